"""The transactional producer's librdkafka settings (``kafka.transactions.producer_config``) and the bound on its
blocking calls (``kafka.transactions.Caller``: the calls here are plain functions, not librdkafka's)."""
from __future__ import annotations

import threading

import pytest

from rlstream.config import KafkaSettings
from rlstream.kafka.transactions import TXN_RETRY_BACKOFF_MS, Caller, Wedged, _First, producer_config


def test_a_transaction_begun_right_after_a_commit_retries_soon_not_after_librdkafkas_100_ms():
    conf = producer_config(KafkaSettings(bootstrap="127.0.0.1:1", run="r"), "r.stage.0")
    assert conf["retry.backoff.ms"] == TXN_RETRY_BACKOFF_MS < 100
    assert conf["transactional.id"] == "r.stage.0"


def test_kafka_config_can_set_the_retry_backoff_but_not_the_transactional_id():
    kafka = KafkaSettings(bootstrap="127.0.0.1:1", run="r", kafka_config="retry.backoff.ms=50,transactional.id=x")
    conf = producer_config(kafka, "r.stage.0")
    assert conf["retry.backoff.ms"] == "50"
    assert conf["transactional.id"] == "r.stage.0"


def test_a_call_past_its_timeout_and_grace_is_wedged_and_a_new_caller_serves_the_next():
    release = threading.Event()

    def stuck(timeout):  # ignores its timeout, as a wedged librdkafka call does
        release.wait()
    caller = Caller()
    with pytest.raises(Wedged, match="stuck did not return within 0.2s"):
        caller(stuck, 0.1, wedged_after=0.1)
    release.set()
    assert Caller()(lambda timeout: timeout * 2, 0.5) == 1.0


def test_a_call_that_returns_or_raises_within_its_grace_is_handed_back_as_it_did():
    caller = Caller()
    assert caller(lambda x, timeout: x + 1, 41, 0.1, wedged_after=5) == 42

    def refused(timeout):
        raise ValueError("the broker said no")
    with pytest.raises(ValueError, match="the broker said no"):
        caller(refused, 0.1)


class _Delivered:
    """A delivered record as librdkafka reports it (the unit under test only asks where it landed)."""

    def topic(self):
        return "t"

    def partition(self):
        return 3

    def offset(self):
        return 41


def test_a_transactions_first_record_notes_where_it_landed_and_still_calls_the_callers_callback():
    seen = []
    first = _First(lambda err, msg: seen.append((err, msg.offset())))
    first("failed", _Delivered())
    assert first.where is None and seen == [("failed", 41)]  # a failed delivery landed nowhere
    first(None, _Delivered())
    assert first.where == ("t", 3, 41) and seen[-1] == (None, 41)
    alone = _First(None)
    alone(None, _Delivered())
    assert alone.where == ("t", 3, 41)
