"""docs/architecture.md keeps up with the tree (issue 46 item 6): a reader looking for a module finds it.

* its **Code layout** names every top-level module and package of ``shared/`` (``x.py``, ``x/``), every
  package of ``services/`` and every module of a service package (``params.py``, ``tool_parsers.py``, ...);
* its **layer table** names every module the import-linter layer contracts (``pyproject.toml``) place: a
  top-level module of the ``layers`` contract as ``x.py`` / ``x/`` (a service as ``services/x``), a module
  inside a container contract (``shared.engines``: ``grammar``, ...) by its name.

Each check gets a synthetic violation (a name taken out of the text), so a check that sees nothing cannot pass.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"


# -- reading the tree and the page ---------------------------------------------------------------
def tree_modules() -> dict[str, list[str]]:
    """What the code layout must name, per top folder: ``shared/``'s top-level modules (``x.py``) and
    packages (``x/``); ``services/``'s packages (``x/``) and their modules (``y.py``, ``__init__`` aside)."""
    shared = sorted(
        [p.name for p in (ROOT / "shared").glob("*.py") if p.stem != "__init__"]
        + [f"{p.name}/" for p in (ROOT / "shared").iterdir() if (p / "__init__.py").is_file()]
    )
    packages = [p for p in sorted((ROOT / "services").iterdir()) if (p / "__init__.py").is_file()]
    services = sorted(
        {f"{p.name}/" for p in packages} | {m.name for p in packages for m in p.glob("*.py") if m.stem != "__init__"}
    )
    return {"shared/": shared, "services/": services}


def section(text: str, heading: str) -> str:
    """The text of a ``## heading`` section (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/architecture.md has no section '## {heading}'"
    return match.group(1)


def layout_regions(text: str) -> dict[str, str]:
    """The code-layout block of the page, by top folder: ``{"shared/": its lines, "services/": ...}``
    (a region runs from an unindented ``folder/`` line to the next unindented line)."""
    block = re.search(r"^```\n(.*?)^```", section(text, "Code layout"), re.M | re.S)
    assert block, "the Code layout section has no fenced block"
    regions: dict[str, list[str]] = {}
    current: list[str] = []
    for line in block.group(1).splitlines():
        if line and not line[0].isspace():
            current = regions.setdefault(line.split()[0], [])
        current.append(line)
    return {top: "\n".join(lines) for top, lines in regions.items()}


def named(name: str, text: str) -> bool:
    """``name`` (``x.py``, ``x/``, ``services/x``, ``x``) is in ``text`` as a name of its own (or as
    ``shared/x``)."""
    return re.search(rf"(?<![\w/.])(?:shared/)?{re.escape(name)}(?![\w])", text) is not None


def unnamed_in_layout(text: str, modules: dict[str, list[str]]) -> list[str]:
    regions = layout_regions(text)
    return [f"{top}{name}" for top, names in modules.items() for name in names if not named(name, regions.get(top, ""))]


def contract_names() -> list[str]:
    """How the layer table names each module the layer contracts place."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    out: list[str] = []
    for contract in contracts:
        if contract["type"] != "layers":
            continue
        modules = [m.strip() for layer in contract["layers"] for m in re.split(r"[:|]", layer)]
        if contract.get("containers"):  # a layer inside a package: its module's own name
            out += [m.split(".")[-1] for m in modules]
            continue
        for module in modules:
            top, name = module.split(".")[:2]
            if top == "services":
                out.append(f"services/{name}")
            else:
                out.append(f"{name}/" if (ROOT / top / name / "__init__.py").is_file() else f"{name}.py")
    return sorted(set(out))


def layer_table(text: str) -> str:
    table = re.search(r"^\| layer \| modules \|\n(?:^\|.*\n)+", section(text, "Layers"), re.M)
    assert table, "the Layers section has no '| layer | modules |' table"
    return table.group(0)


def unnamed_in_layer_table(text: str, names: list[str]) -> list[str]:
    table = layer_table(text)
    return [n for n in names if not named(n, table)]


# -- the checks ----------------------------------------------------------------------------------
def test_the_code_layout_names_every_module_of_shared_and_services():
    modules = tree_modules()
    # the tree reading finds what it should (a reading that finds nothing would pass anything)
    assert {"protocol.py", "engines/", "tools/", "timeline.py"} <= set(modules["shared/"])
    assert {"api/", "encoder/", "prefill/", "decode/", "params.py", "tool_parsers.py"} <= set(modules["services/"])
    assert unnamed_in_layout(ARCHITECTURE.read_text(encoding="utf-8"), modules) == []


def test_the_layer_table_names_every_module_of_the_layer_contracts():
    names = contract_names()
    assert {"routing.py", "heap.py", "grammar", "store/", "services/api"} <= set(names)
    assert unnamed_in_layer_table(ARCHITECTURE.read_text(encoding="utf-8"), names) == []


def test_a_module_taken_out_of_the_page_fails_the_checks():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    modules = tree_modules()
    # one API module and one shared module out of the code layout (each name everywhere in it)
    layout = section(text, "Code layout")
    for top, name in (("services/", "tool_parsers.py"), ("shared/", "heap.py"), ("shared/", "engines/")):
        gone = text.replace(layout, re.sub(rf"(?<![\w/.]){re.escape(name)}(?![\w])", "", layout))
        assert f"{top}{name}" in unnamed_in_layout(gone, modules), name
    # a name in the shared region does not count for services (routing.py is in both)
    regions = layout_regions(text)
    assert named("routing.py", regions["shared/"]) and named("routing.py", regions["services/"])
    gone = text.replace(regions["services/"], regions["services/"].replace("routing.py", ""))
    assert "services/routing.py" in unnamed_in_layout(gone, modules)
    # one module of each kind out of the layer table
    names = contract_names()
    table = layer_table(text)
    for name in ("routing.py", "grammar", "services/decode", "ec_lifecycle/"):
        gone = text.replace(table, table.replace(f"`{name}`", ""))
        assert unnamed_in_layer_table(gone, names) == [name], name
