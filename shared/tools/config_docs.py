"""``epd config docs [--check]``: docs/configuration.md and .env.example, generated from shared/config.py.

The settings classes are the one source: each field's type, default and description (an attribute
docstring or ``Field(description=...)``) become a row of the configuration reference and a line of
.env.example. ``--check`` writes nothing and exits 1 naming every file that differs from what would be
generated (the test suite runs the same comparison).
"""

from __future__ import annotations

import argparse
import enum
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from shared import config
from shared.topology import PREFILL_SERVICE_ROLES

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DOC = Path("docs/configuration.md")
ENV_EXAMPLE = Path(".env.example")
COMPOSE_FILE = Path("docker-compose.yml")

CLI = "the `epd` CLI (`epd replay`, `epd ec`, `epd plan --from-streams`)"


class Section(typing.NamedTuple):
    """One table of the reference: a settings group, or the fields a service class declares itself."""

    cls: type[BaseSettings]
    title: str
    #: who reads it (derived from the service classes that hold the group or inherit the class)
    readers: str
    fields: dict[str, FieldInfo]


def _readers(has: typing.Callable[[type[config.ServiceSettings]], bool]) -> str:
    services = [name for name, cls in config.SERVICE_SETTINGS.items() if has(cls)]
    tools = [CLI] if has(config.ToolSettings) else []
    return "; ".join(part for part in (", ".join(services), *tools) if part)


def _group(cls: type[config.SettingsGroup], title: str, note: str = "") -> Section:
    readers = _readers(lambda svc: cls in svc.groups().values()) + note
    return Section(cls, title, readers, dict(cls.model_fields))


def _own(cls: type[config.ServiceSettings], title: str, note: str = "") -> Section:
    """The plain settings ``cls`` declares (not its groups, not those it inherits)."""
    inherited = {name for base in cls.__mro__[1:] for name in getattr(base, "model_fields", {})}
    fields = {n: f for n, f in cls.model_fields.items() if n not in inherited and config.group_type(f) is None}
    readers = _readers(lambda svc: issubclass(svc, cls)) + note
    return Section(cls, title, readers, fields)


# The reference's tables, in order: the groups (each read by the services that hold it), then each
# service class's own settings.
SECTIONS: tuple[Section, ...] = (
    _own(config.ServiceSettings, "Every process"),
    _group(config.NatsSettings, "NATS and JetStream"),
    _group(config.StoreSettings, "Object store", " (and the vLLM connectors, through their extra config)"),
    _group(config.ModelSettings, "Model"),
    _group(config.MediaSettings, "Image limits"),
    _own(config.ApiSettings, "API"),
    _group(config.JanitorSettings, "EC janitor"),
    _group(config.EngineSettings, "Engine runtime"),
    _own(config.WorkerSettings, "Every worker"),
    _own(config.EncoderSettings, "Encoder"),
    _own(config.PrefillSettings, "Prefill", " (roles `pd`, `prefill`, `agg`)"),
    _own(config.DecodeSettings, "Decode (E|P|D)"),
)
# Values a validator narrows further than the annotation says.
CHOICES = {"role": [r.value for r in PREFILL_SERVICE_ROLES]}

# Secrets: .env.example never carries a value for them (compose refuses to start until they are set).
SECRET_VARS = ("EPD_API_KEYS", "EPD_NATS_PASSWORD", "EPD_S3_ACCESS_KEY", "EPD_S3_SECRET_KEY")
# Compose-side defaults that differ from shared/config.py on purpose (container network, mount point).
COMPOSE_DEFAULTS = {
    "EPD_NATS_URL": "tls://nats:4222",
    "EPD_S3_ENDPOINT": "minio:9000",
    "EPD_MODEL_NAME": "qwen2-vl-shapes",
    # TLS on every link: the certificates the one-shot `certs` makes (volumes tls and api-tls)
    "EPD_NATS_TLS_CA": "/tls/ca.crt",
    "EPD_S3_SECURE": "true",
    "EPD_S3_TLS_CA": "/tls/ca.crt",
    "EPD_TLS_CERT": "/api-tls/api.crt",
    "EPD_TLS_KEY": "/api-tls/api.key",
    "EPD_TLS_CA": "/tls/ca.crt",
}
# Variables docker-compose.yml reads that are no setting of the services.
COMPOSE_ONLY = (
    (
        "COMPOSE_PROFILES",
        "`e-pd` (in .env.example)",
        ("topology and hardware: `e-pd`, `e-p-d`, `gpu-e-pd`, `gpu-e-p-d` (one at a time)"),
    ),
    (
        "EPD_MODEL_DIR",
        "`./shared/tools/models/qwen2-vl-shapes`",
        "host model folder, mounted read-only at `/models/model` (default: the demo model shipped in the repository)",
    ),
    (
        "MINIO_ROOT_USER` / `MINIO_ROOT_PASSWORD",
        "required",
        ("MinIO root account (used by `minio` and `minio-init` only, never by the services)"),
    ),
    (
        "NATS_API_PASSWORD`, `NATS_ENCODER_PASSWORD`, `NATS_PREFILL_PASSWORD`, `NATS_DECODE_PASSWORD`,"
        " `NATS_VIEWER_PASSWORD`, `NATS_ADMIN_PASSWORD",
        "required",
        (
            "one NATS identity per role ([Security](security.md)): nats-server reads them all"
            " (`deploy/nats-auth.conf`); each service gets its own role's as `EPD_NATS_USER` /"
            " `EPD_NATS_PASSWORD`; viewer and admin are the operator's (`epd replay`, `epd ec` from the host)"
        ),
    ),
    (
        "S3_API_ACCESS_KEY` / `S3_API_SECRET_KEY`, and the same for `ENCODER`, `PREFILL`, `DECODE",
        "required",
        (
            "one MinIO account per role ([Security](security.md#store-identities)): `minio-init` creates each"
            " with its role's policy (`deploy/minio-policies/<role>.json`); each service gets its own role's as"
            " `EPD_S3_ACCESS_KEY` / `EPD_S3_SECRET_KEY`"
        ),
    ),
    (
        "NATS_ROUTE_USER` / `NATS_ROUTE_PASSWORD",
        "required with `docker-compose.cluster.yml`",
        "the account the three NATS nodes of the cluster deployment use on their routes (never the services')",
    ),
    (
        "TLS_CERT_HOSTS",
        "empty",
        (
            "more names or addresses (comma-separated) the certificates the one-shot `certs` makes are valid"
            " for, besides the service names and localhost: the names clients elsewhere reach the API, NATS or"
            " MinIO by (read at the first `up` only; [Deployment](deployment.md#tls))"
        ),
    ),
    (
        "EPD_NATS_IMAGE",
        "`nats:2.15.0-alpine`",
        "the `nats` image (a mirror's copy when air-gapped)",
    ),
    (
        "EPD_MINIO_IMAGE",
        "`minio/minio:RELEASE.2025-09-07T16-13-09Z`",
        "the `minio` and `minio-init` image",
    ),
)


def env_name(field: str) -> str:
    return config.env_var(field)


def description(field: FieldInfo) -> str:
    text = " ".join((field.description or "").split())
    first = text.split(" ", 1)[0]
    if first.replace("-", "").isalpha() and first.islower():  # "vLLM ..." and "`text` ..." stay as written
        text = text[:1].upper() + text[1:]
    return text if not text or text.endswith((".", ")")) else text + "."


def type_name(annotation: Any) -> str:
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in inner)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in annotation)
    if annotation is SecretStr:
        return "secret"
    if annotation is Path:
        return "path"
    if origin is tuple:
        return "comma-separated list"
    if origin is dict or annotation is dict:
        return "JSON object"
    return getattr(annotation, "__name__", str(annotation))


def _size(value: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2)):
        if value >= size and value % size == 0:
            return f"{value // size} {unit}"
    return ""


def env_value(field: FieldInfo) -> str:
    """The default as it is written in the environment ('' for unset)."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]  # pydantic types it as taking the validated data; ours take none
        return "{}" if value == {} else ""  # a computed default (worker id) is not written down
    value = field.default
    if value is None or value == ():
        return ""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):  # a comma-separated list
        return ",".join(str(v) for v in value)
    return str(value)


def doc_default(name: str, field: FieldInfo) -> str:
    if field.default_factory is not None and env_value(field) == "":
        return "computed"
    value = env_value(field)
    if value == "":
        return "unset"
    shown = f"`{value}`"
    if isinstance(field.default, int) and not isinstance(field.default, bool) and name.endswith("bytes"):
        size = _size(field.default)
        if size:
            shown += f" ({size})"
    return shown


def compose_variables(root: Path) -> set[str]:
    """Variables docker-compose.yml substitutes (``${NAME...}``), comments left out."""
    text = "\n".join(line.split("#", 1)[0] for line in (root / COMPOSE_FILE).read_text().splitlines())
    return set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", text))


# -- docs/configuration.md ------------------------------------------------------------------------
def configuration_md() -> str:
    out = [
        "# Configuration",
        "",
        "<!-- Generated from shared/config.py by `epd config docs`; do not edit by hand. -->",
        "",
        "Every service reads `EPD_*` environment variables into one settings class per service",
        "(`shared/config.py`), made of the settings groups it needs (NATS, the object store, the model, ...)",
        "and its own settings: each section below is one group or one class, and says who reads it. Every",
        "setting reads `EPD_` + its name, whichever group holds it; nothing else reads the environment. An",
        "empty variable means the default.",
        "Secrets (`EPD_NATS_PASSWORD`, `EPD_S3_ACCESS_KEY`, `EPD_S3_SECRET_KEY`, `EPD_API_KEYS`) are never",
        "logged. This page and `.env.example` are generated from the settings classes: after changing a",
        "setting run `.venv/bin/epd config docs` (the tests fail while either file is stale;",
        "`epd config docs --check` says which). `.venv/bin/epd config show` prints the value of each setting in",
        "effect in the current environment, where it came from (env or default) and who reads it, secrets masked.",
        "",
        "The `epd` tools that talk to a running deployment (`epd replay`, `epd ec`, `epd plan --from-streams`)",
        "read the same variables as the services: NATS from `EPD_NATS_URL` (with `EPD_NATS_USER` /",
        "`EPD_NATS_PASSWORD`), the store from `EPD_S3_ENDPOINT`, `EPD_S3_ACCESS_KEY`, `EPD_S3_SECRET_KEY`,",
        "`EPD_S3_BUCKET` and `EPD_NAMESPACE`, the deployment's subjects from `EPD_SUBJECT_PREFIX`;",
        "`--nats-url` and `--prefix` override the first and the last.",
        "",
    ]
    for section in SECTIONS:
        out += [
            f"## {section.title}",
            "",
            f"`{section.cls.__name__}`, read by: {section.readers}.",
            "",
            "| variable | type | default | description |",
            "|---|---|---|---|",
        ]
        for name, field in section.fields.items():
            kind = " \\| ".join(f"`{c}`" for c in CHOICES[name]) if name in CHOICES else type_name(field.annotation)
            row = (f"`{env_name(name)}`", kind, doc_default(name, field), description(field))
            out.append(
                "| " + " | ".join(cell.replace("|", "\\|") if i != 1 else cell for i, cell in enumerate(row)) + " |"
            )
        out.append("")
    out += [
        "## Retired settings",
        "",
        "No longer read; a worker that finds one set logs a warning naming it when it starts.",
        "",
        *(f"* `{var}`: {why}." for var, why in config.RETIRED_SETTINGS.items()),
        "",
        "## Docker Compose only",
        "",
        "`docker-compose.yml` also reads these from `.env` (see [Deployment](deployment.md)); no service",
        "reads them.",
        "",
        "| variable | default | description |",
        "|---|---|---|",
        *(f"| `{var}` | {default} | {text} |" for var, default, text in COMPOSE_ONLY),
        "",
        "Compose sets per container: `EPD_NATS_URL` (default `tls://nats:4222`), `EPD_S3_ENDPOINT` (default",
        "`minio:9000`), `EPD_MODEL_NAME` (default `qwen2-vl-shapes`), `EPD_MODEL_PATH=/models/model`,",
        "TLS with the certificates of the one-shot `certs` (defaults: `EPD_NATS_TLS_CA`, `EPD_S3_TLS_CA` and",
        "`EPD_TLS_CA` `/tls/ca.crt`, `EPD_S3_SECURE=true`, `EPD_TLS_CERT` / `EPD_TLS_KEY`",
        "`/api-tls/api.crt` / `/api-tls/api.key`, the API's only),",
        "`EPD_STORE_BACKEND=s3`, `EPD_HOST=0.0.0.0` / `EPD_PORT=8000` (api), `EPD_ROLE` (per prefill service),",
        "`EPD_ENGINE=vllm` (GPU services), `EPD_METRICS_PORT=9100` and `EPD_HEALTH_FILE=/tmp/epd-health.json`",
        "(workers). `EPD_WORKER_ID` stays the container's host name plus a random suffix, so replicas differ.",
        "`EPD_NATS_USER` / `EPD_NATS_PASSWORD` are set per service from its role (`api`, `encoder`, `prefill`,",
        "`decode`) and that role's `NATS_<ROLE>_PASSWORD`; `EPD_S3_ACCESS_KEY` / `EPD_S3_SECRET_KEY` likewise",
        "from that role's `S3_<ROLE>_ACCESS_KEY` / `S3_<ROLE>_SECRET_KEY`. `EPD_API_KEYS`, the",
        "`NATS_<ROLE>_PASSWORD`s and the `S3_<ROLE>_*_KEY`s are required under compose.",
        "",
    ]
    return "\n".join(out)


# -- .env.example ---------------------------------------------------------------------------------
ENV_HEADER = """\
# epd-serve: settings for `docker compose` (docker-compose.yml). Copy to .env and fill in the
# secrets; .env is git- and docker-ignored. Compose reads this file for ${...} substitution only;
# docker-compose.yml then hands each service the EPD_* variables it uses. Empty or commented out
# = the default shown (the defaults live in shared/config.py; docs/configuration.md).
# Generated from shared/config.py by `epd config docs`; do not edit by hand.
# Generate each secret with e.g.:  openssl rand -hex 24

# ---- what runs -----------------------------------------------------------------------------------
# One profile: e-pd | e-p-d (CPU) or gpu-e-pd | gpu-e-p-d (NVIDIA + vLLM). `--profile X` replaces it.
COMPOSE_PROFILES=e-pd

# Host folder of the model (Hugging Face layout), mounted read-only at /models/model; readable by
# uid 10001. The default: the demo model shipped in the repository (questions about shapes; see
# docs/getting-started.md). A real model: its folder here and its name below.
EPD_MODEL_DIR=./shared/tools/models/qwen2-vl-shapes
# Model id served in /v1/models and expected in requests (the mount point hides the folder name).
EPD_MODEL_NAME=qwen2-vl-shapes

# ---- secrets (required: compose refuses to start while one is empty) ------------------------------
# Bearer keys clients must send (comma-separated): Authorization: Bearer <key>
EPD_API_KEYS=
# One NATS identity per role (docs/security.md). nats-server reads every password
# (deploy/nats-auth.conf); each service gets only its own role's, as EPD_NATS_USER=<role> /
# EPD_NATS_PASSWORD. viewer and admin are yours, for `epd replay` / `epd ec` from this host
# (EPD_NATS_USER=admin EPD_NATS_PASSWORD=<NATS_ADMIN_PASSWORD>). Use letters and digits (hex):
# nats-server reads a value that looks like a number as one and refuses to start.
NATS_API_PASSWORD=
NATS_ENCODER_PASSWORD=
NATS_PREFILL_PASSWORD=
NATS_DECODE_PASSWORD=
NATS_VIEWER_PASSWORD=
NATS_ADMIN_PASSWORD=
# MinIO root account: used only by minio and the one-shot minio-init, never by the services.
MINIO_ROOT_USER=epd-admin
MINIO_ROOT_PASSWORD=
{store_accounts}

# ---- cluster deployment only (docker-compose.cluster.yml: 3 NATS nodes, distributed MinIO) ---------
# COMPOSE_FILE=docker-compose.yml:docker-compose.cluster.yml
# The NATS nodes' route account (required there; a secret: openssl rand -hex 24).
# NATS_ROUTE_USER=epd-route
# NATS_ROUTE_PASSWORD=

# ---- TLS (docs/deployment.md, "TLS") ----------------------------------------------------------------
# Every link is TLS: the one-shot `certs` makes a development CA and the certificates of nats, minio
# and api at the first `up` (volumes tls and api-tls; kept at later ones). More names they are valid
# for (comma-separated), for clients that reach the servers by another name: the host's, say.
# TLS_CERT_HOSTS=

# ---- infrastructure images (defaults: the upstream images; point them at a mirror when air-gapped) --
# EPD_NATS_IMAGE=nats:2.15.0-alpine
# EPD_MINIO_IMAGE=minio/minio:RELEASE.2025-09-07T16-13-09Z
"""
# What a setting means under compose, beyond its description.
COMPOSE_NOTES = {
    "EPD_ENGINE": "Compose: the CPU profiles only; the gpu-* profiles always run vllm.",
    "EPD_VLLM_DIR": "In the containers it is relative to the home folder (/home/epd).",
    "EPD_VLLM_ENFORCE_EAGER": "On GPUs set false (CUDA graphs / torch.compile).",
    "EPD_STREAM_REPLICAS": "1 on the single compose NATS, 3 on a 3-node cluster.",
}
WRITTEN_IN_HEADER = {
    "EPD_MODEL_NAME",
    "EPD_API_KEYS",
}


def store_accounts() -> str:
    """.env.example's MinIO accounts, one per store role (``shared.store_auth``)."""
    from shared.store_auth import STORE_ROLES, access_key_variable, identity_name, secret_key_variable

    lines = [
        '# One MinIO account per role (docs/security.md, "Store identities"): minio-init creates each with',
        "# its role's policy (deploy/minio-policies/<role>.json: only the object prefixes the role needs);",
        "# each service gets only its own role's keys, as EPD_S3_ACCESS_KEY / EPD_S3_SECRET_KEY. The access",
        "# keys differ from each other and from MINIO_ROOT_USER; each secret needs at least 8 characters.",
    ]
    for role in STORE_ROLES:
        lines += [f"{access_key_variable(role)}={identity_name(role)}", f"{secret_key_variable(role)}="]
    return "\n".join(lines)


def _wrap(text: str, width: int = 100) -> list[str]:
    lines, line = [], "#"
    for word in text.split():
        if len(line) + 1 + len(word) > width and line != "#":
            lines.append(line)
            line = "#"
        line += " " + word
    return [*lines, line] if line != "#" else lines


def _rule(title: str) -> str:
    head = f"# ---- {title} "
    return head + "-" * max(4, 100 - len(head))


def env_example(root: Path = ROOT) -> str:
    read_by_compose = compose_variables(root)
    out = [ENV_HEADER.replace("{store_accounts}", store_accounts()).rstrip("\n")]
    not_read: list[tuple[str, FieldInfo]] = []
    for section in SECTIONS:
        rows = []
        for name, field in section.fields.items():
            var = env_name(name)
            if var in WRITTEN_IN_HEADER:
                continue
            if var not in read_by_compose:
                not_read.append((var, field))
                continue
            rows.append((var, field))
        if not rows:
            continue
        out += ["", _rule(section.title.lower()), f"# (read by: {section.readers.replace('`', '')})"]
        for var, field in rows:
            value = COMPOSE_DEFAULTS.get(var, "" if var in SECRET_VARS else env_value(field))
            out += _wrap(description(field) + (" " + COMPOSE_NOTES[var] if var in COMPOSE_NOTES else ""))
            out.append(f"# {var}={value}")
    out += [
        "",
        _rule("not read from .env by docker-compose.yml"),
        "# Compose sets these per container itself (EPD_MODEL_PATH=/models/model, EPD_STORE_BACKEND=s3,",
        "# EPD_HOST/EPD_PORT, EPD_ROLE, EPD_METRICS_PORT, EPD_HEALTH_FILE) or leaves them at their defaults.",
        "# Listed for services run by hand (export them); the values are the defaults.",
    ]
    for var, field in not_read:
        out += _wrap(description(field))
        out.append(f"# {var}={'' if var in SECRET_VARS else env_value(field)}")
    return "\n".join(out) + "\n"


# -- the command ----------------------------------------------------------------------------------
def generated(root: Path = ROOT) -> dict[Path, str]:
    from shared.store_auth import compose_minio_policies
    from shared.tools.nats_identities import COMPOSE_NATS_AUTH, SECURITY_DOC, compose_nats_auth, security_md

    return {
        CONFIG_DOC: configuration_md(),
        ENV_EXAMPLE: env_example(root),
        SECURITY_DOC: security_md(),
        COMPOSE_NATS_AUTH: compose_nats_auth(),
        **compose_minio_policies(),
    }


def stale_files(root: Path = ROOT) -> list[Path]:
    """The generated files whose checked-in copy under ``root`` differs (or is missing)."""
    out = []
    for rel, text in generated(root).items():
        path = root / rel
        if not path.is_file() or path.read_text() != text:
            out.append(rel)
    return out


def write(root: Path = ROOT) -> list[Path]:
    written = []
    for rel, text in generated(root).items():
        path = root / rel
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(rel)
    return written


def _cmd_docs(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if args.check:
        stale = stale_files(root)
        for rel in stale:
            print(
                f"epd config docs: {rel} is stale: regenerate it with `epd config docs`",
                file=sys.stderr,
            )
        return 1 if stale else 0
    for rel in write(root):
        print(f"wrote {rel}")
    return 0


def add_parser(sub: Any) -> None:
    """Add ``config docs`` to the ``epd`` parser."""
    cfg = sub.add_parser("config", help="settings: the ones in effect here, the generated configuration reference")
    csub = cfg.add_subparsers(dest="config_command", required=True)
    docs = csub.add_parser(
        "docs",
        help=(
            "write docs/configuration.md, .env.example (shared/config.py), docs/security.md and"
            " deploy/nats-auth.conf (shared/nats_auth.py), deploy/minio-policies/ (shared/store_auth.py)"
        ),
    )
    docs.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 naming each stale file",
    )
    docs.add_argument("--root", default=str(ROOT), help="repository root (default: this checkout)")
    docs.set_defaults(func=_cmd_docs)
