"""The simulated GPUs, pods and processes of a scenario, and what really happened on them (ground truth).

``SimWorld(scenario)`` is a pure function of time: the state at ``t`` depends on the scenario and ``t`` only,
never on which times were visited before, so a replay is deterministic for a seed whatever the tick pattern.
``step(now_ms)`` moves the world's current time forward (the simulated NVML library, ``nvml_driver``, reads the
current state); ``truth(now_ms)`` and ``pods_at(now_ms)`` can be asked for any time.

How the simulated driver behaves (see docs/scenarios.md for the scenario side):

* Units. A scheduling unit is a whole GPU, or one MIG instance of a MIG-enabled GPU. A process has one CUDA
  context on each unit it runs on, and its memory and compute demand apply on each.
* Memory. A process's ``usedGpuMemory`` is its CUDA context (a few hundred MiB on a whole GPU: 256–510 MiB,
  fixed per process and unit from the seed; 64–126 MiB for an MPS client, whose context lives partly in the MPS
  server; 96–158 MiB on a MIG instance) plus what its memory behaviour asks for. The driver keeps another 2 MiB
  per context that no process is charged for, so a unit's ``used`` = Σ usedGpuMemory + 2 MiB × contexts, which is
  ≥ the sum NVML lists. Memory info v2: ``total = free + used + reserved`` (``reserved`` is the driver's; MIG
  instances report reserved 0 and their own total; a MIG parent reports the GPU total, the driver reserve and
  the sum of its instances' ``used``). An allocation that does not fit what is free is cut to what is free
  (the real process would get cudaErrorMemoryAllocation); earlier-started processes allocate first. Under MPS a
  client's ``usedGpuMemory`` is capped at ``(total − reserved) / replicas`` (the device plugin's pinned-memory
  limit) and ``preallocate_fraction`` is a fraction of that limit; on a MIG instance, of the instance.
* Time-slicing (also an "exclusive" GPU that a leaking pod shares, and processes within one MIG instance): a
  context gets the GPU when it has work; when the demands add up to ≤ 1 every process gets its demand, otherwise
  time is split in proportion to demand. ``utilization.gpu`` = round(100 × min(1, Σ granted)); a process's SM
  sample ≈ round(100 × granted) ± 2 points of seeded noise.
* MPS: clients run concurrently, each capped at its active thread percentage (default 100 / replicas); granted
  = capped demand, scaled down in proportion if the capped demands add up to more than 1. A kernel of some
  client runs for 1 − Π(1 − granted) of the time, which is ``utilization.gpu``. One MPS server process per GPU
  (host pid, cgroup ``/system.slice/nvidia-mps.service``, 32 MiB) lives from the first client's start to the
  last client's end.
* ``utilization.memory`` = round(100 × min(1, Σ granted × memory_activity)).
* Power = idle + (max − idle) × busy fraction (a MIG GPU's busy fraction weights each instance by its slices).
* A lost GPU reports nothing; its processes leave the ground truth from that moment.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from schemas.records import DeviceAssignment
from simulator.scenario import (
    MIB,
    MIG_TOTAL_COMPUTE_SLICES,
    SHARING_MIG,
    SHARING_MPS,
    ComputeSpec,
    DeviceTarget,
    GpuLostFault,
    GpuSpec,
    MemorySpec,
    NodeSpec,
    NvmlErrorFault,
    PodSpec,
    Scenario,
    ALL_DEVICE_FUNCTIONS,
    NVML_NODE_FUNCTIONS,
)

DRIVER_OVERHEAD_PER_CONTEXT_BYTES = 2 * MIB
MPS_SERVER_MEMORY_BYTES = 32 * MIB
MPS_SERVER_CGROUP = "/system.slice/nvidia-mps.service"
MPS_SERVER_COMM = "nvidia-cuda-mps-server"
SM_NOISE_POINTS = 2
SAMPLE_JITTER_US = 150_000  # NVML samples SM activity every ~1/6 s; a sample is stamped within the last period
CLOCK_TICKS_PER_SECOND = 100
_PID_BASE = 1_000
_PID_SPAN = 4_000_000


def _h(seed: int, *parts: object) -> int:
    text = "\x1f".join([str(seed), *(str(p) for p in parts)])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _h_prefix(seed: int, *parts: object) -> "hashlib.blake2b":
    """The hash state of ``_h(seed, *parts, x)`` before ``x``: ``_h_next(state, x) == _h(seed, *parts, x)``."""
    return hashlib.blake2b("\x1f".join([str(seed), *(str(p) for p in parts), ""]).encode(), digest_size=8)


def _h_next(prefix: "hashlib.blake2b", last: object) -> int:
    state = prefix.copy()
    state.update(str(last).encode())
    return int.from_bytes(state.digest(), "big")


# --------------------------------------------------------------------------------------------------------------
# Static structure


@dataclass(frozen=True, slots=True)
class SimUnit:
    """A scheduling unit: a whole GPU, or one MIG instance (``instance_index`` set, ``parent_uuid`` its GPU)."""

    node_name: str
    gpu_index: int
    instance_index: int | None
    uuid: str
    parent_uuid: str | None
    sharing_mode: str
    replicas: int
    memory_total_bytes: int
    memory_reserved_bytes: int
    gpu_instance_id: int | None
    compute_instance_id: int | None
    compute_slices: int

    @property
    def capacity_bytes(self) -> int:
        return self.memory_total_bytes - self.memory_reserved_bytes


@dataclass(frozen=True, slots=True)
class SimProcess:
    """A host process with contexts on ``unit_uuids``. Times are absolute (ms since the epoch)."""

    pid: int
    node_name: str
    comm: str
    pod_uid: str | None
    pod_key: str | None
    container_name: str | None
    container_id: str | None
    cgroup_path: str
    unit_uuids: tuple[str, ...]
    memory: MemorySpec | None
    compute: ComputeSpec | None
    memory_activity: float
    mps_active_thread_percentage: float | None
    start_ms: int
    end_ms: int | None
    exit_race_ms: int | None
    is_mps_server: bool

    def in_proc(self, now_ms: int) -> bool:
        """Whether /proc has it at ``now_ms``."""
        return self.start_ms <= now_ms and (self.end_ms is None or now_ms < self.end_ms)

    def on_gpu(self, now_ms: int) -> bool:
        """Whether the driver lists its contexts at ``now_ms`` (also at the instant of an exit race)."""
        return self.in_proc(now_ms) or (self.exit_race_ms is not None and now_ms == self.exit_race_ms)


@dataclass(frozen=True, slots=True)
class SimClaimDevice:
    """A device a container holds through a ResourceClaim (DRA node): the claim, in the pod's namespace, and the
    unit (``instance`` None: the whole GPU)."""

    claim: str
    gpu: int
    instance: int | None


@dataclass(frozen=True, slots=True)
class SimContainer:
    name: str
    container_id: str
    gpu_requests: Mapping[str, int]
    device_ids: Mapping[str, tuple[str, ...]]
    assigned_devices: tuple[DeviceAssignment, ...]
    env: Mapping[str, str]
    privileged: bool
    claim_devices: tuple["SimClaimDevice", ...] = ()

    @property
    def visible_devices_env(self) -> str | None:
        return self.env.get("NVIDIA_VISIBLE_DEVICES")


@dataclass(frozen=True, slots=True)
class SimPod:
    """A pod as the API server and the kubelet would show it while it runs."""

    uid: str
    namespace: str
    name: str
    node_name: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    owner_kind: str | None
    owner_name: str | None
    qos_class: str
    started_at_unix_ms: int
    ends_at_unix_ms: int | None
    containers: tuple[SimContainer, ...]

    @property
    def gpu_requests(self) -> Mapping[str, int]:
        total: dict[str, int] = {}
        for container in self.containers:
            for resource, count in container.gpu_requests.items():
                total[resource] = total.get(resource, 0) + count
        return MappingProxyType(total)


# --------------------------------------------------------------------------------------------------------------
# Observations


@dataclass(frozen=True, slots=True)
class ProcessObservation:
    """One context on one unit at one instant, as the driver sees it."""

    pid: int
    unit_uuid: str
    used_gpu_memory_bytes: int
    granted_fraction: float
    sm_util_percent: int | None  # None: no sample (the process ran no kernel in the last period)
    mem_util_percent: int
    sample_timestamp_us: int
    is_mps_server: bool
    is_mps_client: bool
    gpu_instance_id: int | None
    compute_instance_id: int | None


@dataclass(frozen=True, slots=True)
class UnitObservation:
    unit: SimUnit
    memory_total_bytes: int
    memory_reserved_bytes: int
    memory_used_bytes: int
    memory_free_bytes: int
    busy_fraction: float
    gpu_utilization_percent: int
    memory_utilization_percent: int
    processes: tuple[ProcessObservation, ...]


@dataclass(frozen=True, slots=True)
class GpuObservation:
    """A physical GPU: for MIG the parent's aggregate memory and one ``units`` entry per instance."""

    spec: GpuSpec
    node_name: str
    lost: bool
    memory_total_bytes: int
    memory_reserved_bytes: int
    memory_used_bytes: int
    memory_free_bytes: int
    power_milliwatts: int
    units: tuple[UnitObservation, ...]

    @property
    def gpu_utilization_percent(self) -> int:
        return self.units[0].gpu_utilization_percent

    @property
    def memory_utilization_percent(self) -> int:
        return self.units[0].memory_utilization_percent


@dataclass(frozen=True, slots=True)
class TruthRow:
    """What one pod (``pod_uid`` None: processes of no pod) really used of one unit at one instant.

    ``true_compute_fraction``: the unit time its processes were granted (time-slicing), the GPU compute they
    received (MPS), or their share of the instance's time (MIG); summed over the pod's processes on the unit.
    """

    node_name: str
    gpu_uuid: str
    parent_gpu_uuid: str | None
    pod_uid: str | None
    true_memory_bytes: int
    true_compute_fraction: float


# --------------------------------------------------------------------------------------------------------------


def _cgroup_path(node: NodeSpec, pod: PodSpec, container_id: str) -> str:
    prefix = {"containerd": "cri-containerd", "cri-o": "crio", "docker": "docker"}[node.container_runtime]
    qos = pod.qos_class
    if node.cgroup_driver == "systemd":
        uid = pod.uid.replace("-", "_")
        leaf = f"{prefix}-{container_id}.scope"
        if qos == "guaranteed":
            return f"/kubepods.slice/kubepods-pod{uid}.slice/{leaf}"
        return f"/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid}.slice/{leaf}"
    # cgroupfs: the leaf is the bare id for containerd and docker, crio-<id> for CRI-O
    leaf = f"crio-{container_id}" if node.container_runtime == "cri-o" else container_id
    if qos == "guaranteed":
        return f"/kubepods/pod{pod.uid}/{leaf}"
    return f"/kubepods/{qos}/pod{pod.uid}/{leaf}"


def _context_bytes(seed: int, pid: int, unit: SimUnit, mps_client: bool) -> int:
    if mps_client:
        base, span = 64, 32
    elif unit.instance_index is not None:
        base, span = 96, 32
    else:
        base, span = 256, 128
    return (base + 2 * (_h(seed, "ctx", pid, unit.uuid) % span)) * MIB


class _Structure:
    """What every world of one ``Scenario`` object shares: its units, processes and contexts (fixed for the
    scenario), its pods as the API server shows them, and the observations computed so far (a pure function of
    the scenario and the time, so one world's observation serves the others). The replay's collectors (one world
    per node) and its ground truth (one more) thus compute each GPU's observation once, and build the cluster's
    structure once rather than once per node."""

    def __init__(self, scenario: Scenario) -> None:
        self._seed = scenario.seed
        self._nodes: dict[str, NodeSpec] = {n.name: n for n in scenario.nodes}
        self._units: dict[str, SimUnit] = {}
        self._gpu_units: dict[tuple[str, int], tuple[SimUnit, ...]] = {}
        for node in scenario.nodes:
            for gpu in node.gpus:
                self._gpu_units[(node.name, gpu.index)] = self._build_units(node, gpu)
                for unit in self._gpu_units[(node.name, gpu.index)]:
                    self._units[unit.uuid] = unit
        self._processes: tuple[SimProcess, ...] = self._build_processes(scenario)
        self._pod_of: dict[int, str | None] = {p.pid: p.pod_uid for p in self._processes}
        # Per node, so one node's tick walks its own processes and pods only.
        self._node_processes: dict[str, tuple[SimProcess, ...]] = {
            name: tuple(p for p in self._processes if p.node_name == name) for name in self._nodes}
        self._by_unit: dict[str, list[SimProcess]] = {}
        for process in self._processes:
            for uuid in process.unit_uuids:
                self._by_unit.setdefault(uuid, []).append(process)
        for procs in self._by_unit.values():
            procs.sort(key=lambda p: (p.start_ms, p.pid))
        self._contexts: dict[tuple[int, str], int] = {
            (p.pid, u): (
                MPS_SERVER_MEMORY_BYTES
                if p.is_mps_server
                else _context_bytes(self._seed, p.pid, self._units[u], self._units[u].sharing_mode == SHARING_MPS)
            )
            for p in self._processes
            for u in p.unit_uuids
        }
        self._cache: OrderedDict[tuple[int, str, int], GpuObservation] = OrderedDict()
        self._cache_limit = 8 * max(1, len(self._gpu_units))
        # (pid, unit uuid) -> hash states of its per-instant SM noise and sample timestamp jitter
        self._noise: dict[tuple[int, str], tuple["hashlib.blake2b", "hashlib.blake2b"]] = {}
        self._pod_views = self._build_pod_views(scenario)
        self._node_pod_views = {name: tuple(v for v in self._pod_views if v[2].node_name == name)
                                for name in self._nodes}

    # ---- building ------------------------------------------------------------------------------------------

    def _build_units(self, node: NodeSpec, gpu: GpuSpec) -> tuple[SimUnit, ...]:
        if gpu.sharing.mode != SHARING_MIG:
            return (
                SimUnit(
                    node_name=node.name,
                    gpu_index=gpu.index,
                    instance_index=None,
                    uuid=gpu.uuid,
                    parent_uuid=None,
                    sharing_mode=gpu.sharing.mode,
                    replicas=gpu.sharing.replicas,
                    memory_total_bytes=gpu.memory_total_bytes,
                    memory_reserved_bytes=gpu.driver_reserved_bytes,
                    gpu_instance_id=None,
                    compute_instance_id=None,
                    compute_slices=0,
                ),
            )
        return tuple(
            SimUnit(
                node_name=node.name,
                gpu_index=gpu.index,
                instance_index=inst.index,
                uuid=inst.uuid,
                parent_uuid=gpu.uuid,
                sharing_mode=SHARING_MIG,
                replicas=1,
                memory_total_bytes=inst.memory_total_bytes,
                memory_reserved_bytes=0,
                gpu_instance_id=inst.gpu_instance_id,
                compute_instance_id=inst.compute_instance_id,
                compute_slices=inst.profile.compute_slices,
            )
            for inst in gpu.sharing.mig_instances
        )

    def _unit_of(self, node: NodeSpec, target: DeviceTarget) -> str:
        gpu = node.gpus[target.gpu]
        if target.instance is None:
            return gpu.uuid
        return gpu.sharing.mig_instances[target.instance].uuid

    def _build_processes(self, s: Scenario) -> tuple[SimProcess, ...]:
        taken: set[int] = set()

        def pid_for(*identity: object) -> int:
            pid = _PID_BASE + _h(self._seed, "pid", *identity) % _PID_SPAN
            while pid in taken:
                pid = _PID_BASE + (pid - _PID_BASE + 1) % _PID_SPAN
            taken.add(pid)
            return pid

        def ms(seconds: float) -> int:
            return s.start_unix_ms + round(seconds * 1000)

        races = {(r.pod_uid, r.container, r.process): r.at_seconds for r in s.process_exit_races}
        out: list[SimProcess] = []
        mps_clients: dict[tuple[str, int], list[SimProcess]] = {}
        for pod in s.pods:
            node = self._nodes[pod.node]
            pod_end = None if pod.end_seconds is None else ms(pod.end_seconds)
            for container in pod.containers:
                for process in container.processes:
                    pid = pid_for(pod.uid, container.name, process.name)
                    end = pod_end if process.end_seconds is None else ms(pod.start_seconds + process.end_seconds)
                    race = races.get((pod.uid, container.name, process.name))
                    if race is not None:
                        end = ms(race)
                    units = tuple(self._unit_of(node, d) for d in process.devices)
                    proc = SimProcess(
                        pid=pid,
                        node_name=node.name,
                        comm=process.name[:15],
                        pod_uid=pod.uid,
                        pod_key=pod.key,
                        container_name=container.name,
                        container_id=container.container_id,
                        cgroup_path=_cgroup_path(node, pod, container.container_id),
                        unit_uuids=units,
                        memory=process.memory,
                        compute=process.compute,
                        memory_activity=process.memory_activity,
                        mps_active_thread_percentage=self._mps_cap(
                            node, process.devices, process.mps_active_thread_percentage
                        ),
                        start_ms=ms(pod.start_seconds + process.start_seconds),
                        end_ms=end,
                        exit_race_ms=None if race is None else ms(race),
                        is_mps_server=False,
                    )
                    out.append(proc)
                    for d in process.devices:
                        if node.gpus[d.gpu].sharing.mode == SHARING_MPS:
                            mps_clients.setdefault((node.name, d.gpu), []).append(proc)
        for host in s.host_processes:
            node = self._nodes[host.node]
            proc = SimProcess(
                pid=pid_for("host", host.node, host.name, host.start_seconds),
                node_name=node.name,
                comm=host.name[:15],
                pod_uid=None,
                pod_key=None,
                container_name=None,
                container_id=None,
                cgroup_path=host.cgroup,
                unit_uuids=tuple(self._unit_of(node, d) for d in host.devices),
                memory=host.memory,
                compute=host.compute,
                memory_activity=host.memory_activity,
                mps_active_thread_percentage=self._mps_cap(node, host.devices, host.mps_active_thread_percentage),
                start_ms=ms(host.start_seconds),
                end_ms=None if host.end_seconds is None else ms(host.end_seconds),
                exit_race_ms=None,
                is_mps_server=False,
            )
            out.append(proc)
            for d in host.devices:
                if node.gpus[d.gpu].sharing.mode == SHARING_MPS:
                    mps_clients.setdefault((node.name, d.gpu), []).append(proc)
        for (node_name, gpu_index), clients in sorted(mps_clients.items()):
            gpu = self._nodes[node_name].gpus[gpu_index]
            ends = [c.end_ms for c in clients]
            out.append(
                SimProcess(
                    pid=pid_for("mps-server", node_name, gpu_index),
                    node_name=node_name,
                    comm=MPS_SERVER_COMM[:15],
                    pod_uid=None,
                    pod_key=None,
                    container_name=None,
                    container_id=None,
                    cgroup_path=MPS_SERVER_CGROUP,
                    unit_uuids=(gpu.uuid,),
                    memory=None,
                    compute=None,
                    memory_activity=0.0,
                    mps_active_thread_percentage=None,
                    start_ms=min(c.start_ms for c in clients),
                    end_ms=None if any(e is None for e in ends) else max(e for e in ends if e is not None),
                    exit_race_ms=None,
                    is_mps_server=True,
                )
            )
        return tuple(out)

    @staticmethod
    def _mps_cap(node: NodeSpec, devices: tuple[DeviceTarget, ...], given: float | None) -> float | None:
        mps = [node.gpus[d.gpu] for d in devices if node.gpus[d.gpu].sharing.mode == SHARING_MPS]
        if not mps:
            return None
        if given is not None:
            return given
        return 100.0 / mps[0].sharing.replicas

    @staticmethod
    def _build_pod_views(s: Scenario) -> tuple[tuple[int, int | None, SimPod], ...]:
        """(start ms, end ms or None, the pod as shown while it runs) for every pod, in scenario order."""
        views = []
        for pod in s.pods:
            start = s.start_unix_ms + round(pod.start_seconds * 1000)
            end = None if pod.end_seconds is None else s.start_unix_ms + round(pod.end_seconds * 1000)
            containers = []
            for c in pod.containers:
                ids: dict[str, list[str]] = {}
                for a in c.devices:
                    if a.claim is None:  # devices held through claims are no device-plugin ids
                        ids.setdefault(a.resource, []).append(a.device_id)
                containers.append(
                    SimContainer(
                        name=c.name,
                        container_id=c.container_id,
                        gpu_requests=c.requests,
                        device_ids=MappingProxyType({k: tuple(v) for k, v in ids.items()}),
                        assigned_devices=tuple(DeviceAssignment(k, tuple(v)) for k, v in ids.items()),
                        env=c.env,
                        privileged=c.privileged,
                        claim_devices=tuple(SimClaimDevice(a.claim, a.gpu, a.instance)
                                            for a in c.devices if a.claim is not None),
                    )
                )
            views.append((start, end, SimPod(
                uid=pod.uid,
                namespace=pod.namespace,
                name=pod.name,
                node_name=pod.node,
                labels=pod.labels,
                annotations=pod.annotations,
                owner_kind=pod.owner_kind,
                owner_name=pod.owner_name,
                qos_class=pod.qos_class,
                started_at_unix_ms=start,
                ends_at_unix_ms=end,
                containers=tuple(containers),
            )))
        return tuple(views)


# Scenario object (by identity) -> its worlds' shared structure; an entry goes when its scenario is collected.
_STRUCTURES: dict[int, _Structure] = {}


def _structure_of(scenario: Scenario) -> _Structure:
    key = id(scenario)
    structure = _STRUCTURES.get(key)
    if structure is None:
        structure = _STRUCTURES[key] = _Structure(scenario)
        weakref.finalize(scenario, _STRUCTURES.pop, key, None)
    return structure


class SimWorld:
    """The simulated cluster of one scenario. See the module docstring for the behaviour it models.

    Worlds of the same ``Scenario`` object share its structure and the observations computed so far (see
    ``_Structure``); each world has its own current time and its own fake ``/proc`` bookkeeping.
    """

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self._now_ms: int | None = None
        self._written_pids: dict[Path, set[int]] = {}
        shared = _structure_of(scenario)
        self._seed = shared._seed
        self._nodes = shared._nodes
        self._units = shared._units
        self._gpu_units = shared._gpu_units
        self._processes = shared._processes
        self._pod_of = shared._pod_of
        self._node_processes = shared._node_processes
        self._by_unit = shared._by_unit
        self._contexts = shared._contexts
        self._cache = shared._cache
        self._cache_limit = shared._cache_limit
        self._noise = shared._noise
        self._pod_views = shared._pod_views
        self._node_pod_views = shared._node_pod_views

    # ---- public structure -----------------------------------------------------------------------------------

    @property
    def now_ms(self) -> int:
        """The world's current time; before the first ``step`` the scenario start."""
        return self.scenario.start_unix_ms if self._now_ms is None else self._now_ms

    def node(self, name: str) -> NodeSpec:
        return self._nodes[name]

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(self._nodes)

    def units_of_gpu(self, node_name: str, gpu_index: int) -> tuple[SimUnit, ...]:
        return self._gpu_units[(node_name, gpu_index)]

    @property
    def processes(self) -> tuple[SimProcess, ...]:
        """Every process of the scenario over its whole life (pods', host ones and MPS servers)."""
        return self._processes

    def process(self, pid: int) -> SimProcess:
        for p in self._processes:
            if p.pid == pid:
                return p
        raise KeyError(pid)

    # ---- time -----------------------------------------------------------------------------------------------

    def step(self, now_ms: int) -> None:
        """Move the current time to ``now_ms``; a world never goes back (``ValueError``)."""
        if self._now_ms is not None and now_ms < self._now_ms:
            raise ValueError(f"the world is at {self._now_ms} ms and does not go back to {now_ms} ms")
        self._now_ms = now_ms

    def _elapsed_s(self, process: SimProcess, now_ms: int) -> float:
        return (now_ms - process.start_ms) / 1000.0

    def gpu_lost(self, node_name: str, gpu_index: int, now_ms: int | None = None) -> bool:
        now = self.now_ms if now_ms is None else now_ms
        for fault in self._nodes[node_name].faults:
            if isinstance(fault, GpuLostFault) and fault.gpu == gpu_index:
                if now >= self.scenario.start_unix_ms + round(fault.at_seconds * 1000):
                    return True
        return False

    def nvml_fault(self, node_name: str, function: str, gpu_index: int | None, now_ms: int | None = None) -> str | None:
        """The NVML error name a configured fault makes ``function`` return now on ``gpu_index``, or None."""
        now = self.now_ms if now_ms is None else now_ms
        start = self.scenario.start_unix_ms
        for fault in self._nodes[node_name].faults:
            if not isinstance(fault, NvmlErrorFault):
                continue
            if fault.function == ALL_DEVICE_FUNCTIONS:
                if function in NVML_NODE_FUNCTIONS:
                    continue
            elif fault.function != function:
                continue
            if fault.gpu is not None and fault.gpu != gpu_index:
                continue
            if now < start + round(fault.from_seconds * 1000):
                continue
            if fault.until_seconds is not None and now >= start + round(fault.until_seconds * 1000):
                continue
            return fault.error
        return None

    # ---- state ----------------------------------------------------------------------------------------------

    def _gpu_at(self, now_ms: int, node_name: str, gpu_index: int) -> GpuObservation:
        """One GPU's observation at ``now_ms``, computed once. GPUs do not depend on each other, so a node's tick
        computes its own GPUs only: a replay of N nodes costs N times one node's, not N times N."""
        key = (now_ms, node_name, gpu_index)
        cached = self._cache.get(key)
        if cached is None:
            cached = self._cache[key] = self._observe_gpu(self._nodes[node_name],
                                                          self._nodes[node_name].gpus[gpu_index], now_ms)
            # A few instants of every GPU (the truth, NVML's calls of one tick and the next) stay cached.
            while len(self._cache) > self._cache_limit:
                self._cache.popitem(last=False)
        return cached

    def _gpus_at(self, now_ms: int, node_name: str | None) -> list[tuple[str, GpuObservation]]:
        nodes = self.scenario.nodes if node_name is None else (self._nodes[node_name],)
        return [(node.name, self._gpu_at(now_ms, node.name, gpu.index)) for node in nodes for gpu in node.gpus]

    def _observe_unit(self, unit: SimUnit, now_ms: int) -> UnitObservation:
        procs = [p for p in self._by_unit.get(unit.uuid, ()) if p.on_gpu(now_ms)]
        mps = unit.sharing_mode == SHARING_MPS
        mps_limit = unit.capacity_bytes // unit.replicas if mps else None
        used_so_far = sum(self._contexts[(p.pid, unit.uuid)] for p in procs)
        used_so_far += DRIVER_OVERHEAD_PER_CONTEXT_BYTES * len(procs)
        memory: dict[int, int] = {}
        for p in procs:
            context = self._contexts[(p.pid, unit.uuid)]
            if p.memory is None:
                memory[p.pid] = context
                continue
            visible = mps_limit if mps_limit is not None else unit.capacity_bytes
            wanted = p.memory.wanted_bytes(self._elapsed_s(p, now_ms), visible)
            wanted = max(0, wanted) // (2 * MIB) * (2 * MIB)
            if mps_limit is not None:
                wanted = min(wanted, max(0, mps_limit - context))
            granted_bytes = min(wanted, max(0, unit.capacity_bytes - used_so_far))
            used_so_far += granted_bytes
            memory[p.pid] = context + granted_bytes
        demands: dict[int, float] = {}
        for p in procs:
            if p.compute is None or not p.in_proc(now_ms):
                demands[p.pid] = 0.0
                continue
            demand = p.compute.demand(self._elapsed_s(p, now_ms))
            if mps and p.mps_active_thread_percentage is not None:
                demand = min(demand, p.mps_active_thread_percentage / 100.0)
            demands[p.pid] = demand
        total_demand = sum(demands.values())
        scale = 1.0 if total_demand <= 1.0 else 1.0 / total_demand
        granted = {pid: d * scale for pid, d in demands.items()}
        if mps:
            idle = 1.0
            for g in granted.values():
                idle *= 1.0 - g
            busy = 1.0 - idle
        else:
            busy = min(1.0, sum(granted.values()))
        mem_busy = min(1.0, sum(granted[p.pid] * p.memory_activity for p in procs))
        now_us = now_ms * 1000
        observations = []
        for p in procs:
            g = granted[p.pid]
            noise_key = (p.pid, unit.uuid)
            hashes = self._noise.get(noise_key)
            if hashes is None:
                hashes = self._noise[noise_key] = (_h_prefix(self._seed, "sm", p.pid, unit.uuid),
                                                   _h_prefix(self._seed, "ts", p.pid, unit.uuid))
            sm: int | None = None
            if g > 0:
                noise = _h_next(hashes[0], now_ms) % (2 * SM_NOISE_POINTS + 1) - SM_NOISE_POINTS
                sm = min(100, max(0, round(100 * g) + noise))
            observations.append(
                ProcessObservation(
                    pid=p.pid,
                    unit_uuid=unit.uuid,
                    used_gpu_memory_bytes=memory[p.pid],
                    granted_fraction=g,
                    sm_util_percent=sm,
                    mem_util_percent=min(100, round(100 * g * p.memory_activity)),
                    sample_timestamp_us=now_us - _h_next(hashes[1], now_ms) % SAMPLE_JITTER_US,
                    is_mps_server=p.is_mps_server,
                    is_mps_client=mps and not p.is_mps_server,
                    gpu_instance_id=unit.gpu_instance_id,
                    compute_instance_id=unit.compute_instance_id,
                )
            )
        used = used_so_far
        free = max(0, unit.capacity_bytes - used)
        return UnitObservation(
            unit=unit,
            memory_total_bytes=unit.memory_total_bytes,
            memory_reserved_bytes=unit.memory_reserved_bytes,
            memory_used_bytes=unit.memory_total_bytes - unit.memory_reserved_bytes - free,
            memory_free_bytes=free,
            busy_fraction=busy,
            gpu_utilization_percent=round(100 * busy),
            memory_utilization_percent=round(100 * mem_busy),
            processes=tuple(observations),
        )

    def _observe_gpu(self, node: NodeSpec, gpu: GpuSpec, now_ms: int) -> GpuObservation:
        lost = self.gpu_lost(node.name, gpu.index, now_ms)
        units = tuple(self._observe_unit(u, now_ms) for u in self._gpu_units[(node.name, gpu.index)])
        if gpu.sharing.mode == SHARING_MIG:
            used = sum(u.memory_used_bytes for u in units)
            busy = sum(u.busy_fraction * u.unit.compute_slices for u in units) / MIG_TOTAL_COMPUTE_SLICES
        else:
            used = units[0].memory_used_bytes
            busy = units[0].busy_fraction
        reserved = gpu.driver_reserved_bytes
        power = gpu.power_idle_milliwatts + round((gpu.power_max_milliwatts - gpu.power_idle_milliwatts) * busy)
        return GpuObservation(
            spec=gpu,
            node_name=node.name,
            lost=lost,
            memory_total_bytes=gpu.memory_total_bytes,
            memory_reserved_bytes=reserved,
            memory_used_bytes=used,
            memory_free_bytes=gpu.memory_total_bytes - reserved - used,
            power_milliwatts=power,
            units=units,
        )

    def gpu_observation(self, node_name: str, gpu_index: int) -> GpuObservation:
        """The driver's view of a physical GPU at the current time (whether or not it is lost)."""
        return self._gpu_at(self.now_ms, node_name, gpu_index)

    def observation_at(self, now_ms: int, node_name: str, gpu_index: int) -> GpuObservation:
        return self._gpu_at(now_ms, node_name, gpu_index)

    def process_observations(self, now_ms: int, node_name: str | None = None) -> tuple[ProcessObservation, ...]:
        """Every context the driver lists at ``now_ms`` on GPUs that are not lost (of one node, or all)."""
        out: list[ProcessObservation] = []
        for _name, gpu in self._gpus_at(now_ms, node_name):
            if gpu.lost:
                continue
            for unit in gpu.units:
                out.extend(unit.processes)
        return tuple(out)

    # ---- ground truth ---------------------------------------------------------------------------------------

    def truth(self, now_ms: int, node_name: str | None = None) -> tuple[TruthRow, ...]:
        """Per unit and pod (``pod_uid`` None for processes of no pod), what was really used at ``now_ms`` (on one
        node, or all).

        One row per (unit, pod) with at least one context on the unit; lost GPUs have no rows. Rows are ordered
        by node, GPU index, unit and first appearance of the pod.
        """
        rows: list[TruthRow] = []
        pod_of = self._pod_of
        for node_name, gpu in self._gpus_at(now_ms, node_name):
            if gpu.lost:
                continue
            for unit in gpu.units:
                per_pod: dict[str | None, list[float]] = {}
                for obs in unit.processes:
                    acc = per_pod.setdefault(pod_of[obs.pid], [0, 0.0])
                    acc[0] += obs.used_gpu_memory_bytes
                    acc[1] += obs.granted_fraction
                for pod_uid, (memory, compute) in per_pod.items():
                    rows.append(
                        TruthRow(
                            node_name=node_name,
                            gpu_uuid=unit.unit.uuid,
                            parent_gpu_uuid=unit.unit.parent_uuid,
                            pod_uid=pod_uid,
                            true_memory_bytes=int(memory),
                            true_compute_fraction=compute,
                        )
                    )
        return tuple(rows)

    # ---- Kubernetes view ------------------------------------------------------------------------------------

    def pods_at(self, now_ms: int, node_name: str | None = None) -> tuple[SimPod, ...]:
        """Pods running at ``now_ms`` (started, not yet ended), in scenario order; of one node or all."""
        views = self._pod_views if node_name is None else self._node_pod_views[node_name]
        return tuple(pod for start, end, pod in views if start <= now_ms and (end is None or now_ms < end))

    # ---- fake /proc -----------------------------------------------------------------------------------------

    def _stat_line(self, process: SimProcess) -> str:
        node = self._nodes[process.node_name]
        boot_ms = self.scenario.start_unix_ms - node.uptime_seconds_at_start * 1000
        start_ticks = (process.start_ms - boot_ms) * CLOCK_TICKS_PER_SECOND // 1000
        # Fields 3.. of proc(5) stat: state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt
        # utime stime cutime cstime priority nice num_threads itrealvalue starttime vsize rss ... (52 in all).
        rest = ["S", "1", str(process.pid), str(process.pid), "0", "-1", "4194560", "0", "0", "0", "0"]
        rest += ["0", "0", "0", "0", "20", "0", "8", "0", str(start_ticks), "0", "0"]
        rest += ["0"] * (50 - len(rest))
        return f"{process.pid} ({process.comm}) " + " ".join(rest) + "\n"

    def write_proc(self, root: Path, node_name: str | None = None) -> tuple[int, ...]:
        """Write ``<root>/<pid>/cgroup`` and ``<root>/<pid>/stat`` for processes alive now (one node or all).

        cgroup files use the cgroup v2 form (``0::<path>``) of the node's cgroup driver and runtime; host
        processes get their own ``/system.slice/...`` path. Directories this world wrote earlier for processes
        that have since exited are removed, so a pid NVML still lists after its exit has no /proc entry.
        Returns the pids written.
        """
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        now = self.now_ms
        candidates = self._processes if node_name is None else self._node_processes[node_name]
        alive = [p for p in candidates if p.in_proc(now)]
        pids = {p.pid for p in alive}
        previous = self._written_pids.get(root, set())
        for pid in previous - pids:
            shutil.rmtree(root / str(pid), ignore_errors=True)
        root_text = os.fspath(root)
        for p in alive:
            # A string path for the check made on every alive process every tick (pathlib's join costs more).
            if p.pid in previous and os.path.isdir(f"{root_text}/{p.pid}"):
                continue
            directory = root / str(p.pid)
            directory.mkdir(exist_ok=True)
            _write_atomic(directory / "cgroup", f"0::{p.cgroup_path}\n")
            _write_atomic(directory / "stat", self._stat_line(p))
        self._written_pids[root] = pids
        return tuple(sorted(pids))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
