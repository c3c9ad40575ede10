"""Every benchmark run's raw result: one JSON line appended to ``benchmarks/results/<benchmark>.jsonl``.

A benchmark calls ``record`` once, at its end::

    from benchmarks.harness.record import Goal, record
    record("bus_hop", {"raw_per_s": raw, "batch_ratio": r}, [Goal("batch_ratio", ">=", 0.7)], seed=args.seed)

It prints the ``RESULT <name> …`` line (``result.py``: what ``make bench`` and its smoke test look for) and
appends one line holding: ``benchmark``; ``command`` (the interpreter's whole argv) and ``args`` (the script's
arguments, which tell one configuration from another in the tables); ``commit`` (the full hash of HEAD) and
``dirty`` (tracked files other than the raw results differ from it: ``result.CODE``) and ``code`` (HEAD's code as
``result.code_identity`` names it: equal for two commits that changed no file a run executes), all read when this
module is imported, so a commit made during a long run is not taken for the code it ran; ``started`` and ``date`` (UTC,
ISO 8601: when this module was imported, which each benchmark does at its top, and when ``record`` ran);
``load_before`` and ``load_after`` (1/5/15-minute load averages at those two moments); ``machine`` (cores,
memory, CPU model, GPUs as ``nvidia-smi`` lists them); ``seed``; ``figures`` (name → value; NaN and infinities
written as null); ``units`` (name → unit, see ``unit_of``); ``goals`` (``verdict.Goal``: figure, op, target).

Where the line goes: ``RLSTREAM_BENCH_RESULTS=DIR`` writes ``DIR/<benchmark>.jsonl`` instead (the smoke test's
tmp dir; ``run_all.sh`` sets it to ``$OUT/results`` under ``SMOKE=1``); ``RLSTREAM_BENCH_RECORD=0`` writes no line
at all (the RESULT line is printed either way), and neither does a benchmark that a test starts without
``RLSTREAM_BENCH_RESULTS`` (pytest's ``PYTEST_CURRENT_TEST`` in its environment): no test writes into the repository.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.harness.result import CODE, code_identity, result
from benchmarks.harness.verdict import Goal

__all__ = ["Goal", "record", "results_dir", "unit_of"]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
RECORD_ENV, DIR_ENV = "RLSTREAM_BENCH_RECORD", "RLSTREAM_BENCH_RESULTS"

_STARTED = datetime.datetime.now(datetime.timezone.utc)
_LOAD_BEFORE = os.getloadavg()

#: Figure-name endings and the unit each means, tried in order; a name with none of them is a count or a flag.
_SUFFIX_UNITS = (("_tok_s", "tokens/s"), ("_per_s", "1/s"), ("_per_hour", "1/h"), ("_ms", "ms"), ("_s", "s"), ("_mib", "MiB"),
                 ("_gib", "GiB"), ("_mb", "MB"), ("_ratio", "×"), ("ratio", "×"), ("_vs_rl", "×"), ("_vs_goal", "×"))


def unit_of(name: str) -> str:
    """The unit a figure's name says by its ending (``_per_s``: 1/s, ``_s``: s, ``_ratio``: ×, …), else ''."""
    if name.startswith(("ratio_", "stage_over_")):
        return "×"
    return next((unit for end, unit in _SUFFIX_UNITS if name.endswith(end)), "")


def results_dir() -> Path | None:
    """Where ``record`` appends (None: recording is off)."""
    if os.environ.get(RECORD_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    # A benchmark a test starts (pytest's variable is inherited by its subprocesses) never writes into the repository.
    return None if os.environ.get("PYTEST_CURRENT_TEST") else RESULTS


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _commit() -> tuple[str, bool | None, str | None]:
    """(HEAD's full hash or 'unknown', whether tracked files differ from it, its code identity; None where git
    cannot say)."""
    status = _git("status", "--porcelain", "--untracked-files=no", "--", *CODE)
    tree = _git("ls-tree", "-r", "HEAD")
    return (_git("rev-parse", "HEAD") or "unknown", (bool(status) if status is not None else None),
            code_identity(tree) if tree is not None else None)


_COMMIT = _commit()  # at import: the code a run loaded, not a commit made while it ran


def _machine() -> dict:
    cpu = memory = None
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), None)
        kib = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                   if ln.startswith("MemTotal:"))
        memory = round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    gpus = []
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout
            gpus = [ln.strip() for ln in out.splitlines() if ln.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    return {"cores": os.cpu_count(), "memory_gib": memory, "cpu": cpu, "gpus": gpus}


def _plain(value):
    """A figure as JSON can hold it: NaN and infinities as null, numpy scalars as Python numbers."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def record(name: str, figures: dict, goals: list[Goal] | tuple = (), seed=None,
           units: dict[str, str] | None = None) -> dict:
    """Print the RESULT line and append the run's raw line (module docstring); returns the line as a dict.

    A goal on a figure the run did not report is kept, not refused: the run's figures are never lost at its end,
    the table shows that goal as not measured, and the smoke test (tests/e2e/test_benchmarks.py) fails on it.
    """
    result(name, **figures)
    line = {
        "benchmark": name,
        "command": [Path(sys.executable).name, *sys.orig_argv[1:]],
        "args": sys.argv[1:],
        "commit": _COMMIT[0],
        "dirty": _COMMIT[1],
        "code": _COMMIT[2],
        "started": _STARTED.isoformat(timespec="seconds"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_before": [round(x, 2) for x in _LOAD_BEFORE],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "machine": _machine(),
        "seed": seed,
        "figures": {k: _plain(v) for k, v in figures.items()},
        "units": {k: (units or {}).get(k, unit_of(k)) for k in figures},
        "goals": [g.to_json() for g in goals],
    }
    where = results_dir()
    if where is not None:
        where.mkdir(parents=True, exist_ok=True)
        with open(where / f"{name}.jsonl", "a") as f:
            f.write(json.dumps(line, ensure_ascii=False, allow_nan=False) + "\n")
    return line
