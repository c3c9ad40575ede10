"""Staleness bound η: which samples the trainer accepts, and when rollout pauses.

Pure logic, no Kafka. The trainer at policy version ``v`` accepts a sample only
if ``v - policy_version <= η`` (``policy_version`` read from the record header:
the oldest version that produced any of its tokens). Older samples are counted
and archived as stale, never trained on. Rollout pauses its ``prompts``
partitions when it is more than η versions behind the newest policy (AReaL's
rule), so it does not produce samples the trainer would throw away.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StalenessFilter", "StalenessCounter", "rollout_should_pause"]


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

    __slots__ = ("accepted", "stale")

    def __init__(self, accepted: int = 0, stale: int = 0) -> None:
        if accepted < 0 or stale < 0:
            raise ValueError("counts must be >= 0")
        self.accepted = accepted
        self.stale = stale

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
        """Zero both counts (e.g. at the start of a metrics interval)."""
        self.accepted = 0
        self.stale = 0

    def __repr__(self) -> str:
        return (
            f"StalenessCounter(accepted={self.accepted}, stale={self.stale}, "
            f"stale_ratio={self.stale_ratio:.4f})"
        )


def rollout_should_pause(newest_policy: int, rollout_policy: int, eta: int) -> bool:
    """AReaL's rule: pause prompts while rollout is more than ``eta`` versions behind.

    Uses the same inequality as the trainer's filter, so rollout keeps generating
    exactly while its samples would still be accepted by the newest trainer.
    """
    _check_eta(eta)
    return newest_policy - rollout_policy > eta
