"""Per-server rate limits (concurrency, requests/min, tokens/min) on a hand-driven clock."""
from __future__ import annotations

import math

import pytest

from rlstream.engine.limits import RateLimits


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_concurrency_waits_for_a_release_not_for_time():
    limits = RateLimits(concurrency=2, clock=Clock())
    assert limits.try_acquire(10) == 0 and limits.try_acquire(10) == 0
    assert math.isinf(limits.try_acquire(10))
    limits.release(10, 10)
    assert limits.try_acquire(10) == 0 and limits.inflight == 2


def test_requests_per_minute_refill_continuously():
    clock = Clock()
    limits = RateLimits(requests_per_min=60, clock=clock)  # one per second once the first minute's are spent
    for _ in range(60):
        assert limits.try_acquire(1) == 0
        limits.release(1, 1)
    assert limits.try_acquire(1) == pytest.approx(1.0)
    clock.now += 0.5
    assert limits.try_acquire(1) == pytest.approx(0.5)
    clock.now += 0.5
    assert limits.try_acquire(1) == 0


def test_tokens_per_minute_charge_up_front_and_refund_what_was_not_used():
    clock = Clock()
    limits = RateLimits(tokens_per_min=600, clock=clock)
    assert limits.try_acquire(500) == 0  # prompt + max_tokens
    assert limits.try_acquire(200) == pytest.approx(10.0)  # 100 left, 100 more come back in 10 s
    limits.release(500, 120)  # it used 120: 380 come back at once
    assert limits.try_acquire(200) == 0


def test_a_request_larger_than_a_minute_of_tokens_still_runs():
    limits = RateLimits(tokens_per_min=100, clock=Clock())
    assert limits.try_acquire(5000) == 0


def test_negative_limits_are_refused_by_name():
    with pytest.raises(ValueError, match="tokens_per_min"):
        RateLimits(tokens_per_min=-1)


def test_request_seconds_integrate_the_requests_in_flight_over_time():
    clock = Clock()
    limits = RateLimits(clock=clock)
    clock.now = 1.0
    assert limits.try_acquire(1) == 0  # idle before: nothing counted
    clock.now = 2.0
    assert limits.try_acquire(1) == 0  # one in flight for 1 s
    clock.now = 4.0
    limits.release(1, 1)  # two in flight for 2 s
    clock.now = 5.0
    assert limits.mark(clock.now) == pytest.approx(1 + 4 + 1)  # then one for 1 s
    limits.release(1, 1)
    clock.now = 9.0
    assert limits.mark(clock.now) == pytest.approx(6)  # idle again
