"""Produced records kept until Kafka acknowledged them, re-sent with backoff until it does.

A service that commits its input only after its output is durable enqueues every record through an ``Outbox``:
``send`` hands the record to the producer at once (the producer batches; nothing waits per record) and keeps it
with its delivery future. ``flush()`` waits for every record kept so far. While any was not acknowledged (its
future failed, or the producer refused to enqueue it with ``DeliveryError``) it pauses, doubling the pause up to
``retry_max_seconds``, and sends the failed ones again, until all are acknowledged; only then may the service
commit what the records came from.

Records sent with ``latest_wins`` carry a state on a compacted topic: the newest record of a (topic, key) is the
state. A failed one is re-sent only when no newer record of its (topic, key) was sent after it (delivered or
not), so an old state can never overwrite a newer one. Other records are all re-sent.

``send_many`` hands several records of one key and topic to the producer at once: as its ``send_batch`` (a
batch per node-window rather than a ``send`` per record: the same records on the same partition in the same order,
for a sixth of the client's CPU) when it has one, else one ``send`` each. Each record is kept on its own as with
``send``, with its batch's future: a failed batch fails every record of it, and ``flush`` re-sends them all.

Pauses go through the ``pause`` the service passes in; ``pause_unless_stopping`` is the stop-aware one both
services use: it ends early, raising the service's own exception, once the service was asked to stop. No Kafka
client here: the producer is anything with ``send(topic, record, *, key)`` (``gpumeter.kafka.producer
.RecordProducer`` in the services, fakes in tests).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Protocol, Sequence

from gpumeter.kafka.producer import DeliveryError, PartlyEnqueued

log = logging.getLogger(__name__)


class Producer(Protocol):
    async def send(self, topic: str, record: Any, *, key: bytes | None = None) -> asyncio.Future: ...


def next_backoff_seconds(delay_seconds: float, max_seconds: float) -> float:
    """Exponential backoff: double, capped."""
    return min(delay_seconds * 2, max_seconds)


async def pause_unless_stopping(seconds: float, *, sleep: Callable[[float], Awaitable[None]],
                                stopping: asyncio.Event, stopped: Callable[[], BaseException]) -> None:
    """``sleep(seconds)``, cut short when ``stopping`` is set; raises ``stopped()`` when ``stopping`` was set
    before or during the pause (the caller's retry loop must not go on)."""
    if stopping.is_set():
        raise stopped()
    sleeper = asyncio.ensure_future(sleep(seconds))
    stopper = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait((sleeper, stopper), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sleeper, stopper):
            task.cancel()
    if stopping.is_set():
        raise stopped()


@dataclass(eq=False)
class Outgoing:
    """One record in an ``Outbox``: where it goes, its delivery ``future`` once enqueued, or the ``error`` that
    kept the producer from enqueuing it. ``Outbox.send`` always sets ``topic``; its default only serves records
    built to compare keys (``newest_per_key``)."""

    key: bytes | None
    record: Any
    topic: str = ""
    latest_wins: bool = False
    partition: int | None = None  # None: the producer's partitioner (by key)
    sequence: int = 0  # its place in the outbox's order of sends (progress: ``Outbox.oldest_pending``)
    future: asyncio.Future | None = None
    error: BaseException | None = None

    def failed(self) -> bool:
        """Not enqueued, or its future ended without an acknowledgement. A future still pending is not failed."""
        if self.future is None:
            return True
        if not self.future.done():
            return False
        return self.future.cancelled() or self.future.exception() is not None

    def failure(self) -> BaseException | str:
        """Why it failed (for the log)."""
        if self.error is not None:
            return self.error
        if self.future is None or self.future.cancelled():
            return "cancelled"
        return self.future.exception() or "not acknowledged"


def newest_per_key(outbox: Iterable[Outgoing], failed: Iterable[Outgoing]) -> list[Outgoing]:
    """Of ``failed``, in their order, those that are the newest of their (topic, key) in ``outbox`` (a newer
    record of the key, delivered or not, carries the state that must win on a compacted topic)."""
    newest: dict[tuple[str, bytes | None], Outgoing] = {}
    for outgoing in outbox:
        newest[(outgoing.topic, outgoing.key)] = outgoing
    return [o for o in failed if newest.get((o.topic, o.key)) is o]


class Outbox:
    """Records sent and not yet known to be acknowledged (see the module docstring).

    ``retry_initial_seconds``/``retry_max_seconds``: the first pause before a re-send and its cap. ``pause``: how
    to wait (the service's stop-aware pause; whatever it raises ends ``flush``). ``on_retry``: called once per
    round of re-sends (the services count them).
    """

    def __init__(self, producer: Producer, *, pause: Callable[[float], Awaitable[None]],
                 retry_initial_seconds: float = 0.5, retry_max_seconds: float = 30.0,
                 on_retry: Callable[[], None] | None = None) -> None:
        if retry_initial_seconds <= 0 or retry_max_seconds < retry_initial_seconds:
            raise ValueError("retry pauses must be > 0 with retry_max_seconds >= retry_initial_seconds")
        self.producer = producer
        self.retry_initial_seconds = retry_initial_seconds
        self.retry_max_seconds = retry_max_seconds
        self._pause = pause
        self._on_retry = on_retry
        self._entries: list[Outgoing] = []
        self._sent = 0

    def __len__(self) -> int:
        """Records sent and not yet known to be acknowledged (all of them until a ``flush`` saw them through)."""
        return len(self._entries)

    @property
    def oldest_pending(self) -> int | None:
        """The ``sequence`` of the oldest record not (yet) acknowledged, None when every record was: while flushes
        re-send the same records it stays the same, which is how a loop stuck on them shows (``gpumeter.health``)."""
        for outgoing in self._entries:
            future = outgoing.future
            if future is None or not future.done() or future.cancelled() or future.exception() is not None:
                return outgoing.sequence
        return None

    async def send(self, topic: str, key: bytes | None, record: Any, *, latest_wins: bool = False,
                   partition: int | None = None) -> Outgoing:
        """Hand ``record`` to the producer and keep it until ``flush`` saw it acknowledged. A producer that cannot
        enqueue it (``DeliveryError``) does not fail the call: the record is re-sent by ``flush``. ``partition``:
        where it must go (None: by key)."""
        self._sent += 1
        outgoing = Outgoing(key, record, topic, latest_wins, partition, self._sent)
        self._entries.append(outgoing)
        await self._send(outgoing)
        return outgoing

    async def send_many(self, topic: str, key: bytes, records: Sequence[Any], *,
                        partition: int | None = None) -> list[Outgoing]:
        """``send`` of each of ``records`` (in order; none ``latest_wins``), handed to the producer together (see
        the module docstring). A producer that cannot enqueue them does not fail the call: ``flush`` re-sends
        every record not enqueued."""
        outgoing = []
        for record in records:
            self._sent += 1
            outgoing.append(Outgoing(key, record, topic, False, partition, self._sent))
        self._entries.extend(outgoing)
        send_batch = getattr(self.producer, "send_batch", None)
        if send_batch is None or len(outgoing) < 2:
            for one in outgoing:
                await self._send(one)
            return outgoing
        try:
            futures = await send_batch(topic, records, key=key, partition=partition)
        except DeliveryError as exc:
            futures = exc.enqueued if isinstance(exc, PartlyEnqueued) else []
            for one in outgoing[len(futures):]:
                one.future, one.error = None, exc
            log.debug("could not enqueue %d of %d records to %s (%r); re-sent at the next flush",
                      len(outgoing) - len(futures), len(outgoing), topic, exc)
        for one, future in zip(outgoing, futures):
            one.future, one.error = future, None
        return outgoing

    async def _send(self, outgoing: Outgoing) -> None:
        try:
            if outgoing.partition is None:
                outgoing.future = await self.producer.send(outgoing.topic, outgoing.record, key=outgoing.key)
            else:
                outgoing.future = await self.producer.send(outgoing.topic, outgoing.record, key=outgoing.key,
                                                           partition=outgoing.partition)
            outgoing.error = None
        except DeliveryError as exc:
            outgoing.future, outgoing.error = None, exc
            log.debug("could not enqueue a record to %s (%r); re-sent at the next flush", outgoing.topic, exc)

    async def flush(self, *, retry: bool = True) -> bool:
        """Wait for every record sent so far. With ``retry``, re-send the failed ones with backoff until all are
        acknowledged and return True (or raise what ``pause`` raises); without, return False at the first
        failure, keeping every record for the next flush."""
        delay = self.retry_initial_seconds
        while self._entries:
            futures = [o.future for o in self._entries if o.future is not None]
            if futures:
                await asyncio.gather(*futures, return_exceptions=True)
            failed = [o for o in self._entries if o.failed()]
            if not failed:
                self._entries.clear()
                return True
            log.warning("%d of %d records not acknowledged (%r); re-sending in %.1f s", len(failed),
                        len(self._entries), failed[0].failure(), delay)
            if not retry:
                return False
            if self._on_retry is not None:
                self._on_retry()
            await self._pause(delay)
            delay = next_backoff_seconds(delay, self.retry_max_seconds)
            self._entries = self._to_send_again(failed)
            for outgoing in self._entries:
                await self._send(outgoing)
        return True

    def _to_send_again(self, failed: list[Outgoing]) -> list[Outgoing]:
        latest = [o for o in self._entries if o.latest_wins]
        if not latest:
            return failed
        keep = {id(o) for o in newest_per_key(latest, [o for o in failed if o.latest_wins])}
        return [o for o in failed if not o.latest_wins or id(o) in keep]
