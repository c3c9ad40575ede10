"""Archive ingest rate: trajectories/s from Kafka into embedded chDB, against a 50,000/s goal.

Pre-produces N small trajectories to a fresh run, then times the sink end to end
(consume, decode, insert, commit) with ClickHouse decoding the Avro (the default)
and with Python decoding it, then the parts alone. Besides wall-clock rows/s it
prints rows per CPU-second of this process (chDB's threads included), which a
busy shared machine disturbs far less.

    python -m benchmarks.archive_ingest --count 100000 --tokens 30
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

from confluent_kafka import Producer

from benchmarks.harness.record import Goal, record
from benchmarks.harness.scratch import discard_at_exit, run_name
from rlstream.archive.decode import NativeTable, meta_row
from rlstream.archive.sink import ArchiveSettings, ArchiveSink
from rlstream.archive.tables import TABLES
from rlstream.config import KafkaSettings, LoopSettings
from rlstream.kafka.topics import create_topics, topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from rlstream.schemas.records import SamplingParams, Task, Trajectory, Turn

GOAL = 50_000


def trajectory(i: int, n_tokens: int) -> Trajectory:
    task = Task(task_id=f"task-{i // 8}", group_id=f"task-{i // 8}", task_name="reverse", env_name="single",
                env_version="1", prompt="abc>", sampling=SamplingParams(), created_at=hdr.now_ms(), answer="cba")
    return Trajectory(trajectory_id=f"traj-{i}", group_id=task.group_id, sample_index=i % 8, task=task,
                      response="cba", min_policy_version=3, max_policy_version=3, token_ids=list(range(n_tokens)),
                      loss_mask=[1] * n_tokens, behaviour_logprobs=[-0.5] * n_tokens,
                      turns=[Turn("action", "cba", 0, n_tokens, policy_version=3)],
                      stage_times={"rollout": hdr.now_ms(), "env": hdr.now_ms()})


def produce(bootstrap: str, run: str, values: list[bytes]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "compression.type": "lz4",
                         "queue.buffering.max.messages": 1_000_000})
    headers = hdr.build(3, hdr.new_traceparent())
    name = topic_name(run, "trajectories")
    for i, value in enumerate(values):
        while True:
            try:
                producer.produce(name, value=value, key=f"task-{i // 8}".encode(), headers=headers)
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(120)


class _Msg:
    """Just enough of a confluent_kafka Message for the parts measured without Kafka."""

    __slots__ = ("_v", "_o")

    def __init__(self, value: bytes, offset: int):
        self._v, self._o = value, offset

    def value(self): return self._v
    def key(self): return b"task-0"
    def offset(self): return self._o
    def partition(self): return 0
    def topic(self): return "bench.trajectories"
    def timestamp(self): return (1, 1_700_000_000_000)
    def headers(self): return [("policy_version", b"3"), ("traceparent", b"00-ab-cd-01"), ("produced_at", b"17")]
    def __len__(self): return len(self._v)


class _Clock:
    """Wall and process-CPU seconds of a block."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def end_to_end(args, values: list[bytes], tmp: str, native: bool) -> tuple[float, float]:
    """(rows/s from first record consumed to last batch committed, rows per CPU-second)."""
    run = run_name("archive")
    create_topics({"bootstrap.servers": args.bootstrap}, run)
    discard_at_exit(args.bootstrap, run)
    produce(args.bootstrap, run, values)
    sink = ArchiveSink(ArchiveSettings(archive_batch_rows=args.batch_rows, archive_clickhouse_decode=native),
                       LoopSettings(archive=f"chdb://{tmp}/{run}"))
    with _Clock() as clock:
        sink.serve(KafkaSettings(bootstrap=args.bootstrap, run=run), idle_exit_s=2.0)
    assert sink.stats["rows"] == len(values), sink.stats
    return len(values) / (sink.stats["last_flushed"] - sink.stats["first_consumed"]), len(values) / clock.cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--tokens", type=int, default=30)
    parser.add_argument("--batch-rows", type=int, default=ArchiveSettings().archive_batch_rows)
    parser.add_argument("--bootstrap", default=os.environ.get("RLSTREAM_BOOTSTRAP", "127.0.0.1:9092"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    codec = default_codec()
    values = [codec.encode("Trajectory", trajectory(i, args.tokens).to_dict()) for i in range(args.count)]
    n = args.count
    print(f"{n} trajectories of {args.tokens} tokens, {sum(map(len, values)) / n:.0f} bytes each, batches of "
          f"{args.batch_rows}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")

    with tempfile.TemporaryDirectory(prefix="rlstream-archive-bench-") as tmp:
        native = end_to_end(args, values, tmp, native=True)
        python = end_to_end(args, values, tmp, native=False)

        # The parts, without Kafka.
        sink = ArchiveSink(ArchiveSettings(), LoopSettings(archive=f"chdb://{tmp}/parts"))
        sink.open()
        msgs = [_Msg(v, i) for i, v in enumerate(values)]
        spec = sink._native_tables.setdefault("trajectories", NativeTable("trajectories"))
        batches = [msgs[i:i + args.batch_rows] for i in range(0, n, args.batch_rows)]
        with _Clock() as wrap:
            containers = [spec.container("bench", b) for b in batches]
        with _Clock() as ch_insert:
            for data, batch in zip(containers, batches):
                sink._insert_native("trajectories", data, len(batch))
        with _Clock() as decode:
            decoded = [codec.decode(v, expect="Trajectory")[1] for v in values]
        with _Clock() as build:
            rows = [meta_row("bench2", "trajectories", m) + TABLES["trajectories"].row(r, "trajectories")
                    for m, r in zip(msgs, decoded)]
        with _Clock() as insert:
            for i in range(0, n, args.batch_rows):
                sink._insert("trajectories", rows[i:i + args.batch_rows])
        sink.close()

    def line(label: str, wall_rate: float, cpu_rate: float) -> None:
        print(f"{label:<44}{wall_rate:>9,.0f} rows/s  {wall_rate / GOAL:5.2f}x goal  {cpu_rate:>9,.0f} rows/CPU-s")

    print(f"{'':<44}{'wall':>16}{'':13}{'CPU cost':>18}")
    line("end to end, ClickHouse decodes (default)", *native)
    line("end to end, Python decodes", *python)
    for label, c in (("  wrap records into an Avro container", wrap),
                     ("  ClickHouse decode + insert (chDB)", ch_insert), ("  Python decode (codec)", decode),
                     ("  Python row build", build), ("  column-oriented client.insert", insert)):
        line(label, n / c.wall, n / c.cpu)
    print(f"load average {os.getloadavg()[0]:.1f} at end; {len(rows[0])} columns per row")
    record("archive_ingest", dict(rows=n, tokens=args.tokens, native_rows_per_s=native[0],
                                  python_rows_per_s=python[0], native_vs_goal=native[0] / GOAL),
           [Goal("native_rows_per_s", ">=", GOAL)])


if __name__ == "__main__":
    main()
