"""Every benchmark's last line: ``RESULT <name> date=… commit=… load=… <figure>=<value> …``.

One format, so a figure can always be traced to the day, the code and the machine's load it was measured at, and
so ``make bench`` (and its CI smoke test) can check that each script got as far as its result.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import subprocess


#: What a run's code is: every tracked file but the raw results, which each run of a queue appends to (a second
#: benchmark of the queue ran the committed code, not a change to it).
CODE = (":(top)", ":(top,exclude)benchmarks/results")

#: What a run executes, for ``code_identity`` (tests/helpers/ too: some benchmarks start servers and build models
#: through them): a commit that touches none of it (tests, docs, CI, deploy files, the raw results, the README
#: tables' generator) leaves a figure's code as it was, so runs at two such commits are runs of one code, and a set
#: of benchmarks re-taken over several sessions can say so.
RUN_PATHS = ("rlstream/", "benchmarks/", "examples/", "infra/", "tests/helpers/", "pyproject.toml", "constraints")
NOT_RUN = ("benchmarks/results/", "benchmarks/README.md", "benchmarks/harness/tables.py")


def code_identity(ls_tree: str) -> str:
    """12 hex digits naming the run's code: a hash of ``git ls-tree -r`` lines (mode, type, blob, path) under
    ``RUN_PATHS`` less ``NOT_RUN``."""
    kept = [ln for ln in ls_tree.splitlines()
            if "\t" in ln and (path := ln.split("\t", 1)[1]).startswith(RUN_PATHS) and not path.startswith(NOT_RUN)]
    return hashlib.sha1("\n".join(sorted(kept)).encode()).hexdigest()[:12]


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
