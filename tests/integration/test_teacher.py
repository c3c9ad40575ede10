"""The teacher stage against the real broker: per-token teacher log-probs, and a tokenizer mismatch refused."""
from __future__ import annotations

import json

import pytest
import torch

from rlstream.models.tiny import build_model, build_tokenizer, save_pretrained
from rlstream.policy.weights import WeightStore, tokenizer_hash
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import PolicyVersion, Reward, ScoredTrajectory
from tests.helpers.kafka import make_trajectory, produce, read_all

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def publish_student(bootstrap, run, tmp_path):
    tok = build_tokenizer()
    model = build_model(tok, seed=3)
    uri = WeightStore(str(tmp_path / "w")).put("policy", 0, lambda d: save_pretrained(model, tok, d))
    folder = tmp_path / "w" / "policy" / "v0"
    pv = PolicyVersion(policy="policy", version=0, weights_uri=uri, created_at=hdr.now_ms(),
                       published_at=hdr.now_ms(), tokenizer_hash=tokenizer_hash(folder))
    produce(bootstrap, run, "policy-versions", [(b"policy", pv, None)])
    return model, tok, folder


@pytest.mark.timeout(270)
def test_teacher_logprobs_match_the_model_on_student_tokens(bootstrap, run_name, tmp_path, start_stage):
    model, tok, folder = publish_student(bootstrap, run_name, tmp_path)
    samples = []
    for i in range(6):
        traj = make_trajectory(i, n_tokens=4)
        traj.task.prompt_token_ids = tok("abc>")["input_ids"]
        traj.token_ids = [7, 6, 5, 2]
        traj.loss_mask = [1, 1, 0, 1]  # an observation token in the middle gets no teacher log-prob
        samples.append((traj.group_id.encode(), ScoredTrajectory(traj, Reward(1.0, "v1")), None))
    produce(bootstrap, run_name, "rewards", samples)
    log = tmp_path / "teacher.log"
    proc = start_stage("teacher", bootstrap, run_name, "--teacher", str(folder), log_path=log)
    try:
        feedback = read_all(bootstrap, run_name, "feedback", expect=len(samples), timeout=120)
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert len(feedback) == len(samples)
    seq = torch.tensor([tok("abc>")["input_ids"] + [7, 6, 5, 2]])
    with torch.no_grad():
        lp = torch.log_softmax(model(seq).logits[0, :-1].float(), -1).gather(-1, seq[0, 1:, None])[:, 0]
    p = len(tok("abc>")["input_ids"])
    expected = [float(lp[p - 1]), float(lp[p]), 0.0, float(lp[p + 2])]
    for f in feedback:
        assert f.record.teacher_logprobs == pytest.approx(expected, abs=1e-4)
        assert f.record.teacher_version == "v0"


@pytest.mark.timeout(210)
def test_teacher_with_another_tokenizer_is_refused(bootstrap, run_name, tmp_path, start_stage):
    _, tok, folder = publish_student(bootstrap, run_name, tmp_path)
    other = tmp_path / "other-teacher"
    model = build_model(tok)
    save_pretrained(model, tok, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 4096  # any change to the tokenizer files is a different tokenizer
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    log = tmp_path / "teacher.log"
    proc = start_stage("teacher", bootstrap, run_name, "--teacher", str(other), log_path=log)
    code = proc.wait(120)
    text = log.read_text()
    assert code != 0 and "differs from the student" in text, text[-2000:]
    assert "Traceback" not in text, text[-4000:]
