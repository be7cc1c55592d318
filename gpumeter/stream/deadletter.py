"""The dead letter of a bad message: an ``InvalidMessage`` becomes a ``DeadLetter`` record that always fits.

Every consumer runs its processor under ``gpumeter.stream.runner.MessageRunner``, the one place that turns an
``InvalidMessage`` (raised while decoding, checking or processing a message) into the raw bytes on the dead-letter
topic with the reason, a counter and a log line, and carries on; other exceptions are bugs and propagate. The
collector, which produces rather than consumes, dead-letters what it cannot publish with the same
``dead_letter_for``.

A dead letter always fits (``dead_letter_for``): the broker accepts records larger than the producer may send
(a compressed batch is checked compressed; a consumer receives it whole), and a dead letter that copied such a
value whole would be refused by the producer, so the service would retry it forever or crash on it. The dead
letter is sized from the producer's ``max_request_size``: the key is cut to ``SOURCE_KEY_MAX_BYTES``, the reason to
``REASON_MAX_BYTES``, and the value to what is left of ``dead_letter_budget_bytes(max_request_size)``; it always
carries the value's full length and the SHA-256 of all of it, and ``truncated`` says whether anything was cut. A
cut is counted (``gpumeter_dead_letters_truncated_total``) and logged.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from gpumeter.errors import InvalidMessage
from gpumeter.settings import DEFAULT_MAX_REQUEST_SIZE_BYTES
from schemas.records import DeadLetter
from schemas.typed import codec_for


@dataclass(frozen=True)
class RawMessage:
    """What a consumer received, independent of the client library."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int | None = None


SOURCE_KEY_MAX_BYTES = 1024
REASON_MAX_BYTES = 4096
# Bytes of a ``long`` length prefix at most (zig-zag varint of a value below 2**35).
_LENGTH_PREFIX_MAX_BYTES = 5


def dead_letter_budget_bytes(max_request_size_bytes: int) -> int:
    """The most bytes a dead letter's Kafka key and value may take together under a producer whose
    ``max_request_size`` is ``max_request_size_bytes``: that limit less 1/16 of it, which covers the record and
    batch headers (about 100 bytes) and what a compression codec may add to incompressible bytes (lz4 about 0.4 %,
    gzip and zstd less), so the batch also stays within a broker whose ``message.max.bytes`` is the same limit."""
    return max_request_size_bytes - max_request_size_bytes // 16


def cut_text(text: str, max_bytes: int) -> tuple[str, bool]:
    """``text`` within ``max_bytes`` UTF-8 bytes, cut on a character boundary and ending with how many characters
    were cut; and whether it was cut."""
    encoded = text.encode("utf-8", errors="replace")
    if len(encoded) <= max_bytes:
        return text, False
    kept = encoded[: max(max_bytes - 48, 0)].decode("utf-8", errors="ignore")
    return f"{kept} ... [{len(text) - len(kept)} more characters cut]", True


def dead_letter_for(message: RawMessage, error: InvalidMessage, service: str, failed_at_unix_ms: int, *,
                    max_request_size_bytes: int = DEFAULT_MAX_REQUEST_SIZE_BYTES,
                    dead_letter_key: bytes | None = None) -> DeadLetter:
    """The DeadLetter record for ``message`` rejected with ``error`` (pure): encoded, it and ``dead_letter_key``
    (the Kafka key it is sent with; default: the source topic's name) fit ``dead_letter_budget_bytes``."""
    value = message.value or b""
    key = message.key
    reason, reason_cut = cut_text(error.detail, REASON_MAX_BYTES)
    key_cut = key is not None and len(key) > SOURCE_KEY_MAX_BYTES
    empty = DeadLetter(
        reason_code=error.reason_code,
        reason=reason,
        error_type=type(error).__name__,
        service=service,
        source_topic=message.topic,
        source_partition=message.partition,
        source_offset=message.offset,
        source_key=key[:SOURCE_KEY_MAX_BYTES] if key is not None else None,
        raw_bytes=b"",
        failed_at_unix_ms=failed_at_unix_ms,
        payload_length_bytes=len(value),
        payload_sha256=hashlib.sha256(value).hexdigest(),
        source_key_length_bytes=len(key) if key is not None else -1,
        truncated=True,  # the flag takes one byte either way; set below
    )
    if dead_letter_key is None:
        dead_letter_key = message.topic.encode("utf-8")
    codec = codec_for(DeadLetter)
    room = (dead_letter_budget_bytes(max_request_size_bytes) - len(dead_letter_key) - len(codec.encode(empty))
            - _LENGTH_PREFIX_MAX_BYTES)
    value_cut = len(value) > room
    kept = value[: max(room, 0)] if value_cut else value
    return replace(empty, raw_bytes=kept, truncated=reason_cut or key_cut or value_cut)
