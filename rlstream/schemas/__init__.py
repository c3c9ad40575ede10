"""Avro schemas, the single-object codec, typed records and headers.

The codec (and fastavro with it) is imported on first use of its names, not with the package: the records and
headers are plain dataclasses that the trainer's step and the engines use on machines without the Kafka stack.
"""
from rlstream.schemas.records import RECORD_TYPES

__all__ = ["Codec", "DecodeError", "decode", "default_codec", "encode", "RECORD_TYPES"]

_CODEC = ("Codec", "DecodeError", "decode", "default_codec", "encode")


def __getattr__(name: str):
    if name in _CODEC:
        from rlstream.schemas import codec
        return getattr(codec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
