"""Reward functions that tests load by dotted path, ``tests.reward_fns:<name>`` (stage processes start in the
repository root)."""
import random
import time

from rlstream.rewards import exact_match


def slow(trajectory):
    """Exact match after a short sleep, so a SIGKILL lands in the middle of a batch."""
    time.sleep(0.05)
    return exact_match(trajectory)


def jittery(trajectory):
    """Exact match after a heavy-tailed wait (most short, some 20x longer), seeded by the trajectory id."""
    rnd = random.Random(trajectory.trajectory_id)
    time.sleep(0.5 if rnd.random() < 0.05 else rnd.uniform(0.0, 0.05))
    return exact_match(trajectory)


def picky(trajectory):
    """Misbehaves on demand, keyed by the response text."""
    response = trajectory.response
    if response == "raise":
        raise RuntimeError("judge crashed")
    if response == "hang":
        time.sleep(3600)
    if response == "nan":
        return float("nan")
    if response == "inf":
        return {"exact": float("inf")}
    if response == "wrongtype":
        return "one point"
    return exact_match(trajectory)


def slow_picky(trajectory):
    """``picky`` after a short sleep, so a SIGKILL lands while judgements are in flight."""
    time.sleep(0.05)
    return picky(trajectory)


def partial_credit(trajectory):
    """The 'new reward' of the replay tests: the share of answer characters in the right place (exact match gave 0
    or 1)."""
    answer, response = trajectory.task.answer, trajectory.response
    return {"chars": sum(a == b for a, b in zip(answer, response)) / len(answer)}


def token_checksum(trajectory):
    """A score in [0, 1) from the sampled token ids: two different samples almost never tie, so a group's
    advantages are not all zero and every update moves the weights."""
    return {"checksum": (sum(i * t for i, t in enumerate(trajectory.token_ids, 1)) % 997) / 997}


def per_turn(trajectory):
    """Exact match, and one score per action turn: 1 for a turn whose text is ``ok``, else 0."""
    from rlstream.rewards import RewardResult
    return RewardResult(exact_match(trajectory).total,
                        turn_scores=[float(t.text == "ok") for t in trajectory.turns if t.role == "action"])


def miscounted_turns(trajectory):
    """A judge with a bug: one turn score too many."""
    from rlstream.rewards import RewardResult
    return RewardResult(1.0, turn_scores=[1.0] * (1 + sum(t.role == "action" for t in trajectory.turns)))
