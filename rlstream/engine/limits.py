"""Client-side rate limits for one server: concurrent requests, requests per minute and tokens per minute.

Hosted endpoints refuse (HTTP 429) or bill beyond their quotas; keeping under them here costs a wait, not a
retry storm. Per minute limits are token buckets that refill continuously (a full minute's allowance may be
spent at once, then it comes back at limit/60 per second). A request is charged its prompt plus its
``max_tokens`` up front, since its real length is known only at the end; ``release`` refunds what it did
not use. A request costlier than a whole minute's allowance is charged the allowance, so it can still run.

Each server's ``request_seconds`` (requests in flight integrated over time) says how busy the fleet kept it: over
an interval, its change divided by the interval's length is the mean number of requests in flight.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class _Bucket:
    per_minute: float
    level: float = 0.0
    at: float = 0.0

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self.at) * self.per_minute / 60.0)
        self.at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` is available (0: now)."""
        missing = min(amount, self.per_minute) - self.level
        return 0.0 if missing <= 0 else missing * 60.0 / self.per_minute


@dataclass
class RateLimits:
    """Limits of one server (0: unlimited). Not thread-safe: the fleet calls it under its own lock."""

    concurrency: int = 0
    requests_per_min: float = 0.0
    tokens_per_min: float = 0.0
    clock: Callable[[], float] = time.monotonic
    inflight: int = 0
    request_seconds: float = 0.0  # in-flight requests integrated over time, up to ``_marked``
    _marked: float = field(default=0.0, repr=False)
    _requests: _Bucket | None = field(default=None, repr=False)
    _tokens: _Bucket | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("concurrency", "requests_per_min", "tokens_per_min"):
            if getattr(self, name) < 0:
                raise ValueError(f"rate limit {name} must be >= 0 (0: unlimited), got {getattr(self, name)}")
        now = self._marked = self.clock()
        if self.requests_per_min:
            self._requests = _Bucket(self.requests_per_min, self.requests_per_min, now)
        if self.tokens_per_min:
            self._tokens = _Bucket(self.tokens_per_min, self.tokens_per_min, now)

    def try_acquire(self, tokens: int) -> float:
        """Take a slot for a request of up to ``tokens`` tokens: 0.0 if taken, else the seconds to wait before
        trying again (``inf`` while the concurrency limit is reached: a release frees a slot, not time)."""
        if self.concurrency and self.inflight >= self.concurrency:
            return float("inf")
        now = self.clock()
        waits = []
        for bucket, amount in ((self._requests, 1), (self._tokens, tokens)):
            if bucket is not None:
                bucket.refill(now)
                waits.append(bucket.wait_for(amount))
        wait = max(waits, default=0.0)
        if wait > 0:
            return wait
        if self._requests is not None:
            self._requests.level -= 1
        if self._tokens is not None:
            self._tokens.level -= min(tokens, self.tokens_per_min)
        self.mark(now)
        self.inflight += 1
        return 0.0

    def release(self, charged: int, used: int) -> None:
        """End a request that was charged ``charged`` tokens and used ``used``: its slot and unused tokens return."""
        now = self.clock()
        self.mark(now)
        self.inflight = max(0, self.inflight - 1)
        if self._tokens is not None and used < charged:
            self._tokens.refill(now)
            refund = min(charged, self.tokens_per_min) - min(used, self.tokens_per_min)
            self._tokens.level = min(self.tokens_per_min, self._tokens.level + max(0, refund))

    def mark(self, now: float) -> float:
        """Bring ``request_seconds`` up to ``now`` and return it."""
        self.request_seconds += self.inflight * max(0.0, now - self._marked)
        self._marked = max(self._marked, now)
        return self.request_seconds
