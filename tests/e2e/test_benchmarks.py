"""`make bench` at smoke size: every benchmark runs through to its RESULT line and its raw line (the figures are not
judged here: at smoke size they mean nothing, and no test asserts a time). The raw lines go to the test's tmp dir,
never into benchmarks/results/. One at a time: two at once (JOBS=2) took 1087 s in CI against 557 s one by one, since
at smoke size each is mostly CPU-bound process start and imports."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from confluent_kafka.admin import AdminClient

from benchmarks.harness.scratch import PREFIX
from tests.helpers import ROOT
from tests.helpers.kafka import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


# Benchmarks another test runs bigger, checking the same RESULT and raw lines: left out of the smoke run.
RUN_ELSEWHERE = {"chaos": "tests/integration/test_chaos.py", "three_hosts": "tests/integration/test_three_hosts.py"}


def _benchmarks() -> list[str]:
    script = (ROOT / "benchmarks" / "run_all.sh").read_text()
    return re.findall(r"^bench (\w+) ", script, re.M)


def test_every_benchmark_script_is_in_make_bench():
    listed = set(_benchmarks())
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__"}
    assert scripts == listed, f"not run by make bench: {scripts - listed}; listed but missing: {listed - scripts}"


@pytest.mark.timeout(1700)
def test_every_benchmark_prints_its_result_line_at_smoke_size(tmp_path, bootstrap):
    raw_dir = tmp_path / "results"
    committed = {p.name: p.read_bytes() for p in (ROOT / "benchmarks" / "results").glob("*.jsonl")}
    admin = AdminClient({"bootstrap.servers": bootstrap})
    before = set(admin.list_topics(timeout=30).topics)
    env = dict(os.environ, SMOKE="1", OUT=str(tmp_path), PY=sys.executable, PYTHONPATH=str(ROOT),
               RLSTREAM_BENCH_RESULTS=str(raw_dir), BENCH_SKIP=",".join(RUN_ELSEWHERE))
    done = subprocess.run(["bash", "benchmarks/run_all.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1650)
    results = {}
    for name in _benchmarks():
        if name in RUN_ELSEWHERE:
            assert not (tmp_path / f"{name}.log").exists(), f"{name} ran, though BENCH_SKIP named it"
            assert f"RESULT {name} " in (ROOT / RUN_ELSEWHERE[name]).read_text(), RUN_ELSEWHERE[name]
            continue
        log = (tmp_path / f"{name}.log").read_text()
        line = next((ln for ln in log.splitlines() if ln.startswith(f"RESULT {name} ")), None)
        results[name] = line
        assert line is not None, f"{name} printed no RESULT line:\n{log[-3000:]}"
        # Every figure carries its date, commit and load.
        assert re.search(r" date=\d{4}-\d\d-\d\d commit=\S+ load=[\d.]+/[\d.]+/[\d.]+", line), line
        # And one raw line (benchmarks/harness/record.py), well-formed, its goals on figures it reports.
        raw = [json.loads(t) for t in (raw_dir / f"{name}.jsonl").read_text().splitlines()]
        assert len(raw) == 1 and raw[0]["benchmark"] == name, raw
        assert raw[0]["figures"] and set(raw[0]["units"]) == set(raw[0]["figures"]), raw[0]
        assert {g["figure"] for g in raw[0]["goals"]} <= set(raw[0]["figures"]), raw[0]
        assert raw[0]["commit"] and raw[0]["date"] and len(raw[0]["load_before"]) == 3, raw[0]
        # A rate below zero is a broken clock, not a slow run (replay_throughput's baseline once timed a path the
        # stage no longer took and printed -0.17/s).
        negative = {k: v for k, v in raw[0]["figures"].items() if k.endswith("_per_s")
                    and isinstance(v, (int, float)) and v < 0}
        assert not negative, f"{name}: negative rates {negative}"
    assert {p.name: p.read_bytes() for p in (ROOT / "benchmarks" / "results").glob("*.jsonl")} == committed
    assert done.returncode == 0, done.stdout[-4000:]
    # Every run a benchmark made is deleted when it ends (benchmarks/harness/scratch.py): none left on the broker.
    left = lambda: {t for t in admin.list_topics(timeout=30).topics if t.startswith(PREFIX)} - before  # noqa: E731
    try:
        wait_for(lambda: not left(), 60, "the benchmarks' runs to be deleted")
    except AssertionError:
        raise AssertionError(f"benchmark runs left on the broker: {sorted({t.split('.')[0] for t in left()})}")
