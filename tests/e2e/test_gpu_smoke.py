"""The GPU smoke run (``benchmarks/gpu/smoke.py``) on the CPU at smoke size, so that it cannot rot before a GPU is
lent: every check runs through to its PASS/SKIP line, none FAILs, and the JSON file holds them all.

A check may SKIP only for a part that is not installed here (and, under CI=true, not for vLLM or DeepSpeed, which
CI installs). The run's figures reach the results API (``benchmarks.harness.record``) in the test's own folder,
never in the repository's ``benchmarks/results/``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

#: Every check the run prints, in its order.
CHECKS = ["preflight", "gpu-defaults", "trainer-fp32", "trainer-bf16", "behaviour-untied", "behaviour-tied", "vllm",
          "vllm-tied", "vllm-server", "ddp", "zero1", "zero2", "zero3", "fsdp2"]
#: Parts CI installs: a check skipped for want of one of them is a failure there.
CI_PARTS = ("vllm", "deepspeed")


@pytest.mark.slow
# The run's own bounds: the vLLM server's start-up (400 s) and the rest (a minute or two here); DeepSpeed's first
# build of its C++ op on a new machine (about 65 s) on top.
@pytest.mark.timeout(900)
def test_the_gpu_smoke_run_passes_on_the_cpu(tmp_path):
    out, results = tmp_path / "smoke.json", tmp_path / "results"
    in_repo = ROOT / "benchmarks" / "results" / "gpu_smoke.jsonl"
    before = in_repo.read_bytes() if in_repo.exists() else None
    env = dict(os.environ, PYTHONPATH=str(ROOT), RLSTREAM_BENCH_RESULTS=str(results))
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
        assert part, f"{name} skipped for no missing part: {check['reason']}"
        assert importlib.util.find_spec(part) is None, f"{name} skipped for {part}, which is installed here"
        assert not (os.environ.get("CI") == "true" and part in CI_PARTS), f"{name} skipped in CI: {check['reason']}"
    assert report["complete"] and report["counts"]["FAIL"] == 0 and report["device"] == "cpu"
    pre = checks["preflight"]["figures"]
    assert pre["torch"] and pre["auto"] == ("cuda:0" if pre["cuda_available"] else "cpu")
    # The comparisons measured something: a trainer step's figures, and engines that really took each version.
    assert checks["trainer-fp32"]["figures"]["whole"]
    if checks["behaviour-tied"]["status"] == "PASS":
        assert checks["behaviour-tied"]["figures"]["between_versions_min_dlogprob"] > 0.05
    if checks["vllm-tied"]["status"] == "PASS":
        tied = checks["vllm-tied"]["figures"]
        assert tied["between_versions_min_probe_gap"] > tied["v1_folder_probe_allowed"] >= tied["max_probe_gap"]
    defaults = checks["gpu-defaults"]["figures"]
    # On the CPU: no autocast, eager vLLM, and the budget sized from the memory available (the smoke model is tiny:
    # the bound).
    assert (defaults["autocast"], defaults["micro_batch_tokens"], defaults["enforce_eager"]) == ("off", 65536, True)
    # The results API got one line, here and not in the repository.
    [line] = [json.loads(x) for x in (results / "gpu_smoke.jsonl").read_text().splitlines()]
    assert line["figures"]["failed"] == 0 and line["figures"]["passed"] == report["counts"]["PASS"]
    assert {"figure": "failed", "op": "<=", "target": 0} in line["goals"]
    assert "RESULT gpu_smoke" in done.stdout
    assert (in_repo.read_bytes() if in_repo.exists() else None) == before
