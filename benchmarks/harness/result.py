"""Every benchmark's last line: ``RESULT <name> date=… commit=… load=… <figure>=<value> …``.

One format, so a figure can always be traced to the day, the code and the machine's load it was measured at, and
so ``make bench`` (and its CI smoke test) can check that each script got as far as its result.
"""
from __future__ import annotations

import datetime
import os
import subprocess


#: What a run's code is: every tracked file but the raw results, which each run of a queue appends to (a second
#: benchmark of the queue ran the committed code, not a change to it).
CODE = (":(top)", ":(top,exclude)benchmarks/results")


def commit() -> str:
    """The short commit of the working tree, ``+dirty`` when tracked files other than the raw results differ from
    it."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE],
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


_AT_IMPORT = commit()  # the code a run loaded: the raw line (record.py) says the same


def _value(v) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v).replace(" ", "_")


def result(name: str, **figures) -> str:
    """Print and return the benchmark's result line (figures in the order given)."""
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    fields = {"date": datetime.date.today().isoformat(), "commit": _AT_IMPORT, "load": load, **figures}
    line = f"RESULT {name} " + " ".join(f"{k}={_value(v)}" for k, v in fields.items())
    print(line, flush=True)
    return line
