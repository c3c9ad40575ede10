"""Episodes as rollout writes them, for tests of the env side (the env stage, live envs, remote env servers)."""
from __future__ import annotations

from rlstream.schemas import headers as hdr
from rlstream.schemas.records import Episode, SamplingParams, Task, Turn


def task(env: str = "tools", max_turns: int = 6) -> Task:
    """Task ``t1`` of group ``g1`` for env ``env``."""
    return Task(task_id="t1", group_id="g1", task_name="agent", env_name=env, env_version="", prompt="go",
                sampling=SamplingParams(), created_at=hdr.now_ms(), max_turns=max_turns)


def episode(*actions: str, env: str = "tools", max_turns: int = 6) -> Episode:
    """An episode as rollout writes it: actions interleaved with tokenized observations, 2 tokens each."""
    ep = Episode(episode_id="g1:0", group_id="g1", sample_index=0, task=task(env, max_turns))
    for i, text in enumerate(actions):
        if i:
            ep.turns.append(Turn("observation", "obs", len(ep.token_ids), len(ep.token_ids) + 2))
            ep.token_ids += [7, 7]
            ep.loss_mask += [0, 0]
            ep.behaviour_logprobs += [0.0, 0.0]
        ep.turns.append(Turn("action", text, len(ep.token_ids), len(ep.token_ids) + 2, policy_version=0))
        ep.token_ids += [1, 2]
        ep.loss_mask += [1, 1]
        ep.behaviour_logprobs += [-0.5, -0.5]
    return ep
