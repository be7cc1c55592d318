"""What the aiokafka-driven processors (billing, guard) share around their logic: the stop flag, the liveness
beat and the stop-aware retry pause, the errors their consumer loops raise, and the ``RawMessage`` of a consumed
record. No Kafka client here (a record is anything with aiokafka's ``ConsumerRecord`` fields).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from gpumeter.errors import GpumeterError
from gpumeter.kafka.deadletter import RawMessage
from gpumeter.kafka.outbox import pause_unless_stopping


class ConsumerUnavailable(GpumeterError):
    """The consumer could not connect to Kafka at start."""


class ServiceStopping(Exception):
    """Raised out of a retry pause when the service was asked to stop; nothing after it is committed."""


def raw_message(record: Any) -> RawMessage:
    """An aiokafka ``ConsumerRecord`` as a ``RawMessage``."""
    return RawMessage(topic=record.topic, partition=record.partition, offset=record.offset, key=record.key,
                      value=record.value, timestamp_ms=record.timestamp)


class ProcessorLifecycle:
    """The stop flag, the liveness beat (``gpumeter.health``, through ``metrics``; None: no metrics) and the retry
    pause of a processor. ``_pause`` counts as the loop going round (waiting on purpose for an unreachable
    dependency is alive) and raises ``ServiceStopping`` once ``stop()`` was called, before or during the pause."""

    def __init__(self, metrics: Any, sleep: Callable[[float], Awaitable[None]] | None = None) -> None:
        self.metrics = metrics
        self._sleep = sleep or asyncio.sleep
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def beat(self) -> None:
        """The service's loop went round."""
        if self.metrics is not None:
            self.metrics.beat()

    async def _pause(self, seconds: float) -> None:
        self.beat()
        await pause_unless_stopping(seconds, sleep=self._sleep, stopping=self._stopping, stopped=ServiceStopping)


__all__ = ["ConsumerUnavailable", "ProcessorLifecycle", "ServiceStopping", "raw_message"]
