"""The transactional producer's librdkafka settings (``kafka.transactions.producer_config``)."""
from __future__ import annotations

from rlstream.config import KafkaSettings
from rlstream.kafka.transactions import TXN_RETRY_BACKOFF_MS, producer_config


def test_a_transaction_begun_right_after_a_commit_retries_soon_not_after_librdkafkas_100_ms():
    conf = producer_config(KafkaSettings(bootstrap="127.0.0.1:1", run="r"), "r.stage.0")
    assert conf["retry.backoff.ms"] == TXN_RETRY_BACKOFF_MS < 100
    assert conf["transactional.id"] == "r.stage.0"


def test_kafka_config_can_set_the_retry_backoff_but_not_the_transactional_id():
    kafka = KafkaSettings(bootstrap="127.0.0.1:1", run="r", kafka_config="retry.backoff.ms=50,transactional.id=x")
    conf = producer_config(kafka, "r.stage.0")
    assert conf["retry.backoff.ms"] == "50"
    assert conf["transactional.id"] == "r.stage.0"
