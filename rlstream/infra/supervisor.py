"""Stage processes: start an ``rlstream`` subcommand as its own process, watch it, kill it, restart it.

Used by ``rlstream demo``, the benchmarks (chaos, the loop benchmarks, memory) and the integration tests. Each
process runs in its own session, so a signal to it (or a Ctrl-C in the terminal) reaches that process group and
nothing else on the machine; it appends to its own log. A restarted process keeps its argv, so a stage keeps its
``--instance``: its new transactional producer fences the old one's zombie transactions, and its static group
membership takes its partitions back at once. A process stops when its supervisor is gone (``SUPERVISOR_ENV``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlstream.runtime.lifecycle import SUPERVISOR_ENV

#: One compute thread per process: a small machine runs every stage at once.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def stage_env(bootstrap: str, run: str, **extra: str) -> dict[str, str]:
    """This process's environment, pointed at a broker and a run (``RLSTREAM_BOOTSTRAP``, ``RLSTREAM_RUN``).

    Without an ``OMP_NUM_THREADS`` of its own a stage runs one compute thread (``--threads 0`` reads it): a
    supervisor starts several stages at once on one machine, and torch's threads spin on cores another stage
    holds. A placed stage gets its share of the cores instead (``seat_env``)."""
    env = dict(os.environ, RLSTREAM_BOOTSTRAP=bootstrap, RLSTREAM_RUN=run, **extra)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def seat_env(env: dict[str, str], seat) -> dict[str, str]:
    """``env`` for a stage placed at ``seat`` (``infra/placement.py``): its threads for every thread pool, and on a
    GPU that GPU as the only one its process sees (in-process vLLM takes the first visible one)."""
    out = dict(env, OMP_NUM_THREADS=str(seat.threads), MKL_NUM_THREADS=str(seat.threads))
    if seat.gpu is not None:
        out["CUDA_VISIBLE_DEVICES"] = str(seat.gpu)
    return out


class StageProc:
    """One ``python -m <module> <argv>`` process (a stage, or any ``rlstream`` subcommand), started alike each time.

    ``cwd``: its working directory (None: this process's); with ``-m`` that directory is importable in it, so
    reward functions and environments given by dotted path can live there. ``group``: its consumer group, whose
    commits show its progress. ``prefix``: a command that runs it, e.g. ``ip netns exec NS`` (it must exec the
    process, so that the process is the one signalled).
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, *, group: str | None = None,
                 module: str = "rlstream.cli", cwd: Path | None = None, prefix: tuple[str, ...] = ()):
        self.name = name
        self.prefix = tuple(prefix)
        self.argv = argv
        self.env = env
        self.log_path = Path(log_path)
        self.group = group
        self.module = module
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.started_at = 0.0
        self.asked_to_stop = False  # since the last start: an exit then is planned, not a crash

    def start(self) -> "StageProc":
        """Launch it in its own session, appending to its log."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {self.starts} at {time.strftime('%H:%M:%S')} ===\n".encode())
            log.flush()
            # It stops (gracefully) when this process is gone, however this process ends (runtime/lifecycle.py).
            env = dict(self.env, **{SUPERVISOR_ENV: str(os.getpid())})
            self.proc = subprocess.Popen([*self.prefix, sys.executable, "-m", self.module, *self.argv], env=env,
                                         cwd=self.cwd,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.asked_to_stop = False
        self.starts += 1
        self.started_at = time.monotonic()
        return self

    @property
    def pid(self) -> int | None:
        """Its process id (None before the first start)."""
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        """Its exit code once it exited (negative: the signal that ended it); None while it runs."""
        return self.proc.poll() if self.proc else None

    def alive(self) -> bool:
        """Started and not exited."""
        return self.proc is not None and self.proc.poll() is None

    def exited(self) -> bool:
        """Started and exited since (on its own, or because it was stopped)."""
        return self.proc is not None and self.proc.poll() is not None

    def crashed(self) -> bool:
        """Exited without being asked to (no stop, terminate or kill since its last start)."""
        return self.exited() and not self.asked_to_stop

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to exit (subprocess.TimeoutExpired after ``timeout`` seconds); its exit code."""
        return self.proc.wait(timeout)

    def terminate(self) -> None:
        """SIGTERM it (a stage ends its open transaction cleanly and exits), without waiting."""
        self.asked_to_stop = True
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL it and its own children, and reap it."""
        self.asked_to_stop = True
        if not self.alive():
            return
        # Its own process group only (start_new_session): nothing else on the machine is touched.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, SIGKILL after ``timeout`` seconds; the exit code (None if it was never started)."""
        if self.proc is None:
            return None
        self.asked_to_stop = True
        if self.alive():
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def log_tail(self, chars: int = 3000) -> str:
        """The end of its log ('' when there is none yet)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Supervisor:
    """Keeps a set of stage processes running: restarts any that exits without being asked to, and counts it."""

    procs: dict[str, StageProc] = field(default_factory=dict)
    crashes: list[tuple[str, int | None]] = field(default_factory=list)  # (name, exit code) of unplanned exits

    def add(self, proc: StageProc) -> StageProc:
        """Supervise ``proc`` (not started yet) under its name."""
        self.procs[proc.name] = proc
        return proc

    def start_all(self) -> None:
        """Start every process, in the order added."""
        for p in self.procs.values():
            p.start()

    def check(self) -> list[tuple[str, int | None]]:
        """Restart processes that exited without being asked to; (name, exit code) of each."""
        restarted = []
        for name, p in self.procs.items():
            if p.crashed():
                restarted.append((name, p.returncode))
                p.start()
        self.crashes += restarted
        return restarted

    def dead(self) -> list[str]:
        """Processes that exited without being asked to (for callers that report them instead of restarting)."""
        return [name for name, p in self.procs.items() if p.crashed()]

    def stop_all(self, order: list[str] | None = None, timeout: float = 60.0) -> dict[str, int | None]:
        """Stop every process one after the other, those in ``order`` first (upstream first, so downstream can
        finish what it got), then the rest in the order added; their exit codes."""
        names = [n for n in order or [] if n in self.procs] + [n for n in self.procs if n not in (order or [])]
        return {name: self.procs[name].stop(timeout) for name in names}
