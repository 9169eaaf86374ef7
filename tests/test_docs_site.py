"""The documentation site reads at 1280 px (issue 46 item 6): no table cell breaks a word across lines.

The site is built as ``make check-docs`` builds it (mkdocs, strict), each page with a table is opened in a
headless chromium 1280 px wide, and a script on the page finds every run of word characters (letters, digits,
``_``: no line-break opportunity inside one) in a table cell whose text lies on more than one line. Lines may
still break where the browser may break them (spaces, after ``/`` or ``-``): those are not words cut in two.

The negative control builds the same pages without ``docs/stylesheets/extra.css``: Material's own style breaks
names such as ``EPD_NATS_URL`` mid-word there (in the configuration reference, ~100 of them), and the same check
must find them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# Reports the words cut across lines in the page's tables, in the title (the page's own scripts do not set it
# after load).
PROBE = r"""<script>
window.addEventListener('load', () => {
  const broken = [];
  for (const cell of document.querySelectorAll('.md-typeset table td, .md-typeset table th')) {
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const m of node.data.matchAll(/\w+/g)) {
        const range = document.createRange();
        range.setStart(node, m.index);
        range.setEnd(node, m.index + m[0].length);
        const tops = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
        if (tops.size > 1) broken.push(m[0]);
      }
    }
  }
  document.title = 'BROKEN' + JSON.stringify(broken);
});
</script>"""


def build_site(tmp_path: Path, *, extra_css: bool = True) -> Path:
    """The site as ``make check-docs`` builds it (``extra_css=False``: without the project's stylesheet)."""
    config = ROOT / "mkdocs.yml"
    if not extra_css:
        text = config.read_text()
        assert "extra_css:\n  - stylesheets/extra.css\n" in text, "mkdocs.yml no longer loads the stylesheet"
        config = tmp_path / "mkdocs-plain.yml"
        config.write_text(
            text.replace("extra_css:\n  - stylesheets/extra.css\n", "").replace(
                "docs_dir: docs", f"docs_dir: {ROOT / 'docs'}"
            )
        )
    site = tmp_path / ("site" if extra_css else "site-plain")
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f", str(config), "--site-dir", str(site)],
        check=True,
        cwd=ROOT,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"},
        timeout=300,
    )
    return site


def broken_words(page: Path) -> list[str]:
    """The words a 1280 px wide chromium cuts across lines in ``page``'s tables."""
    probe = page.with_name("probe-" + page.name)
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    out = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--window-size=1280,800",
            "--virtual-time-budget=5000",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r"<title>BROKEN(.*?)</title>", out.stdout, re.S)
    assert found, f"the probe did not run on {page}: {out.stderr[-500:]}"
    return json.loads(found.group(1).replace("&quot;", '"'))


def pages_with_tables(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("index.html") if "<table" in p.read_text())


@pytest.mark.skipif(CHROMIUM is None, reason="needs a headless chromium (apt-get install chromium)")
def test_no_table_of_the_docs_site_breaks_a_word_at_1280_px(tmp_path):
    site = build_site(tmp_path)
    pages = pages_with_tables(site)
    assert len(pages) >= 8, pages  # the check sees the site's tables (performance, configuration, api, ...)
    assert site / "performance" / "index.html" in pages
    broken = {str(p.relative_to(site)): words for p in pages if (words := broken_words(p))}
    assert not broken, broken

    # Negative control: Material's own style cuts the configuration reference's names mid-word.
    plain = build_site(tmp_path, extra_css=False)
    assert "EPD_NATS_URL" in broken_words(plain / "configuration" / "index.html")
