"""A weights version's place on the weights topic: its URI, its manifest (where its chunks lie, their hashes), and
what the log may lose.

Pure logic, no Kafka (``rlstream.policy.weight_log`` produces and reads the records):

- ``LogRef``: what a ``kafka:weights?...`` URI says; ``Upload``: a version's chunks once on the topic, and the
  manifest record that announces them.

- ``place``: the partition of each chunk of a version. With one partition, every record is in it. With more, the
  manifests have partition 0 to themselves (an ordered log of the policy's versions, read without fetching a byte
  of payload) and the chunks go round the others, starting one further on each version, so that a version's bytes,
  and a run of one-chunk deltas, are spread over the partitions (and their brokers).
- ``chunk_hash`` / ``payload_hash``: BLAKE3 of one chunk's bytes (a cryptographic hash at about three times
  sha256's speed on one core: writer and reader each hash every byte of every version once more); sha256 over every
  chunk's size and hash in index order, which covers the whole payload with that one pass over its bytes.
- ``Positions``: the committed versions' places, and from them the offset of each partition before which nothing a
  retained version needs lies (``truncation_points``). A chunk that no manifest names (an upload killed before
  its manifest was committed) lies before the chunks of every version produced after it, in its partition: once
  the first anchor produced after it is the truncation anchor, the trainer's prefix delete removes it with the
  retained versions' predecessors. That delete is the weights topic's only retention (not time, not compaction:
  the records' keys, policy/version/chunk, name what a chunk is, but a redone version may have fewer chunks, so
  compaction by key would not remove every orphan). A pinned version's records (a LoRA run's base, which every
  adapter version names) are never deleted: each partition's prefix delete stops before them.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlencode, urlparse

from blake3 import blake3

from rlstream.policy.deltas import Content
from rlstream.schemas.records import WeightChunk

#: The ``chunk`` index a manifest record carries (a chunk's is 0 or more).
MANIFEST = -1
#: The partition manifests go to.
MANIFEST_PARTITION = 0
SCHEME = "kafka"


@dataclass(frozen=True)
class LogRef:
    """Where a version is on the weights topic (what its URI says): ``manifest``, its manifest's offset in
    ``partition`` (and its anchor's manifest's at ``anchor_offset``); else (a log written before manifests) its
    first chunk's, all of its chunks after it in that partition. A LoRA version's also names its base on the log
    (``base``, the name its records carry, and ``base_offset``, its manifest's in ``MANIFEST_PARTITION``:
    ``rlstream.policy.log_bases``)."""

    policy: str
    version: int
    partition: int
    offset: int
    anchor: int
    anchor_offset: int
    manifest: bool = False
    base: str = ""
    base_offset: int = -1

    def uri(self) -> str:
        query = {"policy": self.policy, "version": self.version, "partition": self.partition, "offset": self.offset,
                 "anchor": self.anchor, "anchor_offset": self.anchor_offset}
        if self.manifest:
            query["layout"] = "manifest"
        if self.base:
            query.update(base=self.base, base_offset=self.base_offset)
        return f"{SCHEME}:weights?" + urlencode(query)

    def base_ref(self) -> LogRef:
        """Where the base this (LoRA) version names is: a version 0 of its own name, an anchor."""
        return LogRef(self.base, 0, MANIFEST_PARTITION, self.base_offset, 0, self.base_offset, manifest=True)


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
                     int(q["anchor_offset"]), q.get("layout") == "manifest", q.get("base", ""),
                     int(q.get("base_offset", -1)))
    except (KeyError, ValueError) as exc:
        raise ValueError(f"weights-log URI {uri!r} lacks or garbles {exc}") from None
    if not 0 <= ref.anchor <= ref.version or (ref.anchor == ref.version) != (ref.anchor_offset == ref.offset):
        raise ValueError(f"weights-log URI {uri!r}: inconsistent anchor")
    if ref.base and ref.base_offset < 0:
        raise ValueError(f"weights-log URI {uri!r}: a base without its offset")
    return ref


@dataclass
class Upload:
    """A version's chunks on the topic, not yet announced: what its manifest will say."""

    policy: str
    version: int
    kind: str
    base_version: int
    files: list[str]
    content_hash: str
    places: list[tuple[int, int]]  # (partition, offset) of each chunk
    hashes: list[str]
    sizes: list[int]
    content: Content  # what the next delta is against, once announced and committed

    def manifest(self, created_at: int) -> WeightChunk:
        return WeightChunk(policy=self.policy, version=self.version, kind=self.kind, base_version=self.base_version,
                           chunk=MANIFEST, chunks=len(self.places), files=self.files, payload=b"",
                           content_hash=self.content_hash, created_at=created_at,
                           chunk_partitions=[p for p, _ in self.places], chunk_offsets=[o for _, o in self.places],
                           chunk_hashes=self.hashes, payload_hash=payload_hash(self.sizes, self.hashes))


def place(partitions: int, version: int, count: int) -> list[int]:
    """The partition of each of ``count`` chunks of ``version`` on a topic of ``partitions`` partitions."""
    if partitions < 1:
        raise ValueError("a topic has at least one partition")
    if partitions == 1:
        return [0] * count
    spread = partitions - 1
    return [1 + (version + i) % spread for i in range(count)]


def chunk_hash(part) -> str:
    return blake3(part).hexdigest()


def payload_hash(sizes: list[int], hashes: list[str]) -> str:
    h = hashlib.sha256()
    for size, digest in zip(sizes, hashes, strict=True):
        h.update(f"{size}:{digest}\n".encode())
    return h.hexdigest()


@dataclass
class Placed:
    """One committed version's records: its manifest's offset, and each of its chunks' (partition, offset)."""

    version: int
    anchor: bool
    manifest_offset: int
    chunks: list[tuple[int, int]] = field(default_factory=list)


class Positions:
    """The committed versions of one writer, in order, for its retention (module docstring); and the records it
    keeps while versions that may still be needed name them (``pin``: a LoRA run's base)."""

    def __init__(self):
        self._placed: list[Placed] = []
        # (the first version that names it, partition -> its first record's offset) of each pinned version, oldest
        # first: what the prefix delete stops before.
        self._pins: list[tuple[int, dict[int, int]]] = []

    def add(self, placed: Placed) -> None:
        self._placed.append(placed)

    def pin(self, placed: Placed, from_version: int) -> None:
        """Keep ``placed``'s records (its manifest and chunks) while a version from ``from_version`` on may still be
        needed: a LoRA base, which the versions after it name. An older pin goes once every version that may still
        be needed names a newer one."""
        offsets = {MANIFEST_PARTITION: placed.manifest_offset}
        for partition, offset in placed.chunks:
            offsets[partition] = min(offsets.get(partition, offset), offset)
        self._pins.append((from_version, offsets))

    def anchor_of(self, version: int) -> Placed:
        """The newest anchor at or below ``version`` (a delta's); LookupError when none is known."""
        for p in reversed(self._placed):
            if p.anchor and p.version <= version:
                return p
        raise LookupError(f"no anchor at or below v{version} is known")

    def truncation_points(self, keep_from: int) -> dict[int, int]:
        """partition -> the offset before which no record is needed, when versions from ``keep_from`` on must stay
        readable: below the newest anchor at or below ``keep_from`` and every version after it. A partition none of
        those has a chunk in is cut after the last chunk a version before them had there. Empty when no anchor is
        at or below ``keep_from``. The versions below that anchor are forgotten."""
        try:
            anchor = self.anchor_of(keep_from)
        except LookupError:
            return {}
        at = self._placed.index(anchor)
        older, kept = self._placed[:at], self._placed[at:]
        points = {MANIFEST_PARTITION: anchor.manifest_offset}
        for p in older:
            for partition, offset in p.chunks:
                points[partition] = max(points.get(partition, 0), offset + 1)
        needed: dict[int, int] = {}
        for p in kept:
            for partition, offset in p.chunks:
                needed[partition] = min(needed.get(partition, offset), offset)
        points.update(needed)
        points[MANIFEST_PARTITION] = min(points[MANIFEST_PARTITION], needed.get(MANIFEST_PARTITION,
                                                                                anchor.manifest_offset))
        while len(self._pins) > 1 and self._pins[1][0] <= keep_from:
            self._pins.pop(0)  # no version from keep_from on names it: a newer pin covers them all
        for _, offsets in self._pins:
            for partition, offset in offsets.items():
                if partition in points:
                    points[partition] = min(points[partition], offset)
        self._placed = kept
        return points
