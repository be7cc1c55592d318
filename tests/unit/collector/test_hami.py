"""HAMi vGPU pods (Project-HAMi) are attributed to the GPU HAMi gave them, and priced by use.

HAMi's scheduler writes each pod's GPU on it (``hami.io/vgpu-devices-allocated``); its device plugin hands the
kubelet slot placeholders (``GPU-<uuid>-<n>``) that name no GPU. The collector reads the annotation
(``schemas.hami``) and drops the placeholders; the attributor time-shares a GPU held through HAMi, so each pod
pays for what it uses, never for its request nor the whole GPU. Checked through the real paths: the collector
against our kubelet and API server peers, and ``gpumeter replay`` of ``scenarios/hami.yaml`` against the
simulator's truth.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

from gpumeter.clock import ManualClock
from gpumeter.metrics import METRICS
from pipeline.recordings import scenario_records
from pipeline.replay import replay
from schemas.catalog import TopicCatalog
from schemas.devices import HAMI_RESOURCE, is_gpu_resource, is_hami_request_resource
from schemas.hami import (
    HAMI_ALLOCATED_ANNOTATION,
    HamiAnnotationError,
    HamiDevice,
    containers_of,
    is_hami_placeholder,
    parse_allocation,
)
from schemas.records import DeviceAssignment, PodEvent, PodEventType, SharingMode
from schemas.typed import codec_for
from services.attributor.modes import UnitAssignment, UnitKind, decide_mode
from services.collector.assemble import NodeFacts
from services.collector.podresources.client import PodResourcesClient
from services.collector.pods import (
    HAMI_ANNOTATION_IGNORED,
    HAMI_ANNOTATION_UNTRUSTED,
    pod_event_from_object,
    with_assignments,
    with_hami_checked,
)
from services.collector.podwatch import PodWatcher, make_api_client
from services.collector.service import CollectorService
from services.collector.simulation import SimulatedNode
from simulator.apiserver import make_pod_object
from simulator.scenario import ScenarioError, load_scenario

REPO = Path(__file__).resolve().parents[3]
SCENARIO = REPO / "scenarios" / "hami.yaml"
U0 = "GPU-0fc3eda5-e98b-a25b-5b0d-cf5c855d1448"
U1 = "GPU-5d2c1f3e-0a9b-4c8d-8e7f-6a5b4c3d2e1f"
UID = "0f6e4b2a-1c3d-4e5f-8a9b-0c1d2e3f4a5b"


# ---- the annotation format --------------------------------------------------------------------------------------

def test_one_container_one_device():
    assert parse_allocation(f"{U0},NVIDIA,3000,30:;") == ((HamiDevice(U0, "NVIDIA", 3000, 30),),)


def test_several_containers_several_devices_and_empty_segments_keep_their_places():
    value = f"{U0},NVIDIA,3000,30:{U1},NVIDIA,1024,0:;;{U1},NVIDIA,500,100:;"
    assert parse_allocation(value) == (
        (HamiDevice(U0, "NVIDIA", 3000, 30), HamiDevice(U1, "NVIDIA", 1024, 0)),
        (),
        (HamiDevice(U1, "NVIDIA", 500, 100),),
    )
    assert parse_allocation(";;") == ((), ())
    assert parse_allocation("") == ()


def test_fields_after_the_fourth_are_ignored_as_hamis_decoder_does():
    assert parse_allocation(f"{U0},NVIDIA,3000,30,extra:;") == ((HamiDevice(U0, "NVIDIA", 3000, 30),),)


@pytest.mark.parametrize("value", [
    f"{U0},NVIDIA,3000,30:",             # no segment terminator: cut short
    f"{U0},NVIDIA,3000,30;",             # no entry terminator
    f"{U0},NVIDIA,3000:;",               # a field missing
    f"{U0},NVIDIA,-1,30:;",              # negative memory
    f"{U0},NVIDIA,3000,101:;",           # more than every SM
    f"{U0},NVIDIA,2147483648,30:;",      # above int32
    f"{U0},NVIDIA,3e3,30:;",             # not a decimal integer
    f"{U0},NVIDIA, 3000,30:;",
    f"{U0},NVIDIA,03000,30:;",
    ",NVIDIA,3000,30:;",                # no uuid
    "0,NVIDIA,3000,30:;",               # an index, not a uuid
    "GPU-x[1-0],NVIDIA,3000,30:;",      # legacy MIG template suffix: not a uuid
    f"{U0},,3000,30:;",                  # no type
    f"{U0},NVIDIA,3000,30::;",           # an empty entry
    f"{U0},NVIDIA,3000,30:{U0},NVIDIA,1,1:;",  # the same GPU twice in one container
    "garbage",
])
def test_what_hami_would_not_write_is_refused_with_a_typed_error(value):
    with pytest.raises(HamiAnnotationError):
        parse_allocation(value)


def test_segments_belong_to_init_then_regular_containers_or_to_regular_ones_alone():
    a, b = (HamiDevice(U0, "NVIDIA", 1, 1),), (HamiDevice(U1, "NVIDIA", 2, 2),)
    assert containers_of((a, (), b), ["init"], ["main", "side"]) == {"init": a, "side": b}
    assert containers_of((a, b), ["init"], ["main", "side"]) == {"main": a, "side": b}  # HAMi before init support
    with pytest.raises(HamiAnnotationError):
        containers_of((a,), ["init"], ["main", "side"])


@pytest.mark.parametrize("device_id, placeholder", [
    (f"{U0}-0", True), (f"{U0}-9", True), (f"{U0}-1023", True),
    (U0, False), (f"{U0}::2", False),
    ("GPU-0fc3eda5-e98b-a25b-5b0d-123456789012", False),  # a uuid whose last group is all digits
    ("MIG-0fc3eda5-e98b-a25b-5b0d-cf5c855d1448-1", False), ("0", False),
])
def test_placeholders_are_told_from_device_ids(device_id, placeholder):
    assert is_hami_placeholder(device_id) is placeholder


def test_hami_quantities_are_requests_not_device_counts():
    assert is_gpu_resource(HAMI_RESOURCE) and is_gpu_resource("nvidia.com/gpu")
    for name in ("nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores"):
        assert is_hami_request_resource(name) and not is_gpu_resource(name)


# ---- the collector's pod events ---------------------------------------------------------------------------------

def _hami_pod(value: str | None, *, gpumem: str = "3000") -> dict:
    obj = make_pod_object("ml", "infer-0", UID, "node-1", containers=["main", "side"],
                          gpu_requests={"nvidia.com/gpu": 1, "nvidia.com/gpumem": gpumem, "nvidia.com/gpucores": 30},
                          annotations=None if value is None else {HAMI_ALLOCATED_ANNOTATION: value})
    return obj


def test_a_hami_pods_containers_hold_the_annotations_gpus_and_its_requests_are_kept():
    event = pod_event_from_object(_hami_pod(f"{U0.upper()},NVIDIA,3000,30:;;"), PodEventType.ADDED, "c", 1_000)
    main, side = event.containers
    assert main.assigned_devices == (DeviceAssignment(HAMI_RESOURCE, (U0,)),)  # canonical: hex lowercased
    assert side.assigned_devices == ()
    assert dict(main.gpu_requests) == {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000, "nvidia.com/gpucores": 30}
    assert dict(event.gpu_requests)["nvidia.com/gpu"] == 1  # 3000 MiB is not 3000 GPUs


def test_a_gpumem_in_bytes_is_an_amount_not_a_bad_pod():
    event = pod_event_from_object(_hami_pod(None, gpumem="3Gi"), PodEventType.ADDED, "c", 1_000)
    assert event.containers[0].gpu_requests["nvidia.com/gpumem"] == 3 << 30


def _published(event: PodEvent, kubelet: dict, **kwargs) -> tuple[PodEvent, tuple[str, ...]]:
    """What the collector publishes of ``event`` given the kubelet's ids per container (and its refusals)."""
    return with_hami_checked(with_assignments(event, kubelet), **kwargs)


def _held(event: PodEvent) -> dict[str, tuple[DeviceAssignment, ...]]:
    return {c.name: c.assigned_devices for c in event.containers if c.assigned_devices}


def test_the_kubelets_placeholders_back_the_annotation_and_give_way_to_it():
    event = pod_event_from_object(_hami_pod(f"{U0},NVIDIA,3000,30:;;"), PodEventType.ADDED, "c", 1_000)
    # The kubelet's slot is GPU 1's while HAMi gave GPU 0: the kubelet picks slots, HAMi's plugin ignores them.
    merged = with_assignments(event, {"main": (DeviceAssignment("nvidia.com/gpu", (f"{U1}-3",)),)})
    published, refusals = with_hami_checked(merged, node_units=(U0, U1))
    assert _held(published) == {"main": (DeviceAssignment(HAMI_RESOURCE, (U0,)),)} and refusals == ()
    # Applying the merged view's assignments again (a deletion) changes nothing.
    assert with_assignments(merged, {"main": merged.containers[0].assigned_devices}) == merged
    # NVML's list of the node's GPUs not read yet: the slots alone back the claim.
    assert with_hami_checked(merged)[0] == published


def test_a_whole_gpu_from_the_device_plugin_is_not_made_a_vgpu_by_an_annotation_naming_it():
    """The pod holds GPU 0 through the device plugin (a real id) and writes HAMi's annotation naming it: it
    would pay a vGPU's use instead of the whole GPU. The annotation is ignored and flagged."""
    event = pod_event_from_object(_hami_pod(f"{U0},NVIDIA,3000,30:;;"), PodEventType.ADDED, "c", 1_000)
    published, refusals = _published(event, {"main": (DeviceAssignment("nvidia.com/gpu", (U0,)),)})
    assert _held(published) == {"main": (DeviceAssignment("nvidia.com/gpu", (U0,)),)}
    assert len(refusals) == 1 and "ml/infer-0" in refusals[0] and "not HAMi slots" in refusals[0]


def test_an_annotation_naming_another_teams_gpu_makes_no_holder_of_it():
    """A pod without any GPU writes HAMi's annotation naming a GPU another pod holds whole: that GPU would be
    shared and its owner pay by use. The pod holds nothing; it is flagged once it runs, quietly refused before."""
    running = pod_event_from_object(_hami_pod(f"{U1},NVIDIA,1000,5:;;"), PodEventType.ADDED, "c", 1_000)
    assert running.phase == "Running"
    for kubelet in ({}, {"side": (DeviceAssignment("example.com/nic", ("nic-0",)),)}):
        published, refusals = _published(running, kubelet)
        assert not any(a.resource_name == HAMI_RESOURCE for c in published.containers for a in c.assigned_devices)
        assert len(refusals) == 1 and "no nvidia.com/gpu ids" in refusals[0]
    # Before its containers are given devices (Pending), or with the kubelet not answering, nothing is certain.
    obj = _hami_pod(f"{U1},NVIDIA,1000,5:;;")
    obj["status"]["phase"] = "Pending"
    pending = pod_event_from_object(obj, PodEventType.ADDED, "c", 1_000)
    assert _published(pending, {}) == (dataclasses.replace(pending, containers=tuple(
        dataclasses.replace(c, assigned_devices=()) for c in pending.containers)), ())
    assert _held(_published(running, {}, kubelet_answered=False)[0]) == {}
    assert _published(running, {}, kubelet_answered=False)[1] == ()
    # Its deletion is not flagged again.
    deleted = dataclasses.replace(running, event_type=PodEventType.DELETED)
    assert _published(deleted, {})[1] == ()


@pytest.mark.parametrize("kubelet_ids, claimed, reason", [
    ((f"{U0}-1", U1), f"{U0},NVIDIA,3000,30:", "not HAMi slots"),                    # a slot and a real GPU
    ((f"{U0}-1",), f"{U0},NVIDIA,3000,30:{U1},NVIDIA,3000,30:", "2 GPUs for the 1"),  # more GPUs than slots
    ((f"{U0}-1", f"{U0}-2"), f"{U0},NVIDIA,3000,30:", "1 GPUs for the 2"),            # fewer
    ((f"{U0}-1",), "GPU-0fc3eda5-e98b-a25b-5b0d-000000000000,NVIDIA,3000,30:", "this node does not have"),
])
def test_a_claim_the_slots_do_not_back_is_refused_and_flagged(kubelet_ids, claimed, reason):
    event = pod_event_from_object(_hami_pod(f"{claimed};;"), PodEventType.ADDED, "c", 1_000)
    published, refusals = _published(event, {"main": (DeviceAssignment("nvidia.com/gpu", kubelet_ids),)},
                                      node_units=(U0.upper(), U1))
    assert _held(published) == {"main": (DeviceAssignment("nvidia.com/gpu", kubelet_ids),)}
    assert len(refusals) == 1 and reason in refusals[0], refusals


class _Kubelet:
    """The PodResources client's interface, answering from ``items`` (no socket)."""

    def __init__(self, items):
        self.items = items

    async def list(self):
        return tuple(self.items)

    async def get(self, namespace, name):
        return tuple(i for i in self.items if (i.namespace, i.pod_name) == (namespace, name))


async def test_the_collector_publishes_only_claims_the_kubelet_backs_and_counts_the_rest():
    from gpumeter.metrics import ServiceMetrics
    from services.collector.podresources.client import ContainerDeviceAssignment

    items: list = []
    offered: list = []

    class _Publisher:
        def offer(self, record):
            offered.append(codec_for(PodEvent).decode(record.value))

    class _Backend:
        uuid_by_index = {"0": U0, "1": U1}

    metrics = ServiceMetrics("collector")
    clock = ManualClock(1_000)
    service = CollectorService(
        facts=NodeFacts("c", "node-1", "aws", "r", "t", "on_demand"), interval_seconds=1.0, clock=clock,
        backend=_Backend(), identities=None, publisher=_Publisher(), catalog=TopicCatalog(), kubelet=_Kubelet(items),
        metrics=metrics)
    untrusted = lambda: metrics.registry.get_sample_value(  # noqa: E731
        "gpumeter_collector_pod_warnings_total", {"reason": HAMI_ANNOTATION_UNTRUSTED}) or 0

    # A whole GPU through the device plugin, and HAMi's annotation naming it.
    items.append(ContainerDeviceAssignment("ml", "infer-0", "main", "nvidia.com/gpu", (U0,)))
    forged = pod_event_from_object(_hami_pod(f"{U0},NVIDIA,3000,30:;;"), PodEventType.ADDED, "c", 1_000)
    await service.on_pod_event(forged)
    assert _held(offered[-1]) == {"main": (DeviceAssignment("nvidia.com/gpu", (U0,)),)}
    assert untrusted() == 1
    await service.refresh_assignments()
    assert len(offered) == 1 and untrusted() == 1, "unchanged: neither republished nor counted again"

    # A real HAMi pod seen before the kubelet has its slot: quietly without its GPU, then with it.
    obj = make_pod_object("ml", "vgpu-0", "1f6e4b2a-1c3d-4e5f-8a9b-0c1d2e3f4a5b", "node-1", phase="Pending",
                          annotations={HAMI_ALLOCATED_ANNOTATION: f"{U1},NVIDIA,3000,30:;"})
    await service.on_pod_event(pod_event_from_object(obj, PodEventType.ADDED, "c", 1_000))
    assert _held(offered[-1]) == {} and untrusted() == 1
    items.append(ContainerDeviceAssignment("ml", "vgpu-0", "main", "nvidia.com/gpu", (f"{U0}-4",)))
    clock.advance_ms(500)
    await service.refresh_assignments()
    assert offered[-1].name == "vgpu-0" and offered[-1].event_type is PodEventType.MODIFIED
    assert _held(offered[-1]) == {"main": (DeviceAssignment(HAMI_RESOURCE, (U1,)),)}
    # Its deletion keeps the GPU it held.
    await service.on_pod_event(pod_event_from_object(obj, PodEventType.DELETED, "c", 2_000))
    assert _held(offered[-1]) == {"main": (DeviceAssignment(HAMI_RESOURCE, (U1,)),)}
    assert untrusted() == 1


@pytest.mark.parametrize("value", [f"{U0},NVIDIA,3000,30:", f"{U0},NVIDIA,x,30:;;", f"{U0},NVIDIA,3000,30:;"])
def test_a_broken_annotation_is_ignored_with_a_counted_warning_and_the_pod_still_published(value):
    warnings: list[tuple[str, str]] = []
    event = pod_event_from_object(_hami_pod(value), PodEventType.ADDED, "c", 1_000,
                                  on_warning=lambda code, detail: warnings.append((code, detail)))
    assert [code for code, _ in warnings] == [HAMI_ANNOTATION_IGNORED]
    assert "ml/infer-0" in warnings[0][1] and HAMI_ALLOCATED_ANNOTATION in warnings[0][1]
    assert all(not c.assigned_devices for c in event.containers)
    assert event.name == "infer-0" and event.containers[0].gpu_requests["nvidia.com/gpu"] == 1
    # Without a reader of warnings it is ignored all the same.
    assert pod_event_from_object(_hami_pod(value), PodEventType.ADDED, "c", 1_000) == event


def test_a_long_allocation_is_read_whole_before_annotations_are_cut():
    containers = [f"c{i}" for i in range(20)]
    obj = make_pod_object("ml", "wide-0", UID, "node-1", containers=containers)
    value = "".join(f"{U0},NVIDIA,{100 + i},5:;" for i in range(20))
    assert len(value) > 1024
    obj["metadata"]["annotations"] = {HAMI_ALLOCATED_ANNOTATION: value}
    event = pod_event_from_object(obj, PodEventType.ADDED, "c", 1_000)
    assert event.truncated  # the annotation itself was cut in the event ...
    assert [c.assigned_devices for c in event.containers] == [(DeviceAssignment(HAMI_RESOURCE, (U0,)),)] * 20


# ---- the sharing mode -------------------------------------------------------------------------------------------

def test_a_gpu_held_through_hami_is_time_shared_even_by_one_pod():
    alone = decide_mode(UnitKind.GPU, SharingMode.EXCLUSIVE, 1, [UnitAssignment("p", (HAMI_RESOURCE,), (U0,))])
    assert (alone.mode, alone.dedicated_owner, alone.conflict) == (SharingMode.TIME_SLICING, None, False)
    assert "HAMi" in alone.evidence
    three = decide_mode(UnitKind.GPU, SharingMode.EXCLUSIVE, 1,
                        [UnitAssignment(p, (HAMI_RESOURCE,), (U0,)) for p in ("a", "b", "c")])
    assert (three.mode, three.dedicated_owner, three.conflict) == (SharingMode.TIME_SLICING, None, False)
    mixed = decide_mode(UnitKind.GPU, SharingMode.EXCLUSIVE, 1, [
        UnitAssignment("a", (HAMI_RESOURCE,), (U0,)), UnitAssignment("b", ("nvidia.com/gpu",), (U0,))])
    assert (mixed.mode, mixed.dedicated_owner, mixed.conflict) == (SharingMode.TIME_SLICING, None, True)


# ---- the simulator's HAMi pods ----------------------------------------------------------------------------------

def test_the_scenario_serves_the_annotation_hami_requests_and_placeholders():
    scenario = load_scenario(SCENARIO)
    gpus = scenario.nodes[0].gpus
    notebook = next(p for p in scenario.pods if p.name == "notebook-li")
    assert notebook.annotations[HAMI_ALLOCATED_ANNOTATION] == f"{gpus[0].uuid},NVIDIA,4000,20:;"
    (jupyter,) = notebook.containers
    assert [a.device_id for a in jupyter.devices] == [f"{gpus[1].uuid}-0"]  # a slot of GPU 1
    assert dict(jupyter.requests) == {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 4000, "nvidia.com/gpucores": 20}
    chat = next(p for p in scenario.pods if p.name == "chat-api-0")
    assert chat.annotations[HAMI_ALLOCATED_ANNOTATION] == f"{gpus[0].uuid},NVIDIA,8000,20:;;"  # metrics: empty


def test_a_scenario_hami_gpu_must_not_be_shared_by_the_device_plugin():
    text = SCENARIO.read_text().replace("sharing: {mode: exclusive}", "sharing: {mode: time_slicing, replicas: 4}")
    with pytest.raises(ScenarioError, match="HAMi"):
        load_scenario(text)


def test_a_scenario_can_forge_the_annotation_and_the_collector_ignores_it():
    text = SCENARIO.read_text().replace(
        "labels: {team: research, model: none}",
        f"labels: {{team: research, model: none}}\n    annotations: {{{HAMI_ALLOCATED_ANNOTATION}: 'GPU-x,NVIDIA'}}")
    scenario = load_scenario(text)
    events = [r.message for r in scenario_records(scenario) if isinstance(r.message, PodEvent)]
    notebook = next(e for e in events if e.name == "notebook-li")
    # Ignored: the kubelet's placeholder stays, naming no GPU; the pod is still billed by its processes.
    assert [a.resource_name for c in notebook.containers for a in c.assigned_devices] == ["nvidia.com/gpu"]


# Two forgeries of HAMi's annotation on a node without HAMi: whole-0 holds GPU 0 through the device plugin and
# names it (a vGPU would pay its use, ~10 %, instead of the GPU); forger-0 holds no GPU and names GPU 1, which
# owner-0 holds whole (GPU 1 would be "shared" and owner-0 pay its use, ~20 %, instead of the GPU).
FORGED = SCENARIO.read_text().split("pods:")[0].replace("cluster: sim-hami", "cluster: sim-hami-forged") + """pods:
  - namespace: search
    name: whole-0
    node: gpu-g5-12xl-hami
    labels: {team: search}
    containers:
      - name: worker
        devices: [{resource: nvidia.com/gpu, gpu: 0}]
        hami_forged_annotation: {gpu: 0, memory_mib: 3000, cores_percent: 10}
        processes:
          - name: python3
            memory: {bytes: 2GiB}
            compute: 0.1
  - namespace: chat
    name: owner-0
    node: gpu-g5-12xl-hami
    labels: {team: assistants}
    containers:
      - name: server
        devices: [{resource: nvidia.com/gpu, gpu: 1}]
        processes:
          - name: python3
            memory: {bytes: 4GiB}
            compute: 0.24
  - namespace: search
    name: forger-0
    node: gpu-g5-12xl-hami
    labels: {team: search}
    containers:
      - name: idle
        hami_forged_annotation: {gpu: 1, memory_mib: 1000, cores_percent: 5}
"""


def test_a_scenario_writes_hamis_annotation_for_a_container_that_keeps_its_own_devices():
    scenario = load_scenario(FORGED)
    gpus = scenario.nodes[0].gpus
    whole = next(p for p in scenario.pods if p.name == "whole-0")
    assert whole.annotations[HAMI_ALLOCATED_ANNOTATION] == f"{gpus[0].uuid},NVIDIA,3000,10:;"
    assert [a.device_id for a in whole.containers[0].devices] == [gpus[0].uuid]
    assert dict(whole.containers[0].requests) == {"nvidia.com/gpu": 1}
    forger = next(p for p in scenario.pods if p.name == "forger-0")
    assert forger.annotations[HAMI_ALLOCATED_ANNOTATION] == f"{gpus[1].uuid},NVIDIA,1000,5:;"
    assert forger.containers[0].devices == () and dict(forger.containers[0].requests) == {}
    with pytest.raises(ScenarioError, match="not both"):
        load_scenario(SCENARIO.read_text().replace(
            "hami: {gpu: 1, memory_mib: 6000, cores_percent: 25}",
            "hami: {gpu: 1, memory_mib: 6000, cores_percent: 25}\n        hami_forged_annotation: {gpu: 2, memory_mib: 1}"))


def test_forged_annotations_neither_discount_a_whole_gpu_nor_share_another_teams(tmp_path):
    path = tmp_path / "forged.yaml"
    path.write_text(FORGED)
    summary = replay(path, tmp_path / "out")
    assert summary.share_rows > 0 and summary.dead_letters == {}
    gpus = load_scenario(FORGED).nodes[0].gpus
    costs = _jsonl(tmp_path / "out" / "costs.jsonl")
    by_gpu_window: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in costs:
        by_gpu_window[(row["gpu_uuid"], row["window_start"])].append(row)
    windows = {w for _, w in by_gpu_window}
    assert len(windows) >= 2
    for (gpu, window), rows in by_gpu_window.items():
        owner = {gpus[0].uuid: "whole-0", gpus[1].uuid: "owner-0"}.get(gpu)
        if owner is None:
            continue
        # The owner rule: the GPU's whole cost, not its use.
        assert all(r["sharing_method"] is None and r["method"] == "exclusive" for r in rows), rows
        (paid,) = [r for r in rows if r["pod"] == owner]
        assert paid["cost_share"] == 1.0
        assert paid["cost_micro_usd"] == sum(r["cost_micro_usd"] for r in rows) > 0
    assert not [r for r in costs if r["pod"] == "forger-0"]
    # The collector published each pod with the kubelet's ids alone.
    events = [r.message for r in scenario_records(load_scenario(FORGED)) if isinstance(r.message, PodEvent)]
    assert {e.name: {a.resource_name for c in e.containers for a in c.assigned_devices} for e in events} == {
        "whole-0": {"nvidia.com/gpu"}, "owner-0": {"nvidia.com/gpu"}, "forger-0": set()}


def _assignments_by_pod(events) -> dict[str, tuple]:
    return {e.name: tuple((c.name, c.assigned_devices) for c in e.containers) for e in events}


def test_replays_collector_path_attributes_each_pod_to_its_annotations_gpu():
    scenario = load_scenario(SCENARIO)
    gpus = scenario.nodes[0].gpus
    events = [r.message for r in scenario_records(scenario) if isinstance(r.message, PodEvent)]
    held = {name: {d for _, assigned in containers for a in assigned for d in a.device_ids}
            for name, containers in _assignments_by_pod(events).items()}
    assert held == {"embed-batch-0": {gpus[0].uuid}, "chat-api-0": {gpus[0].uuid},
                    "notebook-li": {gpus[0].uuid}, "translate-0": {gpus[1].uuid}}


@pytest.mark.network
async def test_hami_pods_through_our_kubelet_and_api_server_peers_hold_the_annotations_gpus():
    scenario = load_scenario(SCENARIO)
    node_name = scenario.nodes[0].name
    workdir = Path(tempfile.mkdtemp(dir="/tmp"))
    node = SimulatedNode(scenario, node_name, time_scale=1.0, workdir=workdir)
    await node.start()
    client = PodResourcesClient(node.kubelet_socket, 1.0)
    offered = []

    class _Publisher:
        def offer(self, record):
            offered.append(record)

    service = CollectorService(
        facts=NodeFacts(scenario.cluster, node_name, "aws", "us-east-1", "g5.12xlarge", "on_demand"),
        interval_seconds=10.0, clock=ManualClock(scenario.start_unix_ms), backend=node.backend, identities=None,
        publisher=_Publisher(), catalog=TopicCatalog(), kubelet=client)
    api = make_api_client(node.apiserver.url, None, None, True)
    warnings: list[str] = []
    watcher = PodWatcher(api, node_name, scenario.cluster, ManualClock(scenario.start_unix_ms),
                         service.on_pod_event, on_pod_warning=warnings.append)
    task = asyncio.create_task(watcher.run())
    try:
        for _ in range(500):
            if watcher.has_synced and len(offered) >= len(scenario.pods):
                break
            await asyncio.sleep(0.01)
        kubelet_ids = {d for a in await client.list() for d in a.device_ids}
        published_before_refresh = len(offered)
        await service.refresh_assignments()
        assert len(offered) == published_before_refresh, "the placeholders dropped again are no change"
        # A forged annotation served by the API server: the pod is published, the annotation counted, ignored.
        forged = _hami_pod("GPU-x,NVIDIA,1,1:;")
        forged["spec"]["nodeName"] = node_name
        node.apiserver.add_pod(forged)
        for _ in range(500):
            if any(codec_for(PodEvent).decode(r.value).name == "infer-0" for r in offered):
                break
            await asyncio.sleep(0.01)
        # A deleted HAMi pod keeps the annotation's GPU in its deletion event.
        chat = next(p for p in scenario.pods if p.name == "chat-api-0")
        node.apiserver.delete_pod(chat.uid)
        for _ in range(500):
            if any(codec_for(PodEvent).decode(r.value).event_type is PodEventType.DELETED for r in offered):
                break
            await asyncio.sleep(0.01)
    finally:
        await watcher.stop()
        await task
        await api.close()
        await client.close()
        await node.stop()
    gpus = scenario.nodes[0].gpus
    assert kubelet_ids and all(is_hami_placeholder(d) for d in kubelet_ids), kubelet_ids
    assert f"{gpus[1].uuid}-0" in kubelet_ids  # notebook-li's slot is GPU 1's
    published = {}
    for record in offered:
        event = codec_for(PodEvent).decode(record.value)
        published[event.name] = event
    assert warnings == [HAMI_ANNOTATION_IGNORED]
    assert "gpumeter_collector_pod_warnings_total" in METRICS
    infer = published.pop("infer-0")
    assert all(not c.assigned_devices for c in infer.containers)
    deleted = published["chat-api-0"]
    assert deleted.event_type is PodEventType.DELETED
    assert deleted.containers[0].assigned_devices == (DeviceAssignment(HAMI_RESOURCE, (gpus[0].uuid,)),)
    by_peers = _assignments_by_pod(published.values())
    assert by_peers["notebook-li"] == (("jupyter", (DeviceAssignment(HAMI_RESOURCE, (gpus[0].uuid,)),)),)
    assert by_peers["translate-0"] == (("server", (DeviceAssignment(HAMI_RESOURCE, (gpus[1].uuid,)),)),)
    # The same assignments as replay's collector path publishes.
    replayed = [r.message for r in scenario_records(scenario) if isinstance(r.message, PodEvent)]
    assert by_peers == _assignments_by_pod(replayed)


# ---- priced by use ----------------------------------------------------------------------------------------------

def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_hami_pods_are_priced_by_use_and_match_the_truth(tmp_path):
    summary = replay(SCENARIO, tmp_path)
    assert summary.share_rows > 0 and summary.dead_letters == {}
    scenario = load_scenario(SCENARIO)
    gpus = scenario.nodes[0].gpus
    shares = _jsonl(tmp_path / "shares.jsonl")
    truth = {(t["window_start_unix_ms"], t["gpu_uuid"], t["pod_uid"]): t for t in _jsonl(tmp_path / "truth.jsonl")}
    uid_of = {p.name: p.uid for p in scenario.pods}
    by_unit: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for row in shares:
        by_unit[(row["window_start_unix_ms"], row["gpu_uuid"])].append(row)
    windows = sorted({w for w, _ in by_unit})
    assert len(windows) >= 2
    for (window, unit), rows in by_unit.items():
        for key in ("memory_share", "compute_share", "cost_share"):
            assert sum(r[key] for r in rows) == pytest.approx(1.0, abs=1e-9)
        pods = {r["pod"]: r for r in rows if r["subject_kind"].lower() == "pod"}
        if unit == gpus[0].uuid:
            assert set(pods) == {"embed-batch-0", "chat-api-0", "notebook-li"}
            assert all(r["sharing_mode"].lower() == "time_slicing" for r in rows)
            # chat-api asked for half of embed-batch's memory and a third of its SMs and used most: it pays most.
            assert pods["chat-api-0"]["cost_share"] > pods["embed-batch-0"]["cost_share"] * 3
            assert pods["chat-api-0"]["cost_share"] > pods["notebook-li"]["cost_share"]
        elif unit == gpus[1].uuid:
            # Alone with a 25 % vGPU: it pays its use, the rest of the GPU is idle -- never the whole GPU.
            assert set(pods) == {"translate-0"}
            assert pods["translate-0"]["sharing_mode"].lower() == "time_slicing"
            assert 0.1 < pods["translate-0"]["cost_share"] < 0.25
            assert next(r for r in rows if r["subject_kind"].lower() == "idle")["cost_share"] > 0.7
        else:
            assert pods == {}
        for name, row in pods.items():
            true = truth[(window, unit, uid_of[name])]
            assert row["memory_share"] == pytest.approx(true["true_memory_share"], abs=1e-9)
            assert row["compute_share"] == pytest.approx(true["true_compute_share"], abs=0.03)
    # notebook-li's kubelet slot was GPU 1's: no row of GPU 1 is hers.
    assert not [r for r in shares if r["gpu_uuid"] == gpus[1].uuid and r["pod"] == "notebook-li"]
