"""Weights as a versioned log: policy versions on the run's ``weights`` topic, for workers that share no path.

The trainer (``--weights-transport kafka``) still writes each version to its own weight store (resume,
optimizer state), then puts the version on the topic as ``WeightChunk`` records (``rlstream.policy.deltas``
makes the payload): version 0, the first version a trainer process publishes, and every version that is a
multiple of ``--weights-anchor-every`` K are anchors (the whole folder); the rest are deltas against the
version before. So a delta's chain back to its anchor is at most K - 1 deltas long.

**Visibility.** A version of any size: its chunks are produced first, outside any transaction, by the trainer's
companion idempotent producer (``TransactionalProducer.outside``; ``rlstream.kafka.transactions`` says how that
interacts with read_committed), each keyed by policy/version/index. Then one manifest record (``chunk`` -1: every
chunk's partition, offset and BLAKE3 hash, the payload's hash, the content hash) goes in the announcing transaction
with the PolicyVersion that names it and the offsets of the samples trained. Readers trust only chunks a committed
manifest names, at the place it names: a chunk with no committed manifest (a trainer killed mid-upload, a step
whose transaction aborted) is never read, and the trainer's prefix delete removes it later (``manifest``, which
says when). The transaction carries no payload bytes, so its timeout does not grow with the model; the upload's
and the read's do (``transfer_timeout_s``, the one sizing rule).

**Order.** Manifests have partition 0 to themselves: one ordered log of every policy's versions, read without a byte
of payload. Chunks go round the other partitions (``manifest.place``), so several brokers share a version's bytes;
a reader puts a version's chunks in index order and applies versions in their manifests' order. A log written
before manifests (no ``layout=manifest`` in its URIs) is still read: one partition, chunks in the transaction.

**URI.** ``kafka:weights?policy=P&version=N&partition=0&offset=O&anchor=A&anchor_offset=AO&layout=manifest``:
version N's manifest is at offset O, its anchor A's at AO. A worker holding N - 1 reads from O;
one holding a version between A and N reads from that version's manifest on; any other reads from AO,
and says in its log that it rebuilds from the anchor because the delta's base is not held.

**LoRA.** A LoRA version (an adapter folder) is an anchor every time, and its base goes on the log once, as a
version of its own name, with the first version whose adapter names it; the version's URI names it
(``rlstream.policy.log_bases``, which says how it is kept and when it goes again).

**Checks.** Each rebuilt version must hash to the ``content_hash`` its chunks carry, and the version asked for to
the one its PolicyVersion carries; otherwise the version is refused (ValueError, logged, counted in
``rlstream_weights_refused_total``), nothing is written to the cache, and the worker keeps the weights it holds
(its engine's, and its folder; the reader applies deltas in place to the version it holds in memory, so after a
refusal its next fetch rebuilds from the anchor). Each version is hashed once, when it is rebuilt: the
PolicyVersion's hash is compared with that digest. An engine is handed a version's tensors (``load``) only after
both checks passed. Chunks no longer in the log, or not found, raise OSError.
Either way the rollout keeps generating with (and stamping) its current version.

**Retention.** The topic keeps records until the trainer deletes a prefix of each partition, and only below the
newest anchor at or below ``version - η - 1`` and every version after it (``manifest.Positions``): every retained
delta keeps its anchor, every version η can still need stays readable, and orphan chunks go with what lies below.

**Resume.** A restarted trainer resumes from its own store (with the optimizer state). A trainer on a new host,
whose store lacks the announced version, rebuilds it from the log as a worker does (the anchor and the deltas after
it, hash-checked) and resumes from it with a new optimizer state; which samples it trained is in Kafka already
(the committed offsets and their metadata), so it trains none twice.
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from rlstream import metrics
from rlstream.kafka import records
from rlstream.kafka.tail import read_from
from rlstream.kafka.topics import MAX_MESSAGE_BYTES, delete_before, topic_name
from rlstream.kafka.transactions import transfer_timeout_s
from rlstream.policy.deltas import ANCHOR, DELTA, Content, apply, content_hash, encode, split, write_folder
from rlstream.policy.log_bases import BaseOnLog, adapter_base
from rlstream.policy.manifest import (MANIFEST, MANIFEST_PARTITION, SCHEME, LogRef, Placed, Positions, Upload,
                                      chunk_hash, is_log_uri, parse_uri, payload_hash, place)
from rlstream.schemas.headers import now_ms
from rlstream.schemas.records import PolicyVersion, WeightChunk

log = logging.getLogger(__name__)

#: Payload bytes per record: below the topics' 16 MiB message limit with room for the record around it.
CHUNK_BYTES = 8 * 1024 * 1024


def _join(parts: list[bytes], into: bytearray | None) -> bytearray:
    """The parts back to back, in ``into`` when it has their size (reused: no fresh pages to fault in)."""
    size = sum(len(p) for p in parts)
    out = into if into is not None and len(into) == size else bytearray(size)
    view, at = memoryview(out), 0
    for p in parts:
        view[at:at + len(p)] = p
        at += len(p)
    return out


class WeightLogWriter:
    """The trainer's side: uploads each version's chunks outside the transaction, then announces it with a manifest
    inside the transaction (module docstring)."""

    def __init__(self, run: str, policy: str, anchor_every: int = 10, chunk_bytes: int = CHUNK_BYTES):
        if anchor_every < 1:
            raise ValueError("--weights-anchor-every must be at least 1 (1: every version is an anchor)")
        if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES - 65536:
            raise ValueError(f"a weights chunk must be 1 to {MAX_MESSAGE_BYTES - 65536} bytes (the topic's message "
                             f"limit less the record around it), not {chunk_bytes}")
        self.run, self.policy = run, policy
        self.anchor_every, self.chunk_bytes = anchor_every, chunk_bytes
        self._base: tuple[int, Content] | None = None  # the last committed version, what the next delta is against
        self._positions = Positions()  # the committed versions' records, for retention
        self._partitions: int | None = None  # the weights topic's, read once
        self._pending = None
        self._log_start: dict[int, int] = {}  # each partition's start offset after the last truncate
        self._prepared = None  # (version, content, anchor, the payload's future): prepare's
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weights-encode")
        # The last anchor's payload once produced (its records are encoded copies): the next anchor is built in it.
        self._spare: bytearray | None = None
        self.last_payload_bytes = 0  # of the last version produced (benchmarks)
        self.last_upload_s = 0.0  # the last upload's seconds, from its first chunk produced to its last delivered
        self._lora = BaseOnLog(run, policy, self._upload_base)  # a LoRA run's base (log_bases)

    def _anchor(self, version: int, content: Content) -> bool:
        base = self._base
        return base is None or base[0] != version - 1 or version % self.anchor_every == 0 or \
            adapter_base(content) is not None  # an adapter is small: whole every version (log_bases)

    def prepare(self, content: Content, version: int) -> None:
        """Start encoding ``version``'s payload in a thread, for ``produce`` to take: the trainer calls it as soon as
        the version's content exists, so the encoding runs beside the writing of its folder and its hash."""
        anchor = self._anchor(version, content)
        self._prepared = (version, content, anchor, self._pool.submit(encode, *self._encoding(anchor, content)))

    def _encoding(self, anchor: bool, content: Content) -> tuple:
        """``encode``'s arguments: a delta against the base; an anchor in the spare buffer, handed over."""
        if not anchor:
            return content, self._base[1]
        into, self._spare = self._spare, None
        return content, None, into

    def produce(self, txn, content: Content, digest: str, version: int) -> str:
        """Put version ``version`` (its content, ``deltas.read_folder`` of the written checkpoint, and its
        ``content_hash``) on the topic: ``upload``, then ``announce`` in ``txn``'s open transaction; its URI. Called
        in the transaction's body before anything else is produced in it, the upload does not run on the
        transaction's clock (``rlstream.kafka.transactions``). A delivery error raises KafkaException, which aborts
        the transaction. A LoRA version's base goes before it, when due (``log_bases``)."""
        base = self._lora.uploaded(txn, content)
        return self.announce(txn, self.upload(txn, content, digest, version), base)

    def upload(self, txn, content: Content, digest: str, version: int) -> Upload:
        """Produce the version's chunks through ``txn``'s companion idempotent producer, outside any transaction,
        and wait until every one is acknowledged (within ``transfer_timeout_s`` of the payload). No reader trusts
        them before ``announce`` commits their manifest."""
        base, prepared, self._prepared = self._base, self._prepared, None
        if prepared is not None and prepared[0] == version and prepared[1] is content and \
                prepared[2] == self._anchor(version, content):
            anchor, payload = prepared[2], prepared[3].result()
        else:  # not prepared, or for another version or base (a redone step): encoded now
            anchor = self._anchor(version, content)
            payload = encode(*self._encoding(anchor, content))
        upload = self._upload_payload(txn, self.policy, version, anchor, None if anchor else base[0], content, digest,
                                      payload)
        if anchor:
            self._spare = payload
        return upload

    def _upload_base(self, txn, name: str, content: Content, digest: str, payload: bytearray) -> Upload:
        """A LoRA base's anchor (``log_bases``) as version 0 of ``name``; its Upload keeps none of its tensors."""
        return self._upload_payload(txn, name, 0, True, None, Content(files={}), digest, payload,
                                    files=content.names())

    def _upload_payload(self, txn, policy: str, version: int, anchor: bool, base_version: int | None,
                        content: Content, digest: str, payload: bytearray, files: list[str] | None = None) -> Upload:
        parts = split(payload, self.chunk_bytes)
        topic = topic_name(self.run, "weights")
        if self._partitions is None:
            self._partitions = len(txn.outside().producer.list_topics(topic, timeout=30).topics[topic].partitions)
        where = place(self._partitions, version, len(parts))
        created, files, hashes = now_ms(), files if files is not None else content.names(), []

        def chunks():
            for i, part in enumerate(parts):
                hashes.append(chunk_hash(part))  # hashlib lets go of the GIL: the chunks before it go out meanwhile
                # Keyed by what the chunk is (policy, version, index); placed by ``place``, not by the key.
                yield (f"{policy}/{version}/{i}".encode(),
                       WeightChunk(policy=policy, version=version, kind=ANCHOR if anchor else DELTA,
                                   base_version=-1 if anchor else base_version, chunk=i, chunks=len(parts), files=files,
                                   payload=part, content_hash=digest, created_at=created), where[i])

        started = time.monotonic()
        places = records.produce_placed(txn.outside(), self.run, "weights", chunks(), version,
                                        transfer_timeout_s(len(payload)))
        self.last_upload_s = time.monotonic() - started
        self.last_payload_bytes = len(payload)
        metrics.WEIGHTS_BYTES.labels(ANCHOR if anchor else DELTA).inc(len(payload))
        return Upload(policy, version, ANCHOR if anchor else DELTA, -1 if anchor else base_version, files, digest,
                      places, hashes, [len(p) for p in parts], content)

    def announce(self, txn, upload: Upload, base=None) -> str:
        """Produce ``upload``'s manifest into ``txn``'s open transaction (the PolicyVersion that names the URI
        returned goes in the same one); the version exists for readers once it commits. ``base``: a LoRA version's
        (``BaseOnLog.uploaded``), announced before it unless it was before, and named in its URI."""
        base_offset = self._lora.announce(txn, base) if base is not None else -1
        partition, offset = records.produce_located(txn, self.run, "weights", self.policy.encode(),
                                                    [upload.manifest(now_ms())],
                                                    upload.version, txn.transaction_timeout_s,
                                                    partition=MANIFEST_PARTITION)
        anchor = upload.kind == ANCHOR
        delta_base = None if anchor else self._positions.anchor_of(upload.version - 1)
        ref = LogRef(self.policy, upload.version, partition, offset,
                     upload.version if anchor else delta_base.version,
                     offset if anchor else delta_base.manifest_offset, manifest=True,
                     base=base.name if base is not None else "", base_offset=base_offset)
        self._pending = (upload.version, upload.content, Placed(upload.version, anchor, offset, upload.places), base,
                         sum(upload.sizes))
        return ref.uri()

    def committed(self) -> None:
        """The transaction with the last produced version committed: the next delta builds on it."""
        version, content, placed, base, size = self._pending
        self._base, self._pending = (version, content), None
        self._positions.add(placed)
        self._lora.committed(base, version, size, self._positions)

    def truncation_points(self, keep_from: int) -> dict[int, int]:
        """partition -> offset before which no record is needed when versions from ``keep_from`` on must stay
        readable (``manifest.Positions``); empty when no anchor at or below it is known."""
        return self._positions.truncation_points(keep_from)

    def truncate(self, client_config: dict, keep_from: int) -> None:
        """Delete the log before the anchor that version ``keep_from`` builds on; housekeeping, so a failure is
        logged and the next call tries again."""
        for partition, offset in self.truncation_points(keep_from).items():
            if offset <= self._log_start.get(partition, 0):
                continue
            try:
                self._log_start[partition] = delete_before(client_config, self.run, "weights", partition, offset)
            except Exception as exc:
                log.warning("could not delete the weights log's partition %d before offset %d: %s", partition,
                            offset, exc)


@dataclass
class _Held:
    version: int
    content: Content
    ref: LogRef
    folder: Path | None  # its folder in the cache, once a caller asked for one
    digest: str  # content_hash(content), computed when it was rebuilt
    buffer: bytearray | None  # the anchor's payload, which the content's tensors are views of


class WeightLogReader:
    """A worker's side: rebuilds announced versions from the topic, checked by hash, for an engine to load from memory
    (``load``) or from a folder in its own cache (``fetch``).

    Safe to call from several threads (one call at a time). The newest verified version stays in memory as the base
    of the next delta; the folders of it and of the one before stay on disk (an engine may still be reading the
    previous one). A folder is written only for a caller that asks for one (a server fleet, a teacher, a resuming
    trainer): an in-process engine loads the tensors as they are, and the anchor's buffer is reused by the next
    anchor (a fresh 200 MB buffer costs its page faults, about as much as reading it from the broker)."""

    def __init__(self, client_config: dict, run: str, cache_dir: Path, timeout_s: float = 300.0):
        self.client_config, self.run = client_config, run
        self.cache_dir = Path(cache_dir)
        self.timeout_s = timeout_s
        self._held: _Held | None = None
        self._bases: dict[str, Path] = {}  # base hash -> the folder of a LoRA base rebuilt and checked (``base``)
        self._spare: bytearray | None = None  # a dropped anchor's buffer, for the next anchor to be read into
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weights-aside")

    def fetch(self, pv: PolicyVersion, folder: bool = True) -> Path | None:
        """The local folder of ``pv``'s weights (``folder=False``: rebuilt and checked only, as a prefetch for
        ``load``; None); ValueError when refused, OSError when not readable."""
        with self._lock:
            held = self._hold(pv, folder)
            if folder and held.folder is None:
                self._write_aside(held.ref, held.content)
                held.folder = self._move_in(held.ref)
                self._drop_old(held.ref.policy, keep={held.folder})
            return held.folder

    def base(self, pv: PolicyVersion) -> Path:
        """The folder of the base that LoRA version ``pv`` names on the log (``log_bases``): rebuilt once, checked
        against the ``base_hash`` ``pv`` carries, then kept; errors as ``fetch``'s."""
        known = self._bases.get(pv.base_hash)
        if known is not None and known.is_dir():
            return known
        try:
            ref = parse_uri(pv.weights_uri)
            if not ref.base:
                raise ValueError("it is a LoRA version whose URI names no base on the log")
        except ValueError as exc:
            raise self._refuse(pv, "invalid", str(exc)) from None
        folder = self.fetch(PolicyVersion(ref.base, 0, ref.base_ref().uri(), created_at=0, published_at=0,
                                          content_hash=pv.base_hash))
        self._bases[pv.base_hash] = folder
        return folder

    def load(self, pv: PolicyVersion, use: Callable[[dict[str, torch.Tensor]], None]) -> None:
        """Call ``use(tensors)`` with ``pv``'s tensors, rebuilt and checked as ``fetch`` does, but with no folder
        written. ``use`` runs under the reader's lock, so no delta changes the tensors while it reads them: it must
        copy what it keeps (an engine's ``load_state_dict`` does). Its errors propagate."""
        with self._lock:
            use(self._hold(pv, False).content.tensors)

    def _hold(self, pv: PolicyVersion, folder: bool) -> _Held:
        """``pv`` rebuilt and checked, now the held version (its folder written when ``folder``)."""
        held = self._held
        if held is not None and held.version == pv.version and held.ref.policy == pv.policy:
            self._check(pv, held.digest)
            return held
        ref = None
        try:
            ref = parse_uri(pv.weights_uri)
            if ref.version != pv.version or ref.policy != pv.policy:
                raise ValueError(f"its URI names {ref.policy} v{ref.version}")
            base = held if held is not None and held.ref.policy == ref.policy else None
            # The held content is the base the deltas are applied to, in place (no copy of every changed tensor):
            # from here on it is no longer the held version's, whatever happens.
            self._held = None
            # A folder asked for is written aside while the version is hashed, and moved in once every check passed.
            beside = (lambda rebuilt: self._write_aside(ref, rebuilt)) if folder else None
            content, digest, buffer = self._rebuild(ref, base, beside)
            self._check(pv, digest)
        except ValueError as exc:
            self._discard_aside(ref)
            raise self._refuse(pv, "invalid", str(exc)) from None
        except OSError as exc:
            self._discard_aside(ref)
            metrics.WEIGHTS_REFUSED.labels("unreadable").inc()
            raise OSError(f"{pv.policy} v{pv.version} not readable from the weights log: {exc}") from None
        moved = self._move_in(ref) if folder else None
        self._held = _Held(ref.version, content, ref, moved, digest, buffer)
        # The folders of this version and the one before stay (an engine may still read the one before); with
        # versions loaded from memory, an older folder (the one the engine started from) goes a version later.
        self._drop_old(ref.policy, keep={f for f in (moved, held.folder if held is not None else None) if f})
        return self._held

    def _rebuild(self, ref: LogRef, held: _Held | None, beside=None) -> tuple[Content, str, bytearray | None]:
        started = time.monotonic()
        if held is not None and ref.anchor <= held.version < ref.version:
            start = ref.offset if held.version == ref.version - 1 else held.ref.offset
            base = (held.version, held.content, held.buffer)
        else:
            start, base = ref.anchor_offset, None
            if held is not None and held.buffer is not None:
                self._spare = held.buffer  # the held version is dropped (``_hold``): nothing reads its tensors now
            if ref.anchor != ref.version:
                log.warning("v%d is a delta whose base v%d is not held here (%s): rebuilding from anchor v%d",
                            ref.version, ref.version - 1,
                            f"holding v{held.version}" if held is not None else "nothing held yet", ref.anchor)
        version, content, digest, buffer = self._read(ref, start, base, beside)
        log.info("weights %s v%d rebuilt from the log in %.2fs (from %s)", ref.policy, version,
                 time.monotonic() - started, f"v{base[0]}" if base else f"anchor v{ref.anchor}")
        return content, digest, buffer

    def _read(self, ref: LogRef, start: int, base: tuple[int, Content, bytearray | None] | None,
              beside=None) -> tuple[int, Content, str, bytearray | None]:
        """Apply the policy's versions from offset ``start`` on to ``base`` (version, content, its anchor's buffer;
        its tensors changed in place) until ``ref.version``; that version, its content, its hash (checked against its
        chunks') and its anchor's buffer. ``beside(content)`` runs in a thread while the version asked for is hashed
        (and is done when this returns or raises). With manifests, ``start`` is a manifest's offset, and only the
        chunks a committed manifest names are read; else (a log written before them) the chunks follow ``start``."""
        version, content, buffer = base if base is not None else (-1, None, None)
        parts: list[bytes] = []
        first = True
        for seen in read_from(self.client_config, self.run, "weights", ref.partition, start,
                              timeout=self.timeout_s, name=f"weights-{ref.policy}"):
            if first and seen.offset != start:
                raise OSError(f"weights of {ref.policy} v{ref.version}: offset {start} is no longer in the log "
                              f"(it starts at {seen.offset})")
            first = False
            c = seen.record
            if not isinstance(c, WeightChunk) or c.policy != ref.policy or c.version <= version:
                continue  # another policy's, or versions the base already holds
            if c.version > ref.version:
                break
            if ref.manifest:
                if c.chunk != MANIFEST:
                    continue  # a chunk (with one partition): read where its manifest says, once it is read
                parts = self._chunks(c)
            else:
                if c.chunk != len(parts):
                    raise ValueError(f"weights of {ref.policy} v{c.version}: chunk {c.chunk} where {len(parts)} "
                                     "was due")
                parts.append(c.payload)
                if len(parts) < c.chunks:
                    continue
            if c.kind == DELTA and c.base_version != version:
                raise ValueError(f"v{c.version} is a delta on v{c.base_version}, but v{version} came before it")
            if c.kind == ANCHOR:  # one copy, which the anchor's tensors are then views of
                payload = buffer = _join(parts, self._spare)
                self._spare = None
            else:
                payload = bytearray().join(parts)
            parts = []
            rebuilt = apply(payload, None if c.kind == ANCHOR else content, in_place=True)
            aside = self._pool.submit(beside, rebuilt) if beside is not None and c.version == ref.version else None
            try:
                digest = content_hash(rebuilt)
            finally:
                if aside is not None:
                    aside.result()
            if digest != c.content_hash:
                raise ValueError(f"v{c.version} rebuilt from the log does not match its chunks' hash")
            version, content = c.version, rebuilt
            if version == ref.version:
                return version, content, digest, buffer
        raise OSError(f"weights of {ref.policy} v{ref.version} not found in the log from offset {start}")

    def _chunks(self, m: WeightChunk) -> list[bytes]:
        """The payloads of the chunks manifest ``m`` names, in index order, each checked against its hash and all of
        them against the manifest's payload hash (ValueError); OSError when one is no longer (or not) in the log.
        Each partition is read in its own thread, from the first of the version's chunks there to its last; the
        records in between that the manifest does not name (an upload killed before its manifest, another
        policy's) are passed over."""
        n = m.chunks
        if not (len(m.chunk_partitions) == len(m.chunk_offsets) == len(m.chunk_hashes) == n):
            raise ValueError(f"the manifest of {m.policy} v{m.version} lists {n} chunks but not a place and hash each")
        wanted: dict[int, dict[int, int]] = {}  # partition -> offset -> chunk index
        for i, (p, o) in enumerate(zip(m.chunk_partitions, m.chunk_offsets)):
            wanted.setdefault(p, {})[o] = i
        # Sized from the payload: a chunk record is at most the topics' message limit.
        timeout = max(self.timeout_s, transfer_timeout_s(n * MAX_MESSAGE_BYTES))
        out: list = [None] * n

        def read(partition: int, at: dict[int, int]) -> None:
            start, left = min(at), dict(at)
            for seen in read_from(self.client_config, self.run, "weights", partition, start, timeout=timeout,
                                  name=f"weights-{m.policy}-{partition}"):
                if seen.offset > start and start in left:
                    raise OSError(f"chunk at {partition}@{start} is no longer in the log (it starts at {seen.offset})")
                i = left.pop(seen.offset, None)
                if i is None:
                    continue
                c = seen.record
                if not isinstance(c, WeightChunk) or (c.policy, c.version, c.chunk) != (m.policy, m.version, i):
                    raise ValueError(f"the manifest of {m.policy} v{m.version} names {partition}@{seen.offset} as "
                                     f"its chunk {i}, which it is not")
                if chunk_hash(c.payload) != m.chunk_hashes[i]:
                    raise ValueError(f"chunk {i} of {m.policy} v{m.version} does not match its manifest's hash")
                out[i] = c.payload
                if not left:
                    return
            raise OSError(f"chunks {sorted(left.values())} of {m.policy} v{m.version} not found in partition "
                          f"{partition}")

        groups = list(wanted.items())
        if len(groups) == 1:
            read(*groups[0])
        else:
            with ThreadPoolExecutor(len(groups), thread_name_prefix="weights-read") as pool:
                for f in [pool.submit(read, p, at) for p, at in groups]:
                    f.result()
        if payload_hash([len(x) for x in out], m.chunk_hashes) != m.payload_hash:
            raise ValueError(f"the chunks of {m.policy} v{m.version} do not match its manifest's payload hash")
        return out

    def _check(self, pv: PolicyVersion, digest: str) -> None:
        """``digest``: the hash of the content, computed from its tensors when it was rebuilt (once: it is the
        chunks' hash too, checked in ``_read``)."""
        if pv.content_hash and digest != pv.content_hash:
            raise self._refuse(pv, "hash_mismatch", "its weights do not match the hash its PolicyVersion carries")

    @staticmethod
    def _refuse(pv: PolicyVersion, reason: str, why: str) -> ValueError:
        metrics.WEIGHTS_REFUSED.labels(reason).inc()
        log.error("refusing %s v%d: %s; keeping the weights held now", pv.policy, pv.version, why)
        return ValueError(f"{pv.policy} v{pv.version} refused: {why}")

    def _folder(self, ref: LogRef) -> Path:
        return self.cache_dir / ref.policy / f"v{ref.version}"

    def _aside(self, ref: LogRef) -> Path:
        return self._folder(ref).with_name(f"v{ref.version}.tmp")

    def _discard_aside(self, ref: LogRef | None) -> None:
        if ref is not None:  # None: the URI did not parse, nothing was written
            shutil.rmtree(self._aside(ref), ignore_errors=True)

    def _write_aside(self, ref: LogRef, content: Content) -> None:
        tmp = self._aside(ref)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_folder(content, tmp)

    def _move_in(self, ref: LogRef) -> Path:
        """The version's folder under the cache, appearing whole (written aside, then renamed)."""
        final = self._folder(ref)
        shutil.rmtree(final, ignore_errors=True)
        self._aside(ref).rename(final)
        return final

    def _drop_old(self, policy: str, keep: set[Path]) -> None:
        for folder in (self.cache_dir / policy).glob("v*"):
            if folder not in keep:
                shutil.rmtree(folder, ignore_errors=True)
