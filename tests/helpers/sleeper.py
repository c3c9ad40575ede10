"""A stand-in stage process for the supervisor's tests: ``python -m tests.helpers.sleeper SECONDS [FLAGS...]``.

It writes ``ready`` once its SIGTERM handler is in place, then sleeps SECONDS (0: two minutes, so that a failed
test leaves nothing behind for long) and exits 3.
SIGTERM ends it with 0. Flags: ``ignore-term`` (SIGTERM only makes it write ``term ignored``), ``child`` (it first
starts a ``sleep`` child in its process group and writes ``child <pid>``).
"""
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    """Sleep as told; the exit code says how it ended (3: on its own)."""
    seconds, flags = float(argv[0]), set(argv[1:])
    signal.signal(signal.SIGTERM, (lambda *_: print("term ignored", flush=True)) if "ignore-term" in flags
                  else lambda *_: sys.exit(0))
    if "child" in flags:
        print(f"child {subprocess.Popen(['sleep', '120']).pid}", flush=True)
    print("ready", flush=True)
    deadline = time.monotonic() + (seconds or 120)
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
