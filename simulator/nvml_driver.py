"""The simulated NVML driver at its C boundary: what ``libnvidia-ml.so`` would answer for one node of a ``SimWorld``.

nvidia-ml-py (the ``pynvml`` module) calls the library through ctypes: every wrapper looks its C symbol up with
``_nvmlGetFunctionPointer(name)`` = ``getattr(pynvml.nvmlLib, name)``, calls it with ctypes arguments (handles,
``byref`` out-parameters, caller-allocated arrays, version-stamped structs) and turns a return code other than
``NVML_SUCCESS`` into ``NVMLError(code)``, i.e. its subclass (``NVMLError_GpuIsLost``, ...).

``SimulatedNvmlLibrary(world, clock, node_name)`` is such a library: each NVML symbol below is an attribute holding
a ``CFUNCTYPE`` function pointer over a Python function that answers from the world at ``clock.now_ms()``,
returns an NVML return code and writes its answer through the pointers it was given, in the C layouts of
``nvml.h`` (declared here, not borrowed from pynvml: a wrapper allocating the wrong struct gets the C layout
written into it, as with the real library). ``load_pynvml(library)`` gives a private copy of the installed pynvml
module whose ``nvmlLib`` is that library, so pynvml's own code runs unchanged over it: its ``_v2``/``_v3`` symbol
choices, the struct versions (``c_nvmlMemory_v2_t``, ``c_nvmlProcessInfo_v3_t``), the
``NVML_ERROR_INSUFFICIENT_SIZE`` size-probe loops, the error-to-exception mapping. One copy per simulated node,
because pynvml keeps its library in a module global and one process (``gpumeter replay``, the tests) simulates
several nodes. The copies share the installed module's exception classes, so ``except pynvml.NVMLError_GpuIsLost``
catches a simulated node's errors as it catches the real library's (so ``str()`` of a code pynvml has no text
for, such as ARGUMENT_VERSION_MISMATCH, asks the installed module's library, and reads "NVML Error with code 25"
where a real GPU's library says "Argument version mismatch"); ``simulated_pynvml(world, clock, node)`` does both
steps.

What the C functions answer follows the driver (driver 580.159.04 on an H200 where it was measured:
docs/attribution.md, "What a real GPU answered"; ``simulator/world.py`` for the model):

* A symbol not served here is absent: pynvml's lookup raises FUNCTION_NOT_FOUND, as with an older library.
* Every call before ``nvmlInitWithFlags`` (or after the matching ``nvmlShutdown``) returns UNINITIALIZED; a null
  out-pointer or a handle that is not one of this library's returns INVALID_ARGUMENT.
* Buffers: a string longer than the caller's length (with its NUL) returns INSUFFICIENT_SIZE; the process lists
  (``nvmlDeviceGetComputeRunningProcesses_v3``, ``nvmlDeviceGetMPSComputeRunningProcesses_v3``) and the samples
  (``nvmlDeviceGetProcessUtilization``, ``nvmlDeviceGetProcessesUtilizationInfo``) write the count needed and
  return INSUFFICIENT_SIZE when the caller's count is smaller (the size probe passes a null array with count 0);
  an empty process list returns SUCCESS with count 0; no samples newer than ``lastSeenTimeStamp`` returns
  NOT_FOUND.
* Versioned structs (``nvmlMemory_v2_t``, ``nvmlGpuInstanceProfileInfo_v2_t``,
  ``nvmlProcessesUtilizationInfo_v1_t``) whose ``version`` field is not the one this library knows return
  ARGUMENT_VERSION_MISMATCH.
* Memory: v1 ``used`` includes the driver reserve; v2 has ``total = free + used + reserved`` (a GPU configured with
  ``memory_v2_used_includes_reserved`` reports ``used`` with the reserve in it, as some drivers do).
* Utilization rates: NOT_SUPPORTED on a MIG-enabled GPU and on MIG devices. Power: NOT_SUPPORTED on MIG devices.
* Processes: on an MPS GPU the compute list holds the MPS server, then every client; the MPS list the clients
  alone, with the same ``usedGpuMemory`` (empty elsewhere). A MIG device lists its own processes, the MIG-enabled
  parent every instance's. ``gpuInstanceId``/``computeInstanceId`` are 0xFFFFFFFF off MIG.
* Per-process utilization: one sample per process that ran kernels in the last period and is newer than
  ``lastSeenTimeStamp`` (µs); NOT_SUPPORTED on MIG-enabled GPUs and MIG devices; on an MPS GPU only the server
  has samples, its ``smUtil`` the device's utilization (as on the H200).
* MIG: ``nvmlDeviceGetMigMode`` NOT_SUPPORTED on GPUs without MIG; ``nvmlDeviceGetMaxMigDeviceCount`` 7 when
  enabled, else 0; ``nvmlDeviceGetMigDeviceHandleByIndex`` NOT_FOUND for an index without an instance;
  ``nvmlDeviceGetAttributes_v2`` (MIG devices only); ``nvmlDeviceGetGpuInstanceProfileInfo``/``...InfoV`` describe
  each profile of a MIG-capable GPU (``name`` like ``"MIG 1g.10gb"``); a MIG device's name is
  ``"<GPU name> MIG <profile>"``. GPU-only calls on a MIG handle and MIG-only calls on a GPU handle return
  NOT_SUPPORTED / INVALID_ARGUMENT.
* Scenario faults: after a GPU is lost every call on it or its MIG devices returns GPU_IS_LOST; an ``nvml_error``
  fault names the pynvml function (``nvmlDeviceGetMemoryInfo``), and fails each C symbol behind it
  (``nvmlDeviceGetMemoryInfo``, ``nvmlDeviceGetMemoryInfo_v2``).

A Python exception inside a callback would otherwise reach C as return value 0 (SUCCESS) with nothing written:
it is recorded in ``callback_exceptions`` and returns UNKNOWN. ``call_counts`` counts the C calls by symbol.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import threading
from collections import Counter
from ctypes import CFUNCTYPE, c_char_p, c_int, c_uint, c_ulonglong, c_void_p
from types import ModuleType
from typing import Any, Callable

from gpumeter.clock import Clock
from simulator.scenario import (
    MIB,
    MIG_PROFILES_BY_MEMORY_CLASS,
    MIG_TOTAL_COMPUTE_SLICES,
    MIG_TOTAL_MEMORY_SLICES,
    NVML_DEVICE_FUNCTIONS,
    NVML_ERROR_CODES,
    NVML_NODE_FUNCTIONS,
    SHARING_MIG,
    SHARING_MPS,
    GpuSpec,
    mig_memory_class,
)
from simulator.world import GpuObservation, SimWorld, UnitObservation

# ---- nvml.h: return codes ------------------------------------------------------------------------------------

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999

# nvmlErrorString's text for each code (nvml.h's documentation of nvmlReturn_t); other codes: "Unknown Error".
_ERROR_STRINGS = {
    0: b"Success",
    1: b"Uninitialized",
    2: b"Invalid Argument",
    3: b"Not Supported",
    4: b"Insufficient Permissions",
    5: b"Already Initialized",
    6: b"Not Found",
    7: b"Insufficient Size",
    8: b"Insufficient External Power",
    9: b"Driver Not Loaded",
    10: b"Timeout",
    11: b"Interrupt Request Issue",
    12: b"NVML Shared Library Not Found",
    13: b"Function Not Found",
    14: b"Corrupted infoROM",
    15: b"GPU is lost",
    16: b"GPU requires restart",
    17: b"The operating system has blocked the request.",
    18: b"RM has detected an NVML/RM version mismatch.",
    19: b"Operation in progress",
    20: b"Insufficient Memory",
    21: b"No Data",
    22: b"The requested vgpu operation is not available on target device, because ECC is enabled",
    23: b"Insufficient resources",
    24: b"The requested frequency is not supported",
    25: b"Argument version mismatch",
    26: b"Deprecated",
    27: b"Not ready",
    28: b"GPU not found",
    29: b"Invalid state",
    30: b"Reset type not supported",
    999: b"Unknown Error",
}

# ---- nvml.h: structs ------------------------------------------------------------------------------------------


class _Memory(ctypes.Structure):  # nvmlMemory_t
    _fields_ = [("total", c_ulonglong), ("free", c_ulonglong), ("used", c_ulonglong)]


class _MemoryV2(ctypes.Structure):  # nvmlMemory_v2_t
    _fields_ = [
        ("version", c_uint),
        ("total", c_ulonglong),
        ("reserved", c_ulonglong),
        ("free", c_ulonglong),
        ("used", c_ulonglong),
    ]


class _Utilization(ctypes.Structure):  # nvmlUtilization_t
    _fields_ = [("gpu", c_uint), ("memory", c_uint)]


class _ProcessInfo(ctypes.Structure):  # nvmlProcessInfo_t, the layout behind the _v3 process-list symbols
    _fields_ = [
        ("pid", c_uint),
        ("usedGpuMemory", c_ulonglong),
        ("gpuInstanceId", c_uint),
        ("computeInstanceId", c_uint),
    ]


class _ProcessUtilizationSample(ctypes.Structure):  # nvmlProcessUtilizationSample_t
    _fields_ = [
        ("pid", c_uint),
        ("timeStamp", c_ulonglong),
        ("smUtil", c_uint),
        ("memUtil", c_uint),
        ("encUtil", c_uint),
        ("decUtil", c_uint),
    ]


class _ProcessUtilizationInfoV1(ctypes.Structure):  # nvmlProcessUtilizationInfo_v1_t
    _fields_ = [
        ("timeStamp", c_ulonglong),
        ("pid", c_uint),
        ("smUtil", c_uint),
        ("memUtil", c_uint),
        ("encUtil", c_uint),
        ("decUtil", c_uint),
        ("jpgUtil", c_uint),
        ("ofaUtil", c_uint),
    ]


class _ProcessesUtilizationInfoV1(ctypes.Structure):  # nvmlProcessesUtilizationInfo_v1_t
    _fields_ = [
        ("version", c_uint),
        ("processSamplesCount", c_uint),
        ("lastSeenTimeStamp", c_ulonglong),
        ("procUtilArray", c_void_p),
    ]


class _DeviceAttributes(ctypes.Structure):  # nvmlDeviceAttributes_t
    _fields_ = [
        ("multiprocessorCount", c_uint),
        ("sharedCopyEngineCount", c_uint),
        ("sharedDecoderCount", c_uint),
        ("sharedEncoderCount", c_uint),
        ("sharedJpegCount", c_uint),
        ("sharedOfaCount", c_uint),
        ("gpuInstanceSliceCount", c_uint),
        ("computeInstanceSliceCount", c_uint),
        ("memorySizeMB", c_ulonglong),
    ]


_PROFILE_FIELDS = [
    ("id", c_uint),
    ("isP2pSupported", c_uint),
    ("sliceCount", c_uint),
    ("instanceCount", c_uint),
    ("multiprocessorCount", c_uint),
    ("copyEngineCount", c_uint),
    ("decoderCount", c_uint),
    ("encoderCount", c_uint),
    ("jpegCount", c_uint),
    ("ofaCount", c_uint),
    ("memorySizeMB", c_ulonglong),
]


class _GpuInstanceProfileInfo(ctypes.Structure):  # nvmlGpuInstanceProfileInfo_t
    _fields_ = _PROFILE_FIELDS


class _GpuInstanceProfileInfoV2(ctypes.Structure):  # nvmlGpuInstanceProfileInfo_v2_t
    _fields_ = [("version", c_uint), *_PROFILE_FIELDS, ("name", ctypes.c_char * 96)]


def _struct_version(struct: type, version: int) -> int:
    """nvml.h's NVML_STRUCT_VERSION: the struct's size with the version number in the top byte."""
    return ctypes.sizeof(struct) | (version << 24)


NVML_MEMORY_V2 = _struct_version(_MemoryV2, 2)
NVML_GPU_INSTANCE_PROFILE_INFO_V2 = _struct_version(_GpuInstanceProfileInfoV2, 2)
NVML_PROCESSES_UTILIZATION_INFO_V1 = _struct_version(_ProcessesUtilizationInfoV1, 1)

_NOT_IN_MIG = 0xFFFFFFFF
_MIG_ENABLE, _MIG_DISABLE = 1, 0

# Each C symbol's pynvml-level name, which scenario faults use (a fault on nvmlDeviceGetMemoryInfo fails v1 and v2).
_API_NAME = {
    "nvmlInitWithFlags": "nvmlInit",
    "nvmlDeviceGetCount_v2": "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex_v2": "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetMemoryInfo_v2": "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetComputeRunningProcesses_v3": "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetMPSComputeRunningProcesses_v3": "nvmlDeviceGetMPSComputeRunningProcesses",
    "nvmlDeviceGetGpuInstanceProfileInfoV": "nvmlDeviceGetGpuInstanceProfileInfo",
    "nvmlDeviceGetAttributes_v2": "nvmlDeviceGetAttributes",
}
# The names a scenario fault may give for each symbol: its pynvml-level one, and its own where a scenario may name
# it (nvmlDeviceGetAttributes_v2); a fault on every device function ('*') sees the pynvml-level name alone, so
# nvmlDeviceGetCount_v2 stays a node function.
_FAULT_NAMES = {
    symbol: (api, symbol) if symbol in NVML_DEVICE_FUNCTIONS | NVML_NODE_FUNCTIONS else (api,)
    for symbol, api in _API_NAME.items()
}

# Pointers are c_void_p (the callback gets an address), scalars their C type; the return value is nvmlReturn_t.
_PROTOTYPES: dict[str, tuple[Any, ...]] = {
    "nvmlInitWithFlags": (c_uint,),
    "nvmlShutdown": (),
    "nvmlSystemGetDriverVersion": (c_void_p, c_uint),
    "nvmlDeviceGetCount_v2": (c_void_p,),
    "nvmlDeviceGetHandleByIndex_v2": (c_uint, c_void_p),
    "nvmlDeviceGetHandleByUUID": (c_char_p, c_void_p),
    "nvmlDeviceIsMigDeviceHandle": (c_void_p, c_void_p),
    "nvmlDeviceGetUUID": (c_void_p, c_void_p, c_uint),
    "nvmlDeviceGetName": (c_void_p, c_void_p, c_uint),
    "nvmlDeviceGetMemoryInfo": (c_void_p, c_void_p),
    "nvmlDeviceGetMemoryInfo_v2": (c_void_p, c_void_p),
    "nvmlDeviceGetUtilizationRates": (c_void_p, c_void_p),
    "nvmlDeviceGetPowerUsage": (c_void_p, c_void_p),
    "nvmlDeviceGetMigMode": (c_void_p, c_void_p, c_void_p),
    "nvmlDeviceGetMaxMigDeviceCount": (c_void_p, c_void_p),
    "nvmlDeviceGetMigDeviceHandleByIndex": (c_void_p, c_uint, c_void_p),
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": (c_void_p, c_void_p),
    "nvmlDeviceGetGpuInstanceId": (c_void_p, c_void_p),
    "nvmlDeviceGetComputeInstanceId": (c_void_p, c_void_p),
    "nvmlDeviceGetAttributes_v2": (c_void_p, c_void_p),
    "nvmlDeviceGetGpuInstanceProfileInfo": (c_void_p, c_uint, c_void_p),
    "nvmlDeviceGetGpuInstanceProfileInfoV": (c_void_p, c_uint, c_void_p),
    "nvmlDeviceGetComputeRunningProcesses_v3": (c_void_p, c_void_p, c_void_p),
    "nvmlDeviceGetMPSComputeRunningProcesses_v3": (c_void_p, c_void_p, c_void_p),
    "nvmlDeviceGetProcessUtilization": (c_void_p, c_void_p, c_void_p, c_ulonglong),
    "nvmlDeviceGetProcessesUtilizationInfo": (c_void_p, c_void_p),
}
SYMBOLS = frozenset(_PROTOTYPES) | {"nvmlErrorString"}
"""Every NVML symbol this library serves."""


class _Fail(Exception):
    """Return ``code`` from the C function now."""

    def __init__(self, code: int) -> None:
        self.code = code


def _fail(code: int) -> None:
    raise _Fail(code)


def _sm_per_slice(model: str) -> int:
    # H100/H200 SXM have 132 SMs (7 slices × 16 usable + spares); A100 has 108 (7 × 14).
    return 16 if ("H100" in model or "H200" in model) else 14


def _uint(address: int | None) -> c_uint:
    if not address:
        _fail(NVML_ERROR_INVALID_ARGUMENT)
    return c_uint.from_address(address)


def _write_string(address: int | None, length: int, text: str) -> None:
    data = text.encode()
    if not address:
        _fail(NVML_ERROR_INVALID_ARGUMENT)
    if length < len(data) + 1:
        _fail(NVML_ERROR_INSUFFICIENT_SIZE)
    ctypes.memmove(address, data + b"\0", len(data) + 1)


class SimulatedNvmlLibrary:
    """``libnvidia-ml.so`` for one node of a ``SimWorld``, reading the world at ``clock.now_ms()``.

    Install it as a pynvml module's ``nvmlLib`` (``load_pynvml``). ``node_name`` may be left out when the scenario
    has one node. Not thread-safe beyond what one pynvml module's callers do (the collector reads from one task).
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
        self.callback_exceptions: list[BaseException] = []
        # A node without faults answers every call: its calls skip the fault checks (the same answers, cheaper).
        self._faulty = bool(self._node.faults)
        # Handles are addresses of memory this library owns (pynvml never dereferences them); each names a GPU
        # index and a MIG index (None: the GPU itself).
        self._handle_memory: dict[tuple[int, int | None], Any] = {}
        self._handle_keys: dict[int, tuple[int, int | None]] = {}
        self._error_strings = {code: ctypes.create_string_buffer(text) for code, text in _ERROR_STRINGS.items()}
        for symbol, argtypes in _PROTOTYPES.items():
            setattr(self, symbol, CFUNCTYPE(c_int, *argtypes)(self._entry(symbol, getattr(self, "_" + symbol))))
        self.nvmlErrorString = CFUNCTYPE(c_void_p, c_int)(self._error_string)

    def __repr__(self) -> str:
        return f"<SimulatedNvmlLibrary node={self.node_name!r}>"

    # ---- plumbing -------------------------------------------------------------------------------------------

    def _entry(self, symbol: str, function: Callable[..., None]) -> Callable[..., int]:
        counts = self.call_counts

        def entry(*args: Any) -> int:
            counts[symbol] += 1
            try:
                function(*args)
            except _Fail as fail:
                return fail.code
            except Exception as exc:  # reaching C it would read as SUCCESS with nothing written
                self.callback_exceptions.append(exc)
                return NVML_ERROR_UNKNOWN
            return NVML_SUCCESS

        entry.__name__ = symbol
        return entry

    def _error_string(self, code: int) -> int | None:
        buffer = self._error_strings.get(code, self._error_strings[NVML_ERROR_UNKNOWN])
        return ctypes.addressof(buffer)

    def _now(self) -> int:
        now = self._clock.now_ms()
        if now > self._world.now_ms:
            self._world.step(now)
        return now

    def _faults(self, symbol: str, gpu_index: int | None, now: int) -> None:
        for name in _FAULT_NAMES.get(symbol, (symbol,)):
            error = self._world.nvml_fault(self.node_name, name, gpu_index, now)
            if error is not None:
                _fail(_code(error))

    def _enter(self, symbol: str) -> int:
        if self._refcount <= 0:
            _fail(NVML_ERROR_UNINITIALIZED)
        now = self._now()
        if self._faulty:
            self._faults(symbol, None, now)
        return now

    def _device(self, symbol: str, handle: int | None) -> tuple[int, int | None, int]:
        """(gpu index, MIG index or None, now) of ``handle``, after the lost-GPU and fault checks."""
        if self._refcount <= 0:
            _fail(NVML_ERROR_UNINITIALIZED)
        key = self._handle_keys.get(handle or 0)
        if key is None:
            _fail(NVML_ERROR_INVALID_ARGUMENT)
            raise AssertionError("unreachable")
        now = self._now()
        if self._faulty:
            if self._world.gpu_lost(self.node_name, key[0], now):
                _fail(NVML_ERROR_GPU_IS_LOST)
            self._faults(symbol, key[0], now)
        return key[0], key[1], now

    def _write_handle(self, address: int | None, gpu_index: int, mig_index: int | None) -> None:
        if not address:
            _fail(NVML_ERROR_INVALID_ARGUMENT)
        key = (gpu_index, mig_index)
        memory = self._handle_memory.get(key)
        if memory is None:
            memory = self._handle_memory[key] = ctypes.create_string_buffer(8)
            self._handle_keys[ctypes.addressof(memory)] = key
        c_void_p.from_address(address).value = ctypes.addressof(memory)

    def _gpu(self, gpu_index: int) -> GpuSpec:
        return self._node.gpus[gpu_index]

    def _observation(self, gpu_index: int, now: int) -> GpuObservation:
        return self._world.observation_at(now, self.node_name, gpu_index)

    def _unit(self, gpu_index: int, mig_index: int | None, now: int) -> UnitObservation:
        return self._observation(gpu_index, now).units[mig_index or 0]

    # ---- library --------------------------------------------------------------------------------------------

    def _nvmlInitWithFlags(self, flags: int) -> None:
        if self._faulty:
            self._faults("nvmlInitWithFlags", None, self._now())
        self._refcount += 1

    def _nvmlShutdown(self) -> None:
        if self._refcount <= 0:
            _fail(NVML_ERROR_UNINITIALIZED)
        self._refcount -= 1

    def _nvmlSystemGetDriverVersion(self, version: int | None, length: int) -> None:
        self._enter("nvmlSystemGetDriverVersion")
        _write_string(version, length, self._node.driver_version)

    def _nvmlDeviceGetCount_v2(self, count: int | None) -> None:
        self._enter("nvmlDeviceGetCount_v2")
        _uint(count).value = len(self._node.gpus)

    # ---- handles --------------------------------------------------------------------------------------------

    def _nvmlDeviceGetHandleByIndex_v2(self, index: int, device: int | None) -> None:
        if self._refcount <= 0:
            _fail(NVML_ERROR_UNINITIALIZED)
        if not 0 <= index < len(self._node.gpus) or not device:
            _fail(NVML_ERROR_INVALID_ARGUMENT)
        now = self._now()
        if self._faulty:
            if self._world.gpu_lost(self.node_name, index, now):
                _fail(NVML_ERROR_GPU_IS_LOST)
            self._faults("nvmlDeviceGetHandleByIndex_v2", index, now)
        self._write_handle(device, index, None)

    def _nvmlDeviceGetHandleByUUID(self, uuid: bytes | None, device: int | None) -> None:
        now = self._enter("nvmlDeviceGetHandleByUUID")
        if uuid is None or not device:
            _fail(NVML_ERROR_INVALID_ARGUMENT)
            raise AssertionError("unreachable")
        text = uuid.decode(errors="replace")
        for gpu in self._node.gpus:
            candidates = [(gpu.uuid, None)] + [(i.uuid, i.index) for i in gpu.sharing.mig_instances]
            for candidate, mig_index in candidates:
                if candidate == text:
                    if self._world.gpu_lost(self.node_name, gpu.index, now):
                        _fail(NVML_ERROR_GPU_IS_LOST)
                    self._write_handle(device, gpu.index, mig_index)
                    return
        _fail(NVML_ERROR_NOT_FOUND)

    def _nvmlDeviceIsMigDeviceHandle(self, handle: int | None, is_mig: int | None) -> None:
        _, mig_index, _ = self._device("nvmlDeviceIsMigDeviceHandle", handle)
        _uint(is_mig).value = 0 if mig_index is None else 1

    # ---- identity -------------------------------------------------------------------------------------------

    def _nvmlDeviceGetUUID(self, handle: int | None, uuid: int | None, length: int) -> None:
        gpu_index, mig_index, _ = self._device("nvmlDeviceGetUUID", handle)
        gpu = self._gpu(gpu_index)
        text = gpu.uuid if mig_index is None else gpu.sharing.mig_instances[mig_index].uuid
        _write_string(uuid, length, text)

    def _nvmlDeviceGetName(self, handle: int | None, name: int | None, length: int) -> None:
        gpu_index, mig_index, _ = self._device("nvmlDeviceGetName", handle)
        gpu = self._gpu(gpu_index)
        if mig_index is None:
            text = gpu.model
        else:
            text = f"{gpu.model} MIG {gpu.sharing.mig_instances[mig_index].profile.name}"
        _write_string(name, length, text)

    # ---- memory, utilization, power -------------------------------------------------------------------------

    def _memory(self, gpu_index: int, mig_index: int | None, now: int) -> tuple[int, int, int, int]:
        """(total, reserved, used without the reserve, free) of the GPU or MIG device."""
        if mig_index is None:
            obs = self._observation(gpu_index, now)
            return obs.memory_total_bytes, obs.memory_reserved_bytes, obs.memory_used_bytes, obs.memory_free_bytes
        unit = self._unit(gpu_index, mig_index, now)
        return unit.memory_total_bytes, unit.memory_reserved_bytes, unit.memory_used_bytes, unit.memory_free_bytes

    def _nvmlDeviceGetMemoryInfo(self, handle: int | None, memory: int | None) -> None:
        gpu_index, mig_index, now = self._device("nvmlDeviceGetMemoryInfo", handle)
        if not memory:
            _fail(NVML_ERROR_INVALID_ARGUMENT)
        total, reserved, used, free = self._memory(gpu_index, mig_index, now)
        out = _Memory.from_address(memory)
        out.total, out.free, out.used = total, free, used + reserved

    def _nvmlDeviceGetMemoryInfo_v2(self, handle: int | None, memory: int | None) -> None:
        gpu_index, mig_index, now = self._device("nvmlDeviceGetMemoryInfo_v2", handle)
        if not memory:
            _fail(NVML_ERROR_INVALID_ARGUMENT)
        out = _MemoryV2.from_address(memory)
        if out.version != NVML_MEMORY_V2:
            _fail(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        total, reserved, used, free = self._memory(gpu_index, mig_index, now)
        if self._gpu(gpu_index).memory_v2_used_includes_reserved:
            used += reserved
        out.total, out.reserved, out.free, out.used = total, reserved, free, used

    def _nvmlDeviceGetUtilizationRates(self, handle: int | None, utilization: int | None) -> None:
        gpu_index, mig_index, now = self._device("nvmlDeviceGetUtilizationRates", handle)
        if self._gpu(gpu_index).sharing.mode == SHARING_MIG:
            _fail(NVML_ERROR_NOT_SUPPORTED)
        if not utilization:
            _fail(NVML_ERROR_INVALID_ARGUMENT)
        unit = self._unit(gpu_index, mig_index, now)
        out = _Utilization.from_address(utilization)
        out.gpu, out.memory = unit.gpu_utilization_percent, unit.memory_utilization_percent

    def _nvmlDeviceGetPowerUsage(self, handle: int | None, power: int | None) -> None:
        gpu_index, mig_index, now = self._device("nvmlDeviceGetPowerUsage", handle)
        if mig_index is not None:
            _fail(NVML_ERROR_NOT_SUPPORTED)
        _uint(power).value = self._observation(gpu_index, now).power_milliwatts

    # ---- MIG ------------------------------------------------------------------------------------------------

    def _nvmlDeviceGetMigMode(self, handle: int | None, current: int | None, pending: int | None) -> None:
        gpu_index, mig_index, _ = self._device("nvmlDeviceGetMigMode", handle)
        gpu = self._gpu(gpu_index)
        if mig_index is not None or not gpu.mig_capable:
            _fail(NVML_ERROR_NOT_SUPPORTED)
        mode = _MIG_ENABLE if gpu.sharing.mode == SHARING_MIG else _MIG_DISABLE
        current_out, pending_out = _uint(current), _uint(pending)
        current_out.value = pending_out.value = mode

    def _nvmlDeviceGetMaxMigDeviceCount(self, handle: int | None, count: int | None) -> None:
        gpu_index, mig_index, _ = self._device("nvmlDeviceGetMaxMigDeviceCount", handle)
        if mig_index is not None:
            _fail(NVML_ERROR_INVALID_ARGUMENT)
        _uint(count).value = MIG_TOTAL_COMPUTE_SLICES if self._gpu(gpu_index).sharing.mode == SHARING_MIG else 0

    def _nvmlDeviceGetMigDeviceHandleByIndex(self, handle: int | None, index: int, mig_device: int | None) -> None:
        gpu_index, mig_index, _ = self._device("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        gpu = self._gpu(gpu_index)
        if mig_index is not None:
            _fail(NVML_ERROR_INVALID_ARGUMENT)
        if not gpu.mig_capable:
            _fail(NVML_ERROR_NOT_SUPPORTED)
        if gpu.sharing.mode != SHARING_MIG:
            _fail(NVML_ERROR_NOT_FOUND)
        if not 0 <= index < MIG_TOTAL_COMPUTE_SLICES:
            _fail(NVML_ERROR_INVALID_ARGUMENT)
        if index >= len(gpu.sharing.mig_instances):
            _fail(NVML_ERROR_NOT_FOUND)
        self._write_handle(mig_device, gpu_index, index)

    def _nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: int | None, device: int | None) -> None:
        gpu_index, mig_index, _ = self._device("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle)
        if mig_index is None:
            _fail(NVML_ERROR_NOT_SUPPORTED)
        self._write_handle(device, gpu_index, None)

    def _nvmlDeviceGetGpuInstanceId(self, handle: int | None, out: int | None) -> None:
        gpu_index, mig_index, _ = self._device("nvmlDeviceGetGpuInstanceId", handle)
        if mig_index is None:
            _fail(NVML_ERROR_NOT_SUPPORTED)
            raise AssertionError("unreachable")
        _uint(out).value = self._gpu(gpu_index).sharing.mig_instances[mig_index].gpu_instance_id

    def _nvmlDeviceGetComputeInstanceId(self, handle: int | None, out: int | None) -> None:
        gpu_index, mig_index, _ = self._device("nvmlDeviceGetComputeInstanceId", handle)
        if mig_index is None:
            _fail(NVML_ERROR_NOT_SUPPORTED)
            raise AssertionError("unreachable")
        _uint(out).value = self._gpu(gpu_index).sharing.mig_instances[mig_index].compute_instance_id

    def _nvmlDeviceGetAttributes_v2(self, handle: int | None, attributes: int | None) -> None:
        gpu_index, mig_index, _ = self._device("nvmlDeviceGetAttributes_v2", handle)
        if mig_index is None:
            _fail(NVML_ERROR_NOT_SUPPORTED)  # NVML documents these attributes for MIG devices only
            raise AssertionError("unreachable")
        if not attributes:
            _fail(NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._gpu(gpu_index)
        instance = gpu.sharing.mig_instances[mig_index]
        slices = instance.profile.compute_slices
        out = _DeviceAttributes.from_address(attributes)
        out.multiprocessorCount = slices * _sm_per_slice(gpu.model)
        out.sharedCopyEngineCount = slices
        out.sharedDecoderCount = min(slices, 5)
        out.sharedEncoderCount = 0
        out.sharedJpegCount = out.sharedOfaCount = 1 if slices >= 7 else 0
        out.gpuInstanceSliceCount = out.computeInstanceSliceCount = slices
        out.memorySizeMB = instance.memory_total_bytes // MIB

    def _profile_info(self, symbol: str, handle: int | None, profile: int, info: int | None, v2: bool) -> None:
        gpu_index, mig_index, _ = self._device(symbol, handle)
        if mig_index is not None:
            _fail(NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._gpu(gpu_index)
        if not gpu.mig_capable:
            _fail(NVML_ERROR_NOT_SUPPORTED)
        if not info:
            _fail(NVML_ERROR_INVALID_ARGUMENT)
            raise AssertionError("unreachable")
        out: Any
        if v2:
            out = _GpuInstanceProfileInfoV2.from_address(info)
            if out.version != NVML_GPU_INSTANCE_PROFILE_INFO_V2:
                _fail(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        else:
            out = _GpuInstanceProfileInfo.from_address(info)
        table = MIG_PROFILES_BY_MEMORY_CLASS[mig_memory_class(gpu.memory_total_bytes) or ""]
        match = next((p for p in table.values() if p.nvml_profile_id == profile), None)
        if match is None:
            _fail(NVML_ERROR_NOT_SUPPORTED)
            raise AssertionError("unreachable")
        slice_mib = (gpu.memory_total_bytes - gpu.driver_reserved_bytes) // MIG_TOTAL_MEMORY_SLICES // MIB
        slices = match.compute_slices
        out.id = match.nvml_profile_id
        out.isP2pSupported = 0
        out.sliceCount = slices
        out.instanceCount = match.max_instances
        out.multiprocessorCount = slices * _sm_per_slice(gpu.model)
        out.copyEngineCount = slices
        out.decoderCount = min(slices, 5)
        out.encoderCount = 0
        out.jpegCount = out.ofaCount = 1 if slices >= 7 else 0
        out.memorySizeMB = match.memory_slices * slice_mib
        if v2:
            out.name = f"MIG {match.name}".encode()

    def _nvmlDeviceGetGpuInstanceProfileInfo(self, handle: int | None, profile: int, info: int | None) -> None:
        self._profile_info("nvmlDeviceGetGpuInstanceProfileInfo", handle, profile, info, v2=False)

    def _nvmlDeviceGetGpuInstanceProfileInfoV(self, handle: int | None, profile: int, info: int | None) -> None:
        self._profile_info("nvmlDeviceGetGpuInstanceProfileInfoV", handle, profile, info, v2=True)

    # ---- processes ------------------------------------------------------------------------------------------

    @staticmethod
    def _write_processes(count: int | None, infos: int | None, rows: list[tuple[int, int, int, int]]) -> None:
        """The size-probe protocol of NVML's process lists: the count needed, INSUFFICIENT_SIZE when it is more
        than the caller's; SUCCESS with 0 for an empty list whatever the caller passed."""
        counter = _uint(count)
        capacity = counter.value
        counter.value = len(rows)
        if not rows:
            return
        if capacity < len(rows) or not infos:
            _fail(NVML_ERROR_INSUFFICIENT_SIZE)
        array = (_ProcessInfo * len(rows)).from_address(infos)
        for slot, (pid, used, gi, ci) in zip(array, rows):
            slot.pid, slot.usedGpuMemory, slot.gpuInstanceId, slot.computeInstanceId = pid, used, gi, ci

    def _nvmlDeviceGetComputeRunningProcesses_v3(
        self, handle: int | None, count: int | None, infos: int | None
    ) -> None:
        gpu_index, mig_index, now = self._device("nvmlDeviceGetComputeRunningProcesses_v3", handle)
        obs = self._observation(gpu_index, now)
        units = list(obs.units) if mig_index is None else [obs.units[mig_index]]
        rows: list[tuple[int, int, int, int]] = []
        for unit in units:
            # On an MPS GPU driver 580 lists the MPS server first, then every client with its memory: the clients
            # are in both lists.
            for p in sorted(unit.processes, key=lambda p: p.is_mps_client):
                rows.append((
                    p.pid,
                    p.used_gpu_memory_bytes,
                    _NOT_IN_MIG if p.gpu_instance_id is None else p.gpu_instance_id,
                    _NOT_IN_MIG if p.compute_instance_id is None else p.compute_instance_id,
                ))
        self._write_processes(count, infos, rows)

    def _nvmlDeviceGetMPSComputeRunningProcesses_v3(
        self, handle: int | None, count: int | None, infos: int | None
    ) -> None:
        gpu_index, mig_index, now = self._device("nvmlDeviceGetMPSComputeRunningProcesses_v3", handle)
        rows: list[tuple[int, int, int, int]] = []
        if mig_index is None and self._gpu(gpu_index).sharing.mode == SHARING_MPS:
            unit = self._unit(gpu_index, None, now)
            rows = [
                (p.pid, p.used_gpu_memory_bytes, _NOT_IN_MIG, _NOT_IN_MIG) for p in unit.processes if p.is_mps_client
            ]
        self._write_processes(count, infos, rows)

    def _samples(self, symbol: str, handle: int | None, last_seen_us: int) -> list[tuple[int, int, int, int]]:
        """(pid, timestamp µs, smUtil, memUtil) newer than ``last_seen_us``; NOT_FOUND when there is none."""
        gpu_index, mig_index, now = self._device(symbol, handle)
        gpu = self._gpu(gpu_index)
        if mig_index is not None or gpu.sharing.mode == SHARING_MIG:
            _fail(NVML_ERROR_NOT_SUPPORTED)
        unit = self._unit(gpu_index, None, now)
        if gpu.sharing.mode == SHARING_MPS:
            # On an MPS GPU the driver has the server's samples alone, carrying the device's utilization: the
            # clients' kernels are the server's to NVML (docs/attribution.md, "What a real GPU answered").
            samples = [
                (p.pid, now * 1000, unit.gpu_utilization_percent, unit.memory_utilization_percent)
                for p in unit.processes
                if p.is_mps_server and unit.gpu_utilization_percent > 0 and now * 1000 > last_seen_us
            ]
        else:
            samples = [
                (p.pid, p.sample_timestamp_us, p.sm_util_percent, p.mem_util_percent)
                for p in unit.processes
                if p.sm_util_percent is not None and p.sample_timestamp_us > last_seen_us
            ]
        if not samples:
            _fail(NVML_ERROR_NOT_FOUND)
        return samples

    def _nvmlDeviceGetProcessUtilization(
        self, handle: int | None, utilization: int | None, count: int | None, last_seen_us: int
    ) -> None:
        counter = _uint(count)
        samples = self._samples("nvmlDeviceGetProcessUtilization", handle, last_seen_us)
        capacity = counter.value
        counter.value = len(samples)
        if not utilization or capacity < len(samples):
            _fail(NVML_ERROR_INSUFFICIENT_SIZE)
        array = (_ProcessUtilizationSample * len(samples)).from_address(utilization)
        for slot, (pid, stamp, sm, mem) in zip(array, samples):
            slot.pid, slot.timeStamp, slot.smUtil, slot.memUtil, slot.encUtil, slot.decUtil = pid, stamp, sm, mem, 0, 0

    def _nvmlDeviceGetProcessesUtilizationInfo(self, handle: int | None, info: int | None) -> None:
        if not info:
            _fail(NVML_ERROR_INVALID_ARGUMENT)
        header = _ProcessesUtilizationInfoV1.from_address(info)
        if header.version != NVML_PROCESSES_UTILIZATION_INFO_V1:
            _fail(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        samples = self._samples("nvmlDeviceGetProcessesUtilizationInfo", handle, header.lastSeenTimeStamp)
        capacity = header.processSamplesCount
        header.processSamplesCount = len(samples)
        if not header.procUtilArray or capacity < len(samples):
            _fail(NVML_ERROR_INSUFFICIENT_SIZE)
        array = (_ProcessUtilizationInfoV1 * len(samples)).from_address(header.procUtilArray)
        for slot, (pid, stamp, sm, mem) in zip(array, samples):
            slot.timeStamp, slot.pid, slot.smUtil, slot.memUtil = stamp, pid, sm, mem
            slot.encUtil = slot.decUtil = slot.jpgUtil = slot.ofaUtil = 0


def _code(error_name: str) -> int:
    return NVML_ERROR_CODES[error_name]


# ---- pynvml over the library ----------------------------------------------------------------------------------

_LOAD_LOCK = threading.Lock()
_EXCEPTION_NAMES = ("NVMLError", "NVMLLibraryMismatchError")


def load_pynvml(library: Any) -> ModuleType:
    """A private copy of the installed pynvml module whose ``nvmlLib`` is ``library``.

    pynvml's code runs unchanged; only its library is set (``_LoadNvmlLibrary`` loads nothing when ``nvmlLib`` is
    already set) and its exception classes are the installed module's (``pynvml.NVMLError_NotSupported`` and the
    copy's are one class), so errors from any copy are caught as the real library's are.
    """
    import pynvml as installed

    spec = importlib.util.find_spec("pynvml")
    if spec is None or spec.loader is None:
        raise ImportError("nvidia-ml-py (pynvml) is not installed")
    module = importlib.util.module_from_spec(spec)
    with _LOAD_LOCK:
        # pynvml builds its NVMLError_* classes on sys.modules[__name__]: point that at the copy while it runs, so
        # the installed module is left as it was.
        previous = sys.modules.get("pynvml")
        sys.modules["pynvml"] = module
        try:
            spec.loader.exec_module(module)
        finally:
            if previous is None:
                del sys.modules["pynvml"]
            else:
                sys.modules["pynvml"] = previous
    for name in dir(module):
        if name in _EXCEPTION_NAMES or name.startswith("NVMLError_"):
            setattr(module, name, getattr(installed, name))
    module.nvmlLib = library
    module._nvmlGetFunctionPointer_cache.clear()
    return module


def simulated_pynvml(world: SimWorld, clock: Clock, node_name: str | None = None) -> ModuleType:
    """pynvml (nvidia-ml-py's own code) over a ``SimulatedNvmlLibrary`` of one node; the library is ``.nvmlLib``."""
    return load_pynvml(SimulatedNvmlLibrary(world, clock, node_name))
