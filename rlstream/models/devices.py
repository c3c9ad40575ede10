"""Where a process computes: the device chosen per process, bf16 autocast, gradient checkpointing.

In ``models/`` because the trainer, the rollout's transformers backend and the teacher all place a model; each
process resolves its own ``--device`` (CUDA when present, the CPU otherwise). The same calls run on the CPU, so
the tests exercise every path the GPU takes, bar the kernels.

``--device auto`` on a machine whose ``nvidia-smi`` lists GPUs that torch cannot use (a CPU build of torch, a driver
too old for its CUDA) is an error, not a silent CPU run (``auto_device``). ``--threads 0`` follows the machine
(``resolve_threads``). Not run on a GPU here: every decision is a pure function of what it is told, unit-tested on
the CPU; the probes that feed them (``nvidia_smi_gpus``, ``torch.cuda``) have not met a real GPU in this project's
tests.
"""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess

import torch

from rlstream.errors import UsageError
from rlstream.models.resources import cpu_cores

#: ``--device`` values besides ``cuda:N``.
DEVICES = ("auto", "cpu", "cuda")
#: ``--autocast`` values.
AUTOCASTS = ("off", "bf16")


def resolve_device(spec: str = "auto", local_rank: int | None = None) -> torch.device:
    """``auto``: this rank's CUDA device when CUDA is present, else the CPU; ``cuda`` is ``cuda:<local rank>``.

    A CUDA device that is not there is a usage error naming how many there are, not a crash at the first tensor.
    """
    spec = (spec or "auto").strip().lower()
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if spec == "auto":
        spec = auto_device(torch.cuda.is_available(), nvidia_smi_gpus, torch.__version__, torch.version.cuda)
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = local_rank if spec == "cuda" else _index(spec)
        if index >= count:
            raise UsageError(f"--device {spec}: this machine has {count} CUDA device(s)"
                             + (f" (rank {local_rank} wants cuda:{index})" if spec == "cuda" else "")
                             + "; use --device cpu, or fewer ranks")
        return torch.device("cuda", index)
    raise UsageError(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N")


def auto_device(cuda_available: bool, smi_gpus, torch_version: str = "", torch_cuda: str | None = None) -> str:
    """What ``--device auto`` is: ``cuda`` when torch sees CUDA, else ``cpu``, unless ``nvidia-smi`` lists GPUs
    (``smi_gpus``: a count, or a callable asked only then) that torch cannot use: training a model on the CPU of a
    GPU machine is hours lost without a word, so that stops with what to do instead."""
    if cuda_available:
        return "cuda"
    count = smi_gpus() if callable(smi_gpus) else smi_gpus
    if count:
        built = f"built for CUDA {torch_cuda}" if torch_cuda else "a CPU-only build"
        raise UsageError(f"--device auto: nvidia-smi sees {count} GPU(s) but torch {torch_version} ({built}) cannot "
                         "use them (torch.cuda.is_available() is false): install a torch build for this driver's CUDA "
                         "(the GPU profile of the install), or pass --device cpu to run on the CPU on purpose")
    return "cpu"


@functools.lru_cache(maxsize=1)
def nvidia_smi_gpus() -> int:
    """GPUs ``nvidia-smi -L`` lists (0 without the tool, or when it fails: no driver, no GPU)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return 0
    try:
        out = subprocess.run([tool, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")) if out.returncode == 0 else 0


def resolve_threads(threads: int, share: int = 1, omp: str | None = None, cores: int | None = None) -> int:
    """Torch threads for ``--threads``: as given when positive; 0 (auto) is ``OMP_NUM_THREADS`` when set (what a
    supervisor that placed this process gave it: ``infra/placement.py``), else this process's cores; either divided
    among ``share`` processes (a trainer's ranks), at least 1."""
    if threads > 0:
        return threads
    omp = os.environ.get("OMP_NUM_THREADS") if omp is None else omp
    if omp and omp.strip().isdigit() and int(omp) > 0:
        return max(1, int(omp) // max(1, share))
    return max(1, (cpu_cores() if cores is None else cores) // max(1, share))


def check_vllm_device(device: str) -> None:
    """In-process vLLM runs on the first GPU its process sees (it has no device index of its own, and the CUDA
    runtime reads CUDA_VISIBLE_DEVICES once): ``cuda:N`` past 0 is refused with how to place it."""
    spec = (device or "auto").strip().lower()
    if spec.startswith("cuda:") and spec != "cuda:0":
        raise UsageError(f"--device {spec}: in-process vLLM takes the first GPU this process sees; start the "
                         f"process with CUDA_VISIBLE_DEVICES={spec.split(':', 1)[1]} and --device cuda (the demo's "
                         "placement does this)")


#: /proc/cpuinfo flags of a CPU that multiplies bf16 in hardware: x86's AVX512-BF16 and AMX-BF16, Arm's BF16.
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bf16 instructions (``cpuinfo``: /proc/cpuinfo's text, read when not given; False where
    there is none to read). Without them torch emulates bf16 matmuls, slower than float32, so bf16 autocast on such
    a CPU costs time instead of saving it."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        # x86 lists them as "flags", Arm as "Features"; every core repeats the line, the first one says it.
        if key.strip() in ("flags", "Features"):
            return not CPU_BF16_FLAGS.isdisjoint(value.split())
    return False


def _index(spec: str) -> int:
    try:
        return int(spec.split(":", 1)[1])
    except ValueError:
        raise UsageError(f"--device {spec!r}: expected cuda:N with N a device index") from None


def autocast(device: torch.device, mode: str = "off"):
    """The forward's autocast context: bf16 matmuls on CPU or CUDA, parameters and log-probs stay as they are
    (the log-probs are taken in float32 from the logits, ``models/logprobs.py``). ``off``: no context at all, so
    the default path is the plain forward."""
    if mode == "off":
        return contextlib.nullcontext()
    if mode != "bf16":
        raise UsageError(f"--autocast {mode!r}: expected one of {', '.join(AUTOCASTS)}")
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def enable_gradient_checkpointing(model) -> None:
    """Recompute activations in the backward instead of keeping them (transformers models).

    Non-reentrant checkpointing: it needs no input that requires grad and works under autocast. The KV cache is
    off while training (transformers refuses the two together).
    """
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise UsageError(f"--gradient-checkpointing: {type(model).__name__} does not support it")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
