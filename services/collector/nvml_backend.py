"""Read every GPU and MIG device of this node through NVML, once per collector tick.

``NvmlBackend(nvml, clock, ...)`` takes the NVML module as a parameter: the real ``pynvml`` (nvidia-ml-py) in
production, a private copy of pynvml over ``simulator.nvml_driver``'s simulated library in simulation
(``simulated_pynvml``). The code path is the same for both:
it only calls pynvml functions and reads pynvml constants and exception classes through ``nvml``.

Contracts:

* ``read()`` / ``sample()`` never raise. Every NVML failure becomes an ``NvmlError`` on the device it concerns
  (``nvml_function``, ``error_code`` the ``NVML_ERROR_*`` name without its prefix, ``message``); failures of
  ``nvmlInit`` and ``nvmlDeviceGetCount`` become node errors. A Python exception out of the binding (a missing
  function in an old nvidia-ml-py, a ctypes error) is recorded the same way with error_code ``PYTHON_EXCEPTION``;
  an answer of an unexpected shape is recorded on the GPU as ``gpumeter.read_gpu`` / ``PYTHON_EXCEPTION``.
* NOT_SUPPORTED is not an error where NVML documents it as the normal answer, and is then recorded only as the
  value it stands for: utilization rates on a MIG-enabled GPU and on MIG devices (``None``), power on MIG devices
  (``None``), MIG mode on GPUs without MIG (MIG off), the MPS process list on drivers without it (none), and
  per-process utilization (``process_utilization_supported`` False, SM -1). Every other failure is recorded.
* After GPU_IS_LOST on a GPU no further call is made on it this tick. A lost GPU (or one whose handle or UUID
  cannot be read) is still reported, under the UUID, model and MIG devices seen on earlier ticks, with zero
  memory, ``None`` utilization and power, no processes and the error. A GPU never identified is reported as
  ``unknown:gpu-index-<n>``.
* Memory comes from memory info v2 (``version=nvml.nvmlMemory_v2``), normalised so that ``used`` excludes the
  driver reserve and ``total = free + used + reserved``: drivers whose v2 ``used`` includes the reserve are
  recognised by ``free + used == total`` (to within 1 MiB) and corrected. Drivers without v2 (FUNCTION_NOT_FOUND,
  ARGUMENT_VERSION_MISMATCH) are read through v1 with ``reserved`` 0.
* Processes: ``nvmlDeviceGetComputeRunningProcesses`` plus ``nvmlDeviceGetMPSComputeRunningProcesses`` (MPS
  clients; driver 580 on an H200 lists the server and the clients in the compute list, the clients alone in the
  MPS list, each with the same memory; older drivers are documented to show only the server in the compute list),
  merged by pid in that order. ``usedGpuMemory`` that NVML cannot report (None) is -1. On a GPU with MPS clients
  (or configured as MPS) the compute list's pids that are no client are reported in ``mps_server_pids``: the
  server runs its clients' kernels. When the client list cannot be read no pid is called a server (the clients
  would be among them).
* One failing call never costs the other figures of its device, nor other devices: a failed memory read leaves
  the four memory figures 0 (unknown: the error says so) beside the processes it did read.
* Per-process SM utilization: ``nvmlDeviceGetProcessUtilization(h, lastSeen)`` with a per-device
  ``lastSeen`` (µs, the newest sample timestamp received so far, 0 at first). NVML returns one sample per process
  that ran kernels since then; a listed process without a sample ran none, so it gets 0; NOT_FOUND means no
  process ran any, so every listed process gets 0 (pynvml's NVMLError(NVML_SUCCESS), raised when the driver holds
  no sample at all, counts as NOT_FOUND). Several samples of one pid are averaged. On an MPS GPU the
  call is not made (its samples are the server's, not the clients'): ``process_utilization_supported`` is False
  and every process -1, as on any failure.
* Sharing mode: MIG when ``nvmlDeviceGetMigMode`` says enabled; MPS when NVML lists MPS clients; otherwise what
  ``claimed_sharing`` (the DRA claims' sharing, set by the collector) or else
  ``sharing_by_gpu_uuid`` (the device plugin's configuration: NVML cannot tell time-slicing from exclusive use)
  says, else ``default_sharing``. A GPU configured as MIG whose MIG mode is off is UNKNOWN.
* MIG: the parent GPU is reported with sharing MIG, the aggregate memory, ``mig_total_compute_slices`` (the
  largest ``sliceCount`` of its GPU instance profiles, else ``nvmlDeviceGetMaxMigDeviceCount``), power, and no
  processes (each process is reported once, on its MIG device). Each MIG device (indices 0 ..
  ``nvmlDeviceGetMaxMigDeviceCount`` − 1; NOT_FOUND means no device at that index; when the count itself fails,
  up to the GPU's slices or the last index seen) is reported with ``parent_uuid``, GPU/compute instance ids,
  ``mig_profile`` (from its name, ``"... MIG 1g.10gb"``, else from the profile whose slices and memory match its
  attributes), ``mig_compute_slices`` (``computeInstanceSliceCount`` of ``nvmlDeviceGetAttributes``, else
  ``gpuInstanceSliceCount``), the GPU's ``mig_total_compute_slices`` (so an instance's fraction of the GPU needs
  nothing else), its own memory and processes. An instance seen before whose handle cannot be read this tick is
  still reported, with its identity and the error and no figures: its capacity is not idle slices of the parent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Protocol

from gpumeter.clock import Clock
from schemas.records import GpuDeviceSample, NvmlError, SharingMode

PYTHON_EXCEPTION = "PYTHON_EXCEPTION"
READ_GPU_STEP = "gpumeter.read_gpu"  # nvml_function of an error raised while interpreting NVML's answers
UNKNOWN_GPU_PREFIX = "unknown:gpu-index-"
_MIB = 1 << 20
_MIG_NAME = re.compile(r"\bMIG\s+(\d+g\.\d+gb(?:\+\w+)?)\s*$")
_FAILED = object()


@dataclass(frozen=True, slots=True)
class RawDeviceSample:
    """One GPU or MIG device in one tick: a ``GpuDeviceSample`` before processes are mapped to pods.

    Per-process tuples are parallel. ``process_used_memory_bytes`` is -1 where NVML could not report it and
    ``process_sm_utilization_percent`` -1 where NVML gave no per-process utilization.
    """

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
    process_used_memory_bytes: tuple[int, ...]
    process_sm_utilization_percent: tuple[int, ...]
    mps_server_pids: tuple[int, ...] = ()

    def to_device_sample(self, process_pod_index: tuple[int, ...]) -> GpuDeviceSample:
        """The record with each process's pod index (one per process, -1 for none)."""
        if len(process_pod_index) != len(self.process_pids):
            raise ValueError("one pod index per process")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return GpuDeviceSample(**values, process_pod_index=tuple(process_pod_index))


class NvmlReading(NamedTuple):
    """One tick's NVML view of the node: its devices and the errors tied to no device.

    A named tuple, so ``devices, node_errors = backend.read()`` works.
    """

    devices: tuple[RawDeviceSample, ...]
    node_errors: tuple[NvmlError, ...]


class NvmlMetricsHook(Protocol):
    def nvml_call(self, function: str, duration_seconds: float, error_code: str | None) -> None:
        """Called after every NVML call with its duration and the error code name (None on success)."""


@dataclass(frozen=True, slots=True)
class _MigIdentity:
    mig_index: int
    uuid: str
    gpu_instance_id: int | None
    compute_instance_id: int | None
    profile: str | None
    compute_slices: int


@dataclass(frozen=True, slots=True)
class _GpuIdentity:
    uuid: str
    model: str
    sharing_mode: SharingMode
    replicas: int
    mig_total_compute_slices: int


@dataclass(frozen=True, slots=True)
class _ProfileInfo:
    slices: int
    memory_mib: int
    name: str


class _Calls:
    """NVML calls for one device in one tick: records failures, stops after the device is lost."""

    def __init__(self, backend: "NvmlBackend") -> None:
        self._backend = backend
        self.errors: list[NvmlError] = []
        self.last_code: int | None = None
        self.lost = False

    def __call__(self, function: str, *args: Any, expected: tuple[int, ...] = (), **kwargs: Any) -> Any:
        if self.lost:
            self.last_code = self._backend._gpu_is_lost
            return _FAILED
        value, code, error = self._backend._invoke(function, *args, **kwargs)
        self.last_code = code
        if error is None:
            return value
        if code == self._backend._gpu_is_lost:
            self.lost = True
        if code not in expected:
            self.errors.append(error)
        return _FAILED


class NvmlBackend:
    """Samples this node's GPUs through ``nvml`` (pynvml over the real or the simulated library); see the module
    docstring."""

    def __init__(
        self,
        nvml: Any,
        clock: Clock,
        *,
        sharing_by_gpu_uuid: Mapping[str, tuple[SharingMode, int]] | None = None,
        default_sharing: tuple[SharingMode, int] = (SharingMode.UNKNOWN, 1),
        metrics: NvmlMetricsHook | None = None,
    ) -> None:
        self._nvml = nvml
        self._clock = clock
        self._sharing = MappingProxyType(dict(sharing_by_gpu_uuid or {}))
        # What the pods' DRA claims configure (set by the collector from ResourceClaims): wins over the
        # device-plugin configuration, which does not apply to a GPU the DRA driver allocates.
        self.claimed_sharing: Mapping[str, tuple[SharingMode, int]] = MappingProxyType({})
        self._default_sharing = default_sharing
        self._metrics = metrics
        self._initialized = False
        self._last_seen_us: dict[str, int] = {}
        self._gpus: dict[int, _GpuIdentity] = {}
        self._migs: dict[str, dict[int, _MigIdentity]] = {}
        self._profiles: dict[str, tuple[_ProfileInfo, ...]] = {}
        self._node_errors: tuple[NvmlError, ...] = ()
        self._error_names = {
            getattr(nvml, name): name[len("NVML_ERROR_") :] for name in dir(nvml) if name.startswith("NVML_ERROR_")
        }
        self._gpu_is_lost = nvml.NVML_ERROR_GPU_IS_LOST
        self._not_supported = nvml.NVML_ERROR_NOT_SUPPORTED
        self._not_found = nvml.NVML_ERROR_NOT_FOUND
        # pynvml raises NVMLError(NVML_SUCCESS) from nvmlDeviceGetProcessUtilization when the driver has no
        # sample at all (its size probe succeeds with 0 entries): the same answer as NOT_FOUND.
        self._no_samples = (nvml.NVML_ERROR_NOT_FOUND, nvml.NVML_SUCCESS)
        self._no_v2 = (nvml.NVML_ERROR_FUNCTION_NOT_FOUND, nvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        self._probe_errors = tuple(code for code in self._error_names if code != self._gpu_is_lost)

    # ---- calls ----------------------------------------------------------------------------------------------

    def _invoke(self, function: str, *args: Any, **kwargs: Any) -> tuple[Any, int | None, NvmlError | None]:
        started = self._clock.monotonic_s()
        code: int | None = None
        error: NvmlError | None = None
        value: Any = None
        try:
            value = getattr(self._nvml, function)(*args, **kwargs)
        except self._nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            name = self._error_names.get(code, f"UNKNOWN_{code}")
            error = NvmlError(function, name, _message(exc))
        except Exception as exc:  # a binding problem must not take the collector down either
            code = -1
            error = NvmlError(function, PYTHON_EXCEPTION, f"{type(exc).__name__}: {exc}")
        if self._metrics is not None:
            self._metrics.nvml_call(
                function, max(0.0, self._clock.monotonic_s() - started), None if error is None else error.error_code
            )
        return value, code, error

    # ---- lifecycle ------------------------------------------------------------------------------------------

    @property
    def node_errors(self) -> tuple[NvmlError, ...]:
        """Errors tied to no device from the latest ``sample()``/``read()``."""
        return self._node_errors

    @property
    def uuid_by_index(self) -> dict[str, str]:
        """Each device as the device plugin's ``deviceIDStrategy: index`` names it, to its NVML uuid: ``"<i>"`` for
        GPU ``i`` (``nvmlDeviceGetHandleByIndex``), ``"<i>:<j>"`` for MIG device ``j`` of GPU ``i``
        (``nvmlDeviceGetMigDeviceHandleByIndex``), as last read (empty before the first read). The collector turns
        index and CDI ids into uuids with it (``schemas.devices.resolve_device_id``)."""
        out: dict[str, str] = {}
        for index, gpu in self._gpus.items():
            out[str(index)] = gpu.uuid
            for mig_index, mig in self._migs.get(gpu.uuid, {}).items():
                out[f"{index}:{mig_index}"] = mig.uuid
        return out

    def close(self) -> None:
        """Shut NVML down if this backend initialised it; never raises."""
        if self._initialized:
            self._invoke("nvmlShutdown")
            self._initialized = False

    def sample(self) -> tuple[RawDeviceSample, ...]:
        """Every GPU and MIG device now; node-level errors go to ``node_errors``. Never raises."""
        return self.read().devices

    def read(self) -> NvmlReading:
        """Every GPU and MIG device now, with the node-level errors. Never raises."""
        node_errors: list[NvmlError] = []
        if not self._initialized:
            _, _, error = self._invoke("nvmlInit")
            if error is not None:
                node_errors.append(error)
                return self._finish((), node_errors)
            self._initialized = True
        count, _, error = self._invoke("nvmlDeviceGetCount")
        if error is not None:
            node_errors.append(error)
            return self._finish((), node_errors)
        devices: list[RawDeviceSample] = []
        for index in range(int(count)):
            try:
                devices.extend(self._read_gpu(index))
            except Exception as exc:  # an answer of a shape this code did not expect: report, do not crash
                error = NvmlError(READ_GPU_STEP, PYTHON_EXCEPTION, f"{type(exc).__name__}: {exc}")
                devices.extend(self._placeholders(index, [error]))
        return self._finish(tuple(devices), node_errors)

    def _finish(self, devices: tuple[RawDeviceSample, ...], node_errors: list[NvmlError]) -> NvmlReading:
        self._node_errors = tuple(node_errors)
        return NvmlReading(devices, self._node_errors)

    # ---- one GPU --------------------------------------------------------------------------------------------

    def _configured(self, uuid: str) -> tuple[SharingMode, int]:
        claimed = self.claimed_sharing.get(uuid)
        return claimed if claimed is not None else self._sharing.get(uuid, self._default_sharing)

    def _read_gpu(self, index: int) -> list[RawDeviceSample]:
        nvml = self._nvml
        call = _Calls(self)
        handle = call("nvmlDeviceGetHandleByIndex", index)
        if handle is _FAILED:
            return self._placeholders(index, call.errors)
        uuid = call("nvmlDeviceGetUUID", handle)
        if uuid is _FAILED:
            return self._placeholders(index, call.errors)
        model = call("nvmlDeviceGetName", handle)
        if model is _FAILED:
            known = self._gpus.get(index)
            model = known.model if known is not None and known.uuid == uuid else ""
        mig_mode = call("nvmlDeviceGetMigMode", handle, expected=(self._not_supported,))
        if mig_mode is not _FAILED:
            mig_enabled = mig_mode[0] == nvml.NVML_DEVICE_MIG_ENABLE
        else:
            # NOT_SUPPORTED: a GPU without MIG. Any other failure: keep what this GPU was last tick.
            known = self._gpus.get(index)
            mig_enabled = (
                call.last_code != self._not_supported
                and known is not None
                and known.uuid == uuid
                and known.sharing_mode == SharingMode.MIG
            )
        if call.lost:
            return self._placeholders(index, call.errors, uuid)
        if mig_enabled:
            return self._read_mig_gpu(index, handle, uuid, model, call)
        return [self._read_plain_gpu(index, handle, uuid, model, call)]

    def _read_memory(self, call: _Calls, handle: Any) -> tuple[int, int, int, int]:
        """(total, used, free, reserved) with used excluding reserved; zeros when unreadable."""
        nvml = self._nvml
        info = call("nvmlDeviceGetMemoryInfo", handle, version=nvml.nvmlMemory_v2, expected=self._no_v2)
        if info is _FAILED:
            if call.last_code not in self._no_v2 or call.lost:
                return 0, 0, 0, 0
            legacy = call("nvmlDeviceGetMemoryInfo", handle)
            if legacy is _FAILED:
                return 0, 0, 0, 0
            return int(legacy.total), int(legacy.used), int(legacy.free), 0
        total, used, free, reserved = int(info.total), int(info.used), int(info.free), int(info.reserved)
        if reserved > 0 and used >= reserved:
            includes = abs(total - (free + used))
            excludes = abs(total - (free + used + reserved))
            if includes <= _MIB and includes < excludes:
                used -= reserved
        return total, used, free, reserved

    def _read_processes(
        self, call: _Calls, handle: Any, *, with_mps: bool, mps_configured: bool = False
    ) -> tuple[dict[int, int], bool, tuple[int, ...]]:
        """pid → usedGpuMemory (-1 unknown), in NVML order; whether MPS clients were listed; the MPS server pids.

        On an MPS GPU the compute list holds the MPS server(s) and the MPS list the clients: a compute-list pid
        that is no client is a server, when clients were listed or the GPU is configured as MPS.
        """
        memory: dict[int, int] = {}
        listed = call("nvmlDeviceGetComputeRunningProcesses", handle)
        compute_pids: list[int] = []
        mps_clients = False
        if listed is not _FAILED:
            for p in listed:
                pid = int(p.pid)
                compute_pids.append(pid)
                memory.setdefault(pid, -1 if p.usedGpuMemory is None else int(p.usedGpuMemory))
        client_pids: set[int] = set()
        clients_read = False
        if with_mps:
            clients = call(
                "nvmlDeviceGetMPSComputeRunningProcesses",
                handle,
                expected=(self._not_supported, self._nvml.NVML_ERROR_FUNCTION_NOT_FOUND),
            )
            clients_read = clients is not _FAILED
            if clients_read and clients:
                mps_clients = True
                for p in clients:
                    pid = int(p.pid)
                    client_pids.add(pid)
                    memory.setdefault(pid, -1 if p.usedGpuMemory is None else int(p.usedGpuMemory))
        servers: tuple[int, ...] = ()
        # Only a client list read tells a server from a client: a real driver lists the clients in the compute list
        # too, so without that list every client would be taken for a server and its busy time lost.
        if clients_read and (mps_clients or mps_configured):
            servers = tuple(dict.fromkeys(pid for pid in compute_pids if pid not in client_pids))
        return memory, mps_clients, servers

    def _read_sm(self, call: _Calls, handle: Any, uuid: str, pids: list[int]) -> tuple[bool, tuple[int, ...]]:
        last_seen = self._last_seen_us.get(uuid, 0)
        samples = call(
            "nvmlDeviceGetProcessUtilization", handle, last_seen, expected=(*self._no_samples, self._not_supported)
        )
        if samples is _FAILED:
            if call.last_code in self._no_samples:
                return True, tuple(0 for _ in pids)
            return False, tuple(-1 for _ in pids)
        sums: dict[int, list[int]] = {}
        newest = last_seen
        for s in samples:
            acc = sums.setdefault(int(s.pid), [0, 0])
            acc[0] += int(s.smUtil)
            acc[1] += 1
            newest = max(newest, int(s.timeStamp))
        self._last_seen_us[uuid] = newest
        return True, tuple(round(sums[pid][0] / sums[pid][1]) if pid in sums else 0 for pid in pids)

    def _read_plain_gpu(self, index: int, handle: Any, uuid: str, model: str, call: _Calls) -> RawDeviceSample:
        total, used, free, reserved = self._read_memory(call, handle)
        util = call("nvmlDeviceGetUtilizationRates", handle)
        power = call("nvmlDeviceGetPowerUsage", handle)
        mode, replicas = self._configured(uuid)
        memory, mps_clients, mps_servers = self._read_processes(
            call, handle, with_mps=True, mps_configured=mode == SharingMode.MPS
        )
        if mps_clients and mode != SharingMode.MPS:
            mode, replicas = SharingMode.MPS, 1
        elif mode == SharingMode.MIG:
            mode, replicas = SharingMode.UNKNOWN, 1
        pids = list(memory)
        if mode == SharingMode.MPS or call.lost:
            supported, sm = False, tuple(-1 for _ in pids)
        else:
            supported, sm = self._read_sm(call, handle, uuid, pids)
        if call.lost:
            return self._placeholders(index, call.errors, uuid)[0]
        self._gpus[index] = _GpuIdentity(uuid, model, mode, replicas, 0)
        self._migs.pop(uuid, None)
        return RawDeviceSample(
            uuid=uuid,
            parent_uuid=None,
            index=index,
            model=model,
            sharing_mode=mode,
            replicas=replicas,
            mig_gpu_instance_id=None,
            mig_compute_instance_id=None,
            mig_profile=None,
            mig_compute_slices=0,
            mig_total_compute_slices=0,
            **_readings(call, (total, used, free, reserved), util, power, memory, pids, supported, sm),
            mps_server_pids=mps_servers,
        )

    # ---- MIG ------------------------------------------------------------------------------------------------

    def _profile_infos(self, call: _Calls, handle: Any, uuid: str) -> tuple[_ProfileInfo, ...]:
        cached = self._profiles.get(uuid)
        if cached is not None:
            return cached
        nvml = self._nvml
        infos: list[_ProfileInfo] = []
        for profile_id in range(int(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0))):
            # Unsupported profiles answer NOT_SUPPORTED or INVALID_ARGUMENT: probing, not failures.
            info = call("nvmlDeviceGetGpuInstanceProfileInfo", handle, profile_id, expected=self._probe_errors)
            if call.lost:
                return ()
            if info is _FAILED:
                continue
            raw_name = getattr(info, "name", b"")
            name = raw_name.decode(errors="replace") if isinstance(raw_name, bytes) else str(raw_name)
            match = re.search(r"(\d+g\.\d+gb(?:\+\w+)?)", name)
            infos.append(_ProfileInfo(int(info.sliceCount), int(info.memorySizeMB), match.group(1) if match else ""))
        self._profiles[uuid] = tuple(infos)
        return tuple(infos)

    def _read_mig_gpu(self, index: int, handle: Any, uuid: str, model: str, call: _Calls) -> list[RawDeviceSample]:
        total, used, free, reserved = self._read_memory(call, handle)
        util = call("nvmlDeviceGetUtilizationRates", handle, expected=(self._not_supported,))
        power = call("nvmlDeviceGetPowerUsage", handle)
        max_count = call("nvmlDeviceGetMaxMigDeviceCount", handle)
        profiles = self._profile_infos(call, handle, uuid)
        if max_count is _FAILED:
            # Still look for the instances: no GPU has more MIG devices than compute slices, and the instances
            # seen before are still there (a GPU read as having none would turn them into idle capacity).
            known_count = max(self._migs.get(uuid, {}), default=-1) + 1
            max_count = max(max((p.slices for p in profiles), default=0), known_count)
        else:
            max_count = int(max_count)
        total_slices = max((p.slices for p in profiles), default=max_count)
        instances: list[RawDeviceSample] = []
        identities: dict[int, _MigIdentity] = {}
        known = self._migs.get(uuid, {})
        for mig_index in range(max_count):
            mig_handle = call("nvmlDeviceGetMigDeviceHandleByIndex", handle, mig_index, expected=(self._not_found,))
            if call.lost:
                break
            if mig_handle is _FAILED:
                previous = known.get(mig_index)
                if call.last_code != self._not_found and previous is not None:
                    # The instance exists (it did last tick) but cannot be read now: report it, unreadable, so its
                    # capacity is not mistaken for idle slices of the parent.
                    instances.append(self._unreadable_instance(index, uuid, model, previous, total_slices,
                                                               call.errors[-1:]))
                    identities[mig_index] = previous
                continue
            sample, identity = self._read_mig_device(
                index, uuid, model, mig_index, mig_handle, profiles, known, call, total_slices
            )
            if call.lost:
                break
            if sample is not None and identity is not None:
                instances.append(sample)
                identities[mig_index] = identity
        if call.lost:
            return self._placeholders(index, call.errors, uuid)
        self._migs[uuid] = identities
        self._gpus[index] = _GpuIdentity(uuid, model, SharingMode.MIG, 1, total_slices)
        parent = RawDeviceSample(
            uuid=uuid,
            parent_uuid=None,
            index=index,
            model=model,
            sharing_mode=SharingMode.MIG,
            replicas=1,
            mig_gpu_instance_id=None,
            mig_compute_instance_id=None,
            mig_profile=None,
            mig_compute_slices=0,
            mig_total_compute_slices=total_slices,
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_free_bytes=free,
            memory_reserved_bytes=reserved,
            gpu_utilization_percent=None if util is _FAILED else int(util.gpu),
            memory_utilization_percent=None if util is _FAILED else int(util.memory),
            power_milliwatts=None if power is _FAILED else int(power),
            process_utilization_supported=False,
            errors=tuple(call.errors),
            process_pids=(),
            process_used_memory_bytes=(),
            process_sm_utilization_percent=(),
        )
        return [parent, *instances]

    def _read_mig_device(
        self,
        index: int,
        parent_uuid: str,
        model: str,
        mig_index: int,
        handle: Any,
        profiles: tuple[_ProfileInfo, ...],
        known: Mapping[int, _MigIdentity],
        parent_call: _Calls,
        total_slices: int,
    ) -> tuple[RawDeviceSample | None, _MigIdentity | None]:
        call = _Calls(self)
        uuid = call("nvmlDeviceGetUUID", handle)
        previous = known.get(mig_index)
        if uuid is _FAILED:
            parent_call.lost = call.lost
            if previous is None:
                parent_call.errors.extend(call.errors)
                return None, None
            uuid = previous.uuid
        if previous is not None and previous.uuid != uuid:
            previous = None
        gi = call("nvmlDeviceGetGpuInstanceId", handle)
        ci = call("nvmlDeviceGetComputeInstanceId", handle)
        attributes = call("nvmlDeviceGetAttributes", handle)
        name = call("nvmlDeviceGetName", handle)
        # The compute instance's slices are what its processes can run on; its GPU instance's count stands in
        # where a driver leaves the compute count 0. A GPU-instance slice in no compute instance is capacity no
        # process can use: it stays with the parent's unassigned (idle) capacity.
        slices = 0
        if attributes is not _FAILED:
            slices = int(getattr(attributes, "computeInstanceSliceCount", 0) or 0) or int(
                attributes.gpuInstanceSliceCount
            )
        profile: str | None = None
        if name is not _FAILED:
            match = _MIG_NAME.search(str(name))
            profile = match.group(1) if match else None
        if profile is None and attributes is not _FAILED:
            memory_mib = int(attributes.memorySizeMB)
            matches = [p for p in profiles if p.slices == slices and p.name]
            if matches:
                profile = min(matches, key=lambda p: abs(p.memory_mib - memory_mib)).name
            elif slices:
                profile = f"{slices}g.{round(memory_mib / 1024)}gb"
        if profile is None and previous is not None:
            profile = previous.profile
        if not slices and profile:
            leading = re.match(r"(\d+)g\.", profile)
            slices = int(leading.group(1)) if leading else 0
        if not slices and previous is not None:
            slices = previous.compute_slices
        total, used, free, reserved = self._read_memory(call, handle)
        util = call("nvmlDeviceGetUtilizationRates", handle, expected=(self._not_supported,))
        power = call("nvmlDeviceGetPowerUsage", handle, expected=(self._not_supported,))
        memory, _, _ = self._read_processes(call, handle, with_mps=False)
        pids = list(memory)
        if call.lost:
            parent_call.lost = True
            parent_call.errors.extend(call.errors)
            return None, None
        supported, sm = self._read_sm(call, handle, uuid, pids)
        identity = _MigIdentity(
            mig_index=mig_index,
            uuid=uuid,
            gpu_instance_id=None if gi is _FAILED else int(gi),
            compute_instance_id=None if ci is _FAILED else int(ci),
            profile=profile,
            compute_slices=slices,
        )
        if identity.gpu_instance_id is None and previous is not None:
            identity = _MigIdentity(
                mig_index, uuid, previous.gpu_instance_id, previous.compute_instance_id, profile, slices
            )
        _, replicas = self._configured(uuid)
        sample = RawDeviceSample(
            uuid=uuid,
            parent_uuid=parent_uuid,
            index=index,
            model=model,
            sharing_mode=SharingMode.MIG,
            replicas=max(1, replicas),
            mig_gpu_instance_id=identity.gpu_instance_id,
            mig_compute_instance_id=identity.compute_instance_id,
            mig_profile=profile,
            mig_compute_slices=slices,
            mig_total_compute_slices=total_slices,
            **_readings(call, (total, used, free, reserved), util, power, memory, pids, supported, sm),
        )
        return sample, identity

    # ---- unreadable GPUs ------------------------------------------------------------------------------------

    def _unreadable_instance(
        self, index: int, parent_uuid: str, model: str, mig: _MigIdentity, total_slices: int,
        errors: list[NvmlError],
    ) -> RawDeviceSample:
        return _empty_sample(
            uuid=mig.uuid, parent_uuid=parent_uuid, index=index, model=model, mode=SharingMode.MIG, replicas=1,
            total_slices=total_slices, errors=tuple(errors), gpu_instance_id=mig.gpu_instance_id,
            compute_instance_id=mig.compute_instance_id, profile=mig.profile, slices=mig.compute_slices,
        )

    def _placeholders(self, index: int, errors: list[NvmlError], uuid: str | None = None) -> list[RawDeviceSample]:
        """The GPU at ``index`` (and its MIG devices) as last identified, carrying ``errors`` and no readings.

        ``uuid``: the UUID read this tick, when the GPU failed after it.
        """
        known = self._gpus.get(index)
        if uuid is not None and (known is None or known.uuid != uuid):
            mode, replicas = self._configured(uuid)
            known = _GpuIdentity(uuid, "", mode, replicas, 0)
        if known is None:
            mode, replicas = self._default_sharing
            known = _GpuIdentity(f"{UNKNOWN_GPU_PREFIX}{index}", "", mode, replicas, 0)
        out = [
            _empty_sample(
                uuid=known.uuid,
                parent_uuid=None,
                index=index,
                model=known.model,
                mode=known.sharing_mode,
                replicas=known.replicas,
                total_slices=known.mig_total_compute_slices,
                errors=tuple(errors),
            )
        ]
        for mig in self._migs.get(known.uuid, {}).values():
            out.append(
                _empty_sample(
                    uuid=mig.uuid,
                    parent_uuid=known.uuid,
                    index=index,
                    model=known.model,
                    mode=SharingMode.MIG,
                    replicas=1,
                    total_slices=known.mig_total_compute_slices,
                    errors=tuple(errors),
                    gpu_instance_id=mig.gpu_instance_id,
                    compute_instance_id=mig.compute_instance_id,
                    profile=mig.profile,
                    slices=mig.compute_slices,
                )
            )
        return out


def _readings(
    call: "_Calls", memory_info: tuple[int, int, int, int], util: Any, power: Any, memory: dict[int, int],
    pids: list[int], supported: bool, sm: tuple[int, ...],
) -> dict[str, Any]:
    """The RawDeviceSample fields a GPU and a MIG instance read the same way (failed calls become None)."""
    total, used, free, reserved = memory_info
    return dict(
        memory_total_bytes=total,
        memory_used_bytes=used,
        memory_free_bytes=free,
        memory_reserved_bytes=reserved,
        gpu_utilization_percent=None if util is _FAILED else int(util.gpu),
        memory_utilization_percent=None if util is _FAILED else int(util.memory),
        power_milliwatts=None if power is _FAILED else int(power),
        process_utilization_supported=supported,
        errors=tuple(call.errors),
        process_pids=tuple(pids),
        process_used_memory_bytes=tuple(memory[p] for p in pids),
        process_sm_utilization_percent=sm,
    )


def _empty_sample(
    *,
    uuid: str,
    parent_uuid: str | None,
    index: int,
    model: str,
    mode: SharingMode,
    replicas: int,
    total_slices: int,
    errors: tuple[NvmlError, ...],
    gpu_instance_id: int | None = None,
    compute_instance_id: int | None = None,
    profile: str | None = None,
    slices: int = 0,
) -> RawDeviceSample:
    return RawDeviceSample(
        uuid=uuid,
        parent_uuid=parent_uuid,
        index=index,
        model=model,
        sharing_mode=mode,
        replicas=replicas,
        mig_gpu_instance_id=gpu_instance_id,
        mig_compute_instance_id=compute_instance_id,
        mig_profile=profile,
        mig_compute_slices=slices,
        mig_total_compute_slices=total_slices,
        memory_total_bytes=0,
        memory_used_bytes=0,
        memory_free_bytes=0,
        memory_reserved_bytes=0,
        gpu_utilization_percent=None,
        memory_utilization_percent=None,
        power_milliwatts=None,
        process_utilization_supported=False,
        errors=errors,
        process_pids=(),
        process_used_memory_bytes=(),
        process_sm_utilization_percent=(),
    )


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # pynvml's __str__ asks the library for unknown codes
        return f"NVML error {getattr(exc, 'value', '?')}"
