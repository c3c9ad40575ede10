"""The teacher stage scoring through a real vLLM OpenAI-compatible server (CPU, started by the test): the same
feedback as the model in process, both forms; an unreachable URL and a server with another tokenizer refused at
start by name; a budget too short for the server sends samples on as ``timeout``."""
from __future__ import annotations

import pytest

from tests.helpers.kafka import produce, read_all
from tests.helpers.models import llama_folder
from tests.helpers.servers import free_port, start_vllm_server
from tests.helpers.teacher import expected, publish_student, samples

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture
def student_server(bootstrap, run_name, tmp_path):
    """The published student, and a vLLM server serving it as the teacher."""
    model, tok, folder = publish_student(bootstrap, run_name, tmp_path)
    server = start_vllm_server(folder, tmp_path / "vllm.log", dev_mode=False)
    try:
        yield model, tok, server.wait_ready(300)
    finally:
        server.kill()


@pytest.mark.timeout(600)
def test_a_server_teacher_scores_as_the_model_does_and_a_short_budget_times_out(bootstrap, run_name, tmp_path,
                                                                               start_stage, student_server):
    model, tok, server = student_server
    produce(bootstrap, run_name, "rewards", samples(tok, 0, 6))
    proc = start_stage("teacher", bootstrap, run_name, "--teacher-url", server.url, "--top-k", "4",
                       "--teacher-in-flight", "4", "--teacher-version", "served")
    try:
        feedback = read_all(bootstrap, run_name, "feedback", expect=6, timeout=180)
    finally:
        assert proc.stop() == 0, proc.log_tail()
    lps, ids, tlps = expected(model, tok)
    assert len(feedback) == 6
    for f in feedback:
        fb = f.record
        assert (fb.status, fb.teacher_version, fb.teacher_device) == ("ok", "served", server.url)
        assert fb.teacher_logprobs == pytest.approx(lps, abs=1e-3)
        assert (fb.teacher_top_k, fb.teacher_topk_ids) == (4, ids)
        assert fb.teacher_topk_logprobs == pytest.approx(tlps, abs=1e-3)
    # A budget no request meets: every sample goes on without a signal, none with part of one.
    produce(bootstrap, run_name, "rewards", samples(tok, 10, 4))
    proc = start_stage("teacher", bootstrap, run_name, "--teacher-url", server.url, "--top-k", "2",
                       "--timeout-s", "0.000001", "--teacher-in-flight", "1")
    try:
        late = read_all(bootstrap, run_name, "feedback", expect=10, timeout=180)
    finally:
        assert proc.stop() == 0, proc.log_tail()
    timed_out = [f.record for f in late if f.record.scored.trajectory.trajectory_id not in
                 {g.record.scored.trajectory.trajectory_id for g in feedback}]
    assert len(timed_out) == 4
    assert {fb.status for fb in timed_out} == {"timeout"}
    assert all(not (fb.teacher_logprobs or fb.teacher_topk_ids or fb.teacher_topk_logprobs) for fb in timed_out)


@pytest.mark.timeout(600)
def test_an_unreachable_url_and_another_tokenizer_are_refused_by_name(bootstrap, run_name, tmp_path, start_stage):
    publish_student(bootstrap, run_name, tmp_path)
    dead = f"http://127.0.0.1:{free_port()}"
    log = tmp_path / "unreachable.log"
    proc = start_stage("teacher", bootstrap, run_name, "--teacher-url", dead, log_path=log)
    assert proc.wait(120) != 0
    text = log.read_text()
    assert dead in text and "unreachable" in text and "Traceback" not in text, text[-2000:]
    # A server whose model has another tokenizer (a Llama with its own vocabulary).
    other = llama_folder(tmp_path / "other", max_positions=64)
    server = start_vllm_server(other, tmp_path / "other-vllm.log", dev_mode=False)
    try:
        server.wait_ready(300)
        log = tmp_path / "mismatch.log"
        proc = start_stage("teacher", bootstrap, run_name, "--teacher-url", server.url, log_path=log)
        assert proc.wait(120) != 0
    finally:
        server.kill()
    text = log.read_text()
    assert server.url in text and "tokenizer" in text and "policy v0" in text, text[-2000:]
    assert "Traceback" not in text, text[-2000:]

