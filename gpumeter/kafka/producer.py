"""The one producer every service uses: idempotent, compressed, batched, non-blocking.

``send()`` encodes and enqueues; it never waits for the broker's acknowledgement per message (that would serialise
throughput). ``flush()`` waits for everything enqueued so far. Delivery errors surface from ``flush()`` or from the
futures ``send()`` returns, wrapped in ``DeliveryError``.

``send_batch()`` enqueues several records of one key as ready-made batches (aiokafka's ``create_batch`` /
``send_batch``) to the partition ``send()`` would pick for that key: the records, their order, their partition and
their bytes on the topic are those of one ``send()`` each, for about a sixth of the client's CPU (billing's ~97 cost
records of a node-window: 1.64 -> 0.29 ms against a real broker, docs/performance.md). A batch is delivered or fails
whole: every record of it gets the batch's future.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, RecordListTooLargeError
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from gpumeter.errors import GpumeterError
from gpumeter.settings import KafkaSettings
from schemas.typed import codec_for


class DeliveryError(GpumeterError):
    """A record could not be delivered to Kafka."""


class PartlyEnqueued(DeliveryError):
    """``send_batch`` could enqueue only the first ``len(enqueued)`` records (``enqueued``: their futures)."""

    def __init__(self, message: str, enqueued: list[asyncio.Future]) -> None:
        super().__init__(message)
        self.enqueued = enqueued


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


# More than any record's framing beyond its key and value in aiokafka's size estimate (varints, headers count,
# the batch's header): below this a record surely fits a request, above it the estimate decides.
_RECORD_OVERHEAD_BYTES = 128


class RecordProducer:
    """Produces typed records (schemas.records) as single-object Avro."""

    def __init__(self, settings: KafkaSettings, *, linger_ms: int = 20, max_batch_bytes: int | None = None,
                 request_timeout_ms: int = 30_000, **extra: Any) -> None:
        self._settings = settings
        self._producer = AIOKafkaProducer(
            **settings.client_kwargs(),
            enable_idempotence=True,
            acks="all",
            compression_type=settings.compression_type,
            linger_ms=linger_ms,
            max_batch_size=settings.producer_batch_bytes if max_batch_bytes is None else max_batch_bytes,
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
        return self._track(future)

    def _track(self, future: asyncio.Future) -> asyncio.Future:
        """``future``, kept for ``flush`` until it is done."""
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    async def send_batch(self, topic: str, records: Sequence[Any], *, key: bytes,
                         partition: int | None = None) -> list[asyncio.Future]:
        """Encode ``records`` and enqueue them, in order, as few batches as the producer's batch size allows, to
        ``partition`` (None: the one ``send`` picks for ``key``, which must not be None); returns each record's
        delivery future (its batch's; already tracked for ``flush``). A record too large for a request on its own
        is sent as ``send`` sends it. When a record cannot be enqueued, ``PartlyEnqueued`` (a ``DeliveryError``)
        carries the futures of the records before it, which are on their way."""
        if key is None:
            raise ValueError("send_batch needs a key: without one, send() spreads records over partitions")
        values = [codec_for(type(record)).encode(record) for record in records]
        producer = self._producer
        futures: list[asyncio.Future] = []
        try:
            if partition is None:
                await producer.partitions_for(topic)  # the topic's metadata, as send() waits for it
                # What send() does with a key (aiokafka's own partitioner over the topic's partitions).
                partition = producer._partition(topic, None, None, None, key, None)
            limit_bytes = self._settings.max_request_size_bytes
            batch, members = None, 0
            for value in values:
                if (len(value) + len(key) + _RECORD_OVERHEAD_BYTES > limit_bytes
                        and DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, []) > limit_bytes):
                    # send() refuses it (MessageSizeTooLargeError): the same refusal, for the same record, after
                    # the records before it.
                    if batch is not None:
                        futures += [await self._enqueue_batch(batch, topic, partition)] * members
                        batch, members = None, 0
                    futures.append(await self.send_bytes(topic, value, key=key, partition=partition))
                    continue
                if batch is not None and batch.append(key=key, value=value, timestamp=None) is not None:
                    members += 1
                    continue
                if batch is not None:  # full: out it goes, and a new one takes this record
                    futures += [await self._enqueue_batch(batch, topic, partition)] * members
                batch = producer.create_batch()
                if batch.append(key=key, value=value, timestamp=None) is None:
                    raise DeliveryError(f"a record of {len(value)} bytes does not fit an empty batch of {topic}")
                members = 1
            if batch is not None:
                futures += [await self._enqueue_batch(batch, topic, partition)] * members
        except (KafkaError, OSError, DeliveryError) as exc:
            raise PartlyEnqueued(f"cannot enqueue to {topic}: {exc!r}", futures) from exc
        return futures

    async def _enqueue_batch(self, batch: Any, topic: str, partition: int) -> asyncio.Future:
        batch.close()
        return self._track(await self._producer.send_batch(batch, topic, partition=partition))

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
