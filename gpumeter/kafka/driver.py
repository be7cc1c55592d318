"""The aiokafka driver: one ``MessageRunner`` (``gpumeter.stream``) over a consumer, a producer and a store.

Billing and the guard run on it; the attributor runs the same runner under Faust (``services/attributor/app.py``).
What the driver adds to the runner is transport, and nothing of any service's logic:

* **Fetch** batches (``getmany``) from its input topics: as a member of a consumer group (``assignment="group"``:
  partitions come and go with rebalances) or reading every partition itself (``assignment="all"``: a processor
  whose rules span nodes, like the guard's budgets; the group only stores offsets). Start positions: the
  ``start_positions`` given (a state file's), else topics in ``from_beginning`` from their start, else the group's
  committed offsets, else ``auto_offset_reset``.
* **Step** each fetched batch through the runner (``MessageRunner.step_batch``: decode and check per message, a
  bad one dead-lettered alone, then one ``handle_batch`` over the rest), in partition order.
* **Settle** the batch: its state changes go to the ``Store`` in one ``apply`` (in a worker thread; retried with
  backoff, forever, while it raises ``StoreUnavailable``), and ``MessageRunner.settle`` says what to produce, in
  order: each step's emits, what each change owes, the dead letter of a change the store refused.
* **Produce** through an ``Outbox`` (``gpumeter.kafka.outbox``): nothing waits per record; a record that is not
  acknowledged is re-sent with backoff. ``Emit.partition_by_node`` sends a record to its node's partition
  (``schemas.catalog.partition_for_node``), ``latest_wins`` keeps an older state from overwriting a newer one.
  Consecutive records of one output and key (billing's cost records of a node-window) go to the producer as one
  batch (``Outbox.send_many``): the same records, partition and order as one send each, for less CPU.
* **Checkpoint** after every batch (or every ``checkpoint_interval_seconds``): flush the outbox (every record
  acknowledged), tell the store which changes' records are out (``Store.published``), then commit the positions
  read -- or hand them to ``checkpoint`` (the guard writes its state file with them first) and commit what it
  returns. Input is committed only after everything it produced is acknowledged: a crash re-reads exactly what
  was not fully handled, and the store's own idempotence (the ledger's first write wins) makes that harmless.
* **Tick** the processor's clock every ``tick_seconds`` with ``caught_up`` (every assigned partition read to its
  last stable offset as of the latest fetch); its result is settled like a batch's.
* **Liveness**: every batch and tick beats ``gpumeter.health``'s heartbeat and reports the input and outbox
  positions, so a loop stuck in a retry shows as stalled (``ProcessorLifecycle``).

**Partitions** are the processor's to hear of (``on_assigned`` / ``on_revoked`` of the contract): assigned ones
once sought to their start (every partition at start under ``assignment="all"``), revoked ones after the last
batch that read them. A revocation settles the processor's ``on_revoked`` result (its state changes made durable
in the store, its records produced), then flushes and commits, then drops the partitions; if that settling fails,
nothing is committed, so no offset stands past input whose effect is not durable, and the partitions' new owner
reads them again from the last commit. ``run(stop)`` returns when ``stop`` is set, after a last flush and commit
(both best effort: what is not committed is read again).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Iterable, Literal, Mapping, Sequence

from gpumeter.clock import Clock
from gpumeter.stream.deadletter import RawMessage
from gpumeter.kafka.outbox import Outbox, next_backoff_seconds
from gpumeter.kafka.processor import ConsumerUnavailable, ProcessorLifecycle, ServiceStopping, raw_message
from gpumeter.stream.contract import Emit, Result, Settled, Store, StoreUnavailable
from gpumeter.stream.runner import MessageRunner, changes_of
from schemas.catalog import partition_for_node

log = logging.getLogger(__name__)

TopicPartition = tuple[str, int]
Checkpoint = Callable[[Mapping[TopicPartition, int]], Awaitable[Mapping[TopicPartition, int] | None]]


def _same_key_runs(emits: Sequence[Emit]) -> list[list[Emit]]:
    """``emits`` cut, in order, into runs that one producer batch can carry: consecutive records of one output, one
    key (not None) and one ``partition_by_node``, none ``latest_wins`` (a compacted state is sent alone, as the
    outbox re-sends it); every other record a run of its own."""
    runs: list[list[Emit]] = []
    for emit in emits:
        last = runs[-1][-1] if runs else None
        if (last is not None and not emit.latest_wins and not last.latest_wins and emit.key is not None
                and emit.key == last.key and emit.output == last.output
                and emit.partition_by_node == last.partition_by_node):
            runs[-1].append(emit)
        else:
            runs.append([emit])
    return runs


class KafkaDriver(ProcessorLifecycle):
    """See the module docstring. ``producer``: anything with ``send(topic, record, *, key, partition)`` returning a
    delivery future and ``partitions_for(topic)`` (``gpumeter.kafka.producer.RecordProducer``). ``outputs``: emit
    role -> topic. ``on_emitted(emits)``: told of every record handed to the outbox (the guard's Alertmanager
    sink). ``on_read_to_start()``: called once the driver has read every assigned partition as far as it reached
    when the driver started -- in group mode, when it was assigned (partitions assigned before it is called are
    waited for together) --; its result is settled (the guard publishes what its rebuild held back).
    ``on_assigned(partitions)``: awaited in group mode once assigned partitions are positioned (the guard's
    ``nodes`` role rebuilds their state). ``co_partitioned``: the group assigns partition ``p`` of every input topic
    to the same member (Kafka's range assignor; input topics keyed alike with equal partition counts), instead of
    spreading every topic-partition round-robin."""

    def __init__(
        self,
        runner: MessageRunner,
        *,
        kafka: Any,
        outputs: Mapping[str, str],
        producer: Any,
        clock: Clock,
        consumer_group: str,
        store: Store | None = None,
        metrics: Any = None,
        assignment: Literal["group", "all"] = "group",
        start_positions: Mapping[TopicPartition, int] | None = None,
        from_beginning: Iterable[str] = (),
        auto_offset_reset: str = "earliest",
        checkpoint: Checkpoint | None = None,
        checkpoint_interval_seconds: float | None = None,
        tick_seconds: float | None = None,
        on_emitted: Callable[[Sequence[Emit]], None] | None = None,
        on_read_to_start: Callable[[], Result] | None = None,
        on_assigned: Callable[[set[TopicPartition]], Awaitable[None]] | None = None,
        co_partitioned: bool = False,
        retry_initial_seconds: float = 0.5,
        retry_max_seconds: float = 30.0,
        max_poll_records: int = 2000,
        max_poll_interval_seconds: float = 600.0,
        poll_timeout_ms: int = 500,
        sleep: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(metrics, sleep)
        if assignment not in ("group", "all"):
            raise ValueError(f"assignment must be 'group' or 'all', not {assignment!r}")
        self.runner = runner
        self.kafka = kafka
        self.outputs = dict(outputs)
        missing = [role for role in self.outputs.values() if not role]
        if missing:
            raise ValueError("every output role needs a topic")
        self.producer = producer
        self.clock = clock
        self.consumer_group = consumer_group
        self.store = store
        self.assignment = assignment
        self.start_positions = dict(start_positions or {})
        self.from_beginning = frozenset(from_beginning)
        self.auto_offset_reset = auto_offset_reset
        self.checkpoint_hook = checkpoint
        self.checkpoint_interval_seconds = checkpoint_interval_seconds
        self.tick_seconds = tick_seconds
        self.on_emitted = on_emitted
        self.on_read_to_start = on_read_to_start
        self.on_assigned = on_assigned
        self.co_partitioned = co_partitioned
        self.retry_initial_seconds = retry_initial_seconds
        self.retry_max_seconds = retry_max_seconds
        self.max_poll_records = max_poll_records
        self.max_poll_interval_seconds = max_poll_interval_seconds
        self.poll_timeout_ms = poll_timeout_ms
        self._outbox = Outbox(producer, pause=self._pause, retry_initial_seconds=retry_initial_seconds,
                              retry_max_seconds=retry_max_seconds, on_retry=self._count_retry)
        self._lock = asyncio.Lock()
        self._consumer: Any = None
        self._owned: set[TopicPartition] = set()
        self._taken: dict[TopicPartition, int] = {}  # next offset to read, per partition handled so far
        self._committed: dict[TopicPartition, int] = {}
        self._published: list[Any] = []  # changes whose owed records are in the outbox
        self._partition_counts: dict[str, int] = {}
        self._start_ends: dict[TopicPartition, int] | None = None
        self._generation = 0
        self.batches = 0
        self.commits = 0
        self.store_retries = 0
        self.delivery_retries = 0

    # -- the loop --

    @property
    def input_topics(self) -> tuple[str, ...]:
        return tuple(self.runner.inputs.by_topic)

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set (see the module docstring). Raises ``ConsumerUnavailable`` when Kafka
        cannot be reached at start; any exception of the processor or store other than the expected ones stops
        the service without committing what it was handling."""
        from aiokafka import AIOKafkaConsumer
        from aiokafka.coordinator.assignors.range import RangePartitionAssignor
        from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
        from aiokafka.errors import KafkaError

        consumer = AIOKafkaConsumer(
            partition_assignment_strategy=(
                (RangePartitionAssignor,) if self.co_partitioned else (RoundRobinPartitionAssignor,)),
            **self.kafka.client_kwargs(),
            group_id=self.consumer_group,
            enable_auto_commit=False,
            auto_offset_reset=self.auto_offset_reset,
            isolation_level="read_committed",
            max_poll_records=self.max_poll_records,
            max_poll_interval_ms=int(self.max_poll_interval_seconds * 1000),
            **self.kafka.consumer_fetch_kwargs(),
        )
        self._consumer = consumer
        try:
            try:
                await consumer.start()
                if self.assignment == "group":
                    consumer.subscribe(list(self.input_topics), listener=self._listener())
                else:
                    await self._assign_all(consumer)
            except (KafkaError, OSError, asyncio.TimeoutError) as exc:
                raise ConsumerUnavailable(f"cannot reach Kafka at {self.kafka.bootstrap_servers}: {exc!r}") from exc
        except BaseException:
            await consumer.stop()
            raise
        relay = asyncio.ensure_future(self._relay_stop(stop))
        ticker = asyncio.ensure_future(self._tick_loop()) if self.tick_seconds else None
        waiters = tuple(t for t in (relay, ticker) if t is not None)
        next_checkpoint = self.clock.monotonic_s() + (self.checkpoint_interval_seconds or 0.0)
        try:
            while not self.stopping:
                generation = self._generation
                fetch = asyncio.ensure_future(consumer.getmany(timeout_ms=self.poll_timeout_ms))
                await asyncio.wait((fetch, *waiters), return_when=asyncio.FIRST_COMPLETED)
                if ticker is not None and ticker.done():
                    fetch.cancel()
                    ticker.result()  # the tick loop only ends by raising: surface it
                if not fetch.done():
                    fetch.cancel()
                    break
                batch = fetch.result()
                self.beat()
                self.note_input(tuple(sorted(self._taken.items())),
                                any(batch.values()) or not await self._caught_up())
                async with self._lock:
                    if generation != self._generation:
                        # A rebalance ran while this batch was fetched: the records of partitions still owned are
                        # read again from their first offset (a revoked partition's new owner reads it from the
                        # commit), so a partition is always handled in order from where it was left.
                        self._rewind(consumer, batch)
                        continue
                    await self._handle_batch(batch)
                    await self._check_read_to_start()
                    if self.checkpoint_interval_seconds is None or self.clock.monotonic_s() >= next_checkpoint:
                        await self._checkpoint(retry=True)
                        next_checkpoint = self.clock.monotonic_s() + (self.checkpoint_interval_seconds or 0.0)
        except ServiceStopping:
            log.info("%s: stopped in the middle of a retry; uncommitted input is read again", self.runner.service)
        finally:
            relay.cancel()
            if ticker is not None:
                ticker.cancel()
            self.stop()
            async with self._lock:
                try:
                    await self._checkpoint(retry=False)
                except Exception as exc:  # best effort: whatever is not committed is read again
                    log.warning("%s: final checkpoint failed: %r", self.runner.service, exc)
            await consumer.stop()

    def _rewind(self, consumer: Any, batch: Mapping[Any, Sequence[Any]]) -> None:
        for tp, records in batch.items():
            if records and (tp.topic, tp.partition) in self._owned:
                consumer.seek(tp, records[0].offset)

    async def _handle_batch(self, batch: Mapping[Any, Sequence[Any]]) -> None:
        await self.handle_messages(raw_message(record) for records in batch.values() for record in records)

    async def handle_messages(self, messages: Iterable[RawMessage]) -> int:
        """Step ``messages`` (one fetched batch, in partition order) through the runner at once and settle them
        together: what ``run`` does per fetch. Once stopping it takes no more (the rest is read again after the
        restart). Returns how many it took."""
        batch: list[RawMessage] = []
        for message in messages:
            if self.stopping:
                break
            batch.append(message)
        steps: list[tuple[RawMessage | None, Result]] = [
            (message, step.result) for message, step in zip(batch, self.runner.step_batch(batch))]
        taken = {(message.topic, message.partition): message.offset + 1 for message in batch}
        if steps:
            self.batches += 1
            log.debug("%s: batch of %d messages", self.runner.service, len(steps))
            await self.settle(steps)
        # Read only once settled: a batch whose store apply raised (or was stopped in its retry) is not taken, so
        # no checkpoint -- the final one included -- commits past it, and it is read again after the restart.
        self._taken.update(taken)
        return len(steps)

    async def checkpoint(self, *, retry: bool = True) -> None:
        """Flush the outbox, tell the store what is published, commit what was read (see the module docstring)."""
        async with self._lock:
            await self._checkpoint(retry=retry)

    @property
    def taken(self) -> dict[TopicPartition, int]:
        """The next offset to read per partition handled so far (what the next checkpoint commits)."""
        return dict(self._taken)

    @property
    def unacknowledged(self) -> int:
        """Records handed to the outbox and not acknowledged yet."""
        return len(self._outbox)

    async def settle(self, steps: Sequence[tuple[RawMessage | None, Result]]) -> None:
        """Apply the steps' changes to the store, then produce what they settle into (``MessageRunner.settle``)."""
        changes = changes_of(steps)
        settled: Sequence[Settled] = ()
        if changes and self.store is not None:
            settled = await self._apply(changes)
        settlement = self.runner.settle(steps, settled)
        for run in _same_key_runs(settlement.emits):
            if len(run) == 1:
                await self._produce(run[0])
            else:
                await self._produce_many(run)
        self._published.extend(settlement.published)
        if self.on_emitted is not None and settlement.emits:
            self.on_emitted(settlement.emits)

    async def _apply(self, changes: list[Any]) -> Sequence[Settled]:
        assert self.store is not None
        delay = self.retry_initial_seconds
        while True:
            try:
                return await asyncio.to_thread(self.store.apply, changes)
            except StoreUnavailable as exc:
                self.store_retries += 1
                log.warning("%s: store unavailable, retrying %d changes in %.1f s: %s", self.runner.service,
                            len(changes), delay, exc)
                await self._pause(delay)
                delay = next_backoff_seconds(delay, self.retry_max_seconds)

    async def _destination(self, emit: Emit) -> tuple[str, int | None]:
        """The topic of ``emit``'s output and its partition (None: by key; its node's with ``partition_by_node``)."""
        topic = self.outputs[emit.output]
        if emit.partition_by_node is None:
            return topic, None
        return topic, partition_for_node(emit.partition_by_node, await self._partitions_of(topic))

    async def _produce(self, emit: Emit) -> None:
        topic, partition = await self._destination(emit)
        await self._outbox.send(topic, emit.key, emit.record, latest_wins=emit.latest_wins, partition=partition)

    async def _produce_many(self, run: Sequence[Emit]) -> None:
        """``_produce`` of each of ``run`` (one output, key and partitioning; none ``latest_wins``), handed over
        together (``Outbox.send_many``: a node-window's ~97 cost records in one producer batch)."""
        topic, partition = await self._destination(run[0])
        await self._outbox.send_many(topic, run[0].key, [emit.record for emit in run], partition=partition)

    async def _partitions_of(self, topic: str) -> int:
        count = self._partition_counts.get(topic)
        if count is None:
            count = self._partition_counts[topic] = len(await self.producer.partitions_for(topic))
        return count

    def _count_retry(self) -> None:
        self.delivery_retries += 1

    async def _tick_loop(self) -> None:
        assert self.tick_seconds is not None
        while True:
            await asyncio.sleep(self.tick_seconds)
            async with self._lock:
                if self.stopping:
                    return
                self.beat()
                result = self.runner.tick(self.clock.now_ms(), await self._caught_up())
                if result:
                    await self.settle(((None, result),))

    async def _relay_stop(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.stop()

    async def _caught_up(self) -> bool:
        """Whether every owned partition has been read up to its last stable offset as of the latest fetch (a
        partition not fetched yet is not caught up)."""
        consumer = self._consumer
        if consumer is None:
            return False
        for tp in self._kafka_partitions():
            end = consumer.last_stable_offset(tp)
            if end is None:
                end = consumer.highwater(tp)
            if end is None or await consumer.position(tp) < end:
                return False
        return True

    def _kafka_partitions(self) -> list[Any]:
        from aiokafka.structs import TopicPartition as KafkaTopicPartition

        return [KafkaTopicPartition(t, p) for t, p in sorted(self._owned)]

    async def _check_read_to_start(self) -> None:
        if self._start_ends is None or self.on_read_to_start is None:
            return
        for tp, end in self._start_ends.items():
            position = self._taken.get(tp, self._committed.get(tp))
            if position is None and self._consumer is not None and self.assignment == "group":
                from aiokafka.structs import TopicPartition as KafkaTopicPartition

                position = await self._consumer.position(KafkaTopicPartition(*tp))
            if (position or 0) < end:
                return
        self._start_ends = None
        result = self.on_read_to_start()
        if result:
            await self.settle(((None, result),))

    # -- checkpoints --

    async def _checkpoint(self, *, retry: bool) -> None:
        moved = {tp: p for tp, p in self._taken.items() if tp in self._owned and self._committed.get(tp) != p}
        if not moved and not len(self._outbox) and not self._published:
            return
        if not await self._outbox.flush(retry=retry):
            return
        if self._published and self.store is not None:
            published, self._published = self._published, []
            try:
                await asyncio.to_thread(self.store.published, published, self.clock.now_ms())
            except Exception as exc:
                # Left unmarked, they are published once more after a restart: at least once, never lost.
                log.warning("%s: could not record %d changes as published: %r", self.runner.service,
                            len(published), exc)
        else:
            self._published.clear()
        positions = {tp: p for tp, p in self._taken.items() if tp in self._owned}
        if self.checkpoint_hook is not None:
            to_commit = await self.checkpoint_hook(positions)
            if to_commit is None:
                return
            positions = dict(to_commit)
        await self._commit(positions)

    async def _commit(self, positions: Mapping[TopicPartition, int]) -> None:
        from aiokafka.errors import CommitFailedError, KafkaError
        from aiokafka.structs import OffsetAndMetadata, TopicPartition as KafkaTopicPartition

        moved = {tp: p for tp, p in positions.items() if tp in self._owned and self._committed.get(tp) != p}
        if not moved or self._consumer is None:
            return
        offsets = {KafkaTopicPartition(t, p): OffsetAndMetadata(position, "") for (t, p), position in moved.items()}
        try:
            await self._consumer.commit(offsets)
        except CommitFailedError as exc:
            log.warning("%s: commit failed (group rebalanced); the new owner re-reads from the last commit: %s",
                        self.runner.service, exc)
            return
        except KafkaError as exc:
            log.warning("%s: commit failed, retried at the next checkpoint: %r", self.runner.service, exc)
            return
        self._committed.update(moved)
        self.commits += 1

    # -- partitions --

    def _listener(self) -> Any:
        from aiokafka.abc import ConsumerRebalanceListener

        driver = self

        class Listener(ConsumerRebalanceListener):
            async def on_partitions_revoked(self, revoked):
                await driver._revoked({(tp.topic, tp.partition) for tp in revoked})

            async def on_partitions_assigned(self, assigned):
                await driver._assigned({(tp.topic, tp.partition) for tp in assigned}, assigned)

        return Listener()

    async def _assigned(self, tps: set[TopicPartition], assigned: Iterable[Any] = ()) -> None:
        """Own ``tps`` (sought to their start: ``assigned``, the client's partitions) and tell the processor of the
        ones new to it; its result is settled like a batch's."""
        async with self._lock:
            new = tps - self._owned
            self._owned |= tps
            await self._seek_assigned(assigned)
            if self.on_read_to_start is not None and assigned:
                ends = await self._consumer.end_offsets(list(assigned))
                self._start_ends = {**(self._start_ends or {}),
                                    **{(tp.topic, tp.partition): end for tp, end in ends.items()}}
            result = self.runner.assigned(new)
            if result:
                await self.settle(((None, result),))
            if self.on_assigned is not None:
                # What the contract's synchronous hook cannot do: a service's own reads before the partitions'
                # input (the guard's nodes role reads the violations topic for them).
                await self.on_assigned(tps)
        log.info("%s: assigned %s", self.runner.service, sorted(tps))

    async def _seek_assigned(self, assigned: Iterable[Any]) -> None:
        """Group members start a partition from its committed offset (the consumer's own default) unless a
        start position was given or its topic is read from the beginning."""
        beginning = []
        for tp in assigned:
            key = (tp.topic, tp.partition)
            if key in self.start_positions:
                self._consumer.seek(tp, self.start_positions.pop(key))
            elif tp.topic in self.from_beginning:
                beginning.append(tp)
        if beginning:
            await self._consumer.seek_to_beginning(*beginning)

    async def _revoked(self, tps: set[TopicPartition]) -> None:
        """Give up ``tps``: the processor's ``on_revoked`` result settled, then flush and commit, then drop them
        (see the module docstring). Waits for the batch in hand (the lock): a batch is committed whole or not."""
        async with self._lock:
            revoked = tps & self._owned
            try:
                result = self.runner.revoked(revoked)
                if result:
                    await self.settle(((None, result),))
            except Exception as exc:
                # Not durable: commit nothing, so the new owner reads these partitions again from the last commit.
                log.warning("%s: the processor's state for the revoked partitions %s could not be made durable, "
                            "nothing committed: %r", self.runner.service, sorted(revoked), exc)
            else:
                try:
                    await self._checkpoint(retry=False)
                except Exception as exc:
                    log.warning("%s: commit before revocation failed: %r", self.runner.service, exc)
            if not tps:
                return
            self._owned -= tps
            for tp in tps:
                self._taken.pop(tp, None)
                self._committed.pop(tp, None)
                if self._start_ends is not None:
                    self._start_ends.pop(tp, None)
            self._generation += 1
        if tps:
            log.info("%s: revoked %s", self.runner.service, sorted(tps))

    async def _assign_all(self, consumer: Any) -> None:
        from aiokafka.structs import TopicPartition as KafkaTopicPartition

        from gpumeter.kafka.admin import partition_numbers

        known = await partition_numbers(self.kafka, self.input_topics)
        partitions: list[Any] = []
        for topic in self.input_topics:
            if topic not in known:
                raise ConsumerUnavailable(f"topic {topic} does not exist (run `gpumeter topics create`)")
            partitions.extend(KafkaTopicPartition(topic, p) for p in known[topic])
        consumer.assign(partitions)
        self._owned = {(tp.topic, tp.partition) for tp in partitions}
        assigned = self.runner.assigned(self._owned)
        if assigned:
            async with self._lock:
                await self.settle(((None, assigned),))
        beginning, to_end = [], []
        for tp in partitions:
            key = (tp.topic, tp.partition)
            if key in self.start_positions:
                consumer.seek(tp, self.start_positions[key])
                self._taken[key] = self.start_positions[key]
                continue
            if tp.topic in self.from_beginning:
                beginning.append(tp)
                continue
            committed = await consumer.committed(tp)
            if committed is not None:
                consumer.seek(tp, committed)
                self._committed[key] = committed
            elif self.auto_offset_reset == "earliest":
                beginning.append(tp)
            else:
                to_end.append(tp)
        if beginning:
            await consumer.seek_to_beginning(*beginning)
        if to_end:
            await consumer.seek_to_end(*to_end)
        if self.on_read_to_start is not None:
            ends = await consumer.end_offsets(partitions)
            self._start_ends = {(tp.topic, tp.partition): end for tp, end in ends.items()}
            for tp in partitions:
                key = (tp.topic, tp.partition)
                if key not in self._taken:
                    self._taken[key] = await consumer.position(tp)
            await self._check_read_to_start()
        log.info("%s: reading %d partitions of %s", self.runner.service, len(partitions),
                 ", ".join(self.input_topics))


__all__ = ["Checkpoint", "KafkaDriver"]
