"""Avro schemas, the single-object codec, typed records and headers."""
from rlstream.schemas.codec import Codec, DecodeError, decode, default_codec, encode
from rlstream.schemas.records import RECORD_TYPES

__all__ = ["Codec", "DecodeError", "decode", "default_codec", "encode", "RECORD_TYPES"]
