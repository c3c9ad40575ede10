"""What the trainer writes for each version: the weights workers load every version, the optimizer state every K.

Every version's folder is a complete transformers checkpoint (config, tokenizer, ``model.safetensors``): that is
what rollout and teacher load, hash-checked. Only a restarting trainer needs the optimizer state, so it is written
with every ``--checkpoint-every``-th version (and the first a process publishes); a restart takes the weights of
the last announced version and Adam's moments from the newest version at or before it that holds them. What was
trained and committed is unchanged by this (the offsets go with each PolicyVersion in its transaction), so
recovery stays exactly-once; only Adam's moments may be up to K - 1 steps old after a crash. Engines whose
optimizer state holds the parameters themselves (ZeRO's fp32 master weights, FSDP2's shards) write it every
version: an older one would roll the weights back.

After the first version the weights go through ``policy.tensorfile`` (safetensors without copies) directly (the
tensor names ``save_pretrained`` chose the first time, the static files kept in memory): ``save_pretrained``'s own
overhead is most of a tiny model's write. The content each version announces is hashed from what was written, as
workers hash the folder.

**Publish dtype** (``--publish-dtype``). Workers may load a version in another dtype than the trainer trains in
(fp32 training, bf16 published: a bf16 delta changes few elements, an fp32 one every element). The folder then holds
the cast tensors (its config naming their dtype), and the trainer's master weights, as trained, in the private
``master.safetensors`` beside them (``deltas.PRIVATE``: never hashed, never on the weights topic). A resume loads
the master over the folder's weights (``load_resumed``), so a restart continues from the weights exactly as trained,
not from their rounding.

Invariant: **an announced version's folder holds the state it was published from**: its weights, its master, and
(where the version carries it) every rank's shard of the training state. It holds because all of them are in the
version's folder before ``WeightStore.put`` makes the folder appear whole, and ``TrainerService._publish`` produces
the record that announces the version (``PendingVersion.uri``) only after that, in the transaction that commits its
samples' offsets. The shards get there by every rank writing its own (``trainer/shards.py``: ``save`` returns on
rank 0 only once every rank's files are written and synced, a barrier after DCP's save), which rank 0 moves into the
folder while writing it (``shards.adopt``). A SIGKILL before the commit leaves an unannounced folder (overwritten
when the step is redone), one after it a folder whose master and shards match the committed offsets.
"""
from __future__ import annotations

import json
import logging
import queue
import shutil
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlstream.models.loading import dtype_name, load_model
from rlstream.policy.deltas import PRIVATE, Content, ContentHasher, content_hash, read_folder
from rlstream.policy.tensorfile import save_file

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
MASTER_FILE = "master.safetensors"
_DTYPE_KNOB = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """CPU copies of ``state``'s tensors, floating ones in ``dtype`` (None: as they are); tensors that share storage
    (tied embeddings) stay shared, so ``save_pretrained`` still saves them once."""
    out, done = {}, {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in done:
            to = dtype if dtype is not None and t.is_floating_point() else t.dtype
            done[key] = t.detach().to("cpu", dtype=to, copy=True).contiguous()
        out[name] = done[key]
    return out


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each storage once (the first name in order): safetensors refuses shared tensors."""
    out, seen = {}, set()
    for name in sorted(state):
        t = state[name]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out[name] = t.detach().to("cpu").contiguous()
    return out


class VersionWriter:
    """Writes one version's folder; the first through ``save_pretrained``, later ones through safetensors."""

    def __init__(self, model, tokenizer, publish_dtype: torch.dtype | None = None):
        self.model, self.tokenizer = model, tokenizer
        # None: published as trained. A dtype the parameters already have changes nothing either: no master.
        trained = {p.dtype for p in model.parameters() if p.is_floating_point()}
        self.publish_dtype = publish_dtype if publish_dtype is not None and trained != {publish_dtype} else None
        self._names: list[str] | None = None  # the tensor names save_pretrained wrote (None: not learned yet)
        self._files: dict[str, bytes] = {}  # config, generation config, tokenizer: the same for every version
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="version-writer")
        self._buffers: list[dict[str, torch.Tensor]] = [{}, {}]  # what _copy casts into, in turn

    def _copy(self, state: dict[str, torch.Tensor], each=None) -> dict[str, torch.Tensor]:
        """The published tensors: copies (in the publish dtype), as the weights log keeps a version's content as
        the next delta's base while the model trains on. Into the buffers of the version before the last: fresh
        memory costs its page faults every version (about 5x the copy itself on the CPU). So a content returned
        by ``write`` stays as it is until two more versions are written (the weights log needs only the last).
        ``each(name, tensor)`` is called with each copy as soon as it is made (in name order)."""
        self._buffers.reverse()
        into = self._buffers[0]
        dtype = self.publish_dtype
        out = {}
        for name in self._names:
            src = state[name].detach()
            want = dtype if dtype is not None and src.is_floating_point() else src.dtype
            dst = into.get(name)
            if dst is None or dst.shape != src.shape or dst.dtype != want:
                dst = into[name] = torch.empty(src.shape, dtype=want)
            dst.copy_(src)
            out[name] = dst
            if each is not None:
                each(name, dst)
        return out

    def write(self, folder: Path, full_state=None, fast: bool = True, on_content=None) -> tuple[Content, str]:
        """Write the version's weights and static files into ``folder``; return its content (for the weights log)
        and its ``content_hash`` (what the PolicyVersion carries). ``full_state``: the whole model's parameters
        where an engine shards them; ``fast=False``: through ``save_pretrained`` every time (``--checkpoint-every
        1``, the path before K). With a publish dtype, the master weights go beside them (module docstring).
        ``on_content(content, digest)`` is called as soon as the content exists, before its file is written, with a
        future of its hash (the weights log starts encoding it then, and produces it once the hash is known).

        The master's file and the hash run in threads beside the weights' file (each mostly outside the GIL: file
        writes, hashlib over buffers); all are done before this returns, so before the store makes the folder
        appear and before the version is announced."""
        if isinstance(full_state, Streamed):
            return self._write_streamed(folder, full_state, on_content)
        state = full_state if full_state is not None else self.model.state_dict()
        jobs = []
        if self.publish_dtype is not None:
            jobs.append(self._pool.submit(save_file, _unshared(state), folder / MASTER_FILE, {"format": "pt"}))
        try:
            if self._names is None or full_state is not None or not fast:
                published = cast_state(state, self.publish_dtype) if self.publish_dtype is not None else full_state
                self.model.save_pretrained(folder, safe_serialization=True, state_dict=published)
                self.tokenizer.save_pretrained(folder)
                if self.publish_dtype is not None:
                    _name_dtype(folder / "config.json", self.publish_dtype)
                content = read_folder(folder)
                if full_state is None and set(content.shards.values()) == {WEIGHTS_FILE}:
                    self._names, self._files = sorted(content.tensors), dict(content.files)
                digest = Future()
                digest.set_result(content_hash(content))
                if on_content is not None:
                    on_content(content, digest)
                return content, digest.result()
            # Each tensor is hashed in a thread as soon as it is cast (the hash needs them in name order, as cast):
            # the hash is known about when the last tensor is, not a whole hash later.
            cast: queue.SimpleQueue = queue.SimpleQueue()
            digest = self._pool.submit(_hash_from, cast, self._files)
            try:
                tensors = self._copy(state, each=lambda name, t: cast.put((name, t)))
            finally:
                cast.put(None)
            content = Content(tensors=tensors, shards={name: WEIGHTS_FILE for name in tensors},
                              files=dict(self._files))
            if on_content is not None:
                on_content(content, digest)
            save_file(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
            for rel, data in self._files.items():
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                (folder / rel).write_bytes(data)
            return content, digest.result()
        finally:
            for job in jobs:
                job.result()  # the master is in the folder before it can appear (an error raises here)


    def _write_streamed(self, folder: Path, streamed: "Streamed", on_content=None) -> tuple[Content, str]:
        """``write`` of weights streamed already (``Streamed``): their files moved in, the static files written
        beside them and hashed after the tensors. The content handed over holds the files alone: a streamed
        version's tensors are never all in memory (so it is not for the weights log)."""
        self.model.save_pretrained(folder, safe_serialization=True, state_dict={})  # config and generation config
        self.tokenizer.save_pretrained(folder)
        if self.publish_dtype is not None:
            _name_dtype(folder / "config.json", self.publish_dtype)
        for f in streamed.folder.iterdir():
            shutil.move(str(f), folder / f.name)
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
                 if p.is_file() and p.suffix != ".safetensors" and p.relative_to(folder).parts[0] not in PRIVATE}
        for rel in sorted(files):
            streamed.hasher.file(rel, files[rel])
        digest = Future()
        digest.set_result(streamed.hasher.hexdigest())
        content = Content(tensors={}, shards={}, files=files)
        if on_content is not None:
            on_content(content, digest)
        return content, digest.result()


@dataclass
class Streamed:
    """A version's weights written already, tensor by tensor as they were gathered (``trainer/meta.py``:
    ``stream_full``), into ``folder`` on this host (``model.safetensors``, and the master beside it), with the content
    hash fed every tensor in name order (``VersionWriter.write`` adds the static files)."""

    folder: Path
    hasher: ContentHasher


def _hash_from(tensors: queue.SimpleQueue, files: dict[str, bytes]) -> str:
    """``content_hash`` of the (name, tensor) pairs taken from ``tensors`` in name order until None, then ``files``."""
    h = ContentHasher()
    while (item := tensors.get()) is not None:
        h.tensor(*item)
    for rel in sorted(files):
        h.file(rel, files[rel])
    return h.hexdigest()


class PendingVersion:
    """One version's folder being written into the store in a thread (``WeightStore.put``), its content and hash
    handed over as soon as they exist: the weights log's chunks go into the open transaction while the files (the
    master, the optimizer state) are still being written. ``write(folder, on_content)`` writes the folder and calls
    ``on_content`` as ``VersionWriter.write`` does."""

    def __init__(self, pool: ThreadPoolExecutor, store, policy: str, version: int, write):
        self._content: Future = Future()
        self._put = pool.submit(store.put, policy, version, lambda folder: write(folder, self._hand_over))

    def _hand_over(self, content: Content, digest: Future) -> None:
        self._content.set_result((content, digest))

    def content(self) -> tuple[Content, str]:
        """The version's content and hash, once known (the write's error if it failed before)."""
        wait([self._content, self._put], return_when=FIRST_COMPLETED)
        if not self._content.done():
            self._put.result()
            raise RuntimeError("the version's folder was written without its content being handed over")
        content, digest = self._content.result()
        return content, digest.result()

    def uri(self) -> str:
        """The version's URI in the store, once its folder is there whole (the write's error if it failed)."""
        return self._put.result()


def _name_dtype(config: Path, dtype: torch.dtype) -> None:
    """Make a saved config name the dtype its tensors were published in (``save_pretrained`` names the model's)."""
    data = json.loads(config.read_text())
    for key in ("dtype", "torch_dtype"):  # transformers 5 writes dtype, older ones torch_dtype
        if key in data or key == "dtype":
            data[key] = dtype_name(dtype)
    config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def load_resumed(folder: Path, dtype: str = "auto", flag: str = "resume from"):
    """The model a trainer resumes from ``folder``: its master weights, bit for bit, where the version was published
    in another dtype (in the master's dtype unless ``--dtype`` names one), else the folder's weights."""
    master = folder / MASTER_FILE
    if not master.exists():
        return load_model(folder, dtype, flag=flag)
    state = load_file(str(master))
    trained = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    model = load_model(folder, dtype if dtype != "auto" else _DTYPE_KNOB.get(trained, "fp32"), flag=flag)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied tensor is saved once: the names left out must share storage with one loaded.
    loaded = {t.untyped_storage().data_ptr() for n, t in model.state_dict().items() if n in state}
    absent = [n for n in missing if model.state_dict()[n].untyped_storage().data_ptr() not in loaded]
    if unexpected or absent:
        raise ValueError(f"{master}: does not fit the model in {folder} (missing {absent}, unexpected {unexpected})")
    log.info("resumed the master weights (%s) from %s", dtype_name(trained), master)
    return model
