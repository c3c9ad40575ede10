"""What the trainer writes for each version: the weights workers load every version, the optimizer state every K.

Every version's folder is a complete transformers checkpoint (config, tokenizer, ``model.safetensors``): that is
what rollout and teacher load, hash-checked. Only a restarting trainer needs the optimizer state, so it is written
with every ``--checkpoint-every``-th version (and the first a process publishes); a restart takes the weights of
the last announced version and Adam's moments from the newest version at or before it that holds them. What was
trained and committed is unchanged by this (the offsets go with each PolicyVersion in its transaction), so
recovery stays exactly-once; only Adam's moments may be up to K - 1 steps old after a crash. Engines whose
optimizer state holds the parameters themselves (ZeRO's fp32 master weights, FSDP2's shards) write it every
version: an older one would roll the weights back.

After the first version the weights go through ``safetensors`` directly (the tensor names ``save_pretrained`` chose
the first time, the static files kept in memory): ``save_pretrained``'s own overhead is most of a tiny model's
write. The content each version announces is hashed from what was written, as workers hash the folder.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlstream.policy.deltas import Content, read_folder

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"


class VersionWriter:
    """Writes one version's folder; the first through ``save_pretrained``, later ones through safetensors."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self._names: list[str] | None = None  # the tensor names save_pretrained wrote (None: not learned yet)
        self._files: dict[str, bytes] = {}  # config, generation config, tokenizer: the same for every version

    def write(self, folder: Path, full_state=None, fast: bool = True) -> Content:
        """Write the version's weights and static files into ``folder``; return its content (for the hash and the
        weights log). ``full_state``: the whole model's parameters where an engine shards them; ``fast=False``:
        through ``save_pretrained`` every time (``--checkpoint-every 1``, the path before K)."""
        if self._names is None or full_state is not None or not fast:
            self.model.save_pretrained(folder, safe_serialization=True, state_dict=full_state)
            self.tokenizer.save_pretrained(folder)
            content = read_folder(folder)
            if full_state is None and set(content.shards.values()) == {WEIGHTS_FILE}:
                self._names, self._files = sorted(content.tensors), dict(content.files)
            return content
        state = self.model.state_dict()
        # Copies: the weights log keeps the content as the next delta's base while the model trains on.
        tensors = {name: state[name].detach().to("cpu", copy=True).contiguous() for name in self._names}
        save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
        for rel, data in self._files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)
        return Content(tensors=tensors, shards={name: WEIGHTS_FILE for name in tensors}, files=dict(self._files))


def has_optimizer_state(folder: Path) -> bool:
    return (folder / "optimizer.pt").exists() or (folder / "optimizer").is_dir()


def write_optimizer_states(folder: Path, states: list[dict], sharded: bool) -> None:
    """Plain torch's state in ``optimizer.pt``; a sharded engine's in ``optimizer/rank{r}.pt``, one per rank."""
    if not sharded:
        torch.save(states[0], folder / "optimizer.pt")
        return
    (folder / "optimizer").mkdir()
    for rank, state in enumerate(states):
        torch.save(state, folder / "optimizer" / f"rank{rank}.pt")


def read_optimizer_states(folder: Path) -> list[dict] | None:
    """The optimizer state saved with the checkpoint in ``folder``, in rank order (None: none saved)."""
    if (folder / "optimizer.pt").exists():
        return [torch.load(folder / "optimizer.pt", weights_only=True)]
    shards = sorted((folder / "optimizer").glob("rank*.pt"), key=lambda f: int(f.stem[4:]))
    # ZeRO's state holds more than tensors (its loss scaler): a full unpickle, of the trainer's own files.
    return [torch.load(f, weights_only=False) for f in shards] or None



def resume_optimizer_states(folder: Path, store, policy: str, version: int, cache_dir: Path) -> list[dict] | None:
    """The optimizer state a trainer resuming ``version`` (its weights in ``folder``) takes: the folder's own, else
    the newest at or before ``version`` in ``store`` (``--checkpoint-every``); None: Adam starts anew."""
    if has_optimizer_state(folder):
        return read_optimizer_states(folder)
    for v in sorted((v for v in store.versions(policy) if v <= version), reverse=True):
        candidate = store.fetch(policy, v, cache_dir)
        if has_optimizer_state(candidate):
            log.info("resuming the optimizer state of v%d with the weights of v%d (--checkpoint-every)", v, version)
            return read_optimizer_states(candidate)
    return None
