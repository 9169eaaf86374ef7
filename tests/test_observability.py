"""The observability profile: deploy/observability (Prometheus scrape config, Grafana provisioning
and dashboard) agrees with docker-compose.yml and with the metrics the code exports.

No Prometheus or Grafana image can be pulled or built here (no registry), so the files are checked
statically: the scrape targets are the compose services and ports, every metric the dashboard's
PromQL names is one the processes export (``shared.metrics``' registry; vLLM's own per-engine
metrics from vLLM's source), and ``docker compose config`` accepts the profile where the Compose
binary is installed. ``tests/test_vllm_metrics.py`` checks the dashboard's API metrics against
the /metrics of a running stack."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

from shared import metrics
from tests import deploycheck as dc
from tests.test_deploy import APPS, OBSERVABILITY
from tests.test_vllm_metrics import vllm_metric_docs

OBS = dc.ROOT / "deploy" / "observability"
PROMETHEUS_YML = OBS / "prometheus.yml"
DASHBOARD = OBS / "grafana" / "dashboards" / "epd-serve.json"
DATASOURCES = OBS / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = OBS / "grafana" / "provisioning" / "dashboards" / "epd-serve.yml"
#: the vllm:* of the whole system that dashboards and autoscalers read (issue 24, item 5)
REQUIRED = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
}
_NAME = re.compile(r"\b(?:epd|vllm):[A-Za-z0-9_:]+")
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
}


@pytest.fixture(scope="module")
def compose() -> dict:
    return dc.load_compose()


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_targets(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query, rows' nested panels included."""
    out = []
    for panel in dashboard["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            out += [(p["title"], t["expr"]) for t in p.get("targets", [])]
    return out


def job_of(expr: str) -> str | None:
    jobs = set(re.findall(r'job="([^"]+)"', expr))
    assert len(jobs) <= 1, expr
    return jobs.pop() if jobs else None


def exported_samples(families: dict[str, str]) -> set[str]:
    """Sample names of metric ``families`` (name -> type), prometheus_client style."""
    out = set()
    for name, kind in families.items():
        base = name.removesuffix("_total") if kind == "counter" else name
        out |= {base + suffix for suffix in _SUFFIXES[kind]}
    return out


def our_families() -> dict[str, str]:
    """Every metric family of ``shared.metrics`` (epd:* in every process, vllm:* the API's)."""
    metrics.ApiRequestMetrics("dashboard-check")  # registers the API's vllm:* collectors
    return {f.name: f.type for f in REGISTRY.collect() if f.name.startswith(("epd:", "vllm:"))}


def vllm_engine_samples() -> set[str]:
    """Sample names of vLLM's own per-engine metrics (workers with EPD_ENGINE=vllm)."""
    kinds = {}
    for name in vllm_metric_docs():
        kinds[name] = "histogram" if name.endswith("_seconds") or "request_" in name else "gauge"
    # vLLM's counters are declared without _total; its gauges and histograms by name: accept all forms.
    return {n + s for n in kinds for s in ("", "_total", "_bucket", "_sum", "_count")}


def unknown_metrics(targets: list[tuple[str, str]], ours: set[str], engine: set[str]) -> list[str]:
    """Metric names in ``targets`` that no process exports: epd:* and the API's vllm:* from
    ``shared.metrics``; vllm:* on the workers (job="epd-workers") may also be vLLM's own."""
    problems = []
    for title, expr in targets:
        for name in _NAME.findall(expr):
            allowed = ours | engine if name.startswith("vllm:") and job_of(expr) == "epd-workers" else ours
            if name not in allowed:
                problems.append(f"{title}: {name}")
    return problems


# -- Prometheus -----------------------------------------------------------------------------------
def test_prometheus_scrapes_the_api_and_every_worker_of_every_profile(compose):
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"epd-api", "epd-workers"}
    services = compose["services"]

    def dns(job: str) -> tuple[set[str], set[int]]:
        sd = jobs[job]["dns_sd_configs"]
        return {n for c in sd for n in c["names"]}, {c["port"] for c in sd}

    apis = {n for n, spec in APPS.items() if spec.health_role == "api"}
    workers = set(APPS) - apis
    api_names, api_ports = dns("epd-api")
    worker_names, worker_ports = dns("epd-workers")
    assert api_names == apis and worker_names == workers
    assert api_ports == {int(dc.environment(services[n])["EPD_PORT"]) for n in apis}
    assert worker_ports == {int(dc.environment(services[n])["EPD_METRICS_PORT"]) for n in workers}
    for job in jobs.values():
        assert job.get("metrics_path", "/metrics") == "/metrics"
        assert {"source_labels": ["__meta_dns_name"], "target_label": "service"} in job["relabel_configs"]

    # The API's /metrics needs a key (unless EPD_METRICS_PUBLIC): the container writes the first
    # key of EPD_API_KEYS where the config reads it, and runs Prometheus with this config.
    prom = services["prometheus"]
    script = prom["command"][0]
    key_file = jobs["epd-api"]["authorization"]["credentials_file"]
    assert jobs["epd-api"]["authorization"].get("type", "Bearer") == "Bearer"
    assert f"> {key_file}" in script and "${EPD_API_KEYS%%,*}" in dc.resolve(script, {})
    mount = next(v for v in prom["volumes"] if v.startswith("./deploy/observability/prometheus.yml:"))
    assert f"--config.file={mount.split(':')[1]}" in script
    assert Path(key_file).parent.as_posix() in prom["tmpfs"]
    # The shell sees the first key, trimmed: run the script's key line with compose's environment.
    line = next(ln for ln in script.splitlines() if key_file in ln)
    resolved = dc.interpolate(line, {}).replace(key_file, "/dev/stdout")
    env = {"EPD_API_KEYS": " sk-first , sk-second", "PATH": "/usr/bin:/bin"}
    assert subprocess.run(["sh", "-c", resolved], env=env, capture_output=True, text=True).stdout == "sk-first"


def test_observability_services_are_pinned_healthy_and_only_in_their_profile(compose):
    services = compose["services"]
    for name in OBSERVABILITY:
        svc = services[name]
        assert svc["profiles"] == ["observability"], name
        assert re.fullmatch(r"[a-z0-9./_-]+:v?\d+\.\d+\.\d+", svc["image"]), svc["image"]
        assert svc["healthcheck"]["test"][:2] == ["CMD", "wget"], name
        assert all(p.startswith("127.0.0.1:") for p in svc["ports"]), name  # loopback only
    assert services["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}
    # Nothing else depends on them: the topology profiles run without them.
    for name, svc in services.items():
        if name not in OBSERVABILITY:
            assert not set(svc.get("depends_on") or {}) & OBSERVABILITY, name


# -- Grafana --------------------------------------------------------------------------------------
def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard(compose, dashboard):
    grafana = compose["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"] if v.startswith("./"))
    assert mounts["./deploy/observability/grafana/provisioning"] == "/etc/grafana/provisioning"
    dash_dir = mounts["./deploy/observability/grafana/dashboards"]

    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    prom_port = compose["services"]["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert source["type"] == "prometheus" and source["url"] == f"http://prometheus:{prom_port}"
    (provider,) = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == dash_dir
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dash_dir}/{DASHBOARD.name}"

    # Every panel and query uses the datasource variable, whose default is the provisioned one.
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == source["uid"]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_dashboard_queries_name_only_exported_metrics(dashboard):
    targets = panel_targets(dashboard)
    ours, engine = exported_samples(our_families()), vllm_engine_samples()
    assert unknown_metrics(targets, ours, engine) == []
    named = {name for _, expr in targets for name in _NAME.findall(expr)}
    assert named >= REQUIRED
    # The system view reads the API's series only: the workers' vLLM engines export the same names.
    for title, expr in targets:
        if "vllm:" in expr:
            assert job_of(expr) in ("epd-api", "epd-workers"), title
    # Negative controls: a misspelt metric, and an API panel naming an engine-only vLLM metric.
    assert unknown_metrics([("t", 'rate(vllm:request_sucess_total{job="epd-api"}[1m])')], ours, engine) == [
        "t: vllm:request_sucess_total"
    ]
    assert "vllm:kv_cache_usage_perc" in engine
    assert unknown_metrics([("t", 'vllm:kv_cache_usage_perc{job="epd-api"}')], ours, engine) == [
        "t: vllm:kv_cache_usage_perc"
    ]


def test_dashboard_shows_latency_quantiles_rates_and_stages(dashboard):
    exprs = " ".join(expr for _, expr in panel_targets(dashboard))
    for metric in ("time_to_first_token", "request_time_per_output_token", "e2e_request_latency"):
        for q in ("0.5", "0.95", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(vllm:{metric}_seconds_bucket" in exprs, (metric, q)
    assert "sum by (finished_reason) (rate(vllm:request_success_total" in exprs
    for stage in ("epd:queue_time_seconds_bucket", "epd:encode_seconds_bucket", "epd:kv_handoffs_total"):
        assert stage in exprs
