"""benchmarks/harness/scratch.py: what a benchmark's run leaves on disk. The topics' half needs a broker and is held
by tests/e2e/test_benchmarks.py (no ``bench-*`` run left); this is the folders' half, which needs none (no broker
is given, so none is asked)."""
from __future__ import annotations

from benchmarks.harness import scratch


def _workdir(tmp_path, *folders):
    for folder in (*folders, "logs"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "f").write_text("x")
    return tmp_path


def test_a_run_discards_the_folders_it_names_and_keeps_its_logs(tmp_path, monkeypatch):
    monkeypatch.delenv(scratch.KEEP_ENV, raising=False)
    workdir = _workdir(tmp_path, "weights", "archive", "host-a")
    scratch.discard(None, "bench-x", workdir, folders=("weights", "archive", "host-a", "absent"))
    assert sorted(p.name for p in workdir.iterdir()) == ["logs"]


def test_by_default_only_the_weights_are_scratch(tmp_path, monkeypatch):
    monkeypatch.delenv(scratch.KEEP_ENV, raising=False)
    workdir = _workdir(tmp_path, "weights", "archive")
    scratch.discard(None, "bench-x", workdir)
    assert sorted(p.name for p in workdir.iterdir()) == ["archive", "logs"]


def test_keep_keeps_everything(tmp_path, monkeypatch):
    monkeypatch.setenv(scratch.KEEP_ENV, "1")
    workdir = _workdir(tmp_path, "weights", "archive")
    scratch.discard(None, "bench-x", workdir, folders=("weights", "archive"))
    assert sorted(p.name for p in workdir.iterdir()) == ["archive", "logs", "weights"]


def test_a_run_name_says_it_is_a_benchmarks():
    name = scratch.run_name("chaos")
    assert name.startswith("bench-chaos-") and name != scratch.run_name("chaos")
