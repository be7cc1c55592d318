"""Typed, immutable records: one dataclass per Avro record type, with exact conversion to and from the Avro dicts.

Field names and order match the ``.avsc`` files (a unit test checks it). Sequences are tuples and maps are
read-only mappings so that a record, once built, cannot change under a consumer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Mapping


def _frozen_map(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(value or {}))


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
    process_container_index: tuple[int, ...]
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
            tuple(d["process_container_index"]),
            tuple(d["process_pod_index"]),
            tuple(d["process_used_memory_bytes"]),
            tuple(d["process_sm_utilization_percent"]),
            tuple(d["mps_server_pids"]) if d.get("mps_server_pids") else (),
        )


_PROCESS_FIELDS = (
    "process_pids",
    "process_container_index",
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
    container_ids: tuple[str, ...]
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
            "container_ids": list(self.container_ids),
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
            tuple(d["container_ids"]),
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

    def to_avro(self) -> dict[str, Any]:
        return {"resource_name": self.resource_name, "device_ids": list(self.device_ids)}

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "DeviceAssignment":
        return cls(d["resource_name"], tuple(d["device_ids"]))


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


RECORD_TYPES: dict[str, type] = {
    "gpumeter.NodeSample": NodeSample,
    "gpumeter.PodEvent": PodEvent,
    "gpumeter.GpuShare": GpuShare,
    "gpumeter.CostRecord": CostRecord,
    "gpumeter.Violation": Violation,
    "gpumeter.DeadLetter": DeadLetter,
}
