"""The trainer's consumer fenced in the middle of a step, against the real broker: the announce is committed again
by a rejoined consumer, and nothing is trained twice or skipped (``trainer/announce.py``)."""
from __future__ import annotations

import logging
import time

import pytest
from confluent_kafka import Consumer

from rlstream.config import KafkaSettings
from rlstream.kafka.group import group_consumer_config
from rlstream.kafka.topics import topic_name
from tests.helpers.kafka import committed_offsets, read_all, wait_for
from tests.helpers.trainer import G, SpyTrainer, produce_groups, start, wait_version

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


class FencedMidStep(SpyTrainer):
    """The real trainer; while the step after ``fence_after`` runs, a consumer with its static instance id joins
    its group and leaves, as librdkafka's own rejoin does to it after a broker outage: the step's announce then
    carries the fenced member's group metadata."""

    fence_after = 1
    kafka_settings: KafkaSettings

    def _train(self, batch):
        stats = super()._train(batch)
        if self.version == self.fence_after:
            kafka = self.kafka_settings
            intruder = Consumer(group_consumer_config(kafka, f"{kafka.run}.trainer", self.loop.policy, 6000))
            intruder.subscribe([topic_name(kafka.run, "rewards")])
            deadline = time.monotonic() + 60
            while not intruder.assignment() and time.monotonic() < deadline:
                intruder.poll(0.2)
            assert intruder.assignment(), "the intruder did not join the trainer's group"
            intruder.close()
        return stats


@pytest.mark.timeout(600)
def test_a_step_whose_consumer_was_fenced_is_announced_again_not_redone(bootstrap, run_name, tmp_path, caplog):
    FencedMidStep.kafka_settings = KafkaSettings(bootstrap=bootstrap, run=run_name)
    caplog.set_level(logging.WARNING, logger="rlstream")
    trainer, thread = start(bootstrap, run_name, tmp_path, cls=FencedMidStep)
    wait_version(trainer, 0)
    for v, gids in enumerate(([1, 2], [3, 4], [5, 6])):
        produce_groups(bootstrap, run_name, gids, version=v)
        wait_version(trainer, v + 1)
    assert thread.is_alive(), "the trainer exited instead of announcing again"
    trainer.stop()
    thread.join(60)

    assert any("announcing it again" in r.getMessage() for r in caplog.records), \
        "the announce of the fenced step was not refused: the test did not reach the path it is about"
    assert [(v, sorted(groups)) for v, groups in trainer.trained] == \
        [(0, ["task-1", "task-2"]), (1, ["task-3", "task-4"]), (2, ["task-5", "task-6"])]
    versions = [r.record for r in read_all(bootstrap, run_name, "policy-versions")]
    assert [v.version for v in versions] == [0, 1, 2, 3]
    assert [v.samples_trained for v in versions] == [0, 2 * G, 2 * G, 2 * G]
    # Every sample consumed exactly once: the group's committed offsets cover all of them.
    wait_for(lambda: sum(committed_offsets(bootstrap, f"{run_name}.trainer", run_name, "rewards").values())
             == 6 * G, 30, "the trainer's offsets to cover every sample")
