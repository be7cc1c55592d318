"""NvmlBackend over the simulator (and, where this machine allows, the real pynvml): exact agreement with the
world's ground truth on every example, and every failure recorded rather than raised."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from pathlib import Path

import pynvml
import pytest

from gpumeter.clock import ManualClock
from schemas.records import GpuDeviceSample, SharingMode
from services.collector.nvml_backend import (
    PYTHON_EXCEPTION,
    READ_GPU_STEP,
    UNKNOWN_GPU_PREFIX,
    NvmlBackend,
    RawDeviceSample,
)
from simulator.nvml_driver import simulated_pynvml
from simulator.scenario import NodeSpec, Scenario, load_scenario
from simulator.world import SimWorld

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = sorted(p.stem for p in (REPO / "scenarios").glob("*.yaml"))
_MODES = {"exclusive": SharingMode.EXCLUSIVE, "time_slicing": SharingMode.TIME_SLICING, "mps": SharingMode.MPS}


@functools.lru_cache(maxsize=None)
def scenario(name: str) -> Scenario:
    return load_scenario(REPO / "scenarios" / f"{name}.yaml")


def with_faults(name: str, faults_yaml: str, node_index: int = 0) -> Scenario:
    """The example with ``faults_yaml`` (a YAML flow list) as the faults of one node."""
    text = (REPO / "scenarios" / f"{name}.yaml").read_text()
    assert "    faults:" not in text  # a second faults key would be silently dropped by YAML
    lines = text.splitlines(keepends=True)
    seen = -1
    for i, line in enumerate(lines):
        if line.startswith("  - name: ") and "nodes:" in "".join(lines[:i]) and "pods:" not in "".join(lines[:i]):
            seen += 1
            if seen == node_index:
                lines.insert(i + 1, f"    faults: {faults_yaml}\n")
                break
    return load_scenario("".join(lines))


def sharing_config(node: NodeSpec) -> dict[str, tuple[SharingMode, int]]:
    """What the collector knows from the device plugin's configuration."""
    return {g.uuid: (_MODES[g.sharing.mode], g.sharing.replicas) for g in node.gpus if g.sharing.mode in _MODES}


class Proxy:
    """An nvml module wrapper: records every call and can replace functions. The backend sees a module."""

    def __init__(self, inner, **overrides):
        self._inner = inner
        self._overrides = overrides
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name):
        value = self._overrides.get(name) or getattr(self._inner, name)
        if name.startswith("nvml") and callable(value) and not isinstance(value, type):
            def call(*args, **kwargs):
                self.calls.append((name, args, kwargs))
                return value(*args, **kwargs)

            return call
        return value

    def __dir__(self):
        return dir(self._inner)


def make(s: Scenario, node_name: str | None = None, *, configured: bool = True, wrap=None, metrics=None):
    world = SimWorld(s)
    clock = ManualClock(s.start_unix_ms)
    node = s.node(node_name) if node_name else s.nodes[0]
    fake = simulated_pynvml(world, clock, node.name)
    nvml = wrap(fake) if wrap else fake
    backend = NvmlBackend(
        nvml, clock, sharing_by_gpu_uuid=sharing_config(node) if configured else None, metrics=metrics
    )
    return world, clock, fake, nvml, backend


def at(s: Scenario, clock: ManualClock, seconds: float) -> int:
    clock.set_ms(s.start_unix_ms + round(seconds * 1000))
    return clock.now_ms()


# ---- agreement with the ground truth on every example --------------------------------------------------------


@pytest.mark.parametrize("name", SCENARIOS)
def test_backend_agrees_with_the_world_on_every_tick(name):
    s = scenario(name)
    world = SimWorld(s)
    clock = ManualClock(s.start_unix_ms)
    backends = {
        n.name: NvmlBackend(simulated_pynvml(world, clock, n.name), clock, sharing_by_gpu_uuid=sharing_config(n))
        for n in s.nodes
    }
    for tick in s.tick_times_ms():
        clock.set_ms(tick)
        truth = {(r.gpu_uuid, r.pod_uid): r.true_memory_bytes for r in world.truth(tick)}
        observed = {}
        for node in s.nodes:
            reading = backends[node.name].read()
            assert reading.node_errors == ()
            assert [d.index for d in reading.devices] == sorted(d.index for d in reading.devices)
            for device in reading.devices:
                check_device(s, world, node, device, tick, observed)
        # per-pod memory adds up to the truth exactly (the cgroup mapping is the world's pid → pod)
        assert observed == truth


def check_device(s, world, node, device: RawDeviceSample, tick, observed):
    gpu = node.gpus[device.index]
    assert device.model == gpu.model
    if world.gpu_lost(node.name, gpu.index, tick):
        assert device.uuid in (gpu.uuid, *(i.uuid for i in gpu.sharing.mig_instances))
        assert [e.error_code for e in device.errors] == ["GPU_IS_LOST"]
        assert device.memory_total_bytes == 0 and device.process_pids == () and device.power_milliwatts is None
        return
    obs = world.observation_at(tick, node.name, gpu.index)
    assert device.memory_total_bytes == device.memory_free_bytes + device.memory_used_bytes + device.memory_reserved_bytes
    allowed_errors = {
        ("nvmlDeviceGetPowerUsage", "NOT_SUPPORTED")
        for f in node.faults
        if getattr(f, "function", None) == "nvmlDeviceGetPowerUsage"
        and f.gpu == gpu.index
        and s.start_unix_ms + f.from_seconds * 1000 <= tick < s.start_unix_ms + f.until_seconds * 1000
    }
    assert {(e.nvml_function, e.error_code) for e in device.errors} == allowed_errors
    if device.parent_uuid is None:
        assert (device.power_milliwatts is None) == bool(allowed_errors)
    assert len(device.process_pids) == len(device.process_used_memory_bytes) == len(device.process_sm_utilization_percent)
    if gpu.sharing.mode == "mig":
        assert device.sharing_mode == SharingMode.MIG and device.replicas == 1
        assert device.gpu_utilization_percent is None and device.memory_utilization_percent is None
        assert device.process_utilization_supported is False
        if device.parent_uuid is None:
            assert device.uuid == gpu.uuid
            assert device.mig_total_compute_slices == 7 and device.process_pids == ()
            assert (device.memory_used_bytes, device.memory_reserved_bytes) == (
                obs.memory_used_bytes,
                obs.memory_reserved_bytes,
            )
            assert device.power_milliwatts == obs.power_milliwatts
            return
        assert device.parent_uuid == gpu.uuid
        spec = next(i for i in gpu.sharing.mig_instances if i.uuid == device.uuid)
        unit = obs.units[spec.index]
        assert (device.mig_profile, device.mig_compute_slices) == (spec.profile.name, spec.profile.compute_slices)
        assert (device.mig_gpu_instance_id, device.mig_compute_instance_id) == (spec.gpu_instance_id, 0)
        # Each instance names the GPU's slice count, so its fraction needs no parent (and never memory).
        assert device.power_milliwatts is None and device.mig_total_compute_slices == 7
        assert set(device.process_sm_utilization_percent) <= {-1}
    else:
        assert device.uuid == gpu.uuid and device.parent_uuid is None and device.mig_profile is None
        assert (device.sharing_mode, device.replicas) == (_MODES[gpu.sharing.mode], gpu.sharing.replicas)
        unit = obs.units[0]
        assert device.gpu_utilization_percent == unit.gpu_utilization_percent
        assert device.memory_utilization_percent == unit.memory_utilization_percent
        if gpu.sharing.mode == "mps":
            assert device.process_utilization_supported is False
            assert set(device.process_sm_utilization_percent) <= {-1}
        else:
            assert device.process_utilization_supported is True
            expected_sm = {p.pid: p.sm_util_percent or 0 for p in unit.processes}
            assert dict(zip(device.process_pids, device.process_sm_utilization_percent)) == expected_sm
    assert (device.memory_total_bytes, device.memory_used_bytes, device.memory_free_bytes) == (
        unit.memory_total_bytes,
        unit.memory_used_bytes,
        unit.memory_free_bytes,
    )
    # every context on the unit, each with exactly the memory the world gave it
    assert dict(zip(device.process_pids, device.process_used_memory_bytes)) == {
        p.pid: p.used_gpu_memory_bytes for p in unit.processes
    }
    assert device.memory_used_bytes >= sum(device.process_used_memory_bytes)
    for pid, used in zip(device.process_pids, device.process_used_memory_bytes):
        key = (device.uuid, world.process(pid).pod_uid)
        observed[key] = observed.get(key, 0) + used


def test_the_mps_server_and_clients_are_all_reported():
    s = scenario("mps")
    world, clock, _, _, backend = make(s)
    at(s, clock, 30)
    (device,) = backend.sample()
    kinds = sorted(world.process(pid).is_mps_server for pid in device.process_pids)
    assert kinds == [False, False, False, True]


def test_the_mps_server_is_told_from_the_clients_listed_in_both_lists():
    # Driver 580 lists every client in the compute list too (bench/results/gpu_machine.json): the server is the
    # compute-list pid that is no client, and each client is reported once.
    s = scenario("mps")
    world, clock, _, _, backend = make(s)
    at(s, clock, 30)
    (device,) = backend.sample()
    assert len(device.process_pids) == len(set(device.process_pids)) == 4
    assert [world.process(pid).is_mps_server for pid in device.mps_server_pids] == [True]


def test_an_unreadable_mps_client_list_calls_no_process_a_server():
    # Without the client list the clients (in the compute list too) cannot be told from the server: calling them
    # all servers would drop their busy time, so none is called one; the failure is recorded.
    def fails(*args, **kwargs):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    s = scenario("mps")
    world, clock, _, _, backend = make(s, wrap=lambda f: Proxy(f, nvmlDeviceGetMPSComputeRunningProcesses=fails))
    at(s, clock, 30)
    (device,) = backend.sample()
    assert device.mps_server_pids == ()
    assert sorted(world.process(pid).is_mps_server for pid in device.process_pids) == [False, False, False, True]
    assert [(e.nvml_function, e.error_code) for e in device.errors] == [
        ("nvmlDeviceGetMPSComputeRunningProcesses", "UNKNOWN")
    ]


# ---- sharing modes -------------------------------------------------------------------------------------------


def test_sharing_mode_without_device_plugin_configuration():
    for name, expected in (("exclusive", SharingMode.UNKNOWN), ("mps", SharingMode.MPS), ("mig_mixed", SharingMode.MIG)):
        s = scenario(name)
        _, clock, _, _, backend = make(s, configured=False)
        at(s, clock, 30)
        devices = backend.sample()
        assert {d.sharing_mode for d in devices} == {expected}
        assert {d.replicas for d in devices} == {1}


def test_configured_mig_with_mig_mode_off_is_unknown():
    s = scenario("exclusive")
    world = SimWorld(s)
    clock = ManualClock(s.start_unix_ms + 10_000)
    uuid = s.nodes[0].gpus[0].uuid
    backend = NvmlBackend(simulated_pynvml(world, clock), clock, sharing_by_gpu_uuid={uuid: (SharingMode.MIG, 1)})
    assert backend.sample()[0].sharing_mode == SharingMode.UNKNOWN


def test_mps_gpus_are_not_asked_for_process_utilization():
    s = scenario("mps")
    _, clock, fake, nvml, backend = make(s, wrap=Proxy)
    for tick in s.tick_times_ms()[:3]:
        clock.set_ms(tick)
        backend.sample()
    called = Counter(name for name, _, _ in nvml.calls)
    assert called["nvmlDeviceGetProcessUtilization"] == 0
    assert called["nvmlDeviceGetMPSComputeRunningProcesses"] == 3
    # nor did pynvml reach the driver's symbol some other way
    assert fake.nvmlLib.call_counts["nvmlDeviceGetProcessUtilization"] == 0


# ---- per-process utilization ---------------------------------------------------------------------------------


def test_last_seen_timestamp_is_the_newest_sample_received():
    s = scenario("time_slicing")
    proxies = []
    world, clock, _, nvml, backend = make(s, wrap=lambda f: proxies.append(Proxy(f)) or proxies[-1])
    ticks = s.tick_times_ms()[:3]
    for tick in ticks:
        clock.set_ms(tick)
        backend.sample()
    asked = [args[1] for name, args, _ in proxies[0].calls if name == "nvmlDeviceGetProcessUtilization"]
    newest = [max(p.sample_timestamp_us for p in world.process_observations(t)) for t in ticks]
    assert asked == [0, newest[0], newest[1]]


def test_sampling_twice_at_one_instant_reads_no_new_samples_as_zero():
    s = scenario("time_slicing")
    _, clock, _, _, backend = make(s)
    at(s, clock, 30)
    first = backend.sample()[0]
    assert all(v > 0 for v in first.process_sm_utilization_percent)
    again = backend.sample()[0]  # NVML answers NOT_FOUND: no process ran since the last sample
    assert again.process_utilization_supported is True
    assert again.process_sm_utilization_percent == tuple(0 for _ in again.process_pids)
    assert again.errors == ()


def test_processes_that_ran_nothing_read_zero():
    text = """
cluster: c
start: "2026-07-01T00:00:00Z"
duration_seconds: 60
nodes:
  - {name: n, region: r, instance_type: t,
     gpus: [{model: NVIDIA L4, memory_total_bytes: 22GiB, sharing: {mode: time_slicing, replicas: 2}}]}
pods:
  - name: idle
    node: n
    containers: [{devices: [{resource: nvidia.com/gpu.shared, gpu: 0, replica: 0}],
                  processes: [{name: python, memory: {bytes: 1GiB}, compute: [[0, 0.0], [30, 0.5]]}]}]
"""
    s = load_scenario(text)
    _, clock, _, _, backend = make(s)
    at(s, clock, 10)
    device = backend.sample()[0]
    assert len(device.process_pids) == 1
    assert device.process_utilization_supported is True and device.process_sm_utilization_percent == (0,)
    assert device.gpu_utilization_percent == 0
    at(s, clock, 40)
    assert abs(backend.sample()[0].process_sm_utilization_percent[0] - 50) <= 2


def test_pynvml_success_error_from_process_utilization_means_no_samples():
    # pynvml raises NVMLError(NVML_SUCCESS) when the driver's size probe finds no sample at all
    def empty(handle, timestamp):
        raise pynvml.NVMLError(pynvml.NVML_SUCCESS)

    s = scenario("time_slicing")
    _, clock, _, _, backend = make(s, wrap=lambda f: Proxy(f, nvmlDeviceGetProcessUtilization=empty))
    at(s, clock, 30)
    device = backend.sample()[0]
    assert device.errors == () and device.process_utilization_supported is True
    assert device.process_sm_utilization_percent == (0, 0, 0)


def test_mig_profile_falls_back_to_the_profile_matching_the_attributes():
    def bare_name(inner):
        # a driver whose MIG device names carry no profile: match slices and memory against the profile table
        return Proxy(inner, nvmlDeviceGetName=lambda handle: "NVIDIA A100-SXM4-80GB")

    s = scenario("mig_mixed")
    _, clock, _, _, backend = make(s, wrap=bare_name)
    at(s, clock, 30)
    instances = [d for d in backend.sample() if d.parent_uuid]
    spec = s.nodes[0].gpus[0].sharing.mig_instances
    assert [d.mig_profile for d in instances] == [i.profile.name for i in spec]
    assert [d.mig_compute_slices for d in instances] == [i.profile.compute_slices for i in spec]


def test_a_failing_mig_mode_query_keeps_the_gpu_in_mig_mode():
    s = with_faults("mig_mixed", "[{kind: nvml_error, function: nvmlDeviceGetMigMode, error: UNKNOWN, from_seconds: 20}]")
    _, clock, _, _, backend = make(s)
    at(s, clock, 10)
    before = backend.sample()
    at(s, clock, 20)
    after = backend.sample()
    assert [(d.uuid, d.sharing_mode, d.mig_profile) for d in after] == [
        (d.uuid, d.sharing_mode, d.mig_profile) for d in before
    ]
    assert [(e.nvml_function, e.error_code) for e in after[0].errors] == [("nvmlDeviceGetMigMode", "UNKNOWN")]


def test_a_process_listed_at_its_exit_keeps_its_memory_and_reads_zero():
    s = scenario("faults")
    world, clock, _, _, backend = make(s)
    race = s.process_exit_races[0]
    now = at(s, clock, race.at_seconds)
    device = backend.sample()[0]
    exiting = next(p for p in world.processes if p.comm == race.process)
    index = device.process_pids.index(exiting.pid)
    assert device.process_sm_utilization_percent[index] == 0
    expected = next(o for o in world.process_observations(now) if o.pid == exiting.pid and o.unit_uuid == device.uuid)
    assert device.process_used_memory_bytes[index] == expected.used_gpu_memory_bytes > 0
    assert {e.nvml_function for e in device.errors} == {"nvmlDeviceGetPowerUsage"}  # the scenario's power fault
    clock.advance_ms(s.interval_ms)
    assert exiting.pid not in backend.sample()[0].process_pids


# ---- failures are recorded, never raised ---------------------------------------------------------------------


def test_a_lost_gpu_is_reported_under_its_last_known_uuid():
    s = scenario("faults")
    _, clock, _, _, backend = make(s)
    at(s, clock, 50)
    before = backend.sample()
    at(s, clock, 60)
    after = backend.sample()
    assert [d.uuid for d in after] == [d.uuid for d in before]
    lost = after[1]
    assert [(e.nvml_function, e.error_code) for e in lost.errors] == [("nvmlDeviceGetHandleByIndex", "GPU_IS_LOST")]
    assert lost.errors[0].message == "GPU is lost"
    assert (lost.memory_total_bytes, lost.process_pids, lost.gpu_utilization_percent) == (0, (), None)
    assert lost.sharing_mode == before[1].sharing_mode and lost.model == before[1].model
    assert after[0].memory_total_bytes > 0 and after[0].process_pids


def test_a_gpu_lost_before_it_was_ever_seen_gets_a_placeholder_uuid():
    s = with_faults("exclusive", "[{kind: gpu_lost, gpu: 1, at_seconds: 0}]")
    _, clock, _, _, backend = make(s)
    at(s, clock, 10)
    devices = backend.sample()
    assert devices[1].uuid == f"{UNKNOWN_GPU_PREFIX}1" and devices[1].errors[0].error_code == "GPU_IS_LOST"
    assert devices[0].uuid == s.nodes[0].gpus[0].uuid


def test_a_lost_mig_gpu_keeps_reporting_its_instances():
    s = with_faults("two_nodes", "[{kind: gpu_lost, gpu: 0, at_seconds: 30}]", node_index=1)
    _, clock, _, _, backend = make(s, "node-a100")
    at(s, clock, 25)
    before = backend.sample()
    at(s, clock, 30)
    after = backend.sample()
    assert [(d.uuid, d.parent_uuid, d.mig_profile, d.mig_gpu_instance_id) for d in after] == [
        (d.uuid, d.parent_uuid, d.mig_profile, d.mig_gpu_instance_id) for d in before
    ]
    lost = [d for d in after if d.index == 0]
    assert len(lost) == 3
    assert all([e.error_code for e in d.errors] == ["GPU_IS_LOST"] for d in lost)
    assert all(d.memory_total_bytes == 0 and d.process_pids == () for d in lost)


def test_not_supported_on_every_call_is_recorded_per_device():
    s = with_faults("exclusive", "[{kind: nvml_error, function: '*', error: NOT_SUPPORTED, from_seconds: 30}]")
    _, clock, _, _, backend = make(s)
    at(s, clock, 20)
    known = [d.uuid for d in backend.sample()]
    at(s, clock, 30)
    devices = backend.sample()
    assert [d.uuid for d in devices] == known
    for d in devices:
        assert [(e.nvml_function, e.error_code) for e in d.errors] == [("nvmlDeviceGetHandleByIndex", "NOT_SUPPORTED")]
        assert d.process_utilization_supported is False


def test_each_failing_call_is_recorded_and_documented_not_supported_is_not():
    def not_supported(*args, **kwargs):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    keep = {"nvmlInit", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName"}
    names = [n for n in dir(pynvml) if n.startswith("nvml") and callable(getattr(pynvml, n))
             and not isinstance(getattr(pynvml, n), type) and n not in keep]
    s = scenario("exclusive")
    _, clock, _, _, backend = make(s, wrap=lambda f: Proxy(f, **{n: not_supported for n in names}))
    at(s, clock, 30)
    devices = backend.sample()
    assert len(devices) == 4
    for d in devices:
        assert {e.nvml_function for e in d.errors} == {
            "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetComputeRunningProcesses",
        }
        assert {e.error_code for e in d.errors} == {"NOT_SUPPORTED"}
        assert (d.memory_total_bytes, d.gpu_utilization_percent, d.power_milliwatts) == (0, None, None)
        assert d.process_utilization_supported is False and d.model == "NVIDIA A10G"


def test_init_failure_is_a_node_error_and_is_retried():
    s = with_faults("exclusive", "[{kind: nvml_error, function: nvmlInit, error: DRIVER_NOT_LOADED, until_seconds: 20}]")
    _, clock, _, _, backend = make(s)
    at(s, clock, 10)
    reading = backend.read()
    assert reading.devices == () and backend.sample() == ()
    assert [(e.nvml_function, e.error_code) for e in reading.node_errors] == [("nvmlInit", "DRIVER_NOT_LOADED")]
    assert backend.node_errors == reading.node_errors
    devices, node_errors = backend.read()  # unpacks like a pair
    assert devices == () and node_errors == reading.node_errors
    at(s, clock, 20)
    assert len(backend.sample()) == 4 and backend.node_errors == ()


def test_device_count_failure_is_a_node_error():
    s = with_faults("exclusive", "[{kind: nvml_error, function: nvmlDeviceGetCount, error: UNKNOWN, from_seconds: 20}]")
    _, clock, _, _, backend = make(s)
    at(s, clock, 20)
    reading = backend.read()
    assert reading.devices == ()
    assert [(e.nvml_function, e.error_code, e.message) for e in reading.node_errors] == [
        ("nvmlDeviceGetCount", "UNKNOWN", "Unknown Error")
    ]


def test_drivers_without_memory_info_v2_are_read_through_v1():
    def v1_only(inner):
        def get(handle, version=None):
            if version:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return inner.nvmlDeviceGetMemoryInfo(handle)

        return Proxy(inner, nvmlDeviceGetMemoryInfo=get)

    s = scenario("exclusive")
    world, clock, _, _, backend = make(s, wrap=v1_only)
    now = at(s, clock, 30)
    device = backend.sample()[0]
    truth = world.observation_at(now, s.nodes[0].name, 0)
    assert device.errors == ()
    assert device.memory_reserved_bytes == 0
    assert device.memory_used_bytes == truth.memory_used_bytes + truth.memory_reserved_bytes
    assert device.memory_total_bytes == device.memory_used_bytes + device.memory_free_bytes


def test_a_python_exception_from_the_binding_is_recorded():
    def broken(handle):
        raise RuntimeError("ctypes went wrong")

    s = scenario("exclusive")
    _, clock, _, _, backend = make(s, wrap=lambda f: Proxy(f, nvmlDeviceGetPowerUsage=broken))
    at(s, clock, 30)
    device = backend.sample()[0]
    assert [(e.nvml_function, e.error_code) for e in device.errors] == [("nvmlDeviceGetPowerUsage", PYTHON_EXCEPTION)]
    assert "RuntimeError: ctypes went wrong" in device.errors[0].message
    assert device.power_milliwatts is None and device.memory_total_bytes > 0


def test_an_answer_of_an_unexpected_shape_is_recorded_on_its_gpu():
    s = scenario("exclusive")
    _, clock, _, proxy, backend = make(s, wrap=Proxy)
    at(s, clock, 20)
    assert [d.uuid for d in backend.sample()] == [g.uuid for g in s.nodes[0].gpus]
    proxy._overrides["nvmlDeviceGetUtilizationRates"] = lambda handle: object()  # no .gpu / .memory
    devices = backend.sample()
    assert [d.uuid for d in devices] == [g.uuid for g in s.nodes[0].gpus]
    for d in devices:
        assert [(e.nvml_function, e.error_code) for e in d.errors] == [(READ_GPU_STEP, PYTHON_EXCEPTION)]
        assert "AttributeError" in d.errors[0].message


def test_metrics_hook_sees_every_call_and_its_outcome():
    seen = []

    class Hook:
        def nvml_call(self, function, duration_seconds, error_code):
            assert duration_seconds >= 0
            seen.append((function, error_code))

    s = scenario("faults")
    _, clock, _, nvml, backend = make(s, metrics=Hook(), wrap=Proxy)
    at(s, clock, 30)
    backend.sample()
    assert ("nvmlInit", None) in seen and ("nvmlDeviceGetPowerUsage", "NOT_SUPPORTED") in seen
    assert [function for function, _ in seen] == [name for name, _, _ in nvml.calls]


def test_close_shuts_nvml_down_and_a_later_read_initialises_again():
    s = scenario("exclusive")
    _, clock, fake, _, backend = make(s)
    at(s, clock, 10)
    backend.sample()
    backend.close()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    assert len(backend.sample()) == 4
    calls = fake.nvmlLib.call_counts
    assert calls["nvmlInitWithFlags"] == 2 and calls["nvmlShutdown"] == 1


def test_the_real_pynvml_module_never_raises_out_of_read():
    backend = NvmlBackend(pynvml, ManualClock(0))
    reading = backend.read()
    if reading.node_errors:
        # no NVIDIA driver here: the library or the driver is missing
        assert [e.nvml_function for e in reading.node_errors] == ["nvmlInit"]
        assert reading.node_errors[0].error_code in {"LIBRARY_NOT_FOUND", "DRIVER_NOT_LOADED", "NO_PERMISSION"}
        assert reading.devices == ()
    else:
        assert all(d.uuid.startswith(("GPU-", "MIG-", UNKNOWN_GPU_PREFIX)) for d in reading.devices)
        backend.close()


# ---- records ---------------------------------------------------------------------------------------------------


def test_raw_device_sample_is_a_device_sample_without_the_index_column():
    raw_fields = [f.name for f in dataclasses.fields(RawDeviceSample)]
    record_fields = [f.name for f in dataclasses.fields(GpuDeviceSample) if f.name != "process_pod_index"]
    assert raw_fields == record_fields


def test_to_device_sample_adds_the_index_column():
    s = scenario("time_slicing")
    _, clock, _, _, backend = make(s)
    at(s, clock, 30)
    raw = backend.sample()[0]
    n = len(raw.process_pids)
    record = raw.to_device_sample(tuple(-1 for _ in range(n)))
    assert record.process_pod_index == (-1,) * n
    assert record.uuid == raw.uuid and record.process_used_memory_bytes == raw.process_used_memory_bytes
    assert GpuDeviceSample.from_avro(record.to_avro()) == record
    with pytest.raises(ValueError):
        raw.to_device_sample((0,) * (n + 1))
