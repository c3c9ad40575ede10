"""``rlstream replay --teacher-version V``: the teacher stage over past scored trajectories, as another teacher.

The teacher's own logic under a replay's name and consumer group (``<run>.replay.teacher.<version>``), over a
bounded range of ``rewards`` (``stages/replay.py`` plans the range and runs it): its feedback goes to the feedback
topic beside the first teacher's, each record with its teacher version, so both are archived side by side and a
trainer takes either with ``--teacher-version``.
"""
from __future__ import annotations

from rlstream.config import LoopSettings
from rlstream.runtime.stage import Incoming, Output, Stage, StageContext
from rlstream.stages.teacher.settings import TeacherSettings


class TeacherReplayStage(Stage):
    """The teacher stage under a replay's name, group and policy-version range."""

    inputs = ("rewards",)

    def __init__(self, settings: TeacherSettings, loop: LoopSettings = LoopSettings(),
                 versions: tuple[int | None, int | None] = (None, None)):
        if not settings.teacher_version:
            raise ValueError("--teacher-version is required: replayed feedback needs a teacher version of its own")
        if not settings.teacher:
            raise ValueError("--teacher is required: a replay scores with a given teacher model, not the policy")
        self.name = f"replay.teacher.{settings.teacher_version}"
        self.versions = versions
        from rlstream.stages.teacher.stage import TeacherStage  # torch: only when a replay runs
        self.teacher = TeacherStage(settings, loop)  # the teacher's logic, not a copy of it
        self.scored = self.skipped = 0

    def wanted(self, policy_version: int) -> bool:
        lo, hi = self.versions
        return (lo is None or policy_version >= lo) and (hi is None or policy_version <= hi)

    def before_poll(self, ctx: StageContext) -> None:
        self.teacher.before_poll(ctx)

    def handle_batch(self, items: list[Incoming]) -> list[list[Output] | Exception]:
        keep = [i for i, it in enumerate(items) if self.wanted(it.policy_version)]
        results: list = [[] for _ in items]  # outside the range: consumed (its offset commits), not scored
        for i, result in zip(keep, self.teacher.handle_batch([items[i] for i in keep]) if keep else []):
            results[i] = result
        self.scored += len(keep)
        self.skipped += len(items) - len(keep)
        return results

    def close(self) -> None:
        self.teacher.close()
