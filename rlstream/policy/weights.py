"""The weight store: one checkpoint folder per policy version, written before it is announced; and where a worker
gets an announced version's folder (``PolicyWeights``).

A URI names the store: ``file:///abs/dir`` or a plain path (the default), or any fsspec URL for an object store
shared between hosts (``s3://bucket/run`` through s3fs, which finds an S3-compatible server by ``AWS_ENDPOINT_URL``;
``gs://...`` once gcsfs is installed; ``memory://`` in tests), laid out as
``<root>/<policy>/v<version>/``. Each folder is a complete transformers checkpoint (config, tokenizer,
model.safetensors), so any engine loads it. A version is complete when its ``COMPLETE`` marker exists: a local
folder appears whole by a rename; in an object store the marker is uploaded last and deleted first.

Retention (``prune``): versions from ``version - η - 1`` on (what a rollout η behind may still load), plus
every Nth version (``--keep-every``) for audit and reproducibility, plus version 0.

Weights that travel through Kafka instead (``kafka:weights?...`` URIs) are ``rlstream.policy.weight_log``'s.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from rlstream import metrics
from rlstream.policy import probe
from rlstream.policy.adapters import check_base, check_serves_adapters
from rlstream.errors import UserError
from rlstream.policy.probe import ProbeMismatch
from rlstream.policy.deltas import folder_hash
from rlstream.policy.uris import COMPLETE, fetch_uri, is_local, local_path  # noqa: F401 (local_path: callers')
from rlstream.policy.weight_log import WeightLogReader, is_log_uri
from rlstream.schemas.records import PolicyVersion

log = logging.getLogger(__name__)

class WeightStore:
    """Versions of policies under one root, local or in an fsspec filesystem."""

    def __init__(self, uri: str):
        self.local = is_local(uri)
        if self.local:
            parsed = urlparse(uri)
            self.root = Path(parsed.path if parsed.scheme == "file" else uri).resolve()
            self.root_uri = self.root.as_uri()
        else:
            from fsspec.core import url_to_fs
            try:
                self.fs, self._base = url_to_fs(uri)
            except (ImportError, ValueError) as exc:  # an unknown scheme, or its filesystem package missing
                raise ValueError(f"weight store {uri!r}: {exc}") from None
            self.root_uri = uri.rstrip("/")

    def uri(self, policy: str, version: int) -> str:
        if self.local:
            return (self.root / policy / f"v{version}").as_uri()
        return f"{self.root_uri}/{policy}/v{version}"

    def path(self, policy: str, version: int) -> Path:
        """The local folder of a version (a local store only)."""
        if not self.local:
            raise ValueError(f"{self.root_uri} is not a local store; fetch() a version to a local folder")
        return self.root / policy / f"v{version}"

    def _remote(self, policy: str, version: int | None = None) -> str:
        return f"{self._base.rstrip('/')}/{policy}" + (f"/v{version}" if version is not None else "")

    def put(self, policy: str, version: int, write) -> str:
        """Write a version through ``write(folder)`` (a local folder) atomically; return its URI."""
        return self.put_named(policy, f"v{version}", write, marker=str(version))

    def put_named(self, policy: str, name: str, write, marker: str = "") -> str:
        """``put`` under any folder name of the policy (a LoRA base: ``base-<hash>``, which ``versions`` and
        ``prune`` leave alone); return its URI."""
        if not self.local:
            staging = Path(tempfile.mkdtemp(prefix=f"rlstream-{policy}-{name}-"))
            try:
                write(staging)
                remote = f"{self._remote(policy)}/{name}"
                if self.fs.exists(remote):
                    self._remove(remote)
                for path in sorted(p for p in staging.rglob("*") if p.is_file()):
                    self.fs.put_file(str(path), f"{remote}/{path.relative_to(staging).as_posix()}")
                # Readers take a version as complete by its marker: it goes last.
                self.fs.pipe_file(f"{remote}/{COMPLETE}", (marker or name).encode())
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            return f"{self.root_uri}/{policy}/{name}"
        final = self.root / policy / name
        tmp = final.with_name(final.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        (tmp / COMPLETE).write_text(marker or name)
        shutil.rmtree(final, ignore_errors=True)
        # A reader never sees a half-written version: the folder appears whole.
        os.replace(tmp, final)
        return final.as_uri()

    def versions(self, policy: str) -> list[int]:
        """Complete versions in the store, oldest first."""
        if not self.local:
            folder = self._remote(policy)
            # Listings are cached per filesystem instance (s3fs, gcsfs): another host's new versions would stay
            # unseen by a long-lived reader without this.
            self.fs.invalidate_cache(folder)
            if not self.fs.exists(folder):
                return []
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(folder, detail=False)]
            return sorted(int(n[1:]) for n in names if re.fullmatch(r"v\d+", n)
                          and self.fs.exists(f"{folder}/{n}/{COMPLETE}"))
        folder = self.root / policy
        if not folder.is_dir():
            return []
        found = []
        for p in folder.glob("v*"):
            if p.name[1:].isdigit() and (p / COMPLETE).exists():
                found.append(int(p.name[1:]))
        return sorted(found)

    def prune(self, policy: str, keep_from: int, keep: set[int] = frozenset(), keep_every: int = 0) -> list[int]:
        """Delete versions older than ``keep_from`` (what η can no longer need), except ``keep`` and, when
        ``keep_every`` > 0, every version that is a multiple of it (audit)."""
        removed = []
        for v in self.versions(policy):
            if v < keep_from and v not in keep and not (keep_every > 0 and v % keep_every == 0):
                if self.local:
                    shutil.rmtree(self.path(policy, v), ignore_errors=True)
                else:
                    self._remove(self._remote(policy, v))
                removed.append(v)
        return removed

    def _remove(self, remote: str) -> None:
        """Delete a remote version, its marker first: a reader never takes a half-deleted version as complete."""
        if self.fs.exists(f"{remote}/{COMPLETE}"):
            self.fs.rm_file(f"{remote}/{COMPLETE}")
        self.fs.rm(remote, recursive=True)

    def fetch(self, policy: str, version: int, cache_dir: Path) -> Path:
        """A local folder holding the version: the store's own folder, or a copy under ``cache_dir``."""
        if self.local:
            return self.path(policy, version)
        return fetch_uri(self.uri(policy, version), cache_dir)


class PolicyWeights:
    """Where a worker (rollout, teacher) gets an announced version's local folder; its URI decides how.

    A store path is used in place, a remote store is copied under ``cache_dir``, and the weights log is rebuilt
    under it. Every load is checked against the content hash the PolicyVersion carries (when it carries one):
    ValueError refuses the version, OSError says it is not readable now; either way the caller keeps what it
    holds.

    After every load the engine answers the version's load probe (``rlstream.policy.probe``, when the version
    carries one): an engine whose log-probs are not the trainer's gets the last good version loaded back and the
    new one is refused (``ProbeMismatch``, a ValueError). A fleet checks each server itself (``expect_probe``)."""

    def __init__(self, cache_dir: Path, client_config: dict | None = None, run: str = ""):
        self.cache_dir = Path(cache_dir)
        self._log: WeightLogReader | None = None
        self._checked: tuple[str, Path] | None = None  # (hash, folder) of the last store folder checked
        self._good: PolicyVersion | None = None  # the last version an engine loaded and passed the probe with
        self._bases: set[tuple[str, Path]] = set()  # (hash, folder) of the LoRA bases checked
        if client_config is not None:
            self.bind(client_config, run)

    def bind(self, client_config: dict, run: str) -> None:
        """The broker and run to read the weights log of."""
        self._log = WeightLogReader(client_config, run, self.cache_dir / "log")

    def folder(self, pv: PolicyVersion) -> Path:
        if is_log_uri(pv.weights_uri):
            return self._reader(pv).fetch(pv)
        folder = fetch_uri(pv.weights_uri, self.cache_dir)
        if pv.content_hash and self._checked != (pv.content_hash, folder):
            if folder_hash(folder) != pv.content_hash:
                metrics.WEIGHTS_REFUSED.labels("hash_mismatch").inc()
                log.error("refusing %s v%d: the folder %s does not match the hash its PolicyVersion carries",
                          pv.policy, pv.version, folder)
                raise ValueError(f"{pv.policy} v{pv.version} refused: {folder} does not match its content hash")
            self._checked = (pv.content_hash, folder)
        return folder

    def engine_folder(self, pv: PolicyVersion) -> Path:
        """The folder an engine is built from to serve ``pv``: its own, or a LoRA version's base (``adopt`` then
        applies the adapter). Errors as ``folder``'s."""
        if not pv.base_hash:
            return self.folder(pv)
        if is_log_uri(pv.weights_uri):  # the base on the log too, checked against base_hash as it is rebuilt
            return self._reader(pv).base(pv)
        folder = fetch_uri(pv.base_uri, self.cache_dir)
        if (pv.base_hash, folder) not in self._bases:
            if folder_hash(folder) != pv.base_hash:
                metrics.WEIGHTS_REFUSED.labels("hash_mismatch").inc()
                raise ValueError(f"{pv.policy} v{pv.version} refused: its base {folder} does not match the base hash "
                                 f"{pv.base_hash[:16]} it names")
            self._bases.add((pv.base_hash, folder))
        return folder

    def adopt(self, pv: PolicyVersion, backend) -> None:
        """An engine just built from ``engine_folder(pv)``: record the base it holds and, for a LoRA version, apply
        the adapter (UserError when the engine cannot serve adapters)."""
        backend.base_hash = pv.base_hash or pv.content_hash
        if pv.base_hash:
            self._load(pv, backend)

    def prefetch(self, pv: PolicyVersion, folder: bool = True) -> None:
        """Get ``pv`` ready to load before the engine is taken: its folder (``folder``), or, from the weights log, only
        rebuilt and checked in memory (for an engine that ``loads_tensors``). Errors as ``folder``'s."""
        if folder or not is_log_uri(pv.weights_uri):
            self.folder(pv)
        else:
            self._reader(pv).fetch(pv, folder=False)

    def load(self, pv: PolicyVersion, backend) -> None:
        """Swap ``pv`` into an inference backend: from the weights log's tensors in memory when the backend
        ``loads_tensors`` (no folder written and read back), else from its folder; then the load probe. Errors as
        ``folder``'s, the backend's own, and ProbeMismatch (the backend holds the last good version again);
        RuntimeError when it could not be given back the last good version either (the engine is not fit to
        serve: the worker must stop)."""
        if hasattr(backend, "expect_probe"):  # a fleet: each server is probed after its push, by the fleet
            backend.expect_probe(pv.version, list(pv.probe_token_ids), list(pv.probe_logprobs))
            self._load(pv, backend)
            self._good = pv
            return
        self._load(pv, backend)
        try:
            self.verify(pv, backend)
        except ProbeMismatch as refused:
            good = self._good
            if good is None:  # the worker did not verify the version it started on: nothing known good to go back to
                raise RuntimeError(f"{pv.policy} v{pv.version} failed its load probe and no earlier version is known "
                                   "good to load back; the engine holds weights of no version") from refused
            try:
                self._load(good, backend)
                self.verify(good, backend)
            except Exception as exc:
                raise RuntimeError(f"{pv.policy} v{pv.version} failed its load probe and v{good.version} could not "
                                   f"be loaded back ({exc}); the engine holds weights of neither") from refused
            log.error("refused %s v%d (its load probe failed); still serving v%d", pv.policy, pv.version,
                      good.version)
            raise

    def verify(self, pv: PolicyVersion, backend) -> None:
        """The load probe of ``pv`` on the weights ``backend`` holds now (the first version, which the engine was
        built from, included): ProbeMismatch when they are not the trainer's. A version without a probe, or an
        engine that cannot answer one, passes unchecked."""
        if hasattr(backend, "expect_probe"):
            backend.expect_probe(pv.version, list(pv.probe_token_ids), list(pv.probe_logprobs))
            backend.verify(pv.version)
        elif pv.probe_token_ids and pv.probe_logprobs:
            got = backend.probe_logprobs(list(pv.probe_token_ids))
            if got is not None:
                probe.check(pv.version, getattr(backend, "name", "engine"), list(pv.probe_logprobs), got,
                            backend.probe_precise)
        self._good = pv

    def verify_first(self, pv: PolicyVersion, backend) -> None:
        """``verify`` on the version an engine was built from; UserError if it fails (nothing good to serve)."""
        try:
            self.verify(pv, backend)
        except (ProbeMismatch, OSError) as exc:  # OSError: no server of a fleet could answer its probe
            raise UserError(f"{exc}; the engine serves nothing else, so the worker stops (is the engine's dtype "
                            "or build the trainer's?)") from None

    def _load(self, pv: PolicyVersion, backend) -> None:
        if pv.base_hash:  # a LoRA version: its adapter, on its own base only (rlstream.policy.adapters)
            check_serves_adapters(backend, pv.policy, pv.version)
            check_base(pv.policy, pv.version, pv.base_hash, backend.base_hash, backend.name)
            backend.load_adapter(self.folder(pv), pv.version)
            return
        if getattr(backend, "loads_tensors", False) and is_log_uri(pv.weights_uri):
            self._reader(pv).load(pv, lambda tensors: backend.load_tensors(tensors, pv.version))
        else:
            backend.load_weights(self.folder(pv), pv.version)
        if pv.content_hash:
            backend.base_hash = pv.content_hash  # whole weights: a new base, which only its own adapters fit

    def _reader(self, pv: PolicyVersion) -> WeightLogReader:
        if self._log is None:
            raise OSError(f"{pv.weights_uri}: weights on the log, but no broker to read them from")
        return self._log


def tokenizer_hash(folder: Path) -> str:
    """A short hash of the tokenizer files, to catch a teacher or engine with another tokenizer."""
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        p = folder / name
        if p.exists():
            h.update(p.read_bytes())
    return h.hexdigest()[:16]
