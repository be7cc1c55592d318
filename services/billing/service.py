"""The billing service: node-windows of shares in from Kafka, node bills into the ledger, costs out to Kafka.

Per message of the node-window-shares topic, one node-window whole (``DeadLetterGuard``: bad input becomes a
``DeadLetter`` and the service carries on):

1. decode the ``NodeWindowShares``, reject one impossible on its own (``gpumeter.validation.check_window_shares``:
   ``OUT_OF_RANGE``; a window that has not ended yet beyond ``max_clock_skew_seconds`` is one: billed, it would
   take the real window's ledger keys), then ``bill_node_window`` over its rows (``NodeWindowShares.rows()``) with
   the configured sharing policy (buckets kept or shared to the node-window's pods, ``services.billing.sharing``);
   the message stays held until the end of the fetched batch;
2. at the end of the batch every node-window it brought goes to the ledger in one ``Ledger.write`` (one worker
   thread hop, one transaction; the ledger decides per node-window) → for each node-window, in input order: if
   and only if the ledger says its bill is new, its ``CostRecord``s go to the costs topic (one batch, keyed by node
   name) and its ``NodeWindowCost`` (the bill and every line in one record) to the node-window-costs topic, and the
   Prometheus metrics move. A bill the ledger already holds (redelivery) publishes nothing, unless it was never
   marked published (below).

Offsets are committed by hand, after every record enqueued so far (cost records and dead letters) is acknowledged
(``OffsetTracker``). A crash therefore re-reads exactly what was not billed yet, and the ledger's first-write-wins
keeps the redelivery harmless. A node-window arrives whole, so nothing waits for the rest of a window: no row is
held across batches and no window can be incomplete.

Failures:

* no price for a node (``PriceError``) → the node-window's message is dead-lettered ``NO_PRICE``;
* shares that cannot all be true together (``InconsistentShares``, ``OutOfRange``) → the message is dead-lettered
  with that reason;
* the ledger unreachable (connection refused, server restarting, connection lost) → the write is retried with
  exponential backoff, forever, without consuming further or committing; the database refusing the data
  (``DataError``/``IntegrityError``) → the batch's node-windows are written again one at a time, and the message
  of each one refused on its own is dead-lettered ``LEDGER_REJECTED`` (the others are billed); anything else
  from the ledger (missing schema, a write that would not reconcile) is a bug or a deployment error and stops the
  service without committing;
* Kafka not acknowledging produced records → they are re-sent with backoff (``gpumeter.kafka.outbox``); offsets
  are not committed meanwhile.

The ledger write and the CostRecords' delivery are two systems. Once every record of a flush is acknowledged, the
node-windows whose cost records it carried are marked published in the ledger. A crash after the ledger commit and
before that mark leaves the node-window unpublished: its redelivery is a ledger duplicate the ledger reports as
never published, and its cost records are published then (once: the mark follows). The ledger and ``gpumeter
report`` stay exact either way.

``OffsetTracker`` and ``BillingProcessor`` hold no Kafka client (``BillingProcessor`` gets a producer
with ``send``); ``BillingService`` wires them to aiokafka.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Mapping, Protocol

from sqlalchemy import exc as sa_exc

from gpumeter.clock import Clock
from gpumeter.errors import InvalidMessage
from gpumeter.kafka.deadletter import DeadLetterGuard, RawMessage
from gpumeter.kafka.outbox import Outbox, Producer, next_backoff_seconds
from gpumeter.kafka.processor import (
    ConsumerUnavailable,
    ProcessorLifecycle,
    ServiceStopping,
    input_behind,
    raw_message,
)
from gpumeter.settings import DEFAULT_MAX_REQUEST_SIZE_BYTES
from gpumeter.validation import DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS, check_window_shares
from schemas.catalog import TopicCatalog
from schemas.records import CostRecord, GpuShare, NodeWindowShares
from schemas.typed import codec_for
from services.billing.catalog import PriceCatalog, PriceError
from services.billing.costing import NodeWindowCost, NodeWindowKey, bill_node_window, window_cost_record
from services.billing.ledger import LedgerError, LedgerUnusable, WriteResult
from services.billing.metric_series import BillingSeries
from services.billing.pricing import SplitPolicy
from services.billing.sharing import KEEP_ALL, SharingPolicy

log = logging.getLogger(__name__)

SERVICE_NAME = "billing"
TopicPartition = tuple[str, int]

# The metrics this service exports (all names from gpumeter.metrics.METRICS).
BILLING_METRICS = (
    "gpumeter_messages_consumed_total",
    "gpumeter_dead_letters_total",
    "gpumeter_dead_letters_truncated_total",
    "gpumeter_pod_gpu_cost_micro_usd_total",
    "gpumeter_pod_shared_cost_micro_usd_total",
    "gpumeter_pod_gpu_memory_share",
    "gpumeter_pod_gpu_compute_share",
    "gpumeter_node_cost_micro_usd_total",
    "gpumeter_bucket_cost_micro_usd_total",
    "gpumeter_billing_ledger_rows_written_total",
    "gpumeter_billing_duplicate_rows_total",
)


class NoPrice(InvalidMessage):
    """A node-window no price in the catalog covers."""

    reason_code = "NO_PRICE"


class LedgerRejected(InvalidMessage):
    """A node-window whose values the ledger's database refused (too long, out of range)."""

    reason_code = "LEDGER_REJECTED"


# -- offsets ----------------------------------------------------------------------------------------------------


@dataclass
class _PartitionOffsets:
    next_offset: int
    held: set[int] = field(default_factory=set)

    def position(self) -> int:
        return min(min(self.held), self.next_offset) if self.held else self.next_offset


class OffsetTracker:
    """Which offset of each partition is safe to commit. Pure.

    Every message is either ``done`` (dead-lettered, a duplicate, or billed) or ``hold``-ed by an unfinished
    node-window until ``release``. The safe position of a partition is the oldest held offset, or one past the
    newest finished message when nothing is held: committing it never skips a message whose effect is not yet
    durable, and it never goes backwards. ``commit_positions()`` returns the positions that moved past the last
    ``committed``; ``forget`` drops partitions that were revoked (their offsets are another consumer's now).
    """

    def __init__(self) -> None:
        self._partitions: dict[TopicPartition, _PartitionOffsets] = {}
        self._committed: dict[TopicPartition, int] = {}

    def _state(self, tp: TopicPartition, offset: int) -> _PartitionOffsets:
        state = self._partitions.get(tp)
        if state is None:
            state = self._partitions[tp] = _PartitionOffsets(next_offset=offset)
        return state

    def done(self, tp: TopicPartition, offset: int) -> None:
        state = self._state(tp, offset)
        state.next_offset = max(state.next_offset, offset + 1)

    def hold(self, tp: TopicPartition, offset: int) -> None:
        state = self._state(tp, offset)
        state.held.add(offset)
        state.next_offset = max(state.next_offset, offset + 1)

    def release(self, tp: TopicPartition, offset: int) -> None:
        """Un-hold ``offset`` (its window finished). Unknown partitions (revoked meanwhile) are ignored."""
        state = self._partitions.get(tp)
        if state is not None:
            state.held.discard(offset)

    def position(self, tp: TopicPartition) -> int | None:
        state = self._partitions.get(tp)
        return None if state is None else state.position()

    def taken(self) -> tuple[tuple[TopicPartition, int], ...]:
        """One past the newest message taken (done or held), per partition: how far the consumer got."""
        return tuple(sorted((tp, state.next_offset) for tp, state in self._partitions.items()))

    def held_count(self, tp: TopicPartition | None = None) -> int:
        if tp is not None:
            state = self._partitions.get(tp)
            return 0 if state is None else len(state.held)
        return sum(len(s.held) for s in self._partitions.values())

    def commit_positions(self) -> dict[TopicPartition, int]:
        """Positions that are ahead of what was last committed (the next offset to read, Kafka's convention)."""
        positions = {}
        for tp, state in self._partitions.items():
            position = state.position()
            if position > self._committed.get(tp, -1):
                positions[tp] = position
        return positions

    def committed(self, positions: Mapping[TopicPartition, int]) -> None:
        for tp, position in positions.items():
            if tp in self._partitions:
                self._committed[tp] = max(self._committed.get(tp, -1), position)

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        for tp in tps:
            self._partitions.pop(tp, None)
            self._committed.pop(tp, None)

    @property
    def partitions(self) -> tuple[TopicPartition, ...]:
        return tuple(sorted(self._partitions))


# -- node-windows -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InputWindow:
    """One node-window as it arrived: the message, its ``NodeWindowShares`` record and the record's rows (one
    ``GpuShare`` per unit and subject, what pricing reads)."""

    message: RawMessage
    record: NodeWindowShares
    shares: tuple[GpuShare, ...]

    @property
    def tp(self) -> TopicPartition:
        return (self.message.topic, self.message.partition)

    @property
    def key(self) -> NodeWindowKey:
        return NodeWindowKey(self.record.cluster, self.record.node_name, self.record.window_start_unix_ms)


# -- processing -------------------------------------------------------------------------------------------------


def is_transient_ledger_error(error: LedgerError) -> bool:
    """True when the database could not be reached or the connection broke, or a SQLite file cannot be used safely
    for now (retry); False for anything else."""
    if isinstance(error, LedgerUnusable):
        return error.retry
    cause = error.__cause__
    if isinstance(cause, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError,
                          sa_exc.TimeoutError)):
        return True
    return isinstance(cause, sa_exc.DBAPIError) and bool(cause.connection_invalidated)


def is_rejected_by_ledger(error: LedgerError) -> bool:
    """True when the database refused the values themselves (the same write would fail again)."""
    return isinstance(error.__cause__, (sa_exc.DataError, sa_exc.IntegrityError))


class LedgerWriter(Protocol):
    def write(self, costs: Iterable[CostRecord], bills: Iterable[Any]) -> WriteResult: ...

    def mark_published(self, keys: Iterable[Any], published_at_unix_ms: int) -> int: ...


@dataclass(frozen=True, slots=True)
class _PricedWindow:
    """A complete node-window and its costing, waiting for the batch's ledger write."""

    window: InputWindow
    priced: NodeWindowCost


@dataclass
class ProcessorStats:
    windows_billed: int = 0
    windows_already_billed: int = 0
    windows_republished: int = 0
    windows_dead_lettered: int = 0
    cost_records_sent: int = 0
    ledger_retries: int = 0
    delivery_retries: int = 0


class BillingProcessor(ProcessorLifecycle):
    """Bills node-window messages; owns the offsets that are safe to commit. No Kafka client inside.

    ``handle_batch(messages)`` processes the messages of one fetched batch completely: when it returns, each one
    is dead-lettered or its node-window billed (every node-window of the batch in one ledger write) and its
    records enqueued. ``handle(message)`` is the same for a batch of one message. ``flush()`` waits until every
    record enqueued so far is acknowledged (re-sending failures with backoff); only after it returns are
    ``commit_positions()`` safe to commit. Retry pauses end early with ``ServiceStopping`` once ``stop()`` was
    called.
    """

    def __init__(
        self,
        *,
        catalog: PriceCatalog,
        policy: SplitPolicy,
        ledger: LedgerWriter,
        producer: Producer,
        topics: TopicCatalog,
        clock: Clock,
        series_memory_seconds: float,
        retry_initial_seconds: float = 0.5,
        retry_max_seconds: float = 30.0,
        team_label: str = "team",
        metrics=None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        max_clock_skew_seconds: int = DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS,
        max_request_size_bytes: int = DEFAULT_MAX_REQUEST_SIZE_BYTES,
        sharing: SharingPolicy = KEEP_ALL,
    ) -> None:
        self.catalog = catalog
        self.sharing = sharing
        self.max_clock_skew_ms = max_clock_skew_seconds * 1000
        self.policy = policy
        self.ledger = ledger
        self.producer = producer
        self.topics = topics
        self.clock = clock
        self.retry_initial_seconds = retry_initial_seconds
        self.retry_max_seconds = retry_max_seconds
        self.team_label = team_label
        super().__init__(metrics, sleep)
        self._publishing: set = set()  # node-windows enqueued on the costs topic, not yet marked published
        self.offsets = OffsetTracker()
        self.guard = DeadLetterGuard(SERVICE_NAME, topics.dead_letters, self._enqueue, clock, metrics,
                                     max_request_size_bytes=max_request_size_bytes)
        self.stats = ProcessorStats()
        self._outbox = Outbox(producer, pause=self._pause, retry_initial_seconds=retry_initial_seconds,
                              retry_max_seconds=retry_max_seconds, on_retry=self._count_delivery_retry)
        self._codec = codec_for(NodeWindowShares)
        # Labelled series by the nodes that hold them (services.billing.metric_series): a pod's series go once a
        # newer window of its node lacks it, a node's once it has billed nothing for series_memory_seconds.
        self.series = None if not metrics else BillingSeries(
            metrics, team_label=team_label,
            node_memory_ms=int(series_memory_seconds * 1000))

    # -- messages --

    async def handle(self, message: RawMessage) -> bool:
        """Process one node-window message completely; returns whether it was taken (False: dead-lettered)."""
        completed: dict[NodeWindowKey, _PricedWindow] = {}
        taken = await self._take(message, completed)
        await self._bill(list(completed.values()))
        return taken

    async def handle_batch(self, messages: Iterable[RawMessage]) -> int:
        """Process the messages of one fetched batch in order, then bill every node-window they brought with one
        ledger write. Stops taking messages once ``stop()`` was called (what it did not take is read again after
        the restart; the node-windows already taken are still billed). Returns how many it took."""
        completed: dict[NodeWindowKey, _PricedWindow] = {}
        taken = 0
        for message in messages:
            if self.stopping:
                break
            await self._take(message, completed)
            taken += 1
        await self._bill(list(completed.values()))
        return taken

    async def _take(self, message: RawMessage, completed: dict[NodeWindowKey, _PricedWindow]) -> bool:
        """One message: dead-lettered, or its node-window priced and joining ``completed`` (held until billed)."""
        tp = (message.topic, message.partition)
        window = await self.guard.handle(message, self._decode)
        if window is None:
            self.offsets.done(tp, message.offset)
            return False
        self.offsets.hold(tp, message.offset)
        entry = await self._price(window)
        if entry is not None:
            if entry.window.key in completed:
                # A node-window twice in one batch (a redelivery): bill the first one before the second, as one
                # message at a time would; one ledger write may not hold two bills of a node-window.
                await self._bill(list(completed.values()))
                completed.clear()
            completed[entry.window.key] = entry
        return True

    async def _decode(self, message: RawMessage) -> InputWindow:
        assert message.value is not None
        record = self._codec.decode(message.value)
        check_window_shares(record, self.clock.now_ms(), self.max_clock_skew_ms)
        return InputWindow(message, record, record.rows())

    def partitions_revoked(self, tps: Iterable[TopicPartition]) -> None:
        """Forget the offsets of partitions this consumer no longer owns."""
        self.offsets.forget(set(tps))

    async def _dead_letter(self, window: InputWindow, error: InvalidMessage) -> None:
        await self.guard.reject(window.message, error)
        self.stats.windows_dead_lettered += 1
        self._release(window)

    def _release(self, window: InputWindow) -> None:
        self.offsets.release(window.tp, window.message.offset)

    # -- billing --

    async def _price(self, window: InputWindow) -> _PricedWindow | None:
        """The window's costing, or None when it was dead-lettered (no price, shares inconsistent)."""
        key = window.key
        try:
            priced = bill_node_window(window.shares, self.catalog, self.policy, self.sharing)
        except PriceError as exc:
            log.warning("no price for %s: %s", key, exc)
            await self._dead_letter(window, NoPrice(f"{key.cluster}/{key.node_name}: {exc}"))
            return None
        except InvalidMessage as exc:
            await self._dead_letter(window, exc)
            return None
        return _PricedWindow(window, priced)

    async def _bill(self, entries: list[_PricedWindow]) -> None:
        """Write ``entries`` (distinct node-windows) to the ledger in one call, then publish or skip each one."""
        if not entries:
            return
        try:
            result = await self._write_ledger(entries)
        except LedgerError as exc:
            if not is_rejected_by_ledger(exc):
                raise
            if len(entries) > 1:
                # One refused node-window refuses the whole transaction: alone, each one is billed or refused.
                log.warning("the ledger refused a write of %d node-windows, writing them one at a time: %s",
                            len(entries), exc)
                for entry in entries:
                    await self._bill([entry])
                return
            await self._dead_letter(entries[0].window, LedgerRejected(str(exc)))
            return
        for entry in entries:
            await self._settle(entry, result)

    async def _write_ledger(self, entries: list[_PricedWindow]) -> WriteResult:
        """One ``Ledger.write`` of every entry, retried with backoff while the ledger is unreachable. Raises any
        other ``LedgerError``, and ``ServiceStopping`` out of a pause."""
        costs = [cost for entry in entries for cost in entry.priced.costs]
        bills = [entry.priced.bill for entry in entries]
        more = f" and {len(entries) - 1} more node-windows" if len(entries) > 1 else ""
        delay = self.retry_initial_seconds
        while True:
            try:
                return await asyncio.to_thread(self.ledger.write, costs, bills)
            except LedgerError as exc:
                if not is_transient_ledger_error(exc):
                    raise
                self.stats.ledger_retries += 1
                log.warning("ledger unavailable, retrying %s%s in %.1f s: %s", entries[0].window.key, more, delay,
                            exc)
                await self._pause(delay)
                delay = next_backoff_seconds(delay, self.retry_max_seconds)

    async def _settle(self, entry: _PricedWindow, result: WriteResult) -> None:
        """After the ledger write: enqueue the window's cost records when its bill is new or was never published,
        move the stats and metrics, and release its messages."""
        window, priced = entry.window, entry.priced
        key = window.key
        # One cost record per ledger line: bill_node_window's rows are unique per unit and subject.
        lines = len(priced.costs)
        # Never marked published, and not already on its way from this process (a redelivery in the same batch
        # as the first delivery): publish it.
        republish = key in result.unpublished and key not in self._publishing
        if key in result.written or republish:
            node_key = key.node_name.encode("utf-8")
            for record in priced.costs:
                await self._enqueue(self.topics.costs, node_key, record)
            await self._enqueue(self.topics.node_window_costs, node_key, window_cost_record(priced, window.record))
            self._publishing.add(key)
            self.stats.cost_records_sent += lines
            if key in result.written:
                self.stats.windows_billed += 1
                self._observe_new_bill(window, priced)
                log.debug("billed %s: %d micro-USD in %d cost records", key, priced.bill.node_cost_micro_usd, lines)
            else:
                self.stats.windows_republished += 1
                log.info("%s was in the ledger but never published: publishing its cost records now", key)
        else:
            self.stats.windows_already_billed += 1
            if self.metrics:
                self.metrics.get("gpumeter_billing_duplicate_rows_total").inc(lines)
            log.debug("%s is already in the ledger: nothing published", key)
        self._release(window)

    # -- producing --

    async def _enqueue(self, topic: str, key: bytes | None, record: Any) -> None:
        await self._outbox.send(topic, key, record)

    def _count_delivery_retry(self) -> None:
        self.stats.delivery_retries += 1

    @property
    def unacknowledged(self) -> int:
        return len(self._outbox)

    async def flush(self, *, retry: bool = True) -> bool:
        """Wait for every enqueued record; re-send failures with backoff (``retry``) until all are acknowledged,
        then mark the node-windows whose cost records were acknowledged as published in the ledger.
        Returns whether everything was acknowledged (always True when ``retry``, or ``ServiceStopping``)."""
        acknowledged = await self._outbox.flush(retry=retry)
        if acknowledged and self._publishing:
            keys = tuple(self._publishing)
            try:
                await asyncio.to_thread(self.ledger.mark_published, keys, self.clock.now_ms())
                self._publishing.difference_update(keys)
            except LedgerError as exc:
                # Left unmarked, these windows are published once more after a restart: at least once, never lost.
                log.warning("could not mark %d node-windows published, will retry: %s", len(keys), exc)
        return acknowledged

    def commit_positions(self) -> dict[TopicPartition, int]:
        """Offsets safe to commit once ``flush()`` returned (see ``OffsetTracker``)."""
        return self.offsets.commit_positions()

    def committed(self, positions: Mapping[TopicPartition, int]) -> None:
        self.offsets.committed(positions)

    # -- metrics --

    def _observe_new_bill(self, window: InputWindow, priced: NodeWindowCost) -> None:
        if not self.metrics:
            return
        # The ledger writes every line of a new bill.
        self.metrics.get("gpumeter_billing_ledger_rows_written_total").inc(len(priced.costs))
        self.series.observe(window.key, window.shares, priced)


# -- the Kafka loop ---------------------------------------------------------------------------------------------


class BillingService:
    """The consumer loop: one aiokafka consumer (manual commits, ``read_committed``) feeding a
    ``BillingProcessor``. After every fetched batch it flushes the processor's records and commits the safe
    positions. A rebalance flushes and commits first, then drops the revoked partitions'
    state. ``run(stop)`` returns when ``stop`` is set (after a last flush and commit, both best effort)."""

    def __init__(self, *, kafka, topics: TopicCatalog, processor: BillingProcessor, consumer_group: str,
                 auto_offset_reset: str = "earliest", max_poll_records: int = 2000,
                 max_poll_interval_seconds: float = 600.0, poll_timeout_ms: int = 500) -> None:
        self.kafka = kafka
        self.topics = topics
        self.processor = processor
        self.consumer_group = consumer_group
        self.auto_offset_reset = auto_offset_reset
        self.max_poll_records = max_poll_records
        self.max_poll_interval_seconds = max_poll_interval_seconds
        self.poll_timeout_ms = poll_timeout_ms
        self._lock = asyncio.Lock()
        self._owned: set[TopicPartition] = set()
        self._generation = 0
        self._consumer = None
        self.commits = 0

    async def run(self, stop: asyncio.Event) -> None:
        from aiokafka import AIOKafkaConsumer
        from aiokafka.abc import ConsumerRebalanceListener
        from aiokafka.errors import KafkaError

        service = self

        class Listener(ConsumerRebalanceListener):
            async def on_partitions_revoked(self, revoked):
                await service._revoked({(tp.topic, tp.partition) for tp in revoked})

            async def on_partitions_assigned(self, assigned):
                async with service._lock:
                    service._owned |= {(tp.topic, tp.partition) for tp in assigned}
                log.info("assigned %s", sorted((tp.topic, tp.partition) for tp in assigned))

        consumer = AIOKafkaConsumer(
            **self.kafka.client_kwargs(),
            group_id=self.consumer_group,
            enable_auto_commit=False,
            auto_offset_reset=self.auto_offset_reset,
            isolation_level="read_committed",
            max_poll_records=self.max_poll_records,
            max_poll_interval_ms=int(self.max_poll_interval_seconds * 1000),
        )
        self._consumer = consumer
        consumer.subscribe([self.topics.node_window_shares], listener=Listener())
        try:
            await consumer.start()
        except (KafkaError, OSError) as exc:
            raise ConsumerUnavailable(f"cannot reach Kafka at {self.kafka.bootstrap_servers}: {exc!r}") from exc
        relay = asyncio.ensure_future(self._relay_stop(stop))
        try:
            while not self.processor.stopping:
                generation = self._generation
                fetch = asyncio.ensure_future(consumer.getmany(timeout_ms=self.poll_timeout_ms))
                await asyncio.wait((fetch, relay), return_when=asyncio.FIRST_COMPLETED)
                if not fetch.done():
                    fetch.cancel()
                    break
                batch = fetch.result()
                self.processor.beat()
                self.processor.note_input(self.processor.offsets.taken(),
                                          any(batch.values()) or await input_behind(consumer))
                async with self._lock:
                    if generation != self._generation:
                        # A rebalance ran while this batch was fetched: positions were reset to the committed
                        # offsets, so these records come again from there. Handling them now would break the
                        # offset bookkeeping's assumption that a partition is read in order from its commit.
                        continue
                    # Once stopping, it takes no more records: the rest of the batch is read again after the restart.
                    await self.processor.handle_batch(
                        raw_message(record) for records in batch.values() for record in records)
                    await self._checkpoint()
        except ServiceStopping:
            log.info("stopped in the middle of a retry; uncommitted input will be read again")
        finally:
            relay.cancel()
            self.processor.stop()
            async with self._lock:
                try:
                    if await self.processor.flush(retry=False):
                        await self._commit()
                except Exception as exc:  # best effort: whatever is not committed is read again
                    log.warning("final commit failed: %r", exc)
            await consumer.stop()

    async def _relay_stop(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.processor.stop()

    async def _checkpoint(self) -> None:
        if self.processor.commit_positions() or self.processor.unacknowledged:
            await self.processor.flush()
            await self._commit()

    async def _commit(self) -> None:
        from aiokafka.errors import CommitFailedError, KafkaError
        from aiokafka.structs import OffsetAndMetadata, TopicPartition as KafkaTopicPartition

        positions = {tp: p for tp, p in self.processor.commit_positions().items() if tp in self._owned}
        if not positions or self._consumer is None:
            return
        offsets = {KafkaTopicPartition(t, p): OffsetAndMetadata(position, "")
                   for (t, p), position in positions.items()}
        try:
            await self._consumer.commit(offsets)
        except CommitFailedError as exc:
            log.warning("commit failed (group rebalanced); the new owner re-reads from the last commit: %s", exc)
            return
        except KafkaError as exc:
            log.warning("commit failed, will retry with the next batch: %r", exc)
            return
        self.processor.committed(positions)
        self.commits += 1

    async def _revoked(self, tps: set[TopicPartition]) -> None:
        async with self._lock:
            try:
                if await self.processor.flush(retry=False):
                    await self._commit()
            except Exception as exc:
                log.warning("commit before revocation failed: %r", exc)
            self._owned -= tps
            self._generation += 1
            self.processor.partitions_revoked(tps)
        if tps:
            log.info("revoked %s", sorted(tps))
