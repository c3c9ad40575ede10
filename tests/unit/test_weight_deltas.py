"""A version's content, hash and delta payloads (rlstream.policy.deltas): bit-exact round trips, only what changed."""
from __future__ import annotations

import json

import pytest
import torch

from rlstream.policy.deltas import (Content, apply, content_hash, encode, folder_hash, pack_bits, payload_kind,
                                    read_folder, split, unpack_bits, write_folder)


def content(seed: int = 0) -> Content:
    g = torch.Generator().manual_seed(seed)
    tensors = {"embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
               "layer.0.weight": torch.randn(32, 32, generator=g),
               "layer.0.bias": torch.zeros(32),
               "steps": torch.arange(5, dtype=torch.int64)}
    return Content(tensors, {n: "model.safetensors" for n in tensors},
                   {"config.json": b'{"model_type": "x"}', "tokenizer.json": b"{}", "chat_template.jinja": b""})


def changed(base: Content, fraction: float, seed: int = 1) -> Content:
    """A copy of ``base`` with about ``fraction`` of each float tensor's elements nudged (as an optimizer step)."""
    g = torch.Generator().manual_seed(seed)
    out = Content(dict(base.tensors), dict(base.shards), dict(base.files))
    for name, t in base.tensors.items():
        if t.is_floating_point():
            mask = torch.rand(t.shape, generator=g) < fraction
            out.tensors[name] = torch.where(mask, t + 0.01 * (torch.randn(t.shape, generator=g) + 1).to(t.dtype), t)
    return out


def manifest(payload: bytes) -> dict:
    size = int.from_bytes(payload[:8], "little")
    return json.loads(json.loads(payload[8:8 + size])["__metadata__"]["rlstream"])


def test_an_anchor_rebuilds_the_version_bit_exactly():
    c = content()
    payload = encode(c, None)
    assert payload_kind(payload) == "anchor"
    out = apply(payload, None)
    assert content_hash(out) == content_hash(c)
    assert out.files == c.files and out.shards == c.shards


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_delta_carries_only_changed_elements_and_rebuilds_bit_exactly(dtype):
    base = content()
    base.tensors["w"] = torch.randn(128, 64).to(dtype)
    base.shards["w"] = "model.safetensors"
    new = changed(base, 0.02)
    payload = encode(new, base)
    m = manifest(payload)
    assert m["kind"] == "delta" and payload_kind(payload) == "delta"
    assert m["tensors"]["w"][1] == "sparse"  # 2 % changed: indices and values beat the full tensor
    assert m["tensors"]["steps"][1] == "same" and m["tensors"]["layer.0.bias"][1] == "same"
    assert set(m["files"].values()) == {"same"}
    out = apply(payload, base)
    assert content_hash(out) == content_hash(new) != content_hash(base)
    for name, t in new.tensors.items():
        assert torch.equal(out.tensors[name].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), name
    full = encode(new, None)
    assert len(payload) < 0.2 * len(full), (len(payload), len(full))


def test_a_mostly_changed_tensor_goes_in_full_and_bit_patterns_survive():
    base = content()
    new = changed(base, 0.995)  # past 1 − 1/32 of fp32 elements changed, even a bit mask does not pay
    # -0.0 and a NaN with a payload differ from 0.0 and the plain NaN only in their bits.
    bias = torch.zeros(32)
    bias[0] = -0.0
    bias.view(torch.int32)[1] = 0x7FC00001
    new.tensors["layer.0.bias"] = bias
    m = manifest(encode(new, base))
    assert m["tensors"]["layer.0.weight"][1] == "full"
    out = apply(encode(new, base), base)
    assert content_hash(out) == content_hash(new)
    assert out.tensors["layer.0.bias"].view(torch.int32)[1] == 0x7FC00001
    assert torch.signbit(out.tensors["layer.0.bias"][0])


def test_a_fifth_changed_goes_as_a_bit_mask_and_rebuilds_bit_exactly():
    base = content()
    base.tensors["w"] = torch.randn(1001, 7).to(torch.bfloat16)  # 7,007 elements: the last mask byte is padded
    base.shards["w"] = "model.safetensors"
    new = changed(base, 0.2)
    payload = encode(new, base)
    # bf16 at 20 %: indices + values 1.2 bytes an element, mask + values 0.525, full 2.
    assert manifest(payload)["tensors"]["w"][1] == "mask"
    out = apply(payload, base)
    assert content_hash(out) == content_hash(new)
    assert len(payload) < 0.35 * len(encode(new, None)), len(payload)


def test_bits_pack_eight_to_a_byte_and_come_back():
    mask = torch.rand(13, generator=torch.Generator().manual_seed(3)) < 0.5
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == 2
    assert torch.equal(unpack_bits(packed, 13), mask)
    assert pack_bits(torch.tensor([True] + [False] * 7)).tolist() == [128]  # the first element in the high bit


def test_a_mask_delta_that_does_not_fit_its_base_is_refused():
    base = content()
    base.tensors["w"] = torch.randn(64, 64).to(torch.bfloat16)
    base.shards["w"] = "model.safetensors"
    payload = encode(changed(base, 0.3), base)
    assert manifest(payload)["tensors"]["w"][1] == "mask"
    smaller = Content(dict(base.tensors), dict(base.shards), dict(base.files))
    smaller.tensors["w"] = torch.zeros(32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not fit"):
        apply(payload, smaller)


def test_a_shape_or_dtype_change_sends_the_whole_tensor_and_removed_things_are_gone():
    base = content()
    new = Content(dict(base.tensors), dict(base.shards), dict(base.files))
    new.tensors["embed.weight"] = torch.randn(65, 32).to(torch.bfloat16)  # a token was added
    new.tensors["layer.0.bias"] = torch.zeros(32, dtype=torch.float16)
    del new.tensors["steps"], new.shards["steps"], new.files["chat_template.jinja"]
    new.files["config.json"] = b'{"model_type": "y"}'
    payload = encode(new, base)
    m = manifest(payload)
    assert m["tensors"]["embed.weight"][1] == "full" and m["tensors"]["layer.0.bias"][1] == "full"
    assert m["files"]["config.json"] == "data"
    out = apply(payload, base)
    assert content_hash(out) == content_hash(new)
    assert "steps" not in out.tensors and "chat_template.jinja" not in out.files


def test_a_delta_without_its_base_or_on_a_wrong_base_is_refused():
    base = content()
    payload = encode(changed(base, 0.02), base)
    with pytest.raises(ValueError, match="base"):
        apply(payload, None)
    other = Content({"x": torch.zeros(2)}, {"x": "model.safetensors"}, {})
    with pytest.raises(ValueError):
        apply(payload, other)
    with pytest.raises(ValueError):
        apply(b"\x00" * 40, None)


def test_hash_is_stable_and_covers_bits_names_shapes_and_files():
    c = content()
    assert content_hash(c) == content_hash(content()) == content_hash(Content(
        dict(reversed(list(c.tensors.items()))), {n: "other.safetensors" for n in c.tensors}, c.files))
    variants = []
    v = content(); v.tensors["layer.0.bias"] = torch.full((32,), -0.0); variants.append(v)  # noqa: E702
    v = content(); v.tensors["steps"] = v.tensors["steps"].reshape(5, 1); variants.append(v)  # noqa: E702
    v = content(); v.tensors["renamed"] = v.tensors.pop("steps"); variants.append(v)  # noqa: E702
    v = content(); v.files["tokenizer.json"] = b"{ }"; variants.append(v)  # noqa: E702
    hashes = {content_hash(x) for x in variants}
    assert len(hashes) == len(variants) and content_hash(c) not in hashes


def test_a_tensor_larger_than_a_chunk_spans_chunks_and_comes_back():
    c = content()
    c.tensors["big"] = torch.randn(300, 100)  # 120 kB
    c.shards["big"] = "model-00002-of-00002.safetensors"
    payload = encode(c, None)
    chunks = split(payload, 16 * 1024)
    assert len(chunks) == -(-len(payload) // (16 * 1024)) > 7 and max(map(len, chunks)) <= 16 * 1024
    assert content_hash(apply(b"".join(chunks), None)) == content_hash(c)
    assert split(b"", 10) == [b""]


def test_a_rebuilt_folder_hashes_like_the_written_one_with_its_shards(tmp_path):
    c = content()
    c.tensors["head"] = torch.ones(4, 4)
    c.shards["head"] = "model-00002-of-00002.safetensors"
    write_folder(c, tmp_path / "a")
    (tmp_path / "a" / "optimizer.pt").write_bytes(b"trainer only")
    # A sharded engine's optimizer state, a file per rank, is the trainer's too: a worker hashing the store's
    # folder must get the hash the trainer announced.
    (tmp_path / "a" / "optimizer").mkdir()
    (tmp_path / "a" / "optimizer" / "rank0.pt").write_bytes(b"rank 0's shard")
    assert folder_hash(tmp_path / "a") == content_hash(c)
    again = read_folder(tmp_path / "a")
    assert again.shards == c.shards and set(again.files) == set(c.files)
    (tmp_path / "a" / "optimizers.txt").write_bytes(b"a policy file whose name starts alike")
    assert "optimizers.txt" in read_folder(tmp_path / "a").files


def test_a_log_uri_round_trips_and_a_garbled_one_is_a_clear_error():
    from rlstream.policy.weight_log import LogRef, parse_uri
    ref = LogRef("my policy", 12, 0, 340, 10, 200)
    assert parse_uri(ref.uri()) == ref
    for bad in ("file:///w/v1", "kafka:weights?policy=p&version=3", "kafka:weights?policy=p&version=x&partition=0"
                "&offset=1&anchor=0&anchor_offset=0", "kafka:weights?policy=p&version=3&partition=0&offset=9"
                "&anchor=5&anchor_offset=1"):
        with pytest.raises(ValueError):
            parse_uri(bad)


def test_an_anchor_is_built_in_a_buffer_of_its_size_and_chunks_are_views_of_the_payload():
    first = encode(content(0), None)
    second = encode(content(1), None, into=first)  # the same layout: the same size
    assert second is first and content_hash(apply(second, None)) == content_hash(content(1))
    other = encode(content(2), None, into=bytearray(10))  # a buffer of another size is not used
    assert len(other) == len(first) and content_hash(apply(other, None)) == content_hash(content(2))
    parts = split(second, 1000)
    second[0] ^= 0xFF  # views, not copies: what the record encoding copies is the payload as it is then
    assert parts[0][0] == second[0]


def test_the_reader_joins_a_payloads_chunks_into_a_buffer_of_their_size():
    from rlstream.policy.weight_log import _join
    payload = encode(content(0), None)
    chunks = [bytes(c) for c in split(payload, 300)]
    spare = bytearray(len(payload))
    assert _join(chunks, spare) is spare and spare == payload
    fresh = _join(chunks, bytearray(3))
    assert fresh == payload and len(fresh) == len(payload)
