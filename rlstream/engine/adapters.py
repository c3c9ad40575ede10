"""LoRA adapters in engines that load them themselves: by merging, each version's adapter folded into the base's
weights, served at the base's speed (the transformers engine, in place: ``MergedAdapters``; in-process vLLM without
LoRA slots, as tensors it loads in place: ``MergedTensors``); or unmerged, PEFT's layers in the transformers model
(``AdapterLayers``: a version's load is its adapter's tensors alone).

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


def scaled_product(folder: Path, name: str, a, b, scale: float, shape, device=None):
    """``s·B·A`` of one layer in float32 on ``device``, ValueError unless it is the layer's ``shape``. Scaled in place
    on the one product, so that adding ``W0`` to it is the same fp32 sum as ``W0 + s·B·A``, bit for bit, without
    two more whole-layer temporaries (a 1.1 B model's merge is memory traffic)."""
    import torch
    product = torch.mm(b.to(device=device, dtype=torch.float32), a.to(device=device, dtype=torch.float32))
    if product.shape != shape:
        raise ValueError(f"{folder}: the adapter of {name} is {tuple(product.shape)}, the layer {tuple(shape)}")
    return product.mul_(scale)


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
                p.copy_(scaled_product(folder, name, a, b, scale, p.shape, p.device).add_(self.base[name]))


class AdapterLayers:
    """LoRA versions served unmerged by a transformers model (``--lora-serving adapter``): PEFT's LoRA layers injected
    once, from the first version's adapter config, and each version's A and B copied into them. A load moves the adapter's tensors alone (no merge, which at 1 B parameters is
    seconds of memory traffic on a CPU), and every forward pays the adapter's two small products per layer. Every
    version of a run has its first version's shape (rank, alpha, targets: the trainer's one LoraConfig); one that
    does not is refused."""

    def __init__(self, model):
        self.model = model
        self.shape: tuple | None = None  # (rank, alpha, rsLoRA, targets) of the injected layers
        self.params: dict[str, object] = {}  # the adapter's tensor name -> the injected layer's parameter

    def apply(self, folder: Path) -> None:
        import torch
        _, pairs = read_adapter(folder)  # refuses what is not a LoRA adapter of linear layers
        from peft import LoraConfig
        config = LoraConfig.from_pretrained(str(folder))
        shape = (config.r, config.lora_alpha, config.use_rslora, tuple(sorted(pairs)))
        if self.shape is None:
            self._inject(folder, config, pairs)
            self.shape = shape
        elif shape != self.shape:
            raise ValueError(f"{folder}: an adapter of rank {config.r}, alpha {config.lora_alpha} over "
                             f"{len(pairs)} layers, where this engine's layers were made for rank {self.shape[0]}, "
                             f"alpha {self.shape[1]} over {len(self.shape[3])}: one run's versions share one shape")
        # Straight into the parameters found once: PEFT's set_peft_model_state_dict remaps every name and loads the
        # whole model's state dict, 0.1 s of a 135 M model's 0.2 s load here.
        with torch.no_grad():
            for path, ab in pairs.items():
                for part, tensor in zip("AB", ab):
                    self.params[f"{path}.lora_{part}.weight"].copy_(tensor)

    def _inject(self, folder: Path, config, pairs: dict) -> None:
        from peft import inject_adapter_in_model
        inject_adapter_in_model(config, self.model)
        self.model.eval()  # the injected layers are built in training mode: their dropout would sample
        modules = dict(self.model.named_modules())
        for path in pairs:
            layer = modules.get(path)
            if layer is None or not hasattr(layer, "lora_A") or "default" not in layer.lora_A:
                raise ValueError(f"{folder}: PEFT made no LoRA layer for {path} in this engine's model")
            self.params[f"{path}.lora_A.weight"] = layer.lora_A["default"].weight
            self.params[f"{path}.lora_B.weight"] = layer.lora_B["default"].weight


class MergedTensors:
    """A LoRA version as tensors for an engine that loads weights in place (vLLM in process without LoRA slots): every
    tensor of every module the adapter touches (or the one before it touched), its linear weights ``W0 + s·B·A`` in
    float32 (the engine casts them to its dtype), the rest as the base has them. Whole modules, because an engine
    may fuse a module's layers (vLLM's ``qkv_proj`` holds q, k and v, and their biases) and must not be left with a
    fused layer loaded in part. ``W0`` is read from the base's safetensors at each version (the page cache keeps
    them), so the base is not held twice in memory."""

    def __init__(self, base_folder: Path):
        from safetensors import safe_open
        self.files: dict[str, str] = {}  # tensor name -> the safetensors file holding it
        for shard in sorted(Path(base_folder).glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as f:
                self.files.update(dict.fromkeys(f.keys(), str(shard)))
        if not self.files:
            raise ValueError(f"{base_folder}: no safetensors weights to merge adapters into")
        self.held: set[str] = set()  # modules whose tensors the engine holds merged now

    def tensors(self, folder: Path) -> dict:
        """Name -> tensor of the version whose adapter is in ``folder``: to load into the engine."""
        import torch
        from safetensors import safe_open
        scale, pairs = read_adapter(folder)
        missing = [p for p in pairs if f"{p}.weight" not in self.files]
        if missing:
            raise ValueError(f"{folder}: the adapter names layers this model does not have: {missing[:3]}")
        modules = {p.rsplit(".", 1)[0] for p in pairs}
        loaded = modules | self.held
        wanted = [n for n in self.files if n.rsplit(".", 2)[0] in loaded]
        out = {}
        for shard in sorted({self.files[n] for n in wanted}):
            with safe_open(shard, framework="pt") as f:
                out.update({n: f.get_tensor(n) for n in wanted if self.files[n] == shard})
        for path, (a, b) in pairs.items():
            w0 = out[f"{path}.weight"]
            out[f"{path}.weight"] = scaled_product(folder, path, a, b, scale, w0.shape).add_(w0.to(torch.float32))
        self.held = modules
        return out


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
