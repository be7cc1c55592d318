"""PodResourcesClient against FakeKubelet over a real unix socket, plus the proto's wire contract."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import grpc
import grpc.aio
import pytest

from gpumeter.errors import ConfigError, GpumeterError
from services.collector.podresources import api_pb2, api_pb2_grpc
from services.collector.podresources.client import (
    AllocatableDevices,
    ContainerDeviceAssignment,
    KubeletUnavailable,
    PodResourcesClient,
    PodResourcesError,
    assignments_from_pod,
)
from schemas.devices import is_gpu_resource
from simulator.kubelet import FakeKubelet, build_pod_resources

G0 = "GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
G1 = "GPU-11111111-2222-4333-8444-555555555555"
MIG0 = "MIG-9a8b7c6d-5e4f-4031-8a2b-1c0d9e8f7a6b"

ASSIGNMENTS = [
    ("ml", "trainer-0", "main", "nvidia.com/gpu", (G0,)),
    ("ml", "trainer-0", "main", "example.com/fpga", ("fpga-0",)),
    ("ml", "trainer-0", "sidecar", "nvidia.com/gpu", ()),
    ("ml", "notebook", "jupyter", "nvidia.com/gpu.shared", (f"{G1}::0", f"{G1}::3")),
    ("infer", "server-abc", "triton", "nvidia.com/mig-1g.10gb", (MIG0,)),
    ("infer", "server-abc", "triton", "hugepages-2Mi", ("x",)),
    ("kube-system", "cni", "agent", "example.com/nic", ("nic-1",)),
]


def expected_gpu(assignments, namespace=None, pod_name=None):
    return tuple(
        ContainerDeviceAssignment(ns, pod, container, resource, tuple(ids))
        for ns, pod, container, resource, ids in assignments
        if is_gpu_resource(resource)
        and ids
        and (namespace is None or ns == namespace)
        and (pod_name is None or pod == pod_name)
    )


@pytest.fixture
def socket_path():
    # pytest's tmp_path can pass the 107-byte sun_path limit; a short /tmp dir cannot.
    directory = tempfile.mkdtemp(dir="/tmp", prefix="pr")
    try:
        yield str(Path(directory) / "kubelet.sock")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def state():
    return {"assignments": list(ASSIGNMENTS)}


@pytest.fixture
async def kubelet(socket_path, state):
    fake = FakeKubelet(socket_path, lambda: state["assignments"])
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


@pytest.fixture
async def client(socket_path):
    c = PodResourcesClient(socket_path, timeout_s=2.0)
    try:
        yield c
    finally:
        await c.close()


network = pytest.mark.network


@network
async def test_list_returns_gpu_assignments_only(kubelet, client, state):
    result = await client.list()
    assert result == expected_gpu(state["assignments"])
    assert all(is_gpu_resource(a.resource_name) for a in result)
    assert {a.resource_name for a in result} == {"nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-1g.10gb"}
    assert kubelet.calls["List"] == 1


@network
async def test_list_follows_assignment_changes(kubelet, client, state):
    assert await client.list() == expected_gpu(state["assignments"])
    state["assignments"] = [("ml", "new", "c", "nvidia.com/gpu", (G1,))]
    assert await client.list() == expected_gpu(state["assignments"])
    state["assignments"] = []
    assert await client.list() == ()


@network
async def test_get_uses_get_when_served(kubelet, client, state):
    result = await client.get("ml", "trainer-0")
    assert result == expected_gpu(state["assignments"], "ml", "trainer-0")
    assert result != ()
    assert (kubelet.calls["Get"], kubelet.calls["List"]) == (1, 0)
    assert client.get_served is True


@network
async def test_get_of_unknown_pod_is_empty(kubelet, client):
    assert await client.get("ml", "no-such-pod") == ()
    assert client.get_served is True


@network
async def test_get_of_pod_without_gpus_is_empty(kubelet, client):
    assert await client.get("kube-system", "cni") == ()


@network
async def test_get_unimplemented_falls_back_to_list(kubelet, client, state):
    kubelet.serve_get = False
    result = await client.get("infer", "server-abc")
    assert result == expected_gpu(state["assignments"], "infer", "server-abc")
    assert result != ()
    assert client.get_served is False
    assert (kubelet.calls["Get"], kubelet.calls["List"]) == (1, 1)
    # Known not served: the next get goes straight to List.
    assert await client.get("ml", "notebook") == expected_gpu(state["assignments"], "ml", "notebook")
    assert (kubelet.calls["Get"], kubelet.calls["List"]) == (1, 2)


@network
async def test_get_disabled_by_feature_gate_falls_back_to_list(kubelet, client, state):
    kubelet.get_disabled = True
    assert await client.get("ml", "notebook") == expected_gpu(state["assignments"], "ml", "notebook")
    assert client.get_served is False
    assert kubelet.calls["List"] == 1


@network
async def test_get_reprobed_after_kubelet_unavailable(kubelet, client, state, socket_path):
    kubelet.serve_get = False
    await client.get("ml", "notebook")
    await kubelet.stop()
    with pytest.raises(KubeletUnavailable):
        await client.get("ml", "notebook")
    kubelet.serve_get = True
    await kubelet.start()
    assert await client.get("ml", "notebook") == expected_gpu(state["assignments"], "ml", "notebook")
    assert client.get_served is True


@network
async def test_a_kubelet_restarted_between_two_calls_is_answered_on_the_first_call_after(kubelet, client, state):
    """The kubelet restarts (socket removed and made again) while the client is idle: the client's open channel
    points at the process that is gone. The next call must open a new one and succeed, not fail once first (found
    as a flake of the test above under CPU load: "Stream removed (sendmsg: Broken pipe)")."""
    for restart in range(5):
        assert await client.list() == expected_gpu(state["assignments"])
        channel_before = client._channel
        await kubelet.stop()
        await kubelet.start()
        assert await client.list() == expected_gpu(state["assignments"]), f"restart {restart}"
        # Without load the old channel usually reconnects in time, so the answer alone rarely fails: the new
        # channel is what makes it hold under load too.
        assert client._channel is not channel_before, f"restart {restart}: the old channel was reused"


@network
async def test_allocatable_lists_gpu_resources(socket_path):
    devices = [("nvidia.com/gpu", (G0, G1)), ("example.com/fpga", ("f0",)), ("nvidia.com/mig-1g.10gb", (MIG0,))]
    async with FakeKubelet(socket_path, lambda: [], allocatable_provider=lambda: devices):
        async with PodResourcesClient(socket_path) as c:
            result = await c.allocatable()
    assert result == tuple(AllocatableDevices(name, ids) for name, ids in devices if is_gpu_resource(name))


@network
async def test_missing_socket_raises_kubelet_unavailable_at_once(socket_path):
    timeout_s = 2.0
    async with PodResourcesClient(socket_path, timeout_s=timeout_s) as c:
        started = time.monotonic()
        with pytest.raises(KubeletUnavailable) as info:
            await c.list()
        elapsed = time.monotonic() - started
    assert isinstance(info.value, GpumeterError)
    assert elapsed < timeout_s / 10
    assert socket_path in str(info.value)


@network
async def test_path_that_is_not_a_socket_raises_kubelet_unavailable(socket_path):
    Path(socket_path).write_text("not a socket")
    async with PodResourcesClient(socket_path) as c:
        with pytest.raises(KubeletUnavailable):
            await c.list()


@network
async def test_stale_socket_raises_unavailable_fast(kubelet, socket_path):
    await kubelet.stop(leave_stale_socket=True)
    assert Path(socket_path).is_socket()
    timeout_s = 2.0
    async with PodResourcesClient(socket_path, timeout_s=timeout_s) as c:
        started = time.monotonic()
        with pytest.raises(KubeletUnavailable) as info:
            await c.list()
        elapsed = time.monotonic() - started
    assert info.value.status_code == "UNAVAILABLE"
    assert elapsed < timeout_s


@network
async def test_slow_kubelet_raises_within_timeout(kubelet, socket_path):
    timeout_s = 0.3
    kubelet.delay_s = 5.0
    async with PodResourcesClient(socket_path, timeout_s=timeout_s) as c:
        for call in (c.list, lambda: c.get("ml", "trainer-0")):
            started = time.monotonic()
            with pytest.raises(KubeletUnavailable) as info:
                await call()
            elapsed = time.monotonic() - started
            assert info.value.status_code == "DEADLINE_EXCEEDED"
            assert timeout_s * 0.9 <= elapsed < timeout_s + 1.0


@network
async def test_slow_but_within_timeout_succeeds(kubelet, socket_path, state):
    kubelet.delay_s = 0.05
    async with PodResourcesClient(socket_path, timeout_s=2.0) as c:
        assert await c.list() == expected_gpu(state["assignments"])


@network
async def test_kubelet_stop_and_restart(kubelet, client, state, socket_path):
    assert await client.list() == expected_gpu(state["assignments"])
    await kubelet.stop()
    with pytest.raises(KubeletUnavailable):
        await client.list()
    await kubelet.start()
    assert await client.list() == expected_gpu(state["assignments"])


@network
async def test_restart_after_crash_is_found_on_next_call(kubelet, client, state):
    await kubelet.stop(leave_stale_socket=True)
    with pytest.raises(KubeletUnavailable):
        await client.list()
    await kubelet.start()
    assert await client.list() == expected_gpu(state["assignments"])


@network
async def test_other_grpc_errors_are_typed_not_unavailable(socket_path):
    def broken():
        raise RuntimeError("provider failed")

    async with FakeKubelet(socket_path, broken):
        async with PodResourcesClient(socket_path) as c:
            with pytest.raises(PodResourcesError) as info:
                await c.list()
    assert not isinstance(info.value, KubeletUnavailable)
    assert info.value.status_code == "UNKNOWN"


@network
async def test_method_path_is_the_kubelets(kubelet, socket_path, state):
    # A raw call by path proves the wire name is /v1.PodResourcesLister/List, independent of our stub.
    async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
        call = channel.unary_unary(
            "/v1.PodResourcesLister/List",
            request_serializer=api_pb2.ListPodResourcesRequest.SerializeToString,
            response_deserializer=api_pb2.ListPodResourcesResponse.FromString,
        )
        response = await call(api_pb2.ListPodResourcesRequest(), timeout=2.0)
    pods = {(p.namespace, p.name) for p in response.pod_resources}
    assert pods == {(a[0], a[1]) for a in state["assignments"]}


def test_proto_package_and_service_names():
    assert api_pb2.DESCRIPTOR.package == "v1"
    service = api_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.full_name == "v1.PodResourcesLister"
    assert [m.name for m in service.methods] == ["List", "GetAllocatableResources", "Get"]


def test_proto_field_numbers_match_the_kubelet():
    def numbers(message):
        return {f.name: f.number for f in message.DESCRIPTOR.fields}

    assert numbers(api_pb2.PodResources) == {"name": 1, "namespace": 2, "containers": 3}
    assert numbers(api_pb2.ContainerResources) == {
        "name": 1,
        "devices": 2,
        "cpu_ids": 3,
        "memory": 4,
        "dynamic_resources": 5,
    }
    assert numbers(api_pb2.ContainerDevices) == {"resource_name": 1, "device_ids": 2, "topology": 3}
    assert numbers(api_pb2.GetPodResourcesRequest) == {"pod_name": 1, "pod_namespace": 2}
    assert numbers(api_pb2.DynamicResource) == {"claim_name": 2, "claim_namespace": 3, "claim_resources": 4}
    assert numbers(api_pb2.ClaimResource) == {"cdi_devices": 1, "driver_name": 2, "pool_name": 3, "device_name": 4}


def test_grpc_module_imports_its_pb2_sibling_relatively():
    source = Path(api_pb2_grpc.__file__).read_text()
    assert "from . import api_pb2 as" in source
    assert "from services" not in source


def test_unknown_fields_from_a_newer_kubelet_are_ignored():
    pod = build_pod_resources([("ml", "p", "c", "nvidia.com/gpu", (G0,))])[0]
    container_bytes = pod.containers[0].SerializeToString()
    # Field 6 (length-delimited), as a newer kubelet might add: tag (6 << 3 | 2) = 0x32.
    extra = bytes([0x32, 0x03]) + b"abc"
    parsed_container = api_pb2.ContainerResources.FromString(container_bytes + extra)
    newer_pod = api_pb2.PodResources(name=pod.name, namespace=pod.namespace)
    newer_pod.containers.append(parsed_container)
    assert assignments_from_pod(newer_pod) == assignments_from_pod(pod)
    assert assignments_from_pod(pod) == (ContainerDeviceAssignment("ml", "p", "c", "nvidia.com/gpu", (G0,)),)


def test_build_pod_resources_groups_by_pod_and_container():
    pods = build_pod_resources(ASSIGNMENTS)
    assert [(p.namespace, p.name) for p in pods] == list(dict.fromkeys((a[0], a[1]) for a in ASSIGNMENTS))
    trainer = pods[0]
    assert [c.name for c in trainer.containers] == ["main", "sidecar"]
    assert [d.resource_name for d in trainer.containers[0].devices] == ["nvidia.com/gpu", "example.com/fpga"]
    assert list(trainer.containers[1].devices) == []


def test_socket_path_too_long_is_a_config_error():
    long_path = "/tmp/" + "x" * 200 + "/kubelet.sock"
    with pytest.raises(ConfigError):
        PodResourcesClient(long_path)
    with pytest.raises(ConfigError):
        FakeKubelet(long_path, lambda: [])


def test_timeout_must_be_positive():
    with pytest.raises(ConfigError):
        PodResourcesClient("/tmp/k.sock", timeout_s=0)


async def test_get_needs_namespace_and_name():
    c = PodResourcesClient("/tmp/k.sock")
    with pytest.raises(ValueError):
        await c.get("", "pod")
    with pytest.raises(ValueError):
        await c.get("ns", "")


@network
async def test_fake_kubelet_refuses_to_replace_a_regular_file(socket_path):
    Path(socket_path).write_text("keep me")
    fake = FakeKubelet(socket_path, lambda: [])
    with pytest.raises(ConfigError):
        await fake.start()
    assert Path(socket_path).read_text() == "keep me"


@network
async def test_get_is_reprobed_after_many_fallbacks(kubelet, client, state, monkeypatch):
    import services.collector.podresources.client as client_module

    monkeypatch.setattr(client_module, "GET_REPROBE_AFTER_CALLS", 2)
    kubelet.serve_get = False
    for _ in range(2):
        assert await client.get("ml", "notebook") == expected_gpu(state["assignments"], "ml", "notebook")
    # One probe, then two answers by List: the reprobe budget is spent.
    assert (kubelet.calls["Get"], kubelet.calls["List"]) == (1, 2)
    kubelet.serve_get = True
    assert await client.get("ml", "notebook") == expected_gpu(state["assignments"], "ml", "notebook")
    assert (kubelet.calls["Get"], kubelet.calls["List"]) == (2, 2)
    assert client.get_served is True
