"""Episodes as rollout writes them, for tests of the env side (the env stage, live envs, remote env servers, the
env+reward chain), and a trajectory as the env writes it, for tests of the reward side."""
from __future__ import annotations

from rlstream.schemas import headers as hdr
from rlstream.schemas.records import Episode, SamplingParams, Task, Trajectory, Turn


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


def one_action_episode(i: int, action: str, env: str = "single") -> Episode:
    """A one-action episode as rollout writes it to ``actions`` (v2's tokens)."""
    task = Task(task_id=f"task-{i}", group_id=f"group-{i % 40}", task_name=env, env_name=env, env_version="1",
                prompt="abc>", sampling=SamplingParams(), created_at=hdr.now_ms(), answer="cba",
                max_turns=1 if env == "single" else 4)
    ep = Episode(episode_id=f"group-{i % 40}:{i}", group_id=task.group_id, sample_index=i, task=task)
    ep.token_ids, ep.loss_mask, ep.behaviour_logprobs = [1, 2, 3], [1, 1, 1], [-1.0] * 3
    ep.turns.append(Turn("action", action, 0, 3, policy_version=2, finish_reason="stop"))
    return ep


def traj(response: str, answer: str | None = "5", metadata: dict[str, str] | None = None, n_tokens: int = 4,
         max_tokens: int = 64) -> Trajectory:
    """A one-turn trajectory whose model generated ``n_tokens`` tokens."""
    task = Task(task_id="t", group_id="g", task_name="q", env_name="single", env_version="1", prompt="p",
                sampling=SamplingParams(max_tokens=max_tokens), created_at=hdr.now_ms(), answer=answer,
                metadata=metadata or {})
    return Trajectory(trajectory_id="g:0", group_id="g", sample_index=0, task=task, response=response,
                      min_policy_version=0, max_policy_version=0, token_ids=list(range(n_tokens)),
                      loss_mask=[1] * n_tokens, behaviour_logprobs=[-1.0] * n_tokens,
                      turns=[Turn("action", response, 0, n_tokens)])
