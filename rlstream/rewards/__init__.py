"""Reward functions: the one signature every reward takes, and the built-in verifiers.

A reward function is given by its dotted path, ``package.module:function`` (or ``package.module.function``)::

    def reward(trajectory: Trajectory) -> float | dict[str, float] | RewardResult

It may be ``async`` (a remote judge). A dict is a breakdown whose values sum to the total; a ``RewardResult``
also carries violations and the verifier's and judge's versions. Raising ``InvalidRecord`` dead-letters the
trajectory with its reason. Built in: ``rlstream.rewards:exact_match``, ``rlstream.rewards:calculator_reward``.
"""
from rlstream.rewards.api import RewardResult, load_reward
from rlstream.rewards.builtin import calculator_reward, exact_match, normalise_answer

__all__ = ["RewardResult", "calculator_reward", "exact_match", "load_reward", "normalise_answer"]
