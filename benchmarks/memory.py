"""Peak RSS of each stage process (and the broker) during a short ``rlstream demo`` run.

    python -m benchmarks.memory [--minutes 2]

Samples every process under the demo (each stage with its own children) with psutil every 0.5 s. RSS counts
shared pages (torch, vLLM libraries) in every process that maps them, so the column does not add up to a
machine total; PSS (sampled every 5 s) splits shared pages among the processes that share them.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import psutil

from benchmarks.harness.loop import ROOT
from benchmarks.harness.record import record
from benchmarks.harness.scratch import discard, run_name
from rlstream.infra.broker import bootstrap as broker_address
from rlstream.infra.supervisor import StageProc

STAGES = ("trainer", "rollout", "env", "reward", "archive", "prompts")


def stage_of(proc: psutil.Process) -> str | None:
    """The stage a demo child runs, from its command line."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return None
    for i, arg in enumerate(cmd):
        if arg == "run" and i + 1 < len(cmd) and cmd[i + 1] in STAGES:
            return cmd[i + 1]
        if arg == "prompts":
            return "prompts"
    return None


def broker_process() -> psutil.Process | None:
    """The project's own Kafka broker JVM (under .rlstream/), if it runs."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "kafka.Kafka" in cmd and any(str(ROOT / ".rlstream") in c for c in cmd):
            return p
    return None


def mem(proc: psutil.Process, full: bool) -> tuple[int, int]:
    """(RSS, PSS) in bytes; PSS (reading smaps costs CPU, so only when ``full``) is 0 otherwise."""
    if full:
        try:
            info = proc.memory_full_info()
            return info.rss, getattr(info, "pss", 0)
        except psutil.AccessDenied:
            pass
    return proc.memory_info().rss, 0


def main(argv=None) -> dict:
    """Run the benchmark from the command line; its results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0, help="length of the demo run")
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    run = run_name("mem")
    # A target above 1 is never reached: the demo runs its full --minutes, then stops every stage.
    demo = StageProc("demo", ["demo", "--run", run, "--minutes", str(args.minutes), "--target", "2"], env,
                     ROOT / ".rlstream" / "runs" / run / "memory-demo.log", cwd=ROOT).start()
    root = psutil.Process(demo.pid)
    peak: dict[str, int] = {}  # stage -> peak RSS summed over its processes
    peak_pss: dict[str, int] = {}
    broker = broker_process()
    tick = 0
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))  # a time limit still gets the table so far
    deadline = time.monotonic() + args.minutes * 60 + 45
    while demo.alive() and not stop and time.monotonic() < deadline:
        full = tick % 10 == 0
        tick += 1
        per_stage: dict[str, list[int]] = {}
        try:
            children = root.children(recursive=True)
        except psutil.Error:
            break
        for child in children:
            stage = stage_of(child)
            parent = child
            while stage is None:  # an engine's helper process counts for the stage that started it
                try:
                    parent = parent.parent()
                except psutil.Error:
                    parent = None
                if parent is None or parent.pid == root.pid:
                    break
                stage = stage_of(parent)
            try:
                rss, pss = mem(child, full)
            except psutil.Error:
                continue
            acc = per_stage.setdefault(stage or "other", [0, 0])
            acc[0] += rss
            acc[1] += pss
        try:
            per_stage["demo (orchestrator)"] = list(mem(root, full))
            if broker is not None:
                per_stage["kafka broker (JVM)"] = list(mem(broker, full))
        except psutil.Error:
            pass
        for stage, (rss, pss) in per_stage.items():
            peak[stage] = max(peak.get(stage, 0), rss)
            peak_pss[stage] = max(peak_pss.get(stage, 0), pss)
        time.sleep(args.interval)
    tail = [] if demo.alive() else demo.log_tail().strip().splitlines()[-1:]
    demo.stop(60)  # SIGTERM: the demo stops its stages itself; then its run is scratch (harness/scratch.py)
    print(f"peak memory per process during a {args.minutes:g}-minute `rlstream demo` (run {run})")
    print(f"{'process':22s} {'peak RSS MiB':>12s} {'peak PSS MiB':>12s}")
    order = [s for s in (*STAGES, "other", "demo (orchestrator)", "kafka broker (JVM)") if peak.get(s)]
    for stage in order:
        print(f"{stage:22s} {peak[stage] / 2**20:12.0f} {peak_pss.get(stage, 0) / 2**20:12.0f}")
    if tail:
        print("demo: " + tail[0])
    result = {s: {"rss_mib": peak[s] / 2**20, "pss_mib": peak_pss.get(s, 0) / 2**20} for s in order}
    record("memory", {"minutes": args.minutes, **{f"{s.split()[0]}_rss_mib": round(peak[s] / 2**20) for s in order},
                      **{f"{s.split()[0]}_pss_mib": round(peak_pss.get(s, 0) / 2**20) for s in order}})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    home = Path(os.environ.get("RLSTREAM_HOME") or ROOT / ".rlstream")
    discard(broker_address(home), run, home / "runs" / run)
    return result


if __name__ == "__main__":
    main()
