"""Where the optimizer step runs: plain torch on one rank, DDP across ranks, or an engine that shards state across
ranks (``--sharding zero1|zero2|zero3|fsdp2``: ``trainer/sharded.py``); ``trainer/sharding.py`` makes the one
``--sharding`` names.

Every engine takes a step either whole (``step(loss)``) or accumulated over micro-batches (``accumulating(last)``
around each micro-batch's forward and backward, ``backward``, then one ``optimizer_step``). Across ranks the
gradients are averaged (DDP's all-reduce, ZeRO's and FSDP2's reduce-scatter), which the caller's loss scale accounts
for (``trainer/microbatch.py``).

Training state: ``checkpoint_state()`` is what this rank writes into a version's DCP checkpoint (its shard, where
``sharded``), ``load_checkpoint(load, manifest)`` reads this rank's part back through ``load(template)``
(``trainer/shards.py``: which engine reshards to another number of ranks).

Learning rate: linear warm-up over the first ``lr_warmup_steps`` optimizer steps (``warmup_lr``), on every engine.
"""
from __future__ import annotations

import contextlib

import torch

from rlstream.models.devices import autocast


def warmup_lr(lr: float, step: int, warmup_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (1-based): ``lr * step / warmup_steps`` until the warm-up ends.

    A fresh Adam's first updates are near sign(gradient) at full size whatever the gradient's scale, which is what
    knocks a small pretrained policy off its start; ramping the rate keeps those first steps small.
    """
    return lr if warmup_steps <= 0 else lr * min(1.0, step / warmup_steps)


def adam_steps(optimizer) -> int:
    """Steps a restored Adam state has taken (each parameter counts its own): where a resumed warm-up goes on from."""
    return max((int(st["step"]) for st in optimizer.state.values() if "step" in st), default=0)


def set_lr(param_groups, lr: float) -> None:
    for group in param_groups:
        group["lr"] = lr


class TorchEngine:
    """AdamW on one process; gradients clipped to a max norm."""

    #: Whether each rank's optimizer state is its own part (ZeRO) rather than the same on every rank.
    sharded = False
    #: Whether a publish gathers the whole weights a parameter at a time into the version's file (``trainer/meta.py``:
    #: ``stream_full``) rather than taking them whole from ``full_state_dict``.
    streams = False

    def __init__(self, model, lr: float, max_grad_norm: float, device: torch.device = torch.device("cpu"),
                 autocast_mode: str = "off", lr_warmup_steps: int = 0):
        self.device = device
        self.model = model.to(device)
        self.autocast_mode = autocast_mode
        # The parameters that train (all of them, or a LoRA adapter's: the frozen base gets no optimizer state).
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr,
                                           weight_decay=0.0)
        self.max_grad_norm = max_grad_norm
        self.lr, self.lr_warmup_steps, self.steps = lr, lr_warmup_steps, 0

    def _module(self):
        """What the forward runs through (a DDP wrapper on several ranks)."""
        return self.model

    def forward(self, **inputs):
        with autocast(self.device, self.autocast_mode):
            return self._module()(**inputs)

    def step(self, loss) -> float:
        """Backward and one optimizer step; returns the gradient norm before clipping."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return self.optimizer_step()

    # -- accumulated over micro-batches ----------------------------------------------------------

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def accumulating(self, last: bool):
        """Context of one micro-batch's forward and backward; gradients are synchronised on the ``last``."""
        return contextlib.nullcontext()

    def backward(self, loss) -> None:
        loss.backward()

    def optimizer_step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.steps += 1
        set_lr(self.optimizer.param_groups, warmup_lr(self.lr, self.steps, self.lr_warmup_steps))
        self.optimizer.step()
        return float(norm)

    # -- checkpoints -----------------------------------------------------------------------------

    def checkpoint_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        # Keyed by parameter name, so any number of ranks reads it back. A fresh AdamW has nothing to write (and
        # get_optimizer_state_dict would make it take a zero step, counted as Adam's first).
        return {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)} if self.optimizer.state else {}

    def load_checkpoint(self, load, manifest: dict) -> None:
        if not manifest["optimizer"]:
            return  # written before the first step: Adam starts as it was
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        # The template DCP reads into (every rank reads the whole state: it is the same on each).
        state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
        load(state)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.steps = adam_steps(self.optimizer)

    def full_state_dict(self):
        """The whole model's parameters, on rank 0, for the checkpoint; None: ``model`` holds them already."""
        return None


class DDPEngine(TorchEngine):
    """Data parallel over torch.distributed: full parameters and optimizer on every rank, gradients all-reduced."""

    def __init__(self, model, lr: float, max_grad_norm: float, device: torch.device = torch.device("cpu"),
                 autocast_mode: str = "off", lr_warmup_steps: int = 0):
        from torch.nn.parallel import DistributedDataParallel
        model = model.to(device)
        # Construction broadcasts rank 0's parameters: every rank starts from the policy rank 0 loaded.
        self.ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        super().__init__(model, lr, max_grad_norm, device, autocast_mode, lr_warmup_steps)

    def _module(self):
        return self.ddp

    def accumulating(self, last: bool):
        # All-reduce once per step, in the last micro-batch's backward, not after each one.
        return contextlib.nullcontext() if last else self.ddp.no_sync()
