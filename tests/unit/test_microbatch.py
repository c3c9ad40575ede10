"""Micro-batches under a token budget, and gradient accumulation that equals the whole batch's gradient."""
from __future__ import annotations

import pytest
import torch

from rlstream.models.devices import resolve_device
from rlstream.models.tiny import build_model, build_tokenizer
from rlstream.trainer.engine import TorchEngine
from rlstream.trainer.microbatch import accumulated_update, plan, rows_of
from rlstream.trainer.update import UpdateConfig, batch_loss
from tests.helpers.batches import mixed_batch


def test_plan_packs_sorted_rows_within_the_budget_and_keeps_every_row_once():
    batch = mixed_batch()
    lengths = batch.attention_mask.sum(-1).tolist()
    [micro] = plan(batch, max_tokens=24)
    assert sorted(r for m in micro for r in m) == list(range(8))
    for rows in micro:
        assert len(rows) * max(lengths[r] for r in rows) <= 24 or len(rows) == 1
    # Longest first: each micro-batch's rows are no longer than the previous one's.
    flat = [lengths[r] for m in micro for r in m]
    assert flat == sorted(flat, reverse=True)
    # A budget below the longest row still trains it, alone.
    assert plan(batch, max_tokens=1)[0] == [[r] for r in sorted(range(8), key=lambda r: (-lengths[r], r))]


def test_plan_spreads_micro_batches_over_ranks():
    batch = mixed_batch()
    per_rank = plan(batch, max_tokens=0, world=2)
    assert [len(m) for m in per_rank] == [1, 1]
    assert sorted(r for m in per_rank for rows in m for r in rows) == list(range(8))
    # One big micro-batch under the budget is halved so the second rank gets work.
    per_rank = plan(batch, max_tokens=10_000, world=2)
    assert all(per_rank) and sorted(r for m in per_rank for rows in m for r in rows) == list(range(8))
    # More ranks than rows: the extra ranks get nothing (they run a zero-weight pass).
    small = rows_of(batch, [0, 1])
    assert [len(m) for m in plan(small, max_tokens=0, world=3)] == [1, 1, 0]


def test_rows_of_trims_padding_only():
    batch = mixed_batch()
    lengths = batch.attention_mask.sum(-1)
    shortest = int(lengths.argmin())
    micro = rows_of(batch, [shortest])
    n = int(lengths[shortest])
    assert micro.input_ids.shape == (1, n) and micro.loss_mask.shape == (1, n - 1)
    assert micro.input_ids[0].tolist() == batch.input_ids[shortest, :n].tolist()
    assert float(micro.loss_mask.sum()) == float(batch.loss_mask[shortest].sum())


class RecordingEngine(TorchEngine):
    """Keeps the accumulated gradients at the optimizer step instead of stepping."""

    def optimizer_step(self) -> float:
        self.grads = [p.grad.detach().clone() for p in self.model.parameters()]
        return 0.0


@pytest.mark.parametrize("loss", ["ppo", "opd"])
@pytest.mark.parametrize("budget", [1, 24, 60])
def test_accumulated_gradient_equals_the_whole_batch_gradient(loss, budget):
    torch.manual_seed(0)
    tok = build_tokenizer()
    batch = mixed_batch()
    if loss == "opd":
        batch.teacher_logprobs = -torch.rand_like(batch.behaviour_logprobs)
    cfg = UpdateConfig(loss=loss, kl_coef=0.0)
    whole = TorchEngine(build_model(tok, seed=0), lr=1e-3, max_grad_norm=1.0)
    full_loss, full_stats = batch_loss(whole, batch, cfg)
    full_loss.backward()
    expected = [p.grad.detach().clone() for p in whole.model.parameters()]

    engine = RecordingEngine(build_model(tok, seed=0), lr=1e-3, max_grad_norm=1.0)
    assert len(plan(batch, budget)[0]) > 1, "the budget must split the batch for this test to mean anything"
    stats = accumulated_update(engine, batch, cfg, max_tokens=budget)
    # fp32: sums in another order, so equal to rounding, not to the bit.
    for got, want in zip(engine.grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert stats["loss"] == pytest.approx(float(full_loss), rel=1e-5, abs=1e-7)
    for key, value in full_stats.items():
        assert stats[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_device_auto_is_the_cpu_without_cuda_and_a_missing_gpu_is_named():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    from rlstream.errors import UsageError
    with pytest.raises(UsageError, match="0 CUDA device"):
        resolve_device("cuda:1")


def _grads(autocast_mode="off", checkpointing=False, budget=24):
    from rlstream.models.devices import enable_gradient_checkpointing
    model = build_model(build_tokenizer(), seed=0)
    if checkpointing:
        enable_gradient_checkpointing(model)
    engine = RecordingEngine(model, lr=1e-3, max_grad_norm=1.0, autocast_mode=autocast_mode)
    accumulated_update(engine, mixed_batch(), UpdateConfig(), max_tokens=budget)
    return engine.grads


def test_gradient_checkpointing_gives_the_same_gradients():
    for got, want in zip(_grads(checkpointing=True), _grads()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_runs_on_the_cpu_and_stays_near_float32():
    bf16, fp32 = _grads(autocast_mode="bf16"), _grads()
    assert all(g.dtype == torch.float32 for g in bf16)  # parameters and their gradients keep their dtype
    flat = lambda gs: torch.cat([g.flatten() for g in gs])  # noqa: E731
    cosine = torch.nn.functional.cosine_similarity(flat(bf16), flat(fp32), dim=0)
    assert cosine > 0.99 and not torch.equal(flat(bf16), flat(fp32))
