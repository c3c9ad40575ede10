"""One process's life, the same for every ``rlstream run`` process: the stages the StageRunner drives and the
services with loops of their own (the trainer, the archive, the monitor).

The rules (enforced here, but for the error codes):

- **A first SIGTERM or SIGINT asks for a graceful stop**: every callback given to ``on_stop`` runs (each sets its
  loop's stop flag and returns), the process finishes what is open (commits or aborts its transaction, flushes its
  batch) and returns from its loop.
- **The stop has a deadline** (``--stop-timeout-s``): a process still running then is ended with exit code
  ``EXIT_DEADLINE``. Nothing is lost that way: an open transaction is aborted by the broker or fenced by the
  restart, as after a SIGKILL, and the records are read again.
- **A second signal stops at once**, with exit code 128 + the signal's number (130 for a second Ctrl-C). One within
  ``SAME_SIGNAL_S`` of the first is the same request: a terminal's Ctrl-C reaches every process of its group, and a
  launcher forwards it as well (the trainer's ranks).
- **Exit codes**: 0 stopped or done; ``EXIT_DEADLINE``; 128 + N; and, from ``cli.main``, 1 for a UserError (the
  broker never answered, a missing optional package, a bad setup) and 2 for a UsageError.
- **The metrics server** starts with the work (``serve_metrics``) and stops when the process leaves.
- **A supervised process does not outlive its supervisor**: one started with ``SUPERVISOR_ENV`` in its environment
  (``infra/supervisor.py`` sets it: the demo, the benchmarks, the tests' stage processes) stops as on a SIGTERM
  when its parent is gone, however that parent ended (a SIGKILL, a crash, a ``pkill`` of a benchmark), instead of
  working on, orphaned, against whatever broker it can still reach. A parent-death signal would not do: the kernel
  sends it when the parent's *thread* that forked the process exits, and supervisors restart stages from threads.

A process has one lifecycle (its signal handlers are the process's): ``process()`` returns it, and the first call
from the main thread installs the handlers. A loop run outside ``rlstream run`` (a replay's runner, a runner or a
trainer inside a test) registers its stop the same way; the deadline is the CLI's alone (``configure``).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

from rlstream import metrics

log = logging.getLogger(__name__)

EXIT_OK, EXIT_USER, EXIT_USAGE = 0, 1, 2
#: A graceful stop that did not finish within ``--stop-timeout-s`` (the code timeout(1) uses).
EXIT_DEADLINE = 124
#: Signals this close after the first are the same request (module docstring).
SAME_SIGNAL_S = 1.0
#: How long the interpreter's exit may wait for threads once the work is done (``Lifecycle.finish``).
THREAD_GRACE_S = 5.0

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: In a process's environment: the pid of the supervisor it must not outlive (module docstring).
SUPERVISOR_ENV = "RLSTREAM_SUPERVISOR_PID"
#: How often a supervised process looks for its parent.
PARENT_POLL_S = 1.0


def _exit_now(code: int) -> None:
    """Leave the process without the interpreter's teardown: what is still running is abandoned, as a SIGKILL
    would. Only for a deadline passed, a second signal, or threads that cannot be joined (``Lifecycle.finish``):
    the exactly-once commits make each safe (nothing uncommitted was visible, and it is read again)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process
    return True


class Lifecycle:
    """The process's stop request, its deadline, its metrics server and its exit."""

    def __init__(self, name: str = "rlstream", stop_timeout_s: float | None = None):
        self.name = name
        self.stop_timeout_s = stop_timeout_s  # None or <= 0: no deadline
        self.stopping = threading.Event()
        self.stop_reason = ""
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._stop_asked_at: float | None = None
        self._metrics = None
        self.installed = False
        self._watching = False

    def configure(self, name: str, stop_timeout_s: float | None) -> "Lifecycle":
        """Name the process and set its stop deadline (the CLI does, once it has read its settings)."""
        self.name, self.stop_timeout_s = name, stop_timeout_s
        self.watch_supervisor()
        return self

    def watch_supervisor(self) -> bool:
        """When ``SUPERVISOR_ENV`` is set, stop (as on SIGTERM) once this process's parent is gone: at once if the
        supervisor was gone before this process looked, else when the parent changes (the orphan is re-parented).
        False when no supervisor is named, or it is watched already."""
        named = os.environ.get(SUPERVISOR_ENV, "")
        if not named.isdigit() or self._watching:
            return False
        self._watching, parent = True, os.getppid()
        if parent != int(named) and not _exists(int(named)):
            self.stop("supervisor's exit")
            return True

        def watch() -> None:
            while not self._done.wait(PARENT_POLL_S):
                if os.getppid() != parent:
                    log.warning("%s: its supervisor (pid %d) is gone: stopping", self.name, parent)
                    self.stop("supervisor's exit")
                    return
        threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()
        return True

    # -- stopping ------------------------------------------------------------------------------------------------

    def on_stop(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (it must only flag a loop and return) when a stop is asked; at once if one was. Returns
        a function that takes it back (a loop that has returned)."""
        with self._lock:
            self._callbacks.append(callback)
            stopping = self.stopping.is_set()
        if stopping:
            callback()

        def forget() -> None:
            with self._lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)
        return forget

    def stop(self, reason: str = "asked") -> None:
        """Ask every registered loop to finish and return; the deadline starts now."""
        with self._lock:
            first = not self.stopping.is_set()
            if first:
                self.stop_reason, self._stop_asked_at = reason, time.monotonic()
                self.stopping.set()
            callbacks = list(self._callbacks)
        if not first:
            return
        if self.stop_timeout_s and self.stop_timeout_s > 0:
            threading.Thread(target=self._watch_deadline, name="stop-deadline", daemon=True).start()
        for callback in callbacks:
            callback()

    def _watch_deadline(self) -> None:
        if self._done.wait(self.stop_timeout_s):
            return
        running = ", ".join(t.name for t in threading.enumerate() if t is not threading.current_thread()) or "none"
        log.error("%s did not stop within --stop-timeout-s %.0f s of the %s; leaving now (exit %d); what was not "
                  "committed is read again (threads: %s)", self.name, self.stop_timeout_s, self.stop_reason,
                  EXIT_DEADLINE, running)
        _exit_now(EXIT_DEADLINE)

    def install_signals(self) -> bool:
        """SIGTERM and SIGINT stop gracefully, a second one at once; only from the main thread (False otherwise)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in _SIGNALS:
            signal.signal(sig, self._on_signal)
        self.installed = True
        return True

    def _on_signal(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self.stopping.is_set():
            if time.monotonic() - (self._stop_asked_at or 0.0) < SAME_SIGNAL_S:
                return
            log.warning("%s: second signal (%s): stopping now, exit %d", self.name, name, 128 + signum)
            _exit_now(128 + signum)
        deadline = f" (within {self.stop_timeout_s:.0f} s)" if self.stop_timeout_s and self.stop_timeout_s > 0 else ""
        log.info("%s: %s: finishing what is open, then stopping%s; a second signal stops at once", self.name, name,
                 deadline)
        self.stop(name)

    # -- the metrics server --------------------------------------------------------------------------------------

    def serve_metrics(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics until the process leaves (``finish``); port 0 picks a free one. Returns the port."""
        self._metrics = metrics.start(port, addr)
        return self._metrics.server_address[1]

    # -- leaving -------------------------------------------------------------------------------------------------

    def finish(self, code: int = EXIT_OK) -> int:
        """The work has returned: stop the metrics server and return the exit code, for the interpreter to exit
        with normally.

        A normal exit waits for every non-daemon thread. One that will not end is one that cannot be joined: a sync
        handler still inside a user's function (``runtime/handlers.py``'s pool: concurrent.futures joins its
        workers at exit and nothing can interrupt one), or a library's thread or exit hook that hangs. So a daemon
        watchdog gives the interpreter's exit ``THREAD_GRACE_S``; past that it names the threads still there and
        leaves without them (the work is committed by now). Idle pool workers are not in the way: the
        interpreter's exit releases them before it joins.
        """
        self._done.set()  # the work returned: no stop deadline ends the process from here on
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
            self._metrics = None
        threading.Thread(target=self._watch_exit, args=(code,), name="exit-watchdog", daemon=True).start()
        return code

    def _watch_exit(self, code: int) -> None:
        time.sleep(THREAD_GRACE_S)
        stuck = [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
        log.warning("%s: done, but the exit waited %.0f s for threads that cannot be joined (%s); leaving without "
                    "them (exit %d)", self.name, THREAD_GRACE_S, ", ".join(stuck) or "an exit hook", code)
        _exit_now(code)


_process: Lifecycle | None = None
_process_lock = threading.Lock()


def process() -> Lifecycle:
    """This process's lifecycle; the first call from the main thread installs its signal handlers."""
    global _process
    with _process_lock:
        if _process is None:
            _process = Lifecycle()
        life = _process
    if not life.installed:
        life.install_signals()
    return life
