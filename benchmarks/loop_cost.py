"""The loop's own cost and its chain's latency: the demo loop (tiny model, reverse task, η = 2, no added judge
latency) run for N versions, per mode.

For each mode it prints seconds per version, CPU seconds per version per stage process (the broker is shared by
every run on the machine, so it is left out), and the chain per step, p50 and p99 over the measured versions:
prompt created → generated → env → scored → waited in the trainer's window → trained and published (each step's
PolicyVersion metrics, ``rlstream.trainer.chain``) → loaded by rollout (its publish-latency histogram). ``chain``
is prompt created → version published; with η = 2 three steps are in flight, so a latency-bound loop publishes a
version every chain / 3 seconds.

Modes (``--modes``): ``fast`` is the trainer's defaults; ``checkpoint-every-version`` is the path before this
benchmark, a full checkpoint (weights, tokenizer, optimizer state) written to the store for every version and
loaded from there by rollout (``--checkpoint-every 1 --weights-transport store``), so one run compares them;
``fast-transformers`` is ``fast`` with rollout on plain transformers instead of vLLM; ``fused`` is ``fast`` with
env and reward chained in one process and one transaction (``rlstream run env+reward``, rlstream/runtime/chain.py);
``batch`` and ``fused-batch`` are ``fast`` and ``fused`` with env and reward unpipelined (``--no-pipeline``: each
poll's records in one call of each stage's ``handle_batch``, one transaction per poll).

``RLSTREAM_PROFILE=DIR`` (``rlstream.runtime.profile``) on this command profiles every stage process too.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.loop import Loop, PacedSource, Versions, cpu_seconds, log
from benchmarks.harness.record import Goal, record
from rlstream.trainer.chain import summarize

@dataclass(frozen=True)
class Mode:
    """What a mode changes from the demo loop."""
    trainer_flags: tuple[str, ...] = ()
    backend: str | None = None  # rollout's; None: --backend
    fused: bool = False  # env and reward chained in one process and one transaction (rlstream run env+reward)
    unpipelined: bool = False  # env and reward with --no-pipeline: each poll's records one handle_batch call


MODES = {"fast": Mode(),
         "checkpoint-every-version": Mode(trainer_flags=("--checkpoint-every", "1", "--weights-transport", "store")),
         # The same loop with rollout on plain transformers: what vLLM's engine costs around a 0.5 M model.
         "fast-transformers": Mode(backend="transformers"),
         "fused": Mode(fused=True),
         # EnvStage/RewardStage.handle_batch on a single-turn task and a sync judge: one transaction per poll.
         "batch": Mode(unpipelined=True),
         "fused-batch": Mode(fused=True, unpipelined=True)}


def transactions(loop: Loop) -> dict[str, float]:
    """Committed transactions of each stream stage so far (rollout: one per generated batch)."""
    return {n: loop.scrape(n, "rlstream_batch_seconds_count") or 0.0 for n in loop.sup.procs if n != "trainer"}


def histogram(loop: Loop, name: str, metric: str) -> tuple[float, float]:
    """(sum, count) of a stage's histogram now."""
    return loop.scrape(name, metric + "_sum") or 0.0, loop.scrape(name, metric + "_count") or 0.0


def profiles(loop: Loop) -> dict:
    """Each stage's profile so far (``RLSTREAM_PROFILE``), by stage name; empty when not profiling."""
    from rlstream.runtime.profile import read_collapsed
    folder = os.environ.get("RLSTREAM_PROFILE")
    out = {}
    for name, proc in loop.sup.procs.items() if folder else ():
        found = list(Path(folder).glob(f"*-{proc.pid}.collapsed"))
        if found:
            out[name] = read_collapsed(found[0])
    return out


def write_profiles(before: dict, after: dict, mode: str, versions: int) -> None:
    """The measured versions' share of each stage's profile, ``DIR/measured-<mode>-<stage>.txt``."""
    from rlstream.runtime.profile import report
    for name, stacks in after.items():
        stacks.subtract(before.get(name, {}))
        path = Path(os.environ["RLSTREAM_PROFILE"]) / f"measured-{mode}-{name}.txt"
        path.write_text(f"{name}, {mode}: CPU s over {versions} versions (divide by it for per version)\n\n"
                        + report(stacks))


def run_mode(mode: str, args) -> dict:
    """One fresh loop in ``mode``: skip ``--skip`` versions after rollout starts, then measure ``--versions``."""
    loop = Loop(f"loopcost-{mode[:4]}")
    m = MODES[mode]
    loop.trainer(eta=2, groups_per_step=16, lr=1e-4, warmup_steps=args.warmup_steps, extra=m.trainer_flags)
    loop.rollout(eta=2, backend=m.backend or args.backend)
    stage_flags = ("--no-pipeline",) if m.unpipelined else ()
    if m.fused:
        loop.env_reward("benchmarks.harness.workloads:exact", concurrency=256, extra=stage_flags)
    else:
        loop.env_stage(extra=stage_flags)
        loop.reward("benchmarks.harness.workloads:exact", concurrency=256, extra=stage_flags)
    versions = Versions(loop)
    source = PacedSource(loop, versions, mode="async", eta=2, groups_per_step=16)
    try:
        loop.start()
        deadline = time.monotonic() + args.startup_timeout
        while loop.rollout_version() < 0:
            if time.monotonic() > deadline or loop.dead():
                raise RuntimeError(f"{mode}: the loop did not start (dead {loop.dead()}); logs in {loop.workdir}")
            time.sleep(0.2)
        source.start()
        first = max(versions.latest(), 0) + args.skip
        if not versions.wait_for(first, args.startup_timeout, lambda: not loop.dead()):
            raise RuntimeError(f"{mode}: v{first} not reached (dead {loop.dead()}); logs in {loop.workdir}")
        t0, cpu0, prof0 = time.monotonic(), cpu_seconds(loop), profiles(loop)
        txns0 = transactions(loop)
        load0 = histogram(loop, "rollout", "rlstream_policy_publish_latency_seconds")
        last = first + args.versions
        if not versions.wait_for(last, args.max_seconds, lambda: not loop.dead() and source.error is None):
            raise RuntimeError(f"{mode}: v{last} not reached in {args.max_seconds} s (at v{versions.latest()}, dead "
                               f"{loop.dead()}, source {source.error!r}); logs in {loop.workdir}")
        elapsed, cpu1 = time.monotonic() - t0, cpu_seconds(loop)
        txns1 = transactions(loop)
        write_profiles(prof0, profiles(loop), mode, args.versions)
        load1 = histogram(loop, "rollout", "rlstream_policy_publish_latency_seconds")
        measured = [pv.metrics for pv, _ in versions.all() if first < pv.version <= last]
    finally:
        source.stop()
        dead = loop.dead()
        loop.stop()
        versions.close()
    loads = load1[1] - load0[1]
    return {"mode": mode, "run": loop.run, "versions": args.versions, "s_per_version": elapsed / args.versions,
            "cpu_s_per_version": {n: (cpu1[n] - cpu0.get(n, 0.0)) / args.versions for n in cpu1},
            "chain": summarize(measured),
            "transactions_per_version": {n: (txns1[n] - txns0.get(n, 0.0)) / args.versions for n in txns1}, "load_s_mean": (load1[0] - load0[0]) / loads if loads else float("nan"),
            "dead_stages": dead}


def describe(r: dict) -> list[str]:
    """The mode's lines: time and CPU per version, then every hop at p50 / p99."""
    cpu = r["cpu_s_per_version"]
    lines = [f"{r['mode']}: {r['s_per_version']:.3f} s/version over {r['versions']} versions; CPU s/version "
             f"{sum(cpu.values()):.3f} (" + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items()) + ")"]
    for key, q in r["chain"].items():
        share = f" ({q['share']:.0%} of the chain)" if "share" in q else ""
        lines.append(f"    {key:26s} p50 {q['p50']:.3f} s  p99 {q['p99']:.3f} s{share}")
    lines.append(f"    {'publish -> rollout loaded':26s} mean {r['load_s_mean']:.3f} s")
    lines.append("    transactions per version: " + ", ".join(f"{k} {v:.1f}"
                                                          for k, v in r["transactions_per_version"].items()))
    if r["dead_stages"]:
        lines.append(f"    stages that died: {r['dead_stages']}")
    return lines


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=150, help="versions measured per mode")
    ap.add_argument("--skip", type=int, default=10, help="versions after rollout starts left off the measure")
    ap.add_argument("--modes", default="fast,checkpoint-every-version", help=f"comma-separated, of {list(MODES)}")
    ap.add_argument("--backend", default="vllm", choices=("vllm", "transformers"))
    ap.add_argument("--warmup-steps", type=int, default=300, help="the trainer's supervised warm-up (the demo's)")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--max-seconds", type=float, default=600, help="most seconds for the measured versions")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}: expected some of {list(MODES)}")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", file=sys.stderr)
    out = []
    for mode in modes:
        log("loop_cost", f"mode {mode}")
        r = run_mode(mode, args)
        out.append(r)
        print("\n".join(describe(r)), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    figures = {}
    for r in out:
        tag = {"fast": "fast", "checkpoint-every-version": "baseline"}.get(r["mode"], r["mode"].replace("-", "_"))
        chain = r["chain"].get("chain_s", {})
        cpu = r["cpu_s_per_version"]
        # env and reward, apart or chained: what the hop between them costs a version
        env_reward = sum(v for k, v in cpu.items() if k in ("env", "reward", "env+reward"))
        figures.update({f"{tag}_s_per_version": r["s_per_version"],
                        f"{tag}_cpu_s_per_version": sum(cpu.values()),
                        f"{tag}_env_reward_cpu_s": env_reward,
                        f"{tag}_chain_p50_s": chain.get("p50", float("nan")),
                        f"{tag}_chain_p99_s": chain.get("p99", float("nan"))})
    # The chain goal; "CPU-s per version down" is a comparison of two modes, read from the table.
    record("loop_cost", figures, [Goal(k, "<=", 0.25) for k in figures if k.endswith("_chain_p50_s")]
           + [Goal(k, "<=", 0.02) for k in figures if k.endswith("_env_reward_cpu_s")])
    return out


if __name__ == "__main__":
    main()
