"""Process supervision for scripts that run the whole loop: stage processes, their consumer groups, the topics.

Shared by benchmarks/chaos.py and the loop benchmarks: start every stage as its own
``rlstream run`` process, SIGKILL and restart one with the same ``--instance``, see
when a stage's consumer group commits again, and follow every topic of a run.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, ConsumerGroupTopicPartitions, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient

from rlstream.kafka.topics import TOPICS, topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from rlstream.schemas.records import RECORD_TYPES, Record

ROOT = Path(__file__).resolve().parents[1]


def stage_env(bootstrap: str, run: str, **extra: str) -> dict[str, str]:
    """The environment of a stage process: the run, one thread per process (small machines), project on the path."""
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, RLSTREAM_BOOTSTRAP=bootstrap, RLSTREAM_RUN=run, OMP_NUM_THREADS="1",
                MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=path, **extra)


class StageProc:
    """One ``rlstream`` process (a stage, or any subcommand) that can be SIGKILLed and started again alike."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, group: str | None = None):
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.group = group  # its consumer group, whose commits show progress
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.started_at = 0.0

    def start(self) -> "StageProc":
        """Launch it in its own session, appending to its log."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {self.starts} at {time.strftime('%H:%M:%S')} ===\n".encode())
            log.flush()
            self.proc = subprocess.Popen([sys.executable, "-m", "rlstream.cli", *self.argv], env=self.env, cwd=ROOT,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1
        self.started_at = time.monotonic()
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL the process (its own children included) and reap it."""
        if not self.alive():
            return
        # Its own process group only (start_new_session): nothing else on the machine is touched.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (a clean end of the open transaction), SIGKILL after ``timeout``; the exit code."""
        if self.proc is None:
            return None
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Supervisor:
    """Keeps a set of stage processes running: restarts any that exits on its own, and counts it."""

    procs: dict[str, StageProc] = field(default_factory=dict)
    crashes: list[tuple[str, int | None]] = field(default_factory=list)  # (name, exit code) of unplanned exits

    def add(self, proc: StageProc) -> StageProc:
        self.procs[proc.name] = proc
        return proc

    def check(self) -> list[str]:
        """Restart processes that exited without being asked to; their names."""
        restarted = []
        for name, p in self.procs.items():
            if p.proc is not None and not p.alive():
                self.crashes.append((name, p.proc.returncode))
                p.start()
                restarted.append(name)
        return restarted

    def stop_all(self, order: list[str] | None = None, timeout: float = 60.0) -> dict[str, int | None]:
        """SIGTERM every process (upstream first, so downstream can finish what it got); exit codes."""
        codes = {}
        for name in order or list(self.procs):
            if name in self.procs:
                codes[name] = self.procs[name].stop(timeout)
        return codes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_offsets(admin: AdminClient, group: str, timeout: float = 10.0) -> dict[tuple[str, int], int]:
    """The committed offsets of a consumer group ({} when it has none, or the broker did not answer)."""
    try:
        future = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)],
                                                   request_timeout=timeout)[group]
        parts = future.result(timeout + 5).topic_partitions or []
    except Exception:  # a broker or coordinator moving: callers poll again
        return {}
    return {(tp.topic, tp.partition): tp.offset for tp in parts if tp.offset >= 0 and tp.error is None}


def advanced(before: dict[tuple[str, int], int], now: dict[tuple[str, int], int]) -> bool:
    """Whether any partition's committed offset moved past ``before``."""
    return any(offset > before.get(tp, -1) for tp, offset in now.items())


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.5, what: str = "") -> object:
    """Poll until ``predicate()`` is truthy; TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Seen:
    """One committed record as the tail saw it."""

    topic: str  # logical
    partition: int
    offset: int
    key: bytes | None
    headers: dict[str, bytes]
    record: Record | None  # None when the value does not decode
    seen_at: float  # monotonic


class TopicTail:
    """Follows every partition of the given topics of a run from the start, read_committed, in a thread."""

    def __init__(self, bootstrap: str, run: str, topics: list[str] | None = None, client_config: dict | None = None):
        self.run = run
        self.topics = topics or list(TOPICS)
        self.records: dict[str, list[Seen]] = {t: [] for t in self.topics}
        self.lock = threading.Lock()
        self._logical = {topic_name(run, t): t for t in self.topics}
        self._eof: dict[tuple[str, int], bool] = {}
        self.last_record_at = time.monotonic()
        self._stop = threading.Event()
        self._consumer = Consumer({**(client_config or {}), "bootstrap.servers": bootstrap,
                                   "group.id": f"{run}.tail-{os.getpid()}", "enable.auto.commit": False,
                                   "isolation.level": "read_committed", "enable.partition.eof": True,
                                   # A failed lookup of the beginning falls back to this: the end would skip records.
                                   "auto.offset.reset": "earliest",
                                   "fetch.max.bytes": 64 * 1024 * 1024})
        parts = []
        for physical in self._logical:
            meta = self._consumer.list_topics(physical, timeout=30).topics[physical]
            for p in meta.partitions:
                parts.append(TopicPartition(physical, p, OFFSET_BEGINNING))
                self._eof[(physical, p)] = False
        self._consumer.assign(parts)
        self._thread = threading.Thread(target=self._loop, name="topic-tail", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        codec = default_codec()
        while not self._stop.is_set():
            # Wake on the first record, then take what is fetched: consume(500, 0.2) would sit out the 0.2 s
            # whenever fewer than 500 records wait, and a paced source would see each version that much later.
            msgs = self._consumer.consume(1, 0.2)
            if msgs:
                msgs += self._consumer.consume(499, 0)
            batch: list[Seen] = []
            for m in msgs:
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        self._eof[(m.topic(), m.partition())] = True
                    else:
                        print(f"topic tail: {err}", file=sys.stderr, flush=True)
                    continue
                self._eof[(m.topic(), m.partition())] = False
                logical = self._logical[m.topic()]
                try:
                    _, value = codec.decode(m.value(), expect=TOPICS[logical].record)
                    record = RECORD_TYPES[TOPICS[logical].record].from_dict(value)
                except Exception:  # tests put garbage on topics on purpose
                    record = None
                batch.append(Seen(logical, m.partition(), m.offset(), m.key(), hdr.as_dict(m.headers()), record,
                                  time.monotonic()))
            if batch:
                with self.lock:
                    for s in batch:
                        self.records[s.topic].append(s)
                self.last_record_at = time.monotonic()

    def snapshot(self, topic: str) -> list[Seen]:
        with self.lock:
            return list(self.records[topic])

    def count(self, topic: str) -> int:
        with self.lock:
            return len(self.records[topic])

    def caught_up(self) -> bool:
        """Every partition has reached its end (its last stable offset) since its last record."""
        return all(self._eof.values())

    def settle(self, quiet_s: float = 2.0, timeout: float = 120.0) -> None:
        """Wait until every partition is at its end and nothing new arrived for ``quiet_s``."""
        wait_until(lambda: self.caught_up() and time.monotonic() - self.last_record_at > quiet_s, timeout, 0.2,
                   "the topics to be read to their end")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile (the maximum of fewer than 100 values); nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-99 * len(ordered) // 100) - 1))]
