"""Records in flight in a pipelined stage, committed as they finish, in any order.

A stage with a heavy-tailed handler (an LLM judge, a sandbox) must not hold finished records back until a slow
one before them is done. So each transaction carries the outputs of every record finished since the last one,
in any order, and commits per partition:

- the offset of the first record not finished yet (Kafka's committed offset: everything before is done), and
- in the offset's metadata, which records past it are done too ("done ahead"), as a bitmap.

Both go into the same transaction as the outputs, so they become visible together or not at all. A worker that
takes the partition over (after a crash or a rebalance) reads from the committed offset and skips the records
the metadata lists: none is handled twice, none is lost. Confluent's Parallel Consumer keeps its offset map
the same way.
"""
from __future__ import annotations

import base64
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

#: Prefix of the committed-offset metadata this module writes; other metadata is ignored.
METADATA_PREFIX = "rls1:"
#: The broker refuses larger offset metadata (offset.metadata.max.bytes defaults to 4096).
METADATA_MAX_BYTES = 4000

Partition = tuple[str, int]


@dataclass(eq=False)
class Slot:
    """One consumed record: its message, its decoded input, and the handler's future or final result."""

    msg: Any  # confluent_kafka.Message (anything with topic(), partition(), offset())
    item: Any = None
    future: Any = None  # concurrent.futures.Future of the handler's result
    result: Any = None  # final result when known without a future (rejected at decode, or done before)
    admitted_at: float = 0.0
    emitted: bool = False  # its outputs are in an (open or committed) transaction, or it was done before
    _has_result: bool = field(default=False, repr=False)
    _done: bool = field(default=False, repr=False)
    _watched: bool = field(default=False, repr=False)
    _on_done: Any = field(default=None, repr=False)
    counted: int = field(default=0, repr=False)  # in its window's counts: 0 not, 1 running, 2 ready

    def __post_init__(self) -> None:
        if self.future is not None:
            self.attach(self.future)

    def attach(self, future: Any, on_done: Callable[["Slot"], None] | None = None) -> None:
        """Hold the handler's future; the slot is told when it is done (its done-callback) rather than asking, and
        then hands itself to ``on_done`` (the window's, on whichever thread finished the handler)."""
        self.future, self._watched, self._on_done = future, True, on_done
        future.add_done_callback(self._finished)

    def _finished(self, _future: Any) -> None:
        self._done = True
        if self._on_done is not None:
            self._on_done(self)

    def release(self) -> None:
        """Behind the commit point, its outputs produced: let go of its future, input and outputs. The future's
        done-callback (``_finished``) refers back to this slot, a reference cycle per record around its decoded
        input and its outputs that only the cyclic garbage collector would otherwise free (runtime/chain.py's
        ``_BothSync`` measures what such cycles cost)."""
        self.future = self.item = self.result = None

    def resolve(self, result: Any) -> None:
        """Settle the slot without a handler (e.g. rejected at decode)."""
        self.result, self._has_result = result, True

    @property
    def done(self) -> bool:
        # The runner asks this of every slot in the window on each turn of its loop, and a future's done() takes
        # the future's lock: an attached future's callback says it instead, and an answer once true is kept (a
        # future never stops being done).
        if not self._done and not self._watched:
            self._done = self.future is not None and self.future.done()
        return self._done or self._has_result

    def outcome(self) -> Any:
        """The handler's result (or rejection); only for a done slot."""
        return self.result if self._has_result else self.future.result()


def encode_done_ahead(base: int, done: Iterable[int]) -> str:
    """Metadata for a committed offset ``base``: a bitmap of the offsets from it on that are done."""
    bits = sorted(o - base for o in done if o >= base)
    if not bits:
        return ""
    raw = bytearray(bits[-1] // 8 + 1)
    for b in bits:
        raw[b // 8] |= 1 << (b % 8)
    text = METADATA_PREFIX + base64.b64encode(bytes(raw)).decode()
    if len(text) > METADATA_MAX_BYTES:
        raise ValueError(f"done-ahead map of {len(bits)} offsets over {bits[-1]} exceeds {METADATA_MAX_BYTES} bytes")
    return text


def decode_done_ahead(base: int, metadata: str | None) -> set[int]:
    """The offsets from ``base`` on that ``metadata`` (from encode_done_ahead) lists as done."""
    if not metadata or not metadata.startswith(METADATA_PREFIX):
        return set()
    raw = base64.b64decode(metadata[len(METADATA_PREFIX):])
    return {base + i * 8 + j for i, byte in enumerate(raw) for j in range(8) if byte >> j & 1}


def done_ahead_offsets(offsets: dict[Partition, int], done: Iterable[tuple[str, int, int]]) -> tuple[list, int]:
    """Commit points for a consumer that finishes records out of order without a pipelined window (the trainer):
    per partition (topic, partition, offset, done-ahead metadata or None), and how many done offsets did not fit
    the metadata (the highest ones are left out: read again after a restart, they are handled twice)."""
    by_part: dict[Partition, list[int]] = {}
    for topic, partition, offset in done:
        by_part.setdefault((topic, partition), []).append(offset)
    points, left_out = [], 0
    for (topic, partition), base in offsets.items():
        ahead = sorted(o for o in by_part.get((topic, partition), ()) if o >= base)
        while True:
            try:
                metadata = encode_done_ahead(base, ahead)
                break
            except ValueError:
                keep = ahead[:len(ahead) * 3 // 4]
                left_out += len(ahead) - len(keep)
                ahead = keep
        points.append((topic, partition, base, metadata or None))
    return points, left_out


def committed_done_ahead(consumer, partitions: list) -> set[tuple[str, int, int]]:
    """(topic, partition, offset) of every record the committed offsets' metadata of ``partitions`` lists as done."""
    if not partitions:
        return set()
    return {(tp.topic, tp.partition, o) for tp in consumer.committed(partitions, timeout=30) if tp.offset >= 0
            for o in decode_done_ahead(tp.offset, tp.metadata)}


class _Partition:
    __slots__ = ("slots", "done_before", "first")

    def __init__(self) -> None:
        self.slots: deque[Slot] = deque()  # every consumed record not yet behind the commit point, in order
        self.done_before: set[int] = set()  # offsets the committed metadata lists as done (skip on re-read)
        # Where a rewind goes: the last committed offset, or the first record consumed when none is known.
        self.first: int | None = None


class OffsetWindow:
    """The records a pipelined stage has consumed and not yet committed past, per partition in offset order."""

    def __init__(self) -> None:
        self._parts: dict[Partition, _Partition] = {}
        self._committed: dict[Partition, tuple[int, str]] = {}  # the last commit point known to be committed
        self.size = 0  # slots held (finished or not)
        # The runner's view of its handlers, kept as they finish rather than found by looking: it sleeps on one
        # event (concurrent.futures.wait put a waiter on every running future, under its lock, each turn) and
        # reads two counts (a scan of the window each turn was a tenth of a pipelined hop's CPU at 1,000 records
        # in flight). Finished slots arrive on the handlers' threads into ``_finished`` (a deque: appends are
        # thread-safe); the counts are the runner's alone, brought up to date by ``progress``.
        self._finished: deque[Slot] = deque()
        self._wake = threading.Event()
        self._running = 0  # attached slots whose handler has not been seen to finish
        self._ready = 0  # finished slots not yet emitted

    def attach(self, slot: Slot, future: Any) -> None:
        """Hold ``slot``'s handler future; its end wakes ``wait_finished`` and counts in ``progress``."""
        self._running += 1
        slot.counted = 1
        slot.attach(future, self._on_finished)

    def _on_finished(self, slot: Slot) -> None:
        self._finished.append(slot)
        # Set only when not set: Event.set takes the event's lock, which every handler thread finishing a record
        # contended for (a tenth of a pipelined hop's CPU). No wake-up is lost: ``wait_finished`` clears the event
        # before ``progress`` drains the deque, so a slot appended after that drain finds the event clear.
        if not self._wake.is_set():
            self._wake.set()

    def resolve(self, slot: Slot, result: Any) -> None:
        """Settle a held slot without a handler (rejected at decode, handled before by a chain)."""
        slot.resolve(result)
        slot.counted = 2
        self._ready += 1

    def wait_finished(self, timeout: float) -> None:
        """Sleep until a handler attached since the last call finished (or one finished in between), at most
        ``timeout`` seconds. Call ``progress`` after it (``_on_finished`` relies on that order)."""
        self._wake.wait(timeout)
        self._wake.clear()

    def set_committed(self, partition: Partition, base: int, metadata: str | None) -> None:
        """What the partition's committed offset says: records it lists as done are skipped when read again."""
        part = self._parts.setdefault(partition, _Partition())
        part.done_before = decode_done_ahead(base, metadata)
        part.first = base
        self._committed[partition] = (base, metadata or "")

    def mark_committed(self, points: dict[Partition, tuple[int, str]]) -> None:
        """The transaction carrying these commit points (from commit_points) is committed."""
        self._committed.update(points)
        for key, (base, _) in points.items():
            self._parts[key].first = base

    def rewind(self) -> tuple[list[Slot], dict[Partition, int]]:
        """The open transaction is aborted: forget every slot and return to the last committed points.

        Returns the dropped slots and, per partition, the offset the consumer must seek back to.
        """
        dropped: list[Slot] = []
        rewind_to: dict[Partition, int] = {}
        for key, part in self._parts.items():
            dropped.extend(part.slots)
            if part.first is not None:
                rewind_to[key] = part.first
            part.slots.clear()
            part.done_before.clear()
        self._count_out(dropped)
        self.size = 0
        for key, (base, metadata) in self._committed.items():
            self._parts[key].done_before = decode_done_ahead(base, metadata)
        return dropped, rewind_to

    def add(self, slot: Slot) -> Slot:
        """Hold a newly consumed record; one done before (per the committed metadata) is marked emitted."""
        key = (slot.msg.topic(), slot.msg.partition())
        part = self._parts.setdefault(key, _Partition())
        offset = slot.msg.offset()
        if part.slots and part.slots[-1].msg.offset() >= offset:
            # A rewind without a drop would emit a record twice; refuse rather than duplicate.
            raise ValueError(f"{key} offset {offset} admitted after {part.slots[-1].msg.offset()}")
        if part.first is None:
            part.first = offset
        if offset in part.done_before:
            part.done_before.discard(offset)
            slot.resolve(None)
            slot.emitted = True
        part.slots.append(slot)
        self.size += 1
        return slot

    def is_done_before(self, partition: Partition, offset: int) -> bool:
        part = self._parts.get(partition)
        return part is not None and offset in part.done_before

    def count_ready(self) -> int:
        """How many finished slots wait for a transaction."""
        return sum(1 for p in self._parts.values() for s in p.slots if not s.emitted and s.done)

    def ready(self) -> list[Slot]:
        """Finished slots whose outputs are not in a transaction yet; marks them emitted."""
        self.progress()  # the slots it takes are counted first, so none is counted ready after it is emitted
        out = []
        for part in self._parts.values():
            for slot in part.slots:
                if not slot.emitted and slot.done:
                    slot.emitted = True
                    out.append(slot)
                    if slot.counted == 2:
                        slot.counted = 0
                        self._ready -= 1
        return out

    def commit_points(self) -> dict[Partition, tuple[int, str]]:
        """Per partition with emitted records: (offset to commit, done-ahead metadata); trims what it passes.

        Call after the ready() slots' outputs are produced into the transaction that commits these.
        """
        points: dict[Partition, tuple[int, str]] = {}
        for key, part in self._parts.items():
            slots = part.slots
            if not any(s.emitted for s in slots):
                continue
            while slots and slots[0].emitted:
                last = slots.popleft()
                self.size -= 1
                base = last.msg.offset() + 1
                last.release()
            if slots:
                base = slots[0].msg.offset()
                ahead = [s.msg.offset() for s in slots if s.emitted]
            else:
                ahead = []
            # Offsets listed before and not read again yet stay listed until the commit point passes them.
            ahead += [o for o in part.done_before if o >= base]
            points[key] = (base, encode_done_ahead(base, ahead) if ahead else "")
        return points

    def unfinished(self) -> list[Any]:
        """The futures still running."""
        return [s.future for p in self._parts.values() for s in p.slots if s.future is not None and not s.done]

    def progress(self) -> tuple[bool, int]:
        """Whether a handler attached here still runs, and how many finished slots wait for a transaction (as
        ``count_ready``, without a pass over the window)."""
        finished = self._finished
        while finished:
            slot = finished.popleft()
            if slot.counted != 1:
                continue  # counted out when it was dropped
            self._running -= 1
            slot.counted = 0
            if not slot.emitted:
                slot.counted = 2
                self._ready += 1
        return self._running > 0, self._ready

    def _count_out(self, slots: Iterable[Slot]) -> None:
        """Dropped slots leave the counts (a handler of one finishing later is not counted again)."""
        for slot in slots:
            if slot.counted == 1:
                self._running -= 1
            elif slot.counted == 2:
                self._ready -= 1
            slot.counted = 0

    def drop(self, partitions: Iterable[Partition]) -> list[Slot]:
        """Forget these partitions (revoked, or rewound); returns their slots so their futures can be cancelled."""
        gone: list[Slot] = []
        for key in partitions:
            self._committed.pop(key, None)
            part = self._parts.pop(key, None)
            if part is not None:
                gone.extend(part.slots)
        self._count_out(gone)
        self.size -= len(gone)
        return gone

    def remaining_done(self, partition: Partition, base: int) -> str:
        """Metadata for committing ``base`` without a pipelined window: the listed offsets not passed yet."""
        part = self._parts.get(partition)
        if part is None:
            return ""
        return encode_done_ahead(base, part.done_before)

    def __iter__(self) -> Iterator[Slot]:
        for part in self._parts.values():
            yield from part.slots
