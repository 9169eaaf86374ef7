"""The API examples of the docs (README.md, docs/*.md) run against `make run`'s stack and give the
answer they show (issue 41 item 3); and what a new user meets next: image URLs on their own
machine (item 4) and API keys (item 5), on real ``epd up`` stacks.

The marker convention (HTML comments: invisible on GitHub and in the MkDocs site):

* ``<!-- example: make-run -->`` on the line before a fenced block: the example runs as it is
  against the default stack (``make run``: ``epd up``, the demo model, port 8000). A ``bash``
  block runs in bash; a ``python`` block in this venv's Python (the ``openai`` client).
* ``<!-- example-output -->`` before the next fenced block: what that example prints. A ``json``
  block is matched as a pattern: ``...`` in an object or array stands for more members (key
  order is free); other blocks must equal the output (surrounding white space aside).
* ``<!-- example: other (WHY) -->``: an example for another set-up (Docker Compose, vLLM, several
  hosts, a recorded session on other ports), not run here; the text around it says which.

Every fenced block that sends an API request (``curl``, the ``openai`` client) must carry one of
the two example markers: a new unmarked example fails :func:`test_every_api_example_in_the_docs_is_marked`.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from shared.tools.models.shapes import EXAMPLE, EXAMPLE_VIDEO
from tests.epdup import READY, EpdUp

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: where the examples say the stack is (`make run`'s API)
DOCS_URL = "http://127.0.0.1:8000"

MARK = re.compile(r"^<!-- example: (?:(?P<run>make-run)|other \((?P<why>[^)]+)\)) -->$")
OUTPUT_MARK = "<!-- example-output -->"
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
#: a block that sends an API request
API_REQUEST = re.compile(r"^\s*(\$ )?curl |\bfrom openai\b|OpenAI\(", re.M)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    #: the marker comment on the line before the fence ("" if none)
    marker: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


@dataclass(frozen=True)
class Example:
    block: Block
    output: Block


def blocks(path: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of a Markdown file, each with the marker comment right before it."""
    lines = (path.read_text() if text is None else text).splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = prev if prev.startswith("<!-- example") else ""
        out.append(Block(path, i + 1, m["lang"], "\n".join(lines[i + 1 : end]) + "\n", marker))
        i = end + 1
    return out


def examples(path: Path, text: str | None = None) -> list[Example]:
    """The ``make-run`` examples of a file, each with its output block (AssertionError where one
    lacks it)."""
    found = blocks(path, text)
    out = []
    for k, block in enumerate(found):
        m = MARK.match(block.marker)
        if not m or not m["run"]:
            continue
        assert k + 1 < len(found) and found[k + 1].marker == OUTPUT_MARK, (
            f"{block.where}: a make-run example needs its output in the next block, marked {OUTPUT_MARK}"
        )
        out.append(Example(block, found[k + 1]))
    return out


def all_examples() -> list[Example]:
    return [e for path in DOCS for e in examples(path)]


# -- matching what an example printed against what the docs show ----------------------------------
_MORE = object()  # a "..." member of a shown object or array
_MORE_TEXT = "\u2026MORE"  # what it stands for while parsed


def _shown_json(text: str) -> object:
    """A shown JSON output: ``...`` as an object member or array element means "and more"."""
    out, stack, i, in_string = [], [], 0, False
    while i < len(text):
        c = text[i]
        if in_string:
            out.append(text[i : i + 2] if c == "\\" else c)
            i += 2 if c == "\\" else 1
            in_string = c != '"' if c != "\\" else True
            continue
        if c == '"':
            in_string = True
        elif c in "{[":
            stack.append(c)
        elif c in "}]":
            stack.pop()
        elif text.startswith("...", i) and stack:
            more = json.dumps(_MORE_TEXT)
            out.append(f"{more}: true" if stack[-1] == "{" else more)
            i += 3
            continue
        out.append(c)
        i += 1
    return _mark_more(json.loads("".join(out)))


def _mark_more(value: object) -> object:
    if isinstance(value, dict):
        more = value.pop(_MORE_TEXT, None) is not None
        out = {k: _mark_more(v) for k, v in value.items()}
        return {**out, _MORE: True} if more else out
    if isinstance(value, list):
        return [_MORE if v == _MORE_TEXT else _mark_more(v) for v in value]
    return value


def json_matches(shown: object, actual: object, at: str = "$") -> list[str]:
    """Where ``actual`` differs from the ``shown`` pattern (empty: it matches)."""
    if isinstance(shown, dict):
        if not isinstance(actual, dict):
            return [f"{at}: {actual!r} is no object"]
        more = shown.get(_MORE, False)
        keys = [k for k in shown if k is not _MORE]
        problems = [f"{at}: no {k!r}" for k in keys if k not in actual]
        if not more:
            problems += [f"{at}: {k!r} not shown" for k in actual if k not in keys]
        for k in keys:
            if k in actual:
                problems += json_matches(shown[k], actual[k], f"{at}.{k}")
        return problems
    if isinstance(shown, list):
        if not isinstance(actual, list):
            return [f"{at}: {actual!r} is no array"]
        more = bool(shown) and shown[-1] is _MORE
        items = shown[:-1] if more else shown
        if len(actual) < len(items) or (not more and len(actual) != len(items)):
            return [f"{at}: {len(actual)} elements, shown {len(items)}{' or more' if more else ''}"]
        return [p for i, s in enumerate(items) for p in json_matches(s, actual[i], f"{at}[{i}]")]
    return [] if shown == actual else [f"{at}: {actual!r}, shown {shown!r}"]


def check_output(output: Block, printed: str) -> None:
    """AssertionError unless ``printed`` is what the docs' ``output`` block shows."""
    if output.lang == "json":
        try:
            actual = json.loads(printed)
        except ValueError:
            raise AssertionError(f"{output.where}: the example printed no JSON:\n{printed[-2000:]}") from None
        problems = json_matches(_shown_json(output.code), actual)
        assert not problems, f"{output.where}: the output differs from the one shown: {problems}\n{printed[-2000:]}"
    else:
        assert printed.strip() == output.code.strip(), f"{output.where}: printed {printed!r}, shown {output.code!r}"


def run_example(block: Block, url: str, env: dict[str, str] | None = None) -> str:
    """Run ``block`` against the stack at ``url`` (the docs' URL replaced); what it printed."""
    code = block.code.replace(DOCS_URL, url)
    env = {**{k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}, **(env or {})}
    if block.lang in ("bash", "sh", "shell"):
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    elif block.lang == "python":
        argv = [sys.executable, "-c", code]
    else:
        raise AssertionError(f"{block.where}: cannot run a {block.lang!r} block")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, f"{block.where}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout


# -- fast: the marking and the matching -----------------------------------------------------------
def test_every_api_example_in_the_docs_is_marked():
    unmarked, bad = [], []
    for path in DOCS:
        for block in blocks(path):
            if block.marker.startswith("<!-- example:") and not MARK.match(block.marker):
                bad.append(f"{block.where}: {block.marker}")
            elif API_REQUEST.search(block.code) and not MARK.match(block.marker):
                unmarked.append(block.where)
    assert not bad, f"malformed example markers: {bad}"
    assert not unmarked, f"API examples without <!-- example: make-run --> or <!-- example: other (WHY) -->: {unmarked}"
    found = all_examples()
    # The first request of the README, the docs' index and getting started, and the API reference's.
    files = {e.block.path.relative_to(REPO).as_posix() for e in found}
    assert {"README.md", "docs/index.md", "docs/getting-started.md", "docs/api.md"} <= files, files
    assert {e.block.lang for e in found} >= {"bash", "python"}


def test_a_shown_output_matches_only_what_it_shows():
    shown = Block(REPO / "x.md", 1, "json", '{"a": 1, "b": [{"c": "triangle", ...}, ...], ...}', OUTPUT_MARK)
    check_output(shown, '{"a": 1, "b": [{"c": "triangle", "d": 2}, {"c": "x"}], "e": null}')
    for wrong in (
        '{"a": 1, "b": [{"c": "circle"}]}',  # another answer
        '{"a": 2, "b": [{"c": "triangle"}]}',
        '{"b": [{"c": "triangle"}]}',  # a shown member missing
        '{"a": 1, "b": []}',
        "not json",
    ):
        with pytest.raises(AssertionError):
            check_output(shown, wrong)
    exact = Block(REPO / "x.md", 1, "json", '{"a": 1}', OUTPUT_MARK)
    with pytest.raises(AssertionError):  # no "...": nothing more
        check_output(exact, '{"a": 1, "b": 2}')
    text = Block(REPO / "x.md", 1, "text", "green\n", OUTPUT_MARK)
    check_output(text, "green\n")
    with pytest.raises(AssertionError):
        check_output(text, "red\n")


# -- slow: the examples against `make run`'s stack -------------------------------------------------
@pytest.fixture(scope="module")
def make_run_stack(tmp_path_factory) -> Iterator[EpdUp]:
    """``epd up`` with no options but its ports and data folder: what ``make run`` starts."""
    up = EpdUp(tmp_path_factory.mktemp("make-run"))
    try:
        m = up.wait_ready()
        assert m["model"] == "qwen2-vl-shapes", m.group(0)
        yield up
    finally:
        up.close()


@pytest.mark.slow
@pytest.mark.parametrize("example", all_examples(), ids=lambda e: e.block.where)
def test_docs_example_gives_the_answer_it_shows(example: Example, make_run_stack):
    check_output(example.output, run_example(example.block, make_run_stack.url))


@pytest.mark.slow
def test_the_services_logs_carry_no_progress_bars(make_run_stack):
    """epd up's services write to log files: no bar redrawn with carriage returns (model loading)."""
    logs = sorted((make_run_stack.data_dir / "logs").glob("*.log"))
    assert {p.stem for p in logs} >= {"api-0", "encoder-0", "prefill-0"}, logs
    assert [p.name for p in logs if b"\r" in p.read_bytes()] == []  # (read_text would turn \r into \n)


@pytest.mark.slow
def test_an_example_whose_shown_answer_is_wrong_fails(make_run_stack):
    """Negative control: the README's first request with another answer shown fails the check."""
    [example] = examples(REPO / "README.md")
    assert '"content": "triangle"' in example.output.code
    printed = run_example(example.block, make_run_stack.url)
    check_output(example.output, printed)
    shown = example.output
    wrong = Block(shown.path, shown.line, "json", shown.code.replace("triangle", "circle"), "")
    with pytest.raises(AssertionError, match="shown 'circle'"):
        check_output(wrong, printed)


# -- item 4: an image URL on this machine ---------------------------------------------------------
@pytest.fixture(scope="module")
def local_image_url() -> Iterator[str]:
    """The example's picture (a green triangle) served over HTTP on 127.0.0.1."""
    png = EXAMPLE.scenes[0].png()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args: object) -> None: ...

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/triangle.png"
    finally:
        server.shutdown()
        server.server_close()


def shape_request(image_url: str) -> dict:
    return {
        "model": "qwen2-vl-shapes",
        "max_tokens": 16,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url}},
                    {"type": "text", "text": EXAMPLE.question},
                ],
            }
        ],
    }


@pytest.mark.slow
def test_a_local_image_url_is_refused_by_default_naming_the_way_to_allow_it(make_run_stack, local_image_url):
    resp = httpx.post(f"{make_run_stack.url}/v1/chat/completions", json=shape_request(local_image_url), timeout=120)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "url_not_allowed" and "EPD_URL_ALLOW_NETWORKS" in error["message"], error
    assert "epd up --allow-local-urls" in error["message"], error  # what a developer types


# -- items 4 and 5: a development stack with --allow-local-urls and an API key --------------------
API_KEY = "sk-docs-test-0123456789"


@pytest.fixture(scope="module")
def dev_stack(tmp_path_factory) -> Iterator[EpdUp]:
    up = EpdUp(tmp_path_factory.mktemp("dev"), "--topology", "agg", "--allow-local-urls", "--api-key", API_KEY)
    try:
        up.wait_ready()
        yield up
    finally:
        up.close()


@pytest.mark.slow
def test_allow_local_urls_serves_an_image_on_this_machine(dev_stack, local_image_url):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = shape_request(local_image_url)
    resp = httpx.post(f"{dev_stack.url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == EXAMPLE.answer
    # Only loopback: a private address elsewhere stays refused.
    body = shape_request("http://10.255.255.1/x.png")
    resp = httpx.post(f"{dev_stack.url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "url_not_allowed", resp.text


@pytest.mark.slow
def test_epd_up_api_key_the_printed_curl_sends_it_from_the_environment(dev_stack):
    """``--api-key``: the API asks for it; the printed curl works once OPENAI_API_KEY is exported
    (and gets a 401 without); the key is nowhere in epd up's output."""
    out = dev_stack.output()
    assert READY.search(out) and API_KEY not in out
    curls = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("curl ")]
    assert len(curls) == 2  # the image request, then the video one
    for curl, answer in zip(curls, (EXAMPLE.answer, EXAMPLE_VIDEO.answer), strict=True):
        assert '-H "Authorization: Bearer $OPENAI_API_KEY"' in curl
        block = Block(dev_stack.out_path, 0, "bash", curl + " -w '\\n%{http_code}'\n", "")
        printed = run_example(block, dev_stack.url, {"OPENAI_API_KEY": API_KEY})
        body, status = printed.rsplit("\n", 1)
        assert status == "200" and json.loads(body)["choices"][0]["message"]["content"] == answer, printed
    printed = run_example(block, dev_stack.url)  # no key in the environment
    assert printed.rsplit("\n", 1)[1] == "401", printed


def bench(url: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "shared.tools.cli", "bench", "run", "--url", url, "--requests", "2"]
    argv += ["--image-sizes", "64x64", "--output-tokens", "2,2", "--prompt-words", "4,4", "--no-timelines", *args]
    clean = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY" and not k.startswith("EPD_")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**clean, **env}, cwd=REPO)


@pytest.mark.slow
def test_epd_bench_run_takes_the_key_from_the_environment_and_says_when_one_is_missing(dev_stack):
    done = bench(dev_stack.url, {"OPENAI_API_KEY": API_KEY})
    assert done.returncode == 0, done.stderr[-3000:]
    assert API_KEY not in done.stdout + done.stderr
    # Not a terminal: plain progress lines, no carriage returns.
    assert "\r" not in done.stderr and "concurrency 1: 2/2 req" in done.stderr, done.stderr[-2000:]
    missing = bench(dev_stack.url, {})
    assert missing.returncode == 2
    assert "answered 401: the server asks for an API key: pass --api-key or set OPENAI_API_KEY" in missing.stderr
    assert "pass the model name" not in missing.stderr
    wrong = bench(dev_stack.url, {}, "--api-key", "sk-wrong")
    assert wrong.returncode == 2 and "refused the API key given" in wrong.stderr, wrong.stderr[-2000:]
    assert "sk-wrong" not in wrong.stdout + wrong.stderr
