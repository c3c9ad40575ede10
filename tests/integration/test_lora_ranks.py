"""LoRA under DDP on 2 CPU ranks (gloo): the same losses as 1 rank on the same batches, micro-batched and with
gradient checkpointing, the KL reference the base with the adapter off; the base stays the same on every rank."""
from __future__ import annotations

import json

import pytest
import torch

from rlstream.trainer.distributed import Ranks, launch
from rlstream.trainer.lora import BaseReference, wrap
from rlstream.trainer.microbatch import train_step
from rlstream.trainer.sharding import make_engine
from rlstream.trainer.update import UpdateConfig
from tests.helpers.batches import STEPS, TOLERANCE, fixed_batches
from tests.helpers.cores import require_cores


def train_lora(ranks, out: str, budget: int) -> None:
    torch.set_num_threads(1)
    from rlstream.models.devices import enable_gradient_checkpointing
    from rlstream.models.tiny import build_model, build_tokenizer
    model = build_model(build_tokenizer(), seed=0)
    torch.manual_seed(1)  # the adapter's A: DDP starts every rank from rank 0's anyway
    model = wrap(model, 4, 8.0, 0.0, ("all-linear",))
    enable_gradient_checkpointing(model)
    engine = make_engine(model, lr=1e-2, world_size=ranks.world)
    ref = BaseReference(engine)
    cfg = UpdateConfig(kl_coef=0.1)
    stats = [train_step(engine, b, cfg, ref, max_tokens=budget, rank=ranks.rank, world=ranks.world)
             for b in fixed_batches()]
    base = {n: p for n, p in engine.model.named_parameters() if not p.requires_grad}
    digest = float(sum(p.double().sum() for p in base.values()))
    if ranks.lead:
        with open(out, "w") as f:
            json.dump({"stats": [(s["loss"], s["grad_norm"], s["kl_ref"]) for s in stats], "base": digest}, f)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lora_on_two_ddp_ranks_matches_one_rank(tmp_path):
    require_cores(2)
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    train_lora(Ranks(), str(one), 0)
    launch(2, train_lora, (str(two), 24), "cpu")
    ref, got = json.loads(one.read_text()), json.loads(two.read_text())
    assert got["base"] == ref["base"], "the frozen base moved"
    assert len(got["stats"]) == STEPS
    for step, (a, b) in enumerate(zip(ref["stats"], got["stats"])):
        assert b == pytest.approx(a, rel=TOLERANCE, abs=1e-7), f"step {step}"
    assert ref["stats"][-1][2] > 0, "the adapter never left the base (no KL to it)"
