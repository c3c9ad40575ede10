"""Each rank's share of the training state, written and read through ``torch.distributed.checkpoint`` (DCP).

A version that carries the training state (``trainer/checkpoint.py``: every version under a sharded engine, every
``--checkpoint-every``-th otherwise) holds it in its ``optimizer/`` folder as a DCP checkpoint: every rank writes
its own shard (``__<rank>_0.distcp``) and rank 0 the ``.metadata`` that maps each tensor's pieces to files, so no
rank gathers another's state; ``rlstream.json`` beside them says which engine on how many ranks wrote it. On resume
every rank reads only the pieces of its own shard for the world it runs in. What each engine writes
(``checkpoint_state``) and reads (``load_checkpoint``):

- none / DDP: AdamW's state keyed by parameter name (DCP's ``get_optimizer_state_dict``). It is the same on every
  rank, so DCP writes each tensor once, spread over the ranks; it resumes on any number of ranks.
- FSDP2: the model's and AdamW's DTensor shards (``get_state_dict``); DCP reshards them on load, so a checkpoint of
  N ranks resumes on M (2 -> 1 and 1 -> 2 are tested).
- ZeRO 1, 2 and 3: each rank's partition as DeepSpeed holds it (flat fp32 groups, its Adam moments), under its
  rank's own key. DeepSpeed re-partitions only its "elastic" or offline-converted "universal" checkpoints, neither
  of which this runs, so no ZeRO stage reshards here: a resume on another number of ranks is refused, naming
  ``--nproc``.

A fresh AdamW (no step taken yet) writes no optimizer state: DCP's ``get_optimizer_state_dict`` would initialise one
with a zero-gradient step that Adam then counts as its first.

Where the ranks write: a staging folder beside the version's in the store (``staging``: a ``.``-name, which the
store's listing of versions leaves out), which rank 0 then moves into the version's folder (``adopt``) before the
store makes that folder appear (``trainer/checkpoint.py`` states the invariant this keeps). A local store on several
nodes must be a filesystem all of them mount (``adopt`` refuses a checkpoint missing a rank's file and says so); an
fsspec store (s3://, gs://) is written by every rank through DCP's fsspec writer and copied into the version's
folder by rank 0, which the store uploads.
"""
from __future__ import annotations

import contextlib
import json
import logging
import shutil
import warnings
from pathlib import Path

import torch

from rlstream.errors import UserError

log = logging.getLogger(__name__)

FOLDER = "optimizer"  # a name the weights' content leaves out (policy/deltas.py: PRIVATE)
MANIFEST = "rlstream.json"


def staging(store, policy: str, version: int) -> str:
    """Where every rank writes ``version``'s shards before rank 0 moves them into its folder; emptied first."""
    if store.local:
        where = store.root / policy / f".training-state-v{version}"
        shutil.rmtree(where, ignore_errors=True)  # a crashed attempt's leftovers
        return str(where)
    where = f"{store.root_uri}/{policy}/.training-state-v{version}"
    fs, path = _fs(where)
    if fs.exists(path):
        fs.rm(path, recursive=True)
    return where


def save(engine, where: str, sharding: str, world: int) -> dict:
    """Every rank: write this rank's shard of the training state to ``where``; return the manifest. Collective: it
    returns on any rank only once every rank's files are written and synced (DCP's writer fsyncs each file, and its
    metadata is written after every rank reported its write; the barrier makes the same hold on every rank)."""
    state = engine.checkpoint_state()
    import torch.distributed.checkpoint as dcp
    with _one_process():
        dcp.save(state, storage_writer=_writer(where))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return {"sharding": sharding, "world": world, "optimizer": "optimizer" in state}


def adopt(where: str, folder: Path, manifest: dict) -> None:
    """Rank 0: the shards written to ``where`` become ``folder``'s training state, with their manifest."""
    target = folder / FOLDER
    if "://" in where:
        fs, path = _fs(where)
        fs.invalidate_cache(path)  # a listing cached before the other ranks wrote would leave their files out
        fs.get(path.rstrip("/") + "/", str(target), recursive=True)
        fs.rm(path, recursive=True)
    else:
        missing = [f"__{r}_0.distcp" for r in range(manifest["world"]) if not (Path(where) / f"__{r}_0.distcp").exists()]
        if missing and manifest["world"] > 1:
            raise UserError(f"the trainer's ranks wrote their training state to {where}, but {', '.join(missing)} "
                            "is not there: ranks on several machines need --weights on a filesystem all of them "
                            "mount, or an fsspec URL (s3://, gs://)")
        shutil.move(where, target)  # a rename: the staging folder is in the store, beside the version's
    (target / MANIFEST).write_text(json.dumps(manifest, sort_keys=True) + "\n")


def holds_state(folder: Path) -> bool:
    return (folder / FOLDER / MANIFEST).exists()


def find(folder: Path, store, policy: str, version: int, cache_dir: Path) -> tuple[str, dict] | None:
    """Rank 0: the training state a trainer resuming ``version`` (its weights in ``folder``) takes, as (where every
    rank reads it, its manifest): the folder's own, else the newest at or before ``version`` in ``store``
    (``--checkpoint-every``); None: Adam starts anew."""
    candidates = [(version, folder)] + [(v, None) for v in sorted(store.versions(policy), reverse=True) if v < version]
    for v, local in candidates:
        local = local if local is not None else store.fetch(policy, v, cache_dir)
        if holds_state(local):
            if v != version:
                log.info("resuming the optimizer state of v%d with the weights of v%d (--checkpoint-every)", v, version)
            # Each rank reads its own pieces from the store itself, not from rank 0's copy.
            where = str(local / FOLDER) if store.local else f"{store.uri(policy, v)}/{FOLDER}"
            return where, json.loads((local / FOLDER / MANIFEST).read_text())
        if (local / FOLDER).is_dir() or (local / "optimizer.pt").exists():
            log.warning("v%d holds the optimizer state in the format before DCP (a file per rank): Adam starts anew", v)
            return None
    return None


def load(engine, where: str, manifest: dict, sharding: str, world: int) -> None:
    """Every rank: load the training state at ``where`` (``find``) into ``engine``, resharded to ``world`` ranks
    where the engine allows it; a state it cannot take is a UserError naming the flag to change."""
    if manifest["sharding"] != sharding:
        raise UserError(f"the optimizer state at {where} was written with --sharding {manifest['sharding']}: resume "
                        f"with --sharding {manifest['sharding']} (this trainer has --sharding {sharding})")
    if sharding.startswith("zero") and manifest["world"] != world:
        raise UserError(f"the ZeRO optimizer state at {where} was written by {manifest['world']} rank(s) and this "
                        f"trainer has {world}: ZeRO's partitions do not reshard here; resume with --nproc "
                        f"{manifest['world']} (or a launcher's {manifest['world']} ranks). --sharding fsdp2 and none "
                        "resume on any number of ranks")
    import torch.distributed.checkpoint as dcp
    with _one_process():
        engine.load_checkpoint(lambda state: dcp.load(state, storage_reader=_reader(where)), manifest)
    log.info("resumed the training state of %d %s rank(s) on %d from %s", manifest["world"], sharding, world, where)


@contextlib.contextmanager
def _one_process():
    """DCP warns at every save and load of a single process (no process group) that it assumes one: a trainer of one
    rank is one, so the warning would only repeat in its log every version."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _writer(where: str):
    import torch.distributed.checkpoint as dcp
    if "://" in where:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        return FsspecWriter(where)
    return dcp.FileSystemWriter(where)


def _reader(where: str):
    import torch.distributed.checkpoint as dcp
    if "://" in where:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        return FsspecReader(where)
    return dcp.FileSystemReader(where)


def _fs(url: str):
    from fsspec.core import url_to_fs
    return url_to_fs(url)
