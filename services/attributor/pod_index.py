"""The pod state a node's window is attributed against, built from PodEvents.

Pure and immutable: ``apply_pod_event(index, event)`` returns a new ``PodIndex`` and leaves the old one as it was,
so a window can be attributed against a snapshot while events keep arriving. That copies the index per event
(O(pods) each); ``LivePodIndex`` applies the same rules in place, O(1) amortised per event, for an owner that loads
many pods (the attributor's engine: every pod of its partition) and takes an immutable ``snapshot()`` when it needs
one. Both answer the same lookups (``PodLookup``), which is all attribution reads.

Rules:

* Events are applied by ``observed_at_unix_ms``: an event older than what the index holds for that pod is ignored
  (a compacted topic, a replay or a redelivery can bring them out of order); an event with the same time and the
  same ``resource_version`` is a duplicate and ignored.
* A pod's life is ``[started_at, ended_at)``. ``started_at`` is ``status.startTime`` (unknown start: alive since
  forever, since a pod in the index exists); ``ended_at`` is when a terminal phase (Succeeded, Failed) or the
  deletion was first observed.
* Deleted pods are kept for ``linger_ms`` after their deletion so that a window closing after a pod ended still
  names it. The index's clock is the largest ``observed_at_unix_ms`` it has applied (or a time passed to
  ``prune_pod_index``); pods whose deletion is older than clock − linger are dropped. Linger must be at least
  window + grace + the pipeline's lag, or late windows lose pod names (their usage then stays with the pod uid
  the collector saw, without namespace and name).
* What of a pod's labels and annotations the index keeps is its ``PodFields``: with ``label_keys`` set (the
  attributor's grouping labels, ``GPUMETER_GROUPING_LABELS``), only those labels, and ``carried_label_keys``
  naming them (a field of every share row and every cost line made from it, ``GpuShare.carried_label_keys``), so
  that a report can tell "not carried" from "the pod had none"; with
  ``annotation_keys`` set, only those annotations (attribution reads one: the MPS thread annotation). A pod with
  30,000 labels then costs the index, the share rows and the pod table what a pod with two does.
  ``trim_pod_event`` gives the event with the same cut (what the attributor stores per pod).
* Where a grouping label's value comes from is ``PodFields.sources`` (``schemas.pods.GroupingLabelSources``, the
  attributor's ``GPUMETER_GROUPING_LABEL_SOURCE``): the pod's own labels (the default), its namespace's
  (``PodEvent.namespace_labels``, which the platform writes, not the pod's owner), or one then the other. The
  resolved value is the row's label, so nothing downstream tells the sources apart.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Iterable, Mapping, NamedTuple

from gpumeter.errors import ConfigError
from schemas.records import PodEvent, PodEventType

from schemas.devices import base_device_id
from schemas.pods import (
    TERMINAL_PHASES,
    GroupingLabelSources,
    PodAssignment,
    fold_assignments,
    fold_life,
    fold_started,
    is_stale,
)
from services.attributor.modes import UnitAssignment

DEFAULT_LINGER_MS = 15 * 60 * 1000
DEFAULT_GROUPING_LABELS = ("team", "model")
"""The labels share rows carry by default: what ``gpumeter report --by label:team|label:model``, billing's and the
guard's team label (``team``) read. Others need ``GPUMETER_GROUPING_LABELS``."""
_EMPTY: Mapping = MappingProxyType({})
_FOREVER = 2**62
_HOLDERS_MAX = 65_536  # LivePodIndex.assignments_for answers kept at most (one per unit of the partition)


@dataclass(frozen=True, slots=True)
class PodFields:
    """Which labels and annotations of a pod the index keeps (None: all of them), and where each kept label's
    value comes from (``sources``: the pod's labels, its namespace's, in a configured order)."""

    label_keys: frozenset[str] | None = None
    annotation_keys: frozenset[str] | None = None
    sources: GroupingLabelSources = GroupingLabelSources()

    @classmethod
    def for_grouping(cls, label_keys: Iterable[str] | None,
                     annotation_keys: Iterable[str] | None = None,
                     sources: GroupingLabelSources = GroupingLabelSources()) -> "PodFields":
        return cls(None if label_keys is None else frozenset(label_keys),
                   None if annotation_keys is None else frozenset(annotation_keys), sources)

    def carried_labels(self, labels: Mapping[str, str],
                       namespace_labels: Mapping[str, str] = _EMPTY) -> Mapping[str, str]:
        """The labels a pod's share rows carry: the kept keys, each from the first of its sources that has it
        (``GroupingLabelSources.resolve``)."""
        if self.sources.pod_only:
            if self.label_keys is None:
                return MappingProxyType(dict(labels))
            return MappingProxyType({key: value for key, value in labels.items() if key in self.label_keys})
        return MappingProxyType(self.sources.resolve(self.label_keys, labels, namespace_labels))

    def kept_namespace_labels(self, namespace_labels: Mapping[str, str]) -> Mapping[str, str]:
        """The namespace labels ``carried_labels`` may read: those of kept keys whose sources include the
        namespace."""
        if not namespace_labels:
            return namespace_labels
        return MappingProxyType({key: value for key, value in namespace_labels.items()
                                 if (self.label_keys is None or key in self.label_keys)
                                 and self.sources.reads_namespace(key)})

    @property
    def carried_label_keys(self) -> tuple[str, ...]:
        """The keys share rows carry labels of, sorted; () when every label is carried."""
        return () if self.label_keys is None else tuple(sorted(self.label_keys))

    def kept_annotations(self, annotations: Mapping[str, str]) -> Mapping[str, str]:
        if self.annotation_keys is None:
            return MappingProxyType(dict(annotations))
        return MappingProxyType({k: v for k, v in annotations.items() if k in self.annotation_keys})


ALL_FIELDS = PodFields()


def trim_pod_event(event: PodEvent, fields: PodFields) -> PodEvent:
    """``event`` with only the labels and annotations ``fields`` keeps (what the index would read of it); the cut
    is added to the event's ``labels_dropped``/``annotations_dropped``. The index builds the same ``PodInfo`` from
    the trimmed event as from the whole one."""
    labels = event.labels if fields.label_keys is None else {
        k: v for k, v in event.labels.items() if k in fields.label_keys}
    annotations = fields.kept_annotations(event.annotations)
    namespace_labels = fields.kept_namespace_labels(event.namespace_labels)
    dropped_labels = len(event.labels) - len(labels)
    dropped_annotations = len(event.annotations) - len(annotations)
    if not dropped_labels and not dropped_annotations and len(namespace_labels) == len(event.namespace_labels):
        return event
    # Namespace labels left out are not counted: the counts say what of the pod's own was cut.
    return replace(event, labels=MappingProxyType(dict(labels)), annotations=annotations,
                   labels_dropped=event.labels_dropped + dropped_labels,
                   annotations_dropped=event.annotations_dropped + dropped_annotations,
                   namespace_labels=namespace_labels)


@dataclass(frozen=True, slots=True)
class PodDeviceAssignment:
    """One device id one container of the pod was given. ``base_id`` is the id without ``::N``; ``owning_claim``
    the DRA claim that holds the device alone (None: a device-plugin device, or one shared across claims)."""

    container_name: str
    resource_name: str
    device_id: str
    base_id: str
    owning_claim: str | None = None


@dataclass(frozen=True, slots=True)
class PodInfo:
    """What attribution needs to know about one pod."""

    uid: str
    cluster: str
    node_name: str
    namespace: str
    name: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    workload_kind: str | None
    workload_name: str | None
    phase: str
    started_at_unix_ms: int | None
    ended_at_unix_ms: int | None
    deleted_at_unix_ms: int | None
    observed_at_unix_ms: int
    resource_version: str
    gpu_requests: Mapping[str, int]
    assignments: tuple[PodDeviceAssignment, ...]
    carried_label_keys: tuple[str, ...] = ()  # the keys ``labels`` was selected from; (): all of the pod's
    # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE its containers' specs set (the largest; None: none sets it).
    mps_active_thread_percentage: float | None = None
    # The pod's effective CPU and memory requests (PodEvent v2): what billing's ``requests`` sharing weighs.
    cpu_request_millicores: int = 0
    memory_request_bytes: int = 0

    @property
    def life_start_ms(self) -> int:
        return self.started_at_unix_ms if self.started_at_unix_ms is not None else -_FOREVER

    @property
    def life_end_ms(self) -> int:
        return self.ended_at_unix_ms if self.ended_at_unix_ms is not None else _FOREVER

    def alive_at(self, t_unix_ms: int) -> bool:
        """Whether the pod held its devices at ``t_unix_ms``: started_at <= t < ended_at."""
        return self.life_start_ms <= t_unix_ms < self.life_end_ms

    def overlaps(self, start_unix_ms: int, end_unix_ms: int) -> bool:
        return self.life_start_ms < end_unix_ms and start_unix_ms < self.life_end_ms

    def assignment_for(self, base_ids: Iterable[str]) -> UnitAssignment | None:
        """The pod's claim on the unit named by ``base_ids``, or None when it holds none of them."""
        wanted = set(base_ids)
        resources: list[str] = []
        ids: list[str] = []
        claims: list[str | None] = []
        for a in self.assignments:
            if a.base_id in wanted:
                ids.append(a.device_id)
                claims.append(a.owning_claim)
                if a.resource_name not in resources:
                    resources.append(a.resource_name)
        if not ids:
            return None
        return UnitAssignment(self.uid, tuple(resources), tuple(ids), tuple(claims))


def _pod_info(event: PodEvent, previous: PodInfo | None, fields: PodFields = ALL_FIELDS) -> PodInfo:
    # The fold's rules are the schema package's (schemas.pods), shared with the guard.
    ended, deleted = fold_life(previous.ended_at_unix_ms if previous is not None else None,
                               previous.deleted_at_unix_ms if previous is not None else None, event)
    folded = fold_assignments(
        (PodAssignment(a.container_name, a.resource_name, a.device_id, a.owning_claim) for a in previous.assignments)
        if previous is not None else (), event)
    assignments = [PodDeviceAssignment(a.container_name, a.resource_name, a.device_id, base_device_id(a.device_id),
                                       a.owning_claim)
                   for a in folded]
    started = fold_started(previous.started_at_unix_ms if previous is not None else None, event)
    return PodInfo(
        uid=event.uid,
        cluster=event.cluster,
        node_name=event.node_name,
        namespace=event.namespace,
        name=event.name,
        labels=fields.carried_labels(event.labels, event.namespace_labels),
        carried_label_keys=fields.carried_label_keys,
        mps_active_thread_percentage=max(
            (c.mps_active_thread_percentage for c in event.containers if c.mps_active_thread_percentage is not None),
            default=None),
        annotations=fields.kept_annotations(event.annotations),
        workload_kind=event.workload_kind,
        workload_name=event.workload_name,
        phase=event.phase,
        started_at_unix_ms=started,
        ended_at_unix_ms=ended,
        deleted_at_unix_ms=deleted,
        observed_at_unix_ms=event.observed_at_unix_ms,
        resource_version=event.resource_version,
        gpu_requests=MappingProxyType(dict(event.gpu_requests)),
        assignments=tuple(assignments),
        cpu_request_millicores=event.cpu_request_millicores,
        memory_request_bytes=event.memory_request_bytes,
    )


class PodLookup:
    """The lookups of a pod index, by uid and by device id (``PodIndex`` and ``LivePodIndex``)."""

    __slots__ = ()
    _pods: Mapping[str, PodInfo]
    _by_device: Mapping[str, tuple[str, ...]]  # base device id -> uids holding it, sorted
    # Changes whenever the pods or their devices' holders change (``LivePodIndex``); None where not counted
    generation: int | None = None

    def __len__(self) -> int:
        return len(self._pods)

    def __contains__(self, uid: object) -> bool:
        return uid in self._pods

    @property
    def uids(self) -> tuple[str, ...]:
        return tuple(sorted(self._pods))

    def pod(self, uid: str) -> PodInfo | None:
        """The pod with this uid, or None (never seen, or pruned after its linger)."""
        return self._pods.get(uid)

    def pods_for_device(self, device_id: str) -> tuple[PodInfo, ...]:
        """Pods holding ``device_id`` or any replica of it (``GPU-x::3`` and ``GPU-x`` both find every holder of
        ``GPU-x``), sorted by uid; deleted pods within their linger included."""
        base = base_device_id(device_id)
        return tuple(self._pods[uid] for uid in self._by_device.get(base, ()))

    def assignments_for(self, base_ids: Iterable[str]) -> tuple[tuple[PodInfo, UnitAssignment], ...]:
        """Every pod holding an id that names the unit named by ``base_ids``, with its claim, sorted by uid."""
        base_ids = tuple(base_ids)
        uids: set[str] = set()
        for base in base_ids:
            uids.update(self._by_device.get(base, ()))
        result = []
        for uid in sorted(uids):
            info = self._pods[uid]
            claim = info.assignment_for(base_ids)
            if claim is not None:
                result.append((info, claim))
        return tuple(result)


@dataclass(frozen=True, slots=True)
class PodIndex(PodLookup):
    """An immutable snapshot of the pods known, with lookups by uid and by device id.

    Build with ``PodIndex.empty(linger_ms)`` and ``apply_pod_event``. Never mutate: every change returns a new one.
    """

    linger_ms: int = DEFAULT_LINGER_MS
    clock_unix_ms: int = -_FOREVER
    _pods: Mapping[str, PodInfo] = field(default_factory=lambda: _EMPTY)
    _by_device: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: _EMPTY)
    _next_expiry_ms: int = _FOREVER
    fields: PodFields = ALL_FIELDS

    def __post_init__(self) -> None:
        if self.linger_ms < 0:
            raise ConfigError(f"pod linger must be >= 0 ms, got {self.linger_ms}")

    @classmethod
    def empty(cls, linger_ms: int = DEFAULT_LINGER_MS, fields: PodFields = ALL_FIELDS) -> "PodIndex":
        return cls(linger_ms=linger_ms, fields=fields)


def apply_pod_event(index: PodIndex, event: PodEvent) -> PodIndex:
    """The index after ``event``. Pure; ``index`` is unchanged. Stale and duplicate events return ``index``."""
    previous = index._pods.get(event.uid)
    if previous is not None and is_stale(previous.observed_at_unix_ms, previous.resource_version,
                                         previous.deleted_at_unix_ms is not None, event):
        if event.observed_at_unix_ms < previous.observed_at_unix_ms:
            return _advance_clock(index, event.observed_at_unix_ms)
        return index
    info = _pod_info(event, previous, index.fields)
    pods = dict(index._pods)
    pods[event.uid] = info
    by_device = index._by_device
    old_bases = {a.base_id for a in previous.assignments} if previous is not None else set()
    new_bases = {a.base_id for a in info.assignments}
    if old_bases != new_bases:
        by_device = dict(by_device)
        for base in old_bases - new_bases:
            remaining = tuple(u for u in by_device.get(base, ()) if u != event.uid)
            if remaining:
                by_device[base] = remaining
            else:
                by_device.pop(base, None)
        for base in new_bases - old_bases:
            by_device[base] = tuple(sorted(set(by_device.get(base, ())) | {event.uid}))
        by_device = MappingProxyType(by_device)
    next_expiry = index._next_expiry_ms
    if info.deleted_at_unix_ms is not None:
        next_expiry = min(next_expiry, info.deleted_at_unix_ms + index.linger_ms)
    updated = PodIndex(
        linger_ms=index.linger_ms,
        clock_unix_ms=max(index.clock_unix_ms, event.observed_at_unix_ms),
        _pods=MappingProxyType(pods),
        _by_device=by_device,
        _next_expiry_ms=next_expiry,
        fields=index.fields,
    )
    return _prune(updated, updated.clock_unix_ms)


def apply_pod_events(index: PodIndex, events: Iterable[PodEvent]) -> PodIndex:
    """``apply_pod_event`` over ``events`` in order."""
    for event in events:
        index = apply_pod_event(index, event)
    return index


def prune_pod_index(index: PodIndex, now_unix_ms: int) -> PodIndex:
    """Move the index's clock to ``now_unix_ms`` (never back) and drop pods deleted longer than linger ago."""
    return _prune(_advance_clock(index, now_unix_ms), max(index.clock_unix_ms, now_unix_ms))


def _advance_clock(index: PodIndex, now_unix_ms: int) -> PodIndex:
    if now_unix_ms <= index.clock_unix_ms:
        return index
    return _prune(
        PodIndex(index.linger_ms, now_unix_ms, index._pods, index._by_device, index._next_expiry_ms, index.fields),
        now_unix_ms
    )


def _prune(index: PodIndex, now_unix_ms: int) -> PodIndex:
    # A pod deleted at d is kept while now < d + linger: the boundary is exclusive so linger 0 drops at once.
    if now_unix_ms < index._next_expiry_ms:
        return index
    pods: dict[str, PodInfo] = {}
    dropped: list[PodInfo] = []
    next_expiry = _FOREVER
    for uid, info in index._pods.items():
        deleted = info.deleted_at_unix_ms
        if deleted is not None:
            expiry = deleted + index.linger_ms
            if now_unix_ms >= expiry:
                dropped.append(info)
                continue
            next_expiry = min(next_expiry, expiry)
        pods[uid] = info
    by_device = dict(index._by_device)
    for info in dropped:
        for base in {a.base_id for a in info.assignments}:
            remaining = tuple(u for u in by_device.get(base, ()) if u != info.uid)
            if remaining:
                by_device[base] = remaining
            else:
                by_device.pop(base, None)
    return PodIndex(
        linger_ms=index.linger_ms,
        clock_unix_ms=max(index.clock_unix_ms, now_unix_ms),
        _pods=MappingProxyType(pods),
        _by_device=MappingProxyType(by_device),
        _next_expiry_ms=next_expiry,
        fields=index.fields,
    )


class PodChange(NamedTuple):
    """What ``LivePodIndex.apply`` did: ``changed`` is False for a stale or repeated event (as ``apply_pod_event``
    returning its input); ``pruned`` are the uids the event's clock dropped (deleted longer than the linger ago),
    sorted. (A new pod deleted before the clock minus linger is dropped on arrival; it is then the only one: an
    event that moves the clock cannot also carry a deletion older than its own time.)"""

    changed: bool
    pruned: tuple[str, ...]


class LivePodIndex(PodLookup):
    """A mutable pod index with ``apply_pod_event``'s rules, changed in place: O(1) amortised per event, where
    ``apply_pod_event`` copies every pod (loading n pods: O(n) instead of O(n²)).

    After any sequence of events, ``snapshot()`` equals what ``apply_pod_events(PodIndex.empty(linger_ms, fields),
    events)`` gives (same pods, device map, clock and next expiry). Its lookups read the current state: use them
    within one synchronous step (attributing a window against the pods of the moment) and keep ``snapshot()``,
    never this object, where the pods must not change afterwards. Not thread-safe: one owner.

    ``generation`` changes whenever a pod or a device's holders change (an event applied, a pod pruned): what was
    looked up under one generation holds until it changes.
    """

    __slots__ = ("linger_ms", "fields", "clock_unix_ms", "generation", "_pods", "_by_device", "_expiries",
                 "_snapshot", "_holders", "_holders_generation")

    def __init__(self, linger_ms: int = DEFAULT_LINGER_MS, fields: PodFields = ALL_FIELDS) -> None:
        if linger_ms < 0:
            raise ConfigError(f"pod linger must be >= 0 ms, got {linger_ms}")
        self.linger_ms = linger_ms
        self.fields = fields
        self.clock_unix_ms = -_FOREVER
        self.generation = 0
        self._pods: dict[str, PodInfo] = {}
        self._by_device: dict[str, tuple[str, ...]] = {}
        # (deleted_at + linger, uid) of every deleted pod, plus stale entries (pod since pruned, or its deletion
        # time lowered by a later event) that are skipped when they come up.
        self._expiries: list[tuple[int, str]] = []
        self._snapshot: PodIndex | None = None
        # ``assignments_for``'s answers under ``_holders_generation`` (a unit is looked up again by each window
        # that takes its ticks in, and at each close): emptied when the generation moves
        self._holders: dict[tuple[str, ...], tuple[tuple[PodInfo, UnitAssignment], ...]] = {}
        self._holders_generation = 0

    def assignments_for(self, base_ids: Iterable[str]) -> tuple[tuple[PodInfo, UnitAssignment], ...]:
        """``PodLookup.assignments_for``, remembered until the generation moves (every change of a pod or of a
        device's holders moves it, and nothing else changes the answer): the same tuple, of the same objects."""
        key = tuple(base_ids)
        holders = self._holders
        if self._holders_generation != self.generation:
            holders.clear()
            self._holders_generation = self.generation
        found = holders.get(key)
        if found is None:
            if len(holders) >= _HOLDERS_MAX:
                holders.clear()
            found = holders[key] = PodLookup.assignments_for(self, key)
        return found

    def apply(self, event: PodEvent) -> PodChange:
        """Apply ``event`` as ``apply_pod_event`` would (stale and duplicate events change nothing)."""
        uid = event.uid
        previous = self._pods.get(uid)
        if previous is not None and is_stale(previous.observed_at_unix_ms, previous.resource_version,
                                             previous.deleted_at_unix_ms is not None, event):
            if event.observed_at_unix_ms < previous.observed_at_unix_ms:
                return self._advance_clock(event.observed_at_unix_ms)
            return PodChange(False, ())
        self._snapshot = None
        self.generation += 1
        info = _pod_info(event, previous, self.fields)
        self._pods[uid] = info
        old_bases = {a.base_id for a in previous.assignments} if previous is not None else set()
        new_bases = {a.base_id for a in info.assignments}
        if old_bases != new_bases:
            by_device = self._by_device
            for base in old_bases - new_bases:
                self._remove_holder(base, uid)
            for base in new_bases - old_bases:
                by_device[base] = tuple(sorted(set(by_device.get(base, ())) | {uid}))
        deleted = info.deleted_at_unix_ms
        if deleted is not None and (previous is None or previous.deleted_at_unix_ms != deleted):
            heapq.heappush(self._expiries, (deleted + self.linger_ms, uid))
        self.clock_unix_ms = max(self.clock_unix_ms, event.observed_at_unix_ms)
        return PodChange(True, tuple(sorted(self._prune())))

    def snapshot(self) -> PodIndex:
        """The current state as an immutable ``PodIndex`` (copied once per change, then shared)."""
        if self._snapshot is None:
            self._snapshot = PodIndex(
                linger_ms=self.linger_ms,
                clock_unix_ms=self.clock_unix_ms,
                _pods=MappingProxyType(dict(self._pods)),
                _by_device=MappingProxyType(dict(self._by_device)),
                _next_expiry_ms=self._next_expiry(),
                fields=self.fields,
            )
        return self._snapshot

    def _advance_clock(self, now_unix_ms: int) -> PodChange:
        if now_unix_ms <= self.clock_unix_ms:
            return PodChange(False, ())
        self._snapshot = None
        self.clock_unix_ms = now_unix_ms
        return PodChange(True, tuple(sorted(self._prune())))

    def _prune(self) -> list[str]:
        # A pod deleted at d is kept while clock < d + linger, as ``_prune``.
        heap = self._expiries
        now = self.clock_unix_ms
        dropped: list[str] = []
        while heap and heap[0][0] <= now:
            expiry, uid = heapq.heappop(heap)
            if not self._is_current(expiry, uid):
                continue
            info = self._pods.pop(uid)
            for base in {a.base_id for a in info.assignments}:
                self._remove_holder(base, uid)
            dropped.append(uid)
        if dropped:
            self.generation += 1
        return dropped

    def _next_expiry(self) -> int:
        heap = self._expiries
        while heap and not self._is_current(*heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else _FOREVER

    def _is_current(self, expiry: int, uid: str) -> bool:
        info = self._pods.get(uid)
        return (
            info is not None
            and info.deleted_at_unix_ms is not None
            and info.deleted_at_unix_ms + self.linger_ms == expiry
        )

    def _remove_holder(self, base: str, uid: str) -> None:
        remaining = tuple(u for u in self._by_device.get(base, ()) if u != uid)
        if remaining:
            self._by_device[base] = remaining
        else:
            self._by_device.pop(base, None)
