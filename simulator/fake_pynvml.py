"""A stand-in for the ``pynvml`` module (nvidia-ml-py) backed by a ``SimWorld``, for one node.

``FakeNvml(world, clock)`` has the same function names, signatures and return types as the part of pynvml that
gpumeter uses, and its errors ARE pynvml's: ``pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)`` and so on, so
``except nvml.NVMLError_NotSupported`` behaves identically. Every other pynvml name that is not a function
(constants such as ``NVML_ERROR_GPU_IS_LOST`` and ``nvmlMemory_v2``, the struct classes, the exception classes)
is passed through from the real module; a pynvml function this fake does not simulate raises AttributeError
rather than answering something made up.

What each call returns follows the driver (see ``simulator/world.py`` for the model):

* ``nvmlDeviceGetMemoryInfo(h)`` → ``c_nvmlMemory_t`` whose ``used`` includes the driver reserve (v1);
  ``version=nvmlMemory_v2`` → ``c_nvmlMemory_v2_t`` with ``total = free + used + reserved`` (a GPU configured with
  ``memory_v2_used_includes_reserved`` reports ``used`` with the reserve in it, as some drivers do). Any other
  version → ARGUMENT_VERSION_MISMATCH.
* Utilization rates: NOT_SUPPORTED on a MIG-enabled GPU and on MIG devices. Power: NOT_SUPPORTED on MIG devices.
* ``nvmlDeviceGetComputeRunningProcesses``: ``nvmlFriendlyObject``s with ``pid``, ``usedGpuMemory``,
  ``gpuInstanceId``, ``computeInstanceId`` (0xFFFFFFFF off MIG). On an MPS GPU it lists the MPS server and then
  every client, as driver 580.159.04 did on an H200 (``bench/results/gpu_machine.json``);
  ``nvmlDeviceGetMPSComputeRunningProcesses`` lists the clients alone, with the same ``usedGpuMemory`` (empty on
  other GPUs). A MIG device lists its own processes; the MIG-enabled parent lists every instance's (as it does for
  root).
* ``nvmlDeviceGetProcessUtilization(h, lastSeenTimeStamp)``: one ``c_nvmlProcessUtilizationSample_t`` per
  process that ran kernels in the last sample period and whose sample is newer than ``lastSeenTimeStamp`` (µs);
  NOT_FOUND when there is none; NOT_SUPPORTED on MIG-enabled GPUs and MIG devices. On an MPS GPU only the MPS
  server has samples, its ``smUtil`` the device's utilization (as on the H200): the clients' kernels are the
  server's to NVML. (On a time-sliced real GPU the driver gave about one sample a second, mostly for one process
  carrying the device's whole utilization: see docs/attribution.md, "What a real GPU answered". The simulator
  keeps one sample per process, each its own kernel time.)
* MIG: ``nvmlDeviceGetMigMode`` → ``[current, pending]`` (NOT_SUPPORTED on GPUs without MIG);
  ``nvmlDeviceGetMaxMigDeviceCount`` → 7 when enabled, else 0; ``nvmlDeviceGetMigDeviceHandleByIndex`` →
  NOT_FOUND for an index with no instance; ``nvmlDeviceGetAttributes`` (MIG devices only) gives
  ``gpuInstanceSliceCount`` and ``memorySizeMB``; ``nvmlDeviceGetGpuInstanceProfileInfo`` describes each profile
  of a MIG-capable GPU (``name`` like ``"MIG 1g.10gb"``); ``nvmlDeviceGetName`` on a MIG device is
  ``"<GPU name> MIG <profile>"``. GPU-only calls on a MIG handle and MIG-only calls on a GPU handle fail with
  NOT_SUPPORTED / INVALID_ARGUMENT.
* Faults from the scenario: after a GPU is lost every call on it or its MIG devices (and
  ``nvmlDeviceGetHandleByIndex`` for it) raises GPU_IS_LOST; ``nvml_error`` faults make the named call fail.
* Every call before ``nvmlInit`` (or after the matching ``nvmlShutdown``) raises UNINITIALIZED.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pynvml

from gpumeter.clock import Clock
from simulator.scenario import (
    MIB,
    MIG_PROFILES_BY_MEMORY_CLASS,
    MIG_TOTAL_COMPUTE_SLICES,
    MIG_TOTAL_MEMORY_SLICES,
    NVML_ERROR_CODES,
    SHARING_MIG,
    SHARING_MPS,
    GpuSpec,
    mig_memory_class,
)
from simulator.world import GpuObservation, SimWorld, UnitObservation

_NOT_IN_MIG = 0xFFFFFFFF
_MISSING = object()


@dataclass(frozen=True, slots=True)
class FakeDeviceHandle:
    """An opaque device handle: a physical GPU (``mig_index`` None) or one of its MIG devices."""

    node_name: str
    gpu_index: int
    mig_index: int | None


def _fail(code: int) -> None:
    raise pynvml.NVMLError(code)


def _sm_per_slice(model: str) -> int:
    # H100/H200 SXM have 132 SMs (7 slices × 16 usable + spares); A100 has 108 (7 × 14).
    return 16 if ("H100" in model or "H200" in model) else 14


class FakeNvml:
    """The pynvml API for one node of a ``SimWorld``, reading the world at ``clock.now_ms()``.

    ``node_name`` may be left out when the scenario has one node. ``call_counts`` counts calls by function name.
    """

    def __init__(self, world: SimWorld, clock: Clock, node_name: str | None = None) -> None:
        if node_name is None:
            if len(world.node_names) != 1:
                raise ValueError(f"the scenario has nodes {world.node_names}: say which one this NVML serves")
            node_name = world.node_names[0]
        self._world = world
        self._clock = clock
        self._node = world.node(node_name)
        self.node_name = node_name
        self._refcount = 0
        self.call_counts: Counter[str] = Counter()
        # A node without faults answers every call: its calls skip the fault checks (the same answers, cheaper).
        self._faulty = bool(self._node.faults)

    # ---- pass-through of pynvml's constants, structs and exceptions -----------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(pynvml, name, _MISSING)
        if value is _MISSING:
            raise AttributeError(f"pynvml has no attribute {name!r}")
        if isinstance(value, type) or not callable(value):
            # pynvml's constants, structs and exceptions do not change: the next lookup finds them here.
            object.__setattr__(self, name, value)
            return value
        raise AttributeError(f"FakeNvml does not simulate pynvml.{name}")

    def __dir__(self) -> list[str]:
        passed = {
            name
            for name in dir(pynvml)
            if not name.startswith("_")
            and (isinstance(getattr(pynvml, name), type) or not callable(getattr(pynvml, name)))
        }
        return sorted(set(object.__dir__(self)) | passed)

    # ---- plumbing -------------------------------------------------------------------------------------------

    def _now(self) -> int:
        now = self._clock.now_ms()
        if now > self._world.now_ms:
            self._world.step(now)
        return now

    def _enter(self, function: str, *, fault_names: tuple[str, ...] = ()) -> int:
        self.call_counts[function] += 1
        if self._refcount <= 0:
            _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        now = self._now()
        if not self._faulty:
            return now
        for name in (function, *fault_names):
            error = self._world.nvml_fault(self.node_name, name, None, now)
            if error is not None:
                _fail(NVML_ERROR_CODES[error])
        return now

    def _enter_device(
        self, function: str, handle: Any, *, fault_names: tuple[str, ...] = (), counted: bool = False
    ) -> int:
        if not counted:
            self.call_counts[function] += 1
        if self._refcount <= 0:
            _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, FakeDeviceHandle) or handle.node_name != self.node_name:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        now = self._now()
        if not self._faulty:
            return now
        if self._world.gpu_lost(self.node_name, handle.gpu_index, now):
            _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
        for name in (function, *fault_names):
            error = self._world.nvml_fault(self.node_name, name, handle.gpu_index, now)
            if error is not None:
                _fail(NVML_ERROR_CODES[error])
        return now

    def _gpu(self, handle: FakeDeviceHandle) -> GpuSpec:
        return self._node.gpus[handle.gpu_index]

    def _observation(self, handle: FakeDeviceHandle, now: int) -> GpuObservation:
        return self._world.observation_at(now, self.node_name, handle.gpu_index)

    def _unit(self, handle: FakeDeviceHandle, now: int) -> UnitObservation:
        return self._observation(handle, now).units[handle.mig_index or 0]

    def _is_mig_gpu(self, handle: FakeDeviceHandle) -> bool:
        return self._gpu(handle).sharing.mode == SHARING_MIG

    # ---- library --------------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.call_counts["nvmlInit"] += 1
        error = self._world.nvml_fault(self.node_name, "nvmlInit", None, self._now())
        if error is not None:
            _fail(NVML_ERROR_CODES[error])
        self._refcount += 1

    def nvmlShutdown(self) -> None:
        self.call_counts["nvmlShutdown"] += 1
        if self._refcount <= 0:
            _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        self._refcount -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self._node.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self._node.gpus)

    # ---- handles --------------------------------------------------------------------------------------------

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDeviceHandle:
        self.call_counts["nvmlDeviceGetHandleByIndex"] += 1
        if self._refcount <= 0:
            _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        if not isinstance(index, int) or not 0 <= index < len(self._node.gpus):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        handle = FakeDeviceHandle(self.node_name, index, None)
        self._enter_device("nvmlDeviceGetHandleByIndex", handle, counted=True)
        return handle

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeDeviceHandle:
        self._enter("nvmlDeviceGetHandleByUUID")
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for gpu in self._node.gpus:
            candidates = [(gpu.uuid, None)] + [(i.uuid, i.index) for i in gpu.sharing.mig_instances]
            for candidate, mig_index in candidates:
                if candidate == text:
                    handle = FakeDeviceHandle(self.node_name, gpu.index, mig_index)
                    if self._world.gpu_lost(self.node_name, gpu.index, self._now()):
                        _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
                    return handle
        _fail(pynvml.NVML_ERROR_NOT_FOUND)
        raise AssertionError("unreachable")

    def nvmlDeviceIsMigDeviceHandle(self, handle: FakeDeviceHandle) -> ctypes.c_uint:
        self._enter_device("nvmlDeviceIsMigDeviceHandle", handle)
        return ctypes.c_uint(1 if handle.mig_index is not None else 0)

    # ---- identity -------------------------------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: FakeDeviceHandle) -> str:
        self._enter_device("nvmlDeviceGetUUID", handle)
        gpu = self._gpu(handle)
        if handle.mig_index is None:
            return gpu.uuid
        return gpu.sharing.mig_instances[handle.mig_index].uuid

    def nvmlDeviceGetName(self, handle: FakeDeviceHandle) -> str:
        self._enter_device("nvmlDeviceGetName", handle)
        gpu = self._gpu(handle)
        if handle.mig_index is None:
            return gpu.model
        return f"{gpu.model} MIG {gpu.sharing.mig_instances[handle.mig_index].profile.name}"

    # ---- memory, utilization, power -------------------------------------------------------------------------

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDeviceHandle, version: int | None = None):
        now = self._enter_device("nvmlDeviceGetMemoryInfo", handle)
        if handle.mig_index is None:
            obs = self._observation(handle, now)
            total, reserved, used, free = (
                obs.memory_total_bytes,
                obs.memory_reserved_bytes,
                obs.memory_used_bytes,
                obs.memory_free_bytes,
            )
        else:
            unit = self._unit(handle, now)
            total, reserved, used, free = (
                unit.memory_total_bytes,
                unit.memory_reserved_bytes,
                unit.memory_used_bytes,
                unit.memory_free_bytes,
            )
        if not version:
            return pynvml.c_nvmlMemory_t(total=total, free=free, used=used + reserved)
        if version != pynvml.nvmlMemory_v2:
            _fail(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if self._gpu(handle).memory_v2_used_includes_reserved:
            used += reserved
        return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=reserved, free=free, used=used)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeDeviceHandle):
        now = self._enter_device("nvmlDeviceGetUtilizationRates", handle)
        if self._is_mig_gpu(handle):
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        unit = self._unit(handle, now)
        return pynvml.c_nvmlUtilization_t(gpu=unit.gpu_utilization_percent, memory=unit.memory_utilization_percent)

    def nvmlDeviceGetPowerUsage(self, handle: FakeDeviceHandle) -> int:
        now = self._enter_device("nvmlDeviceGetPowerUsage", handle)
        if handle.mig_index is not None:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._observation(handle, now).power_milliwatts

    # ---- MIG ------------------------------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, handle: FakeDeviceHandle) -> list[int]:
        self._enter_device("nvmlDeviceGetMigMode", handle)
        gpu = self._gpu(handle)
        if handle.mig_index is not None or not gpu.mig_capable:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.sharing.mode == SHARING_MIG else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeDeviceHandle) -> int:
        self._enter_device("nvmlDeviceGetMaxMigDeviceCount", handle)
        if handle.mig_index is not None:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return MIG_TOTAL_COMPUTE_SLICES if self._is_mig_gpu(handle) else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeDeviceHandle, index: int) -> FakeDeviceHandle:
        self._enter_device("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        gpu = self._gpu(handle)
        if handle.mig_index is not None:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not gpu.mig_capable:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if gpu.sharing.mode != SHARING_MIG:
            _fail(pynvml.NVML_ERROR_NOT_FOUND)
        if not isinstance(index, int) or not 0 <= index < MIG_TOTAL_COMPUTE_SLICES:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index >= len(gpu.sharing.mig_instances):
            _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeDeviceHandle(self.node_name, handle.gpu_index, index)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: FakeDeviceHandle) -> FakeDeviceHandle:
        self._enter_device("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle)
        if handle.mig_index is None:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return FakeDeviceHandle(self.node_name, handle.gpu_index, None)

    def nvmlDeviceGetGpuInstanceId(self, handle: FakeDeviceHandle) -> int:
        self._enter_device("nvmlDeviceGetGpuInstanceId", handle)
        if handle.mig_index is None:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._gpu(handle).sharing.mig_instances[handle.mig_index].gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: FakeDeviceHandle) -> int:
        self._enter_device("nvmlDeviceGetComputeInstanceId", handle)
        if handle.mig_index is None:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._gpu(handle).sharing.mig_instances[handle.mig_index].compute_instance_id

    def nvmlDeviceGetAttributes_v2(self, handle: FakeDeviceHandle):
        self._enter_device("nvmlDeviceGetAttributes_v2", handle, fault_names=("nvmlDeviceGetAttributes",))
        return self._attributes(handle)

    def nvmlDeviceGetAttributes(self, handle: FakeDeviceHandle):
        self._enter_device("nvmlDeviceGetAttributes", handle, fault_names=("nvmlDeviceGetAttributes_v2",))
        return self._attributes(handle)

    def _attributes(self, handle: FakeDeviceHandle):
        if handle.mig_index is None:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)  # NVML documents these attributes for MIG devices only
        gpu = self._gpu(handle)
        instance = gpu.sharing.mig_instances[handle.mig_index]
        slices = instance.profile.compute_slices
        return pynvml.c_nvmlDeviceAttributes(
            multiprocessorCount=slices * _sm_per_slice(gpu.model),
            sharedCopyEngineCount=slices,
            sharedDecoderCount=min(slices, 5),
            sharedEncoderCount=0,
            sharedJpegCount=1 if slices >= 7 else 0,
            sharedOfaCount=1 if slices >= 7 else 0,
            gpuInstanceSliceCount=slices,
            computeInstanceSliceCount=slices,
            memorySizeMB=instance.memory_total_bytes // MIB,
        )

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: FakeDeviceHandle, profile: int, version: int = 2):
        self._enter_device("nvmlDeviceGetGpuInstanceProfileInfo", handle)
        if version not in (1, 2):
            _fail(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if handle.mig_index is not None:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._gpu(handle)
        if not gpu.mig_capable:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        table = MIG_PROFILES_BY_MEMORY_CLASS[mig_memory_class(gpu.memory_total_bytes) or ""]
        match = next((p for p in table.values() if p.nvml_profile_id == profile), None)
        if match is None:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        slice_mib = (gpu.memory_total_bytes - gpu.driver_reserved_bytes) // MIG_TOTAL_MEMORY_SLICES // MIB
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t() if version == 2 else pynvml.c_nvmlGpuInstanceProfileInfo_t()
        info.id = match.nvml_profile_id
        info.isP2pSupported = 0
        info.sliceCount = match.compute_slices
        info.instanceCount = match.max_instances
        info.multiprocessorCount = match.compute_slices * _sm_per_slice(gpu.model)
        info.copyEngineCount = match.compute_slices
        info.decoderCount = min(match.compute_slices, 5)
        info.encoderCount = 0
        info.jpegCount = 1 if match.compute_slices >= 7 else 0
        info.ofaCount = 1 if match.compute_slices >= 7 else 0
        info.memorySizeMB = match.memory_slices * slice_mib
        if version == 2:
            info.name = f"MIG {match.name}".encode()
        return info

    # ---- processes ------------------------------------------------------------------------------------------

    @staticmethod
    def _process_info(pid: int, used: int, gi: int | None, ci: int | None):
        return pynvml.nvmlFriendlyObject(
            {
                "pid": pid,
                "usedGpuMemory": used,
                "gpuInstanceId": _NOT_IN_MIG if gi is None else gi,
                "computeInstanceId": _NOT_IN_MIG if ci is None else ci,
            }
        )

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDeviceHandle) -> list:
        now = self._enter_device("nvmlDeviceGetComputeRunningProcesses", handle)
        obs = self._observation(handle, now)
        if handle.mig_index is not None:
            units = [obs.units[handle.mig_index]]
        else:
            units = list(obs.units)
        out = []
        for unit in units:
            # On an MPS GPU the real driver (580.159.04, H200: bench/results/gpu_machine.json) lists the MPS server
            # first, then every client with its memory: the clients are in both lists.
            for p in sorted(unit.processes, key=lambda p: p.is_mps_client):
                out.append(self._process_info(p.pid, p.used_gpu_memory_bytes, p.gpu_instance_id, p.compute_instance_id))
        return out

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: FakeDeviceHandle) -> list:
        now = self._enter_device("nvmlDeviceGetMPSComputeRunningProcesses", handle)
        if handle.mig_index is not None or self._gpu(handle).sharing.mode != SHARING_MPS:
            return []
        unit = self._unit(handle, now)
        return [
            self._process_info(p.pid, p.used_gpu_memory_bytes, None, None) for p in unit.processes if p.is_mps_client
        ]

    def nvmlDeviceGetProcessUtilization(self, handle: FakeDeviceHandle, timeStamp: int) -> list:
        now = self._enter_device("nvmlDeviceGetProcessUtilization", handle)
        gpu = self._gpu(handle)
        if handle.mig_index is not None or gpu.sharing.mode == SHARING_MIG:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        unit = self._unit(handle, now)
        if gpu.sharing.mode == SHARING_MPS:
            # The real driver answers on an MPS GPU with the server's samples alone, carrying the device's
            # utilization: the clients' kernels are the server's to NVML (bench/results/gpu_machine).
            servers = [
                pynvml.c_nvmlProcessUtilizationSample_t(
                    pid=p.pid, timeStamp=now * 1000, smUtil=unit.gpu_utilization_percent,
                    memUtil=unit.memory_utilization_percent, encUtil=0, decUtil=0,
                )
                for p in unit.processes
                if p.is_mps_server and unit.gpu_utilization_percent > 0 and now * 1000 > timeStamp
            ]
            if not servers:
                _fail(pynvml.NVML_ERROR_NOT_FOUND)
            return servers
        samples = [
            pynvml.c_nvmlProcessUtilizationSample_t(
                pid=p.pid,
                timeStamp=p.sample_timestamp_us,
                smUtil=p.sm_util_percent,
                memUtil=p.mem_util_percent,
                encUtil=0,
                decUtil=0,
            )
            for p in unit.processes
            if p.sm_util_percent is not None and p.sample_timestamp_us > timeStamp
        ]
        if not samples:
            _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return samples
