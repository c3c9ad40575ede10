"""Start and stop real stage processes (``python -m rlstream.cli run ...``) for integration tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_stage(stage: str, bootstrap: str, run: str, *args: str, log_path: Path | None = None) -> subprocess.Popen:
    """Launch one stage process in its own session; tests/ is importable for test reward functions."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
               RLSTREAM_BOOTSTRAP=bootstrap, RLSTREAM_RUN=run)
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "rlstream.cli", "run", stage, *args], env=env, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    """Signal a stage process and wait for it; returns its exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout)
