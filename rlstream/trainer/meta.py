"""Never the whole model on one device: FSDP2 models built on the meta device, each rank filling only its shard, and
the consolidated weights published tensor by tensor (FSDP2 and ZeRO-3).

- ``empty_model``: the model's parameters on the meta device (no memory), its buffers computed on the CPU as usual
  (rotary frequencies and the like are small, and a meta buffer could not be recomputed after sharding).
- ``shard_blocks``: FSDP2's ``fully_shard`` on each decoder block and then the whole model; on meta parameters it
  only records each rank's shard (DTensors on meta).
- ``materialize``: only this rank's shards get memory (``to_empty``), the buffers kept; ``fill_from_folder`` then
  reads each shard's rows straight from the version's safetensors (its master where there is one), a slice at a
  time: no rank reads, and no device holds, a whole tensor it does not own.
- ``stream_full``: the consolidated parameters one at a time (FSDP2's ``full_tensor()``, ZeRO-3's
  ``GatheredParameters`` of one parameter: a collective per parameter, every rank in the same order), each written into the version's safetensors file as it comes (its header built from the
  shapes first) and hashed, so rank 0 holds one whole tensor at a time, never the model (``checkpoint.Streamed``).
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Iterator

import torch

from rlstream.policy.deltas import ContentHasher
from rlstream.policy.tensorfile import _header, raw_bytes
from rlstream.trainer.checkpoint import MASTER_FILE, WEIGHTS_FILE, Streamed, load_resumed
from rlstream.trainer.distributed import warn_of_a_left_lock

log = logging.getLogger(__name__)


def empty_model(config, dtype: torch.dtype | None = None):
    """The causal LM of ``config`` with its parameters on the meta device (in ``dtype``; None: the config's)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype) if dtype is not None else \
            AutoModelForCausalLM.from_config(config)


def resumed_model(folder: Path, dtype: str, sharding: str, device: torch.device = torch.device("cpu")):
    """The model a trainer resumes from ``folder``: under ``--sharding fsdp2`` on the meta device (the engine has each
    rank fill its shard from the folder: ``fill_from_folder``), under ``zero3`` on several ranks partitioned as it is
    built (``zero3_model``), in the master's dtype where the folder holds one (unless ``--dtype`` names another); the
    other engines load it whole (``checkpoint.load_resumed``)."""
    from transformers import AutoConfig

    from rlstream.models.loading import torch_dtype
    several = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    if sharding != "fsdp2" and not (sharding == "zero3" and several):
        return load_resumed(folder, dtype)
    master = folder / MASTER_FILE
    if dtype == "auto" and master.exists():
        from safetensors import safe_open
        with safe_open(str(master), "pt") as st:
            first = next(iter(st.keys()), None)
            want = st.get_tensor(first).dtype if first is not None else torch.float32
    else:
        want = torch_dtype(dtype, folder)
    config = AutoConfig.from_pretrained(folder)
    if sharding == "zero3":
        return zero3_model(config, want, folder, device)
    log.info("resuming from %s on the meta device: each rank reads its own shard (%s)", folder, want)
    return empty_model(config, want)


def zero3_model(config, dtype: torch.dtype, folder: Path, device: torch.device):
    """The model of ``config`` built under ``deepspeed.zero.Init`` (transformers' own, for a ZeRO-3 config: each
    parameter partitioned over the ranks as it is made and initialised gathered), then each parameter's weights from ``folder`` read by rank 0 alone and spread under ``GatheredParameters``
    of that parameter: no rank holds more than one whole parameter beyond its partition."""
    import os

    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported, as DeepSpeedEngine sets it
        warn_of_a_left_lock()
    import deepspeed
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    # transformers builds under zero.Init (and initialises each weight gathered) while such a config is alive: only
    # for this model, so it is dropped at once (a later load_model must not partition the KL reference).
    zero3 = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        del zero3
    lead = torch.distributed.get_rank() == 0
    files = sorted(folder.glob("*.safetensors"), key=lambda f: f.name == MASTER_FILE)  # the master last: it wins
    where = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            where.update({name: f for name in st.keys()})
    for name, param in model.named_parameters():
        if name not in where:
            raise ValueError(f"{folder}: no tensor {name!r} for the model's parameter of that name")
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            if lead:  # the others get it as the context ends
                with safe_open(str(where[name]), "pt") as st:
                    param.data.copy_(st.get_tensor(name).to(param.dtype))
    log.info("resumed from %s partitioned as built (ZeRO-3, %s): rank 0 read it a parameter at a time", folder, dtype)
    return model


def param_count(model) -> int:
    """The model's parameters, counted whole where ZeRO-3 (``zero3_model``) leaves each rank an empty stand-in."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


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
    files = sorted(folder.glob("*.safetensors"), key=lambda f: f.name == MASTER_FILE)  # the master last: it wins
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


def stream_full(model, folder: Path | None, publish_dtype: torch.dtype | None) -> Streamed | None:
    """The consolidated weights, gathered a parameter at a time and written as each comes into ``folder`` (rank 0's;
    None on the other ranks, which take part in each gather and write nothing): ``model.safetensors`` in
    ``publish_dtype`` (None: as trained), and the master as trained beside it where that differs. Every rank calls it."""
    names = _published(model)
    if folder is None:
        for _ in full_tensors(model, names, keep=False):
            pass
        return None
    shutil.rmtree(folder, ignore_errors=True)  # an earlier, failed publish's files (a master it no longer writes)
    folder.mkdir(parents=True)
    published = _StreamedFile(folder / WEIGHTS_FILE, specs(model, names, publish_dtype))
    master = _StreamedFile(folder / MASTER_FILE, specs(model, names)) if publish_dtype is not None else None
    hasher = ContentHasher()
    for name, full in full_tensors(model, names):
        cast = full.to(publish_dtype) if publish_dtype is not None and full.is_floating_point() else full
        published.add(name, cast)
        hasher.tensor(name, cast)  # in name order, as workers hash the file
        if master is not None:
            master.add(name, full)
    published.close()
    if master is not None:
        master.close()
    return Streamed(folder, hasher)


def _published(model) -> list[str]:
    """The state's names in order, a tied parameter under its first name only (as ``save_pretrained`` saves it)."""
    state = model.state_dict()
    tied = set(state) - {n for n, _ in model.named_parameters()} - {n for n, _ in model.named_buffers()}
    return sorted(n for n in state if n not in tied)


def full_tensors(model, names: list[str], keep: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``names`` of the model's state consolidated one at a time on the CPU: an FSDP2 DTensor by ``full_tensor()``,
    a ZeRO-3 parameter under ``GatheredParameters`` of itself alone. A collective per parameter: every rank must
    iterate it whole; ``keep=False`` (the ranks that write nothing) yields nothing but takes part."""
    tensors = _tensors(model)
    for name in names:
        t = tensors[name]
        if hasattr(t, "ds_id"):
            import deepspeed
            with deepspeed.zero.GatheredParameters([t], modifier_rank=None):
                full = t.data.detach().to("cpu", copy=True) if keep else None
        else:
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if keep:
            yield name, full.detach().to("cpu")
        del full


def _tensors(model) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by state-dict name, as they are (a ZeRO-3 parameter keeps its ``ds_*``)."""
    return {**dict(model.named_buffers(remove_duplicate=False)),
            **dict(model.named_parameters(remove_duplicate=False))}


def specs(model, names: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``names``' consolidated shapes and dtypes (floating ones in ``dtype``; None: as trained) as meta tensors:
    what a safetensors header needs, before any tensor is gathered."""
    tensors, out = _tensors(model), {}
    for name in names:
        t = tensors[name]
        shape = tuple(t.ds_shape) if hasattr(t, "ds_shape") else tuple(t.shape)  # a ZeRO-3 parameter's own is empty
        out[name] = torch.empty(shape, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype,
                                device="meta")
    return out


class _StreamedFile:
    """One safetensors file written as its tensors come, in the order of the header built first from their shapes:
    a plain safetensors file any engine reads."""

    def __init__(self, path: Path, shapes: dict[str, torch.Tensor]):
        self.path, self.shapes, self._names = path, shapes, iter(shapes)
        head, _ = _header(shapes, {"format": "pt"})
        self._file = open(path, "wb")
        self._file.write(head)

    def add(self, name: str, t: torch.Tensor) -> None:
        want = next(self._names, None)
        if want != name or t.shape != self.shapes[name].shape or t.dtype != self.shapes[name].dtype:
            raise ValueError(f"{self.path}: tensor {name!r} {tuple(t.shape)} {t.dtype} came where the header has "
                             f"{want!r}")
        self._file.write(raw_bytes(t))

    def close(self) -> None:
        self._file.close()
        if next(self._names, None) is not None:
            raise ValueError(f"{self.path}: fewer tensors came than its header names")
