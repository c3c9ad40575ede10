"""benchmarks/recipe_vs_trl.py's reading of a held-out curve: seconds to each gain over the side's own start."""
from __future__ import annotations

import pytest

from benchmarks.recipe_vs_trl import to_gains


def test_gains_count_from_the_sides_own_start_and_only_after_an_update():
    # [seconds, update, held-out]: the untrained reading (update 0) never counts as reaching a gain.
    curve = [[10.0, 0, 0.375], [50.0, 4, 0.47], [90.0, 8, 0.475], [130.0, 12, 0.525]]
    got = to_gains(curve, 0.375)
    assert got == {"start": 0.375, "best": 0.525, "to_plus_0_10_s": 90.0, "to_plus_0_15_s": 130.0}


def test_a_gain_never_reached_has_no_time_and_an_untrained_high_reading_is_not_one():
    got = to_gains([[5.0, 0, 0.9], [60.0, 4, 0.45]], 0.4)
    assert got["to_plus_0_10_s"] is None and got["to_plus_0_15_s"] is None
    assert got["best"] == pytest.approx(0.45)
