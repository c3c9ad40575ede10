"""Windowed FIFO over grouped samples, for the trainer's consumer.

Pure logic, no Kafka. Records arrive in log order; each belongs to a group
(``group_id``) of expected size ``group_size`` (the G samples of one prompt).
Groups are ordered by the arrival of their first item, and only the first W
held groups form the window. A batch takes complete groups from inside the
window in any order, so one straggler does not stall training, but never from
beyond it, so fast-finishing samples are not favoured (Forge's rule). An
incomplete head group older than a timeout is evicted and handed back to be
recorded. Offsets are committable only up to what has been consumed.

Choices the spec leaves open:

* **Oversized groups.** A group is complete once it holds ``group_size`` items.
  Extra items that arrive before it is taken stay in it and are taken with it
  (nothing lost, completion not blocked). Items that arrive for a group that was
  already taken or evicted are *late*: they are not re-opened as a new group
  (which would sit at the head, incomplete, until it timed out) but are handed
  back by the next :meth:`WindowedFIFO.evict_expired` as a ``Group`` with
  ``late=True``, so they are recorded, not trained on and not dropped.
* **Duplicates.** Items arrive in log order per partition, so any offset at or
  below the highest one seen on its partition is a redelivery and is ignored.
  This keeps dedup O(1) in memory per partition instead of remembering every
  position. Call :meth:`WindowedFIFO.clear` after seeking back.
* **Refused samples.** A sample the trainer refuses (stale) will never arrive;
  :meth:`WindowedFIFO.refuse` counts it, and the group completes without it
  (trained as a smaller group, or dropped if nothing of it arrived in time).
* **Group age** is measured on the window's own clock, stamped when the group's
  first item is added, not from ``WindowItem.arrived_at``, which the caller may
  take from any clock (e.g. a record's ``produced_at``).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["WindowItem", "Group", "WindowedFIFO"]

TopicPartition = tuple[str, int]


@dataclass
class WindowItem:
    """One sample: its group, expected group size, (topic, partition, offset), and payload."""

    group_id: str
    group_size: int
    position: tuple[str, int, int]
    arrived_at: float
    payload: Any


@dataclass(frozen=True)
class Group:
    """A group handed out by the window: its items in arrival order.

    ``first_arrived_at`` is on the window's clock. ``late`` marks items that
    arrived after their group had already been taken or evicted.
    """

    group_id: str
    group_size: int
    items: tuple[WindowItem, ...]
    first_arrived_at: float
    late: bool = False
    refused: int = 0  # samples of the group that were refused (stale) and will never arrive

    @property
    def complete(self) -> bool:
        """True if every sample of the group arrived or was refused."""
        return len(self.items) + self.refused >= self.group_size

    def __len__(self) -> int:
        return len(self.items)


@dataclass
class _OpenGroup:
    group_id: str
    group_size: int
    first_arrived_at: float
    items: list[WindowItem] = field(default_factory=list)
    refused: int = 0

    @property
    def done(self) -> bool:
        return len(self.items) + self.refused >= self.group_size

    def freeze(self, late: bool = False) -> Group:
        return Group(self.group_id, self.group_size, tuple(self.items), self.first_arrived_at, late, self.refused)


class _PartitionOffsets:
    """Held offsets of one partition, to find the smallest still held in amortised O(1)."""

    __slots__ = ("highest", "held", "released")

    def __init__(self) -> None:
        self.highest = -1
        # Offsets are appended in increasing order (log order), so the deque is
        # sorted; releases happen in any order, so they are marked and the front
        # is trimmed lazily instead of removing from the middle.
        self.held: deque[int] = deque()
        self.released: set[int] = set()

    def release(self, offset: int) -> None:
        self.released.add(offset)
        held, released = self.held, self.released
        while held and held[0] in released:
            released.discard(held.popleft())

    def committable(self) -> int:
        return self.held[0] if self.held else self.highest + 1


class WindowedFIFO:
    """Windowed FIFO of groups: take complete groups from the first W, evict a stale head.

    ``window_groups`` is W, ``head_timeout_s`` the age after which an incomplete
    head group is evicted, ``clock`` a monotonic time source (seconds).
    ``closed_memory`` bounds how many taken/evicted group ids are remembered to
    spot late items; an item for a group forgotten beyond that opens a new group,
    which is still evicted and recorded after the timeout, so nothing is lost.
    """

    def __init__(
        self,
        window_groups: int,
        head_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        closed_memory: int = 65536,
    ) -> None:
        if window_groups < 1:
            raise ValueError(f"window_groups must be >= 1, got {window_groups}")
        if head_timeout_s < 0:
            raise ValueError(f"head_timeout_s must be >= 0, got {head_timeout_s}")
        if closed_memory < 0:
            raise ValueError(f"closed_memory must be >= 0, got {closed_memory}")
        self.window_groups = window_groups
        self.head_timeout_s = head_timeout_s
        self.closed_memory = closed_memory
        self._clock = clock
        self._groups: OrderedDict[str, _OpenGroup] = OrderedDict()
        self._late: OrderedDict[str, _OpenGroup] = OrderedDict()
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._partitions: dict[TopicPartition, _PartitionOffsets] = {}
        self._pending = 0
        self.duplicates_ignored = 0

    # -- input ---------------------------------------------------------------

    def add(self, item: WindowItem) -> bool:
        """Add one item in log order; return False if its position was already seen."""
        if item.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {item.group_size}")
        topic, partition, offset = item.position
        tp = (topic, partition)
        part = self._partitions.get(tp)
        if part is None:
            part = self._partitions[tp] = _PartitionOffsets()
        if offset <= part.highest:
            self.duplicates_ignored += 1
            return False
        part.highest = offset
        part.held.append(offset)
        self._pending += 1

        gid = item.group_id
        group = self._groups.get(gid)
        if group is None:
            if gid in self._closed:
                group = self._late.get(gid)
                if group is None:
                    group = self._late[gid] = _OpenGroup(gid, item.group_size, self._clock())
            else:
                group = self._groups[gid] = _OpenGroup(gid, item.group_size, self._clock())
        group.items.append(item)
        return True

    def skip(self, position: tuple[str, int, int]) -> None:
        """Count an item already trained or evicted before a restart as consumed, without holding it."""
        topic, partition, offset = position
        part = self._partitions.setdefault((topic, partition), _PartitionOffsets())
        if offset > part.highest:
            part.highest = offset
            part.held.append(offset)
            part.release(offset)

    # -- output --------------------------------------------------------------

    def take(self, max_groups: int | None = None, max_samples: int | None = None) -> list[Group]:
        """Remove and return complete groups from within the window, oldest first.

        Stops before the first group that would push the batch past
        ``max_samples``, except that an empty batch always takes one complete
        group, so a group larger than ``max_samples`` cannot wedge the window.
        """
        if (max_groups is not None and max_groups <= 0) or (
            max_samples is not None and max_samples <= 0
        ):
            return []
        # The window is fixed when the call starts: groups that slide into it
        # as earlier ones are removed wait for the next call.
        window = list(itertools.islice(self._groups.values(), self.window_groups))
        out: list[Group] = []
        samples = 0
        for group in window:
            if not group.done:
                continue
            n = len(group.items)
            if max_samples is not None and out and samples + n > max_samples:
                break
            out.append(self._close(group))
            samples += n
            if max_groups is not None and len(out) >= max_groups:
                break
            if max_samples is not None and samples >= max_samples:
                break
        return out

    def evict_expired(self) -> list[Group]:
        """Remove and return expired incomplete head groups, plus any late items held.

        The head is evicted when incomplete and older than ``head_timeout_s``;
        this repeats while the new head is also expired. A complete head stops it.
        """
        out: list[Group] = []
        if self._late:
            late = list(self._late.values())
            self._late.clear()
            for group in late:
                self._release(group)
                out.append(group.freeze(late=True))
        now = self._clock()
        while self._groups:
            head = next(iter(self._groups.values()))
            if head.done:
                break
            if now - head.first_arrived_at <= self.head_timeout_s:
                break
            out.append(self._close(head))
        return out

    def refuse(self, group_id: str, group_size: int, position: tuple[str, int, int]) -> None:
        """A sample of ``group_id`` was refused (stale): its group completes without it.

        Its offset counts as consumed. Waiting for it would hold the group, and a window slot, until the head
        timeout; the group's other samples are trained as a smaller group (advantages are per group).
        """
        self.skip(position)
        group = self._groups.get(group_id)
        if group is None:
            if group_id in self._closed:
                return  # its group was taken or evicted already
            group = self._groups[group_id] = _OpenGroup(group_id, group_size, self._clock())
        group.refused += 1
        if group.done and not group.items:
            self._close(group)  # nothing of it arrived in time: nothing to train

    # -- offsets -------------------------------------------------------------

    def committable_offsets(self) -> dict[TopicPartition, int]:
        """Per (topic, partition), the next offset safe to commit.

        That is the smallest offset still held (taken nor evicted yet), or the
        highest offset seen + 1 when nothing of that partition is held.
        """
        return {tp: part.committable() for tp, part in self._partitions.items()}

    def released_ahead(self) -> list[tuple[str, int, int]]:
        """Positions taken or evicted beyond their partition's committable offset.

        Committed offsets cannot say "done except for the held head", so these are what a restart, which reads
        again from the committed offsets, must skip to train no sample twice.
        """
        return sorted((tp[0], tp[1], o) for tp, part in self._partitions.items() for o in part.released)

    # -- inspection ----------------------------------------------------------

    def __len__(self) -> int:
        """Number of groups held in FIFO order (late items are not counted)."""
        return len(self._groups)

    @property
    def pending_samples(self) -> int:
        """Number of items held, late ones included."""
        return self._pending

    def window_group_ids(self) -> list[str]:
        """Ids of the groups currently inside the window, oldest first."""
        return [g for g in itertools.islice(self._groups.keys(), self.window_groups)]

    def complete_in_window(self) -> int:
        """How many groups inside the window are complete (what ``take`` could return)."""
        return sum(
            1
            for g in itertools.islice(self._groups.values(), self.window_groups)
            if g.done
        )

    def clear(self) -> None:
        """Forget everything, seen offsets included: call after seeking the consumer back."""
        self._groups.clear()
        self._late.clear()
        self._closed.clear()
        self._partitions.clear()
        self._pending = 0

    # -- internals -----------------------------------------------------------

    def _close(self, group: _OpenGroup) -> Group:
        del self._groups[group.group_id]
        if self.closed_memory:
            self._closed[group.group_id] = None
            if len(self._closed) > self.closed_memory:
                self._closed.popitem(last=False)
        self._release(group)
        return group.freeze()

    def _release(self, group: _OpenGroup) -> None:
        for item in group.items:
            topic, partition, offset = item.position
            self._partitions[(topic, partition)].release(offset)
        self._pending -= len(group.items)
