"""What a benchmark leaves behind. Its raw line (``harness/record.py``) and its logs are what it keeps; its run's
Kafka topics, the weights its trainer wrote and the data of an archive or brokers it started in its run's folder are
scratch, deleted when it is done.

Every benchmark run makes a fresh run namespace (11 topics of up to 8 partitions each), and `make bench` makes
about a hundred: a local broker that had collected them over a few weeks held 12,000 partitions and took over a
minute to start, past `rlstream up`'s wait, and a recipe's run left up to 4 GB of versions in its weights folder.
Kafka deletes a topic's files in the background, so a deletion costs the benchmark nothing it measures.

Every run a benchmark makes up is named by ``run_name`` (``bench-KIND-...``), so what a benchmark left behind is
told from a user's runs and a test's by its name (``tests/e2e/test_benchmarks.py`` checks that none is left).
``RLSTREAM_BENCH_KEEP=1`` keeps them (to read a run's records or load a version afterwards). A run a user named
(``chaos --run R``) is theirs and never discarded: only the names a benchmark made up are; and ``chaos`` keeps a
run that failed its checks, whose records are the finding. Deletion is best effort:
a broker already gone is said on stderr, and ``rlstream topics --delete --run R`` does it by hand.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from rlstream.kafka.topics import delete_topics

#: Set to 1 to keep a benchmark's topics and weights.
KEEP_ENV = "RLSTREAM_BENCH_KEEP"
#: The start of every run name a benchmark makes up.
PREFIX = "bench-"


def run_name(kind: str) -> str:
    """A fresh run name for a benchmark's ``kind`` of run: ``bench-KIND-HHMMSS-xxxx``."""
    return f"{PREFIX}{kind}-{time.strftime('%H%M%S')}-{uuid.uuid4().hex[:4]}"


def keeping() -> bool:
    """Whether scratch is kept ($RLSTREAM_BENCH_KEEP set to anything but empty or 0)."""
    return os.environ.get(KEEP_ENV, "") not in ("", "0")


def discard(bootstrap: str | None, run: str, workdir: Path | None = None,
            folders: tuple[str, ...] = ("weights",)) -> None:
    """Delete ``run``'s topics on ``bootstrap`` and ``workdir``'s scratch ``folders`` now (unless kept): the weights a
    trainer wrote, and where a benchmark keeps them in its run's folder, its archive and its own brokers' data."""
    if keeping():
        return
    if workdir is not None:
        for folder in folders:
            shutil.rmtree(workdir / folder, ignore_errors=True)
    if not bootstrap:
        return
    try:
        delete_topics({"bootstrap.servers": bootstrap}, run, timeout=30.0)
    except Exception as exc:  # the broker stopped first, or timed out: the figures are already recorded
        print(f"[scratch] run {run}'s topics not deleted ({type(exc).__name__}: {exc}); "
              f"`rlstream topics --delete --run {run}` deletes them", file=sys.stderr, flush=True)


def discard_at_exit(bootstrap: str | None, run: str, workdir: Path | None = None,
                    folders: tuple[str, ...] = ("weights",)) -> None:
    """``discard`` when this process exits (a normal end, an error, sys.exit or a SIGTERM the script turns into
    one; a SIGKILL leaves them, as it leaves everything)."""
    if not keeping():
        atexit.register(discard, bootstrap, run, workdir, folders)
