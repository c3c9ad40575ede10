"""A recipe's learning, over seeds: ``rlstream demo --recipe NAME --seed S`` once per seed, each a whole loop on
this machine, and from each run's held-out curve the start, the best, and the seconds to +0.10 and +0.15 over the
start (the real-checkpoint recipe's goal: +0.15 held-out greedy accuracy within 20 minutes on 2 cores, 3 seeds).

    python -m benchmarks.recipe_learning --recipe smollm2 --seeds 0,1,2 --minutes 20
    python -m benchmarks.recipe_learning --recipe arithmetic --size smoke --seeds 0   # what make bench's smoke runs
    python -m benchmarks.recipe_learning --recipe smollm2 --seeds 0,1,2 --demo-args "--lora-rank 16"  # LoRA variant

One raw line per seed (benchmarks/results/recipe_learning.jsonl), so the tables report the median and the spread
across seeds. A run that does not reach a gain has no figure for it (null), which counts as not meeting the goal.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness.record import Goal, record
from benchmarks.harness.scratch import discard
from rlstream.infra.broker import bootstrap as broker_address

ROOT = Path(__file__).resolve().parents[1]


def first_time_to(curve: list[list[float]], start: float, gain: float) -> float | None:
    """Seconds of the first held-out point at least ``gain`` above ``start``, or None."""
    return next((t for t, version, reward in curve if version > 0 and reward >= start + gain), None)


def run(recipe: str, size: str, seed: int, minutes: float, home: Path, extra: tuple[str, ...] = ()) -> dict:
    """One demo run (``extra``: more demo flags); its figures."""
    return demo(recipe, size, seed, minutes, home, extra)[0]


def demo(recipe: str, size: str, seed: int, minutes: float, home: Path, extra: tuple[str, ...] = ()
         ) -> tuple[dict, list[list[float]]]:
    """One demo run: its figures and its held-out curve ([seconds, version, held-out] from the demo's start)."""
    name = f"bench-{recipe}-{size}-s{seed}-{int(time.time())}"
    argv = [sys.executable, "-m", "rlstream.cli", "demo", "--recipe", recipe, "--recipe-size", size, "--seed",
            str(seed), "--run", name, *(["--minutes", str(minutes)] if minutes else []), *extra]
    started = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, env=dict(os.environ, RLSTREAM_HOME=str(home)), capture_output=True,
                          text=True)
    seconds = time.monotonic() - started
    text = done.stdout + done.stderr
    summary = re.search(r"reward (\S+) -> (\S+) over (\d+) policy versions in (\d+) s", text)
    if not summary:
        sys.exit(f"rlstream demo printed no summary line (exit {done.returncode}):\n{text[-3000:]}")
    curve = json.loads((home / "runs" / name / "heldout_curve.json").read_text())
    discard(broker_address(home), name, home / "runs" / name)  # the broker the demo started there
    start = next((reward for t, version, reward in curve if version == 0), float(summary[1]))
    best = max((reward for _, version, reward in curve if version > 0), default=float("nan"))
    return {"heldout_start": start, "heldout_best": best, "heldout_gain": best - start,
            "to_plus_0_10_s": first_time_to(curve, start, 0.10), "to_plus_0_15_s": first_time_to(curve, start, 0.15),
            "versions": int(summary[3]), "demo_s": seconds, "curve_points": len(curve)}, curve


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="smollm2", help="a recipe of rlstream demo --recipe list")
    p.add_argument("--size", default="full", choices=("full", "smoke"), help="the recipe's size")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one run each")
    p.add_argument("--minutes", type=float, default=0.0, help="each run's limit (0: the recipe's own)")
    p.add_argument("--demo-args", default="",
                   help="more rlstream demo flags, quoted (e.g. \"--lora-rank 16\": the recipe's LoRA variant)")
    p.add_argument("--home", type=Path, default=ROOT / ".rlstream",
                   help="RLSTREAM_HOME of the runs (the project's broker's, by default)")
    args = p.parse_args(argv)
    for seed in (int(s) for s in args.seeds.split(",")):
        figures = run(args.recipe, args.size, seed, args.minutes, args.home, tuple(args.demo_args.split()))
        print(json.dumps({"seed": seed, **figures}), flush=True)
        # Within the recipe's 20 minutes on 2 cores: the goal the smollm2 recipe is measured against.
        record("recipe_learning", figures, [Goal("to_plus_0_15_s", "<=", 1200.0)], seed=seed)


if __name__ == "__main__":
    main()
