"""What a model costs in GPU memory, estimated from its shape (the trainer's state and activations per token, an
in-process engine's weights and cache), and the cores and memory this process has. The trainer's default
micro-batch budget (``trainer/microbatch.py``) and the demo's placement (``infra/placement.py``) are sized from
these, so both read one set of figures. Torch-free: the demo places its stages before any of them loads a model.

Estimates, not measurements: the layer term is Korthikanti et al.'s 34·h bytes per token per layer of 16-bit
activations (attention through SDPA or flash-attention, so no sequence² term), the head term what the loss keeps
per token (``models/logprobs.py``: the bf16 logits, their float32 log-softmax per chunk, and the logits' gradient in
the backward). None of them has been checked against a real GPU's allocator in this project (no GPU here): they err
large, and the callers keep a margin on top.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30

#: AdamW on fp32 master weights: the weights, their gradients, and the two moments, 4 bytes each.
TRAIN_STATE_BYTES_PER_PARAM = 16
#: Bytes the loss keeps per token per vocabulary entry: bf16 logits (2), float32 log-softmax (4), the gradient of
#: the logits in float32 and bf16 in the backward (6).
HEAD_BYTES_PER_VOCAB = 12
#: Bytes per token per layer per hidden unit of 16-bit activations (Korthikanti et al. 2022, without the s² term).
LAYER_BYTES_PER_HIDDEN = 34
#: An in-process engine's floor beyond its weights: a KV cache for a few sequences, CUDA graphs, the sampler.
ENGINE_FLOOR_BYTES = GIB


@dataclass(frozen=True)
class ModelShape:
    """What the estimates need of a model: parameters, hidden size, layers, vocabulary."""

    params: int
    hidden: int
    layers: int
    vocab: int

    @classmethod
    def of_config(cls, config: dict, params: int | None = None) -> "ModelShape":
        """From a Hugging Face config (a multimodal one's text part); ``params`` from the weights when known, else
        estimated from the shape (12·h² a layer plus the embeddings)."""
        config = config.get("text_config", config)
        hidden = int(config.get("hidden_size") or config.get("n_embd") or config.get("d_model") or 0)
        layers = int(config.get("num_hidden_layers") or config.get("n_layer") or config.get("num_layers") or 0)
        vocab = int(config.get("vocab_size") or 0)
        if not (hidden and layers and vocab):
            raise ValueError("the model's config names no hidden_size, num_hidden_layers or vocab_size")
        if params is None:
            params = 12 * hidden * hidden * layers + vocab * hidden
        return cls(int(params), hidden, layers, vocab)

    @classmethod
    def of_model(cls, model) -> "ModelShape":
        """From a loaded transformers model."""
        config = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(model.config)
        return cls.of_config(config, sum(p.numel() for p in model.parameters()))

    @classmethod
    def of_folder(cls, folder: Path, params: int | None = None) -> "ModelShape":
        return cls.of_config(json.loads((Path(folder) / "config.json").read_text()), params)


def activation_bytes_per_token(shape: ModelShape, dtype_bytes: int = 2, checkpointing: bool = False) -> int:
    """Activation memory one training token keeps until its backward: every layer's (one layer's and each layer's
    input under gradient checkpointing), in ``dtype_bytes`` (2 under bf16 autocast, 4 in float32), plus the head's."""
    layer = LAYER_BYTES_PER_HIDDEN * shape.hidden * dtype_bytes // 2
    layers = (layer + 2 * shape.hidden * dtype_bytes * shape.layers) if checkpointing else layer * shape.layers
    return layers + HEAD_BYTES_PER_VOCAB * shape.vocab


def trainer_state_bytes(shape: ModelShape, world: int = 1, sharded: bool = False) -> int:
    """Weights, gradients and AdamW moments (fp32) on one rank; a sharded engine (ZeRO-3, FSDP2) splits them."""
    return TRAIN_STATE_BYTES_PER_PARAM * shape.params // (world if sharded else 1)


def trainer_bytes(shape: ModelShape, tokens: int, dtype_bytes: int = 2, checkpointing: bool = False) -> int:
    """A trainer's need for one micro-batch of ``tokens``: its state and those tokens' activations."""
    return trainer_state_bytes(shape) + tokens * activation_bytes_per_token(shape, dtype_bytes, checkpointing)


def engine_bytes(shape: ModelShape, dtype_bytes: int = 2) -> int:
    """An inference engine's least: its weights (``dtype_bytes`` each) and a floor of cache and graphs."""
    return shape.params * dtype_bytes + ENGINE_FLOOR_BYTES


def gib(n: float) -> str:
    """Bytes as GiB for a message."""
    return f"{n / GIB:.1f} GiB"


def cpu_cores() -> int:
    """The cores this process may run on (its affinity, which a container or taskset narrows), not the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def available_memory() -> int:
    """Bytes this process could still allocate: the host's available memory (psutil), within the room its cgroup's
    limit leaves (a container's ``--memory``; psutil reports the host's figure inside a container)."""
    import psutil  # imported here: the demo's placement reads this module before anything heavy loads

    available = psutil.virtual_memory().available
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):  # no cgroup v2 here, or not Linux
        pass
    return max(0, available)


def peak_rss() -> int:
    """This process's peak RSS in bytes: the kernel's high-water mark of its memory (``VmHWM``). Not ``getrusage``:
    Linux carries ``ru_maxrss`` across ``execve``, so a spawned child reports at least its parent's RSS at the fork
    (a rank of a 3.7 GB pytest worker "peaked" at 3.7 GB having held 0.8)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")
