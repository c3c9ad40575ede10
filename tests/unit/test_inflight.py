"""The pipelined stage's offset window: what each transaction may commit, and what a successor must skip."""
from __future__ import annotations

from concurrent.futures import Future

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlstream.kafka.inflight import OffsetWindow, Slot, decode_done_ahead, done_ahead_offsets, encode_done_ahead


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


def test_done_ahead_metadata_round_trips_and_stays_small():
    done = {105, 106, 200, 1100}
    meta = encode_done_ahead(100, done | {99})  # offsets before the base are never listed
    assert meta.startswith("rls1:") and decode_done_ahead(100, meta) == done
    assert encode_done_ahead(100, []) == "" and decode_done_ahead(100, "") == set()
    assert decode_done_ahead(100, "someone else's metadata") == set()
    assert len(encode_done_ahead(0, range(0, 20000, 3))) < 4000
    with pytest.raises(ValueError):
        encode_done_ahead(0, [40000])


def test_a_slow_record_holds_back_only_the_committed_offset_not_the_outputs():
    w = OffsetWindow()
    slow, fast, other = w.add(slot(0, 0)), w.add(slot(0, 1)), w.add(slot(1, 0))
    fast.future.set_result(["f"])
    other.future.set_result(["o"])
    assert [(s.msg.partition(), s.msg.offset()) for s in w.ready()] == [(0, 1), (1, 0)]
    points = w.commit_points()
    assert points[("t", 1)] == (1, "")
    base, meta = points[("t", 0)]
    assert base == 0 and decode_done_ahead(0, meta) == {1}  # offset 0 unfinished; 1 done past it
    assert w.ready() == []  # nothing is emitted twice
    slow.future.set_result(["s"])
    assert [s.msg.offset() for s in w.ready()] == [0]
    assert w.commit_points() == {("t", 0): (2, "")} and w.size == 0


def test_a_successor_skips_what_the_metadata_lists_and_keeps_listing_what_it_has_not_reread():
    w = OffsetWindow()
    w.set_committed(("t", 0), 10, encode_done_ahead(10, {12, 15}))
    head, done = w.add(slot(0, 10)), w.add(slot(0, 12))
    assert done.emitted and not head.emitted  # 12 finished before the takeover: no handler, no output
    head.future.set_result([])
    assert w.ready() == [head]
    base, meta = w.commit_points()[("t", 0)]
    assert base == 13 and decode_done_ahead(13, meta) == {15}  # 15 not read again yet: still listed


def test_an_abort_returns_to_the_last_committed_points():
    w = OffsetWindow()
    w.set_committed(("t", 0), 0, encode_done_ahead(0, {3}))
    slots = [w.add(slot(0, o)) for o in range(3)]
    for s in slots[1:]:
        s.future.set_result([])
    w.ready()
    points = w.commit_points()
    w.mark_committed(points)
    slots[0].future.set_result([])
    w.ready()
    w.commit_points()  # ... and the transaction carrying this is aborted
    dropped, rewind_to = w.rewind()
    assert dropped == [] and w.size == 0  # the aborted commit point had passed every slot
    assert rewind_to == {("t", 0): 0}  # so the rewind goes to the last committed offset
    # Read again from offset 0: 1 and 2 are done per the committed metadata, 0 is not, 3 still is.
    again = [w.add(slot(0, o)) for o in range(4)]
    assert [s.emitted for s in again] == [False, True, True, True]


def test_admitting_an_offset_twice_is_refused():
    w = OffsetWindow()
    w.add(slot(0, 0))
    with pytest.raises(ValueError):
        w.add(slot(0, 0))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.randoms(), st.integers(1, 5))
def test_every_record_is_emitted_once_and_commit_points_never_pass_an_unfinished_one(partitions, rnd, every):
    w, next_offset, slots = OffsetWindow(), {}, []
    for partition in partitions:
        offset = next_offset.get(partition, 0)
        next_offset[partition] = offset + 1
        slots.append(w.add(slot(partition, offset)))
    futures = [s.future for s in slots]  # a slot lets go of its future once behind the commit point
    order = list(range(len(slots)))
    rnd.shuffle(order)
    emitted: list[tuple[int, int]] = []
    for n, i in enumerate(order, 1):  # finish in any order, commit every few
        futures[i].set_result([])
        if n % every and n != len(order):
            continue
        emitted += [(s.msg.partition(), s.msg.offset()) for s in w.ready()]
        for (_, p), (base, meta) in w.commit_points().items():
            unfinished = [s.msg.offset() for s, f in zip(slots, futures) if s.msg.partition() == p and not f.done()]
            assert not unfinished or base <= min(unfinished), "committed past an unfinished record"
            listed = decode_done_ahead(base, meta)
            assert all(slots_done(slots, futures, p, o) for o in listed) and not listed & set(unfinished)
    assert sorted(emitted) == sorted({(s.msg.partition(), s.msg.offset()) for s in slots})
    assert w.size == 0
    # Passed by the commit point, every slot has let go of its future (whose callback refers back to the slot: a
    # reference cycle per record otherwise), its input and its outputs.
    assert all(s.future is None and s.item is None and s.result is None for s in slots)


def slots_done(slots, futures, partition, offset):
    return any(s.msg.partition() == partition and s.msg.offset() == offset and f.done()
               for s, f in zip(slots, futures))


def test_done_ahead_offsets_list_each_partitions_records_past_its_offset_and_what_did_not_fit():
    points, left_out = done_ahead_offsets({("r", 0): 10, ("r", 1): 5}, [("r", 0, 12), ("r", 0, 15), ("r", 1, 3)])
    assert left_out == 0
    assert [(t, p, o) for t, p, o, _ in points] == [("r", 0, 10), ("r", 1, 5)]
    assert decode_done_ahead(10, points[0][3]) == {12, 15}
    assert points[1][3] is None  # nothing past partition 1's offset
    # More than the broker's metadata limit takes: the lowest offsets are kept, the rest counted.
    far = [("r", 0, 10 + 8 * k) for k in range(1, 4000)]
    (point,), left_out = done_ahead_offsets({("r", 0): 10}, far)
    kept = decode_done_ahead(10, point[3])
    assert left_out > 0 and len(kept) + left_out == len(far)
    assert kept == {o for _, _, o in far[:len(kept)]}


def scanned(w: OffsetWindow, slots) -> tuple[bool, int]:
    """What ``progress`` reports, found by looking at every held slot (what it did before it kept counts)."""
    held = [s for s in slots if s in list(w)]
    return (any(s.future is not None and not s.done and not s.emitted for s in held),
            sum(1 for s in held if s.done and not s.emitted))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "finish", "reject", "commit", "drop", "rewind"]),
                          st.integers(0, 2)), min_size=1, max_size=80), st.randoms())
def test_the_windows_counts_match_a_scan_through_finishes_commits_drops_and_rewinds(ops, rnd):
    """progress() keeps counts as handlers finish (on their threads, here this one) instead of scanning the window;
    whatever happens to the slots meanwhile, the counts are what a scan finds."""
    w, next_offset, slots = OffsetWindow(), {}, []
    for op, partition in ops:
        if op in ("add", "reject"):
            offset = next_offset.get(partition, 0)
            next_offset[partition] = offset + 1
            s = w.add(Slot(Msg("t", partition, offset)))
            if op == "reject":
                w.resolve(s, "rejected")
            else:
                w.attach(s, Future())
            slots.append(s)
        elif op == "finish":
            running = [s for s in slots if s.future is not None and not s.future.done()]
            if running:
                rnd.choice(running).future.set_result([])
        elif op == "commit":
            w.progress()
            w.ready()
            w.mark_committed(w.commit_points())
        elif op == "drop":
            w.drop([("t", partition)])
        else:
            w.rewind()
        assert w.progress() == scanned(w, slots)
