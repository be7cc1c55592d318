"""Simulation scenarios: a YAML file → a validated, fully resolved, immutable ``Scenario``.

``load_scenario(path_or_text)`` parses and validates a scenario (the format is documented field by field in
``docs/scenarios.md``). Everything the YAML leaves out that must be fixed for a deterministic replay is resolved
here from the seed: GPU and MIG UUIDs, pod UIDs, container ids. Every error is a ``ScenarioError`` whose message
starts with the path of the offending value (``pods[2].containers[0].devices[1].replica: ...``).

The result is checked against what Kubernetes and the NVIDIA stack would allow: device assignments use the
resource names the device plugin advertises for the GPU's sharing mode, no device id is handed to two pods at the
same time, requests equal assignments, MIG layouts fit the GPU, and a process only runs on a device its
container can see (its assignment, or every GPU with ``NVIDIA_VISIBLE_DEVICES=all`` or ``privileged``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import pynvml
import yaml

from schemas.devices import MPS_THREAD_ENV, VISIBLE_DEVICES_ENV
from schemas.hami import HAMI_ALLOCATED_ANNOTATION, HAMI_DEVICE_TYPE, HAMI_NODE_ANNOTATION

from gpumeter.errors import GpumeterError

MIB = 1 << 20
GIB = 1 << 30

SHARING_EXCLUSIVE = "exclusive"
SHARING_TIME_SLICING = "time_slicing"
SHARING_MPS = "mps"
SHARING_MIG = "mig"
SHARING_MODES = (SHARING_EXCLUSIVE, SHARING_TIME_SLICING, SHARING_MPS, SHARING_MIG)

CLOUD_PROVIDERS = ("aws", "gcp", "azure", "custom")
PRICE_MODELS = ("on_demand", "spot", "committed")
CGROUP_DRIVERS = ("systemd", "cgroupfs")
CONTAINER_RUNTIMES = ("containerd", "cri-o", "docker")
QOS_CLASSES = ("guaranteed", "burstable", "besteffort")

RESOURCE_GPU = "nvidia.com/gpu"
RESOURCE_GPU_SHARED = "nvidia.com/gpu.shared"
RESOURCE_MIG_PREFIX = "nvidia.com/mig-"
RESOURCE_HAMI_MEMORY = "nvidia.com/gpumem"
RESOURCE_HAMI_CORES = "nvidia.com/gpucores"
HAMI_SLOTS_PER_GPU = 10  # HAMi's deviceSplitCount default: the nvidia.com/gpu slots its device plugin registers


# NVML functions a fault may target. The node-level ones take no device handle; a fault on them has no ``gpu``.
NVML_NODE_FUNCTIONS = frozenset({"nvmlInit", "nvmlDeviceGetCount", "nvmlSystemGetDriverVersion"})
NVML_DEVICE_FUNCTIONS = frozenset(
    {
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetHandleByUUID",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetMigMode",
        "nvmlDeviceIsMigDeviceHandle",
        "nvmlDeviceGetMaxMigDeviceCount",
        "nvmlDeviceGetMigDeviceHandleByIndex",
        "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetComputeInstanceId",
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        "nvmlDeviceGetAttributes",
        "nvmlDeviceGetAttributes_v2",
        "nvmlDeviceGetGpuInstanceProfileInfo",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetMPSComputeRunningProcesses",
        "nvmlDeviceGetProcessUtilization",
    }
)
ALL_DEVICE_FUNCTIONS = "*"

NVML_ERROR_CODES: Mapping[str, int] = MappingProxyType(
    {name[len("NVML_ERROR_") :]: getattr(pynvml, name) for name in dir(pynvml) if name.startswith("NVML_ERROR_")}
)
"""NVML return codes by name without the ``NVML_ERROR_`` prefix (``GPU_IS_LOST`` → 15)."""

_GPU_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_POD_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(B|KiB|MiB|GiB|TiB|kB|KB|MB|GB|TB)\s*")
_SIZE_UNITS = {
    "B": 1,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
    "kB": 10**3,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}
_MIG_CAPABLE_MODEL = re.compile(r"A100|A800|H100|H800|H200|H20\b|GH200")


class ScenarioError(GpumeterError):
    """A scenario that cannot be used. ``path`` names the offending value (``nodes[0].gpus[1].sharing``)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}" if path else problem)
        self.path = path
        self.problem = problem


# --------------------------------------------------------------------------------------------------------------
# MIG profiles


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One MIG GPU-instance profile of a GPU memory class.

    ``compute_slices`` of 7, ``memory_slices`` of 8; ``nvml_profile_id`` is the ``NVML_GPU_INSTANCE_PROFILE_*``
    constant ``nvmlDeviceGetGpuInstanceProfileInfo`` takes for it.
    """

    name: str
    compute_slices: int
    memory_slices: int
    max_instances: int
    nvml_profile_id: int


MIG_TOTAL_COMPUTE_SLICES = 7
MIG_TOTAL_MEMORY_SLICES = 8


def _profiles(*rows: tuple[str, int, int, int, int]) -> Mapping[str, MigProfile]:
    return MappingProxyType({r[0]: MigProfile(*r) for r in rows})


_P = pynvml
MIG_PROFILES_BY_MEMORY_CLASS: Mapping[str, Mapping[str, MigProfile]] = MappingProxyType(
    {
        "40gb": _profiles(
            ("1g.5gb", 1, 1, 7, _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE),
            ("1g.10gb", 1, 2, 4, _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2),
            ("2g.10gb", 2, 2, 3, _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE),
            ("3g.20gb", 3, 4, 2, _P.NVML_GPU_INSTANCE_PROFILE_3_SLICE),
            ("4g.20gb", 4, 4, 1, _P.NVML_GPU_INSTANCE_PROFILE_4_SLICE),
            ("7g.40gb", 7, 8, 1, _P.NVML_GPU_INSTANCE_PROFILE_7_SLICE),
        ),
        "80gb": _profiles(
            ("1g.10gb", 1, 1, 7, _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE),
            ("1g.20gb", 1, 2, 4, _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2),
            ("2g.20gb", 2, 2, 3, _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE),
            ("3g.40gb", 3, 4, 2, _P.NVML_GPU_INSTANCE_PROFILE_3_SLICE),
            ("4g.40gb", 4, 4, 1, _P.NVML_GPU_INSTANCE_PROFILE_4_SLICE),
            ("7g.80gb", 7, 8, 1, _P.NVML_GPU_INSTANCE_PROFILE_7_SLICE),
        ),
        "141gb": _profiles(
            ("1g.18gb", 1, 1, 7, _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE),
            ("1g.35gb", 1, 2, 4, _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2),
            ("2g.35gb", 2, 2, 3, _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE),
            ("3g.71gb", 3, 4, 2, _P.NVML_GPU_INSTANCE_PROFILE_3_SLICE),
            ("4g.71gb", 4, 4, 1, _P.NVML_GPU_INSTANCE_PROFILE_4_SLICE),
            ("7g.141gb", 7, 8, 1, _P.NVML_GPU_INSTANCE_PROFILE_7_SLICE),
        ),
    }
)

# GPU instance ids NVML gives each profile size, in placement order (as nvidia-smi shows on A100/H100: the full
# GPU is GI 0, 1-slice instances are GIs 7..13). Instances take the first id of their pool not yet used.
_GI_ID_POOLS: Mapping[int, tuple[int, ...]] = MappingProxyType(
    {7: (0,), 4: (1,), 3: (1, 2), 2: (3, 4, 5), 1: (7, 8, 9, 10, 11, 12, 13)}
)


def mig_memory_class(memory_total_bytes: int) -> str | None:
    """The MIG profile table a GPU of this framebuffer size uses (``40gb``, ``80gb``, ``141gb``) or None."""
    gib = memory_total_bytes / GIB
    if 36 <= gib <= 48:
        return "40gb"
    if 72 <= gib <= 100:
        return "80gb"
    if 130 <= gib <= 160:
        return "141gb"
    return None


# --------------------------------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True, slots=True)
class MigInstanceSpec:
    """One MIG device: a GPU instance with one full-size compute instance (CI id 0)."""

    index: int
    profile: MigProfile
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str
    memory_total_bytes: int


@dataclass(frozen=True, slots=True)
class SharingSpec:
    """``mode`` one of SHARING_MODES; ``replicas`` 1 for exclusive and MIG; ``mig_instances`` for MIG only."""

    mode: str
    replicas: int
    mig_instances: tuple[MigInstanceSpec, ...]


@dataclass(frozen=True, slots=True)
class GpuSpec:
    index: int
    model: str
    uuid: str
    memory_total_bytes: int
    driver_reserved_bytes: int
    memory_v2_used_includes_reserved: bool
    power_idle_milliwatts: int
    power_max_milliwatts: int
    sharing: SharingSpec

    @property
    def mig_capable(self) -> bool:
        return bool(_MIG_CAPABLE_MODEL.search(self.model)) and mig_memory_class(self.memory_total_bytes) is not None


@dataclass(frozen=True, slots=True)
class GpuLostFault:
    """From ``at_seconds`` on, every NVML call on GPU ``gpu`` (and its MIG devices) fails with GPU_IS_LOST."""

    gpu: int
    at_seconds: float


@dataclass(frozen=True, slots=True)
class NvmlErrorFault:
    """NVML ``function`` (or every device function for ``*``) returns ``error`` in [from, until) seconds.

    ``gpu`` None: on every GPU (node-level functions never have one).
    """

    function: str
    error: str
    gpu: int | None
    from_seconds: float
    until_seconds: float | None


@dataclass(frozen=True, slots=True)
class ProcessExitRaceFault:
    """The process exits at ``at_seconds`` while the driver still lists its context.

    At that instant NVML still lists it (with its memory) but it ran no kernel, it is gone from ``/proc`` and
    from process utilization samples; afterwards it is gone everywhere.
    """

    pod: str  # namespace/name
    container: str
    process: str
    at_seconds: float
    pod_uid: str  # the incarnation of ``pod`` alive at ``at_seconds`` (a recreated pod has one name, two uids)


Fault = GpuLostFault | NvmlErrorFault | ProcessExitRaceFault


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    cloud_provider: str
    region: str
    instance_type: str
    price_model: str
    cgroup_driver: str
    container_runtime: str
    driver_version: str
    uptime_seconds_at_start: int
    gpus: tuple[GpuSpec, ...]
    faults: tuple[GpuLostFault | NvmlErrorFault, ...]
    zone: str = ""
    provider_id: str = ""
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    device_id_strategy: str = "uuid"  # the device plugin's deviceIDStrategy: uuid | index
    allocation: str = "device_plugin"  # how pods get GPUs: device_plugin | dra (ResourceClaims)
    # How far the node's clock is off (its collector's and kubelet's timestamps), seconds; + ahead, - behind. The
    # broker's append time stays the scenario's: what gpumeter trusts (gpumeter.clockskew).
    clock_offset_seconds: int = 0


@dataclass(frozen=True, slots=True)
class DeviceAssignmentSpec:
    """One device the kubelet gave a container: ``device_id`` is the id the device plugin uses (on a DRA node the
    scenario's own name for the unit and replica, which only the simulator sees). ``claim`` names the
    ResourceClaim (in the pod's namespace) that holds the device on a DRA node, None on a device-plugin node."""

    resource: str
    gpu: int
    replica: int | None
    instance: int | None
    device_id: str
    claim: str | None = None


@dataclass(frozen=True, slots=True)
class DeviceTarget:
    """Where a process really runs: a GPU (``instance`` None) or one MIG instance of it."""

    gpu: int
    instance: int | None


@dataclass(frozen=True, slots=True)
class MemorySpec:
    """GPU memory a process wants on each device it runs on, besides its CUDA context.

    ``kind``: ``preallocate`` (``fraction`` of the memory the process can see, taken at start as JAX and
    PyTorch caching allocators do), ``fixed`` (``bytes``), ``ramp`` (``from_bytes`` → ``to_bytes`` linearly over
    ``over_seconds`` from process start) or ``steps`` (``steps``: (seconds since process start, bytes)).
    """

    kind: str
    fraction: float = 0.0
    bytes: int = 0
    from_bytes: int = 0
    to_bytes: int = 0
    over_seconds: float = 0.0
    steps: tuple[tuple[float, int], ...] = ()

    def wanted_bytes(self, elapsed_seconds: float, visible_bytes: int) -> int:
        """Bytes wanted ``elapsed_seconds`` after the process started when it can see ``visible_bytes``."""
        if self.kind == "preallocate":
            return int(self.fraction * visible_bytes)
        if self.kind == "fixed":
            return self.bytes
        if self.kind == "ramp":
            if self.over_seconds <= 0 or elapsed_seconds >= self.over_seconds:
                return self.to_bytes
            progress = max(0.0, elapsed_seconds) / self.over_seconds
            return int(self.from_bytes + (self.to_bytes - self.from_bytes) * progress)
        current = self.steps[0][1]
        for at, value in self.steps:
            if elapsed_seconds >= at:
                current = value
        return current


@dataclass(frozen=True, slots=True)
class ComputeSpec:
    """Fraction of the device's time (0..1) the process would keep kernels running if it had it to itself.

    ``steps``: (seconds since process start, demand), first at 0.
    """

    steps: tuple[tuple[float, float], ...]

    def demand(self, elapsed_seconds: float) -> float:
        current = self.steps[0][1]
        for at, value in self.steps:
            if elapsed_seconds >= at:
                current = value
        return current


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One host process with CUDA contexts on ``devices``; times are seconds since its pod started."""

    name: str
    devices: tuple[DeviceTarget, ...]
    memory: MemorySpec
    compute: ComputeSpec
    memory_activity: float
    mps_active_thread_percentage: float | None
    start_seconds: float
    end_seconds: float | None


@dataclass(frozen=True, slots=True)
class ContainerSpec:
    name: str
    container_id: str
    requests: Mapping[str, int]
    devices: tuple[DeviceAssignmentSpec, ...]
    env: Mapping[str, str]
    privileged: bool
    processes: tuple[ProcessSpec, ...]
    hami: "HamiSpec | None" = None
    hami_forged: "HamiAnnotationSpec | None" = None


@dataclass(frozen=True, slots=True)
class HamiSpec:
    """A container's HAMi vGPU: the GPU HAMi's scheduler gave it (written on the pod as
    ``hami.io/vgpu-devices-allocated``) and its limits. ``devices`` of the container then holds the placeholder
    the kubelet hands out for ``nvidia.com/gpu`` instead: slot ``slot`` of GPU ``placeholder_gpu``."""

    gpu: int
    memory_mib: int
    cores_percent: int
    placeholder_gpu: int
    slot: int


@dataclass(frozen=True, slots=True)
class HamiAnnotationSpec:
    """A container's entry in ``hami.io/vgpu-devices-allocated`` that HAMi did not write (``hami_forged_annotation``:
    the pod's owner did): the GPU it names and its limits, as HAMi would write them. The container's devices stay
    its own -- what the kubelet gave it, real ids or none."""

    gpu: int
    memory_mib: int
    cores_percent: int


@dataclass(frozen=True, slots=True)
class PodSpec:
    namespace: str
    name: str
    uid: str
    node: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    owner_kind: str | None
    owner_name: str | None
    qos_class: str
    start_seconds: float
    end_seconds: float | None
    containers: tuple[ContainerSpec, ...]

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    """A Namespace object and its labels (what the platform writes; the collector carries them on pod events)."""

    name: str
    labels: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class HostProcessSpec:
    """A process of no pod (a node agent, a benchmark run over ssh); times are scenario seconds."""

    node: str
    name: str
    cgroup: str
    devices: tuple[DeviceTarget, ...]
    memory: MemorySpec
    compute: ComputeSpec
    memory_activity: float
    mps_active_thread_percentage: float | None
    start_seconds: float
    end_seconds: float | None


@dataclass(frozen=True, slots=True, weakref_slot=True)  # weakref: simulator.world shares per Scenario object
class Scenario:
    cluster: str
    seed: int
    interval_seconds: float
    duration_seconds: float
    start_unix_ms: int
    nodes: tuple[NodeSpec, ...]
    pods: tuple[PodSpec, ...]
    host_processes: tuple[HostProcessSpec, ...]
    process_exit_races: tuple[ProcessExitRaceFault, ...]
    namespaces: tuple[NamespaceSpec, ...] = ()

    @property
    def interval_ms(self) -> int:
        return round(self.interval_seconds * 1000)

    @property
    def end_unix_ms(self) -> int:
        return self.start_unix_ms + round(self.duration_seconds * 1000)

    def all_namespaces(self) -> tuple[NamespaceSpec, ...]:
        """The declared namespaces, then every other namespace a pod runs in (without labels): the Namespace
        objects a cluster running these pods has."""
        declared = {spec.name for spec in self.namespaces}
        implied = dict.fromkeys(pod.namespace for pod in self.pods if pod.namespace not in declared)
        return self.namespaces + tuple(NamespaceSpec(name, MappingProxyType({})) for name in implied)

    def namespace_labels(self, namespace: str) -> Mapping[str, str]:
        """The labels of the namespace called ``namespace`` (``{}`` for one the scenario does not declare)."""
        for spec in self.namespaces:
            if spec.name == namespace:
                return spec.labels
        return MappingProxyType({})

    def node(self, name: str) -> NodeSpec:
        """The node called ``name``; ``ScenarioError`` naming the scenario's nodes when there is none."""
        for node in self.nodes:
            if node.name == name:
                return node
        known = ", ".join(node.name for node in self.nodes)
        raise ScenarioError("nodes", f"no node {name!r} in the scenario (its nodes: {known})")

    def tick_times_ms(self) -> tuple[int, ...]:
        """The collector ticks of a replay: ``start + k × interval`` for k = 1 .. duration // interval.

        Each tick stands for the interval that ends at it, so every tick's period lies inside the scenario.
        """
        count = int(round(self.duration_seconds * 1000) // self.interval_ms)
        return tuple(self.start_unix_ms + k * self.interval_ms for k in range(1, count + 1))


# --------------------------------------------------------------------------------------------------------------
# Deterministic identifiers


def _digest(seed: int, *parts: object) -> bytes:
    text = "\x1f".join([str(seed), *(str(p) for p in parts)])
    return hashlib.sha256(text.encode()).digest()


def _uuid_text(digest: bytes) -> str:
    h = bytearray(digest[:16])
    h[6] = (h[6] & 0x0F) | 0x40  # version 4 layout, as the API server and the driver print them
    h[8] = (h[8] & 0x3F) | 0x80
    x = h.hex()
    return f"{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:32]}"


def deterministic_gpu_uuid(seed: int, node: str, index: int) -> str:
    return "GPU-" + _uuid_text(_digest(seed, "gpu", node, index))


def deterministic_mig_uuid(seed: int, gpu_uuid: str, gpu_instance_id: int) -> str:
    return "MIG-" + _uuid_text(_digest(seed, "mig", gpu_uuid, gpu_instance_id))


def default_zone(provider: str, region: str) -> str:
    """The zone a node of ``provider`` in ``region`` is given when the scenario names none (each provider's own
    zone naming: ``us-east-1a``, ``us-central1-a``, ``eastus-1``; none on premises)."""
    return {"aws": f"{region}a", "gcp": f"{region}-a", "azure": f"{region}-1"}.get(provider, "")


def deterministic_provider_id(seed: int, provider: str, zone: str, node: str) -> str:
    """A ``spec.providerID`` in the provider's own form, from the seed (empty on premises)."""
    digest = _digest(seed, "provider-id", node).hex()
    if provider == "aws":
        return f"aws:///{zone}/i-0{digest[:16]}"
    if provider == "gcp":
        return f"gce://gpumeter-sim-{digest[:6]}/{zone}/{node}"
    if provider == "azure":
        subscription = _uuid_text(_digest(seed, "azure-subscription"))
        return (f"azure:///subscriptions/{subscription}/resourceGroups/mc_gpumeter-sim/providers/"
                f"Microsoft.Compute/virtualMachineScaleSets/aks-gpu-{digest[:8]}-vmss/virtualMachines/"
                f"{int(digest[8:12], 16) % 100}")
    return ""


def deterministic_pod_uid(seed: int, namespace: str, name: str, recreated_at_seconds: float | None = None) -> str:
    """A pod's UID from the seed and its name; a pod recreated under a name an earlier pod of the scenario had
    (a StatefulSet pod deleted and created again) gets a new one, from its start too (``recreated_at_seconds``)."""
    if recreated_at_seconds is None:
        return _uuid_text(_digest(seed, "pod", namespace, name))
    return _uuid_text(_digest(seed, "pod", namespace, name, "recreated", f"{recreated_at_seconds:g}"))


def deterministic_container_id(seed: int, pod_uid: str, container: str) -> str:
    return _digest(seed, "container", pod_uid, container).hex()


# --------------------------------------------------------------------------------------------------------------
# Reading helpers

_MISSING = object()


class _Map:
    """A YAML mapping being read: remembers which keys were used so that unknown ones can be reported."""

    def __init__(self, raw: Any, path: str) -> None:
        if not isinstance(raw, Mapping):
            raise ScenarioError(path, f"must be a mapping, got {_kind(raw)}")
        for key in raw:
            if not isinstance(key, str):
                raise ScenarioError(path, f"keys must be strings, got {key!r}")
        self.raw = raw
        self.path = path
        self._used: set[str] = set()

    def sub(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return key in self.raw

    def get(self, key: str, default: Any = _MISSING) -> Any:
        self._used.add(key)
        if key in self.raw:
            return self.raw[key]
        if default is _MISSING:
            raise ScenarioError(self.sub(key), "is required")
        return default

    def done(self) -> None:
        unknown = sorted(set(self.raw) - self._used)
        if unknown:
            raise ScenarioError(self.path or "<top>", f"unknown field(s): {', '.join(unknown)}")


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _str(value: Any, path: str, *, pattern: re.Pattern[str] | None = None, what: str = "") -> str:
    if not isinstance(value, str) or not value:
        raise ScenarioError(path, f"must be a non-empty string, got {_kind(value)}")
    if pattern is not None and not pattern.fullmatch(value):
        raise ScenarioError(path, f"{value!r} is not {what}")
    return value


def _choice(value: Any, path: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ScenarioError(path, f"must be one of {', '.join(choices)}, got {value!r}")
    return value


def _int(value: Any, path: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(path, f"must be an integer, got {_kind(value)}")
    if minimum is not None and value < minimum:
        raise ScenarioError(path, f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ScenarioError(path, f"must be at most {maximum}, got {value}")
    return value


def _number(value: Any, path: str, *, minimum: float | None = None, maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ScenarioError(path, f"must be a number, got {_kind(value)}")
    if minimum is not None and value < minimum:
        raise ScenarioError(path, f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ScenarioError(path, f"must be at most {maximum}, got {value}")
    return float(value)


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ScenarioError(path, f"must be true or false, got {_kind(value)}")
    return value


def _bytes(value: Any, path: str) -> int:
    """An int of bytes or a string such as ``80GiB`` / ``512 MiB`` / ``2.5GB``."""
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if not match:
            raise ScenarioError(
                path, f"{value!r} is not a size (bytes, or a number with B/KiB/MiB/GiB/TiB/kB/MB/GB/TB)"
            )
        return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])
    return _int(value, path, minimum=0)


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise ScenarioError(path, f"must be a list, got {_kind(value)}")
    return value


def _str_map(value: Any, path: str) -> Mapping[str, str]:
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, Mapping):
        raise ScenarioError(path, f"must be a mapping of strings, got {_kind(value)}")
    out: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            raise ScenarioError(path, f"keys must be non-empty strings, got {key!r}")
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise ScenarioError(f"{path}.{key}", f"must be a string, got {_kind(item)}")
        out[key] = str(item)
    return MappingProxyType(out)


def _start_time(value: Any, path: str) -> int:
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, str):
        text = value.strip()
        if text.endswith("Z"):
            text = text[:-1] + "+00:00"
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            raise ScenarioError(path, f"{value!r} is not an ISO 8601 time") from None
    else:
        raise ScenarioError(path, f"must be an ISO 8601 UTC time such as 2026-07-01T00:00:00Z, got {_kind(value)}")
    if moment.tzinfo is None or moment.utcoffset() != timezone.utc.utcoffset(None):
        raise ScenarioError(path, "must be in UTC (end it with Z)")
    return round(moment.timestamp() * 1000)


def _seconds(value: Any, path: str, duration: float) -> float:
    return _number(value, path, minimum=0.0, maximum=duration)


# --------------------------------------------------------------------------------------------------------------
# Known GPU models: default power limits when the scenario gives none (board TDP; idle ~10 %).

_POWER_MAX_MILLIWATTS = (
    ("H200", 700_000),
    ("H100", 700_000),
    ("A100", 400_000),
    ("A10G", 300_000),
    ("L40S", 350_000),
    ("L4", 72_000),
    ("T4", 70_000),
)


def _default_power_max(model: str) -> int:
    for marker, watts in _POWER_MAX_MILLIWATTS:
        if marker in model:
            return watts
    return 300_000


# --------------------------------------------------------------------------------------------------------------
# Sections


def _read_sharing(raw: Any, path: str, gpu_uuid: str, gpu: "_GpuDraft", seed: int) -> SharingSpec:
    m = _Map(raw, path)
    mode = _choice(m.get("mode"), m.sub("mode"), SHARING_MODES)
    if mode == SHARING_EXCLUSIVE:
        m.done()
        return SharingSpec(mode, 1, ())
    if mode in (SHARING_TIME_SLICING, SHARING_MPS):
        replicas = _int(m.get("replicas"), m.sub("replicas"), minimum=2, maximum=48 if mode == SHARING_MPS else 1024)
        m.done()
        return SharingSpec(mode, replicas, ())
    # MIG
    if not _MIG_CAPABLE_MODEL.search(gpu.model):
        raise ScenarioError(m.sub("mode"), f"{gpu.model!r} does not support MIG (A100/H100/H200 class GPUs do)")
    memory_class = mig_memory_class(gpu.memory_total_bytes)
    if memory_class is None:
        raise ScenarioError(m.sub("mode"), f"no MIG profile table for a {gpu.memory_total_bytes} byte GPU")
    profiles = MIG_PROFILES_BY_MEMORY_CLASS[memory_class]
    names = _list(m.get("instances"), m.sub("instances"))
    m.done()
    if not names:
        raise ScenarioError(path + ".instances", "a MIG GPU needs at least one instance")
    slice_bytes = ((gpu.memory_total_bytes - gpu.driver_reserved_bytes) // MIG_TOTAL_MEMORY_SLICES) // MIB * MIB
    used_ids: set[int] = set()
    counts: dict[str, int] = {}
    compute_total = memory_total = 0
    instances: list[MigInstanceSpec] = []
    for i, name in enumerate(names):
        ipath = f"{path}.instances[{i}]"
        if not isinstance(name, str) or name not in profiles:
            raise ScenarioError(ipath, f"{name!r} is not a MIG profile of this GPU ({', '.join(profiles)})")
        profile = profiles[name]
        counts[name] = counts.get(name, 0) + 1
        compute_total += profile.compute_slices
        memory_total += profile.memory_slices
        if counts[name] > profile.max_instances:
            raise ScenarioError(ipath, f"at most {profile.max_instances} {name} instances fit on one GPU")
        if compute_total > MIG_TOTAL_COMPUTE_SLICES or memory_total > MIG_TOTAL_MEMORY_SLICES:
            raise ScenarioError(
                ipath,
                f"the instances so far need {compute_total}/7 compute and {memory_total}/8 memory slices: too many",
            )
        gi = next((g for g in _GI_ID_POOLS[profile.compute_slices] if g not in used_ids), None)
        if gi is None:
            gi = max(used_ids | {13}) + 1
        used_ids.add(gi)
        instances.append(
            MigInstanceSpec(
                index=i,
                profile=profile,
                gpu_instance_id=gi,
                compute_instance_id=0,
                uuid=deterministic_mig_uuid(seed, gpu_uuid, gi),
                memory_total_bytes=profile.memory_slices * slice_bytes,
            )
        )
    return SharingSpec(SHARING_MIG, 1, tuple(instances))


@dataclass
class _GpuDraft:
    model: str
    memory_total_bytes: int
    driver_reserved_bytes: int


def _read_gpus(raw: Any, path: str, node_name: str, seed: int) -> tuple[GpuSpec, ...]:
    entries = _list(raw, path)
    if not entries:
        raise ScenarioError(path, "a node needs at least one GPU")
    gpus: list[GpuSpec] = []
    for i, entry in enumerate(entries):
        gpath = f"{path}[{i}]"
        m = _Map(entry, gpath)
        count = _int(m.get("count", 1), m.sub("count"), minimum=1, maximum=64)
        model = _str(m.get("model"), m.sub("model"))
        total = _bytes(m.get("memory_total_bytes"), m.sub("memory_total_bytes"))
        if total < GIB:
            raise ScenarioError(m.sub("memory_total_bytes"), f"{total} bytes is less than 1 GiB")
        reserved = _bytes(m.get("driver_reserved_bytes", 0), m.sub("driver_reserved_bytes"))
        if reserved >= total // 4:
            raise ScenarioError(m.sub("driver_reserved_bytes"), "must be well under the total (driver reserve)")
        uuid_raw = m.get("uuid", None)
        if uuid_raw is not None and count != 1:
            raise ScenarioError(m.sub("uuid"), "cannot be given together with count > 1")
        includes_reserved = _bool(
            m.get("memory_v2_used_includes_reserved", False), m.sub("memory_v2_used_includes_reserved")
        )
        power_max = _int(
            m.get("power_max_milliwatts", _default_power_max(model)), m.sub("power_max_milliwatts"), minimum=1
        )
        power_idle = _int(
            m.get("power_idle_milliwatts", power_max // 10), m.sub("power_idle_milliwatts"), minimum=0,
            maximum=power_max,
        )
        sharing_raw = m.get("sharing", {"mode": SHARING_EXCLUSIVE})
        m.done()
        draft = _GpuDraft(model, total, reserved)
        for _ in range(count):
            index = len(gpus)
            uuid = (
                _str(uuid_raw, m.sub("uuid"), pattern=_GPU_UUID, what="an NVML GPU uuid (GPU-xxxxxxxx-xxxx-...)")
                if uuid_raw is not None
                else deterministic_gpu_uuid(seed, node_name, index)
            )
            sharing = _read_sharing(sharing_raw, m.sub("sharing"), uuid, draft, seed)
            gpus.append(
                GpuSpec(
                    index=index,
                    model=model,
                    uuid=uuid,
                    memory_total_bytes=total,
                    driver_reserved_bytes=reserved,
                    memory_v2_used_includes_reserved=includes_reserved,
                    power_idle_milliwatts=power_idle,
                    power_max_milliwatts=power_max,
                    sharing=sharing,
                )
            )
    return tuple(gpus)


def _read_node_faults(raw: Any, path: str, gpus: tuple[GpuSpec, ...], duration: float):
    faults: list[GpuLostFault | NvmlErrorFault] = []
    for i, entry in enumerate(_list(raw, path)):
        fpath = f"{path}[{i}]"
        m = _Map(entry, fpath)
        kind = _choice(m.get("kind"), m.sub("kind"), ("gpu_lost", "nvml_error"))
        if kind == "gpu_lost":
            gpu = _int(m.get("gpu"), m.sub("gpu"), minimum=0, maximum=len(gpus) - 1)
            at = _seconds(m.get("at_seconds"), m.sub("at_seconds"), duration)
            m.done()
            faults.append(GpuLostFault(gpu, at))
            continue
        function = _str(m.get("function"), m.sub("function"))
        if function != ALL_DEVICE_FUNCTIONS and function not in NVML_DEVICE_FUNCTIONS | NVML_NODE_FUNCTIONS:
            raise ScenarioError(m.sub("function"), f"{function!r} is not an NVML function the simulator serves")
        error = _str(m.get("error", "NOT_SUPPORTED"), m.sub("error"))
        if error not in NVML_ERROR_CODES:
            raise ScenarioError(m.sub("error"), f"{error!r} is not an NVML error name (e.g. NOT_SUPPORTED, UNKNOWN)")
        gpu_raw = m.get("gpu", None)
        gpu = None if gpu_raw is None else _int(gpu_raw, m.sub("gpu"), minimum=0, maximum=len(gpus) - 1)
        if gpu is not None and function in NVML_NODE_FUNCTIONS:
            raise ScenarioError(m.sub("gpu"), f"{function} takes no device: leave gpu out")
        start = _seconds(m.get("from_seconds", 0), m.sub("from_seconds"), duration)
        until_raw = m.get("until_seconds", None)
        until = None if until_raw is None else _seconds(until_raw, m.sub("until_seconds"), duration)
        if until is not None and until <= start:
            raise ScenarioError(m.sub("until_seconds"), "must be after from_seconds")
        m.done()
        faults.append(NvmlErrorFault(function, error, gpu, start, until))
    return tuple(faults)


ALLOCATIONS = ("device_plugin", "dra")
"""How a node's pods get GPUs: the NVIDIA device plugin (extended resources, PodResources ``devices``) or NVIDIA's
DRA driver (ResourceClaims, PodResources ``dynamic_resources``, ResourceSlices on the API server)."""

DEVICE_ID_STRATEGIES = ("uuid", "index")
"""How the node's device plugin names devices (``deviceIDStrategy``): ``GPU-<uuid>``, ``GPU-<uuid>::<n>`` and
``MIG-<uuid>``, or NVML indexes ``<i>``, ``<i>::<n>`` and ``<i>:<j>`` (MIG device ``j`` of GPU ``i``)."""


def _read_nodes(raw: Any, seed: int, duration: float) -> tuple[NodeSpec, ...]:
    entries = _list(raw, "nodes")
    if not entries:
        raise ScenarioError("nodes", "a scenario needs at least one node")
    nodes: list[NodeSpec] = []
    names: set[str] = set()
    for i, entry in enumerate(entries):
        path = f"nodes[{i}]"
        m = _Map(entry, path)
        name = _str(m.get("name"), m.sub("name"), pattern=_DNS_SUBDOMAIN, what="a Kubernetes node name")
        if name in names:
            raise ScenarioError(m.sub("name"), f"node {name!r} is defined twice")
        names.add(name)
        gpus = _read_gpus(m.get("gpus"), m.sub("gpus"), name, seed)
        provider = _choice(m.get("cloud_provider", "aws"), m.sub("cloud_provider"), CLOUD_PROVIDERS)
        region = _str(m.get("region"), m.sub("region"))
        zone = _str(m.get("zone"), m.sub("zone")) if m.has("zone") else default_zone(provider, region)
        node = NodeSpec(
            name=name,
            cloud_provider=provider,
            region=region,
            instance_type=_str(m.get("instance_type"), m.sub("instance_type")),
            price_model=_choice(m.get("price_model", "on_demand"), m.sub("price_model"), PRICE_MODELS),
            cgroup_driver=_choice(m.get("cgroup_driver", "systemd"), m.sub("cgroup_driver"), CGROUP_DRIVERS),
            container_runtime=_choice(
                m.get("container_runtime", "containerd"), m.sub("container_runtime"), CONTAINER_RUNTIMES
            ),
            driver_version=_str(m.get("driver_version", "570.172.08"), m.sub("driver_version")),
            uptime_seconds_at_start=_int(
                m.get("uptime_seconds_at_start", 86_400), m.sub("uptime_seconds_at_start"), minimum=60
            ),
            gpus=gpus,
            faults=_read_node_faults(m.get("faults", []), m.sub("faults"), gpus, duration),
            zone=zone,
            provider_id=(_str(m.get("provider_id"), m.sub("provider_id")) if m.has("provider_id")
                         else deterministic_provider_id(seed, provider, zone, name)),
            labels=_str_map(m.get("labels", {}), m.sub("labels")),
            device_id_strategy=_choice(m.get("device_id_strategy", "uuid"), m.sub("device_id_strategy"),
                                       DEVICE_ID_STRATEGIES),
            allocation=_choice(m.get("allocation", "device_plugin"), m.sub("allocation"), ALLOCATIONS),
            clock_offset_seconds=_int(m.get("clock_offset_seconds", 0), m.sub("clock_offset_seconds"),
                                      minimum=-86_400, maximum=86_400),
        )
        m.done()
        nodes.append(node)
    return tuple(nodes)


def _unit_label(gpu: GpuSpec, instance: int | None) -> str:
    return f"GPU {gpu.index}" if instance is None else f"GPU {gpu.index} MIG instance {instance}"


def _read_assignment(raw: Any, path: str, node: NodeSpec) -> DeviceAssignmentSpec:
    m = _Map(raw, path)
    resource = _str(m.get("resource"), m.sub("resource"))
    gpu_index = _int(m.get("gpu"), m.sub("gpu"), minimum=0, maximum=len(node.gpus) - 1)
    replica_raw = m.get("replica", None)
    instance_raw = m.get("instance", None)
    claim_raw = m.get("claim", None)
    m.done()
    if claim_raw is not None:
        if node.allocation != "dra":
            raise ScenarioError(m.sub("claim"), f"node {node.name} gives GPUs through the device plugin: no claims")
        _str(claim_raw, m.sub("claim"), pattern=_DNS_SUBDOMAIN, what="a ResourceClaim name")
    spec = _read_plugin_assignment(m, resource, gpu_index, replica_raw, instance_raw, node)
    if node.allocation == "dra":
        spec = replace(spec, claim=claim_raw)
    return spec


def _read_plugin_assignment(m: "_Map", resource: str, gpu_index: int, replica_raw: Any, instance_raw: Any,
                            node: NodeSpec) -> DeviceAssignmentSpec:
    gpu = node.gpus[gpu_index]
    mode = gpu.sharing.mode
    if mode == SHARING_MIG:
        if replica_raw is not None:
            raise ScenarioError(m.sub("replica"), "MIG devices have no replicas")
        if instance_raw is None:
            raise ScenarioError(m.sub("instance"), f"GPU {gpu_index} is in MIG mode: say which instance")
        instance = _int(instance_raw, m.sub("instance"), minimum=0, maximum=len(gpu.sharing.mig_instances) - 1)
        spec = gpu.sharing.mig_instances[instance]
        profiles = {i.profile.name for i in gpu.sharing.mig_instances}
        allowed = {RESOURCE_MIG_PREFIX + spec.profile.name}
        if len(profiles) == 1:
            allowed.add(RESOURCE_GPU)  # MIG "single" strategy: every instance is advertised as nvidia.com/gpu
        if resource not in allowed:
            raise ScenarioError(
                m.sub("resource"),
                f"instance {instance} ({spec.profile.name}) is advertised as {' or '.join(sorted(allowed))}",
            )
        device_id = f"{gpu_index}:{instance}" if node.device_id_strategy == "index" else spec.uuid
        return DeviceAssignmentSpec(resource, gpu_index, None, instance, device_id)
    if instance_raw is not None:
        raise ScenarioError(m.sub("instance"), f"GPU {gpu_index} is not in MIG mode")
    if mode == SHARING_EXCLUSIVE:
        if replica_raw is not None:
            raise ScenarioError(m.sub("replica"), f"GPU {gpu_index} is not shared: no replicas")
        if resource != RESOURCE_GPU:
            raise ScenarioError(m.sub("resource"), f"an exclusive GPU is advertised as {RESOURCE_GPU}")
        return DeviceAssignmentSpec(resource, gpu_index, None, None,
                                    str(gpu_index) if node.device_id_strategy == "index" else gpu.uuid)
    if replica_raw is None:
        raise ScenarioError(m.sub("replica"), f"GPU {gpu_index} is shared ({mode}): say which replica")
    replica = _int(replica_raw, m.sub("replica"), minimum=0, maximum=gpu.sharing.replicas - 1)
    if resource not in (RESOURCE_GPU, RESOURCE_GPU_SHARED):
        raise ScenarioError(m.sub("resource"), f"a shared GPU is advertised as {RESOURCE_GPU} or {RESOURCE_GPU_SHARED}")
    base = str(gpu_index) if node.device_id_strategy == "index" else gpu.uuid
    return DeviceAssignmentSpec(resource, gpu_index, replica, None, f"{base}::{replica}")


def _read_targets(raw: Any, path: str, node: NodeSpec) -> tuple[DeviceTarget, ...]:
    entries = _list(raw, path)
    if not entries:
        raise ScenarioError(path, "a process runs on at least one device")
    targets: list[DeviceTarget] = []
    for i, entry in enumerate(entries):
        tpath = f"{path}[{i}]"
        if isinstance(entry, int) and not isinstance(entry, bool):
            gpu_index, instance = _int(entry, tpath, minimum=0, maximum=len(node.gpus) - 1), None
        else:
            m = _Map(entry, tpath)
            gpu_index = _int(m.get("gpu"), m.sub("gpu"), minimum=0, maximum=len(node.gpus) - 1)
            instance_raw = m.get("instance", None)
            m.done()
            instance = None
            if instance_raw is not None:
                if node.gpus[gpu_index].sharing.mode != SHARING_MIG:
                    raise ScenarioError(f"{tpath}.instance", f"GPU {gpu_index} is not in MIG mode")
                instance = _int(
                    instance_raw,
                    f"{tpath}.instance",
                    minimum=0,
                    maximum=len(node.gpus[gpu_index].sharing.mig_instances) - 1,
                )
        if node.gpus[gpu_index].sharing.mode == SHARING_MIG and instance is None:
            raise ScenarioError(tpath, f"GPU {gpu_index} is in MIG mode: a process runs on one of its instances")
        target = DeviceTarget(gpu_index, instance)
        if target in targets:
            raise ScenarioError(tpath, f"{_unit_label(node.gpus[gpu_index], instance)} is listed twice")
        targets.append(target)
    return tuple(targets)


def _read_memory(raw: Any, path: str) -> MemorySpec:
    m = _Map(raw, path)
    kinds = [k for k in ("preallocate_fraction", "bytes", "ramp", "steps") if m.has(k)]
    if len(kinds) != 1:
        raise ScenarioError(path, "give exactly one of preallocate_fraction, bytes, ramp, steps")
    kind = kinds[0]
    if kind == "preallocate_fraction":
        spec = MemorySpec("preallocate", fraction=_number(m.get(kind), m.sub(kind), minimum=0.0, maximum=1.0))
    elif kind == "bytes":
        spec = MemorySpec("fixed", bytes=_bytes(m.get(kind), m.sub(kind)))
    elif kind == "ramp":
        r = _Map(m.get(kind), m.sub(kind))
        spec = MemorySpec(
            "ramp",
            from_bytes=_bytes(r.get("from_bytes", 0), r.sub("from_bytes")),
            to_bytes=_bytes(r.get("to_bytes"), r.sub("to_bytes")),
            over_seconds=_number(r.get("over_seconds"), r.sub("over_seconds"), minimum=0.0),
        )
        r.done()
    else:
        steps = _read_steps(m.get(kind), m.sub(kind), lambda v, p: _bytes(v, p))
        spec = MemorySpec("steps", steps=steps)
    m.done()
    return spec


def _read_steps(raw: Any, path: str, read_value) -> tuple[tuple[float, Any], ...]:
    entries = _list(raw, path)
    if not entries:
        raise ScenarioError(path, "needs at least one [seconds, value] step")
    steps: list[tuple[float, Any]] = []
    for i, entry in enumerate(entries):
        spath = f"{path}[{i}]"
        if not isinstance(entry, list) or len(entry) != 2:
            raise ScenarioError(spath, "a step is a [seconds, value] pair")
        at = _number(entry[0], spath + "[0]", minimum=0.0)
        if i == 0 and at != 0:
            raise ScenarioError(spath + "[0]", "the first step starts at 0")
        if steps and at <= steps[-1][0]:
            raise ScenarioError(spath + "[0]", "step times must increase")
        steps.append((at, read_value(entry[1], spath + "[1]")))
    return tuple(steps)


def _read_compute(raw: Any, path: str) -> ComputeSpec:
    if isinstance(raw, list):
        return ComputeSpec(_read_steps(raw, path, lambda v, p: _number(v, p, minimum=0.0, maximum=1.0)))
    return ComputeSpec(((0.0, _number(raw, path, minimum=0.0, maximum=1.0)),))


@dataclass(frozen=True)
class _ProcessCommon:
    name: str
    devices: tuple[DeviceTarget, ...] | None
    memory: MemorySpec
    compute: ComputeSpec
    memory_activity: float
    mps_active_thread_percentage: float | None
    start_seconds: float
    end_seconds: float | None


def _read_process_common(m: _Map, node: NodeSpec, limit_seconds: float) -> _ProcessCommon:
    devices_raw = m.get("devices", None)
    devices = None if devices_raw is None else _read_targets(devices_raw, m.sub("devices"), node)
    mps_raw = m.get("mps_active_thread_percentage", None)
    mps = (
        None
        if mps_raw is None
        else _number(mps_raw, m.sub("mps_active_thread_percentage"), minimum=1.0, maximum=100.0)
    )
    start = _number(m.get("start_seconds", 0), m.sub("start_seconds"), minimum=0.0, maximum=limit_seconds)
    end_raw = m.get("end_seconds", None)
    end = None if end_raw is None else _number(end_raw, m.sub("end_seconds"), minimum=0.0)
    if end is not None and end <= start:
        raise ScenarioError(m.sub("end_seconds"), "must be after start_seconds")
    return _ProcessCommon(
        name=_str(m.get("name"), m.sub("name")),
        devices=devices,
        memory=_read_memory(m.get("memory"), m.sub("memory")),
        compute=_read_compute(m.get("compute", 0.0), m.sub("compute")),
        memory_activity=_number(m.get("memory_activity", 0.35), m.sub("memory_activity"), minimum=0.0, maximum=1.0),
        mps_active_thread_percentage=mps,
        start_seconds=start,
        end_seconds=end,
    )


def _check_mps_field(common: _ProcessCommon, devices: tuple[DeviceTarget, ...], node: NodeSpec, path: str) -> None:
    if common.mps_active_thread_percentage is None:
        return
    if not any(node.gpus[d.gpu].sharing.mode == SHARING_MPS for d in devices):
        raise ScenarioError(path + ".mps_active_thread_percentage", "only applies to processes on an MPS GPU")


def _visible_units(container: "_ContainerDraft", node: NodeSpec) -> set[DeviceTarget] | None:
    """Units a container can open, or None for all of the node's."""
    env = container.env.get(VISIBLE_DEVICES_ENV)
    if container.privileged or env == "all":
        return None
    units = {DeviceTarget(a.gpu, a.instance) for a in container.devices}
    if env and env not in ("void", "none"):
        for item in env.split(","):
            item = item.strip()
            for gpu in node.gpus:
                if item in (str(gpu.index), gpu.uuid):
                    if gpu.sharing.mode == SHARING_MIG:
                        units.update(DeviceTarget(gpu.index, i.index) for i in gpu.sharing.mig_instances)
                    else:
                        units.add(DeviceTarget(gpu.index, None))
                for inst in gpu.sharing.mig_instances:
                    if item == inst.uuid:
                        units.add(DeviceTarget(gpu.index, inst.index))
    return units


@dataclass
class _ContainerDraft:
    devices: tuple[DeviceAssignmentSpec, ...]
    env: Mapping[str, str]
    privileged: bool


def _read_hami_gpu(m: "_Map", node: NodeSpec) -> tuple[int, int, int]:
    """The ``gpu`` (index or uuid), ``memory_mib`` and ``cores_percent`` of a ``hami`` or ``hami_forged_annotation``
    option."""
    gpu_raw = m.get("gpu")
    if isinstance(gpu_raw, str):
        matches = [g.index for g in node.gpus if g.uuid == gpu_raw]
        if not matches:
            raise ScenarioError(m.sub("gpu"), f"no GPU of node {node.name} has uuid {gpu_raw!r}")
        gpu = matches[0]
    else:
        gpu = _int(gpu_raw, m.sub("gpu"), minimum=0, maximum=len(node.gpus) - 1)
    memory_mib = _int(m.get("memory_mib"), m.sub("memory_mib"), minimum=1,
                      maximum=node.gpus[gpu].memory_total_bytes // MIB)
    cores = _int(m.get("cores_percent", 0), m.sub("cores_percent"), minimum=0, maximum=100)
    return gpu, memory_mib, cores


def _read_hami_forged(raw: Any, path: str, node: NodeSpec) -> HamiAnnotationSpec:
    """A container's ``hami_forged_annotation`` option: any GPU of the node, whatever its sharing."""
    m = _Map(raw, path)
    gpu, memory_mib, cores = _read_hami_gpu(m, node)
    m.done()
    return HamiAnnotationSpec(gpu, memory_mib, cores)


def _read_hami(raw: Any, path: str, node: NodeSpec, slots: dict[tuple[str, int], int]) -> HamiSpec:
    """A container's ``hami`` option. The GPU must be one no device plugin shares (``exclusive``: HAMi shares it
    by itself); the kubelet's placeholder is the next free slot of ``placeholder_gpu`` (default: that GPU)."""
    m = _Map(raw, path)
    gpu, memory_mib, cores = _read_hami_gpu(m, node)
    placeholder_gpu = _int(m.get("placeholder_gpu", gpu), m.sub("placeholder_gpu"), minimum=0,
                           maximum=len(node.gpus) - 1)
    m.done()
    for index in {gpu, placeholder_gpu}:
        if node.gpus[index].sharing.mode != SHARING_EXCLUSIVE:
            raise ScenarioError(path, f"GPU {index} is {node.gpus[index].sharing.mode}: HAMi GPUs are not shared "
                                      "by the device plugin (sharing: exclusive)")
    slot = slots.get((node.name, placeholder_gpu), 0)
    if slot >= HAMI_SLOTS_PER_GPU:
        raise ScenarioError(path, f"GPU {placeholder_gpu} has only {HAMI_SLOTS_PER_GPU} HAMi slots")
    slots[(node.name, placeholder_gpu)] = slot + 1
    return HamiSpec(gpu, memory_mib, cores, placeholder_gpu, slot)


def _with_hami_annotations(annotations: Mapping[str, str], containers: list[ContainerSpec],
                           node: NodeSpec) -> Mapping[str, str]:
    """The pod's annotations with what HAMi's scheduler writes on it: the allocation, one ``;``-terminated
    segment per container (empty for a container without a vGPU), and the node. A value the scenario gives
    itself is kept (a forged or broken annotation to test)."""
    entries = [c.hami or c.hami_forged for c in containers]
    allocation = "".join(
        (f"{node.gpus[e.gpu].uuid},{HAMI_DEVICE_TYPE},{e.memory_mib},{e.cores_percent}:" if e is not None else "")
        + ";"
        for e in entries
    )
    merged = {HAMI_ALLOCATED_ANNOTATION: allocation, HAMI_NODE_ANNOTATION: node.name, "hami.io/bind-phase": "success"}
    merged.update(annotations)
    return MappingProxyType(merged)


def _read_pods(raw: Any, nodes: tuple[NodeSpec, ...], seed: int, duration: float) -> tuple[PodSpec, ...]:
    by_name = {n.name: n for n in nodes}
    hami_slots: dict[tuple[str, int], int] = {}
    pods: list[PodSpec] = []
    # namespace/name -> (index, start, end) of every pod of that name so far: a name is unique among the pods
    # alive at one time, as the API server keeps it; a pod deleted and created again (a StatefulSet's) reuses it.
    lives: dict[str, list[tuple[int, float, float]]] = {}
    uids: set[str] = set()
    for i, entry in enumerate(_list(raw, "pods")):
        path = f"pods[{i}]"
        m = _Map(entry, path)
        namespace = _str(m.get("namespace", "default"), m.sub("namespace"), pattern=_DNS_LABEL, what="a namespace")
        name = _str(m.get("name"), m.sub("name"), pattern=_DNS_SUBDOMAIN, what="a pod name")
        start = _seconds(m.get("start_seconds", 0), m.sub("start_seconds"), duration)
        end_raw = m.get("end_seconds", None)
        end = None if end_raw is None else _seconds(end_raw, m.sub("end_seconds"), duration)
        if end is not None and end <= start:
            raise ScenarioError(m.sub("end_seconds"), "must be after start_seconds")
        key = f"{namespace}/{name}"
        until = end if end is not None else float("inf")
        for other, other_start, other_until in lives.get(key, ()):
            if start < other_until and other_start < until:
                raise ScenarioError(
                    path, f"pod {key} is alive {_life_text(start, until)} and so is pods[{other}] "
                          f"{_life_text(other_start, other_until)}, the pod of the same name: only one pod of a name "
                          "is alive at a time (a recreated pod starts at or after the end_seconds of the one before)")
        recreated = bool(lives.get(key))
        lives.setdefault(key, []).append((i, start, until))
        node_name = _str(m.get("node"), m.sub("node"))
        if node_name not in by_name:
            raise ScenarioError(m.sub("node"), f"no node named {node_name!r}")
        node = by_name[node_name]
        uid_raw = m.get("uid", None)
        uid = (
            _str(uid_raw, m.sub("uid"), pattern=_POD_UID, what="a lowercase dashed pod UID")
            if uid_raw is not None
            else deterministic_pod_uid(seed, namespace, name, start if recreated else None)
        )
        if uid in uids:
            raise ScenarioError(m.sub("uid"), f"UID {uid} is used by another pod")
        uids.add(uid)
        owner_kind = owner_name = None
        owner_raw = m.get("owner", None)
        if owner_raw is not None:
            o = _Map(owner_raw, m.sub("owner"))
            owner_kind = _str(o.get("kind"), o.sub("kind"))
            owner_name = _str(o.get("name"), o.sub("name"))
            o.done()
        lifetime = (end if end is not None else duration) - start
        containers: list[ContainerSpec] = []
        cnames: set[str] = set()
        centries = _list(m.get("containers"), m.sub("containers"))
        if not centries:
            raise ScenarioError(m.sub("containers"), "a pod has at least one container")
        for c, centry in enumerate(centries):
            cpath = f"{path}.containers[{c}]"
            cm = _Map(centry, cpath)
            cname = _str(cm.get("name", "main"), cm.sub("name"), pattern=_DNS_LABEL, what="a container name")
            if cname in cnames:
                raise ScenarioError(cm.sub("name"), f"container {cname!r} is defined twice")
            cnames.add(cname)
            assignments = tuple(
                _read_assignment(a, f"{cpath}.devices[{d}]", node)
                for d, a in enumerate(_list(cm.get("devices", []), cm.sub("devices")))
            )
            if len({a.device_id for a in assignments}) != len(assignments):
                raise ScenarioError(cm.sub("devices"), "the same device is assigned twice")
            if node.allocation == "dra":
                # A pod on a DRA node requests its GPUs through ResourceClaims, not extended resources.
                assignments = tuple(replace(a, claim=a.claim or _default_claim_name(name, a)) for a in assignments)
            counted: dict[str, int] = {}
            for a in assignments:
                if a.claim is None:
                    counted[a.resource] = counted.get(a.resource, 0) + 1
            requests_raw = cm.get("requests", None)
            hami_raw = cm.get("hami", None)
            hami: HamiSpec | None = None
            forged_raw = cm.get("hami_forged_annotation", None)
            hami_forged: HamiAnnotationSpec | None = None
            if forged_raw is not None:
                if hami_raw is not None:
                    raise ScenarioError(cm.sub("hami_forged_annotation"), "a HAMi container's annotation is HAMi's: "
                                                                          "hami or hami_forged_annotation, not both")
                hami_forged = _read_hami_forged(forged_raw, cm.sub("hami_forged_annotation"), node)
            visible_assignments = assignments
            if hami_raw is not None:
                if assignments or requests_raw is not None:
                    raise ScenarioError(cm.sub("hami"), "a HAMi container gets its GPU from hami: no devices or "
                                                        "requests of its own")
                hami = _read_hami(hami_raw, cm.sub("hami"), node, hami_slots)
                placeholder = node.gpus[hami.placeholder_gpu]
                assignments = (DeviceAssignmentSpec(RESOURCE_GPU, hami.placeholder_gpu, hami.slot, None,
                                                    f"{placeholder.uuid}-{hami.slot}"),)
                # What the container can open is the GPU HAMi gave it (HAMi's Allocate sets it), not the slot's.
                visible_assignments = (DeviceAssignmentSpec(RESOURCE_GPU, hami.gpu, None, None,
                                                            node.gpus[hami.gpu].uuid),)
                requests = {RESOURCE_GPU: 1, RESOURCE_HAMI_MEMORY: hami.memory_mib}
                if hami.cores_percent:
                    requests[RESOURCE_HAMI_CORES] = hami.cores_percent
            elif requests_raw is None:
                requests = dict(counted)
            else:
                rm = _Map(requests_raw, cm.sub("requests"))
                requests = {k: _int(rm.get(k), rm.sub(k), minimum=0) for k in list(rm.raw)}
                rm.done()
                requests = {k: v for k, v in requests.items() if v}
                if requests != counted:
                    raise ScenarioError(
                        cm.sub("requests"),
                        f"requests {requests} must equal the devices assigned per resource {counted}",
                    )
            env = _str_map(cm.get("env", None), cm.sub("env"))
            for key in env:
                if not _ENV_NAME.fullmatch(key):
                    raise ScenarioError(cm.sub("env"), f"{key!r} is not an environment variable name")
            privileged = _bool(cm.get("privileged", False), cm.sub("privileged"))
            draft = _ContainerDraft(visible_assignments, env, privileged)
            visible = _visible_units(draft, node)
            processes: list[ProcessSpec] = []
            pnames: set[str] = set()
            for p, pentry in enumerate(_list(cm.get("processes", []), cm.sub("processes"))):
                ppath = f"{cpath}.processes[{p}]"
                pm = _Map(pentry, ppath)
                common = _read_process_common(pm, node, lifetime)
                pm.done()
                if common.name in pnames:
                    raise ScenarioError(ppath + ".name", f"process {common.name!r} is defined twice in this container")
                pnames.add(common.name)
                devices = common.devices
                if devices is None:
                    devices = tuple(dict.fromkeys(DeviceTarget(a.gpu, a.instance) for a in visible_assignments))
                    if not devices:
                        raise ScenarioError(
                            ppath + ".devices", "the container has no device assigned: say which devices it uses"
                        )
                if visible is not None:
                    for d, target in enumerate(devices):
                        if target not in visible:
                            raise ScenarioError(
                                f"{ppath}.devices[{d}]",
                                f"{_unit_label(node.gpus[target.gpu], target.instance)} is not visible to container "
                                f"{cname!r} (not assigned; set {VISIBLE_DEVICES_ENV}=all or privileged to leak)",
                            )
                _check_mps_field(common, devices, node, ppath)
                end_seconds = common.end_seconds
                if end_seconds is not None and end_seconds > lifetime:
                    raise ScenarioError(ppath + ".end_seconds", f"is after the pod ends ({lifetime} s after its start)")
                processes.append(
                    ProcessSpec(
                        name=common.name,
                        devices=devices,
                        memory=common.memory,
                        compute=common.compute,
                        memory_activity=common.memory_activity,
                        mps_active_thread_percentage=common.mps_active_thread_percentage,
                        start_seconds=common.start_seconds,
                        end_seconds=end_seconds,
                    )
                )
            cm.done()
            env, processes = _mps_thread_env(env, processes, cm.sub("env"))
            containers.append(
                ContainerSpec(
                    name=cname,
                    container_id=deterministic_container_id(seed, uid, cname),
                    requests=MappingProxyType(requests),
                    devices=assignments,
                    env=env,
                    privileged=privileged,
                    processes=tuple(processes),
                    hami=hami,
                    hami_forged=hami_forged,
                )
            )
        labels = _str_map(m.get("labels", None), m.sub("labels"))
        annotations = _str_map(m.get("annotations", None), m.sub("annotations"))
        if any(c.hami is not None or c.hami_forged is not None for c in containers):
            annotations = _with_hami_annotations(annotations, containers, node)
        qos = _choice(m.get("qos_class", "burstable"), m.sub("qos_class"), QOS_CLASSES)
        m.done()
        pods.append(
            PodSpec(
                namespace=namespace,
                name=name,
                uid=uid,
                node=node_name,
                labels=labels,
                annotations=annotations,
                owner_kind=owner_kind,
                owner_name=owner_name,
                qos_class=qos,
                start_seconds=start,
                end_seconds=end,
                containers=tuple(containers),
            )
        )
    _check_no_double_assignment(pods)
    _check_claims(pods, by_name)
    return tuple(pods)


def _life_text(start: float, until: float) -> str:
    return f"from {start:g} s " + ("on" if until == float("inf") else f"to {until:g} s")


def _default_claim_name(pod_name: str, device: DeviceAssignmentSpec) -> str:
    suffix = f"-gpu{device.gpu}" + (f"-mig{device.instance}" if device.instance is not None else "")
    return f"{pod_name[:253 - len(suffix)]}{suffix}"


def _check_claims(pods: list[PodSpec], nodes: Mapping[str, NodeSpec]) -> None:
    """On DRA nodes: a ResourceClaim holds one device (a GPU or a MIG instance), and a device belongs to one claim
    at a time (the pods sharing it share the claim)."""
    units: dict[tuple[str, str, str], tuple[int, int | None, str]] = {}
    lifetimes: dict[tuple[str, str, str], tuple[float, float]] = {}
    for i, pod in enumerate(pods):
        end = pod.end_seconds if pod.end_seconds is not None else float("inf")
        for c, container in enumerate(pod.containers):
            for d, device in enumerate(container.devices):
                if device.claim is None:
                    continue
                path = f"pods[{i}].containers[{c}].devices[{d}].claim"
                key = (pod.node, pod.namespace, device.claim)
                unit = (device.gpu, device.instance)
                known = units.get(key)
                if known is not None and known[:2] != unit:
                    raise ScenarioError(path, f"claim {device.claim} already holds another device (in {known[2]})")
                units.setdefault(key, (*unit, pod.key))
                start0, end0 = lifetimes.get(key, (pod.start_seconds, end))
                lifetimes[key] = (min(start0, pod.start_seconds), max(end0, end))
    by_unit: dict[tuple[str, int, int | None], list[tuple[float, float, str]]] = {}
    for key, (gpu, instance, _) in units.items():
        start, end = lifetimes[key]
        for start2, end2, other in by_unit.get((key[0], gpu, instance), []):
            if start < end2 and start2 < end:
                raise ScenarioError(f"claims {other} and {key[1]}/{key[2]}",
                                    f"both hold GPU {gpu}{'' if instance is None else f' instance {instance}'} "
                                    f"of node {key[0]} at the same time (pods share a device by sharing a claim)")
        by_unit.setdefault((key[0], gpu, instance), []).append((start, end, f"{key[1]}/{key[2]}"))


def _mps_thread_env(env: Mapping[str, str], processes: list[ProcessSpec], path: str
                    ) -> tuple[Mapping[str, str], list[ProcessSpec]]:
    """An MPS client's cap is set by ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` in its environment, which a pod spec
    gives the whole container: a process's ``mps_active_thread_percentage`` appears in its container's env (the
    first capped process's, when they differ), and a container env that sets it caps its processes that name no
    cap of their own."""
    given = env.get(MPS_THREAD_ENV)
    if given is None:
        capped = [p.mps_active_thread_percentage for p in processes if p.mps_active_thread_percentage is not None]
        if not capped:
            return env, processes
        return MappingProxyType({**env, MPS_THREAD_ENV: f"{capped[0]:g}"}), processes
    try:
        cap = float(given)
    except ValueError:
        raise ScenarioError(path, f"{MPS_THREAD_ENV} {given!r} is not a number") from None
    if not 0 < cap <= 100:
        raise ScenarioError(path, f"{MPS_THREAD_ENV} must be within (0, 100], got {given!r}")
    return env, [p if p.mps_active_thread_percentage is not None else replace(p, mps_active_thread_percentage=cap)
                 for p in processes]


def _check_no_double_assignment(pods: list[PodSpec]) -> None:
    """A device id is one container's at a time -- except on a DRA node, where the pods of one claim share the
    claim's device (``_check_claims`` keeps a device to one claim at a time)."""
    holders: dict[tuple[str, str], list[tuple[float, float, tuple[str, str] | None, str]]] = {}
    for i, pod in enumerate(pods):
        end = pod.end_seconds if pod.end_seconds is not None else float("inf")
        for c, container in enumerate(pod.containers):
            for d, device in enumerate(container.devices):
                path = f"pods[{i}].containers[{c}].devices[{d}]"
                claim = (pod.namespace, device.claim) if device.claim is not None else None
                for start2, end2, claim2, other in holders.get((pod.node, device.device_id), []):
                    if pod.start_seconds < end2 and start2 < end and (claim is None or claim != claim2):
                        raise ScenarioError(
                            path, f"device {device.device_id} is already assigned to {other} at the same time"
                        )
                holders.setdefault((pod.node, device.device_id), []).append(
                    (pod.start_seconds, end, claim, f"{pod.key} ({container.name})")
                )


def _read_host_processes(raw: Any, nodes: tuple[NodeSpec, ...], duration: float) -> tuple[HostProcessSpec, ...]:
    by_name = {n.name: n for n in nodes}
    out: list[HostProcessSpec] = []
    for i, entry in enumerate(_list(raw, "host_processes")):
        path = f"host_processes[{i}]"
        m = _Map(entry, path)
        node_name = _str(m.get("node"), m.sub("node"))
        if node_name not in by_name:
            raise ScenarioError(m.sub("node"), f"no node named {node_name!r}")
        node = by_name[node_name]
        cgroup = _str(m.get("cgroup", "/system.slice/gpu-job.service"), m.sub("cgroup"))
        if not cgroup.startswith("/") or "kubepods" in cgroup:
            raise ScenarioError(m.sub("cgroup"), "must be an absolute cgroup path outside the kubepods hierarchy")
        common = _read_process_common(m, node, duration)
        m.done()
        if common.devices is None:
            raise ScenarioError(m.sub("devices"), "is required for a host process")
        _check_mps_field(common, common.devices, node, path)
        if common.end_seconds is not None and common.end_seconds > duration:
            raise ScenarioError(m.sub("end_seconds"), f"is after the scenario ends ({duration} s)")
        out.append(
            HostProcessSpec(
                node=node_name,
                name=common.name,
                cgroup=cgroup,
                devices=common.devices,
                memory=common.memory,
                compute=common.compute,
                memory_activity=common.memory_activity,
                mps_active_thread_percentage=common.mps_active_thread_percentage,
                start_seconds=common.start_seconds,
                end_seconds=common.end_seconds,
            )
        )
    return tuple(out)


def _read_races(raw: Any, pods: tuple[PodSpec, ...], duration: float) -> tuple[ProcessExitRaceFault, ...]:
    by_key: dict[str, list[PodSpec]] = {}
    for p in pods:
        by_key.setdefault(p.key, []).append(p)
    out: list[ProcessExitRaceFault] = []
    seen: set[tuple[str, str, str]] = set()
    for i, entry in enumerate(_list(raw, "process_exit_races")):
        path = f"process_exit_races[{i}]"
        m = _Map(entry, path)
        pod_key = _str(m.get("pod"), m.sub("pod"))
        if pod_key not in by_key:
            raise ScenarioError(m.sub("pod"), f"no pod {pod_key!r} (write namespace/name)")
        at = _seconds(m.get("at_seconds"), m.sub("at_seconds"), duration)
        pod = by_key[pod_key][0]
        if len(by_key[pod_key]) > 1:
            # A recreated pod: the race is the incarnation's alive at the instant it names.
            alive = [p for p in by_key[pod_key]
                     if p.start_seconds <= at and (p.end_seconds is None or at < p.end_seconds)]
            if not alive:
                raise ScenarioError(m.sub("at_seconds"), f"no pod {pod_key} is alive then")
            pod = alive[0]
        container_name = _str(m.get("container", pod.containers[0].name), m.sub("container"))
        container = next((c for c in pod.containers if c.name == container_name), None)
        if container is None:
            raise ScenarioError(m.sub("container"), f"pod {pod_key} has no container {container_name!r}")
        process_name = _str(m.get("process"), m.sub("process"))
        process = next((p for p in container.processes if p.name == process_name), None)
        if process is None:
            raise ScenarioError(m.sub("process"), f"container {container_name!r} has no process {process_name!r}")
        m.done()
        begin = pod.start_seconds + process.start_seconds
        finish = pod.start_seconds + process.end_seconds if process.end_seconds is not None else pod.end_seconds
        if at <= begin or (finish is not None and at >= finish):
            raise ScenarioError(m.sub("at_seconds"), "must fall while the process runs")
        key = (pod.uid, container_name, process_name)
        if key in seen:
            raise ScenarioError(path, "a process exits once")
        seen.add(key)
        out.append(ProcessExitRaceFault(pod_key, container_name, process_name, at, pod.uid))
    return tuple(out)


def _read_namespaces(raw: Any) -> tuple[NamespaceSpec, ...]:
    out: list[NamespaceSpec] = []
    for i, entry in enumerate(_list(raw, "namespaces")):
        m = _Map(entry, f"namespaces[{i}]")
        name = _str(m.get("name"), m.sub("name"), pattern=_DNS_LABEL, what="a namespace")
        if any(spec.name == name for spec in out):
            raise ScenarioError(m.sub("name"), f"namespace {name!r} is defined twice")
        out.append(NamespaceSpec(name, _str_map(m.get("labels", {}), m.sub("labels"))))
        m.done()
    return tuple(out)


def _parse(document: Any) -> Scenario:
    m = _Map(document, "")
    cluster = _str(m.get("cluster"), "cluster")
    seed = _int(m.get("seed", 0), "seed", minimum=0)
    interval = _number(m.get("interval_seconds", 10), "interval_seconds", minimum=1.0, maximum=3600.0)
    if round(interval * 1000) != interval * 1000:
        raise ScenarioError("interval_seconds", "must be a whole number of milliseconds")
    duration = _number(m.get("duration_seconds"), "duration_seconds", minimum=interval, maximum=30 * 86_400.0)
    start = _start_time(m.get("start"), "start")
    nodes = _read_nodes(m.get("nodes"), seed, duration)
    pods = _read_pods(m.get("pods", []), nodes, seed, duration)
    host = _read_host_processes(m.get("host_processes", []), nodes, duration)
    races = _read_races(m.get("process_exit_races", []), pods, duration)
    namespaces = _read_namespaces(m.get("namespaces", []))
    m.done()
    return Scenario(
        cluster=cluster,
        seed=seed,
        interval_seconds=interval,
        duration_seconds=duration,
        start_unix_ms=start,
        nodes=nodes,
        pods=pods,
        host_processes=host,
        process_exit_races=races,
        namespaces=namespaces,
    )


class _StrictLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser where PyYAML has it: 10x
    """SafeLoader that refuses duplicate mapping keys (PyYAML would silently keep the last one)."""

    def construct_mapping(self, node, deep=False):
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_scenario(path_or_text: str | Path) -> Scenario:
    """Parse and validate a scenario.

    A ``Path`` (or a one-line ``str`` ending in ``.yaml``/``.yml``) is read as a file; any other ``str`` is the
    YAML text itself. Raises ``ScenarioError`` naming the offending path for any invalid input, including YAML
    syntax errors and unreadable files.
    """
    if isinstance(path_or_text, Path) or (
        isinstance(path_or_text, str) and "\n" not in path_or_text and path_or_text.endswith((".yaml", ".yml"))
    ):
        try:
            text = Path(path_or_text).read_text(encoding="utf-8")
        except OSError as exc:
            raise ScenarioError(str(path_or_text), f"cannot read the scenario file: {exc.strerror or exc}") from exc
    elif isinstance(path_or_text, str):
        text = path_or_text
    else:
        raise ScenarioError("", f"load_scenario takes a path or YAML text, got {_kind(path_or_text)}")
    try:
        document = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "YAML"
        raise ScenarioError(where, f"not valid YAML: {getattr(exc, 'problem', None) or exc}") from exc
    if document is None:
        raise ScenarioError("", "the scenario is empty")
    return _parse(document)
