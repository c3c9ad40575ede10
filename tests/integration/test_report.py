"""The report against the real broker and archive: its goodput and stale ratio equal the raw topics' own figures."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from rlstream.archive.query import open_archive, read_endpoint
from rlstream.archive.readings import human
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import DeadLetter, Failure, PolicyVersion, Reward, ScoredTrajectory, ToolResult
from tests.helpers import ROOT
from tests.helpers.browser import dom_after_load, screenshot
from tests.helpers.kafka import make_trajectory, produce, read_all, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

HOUR_MS = 3_600_000


def _raw(bootstrap: str, run: str, logical: str) -> list[tuple[int, object]]:
    """Every record of a topic as (timestamp ms, record)."""
    return [(s.timestamp_ms, s.record) for s in read_all(bootstrap, run, logical)]


@pytest.mark.timeout(690)
def test_report_figures_match_the_raw_topics_and_render(bootstrap, run_name, tmp_path, start_stage):
    """Goodput (per hour and overall) and stale ratio from the report equal those computed here from the topics."""
    now = hdr.now_ms()
    base = now - now % HOUR_MS - 2 * HOUR_MS  # three clock hours of trajectories
    trajectories, rewards = [], []
    for i in range(60):
        ts = base + (i % 3) * HOUR_MS + 1000 * i
        traj = make_trajectory(i, response="cba" if i % 4 else "abc", version=i % 4)
        traj.stage_times = {"prompt.created": ts - 900, "rollout.start": ts - 800 + i, "rollout.end": ts - 300,
                            "env.end": ts - 10}
        if i % 7 == 0:
            traj.status, traj.failure = "failed", Failure("sandbox_timeout" if i % 2 else "env_error", "x", "env")
        elif i % 11 == 0:
            traj.status = "truncated"
        if i % 5 == 0:
            traj.turns[0].tool_result = ToolResult("", exit_code=1, failure_class="tool_timeout")
        heads = hdr.build(i % 4, hdr.new_traceparent(), produced_at=ts)
        trajectories.append((traj.group_id.encode(), traj, heads, ts))
        for rv, total in (("v1", float(i % 4 != 0)), ("v2", 1.0 if i % 4 == 1 else 0.5)):
            traj.stage_times["reward.end"] = ts + 40
            rewards.append((traj.group_id.encode(), ScoredTrajectory(traj, Reward(total, rv, latency_ms=25.0)),
                            hdr.build(i % 4, hdr.child_traceparent(heads[1][1]), rv, produced_at=ts + 40), ts + 40))
    # What trainers publish: process-cumulative counts, and (newer ones) per-step counts; v3 follows a restart.
    metrics = [{"warmup_steps": 300.0}, {"accepted": 40, "stale": 2}, {"accepted": 90, "stale": 10},
               {"accepted": 15, "stale": 5}, {"accepted": 60, "stale": 5, "accepted_step": 45, "stale_step": 0},
               {"accepted": 100, "stale": 20, "accepted_step": 40, "stale_step": 15, "stale_tokens_step": 7}]
    versions = []
    for v, m in enumerate(metrics):
        published = base + v * 20 * 60_000  # in the past: the broker refuses timestamps > 1 h ahead
        versions.append((b"policy", PolicyVersion(policy="policy", version=v, weights_uri=f"file:///w/{v}",
                                                  created_at=published, published_at=published, step=v,
                                                  metrics={k: float(x) for k, x in m.items()}),
                         hdr.build(v, hdr.new_traceparent()), published))
    letter = DeadLetter(stage="reward", reason="handler_timeout", error="slow", topic=f"{run_name}.trajectories",
                        partition=0, offset=3, failed_at=now, headers={})
    # The eval lane's results (held-out, never trained on): v0 scores 1, 1, 0 and v1 scores 0, 1, 0.
    evals = []
    for i in range(6):
        traj = make_trajectory(1000 + i, version=i % 2)
        traj.task.split = "heldout"
        evals.append((traj.group_id.encode(), ScoredTrajectory(traj, Reward(float(i in (0, 2, 3)), "v1")),
                      hdr.build(i % 2, hdr.new_traceparent(), "v1")))
    produce(bootstrap, run_name, "trajectories", trajectories)
    produce(bootstrap, run_name, "rewards", rewards)
    produce(bootstrap, run_name, "eval-rewards", evals)
    produce(bootstrap, run_name, "policy-versions", versions)
    produce(bootstrap, run_name, "dead-letters", [(b"k", letter, hdr.build(-1, hdr.new_traceparent()), now)])

    # Independently, from the raw topics.
    raw_traj = _raw(bootstrap, run_name, "trajectories")
    raw_versions = sorted(_raw(bootstrap, run_name, "policy-versions"), key=lambda r: r[1].version)
    valid_by_hour: dict[int, int] = {}
    for ts, t in raw_traj:
        if t.status == "ok":
            valid_by_hour[ts - ts % HOUR_MS] = valid_by_hour.get(ts - ts % HOUR_MS, 0) + 1
    accepted = stale = 0.0
    accepted_by_hour: dict[int, float] = {}
    prev = {"accepted": 0.0, "stale": 0.0}
    for _, pv in raw_versions:
        m = pv.metrics
        step = {}
        for k in ("accepted", "stale"):
            total = m.get(k, 0.0)
            step[k] = m[f"{k}_step"] if f"{k}_step" in m else (total - prev[k] if total >= prev[k] else total)
            prev[k] = total
        accepted, stale = accepted + step["accepted"], stale + step["stale"]
        hour = pv.published_at - pv.published_at % HOUR_MS
        accepted_by_hour[hour] = accepted_by_hour.get(hour, 0.0) + step["accepted"]
    times = [ts for ts, _ in raw_traj]
    span_s = (max(times) - min(times)) / 1000
    valid = sum(valid_by_hour.values())
    assert (len(raw_traj), valid) == (60, 60 - 9 - 5) and stale > 0

    path = tmp_path / "archive"
    url = f"chdb://{path}"
    log = tmp_path / "archive.log"
    archive = start_stage("archive", bootstrap, run_name, "--archive", url, "--archive-flush-s", "0.3", log_path=log)
    try:
        wait_for(lambda: read_endpoint(str(path)) or not archive.alive(), 60, "the SQL endpoint")
        assert archive.alive(), archive.log_tail()

        def archived():
            with open_archive(url) as db:
                return db.query(f"SELECT (SELECT count() FROM rlstream.rewards WHERE run = '{run_name}'), "
                                f"(SELECT count() FROM rlstream.policy_versions WHERE run = '{run_name}'), "
                                f"(SELECT count() FROM rlstream.dead_letters WHERE run = '{run_name}')")[1][0] \
                    == [120 + len(evals), len(metrics), 1]
        wait_for(archived, 60, "every record in the archive")
        out_dir = tmp_path / "report"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-m", "rlstream.cli", "report", "--run", run_name, "--out",
                               str(out_dir), "--archive", url, "--trajectory", "traj-7"],
                              capture_output=True, text=True, env=env, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "trajectory failed" in done.stdout and "reward v2" in done.stdout, done.stdout
    finally:
        assert archive.stop() == 0, archive.log_tail()

    figures = json.loads((out_dir / "figures.json").read_text())

    def rows(name):
        return [dict(zip(figures[name]["columns"], r)) for r in figures[name]["rows"]]

    good = rows("goodput")[0]
    assert good["valid_trajectories"] == valid and good["accepted_samples"] == pytest.approx(accepted)
    assert good["valid_per_hour"] == pytest.approx(valid * 3600 / span_s)
    assert good["accepted_per_hour"] == pytest.approx(accepted * 3600 / span_s)
    hourly = rows("goodput per hour")
    got_valid = {r["hour"]: r["valid_trajectories"] for r in hourly if r["valid_trajectories"]}
    got_accepted = {r["hour"]: r["accepted_samples"] for r in hourly if r["accepted_samples"]}
    iso = lambda ms: time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000))  # noqa: E731
    assert got_valid == {iso(h): n for h, n in valid_by_hour.items()}
    assert got_accepted == {iso(h): round(n) for h, n in accepted_by_hour.items() if round(n)}
    ratio = rows("stale ratio")[0]
    assert ratio["stale_ratio"] == pytest.approx(stale / (stale + accepted))
    assert (ratio["accepted_samples"], ratio["stale_samples"]) == (pytest.approx(accepted), pytest.approx(stale))

    assert ratio["stale_tokens"] == 7 and rows("staleness by policy version")[-1]["stale_tokens"] == 7
    # Eval reward by version: the eval lane alone.
    assert [(r["policy_version"], r["samples"], r["reward_mean"]) for r in rows("eval reward by policy version")] == [
        (0, 3, pytest.approx(2 / 3)), (1, 3, pytest.approx(1 / 3))]

    failures = {(r["source"], r["failure_class"]): r for r in rows("timeout and failure rates by class")}
    assert failures[("trajectory", "sandbox_timeout")]["is_timeout"] and failures[("tool", "tool_timeout")]["failures"] == 12
    assert failures[("dead_letter", "handler_timeout")]["rate"] == pytest.approx(1 / 60)
    stages = {r["stage"]: r for r in rows("latency and queue delay per stage (ms)")}
    assert stages["reward"]["latency_p50_ms"] == 25.0 and stages["env"]["latency_p50_ms"] == 290.0
    assert figures["reward disagreement"]["rows"][0][:2] == [60, 45]  # v1 and v2 agree on 1.0 only

    # The page renders: HTML that shows each plot, and real PNGs.
    page = (out_dir / "report.html").read_text()
    pngs = sorted(p.name for p in out_dir.glob("*.png"))
    assert {"reward_by_version.png", "eval_reward.png", "goodput.png", "staleness.png", "latency.png", "failures.png",
            "disagreement.png"} <= set(pngs)
    for name in pngs:
        assert f"src='{name}'" in page
        assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out_dir / name).stat().st_size > 5000
    assert "traj-7 end to end" in page and "<table>" in page
    # A person reads the summary first, in plain units: no scientific notation on the page, every figure's rows
    # linked in full.
    assert page.index("<h2>summary</h2>") < page.index("<img") and "e+0" not in page
    assert f"{human(valid * 3600 / span_s)} valid trajectories and" in page
    for name in figures:
        assert (out_dir / f"{''.join(c if c.isalnum() else '_' for c in name).strip('_')}.csv").exists(), name

    # And a real browser renders it: every chart decoded, and a screenshot with something on it.
    dom = dom_after_load(out_dir / "report.html")
    assert dom.count('data-loaded="yes"') == len(pngs), dom[:2000]
    shot = screenshot(out_dir / "report.html", tmp_path / "report.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
