"""The simulated driver, read through nvidia-ml-py's own code (``simulated_pynvml``): NVML's answers per sharing
mode, its errors (pynvml's own classes), faults, /proc and truth. The C boundary itself (structs, size probes,
return codes) is tested in test_nvml_c_boundary.py."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pynvml
import pytest

from gpumeter.clock import ManualClock
from services.collector.cgroup import read_process_identity, read_process_start_ticks
from schemas.devices import parse_device_id
from simulator.nvml_driver import simulated_pynvml
from simulator.scenario import MIB, Scenario, load_scenario
from simulator.world import SimWorld

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = sorted(p.stem for p in (REPO / "scenarios").glob("*.yaml"))


@functools.lru_cache(maxsize=None)
def scenario(name: str) -> Scenario:
    return load_scenario(REPO / "scenarios" / f"{name}.yaml")


def setup(name: str, node: str | None = None, at_seconds: float | None = None):
    s = scenario(name)
    world = SimWorld(s)
    clock = ManualClock(s.start_unix_ms)
    if at_seconds is not None:
        clock.set_ms(s.start_unix_ms + round(at_seconds * 1000))
    nvml = simulated_pynvml(world, clock, node)
    nvml.nvmlInit()
    return s, world, clock, nvml


def all_processes(nvml, handle):
    listed = {p.pid: p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    listed.update({p.pid: p.usedGpuMemory for p in nvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)})
    return listed


def unit_handles(nvml):
    """(handle, is_mig_parent) for every GPU and MIG device."""
    out = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        mig = nvml.nvmlDeviceGetMaxMigDeviceCount(h) > 0
        out.append((h, mig))
        for k in range(nvml.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                out.append((nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k), False))
            except pynvml.NVMLError_NotFound:
                pass
    return out


# ---- the module surface --------------------------------------------------------------------------------------


def test_calls_before_init_and_after_shutdown_raise_uninitialized():
    s = scenario("exclusive")
    nvml = simulated_pynvml(SimWorld(s), ManualClock(s.start_unix_ms))
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    nvml.nvmlInit()
    nvml.nvmlShutdown()
    assert nvml.nvmlDeviceGetCount() == 4  # still one reference
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlShutdown()


def test_errors_constants_and_structs_are_pynvmls_own():
    _, _, _, nvml = setup("exclusive", at_seconds=10)
    assert nvml.NVMLError is pynvml.NVMLError
    assert nvml.NVMLError_NotSupported is pynvml.NVMLError_NotSupported
    assert nvml.NVML_ERROR_GPU_IS_LOST == pynvml.NVML_ERROR_GPU_IS_LOST
    assert nvml.nvmlMemory_v2 == pynvml.nvmlMemory_v2
    assert "NVML_ERROR_NOT_FOUND" in dir(nvml)
    with pytest.raises(pynvml.NVMLError) as info:
        nvml.nvmlDeviceGetHandleByIndex(99)
    assert type(info.value) is pynvml.NVMLError_InvalidArgument and info.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert str(info.value) == "Invalid Argument"
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):  # a symbol the simulated library does not have
        nvml.nvmlDeviceGetFanSpeed(nvml.nvmlDeviceGetHandleByIndex(0))
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    # the structs are the copy's own pynvml classes (a private copy of the module: simulator/nvml_driver.py)
    assert isinstance(nvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2), nvml.c_nvmlMemory_v2_t)
    assert isinstance(nvml.nvmlDeviceGetMemoryInfo(h), nvml.c_nvmlMemory_t)
    assert isinstance(nvml.nvmlDeviceGetUtilizationRates(h), nvml.c_nvmlUtilization_t)
    samples = nvml.nvmlDeviceGetProcessUtilization(h, 0)
    assert samples and all(isinstance(x, nvml.c_nvmlProcessUtilizationSample_t) for x in samples)
    proc = nvml.nvmlDeviceGetComputeRunningProcesses(h)[0]
    assert isinstance(proc, nvml.nvmlFriendlyObject)
    assert proc.gpuInstanceId == proc.computeInstanceId == 0xFFFFFFFF
    assert isinstance(nvml.nvmlDeviceGetUUID(h), str) and nvml.nvmlDeviceGetUUID(h).startswith("GPU-")
    assert nvml.nvmlDeviceGetName(h) == "NVIDIA A10G"


def test_a_multi_node_world_needs_a_node_name():
    s = scenario("two_nodes")
    with pytest.raises(ValueError, match="say which one"):
        simulated_pynvml(SimWorld(s), ManualClock(s.start_unix_ms))


# ---- memory --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCENARIOS)
def test_memory_info_invariants_hold_on_every_unit_and_tick(name):
    s = scenario(name)
    world = SimWorld(s)
    clock = ManualClock(s.start_unix_ms)
    for node in s.nodes:
        nvml = simulated_pynvml(world, clock, node.name)
        nvml.nvmlInit()
        for tick in s.tick_times_ms()[::3]:
            clock.set_ms(max(tick, clock.now_ms()))
            for i, gpu in enumerate(node.gpus):
                if world.gpu_lost(node.name, i):
                    continue
                for handle, mig_parent in unit_handles_of(nvml, i):
                    v2 = nvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
                    v1 = nvml.nvmlDeviceGetMemoryInfo(handle)
                    used = v2.used - (v2.reserved if gpu.memory_v2_used_includes_reserved else 0)
                    assert v2.total == v2.free + used + v2.reserved
                    assert v1.total == v2.total and v1.free == v2.free and v1.used == used + v2.reserved
                    if not mig_parent:
                        listed = all_processes(nvml, handle)
                        assert used >= sum(listed.values())
                        # 2 MiB per context that no process is charged for
                        assert used - sum(listed.values()) == 2 * MIB * len(listed)


def unit_handles_of(nvml, index):
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    out = [(h, nvml.nvmlDeviceGetMaxMigDeviceCount(h) > 0)]
    for k in range(nvml.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            out.append((nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k), False))
        except pynvml.NVMLError_NotFound:
            pass
    return out


def test_unknown_memory_info_version_is_a_version_mismatch():
    _, _, _, nvml = setup("exclusive", at_seconds=10)
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0), version=0x01000028)


def test_driver_quirk_counts_the_reserve_in_v2_used():
    s, world, _, nvml = setup("faults", at_seconds=10)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    v2 = nvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    real = world.gpu_observation(s.nodes[0].name, 0)
    assert v2.used == real.memory_used_bytes + real.memory_reserved_bytes
    assert v2.total == v2.free + v2.used  # what such drivers show


def test_preallocation_is_cut_to_what_is_free():
    text = """
cluster: c
start: "2026-07-01T00:00:00Z"
duration_seconds: 60
nodes:
  - name: n
    region: r
    instance_type: t
    gpus: [{model: NVIDIA A10G, memory_total_bytes: 24GiB, sharing: {mode: time_slicing, replicas: 2}}]
pods:
  - name: first
    node: n
    containers: [{devices: [{resource: nvidia.com/gpu.shared, gpu: 0, replica: 0}],
                  processes: [{name: jax, memory: {preallocate_fraction: 0.75}}]}]
  - name: second
    node: n
    start_seconds: 10
    containers: [{devices: [{resource: nvidia.com/gpu.shared, gpu: 0, replica: 1}],
                  processes: [{name: jax, memory: {preallocate_fraction: 0.75}}]}]
"""
    s = load_scenario(text)
    world = SimWorld(s)
    clock = ManualClock(s.start_unix_ms + 20_000)
    nvml = simulated_pynvml(world, clock)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    mem = nvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    procs = {world.process(p.pid).pod_key: p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)}
    assert procs["default/first"] > 0.75 * 24 * 1024 * MIB  # its context on top of 75 %
    assert procs["default/second"] < 0.3 * 24 * 1024 * MIB  # only what was left
    assert mem.free == 0 and mem.used == mem.total - mem.reserved


# ---- time-slicing --------------------------------------------------------------------------------------------


def expected_time_slices(demands: dict[int, float]) -> dict[int, float]:
    total = sum(demands.values())
    return {pid: d if total <= 1 else d / total for pid, d in demands.items()}


@pytest.mark.parametrize("at_seconds", [30, 90])
def test_time_slicing_grants_demand_or_proportional_shares(at_seconds):
    s, world, clock, nvml = setup("time_slicing", at_seconds=at_seconds)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    demands = {}
    for p in nvml.nvmlDeviceGetComputeRunningProcesses(h):
        proc = world.process(p.pid)
        elapsed = (clock.now_ms() - proc.start_ms) / 1000
        demands[p.pid] = proc.compute.demand(elapsed)
    assert len(demands) == 3
    granted = expected_time_slices(demands)
    util = nvml.nvmlDeviceGetUtilizationRates(h)
    assert util.gpu == round(100 * min(1.0, sum(granted.values())))
    samples = {x.pid: x.smUtil for x in nvml.nvmlDeviceGetProcessUtilization(h, 0)}
    assert set(samples) == set(demands)
    for pid, sm in samples.items():
        assert abs(sm - round(100 * granted[pid])) <= 2
    truth = {r.pod_uid: r.true_compute_fraction for r in world.truth(clock.now_ms())}
    for pid, g in granted.items():
        assert truth[world.process(pid).pod_uid] == pytest.approx(g)
    if sum(demands.values()) > 1:
        assert util.gpu == 100 and sum(truth.values()) == pytest.approx(1.0)


def test_every_sharing_process_sees_the_same_device_utilization():
    _, _, _, nvml = setup("time_slicing", at_seconds=90)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    # one counter for the whole GPU, whoever asks
    assert len({nvml.nvmlDeviceGetUtilizationRates(h).gpu for _ in range(3)}) == 1


def test_process_utilization_returns_only_samples_newer_than_last_seen():
    s, _, clock, nvml = setup("time_slicing", at_seconds=30)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    first = nvml.nvmlDeviceGetProcessUtilization(h, 0)
    stamps = sorted(x.timeStamp for x in first)
    assert len(first) == 3 and stamps[-1] <= clock.now_ms() * 1000
    assert stamps[0] > clock.now_ms() * 1000 - 1_000_000  # stamped within the last sample period
    newer = nvml.nvmlDeviceGetProcessUtilization(h, stamps[0])
    assert sorted(x.timeStamp for x in newer) == [t for t in stamps if t > stamps[0]]
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetProcessUtilization(h, stamps[-1])
    clock.advance_ms(s.interval_ms)
    later = nvml.nvmlDeviceGetProcessUtilization(h, stamps[-1])
    assert {x.pid for x in later} == {x.pid for x in first}
    assert all(x.timeStamp > stamps[-1] for x in later)


def test_process_utilization_is_not_found_when_no_process_ran():
    # churn: the exclusive GPU 1 has no process before t=20
    _, _, _, nvml = setup("churn", at_seconds=10)
    h = nvml.nvmlDeviceGetHandleByIndex(1)
    assert nvml.nvmlDeviceGetComputeRunningProcesses(h) == []
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetProcessUtilization(h, 0)
    assert nvml.nvmlDeviceGetUtilizationRates(h).gpu == 0


def test_a_leaking_pod_time_slices_an_exclusive_gpu():
    s, world, clock, nvml = setup("visibility_leak", at_seconds=30)
    h0 = nvml.nvmlDeviceGetHandleByIndex(0)
    pods = {world.process(p.pid).pod_key for p in nvml.nvmlDeviceGetComputeRunningProcesses(h0)}
    assert pods == {"prod/ranker-0", "scratch/cuda-debug"}
    # demands 0.6 + 0.5 > 1: proportional slices, device busy all the time
    assert nvml.nvmlDeviceGetUtilizationRates(h0).gpu == 100
    truth = {(r.gpu_uuid, r.pod_uid): r.true_compute_fraction for r in world.truth(clock.now_ms())}
    ranker = next(p for p in s.pods if p.name == "ranker-0")
    assert truth[(s.nodes[0].gpus[0].uuid, ranker.uid)] == pytest.approx(0.6 / 1.1)
    h1 = nvml.nvmlDeviceGetHandleByIndex(1)
    assert {world.process(p.pid).pod_key for p in nvml.nvmlDeviceGetComputeRunningProcesses(h1)} == {
        "scratch/cuda-debug"
    }


# ---- MPS -----------------------------------------------------------------------------------------------------


def test_mps_lists_the_server_then_the_clients_as_compute_processes_and_the_clients_alone_as_mps_clients():
    # As driver 580.159.04 answered on an H200 under MPS (bench/results/gpu_machine.json): the compute list holds
    # the server first and then every client, the MPS list the clients alone with the same memory, and the
    # per-process utilization has one sample, the server's, carrying the device's utilization.
    s, world, clock, nvml = setup("mps", at_seconds=30)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    compute = nvml.nvmlDeviceGetComputeRunningProcesses(h)
    assert world.process(compute[0].pid).is_mps_server
    assert world.process(compute[0].pid).cgroup_path == "/system.slice/nvidia-mps.service"
    assert not any(world.process(c.pid).is_mps_server for c in compute[1:])
    clients = nvml.nvmlDeviceGetMPSComputeRunningProcesses(h)
    assert {world.process(c.pid).pod_key for c in clients} == {p.key for p in s.pods}
    assert [(c.pid, c.usedGpuMemory) for c in compute[1:]] == [(c.pid, c.usedGpuMemory) for c in clients]
    samples = nvml.nvmlDeviceGetProcessUtilization(h, 0)
    assert [x.pid for x in samples] == [compute[0].pid]
    assert samples[0].smUtil == nvml.nvmlDeviceGetUtilizationRates(h).gpu > 0
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetProcessUtilization(h, samples[0].timeStamp)
    # the pinned-memory limit caps every client at 1/replicas of the usable memory
    gpu = s.nodes[0].gpus[0]
    limit = (gpu.memory_total_bytes - gpu.driver_reserved_bytes) // gpu.sharing.replicas
    assert all(c.usedGpuMemory <= limit for c in clients)
    # concurrent clients capped at their active thread percentage: busy = 1 - prod(1 - granted)
    granted = []
    for c in clients:
        proc = world.process(c.pid)
        demand = proc.compute.demand((clock.now_ms() - proc.start_ms) / 1000)
        granted.append(min(demand, proc.mps_active_thread_percentage / 100))
    assert sum(granted) <= 1
    assert nvml.nvmlDeviceGetUtilizationRates(h).gpu == round(100 * (1 - math.prod(1 - g for g in granted)))
    truth = sorted(r.true_compute_fraction for r in world.truth(clock.now_ms()) if r.pod_uid)
    assert truth == pytest.approx(sorted(granted))


def test_non_mps_gpus_have_no_mps_clients():
    _, _, _, nvml = setup("exclusive", at_seconds=30)
    assert nvml.nvmlDeviceGetMPSComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(0)) == []


# ---- MIG -----------------------------------------------------------------------------------------------------


def test_mig_handles_instances_and_what_they_do_not_support():
    s, world, clock, nvml = setup("mig_mixed", at_seconds=30)
    gpu = s.nodes[0].gpus[0]
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMigMode(h) == [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetUtilizationRates(h)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetProcessUtilization(h, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetAttributes(h)
    assert nvml.nvmlDeviceGetPowerUsage(h) > 0
    used_sum = 0
    parent_pids = {p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)}
    instance_pids = set()
    for k in range(7):
        if k >= len(gpu.sharing.mig_instances):
            with pytest.raises(pynvml.NVMLError_NotFound):
                nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
            continue
        spec = gpu.sharing.mig_instances[k]
        m = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
        assert nvml.nvmlDeviceIsMigDeviceHandle(m).value == 1
        assert nvml.nvmlDeviceGetUUID(m) == spec.uuid and spec.uuid.startswith("MIG-")
        assert nvml.nvmlDeviceGetName(m) == f"{gpu.model} MIG {spec.profile.name}"
        assert nvml.nvmlDeviceGetGpuInstanceId(m) == spec.gpu_instance_id
        assert nvml.nvmlDeviceGetComputeInstanceId(m) == 0
        assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)) == gpu.uuid
        attrs = nvml.nvmlDeviceGetAttributes(m)
        assert attrs.gpuInstanceSliceCount == spec.profile.compute_slices
        assert attrs.memorySizeMB * MIB == spec.memory_total_bytes
        mem = nvml.nvmlDeviceGetMemoryInfo(m, version=pynvml.nvmlMemory_v2)
        assert mem.total == spec.memory_total_bytes and mem.reserved == 0
        used_sum += mem.used
        for call in (nvml.nvmlDeviceGetUtilizationRates, nvml.nvmlDeviceGetPowerUsage):
            with pytest.raises(pynvml.NVMLError_NotSupported):
                call(m)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nvml.nvmlDeviceGetProcessUtilization(m, 0)
        for p in nvml.nvmlDeviceGetComputeRunningProcesses(m):
            assert (p.gpuInstanceId, p.computeInstanceId) == (spec.gpu_instance_id, 0)
            instance_pids.add(p.pid)
    parent = nvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    assert parent.used == used_sum
    assert parent.total == gpu.memory_total_bytes and parent.reserved == gpu.driver_reserved_bytes
    assert parent_pids == instance_pids and instance_pids
    # truth: share of the instance's time; both processes of the 3g pod add up
    trainer = next(p for p in s.pods if p.name == "trainer-small-0")
    row = next(r for r in world.truth(clock.now_ms()) if r.pod_uid == trainer.uid)
    assert row.gpu_uuid == gpu.sharing.mig_instances[0].uuid and row.parent_gpu_uuid == gpu.uuid
    assert row.true_compute_fraction == pytest.approx(0.8 + 0.1)


def test_gpu_instance_profile_info_describes_the_profiles():
    s, _, _, nvml = setup("mig_mixed", at_seconds=10)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    assert (info.sliceCount, info.instanceCount, info.name) == (1, 7, "MIG 1g.10gb")
    full = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)
    assert full.sliceCount == 7 and full.name == "MIG 7g.80gb"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_6_SLICE)


def test_mig_mode_off_and_unsupported():
    _, _, _, nvml = setup("exclusive", at_seconds=10)  # A10G: no MIG at all
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetMigMode(h)
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(h) == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetGpuInstanceId(h)
    _, _, _, nvml = setup("demo", node="gpu-p5-a", at_seconds=10)  # H100 in whole-GPU mode
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMigMode(h) == [pynvml.NVML_DEVICE_MIG_DISABLE] * 2
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)


# ---- faults --------------------------------------------------------------------------------------------------


def test_a_lost_gpu_fails_every_call_from_its_time_on():
    s, _, clock, nvml = setup("faults", at_seconds=50)
    h = nvml.nvmlDeviceGetHandleByIndex(1)
    assert nvml.nvmlDeviceGetUUID(h) == s.nodes[0].gpus[1].uuid
    clock.set_ms(s.start_unix_ms + 60_000)
    for call in (
        nvml.nvmlDeviceGetUUID,
        nvml.nvmlDeviceGetName,
        nvml.nvmlDeviceGetMemoryInfo,
        nvml.nvmlDeviceGetUtilizationRates,
        nvml.nvmlDeviceGetPowerUsage,
        nvml.nvmlDeviceGetComputeRunningProcesses,
        nvml.nvmlDeviceGetMigMode,
    ):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call(h)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetHandleByIndex(1)
    assert nvml.nvmlDeviceGetCount() == 2
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(0)) == s.nodes[0].gpus[0].uuid


def test_nvml_error_faults_hold_only_in_their_window():
    s, _, clock, nvml = setup("faults", at_seconds=20)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetPowerUsage(h) > 0
    clock.set_ms(s.start_unix_ms + 30_000)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetPowerUsage(h)
    clock.set_ms(s.start_unix_ms + 90_000)
    assert nvml.nvmlDeviceGetPowerUsage(h) > 0


def test_init_fault():
    text = (REPO / "scenarios/exclusive.yaml").read_text().replace(
        "    gpus:\n", "    faults: [{kind: nvml_error, function: nvmlInit, error: DRIVER_NOT_LOADED, until_seconds: 20}]\n    gpus:\n", 1
    )
    s = load_scenario(text)
    clock = ManualClock(s.start_unix_ms)
    nvml = simulated_pynvml(SimWorld(s), clock)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        nvml.nvmlInit()
    clock.set_ms(s.start_unix_ms + 20_000)
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetCount() == 4


def test_a_process_exiting_between_listing_and_proc_read(tmp_path):
    s, world, clock, nvml = setup("faults", at_seconds=30)
    race = s.process_exit_races[0]
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    before = {world.process(p.pid).comm: p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)}
    pid = before[race.process]
    world.write_proc(tmp_path)
    assert read_process_identity(pid, tmp_path) is not None
    clock.set_ms(s.start_unix_ms + round(race.at_seconds * 1000))
    listed = {p.pid: p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)}
    assert pid in listed and listed[pid] > 0  # the driver still lists its context
    assert pid not in {x.pid for x in nvml.nvmlDeviceGetProcessUtilization(h, 0)}  # it ran no kernel
    world.write_proc(tmp_path)
    assert read_process_identity(pid, tmp_path) is None and read_process_start_ticks(pid, tmp_path) is None
    clock.advance_ms(s.interval_ms)
    assert pid not in {p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)}


# ---- determinism, /proc, pods, truth ---------------------------------------------------------------------------


def observe_everything(s: Scenario) -> list:
    world = SimWorld(s)
    clock = ManualClock(s.start_unix_ms)
    fakes = [simulated_pynvml(world, clock, n.name) for n in s.nodes]
    for f in fakes:
        f.nvmlInit()
    out = []
    for tick in s.tick_times_ms():
        clock.set_ms(tick)
        for nvml in fakes:
            for handle, _ in unit_handles(nvml):
                mem = nvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
                procs = sorted(all_processes(nvml, handle).items())
                try:
                    sm = sorted((x.pid, x.smUtil, x.timeStamp) for x in nvml.nvmlDeviceGetProcessUtilization(handle, 0))
                except pynvml.NVMLError as exc:
                    sm = type(exc).__name__
                out.append((nvml.nvmlDeviceGetUUID(handle), mem.used, mem.free, procs, sm))
        out.append(world.truth(tick))
    return out


def test_a_replay_is_identical_for_a_seed_and_differs_with_another():
    s = scenario("two_nodes")
    assert observe_everything(s) == observe_everything(load_scenario(REPO / "scenarios/two_nodes.yaml"))
    text = (REPO / "scenarios/two_nodes.yaml").read_text().replace("seed: 77", "seed: 78")
    other = observe_everything(load_scenario(text))
    first = observe_everything(s)
    assert [x[0] for x in first if isinstance(x, tuple)] != [x[0] for x in other if isinstance(x, tuple)]


def test_world_state_does_not_depend_on_the_tick_pattern():
    s = scenario("churn")
    late = s.tick_times_ms()[-1]
    skipping = SimWorld(s)
    stepping = SimWorld(s)
    for tick in s.tick_times_ms():
        stepping.step(tick)
        stepping.truth(tick)
    skipping.step(late)
    assert skipping.truth(late) == stepping.truth(late)
    with pytest.raises(ValueError):
        stepping.step(s.start_unix_ms)


@pytest.mark.parametrize("name", SCENARIOS)
def test_fake_proc_maps_every_pid_to_its_pod_and_container(name, tmp_path):
    s = scenario(name)
    world = SimWorld(s)
    for tick in s.tick_times_ms()[::4]:
        world.step(tick)
        written = set(world.write_proc(tmp_path))
        assert {int(p.name) for p in tmp_path.iterdir()} == written
        for pid in written:
            process = world.process(pid)
            identity = read_process_identity(pid, tmp_path)
            if process.pod_uid is None:
                assert identity is None
            else:
                assert (identity.pod_uid, identity.container_id) == (process.pod_uid, process.container_id)
                pod = next(p for p in s.pods if p.uid == process.pod_uid)
                assert identity.qos_class == pod.qos_class
            node = s.node(process.node_name)
            boot_ms = s.start_unix_ms - node.uptime_seconds_at_start * 1000
            assert read_process_start_ticks(pid, tmp_path) == (process.start_ms - boot_ms) // 10


def test_pods_come_and_go_with_their_device_ids():
    s = scenario("churn")
    world = SimWorld(s)
    at = lambda sec: {p.name for p in world.pods_at(s.start_unix_ms + sec * 1000)}  # noqa: E731
    assert at(0) == {"etl-embed-1"}
    assert at(60) == {"captioner-0", "transcode-7"}
    assert at(75) == {"etl-embed-2", "captioner-0", "transcode-7"}
    assert at(150) == {"captioner-0"}
    pod = next(p for p in world.pods_at(s.start_unix_ms + 75_000) if p.name == "etl-embed-2")
    ids = pod.containers[0].device_ids["nvidia.com/gpu.shared"]
    ref = parse_device_id(ids[0])
    assert (ref.gpu_uuid, ref.replica) == (s.nodes[0].gpus[0].uuid, 0)
    assert pod.gpu_requests == {"nvidia.com/gpu.shared": 1}
    assert pod.containers[0].assigned_devices[0].device_ids == ids
    assert pod.started_at_unix_ms == s.start_unix_ms + 70_000 and pod.ends_at_unix_ms == s.start_unix_ms + 150_000


def test_truth_memory_is_the_listed_memory_and_processes_follow_their_pods():
    s = scenario("churn")
    world = SimWorld(s)
    for tick in s.tick_times_ms():
        alive = {p.uid for p in world.pods_at(tick)}
        rows = world.truth(tick)
        assert {r.pod_uid for r in rows if r.pod_uid} <= alive
        by_pod: dict = {}
        for obs in world.process_observations(tick):
            key = (obs.unit_uuid, world.process(obs.pid).pod_uid)
            by_pod[key] = by_pod.get(key, 0) + obs.used_gpu_memory_bytes
        assert {(r.gpu_uuid, r.pod_uid): r.true_memory_bytes for r in rows} == by_pod
    # the late second process of transcode-7 runs in [50, 110) scenario seconds
    transcode = next(p for p in s.pods if p.name == "transcode-7")
    pids = lambda sec: [o.pid for o in world.process_observations(s.start_unix_ms + sec * 1000)  # noqa: E731
                        if world.process(o.pid).pod_uid == transcode.uid]
    assert len(pids(40)) == 1 and len(pids(60)) == 2 and len(pids(110)) == 1 and pids(140) == []
