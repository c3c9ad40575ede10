"""The teacher stage (on-policy distillation): scored trajectories in, the teacher's signal on every student token
out, on the feedback topic.

- ``settings``: the knobs (no torch, for the command line).
- ``stage``: the stage: loading the teacher (fixed, with a version of its own, or following the
  policy and reloading on each PolicyVersion), the version header, the timeout that sends a sample on without
  feedback.
- ``scoring``: the teacher's forward over the student's tokens: the sampled token's log-prob and the top-k form.
- ``tokenizers``: teacher and student must share a tokenizer; a teacher that does not is refused at start.
- ``replay``: ``rlstream replay --teacher-version V``, the teacher over past scored trajectories.

The trainer's side of the signal: the losses in ``rlstream.trainer.distill``, the admission of feedback and the
staleness bound per loss in ``rlstream.trainer.gate``.
"""
from rlstream.stages.teacher.settings import MAX_TOP_K, TeacherSettings

__all__ = ["MAX_TOP_K", "TeacherSettings", "TeacherStage", "TokenizerMismatch", "check_tokenizers"]


def __getattr__(name: str):
    # The stage loads torch: imported when asked for, so that parsing a command line does not pay for it.
    if name == "TeacherStage":
        from rlstream.stages.teacher.stage import TeacherStage
        return TeacherStage
    if name in ("TokenizerMismatch", "check_tokenizers"):
        from rlstream.stages.teacher import tokenizers
        return getattr(tokenizers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
