"""The one rule that judges a benchmark figure's runs against its goal (benchmarks/harness/verdict.py)."""
from __future__ import annotations

import math

import pytest

from benchmarks.harness.verdict import MET, MISSED, NOISE, NOT_MEASURED, ONE_RUN, Goal, verdict

AT_LEAST = Goal("ratio", ">=", 0.9)
AT_MOST = Goal("p99_s", "<=", 1.0)


@pytest.mark.parametrize("values, expected", [
    ([1.0, 1.2, 0.95], MET),
    ([0.9, 0.9], MET),            # on the target counts as meeting it
    ([0.5, 0.7], MISSED),
    ([0.85, 1.1], NOISE),         # the goal inside the runs' spread
    ([1.5], ONE_RUN),             # one run is never met, however far past the goal
    ([0.1], ONE_RUN),
    ([], NOT_MEASURED),
    ([1.2, "none"], NOISE),       # a target not reached is a run short of the goal
    ([None, "none"], MISSED),
    ([math.nan, 1.0], NOISE),
])
def test_at_least(values, expected):
    assert verdict(AT_LEAST, values) == expected


@pytest.mark.parametrize("values, expected", [
    ([0.3, 0.9], MET),
    ([1.1, 3.0], MISSED),
    ([0.9, 1.2], NOISE),
    ([0.2], ONE_RUN),
])
def test_at_most(values, expected):
    assert verdict(AT_MOST, values) == expected


def test_flags_count_as_one_and_zero():
    ok = Goal("ok", ">=", 1)
    assert verdict(ok, [True, True]) == MET
    assert verdict(ok, [True, False]) == NOISE


def test_a_goal_is_checked_when_declared():
    with pytest.raises(ValueError, match="op must be"):
        Goal("x", ">", 1)
    with pytest.raises(ValueError, match="target must be a number"):
        Goal("x", "<=", "fast")
    assert Goal.from_json(AT_MOST.to_json()) == AT_MOST
