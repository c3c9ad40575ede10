"""The teacher's scoring on a real tiny model: the sampled token's log-prob and the top-k per response token, in
chunks, and rows past the deadline left unscored (never half-filled)."""
from __future__ import annotations

import time

import pytest
import torch

from rlstream.models.tiny import build_model, build_tokenizer
from rlstream.stages.teacher.scoring import TorchScorer, response_feedback
from rlstream.stages.teacher.server import from_prompt_logprobs
from rlstream.models.logprobs import pack_by_length


def test_chunks_stay_within_the_token_budget_longest_first():
    assert pack_by_length([3, 5, 2, 5], 10) == [[1, 3], [0, 2]]
    assert pack_by_length([12, 2], 10) == [[0], [1]]  # a row longer than the budget is a chunk alone


def test_response_feedback_aligns_with_the_response_and_zeroes_unmasked_tokens():
    seq = [-0.1, -0.2, -0.3, -0.4, -0.5]  # position t predicted token t + 1 of a 6-token row, prompt of 3
    ids = [[t, t + 1] for t in range(5)]
    lps = [[-t, -t - 1.0] for t in range(5)]
    fb = response_feedback(seq, ids, lps, prompt_len=3, loss_mask=[1, 0, 1], k=2)
    assert fb.logprobs == [-0.3, 0.0, -0.5]  # response token j was predicted at 3 + j - 1
    assert fb.topk_ids == [2, 3, 0, 0, 4, 5]
    assert fb.topk_logprobs == [-2, -3.0, 0.0, 0.0, -4, -5.0]
    assert response_feedback(seq, None, None, 3, [1, 1, 0], 0).topk_ids == []


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scores_match_the_model_in_any_chunking(temperature):
    tok = build_tokenizer()
    model = build_model(tok, seed=3)
    rows = [[1, 5, 6, 7, 8, 2], [1, 9, 2], [1, 5, 7, 7]]
    whole = TorchScorer(model, torch.device("cpu"), batch_tokens=10_000).score(rows, temperature, 4)
    chunked = TorchScorer(model, torch.device("cpu"), batch_tokens=6).score(rows, temperature, 4)
    for row, (lp, ids, tlp), (lp2, ids2, tlp2) in zip(rows, whole, chunked):
        with torch.no_grad():
            full = torch.log_softmax(model(input_ids=torch.tensor([row])).logits[0, :-1].float() / temperature, -1)
        expected = full.gather(-1, torch.tensor(row[1:])[:, None])[:, 0]
        assert lp == pytest.approx(expected.tolist(), abs=1e-5)
        assert ids == full.topk(4, -1).indices.tolist()
        assert torch.allclose(torch.tensor(tlp), full.topk(4, -1).values, atol=1e-5)
        assert lp2 == pytest.approx(lp, abs=1e-5) and ids2 == ids


def test_rows_past_the_deadline_are_left_unscored():
    tok = build_tokenizer()
    scorer = TorchScorer(build_model(tok, seed=3), torch.device("cpu"), batch_tokens=4)
    rows = [[1, 5, 6, 2], [1, 5, 7, 2], [1, 6, 6, 2]]
    assert scorer.score(rows, 1.0, 0, deadline=time.monotonic() - 1) == [None, None, None]
    out = scorer.score(rows, 1.0, 0, deadline=time.monotonic() + 60)
    assert all(o is not None and len(o[0]) == 3 and o[1] is None for o in out)


def test_server_prompt_logprobs_are_read_by_token_id_and_rank():
    """vLLM's JSON: string token ids as keys, the actual token's entry besides the top k (here outside them)."""
    row = [1, 7, 9]
    reply = [None,
             {"7": {"logprob": -0.1, "rank": 1}, "3": {"logprob": -2.5, "rank": 2}},
             {"4": {"logprob": -0.3, "rank": 1}, "5": {"logprob": -1.9, "rank": 2}, "9": {"logprob": -6.0, "rank": 7}}]
    lps, ids, tlps = from_prompt_logprobs(row, reply, 2)
    assert lps == [-0.1, -6.0]
    assert ids == [[7, 3], [4, 5]]
    assert tlps == [[-0.1, -2.5], [-0.3, -1.9]]
    assert from_prompt_logprobs(row, reply, 0) == ([-0.1, -6.0], None, None)
    with pytest.raises(ValueError, match="2 prompt positions for 3 tokens"):
        from_prompt_logprobs(row, reply[:2], 2)
