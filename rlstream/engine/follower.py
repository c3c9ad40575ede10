"""Following the policy: how rollout, the gateway and the teacher take each version the trainer announces.

One ``PolicyFollower`` per engine, and one rule for all three:

- **watch**: a ``PolicyWatcher`` on the run's policy-versions topic;
- **first**: the newest announced version whose weights can be had (older ones that cannot are skipped), within
  ``wait_policy_s``, else a ``UserError`` that says what to start;
- **prefetch**: a version's weights fetched and hash-checked before the engine is taken, so a generation in
  progress never waits on the weights log between its steps;
- **load**: into the engine, by the caller, who holds it;
- **confirm**: the version held is the engine's own word after the load (a fleet moves only once a server
  confirmed it), never the announcement's;
- **retry**: a version that failed to load (unreadable, pruned, refused by its hash or its probe) is tried again
  after ``retry_s``, or as soon as a newer one is announced; meanwhile the engine keeps the version it holds and
  its tokens keep carrying that version, so staleness (η) decides what they are worth.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from rlstream import metrics
from rlstream.errors import UserError
from rlstream.policy.watcher import PolicyWatcher
from rlstream.policy.weights import PolicyWeights
from rlstream.schemas.headers import now_ms
from rlstream.schemas.records import PolicyVersion

log = logging.getLogger(__name__)

#: What a failed load raises: weights not readable (pruned, not in the log) or refused (hash or probe mismatch).
LOAD_ERRORS = (OSError, ValueError)
#: The line a worker logs once its first version serves (role, policy, version, engine): tests and operators wait
#: on it, so it is named here rather than retyped where it is read (``serving_line``).
SERVING = "%s serving %s v%d on %s"


def serving_line(role: str, policy: str, version: int) -> str:
    """The start of ``SERVING`` for a role's first version, as a log reader looks for it."""
    return SERVING.rsplit("%s", 1)[0] % (role, policy, version)


class PolicyFollower:
    """The policy version one engine holds, and the next one it should load (see the module docstring)."""

    def __init__(self, role: str, policy: str, weights: PolicyWeights, retry_s: float = 1.0):
        self.role, self.policy, self.weights, self.retry_s = role, policy, weights, retry_s
        self.watcher: PolicyWatcher | None = None
        self.version = -1  # the version the engine holds, as it confirmed it
        self.failed: tuple[int, float] = (-1, 0.0)  # (version, monotonic time) of the last failed load

    def connect(self, client_config: dict, run: str) -> None:
        """Watch ``run``'s announcements, and read its weights log."""
        self.run = run
        self.weights.bind(client_config, run)
        self.watcher = PolicyWatcher(client_config, run, self.policy)

    def announced(self, wait_s: float) -> PolicyVersion:
        """The newest announced version, once there is one (``UserError`` after ``wait_s`` without)."""
        if not self.watcher.wait_for(0, wait_s):
            raise self._none_in_time(wait_s, "")
        return self.watcher.latest

    def first(self, wait_s: float, base: bool = True) -> tuple[PolicyVersion, Path]:
        """The newest announced version whose weights can be had, and its folder (``base``: the folder an engine is
        built from, a LoRA version's base; else the version's own). ``UserError`` after ``wait_s`` without."""
        deadline = time.monotonic() + wait_s
        version = 0
        while self.watcher.wait_for(version, max(0.0, deadline - time.monotonic())):
            pv = self.watcher.latest
            try:
                return pv, self.weights.engine_folder(pv) if base else self.weights.folder(pv)
            except LOAD_ERRORS as exc:
                log.warning("%s: could not load %s v%d: %s", self.role, pv.policy, pv.version, exc)
                version = pv.version + 1
        raise self._none_in_time(wait_s, "loadable ")

    def _none_in_time(self, wait_s: float, what: str) -> UserError:
        return UserError(f"no {what}{self.policy} policy announced on run {self.run!r} within {wait_s}s; is the "
                         f"trainer running for this run (or give {self.role}'s --wait-policy-s)?")

    def start(self, wait_s: float, build: Callable[[PolicyVersion, Path], object]):
        """The engine ``build(pv, folder)`` makes from the first loadable version, its LoRA adapter applied and its
        load probe passed (``UserError`` if not: it has nothing good to serve); returns it."""
        pv, folder = self.first(wait_s)
        backend = build(pv, folder)
        self.weights.adopt(pv, backend)  # a LoRA version's adapter over the base the engine was built from
        self.weights.verify_first(pv, backend)
        self.held(backend.version)
        log.info(SERVING, self.role, pv.policy, pv.version, backend.name)
        return backend

    def held(self, version: int) -> None:
        """The engine now holds ``version`` (its own word)."""
        self.version = version
        metrics.POLICY_VERSION.labels(self.role).set(version)

    def _waiting_to_retry(self, pv: PolicyVersion) -> bool:
        failed_version, failed_at = self.failed
        return pv.version == failed_version and time.monotonic() - failed_at < self.retry_s

    def due(self) -> PolicyVersion | None:
        """The version to load now: the newest announced, if newer than the one held and not a failed one whose
        retry interval has not passed."""
        latest = self.watcher.latest
        if latest is None or latest.version <= self.version or self._waiting_to_retry(latest):
            return None
        return latest

    def advance(self, load: Callable[[PolicyVersion], int]) -> bool:
        """Load the due version, if any, with ``load(pv)``, which returns the version the engine then holds; True if
        it loaded. A failed load is logged and retried by the rule above; the engine keeps what it holds."""
        pv = self.due()
        if pv is None:
            return False
        try:
            version = load(pv)
        except LOAD_ERRORS as exc:
            self.failed = (pv.version, time.monotonic())
            log.warning("%s: could not load %s v%d (keeps v%d; tried again in %ss or on a newer version): %s",
                        self.role, pv.policy, pv.version, self.version, self.retry_s, exc)
            return False
        self.held(version)
        metrics.PUBLISH_LATENCY.observe(max(0, now_ms() - pv.published_at) / 1000)
        log.info("%s: now serving %s v%d", self.role, pv.policy, version)
        return True

    def swap(self, backend) -> bool:
        """``advance`` into an inference backend (the caller holds it). A pinned endpoint (``follows_policy``
        False) is never swapped: its weights are not ours to change."""
        if not getattr(backend, "follows_policy", True):
            return False

        def load(pv: PolicyVersion) -> int:
            self.weights.load(pv, backend)
            return backend.version
        return self.advance(load)

    def prefetch(self, folder: bool = True) -> None:
        """Fetch and check the due version's weights before the engine is taken (``folder``: as a folder, else only
        rebuilt in memory, for an engine that ``loads_tensors``). A failure is left to the load, which logs it."""
        pv = self.due()
        if pv is not None:
            try:
                self.weights.prefetch(pv, folder=folder)
            except LOAD_ERRORS:
                pass

    def follow(self, engine_lock: threading.Lock, stop: threading.Event, backend) -> None:
        """The swapper thread's body: load each announced version into ``backend`` as soon as the engine is free.

        While a generation holds the engine it swaps between steps itself (``swap``); this covers the idle engine,
        so the first call after an announcement starts on the new weights."""
        while not stop.is_set():
            if not self.watcher.wait_for(self.version + 1, 0.5):
                continue
            self.prefetch(folder=not getattr(backend, "loads_tensors", False))
            if not engine_lock.acquire(timeout=0.05):
                continue  # a generation holds the engine and takes the new weights between its steps
            try:
                loaded = not stop.is_set() and self.swap(backend)
            except Exception:  # an engine error surfaces on the next generation; keep following
                log.exception("%s: loading new weights failed", self.role)
                loaded = False
            finally:
                engine_lock.release()
            if not loaded and self.watcher.version > self.version:
                # Unloadable for now: wait for a newer announcement or the retry interval, not spin.
                self.watcher.wait_for(self.watcher.version + 1, self.retry_s)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
