"""The docs site builds from the repository as `make docs` builds it, and renders in a real browser.

The reference pages are generated from the code first (docs/gen_reference.py), then `mkdocs build --strict`
(every link and nav entry resolves, or the build fails), all in a temporary copy so the checkout is not written.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.helpers.browser import dom_after_load, screenshot

pytestmark = pytest.mark.slow


# Bounded waits: the generator 120 s (it imports torch through the stages' settings), mkdocs 120 s, the browser
# three times 60 s; plus 60 s of start-up.
@pytest.mark.timeout(510)
def test_docs_site_builds_strict_and_renders(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("reference"))
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    gen = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_reference.py"), str(tmp_path / "docs")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert gen.returncode == 0, gen.stderr[-3000:]
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp_path / "mkdocs.yml"),
                            "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120, env=env)
    assert build.returncode == 0, build.stderr[-3000:]
    assert "WARNING" not in build.stderr, build.stderr[-3000:]

    site = tmp_path / "site"
    quickstart = site / "quickstart" / "index.html"
    dom = dom_after_load(quickstart)
    assert "<title>Quickstart - rlstream</title>" in dom
    assert re.search(r'<h1 id="quickstart">Quickstart', dom), dom[:2000]
    assert re.search(r"<h2 id=\"the-two-commands\">The two commands", dom), dom[:2000]
    # The theme's script ran in the browser: it swaps the html element's no-js class and adds code-copy buttons.
    html_tag = re.search(r"<html[^>]*>", dom).group(0)
    assert "no-js" not in html_tag and "md-code__button" in dom, html_tag
    shot = screenshot(quickstart, tmp_path / "quickstart.png", size="1200,1600")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000

    # The generated reference: a known flag in one row with its environment variable and default.
    cli = dom_after_load(site / "reference" / "cli" / "index.html")
    rows = [r for r in re.findall(r"<tr>.*?</tr>", cli, re.S) if "<code>--micro-batch-tokens</code>" in r]
    assert len(rows) == 1, rows
    assert "<code>RLSTREAM_TRAINER_MICRO_BATCH_TOKENS</code>" in rows[0] and "<code>-1</code>" in rows[0], rows[0]
    topics = (site / "reference" / "topics" / "index.html").read_text()
    assert 'id="scoredtrajectory"' in topics and "<code>policy-versions</code>" in topics
    views = (site / "reference" / "views" / "index.html").read_text()
    assert 'id="reward-by-version"' in views
