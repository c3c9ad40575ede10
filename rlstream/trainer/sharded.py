"""Engines that shard training state across the ranks: DeepSpeed ZeRO (stage 1: optimizer state; 2: and gradients;
3: and parameters) and torch's FSDP2 (``fully_shard``: parameters, gradients and optimizer state, as DTensors).

Both run on the CPU over gloo as on GPUs over NCCL, and on a single process as a world of one. Under ZeRO-3 and
FSDP2 every forward and backward is a collective (parameters are gathered per layer), so every rank must run as
many micro-batches as the others (``trainer/microbatch.py`` pads with zero-weight passes).

Checkpoints: each rank writes its own shard of the training state (``checkpoint_state``, through DCP:
``trainer/shards.py``, which says which engine reshards); the full parameters that workers load are gathered to
rank 0 (``full_state_dict``, a collective).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from rlstream.models.devices import autocast
from rlstream.trainer.distributed import free_port, warn_of_a_left_lock
from rlstream.trainer.engine import TorchEngine, adam_steps, set_lr, warmup_lr


def deepspeed_config(stage: int, lr: float, max_grad_norm: float, autocast_mode: str = "off") -> dict:
    """The DeepSpeed config of ZeRO at ``stage``. Under bf16 autocast it has a ``bf16`` block: DeepSpeed then runs
    the module in bf16 and keeps the fp32 master weights in ZeRO's optimizer partitions (what it saves and resumes
    from, ``load_from_fp32_weights``), the trainer's fp32-master default on CUDA (``trainer/precision.py``)."""
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}},
    }
    if autocast_mode == "bf16":
        config["bf16"] = {"enabled": True}
    return config


class DeepSpeedEngine:
    """DeepSpeed ZeRO: optimizer state (stage 1), gradients (stage 2) and parameters (stage 3) sharded across ranks.

    ZeRO 1/2 keep full parameters on every rank, so ``model`` saves as a normal checkpoint; ZeRO-3's are gathered a
    parameter at a time into the version's file (``streams``: ``trainer/meta.py``), or all to rank 0 where the
    weights log needs the version in memory (``full_state_dict``).
    """

    sharded = True

    def __init__(self, model, lr: float, max_grad_norm: float, stage: int, device: torch.device = torch.device("cpu"),
                 autocast_mode: str = "off", lr_warmup_steps: int = 0):
        # A single process is a world of one; the rank launcher (trainer/distributed.py) sets these for more.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # never a fixed port: two trainers on one machine would meet on it
            os.environ["MASTER_PORT"] = str(free_port())
        if device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            warn_of_a_left_lock()
        import deepspeed
        self.device = device
        self.stage = stage
        # ZeRO-3 publishes a parameter at a time (trainer/meta.py: stream_full); 1 and 2 hold the whole model anyway.
        self.streams = stage == 3
        self.autocast_mode = autocast_mode
        config = deepspeed_config(stage, lr, max_grad_norm, autocast_mode)
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
        set_lr(self.engine.optimizer.param_groups, warmup_lr(self.lr, self.steps, self.lr_warmup_steps))
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def checkpoint_state(self) -> dict:
        import deepspeed

        # This rank's partition under its own key, whole (DeepSpeed's own structure, loss scaler and all): DCP writes
        # it into this rank's file, and only this rank reads it back.
        rank = torch.distributed.get_rank()
        return {f"zero_rank{rank}": _Opaque({**self.engine.optimizer.state_dict(), "ds_version": deepspeed.__version__})}

    def load_checkpoint(self, load, manifest: dict) -> None:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        state = {f"zero_rank{rank}": _Opaque(None)}
        load(state)
        # At the same number of ranks (trainer/shards.py refuses another) ZeRO's loader reads the current rank's
        # entry alone, fp32 master partition included.
        mine = [None] * world
        mine[rank] = state[f"zero_rank{rank}"].value
        self.engine.optimizer.load_state_dict(mine, load_optimizer_states=True, load_from_fp32_weights=True)

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


class FSDP2Engine(TorchEngine):
    """torch's FSDP2: each of the model's blocks (its ``_no_split_modules``: decoder layers) and then the whole model
    are ``fully_shard``-ed over one mesh of every rank; AdamW steps on the local shards."""

    sharded = True
    streams = True

    def __init__(self, model, lr: float, max_grad_norm: float, device: torch.device = torch.device("cpu"),
                 autocast_mode: str = "off", lr_warmup_steps: int = 0, weights: Path | None = None):
        """``model`` on the meta device (``trainer/meta.py``: ``empty_model``) is sharded first and each rank then
        fills only its shard from ``weights``, a version's folder: no rank ever holds the whole model."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from rlstream.trainer import meta
        if not dist.is_initialized():  # a single process: a world of one (the launcher sets up more)
            from rlstream.trainer.distributed import free_port
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                                    init_method=f"tcp://127.0.0.1:{free_port()}")
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        if meta.is_meta(model):
            if weights is None:
                raise ValueError("FSDP2 on a model on the meta device needs the folder its weights are read from")
            meta.shard_blocks(model, mesh)
            meta.materialize(model, device)
            meta.fill_from_folder(model, weights)  # every rank reads the same files: the same weights everywhere
        else:
            model = model.to(device)
            # Every rank starts from rank 0's weights (its warm-up, or the checkpoint it named), as DDP's and ZeRO's
            # construction make sure: fully_shard keeps each rank's own shard of whatever that rank holds.
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
            meta.shard_blocks(model, mesh)
        self.device, self.model, self.autocast_mode = device, model, autocast_mode
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        self.max_grad_norm = max_grad_norm
        self.lr, self.lr_warmup_steps, self.steps = lr, lr_warmup_steps, 0

    def accumulating(self, last: bool):
        # Gradients reduce-scatter once per step, in the last micro-batch's backward (the others accumulate).
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def optimizer_step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.steps += 1
        set_lr(self.optimizer.param_groups, warmup_lr(self.lr, self.steps, self.lr_warmup_steps))
        self.optimizer.step()
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def checkpoint_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        # This rank's DTensor shards, keyed by parameter name: DCP writes each rank's pieces and reshards on load.
        # The model's too: its fp32 shards are the master, whatever dtype the version was published in.
        state = {"model": get_model_state_dict(self.model)}
        if self.optimizer.state:  # a fresh AdamW has none (and would take a zero step to make one)
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        return state

    def load_checkpoint(self, load, manifest: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        state = {"model": get_model_state_dict(self.model)}
        if manifest["optimizer"]:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        load(state)  # into this rank's shards, for the current world
        set_model_state_dict(self.model, state["model"])
        if manifest["optimizer"]:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
            self.steps = adam_steps(self.optimizer)

    def full_state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Collective: every rank takes part; with the CPU offload only rank 0 keeps the gathered copy.
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return full if int(os.environ.get("RANK", "0")) == 0 else None


class _Opaque:
    """A value DCP writes as one object (pickled whole into the writing rank's file) instead of walking into it."""

    def __init__(self, value):
        self.value = value
