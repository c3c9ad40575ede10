"""Where the optimizer step runs: plain torch, DDP across ranks, or DeepSpeed ZeRO (stage 1/2/3, also on CPU over
gloo).

Every engine takes a step either whole (``step(loss)``) or accumulated over micro-batches (``accumulating(last)``
around each micro-batch's forward and backward, ``backward``, then one ``optimizer_step``). Across ranks the
gradients are averaged (DDP's all-reduce, ZeRO's reduce-scatter), which the caller's loss scale accounts for
(``trainer/microbatch.py``).

Optimizer state: ``state_dict()`` is this rank's (its shard under ZeRO, where ``sharded``); ``load_state_dict(states)``
takes every rank's, in rank order, because ZeRO re-partitions from all of them (rank 0's alone where not sharded).

Learning rate: linear warm-up over the first ``lr_warmup_steps`` optimizer steps (``warmup_lr``), on every engine.
"""
from __future__ import annotations

import contextlib
import os

import torch

from rlstream.models.devices import autocast


def warmup_lr(lr: float, step: int, warmup_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (1-based): ``lr * step / warmup_steps`` until the warm-up ends.

    A fresh Adam's first updates are near sign(gradient) at full size whatever the gradient's scale, which is what
    knocks a small pretrained policy off its start; ramping the rate keeps those first steps small.
    """
    return lr if warmup_steps <= 0 else lr * min(1.0, step / warmup_steps)


def _set_lr(param_groups, lr: float) -> None:
    for group in param_groups:
        group["lr"] = lr


class TorchEngine:
    """AdamW on one process; gradients clipped to a max norm."""

    #: Whether each rank's optimizer state is its own part (ZeRO) rather than the same on every rank.
    sharded = False

    def __init__(self, model, lr: float, max_grad_norm: float, device: torch.device = torch.device("cpu"),
                 autocast_mode: str = "off", lr_warmup_steps: int = 0):
        self.device = device
        self.model = model.to(device)
        self.autocast_mode = autocast_mode
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
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
        _set_lr(self.optimizer.param_groups, warmup_lr(self.lr, self.steps, self.lr_warmup_steps))
        self.optimizer.step()
        return float(norm)

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, states: list[dict]) -> None:
        # Every rank's plain AdamW state is the same (its gradients were averaged): rank 0's serves any world size.
        self.optimizer.load_state_dict(states[0])
        # The warm-up goes on from the steps the restored Adam state has taken (each parameter counts its own).
        self.steps = max((int(st["step"]) for st in self.optimizer.state.values() if "step" in st), default=0)

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


class DeepSpeedEngine:
    """DeepSpeed ZeRO: optimizer state (stage 1), gradients (stage 2) and parameters (stage 3) sharded across ranks.

    ZeRO 1/2 keep full parameters on every rank, so ``model`` saves as a normal checkpoint; ZeRO-3's are gathered to
    rank 0 for it (``full_state_dict``).
    """

    sharded = True

    def __init__(self, model, lr: float, max_grad_norm: float, stage: int, device: torch.device = torch.device("cpu"),
                 autocast_mode: str = "off", lr_warmup_steps: int = 0):
        # A single process is a world of one; the rank launcher (trainer/distributed.py) sets these for more.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        if device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        self.device = device
        self.stage = stage
        self.autocast_mode = autocast_mode
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": max_grad_norm,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}},
        }
        deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else "nccl")
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        self.model = self.engine.module
        # Counted from this process's start: a resumed ZeRO run warms up again (its Adam moments are restored).
        self.lr, self.lr_warmup_steps, self.steps = lr, lr_warmup_steps, 0

    def forward(self, **inputs):
        with autocast(self.device, self.autocast_mode):
            return self.engine(**inputs)

    def step(self, loss) -> float:
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.backward(loss)
        return self.optimizer_step()

    def zero_grad(self) -> None:
        pass  # DeepSpeed zeroes the gradients in its step

    def accumulating(self, last: bool):
        # Only the boundary micro-batch reduces the gradients; the step after it applies them once.
        self.engine.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def backward(self, loss) -> None:
        # The caller scales each micro-batch's loss by its share of the step (microbatch.py), not by a fixed count.
        self.engine.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self) -> float:
        self.engine.set_gradient_accumulation_boundary(True)
        self.steps += 1
        _set_lr(self.engine.optimizer.param_groups, warmup_lr(self.lr, self.steps, self.lr_warmup_steps))
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def state_dict(self) -> dict:
        import deepspeed
        # This rank's partition; ZeRO's loader asks for the version that wrote it.
        return {**self.engine.optimizer.state_dict(), "ds_version": deepspeed.__version__}

    def load_state_dict(self, states: list[dict]) -> None:
        # ZeRO merges the saved partitions and takes its own: every rank gets them all.
        self.engine.optimizer.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)

    def full_state_dict(self):
        if self.stage < 3:
            return None
        import deepspeed
        # Collective: every rank takes part, rank 0 keeps the gathered copy.
        params = list(self.model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if int(os.environ.get("RANK", "0")) == 0:
                return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        return None


def make_engine(model, lr: float, max_grad_norm: float = 1.0, deepspeed_stage: int = 0,
                device: torch.device = torch.device("cpu"), autocast_mode: str = "off", world_size: int = 1,
                lr_warmup_steps: int = 0):
    """Torch when deepspeed_stage is 0 (DDP across several ranks), else DeepSpeed ZeRO at that stage."""
    if deepspeed_stage not in (0, 1, 2, 3):
        raise ValueError("--deepspeed-stage must be 0 (plain torch, DDP across ranks), 1, 2 or 3")
    if deepspeed_stage:
        return DeepSpeedEngine(model, lr, max_grad_norm, deepspeed_stage, device, autocast_mode, lr_warmup_steps)
    if world_size > 1:
        return DDPEngine(model, lr, max_grad_norm, device, autocast_mode, lr_warmup_steps)
    return TorchEngine(model, lr, max_grad_norm, device, autocast_mode, lr_warmup_steps)
