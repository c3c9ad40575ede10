"""The policy engine behind the gateway: the newest announced policy version, loaded into an inference backend.

The same backends as rollout (``rlstream.engine``): transformers or vLLM in this process, or a fleet of
vLLM / SGLang servers that each version is pushed to. One engine thread runs the calls: those waiting together
with equal sampling parameters go to the backend as one batch (many agents at once keep the engine busy). New
versions go in between batches (``rlstream.engine.follower``: its thread loads an announced version while the
engine is idle, and each batch checks before it starts), so every token carries the version whose weights sampled
it, as the backend reports it.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

from rlstream import metrics
from rlstream.config import KafkaSettings, LoopSettings
from rlstream.engine.base import Generation
from rlstream.engine.follower import PolicyFollower
from rlstream.engine.settings import build_backend
from rlstream.models.loading import context_limit, load_tokenizer
from rlstream.policy.weights import PolicyWeights
from rlstream.schemas.records import SamplingParams

log = logging.getLogger(__name__)


class PolicyEngine:
    """``generate`` one continuation of token ids with the newest loadable policy version."""

    name = "gateway"

    def __init__(self, settings, loop: LoopSettings, kafka: KafkaSettings):
        self.s, self.loop, self.kafka = settings, loop, kafka
        self.backend = None
        self.tokenizer = None
        self.max_context = settings.max_context
        self.follower = PolicyFollower(self.name, loop.policy, PolicyWeights(loop.home_path / "weights-cache"),
                                       settings.retry_load_s)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._swapper = threading.Thread(target=self._follow, name="gateway-swap", daemon=True)
        self._calls: queue.Queue = queue.Queue()
        self._engine = threading.Thread(target=self._batches, name="gateway-engine", daemon=True)

    @property
    def version(self) -> int:
        """The policy version the engine holds, as it confirmed it."""
        return self.follower.version

    def start(self) -> None:
        """Wait for the first loadable announced version and load it (UserError when none comes in time)."""
        self.follower.connect(self.kafka.client_config(), self.kafka.run)
        self.backend = self.follower.start(self.s.wait_policy_s, self._make_backend)
        self.tokenizer = getattr(self.backend, "tokenizer", None) or self.tokenizer
        self._swapper.start()
        self._engine.start()

    def _make_backend(self, pv, folder):
        self.max_context = self.s.max_context or context_limit(folder)
        self.tokenizer = load_tokenizer(folder, flag="policy folder")
        return build_backend(self.s, folder, pv.version, self.max_context, self.tokenizer if self.s.remote else None,
                             api_key_env="RLSTREAM_GATEWAY_API_KEY")

    def _follow(self) -> None:
        self.follower.follow(self._lock, self._stop, self.backend)

    def _swap_to_latest(self) -> None:
        """Load the newest announced version if newer (the caller holds the engine); a failed load keeps the old."""
        self.follower.swap(self.backend)

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
        for thread in (self._swapper, self._engine):
            if thread.is_alive():
                thread.join(5)
        self.follower.close()
        if self.backend is not None:
            self.backend.close()
