"""nvidia-ml-py's own wrappers over the simulated library (``simulator/nvml_driver.py``): the C symbols they choose,
the structs and versions they pass, the INSUFFICIENT_SIZE size probes, byref out-parameters and the mapping of
return codes to NVMLError subclasses, checked against the world's answers."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import pynvml
import pytest

from gpumeter.clock import ManualClock
from simulator import nvml_driver
from simulator.nvml_driver import SimulatedNvmlLibrary, load_pynvml, simulated_pynvml
from simulator.scenario import Scenario, load_scenario
from simulator.world import SimWorld

REPO = Path(__file__).resolve().parents[3]


@functools.lru_cache(maxsize=None)
def scenario(name: str) -> Scenario:
    return load_scenario(REPO / "scenarios" / f"{name}.yaml")


def setup(name: str, at_seconds: float, node: str | None = None):
    s = scenario(name)
    world = SimWorld(s)
    clock = ManualClock(s.start_unix_ms + round(at_seconds * 1000))
    nvml = simulated_pynvml(world, clock, node)
    nvml.nvmlInit()
    return s, world, clock, nvml


def test_compute_processes_come_back_as_v3_structs_with_the_worlds_pids_and_memory():
    s, world, clock, nvml = setup("time_slicing", at_seconds=30)
    library = nvml.nvmlLib
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    listed = nvml.nvmlDeviceGetComputeRunningProcesses(h)
    truth = world.observation_at(clock.now_ms(), s.nodes[0].name, 0).units[0].processes
    assert len(truth) >= 2
    assert [(p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId) for p in listed] == [
        (p.pid, p.used_gpu_memory_bytes, 0xFFFFFFFF, 0xFFFFFFFF) for p in truth
    ]
    # pynvml chose the _v3 symbol and made its two calls: the size probe (null array, count 0) and the fill
    assert library.call_counts["nvmlDeviceGetComputeRunningProcesses_v3"] == 2
    assert nvml.c_nvmlProcessInfo_v3_t is nvml.c_nvmlProcessInfo_v2_t  # what pynvml allocates for _v3
    assert ctypes.sizeof(nvml.c_nvmlProcessInfo_v3_t) == ctypes.sizeof(nvml_driver._ProcessInfo)
    assert library.callback_exceptions == []


def test_a_too_small_process_buffer_gets_insufficient_size_and_the_count_needed():
    s, world, clock, nvml = setup("time_slicing", at_seconds=30)
    fn = nvml.nvmlLib.nvmlDeviceGetComputeRunningProcesses_v3
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    needed = len(world.observation_at(clock.now_ms(), s.nodes[0].name, 0).units[0].processes)
    count = ctypes.c_uint(1)
    one = (nvml.c_nvmlProcessInfo_v3_t * 1)()
    assert fn(h, ctypes.byref(count), one) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == needed and one[0].pid == 0  # nothing written into the short buffer
    room = (nvml.c_nvmlProcessInfo_v3_t * (needed + 3))()
    count = ctypes.c_uint(needed + 3)
    assert fn(h, ctypes.byref(count), room) == pynvml.NVML_SUCCESS
    assert count.value == needed and room[needed - 1].pid != 0 and room[needed].pid == 0
    # the same protocol for the utilization samples and for strings
    samples = nvml.nvmlLib.nvmlDeviceGetProcessUtilization
    count = ctypes.c_uint(0)
    assert samples(h, None, ctypes.byref(count), ctypes.c_ulonglong(0)) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value >= 2
    short = (nvml.c_nvmlProcessUtilizationSample_t * 1)()
    wanted = count.value
    count = ctypes.c_uint(1)
    assert samples(h, short, ctypes.byref(count), ctypes.c_ulonglong(0)) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == wanted
    uuid = ctypes.create_string_buffer(8)
    assert nvml.nvmlLib.nvmlDeviceGetUUID(h, uuid, ctypes.c_uint(8)) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE


def test_an_empty_process_list_is_success_with_count_zero_and_pynvml_returns_no_processes():
    _, _, _, nvml = setup("exclusive", at_seconds=10)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    count = ctypes.c_uint(0)
    # an exclusive GPU lists no MPS clients: the probe itself succeeds
    assert nvml.nvmlLib.nvmlDeviceGetMPSComputeRunningProcesses_v3(h, ctypes.byref(count), None) == 0
    assert count.value == 0 and nvml.nvmlDeviceGetMPSComputeRunningProcesses(h) == []


def test_mps_lists_server_and_clients_in_the_compute_list_and_clients_alone_in_the_mps_list():
    s, world, clock, nvml = setup("mps", at_seconds=30)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    truth = world.observation_at(clock.now_ms(), s.nodes[0].name, 0).units[0].processes
    servers = [p.pid for p in truth if p.is_mps_server]
    clients = [(p.pid, p.used_gpu_memory_bytes) for p in truth if p.is_mps_client]
    assert servers and clients
    assert [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)] == servers + [pid for pid, _ in clients]
    assert [(p.pid, p.usedGpuMemory) for p in nvml.nvmlDeviceGetMPSComputeRunningProcesses(h)] == clients
    # one sample, the server's, carrying the device's utilization (as driver 580 on an H200 answered)
    samples = nvml.nvmlDeviceGetProcessUtilization(h, 0)
    assert [(x.pid, x.smUtil) for x in samples] == [(servers[0], nvml.nvmlDeviceGetUtilizationRates(h).gpu)]


def test_memory_v2_goes_through_the_versioned_struct_and_a_wrong_version_is_a_mismatch():
    s, world, clock, nvml = setup("exclusive", at_seconds=10)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    # pynvml's constant is nvml.h's NVML_STRUCT_VERSION(Memory, 2): the C struct's size with 2 in the top byte
    assert nvml.nvmlMemory_v2 == nvml_driver.NVML_MEMORY_V2
    info = nvml.nvmlDeviceGetMemoryInfo(h, version=nvml.nvmlMemory_v2)
    gpu = world.observation_at(clock.now_ms(), s.nodes[0].name, 0)
    assert (info.version, info.total, info.reserved, info.free, info.used) == (
        nvml.nvmlMemory_v2, gpu.memory_total_bytes, gpu.memory_reserved_bytes, gpu.memory_free_bytes,
        gpu.memory_used_bytes,
    )
    assert nvml.nvmlLib.call_counts["nvmlDeviceGetMemoryInfo_v2"] == 1
    stale = nvml.c_nvmlMemory_v2_t()
    stale.version = 1 << 24 | ctypes.sizeof(stale)
    assert nvml.nvmlLib.nvmlDeviceGetMemoryInfo_v2(h, ctypes.byref(stale)) == 25  # ARGUMENT_VERSION_MISMATCH
    assert stale.total == 0


def test_error_codes_become_pynvmls_exception_subclasses():
    s, _, clock, nvml = setup("faults", at_seconds=50)
    lost = nvml.nvmlDeviceGetHandleByIndex(1)
    clock.set_ms(s.start_unix_ms + 60_000)
    with pytest.raises(pynvml.NVMLError) as info:
        nvml.nvmlDeviceGetMemoryInfo(lost, version=nvml.nvmlMemory_v2)
    assert type(info.value) is pynvml.NVMLError_GpuIsLost and info.value.value == pynvml.NVML_ERROR_GPU_IS_LOST
    # the scenario's NOT_SUPPORTED fault on GPU 0's power
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetPowerUsage(nvml.nvmlDeviceGetHandleByIndex(0))
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0), version=0x01000028)
    # the library's own text for a code (pynvml sets the symbol's restype to c_char_p)
    assert nvml.nvmlErrorString(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH) == "Argument version mismatch"
    assert nvml.nvmlErrorString(12345) == "Unknown Error"


def test_mig_handles_ids_attributes_and_profile_info_v2():
    s, _, _, nvml = setup("two_nodes", at_seconds=20, node="node-a100")
    gpu = s.node("node-a100").gpus[0]
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMigMode(h) == [nvml.NVML_DEVICE_MIG_ENABLE] * 2
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetUtilizationRates(h)
    for k, instance in enumerate(gpu.sharing.mig_instances):
        m = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
        assert nvml.nvmlDeviceGetUUID(m) == instance.uuid
        assert nvml.nvmlDeviceIsMigDeviceHandle(m).value == 1
        assert (nvml.nvmlDeviceGetGpuInstanceId(m), nvml.nvmlDeviceGetComputeInstanceId(m)) == (
            instance.gpu_instance_id, instance.compute_instance_id)
        attributes = nvml.nvmlDeviceGetAttributes(m)
        assert attributes.gpuInstanceSliceCount == instance.profile.compute_slices
        assert nvml.nvmlDeviceGetName(m) == f"{gpu.model} MIG {instance.profile.name}"
        parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
        assert nvml.nvmlDeviceGetUUID(parent) == gpu.uuid
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, len(gpu.sharing.mig_instances))
    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, nvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)
    assert (info.version, info.sliceCount, info.name) == (nvml.nvmlGpuInstanceProfileInfo_v2, 7, "MIG 7g.80gb")
    assert nvml.nvmlLib.call_counts["nvmlDeviceGetGpuInstanceProfileInfoV"] == 1
    v1 = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, nvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE, version=1)
    assert (v1.sliceCount, v1.memorySizeMB) == (info.sliceCount, info.memorySizeMB)


def test_the_newer_utilization_api_agrees_with_the_older_one():
    _, _, _, nvml = setup("time_slicing", at_seconds=30)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    older = sorted((x.pid, x.timeStamp, x.smUtil, x.memUtil) for x in nvml.nvmlDeviceGetProcessUtilization(h, 0))
    newer = sorted((x.pid, x.timeStamp, x.smUtil, x.memUtil) for x in nvml.nvmlDeviceGetProcessesUtilizationInfo(h, 0))
    assert older and newer == older
    with pytest.raises(pynvml.NVMLError_NotFound):  # nothing newer than the newest sample
        nvml.nvmlDeviceGetProcessUtilization(h, max(t for _, t, _, _ in older))


def test_each_node_has_its_own_pynvml_and_the_installed_module_is_untouched():
    s = scenario("two_nodes")
    world, clock = SimWorld(s), ManualClock(s.start_unix_ms + 20_000)
    first, second = (simulated_pynvml(world, clock, n.name) for n in s.nodes)
    first.nvmlInit()
    second.nvmlInit()
    assert first is not second and first.nvmlLib is not second.nvmlLib
    assert first.nvmlDeviceGetUUID(first.nvmlDeviceGetHandleByIndex(0)) == s.nodes[0].gpus[0].uuid
    assert second.nvmlDeviceGetUUID(second.nvmlDeviceGetHandleByIndex(0)) == s.nodes[1].gpus[0].uuid
    # a handle of one node's library means nothing to another's
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        second.nvmlDeviceGetUUID(first.nvmlDeviceGetHandleByIndex(0))
    assert pynvml.nvmlLib is None or not isinstance(pynvml.nvmlLib, SimulatedNvmlLibrary)
    assert first.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost


def test_a_python_error_inside_the_library_is_unknown_not_success():
    s = scenario("exclusive")
    library = SimulatedNvmlLibrary(SimWorld(s), ManualClock(s.start_unix_ms))

    class Broken:
        def now_ms(self):
            raise RuntimeError("broken clock")

    nvml = load_pynvml(library)
    nvml.nvmlInit()
    library._clock = Broken()
    with pytest.raises(pynvml.NVMLError_Unknown):
        nvml.nvmlDeviceGetCount()
    assert [str(e) for e in library.callback_exceptions] == ["broken clock"]
