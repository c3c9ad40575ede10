"""The tail reader against the real broker: committed records only, the end of each partition, following."""
from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Producer

from rlstream.kafka.tail import TopicTail, read_to_end
from rlstream.kafka.topics import topic_name
from rlstream.policy.watcher import PolicyWatcher, last_policy_version
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from rlstream.schemas.records import PolicyVersion
from tests.helpers.kafka import make_task, make_trajectory, produce

pytestmark = [pytest.mark.kafka]


def _transactional(bootstrap: str, run: str, name: str) -> Producer:
    """A transactional producer, ready for its first transaction."""
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"{run}.{name}"})
    producer.init_transactions(30)
    return producer


def _send(producer: Producer, run: str, i: int, partition: int = 0) -> None:
    """Task ``i`` to one partition of the run's prompts (inside the producer's open transaction)."""
    value = default_codec().encode("Task", make_task(i).to_dict())
    producer.produce(topic_name(run, "prompts"), value=value, key=f"k{i}", partition=partition,
                     headers=hdr.build(0, hdr.new_traceparent()))


def test_read_to_end_returns_committed_records_beside_an_open_transaction(bootstrap, run_name):
    """Aborted records are never read, and a transaction left open (a killed stage's) does not hold the read."""
    client = {"bootstrap.servers": bootstrap}
    producer = _transactional(bootstrap, run_name, "writer")
    for i, commit in ((0, True), (1, False), (2, True)):
        producer.begin_transaction()
        _send(producer, run_name, i)
        producer.commit_transaction(30) if commit else producer.abort_transaction(30)
    producer.begin_transaction()
    _send(producer, run_name, 3)
    producer.flush(30)
    committed = False
    try:
        # Held by the open transaction, the read would raise TimeoutError: it is not at the end.
        seen = read_to_end(client, run_name, "prompts", timeout=15)
        assert [s.record.task_id for s in seen] == ["task-0", "task-2"]
        with pytest.raises(TimeoutError, match="2 records read in 3s, 3 expected"):
            read_to_end(client, run_name, "prompts", expect=3, timeout=3)
        producer.commit_transaction(30)
        committed = True
        assert [s.record.task_id for s in read_to_end(client, run_name, "prompts", expect=3)] == [
            "task-0", "task-2", "task-3"]
    finally:
        if not committed:
            producer.abort_transaction(30)


def test_read_to_end_ends_while_a_stage_keeps_writing(bootstrap, run_name):
    """A partition written without pause never shows its end: the read stops past where it ended at the call."""
    producer = _transactional(bootstrap, run_name, "busy")
    stop = threading.Event()
    written = []

    def write() -> None:
        """One record per transaction, as fast as they commit, until stopped."""
        i = 0
        while not stop.is_set():
            producer.begin_transaction()
            _send(producer, run_name, i)
            producer.commit_transaction(30)
            written.append(i)
            i += 1
            time.sleep(0.01)
    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    try:
        while len(written) < 50:
            time.sleep(0.05)
        before = len(written)
        seen = read_to_end({"bootstrap.servers": bootstrap}, run_name, "prompts", timeout=30)
        assert len(seen) >= before and thread.is_alive()
        assert [s.record.task_id for s in seen] == [f"task-{i}" for i in range(len(seen))]
    finally:
        stop.set()
        thread.join(30)


def test_topic_tail_follows_keeps_hands_over_and_knows_it_is_caught_up(bootstrap, run_name):
    handed = []
    tail = TopicTail({"bootstrap.servers": bootstrap}, run_name, ["prompts", "trajectories"], on_record=handed.append)
    try:
        tail.settle(quiet_s=0.2, timeout=30)
        assert tail.count("prompts") == tail.count("trajectories") == 0
        produce(bootstrap, run_name, "prompts", [(f"k{i}".encode(), make_task(i), None) for i in range(5)])
        produce(bootstrap, run_name, "trajectories", [(b"t", make_trajectory(7), None), (b"bad", b"\x00junk", None)])
        deadline = time.monotonic() + 30
        while tail.count("prompts") + tail.count("trajectories") < 7:
            assert time.monotonic() < deadline, "the tail did not follow the new records"
            time.sleep(0.05)
        tail.settle(quiet_s=0.2, timeout=30)
        assert tail.caught_up()
        assert sorted(s.record.task_id for s in tail.snapshot("prompts")) == [f"task-{i}" for i in range(5)]
        by_key = {s.key: s for s in tail.snapshot("trajectories")}
        assert by_key[b"t"].record.trajectory_id == "traj-7" and by_key[b"t"].headers["policy_version"] == b"0"
        assert by_key[b"bad"].record is None, "an undecodable value is kept, without a record"
        assert sorted((s.topic, s.offset, s.partition) for s in handed) == sorted(
            (s.topic, s.offset, s.partition) for t in ("prompts", "trajectories") for s in tail.snapshot(t))
    finally:
        tail.close()


def _announce(bootstrap: str, run: str, policy: str, versions: range) -> None:
    """PolicyVersion records of ``policy``, as a trainer announces them."""
    now = hdr.now_ms()
    produce(bootstrap, run, "policy-versions", [
        (policy.encode(), PolicyVersion(policy, v, f"file:///w/{v}", now, now), hdr.build(v, hdr.new_traceparent()))
        for v in versions])


def test_the_policy_watcher_and_the_last_announced_version(bootstrap, run_name):
    client = {"bootstrap.servers": bootstrap}
    assert last_policy_version(client, run_name, "policy") is None
    new = []
    watcher = PolicyWatcher(client, run_name, "policy", on_new=lambda pv: new.append(pv.version))
    try:
        assert not watcher.wait_for(0, 1.0) and watcher.version == -1 and watcher.latest is None
        _announce(bootstrap, run_name, "policy", range(3))
        _announce(bootstrap, run_name, "other", range(5, 6))
        assert watcher.wait_for(2, 30)
        assert watcher.latest.version == 2 and sorted(watcher.seen_at) == [0, 1, 2] and new == [0, 1, 2]
    finally:
        watcher.close()
    assert last_policy_version(client, run_name, "policy").version == 2
    assert last_policy_version(client, run_name, "other").version == 5


@pytest.mark.parametrize("read", ["read_to_end", "tail"])
def test_a_topic_that_does_not_exist_is_an_error_that_says_what_to_do(bootstrap, monkeypatch, read):
    """A misspelt run is neither an empty read nor a follower that waits for ever: the reader names the topic and the
    command that makes a run's topics."""
    from rlstream.kafka import tail
    monkeypatch.setattr(tail, "UNKNOWN_TOPIC_WAIT_S", 1.0)
    client = {"bootstrap.servers": bootstrap}
    with pytest.raises(tail.UnknownTopic, match=r"topic nosuchrun\.prompts \(of run 'nosuchrun'\) does not exist.*"
                                               r"rlstream topics --run nosuchrun"):
        if read == "read_to_end":
            read_to_end(client, "nosuchrun", "prompts", timeout=15)
        else:
            TopicTail(client, "nosuchrun", ["prompts"]).close()
