"""The cores a multi-rank test needs: skipped on a smaller machine, except under CI (``CI=true``), where a runner
too small to run them is a failure: a skip there would pass CI with the rank tests never run."""
from __future__ import annotations

import os

import pytest

from rlstream.models.resources import cpu_cores


def require_cores(n: int) -> None:
    """Skip (fail under CI) unless this process may use ``n`` cores: one per rank on the CPU."""
    have = cpu_cores()
    if have >= n:
        return
    why = f"{n} ranks need {n} CPU cores and this process may use {have}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}: CI must run the multi-rank tests on a runner with {n} cores or more")
    pytest.skip(why)
