"""Typed records for tests, produced to a run's topics and read back (committed records, to each partition's end).

Produce is the tests' own: rlstream has no typed-produce helper outside its transactional producer yet.
"""
from __future__ import annotations

import collections

import random
import socket
import time

from confluent_kafka import Producer

from rlstream.kafka.tail import Seen, read_to_end
from rlstream.kafka.topics import TOPICS, topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from rlstream.schemas.records import SamplingParams, Task, Trajectory, Turn

#: How late a busy stage may see a record after it was committed, on CI's loaded machine (it saw 448 ms): a test of
#: what a stage does once it has a record counts from this long after the record was written. Not the consumer's
#: fetch wait (librdkafka's fetch.wait.max.ms, 500 ms): a caught-up read_committed consumer gets a committed record
#: within ~10 ms here (the broker answers a waiting fetch when the transaction's marker lands); it is scheduling.
DELIVERY_SLACK_MS = 500


def produce(bootstrap: str, run: str, logical: str, items: list[tuple], flush: bool = True) -> None:
    """Produce (key, record-or-bytes, headers-or-None[, timestamp ms]) tuples, not in a transaction; records get
    default headers, and the time of producing unless a timestamp is given."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for key, value, headers, *at in items:
        if not isinstance(value, (bytes, bytearray)):
            value = default_codec().encode(TOPICS[logical].record, value.to_dict())
        if headers is None:
            headers = hdr.build(0, hdr.new_traceparent())
        # Timestamp 0: librdkafka stamps the time of producing.
        producer.produce(topic_name(run, logical), value=value, key=key, headers=headers, timestamp=at[0] if at else 0)
    if flush:
        producer.flush(30)


def read_all(bootstrap: str, run: str, logical: str, expect: int = 0, timeout: float = 60.0) -> list[Seen]:
    """Every committed record of a topic (at least ``expect``, waiting up to ``timeout`` for them), decoded."""
    return read_to_end({"bootstrap.servers": bootstrap}, run, logical, expect=expect, timeout=timeout)


def make_task(i: int, group_size: int = 2, answer: str = "cba", prompt: str = "abc>") -> Task:
    """Task ``task-<i>`` of the reverse task."""
    return Task(task_id=f"task-{i}", group_id=f"task-{i}", task_name="reverse", env_name="single",
                env_version="1", prompt=prompt, sampling=SamplingParams(), created_at=hdr.now_ms(),
                answer=answer, group_size=group_size)


def make_trajectory(i: int, response: str = "cba", n_tokens: int = 4, group: int | None = None,
                    version: int = 0) -> Trajectory:
    """Trajectory ``traj-<i>`` of task ``group`` (default ``i``): one action turn of ``n_tokens`` tokens."""
    task = make_task(group if group is not None else i)
    return Trajectory(trajectory_id=f"traj-{i}", group_id=task.group_id, sample_index=0, task=task,
                      response=response, min_policy_version=version, max_policy_version=version,
                      token_ids=list(range(n_tokens)), loss_mask=[1] * n_tokens,
                      behaviour_logprobs=[-1.0] * n_tokens,
                      turns=[Turn("action", response, 0, n_tokens, policy_version=version)])


def wait_for(predicate, timeout: float, what: str, interval: float = 0.3):
    """Poll ``predicate`` until it returns something truthy (returned), or fail saying what never happened."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def free_base_port(n: int = 2) -> int:
    """A port p with p .. p+n-1 all free, below the kernel's ephemeral range (each broker node takes a broker and a
    controller port). An ephemeral port can be taken by any outgoing connection while a broker is down between two
    starts, which made restarts fail now and then."""
    low = 32768
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    top = min(low, 32000) - n if low > 20000 + 10 * n else 32000 - n
    rnd = random.Random()
    for _ in range(100):
        port = rnd.randrange(20000, top)
        socks = []
        try:
            for p in range(port, port + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no run of free ports below the ephemeral range")


def read_uncommitted(bootstrap: str, run: str, logical: str, timeout: float = 30.0) -> list[bytes]:
    """The values of every record of a topic, committed or not (``read_uncommitted``), up to each partition's end:
    what a transaction wrote before it was committed or aborted, which read_committed readers never see."""
    from confluent_kafka import Consumer, TopicPartition
    name = topic_name(run, logical)
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"uncommitted-{random.random()}",
                         "isolation.level": "read_uncommitted", "enable.auto.commit": False})
    try:
        parts = consumer.list_topics(name, timeout=timeout).topics[name].partitions
        ends = {p: consumer.get_watermark_offsets(TopicPartition(name, p), timeout=timeout)[1] for p in parts}
        consumer.assign([TopicPartition(name, p, 0) for p in parts])
        values = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = consumer.poll(0.1)
            if m is not None and not m.error():
                values.append(m.value())
            # The position, not the last offset read: transaction markers take offsets and are never delivered.
            at = {tp.partition: tp.offset for tp in consumer.position([TopicPartition(name, p) for p in parts])}
            if all(at[p] >= ends[p] or ends[p] == 0 for p in parts):
                break
        return values
    finally:
        consumer.close()


def committed_offsets(bootstrap: str, group: str, run: str, logical: str) -> dict[int, int]:
    """Consumer group ``group``'s committed offset per partition of a run's topic (partitions it never committed
    are left out; none while the group's coordinator does not answer, e.g. moving after a broker was lost). The
    group is asked, never joined."""
    from confluent_kafka import Consumer, KafkaException, TopicPartition
    name = topic_name(run, logical)
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        parts = consumer.list_topics(name, timeout=30).topics[name].partitions
        found = consumer.committed([TopicPartition(name, p) for p in parts], timeout=30)
        return {tp.partition: tp.offset for tp in found if tp.offset >= 0}
    except KafkaException:
        return {}
    finally:
        consumer.close()


def wait_consumed(bootstrap: str, group: str, run: str, logical: str, timeout: float = 60.0) -> list[Seen]:
    """Wait until consumer group ``group`` has committed past every committed record of a run's topic (as of the
    call); its records, as ``read_all`` gives them.

    What "nothing more arrives" means for a stage: it commits its outputs in the transaction that commits its input
    offsets, so once its group is past every input record, everything those inputs give is on the output topics,
    and a read to their end sees all of it, duplicates included.
    """
    records = read_all(bootstrap, run, logical)
    wanted: dict[int, int] = {}
    for s in records:
        wanted[s.partition] = max(wanted.get(s.partition, 0), s.offset + 1)
    wait_for(lambda: all(committed_offsets(bootstrap, group, run, logical).get(p, -1) >= o for p, o in wanted.items()),
             timeout, f"group {group} to commit past the {len(records)} records of {logical}")
    return records


def assert_rewarded_once(bootstrap: str, run: str, n: int, timeout: float = 120.0, context: str = "") -> None:
    """A reward stage's exactly-once, from the topics: each of its ``n`` inputs has one reward, once its group is
    past every input (a duplicate would be on the topic by then), and nothing went to dead-letters."""
    read_all(bootstrap, run, "rewards", expect=n, timeout=timeout)
    wait_consumed(bootstrap, f"{run}.reward", run, "trajectories", timeout=timeout)
    counts = collections.Counter(r.record.trajectory.trajectory_id for r in read_all(bootstrap, run, "rewards"))
    assert len(counts) == n, f"lost {n - len(counts)} records\n{context}"
    assert max(counts.values()) == 1, f"duplicated: {[k for k, c in counts.items() if c > 1][:5]}"
    assert read_all(bootstrap, run, "dead-letters") == []
