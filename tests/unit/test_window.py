"""Windowed FIFO: hand-made sequences, then a stateful property test against a reference model."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rlstream.trainer.window import Group, WindowedFIFO, WindowItem

TOPIC = "samples"


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


class Feeder:
    """Makes items with increasing offsets per partition, as a consumer would see them."""

    def __init__(self) -> None:
        self.next_offset: dict[int, int] = {}

    def item(self, gid: str, size: int, partition: int = 0, gap: int = 0) -> WindowItem:
        off = self.next_offset.get(partition, 0) + gap
        self.next_offset[partition] = off + 1
        return WindowItem(gid, size, (TOPIC, partition, off), 0.0, payload=(gid, off))


def ids(groups: list[Group]) -> list[str]:
    return [g.group_id for g in groups]


def make(w: int = 2, timeout: float = 10.0):
    clock = FakeClock()
    return WindowedFIFO(w, timeout, clock=clock), clock, Feeder()


# -- hand-made sequences -----------------------------------------------------


def test_takes_complete_groups_in_window_out_of_order():
    win, _, f = make(w=2)
    win.add(f.item("a", 2))  # straggler at the head
    win.add(f.item("b", 2))
    win.add(f.item("b", 2))
    got = win.take()
    assert ids(got) == ["b"]
    assert got[0].complete and [i.payload for i in got[0].items] == [("b", 1), ("b", 2)]
    assert win.window_group_ids() == ["a"]
    assert len(win) == 1 and win.pending_samples == 1


def test_never_takes_beyond_window():
    win, _, f = make(w=2)
    win.add(f.item("a", 2))
    win.add(f.item("b", 2))
    win.add(f.item("c", 1))  # complete, but third group: outside W=2
    assert win.window_group_ids() == ["a", "b"]
    assert win.take() == []
    assert win.complete_in_window() == 0
    win.add(f.item("b", 2))
    assert ids(win.take()) == ["b"]  # window fixed at call start: c not yet
    assert win.window_group_ids() == ["a", "c"]
    assert ids(win.take()) == ["c"]


def test_take_limits_oldest_first():
    win, _, f = make(w=4)
    for gid in "abcd":
        for _ in range(2):
            win.add(f.item(gid, 2))
    assert ids(win.take(max_groups=1)) == ["a"]
    assert ids(win.take(max_samples=3)) == ["b"]  # c would make 4 > 3: stop
    assert win.take(max_groups=0) == [] and win.take(max_samples=0) == []
    assert ids(win.take(max_samples=4)) == ["c", "d"]


def test_oversized_group_does_not_wedge_max_samples():
    win, _, f = make(w=1)
    for _ in range(3):
        win.add(f.item("a", 3))
    assert ids(win.take(max_samples=2)) == ["a"]  # empty batch always takes one


def test_duplicate_positions_ignored():
    win, _, f = make()
    it = f.item("a", 2)
    assert win.add(it) is True
    assert win.add(it) is False
    assert win.add(WindowItem("a", 2, it.position, 0.0, None)) is False
    assert win.pending_samples == 1 and win.duplicates_ignored == 2
    assert win.take() == []


def test_group_too_big_keeps_extras():
    win, _, f = make(w=2)
    for _ in range(3):
        win.add(f.item("a", 2))  # one more than expected, before take
    (g,) = win.take()
    assert len(g) == 3 and g.complete
    win.add(f.item("a", 2))  # arrives after its group was taken
    assert len(win) == 0 and win.pending_samples == 1
    assert win.committable_offsets() == {(TOPIC, 0): 3}  # the late item is held
    (late,) = win.evict_expired()  # handed back at once, no timeout needed
    assert late.late and late.group_id == "a" and len(late) == 1
    assert win.pending_samples == 0
    assert win.committable_offsets() == {(TOPIC, 0): 4}


def test_late_item_for_evicted_group_is_not_a_new_head():
    win, clock, f = make(w=2, timeout=5)
    win.add(f.item("a", 2))
    clock.advance(6)
    (ev,) = win.evict_expired()
    assert ev.group_id == "a" and not ev.complete and not ev.late
    win.add(f.item("a", 2))
    win.add(f.item("b", 1))
    assert win.window_group_ids() == ["b"]
    assert ids(win.take()) == ["b"]
    (late,) = win.evict_expired()
    assert late.late and late.group_id == "a"


def test_head_eviction_only_after_timeout():
    win, clock, f = make(w=3, timeout=10)
    win.add(f.item("a", 2))
    clock.advance(4)
    win.add(f.item("b", 2))
    clock.advance(6)  # a is exactly 10 old: not older than the timeout yet
    assert win.evict_expired() == []
    clock.advance(0.5)
    evicted = win.evict_expired()
    assert ids(evicted) == ["a"] and evicted[0].first_arrived_at == 1000.0
    assert win.window_group_ids() == ["b"]  # b is 6.5 old: stays
    clock.advance(4)
    assert ids(win.evict_expired()) == ["b"]


def test_eviction_repeats_and_stops_at_complete_head():
    win, clock, f = make(w=4, timeout=1)
    win.add(f.item("a", 2))
    win.add(f.item("b", 2))
    win.add(f.item("c", 1))  # complete
    win.add(f.item("d", 2))
    clock.advance(2)
    assert ids(win.evict_expired()) == ["a", "b"]  # c is complete: take it, don't evict
    assert win.window_group_ids() == ["c", "d"]
    assert ids(win.take()) == ["c"]
    assert ids(win.evict_expired()) == ["d"]


def test_committable_offsets_only_up_to_consumed():
    win, _, f = make(w=3)
    win.add(f.item("a", 2, partition=0))  # p0:0
    win.add(f.item("b", 1, partition=0))  # p0:1
    win.add(f.item("c", 1, partition=1, gap=5))  # p1:5 (gap: transaction markers)
    assert win.committable_offsets() == {(TOPIC, 0): 0, (TOPIC, 1): 5}
    assert ids(win.take()) == ["b", "c"]
    # b (offset 1) is consumed, but a at offset 0 is still held: commit stays at 0.
    assert win.committable_offsets() == {(TOPIC, 0): 0, (TOPIC, 1): 6}
    win.add(f.item("a", 2, partition=0))  # p0:2
    assert ids(win.take()) == ["a"]
    assert win.committable_offsets() == {(TOPIC, 0): 3, (TOPIC, 1): 6}


def test_released_ahead_lists_what_a_restart_must_skip():
    win, _, f = make(w=3)
    win.add(f.item("a", 2))  # 0, held head
    win.add(f.item("b", 1))  # 1
    win.add(f.item("c", 1))  # 2
    assert ids(win.take()) == ["b", "c"]
    assert win.committable_offsets() == {(TOPIC, 0): 0}
    assert win.released_ahead() == [(TOPIC, 0, 1), (TOPIC, 0, 2)]

    # After a restart the consumer reads from offset 0 again; skipped positions count as consumed.
    again = WindowedFIFO(3, 10.0)
    again.add(WindowItem("a", 2, (TOPIC, 0, 0), 0.0, payload=None))
    again.skip((TOPIC, 0, 1))
    again.skip((TOPIC, 0, 2))
    assert len(again) == 1 and again.pending_samples == 1
    assert again.released_ahead() == [(TOPIC, 0, 1), (TOPIC, 0, 2)]  # still ahead of the held head
    again.add(WindowItem("a", 2, (TOPIC, 0, 3), 0.0, payload=None))
    assert ids(again.take()) == ["a"]
    assert again.committable_offsets() == {(TOPIC, 0): 4} and again.released_ahead() == []


def test_a_group_completes_without_its_refused_samples():
    win, _, f = make(w=2)
    win.add(f.item("a", 3))  # 0
    win.refuse("a", 3, (TOPIC, 0, 1))  # a stale sample of a: a can never hold 3 items
    f.next_offset[0] = 2
    win.add(f.item("b", 1))  # 2
    win.add(f.item("c", 1))  # 3: beyond the window while a is open
    assert ids(win.take()) == ["b"]  # c slides into the window only now
    assert win.complete_in_window() == 1  # c; a still waits for its third sample
    win.refuse("a", 3, (TOPIC, 0, 4))
    taken = win.take(max_groups=1)
    assert ids(taken) == ["a"] and len(taken[0]) == 1 and taken[0].refused == 2 and taken[0].complete
    assert ids(win.take()) == ["c"] and win.committable_offsets() == {(TOPIC, 0): 5}


def test_a_group_refused_whole_is_dropped_and_a_refusal_after_take_only_counts_the_offset():
    win, _, f = make(w=2)
    win.refuse("a", 2, (TOPIC, 0, 0))
    assert len(win) == 1 and win.complete_in_window() == 0
    win.refuse("a", 2, (TOPIC, 0, 1))
    assert len(win) == 0 and win.take() == [] and win.committable_offsets() == {(TOPIC, 0): 2}
    f.next_offset[0] = 2
    win.add(f.item("b", 1))
    assert ids(win.take()) == ["b"]
    win.refuse("b", 1, (TOPIC, 0, 3))  # b was taken already
    assert len(win) == 0 and win.committable_offsets() == {(TOPIC, 0): 4}


def test_clear_forgets_offsets_for_reread():
    win, _, f = make()
    it = f.item("a", 2)
    win.add(it)
    win.clear()
    assert len(win) == 0 and win.pending_samples == 0 and win.committable_offsets() == {}
    assert win.add(it) is True


def test_constructor_validation():
    with pytest.raises(ValueError):
        WindowedFIFO(0, 1.0)
    with pytest.raises(ValueError):
        WindowedFIFO(1, -1.0)
    win = WindowedFIFO(1, 1.0)
    with pytest.raises(ValueError):
        win.add(WindowItem("a", 0, (TOPIC, 0, 0), 0.0, None))


# -- stateful property test against a reference model ------------------------


class WindowMachine(RuleBasedStateMachine):
    """Drives WindowedFIFO with random adds/takes/evictions and checks it against a model."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.w = 0
        self.timeout = 0.0
        self.win: WindowedFIFO | None = None
        self.next_offset = {0: 0, 1: 0, 2: 0}
        self.added: list[WindowItem] = []  # unique positions only
        self.arrival: dict[tuple, int] = {}
        # Reference model of the FIFO: open groups in first-arrival order.
        self.order: list[str] = []
        self.size: dict[str, int] = {}
        self.count: dict[str, int] = {}
        self.first_at: dict[str, float] = {}
        self.closed: set[str] = set()
        self.late: dict[str, int] = {}
        self.gids = 0
        self.taken: dict[tuple, WindowItem] = {}
        self.evicted: dict[tuple, WindowItem] = {}
        self.last_commit: dict[tuple, int] = {}

    @rule(w=st.integers(1, 5), timeout=st.sampled_from([0.0, 1.0, 5.0]))
    @precondition(lambda self: self.win is None)
    def start(self, w, timeout):
        self.w, self.timeout = w, timeout
        self.win = WindowedFIFO(w, timeout, clock=self.clock)

    def _add(self, gid: str, size: int, partition: int, gap: int) -> None:
        off = self.next_offset[partition] + gap
        self.next_offset[partition] = off + 1
        item = WindowItem(gid, size, (TOPIC, partition, off), self.clock.now, payload=off)
        assert self.win.add(item) is True
        self.arrival[item.position] = len(self.added)
        self.added.append(item)
        if gid in self.closed:
            self.late[gid] = self.late.get(gid, 0) + 1
        elif gid in self.count:
            self.count[gid] += 1
        else:
            self.order.append(gid)
            self.size[gid], self.count[gid], self.first_at[gid] = size, 1, self.clock.now

    @rule(size=st.integers(1, 4), partition=st.integers(0, 2), gap=st.integers(0, 2))
    @precondition(lambda self: self.win is not None)
    def add_new_group(self, size, partition, gap):
        self.gids += 1
        self._add(f"g{self.gids}", size, partition, gap)

    @rule(data=st.data(), partition=st.integers(0, 2), gap=st.integers(0, 2))
    @precondition(lambda self: self.win is not None and (self.order or self.closed))
    def add_to_existing_group(self, data, partition, gap):
        # Mostly open groups (which may overfill them); sometimes already-closed ones.
        pool = self.order + sorted(self.closed)
        gid = data.draw(st.sampled_from(pool))
        self._add(gid, self.size[gid], partition, gap)

    @rule(data=st.data())
    @precondition(lambda self: self.win is not None and self.added)
    def redeliver(self, data):
        item = data.draw(st.sampled_from(self.added))
        before = self.win.pending_samples
        assert self.win.add(item) is False
        assert self.win.pending_samples == before

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0, 6.0]))
    @precondition(lambda self: self.win is not None)
    def tick(self, dt):
        self.clock.advance(dt)

    def _record(self, groups: list[Group], sink: dict) -> None:
        for g in groups:
            for it in g.items:
                key = it.position
                assert key not in self.taken and key not in self.evicted, "item handed out twice"
                sink[key] = it

    @rule(
        max_groups=st.none() | st.integers(1, 5),
        max_samples=st.none() | st.integers(1, 10),
    )
    @precondition(lambda self: self.win is not None)
    def take(self, max_groups, max_samples):
        window = self.order[: self.w]  # model's window at the time of take
        assert self.win.window_group_ids() == window
        complete = [g for g in window if self.count[g] >= self.size[g]]
        got = self.win.take(max_groups=max_groups, max_samples=max_samples)
        got_ids = ids(got)
        # Never beyond the window, only complete groups, oldest first: a prefix
        # of the window's complete groups.
        assert set(got_ids) <= set(window)
        assert got_ids == complete[: len(got_ids)]
        if max_groups is None and max_samples is None:
            assert got_ids == complete
        if complete:
            assert got_ids, "a complete group in the window must always be takeable"
        if max_samples is not None and len(got) > 1:
            assert sum(len(g) for g in got) <= max_samples
        for g in got:
            assert g.complete and not g.late
            assert len(g) == self.count[g.group_id]
            assert all(it.group_id == g.group_id for it in g.items)
            arrival = [self.arrival[it.position] for it in g.items]
            assert arrival == sorted(arrival), "items not in arrival order"
        self._record(got, self.taken)
        for gid in got_ids:
            self._close(gid)

    def _close(self, gid: str) -> None:
        self.order.remove(gid)
        self.closed.add(gid)

    @rule()
    @precondition(lambda self: self.win is not None)
    def evict(self):
        now = self.clock.now
        expect_late = dict(self.late)
        expect = []
        for gid in self.order:
            if self.count[gid] >= self.size[gid] or now - self.first_at[gid] <= self.timeout:
                break
            expect.append(gid)
        got = self.win.evict_expired()
        late = [g for g in got if g.late]
        regular = [g for g in got if not g.late]
        assert {g.group_id: len(g) for g in late} == expect_late
        assert ids(regular) == expect
        for g in regular:
            assert not g.complete
            assert now - g.first_arrived_at > self.timeout  # only after the timeout
        self._record(got, self.evicted)
        self.late.clear()
        for gid in expect:
            self._close(gid)

    @invariant()
    def accounting(self):
        if self.win is None:
            return
        held = len(self.added) - len(self.taken) - len(self.evicted)
        assert self.win.pending_samples == held
        assert len(self.win) == len(self.order)
        assert held == sum(self.count[g] for g in self.order) + sum(self.late.values())

    @invariant()
    def offsets(self):
        if self.win is None:
            return
        held_positions = {it.position for it in self.added} - set(self.taken) - set(self.evicted)
        commit = self.win.committable_offsets()
        for (topic, part), nxt in commit.items():
            held = [o for (t, p, o) in held_positions if (t, p) == (topic, part)]
            seen = [it.position[2] for it in self.added if it.position[:2] == (topic, part)]
            # Never past a still-held item; otherwise everything seen is committable.
            assert nxt == (min(held) if held else max(seen) + 1)
            assert nxt >= self.last_commit.get((topic, part), nxt), "commit went backwards"
            self.last_commit[(topic, part)] = nxt
        assert set(commit) == {it.position[:2] for it in self.added}

    def teardown(self):
        if self.win is None:
            return
        # Drain: everything added must come out exactly once, taken or evicted.
        self.clock.advance(self.timeout + 1000)
        for _ in range(len(self.added) + 2):
            self._record(self.win.take(), self.taken)
            self._record(self.win.evict_expired(), self.evicted)
        assert self.win.pending_samples == 0 and len(self.win) == 0
        assert set(self.taken) | set(self.evicted) == {it.position for it in self.added}
        assert not set(self.taken) & set(self.evicted)


TestWindowMachine = WindowMachine.TestCase
TestWindowMachine.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
