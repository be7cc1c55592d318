"""What the aiokafka-driven processors (billing, guard) share around their logic: the stop flag, the liveness
beat and the stop-aware retry pause, the errors their consumer loops raise, and the ``RawMessage`` of a consumed
record. No Kafka client here (a record is anything with aiokafka's ``ConsumerRecord`` fields).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from gpumeter.errors import GpumeterError
from gpumeter.stream.deadletter import RawMessage
from gpumeter.kafka.outbox import pause_unless_stopping


class ConsumerUnavailable(GpumeterError):
    """The consumer could not connect to Kafka at start."""


class ServiceStopping(Exception):
    """Raised out of a retry pause when the service was asked to stop; nothing after it is committed."""


def raw_message(record: Any) -> RawMessage:
    """An aiokafka ``ConsumerRecord`` as a ``RawMessage``."""
    return RawMessage(topic=record.topic, partition=record.partition, offset=record.offset, key=record.key,
                      value=record.value, timestamp_ms=record.timestamp)


async def input_behind(consumer: Any) -> bool:
    """Whether an aiokafka consumer has input waiting beyond its fetch positions (a high-water mark ahead)."""
    for tp in consumer.assignment():
        highwater = consumer.highwater(tp)
        if highwater is not None and highwater > await consumer.position(tp):
            return True
    return False


class ProcessorLifecycle:
    """The stop flag, the liveness beat and progress (``gpumeter.health``, through ``metrics``; None: no metrics)
    and the retry pause of a processor. ``_pause`` counts as the loop going round (waiting on purpose for an
    unreachable dependency is alive) and raises ``ServiceStopping`` once ``stop()`` was called, before or during
    the pause.

    Progress: every beat and every pause report two positions -- ``input`` (what the consumer loop last said with
    ``note_input``: the offsets taken, and whether input was waiting behind them) and ``outbox`` (the oldest
    unacknowledged record of ``self._outbox``, if the processor has one). A retry loop pauses with both standing
    still: after ``max_stall_seconds`` that is a stall, not life."""

    _outbox: Any = None

    def __init__(self, metrics: Any, sleep: Callable[[float], Awaitable[None]] | None = None) -> None:
        self.metrics = metrics
        self._sleep = sleep or asyncio.sleep
        self._stopping = asyncio.Event()
        self._input: tuple[Any, bool] | None = None

    def stop(self) -> None:
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def beat(self) -> None:
        """The service's loop went round."""
        if self.metrics is not None:
            self.metrics.beat()
            self._report_progress()

    def note_input(self, position: Any, waiting: bool) -> None:
        """The consumer loop's position on its input (the offsets taken so far) and whether input is waiting behind
        it (a fetched batch not yet handled, or the partitions' high-water marks ahead)."""
        self._input = (position, waiting)
        self._report_progress()

    def _report_progress(self) -> None:
        if self.metrics is None:
            return
        if self._input is not None:
            self.metrics.progress("input", *self._input)
        if self._outbox is not None:
            oldest = self._outbox.oldest_pending
            self.metrics.progress("outbox", oldest, oldest is not None)

    async def _pause(self, seconds: float) -> None:
        self.beat()
        await pause_unless_stopping(seconds, sleep=self._sleep, stopping=self._stopping, stopped=ServiceStopping)


__all__ = ["ConsumerUnavailable", "ProcessorLifecycle", "ServiceStopping", "input_behind", "raw_message"]
