"""The observability profile for real, in ``make test-compose`` (where Docker Compose v2 and a
Prometheus binary are installed first; ``tests/test_observability.py`` has the static checks that
``make test`` runs): ``docker compose config`` accepts the profile, and a real Prometheus scrapes a
running stack with ``deploy/observability/prometheus.yml``'s jobs and evaluates every dashboard
query. No Prometheus or Grafana image can be pulled here, so their containers are not started."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.parse

import yaml

from tests import deploycheck as dc
from tests.test_deploy import OBSERVABILITY, TEST_SECRETS, env_example_values
from tests.test_observability import DASHBOARD, PROMETHEUS_YML, job_of, panel_targets


# -- docker compose -------------------------------------------------------------------------------
def compose_cli() -> list[str]:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        probe = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True)
        major = probe.stdout.strip().lstrip("v").split(".")[0]
        if probe.returncode == 0 and major.isdigit() and int(major) >= 2:  # 1.x cannot read docker-compose.yml
            return cmd
    raise AssertionError("no Docker Compose v2 here: make test-compose installs it (tests/compose/ensure-docker.sh)")


def test_docker_compose_accepts_the_observability_profile(tmp_path):
    cmd = compose_cli()
    env_file = tmp_path / ".env"
    values = {**env_example_values(), **TEST_SECRETS}
    values.pop("COMPOSE_PROFILES", None)  # the profiles come from the flags only
    env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    base = [*cmd, "--project-directory", str(dc.ROOT), "-f", str(dc.COMPOSE_PATH), "--env-file", str(env_file)]

    def services(*profiles: str) -> set[str]:
        args = [a for p in profiles for a in ("--profile", p)]
        out = subprocess.run([*base, *args, "config", "--services"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return set(out.stdout.split())

    assert not services("e-pd") & OBSERVABILITY
    assert services("e-pd", "observability") >= OBSERVABILITY | {"api", "encoder", "prefill"}
    full = subprocess.run(
        [*base, "--profile", "observability", "config", "--format", "json"], capture_output=True, text=True, timeout=60
    )
    assert full.returncode == 0, full.stderr
    model = json.loads(full.stdout)["services"]
    assert model["prometheus"]["environment"]["EPD_API_KEYS"] == TEST_SECRETS["EPD_API_KEYS"]
    # Compose left the shell's own expansion to the shell ($$ -> $).
    assert "${EPD_API_KEYS%%,*}" in " ".join(model["prometheus"]["command"])


# -- a real Prometheus (Debian's, installed by tests/compose/ensure-prometheus.sh) -----------------
PROMETHEUS = os.environ.get("PROMETHEUS_BIN") or shutil.which("prometheus")


def test_prometheus_scrapes_the_stack_and_evaluates_every_dashboard_query(epd_stack, tmp_path):
    """deploy/observability/prometheus.yml's jobs, with the compose DNS names replaced by this
    stack's API and prefill worker, run in a real Prometheus; after one request every dashboard
    query evaluates without error, and every system panel (job="epd-api") has data. (The vLLM
    engine panels stay empty with the transformers engine.)"""
    import httpx

    from shared.tools.infra import free_port
    from tests.stackutil import data_url, noise_image, user_message, wait_for

    assert PROMETHEUS, "no prometheus binary (PATH or PROMETHEUS_BIN): make test-compose installs one"
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    api = urllib.parse.urlsplit(epd_stack.url).netloc
    targets = {"epd-api": api, "epd-workers": f"127.0.0.1:{epd_stack.prefill_metrics_port}"}
    services = {"epd-api": "api", "epd-workers": "prefill"}
    for job in config["scrape_configs"]:
        job.pop("dns_sd_configs")
        job.pop("relabel_configs")
        name = job["job_name"]
        job["static_configs"] = [{"targets": [targets[name]], "labels": {"service": services[name]}}]
        if job.get("scheme") == "https":  # the test stack's API serves plain http (Compose's: its certificate)
            assert job.pop("tls_config")["ca_file"] == "/tls/ca.crt"
            job["scheme"] = "http"
        if "authorization" in job:  # the test stack has no API keys: any token is ignored
            (tmp_path / "key").write_text("unused")
            job["authorization"]["credentials_file"] = str(tmp_path / "key")
    config["global"]["scrape_interval"] = "1s"
    config["global"]["scrape_timeout"] = "1s"
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}/api/v1"
    try:

        def up() -> bool:
            try:
                active = httpx.get(f"{base}/targets", timeout=5).json()["data"]["activeTargets"]
            except (httpx.HTTPError, ValueError):
                return False
            return len(active) == 2 and all(t["health"] == "up" for t in active)

        wait_for(up, 60, "Prometheus to scrape the API and the worker")
        msgs = [user_message("Describe the image.", [data_url(noise_image(4201, (56, 56)))])]
        resp = epd_stack.chat(msgs, temperature=0, max_tokens=6, ignore_eos=True)
        assert resp.status_code == 200, resp.text

        def query(expr: str) -> list:
            expr = expr.replace("$__rate_interval", "1m").replace("$model_name", ".*")
            body = httpx.get(f"{base}/query", params={"query": expr}, timeout=10).json()
            assert body["status"] == "success", (expr, body)
            return body["data"]["result"]

        def scraped_the_request() -> bool:
            result = query('sum(vllm:request_success_total{job="epd-api", finished_reason="length"})')
            return bool(result) and float(result[0]["value"][1]) >= 1

        wait_for(scraped_the_request, 60, "the request in Prometheus")
        targets = panel_targets(json.loads(DASHBOARD.read_text()))

        def empty_system_panels() -> list[tuple[str, str]]:
            # every query evaluates (query() asserts it); the system panels (the API's series) have
            # data once two scrapes hold a series (a counter child appears at its first increment)
            return [(title, expr) for title, expr in targets if not query(expr) and job_of(expr) == "epd-api"]

        try:
            wait_for(lambda: not empty_system_panels(), 30, "every system panel to have data")
        except AssertionError:
            assert empty_system_panels() == []
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
