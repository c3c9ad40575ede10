"""The dataset source on the real broker: SIGKILLed mid-batch and restarted, it writes every row of every epoch
exactly once (bad rows as dead letters with their index), and a second dataset in the same run starts from its own
beginning, not from the first one's position."""
from __future__ import annotations

import json
import time
from pathlib import Path

import datasets
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from rlstream.infra.supervisor import StageProc, stage_env
from rlstream.kafka.topics import topic_name
from rlstream.schemas.records import PolicyVersion
from rlstream.sources.exactly_once import SOURCE_ID, SOURCE_SEQ
from tests.helpers import ROOT
from tests.helpers.kafka import produce, read_all, wait_for

pytestmark = pytest.mark.kafka

ROWS, EPOCHS, BAD = 60, 2, {7, 23, 41}


@pytest.fixture
def prompts_proc(tmp_path, bootstrap, run_name):
    """Starts ``rlstream prompts ARGS`` processes in the test's run (home under tmp_path); SIGKILLs what is left."""
    started: list[StageProc] = []

    def start(*args: str) -> StageProc:
        env = stage_env(bootstrap, run_name, RLSTREAM_HOME=str(tmp_path / "home"))
        proc = StageProc("prompts", ["prompts", *args], env, tmp_path / f"prompts-{len(started)}.log", cwd=ROOT)
        started.append(proc.start())
        return proc

    yield start
    for proc in started:
        proc.kill()


def uncommitted_keys(bootstrap: str, run: str) -> set[str]:
    """The keys of every record on the prompts topic, those of open and aborted transactions included."""
    topic = topic_name(run, "prompts")
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{run}.uncommitted", "enable.auto.commit": False,
                         "isolation.level": "read_uncommitted", "enable.partition.eof": True})
    try:
        parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        keys, at_end = set(), set()
        for _ in range(600):  # 0.1 s polls: a minute at most
            if len(at_end) == len(parts):
                return keys
            m = consumer.poll(0.1)
            if m is None:
                continue
            if m.error():
                assert m.error().code() == KafkaError._PARTITION_EOF, m.error()
                at_end.add(m.partition())
                continue
            at_end.discard(m.partition())
            keys.add(m.key().decode())
        raise AssertionError(f"{topic}: not at the end of every partition within a minute")
    finally:
        consumer.close()


def ours(seen, source: str) -> list:
    """The records of ``seen`` that source ``source`` wrote."""
    return [s for s in seen if s.headers.get(SOURCE_ID) == source.encode()]


@pytest.mark.timeout(1320)
def test_a_killed_dataset_source_resumes_exactly_once(tmp_path, bootstrap, run_name, prompts_proc):
    rows = [{"prompt": None if i in BAD else f"prompt {i}", "answer": str(i), "uid": f"q{i}"} for i in range(ROWS)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Four rows a transaction held open for a second: a kill almost always lands inside one.
    args = ("--dataset", str(data), "--epochs", str(EPOCHS), "--shuffle-seed", "3", "--id-column", "uid",
            "--metadata-columns", "answer", "--source-id", "train", "--batch-rows", "4", "--batch-pause", "1.0")
    total = ROWS * EPOCHS
    in_flight: set[str] = set()
    committed_at_kill = 0
    for attempt in range(3):  # until one kill caught a transaction open (in_flight), 3 tries at most
        proc = prompts_proc(*args)
        committed_at_kill = len(read_all(bootstrap, run_name, "prompts", expect=committed_at_kill + 8, timeout=120))
        # That read returned just after a commit: half a second on, the next transaction has produced and waits.
        time.sleep(0.5)
        proc.kill()
        assert proc.returncode == -9
        committed = {s.key.decode() for s in read_all(bootstrap, run_name, "prompts")}
        assert len(committed) < total - 2 * len(BAD), "the source finished before it was killed"
        # The killed instance's open transaction: on the log, not committed.
        in_flight = uncommitted_keys(bootstrap, run_name) - committed
        if in_flight:
            break
    assert in_flight, "three kills all landed between transactions"
    assert len(in_flight) <= 4

    last = prompts_proc(*args)
    assert last.wait(240) == 0, last.log_tail()

    tasks = ours(read_all(bootstrap, run_name, "prompts"), "train")
    letters = ours(read_all(bootstrap, run_name, "dead-letters"), "train")
    ids = [s.record.task_id for s in tasks]
    assert len(ids) == len(set(ids)) == total - EPOCHS * len(BAD)
    assert in_flight <= set(ids)  # the batch the kill cut short was written again, once
    # Every position once, over both topics, and each row of each epoch once.
    seqs = sorted(int(s.headers[SOURCE_SEQ]) for s in tasks + letters)
    assert seqs == list(range(total))
    placed = [(int(s.record.metadata["epoch"]), int(s.record.metadata["row"])) for s in tasks]
    placed += [(s.record.partition, s.record.offset) for s in letters]
    assert sorted(placed) == [(e, r) for e in range(EPOCHS) for r in range(ROWS)]
    assert all(s.record.task_id == f"q{s.record.metadata['row']}-e{s.record.metadata['epoch']}"
               and s.record.answer == s.record.metadata["answer"] == s.record.metadata["row"] for s in tasks)
    # Within each partition the source's order holds: what one producer commits in order is read in order.
    for p in {s.partition for s in tasks}:
        in_partition = [int(s.headers[SOURCE_SEQ]) for s in sorted(tasks, key=lambda s: s.offset) if s.partition == p]
        assert in_partition == sorted(in_partition)
    # Bad rows: one dead letter per epoch, reason invalid, the error naming the row, the row kept.
    assert sorted((s.record.partition, s.record.offset) for s in letters) == sorted(
        (e, r) for e in range(EPOCHS) for r in BAD)
    for s in letters:
        row = s.record.offset
        assert (s.record.stage, s.record.reason) == ("prompts", "invalid")
        assert f"row {row}: no prompt" in s.record.error
        assert json.loads(s.record.value) == rows[row]
    assert "source train resumes after position" in last.log_tail()

    # A second dataset in the same run is a source of its own: it starts at its first row.
    other = tmp_path / "other.csv"
    other.write_text("question,solution\n" + "".join(f"q{i},{i}\n" for i in range(5)))
    second = prompts_proc("--dataset", str(other), "--prompt-column", "question", "--answer-column", "solution")
    assert second.wait(120) == 0, second.log_tail()
    seen = read_all(bootstrap, run_name, "prompts")
    assert len(ours(seen, "train")) == len(tasks)
    new = [s for s in seen if s.headers.get(SOURCE_ID, b"").startswith(b"other-")]
    assert sorted(s.record.prompt for s in new) == [f"q{i}" for i in range(5)]
    assert sorted(s.record.answer for s in new) == [str(i) for i in range(5)]
    assert Path(tmp_path / "home" / "datasets").is_dir()  # the datasets cache stays in the loop's home


def announce(bootstrap: str, run: str, version: int) -> None:
    """Policy ``p`` at ``version`` on the run's policy-versions topic, as the trainer announces it."""
    produce(bootstrap, run, "policy-versions",
            [(b"p", PolicyVersion(policy="p", version=version, weights_uri="", created_at=0, published_at=0), None)])


def split_ids(bootstrap: str, run: str, proc: StageProc, version: int) -> tuple[list[str], list[str]]:
    """(training task ids, held-out task ids) once the paced source ``proc`` says it is at its allowance for policy
    ``version`` (-1: none yet): what it wrote for it is committed, and it writes nothing more until the next version.
    Held-out tasks travel in the eval lane."""
    line = f"paced source at its allowance for policy version {version}:"
    wait_for(lambda: line in proc.log_tail(), 120, f"the source to reach its allowance for version {version}")
    train, held = read_all(bootstrap, run, "prompts"), read_all(bootstrap, run, "eval-prompts")
    assert {s.record.split for s in train} <= {"train"} and {s.record.split for s in held} <= {"heldout"}
    return [s.record.task_id for s in train], [s.record.task_id for s in held]


@pytest.mark.timeout(810)
def test_a_paced_dataset_source_follows_the_trainer_and_resumes_its_rounds(tmp_path, bootstrap, run_name,
                                                                           prompts_proc):
    train, held = tmp_path / "train.jsonl", tmp_path / "held.parquet"
    train.write_text("".join(json.dumps({"prompt": f"t{i}", "answer": str(i)}) + "\n" for i in range(30)))
    datasets.Dataset.from_list([{"prompt": f"h{i}", "answer": str(i)} for i in range(3)]).to_parquet(str(held))
    args = ("--dataset", str(train), "--eval-dataset", str(held), "--paced", "--policy", "p", "--eta", "0",
            "--groups-per-step", "2", "--heldout-every", "2", "--batch-rows", "4")
    proc = prompts_proc(*args)
    # No policy yet: one step of groups, (version 0 + eta 0 + 1) * 2 tasks, and no evaluation round.
    train_ids, held_ids = split_ids(bootstrap, run_name, proc, -1)
    assert (len(train_ids), held_ids) == (2, [])
    announce(bootstrap, run_name, 0)  # round 0 is due at version 0
    train_ids, held_ids = split_ids(bootstrap, run_name, proc, 0)
    assert (len(train_ids), len(held_ids)) == (2, 3) and all(h.startswith("v0-r0-") for h in held_ids)
    announce(bootstrap, run_name, 2)  # two steps further, and round 1
    train_ids, held_ids = split_ids(bootstrap, run_name, proc, 2)
    assert (len(train_ids), len(held_ids)) == (6, 6)
    assert sum(h.startswith("v2-r1-") for h in held_ids) == 3
    proc.kill()

    again = prompts_proc(*args)
    announce(bootstrap, run_name, 3)
    train_ids, held_ids = split_ids(bootstrap, run_name, again, 3)
    # Resumed: two more training tasks, no evaluation round again, nothing twice.
    assert (len(train_ids), len(held_ids)) == (8, 6)
    assert len(set(train_ids)) == 8 and len(set(held_ids)) == 6
    assert sorted(int(t.rsplit("-r", 1)[1].removesuffix("-e0")) for t in train_ids) == list(range(8))
    assert again.alive(), again.log_tail()
