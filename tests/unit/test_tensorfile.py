"""rlstream.policy.tensorfile: files and blobs the safetensors library reads back bit-exactly; blobs read as views."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import load_file

from rlstream.policy import tensorfile


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"b.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # 30 bytes: what follows is unaligned
            "a.f32": torch.randn(7, generator=g), "c.i64": torch.arange(4), "d.mask": torch.tensor([True, False]),
            "e.empty": torch.empty(0, 3), "f.u8": torch.tensor([1, 2, 3], dtype=torch.uint8),
            "g.strided": torch.arange(12, dtype=torch.int32).reshape(3, 4).t()}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def test_files_and_blobs_read_back_by_the_safetensors_library(tmp_path):
    tensors = _tensors()
    tensorfile.save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    _same(load_file(str(tmp_path / "x.safetensors")), tensors)
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    _same(st_load(bytes(tensorfile.save(tensors))), tensors)


def test_load_gives_writable_views_of_the_buffer_and_copies_the_unaligned():
    tensors = _tensors()
    buf = tensorfile.save(tensors, metadata={"k": "v"})
    out, meta = tensorfile.load(buf)
    _same(out, tensors)
    assert meta == {"k": "v"}
    out["b.bf16"].zero_()  # at an aligned offset: a view of the buffer
    out["a.f32"].zero_()  # at offset 30, which a float32 cannot start at: a copy
    again = tensorfile.load(buf)[0]
    assert not again["b.bf16"].any() and torch.equal(again["a.f32"], tensors["a.f32"])


def test_a_damaged_blob_is_a_value_error():
    buf = tensorfile.save(_tensors())
    with pytest.raises(ValueError):
        tensorfile.load(buf[:-3])
    with pytest.raises(ValueError):
        tensorfile.load(bytearray(b"\x05\x00\x00\x00\x00\x00\x00\x00{abc}"))
