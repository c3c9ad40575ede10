"""A policy version announced as the trainer announces it, for tests of its followers (rollout, the gateway)
without a trainer."""
from __future__ import annotations

import shutil
from pathlib import Path

from rlstream.policy.weights import WeightStore
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import PolicyVersion, Reward, ScoredTrajectory
from tests.helpers.kafka import make_trajectory, produce


def publish_version(bootstrap: str, run: str, folder: Path, root: Path, version: int = 0) -> PolicyVersion:
    """Put the model ``folder`` in a weight store under ``root`` as ``version`` and announce it."""
    uri = WeightStore(str(root)).put("policy", version, lambda out: shutil.copytree(folder, out, dirs_exist_ok=True))
    now = hdr.now_ms()
    pv = PolicyVersion("policy", version, uri, created_at=now, published_at=now)
    produce(bootstrap, run, "policy-versions", [(b"policy", pv, hdr.build(version, hdr.new_traceparent()))])
    return pv


def scored_group(gid: int, version: int) -> list[tuple]:
    """A group of two scored samples of the reverse task (rewards 1 and 0) sampled by ``version``, as produce()'s
    items: what a trainer needs for one step without rollout, env or reward running."""
    items = []
    for i, r in enumerate((1.0, 0.0)):
        traj = make_trajectory(gid * 100 + i, group=gid, response="cba" if r else "abc", n_tokens=4)
        traj.task.group_size = 2
        traj.task.prompt_token_ids = [1, 5, 6, 7, 40]
        items.append((f"task-{gid}".encode(), ScoredTrajectory(traj, Reward(total=r, reward_version="v1")),
                      hdr.build(version, hdr.new_traceparent(), "v1")))
    return items


def start_log_trainer(start_stage, bootstrap: str, run: str, home: Path):
    """A trainer process whose versions go through the weights log (an anchor every 2 versions), with its store under
    ``home``, taking 3 steps of one 2-sample group each (``scored_group``) from version 0 (no warm-up)."""
    return start_stage("trainer", bootstrap, run, "--home", str(home), "--weights", str(home / "weights"),
                       "--weights-transport", "kafka", "--weights-anchor-every", "2", "--warmup-steps", "0",
                       "--max-steps", "3", "--window-groups", "2", "--groups-per-step", "1", "--group-size", "2",
                       "--lr", "1e-2", "--eta", "8")
