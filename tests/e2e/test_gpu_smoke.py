"""The GPU smoke run (``benchmarks/gpu/smoke.py``) on the CPU at smoke size, so that it cannot rot before a GPU is
lent: every check runs through to its PASS/SKIP line, none FAILs, and the JSON file holds them all.

A check may SKIP only for a part that is not installed here (and, under CI=true, not for vLLM or DeepSpeed, which
CI installs), or because the code it checks has not landed yet (``PENDING``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks.gpu.smoke import PENDING
from tests.helpers import ROOT

#: Every check the run prints, in its order.
CHECKS = ["preflight", "trainer-fp32", "trainer-bf16", "behaviour-untied", "behaviour-tied", "vllm", "vllm-server",
          "ddp", "zero1", "zero2", "zero3", "fsdp2", *PENDING]
#: Parts CI installs: a check skipped for want of one of them is a failure there.
CI_PARTS = ("vllm", "deepspeed")


@pytest.mark.slow
# The run's own bounds: the vLLM server's start-up (400 s) and the rest (a minute or two here); DeepSpeed's first
# build of its C++ op on a new machine (about 65 s) on top.
@pytest.mark.timeout(900)
def test_the_gpu_smoke_run_passes_on_the_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu.smoke", "--devices", "cpu", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=830)
    lines = re.findall(r"^(PASS|FAIL|SKIP) (\S+) \([\d.]+ s\)(?:: (.*))?$", done.stdout, re.M)
    assert [name for _, name, _ in lines] == CHECKS, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert [c["name"] for c in report["checks"]] == CHECKS
    for status, name, reason in lines:  # the JSON says what the lines say
        assert (checks[name]["status"], checks[name]["reason"]) == (status, reason or "")
        assert isinstance(checks[name]["figures"], dict) and checks[name]["seconds"] >= 0
    failed = {n: c["reason"] for n, c in checks.items() if c["status"] == "FAIL"}
    assert not failed, failed
    assert done.returncode == 0, done.stdout[-3000:]
    for name, check in checks.items():
        if check["status"] != "SKIP":
            continue
        part = check["part"]
        if not part:
            assert name in PENDING, f"{name} skipped for no missing part: {check['reason']}"
            continue
        assert importlib.util.find_spec(part) is None, f"{name} skipped for {part}, which is installed here"
        assert not (os.environ.get("CI") == "true" and part in CI_PARTS), f"{name} skipped in CI: {check['reason']}"
    assert report["complete"] and report["counts"]["FAIL"] == 0 and report["device"] == "cpu"
    pre = checks["preflight"]["figures"]
    assert pre["torch"] and pre["auto"] == ("cuda:0" if pre["cuda_available"] else "cpu")
    # The comparisons measured something: a trainer step's figures, and engines that really took each version.
    assert checks["trainer-fp32"]["figures"]["whole"]
    if checks["behaviour-tied"]["status"] == "PASS":
        assert checks["behaviour-tied"]["figures"]["between_versions_min_dlogprob"] > 0.05
