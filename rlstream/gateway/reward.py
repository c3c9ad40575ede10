"""``posted``: the reward function of gateway episodes whose harness posted a reward with the close.

    rlstream run reward --run R --reward rlstream.gateway.reward:posted

The gateway writes the posted number into the trajectory's ``task.metadata['gateway.reward']``; a trajectory
without one (closed without a reward, or not from the gateway) is a judge_error, never a silent zero.
"""
from __future__ import annotations

from rlstream.gateway.sessions import REWARD_KEY
from rlstream.schemas.records import Trajectory


def posted(trajectory: Trajectory) -> float:
    """The reward posted to the gateway for this trajectory's session."""
    raw = trajectory.task.metadata.get(REWARD_KEY)
    if raw is None:
        raise ValueError(f"{trajectory.trajectory_id}: no reward was posted with its close (POST "
                         "/v1/sessions/{id}/close {\"reward\": x}); score it with another reward function")
    return float(raw)
