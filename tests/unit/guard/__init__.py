"""Builders for the guard's tests: typed records with only the fields a test cares about spelled out."""

from __future__ import annotations

from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

from schemas.records import (
    CostRecord,
    CostSubjectKind,
    DeviceAssignment,
    GpuDeviceSample,
    GpuShare,
    NodeSample,
    NvmlError,
    PodContainer,
    PodEvent,
    PodEventType,
    ShareSubjectKind,
    SharingMode,
)

GIB = 1 << 30
CLUSTER = "test-cluster"
NODE = "gpu-node-1"
T0 = 1_782_864_000_000  # 2026-07-01T00:00:00Z

GPU_A = "GPU-0a0a0a0a-0000-4000-8000-00000000000a"
GPU_B = "GPU-0b0b0b0b-0000-4000-8000-00000000000b"
GPU_C = "GPU-0c0c0c0c-0000-4000-8000-00000000000c"
MIG_1 = "MIG-11111111-0000-4000-8000-000000000001"
MIG_2 = "MIG-22222222-0000-4000-8000-000000000002"

UID_1 = "00000000-0000-4000-8000-000000000001"
UID_2 = "00000000-0000-4000-8000-000000000002"
UID_3 = "00000000-0000-4000-8000-000000000003"


def proc(pid: int, pod_index: int, memory_bytes: int, sm_percent: int = 0) -> tuple[int, int, int, int]:
    return (pid, pod_index, memory_bytes, sm_percent)


def device(
    uuid: str,
    *,
    index: int = 0,
    parent: str | None = None,
    mode: SharingMode = SharingMode.EXCLUSIVE,
    replicas: int = 1,
    total: int = 80 * GIB,
    reserved: int = GIB // 2,
    used: int | None = None,
    processes: Sequence[tuple[int, int, int, int]] = (),
    errors: Iterable[NvmlError] = (),
    gi: int | None = None,
    ci: int | None = None,
    utilization: int | None = 50,
) -> GpuDeviceSample:
    process_memory = sum(p[2] for p in processes)
    used_bytes = process_memory if used is None else used
    return GpuDeviceSample(
        uuid=uuid,
        parent_uuid=parent,
        index=index,
        model="NVIDIA H100 80GB HBM3",
        sharing_mode=SharingMode.MIG if parent is not None else mode,
        replicas=replicas,
        mig_gpu_instance_id=gi,
        mig_compute_instance_id=ci,
        mig_profile="1g.10gb" if parent is not None else None,
        mig_compute_slices=1 if parent is not None else 0,
        mig_total_compute_slices=0,
        memory_total_bytes=total,
        memory_used_bytes=used_bytes,
        memory_free_bytes=max(0, total - reserved - used_bytes),
        memory_reserved_bytes=reserved,
        gpu_utilization_percent=utilization,
        memory_utilization_percent=10 if utilization is not None else None,
        power_milliwatts=300_000,
        process_utilization_supported=True,
        errors=tuple(errors),
        process_pids=tuple(p[0] for p in processes),
        process_pod_index=tuple(p[1] for p in processes),
        process_used_memory_bytes=tuple(p[2] for p in processes),
        process_sm_utilization_percent=tuple(p[3] for p in processes),
    )


def sample(
    devices: Sequence[GpuDeviceSample],
    pod_uids: Sequence[str] = (),
    *,
    t: int = T0,
    node: str = NODE,
    cluster: str = CLUSTER,
    interval_ms: int = 10_000,
    node_errors: Iterable[NvmlError] = (),
    sequence: int | None = None,
) -> NodeSample:
    return NodeSample(
        cluster=cluster,
        node_name=node,
        sequence=(t - T0) // 1000 if sequence is None else sequence,
        collector_started_at_unix_ms=T0 - 3_600_000,
        sampled_at_unix_ms=t,
        interval_ms=interval_ms,
        cloud_provider="aws",
        region="us-east-1",
        instance_type="p5.48xlarge",
        price_model="on_demand",
        pod_uids=tuple(pod_uids),
        node_errors=tuple(node_errors),
        devices=tuple(devices),
    )


def container(
    name: str = "main",
    *,
    devices: Sequence[tuple[str, Sequence[str]]] = (),
    requests: Mapping[str, int] | None = None,
    env: str | None = None,
    privileged: bool = False,
) -> PodContainer:
    if requests is None:
        counts: dict[str, int] = {}
        for resource, ids in devices:
            counts[resource] = counts.get(resource, 0) + len(ids)
        requests = counts
    return PodContainer(
        name=name,
        container_id=None,
        gpu_requests=MappingProxyType(dict(requests)),
        assigned_devices=tuple(DeviceAssignment(r, tuple(ids)) for r, ids in devices),
        visible_devices_env=env,
        privileged=privileged,
    )


def pod_event(
    uid: str,
    name: str,
    *,
    namespace: str = "default",
    node: str = NODE,
    containers: Sequence[PodContainer] | None = None,
    labels: Mapping[str, str] | None = None,
    event_type: PodEventType = PodEventType.ADDED,
    t: int = T0,
    phase: str = "Running",
    resource_version: str | None = None,
    cluster: str = CLUSTER,
) -> PodEvent:
    containers = tuple(containers) if containers is not None else (container(),)
    requests: dict[str, int] = {}
    for c in containers:
        for resource, count in c.gpu_requests.items():
            requests[resource] = requests.get(resource, 0) + count
    return PodEvent(
        event_type=event_type,
        observed_at_unix_ms=t,
        resource_version=resource_version or str(t),
        cluster=cluster,
        node_name=node,
        uid=uid,
        namespace=namespace,
        name=name,
        labels=MappingProxyType(dict(labels or {})),
        annotations=MappingProxyType({}),
        workload_kind=None,
        workload_name=None,
        phase=phase,
        started_at_unix_ms=T0 - 60_000,
        gpu_requests=MappingProxyType(requests),
        containers=containers,
    )


def share(
    gpu_uuid: str,
    *,
    window_start: int,
    kind: ShareSubjectKind = ShareSubjectKind.POD,
    pod_uid: str | None = None,
    namespace: str | None = None,
    pod_name: str | None = None,
    compute: float = 0.0,
    memory: float = 0.0,
    rows_in_unit: int = 4,
    parent: str | None = None,
    covered_seconds: float = 60.0,
    window_seconds: int = 60,
    node: str = NODE,
    cluster: str = CLUSTER,
    memory_used_bytes_avg: float = 0.0,
) -> GpuShare:
    return GpuShare(
        cluster=cluster,
        node_name=node,
        window_start_unix_ms=window_start,
        window_seconds=window_seconds,
        node_covered_seconds=covered_seconds,
        units_in_node=1,
        rows_in_unit=rows_in_unit,
        cloud_provider="aws",
        region="us-east-1",
        instance_type="p5.48xlarge",
        price_model="on_demand",
        gpu_uuid=gpu_uuid,
        parent_gpu_uuid=parent,
        gpu_model="NVIDIA H100 80GB HBM3",
        gpu_fraction=1.0,
        sharing_mode=SharingMode.MIG if parent else SharingMode.EXCLUSIVE,
        subject_kind=kind,
        pod_uid=pod_uid,
        namespace=namespace,
        pod_name=pod_name,
        labels=MappingProxyType({}),
        workload_kind=None,
        workload_name=None,
        memory_used_bytes_avg=memory_used_bytes_avg,
        memory_share=memory,
        compute_share=compute,
        cost_share=1.0 if kind is ShareSubjectKind.POD else 0.0,
        method="exclusive",
        sample_count=6,
        covered_seconds=covered_seconds,
    )


def unit_window(gpu_uuid: str, window_start: int, pods: Sequence[tuple[str, float]], *,
                unattributed_compute: float = 0.0, parent: str | None = None,
                covered_seconds: float = 60.0) -> list[GpuShare]:
    """A unit's complete rows for one window: one POD row per (uid, compute share), then the four buckets."""
    rows_in_unit = len(pods) + 4
    rows = [
        share(gpu_uuid, window_start=window_start, pod_uid=uid, namespace="default", pod_name=f"pod-{uid[-1]}",
              compute=compute, rows_in_unit=rows_in_unit, parent=parent, covered_seconds=covered_seconds)
        for uid, compute in pods
    ]
    busy = sum(c for _, c in pods)
    idle = max(0.0, 1.0 - busy - unattributed_compute)
    for kind, compute in ((ShareSubjectKind.IDLE, idle), (ShareSubjectKind.DRIVER_RESERVED, 0.0),
                          (ShareSubjectKind.UNATTRIBUTED, unattributed_compute), (ShareSubjectKind.UNAVAILABLE, 0.0)):
        rows.append(share(gpu_uuid, window_start=window_start, kind=kind, compute=compute,
                          rows_in_unit=rows_in_unit, parent=parent, covered_seconds=covered_seconds))
    return rows


def cost(
    gpu_uuid: str | None,
    *,
    window_start: int,
    micro_usd: int,
    pod_uid: str | None = None,
    namespace: str | None = None,
    team: str | None = None,
    kind: CostSubjectKind = CostSubjectKind.POD,
    node: str = NODE,
    cluster: str = CLUSTER,
    window_seconds: int = 60,
) -> CostRecord:
    return CostRecord(
        cluster=cluster,
        node_name=node,
        window_start_unix_ms=window_start,
        window_seconds=window_seconds,
        gpu_uuid=gpu_uuid,
        subject_kind=kind,
        pod_uid=pod_uid,
        namespace=namespace,
        pod_name=None if pod_uid is None else f"pod-{pod_uid[-1]}",
        labels=MappingProxyType({"team": team} if team else {}),
        cost_share=1.0,
        cost_micro_usd=micro_usd,
        instance_type="p5.48xlarge",
        price_model="on_demand",
        price_version="test",
    )


def nvml_error(function: str, code: str) -> NvmlError:
    return NvmlError(function, code, f"{function} failed: {code}")
