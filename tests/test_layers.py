"""The layers, checked statically (``ast``, no imports of the code under test except in (c)).

* (a) the runtime library (``shared/`` outside ``shared/tools/``) and the services never import
  the operator and development tools (``shared.tools``), lazily inside a function or not;
* (b) a service never imports another service (``services/<x>/`` -> ``services/<y>/``);
* (c) the API process, the ``epd`` CLI and ``epd healthcheck`` do not load torch or vLLM when
  they start (a subprocess imports them and looks at ``sys.modules``);
* (d) the kv/ec transfer-param keys are spelled only in ``shared/connectors/params.py``;
* (e) nothing under ``shared/`` imports a service (the library sits below the services; the
  CLI starts them by module name, ``python -m services.<name>``).

Each checker also gets a synthetic violation (a negative control), so a checker that sees
nothing cannot pass.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = "shared.tools"
PARAMS_MODULE = "shared.connectors.params"
#: Heavy modules that processes without an engine must not load.
HEAVY = ("torch", "vllm")


# -- reading the tree --------------------------------------------------------------------------
def module_name(path: Path) -> tuple[str, bool]:
    """(dotted module name, is a package ``__init__``) of a file under ROOT."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def sources(*tops: str) -> list[tuple[str, bool, Path, str]]:
    """(module, is_package, path, source) of every .py file under the given top folders."""
    found = []
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            name, is_pkg = module_name(path)
            found.append((name, is_pkg, path, path.read_text(encoding="utf-8")))
    return found


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute module a ``from <level dots><target> import`` in ``module`` refers to."""
    if level == 0:
        return target or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (level - 1)] if level > 1 else package
    return ".".join(base + ([target] if target else []))


def imported_modules(module: str, source: str, *, is_package: bool = False) -> list[tuple[str, int]]:
    """(module, line) for every import anywhere in ``source`` - top level, inside functions,
    under ``TYPE_CHECKING`` - and every ``importlib.import_module("<constant>")``. For
    ``from M import N`` both ``M`` and ``M.N`` are listed (``N`` may be a submodule)."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.level, node.module)
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}" if base else alias.name, node.lineno)
                      for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("import_module", "__import__"):
                found.append((node.args[0].value, node.lineno))
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# -- the checkers ------------------------------------------------------------------------------
def tools_imports(module: str, source: str, *, is_package: bool = False) -> list[str]:
    """(a) Imports of shared.tools from the runtime library or a service."""
    if _within(module, TOOLS) or not (_within(module, "shared") or _within(module, "services")):
        return []
    return sorted({f"{module}:{line} imports {name}" for name, line in imported_modules(module, source,
                                                                                       is_package=is_package)
                   if _within(name, TOOLS)})


def cross_service_imports(module: str, source: str, *, is_package: bool = False) -> list[str]:
    """(b) Imports of one service's modules by another service (or by the ``services`` package)."""
    parts = module.split(".")
    if parts[0] != "services":
        return []
    own = parts[1] if len(parts) > 1 else None
    out = set()
    for name, line in imported_modules(module, source, is_package=is_package):
        target = name.split(".")
        if target[0] == "services" and len(target) > 1 and target[1] != own:
            out.add(f"{module}:{line} imports {'.'.join(target[:2])}")
    return sorted(out)


def service_imports(module: str, source: str, *, is_package: bool = False) -> list[str]:
    """(e) Imports of the services from the shared library (tools included)."""
    if not _within(module, "shared"):
        return []
    return sorted({f"{module}:{line} imports {name}" for name, line in imported_modules(module, source,
                                                                                       is_package=is_package)
                   if _within(name, "services")})


def transfer_param_keys() -> dict[str, str]:
    """The key constants of shared/connectors/params.py (module-level ``NAME = "literal"``)."""
    tree = ast.parse((ROOT / "shared" / "connectors" / "params.py").read_text())
    keys = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.isupper() and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            keys[node.value.value] = node.targets[0].id
    return keys


def spelled_keys(module: str, source: str, keys: dict[str, str]) -> list[str]:
    """(d) String literals equal to a transfer-param key outside shared.connectors.params
    (prose that mentions a key, e.g. in a docstring, is not a literal equal to it)."""
    if module == PARAMS_MODULE:
        return []
    return sorted({f"{module}:{node.lineno} spells {node.value!r} (use params.{keys[node.value]})"
                   for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in keys})


def heavy_modules_loaded(statements: str, *, extra_path: Path | None = None) -> list[str]:
    """(c) Which of HEAVY a fresh interpreter has loaded after running ``statements``."""
    code = f"{statements}\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    path = [str(extra_path)] if extra_path else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path + [str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- (a) runtime and services do not import the tools ------------------------------------------
def test_runtime_and_services_do_not_import_the_tools():
    files = sources("shared", "services")
    assert any(name == "shared.tools.cli" for name, *_ in files) and any(n == "services.api.app" for n, *_ in files)
    problems = [p for name, is_pkg, _, src in files for p in tools_imports(name, src, is_package=is_pkg)]
    assert problems == []


def test_tools_import_check_sees_violations():
    lazy = "def page():\n    from shared.tools import replay\n    return replay\n"
    assert tools_imports("shared.store.ec", lazy) == ["shared.store.ec:2 imports shared.tools",
                                                       "shared.store.ec:2 imports shared.tools.replay"]
    assert tools_imports("services.api.app", "import shared.tools.replay\n") == [
        "services.api.app:1 imports shared.tools.replay"]
    assert tools_imports("services.api.app", "from shared import tools\n") == [
        "services.api.app:1 imports shared.tools"]
    assert tools_imports("shared.store.ec", "from ..tools.infra import free_port\n") == [
        "shared.store.ec:1 imports shared.tools.infra", "shared.store.ec:1 imports shared.tools.infra.free_port"]
    assert tools_imports("shared", "from .tools import cli\n", is_package=True) == [
        "shared:1 imports shared.tools", "shared:1 imports shared.tools.cli"]
    assert tools_imports("shared.worker", "import importlib\nimportlib.import_module('shared.tools.replay')\n") == [
        "shared.worker:2 imports shared.tools.replay"]
    src = "if TYPE_CHECKING:\n    from shared.tools.launcher import Stack\n"
    assert tools_imports("services.decode.handler", src) != []
    # Controls: the tools may import each other, and anyone may import the runtime library.
    assert tools_imports("shared.tools.cli", "from shared.tools.infra import EmbeddedNats\n") == []
    assert tools_imports("shared.store.ec", "from shared.toolsmith import x\nfrom shared import config\n") == []


# -- (b) services do not import each other -----------------------------------------------------
def test_services_do_not_import_each_other():
    files = sources("services")
    assert {name.split(".")[1] for name, *_ in files if name.count(".") >= 1} >= {"api", "encoder", "prefill",
                                                                                   "decode"}
    problems = [p for name, is_pkg, _, src in files for p in cross_service_imports(name, src, is_package=is_pkg)]
    assert problems == []


def test_cross_service_check_sees_violations():
    assert cross_service_imports("services.api.app", "from services.prefill.handler import PrefillHandler\n") == [
        "services.api.app:1 imports services.prefill"]
    assert cross_service_imports("services.decode.handler", "def f():\n    import services.prefill.handler\n") == [
        "services.decode.handler:2 imports services.prefill"]
    assert cross_service_imports("services.api.app", "from ..prefill import handler\n") == [
        "services.api.app:1 imports services.prefill"]
    assert cross_service_imports("services.api", "from services import encoder\n", is_package=True) == [
        "services.api:1 imports services.encoder"]
    # Controls: a service's own modules, and the shared library, are fine.
    own = "from services.api import schemas\nfrom . import schemas\nfrom .schemas import ChatRequest\n" \
          "from shared import protocol\n"
    assert cross_service_imports("services.api.app", own) == []
    assert cross_service_imports("services.api", "from . import app\n", is_package=True) == []


# -- (c) no torch / vLLM in the API and the CLI ------------------------------------------------
@pytest.mark.parametrize("statements", [
    "import services.api.app, services.api.main",
    "import shared.tools.cli\nshared.tools.cli.build_parser()",
    "import shared.health",
], ids=["api", "epd-cli", "healthcheck"])
def test_api_and_cli_start_without_torch_or_vllm(statements):
    assert heavy_modules_loaded(statements) == []


def test_heavy_import_check_sees_violations(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")  # a stand-in: the check is about sys.modules
    (tmp_path / "eager_torch.py").write_text("import torch\n")
    (tmp_path / "lazy_torch.py").write_text("def f():\n    import torch\n")
    assert heavy_modules_loaded("import eager_torch", extra_path=tmp_path) == ["torch"]
    # Control: an import inside a function runs only when called.
    assert heavy_modules_loaded("import lazy_torch", extra_path=tmp_path) == []


# -- (d) the transfer-param keys live in shared/connectors/params.py ---------------------------
def test_transfer_param_keys_are_spelled_once():
    keys = transfer_param_keys()
    assert {"epd_kv_key", "do_remote_prefill", "do_remote_decode", "epd_ec_sources"} <= set(keys), keys
    problems = [p for name, _, _, src in sources("shared", "services") for p in spelled_keys(name, src, keys)]
    assert problems == []


def test_key_check_sees_violations():
    keys = transfer_param_keys()
    src = 'params = {"do_remote_prefill": True}\nkey = params.get("epd_kv_key")\n'
    assert spelled_keys("shared.engines.vllm_engine", src, keys) == [
        "shared.engines.vllm_engine:1 spells 'do_remote_prefill' (use params.DO_REMOTE_PREFILL)",
        "shared.engines.vllm_engine:2 spells 'epd_kv_key' (use params.KV_KEY)"]
    # Controls: params.py itself, and prose that mentions a key.
    assert spelled_keys(PARAMS_MODULE, src, keys) == []
    assert spelled_keys("shared.connectors.s3_kv", '"""Reads epd_kv_key from the request."""\n', keys) == []


# -- (e) the library does not import the services ----------------------------------------------
def test_shared_does_not_import_the_services():
    problems = [p for name, is_pkg, _, src in sources("shared") for p in service_imports(name, src, is_package=is_pkg)]
    assert problems == []


def test_service_import_check_sees_violations():
    assert service_imports("shared.worker", "def f():\n    from services.api.app import ApiService\n") == [
        "shared.worker:2 imports services.api.app", "shared.worker:2 imports services.api.app.ApiService"]
    assert service_imports("shared.tools.replay", "import services.prefill.handler\n") == [
        "shared.tools.replay:1 imports services.prefill.handler"]
    # Controls: services import the library, and a name that only starts alike is not a service.
    assert service_imports("services.api.app", "from shared import protocol\n") == []
    assert service_imports("shared.worker", "import services_extra\n") == []
