"""The pipelined stage's in-order window: what may be committed, and when."""
from __future__ import annotations

from concurrent.futures import Future

from hypothesis import given, settings
from hypothesis import strategies as st

from rlstream.streams.inflight import InOrderWindow, Slot, first_offsets


class Msg:
    """Stands in for a confluent_kafka.Message: only its coordinates matter to the window."""

    def __init__(self, topic: str, partition: int, offset: int):
        self._c = (topic, partition, offset)

    def topic(self):
        return self._c[0]

    def partition(self):
        return self._c[1]

    def offset(self):
        return self._c[2]


def slot(partition: int, offset: int) -> Slot:
    return Slot(Msg("t", partition, offset), future=Future())


def test_a_slow_record_holds_back_only_its_own_partition():
    w = InOrderWindow()
    slow, fast, other = w.add(slot(0, 0)), w.add(slot(0, 1)), w.add(slot(1, 0))
    fast.future.set_result(["f"])
    other.future.set_result(["o"])
    assert [s.msg.offset() for s in w.release()] == [0] and w.size == 2  # partition 1's record only
    slow.future.set_result(["s"])
    assert [(s.msg.partition(), s.msg.offset()) for s in w.release()] == [(0, 0), (0, 1)]
    assert w.size == 0


def test_a_record_rejected_at_decode_is_released_in_its_place():
    w = InOrderWindow()
    head = w.add(slot(0, 0))
    bad = w.add(Slot(Msg("t", 0, 1)))
    bad.resolve("rejected")
    assert w.release() == []
    head.future.set_result([])
    assert [s.outcome() for s in w.release()] == [[], "rejected"]


def test_dropping_partitions_forgets_their_records_and_a_rewind_may_admit_them_again():
    w = InOrderWindow()
    for o in range(3):
        w.add(slot(0, o))
    w.add(slot(1, 5))
    dropped = w.drop([("t", 0)])
    assert first_offsets(dropped) == {("t", 0): 0} and w.size == 1
    w.add(slot(0, 0))  # read again after the rewind
    try:
        w.add(slot(0, 0))
    except ValueError:
        pass
    else:
        raise AssertionError("admitting an offset twice must be refused")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.randoms())
def test_released_records_form_a_gapless_prefix_of_each_partition(partitions, rnd):
    w, next_offset, slots = InOrderWindow(), {}, []
    for partition in partitions:
        offset = next_offset.get(partition, 0)
        next_offset[partition] = offset + 1
        slots.append(w.add(slot(partition, offset)))
    released: dict[int, list[int]] = {}
    order = list(range(len(slots)))
    rnd.shuffle(order)
    for i in order:  # finish in any order
        slots[i].future.set_result([])
        for s in w.release():
            released.setdefault(s.msg.partition(), []).append(s.msg.offset())
        for p, offsets in released.items():
            assert offsets == list(range(len(offsets))), "released out of order or with a gap"
            # Nothing still held in the window is before a released record of its partition.
            assert all(s.msg.offset() > offsets[-1] for s in w if s.msg.partition() == p)
    assert w.size == 0 and sum(map(len, released.values())) == len(slots)
