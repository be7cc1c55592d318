"""The one producer every service uses: idempotent, compressed, batched, non-blocking.

``send()`` encodes and enqueues; it never waits for the broker's acknowledgement per message (that would serialise
throughput). ``flush()`` waits for everything enqueued so far. Delivery errors surface from ``flush()`` or from the
futures ``send()`` returns, wrapped in ``DeliveryError``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, RecordListTooLargeError

from gpumeter.errors import GpumeterError
from gpumeter.settings import KafkaSettings
from schemas.typed import codec_for


class DeliveryError(GpumeterError):
    """A record could not be delivered to Kafka."""


# What Kafka answers about the record itself, not about its own state: sending the same bytes again cannot work.
_REFUSED_FOR_GOOD = (MessageSizeTooLargeError, RecordListTooLargeError)


def refused_for_good(error: BaseException | None) -> bool:
    """Whether ``error`` -- raised by ``send``/``send_bytes`` or set on a delivery future -- says that Kafka will
    never take this record (larger than the producer's ``max_request_size`` or the broker's ``message.max.bytes``),
    as opposed to an outage that a retry outlasts."""
    while error is not None:
        if isinstance(error, _REFUSED_FOR_GOOD):
            return True
        error = error.__cause__
    return False


class RecordProducer:
    """Produces typed records (schemas.records) as single-object Avro."""

    def __init__(self, settings: KafkaSettings, *, linger_ms: int = 20, max_batch_bytes: int = 512 * 1024,
                 request_timeout_ms: int = 30_000, **extra: Any) -> None:
        self._settings = settings
        self._producer = AIOKafkaProducer(
            **settings.client_kwargs(),
            enable_idempotence=True,
            acks="all",
            compression_type=settings.compression_type,
            linger_ms=linger_ms,
            max_batch_size=max_batch_bytes,
            request_timeout_ms=request_timeout_ms,
            max_request_size=settings.max_request_size_bytes,
            **extra,
        )
        self._pending: set[asyncio.Future] = set()

    async def start(self) -> None:
        try:
            await self._producer.start()
        except (KafkaError, OSError) as exc:
            raise DeliveryError(f"cannot reach Kafka at {self._settings.bootstrap_servers}: {exc!r}") from exc

    async def stop(self) -> None:
        """Flush, then close."""
        try:
            await self.flush()
        finally:
            await self._producer.stop()

    async def abort(self) -> None:
        """Close without waiting for unacknowledged records (after a delivery failure; the caller resends)."""
        self._pending.clear()
        await self._producer.stop()

    async def send(self, topic: str, record: Any, *, key: bytes | None = None, partition: int | None = None) -> asyncio.Future:
        """Encode and enqueue ``record``; returns the delivery future (already tracked for ``flush``)."""
        value = codec_for(type(record)).encode(record)
        return await self.send_bytes(topic, value, key=key, partition=partition)

    async def send_bytes(self, topic: str, value: bytes | None, *, key: bytes | None = None,
                         partition: int | None = None) -> asyncio.Future:
        try:
            future = await self._producer.send(topic, value=value, key=key, partition=partition)
        except (KafkaError, OSError) as exc:
            raise DeliveryError(f"cannot enqueue to {topic}: {exc!r}") from exc
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    async def flush(self) -> None:
        """Wait until every record sent so far is acknowledged; raise DeliveryError if any failed."""
        pending = list(self._pending)
        if not pending:
            return
        results = await asyncio.gather(*pending, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise DeliveryError(f"{len(failures)} of {len(pending)} records failed: {failures[0]!r}")

    async def partitions_for(self, topic: str) -> set[int]:
        return await self._producer.partitions_for(topic)
