"""Per-pod shares of each GPU unit over one window: the attribution math.

Pure: no Kafka, no Faust, no clock. ``attribute_node_window(window, pods, policy)`` is what the streaming path and
the replay call; ``attribute_unit`` does one GPU or MIG instance. The math, its reasons and its expected error are
in ``docs/attribution.md``; the contract in short:

* A unit is a whole GPU, one MIG instance, or the capacity of a MIG-enabled GPU that lies in no instance (under
  the parent's uuid, all idle).
* For each unit and window there is one row per pod (pods whose processes ran on the unit, and pods holding a
  device id that names it) plus the four buckets IDLE, DRIVER_RESERVED, UNATTRIBUTED and UNAVAILABLE, always all
  four.
* The sharing mode and the owner of a unit are decided per tick (per epoch of ticks with the same alive holders),
  and each epoch is costed by its own decision; ticks where the unit was lost or unreadable are UNAVAILABLE.
* Invariant: over a unit's rows, ``memory_share``, ``compute_share`` and ``cost_share`` each add up to 1 within
  1e-9, for any input: values out of range are clamped, missing data moves weight to UNATTRIBUTED, never away.
"""

from __future__ import annotations

import enum
import math
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from gpumeter.errors import ConfigError
from schemas.packed import COLUMNS, MISSING_I4, SHARING_MODE_CODES, PackedNodeSample
from schemas.records import (
    GpuDeviceSample,
    GpuShare,
    NodeSample,
    NodeWindowBuilder,
    NodeWindowShares,
    SharingMode,
    ShareSubjectKind,
)

from services.attributor.modes import (
    ModeDecision,
    UnitAssignment,
    UnitKind,
    decide_mode,
    device_keys,
    majority_of,
    majority_sample_mode,
)
from services.attributor.pod_index import PodInfo, PodLookup
from services.attributor.windows import NodeWindow

METHOD_EXCLUSIVE = "exclusive"
METHOD_PER_PROCESS_SM = "per_process_sm"
METHOD_MEMORY_PROXY = "memory_proxy"
METHOD_MPS_MEMORY = "mps_memory"
METHOD_MPS_THREADS = "mps_threads"
METHOD_MIG_INSTANCE = "mig_instance"
METHOD_REQUEST = "request"

DEFAULT_MPS_THREAD_ANNOTATION = "gpumeter.io/mps-active-thread-percentage"
_EMPTY_LABELS: Mapping[str, str] = MappingProxyType({})
# Every unit has one row per bucket, in this order, after its pod rows.
BUCKET_KINDS = (
    ShareSubjectKind.IDLE,
    ShareSubjectKind.DRIVER_RESERVED,
    ShareSubjectKind.UNATTRIBUTED,
    ShareSubjectKind.UNAVAILABLE,
)
_BUCKETS = len(BUCKET_KINDS)
_UNAVAILABLE = BUCKET_KINDS.index(ShareSubjectKind.UNAVAILABLE)


class CostBasis(enum.StrEnum):
    MEMORY = "memory"
    COMPUTE = "compute"
    BLEND = "blend"
    REQUEST = "request"


class MpsCompute(enum.StrEnum):
    MEMORY = "memory"
    THREADS = "threads"


@dataclass(frozen=True, slots=True)
class AttributionPolicy:
    """How shares become cost.

    ``cost_basis``: MEMORY (cost = memory_share, the default), COMPUTE (cost = compute_share), BLEND
    (cost = blend_alpha * compute_share + (1 - blend_alpha) * memory_share) or REQUEST (the OpenCost way, for
    comparison: each pod pays the replicas it was assigned, unassigned replicas are idle).
    IDLE is always a row of its own: sharing it (or any bucket) to pods is billing's sharing policy
    (``services.billing.sharing``), applied to money, once, where the ledger and every report see it.
    ``mps_compute``: MEMORY (busy time split by memory) or THREADS (by active-thread percentage: the
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` its container spec sets, which the MPS server enforces, else its replicas'
    100/replicas each). ``mps_thread_annotation``: a pod annotation whose value is taken before both -- only when
    the platform names one (an annotation its admission webhook writes): empty (the default), no annotation is
    read, because a pod's owner writes its annotations and one nothing enforces would let a tenant lower its own
    share of an MPS GPU.
    """

    cost_basis: CostBasis = CostBasis.MEMORY
    blend_alpha: float = 0.5
    mps_compute: MpsCompute = MpsCompute.MEMORY
    mps_thread_annotation: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.cost_basis, CostBasis):
            raise ConfigError(f"cost basis {self.cost_basis!r} is not a CostBasis")
        if not isinstance(self.mps_compute, MpsCompute):
            raise ConfigError(f"MPS compute {self.mps_compute!r} is not an MpsCompute")
        alpha = self.blend_alpha
        if not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0 or alpha != alpha:
            raise ConfigError(f"blend alpha must be within [0, 1], got {alpha!r}")

    @classmethod
    def parse(cls, cost_basis: str = "memory", mps_compute: str = "memory",
              mps_thread_annotation: str = "") -> "AttributionPolicy":
        """From configuration strings: ``memory`` | ``compute`` | ``blend:<alpha>`` | ``request``; ``memory`` |
        ``threads``; an annotation key or empty. Raises ConfigError on anything else."""
        text = cost_basis.strip().lower()
        alpha = 0.5
        if text.startswith("blend:"):
            raw = text[len("blend:") :]
            try:
                alpha = float(raw)
            except ValueError:
                raise ConfigError(f"blend alpha {raw!r} is not a number") from None
            text = "blend"
        try:
            basis = CostBasis(text)
        except ValueError:
            raise ConfigError(
                f"cost basis {cost_basis!r} is not one of memory, compute, blend:<alpha>, request"
            ) from None
        try:
            mps = MpsCompute(mps_compute.strip().lower())
        except ValueError:
            raise ConfigError(f"MPS compute {mps_compute!r} is not one of memory, threads") from None
        return cls(basis, alpha, mps, mps_thread_annotation.strip())

    @property
    def basis_text(self) -> str:
        """``memory``, ``compute``, ``blend:0.3`` or ``request``: what ``GpuShare.cost_basis`` says."""
        return f"blend:{self.blend_alpha:g}" if self.cost_basis is CostBasis.BLEND else str(self.cost_basis)

    def describe(self) -> str:
        return f"cost={self.basis_text} mps={self.mps_compute}"


class UnitTick(NamedTuple):
    """One unit in one tick.

    ``capacity_fraction`` is the fraction of the physical GPU the unit stood for in this tick (1 for a whole GPU,
    slices/total for a MIG instance, the slices in no instance for MIG_UNASSIGNED). ``all_idle`` marks a tick of
    capacity no pod can use (a MIG-enabled GPU outside its instances); ``unassigned_memory_bytes`` is that
    capacity's memory. ``pod_uids`` is the tick's ``NodeSample.pod_uids`` (``process_pod_index`` points into it).
    """

    sampled_at_unix_ms: int
    interval_ms: int
    capacity_fraction: float
    pod_uids: tuple[str, ...]
    device: GpuDeviceSample
    all_idle: bool = False
    unassigned_memory_bytes: int = 0


@dataclass(frozen=True, slots=True)
class UnitWindow:
    """One unit's ticks in one window, in time order."""

    cluster: str
    node_name: str
    window_start_unix_ms: int
    window_seconds: int
    unit_uuid: str
    parent_uuid: str | None
    kind: UnitKind
    model: str
    ticks: tuple[UnitTick, ...]

    def __post_init__(self) -> None:
        if not self.ticks:
            raise ValueError(f"unit window {self.unit_uuid} has no ticks: a unit exists only where it was sampled")


class ShareRow(NamedTuple):
    """One subject's share of one unit in one window: the ``GpuShare`` fields that do not depend on the node. (A
    NamedTuple, not a frozen dataclass: a close makes one per row, and a frozen dataclass costs a ``__setattr__``
    per field to build.)"""

    gpu_uuid: str
    parent_gpu_uuid: str | None
    gpu_model: str
    gpu_fraction: float
    sharing_mode: SharingMode
    subject_kind: ShareSubjectKind
    pod_uid: str | None
    namespace: str | None
    pod_name: str | None
    labels: Mapping[str, str]
    workload_kind: str | None
    workload_name: str | None
    memory_used_bytes_avg: float
    memory_share: float
    compute_share: float
    cost_share: float
    method: str
    sample_count: int
    covered_seconds: float
    carried_label_keys: tuple[str, ...] = ()
    cpu_request_millicores: int = 0
    memory_request_bytes: int = 0


@dataclass(frozen=True, slots=True)
class DataQuality:
    """What the unit's input needed: ticks (of ``sample_count``) where data was missing, clamped or rescaled."""

    ticks_zero_weight: int = 0
    ticks_memory_invalid: int = 0  # no usable memory info: the tick does not count for memory shares
    ticks_memory_clamped: int = 0  # reserved or used outside [0, total]: clamped
    ticks_process_memory_scaled: int = 0  # processes held more than used: scaled down to used
    ticks_compute_unknown: int = 0  # no device or per-process utilization: the tick does not count for compute
    ticks_utilization_clamped: int = 0  # utilization outside [0, 100]: clamped
    ticks_busy_unexplained: int = 0  # busy with no process seen: busy time went to UNATTRIBUTED
    ticks_unavailable: int = 0  # the unit was lost or unreadable: memory, compute and cost went to UNAVAILABLE


@dataclass(frozen=True, slots=True)
class EpochDecision:
    """How the unit was shared during part of the window (the ticks with the same holders alive), and the
    fraction of the unit's weight those ticks carry."""

    decision: ModeDecision
    weight_fraction: float


@dataclass(frozen=True, slots=True)
class UnitAttribution:
    """Everything ``attribute_unit`` worked out for one unit; ``rows`` are its share rows."""

    unit_uuid: str
    parent_uuid: str | None
    kind: UnitKind
    decision: ModeDecision
    method: str
    gpu_fraction: float
    sample_count: int
    covered_seconds: float
    memory_covered_seconds: float
    compute_covered_seconds: float
    quality: DataQuality
    rows: tuple[ShareRow, ...]
    decisions: tuple[EpochDecision, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeAttribution:
    """``attribute_node_window_detailed``'s result: the GpuShare rows plus per-unit decisions for logs/metrics."""

    shares: tuple[GpuShare, ...]
    units: tuple[UnitAttribution, ...]
    node_covered_seconds: float


# --------------------------------------------------------------------------------------------------------------
# Splitting a node window into units


def _instance_fraction(instance: GpuDeviceSample, parent: GpuDeviceSample | None) -> float:
    slices, total = instance.mig_compute_slices, instance.mig_total_compute_slices
    if total <= 0 and parent is not None:
        total = parent.mig_total_compute_slices  # an instance may leave the GPU's slice count to its parent
    if total > 0 and slices > 0:
        return min(slices / total, 1.0)
    if parent is not None and parent.memory_total_bytes > 0 and instance.memory_total_bytes >= 0:
        # No slice counts: the memory fraction is the closest thing NVML gives.
        return min(instance.memory_total_bytes / parent.memory_total_bytes, 1.0)
    return 0.0


def _fraction_in_instances(children: Sequence[GpuDeviceSample], parent: GpuDeviceSample) -> float:
    totals = {c.mig_total_compute_slices or parent.mig_total_compute_slices for c in children}
    if len(totals) == 1:
        total = totals.pop()
        if total > 0 and all(c.mig_compute_slices > 0 for c in children):
            # Whole slices: exact, so a fully partitioned GPU leaves exactly 0, not a float crumb.
            return min(sum(c.mig_compute_slices for c in children), total) / total
    fraction = sum(_instance_fraction(c, parent) for c in children)
    return 1.0 if fraction > 1.0 - 1e-9 else fraction


def split_units(window: NodeWindow) -> tuple[UnitWindow, ...]:
    """The window's units with their ticks, sorted by (physical GPU uuid, the GPU's own unit first, uuid).

    A device is a MIG instance when it has ``parent_uuid``; a device without one is a MIG-enabled parent when it
    reports ``sharing_mode`` MIG or an instance in the same tick names it, and then only its capacity outside the
    instances is a unit (all idle). A uuid listed twice in one tick counts once.
    """
    ticks_by_unit: dict[str, list[UnitTick]] = {}
    meta: dict[str, list] = {}  # uuid -> [parent_uuid, kind, model]
    for sample in window.samples:
        _split_sample(sample, ticks_by_unit, meta)
    units = []
    for uuid, ticks in ticks_by_unit.items():
        parent_uuid, kind, model = meta[uuid]
        units.append(
            UnitWindow(
                window.cluster,
                window.node_name,
                window.window_start_unix_ms,
                window.window_seconds,
                uuid,
                parent_uuid,
                kind,
                model,
                tuple(ticks),
            )
        )
    units.sort(key=lambda u: (u.parent_uuid or u.unit_uuid, u.parent_uuid is not None, u.unit_uuid))
    return tuple(units)


def _split_sample(sample: NodeSample, ticks_by_unit: dict[str, list[UnitTick]], meta: dict[str, list]) -> None:
    devices = sample.devices
    t = sample.sampled_at_unix_ms
    interval = sample.interval_ms
    pod_uids = sample.pod_uids
    instances: dict[str, list[GpuDeviceSample]] | None = None
    for dev in devices:
        if dev.parent_uuid is not None:
            if instances is None:
                instances = {}
            instances.setdefault(dev.parent_uuid, []).append(dev)
    seen: set[str] = set()
    parents: dict[str, GpuDeviceSample] = {}
    if instances is not None:
        parents = {d.uuid: d for d in devices if d.parent_uuid is None}
    for dev in devices:
        uuid = dev.uuid
        if uuid in seen:
            continue
        seen.add(uuid)
        if dev.parent_uuid is not None:
            parent = parents.get(dev.parent_uuid)
            tick = UnitTick(t, interval, _instance_fraction(dev, parent), pod_uids, dev)
            kind = UnitKind.MIG_INSTANCE
            model = parent.model if parent is not None else dev.model
        elif dev.sharing_mode is SharingMode.MIG or (instances is not None and uuid in instances):
            children = instances.get(uuid, ()) if instances is not None else ()
            in_instances = _fraction_in_instances(children, dev)
            unassigned_memory = max(dev.memory_total_bytes - sum(max(c.memory_total_bytes, 0) for c in children), 0)
            tick = UnitTick(t, interval, max(1.0 - in_instances, 0.0), pod_uids, dev, True, unassigned_memory)
            kind = UnitKind.MIG_UNASSIGNED
            model = dev.model
        else:
            tick = UnitTick(t, interval, 1.0, pod_uids, dev)
            kind = UnitKind.GPU
            model = dev.model
        ticks = ticks_by_unit.get(uuid)
        if ticks is None:
            ticks_by_unit[uuid] = [tick]
        else:
            ticks.append(tick)
        # ``meta`` may outlive ``ticks_by_unit`` (an open window keeps the one, not the other): it decides alone.
        entry = meta.get(uuid)
        if entry is None:
            meta[uuid] = [dev.parent_uuid, kind, model]
        elif kind is UnitKind.GPU and entry[1] is UnitKind.MIG_UNASSIGNED:
            # A GPU whose MIG mode flipped within the window stays one unit: its MIG ticks are all idle.
            entry[1] = UnitKind.GPU


# --------------------------------------------------------------------------------------------------------------
# Pod slots: one index per pod uid for the whole node window, so each tick maps process -> pod with list lookups.


class _PodSlots:
    __slots__ = ("slot_of", "uids", "maps", "_by_value")

    def __init__(self) -> None:
        self.slot_of: dict[str, int] = {}
        self.uids: list[str] = []
        self.maps: dict[int, list[int]] = {}  # id(pod_uids) -> slot per position
        self._by_value: dict[tuple[str, ...], list[int]] = {}

    def slot(self, uid: str) -> int:
        slot = self.slot_of.get(uid)
        if slot is None:
            slot = self.slot_of[uid] = len(self.uids)
            self.uids.append(uid)
        return slot

    def map_for(self, pod_uids: tuple[str, ...]) -> list[int]:
        # Keyed by identity for the hot lookups (every device of a tick shares its NodeSample's pod_uids tuple,
        # which the ticks keep alive for as long as this object lives), and by value behind that: each tick is
        # decoded into a new tuple, but a node lists the same pods tick after tick, so the window's ticks share
        # one map instead of slotting every uid again per tick.
        key = id(pod_uids)
        found = self.maps.get(key)
        if found is None:
            found = self._by_value.get(pod_uids)
            if found is None:
                found = self._by_value[pod_uids] = [self.slot(uid) for uid in pod_uids]
            self.maps[key] = found
        return found


# --------------------------------------------------------------------------------------------------------------
# One unit


def attribute_unit(unit: UnitWindow, pods: PodLookup, policy: AttributionPolicy) -> tuple[ShareRow, ...]:
    """The unit's share rows: pods sorted by uid, then IDLE, DRIVER_RESERVED, UNATTRIBUTED."""
    return attribute_unit_detailed(unit, pods, policy).rows


def attribute_unit_detailed(unit: UnitWindow, pods: PodLookup, policy: AttributionPolicy) -> UnitAttribution:
    """``attribute_unit`` with the mode decision, method, coverage and data-quality counts."""
    return _attribute(unit, pods, policy, _PodSlots())


def _weights(unit: UnitWindow) -> tuple[list[float], list[int], int]:
    """Per-tick weights (interval clamped to [0, window] times capacity fraction), clamped intervals, and the
    count of zero-interval ticks. All-zero intervals fall back to equal weights so the window still counts."""
    window_ms = unit.window_seconds * 1000
    intervals = [min(max(t.interval_ms, 0), window_ms) for t in unit.ticks]
    zero = intervals.count(0)
    if zero == len(intervals):
        intervals = [1] * len(intervals)
    weights = [i * min(max(t.capacity_fraction, 0.0), 1.0) for i, t in zip(intervals, unit.ticks)]
    return weights, intervals, zero


def _parse_thread_percent(info: PodInfo, annotation: str) -> float | None:
    raw = info.annotations.get(annotation)
    if raw is None:
        return None
    try:
        value = float(raw.strip().rstrip("%"))
    except ValueError:
        return None
    if not 0.0 < value <= 100.0:
        return None
    return value


class _Epoch:
    """The ticks of one unit-window during which the same pods held the unit, and what they added up to.

    A unit's sharing mode and its owner are decided per tick from the pods alive at that tick; ticks with the same
    set of alive holders decide alike, so they are decided once, as one epoch. Memory and compute fractions are
    summed per epoch (weighted by the tick's weight): the unit's shares are the sums over its epochs, and each
    epoch's cost follows its own decision (an owner pays only the ticks it held the unit).
    """

    __slots__ = (
        "holders", "ticks", "weight", "decision", "mode", "occupancy", "mps_threads", "use_per_process",
        "mem_frac", "mem_bytes", "comp", "present", "mem_w", "comp_w", "mem_res", "mem_idle", "mem_unx",
        "bytes_res", "bytes_idle", "bytes_unx", "comp_idle", "comp_unx", "busy_per_process", "busy_proxy",
        "slot_cache", "summed", "mode_weights", "replicas_max", "decided_on",
    )

    def __init__(self, holders: tuple[int, ...], nslots: int) -> None:
        self.holders = holders  # indexes into the unit's assignees alive in these ticks
        self.ticks: list[tuple[UnitTick, float]] = []
        self.weight = 0.0
        self.decision: ModeDecision | None = None
        self.mode = SharingMode.UNKNOWN
        self.occupancy = False
        self.mps_threads = False
        self.use_per_process = False
        # Index -1 (the extra last entry) collects processes of no known pod.
        self.mem_frac = [0.0] * (nslots + 1)
        self.mem_bytes = [0.0] * (nslots + 1)
        self.comp = [0.0] * (nslots + 1)
        self.present: set[int] = set()
        self.mem_w = self.comp_w = 0.0
        self.mem_res = self.mem_idle = self.mem_unx = 0.0
        self.bytes_res = self.bytes_idle = self.bytes_unx = 0.0
        self.comp_idle = self.comp_unx = 0.0
        self.busy_per_process = self.busy_proxy = 0.0
        # (slot map, process_pod_index, their slots) of the last tick summed: the next tick of a node whose pods
        # and processes stayed reuses its slots (``_add_ticks``)
        self.slot_cache: tuple[list[int] | None, tuple[int, ...] | None, list[int]] = (None, None, [])
        self.summed = 0  # how many of ``ticks`` are in the sums (``OpenNodeWindow`` adds them in batches)
        # What ``_decide`` reads of the ticks, summed as they arrive (``OpenNodeWindow``): the weight of each
        # sharing mode the samples report (``majority_sample_mode``) and the largest replicas
        self.mode_weights: dict[SharingMode, float] = {}
        self.replicas_max = 1
        # (sample mode, replicas, claims) ``decision`` was taken on, when it was taken on one tick as it arrived
        self.decided_on: tuple[SharingMode, int, list[UnitAssignment]] | None = None

    def fit(self, nslots: int) -> None:
        """Room for ``nslots`` pod slots: slots the node window's later ticks added, inserted before the last
        entry (the processes of no known pod), which stays last."""
        extra = nslots + 1 - len(self.comp)
        if extra > 0:
            for values in (self.mem_frac, self.mem_bytes, self.comp):
                values[-1:-1] = [0.0] * extra

    def method(self, mps_compute: MpsCompute) -> str:
        if self.occupancy:
            return METHOD_MIG_INSTANCE
        if self.mode is SharingMode.EXCLUSIVE:
            return METHOD_EXCLUSIVE
        if self.mode is SharingMode.MPS:
            return METHOD_MPS_THREADS if mps_compute is MpsCompute.THREADS else METHOD_MPS_MEMORY
        if self.busy_proxy > 0.0 or self.busy_per_process == 0.0:
            return METHOD_MEMORY_PROXY
        return METHOD_PER_PROCESS_SM


class _Quality:
    __slots__ = ("mem_invalid", "mem_clamped", "scaled", "comp_unknown", "util_clamped", "busy_unexplained",
                 "unavailable")

    def __init__(self) -> None:
        self.mem_invalid = self.mem_clamped = self.scaled = self.comp_unknown = 0
        self.util_clamped = self.busy_unexplained = self.unavailable = 0


class _Prepared(NamedTuple):
    """Phase 1 of one unit's attribution (``_prepare``, or ``OpenNodeWindow`` tick by tick): its epochs with
    their sums and decisions, and the unit's weights and holders; ``_finish`` makes the rows from it."""

    epochs: list[_Epoch]
    unavailable_w: float
    quality: _Quality
    total_weight: float
    gpu_fraction: float
    covered_seconds: float
    zero_weight_ticks: int
    assignees: list[tuple[PodInfo, UnitAssignment]]
    assignee_slots: list[int]
    sample_count: int


class _UnitId(NamedTuple):
    """What a unit's rows say of the unit itself."""

    unit_uuid: str
    parent_uuid: str | None
    model: str
    kind: UnitKind


def _attribute(unit: UnitWindow, pods: PodLookup, policy: AttributionPolicy, slots: _PodSlots) -> UnitAttribution:
    return _finish(_UnitId(unit.unit_uuid, unit.parent_uuid, unit.model, unit.kind), pods, policy, slots,
                   _prepare(unit, pods, policy, slots))


def _assignees(pods: PodLookup, keys: tuple[str, ...],
               tick_times: Sequence[int]) -> list[tuple[PodInfo, UnitAssignment]]:
    """Pods holding an id that names the unit (``keys``), alive at one of its ticks (``tick_times``, sorted) at
    least, sorted by uid."""
    return _alive_assignees(pods.assignments_for(keys), tick_times)


def _alive_assignees(assignments: Iterable[tuple[PodInfo, UnitAssignment]],
                     tick_times: Sequence[int]) -> list[tuple[PodInfo, UnitAssignment]]:
    """Of ``assignments``, those alive at one of ``tick_times`` (sorted) at least, in their order."""
    assignees: list[tuple[PodInfo, UnitAssignment]] = []
    for info, claim in assignments:
        # Alive at one tick at least: the first tick at or after its start comes before its end.
        first = bisect_left(tick_times, info.life_start_ms)
        if first < len(tick_times) and tick_times[first] < info.life_end_ms:
            assignees.append((info, claim))
    return assignees


def _unit_keys(unit: UnitWindow) -> tuple[str, ...]:
    """The device ids naming ``unit``, from its first tick that is not all idle (MIG ids can only come from one)."""
    ticks = unit.ticks
    first_device = next((t.device for t in ticks if not t.all_idle), ticks[0].device if ticks else None)
    return device_keys(unit.kind, unit.unit_uuid, unit.parent_uuid, first_device)


def _unit_totals(weights: Sequence[float], intervals: Sequence[int], covered_ms: int,
                 window_ms: int) -> tuple[float, float, float]:
    """A unit's total weight, its capacity fraction and its covered seconds, from its ticks' weights, intervals
    and summed non-negative intervals: the same arithmetic for the close from ticks (``_prepare``) and from sums
    (``_OpenUnit.prepared``). The capacity fraction is the interval-weighted mean (each weight is interval ×
    clamped fraction), taken before any equal-weights fallback."""
    total_weight = sum(weights)
    interval_sum = sum(intervals)
    gpu_fraction = total_weight / interval_sum if interval_sum > 0 else 0.0
    return total_weight, gpu_fraction, min(covered_ms, window_ms) / 1000.0


def _prepare(unit: UnitWindow, pods: PodLookup, policy: AttributionPolicy, slots: _PodSlots) -> _Prepared:
    ticks = unit.ticks
    weights, intervals, zero_weight_ticks = _weights(unit)
    total_weight, gpu_fraction, covered_seconds = _unit_totals(
        weights, intervals, sum(max(t.interval_ms, 0) for t in ticks), unit.window_seconds * 1000)
    if total_weight <= 0.0:
        # Every tick had zero capacity (a fully partitioned MIG GPU's remainder): count ticks equally so the
        # shares are still defined.
        weights = [1.0] * len(ticks)
        total_weight = float(len(ticks))

    tick_times = sorted(t.sampled_at_unix_ms for t in ticks)
    assignees = _assignees(pods, _unit_keys(unit), tick_times)
    assignee_slots = [slots.slot(info.uid) for info, _ in assignees]
    for t in ticks:
        slots.map_for(t.pod_uids)
    nslots = len(slots.uids)

    epochs, unavailable_w, quality = _accumulate(unit, ticks, weights, assignees, assignee_slots, slots, nslots,
                                                 policy)
    return _Prepared(epochs, unavailable_w, quality, total_weight, gpu_fraction, covered_seconds, zero_weight_ticks,
                     assignees, assignee_slots, len(ticks))


def _finish(unit: _UnitId, pods: PodLookup, policy: AttributionPolicy, slots: _PodSlots,
            prepared: _Prepared) -> UnitAttribution:
    """Phase 2 of one unit's attribution: its rows, from its epochs' sums and decisions."""
    epochs, unavailable_w, quality = prepared.epochs, prepared.unavailable_w, prepared.quality
    total_weight, gpu_fraction, covered_seconds = prepared.total_weight, prepared.gpu_fraction, prepared.covered_seconds
    zero_weight_ticks, assignees, assignee_slots = (prepared.zero_weight_ticks, prepared.assignees,
                                                    prepared.assignee_slots)
    main = max(epochs, key=lambda e: e.weight)
    decision = main.decision
    assert decision is not None
    if len(epochs) > 1:
        decision = _combined_decision(epochs, assignees, main)
    mode = main.mode

    # Which pods get rows: those whose processes ran here and those holding the unit.
    present: set[int] = set(assignee_slots)
    for epoch in epochs:
        present |= epoch.present
    present.discard(-1)
    row_slots = sorted(present, key=lambda s: slots.uids[s])
    row_of_slot = {s: i for i, s in enumerate(row_slots)}
    n_rows = len(row_slots)

    # Memory and compute vectors: [pods in row order..., idle, reserved, unattributed, unavailable].
    memory, bytes_avg, compute, available_memory, available_compute = _unit_vectors(
        epochs, unavailable_w, row_slots, n_rows)

    basis = policy.cost_basis
    cost = [0.0] * (n_rows + _BUCKETS)
    for epoch in epochs:
        if epoch.weight <= 0.0:
            continue
        share = epoch.weight / total_weight
        vector = _epoch_cost(epoch, policy, row_slots, row_of_slot, n_rows, assignees, assignee_slots,
                             available_memory, available_compute)
        for i, value in enumerate(vector):
            cost[i] += share * value
    cost[n_rows + _UNAVAILABLE] += unavailable_w / total_weight

    if basis is CostBasis.REQUEST:
        method = METHOD_REQUEST
    else:
        method = main.method(policy.mps_compute)

    rows = []
    sample_count = prepared.sample_count
    uuid, parent, model = unit.unit_uuid, unit.parent_uuid, unit.model
    for i, slot in enumerate(row_slots):
        uid = slots.uids[slot]
        info = pods.pod(uid)
        rows.append(
            ShareRow(
                uuid,
                parent,
                model,
                gpu_fraction,
                mode,
                ShareSubjectKind.POD,
                uid,
                info.namespace if info is not None else None,
                info.name if info is not None else None,
                info.labels if info is not None else _EMPTY_LABELS,
                info.workload_kind if info is not None else None,
                info.workload_name if info is not None else None,
                bytes_avg[i],
                memory[i],
                compute[i],
                cost[i],
                method,
                sample_count,
                covered_seconds,
                info.carried_label_keys if info is not None else (),
                info.cpu_request_millicores if info is not None else 0,
                info.memory_request_bytes if info is not None else 0,
            )
        )
    for j, kind in enumerate(BUCKET_KINDS):
        i = n_rows + j
        rows.append(
            ShareRow(
                uuid,
                parent,
                model,
                gpu_fraction,
                mode,
                kind,
                None,
                None,
                None,
                _EMPTY_LABELS,
                None,
                None,
                bytes_avg[i],
                memory[i],
                compute[i],
                cost[i],
                method,
                sample_count,
                covered_seconds,
            )
        )
    mem_w = sum(e.mem_w for e in epochs) + unavailable_w
    comp_w = sum(e.comp_w for e in epochs) + unavailable_w
    scale = covered_seconds / total_weight if total_weight else 0.0
    return UnitAttribution(
        unit_uuid=uuid,
        parent_uuid=parent,
        kind=unit.kind,
        decision=decision,
        method=method,
        gpu_fraction=gpu_fraction,
        sample_count=sample_count,
        covered_seconds=covered_seconds,
        memory_covered_seconds=min(mem_w * scale, covered_seconds),
        compute_covered_seconds=min(comp_w * scale, covered_seconds),
        quality=DataQuality(
            ticks_zero_weight=zero_weight_ticks,
            ticks_memory_invalid=quality.mem_invalid,
            ticks_memory_clamped=quality.mem_clamped,
            ticks_process_memory_scaled=quality.scaled,
            ticks_compute_unknown=quality.comp_unknown,
            ticks_utilization_clamped=quality.util_clamped,
            ticks_busy_unexplained=quality.busy_unexplained,
            ticks_unavailable=quality.unavailable,
        ),
        rows=tuple(rows),
        decisions=tuple(
            EpochDecision(e.decision, e.weight / total_weight) for e in epochs if e.decision is not None
        ),
    )


def _accumulate(
    unit: UnitWindow,
    ticks: Sequence[UnitTick],
    weights: Sequence[float],
    assignees: Sequence[tuple[PodInfo, UnitAssignment]],
    assignee_slots: Sequence[int],
    slots: _PodSlots,
    nslots: int,
    policy: AttributionPolicy,
) -> tuple[list[_Epoch], float, _Quality]:
    """Phase 1: group the unit's ticks into epochs (same alive holders), decide each epoch's mode, and sum each
    tick's memory and compute fractions into its epoch. Ticks in which the unit was lost or unreadable go to the
    returned unavailable weight instead."""
    quality = _Quality()
    epochs: dict[tuple[int, ...], _Epoch] = {}
    unavailable_w = 0.0
    # The alive holders change only where a holder's life starts or ends: between two such times they are the
    # same for every tick, so they are worked out once per stretch.
    cuts = sorted({edge for info, _claim in assignees for edge in (info.life_start_ms, info.life_end_ms)})
    holders_in: dict[int, tuple[int, ...]] = {}
    for tick, w in zip(ticks, weights):
        if w <= 0.0:
            continue
        if tick.device.unavailable:
            unavailable_w += w
            quality.unavailable += 1
            continue
        t = tick.sampled_at_unix_ms
        stretch = bisect_right(cuts, t)
        holders = holders_in.get(stretch)
        if holders is None:
            holders = holders_in[stretch] = tuple(
                i for i, (info, _claim) in enumerate(assignees) if info.alive_at(t))
        epoch = epochs.get(holders)
        if epoch is None:
            epoch = epochs[holders] = _Epoch(holders, nslots)
        epoch.ticks.append((tick, w))
        epoch.weight += w
    if not epochs:
        # The unit was unavailable (or weightless) all window: one empty epoch still decides its mode label.
        epoch = _Epoch((), nslots)
        epoch.ticks = [(t, 0.0) for t in ticks]
        epochs[()] = epoch

    thread_pct_cache: dict[int, list[float]] = {}
    for epoch in epochs.values():
        _decide(epoch, unit, assignees, policy)
        if epoch.mps_threads:
            replicas = epoch.decision.replicas if epoch.decision is not None else 1
            pct = thread_pct_cache.get(replicas)
            if pct is None:
                pct = thread_pct_cache[replicas] = _thread_percents(
                    replicas, nslots, assignees, assignee_slots, policy)
            _add_ticks(epoch, epoch.ticks, slots, quality, pct)
        else:
            _add_ticks(epoch, epoch.ticks, slots, quality, None)
    return list(epochs.values()), unavailable_w, quality


def _decide(epoch: _Epoch, unit: UnitWindow, assignees: Sequence[tuple[PodInfo, UnitAssignment]],
            policy: AttributionPolicy) -> None:
    sample_mode, mode_changed = majority_sample_mode(
        (t.device, w) for t, w in epoch.ticks if not t.all_idle or unit.kind is UnitKind.MIG_UNASSIGNED
    )
    replicas = max((t.device.replicas for t, _w in epoch.ticks), default=1)
    decision = decide_mode(
        unit.kind, sample_mode, replicas, [assignees[i][1] for i in epoch.holders],
        sample_mode_changed=mode_changed,
    )
    _apply_decision(epoch, decision, unit.kind, policy)


def _decide_summed(epoch: _Epoch, kind: UnitKind, assignees: Sequence[tuple[PodInfo, UnitAssignment]],
                   policy: AttributionPolicy) -> None:
    """``_decide`` of an epoch whose ticks' modes and replicas were summed as they arrived (``mode_weights``,
    ``replicas_max``): the same decision, without going over its ticks again."""
    sample_mode, mode_changed = majority_of(epoch.mode_weights)
    claims = [assignees[i][1] for i in epoch.holders]
    if not mode_changed and epoch.decided_on == (sample_mode, epoch.replicas_max, claims):
        return  # decided on the same evidence when its first tick arrived (``decide_mode`` is pure)
    decision = decide_mode(kind, sample_mode, epoch.replicas_max, claims, sample_mode_changed=mode_changed)
    _apply_decision(epoch, decision, kind, policy)


def _apply_decision(epoch: _Epoch, decision: ModeDecision, kind: UnitKind, policy: AttributionPolicy) -> None:
    """Set the epoch's decision and the branch of the per-tick math it selects (``_add_ticks``)."""
    epoch.decision = decision
    epoch.mode = decision.mode
    epoch.occupancy = kind is not UnitKind.GPU
    epoch.mps_threads = decision.mode is SharingMode.MPS and policy.mps_compute is MpsCompute.THREADS
    epoch.use_per_process = decision.mode is not SharingMode.MPS and not epoch.occupancy


def _branch(epoch: _Epoch) -> tuple[bool, bool, bool, bool]:
    """What of the epoch's decision ``_add_ticks`` reads: ticks summed under one branch are summed alike."""
    return epoch.occupancy, epoch.use_per_process, epoch.mode is SharingMode.MPS, epoch.mps_threads


def _thread_percents(replicas: int, nslots: int, assignees: Sequence[tuple[PodInfo, UnitAssignment]],
                     assignee_slots: Sequence[int], policy: AttributionPolicy) -> list[float]:
    """Per pod slot: the active-thread percentage its MPS clients run with -- the platform's annotation
    (``policy.mps_thread_annotation``, when one is configured) when set and valid, else the
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` its container spec sets (the cap the MPS server enforces), else its
    replicas' 100/replicas each (the device plugin's cap); processes of no known pod count with one replica's
    share."""
    default_pct = 100.0 / replicas
    thread_pct = [default_pct] * (nslots + 1)
    for slot, (info, claim) in zip(assignee_slots, assignees):
        configured = (_parse_thread_percent(info, policy.mps_thread_annotation)
                      if policy.mps_thread_annotation else None)
        if configured is None:
            configured = info.mps_active_thread_percentage
        if configured is None:
            configured = min(100.0, 100.0 * claim.claim_replicas(replicas) / replicas)
        thread_pct[slot] = configured
    return thread_pct


def _add_ticks(epoch: _Epoch, ticks: Sequence[tuple[UnitTick, float]], slots: _PodSlots, quality: _Quality,
               thread_pct: list[float] | None) -> None:
    """Add the memory and compute fractions of ``ticks`` (the epoch's, in time order: all at once, or one at a
    time as they arrive) to the epoch's sums, each weighted by the tick's weight, by the epoch's decision."""
    maps = slots.maps
    mem_frac, mem_bytes, comp, present = epoch.mem_frac, epoch.mem_bytes, epoch.comp, epoch.present
    occupancy, use_per_process = epoch.occupancy, epoch.use_per_process
    mps = epoch.mode is SharingMode.MPS
    last_smap, last_ppi, last_slots = epoch.slot_cache
    # The epoch's sums as locals while its ticks are added (written back at the end): the same additions in
    # the same order, without an attribute store per addition.
    mem_w, mem_idle, bytes_idle = epoch.mem_w, epoch.mem_idle, epoch.bytes_idle
    mem_res, bytes_res, mem_unx, bytes_unx = epoch.mem_res, epoch.bytes_res, epoch.mem_unx, epoch.bytes_unx
    comp_w, comp_idle, comp_unx = epoch.comp_w, epoch.comp_idle, epoch.comp_unx
    busy_per_process, busy_proxy = epoch.busy_per_process, epoch.busy_proxy
    for tick, w in ticks:
        if w <= 0.0:
            continue
        if tick.all_idle:
            mem_w += w
            mem_idle += w
            bytes_idle += tick.unassigned_memory_bytes * w
            comp_w += w
            comp_idle += w
            continue
        dev = tick.device
        smap = maps[id(tick.pod_uids)]
        ppi = dev.process_pod_index
        pmem = dev.process_used_memory_bytes
        psm = dev.process_sm_utilization_percent
        n_procs = len(ppi)
        if len(psm) < n_procs:
            psm = (-1,) * n_procs
        # Per process: its pod's slot (-1: no known pod), its memory and its SM utilization, negatives as 0 (-1 is
        # NVML's "no sample", which on a supported device means the process ran no kernel). The arrays are
        # parallel (check_sample); the slots repeat from tick to tick while the node's pods and processes stay.
        if len(pmem) == n_procs and len(psm) == n_procs:
            if smap is last_smap and ppi == last_ppi:
                tick_slots = last_slots
            else:
                nmap = len(smap)
                tick_slots = [smap[p] if 0 <= p < nmap else -1 for p in ppi]
                present.update(tick_slots)
                last_smap, last_ppi, last_slots = smap, ppi, tick_slots
            if n_procs:
                # Whenever a value is below 0, so is min() or it is a NaN: either way the values are clamped one
                # by one, as the plain loop would (a NaN stays a NaN).
                if not min(pmem) >= 0:
                    pmem = [0 if m < 0 else m for m in pmem]
                if not min(psm) >= 0:
                    psm = [0 if s < 0 else s for s in psm]
            # Byte counts and percentages are ints: their sums are exact in any order.
            mem_sum = sum(pmem)
            sm_sum = sum(psm)
        else:
            # Arrays of unequal length (no checked tick has them): the processes all three arrays describe.
            nmap = len(smap)
            triples = list(zip(ppi, pmem, psm))
            n_procs = len(triples)
            tick_slots = [smap[p] if 0 <= p < nmap else -1 for p, _m, _s in triples]
            present.update(tick_slots)
            pmem = [0 if m < 0 else m for _p, m, _s in triples]
            psm = [0 if s < 0 else s for _p, _m, s in triples]
            mem_sum = sum(pmem)
            sm_sum = sum(psm)

        # Memory: fractions of this tick's total, weighted by the tick's time.
        total = dev.memory_total_bytes
        if total > 0 and dev.memory_known:
            reserved = dev.memory_reserved_bytes
            used = dev.memory_used_bytes
            clamped = False
            if reserved < 0:
                reserved, clamped = 0, True
            elif reserved > total:
                reserved, clamped = total, True
            if reserved and used >= reserved and used + dev.memory_free_bytes == total:
                # This driver's v2 "used" includes the reserved memory (used + free = total): take it out.
                used -= reserved
            capacity = total - reserved
            if used < 0:
                used, clamped = 0, True
            elif used > capacity:
                used, clamped = capacity, True
            if clamped:
                quality.mem_clamped += 1
            inv = w / total
            mem_w += w
            mem_res += reserved * inv
            bytes_res += reserved * w
            free = capacity - used
            mem_idle += free * inv
            bytes_idle += free * w
            if mem_sum > used:
                # Processes report more than the device has in use (sampled at another instant): the device
                # total is authoritative, so scale the processes into it.
                quality.scaled += 1
                scale = used / mem_sum
                unexplained = 0.0
            else:
                scale = 1.0
                unexplained = used - mem_sum
            mem_unx += unexplained * inv
            bytes_unx += unexplained * w
            if mem_sum:
                fi = scale * inv
                bi = scale * w
                for slot, m in zip(tick_slots, pmem):
                    if m:
                        mem_frac[slot] += m * fi
                        mem_bytes[slot] += m * bi
        else:
            quality.mem_invalid += 1

        # Compute: the tick's busy fraction b; idle is 1 - b; b is split among processes.
        util = dev.gpu_utilization_percent
        per_process_ok = use_per_process and dev.process_utilization_supported and sm_sum > 0
        if util is not None:
            if util < 0:
                busy_fraction = 0.0
                quality.util_clamped += 1
            elif util > 100:
                busy_fraction = 1.0
                quality.util_clamped += 1
            else:
                busy_fraction = util / 100.0
        elif occupancy:
            # NVML has no utilization for MIG instances: the instance is busy while a process holds it.
            busy_fraction = 1.0 if n_procs else 0.0
        elif per_process_ok:
            busy_fraction = sm_sum / 100.0 if sm_sum < 100 else 1.0
        else:
            quality.comp_unknown += 1
            continue
        comp_w += w
        comp_idle += (1.0 - busy_fraction) * w
        busy = busy_fraction * w
        if busy <= 0.0:
            continue
        servers = dev.mps_server_pids
        if mps and servers and n_procs:
            # An MPS server runs its clients' kernels: the busy time is the clients', never the server's own.
            pids = dev.process_pids
            clients = [i for i in range(n_procs) if i >= len(pids) or pids[i] not in servers]
            if len(clients) < n_procs:
                tick_slots = [tick_slots[i] for i in clients]
                pmem = [pmem[i] for i in clients]
                psm = [psm[i] for i in clients]
                n_procs = len(clients)
                mem_sum = sum(pmem)
                last_smap = None  # the filtered slots must not be reused as the tick's own
        if not n_procs:
            comp_unx += busy
            quality.busy_unexplained += 1
        elif thread_pct is not None:
            pct_of: dict[int, float] = {}
            for slot in tick_slots:
                pct_of[slot] = thread_pct[slot]
            pct_total = sum(pct_of.values())
            c = busy / pct_total
            for slot, pct in pct_of.items():
                comp[slot] += pct * c
        elif per_process_ok:
            busy_per_process += busy
            c = busy / sm_sum
            for slot, s in zip(tick_slots, psm):
                if s:
                    comp[slot] += s * c
        else:
            busy_proxy += busy
            if mem_sum:
                c = busy / mem_sum
                for slot, m in zip(tick_slots, pmem):
                    if m:
                        comp[slot] += m * c
            else:
                c = busy / n_procs
                for slot in tick_slots:
                    comp[slot] += c
    epoch.mem_w, epoch.mem_idle, epoch.bytes_idle = mem_w, mem_idle, bytes_idle
    epoch.mem_res, epoch.bytes_res, epoch.mem_unx, epoch.bytes_unx = mem_res, bytes_res, mem_unx, bytes_unx
    epoch.comp_w, epoch.comp_idle, epoch.comp_unx = comp_w, comp_idle, comp_unx
    epoch.busy_per_process, epoch.busy_proxy = busy_per_process, busy_proxy
    epoch.slot_cache = (last_smap, last_ppi, last_slots)


def _unit_vectors(
    epochs: Sequence[_Epoch], unavailable_w: float, row_slots: Sequence[int], n_rows: int
) -> tuple[list[float], list[float], list[float], list[float] | None, list[float] | None]:
    """Phase 2: the unit's memory share, average bytes and compute share per row (pods in row order, then the
    buckets), as weighted means over its ticks; unavailable ticks count with all of their weight in UNAVAILABLE.
    Also the memory and compute vectors of the available ticks alone (None when no tick had that figure), which
    an epoch whose own ticks lack it falls back to."""
    mem_w = sum(e.mem_w for e in epochs)
    comp_w = sum(e.comp_w for e in epochs)

    def summed(slot_attr: str) -> list[float]:
        if len(epochs) == 1:
            values = getattr(epochs[0], slot_attr)
            return [0.0 + values[s] for s in row_slots]  # sum() of one value: 0 + it
        return [sum(getattr(e, slot_attr)[s] for e in epochs) for s in row_slots]

    available_memory = available_compute = None
    if mem_w > 0.0:
        frac = summed("mem_frac")
        nbytes = summed("mem_bytes")
        idle = sum(e.mem_idle for e in epochs)
        res = sum(e.mem_res for e in epochs)
        unx = sum(e.mem_unx + e.mem_frac[-1] for e in epochs)
        b_idle = sum(e.bytes_idle for e in epochs)
        b_res = sum(e.bytes_res for e in epochs)
        b_unx = sum(e.bytes_unx + e.mem_bytes[-1] for e in epochs)
        total = mem_w + unavailable_w
        memory = [f / total for f in frac] + [idle / total, res / total, unx / total, unavailable_w / total]
        bytes_avg = [b / total for b in nbytes] + [b_idle / total, b_res / total, b_unx / total, 0.0]
        available_memory = [f / mem_w for f in frac] + [idle / mem_w, res / mem_w, unx / mem_w, 0.0]
    elif unavailable_w > 0.0:
        memory = [0.0] * n_rows + [0.0, 0.0, 0.0, 1.0]
        bytes_avg = [0.0] * (n_rows + _BUCKETS)
    else:
        memory = [0.0] * n_rows + [0.0, 0.0, 1.0, 0.0]
        bytes_avg = [0.0] * (n_rows + _BUCKETS)
    if comp_w > 0.0:
        frac = summed("comp")
        idle = sum(e.comp_idle for e in epochs)
        unx = sum(e.comp_unx + e.comp[-1] for e in epochs)
        total = comp_w + unavailable_w
        compute = [f / total for f in frac] + [idle / total, 0.0, unx / total, unavailable_w / total]
        available_compute = [f / comp_w for f in frac] + [idle / comp_w, 0.0, unx / comp_w, 0.0]
    elif unavailable_w > 0.0:
        compute = [0.0] * n_rows + [0.0, 0.0, 0.0, 1.0]
    else:
        compute = [0.0] * n_rows + [0.0, 0.0, 1.0, 0.0]
    return memory, bytes_avg, compute, available_memory, available_compute


def _epoch_vector(epoch: _Epoch, kind: str, row_slots: Sequence[int], fallback: list[float] | None,
                  n_rows: int) -> list[float]:
    """The epoch's own memory (or compute) fractions per row, normalised over its ticks that had the figure; the
    available-ticks vector of the unit when none of the epoch's did; UNATTRIBUTED when no tick of the unit had it."""
    if kind == "memory":
        w = epoch.mem_w
        if w > 0.0:
            return [epoch.mem_frac[s] / w for s in row_slots] + [
                epoch.mem_idle / w, epoch.mem_res / w, (epoch.mem_unx + epoch.mem_frac[-1]) / w, 0.0]
    else:
        w = epoch.comp_w
        if w > 0.0:
            return [epoch.comp[s] / w for s in row_slots] + [
                epoch.comp_idle / w, 0.0, (epoch.comp_unx + epoch.comp[-1]) / w, 0.0]
    if fallback is not None:
        return fallback
    return [0.0] * n_rows + [0.0, 0.0, 1.0, 0.0]


def _epoch_cost(
    epoch: _Epoch,
    policy: AttributionPolicy,
    row_slots: Sequence[int],
    row_of_slot: Mapping[int, int],
    n_rows: int,
    assignees: Sequence[tuple[PodInfo, UnitAssignment]],
    assignee_slots: Sequence[int],
    available_memory: list[float] | None,
    available_compute: list[float] | None,
) -> list[float]:
    """Phase 3: what the epoch's ticks cost each row, as fractions that add up to 1.

    The cost basis over the epoch's own ticks; on a dedicated unit (an exclusive GPU, a MIG instance one pod
    holds) the owner pays the epoch, except what pods that use the unit without holding it (a leak through
    ``NVIDIA_VISIBLE_DEVICES=all``) pay for their use: the larger of their memory and compute fractions. A unit
    a DRA claim holds alone is paid the same way by the claim's pods together (``ModeDecision.claim_owners``),
    split among them by the cost basis (their use).
    """
    basis = policy.cost_basis
    if basis is CostBasis.REQUEST:
        return _request_cost(epoch, assignees, assignee_slots, row_of_slot, n_rows)
    memory = compute = None
    if basis is not CostBasis.COMPUTE:
        memory = _epoch_vector(epoch, "memory", row_slots, available_memory, n_rows)
    if basis is not CostBasis.MEMORY:
        compute = _epoch_vector(epoch, "compute", row_slots, available_compute, n_rows)
    decision = epoch.decision
    owners: tuple[str, ...] = ()
    if decision is not None:
        owners = (decision.dedicated_owner,) if decision.dedicated_owner is not None else decision.claim_owners
    if owners:
        if memory is None:
            memory = _epoch_vector(epoch, "memory", row_slots, available_memory, n_rows)
        if compute is None:
            compute = _epoch_vector(epoch, "compute", row_slots, available_compute, n_rows)
        return _owners_pay(owners, epoch, row_slots, row_of_slot, n_rows, assignee_slots, assignees, memory,
                           compute, _basis_vector(policy, memory, compute) if len(owners) > 1 else memory)
    return _basis_vector(policy, memory, compute)


def _basis_vector(policy: AttributionPolicy, memory: list[float] | None, compute: list[float] | None) -> list[float]:
    """The cost basis's vector (memory, compute or their blend) of an epoch."""
    basis = policy.cost_basis
    if basis is CostBasis.MEMORY:
        assert memory is not None
        return memory
    if basis is CostBasis.COMPUTE:
        assert compute is not None
        return compute
    assert memory is not None and compute is not None
    a = float(policy.blend_alpha)
    return [a * c + (1.0 - a) * m for m, c in zip(memory, compute)]


def _owners_pay(
    owners: Sequence[str],
    epoch: _Epoch,
    row_slots: Sequence[int],
    row_of_slot: Mapping[int, int],
    n_rows: int,
    assignee_slots: Sequence[int],
    assignees: Sequence[tuple[PodInfo, UnitAssignment]],
    memory: list[float],
    compute: list[float],
    use: list[float],
) -> list[float]:
    """The epoch's cost when ``owners`` (the dedicated owner, or a DRA claim's pods) hold the unit: leakers pay
    their use (the larger of their memory and compute fractions, scaled down to the whole unit when they would
    pay more), the owners the rest, split by ``use`` (the cost basis's fractions; equally when none used it)."""
    wanted = set(owners)
    owner_rows = sorted({row_of_slot[slot] for slot, (info, _claim) in zip(assignee_slots, assignees)
                         if info.uid in wanted})
    cost = [0.0] * (n_rows + _BUCKETS)
    if not owner_rows:
        return memory
    leakers = []
    for slot in epoch.present:
        if slot < 0:
            continue
        row = row_of_slot.get(slot)
        if row is None or row in owner_rows:
            continue
        used = max(memory[row], compute[row])
        if used > 0.0:
            leakers.append((row, used))
    # Summed in row order (pods by uid): a set's order, and the slots' numbering, depend on the order the pods and
    # ticks came in, and the sums must not.
    leakers.sort()
    leaked = 0.0
    for _row, used in leakers:
        leaked += used
    scale = 1.0 / leaked if leaked > 1.0 else 1.0
    paid = 0.0
    for row, used in leakers:
        cost[row] = used * scale
        paid += cost[row]
    rest = max(1.0 - paid, 0.0)
    if len(owner_rows) == 1:
        cost[owner_rows[0]] = rest
        return cost
    # Several owners (one claim's pods): the rest split by what each used of the unit, like any shared unit's
    # pods -- only the unit's idle and unexplained parts are theirs too.
    weights = [max(use[row], 0.0) for row in owner_rows]
    total = math.fsum(weights)
    if not total > 0.0:
        weights, total = [1.0] * len(owner_rows), float(len(owner_rows))
    for row, weight in zip(owner_rows, weights):
        cost[row] = rest * weight / total
    return cost


def _request_cost(
    epoch: _Epoch,
    assignees: Sequence[tuple[PodInfo, UnitAssignment]],
    assignee_slots: Sequence[int],
    row_of_slot: Mapping[int, int],
    n_rows: int,
) -> list[float]:
    """Each tick of the epoch: every alive holder pays claim / max(replicas, total claims) (claim / total claims
    on a unit a DRA claim holds alone); the rest is idle."""
    cost = [0.0] * (n_rows + _BUCKETS)
    idle = n_rows
    replicas = epoch.decision.replicas if epoch.decision is not None else 1
    claims = [(row_of_slot[assignee_slots[i]], assignees[i][1].claim_replicas(replicas)) for i in epoch.holders]
    alive = [(row, c) for row, c in claims if c > 0]
    claimed = sum(c for _, c in alive)
    # A unit a DRA claim holds alone is its pods' whole: no replica of it is free for anyone else.
    owned = epoch.decision is not None and bool(epoch.decision.claim_owners) and claimed > 0
    slots_total = claimed if owned else max(replicas, claimed)
    weight = 0.0
    for tick, w in epoch.ticks:
        if w <= 0.0:
            continue
        weight += w
        if tick.all_idle:
            cost[idle] += w
            continue
        for row, c in alive:
            cost[row] += w * c / slots_total
        cost[idle] += w * (slots_total - claimed) / slots_total
    if weight <= 0.0:
        cost[idle] = 1.0
        return cost
    return [c / weight for c in cost]


def _combined_decision(epochs: Sequence[_Epoch], assignees: Sequence[tuple[PodInfo, UnitAssignment]],
                       main: _Epoch) -> ModeDecision:
    """The unit-window's decision when its holders changed inside the window: the largest epoch's, with every
    epoch's evidence."""
    assert main.decision is not None
    total = sum(e.weight for e in epochs) or 1.0
    parts = []
    for e in sorted(epochs, key=lambda e: (-e.weight, e.holders)):
        if e.decision is None:
            continue
        holders = sorted(assignees[i][0].uid for i in e.holders) or ["none"]
        parts.append(f"{e.weight / total:.0%} held by {', '.join(holders)}: {e.decision.mode} ({e.decision.evidence})")
    evidence = f"holders changed within the window; {'; '.join(parts)}"
    conflict = any(e.decision is not None and e.decision.conflict for e in epochs)
    return ModeDecision(main.decision.mode, main.decision.dedicated_owner, evidence, conflict,
                        main.decision.sample_mode, main.decision.replicas, main.decision.claim_owners,
                        main.decision.owning_claim)


# --------------------------------------------------------------------------------------------------------------
# A node window


def attribute_node_window(window: NodeWindow, pods: PodLookup, policy: AttributionPolicy,
                          open_window: "OpenNodeWindow | None" = None) -> tuple[GpuShare, ...]:
    """Every unit's GpuShare rows for one node window, units in ``split_units`` order, rows as ``attribute_unit``.
    ``open_window``: the window's sums as its ticks arrived (``OpenNodeWindow``); the rows are the same with or
    without it, it only saves the close the per-tick work."""
    return attribute_node_window_detailed(window, pods, policy, open_window).shares


def attribute_node_window_detailed(window: NodeWindow, pods: PodLookup, policy: AttributionPolicy,
                                   open_window: "OpenNodeWindow | None" = None) -> NodeAttribution:
    """``attribute_node_window`` with each unit's mode decision and data-quality counts."""
    if not window.samples:
        return NodeAttribution((), (), 0.0)
    node_covered_seconds = _node_covered_seconds(window)
    attributed = _attributed_units(window, pods, policy, open_window)
    facts = window.samples[-1]
    cost_basis = policy.basis_text
    units = tuple(unit for _device, unit in attributed)
    shares = []
    units_in_node = len(units)
    for device, unit in attributed:
        rows_in_unit = len(unit.rows)
        mig_profile, mig_gpu_instance_id = _mig_instance_labels(device, unit)
        for row in unit.rows:
            shares.append(
                GpuShare(
                    window.cluster,
                    window.node_name,
                    window.window_start_unix_ms,
                    window.window_seconds,
                    node_covered_seconds,
                    units_in_node,
                    rows_in_unit,
                    facts.cloud_provider,
                    facts.region,
                    facts.instance_type,
                    facts.price_model,
                    row.gpu_uuid,
                    row.parent_gpu_uuid,
                    row.gpu_model,
                    row.gpu_fraction,
                    row.sharing_mode,
                    row.subject_kind,
                    row.pod_uid,
                    row.namespace,
                    row.pod_name,
                    row.labels,
                    row.workload_kind,
                    row.workload_name,
                    row.memory_used_bytes_avg,
                    row.memory_share,
                    row.compute_share,
                    row.cost_share,
                    row.method,
                    row.sample_count,
                    row.covered_seconds,
                    facts.zone,
                    facts.provider_id,
                    row.carried_label_keys,
                    row.cpu_request_millicores,
                    row.memory_request_bytes,
                    cost_basis,
                    mig_profile,
                    mig_gpu_instance_id,
                )
            )
    return NodeAttribution(tuple(shares), units, node_covered_seconds)


def node_window_record(window: NodeWindow, pods: PodLookup, policy: AttributionPolicy,
                       open_window: "OpenNodeWindow | None" = None) -> NodeWindowShares | None:
    """The record the attributor emits for one closed node window: equal to
    ``NodeWindowShares.from_rows(attribute_node_window(window, pods, policy))``, or None for a window without rows.

    Built from the units' rows directly by the same ``NodeWindowBuilder`` as ``from_rows``: a close makes one
    record, not first a ``GpuShare`` per row (38 fields, ~5 µs each) and then the record from those. ``open_window`` as in ``attribute_node_window``. Raises
    ``RecordShapeError`` where ``from_rows`` would: two units under one uuid, a POD row without a pod uid, a pod
    described two ways."""
    if not window.samples:
        return None
    if open_window is not None:
        early, record = open_window.early_record(window, pods, policy)
        if early:
            return record
    builder = NodeWindowBuilder()
    for device, unit in _attributed_units(window, pods, policy, open_window):
        rows = unit.rows
        if not rows:
            continue
        first = rows[0]
        mig_profile, mig_gpu_instance_id = _mig_instance_labels(device, unit)
        builder.add_unit(first.gpu_uuid, first.parent_gpu_uuid, first.gpu_model, first.gpu_fraction,
                         first.sharing_mode, first.method, first.sample_count, first.covered_seconds, rows,
                         mig_profile, mig_gpu_instance_id)
    facts = window.samples[-1]
    return builder.build(window.cluster, window.node_name, window.window_start_unix_ms, window.window_seconds,
                         _node_covered_seconds(window), facts.cloud_provider, facts.region, facts.zone,
                         facts.provider_id, facts.instance_type, facts.price_model, policy.basis_text)


def _node_covered_seconds(window: NodeWindow) -> float:
    window_ms = window.window_seconds * 1000
    return min(sum(max(s.interval_ms, 0) for s in window.samples), window_ms) / 1000.0


def _attributed_units(window: NodeWindow, pods: PodLookup, policy: AttributionPolicy,
                      open_window: "OpenNodeWindow | None") -> list[tuple[GpuDeviceSample, UnitAttribution]]:
    """Each unit of the window with capacity, in ``split_units`` order, with its last tick's device facts."""
    if open_window is not None and open_window.holds(window, policy):
        return open_window.attribute_units(window, pods)
    slots = _PodSlots()
    return [(unit.ticks[-1].device, _attribute(unit, pods, policy, slots))
            for unit in split_units(window) if _has_capacity(unit)]


def _mig_instance_labels(device: GpuDeviceSample, unit: UnitAttribution) -> tuple[str | None, int | None]:
    # A MIG instance's profile and GPU instance id as NVML gave them last in the window (what dcgm-exporter labels
    # GPU_I_PROFILE and GPU_I_ID); None for a whole GPU and a MIG GPU's unassigned capacity.
    if unit.kind is UnitKind.MIG_INSTANCE:
        return device.mig_profile, device.mig_gpu_instance_id
    return None, None


def _has_capacity(unit: UnitWindow) -> bool:
    # A MIG GPU whose capacity is all in instances leaves nothing of its own to attribute.
    return not (unit.kind is UnitKind.MIG_UNASSIGNED and all(t.capacity_fraction <= 0.0 for t in unit.ticks))


# --------------------------------------------------------------------------------------------------------------
# A node window summed as its ticks arrive


_SUM_BATCH_TICKS = 8
_FOREVER_MS = 2**63
"""An open window's ticks are added to its sums this many at a time: one ``_add_ticks`` call per tick would cost
more than the close saves (``make bench``: attribution core), and a close is left at most this many less one per
epoch to add. Once added, a tick is let go: an open window holds its ticks' sums, not its ticks (which would be
objects the garbage collector walks until the window closes)."""


class _OpenUnit:
    """One unit of an open node window: its ticks' weights and times, and its epochs' sums so far (keyed by the
    uids of the holders alive at their ticks, by the pods known when each tick arrived; an epoch's ``ticks`` are
    those not yet added to its sums). ``runs``: consecutive ticks summed under the same holders, ``[first tick
    time, last tick time, holder uids]``, for the close to check against the holders it finds. ``usable`` turns
    False when the sums cannot be the close's (the unit's ids changed, or an epoch would split busy time by thread
    percentages, which the close must know the pods for): the close then attributes the unit from its ticks."""

    __slots__ = ("uuid", "parent_uuid", "kind", "model", "keys", "sample_count", "first_device", "first_busy_device",
                 "last_device", "has_capacity", "times", "weights", "intervals", "covered_ms", "epochs", "runs",
                 "unavailable_w", "quality", "usable", "keep_ticks", "_assignments", "_assignments_generation",
                 "_cuts", "_current", "_runs_generation")

    def __init__(self, uuid: str, parent_uuid: str | None, kind: UnitKind, model: str, keep_ticks: bool) -> None:
        self.uuid, self.parent_uuid, self.kind, self.model = uuid, parent_uuid, kind, model
        self.keys: tuple[str, ...] | None = None
        self.sample_count = 0
        self.first_device: GpuDeviceSample | None = None
        self.first_busy_device: GpuDeviceSample | None = None  # the first that is not all idle
        self.last_device: GpuDeviceSample | None = None
        self.has_capacity = False
        # Packed arrays, not lists: 8 bytes per tick each instead of a Python int or float object (and the same
        # values: ``sum`` adds them in the same order, ``count`` and ``bisect`` read them alike).
        self.times = array("q")
        self.weights = array("d")
        self.intervals = array("q")
        self.covered_ms = 0
        self.epochs: dict[tuple[str, ...], _Epoch] = {}
        self.runs: list[list] = []
        self.unavailable_w = 0.0
        self.quality = _Quality()
        self.usable = True
        # The cost basis REQUEST reads every tick of an epoch at close (``_request_cost``): its ticks are kept.
        self.keep_ticks = keep_ticks
        self._assignments: tuple[tuple[PodInfo, UnitAssignment], ...] = ()
        self._assignments_generation = -1
        self._cuts: list[int] = []
        # (pods generation, from ms, until ms, holders, epoch): the stretch of the last tick summed
        self._current: tuple[int, int, int, tuple[str, ...], _Epoch] | None = None
        # The pods generation every run's holders were found under (None: several)
        self._runs_generation: int | None = None

    def add(self, tick: UnitTick, window_ms: int, slots: _PodSlots, pods: PodLookup, generation: int,
            policy: AttributionPolicy) -> None:
        """``_prepare``'s and ``_accumulate``'s per-tick steps for one tick (its sums added in batches: ``_sum``)."""
        device = tick.device
        self.sample_count += 1
        if self.first_device is None:
            self.first_device = device
        if self.first_busy_device is None and not tick.all_idle:
            self.first_busy_device = device
        self.last_device = device
        if not tick.capacity_fraction <= 0.0:  # _has_capacity's test, negated
            self.has_capacity = True
        self.times.append(tick.sampled_at_unix_ms)
        interval = tick.interval_ms
        if interval < 0:
            interval = 0
        self.covered_ms += interval
        if interval > window_ms:
            interval = window_ms
        self.intervals.append(interval)
        w = interval * min(max(tick.capacity_fraction, 0.0), 1.0)
        self.weights.append(w)
        if not self.usable or w <= 0.0:
            return
        if device.unavailable:
            self.unavailable_w += w
            self.quality.unavailable += 1
            return
        if self.keys is None:
            self.keys = device_keys(self.kind, self.uuid, self.parent_uuid, device)
        elif self.kind is UnitKind.MIG_INSTANCE and device_keys(self.kind, self.uuid, self.parent_uuid,
                                                                device) != self.keys:
            self.usable = False
            return
        t = tick.sampled_at_unix_ms
        current = self._current
        if current is not None and current[0] == generation and current[1] <= t < current[2]:
            # Same pods, same stretch as the previous tick summed (ticks come in time order): same epoch.
            epoch = current[4]
            self.runs[-1][1] = t
        else:
            epoch = self._enter(t, pods, generation, slots, device, policy)
            if epoch is None:
                return
        epoch.ticks.append((tick, w))
        epoch.weight += w
        if not tick.all_idle or self.kind is UnitKind.MIG_UNASSIGNED:
            mode = device.sharing_mode
            epoch.mode_weights[mode] = epoch.mode_weights.get(mode, 0.0) + max(w, 0.0)
        if device.replicas > epoch.replicas_max:
            epoch.replicas_max = device.replicas
        if len(epoch.ticks) - epoch.summed >= _SUM_BATCH_TICKS:
            self._sum(epoch, slots)

    def _enter(self, t: int, pods: PodLookup, generation: int, slots: _PodSlots, device: GpuDeviceSample,
               policy: AttributionPolicy) -> _Epoch | None:
        """The epoch of a tick at ``t`` that is not in the previous tick's stretch (None: the unit's sums cannot
        be used); records the tick's run and the stretch for the ticks after it."""
        alive, stretch = self._alive_at(t, pods, generation)
        holders = tuple(uid for uid, _ in alive)
        epoch = self.epochs.get(holders)
        if epoch is None:
            epoch = _Epoch((), len(slots.uids))
            # The branch a decision on this tick alone selects; the close decides on all of the epoch's ticks and
            # uses these sums only if it selects the same branch.
            claims = [c for _, c in alive]
            decision = decide_mode(self.kind, device.sharing_mode, device.replicas, claims)
            _apply_decision(epoch, decision, self.kind, policy)
            epoch.decided_on = (device.sharing_mode, max(device.replicas, 1), claims)
            if epoch.mps_threads:
                self.usable = False
                return None
            self.epochs[holders] = epoch
        self._record_run(t, generation, holders, epoch, stretch)
        return epoch

    def epoch_at(self, t: int, pods: PodLookup, generation: int) -> _Epoch | None:
        """``_enter`` for a tick whose holders already have an epoch: that epoch, its run and stretch recorded as
        ``_enter`` records them; None (and nothing recorded) where the holders at ``t`` have none."""
        alive, stretch = self._alive_at(t, pods, generation)
        holders = tuple(uid for uid, _ in alive)
        epoch = self.epochs.get(holders)
        if epoch is not None:
            self._record_run(t, generation, holders, epoch, stretch)
        return epoch

    def _alive_at(self, t: int, pods: PodLookup, generation: int) -> tuple[list[tuple[str, UnitAssignment]], int]:
        """The (uid, claim) of each holder alive at ``t``, and the stretch of ``_cuts`` that ``t`` is in."""
        # The holders change only where one's life starts or ends, and the pods only when the index does: both
        # are worked out once per stretch and per change of the index, not per tick.
        if generation != self._assignments_generation:
            assert self.keys is not None
            self._assignments = pods.assignments_for(self.keys)
            self._assignments_generation = generation
            self._cuts = sorted({edge for info, _ in self._assignments for edge in (info.life_start_ms,
                                                                                   info.life_end_ms)})
        alive = [(info.uid, claim) for info, claim in self._assignments if info.alive_at(t)]
        return alive, bisect_right(self._cuts, t)

    def _record_run(self, t: int, generation: int, holders: tuple[str, ...], epoch: _Epoch, stretch: int) -> None:
        runs = self.runs
        if not runs:
            self._runs_generation = generation
        elif generation != self._runs_generation:
            self._runs_generation = None
        if runs and runs[-1][2] == holders:
            runs[-1][1] = t
        else:
            runs.append([t, t, holders])
        cuts = self._cuts
        self._current = (generation, cuts[stretch - 1] if stretch else -_FOREVER_MS,
                         cuts[stretch] if stretch < len(cuts) else _FOREVER_MS, holders, epoch)

    def _sum(self, epoch: _Epoch, slots: _PodSlots) -> None:
        """Add the epoch's ticks not yet in its sums (in order: the sums are the same however they are batched),
        then let them go (unless ``keep_ticks``)."""
        epoch.fit(len(slots.uids))
        _add_ticks(epoch, epoch.ticks[epoch.summed:], slots, self.quality, None)
        if self.keep_ticks:
            epoch.summed = len(epoch.ticks)
        else:
            epoch.ticks.clear()

    def settle(self, slots: _PodSlots) -> None:
        """Add every tick not yet in the sums (a window that takes no more ticks but has not closed yet)."""
        for epoch in self.epochs.values():
            if epoch.summed < len(epoch.ticks):
                self._sum(epoch, slots)

    def prepared(self, pods: PodLookup, policy: AttributionPolicy, slots: _PodSlots, same_pods: bool,
                 window_ms: int) -> _Prepared | None:
        """What ``_prepare`` makes of the unit's ticks, from the sums; None where they are not provably the same: a
        weight fallback applies, the unit's ids changed, a tick was summed under other holders than the close
        finds for it (a pod event arrived after the tick), or an epoch's decision selects another branch."""
        if not self.usable or not self.epochs:
            return None
        intervals = self.intervals
        if intervals.count(0) == len(intervals):
            return None
        total_weight, gpu_fraction, covered_seconds = _unit_totals(self.weights, intervals, self.covered_ms, window_ms)
        if total_weight <= 0.0:
            return None
        # ``_unit_keys``: from the first tick that is not all idle (a MIG instance's ids come from it)
        keys = device_keys(self.kind, self.uuid, self.parent_uuid, self.first_busy_device or self.first_device)
        if keys != self.keys:
            return None
        generation = pods.generation
        if (same_pods and generation is not None and generation == self._runs_generation
                and generation == self._assignments_generation):
            # The pods have not changed since every run's holders were found among these same assignments: the
            # close would find the same holders.
            if type(pods) is _ReadPods:
                # What ``pods.assignments_for(keys)`` would find and record now: these very assignments, found
                # under this generation of the same index (the index moves its generation on every change).
                pods.assignments[keys] = tuple(info for info, _claim in self._assignments)
            assignees = _alive_assignees(self._assignments, self.times)
        else:
            assignees = _assignees(pods, keys, self.times)
            cuts = sorted({edge for info, _claim in assignees for edge in (info.life_start_ms, info.life_end_ms)})
            for first, last, holders in self.runs:
                if bisect_right(cuts, first) != bisect_right(cuts, last):
                    return None
                if tuple(info.uid for info, _claim in assignees if info.alive_at(first)) != holders:
                    return None
        index_of = {info.uid: i for i, (info, _claim) in enumerate(assignees)}
        assignee_slots = [slots.slot(info.uid) for info, _ in assignees]
        nslots = len(slots.uids)
        for holders, epoch in self.epochs.items():
            if epoch.summed < len(epoch.ticks):
                self._sum(epoch, slots)
            summed_as = _branch(epoch)
            epoch.holders = tuple(index_of[uid] for uid in holders)
            _decide_summed(epoch, self.kind, assignees, policy)
            if _branch(epoch) != summed_as:
                return None
            epoch.fit(nslots)
        return _Prepared(list(self.epochs.values()), self.unavailable_w, self.quality, total_weight, gpu_fraction,
                         covered_seconds, intervals.count(0), assignees, assignee_slots, self.sample_count)


# Scalar sums of an epoch the packed lane keeps per unit, in this column order (``_PackedLane``).
_LANE_SCALARS = ("weight", "mode_weight", "mem_w", "mem_res", "bytes_res", "mem_idle", "bytes_idle", "mem_unx",
                 "bytes_unx", "comp_w", "comp_idle", "comp_unx", "busy_per_process", "busy_proxy")
_LANE_QUALITY = ("mem_invalid", "mem_clamped", "scaled", "comp_unknown", "util_clamped", "busy_unexplained")
_LANE_CHUNK_TICKS = 16
# (32 ticks a chunk: ~4 % less CPU in make bench's attribution core, but 3,838 bytes per open tick against 3,055 at
# its memory figure's 50th tick, 17 ticks waiting in a chunk: kept at 16.)
# The columns the lane reads of each tick, copied into one growing buffer per column as the tick is taken (its
# record's arrays are let go at once): a chunk is then one ``np.frombuffer`` per column, and a tick waiting in a
# chunk holds ~1.4 KB of figures (8 GPUs x 8 processes) rather than its ~6 KB of arrays.
_LANE_COLUMNS = ("device_memory_total_bytes", "device_memory_used_bytes", "device_memory_free_bytes",
                 "device_memory_reserved_bytes", "device_gpu_utilization_percent",
                 "device_process_utilization_supported", "device_process_count", "device_replicas",
                 "process_pod_index", "process_used_memory_bytes", "process_sm_utilization_percent")
_LANE_DTYPES = tuple(COLUMNS[name].dtype for name in _LANE_COLUMNS)
_MIG_CODE = SHARING_MODE_CODES.index(SharingMode.MIG)


class _PackedLane:
    """The per-tick sums of a node window's whole GPUs taken straight from NodeSample v4 columns
    (``PackedNodeSample``): no ``GpuDeviceSample``, ``UnitTick`` or per-process Python value per tick.

    Contract: exactly the sums ``_OpenUnit.add`` and ``_add_ticks`` make for the same ticks, bit for bit. Each
    sum is the same IEEE operations in the same order: the per-tick terms are computed elementwise as
    ``_add_ticks`` computes them (numpy float64 is Python's float), and they are added to the epoch's sums tick
    after tick (``np.cumsum`` along the ticks, and ``np.bincount``, which adds in input order, for the per-pod sums;
    a term a branch does not add is 0.0, which leaves a non-negative sum as it is). A lane is opened only where
    its ticks cannot take another path than the one it computes: every device a whole GPU (no MIG instance, no MIG
    mode), no device error (memory known, nothing lost), no MPS server, a positive interval, the same devices,
    sharing modes, pod list and pod index generation as the tick that opened it, and every tick within the
    stretch of time over which each unit's holders stay the same (each unit's epoch is then fixed). Any other
    tick closes the lane (its sums written to the units and epochs) and goes the object path. ``close`` must run
    before anything reads the units."""

    __slots__ = ("window", "units", "epochs", "modes", "uuids", "modes_raw", "parents_raw", "smap", "generation",
                 "t_from", "t_until", "col_of", "nmap", "nslots", "use_pp", "sums", "present",
                 "scalars", "quality", "replicas_max", "buffer", "columns", "times", "intervals", "covered_ms", "last")

    @classmethod
    def open(cls, window: "OpenNodeWindow", sample: NodeSample, packed: PackedNodeSample,
             generation: int) -> "_PackedLane | None":
        """A lane for the ticks after ``sample`` (which went the object path), or None where one cannot run."""
        if window.policy.cost_basis is CostBasis.REQUEST or not _lane_tick_ok(packed):
            return None
        uuids = packed.device_uuids
        raw = packed.raw_columns
        modes = raw["device_sharing_mode"]  # one byte per device (uint8): iterating the bytes gives the codes
        if not uuids or len(set(uuids)) != len(uuids) or _MIG_CODE in modes:
            return None
        units, epochs = [], []
        t_from, t_until = -_FOREVER_MS, _FOREVER_MS
        meta = window.meta
        for uuid in uuids:
            unit = window.units.get(uuid)
            if (unit is None or unit.kind is not UnitKind.GPU or meta[uuid][1] is not UnitKind.GPU
                    or not unit.usable or unit.keep_ticks):
                return None
            current = unit._current
            if current is None or current[0] != generation:
                return None
            t_from, t_until = max(t_from, current[1]), min(t_until, current[2])
            units.append(unit)
            epochs.append(current[4])
        if not t_from <= sample.sampled_at_unix_ms < t_until:
            return None
        slots = window.slots
        lane = cls()
        lane.window, lane.units, lane.epochs, lane.uuids = window, units, epochs, uuids
        codes = SHARING_MODE_CODES
        lane.modes = [codes[c] if c < len(codes) else SharingMode.UNKNOWN for c in modes]
        lane.modes_raw = raw["device_sharing_mode"]
        lane.parents_raw = raw["device_parent_uuid"]
        lane.smap = slots.maps[id(sample.pod_uids)]
        lane.generation, lane.t_from, lane.t_until = generation, t_from, t_until
        nslots = lane.nslots = len(slots.uids)
        lane.nmap = len(lane.smap)
        # A process's pod index -> its column in the sums: the pod's slot, or the last column (no known pod).
        lane.col_of = np.array(list(lane.smap) + [nslots], dtype=np.int64)
        for unit, epoch in zip(units, epochs):
            if epoch.summed < len(epoch.ticks):
                unit._sum(epoch, slots)  # the ticks before the lane's, summed first: the sums keep tick order
            epoch.fit(nslots)
        lane.use_pp = np.array([e.use_per_process for e in epochs], dtype=bool)
        # mem_frac, mem_bytes and comp of every unit's epoch: (3, units, slots + 1)
        lane.sums = np.array([[e.mem_frac for e in epochs], [e.mem_bytes for e in epochs],
                              [e.comp for e in epochs]], dtype=np.float64)
        lane.present = np.zeros(lane.sums.shape[1:], dtype=bool)
        lane.scalars = np.array([[e.weight, e.mode_weights.get(mode, 0.0), e.mem_w, e.mem_res, e.bytes_res,
                                  e.mem_idle, e.bytes_idle, e.mem_unx, e.bytes_unx, e.comp_w, e.comp_idle,
                                  e.comp_unx, e.busy_per_process, e.busy_proxy]
                                 for e, mode in zip(epochs, lane.modes)], dtype=np.float64)
        lane.quality = np.zeros((len(units), len(_LANE_QUALITY)), dtype=np.int64)
        lane.replicas_max = np.array([e.replicas_max for e in epochs], dtype=np.int64)
        lane.buffer, lane.times, lane.intervals = [], [], []
        lane.columns = [bytearray() for _ in _LANE_COLUMNS]
        lane.covered_ms = 0
        lane.last = None
        return lane

    def accepts(self, sample: NodeSample, packed: PackedNodeSample, pods: PodLookup, generation: int) -> bool:
        """Whether ``sample`` (its pod list already slotted) is a tick this lane computes. Where the pods changed
        or the tick left the stretch, each unit's holders at it are found again (``_OpenUnit.epoch_at``): the lane
        goes on where every unit's are still its epoch's."""
        raw = packed.raw_columns
        if not (packed.device_uuids == self.uuids and _lane_tick_ok(packed)
                and raw["device_sharing_mode"] == self.modes_raw and raw["device_parent_uuid"] == self.parents_raw
                and self.window.slots.maps.get(id(sample.pod_uids)) is self.smap):
            return False
        t = sample.sampled_at_unix_ms
        if generation == self.generation and self.t_from <= t < self.t_until:
            return True
        t_from, t_until = -_FOREVER_MS, _FOREVER_MS
        for unit, epoch in zip(self.units, self.epochs):
            # A unit found under its epoch has its run taken to ``t``; if a later one is not, the tick goes the
            # object path, which finds the former in their stretch and takes their run to ``t`` as well.
            if unit.epoch_at(t, pods, generation) is not epoch:
                return False
            current = unit._current
            assert current is not None
            t_from, t_until = max(t_from, current[1]), min(t_until, current[2])
        self.generation, self.t_from, self.t_until = generation, t_from, t_until
        return True

    def take(self, sample: NodeSample, packed: PackedNodeSample) -> None:
        """Add one tick this lane ``accepts``: its figures are copied into the chunk's columns, and its record's
        arrays let go -- but for the newest tick's, which the close reads its units' last devices from (rather than
        decoding its message again)."""
        interval = packed.interval_ms
        self.covered_ms += interval
        window_ms = self.window.window_ms
        raw = packed.raw_columns
        for column, name in zip(self.columns, _LANE_COLUMNS):
            column += raw[name]
        self.buffer.append(interval if interval <= window_ms else window_ms)
        self.times.append(sample.sampled_at_unix_ms)
        if self.last is not None:
            self.last.release_columns()  # type: ignore[attr-defined]
        self.last = sample
        if len(self.buffer) >= _LANE_CHUNK_TICKS:
            self._compute()

    def _compute(self) -> None:
        """Add the buffered ticks to the lane's sums (``_add_ticks``'s arithmetic on whole columns)."""
        buffer = self.buffer
        if not buffer:
            return
        ticks, devices = len(buffer), len(self.units)
        self.intervals.extend(buffer)
        w = np.array(buffer, dtype=np.float64)  # interval * capacity fraction 1.0
        weight = np.empty((ticks, devices))
        weight[:] = w[:, None]
        concatenate, shape = np.concatenate, (ticks, devices)
        # The chunk's ticks, column by column, in tick order (what concatenating their arrays gives).
        frombuffer = np.frombuffer
        (total, used, free, reserved, util, supported, counts, replicas, pod_index, memory,
         sm) = [frombuffer(column, dtype) for column, dtype in zip(self.columns, _LANE_DTYPES)]
        self.columns = [bytearray() for _ in _LANE_COLUMNS]  # the arrays above keep the filled ones
        total, used, free, reserved, util = (total.reshape(shape), used.reshape(shape), free.reshape(shape),
                                             reserved.reshape(shape), util.reshape(shape))
        supported = supported.reshape(shape) != 0
        counts = counts.astype(np.int64).reshape(shape)
        np.maximum(self.replicas_max, replicas.reshape(shape).max(axis=0), out=self.replicas_max)
        memory = np.maximum(memory, 0).astype(np.float64)
        sm = np.maximum(sm, 0).astype(np.float64)
        device_of = np.repeat(np.arange(ticks * devices), counts.ravel())  # process -> (tick, device), flat
        unit_of = device_of % devices
        nmap = self.nmap
        column = self.col_of[np.where((pod_index >= 0) & (pod_index < nmap), pod_index, nmap)]
        # Integer sums of byte counts and percentages, exact in float64 (far below 2**53).
        mem_sum = np.bincount(device_of, weights=memory, minlength=ticks * devices).reshape(ticks, devices)
        sm_sum = np.bincount(device_of, weights=sm, minlength=ticks * devices).reshape(ticks, devices)

        # Memory (``_add_ticks``: reserved and used clamped, the v2 "used includes reserved" fix, scaling).
        valid = total > 0
        clamped = (reserved < 0) | (reserved > total)
        reserved = np.minimum(np.maximum(reserved, 0), total)
        used = np.where((reserved != 0) & (used >= reserved) & (used + free == total), used - reserved, used)
        capacity = total - reserved
        clamped |= (used < 0) | (used > capacity)
        used = np.minimum(np.maximum(used, 0), capacity).astype(np.float64)
        weight_v = np.where(valid, weight, 0.0)
        inv = np.where(valid, weight / np.where(valid, total, 1).astype(np.float64), 0.0)
        reserved_f = reserved.astype(np.float64)
        free_f = (capacity - used).astype(np.float64)
        scaled = valid & (mem_sum > used)
        scale = np.where(scaled, used / np.where(scaled, mem_sum, 1.0), 1.0)
        unexplained = np.where(scaled, 0.0, used - mem_sum)
        fi = (scale * inv).ravel()[device_of]
        bi = (scale * weight_v).ravel()[device_of]

        # Compute: the tick's busy fraction, split by SM utilization, by memory, or evenly.
        missing = util == MISSING_I4
        per_process_ok = self.use_pp[None, :] & supported & (sm_sum > 0)
        known = ~missing | per_process_ok
        busy_fraction = np.where(
            ~missing, np.where(util < 0, 0.0, np.where(util > 100, 1.0, util / 100.0)),
            np.where(per_process_ok, np.where(sm_sum < 100, sm_sum / 100.0, 1.0), 0.0))
        weight_k = np.where(known, weight, 0.0)
        busy = busy_fraction * weight_k
        active = busy > 0.0
        no_process = active & (counts == 0)
        by_sm = active & (counts > 0) & per_process_ok
        by_memory = active & (counts > 0) & ~per_process_ok
        busy_sm = np.where(by_sm, busy, 0.0)
        busy_memory = np.where(by_memory, busy, 0.0)
        share = np.where(by_sm.ravel()[device_of], sm * (busy / np.where(by_sm, sm_sum, 1.0)).ravel()[device_of],
                         np.where((by_memory & (mem_sum > 0)).ravel()[device_of],
                                  memory * (busy / np.where(mem_sum > 0, mem_sum, 1.0)).ravel()[device_of],
                                  np.where((by_memory & (mem_sum == 0)).ravel()[device_of],
                                           (busy / np.where(counts > 0, counts, 1)).ravel()[device_of], 0.0)))

        terms = np.stack([
            weight, weight, weight_v, reserved_f * inv, reserved_f * weight_v, free_f * inv, free_f * weight_v,
            unexplained * inv, unexplained * weight_v, weight_k, (1.0 - busy_fraction) * weight_k,
            np.where(no_process, busy, 0.0), busy_sm, busy_memory,
        ], axis=-1)
        self.scalars = np.cumsum(concatenate([self.scalars[None], terms]), axis=0)[-1]
        # Each per-pod sum takes its terms in process order, tick after tick: ``np.bincount`` adds its weights to
        # their bins in input order, starting from 0.0 + the sum so far (exactly the sum so far).
        sums = self.sums
        cells = sums[0].size
        flat = unit_of * sums.shape[2] + column
        sums = np.bincount(concatenate([np.arange(sums.size), flat, flat + cells, flat + 2 * cells]),
                           weights=concatenate([sums.ravel(), memory * fi, memory * bi, share]),
                           minlength=sums.size).reshape(sums.shape)
        self.sums = sums
        self.present[unit_of, column] = True
        self.quality += np.stack([~valid, valid & clamped, scaled, ~known,
                                  ~missing & ((util < 0) | (util > 100)), no_process], axis=-1).sum(axis=0)
        buffer.clear()

    def close(self) -> None:
        """Write the lane's sums and bookkeeping to its units and their epochs (the lane is spent)."""
        self._compute()
        if not self.times:
            return
        nslots = self.nslots
        last_devices = self.last.devices
        self.last.release_columns()
        device_at = {d.uuid: d for d in last_devices}
        for i, (unit, epoch, mode) in enumerate(zip(self.units, self.epochs, self.modes)):
            epoch.mem_frac = self.sums[0, i].tolist()
            epoch.mem_bytes = self.sums[1, i].tolist()
            epoch.comp = self.sums[2, i].tolist()
            (epoch.weight, mode_weight, epoch.mem_w, epoch.mem_res, epoch.bytes_res, epoch.mem_idle,
             epoch.bytes_idle, epoch.mem_unx, epoch.bytes_unx, epoch.comp_w, epoch.comp_idle, epoch.comp_unx,
             epoch.busy_per_process, epoch.busy_proxy) = self.scalars[i].tolist()
            epoch.mode_weights[mode] = mode_weight
            epoch.replicas_max = int(self.replicas_max[i])
            epoch.present.update(c if c < nslots else -1 for c in np.flatnonzero(self.present[i]).tolist())
            quality = unit.quality
            for name, count in zip(_LANE_QUALITY, self.quality[i].tolist()):
                if count:
                    setattr(quality, name, getattr(quality, name) + count)
            unit.sample_count += len(self.times)
            unit.times.extend(self.times)
            unit.intervals.extend(self.intervals)
            unit.weights.extend([float(interval) for interval in self.intervals])
            unit.covered_ms += self.covered_ms
            unit.last_device = device_at[unit.uuid]
            unit.runs[-1][1] = self.times[-1]
        self.times = []


def _lane_tick_ok(packed: PackedNodeSample) -> bool:
    """A tick the lane can compute as far as its own columns tell: no device error, no MPS server, a positive
    interval (the devices' kinds and modes are checked against the lane's)."""
    return not packed.device_errors and not packed.raw_columns["mps_server_pids"] and packed.interval_ms > 0



class _ReadPods:
    """The pods as a window's attribution reads them, remembering each lookup and what it found (``PodLookup``'s
    reads attribution makes: ``assignments_for``, ``pod``, ``generation``), so that it can be told later whether
    any of them would find something else."""

    __slots__ = ("pods", "generation", "assignments", "infos")

    def __init__(self, pods: PodLookup) -> None:
        self.pods = pods
        self.generation = pods.generation
        self.assignments: dict[tuple[str, ...], tuple[PodInfo, ...]] = {}
        self.infos: dict[str, PodInfo | None] = {}

    def assignments_for(self, base_ids: Iterable[str]) -> tuple[tuple[PodInfo, UnitAssignment], ...]:
        keys = tuple(base_ids)
        found = self.pods.assignments_for(keys)
        self.assignments[keys] = tuple(info for info, _claim in found)
        return found

    def pod(self, uid: str) -> PodInfo | None:
        info = self.infos[uid] = self.pods.pod(uid)
        return info

    def unchanged_in(self, pods: PodLookup) -> bool:
        """Whether every lookup made through this finds the same pods (the same ``PodInfo`` objects: a pod's
        info is replaced, never changed, when an event changes it) in ``pods`` now."""
        for keys, infos in self.assignments.items():
            found = pods.assignments_for(keys)
            if len(found) != len(infos) or any(a[0] is not b for a, b in zip(found, infos)):
                return False
        return all(pods.pod(uid) is info for uid, info in self.infos.items())


class OpenNodeWindow:
    """One node window's attribution summed tick by tick as its ticks arrive, so that its close is O(units): the
    per-tick work (splitting ticks into units, their weights and holders, each tick's memory and compute
    fractions) is done at ``add``, and the close (``attribute_node_window(..., open_window=self)``) only checks
    and decides.

    Contract: ``add`` each tick the window takes in, as it takes it in. The close gives exactly what it gives
    without this object, bit for bit: the sums are the same floating-point operations (``_add_ticks``) in the same
    order, and a unit's sums are used only where they are provably the ones the close would make -- the window's
    ticks are the ones added, in the order added (which is the close's (sampled_at, collector start, sequence)
    order), each tick was summed under the holders the close finds for it, and each epoch's decision selects the
    branch its ticks were summed under. Any other unit (a pod event that arrived after its ticks, a mode that
    changed) is attributed from its ticks as before; a tick out of order drops the sums of the whole window.
    Mutable, one owner. It holds its samples (the window's accumulator holds them anyway) and its ticks' sums,
    not the per-unit ticks."""

    __slots__ = ("window_ms", "policy", "samples", "slots", "meta", "units", "in_order", "_last_order", "_pods",
                 "_lane", "_early")

    def __init__(self, window_seconds: int, policy: AttributionPolicy) -> None:
        self.window_ms = window_seconds * 1000
        self.policy = policy
        self.samples: list[NodeSample] = []
        self.slots = _PodSlots()
        self.meta: dict[str, list] = {}
        self.units: dict[str, _OpenUnit] = {}
        self.in_order = True
        self._last_order: tuple[int, int, int] | None = None
        # The pods every tick was summed against (None: none yet, or not always the same object)
        self._pods: PodLookup | None = None
        # Whole-GPU ticks summed from their v4 columns (``_PackedLane``); None: the object path
        self._lane: _PackedLane | None = None
        # (ticks taken in, pods, what was read of them, the record) of ``close_early``
        self._early: tuple[int, PodLookup, _ReadPods, NodeWindowShares | None] | None = None

    def add(self, sample: NodeSample, pods: PodLookup, pods_generation: int) -> None:
        """Sum one tick. ``pods``: the pods known now; ``pods_generation`` changes whenever they change
        (``LivePodIndex.generation``; a caller passing immutable indexes passes a new number for each)."""
        self._early = None
        if not self.in_order:
            return
        if not self.samples:
            self._pods = pods
        elif pods is not self._pods:
            self._pods = None
        order = (sample.sampled_at_unix_ms, sample.collector_started_at_unix_ms, sample.sequence)
        if self._last_order is not None and order <= self._last_order:
            # A tick older than one already summed: the close sorts it before that one, so no sum can be reused.
            self.in_order = False
            self.samples, self.units, self._lane = [], {}, None
            return
        self._last_order = order
        self.samples.append(sample)
        self.slots.map_for(sample.pod_uids)
        packed: PackedNodeSample | None = getattr(sample, "packed", None)  # a tick decoded from NodeSample v4
        lane = self._lane
        if lane is not None:
            if packed is not None and lane.accepts(sample, packed, pods, pods_generation):
                lane.take(sample, packed)
                return
            lane.close()
            self._lane = None
        ticks: dict[str, list[UnitTick]] = {}
        meta = self.meta
        _split_sample(sample, ticks, meta)
        keep_ticks = self.policy.cost_basis is CostBasis.REQUEST
        for uuid, (tick,) in ticks.items():
            unit = self.units.get(uuid)
            if unit is None:
                parent_uuid, kind, model = meta[uuid]
                unit = self.units[uuid] = _OpenUnit(uuid, parent_uuid, kind, model, keep_ticks)
            unit.add(tick, self.window_ms, self.slots, pods, pods_generation, self.policy)
        if packed is not None:
            self._lane = _PackedLane.open(self, sample, packed, pods_generation)
            sample.release_columns()  # type: ignore[attr-defined]  # summed through its devices

    def _close_lane(self) -> None:
        if self._lane is not None:
            self._lane.close()
            self._lane = None

    def settle(self) -> None:
        """Add every tick taken in to the sums now (the node's ticks have moved on to its next window): less for
        the close to do. The sums are the same whenever this is called."""
        self._close_lane()
        for unit in self.units.values():
            if unit.usable:
                unit.settle(self.slots)

    def close_early(self, window: NodeWindow, pods: PodLookup) -> None:
        """``settle``, then attribute ``window`` (the ticks taken in, in order) against ``pods`` now and keep its
        record, with what was read of the pods, for the close (``early_record``): the node's ticks have moved on
        to its next window, and every node's window closes in the same second, so its attribution is done in its
        grace, not in that burst."""
        self.settle()
        if not (self.in_order and self.samples and self.holds(window, self.policy)):
            return
        read = _ReadPods(pods)
        self._early = (len(self.samples), pods, read, node_window_record(window, read, self.policy, self))

    def early_record(self, window: NodeWindow, pods: PodLookup, policy: AttributionPolicy
                     ) -> tuple[bool, NodeWindowShares | None]:
        """(True, the record ``close_early`` made) where it is the one ``window`` closes to now: the same ticks and
        policy, and nothing it read of the pods changed since (every pod index change moves ``generation``; when
        it moved, each lookup is made again and must find the very same pods); else (False, None)."""
        early = self._early
        if (early is None or early[0] != len(self.samples) or early[1] is not pods
                or not self.holds(window, policy)):
            return False, None
        read = early[2]
        if pods.generation is None or (pods.generation != read.generation and not read.unchanged_in(pods)):
            return False, None
        return True, early[3]

    def holds(self, window: NodeWindow, policy: AttributionPolicy) -> bool:
        """Whether this summed exactly ``window``'s ticks, in its order, under ``policy``."""
        samples = self.samples
        return (self.in_order and policy == self.policy and window.window_seconds * 1000 == self.window_ms
                and len(samples) == len(window.samples) and all(a is b for a, b in zip(samples, window.samples)))

    def attribute_units(self, window: NodeWindow, pods: PodLookup
                        ) -> list[tuple[GpuDeviceSample, UnitAttribution]]:
        """Of a window this ``holds``: each unit's last device and ``attribute_unit_detailed``, in ``split_units``
        order, from the sums where they hold and from the window's ticks where they do not."""
        self._close_lane()
        meta = self.meta
        units = [u for u in self.units.values() if not (meta[u.uuid][1] is UnitKind.MIG_UNASSIGNED
                                                        and not u.has_capacity)]
        units.sort(key=lambda u: (meta[u.uuid][0] or u.uuid, meta[u.uuid][0] is not None, u.uuid))
        split: dict[str, UnitWindow] | None = None
        # ``close_early`` reads the pods through a ``_ReadPods`` over the very index the ticks were summed against
        same_pods = pods is self._pods or (type(pods) is _ReadPods and pods.pods is self._pods)
        attributed = []
        for unit in units:
            kind = meta[unit.uuid][1]  # a GPU whose MIG mode flipped in the window is one GPU unit (_split_sample)
            prepared = (unit.prepared(pods, self.policy, self.slots, same_pods, self.window_ms)
                        if kind is unit.kind else None)
            if prepared is None:
                if split is None:
                    split = {u.unit_uuid: u for u in split_units(window)}
                attribution = _attribute(split[unit.uuid], pods, self.policy, self.slots)
            else:
                attribution = _finish(_UnitId(unit.uuid, unit.parent_uuid, unit.model, kind), pods, self.policy,
                                      self.slots, prepared)
            assert unit.last_device is not None
            attributed.append((unit.last_device, attribution))
        return attributed
