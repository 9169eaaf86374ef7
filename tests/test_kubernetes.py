"""Kubernetes manifests (deploy/kubernetes/, `epd kube render`, `epd plan --emit kubernetes`), offline.

No cluster: each overlay is assembled the way kustomize does (tests/kubecheck.py), validated against
Kubernetes' schemas of a pinned version (kubernetes-validate, strict) and KEDA's vendored CRD, and
held to the deployment policies. Every check has a broken copy it must reject.
"""

from __future__ import annotations

import copy
import re
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared import config
from shared.nats_auth import SERVICE_ROLES
from shared.tools import kubernetes as kube
from shared.tools.bench import plan as bench_plan
from shared.tools.cli import main as epd_main
from shared.tools.config_docs import SECTIONS
from shared.tools.nats_identities import DEPLOYED_ROLES, password_variable
from shared.topology import Service, Topology
from tests import kubecheck as kc

OVERLAYS = [kube.overlay_name(t, a) for t in Topology for a in kube.ACCELERATORS]


def test_committed_manifests_are_what_the_renderer_writes(tmp_path: Path) -> None:
    assert kube.stale_files() == [], "deploy/kubernetes is stale: run `.venv/bin/epd kube render`"
    assert epd_main(["kube", "render", "--check"]) == 0
    # broken copy: one edited file and one missing file are both named
    shutil.copytree(kc.DEPLOY, tmp_path / kube.OUT_DIR)
    edited = tmp_path / kube.OUT_DIR / "e-pd-cpu" / "scaledobjects.yaml"
    edited.write_text(edited.read_text().replace("maxReplicaCount: 8", "maxReplicaCount: 80", 1))
    (tmp_path / kube.OUT_DIR / "base" / "service.yaml").unlink()
    assert sorted(map(str, kube.stale_files(tmp_path))) == ["base/service.yaml", "e-pd-cpu/scaledobjects.yaml"]
    assert epd_main(["kube", "render", "--check", "--root", str(tmp_path)]) == 1
    assert epd_main(["kube", "render", "--root", str(tmp_path)]) == 0
    assert kube.stale_files(tmp_path) == []


def test_one_overlay_per_topology_and_accelerator() -> None:
    assert [p.name for p in kc.overlays()] == sorted(OVERLAYS)


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlay_passes_schemas_and_policies(name: str) -> None:
    objs = kc.kustomize(kc.DEPLOY / name)
    topology = Topology(name.rsplit("-", 1)[0])
    kinds = sorted({o["kind"] for o in objs})
    assert kinds == sorted(
        {"ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "ScaledObject", "Service", "ServiceAccount"}
    )
    deployments = {o["metadata"]["name"] for o in objs if o["kind"] == "Deployment"}
    from shared.topology import TOPOLOGIES

    assert deployments == {kube.deployment_name(s) for s in TOPOLOGIES[topology].services}
    assert all(o["metadata"]["namespace"] == kube.NAMESPACE for o in objs)
    assert kc.tree_problems(kc.DEPLOY / name) == []


def test_secret_example_is_a_valid_secret_with_every_credential() -> None:
    [secret] = kc.load(kc.DEPLOY / "base" / "secret.example.yaml")
    assert kc.schema_problems(secret) == []
    assert set(secret["stringData"]) == {"EPD_API_KEYS", "EPD_S3_ACCESS_KEY", "EPD_S3_SECRET_KEY",
                                         *(password_variable(r) for r in DEPLOYED_ROLES)}  # fmt: skip
    assert "secret.example.yaml" not in (kc.DEPLOY / "base" / "kustomization.yaml").read_text()
    assert kc.secret_problems(secret) == []
    # broken copies: the old shared account back, a role's password missing
    shared = copy.deepcopy(secret)
    shared["stringData"].update(EPD_NATS_USER="CHANGE-ME", EPD_NATS_PASSWORD="CHANGE-ME")
    assert kc.secret_problems(shared) == [
        "Secret: key EPD_NATS_USER is the old shared NATS account",
        "Secret: key EPD_NATS_PASSWORD is the old shared NATS account",
    ]
    missing = copy.deepcopy(secret)
    del missing["stringData"]["NATS_VIEWER_PASSWORD"]
    assert kc.secret_problems(missing) == ["Secret: no key NATS_VIEWER_PASSWORD (role viewer's NATS password)"]


def test_every_setting_is_in_the_configmap_the_secret_or_set_per_pod() -> None:
    settings = {config.env_var(n) for s in SECTIONS for n in s.fields}
    data = kube.settings_data()
    secrets = set(kube.secret_settings())
    assert set(data) | secrets | set(kube.PER_POD) == settings
    assert not set(data) & secrets
    assert data["EPD_STORE_BACKEND"] == "s3" and data["EPD_STREAM_REPLICAS"] == "3"


def test_grace_period_follows_the_drain() -> None:
    objs = kc.kustomize(kc.DEPLOY / "e-p-d-cpu")
    drain = float(kube.settings_data()["EPD_DRAIN_S"])
    for dep in (o for o in objs if o["kind"] == "Deployment"):
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        extra = kube.API_PRESTOP_S if kc._component(dep) == "api" else 0
        assert grace == config.grace_period_s(drain) + extra


# -- schemas: broken copies -------------------------------------------------------------------------
def _objs(name: str = "e-p-d-cpu") -> list[dict[str, Any]]:
    return kc.kustomize(kc.DEPLOY / name)


def _get(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]["containers"][0]


SCHEMA_BREAKS: list[tuple[str, str, str, Callable[[dict[str, Any]], None], str]] = [
    ("unknown field", "Deployment", "epd-decode",
     lambda o: o["spec"]["template"]["spec"].update(terminationGracePeriod=75), "terminationGracePeriod"),
    ("port as a string", "Deployment", "epd-api",
     lambda o: _container(o)["ports"][0].update(containerPort="8000"), "containerPort"),
    ("probe with a misspelt handler", "Deployment", "epd-encoder",
     lambda o: _container(o)["livenessProbe"].update(exec_={"command": ["true"]}), "exec_"),
    ("ports not a list", "Service", "epd-api",
     lambda o: o["spec"].update(ports="8000"), "ports"),
    ("policy type not a list", "NetworkPolicy", "epd-api",
     lambda o: o["spec"].update(policyTypes="Ingress"), "policyTypes"),
    ("PDB with an unknown field", "PodDisruptionBudget", "epd-prefill",
     lambda o: o["spec"].update(maxUnavailables=1), "maxUnavailables"),
    ("KEDA: a threshold as a number", "ScaledObject", "epd-decode",
     lambda o: o["spec"]["triggers"][0]["metadata"].update(lagThreshold=16), "lagThreshold"),
    ("KEDA: unknown spec field", "ScaledObject", "epd-encoder",
     lambda o: o["spec"].update(minReplicas=0), "minReplicas"),
    ("KEDA: no scale target", "ScaledObject", "epd-prefill",
     lambda o: o["spec"].pop("scaleTargetRef"), "scaleTargetRef"),
    ("KEDA: replica count as a string", "ScaledObject", "epd-prefill",
     lambda o: o["spec"].update(maxReplicaCount="8"), "maxReplicaCount"),
]  # fmt: skip


@pytest.mark.parametrize("what,kind,name,breaks,expect", SCHEMA_BREAKS, ids=[b[0] for b in SCHEMA_BREAKS])
def test_schema_rejects_broken_copy(what: str, kind: str, name: str, breaks: Callable, expect: str) -> None:
    obj = copy.deepcopy(_get(_objs(), kind, name))
    assert kc.schema_problems(obj) == []
    breaks(obj)
    problems = kc.schema_problems(obj)
    assert problems and any(expect in p for p in problems), problems


def test_schema_pins_a_kubernetes_version_and_keda_release() -> None:
    # a field of a newer Kubernetes than the pinned one is refused (strict): pod-level resources are 1.32+
    dep = copy.deepcopy(_get(_objs(), "Deployment", "epd-api"))
    dep["spec"]["template"]["spec"]["resources"] = {"requests": {"cpu": "1"}}
    assert kc.schema_problems(dep, "1.31") and not kc.schema_problems(dep, "1.34")
    assert "2.16.1" in kc.KEDA_CRD.read_text().splitlines()[0]


# -- policies: broken copies ------------------------------------------------------------------------
def _set_env(container: dict[str, Any], name: str, value: str) -> None:
    container["env"] = [e for e in container["env"] if e["name"] != name] + [{"name": name, "value": value}]


def _drop(objs: list[dict[str, Any]], kind: str, name: str) -> None:
    objs.remove(_get(objs, kind, name))


def _cm(objs: list[dict[str, Any]]) -> dict[str, str]:
    return _get(objs, "ConfigMap", kube.CONFIGMAP)["data"]


def _trigger(objs: list[dict[str, Any]], name: str, kind: str) -> dict[str, Any]:
    so = _get(objs, "ScaledObject", name)
    return next(t for t in so["spec"]["triggers"] if t["type"] == kind)


DEP = "Deployment"
POLICY_BREAKS: list[tuple[str, Callable[[list[dict[str, Any]]], None], str]] = [
    ("root user", lambda o: _get(o, DEP, "epd-decode")["spec"]["template"]["spec"]["securityContext"].update(
        runAsUser=0), "not non-root"),
    ("runAsNonRoot off", lambda o: _container(_get(o, DEP, "epd-api"))["securityContext"].update(
        runAsNonRoot=False), "not non-root"),
    ("privilege escalation", lambda o: _container(_get(o, DEP, "epd-encoder"))["securityContext"].update(
        allowPrivilegeEscalation=True), "privilege escalation"),
    ("writable root fs", lambda o: _container(_get(o, DEP, "epd-encoder"))["securityContext"].update(
        readOnlyRootFilesystem=False), "writable root filesystem"),
    ("latest image", lambda o: _container(_get(o, DEP, "epd-prefill")).update(image="epd-serve:latest"),
     "not pinned"),
    ("untagged image", lambda o: _container(_get(o, DEP, "epd-prefill")).update(image="registry:5000/epd-serve"),
     "not pinned"),
    ("no readiness probe", lambda o: _container(_get(o, DEP, "epd-decode")).pop("readinessProbe"),
     "readinessProbe"),
    ("probe of another role", lambda o: _container(_get(o, DEP, "epd-decode"))["livenessProbe"]["exec"].update(
        command=["epd", "healthcheck", "--role", "prefill"]), "livenessProbe"),
    ("worker without a heartbeat file", lambda o: _container(_get(o, DEP, "epd-encoder")).update(
        env=[e for e in _container(_get(o, DEP, "epd-encoder"))["env"] if e["name"] != "EPD_HEALTH_FILE"]),
     "EPD_HEALTH_FILE"),
    ("secret setting in the ConfigMap", lambda o: _cm(o).update(EPD_S3_SECRET_KEY="x"), "is a secret"),
    ("secret-looking key in the ConfigMap", lambda o: _cm(o).update(SMTP_PASSWORD="x"), "is a secret"),
    ("credential as a plain value", lambda o: _set_env(_container(_get(o, DEP, "epd-api")), "EPD_NATS_PASSWORD",
                                                       "hunter2"), "does not come from a Secret"),
    ("drain longer than the grace period", lambda o: _cm(o).update(EPD_DRAIN_S="600"),
     "terminationGracePeriodSeconds 75 < EPD_DRAIN_S 600"),
    ("a container's own drain", lambda o: _set_env(_container(_get(o, DEP, "epd-decode")), "EPD_DRAIN_S", "120"),
     "terminationGracePeriodSeconds 75 < EPD_DRAIN_S 120"),
    ("grace period cut", lambda o: _get(o, DEP, "epd-prefill")["spec"]["template"]["spec"].update(
        terminationGracePeriodSeconds=30), "terminationGracePeriodSeconds 30"),
    ("API grace without its preStop pause", lambda o: _get(o, DEP, "epd-api")["spec"]["template"]["spec"].update(
        terminationGracePeriodSeconds=75), "preStop"),
    ("writable model volume", lambda o: _container(_get(o, DEP, "epd-encoder"))["volumeMounts"][0].update(
        readOnly=False), "model volume"),
    ("no resources", lambda o: _container(_get(o, DEP, "epd-decode")).pop("resources"), "requests"),
    ("service account token", lambda o: _get(o, DEP, "epd-api")["spec"]["template"]["spec"].update(
        automountServiceAccountToken=True), "service account token"),
    ("no PodDisruptionBudget", lambda o: _drop(o, "PodDisruptionBudget", "epd-prefill"), "PodDisruptionBudgets"),
    ("worker role without a ScaledObject", lambda o: _drop(o, "ScaledObject", "epd-decode"), "ScaledObjects scale"),
    ("ScaledObject naming no consumer", lambda o: _trigger(o, "epd-decode", "nats-jetstream")["metadata"].update(
        consumer="decoder"), "is no consumer"),
    ("ScaledObject naming no stream", lambda o: _trigger(o, "epd-encoder", "nats-jetstream")["metadata"].update(
        stream="EPD_ENCODER"), "is no consumer"),
    ("another role's consumer", lambda o: _trigger(o, "epd-decode", "nats-jetstream")["metadata"].update(
        stream="EPD_GENERATE", consumer="prefill"), "do not pull"),
    ("ScaledObject of no Deployment", lambda o: _get(o, "ScaledObject", "epd-decode")["spec"][
        "scaleTargetRef"].update(name="epd-decoder"), "no Deployment"),
    ("no cost trigger", lambda o: _get(o, "ScaledObject", "epd-prefill")["spec"].update(
        triggers=[_trigger(o, "epd-prefill", "nats-jetstream")]), "pending_work_seconds"),
    ("cost trigger of another role", lambda o: _trigger(o, "epd-prefill", "prometheus")["metadata"].update(
        query='max(epd:pending_work_seconds{role="decode"})'), "pending_work_seconds"),
    ("decode scaled to zero", lambda o: _get(o, "ScaledObject", "epd-decode")["spec"].update(minReplicaCount=0),
     "scales to zero"),
    ("worker reachable from anywhere", lambda o: _get(o, "NetworkPolicy", "epd-workers")["spec"][
        "ingress"].append({"ports": [{"port": 9100}]}), "reachable from anywhere"),
    ("worker egress to any address", lambda o: _get(o, "NetworkPolicy", "epd-workers")["spec"]["egress"].append(
        {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}), "may reach any address"),
    ("no default deny and no worker policy", lambda o: (_drop(o, "NetworkPolicy", "epd-default-deny"),
                                                       _drop(o, "NetworkPolicy", "epd-workers")),
     "no NetworkPolicy restricts"),
]  # fmt: skip


@pytest.mark.parametrize("what,breaks,expect", POLICY_BREAKS, ids=[b[0] for b in POLICY_BREAKS])
def test_policy_rejects_broken_copy(what: str, breaks: Callable, expect: str) -> None:
    objs = copy.deepcopy(_objs())
    assert kc.policy_problems(objs) == []
    breaks(objs)
    problems = kc.policy_problems(objs)
    assert any(expect in p for p in problems), problems


# -- NATS identities: each Deployment connects as its own role -----------------------------------------
@pytest.mark.parametrize("name", OVERLAYS)
def test_each_deployment_connects_as_its_own_role(name: str) -> None:
    objs = kc.kustomize(kc.DEPLOY / name)
    assert kc.nats_identity_problems(objs) == []
    for dep in (o for o in objs if o["kind"] == DEP):
        role = SERVICE_ROLES[kc._component(dep)].value
        env = kc._env(_container(dep))
        assert env["EPD_NATS_USER"] == {"name": "EPD_NATS_USER", "value": role}
        assert env["EPD_NATS_PASSWORD"]["valueFrom"] == {
            "secretKeyRef": {"name": kube.SECRET, "key": f"NATS_{role.upper()}_PASSWORD"}
        }
        keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in env.values() if "valueFrom" in e}
        assert keys & set(kc.PASSWORD_KEYS) == {f"NATS_{role.upper()}_PASSWORD"}  # no other role's password


def test_no_manifest_reads_the_shared_nats_account() -> None:
    """The Secret's old shared keys EPD_NATS_USER / EPD_NATS_PASSWORD are gone from every file."""
    for path in sorted(kc.DEPLOY.rglob("*.yaml")):
        for doc in kc.load(path):
            refs = [m for m in _walk(doc) if isinstance(m, dict) and "secretKeyRef" in m]
            keys = {r["secretKeyRef"]["key"] for r in refs}
            assert not keys & {"EPD_NATS_USER", "EPD_NATS_PASSWORD"}, (path, keys)
            if doc.get("kind") == "Secret":
                assert not set(doc.get("stringData") or {}) & {"EPD_NATS_USER", "EPD_NATS_PASSWORD"}, path


def _walk(node: Any) -> Any:
    yield node
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
    for child in children:
        yield from _walk(child)


def _set_env_from(container: dict[str, Any], name: str, key: str, secret: str = kube.SECRET) -> None:
    ref = {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
    container["env"] = [e for e in container["env"] if e["name"] != name] + [ref]


def _job(env: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "epd-setup"},
            "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [
                {"name": "setup", "image": "epd-serve:0.1.0-cpu", "env": env}]}}}}  # fmt: skip


def _as_api(container: dict[str, Any]) -> None:
    _set_env(container, "EPD_NATS_USER", "api")
    _set_env_from(container, "EPD_NATS_PASSWORD", "NATS_API_PASSWORD")


_SHARED_ACCOUNT = [
    {"name": "EPD_NATS_USER", "valueFrom": {"secretKeyRef": {"name": kube.SECRET, "key": "EPD_NATS_USER"}}},
    {"name": "EPD_NATS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": kube.SECRET, "key": "EPD_NATS_PASSWORD"}}},
]
IDENTITY_BREAKS: list[tuple[str, Callable[[list[dict[str, Any]]], object], list[str]]] = [
    ("a worker given the api user", lambda o: _set_env(_container(_get(o, DEP, "epd-decode")), "EPD_NATS_USER",
                                                       "api"),
     ["Deployment/epd-decode/decode: EPD_NATS_USER='api', expected its role 'decode' (a literal)"]),
    ("a worker given the api user and password", lambda o: _as_api(_container(_get(o, DEP, "epd-encoder"))),
     ["Deployment/epd-encoder/encoder: EPD_NATS_USER='api', expected its role 'encoder' (a literal)",
      "Deployment/epd-encoder/encoder: EPD_NATS_PASSWORD reads {'name': 'epd-credentials', 'key': "
      "'NATS_API_PASSWORD'}, not its role's key NATS_ENCODER_PASSWORD of Secret epd-credentials",
      "Deployment/epd-encoder/encoder: is handed other roles' NATS passwords ['NATS_API_PASSWORD']"]),
    ("a shared password key", lambda o: _set_env_from(_container(_get(o, DEP, "epd-prefill")), "EPD_NATS_PASSWORD",
                                                      "EPD_NATS_PASSWORD"),
     ["Deployment/epd-prefill/prefill: EPD_NATS_PASSWORD reads the shared key EPD_NATS_PASSWORD of Secret "
      "epd-credentials (one NATS account for every role)",
      "Deployment/epd-prefill/prefill: EPD_NATS_PASSWORD reads {'name': 'epd-credentials', 'key': "
      "'EPD_NATS_PASSWORD'}, not its role's key NATS_PREFILL_PASSWORD of Secret epd-credentials"]),
    ("the old shared account", lambda o: _container(_get(o, DEP, "epd-api")).update(env=[
        e for e in _container(_get(o, DEP, "epd-api"))["env"] if not e["name"].startswith("EPD_NATS_")
    ] + _SHARED_ACCOUNT),
     ["Deployment/epd-api/api: EPD_NATS_USER reads the shared key EPD_NATS_USER of Secret epd-credentials (one "
      "NATS account for every role)",
      "Deployment/epd-api/api: EPD_NATS_PASSWORD reads the shared key EPD_NATS_PASSWORD of Secret epd-credentials "
      "(one NATS account for every role)",
      "Deployment/epd-api/api: EPD_NATS_USER=\"(from secretKeyRef {'name': 'epd-credentials', 'key': "
      "'EPD_NATS_USER'})\", expected its role 'api' (a literal)",
      "Deployment/epd-api/api: EPD_NATS_PASSWORD reads {'name': 'epd-credentials', 'key': 'EPD_NATS_PASSWORD'}, "
      "not its role's key NATS_API_PASSWORD of Secret epd-credentials"]),
    ("a worker without an identity", lambda o: _container(_get(o, DEP, "epd-decode")).update(env=[
        e for e in _container(_get(o, DEP, "epd-decode"))["env"] if not e["name"].startswith("EPD_NATS_")]),
     ["Deployment/epd-decode/decode: EPD_NATS_USER=None, expected its role 'decode' (a literal)",
      "Deployment/epd-decode/decode: EPD_NATS_PASSWORD reads None, not its role's key NATS_DECODE_PASSWORD of "
      "Secret epd-credentials"]),
    ("the whole Secret as env", lambda o: _container(_get(o, DEP, "epd-api"))["envFrom"].append(
        {"secretRef": {"name": kube.SECRET}}),
     ["Deployment/epd-api/api: reads the whole Secret epd-credentials (envFrom: every role's NATS password)"]),
    ("a Job on the shared account", lambda o: o.append(_job(_SHARED_ACCOUNT)),
     ["Job/epd-setup/setup: EPD_NATS_USER reads the shared key EPD_NATS_USER of Secret epd-credentials (one NATS "
      "account for every role)",
      "Job/epd-setup/setup: EPD_NATS_PASSWORD reads the shared key EPD_NATS_PASSWORD of Secret epd-credentials "
      "(one NATS account for every role)",
      "Job/epd-setup/setup: EPD_NATS_USER=\"(from secretKeyRef {'name': 'epd-credentials', 'key': "
      "'EPD_NATS_USER'})\" is no deployed NATS role"]),
    ("a Job as admin with the api's password", lambda o: o.append(_job([
        {"name": "EPD_NATS_USER", "value": "admin"},
        {"name": "EPD_NATS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": kube.SECRET,
                                                                     "key": "NATS_API_PASSWORD"}}}])),
     ["Job/epd-setup/setup: EPD_NATS_PASSWORD reads {'name': 'epd-credentials', 'key': 'NATS_API_PASSWORD'}, not "
      "its role's key NATS_ADMIN_PASSWORD of Secret epd-credentials",
      "Job/epd-setup/setup: is handed other roles' NATS passwords ['NATS_API_PASSWORD']"]),
]  # fmt: skip


@pytest.mark.parametrize("what,breaks,expect", IDENTITY_BREAKS, ids=[b[0] for b in IDENTITY_BREAKS])
def test_identity_check_rejects_broken_copy(what: str, breaks: Callable, expect: list[str]) -> None:
    objs = copy.deepcopy(_objs())
    assert kc.nats_identity_problems(objs) == []
    breaks(objs)
    assert kc.nats_identity_problems(objs) == expect
    assert set(expect) <= set(kc.policy_problems(objs))  # part of every overlay's policy check


def test_a_job_with_its_own_role_passes() -> None:
    objs = _objs()
    objs.append(_job([{"name": "EPD_NATS_USER", "value": "admin"}, {"name": "EPD_NATS_PASSWORD", "valueFrom": {
        "secretKeyRef": {"name": kube.SECRET, "key": "NATS_ADMIN_PASSWORD"}}}]))  # fmt: skip
    assert kc.nats_identity_problems(objs) == []


# -- the NATS chart's values ---------------------------------------------------------------------------
def _nats_values() -> dict[str, Any]:
    [values] = kc.load(kc.DEPLOY / kube.NATS_VALUES)
    return values


def test_nats_values_know_every_role_with_its_permissions() -> None:
    values = _nats_values()
    assert values == kube.nats_values()
    assert kc.nats_values_problems(values) == []
    users = values["config"]["merge"]["authorization"]["users"]
    assert [u["user"] for u in users] == [r.value for r in DEPLOYED_ROLES]
    assert users[1]["password"] == "<< $NATS_ENCODER_PASSWORD >>"
    # the server reads every role's password from the Secret: the keys secret.example.yaml lists
    [secret] = kc.load(kc.DEPLOY / "base" / "secret.example.yaml")
    env = values["container"]["env"]
    assert {e["valueFrom"]["secretKeyRef"]["key"] for e in env.values()} == set(kc.PASSWORD_KEYS)
    assert set(kc.PASSWORD_KEYS) <= set(secret["stringData"])


def _users(values: dict[str, Any]) -> list[dict[str, Any]]:
    return values["config"]["merge"]["authorization"]["users"]


NATS_VALUES_BREAKS: list[tuple[str, Callable[[dict[str, Any]], object], str]] = [
    ("the old shared user", lambda v: v["config"]["merge"]["authorization"].update(
        user="<< $EPD_NATS_USER >>", password="<< $EPD_NATS_PASSWORD >>"), "besides the per-role users"),
    ("a role missing", lambda v: _users(v).pop(), "expected one per deployed role"),
    ("a user without permissions", lambda v: _users(v)[2].pop("permissions"),
     "user prefill: permissions differ"),
    ("a worker with the api's permissions", lambda v: _users(v)[3].update(permissions=_users(v)[0]["permissions"]),
     "user decode: permissions differ"),
    ("a literal password", lambda v: _users(v)[0].update(password="hunter2"), "user api: password 'hunter2'"),
    ("a password not from the Secret", lambda v: v["container"]["env"].update(NATS_ADMIN_PASSWORD="hunter2"),
     "NATS container: NATS_ADMIN_PASSWORD"),
]  # fmt: skip


@pytest.mark.parametrize("what,breaks,expect", NATS_VALUES_BREAKS, ids=[b[0] for b in NATS_VALUES_BREAKS])
def test_nats_values_check_rejects_broken_copy(what: str, breaks: Callable, expect: str) -> None:
    values = copy.deepcopy(_nats_values())
    breaks(values)
    problems = kc.nats_values_problems(values)
    assert any(expect in p for p in problems), problems


# -- docs/kubernetes.md: the chart values and the Secret's command --------------------------------------
DOC = kc.ROOT / "docs" / "kubernetes.md"


def _doc_nats_values(text: str) -> dict[str, Any]:
    """The NATS chart values block of docs/kubernetes.md (the fenced yaml block with ``authorization``)."""

    blocks = [textwrap.dedent(b) for b in re.findall(r"^ *```yaml\n(.*?)^ *```$", text, flags=re.S | re.M)]
    [block] = [b for b in blocks if "authorization:" in b]
    return yaml.safe_load(block)


def _without_permissions(values: dict[str, Any]) -> dict[str, Any]:
    values = copy.deepcopy(values)
    for user in _users(values):
        user.pop("permissions", None)
    return values


def test_docs_nats_values_are_the_generated_ones() -> None:
    """The docs show the generated values less each user's permissions (400+ lines: they are in
    deploy/kubernetes/nats-values.yaml, which the docs install); users, passwords and the Secret's keys
    cannot drift from shared/nats_auth.py and shared/tools/nats_identities.py."""
    text = DOC.read_text()
    assert _doc_nats_values(text) == _without_permissions(kube.nats_values())
    assert "-f deploy/kubernetes/nats-values.yaml" in text
    # broken copies: a role dropped from the docs, the old shared account
    dropped = re.sub(r"\n *- user: viewer\n *password: << \$NATS_VIEWER_PASSWORD >>", "", text)
    assert dropped != text and _doc_nats_values(dropped) != _without_permissions(kube.nats_values())
    shared = text.replace("key: NATS_API_PASSWORD", "key: EPD_NATS_PASSWORD")
    assert shared != text and _doc_nats_values(shared) != _without_permissions(kube.nats_values())


def test_docs_create_the_secret_with_every_key(tmp_path: Path) -> None:
    """The docs' command is kube.secret_command(); run with a stand-in kubectl, it creates every key of
    secret.example.yaml, each NATS password random and different."""
    import os
    import subprocess

    command = kube.secret_command()
    assert command in DOC.read_text()
    if shutil.which("openssl") is None:
        pytest.skip("no openssl")
    fake = tmp_path / "kubectl"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, check=True).stdout
    args = out.splitlines()
    assert args[:5] == ["-n", "epd", "create", "secret", "generic"] and args[5] == kube.SECRET
    literals = dict(a.removeprefix("--from-literal=").split("=", 1) for a in args[6:])
    [secret] = kc.load(kc.DEPLOY / "base" / "secret.example.yaml")
    assert list(literals) == list(secret["stringData"]) == kube.secret_keys()
    passwords = [literals[k] for k in kc.PASSWORD_KEYS]
    assert len(set(passwords)) == len(passwords) and all(len(p) == 48 for p in passwords)


def test_scaledobjects_name_the_consumers_the_workers_bind() -> None:
    objs = _objs()
    known = kc.consumers(objs)
    assert known == {"EPD_ENCODE": {"encoder"}, "EPD_GENERATE": {"prefill"}, "EPD_DECODE": {"decode"}}
    # another subject prefix renames the streams: the committed triggers no longer name real ones
    _cm(objs)["EPD_SUBJECT_PREFIX"] = "tenant-a"
    assert any("is no consumer" in p for p in kc.policy_problems(objs))


# -- epd plan --emit kubernetes ---------------------------------------------------------------------
def test_scaling_from_plan() -> None:
    s = kube.scaling_from_plan("encoder", workers=3, jobs_per_s=10, wait_s=0.5)
    assert (s.min_replicas, s.max_replicas, s.work_threshold_s) == (0, 3, 0.5)
    assert s.lag_threshold == kube.in_flight(Service.ENCODER) + 2  # ceil(10 x 0.5 / 3)
    d = kube.scaling_from_plan("pd", workers=20, jobs_per_s=10, wait_s=1.58)
    assert (d.min_replicas, d.max_replicas, d.lag_threshold) == (1, 20, kube.in_flight(Service.PREFILL) + 1)


def test_plan_emits_a_valid_overlay_with_its_bounds(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["plan", "--costs", "encode=0.2,prefill=0.3,decode=0.02", "--rate", "10", "--images", "1",
            "--output-tokens", "64", "--slo", "ttft=2000", "--topology", "e-p-d", "--json"]  # fmt: skip
    assert epd_main([*args, "--emit", "kubernetes", str(tmp_path), "--accelerator", "gpu"]) == 0
    import json

    [plan] = json.loads(capsys.readouterr().out)
    folder = tmp_path / "e-p-d-gpu"
    assert kc.tree_problems(folder) == []
    objs = kc.kustomize(folder)
    counts = {r["role"]: r["workers"] for r in plan["roles"]}
    for role, workers in counts.items():
        so = _get(objs, "ScaledObject", f"epd-{role}")
        assert so["spec"]["maxReplicaCount"] == workers
        assert so["spec"]["minReplicaCount"] == (0 if role == "encoder" else 1)
    # the encoder's share of TTFT 2000 ms: 2000 x 0.2 / 0.5 = 800 ms, less its 200 ms service
    assert _trigger(objs, "epd-encoder", "prometheus")["metadata"]["threshold"] == "0.6"
    # the rest of the overlay is the committed one (GPU image, the plan's topology)
    assert _container(_get(objs, DEP, "epd-decode"))["image"].endswith("-cuda")
    # broken copy: an overlay whose patch names an object the base lacks is refused
    (folder / "scaledobject-decode.yaml").write_text(
        (folder / "scaledobject-decode.yaml").read_text().replace("name: epd-decode\n", "name: epd-decoder\n", 1)
    )
    with pytest.raises(ValueError, match="matches no object"):
        kc.kustomize(folder)
    assert epd_main([*args, "--emit", "helm", str(tmp_path)]) == bench_plan.EXIT_ERROR
