"""The layers and the import graph, checked statically.

* (a) the import-linter contracts in pyproject.toml (``[tool.importlinter]``, also ``make
  check-layers``) hold: the layers of the whole tree (tools > services > model workers > engines >
  connectors > EC lifecycle > store > transport > schema / settings > core), the engines
  independent inside ``shared.engines``, the services independent of each other, ``shared`` never
  importing a service, only the tools importing the tools, no worker importing the URL fetcher or
  httpx, no cycle between the subpackages of a package. Each contract gets a synthetic violation
  (a copy of the tree with one import added);
* (b) no import cycle between any two modules of ``shared`` / ``services`` (grimp's graph; type-only
  imports under ``TYPE_CHECKING`` count: they couple the modules all the same), and every module
  sits in a layer of the layers contract, so a new module cannot slip past it;
* (c) the API process, the ``epd`` CLI and ``epd healthcheck`` do not load torch or vLLM when
  they start (a subprocess imports them and looks at ``sys.modules``);
* (d) the kv/ec transfer-param keys are spelled only in ``shared/connectors/params.py``;
* (e) what import-linter cannot see: a dynamic import of a constant module name
  (``importlib.import_module("shared.x")``; write an import statement instead), and ``bench/``
  (scripts, not a package): bench imports the library, the tools (and test helpers), never a service, and
  nothing imports bench;
* (f) every NATS subject is built in ``shared/protocol.py`` (``Subjects``): no f-string puts the
  prefix before a dot elsewhere, no ``$JS.`` / ``$KV.`` literal.

Each checker also gets a synthetic violation (a negative control), so a checker that sees
nothing cannot pass.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "services")
PARAMS_MODULE = "shared.connectors.params"
#: Heavy modules that processes without an engine must not load.
HEAVY = ("torch", "vllm")
#: The bench scripts' own modules (they import each other as top-level names: ``import harness``).
BENCH_MODULES = frozenset(path.stem for path in (ROOT / "bench").glob("*.py"))


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
            found += [
                (f"{base}.{alias.name}" if base else alias.name, node.lineno)
                for alias in node.names
                if alias.name != "*"
            ]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("import_module", "__import__"):
                found.append((node.args[0].value, node.lineno))
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# -- the checkers of (c) and (d) -------------------------------------------------------------
def transfer_param_keys() -> dict[str, str]:
    """The key constants of shared/connectors/params.py (module-level ``NAME = "literal"``)."""
    tree = ast.parse((ROOT / "shared" / "connectors" / "params.py").read_text())
    keys = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id.isupper()
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            keys[node.value.value] = node.targets[0].id
    return keys


def spelled_keys(module: str, source: str, keys: dict[str, str]) -> list[str]:
    """(d) String literals equal to a transfer-param key outside shared.connectors.params
    (prose that mentions a key, e.g. in a docstring, is not a literal equal to it)."""
    if module == PARAMS_MODULE:
        return []
    return sorted(
        {
            f"{module}:{node.lineno} spells {node.value!r} (use params.{keys[node.value]})"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in keys
        }
    )


def heavy_modules_loaded(statements: str, *, extra_path: Path | None = None) -> list[str]:
    """(c) Which of HEAVY a fresh interpreter has loaded after running ``statements``."""
    code = f"{statements}\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    path = [str(extra_path)] if extra_path else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path + [str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- (a) the import-linter contracts -----------------------------------------------------------
def import_linter_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]


def lint_imports(root: Path) -> tuple[int, dict[str, str], str]:
    """Run ``lint-imports`` on the tree under ``root`` (its pyproject.toml): (exit status,
    contract name -> "KEPT" / "BROKEN", output)."""
    script = Path(sys.executable).with_name("lint-imports")
    assert script.exists(), f"import-linter is not installed next to {sys.executable}"
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [str(script), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = proc.stdout + proc.stderr
    # Long contract names are wrapped over lines: join the report's lines before matching names.
    flat = " ".join(out.split())
    status = {
        c["name"]: m.group(1)
        for c in import_linter_config()["contracts"]
        if (m := re.search(re.escape(" ".join(c["name"].split())) + r" (KEPT|BROKEN)", flat))
    }
    return proc.returncode, status, out


def copy_tree(dst: Path) -> Path:
    """A copy of the packages (caches aside) and pyproject.toml under ``dst``, to break on purpose."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, dst / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_import_contracts_hold():
    names = [c["name"] for c in import_linter_config()["contracts"]]
    assert {c["type"] for c in import_linter_config()["contracts"]} >= {
        "layers",
        "independence",
        "forbidden",
        "protected",
        "acyclic_siblings",
    }
    status, kept, out = lint_imports(ROOT)
    assert status == 0 and kept == dict.fromkeys(names, "KEPT"), out[-5000:]


#: contract id -> (file, line appended to it): an import each contract must refuse.
VIOLATIONS = {
    # the store importing the EC lifecycle, a layer above it (no cycle: only the layers break)
    "layers": ("shared/store/objects.py", "from shared.ec_lifecycle import index\n"),
    "engines": ("shared/engines/vllm_engine.py", "def f():\n    from shared.engines import transformers_engine\n"),
    "services-independent": ("services/api/app.py", "from services.prefill import handler\n"),
    "library-below-services": ("shared/tools/launcher.py", "import services.api.app\n"),
    "tools-on-top": ("shared/worker.py", "def f():\n    from shared.tools import replay\n"),
    # the encoder decodes images; fetching their URLs is the API's (the layers allow the import)
    "workers-do-not-fetch": ("services/encoder/handler.py", "def f():\n    from shared.fetch import ImageFetcher\n"),
    # a type-only import back: index <- janitor already imports the other way
    "acyclic": (
        "shared/ec_lifecycle/index.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shared.ec_lifecycle.janitor import Janitor\n",
    ),
}


@pytest.mark.parametrize("contract_id", sorted(VIOLATIONS))
def test_import_contracts_see_violations(tmp_path, contract_id):
    assert set(VIOLATIONS) == {c["id"] for c in import_linter_config()["contracts"]}  # one per contract
    name = next(c["name"] for c in import_linter_config()["contracts"] if c["id"] == contract_id)
    root = copy_tree(tmp_path)
    path, line = VIOLATIONS[contract_id]
    with open(root / path, "a", encoding="utf-8") as f:
        f.write("\n" + line)
    status, result, out = lint_imports(root)
    assert status != 0 and result.get(name) == "BROKEN", out[-5000:]


# -- (b) no cycles; every module in a layer ----------------------------------------------------
def build_graph(*packages: str) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports (anywhere in it, TYPE_CHECKING included)."""
    graph = grimp.build_graph(*packages, cache_dir=None)
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing
    itself): each is a set of modules that import each other, directly or not (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_import_cycles():
    graph = build_graph(*PACKAGES)
    # The graph has the imports inside functions and the type-only ones.
    assert "shared.engines.transformers_batch" in graph["shared.engines.transformers_engine"]
    assert "shared.engines.base" in graph["shared.token_stream"]
    assert import_cycles(graph) == []


def test_cycle_finder_sees_cycles(tmp_path, monkeypatch):
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"a"}}) == [["a"]]
    assert import_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b"], ["c", "d"]]
    # Controls: a chain and a diamond are not cycles.
    assert import_cycles({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) == []
    # A synthetic package: a lazy import and a type-only import close cycles too.
    pkg = tmp_path / "cyclic_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclic_pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from cyclic_pkg import a\n")
    (pkg / "c.py").write_text("from cyclic_pkg import a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyclic_pkg import e\n")
    (pkg / "e.py").write_text("import cyclic_pkg.d\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles(build_graph("cyclic_pkg")) == [
        ["cyclic_pkg.a", "cyclic_pkg.b"],
        ["cyclic_pkg.d", "cyclic_pkg.e"],
    ]


def layer_modules() -> list[str]:
    """The modules the layers contract names (``a : b`` and ``a | b`` list two)."""
    layers = next(c for c in import_linter_config()["contracts"] if c["id"] == "layers")["layers"]
    return [m.strip() for layer in layers for m in re.split(r"[:|]", layer)]


def modules_outside_layers(graph: dict[str, set[str]], layered: list[str]) -> list[str]:
    """Modules in no layer (a package that is only a container of layers - no layer names it or
    an ancestor - may stay out when it imports nothing)."""
    out = []
    for module, imports in graph.items():
        if any(_within(module, m) for m in layered):
            continue
        if imports or not any(_within(m, module) for m in layered):
            out.append(module)
    return sorted(out)


def test_every_module_is_in_a_layer():
    graph = build_graph(*PACKAGES)
    layered = layer_modules()
    assert all(m in graph for m in layered), sorted(set(layered) - set(graph))
    assert modules_outside_layers(graph, layered) == []


def test_layer_coverage_check_sees_violations():
    layered = ["p.x", "p.y"]
    graph = {"p": set(), "p.x": set(), "p.x.inner": {"p.y"}, "p.y": set(), "p.new": set(), "p.sub": {"p.x"}, "q": set()}
    assert modules_outside_layers(graph, layered) == ["p.new", "p.sub", "q"]
    # A container package that imports something is not exempt.
    assert modules_outside_layers({"p": {"p.x"}, "p.x": set()}, ["p.x"]) == ["p"]


# -- (c) no torch / vLLM in the API and the CLI ------------------------------------------------
@pytest.mark.parametrize(
    "statements",
    [
        "import services.api.app, services.api.main",
        "import shared.tools.cli\nshared.tools.cli.build_parser()",
        "import shared.health",
    ],
    ids=["api", "epd-cli", "healthcheck"],
)
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
        "shared.engines.vllm_engine:2 spells 'epd_kv_key' (use params.KV_KEY)",
    ]
    # Controls: params.py itself, and prose that mentions a key.
    assert spelled_keys(PARAMS_MODULE, src, keys) == []
    assert spelled_keys("shared.connectors.s3_kv", '"""Reads epd_kv_key from the request."""\n', keys) == []


# -- (e) what import-linter cannot see ----------------------------------------------------------
def dynamic_imports(module: str, source: str) -> list[str]:
    """``importlib.import_module("<constant>")`` / ``__import__("<constant>")``: invisible to
    import-linter, so not allowed in the packages (a registry that names its plugins in strings,
    ``shared.engines.ENGINES``, imports them through a variable, inside its own package)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("import_module", "__import__"):
                out.add(f"{module}:{node.lineno} imports {node.args[0].value} dynamically")
    return sorted(out)


def test_no_dynamic_imports_of_constant_names():
    files = sources(*PACKAGES)
    assert any(name == "shared.engines" for name, *_ in files)
    assert [p for name, _, _, src in files for p in dynamic_imports(name, src)] == []


def test_dynamic_import_check_sees_violations():
    src = "import importlib\ndef f():\n    return importlib.import_module('shared.tools.replay')\n__import__('torch')\n"
    assert dynamic_imports("shared.worker", src) == [
        "shared.worker:3 imports shared.tools.replay dynamically",
        "shared.worker:4 imports torch dynamically",
    ]
    assert dynamic_imports("shared.x", "from importlib import import_module\nimport_module('services.api')\n") == [
        "shared.x:2 imports services.api dynamically"
    ]
    # Controls: a name in a variable (a registry), and an import statement.
    assert dynamic_imports("shared.engines", "import importlib\nimportlib.import_module(name)\n") == []
    assert dynamic_imports("shared.x", "import shared.tools.replay\n") == []


def bench_imports(module: str, source: str) -> list[str]:
    """Imports of a service by a bench script: bench drives the system over HTTP and the tools
    (it may import the library, the tools, its sibling scripts and the test helpers)."""
    out = set()
    for name, line in imported_modules(module, source):
        if _within(name, "services"):
            out.add(f"bench/{module}.py:{line} imports {name}")
    return sorted(out)


def imports_of_bench(module: str, source: str, *, is_package: bool = False) -> list[str]:
    """Imports of the bench scripts (``bench``, ``bench.x`` or a script's own name) from the
    packages or the tests."""
    out = set()
    for name, line in imported_modules(module, source, is_package=is_package):
        top = name.split(".")[0]
        if top == "bench" or top in BENCH_MODULES:
            out.add(f"{module}:{line} imports {name}")
    return sorted(out)


def test_bench_imports_only_the_library_and_nothing_imports_bench():
    scripts = sorted((ROOT / "bench").glob("*.py"))
    assert {"harness", "run"} <= BENCH_MODULES and len(scripts) >= 5
    assert any(
        name.startswith("shared.tools")
        for path in scripts
        for name, _ in imported_modules(path.stem, path.read_text(encoding="utf-8"))
    )
    assert [p for path in scripts for p in bench_imports(path.stem, path.read_text(encoding="utf-8"))] == []
    assert [
        p
        for name, is_pkg, _, src in sources(*PACKAGES, "tests")
        for p in imports_of_bench(name, src, is_package=is_pkg)
    ] == []


def test_bench_checks_see_violations():
    assert bench_imports("p1", "import harness as h\nfrom services.api.app import ApiService\n") == [
        "bench/p1.py:2 imports services.api.app",
        "bench/p1.py:2 imports services.api.app.ApiService",
    ]
    assert bench_imports("run", "def f():\n    import services.decode.handler\n") == [
        "bench/run.py:2 imports services.decode.handler"
    ]
    assert imports_of_bench("shared.tools.bench.plan", "def f():\n    import harness\n") == [
        "shared.tools.bench.plan:2 imports harness"
    ]
    assert imports_of_bench("tests.test_x", "from bench import run\n") == [
        "tests.test_x:1 imports bench",
        "tests.test_x:1 imports bench.run",
    ]
    # Controls: bench may import the library, the tools, its siblings and third-party modules;
    # the tools' own bench package is not the bench scripts.
    ok = (
        "import harness as h\nfrom shared.tools.bench.schema import WorkloadSpec\n"
        "from shared.cpus import split_cpus\n"
        "import httpx\nfrom tests.epdup import EpdUp\n"
    )
    assert bench_imports("p4", ok) == []
    assert imports_of_bench("shared.tools.cli", "from shared.tools.bench import plan\n") == []


# -- (f) every subject is built in shared/protocol.py (Subjects) -------------------------------
PROTOCOL_MODULE = "shared.protocol"
NATS_SPACES = ("$JS.", "$KV.", "$SYS.", "$OBJ.")


def _is_prefix(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "prefix") or (
        isinstance(node, ast.Name) and node.id in ("prefix", "p")
    )


def hand_built_subjects(module: str, source: str) -> list[str]:
    """Subjects spelled outside ``shared.protocol``: an f-string that puts the deployment prefix
    before a dot (``f"{subjects.prefix}.ec.ready.>"``), and NATS's own subject spaces
    (``$JS.``, ``$KV.``, ...). A prefix quoted in prose (``EPD_SUBJECT_PREFIX={subjects.prefix}``) is not
    followed by a dot."""
    if module == PROTOCOL_MODULE:
        return []
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            parts = node.values
            for i, part in enumerate(parts[:-1]):
                nxt = parts[i + 1]
                if (
                    isinstance(part, ast.FormattedValue)
                    and _is_prefix(part.value)
                    and isinstance(nxt, ast.Constant)
                    and str(nxt.value).startswith(".")
                ):
                    out.add(f"{module}:{node.lineno} builds a subject from the prefix")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(NATS_SPACES):
            out.add(f"{module}:{node.lineno} spells {node.value!r}")
    return sorted(out)


def test_subjects_are_built_in_the_protocol():
    files = sources(*PACKAGES)
    assert [p for name, _, _, src in files for p in hand_built_subjects(name, src)] == []
    # The protocol itself does spell them (the checker reads what it should).
    assert [p for name, _, _, src in files if name == PROTOCOL_MODULE for p in hand_built_subjects("x", src)] != []


def test_subject_check_sees_violations():
    src = (
        'sub = await nc.subscribe(f"{self.subjects.prefix}.ec.ready.>")\n'
        'scan(f"{subjects.prefix}.ec.*.*.{item}")\n'
        'x = f"{prefix}.tokens.{rid}"\n'
        'adv = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.S.C"\n'
        'kv = f"$KV.{bucket}.{key}"\n'
    )
    assert hand_built_subjects("shared.store.janitor", src) == [
        "shared.store.janitor:1 builds a subject from the prefix",
        "shared.store.janitor:2 builds a subject from the prefix",
        "shared.store.janitor:3 builds a subject from the prefix",
        "shared.store.janitor:4 spells '$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.S.C'",
        "shared.store.janitor:5 spells '$KV.'",
    ]
    # Controls: the protocol module, a prefix in prose, a path under an object prefix, Subjects' methods.
    assert hand_built_subjects(PROTOCOL_MODULE, src) == []
    assert (
        hand_built_subjects(
            "shared.tools.replay",
            'm = f"use EPD_SUBJECT_PREFIX={subjects.prefix}"\nk = f"{self.prefix}/{name}"\ns = subjects.ec_ready_all\n',
        )
        == []
    )
