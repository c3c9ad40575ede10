"""benchmarks/README.md's generated tables, made from the raw lines in benchmarks/results/ and nothing else.

    python -m benchmarks.harness.tables            # print every benchmark's tables
    python -m benchmarks.harness.tables --write    # regenerate README's generated sections in place
    python -m benchmarks.harness.tables --check    # exit 1, saying why, when a section is stale or unbacked

A generated section sits between ``<!-- results:begin NAME -->`` and ``<!-- results:end NAME -->`` and is
rewritten whole from ``results/NAME.jsonl``; ``--write`` puts the section of a results file that has none just
before ``<!-- results:insert -->``. In a section, runs are grouped by configuration (the script's arguments less
``PLACES``, where it writes: a smoke-sized run and a full one are never pooled, two `make bench` runs are); per
figure a row gives the unit, the number of runs, the median, the min–max spread, the goal, the verdict
(``verdict.py``'s rule) and links to the raw lines it was made from. ``problems`` is what
tests/unit/test_bench_tables.py holds the real README to: every row of a generated section links raw lines that
hold its figure, and every section equals what the results files regenerate.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from collections import Counter
from pathlib import Path

from benchmarks.harness.verdict import Goal, number, verdict

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "benchmarks" / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
INSERT = "<!-- results:insert -->"
#: The index of every benchmark's configurations, stalest first: which figures a re-take should reach next.
INDEX = re.compile(r"(<!-- results:index:begin -->\n)(?P<body>.*?)(<!-- results:index:end -->)", re.S)
_SECTION = re.compile(r"<!-- results:begin (?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- results:end (?P=name) -->",
                      re.S)
_LINK = re.compile(r"\(results/(?P<file>[\w.-]+)\.jsonl#L(?P<a>\d+)(?:-L(?P<b>\d+))?\)")

Run = tuple[int, dict]  # (line number in its file, counting from 1; the parsed line)


def load(results: Path = RESULTS) -> dict[str, list[Run]]:
    """Every results file's runs, by benchmark (the file's name), files in name order."""
    out: dict[str, list[Run]] = {}
    for path in sorted(results.glob("*.jsonl")):
        runs = []
        for n, text in enumerate(path.read_text().splitlines(), 1):
            if not text.strip():
                continue
            try:
                runs.append((n, json.loads(text)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n} is not a JSON line ({exc}); fix or remove it") from None
        out[path.stem] = runs
    return out


#: Arguments that say where a run writes or which broker it uses, not what it measures: left out of the
#: configuration, so that `make bench`'s runs (each with its own --json path) are pooled.
PLACES = ("--json", "--workdir", "--run", "--bootstrap", "--path", "--out", "--home")
#: A seed is a run of its configuration, not another configuration: runs over seeds 0, 1, 2 are pooled into one
#: median and spread (a learning comparison takes several seeds), and the table's head names the seeds. A script
#: that takes a list (``--seeds 0,1,2``) records one line per seed with its ``seed``: the list is left out alike.
SEEDS = ("--seed", "--seeds")


def _split(args: list[str], names: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """``args`` less the options in ``names`` (``--x V`` and ``--x=V`` alike), and those options' values."""
    kept, taken, pending = [], {}, None
    for a in args:
        if pending:
            taken[pending], pending = a, None
        elif a in names:
            pending = a
        elif a.split("=", 1)[0] in names and "=" in a:
            name, value = a.split("=", 1)
            taken[name] = value
        else:
            kept.append(a)
    return kept, taken


def configuration(args: list[str]) -> tuple:
    """A run's arguments less PLACES and SEEDS (``--json X`` and ``--json=X`` alike)."""
    return tuple(_split(args, PLACES + SEEDS)[0])


def seed_of(line: dict):
    """The run's seed: the one it recorded, else its ``--seed`` argument, else None."""
    if line.get("seed") is not None:
        return line["seed"]
    return _split(list(line.get("args", [])), SEEDS)[1].get("--seed")


def configurations(runs: list[Run]) -> dict[tuple, list[Run]]:
    """Runs grouped by their configuration, in the order each first appears."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault(configuration(run[1].get("args", [])), []).append(run)
    return groups


def fmt(x: float) -> str:
    if x != x:
        return "nan"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def _links(name: str, numbers: list[int]) -> str:
    """Links to the raw lines, consecutive ones as one range."""
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"[L{a}](results/{name}.jsonl#L{a})" if a == b else
                     f"[L{a}–{b}](results/{name}.jsonl#L{a}-L{b})" for a, b in spans)


def _values(values: list) -> tuple[str, str]:
    """(median, min–max) of one figure's values; flags and words are counted instead."""
    numeric = [number(v) for v in values if number(v) is not None and not isinstance(v, bool)]
    others = Counter("null" if v is None else ("yes" if v else "no") if isinstance(v, bool) else str(v)
                     for v in values if number(v) is None or isinstance(v, bool))
    words = ", ".join(f"{w} ×{k}" for w, k in others.items())
    if not numeric:
        return words, "—"
    return fmt(statistics.median(numeric)), _span(numeric) + (f" (and {words})" if words else "")


def _span(xs: list[float]) -> str:
    return fmt(min(xs)) if min(xs) == max(xs) else f"{fmt(min(xs))}–{fmt(max(xs))}"


def _one_code(lines: list[dict]) -> str | None:
    """The code (result.code_identity) every line ran, if they share one: several commits of one code are one
    measurement of it. None for two codes, or for lines older than the field (nothing is claimed for them)."""
    codes = {ln.get("code") for ln in lines}
    return codes.pop() if len(codes) == 1 else None


def render_configuration(name: str, runs: list[Run]) -> str:
    lines = [ln for _, ln in runs]
    first = lines[0].get("command") or ["python", "-m", f"benchmarks.{name}", *lines[0]["args"]]
    command = shlex.join(first[:len(first) - len(lines[0]["args"])] + list(configuration(lines[0]["args"])))
    commits = list(dict.fromkeys(ln["commit"][:7] + ("+dirty" if ln.get("dirty") else "") for ln in lines))
    code = _one_code(lines)
    days = sorted(ln["date"][:10] for ln in lines)
    seeds = list(dict.fromkeys(str(seed_of(ln)) for ln in lines if seed_of(ln) is not None))
    machines = list(dict.fromkeys(
        f"{m.get('cores')} cores, {m.get('memory_gib')} GiB, {m.get('cpu')}" + (f", {'; '.join(m['gpus'])}"
                                                                              if m.get("gpus") else "")
        for m in (ln.get("machine", {}) for ln in lines)))
    head = (f"`{command}`: {len(lines)} run{'s' * (len(lines) != 1)}, {days[0]}"
            + (f" to {days[-1]}" if days[-1] != days[0] else "")
            + f", commit {', '.join(commits)}"
            + (f" (one code: {code})" if len(commits) > 1 and code else "")
            + (f", seed {', '.join(map(str, seeds))}" if seeds else "")
            + f"; 1-minute load {_span([ln['load_before'][0] for ln in lines])} "
            f"before, {_span([ln['load_after'][0] for ln in lines])} after; {' / '.join(machines)}")
    recovered = sum(1 for ln in lines if ln.get("recovered"))
    if recovered:  # a line rebuilt from what its run printed (its `recovered` says how), never a figure made up
        head += (f"; {recovered} of the lines rebuilt from their runs' printed RESULT lines (`recovered` and "
                 "`result_line` in the raw line)")
    goals: dict[str, Goal] = {}
    for ln in lines:  # the latest run's goal for a figure, if the goal moved
        goals.update({g["figure"]: Goal.from_json(g) for g in ln.get("goals", [])})
    figures = list(dict.fromkeys([*(f for ln in lines for f in ln["figures"]), *goals]))
    rows = [head, "", "| figure | unit | runs | median | min–max | goal | verdict | raw lines |",
            "|---|---|---|---|---|---|---|---|"]
    for f in figures:
        holding = [(n, ln) for n, ln in runs if f in ln["figures"]]
        values = [ln["figures"][f] for _, ln in holding]
        unit = next((ln.get("units", {}).get(f, "") for _, ln in reversed(holding)), "")
        median, spread = _values(values) if values else ("—", "—")
        goal = goals.get(f)
        shown = f"{goal.op} {fmt(goal.target)}" if goal else "—"
        rows.append(f"| `{f}` | {unit} | {len(values)} | {median} | {spread} | {shown} | "
                    f"{verdict(goal, values) if goal else '—'} | {_links(name, [n for n, _ in holding]) or '—'} |")
    return "\n".join(rows)


def render(name: str, runs: list[Run]) -> str:
    """A benchmark's generated section body: its heading, then a table per configuration."""
    parts = [f"#### `{name}` ([raw lines](results/{name}.jsonl))"]
    parts += [render_configuration(name, group) for group in configurations(runs).values()]
    return "\n\n".join(parts) + "\n"


def render_index(results: dict[str, list[Run]]) -> str:
    """One row per configuration of every benchmark, the stalest (by its newest run) first: its runs, their days,
    commits and code (``result.code_identity``; "unrecorded" for lines older than the field)."""
    rows = []
    for name, runs in results.items():
        for group in configurations(runs).values():
            lines = [ln for _, ln in group]
            args = " ".join(configuration(lines[0].get("args", []))) or "(defaults)"
            days = sorted(ln["date"] for ln in lines)
            commits = list(dict.fromkeys(ln["commit"][:7] for ln in lines))
            codes = {ln.get("code") for ln in lines}
            code = _one_code(lines) or ("unrecorded" if None in codes else f"{len(codes)} codes")
            rows.append((days[-1], name, args, len(lines), days[0], ", ".join(commits), code))
    out = ["| benchmark | configuration | runs | days | commits | code |", "|---|---|---|---|---|---|"]
    for last, name, args, n, first, commits, code in sorted(rows):
        first, last = first[:10], last[:10]
        out.append(f"| `{name}` | `{args}` | {n} | {first}{'' if first == last else ' to ' + last} | {commits} | "
                   f"{code} |")
    return "\n".join(out) + "\n"


def _section(name: str, body: str) -> str:
    return f"<!-- results:begin {name} -->\n{body}<!-- results:end {name} -->"


def update(readme: str, results: dict[str, list[Run]]) -> str:
    """The README with every generated section rewritten, and the missing ones put before the insert marker."""
    text = _SECTION.sub(lambda m: _section(m["name"], render(m["name"], results.get(m["name"], []))), readme)
    text = INDEX.sub(lambda m: m.group(1) + render_index(results) + m.group(3), text)
    present = {m["name"] for m in _SECTION.finditer(readme)}
    missing = [_section(n, render(n, runs)) + "\n\n" for n, runs in results.items() if n not in present]
    if missing:
        if INSERT not in text:
            raise ValueError(f"benchmarks/README.md has no {INSERT} line for the new sections "
                             f"({', '.join(n for n in results if n not in present)}); add one where they belong")
        text = text.replace(INSERT, "".join(missing) + INSERT, 1)
    return text


def problems(readme: str, results: dict[str, list[Run]]) -> list[str]:
    """Why the README's generated sections cannot be trusted, one sentence each ([] when they can)."""
    out = []
    begins = re.findall(r"<!-- results:begin ([\w.-]+) -->", readme)
    sections = {m["name"]: m["body"] for m in _SECTION.finditer(readme)}
    for name in begins:
        if name not in sections:
            out.append(f"section {name}: no matching '<!-- results:end {name} -->'")
    for name, body in sections.items():
        if name not in results:
            out.append(f"section {name}: no results/{name}.jsonl behind it")
            continue
        lines = dict(results[name])
        for row in body.splitlines():
            m = re.match(r"\| `(?P<figure>[^`]+)` \|", row)
            if not m:
                continue
            links = list(_LINK.finditer(row))
            if not links and row.split("|")[3].strip() != "0":  # 0 runs: a goal not measured shows no value
                out.append(f"section {name}: figure {m['figure']} links no raw line")
            for link in links:
                a = int(link["a"])
                for n in range(a, int(link["b"] or a) + 1):
                    line = lines.get(n) if link["file"] == name else None
                    if line is None or m["figure"] not in line["figures"]:
                        out.append(f"section {name}: figure {m['figure']} links results/{link['file']}.jsonl line "
                                   f"{n}, which does not hold it")
        if body != render(name, results[name]):
            out.append(f"section {name} is out of date with results/{name}.jsonl: "
                       "run python -m benchmarks.harness.tables --write")
    index = INDEX.search(readme)
    if index and index["body"] != render_index(results):
        out.append("the results index is out of date with results/: run python -m benchmarks.harness.tables --write")
    for name in results:
        if name not in sections:
            out.append(f"results/{name}.jsonl has no section in benchmarks/README.md: "
                       "run python -m benchmarks.harness.tables --write")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="regenerate benchmarks/README.md's sections in place")
    mode.add_argument("--check", action="store_true", help="exit 1 when a section is stale or has no raw line")
    args = ap.parse_args(argv)
    try:
        results = load(RESULTS)
        readme = README.read_text()
        if args.write:
            README.write_text(update(readme, results))
            print(f"wrote {len(results)} benchmarks' sections into {README.relative_to(ROOT)}")
        elif args.check:
            found = problems(readme, results)
            print("\n".join(found) or "benchmarks/README.md's generated sections match benchmarks/results/")
            return 1 if found else 0
        else:
            print("\n".join(render(n, runs) for n, runs in results.items()))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
