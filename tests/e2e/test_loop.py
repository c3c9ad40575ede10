"""The whole loop over the real broker: every stage its own process, and the tiny model learns."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.mark.timeout(1080)
def test_demo_loop_improves_held_out_reward(bootstrap, tmp_path):
    run = "e2e-" + uuid.uuid4().hex[:8]
    archive = f"chdb://{tmp_path / 'archive'}"
    env = dict(os.environ, RLSTREAM_HOME=str(ROOT / ".rlstream"))
    # vLLM, never auto: a broken vLLM install must fail here, not fall back to transformers unnoticed.
    proc = subprocess.run(
        [sys.executable, "-m", "rlstream.cli", "demo", "--backend", "vllm", "--run", run, "--minutes", "8",
         "--target", "0.35", "--heldout-every", "20", "--heldout-count", "64", "--archive", archive],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    summary = re.search(r"reward (\S+) -> (\S+) over (\d+) policy versions in (\d+) s", out)
    assert summary, out[-4000:]
    start, end, versions = float(summary[1]), float(summary[2]), int(summary[3])
    assert proc.returncode == 0, out[-4000:]
    assert start <= 0.3 and end >= 0.35 and end > start + 0.1, summary[0]
    assert versions >= 3
    png = ROOT / ".rlstream" / "runs" / run / "reward_curve.png"
    assert png.exists() and png.stat().st_size > 5000

    # The archive holds the run: rewards by policy version, queried with plain SQL after the loop stopped.
    sql = subprocess.run([sys.executable, "-m", "rlstream.cli", "sql", "--archive", archive, "--format", "csv",
                          f"SELECT count(), uniqExact(header_policy_version) FROM rlstream.rewards WHERE run = '{run}'"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert sql.returncode == 0, sql.stderr
    rows, distinct_versions = [int(x) for x in sql.stdout.strip().splitlines()[-1].split(",")]
    assert rows > 1000 and distinct_versions >= 3
