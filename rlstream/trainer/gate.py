"""The gate every consumed sample passes before the trainer's window: whether it is trained on, and if not, why.

One decision per record, in this order, each rule stated where it is enforced below:
another reward or teacher version than this trainer's → ignored; the eval lane → skipped (never trained on);
teacher feedback the loss cannot use → refused (or dead-lettered when malformed); a reward that is no verdict on the
policy → refused; turn scores that do not fit the trajectory → dead-lettered; older than η → refused (or, under
``--stale-rule token``, its stale tokens masked). A refused sample's group completes without it.

Every admission rule lives here, the feedback checks too; the loss they feed is ``trainer/distill.py``'s.
"""
from __future__ import annotations

from dataclasses import dataclass

from rlstream import metrics
from rlstream.policy.staleness import StalenessCounter, StalenessFilter, mask_stale_tokens
from rlstream.rewards import NO_VERDICT, check_turn_scores
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import MAX_TOP_K, ScoredTrajectory, TeacherFeedback, Trajectory, is_eval
from rlstream.trainer.distill import DistillConfig, uses_teacher


@dataclass(frozen=True)
class Decision:
    """What the trainer does with one consumed sample."""

    #: add: into the window. refuse: not trained on, and its group completes without it. skip: a position done
    #: with that belongs to no group. ignore: not this trainer's to count (another reward or teacher version).
    action: str
    #: (reason, error): dead-letter the record as well.
    letter: tuple[str, str] | None = None


ADD, REFUSE, SKIP, IGNORE = Decision("add"), Decision("refuse"), Decision("skip"), Decision("ignore")


def trajectory_of(sample: ScoredTrajectory | TeacherFeedback) -> Trajectory:
    return sample.scored.trajectory if isinstance(sample, TeacherFeedback) else sample.trajectory


class SampleGate:
    """The trainer's admission rules and the staleness counts they keep (``counter``)."""

    def __init__(self, settings, eta: int, distill: DistillConfig):
        self.settings = settings  # TrainerSettings: reward_version, teacher_version, loss, stale_rule, opd_reverse_eta
        self.distill = distill
        self.filter = StalenessFilter(eta)
        # Samples whose loss assumes the current student drew them are held to a bound of their own (reverse_kl_bound_applies).
        self.reverse_filter = StalenessFilter(eta if settings.opd_reverse_eta < 0 else
                                              min(eta, settings.opd_reverse_eta))
        self.counter = StalenessCounter()

    def decide(self, sample, headers: dict[str, bytes], header_version: int, version: int) -> Decision:
        """The decision for ``sample`` (with its record's headers and policy-version header) at trainer ``version``."""
        # Compared as bytes: a null header is just another version, never a crash.
        if self.settings.reward_version and headers.get(hdr.REWARD_VERSION) != self.settings.reward_version.encode():
            return IGNORE
        traj = trajectory_of(sample)
        if is_eval(traj.task):
            # The reward stage sends the eval lane to eval-rewards; one on this topic (a writer from before the lane)
            # still measures the policy and is never trained on.
            return SKIP
        if isinstance(sample, TeacherFeedback):
            verdict = admit_feedback(sample, self.settings.loss, self.settings.teacher_version)
            if verdict.action == "skip":
                return IGNORE
            if verdict.action in ("dead_letter", "refuse"):
                metrics.FAILURES.labels("trainer", verdict.reason).inc()
                return Decision("refuse", (verdict.reason, verdict.error) if verdict.action == "dead_letter" else None)
        reward = sample.scored.reward if isinstance(sample, TeacherFeedback) else sample.reward
        if reward.failure_class in NO_VERDICT:
            # The judge or the infrastructure failed, not the policy: its 0 is no reward. The group trains without the
            # sample (a failed episode's 0, by contrast, is a real reward and is trained on).
            metrics.FAILURES.labels("trainer", reward.failure_class).inc()
            return REFUSE
        try:
            check_turn_scores(traj, reward.turn_scores)
        except ValueError as exc:  # the reward stage checks this; a record from elsewhere may not fit
            return Decision("refuse", ("invalid", str(exc)))
        if not self._within_eta(traj, header_version, version, self._bound_for(sample)):
            # The version moved on between samples of one group: the group completes without this one rather than
            # holding a window slot (and the pipeline behind it) until the head timeout.
            return REFUSE
        return ADD

    def _bound_for(self, sample) -> StalenessFilter:
        if isinstance(sample, TeacherFeedback) and reverse_kl_bound_applies(sample, self.settings.loss, self.distill):
            return self.reverse_filter
        return self.filter

    def _within_eta(self, traj: Trajectory, header_version: int, version: int, bound: StalenessFilter) -> bool:
        """The η bound, enforced here before a sample can reach a batch, under --stale-rule; counted either way.

        sample: the header (the oldest version of any token) decides. token: a sample the header refuses keeps the
        tokens of its turns' version segments within η (the others are masked out of its loss) and is dropped only
        when none of its trained tokens is left.
        """
        if self.settings.stale_rule == "token" and bound.is_stale(version, header_version):
            mask, masked, left = mask_stale_tokens(bound, version, traj.turns, traj.loss_mask, header_version)
            if left:
                traj.loss_mask = mask
                self.counter.record(True)
                self.counter.stale_tokens += masked
                metrics.STALE_TOKENS.labels("trainer").inc(masked)
                metrics.count_staleness("trainer", True, self.counter.stale_ratio)
                return True
        accepted = self.counter.observe(bound, version, header_version)
        metrics.count_staleness("trainer", accepted, self.counter.stale_ratio)
        return accepted


# -- teacher feedback: which samples a loss may take ----------------------------------------------------------

def feedback_mismatch(fb) -> str | None:
    """Why ``fb``'s arrays do not fit its trajectory (both lengths named), or None when they do.

    A record with a teacher signal must carry one log-prob per token (and k per token in the top-k form); one
    without (a teacher that timed out) must carry none: a half-filled signal is never trained on.
    """
    n = len(fb.scored.trajectory.token_ids)
    k = fb.teacher_top_k
    if fb.status != "ok":
        filled = len(fb.teacher_logprobs) + len(fb.teacher_topk_ids) + len(fb.teacher_topk_logprobs)
        return (f"feedback with status {fb.status!r} carries {filled} teacher values; a sample without teacher "
                "feedback must carry none") if filled else None
    if len(fb.teacher_logprobs) != n:
        return (f"teacher_logprobs has {len(fb.teacher_logprobs)} entries but the trajectory has {n} tokens "
                f"(trajectory {fb.scored.trajectory.trajectory_id}, teacher {fb.teacher_version})")
    if not 0 <= k <= MAX_TOP_K:
        return f"teacher_top_k is {k}; it must be in [0, {MAX_TOP_K}]"
    for name in ("teacher_topk_ids", "teacher_topk_logprobs"):
        got = len(getattr(fb, name))
        if got != n * k:
            return (f"{name} has {got} entries but the trajectory's {n} tokens x top-k {k} make {n * k} "
                    f"(trajectory {fb.scored.trajectory.trajectory_id}, teacher {fb.teacher_version})")
    return None


@dataclass(frozen=True)
class Admission:
    """What the trainer does with one feedback sample before the staleness check."""

    action: str  # take | skip (another teacher version: not this trainer's) | dead_letter | refuse
    reason: str = ""
    error: str = ""


TAKE = Admission("take")


def admit_feedback(fb, loss: str, teacher_version: str = "") -> Admission:
    """Whether a trainer with ``--loss`` ``loss`` (and ``--teacher-version``, '' = any) may train on ``fb``.

    Arrays that do not fit the trajectory go to dead letters; a sample without teacher feedback (status not ok)
    is refused when the loss needs the teacher, so its group completes without it.
    """
    if teacher_version and fb.teacher_version != teacher_version:
        return Admission("skip")
    problem = feedback_mismatch(fb)
    if problem is not None:
        return Admission("dead_letter", "invalid", problem)
    if fb.status != "ok" and uses_teacher(loss):
        return Admission("refuse", f"teacher_{fb.status}")
    return TAKE


def reverse_kl_bound_applies(fb, loss: str, cfg: DistillConfig) -> bool:
    """Whether ``fb`` is held to the reverse KL's own staleness bound (``--opd-reverse-eta``).

    Reverse KL on the sampled-token form takes ``log q(y) - log p(y)`` as the KL, which holds only when ``y`` was
    drawn from the current student: a stale sample biases it (AsyncOPD). Forward KL is weighted by the teacher
    over the behaviour policy, which corrects a stale sample; and the top-k form's reverse KL is recomputed over
    the k tokens under the current student. Those keep the loop's η.
    """
    return uses_teacher(loss) and cfg.kl in ("reverse", "mixed") and fb.teacher_top_k == 0


@dataclass
class OutcomeBooks:
    """What became of the positions consumed since the last publish, other than being trained.

    Each step publishes these (``refused_step``, ``evicted_step``, ``skipped_step``) in the transaction that commits
    the offsets covering the positions, and a version's ``samples_trained`` counts the rest, so over every version:
    trained + refused + evicted + skipped = the records the trainer's group has committed (benchmarks/chaos.py checks
    it after SIGKILLs). Decisions not yet committed are redone after a restart or a reassignment, so they are forgotten
    with them (``TrainerService._assigned``) and never counted twice.
    """

    refused: int = 0  # stale past η, no verdict, invalid turn scores, refused feedback
    evicted: int = 0  # an incomplete head group's samples at its timeout, and late samples of a closed group
    skipped: int = 0  # not this trainer's (another reward or teacher version), the eval lane, undecodable

    def take(self) -> dict[str, float]:
        """The counts as step metrics, and start again from zero."""
        out = {"refused_step": float(self.refused), "evicted_step": float(self.evicted),
               "skipped_step": float(self.skipped)}
        self.refused = self.evicted = self.skipped = 0
        return out

