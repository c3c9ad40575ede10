"""The ``--reward`` spec: one reward function, or weighted parts that add up to one (see ``rlstream.rewards``)."""
from __future__ import annotations

import asyncio
import inspect
import re
from typing import Any, Callable

from rlstream.rewards.api import RewardResult, as_result, import_reward
from rlstream.rewards.verifiers import VERIFIERS
from rlstream.schemas.records import Trajectory

# A weight is a plain decimal: "fn:inf" or "fn:nan" name a function, never a weight.
_WEIGHT = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def parse_spec(spec: str) -> list[tuple[str, float | None]]:
    """``"math:1.0,format:0.2,pkg.mod:judge:0.5"`` -> [(target, weight or None)], each target a built-in name or
    a dotted path; the weight is what follows the last colon when it is a number."""
    parts = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"reward spec {spec!r} has an empty part")
        target, sep, weight = part.rpartition(":")
        if sep and _WEIGHT.fullmatch(weight.strip()):
            parts.append((target.strip(), float(weight)))
        else:
            parts.append((part, None))
    return parts


def resolve(target: str) -> tuple[str, Callable[[Trajectory], Any]]:
    """A part's breakdown key and function: a built-in verifier by name, or a function by dotted path."""
    if target in VERIFIERS:
        return target, VERIFIERS[target]
    if ":" not in target and "." not in target:
        raise ValueError(f"unknown reward {target!r}: built-in verifiers are {', '.join(VERIFIERS)}; "
                         f"anything else is a dotted path like package.module:function")
    return re.split(r"[:.]", target)[-1], import_reward(target)


def load_reward(spec: str) -> Callable[[Trajectory], Any]:
    """The reward function a ``--reward`` spec names: one part without a weight is that function itself (its return
    value untouched); several parts, or a weight, make a composite."""
    parts = parse_spec(spec)
    if len(parts) == 1 and parts[0][1] is None:
        return resolve(parts[0][0])[1]
    keyed: list[tuple[str, float, Callable]] = []
    for target, weight in parts:
        key, fn = resolve(target)
        if any(k == key for k, _, _ in keyed):
            if target in VERIFIERS:
                raise ValueError(f"reward spec {spec!r} names {target!r} twice")
            key = target  # two functions of one name from different modules: the full path tells them apart
        keyed.append((key, 1.0 if weight is None else weight, fn))
    return composite(keyed)


def combine(parts: list[tuple[str, float, Callable]], results: list[RewardResult]) -> RewardResult:
    """The weighted sum of the parts' results: one breakdown key per part holding its weighted share (so the
    breakdown sums to the total), violations and versions prefixed by the part."""
    breakdown = {key: weight * r.total for (key, weight, _), r in zip(parts, results)}
    # Per-turn scores add up like the totals, over the parts that gave them.
    scored = [(weight, r.turn_scores) for (_, weight, _), r in zip(parts, results) if r.turn_scores]
    if len({len(s) for _, s in scored}) > 1:
        raise ValueError("the parts gave different numbers of turn scores: "
                         f"{[len(s) for _, s in scored]}; each must give one per action turn")
    turn_scores = [sum(w * s[k] for w, s in scored) for k in range(len(scored[0][1]))] if scored else []
    return RewardResult(
        total=sum(breakdown.values()), breakdown=breakdown,
        violations=[f"{key}:{v}" for (key, _, _), r in zip(parts, results) for v in r.violations],
        # The weights are in the version: re-weighting changes what a total means.
        verifier_version="+".join(f"{r.verifier_version or key}*{weight:g}"
                                  for (key, weight, _), r in zip(parts, results)),
        judge_version="+".join(r.judge_version for r in results if r.judge_version), turn_scores=turn_scores)


def composite(parts: list[tuple[str, float, Callable]]) -> Callable[[Trajectory], Any]:
    """A reward function scoring with every part (key, weight, function); ``async`` when any part is, and then the
    parts run concurrently (sync ones in the stage's thread pool)."""
    fns = [fn for _, _, fn in parts]
    spec = ",".join(f"{key}:{weight:g}" for key, weight, _ in parts)
    if not any(inspect.iscoroutinefunction(fn) for fn in fns):
        def composite_reward(trajectory: Trajectory) -> RewardResult:
            return combine(parts, [as_result(fn(trajectory)) for fn in fns])
    else:
        async def call(fn, trajectory: Trajectory):
            return await (fn(trajectory) if inspect.iscoroutinefunction(fn) else asyncio.to_thread(fn, trajectory))

        async def composite_reward(trajectory: Trajectory) -> RewardResult:
            raws = await asyncio.gather(*(call(fn, trajectory) for fn in fns))
            return combine(parts, [as_result(raw) for raw in raws])
    composite_reward.__doc__ = f"Composite reward {spec}: the weighted sum of its parts."
    return composite_reward
