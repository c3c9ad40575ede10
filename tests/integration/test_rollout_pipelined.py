"""Rollout pipelined on a server fleet, through the real runner and broker: an eval prompt behind a backlog of
training prompts is still served first. The engine is a stand-in (``tests.helpers.engines.FakeBackend``, slowed):
what is tested is the stage's scheduling in this mode, not a server (real vLLM servers: test_inference_fleet.py)."""
from __future__ import annotations

import threading
import time

import pytest

from rlstream.config import KafkaSettings
from rlstream.runtime.runner import StageRunner
from rlstream.runtime.settings import RuntimeSettings
from rlstream.stages.rollout import RolloutSettings, RolloutStage
from tests.helpers.engines import FakeBackend, FakeWatcher, pv
from tests.helpers.kafka import DELIVERY_SLACK_MS, make_task, produce, read_all
from tests.helpers.models import chat_tokenizer

pytestmark = pytest.mark.kafka

BACKLOG = 100
#: Training turns that may land after the eval prompt was sent and before its own: the record generating, those
#: finished and waiting for their commit (--commit-interval-s), one fetched before the pause.
SLACK = 5


class SlowServer(FakeBackend):
    """Answers like a server kind, 50 ms a call."""

    name = "vllm-server"

    def generate(self, prompts, params, between_steps=None, keys=None):
        time.sleep(0.05)
        return super().generate(prompts, params)


@pytest.mark.timeout(120)
def test_an_eval_prompt_behind_a_backlog_is_served_first_when_pipelined(bootstrap, run_name):
    # One server taking one request at a time: the stage keeps one record in flight (RolloutStage.max_in_flight),
    # so the backlog waits in Kafka, where the eval lane's pause holds it back.
    stage = RolloutStage(RolloutSettings(backend="vllm-server", engine_url=("http://127.0.0.1:1",),
                                         max_concurrency=1, max_context=64))
    stage.follower.watcher, stage.backend, stage.tokenizer = FakeWatcher(pv(0)), SlowServer(False), chat_tokenizer()
    stage.max_context, stage.follower.version = 64, 0
    runner = StageRunner(stage, KafkaSettings(bootstrap=bootstrap, run=run_name),
                         RuntimeSettings(instance=f"{run_name}-rollout"))
    assert not stage.batched and runner.in_flight_limit() == 1
    worker = threading.Thread(target=runner.run, kwargs={"idle_exit_s": 30}, daemon=True)
    worker.start()
    try:
        produce(bootstrap, run_name, "prompts", [(f"task-{i}".encode(), make_task(i, group_size=1), None)
                                                 for i in range(BACKLOG)])
        read_all(bootstrap, run_name, "actions", expect=1, timeout=60)  # working through the backlog
        evaluation = make_task(10_000, group_size=1)
        produce(bootstrap, run_name, "eval-prompts", [(evaluation.task_id.encode(), evaluation, None)])
        # From the eval prompt's own timestamp (set as it is produced), not from before the test's producer starts:
        # a new producer's connection and metadata took 0.4 s in CI, 8 training turns counted against the stage.
        [sent] = read_all(bootstrap, run_name, "eval-prompts", expect=1, timeout=30)
        sent_at = sent.timestamp_ms
        actions = read_all(bootstrap, run_name, "actions", expect=BACKLOG + 1, timeout=60)
    finally:
        runner.request_stop()
        worker.join(30)
    [served] = [a for a in actions if a.record.task.task_id == evaluation.task_id]
    training = [a.timestamp_ms for a in actions if a is not served]
    # Turns that ended before the stage can have had the eval prompt (DELIVERY_SLACK_MS) are not its choice.
    before = sum(sent_at + DELIVERY_SLACK_MS < t < served.timestamp_ms for t in training)
    after = sum(t > served.timestamp_ms for t in training)
    assert after >= 20, f"the backlog ran out before the eval prompt came ({after} training turns after it)"
    assert before <= SLACK, f"{before} training turns went ahead of the eval prompt that was waiting"
    assert served.record.task.split == "eval"
