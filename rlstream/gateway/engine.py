"""The policy engine behind the gateway: the newest announced policy version, loaded into an inference backend.

The same backends as rollout (``rlstream.engine``): transformers or vLLM in this process, or a fleet of
vLLM / SGLang servers that each version is pushed to. One engine thread runs the calls: those waiting together
with equal sampling parameters go to the backend as one batch (many agents at once keep the engine busy). New
versions go in between batches (a follower thread loads an announced version while the engine is idle, and each
batch checks before it starts), so every token carries the version whose weights sampled it, as the backend
reports it.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

from rlstream import metrics
from rlstream.config import KafkaSettings, LoopSettings
from rlstream.errors import UserError
from rlstream.models.loading import context_limit, load_tokenizer
from rlstream.policy.watcher import PolicyWatcher
from rlstream.policy.weights import PolicyWeights
from rlstream.schemas.records import SamplingParams
from rlstream.engine import FleetOptions, Generation, make_backend, server_urls

log = logging.getLogger(__name__)


class PolicyEngine:
    """``generate`` one continuation of token ids with the newest loadable policy version."""

    name = "gateway"

    def __init__(self, settings, loop: LoopSettings, kafka: KafkaSettings):
        self.s, self.loop, self.kafka = settings, loop, kafka
        self.backend = None
        self.tokenizer = None
        self.version = -1
        self.max_context = settings.max_context
        self.watcher: PolicyWatcher | None = None
        self.weights = PolicyWeights(loop.home_path / "weights-cache")
        self._lock = threading.Lock()
        self._failed = -1  # a version that did not load (tried again on the next announcement only)
        self._stop = threading.Event()
        self._follower = threading.Thread(target=self._follow, name="gateway-swap", daemon=True)
        self._calls: queue.Queue = queue.Queue()
        self._engine = threading.Thread(target=self._batches, name="gateway-engine", daemon=True)

    def start(self) -> None:
        """Wait for the first loadable announced version and load it (UserError when none comes in time)."""
        self.weights.bind(self.kafka.client_config(), self.kafka.run)
        self.watcher = PolicyWatcher(self.kafka.client_config(), self.kafka.run, self.loop.policy)
        deadline = time.monotonic() + self.s.wait_policy_s
        version = 0
        while self.watcher.wait_for(version, max(0.0, deadline - time.monotonic())):
            pv = self.watcher.latest
            try:
                folder = self.weights.engine_folder(pv)  # a LoRA version's base
                break
            except (OSError, ValueError) as exc:
                log.warning("gateway: could not load v%d: %s", pv.version, exc)
                version = pv.version + 1
        else:
            raise UserError(f"no loadable {self.loop.policy} policy announced on run {self.kafka.run!r} within "
                            f"{self.s.wait_policy_s}s; is the trainer running (or give --wait-policy-s)?")
        self.max_context = self.s.max_context or context_limit(folder)
        s = self.s
        remote = s.backend in ("vllm-server", "sglang", "openai")
        self.tokenizer = load_tokenizer(folder, flag="policy folder")
        self.backend = make_backend(s.backend, folder, threads=s.threads,
                                    urls=server_urls(s.engine_url, s.engine_urls_file), model=s.engine_model,
                                    version=pv.version, dtype=s.dtype, max_context=self.max_context,
                                    fleet=FleetOptions(request_timeout_s=s.request_timeout_s),
                                    tokenizer=self.tokenizer if remote else None, device=s.device,
                                    api_key=os.environ.get("RLSTREAM_GATEWAY_API_KEY", ""),
                                    enforce_eager=s.enforce_eager, attn_implementation=s.attn_implementation)
        self.tokenizer = getattr(self.backend, "tokenizer", None) or self.tokenizer
        self.weights.adopt(pv, self.backend)
        self.weights.verify_first(pv, self.backend)
        self.version = self.backend.version
        metrics.POLICY_VERSION.labels(self.name).set(self.version)
        log.info("gateway serving %s v%d on %s", pv.policy, pv.version, self.backend.name)
        self._follower.start()
        self._engine.start()

    def _follow(self) -> None:
        """Load each announced version as soon as the engine is free, so the next call starts on it."""
        while not self._stop.is_set():
            if not self.watcher.wait_for(max(self.version, self._failed) + 1, 0.5):
                continue
            if self._lock.acquire(timeout=0.05):
                try:
                    self._swap_to_latest()
                except Exception:  # the engine's error surfaces on the next call; keep following
                    log.exception("gateway: loading new weights failed")
                finally:
                    self._lock.release()

    def _swap_to_latest(self) -> None:
        """Load the newest announced version if newer (the caller holds the engine); a failed load keeps the old."""
        latest = self.watcher.latest
        if latest is None or latest.version <= self.version or latest.version == self._failed \
                or not getattr(self.backend, "follows_policy", True):
            return
        try:
            self.weights.load(latest, self.backend)
        except (OSError, ValueError) as exc:
            self._failed = latest.version
            log.warning("gateway: could not load v%d: %s", latest.version, exc)
            return
        log.info("gateway: now serving v%d", latest.version)
        self.version = self.backend.version
        metrics.POLICY_VERSION.labels(self.name).set(self.version)

    def generate(self, prompt: list[int], params: SamplingParams, key: str,
                 on_tokens: Callable[[list[int]], None] | None = None) -> tuple[Generation, int]:
        """One continuation of ``prompt`` (``key``: the session, for a fleet's prefix affinity), and the version
        the engine held when it started. Calls that wait together are generated as one batch.

        ``on_tokens`` is called in the engine's thread with the token ids sampled so far, after every engine step
        of a backend that ``streams`` (else not at all: the answer comes whole); it must be quick."""
        done: Future = Future()
        self._calls.put((prompt, params, key, done, on_tokens))
        return done.result()

    def _batches(self) -> None:
        """Engine thread: take the calls waiting now (up to ``max_batch``, after ``batch_wait_s`` for more), and
        generate those with equal sampling parameters together, on the newest loaded version."""
        while not self._stop.is_set():
            try:
                calls = [self._calls.get(timeout=0.5)]
            except queue.Empty:
                continue
            deadline = time.monotonic() + self.s.batch_wait_s
            while len(calls) < self.s.max_batch:
                try:
                    calls.append(self._calls.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            groups: dict[tuple, list] = {}
            for call in calls:
                p = call[1]
                groups.setdefault((p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed, tuple(p.stop)),
                                  []).append(call)
            for group in groups.values():
                try:
                    with self._lock:
                        self._swap_to_latest()
                        version = self.version
                        gens = self.backend.generate([c[0] for c in group], group[0][1], keys=[c[2] for c in group],
                                                     **self._streaming(group))
                except Exception as exc:  # each waiting call answers with the engine's error
                    for c in group:
                        c[3].set_exception(exc)
                    continue
                metrics.GENERATED_TOKENS.labels(self.backend.name).inc(sum(len(g.token_ids) for g in gens))
                for c, gen in zip(group, gens):
                    c[3].set_result((gen, version))

    def _streaming(self, group: list) -> dict:
        """The backend's ``on_step`` for the calls of a batch that stream: each gets its own tokens so far."""
        if not getattr(self.backend, "streams", False) or not any(c[4] for c in group):
            return {}
        counts = [0] * len(group)

        def on_step(gens: list[Generation]) -> None:
            for i, (c, gen) in enumerate(zip(group, gens)):
                if c[4] is not None and len(gen.token_ids) > counts[i]:
                    counts[i] = len(gen.token_ids)
                    try:
                        c[4](list(gen.token_ids))
                    except Exception:  # a listener's fault (a client gone) must not stop the batch
                        log.exception("gateway: streaming tokens failed")
        return {"on_step": on_step}

    def close(self) -> None:
        self._stop.set()
        for thread in (self._follower, self._engine):
            if thread.is_alive():
                thread.join(5)
        if self.watcher is not None:
            self.watcher.close()
        if self.backend is not None:
            self.backend.close()
