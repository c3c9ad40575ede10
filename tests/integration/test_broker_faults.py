"""Broker faults, on brokers of their own (the shared one at 9092 is left alone): a restart of the only broker
and the loss of one broker of three under a running stage, and a commit whose answer comes too late. Nothing is
lost or duplicated."""
from __future__ import annotations

import collections
import os
import signal
import threading
import time
import uuid

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource

from rlstream.config import KafkaSettings
from rlstream.infra import broker
from rlstream.kafka import transactions
from rlstream.kafka.tail import Seen
from rlstream.kafka.topics import TOPICS, create_topics, topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from tests.helpers.kafka import free_base_port, make_trajectory, produce, read_all, wait_consumed

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
GROUPS = 40


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A broker home of the test's own; JVMs starting on a busy two-core machine get more time than usual."""
    monkeypatch.setattr(broker, "START_TIMEOUT_S", 240.0)
    path = tmp_path / "home"
    yield path
    broker.down(path)


def _trajectories(start: int, n: int) -> list[tuple]:
    return [(f"g{i % GROUPS}".encode(), make_trajectory(i, group=i % GROUPS), None) for i in range(start, start + n)]


def _read(*args, **kw) -> list[Seen]:
    """read_all, again when a broker busy starting up does not answer its metadata request in time."""
    for attempt in range(10):
        try:
            return read_all(*args, **kw)
        except KafkaException:
            if attempt == 9:
                raise
            time.sleep(3)


def _wait_rewards(bootstrap: str, run: str, at_least: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(_read(bootstrap, run, "rewards", timeout=10)) < at_least:
        assert time.monotonic() < deadline, f"fewer than {at_least} rewards within {timeout}s"
        time.sleep(1)


def _exactly_once(bootstrap: str, run: str, n: int, log) -> None:
    """Every one of the n inputs has exactly one reward, and nothing went to dead-letters."""
    _read(bootstrap, run, "rewards", expect=n, timeout=400)
    # Past every input, the stage's outputs are all committed: a duplicate would be on the topic now.
    wait_consumed(bootstrap, f"{run}.reward", run, "trajectories", timeout=120)
    rewards = _read(bootstrap, run, "rewards", timeout=120)
    counts = collections.Counter(r.record.trajectory.trajectory_id for r in rewards)
    assert len(counts) == n, f"lost {n - len(counts)} records\n{log.read_text()[-3000:]}"
    assert max(counts.values()) == 1, f"duplicated: {[k for k, c in counts.items() if c > 1][:5]}"
    assert _read(bootstrap, run, "dead-letters") == []


@pytest.mark.timeout(1740)
def test_broker_restart_mid_run_loses_nothing_and_the_stage_resumes(home, tmp_path, start_stage):
    """Stop the only broker while a stage is mid-run and start it again with its data: the same stage
    process carries on by itself, and every input reaches the output exactly once."""
    port = free_base_port(2)
    bootstrap = broker.up(home, port=port)
    run = "bf" + uuid.uuid4().hex[:8]
    create_topics({"bootstrap.servers": bootstrap}, run, partitions=2)
    first, second = 300, 100
    produce(bootstrap, run, "trajectories", _trajectories(0, first))
    log = tmp_path / "reward.log"
    # One record at a time, 50 ms each: the broker goes away in the middle of the work.
    proc = start_stage("reward", bootstrap, run, "--reward", "tests.reward_fns:slow", "--batch-size", "20",
                       "--concurrency", "1", "--instance", "w0", log_path=log)
    try:
        _wait_rewards(bootstrap, run, 40)
        broker.down(home)
        assert broker.status(home) == {}
        # Longer than transaction.timeout.ms (30 s): the open transaction expires while the broker is away.
        time.sleep(35)
        assert proc.alive(), proc.log_tail()
        assert broker.up(home, port=port) == bootstrap
        produce(bootstrap, run, "trajectories", _trajectories(first, second))
        _exactly_once(bootstrap, run, first + second, log)
        assert proc.alive(), "the stage did not survive the broker restart:\n" + log.read_text()[-3000:]
    finally:
        code = proc.stop(timeout=60)
    assert code == 0, log.read_text()[-3000:]


@pytest.mark.timeout(2040)
def test_three_brokers_replication_three_survive_losing_one(home, tmp_path, start_stage):
    """On `rlstream up --brokers 3` with replication 3 and min.insync.replicas 2, SIGKILL the broker that
    coordinates the stage's consumer group mid-run: the stage carries on without loss or duplicates."""
    port = free_base_port(6)
    bootstrap = broker.up(home, brokers=3, port=port)
    assert len(broker.status(home)) == 3 and broker.stopped(home) is None
    run = "bf3" + uuid.uuid4().hex[:8]
    create_topics({"bootstrap.servers": bootstrap}, run, replication=3, partitions=2)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    name = topic_name(run, "trajectories")
    meta = admin.list_topics(name, timeout=30).topics[name]
    assert all(len(p.replicas) == 3 for p in meta.partitions.values())
    config = admin.describe_configs([ConfigResource("topic", name)])[ConfigResource("topic", name)].result(30)
    assert config["min.insync.replicas"].value == "2"

    first, second = 300, 100
    produce(bootstrap, run, "trajectories", _trajectories(0, first))
    log = tmp_path / "reward.log"
    proc = start_stage("reward", bootstrap, run, "--reward", "tests.reward_fns:slow", "--batch-size", "20",
                       "--concurrency", "1", "--instance", "w0", log_path=log)
    try:
        _wait_rewards(bootstrap, run, 40)
        group = admin.describe_consumer_groups([f"{run}.reward"])[f"{run}.reward"].result(30)
        victim = group.coordinator.id  # the hardest one to lose: offsets and membership move elsewhere
        broker.kill_node(home, victim)
        assert victim not in broker.status(home) and len(broker.status(home)) == 2
        why = broker.stopped(home)  # what the suite's guard (tests/conftest.py) reports of a broker that stopped
        assert why and why.startswith(f"Kafka node(s) {victim} under ") and "GB of disk free" in why, why
        produce(bootstrap, run, "trajectories", _trajectories(first, second))
        _exactly_once(bootstrap, run, first + second, log)
        assert proc.alive(), "the stage did not survive losing a broker:\n" + log.read_text()[-3000:]
        # The group's committed offsets cover every input, on the two brokers left.
        offsets = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(f"{run}.reward")])
        committed = offsets[f"{run}.reward"].result(30).topic_partitions
        assert sum(tp.offset for tp in committed if tp.topic == name) == first + second
    finally:
        code = proc.stop(timeout=60)
    assert code == 0, log.read_text()[-3000:]


@pytest.mark.timeout(600)
def test_a_commit_answered_late_is_resumed_and_one_never_answered_is_settled_from_the_log(home, monkeypatch, caplog):
    """The broker is stopped (SIGSTOP) once a transaction's record is delivered, so the commit's request waits in
    its socket past the call's timeout (2 s here), and let go later; the broker then commits it.

    Let go within the transaction timeout, the commit call is made again and finishes it (librdkafka resumes a
    timed-out commit; an abort would be refused as a conflicting call). Let go after it, the producer is replaced
    and the transaction's first record says that it committed. Either way ``transact`` reports it committed (its
    caller does not redo it), each record is there once, and the next transaction goes through."""
    port = free_base_port(2)
    bootstrap = broker.up(home, port=port)
    run = "co" + uuid.uuid4().hex[:8]
    create_topics({"bootstrap.servers": bootstrap}, run, partitions=1)
    pid = broker.status(home)[1]["pid"]
    monkeypatch.setattr(transactions, "COMMIT_TIMEOUT_S", 2.0)
    topic = topic_name(run, "trajectories")
    (key, traj, _), = _trajectories(0, 1)
    value = default_codec().encode(TOPICS["trajectories"].record, traj.to_dict())

    def commit_answered_after(txn: transactions.TransactionalProducer, seconds: float) -> bool:
        cont = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
        register = txn.start

        def register_once_resumed(*args, **kw):
            # A successor's registration and the stalled commit request would race on the resumed broker (either may
            # be served first); an answer lost means the broker took the commit first, so the successor registers
            # once the broker is back and has served what waited in its sockets.
            cont.join(30)
            time.sleep(2)
            return register(*args, **kw)
        txn.start = register_once_resumed

        def body() -> list:
            txn.produce(topic, value, key, hdr.build(0, hdr.new_traceparent()))
            assert txn.flush(30) == 0  # delivered: only the commit's own request is left
            os.kill(pid, signal.SIGSTOP)
            cont.start()
            return []
        try:
            return txn.transact(body)
        finally:
            if cont.ident is not None:  # started: the broker was stopped
                cont.join(30)
            os.kill(pid, signal.SIGCONT)

    kafka = KafkaSettings(bootstrap=bootstrap, run=run)
    for n, (give_up_s, late_s, sign) in enumerate([(30.0, 3.0, "commit not done yet"),
                                                   (3.0, 5.0, "had gone through; not redoing it")], start=1):
        caplog.clear()
        txn = transactions.TransactionalProducer(kafka, f"{run}.co{n}", who=f"co{n}")
        txn.start()
        # How long the commit is called again: the transaction timeout's, shortened on the client alone (a broker
        # with a short one would abort the transaction itself on resuming).
        monkeypatch.setattr(txn, "_transaction_timeout_s", give_up_s)
        assert commit_answered_after(txn, late_s) is True
        assert sign in caplog.text, caplog.text[-3000:]
        assert ("replacing the producer" in caplog.text) == (n == 2), caplog.text[-3000:]
        assert len(_read(bootstrap, run, "trajectories", expect=2 * n - 1, timeout=60)) == 2 * n - 1
        assert txn.transact(lambda: txn.produce(topic, value, key, hdr.build(0, hdr.new_traceparent()))) is True
        assert len(_read(bootstrap, run, "trajectories", expect=2 * n, timeout=60)) == 2 * n
