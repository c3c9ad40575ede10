"""Misbehaving environments and reward functions for the bad-input tests.

``python -m tests.bad_envs run env ...`` (from the repository root) is ``rlstream run env ...`` with these
environments registered; reward functions load by dotted path as usual (``tests.bad_envs:unencodable``).
"""
import sys
import time

from rlstream.rewards import RewardResult, exact_match
from rlstream.schemas.records import Trajectory
from rlstream.stages.env import Environment, StepResult, register_environment


class HangingEnv(Environment):
    """Its own code never returns (a deadlock, a stuck remote call): the handler timeout must catch it."""

    name = "hang"

    def step(self, episode):
        time.sleep(3600)


class RaisingEnv(Environment):
    """Its own code raises: the episode ends as a failed trajectory (env_error)."""

    name = "raise"

    def step(self, episode):
        raise RuntimeError("environment crashed")


class SurrogateEnv(Environment):
    """Answers with bytes decoded by surrogateescape: text that no UTF-8 encoder accepts."""

    name = "surrogate"

    def step(self, episode):
        return StepResult(done=False, observation=b"\xff\xfe tool said this\n".decode("utf-8", "surrogateescape"))


def unencodable(trajectory: Trajectory):
    """A reward whose violation text cannot be encoded (a lone surrogate) when the response says so."""
    if trajectory.response == "surrogate":
        return RewardResult(1.0, violations=["\udcff"])
    return exact_match(trajectory)


for _env in (HangingEnv, RaisingEnv, SurrogateEnv):
    register_environment(_env.name, lambda sandbox, cls=_env: cls())

if __name__ == "__main__":
    from rlstream.cli import main
    sys.exit(main(sys.argv[1:]))
