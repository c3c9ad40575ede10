"""Dead letters: an input record a process could not use, kept with its reason, stage and origin.

A dead letter must always fit on the broker: a letter that the broker refused would make the batch that carries
it fail forever. So its size is checked against the worst case on the wire, and the original bytes are dropped
(keeping where they are) when they would not fit.
"""
from __future__ import annotations

from confluent_kafka import Message

from rlstream.kafka.topics import MAX_MESSAGE_BYTES
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from rlstream.schemas.records import DeadLetter


def dead_letter(stage: str, m: Message, reason: str, error: str,
                max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[bytes, list]:
    """The encoded DeadLetter value and headers for an input record a stage could not use."""
    # Kafka allows null header values; the letter's map cannot hold them (and must never fail to encode).
    headers = {k: v if v is not None else b"" for k, v in hdr.as_dict(m.headers()).items()}
    letter = DeadLetter(stage=stage, reason=reason, error=error[:4000], topic=m.topic(), partition=m.partition(),
                        offset=m.offset(), failed_at=hdr.now_ms(), key=m.key(), value=m.value(), headers=headers,
                        trace_id=hdr.trace_id(headers.get(hdr.TRACEPARENT)))
    try:
        version = hdr.policy_version(headers)
    except hdr.HeaderError:
        version = -1
    out_headers = hdr.build(version, hdr.child_traceparent(headers.get(hdr.TRACEPARENT)))
    value = default_codec().encode("DeadLetter", letter.to_dict())
    if wire_bytes(value, m.key(), out_headers) > max_bytes:
        # A record near the size limit no longer fits once wrapped: the broker would refuse the letter and the
        # batch would be redone forever. Keep where the original is instead of its bytes.
        letter.value = None
        letter.error = (f"{letter.error[:3000]} [original value of {len(m.value() or b'')} bytes not kept: the "
                        f"letter would exceed {max_bytes} bytes; it is at {m.topic()}[{m.partition()}]@{m.offset()}]")
        value = default_codec().encode("DeadLetter", letter.to_dict())
    return value, out_headers


def wire_bytes(value: bytes, key: str | bytes | None, headers: list[tuple[str, bytes]]) -> int:
    """Worst-case size of a one-record batch on the broker, which checks it against max.message.bytes.

    Record and batch framing add up to ~100 bytes, and lz4 can grow incompressible data by 1/255.
    """
    key_len = len(key.encode()) if isinstance(key, str) else len(key or b"")
    raw = len(value) + key_len + sum(len(k) + len(v or b"") + 10 for k, v in headers) + 128
    return raw + raw // 255 + 64
