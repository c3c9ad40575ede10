"""On-policy distillation against RL alone, in one run: wall-clock for a fresh student to reach a held-out target
with RL (PPO on the verifier's reward), with OPD alone (the teacher's KL on the student's own samples), and with
RL + OPD (PPO on A_t - λ·KL_t, or the PPO loss + λ·KL: ``rl+opd-sum``). Goal: OPD reaches the target in <= 0.5x
RL's time.

The teacher is the demo's policy after it has learned: a first loop trains the tiny model on the reverse task until
held-out greedy accuracy reaches ``--teacher-target`` (or give ``--teacher DIR``, a model folder). Every student
starts the same way (the demo's 300-step supervised warm-up from the same seed) and runs the same loop (η = 2, 16
groups of 8 a step), with the teacher stage between reward and trainer in the two distillation runs. RL trains at
``--lr`` (1e-4; 2e-4 collapses it), the distillation students at ``--opd-lr`` with ``--opd-lr-warmup-steps``: each
side at the rate it learns best at (``benchmarks.distill_offline`` sweeps them). ``--top-k K`` has the teacher send
its top-K form, and ``--opd-kl`` picks the KL's direction. Time runs from rollout's first version; held-out accuracy
is measured off the clock on snapshots, as vs_trl does.

    python -m benchmarks.distill_vs_rl [--target 0.5] [--teacher-target 0.8] [--max-seconds 300] [--teacher DIR]
        [--opd-lr 1e-4] [--opd-lr-warmup-steps 0] [--opd-kl reverse] [--top-k 0] [--seed 0]
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from benchmarks.harness.loop import ROOT, Loop, PacedSource, Versions, log
from benchmarks.harness.race import race
from benchmarks.harness.record import Goal, record

MODES = {
    "rl": {"trainer": ()},
    "opd": {"trainer": ("--source", "feedback", "--loss", "opd")},
    "rl+opd": {"trainer": ("--source", "feedback", "--loss", "ppo+opd", "--opd-coef", "1.0")},
    "rl+opd-sum": {"trainer": ("--source", "feedback", "--loss", "ppo+opd-sum", "--opd-coef", "1.0")},
}


def run_loop(name: str, trainer_extra: tuple, teacher: Path | None, target: float, args) -> dict:
    """One loop until held-out greedy >= target or --max-seconds; its curve and the folder of its best version."""
    loop = Loop(f"distill-{name.replace('+', '-')}")
    distill = teacher is not None
    lr = args.opd_lr if distill else args.lr
    # The distillation students' learning rate may differ from RL's: each at its best (benchmarks/README.md).
    warm = ("--lr-warmup-steps", str(args.opd_lr_warmup_steps)) if distill and args.opd_lr_warmup_steps else ()
    kl = ("--opd-kl", args.opd_kl) if distill else ()
    loop.trainer(eta=2, groups_per_step=16, lr=lr, warmup_steps=300,
                 extra=(*trainer_extra, *warm, *kl, "--seed", str(args.seed)))
    loop.rollout(eta=2, backend=args.backend)
    loop.env_stage()
    loop.reward("benchmarks.harness.workloads:exact")
    if teacher is not None:
        loop.add("teacher", ["run", "teacher", "--teacher", str(teacher), "--teacher-version", "demo-teacher",
                             "--threads", "1", "--instance", "0", "--top-k", str(args.top_k)])
    versions = Versions(loop)
    source = PacedSource(loop, versions, mode="async", eta=2, groups_per_step=16, seed=args.seed)
    try:
        run = race(loop, versions, source, target=target, max_seconds=args.max_seconds, eval_every=args.eval_every,
                   startup_timeout=args.startup_timeout, tag=name)
    finally:
        source.stop()
        # Where each stage's time went (the teacher's batches against the reward's), read before the loop stops.
        stages = {n: loop.stage_profile(n) for n in ("reward", "teacher") if n in loop.metrics_ports}
        dead = loop.dead()
        loop.stop()
        versions.close()
    reached = next((c for c in run.curve if c["heldout"] >= target), None)
    return {"curve": run.curve, "run": loop.run, "dead": dead, "best": run.best[0], "best_folder": run.best[1],
            "seconds_to_target": run.seconds_to(target), "stages": stages,
            "versions_to_target": reached["step"] - run.first_version if reached else None}


def _key(mode: str) -> str:
    """A mode's name in the RESULT line's figures."""
    return mode.replace("+", "_").replace("-", "_")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=float, default=0.5, help="held-out greedy accuracy the students race to")
    ap.add_argument("--teacher-target", type=float, default=0.8, help="held-out accuracy the teacher is trained to")
    ap.add_argument("--teacher", default="", help="a model folder to use as the teacher (skips training one); "
                                                  "untrained: the tiny model as built, for a smoke run")
    ap.add_argument("--modes", default="rl,opd,rl+opd", help="students to run, comma-separated: " + ", ".join(MODES))
    ap.add_argument("--max-seconds", type=float, default=300, help="longest a student runs")
    ap.add_argument("--lr", type=float, default=1e-4, help="the RL student's learning rate (2e-4 collapses it)")
    ap.add_argument("--opd-lr", type=float, default=1e-4, help="the distillation students' learning rate")
    ap.add_argument("--opd-lr-warmup-steps", type=int, default=0,
                    help="the distillation students' --lr-warmup-steps (a fresh Adam's first full-size steps)")
    ap.add_argument("--opd-kl", default="reverse", choices=("reverse", "forward", "mixed"),
                    help="the distillation students' --opd-kl")
    ap.add_argument("--top-k", type=int, default=0, help="the teacher's top-k form (0: the sampled token's log-prob "
                                                         "alone; the tiny model's vocabulary is 47: --top-k 47 is "
                                                         "its whole distribution, the exact KL)")
    ap.add_argument("--teacher-seconds", type=float, default=600, help="longest the teacher's own training runs")
    ap.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every N versions")
    ap.add_argument("--backend", default="auto", choices=("auto", "vllm", "transformers"),
                    help="rollout's backend (auto: transformers for the tiny model, as the demo)")
    ap.add_argument("--seed", type=int, default=0,
                    help="every loop's initialisation, warm-up and prompt stream (the teacher's too, when trained "
                         "here: give the same --teacher to runs over several seeds, so only the students differ)")
    ap.add_argument("--startup-timeout", type=float, default=300)
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes takes {', '.join(MODES)}")
    if args.teacher == "untrained":
        from rlstream.models.tiny import build_model, build_tokenizer, save_pretrained
        teacher = ROOT / ".rlstream" / "distill-teacher-untrained"
        tok = build_tokenizer()
        save_pretrained(build_model(tok), tok, teacher)
    elif args.teacher:
        teacher = Path(args.teacher)
    else:
        trained = run_loop("teacher", (), None, args.teacher_target,
                           argparse.Namespace(**{**vars(args), "max_seconds": args.teacher_seconds}))
        if trained["best_folder"] is None:
            raise SystemExit(f"the teacher's loop produced no version to use (logs: .rlstream/runs/{trained['run']})")
        teacher = ROOT / ".rlstream" / "distill-teacher"
        shutil.rmtree(teacher, ignore_errors=True)
        shutil.copytree(trained["best_folder"], teacher)
        log("teacher", f"held-out {trained['best']:.3f}, saved to {teacher}")
    results = {m: run_loop(m, MODES[m]["trainer"], teacher if m != "rl" else None, args.target, args)
               for m in modes}
    print(f"time to held-out {args.target} (teacher: {teacher}):")
    for m, r in results.items():
        secs = r["seconds_to_target"]
        n = r["versions_to_target"]
        print(f"  {m:7s} " + (f"{secs:7.1f} s, {n} versions, {secs / max(1, n):.3f} s a version"
                              if secs is not None else
                              f"not reached in {args.max_seconds:.0f} s (best {r['best']:.2f})"))
        for stage, p in r["stages"].items():
            print(f"          {stage:8s} {p['batches']:.0f} transactions, {p['records_per_batch']:.1f} records each, "
                  f"{p['batch_s'] * 1000:.0f} ms a transaction")
    figures = {f"{_key(m)}_s": r["seconds_to_target"] for m, r in results.items()}
    figures.update({f"{_key(m)}_versions": r["versions_to_target"] for m, r in results.items()})
    rl = results.get("rl", {}).get("seconds_to_target")
    for m in MODES:
        secs = results.get(m, {}).get("seconds_to_target")
        if m != "rl" and m in results and "rl" in results:
            # "none" when either side did not reach the target: a run that does not meet the goal (harness/verdict).
            figures[f"{_key(m)}_vs_rl"] = secs / rl if rl and secs is not None else None
            if figures[f"{_key(m)}_vs_rl"] is not None:
                print(f"  {m} / rl: {secs / rl:.2f}x   (goal for opd <= 0.5x)")
    record("distill_vs_rl", {"target": args.target, **{k: ("none" if v is None else v) for k, v in figures.items()}},
           [Goal(k, "<=", 0.5) for k in figures if k.endswith("_vs_rl")])
    return results


if __name__ == "__main__":
    main()
