"""The one path for bad input: an ``InvalidMessage`` becomes a ``DeadLetter`` record, a counter, and a log line.

Every consumer (Faust agent or aiokafka loop) hands each raw message to ``DeadLetterGuard.handle``; the handler
decodes and processes it; if anything raises ``InvalidMessage`` the raw bytes go to the dead-letter topic with the
reason and the consumer carries on. Other exceptions are bugs and propagate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

from gpumeter.clock import Clock
from gpumeter.errors import InvalidMessage
from schemas.records import DeadLetter

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


def dead_letter_for(message: RawMessage, error: InvalidMessage, service: str, failed_at_unix_ms: int) -> DeadLetter:
    """The DeadLetter record for ``message`` rejected with ``error`` (pure)."""
    return DeadLetter(
        reason_code=error.reason_code,
        reason=error.detail,
        error_type=type(error).__name__,
        service=service,
        source_topic=message.topic,
        source_partition=message.partition,
        source_offset=message.offset,
        source_key=message.key,
        raw_bytes=message.value or b"",
        failed_at_unix_ms=failed_at_unix_ms,
    )


class DeadLetterGuard:
    """Runs handlers and dead-letters their invalid input through ``publish(topic, key, record)``."""

    def __init__(self, service: str, dead_letter_topic: str, publish: Callable[[str, bytes, DeadLetter], Awaitable],
                 clock: Clock, metrics=None) -> None:
        self.service = service
        self.topic = dead_letter_topic
        self._publish = publish
        self._clock = clock
        self._metrics = metrics
        self.dead_lettered = 0

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
        record = dead_letter_for(message, error, self.service, self._clock.now_ms())
        self.dead_lettered += 1
        if self._metrics:
            self._metrics.get("gpumeter_dead_letters_total").labels(
                self.service, message.topic, error.reason_code).inc()
        log.warning("dead-lettered %s[%d]@%d: %s %s", message.topic, message.partition, message.offset,
                    error.reason_code, error.detail)
        await self._publish(self.topic, message.topic.encode(), record)
