"""The streaming attributor: a Faust app, a thin driver over ``services.attributor.processor``.

Every message goes through the one runner (``gpumeter.stream.runner.MessageRunner``: decode, range check,
``AttributorProcessor.handle``, dead letters); every decision about windows, pods, shares and bad input is the
processor's (and its per-partition ``services.attributor.engine``). What the app adds is Faust's part: agents,
tables, the timer, rebalances, delivery. ``build_app(settings, clock)`` returns the ``faust.App``; ``main`` runs it.

Topology (a node's samples and its pods' events share a partition number, so each partition is self-contained):

* ``node-samples`` and ``pod-events`` agents take their input in batches (``faust_batches.take_batches``: up to
  ``AGENT_BATCH_MAX`` messages, or what came within ``AGENT_BATCH_WITHIN_SECONDS`` of a batch's first; an idle
  agent is not woken) and hand each batch to the
  runner at once (``runner.step_batch``: one ``handle_batch``; a bad message is dead-lettered alone). Each
  message's result is then applied inside its own event (Faust writes a table's changelog to the current
  event's partition): its emits are produced (each closed window as one ``NodeWindowShares`` keyed by node name on the
  node-window-shares topic; each dead letter on the dead-letters topic), and its ``TableWrite``s are written to the
  tables ``open_samples`` (each node's progress record ``<node>|progress|<cluster>``: how far its windows are
  done, and the input position of the first tick of its oldest window not yet acknowledged) and ``pods`` (key
  ``<node>/<uid>``, the topic's compaction key: the pod as the engine keeps it; a tombstone removes the key).
  Ticks are not written to a changelog: they are in the input topic already, and a rebuild reads them again.
  The agent does not wait for Kafka's acknowledgement of a window: it goes on with the next message while the
  record is in flight (windows of every node close in the same second; waiting ~30 ms per node-window made the
  close of a large fleet serial). Once Kafka acknowledged it, the next event of the partition tells the processor
  (``AttributorProcessor.acknowledge``) and writes the table changes that follow; until then the window is in
  flight and its node's progress stays behind it. A batch hears of acknowledgements at the last message of each
  partition in it, after its own events' table writes.
* A timer (every second) closes windows of nodes that went silent (``on_clock_partition``), only on partitions
  whose input is caught up, and emits them. Tables can only be written inside an agent's event, so table writes
  that arise outside one (the timer's, a rebuild's) are written by the next event processed on that partition,
  before its own. A crash in between re-emits such a window once after recovery; downstream billing is
  idempotent by (window, GPU, subject).
* After every rebalance (and at start), once Faust has recovered the tables from their changelogs, each newly
  assigned partition is rebuilt from the local table contents (``AttributorProcessor.restore``: pods and progress
  records) before any of the partition's input is processed, its pod events are read from Kafka first
  (``preload_pod_event``), and its samples are read again from ``resume_position``: the first tick of the oldest
  window any node had not seen acknowledged. Ticks of windows already emitted come back as redeliveries and are
  dropped; windows that were in flight are emitted again. A partition kept across a rebalance goes on one past
  the last record its engine processed. Both positions are committed for the group before Faust seeks to the
  committed offsets (``_rewind_streams``), and its first record after the rebalance is checked against them.
* Bad input of any kind becomes a dead letter through the runner; the agents carry on.

Delivery: at-least-once (``processing_guarantee='at_least_once'``). Where input is read again from never rests on
the offsets Faust commits (it commits what its streams acknowledged, which can be past records no agent processed,
and its flush before a commit gives up on a slow producer): a partition resumes from its durable progress records
(rebuilt) or from what its engine processed (kept), as above. The changelog writes of one event go to that
event's partition in order, which is what makes "progress record before deletes" hold after recovery (see
``engine``), and what makes a changelog recovered before the last writes arrived a safe, older prefix.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Iterable, Sequence

import faust
from faust.types import TP

from gpumeter.clock import Clock
from gpumeter.errors import ConfigError, GpumeterError, InvalidMessage
from gpumeter.stream.deadletter import RawMessage
from gpumeter.logflood import guard_root_handlers
from gpumeter.metrics import ServiceMetrics, child_factory
from gpumeter.settings import KafkaSettings
from gpumeter.stream.contract import DEAD_LETTERS, Emit, Result
from gpumeter.stream.runner import MessageRunner
from schemas.records import NodeWindowShares, PodEvent
from schemas.typed import codec_for
from services.attributor.processor import (
    MAX_STORED_POD_BYTES,
    PODS_TABLE,
    SAMPLES_TABLE,
    SERVICE,
    WINDOW_SHARES,
    AttributorProcessor,
    TableWrite,
    input_topics,
    output_topics,
    resume_position,
)
from services.attributor.faust_batches import take_batches
from services.attributor.faust_tables import GpumeterTableManager
from services.attributor.faust_transport import FetchTunedApp
from services.attributor.settings import AttributorSettings

log = logging.getLogger(__name__)


class WindowDeliveryFailed(GpumeterError):
    """Kafka did not acknowledge a window's record (after the producer's own retries)."""


def changelog_topic(app_id: str, table: str) -> str:
    """The changelog topic Faust uses for ``table`` of app ``app_id``."""
    return f"{app_id}-{table}-changelog"


CLOCK_INTERVAL_SECONDS = 1.0

AGENT_BATCH_MAX = 1000
"""The most messages an agent hands the runner at once (``take_batches``)."""
AGENT_BATCH_WITHIN_SECONDS = 0.05
"""How long after a batch's first message an agent waits for it to fill before it handles what it has: the most
a message waits in the agent's buffer."""


def _set_current_event(event: Any) -> None:
    """Make ``event`` Faust's current event (what a table write's changelog partition is taken from), as its
    stream does for each event it yields; ``take_batches`` yields a batch with the last one current."""
    import weakref

    from faust.streams import _current_event

    _current_event.set(weakref.ref(event))


def faust_broker_urls(kafka: KafkaSettings) -> list[str]:
    return [f"kafka://{host.strip()}" for host in kafka.bootstrap_servers.split(",") if host.strip()]


def faust_credentials(kafka: KafkaSettings) -> Any:
    """``KafkaSettings`` security as Faust credentials (None for PLAINTEXT)."""
    protocol = kafka.security_protocol
    if protocol == "PLAINTEXT":
        return None
    ssl_context = None
    if protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        ssl_context = create_ssl_context(cafile=kafka.ssl_cafile, certfile=kafka.ssl_certfile,
                                         keyfile=kafka.ssl_keyfile)
    if protocol == "SSL":
        return faust.SSLCredentials(ssl_context)
    return faust.SASLCredentials(username=kafka.sasl_username, password=kafka.sasl_password,
                                 ssl_context=ssl_context, mechanism=kafka.sasl_mechanism)


def raw_message(message: Any) -> RawMessage:
    """A Faust message as the library-free ``RawMessage`` the runner takes."""
    timestamp = getattr(message, "timestamp", None)
    return RawMessage(
        topic=message.topic,
        partition=message.partition,
        offset=message.offset,
        key=message.key,
        value=message.value,
        timestamp_ms=int(timestamp * 1000) if timestamp else None,
    )


class AttributorStream:
    """The Faust app driving one ``AttributorProcessor`` through one ``MessageRunner``. Build with ``build_app``."""

    def __init__(self, settings: AttributorSettings, clock: Clock, metrics: ServiceMetrics | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        if settings.partitions is None:
            raise ConfigError("the attributor needs the input topics' partition count (settings.partitions)")
        if settings.data_dir is None:
            raise ConfigError("the attributor needs a data folder (settings.data_dir)")
        self.settings = settings
        self.clock = clock
        self.metrics = metrics or ServiceMetrics(SERVICE, dead_letters=settings.dead_letters)
        self.partitions = settings.partitions
        catalog = settings.kafka.catalog
        self.samples_topic_name = catalog.node_samples
        self.pods_topic_name = catalog.pod_events
        self.processor = AttributorProcessor(settings.engine_config(), self.partitions)
        self.runner = MessageRunner(self.processor, input_topics(catalog), clock, metrics=self.metrics,
                                    max_request_size_bytes=settings.kafka.max_request_size_bytes)
        self.outputs = output_topics(catalog)

        self._assigned: set[int] = set()
        self._processed_offset: dict[int, int] = {}  # samples partition -> last offset processed
        self._processed_pod_offset: dict[int, int] = {}  # pod-events partition -> last offset processed
        # partition -> one past its newest progress record after a rebuild; checked once, on its first record
        self._resume_samples_from: dict[int, int] = {}
        self._resume_pods_from: dict[int, int] = {}
        # partition -> table writes that arose outside an event of it (timer, rebuild): written by its next event
        self._deferred: dict[int, list[TableWrite]] = {}
        # partition -> window records sent and not yet acknowledged to the processor, each with its delivery future
        self._in_flight: dict[int, list[tuple[tuple[NodeWindowShares, ...], list[asyncio.Future]]]] = {}
        self._second_collector_reported: dict[tuple[str, str], int] = {}  # (cluster, node) -> ticks counted
        # Samples partitions not known to be caught up (assigned and not read to their end yet, or seen behind by
        # the timer): the batch that reads one to its end runs its clock at once (``_clock_partition``) rather
        # than leave its due windows to the next timer tick, up to a second later.
        self._behind: set[int] = set()
        # Each node's clock-skew gauge, set every second for every node (``gpumeter.metrics.child_factory``)
        self._skew_child = child_factory(self.metrics.get("gpumeter_attributor_node_clock_skew_seconds"))
        self._ready = False
        self._rebuild_lock = asyncio.Lock()
        self._on_failure = on_failure
        self.failure: BaseException | None = None

        self.app = FetchTunedApp(
            settings.app_id,
            consumer_fetch=settings.kafka.consumer_fetch_kwargs(),
            env={},  # settings come from AttributorSettings only, never from Faust's own environment variables
            autodiscover=False,
            broker=faust_broker_urls(settings.kafka),
            broker_credentials=faust_credentials(settings.kafka),
            broker_client_id=settings.kafka.client_id,
            store=settings.store,
            datadir=str(settings.data_dir),
            broker_session_timeout=settings.session_timeout_seconds,
            broker_heartbeat_interval=min(3.0, settings.session_timeout_seconds / 5),
            processing_guarantee="at_least_once",
            consumer_auto_offset_reset="earliest",
            producer_acks=-1,
            producer_compression_type=settings.kafka.compression_type,
            producer_max_request_size=settings.kafka.max_request_size_bytes,
            producer_max_batch_size=settings.kafka.producer_batch_bytes,
            topic_partitions=self.partitions,
            topic_replication_factor=settings.topic_replication_factor,
            table_standby_replicas=settings.table_standby_replicas,
            topic_disable_leader=True,
            web_enabled=False,
            TableManager=GpumeterTableManager,  # Faust's recovery with a rebalance race closed (see faust_tables)
        )
        app = self.app
        raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
        self.samples_topic = app.topic(self.samples_topic_name, partitions=self.partitions, **raw)
        self.pods_topic = app.topic(self.pods_topic_name, partitions=self.partitions, **raw)
        self.shares_topic = app.topic(self.outputs[WINDOW_SHARES], **raw)
        self.dead_letters_topic = app.topic(self.outputs[DEAD_LETTERS], **raw)
        self.open_samples = app.Table(SAMPLES_TABLE, key_type=str, value_type=bytes, partitions=self.partitions,
                                      help="Each node's progress record (raw ticks of open windows only in tables "
                                           "written by older versions).")
        self.pods = app.Table(PODS_TABLE, key_type=str, value_type=bytes, partitions=self.partitions,
                              help="Raw latest PodEvent per pod of the partition's nodes.")

        app.agent(self.samples_topic, name=f"{SERVICE}.node-samples")(self._samples_agent)
        app.agent(self.pods_topic, name=f"{SERVICE}.pod-events")(self._pods_agent)
        app.timer(CLOCK_INTERVAL_SECONDS, name=f"{SERVICE}.clock")(self._clock_timer)
        app.on_partitions_revoked.connect(self._on_partitions_revoked)
        app.on_partitions_assigned.connect(self._on_partitions_assigned)
        app.on_rebalance_complete.connect(self._on_rebalance_complete)

    # -- agents --------------------------------------------------------------------------------------------------

    async def _samples_agent(self, stream: Any) -> None:
        await self._consume(stream, "node-samples agent", self.process_samples)

    async def _pods_agent(self, stream: Any) -> None:
        await self._consume(stream, "pod-events agent", self.process_pod_events)

    async def _consume(self, stream: Any, name: str,
                       process: Callable[..., Awaitable[None]]) -> None:
        """Feed ``process`` what the stream took in, a batch at a time (``take_batches``: at most
        ``AGENT_BATCH_MAX`` events, or what came within ``AGENT_BATCH_WITHIN_SECONDS`` of the batch's first). A
        batch's events are acknowledged once ``process`` returned, so Faust's commits never pass a batch in hand."""
        async for events in take_batches(stream, AGENT_BATCH_MAX, AGENT_BATCH_WITHIN_SECONDS):
            try:
                await process([raw_message(event.message) for event in events],
                              lambda index, events=events: _set_current_event(events[index]))
            except Exception as exc:
                self._fail(name, exc)
                raise

    async def process_sample(self, raw: RawMessage) -> None:
        """One node-samples message, whole (inside its event): ``process_samples`` of a batch of one."""
        await self.process_samples((raw,))

    async def process_pod_event(self, raw: RawMessage) -> None:
        """One pod-events message, whole (inside its event); a tombstone removes the pod's table entry."""
        await self.process_pod_events((raw,))

    async def process_samples(self, raws: Sequence[RawMessage],
                              enter: Callable[[int], None] | None = None) -> None:
        """A batch of node-samples messages (see ``_process``). Bad input is dead-lettered; anything else raised
        is not bad input (the agent stops the worker)."""
        await self._process(self.samples_topic_name, self._resume_samples_from, self._processed_offset, raws, enter)

    async def process_pod_events(self, raws: Sequence[RawMessage],
                                 enter: Callable[[int], None] | None = None) -> None:
        """A batch of pod-events messages (see ``_process``)."""
        await self._process(self.pods_topic_name, self._resume_pods_from, self._processed_pod_offset, raws, enter)

    async def _process(self, topic: str, resume_from: dict[int, int], processed: dict[int, int],
                       raws: Sequence[RawMessage], enter: Callable[[int], None] | None) -> None:
        """One batch of one topic's messages, each partition's in offset order: first, per partition, its first
        record after a rebalance is checked against its resume position (``_check_resume``); then the runner
        steps the batch at once (``step_batch``: one ``handle_batch``); then each message's result is applied
        inside its own event (``enter(i)`` makes the i-th message's event the current one: Faust writes a
        table's changelog to the current event's partition): its records sent, its table writes written. The
        windows Kafka acknowledged are told to the processor at the last message of their partition in the
        batch, so the table writes that follow come after every write of the batch's own events: the same
        writes, in the same order, as one message at a time with the acknowledgements arriving after the batch."""
        for index, raw in enumerate(raws):
            if enter is not None:
                enter(index)
            await self._ensure_partition(raw.partition)
            await self._check_resume(topic, resume_from, raw, self._step)
        steps = self.runner.step_batch(raws)
        last = {raw.partition: index for index, raw in enumerate(raws)}
        for index, (raw, step) in enumerate(zip(raws, steps)):
            if enter is not None:
                enter(index)
            await self._send(raw.partition, step.result.emits)
            changes = step.result.changes
            if last[raw.partition] == index:
                changes = changes + self._settle(raw.partition).changes
            self._write_tables(raw.partition, changes)
            processed[raw.partition] = raw.offset
        if topic == self.samples_topic_name:
            await self._clock_caught_up(last)

    async def _step(self, raw: RawMessage) -> None:
        """``runner.step(raw)`` applied inside ``raw``'s event: its records sent, then the windows Kafka acknowledged
        since told to the processor, then every table write of the partition (deferred ones first)."""
        step = self.runner.step(raw)
        await self._send(raw.partition, step.result.emits)
        acknowledged = self._settle(raw.partition)
        self._write_tables(raw.partition, step.result.changes + acknowledged.changes)

    async def _check_resume(self, topic: str, resume_from: dict[int, int], raw: RawMessage,
                            process: Callable[[RawMessage], Awaitable[None]]) -> None:
        """Before the first record of a partition after a rebalance: process what lies between its resume position
        (rebuilt: ``resume_position``; kept: one past its last record processed) and that record, read directly
        from Kafka.

        ``_rewind_streams`` seeks and commits every assigned partition to that position, but Faust does not always
        honour it (the commit fails when another rebalance is under way): after a crash it can resume at a
        committed offset beyond what its changelog made durable (seen in CI, when open ticks were still stored: 16
        of the 36 ticks below the resume point were missing, and a window was lost). The records in between are
        therefore read again here, inside the current event so that their table writes go to this partition's
        changelog, and processed in order; ticks of windows already emitted come back as redeliveries, which the
        engine drops."""
        start = resume_from.pop(raw.partition, None)
        if start is None or raw.offset <= start:
            return
        log.warning("%s[%d]: resumed at offset %d, past the resume position (%d): processing %d..%d from "
                    "Kafka first", topic, raw.partition, raw.offset, start, start, raw.offset - 1)
        count = 0
        async for record in self._read_range(topic, raw.partition, start, raw.offset):
            await process(record)
            count += 1
        log.info("%s[%d]: %d records before offset %d processed again", topic, raw.partition, count, raw.offset)

    async def _preload_pod_events(self, partitions: set[int]) -> None:
        """Apply every pod event Kafka holds for the rebuilt ``partitions`` to the processor before streams resume.

        Samples and pod events are two topics read concurrently: after a restart or a rebalance the samples agent
        can race ahead of the pod events its ticks need, and windows would close with their processes attributed
        to no pod (seen in the stream-equals-replay test). Reading the partition's pod events (a compacted topic:
        one record per live pod) first closes that race; the pods agent reads them again afterwards, and the engine
        ignores what it already has. Records the runner does not accept are left to the agent, which dead-letters
        them."""
        await asyncio.gather(*(self._preload_partition(p) for p in sorted(partitions)))

    async def _preload_partition(self, partition: int) -> None:
        if not self.processor.has_partition(partition):
            return
        applied = 0
        async for record in self._read_range(self.pods_topic_name, partition, 0, None):
            try:
                event = self.runner.decode(record)
                if not isinstance(event.record, PodEvent):
                    continue  # a tombstone: the pods agent removes its table entry
                changed, result = self.processor.preload_pod_event(partition, event.record,
                                                                   event.received_at_unix_ms, event.timestamp_ms)
            except InvalidMessage:
                continue
            self._defer(partition, result.changes)
            applied += changed
        log.info("partition %d: %d pod events applied before its streams resume", partition, applied)

    async def _resume_pods_after_preload(self, partitions: set[int]) -> None:
        """A rebuilt partition's pods stream resumes at the group's committed offset on the pod-events topic, not at
        its beginning: the preload has applied every pod event up to the topic's end, so what lies below the
        commit is in the state already, and the group handled it (a bad record there was dead-lettered by
        whoever processed it). Re-reading from the beginning applied every pod a third time (table, preload,
        stream; about 1 ms per pod at each worker's start: make bench's scale-out phase) and dead-lettered the
        partition's bad pod events again at every rebuild. Where the group has no commit, or it cannot be read
        (another rebalance under way), the stream starts at the beginning as before."""
        if not partitions:
            return
        committed = await self._committed_positions({TP(self.pods_topic_name, p) for p in partitions})
        for partition in sorted(partitions):
            offset = committed.get(TP(self.pods_topic_name, partition))
            if offset is not None and offset > 0 and partition in self._resume_pods_from:
                self._resume_pods_from[partition] = offset

    async def _committed_positions(self, tps: set[TP]) -> dict[TP, int | None]:
        """The group's committed offsets of ``tps`` (None: no commit), read on Faust's consumer thread; empty
        when they cannot be read."""
        from aiokafka.structs import TopicPartition

        thread = self.app.consumer._thread  # faust-streaming's AIOKafkaConsumerThread
        offsets: dict[TP, int | None] = {}
        try:
            client = thread._ensure_consumer()
            for tp in sorted(tps):
                offsets[tp] = await thread.call_thread(client.committed, TopicPartition(tp.topic, tp.partition))
        except Exception as exc:
            log.warning("could not read the group's committed offsets of %s: %r",
                        sorted(f"{tp.topic}[{tp.partition}]" for tp in tps), exc)
            return {}
        return offsets

    async def _read_range(self, topic: str, partition: int, start: int, stop: int | None):
        """Records of one partition with ``start <= offset < stop`` (``stop`` None: its end offset now), read by a
        group-less consumer."""
        from aiokafka import AIOKafkaConsumer
        from aiokafka.structs import TopicPartition

        consumer = AIOKafkaConsumer(**self.settings.kafka.client_kwargs(), group_id=None,
                                    enable_auto_commit=False, auto_offset_reset="earliest")
        tp = TopicPartition(topic, partition)
        await consumer.start()
        try:
            consumer.assign([tp])
            if stop is None:
                stop = (await consumer.end_offsets([tp]))[tp]
            if start >= stop:
                return
            consumer.seek(tp, start)
            idle_polls = 0
            while idle_polls < 3:
                batch = await consumer.getmany(tp, timeout_ms=1000, max_records=500)
                records = batch.get(tp, [])
                if not records:
                    if await consumer.position(tp) >= stop:
                        return
                    idle_polls += 1  # records gone (retention, compaction) below ``stop``: stop trying
                    continue
                idle_polls = 0
                for record in records:
                    if record.offset >= stop:
                        return
                    yield RawMessage(topic, partition, record.offset, record.key, record.value, record.timestamp)
                if await consumer.position(tp) >= stop:
                    return  # without waiting out another poll
        finally:
            await consumer.stop()

    # -- timer -----------------------------------------------------------------------------------------------------

    async def _clock_timer(self) -> None:
        if self.failure is None:
            self.metrics.beat()  # the event loop runs the timer: liveness (gpumeter.health)
        if not self._ready or self.app.rebalancing:
            return
        # Progress (gpumeter.health): the offsets processed, and whether samples are waiting behind them; agents
        # stuck on one record (retrying it, or awaiting what never comes) leave them standing while the timer runs.
        self.metrics.progress("input", (tuple(sorted(self._processed_offset.items())),
                                        tuple(sorted(self._processed_pod_offset.items()))),
                              any(not self._caught_up(p) for p in self.processor.partitions()))
        self._report_clocks()
        now_ms = self.clock.now_ms()
        try:
            for partition in self.processor.partitions():
                caught_up = self._caught_up(partition)
                if caught_up:
                    self._behind.discard(partition)
                else:
                    self._behind.add(partition)
                await self._clock_partition(partition, now_ms, caught_up)
        except Exception as exc:
            self._fail("clock timer", exc)
            raise

    async def _clock_partition(self, partition: int, now_ms: int, caught_up: bool) -> None:
        """The processor's clock step for ``partition`` (``on_clock_partition``): its records sent, its table
        writes deferred to the partition's next event (none is current here)."""
        result = self.processor.on_clock_partition(partition, now_ms, caught_up)
        await self._send(partition, result.emits)
        self._defer(partition, result.changes)

    async def _clock_caught_up(self, partitions: Iterable[int]) -> None:
        """Of ``partitions`` (those a samples batch just read), each that was behind and is now read to its end:
        its clock step now. A backlog's windows the clock has closed (a restart's, a worker's catching up) go out
        as soon as it is read, not at the next timer tick; a partition caught up all along costs nothing here."""
        if not self._behind or not self._ready or self.app.rebalancing:
            return
        now_ms = self.clock.now_ms()
        for partition in sorted(self._behind.intersection(partitions)):
            if self.processor.has_partition(partition) and self._caught_up(partition):
                self._behind.discard(partition)
                try:
                    await self._clock_partition(partition, now_ms, True)
                except Exception as exc:
                    self._fail("clock after catching up", exc)
                    raise

    def _report_clocks(self) -> None:
        """Each node's clock offset (``gpumeter_attributor_node_clock_skew_seconds``) and the ticks of second
        collectors merged since the last report."""
        skew = self._skew_child
        for (_, node), offset_ms in sorted(self.processor.clock_offsets().items()):
            skew((node,)).set(offset_ms / 1000)
        counter = self.metrics.get("gpumeter_attributor_second_collector_ticks_total")
        for key, count in sorted(self.processor.second_collector_counts().items()):
            reported = self._second_collector_reported.get(key, 0)
            if count > reported:
                counter.labels(key[1]).inc(count - reported)
                self._second_collector_reported[key] = count

    def _fail(self, where: str, exc: BaseException) -> None:
        """An error that is not bad input (a bug, Kafka unreachable past its timeouts): windows may have closed
        without their rows going out. Stop through ``on_failure`` so that a restart restores and re-emits them
        from the tables, rather than run on with those windows lost."""
        log.exception("%s failed: %r", where, exc)
        if self.failure is None:
            self.failure = exc
            if self._on_failure is not None:
                self._on_failure(exc)

    def _caught_up(self, partition: int) -> bool:
        """Whether every sample of the partition that Kafka holds has been processed. While a backlog is being
        read, its own event time closes windows; a wall clock ahead of it would make the backlog late."""
        tp = TP(self.samples_topic_name, partition)
        consumer = self.app.consumer
        try:
            highwater = consumer.highwater(tp)
        except Exception:  # not assigned (any more), or not fetched yet: not known to be caught up
            return False
        if highwater is None:
            return False
        processed = self._processed_offset.get(partition)
        if processed is not None:
            return processed + 1 >= highwater
        # Nothing processed since the assignment: caught up when the group's committed offset is the end.
        # faust-streaming 0.15 keeps the committed offsets it sought to in Consumer._committed_offset.
        committed = getattr(consumer, "_committed_offset", {}).get(tp)
        if committed is None:
            return highwater == 0
        return committed >= highwater

    # -- emission and tables ---------------------------------------------------------------------------------------

    async def _send(self, partition: int, emits: Sequence[Emit]) -> list[asyncio.Future]:
        """Enqueue ``emits`` in order without waiting for Kafka; window records stay in flight on ``partition``
        until ``_settle`` finds them acknowledged. Returns the window records' delivery futures."""
        records: list[NodeWindowShares] = []
        futures: list[asyncio.Future] = []
        for emit in emits:
            value = codec_for(type(emit.record)).encode(emit.record)
            if emit.output == WINDOW_SHARES:
                sent = await self.shares_topic.send(key=emit.key, value=value)
                records.append(emit.record)
                futures.append(sent)
                sent.add_done_callback(lambda future, record=emit.record: self._acknowledged(record, future))
            elif emit.output == DEAD_LETTERS:
                await self.dead_letters_topic.send(key=emit.key, value=value)
            else:
                raise ValueError(f"{SERVICE} has no output {emit.output!r}")
        if records:
            self._in_flight.setdefault(partition, []).append((tuple(records), futures))
        return futures

    def _settle(self, partition: int) -> Result:
        """Tell the processor of every window record of ``partition`` Kafka acknowledged (in the order sent, a
        batch at a time); the result holds the table writes that follow, for this event to write. A failed
        delivery raises ``WindowDeliveryFailed``: not bad input, so the worker stops, and a restart re-emits the
        window (its node's progress record is still behind it)."""
        pending = self._in_flight.get(partition)
        if not pending:
            return Result()
        acknowledged: list[NodeWindowShares] = []
        waiting = []
        for records, futures in pending:
            if not all(f.done() for f in futures):
                waiting.append((records, futures))
                continue
            for record, future in zip(records, futures):
                error = future.exception() if not future.cancelled() else asyncio.CancelledError()
                if error is not None:
                    raise WindowDeliveryFailed(
                        f"the record of node {record.node_name}'s window {record.window_start_unix_ms} was not "
                        f"delivered: {error!r}") from error
            acknowledged.extend(records)
        self._in_flight[partition] = waiting
        return self.processor.acknowledge(partition, acknowledged) if acknowledged else Result()

    def _acknowledged(self, record: NodeWindowShares, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # ``_settle`` (or the rebuild's re-emission) raises it
        now_ms = self.clock.now_ms()
        closes_at_ms = record.window_end_unix_ms + self.settings.grace_seconds * 1000
        self.metrics.get("gpumeter_attributor_windows_closed_total").inc()
        self.metrics.get("gpumeter_attributor_shares_emitted_total").inc(record.row_count)
        self.metrics.get("gpumeter_attributor_window_lag_seconds").set(max(now_ms - closes_at_ms, 0) / 1000)
        log.info("emitted %d shares of node %s window %d", record.row_count, record.node_name,
                 record.window_start_unix_ms)

    def _defer(self, partition: int, changes: Iterable[TableWrite]) -> None:
        """Table writes that arose outside an event of ``partition``: its next event writes them, first."""
        if changes:
            self._deferred.setdefault(partition, []).extend(changes)

    def _write_tables(self, partition: int, changes: Iterable[TableWrite]) -> None:
        """Write ``partition``'s deferred table writes, then ``changes``, in order; only inside an event of
        ``partition`` (Faust writes a table's changelog to the current event's partition)."""
        for change in (*self._deferred.pop(partition, ()), *changes):
            if change.partition != partition:
                raise RuntimeError(f"a table write of partition {change.partition} in an event of {partition}")
            table = self.open_samples if change.table == SAMPLES_TABLE else self.pods
            if change.value is None:
                if change.key in table:
                    del table[change.key]
            else:
                table[change.key] = change.value

    # -- rebalance and restore -------------------------------------------------------------------------------------

    async def _on_partitions_revoked(self, sender: Any, revoked: Any, **_: Any) -> None:
        self._ready = False

    async def _on_partitions_assigned(self, sender: Any, assigned: Any, **_: Any) -> None:
        self._ready = False
        self._assigned = {tp.partition for tp in assigned if tp.topic == self.samples_topic_name}
        self._behind = set(self._assigned)  # until each is seen read to its end

    def _recovery_overtaken(self) -> bool:
        """Whether the recovery pass now ending was overtaken by a newer rebalance, its tables a partial read.

        faust-streaming 0.15.3 (``Recovery.on_recovery_completed``) sends ``on_rebalance_complete`` before it
        checks the generation: a pass cut short by the next rebalance (which pops the partitions it revokes from
        what the pass waits for) ends in this hook, and Faust then cancels the hook at its first suspension. Seen
        in make bench's fleet loads: the second worker's join made the first rebuild six partitions from about a
        sixth of their pods, then lose its preload; its engine ran on that state. The rebalance has set
        ``signal_recovery_start``: the pass for it reads the changelogs anew and ends in this hook again."""
        return self.app.tables.recovery.signal_recovery_start.is_set()

    async def _on_rebalance_complete(self, sender: Any, **_: Any) -> None:
        # Tables are recovered; streams have not resumed yet. Partitions kept across the rebalance keep their
        # engine and their deferred table writes; new ones are rebuilt from the tables.
        if self._recovery_overtaken():
            log.info("a newer rebalance overtook the table recovery: the partitions are rebuilt after its own")
            return
        # Faust's revocation hook names every partition held (an eager rebalance): only those not assigned again
        # are lost, and only they are revoked in the processor's contract (``on_revoked``: their engines dropped;
        # the new owner re-emits their windows in flight).
        lost = {p for p in self.processor.partitions() if p not in self._assigned}
        self._drop_partitions(lost)
        rebuilt = self._assigned - set(self.processor.partitions())
        try:
            await self._rebuild(rebuilt)
            await self._preload_pod_events(rebuilt)
            await self._resume_pods_after_preload(rebuilt)
            await self._rewind_streams(rebuilt)
        except asyncio.CancelledError:
            # A rebalance arrived mid-hook (Faust cancels it): a partition rebuilt but not preloaded or rewound
            # would be taken for one kept by the next hook, and run without its pods. Drop it; that hook rebuilds.
            self._drop_partitions(rebuilt & set(self.processor.partitions()))
            raise
        assigned = self.runner.assigned(self._topic_partitions(rebuilt))  # nothing beyond the rebuild so far
        if assigned.emits:
            raise RuntimeError(f"{SERVICE}: on_assigned emits nothing (a window is emitted by its partition's event)")
        for change in assigned.changes:
            self._defer(change.partition, (change,))
        self._ready = True

    def _drop_partitions(self, partitions: set[int]) -> None:
        """Revoke ``partitions`` in the processor's contract (``on_revoked``: their engines dropped) and forget
        what this worker kept of them; what is durable of them is in the tables already."""
        if self.runner.revoked(self._topic_partitions(partitions)):
            # Tables of a dropped partition can no longer be written here.
            raise RuntimeError(f"{SERVICE}: on_revoked must leave nothing to flush")
        for partition in partitions:
            self._forget_partition(partition)

    def _forget_partition(self, partition: int) -> None:
        """Forget the positions, deferred table writes and windows in flight this worker kept of ``partition``."""
        self._processed_offset.pop(partition, None)
        self._processed_pod_offset.pop(partition, None)
        self._deferred.pop(partition, None)
        self._in_flight.pop(partition, None)

    def _topic_partitions(self, partitions: Iterable[int]) -> set[tuple[str, int]]:
        return {(topic, p) for p in partitions for topic in (self.samples_topic_name, self.pods_topic_name)}

    async def _rewind_streams(self, rebuilt: set[int]) -> None:
        """Put every assigned input partition where this worker's processing must go on, before streams resume.

        * a partition it kept: one past the last offset it processed there (where a rebuild of an earlier
          rebalance said to resume, if it processed none since; its start if neither);
        * a partition rebuilt from the tables: ``_resume_samples_from`` (``resume_position``: the first tick of the
          oldest window not yet acknowledged; pod events from the start).

        Both are sought and committed for the group, because Faust seeks every partition to its committed offset
        right after this hook, and the group's committed offset is Faust's, not the processor's: Faust commits
        what its streams acknowledged, and acknowledges records it never handed to an agent (a record still
        queued when a revocation suspends the flow is skipped and acknowledged), so its revocation commit can
        stand past input whose effect is in no state at all. On a partition kept, a seek there would skip that
        input for good: its engine runs on, and a window comes out short of the ticks skipped (seen in CI: a
        window of 9 of its 10 ticks after a second worker joined). Each position is also where the partition's
        first record after the rebalance is checked against (``_check_resume``): where the commit fails (another
        rebalance under way) and Faust resumes past it, what lies in between is read from Kafka first.

        Why seek as well: Faust drops records it had already fetched when a rebalance interrupts a batch (and
        any queued from the previous generation), relying on that seek to committed offsets to fetch them again;
        for a partition without a committed offset that seek does nothing. On a partition rebuilt, seeking there
        from inside a stream would race with the records Faust still delivers from before the seek."""
        commits: dict[TP, int] = {}
        seeks: dict[TP, int] = {}
        for partition in sorted(self._assigned):
            for topic, processed, resume_from in (
                    (self.samples_topic_name, self._processed_offset, self._resume_samples_from),
                    (self.pods_topic_name, self._processed_pod_offset, self._resume_pods_from)):
                tp = TP(topic, partition)
                if partition not in rebuilt and partition in processed:
                    resume_from[partition] = processed[partition] + 1
                if partition in resume_from:  # rebuilt, kept, or rebuilt earlier and nothing processed since
                    seeks[tp] = commits[tp] = resume_from[partition]
                else:
                    seeks[tp] = 0  # kept without a known position (not expected): Faust's committed offset wins
        if seeks:
            await self._seek_positions(seeks)
        if commits:
            await self._commit_positions(commits)

    async def _seek_positions(self, offsets: dict[TP, int]) -> None:
        """Seek on Faust's consumer thread and wait until the positions are set. ``Consumer.seek`` would call the
        aiokafka consumer from this thread while its fetcher runs on the other one: seen in the stream benchmark,
        the fetcher then crashed the worker with ``KeyError`` in ``fetched_records`` right after a restart (the
        race faust-streaming and robinhood/aiokafka#19 report)."""
        thread = self.app.consumer._thread  # faust-streaming's AIOKafkaConsumerThread
        try:
            await thread.seek_wait(offsets)
        except Exception as exc:  # another rebalance under way: the next one rewinds again
            log.warning("could not seek to %s: %r",
                        {f"{tp.topic}[{tp.partition}]": o for tp, o in sorted(offsets.items())}, exc)

    async def _commit_positions(self, offsets: dict[TP, int]) -> None:
        """Commit ``offsets`` for the group as they are (backwards too), on Faust's consumer thread. Faust's own
        commit only moves forward over acknowledged records and stops the worker on a failed commit; a failure
        here leaves the committed offsets as they were (the streams then check their position themselves)."""
        from aiokafka.structs import OffsetAndMetadata, TopicPartition

        thread = self.app.consumer._thread  # faust-streaming's AIOKafkaConsumerThread
        try:
            client = thread._ensure_consumer()
            await thread.call_thread(client.commit, {TopicPartition(tp.topic, tp.partition): OffsetAndMetadata(o, "")
                                                     for tp, o in offsets.items()})
        except Exception as exc:
            log.warning("could not commit the rebuilt partitions' positions %s: %r",
                        {f"{tp.topic}[{tp.partition}]": o for tp, o in sorted(offsets.items())}, exc)

    async def _ensure_partition(self, partition: int) -> None:
        if not self.processor.has_partition(partition):
            # An event of a partition the rebalance hook did not rebuild (it could not have: the hook always runs
            # first); rebuild now rather than process the event against empty state.
            await self._rebuild({partition})

    async def _rebuild(self, partitions: set[int]) -> None:
        if not partitions:
            return
        async with self._rebuild_lock:
            restored = self.processor.restore(partitions, list(self.open_samples.items()), list(self.pods.items()))
            for partition, done in sorted(restored.items()):
                self._forget_partition(partition)
                self._resume_samples_from[partition] = done.resume_samples_from
                # The pod table stores no positions: re-read the (compacted) pod events; stale ones are ignored.
                self._resume_pods_from[partition] = 0
                self._defer(partition, done.result.changes)
                log.info(
                    "partition %d rebuilt: %d open ticks, %d pods, %d nodes with progress, %d windows to re-emit",
                    partition, done.open_ticks, done.pods, done.nodes_with_progress, len(done.result.emits),
                )
        for partition, done in sorted(restored.items()):
            if done.result.emits:
                try:
                    futures = await self._send(partition, done.result.emits)
                    await asyncio.gather(*futures)
                except Exception as exc:
                    self._fail(f"re-emission of partition {partition}", exc)
                    raise
                self._defer(partition, self._settle(partition).changes)


class AttributorWorker(faust.Worker):
    """Faust's worker with the log-flood guard every gpumeter service has (``gpumeter.logflood``): Faust sets its
    own logging up, so the guard goes onto the root handlers it made."""

    def on_setup_root_logger(self, logger: logging.Logger, level: int) -> None:
        super().on_setup_root_logger(logger, level)
        guard_root_handlers()


def build_app(settings: AttributorSettings, clock: Clock, metrics: ServiceMetrics | None = None,
              on_failure: Callable[[BaseException], None] | None = None) -> faust.App:
    """The attributor's Faust app for ``settings`` (``partitions`` and ``data_dir`` must be set; ``main`` fills
    them in). ``metrics``: where to count (a fresh ``ServiceMetrics('attributor')`` when None). ``on_failure``:
    called once with the first error that is not bad input (``main`` stops the worker with it). The
    ``AttributorStream`` behind the app is ``app.attributor``."""
    stream = AttributorStream(settings, clock, metrics, on_failure)
    stream.app.attributor = stream  # type: ignore[attr-defined]
    return stream.app


__all__ = [
    "CLOCK_INTERVAL_SECONDS",
    "MAX_STORED_POD_BYTES",
    "PODS_TABLE",
    "SAMPLES_TABLE",
    "SERVICE",
    "AttributorStream",
    "AttributorWorker",
    "WindowDeliveryFailed",
    "build_app",
    "changelog_topic",
    "faust_broker_urls",
    "faust_credentials",
    "raw_message",
    "resume_position",
]
