"""benchmarks/chaos.py in CI: SIGKILL each stage of the running loop once, then reconcile topics and archive."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import pytest

from tests.helpers import ROOT

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.mark.timeout(1860)
def test_killing_every_stage_loses_and_duplicates_nothing(bootstrap, tmp_path):
    """Also the benchmark's smoke check (tests/e2e/test_benchmarks.py leaves chaos to this test, which runs it
    bigger): its RESULT line and one well-formed raw line."""
    run = "chaos-" + uuid.uuid4().hex[:8]
    raw_dir = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos", "--kills", "5", "--tasks", "24", "--seed", "1", "--run", run,
         "--bootstrap", bootstrap, "--workdir", str(tmp_path), "--interval", "2",
         # η = 0: every sample of an older version is refused, so the trainer's books carry refusals too.
         "--eta", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
        env=dict(os.environ, RLSTREAM_BENCH_RESULTS=str(raw_dir)))
    out = proc.stdout + proc.stderr
    summary = re.search(r"^tasks=(\d+) trajectories=(\d+) lost=(\d+) duplicated=(\d+) recovery_p99=(\S+)s "
                        r"kills=(\d+)", proc.stdout, re.M)
    assert summary, out[-5000:]
    tasks, trajectories, lost, duplicated, _, kills = summary.groups()
    assert proc.returncode == 0, out[-5000:]
    assert (lost, duplicated) == ("0", "0"), out[-5000:]
    assert int(kills) == 5 and int(tasks) == 24
    assert 0 < int(trajectories) <= 24 * 4  # G = 4; fewer only where a dead letter records the failure
    # Every stage was killed once (each round kills every stage, in a random order).
    kill_line = next(line for line in proc.stdout.splitlines() if line.startswith("kills: "))
    for stage in ("rollout", "env", "reward", "trainer", "archive"):
        assert f"{stage} [" in kill_line, kill_line
    # Train-at-most-once, from the topics: what every PolicyVersion says it trained, refused, evicted and skipped adds
    # up to the rewards the trainer's group committed (a sample trained twice after its SIGKILL would break it).
    books = re.search(r"^trainer books: trained (\d+) \+ refused (\d+) \(stale \d+\) \+ evicted (\d+) \+ skipped (\d+) "
                      r"= (\d+); rewards the trainer committed: (\d+)", proc.stdout, re.M)
    assert books, out[-5000:]
    trained, refused, evicted, skipped, total, consumed = map(int, books.groups())
    assert trained > 0 and trained + refused + evicted + skipped == total == consumed, books.group(0)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT chaos ")), None)
    assert line is not None and re.search(r" date=\d{4}-\d\d-\d\d commit=\S+ load=", line), out[-3000:]
    raw = [json.loads(t) for t in (raw_dir / "chaos.jsonl").read_text().splitlines()]
    assert len(raw) == 1 and raw[0]["benchmark"] == "chaos" and raw[0]["figures"]["lost"] == 0, raw
    assert set(raw[0]["units"]) == set(raw[0]["figures"]), raw[0]
