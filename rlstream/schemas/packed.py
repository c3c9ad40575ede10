"""Per-token arrays on the wire: little-endian packed bytes (fields marked ``"rlstream.packed"`` in the schemas),
and what a decoded one becomes: a ``TokenList``, or for a reader that never edits them a ``TokenView``.

A ``TokenList`` is a real ``list`` (every reader, C code included, sees its elements) that remembers the bytes it
was decoded from. Encoding it again writes those bytes as they are instead of packing the list element by
element, which is what a pass-through hop (reward: a Trajectory in, the same Trajectory inside a
ScoredTrajectory out) spent most of its encode on. Every mutating method forgets the bytes, so a list that
changed is packed afresh: the bytes are only ever reused for the exact elements they were read from.

A ``TokenView`` is a read-only sequence over the bytes themselves (no Python number is made until one is read):
what a stage that declares ``Stage.token_views`` gets (the reward stage: a judge reads tokens, it does not edit
them). It compares equal to the list of its elements, ``+`` makes a list, and ``numpy.asarray`` views its bytes.
"""
from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

#: Packed token-array kinds -> array typecodes (int32, uint8, float32 on every platform we run on).
TYPECODES = {"int32": "i", "uint8": "B", "float32": "f"}
_BIG_ENDIAN = sys.byteorder == "big"
_SIZES = {kind: array(code).itemsize for kind, code in TYPECODES.items()}


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
    if isinstance(values, TokenView):
        cached = values.packed_as(kind)
        if cached is not None:
            return cached
    arr = array(TYPECODES[kind], values)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def unpack(data: bytes | str, kind: str, view: bool = False) -> "TokenList | TokenView":
    """Packed bytes as a TokenList that remembers them, or (``view``) a TokenView over them; ValueError when the
    length is not a whole number of elements."""
    if isinstance(data, str):
        # A packed field added later reads from an older record as its schema default, which fastavro hands back
        # as the JSON string (Avro: a bytes default is a string of code points 0-255).
        data = data.encode("latin-1")
    if view and not _BIG_ENDIAN:  # a native-order view is the little-endian wire order
        return TokenView(kind, bytes(data))
    arr = array(TYPECODES[kind])
    arr.frombytes(data)
    if _BIG_ENDIAN:
        arr.byteswap()
    return TokenList(arr.tolist(), (kind, bytes(data)))


class TokenView(Sequence):
    """A read-only per-token array over its packed little-endian bytes (see the module docstring)."""

    __slots__ = ("_kind", "_data", "_cast")

    def __init__(self, kind: str, data: bytes):
        if len(data) % _SIZES[kind]:
            raise ValueError(f"{len(data)} bytes are not a whole number of {kind} elements")
        self._kind, self._data, self._cast = kind, data, None

    @property
    def _view(self) -> memoryview:
        # Made on the first read: a pass-through stage (reward) hands most views on unread, and a cast per array
        # was a tenth of its decode.
        if self._cast is None:
            self._cast = memoryview(self._data).cast(TYPECODES[self._kind])
        return self._cast

    def packed_as(self, kind: str) -> bytes | None:
        """The bytes this view reads, if they are of ``kind``."""
        return self._data if kind == self._kind else None

    def tolist(self) -> list:
        return self._view.tolist()

    def __len__(self) -> int:
        return len(self._data) // _SIZES[self._kind]

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._view[index].tolist()
        return self._view[index]

    def __iter__(self):
        return iter(self._view)

    def __eq__(self, other):
        if isinstance(other, TokenView):
            return self.tolist() == other.tolist()
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # equal to a list, so unhashable like one

    def __add__(self, other):
        return self.tolist() + list(other)

    def __radd__(self, other):
        return list(other) + self.tolist()

    def __repr__(self) -> str:
        return repr(self.tolist())

    def __array__(self, dtype=None, copy=None):
        import numpy as np  # only for a caller that asks for an array
        arr = np.frombuffer(self._data, dtype={"int32": "<i4", "uint8": "u1", "float32": "<f4"}[self._kind])
        return arr.astype(dtype) if dtype is not None else arr

    def __reduce__(self):  # a pickled copy is a plain list
        return list, (self.tolist(),)
