"""Replay with another teacher: the same scored trajectories under two teacher versions, archived side by side,
from the topic and from the archive."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlstream.archive.query import open_archive, read_endpoint
from rlstream.archive.readings import reading
from rlstream.archive.report import collect
from rlstream.config import KafkaSettings, LoopSettings
from rlstream.models.tiny import build_model, save_pretrained
from rlstream.runtime.settings import RuntimeSettings
from rlstream.stages.replay import ReplaySettings, replay
from rlstream.stages.teacher import TeacherSettings
from tests.helpers import ROOT
from tests.helpers.kafka import produce, read_all, wait_for
from tests.helpers.teacher import publish_student, samples

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
N = 6


def _by_version(url: str, run: str) -> dict[str, dict[str, list[float]]]:
    with open_archive(url) as archive:
        rows = archive.query(f"SELECT teacher_version, trajectory_id, teacher_logprobs, header_policy_version "
                             f"FROM rlstream.feedback WHERE run = '{run}'")[1]
    out: dict[str, dict[str, list[float]]] = {}
    for version, traj, lps, _ in rows:
        out.setdefault(version, {})[traj] = list(lps)
    return out


@pytest.mark.timeout(600)
def test_two_teacher_versions_are_archived_side_by_side(bootstrap, run_name, tmp_path, start_stage):
    _, tok, folder_a = publish_student(bootstrap, run_name, tmp_path)
    folder_b = tmp_path / "teacher-b"
    save_pretrained(build_model(tok, seed=11), tok, folder_b)  # another teacher of the same tokenizer
    produce(bootstrap, run_name, "rewards", samples(tok, 0, N))
    teacher = start_stage("teacher", bootstrap, run_name, "--teacher", str(folder_a), "--teacher-version", "tA")
    try:
        read_all(bootstrap, run_name, "feedback", expect=N, timeout=120)
    finally:
        assert teacher.stop() == 0, teacher.log_tail()

    kafka = KafkaSettings(bootstrap=bootstrap, run=run_name)
    runtime = RuntimeSettings(batch_size=4, poll_timeout_s=0.1)
    loop = LoopSettings(run=run_name, home=str(tmp_path / "home"))
    other = TeacherSettings(teacher=str(folder_b), teacher_version="tB", top_k=2)
    result = replay(ReplaySettings(progress=False), kafka, runtime, loop, other)
    assert (result.scored, result.skipped) == (N, 0)
    assert replay(ReplaySettings(progress=False), kafka, runtime, loop, other).scored == 0  # resumed: all done

    feedback = read_all(bootstrap, run_name, "feedback", expect=2 * N, timeout=60)
    assert sorted(f.headers["teacher_version"] for f in feedback) == [b"tA"] * N + [b"tB"] * N
    assert all(f.record.teacher_top_k == (2 if f.record.teacher_version == "tB" else 0) for f in feedback)

    path = tmp_path / "archive"
    url = f"chdb://{path}"
    archive = start_stage("archive", bootstrap, run_name, "--archive", url, "--archive-flush-s", "0.3")
    try:
        wait_for(lambda: read_endpoint(str(path)) or not archive.alive(), 60, "the SQL endpoint")
        rows = wait_for(lambda: (r := _by_version(url, run_name)) and sum(map(len, r.values())) >= 2 * N and r,
                        90, "both teachers' rows")
        # After retention: the scored trajectories rebuilt from the archive, through the CLI as a user would.
        out = subprocess.run([sys.executable, "-m", "rlstream.cli", "replay", "--bootstrap", bootstrap, "--run",
                              run_name, "--teacher", str(folder_b), "--teacher-version", "tC", "--source", "archive",
                              "--archive", url, "--home", str(tmp_path / "home"), "--no-progress"],
                             capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=240)
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"replayed {N} trajectories from the archive as teacher version tC" in out.stdout, out.stdout
        rows = wait_for(lambda: (r := _by_version(url, run_name)) and len(r.get("tC", {})) >= N and r, 90,
                        "the archive replay's rows")
        with open_archive(url) as db:
            cols, figures = db.query(
                f"SELECT teacher_version, samples, without_feedback, latency_p50_ms, reverse_kl_mean, "
                f"top1_agreement_mean, teacher_verifier_disagreement FROM rlstream.teacher_by_version "
                f"WHERE run = '{run_name}' ORDER BY teacher_version")
            report = collect(db, run_name)["teacher by version"]  # the report shows the same, with a reading
    finally:
        assert archive.stop() == 0, archive.log_tail()
    assert sorted(rows) == ["tA", "tB", "tC"] and len(rows["tA"]) == len(rows["tB"]) == len(rows["tC"]) == N
    # The same trajectories, scored by two different teachers (tC is tB again, from the archive).
    assert rows["tA"].keys() == rows["tB"].keys() == rows["tC"].keys()
    some = next(iter(rows["tA"]))
    assert rows["tA"][some] != pytest.approx(rows["tB"][some], abs=1e-3)
    assert all(rows["tC"][t] == pytest.approx(rows["tB"][t], abs=1e-5) for t in rows["tB"])
    # The teacher's figures per version: every sample scored, KL finite, top-1 agreement only where top-k was sent.
    by = {r[0]: dict(zip(cols, r)) for r in figures}
    assert sorted(by) == ["tA", "tB", "tC"]
    for version in ("tA", "tB", "tC"):
        assert (by[version]["samples"], by[version]["without_feedback"]) == (N, 0)
        assert by[version]["latency_p50_ms"] > 0 and abs(by[version]["reverse_kl_mean"]) < 100
        assert 0 <= by[version]["teacher_verifier_disagreement"] <= 1
    assert {r[0] for r in report["rows"]} == {"tA", "tB", "tC"}
    assert reading("teacher by version", report).startswith(f"teacher tA: {N} samples, 0.0 % without feedback")
    assert by["tA"]["top1_agreement_mean"] is None and 0 <= by["tB"]["top1_agreement_mean"] <= 1
