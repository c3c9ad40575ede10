"""Weights versions larger than a transaction can carry, against the real broker: the chunks go outside the
transaction, the manifest and the PolicyVersion inside it. With the trainer's transaction timeout at 1 s, a version
whose upload takes longer is published, read and hash-checked; a publisher SIGKILLed mid-upload leaves chunks that
no reader accepts, the next publish works past them, and the trainer's retention deletes them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from confluent_kafka import Consumer, KafkaException, TopicPartition

from rlstream.kafka import records
from rlstream.kafka.topics import create_topics, delete_before, delete_topics, topic_name
from rlstream.policy.deltas import Content, content_hash
from rlstream.policy.manifest import MANIFEST
from rlstream.policy.weight_log import WeightLogReader, WeightLogWriter, parse_uri
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import PolicyVersion, WeightChunk
from tests.helpers.kafka import read_all, wait_for
from tests.helpers.weights import POLICY, content_of, publish, trainer_producer

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

#: A version whose upload outlasts the transaction timeout with margin on this project's 2-core machine, quiet or
#: loaded: 256 MiB took 0.7 s on a quiet one (CI) and 2.5-6 s on a loaded one, so 768 MiB takes about 2 s or more
#: against the 1 s timeout (librdkafka's smallest). Small enough that the writer, the reader and the killed
#: publisher together stay near 4 GB.
MB = 768
TIMEOUT_MS = 1000


def watermarks(bootstrap: str, run: str, partitions: int) -> list[tuple[int, int]]:
    """Each weights partition's (low, high) watermarks, asked again while a new topic's leaders settle."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{run}.marks"})
    try:
        for _ in range(50):
            try:
                return [c.get_watermark_offsets(TopicPartition(topic_name(run, "weights"), p), timeout=30)
                        for p in range(partitions)]
            except KafkaException:  # NOT_LEADER_FOR_PARTITION just after the topic's creation
                time.sleep(0.2)
        raise AssertionError(f"no watermarks for {run}.weights")
    finally:
        c.close()


@pytest.mark.timeout(300)
def test_a_version_past_the_transaction_is_published_and_a_killed_upload_leaves_no_version(bootstrap, tmp_path):
    run = "t" + uuid.uuid4().hex[:10]
    # Three partitions: the manifests' and two that share the chunks.
    create_topics({"bootstrap.servers": bootstrap}, run, partitions=3)
    try:
        # -- a trainer killed mid-upload ------------------------------------------------------------------------
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        killed = subprocess.Popen([sys.executable, "-m", "tests.helpers.weights", bootstrap, run, str(MB), "1", "0",
                                   str(TIMEOUT_MS)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            # A chunk in each of the two chunk partitions (the forged manifest below names one orphan in each):
            # a total of two could be both in one partition, whose batch the broker acked first (CI at 25cbae7).
            wait_for(lambda: all(hi >= 1 for _, hi in watermarks(bootstrap, run, 3)[1:]), 120, "the first chunks")
        finally:
            killed.send_signal(signal.SIGKILL)
            out = killed.communicate(timeout=30)[0].decode()
        assert "published" not in out, out
        orphans = [s for s in read_all(bootstrap, run, "weights")]
        assert 2 <= len(orphans) < MB // 8, "the kill came after the upload, not during it"
        assert all(s.record.version == 0 for s in orphans)
        assert {s.partition for s in orphans} == {1, 2}, "the orphans are not in both chunk partitions"
        assert all(s.record.chunk != MANIFEST for s in orphans), "no manifest was committed"
        assert read_all(bootstrap, run, "policy-versions") == [], "no version was announced"

        # -- the next trainer publishes the same version (another content) under a 1 s transaction timeout -----
        txn = trainer_producer(bootstrap, run, TIMEOUT_MS)  # fences the killed one's transactional id
        writer = WeightLogWriter(run, POLICY, anchor_every=1)
        big = content_of(MB, 2)
        pv0 = publish(txn, writer, big, 0)
        assert writer.last_upload_s > TIMEOUT_MS / 1000, \
            f"the upload took {writer.last_upload_s:.1f}s, within the transaction timeout: raise MB to prove it"
        chunks = [s for s in read_all(bootstrap, run, "weights") if s.record.chunk != MANIFEST]
        assert {s.partition for s in chunks} == {1, 2}, "the chunks are not spread over the partitions"
        [manifest] = [s.record for s in read_all(bootstrap, run, "weights") if s.record.chunk == MANIFEST]
        named = set(zip(manifest.chunk_partitions, manifest.chunk_offsets))
        assert manifest.chunks == len(named) == -(-writer.last_payload_bytes // (8 << 20))
        assert named <= {(s.partition, s.offset) for s in chunks if s.record.version == 0}
        orphan_places = {(s.partition, s.offset) for s in orphans}
        assert not orphan_places & named

        reader = WeightLogReader({"bootstrap.servers": bootstrap}, run, tmp_path / "cache")
        got = {}
        reader.load(pv0, lambda tensors: got.update(hash=content_hash(Content(tensors, {}, big.files))))
        assert got["hash"] == content_hash(big) == pv0.content_hash

        # -- a manifest that names the orphans, with the published chunks' hashes: refused -------------------
        forged = WeightChunk(**{**{f: getattr(manifest, f) for f in manifest.__slots__}, "version": 1})
        forged.chunk_offsets = [next(o for p, o in sorted(orphan_places) if p == manifest.chunk_partitions[i])
                                for i in range(forged.chunks)]
        pv1 = _announce_forged(txn, run, forged, manifest)
        with pytest.raises(ValueError, match="refused"):
            WeightLogReader({"bootstrap.servers": bootstrap}, run, tmp_path / "cache2").load(pv1, lambda t: None)

        # -- retention: once a later anchor is the oldest needed, the orphans are deleted ----------------------
        small = content_of(1, 3)
        pv2 = publish(txn, writer, small, 2)
        for partition, offset in writer.truncation_points(2).items():
            delete_before({"bootstrap.servers": bootstrap}, run, "weights", partition, offset)
        lows = dict(enumerate(lo for lo, _ in watermarks(bootstrap, run, 3)))
        assert all(offset < lows[p] for p, offset in orphan_places), (lows, sorted(orphan_places))
        reader.load(pv2, lambda tensors: got.update(small=content_hash(Content(tensors, {}, small.files))))
        assert got["small"] == pv2.content_hash
    finally:
        delete_topics({"bootstrap.servers": bootstrap}, run)


def _announce_forged(txn, run: str, forged: WeightChunk, real: WeightChunk) -> PolicyVersion:
    """Commit ``forged`` as v1's manifest with a PolicyVersion naming it (what a buggy or hostile writer might)."""
    out = {}

    def body():
        [(partition, offset)] = records.produce_placed(txn, run, "weights", [(POLICY.encode(), forged, 0)], 1,
                                                       txn.transaction_timeout_s)
        ref = parse_uri(f"kafka:weights?policy={POLICY}&version=1&partition=0&offset={offset}&anchor=1"
                        f"&anchor_offset={offset}&layout=manifest")
        out["pv"] = PolicyVersion(POLICY, 1, ref.uri(), created_at=hdr.now_ms(), published_at=hdr.now_ms(),
                                  content_hash=real.content_hash)
        records.produce(txn, run, "policy-versions", POLICY.encode(), out["pv"], 1)
    assert txn.transact(body)
    return out["pv"]
