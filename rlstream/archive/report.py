"""``rlstream report --run R``: the loop's figures from the archive as an HTML page of PNG plots and tables.

Every figure is a query over the views in archive/views.py, so each one can also be
asked in plain SQL (``rlstream sql``); the page lists the SQL under each table.
"""
from __future__ import annotations

import argparse
import html
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rlstream.archive.query import DATABASE, format_table, open_archive
from rlstream.archive.views import install_views, quote, standard_queries, trajectory_timeline
from rlstream.config import LoopSettings, add_arguments, knob, load
from rlstream.errors import UsageError

#: Figure key -> section title (keys of standard_queries).
SECTIONS = [
    ("reward by policy and reward version", "reward_by_version.png"),
    ("eval reward by policy version", "eval_reward.png"),
    ("reward disagreement", "disagreement.png"),
    ("most disagreeing trajectories", None),
    ("goodput", None),
    ("goodput per hour", "goodput.png"),
    ("stale ratio", None),
    ("staleness by policy version", "staleness.png"),
    ("latency and queue delay per stage (ms)", "latency.png"),
    ("timeout and failure rates by class", "failures.png"),
    ("policy publish latency", "publish_latency.png"),
]


def reward_versions(archive, run: str) -> list[str]:
    """The run's reward versions, oldest first (by when they were first scored)."""
    _, rows = archive.query(f"SELECT reward_version FROM {DATABASE}.rewards WHERE run = {quote(run)} "
                            f"GROUP BY reward_version ORDER BY min(scored_at), reward_version")
    return [r[0] for r in rows]


def collect(archive, run: str, compare: tuple[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Install the views and answer every standard question for the run: name -> {sql, columns, rows}."""
    install_views(archive)
    if compare is None:
        versions = reward_versions(archive, run)
        compare = (versions[0], versions[-1]) if len(versions) >= 2 else None
    out = {}
    for name, sql in standard_queries(run, compare).items():
        columns, rows = archive.query(sql)
        out[name] = {"sql": sql, "columns": columns, "rows": rows}
    if compare:
        out["reward disagreement"]["versions"] = list(compare)
    return out


def _records(figure: dict) -> list[dict]:
    return [dict(zip(figure["columns"], row)) for row in figure["rows"]]


def _num(x: Any) -> float:
    return float("nan") if x is None else float(x)


# -- plots -------------------------------------------------------------------------------------------------------

def _plot(name: str, figure: dict, path: Path, versions: list[str] | None) -> bool:
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


def _disagreement_plot(archive, run: str, versions: list[str], path: Path) -> bool:
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


# -- page --------------------------------------------------------------------------------------------------------

def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _table(figure: dict) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in figure["columns"])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>"
                   for row in figure["rows"][:200])
    more = f"<p class=note>{len(figure['rows']) - 200} more rows</p>" if len(figure["rows"]) > 200 else ""
    return f"<table><tr>{head}</tr>{body}</table>{more}" if figure["rows"] else "<p class=note>no rows</p>"


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
th{background:#f2f2f2}.note{color:#777;font-size:12px}pre{background:#f7f7f7;padding:6px;font-size:11px;white-space:pre-wrap}
.kpi{display:inline-block;margin:0 2em 1em 0}.kpi b{font-size:22px;display:block}"""


def render(run: str, figures: dict, images: dict[str, str], out: Path, timeline: dict | None = None) -> Path:
    """Write report.html (and figures.json) into ``out``."""
    good = (_records(figures.get("goodput", {"columns": [], "rows": []})) or [{}])[0]
    stale = _records(figures.get("stale ratio", {"columns": [], "rows": []}))
    kpis = [("valid trajectories / hour", good.get("valid_per_hour")),
            ("accepted samples / hour", good.get("accepted_per_hour")),
            ("valid trajectories", good.get("valid_trajectories")),
            ("stale ratio", stale[0]["stale_ratio"] if stale else None)]
    parts = [f"<!doctype html><meta charset=utf-8><title>rlstream report: {html.escape(run)}</title>",
             f"<style>{_CSS}</style><h1>rlstream run <code>{html.escape(run)}</code></h1>",
             "".join(f"<div class=kpi><b>{html.escape(_fmt(v))}</b>{html.escape(k)}</div>" for k, v in kpis)]
    for name, _ in SECTIONS:
        if name not in figures:
            continue
        fig = figures[name]
        title = name + (f" ({' vs '.join(fig['versions'])})" if fig.get("versions") else "")
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if name in images:
            parts.append(f"<img src='{html.escape(images[name])}' alt='{html.escape(name)}'>")
        parts.append(_table(fig))
        parts.append(f"<pre>{html.escape(fig['sql'])}</pre>")
    if timeline is not None:
        parts.append(f"<h2>trajectory {html.escape(timeline['id'])} end to end</h2>{_table(timeline)}")
    out.mkdir(parents=True, exist_ok=True)
    page = out / "report.html"
    page.write_text("\n".join(parts), encoding="utf-8")
    (out / "figures.json").write_text(json.dumps(figures, indent=1, default=str), encoding="utf-8")
    return page


def build_report(archive, run: str, out: Path, compare: tuple[str, str] | None = None,
                 trajectory: str | None = None) -> tuple[Path, dict]:
    """Query, plot and render; returns (report.html, figures)."""
    out.mkdir(parents=True, exist_ok=True)
    figures = collect(archive, run, compare)
    images = {}
    for name, png in SECTIONS:
        if png and name in figures and _plot(name, figures[name], out / png, None):
            images[name] = png
    if "reward disagreement" in figures and _disagreement_plot(archive, run, figures["reward disagreement"]["versions"],
                                                               out / "disagreement.png"):
        images["reward disagreement"] = "disagreement.png"
    timeline = None
    if trajectory:
        columns, rows = trajectory_timeline(archive, run, trajectory)
        timeline = {"id": trajectory, "columns": columns, "rows": rows, "sql": ""}
    return render(run, figures, images, out, timeline), figures


@dataclass(frozen=True)
class ReportSettings:
    """What ``rlstream report`` draws and where."""

    ROLE: ClassVar[str] = "REPORT"

    out: str = knob("", "Output folder (default: HOME/runs/RUN/report)")
    compare: str = knob("", "Two reward versions A,B to compare (default: the first and the last)")
    trajectory: str = knob("", "Also show this trajectory end to end")


def cmd_report(args: argparse.Namespace) -> None:
    loop, s = load(LoopSettings, args), load(ReportSettings, args)
    run = loop.run
    out = Path(s.out or loop.home_path / "runs" / run / "report")
    compare = tuple(s.compare.split(",", 1)) if s.compare else None
    if compare is not None and len(compare) != 2:
        raise UsageError("--compare takes two reward versions: A,B")
    with open_archive(loop.archive) as archive:
        page, figures = build_report(archive, run, out, compare, s.trajectory or None)
        if s.trajectory:
            columns, rows = trajectory_timeline(archive, run, s.trajectory)
            print(format_table(columns, rows))
    for name in ("goodput", "stale ratio"):
        fig = figures[name]
        print(f"{name}:\n{format_table(fig['columns'], fig['rows'])}")
    print(f"report: {page}")


def add_command(subparsers) -> None:
    """``rlstream report --run R [--out DIR] [--archive URL] [--compare A,B] [--trajectory ID]``."""
    p = subparsers.add_parser("report", help="HTML page of plots and tables of the loop's figures, from the archive")
    add_arguments(p, LoopSettings)
    add_arguments(p, ReportSettings)
    p.set_defaults(func=cmd_report)
