"""``rlstream report --run R``: the loop's figures from the archive as an HTML page of PNG plots and tables.

Every figure is a query over the views in archive/views.py, so each one can also be
asked in plain SQL (``rlstream sql``); the page lists the SQL under each table.
"""
from __future__ import annotations

import argparse
import csv
import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rlstream.archive.plots import disagreement_plot, plot
from rlstream.archive.query import DATABASE, format_table, open_archive
from rlstream.archive.readings import MAX_ROWS, by_version_ranges, human, percent, reading, records
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
    ("teacher by version", None),
    ("distillation by version", None),
]

#: Figures whose reading opens the page, in this order.
SUMMARY = ["reward by policy and reward version", "eval reward by policy version", "goodput", "stale ratio",
           "latency and queue delay per stage (ms)", "timeout and failure rates by class", "policy publish latency",
           "reward disagreement"]


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


# -- page --------------------------------------------------------------------------------------------------------

def _table(figure: dict) -> str:
    if not figure["rows"]:
        return "<p class=note>no rows</p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in figure["columns"])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(human(v))}</td>" for v in row) + "</tr>"
                   for row in figure["rows"][:MAX_ROWS * 2])
    folded = (f"<p class=note>{figure['folded_from']} rows folded into version ranges (counts summed, the rest "
              f"averaged)</p>" if figure.get("folded_from") else "")
    more = (f"<p class=note>{len(figure['rows']) - MAX_ROWS * 2} more rows in the CSV</p>"
            if len(figure["rows"]) > MAX_ROWS * 2 else "")
    return f"{folded}<table><tr>{head}</tr>{body}</table>{more}"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def _write_csv(figure: dict, path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(figure["columns"])
        writer.writerows(figure["rows"])


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
th{background:#f2f2f2}.note{color:#777;font-size:12px}pre{background:#f7f7f7;padding:6px;font-size:11px;white-space:pre-wrap}
.kpi{display:inline-block;margin:0 2em 1em 0}.kpi b{font-size:22px;display:block}.reading{font-size:15px}
details{margin:.3em 0 1.5em}"""

#: Marks each chart once the browser has decoded it, so a headless browser's DOM shows which figures rendered.
_LOADED = "this.dataset.loaded = this.naturalWidth > 0 ? 'yes' : 'empty'"


def render(run: str, figures: dict, images: dict[str, str], out: Path, timeline: dict | None = None) -> Path:
    """Write report.html, figures.json and one CSV per figure into ``out``: a summary first, then per figure its
    reading, chart, a table (long ones folded into version ranges), the full rows as CSV and the SQL."""
    good = (records(figures.get("goodput", {"columns": [], "rows": []})) or [{}])[0]
    stale = records(figures.get("stale ratio", {"columns": [], "rows": []}))
    kpis = [("valid trajectories / hour", human(good.get("valid_per_hour"))),
            ("trained samples / hour", human(good.get("accepted_per_hour"))),
            ("valid trajectories", human(good.get("valid_trajectories"))),
            ("stale ratio", percent(stale[0]["stale_ratio"]) if stale else "—")]
    summary = [reading(name, figures[name]) for name in SUMMARY if name in figures]
    parts = [f"<!doctype html><meta charset=utf-8><title>rlstream report: {html.escape(run)}</title>",
             f"<style>{_CSS}</style><h1>rlstream run <code>{html.escape(run)}</code></h1>",
             "".join(f"<div class=kpi><b>{html.escape(v)}</b>{html.escape(k)}</div>" for k, v in kpis),
             "<h2>summary</h2><ul>" + "".join(f"<li>{html.escape(t)}</li>" for t in summary if t) + "</ul>",
             "<p class=note>every figure's full rows: <a href='figures.json'>figures.json</a> and one CSV each"
             "</p>"]
    out.mkdir(parents=True, exist_ok=True)
    for name, _ in SECTIONS:
        if name not in figures:
            continue
        fig = figures[name]
        title = name + (f" ({' vs '.join(fig['versions'])})" if fig.get("versions") else "")
        csv_name = f"{_slug(name)}.csv"
        _write_csv(fig, out / csv_name)
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if text := reading(name, fig):
            parts.append(f"<p class=reading>{html.escape(text)}</p>")
        if name in images:
            parts.append(f"<img src='{html.escape(images[name])}' alt='{html.escape(name)}' onload=\"{_LOADED}\" "
                         f"onerror=\"this.dataset.loaded = 'broken'\">")
        parts.append(_table(by_version_ranges(fig, "policy_version" if "policy_version" in fig["columns"]
                                              else "version")))
        parts.append(f"<p class=note>all {len(fig['rows'])} rows: <a href='{csv_name}'>{csv_name}</a></p>")
        parts.append(f"<details><summary class=note>SQL</summary><pre>{html.escape(fig['sql'])}</pre></details>")
    if timeline is not None:
        parts.append(f"<h2>trajectory {html.escape(timeline['id'])} end to end</h2>{_table(timeline)}")
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
        if png and name in figures and plot(name, figures[name], out / png, None):
            images[name] = png
    if "reward disagreement" in figures and disagreement_plot(archive, run, figures["reward disagreement"]["versions"],
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
