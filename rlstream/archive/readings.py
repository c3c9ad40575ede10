"""What a person reads in the report before any table: numbers in plain units, long per-version tables folded into
version ranges, and one sentence per figure saying what it shows.

Pure functions over the report's figures (``{"columns": [...], "rows": [...]}``, see report.collect), so each is
tested without an archive.
"""
from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Callable

#: A per-version table longer than this is shown folded into about this many version ranges.
MAX_ROWS = 24

#: Per-version columns that are counts: a range shows their sum; every other number shows its mean over the range.
COUNTS = frozenset({"samples", "accepted", "stale", "evicted", "trajectories", "valid_trajectories",
                    "accepted_samples", "stale_samples", "failures"})


def human(v: Any) -> str:
    """A number as a person reads it: 3.29 M, 12,480, 0.412, 85.3; never scientific notation for usual sizes."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)[:19] if isinstance(v, datetime) else str(v)
    a = abs(v)
    for size, unit in ((1e9, "G"), (1e6, "M")):
        if a >= size:
            return f"{v / size:.3g} {unit}"
    if isinstance(v, int) or (a >= 1000 and float(v).is_integer()):
        return f"{int(v):,}"
    if a >= 1000:
        return f"{v:,.0f}"
    if a == 0 or a >= 1e-3:
        return f"{v:.3g}"
    return f"{v:.1e}"  # a rare tiny value: its size matters more than its digits


def percent(v: Any) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * float(v):.1f} %"


def records(figure: dict) -> list[dict]:
    return [dict(zip(figure["columns"], row)) for row in figure["rows"]]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def by_version_ranges(figure: dict, version: str = "version", max_rows: int = MAX_ROWS) -> dict:
    """``figure`` with at most about ``max_rows`` rows per series: consecutive versions folded into ranges.

    A series is the rows sharing every non-numeric column (reward version, split, policy). Counts (``COUNTS``) are
    summed over a range, other numbers averaged; the version column becomes "first–last". Short tables come back
    as they are.
    """
    columns, rows = figure["columns"], figure["rows"]
    if version not in columns or len(rows) <= max_rows:
        return figure
    vi = columns.index(version)
    keys = [i for i, c in enumerate(columns) if i != vi and rows and not _number(rows[0][i])]
    series: dict[tuple, list] = {}
    for row in rows:
        series.setdefault(tuple(row[i] for i in keys), []).append(row)
    per_series = max(1, max_rows // max(1, len(series)))
    folded = []
    for members in series.values():
        members.sort(key=lambda r: r[vi])
        width = math.ceil(len(members) / per_series)
        for start in range(0, len(members), width):
            chunk = members[start:start + width]
            out = []
            for i, c in enumerate(columns):
                values = [r[i] for r in chunk]
                if i == vi:
                    out.append(f"{values[0]}–{values[-1]}" if len(chunk) > 1 else values[0])
                elif i in keys:
                    out.append(values[0])
                else:
                    nums = [float(x) for x in values if _number(x) and not math.isnan(float(x))]
                    out.append(None if not nums else sum(nums) if c in COUNTS else sum(nums) / len(nums))
            folded.append(out)
    return {**figure, "rows": folded, "folded_from": len(rows)}


# -- one sentence per figure -------------------------------------------------------------------------------------

def _points(rows: list[dict], column: str, value: str) -> list[tuple]:
    """(policy version, mean reward) of the rows whose ``column`` is ``value``, oldest version first."""
    return sorted((r["policy_version"], r["reward_mean"]) for r in rows
                  if r.get(column) == value and r.get("reward_mean") is not None)


def _from_to(points: list[tuple]) -> str:
    (v0, r0), (v1, r1) = points[0], points[-1]
    return f"{human(r0)} at v{v0} → {human(r1)} at v{v1}"


def _reward(rows: list[dict]) -> str:
    parts = []
    for split in ("heldout", "train"):
        points = _points(rows, "split", split)
        if len(points) >= 2:
            best = max(points, key=lambda p: p[1])
            parts.append(f"{split} reward {_from_to(points)} (best {human(best[1])} at v{best[0]})")
    return "; ".join(parts) or "too few versions scored to show a trend yet"


def _eval(rows: list[dict]) -> str:
    parts = [f"{task}: {_from_to(points)}" for task in sorted({r["task_name"] for r in rows})
             if (points := _points(rows, "task_name", task))]
    return "eval lane " + "; ".join(parts) if parts else ""


def _stale(rows: list[dict]) -> str:
    r = rows[0]
    return (f"{percent(r['stale_ratio'])} of samples arrived too stale to train on; {human(r['accepted_samples'])} "
            f"trained over {human(r['versions'])} versions, {human(r['evicted_samples'])} evicted from the window")


def _staleness(rows: list[dict]) -> str:
    worst = max(rows, key=lambda r: r.get("stale") or 0)
    if not worst.get("stale"):
        return "no sample was refused as stale at any version"
    return f"stale refusals peak at v{worst['version']} ({human(worst['stale'])} samples)"


def _latency(rows: list[dict]) -> str:
    stages = [r for r in rows if r["stage"] != "end_to_end" and r.get("latency_p99_ms") is not None]
    e2e = next((r for r in rows if r["stage"] == "end_to_end"), None)
    text = []
    if stages:
        slow = max(stages, key=lambda r: r["latency_p99_ms"])
        text.append(f"the slowest stage at p99 is {slow['stage']} ({human(slow['latency_p99_ms'])} ms)")
    queued = [r for r in rows if r.get("queue_p99_ms") is not None]
    if queued:
        q = max(queued, key=lambda r: r["queue_p99_ms"])
        text.append(f"the longest wait before a stage is at {q['stage']} ({human(q['queue_p99_ms'])} ms p99)")
    if e2e and e2e.get("latency_p50_ms") is not None:
        text.append(f"a trajectory takes {human(e2e['latency_p50_ms'])} ms end to end at the median")
    return "; ".join(text)


def _failures(rows: list[dict]) -> str:
    if not rows:
        return "no failures, timeouts or dead letters"
    top = rows[0]
    return (f"{len(rows)} failure classes; the most frequent is {top['failure_class']} at {top['stage']} "
            f"({human(top['failures'])}, {percent(top['rate'])} of trajectories)")


def _goodput(rows: list[dict]) -> str:
    r = rows[0]
    return (f"{human(r['valid_per_hour'])} valid trajectories and {human(r['accepted_per_hour'])} trained samples per "
            f"hour over {human(r['span_s'])} s")


def _hourly(rows: list[dict]) -> str:
    best = max(rows, key=lambda r: r.get("valid_trajectories") or 0)
    return f"{len(rows)} hours; the busiest, {str(best['hour'])[:16]}, had {human(best['valid_trajectories'])} valid"


def _publish(rows: list[dict]) -> str:
    ms = sorted(r["publish_latency_ms"] for r in rows if r.get("publish_latency_ms") is not None)
    if not ms:
        return "no version has been used by rollout yet"
    return (f"a new version reaches rollout {human(ms[len(ms) // 2] / 1000)} s after it is published at the median, "
            f"{human(ms[-1] / 1000)} s at worst")


def _teacher(rows: list[dict]) -> str:
    parts = []
    for teacher in sorted({r["teacher_version"] for r in rows}):
        mine = [r for r in rows if r["teacher_version"] == teacher]
        n = sum(r["samples"] for r in mine)
        mean = lambda key: sum((r[key] or 0) * r["samples"] for r in mine) / max(n, 1)  # noqa: E731
        parts.append(f"teacher {teacher}: {human(n)} samples, {percent(mean('without_feedback_rate'))} without "
                     f"feedback, {percent(mean('alignment_error_rate'))} not aligned, top-1 agreement "
                     f"{percent(mean('top1_agreement_mean'))}, reverse KL {human(mean('reverse_kl_mean'))}")
    return "; ".join(parts)


def _distillation(rows: list[dict]) -> str:
    first, last = rows[0], rows[-1]
    return (f"KL to the teacher {human(first['opd_kl'])} at v{first['version']} → {human(last['opd_kl'])} at "
            f"v{last['version']} (λ {human(first['opd_coef'])} → {human(last['opd_coef'])})")


def _disagreement(rows: list[dict]) -> str:
    r = rows[0]
    return (f"the two reward versions disagree on {percent(r['disagreement_rate'])} of "
            f"{human(r['trajectories'])} trajectories (mean {human(r['mean_a'])} vs {human(r['mean_b'])})")


READINGS: dict[str, Callable[[list[dict]], str]] = {
    "reward by policy and reward version": _reward,
    "eval reward by policy version": _eval,
    "stale ratio": _stale,
    "staleness by policy version": _staleness,
    "latency and queue delay per stage (ms)": _latency,
    "timeout and failure rates by class": _failures,
    "goodput": _goodput,
    "goodput per hour": _hourly,
    "policy publish latency": _publish,
    "reward disagreement": _disagreement,
    "teacher by version": _teacher,
    "distillation by version": _distillation,
}


def reading(name: str, figure: dict) -> str:
    """The one-line reading of a figure ('' when it has none or no rows to read)."""
    rows = records(figure)
    read = READINGS.get(name)
    if read is None or (not rows and name != "timeout and failure rates by class"):
        return ""
    return read(rows)
