"""The report's PNG charts: one per figure that has a picture, drawn with matplotlib from the figure's rows."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rlstream.archive.query import DATABASE
from rlstream.archive.readings import records as _records
from rlstream.archive.views import quote


def _num(x: Any) -> float:
    return float("nan") if x is None else float(x)


def plot(name: str, figure: dict, path: Path, versions: list[str] | None) -> bool:
    """Draw one figure's PNG; False when there is nothing to draw."""
    rows = _records(figure)
    if not rows:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    try:
        if name.startswith(("reward by policy", "eval reward")):
            series: dict[tuple, list] = {}
            for r in rows:  # one line per reward version and split (all rewards) or task (the eval lane)
                series.setdefault((r["reward_version"], r.get("split", r.get("task_name"))), []).append(
                    (r["policy_version"], r["reward_mean"]))
            for (rv, split), points in sorted(series.items()):
                points.sort()
                ax.plot([p for p, _ in points], [m for _, m in points], marker="o", ms=3, label=f"{rv} ({split})")
            ax.set(xlabel="policy version", ylabel="mean reward")
            ax.legend(fontsize=8)
        elif name == "reward disagreement":
            return False  # the scatter below needs per-trajectory rows; drawn from the next figure
        elif name == "goodput per hour":
            hours = [str(r["hour"])[5:16].replace("T", " ") for r in rows]
            xs = range(len(rows))
            ax.bar([x - 0.2 for x in xs], [r["valid_trajectories"] for r in rows], 0.4, label="valid trajectories")
            ax.bar([x + 0.2 for x in xs], [r["accepted_samples"] for r in rows], 0.4, label="accepted samples")
            ax.set_xticks(list(xs), hours, rotation=30, fontsize=7)
            ax.set(ylabel="per hour")
            ax.legend(fontsize=8)
        elif name == "staleness by policy version":
            versions_ = [r["version"] for r in rows]
            ax.bar(versions_, [_num(r["accepted"]) for r in rows], label="accepted")
            ax.bar(versions_, [_num(r["stale"]) for r in rows], bottom=[_num(r["accepted"]) for r in rows],
                   label="stale")
            ax.set(xlabel="policy version", ylabel="samples")
            ax2 = ax.twinx()
            ax2.plot(versions_, [_num(r["stale_ratio"]) for r in rows], color="black", marker=".", label="stale ratio")
            ax2.set_ylim(0, 1)
            ax2.set_ylabel("stale ratio")
            ax.legend(fontsize=8, loc="upper left")
        elif name.startswith("latency"):
            stages = [r["stage"] for r in rows]
            xs = range(len(stages))
            for k, (col, label) in enumerate((("latency_p50_ms", "latency p50"), ("latency_p95_ms", "p95"),
                                              ("latency_p99_ms", "p99"), ("queue_p50_ms", "queue p50"),
                                              ("queue_p99_ms", "queue p99"))):
                ax.bar([x + (k - 2) * 0.16 for x in xs], [_num(r[col]) for r in rows], 0.16, label=label)
            ax.set_xticks(list(xs), stages)
            ax.set(ylabel="ms")
            if all(_num(r["latency_p99_ms"]) > 0 or math.isnan(_num(r["latency_p99_ms"])) for r in rows):
                ax.set_yscale("log")
            ax.legend(fontsize=7, ncol=5)
        elif name.startswith("timeout and failure"):
            labels = [f"{r['source']}:{r['stage']}:{r['failure_class']}" for r in rows][:15]
            ax.barh(labels[::-1], [_num(r["rate"]) for r in rows][:15][::-1],
                    color=["tab:red" if r["is_timeout"] else "tab:gray" for r in rows][:15][::-1])
            ax.set(xlabel="share of trajectories (red: timeouts)")
            ax.tick_params(axis="y", labelsize=7)
        elif name == "policy publish latency":
            points = [(r["version"], r["publish_latency_ms"]) for r in rows if r["publish_latency_ms"] is not None]
            if not points:
                return False
            ax.plot([v for v, _ in points], [ms / 1000 for _, ms in points], marker="o", ms=3)
            ax.set(xlabel="policy version", ylabel="s from publish to first use")
        elif name == "most disagreeing trajectories":
            return False
        else:
            return False
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        return True
    finally:
        plt.close(fig)


def disagreement_plot(archive, run: str, versions: list[str], path: Path) -> bool:
    a, b = map(quote, versions)
    _, rows = archive.query(f"SELECT reward_a, reward_b FROM {DATABASE}.reward_disagreement(run={quote(run)}, a={a}, "
                            f"b={b}) LIMIT 20000")
    if not rows:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 4.2))
    ax.scatter([r[0] for r in rows], [r[1] for r in rows], s=6, alpha=0.4)
    ax.set(xlabel=f"reward {versions[0]}", ylabel=f"reward {versions[1]}", title="reward disagreement per trajectory")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
