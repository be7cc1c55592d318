"""The attributor's logic on the one processing contract (``gpumeter.stream.contract``): one engine per partition.

``AttributorProcessor(config, partitions)`` is what the Faust app (``services/attributor/app.py``) runs per message
through ``MessageRunner``, and what a ``MemoryDriver`` runs offline. No Kafka, no Faust, no asyncio here.

Input roles (``input_topics``): ``samples`` (``NodeSample``; the range check is the engine's ``check_sample``, after
the partition check) and ``pod_events`` (``PodEvent``, checked by ``check_pod_event`` with the config's clock skew
once its node's clock offset is taken off it; a message without value is the compacted topic's tombstone).

Time: each message's ``Event.timestamp_ms`` is the broker's append time (the input topics are
``LogAppendTime``), the clock gpumeter trusts; a node whose own clock disagrees with it has its ticks' and pod
events' times corrected by the engine (``gpumeter.clockskew``, ``engine.on_sample``), so it is billed in the
windows it was really sampled in; ``clock_offsets()`` reports each node's offset.

Output role: ``window_shares`` (``output_topics``), one ``NodeWindowShares`` per closed window, keyed by node name;
dead letters are the runner's.

Per message, after the runner decoded and checked it (a raised ``InvalidMessage`` dead-letters the message, with
nothing done; a ``Result.rejected`` one dead-letters it with the result's changes kept):

* a sample: ``WRONG_PARTITION`` unless it is on its node's partition (``schemas.catalog.partition_for_node``:
  samples and pod events of a node must share one, or its windows are attributed without its pods); then the
  partition's engine (``engine.on_sample`` at the event's ``received_at_unix_ms`` with the message offset as
  position and its timestamp as append time: ``OUT_OF_RANGE`` raised; a tick of a closed window is rejected
  ``LATE``, or ``CLOCK_SKEW`` when only its node's clock moving put it there; windows it closed are emitted);
  a tick of a second collector of one node (``EngineOutput.second_collector``) is merged, counted
  (``second_collector_ticks``) and logged (the first per node, then every ``SECOND_COLLECTOR_LOG_EVERY``th);
* a pod event: ``WRONG_KEY`` unless keyed ``<node>/<uid>``, ``WRONG_PARTITION``, ``TOO_LARGE`` when what the engine
  keeps of it (``engine.pod_record``) encodes to more than ``max_stored_pod_bytes``; an event that changes the pod
  index is put in the pod table; a tombstone deletes its key from the pod table (a keyless one is ``EMPTY``).

``Result.changes`` are ``TableWrite``s, in the order they must be applied: the engine's ``take_table_changes``
(progress records, then deletes) after the event's own pod put. A Faust table can only be written inside an event
of its partition, so a driver applies the changes of ``on_clock``, ``acknowledge`` and ``restore`` (which come
outside such an event under Faust) before those of the partition's next event.

Acknowledgement is the driver's: a window's emit is in flight until the driver calls ``acknowledge(partition,
records)`` with its ``NodeWindowShares`` once Kafka acknowledged it (``engine.record_emitted``: the node's progress
record moves past it); a driver whose produce is durable at once (the in-memory broker) calls
``acknowledge_all()`` right after producing. A window without rows emits nothing and is recorded at once.

The clock: ``on_clock_partition(partition, now_ms, caught_up)`` closes the windows of the partition's silent nodes
(``engine.on_clock``), only while that partition's input is caught up; ``on_clock`` does it for every partition
with one ``caught_up``. Restore after a rebalance: ``restore(partitions, open_samples, pods)`` rebuilds each
partition's engine from the two tables' entries and says where its samples are read again from
(``resume_position``); ``preload_pod_event`` applies a pod event read directly from Kafka before streams resume.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection, Iterable, Sequence

from gpumeter.errors import ConfigError, InvalidMessage
from gpumeter.stream.contract import (
    DEAD_LETTERS,
    NOTHING,
    Emit,
    Event,
    Input,
    Position,
    ProcessorDefaults,
    Result,
    TopicPartition,
)
from gpumeter.validation import check_pod_event
from schemas.catalog import TopicCatalog, partition_for_node
from schemas.records import NodeSample, NodeWindowShares, PodEvent
from schemas.typed import codec_for
from services.attributor.engine import (
    AttributionEngine,
    EngineConfig,
    NodeProgress,
    WindowResult,
    is_progress_key,
    node_of_table_key,
    pod_event_lead,
    pod_table_key,
    shift_pod_event,
)

log = logging.getLogger(__name__)

SERVICE = "attributor"
SAMPLES = "samples"
POD_EVENTS = "pod_events"
WINDOW_SHARES = "window_shares"

SECOND_COLLECTOR_LOG_EVERY = 1000
"""Ticks of a second collector of one node logged: the first, then one in this many (a steady state, not news)."""

SAMPLES_TABLE = "open_samples"
PODS_TABLE = "pods"
MAX_STORED_POD_BYTES = 64 * 1024
"""The most the pod table stores per pod (its changelog record): a pod cut to the grouping labels takes a few
hundred bytes per container; a larger one is dead-lettered ``TOO_LARGE`` rather than crash the changelog write."""

_SAMPLE_CODEC = codec_for(NodeSample)
_POD_CODEC = codec_for(PodEvent)

WindowKey = tuple[str, str, int]  # (cluster, node, window start)


def input_topics(catalog: TopicCatalog) -> dict[str, str]:
    """The processor's input roles -> topic names of ``catalog``."""
    return {SAMPLES: catalog.node_samples, POD_EVENTS: catalog.pod_events}


def output_topics(catalog: TopicCatalog) -> dict[str, str]:
    """The emit roles (the processor's and the runner's dead letters) -> topic names of ``catalog``."""
    return {WINDOW_SHARES: catalog.node_window_shares, DEAD_LETTERS: catalog.dead_letters}


@dataclass(frozen=True, slots=True)
class TableWrite:
    """One write to a table of ``partition``: put ``value`` at ``key`` of ``table`` (``SAMPLES_TABLE`` or
    ``PODS_TABLE``), or delete ``key`` when ``value`` is None (a key not there is no error)."""

    partition: int
    table: str
    key: str
    value: bytes | None


@dataclass(frozen=True, slots=True)
class Restored:
    """One partition rebuilt by ``restore``. ``result``: the windows to emit again (in flight before, or stored
    whole without progress by an older version; acknowledge them like any other) and the deletes of stale or
    unreadable table entries. ``resume_samples_from``: the samples offset to read the partition again from."""

    partition: int
    result: Result
    resume_samples_from: int
    open_ticks: int
    pods: int
    nodes_with_progress: int


def window_key(window: WindowResult | NodeWindowShares) -> WindowKey:
    return (window.cluster, window.node_name, window.window_start_unix_ms)


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


class AttributorProcessor(ProcessorDefaults):
    """See the module docstring. ``partitions``: the input topics' partition count (what ``WRONG_PARTITION`` is
    judged against). Mutable (its engines); one caller at a time."""

    service = SERVICE

    def __init__(self, config: EngineConfig, partitions: int, *,
                 max_stored_pod_bytes: int = MAX_STORED_POD_BYTES) -> None:
        if not isinstance(partitions, int) or partitions < 1:
            raise ConfigError(f"the attributor needs a positive partition count, got {partitions!r}")
        self.config = config
        self.partition_count = partitions
        self.max_stored_pod_bytes = max_stored_pod_bytes
        self._skew_ms = config.max_clock_skew_seconds * 1000
        # In the order of precedence at one instant (gpumeter.stream.contract.Processor.inputs): a tick's pods
        # must be known when the tick's window closes at the same instant. Pod events are range-checked in
        # ``handle``, once their node's clock offset is taken off them.
        self.inputs: Sequence[Input] = (
            Input(POD_EVENTS, PodEvent, tombstones=True),
            Input(SAMPLES, NodeSample),
        )
        self._clock_ms: int | None = None
        self.second_collector_ticks = 0
        self._second_collector_by_node: dict[tuple[str, str], int] = {}
        self._engines: dict[int, AttributionEngine] = {}
        # partition -> windows emitted and not yet acknowledged, in emission order
        self._unacknowledged: dict[int, dict[WindowKey, WindowResult]] = {}

    # -- the contract ----------------------------------------------------------------------------------------------

    def handle(self, event: Event, position: Position) -> Result:
        """One sample or pod event of ``position.partition`` (see the module docstring)."""
        if event.input == SAMPLES:
            return self._on_sample(event.record, event.received_at_unix_ms, position, event.timestamp_ms)
        if event.input == POD_EVENTS:
            return self._on_pod_event(event.record, event.key, position.partition, event.received_at_unix_ms,
                                      event.timestamp_ms)
        raise ValueError(f"{SERVICE} has no input {event.input!r}")

    def on_clock(self, now_ms: int, caught_up: bool = True) -> Result:
        """``on_clock_partition`` for every partition with an engine, in partition order. The input is then one
        whole, caught up or not (the in-memory driver): an engine created later by a message starts on the
        latest caught-up clock, as the engines that existed did (so a node's first tick is judged late or not
        alike on every partition)."""
        if caught_up:
            self._clock_ms = now_ms
        result = NOTHING
        for partition in sorted(self._engines):
            result = result + self.on_clock_partition(partition, now_ms, caught_up)
        return result

    def on_clock_partition(self, partition: int, now_ms: int, caught_up: bool = True) -> Result:
        """Close the windows of ``partition``'s silent nodes at ``now_ms`` (nothing unless ``caught_up``: during a
        backlog the backlog's own event time closes windows, and a clock ahead of it would make it late)."""
        engine = self._engines.get(partition)
        if engine is None or not caught_up:
            return NOTHING
        return self._closed(partition, engine, engine.on_clock(now_ms).windows)

    # -- acknowledgement -------------------------------------------------------------------------------------------

    def acknowledge(self, partition: int, records: Iterable[NodeWindowShares]) -> Result:
        """Kafka acknowledged these emitted ``window_shares`` records of ``partition``: record their windows as
        emitted; the result holds the table writes that follows (progress records, tick deletes). Records of
        windows not in flight (acknowledged already, or of a partition dropped since) are ignored."""
        pending = self._unacknowledged.get(partition)
        engine = self._engines.get(partition)
        if not pending or engine is None:
            return NOTHING
        windows = [w for w in (pending.pop(window_key(r), None) for r in records) if w is not None]
        if not windows:
            return NOTHING
        engine.record_emitted(windows)
        return Result(changes=self._table_writes(partition, engine))

    def acknowledge_all(self) -> Result:
        """Every emitted window acknowledged (a driver whose produce is durable at once), partition by partition."""
        result = NOTHING
        for partition in sorted(self._unacknowledged):
            pending = self._unacknowledged[partition]
            windows = list(pending.values())
            pending.clear()
            engine = self._engines.get(partition)
            if windows and engine is not None:
                engine.record_emitted(windows)
                result = result + Result(changes=self._table_writes(partition, engine))
        return result

    def in_flight(self, partition: int) -> tuple[WindowKey, ...]:
        """The windows of ``partition`` emitted and not yet acknowledged, in emission order."""
        return tuple(self._unacknowledged.get(partition, ()))

    # -- partitions: rebuild, preload, drop ------------------------------------------------------------------------

    def has_partition(self, partition: int) -> bool:
        return partition in self._engines

    def partitions(self) -> tuple[int, ...]:
        return tuple(sorted(self._engines))

    def clock_offsets(self) -> dict[tuple[str, str], int]:
        """(cluster, node) -> the node's clock offset in effect, ms, over every partition (0: its clock agrees
        with the broker's within the threshold; ``gpumeter.clockskew``)."""
        offsets: dict[tuple[str, str], int] = {}
        for partition in sorted(self._engines):
            offsets.update(self._engines[partition].clock_offsets())
        return offsets

    def second_collector_counts(self) -> dict[tuple[str, str], int]:
        """(cluster, node) -> ticks of a second collector of the node merged so far
        (``EngineOutput.second_collector``)."""
        return dict(self._second_collector_by_node)

    def engine(self, partition: int) -> AttributionEngine | None:
        """The partition's engine, for inspection (None before its first input or restore)."""
        return self._engines.get(partition)

    def drop_partition(self, partition: int) -> None:
        """Forget ``partition`` (revoked): its engine and its windows in flight (the new owner emits them again)."""
        self._engines.pop(partition, None)
        self._unacknowledged.pop(partition, None)

    def on_revoked(self, partitions: Collection[TopicPartition]) -> Result:
        """The contract's revocation: ``drop_partition`` for the partition number of each of ``partitions`` (a
        partition number holds a node's samples and its pod events alike). Nothing to flush: what is durable of
        a partition is in its tables already, and its windows in flight are emitted again by the new owner."""
        for partition in sorted({partition for _, partition in partitions}):
            self.drop_partition(partition)
        return NOTHING

    def restore(self, partitions: Iterable[int], open_samples: Iterable[tuple[str, bytes]],
                pods: Iterable[tuple[str, bytes]]) -> dict[int, Restored]:
        """Rebuild the engine of each of ``partitions`` that has none from the tables' entries (``open_samples``:
        progress records, and ticks stored by older versions; ``pods``: stored pod events), each entry belonging to
        the partition of its node. Entries that do not decode are skipped and deleted (``Restored.result``)."""
        wanted = {p for p in partitions if p not in self._engines}
        if not wanted:
            return {}
        samples: dict[int, list[NodeSample]] = {p: [] for p in wanted}
        progress: dict[int, list[NodeProgress]] = {p: [] for p in wanted}
        pod_events: dict[int, list[PodEvent]] = {p: [] for p in wanted}
        unreadable: dict[int, list[TableWrite]] = {p: [] for p in wanted}
        for key, value in open_samples:
            partition = partition_for_node(node_of_table_key(key), self.partition_count)
            if partition not in wanted:
                continue
            try:
                if is_progress_key(key):
                    progress[partition].append(NodeProgress.decode(value))
                else:
                    samples[partition].append(_SAMPLE_CODEC.decode(value))
            except InvalidMessage as exc:
                log.warning("dropping unreadable %s entry %r: %s", SAMPLES_TABLE, key, exc)
                unreadable[partition].append(TableWrite(partition, SAMPLES_TABLE, key, None))
        for key, value in pods:
            partition = partition_for_node(key.split("/", 1)[0], self.partition_count)
            if partition not in wanted:
                continue
            try:
                pod_events[partition].append(_POD_CODEC.decode(value))
            except InvalidMessage as exc:
                log.warning("dropping unreadable %s entry %r: %s", PODS_TABLE, key, exc)
                unreadable[partition].append(TableWrite(partition, PODS_TABLE, key, None))
        restored: dict[int, Restored] = {}
        for partition in sorted(wanted):
            engine = AttributionEngine(self.config)
            output = engine.restore(samples[partition], pod_events[partition], progress[partition])
            self._engines[partition] = engine
            self._unacknowledged[partition] = {}
            result = self._closed(partition, engine, output.windows)
            result = result + Result(changes=tuple(unreadable[partition]))
            restored[partition] = Restored(partition, result, resume_position(progress[partition]),
                                           len(samples[partition]), len(pod_events[partition]),
                                           len(progress[partition]))
        return restored

    def preload_pod_event(self, partition: int, event: PodEvent, now_ms: int,
                          appended_at_ms: int | None = None) -> tuple[bool, Result]:
        """Apply a (decoded) pod event of ``partition`` read before its streams resume, corrected and checked as
        ``handle`` does (raises ``InvalidMessage``: leave it to the pods agent, which dead-letters it): whether it
        changed the partition's pods, and the table writes that follow (pods the index pruned). Nothing for an
        event of another partition's node or of a partition without an engine."""
        engine = self._engines.get(partition)
        if engine is None or partition_for_node(event.node_name, self.partition_count) != partition:
            return False, NOTHING
        event = engine.corrected_pod_event(event, appended_at_ms)
        check_pod_event(event, now_ms, self._skew_ms)
        applied = engine.on_pod_event(engine.pod_record(event))
        return applied, Result(changes=self._table_writes(partition, engine))

    # -- per message -----------------------------------------------------------------------------------------------

    def _on_sample(self, sample: NodeSample, now_ms: int, position: Position,
                   appended_at_ms: int | None = None) -> Result:
        partition = position.partition
        self._check_partition(partition, sample.node_name)
        engine = self._engine(partition)
        output = engine.on_sample(sample, now_ms, position.offset, appended_at_ms)
        if output.second_collector:
            self._count_second_collector(sample)
        result = self._closed(partition, engine, output.windows)
        rejection = output.rejection
        if rejection is not None:
            result = Result(result.emits, result.changes, (rejection,))
        return result

    def _count_second_collector(self, sample: NodeSample) -> None:
        self.second_collector_ticks += 1
        key = (sample.cluster, sample.node_name)
        seen = self._second_collector_by_node.get(key, 0) + 1
        self._second_collector_by_node[key] = seen
        if seen % SECOND_COLLECTOR_LOG_EVERY == 1:
            log.warning("node %s: ticks of two collectors (one started at %d still writing after a newer one "
                        "started); merged into its windows (%d such ticks so far)", sample.node_name,
                        sample.collector_started_at_unix_ms, seen)

    def _on_pod_event(self, event: PodEvent | None, key: bytes | None, partition: int, now_ms: int = 0,
                      appended_at_ms: int | None = None) -> Result:
        if event is None:
            if key is None:
                raise InvalidMessage("a tombstone without key deletes no pod", reason_code="EMPTY")
            # The pod is gone for good; the index prunes it by itself.
            return Result(changes=(TableWrite(partition, PODS_TABLE, key.decode("utf-8", errors="replace"), None),))
        engine = self._engines.get(partition)
        if engine is not None:
            event = engine.corrected_pod_event(event, appended_at_ms)
        else:
            event = shift_pod_event(event, pod_event_lead(event, appended_at_ms,
                                                          self.config.clock_skew_threshold_seconds * 1000))
        check_pod_event(event, now_ms, self._skew_ms)
        table_key = pod_table_key(event)
        if key is not None and key != table_key.encode("utf-8"):
            raise InvalidMessage(
                f"pod event of {event.namespace}/{event.name} keyed {key!r}; the topic's key is {table_key!r}",
                reason_code="WRONG_KEY",
            )
        self._check_partition(partition, event.node_name)
        engine = self._engine(partition)
        # What is stored per pod is what the engine keeps of it (its grouping labels, the annotation attribution
        # reads), bounded: whatever a producer puts in a pod event, its changelog record stays small.
        record = engine.pod_record(event)
        stored = _POD_CODEC.encode(record)
        if len(stored) > self.max_stored_pod_bytes:
            raise InvalidMessage(
                f"pod event of {event.namespace}/{event.name} is {len(stored)} bytes once cut to what attribution "
                f"keeps ({len(event.containers)} containers); a pod's stored state is at most "
                f"{self.max_stored_pod_bytes} bytes", reason_code="TOO_LARGE")
        put = (TableWrite(partition, PODS_TABLE, table_key, stored),) if engine.on_pod_event(record) else ()
        return Result(changes=put + self._table_writes(partition, engine))

    def _check_partition(self, partition: int, node_name: str) -> None:
        expected = partition_for_node(node_name, self.partition_count)
        if partition != expected:
            raise InvalidMessage(
                f"record of node {node_name} on partition {partition}; the catalog puts it on {expected} "
                f"(Kafka's murmur2 of the node name over {self.partition_count} partitions)",
                reason_code="WRONG_PARTITION",
            )

    # -- internals -------------------------------------------------------------------------------------------------

    def _engine(self, partition: int) -> AttributionEngine:
        engine = self._engines.get(partition)
        if engine is None:
            engine = self._engines[partition] = AttributionEngine(self.config)
            self._unacknowledged[partition] = {}
            if self._clock_ms is not None:
                engine.on_clock(self._clock_ms)  # empty: closes nothing, sets its clock watermark
        return engine

    def _closed(self, partition: int, engine: AttributionEngine, windows: Sequence[WindowResult]) -> Result:
        """Emit each window with rows (in flight until acknowledged); record a window without rows at once. The
        result's changes are every table write the engine queued, this call's included."""
        emits: list[Emit] = []
        empty: list[WindowResult] = []
        pending = self._unacknowledged.setdefault(partition, {})
        for window in windows:
            if window.record is None:
                empty.append(window)
                continue
            pending[window_key(window)] = window
            emits.append(Emit(WINDOW_SHARES, window.node_name.encode("utf-8"), window.record))
        if empty:
            engine.record_emitted(empty)
        return Result(emits=tuple(emits), changes=self._table_writes(partition, engine))

    @staticmethod
    def _table_writes(partition: int, engine: AttributionEngine) -> tuple[TableWrite, ...]:
        changes = engine.take_table_changes()
        if not changes:
            return ()
        return (
            tuple(TableWrite(partition, SAMPLES_TABLE, p.table_key, p.encode()) for p in changes.progress)
            + tuple(TableWrite(partition, SAMPLES_TABLE, k, None) for k in changes.deleted_sample_keys)
            + tuple(TableWrite(partition, PODS_TABLE, k, None) for k in changes.deleted_pod_keys)
        )


__all__ = [
    "MAX_STORED_POD_BYTES",
    "PODS_TABLE",
    "POD_EVENTS",
    "SAMPLES",
    "SAMPLES_TABLE",
    "SERVICE",
    "WINDOW_SHARES",
    "AttributorProcessor",
    "Restored",
    "TableWrite",
    "input_topics",
    "output_topics",
    "resume_position",
    "window_key",
]
