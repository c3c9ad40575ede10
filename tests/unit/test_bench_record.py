"""A benchmark run's raw line (benchmarks/harness/record.py): what it holds, and where it goes."""
from __future__ import annotations

import json
import math

import pytest

from benchmarks.harness import record as rec
from benchmarks.harness.record import Goal, record, results_dir, unit_of
from benchmarks.harness.tables import load, render


def test_one_line_per_run_with_everything_it_says(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(rec.DIR_ENV, str(tmp_path))
    monkeypatch.delenv(rec.RECORD_ENV, raising=False)
    goals = [Goal("hop_ratio", ">=", 0.7)]
    record("probe", {"raw_per_s": 100.0, "hop_ratio": 0.5, "left_s": math.nan, "ok": True}, goals, seed=3)
    record("probe", {"raw_per_s": 90.0, "hop_ratio": 0.6, "left_s": 1.0, "ok": False}, goals, seed=4)
    assert capsys.readouterr().out.count("RESULT probe date=") == 2  # what make bench and its smoke test look for
    lines = [json.loads(t) for t in (tmp_path / "probe.jsonl").read_text().splitlines()]
    assert [ln["seed"] for ln in lines] == [3, 4]
    first = lines[0]
    assert first["figures"] == {"raw_per_s": 100.0, "hop_ratio": 0.5, "left_s": None, "ok": True}
    assert first["units"] == {"raw_per_s": "1/s", "hop_ratio": "×", "left_s": "s", "ok": ""}
    assert first["goals"] == [{"figure": "hop_ratio", "op": ">=", "target": 0.7}]
    assert len(first["commit"]) == 40 and isinstance(first["dirty"], bool)
    assert first["date"].endswith("+00:00") and first["started"] <= first["date"]
    assert len(first["load_before"]) == len(first["load_after"]) == 3
    assert first["machine"]["cores"] >= 1 and "gpus" in first["machine"]
    assert first["command"][0].startswith("python")


def test_off_and_never_into_the_repository_from_a_test(tmp_path, monkeypatch):
    monkeypatch.setenv(rec.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(rec.RECORD_ENV, "0")
    record("probe", {"x_s": 1.0})
    assert results_dir() is None and not list(tmp_path.iterdir())
    monkeypatch.delenv(rec.RECORD_ENV)
    monkeypatch.delenv(rec.DIR_ENV)
    assert results_dir() is None  # PYTEST_CURRENT_TEST is set: benchmarks/results/ is not touched


def test_a_goal_on_a_figure_it_does_not_report_keeps_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv(rec.DIR_ENV, str(tmp_path))
    record("probe", {"raw_per_s": 1.0}, [Goal("ratio", ">=", 1)])
    [line] = load(tmp_path)["probe"]
    assert line[1]["figures"] == {"raw_per_s": 1.0}
    assert "| `ratio` |  | 0 | — | — | >= 1 | not measured | — |" in render("probe", [line])


@pytest.mark.parametrize("name, unit", [("native_rows_per_s", "1/s"), ("async_per_hour", "1/h"),
                                        ("checkpoint_ms", "ms"), ("fast_chain_p50_s", "s"), ("rollout_rss_mib", "MiB"),
                                        ("x_peak_gib", "GiB"),
                                        ("anchor_mb", "MB"), ("ratio", "×"), ("ratio_at_0_to_0.5", "×"),
                                        ("stage_over_direct", "×"), ("opd_vs_rl", "×"), ("lost", "")])
def test_units_from_names(name, unit):
    assert unit_of(name) == unit


def test_a_raw_line_that_an_earlier_run_appended_is_not_a_change_to_the_code(tmp_path, monkeypatch):
    """The runs of a queue append to benchmarks/results/ one after another: the second ran the committed code, and
    its line says so; a change to any other tracked file makes it dirty."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "probe.jsonl").write_text("{}\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "code")
    monkeypatch.setattr(rec, "ROOT", tmp_path)
    assert rec._commit()[1] is False
    with open(tmp_path / "benchmarks" / "results" / "probe.jsonl", "a") as f:
        f.write("{}\n")
    assert rec._commit()[1] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert rec._commit()[1] is True


def test_two_commits_that_change_nothing_a_run_executes_are_one_code(tmp_path, monkeypatch):
    """A re-take spread over sessions is one measurement when the commits between its runs touched only tests, docs
    or the raw results; a change under rlstream/ (or a benchmark script) is another code."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)
    for path, text in {"rlstream/loop.py": "x = 1\n", "benchmarks/hop.py": "y = 1\n", "docs/a.md": "a\n",
                       "tests/test_a.py": "a = 1\n", "tests/helpers/models.py": "m = 1\n",
                       "benchmarks/results/hop.jsonl": "{}\n"}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "code")
    monkeypatch.setattr(rec, "ROOT", tmp_path)
    first = rec._commit()[2]
    assert first and len(first) == 12
    for path in ("docs/a.md", "tests/test_a.py", "benchmarks/results/hop.jsonl"):
        (tmp_path / path).write_text("changed\n")
    git("commit", "-qam", "docs, tests, results")
    assert rec._commit()[2] == first
    (tmp_path / "benchmarks" / "hop.py").write_text("y = 2\n")
    git("commit", "-qam", "a benchmark script")
    second = rec._commit()[2]
    assert second != first
    (tmp_path / "rlstream" / "loop.py").write_text("x = 2\n")
    git("commit", "-qam", "the loop")
    third = rec._commit()[2]
    assert third not in (first, second)
    (tmp_path / "tests" / "helpers" / "models.py").write_text("m = 2\n")  # benchmarks build models through it
    git("commit", "-qam", "a test helper")
    assert rec._commit()[2] not in (first, second, third)
