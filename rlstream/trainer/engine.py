"""Where the optimizer step runs: plain torch, or DeepSpeed ZeRO (stage 1/2, also on CPU over gloo)."""
from __future__ import annotations

import os

import torch


class TorchEngine:
    """AdamW on one process; gradients clipped to a max norm."""

    def __init__(self, model, lr: float, max_grad_norm: float):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        self.max_grad_norm = max_grad_norm

    def forward(self, **inputs):
        return self.model(**inputs)

    def step(self, loss) -> float:
        """Backward and one optimizer step; returns the gradient norm before clipping."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return float(norm)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


class DeepSpeedEngine:
    """DeepSpeed ZeRO: optimizer state (stage 1) and gradients (stage 2) sharded across ranks.

    ZeRO 1/2 keep full parameters on every rank, so ``model`` saves as a normal checkpoint.
    """

    def __init__(self, model, lr: float, max_grad_norm: float, stage: int):
        # A single process is a world of one; launchers (deepspeed, torchrun) set these for more ranks.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": max_grad_norm,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}},
        }
        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        self.model = self.engine.module

    def forward(self, **inputs):
        return self.engine(**inputs)

    def step(self, loss) -> float:
        self.engine.backward(loss)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def state_dict(self) -> dict:
        # ZeRO shards optimizer state; resuming it takes engine.save_checkpoint, which is per rank.
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def make_engine(model, lr: float, max_grad_norm: float = 1.0, deepspeed_stage: int = 0):
    """Torch when deepspeed_stage is 0, else DeepSpeed ZeRO at that stage."""
    if deepspeed_stage == 0:
        return TorchEngine(model, lr, max_grad_norm)
    if deepspeed_stage not in (1, 2):
        raise ValueError("--deepspeed-stage must be 0 (plain torch), 1 or 2")
    return DeepSpeedEngine(model, lr, max_grad_norm, deepspeed_stage)
