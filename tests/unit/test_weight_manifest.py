"""The weights log's manifest logic (rlstream.policy.manifest): where chunks go, the hashes, the URI, and what the
trainer's retention may delete (orphans of a killed upload included)."""
from __future__ import annotations

import pytest

from rlstream.kafka.transactions import FLOOR_BYTES_PER_S, TRANSFER_SLACK_S, transfer_timeout_s
from rlstream.policy.deltas import Content
from rlstream.policy.manifest import (MANIFEST, LogRef, Placed, Positions, Upload, chunk_hash, parse_uri,
                                      payload_hash, place)
from rlstream.schemas.codec import default_codec


def test_chunks_leave_the_manifest_partition_and_spread_round_the_others():
    assert place(1, 5, 3) == [0, 0, 0]
    assert place(3, 0, 4) == [1, 2, 1, 2]
    assert place(3, 1, 1) == [2] and place(3, 2, 1) == [1], "one-chunk deltas alternate"
    assert set(place(5, 7, 40)) == {1, 2, 3, 4}
    with pytest.raises(ValueError):
        place(0, 0, 1)


def test_payload_hash_covers_each_chunk_its_size_and_their_order():
    a, b = chunk_hash(b"abc"), chunk_hash(b"de")
    h = payload_hash([3, 2], [a, b])
    assert h != payload_hash([2, 3], [b, a]) and h != payload_hash([3, 3], [a, b])
    with pytest.raises(ValueError):
        payload_hash([3], [a, b])


def test_a_manifest_travels_as_a_weight_chunk_and_its_uri_says_so():
    up = Upload("p", 4, "delta", 3, ["model.safetensors"], "c" * 64, [(1, 10), (2, 7)], ["h0", "h1"], [8, 5],
                Content())
    m = up.manifest(123)
    assert m.chunk == MANIFEST and m.payload == b"" and m.chunks == 2
    codec = default_codec()
    name, value = codec.decode(codec.encode("WeightChunk", m.to_dict()), expect="WeightChunk")
    assert value["chunk_partitions"] == [1, 2] and value["chunk_offsets"] == [10, 7]
    assert value["payload_hash"] == payload_hash([8, 5], ["h0", "h1"])
    ref = LogRef("p", 4, 0, 30, 2, 12, manifest=True)
    assert parse_uri(ref.uri()) == ref
    old = "kafka:weights?policy=p&version=4&partition=0&offset=30&anchor=2&anchor_offset=12"
    assert parse_uri(old).manifest is False, "a URI written before manifests still reads (the old layout)"


def test_retention_keeps_the_anchor_and_what_follows_and_cuts_every_partition():
    pos = Positions()
    pos.add(Placed(0, True, 0, [(1, 0), (2, 0), (1, 1)]))
    pos.add(Placed(1, False, 1, [(2, 1)]))
    # A killed upload's orphans would lie here: partition 1 at 2-3, partition 2 at 2.
    pos.add(Placed(2, True, 2, [(1, 4), (2, 3)]))
    pos.add(Placed(3, False, 3, [(1, 5)]))
    assert pos.truncation_points(1) == {0: 0, 1: 0, 2: 0}
    assert pos.truncation_points(2) == {0: 2, 1: 4, 2: 3}, "orphans below the anchor's chunks are cut"
    pos.add(Placed(4, True, 4, [(1, 6)]))
    # Partition 2 holds nothing of v4: cut after the last chunk a version before it had there.
    assert pos.truncation_points(4) == {0: 4, 1: 6, 2: 4}
    assert Positions().truncation_points(3) == {}


def test_one_partition_holds_chunks_and_manifests_alike():
    pos = Positions()
    pos.add(Placed(0, True, 2, [(0, 0), (0, 1)]))
    pos.add(Placed(1, True, 5, [(0, 3), (0, 4)]))
    assert pos.truncation_points(1) == {0: 3}


def test_bulk_timeouts_grow_with_the_payload():
    assert transfer_timeout_s(0) == TRANSFER_SLACK_S
    assert transfer_timeout_s(14 * 10 ** 9) == pytest.approx(TRANSFER_SLACK_S + 14 * 10 ** 9 / FLOOR_BYTES_PER_S)
    assert transfer_timeout_s(14 * 10 ** 9) > 15 * 60, "a 7 B anchor gets more than the broker's transaction cap"
