"""Closed gateway episodes onto ``trajectories``, in Kafka transactions.

The gateway reads no topic: an episode lives in its memory until it closes, then its trajectories are produced in
one transaction (closes that arrive together share one), keyed by group id like the env stage's, with the oldest
version of their tokens as the ``policy_version`` header. A close is answered only once its transaction committed.
So a gateway killed mid-episode has written nothing of that episode, and one killed inside a transaction leaves
only an open transaction, which read_committed consumers never see and which the next gateway of the same
``--instance`` (the transactional id ``<run>.gateway.<instance>``) aborts when it starts.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future

from rlstream import metrics
from rlstream.config import KafkaSettings
from rlstream.kafka.records import encode
from rlstream.kafka.topics import topic_name
from rlstream.kafka.transactions import TransactionalProducer
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import Trajectory

log = logging.getLogger(__name__)


class TrajectoryWriter:
    """``submit`` trajectories; the future resolves once they are committed."""

    def __init__(self, kafka: KafkaSettings, instance: str, commit_pause_s: float = 0.0):
        """``commit_pause_s``: how long each transaction waits before its commit (tests kill inside it)."""
        self.kafka, self.commit_pause_s = kafka, commit_pause_s
        self._stop = threading.Event()
        self.producer = TransactionalProducer(kafka, f"{kafka.run}.gateway.{instance}", who="gateway",
                                              stopping=self._stop.is_set)
        self._queue: queue.Queue[tuple[list[Trajectory], str, Future]] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="gateway-writer", daemon=True)

    def start(self) -> None:
        """Fence an earlier instance (aborting its open transaction), then start writing."""
        self.producer.start()
        self._thread.start()

    def submit(self, trajectories: list[Trajectory], traceparent: str) -> Future:
        done: Future = Future()
        if not trajectories:
            done.set_result(0)
        else:
            self._queue.put((trajectories, traceparent, done))
        return done

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                batch = [self._queue.get(timeout=0.2)]
            except queue.Empty:
                continue
            while True:  # every close waiting now goes into this transaction
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write(batch)
            except Exception as exc:  # fenced, or a fault that outlived the producer's own recovery
                log.exception("gateway: writing %d closed sessions failed", len(batch))
                for _, _, done in batch:
                    done.set_exception(exc)
                continue
            for trajs, _, done in batch:
                metrics.RECORDS_OUT.labels("gateway", "trajectories").inc(len(trajs))
                done.set_result(len(trajs))

    def _write(self, batch: list[tuple[list[Trajectory], str, Future]]) -> None:
        topic = topic_name(self.kafka.run, "trajectories")

        def body() -> None:
            for trajs, traceparent, _ in batch:
                for traj in trajs:
                    headers = hdr.build(traj.min_policy_version, hdr.child_traceparent(traceparent))
                    self.producer.produce(topic, encode("trajectories", traj), traj.group_id, headers)
            if self.commit_pause_s:
                time.sleep(self.commit_pause_s)

        # False: aborted by a broker fault; nothing of it is visible, so the same batch is written again.
        while not self.producer.transact(body):
            time.sleep(0.5)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self.producer.flush(10)
