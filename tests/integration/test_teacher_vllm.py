"""The vLLM teacher (prompt log-probs, in process) scores the student's tokens as the transformers teacher does."""
from __future__ import annotations

import pytest
import torch

from rlstream.models.tiny import build_model, build_tokenizer, save_pretrained
from rlstream.stages.teacher.scoring import TorchScorer, VllmScorer

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_vllm_prompt_logprobs_match_the_transformers_teacher(tmp_path):
    tok = build_tokenizer()
    model = build_model(tok, seed=5)
    save_pretrained(model, tok, tmp_path / "t")
    rows = [[1, 5, 6, 7, 8, 2], [1, 9, 2], [1, 5, 7, 7, 12, 13, 14]]
    expected = TorchScorer(model, torch.device("cpu")).score(rows, 1.0, 3)
    scorer = VllmScorer(tmp_path / "t", batch_tokens=12)  # two chunks
    got = scorer.score(rows, 1.0, 3)
    for (lp, ids, tlp), (lp2, ids2, tlp2) in zip(expected, got):
        assert lp2 == pytest.approx(lp, abs=1e-3)
        assert ids2 == ids
        assert torch.allclose(torch.tensor(tlp2), torch.tensor(tlp), atol=1e-3)
    with pytest.raises(ValueError, match="temperature 1"):
        scorer.score(rows, 0.7, 3)
    # A teacher following the policy: new weights in the same engine.
    other = build_model(tok, seed=6)
    save_pretrained(other, tok, tmp_path / "t2")
    scorer.reload(tmp_path / "t2")
    after = scorer.score(rows[:1], 1.0, 0)[0]
    assert after[0] == pytest.approx(TorchScorer(other, torch.device("cpu")).score(rows[:1], 1.0, 0)[0][0], abs=1e-3)
