"""Fixtures of the multi-host tests (``make test-multihost``, root only): one lab of network
namespaces and one site (NATS cluster, SeaweedFS, E|PD services) per module, reused by every case;
each case restores what it broke. The results file's path is printed at the end of the run."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from tests.multihost.lab import Lab, sweep_stale
from tests.multihost.load import Reference, Results
from tests.multihost.site import Site

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
RESULTS_ENV = "MULTIHOST_RESULTS"
#: Settings every service of the site gets on top of the cluster's (site.Site._service_env).
SITE_SETTINGS = {
    # (the ack wait is the default, 4 s: a lost host's jobs come back within it, and the cases count
    # every job run twice - a worker on a stalled node keeps its job: docs/scaling-out.md)
    # a request stuck in an outage ends (504) within the case
    "EPD_REQUEST_TIMEOUT_S": "60",
}

_results: Results | None = None


def results_path() -> Path:
    return Path(os.environ.get(RESULTS_ENV) or REPO / "var" / "multihost" / "results.json")


@pytest.fixture(scope="session")
def results() -> Results:
    global _results
    if _results is None:
        _results = Results(results_path())
    return _results


@pytest.fixture(scope="session")
def lab():
    if os.geteuid() != 0:
        pytest.fail("the multi-host tests make network namespaces: run them as root (make test-multihost)")
    sweep_stale()
    lab = Lab()
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope="module")
def site(lab, tiny_model_dir, tmp_path_factory, results):
    t0 = time.monotonic()
    site = Site(lab, tmp_path_factory.mktemp("multihost"), tiny_model_dir, settings=dict(SITE_SETTINGS))
    try:
        site.start()
        results.meta["site_start_s"] = round(time.monotonic() - t0, 1)
        results.meta["hosts"] = {name: h.address for name, h in lab.hosts.items()}
        results.meta["logs"] = str(site.data_dir)
        log.warning("multi-host site ready in %.1fs, logs under %s", time.monotonic() - t0, site.data_dir)
        yield site
    finally:
        site.stop()


@pytest.fixture(scope="module")
def reference(reference_engine) -> Reference:
    return Reference(reference_engine)


def pytest_terminal_summary(terminalreporter) -> None:
    if _results is not None and _results.cases:
        terminalreporter.write_line(f"multi-host results: {_results.path} and {_results.path.with_suffix('.md')}")
