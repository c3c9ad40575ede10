"""Per-token arrays on the wire: little-endian packed bytes (fields marked ``"rlstream.packed"`` in the schemas),
and ``TokenList``, the list a decoded one becomes.

A ``TokenList`` is a real ``list`` (every reader, C code included, sees its elements) that remembers the bytes it
was decoded from. Encoding it again writes those bytes as they are instead of packing the list element by
element, which is what a pass-through hop (reward: a Trajectory in, the same Trajectory inside a
ScoredTrajectory out) spent most of its encode on. Every mutating method forgets the bytes, so a list that
changed is packed afresh: the bytes are only ever reused for the exact elements they were read from.
"""
from __future__ import annotations

import sys
from array import array

#: Packed token-array kinds -> array typecodes (int32, uint8, float32 on every platform we run on).
TYPECODES = {"int32": "i", "uint8": "B", "float32": "f"}
_BIG_ENDIAN = sys.byteorder == "big"


def _forgets(name: str):
    base = getattr(list, name)

    def method(self, *args, **kwargs):
        self._packed = None
        return base(self, *args, **kwargs)
    method.__name__ = name
    method.__doc__ = base.__doc__
    return method


class TokenList(list):
    """A decoded per-token array: a list, plus the packed bytes (and their kind) it was decoded from, until the
    first change."""

    __slots__ = ("_packed",)

    def __init__(self, values=(), packed: tuple[str, bytes] | None = None):
        super().__init__(values)
        self._packed = packed

    def packed_as(self, kind: str) -> bytes | None:
        """The bytes this list was decoded from, if it is unchanged since and they are of ``kind``."""
        packed = self._packed
        return packed[1] if packed is not None and packed[0] == kind else None

    # Every mutator of list: the bytes describe the elements as decoded, not as changed.
    for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop",
                  "remove", "clear", "sort", "reverse"):
        locals()[_name] = _forgets(_name)
    del _name

    def __reduce__(self):  # a pickled copy is a plain list (the bytes are a cache, not state)
        return list, (list(self),)


def pack(values, kind: str) -> bytes:
    """A sequence of numbers as little-endian packed bytes; a TokenList unchanged since its decode costs nothing."""
    if isinstance(values, TokenList):
        cached = values.packed_as(kind)
        if cached is not None:
            return cached
    arr = array(TYPECODES[kind], values)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def unpack(data: bytes | str, kind: str) -> TokenList:
    """Packed bytes as a TokenList that remembers them (ValueError when the length is not a whole number of
    elements)."""
    if isinstance(data, str):
        # A packed field added later reads from an older record as its schema default, which fastavro hands back
        # as the JSON string (Avro: a bytes default is a string of code points 0-255).
        data = data.encode("latin-1")
    arr = array(TYPECODES[kind])
    arr.frombytes(data)
    if _BIG_ENDIAN:
        arr.byteswap()
    return TokenList(arr.tolist(), (kind, bytes(data)))
