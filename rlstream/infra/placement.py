"""Where the stages of one machine run: each on a GPU with a share of its memory, or on the CPU, and how many
threads each gets. ``rlstream demo`` (and any supervisor that starts stages together) places them before anything
loads, so a placement that does not fit is one error naming the stages and their memory, not an out-of-memory
crash minutes in.

Rules (``place``), for the GPU stages in priority order (the trainer first):
- no GPU: every stage on the CPU;
- a GPU each where there are enough (the trainer on the first; the rest round-robin over the others);
- stages sharing a GPU split what is free on it, less ``HEADROOM`` per process (its CUDA context, the allocator's
  slack): the trainer is reserved first, and each stage gets its need (``models/resources.py``'s estimates) plus an
  equal part of what is left, or exactly the share it asked; asks that add up past the GPU are a ``PlacementError``.
Shares are fractions of the GPU's total memory, what vLLM's ``gpu_memory_utilization`` and torch's per-process
memory fraction both take, rounded down to a hundredth so that they add up.

Threads (``split_threads``): the light stages (env, reward, archive, the prompt source mostly wait on the broker)
share a core per four the machine has; a stage on a GPU needs few CPU threads (``GPU_STAGE_THREADS``); the CPU
stages divide the rest, the first one (the trainer) taking the odd core.

A stage placed on GPU N runs with ``CUDA_VISIBLE_DEVICES=N`` and ``--device cuda`` (``stage_env``): in-process vLLM
has no device index of its own, and the CUDA runtime reads the variable once per process.

Pure arithmetic on what it is told (``Gpu``, ``Need``, cores), unit-tested on the CPU; ``gpus()`` asks nvidia-smi.
Not run on a GPU in this project: no placement here has met a real driver.
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from rlstream.errors import UserError
from rlstream.models.resources import GIB, gib

#: Per process on a GPU, kept out of every share: its CUDA context (~0.5 GiB) and the allocator's slack.
HEADROOM = GIB
#: CPU threads of a stage whose compute is on a GPU: it launches kernels and moves batches.
GPU_STAGE_THREADS = 2
#: The micro-batch a trainer's need is sized at: the least room a placement leaves it for activations (the
#: trainer's own default budget is sized within its share, ``trainer/microbatch.py``).
TRAINER_TOKENS = 4096


class PlacementError(UserError):
    """The stages asked for more than the machine's GPUs have; the message names each stage and its memory."""


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi reports it: its index, total and free memory in bytes."""

    index: int
    total: int
    free: int


@dataclass(frozen=True)
class Need:
    """A stage that runs on a GPU when there is one: the least memory it needs there, and the share it asks
    (a fraction of the GPU's total; 0: its need and a part of what is left)."""

    stage: str
    memory: int
    share: float = 0.0


@dataclass(frozen=True)
class Seat:
    """Where a stage runs: ``gpu`` (None: the CPU), its ``share`` of that GPU's memory, its threads."""

    stage: str
    gpu: int | None
    share: float
    threads: int

    @property
    def device(self) -> str:
        """Its ``--device`` (the GPU is its process's only visible one: ``stage_env``)."""
        return "cpu" if self.gpu is None else "cuda"


def place(needs: list[Need], gpus: list[Gpu], cores: int, light: int = 0) -> dict[str, Seat]:
    """Seats of the GPU stages ``needs`` (priority order, the trainer first) on ``gpus``, with threads from
    ``cores`` shared with ``light`` light stages; PlacementError when they do not fit (module docstring)."""
    if not gpus or not needs:
        threads = split_threads(cores, {n.stage: False for n in needs}, light)
        return {n.stage: Seat(n.stage, None, 0.0, threads[n.stage]) for n in needs}
    on = assign(len(needs), len(gpus))
    shares: dict[str, float] = {}
    for g, gpu in enumerate(gpus):
        here = [n for n, at in zip(needs, on) if at == g]
        if here:
            shares.update(split_gpu(here, gpu))
    threads = split_threads(cores, {n.stage: True for n in needs}, light)
    return {n.stage: Seat(n.stage, gpus[at].index, shares[n.stage], threads[n.stage]) for n, at in zip(needs, on)}


def assign(stages: int, gpus: int) -> list[int]:
    """Which GPU (a position in the list) each stage goes on: the first alone on the first GPU when there are two
    or more, the others round-robin over the rest; one GPU holds them all."""
    if gpus <= 1:
        return [0] * stages
    return [0] + [1 + i % (gpus - 1) for i in range(stages - 1)]


def split_gpu(needs: list[Need], gpu: Gpu) -> dict[str, float]:
    """Shares of one GPU for the stages on it: those that asked a share get it, the others their need plus an equal
    part of what is left, the first reserved first; PlacementError when the asks pass what is free."""
    for n in needs:
        if not 0 <= n.share < 1:
            raise PlacementError(f"{n.stage}: a GPU share of {n.share} is not a fraction in [0, 1) (0: the "
                                 "placement's choice)")
    usable = gpu.free - HEADROOM * len(needs)
    asked = {n.stage: int(n.share * gpu.total) if n.share > 0 else n.memory for n in needs}
    short = [n for n in needs if n.share > 0 and asked[n.stage] < n.memory]
    if short:
        n = short[0]
        raise PlacementError(f"{n.stage} asks {n.share:.2f} of GPU {gpu.index} ({gib(asked[n.stage])}) but needs "
                             f"about {gib(n.memory)}: give it a larger share, or leave its share to the placement")
    if sum(asked.values()) > usable:
        each = ", ".join(f"{n.stage} {gib(asked[n.stage])}" + (f" ({n.share:.2f} asked)" if n.share else " (need)")
                         for n in needs)
        raise PlacementError(f"GPU {gpu.index} has {gib(gpu.free)} free of {gib(gpu.total)} ({gib(HEADROOM)} kept per "
                             f"process), and {each} do not fit together: run them on a GPU each, on a larger GPU, "
                             "or one of them on the CPU (--placement cpu), or lower the shares asked")
    open_ = [n for n in needs if n.share <= 0]
    spare = (usable - sum(asked.values())) // max(1, len(open_))
    return {n.stage: n.share if n.share > 0 else _hundredths((asked[n.stage] + spare) / gpu.total) for n in needs}


def _hundredths(x: float) -> float:
    """Rounded down to a hundredth (shares stay within what was added up), at least 0.01."""
    return max(0.01, int(x * 100 + 1e-9) / 100)


def split_threads(cores: int, stages: dict[str, bool], light: int = 0) -> dict[str, int]:
    """Threads of each heavy stage (``stages``: name -> on a GPU), in order, on ``cores`` shared with ``light``
    light stages (module docstring); every stage gets at least 1."""
    if not stages:
        return {}
    left = max(1, cores - min(light, cores // 4))
    out = {s: max(1, min(GPU_STAGE_THREADS, left // len(stages))) for s, gpu in stages.items() if gpu}
    cpu = [s for s, gpu in stages.items() if not gpu]
    rest = max(len(cpu), left - sum(out.values()))
    for i, s in enumerate(cpu):
        out[s] = rest // len(cpu) + (1 if i < rest % len(cpu) else 0)
    return {s: out[s] for s in stages}


def parse_smi(text: str) -> list[Gpu]:
    """``nvidia-smi --query-gpu=index,memory.total,memory.free --format=csv,noheader,nounits`` (MiB) as Gpus."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            out.append(Gpu(int(parts[0]), int(parts[1]) << 20, int(parts[2]) << 20))
    return out


def gpus() -> list[Gpu]:
    """The GPUs nvidia-smi reports on this machine (none without the tool, or when it fails). Asked of the driver,
    not of torch, so the supervisor opens no CUDA context of its own on a GPU its stages share."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return []
    try:
        done = subprocess.run([tool, "--query-gpu=index,memory.total,memory.free", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_smi(done.stdout) if done.returncode == 0 else []
