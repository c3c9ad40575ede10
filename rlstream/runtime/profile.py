"""``RLSTREAM_PROFILE=DIR``: a sampling profiler in any stage process, weighted by each thread's own CPU time.

py-spy is not installed here and cProfile sees one thread (a stage's work runs in pool threads, the swapper, the
producer's callbacks), so a daemon thread samples every Python thread's stack every ``RLSTREAM_PROFILE_INTERVAL_S``
and charges it the CPU that thread used since the last sample (``pthread_getcpuclockid``): a thread blocked in a
poll is charged nothing, so the profile is CPU, not wall time. The native threads (librdkafka's, torch's pool) have
no Python stack: their CPU is the process's total minus the Python threads' and the profiler's own, one line.

The cyclic garbage collector's share is counted apart (``gc.callbacks``: collections per generation, objects they
found unreachable, and the thread CPU they took), because a sampler charges it to whatever frame allocated when a
collection started: a reference cycle per record once showed up only as a slower ``encode`` and ``Future.result``.

It rewrites ``DIR/<role>-<pid>.txt`` (top functions, self and inclusive) and ``.collapsed`` (flame-graph input)
every few seconds rather than at exit, because a stage process may leave without the interpreter's teardown (a
stop deadline, a second signal: ``runtime/lifecycle.py``) or be SIGKILLed.
"""
from __future__ import annotations

import collections
import gc
import os
import re
import sys
import threading
import time
from pathlib import Path

_started = False


def maybe_start(role: str) -> None:
    """Start the profiler when ``RLSTREAM_PROFILE`` names a folder (once per process)."""
    global _started
    folder = os.environ.get("RLSTREAM_PROFILE", "")
    if not folder or _started:
        return
    _started = True
    interval = float(os.environ.get("RLSTREAM_PROFILE_INTERVAL_S", "0.01"))
    Path(folder).mkdir(parents=True, exist_ok=True)
    sampler = _Sampler(Path(folder) / f"{role}-{os.getpid()}", interval)
    gc.callbacks.append(sampler.gc_callback)
    threading.Thread(target=sampler.run, name="rlstream-profile", daemon=True).start()


def _frame_name(code) -> str:
    path = code.co_filename
    for marker in ("site-packages/", "rlstream/", "benchmarks/", "lib/python"):
        if marker in path:
            path = path[path.index(marker) + (len(marker) if marker != "rlstream/" else 0):]
            break
    return f"{code.co_name} ({path}:{code.co_firstlineno})"


class _Sampler:
    def __init__(self, out: Path, interval: float):
        self.out, self.interval = out, interval
        self.stacks: collections.Counter = collections.Counter()  # (thread name, frames root first) -> CPU s
        self.cpu_last: dict[int, float] = {}
        self.python_cpu = 0.0
        self.started_cpu = sum(os.times()[:2])
        self.started = time.monotonic()
        self.gc_collections = [0, 0, 0]
        self.gc_collected = 0
        self.gc_cpu = 0.0
        self._gc_started = 0.0

    def gc_callback(self, phase: str, info: dict) -> None:
        """``gc.callbacks``: a collection starts or stops on the thread that triggered it (under the GIL)."""
        now = time.clock_gettime(time.CLOCK_THREAD_CPUTIME_ID)
        if phase == "start":
            self._gc_started = now
            return
        self.gc_cpu += max(0.0, now - self._gc_started)
        self.gc_collections[info["generation"]] += 1
        self.gc_collected += info["collected"]

    def _thread_cpu(self, ident: int) -> float | None:
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except (OSError, ProcessLookupError, OverflowError):
            return None

    def sample(self) -> None:
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            cpu = self._thread_cpu(ident)
            if cpu is None:
                continue
            spent = cpu - self.cpu_last.get(ident, cpu)
            self.cpu_last[ident] = cpu
            if spent <= 0:
                continue
            self.python_cpu += spent
            frames = []
            while frame is not None and len(frames) < 60:
                frames.append(_frame_name(frame.f_code))
                frame = frame.f_back
            name = re.sub(r"\d+", "N", names.get(ident, "?"))
            self.stacks[(name, tuple(reversed(frames)))] += spent

    def run(self) -> None:
        last_write = time.monotonic()
        while True:
            time.sleep(self.interval)
            try:
                self.sample()
                if time.monotonic() - last_write > 5:
                    self.write()
                    last_write = time.monotonic()
            except Exception:  # a profiler must never take its process down
                pass

    def write(self) -> None:
        total = sum(os.times()[:2]) - self.started_cpu
        own = time.clock_gettime(time.CLOCK_THREAD_CPUTIME_ID)
        head = (f"wall {time.monotonic() - self.started:.1f} s, process CPU {total:.2f} s: Python threads "
                f"{self.python_cpu:.2f} s, this profiler {own:.2f} s, the rest (native threads: librdkafka, torch's "
                f"pool; threads too short-lived to sample) {total - self.python_cpu - own:.2f} s\n"
                f"cyclic GC (inside the above): {self.gc_cpu:.2f} s in {'/'.join(map(str, self.gc_collections))} "
                f"collections of generation 0/1/2, {self.gc_collected} unreachable objects freed")
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(head + "\n\n" + report(self.stacks))
        os.replace(tmp, self.out.with_suffix(".txt"))
        collapsed = [f"{thread};{';'.join(frames)} {int(cpu * 1e6)}" for (thread, frames), cpu in self.stacks.items()]
        tmp.write_text("\n".join(collapsed) + "\n")
        os.replace(tmp, self.out.with_suffix(".collapsed"))


def read_collapsed(path: Path) -> collections.Counter:
    """A ``.collapsed`` file back as {(thread, frames): CPU s}."""
    stacks: collections.Counter = collections.Counter()
    for line in Path(path).read_text().splitlines():
        stack, _, micros = line.rpartition(" ")
        if stack:
            thread, *frames = stack.split(";")
            stacks[(thread, tuple(frames))] += int(micros) / 1e6
    return stacks


def report(stacks: collections.Counter, top: int = 40) -> str:
    """CPU seconds by thread, by function's own time and by inclusive time (a function counted once per stack)."""
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    by_thread: collections.Counter = collections.Counter()
    for (thread, frames), cpu in stacks.items():
        if cpu <= 0:
            continue
        by_thread[thread] += cpu
        if frames:
            own[frames[-1]] += cpu
        for f in set(frames):
            inclusive[f] += cpu
    lines = ["CPU s by thread:"] + [f"  {cpu:8.3f}  {name}" for name, cpu in by_thread.most_common(12)]
    lines += ["", f"self CPU s (top {top}):"] + [f"  {cpu:8.3f}  {f}" for f, cpu in own.most_common(top)]
    lines += ["", f"inclusive CPU s (top {top * 2}):"]
    lines += [f"  {cpu:8.3f}  {f}" for f, cpu in inclusive.most_common(top * 2)]
    return "\n".join(lines) + "\n"
