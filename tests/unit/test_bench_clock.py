"""The vs-TRL race's clock: evaluation pauses come off it (benchmarks/harness/race.py)."""
from __future__ import annotations

import pytest

from benchmarks.harness.race import clock_seconds


def test_pauses_that_ended_before_a_version_come_off_its_time():
    pauses = [(11_000, 13_000), (20_000, 20_500)]
    assert clock_seconds(10_000, 10_000, pauses) == 0.0
    assert clock_seconds(10_900, 10_000, pauses) == pytest.approx(0.9)  # before any pause
    assert clock_seconds(15_000, 10_000, pauses) == pytest.approx(3.0)  # 5 s since t0, 2 s of it paused
    assert clock_seconds(30_000, 10_000, pauses) == pytest.approx(17.5)  # both pauses off


def test_without_pauses_the_clock_is_wall_time_since_the_start_and_never_negative():
    assert clock_seconds(12_345, 10_000, []) == pytest.approx(2.345)
    assert clock_seconds(9_000, 10_000, []) == 0.0
