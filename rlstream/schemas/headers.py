"""Kafka headers every record carries, readable without decoding the value."""
from __future__ import annotations

import random
import time

POLICY_VERSION = "policy_version"
REWARD_VERSION = "reward_version"
TRACEPARENT = "traceparent"
PRODUCED_AT = "produced_at"
TEACHER_VERSION = "teacher_version"  # on feedback: the teacher that scored it


class HeaderError(ValueError):
    """A required header is missing or malformed (dead-letter reason ``bad_header``)."""

    reason = "bad_header"


def now_ms() -> int:
    """Wall-clock milliseconds since the epoch."""
    return time.time_ns() // 1_000_000


def as_dict(headers: list[tuple[str, bytes]] | None) -> dict[str, bytes]:
    """Kafka's header list as a dict (the last value of a repeated key wins)."""
    return {k: v for k, v in headers} if headers else {}


def int_header(headers: dict[str, bytes], name: str) -> int:
    """An integer header, or HeaderError saying what is wrong with it."""
    raw = headers.get(name)
    if raw is None:
        raise HeaderError(f"missing {name} header")
    try:
        return int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise HeaderError(f"{name} header is not an integer: {raw[:32]!r}") from None


def policy_version(headers: dict[str, bytes]) -> int:
    """The oldest policy version that produced any token of the record (-1: none yet)."""
    return int_header(headers, POLICY_VERSION)


def new_traceparent() -> str:
    """A fresh W3C traceparent with a random trace id and span id."""
    return f"00-{_random_hex(128)}-{_random_hex(64)}-01"


def _random_hex(bits: int) -> str:
    # Trace ids need to be unique, not secret (W3C trace context): Python's generator, reseeded in every forked
    # child, rather than os.urandom's system call, which was a few microseconds of every record a stage produced.
    return f"{random.getrandbits(bits):0{bits // 4}x}"


def child_traceparent(parent: bytes | str | None) -> str:
    """The traceparent of a span under ``parent`` (a new trace when parent is absent or invalid)."""
    if isinstance(parent, bytes):
        parent = parent.decode("ascii", "replace")
    parts = parent.split("-") if parent else []
    if len(parts) != 4 or len(parts[1]) != 32:
        return new_traceparent()
    return f"00-{parts[1]}-{_random_hex(64)}-{parts[3]}"


def trace_id(traceparent: bytes | str | None) -> str:
    """The 32-hex trace id inside a traceparent ('' when absent)."""
    if isinstance(traceparent, bytes):
        traceparent = traceparent.decode("ascii", "replace")
    parts = traceparent.split("-") if traceparent else []
    return parts[1] if len(parts) == 4 else ""


def build(policy_version: int, traceparent: str, reward_version: str | None = None,
          produced_at: int | None = None) -> list[tuple[str, bytes]]:
    """The header list for a produced record."""
    out = [
        (POLICY_VERSION, str(int(policy_version)).encode()),
        (TRACEPARENT, traceparent.encode()),
        (PRODUCED_AT, str(produced_at if produced_at is not None else now_ms()).encode()),
    ]
    if reward_version is not None:
        out.append((REWARD_VERSION, reward_version.encode()))
    return out
