"""A LoRA run's versions through Kafka alone (``--lora-rank`` with ``--weights-transport kafka``), against the real
broker: the base goes on the weights log once, each version's adapter whole; workers that share no path with the
trainer build their engine from the base rebuilt from the log (hash-checked) and apply each adapter to it; a
version whose adapter names another base is refused while the workers serve on the version they hold."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch

from rlstream.policy.deltas import folder_hash
from rlstream.policy.log_bases import BASE_MARK
from rlstream.policy.manifest import MANIFEST
from rlstream.policy.weight_log import parse_uri
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import PolicyVersion
from tests.helpers.kafka import produce, read_all, wait_for
from tests.helpers.policy import scored_group
from tests.helpers.weights import start_worker

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def engine_state(stage) -> dict[str, torch.Tensor]:
    with stage._engine_lock:  # no swap while we read
        return {n: t.clone() for n, t in stage.backend.model.state_dict().items()}


@pytest.mark.timeout(400)
def test_a_lora_run_travels_the_weights_log_its_base_once_and_each_adapter_whole(
        bootstrap, run_name, tmp_path, start_stage, caplog):
    caplog.set_level(logging.INFO, logger="rlstream")
    home = tmp_path / "trainer-host"
    trainer = start_stage("trainer", bootstrap, run_name, "--home", str(home), "--weights", str(home / "weights"),
                          "--weights-transport", "kafka", "--lora-rank", "4", "--lora-alpha", "8",
                          "--warmup-steps", "0", "--max-steps", "3", "--window-groups", "2", "--groups-per-step", "1",
                          "--group-size", "2", "--lr", "1e-2", "--eta", "8")
    a, runner_a, thread_a = start_worker(bootstrap, run_name, tmp_path / "host-a")
    workers = [(runner_a, thread_a)]
    try:
        for v in range(4):
            wait_for(lambda: a.version >= v, 120, f"worker A to load v{v}\n{trainer.log_tail(2000)}")
            if v < 3:
                produce(bootstrap, run_name, "rewards", scored_group(v + 1, v))
        assert trainer.wait(60) == 0, trainer.log_tail(3000)
        versions = [s.record for s in read_all(bootstrap, run_name, "policy-versions", expect=4)]
        assert [pv.version for pv in versions] == [0, 1, 2, 3]
        base_hash = versions[0].base_hash
        assert base_hash and all(pv.base_hash == base_hash for pv in versions)
        refs = [parse_uri(pv.weights_uri) for pv in versions]
        assert all(r.anchor == r.version and r.base == f"policy{BASE_MARK}{base_hash[:16]}" for r in refs), \
            "every LoRA version whole, naming its base on the log"
        assert len({r.base_offset for r in refs}) == 1, "one base for the trainer process"
        manifests = [c for c in (s.record for s in read_all(bootstrap, run_name, "weights")) if c.chunk == MANIFEST]
        assert [(c.policy, c.version, c.kind) for c in manifests] == \
            [(refs[0].base, 0, "anchor")] + [("policy", v, "anchor") for v in range(4)], "the base went once"
        assert manifests[0].content_hash == base_hash
        base_bytes = sum(len(c.payload) for c in (s.record for s in read_all(bootstrap, run_name, "weights"))
                         if c.policy == refs[0].base)
        adapter_bytes = sum(len(c.payload) for c in (s.record for s in read_all(bootstrap, run_name, "weights"))
                            if c.policy == "policy" and c.version == 3)
        assert adapter_bytes < base_bytes / 2, (adapter_bytes, base_bytes)
        # The trainer's adapters hash as announced; the worker's base, rebuilt from the log, is the trainer's.
        store = home / "weights" / "policy"
        assert folder_hash(store / "v3") == versions[3].content_hash
        rebuilt = [p.parent for p in (tmp_path / "host-a").rglob("rlstream_lora.json")]
        assert len(rebuilt) == 1 and folder_hash(rebuilt[0]) == base_hash, rebuilt
        assert "LoRA base policy@base-" in trainer.log_tail(20000)
        state_a = engine_state(a)

        # The trainer's host goes away: a new worker builds its engine from the base on the log, then v3 over it.
        shutil.move(home, tmp_path / "gone")
        b, runner_b, thread_b = start_worker(bootstrap, run_name, tmp_path / "host-b")
        workers.append((runner_b, thread_b))
        wait_for(lambda: b.version == 3, 120, "worker B to load v3")
        state_b = engine_state(b)
        assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[n], state_b[n]) for n in state_a), \
            "worker B's engine (base and v3's adapter from the log) is not worker A's"

        # A v4 whose adapter names another base: refused by both, which serve on with v3.
        forged = PolicyVersion("policy", 4, versions[3].weights_uri, created_at=hdr.now_ms(),
                               published_at=hdr.now_ms(), content_hash=versions[3].content_hash,
                               base_hash="f" * 64, base_uri=versions[3].base_uri)
        produce(bootstrap, run_name, "policy-versions", [(b"policy", forged, hdr.build(4, hdr.new_traceparent()))])
        for stage in (a, b):
            wait_for(lambda: stage.follower.failed[0] == 4, 60, "the v4 of another base to be refused")
            assert stage.version == 3
        assert "an adapter is applied only to its own base" in caplog.text
        assert all(torch.equal(state_a[n], t) for n, t in engine_state(a).items())
    finally:
        for runner, thread in workers:
            runner.request_stop()
            thread.join(60)


@pytest.mark.timeout(300)
def test_the_base_goes_on_the_log_again_once_the_adapters_since_add_up_to_its_size(bootstrap, run_name, tmp_path):
    """The writer's own bookkeeping against the broker: a second copy of the base once the adapter bytes since the
    first reach its size; the prefix delete then lets the first copy go, never the second, and a new worker
    rebuilds the base from the copy the newest version names."""
    from rlstream.config import KafkaSettings
    from rlstream.kafka.transactions import TransactionalProducer
    from rlstream.policy.weight_log import WeightLogWriter
    from rlstream.policy.weights import PolicyWeights, WeightStore
    from rlstream.trainer.lora import LoraTraining
    from rlstream.trainer.settings import TrainerSettings
    from tests.helpers.lora import tiny
    model, tok = tiny(False)
    lora = LoraTraining(TrainerSettings(lora_rank=4, lora_alpha=8.0))
    peft_model = lora.fresh(model, tok, WeightStore(str(tmp_path / "store")), "policy", lead=True)
    adapter_writer = lora.writer(peft_model, tok)
    kafka = KafkaSettings(bootstrap=bootstrap, run=run_name)
    txn = TransactionalProducer(kafka, f"{run_name}.lora-writer", who="test")
    txn.start()
    writer = WeightLogWriter(run_name, "policy")
    pvs, sizes = [], []
    for v in range(40):
        content, digest = adapter_writer.write(tmp_path / f"adapter-v{v}")
        uri = []
        assert txn.transact(lambda: uri.append(writer.produce(txn, content, digest, v)))
        writer.committed()
        sizes.append(writer.last_payload_bytes)
        pvs.append(PolicyVersion("policy", v, uri[0], created_at=0, published_at=0, content_hash=digest,
                                 **lora.fields()))
        if parse_uri(uri[0]).base_offset != parse_uri(pvs[0].weights_uri).base_offset:
            break
    refs = [parse_uri(pv.weights_uri) for pv in pvs]
    first, second = refs[0].base_offset, refs[-1].base_offset
    assert second != first, "the base never went again"
    base_bytes = sum(len(c.payload) for c in (s.record for s in read_all(bootstrap, run_name, "weights"))
                     if c.policy == refs[0].base and c.chunk != MANIFEST) // 2  # two copies on the log
    assert sum(sizes[1:-1]) >= base_bytes > sum(sizes[1:-2]), "a copy went before (or long after) it was due"
    # Versions up to the last one's predecessor name the first copy: it stays while they may be needed.
    assert writer.truncation_points(len(pvs) - 2)[0] <= first
    assert first < writer.truncation_points(len(pvs) - 1)[0] <= second
    weights = PolicyWeights(tmp_path / "worker", kafka.client_config(), run_name)
    assert folder_hash(weights.engine_folder(pvs[-1])) == pvs[-1].base_hash
