"""Consumer-group scaling of the reward stage: throughput at 1, 2, 4, 8 processes, with an I/O-bound judge (the
default) or a CPU-bound one (``--judge cpu``).

    python -m benchmarks.reward_scaling [--consumers 1,2,4,8] [--per-consumer 800] [--concurrency 2] [--judge io|cpu]

Each point is a fresh run (8 partitions per topic) whose reward group is N separate ``rlstream run reward``
processes with benchmarks/harness/workloads.py:io_judge (asyncio.sleep of 50 ms, no CPU). An async judge lets one
process keep --concurrency judgements in flight, so one process alone could absorb the whole load; --concurrency 2 caps
each process at about 2 / 50 ms = 40 records/s, which makes one consumer the bottleneck and the group's size
what is measured. ``--judge cpu`` is benchmarks/harness/workloads.py:cpu_judge instead: ``--judge-s`` of its
thread's CPU time, holding the GIL, so a process scores on one core and a group can scale only as far as the
machine's cores (less the broker's and the producer's share): its goal is 0.9x min(N, cores).
Once the group is stable with N members, per-consumer x N trajectories are produced evenly
over the partitions; throughput is counted from the group's committed offsets, from the first commit to the last.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from confluent_kafka import ConsumerGroupState, Producer
from confluent_kafka.admin import AdminClient

from benchmarks.harness.groups import group_offsets
from benchmarks.harness.loop import Loop, log
from benchmarks.harness.record import Goal, record
from benchmarks.harness.workloads import make_trajectory
from rlstream.kafka.topics import topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec

#: --judge -> the reward function each process loads.
JUDGES = {"io": "benchmarks.harness.workloads:io_judge", "cpu": "benchmarks.harness.workloads:cpu_judge"}


def stable_members(admin: AdminClient, group: str) -> int:
    """Members of a stable group that hold partitions (0 while it rebalances)."""
    try:
        desc = admin.describe_consumer_groups([group], request_timeout=5)[group].result(10)
    except Exception:  # the coordinator may not know the group yet
        return 0
    if desc.state != ConsumerGroupState.STABLE:
        return 0
    return sum(1 for m in desc.members if m.assignment and m.assignment.topic_partitions)


def one_point(n: int, args) -> dict:
    """Throughput of a reward group of ``n`` processes."""
    loop = Loop(f"rscale-{n}", partitions=args.partitions, BENCH_JUDGE_S=str(args.judge_s))
    for i in range(n):
        loop.reward(JUDGES[args.judge], instance=i, concurrency=args.concurrency, batch_size=args.batch_size)
    loop.start()
    admin = AdminClient({"bootstrap.servers": loop.bootstrap})
    group = f"{loop.run}.reward"
    try:
        deadline = time.monotonic() + 180
        # Every member must hold partitions before the clock starts: a rebalance mid-run is not scaling.
        while stable_members(admin, group) < min(n, args.partitions):
            if time.monotonic() > deadline or loop.dead():
                raise RuntimeError(f"{n} consumers: group never stable (dead {loop.dead()}); logs {loop.workdir}")
            time.sleep(0.5)
        total = args.per_consumer * n
        codec = default_codec()
        topic = topic_name(loop.run, "trajectories")
        producer = Producer({"bootstrap.servers": loop.bootstrap, "linger.ms": 5})
        headers = hdr.build(0, hdr.new_traceparent())
        for i in range(total):
            value = codec.encode("Trajectory", make_trajectory(i).to_dict())
            producer.produce(topic, value=value, key=f"g{i}", partition=i % args.partitions, headers=headers)
            producer.poll(0)
        producer.flush(60)
        first = None
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            done = sum(group_offsets(admin, group).values())
            now = time.monotonic()
            if first is None and done > 0:
                first = (now, done)
            if done >= total:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"{n} consumers: {done}/{total} scored within {args.timeout}s")
        seconds = now - first[0]
        rate = (total - first[1]) / seconds if seconds > 0 else float("nan")
        log("scaling", f"{n} consumers: {total} records, {rate:.0f}/s")
        return {"consumers": n, "records": total, "seconds": seconds, "records_per_s": rate}
    finally:
        loop.stop()


def main(argv=None) -> dict:
    """Run the benchmark from the command line; its results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--consumers", default="1,2,4,8")
    ap.add_argument("--per-consumer", type=int, default=800, help="records per consumer (N x this in all)")
    ap.add_argument("--concurrency", type=int, default=2, help="judgements in flight per process")
    ap.add_argument("--batch-size", type=int, default=16, help="records per transaction")
    ap.add_argument("--judge", choices=sorted(JUDGES), default="io",
                    help="io: asyncio.sleep(--judge-s); cpu: --judge-s of CPU time in the judge's thread")
    ap.add_argument("--judge-s", type=float, default=0.05)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    log("scaling", f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    points = [one_point(int(n), args) for n in args.consumers.split(",")]
    base = points[0]["records_per_s"] / points[0]["consumers"]
    cores = os.cpu_count() or 1
    # A CPU-bound judge cannot scale past the cores; an I/O-bound one should scale with the group.
    bound = (lambda n: min(n, cores)) if args.judge == "cpu" else (lambda n: n)
    print(f"reward stage, {args.judge} judge {args.judge_s * 1000:.0f} ms, concurrency {args.concurrency} per process, "
          f"batch {args.batch_size}, {args.partitions} partitions")
    for p in points:
        p["ratio"] = p["records_per_s"] / base
        print(f"{p['consumers']} consumers  {p['records_per_s']:8.1f} records/s  ratio {p['ratio']:5.2f}x  "
              f"(goal >= {0.9 * bound(p['consumers']):.1f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"points": points, "load_average": os.getloadavg()[0]}, indent=1))
    record("reward_scaling", {"judge_ms": args.judge_s * 1000, "concurrency": args.concurrency,
                              **{f"ratio_{p['consumers']}": p["ratio"] for p in points}},
           [Goal(f"ratio_{p['consumers']}", ">=", 0.9 * bound(p["consumers"])) for p in points if p["consumers"] > 1])
    return {"points": points}


if __name__ == "__main__":
    main()
