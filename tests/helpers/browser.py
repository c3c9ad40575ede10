"""A real headless browser for the tests that check a page renders: Debian's chromium-headless-shell (or chromium).

``.ci/run`` installs it; elsewhere a test that needs it skips, and under CI=true fails instead.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser")


def browser() -> str:
    """The browser's path; skips (fails under CI=true) where none is installed."""
    for name in BROWSERS:
        if found := shutil.which(name):
            return found
    what = "no headless Chromium here (apt-get install chromium-headless-shell)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {what}; the report's rendering cannot be tested", pytrace=False)
    pytest.skip(what)


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    # --no-sandbox: the tests may run as root, where Chromium's own sandbox refuses to start.
    return subprocess.run([browser(), "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
                           *args], capture_output=True, text=True, timeout=timeout)


def dom_after_load(page: Path, timeout: float = 60) -> str:
    """The page's DOM as the browser has it once loaded (scripts and onload handlers run)."""
    done = _run(["--virtual-time-budget=5000", "--dump-dom", page.resolve().as_uri()], timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def screenshot(page: Path, out: Path, size: str = "1200,3000", timeout: float = 60) -> Path:
    """A PNG of the page as rendered."""
    done = _run([f"--screenshot={out}", f"--window-size={size}", "--virtual-time-budget=5000",
                 page.resolve().as_uri()], timeout)
    assert done.returncode == 0 and out.exists(), done.stderr[-2000:]
    return out
