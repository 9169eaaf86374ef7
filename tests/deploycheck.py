"""Static checks of the deployment files (docker-compose.yml, Dockerfile, .env.example).

No Docker engine runs in the test environment, so this module reads the files the way Compose and
BuildKit do, for the parts this project uses: YAML with anchors and merge keys (PyYAML), ``${...}``
interpolation with ``:-`` / ``-`` / ``:?`` / ``?`` and ``$$``, profiles, and Dockerfile stages.
Each ``*_problems`` function returns a list of human-readable problems (empty = fine), so a test
can show that a deliberately broken copy is rejected.
"""

from __future__ import annotations

import copy
import re
import shlex
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shared.config import ServiceSettings, grace_period_s

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_PATH = ROOT / "docker-compose.yml"
DOCKERFILE_PATH = ROOT / "Dockerfile"
ENV_EXAMPLE_PATH = ROOT / ".env.example"
NATS_CONF_PATH = ROOT / "deploy" / "nats.conf"

# -- interpolation ----------------------------------------------------------------------------
_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class MissingVariable(ValueError):
    """A ``${VAR:?message}`` whose variable is unset or empty: Compose refuses to start."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.name = name


@dataclass(frozen=True)
class VarRef:
    name: str
    op: str | None  # None, ":-", "-", ":?", "?"
    arg: str


def var_refs(text: str) -> list[VarRef]:
    out = []
    for m in _VAR.finditer(text):
        if m.group("escaped"):
            continue
        out.append(VarRef(m.group("braced") or m.group("bare"), m.group("op"), m.group("arg") or ""))
    return out


def _seconds(duration: object) -> float:
    """A Compose duration (``75s``, ``1m30s``, ``500ms``) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(duration))
    if not parts:
        raise ValueError(f"not a duration: {duration!r}")
    return sum(float(n) * units[u] for n, u in parts)


def interpolate(text: str, env: Mapping[str, str]) -> str:
    def sub(m: re.Match) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("braced") or m.group("bare")
        op, arg = m.group("op"), m.group("arg") or ""
        value = env.get(name)
        if op == ":-":
            return value if value else arg
        if op == "-":
            return value if value is not None else arg
        if op in (":?", "?") and (value is None or (op == ":?" and value == "")):
            raise MissingVariable(name, arg)
        return value or ""

    return _VAR.sub(sub, text)


def walk_strings(obj: Any) -> Iterable[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from walk_strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from walk_strings(v)


def resolve(obj: Any, env: Mapping[str, str]) -> Any:
    if isinstance(obj, str):
        return interpolate(obj, env)
    if isinstance(obj, Mapping):
        return {k: resolve(v, env) for k, v in obj.items()}
    if isinstance(obj, list):
        return [resolve(v, env) for v in obj]
    return obj


# -- compose model ----------------------------------------------------------------------------
def load_compose(path: Path = COMPOSE_PATH) -> dict:
    return yaml.safe_load(path.read_text())


def compose_variables(compose: Mapping) -> dict[str, list[VarRef]]:
    """Every variable the file substitutes (comments excluded), with each way it is used."""
    out: dict[str, list[VarRef]] = {}
    for s in walk_strings(compose):
        for ref in var_refs(s):
            out.setdefault(ref.name, []).append(ref)
    return out


def active_services(compose: Mapping, profiles: Iterable[str]) -> list[str]:
    """Services Compose starts with these profiles active (no profiles: always)."""
    active = set(p for p in profiles if p)
    return [
        name for name, svc in compose["services"].items() if not svc.get("profiles") or active & set(svc["profiles"])
    ]


def environment(service: Mapping) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def parse_env_file(path: Path = ENV_EXAMPLE_PATH) -> tuple[dict[str, str], dict[str, str]]:
    """(set, commented out) ``NAME=value`` lines of a .env file."""
    active, commented = {}, {}
    for line in path.read_text().splitlines():
        m = re.match(r"^(#\s*)?([A-Z][A-Z0-9_]*)=(.*)$", line.strip())
        if m:
            (commented if m.group(1) else active)[m.group(2)] = m.group(3).strip()
    return active, commented


def port_mappings(service: Mapping) -> list[tuple[str | None, int, int]]:
    """(host ip, host port, container port) of each short-syntax ``ports`` entry."""
    out = []
    for entry in service.get("ports") or []:
        parts = str(entry).split(":")
        ip = parts[0] if len(parts) == 3 else None
        out.append((ip, int(parts[-2]), int(parts[-1].split("/")[0])))
    return out


def nats_conf_ports(path: Path = NATS_CONF_PATH) -> tuple[int, int]:
    text = path.read_text()
    client = int(re.search(r"^port:\s*(\d+)", text, re.M).group(1))
    http = int(re.search(r"^http_port:\s*(\d+)", text, re.M).group(1))
    return client, http


# -- Dockerfile model -------------------------------------------------------------------------
@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)

    def args_of(self, keyword: str) -> list[str]:
        return [a for k, a in self.instructions if k == keyword]


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, args = buf.partition(" ")
        out.append((keyword.upper(), args.strip()))
        buf = ""
    return out


def dockerfile_stages(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages in order)."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, args in dockerfile_instructions(text):
        if keyword == "FROM":
            m = re.match(r"^(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?$", args, re.I)
            stages.append(Stage(name=(m.group(2) or str(len(stages))), base=m.group(1)))
        elif not stages and keyword == "ARG":
            name, _, default = args.partition("=")
            global_args[name] = default
        elif stages:
            stages[-1].instructions.append((keyword, args))
    return global_args, stages


def apt_packages(stage: Stage) -> set[str]:
    pkgs: set[str] = set()
    for run in stage.args_of("RUN"):
        for cmd in re.split(r"&&|;", run):
            words = shlex.split(cmd)
            if len(words) >= 2 and words[0] in ("apt-get", "apt") and "install" in words:
                pkgs.update(w for w in words[words.index("install") + 1 :] if not w.startswith("-"))
    return pkgs


BUILD_TOOLS = {"build-essential", "gcc", "g++", "make", "cmake", "clang", "cc", "libc6-dev", "cpp", "ninja-build"}
#: The gpu target's documented exception: Triton / FlashInfer compile kernel launchers at run time.
GPU_RUNTIME_COMPILERS = {"gcc", "g++", "libc6-dev"}
PINNED_PYTHON = re.compile(r"^python:3\.11\.\d+-slim-[a-z]+$")


def _uid(user: str) -> str:
    return user.split(":")[0]


def dockerfile_problems(text: str) -> list[str]:
    problems = []
    global_args, stages = dockerfile_stages(text)
    by_name = {s.name: s for s in stages}
    py = global_args.get("PYTHON_IMAGE", "")
    if not PINNED_PYTHON.match(py):
        problems.append(f"base image {py!r} is not a pinned python:3.11.N-slim-<debian> tag")
    for target in ("cpu", "gpu"):
        if target not in by_name:
            problems.append(f"no stage named {target!r}")
    if not problems and stages[-1].name != "cpu":
        problems.append("the last stage (the default target) is not 'cpu'")
    if problems:
        return problems

    def chain(stage: Stage) -> list[Stage]:  # the stage and the stages it is built FROM
        out = [stage]
        while out[-1].base in by_name:
            out.append(by_name[out[-1].base])
        return out

    if chain(by_name["cpu"])[-1].base != "${PYTHON_IMAGE}":
        problems.append("the cpu stage does not derive from ${PYTHON_IMAGE}")
    for target in ("cpu", "gpu"):
        stage = by_name[target]
        lineage = chain(stage)
        names = [s.name for s in lineage]
        if "builder" in names or any(s.name.startswith("venv") for s in lineage):
            problems.append(f"final stage {target} is built FROM a build stage ({' <- '.join(names)})")
        users = [u for s in reversed(lineage) for u in s.args_of("USER")]
        if not users or _uid(users[-1]) in ("root", "0") or not _uid(users[-1]).isdigit():
            problems.append(
                f"final stage {target} does not end as a numeric non-root USER (got {users[-1:] or 'none'})"
            )
        pkgs = set().union(*(apt_packages(s) for s in lineage))
        allowed = GPU_RUNTIME_COMPILERS if target == "gpu" else set()
        if pkgs & (BUILD_TOOLS - allowed):
            problems.append(f"final stage {target} installs build tools: {sorted(pkgs & (BUILD_TOOLS - allowed))}")
        for copy_args in stage.args_of("COPY"):
            m = re.search(r"--from=(\S+)", copy_args)
            if m is None:
                problems.append(f"final stage {target} copies from the build context: COPY {copy_args}")
            elif not m.group(1).startswith("venv"):
                problems.append(f"final stage {target} copies from {m.group(1)}, not a venv stage")
    for stage in stages:
        for copy_args in stage.args_of("COPY") + stage.args_of("ADD"):
            source = copy_args.split()[0] if copy_args else ""
            if re.search(r"(^|\s)\.env(\s|$)", copy_args) or re.search(r"(^|\s)\.(\s|$)", source):
                problems.append(f"stage {stage.name} copies .env or the whole context: {copy_args}")
    return problems


# -- compose checks ---------------------------------------------------------------------------
@dataclass(frozen=True)
class AppSpec:
    """What the checks expect of one epd-serve service in docker-compose.yml."""

    module: str  # python -m <module>
    health_role: str  # epd healthcheck --role <role>
    target: str  # Dockerfile target
    role: str | None = None  # EPD_ROLE
    gpu_device: bool = False


def _healthcheck_args(service: Mapping) -> list[str] | None:
    test = (service.get("healthcheck") or {}).get("test")
    if isinstance(test, list) and test and test[0] in ("CMD", "CMD-SHELL"):
        return [str(x) for x in test]
    return None


#: What every epd-serve service waits for in docker-compose.yml: (service, condition).
SINGLE_NODE_DEPS = (
    ("nats", "service_healthy"),
    ("minio", "service_healthy"),
    ("minio-init", "service_completed_successfully"),
)


def compose_problems(
    compose: Mapping,
    apps: Mapping[str, AppSpec],
    *,
    dockerfile_targets: set[str],
    image_version: str,
    model_path: str,
    infra_deps: Iterable[tuple[str, str]] = SINGLE_NODE_DEPS,
) -> list[str]:
    """Structural problems of a compose model: entry points, healthchecks, ports, dependencies,
    images, GPU reservations and hardening. Settings-level checks live in the tests."""
    problems = []
    services = compose.get("services", {})
    for name, svc in services.items():
        one_shot = str(svc.get("restart", "")) == "no"
        if _healthcheck_args(svc) is None and not one_shot:
            problems.append(f"{name}: no healthcheck")
        image = interpolate(str(svc.get("image", "")), {})  # ${EPD_NATS_IMAGE:-...}: its default
        if not re.match(r"^[a-z0-9./_-]+:[A-Za-z0-9._-]*\d[A-Za-z0-9._-]*$", image) or image.endswith(":latest"):
            problems.append(f"{name}: image {image!r} is not pinned to a version tag")
        if "container_name" in svc:
            problems.append(f"{name}: container_name stops `--scale`")
        if svc.get("privileged"):
            problems.append(f"{name}: privileged")
        for dep, cond in (svc.get("depends_on") or {}).items():
            if dep not in services:
                problems.append(f"{name}: depends on unknown service {dep}")
            elif (cond or {}).get("condition") not in ("service_healthy", "service_completed_successfully"):
                problems.append(f"{name}: depends_on {dep} without a health/completion condition")
            elif cond["condition"] == "service_healthy" and _healthcheck_args(services[dep]) is None:
                problems.append(f"{name}: waits for {dep} to be healthy but {dep} has no healthcheck")

    for name, spec in apps.items():
        svc = services.get(name)
        if svc is None:
            problems.append(f"{name}: missing")
            continue
        if svc.get("command") != ["python", "-m", spec.module]:
            problems.append(f"{name}: command {svc.get('command')} is not ['python', '-m', {spec.module!r}]")
        env = environment(svc)
        hc = _healthcheck_args(svc) or []
        if hc[1:] != ["epd", "healthcheck", "--role", spec.health_role]:
            problems.append(f"{name}: healthcheck {hc} is not `epd healthcheck --role {spec.health_role}`")
        if spec.health_role != "api" and not env.get("EPD_HEALTH_FILE", "").startswith("/"):
            problems.append(f"{name}: worker without an absolute EPD_HEALTH_FILE (its healthcheck would fail)")
        if spec.role is not None and env.get("EPD_ROLE") != spec.role:
            problems.append(f"{name}: EPD_ROLE={env.get('EPD_ROLE')!r}, expected {spec.role!r}")
        build = svc.get("build") or {}
        if build.get("target") != spec.target or spec.target not in dockerfile_targets:
            problems.append(f"{name}: build target {build.get('target')!r}, expected Dockerfile target {spec.target!r}")
        flavour = "cuda" if spec.target == "gpu" else "cpu"
        if svc.get("image") != f"epd-serve:{image_version}-{flavour}":
            problems.append(f"{name}: image {svc.get('image')!r}, expected epd-serve:{image_version}-{flavour}")
        if spec.target == "gpu" and env.get("EPD_ENGINE") != "vllm":
            problems.append(f"{name}: GPU service without EPD_ENGINE=vllm")
        devices = (((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
        has_gpu = any(d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or []) for d in devices)
        if has_gpu != spec.gpu_device:
            problems.append(f"{name}: NVIDIA GPU reservation {'missing' if spec.gpu_device else 'unexpected'}")
        drain_env = interpolate(str(env.get("EPD_DRAIN_S") or ""), {})
        drain = float(drain_env or ServiceSettings.model_fields["drain_s"].default)
        if _seconds(svc.get("stop_grace_period", "10s")) < grace_period_s(drain):
            problems.append(
                f"{name}: stop_grace_period {svc.get('stop_grace_period', '10s (the default)')} is shorter than "
                f"grace_period_s(EPD_DRAIN_S={drain:g}) = {grace_period_s(drain)}s: its drain would be cut off"
            )
        if spec.health_role != "api" and svc.get("ports"):
            problems.append(f"{name}: a worker publishes ports, so it cannot be scaled")
        if spec.health_role == "api":
            port = env.get("EPD_PORT")
            if [(h, c) for _, h, c in port_mappings(svc)] != [(8000, int(port or 0))]:
                problems.append(f"{name}: ports {svc.get('ports')} do not map host 8000 to EPD_PORT={port}")
        # hardening and the model mount
        if _uid(str(svc.get("user", "0"))) in ("0", "root"):
            problems.append(f"{name}: runs as root")
        if "ALL" not in (svc.get("cap_drop") or []):
            problems.append(f"{name}: does not drop all capabilities")
        if "no-new-privileges:true" not in (svc.get("security_opt") or []):
            problems.append(f"{name}: no no-new-privileges")
        mounts = [v for v in svc.get("volumes") or [] if isinstance(v, Mapping) and v.get("target") == model_path]
        if (
            len(mounts) != 1
            or not mounts[0].get("read_only")
            or (mounts[0].get("bind") or {}).get("create_host_path") is not False
        ):
            problems.append(f"{name}: the model is not bind-mounted read-only at {model_path} (without creating it)")
        if env.get("EPD_MODEL_PATH") != model_path:
            problems.append(f"{name}: EPD_MODEL_PATH={env.get('EPD_MODEL_PATH')!r} is not the mount {model_path}")
        deps = svc.get("depends_on") or {}
        for dep, cond in infra_deps:
            if (deps.get(dep) or {}).get("condition") != cond:
                problems.append(f"{name}: does not wait for {dep} ({cond})")
    return problems


def broken(compose: Mapping, service: str, **changes: Any) -> dict:
    """A deep copy with ``changes`` applied to one service (``None`` deletes a key)."""
    out = copy.deepcopy(dict(compose))
    svc = out["services"][service]
    for key, value in changes.items():
        if value is None:
            svc.pop(key, None)
        else:
            svc[key] = value
    return out


# -- several compose files (docker compose -f A -f B ...) -------------------------------------------
CLUSTER_COMPOSE_PATH = ROOT / "docker-compose.cluster.yml"
TEST_OVERLAY_PATH = ROOT / "tests" / "compose" / "compose.test.yml"
CLUSTER_TEST_OVERLAY_PATH = ROOT / "tests" / "compose" / "compose.cluster.test.yml"


@dataclass(frozen=True)
class Override:
    """A value tagged ``!override``: it replaces what the files before said."""

    value: Any


class Reset:
    """A value tagged ``!reset``: the key is removed."""


class ComposeLoader(yaml.SafeLoader):
    pass


def _construct_override(loader: yaml.SafeLoader, node: yaml.Node) -> Override:
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return Override(loader.construct_scalar(node))


ComposeLoader.add_constructor("!override", _construct_override)
ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())

# Lists Compose replaces when a later file sets them (compose-go's merge rules); any other list
# must be tagged !override in an overlay, so that what the files mean does not hang on Compose's
# rule for that key (appended, merged by target, ...).
_REPLACED_LISTS = {("command",), ("entrypoint",), ("healthcheck", "test")}


def _plain(value: Any) -> Any:
    """``value`` with every tag resolved (an overlay's new keys)."""
    if isinstance(value, Override):
        return _plain(value.value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items() if not isinstance(v, Reset)}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def merge_compose(base: Any, over: Any, path: tuple[str, ...]) -> Any:
    if isinstance(over, Override):
        return _plain(over.value)
    if isinstance(base, Mapping) and isinstance(over, Mapping):
        out = dict(base)
        for key, value in over.items():
            if isinstance(value, Reset):
                out.pop(key, None)
            elif key in out:
                out[key] = merge_compose(out[key], value, (*path, str(key)))
            else:
                out[key] = _plain(value)
        return out
    if isinstance(base, list) or isinstance(over, list):
        if len(path) >= 3 and path[0] == "services" and path[2:] in _REPLACED_LISTS:
            return _plain(over)
        raise ValueError(f"{'.'.join(path)}: a list set again without !override (say what Compose should do)")
    return _plain(over)


def load_compose_files(*paths: Path) -> dict:
    """The model ``docker compose -f P1 -f P2 ...`` reads: each file merged over the ones before
    (mappings key by key, ``!override`` replaces, ``!reset`` removes)."""
    model: dict = {}
    for path in paths:
        model = merge_compose(model, yaml.load(path.read_text(), Loader=ComposeLoader) or {}, ())
    return model


def cluster_compose(*, test: bool = False) -> dict:
    """docker-compose.yml + docker-compose.cluster.yml (+ the test overlays, as `make test-compose` runs it)."""
    paths = [COMPOSE_PATH, CLUSTER_COMPOSE_PATH]
    if test:
        paths += [TEST_OVERLAY_PATH, CLUSTER_TEST_OVERLAY_PATH]
    return load_compose_files(*paths)


# -- NATS configuration files (the subset this project's files use) --------------------------------
_NATS_TOKEN = re.compile(r"""\s*(?:(?:#|//)[^\n]*|([{}\[\],]|[:=]|"[^"]*"|'[^']*'|[^\s{}\[\],:=#"']+))""")


def _nats_tokens(text: str) -> list[str]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _NATS_TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"cannot read the NATS configuration at {text[pos : pos + 30]!r}")
        if m.group(1) is not None:
            tokens.append(m.group(1).strip("\"'"))
        pos = m.end()
    return tokens


def parse_nats_conf(text: str, read_include) -> dict[str, Any]:
    """``key: value`` / ``key { ... }`` / ``[a, b]`` of a nats-server configuration, as nested
    dicts; ``include PATH`` is read with ``read_include(PATH)`` and merged in place."""
    tokens = _nats_tokens(text)
    pos = 0

    def value() -> Any:
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok == "{":
            return block("}")
        if tok == "[":
            items = []
            while tokens[pos] != "]":
                if tokens[pos] == ",":
                    pos += 1
                    continue
                items.append(value())
            pos += 1
            return items
        return tok

    def block(end: str | None) -> dict[str, Any]:
        nonlocal pos
        out: dict[str, Any] = {}
        while pos < len(tokens) and tokens[pos] != end:
            key = tokens[pos]
            pos += 1
            if key == ",":
                continue
            if key == "include":
                out.update(parse_nats_conf(read_include(tokens[pos]), read_include))
                pos += 1
                continue
            if tokens[pos] in (":", "="):
                pos += 1
            out[key] = value()
        pos += 1
        return out

    return block(None)


# -- the cluster deployment ------------------------------------------------------------------------
def _is_active(service: Mapping) -> bool:
    """Started whatever the profiles (infrastructure has none)."""
    return not service.get("profiles")


def nats_nodes(compose: Mapping) -> list[str]:
    """The NATS servers the deployment starts: the services on EPD_NATS_IMAGE without a profile."""
    return [
        name
        for name, svc in compose["services"].items()
        if "EPD_NATS_IMAGE" in str(svc.get("image", "")) and _is_active(svc)
    ]


def _flag(command: list[str], *names: str) -> str | None:
    for i, arg in enumerate(command):
        if arg in names and i + 1 < len(command):
            return command[i + 1]
        for name in names:
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def _placeholders(text: str) -> dict[str, str]:
    """Every variable of ``text`` mapped to ``VAR.<name>``: interpolated, the result shows where
    a variable (and not a literal) stands."""
    return {ref.name: f"VAR.{ref.name}" for ref in var_refs(text)}


def _url(raw: str) -> tuple[str | None, str | None, str, int | None]:
    """(user, password, host, port) of a URL whose variables stand as ``VAR.<name>``."""
    from urllib.parse import urlsplit

    parts = urlsplit(interpolate(raw, _placeholders(raw)))
    return parts.username, parts.password, parts.hostname or "", parts.port


@dataclass
class NatsNode:
    name: str
    server_name: str | None
    cluster_name: str | None
    jetstream: bool
    store_dir: str | None
    client_port: int | None
    cluster_port: int | None
    cluster_credentials: tuple[str | None, str | None]
    routes: list[tuple[str | None, str | None, str, int | None]]  # (user, password, host, port)
    raw_credentials: list[str]  # the URL texts that carry route credentials


def _mounted_file(service: Mapping, target: str, read_file) -> str | None:
    for vol in service.get("volumes") or []:
        src, _, rest = str(vol).partition(":") if isinstance(vol, str) else ("", "", "")
        if rest.split(":")[0] == target and src.startswith("./"):
            return read_file(src[2:])
    return None


def nats_node_conf(name: str, service: Mapping, read_file) -> tuple[dict[str, Any], list[str]]:
    """A NATS service's configuration file as nats-server reads it: from the mount, includes too."""
    import posixpath

    problems = []
    command = [str(a) for a in service.get("command") or []]
    conf: dict[str, Any] = {}
    conf_target = _flag(command, "--config", "-c")
    if conf_target is None:
        problems.append(f"{name}: no --config")
    else:

        def read_include(path: str) -> str:
            target = posixpath.normpath(posixpath.join(posixpath.dirname(conf_target), path))
            text = _mounted_file(service, target, read_file)
            if text is None:
                raise FileNotFoundError(f"{name}: the configuration includes {target}, which is not mounted")
            return text

        text = _mounted_file(service, conf_target, read_file)
        if text is None:
            problems.append(f"{name}: its configuration {conf_target} is not a file of this repository mounted there")
        else:
            try:
                conf = parse_nats_conf(text, read_include)
            except FileNotFoundError as exc:
                problems.append(str(exc))
    return conf, problems


def nats_node(name: str, service: Mapping, read_file) -> tuple[NatsNode, list[str]]:
    """A NATS service's settings as nats-server sees them: its configuration file (read from the
    mount, includes too), overridden by its command line."""
    command = [str(a) for a in service.get("command") or []]
    conf, problems = nats_node_conf(name, service, read_file)
    cluster = conf.get("cluster") if isinstance(conf.get("cluster"), Mapping) else {}
    js = conf.get("jetstream")
    listen = _flag(command, "--cluster")
    user, password, _, port = _url(listen) if listen else (None, None, "", None)
    routes_arg = _flag(command, "--routes")
    routes_raw = [r.strip() for r in (routes_arg or "").split(",") if r.strip()]
    if routes_arg is None and isinstance(cluster.get("routes"), list):
        routes_raw = [str(r) for r in cluster["routes"]]
    node = NatsNode(
        name=name,
        server_name=_flag(command, "--server_name", "-n", "--name") or conf.get("server_name"),
        cluster_name=_flag(command, "--cluster_name") or cluster.get("name"),
        jetstream=isinstance(js, Mapping) or "-js" in command or "--jetstream" in command,
        store_dir=(js.get("store_dir") if isinstance(js, Mapping) else None) or _flag(command, "-sd", "--store_dir"),
        client_port=int(_flag(command, "-p", "--port") or conf.get("port") or 4222),
        cluster_port=port or (int(cluster["port"]) if "port" in cluster else None),
        cluster_credentials=(user, password),
        routes=[_url(r) for r in routes_raw],
        raw_credentials=([listen] if listen else []) + routes_raw,
    )
    return node, problems


def read_repo_file(relative: str) -> str | None:
    """A file of this repository (a compose file's ``./`` source), None if there is none."""
    path = ROOT / relative
    return path.read_text() if path.is_file() else None


def read_repo_file_in(folder: str):
    """``read_include`` for a configuration file in ``folder`` of this repository."""
    return lambda path: (ROOT / folder / path).read_text()


def nats_cluster_problems(compose: Mapping, read_file=read_repo_file) -> list[str]:
    """The NATS nodes form one cluster: 3+ (odd) nodes, distinct server names, one cluster name,
    JetStream on with a volume of its own per node, every node routing to every other, route
    credentials from required variables and the same on every node, and no node waiting for
    another (a node is healthy only once the cluster has a meta leader: that would never come)."""
    services = compose["services"]
    names = nats_nodes(compose)
    problems = []
    if len(names) < 3 or len(names) % 2 == 0:
        problems.append(f"NATS nodes {names}: a JetStream cluster needs an odd number of 3 or more")
    nodes = {}
    for name in names:
        node, node_problems = nats_node(name, services[name], read_file)
        problems += node_problems
        nodes[name] = node
    server_names = [n.server_name for n in nodes.values()]
    if None in server_names or len(set(server_names)) != len(server_names):
        problems.append(f"server names {server_names} are not set and distinct on every node")
    cluster_names = {n.cluster_name for n in nodes.values()}
    if None in cluster_names or len(cluster_names) != 1:
        problems.append(f"cluster names {sorted(map(str, cluster_names))}: every node needs the same one")
    credentials = set()
    for name, node in nodes.items():
        svc = services[name]
        if not node.jetstream:
            problems.append(f"{name}: JetStream is off")
        data = [
            str(v).split(":")[0] for v in svc.get("volumes") or [] if str(v).split(":")[1:2] == [node.store_dir or ""]
        ]
        if len(data) != 1 or data[0] not in (compose.get("volumes") or {}):
            problems.append(f"{name}: JetStream's store_dir {node.store_dir} is not on a named volume")
        owners = [
            o for o in names if data and any(str(v).startswith(f"{data[0]}:") for v in services[o].get("volumes") or [])
        ]
        if len(owners) > 1:
            problems.append(f"{', '.join(owners)} share the JetStream volume {data[0]}")
        if node.cluster_port is None:
            problems.append(f"{name}: no cluster port (--cluster)")
        routed = {(host, port) for _, _, host, port in node.routes}
        for other in names:
            if other == name:
                continue
            if (other, nodes[other].cluster_port) not in routed:
                problems.append(f"{name}: its routes do not name {other}:{nodes[other].cluster_port}")
        unknown = sorted(h for h, _ in routed if h not in names)
        if unknown:
            problems.append(f"{name}: routes to {unknown}, which are no NATS node of this deployment")
        for user, password in [node.cluster_credentials, *((u, p) for u, p, _, _ in node.routes)]:
            if not (user or "").startswith("VAR.") or not (password or "").startswith("VAR."):
                problems.append(
                    f"{name}: a route URL without route credentials from variables ({user!r}, {password!r})"
                )
            credentials.add((user, password))
        for raw in node.raw_credentials:
            for ref in var_refs(raw):
                if ref.op != ":?":
                    problems.append(
                        f"{name}: route credential {ref.name} must be ${{{ref.name}:?...}} (required, no default)"
                    )
        hc = _healthcheck_args(svc) or []
        if not any("/healthz" in a for a in hc):
            problems.append(f"{name}: the healthcheck does not ask /healthz")
        for dep in svc.get("depends_on") or {}:
            if dep in names:
                problems.append(
                    f"{name}: waits for {dep} (a node is healthy only with a quorum: they would wait forever)"
                )
    if len(credentials) > 1:
        problems.append(f"route credentials differ between the nodes: {sorted(map(str, credentials))}")
    return sorted(set(problems))


def _seeds(url: str) -> set[tuple[str, int | None]]:
    from urllib.parse import urlsplit

    out = set()
    for part in url.split(","):
        if part.strip():
            parts = urlsplit(part.strip())
            out.add((parts.hostname or "", parts.port))
    return out


def cluster_app_problems(
    compose: Mapping, apps: Iterable[str], dotenv: Mapping[str, str], *, replicas: int = 3
) -> list[str]:
    """Every epd-serve service knows every NATS node (EPD_NATS_URL), creates its streams with
    ``replicas`` copies, and waits at start-up for every node, not for one of them."""
    services = compose["services"]
    names = nats_nodes(compose)
    ports = {name: nats_node(name, services[name], read_repo_file)[0].client_port for name in names}
    problems = []
    if replicas > len(names):
        problems.append(f"R{replicas} streams need {replicas} NATS nodes; the deployment has {len(names)}")
    for name in apps:
        svc = services[name]
        env = environment(resolve(svc, dotenv))
        seeds = _seeds(env.get("EPD_NATS_URL", ""))
        missing = sorted(n for n in names if (n, ports[n]) not in seeds)
        if missing:
            problems.append(f"{name}: EPD_NATS_URL={env.get('EPD_NATS_URL')!r} misses {missing}")
        stray = sorted(h for h, _ in seeds if h not in names)
        if stray:
            problems.append(f"{name}: EPD_NATS_URL names {stray}, which no NATS node of this deployment is")
        if env.get("EPD_STREAM_REPLICAS") != str(replicas):
            problems.append(f"{name}: EPD_STREAM_REPLICAS={env.get('EPD_STREAM_REPLICAS')!r}, expected {replicas}")
        deps = svc.get("depends_on") or {}
        waits = sorted(d for d in deps if d in names)
        if waits != sorted(names):
            problems.append(f"{name}: waits at start-up for {waits} only, not for every NATS node {sorted(names)}")
        for dep in deps:
            if dep in services and not _is_active(services[dep]):
                problems.append(f"{name}: waits for {dep}, which this deployment does not start")
        for node in waits:
            if (deps[node] or {}).get("condition") != "service_healthy":
                problems.append(f"{name}: waits for {node} without condition service_healthy")
    return problems


def expand_minio(endpoint: str) -> list[str]:
    """MinIO's ``{1...4}`` ellipses, expanded (every combination)."""
    m = re.search(r"\{(\d+)\.\.\.(\d+)\}", endpoint)
    if m is None:
        return [endpoint]
    lo, hi = int(m.group(1)), int(m.group(2))
    return [e for i in range(lo, hi + 1) for e in expand_minio(endpoint[: m.start()] + str(i) + endpoint[m.end() :])]


_MINIO_VALUE_FLAGS = {"--address", "--console-address", "--certs-dir", "--ftp", "--sftp", "--config"}


def minio_endpoints(command: list[str]) -> list[str]:
    """The drive arguments of ``minio server ...`` (URLs or paths, ellipses unexpanded)."""
    out, args = [], [str(a) for a in command[1:]]
    i = 0
    while i < len(args):
        if args[i].startswith("-"):
            i += 2 if args[i] in _MINIO_VALUE_FLAGS else 1
            continue
        out.append(args[i])
        i += 1
    return out


def aliases(service: Mapping) -> set[str]:
    nets = service.get("networks") or {}
    if not isinstance(nets, Mapping):
        return set()
    return {a for net in nets.values() for a in ((net or {}).get("aliases") or [])}


def object_store_problems(compose: Mapping, apps: Iterable[str], dotenv: Mapping[str, str]) -> list[str]:
    """The object store keeps more than one copy. A distributed MinIO: 4+ drives on 2+ nodes, every
    node running the same server list, each drive on a volume of its own, the services' endpoint a
    name every node answers to. The test stand-in: a SeaweedFS master whose default replication
    keeps 2+ copies, with enough volume servers for them."""
    from urllib.parse import urlsplit

    services = compose["services"]
    problems = []
    minio = {
        name: svc
        for name, svc in services.items()
        if _is_active(svc)
        and "EPD_MINIO_IMAGE" in str(svc.get("image", ""))
        and (svc.get("command") or [""])[0] == "server"
    }
    seaweed_masters = {
        name: svc for name, svc in services.items() if _is_active(svc) and (svc.get("command") or [""])[0] == "master"
    }
    if minio:
        lists = {name: minio_endpoints(svc["command"]) for name, svc in minio.items()}
        if len({tuple(v) for v in lists.values()}) != 1:
            problems.append(f"the MinIO nodes run different server lists: {lists}")
        # (node, path) of each drive; a bare path is a drive of the node that runs it
        drives = [
            (u.hostname, u.path) if u.scheme else (name, e)
            for name, endpoints in lists.items()
            for raw in endpoints
            for e in expand_minio(raw)
            for u in [urlsplit(e)]
        ]
        drives = sorted(set(drives), key=str)
        hosts = {host for host, _ in drives}
        if len(drives) < 4 or len(hosts) < 2:
            problems.append(
                f"MinIO with {len(drives)} drive(s) on {len(hosts)} node(s): distributed needs 4+ drives on 2+ nodes"
            )
        if hosts != set(minio):
            problems.append(
                f"the server list names nodes {sorted(map(str, hosts))}, the deployment runs {sorted(minio)}"
            )
        volumes = {}
        for name, svc in minio.items():
            paths = {path for host, path in drives if host == name}
            for path in paths:
                mounted = [str(v).split(":")[0] for v in svc.get("volumes") or [] if str(v).split(":")[1:2] == [path]]
                if len(mounted) != 1 or mounted[0] not in (compose.get("volumes") or {}):
                    problems.append(f"{name}: drive {path} is not on a named volume")
                elif mounted[0] in volumes:
                    problems.append(f"{name} and {volumes[mounted[0]]} share the drive volume {mounted[0]}")
                else:
                    volumes[mounted[0]] = name
            env = environment(svc)
            for var in ("MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"):
                if not env.get(var, "").startswith("${" + var + ":?"):
                    problems.append(f"{name}: {var} is not ${{{var}:?...}}")
        for name in apps:
            host = environment(resolve(services[name], dotenv)).get("EPD_S3_ENDPOINT", "").split(":")[0]
            serving = sorted(n for n, svc in minio.items() if host == n or host in aliases(svc))
            if serving != sorted(minio):
                problems.append(f"{name}: EPD_S3_ENDPOINT host {host!r} reaches {serving}, not every MinIO node")
    elif seaweed_masters:
        for name, svc in seaweed_masters.items():
            replication = _flag([str(a) for a in svc["command"]], "-defaultReplication") or "000"
            copies = 1 + sum(int(c) for c in replication if c.isdigit())
            volume_servers = [
                n
                for n, s in services.items()
                if _is_active(s)
                and (s.get("command") or [""])[0] == "volume"
                and (_flag([str(a) for a in s["command"]], "-mserver") or "").split(":")[0] == name
            ]
            if copies < 2:
                problems.append(f"{name}: -defaultReplication={replication} keeps one copy of each volume")
            if len(volume_servers) < copies:
                problems.append(f"{name}: {copies} copies need {copies} volume servers, it has {volume_servers}")
    else:
        problems.append("no replicated object store: neither distributed MinIO nodes nor a SeaweedFS master")
    return problems


# -- NATS identities (one per role, docs/security.md) ----------------------------------------------
NATS_AUTH_CONF = "deploy/nats-auth.conf"
#: The NATS identity (EPD_NATS_USER) of an epd-serve service, by the module it runs.
NATS_ROLE_OF_MODULE = {
    "services.api": "api",
    "services.encoder": "encoder",
    "services.prefill": "prefill",
    "services.decode": "decode",
}
#: Command-line flags that would replace the configuration's users with one account.
_AUTH_FLAGS = ("--user", "--pass", "--auth")


def nats_auth_conf_problems(text: str | None) -> list[str]:
    """The committed deploy/nats-auth.conf is what shared/nats_auth.py generates."""
    from shared.tools.nats_identities import compose_nats_auth

    if text is None:
        return [f"{NATS_AUTH_CONF} is missing (`epd config docs` writes it)"]
    if text != compose_nats_auth():
        return [f"{NATS_AUTH_CONF} differs from shared/nats_auth.py's permissions: regenerate it (`epd config docs`)"]
    return []


@dataclass(frozen=True)
class DeployedApp:
    """An epd-serve service of ``apps`` as the compose model defines it."""

    name: str
    spec: AppSpec
    service: Mapping
    env: dict[str, str]

    @property
    def role(self) -> str:
        """Its identity, by the module it runs: its NATS user and its store role."""
        return NATS_ROLE_OF_MODULE[self.spec.module]


def deployed_apps(compose: Mapping, apps: Mapping[str, AppSpec]) -> Iterator[DeployedApp]:
    """Each service of ``apps`` the compose model has, in ``apps``' order (a missing one is
    :func:`compose_problems`' to report)."""
    services = compose["services"]
    for name, spec in apps.items():
        svc = services.get(name)
        if svc is not None:
            yield DeployedApp(name, spec, svc, environment(svc))


def handed(compose: Mapping, variables: Iterable[str], *, skip: Iterable[str]) -> Iterator[tuple[str, list[str]]]:
    """Each service not in ``skip`` whose environment names any of ``variables``: (its name,
    those variables, sorted)."""
    wanted, skipped = set(variables), set(skip)
    for name, svc in compose["services"].items():
        if name not in skipped and (given := sorted({r.name for r in var_refs(str(environment(svc)))} & wanted)):
            yield name, given


def _required(value: str, var: str) -> bool:
    """Whether ``value`` is exactly ``${var:?...}``: the variable, required, no default."""
    return [(r.name, r.op) for r in var_refs(value)] == [(var, ":?")]


def nats_identity_problems(compose: Mapping, apps: Mapping[str, AppSpec], read_file=read_repo_file) -> list[str]:
    """Every NATS node knows every deployed role as a user with permissions, its password read
    from a required variable of the node's environment (none on the command line, which would
    replace them); every epd-serve service connects as its own role with that role's password;
    no other service is handed a NATS password."""
    from shared.tools.nats_identities import DEPLOYED_ROLES, password_variable

    services = compose["services"]
    variables = {role.value: password_variable(role) for role in DEPLOYED_ROLES}
    problems = []
    nodes = nats_nodes(compose)
    if not nodes:
        problems.append("no NATS node")
    for name in nodes:
        svc = services[name]
        conf, conf_problems = nats_node_conf(name, svc, read_file)
        problems += conf_problems
        auth = conf.get("authorization") if isinstance(conf.get("authorization"), Mapping) else {}
        users = {str(u.get("user")): u for u in auth.get("users") or [] if isinstance(u, Mapping)}
        if sorted(users) != sorted(variables):
            problems.append(f"{name}: NATS users {sorted(users)}, expected one per role {sorted(variables)}")
        for user, var in variables.items():
            entry = users.get(user)
            if entry is None:
                continue
            if entry.get("password") != "$" + var:
                problems.append(f"{name}: user {user}'s password is {entry.get('password')!r}, not ${var}")
            if not isinstance(entry.get("permissions"), Mapping):
                problems.append(f"{name}: user {user} has no permissions (it could do anything)")
        command = [str(a) for a in svc.get("command") or []]
        for flag in _AUTH_FLAGS:
            if _flag(command, flag) is not None:
                problems.append(f"{name}: {flag} on the command line replaces the per-role users")
        env = environment(svc)
        for var in variables.values():
            if not _required(env.get(var, ""), var):
                problems.append(f"{name}: {var}={env.get(var)!r} is not ${{{var}:?...}} (required, no default)")
    for app in deployed_apps(compose, apps):
        if app.env.get("EPD_NATS_USER") != app.role:
            problems.append(
                f"{app.name}: EPD_NATS_USER={app.env.get('EPD_NATS_USER')!r}, expected its role {app.role!r}"
            )
        if not _required(app.env.get("EPD_NATS_PASSWORD", ""), variables[app.role]):
            problems.append(
                f"{app.name}: EPD_NATS_PASSWORD={app.env.get('EPD_NATS_PASSWORD')!r} is not its role's "
                f"${{{variables[app.role]}:?...}}"
            )
    servers = [name for name, svc in services.items() if "EPD_NATS_IMAGE" in str(svc.get("image", ""))]
    for name, given in handed(compose, variables.values(), skip=[*apps, *servers]):  # (a server, on or off)
        problems.append(f"{name}: is handed NATS passwords {given}")
    return problems


# -- TLS on every link (docs/security.md; docker-compose.yml's one-shot `certs`) --------------------
#: Where the services find the CA, and the settings that point at it.
TLS_CLIENT_SETTINGS = ("EPD_NATS_TLS_CA", "EPD_S3_TLS_CA")


def _mount_targets(service: Mapping) -> list[str]:
    targets = []
    for vol in service.get("volumes") or []:
        if isinstance(vol, Mapping):
            targets.append(str(vol.get("target", "")))
        else:
            parts = str(vol).split(":")
            if len(parts) >= 2:
                targets.append(parts[1])
    return targets


def _mounted(service: Mapping, path: str) -> bool:
    """Whether ``path`` lies in one of the service's mounts (a file of a volume or a bind)."""
    return any(t and (path == t or path.startswith(t.rstrip("/") + "/")) for t in _mount_targets(service))


def _after(services: Mapping, name: str, dep: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether ``name`` starts only after ``dep`` (its depends_on, followed through)."""
    deps = services.get(name, {}).get("depends_on") or {}
    return dep in deps or any(_after(services, d, dep, seen | {name}) for d in deps if d not in seen)


def tls_problems(compose: Mapping, apps: Mapping[str, AppSpec], read_file=read_repo_file) -> list[str]:
    """Every link TLS, verified: each NATS node's client port requires TLS from the first byte
    (a ``tls`` block with its certificate and key, mounted, and ``handshake_first``), a cluster
    node's routes TLS verified against a CA; each MinIO server HTTPS (``--certs-dir``, mounted; a
    distributed one's drives https://); every epd-serve service verifies NATS and S3 against a CA
    file it has mounted, and S3 is secure; the API serves HTTPS; minio-init trusts the CA; and
    everything that reads the certificates starts after the one-shot ``certs`` that makes them."""
    services = compose["services"]
    problems = []
    readers = []
    for name in nats_nodes(compose):
        svc = services[name]
        conf, conf_problems = nats_node_conf(name, svc, read_file)
        problems += conf_problems
        tls = conf.get("tls") if isinstance(conf.get("tls"), Mapping) else None
        if tls is None:
            problems.append(f"{name}: the client port does not require TLS (no tls block)")
        else:
            for key in ("cert_file", "key_file"):
                if not tls.get(key):
                    problems.append(f"{name}: its tls block has no {key}")
                elif not _mounted(svc, str(tls[key])):
                    problems.append(f"{name}: tls {key} {tls[key]} is not in a mount")
            if str(tls.get("handshake_first", "")).lower() != "true":
                problems.append(f"{name}: tls without handshake_first (a client could send its password in the clear)")
        node, _ = nats_node(name, svc, read_file)
        if node.cluster_port is not None:
            cluster = conf.get("cluster") if isinstance(conf.get("cluster"), Mapping) else {}
            route_tls = cluster.get("tls") if isinstance(cluster.get("tls"), Mapping) else None
            if route_tls is None:
                problems.append(f"{name}: its cluster routes are plaintext (no cluster tls block)")
            else:
                for key in ("cert_file", "key_file", "ca_file"):
                    if not route_tls.get(key) or not _mounted(svc, str(route_tls[key])):
                        problems.append(f"{name}: cluster tls {key} {route_tls.get(key)!r} is not a mounted file")
        readers.append(name)
    for name, svc in services.items():
        command = [str(a) for a in svc.get("command") or []]
        if not (_is_active(svc) and "EPD_MINIO_IMAGE" in str(svc.get("image", "")) and command[:1] == ["server"]):
            continue
        certs_dir = _flag(command, "--certs-dir", "-S")
        if certs_dir is None:
            problems.append(f"{name}: MinIO serves plain HTTP (no --certs-dir)")
        elif not _mounted(svc, certs_dir):
            problems.append(f"{name}: --certs-dir {certs_dir} is not in a mount")
        plain = [e for e in minio_endpoints(command) if e.startswith("http://")]
        if plain:
            problems.append(f"{name}: MinIO nodes talk plain HTTP to each other: {plain}")
        readers.append(name)
    init = services.get("minio-init")
    if init is not None:
        env = environment(init)
        if interpolate(str(env.get("EPD_S3_SECURE", "")), {}).lower() != "true":
            problems.append("minio-init: EPD_S3_SECURE is not true by default (mc would talk plain HTTP)")
        ca = interpolate(str(env.get("EPD_S3_TLS_CA", "")), {})
        if not ca or not _mounted(init, ca):
            problems.append(f"minio-init: its CA {ca!r} is not a mounted file")
        script = " ".join(str(c) for c in init.get("command") or [])
        if "mc " in script and "certs/CAs" not in script:  # (the test stand-in's init reads EPD_S3_TLS_CA)
            problems.append("minio-init: mc is not given the CA (its config folder's certs/CAs)")
    for app in deployed_apps(compose, apps):
        name, svc = app.name, app.service
        env = {
            k: interpolate(str(v), {})
            for k, v in app.env.items()
            if k in (*TLS_CLIENT_SETTINGS, "EPD_S3_SECURE", "EPD_TLS_CERT", "EPD_TLS_KEY", "EPD_TLS_CA")
        }  # the defaults
        for var in TLS_CLIENT_SETTINGS:
            if not env.get(var):
                problems.append(f"{name}: {var} is empty by default: it would not verify the server")
            elif not _mounted(svc, env[var]):
                problems.append(f"{name}: {var}={env[var]} is not in a mount")
        if env.get("EPD_S3_SECURE", "").lower() != "true":
            problems.append(f"{name}: EPD_S3_SECURE is not true by default (plain HTTP to the store)")
        if app.spec.health_role == "api":
            for var in ("EPD_TLS_CERT", "EPD_TLS_KEY", "EPD_TLS_CA"):
                if not env.get(var) or not _mounted(svc, env[var]):
                    problems.append(f"{name}: {var}={env.get(var)!r} is not a mounted file (the API would serve HTTP)")
        readers.append(name)
    if "certs" not in services:
        problems.append("no one-shot `certs` service makes the certificates")
    else:
        for name in readers:
            if not _after(services, name, "certs"):
                problems.append(f"{name}: starts without waiting for `certs`")
    return problems


# -- store identities (one MinIO account per role, docs/security.md "Store identities") -------------
MINIO_POLICIES = "deploy/minio-policies"
#: Where minio-init reads the policies (the mount of deploy/minio-policies).
POLICY_MOUNT = "/policies"


def minio_policy_problems(read_file=read_repo_file) -> list[str]:
    """The committed deploy/minio-policies/<role>.json are what shared/store_auth.py renders."""
    from shared.store_auth import compose_minio_policies

    problems = []
    for path, text in compose_minio_policies().items():
        committed = read_file(str(path))
        if committed is None:
            problems.append(f"{path} is missing (`epd config docs` writes it)")
        elif committed != text:
            problems.append(
                f"{path} differs from shared/store_auth.py's permissions: regenerate it (`epd config docs`)"
            )
    return problems


def _role_call(role: str) -> str:
    from shared.store_auth import access_key_variable, secret_key_variable

    return f'role_account {role} "${access_key_variable(role)}" "${secret_key_variable(role)}"'


#: What minio-init's role_account does for each role (its script, `$$` read as `$`).
MINIO_INIT_STEPS = {
    "creates the role's policy from its file": f'mc admin policy create epd "epd-$1" "{POLICY_MOUNT}/$1.json"',
    "creates the role's account": 'mc admin user add epd "$2" "$3"',
    "attaches the policy to the account": 'mc admin policy attach epd "epd-$1" --user "$2"',
    "refuses the root's or another role's access key": '*" $2 "*) echo',
    "remembers each role's access key (two roles could share one)": 'seen="$seen$2 "',
}


def store_identity_problems(compose: Mapping, apps: Mapping[str, AppSpec]) -> list[str]:
    """Every epd-serve service reaches the store with its own role's keys only
    (``EPD_S3_ACCESS_KEY`` / ``EPD_S3_SECRET_KEY`` from ``${S3_<ROLE>_ACCESS_KEY:?...}`` /
    ``${S3_<ROLE>_SECRET_KEY:?...}``), never the MinIO root account or another role's; minio-init
    holds every role's keys (required), mounts deploy/minio-policies, and for each role creates its
    policy from its file, its account, and attaches the one to the other; no other service holds a
    role's keys."""
    from shared.store_auth import STORE_ROLES, access_key_variable, secret_key_variable

    services = compose["services"]
    role_vars = {role.value: (access_key_variable(role), secret_key_variable(role)) for role in STORE_ROLES}
    every_role_var = {v for pair in role_vars.values() for v in pair}
    root_vars = {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"}
    problems = []
    for app in deployed_apps(compose, apps):
        own = role_vars[app.role]
        for setting, var in zip(("EPD_S3_ACCESS_KEY", "EPD_S3_SECRET_KEY"), own, strict=True):
            if not _required(app.env.get(setting, ""), var):
                problems.append(f"{app.name}: {setting}={app.env.get(setting)!r} is not its role's ${{{var}:?...}}")
        given = {r.name for r in var_refs(str(app.env))}
        if given & root_vars:
            problems.append(f"{app.name}: is handed the MinIO root account {sorted(given & root_vars)}")
        others = sorted(given & (every_role_var - set(own)))
        if others:
            problems.append(f"{app.name}: is handed another role's store keys {others}")
    init = services.get("minio-init")
    if init is None:
        problems.append("no minio-init: nobody creates the roles' accounts")
    else:
        env = environment(init)
        for var in sorted(every_role_var):
            if not _required(env.get(var, ""), var):
                problems.append(f"minio-init: {var}={env.get(var)!r} is not ${{{var}:?...}} (required, no default)")
        script = "\n".join(str(c) for c in init.get("command") or []).replace("$$", "$")
        is_mc = "mc " in script  # (the test stand-in's init renders the same table for SeaweedFS)
        if is_mc:
            mounts = [str(v) for v in init.get("volumes") or []]
            if f"./{MINIO_POLICIES}:{POLICY_MOUNT}:ro" not in mounts:
                problems.append(f"minio-init: {MINIO_POLICIES} is not mounted read-only at {POLICY_MOUNT}")
            for what, step in MINIO_INIT_STEPS.items():
                if step not in script:
                    problems.append(f"minio-init: no `{step}`: it no longer {what}")
            for role in role_vars:
                if _role_call(role) not in script:
                    problems.append(f"minio-init: no account for {role} (`{_role_call(role)}`)")
    for name, given in handed(compose, every_role_var, skip=[*apps, "minio-init"]):
        problems.append(f"{name}: is handed the roles' store keys {given}")
    return problems
