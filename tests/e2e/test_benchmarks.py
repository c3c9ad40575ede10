"""`make bench` at smoke size: every benchmark runs through to its RESULT line (the figures are not judged here:
at smoke size they mean nothing, and no test asserts a time)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _benchmarks() -> list[str]:
    script = (ROOT / "benchmarks" / "run_all.sh").read_text()
    return re.findall(r"^bench (\w+) ", script, re.M)


def test_every_benchmark_script_is_in_make_bench():
    listed = set(_benchmarks())
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__"}
    assert scripts == listed, f"not run by make bench: {scripts - listed}; listed but missing: {listed - scripts}"


@pytest.mark.timeout(1700)
def test_every_benchmark_prints_its_result_line_at_smoke_size(tmp_path, bootstrap):
    env = dict(os.environ, SMOKE="1", OUT=str(tmp_path), PY=sys.executable, PYTHONPATH=str(ROOT))
    done = subprocess.run(["bash", "benchmarks/run_all.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1650)
    results = {}
    for name in _benchmarks():
        log = (tmp_path / f"{name}.log").read_text()
        line = next((ln for ln in log.splitlines() if ln.startswith(f"RESULT {name} ")), None)
        results[name] = line
        assert line is not None, f"{name} printed no RESULT line:\n{log[-3000:]}"
        # Every figure carries its date, commit and load.
        assert re.search(r" date=\d{4}-\d\d-\d\d commit=\S+ load=[\d.]+/[\d.]+/[\d.]+", line), line
    assert done.returncode == 0, done.stdout[-4000:]
