"""A benchmark's goals and the one rule that judges a figure's runs against its goal.

A goal is a figure's name, a direction and a target: ``Goal("hop_ratio", ">=", 0.7)``. A benchmark declares its
goals beside its result (``record(name, figures, goals)``) and each raw line keeps them, so the generated tables
(``tables.py``) judge every configuration by the goal its runs were held to.

The rule (``verdict``), over the runs of one configuration that carry the figure:

- no run carries it: ``not measured``;
- one run: ``one run, no spread``, whatever its value: a single run says nothing of its own noise, so it is never
  ``met`` (nor ``missed``); the table shows its value beside the goal;
- two runs or more: ``met`` when every run meets the goal, ``missed`` when none does, and ``within noise`` when some
  do and some do not (the goal lies inside the runs' spread). Only ``met`` counts as a goal met.

A run whose figure is not a number (``none``: a target not reached within the time allowed; NaN, written as null:
a side that did not finish) counts as a run that did not meet the goal. Booleans count as 1 and 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MET, MISSED, NOISE, ONE_RUN, NOT_MEASURED = "met", "missed", "within noise", "one run, no spread", "not measured"
_OPS = (">=", "<=")


@dataclass(frozen=True)
class Goal:
    """``figure op target``: the figure's value in a run must be at least (``>=``) or at most (``<=``) target."""

    figure: str
    op: str
    target: float

    def __post_init__(self):
        if self.op not in _OPS:
            raise ValueError(f"Goal {self.figure!r}: op must be one of {_OPS}, not {self.op!r}")
        if not isinstance(self.target, (int, float)) or isinstance(self.target, bool) or math.isnan(self.target):
            raise ValueError(f"Goal {self.figure!r}: target must be a number, not {self.target!r}")

    def meets(self, value) -> bool:
        """Whether one run's value meets the goal (a value that is not a number does not)."""
        x = number(value)
        if x is None:
            return False
        return x >= self.target if self.op == ">=" else x <= self.target

    def __str__(self) -> str:
        return f"{self.op} {self.target:g}"

    def to_json(self) -> dict:
        return {"figure": self.figure, "op": self.op, "target": self.target}

    @classmethod
    def from_json(cls, d: dict) -> Goal:
        return cls(d["figure"], d["op"], d["target"])


def number(value) -> float | None:
    """A figure's value as a float, or None when it is not a number (a string, null, NaN)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and not math.isnan(value):
        return float(value)
    return None


def verdict(goal: Goal, values: list) -> str:
    """The module docstring's rule, over one value per run (the runs that carry the figure)."""
    if not values:
        return NOT_MEASURED
    if len(values) == 1:
        return ONE_RUN
    meeting = sum(goal.meets(v) for v in values)
    return MET if meeting == len(values) else MISSED if meeting == 0 else NOISE
