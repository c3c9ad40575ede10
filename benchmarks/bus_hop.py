"""One exactly-once hop against raw pass-through, on the same broker in the same run.

    python benchmarks/bus_hop.py [--records 10000] [--tokens 1000]

- raw: consume bytes from one topic and produce them to another: no Avro, no transactions.
- hop: the reward stage on the shared runtime: decode a Trajectory, score it, encode a
  ScoredTrajectory, produce, and commit input offsets in the same transaction.
Prints records/s for both and their ratio (goal: hop >= 0.5 x raw and >= 10,000/s).
"""
from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

from confluent_kafka import Consumer, Producer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kafka_util import make_trajectory  # noqa: E402

from rlstream.config import KafkaSettings  # noqa: E402
from rlstream.infra import broker  # noqa: E402
from rlstream.infra.topics import create_topics, topic_name  # noqa: E402
from rlstream.schemas import headers as hdr  # noqa: E402
from rlstream.schemas.codec import default_codec  # noqa: E402
from rlstream.streams.reward import RewardSettings, RewardStage  # noqa: E402
from rlstream.streams.runtime import RuntimeSettings, StageRunner  # noqa: E402


def constant_reward(trajectory) -> float:
    """A reward that costs nothing, so the hop measures the bus."""
    return 1.0


def fill(bootstrap: str, topic: str, values: list[bytes], with_headers: bool) -> None:
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
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"raw-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": True,
                         "max.partition.fetch.bytes": 16 << 20})
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "compression.type": "lz4",
                         "queue.buffering.max.kbytes": 1048576})
    consumer.subscribe([src])
    done, started = 0, None
    while done < n:
        for m in consumer.consume(256, 1.0):
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


def eos_hop(bootstrap: str, run: str, n: int) -> float:
    stage = RewardStage(RewardSettings(reward=f"{__name__}:constant_reward" if __name__ != "__main__"
                                       else "bus_hop:constant_reward"))
    runner = StageRunner(stage, KafkaSettings(bootstrap=bootstrap, run=run),
                         RuntimeSettings(batch_size=500, concurrency=1))
    # Wait for the first records so the timed part excludes group join.
    counted = {"n": 0, "t0": None}
    original = runner._process_batch

    def timed(msgs):
        counted["t0"] = counted["t0"] or time.perf_counter()
        original(msgs)
        counted["n"] += len(msgs)
        if counted["n"] >= n:
            runner.request_stop()

    runner._process_batch = timed
    runner.run()
    return n / (time.perf_counter() - counted["t0"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=10000)
    parser.add_argument("--tokens", type=int, default=1000)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    bootstrap = broker.up()
    run = "bench-hop-" + uuid.uuid4().hex[:8]
    create_topics({"bootstrap.servers": bootstrap}, run, partitions=4)
    codec = default_codec()
    value = codec.encode("Trajectory", make_trajectory(0, n_tokens=args.tokens).to_dict())
    values = [value] * args.records
    print(f"{args.records} trajectories of {args.tokens} tokens ({len(value)} bytes each), broker {bootstrap}")

    fill(bootstrap, topic_name(run, "prompts"), values, with_headers=False)  # raw source (any topic will do)
    raw = raw_pass_through(bootstrap, topic_name(run, "prompts"), topic_name(run, "actions"), args.records)
    fill(bootstrap, topic_name(run, "trajectories"), values, with_headers=True)
    hop = eos_hop(bootstrap, run, args.records)
    print(f"raw pass-through      {raw:10.0f} records/s")
    print(f"exactly-once hop      {hop:10.0f} records/s")
    print(f"ratio hop/raw         {hop / raw:10.2f}   (goal >= 0.5)")
    print(f"hop vs 10,000/s goal  {hop / 10000:10.2f}x")


if __name__ == "__main__":
    main()
