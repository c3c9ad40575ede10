"""The loop's chain, measured per step from the samples the step trains on.

A sample's way round the loop: prompt created → generated (rollout.end) → env done (env.end) → scored (reward.end)
→ waited in the trainer's window until the step that trains it began → trained and its version published. With η
versions in flight, how fast the policy can move is bound by this chain, not by any one stage's CPU, so each step
publishes the chain's hops (p50 over its samples, seconds) in its PolicyVersion metrics, beside its own
(``STEP_KEYS``). The last hop, publish → rollout generating with the new version, is the archive's
``publish_latency`` view.
"""
from __future__ import annotations

import statistics
from typing import Iterable

#: (hop, stamp it starts at, stamp it ends at); the stamps are the trajectories' stage_times (wall-clock ms).
HOPS = (("generate", "prompt.created", "rollout.end"),
        ("env", "rollout.end", "env.end"),
        ("reward", "env.end", "reward.end"))

#: The metric names a step publishes (``chain_<hop>_s`` p50s, the whole chain to the step's start at p50 and p99).
KEYS = tuple(f"chain_{hop}_s" for hop, _, _ in HOPS) + ("chain_wait_s", "chain_to_step_s", "chain_to_step_p99_s")

#: A step's own hops after the chain's (service.py): the update (``step_seconds``: batch built, trained), the
#: version's folder written (``weights_s``), the announcing transaction (``commit_s``).
STEP_KEYS = ("step_seconds", "weights_s", "commit_s")


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def chain_stats(stage_times: Iterable[dict[str, int]], step_started_ms: int) -> dict[str, float]:
    """Seconds per hop (p50 over the samples that carry both stamps) and the whole chain up to ``step_started_ms``.

    A sample without a stamp (an older producer, a replayed one) leaves that hop out; a hop no sample measured is
    absent from the result rather than 0, so a figure is never made up.
    """
    stamps = list(stage_times)
    out: dict[str, float] = {}
    for hop, start, end in HOPS:
        spans = [(t[end] - t[start]) / 1000 for t in stamps if start in t and end in t]
        if spans:
            out[f"chain_{hop}_s"] = statistics.median(spans)
    waits = [(step_started_ms - t["reward.end"]) / 1000 for t in stamps if "reward.end" in t]
    if waits:
        out["chain_wait_s"] = statistics.median(waits)
    whole = [(step_started_ms - t["prompt.created"]) / 1000 for t in stamps if "prompt.created" in t]
    if whole:
        out["chain_to_step_s"] = statistics.median(whole)
        out["chain_to_step_p99_s"] = _quantile(whole, 0.99)
    return out


def summarize(per_step: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Across steps' PolicyVersion metrics: p50 and p99 of each hop (and of the step's own) and each hop's share of
    the chain (prompt created → version published, at the p50s), the whole chain per step as ``chain_s``."""
    out: dict[str, dict[str, float]] = {}
    # The whole chain, prompt created -> version published: up to the step, the update, the weights written and
    # the announcing transaction (a step carries its predecessor's, the last one known when it is announced).
    per_step = [{**m, "chain_s": m["chain_to_step_s"] + sum(m.get(k, 0.0) for k in STEP_KEYS)}
                if "chain_to_step_s" in m and "step_seconds" in m else m for m in per_step]
    for key in ("chain_s", *KEYS, *STEP_KEYS, "train_s"):
        values = [m[key] for m in per_step if key in m]
        if values:
            out[key] = {"p50": _quantile(values, 0.5), "p99": _quantile(values, 0.99)}
    hops = [f"chain_{hop}_s" for hop, _, _ in HOPS] + ["chain_wait_s", *STEP_KEYS]
    total = sum(out[k]["p50"] for k in hops if k in out)
    for k in hops:
        if k in out and total > 0:
            out[k]["share"] = out[k]["p50"] / total
    return out


def describe(summary: dict[str, dict[str, float]]) -> str:
    """One line: the chain's hops at p50 with their shares, and the whole chain to a step at p50/p99."""
    names = {"chain_generate_s": "generate", "chain_env_s": "env", "chain_reward_s": "reward",
             "chain_wait_s": "wait in window", "step_seconds": "train", "weights_s": "write weights",
             "commit_s": "announce"}
    hops = ", ".join(f"{label} {summary[k]['p50']:.2f} s ({summary[k].get('share', 0):.0%})"
                     for k, label in names.items() if k in summary)
    whole, chain = summary.get("chain_to_step_s"), summary.get("chain_s")
    tail = f"; prompt to step p50 {whole['p50']:.2f} s, p99 {whole['p99']:.2f} s" if whole else ""
    tail += f"; prompt to published p50 {chain['p50']:.2f} s, p99 {chain['p99']:.2f} s" if chain else ""
    return f"chain per step: {hops}{tail}"
