"""benchmarks/README.md's generated tables (benchmarks/harness/tables.py): made from the raw lines alone, every row
linked to the lines behind it, and the real README held to its results files."""
from __future__ import annotations

import json

from benchmarks.harness import tables
from benchmarks.harness.tables import INSERT, load, problems, render, update


def _line(args, ratio, *, speed=100.0, commit="a" * 40, goal=0.7):
    return {"benchmark": "hop", "command": ["python", "-m", "benchmarks.hop", *args], "args": args,
            "commit": commit, "dirty": False, "started": "2026-12-02T10:00:00+00:00",
            "date": "2026-12-02T10:01:00+00:00", "load_before": [1.5, 1.0, 0.5], "load_after": [2.5, 1.2, 0.6],
            "machine": {"cores": 2, "memory_gib": 23.5, "cpu": "Xeon", "gpus": []}, "seed": None,
            "figures": {"speed_per_s": speed, "ratio": ratio}, "units": {"speed_per_s": "1/s", "ratio": "×"},
            "goals": [{"figure": "ratio", "op": ">=", "target": goal}]}


def _results(tmp_path, lines: dict[str, list[dict]]):
    for name, rows in lines.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load(tmp_path)


def test_configurations_apart_and_the_verdict_per_figure(tmp_path):
    results = _results(tmp_path, {"hop": [_line(["--n", "10"], 0.8), _line(["--smoke"], 0.1),
                                           _line(["--n", "10"], 0.6, speed=300.0), _line(["--n", "10"], 0.9)]})
    text = render("hop", results["hop"])
    full, smoke = text.split("`python -m benchmarks.hop --n 10`")[1].split("`python -m benchmarks.hop --smoke`")
    assert "3 runs" in full and "1 run," in smoke
    # 0.6 of the three is short of 0.7: the goal lies inside the spread; the links are the lines it was made from.
    assert ("| `ratio` | × | 3 | 0.8 | 0.6–0.9 | >= 0.7 | within noise | [L1](results/hop.jsonl#L1), "
            "[L3–4](results/hop.jsonl#L3-L4) |") in full
    assert "| `speed_per_s` | 1/s | 3 | 100 | 100–300 | — | — |" in full
    assert "| `ratio` | × | 1 | 0.1 | 0.1 | >= 0.7 | one run, no spread | [L2](results/hop.jsonl#L2) |" in smoke
    assert "load 1.5 before, 2.5 after" in full


def test_runs_at_several_commits_of_one_code_say_so(tmp_path):
    """Commits that changed nothing a run executes (result.code_identity) are named as one code; lines from before
    the field, or from two codes, claim nothing."""
    def at(commit, code):
        return {**_line(["--n", "10"], 0.8, commit=commit * 40), "code": code}
    one = render("hop", _results(tmp_path, {"hop": [at("a", "c0de"), at("b", "c0de")]})["hop"])
    assert "commit aaaaaaa, bbbbbbb (one code: c0de)" in one
    two = render("hop", _results(tmp_path, {"hop": [at("a", "c0de"), at("b", "beef")]})["hop"])
    old = render("hop", _results(tmp_path, {"hop": [_line(["--n", "10"], 0.8, commit="a" * 40),
                                                    at("b", "c0de")]})["hop"])
    assert "one code" not in two and "one code" not in old


def test_the_index_lists_every_configuration_stalest_first_and_is_held_current(tmp_path):
    old = {**_line(["--n", "10"], 0.8), "date": "2026-12-01T09:00:00+00:00"}
    fresh = [{**_line(["--n", "11"], 0.8, commit=c * 40), "code": "c0de"} for c in "ab"]
    results = _results(tmp_path, {"hop": [old, *fresh], "aaa": [{**_line([], 0.8), "benchmark": "aaa"}]})
    index = tables.render_index(results).splitlines()[2:]
    assert index[0].startswith("| `hop` | `--n 10` | 1 | 2026-12-01 | aaaaaaa | unrecorded |")
    assert index[1].startswith("| `aaa` | `(defaults)` | 1 | 2026-12-02 |")
    assert index[2] == "| `hop` | `--n 11` | 2 | 2026-12-02 | aaaaaaa, bbbbbbb | c0de |"
    readme = "x\n<!-- results:index:begin -->\n<!-- results:index:end -->\n" + INSERT + "\n"
    written = update(readme, results)
    assert tables.render_index(results) in written and not problems(written, results)
    assert "results index is out of date" in " ".join(problems(written.replace("c0de |", "beef |"), results))


def test_a_line_rebuilt_from_its_printed_result_is_counted_in_the_head(tmp_path):
    rebuilt = {**_line(["--n", "10"], 0.9), "recovered": "from the run's RESULT line", "result_line": "RESULT hop"}
    text = render("hop", _results(tmp_path, {"hop": [_line(["--n", "10"], 0.8), rebuilt]})["hop"])
    assert "1 of the lines rebuilt from their runs' printed RESULT lines" in text
    assert "rebuilt" not in render("hop", _results(tmp_path, {"hop": [_line(["--n", "10"], 0.8)]})["hop"])


def test_where_a_run_writes_is_not_its_configuration(tmp_path):
    results = _results(tmp_path, {"hop": [_line(["--n", "10", "--json", "/tmp/a.json"], 0.8),
                                           _line(["--json=/tmp/b.json", "--n", "10"], 0.9)]})
    text = render("hop", results["hop"])
    assert "`python -m benchmarks.hop --n 10`: 2 runs" in text and "| met |" in text


def test_runs_over_seeds_are_one_configuration_and_the_head_names_the_seeds(tmp_path):
    recorded = {**_line(["--n", "10", "--seed", "7"], 0.8), "seed": 7}
    results = _results(tmp_path, {"hop": [_line(["--n", "10", "--seed", "0"], 0.8),
                                           _line(["--seed=1", "--n", "10"], 0.9), recorded,
                                           _line(["--n", "11", "--seed", "2"], 0.1)]})
    text = render("hop", results["hop"])
    assert "`python -m benchmarks.hop --n 10`: 3 runs" in text and "seed 0, 1, 7;" in text
    assert "`python -m benchmarks.hop --n 11`: 1 run" in text and "seed 2;" in text
    # A script that takes a list of seeds records a line per seed, its seed in the line: one configuration too.
    listed = [{**_line(["--n", "12", "--seeds", s], 0.5), "seed": int(s)} for s in "01"]
    text = render("hop", _results(tmp_path, {"hop": listed})["hop"])
    assert "`python -m benchmarks.hop --n 12`: 2 runs" in text and "seed 0, 1;" in text


def test_update_rewrites_sections_and_inserts_new_ones_once(tmp_path):
    results = _results(tmp_path, {"hop": [_line([], 0.8), _line([], 0.9)], "other": [_line([], 0.1)]})
    readme = "# B\n\n<!-- results:begin hop -->\nstale text\n<!-- results:end hop -->\n\nprose\n" + INSERT + "\n"
    once = update(readme, results)
    assert "stale text" not in once and "| met |" in once and "prose" in once
    assert once.index("results:begin other") < once.index(INSERT)
    assert update(once, results) == once
    assert problems(once, results) == []


def test_problems_name_every_unbacked_or_stale_figure(tmp_path):
    results = _results(tmp_path, {"hop": [_line([], 0.8), _line([], 0.9)]})
    good = update(f"<!-- results:begin hop -->\n<!-- results:end hop -->\n{INSERT}\n", results)
    assert problems(good, results) == []
    edited = good.replace("| 0.85 |", "| 0.95 |")
    assert edited != good and any("out of date" in p for p in problems(edited, results))
    unlinked = good.replace("<!-- results:end hop -->", "| `speed_per_s` | 1/s | 1 | 9,999 | — | — | — | — |\n"
                                                         "<!-- results:end hop -->")
    assert any("speed_per_s links no raw line" in p for p in problems(unlinked, results))
    wrong_line = good.replace("results/hop.jsonl#L1-L2)", "results/hop.jsonl#L1-L3)")
    assert any("line 3, which does not hold it" in p for p in problems(wrong_line, results))
    assert any("no results/gone.jsonl" in p for p in
               problems(good + "<!-- results:begin gone -->\nx\n<!-- results:end gone -->\n", results))
    more = _results(tmp_path, {"new": [_line([], 1.0)]})
    assert any("results/new.jsonl has no section" in p for p in problems(good, more))


def test_a_goal_that_moved_is_judged_at_the_latest_target(tmp_path):
    results = _results(tmp_path, {"hop": [_line([], 0.8, goal=0.5), _line([], 0.9, goal=0.85)]})
    assert "| >= 0.85 | within noise |" in render("hop", results["hop"])


def test_the_readme_figures_are_backed_by_the_committed_results():
    """Every generated section of benchmarks/README.md equals what benchmarks/results/ regenerates, and every row
    links raw lines that hold its figure (figures from before raw results were kept sit outside these sections)."""
    found = problems(tables.README.read_text(), load(tables.RESULTS))
    assert found == [], "\n".join(found)
