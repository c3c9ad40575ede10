"""benchmarks/three_hosts.py's measure of how long the loop stood still after its broker was killed."""
from __future__ import annotations

from benchmarks.three_hosts import Pause


def test_the_longest_gap_between_new_versions_counts_from_the_kill_and_ignores_repeats():
    pause = Pause()
    pause.seen(3, 1.0)  # before the kill: not counted
    pause.start(4, 10.0)
    pause.seen(4, 50.0)  # the same version seen again: no new version yet
    pause.seen(5, 30.0)  # 20 s after the kill
    pause.seen(7, 32.0)
    pause.seen(8, 33.0)
    assert pause.longest == 20.0
    pause.seen(8, 99.0)  # nothing newer by the end: an open gap is not a closed one
    assert pause.longest == 20.0
