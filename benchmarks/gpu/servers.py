"""The server path on a GPU: the rollout stage on a real vLLM server and a real SGLang server, each serving the
~0.5 B Qwen2 that ``benchmarks.gpu.run`` builds in code, against the same server driven directly with the same
prompts (``benchmarks/fleet_tokens.py``'s two halves); and a weight push, timed until the server confirms it.

    python -m benchmarks.gpu.servers [--kinds vllm,sglang] [--size large] [--tasks 64] [--max-tokens 256]

Needs CUDA and the CUDA builds of vLLM and/or SGLang (``python -m vllm.entrypoints.openai.api_server``,
``python -m sglang.launch_server``); a kind that is not installed is skipped with a line saying so, and on a host
without CUDA the script says so and stops (SGLang has no CPU build; the CPU's vLLM server path is
``benchmarks/fleet_tokens.py``). A Kafka broker is started as ``rlstream up`` starts it. Not part of CI or
``make bench``. No GPU was lent to the session that wrote it: it has not yet run on one.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from benchmarks.fleet_tokens import direct_round, stage_round
from benchmarks.gpu.run import SIZES, build
from benchmarks.harness.result import result
from rlstream.infra import broker
from rlstream.engine.servers import SGLangAPI, VLLMServerAPI
from tests.helpers.servers import free_port

#: kind -> (module that must import, the rollout backend, the stage's client of that server, how to launch it)
KINDS = {
    "vllm": ("vllm", "vllm-server", VLLMServerAPI,
             lambda folder, port, args: [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                         str(folder), "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
                                         str(args.max_context), "--gpu-memory-utilization",
                                         str(args.gpu_memory_utilization), "--dtype", "bfloat16"]),
    "sglang": ("sglang", "sglang", SGLangAPI,
               lambda folder, port, args: [sys.executable, "-m", "sglang.launch_server", "--model-path", str(folder),
                                           "--host", "127.0.0.1", "--port", str(port), "--context-length",
                                           str(args.max_context), "--mem-fraction-static",
                                           str(args.gpu_memory_utilization), "--dtype", "bfloat16"]),
}


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for route in ("/health", "/v1/models", "/get_model_info"):
            try:
                urllib.request.urlopen(url + route, timeout=2)
                return
            except OSError:
                pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server at {url} did not come up; see {log}")
        time.sleep(2)


def one_kind(kind: str, folder: Path, work: Path, bootstrap: str, args) -> dict | None:
    module, backend, api, command = KINDS[kind]
    if importlib.util.find_spec(module) is None:
        print(f"{kind}: not installed here; skipped")
        return None
    port, log = free_port(), work / f"{kind}.log"
    # The weight routes of vLLM's server are its dev-mode ones (rlstream pushes each version through them).
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    proc = subprocess.Popen(command(folder, port, args), env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log, args.startup_timeout)
        stage, direct = [], []
        for k in range(args.rounds):
            rate, _, prompts = stage_round(bootstrap, [url], folder, work, args, k, backend=backend)
            stage.append(rate)
            direct.append(direct_round([url], prompts, args, api=api)[0])
            print(f"{kind} round {k}: stage {stage[-1]:8.0f} tokens/s, direct {direct[-1]:8.0f} tokens/s", flush=True)
        client = api(url)
        pushes = []
        for version in range(1, args.pushes + 1):
            started = time.perf_counter()
            client.push(folder, version)  # returns once the server confirms it serves the new weights
            pushes.append(time.perf_counter() - started)
        ratio = sorted(s / d for s, d in zip(stage, direct))[len(stage) // 2]
        print(f"{kind}: stage/direct {ratio:.2f}x; weight push confirmed in p50 {sorted(pushes)[len(pushes) // 2]:.2f} "
              f"s (max {max(pushes):.2f} s, {len(pushes)} pushes of {args.params_b:.2f} B parameters)")
        return {"ratio": ratio, "stage": max(stage), "direct": max(direct),
                "push_p50_s": sorted(pushes)[len(pushes) // 2]}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="vllm,sglang", help="servers to measure, comma-separated: vllm, sglang")
    ap.add_argument("--size", choices=tuple(SIZES), default="large")
    ap.add_argument("--tasks", type=int, default=64, help="prompts per round")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch-tasks", type=int, default=16,
                    help="prompts per stage batch (one transaction; x G requests)")
    ap.add_argument("--in-flight", type=int, default=128, help="most requests in flight, both sides")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pushes", type=int, default=3, help="weight pushes timed to their confirmation")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--startup-timeout", type=float, default=900)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device here: the GPU server path cannot run (the CPU's is python -m benchmarks.fleet_tokens)")
        return {}
    work = Path(tempfile.mkdtemp(prefix="rlstream-gpu-servers-"))
    folder = work / "model"
    model, tokenizer = build(args.size)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    args.params_b = sum(p.numel() for p in model.parameters()) / 1e9
    bootstrap = broker.up()
    out = {}
    try:
        for kind in [k.strip() for k in args.kinds.split(",") if k.strip()]:
            if kind not in KINDS:
                ap.error(f"--kinds takes {', '.join(KINDS)}")
            got = one_kind(kind, folder, work, bootstrap, args)
            if got:
                out[kind] = got
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result("gpu_servers", size=args.size, **{f"{k}_{f}": v for k, r in out.items() for f, v in r.items()})
    return out


if __name__ == "__main__":
    main()
