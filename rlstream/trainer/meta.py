"""Never the whole model on one device: FSDP2 models built on the meta device, each rank filling only its shard, and
the consolidated weights published tensor by tensor.

- ``empty_model``: the model's parameters on the meta device (no memory), its buffers computed on the CPU as usual
  (rotary frequencies and the like are small, and a meta buffer could not be recomputed after sharding).
- ``shard_blocks``: FSDP2's ``fully_shard`` on each decoder block and then the whole model; on meta parameters it
  only records each rank's shard (DTensors on meta).
- ``materialize``: only this rank's shards get memory (``to_empty``), the buffers kept; ``fill_from_folder`` then
  reads each shard's rows straight from the version's safetensors (its master where there is one), a slice at a
  time: no rank reads, and no device holds, a whole tensor it does not own.
- ``full_tensors``: the consolidated parameters one at a time (``full_tensor()``, a collective per parameter, every
  rank in the same order); ``write_streamed`` writes them into one safetensors file as they come, its header built
  from the parameters' shapes first, so rank 0 holds one whole tensor at a time, never the model.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable, Iterator

import torch

from rlstream.policy.tensorfile import _header, raw_bytes

log = logging.getLogger(__name__)


def empty_model(config, dtype: torch.dtype | None = None):
    """The causal LM of ``config`` with its parameters on the meta device (in ``dtype``; None: the config's)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype) if dtype is not None else \
            AutoModelForCausalLM.from_config(config)


def resumed_model(folder: Path, dtype: str, sharding: str):
    """The model a trainer resumes from ``folder``: under ``--sharding fsdp2`` on the meta device (the engine has each
    rank fill its shard from the folder: ``fill_from_folder``), in the master's dtype where the folder holds one
    (unless ``--dtype`` names another), as ``checkpoint.load_resumed`` loads it whole for the other engines."""
    from transformers import AutoConfig

    from rlstream.models.loading import torch_dtype
    from rlstream.trainer.checkpoint import MASTER_FILE, load_resumed
    if sharding != "fsdp2":
        return load_resumed(folder, dtype)
    master = folder / MASTER_FILE
    if dtype == "auto" and master.exists():
        from safetensors import safe_open
        with safe_open(str(master), "pt") as st:
            first = next(iter(st.keys()), None)
            want = st.get_tensor(first).dtype if first is not None else torch.float32
    else:
        want = torch_dtype(dtype, folder)
    log.info("resuming from %s on the meta device: each rank reads its own shard (%s)", folder, want)
    return empty_model(AutoConfig.from_pretrained(folder), want)


def is_meta(model) -> bool:
    return any(p.is_meta for p in model.parameters())


def shard_blocks(model, mesh) -> None:
    """``fully_shard`` each of the model's blocks (its ``_no_split_modules``: decoder layers), then the whole model
    (what no block holds: embeddings, final norm, head), over ``mesh``."""
    from torch.distributed.fsdp import fully_shard
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def materialize(model, device: torch.device) -> None:
    """Memory for this rank's shards alone (uninitialised: ``fill_from_folder`` writes them); buffers unchanged."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def fill_from_folder(model, folder: Path) -> None:
    """Each parameter's local shard read from ``folder``'s safetensors: the master weights where the version was
    published in another dtype (``checkpoint.MASTER_FILE``), else its weights; only the rows this rank holds."""
    from safetensors import safe_open
    files = sorted(folder.glob("*.safetensors"), key=lambda f: f.name == "master.safetensors")  # master last: wins
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            where.update({name: f for name in st.keys()})
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in where:
                raise ValueError(f"{folder}: no tensor {name!r} for the model's parameter of that name")
            local, offset = _local(param)
            if local.numel() == 0:
                continue  # a rank past the last row of a small tensor holds none of it
            with safe_open(str(where[name]), "pt") as st:
                rows = st.get_slice(name)[offset:offset + local.shape[0]] if local.dim() else st.get_tensor(name)
            local.copy_(rows.to(local.dtype))


def _local(param) -> tuple[torch.Tensor, int]:
    """This rank's part of ``param`` and its first row in the whole (FSDP2 shards on dim 0; 0 for a plain tensor)."""
    if not hasattr(param, "to_local"):
        return param.data, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), offset[0] if offset else 0


def full_tensors(model, dtype: torch.dtype | None = None, keep: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer, consolidated one at a time on the CPU (in ``dtype`` where floating; None: as
    trained), in name order. A collective per parameter: every rank must iterate it whole; ``keep=False`` (the
    ranks that write nothing) yields nothing but takes part."""
    state = model.state_dict()
    for name in sorted(state):
        t = state[name]
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if keep:
            to = dtype if dtype is not None and full.is_floating_point() else full.dtype
            yield name, full.detach().to("cpu", dtype=to)
        del full


def specs(model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The consolidated tensors' names, shapes and dtypes, as meta tensors (what a safetensors header needs)."""
    out = {}
    for name, t in sorted(model.state_dict().items()):
        to = dtype if dtype is not None and t.is_floating_point() else t.dtype
        out[name] = torch.empty(t.shape, dtype=to, device="meta")
    return out


def write_streamed(path: Path, shapes: dict[str, torch.Tensor], tensors: Iterable[tuple[str, torch.Tensor]],
                   metadata: dict[str, str] | None = None) -> None:
    """One safetensors file of ``tensors`` (in ``shapes``' order, which they must come in), written as each comes:
    the header from ``shapes`` first, then each tensor's bytes; a plain safetensors file any engine reads."""
    head, _ = _header(shapes, metadata)
    names = iter(shapes)
    with open(path, "wb") as f:
        f.write(head)
        for name, t in tensors:
            want = next(names)
            if name != want or t.shape != shapes[name].shape or t.dtype != shapes[name].dtype:
                raise ValueError(f"{path}: tensor {name!r} {tuple(t.shape)} {t.dtype} came where the header has "
                                 f"{want!r} {tuple(shapes[want].shape)} {shapes[want].dtype}")
            f.write(raw_bytes(t))
        if next(names, None) is not None:
            raise ValueError(f"{path}: fewer tensors came than the header names")
