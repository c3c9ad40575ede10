"""Goodput: valid samples/hour of rlstream's async loop (eta=2) against the same loop run synchronously.

    python -m benchmarks.goodput_async_vs_sync [--seconds 150] [--reward-workers 2]

Both modes run the same processes (trainer, vLLM rollout, env, reward x R, every one its own ``rlstream run``)
on the same tasks in the same order; only the pacing differs:

- async: eta=2 in trainer and rollout; the prompt source stays (version + 3) steps of groups ahead (AReaL's rule).
- sync: eta=0, and a barrier: the source issues step k+1's prompts only once version k+1 is announced and every
  rollout worker reports generating with it. So: generate a batch, score it, train, publish, load, repeat.
  Same engine, bus, stages and reward as async, so the ratio isolates what asynchrony buys, not what the bus costs
  (benchmarks/vs_trl.py compares against a single-process synchronous trainer).

Workload (the reverse task's prompts; the policy is the tiny Qwen2 from random init, no warm-up, so it samples
until <eos> or its budget and lengths follow the budget):
- generation budget max_tokens per task: Pareto(alpha=1.2, x_min=4) mass on the buckets 4/8/16/32/59 tokens
  (56.5/24.6/10.7/4.3/3.9 %), cut at the 64-token context;
- reward latency per sample: lognormal, median 0.1 s, sigma 1.5 (mean 0.31 s, p99 3.3 s), capped at 10 s,
  an async judge (benchmarks/harness/workloads.py:heavy_tailed_reward), seeded by trajectory id so both modes draw
  alike.
A valid sample is one the trainer trained on (PolicyVersion.samples_trained): within eta, not stale, not evicted.
Goodput is counted between the publish of version 2 (the pipeline is full) and the last version in the window.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.harness.loop import Loop, PacedSource, Versions, log
from benchmarks.harness.record import Goal, record
from benchmarks.harness.workloads import max_tokens_for
from rlstream.trainer.chain import describe, summarize

REWARD = "benchmarks.harness.workloads:heavy_tailed_reward"


def run_mode(mode: str, args) -> dict:
    """One run of the loop in ``mode`` (async or sync); its goodput and what it spent time on."""
    eta = 2 if mode == "async" else 0
    loop = Loop(f"goodput-{mode}", BENCH_LATENCY_MEDIAN_S=str(args.median_s), BENCH_LATENCY_SIGMA=str(args.sigma))
    loop.trainer(eta=eta, groups_per_step=args.groups_per_step, warmup_steps=0, lr=1e-4)
    loop.rollout(eta=eta, backend=args.backend)
    loop.env_stage()
    for i in range(args.reward_workers):
        loop.reward(REWARD, instance=i)
    versions = Versions(loop)
    source = PacedSource(loop, versions, mode=mode, eta=eta, groups_per_step=args.groups_per_step,
                         max_tokens=max_tokens_for)
    log(mode, f"run {loop.run}: starting stages")
    loop.start()
    try:
        # The engine and the trainer start before the clock: only the running loop is measured.
        deadline = time.monotonic() + args.startup_timeout
        while loop.rollout_version() < 0:
            if time.monotonic() > deadline or loop.dead():
                raise RuntimeError(f"{mode}: loop did not start (dead: {loop.dead()}); logs in {loop.workdir}/logs")
            time.sleep(0.5)
        source.start()
        if not versions.wait_for(2, args.startup_timeout, lambda: not loop.dead()):
            raise RuntimeError(f"{mode}: no version 2 (dead: {loop.dead()}); logs in {loop.workdir}/logs")
        started = time.monotonic()
        while time.monotonic() - started < args.seconds and not loop.dead() and source.error is None:
            time.sleep(1)
        source.stop()
        stages = {name: loop.stage_profile(name) for name in loop.sup.procs if name != "trainer"}
    finally:
        source.stop()
        pvs = [pv for pv, _ in versions.all()]
        dead = loop.dead()
        loop.stop()
        versions.close()
    if source.error:
        raise source.error
    window = [pv for pv in pvs if pv.version >= 2]
    first, last = window[0], window[-1]
    seconds = (last.published_at - first.published_at) / 1000
    trained = sum(pv.samples_trained for pv in window[1:])
    stale = sum(pv.metrics.get("stale_step", 0.0) for pv in window[1:])
    steps = [pv.metrics.get("step_seconds", 0.0) for pv in window[1:]]
    return {"mode": mode, "run": loop.run, "eta": eta, "versions": last.version - first.version,
            "seconds": seconds, "samples_trained": trained, "stale_dropped": stale,
            "samples_per_hour": trained / seconds * 3600 if seconds > 0 else 0.0,
            "update_s_mean": sum(steps) / len(steps) if steps else float("nan"),
            "s_per_version": seconds / max(1, last.version - first.version),
            "trainer_busy": sum(steps) / seconds if seconds > 0 else float("nan"),
            "barrier_wait_s": source.barrier_wait_s, "dead_stages": dead, "stages": stages,
            "chain": summarize([pv.metrics for pv in window[1:]])}


def main(argv=None) -> dict:
    """Run the benchmark from the command line; its results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=150, help="measured wall-clock per mode")
    ap.add_argument("--reward-workers", type=int, default=2, help="reward processes in both modes")
    ap.add_argument("--groups-per-step", type=int, default=16)
    ap.add_argument("--median-s", type=float, default=0.1, help="median reward latency")
    ap.add_argument("--sigma", type=float, default=1.5, help="lognormal sigma of the reward latency")
    ap.add_argument("--backend", default="vllm", choices=("vllm", "transformers"))
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args(argv)
    log("goodput", f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    results = {m: run_mode(m, args) for m in args.modes.split(",")}
    for r in results.values():
        print(f"{r['mode']:5s} eta={r['eta']}  {r['samples_per_hour']:10.0f} valid samples/h  "
              f"({r['samples_trained']} trained in {r['seconds']:.0f} s over {r['versions']} versions, "
              f"{r['s_per_version']:.2f} s/version, update {r['update_s_mean']:.2f} s, "
              f"stale dropped {r['stale_dropped']:.0f}, barrier wait {r['barrier_wait_s']:.1f} s)"
              + (f"  DEAD: {r['dead_stages']}" if r["dead_stages"] else ""))
        # Why: a stage's transaction holds its whole batch until the slowest record is done.
        for name, p in r["stages"].items():
            print(f"      {name:8s} {p['batches']:5.0f} transactions, {p['records_per_batch']:6.1f} records each, "
                  f"consume-to-commit {p['batch_s']:5.2f} s, handler mean {p['handler_s']:5.2f} s")
        print(f"      trainer  busy updating {r['trainer_busy']:.0%} of the window")
        print(f"      {describe(r['chain'])}")
    if "sync" in results and "async" in results:
        ratio = results["async"]["samples_per_hour"] / max(results["sync"]["samples_per_hour"], 1e-9)
        print(f"goodput ratio async/sync {ratio:.2f}x   (goal >= 2.5x)")
        results["ratio"] = ratio
    results["load_average"] = os.getloadavg()[0]
    record("goodput_async_vs_sync", {"seconds": args.seconds,
                                     **{f"{m}_per_hour": results[m]["samples_per_hour"]
                                        for m in ("sync", "async") if m in results},
                                     "ratio": results.get("ratio", float("nan"))}, [Goal("ratio", ">=", 2.5)])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
