"""The engine ``--sharding`` names: plain torch on one rank, DDP across ranks (``trainer/engine.py``), or DeepSpeed
ZeRO and FSDP2 (``trainer/sharded.py``, imported only when asked for: DeepSpeed is slow to import). Above both
modules, so neither imports the other's factory.
"""
from __future__ import annotations

from pathlib import Path

import torch

from rlstream.trainer.engine import DDPEngine, TorchEngine

#: ``--sharding``: none is plain torch (DDP across ranks); zero1/2/3 DeepSpeed ZeRO at that stage; fsdp2 torch's
#: fully_shard (parameters, gradients and optimizer state sharded, like ZeRO-3).
SHARDING = ("none", "zero1", "zero2", "zero3", "fsdp2")


def make_engine(model, lr: float, max_grad_norm: float = 1.0, sharding: str = "none",
                device: torch.device = torch.device("cpu"), autocast_mode: str = "off", world_size: int = 1,
                lr_warmup_steps: int = 0, weights: Path | None = None):
    """The engine ``sharding`` names (``SHARDING``); none is DDP across several ranks, plain torch on one. A model on
    the meta device (``trainer/meta.py``) is FSDP2's alone: each rank fills its shard from ``weights``' files."""
    if sharding not in SHARDING:
        raise ValueError(f"--sharding {sharding!r}: expected one of {', '.join(SHARDING)}")
    if sharding != "fsdp2" and any(p.is_meta for p in model.parameters()):
        raise ValueError(f"--sharding {sharding}: a model on the meta device is built for --sharding fsdp2 only")
    if sharding.startswith("zero"):
        from rlstream.trainer.sharded import DeepSpeedEngine
        return DeepSpeedEngine(model, lr, max_grad_norm, int(sharding[-1]), device, autocast_mode, lr_warmup_steps)
    if sharding == "fsdp2":
        from rlstream.trainer.sharded import FSDP2Engine
        return FSDP2Engine(model, lr, max_grad_norm, device, autocast_mode, lr_warmup_steps, weights)
    if world_size > 1:
        return DDPEngine(model, lr, max_grad_norm, device, autocast_mode, lr_warmup_steps)
    return TorchEngine(model, lr, max_grad_norm, device, autocast_mode, lr_warmup_steps)
