"""Pure assembly of one tick's NodeSample from NVML device samples and process identities.

Contract: ``assemble_node_sample`` copies every device field through unchanged, maps each process pid to the pod
its cgroup names (-1 where unknown), lists each distinct pod uid once per node in first-seen order, and never drops
a process. (The container a process runs in is not on the wire since NodeSample v3: no consumer read it, and the
pod events carry every container's id.)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Sequence

from schemas.records import GpuDeviceSample, NodeSample, NvmlError

_COPIED_FIELDS = tuple(
    f.name for f in fields(GpuDeviceSample) if f.name != "process_pod_index"
)


@dataclass(frozen=True)
class NodeFacts:
    """What the collector knows about its node for pricing (``nodefacts``: its Node object, then configuration)."""

    cluster: str
    node_name: str
    cloud_provider: str
    region: str
    instance_type: str
    price_model: str
    zone: str = ""
    provider_id: str = ""


@dataclass(frozen=True)
class TickInfo:
    sequence: int
    collector_started_at_unix_ms: int
    sampled_at_unix_ms: int
    interval_ms: int


class _Interner:
    __slots__ = ("values", "index")

    def __init__(self) -> None:
        self.values: list[str] = []
        self.index: dict[str, int] = {}

    def __call__(self, value: str | None) -> int:
        if value is None:
            return -1
        position = self.index.get(value)
        if position is None:
            position = self.index[value] = len(self.values)
            self.values.append(value)
        return position


def assemble_node_sample(
    facts: NodeFacts,
    tick: TickInfo,
    raw_devices: Sequence[Any],
    identity_of: Callable[[int], Any],
    node_errors: Sequence[NvmlError] = (),
) -> NodeSample:
    """Build the tick's NodeSample. ``identity_of(pid)`` returns an object with a ``pod_uid`` (may be None) or None
    for a process whose cgroup names no container."""
    pods = _Interner()
    devices = []
    for raw in raw_devices:
        pod_index = []
        for pid in raw.process_pids:
            identity = identity_of(pid)
            pod_index.append(-1 if identity is None else pods(identity.pod_uid))
        values = {name: getattr(raw, name) for name in _COPIED_FIELDS}
        values["process_pod_index"] = tuple(pod_index)
        devices.append(GpuDeviceSample(**values))
    return NodeSample(
        cluster=facts.cluster,
        node_name=facts.node_name,
        sequence=tick.sequence,
        collector_started_at_unix_ms=tick.collector_started_at_unix_ms,
        sampled_at_unix_ms=tick.sampled_at_unix_ms,
        interval_ms=tick.interval_ms,
        cloud_provider=facts.cloud_provider,
        region=facts.region,
        instance_type=facts.instance_type,
        price_model=facts.price_model,
        pod_uids=tuple(pods.values),
        node_errors=tuple(node_errors),
        devices=tuple(devices),
        zone=facts.zone,
        provider_id=facts.provider_id,
    )


def unmapped_process_count(sample: NodeSample) -> int:
    return sum(1 for device in sample.devices for index in device.process_pod_index if index < 0)


def nvml_error_counts(sample: NodeSample) -> Mapping[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for error in list(sample.node_errors) + [e for d in sample.devices for e in d.errors]:
        key = (error.nvml_function, error.error_code)
        counts[key] = counts.get(key, 0) + 1
    return counts
