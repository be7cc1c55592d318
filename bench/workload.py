"""A synthetic, deterministic fleet for the benchmarks: nodes of time-sliced GPUs with one process per pod.

``Fleet(nodes, gpus_per_node=8, pods_per_gpu=8)``: every node is a ``p5.48xlarge`` (8 × H100 80GB, priced in the
bundled catalog) whose GPUs are time-sliced into ``pods_per_gpu`` replicas; each replica is held by one pod
(``nvidia.com/gpu.shared``, device id ``GPU-<uuid>::<r>``) that runs one process on it. ``node_sample(i, tick)``
gives the node's ``NodeSample`` at tick ``tick`` (1 Hz from ``start_unix_ms``): per-process memory and SM
utilisation vary with the tick, device utilisation is the processes' sum plus a little, and some memory is held
outside any process, so every attribution bucket is non-trivial. ``sample_dict`` gives the same tick as the
Avro dict, built by patching a per-node template (what the stream benchmark's load generator sends at 1,250
nodes × 1 Hz without spending a core on it). Everything is a function of (node, tick): same input, same bytes.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from schemas.records import (
    DeviceAssignment,
    GpuDeviceSample,
    NodeSample,
    PodContainer,
    PodEvent,
    PodEventType,
    SharingMode,
)

CLUSTER = "bench"
GIB = 1 << 30
MIB = 1 << 20
H100_TOTAL_BYTES = 85_520_809_984
H100_RESERVED_BYTES = 597_688_320
H100_MODEL = "NVIDIA H100 80GB HBM3"
INSTANCE_TYPE = "p5.48xlarge"
REGION = "us-east-1"
SHARED_RESOURCE = "nvidia.com/gpu.shared"
# 2026-07-01T00:00:00Z: window-aligned for every window length that divides a day.
START_UNIX_MS = 1_782_864_000_000
NAMESPACES = ("serving", "research", "training", "batch")
TEAMS = ("assistants", "search", "ranking", "media", "foundation", "platform")


def _uuid(*parts: object) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "gpumeter-bench/" + "/".join(map(str, parts))))


@dataclass(frozen=True)
class PodPlan:
    uid: str
    namespace: str
    name: str
    container_id: str
    gpu_index: int
    replica: int
    base_memory_bytes: int


@dataclass(frozen=True)
class NodePlan:
    index: int
    name: str
    gpu_uuids: tuple[str, ...]
    pods: tuple[PodPlan, ...]  # GPU-major: pods[g * pods_per_gpu + r]
    pid_base: int


class Fleet:
    """``nodes`` nodes of ``gpus_per_node`` time-sliced GPUs, ``pods_per_gpu`` single-process pods on each."""

    def __init__(self, nodes: int, gpus_per_node: int = 8, pods_per_gpu: int = 8, *, cluster: str = CLUSTER,
                 start_unix_ms: int = START_UNIX_MS, interval_ms: int = 1000) -> None:
        if nodes < 1 or gpus_per_node < 1 or pods_per_gpu < 1:
            raise ValueError("a fleet needs at least one node, GPU and pod per GPU")
        self.node_count = nodes
        self.gpus_per_node = gpus_per_node
        self.pods_per_gpu = pods_per_gpu
        self.cluster = cluster
        self.start_unix_ms = start_unix_ms
        self.interval_ms = interval_ms
        self._templates: dict[int, dict[str, Any]] = {}

    @property
    def gpu_count(self) -> int:
        return self.node_count * self.gpus_per_node

    def node(self, index: int) -> NodePlan:
        return self._plans[index]

    @cached_property
    def _plans(self) -> tuple[NodePlan, ...]:
        return tuple(self._plan(i) for i in range(self.node_count))

    def _plan(self, index: int) -> NodePlan:
        name = f"gpu-node-{index:05d}"
        gpus = tuple(f"GPU-{_uuid(name, 'gpu', g)}" for g in range(self.gpus_per_node))
        pods = []
        for g in range(self.gpus_per_node):
            for r in range(self.pods_per_gpu):
                k = g * self.pods_per_gpu + r
                namespace = NAMESPACES[(index + k) % len(NAMESPACES)]
                uid = _uuid(name, "pod", k)
                pods.append(PodPlan(
                    uid=uid,
                    namespace=namespace,
                    name=f"{namespace}-{index:05d}-{k:03d}",
                    container_id=uuid.uuid5(uuid.NAMESPACE_OID, uid).hex + uuid.uuid5(uuid.NAMESPACE_DNS, uid).hex,
                    gpu_index=g,
                    replica=r,
                    # 1..6 GiB, so that eight processes fit an 80 GB GPU with room to vary.
                    base_memory_bytes=(1 + (index * 7 + k * 5) % 6) * GIB,
                ))
        return NodePlan(index, name, gpus, tuple(pods), pid_base=10_000 + index * 1000)

    # -- pods -------------------------------------------------------------------------------------------------

    def pod_events(self, node_index: int, observed_at_unix_ms: int | None = None) -> tuple[PodEvent, ...]:
        """ADDED events of every pod of the node, with the replica id the kubelet assigned it."""
        plan = self.node(node_index)
        observed = self.start_unix_ms - 60_000 if observed_at_unix_ms is None else observed_at_unix_ms
        events = []
        for pod in plan.pods:
            device_id = f"{plan.gpu_uuids[pod.gpu_index]}::{pod.replica}"
            container = PodContainer(
                name="main",
                container_id=f"containerd://{pod.container_id}",
                gpu_requests={SHARED_RESOURCE: 1},
                assigned_devices=(DeviceAssignment(SHARED_RESOURCE, (device_id,)),),
                visible_devices_env=None,
            )
            team = TEAMS[(node_index + pod.gpu_index + pod.replica) % len(TEAMS)]
            events.append(PodEvent(
                event_type=PodEventType.ADDED,
                observed_at_unix_ms=observed,
                resource_version=str(1000 + node_index),
                cluster=self.cluster,
                node_name=plan.name,
                uid=pod.uid,
                namespace=pod.namespace,
                name=pod.name,
                labels={"team": team, "app": pod.name.rsplit("-", 1)[0]},
                annotations={},
                workload_kind="Deployment",
                workload_name=pod.name.rsplit("-", 1)[0],
                phase="Running",
                started_at_unix_ms=observed,
                gpu_requests={SHARED_RESOURCE: 1},
                containers=(container,),
            ))
        return tuple(events)

    # -- samples ----------------------------------------------------------------------------------------------

    def sampled_at(self, tick: int) -> int:
        return self.start_unix_ms + tick * self.interval_ms

    def _device_values(self, plan: NodePlan, g: int, tick: int) -> dict[str, Any]:
        pods = plan.pods[g * self.pods_per_gpu:(g + 1) * self.pods_per_gpu]
        memory = [p.base_memory_bytes + ((tick * 37 + p.replica * 11 + plan.index) % 64) * MIB for p in pods]
        budget = max(90 // self.pods_per_gpu, 1)
        sm = [1 + (tick * 3 + p.replica * 7 + g) % budget for p in pods]
        # Every fourth tick one process has no sample (NVML's -1: it ran no kernel in the period).
        if tick % 4 == 0:
            sm[tick % len(sm)] = -1
        # Memory held outside the listed processes (another context, a process that just exited): UNATTRIBUTED.
        unexplained = (64 + (tick % 8) * 16) * MIB
        used = min(sum(memory) + unexplained, H100_TOTAL_BYTES - H100_RESERVED_BYTES)
        return {
            "memory_used_bytes": used,
            "memory_free_bytes": H100_TOTAL_BYTES - H100_RESERVED_BYTES - used,
            "gpu_utilization_percent": min(100, sum(max(s, 0) for s in sm) + 2),
            "memory_utilization_percent": min(100, 10 + (tick + g) % 40),
            "power_milliwatts": 150_000 + ((tick * 13 + g * 17) % 500) * 1000,
            "process_used_memory_bytes": memory,
            "process_sm_utilization_percent": sm,
        }

    def node_sample(self, node_index: int, tick: int) -> NodeSample:
        """The node's typed ``NodeSample`` at ``tick`` (sequence = tick, 1 s interval)."""
        plan = self.node(node_index)
        devices = []
        for g in range(self.gpus_per_node):
            values = self._device_values(plan, g, tick)
            first = g * self.pods_per_gpu
            indices = tuple(range(first, first + self.pods_per_gpu))
            devices.append(GpuDeviceSample(
                uuid=plan.gpu_uuids[g],
                parent_uuid=None,
                index=g,
                model=H100_MODEL,
                sharing_mode=SharingMode.TIME_SLICING,
                replicas=self.pods_per_gpu,
                mig_gpu_instance_id=None,
                mig_compute_instance_id=None,
                mig_profile=None,
                mig_compute_slices=0,
                mig_total_compute_slices=0,
                memory_total_bytes=H100_TOTAL_BYTES,
                memory_used_bytes=values["memory_used_bytes"],
                memory_free_bytes=values["memory_free_bytes"],
                memory_reserved_bytes=H100_RESERVED_BYTES,
                gpu_utilization_percent=values["gpu_utilization_percent"],
                memory_utilization_percent=values["memory_utilization_percent"],
                power_milliwatts=values["power_milliwatts"],
                process_utilization_supported=True,
                errors=(),
                process_pids=tuple(plan.pid_base + i for i in indices),
                process_pod_index=indices,
                process_used_memory_bytes=tuple(values["process_used_memory_bytes"]),
                process_sm_utilization_percent=tuple(values["process_sm_utilization_percent"]),
            ))
        return NodeSample(
            cluster=self.cluster,
            node_name=plan.name,
            sequence=tick,
            collector_started_at_unix_ms=self.start_unix_ms - 3_600_000,
            sampled_at_unix_ms=self.sampled_at(tick),
            interval_ms=self.interval_ms,
            cloud_provider="aws",
            region=REGION,
            instance_type=INSTANCE_TYPE,
            price_model="on_demand",
            pod_uids=tuple(p.uid for p in plan.pods),
            node_errors=(),
            devices=tuple(devices),
        )

    def sample_dict(self, node_index: int, tick: int, sampled_at_unix_ms: int | None = None) -> dict[str, Any]:
        """``node_sample(node_index, tick).to_avro()``, built from a cached per-node template; ``sampled_at``
        overrides the tick's time (the load generator stamps its real send time)."""
        template = self._templates.get(node_index)
        if template is None:
            template = self._templates[node_index] = self.node_sample(node_index, 0).to_avro()
        plan = self.node(node_index)
        d = copy.copy(template)
        d["sequence"] = tick
        d["sampled_at_unix_ms"] = self.sampled_at(tick) if sampled_at_unix_ms is None else sampled_at_unix_ms
        devices = []
        for g, dev in enumerate(template["devices"]):
            dev = dict(dev)
            dev.update(self._device_values(plan, g, tick))
            devices.append(dev)
        d["devices"] = devices
        return d
