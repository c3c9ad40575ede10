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
