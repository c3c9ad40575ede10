"""A LoRA run's base on the weights log: put there by the writer with the first version whose adapter names it.

A LoRA version (``rlstream.policy.adapters``) is an adapter folder, small beside the model, so it goes on the log
whole: every LoRA version is an anchor, no deltas. The frozen base it applies to is the model's size. It goes on the
log as a version 0 of its own name (``<policy>@base-<hash16>``, ``base_name``) the first time this writer announces
a version whose adapter names it (``adapter_config.json``'s ``base_model_name_or_path``: the trainer sets it to the
base's folder in its store, ``trainer/lora.py``): its chunks uploaded outside the transaction before the version's,
its manifest produced in the version's transaction before the version's own, so the base becomes visible with the
first version that names it or not at all. Every LoRA version's URI names where its base's manifest is
(``LogRef.base``, ``base_offset``); a worker rebuilds the base from there once, checked against the ``base_hash``
its PolicyVersion carries (``WeightLogReader.base``), and applies each adapter only to that base, as from the store.

Retention: the trainer's prefix delete stops before the base's records while a version η may still need names it
(``Positions.pin``). So that the topic does not keep every adapter since the run began, the writer puts the base on
the log again once the adapter bytes produced since its last copy reach the base's own size (``BaseOnLog.due``):
the topic then holds at most about two copies of the base and the versions after the older one, and each copy costs
about the bytes of the adapters it lets go. A restarted trainer puts it again with its first version.
"""
from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlstream.kafka import records
from rlstream.policy.adapters import ADAPTER_CONFIG
from rlstream.policy.deltas import Content, content_hash, encode, read_folder
from rlstream.policy.manifest import MANIFEST_PARTITION, Placed, Positions, Upload
from rlstream.policy.uris import fetch_uri
from rlstream.schemas.headers import now_ms

log = logging.getLogger(__name__)

#: Between a policy's name and its base's hash in the base's name on the log.
BASE_MARK = "@base-"


def base_name(policy: str, digest: str) -> str:
    return f"{policy}{BASE_MARK}{digest[:16]}"


def adapter_base(content: Content) -> str | None:
    """Where the base of the adapter ``content`` is (the folder or store URI its config names); None when
    ``content`` is whole weights. ValueError when it is an adapter that names no base."""
    config = content.files.get(ADAPTER_CONFIG)
    if config is None:
        return None
    where = json.loads(config).get("base_model_name_or_path") or ""
    if not where:
        raise ValueError(f"an adapter version whose {ADAPTER_CONFIG} names no base (base_model_name_or_path): its "
                         "base cannot go on the weights log")
    return where


@dataclass
class _Copy:
    """One copy of the base on the log: uploaded, then announced in a transaction, then committed."""

    where: str
    name: str
    digest: str
    upload: Upload
    offset: int = -1  # its manifest's, once produced in a transaction
    committed: bool = False
    since: int = 0  # adapter payload bytes produced after it
    size: int = 0  # its own payload bytes


class BaseOnLog:
    """The writer's side: the base the adapters name, put on the log once and again when due (module docstring).
    ``upload(txn, name, content, digest, payload)`` puts ``payload`` (``content``'s anchor) as version 0 of ``name``
    outside the transaction and returns its Upload, which keeps no tensor (``WeightLogWriter._upload_base``)."""

    def __init__(self, run: str, policy: str, upload):
        self.run, self.policy, self._upload = run, policy, upload
        self._copy: _Copy | None = None
        self._pending: _Copy | None = None  # announced in the open transaction

    def due(self, where: str) -> bool:
        c = self._copy
        return c is None or c.where != where or c.since >= c.size

    def uploaded(self, txn, content: Content) -> _Copy | None:
        """Before a version's own chunks: the copy of the base its adapter names, its chunks on the log (uploaded
        now when there is none, or when one is due); None for whole weights."""
        where = adapter_base(content)
        if where is None:
            return None
        if not self.due(where):
            return self._copy
        if self._pending is not None and self._pending.where == where:
            return self._pending  # uploaded for a transaction that did not commit: its chunks are still there
        with tempfile.TemporaryDirectory(prefix="rlstream-base-") as cache:
            base = read_folder(fetch_uri(where, Path(cache)))
        digest = content_hash(base)
        payload = encode(base, None)
        name = base_name(self.policy, digest)
        upload = self._upload(txn, name, base, digest, payload)
        del base, payload  # the base's size twice in memory while it goes, not after
        size = sum(upload.sizes)
        log.info("LoRA base %s (%.1f MB) uploaded to the weights log", name, size / 1e6)
        self._pending = _Copy(where, name, digest, upload, size=size)
        return self._pending

    def announce(self, txn, copy: _Copy) -> int:
        """``copy``'s manifest in ``txn``'s open transaction unless committed before; its offset."""
        if not copy.committed:
            _, copy.offset = records.produce_located(txn, self.run, "weights", copy.name.encode(),
                                                     [copy.upload.manifest(now_ms())], 0,
                                                     txn.transaction_timeout_s, partition=MANIFEST_PARTITION)
        return copy.offset

    def committed(self, copy: _Copy | None, version: int, payload_bytes: int, positions: Positions) -> None:
        """The transaction that announced ``version`` (whose adapter named ``copy``) committed."""
        if copy is None:
            return
        if not copy.committed:
            copy.committed, self._copy, self._pending = True, copy, None
            positions.pin(Placed(0, True, copy.offset, copy.upload.places), version)
        else:
            copy.since += payload_bytes
