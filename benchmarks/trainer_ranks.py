"""The trainer's step on 2 ranks against 1 rank: samples per second, and the loss curves side by side.

    python -m benchmarks.trainer_ranks [--steps 8] [--groups-per-step 8] [--micro-batch-tokens 0] [--warmup 1]

Each side launches its ranks as ``rlstream run trainer --nproc N`` does (``trainer/distributed.launch``: spawned
processes, gloo on the CPU, one torch thread each) and runs the trainer's own step function (``train_step``: every
rank holds the batch, trains its share, DDP all-reduces the gradients) on the same seeded steps and weights as
``benchmarks/trainer_tokens.py`` (its ~5 M-parameter Qwen2, groups of 8). Not on the clock: Kafka, the batch's
broadcast from rank 0 and the checkpoint (the service adds those per step on either side). The first --warmup steps
are not counted. Samples/s: samples of the counted steps over their wall time on rank 0 (a step ends on every rank
at once: the all-reduce and the optimizer step are in it). The 2-rank losses should equal the 1-rank ones to float
rounding; on a machine with 2 cores shared with other work expect little speed-up.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness.record import record
from benchmarks.harness.result import commit
from benchmarks.trainer_tokens import make_model, make_steps
from rlstream.trainer.distributed import launch
from rlstream.trainer.sharding import make_engine
from rlstream.trainer.microbatch import train_step
from rlstream.trainer.update import UpdateConfig, build_batch


def run_ranks(ranks, out: str, steps: int, groups: int, budget: int, seed: int) -> None:
    torch.set_num_threads(1)
    model, _, pad = make_model(None, seed)
    engine = make_engine(model, lr=1e-4, world_size=ranks.world)
    batches = [build_batch(g, "grpo", pad) for g in make_steps(steps, groups, 2048, pad, seed)]
    times, losses = [], []
    for batch in batches:
        started = time.perf_counter()
        stats = train_step(engine, batch, UpdateConfig(), max_tokens=budget, rank=ranks.rank, world=ranks.world)
        times.append(time.perf_counter() - started)
        losses.append(stats["loss"])
    if ranks.lead:
        Path(out).write_text(json.dumps({"times": times, "losses": losses,
                                         "samples": [int(b.input_ids.shape[0]) for b in batches]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=8)
    parser.add_argument("--micro-batch-tokens", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"date {datetime.datetime.now().isoformat(timespec='seconds')}  commit {commit()}  "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}  cores {os.cpu_count()}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, 2):
            out = Path(tmp) / f"ranks{n}.json"
            launch(n, run_ranks, (str(out), args.steps, args.groups_per_step, args.micro_batch_tokens, args.seed),
                   "cpu")
            results[n] = json.loads(out.read_text())
    counted = slice(args.warmup, None)
    rate = {n: sum(r["samples"][counted]) / sum(r["times"][counted]) for n, r in results.items()}
    for n in (1, 2):
        print(f"{n} rank(s): {rate[n]:.1f} samples/s over {args.steps - args.warmup} steps "
              f"({sum(results[n]['times'][counted]):.1f} s)")
    print(f"2 ranks / 1 rank: {rate[2] / rate[1]:.2f}x samples/s")
    record("trainer_ranks", dict(steps=args.steps, ratio=rate[2] / rate[1], one_rank_samples_per_s=rate[1],
                                 two_ranks_samples_per_s=rate[2],
                                 max_loss_difference=max(abs(a - b) for a, b in zip(results[1]["losses"],
                                                                                     results[2]["losses"]))),
           seed=args.seed)
    print("step  loss (1 rank)   loss (2 ranks)  |difference|")
    for step, (a, b) in enumerate(zip(results[1]["losses"], results[2]["losses"])):
        print(f"{step:4d}  {a:+.8f}  {b:+.8f}  {abs(a - b):.1e}")


if __name__ == "__main__":
    main()
