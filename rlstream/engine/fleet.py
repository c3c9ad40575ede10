"""Many inference servers behind one backend: weight pushes with confirmation, routing, health and failover.

Versions. The fleet has a *target* version (the newest one rlstream asked for that at least one server loaded:
it moves when the first server confirms). A push tells each server to load a version and waits for its reply; only
a server that confirmed the target takes new work. A server is never pushed to while it has requests in flight, and
gets none while it loads, so every request runs on one set of weights: the version the server had confirmed when
the request was dispatched, which is the version stamped on all its tokens. A server that fails to load keeps its
old version and is quarantined (a log line and ``rlstream_inference_push_failures_total``); one that loaded it but
fails the version's load probe (``rlstream.policy.probe``: its log-probs are not the trainer's) holds weights of no
version, and takes no work until a push confirms. The health thread pushes the target to such servers again every
``retry_push_s`` until they confirm, but not while a fleet-wide push is under way (it covers every server). Where
the server names the version of each reply (SGLang), that is checked against the recorded one, and a mismatch is
never stamped. A LoRA version (``load_adapter``) moves the same way, pushed to each server as an adapter over the
base it was started on (``ServerAPI.push_adapter``), and confirmed by the same load probe.

Routing. Each request goes to an eligible server (healthy, on the target, within its rate limits): the server its
key (the episode) went to before if that one is eligible, since it holds the episode's prefix in cache, else the
least loaded (fewest requests in flight). Failover: a request that fails on a server for a server-side reason
(no connection, 5xx, 429) marks that server down until a health check passes and is sent to another one; the
stage's transaction holds the batch until every request has finished once, so nothing is lost or duplicated
downstream.

Hedging (``hedge``). Where the stage's transaction holds a batch (``--no-pipeline``; pipelined, the default on a
fleet, has no batch barrier), a batch lasts as long as its slowest server: a server that is done while another
still works on the batch would idle until the next one. Instead, once a server has
nothing in flight, each unfinished request of the batch running on another server is sent to it too; the first
reply is kept and the other attempt cancelled (its connection shut: vLLM aborts the request). Both attempts carry
one sampling seed (the task's, else one drawn per request), so they sample the same tokens and keeping the first
does not favour short replies. Each reply is stamped with the version its own server confirmed. Servers rlstream
pushes weights to only: a hosted ``openai`` endpoint bills the duplicate.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_any
from dataclasses import dataclass, field
from pathlib import Path

from rlstream import metrics
from rlstream.schemas.records import SamplingParams
from rlstream.policy import probe
from rlstream.engine.base import BetweenSteps, Generation, InferenceBackend
from rlstream.engine.limits import RateLimits
from rlstream.engine.servers import Call, PushRejected, ServerAPI, ServerError

log = logging.getLogger(__name__)

#: Most episode -> server entries kept for prefix affinity; the oldest are forgotten first.
AFFINITY_ENTRIES = 100_000
#: How often a generate call looks for an idle server to hedge its unfinished requests on (seconds).
HEDGE_POLL_S = 0.02


class NoServerAvailable(RuntimeError):
    """No server could take a request before its deadline."""


@dataclass
class Server:
    """One server's state, guarded by the fleet's lock."""

    api: ServerAPI
    limits: RateLimits
    version: int = -1  # the version it confirmed it holds (-1: unknown, takes no work)
    up: bool = True
    loading: bool = False
    failed_push: tuple[int, float] = (-1, 0.0)  # (version, monotonic time) of its last failed push
    why: str = ""  # why it takes no work, for the operator

    @property
    def url(self) -> str:
        return self.api.url

    @property
    def inflight(self) -> int:
        return self.limits.inflight


@dataclass
class FleetOptions:
    """How a fleet behaves; the rollout stage fills it from its knobs."""

    request_timeout_s: float = 300.0
    retries: int = 3
    health_interval_s: float = 2.0
    retry_push_s: float = 10.0
    concurrency: int = 0
    requests_per_min: float = 0.0
    tokens_per_min: float = 0.0
    workers: int = 256
    hedge: bool = False
    clock: object = field(default=time.monotonic)


@dataclass
class _Job:
    """One prompt of a generate call, guarded by the fleet's lock: its attempts, and the first reply."""

    prompt: list[int]
    params: SamplingParams
    key: str | None
    server: str = ""  # where its first attempt runs
    calls: list[Call] = field(default_factory=list)
    running: int = 0  # attempts submitted and not finished
    hedged: bool = False
    result: Generation | None = None
    error: BaseException | None = None  # the first attempt's failure


class ServerFleet(InferenceBackend):
    """Inference on one or more servers of one kind (see the module docstring)."""

    def __init__(self, apis: list[ServerAPI], options: FleetOptions = FleetOptions(), pinned_version: int = -1):
        if not apis:
            raise ValueError("an inference fleet needs at least one server URL (--engine-url or --engine-urls-file)")
        self.options = options
        self.name = apis[0].kind
        self.follows_policy = apis[0].pushes
        self.serves_adapters = apis[0].serves_adapters  # LoRA versions as adapters (``load_adapter``)
        self.servers = [Server(api, RateLimits(options.concurrency, options.requests_per_min,
                                               options.tokens_per_min, options.clock)) for api in apis]
        self.version = pinned_version
        self.folder: Path | None = None
        self.adapter = False  # whether the fleet's version is a LoRA adapter over the servers' base
        if not self.follows_policy:  # the operator's pinned version is all the fleet can say about its weights
            for s in self.servers:
                s.version = pinned_version
        self._cond = threading.Condition()
        self._pushing = -1  # the version a fleet-wide push (load_weights) is under way for, else -1
        self._affinity: dict[str, Server] = {}
        self._probes: dict[int, tuple[list[int], list[float]]] = {}  # version -> its load probe (expect_probe)
        self._pool = ThreadPoolExecutor(max_workers=options.workers, thread_name_prefix="fleet")
        self._stop = threading.Event()
        self._health: threading.Thread | None = None
        self._publish()

    def start_health_checks(self) -> None:
        self._health = threading.Thread(target=self._check_health, name="fleet-health", daemon=True)
        self._health.start()

    # -- weights --------------------------------------------------------------------------------

    def expect_probe(self, version: int, token_ids: list[int], logprobs: list[float]) -> None:
        """The load probe every server must pass after loading ``version`` (nothing to check when empty)."""
        with self._cond:
            if token_ids and logprobs:
                self._probes[version] = (list(token_ids), list(logprobs))
            for old in sorted(self._probes)[:-4]:  # the fleet's version, and a few a catch-up may still push
                del self._probes[old]

    def load_weights(self, folder: Path, version: int, adapter: bool = False) -> None:
        """Push ``version`` to every server and wait for each to confirm or refuse. The fleet moves to it as soon as
        one server confirmed (that one takes work again at once, while others still wait for their requests in
        flight to end); the others are quarantined until they catch up. OSError if none did (the fleet, and every
        server, keep the old version). ``adapter``: ``folder`` is a LoRA adapter over the servers' base."""
        if not self.follows_policy:
            return  # serving only: the pinned version stays
        with self._cond:
            self._pushing = version
        try:
            results = list(self._pool.map(lambda s: self._push(s, folder, version, adapter), self.servers))
        finally:
            with self._cond:
                self._pushing = -1
        confirmed = [s for s, ok in zip(self.servers, results) if ok]
        if not confirmed:
            raise OSError(f"no server confirmed v{version}: " + "; ".join(s.why for s in self.servers))
        with self._cond:
            self.version, self.folder, self.adapter = version, Path(folder), adapter
            self._cond.notify_all()
        self._publish()

    def load_adapter(self, folder: Path, version: int) -> None:
        """A LoRA version: its adapter pushed to every server as ``load_weights`` pushes weights."""
        self.load_weights(folder, version, adapter=True)

    def _push(self, server: Server, folder: Path, version: int, adapter: bool = False) -> bool:
        """One server loads ``version``: after its in-flight requests finish, with no new ones meanwhile."""
        with self._cond:
            if not server.up:
                server.why = f"{server.url} is down"
                return False
            # One push at a time per server (the health thread may be catching it up), and none under a request.
            self._cond.wait_for(lambda: not server.loading)
            server.loading = True
            self._cond.wait_for(lambda: server.inflight == 0)
        loaded = False
        try:
            (server.api.push_adapter if adapter else server.api.push)(folder, version)
            loaded = True
            self._probe(server, version)
            ok, why = True, ""
        except (PushRejected, ServerError, OSError, ValueError) as exc:
            ok, why = False, str(exc)
        with self._cond:
            server.loading = False
            if loaded and not ok:
                server.version = -1  # it holds the refused weights, which are no version's: no work until a push
            if ok:
                server.version, server.why = version, ""
                if version == self._pushing and version != self.version:
                    # the first to confirm moves the fleet
                    self.version, self.folder, self.adapter = version, Path(folder), adapter
            else:
                server.failed_push, server.why = (version, self.options.clock()), why
                if adapter and server.version == version:
                    server.version = -1  # it holds the base, pushed under this number before its adapter: no work
            self._cond.notify_all()
        if ok:
            log.info("%s confirmed v%d", server.url, version)
        elif loaded:
            metrics.PUSH_FAILURES.labels(server.url).inc()
            log.error("%s loaded v%d but its log-probs are not the trainer's; it takes no work until a push "
                      "confirms: %s", server.url, version, why)
        else:
            metrics.PUSH_FAILURES.labels(server.url).inc()
            log.warning("%s did not load v%d and stays on v%d, taking no new work until it does: %s",
                        server.url, version, server.version, why)
        self._publish()
        return ok

    def verify(self, version: int) -> None:
        """The load probe on every server that holds ``version`` now (the first version, pushed before its probe was
        known): one that fails takes no work until a push confirms. ProbeMismatch if none passes."""
        passed, failure = 0, None
        for server in list(self.servers):
            if server.version != version or version not in self._probes:
                continue
            try:
                self._probe(server, version)
                passed += 1
            except (ServerError, OSError, ValueError) as exc:
                failure = exc
                metrics.PUSH_FAILURES.labels(server.url).inc()
                with self._cond:
                    server.version, server.why = -1, str(exc)
                    server.failed_push = (version, self.options.clock())
                log.error("%s holds v%d but its log-probs are not the trainer's; it takes no work until a push "
                          "confirms: %s", server.url, version, exc)
        self._publish()
        if not passed and failure is not None:
            raise failure

    def _probe(self, server: Server, version: int) -> None:
        """ProbeMismatch (a ValueError) when ``server``'s log-probs after loading ``version`` are not the trainer's."""
        with self._cond:
            expected = self._probes.get(version)
        if expected is None:
            return
        got = server.api.probe_logprobs(expected[0])
        if got is not None:
            probe.check(version, server.url, expected[1], got)

    # -- health ---------------------------------------------------------------------------------

    def _check_health(self) -> None:
        while not self._stop.wait(self.options.health_interval_s):
            for server in self.servers:
                self.check(server)

    def check(self, server: Server) -> None:
        """One health check, then a catch-up push if the server is behind the fleet."""
        healthy = server.api.healthy()
        with self._cond:
            if healthy and not server.up:
                server.up, server.why = True, ""
                if self.follows_policy:
                    server.version = -1  # it may have restarted on other weights: it must confirm again
                log.info("%s is back", server.url)
            elif not healthy and server.up:
                server.up, server.why = False, f"{server.url} failed its health check"
                log.warning("%s failed its health check; no new work for it", server.url)
            self._cond.notify_all()
            # Not during a fleet-wide push: it covers every server, and a server that confirmed the new version
            # before the fleet moved would be pushed the old one back.
            behind = (self.follows_policy and server.up and self.folder is not None and server.version != self.version
                      and not server.loading and self._pushing < 0)
            failed_version, failed_at = server.failed_push
            if behind and failed_version == self.version and \
                    self.options.clock() - failed_at < self.options.retry_push_s:
                behind = False
            target, folder, adapter = self.version, self.folder, self.adapter
        if behind:
            self._push(server, folder, target, adapter)
        self._publish()

    def _publish(self) -> None:
        for s in self.servers:
            metrics.SERVER_UP.labels(s.url).set(1 if self._eligible(s) else 0)
            metrics.SERVER_VERSION.labels(s.url).set(s.version)

    # -- generation -----------------------------------------------------------------------------

    def _eligible(self, s: Server) -> bool:
        return s.up and not s.loading and s.version == self.version and s.version >= 0 or (
            not self.follows_policy and s.up)

    def _acquire(self, key: str | None, cost: int, avoid: set[str],
                 deadline: float | None) -> tuple[Server, int] | None:
        """A server for one request and the version it holds now; waits for one until ``deadline``. With no deadline
        (a hedge): a server not in ``avoid`` that is free now, or None."""
        with self._cond:
            while True:
                candidates = [s for s in self.servers if self._eligible(s) and s.url not in avoid]
                if not candidates and avoid and deadline is not None:
                    # every other one failed: the one that failed may have recovered
                    candidates = [s for s in self.servers if self._eligible(s)]
                preferred = self._affinity.get(key) if key is not None else None
                order = sorted(candidates, key=lambda s: (s is not preferred, s.inflight))
                wait = float("inf")
                for server in order:
                    wait_s = server.limits.try_acquire(cost)
                    if wait_s == 0:
                        if key is not None:
                            self._affinity.pop(key, None)
                            self._affinity[key] = server
                            if len(self._affinity) > AFFINITY_ENTRIES:
                                self._affinity.pop(next(iter(self._affinity)))
                        return server, server.version
                    wait = min(wait, wait_s)
                if deadline is None:
                    return None
                left = deadline - self.options.clock()
                if left <= 0:
                    raise NoServerAvailable(f"no inference server could take a request for v{self.version} within "
                                            f"{self.options.request_timeout_s}s: " + "; ".join(
                                                f"{s.url}: {self._state(s)}" for s in self.servers))
                self._cond.wait(min(left, wait, 1.0))

    def request_seconds(self) -> float:
        """Requests in flight integrated over time, summed over the servers (``limits.RateLimits.mark``)."""
        with self._cond:
            now = self.options.clock()
            return sum(s.limits.mark(now) for s in self.servers)

    def _state(self, s: Server) -> str:
        if self._eligible(s):
            return f"v{s.version}, {s.inflight} in flight"
        return s.why or ("loading" if s.loading else f"on v{s.version}, not v{self.version}")

    def _release(self, server: Server, cost: int, used: int) -> None:
        with self._cond:
            server.limits.release(cost, used)
            self._cond.notify_all()

    def _down(self, server: Server, why: str) -> None:
        with self._cond:
            if server.up:
                server.up, server.why = False, why
                log.warning("%s is down (%s); its requests go to the other servers", server.url, why)
            self._cond.notify_all()
        self._publish()

    def _one(self, job: _Job, hedge: bool = False) -> Generation | None:
        """One request, sent again to another server after a server-side failure (up to ``retries`` times). A hedge
        is one try on another server that is free now, or none. None when another attempt answered first."""
        prompt, params = job.prompt, job.params
        cost = len(prompt) + params.max_tokens
        deadline = self.options.clock() + self.options.request_timeout_s
        avoid: set[str] = {job.server} if hedge else set()
        for attempt in range(1 if hedge else self.options.retries + 1):
            taken = self._acquire(None if hedge else job.key, cost, avoid, None if hedge else deadline)
            if taken is None:
                return None
            server, version = taken
            call = Call()
            with self._cond:
                if job.result is not None:
                    server.limits.release(cost, 0)
                    self._cond.notify_all()
                    return None
                job.calls.append(call)
                job.server = job.server if hedge else server.url
            used = cost
            try:
                gen, named = server.api.generate(prompt, params, call=call)
                used = len(prompt) + len(gen.token_ids)
            except ServerError as exc:
                if call.cancelled:
                    return None  # the other attempt answered
                if not exc.retryable or attempt == self.options.retries or hedge:
                    if exc.retryable:
                        self._down(server, str(exc))
                    raise
                self._down(server, str(exc))
                metrics.REQUEST_RETRIES.labels(server.url).inc()
                avoid.add(server.url)
                continue
            finally:
                self._release(server, cost, used)
            if named is not None and self.follows_policy and named != str(version):
                # The server says other weights made this reply than the ones it confirmed: never stamp it.
                with self._cond:
                    server.version, server.why = -1, f"{server.url} answered with weights {named!r}, not v{version}"
                log.warning("%s: reply made by weight version %r, expected v%d; re-pushing", server.url, named,
                            version)
                avoid.add(server.url)
                continue
            gen.versions = [version] * len(gen.token_ids)
            return gen
        if hedge:
            return None
        raise NoServerAvailable(f"request failed on {self.options.retries + 1} servers")

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 between_steps: BetweenSteps | None = None, keys: list[str] | None = None) -> list[Generation]:
        keys = keys or [None] * len(prompts)
        # Not on hosted endpoints (``openai``, serving only): a duplicate there is billed and spends the quota.
        hedging = self.options.hedge and len(self.servers) > 1 and self.follows_policy
        jobs = [_Job(p, _seeded(params) if hedging else params, k) for p, k in zip(prompts, keys)]
        running: dict[Future, _Job] = {}

        def submit(job: _Job, hedge: bool = False) -> None:
            with self._cond:
                job.running += 1
            running[self._pool.submit(self._one, job, hedge)] = job

        for job in jobs:
            submit(job)
        try:
            while running:
                done, _ = wait_any(running, timeout=HEDGE_POLL_S if hedging else None, return_when=FIRST_COMPLETED)
                for future in done:
                    self._settle(running.pop(future), future)
                if hedging:
                    for job in self._to_hedge(jobs):
                        submit(job, hedge=True)
        except BaseException:
            for job in jobs:  # the batch failed: the stage retries it whole, so what still runs is waste
                self._cancel(job)
            raise
        return [job.result for job in jobs]

    def _settle(self, job: _Job, future: Future) -> None:
        """One attempt of ``job`` ended. The first reply is the job's (the other attempt is cancelled); once every
        attempt of it ended with none, its failure fails the batch."""
        exc = future.exception()
        with self._cond:
            job.running -= 1
            reply = None if exc is not None else future.result()
            job.error = job.error or exc
            won = reply is not None and job.result is None
            if won:
                job.result = reply
            failed = job.result is None and job.running == 0
        if won:
            self._cancel(job)
        if failed:
            raise job.error or NoServerAvailable("every attempt of a request gave way, none answered")

    def _cancel(self, job: _Job) -> None:
        with self._cond:
            calls = list(job.calls)
        for call in calls:
            call.cancel()  # the winner's own call has finished: cancelling it does nothing

    def _to_hedge(self, jobs: list[_Job]) -> list[_Job]:
        """The unfinished, not yet hedged requests of a call that run on a server while another server is idle."""
        with self._cond:
            idle = {s.url for s in self.servers if self._eligible(s) and s.inflight == 0}
            if not idle:
                return []
            late = [j for j in jobs if j.result is None and not j.hedged and j.server and j.server not in idle]
            for job in late:
                job.hedged = True
        return late

    def close(self) -> None:
        self._stop.set()
        if self._health is not None:
            self._health.join(10)
        self._pool.shutdown(wait=False, cancel_futures=True)


def _seeded(params: SamplingParams) -> SamplingParams:
    """``params`` with a seed: its own, else one drawn for this request (a hedge then samples the same tokens)."""
    return params if params.seed is not None else dataclasses.replace(params, seed=random.getrandbits(31))
