"""Observability against the real broker: stage and trainer /metrics expose the loop's series; the live monitor."""
from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.request

import pytest
from confluent_kafka import Producer

from rlstream import metrics
from rlstream.config import KafkaSettings, LoopSettings
from rlstream.kafka.topics import topic_name
from rlstream.monitoring.monitor import faust_available
from rlstream.runtime.settings import RuntimeSettings
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from rlstream.schemas.records import PolicyVersion, Reward, ScoredTrajectory
from tests.helpers import ROOT
from tests.helpers.kafka import make_trajectory, produce
from tests.helpers.kafka import wait_for as _wait

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

#: The loop's figures (DESIGN "Observability") every process declares.
LOOP_SERIES = ["rlstream_valid_trajectories_total", "rlstream_accepted_samples_total", "rlstream_stale_samples_total",
               "rlstream_stale_ratio", "rlstream_consumer_lag", "rlstream_policy_publish_latency_seconds",
               "rlstream_policy_publish_seconds", "rlstream_rl_step_seconds", "rlstream_queue_delay_seconds",
               "rlstream_handler_seconds", "rlstream_failures_total", "rlstream_dead_letters_total"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _value(text: str, series: str, **labels) -> float | None:
    """The sample of ``series`` with exactly these labels (any order), or None."""
    for name, raw, value in re.findall(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", text, re.M):
        if name == series and dict(re.findall(r'(\w+)="([^"]*)"', raw or "")) == labels:
            return float(value)
    return None




@pytest.mark.timeout(210)
def test_stage_metrics_endpoint_exposes_the_loop_series(bootstrap, run_name, tmp_path, start_stage):
    """A real reward process: the named series are there, with its records, queue delay and consumer lag."""
    port = _free_port()
    log = tmp_path / "reward.log"
    proc = start_stage("reward", bootstrap, run_name, "--metrics-port", str(port), "--batch-size", "8", log_path=log)
    try:
        produce(bootstrap, run_name, "trajectories",
                [(f"g{i}".encode(), make_trajectory(i, response="cba" if i % 2 else "x"), None) for i in range(40)])
        text = _wait(lambda: (t := _try_scrape(port)) and _value(t, "rlstream_records_out_total", stage="reward",
                                                                    topic="rewards") == 40 and t, 60, "40 rewards")
        text = _wait(lambda: (t := _scrape(port)) and _value(t, "rlstream_consumer_lag", stage="reward",
                                                             topic="trajectories") == 0 and t, 20,
                     "the lag gauge to come down to 0 (it refreshes every 5 s)")
    finally:
        assert proc.stop() == 0, proc.log_tail()
    for series in LOOP_SERIES:
        assert f"# TYPE {series}" in text or f"# TYPE {series.removesuffix('_total')}" in text, series
    assert _value(text, "rlstream_records_in_total", stage="reward", topic="trajectories") == 40
    assert _value(text, "rlstream_queue_delay_seconds_count", stage="reward") == 40
    assert _value(text, "rlstream_transactions_total", stage="reward", outcome="committed") >= 1

    # Goodput is counted where trajectories are produced (the env stage, through the same runtime hook).
    before = metrics.VALID_TRAJECTORIES.labels("env")._value.get()
    ok, failed = make_trajectory(1), make_trajectory(2)
    failed.status = "failed"
    for record in (ok, failed):
        metrics.count_output("env", "trajectories", record)
    assert metrics.VALID_TRAJECTORIES.labels("env")._value.get() == before + 1


def _try_scrape(port: int) -> str | None:
    try:
        return _scrape(port)
    except OSError:
        return None


@pytest.mark.timeout(570)
def test_trainer_metrics_carry_accepted_stale_and_publish_times(bootstrap, run_name, tmp_path):
    """The real trainer: accepted / stale counters and ratio, RL step and publish times, consumer lag."""
    from rlstream.trainer.service import TrainerService, TrainerSettings
    trainer = TrainerService(TrainerSettings(weights=str(tmp_path / "weights"), warmup_steps=0, window_groups=2),
                             LoopSettings(groups_per_step=1, eta=0))
    port = metrics.serve(0)
    thread = threading.Thread(target=trainer.serve, args=(KafkaSettings(bootstrap=bootstrap, run=run_name),
                                                          RuntimeSettings(poll_timeout_s=0.1)), daemon=True)
    thread.start()
    _wait(lambda: trainer.version >= 0, 120, "the first policy version")
    accepted0 = metrics.ACCEPTED_SAMPLES.labels("trainer")._value.get()
    stale0 = metrics.STALE_SAMPLES.labels("trainer")._value.get()

    def group(g: int, version: int) -> list[tuple]:
        out = []
        for i, r in enumerate((1.0, 0.0)):
            traj = make_trajectory(g * 10 + i, group=g, response="cba" if r else "abc", n_tokens=4)
            traj.task.group_size, traj.task.prompt_token_ids = 2, [1, 5, 6, 7, 40]
            out.append((f"task-{g}".encode(), ScoredTrajectory(traj, Reward(total=r, reward_version="v1")),
                        hdr.build(version, hdr.new_traceparent(), "v1")))
        return out

    produce(bootstrap, run_name, "rewards", group(1, 0))
    _wait(lambda: trainer.version >= 1, 120, "v1")
    produce(bootstrap, run_name, "rewards", group(2, 0) + group(3, 1))  # at v1 with η=0, v0 samples are stale
    _wait(lambda: trainer.version >= 2, 120, "v2")
    try:
        text = _wait(lambda: (t := _scrape(port)) and _value(t, "rlstream_consumer_lag", stage="trainer",
                                                             topic="rewards") == 0 and t, 20, "the trainer's lag")
    finally:
        trainer.stop()
        thread.join(60)
    assert _value(text, "rlstream_accepted_samples_total", stage="trainer") - accepted0 == 4
    assert _value(text, "rlstream_stale_samples_total", stage="trainer") - stale0 == 2
    assert _value(text, "rlstream_stale_ratio", stage="trainer") == pytest.approx(2 / 6)
    assert _value(text, "rlstream_rl_step_seconds_count", stage="trainer") >= 2
    assert _value(text, "rlstream_policy_publish_seconds_count") >= 3


@pytest.mark.parametrize("backend", ["faust", "plain"])
@pytest.mark.timeout(450)
def test_monitor_serves_per_version_figures_of_committed_records(backend, bootstrap, run_name, tmp_path,
                                                                  start_stage):
    """`rlstream run monitor`: reward mean and samples per version, stale counts; aborted records never count."""
    # `make setup` installs faust-streaming (beside pip's resolver, see the Makefile): a missing one is a failure.
    assert backend != "faust" or faust_available(), "faust-streaming is not installed: run make setup"
    produced = time.time()
    produce(bootstrap, run_name, "rewards", [
        (f"g{i}".encode(), ScoredTrajectory(make_trajectory(i), Reward(float(i % 2), "v1")),
         hdr.build(i % 2, hdr.new_traceparent(), "v1")) for i in range(10)])
    produce(bootstrap, run_name, "policy-versions", [
        (b"policy", PolicyVersion("policy", v, "u", 1, 2, metrics={"accepted": 10.0 * v, "stale": float(v)}),
         hdr.build(v, hdr.new_traceparent())) for v in range(3)])
    # An aborted transaction: read_committed consumers never see it.
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"{run_name}.aborter"})
    producer.init_transactions(30)
    producer.begin_transaction()
    value = default_codec().encode("ScoredTrajectory", ScoredTrajectory(make_trajectory(99), Reward(5.0, "v1")).to_dict())
    producer.produce(topic_name(run_name, "rewards"), value=value, key=b"g", headers=hdr.build(0, "", "v1"))
    producer.flush(30)
    producer.abort_transaction(30)
    # Then a committed sample of the same key (the same partition): a reader that counted it has passed the aborted
    # one, so the figures are final once they count it.
    produce(bootstrap, run_name, "rewards", [(b"g", ScoredTrajectory(make_trajectory(98), Reward(1.0, "v1")),
                                              hdr.build(1, hdr.new_traceparent(), "v1"))])

    port = _free_port()
    log = tmp_path / "monitor.log"
    proc = start_stage("monitor", bootstrap, run_name, "--monitor-port", str(port), "--monitor-backend", backend,
                       "--monitor-data", str(tmp_path / "monitor"), log_path=log)

    def doc():
        try:
            d = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/versions/", timeout=2).read())
        except OSError:
            return None
        return d if d["totals"]["samples"] >= 11 and len(d["policies"]) == 3 else None
    try:
        d = _wait(doc, 180, "the monitor's figures")  # faust joins its group and creates changelogs first: slow under load
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert d["backend"] == backend
    # Windowed figures count what arrived in the current tumbling window (epoch-aligned), if it has not rolled on.
    assert [(r["policy_version"], r["samples"], r["reward_mean"]) for r in d["rewards"]] == [(0, 5, 0.0), (1, 6, 1.0)]
    windowed = [r["window_samples"] for r in d["rewards"]]
    assert windowed == [5, 6] if d["window_start"] <= produced else all(0 <= n <= 6 for n in windowed)
    assert [(p["version"], p["accepted"], p["stale"]) for p in d["policies"]] == [(0, 0, 0), (1, 10, 1), (2, 10, 1)]
    assert d["totals"]["stale_ratio"] == pytest.approx(2 / 22) and d["totals"]["samples"] == 11


def test_grafana_dashboard_uses_only_declared_series():
    """Every series the provisioned dashboard queries is one the processes declare."""
    from prometheus_client import REGISTRY

    import rlstream.archive.sink  # noqa: F401 (declares the archive's series)
    dashboard = json.loads((ROOT / "infra" / "grafana" / "dashboards" / "rlstream.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {re.sub(r"_(bucket|count|sum)$", "", n) for e in exprs for n in re.findall(r"rlstream_\w+", e)}
    declared = {m.name + ("_total" if m.type == "counter" else "") for m in REGISTRY.collect()}
    assert used and used <= declared, used - declared
