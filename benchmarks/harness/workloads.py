"""Workloads of the benchmarks: reward functions (stage processes load them by dotted path,
``benchmarks.harness.workloads:<name>``), the seeded latency and length draws, and the trajectories the bus
benchmarks produce.

Every random draw is seeded by the sample's id, so two runs of one workload see the same latencies and lengths.
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import os
import random
import time

from rlstream.schemas import headers as hdr
from rlstream.schemas.records import SamplingParams, Task, Trajectory, Turn
from rlstream.sources.tasks import clean_response

# Knobs come from the environment: a reward loaded by dotted path in its own process takes no arguments.
MEDIAN_S = float(os.environ.get("BENCH_LATENCY_MEDIAN_S", "0.1"))
SIGMA = float(os.environ.get("BENCH_LATENCY_SIGMA", "1.5"))
CAP_S = float(os.environ.get("BENCH_LATENCY_CAP_S", "10"))
FIXED_S = float(os.environ.get("BENCH_REWARD_LATENCY_S", "0.2"))
JUDGE_S = float(os.environ.get("BENCH_JUDGE_S", "0.05"))

#: max_tokens buckets and the Pareto(alpha=1.2, x_min=4) mass of each (P(L >= x) = (4/x)^1.2), cut at the
#: tiny model's 64-token context (5 prompt tokens). Buckets, not every integer: rollout batches by sampling params.
LENGTH_BUCKETS = (4, 8, 16, 32, 59)
_ALPHA = 1.2
_TAIL = [(4 / x) ** _ALPHA for x in LENGTH_BUCKETS] + [0.0]
LENGTH_PROBS = tuple(_TAIL[i] - _TAIL[i + 1] if i < len(LENGTH_BUCKETS) - 1 else _TAIL[i]
                     for i in range(len(LENGTH_BUCKETS)))


def _rng(key: str) -> random.Random:
    """A generator seeded by ``key``: the same draws for the same sample in every run."""
    return random.Random(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little"))


def lognormal_latency(key: str, median_s: float = MEDIAN_S, sigma: float = SIGMA, cap_s: float = CAP_S) -> float:
    """Seconds of judge latency for one sample: lognormal(ln median, sigma), capped below the handler timeout."""
    return min(cap_s, median_s * math.exp(sigma * _rng("lat:" + key).gauss(0.0, 1.0)))


def max_tokens_for(task_id: str) -> int:
    """A task's generation budget, drawn from LENGTH_BUCKETS with Pareto weights."""
    return _rng("len:" + task_id).choices(LENGTH_BUCKETS, weights=LENGTH_PROBS)[0]


def reverse_score(response: str, answer: str) -> float:
    """The reverse task's verifier, the same for rlstream and TRL: exact match of the cleaned response."""
    return 1.0 if clean_response(response) == answer.strip() else 0.0


def _response(trajectory) -> str:
    """The text the verifier judges: the last turn's, else the whole response."""
    return trajectory.turns[-1].text if trajectory.turns else trajectory.response


def make_trajectory(i: int, n_tokens: int = 4) -> Trajectory:
    """Trajectory ``traj-<i>`` of task ``task-<i>`` (reverse "abc", answered right): one action turn of ``n_tokens``
    tokens; what the bus benchmarks push through a stage."""
    task = Task(task_id=f"task-{i}", group_id=f"task-{i}", task_name="reverse", env_name="single", env_version="1",
                prompt="abc>", sampling=SamplingParams(), created_at=hdr.now_ms(), answer="cba", group_size=2)
    return Trajectory(trajectory_id=f"traj-{i}", group_id=task.group_id, sample_index=0, task=task, response="cba",
                      min_policy_version=0, max_policy_version=0, token_ids=list(range(n_tokens)),
                      loss_mask=[1] * n_tokens, behaviour_logprobs=[-1.0] * n_tokens,
                      turns=[Turn("action", "cba", 0, n_tokens, policy_version=0)])


# -- rlstream reward functions (one Trajectory each) ----------------------------------------------------

def constant(trajectory) -> float:
    """A reward that costs nothing, so a hop measures the bus."""
    return 1.0


def exact(trajectory) -> float:
    """No added latency."""
    return reverse_score(_response(trajectory), trajectory.task.answer)


async def heavy_tailed_reward(trajectory) -> float:
    """Exact match after a lognormal judge latency (seeded by the trajectory id)."""
    await asyncio.sleep(lognormal_latency(trajectory.trajectory_id))
    return reverse_score(_response(trajectory), trajectory.task.answer)


async def fixed_latency_reward(trajectory) -> float:
    """Exact match after BENCH_REWARD_LATENCY_S (a slow verifier or sandbox)."""
    await asyncio.sleep(FIXED_S)
    return reverse_score(_response(trajectory), trajectory.task.answer)


async def io_judge(trajectory) -> float:
    """An I/O-bound judge: BENCH_JUDGE_S of waiting, no CPU."""
    await asyncio.sleep(JUDGE_S)
    return 1.0


def cpu_judge(trajectory) -> float:
    """A CPU-bound judge: BENCH_JUDGE_S of this thread's CPU time (a verifier that computes), holding the GIL, so
    one process scores on one core whatever its --concurrency."""
    end = time.thread_time() + JUDGE_S
    while time.thread_time() < end:
        sum(range(200))
    return 1.0


# -- TRL reward functions (a batch of completions; dataset columns arrive as keyword lists) -------------

def trl_exact(prompts, completions, answer, **_) -> list[float]:
    """Exact match, no added latency."""
    return [reverse_score(c, a) for c, a in zip(completions, answer)]


async def trl_fixed_latency(prompts, completions, answer, **_) -> list[float]:
    """Every completion judged concurrently: the batch waits BENCH_REWARD_LATENCY_S once (TRL's best case)."""
    async def one(c, a):
        """One completion, judged after the fixed latency."""
        await asyncio.sleep(FIXED_S)
        return reverse_score(c, a)
    return list(await asyncio.gather(*(one(c, a) for c, a in zip(completions, answer))))


_trl_judged = itertools.count()


async def trl_heavy_tailed(prompts, completions, answer, **_) -> list[float]:
    """Every completion judged concurrently after its own lognormal latency (the goodput benchmark's judge), keyed by
    a running count since TRL's completions carry no id: the batch waits for its slowest (TRL's best case)."""
    async def one(key, c, a):
        """One completion, judged after its lognormal latency."""
        await asyncio.sleep(lognormal_latency(key))
        return reverse_score(c, a)
    return list(await asyncio.gather(*(one(f"trl-{next(_trl_judged)}", c, a) for c, a in zip(completions, answer))))


def trl_fixed_latency_sync(prompts, completions, answer, **_) -> list[float]:
    """The same judge called synchronously, one completion after another (TRL's default reward call)."""
    out = []
    for c, a in zip(completions, answer):
        time.sleep(FIXED_S)
        out.append(reverse_score(c, a))
    return out
