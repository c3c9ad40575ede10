"""The real trainer service in a thread, with a spy on what reached each update, and the scored groups it trains
on, produced to the real broker's ``rewards``."""
from __future__ import annotations

import threading

from rlstream.config import KafkaSettings, LoopSettings
from rlstream.runtime.settings import RuntimeSettings
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import Reward, ScoredTrajectory
from rlstream.trainer.service import TrainerService, TrainerSettings
from tests.helpers.kafka import make_trajectory, produce, wait_for

#: Samples per group of ``scored_group``.
G = 4


class SpyTrainer(TrainerService):
    """The real trainer; the spy only records which groups reached each update, and counts its reads."""

    def __init__(self, settings, loop):
        super().__init__(settings, loop)
        self.trained: list[tuple[int, list[str]]] = []  # (version before the step, group ids)
        self.reads = 0  # passes of the serve loop's read (each followed by its step check)

    def _step(self, groups):
        self.trained.append((self.version, [g.group_id for g in groups]))
        super()._step(groups)

    def _consume_once(self, runtime):
        super()._consume_once(runtime)
        self.reads += 1

    def settled(self, timeout: float = 60.0) -> None:
        """Wait until what it has read has been through the step check: two more reads end, so the read in progress
        now and the step check after it are over."""
        seen = self.reads
        wait_for(lambda: self.reads >= seen + 2, timeout, "the trainer's next reads")


def scored_group(gid: int, rewards=(1.0, 0.0, 0.0, 1.0)):
    """G samples of the reverse task for group ``gid``, alike but for their rewards."""
    out = []
    for i, r in enumerate(rewards):
        traj = make_trajectory(gid * 100 + i, group=gid, response="cba" if r else "abc", n_tokens=4)
        traj.task.group_size = G
        traj.task.prompt_token_ids = [1, 5, 6, 7, 40]
        out.append(ScoredTrajectory(traj, Reward(total=r, reward_version="v1")))
    return out


def varied_group(gid: int):
    """A group whose samples' tokens differ (``scored_group``'s are alike, so their advantages cancel to a zero
    gradient)."""
    group = scored_group(gid)
    for i, sample in enumerate(group):
        sample.trajectory.token_ids = [7 + (i * 5 + k) % 30 for k in range(len(sample.trajectory.token_ids))]
    return group


def produce_groups(bootstrap, run, gids, version):
    produce(bootstrap, run, "rewards", [(f"task-{g}".encode(), s, hdr.build(version, hdr.new_traceparent(), "v1"))
                                        for g in gids for s in scored_group(g)])


def start(bootstrap, run, tmp_path, cls=SpyTrainer, **kw):
    """A ``cls`` (a SpyTrainer) serving in a thread; ``kw``: TrainerSettings beside the helpers' own."""
    settings = TrainerSettings(weights=str(tmp_path / "weights"), warmup_steps=0, window_groups=4, **kw)
    trainer = cls(settings, LoopSettings(groups_per_step=2, eta=1))
    thread = threading.Thread(target=trainer.serve, args=(KafkaSettings(bootstrap=bootstrap, run=run),
                                                          RuntimeSettings(poll_timeout_s=0.1)), daemon=True)
    thread.start()
    return trainer, thread


def wait_version(trainer, version, timeout=120):
    wait_for(lambda: trainer.version >= version, timeout, f"the trainer to reach v{version}", interval=0.2)
