"""The one path for bad input: an ``InvalidMessage`` becomes a ``DeadLetter`` record, a counter, and a log line.

Every consumer (Faust agent or aiokafka loop) hands each raw message to ``DeadLetterGuard.handle``; the handler
decodes and processes it; if anything raises ``InvalidMessage`` the raw bytes go to the dead-letter topic with the
reason and the consumer carries on. Other exceptions are bugs and propagate.

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
import logging
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, TypeVar

from gpumeter.clock import Clock
from gpumeter.errors import InvalidMessage
from gpumeter.settings import DEFAULT_MAX_REQUEST_SIZE_BYTES
from schemas.records import DeadLetter
from schemas.typed import codec_for

log = logging.getLogger(__name__)
T = TypeVar("T")


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


class DeadLetterGuard:
    """Runs handlers and dead-letters their invalid input through ``publish(topic, key, record)``; every dead letter
    fits a producer whose ``max_request_size`` is ``max_request_size_bytes`` (see the module docstring)."""

    def __init__(self, service: str, dead_letter_topic: str, publish: Callable[[str, bytes, DeadLetter], Awaitable],
                 clock: Clock, metrics=None, *,
                 max_request_size_bytes: int = DEFAULT_MAX_REQUEST_SIZE_BYTES) -> None:
        self.service = service
        self.topic = dead_letter_topic
        self._publish = publish
        self._clock = clock
        self._metrics = metrics
        self.max_request_size_bytes = max_request_size_bytes
        self.dead_lettered = 0
        self.truncated = 0

    async def handle(self, message: RawMessage, handler: Callable[[RawMessage], Awaitable[T]]) -> T | None:
        if self._metrics:
            self._metrics.get("gpumeter_messages_consumed_total").labels(self.service, message.topic).inc()
        try:
            if message.value is None:
                raise InvalidMessage("message has no value (tombstone on a non-compacted topic)",
                                     reason_code="EMPTY")
            return await handler(message)
        except InvalidMessage as error:
            await self.reject(message, error)
            return None

    async def reject(self, message: RawMessage, error: InvalidMessage) -> None:
        """Dead-letter ``message`` (also for handlers that find a problem after decoding)."""
        key = message.topic.encode("utf-8")
        record = dead_letter_for(message, error, self.service, self._clock.now_ms(),
                                 max_request_size_bytes=self.max_request_size_bytes, dead_letter_key=key)
        self.dead_lettered += 1
        if self._metrics:
            self._metrics.get("gpumeter_dead_letters_total").labels(
                self.service, message.topic, error.reason_code).inc()
        log.warning("dead-lettered %s[%d]@%d: %s %s", message.topic, message.partition, message.offset,
                    error.reason_code, cut_text(error.detail, 512)[0])
        if record.truncated:
            self.truncated += 1
            if self._metrics:
                self._metrics.get("gpumeter_dead_letters_truncated_total").labels(self.service, message.topic).inc()
            log.warning("dead letter of %s[%d]@%d cut to fit %d bytes: value %d of %d bytes kept (sha256 %s), "
                        "key %d of %d bytes", message.topic, message.partition, message.offset,
                        dead_letter_budget_bytes(self.max_request_size_bytes), len(record.raw_bytes),
                        record.payload_length_bytes, record.payload_sha256,
                        len(record.source_key or b""), max(record.source_key_length_bytes, 0))
        await self._publish(self.topic, key, record)
