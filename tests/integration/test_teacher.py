"""The teacher stage against the real broker: both feedback forms on student tokens, the version header, a timeout
that sends samples on without feedback, bad input to dead letters, a teacher that follows the policy, and a
tokenizer mismatch refused."""
from __future__ import annotations

import json

import pytest

from rlstream.models.tiny import build_model, save_pretrained
from rlstream.schemas import headers as hdr
from tests.helpers.kafka import produce, read_all, wait_for
from tests.helpers.teacher import expected, publish_student, samples

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

@pytest.mark.timeout(270)
def test_teacher_sends_both_forms_with_its_version(bootstrap, run_name, tmp_path, start_stage):
    model, tok, folder = publish_student(bootstrap, run_name, tmp_path)
    produce(bootstrap, run_name, "rewards", samples(tok, 0, 6))
    proc = start_stage("teacher", bootstrap, run_name, "--teacher", str(folder), "--top-k", "4", "--device", "cpu")
    try:
        feedback = read_all(bootstrap, run_name, "feedback", expect=6, timeout=120)
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert len(feedback) == 6
    lps, ids, tlps = expected(model, tok)
    for f in feedback:
        fb = f.record
        assert fb.teacher_logprobs == pytest.approx(lps, abs=1e-4)
        assert (fb.teacher_top_k, fb.teacher_topk_ids) == (4, ids)
        assert fb.teacher_topk_logprobs == pytest.approx(tlps, abs=1e-4)
        assert (fb.teacher_version, fb.status, fb.teacher_device) == ("v0", "ok", "cpu")
        assert f.headers[hdr.TEACHER_VERSION] == b"v0"


@pytest.mark.timeout(270)
def test_timeout_sends_samples_on_without_feedback_and_bad_input_is_dead_lettered(bootstrap, run_name, tmp_path,
                                                                                    start_stage):
    _, tok, folder = publish_student(bootstrap, run_name, tmp_path)
    good = samples(tok, 0, 8)
    out_of_vocab = samples(tok, 100, 1)
    out_of_vocab[0][1].trajectory.token_ids = [7, 6, 5, 9999]
    short_mask = samples(tok, 101, 1)
    short_mask[0][1].trajectory.loss_mask = [1, 1, 1]
    produce(bootstrap, run_name, "rewards", good + out_of_vocab + short_mask)
    # One row per forward, and a budget that runs out after the first: the rest go on without feedback.
    proc = start_stage("teacher", bootstrap, run_name, "--teacher", str(folder), "--top-k", "2",
                       "--timeout-s", "0.001", "--batch-tokens", "8")
    try:
        feedback = read_all(bootstrap, run_name, "feedback", expect=8, timeout=120)
        letters = read_all(bootstrap, run_name, "dead-letters", expect=2, timeout=60)
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert len(feedback) == 8
    timed_out = [f.record for f in feedback if f.record.status == "timeout"]
    assert timed_out, "a 1 ms budget left every sample scored"
    for fb in (f.record for f in feedback):
        filled = (fb.teacher_logprobs, fb.teacher_topk_ids, fb.teacher_topk_logprobs)
        if fb.status == "timeout":
            assert filled == ([], [], []), "a sample without feedback carries no part of one"
        else:
            assert (len(filled[0]), len(filled[1]), len(filled[2])) == (4, 8, 8)
    reasons = sorted((d.record.reason, d.record.error) for d in letters)
    assert [r for r, _ in reasons] == ["invalid", "invalid"]
    assert any("outside the teacher's vocabulary" in e and "9999" in e for _, e in reasons), reasons
    assert any("loss_mask has 3 entries but token_ids 4" in e for _, e in reasons), reasons


@pytest.mark.timeout(300)
def test_a_teacher_following_the_policy_reloads_on_each_version(bootstrap, run_name, tmp_path, start_stage):
    _, tok, _ = publish_student(bootstrap, run_name, tmp_path, version=0, seed=3)
    produce(bootstrap, run_name, "rewards", samples(tok, 0, 2))
    proc = start_stage("teacher", bootstrap, run_name, "--home", str(tmp_path / "home"))
    try:
        first = read_all(bootstrap, run_name, "feedback", expect=2, timeout=120)
        assert {f.record.teacher_version for f in first} == {"policy-v0"}
        model1, _, _ = publish_student(bootstrap, run_name, tmp_path, version=1, seed=4)
        sent = [2]

        def scored_by_v1():
            # The watcher sees v1 at some point after it is announced: keep sending until feedback says so.
            produce(bootstrap, run_name, "rewards", samples(tok, sent[0], 1))
            sent[0] += 1
            found = [f for f in read_all(bootstrap, run_name, "feedback") if f.record.teacher_version == "policy-v1"]
            return found
        later = wait_for(scored_by_v1, 90, "feedback from the reloaded teacher", interval=1.0)
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert later[0].record.teacher_logprobs == pytest.approx(expected(model1, tok)[0], abs=1e-4)
    assert later[0].headers[hdr.TEACHER_VERSION] == b"policy-v1"


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
    assert str(other) in text and "policy v0" in text, text[-2000:]  # both tokenizers named
    assert "Traceback" not in text, text[-4000:]
