"""A sandbox that lives as long as an episode: one process per episode runs every tool call, so what a call starts
in the background (a server, a watcher, a build) is still running at the next step.

The session is the subprocess sandbox of ``rlstream.sandbox`` made persistent: the same namespaces (user, net,
pid, mount; HOME and the project folder covered), rlimits, minimal environment and audit hooks, prepared by the
same code; but its program is a small command server instead of one snippet. The host sends each call as a JSON
line on a FIFO in the sandbox's private folder; the server runs it (``/bin/sh -c`` or the sandbox's Python) in the
episode's workspace as a process group of its own, waits for that call alone (its background children keep
running, and keep the output pipe: what they print later is drained and dropped), and answers on its stdout.

Ending: ``close`` (the episode ended) kills the session's init, and with it the pid namespace, so every process the
episode started dies with it, whatever it did to escape its process group. A host that dies closes the FIFO's
only writer: the server reads end-of-file, kills its calls' groups and exits, and the namespace goes with it.
A call past its timeout has its group killed and fails as ``timeout``; a session that stops answering is killed
and started again at the next call (its files remain, its processes do not).
"""
from __future__ import annotations

import json
import logging
import os
import selectors
import shutil
import subprocess
import threading
import time

# The sandbox's own preparation and teardown, reused as they are.
from rlstream.sandbox import Sandbox, SandboxResult, classify
from rlstream.sandbox.process import INIT, kill_group, read_reports, wait_gone

log = logging.getLogger(__name__)

#: Seconds a session may take to start (namespaces, Python) before it is given up as a sandbox error.
START_TIMEOUT_S = 30.0

# The command server, run by the sandbox's init as its one program; its folder holds the FIFO it reads.
_SERVER = r'''
import fcntl, json, os, select, signal, subprocess, sys, threading, time
MAX_OUTPUT, EXE = {max_output}, {exe!r}
groups = set()

def answer(**kw):
    os.write(1, (json.dumps(kw) + "\n").encode())

def drop(pipe):
    # What a call's background children print after its answer: read so they never block, kept nowhere.
    os.set_blocking(pipe.fileno(), True)
    while os.read(pipe.fileno(), 65536):
        pass
    pipe.close()

def kill(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass

def run(req):
    started = time.monotonic()
    shell = req["kind"] == "shell"
    argv = ["/bin/sh", "-c", req["code"]] if shell else [EXE, "-B", "-"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL if shell else subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    groups.add(proc.pid)
    if not shell:
        try:
            proc.stdin.write(req["code"].encode())
            proc.stdin.close()
        except OSError:
            pass
    fd, buf, eof = proc.stdout.fileno(), bytearray(), [False]
    os.set_blocking(fd, False)
    capacity = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)

    def pump(most):  # what is in the pipe now (up to ``most`` bytes), without waiting
        while not eof[0] and most > 0:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return
            eof[0], most = not chunk, most - len(chunk)
            if len(buf) <= MAX_OUTPUT:
                buf.extend(chunk)

    deadline, timed_out, status, cpu = started + req["timeout"], False, None, 0.0
    while status is None:
        pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            status, cpu = os.waitstatus_to_exitcode(st), ru.ru_utime + ru.ru_stime
            proc.returncode = status
        elif time.monotonic() > deadline:
            kill(proc.pid)
            timed_out = True
        elif eof[0]:
            time.sleep(0.005)
        else:
            select.select([fd], [], [], 0.005)
            pump(capacity)
    # Everything the call wrote before it exited is in the pipe by now (one pipe's capacity at most), so this
    # read ends its output however late this process is scheduled (a timed wait for a reader thread lost it on a
    # loaded machine), and a background child that keeps writing cannot hold the answer.
    pump(capacity)
    if timed_out:
        kill(proc.pid)
    if not eof[0]:  # a background child still holds the pipe
        threading.Thread(target=drop, args=(proc.stdout,), daemon=True).start()  # keeps the pipe open
    out = bytes(buf)
    answer(id=req["id"], output=out[:MAX_OUTPUT].decode("utf-8", "replace"), truncated=len(out) > MAX_OUTPUT,
           exit=status, cpu_s=cpu, timed_out=timed_out)

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls"), "rb") as calls:
    answer(ready=True)  # only once the host may close its spare reader
    for line in calls:
        run(json.loads(line))
for pgid in groups:  # the host is gone: nothing of the episode outlives it
    kill(pgid)
'''


class Session:
    """One episode's persistent sandbox, started on first use; thread-safe, and ``run`` never raises.

    A backend gives ``alive``, ``_start``, ``_call`` and ``_stop``; a broken session is stopped and answered as a
    ``sandbox_error``, and the next call starts a new one.
    """

    what = "sandbox session"  # for the log line of a broken session

    def __init__(self) -> None:
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def run(self, kind: str, code: str) -> SandboxResult:
        """Run a ``shell`` command or ``python`` code in the session (started on first use); never raises."""
        started = time.monotonic()
        with self._lock:
            try:
                if not self.alive:
                    self._start()
                return self._call(kind, code, started)
            except Exception as exc:  # the session itself broke: say so, and start a new one next time
                log.exception("%s error", self.what)
                self._stop()
                return SandboxResult(f"sandbox error: {type(exc).__name__}: {exc}", -1,
                                     (time.monotonic() - started) * 1000, failure_class="sandbox_error")

    def close(self) -> None:
        """End the session and every process of the episode with it (idempotent)."""
        with self._lock:
            self._stop()

    def _start(self) -> None:
        raise NotImplementedError

    def _call(self, kind: str, code: str, started: float) -> SandboxResult:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError


class SandboxSession(Session):
    """One episode's persistent sandbox (subprocess backend) with its workspace as cwd; thread-safe."""

    def __init__(self, sandbox: Sandbox, workdir: str):
        if sandbox.backend != "subprocess":
            raise ValueError("a persistent sandbox session needs the subprocess backend")
        super().__init__()
        self.sandbox, self.workdir = sandbox, workdir
        self._proc: subprocess.Popen | None = None
        self._base = ""
        self._calls = -1
        self._status = -1
        self._lines = bytearray()
        self._next_id = 0

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _start(self) -> None:
        self._stop()
        lim, sandbox = self.sandbox.limits, self.sandbox
        code = _SERVER.format(max_output=lim.max_output_bytes, exe=os.path.realpath(sandbox._exe))
        base, prefix, cfg = sandbox._prepare(code, self.workdir, ("/bin/sh",))
        fifo = os.path.join(base, "hook", "calls")
        os.mkfifo(fifo, 0o600)
        status_r, status_w = os.pipe()
        self._base, self._status = base, status_r
        self._proc = subprocess.Popen([*prefix, sandbox._exe, "-I", "-c", INIT, json.dumps(cfg), str(status_w)],
                                      cwd=cfg["cwd"], env={"PATH": cfg["env"]["PATH"], "LANG": "C.UTF-8"},
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      pass_fds=(status_w,), start_new_session=True)
        os.close(status_w)
        # Held open read-write until the server has opened its end, so that opening the write end never blocks;
        # after that the host is the only writer, and its death is the server's end-of-file.
        spare = os.open(fifo, os.O_RDWR)
        try:
            self._calls = os.open(fifo, os.O_WRONLY)
            if self._read(time.monotonic() + max(START_TIMEOUT_S, lim.timeout_s), lambda m: m.get("ready")) is None:
                raise OSError(f"the sandbox session did not start within {max(START_TIMEOUT_S, lim.timeout_s):g}s")
        finally:
            os.close(spare)

    def _call(self, kind: str, code: str, started: float) -> SandboxResult:
        lim = self.sandbox.limits
        self._next_id += 1
        request = {"id": self._next_id, "kind": kind, "code": code, "timeout": lim.timeout_s}
        os.write(self._calls, (json.dumps(request) + "\n").encode())
        # The server enforces the call's timeout; this one covers a server that stopped answering.
        reply = self._read(started + lim.timeout_s + 10, lambda m: m.get("id") == request["id"])
        duration = (time.monotonic() - started) * 1000
        if reply is None:
            self._stop()
            return SandboxResult("", -9, duration, failure_class="timeout")
        exit_code, output, cut = reply["exit"], reply["output"], reply["truncated"]
        if reply["timed_out"]:
            return SandboxResult(output, -9, duration, cut, "timeout")
        if kind == "shell":  # the shell's convention: a child killed by a signal is 128 + its number
            return SandboxResult(output, exit_code if exit_code >= 0 else 128 - exit_code, duration, cut)
        return SandboxResult(output, exit_code, duration, cut, classify(exit_code, reply["cpu_s"], lim.cpu_s))

    def _read(self, deadline: float, wanted) -> dict | None:
        """The server's next answer that ``wanted`` accepts (other lines are logged); None past the deadline or
        when the session ended."""
        fd = self._proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                while b"\n" in self._lines:
                    line, _, rest = bytes(self._lines).partition(b"\n")
                    self._lines = bytearray(rest)
                    try:
                        message = json.loads(line)
                    except ValueError:
                        message = None
                    if isinstance(message, dict) and wanted(message):
                        return message
                    log.debug("sandbox session: %s", line[:500])
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                if sel.select(min(remaining, 0.5)):
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        raise OSError(f"the sandbox session ended: {bytes(self._lines[-500:])!r}")
                    self._lines += chunk

    def _stop(self) -> None:
        """Kill the session's init, and with its pid namespace every process of the episode; remove its folder."""
        if self._calls >= 0:
            # End of file first: the server kills its calls' process groups and exits (all there is to end them
            # where no pid namespace holds them), then the init and the namespace are killed regardless.
            os.close(self._calls)
            self._calls = -1
            try:
                self._proc.wait(1.0)
            except subprocess.TimeoutExpired:
                pass
        if self._proc is not None:
            kill_group(self._proc.pid)
            self._proc.wait()
            self._proc.stdout.close()
            reports = read_reports(self._status)
            wait_gone(reports.get("pid"))
        for fd in (self._calls, self._status):
            if fd >= 0:
                os.close(fd)
        self._calls = self._status = -1
        if self._base:
            shutil.rmtree(self._base, ignore_errors=True)
        self._proc, self._base, self._lines = None, "", bytearray()
