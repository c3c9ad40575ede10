"""The teacher stage (on-policy distillation): scored trajectories in, teacher log-probs on every student token out.

The teacher scores the student's own samples, so it must read the same token
ids: a teacher whose tokenizer differs from the student's is refused at start
with a clear error rather than producing log-probs of the wrong tokens.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from rlstream.config import LoopSettings, knob
from rlstream.errors import UserError
from rlstream.models.loading import check_folder, load_model
from rlstream.policy.watcher import PolicyWatcher
from rlstream.policy.weights import PolicyWeights, tokenizer_hash
from rlstream.runtime.stage import Incoming, Output, Stage, StageContext
from rlstream.schemas.headers import now_ms
from rlstream.schemas.records import ScoredTrajectory, TeacherFeedback

log = logging.getLogger(__name__)


class TokenizerMismatch(UserError):
    """Teacher and student tokenize differently: distillation on token ids would be meaningless."""


@dataclass(frozen=True)
class TeacherSettings:
    """The teacher stage's knobs."""

    ROLE: ClassVar[str] = "TEACHER"

    teacher: str = knob("", "Teacher model: a Hugging Face folder or hub id; '' follows the policy itself")
    dtype: str = knob("auto", "Teacher dtype: auto (the checkpoint's own), bf16, fp16, fp32",
                      choices=("auto", "bf16", "fp16", "fp32"))
    teacher_version: str = knob("", "Version label written on feedback ('' = folder name or policy version)")
    threads: int = knob(1, "Torch threads for this process")
    wait_policy_s: float = knob(600.0, "How long to wait at start for the student's first policy version")


def check_tokenizers(teacher_folder: Path, student_hash: str) -> str:
    """The teacher's tokenizer hash, or TokenizerMismatch when it differs from the student's."""
    teacher_hash = tokenizer_hash(teacher_folder)
    if student_hash and teacher_hash != student_hash:
        raise TokenizerMismatch(
            f"teacher tokenizer ({teacher_folder}, hash {teacher_hash}) differs from the student's (hash "
            f"{student_hash}); on-policy distillation needs the same tokenizer — use a teacher of the same family")
    return teacher_hash


class TeacherStage(Stage):
    """Adds the teacher's per-token log-probs (0 where the student did not act) to each scored trajectory."""

    name = "teacher"
    inputs = ("rewards",)

    def __init__(self, settings: TeacherSettings = TeacherSettings(), loop: LoopSettings = LoopSettings()):
        self.loop = loop
        self.settings = settings
        self.model = None
        self.watcher: PolicyWatcher | None = None

    def before_poll(self, ctx: StageContext) -> None:
        if self.model is not None:
            return
        import torch
        torch.set_num_threads(max(1, self.settings.threads))
        self.torch = torch
        self.watcher = PolicyWatcher(ctx.kafka.client_config(), ctx.kafka.run, self.loop.policy)
        if not self.watcher.wait_for(0, self.settings.wait_policy_s):
            raise UserError(f"no {self.loop.policy} policy announced within {self.settings.wait_policy_s}s; "
                            "is the trainer running for this run?")
        student = self.watcher.latest
        weights = PolicyWeights(self.loop.home_path / "weights-cache", ctx.kafka.client_config(), ctx.kafka.run)
        folder = check_folder(self.settings.teacher, "--teacher") if self.settings.teacher else weights.folder(student)
        check_tokenizers(folder, student.tokenizer_hash)
        self.version = self.settings.teacher_version or (folder.name if self.settings.teacher else
                                                         f"{student.policy}-v{student.version}")
        self.model = load_model(folder, self.settings.dtype, flag="--teacher").eval()
        log.info("teacher %s loaded from %s", self.version, folder)

    def handle_batch(self, items: list[Incoming]) -> list[list[Output]]:
        from rlstream.models.logprobs import token_logprobs
        torch = self.torch
        started = time.perf_counter()
        rows = []
        for it in items:
            traj = it.record.trajectory
            rows.append(traj.task.prompt_token_ids + traj.token_ids)
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            attn[i, :len(r)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            # Scored at the student's sampling temperature, like the trainer scores the student.
            temperature = items[0].record.trajectory.task.sampling.temperature or 1.0
            lps = token_logprobs(logits.float() / temperature, ids[:, 1:])
        latency = (time.perf_counter() - started) * 1000 / len(items)
        out = []
        for i, it in enumerate(items):
            scored: ScoredTrajectory = it.record
            traj = scored.trajectory
            seq_lp, p = lps[i].tolist(), len(traj.task.prompt_token_ids)
            # Response token j sits at p + j; the logits at p + j - 1 predicted it.
            teacher = [seq_lp[p + j - 1] if m and p + j >= 1 else 0.0 for j, m in enumerate(traj.loss_mask)]
            traj.stage_times["teacher.end"] = now_ms()
            out.append([Output("feedback", it.key, TeacherFeedback(scored, self.version, teacher,
                                                                   teacher_model=self.settings.teacher,
                                                                   latency_ms=latency))])
        return out

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
