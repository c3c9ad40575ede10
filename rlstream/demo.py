"""``rlstream demo``: the whole loop on this machine, every stage its own process, until the model learns.

It starts the broker, creates a fresh run's topics, launches trainer, rollout,
env, reward, archive and a paced prompt source, follows held-out reward per
policy version on a live line, and ends with a reward-curve PNG, the SQL to
explore the run, and ``reward A -> B over N policy versions in T s``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from rlstream import recipes
from rlstream.config import LoopSettings, add_arguments, env_name, knob, load
from rlstream.errors import UserError
from rlstream.infra import placement
from rlstream.infra.placement import Need, Seat
from rlstream.infra.supervisor import ONE_THREAD, StageProc, Supervisor, seat_env, stage_env
from rlstream.kafka.tail import Seen, TopicTail
from rlstream.kafka.topics import create_topics
from rlstream.models.resources import ModelShape, cpu_cores, engine_bytes, trainer_bytes
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import PolicyVersion, ScoredTrajectory

#: Recipes: a model and a dataset that a recipe of rlstream.recipes builds under HOME/recipes/<name>, with the
#: demo settings that run them.
RECIPES = recipes.NAMES

#: Stop order: the source first, then each stage after the one that feeds it; the archive last.
STOP_ORDER = ["prompts", "rollout", "env", "reward", "trainer", "archive"]


@dataclass(frozen=True)
class DemoSettings:
    """Knobs of the local demo (defaults: reverse 3 letters with a tiny Qwen2, vLLM when installed); the run, η,
    group sizes, home and archive are the loop's settings (without --run, a fresh demo-<time> run, so a fresh
    model). With --model and --dataset it runs your model on your data; --recipe names a prepared pair."""

    ROLE: ClassVar[str] = "DEMO"

    recipe: str = knob("", "A prepared model and dataset, built on first use: " + ", ".join(RECIPES) +
                           " (its settings are defaults: flags given here win); list: print them",
                       choices=("", recipes.LIST, *RECIPES))
    recipe_size: str = knob("full", "full, or smoke: the recipe's code paths at the smallest size (a tiny build, "
                                    "a short run that ends at its first held-out evaluation of a trained version)",
                            choices=recipes.SIZES)
    task: str = knob("reverse", "Built-in task to learn (without --dataset): reverse or arithmetic")
    model: str = knob("tiny", "The policy to train: a Hugging Face folder (version 0 as given) or tiny")
    dataset: str = knob("", "Training prompts from a dataset file or save_to_disk folder (instead of --task)")
    eval_dataset: str = knob("", "Held-out prompts from a dataset, evaluated every --heldout-every versions")
    prompt_column: str = knob("prompt", "Dataset column of the prompt")
    answer_column: str = knob("answer", "Dataset column of the reference answer")
    chat: bool = knob(False, "Apply the model's chat template to the prompts")
    reward: str = knob("", "Reward function (see rlstream run reward --help; '' = the reward stage's default)")
    max_tokens: int = knob(0, "Most new tokens per response (0: the task's own; a dataset's default is 256)")
    minutes: float = knob(15.0, "Give up after this long")
    target: float = knob(0.8, "Stop once held-out reward reaches this")
    backend: str = knob("auto", "Rollout engine: auto (vLLM if installed, but transformers for a model under "
                                 "10 M parameters on the CPU: the demo's), transformers, vllm",
                        choices=("auto", "transformers", "vllm"))
    lr: float = knob(1e-4, "Learning rate")
    temperature: float = knob(1.0, "Sampling temperature of the training rollouts (the prompt source's "
                                   "--temperature; held-out ones are greedy)")
    autocast: str = knob("auto", "The trainer's --autocast: auto (bf16 on a CUDA device that has it, off on the "
                                 "CPU), bf16 (also on a CPU with bf16 instructions: AVX512-BF16 or AMX), off",
                         choices=("auto", "off", "bf16"))
    lr_warmup_steps: int = knob(0, "Linear learning-rate warm-up over this many updates (the trainer's "
                                   "--lr-warmup-steps)")
    lora_rank: int = knob(0, "Train a LoRA adapter of this rank instead of the whole model (the trainer's "
                             "--lora-rank; 0: the whole model)")
    warmup_steps: int = knob(300, "Supervised warm-up steps of the tiny model before RL (a --model is used as "
                                  "given)")
    heldout_every: int = knob(2, "Evaluate the held-out set every N policy versions")
    heldout_count: int = knob(128, "Held-out tasks per evaluation (with --eval-dataset: its rows)")
    seed: int = knob(0, "Seed of the run: the trainer's (the tiny model's weights and warm-up) and the order a "
                        "dataset's prompts are served in")
    placement: str = knob("auto", "Where trainer and rollout run: auto (on the GPUs nvidia-smi lists: a GPU each "
                                  "where there are two, else sharing one, the trainer reserved first; the CPU "
                                  "without one) or cpu; threads follow the machine's cores either way",
                          choices=("auto", "cpu"))
    trainer_threads: int = knob(0, "CPU threads of a trainer placed on the CPU: 0 its share of the cores (the "
                                   "placement's), -1 every core (sharing them with the rollout), or N. Without a "
                                   "GPU the trainer's step is the loop's longest part while the paced rollout waits "
                                   "for its next version (benchmarks/trainer_step_cpu: a SmolLM2-135M step of 32 "
                                   "samples, bf16, 15.0 s on 2 cores against 27.9 s on one)")
    trainer_gpu_share: float = knob(0.0, "Share of its GPU's memory the trainer asks (0: its estimated need and an "
                                         "equal part of what is left)")
    rollout_gpu_share: float = knob(0.0, "Share of its GPU's memory the rollout engine asks (0: its estimated need "
                                         "and an equal part of what is left)")


@dataclass
class Progress:
    """What the live line shows, folded from the rewards and policy-versions topics."""

    heldout: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # round -> (version, reward)
    rounds: dict[str, tuple[int, float]] = field(default_factory=dict)  # complete round -> (version, reward)
    curve: list[tuple[float, int, float]] = field(default_factory=list)  # (seconds, version, held-out reward)
    train_rewards: deque = field(default_factory=lambda: deque(maxlen=512))
    train_times: deque = field(default_factory=lambda: deque(maxlen=2048))
    train_curve: list[tuple[float, float]] = field(default_factory=list)
    version: int = -1
    stale_ratio: float = 0.0

    def samples_per_s(self) -> float | None:
        """Scored samples a second over the kept arrivals; None until they span ``RATE_SPAN_S`` (records come in
        bursts, a batch at a time: over the first burst's milliseconds a rate is a huge number that means
        nothing, as v0's ``281162.1 samples/s`` did)."""
        if len(self.train_times) < 2:
            return None
        span = self.train_times[-1] - self.train_times[0]
        return (len(self.train_times) - 1) / span if span >= RATE_SPAN_S else None


#: The shortest span of arrivals the live line shows a rate over.
RATE_SPAN_S = 10.0


def live_line(progress: Progress, best: tuple[int, float] | None, seconds: float, warming: bool = False) -> str:
    """The demo's one status line: what the loop is waiting on until it has figures, then the figures."""
    if progress.version < 0:
        doing = "supervised warm-up, then version 0" if warming else "loading the model for version 0"
        return f"starting: trainer {doing}  {seconds:5.0f}s"
    if not progress.train_rewards:
        return f"v{progress.version:<4d} rollout engine starting: no samples scored yet  {seconds:5.0f}s"
    heldout = f"{best[1]:.2f}" if best else "  - "
    rate = progress.samples_per_s()
    return (f"v{progress.version:<4d} held-out {heldout}  train {_mean(progress.train_rewards):.2f}  "
            f"{'     -' if rate is None else f'{rate:6.1f}'} samples/s  stale {progress.stale_ratio:.1%}  "
            f"{seconds:5.0f}s")


def run_demo(s: DemoSettings, loop: LoopSettings) -> int:
    """Run the loop until held-out reward reaches the target or time is up; 0 when it was reached."""
    from rlstream.infra import broker
    started = time.monotonic()
    seats = demo_placement(s)  # before anything starts: a placement that does not fit loads nothing
    home = loop.home_path
    bootstrap = broker.up(home)
    run = loop.run
    run_dir = home / "runs" / run
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    client = {"bootstrap.servers": bootstrap}
    create_topics(client, run)
    # Every stage reads the loop's settings from the same variables.
    env = stage_env(bootstrap, run, **ONE_THREAD, RLSTREAM_HOME=str(home), RLSTREAM_POLICY=loop.policy,
                    RLSTREAM_ETA=str(loop.eta), RLSTREAM_GROUP_SIZE=str(loop.group_size),
                    RLSTREAM_GROUPS_PER_STEP=str(loop.groups_per_step), RLSTREAM_ARCHIVE=loop.archive)
    weights = str(run_dir / "weights")
    user_model = s.model != "tiny"
    print("placement: " + ", ".join(f"{n} " + (f"GPU {x.gpu} ({x.share:.2f} of its memory)" if x.gpu is not None
                                              else "CPU") + f", {x.threads} threads" for n, x in seats.items()))
    plan = {
        "trainer": ["run", "trainer", "--weights", weights, "--model", s.model, "--task", s.task, "--lr", str(s.lr),
                    "--lr-warmup-steps", str(s.lr_warmup_steps), "--lora-rank", str(s.lora_rank),
                    # Only when asked: an RLSTREAM_TRAINER_AUTOCAST of the user's still reaches the trainer otherwise.
                    *(["--autocast", s.autocast] if s.autocast != "auto" else []),
                    "--warmup-steps", str(0 if user_model else s.warmup_steps),
                    "--seed", str(s.seed), "--instance", "0",
                    *seat_flags(seats["trainer"], "--gpu-memory-fraction")],
        "rollout": ["run", "rollout", "--backend", s.backend, "--instance", "0", "--batch-size", "64",
                    *seat_flags(seats["rollout"], "--gpu-memory-utilization")],
        "env": ["run", "env", "--instance", "0"],
        "reward": ["run", "reward", "--instance", "0", *(["--reward", s.reward] if s.reward else [])],
        "archive": ["run", "archive"],
        "prompts": ["prompts", *_prompt_source(s), "--paced", "--heldout-every", str(s.heldout_every),
                    *(["--temperature", str(s.temperature)] if s.temperature != 1.0 else []),
                    *(["--max-tokens", str(s.max_tokens)] if s.max_tokens else [])],
    }
    sup = Supervisor()
    for name, argv in plan.items():
        sup.add(StageProc(name, argv, seat_env(env, seats[name]) if name in seats else env,
                          run_dir / "logs" / f"{name}.log"))
    sup.start_all()
    print(f"rlstream demo: run {run} on {bootstrap}; logs in {run_dir / 'logs'}", flush=True)
    progress = Progress()
    stopping = []
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    # The tail reads in its own thread and hands records over; this loop folds them, so Progress has one writer.
    arrived: queue.SimpleQueue[Seen] = queue.SimpleQueue()
    view = TopicTail(client, run, ["rewards", "eval-rewards", "policy-versions"], name="demo-view", keep=False,
                     on_record=arrived.put)
    first: float | None = None
    best: tuple[int, float] | None = None
    tty = sys.stdout.isatty()
    last_print = 0.0
    try:
        while not stopping and time.monotonic() - started < s.minutes * 60:
            for name, code in sup.check():  # a stage died: restart it, as an orchestrator would
                print(f"\n{name} exited with {code}; restarting (see {sup.procs[name].log_path})")
            for seen in _take(arrived, 0.5):
                fold(progress, seen, started)
            done_round = latest_complete_round(progress, s.heldout_count, time.monotonic() - started)
            if done_round is not None:
                if first is None:
                    first = min(progress.rounds.values())[1]
                best = done_round
            now = time.monotonic()
            if now - last_print > (0.5 if tty else 10):
                last_print = now
                line = live_line(progress, best, now - started, warming=s.warmup_steps > 0 and s.model == "tiny")
                print("\r" + line if tty else line, end="" if tty else "\n", flush=True)
            if best is not None and first is not None and best[1] >= s.target and best[0] > 0:
                break
    finally:
        view.close()
        # The source first, then each stage after the one feeding it: every stage finishes what it was given.
        sup.stop_all(STOP_ORDER, timeout=30)
    elapsed = time.monotonic() - started
    png = _plot(progress, run_dir / "reward_curve.png", s.recipe or (Path(s.dataset).stem if s.dataset else s.task))
    # The curve's points as data too (seconds since start, policy version, held-out reward), for benchmarks.
    (run_dir / "heldout_curve.json").write_text(json.dumps(progress.curve))
    print()
    print(f"reward curve: {png}")
    print("explore the run in the archive, e.g.:")
    for q in (f"rlstream sql \"SELECT header_policy_version AS v, avg(reward_total) FROM rlstream.rewards "
              f"WHERE run = '{run}' GROUP BY v ORDER BY v\"",
              f"rlstream sql \"SELECT reason, count() FROM rlstream.dead_letters WHERE run = '{run}' GROUP BY reason\""):
        print("  " + q)
    if sup.crashes:
        print(f"{len(sup.crashes)} stage restarts during the run (see logs)")
    start_r = first if first is not None else float("nan")
    end_r = best[1] if best else float("nan")
    print(f"reward {start_r:.2f} -> {end_r:.2f} over {max(progress.version, 0)} policy versions in {elapsed:.0f} s")
    return 0 if best is not None and best[1] >= s.target else 1


def demo_placement(s: DemoSettings) -> dict[str, Seat]:
    """Seats of the trainer and the rollout engine on this machine's GPUs (none: the CPU), before anything loads:
    a placement that does not fit is a PlacementError naming both and their memory (``infra/placement.py``)."""
    found = [] if s.placement == "cpu" else placement.gpus()
    trainer, rollout = 0, 0  # memory matters only on a GPU
    if found:
        import torch  # only on a machine with GPUs: say so when torch cannot use them, before any stage starts

        from rlstream.models.devices import auto_device
        auto_device(torch.cuda.is_available(), len(found), torch.__version__, torch.version.cuda)
        try:
            shape = TINY_SHAPE if s.model == "tiny" else ModelShape.of_folder(Path(s.model))
        except (OSError, ValueError) as exc:
            raise UserError(f"--model {s.model}: cannot size it for the GPUs from its config.json ({exc})") from None
        trainer, rollout = trainer_bytes(shape, placement.TRAINER_TOKENS), engine_bytes(shape)
    needs = [Need("trainer", trainer, s.trainer_gpu_share), Need("rollout", rollout, s.rollout_gpu_share)]
    light = len(STOP_ORDER) - len(needs)  # env, reward, archive, the prompt source
    if s.trainer_threads < -1:
        raise UserError(f"--trainer-threads {s.trainer_threads}: expected -1 (every core), 0 (the placement's share "
                        "of the cores) or a number of threads")
    seats = placement.place(needs, found, cpu_cores(), light)
    if s.trainer_threads and seats["trainer"].gpu is None:
        threads = cpu_cores() if s.trainer_threads < 0 else s.trainer_threads
        seats["trainer"] = dataclasses.replace(seats["trainer"], threads=threads)
    return seats


#: The built-in model's shape for the placement (models/tiny.py: a few hundred thousand parameters).
TINY_SHAPE = ModelShape(params=1_000_000, hidden=64, layers=2, vocab=2048)


def seat_flags(seat: Seat, share_flag: str) -> list[str]:
    """A placed stage's flags: its threads, and on a GPU its device and its share (``share_flag``)."""
    flags = ["--threads", str(seat.threads)]
    if seat.gpu is not None:
        flags += ["--device", seat.device, share_flag, f"{seat.share:.2f}"]
    return flags


def _prompt_source(s: DemoSettings) -> list[str]:
    """The prompt source's flags: a dataset's (its rows once per epoch, as many epochs as the run takes), or the
    built-in task's."""
    if not s.dataset:
        return ["--task", s.task, "--count", "0", "--heldout-count", str(s.heldout_count)]
    return ["--dataset", s.dataset, "--epochs", "1000", "--shuffle-seed", str(s.seed), "--prompt-column", s.prompt_column,
            "--answer-column", s.answer_column, *(["--eval-dataset", s.eval_dataset] if s.eval_dataset else []),
            *(["--chat"] if s.chat else [])]


def _take(arrived: queue.SimpleQueue, timeout: float, most: int = 500) -> list[Seen]:
    """What the tail handed over: waits up to ``timeout`` for the first record, then takes what is there."""
    try:
        out = [arrived.get(timeout=timeout)]
    except queue.Empty:
        return []
    while len(out) < most:
        try:
            out.append(arrived.get_nowait())
        except queue.Empty:
            break
    return out


def _mean(values) -> float:
    return sum(values) / len(values) if values else float("nan")


def fold(progress: Progress, seen: Seen, started: float) -> None:
    """Fold one record of rewards or policy-versions into the live figures."""
    record = seen.record
    if isinstance(record, PolicyVersion):
        progress.version = max(progress.version, record.version)
        progress.stale_ratio = record.metrics.get("stale_ratio", progress.stale_ratio)
        return
    if not isinstance(record, ScoredTrajectory):
        return  # not decodable: the stages dead-letter such records, the view only skips them
    task = record.trajectory.task
    version = hdr.policy_version(seen.headers)
    if task.split == "heldout":
        round_id = task.task_id.split("-", 2)[:2]
        progress.heldout.setdefault("-".join(round_id), []).append((version, record.reward.total))
    else:
        progress.train_rewards.append(record.reward.total)
        progress.train_times.append(time.monotonic())
        progress.train_curve.append((time.monotonic() - started, record.reward.total))


def latest_complete_round(progress: Progress, size: int, elapsed: float) -> tuple[int, float] | None:
    """(generating version, mean reward) of the newest evaluation round whose every task is scored."""
    for key, rows in progress.heldout.items():
        if key not in progress.rounds and len(rows) >= size:
            # A round is attributed to the oldest version that generated any of its answers.
            progress.rounds[key] = (min(v for v, _ in rows), _mean([r for _, r in rows]))
            progress.curve.append((elapsed, *progress.rounds[key]))
    return max(progress.rounds.values()) if progress.rounds else None


def _plot(progress: Progress, path: Path, task: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    points = sorted({(v, r) for _, v, r in progress.curve})
    fig, ax = plt.subplots(figsize=(7, 4))
    if points:
        ax.plot([v for v, _ in points], [r for _, r in points], marker="o", label="held-out reward (greedy)")
    ax.set_xlabel("policy version")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"rlstream demo: {task}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cmd_demo(args: argparse.Namespace) -> None:
    loop = load(LoopSettings, args)
    if args.run is None and "RLSTREAM_RUN" not in os.environ:
        loop = dataclasses.replace(loop, run=time.strftime("demo-%Y%m%d-%H%M%S"))  # a fresh run: a fresh model
    s = load(DemoSettings, args)
    if s.recipe == recipes.LIST:
        print(recipes.listing())
        return
    if s.recipe:
        # The recipe's values stand in for flags and variables not given.
        given = {f.name for f in dataclasses.fields(DemoSettings) if getattr(args, f.name, None) is not None
                 or env_name(DemoSettings, f.name) in os.environ}
        demo, shared = recipes.prepare(s.recipe, loop.home_path, s.recipe_size, lora=s.lora_rank > 0)
        s = load(DemoSettings, args, **{k: v for k, v in demo.items() if k not in given})
        loop = dataclasses.replace(loop, **{k: v for k, v in shared.items() if getattr(args, k, None) is None})
        if "autocast" not in given:
            s = recipe_autocast(s)
    if s.eval_dataset:
        from rlstream.sources.dataset import load as load_dataset
        s = dataclasses.replace(s, heldout_count=len(load_dataset(s.eval_dataset, "--eval-dataset")))
    sys.exit(run_demo(s, loop))


def recipe_autocast(s: DemoSettings, cpu_bf16: bool | None = None) -> DemoSettings:
    """A recipe's bf16 autocast where the trainer can use it: on a GPU, or on a CPU with bf16 instructions; else
    off, and said (torch emulates bf16 on a CPU without them, slower than float32). ``cpu_bf16``: for tests."""
    if s.autocast != "bf16" or (s.placement != "cpu" and placement.gpus()):
        return s
    if cpu_bf16 is None:
        from rlstream.models.devices import cpu_has_bf16
        cpu_bf16 = cpu_has_bf16()
    if cpu_bf16:
        return s
    print(f"rlstream demo: the {s.recipe} recipe's trainer runs in float32 here (--autocast off): this CPU has no "
          "bf16 instructions (AVX512-BF16, AMX or Arm BF16), so bf16 autocast would be slower; its step is about "
          "twice as long as where the recipe was measured", flush=True)
    return dataclasses.replace(s, autocast="off")


def add_command(sub) -> None:
    """Register ``rlstream demo``."""
    p = sub.add_parser("demo", help="run the whole loop locally until a tiny model learns")
    add_arguments(p, LoopSettings)
    add_arguments(p, DemoSettings)
    p.set_defaults(func=cmd_demo)
