"""``rlstream gateway`` as its own process in front of a real engine (transformers, a small Llama with a ChatML
tokenizer), driven by the real ``openai`` client from an agent program of its own (tests.helpers.agent).

Checked: each call's tokens, log-probs and version in the trajectory exactly as the engine returned them (a streamed
call's arriving in several chunks as the engine sampled them), and the
episode's token sequence is the conversation the agent sent (the agent's additions rendered, the model's answers
never re-tokenized); unknown and closed sessions refused with 404/409 and a message; a gateway SIGKILLed with an
episode open and a close inside its transaction leaves nothing visible to read_committed readers (the records it
had written stay invisible, and the next gateway of its instance aborts them); an unclosed session times out
into a failure record; the reward stage scores gateway episodes with the posted reward.
"""
from __future__ import annotations

import threading

import openai
import pytest

from rlstream.gateway import chat
from rlstream.models.loading import load_tokenizer
from tests.helpers.agent import TOOLS, run_agent
from tests.helpers.gateway import post, start_gateway
from tests.helpers.kafka import read_all, read_uncommitted, wait_for
from tests.helpers.models import llama_folder
from tests.helpers.policy import publish_version
from tests.helpers.servers import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_an_agent_through_the_gateway_becomes_trajectories_and_a_killed_gateway_writes_nothing_half(
        bootstrap, run_name, tmp_path, start_stage):
    folder = llama_folder(tmp_path / "llama", max_positions=512)
    tok = load_tokenizer(folder)
    publish_version(bootstrap, run_name, folder, tmp_path / "weights")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    gateway = start_gateway(bootstrap, run_name, port, tmp_path / "gateway-0.log", tmp_path / "home",
                            "--commit-pause-s", "3", timeout=120)
    try:
        # Episode A: three calls (the second streamed), the agent's own tool between them, closed with a reward.
        assert post(base + "/v1/sessions", {"session_id": "A", "group_id": "gA", "answer": "42"})[0] == 201
        streamed: list = []
        messages, responses = run_agent(base + "/v1", "A", steps=3, stream_at=1, chunks=streamed)
        status, closed = post(base + "/v1/sessions/A/close", {"reward": 1.0})
        assert (status, closed["trajectories"], closed["calls"]) == (200, 1, 3)
        # Episode B: completions, the second prompt extending the first's prompt and answer.
        assert post(base + "/v1/sessions", {"session_id": "B"})[0] == 201
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        one = client.completions.create(model="policy", prompt="12 + 30 =", max_tokens=4, user="B", seed=1)
        two = client.completions.create(model="policy", prompt="12 + 30 =" + one.choices[0].text + " so", user="B",
                                        max_tokens=4, seed=2)
        assert two.model_extra["rlstream"]["chained"] or one.choices[0].finish_reason == "stop"
        assert post(base + "/v1/sessions/B/close", {})[0] == 200

        # Unknown and closed sessions: 4xx with what to do.
        with pytest.raises(openai.NotFoundError, match="open it first with POST /v1/sessions"):
            run_agent(base + "/v1", "nobody", steps=1)
        with pytest.raises(openai.ConflictError, match="is closed"):
            run_agent(base + "/v1", "A", steps=1)

        # Mid-episode C (two calls, never closed) and D closing inside its transaction: SIGKILL.
        for sid in ("C", "D"):
            assert post(base + "/v1/sessions", {"session_id": sid})[0] == 201
        run_agent(base + "/v1", "C", steps=2)
        run_agent(base + "/v1", "D", steps=1)
        answered = []

        def close_d():
            try:
                answered.append(post(base + "/v1/sessions/D/close", {}))
            except OSError:
                pass  # the gateway died with the close in flight
        closing = threading.Thread(target=close_d, daemon=True)
        closing.start()
        wait_for(lambda: len(read_uncommitted(bootstrap, run_name, "trajectories")) == 3, 30,
                 "D's trajectory written inside its open transaction")
        gateway.kill()
        closing.join(30)
        assert answered == [], "the close was never answered: its transaction did not commit"
    finally:
        gateway.kill()
    # The next gateway of the instance fences the killed one and aborts its open transaction.
    gateway = start_gateway(bootstrap, run_name, port, tmp_path / "gateway-1.log", tmp_path / "home",
                            "--session-timeout-s", "2", timeout=120)
    try:
        committed = read_all(bootstrap, run_name, "trajectories", expect=2, timeout=60)
        assert sorted(s.record.trajectory_id for s in committed) == ["A:0", "B:0"], "nothing of C or D is visible"
        assert len(read_uncommitted(bootstrap, run_name, "trajectories")) == 3, "D's record exists, uncommitted"
        # C's episode went with the old gateway (404, saying why); a session left open times out into a failure.
        with pytest.raises(openai.NotFoundError, match="may have restarted"):
            run_agent(base + "/v1", "C", steps=1)
        assert post(base + "/v1/sessions", {"session_id": "E", "group_id": "gE"})[0] == 201
        run_agent(base + "/v1", "E", steps=1)
        trajs = read_all(bootstrap, run_name, "trajectories", expect=3, timeout=60)
    finally:
        code = gateway.stop(60)
    assert code == 0, gateway.log_tail()
    [e] = [s.record for s in trajs if s.record.trajectory_id == "E:0"]
    assert (e.status, e.failure.failure_class, e.failure.stage) == ("failed", "gateway_timeout", "gateway")
    assert len(e.turns) == 1 and e.turns[0].token_end > 0, "its tokens are kept for the archive"

    # Episode A as the engine made it.
    [a] = [s for s in committed if s.record.trajectory_id == "A:0"]
    traj = a.record
    assert a.key == b"gA" and a.headers["policy_version"] == b"0"
    assert [t.role for t in traj.turns] == ["action", "observation"] * 2 + ["action"]
    assert (traj.task.answer, traj.task.metadata["gateway.reward"], traj.group_id) == ("42", "1.0", "gA")
    assert traj.status == ("truncated" if traj.turns[-1].finish_reason == "length" else "ok")
    actions = [t for t in traj.turns if t.role == "action"]
    for turn, response in zip([actions[0], actions[2]], responses):
        captured = response.model_extra["rlstream"]
        assert traj.token_ids[turn.token_start:turn.token_end] == captured["token_ids"]
        assert traj.behaviour_logprobs[turn.token_start:turn.token_end] == pytest.approx(captured["logprobs"])
        assert all(lp < 0 for lp in captured["logprobs"]) and captured["policy_version"] == 0
    # The streamed call came token by token as the engine sampled them, and kept the engine's own ids.
    texts = [c.choices[0].delta.content for c in streamed if c.choices and c.choices[0].delta.content]
    assert len(texts) >= 2, streamed
    assert traj.token_ids[actions[1].token_start:actions[1].token_end] == streamed[-1].model_extra["rlstream"][
        "token_ids"]
    assert all(t.policy_version == 0 for t in actions) and traj.min_policy_version == 0
    assert traj.loss_mask == [int(t.role == "action") for t in traj.turns for _ in range(t.token_start, t.token_end)]
    # Episode B: the second completion continued the first (its prompt's new text " so" is context).
    [b] = [s.record for s in committed if s.record.trajectory_id == "B:0"]
    if two.model_extra["rlstream"]["chained"]:
        assert [t.role for t in b.turns] == ["action", "observation", "action"] and b.turns[1].text == " so"
        assert b.token_ids[:b.turns[0].token_end] == one.model_extra["rlstream"]["token_ids"]
    # Up to the last answer, the sequence is the agent's conversation (tools included) as the template renders
    # it: the agent's additions rendered, the answers the engine's own tokens.
    rendered = chat.render(tok, chat.normalize(messages[:-1]), TOOLS, True)
    assert tok.decode(traj.task.prompt_token_ids + traj.token_ids[:actions[-1].token_start]) == rendered
    assert "<|im_start|>tool\n42<|im_end|>" in traj.turns[1].text

    # The reward stage: the posted reward for A; B had none posted (a judge error, not a silent zero); E failed.
    start_stage("reward", bootstrap, run_name, "--reward", "rlstream.gateway.reward:posted")
    rewards = {s.record.trajectory.trajectory_id: s.record.reward
               for s in read_all(bootstrap, run_name, "rewards", expect=3, timeout=120)}
    assert set(rewards) == {"A:0", "B:0", "E:0"}
    assert rewards["A:0"].total == 1.0 and rewards["A:0"].failure_class is None
    assert rewards["B:0"].failure_class == "judge_error"
    assert rewards["E:0"].failure_class == "gateway_timeout"
