"""Committing the transaction that announces a version, once its step has run.

The step has already moved the model, so an aborted announce cannot be redone by reading the samples again, as a
stage redoes a batch: it is tried again with the same outputs (the version's record, its dead letters, the offsets
of the samples it trained on), up to ``ATTEMPTS`` times. One invariant makes that safe, enforced here: the offsets
are committed with the group metadata of a consumer that holds their partitions now. When the broker refused the
commit because the trainer's consumer lost its place in the group (``MEMBERSHIP_LOST``: after a broker outage a
static member can be fenced by its own rejoin), the consumer is replaced and rejoins first, and the announce goes
again only if it got back every partition the offsets name. Otherwise the process exits to resume
(``RestartToResume``, the caller's): the step is redone from the last announced version.

A version is announced once. ``transact`` already tells a commit whose answer was lost from an abort (it settles it
from the log: ``kafka.transactions``); before each new try the log is asked all the same whether the version is
there, because announcing one version twice costs more than that read.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable

from rlstream.config import KafkaSettings
from rlstream.errors import RestartToResume
from rlstream.kafka.group import MEMBERSHIP_LOST, GroupMember
from rlstream.kafka.transactions import Offset, TransactionalProducer
from rlstream.policy.watcher import last_policy_version

log = logging.getLogger(__name__)

#: Tries of one version's announce before the process exits to redo its step.
ATTEMPTS = 3


def announce(txn: TransactionalProducer, member: GroupMember | None, body: Callable[[], Iterable[Offset]],
             partitions: set[tuple[str, int]], what: str, announced: Callable[[], bool]) -> tuple[bool, bool]:
    """Run ``body`` (which returns offsets in ``partitions`` only) in ``txn`` with ``member``'s group metadata
    until it commits, or ``announced()`` says an earlier try did: (committed, rejoined). Rejoined: the member's
    consumer is a new one, positioned anywhere; the caller moves it back to the committed offsets
    (``GroupMember.seek_committed``) and forgets what the old one had read."""
    rejoined = False
    for attempt in range(1, ATTEMPTS + 1):
        if txn.transact(body, lambda: member.consumer.consumer_group_metadata()):
            return True, rejoined
        if attempt == ATTEMPTS:
            break
        err = txn.failure  # None when the producer was replaced instead (logged by it)
        if err is not None and err.code() in MEMBERSHIP_LOST:
            rejoined = True
            missing = partitions - member.rejoin(err)
            if missing:
                log.error("%s: the trainer's consumer rejoined its group without %s; their offsets cannot be "
                          "committed", what, sorted(missing))
                break
        if announced():
            log.warning("%s: the transaction reported as failed had committed; not announcing it again", what)
            return True, rejoined
        log.warning("%s: announcing it again with the same outputs (attempt %d of %d)", what, attempt + 1, ATTEMPTS)
    return False, rejoined


def in_log(kafka: KafkaSettings, policy: str, version: int) -> Callable[[], bool]:
    """``announce``'s ``announced``: whether the run's log holds ``version`` of ``policy``; when the log does not
    answer, the process exits to resume (announcing again might announce it twice)."""
    def announced() -> bool:
        try:
            pv = last_policy_version(kafka.client_config(), kafka.run, policy)
        except TimeoutError:
            raise RestartToResume(f"trainer: cannot tell whether {policy} v{version} was announced (the log did not "
                                  "answer); a restart resumes from what it says") from None
        return pv is not None and pv.version >= version
    return announced
