"""The collector's path to Kafka: a bounded local buffer drained in order by one non-blocking producer.

Contract:
* ``offer()`` never blocks and never raises for Kafka reasons: the record joins the buffer. When the buffer is
  full the oldest record is dropped (counted in ``gpumeter_collector_buffer_dropped_total``) — recent ticks are
  worth more than old ones once an outage outlasts the buffer.
* A record leaves the buffer only once Kafka acknowledged it (idempotent producer, acks=all). After a delivery
  failure the producer is rebuilt and unacknowledged records are sent again, so a record may arrive twice but is
  never lost while it is buffered; consumers drop duplicates by (node, collector start, sequence).
* ``close()`` drains what it can within its timeout, then stops the producer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable

from gpumeter.errors import GpumeterError
from schemas.catalog import partition_for_node

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutboundRecord:
    topic: str
    key: bytes | None
    partition: int | None
    value: bytes
    kind: str  # "sample" | "pod_event": which sent-counter it feeds
    partition_by_node: str | None = None  # send to partition_for_node(this, topic's partition count)


class BufferedPublisher:
    def __init__(
        self,
        producer_factory: Callable[[], object],
        *,
        max_records: int,
        metrics=None,
        batch_records: int = 500,
        send_timeout_s: float = 10.0,
        retry_backoff_s: float = 0.5,
        retry_backoff_max_s: float = 5.0,
    ) -> None:
        self._producer_factory = producer_factory
        self._producer = None
        self._buffer: deque[tuple[int, OutboundRecord]] = deque()
        self._ids = itertools.count()
        self._max_records = max_records
        self._batch_records = batch_records
        self._send_timeout_s = send_timeout_s
        self._retry_backoff_s = retry_backoff_s
        self._retry_backoff_max_s = retry_backoff_max_s
        self._metrics = metrics
        self._wakeup = asyncio.Event()
        self._closing = False
        self._close_deadline = 0.0
        self._task: asyncio.Task | None = None
        self._partition_counts: dict[str, int] = {}
        self.dropped_count = 0
        self.sent_count = {"sample": 0, "pod_event": 0}
        self.delivery_failures = 0

    @property
    def depth(self) -> int:
        return len(self._buffer)

    def offer(self, record: OutboundRecord) -> None:
        if len(self._buffer) >= self._max_records:
            self._buffer.popleft()
            self.dropped_count += 1
            if self._metrics:
                self._metrics.get("gpumeter_collector_buffer_dropped_total").inc()
        self._buffer.append((next(self._ids), record))
        self._update_depth()
        self._wakeup.set()

    def _update_depth(self) -> None:
        if self._metrics:
            self._metrics.get("gpumeter_collector_buffer_depth").set(len(self._buffer))

    def start(self) -> None:
        """Start draining in the background."""
        self._task = asyncio.create_task(self._run(), name="collector-publisher")

    def _should_exit(self) -> bool:
        loop_time = asyncio.get_running_loop().time()
        return self._closing and (not self._buffer or loop_time >= self._close_deadline)

    async def _run(self) -> None:
        backoff_s = self._retry_backoff_s
        while True:
            if self._should_exit():
                return
            if not self._buffer:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                await self._drain_once()
                backoff_s = self._retry_backoff_s
            except (GpumeterError, OSError, asyncio.TimeoutError) as exc:
                self.delivery_failures += 1
                log.warning("kafka delivery failed (%d records buffered): %s", len(self._buffer), exc)
                await self._reset_producer()
                if self._should_exit():
                    return
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self._retry_backoff_max_s)

    async def _drain_once(self) -> None:
        if self._producer is None:
            producer = self._producer_factory()
            try:
                await asyncio.wait_for(producer.start(), self._send_timeout_s)
            except BaseException:
                # A client whose start failed still holds connections and tasks; left open, each one keeps
                # retrying the broker on its own for as long as the outage lasts.
                await self._discard(producer)
                raise
            self._producer = producer
        batch = list(itertools.islice(self._buffer, self._batch_records))
        futures = []
        for record_id, record in batch:
            partition = record.partition
            if record.partition_by_node is not None:
                partition = partition_for_node(record.partition_by_node, await self._partition_count(record.topic))
            future = await asyncio.wait_for(
                self._producer.send_bytes(record.topic, record.value, key=record.key, partition=partition),
                self._send_timeout_s,
            )
            futures.append((record_id, record, future))
        results = await asyncio.wait_for(
            asyncio.gather(*(f for _, _, f in futures), return_exceptions=True), self._send_timeout_s * 2
        )
        delivered = set()
        first_error = None
        for (record_id, record, _), result in zip(futures, results):
            if isinstance(result, BaseException):
                first_error = first_error or result
                continue
            delivered.add(record_id)
            self.sent_count[record.kind] += 1
            if self._metrics:
                name = ("gpumeter_collector_samples_sent_total" if record.kind == "sample"
                        else "gpumeter_collector_pod_events_sent_total")
                self._metrics.get(name).inc()
        if delivered:
            self._buffer = deque(item for item in self._buffer if item[0] not in delivered)
            self._update_depth()
        if first_error is not None:
            raise GpumeterError(f"delivery failed: {first_error!r}")

    async def _partition_count(self, topic: str) -> int:
        count = self._partition_counts.get(topic)
        if count is None:
            partitions = await asyncio.wait_for(self._producer.partitions_for(topic), self._send_timeout_s)
            count = self._partition_counts[topic] = len(partitions)
        return count

    async def _reset_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await self._discard(producer)

    @staticmethod
    async def _discard(producer) -> None:
        try:
            await asyncio.wait_for(producer.abort(), 5)
        except Exception as exc:  # a half-broken client may fail to close; it is discarded either way
            log.debug("discarding producer: %r", exc)

    async def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what can be delivered within ``timeout_s``, then stop the producer."""
        self._closing = True
        self._close_deadline = asyncio.get_running_loop().time() + timeout_s
        self._wakeup.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s + self._send_timeout_s * 3)
            except asyncio.TimeoutError:
                self._task.cancel()
        if self._buffer:
            log.warning("closing with %d records not delivered", len(self._buffer))
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()
