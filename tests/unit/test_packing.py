"""Padding-free training: a batch's rows packed into one sequence give the padded batch's log-probs, loss and
gradients (within float32 rounding), and a model whose attention would cross rows is refused."""
from __future__ import annotations

import pytest
import torch

from rlstream.errors import UsageError
from rlstream.models.logprobs import check_packing, pack_rows, unpack_rows
from rlstream.models.tiny import build_model, build_tokenizer
from rlstream.trainer.engine import TorchEngine
from rlstream.trainer.microbatch import accumulated_update, plan
from rlstream.trainer.update import UpdateConfig, batch_loss, sequence_logprobs
from tests.helpers.batches import mixed_batch

#: Packed and padded forwards run the same arithmetic on the same tokens with other mask shapes (a block-diagonal
#: mask over one sequence against a causal mask per row), so they differ by float32 rounding only (seen: ~1e-7).
TOLERANCE = 1e-5


def test_pack_rows_puts_the_real_tokens_end_to_end_and_unpack_puts_values_back():
    batch = mixed_batch()
    ids, positions, keep = pack_rows(batch.input_ids, batch.attention_mask)
    lengths = batch.attention_mask.sum(-1).tolist()
    assert ids.shape == positions.shape == (1, sum(lengths))
    assert ids[0, :lengths[0]].tolist() == batch.input_ids[0, :lengths[0]].tolist()
    assert positions[0, lengths[0]:lengths[0] + lengths[1]].tolist() == list(range(lengths[1]))
    back = unpack_rows(ids[0].float(), keep)
    assert torch.equal(back, batch.input_ids.float() * batch.attention_mask)


def test_packed_and_padded_logprobs_loss_and_gradients_match():
    torch.manual_seed(0)
    batch = mixed_batch()
    assert batch.attention_mask.float().mean() < 0.8, "the batch must have padding for packing to skip"
    model = build_model(build_tokenizer(), seed=0)
    mask = batch.loss_mask.bool()
    with torch.no_grad():
        padded, _ = sequence_logprobs(model, batch)
        packed, _ = sequence_logprobs(model, batch, packed=True)
    assert packed[mask] == pytest.approx(padded[mask].tolist(), abs=TOLERANCE)
    # The comparison can fail: the same packed tokens in one causal sequence (rows attending to the rows before
    # them, positions running on) give other log-probs.
    with torch.no_grad():
        across, _ = sequence_logprobs(_AttendsAcrossRows(model), batch, packed=True)
    assert float((across[mask] - padded[mask]).abs().max()) > 1e-3

    grads = []
    for cfg in (UpdateConfig(), UpdateConfig(packed=True)):
        engine = TorchEngine(build_model(build_tokenizer(), seed=0), lr=1e-3, max_grad_norm=1.0)
        loss, _ = batch_loss(engine, batch, cfg)
        loss.backward()
        grads.append((float(loss.detach()), torch.cat([p.grad.reshape(-1) for p in engine.model.parameters()])))
    (loss_padded, grad_padded), (loss_packed, grad_packed) = grads
    assert loss_packed == pytest.approx(loss_padded, rel=TOLERANCE)
    assert float(grad_padded.abs().max()) > 0
    assert torch.allclose(grad_packed, grad_padded, rtol=1e-4, atol=TOLERANCE)


def test_packed_micro_batches_count_real_tokens_and_train_like_padded_ones():
    batch = mixed_batch()
    lengths = batch.attention_mask.sum(-1).tolist()
    [micro] = plan(batch, max_tokens=24, packed=True)
    assert sorted(r for m in micro for r in m) == list(range(8))
    assert all(sum(lengths[r] for r in rows) <= 24 or len(rows) == 1 for rows in micro)
    # Without padding, more rows fit a budget: fewer micro-batches.
    assert len(plan(batch, max_tokens=40, packed=True)[0]) < len(plan(batch, max_tokens=40)[0])
    stats = []
    for cfg in (UpdateConfig(), UpdateConfig(packed=True)):
        engine = TorchEngine(build_model(build_tokenizer(), seed=0), lr=1e-3, max_grad_norm=1.0)
        stats.append(accumulated_update(engine, batch, cfg, max_tokens=24))
    assert stats[1]["loss"] == pytest.approx(stats[0]["loss"], rel=TOLERANCE)
    assert stats[1]["grad_norm"] == pytest.approx(stats[0]["grad_norm"], rel=1e-4)


class _AttendsAcrossRows(torch.nn.Module):
    """A real model called the way a model without packing support behaves: one causal mask over the whole
    sequence, position ids or not."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask if attention_mask is not None
                          else torch.ones_like(input_ids))


def test_check_packing_accepts_a_model_that_keeps_rows_apart_and_refuses_one_that_does_not():
    model = build_model(build_tokenizer(), seed=0)
    check_packing(model)
    assert model.training, "the check leaves the model in the mode it found it"
    with pytest.raises(UsageError, match="does not keep packed rows apart"):
        check_packing(_AttendsAcrossRows(model))


def test_logits_only_at_counted_positions_give_the_full_heads_logprobs_and_gradients(monkeypatch):
    """The vocabulary head runs only where a loss mask counts a token (``logits_to_keep``): the counted log-probs
    and the gradients equal the whole head's, padded and packed; a model that does not take the argument gets the
    whole head."""
    import rlstream.trainer.update as update
    torch.manual_seed(0)
    batch = mixed_batch()
    mask = batch.loss_mask.bool()
    assert not mask.any(0).all(), "some positions must be counted by no row for the head to skip them"
    model = build_model(build_tokenizer(), seed=0)
    assert update._takes_logits_to_keep(model) and not update._takes_logits_to_keep(_AttendsAcrossRows(model))
    for packed in (False, True):
        results = []
        for keeps in (True, False):
            monkeypatch.setattr(update, "_takes_logits_to_keep", lambda forward, keeps=keeps: keeps)
            engine = TorchEngine(build_model(build_tokenizer(), seed=0), lr=1e-3, max_grad_norm=1.0)
            logp, _ = sequence_logprobs(engine.forward, batch, packed=packed)
            loss, _ = batch_loss(engine, batch, UpdateConfig(packed=packed))
            loss.backward()
            results.append((logp.detach(), torch.cat([p.grad.reshape(-1) for p in engine.model.parameters()])))
        (kept, kept_grad), (whole, whole_grad) = results
        assert kept[mask] == pytest.approx(whole[mask].tolist(), abs=TOLERANCE)
        assert float(kept[:, ~mask.any(0)].abs().max()) == 0.0  # positions no row counts
        assert float(whole_grad.abs().max()) > 0
        assert torch.allclose(kept_grad, whole_grad, rtol=1e-4, atol=TOLERANCE)
