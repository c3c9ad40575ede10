"""Stop a stage process for good: SIGTERM, then SIGKILL if it does not exit, so no test leaves one behind."""
from __future__ import annotations

import subprocess

from stage_proc import stop


def stop_or_kill(proc: subprocess.Popen, timeout: float = 60) -> int | None:
    """The exit code after SIGTERM; None (and the process SIGKILLed) when SIGTERM did not end it in time."""
    try:
        return stop(proc, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        return None
