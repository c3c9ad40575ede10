"""The reward function's contract: its return type and how it is found by its dotted path."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from rlstream.schemas.records import Trajectory


@dataclass
class RewardResult:
    """What a reward function may return when it has more to say than a number."""

    total: float
    breakdown: dict[str, float] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    verifier_version: str = ""
    judge_version: str = ""


def load_reward(spec: str) -> Callable[[Trajectory], Any]:
    """Import a reward function from ``module:function`` or ``module.function``."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r} is not a dotted path like package.module:function")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load reward {spec!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not callable")
    return fn
