"""The gateway in front of a real vLLM OpenAI-compatible server (CPU) as a one-server fleet: the server is pushed the
announced version and confirms it; an agent's multi-call episode comes back with the server's tokens, and every
action's log-probs are the ones the model gives those tokens after the chained sequence (so the server sampled
from exactly the sequence the trajectory records)."""
from __future__ import annotations

import pytest

from tests.helpers.agent import run_agent
from tests.helpers.gateway import post, start_gateway
from tests.helpers.kafka import read_all
from tests.helpers.models import llama_folder, reference_logprobs
from tests.helpers.policy import publish_version
from tests.helpers.servers import free_port, start_vllm_server

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.mark.timeout(720)
def test_an_agent_through_the_gateway_on_a_vllm_server(bootstrap, run_name, tmp_path):
    folder = llama_folder(tmp_path / "v0", max_positions=512)
    publish_version(bootstrap, run_name, folder, tmp_path / "weights")
    server = start_vllm_server(folder, tmp_path / "vllm.log", max_model_len=512)
    gateway = None
    try:
        server.wait_ready(300)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        gateway = start_gateway(bootstrap, run_name, port, tmp_path / "gateway.log", tmp_path / "home",
                                "--backend", "vllm-server", "--engine-url", server.url, timeout=120)
        assert post(base + "/v1/sessions", {"session_id": "V", "group_id": "gV"})[0] == 201
        _, responses = run_agent(base + "/v1", "V", steps=3)
        assert post(base + "/v1/sessions/V/close", {"reward": 0.5})[0] == 200
        [seen] = read_all(bootstrap, run_name, "trajectories", expect=1, timeout=60)
    finally:
        if gateway is not None:
            gateway.kill()
        server.kill()
    traj = seen.record
    actions = [t for t in traj.turns if t.role == "action"]
    assert len(actions) == 3 and all(t.policy_version == 0 for t in actions), "the server confirmed v0"
    for turn, response in zip(actions, responses):
        captured = response.model_extra["rlstream"]
        assert traj.token_ids[turn.token_start:turn.token_end] == captured["token_ids"]
    for turn in actions:
        before = traj.task.prompt_token_ids + traj.token_ids[:turn.token_start]
        tokens = traj.token_ids[turn.token_start:turn.token_end]
        assert traj.behaviour_logprobs[turn.token_start:turn.token_end] == pytest.approx(
            reference_logprobs(folder, before, tokens), abs=1e-3)
