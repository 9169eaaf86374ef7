"""Every suppression says what it suppresses and why (issue 23).

A ``noqa`` names its rule codes and gives a reason (``# noqa: BLE001 - why``); a ``type: ignore``
names its error codes and is followed by a reason (``# type: ignore[code]  # why``). ruff's
PGH003/PGH004 catch suppressions without codes, not ones without a reason: this test does both,
over every Python file of shared/, services/, tests/ and bench/.

Each checker also gets synthetic lines (negative controls), so a checker that sees nothing
cannot pass.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("shared", "services", "tests", "bench")

_NOQA = re.compile(r"#\s*noqa\b", re.IGNORECASE)
_NOQA_OK = re.compile(r"#\s*noqa:\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*\s+-\s+\S")
_IGNORE = re.compile(r"#\s*type:\s*ignore\b")
_IGNORE_OK = re.compile(r"#\s*type:\s*ignore\[[a-z0-9-]+(?:\s*,\s*[a-z0-9-]+)*\]\s+#\s*\S")


def bad_suppressions(source: str) -> list[tuple[int, str]]:
    """(line, comment) of each noqa / type: ignore comment without codes and a reason.

    Only real comments count (``tokenize``): the patterns in strings, like this module's own,
    are not suppressions."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        text = tok.string
        if _NOQA.search(text) and not _NOQA_OK.search(text):
            out.append((tok.start[0], text))
        elif _IGNORE.search(text) and not _IGNORE_OK.search(text):
            out.append((tok.start[0], text))
    return out


def python_files() -> list[Path]:
    files = [p for tree in TREES for p in sorted((ROOT / tree).rglob("*.py"))]
    return [p for p in files if "__pycache__" not in p.parts]


def test_every_suppression_names_its_codes_and_reason():
    files = python_files()
    assert len(files) > 100, "the checker found too few files to look at"
    found = [
        f"{path.relative_to(ROOT)}:{line}: {comment}"
        for path in files
        for line, comment in bad_suppressions(path.read_text(encoding="utf-8"))
    ]
    assert not found, (
        "suppressions without codes and a reason (write `# noqa: CODE - why` or "
        "`# type: ignore[code]  # why`):\n" + "\n".join(found)
    )


def test_checker_flags_suppressions_without_reason():
    """Negative controls: synthetic lines the checker must flag, and some it must accept."""
    flagged = [
        "x = 1  # noqa\n",
        "x = 1  # noqa: E501\n",
        "x = 1  # NOQA:E501\n",
        "x = 1  # type: ignore\n",
        "x = 1  # type: ignore[assignment]\n",
        "x = 1  # type: ignore  # a reason but no code\n",
        "x = 1  # noqa - a reason but no code\n",
    ]
    for line in flagged:
        assert bad_suppressions(line) == [(1, line.split("  ", 1)[1].rstrip("\n"))], line
    accepted = [
        "x = 1  # noqa: E501 - a long URL\n",
        "x = 1  # noqa: E402, F401 - after sys.path setup\n",
        "x = 1  # type: ignore[assignment]  # narrowed by the caller\n",
        "x = 1  # type: ignore[arg-type, union-attr]  # vLLM's stubs\n",
        "x = '# noqa'  # a string, not a comment\n",
        "x = 1\n",
    ]
    for line in accepted:
        assert bad_suppressions(line) == [], line
    # A file's offending line is reported with its number.
    assert bad_suppressions("a = 1\nb = 2  # type: ignore\n") == [(2, "# type: ignore")]
