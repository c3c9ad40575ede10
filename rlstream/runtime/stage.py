"""The Stage API: what a stream processor implements, and the few things it may ask of the runtime.

A stage maps typed input records (``Incoming``) to typed outputs (``Output``); it never touches Kafka. The runner
takes its inputs decoded from a source, calls it, encodes its outputs and commits them with the input offsets.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from rlstream.config import KafkaSettings
from rlstream.kafka.records import Incoming
from rlstream.schemas.records import Record

__all__ = ["Incoming", "InvalidRecord", "Output", "Stage", "StageContext", "SyncHandler"]


class InvalidRecord(ValueError):
    """Raised by a stage's handler for input that decodes but is not acceptable (dead-letter reason ``invalid``)."""


@dataclass
class Output:
    """A record a handler wants produced; headers default to the input's."""

    topic: str  # logical name
    key: str | bytes | None
    record: Record
    policy_version: int | None = None
    reward_version: str | None = None
    extra_headers: tuple[tuple[str, str], ...] = ()  # headers of the stage's own (the teacher's version)
    # How to encode ``record`` more cheaply than whole: a stage that carries its input on as the bytes it arrived in
    # (schemas.splice) gives a function that writes the value. The runner calls it where it encodes every output,
    # so a value that cannot be encoded is dead-lettered the same way either way. None: the runner encodes ``record``.
    value: Callable[[], bytes] | None = None


@dataclass(frozen=True)
class SyncHandler:
    """A per-record handler the runtime calls straight on a pool thread, with no event loop in between (a task, an
    executor hop and a loop wake-up per record cost more than an exact-match judge or a single-turn env).

    A sync handler cannot be interrupted: one still running ``timeout_s`` after it started (None: the runtime's
    handler timeout, if that is shorter) is given up on, its thread left to finish and its result dropped, and its
    record gets ``timed_out(item)``'s outputs (None: dead-lettered as ``handler_timeout``)."""

    fn: Callable[[Incoming], list[Output]]
    timeout_s: float | None = None
    timed_out: Callable[[Incoming], list[Output]] | None = None


class Stage:
    """A stream processor: override ``handle`` (per record) or ``handle_batch``.

    ``handle`` may be sync (run in a pool thread, ``SyncHandler``) or ``async`` (on the runtime's event loop); both
    get a timeout.

    The runner drives a stage one of two ways, asking ``batched`` once when it starts: one batch per transaction
    (``handle_batch``), or pipelined (``handle`` per record, records in flight across polls, each committed as it
    finishes). A stage that has both handlers picks per instance (rollout: batched on an in-process engine,
    pipelined on a server fleet).
    """

    name: str = "stage"
    inputs: tuple[str, ...] = ()
    #: Whether records without a policy_version header are accepted (sources outside the loop).
    require_policy_version: bool = True
    #: Least seconds a record's handler may run before it is dead-lettered as ``handler_timeout`` (None: the
    #: runtime's ``--handler-timeout-s`` alone); the runtime takes the larger of the two.
    handler_timeout_s: float | None = None
    #: Whether the per-token arrays of its inputs may come as read-only ``TokenView``s over their packed bytes
    #: instead of lists (``rlstream.schemas.packed``): for a stage that reads tokens and never edits them in place.
    token_views: bool = False
    #: Most records in flight a pipelined stage wants (None: the runtime's ``--max-in-flight``); the runtime takes
    #: the smaller of the two.
    max_in_flight: int | None = None

    @property
    def batched(self) -> bool:
        """Whether the runner calls ``handle_batch`` (one batch per transaction) rather than pipelining ``handle``.
        By default: whether the class overrides ``handle_batch``."""
        return type(self).handle_batch is not Stage.handle_batch

    def handle(self, item: Incoming) -> list[Output]:
        raise NotImplementedError

    def sync_handler(self) -> SyncHandler | None:
        """The pipelined runtime's per-record handler when it is sync (None: ``handle`` runs on the event loop).
        By default ``handle`` itself when it is not ``async``; a stage whose ``handle`` awaits something that may
        be sync (the reward stage's function) offers its sync path here."""
        return None if inspect.iscoroutinefunction(self.handle) else SyncHandler(self.handle)

    def handle_batch(self, items: list[Incoming]) -> list[list[Output] | Exception] | None:
        """Handle a whole batch at once (e.g. batched generation); None means per record.

        One entry per item, in order. An entry that is an exception (``InvalidRecord``: reason ``invalid``)
        dead-letters that record alone; raising fails the batch, which is then retried record by record.
        """
        return None

    def prepare(self, ctx: "StageContext") -> None:
        """Load what the first batch needs (engines, weights) before the runner joins its group: a warm standby
        (``--standby``) calls it, then waits. Default: nothing; what is not loaded here loads in ``before_poll``."""

    def before_poll(self, ctx: "StageContext") -> None:
        """Called between batches, outside any transaction: reload weights, pause, resume."""

    def close(self) -> None:
        """Release what the stage holds (engines, pools)."""


def each_alone(handle: Callable[[Incoming], list[Output]], items: list[Incoming]) -> list[list[Output] | Exception]:
    """A ``handle_batch`` made of a per-record handler called on this thread, one record after another: each
    record's outputs, or the exception it raised in its place (that record alone dead-lettered, as
    ``Stage.handle_batch`` says)."""
    out: list[list[Output] | Exception] = []
    for item in items:
        try:
            out.append(handle(item))
        except Exception as exc:
            out.append(exc)
    return out


class StageContext:
    """What a stage may do to its own consumption: pause and resume partitions."""

    def __init__(self, kafka: KafkaSettings, set_paused: Callable[[str, bool], None], paused_topics: set[str],
                 backlog: Callable[[str], int] = lambda topic: 0):
        self._kafka = kafka
        self._set_paused = set_paused
        self._paused = paused_topics  # the runner's own set: it re-applies these after a rebalance
        self._backlog = backlog

    def pause(self, logical_topic: str) -> None:
        """Stop fetching a topic (backpressure); records wait in Kafka."""
        self._set_paused(logical_topic, True)

    def resume(self, logical_topic: str) -> None:
        self._set_paused(logical_topic, False)

    def is_paused(self, logical_topic: str) -> bool:
        return logical_topic in self._paused

    def backlog(self, logical_topic: str) -> int:
        """Records of an input topic waiting on this worker's partitions, as of the last fetch (no broker round
        trip): what a stage serving one input first checks before letting the others in."""
        return self._backlog(logical_topic)

    @property
    def kafka(self) -> KafkaSettings:
        """The process's Kafka settings, for stages that open clients of their own (policy watchers)."""
        return self._kafka
