"""Scored trajectories and the batches the trainer builds from them, for tests of the update, micro-batching and
the trainer's ranks (no Kafka)."""
from __future__ import annotations

import torch

from rlstream.schemas.records import Reward, SamplingParams, ScoredTrajectory, Task, Trajectory
from rlstream.trainer.update import build_batch


def scored(gid: str, i: int, reward: float, prompt=(1, 5, 6), response=(7, 8, 2), mask=(1, 0, 1)):
    task = Task(task_id=gid, group_id=gid, task_name="reverse", env_name="single", env_version="1", prompt="x",
                sampling=SamplingParams(), created_at=0, prompt_token_ids=list(prompt), group_size=2)
    traj = Trajectory(trajectory_id=f"{gid}:{i}", group_id=gid, sample_index=i, task=task, response="",
                      min_policy_version=0, max_policy_version=0, token_ids=list(response), loss_mask=list(mask),
                      behaviour_logprobs=[-1.0, 0.0, -2.0])
    return ScoredTrajectory(traj, Reward(reward, "v1"))


def mixed_batch():
    """Two groups of long and short responses (lengths 4..13 tokens), rewards that give non-zero advantages."""
    groups = []
    for g, gid in enumerate("ab"):
        group = []
        for i in range(4):
            n = 1 + (3 * i + 5 * g) % 10
            s = scored(gid, i, float(i % 2), response=tuple(range(7, 7 + n)), mask=(1,) * n)
            s.trajectory.behaviour_logprobs = [-1.0 - 0.1 * k for k in range(n)]
            group.append(s)
        groups.append(group)
    return build_batch(groups, "grpo", pad_id=0)


STEPS = 4
#: Losses of 2 ranks against 1, for every engine: the same sums in another order and gradients averaged across ranks
#: (all-reduced, or reduce-scattered onto shards), in float32, so rounding differences only; 1e-5 relative holds
#: them with room.
TOLERANCE = 1e-5


def fixed_batches():
    """STEPS batches of long and short sequences, each with its own rewards (so each step's gradient differs)."""
    out = []
    for step in range(STEPS):
        batch = mixed_batch()
        g = torch.Generator().manual_seed(step)
        batch.advantages = torch.randn(batch.advantages.shape, generator=g)
        batch.behaviour_logprobs = batch.behaviour_logprobs - 0.1 * step
        out.append(batch)
    return out
