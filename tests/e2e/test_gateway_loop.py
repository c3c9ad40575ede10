"""Gateway episodes are trained on: trainer -> policy v0 -> ``rlstream gateway`` -> an agent program (the real
``openai`` client) -> trajectories -> reward (the posted rewards) -> trainer -> v1, which the gateway then serves:
a later call's tokens carry version 1."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.agent import run_agent
from tests.helpers.gateway import health, post, start_gateway
from tests.helpers.kafka import read_all, wait_for
from tests.helpers.models import llama_folder
from tests.helpers.servers import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

GROUPS, GROUP = 2, 2


@pytest.mark.timeout(600)
def test_gateway_episodes_reach_the_trainer_and_the_gateway_serves_the_new_version(bootstrap, run_name, tmp_path,
                                                                                 start_stage):
    folder = llama_folder(tmp_path / "llama", max_positions=512)
    trainer = start_stage("trainer", bootstrap, run_name, "--model", str(folder), "--weights", str(tmp_path / "w"),
                          "--max-steps", "1", "--window-groups", str(GROUPS), "--groups-per-step", str(GROUPS),
                          "--group-size", str(GROUP), "--lr", "1e-2")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    start_stage("reward", bootstrap, run_name, "--reward", "rlstream.gateway.reward:posted")
    gateway = start_gateway(bootstrap, run_name, port, tmp_path / "gateway.log", tmp_path / "home", timeout=180)
    try:
        run_episodes(base)
        assert trainer.wait(240) == 0, trainer.log_tail(3000)
        versions = [s.record for s in read_all(bootstrap, run_name, "policy-versions", expect=2)]
        assert [v.version for v in versions] == [0, 1] and versions[1].samples_trained == GROUPS * GROUP
        rewards = read_all(bootstrap, run_name, "rewards", expect=GROUPS * GROUP)
        assert sorted(s.record.reward.total for s in rewards) == [0.0, 0.0, 1.0, 1.0]
        # The gateway follows the policy: the next call is sampled by v1 and says so.
        wait_for(lambda: (health(base) or {}).get("policy_version") == 1 or not gateway.alive(), 60,
                 "the gateway to load v1")
        assert post(base + "/v1/sessions", {"session_id": "after"})[0] == 201
        _, [response] = run_agent(base + "/v1", "after", steps=1)
        assert response.model_extra["rlstream"]["policy_version"] == 1
    finally:
        code = gateway.stop(60)
    assert code == 0, gateway.log_tail()


def run_episodes(base: str) -> None:
    """GROUPS groups of GROUP agent episodes, all at once (the gateway batches their calls), each closed with the
    reward its harness gave it."""
    def one(g: int, i: int) -> None:
        sid = f"s{g}-{i}"
        assert post(base + "/v1/sessions", {"session_id": sid, "group_id": f"g{g}", "group_size": GROUP,
                                            "sample_index": i})[0] == 201
        _, responses = run_agent(base + "/v1", sid, steps=2, seed=10 * g + i)
        assert {r.model_extra["rlstream"]["policy_version"] for r in responses} == {0}
        assert all(r.model_extra["rlstream"]["session_id"] == sid for r in responses)
        # The agent's harness scores its own episode: one good, one bad sample per group.
        assert post(f"{base}/v1/sessions/{sid}/close", {"reward": float(i % 2)})[1]["trajectories"] == 1
    with ThreadPoolExecutor(GROUPS * GROUP) as pool:
        for done in [pool.submit(one, g, i) for g in range(GROUPS) for i in range(GROUP)]:
            done.result()
