"""The teacher stage (on-policy distillation): scored trajectories in, the teacher's signal on every student token
out, on the feedback topic.

- ``stage``: the stage and its knobs: loading the teacher (fixed, with a version of its own, or following the
  policy and reloading on each PolicyVersion), the version header, the timeout that sends a sample on without
  feedback.
- ``scoring``: the teacher's forward over the student's tokens: the sampled token's log-prob and the top-k form.
- ``tokenizers``: teacher and student must share a tokenizer; a teacher that does not is refused at start.
- ``replay``: ``rlstream replay --teacher-version V``, the teacher over past scored trajectories.

The trainer's side of the signal (losses, admission of feedback, staleness per loss) is ``rlstream.trainer.distill``.
"""
from rlstream.stages.teacher.stage import TeacherSettings, TeacherStage
from rlstream.stages.teacher.tokenizers import TokenizerMismatch, check_tokenizers

__all__ = ["TeacherSettings", "TeacherStage", "TokenizerMismatch", "check_tokenizers"]
