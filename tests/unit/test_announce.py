"""The announce's retry decisions (``trainer/announce.py``). The broker behaviours behind two of them (a third
refusal in a row; a rejoin that comes back without a partition) cannot be forced on the real broker with one
trainer, so this test alone stands the transaction and the group member in with stand-ins; the path a fenced
consumer takes on the real broker is ``tests/integration/test_trainer_membership.py``."""
from __future__ import annotations

from confluent_kafka import KafkaError

from rlstream.trainer import announce as ann


class Txn:
    """Fails the first ``fails`` transactions with ``code``."""

    def __init__(self, fails: int, code: int):
        self.fails, self.code, self.tries, self.failure = fails, code, 0, None

    def transact(self, body, group_metadata):
        self.tries += 1
        body()
        self.failure = KafkaError(self.code) if self.tries <= self.fails else None
        return self.failure is None


class Member:
    def __init__(self, held):
        self.held, self.rejoins = held, 0
        self.consumer = None

    def rejoin(self, err):
        self.rejoins += 1
        return self.held


PARTS = {("r.rewards", 0), ("r.rewards", 1)}


def test_an_aborted_announce_goes_again_and_a_lost_member_rejoins_first():
    txn, member = Txn(1, KafkaError.FENCED_INSTANCE_ID), Member(PARTS)
    assert ann.announce(txn, member, lambda: [], PARTS, "v2", lambda: False) == (True, True)
    assert (txn.tries, member.rejoins) == (2, 1)
    # A retriable failure that is not the member's: the same outputs again, no rejoin.
    txn, member = Txn(2, KafkaError._TIMED_OUT), Member(PARTS)
    assert ann.announce(txn, member, lambda: [], PARTS, "v2", lambda: False) == (True, False)
    assert (txn.tries, member.rejoins) == (3, 0)


def test_it_gives_up_after_its_attempts_or_without_a_partition_it_commits():
    txn = Txn(ann.ATTEMPTS, KafkaError._TIMED_OUT)
    assert ann.announce(txn, Member(PARTS), lambda: [], PARTS, "v2", lambda: False) == (False, False)
    assert txn.tries == ann.ATTEMPTS
    txn, member = Txn(1, KafkaError.UNKNOWN_MEMBER_ID), Member({("r.rewards", 0)})
    assert ann.announce(txn, member, lambda: [], PARTS, "v2", lambda: False) == (False, True)
    assert txn.tries == 1, "offsets of a partition the rejoined member lacks were committed"


def test_a_commit_reported_failed_that_went_through_is_not_announced_twice():
    txn = Txn(1, KafkaError._TIMED_OUT)
    assert ann.announce(txn, Member(PARTS), lambda: [], PARTS, "v2", lambda: True) == (True, False)
    assert txn.tries == 1
