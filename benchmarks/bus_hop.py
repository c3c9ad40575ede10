"""One exactly-once hop against raw pass-through, on the same broker in the same run.

    python -m benchmarks.bus_hop [--records 10000] [--tokens 1000] [--rounds 3]

The broker: $RLSTREAM_BOOTSTRAP when set (a broker someone else runs; this script never starts or stops it), else
the project's own local broker, started if needed (``rlstream up``).

- raw: consume bytes from one topic and produce them to another: no Avro, no transactions.
- hop: the reward stage on the shared runtime: decode a Trajectory, score it, encode a
  ScoredTrajectory, produce, and commit input offsets in the same transaction; once a batch per
  transaction (--no-pipeline, one handler thread) and once pipelined (--concurrency records in flight).
Raw, batch and pipelined runs alternate for --rounds rounds; prints the medians' records/s and ratios (goal: hop
>= 0.7 x raw and >= 10,000/s), and the hop process's CPU µs a record: on a machine shared with other work that
moves less than a rate does (a rate waits for the CPU the others take; the CPU a record needs stays put).

- back-to-back transactions: what a transaction of a few small records costs when the next begins as soon as the
  last committed (a gateway's closes, a stage's small polls), p50 over --transactions, with the loop's producer
  settings and again with librdkafka's default retry backoff (``kafka.transactions.producer_config`` says why the
  loop's differs).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

from confluent_kafka import Consumer, Producer

from benchmarks.harness.record import Goal, record
from benchmarks.harness.scratch import discard_at_exit, run_name
from benchmarks.harness.workloads import make_trajectory
from rlstream.config import KafkaSettings
from rlstream.infra import broker
from rlstream.kafka.topics import create_topics, topic_name
from rlstream.kafka.transactions import TXN_RETRY_BACKOFF_MS, TransactionalProducer
from rlstream.runtime.runner import StageRunner
from rlstream.runtime.settings import RuntimeSettings
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from rlstream.stages.reward import RewardSettings, RewardStage


def fill(bootstrap: str, topic: str, values: list[bytes], with_headers: bool) -> None:
    """Produce ``values`` to ``topic`` (with the headers a stage needs when ``with_headers``)."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "compression.type": "lz4",
                         "queue.buffering.max.kbytes": 1048576})
    headers = hdr.build(0, hdr.new_traceparent()) if with_headers else None
    for i, v in enumerate(values):
        while True:
            try:
                producer.produce(topic, value=v, key=f"g{i % 512}", headers=headers)
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(120)


def raw_pass_through(bootstrap: str, src: str, dst: str, n: int) -> float:
    """Records/s of plain consume-and-produce from ``src`` to ``dst``: no Avro, no transactions."""
    # As fast as librdkafka goes from Python: large fetches, 10,000 records a consume call, batched lz4 produce.
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"raw-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": True,
                         "max.partition.fetch.bytes": 16 << 20, "fetch.min.bytes": 1 << 20, "fetch.wait.max.ms": 20})
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.size": 4 << 20,
                         "compression.type": "lz4", "queue.buffering.max.kbytes": 1048576})
    consumer.subscribe([src])
    done, started = 0, None
    while done < n:
        for m in consumer.consume(10000, 1.0):
            if m.error():
                continue
            started = started or time.perf_counter()
            while True:
                try:
                    producer.produce(dst, value=m.value(), key=m.key())
                    break
                except BufferError:
                    producer.poll(0.05)
            done += 1
    producer.flush(120)
    elapsed = time.perf_counter() - started
    consumer.close()
    return n / elapsed


def eos_hop(bootstrap: str, run: str, n: int, pipeline: bool, concurrency: int) -> tuple[float, float]:
    """Records/s of the reward stage on the shared runtime, from its first record to its n-th commit, and the
    process's CPU µs per record over the same span (every thread's: the stage's, the runtime's, librdkafka's)."""
    stage = RewardStage(RewardSettings(reward="benchmarks.harness.workloads:constant"))
    # The clock starts at the first record handed to the stage, so the timed part excludes group join; the runner's
    # public hooks count records handed in and records committed.
    counted = {"n": 0, "t0": None, "cpu0": None}

    def consumed(k: int) -> None:
        if counted["t0"] is None:
            counted["t0"], counted["cpu0"] = time.perf_counter(), time.process_time()

    def committed(k: int) -> None:
        counted["n"] += k
        if counted["n"] >= n:
            runner.request_stop()

    runner = StageRunner(stage, KafkaSettings(bootstrap=bootstrap, run=run),
                         RuntimeSettings(batch_size=500, concurrency=concurrency, pipeline=pipeline),
                         on_consumed=consumed, on_committed=committed)
    runner.run()
    wall, cpu = time.perf_counter() - counted["t0"], time.process_time() - counted["cpu0"]
    return n / wall, cpu / n * 1e6


def back_to_back_ms(bootstrap: str, run: str, backoff_ms: int, n: int) -> float:
    """p50 ms of a transaction of 10 small records and an input offset, each begun as the last one committed."""
    topic, source = topic_name(run, "trajectories"), topic_name(run, "actions")
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"b2b-{uuid.uuid4().hex}"})
    consumer.subscribe([source])
    consumer.poll(1.0)  # joins the group: send_offsets_to_transaction needs its metadata
    group = consumer.consumer_group_metadata()
    txn = TransactionalProducer(KafkaSettings(bootstrap=bootstrap, run=run), f"b2b-{uuid.uuid4().hex}", who="bench",
                                **{"retry.backoff.ms": backoff_ms})
    txn.start()

    def body():
        for i in range(10):
            txn.produce(topic, b"x" * 300, f"k{i}")
        return [(source, 0, 1, None)]
    times = []
    for i in range(n + 10):  # the first 10 warm the connections up
        started = time.perf_counter()
        if not txn.transact(body, lambda: group):
            raise RuntimeError(f"a back-to-back transaction aborted: {txn.failure}")
        if i >= 10:
            times.append((time.perf_counter() - started) * 1000)
    consumer.close()
    return statistics.median(times)


def main() -> None:
    """Raw pass-through, then the hop in both runtime modes; print records/s and ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=10000)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64, help="records in flight in the pipelined hop")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of raw, batch and pipelined runs (medians)")
    parser.add_argument("--transactions", type=int, default=100, help="back-to-back transactions timed per setting")
    args = parser.parse_args()
    bootstrap = os.environ.get("RLSTREAM_BOOTSTRAP") or broker.up()
    run = run_name("hop")
    create_topics({"bootstrap.servers": bootstrap}, run, partitions=4)
    discard_at_exit(bootstrap, run)
    codec = default_codec()
    value = codec.encode("Trajectory", make_trajectory(0, n_tokens=args.tokens).to_dict())
    values = [value] * args.records
    print(f"{args.records} trajectories of {args.tokens} tokens ({len(value)} bytes each), broker {bootstrap}")

    # The three runs alternate, round after round, so a drift in the machine's load falls on each of them alike;
    # each round reads its own freshly filled topics, and the medians are reported.
    rates: dict[str, list[float]] = {"raw": [], "batch": [], "pipelined": []}
    cpu_us: dict[str, list[float]] = {"batch": [], "pipelined": []}
    for r in range(args.rounds):
        raw_run = f"{run}-raw{r}"
        create_topics({"bootstrap.servers": bootstrap}, raw_run, partitions=4)
        discard_at_exit(bootstrap, raw_run)
        fill(bootstrap, topic_name(raw_run, "prompts"), values, with_headers=False)  # any two topics will do
        rates["raw"].append(raw_pass_through(bootstrap, topic_name(raw_run, "prompts"),
                                             topic_name(raw_run, "actions"), args.records))
        for mode, pipeline, concurrency in (("batch", False, 1), ("pipelined", True, args.concurrency)):
            hop_run = f"{run}-{mode}{r}"
            create_topics({"bootstrap.servers": bootstrap}, hop_run, partitions=4)
            discard_at_exit(bootstrap, hop_run)
            fill(bootstrap, topic_name(hop_run, "trajectories"), values, with_headers=True)
            rate, cpu = eos_hop(bootstrap, hop_run, args.records, pipeline, concurrency)
            rates[mode].append(rate)
            cpu_us[mode].append(cpu)
        print(f"round {r}: " + ", ".join(f"{m} {v[-1]:.0f}/s" for m, v in rates.items()), flush=True)
    b2b_run = f"{run}-b2b"
    create_topics({"bootstrap.servers": bootstrap}, b2b_run, partitions=4)
    discard_at_exit(bootstrap, b2b_run)
    b2b = {"loop": back_to_back_ms(bootstrap, b2b_run, TXN_RETRY_BACKOFF_MS, args.transactions),
           "default": back_to_back_ms(bootstrap, b2b_run, 100, args.transactions)}
    print(f"back-to-back transaction p50: {b2b['loop']:.1f} ms at retry.backoff.ms={TXN_RETRY_BACKOFF_MS}, "
          f"{b2b['default']:.1f} ms at librdkafka's default 100")
    raw = statistics.median(rates["raw"])
    hops = {m: statistics.median(rates[m]) for m in ("batch", "pipelined")}
    cpus = {m: statistics.median(cpu_us[m]) for m in cpu_us}
    print(f"raw pass-through      {raw:10.0f} records/s (median of {args.rounds})")
    for mode, hop in hops.items():
        print(f"exactly-once hop, {mode:9s} {hop:10.0f} records/s   ratio hop/raw {hop / raw:5.2f} (goal >= 0.7), "
              f"{hop / 10000:4.2f}x the 10,000/s goal; {cpus[mode]:.0f} CPU-µs a record "
              f"({min(cpu_us[mode]):.0f}-{max(cpu_us[mode]):.0f})")
    record("bus_hop", dict(records=args.records, rounds=args.rounds, raw_per_s=raw,
                           **{f"{m}_per_s": h for m, h in hops.items()},
                           **{f"{m}_ratio": h / raw for m, h in hops.items()},
                           **{f"{m}_cpu_us_per_record": c for m, c in cpus.items()},
                           txn_b2b_p50_ms=b2b["loop"], txn_b2b_default_backoff_p50_ms=b2b["default"],
                           txn_b2b_vs_default_ratio=b2b["loop"] / b2b["default"]),
           [Goal(f"{m}_ratio", ">=", 0.7) for m in hops] + [Goal(f"{m}_per_s", ">=", 10_000) for m in hops])

if __name__ == "__main__":
    main()
