"""The collector's path to Kafka: a bounded local buffer drained in order by one non-blocking producer.

Contract:
* ``offer()`` never blocks and never raises for Kafka reasons: the record joins the buffer. When the buffer is
  full the oldest record is dropped (counted in ``gpumeter_collector_buffer_dropped_total``) — recent ticks are
  worth more than old ones once an outage outlasts the buffer.
* A record leaves the buffer only once Kafka acknowledged it (idempotent producer, acks=all). After a delivery
  failure the producer is rebuilt and unacknowledged records are sent again, so a record may arrive twice but is
  never lost while it is buffered; consumers drop duplicates by (node, collector start, sequence).
* No record blocks the ones behind it. A record Kafka refuses for good (``refused_for_good``: larger than the
  producer's ``max_request_size`` or the broker's ``message.max.bytes``), or one that failed ``max_record_tries``
  rounds in a row while other records of its topic were delivered in the same round, is given up: replaced in
  the buffer by a ``DeadLetter`` (reason ``TOO_LARGE`` or ``UNDELIVERABLE``, its value cut to fit, with the full
  length and SHA-256: ``gpumeter.stream.deadletter``) for the dead-letters topic, or dropped when it is itself a
  dead letter or no dead-letters topic is configured. Either is counted
  (``gpumeter_collector_undeliverable_records_total{kind,outcome}``) and logged. The records around it are sent
  on in the same round, without a producer reset or a back-off. During an outage nothing is delivered, so
  nothing counts as a try: the buffer keeps everything, as above.
* ``close()`` drains what it can within its timeout, then stops the producer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable

from gpumeter.clock import Clock, SystemClock
from gpumeter.errors import GpumeterError, InvalidMessage
from gpumeter.stream.deadletter import RawMessage, dead_letter_for
from gpumeter.kafka.producer import refused_for_good
from gpumeter.settings import DEFAULT_MAX_REQUEST_SIZE_BYTES
from schemas.catalog import partition_for_node
from schemas.records import DeadLetter
from schemas.typed import codec_for

SERVICE = "collector"
DEAD_LETTER_KIND = "dead_letter"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutboundRecord:
    topic: str
    key: bytes | None
    partition: int | None
    value: bytes
    kind: str  # "sample" | "pod_event" | "dead_letter": which sent-counter it feeds
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
        dead_letter_topic: str | None = None,
        max_request_size_bytes: int = DEFAULT_MAX_REQUEST_SIZE_BYTES,
        max_record_tries: int = 3,
        clock: Clock | None = None,
    ) -> None:
        if max_record_tries < 1:
            raise ValueError("max_record_tries must be >= 1")
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
        self._dead_letter_topic = dead_letter_topic
        self._max_request_size_bytes = max_request_size_bytes
        self._max_record_tries = max_record_tries
        self._clock = clock or SystemClock()  # a dead letter's failed_at only
        self._tries: dict[int, int] = {}  # record id -> rounds it failed while its topic took other records
        self.dropped_count = 0
        self.sent_count = {"sample": 0, "pod_event": 0, DEAD_LETTER_KIND: 0}
        self.delivery_failures = 0
        self.undeliverable = {"dead_lettered": 0, "dropped": 0}

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
        given_up: list[tuple[int, OutboundRecord, BaseException]] = []
        for record_id, record in batch:
            partition = record.partition
            if record.partition_by_node is not None:
                partition = partition_for_node(record.partition_by_node, await self._partition_count(record.topic))
            try:
                future = await asyncio.wait_for(
                    self._producer.send_bytes(record.topic, record.value, key=record.key, partition=partition),
                    self._send_timeout_s,
                )
            except (GpumeterError, OSError) as exc:
                if not refused_for_good(exc):
                    raise
                given_up.append((record_id, record, exc))  # refused before it was sent: the rest go on
                continue
            futures.append((record_id, record, future))
        results = await asyncio.wait_for(
            asyncio.gather(*(f for _, _, f in futures), return_exceptions=True), self._send_timeout_s * 2
        )
        delivered = set()
        delivered_topics = set()
        failed: list[tuple[int, OutboundRecord, BaseException]] = []
        for (record_id, record, _), result in zip(futures, results):
            if isinstance(result, BaseException):
                (given_up if refused_for_good(result) else failed).append((record_id, record, result))
                continue
            delivered.add(record_id)
            delivered_topics.add(record.topic)
            self._tries.pop(record_id, None)
            self.sent_count[record.kind] += 1
            if self._metrics and record.kind != DEAD_LETTER_KIND:
                name = ("gpumeter_collector_samples_sent_total" if record.kind == "sample"
                        else "gpumeter_collector_pod_events_sent_total")
                self._metrics.get(name).inc()
        if delivered:
            self._buffer = deque(item for item in self._buffer if item[0] not in delivered)
            self._update_depth()
        still_failing = []
        for record_id, record, error in failed:
            # Kafka took other records of this topic in the same round: the fault is this record's.
            if record.topic in delivered_topics:
                self._tries[record_id] = self._tries.get(record_id, 0) + 1
                if self._tries[record_id] >= self._max_record_tries:
                    given_up.append((record_id, record, error))
                    continue
            still_failing.append((record_id, record, error))
        for record_id, record, error in given_up:
            self._give_up(record_id, record, error)
        if still_failing:
            raise GpumeterError(f"delivery failed: {still_failing[0][2]!r}")

    def _give_up(self, record_id: int, record: OutboundRecord, error: BaseException) -> None:
        """Replace the record in the buffer by its dead letter, or drop it (see the module docstring)."""
        self._tries.pop(record_id, None)
        replacement = None
        if record.kind != DEAD_LETTER_KIND and self._dead_letter_topic is not None:
            reason_code = "TOO_LARGE" if refused_for_good(error) else "UNDELIVERABLE"
            message = RawMessage(record.topic, -1 if record.partition is None else record.partition, -1,
                                 record.key, record.value)
            letter = dead_letter_for(message, InvalidMessage(f"Kafka did not take the {record.kind} record: "
                                                             f"{error!r}", reason_code=reason_code),
                                     SERVICE, self._clock.now_ms(), max_request_size_bytes=self._max_request_size_bytes)
            replacement = (next(self._ids), OutboundRecord(self._dead_letter_topic, record.topic.encode("utf-8"),
                                                           None, codec_for(DeadLetter).encode(letter),
                                                           DEAD_LETTER_KIND))
        outcome = "dead_lettered" if replacement is not None else "dropped"
        self.undeliverable[outcome] += 1
        if self._metrics:
            self._metrics.get("gpumeter_collector_undeliverable_records_total").labels(record.kind, outcome).inc()
        log.error("%s record to %s (%d bytes) %s, the buffer goes on: %r", record.kind, record.topic,
                  len(record.value), "replaced by a dead letter" if replacement else "dropped", error)
        self._buffer = deque(replacement if item[0] == record_id and replacement is not None else item
                             for item in self._buffer if item[0] != record_id or replacement is not None)
        self._update_depth()

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
