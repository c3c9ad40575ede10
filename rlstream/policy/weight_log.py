"""Weights as a versioned log: policy versions on the run's ``weights`` topic, for workers that share no path.

The trainer (``--weights-transport kafka``) still writes each version to its own weight store (resume,
optimizer state), then puts the version on the topic as ``WeightChunk`` records (``rlstream.policy.deltas``
makes the payload): version 0, the first version a trainer process publishes, and every version that is a
multiple of ``--weights-anchor-every`` K are anchors (the whole folder); the rest are deltas against the
version before. So a delta's chain back to its anchor is at most K - 1 deltas long.

**Visibility.** A version's chunks are produced in the same transaction as its PolicyVersion record and the
offsets of the samples it was trained on. No PolicyVersion is visible to a read_committed reader before every
chunk of its weights is, and a step that aborts leaves no chunks behind (a redone step cannot leave two
committed payloads for one version). The chunks are flushed inside the transaction first: their delivery
reports give their offsets, which the PolicyVersion's URI then names. The cost is a longer transaction: the
payload's bytes are written while it is open (a few hundred MB take seconds on one broker; the trainer's
``--transaction-timeout-ms`` must cover it, and the broker's ``transaction.max.timeout.ms`` caps that).
Readers of policy-versions see the record only at the commit, as before. Models too large for that belong in
an object store (``--weights s3://...``, ``rlstream.policy.weights``).

**Order.** Chunks are keyed by policy, so one policy's versions are one ordered log in one partition, and a
version's chunks are contiguous among that policy's records.

**URI.** ``kafka:weights?policy=P&version=N&partition=p&offset=O&anchor=A&anchor_offset=AO``: version N's first
chunk is at offset O of partition p, its anchor A's first chunk at AO. A worker holding N - 1 reads from O;
one holding a version between A and N reads from where that version's chunks began; any other reads from AO,
and says in its log that it rebuilds from the anchor because the delta's base is not held.

**Checks.** Each rebuilt version must hash to the ``content_hash`` its chunks carry, and the version asked for to
the one its PolicyVersion carries; otherwise the version is refused (ValueError, logged, counted in
``rlstream_weights_refused_total``), nothing is written to the cache, and the worker keeps the weights it holds
(its engine's, and its folder; the reader applies deltas in place to the version it holds in memory, so after a
refusal its next fetch rebuilds from the anchor). Each version is hashed once, when it is rebuilt: the
PolicyVersion's hash is compared with that digest. An engine is handed a version's tensors (``load``) only after
both checks passed. Chunks no longer in the log, or not found, raise OSError.
Either way the rollout keeps generating with (and stamping) its current version.

**Retention.** The topic keeps records until the trainer deletes a prefix, and it deletes only up to the first
chunk of the newest anchor at or below ``version - η - 1``: every retained delta keeps its anchor, and every
version η can still need stays readable. Audit copies of every Nth version belong in the store
(``--keep-every``).

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
from urllib.parse import parse_qs, urlencode, urlparse

import torch

from rlstream import metrics
from rlstream.kafka import records
from rlstream.kafka.tail import read_from
from rlstream.policy.deltas import ANCHOR, DELTA, Content, apply, content_hash, encode, split, write_folder
from rlstream.schemas.headers import now_ms
from rlstream.schemas.records import PolicyVersion, WeightChunk

log = logging.getLogger(__name__)

SCHEME = "kafka"
#: Payload bytes per record: below the topics' 16 MiB message limit with room for the record around it.
CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class LogRef:
    """Where a version's chunks are on the weights topic (what its URI says)."""

    policy: str
    version: int
    partition: int
    offset: int
    anchor: int
    anchor_offset: int

    def uri(self) -> str:
        return f"{SCHEME}:weights?" + urlencode({
            "policy": self.policy, "version": self.version, "partition": self.partition, "offset": self.offset,
            "anchor": self.anchor, "anchor_offset": self.anchor_offset})


def _join(parts: list[bytes], into: bytearray | None) -> bytearray:
    """The parts back to back, in ``into`` when it has their size (reused: no fresh pages to fault in)."""
    size = sum(len(p) for p in parts)
    out = into if into is not None and len(into) == size else bytearray(size)
    view, at = memoryview(out), 0
    for p in parts:
        view[at:at + len(p)] = p
        at += len(p)
    return out


def is_log_uri(uri: str) -> bool:
    return uri.startswith(f"{SCHEME}:")


def parse_uri(uri: str) -> LogRef:
    """The LogRef a ``kafka:weights?...`` URI names; ValueError when it is not one."""
    parsed = urlparse(uri)
    if parsed.scheme != SCHEME or parsed.path != "weights":
        raise ValueError(f"{uri!r} is not a weights-log URI (kafka:weights?...)")
    q = {k: v[0] for k, v in parse_qs(parsed.query).items()}
    try:
        ref = LogRef(q["policy"], int(q["version"]), int(q["partition"]), int(q["offset"]), int(q["anchor"]),
                     int(q["anchor_offset"]))
    except (KeyError, ValueError) as exc:
        raise ValueError(f"weights-log URI {uri!r} lacks or garbles {exc}") from None
    if not 0 <= ref.anchor <= ref.version or (ref.anchor == ref.version) != (ref.anchor_offset == ref.offset):
        raise ValueError(f"weights-log URI {uri!r}: inconsistent anchor")
    return ref


class WeightLogWriter:
    """The trainer's side: puts each version on the topic inside the announcing transaction (module docstring)."""

    def __init__(self, run: str, policy: str, anchor_every: int = 10, chunk_bytes: int = CHUNK_BYTES):
        if anchor_every < 1:
            raise ValueError("--weights-anchor-every must be at least 1 (1: every version is an anchor)")
        self.run, self.policy = run, policy
        self.anchor_every, self.chunk_bytes = anchor_every, chunk_bytes
        self._base: tuple[int, Content] | None = None  # the last committed version, what the next delta is against
        self._anchors: list[tuple[int, int, int]] = []  # committed anchors: (version, partition, first offset)
        self._pending = None
        self._prepared = None  # (version, content, anchor, the payload's future): prepare's
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weights-encode")
        # The last anchor's payload once produced (its records are encoded copies): the next anchor is built in it.
        self._spare: bytearray | None = None
        self.last_payload_bytes = 0  # of the last version produced (benchmarks)

    def _anchor(self, version: int) -> bool:
        base = self._base
        return base is None or base[0] != version - 1 or version % self.anchor_every == 0

    def prepare(self, content: Content, version: int) -> None:
        """Start encoding ``version``'s payload in a thread, for ``produce`` to take: the trainer calls it as soon as
        the version's content exists, so the encoding runs beside the writing of its folder and its hash."""
        anchor = self._anchor(version)
        self._prepared = (version, content, anchor, self._pool.submit(encode, *self._encoding(anchor, content)))

    def _encoding(self, anchor: bool, content: Content) -> tuple:
        """``encode``'s arguments: a delta against the base; an anchor in the spare buffer, handed over."""
        if not anchor:
            return content, self._base[1]
        into, self._spare = self._spare, None
        return content, None, into

    def produce(self, txn, content: Content, digest: str, version: int, flush_timeout_s: float = 300.0) -> str:
        """Produce version ``version`` (its content, ``deltas.read_folder`` of the written checkpoint, and its
        ``content_hash``) into ``txn``'s open transaction; return its URI. A delivery error raises KafkaException,
        which aborts the transaction."""
        base, prepared, self._prepared = self._base, self._prepared, None
        if prepared is not None and prepared[0] == version and prepared[1] is content and \
                prepared[2] == self._anchor(version):
            anchor, payload = prepared[2], prepared[3].result()
        else:  # not prepared, or for another version or base (a redone step): encoded now
            anchor = self._anchor(version)
            payload = encode(*self._encoding(anchor, content))
        parts = split(payload, self.chunk_bytes)
        created, files = now_ms(), content.names()
        chunks = [WeightChunk(policy=self.policy, version=version, kind=ANCHOR if anchor else DELTA,
                              base_version=-1 if anchor else base[0], chunk=i, chunks=len(parts), files=files,
                              payload=part, content_hash=digest, created_at=created)
                  for i, part in enumerate(parts)]
        partition, offset = records.produce_located(txn, self.run, "weights", self.policy.encode(), chunks, version,
                                                    flush_timeout_s)
        if anchor:
            self._spare = payload
        if anchor:
            ref = LogRef(self.policy, version, partition, offset, version, offset)
        else:
            last = self._anchors[-1]
            ref = LogRef(self.policy, version, partition, offset, last[0], last[2])
        self._pending = (version, content, (version, partition, offset) if anchor else None)
        self.last_payload_bytes = len(payload)
        metrics.WEIGHTS_BYTES.labels(ANCHOR if anchor else DELTA).inc(len(payload))
        return ref.uri()

    def committed(self) -> None:
        """The transaction with the last produced version committed: the next delta builds on it."""
        version, content, anchor = self._pending
        self._base, self._pending = (version, content), None
        if anchor is not None:
            self._anchors.append(anchor)

    def truncation_point(self, keep_from: int) -> tuple[int, int] | None:
        """(partition, offset) before which no record is needed when versions from ``keep_from`` on must stay
        readable: the first chunk of the newest anchor at or below ``keep_from``; None when none is known."""
        below = [a for a in self._anchors if a[0] <= keep_from]
        if not below:
            return None
        self._anchors = [a for a in self._anchors if a[0] >= below[-1][0]]
        return below[-1][1], below[-1][2]


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
        (and is done when this returns or raises)."""
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
            if c.chunk != len(parts):
                raise ValueError(f"weights of {ref.policy} v{c.version}: chunk {c.chunk} where {len(parts)} was due")
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
