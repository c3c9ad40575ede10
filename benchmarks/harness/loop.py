"""The whole loop for benchmarks: stage processes (rlstream.infra.supervisor), a paced prompt source, and the
published versions (rlstream.kafka.tail).

The prompt source runs in the benchmark's own process so that it can pace itself two ways: AReaL's
``(version + eta + 1)`` steps ahead (async), or one batch at a time behind a barrier (sync).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

from benchmarks.harness.scratch import discard_at_exit, run_name
from rlstream.config import KafkaSettings
from rlstream.infra import broker
from rlstream.infra.supervisor import ONE_THREAD, StageProc, Supervisor, stage_env
from rlstream.kafka.tail import TopicTail
from rlstream.kafka.topics import create_topics
from rlstream.policy.weights import local_path
from rlstream.schemas.records import PolicyVersion, SamplingParams
from rlstream.sources.prompts import PromptProducer, make_task, task_items

#: The repository root: stage processes start there, so ``benchmarks.harness.workloads:...`` loads in them.
ROOT = Path(__file__).resolve().parents[2]
#: Stop order: the source is already stopped; upstream first so each stage finishes what it holds.
STOP_ORDER = ["rollout", "rollout1", "env", "env+reward", "reward", "teacher", "trainer"]


def log(tag: str, msg: str) -> None:
    """A progress line on stderr (stdout carries the results)."""
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.5, what: str = "") -> object:
    """Poll until ``predicate()`` is truthy (returned); TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class Loop:
    """A fresh run on a broker and its stage processes (one ``rlstream run`` each). The broker is
    $RLSTREAM_BOOTSTRAP when set, as in the other benchmarks (one someone else runs: never started or stopped
    here), else the project's local broker, started if needed."""

    def __init__(self, prefix: str, partitions: int = 8, **extra_env: str):
        self.bootstrap = os.environ.get("RLSTREAM_BOOTSTRAP") or broker.up()
        self.run = run_name(prefix)
        self.workdir = ROOT / ".rlstream" / "runs" / self.run
        self.workdir.mkdir(parents=True, exist_ok=True)
        create_topics({"bootstrap.servers": self.bootstrap}, self.run, partitions=partitions)
        discard_at_exit(self.bootstrap, self.run, self.workdir)
        self.kafka = KafkaSettings(bootstrap=self.bootstrap, run=self.run)
        self.env = stage_env(self.bootstrap, self.run, **ONE_THREAD, PYTHONWARNINGS="ignore", **extra_env)
        self.sup = Supervisor()
        self.metrics_ports: dict[str, int] = {}

    def add(self, name: str, argv: list[str]) -> StageProc:
        """A stage process (started by ``start``) with its own /metrics port."""
        port = free_port()
        self.metrics_ports[name] = port
        proc = StageProc(name, [*argv, "--metrics-port", str(port)], self.env, self.workdir / "logs" / f"{name}.log",
                         group=f"{self.run}.{argv[1].split('+')[0]}", cwd=ROOT)  # a chain: its first stage's
        return self.sup.add(proc)

    def trainer(self, *, eta: int, groups_per_step: int = 16, lr: float = 1e-4, warmup_steps: int = 300,
                window_groups: int = 32, extra: tuple = ()) -> StageProc:
        """The trainer stage."""
        return self.add("trainer", ["run", "trainer", "--weights", str(self.workdir / "weights"), "--eta", str(eta),
                                    "--groups-per-step", str(groups_per_step), "--window-groups", str(window_groups),
                                    "--lr", str(lr), "--warmup-steps", str(warmup_steps), "--threads", "1",
                                    "--instance", "0", *extra])

    def rollout(self, *, eta: int, instance: int = 0, backend: str = "auto", batch_size: int = 64) -> StageProc:
        """A rollout worker (``rollout``, ``rollout1``, ... by instance)."""
        return self.add("rollout" if instance == 0 else f"rollout{instance}",
                        ["run", "rollout", "--backend", backend, "--eta", str(eta), "--threads", "1",
                         "--instance", str(instance), "--batch-size", str(batch_size)])

    def env_stage(self, extra: tuple = ()) -> StageProc:
        """The env stage, tools in subprocess sandboxes."""
        return self.add("env", ["run", "env", "--instance", "0", "--sandbox", "subprocess", *extra])

    def env_reward(self, fn: str, *, concurrency: int = 256, batch_size: int = 256, extra: tuple = ()) -> StageProc:
        """env and reward chained in one process and one transaction (``rlstream run env+reward``)."""
        return self.add("env+reward", ["run", "env+reward", "--instance", "0", "--sandbox", "subprocess", "--reward",
                                       fn, "--concurrency", str(concurrency), "--batch-size", str(batch_size),
                                       *extra])

    def reward(self, fn: str, *, instance: int = 0, concurrency: int = 256, batch_size: int = 256,
               extra: tuple = ()) -> StageProc:
        """A reward worker with reward function ``fn`` (a dotted path)."""
        return self.add("reward" if instance == 0 else f"reward{instance}",
                        ["run", "reward", "--reward", fn, "--instance", str(instance),
                         "--concurrency", str(concurrency), "--batch-size", str(batch_size), *extra])

    def start(self) -> None:
        """Start every stage."""
        self.sup.start_all()

    def stop(self) -> None:
        """Stop every stage, upstream first."""
        self.resume()  # a stage stopped by pause() would not act on SIGTERM until continued
        self.sup.stop_all(STOP_ORDER, timeout=30)

    def pause(self) -> None:
        """Stop every stage process and its children (SIGSTOP), so that nothing of the loop runs: the benchmark's
        own evaluation then has the cores to itself, as TRL's has while its synchronous loop waits on it."""
        self._signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        """Continue every stage process paused by ``pause``."""
        self._signal_all(signal.SIGCONT)

    def _signal_all(self, sig: int) -> None:
        import psutil
        for proc in self.sup.procs.values():
            try:
                root = psutil.Process(proc.pid)
                # The whole tree: vLLM's engine core and the env's sandboxes are children of their stage.
                for p in [root, *root.children(recursive=True)]:
                    p.send_signal(sig)
            except (psutil.Error, TypeError, ValueError):
                continue  # a stage that exited is reported by dead()

    def dead(self) -> list[str]:
        """Stages that exited on their own (a benchmark reports them rather than hiding them with restarts)."""
        return self.sup.dead()

    def scrape(self, name: str, metric: str) -> float | None:
        """One sample of a stage's Prometheus metric (first series), or None when unreachable."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_ports[name]}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return None
        m = re.search(rf"^{re.escape(metric)}(?:{{[^}}]*}})? ([-0-9.e+naif]+)$", text, re.M)
        return float(m.group(1)) if m else None

    def mean(self, name: str, histogram: str) -> tuple[float, float]:
        """(mean, count) of a stage's Prometheus histogram; (nan, 0) when it has no samples."""
        total, count = self.scrape(name, histogram + "_sum"), self.scrape(name, histogram + "_count")
        return (total / count, count) if total is not None and count else (float("nan"), 0.0)

    def stage_profile(self, name: str) -> dict:
        """Where a stream stage's time went: transactions, records per transaction, handler and batch time."""
        batch_s, batches = self.mean(name, "rlstream_batch_seconds")
        handler_s, _ = self.mean(name, "rlstream_handler_seconds")
        records = self.scrape(name, "rlstream_records_in_total") or 0.0
        return {"batches": batches, "batch_s": batch_s, "handler_s": handler_s,
                "records_per_batch": records / batches if batches else float("nan")}

    def rollout_version(self, name: str = "rollout") -> float:
        """The policy version a rollout worker generates with (-1 before its engine is up)."""
        v = self.scrape(name, "rlstream_policy_version")
        return -1 if v is None else v


class Versions:
    """The run's PolicyVersion records as they are committed."""

    def __init__(self, loop: Loop):
        self._changed = threading.Condition()
        self._newest = -1
        self.tail = TopicTail(loop.kafka.client_config(), loop.run, ["policy-versions"], name="bench-versions",
                              on_record=self._seen)

    def _seen(self, s) -> None:
        """Wakes ``wait_for`` as soon as a version is read: a paced source issues the next step's prompts at once,
        not up to a polling interval later (that interval was part of every step's chain)."""
        if s.record is not None:
            with self._changed:
                self._newest = max(self._newest, s.record.version)
                self._changed.notify_all()

    def all(self) -> list[tuple[PolicyVersion, float]]:
        """(record, monotonic time this process saw it), in version order."""
        seen = [(s.record, s.seen_at) for s in self.tail.snapshot("policy-versions") if s.record is not None]
        return sorted(seen, key=lambda x: x[0].version)

    def latest(self) -> int:
        """The newest version seen (-1 before the first)."""
        versions = self.all()
        return versions[-1][0].version if versions else -1

    def wait_for(self, version: int, timeout: float, alive: Callable[[], bool] = lambda: True) -> bool:
        """Wait until ``version`` is announced, while ``alive()``; whether it was."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and alive():
            with self._changed:
                # Woken by each version read; alive() is looked at again every half second.
                if self._changed.wait_for(lambda: self._newest >= version,
                                          min(0.5, max(0.0, deadline - time.monotonic()))):
                    return True
        return False

    def close(self) -> None:
        """Stop following the topic."""
        self.tail.close()


class PacedSource(threading.Thread):
    """Produces training tasks paced by the trainer: ``async`` (eta steps ahead) or ``sync`` (a barrier).

    sync: batch k+1 is issued only once version k+1 is announced and every rollout worker reports generating
    with it (its ``rlstream_policy_version`` gauge), so no sample of the next batch can come from an old policy.
    """

    def __init__(self, loop: Loop, versions: Versions, *, mode: str, eta: int, groups_per_step: int = 16,
                 group_size: int = 8, seed: int = 0, task: str = "reverse",
                 max_tokens: Callable[[str], int] | None = None, rollouts: tuple[str, ...] = ("rollout",),
                 ahead: int | None = None):
        super().__init__(name="prompts", daemon=True)
        if mode not in ("async", "sync"):
            raise ValueError(mode)
        self.loop, self.versions, self.mode, self.eta = loop, versions, mode, eta
        self.gps, self.group_size, self.seed, self.task = groups_per_step, group_size, seed, task
        self.max_tokens, self.rollouts = max_tokens, rollouts
        self.ahead = ahead if ahead is not None else (eta if mode == "async" else 0)  # steps beyond the version
        self.sent = 0
        self.barrier_wait_s = 0.0  # sync: time spent waiting for rollout workers to load the new version
        self._stop = threading.Event()
        self.error: BaseException | None = None

    def stop(self) -> None:
        """Stop producing (the thread ends within a step)."""
        self._stop.set()

    def _rollouts_at(self, version: int) -> bool:
        """Every rollout worker reports generating with ``version`` or newer."""
        return all(self.loop.rollout_version(r) >= version for r in self.rollouts)

    def run(self) -> None:
        """Produce tasks as the pacing allows, until stopped; an error is kept in ``error``."""
        try:
            items, max_new = task_items(self.task, "train", self.seed)
            out = PromptProducer(self.loop.kafka)
            while not self._stop.is_set():
                version = max(self.versions.latest(), 0)
                allowed = (version + self.ahead + 1) * self.gps
                if self.sent < allowed and self.mode == "sync":
                    started = time.monotonic()
                    while not self._stop.is_set() and not self._rollouts_at(version):
                        time.sleep(0.02)
                    self.barrier_wait_s += time.monotonic() - started
                while self.sent < allowed and not self._stop.is_set():
                    item = next(items)
                    n = self.max_tokens(item[0]) if self.max_tokens else max_new
                    out.send(make_task(self.task, item, self.group_size, SamplingParams(temperature=1.0, max_tokens=n)))
                    self.sent += 1
                out.flush(10)
                if self.sent >= allowed:
                    self.versions.wait_for(version + 1, 0.5, lambda: not self._stop.is_set())
        except BaseException as exc:  # reported by the benchmark, never swallowed
            self.error = exc


def snapshot(weights_uri: str, dest: Path) -> bool:
    """Copy a published version's model (not its optimizer state) before the weight store prunes it."""
    src = local_path(weights_uri)
    try:
        shutil.copytree(src, dest, ignore=shutil.ignore_patterns("optimizer.pt"), dirs_exist_ok=True)
        return True
    except OSError:
        return False


def cpu_seconds(loop: Loop) -> dict[str, float]:
    """CPU seconds (user + system) each stage process of ``loop`` and its children have used so far."""
    import psutil
    out = {}
    for name, proc in loop.sup.procs.items():
        try:
            p = psutil.Process(proc.pid)
            out[name] = sum(sum(q.cpu_times()[:2]) for q in [p, *p.children(recursive=True)])
        except (psutil.Error, TypeError):
            out[name] = float("nan")
    return out
