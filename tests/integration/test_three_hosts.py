"""benchmarks/three_hosts.py in CI: the loop across three network namespaces joined only by network links (host A the
3-broker cluster and the archive, B the trainer's rank 0, C its rank 1, rollout, env, reward and the prompt source; the
two ranks one torchrun job), one broker SIGKILLed
mid-run; it must learn to its target and the books must balance. Needs root and iproute2, as test_weights_netns.py."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_three_hosts_learn_through_a_dead_broker_and_lose_nothing(tmp_path):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        why = "network namespaces need root and iproute2's ip"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {why}", pytrace=False)
        pytest.skip(why)
    raw_dir = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.three_hosts", "--target", "0.3", "--minutes", "10",
                           "--workdir", str(tmp_path / "hosts")],
                          cwd=ROOT, capture_output=True, text=True, timeout=870,
                          env=dict(os.environ, RLSTREAM_BENCH_RESULTS=str(raw_dir)))
    out = proc.stdout + proc.stderr
    summary = re.search(r"^reached=(\w+) .* versions=(\d+) tasks=(\d+) lost=(\d+) duplicated=(\d+) "
                        r"broker_killed_at=v(\S+)", proc.stdout, re.M)
    assert summary, out[-6000:]
    reached, versions, tasks, lost, duplicated, killed = summary.groups()
    assert (lost, duplicated) == ("0", "0"), out[-6000:]
    assert killed != "None", out[-6000:]  # the broker died mid-run, after that version was announced
    assert reached == "yes" and int(versions) > int(killed), out[-6000:]
    assert "trainer books:" in proc.stdout and "(equal)" in proc.stdout, out[-6000:]
    assert proc.returncode == 0, out[-6000:]
    raw = [json.loads(t) for t in (raw_dir / "three_hosts.jsonl").read_text().splitlines()]
    assert len(raw) == 1 and raw[0]["figures"]["ok"] is True, raw
    assert raw[0]["figures"]["longest_pause_after_kill_s"] > 0, raw  # versions came after the kill, and were timed
    # The trainer was one torchrun job of two ranks, on hosts B and C, and each rank said so in its own log.
    assert raw[0]["figures"]["trainer_ranks"] == 2, raw
    logs = tmp_path / "hosts" / "logs"
    assert "trainer rank 0 of 2" in (logs / "trainer.log").read_text()
    assert "trainer rank 1 of 2" in (logs / "trainer-1.log").read_text()
    assert "RESULT three_hosts " in proc.stdout
