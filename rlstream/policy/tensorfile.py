"""The safetensors format written and read without copies of the tensors' bytes on the way.

``safetensors.torch`` turns every tensor into a Python ``bytes`` copy before it writes a file or builds a blob, and
``load`` copies each tensor out of the blob again: on a 100 M-parameter version that is most of a write's time.
Here the header is built once and each tensor's memory goes to the file (or into one preallocated buffer) as it
is; ``load`` makes the tensors views of the buffer it is given. Files and blobs are plain safetensors (the layout is
the format's: an 8-byte little-endian header length, the JSON header padded with spaces to 8 bytes, then the
tensors' bytes back to back in header order), so ``safetensors.torch.load_file`` and every engine read them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


def raw_bytes(t: torch.Tensor):
    """The tensor's memory as a flat uint8 array (no copy when it is a contiguous CPU tensor): what files and
    blobs are written from, and what the content hash reads."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else b""


def _header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> tuple[bytes, int]:
    """The header's bytes (length prefix included) and the size of the data after it."""
    head: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _CODES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors code here")
        size = t.numel() * t.element_size()
        head[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offset


def save(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
         into: bytearray | None = None) -> bytearray:
    """A safetensors blob of ``tensors`` (in their order), built in one buffer: ``into`` when it has the blob's size
    (a buffer reused from the version before: fresh memory costs its page faults, about as much as the copy)."""
    head, size = _header(tensors, metadata)
    out = into if into is not None and len(into) == len(head) + size else bytearray(len(head) + size)
    view = memoryview(out)
    view[:len(head)] = head
    at = len(head)
    for t in tensors.values():
        data = raw_bytes(t)
        view[at:at + len(data)] = data
        at += len(data)
    return out


def save_file(tensors: dict[str, torch.Tensor], path: Path | str, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file of ``tensors`` (in their order), each tensor's memory straight to the file."""
    head, _ = _header(tensors, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for t in tensors.values():
            f.write(raw_bytes(t))


def load(buf: bytearray | memoryview) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors blob; the tensors are views of ``buf`` (writable: a bytearray),
    except those whose offset does not suit their dtype's alignment, which are copied. ValueError when ``buf`` is
    not a well-formed blob."""
    try:
        size = int.from_bytes(bytes(buf[:8]), "little")
        head = json.loads(bytes(buf[8:8 + size]))
        metadata = head.pop("__metadata__", None) or {}
        start, out = 8 + size, {}
        for name, info in head.items():
            dtype, shape, (begin, end) = _DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
            count = end - begin
            n = 1
            for d in shape:
                n *= d
            if n * dtype.itemsize != count or start + end > len(buf) or begin < 0:
                raise ValueError(f"tensor {name!r}: its offsets do not fit its shape or the blob")
            if count == 0:
                out[name] = torch.empty(shape, dtype=dtype)
                continue
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=count, offset=start + begin)
            aligned = (start + begin) % dtype.itemsize == 0
            out[name] = (raw if aligned else raw.clone()).view(dtype).reshape(shape)
        return out, metadata
    except (KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a safetensors blob: {exc}") from None
