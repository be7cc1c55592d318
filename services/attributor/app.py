"""The streaming attributor: a Faust app that feeds node samples and pod events to one engine per partition.

The agents only decode, check, call ``services.attributor.engine`` and forward; every decision about windows,
pods and shares is the engine's. ``build_app(settings, clock)`` returns the ``faust.App``; ``main`` runs it.

Topology (a node's samples and its pods' events share a partition number, so each partition is self-contained):

* ``pod-events`` agent: decode ``PodEvent``, reject impossible ones (``gpumeter.validation.check_pod_event``:
  ``OUT_OF_RANGE``) → ``engine.on_pod_event``; events that change the pod index are stored in the table ``pods``
  (key ``<node>/<uid>``, the topic's compaction key) as the engine keeps them: only the grouping labels
  (``GPUMETER_GROUPING_LABELS``) and the annotation attribution reads, at most ``MAX_STORED_POD_BYTES`` (a larger
  one is dead-lettered ``TOO_LARGE``). A tombstone removes the key.
* ``node-samples`` agent: decode ``NodeSample``, reject impossible ticks (``check_sample`` in ``engine.on_sample``:
  ``OUT_OF_RANGE``) → ``engine.on_sample``; an accepted tick stays in the engine's memory only (ticks are not
  written to a changelog: they are in the input topic already, and a rebuild reads them again from there); a late
  tick is dead-lettered (``LATE``). Each closed window goes to the node-window-shares topic as one
  ``NodeWindowShares`` record keyed by node name (``NodeWindowShares.from_rows`` of its ``GpuShare`` rows: every
  unit and subject of the node-window in one message). The agent does not wait for Kafka's acknowledgement: it goes on with
  the next message while the rows are in flight (windows of every node close in the same second; waiting ~30 ms
  per node-window made the close of a large fleet serial). Once Kafka acknowledged them, the next event of the
  partition writes the node's progress record (``<node>|progress|<cluster>``, table ``open_samples``: how far its
  windows are done, and the input position of the first tick of its oldest window not yet acknowledged); until
  then the engine holds the window in flight (its progress stays behind it). A node's first tick after it had no
  window open also writes its progress record (where to re-read from).
* A timer (every second) closes windows of nodes that went silent (``engine.on_clock``), only on partitions whose
  input is caught up, and emits them. Tables can only be written inside an agent's event, so those windows'
  progress records and deletions are written by the next event processed on that partition. A crash in between
  re-emits such a window once after recovery; downstream billing is idempotent by (window, GPU, subject).
* After every rebalance (and at start), once Faust has recovered the tables from their changelogs, the engine of
  each newly assigned partition is rebuilt from the local table contents (``engine.restore``: pods and progress
  records) before any of the partition's input is processed, and its samples are read again from
  ``resume_position``: the first tick of the oldest window any node had not seen acknowledged. Ticks of windows
  already emitted come back as redeliveries and are dropped; windows that were in flight are emitted again.
* Bad input of any kind goes through ``DeadLetterGuard`` to the dead-letters topic; the agents carry on.

Delivery: at-least-once (``processing_guarantee='at_least_once'``; Faust flushes the producer, changelogs
included, before it commits input offsets). The changelog writes of one event go to that event's partition in
order, which is what makes "progress record before deletes" hold after recovery (see ``engine``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Iterable

import faust
from faust.types import TP

from gpumeter.clock import Clock
from gpumeter.errors import ConfigError, GpumeterError, InvalidMessage
from gpumeter.kafka.deadletter import DeadLetterGuard, RawMessage
from gpumeter.logflood import guard_root_handlers
from gpumeter.metrics import ServiceMetrics
from gpumeter.settings import KafkaSettings
from gpumeter.validation import check_pod_event
from schemas.catalog import partition_for_node
from schemas.records import DeadLetter, NodeSample, NodeWindowShares, PodEvent
from schemas.typed import codec_for
from services.attributor.engine import (
    AttributionEngine,
    NodeProgress,
    WindowResult,
    is_progress_key,
    node_of_table_key,
    pod_table_key,
)
from services.attributor.settings import AttributorSettings

log = logging.getLogger(__name__)

SERVICE = "attributor"
SAMPLES_TABLE = "open_samples"
PODS_TABLE = "pods"


class WindowDeliveryFailed(GpumeterError):
    """Kafka did not acknowledge a window's share rows (after the producer's own retries)."""


def changelog_topic(app_id: str, table: str) -> str:
    """The changelog topic Faust uses for ``table`` of app ``app_id``."""
    return f"{app_id}-{table}-changelog"
CLOCK_INTERVAL_SECONDS = 1.0
MAX_STORED_POD_BYTES = 64 * 1024
"""The most the pod table stores per pod (its changelog record): a pod cut to the grouping labels takes a few
hundred bytes per container; a larger one is dead-lettered ``TOO_LARGE`` rather than crash the changelog write."""

_SAMPLE_CODEC = codec_for(NodeSample)
_POD_CODEC = codec_for(PodEvent)
_WINDOW_SHARES_CODEC = codec_for(NodeWindowShares)
_DEAD_LETTER_CODEC = codec_for(DeadLetter)


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
    """A Faust message as the library-free ``RawMessage`` the dead-letter guard takes."""
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
    """The Faust app and the per-partition engines it drives. Build with ``build_app``."""

    def __init__(self, settings: AttributorSettings, clock: Clock, metrics: ServiceMetrics | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        if settings.partitions is None:
            raise ConfigError("the attributor needs the input topics' partition count (settings.partitions)")
        if settings.data_dir is None:
            raise ConfigError("the attributor needs a data folder (settings.data_dir)")
        self.settings = settings
        self.clock = clock
        self.metrics = metrics or ServiceMetrics(SERVICE)
        self.partitions = settings.partitions
        self.engine_config = settings.engine_config()
        catalog = settings.kafka.catalog
        self.samples_topic_name = catalog.node_samples
        self.pods_topic_name = catalog.pod_events

        self.engines: dict[int, AttributionEngine] = {}
        self._assigned: set[int] = set()
        self._processed_offset: dict[int, int] = {}  # samples partition -> last offset processed
        self._processed_pod_offset: dict[int, int] = {}  # pod-events partition -> last offset processed
        # partition -> one past its newest progress record after a rebuild; checked once, on its first record
        self._resume_samples_from: dict[int, int] = {}
        self._resume_pods_from: dict[int, int] = {}
        self._unreadable_keys: dict[int, list[tuple[str, str]]] = {}  # partition -> (table name, key)
        # partition -> windows sent and not yet recorded as emitted, each with its rows' delivery futures
        self._in_flight: dict[int, list[tuple[tuple[WindowResult, ...], list[asyncio.Future]]]] = {}
        self._ready = False
        self._rebuild_lock = asyncio.Lock()
        self._on_failure = on_failure
        self.failure: BaseException | None = None

        self.app = faust.App(
            settings.app_id,
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
            topic_partitions=self.partitions,
            topic_replication_factor=settings.topic_replication_factor,
            topic_disable_leader=True,
            web_enabled=False,
        )
        app = self.app
        raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
        self.samples_topic = app.topic(self.samples_topic_name, partitions=self.partitions, **raw)
        self.pods_topic = app.topic(self.pods_topic_name, partitions=self.partitions, **raw)
        self.shares_topic = app.topic(catalog.node_window_shares, **raw)
        self.dead_letters_topic = app.topic(catalog.dead_letters, **raw)
        self.open_samples = app.Table(SAMPLES_TABLE, key_type=str, value_type=bytes, partitions=self.partitions,
                                      help="Each node's progress record (raw ticks of open windows only in tables written by older versions).")
        self.pods = app.Table(PODS_TABLE, key_type=str, value_type=bytes, partitions=self.partitions,
                              help="Raw latest PodEvent per pod of the partition's nodes.")
        self.guard = DeadLetterGuard(SERVICE, catalog.dead_letters, self._publish_dead_letter, clock, self.metrics,
                                     max_request_size_bytes=settings.kafka.max_request_size_bytes)

        app.agent(self.samples_topic, name=f"{SERVICE}.node-samples")(self._samples_agent)
        app.agent(self.pods_topic, name=f"{SERVICE}.pod-events")(self._pods_agent)
        app.timer(CLOCK_INTERVAL_SECONDS, name=f"{SERVICE}.clock")(self._clock_timer)
        app.on_partitions_revoked.connect(self._on_partitions_revoked)
        app.on_partitions_assigned.connect(self._on_partitions_assigned)
        app.on_rebalance_complete.connect(self._on_rebalance_complete)

    # -- agents --------------------------------------------------------------------------------------------------

    async def _samples_agent(self, stream: Any) -> None:
        async for event in stream.events():
            try:
                await self.process_sample(raw_message(event.message))
            except Exception as exc:
                self._fail("node-samples agent", exc)
                raise

    async def process_sample(self, raw: RawMessage) -> None:
        """One node-samples message, whole: decode, check, engine, emission, table writes (inside its event).
        Bad input is dead-lettered here; anything else raised is not bad input (the agent stops the worker)."""
        await self._engine_for(raw.partition)
        await self._check_resume(self.samples_topic_name, self._resume_samples_from, raw, self._sample_body)
        await self._sample_body(raw)

    async def _sample_body(self, raw: RawMessage) -> None:
        engine = self.engines[raw.partition]
        await self.guard.handle(raw, lambda m: self._on_sample(engine, m))
        self._settle(raw.partition, engine)
        self._apply_table_changes(raw.partition, engine)
        self._processed_offset[raw.partition] = raw.offset

    async def _check_resume(self, topic: str, resume_from: dict[int, int], raw: RawMessage,
                            process: Callable[[RawMessage], Awaitable[None]]) -> None:
        """Before the first record of a partition after a rebuild: process what lies between its resume position
        (``resume_position``) and that record, read directly from Kafka.

        ``_rewind_streams`` seeks and commits every rebuilt partition to its resume position, but Faust does not
        always honour it: after a crash it can resume at a committed offset beyond what its changelog made durable
        (seen in CI, when open ticks were still stored: 16 of the 36 ticks below the resume point were missing,
        and a window was lost). The records in between are therefore read again here, inside the current event so
        that their table writes go to this partition's changelog, and processed in order; ticks of windows already
        emitted come back as redeliveries, which the engine drops."""
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
        """Apply every pod event Kafka holds for the rebuilt ``partitions`` to their engines before streams resume.

        Samples and pod events are two topics read concurrently: after a restart or a rebalance the samples agent
        can race ahead of the pod events its ticks need, and windows would close with their processes attributed
        to no pod (seen in the stream-equals-replay test). Reading the partition's pod events (a compacted topic:
        one record per live pod) first closes that race; the pods agent reads them again afterwards, and the engine
        ignores what it already has. Bad records are left to the agent, which dead-letters them."""
        await asyncio.gather(*(self._preload_partition(p) for p in sorted(partitions)))

    async def _preload_partition(self, partition: int) -> None:
        engine = self.engines.get(partition)
        if engine is None:
            return
        applied = 0
        async for record in self._read_range(self.pods_topic_name, partition, 0, None):
            if record.value is None:
                continue
            try:
                event = _POD_CODEC.decode(record.value)
                check_pod_event(event, self.clock.now_ms(), self.settings.max_clock_skew_seconds * 1000)
            except InvalidMessage:
                continue
            if partition_for_node(event.node_name, self.partitions) == partition and engine.on_pod_event(event):
                applied += 1
        log.info("partition %d: %d pod events applied before its streams resume", partition, applied)

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

    async def _on_sample(self, engine: AttributionEngine, raw: RawMessage) -> None:
        sample = _SAMPLE_CODEC.decode(raw.value or b"")
        self._check_partition(raw, sample.node_name)
        output = engine.on_sample(sample, self.clock.now_ms(), raw.offset)
        if output.late:
            await self.guard.reject(raw, output.late[0].error())
            return
        if output.windows:
            await self._send_windows(raw.partition, output.windows)

    async def _pods_agent(self, stream: Any) -> None:
        async for event in stream.events():
            try:
                await self.process_pod_event(raw_message(event.message))
            except Exception as exc:
                self._fail("pod-events agent", exc)
                raise

    async def process_pod_event(self, raw: RawMessage) -> None:
        """One pod-events message, whole (inside its event); a tombstone removes the pod's table entry."""
        await self._engine_for(raw.partition)
        await self._check_resume(self.pods_topic_name, self._resume_pods_from, raw, self._pod_event_body)
        await self._pod_event_body(raw)

    async def _pod_event_body(self, raw: RawMessage) -> None:
        engine = self.engines[raw.partition]
        if raw.value is None and raw.key is not None:
            # A tombstone on the compacted topic: the pod is gone for good; the index prunes it by itself.
            self.metrics.get("gpumeter_messages_consumed_total").labels(SERVICE, raw.topic).inc()
            key = raw.key.decode("utf-8", errors="replace")
            if key in self.pods:
                del self.pods[key]
        else:
            await self.guard.handle(raw, lambda m: self._on_pod_event(engine, m))
        self._settle(raw.partition, engine)
        self._apply_table_changes(raw.partition, engine)
        self._processed_pod_offset[raw.partition] = raw.offset

    async def _on_pod_event(self, engine: AttributionEngine, raw: RawMessage) -> None:
        event = _POD_CODEC.decode(raw.value or b"")
        check_pod_event(event, self.clock.now_ms(), self.settings.max_clock_skew_seconds * 1000)
        key = pod_table_key(event)
        if raw.key is not None and raw.key != key.encode("utf-8"):
            raise InvalidMessage(
                f"pod event of {event.namespace}/{event.name} keyed {raw.key!r}; the topic's key is {key!r}",
                reason_code="WRONG_KEY",
            )
        self._check_partition(raw, event.node_name)
        # What is stored per pod is what the engine keeps of it (its grouping labels, the annotation attribution
        # reads), bounded: whatever a producer puts in a pod event, its changelog record stays small.
        record = engine.pod_record(event)
        stored = raw.value if record is event else _POD_CODEC.encode(record)
        if len(stored) > MAX_STORED_POD_BYTES:
            raise InvalidMessage(
                f"pod event of {event.namespace}/{event.name} is {len(stored)} bytes once cut to what attribution "
                f"keeps ({len(event.containers)} containers); a pod's stored state is at most "
                f"{MAX_STORED_POD_BYTES} bytes", reason_code="TOO_LARGE")
        if engine.on_pod_event(record):
            self.pods[key] = stored

    def _check_partition(self, raw: RawMessage, node_name: str) -> None:
        # Samples and pod events of a node must share a partition, or its windows are attributed without its pods.
        expected = partition_for_node(node_name, self.partitions)
        if raw.partition != expected:
            raise InvalidMessage(
                f"record of node {node_name} on partition {raw.partition}; the catalog puts it on {expected} "
                f"(Kafka's murmur2 of the node name over {self.partitions} partitions)",
                reason_code="WRONG_PARTITION",
            )

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
                              any(not self._caught_up(p) for p in sorted(self.engines)))
        now_ms = self.clock.now_ms()
        try:
            for partition, engine in sorted(self.engines.items()):
                if not self._caught_up(partition):
                    continue
                output = engine.on_clock(now_ms)
                if output.windows:
                    await self._send_windows(partition, output.windows)
        except Exception as exc:
            self._fail("clock timer", exc)
            raise

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

    # -- emission --------------------------------------------------------------------------------------------------

    async def _send_windows(self, partition: int, windows: tuple[WindowResult, ...]) -> None:
        """Send ``windows``' rows without waiting for Kafka; ``_settle`` records them once acknowledged."""
        futures = await self._send_rows(windows)
        self._in_flight.setdefault(partition, []).append((windows, futures))

    def _settle(self, partition: int, engine: AttributionEngine) -> None:
        """Record as emitted every window of ``partition`` whose rows Kafka acknowledged (the engine then queues
        their progress records and tick deletions for this event's table writes). A failed delivery raises
        ``WindowDeliveryFailed``: not bad input, so the worker stops, and a restart re-emits the window from the
        tables (its ticks are still there)."""
        pending = self._in_flight.get(partition)
        if not pending:
            return
        waiting = []
        for windows, futures in pending:
            if not all(f.done() for f in futures):
                waiting.append((windows, futures))
                continue
            for future in futures:
                error = future.exception() if not future.cancelled() else asyncio.CancelledError()
                if error is not None:
                    raise WindowDeliveryFailed(
                        f"the rows of node {windows[0].node_name}'s window {windows[0].window_start_unix_ms} were "
                        f"not delivered: {error!r}") from error
            engine.record_emitted(windows)
        self._in_flight[partition] = waiting

    async def _emit(self, windows: Iterable[WindowResult]) -> None:
        """Send each window's rows and wait until Kafka acknowledged all of them (the rebuild's re-emission)."""
        futures = await self._send_rows(windows)
        if futures:
            await asyncio.gather(*futures)

    async def _send_rows(self, windows: Iterable[WindowResult]) -> list[asyncio.Future]:
        """Enqueue each window as one ``NodeWindowShares`` keyed by node name (in order); returns their delivery
        futures. The window metrics move when its record is acknowledged; a window without rows sends nothing."""
        futures: list[asyncio.Future] = []
        for window in windows:
            if not window.shares:
                self._acknowledged(window, None)
                continue
            key = window.node_name.encode("utf-8")
            value = _WINDOW_SHARES_CODEC.encode(NodeWindowShares.from_rows(window.shares))
            sent = await self.shares_topic.send(key=key, value=value)
            futures.append(sent)
            sent.add_done_callback(lambda future, window=window: self._acknowledged(window, future))
        return futures

    def _acknowledged(self, window: WindowResult, future: asyncio.Future | None) -> None:
        if future is not None and (future.cancelled() or future.exception() is not None):
            return  # ``_settle`` (or ``_emit``) raises it
        now_ms = self.clock.now_ms()
        closes_at_ms = window.window_end_unix_ms + self.settings.grace_seconds * 1000
        self.metrics.get("gpumeter_attributor_windows_closed_total").inc()
        self.metrics.get("gpumeter_attributor_shares_emitted_total").inc(len(window.shares))
        self.metrics.get("gpumeter_attributor_window_lag_seconds").set(max(now_ms - closes_at_ms, 0) / 1000)
        log.info("emitted %d shares of node %s window %d (%d ticks)", len(window.shares), window.node_name,
                 window.window_start_unix_ms, len(window.sample_keys))

    async def _publish_dead_letter(self, topic: str, key: bytes, record: DeadLetter) -> None:
        await self.dead_letters_topic.send(key=key, value=_DEAD_LETTER_CODEC.encode(record))

    def _apply_table_changes(self, partition: int, engine: AttributionEngine) -> None:
        """Write the engine's queued table changes; only inside an event of ``partition`` (Faust writes a table's
        changelog to the current event's partition)."""
        changes = engine.take_table_changes()
        for progress in changes.progress:
            self.open_samples[progress.table_key] = progress.encode()
        for key in changes.deleted_sample_keys:
            if key in self.open_samples:
                del self.open_samples[key]
        for key in changes.deleted_pod_keys:
            if key in self.pods:
                del self.pods[key]
        for table_name, key in self._unreadable_keys.pop(partition, ()):
            table = self.open_samples if table_name == SAMPLES_TABLE else self.pods
            if key in table:
                del table[key]

    # -- rebalance and restore -------------------------------------------------------------------------------------

    async def _on_partitions_revoked(self, sender: Any, revoked: Any, **_: Any) -> None:
        self._ready = False

    async def _on_partitions_assigned(self, sender: Any, assigned: Any, **_: Any) -> None:
        self._ready = False
        self._assigned = {tp.partition for tp in assigned if tp.topic == self.samples_topic_name}

    async def _on_rebalance_complete(self, sender: Any, **_: Any) -> None:
        # Tables are recovered; streams have not resumed yet. Partitions kept across the rebalance keep their
        # engine (it holds table changes not yet written); new ones are rebuilt from the tables.
        for partition in list(self.engines):
            if partition not in self._assigned:
                del self.engines[partition]
                self._processed_offset.pop(partition, None)
                self._processed_pod_offset.pop(partition, None)
                self._unreadable_keys.pop(partition, None)
                self._in_flight.pop(partition, None)  # the new owner re-emits them from the tables
        rebuilt = self._assigned - set(self.engines)
        await self._rebuild(rebuilt)
        await self._preload_pod_events(rebuilt)
        await self._rewind_streams(rebuilt)
        self._ready = True

    async def _rewind_streams(self, rebuilt: set[int]) -> None:
        """Put every assigned input partition where this worker's processing must go on, before streams resume.

        * a partition it kept: one past the last offset it processed there (its start if it processed none);
        * a partition rebuilt from the tables: ``_resume_samples_from`` (``resume_position``: the first tick of the
          oldest window not yet acknowledged; pod events from the start). The group's committed offsets are
          moved there too, because Faust seeks every partition to its committed offset right after this hook.

        Why: Faust drops records it had already fetched when a rebalance interrupts a batch (and any queued from
        the previous generation), relying on that seek to committed offsets to fetch them again. For a partition
        without a committed offset (a new group, or a rebalance within the commit interval of its first records)
        the seek does nothing, and the dropped records would never be processed: their windows would never close.
        Where the group has committed, on a partition kept, its offset wins, and the engine takes the records read
        again as duplicates. On a partition rebuilt, seeking there from inside a stream would race with the
        records Faust still delivers from before the seek."""
        commits: dict[TP, int] = {}
        seeks: dict[TP, int] = {}
        for partition in sorted(self._assigned):
            if partition in rebuilt:
                samples_at = self._resume_samples_from.get(partition, 0)
                pods_at = self._resume_pods_from.get(partition, 0)
                commits[TP(self.samples_topic_name, partition)] = samples_at
                commits[TP(self.pods_topic_name, partition)] = pods_at
            else:
                processed, processed_pods = self._processed_offset.get(partition), self._processed_pod_offset.get(
                    partition)
                samples_at = 0 if processed is None else processed + 1
                pods_at = 0 if processed_pods is None else processed_pods + 1
            seeks[TP(self.samples_topic_name, partition)] = samples_at
            seeks[TP(self.pods_topic_name, partition)] = pods_at
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

    async def _engine_for(self, partition: int) -> AttributionEngine:
        engine = self.engines.get(partition)
        if engine is None:
            # An event of a partition the rebalance hook did not rebuild (it could not have: the hook always runs
            # first); rebuild now rather than process the event against empty state.
            await self._rebuild({partition})
            engine = self.engines[partition]
        return engine

    async def _rebuild(self, partitions: set[int]) -> None:
        if not partitions:
            return
        async with self._rebuild_lock:
            partitions = {p for p in partitions if p not in self.engines}
            if not partitions:
                return
            samples: dict[int, list[NodeSample]] = {p: [] for p in partitions}
            progress: dict[int, list[NodeProgress]] = {p: [] for p in partitions}
            pod_events: dict[int, list[PodEvent]] = {p: [] for p in partitions}
            for key, value in list(self.open_samples.items()):
                partition = partition_for_node(node_of_table_key(key), self.partitions)
                if partition not in partitions:
                    continue
                try:
                    if is_progress_key(key):
                        progress[partition].append(NodeProgress.decode(value))
                    else:
                        samples[partition].append(_SAMPLE_CODEC.decode(value))
                except InvalidMessage as exc:
                    log.warning("dropping unreadable %s entry %r: %s", SAMPLES_TABLE, key, exc)
                    self._unreadable_keys.setdefault(partition, []).append((SAMPLES_TABLE, key))
            for key, value in list(self.pods.items()):
                partition = partition_for_node(key.split("/", 1)[0], self.partitions)
                if partition not in partitions:
                    continue
                try:
                    pod_events[partition].append(_POD_CODEC.decode(value))
                except InvalidMessage as exc:
                    log.warning("dropping unreadable %s entry %r: %s", PODS_TABLE, key, exc)
                    self._unreadable_keys.setdefault(partition, []).append((PODS_TABLE, key))
            restored: dict[int, tuple[AttributionEngine, tuple[WindowResult, ...]]] = {}
            for partition in sorted(partitions):
                engine = AttributionEngine(self.engine_config)
                output = engine.restore(samples[partition], pod_events[partition], progress[partition])
                self.engines[partition] = engine
                self._processed_offset.pop(partition, None)
                self._processed_pod_offset.pop(partition, None)
                self._resume_samples_from[partition] = resume_position(progress[partition])
                # The pod table stores no positions: re-read the (compacted) pod events; stale ones are ignored.
                self._resume_pods_from[partition] = 0
                restored[partition] = (engine, output.windows)
                log.info(
                    "partition %d rebuilt: %d open ticks, %d pods, %d nodes with progress, %d windows to re-emit",
                    partition, len(samples[partition]), len(pod_events[partition]), len(progress[partition]),
                    len(output.windows),
                )
        for partition, (engine, windows) in sorted(restored.items()):
            if windows:
                try:
                    await self._emit(windows)
                except Exception as exc:
                    self._fail(f"re-emission of partition {partition}", exc)
                    raise
                engine.record_emitted(windows)


def resume_position(progress: Iterable[NodeProgress]) -> int:
    """Where a rebuilt partition's samples are read again from: the first tick of the oldest window any node had
    not yet seen acknowledged (``reread_from_position``), else one past the newest processed position, else the
    start. Open windows are not stored, so their ticks come back from the input topic; ticks of windows already
    emitted come back too and are dropped as redeliveries (at or below their node's ``position``).

    Why the smallest re-read point covers a node whose own progress record was lost: changelog writes of a
    partition are ordered, so the records that survived were written before it, and each one's re-read point is at
    or below the position processed then, which is below that node's first unrecorded tick."""
    progress = list(progress)
    rereads = [p.reread_from_position for p in progress if p.reread_from_position is not None]
    if rereads:
        return min(rereads)
    positions = [p.position for p in progress if p.position is not None]
    return max(positions) + 1 if positions else 0


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
