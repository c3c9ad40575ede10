"""The subprocess backend's process plumbing, shared with the per-episode sessions of ``rlstream.envs``: the
trusted init's text, killing a sandbox's process group, reading the init's reports, waiting for its pid namespace
to end, and path helpers."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import time

from rlstream.sandbox.child import source

#: The trusted first process inside the sandbox (child/init.py), run with ``python -I -c``.
INIT = source("init")
#: The audit hook every sandboxed Python loads as sitecustomize (child/hook.py), after its ``_CONFIG`` line.
HOOK = source("hook")


def real(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))


def inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def read_reports(fd: int) -> dict:
    """The init's JSON lines, merged; every writer is dead by now, so reading ends."""
    data = bytearray()
    while chunk := os.read(fd, 65536):
        data += chunk
    reports: dict = {}
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            reports.update(json.loads(line))
        except ValueError:
            pass
    return reports


def wait_gone(pid: int | None, timeout: float = 5.0) -> None:
    """Wait for the sandbox's init to die: with a pid namespace, its death is every descendant's."""
    if not pid:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return
        time.sleep(0.01)
