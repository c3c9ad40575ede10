"""A loop racing to a held-out target, measured off the clock: what vs_trl and distill_vs_rl both time.

The clock starts once rollout generates with the first version (engine start-up is off it); every
``eval_every``-th version is copied as soon as it is announced (the store keeps only η + 1 back) and scored
greedily on the held-out set in this process, and its time is when it was published. With ``pause_for_eval`` the
loop's processes are stopped (SIGSTOP) while an evaluation runs and the paused time is taken off the clock, so the
evaluation neither competes with the loop for the cores nor counts: what TRL's synchronous loop gets when its
callback evaluates. Without it the loop goes on during the evaluation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from benchmarks.harness.loop import Loop, PacedSource, Versions, log, snapshot


def heldout_reverse(folder: Path) -> float:
    """Greedy exact-match on the reverse task's held-out set of the model in ``folder`` (the demo's measure)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlstream.models.tiny import build_tokenizer
    from rlstream.trainer.warmup import greedy_exact_match
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return greedy_exact_match(model, build_tokenizer(), "reverse")


@dataclass
class Race:
    curve: list[dict] = field(default_factory=list)  # {"step": version, "seconds", "heldout"}
    startup_s: float = 0.0
    first_version: int = 0  # the version rollout started on (updates are counted from it)
    best: tuple[float, Path | None] = (-1.0, None)  # (held-out, its snapshot folder)
    paused_s: float = 0.0  # time the loop was stopped for evaluations (off the clock)

    def seconds_to(self, target: float) -> float | None:
        return next((c["seconds"] for c in self.curve if c["heldout"] >= target), None)


def clock_seconds(ms: int, t0_ms: int, pauses: list[tuple[int, int]]) -> float:
    """Seconds on the race's clock at wall-clock ``ms``: since ``t0_ms``, less every pause (start, end) that ended by
    then. Nothing of the loop runs during a pause, so no version is published inside one."""
    return max(0.0, (ms - t0_ms - sum(b - a for a, b in pauses if b <= ms)) / 1000)


def race(loop: Loop, versions: Versions, source: PacedSource, *, target: float, max_seconds: float,
         eval_every: int, startup_timeout: float, tag: str,
         evaluate: Callable[[Path], float] = heldout_reverse, on_start: Callable[[], None] | None = None,
         pause_for_eval: bool = False) -> Race:
    """Start ``loop`` and ``source`` and follow the versions until held-out >= ``target`` or ``max_seconds`` on the
    clock; the caller stops the loop (in a finally). ``on_start`` runs when the clock starts."""
    out, snaps, snapped = Race(), loop.workdir / "snapshots", {}
    launched = time.monotonic()
    loop.start()
    deadline = time.monotonic() + startup_timeout
    while loop.rollout_version() < 0:
        if time.monotonic() > deadline or loop.dead():
            raise RuntimeError(f"{tag}: the loop did not start (dead {loop.dead()}); logs in {loop.workdir}/logs")
        time.sleep(0.2)
    t0_ms = int(time.time() * 1000)
    out.startup_s, out.first_version = time.monotonic() - launched, max(versions.latest(), 0)
    if on_start:
        on_start()
    source.start()
    evaluated: set[int] = set()
    pauses: list[tuple[int, int]] = []  # (start, end) wall-clock ms of each evaluation's pause
    on_clock = lambda ms: clock_seconds(ms, t0_ms, pauses)  # noqa: E731

    while not loop.dead() and source.error is None:
        for pv, _ in versions.all():
            if pv.version % eval_every == 0 and pv.version not in snapped:
                if snapshot(pv.weights_uri, snaps / f"v{pv.version}"):
                    snapped[pv.version] = pv.published_at
        todo = sorted(v for v in snapped if v not in evaluated)
        if not todo:
            if on_clock(int(time.time() * 1000)) > max_seconds:
                break
            time.sleep(0.2)
            continue
        v = todo[0]
        evaluated.add(v)
        if pause_for_eval:
            paused_at = int(time.time() * 1000)
            loop.pause()
            try:
                acc = evaluate(snaps / f"v{v}")
            finally:
                loop.resume()
            pauses.append((paused_at, int(time.time() * 1000)))
            out.paused_s = sum(b - a for a, b in pauses) / 1000
        else:
            acc = evaluate(snaps / f"v{v}")
        secs = on_clock(snapped[v])
        out.curve.append({"step": v, "seconds": secs, "heldout": acc})
        log(tag, f"v{v} {secs:.1f}s held-out {acc:.3f}")
        if acc > out.best[0]:
            out.best = (acc, snaps / f"v{v}")
        if acc >= target or secs > max_seconds:
            break
    return out
