"""A policy version's content, its hash, and the anchor and delta payloads that carry it between hosts.

Pure logic, no Kafka (``rlstream.policy.weight_log`` moves the payloads):

- ``Content``: what a version is: every tensor of its safetensors shards (with the shard each lives in) and
  every other file of its folder (config, generation config, tokenizer, chat template). Files only the trainer
  needs (``PRIVATE``: optimizer state, master weights, its resume notes, the store's marker) are not part of a version.
- ``content_hash``: sha256 over the tensors in name order (name, dtype, shape, raw bytes), then the other files
  in name order (name, length, bytes). Shard layout and safetensors header bytes are not hashed, so a folder
  rebuilt from a delta hashes equal to the trainer's ``save_pretrained`` folder when, and only when, every
  tensor is bit-equal. Writer and reader both call ``folder_hash``; ``PolicyVersion.content_hash`` carries it.
- ``encode`` / ``apply``: a version as a payload, itself a safetensors blob. An anchor holds every tensor and
  file. A delta against the previous version holds only what changed: a changed tensor in full, or, when
  smaller, the flat indices (int32, int64 past 2^31 elements) and new values of the changed elements; a tensor
  whose shape or dtype changed goes in full. Past about 1 changed element in 48 (for bf16) a bit mask of the changed
  elements (one bit each) beats the indices, so each changed tensor goes in the smallest of the three forms
  (full, indices + values, mask + values). Elements are compared as integers of their width, so the rebuilt
  tensor is bit-equal (NaN payloads and -0.0 included). The blob's metadata holds a JSON manifest of every
  tensor (shard, and full | sparse | mask | same) and file (data | same); what the manifest does not list is gone.
- ``split``: a payload as chunks of at most ``chunk_bytes``; a tensor larger than a chunk spans several.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from rlstream.policy import tensorfile

#: Files (or folders) of a store folder that are the trainer's own, not the policy's (never hashed, never shipped):
#: the optimizer state (``optimizer/`` holds a sharded engine's, a file per rank), the master weights in the
#: training dtype when the version is published in another (``--publish-dtype``), the store's marker, and the skip
#: list older trainers wrote.
PRIVATE = frozenset({"optimizer.pt", "optimizer", "master.safetensors", "consumed_ahead.json", "COMPLETE"})

ANCHOR, DELTA = "anchor", "delta"
_META = "rlstream"
#: Integer views of each element width: comparing and assigning through them is bit-exact.
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Content:
    """One version: tensors by name, the shard file each is saved in, and the other files by relative path."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    shards: dict[str, str] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)

    def names(self) -> list[str]:
        """Every file of the folder this content writes."""
        return sorted(set(self.shards.values()) | set(self.files))


def read_folder(folder: Path) -> Content:
    """The content of a checkpoint folder (its safetensors shards and other files, private ones left out)."""
    folder = Path(folder)
    content = Content()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel.split("/")[0] in PRIVATE:
            continue
        if path.suffix == ".safetensors":
            for name, tensor in load_file(str(path)).items():
                if name in content.tensors:
                    raise ValueError(f"{folder}: tensor {name!r} is in two shards")
                content.tensors[name], content.shards[name] = tensor, rel
        else:
            content.files[rel] = path.read_bytes()
    return content


def write_folder(content: Content, folder: Path) -> None:
    """Write a content as a checkpoint folder: the same shards (so an index file stays right) and files."""
    folder = Path(folder)
    by_shard: dict[str, dict[str, torch.Tensor]] = {}
    for name, shard in content.shards.items():
        by_shard.setdefault(shard, {})[name] = content.tensors[name]
    for shard, tensors in by_shard.items():
        (folder / shard).parent.mkdir(parents=True, exist_ok=True)
        tensorfile.save_file(tensors, folder / shard, metadata={"format": "pt"})
    for rel, data in content.files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)


class ContentHasher:
    """``content_hash`` fed piece by piece: every tensor in name order, then every file in name order (a writer
    hashes each tensor as soon as it exists)."""

    def __init__(self):
        self._h = hashlib.sha256()

    def tensor(self, name: str, t: torch.Tensor) -> None:
        self._h.update(f"tensor:{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        self._h.update(tensorfile.raw_bytes(t))  # a view: a copy would double a hash's time

    def file(self, rel: str, data: bytes) -> None:
        self._h.update(f"file:{rel}:{len(data)}\n".encode())
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def content_hash(content: Content) -> str:
    """The version's hash (see the module docstring for what it covers)."""
    h = ContentHasher()
    for name in sorted(content.tensors):
        h.tensor(name, content.tensors[name])
    for rel in sorted(content.files):
        h.file(rel, content.files[rel])
    return h.hexdigest()


def folder_hash(folder: Path) -> str:
    """``content_hash`` of a checkpoint folder."""
    return content_hash(read_folder(folder))


def _int_view(t: torch.Tensor) -> torch.Tensor:
    """The flat tensor as integers of its element width (bool and complex too: only the bits matter)."""
    return t.reshape(-1).view(_INT_VIEW[t.element_size()])


def _changed(new: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor | None:
    """Which elements differ bitwise (a flat bool tensor); None when the tensors cannot be compared elementwise."""
    if old is None or old.shape != new.shape or old.dtype != new.dtype or new.element_size() not in _INT_VIEW:
        return None
    return _int_view(new) != _int_view(old)


# Bits, counts and element selections go through numpy: torch's bool sum, bit arithmetic and masked indexing take
# several times as long on the CPU, and a 100 M-parameter delta does each over every element.

def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A flat bool tensor as bytes, 8 elements a byte, the first in the high bit (the last byte zero-padded)."""
    return torch.from_numpy(np.packbits(mask.numpy()))


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` elements of a ``pack_bits`` result, as a flat bool tensor."""
    return torch.from_numpy(np.unpackbits(packed.numpy(), count=n).view(np.bool_))


def encode(content: Content, base: Content | None, into: bytearray | None = None) -> bytearray:
    """The payload of ``content``: an anchor when ``base`` is None, else a delta against ``base``; built in ``into``
    when it has the payload's size (``tensorfile.save``)."""
    blob: dict[str, torch.Tensor] = {}
    tensors: dict[str, list[str]] = {}
    for name, t in content.tensors.items():
        t = t.contiguous()
        mask = _changed(t, base.tensors.get(name) if base is not None else None)
        changed = int(np.count_nonzero(mask.numpy())) if mask is not None else -1
        if mask is None:
            enc = "full"
        elif changed == 0:
            enc = "same"
        else:
            index_dtype = torch.int32 if t.numel() < 2 ** 31 else torch.int64
            values = changed * t.element_size()
            sizes = {"full": t.numel() * t.element_size(), "sparse": changed * index_dtype.itemsize + values,
                     "mask": -(-t.numel() // 8) + values}
            enc = min(sizes, key=lambda k: (sizes[k], k != "full"))  # full on a tie: the simplest to apply
        if enc == "full":
            blob[f"t/{name}"] = t
        elif enc == "sparse":
            idx = np.flatnonzero(mask.numpy())
            blob[f"i/{name}"] = torch.from_numpy(idx).to(index_dtype)
            blob[f"v/{name}"] = _select(t, idx)
        elif enc == "mask":
            blob[f"m/{name}"] = pack_bits(mask)
            blob[f"v/{name}"] = _select(t, mask.numpy())
        tensors[name] = [content.shards[name], enc]
    files: dict[str, str] = {}
    for rel, data in content.files.items():
        if base is not None and base.files.get(rel) == data:
            files[rel] = "same"
        else:
            files[rel] = "data"
            blob[f"f/{rel}"] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
                torch.empty(0, dtype=torch.uint8)
    manifest = {"kind": ANCHOR if base is None else DELTA, "tensors": tensors, "files": files}
    return tensorfile.save(blob, metadata={_META: json.dumps(manifest)}, into=into)


def _select(t: torch.Tensor, where) -> torch.Tensor:
    """The flat tensor's elements at ``where`` (numpy indices or bool mask), bit-exact, through its integer view."""
    view = _int_view(t)
    return torch.from_numpy(view.numpy()[where]).view(t.dtype)


def payload_kind(payload: bytes) -> str:
    """anchor or delta, from a payload's manifest."""
    return _manifest(payload)["kind"]


def _manifest(payload: bytes) -> dict:
    """The manifest in a payload's safetensors header (read without loading the tensors)."""
    try:
        size = int.from_bytes(payload[:8], "little")
        header = json.loads(payload[8:8 + size])
        return json.loads(header["__metadata__"][_META])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a weights payload: {exc}") from None


def apply(payload: bytes | bytearray, base: Content | None, in_place: bool = False) -> Content:
    """The content a payload encodes; a delta needs the ``base`` it was made against (ValueError if absent, or if
    the payload does not fit it). The tensors it carries whole are views of ``payload`` (a bytearray is taken as
    it is, bytes copied once). ``in_place``: the changed tensors of ``base`` are changed where they are, not copied
    (a reader that drops ``base`` on any error: a failed apply or hash leaves it half-changed)."""
    manifest = _manifest(payload)
    blob, _ = tensorfile.load(payload if isinstance(payload, bytearray) else bytearray(payload))
    if manifest["kind"] == DELTA and base is None:
        raise ValueError("a delta needs its base version")
    out = Content()
    for name, (shard, enc) in manifest["tensors"].items():
        if enc == "full":
            t = blob[f"t/{name}"]
        elif name not in base.tensors:
            raise ValueError(f"delta names tensor {name!r} as changed in place, but its base has no such tensor")
        elif enc == "same":
            t = base.tensors[name]
        else:
            old = base.tensors[name]
            values = blob[f"v/{name}"]
            if enc == "mask":
                packed = blob[f"m/{name}"]
                fits = packed.numel() == -(-old.numel() // 8)
                idx = unpack_bits(packed, old.numel()).numpy() if fits else None
                fits = fits and int(np.count_nonzero(idx)) == values.numel()
            else:
                idx = blob[f"i/{name}"].numpy().astype(np.int64)
                fits = idx.size == values.numel() and not (idx.size and (int(idx.max()) >= old.numel()
                                                                         or int(idx.min()) < 0))
            if values.dtype != old.dtype or not fits:
                raise ValueError(f"delta of tensor {name!r} does not fit its base")
            t = old if in_place and old.is_contiguous() else old.clone()
            _int_view(t).numpy()[idx] = _int_view(values).numpy()
        out.tensors[name], out.shards[name] = t, shard
    for rel, enc in manifest["files"].items():
        if enc == "data":
            out.files[rel] = blob[f"f/{rel}"].numpy().tobytes()
        elif base is None or rel not in base.files:
            raise ValueError(f"delta keeps file {rel!r}, but its base has no such file")
        else:
            out.files[rel] = base.files[rel]
    return out


def split(payload: bytes | bytearray, chunk_bytes: int) -> list[memoryview]:
    """The payload as chunks of at most ``chunk_bytes`` (at least one, even for an empty payload): views of it, not
    copies (the record encoding copies each once), so the payload must not change while they are in use."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    view = memoryview(payload)
    return [view[i:i + chunk_bytes] for i in range(0, len(payload), chunk_bytes)] or [view[0:0]]
