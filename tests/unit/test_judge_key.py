"""The judge's idempotency key through the real reward stage: the same for every judging of one trajectory under one
reward version (what a redo after a SIGKILL repeats), another under a new version or for another trajectory."""
from __future__ import annotations

import asyncio

from rlstream.rewards import idempotency_key
from rlstream.runtime.stage import Incoming
from rlstream.schemas import headers as hdr
from rlstream.stages.reward import RewardSettings, RewardStage
from tests.helpers.kafka import make_trajectory

HERE = "tests.unit.test_judge_key"
KEYS: list[str] = []  # what the judges below were given, in order


def keyed(trajectory):
    KEYS.append(idempotency_key(trajectory))
    return 1.0


async def async_keyed(trajectory):
    await asyncio.sleep(0)
    KEYS.append(idempotency_key(trajectory))
    return 1.0


def judge(fn: str, version: str, *trajectories) -> list[str]:
    """The keys ``fn`` saw judging ``trajectories`` concurrently in one reward stage under ``version``."""
    KEYS.clear()
    stage = RewardStage(RewardSettings(reward=f"{HERE}:{fn}", reward_version=version))

    async def run():
        return await asyncio.gather(*(stage.handle(Incoming("trajectories", 0, i, b"g", {}, 0, t))
                                      for i, t in enumerate(trajectories)))
    asyncio.run(run())
    return sorted(KEYS)


def test_a_judgement_repeated_gets_its_key_again_and_another_judgement_another():
    a, b = make_trajectory(1), make_trajectory(2)
    for t in (a, b):
        t.task.trace_id = hdr.new_traceparent()
    for fn in ("keyed", "async_keyed"):
        first = judge(fn, "v1", a, b)
        assert len(set(first)) == 2, "two trajectories, two keys"
        assert judge(fn, "v1", a, b) == first, "judged again (a redo): the same keys"
        again = judge(fn, "v2", a, b)
        assert set(again).isdisjoint(first), "a new reward version is a new judgement"
    # The same ids in another run (a new trace from the source): other keys.
    other = make_trajectory(1)
    other.task.trace_id = hdr.new_traceparent()
    assert judge("keyed", "v1", other)[0] not in judge("keyed", "v1", a)
