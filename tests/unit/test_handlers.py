"""The pipelined runner's hand-off of records to the handlers' event loop (rlstream.runtime.handlers): one wake-up
for a poll's records, each record's outcome on its own future, and a cancelled future cancels its handler; a sync
handler's records straight on the pool instead, given up on at their timeout."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, wait

import pytest

from rlstream.kafka.records import Incoming, Rejected
from rlstream.runtime.handlers import Deadlines, Handlers, resolve
from rlstream.runtime.settings import RuntimeSettings
from rlstream.runtime.stage import Stage


class Sleeper(Stage):
    """Sleeps the seconds its record says; -1 raises."""

    name = "sleeper"

    def __init__(self):
        self.cancelled: list[float] = []

    async def handle(self, item):
        if item.record < 0:
            raise ValueError("bad record")
        try:
            await asyncio.sleep(item.record)
        except asyncio.CancelledError:
            self.cancelled.append(item.record)
            raise
        return []


@pytest.fixture
def handlers():
    stage = Sleeper()
    h = Handlers(stage, RuntimeSettings(concurrency=8, handler_timeout_s=30))
    thread = threading.Thread(target=h.loop.run_forever, daemon=True)
    thread.start()
    yield h
    h.loop.call_soon_threadsafe(h.loop.stop)
    thread.join(5)


@pytest.mark.timeout(60)
def test_each_record_of_a_batch_resolves_alone_and_a_cancelled_one_stops_its_handler(handlers):
    items = [Incoming("in", 0, i, None, {}, 0, s) for i, s in enumerate((0.0, 30.0, -1))]
    quick, slow, bad = handlers.submit(items)
    wait([quick, bad], timeout=10)
    assert quick.result() == [] and not slow.done()
    assert isinstance(bad.result(), Rejected) and bad.result().reason == "handler_error"
    assert slow.cancel()
    for _ in range(100):
        if handlers.stage.cancelled:
            break
        threading.Event().wait(0.05)
    assert handlers.stage.cancelled == [30.0], "the cancelled record's handler kept running"
    assert handlers.submit([]) == []


class Both(Stage):
    """Has both handlers; which one the runtime calls is this instance's choice."""

    def __init__(self, batched: bool):
        self._batched = batched

    @property
    def batched(self) -> bool:
        return self._batched

    def handle(self, item):
        return []

    def handle_batch(self, items):
        return [[] for _ in items]


def modes(stage: Stage) -> tuple[bool, float]:
    h = Handlers(stage, RuntimeSettings(handler_timeout_s=30))
    try:
        return h.batched, h.timeout_s
    finally:
        h.close()


def test_the_runtime_picks_batch_or_pipelined_per_stage_instance_and_takes_the_stages_longer_timeout():
    assert modes(Sleeper()) == (False, 30)  # handle only: pipelined
    assert modes(Both(True))[0] and not modes(Both(False))[0]
    from rlstream.stages.rollout import RolloutSettings, RolloutStage
    local = RolloutStage(RolloutSettings(backend="transformers"))
    # Batched; a generation on an in-process engine gets --generation-timeout-s, not the generic 30 s.
    assert modes(local) == (True, 600) and local.max_in_flight is None
    assert modes(RolloutStage(RolloutSettings(backend="transformers", generation_timeout_s=5))) == (True, 30)
    fleet = RolloutStage(RolloutSettings(backend="vllm-server", engine_url=("http://a:1,http://b:2",),
                                         max_concurrency=16, request_timeout_s=100, request_retries=3))
    batched, timeout = modes(fleet)
    # Pipelined; a record's handler outlives the fleet's own bound on its requests (wait, then 4 attempts).
    assert not batched and timeout > 100 * 5
    assert fleet.max_in_flight == 32  # a record per request slot of the two servers
    assert RolloutStage(RolloutSettings(backend="sglang", engine_url=("http://a:1",))).max_in_flight is None


# -- sync handlers: straight on the pool, no event loop, timeouts watched by one thread ---------------------------


class Blocking(Stage):
    """A sync handler that sleeps the seconds its record says (-1 raises), counting the records it started."""

    name = "blocking"

    def __init__(self):
        self.started: list[float] = []

    def handle(self, item):
        self.started.append(item.record)
        if item.record < 0:
            raise ValueError("bad record")
        threading.Event().wait(item.record)
        return []


def items_of(*records):
    return [Incoming("in", 0, i, None, {}, 0, r) for i, r in enumerate(records)]


@pytest.mark.timeout(60)
def test_a_sync_handler_runs_on_the_pool_without_the_event_loop_and_is_given_up_on_at_its_timeout():
    stage = Blocking()
    h = Handlers(stage, RuntimeSettings(concurrency=4, handler_timeout_s=0.5))
    try:
        assert not h.loop.is_running()  # nothing here goes through the loop: its records would never resolve
        quick, bad, hung = h.submit(items_of(0.0, -1, 3.0))
        wait([quick, bad], timeout=10)
        assert quick.result() == []
        assert (bad.result().reason, str(bad.result())) == ("handler_error", "ValueError: bad record")
        # Resolved at its 0.5 s timeout while its thread sleeps on; its own result, when it comes, is dropped.
        assert isinstance(hung.result(timeout=10), Rejected) and hung.result().reason == "handler_timeout"
        assert sorted(stage.started) == [-1, 0.0, 3.0]  # three threads: they start in any order
    finally:
        h.close()


@pytest.mark.timeout(60)
def test_sync_records_are_drained_by_at_most_concurrency_threads_and_a_slow_one_holds_up_no_other():
    """Handlers.submit_sync queues records for up to ``concurrency`` drainers: every record resolves, never more
    than ``concurrency`` run at once, and the rest go on past one that is still running."""
    class Counting(Blocking):
        def __init__(self):
            super().__init__()
            self.running = self.most = 0
            self.lock = threading.Lock()

        def handle(self, item):
            with self.lock:
                self.running += 1
                self.most = max(self.most, self.running)
            try:
                return super().handle(item)
            finally:
                with self.lock:
                    self.running -= 1
    stage = Counting()
    h = Handlers(stage, RuntimeSettings(concurrency=4, handler_timeout_s=30))
    try:
        slow, *quick = h.submit(items_of(8.0, *([0.001] * 300)))
        assert all(f.result(timeout=20) == [] for f in quick)
        assert not slow.done()  # all 300 done while the slow one still runs on its own drainer
        assert slow.result(timeout=20) == [] and stage.most <= 4 and len(stage.started) == 301
        late = h.submit(items_of(0.0))  # the drainers have all left: a new record starts one again
        assert late[0].result(timeout=10) == []
    finally:
        h.close()


@pytest.mark.timeout(60)
def test_a_sync_record_cancelled_while_it_waits_for_a_thread_never_starts():
    stage = Blocking()
    h = Handlers(stage, RuntimeSettings(concurrency=1, handler_timeout_s=30))
    try:
        first, second = h.submit(items_of(0.5, 0.0))
        assert second.cancel()  # the one thread is busy with the first: the second has not started
        assert first.result(timeout=10) == [] and stage.started == [0.5]
        threading.Event().wait(0.2)
        assert stage.started == [0.5], "a cancelled record's handler ran"
    finally:
        h.close()


@pytest.mark.timeout(60)
def test_a_sync_reward_function_is_given_up_on_at_the_judge_timeout_with_a_judge_timeout_reward():
    """The reward stage offers its sync path (RewardStage.sync_handler): a judge past --judge-timeout-s gives the
    judge_timeout reward the event-loop path gives, at that timeout rather than at the handler's."""
    from rlstream.stages.reward import RewardSettings, RewardStage
    from tests.helpers.episodes import traj
    stage = RewardStage(RewardSettings(reward="tests.unit.test_verifiers:sleepy", judge_timeout_s=0.3))
    assert stage.sync_handler() is not None
    assert RewardStage(RewardSettings(reward="tests.unit.test_verifiers:async_sleepy")).sync_handler() is None
    h = Handlers(stage, RuntimeSettings(handler_timeout_s=30))
    try:
        [late] = h.submit([Incoming("trajectories", 0, 0, b"g", {}, 0, traj("5"))])
        [out] = late.result(timeout=0.9)  # the judge sleeps 1 s
        assert (out.record.reward.failure_class, out.record.reward.total) == ("judge_timeout", 0.0)
        assert out.record.reward.violations == ["judge_timeout: no judgement within 0.3s"]
    finally:
        h.close()


@pytest.mark.timeout(60)
def test_a_chain_of_two_sync_stages_runs_on_the_pool_and_keeps_the_second_stages_timeout_outcome():
    """env+reward with a sync judge (runtime/chain.py ``_both_sync``): no event loop; the env's trajectory is
    handed over, and a judge past --judge-timeout-s still gives its judge_timeout reward within the chain."""
    from rlstream.runtime.chain import Chained
    from rlstream.stages.env import EnvSettings, EnvStage
    from rlstream.stages.reward import RewardSettings

    chain = _env_reward_chain(EnvStage(EnvSettings(sandbox="subprocess")),
                              RewardSettings(reward="tests.unit.test_verifiers:sleepy", judge_timeout_s=0.3),
                              handler_timeout_s=30)
    try:
        assert not chain.loop.is_running()
        [future] = chain.submit([_action(0)])
        chained = future.result(timeout=0.9)  # the judge sleeps 1 s
        assert isinstance(chained, Chained) and [out.topic for out, _ in chained.first] == ["trajectories"]
        [(_, [(scored, _)])] = chained.handed
        assert (scored.record.reward.failure_class, scored.record.reward.total) == ("judge_timeout", 0.0)
    finally:
        chain.close()


#: The thread each call of ``noting_judge`` ran on (the chain tests below read it).
JUDGED_ON: list[str] = []


def noting_judge(trajectory):
    """A sync judge that notes the thread it runs on."""
    JUDGED_ON.append(threading.current_thread().name)
    return 1.0


def _env_reward_chain(env, reward=None, **runtime):
    """``env`` chained with a reward stage of ``reward`` (RewardSettings; else judged by ``noting_judge``), outputs
    encoded as the runner would."""
    from rlstream.kafka import records
    from rlstream.kafka.topics import topic_name
    from rlstream.runtime.chain import ChainHandlers
    from rlstream.schemas import headers as hdr
    from rlstream.stages.reward import RewardSettings, RewardStage

    def encode(item, out):
        return (topic_name("r", out.topic), out.key, records.encode(out.topic, out.record),
                hdr.build(item.policy_version, hdr.child_traceparent(item.traceparent)))
    reward = reward or RewardSettings(reward="tests.unit.test_handlers:noting_judge")
    return ChainHandlers(env, RewardStage(reward), RuntimeSettings(**runtime), "r", encode)


def _action(i: int) -> Incoming:
    from rlstream.schemas import headers as hdr
    from tests.helpers.episodes import one_action_episode as episode
    headers = {"policy_version": b"2", "traceparent": hdr.new_traceparent().encode()}
    return Incoming("actions", 0, i, b"g", headers, 2, episode(i, "cba"))


@pytest.mark.timeout(60)
def test_a_sync_chain_judges_on_the_thread_that_ran_the_env_and_never_on_the_timeout_watcher():
    """``_both_sync``: the second stage's call runs on the pool thread that finished the first (no second pool
    task per record); a first stage given up on at its timeout, whose outcome still feeds the second, has its
    second call sent to the pool, never run on the deadline watcher (which would stall every other timeout)."""
    from rlstream.runtime.chain import Chained
    from rlstream.runtime.stage import SyncHandler
    from rlstream.stages.env import EnvSettings, EnvStage

    class NotingEnv(EnvStage):
        """The real env, noting its thread; with ``hang`` its handler overruns a 0.3 s timeout whose outcome is
        the env's own outputs (a stage whose timed_out feeds the second; this env's own would dead-letter)."""

        def __init__(self, hang: bool):
            super().__init__(EnvSettings(sandbox="subprocess"))
            self.hang, self.ran_on = hang, []

        def sync_handler(self):
            def fn(item):
                self.ran_on.append(threading.current_thread().name)
                if self.hang:
                    threading.Event().wait(1.0)
                return self.handle(item)
            return SyncHandler(fn, 0.3, self.handle) if self.hang else SyncHandler(fn)

    env = NotingEnv(hang=False)
    chain = _env_reward_chain(env, handler_timeout_s=30, concurrency=4)
    try:
        JUDGED_ON.clear()
        futures = chain.submit([_action(i) for i in range(8)])
        for f in futures:
            chained = f.result(timeout=30)
            assert isinstance(chained, Chained) and len(chained.handed) == 1
            assert chained.handed[0][1][0][0].record.reward.total == 1.0
        assert sorted(JUDGED_ON) == sorted(env.ran_on) and all(n.startswith("env-handler") for n in JUDGED_ON)
    finally:
        chain.close()

    env = NotingEnv(hang=True)
    chain = _env_reward_chain(env, handler_timeout_s=30, concurrency=4)
    try:
        JUDGED_ON.clear()
        [future] = chain.submit([_action(0)])
        chained = future.result(timeout=0.9)  # the env's handler waits 1 s; its timeout is 0.3 s
        assert isinstance(chained, Chained) and chained.handed[0][1][0][0].record.reward.total == 1.0
        assert len(JUDGED_ON) == 1 and JUDGED_ON[0].startswith("env-handler"), JUDGED_ON
    finally:
        chain.close()


@pytest.mark.timeout(60)
def test_a_sync_chain_record_cancelled_while_its_env_runs_is_never_judged_and_lets_go_of_it():
    """A rewind cancels a record's future while its first stage runs (``_BothSync``): the env finishes, the judge
    never runs, and the chain holds nothing of the record afterwards."""
    import time

    from rlstream.runtime.stage import SyncHandler
    from rlstream.stages.env import EnvSettings, EnvStage

    class GatedEnv(EnvStage):
        def __init__(self):
            super().__init__(EnvSettings(sandbox="subprocess"))
            self.entered, self.go, self.left = threading.Event(), threading.Event(), threading.Event()

        def sync_handler(self):
            def fn(item):
                self.entered.set()
                self.go.wait(10)
                try:
                    return self.handle(item)
                finally:
                    self.left.set()
            return SyncHandler(fn)

    env = GatedEnv()
    chain = _env_reward_chain(env, handler_timeout_s=30, concurrency=4)
    try:
        JUDGED_ON.clear()
        [future] = chain.submit([_action(0)])
        assert env.entered.wait(10)
        future.cancel()  # a running first stage cannot be stopped, but the record is
        assert future.cancelled()
        call = next(cb.__self__ for cb in future._done_callbacks)  # the record's _BothSync
        env.go.set()
        assert env.left.wait(10)
        time.sleep(0.2)  # the env's future resolves, and its callback runs, on the pool thread
        assert JUDGED_ON == []
        # Let go of: nothing it holds refers back to it through a future's callbacks any more.
        assert (call.outer, call.first, call.item, call.chained, call.seconds) == (None, None, None, None, [])
    finally:
        chain.close()


@pytest.mark.timeout(60)
def test_deadlines_added_from_many_threads_resolve_the_overdue_and_wake_an_idle_watcher():
    """Deadlines.add takes no lock (every pool thread adds one per record): what is overdue still resolves with
    its outcome, what finished is dropped from the queue, and an add after the watcher went idle wakes it."""
    deadlines = Deadlines()
    try:
        finished, hung = [Future() for _ in range(800)], [Future() for _ in range(8)]

        def add(futures, after_s, outcome):
            for f in futures:
                deadlines.add(time.monotonic() + after_s, f, lambda o=outcome: o)
        # The finished ones' deadline is far off, so their own result always wins, however loaded the machine (at
        # 0.3 s, a CI run's 3.12 unit tests beside the compose stack resolved some 'late' before the main thread
        # got to them); their entries can then only leave the queue by being pruned, which the end checks.
        threads = [threading.Thread(target=add, args=(finished[i::8], 60, "late")) for i in range(8)]
        threads.append(threading.Thread(target=add, args=(hung, 0.3, "given up")))
        for t in threads:
            t.start()
        for f in finished:
            resolve(f, "own")  # each handler's own result, well before its deadline
        for t in threads:
            t.join()
        assert [f.result(timeout=10) for f in hung] == ["given up"] * 8
        assert {f.result() for f in finished} == {"own"}
        # Finished entries pruned, overdue ones resolved and dropped: within a few PRUNE_S of an idle machine, given
        # longer here since a loaded one may not run the watcher for a while.
        deadline = time.monotonic() + 10
        while deadlines._entries and time.monotonic() < deadline:
            time.sleep(Deadlines.PRUNE_S)
        assert not deadlines._entries
        time.sleep(0.2)  # the watcher sleeps with nothing to watch
        late = Future()
        deadlines.add(time.monotonic() + 0.1, late, lambda: "given up")
        assert late.result(timeout=5) == "given up"
    finally:
        deadlines.close()
