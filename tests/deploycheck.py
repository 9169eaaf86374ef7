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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

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


def compose_problems(
    compose: Mapping, apps: Mapping[str, AppSpec], *, dockerfile_targets: set[str], image_version: str, model_path: str
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
        for dep, cond in (
            ("nats", "service_healthy"),
            ("minio", "service_healthy"),
            ("minio-init", "service_completed_successfully"),
        ):
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
