"""The pipelined runner's hand-off of records to the handlers' event loop (rlstream.runtime.handlers): one wake-up
for a poll's records, each record's outcome on its own future, and a cancelled future cancels its handler."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import wait

import pytest

from rlstream.kafka.records import Incoming, Rejected
from rlstream.runtime.handlers import Handlers
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
