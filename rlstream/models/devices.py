"""Where a process computes: the device chosen per process, bf16 autocast, gradient checkpointing.

In ``models/`` because the trainer, the rollout's transformers backend and the teacher all place a model; each
process resolves its own ``--device`` (CUDA when present, the CPU otherwise). The same calls run on the CPU, so
the tests exercise every path the GPU takes, bar the kernels.
"""
from __future__ import annotations

import contextlib
import os

import torch

from rlstream.errors import UsageError

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
        spec = "cuda" if torch.cuda.is_available() else "cpu"
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
