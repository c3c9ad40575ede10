"""The teacher stage: each scored trajectory goes on to ``feedback`` with the teacher's signal on its tokens.

A fixed teacher (``--teacher FOLDER``) is loaded once, with a version of its own (``--teacher-version``, default
the folder's name); a teacher that follows the policy (no ``--teacher``) loads each PolicyVersion the trainer
announces, between batches, and its version is the policy's (a LoRA policy's base loaded once, each version's
adapter merged over it). Either way the version is on every feedback record, in the record (archived) and in the
``teacher_version`` header.

A batch has ``--timeout-s``: samples the teacher has not scored by then go on with status ``timeout`` and empty
arrays, never a half-filled signal; a trainer whose loss needs the teacher refuses them.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from rlstream import metrics
from rlstream.config import LoopSettings
from rlstream.errors import UserError
from rlstream.models.devices import check_vllm_device, resolve_device, resolve_threads
from rlstream.models.loading import check_folder, flash_attn_installed, load_model, resolve_attention
from rlstream.engine.adapters import AdaptedModel
from rlstream.engine.follower import PolicyFollower
from rlstream.policy.weights import PolicyWeights, tokenizer_hash
from rlstream.runtime.stage import Incoming, InvalidRecord, Output, Stage, StageContext
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import PolicyVersion, ScoredTrajectory, TeacherFeedback
from rlstream.stages.teacher.scoring import TorchScorer, VllmScorer, response_feedback
from rlstream.schemas.records import MAX_TOP_K
from rlstream.stages.teacher.settings import TeacherSettings
from rlstream.stages.teacher.tokenizers import Aligner, AlignmentFailed, check_tokenizers, make_aligner

log = logging.getLogger(__name__)


class TeacherStage(Stage):
    """Adds the teacher's per-token log-probs (0 where the student did not act), and its top-k, to each sample."""

    name = "teacher"
    inputs = ("rewards",)

    def __init__(self, settings: TeacherSettings = TeacherSettings(), loop: LoopSettings = LoopSettings()):
        if not 0 <= settings.top_k <= MAX_TOP_K:
            raise ValueError(f"--top-k {settings.top_k}: the teacher sends at most {MAX_TOP_K} tokens per position")
        if settings.timeout_s <= 0:
            raise ValueError(f"--timeout-s {settings.timeout_s}: a batch's time budget must be positive")
        self.loop = loop
        self.settings = settings
        self.scorer: TorchScorer | VllmScorer | None = None
        # The student's announcements; a following teacher also loads each version by them.
        self.follower = PolicyFollower(self.name, loop.policy, PolicyWeights(loop.home_path / "weights-cache"),
                                       settings.retry_load_s)
        self.aligner: Aligner | None = None  # a teacher with another tokenizer (--align-tokenizers)
        self._adapted: AdaptedModel | None = None  # a LoRA policy's base, the held version's adapter merged in
        self.version = ""

    @property
    def following(self) -> bool:
        """Whether the teacher is the policy itself (reloaded on each version)."""
        return not (self.settings.teacher or self.settings.teacher_url)

    # -- loading ---------------------------------------------------------------------------------------------

    def prepare(self, ctx: StageContext) -> None:
        if self.scorer is None:
            self._start(ctx)  # a standby's teacher holds the newest version; it follows again once it takes over

    def before_poll(self, ctx: StageContext) -> None:
        if self.scorer is None:
            self._start(ctx)
        elif self.following:
            self.follower.advance(self._follow)  # between batches: a version that will not load keeps the one held

    def _start(self, ctx: StageContext) -> None:
        import torch
        torch.set_num_threads(resolve_threads(self.settings.threads))
        self.device = resolve_device(self.settings.device)
        self.follower.connect(ctx.kafka.client_config(), ctx.kafka.run)
        self.weights = self.follower.weights
        if self.following:
            pv, _ = self.follower.first(self.settings.wait_policy_s, base=False)
            self.follower.held(self._follow(pv))
            return
        student = self.follower.announced(self.settings.wait_policy_s)
        if self.settings.teacher_url:
            self._connect(student)
            return
        folder = check_folder(self.settings.teacher, "--teacher")
        name = f"{student.policy} v{student.version}"
        if self.settings.align_tokenizers and student.tokenizer_hash and \
                tokenizer_hash(Path(folder)) != student.tokenizer_hash:
            if self.settings.top_k:
                raise UserError("--top-k needs the student's tokenizer: a teacher's top-k tokens are not the "
                                "student's; drop --top-k with --align-tokenizers")
            self.aligner = make_aligner(self.weights.folder(student), Path(folder), name)
            log.info("teacher tokens aligned with the student's through the text")
        else:
            check_tokenizers(folder, student.tokenizer_hash, name)
        self._load(folder, self.settings.teacher_version or Path(folder).name)

    def _connect(self, student: PolicyVersion) -> None:
        """The teacher as a server (``--teacher-url``): reachable, and tokenizing as the student does."""
        from rlstream.models.loading import load_tokenizer
        from rlstream.stages.teacher.server import ServerScorer
        s = self.settings
        if s.align_tokenizers:
            raise UserError("--align-tokenizers needs the teacher's folder (--teacher), not --teacher-url")
        if s.backend != "transformers" or s.teacher:
            raise UserError("--teacher-url scores on the server: give it without --teacher and --backend")
        scorer = ServerScorer(s.teacher_url, s.teacher_served_model, s.teacher_in_flight, s.timeout_s)
        tokenizer = load_tokenizer(self.weights.folder(student), flag="the student's")
        scorer.check_tokenizer(tokenizer, f"{student.policy} v{student.version}")
        self.scorer, self.vocab, self.device = scorer, len(tokenizer), s.teacher_url
        self.version = s.teacher_version or scorer.served
        log.info("teacher %s served at %s", self.version, s.teacher_url)

    def _follow(self, pv: PolicyVersion) -> int:
        """Load the policy's version ``pv`` as the teacher, and return it; a load error is the follower's to retry
        (``rlstream.engine.follower``: the teacher keeps the version it holds meanwhile)."""
        label = f"{self.settings.teacher_version or pv.policy}-v{pv.version}"
        if pv.base_hash:
            self._follow_adapter(pv, label)
        else:
            self._adapted = None  # whole weights: a model of their own, no adapter over it
            self._load(self.weights.folder(pv), label)
        return pv.version

    def _follow_adapter(self, pv: PolicyVersion, label: str) -> None:
        """A LoRA version: the teacher's model is built once from the base the version names, and each version's
        adapter is merged over it (``engine/adapters.py``), only ever over the base it names and checked by its load
        probe, as in rollout (``PolicyWeights``)."""
        if self.settings.backend != "transformers":
            raise UserError(f"the teacher follows {pv.policy}, whose v{pv.version} is a LoRA adapter, and the "
                            f"{self.settings.backend} teacher cannot apply adapters: run it with --backend "
                            "transformers, give it --teacher FOLDER, or train without --lora-rank")
        if self._adapted is not None:
            self.weights.load(pv, self._adapted)  # BaseMismatch, a probe refusal: the follower's to retry
        else:
            held = (self.scorer, self.vocab if self.scorer is not None else None, self.version)
            try:
                self._load(self.weights.engine_folder(pv), label)
                adapted = AdaptedModel(self.scorer.model)
                self.weights.adopt(pv, adapted)
                # The first version: nothing else to serve, so a probe refusal stops the teacher; later, it is retried.
                (self.weights.verify_first if held[0] is None else self.weights.verify)(pv, adapted)
            except Exception:  # the base alone is no version: the teacher keeps scoring with what it held
                self.scorer, self.vocab, self.version = held
                raise
            self._adapted = adapted
        self.version = label
        log.info("teacher %s: the adapter of %s v%d over its base", label, pv.policy, pv.version)

    def _load(self, folder, version: str) -> None:
        s = self.settings
        if s.backend == "vllm":
            self.vocab = vocab_size(folder)
            if self.scorer is None:
                check_vllm_device(s.device)
                self.scorer = VllmScorer(folder, s.dtype, resolve_threads(s.threads), s.batch_tokens,
                                         s.gpu_memory_utilization)
                self.device = "vllm"
            else:
                self.scorer.reload(folder)  # the engine stays; its weights change
        else:
            model = load_model(folder, s.dtype, flag="--teacher", attn_implementation=resolve_attention(
                s.attn_implementation, self.device.type, self.device.type == "cuda" and flash_attn_installed()))
            self.vocab = int(model.config.vocab_size)
            self.scorer = TorchScorer(model, self.device, s.batch_tokens)
        if s.top_k > self.vocab:
            raise UserError(f"--top-k {s.top_k} exceeds the teacher's vocabulary of {self.vocab} tokens")
        self.version = version
        log.info("teacher %s loaded from %s on %s", version, folder, self.device)

    # -- scoring ---------------------------------------------------------------------------------------------

    def check(self, scored: ScoredTrajectory) -> None:
        """InvalidRecord (dead-lettered, with what is wrong) for a sample the teacher cannot score."""
        traj = scored.trajectory
        if len(traj.loss_mask) != len(traj.token_ids):
            raise InvalidRecord(f"trajectory {traj.trajectory_id}: loss_mask has {len(traj.loss_mask)} entries but "
                                f"token_ids {len(traj.token_ids)}")
        temperature = traj.task.sampling.temperature or 1.0
        if hasattr(self.scorer, "supports") and not self.scorer.supports(temperature):
            raise InvalidRecord(f"trajectory {traj.trajectory_id} was sampled at temperature {temperature}; the vLLM "
                                "teacher scores at temperature 1 (use --backend transformers)")
        ids = traj.task.prompt_token_ids + traj.token_ids
        if self.aligner is None and ids and not 0 <= min(ids) <= max(ids) < self.vocab:
            raise InvalidRecord(f"trajectory {traj.trajectory_id}: token ids outside the teacher's vocabulary of "
                                f"{self.vocab} (min {min(ids)}, max {max(ids)})")

    def handle_batch(self, items: list[Incoming]) -> list[list[Output] | Exception]:
        started = time.monotonic()
        deadline = started + self.settings.timeout_s
        k = self.settings.top_k
        results: list = [None] * len(items)
        valid: dict[float, list[int]] = {}  # temperature -> rows: each is scored at its own sampling temperature
        for i, it in enumerate(items):
            try:
                self.check(it.record)
            except InvalidRecord as exc:
                results[i] = exc
                continue
            valid.setdefault(it.record.trajectory.task.sampling.temperature or 1.0, []).append(i)
        scores: dict[int, tuple | None] = {}
        aligned: dict[int, object] = {}  # row -> its Alignment, or AlignmentFailed
        for temperature, rows in valid.items():
            seqs = {i: self._row(items[i].record, aligned, i) for i in rows}
            todo = [i for i in rows if seqs[i] is not None]
            scores.update(zip(todo, self.scorer.score([seqs[i] for i in todo], temperature, k, deadline)))
        latency = (time.monotonic() - started) * 1000 / max(1, len(items))
        headers = ((hdr.TEACHER_VERSION, self.version),)
        for i in (i for rows in valid.values() for i in rows):
            if isinstance(scores.get(i), ValueError):  # a server that refused the sequence says why
                results[i] = InvalidRecord(f"trajectory {items[i].record.trajectory.trajectory_id}: {scores[i]}")
                continue
            fb = self._feedback(items[i].record, scores.get(i), k, latency, aligned.get(i))
            results[i] = [Output("feedback", items[i].key, fb, extra_headers=headers)]
        return results

    def _row(self, scored: ScoredTrajectory, aligned: dict, i: int) -> list[int] | None:
        """The ids the teacher reads: the student's, or their alignment's teacher ids (None: it failed)."""
        traj = scored.trajectory
        if self.aligner is None:
            return traj.task.prompt_token_ids + traj.token_ids
        try:
            aligned[i] = self.aligner.align(traj.task.prompt_token_ids, traj.token_ids, traj.loss_mask)
            return aligned[i].teacher_ids
        except AlignmentFailed as failed:
            aligned[i] = failed
            return None

    def _feedback(self, scored: ScoredTrajectory, score: tuple | None, k: int, latency: float,
                  alignment=None) -> TeacherFeedback:
        traj = scored.trajectory
        traj.stage_times["teacher.end"] = hdr.now_ms()
        common = dict(teacher_model=self.settings.teacher or self.settings.teacher_url or self.loop.policy, latency_ms=latency,
                      teacher_device=str(self.device))
        if isinstance(alignment, AlignmentFailed):  # recorded with its class, never guessed
            metrics.FAILURES.labels("teacher", f"alignment_{alignment.failure_class}").inc()
            return TeacherFeedback(scored, self.version, [], status="alignment_failed",
                                   failure_class=alignment.failure_class, **common)
        if score is None:  # past the deadline: on without a signal, never with part of one
            metrics.FAILURES.labels("teacher", "teacher_timeout").inc()
            return TeacherFeedback(scored, self.version, [], status="timeout", **common)
        if alignment is not None:
            return TeacherFeedback(scored, self.version, alignment.student_logprobs(score[0]), **common)
        arrays = response_feedback(score[0], score[1], score[2], len(traj.task.prompt_token_ids), traj.loss_mask, k)
        return TeacherFeedback(scored, self.version, arrays.logprobs, teacher_top_k=k, teacher_topk_ids=arrays.topk_ids,
                               teacher_topk_logprobs=arrays.topk_logprobs, **common)

    def close(self) -> None:
        self.follower.close()
        if hasattr(self.scorer, "close"):
            self.scorer.close()


def vocab_size(folder) -> int:
    """The vocabulary size a model folder's config names (its text model's, for a multimodal config)."""
    import json
    config = json.loads((Path(folder) / "config.json").read_text())
    return int(config.get("text_config", config)["vocab_size"])
