"""The per-partition attribution engine: windows, pods and attribution as one state the attributor's processor drives.

No Kafka or Faust here: ``services.attributor.processor`` calls this per message (under the Faust app and under
the in-memory driver); the offline replay can call the same engine with ``position=None``. One engine serves one
input partition (a node's samples and its pods' events share a partition number), so it holds the pods of the
partition's nodes and one ``WindowAccumulator`` per node: the accumulator copies its node map on every ``add``, so
one per node keeps each add proportional to that node's state, not to the partition's.

Lifecycle of a window (what the caller does with each output):

1. ``on_sample`` adds a tick; ticks past a window's end + grace close it. ``on_clock(now)`` closes windows of
   nodes that went silent, once ``now >= end + grace + idle_close`` (the caller only calls it while its input is
   caught up: during a backlog the backlog's own event time closes windows, and a clock ahead of the backlog
   would wrongly make the backlog late).
2. Every closed window comes out once as a ``WindowResult`` with its ``GpuShare`` rows and the state-table keys
   of its ticks. The caller emits the rows, waits for them to be acknowledged, then calls ``record_emitted``.
3. ``take_table_changes`` gives what the caller's state table must do, in this order: put the nodes' progress
   records, then delete the emitted windows' tick keys and the pods pruned from the index. Progress before
   deletes: a table recovered from a prefix of those writes never holds part of a window without its progress
   record, so a restore re-emits a window whole or not at all.

Replay feeds the same calls from recorded input (``position=None``, ``now_ms`` from its own clock) and ends with
``flush()``, which closes whatever is still open.

Restore (after a restart or a rebalance): ``restore(samples, pod_events, progress)`` from the tables' contents
rebuilds the pod index and each node's closed-before boundary. The streaming app stores no ticks: each progress
record also carries ``reread_from_position``, the input position of the first tick of the node's oldest window
not yet recorded as emitted, and the app reads its input again from the smallest of these
(``services.attributor.processor.resume_position``), which rebuilds the open windows and re-closes those that
were in flight (they may have been emitted before the crash: at-least-once, downstream is idempotent by (window,
GPU, subject)). ``samples`` restores ticks stored by older versions: windows whose ticks are all there but whose
progress record is missing are closed and returned again.

A progress record also carries ``position``: the largest input position (the Kafka offset on the partition) the
engine had processed when it was written. Every input at or below it was processed and its table writes came
before the record, so after a restore a tick of an already closed window at or below that position is a
redelivery (dropped, counted) and one above it is really late (the caller dead-letters it).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from gpumeter.clockskew import DEFAULT_CLOCK_SKEW_THRESHOLD_SECONDS, MAX_CLOCK_CORRECTION_MS, ClockReading, NodeClocks
from gpumeter.errors import ClockSkew, ConfigError, InvalidMessage, OutOfRange
from gpumeter.validation import (
    DEFAULT_MAX_SAMPLE_AGE_SECONDS,
    check_packed_sample,
    check_packed_sample_names,
    check_sample,
    check_sample_names,
)
from schemas.catalog import pod_event_key
from schemas.packed import PackedNodeSample
from schemas.pods import GroupingLabelSources
from schemas.records import GpuShare, NodeSample, NodeWindowShares, PodEvent

from services.attributor.attribution import AttributionPolicy, OpenNodeWindow, node_window_record
from services.attributor.pod_index import DEFAULT_LINGER_MS, LivePodIndex, PodFields, PodIndex, trim_pod_event
from services.attributor.windows import LateSample, NodeKey, NodeWindow, WindowAccumulator

KEY_SEPARATOR = "|"
PROGRESS_TAG = "progress"


# ----------------------------------------------------------------------------------------------------------------
# State-table keys


def sample_table_key(sample: NodeSample) -> str:
    """``<node>|<collector_started_at_unix_ms>|<sequence>``: one key per tick, so each tick is one small record."""
    return f"{sample.node_name}{KEY_SEPARATOR}{sample.collector_started_at_unix_ms}{KEY_SEPARATOR}{sample.sequence}"


def progress_table_key(cluster: str, node_name: str) -> str:
    """``<node>|progress|<cluster>``: the node's progress record, in the same table as its ticks (see module doc)."""
    return f"{node_name}{KEY_SEPARATOR}{PROGRESS_TAG}{KEY_SEPARATOR}{cluster}"


def pod_table_key(event: PodEvent) -> str:
    """The pod table's key of ``event``: its compaction key on the pod-events topic, ``<node>/<uid>``."""
    return pod_event_key(event.node_name, event.uid).decode("utf-8")


def node_of_table_key(key: str) -> str:
    """The node name a sample or progress key belongs to (node names cannot contain ``|``)."""
    return key.split(KEY_SEPARATOR, 1)[0]


def is_progress_key(key: str) -> bool:
    parts = key.split(KEY_SEPARATOR, 2)
    return len(parts) == 3 and parts[1] == PROGRESS_TAG


@dataclass(frozen=True, slots=True)
class NodeProgress:
    """How far a node's windows are closed and emitted: windows starting before ``closed_before_unix_ms`` are done.

    ``position``: every input at or below it had been processed when this was written (None: positions unknown).
    ``reread_from_position``: the input position of the first tick of the node's oldest window not yet
    acknowledged downstream (open or in flight) when this was written; None when the node had none. Open windows
    are not stored: a rebuilt partition re-reads its input from the smallest of these (see the module doc).
    """

    cluster: str
    node_name: str
    closed_before_unix_ms: int
    position: int | None
    reread_from_position: int | None = None

    @property
    def table_key(self) -> str:
        return progress_table_key(self.cluster, self.node_name)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "cluster": self.cluster,
                "node_name": self.node_name,
                "closed_before_unix_ms": self.closed_before_unix_ms,
                "position": self.position,
                "reread_from_position": self.reread_from_position,
            },
            sort_keys=True,
        ).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes) -> "NodeProgress":
        """Raises ``InvalidMessage`` (reason ``CORRUPT``) for bytes ``encode`` did not write."""
        try:
            d = json.loads(data)
            position = d["position"]
            reread = d.get("reread_from_position")  # absent in records written before it existed
            progress = cls(str(d["cluster"]), str(d["node_name"]), int(d["closed_before_unix_ms"]),
                           None if position is None else int(position), None if reread is None else int(reread))
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidMessage(f"not a progress record: {exc!r}", reason_code="CORRUPT") from None
        return progress


# ----------------------------------------------------------------------------------------------------------------
# Engine (range checks: ``check_sample`` is ``gpumeter.validation.check_sample``, shared with the guard, re-exported
# here)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What an engine needs to know; the streaming app builds it from ``AttributorSettings``."""

    window_seconds: int = 60
    grace_seconds: int = 10
    idle_close_seconds: int = 30
    max_clock_skew_seconds: int = 120
    max_sample_age_seconds: int | None = DEFAULT_MAX_SAMPLE_AGE_SECONDS
    pod_linger_ms: int = DEFAULT_LINGER_MS
    policy: AttributionPolicy = field(default_factory=AttributionPolicy)
    closed_key_retention: int = 2
    # A node whose clock disagrees with the broker's by more than this has its timestamps corrected
    # (``gpumeter.clockskew``); within it, a node's clock is taken as it reads.
    clock_skew_threshold_seconds: int = DEFAULT_CLOCK_SKEW_THRESHOLD_SECONDS
    # The labels share rows carry (``pod_index.PodFields``); None: every label (the streaming attributor and
    # ``gpumeter replay`` pass ``GPUMETER_GROUPING_LABELS``, default ``pod_index.DEFAULT_GROUPING_LABELS``).
    grouping_labels: tuple[str, ...] | None = None
    # Where each grouping label's value comes from: the pod's labels (default), its namespace's, or one then the
    # other (``GPUMETER_GROUPING_LABEL_SOURCE``).
    grouping_label_sources: GroupingLabelSources = GroupingLabelSources()

    @property
    def pod_fields(self) -> PodFields:
        """What the engine keeps of each pod: the grouping labels, and only the annotation attribution reads."""
        if self.grouping_labels is None:
            return PodFields(sources=self.grouping_label_sources)
        annotations = (self.policy.mps_thread_annotation,) if self.policy.mps_thread_annotation else ()
        return PodFields.for_grouping(self.grouping_labels, annotations, self.grouping_label_sources)

    def __post_init__(self) -> None:
        # The accumulator validates window and grace; these are the engine's own.
        WindowAccumulator(self.window_seconds, self.grace_seconds, self.closed_key_retention)
        if not isinstance(self.idle_close_seconds, int) or self.idle_close_seconds < 0:
            raise ConfigError(f"idle_close_seconds must be a non-negative integer, got {self.idle_close_seconds!r}")
        if not isinstance(self.max_clock_skew_seconds, int) or self.max_clock_skew_seconds < 0:
            raise ConfigError(
                f"max_clock_skew_seconds must be a non-negative integer, got {self.max_clock_skew_seconds!r}"
            )
        if self.max_sample_age_seconds is not None and (
                not isinstance(self.max_sample_age_seconds, int) or self.max_sample_age_seconds <= 0):
            raise ConfigError(
                f"max_sample_age_seconds must be a positive integer or None, got {self.max_sample_age_seconds!r}"
            )
        if not isinstance(self.clock_skew_threshold_seconds, int) or self.clock_skew_threshold_seconds < 0:
            raise ConfigError(f"clock_skew_threshold_seconds must be a non-negative integer, got "
                              f"{self.clock_skew_threshold_seconds!r}")
        if self.pod_linger_ms < 0:
            raise ConfigError(f"pod linger must be >= 0 ms, got {self.pod_linger_ms}")
        if self.grouping_labels is not None and (
                isinstance(self.grouping_labels, str)
                or not all(isinstance(k, str) and k and "," not in k for k in self.grouping_labels)):
            raise ConfigError(f"grouping labels must be label keys, got {self.grouping_labels!r}")
        if not isinstance(self.grouping_label_sources, GroupingLabelSources):
            raise ConfigError(f"grouping label sources must be GroupingLabelSources, got "
                              f"{self.grouping_label_sources!r}")
        unknown = [key for key in self.grouping_label_sources.keys_named
                   if self.grouping_labels is not None and key not in self.grouping_labels]
        if unknown:
            raise ConfigError(f"grouping label sources name {', '.join(unknown)}, which are not grouping labels "
                              f"({', '.join(self.grouping_labels or ())}): no row would carry them")


@dataclass(frozen=True, slots=True)
class WindowResult:
    """One closed node window: the record to emit (``attribution.node_window_record``; None when the window has no
    rows) and its ticks' table keys."""

    cluster: str
    node_name: str
    window_start_unix_ms: int
    window_seconds: int
    record: NodeWindowShares | None
    sample_keys: tuple[str, ...]

    @property
    def shares(self) -> tuple[GpuShare, ...]:
        """The record's rows, one ``GpuShare`` per unit and subject (``attribute_node_window``'s rows); built on
        each call, for readers that want rows (the streaming path emits ``record``)."""
        return self.record.rows() if self.record is not None else ()

    @property
    def window_end_unix_ms(self) -> int:
        return self.window_start_unix_ms + self.window_seconds * 1000


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """What one engine call produced.

    ``windows``: windows closed by this call, sorted by (window start, cluster, node). ``late``: the tick of this
    call when its window was already closed (dead-letter it with ``late[0].error()``, or ``rejection``).
    ``accepted``: the tick was added to an open window (store it in the state table). ``duplicate``: the tick was
    seen before, or is a redelivery of a tick of an emitted window (nothing to do). ``clock_skew``: the late tick
    was refused because its node's clock moved (``late[0]`` says how; ``rejection`` is then ``ClockSkew``).
    ``second_collector``: the tick came from a collector of the node older than one already heard from, still
    writing after its successor started (two collectors for one node: their ticks are merged).
    """

    windows: tuple[WindowResult, ...] = ()
    late: tuple[LateSample, ...] = ()
    accepted: bool = False
    duplicate: bool = False
    clock_skew: bool = False
    second_collector: bool = False

    @property
    def rejection(self) -> InvalidMessage | None:
        """The dead letter's error of the tick of this call, if it was refused (None otherwise)."""
        if not self.late:
            return None
        late = self.late[0]
        return ClockSkew(late.reason) if self.clock_skew else late.error()

    @property
    def shares(self) -> tuple[GpuShare, ...]:
        return tuple(row for w in self.windows for row in w.shares)

    @property
    def closed_keys(self) -> tuple[str, ...]:
        """Table keys of the ticks of the closed windows (deleted once the windows are emitted)."""
        return tuple(k for w in self.windows for k in w.sample_keys)


@dataclass(frozen=True, slots=True)
class TableChanges:
    """State-table writes, to apply in field order: progress puts, then sample deletes, then pod deletes."""

    progress: tuple[NodeProgress, ...] = ()
    deleted_sample_keys: tuple[str, ...] = ()
    deleted_pod_keys: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.progress or self.deleted_sample_keys or self.deleted_pod_keys)


_NO_CHANGES = TableChanges()


def _window_order(w: WindowResult) -> tuple[int, str, str]:
    return (w.window_start_unix_ms, w.cluster, w.node_name)


def pod_event_lead(event: PodEvent, appended_at_ms: int | None, threshold_ms: int) -> int:
    """How far ``event`` is stamped ahead of its append, when that is more than ``threshold_ms`` (else 0):
    what its node's clock is ahead by at least (a delay never makes a message look early)."""
    if appended_at_ms is None:
        return 0
    lead = event.observed_at_unix_ms - appended_at_ms
    return lead if threshold_ms < lead < MAX_CLOCK_CORRECTION_MS else 0


def shift_pod_event(event: PodEvent, offset_ms: int) -> PodEvent:
    """``event`` with ``offset_ms`` taken off its node-clock times (``observed_at``, ``started_at``)."""
    if not offset_ms:
        return event
    started = event.started_at_unix_ms
    return dataclasses.replace(event, observed_at_unix_ms=event.observed_at_unix_ms - offset_ms,
                               started_at_unix_ms=None if started is None else started - offset_ms)


def _clock_note(reading: ClockReading) -> str:
    """What a dead letter says of the node's clock: the broker's time against it, and what was done."""
    text = (f"; by the broker's append time the node's clock reads {reading.measured_ms / 1000:+.3f} s off "
            f"(less any delay before the append)")
    if reading.offset_ms:
        text += f", its times were corrected by its clock offset {reading.offset_ms / 1000:+.3f} s"
    if reading.moved:
        text += (" -- this tick disagrees with that offset and the node's previous tick does not confirm a new one "
                 "(its clock may just have moved)")
    return text


class AttributionEngine:
    """One partition's windows and pods. Mutable (it holds immutable accumulators and a ``LivePodIndex``, changed in
    place per pod event; ``pods`` gives an immutable snapshot); not thread-safe: one caller at a time (the Faust
    agents and timer share one event loop)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._accs: dict[NodeKey, WindowAccumulator] = {}
        self._last_sampled_at: dict[NodeKey, int] = {}
        self._pods = LivePodIndex(config.pod_linger_ms, config.pod_fields)
        self._pod_keys: dict[str, str] = {}  # uid -> pod table key
        self._clock_watermark_ms: int | None = None
        self._position: int | None = None
        self._restored_positions: dict[NodeKey, int] = {}
        self._has_progress: set[NodeKey] = set()
        self._in_flight: dict[NodeKey, set[int]] = {}
        # node -> window start -> input position of the window's first tick, for every window not yet recorded
        # as emitted (open or in flight): where a rebuild must re-read the input from (NodeProgress)
        self._first_positions: dict[NodeKey, dict[int, int]] = {}
        self._pending_progress: dict[NodeKey, NodeProgress] = {}
        # the open windows' attribution summed as their ticks arrived: the close of a
        # window is then O(units), not O(ticks) (``attribution.OpenNodeWindow``; same rows either way)
        self._open_windows: dict[NodeKey, dict[int, OpenNodeWindow]] = {}  # node -> window start -> its sums
        self._pending_sample_deletes: list[str] = []
        self._pending_pod_deletes: list[str] = []
        self.redeliveries_ignored = 0
        self.late_rejected = 0
        self.clocks = NodeClocks(config.clock_skew_threshold_seconds * 1000)
        # node -> the newest collector start heard of (collector_started_at_unix_ms)
        self._collector_starts: dict[NodeKey, int] = {}
        self.second_collector_ticks = 0

    # -- inputs ----------------------------------------------------------------------------------------------------

    def on_sample(self, sample: NodeSample, now_ms: int, position: int | None = None,
                  appended_at_ms: int | None = None) -> EngineOutput:
        """Add one tick (``check_sample`` first, with the config's clock skew and maximum age: raises
        ``OutOfRange``). ``position``: the tick's place in the input (its Kafka offset), or None when the input has
        no positions. ``appended_at_ms``: when the broker appended it (its trusted clock; None: unknown, the
        node's clock is taken as it reads): measured against it (``gpumeter.clockskew``), a node whose clock is
        off has its tick's ``sampled_at`` corrected by its offset before anything else judges it, so it is
        billed in the windows it was really sampled in. A tick whose time is impossible (out of range, late)
        only because its node's clock just moved is refused ``CLOCK_SKEW`` rather than ``OUT_OF_RANGE``/``LATE``."""
        packed: PackedNodeSample | None = getattr(sample, "packed", None)  # decoded from v4: judged on its arrays
        if packed is not None:
            check_packed_sample_names(packed, sample.pod_uids)  # the record's pod_uid_strings(), decoded once
        else:
            check_sample_names(sample)
        key: NodeKey = (sample.cluster, sample.node_name)
        reading: ClockReading | None = None
        if appended_at_ms is not None:
            reading = self.clocks.observe(key, sample.sampled_at_unix_ms, appended_at_ms,
                                          lambda: self._is_late(key, sample.sampled_at_unix_ms),
                                          sample.interval_ms)
            if reading.offset_ms:
                sample = dataclasses.replace(sample,
                                             sampled_at_unix_ms=sample.sampled_at_unix_ms - reading.offset_ms)
        age = self.config.max_sample_age_seconds
        try:
            if getattr(sample, "packed", None) is not None:  # not when its time was corrected: then a new sample
                check_packed_sample(packed, now_ms, self.config.max_clock_skew_seconds * 1000,
                                    None if age is None else age * 1000, names=False)
            else:
                check_sample(sample, now_ms, self.config.max_clock_skew_seconds * 1000,
                             None if age is None else age * 1000, names=False)
        except OutOfRange as exc:
            if reading is not None and reading.moved and reading.offset_ms:
                raise ClockSkew(f"{exc.detail}{_clock_note(reading)}") from None
            raise
        acc = self._acc_for(key)
        result = acc.add(sample, position)
        self._accs[key] = result.state
        if position is not None and (self._position is None or position > self._position):
            self._position = position
        if result.rejected:
            restored = self._restored_positions.get(key)
            if position is not None and restored is not None and position <= restored:
                self.redeliveries_ignored += 1
                return EngineOutput(duplicate=True)
            self.late_rejected += 1
            late = result.rejected
            skew = False
            if reading is not None and (reading.offset_ms or reading.measured_ms):
                late = (dataclasses.replace(late[0], clock_note=_clock_note(reading)),)
                skew = reading.moved and reading.offset_ms != 0
            return EngineOutput(late=late, clock_skew=skew)
        if result.state.duplicates_ignored > acc.duplicates_ignored:
            return EngineOutput(duplicate=True)
        second = self._second_collector(key, sample)
        last = self._last_sampled_at.get(key)
        if last is None or sample.sampled_at_unix_ms > last:
            self._last_sampled_at[key] = sample.sampled_at_unix_ms
        start = result.state.window_start_of(sample.sampled_at_unix_ms)
        self._sum_tick(key, start, sample)
        if position is not None:
            firsts = self._first_positions.setdefault(key, {})
            if start not in firsts:
                firsts[start] = position
                if len(firsts) == 1:
                    # The node's only unacknowledged window starts here: the re-read point moved (from none), and
                    # nothing else would record it until this window is acknowledged.
                    self._queue_progress(key, result.state)
        return EngineOutput(windows=self._attribute(key, result.closed), accepted=True, second_collector=second)

    def corrected_pod_event(self, event: PodEvent, appended_at_ms: int | None) -> PodEvent:
        """``event`` with its node's clock offset taken off its times (``observed_at``, ``started_at``: its
        collector's and its kubelet's, both the node's clock). A pod event does not move the offset (ticks do:
        ``on_sample``); before its node's first tick, an event stamped further ahead of its append than the skew
        threshold is corrected by that much (a delay never makes a message look early)."""
        key: NodeKey = (event.cluster, event.node_name)
        offset = self.clocks.offset(key)
        if not offset and key not in self.clocks.offsets():
            offset = pod_event_lead(event, appended_at_ms, self.clocks.threshold_ms)
        return shift_pod_event(event, offset)

    def clock_offsets(self) -> Mapping[NodeKey, int]:
        """Every node's clock offset in effect, ms (0: its clock agrees with the broker's)."""
        return self.clocks.offsets()

    def pod_record(self, event: PodEvent) -> PodEvent:
        """``event`` as the engine keeps it (``pod_index.trim_pod_event`` with the config's ``pod_fields``): what
        the pod table stores, so that a pod's stored size does not grow with labels and annotations no one reads."""
        return trim_pod_event(event, self.config.pod_fields)

    def on_pod_event(self, event: PodEvent) -> bool:
        """Apply a pod event; True when it changed the pod index (store it), False for a stale or repeated one.
        Pods the index prunes (deleted longer than the linger ago) are queued for deletion from the pod table."""
        change = self._pods.apply(event)
        if not change.changed:
            return False
        self._pod_keys[event.uid] = pod_table_key(event)
        for uid in change.pruned:
            table_key = self._pod_keys.pop(uid, None)
            if table_key is not None:
                self._pending_pod_deletes.append(table_key)
        return True

    def on_clock(self, now_ms: int) -> EngineOutput:
        """Close windows with ``end + grace + idle_close <= now_ms`` on every node (clock-driven watermark
        ``now - idle_close``; it never goes back). Forgets nodes silent for longer than their key retention."""
        watermark = now_ms - self.config.idle_close_seconds * 1000
        if self._clock_watermark_ms is not None and watermark <= self._clock_watermark_ms:
            return EngineOutput()
        self._clock_watermark_ms = watermark
        windows: list[WindowResult] = []
        for key in sorted(self._accs):
            result = self._accs[key].advance(watermark)
            self._accs[key] = result.state
            windows.extend(self._attribute(key, result.closed))
        self._forget_silent_nodes(watermark)
        windows.sort(key=_window_order)
        return EngineOutput(windows=tuple(windows))

    def flush(self) -> EngineOutput:
        """Close every open window now, whatever the time (the end of a replay's input). Windows come sorted by
        (window start, cluster, node)."""
        windows: list[WindowResult] = []
        for key in sorted(self._accs):
            result = self._accs[key].flush()
            self._accs[key] = result.state
            windows.extend(self._attribute(key, result.closed))
        windows.sort(key=_window_order)
        return EngineOutput(windows=tuple(windows))

    def restore(
        self,
        samples: Iterable[NodeSample],
        pod_events: Iterable[PodEvent],
        progress: Iterable[NodeProgress] = (),
    ) -> EngineOutput:
        """Rebuild a fresh engine from its state tables (call before any other input).

        Pod events are applied in ``observed_at`` order; each node starts at its progress record's boundary;
        samples are added in (sampled_at, collector start, sequence) order. Returns the windows that close while
        rebuilding (stored whole but without a progress record: maybe emitted before, emit them again). Stored
        ticks of windows before a node's boundary (their deletes were lost) are queued for deletion.
        """
        if self._accs or len(self._pods) or self._position is not None:
            raise RuntimeError("restore() rebuilds a fresh engine; this one has processed input")
        for event in sorted(pod_events, key=lambda e: (e.observed_at_unix_ms, e.uid, e.resource_version)):
            self.on_pod_event(event)
        grace_ms = self.config.grace_seconds * 1000
        for record in progress:
            key: NodeKey = (record.cluster, record.node_name)
            acc = self._accs.get(key) or WindowAccumulator(
                self.config.window_seconds, self.config.grace_seconds, self.config.closed_key_retention
            )
            # A clock-driven watermark of boundary + grace closes exactly the windows before the boundary.
            self._accs[key] = acc.advance(record.closed_before_unix_ms + grace_ms).state
            self._has_progress.add(key)
            # Until it sends again, a node restored from its progress record alone was last heard of at its boundary.
            boundary = record.closed_before_unix_ms
            self._last_sampled_at[key] = max(boundary, self._last_sampled_at.get(key, boundary))
            if record.position is not None:
                self._restored_positions[key] = max(record.position, self._restored_positions.get(key, record.position))
        positions = [p for p in self._restored_positions.values()]
        self._position = max(positions) if positions else None
        windows: list[WindowResult] = []
        ordered = sorted(samples, key=lambda s: (s.sampled_at_unix_ms, s.collector_started_at_unix_ms, s.sequence))
        for sample in ordered:
            key = (sample.cluster, sample.node_name)
            acc = self._acc_for(key)
            result = acc.add(sample)
            self._accs[key] = result.state
            if result.rejected:
                self._pending_sample_deletes.append(sample_table_key(sample))
                continue
            if result.state.duplicates_ignored == acc.duplicates_ignored:
                self._sum_tick(key, result.state.window_start_of(sample.sampled_at_unix_ms), sample)
            last = self._last_sampled_at.get(key)
            if last is None or sample.sampled_at_unix_ms > last:
                self._last_sampled_at[key] = sample.sampled_at_unix_ms
            windows.extend(self._attribute(key, result.closed))
        windows.sort(key=_window_order)
        return EngineOutput(windows=tuple(windows))

    # -- after emission --------------------------------------------------------------------------------------------

    def record_emitted(self, windows: Iterable[WindowResult]) -> None:
        """The rows of ``windows`` are acknowledged downstream: queue each node's progress record and the
        windows' tick deletions (``take_table_changes``)."""
        touched: list[NodeKey] = []
        for w in windows:
            key = (w.cluster, w.node_name)
            flight = self._in_flight.get(key)
            if flight is not None:
                flight.discard(w.window_start_unix_ms)
                if not flight:
                    del self._in_flight[key]
            firsts = self._first_positions.get(key)
            if firsts is not None:
                firsts.pop(w.window_start_unix_ms, None)
                if not firsts:
                    del self._first_positions[key]
            self._pending_sample_deletes.extend(w.sample_keys)
            if key not in touched:
                touched.append(key)
        for key in touched:
            acc = self._accs.get(key)
            if acc is not None:
                self._queue_progress(key, acc)

    def _queue_progress(self, key: NodeKey, acc: WindowAccumulator) -> None:
        watermark = acc.watermark(*key)
        closed_before = acc.closed_before_for(watermark) if watermark is not None else None
        flight = self._in_flight.get(key)
        if flight:
            # A window closed earlier but not yet acknowledged holds the boundary back: a restore must
            # re-emit it rather than count it as done.
            closed_before = min(flight) if closed_before is None else min(closed_before, min(flight))
        if closed_before is None:
            return
        firsts = self._first_positions.get(key)
        reread = min(firsts.values()) if firsts else None
        self._pending_progress.pop(key, None)
        self._pending_progress[key] = NodeProgress(key[0], key[1], closed_before, self._position, reread)
        self._has_progress.add(key)

    def take_table_changes(self) -> TableChanges:
        """The queued state-table writes (apply them in ``TableChanges`` field order); the queue is emptied."""
        if not (self._pending_progress or self._pending_sample_deletes or self._pending_pod_deletes):
            return _NO_CHANGES  # most calls (one per input message): nothing queued
        changes = TableChanges(
            tuple(self._pending_progress.values()),
            tuple(dict.fromkeys(self._pending_sample_deletes)),
            tuple(dict.fromkeys(self._pending_pod_deletes)),
        )
        self._pending_progress.clear()
        self._pending_sample_deletes.clear()
        self._pending_pod_deletes.clear()
        return changes

    # -- introspection ---------------------------------------------------------------------------------------------

    @property
    def pods(self) -> PodIndex:
        """An immutable snapshot of the partition's pods (copied once after each change, when asked for)."""
        return self._pods.snapshot()

    @property
    def clock_watermark_ms(self) -> int | None:
        return self._clock_watermark_ms

    def nodes(self) -> tuple[NodeKey, ...]:
        return tuple(sorted(self._accs))

    def open_window_starts(self, cluster: str, node_name: str) -> tuple[int, ...]:
        acc = self._accs.get((cluster, node_name))
        return acc.open_window_starts(cluster, node_name) if acc is not None else ()

    def open_sample_count(self) -> int:
        return sum(acc.open_sample_count() for acc in self._accs.values())

    def closed_before(self, cluster: str, node_name: str) -> int | None:
        """Windows of the node starting before this are closed (None: node unknown)."""
        acc = self._accs.get((cluster, node_name))
        if acc is None:
            return None
        watermark = acc.watermark(cluster, node_name)
        if watermark is None:
            return None
        return acc.closed_before_for(watermark)

    def in_flight(self) -> Mapping[NodeKey, frozenset[int]]:
        """Window starts closed but not yet recorded as emitted, per node."""
        return {k: frozenset(v) for k, v in self._in_flight.items()}

    # -- internals -------------------------------------------------------------------------------------------------

    def _is_late(self, key: NodeKey, sampled_at_unix_ms: int) -> bool:
        acc = self._accs.get(key)
        if acc is None:
            acc = WindowAccumulator(self.config.window_seconds, self.config.grace_seconds)
            if self._clock_watermark_ms is not None:
                acc = acc.advance(self._clock_watermark_ms).state
        return acc.is_closed(key[0], key[1], sampled_at_unix_ms)

    def _second_collector(self, key: NodeKey, sample: NodeSample) -> bool:
        # A collector restart changes the start for good; a tick of an older start sampled after the newer
        # collector started means both are writing.
        start = sample.collector_started_at_unix_ms
        newest = self._collector_starts.get(key)
        if newest is None or start > newest:
            self._collector_starts[key] = start
            return False
        if start < newest and sample.sampled_at_unix_ms >= newest - self.clocks.offset(key):
            self.second_collector_ticks += 1
            return True
        return False

    def _acc_for(self, key: NodeKey) -> WindowAccumulator:
        acc = self._accs.get(key)
        if acc is None:
            acc = WindowAccumulator(
                self.config.window_seconds, self.config.grace_seconds, self.config.closed_key_retention
            )
            if self._clock_watermark_ms is not None:
                # A node first heard of now obeys the same clock as the others: its ticks of windows the clock
                # has closed are late.
                acc = acc.advance(self._clock_watermark_ms).state
            self._accs[key] = acc
        return acc

    def _sum_tick(self, key: NodeKey, window_start_unix_ms: int, sample: NodeSample) -> None:
        """Sum a tick its window took in into the window's ``OpenNodeWindow``."""
        node_windows = self._open_windows.get(key)
        if node_windows is None:
            node_windows = self._open_windows[key] = {}
        summed = node_windows.get(window_start_unix_ms)
        if summed is None:
            summed = node_windows[window_start_unix_ms] = OpenNodeWindow(self.config.window_seconds,
                                                                         self.config.policy)
            previous_start = window_start_unix_ms - self.config.window_seconds * 1000
            previous = node_windows.get(previous_start)
            if previous is not None:
                # The node's ticks moved on to its next window: the previous one is attributed now, in its grace,
                # rather than at its close, when every node's window closes at once (its close hands the record
                # out if nothing it read has changed by then: ``OpenNodeWindow.early_record``).
                previous.close_early(NodeWindow(key[0], key[1], previous_start, self.config.window_seconds,
                                                tuple(previous.samples)), self._pods)
        summed.add(sample, self._pods, self._pods.generation)

    def _attribute(self, key: NodeKey, closed: tuple[NodeWindow, ...]) -> tuple[WindowResult, ...]:
        results = []
        for window in closed:
            node_windows = self._open_windows.get(key)
            summed = node_windows.pop(window.window_start_unix_ms, None) if node_windows is not None else None
            if node_windows is not None and not node_windows:
                del self._open_windows[key]
            record = node_window_record(window, self._pods, self.config.policy, summed)
            results.append(
                WindowResult(
                    window.cluster,
                    window.node_name,
                    window.window_start_unix_ms,
                    window.window_seconds,
                    record,
                    tuple(sample_table_key(s) for s in window.samples),
                )
            )
            self._in_flight.setdefault(key, set()).add(window.window_start_unix_ms)
        return tuple(results)

    def _forget_silent_nodes(self, clock_watermark_ms: int) -> None:
        # A node with no open window, nothing in flight and no tick for longer than its closed-key retention
        # (plus grace) is dropped: a fresh accumulator under the same clock rejects the same ticks as late, and
        # its redeliveries are long committed. Keeps memory bounded as nodes come and go.
        window_ms = self.config.window_seconds * 1000
        retained_ms = (self.config.closed_key_retention + 1) * window_ms + self.config.grace_seconds * 1000
        horizon = clock_watermark_ms - retained_ms
        for key in list(self._accs):
            if key in self._in_flight or self._accs[key].open_window_starts(*key):
                continue
            last = self._last_sampled_at.get(key)
            if last is not None and last >= horizon:
                continue
            del self._accs[key]
            self._open_windows.pop(key, None)
            self._last_sampled_at.pop(key, None)
            self.clocks.forget(key)
            self._collector_starts.pop(key, None)
            self._restored_positions.pop(key, None)
            if key in self._has_progress:
                self._has_progress.discard(key)
                self._pending_progress.pop(key, None)
                self._pending_sample_deletes.append(progress_table_key(*key))


__all__ = [
    "AttributionEngine",
    "EngineConfig",
    "EngineOutput",
    "NodeProgress",
    "TableChanges",
    "WindowResult",
    "check_sample",
    "is_progress_key",
    "node_of_table_key",
    "pod_event_lead",
    "pod_table_key",
    "progress_table_key",
    "sample_table_key",
    "shift_pod_event",
]
