"""Builders shared by the attributor's unit tests: samples and pod events with only the fields a test cares about."""

from __future__ import annotations

from typing import Iterable, Sequence

from schemas.records import (
    DeviceAssignment,
    GpuDeviceSample,
    NodeSample,
    NvmlError,
    PodContainer,
    PodEvent,
    PodEventType,
    SharingMode,
)

GIB = 1024**3
CLUSTER = "c1"
NODE = "node-a"
COLLECTOR_START_MS = 1_700_000_000_000


def device(
    uuid: str = "GPU-0",
    *,
    total: int = 80 * GIB,
    used: int = 0,
    reserved: int = 0,
    free: int | None = None,
    util: int | None = 0,
    mode: SharingMode = SharingMode.TIME_SLICING,
    replicas: int = 1,
    procs: Sequence[tuple[int, int, int]] = (),
    per_process_supported: bool = True,
    parent_uuid: str | None = None,
    gi: int | None = None,
    ci: int | None = None,
    profile: str | None = None,
    slices: int = 0,
    total_slices: int = 0,
    errors: Iterable[NvmlError] = (),
    index: int = 0,
    model: str = "NVIDIA H100 80GB HBM3",
) -> GpuDeviceSample:
    """``procs`` are (pod index into the sample's pod_uids or -1, used memory bytes, SM percent or -1)."""
    if free is None:
        free = max(total - reserved - used, 0)
    return GpuDeviceSample(
        uuid=uuid,
        parent_uuid=parent_uuid,
        index=index,
        model=model,
        sharing_mode=mode,
        replicas=replicas,
        mig_gpu_instance_id=gi,
        mig_compute_instance_id=ci,
        mig_profile=profile,
        mig_compute_slices=slices,
        mig_total_compute_slices=total_slices,
        memory_total_bytes=total,
        memory_used_bytes=used,
        memory_free_bytes=free,
        memory_reserved_bytes=reserved,
        gpu_utilization_percent=util,
        memory_utilization_percent=None,
        power_milliwatts=None,
        process_utilization_supported=per_process_supported,
        errors=tuple(errors),
        process_pids=tuple(1000 + i for i in range(len(procs))),
        process_pod_index=tuple(p[0] for p in procs),
        process_used_memory_bytes=tuple(p[1] for p in procs),
        process_sm_utilization_percent=tuple(p[2] for p in procs),
    )


def node_sample(
    sampled_at_unix_ms: int,
    devices: Sequence[GpuDeviceSample],
    *,
    pod_uids: Sequence[str] = (),
    sequence: int | None = None,
    interval_ms: int = 1000,
    node: str = NODE,
    cluster: str = CLUSTER,
    collector_started_at_unix_ms: int = COLLECTOR_START_MS,
    instance_type: str = "p5.48xlarge",
) -> NodeSample:
    return NodeSample(
        cluster=cluster,
        node_name=node,
        sequence=sequence if sequence is not None else sampled_at_unix_ms // 1000,
        collector_started_at_unix_ms=collector_started_at_unix_ms,
        sampled_at_unix_ms=sampled_at_unix_ms,
        interval_ms=interval_ms,
        cloud_provider="aws",
        region="us-east-1",
        instance_type=instance_type,
        price_model="on_demand",
        pod_uids=tuple(pod_uids),
        node_errors=(),
        devices=tuple(devices),
    )


def pod_event(
    uid: str,
    *,
    devices: Sequence[tuple[str, Sequence[str]]] = (),
    event_type: PodEventType = PodEventType.ADDED,
    observed_at_unix_ms: int = 0,
    started_at_unix_ms: int | None = 0,
    phase: str = "Running",
    namespace: str = "ml",
    name: str | None = None,
    node: str = NODE,
    cluster: str = CLUSTER,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    resource_version: str = "1",
    cpu_request_millicores: int = 0,
    memory_request_bytes: int = 0,
    namespace_labels: dict[str, str] | None = None,
) -> PodEvent:
    """``devices`` are (resource name, device ids) assigned to the pod's one container (which requests the pod's
    CPU and memory)."""
    requests: dict[str, int] = {}
    for resource, ids in devices:
        requests[resource] = requests.get(resource, 0) + len(ids)
    container = PodContainer(
        name="main",
        container_id=None,
        gpu_requests=requests,
        assigned_devices=tuple(DeviceAssignment(r, tuple(ids)) for r, ids in devices),
        visible_devices_env=None,
        cpu_request_millicores=cpu_request_millicores,
        memory_request_bytes=memory_request_bytes,
    )
    return PodEvent(
        event_type=event_type,
        observed_at_unix_ms=observed_at_unix_ms,
        resource_version=resource_version,
        cluster=cluster,
        node_name=node,
        uid=uid,
        namespace=namespace,
        name=name or f"pod-{uid}",
        labels=labels or {"team": f"team-{uid}"},
        annotations=annotations or {},
        workload_kind="Deployment",
        workload_name=f"wl-{uid}",
        phase=phase,
        started_at_unix_ms=started_at_unix_ms,
        gpu_requests=requests,
        containers=(container,),
        cpu_request_millicores=cpu_request_millicores,
        memory_request_bytes=memory_request_bytes,
        namespace_labels=namespace_labels or {},
    )
