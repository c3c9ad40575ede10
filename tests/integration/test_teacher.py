"""The teacher stage against the real broker: both feedback forms on student tokens, the version header, a timeout
that sends samples on without feedback, bad input to dead letters, a teacher that follows the policy, and a
tokenizer mismatch refused."""
from __future__ import annotations

import json

import pytest

from rlstream.models.tiny import build_model, build_tokenizer, save_pretrained
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


@pytest.mark.timeout(270)
def test_a_teacher_with_another_tokenizer_scores_aligned_tokens(bootstrap, run_name, tmp_path, start_stage):
    """A BPE student and a character-level teacher: each student token gets the summed log-probs of the teacher's
    characters that spell it; a sample that cannot be aligned goes on with its failure class."""
    import torch

    from rlstream.recipes.arithmetic.tokenizer import train_tokenizer
    from rlstream.policy.weights import WeightStore, tokenizer_hash
    from rlstream.schemas.records import PolicyVersion, Reward, ScoredTrajectory
    from tests.helpers.kafka import make_trajectory
    bpe = train_tokenizer(["abc cba abcabc", "cba abc bca"] * 20, vocab_size=300)
    uri = WeightStore(str(tmp_path / "w")).put("policy", 0, lambda d: bpe.save_pretrained(d))
    pv = PolicyVersion(policy="policy", version=0, weights_uri=uri, created_at=hdr.now_ms(), published_at=hdr.now_ms(),
                       tokenizer_hash=tokenizer_hash(tmp_path / "w" / "policy" / "v0"))
    produce(bootstrap, run_name, "policy-versions", [(b"policy", pv, None)])
    tiny = build_tokenizer()
    teacher = build_model(tiny, seed=7)
    save_pretrained(teacher, tiny, tmp_path / "teacher")
    prompt = bpe("xy>", add_special_tokens=False)["input_ids"]
    response = bpe("abc cba", add_special_tokens=False)["input_ids"]
    records = []
    # The second sample ends a sequence mid-text: the teacher's end-of-sequence cannot stand there.
    for i, actions in enumerate([response, response[:1] + [bpe.eos_token_id] + response[1:]]):
        traj = make_trajectory(i, n_tokens=len(actions))
        traj.task.prompt_token_ids, traj.token_ids = prompt, actions
        records.append((traj.group_id.encode(), ScoredTrajectory(traj, Reward(1.0, "v1")), None))
    produce(bootstrap, run_name, "rewards", records)
    proc = start_stage("teacher", bootstrap, run_name, "--teacher", str(tmp_path / "teacher"), "--align-tokenizers",
                       "--home", str(tmp_path / "home"))
    try:
        feedback = {f.record.scored.trajectory.trajectory_id: f.record
                    for f in read_all(bootstrap, run_name, "feedback", expect=2, timeout=120)}
    finally:
        assert proc.stop() == 0, proc.log_tail()
    seq = torch.tensor([tiny("xy>abc cba")["input_ids"]])  # the teacher's BOS, then one token per character
    with torch.no_grad():
        lp = torch.log_softmax(teacher(seq).logits[0, :-1].float(), -1).gather(-1, seq[0, 1:, None])[:, 0].tolist()
    # 'abc' is teacher tokens 4..6 (predicted at 3..5), ' cba' tokens 7..10.
    assert feedback["traj-0"].teacher_logprobs == pytest.approx([sum(lp[3:6]), sum(lp[6:10])], abs=1e-4)
    assert feedback["traj-0"].status == "ok"
    failed = feedback["traj-1"]
    assert (failed.status, failed.failure_class, failed.teacher_logprobs) == ("alignment_failed", "special_token", [])
