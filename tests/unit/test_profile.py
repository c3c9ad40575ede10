"""The sampling profiler (``RLSTREAM_PROFILE``, rlstream/runtime/profile.py): CPU charged to the stacks of the
threads that used it, and the cyclic garbage collector's share counted apart."""
from __future__ import annotations

import gc
import threading
import time

from rlstream.runtime.profile import _Sampler, read_collapsed


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic GC frees it


def _busy_making_cycles(cpu_seconds: float, used: list) -> None:
    """Until this thread has used ``cpu_seconds`` of CPU (its own clock: on a loaded machine wall time says little
    of what a thread got); ``used`` gets what it used."""
    while time.thread_time() < cpu_seconds:
        for _ in range(1000):
            _Node()
    used.append(time.thread_time())


def test_a_busy_thread_is_charged_its_cpu_and_the_cyclic_gc_is_counted_apart(tmp_path):
    sampler = _Sampler(tmp_path / "role-1", 0.005)
    gc.callbacks.append(sampler.gc_callback)
    try:
        used: list[float] = []
        worker = threading.Thread(target=_busy_making_cycles, args=(0.4, used), name="busy-7")
        worker.start()
        while worker.is_alive():
            sampler.sample()
            time.sleep(0.005)
        sampler.write()
    finally:
        gc.callbacks.remove(sampler.gc_callback)
    text = (tmp_path / "role-1.txt").read_text()
    stacks = read_collapsed(tmp_path / "role-1.collapsed")
    busy = sum(cpu for (thread, frames), cpu in stacks.items()
               if thread == "busy-N" and any("_busy_making_cycles" in f for f in frames))
    # Charged what it used but its last slice (after the last sample: up to an interval's worth, more on a loaded
    # machine, where a sample may come late); thread names' digits become N.
    assert 0.5 * used[0] < busy <= used[0] + 0.01, text
    assert sampler.gc_collections[0] > 0 and sampler.gc_collected > 1000 and sampler.gc_cpu > 0, text
    assert f"{sampler.gc_collected} unreachable objects freed" in text
