"""The LoRA trainer (--lora-rank) against the real broker: it publishes adapters naming their base, trains with the
base as its KL reference, and a killed trainer resumes its adapter and Adam's state bit for bit."""
from __future__ import annotations

import pytest
import torch

from rlstream.config import KafkaSettings
from rlstream.engine.local import TransformersBackend
from rlstream.policy.adapters import is_adapter
from rlstream.policy.deltas import folder_hash
from rlstream.policy.watcher import last_policy_version
from rlstream.policy.weights import PolicyWeights, local_path
from tests.helpers.trainer import produce_groups, start, wait_version

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
LORA = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules=("q_proj,v_proj", "down_proj"), kl_coef=0.1,
            checkpoint_every=1, lr=1e-2)


def _state(trainer):
    adapter = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    adam = trainer.engine.optimizer.state_dict()
    return adapter, adam


@pytest.mark.timeout(300)
def test_a_lora_trainer_publishes_adapters_and_resumes_them_and_adam_bit_for_bit(bootstrap, run_name, tmp_path):
    trainer, thread = start(bootstrap, run_name, tmp_path, **LORA)
    wait_version(trainer, 0)
    produce_groups(bootstrap, run_name, [1, 2], version=0)
    wait_version(trainer, 1)
    trainer.stop()
    thread.join(60)
    adapter, adam = _state(trainer)
    assert adapter and all("lora_" in n for n in adapter)
    assert {"q_proj", "v_proj", "down_proj"} == {n.split(".")[-4] for n in adapter}
    assert len(adam["state"]) == len(adapter), "Adam holds state for more than the adapter"

    pv = last_policy_version(KafkaSettings(bootstrap=bootstrap, run=run_name).client_config(), run_name, "policy")
    folder = local_path(pv.weights_uri)
    assert pv.version == 1 and is_adapter(folder) and not (folder / "model.safetensors").exists()
    assert folder_hash(folder) == pv.content_hash and pv.base_hash and "kl_ref" in pv.metrics
    assert folder_hash(local_path(pv.base_uri)) == pv.base_hash

    # What a rollout worker serves for v1 is the trainer's v1.
    weights = PolicyWeights(tmp_path / "cache")
    backend = TransformersBackend(weights.engine_folder(pv))
    weights.adopt(pv, backend)
    weights.verify_first(pv, backend)  # the version's load probe, computed by the trainer's PEFT model

    # Killed after v1 (its thread stopped, nothing more written): the restart holds the same adapter and Adam state.
    trainer2, thread2 = start(bootstrap, run_name, tmp_path, **LORA)
    wait_version(trainer2, 1)
    adapter2, adam2 = _state(trainer2)
    assert adapter.keys() == adapter2.keys() and all(torch.equal(adapter[k], adapter2[k]) for k in adapter)
    assert adam["state"].keys() == adam2["state"].keys()
    for i, st in adam["state"].items():
        assert all(torch.equal(st[k], adam2["state"][i][k]) for k in st), f"Adam state of parameter {i} differs"
    produce_groups(bootstrap, run_name, [3, 4], version=1)
    wait_version(trainer2, 2)
    trainer2.stop()
    thread2.join(60)
    pv2 = last_policy_version(KafkaSettings(bootstrap=bootstrap, run=run_name).client_config(), run_name, "policy")
    assert pv2.version == 2 and pv2.base_hash == pv.base_hash, "a resumed trainer named another base"
    weights.load(pv2, backend)
