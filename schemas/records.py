"""Typed, immutable records: one dataclass per Avro record type, with exact conversion to and from the Avro dicts.

Field names and order match the ``.avsc`` files (a unit test checks it). Sequences are tuples and maps are
read-only mappings so that a record, once built, cannot change under a consumer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping, Sequence


def _frozen_map(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(value or {}))


_EMPTY_MAP: Mapping[str, Any] = MappingProxyType({})


# The NVML facts a record's meaning depends on (the collector writes them, every consumer reads them here).
MEMORY_INFO_FUNCTION = "nvmlDeviceGetMemoryInfo"
GPU_IS_LOST = "GPU_IS_LOST"


class SharingMode(enum.StrEnum):
    UNKNOWN = "UNKNOWN"
    EXCLUSIVE = "EXCLUSIVE"
    TIME_SLICING = "TIME_SLICING"
    MPS = "MPS"
    MIG = "MIG"


# Value -> member: a dict lookup per decoded device instead of an enum call (the decode hot path).
_SHARING_MODES: dict[str, SharingMode] = {mode.value: mode for mode in SharingMode}


class PodEventType(enum.StrEnum):
    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"


class ShareSubjectKind(enum.StrEnum):
    POD = "POD"
    IDLE = "IDLE"
    DRIVER_RESERVED = "DRIVER_RESERVED"
    UNATTRIBUTED = "UNATTRIBUTED"
    UNAVAILABLE = "UNAVAILABLE"  # v2: time the unit was lost or unreadable


class CostSubjectKind(enum.StrEnum):
    POD = "POD"
    IDLE = "IDLE"
    DRIVER_RESERVED = "DRIVER_RESERVED"
    UNATTRIBUTED = "UNATTRIBUTED"
    NODE_OTHER = "NODE_OTHER"
    UNAVAILABLE = "UNAVAILABLE"  # v2: lost or unreadable units, and GPUs billed but not reported


class Severity(enum.StrEnum):
    INFO = "INFO"
    WARNING = "WARNING"
    CRITICAL = "CRITICAL"


class ViolationState(enum.StrEnum):
    FIRING = "FIRING"
    RESOLVED = "RESOLVED"


@dataclass(frozen=True, slots=True)
class NvmlError:
    nvml_function: str
    error_code: str
    message: str

    def to_avro(self) -> dict[str, Any]:
        return {"nvml_function": self.nvml_function, "error_code": self.error_code, "message": self.message}

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "NvmlError":
        return cls(d["nvml_function"], d["error_code"], d["message"])


@dataclass(frozen=True, slots=True)
class GpuDeviceSample:
    """One GPU or MIG instance in one tick. Per-process tuples are parallel (same length)."""

    uuid: str
    parent_uuid: str | None
    index: int
    model: str
    sharing_mode: SharingMode
    replicas: int
    mig_gpu_instance_id: int | None
    mig_compute_instance_id: int | None
    mig_profile: str | None
    mig_compute_slices: int
    mig_total_compute_slices: int
    memory_total_bytes: int
    memory_used_bytes: int
    memory_free_bytes: int
    memory_reserved_bytes: int
    gpu_utilization_percent: int | None
    memory_utilization_percent: int | None
    power_milliwatts: int | None
    process_utilization_supported: bool
    errors: tuple[NvmlError, ...]
    process_pids: tuple[int, ...]
    process_pod_index: tuple[int, ...]
    process_used_memory_bytes: tuple[int, ...]
    process_sm_utilization_percent: tuple[int, ...]
    mps_server_pids: tuple[int, ...] = ()  # v2

    @property
    def is_mig_instance(self) -> bool:
        return self.parent_uuid is not None

    @property
    def memory_known(self) -> bool:
        """False when the memory figures are unknown, not empty: an nvmlDeviceGetMemoryInfo call failed (the four
        figures are then 0 and per-process memory cannot be compared with them)."""
        errors = self.errors
        return not errors or not any(MEMORY_INFO_FUNCTION in e.nvml_function for e in errors)

    @property
    def unavailable(self) -> bool:
        """The unit could not be used or read this tick: it is lost (an NVML call answered GPU_IS_LOST), or it
        failed with no figure at all (no memory, no utilization, no process). Its time is nobody's use."""
        errors = self.errors
        if not errors:
            return False
        if any(e.error_code == GPU_IS_LOST for e in errors):
            return True
        return (
            (self.memory_total_bytes <= 0 or not self.memory_known)
            and self.gpu_utilization_percent is None
            and not self.process_pids
        )

    def to_avro(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["sharing_mode"] = str(self.sharing_mode)
        d["errors"] = [e.to_avro() for e in self.errors]
        for name in _PROCESS_FIELDS:
            d[name] = list(d[name])
        d["mps_server_pids"] = list(self.mps_server_pids)
        return d

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "GpuDeviceSample":
        # Positional, in field order: keyword arguments cost twice as much on the decode hot path (8 devices per
        # tick). tests/unit/schemas/test_records.py checks that every Avro field lands in its own attribute.
        try:
            mode = _SHARING_MODES[d["sharing_mode"]]
        except (KeyError, TypeError):
            mode = SharingMode(d["sharing_mode"])  # not a member: the enum's own ValueError, as before
        errors = d["errors"]
        return cls(
            d["uuid"],
            d["parent_uuid"],
            d["index"],
            d["model"],
            mode,
            d["replicas"],
            d["mig_gpu_instance_id"],
            d["mig_compute_instance_id"],
            d["mig_profile"],
            d["mig_compute_slices"],
            d["mig_total_compute_slices"],
            d["memory_total_bytes"],
            d["memory_used_bytes"],
            d["memory_free_bytes"],
            d["memory_reserved_bytes"],
            d["gpu_utilization_percent"],
            d["memory_utilization_percent"],
            d["power_milliwatts"],
            d["process_utilization_supported"],
            tuple([NvmlError.from_avro(e) for e in errors]) if len(errors) else (),
            tuple(d["process_pids"]),
            tuple(d["process_pod_index"]),
            tuple(d["process_used_memory_bytes"]),
            tuple(d["process_sm_utilization_percent"]),
            tuple(d["mps_server_pids"]) if d.get("mps_server_pids") else (),
        )


_PROCESS_FIELDS = (
    "process_pids",
    "process_pod_index",
    "process_used_memory_bytes",
    "process_sm_utilization_percent",
)


@dataclass(frozen=True, slots=True)
class NodeSample:
    cluster: str
    node_name: str
    sequence: int
    collector_started_at_unix_ms: int
    sampled_at_unix_ms: int
    interval_ms: int
    cloud_provider: str
    region: str
    instance_type: str
    price_model: str
    pod_uids: tuple[str, ...]
    node_errors: tuple[NvmlError, ...]
    devices: tuple[GpuDeviceSample, ...]
    zone: str = ""  # v2
    provider_id: str = ""  # v2

    def to_avro(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "node_name": self.node_name,
            "sequence": self.sequence,
            "collector_started_at_unix_ms": self.collector_started_at_unix_ms,
            "sampled_at_unix_ms": self.sampled_at_unix_ms,
            "interval_ms": self.interval_ms,
            "cloud_provider": self.cloud_provider,
            "region": self.region,
            "instance_type": self.instance_type,
            "price_model": self.price_model,
            "pod_uids": list(self.pod_uids),
            "node_errors": [e.to_avro() for e in self.node_errors],
            "devices": [dev.to_avro() for dev in self.devices],
            "zone": self.zone,
            "provider_id": self.provider_id,
        }

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "NodeSample":
        node_errors = d["node_errors"]
        device_from_avro = GpuDeviceSample.from_avro
        return cls(
            d["cluster"],
            d["node_name"],
            d["sequence"],
            d["collector_started_at_unix_ms"],
            d["sampled_at_unix_ms"],
            d["interval_ms"],
            d["cloud_provider"],
            d["region"],
            d["instance_type"],
            d["price_model"],
            tuple(d["pod_uids"]),
            tuple([NvmlError.from_avro(e) for e in node_errors]) if len(node_errors) else (),
            tuple([device_from_avro(dev) for dev in d["devices"]]),
            d.get("zone", ""),
            d.get("provider_id", ""),
        )


@dataclass(frozen=True, slots=True)
class DeviceAssignment:
    resource_name: str
    device_ids: tuple[str, ...]
    # v3: the DRA claim (``<namespace>/<name>``) that holds these devices alone; None for the device plugin's and
    # for a DRA device shared across claims.
    owning_claim: str | None = None

    def to_avro(self) -> dict[str, Any]:
        return {"resource_name": self.resource_name, "device_ids": list(self.device_ids),
                "owning_claim": self.owning_claim}

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "DeviceAssignment":
        return cls(d["resource_name"], tuple(d["device_ids"]), d.get("owning_claim"))


@dataclass(frozen=True, slots=True)
class PodContainer:
    name: str
    container_id: str | None
    gpu_requests: Mapping[str, int]
    assigned_devices: tuple[DeviceAssignment, ...]
    visible_devices_env: str | None
    privileged: bool = False
    mps_active_thread_percentage: float | None = None  # v2
    cpu_request_millicores: int = 0  # v2
    memory_request_bytes: int = 0  # v2

    def to_avro(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "container_id": self.container_id,
            "gpu_requests": dict(self.gpu_requests),
            "assigned_devices": [a.to_avro() for a in self.assigned_devices],
            "visible_devices_env": self.visible_devices_env,
            "privileged": self.privileged,
            "mps_active_thread_percentage": self.mps_active_thread_percentage,
            "cpu_request_millicores": self.cpu_request_millicores,
            "memory_request_bytes": self.memory_request_bytes,
        }

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "PodContainer":
        return cls(
            name=d["name"],
            container_id=d["container_id"],
            gpu_requests=_frozen_map(d["gpu_requests"]),
            assigned_devices=tuple(DeviceAssignment.from_avro(a) for a in d["assigned_devices"]),
            visible_devices_env=d["visible_devices_env"],
            privileged=d["privileged"],
            mps_active_thread_percentage=d.get("mps_active_thread_percentage"),
            cpu_request_millicores=d.get("cpu_request_millicores", 0),
            memory_request_bytes=d.get("memory_request_bytes", 0),
        )


@dataclass(frozen=True, slots=True)
class PodEvent:
    event_type: PodEventType
    observed_at_unix_ms: int
    resource_version: str
    cluster: str
    node_name: str
    uid: str
    namespace: str
    name: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    workload_kind: str | None
    workload_name: str | None
    phase: str
    started_at_unix_ms: int | None
    gpu_requests: Mapping[str, int]
    containers: tuple[PodContainer, ...]
    # Version 2 (defaults: what a version 1 record means -- nothing left out by the collector).
    labels_dropped: int = 0
    annotations_dropped: int = 0
    truncated: bool = False
    cpu_request_millicores: int = 0
    memory_request_bytes: int = 0
    # Version 3 (default: what an older record means -- no namespace labels known).
    namespace_labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY_MAP)

    def to_avro(self) -> dict[str, Any]:
        return {
            "event_type": str(self.event_type),
            "observed_at_unix_ms": self.observed_at_unix_ms,
            "resource_version": self.resource_version,
            "cluster": self.cluster,
            "node_name": self.node_name,
            "uid": self.uid,
            "namespace": self.namespace,
            "name": self.name,
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "workload_kind": self.workload_kind,
            "workload_name": self.workload_name,
            "phase": self.phase,
            "started_at_unix_ms": self.started_at_unix_ms,
            "gpu_requests": dict(self.gpu_requests),
            "containers": [c.to_avro() for c in self.containers],
            "labels_dropped": self.labels_dropped,
            "annotations_dropped": self.annotations_dropped,
            "truncated": self.truncated,
            "cpu_request_millicores": self.cpu_request_millicores,
            "memory_request_bytes": self.memory_request_bytes,
            "namespace_labels": dict(self.namespace_labels),
        }

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "PodEvent":
        return cls(
            event_type=PodEventType(d["event_type"]),
            observed_at_unix_ms=d["observed_at_unix_ms"],
            resource_version=d["resource_version"],
            cluster=d["cluster"],
            node_name=d["node_name"],
            uid=d["uid"],
            namespace=d["namespace"],
            name=d["name"],
            labels=_frozen_map(d["labels"]),
            annotations=_frozen_map(d["annotations"]),
            workload_kind=d["workload_kind"],
            workload_name=d["workload_name"],
            phase=d["phase"],
            started_at_unix_ms=d["started_at_unix_ms"],
            gpu_requests=_frozen_map(d["gpu_requests"]),
            containers=tuple(PodContainer.from_avro(c) for c in d["containers"]),
            labels_dropped=d.get("labels_dropped", 0),
            annotations_dropped=d.get("annotations_dropped", 0),
            truncated=d.get("truncated", False),
            cpu_request_millicores=d.get("cpu_request_millicores", 0),
            memory_request_bytes=d.get("memory_request_bytes", 0),
            namespace_labels=_frozen_map(d.get("namespace_labels")),
        )


def _flat_to_avro(record: Any, enum_fields: tuple[str, ...], map_fields: tuple[str, ...]) -> dict[str, Any]:
    d = {f.name: getattr(record, f.name) for f in fields(record)}
    for name in enum_fields:
        d[name] = str(d[name])
    for name in map_fields:
        d[name] = dict(d[name])
    return d


@dataclass(frozen=True, slots=True)
class GpuShare:
    cluster: str
    node_name: str
    window_start_unix_ms: int
    window_seconds: int
    node_covered_seconds: float
    units_in_node: int
    rows_in_unit: int
    cloud_provider: str
    region: str
    instance_type: str
    price_model: str
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
    zone: str = ""  # v2
    provider_id: str = ""  # v2
    carried_label_keys: tuple[str, ...] = ()  # v2
    cpu_request_millicores: int = 0  # v2: POD rows
    memory_request_bytes: int = 0  # v2: POD rows
    cost_basis: str = ""  # v2
    mig_profile: str | None = None  # v3: a MIG instance unit's profile (dcgm-exporter's GPU_I_PROFILE)
    mig_gpu_instance_id: int | None = None  # v3: its GPU instance id (GPU_I_ID)

    def to_avro(self) -> dict[str, Any]:
        d = _flat_to_avro(self, ("sharing_mode", "subject_kind"), ("labels",))
        d["carried_label_keys"] = list(self.carried_label_keys)
        return d

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "GpuShare":
        values = dict(d)
        values["sharing_mode"] = SharingMode(values["sharing_mode"])
        values["subject_kind"] = ShareSubjectKind(values["subject_kind"])
        values["labels"] = _frozen_map(values["labels"])
        values["carried_label_keys"] = tuple(values.get("carried_label_keys") or ())
        return cls(**values)


@dataclass(frozen=True, slots=True)
class CostRecord:
    cluster: str
    node_name: str
    window_start_unix_ms: int
    window_seconds: int
    gpu_uuid: str | None
    subject_kind: CostSubjectKind
    pod_uid: str | None
    namespace: str | None
    pod_name: str | None
    labels: Mapping[str, str]
    cost_share: float
    cost_micro_usd: int
    instance_type: str
    price_model: str
    price_version: str
    carried_label_keys: tuple[str, ...] = ()  # v2
    # v2: a shared line carries (a part of) a bucket of its node-window (billing's sharing policy); None: direct.
    shared_from: CostSubjectKind | None = None
    sharing_method: str = ""  # v2: weighted | even | requests for a shared line
    method: str = ""  # v2: the unit's attribution method (unit lines)
    cost_basis: str = ""  # v2: what cost_share followed (unit lines)
    memory_share: float = 0.0  # v2 (unit lines)
    compute_share: float = 0.0  # v2 (unit lines)
    gpu_fraction: float = 0.0  # v2 (unit lines; node-level UNAVAILABLE: the GPUs billed but not reported)

    @property
    def is_shared(self) -> bool:
        """A line that carries a bucket's cost to a pod (``shared_from`` set), not the subject's own use."""
        return self.shared_from is not None

    def to_avro(self) -> dict[str, Any]:
        d = _flat_to_avro(self, ("subject_kind",), ("labels",))
        d["carried_label_keys"] = list(self.carried_label_keys)
        d["shared_from"] = None if self.shared_from is None else str(self.shared_from)
        return d

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "CostRecord":
        values = dict(d)
        values["subject_kind"] = CostSubjectKind(values["subject_kind"])
        values["labels"] = _frozen_map(values["labels"])
        values["carried_label_keys"] = tuple(values.get("carried_label_keys") or ())
        shared_from = values.get("shared_from")
        values["shared_from"] = None if shared_from is None else CostSubjectKind(shared_from)
        return cls(**values)


@dataclass(frozen=True, slots=True)
class Violation:
    fingerprint: str
    rule: str
    severity: Severity
    state: ViolationState
    cluster: str
    node_name: str | None
    gpu_uuid: str | None
    namespace: str | None
    pod_name: str | None
    pod_uid: str | None
    team: str | None
    summary: str
    evidence: Mapping[str, float]
    first_seen_unix_ms: int
    last_seen_unix_ms: int
    resolved_at_unix_ms: int | None

    def to_avro(self) -> dict[str, Any]:
        return _flat_to_avro(self, ("severity", "state"), ("evidence",))

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "Violation":
        values = dict(d)
        values["severity"] = Severity(values["severity"])
        values["state"] = ViolationState(values["state"])
        values["evidence"] = _frozen_map(values["evidence"])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    reason_code: str
    reason: str
    error_type: str
    service: str
    source_topic: str
    source_partition: int
    source_offset: int
    source_key: bytes | None
    raw_bytes: bytes
    failed_at_unix_ms: int
    # Version 2 (defaults: what a version 1 record means -- raw_bytes whole, nothing cut).
    payload_length_bytes: int = -1
    payload_sha256: str = ""
    source_key_length_bytes: int = -1
    truncated: bool = False

    def to_avro(self) -> dict[str, Any]:
        return _flat_to_avro(self, (), ())

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "DeadLetter":
        return cls(**d)


# ---------------------------------------------------------------------------------------------------------------
# Node-window records: one message per node and window, columnar, the pods listed once.


@dataclass(frozen=True, slots=True)
class WindowPod:
    """One pod of a node-window record, referenced by index from its rows or lines."""

    pod_uid: str
    namespace: str | None
    pod_name: str | None
    labels: Mapping[str, str]
    carried_label_keys: tuple[str, ...]
    workload_kind: str | None
    workload_name: str | None
    cpu_request_millicores: int
    memory_request_bytes: int

    def to_avro(self) -> dict[str, Any]:
        return {
            "pod_uid": self.pod_uid,
            "namespace": self.namespace,
            "pod_name": self.pod_name,
            "labels": dict(self.labels),
            "carried_label_keys": list(self.carried_label_keys),
            "workload_kind": self.workload_kind,
            "workload_name": self.workload_name,
            "cpu_request_millicores": self.cpu_request_millicores,
            "memory_request_bytes": self.memory_request_bytes,
        }

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "WindowPod":
        return cls(d["pod_uid"], d["namespace"], d["pod_name"], _frozen_map(d["labels"]),
                   tuple(d["carried_label_keys"]), d["workload_kind"], d["workload_name"],
                   d["cpu_request_millicores"], d["memory_request_bytes"])


_SHARE_KINDS: dict[str, ShareSubjectKind] = {kind.value: kind for kind in ShareSubjectKind}
_COST_KINDS: dict[str, CostSubjectKind] = {kind.value: kind for kind in CostSubjectKind}
_UNIT_ROW_FIELDS = ("subject_kinds", "subject_pod_index", "memory_used_bytes_avg", "memory_share", "compute_share",
                    "cost_share")


@dataclass(frozen=True, slots=True)
class UnitShares:
    """One unit of a ``NodeWindowShares`` and its subjects' shares, as parallel tuples (one entry per row)."""

    gpu_uuid: str
    parent_gpu_uuid: str | None
    gpu_model: str
    gpu_fraction: float
    sharing_mode: SharingMode
    method: str
    sample_count: int
    covered_seconds: float
    subject_kinds: tuple[ShareSubjectKind, ...]
    subject_pod_index: tuple[int, ...]
    memory_used_bytes_avg: tuple[float, ...]
    memory_share: tuple[float, ...]
    compute_share: tuple[float, ...]
    cost_share: tuple[float, ...]
    mig_profile: str | None = None  # a MIG instance's profile (dcgm-exporter's GPU_I_PROFILE)
    mig_gpu_instance_id: int | None = None  # its GPU instance id (GPU_I_ID)

    def __len__(self) -> int:
        return len(self.subject_kinds)

    def to_avro(self) -> dict[str, Any]:
        return {
            "gpu_uuid": self.gpu_uuid,
            "parent_gpu_uuid": self.parent_gpu_uuid,
            "gpu_model": self.gpu_model,
            "gpu_fraction": self.gpu_fraction,
            "sharing_mode": str(self.sharing_mode),
            "method": self.method,
            "sample_count": self.sample_count,
            "covered_seconds": self.covered_seconds,
            "subject_kinds": [str(k) for k in self.subject_kinds],
            "subject_pod_index": list(self.subject_pod_index),
            "memory_used_bytes_avg": list(self.memory_used_bytes_avg),
            "memory_share": list(self.memory_share),
            "compute_share": list(self.compute_share),
            "cost_share": list(self.cost_share),
            "mig_profile": self.mig_profile,
            "mig_gpu_instance_id": self.mig_gpu_instance_id,
        }

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "UnitShares":
        return cls(d["gpu_uuid"], d["parent_gpu_uuid"], d["gpu_model"], d["gpu_fraction"],
                   _SHARING_MODES[d["sharing_mode"]], d["method"], d["sample_count"], d["covered_seconds"],
                   tuple([_SHARE_KINDS[k] for k in d["subject_kinds"]]), tuple(d["subject_pod_index"]),
                   tuple(d["memory_used_bytes_avg"]), tuple(d["memory_share"]), tuple(d["compute_share"]),
                   tuple(d["cost_share"]), d.get("mig_profile"), d.get("mig_gpu_instance_id"))


class RecordShapeError(ValueError):
    """A columnar record whose parallel arrays or indexes do not line up (``check_shape``), or rows that cannot be
    one node-window (``from_rows``)."""


@dataclass(frozen=True, slots=True)
class NodeWindowShares:
    """One node's shares of one window (``NodeWindowShares.v1.avsc``). ``rows()`` is the same content as one
    ``GpuShare`` per unit and subject; ``from_rows`` builds it from those rows."""

    cluster: str
    node_name: str
    window_start_unix_ms: int
    window_seconds: int
    node_covered_seconds: float
    cloud_provider: str
    region: str
    zone: str
    provider_id: str
    instance_type: str
    price_model: str
    cost_basis: str
    pods: tuple[WindowPod, ...]
    units: tuple[UnitShares, ...]

    @property
    def window_end_unix_ms(self) -> int:
        return self.window_start_unix_ms + self.window_seconds * 1000

    @property
    def row_count(self) -> int:
        return sum(len(unit) for unit in self.units)

    def check_shape(self) -> None:
        """Raise ``RecordShapeError`` unless every unit's arrays have one entry per row and every pod index names
        a pod (POD rows) or is -1 (buckets)."""
        pods = len(self.pods)
        for unit in self.units:
            n = len(unit.subject_kinds)
            for name in _UNIT_ROW_FIELDS[1:]:
                if len(getattr(unit, name)) != n:
                    raise RecordShapeError(f"unit {unit.gpu_uuid}: {name} has {len(getattr(unit, name))} entries "
                                           f"for {n} rows")
            for kind, index in zip(unit.subject_kinds, unit.subject_pod_index):
                if kind is ShareSubjectKind.POD:
                    if not 0 <= index < pods:
                        raise RecordShapeError(f"unit {unit.gpu_uuid}: a POD row names pod {index} of {pods}")
                elif index != -1:
                    raise RecordShapeError(f"unit {unit.gpu_uuid}: a {kind} row names pod {index}")

    def rows(self) -> tuple[GpuShare, ...]:
        """One ``GpuShare`` per unit and subject, in unit then row order."""
        out: list[GpuShare] = []
        units_in_node = len(self.units)
        pods = self.pods
        for unit in self.units:
            rows_in_unit = len(unit.subject_kinds)
            for i in range(rows_in_unit):
                index = unit.subject_pod_index[i]
                pod = pods[index] if index >= 0 else None
                out.append(GpuShare(
                    self.cluster, self.node_name, self.window_start_unix_ms, self.window_seconds,
                    self.node_covered_seconds, units_in_node, rows_in_unit, self.cloud_provider, self.region,
                    self.instance_type, self.price_model, unit.gpu_uuid, unit.parent_gpu_uuid, unit.gpu_model,
                    unit.gpu_fraction, unit.sharing_mode, unit.subject_kinds[i],
                    None if pod is None else pod.pod_uid,
                    None if pod is None else pod.namespace,
                    None if pod is None else pod.pod_name,
                    _EMPTY_MAP if pod is None else pod.labels,
                    None if pod is None else pod.workload_kind,
                    None if pod is None else pod.workload_name,
                    unit.memory_used_bytes_avg[i], unit.memory_share[i], unit.compute_share[i], unit.cost_share[i],
                    unit.method, unit.sample_count, unit.covered_seconds, self.zone, self.provider_id,
                    () if pod is None else pod.carried_label_keys,
                    0 if pod is None else pod.cpu_request_millicores,
                    0 if pod is None else pod.memory_request_bytes,
                    self.cost_basis,
                    unit.mig_profile,
                    unit.mig_gpu_instance_id,
                ))
        return tuple(out)

    @classmethod
    def from_rows(cls, rows: Sequence[GpuShare]) -> "NodeWindowShares":
        """The node-window of ``rows`` (one node-window's rows, grouped by unit in unit order). Raises
        ``RecordShapeError`` for rows of several node-windows, a unit's rows apart, or one pod described two
        ways."""
        if not rows:
            raise RecordShapeError("a node-window has at least one row")
        first = rows[0]
        node = (first.cluster, first.node_name, first.window_start_unix_ms, first.window_seconds)
        builder = NodeWindowBuilder()
        start = 0
        for end in range(1, len(rows) + 1):
            if end < len(rows):
                row = rows[end]
                if (row.cluster, row.node_name, row.window_start_unix_ms, row.window_seconds) != node:
                    raise RecordShapeError(
                        f"rows of {node} and {(row.cluster, row.node_name, row.window_start_unix_ms)}")
                if row.gpu_uuid == rows[start].gpu_uuid:
                    continue
            head = rows[start]
            builder.add_unit(head.gpu_uuid, head.parent_gpu_uuid, head.gpu_model, head.gpu_fraction,
                             head.sharing_mode, head.method, head.sample_count, head.covered_seconds,
                             rows[start:end], head.mig_profile, head.mig_gpu_instance_id)
            start = end
        return builder.build(first.cluster, first.node_name, first.window_start_unix_ms, first.window_seconds,
                             first.node_covered_seconds, first.cloud_provider, first.region, first.zone,
                             first.provider_id, first.instance_type, first.price_model, first.cost_basis)

    def to_avro(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "node_name": self.node_name,
            "window_start_unix_ms": self.window_start_unix_ms,
            "window_seconds": self.window_seconds,
            "node_covered_seconds": self.node_covered_seconds,
            "cloud_provider": self.cloud_provider,
            "region": self.region,
            "zone": self.zone,
            "provider_id": self.provider_id,
            "instance_type": self.instance_type,
            "price_model": self.price_model,
            "cost_basis": self.cost_basis,
            "pods": [p.to_avro() for p in self.pods],
            "units": [u.to_avro() for u in self.units],
        }

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "NodeWindowShares":
        return cls(d["cluster"], d["node_name"], d["window_start_unix_ms"], d["window_seconds"],
                   d["node_covered_seconds"], d["cloud_provider"], d["region"], d["zone"], d["provider_id"],
                   d["instance_type"], d["price_model"], d["cost_basis"],
                   tuple([WindowPod.from_avro(p) for p in d["pods"]]),
                   tuple([UnitShares.from_avro(u) for u in d["units"]]))


class NodeWindowBuilder:
    """Builds one ``NodeWindowShares`` unit by unit: the one place a node-window's rows become its pods and units.

    ``add_unit`` takes one unit's rows -- any objects with ``GpuShare``'s subject and share attributes
    (``subject_kind``, ``pod_uid``, ``namespace``, ``pod_name``, ``labels``, ``carried_label_keys``,
    ``workload_kind``, ``workload_name``, ``cpu_request_millicores``, ``memory_request_bytes``,
    ``memory_used_bytes_avg``, ``memory_share``, ``compute_share``, ``cost_share``) -- and indexes its POD rows'
    pods, each pod once per node-window. Raises ``RecordShapeError`` for a unit added twice (its rows apart), a
    POD row without a pod uid, or a pod described two ways. A unit without rows is left out; ``build`` returns
    None when no unit has rows."""

    __slots__ = ("_pods", "_pod_index", "_units", "_unit_uuids")

    def __init__(self) -> None:
        self._pods: list[WindowPod] = []
        self._pod_index: dict[str, int] = {}
        self._units: list[UnitShares] = []
        self._unit_uuids: set[str] = set()

    def _index_of(self, row: Any) -> int:
        if row.subject_kind is not ShareSubjectKind.POD:
            return -1
        uid = row.pod_uid
        if uid is None:
            raise RecordShapeError(f"unit {row.gpu_uuid}: a POD row without pod uid")
        labels = row.labels
        if type(labels) is not MappingProxyType:  # read-only copies are kept as they are
            labels = _frozen_map(labels)
        pod = WindowPod(uid, row.namespace, row.pod_name, labels, tuple(row.carried_label_keys), row.workload_kind,
                        row.workload_name, row.cpu_request_millicores, row.memory_request_bytes)
        at = self._pod_index.get(uid)
        if at is None:
            at = self._pod_index[uid] = len(self._pods)
            self._pods.append(pod)
        elif self._pods[at] != pod:
            raise RecordShapeError(f"pod {uid} is described two ways in one node-window")
        return at

    def add_unit(self, gpu_uuid: str, parent_gpu_uuid: str | None, gpu_model: str, gpu_fraction: float,
                 sharing_mode: SharingMode, method: str, sample_count: int, covered_seconds: float,
                 rows: Sequence[Any], mig_profile: str | None = None, mig_gpu_instance_id: int | None = None) -> None:
        """Add one unit and its rows (in row order)."""
        if not rows:
            return
        if gpu_uuid in self._unit_uuids:
            raise RecordShapeError(f"the rows of unit {gpu_uuid} are not together")
        self._unit_uuids.add(gpu_uuid)
        index_of = self._index_of
        self._units.append(UnitShares(
            gpu_uuid, parent_gpu_uuid, gpu_model, gpu_fraction, sharing_mode, method, sample_count, covered_seconds,
            tuple([row.subject_kind for row in rows]), tuple([index_of(row) for row in rows]),
            tuple([row.memory_used_bytes_avg for row in rows]), tuple([row.memory_share for row in rows]),
            tuple([row.compute_share for row in rows]), tuple([row.cost_share for row in rows]),
            mig_profile, mig_gpu_instance_id))

    def build(self, cluster: str, node_name: str, window_start_unix_ms: int, window_seconds: int,
              node_covered_seconds: float, cloud_provider: str, region: str, zone: str, provider_id: str,
              instance_type: str, price_model: str, cost_basis: str) -> "NodeWindowShares | None":
        """The record of the units added so far (None: none had rows)."""
        if not self._units:
            return None
        return NodeWindowShares(cluster, node_name, window_start_unix_ms, window_seconds, node_covered_seconds,
                                cloud_provider, region, zone, provider_id, instance_type, price_model, cost_basis,
                                tuple(self._pods), tuple(self._units))


_LINE_FIELDS = ("line_unit_index", "line_subject_kinds", "line_pod_index", "line_cost_share", "line_cost_micro_usd",
                "line_shared_from", "line_sharing_method", "line_method", "line_cost_basis", "line_memory_share",
                "line_compute_share", "line_gpu_fraction")


@dataclass(frozen=True, slots=True)
class NodeWindowCost:
    """One node-window's bill and its cost lines (``NodeWindowCost.v1.avsc``). ``cost_records()`` is the same
    lines as the flat ``CostRecord`` stream carries them; ``from_cost_records`` builds one from those."""

    cluster: str
    node_name: str
    window_start_unix_ms: int
    window_seconds: int
    billed_milliseconds: int
    cloud_provider: str
    region: str
    zone: str
    provider_id: str
    instance_type: str
    price_model: str
    price_version: str
    price_per_hour_usd: str
    split_rule: str
    gpu_count: int
    node_cost_micro_usd: int
    gpu_cost_micro_usd: int
    node_other_micro_usd: int
    sharing: str
    pods: tuple[WindowPod, ...]
    unit_uuids: tuple[str, ...]
    line_unit_index: tuple[int, ...]
    line_subject_kinds: tuple[CostSubjectKind, ...]
    line_pod_index: tuple[int, ...]
    line_cost_share: tuple[float, ...]
    line_cost_micro_usd: tuple[int, ...]
    line_shared_from: tuple[CostSubjectKind | None, ...]
    line_sharing_method: tuple[str, ...]
    line_method: tuple[str, ...]
    line_cost_basis: tuple[str, ...]
    line_memory_share: tuple[float, ...]
    line_compute_share: tuple[float, ...]
    line_gpu_fraction: tuple[float, ...]

    @property
    def line_count(self) -> int:
        return len(self.line_subject_kinds)

    def check_shape(self) -> None:
        """Raise ``RecordShapeError`` unless every line array has one entry per line, every index names a unit or
        pod (or is -1), only POD lines name pods, and the lines add up to ``node_cost_micro_usd``."""
        n = len(self.line_subject_kinds)
        for name in _LINE_FIELDS:
            if len(getattr(self, name)) != n:
                raise RecordShapeError(f"{name} has {len(getattr(self, name))} entries for {n} lines")
        units, pods = len(self.unit_uuids), len(self.pods)
        for kind, unit, pod in zip(self.line_subject_kinds, self.line_unit_index, self.line_pod_index):
            if not -1 <= unit < units:
                raise RecordShapeError(f"a line names unit {unit} of {units}")
            if kind is CostSubjectKind.POD:
                if not 0 <= pod < pods:
                    raise RecordShapeError(f"a POD line names pod {pod} of {pods}")
            elif pod != -1:
                raise RecordShapeError(f"a {kind} line names pod {pod}")
        total = sum(self.line_cost_micro_usd)
        if total != self.node_cost_micro_usd:
            raise RecordShapeError(f"the lines add up to {total} micro-USD, the bill to {self.node_cost_micro_usd}")

    def cost_records(self) -> tuple[CostRecord, ...]:
        """One ``CostRecord`` per line, in line order (what the flat costs stream carries)."""
        out: list[CostRecord] = []
        pods, units = self.pods, self.unit_uuids
        for i in range(len(self.line_subject_kinds)):
            index = self.line_pod_index[i]
            pod = pods[index] if index >= 0 else None
            unit = self.line_unit_index[i]
            out.append(CostRecord(
                self.cluster, self.node_name, self.window_start_unix_ms, self.window_seconds,
                units[unit] if unit >= 0 else None, self.line_subject_kinds[i],
                None if pod is None else pod.pod_uid,
                None if pod is None else pod.namespace,
                None if pod is None else pod.pod_name,
                _EMPTY_MAP if pod is None else pod.labels,
                self.line_cost_share[i], self.line_cost_micro_usd[i], self.instance_type, self.price_model,
                self.price_version, () if pod is None else pod.carried_label_keys, self.line_shared_from[i],
                self.line_sharing_method[i], self.line_method[i], self.line_cost_basis[i],
                self.line_memory_share[i], self.line_compute_share[i], self.line_gpu_fraction[i],
            ))
        return tuple(out)

    @classmethod
    def from_cost_records(cls, records: Sequence[CostRecord], *, billed_milliseconds: int, cloud_provider: str,
                          region: str, zone: str, provider_id: str, price_per_hour_usd: str, split_rule: str,
                          gpu_count: int, gpu_cost_micro_usd: int, sharing: str,
                          pods: Mapping[str, WindowPod] | None = None) -> "NodeWindowCost":
        """The node-window of ``records`` (every line of one bill) with the bill's own figures. ``pods``: the
        pods by uid as the shares described them (requests, workload), else built from the lines alone. Raises
        ``RecordShapeError`` for lines of several node-windows or prices."""
        if not records:
            raise RecordShapeError("a bill has at least one line")
        first = records[0]
        key = (first.cluster, first.node_name, first.window_start_unix_ms, first.window_seconds,
               first.instance_type, first.price_model, first.price_version)
        listed: dict[str, int] = {}
        window_pods: list[WindowPod] = []
        unit_index: dict[str, int] = {}
        columns: list[list[Any]] = [[] for _ in _LINE_FIELDS]
        for record in records:
            if (record.cluster, record.node_name, record.window_start_unix_ms, record.window_seconds,
                    record.instance_type, record.price_model, record.price_version) != key:
                raise RecordShapeError(f"lines of {key[:3]} and {(record.cluster, record.node_name, record.window_start_unix_ms)}")
            pod_at = -1
            if record.subject_kind is CostSubjectKind.POD:
                if record.pod_uid is None:
                    raise RecordShapeError("a POD line without pod uid")
                pod_at = listed.get(record.pod_uid, -1)
                if pod_at < 0:
                    pod = (pods or {}).get(record.pod_uid) or WindowPod(
                        record.pod_uid, record.namespace, record.pod_name, _frozen_map(record.labels),
                        tuple(record.carried_label_keys), None, None, 0, 0)
                    pod_at = listed[record.pod_uid] = len(window_pods)
                    window_pods.append(pod)
            unit_at = -1
            if record.gpu_uuid is not None:
                unit_at = unit_index.setdefault(record.gpu_uuid, len(unit_index))
            for column, value in zip(columns, (
                    unit_at, record.subject_kind, pod_at, record.cost_share, record.cost_micro_usd,
                    record.shared_from, record.sharing_method, record.method, record.cost_basis,
                    record.memory_share, record.compute_share, record.gpu_fraction)):
                column.append(value)
        node_cost = sum(r.cost_micro_usd for r in records)
        return cls(first.cluster, first.node_name, first.window_start_unix_ms, first.window_seconds,
                   billed_milliseconds, cloud_provider, region, zone, provider_id, first.instance_type,
                   first.price_model, first.price_version, price_per_hour_usd, split_rule, gpu_count, node_cost,
                   gpu_cost_micro_usd, node_cost - gpu_cost_micro_usd, sharing, tuple(window_pods),
                   tuple(unit_index), *(tuple(c) for c in columns))

    def to_avro(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["pods"] = [p.to_avro() for p in self.pods]
        for name in _LINE_FIELDS:
            d[name] = list(d[name])
        d["unit_uuids"] = list(self.unit_uuids)
        d["line_subject_kinds"] = [str(k) for k in self.line_subject_kinds]
        d["line_shared_from"] = [None if k is None else str(k) for k in self.line_shared_from]
        return d

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "NodeWindowCost":
        values = dict(d)
        values["pods"] = tuple([WindowPod.from_avro(p) for p in d["pods"]])
        for name in _LINE_FIELDS:
            values[name] = tuple(d[name])
        values["unit_uuids"] = tuple(d["unit_uuids"])
        values["line_subject_kinds"] = tuple([_COST_KINDS[k] for k in d["line_subject_kinds"]])
        values["line_shared_from"] = tuple([None if k is None else _COST_KINDS[k] for k in d["line_shared_from"]])
        return cls(**values)


RECORD_TYPES: dict[str, type] = {
    "gpumeter.NodeSample": NodeSample,
    "gpumeter.PodEvent": PodEvent,
    "gpumeter.GpuShare": GpuShare,
    "gpumeter.CostRecord": CostRecord,
    "gpumeter.Violation": Violation,
    "gpumeter.DeadLetter": DeadLetter,
    "gpumeter.NodeWindowShares": NodeWindowShares,
    "gpumeter.NodeWindowCost": NodeWindowCost,
}
