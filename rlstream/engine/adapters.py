"""LoRA adapters in the transformers engine, by merging: each version's adapter folded into the base's weights.

A version's linear weight is ``W0 + s·B·A`` (``s`` = alpha / rank, or alpha / sqrt(rank) with rsLoRA), which is
what PEFT's forward computes unmerged; merged, the engine's forward costs what the base's does. ``W0`` of every
weight an adapter touched is kept, so the next version's adapter is merged into the base again, never into the
previous version. Only linear-layer adapters are read (what ``--lora-target-modules`` trains); anything else in an
adapter folder is refused.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from rlstream.policy.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS

#: PEFT's prefix on every tensor name of a causal LM's adapter.
_PREFIX = "base_model.model."


def read_adapter(folder: Path) -> tuple[float, dict[str, tuple]]:
    """(the scale, module path -> (A, B)) of the adapter in ``folder``; ValueError when it is not a LoRA adapter of
    linear layers."""
    from safetensors.torch import load_file
    folder = Path(folder)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder}: a {config.get('peft_type')} adapter, not LoRA")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    pairs: dict[str, dict[str, object]] = {}
    for name, tensor in load_file(str(folder / ADAPTER_WEIGHTS)).items():
        path = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
        for part in ("A", "B"):
            suffix = f".lora_{part}.weight"
            if path.endswith(suffix):
                pairs.setdefault(path[:-len(suffix)], {})[part] = tensor
                break
        else:
            raise ValueError(f"{folder}: tensor {name!r} is not a linear layer's LoRA A or B")
    incomplete = [p for p, ab in pairs.items() if set(ab) != {"A", "B"}]
    if incomplete:
        raise ValueError(f"{folder}: LoRA layers without both A and B: {incomplete[:3]}")
    return scale, {p: (ab["A"], ab["B"]) for p, ab in pairs.items()}


class MergedAdapters:
    """The base's weights that adapters touch, kept, and the current version's adapter merged over them."""

    def __init__(self, model):
        self.model = model
        self.base: dict[str, object] = {}  # parameter name -> W0, for every weight an adapter has touched

    def apply(self, folder: Path) -> None:
        import torch
        scale, pairs = read_adapter(folder)
        params = dict(self.model.named_parameters())
        targets = {f"{path}.weight": ab for path, ab in pairs.items()}
        missing = [n for n in targets if n not in params]
        if missing:
            raise ValueError(f"{folder}: the adapter names layers this model does not have: {missing[:3]}")
        with torch.no_grad():
            for name in [n for n in self.base if n not in targets]:  # touched by an earlier version, not this one
                params[name].copy_(self.base.pop(name))
            for name, (a, b) in targets.items():
                p = params[name]
                if name not in self.base:
                    self.base[name] = p.detach().clone()
                # In place on the one fp32 product: the sum is the same fp32 addition as (W0 + s·B·A), bit for
                # bit, without two more whole-layer temporaries (a 1.1 B model's merge is memory traffic).
                merged = torch.mm(b.to(p.device, torch.float32), a.to(p.device, torch.float32))
                if merged.shape != p.shape:
                    raise ValueError(f"{folder}: the adapter of {name} is {tuple(merged.shape)}, the layer "
                                     f"{tuple(p.shape)}")
                p.copy_(merged.mul_(scale).add_(self.base[name]))


class AdaptedModel:
    """A transformers model someone else runs (the teacher's scorer) as ``PolicyWeights`` sees an engine that serves
    LoRA versions: its base's hash (``PolicyWeights.adopt`` sets it), each version's adapter merged over the base
    (``MergedAdapters``), and the load probe on the weights it holds now."""

    name = "transformers"
    serves_adapters = True
    base_hash = ""

    def __init__(self, model):
        self.model, self.version = model, -1
        self._adapters = MergedAdapters(model)

    def load_adapter(self, folder: Path, version: int) -> None:
        self._adapters.apply(folder)
        self.version = version

    @property
    def probe_precise(self) -> bool:
        import torch
        return self.model.dtype == torch.float32

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        import torch
        device = next(self.model.parameters()).device
        seq = torch.tensor([token_ids], dtype=torch.long, device=device)
        with torch.inference_mode():
            logits = self.model(input_ids=seq).logits[0, :-1].float()
        return [float(x) for x in torch.log_softmax(logits, -1).gather(-1, seq[0, 1:, None])[:, 0].cpu()]
