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


def test_a_lora_versions_uri_names_its_base_on_the_log():
    ref = LogRef("p", 3, 0, 40, 3, 40, manifest=True, base="p@base-0123456789abcdef", base_offset=7)
    assert parse_uri(ref.uri()) == ref
    assert ref.base_ref() == LogRef("p@base-0123456789abcdef", 0, 0, 7, 0, 7, manifest=True)
    assert parse_uri(LogRef("p", 3, 0, 40, 3, 40, manifest=True).uri()).base == "", "whole weights name no base"
    with pytest.raises(ValueError, match="base without its offset"):
        parse_uri(ref.uri().replace("&base_offset=7", ""))


def test_retention_stops_before_a_pinned_base_while_a_version_that_may_be_needed_names_it():
    pos = Positions()
    # A LoRA base (manifest 0, chunks on 1 and 2), then its first adapter version and more, each an anchor.
    pos.pin(Placed(0, True, 0, [(1, 0), (2, 0), (1, 1)]), from_version=0)
    for v in range(4):
        pos.add(Placed(v, True, 1 + v, [(1 + v % 2, 2 + v)]))
    assert pos.truncation_points(2) == {0: 0, 1: 0, 2: 0}, "nothing below the base goes"
    # A second copy of the base, named from v4 on: the first goes once no version from keep_from on names it.
    pos.pin(Placed(0, True, 5, [(1, 6), (2, 6)]), from_version=4)
    for v in range(4, 7):
        pos.add(Placed(v, True, 6 + v - 3, [(1 + v % 2, 7 + v)]))
    assert pos.truncation_points(3) == {0: 0, 1: 0, 2: 0}, "v3 names the first copy"
    assert pos.truncation_points(5) == {0: 5, 1: 6, 2: 6}, "only the second copy and what follows stay"


def test_one_partition_holds_chunks_and_manifests_alike():
    pos = Positions()
    pos.add(Placed(0, True, 2, [(0, 0), (0, 1)]))
    pos.add(Placed(1, True, 5, [(0, 3), (0, 4)]))
    assert pos.truncation_points(1) == {0: 3}


def test_bulk_timeouts_grow_with_the_payload():
    assert transfer_timeout_s(0) == TRANSFER_SLACK_S
    assert transfer_timeout_s(14 * 10 ** 9) == pytest.approx(TRANSFER_SLACK_S + 14 * 10 ** 9 / FLOOR_BYTES_PER_S)
    assert transfer_timeout_s(14 * 10 ** 9) > 15 * 60, "a 7 B anchor gets more than the broker's transaction cap"
