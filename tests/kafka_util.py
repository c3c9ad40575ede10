"""Helpers for integration tests: produce typed records and read a topic back under read_committed."""
from __future__ import annotations

import time

from confluent_kafka import Consumer, Producer, TopicPartition

from rlstream.kafka.topics import TOPICS, topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from rlstream.schemas.records import RECORD_TYPES, SamplingParams, Task, Trajectory, Turn


def produce(bootstrap: str, run: str, logical: str, items: list[tuple], flush: bool = True) -> None:
    """Produce (key, record-or-bytes, headers-or-None) tuples; records get default headers."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for key, value, headers in items:
        if not isinstance(value, (bytes, bytearray)):
            value = default_codec().encode(TOPICS[logical].record, value.to_dict())
        if headers is None:
            headers = hdr.build(0, hdr.new_traceparent())
        producer.produce(topic_name(run, logical), value=value, key=key, headers=headers)
    if flush:
        producer.flush(30)


def read_all(bootstrap: str, run: str, logical: str, expect: int | None = None, timeout: float = 60.0,
             idle: float = 3.0) -> list[dict]:
    """Every committed record of a topic as dicts with key, headers, record (decoded typed) and raw value."""
    name = topic_name(run, logical)
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{time.time_ns()}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "auto.offset.reset": "earliest"})
    meta = consumer.list_topics(name, timeout=10)
    consumer.assign([TopicPartition(name, p, 0) for p in meta.topics[name].partitions])
    out: list[dict] = []
    deadline = time.monotonic() + timeout
    last_new = time.monotonic()
    try:
        while time.monotonic() < deadline:
            msgs = consumer.consume(500, 0.5)
            for m in msgs:
                if m.error():
                    continue
                _, value = default_codec().decode(m.value())
                out.append({"key": m.key(), "headers": hdr.as_dict(m.headers()), "partition": m.partition(),
                            "offset": m.offset(), "record": RECORD_TYPES[TOPICS[logical].record].from_dict(value),
                            "value": m.value()})
            if msgs:
                last_new = time.monotonic()
            if expect is not None and len(out) >= expect and time.monotonic() - last_new > 0.5:
                break
            if expect is None and time.monotonic() - last_new > idle:
                break
    finally:
        consumer.close()
    return out


def make_task(i: int, group_size: int = 2, answer: str = "cba", prompt: str = "abc>") -> Task:
    return Task(task_id=f"task-{i}", group_id=f"task-{i}", task_name="reverse", env_name="single",
                env_version="1", prompt=prompt, sampling=SamplingParams(), created_at=hdr.now_ms(),
                answer=answer, group_size=group_size)


def make_trajectory(i: int, response: str = "cba", n_tokens: int = 4, group: int | None = None,
                    version: int = 0) -> Trajectory:
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
    import random
    import socket
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
