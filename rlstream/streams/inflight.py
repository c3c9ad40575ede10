"""Records in flight in a pipelined stage, released per partition in offset order.

A stage with a heavy-tailed handler (an LLM judge, a sandbox) must not hold every record of a batch until the
slowest one is done. The runtime keeps up to ``concurrency`` records in flight across polls instead and commits
whatever is ready. Exactly-once still needs one rule: a transaction that commits offset ``o`` of a partition
must carry the outputs of every record of that partition before ``o``. So a finished record is released only
when every earlier record of its partition is finished too; a slow record delays its own partition's later
records, never the other partitions or new work.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator


@dataclass(eq=False)
class Slot:
    """One consumed record: its message, its decoded input, and the handler's future or final result."""

    msg: Any  # confluent_kafka.Message (anything with topic(), partition(), offset())
    item: Any = None
    future: Any = None  # concurrent.futures.Future of the handler's result
    result: Any = None  # final result when known without a future (a record rejected at decode)
    admitted_at: float = 0.0
    _has_result: bool = field(default=False, repr=False)

    def resolve(self, result: Any) -> None:
        """Settle the slot without a handler (e.g. rejected at decode)."""
        self.result, self._has_result = result, True

    @property
    def done(self) -> bool:
        return self._has_result or (self.future is not None and self.future.done())

    def outcome(self) -> Any:
        """The handler's result (or rejection); only for a done slot."""
        return self.result if self._has_result else self.future.result()


class InOrderWindow:
    """Slots keyed by partition, each partition in consumption (offset) order."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, int], deque[Slot]] = {}
        self.size = 0

    def add(self, slot: Slot) -> Slot:
        key = (slot.msg.topic(), slot.msg.partition())
        queue = self._parts.setdefault(key, deque())
        if queue and queue[-1].msg.offset() >= slot.msg.offset():
            # A rewind without a drop would release a record twice; refuse rather than duplicate.
            raise ValueError(f"{key} offset {slot.msg.offset()} admitted after {queue[-1].msg.offset()}")
        queue.append(slot)
        self.size += 1
        return slot

    def release(self) -> list[Slot]:
        """Remove and return every slot that is done and has no unfinished slot before it in its partition."""
        out: list[Slot] = []
        for key in list(self._parts):
            queue = self._parts[key]
            while queue and queue[0].done:
                out.append(queue.popleft())
            if not queue:
                del self._parts[key]
        self.size -= len(out)
        return out

    def unfinished(self) -> list[Any]:
        """The futures still running."""
        return [s.future for q in self._parts.values() for s in q if s.future is not None and not s.future.done()]

    def drop(self, partitions: Iterable[tuple[str, int]]) -> list[Slot]:
        """Forget the slots of these partitions (revoked, or rewound); returns them so their futures can be cancelled."""
        gone: list[Slot] = []
        for key in partitions:
            gone.extend(self._parts.pop(key, ()))
        self.size -= len(gone)
        return gone

    def clear(self) -> list[Slot]:
        """Forget every slot; returns them in partition order."""
        return self.drop(list(self._parts))

    def __iter__(self) -> Iterator[Slot]:
        for queue in self._parts.values():
            yield from queue


def first_offsets(slots: Iterable[Slot]) -> dict[tuple[str, int], int]:
    """The lowest offset of each partition among ``slots``: where a rewind must seek to."""
    first: dict[tuple[str, int], int] = {}
    for s in slots:
        key = (s.msg.topic(), s.msg.partition())
        first[key] = min(first.get(key, s.msg.offset()), s.msg.offset())
    return first
