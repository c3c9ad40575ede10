"""Weights through Kafka alone: a trainer process (``--weights-transport kafka``) and rollout workers with their own
homes, which share no path with it, against the real broker. Versions load from the weights topic, bit-equal to
what the trainer wrote; a delta whose base a worker lacks is rebuilt from its anchor; a version whose weights do
not match its hash is refused while the worker generates on with (and stamps) the version it holds."""
from __future__ import annotations

import logging
import shutil
import threading

import pytest

from rlstream.config import KafkaSettings, LoopSettings
from rlstream.kafka import records
from rlstream.kafka.transactions import TransactionalProducer
from rlstream.policy.deltas import Content, content_hash, read_folder
from rlstream.policy.weight_log import WeightLogWriter, parse_uri
from rlstream.runtime.settings import RuntimeSettings
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import PolicyVersion
from rlstream.stages.rollout import RolloutStage
from tests.helpers.kafka import make_task, produce, read_all, wait_for
from tests.helpers.policy import scored_group, start_log_trainer
from tests.helpers.weights import start_worker

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def held_hash(stage: RolloutStage, like: Content) -> str:
    """The content hash of the weights the worker's engine holds now (the tensors a folder like ``like`` has)."""
    with stage._engine_lock:  # no swap while we read
        state = stage.backend.model.state_dict()
        return content_hash(Content({n: state[n].clone() for n in like.tensors}, {}, like.files))


@pytest.mark.timeout(300)
def test_workers_without_a_shared_path_load_versions_from_the_log_and_refuse_a_bad_hash(
        bootstrap, run_name, tmp_path, start_stage, caplog):
    caplog.set_level(logging.INFO, logger="rlstream.policy.weight_log")
    trainer_home = tmp_path / "trainer-host"
    trainer = start_log_trainer(start_stage, bootstrap, run_name, trainer_home)
    a, runner_a, thread_a = start_worker(bootstrap, run_name, tmp_path / "host-a")
    workers = [(runner_a, thread_a)]
    try:
        truth: dict[int, Content] = {}
        for v in range(4):
            wait_for(lambda: a.version >= v, 120, f"worker A to load v{v}\n{trainer.log_tail(2000)}")
            # The trainer host's own checkpoint is the ground truth (the test reads it; the worker cannot).
            truth[v] = read_folder(trainer_home / "weights" / "policy" / f"v{v}")
            assert held_hash(a, truth[v]) == content_hash(truth[v]), f"worker A's v{v} is not what was trained"
            if v < 3:
                produce(bootstrap, run_name, "rewards", scored_group(v + 1, v))
        assert trainer.wait(60) == 0, trainer.log_tail(3000)
        versions = [s.record for s in read_all(bootstrap, run_name, "policy-versions", expect=4)]
        assert [pv.version for pv in versions] == [0, 1, 2, 3]
        for pv in versions:
            ref = parse_uri(pv.weights_uri)  # every version was announced on the log, with its hash
            assert ref.version == pv.version and ref.anchor == pv.version - pv.version % 2
            assert pv.content_hash == content_hash(truth[pv.version])
            assert len(pv.probe_logprobs) == len(pv.probe_token_ids) - 1 > 0, "every version carries its load probe"
        assert len({pv.content_hash for pv in versions}) == 4, "a step did not change the weights"
        chunks = [s.record for s in read_all(bootstrap, run_name, "weights")]
        assert [(c.version, c.kind) for c in chunks if c.chunk == 0] == [(0, "anchor"), (1, "delta"), (2, "anchor"),
                                                                         (3, "delta")]
        sizes = {c.version: sum(len(x.payload) for x in chunks if x.version == c.version) for c in chunks}
        assert sizes[1] < sizes[0] and sizes[3] < sizes[2]
        assert "rebuilding from anchor" not in caplog.text, "A followed every delta from the version it held"
        # A's engine took v1..v3 from memory: no folder written for them, and v0's (its start) gone since v2.
        assert not list((tmp_path / "host-a").rglob("v[0-9]*")), list((tmp_path / "host-a").rglob("v[0-9]*"))

        # The trainer's host goes away: nothing of it can be read any more, only the broker remains.
        shutil.move(trainer_home, tmp_path / "gone")
        b, runner_b, thread_b = start_worker(bootstrap, run_name, tmp_path / "host-b")
        workers.append((runner_b, thread_b))
        wait_for(lambda: b.version == 3, 120, "worker B to load v3")
        assert held_hash(b, truth[3]) == content_hash(truth[3])
        assert "v3 is a delta whose base v2 is not held here (nothing held yet): rebuilding from anchor v2" \
            in caplog.text
        assert all(str(tmp_path / "host-b") in str(p) for p in (tmp_path / "host-b").rglob("*.safetensors"))

        # A v4 whose weights do not match the hash its PolicyVersion carries: both workers refuse it.
        forged = Content(dict(truth[3].tensors), dict(truth[3].shards), dict(truth[3].files))
        name = sorted(forged.tensors)[0]
        forged.tensors[name] = forged.tensors[name].clone()
        forged.tensors[name].view(-1)[0] += 1
        kafka = KafkaSettings(bootstrap=bootstrap, run=run_name)
        txn = TransactionalProducer(kafka, f"{run_name}.forger", who="test")
        txn.start()
        writer = WeightLogWriter(run_name, "policy")

        def body():
            uri = writer.produce(txn, forged, content_hash(forged), 4)
            pv = PolicyVersion("policy", 4, uri, created_at=hdr.now_ms(), published_at=hdr.now_ms(),
                               content_hash=content_hash(truth[3]))
            records.produce(txn, run_name, "policy-versions", b"policy", pv, 4)
        assert txn.transact(body)
        for stage in (a, b):
            wait_for(lambda: stage.follower.failed[0] == 4, 60, "the forged v4 to be refused")
            assert stage.version == 3 and held_hash(stage, truth[3]) == content_hash(truth[3])
        assert "refusing policy v4" in caplog.text
        # And generation goes on, stamped with the version the engines hold.
        produce(bootstrap, run_name, "prompts", [(b"task-9", make_task(9), None)])
        actions = read_all(bootstrap, run_name, "actions", expect=2, timeout=60)
        assert [hdr.policy_version(s.headers) for s in actions] == [3, 3]
        assert {t.policy_version for s in actions for t in s.record.turns} == {3}
        assert a.version == b.version == 3
    finally:
        for runner, thread in workers:
            runner.request_stop()
            thread.join(60)


@pytest.mark.timeout(600)
def test_a_trainer_on_a_new_host_resumes_from_the_weights_log_and_trains_no_sample_twice(bootstrap, run_name,
                                                                                        tmp_path, caplog):
    """Trainer A trains v1..v3 (v2 an anchor, v3 a delta) past a held head group, then its host goes away. Trainer
    B, with an empty store, resumes at v3 rebuilt from the log, skips the samples A trained past the head (the
    committed offsets' metadata says which), and trains on from v3."""
    from rlstream.trainer.service import TrainerSettings
    from tests.helpers.trainer import G, SpyTrainer, produce_groups, scored_group, wait_version
    caplog.set_level(logging.INFO)
    kafka = KafkaSettings(bootstrap=bootstrap, run=run_name)

    def start(host):
        settings = TrainerSettings(weights=str(host / "weights"), weights_transport="kafka", weights_anchor_every=2,
                                   warmup_steps=0, window_groups=4, lr=1e-2)
        trainer = SpyTrainer(settings, LoopSettings(run=run_name, home=str(host), groups_per_step=2, eta=8))
        thread = threading.Thread(target=trainer.serve, args=(kafka, RuntimeSettings(poll_timeout_s=0.1)),
                                  daemon=True)
        thread.start()
        return trainer, thread

    head = scored_group(0)
    produce(bootstrap, run_name, "rewards", [(b"task-0", s, hdr.build(0, hdr.new_traceparent(), "v1"))
                                             for s in head[:G - 1]])
    a, thread_a = start(tmp_path / "host-a")
    try:
        for v, gids in ((1, [1, 2]), (2, [3, 4]), (3, [5, 6])):
            produce_groups(bootstrap, run_name, gids, version=v - 1)
            wait_version(a, v)
    finally:
        a.stop()
        thread_a.join(60)
    assert [sorted(groups) for _, groups in a.trained] == [[f"task-{g}", f"task-{g + 1}"] for g in (1, 3, 5)]
    v3 = [s.record for s in read_all(bootstrap, run_name, "policy-versions", expect=4)][-1]
    assert v3.version == 3 and parse_uri(v3.weights_uri).anchor == 2
    truth = read_folder(tmp_path / "host-a" / "weights" / "policy" / "v3")
    shutil.move(tmp_path / "host-a", tmp_path / "gone")  # nothing of host A is left to read

    caplog.clear()
    b, thread_b = start(tmp_path / "host-b")
    try:
        wait_for(lambda: b.version == 3, 120, "trainer B to resume at v3")
        assert "resuming policy at v3 from kafka:weights?" in caplog.text
        assert "v3 is a delta whose base v2 is not held here (nothing held yet): rebuilding from anchor v2" \
            in caplog.text
        state = b.model.state_dict()
        assert content_hash(Content({n: state[n] for n in truth.tensors}, {}, truth.files)) == v3.content_hash, \
            f"B does not hold v3 (trained since on: {b.trained})"
        # Groups 1-6 lie past the held head group 0 in the log; B reads from the head again and must skip them.
        produce_groups(bootstrap, run_name, [7], version=3)  # one complete group: not a step of two yet
        wait_for(lambda: b.window.pending_samples >= 2 * G - 1, 60, "trainer B to read groups 0 and 7")
        b.settled()  # what B took for new it would have trained by now
        assert b.trained == [], "trainer B trained again what trainer A had trained"
        produce(bootstrap, run_name, "rewards", [(b"task-0", head[G - 1], hdr.build(3, hdr.new_traceparent(), "v1"))])
        wait_version(b, 4)
    finally:
        b.stop()
        thread_b.join(60)
    assert [(v, sorted(groups)) for v, groups in b.trained] == [(3, ["task-0", "task-7"])]
    versions = [s.record for s in read_all(bootstrap, run_name, "policy-versions", expect=5)]
    assert [(pv.version, pv.parent_version) for pv in versions][-2:] == [(3, 2), (4, 3)]
    chunks = [s.record for s in read_all(bootstrap, run_name, "weights")]
    # B's first version is an anchor: B holds no base that the log's readers hold.
    assert [(c.version, c.kind) for c in chunks if c.chunk == 0][-2:] == [(3, "delta"), (4, "anchor")]
    assert sum(pv.samples_trained for pv in versions) == 8 * G  # groups 0-7, every sample once
