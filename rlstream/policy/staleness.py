"""Staleness bound η: which samples the trainer accepts, and when rollout pauses.

Pure logic, no Kafka. The trainer at policy version ``v`` accepts a sample only
if ``v - policy_version <= η`` (``policy_version`` read from the record header:
the oldest version that produced any of its tokens). Older samples are counted
and archived as stale, never trained on; or, under the trainer's ``--stale-rule token``, only the tokens older
than η are masked out (``mask_stale_tokens``, from each turn's version segments) and the sample is dropped only when
none is left. Rollout pauses its ``prompts``
partitions when it is more than η versions behind the newest policy (AReaL's
rule), so it does not produce samples the trainer would throw away.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StalenessFilter", "StalenessCounter", "mask_stale_tokens", "rollout_should_pause", "version_segments"]


def _check_eta(eta: int) -> None:
    # bool is an int subclass; True as η is almost certainly a wiring bug.
    if isinstance(eta, bool) or not isinstance(eta, int):
        raise TypeError(f"eta must be an int, got {type(eta).__name__}")
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")


@dataclass(frozen=True)
class StalenessFilter:
    """The trainer's acceptance rule for the staleness bound ``eta`` (η >= 0)."""

    eta: int

    def __post_init__(self) -> None:
        _check_eta(self.eta)

    @staticmethod
    def lag(trainer_version: int, sample_policy_version: int) -> int:
        """How many versions the sample is behind the trainer (negative if ahead)."""
        return trainer_version - sample_policy_version

    def accepts(self, trainer_version: int, sample_policy_version: int) -> bool:
        """True iff ``trainer_version - sample_policy_version <= eta``.

        A sample from a newer version than the trainer (possible after the
        trainer restarts from an older checkpoint) is accepted: it is not stale.
        """
        return trainer_version - sample_policy_version <= self.eta

    def is_stale(self, trainer_version: int, sample_policy_version: int) -> bool:
        """True iff the sample is more than ``eta`` versions behind the trainer."""
        return not self.accepts(trainer_version, sample_policy_version)


class StalenessCounter:
    """Running counts of accepted and stale samples, for the stale-ratio metric."""

    __slots__ = ("accepted", "stale", "stale_tokens")

    def __init__(self, accepted: int = 0, stale: int = 0) -> None:
        if accepted < 0 or stale < 0:
            raise ValueError("counts must be >= 0")
        self.accepted = accepted
        self.stale = stale
        self.stale_tokens = 0  # tokens masked out of accepted samples (token rule)

    def record(self, accepted: bool, n: int = 1) -> None:
        """Count ``n`` samples as accepted (True) or stale (False)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if accepted:
            self.accepted += n
        else:
            self.stale += n

    def observe(
        self, flt: StalenessFilter, trainer_version: int, sample_policy_version: int
    ) -> bool:
        """Apply ``flt`` to one sample, count the outcome, and return whether it is accepted."""
        ok = flt.accepts(trainer_version, sample_policy_version)
        self.record(ok)
        return ok

    @property
    def seen(self) -> int:
        """Total samples counted."""
        return self.accepted + self.stale

    @property
    def stale_ratio(self) -> float:
        """stale / seen; 0.0 when nothing has been seen (no samples, nothing stale)."""
        seen = self.accepted + self.stale
        return self.stale / seen if seen else 0.0

    def reset(self) -> None:
        """Zero the counts (e.g. at the start of a metrics interval)."""
        self.accepted = 0
        self.stale = 0
        self.stale_tokens = 0

    def __repr__(self) -> str:
        return (
            f"StalenessCounter(accepted={self.accepted}, stale={self.stale}, "
            f"stale_ratio={self.stale_ratio:.4f})"
        )


def version_segments(turn, fallback_version: int) -> list[tuple[int, int]]:
    """(version, tokens) runs of an action turn, in token order: the segments it recorded, or else the whole turn
    under its ``policy_version`` (``fallback_version``, the record's header, when it has none either)."""
    if turn.segment_versions:
        if len(turn.segment_versions) != len(turn.segment_tokens) or \
                sum(turn.segment_tokens) != turn.token_end - turn.token_start:
            raise ValueError(f"turn [{turn.token_start}, {turn.token_end}): segments {turn.segment_versions} x "
                             f"{turn.segment_tokens} do not cover its tokens")
        return list(zip(turn.segment_versions, turn.segment_tokens))
    version = turn.policy_version if turn.policy_version >= 0 else fallback_version
    return [(version, turn.token_end - turn.token_start)]


def mask_stale_tokens(flt: StalenessFilter, trainer_version: int, turns, loss_mask: list[int],
                      fallback_version: int) -> tuple[list[int], int, int]:
    """The token rule: ``loss_mask`` with every token of an action turn's version segment that ``flt`` refuses set
    to 0; returns (the new mask, trained tokens it masked, trained tokens left). ``turns`` span the mask's positions
    (a trajectory's turns); a mask position outside every action turn is left as it is."""
    mask = list(loss_mask)
    masked = 0
    for turn in turns:
        if turn.role != "action":
            continue
        at = turn.token_start
        for version, n in version_segments(turn, fallback_version):
            if flt.is_stale(trainer_version, version):
                masked += sum(mask[at:at + n])
                mask[at:at + n] = [0] * n
            at += n
    return mask, masked, sum(mask)


def rollout_should_pause(newest_policy: int, rollout_policy: int, eta: int) -> bool:
    """AReaL's rule: pause prompts while rollout is more than ``eta`` versions behind.

    Uses the same inequality as the trainer's filter, so rollout keeps generating
    exactly while its samples would still be accepted by the newest trainer.
    """
    _check_eta(eta)
    return newest_policy - rollout_policy > eta
