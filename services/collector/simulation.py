"""Simulate mode: the collector's real code against simulated peers, fed by one scenario.

Two shapes share the same parts:

* ``SimulatedNode`` (async, ``gpumeter collector --simulate``): the real ``NvmlBackend`` over pynvml on the
  simulated library (``simulator.nvml_driver``), the real cgroup reader over a fake proc root the world writes, the real PodResources client against our gRPC
  ``FakeKubelet``, and the real pod watch against our ``FakeApiServer``. Time runs ``time_scale`` times faster
  than the wall clock, from the scenario's start.
* ``node_streams`` (sync, for ``gpumeter replay``): the same backend, cgroup reader, pod parser and assembly
  ticked through the scenario with a manual clock — no sockets, deterministic.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from gpumeter.clock import Clock, ManualClock, SystemClock
from schemas.records import NodeSample, PodEvent, PodEventType, SharingMode
from services.collector.assemble import NodeFacts, TickInfo, assemble_node_sample
from services.collector.cgroup import ProcessIdentityCache
from services.collector.dra import resolve_claim_devices, slice_devices
from services.collector.nodefacts import NodeFactOverrides, node_facts_from_node
from services.collector.nvml_backend import NvmlBackend
from services.collector.namespaces import namespace_event_from_object, with_namespace_labels
from services.collector.pods import (
    pod_event_from_object,
    with_assignments,
    with_devices_resolved,
    with_hami_checked,
)
from services.collector.podresources.client import ContainerClaimDevice
from simulator import dra as sim_dra
from simulator.apiserver import make_namespace_object, make_node_object, make_pod_object
from simulator.nvml_driver import simulated_pynvml
from simulator.scenario import NamespaceSpec, NodeSpec, Scenario
from simulator.world import SimPod, SimWorld

_MODES = {
    "exclusive": SharingMode.EXCLUSIVE,
    "time_slicing": SharingMode.TIME_SLICING,
    "mps": SharingMode.MPS,
    "mig": SharingMode.MIG,
}


class ScaledClock:
    """Scenario time: starts at ``start_ms`` and runs ``scale`` times as fast as ``base``."""

    def __init__(self, start_ms: int, scale: float, base: Clock | None = None) -> None:
        self._base = base or SystemClock()
        self._origin_s = self._base.monotonic_s()
        self._start_ms = start_ms
        self._scale = scale

    def now_ms(self) -> int:
        return self._start_ms + int((self._base.monotonic_s() - self._origin_s) * 1000 * self._scale)

    def monotonic_s(self) -> float:
        return self.now_ms() / 1000.0


def node_object(node: NodeSpec) -> dict:
    """The scenario node as the Kubernetes API server would serialise its Node object."""
    return make_node_object(node.name, provider=node.cloud_provider, region=node.region, zone=node.zone,
                            instance_type=node.instance_type, price_model=node.price_model,
                            provider_id=node.provider_id, labels=node.labels)


def node_overrides(node: NodeSpec) -> NodeFactOverrides:
    """What the node's collector ConfigMap must say because the Node object cannot: the provider of a node
    without a cloud providerID, and a committed-use price where the provider has no label for it."""
    return NodeFactOverrides(
        cloud_provider=node.cloud_provider if not node.provider_id else None,
        price_model=node.price_model if node.price_model == "committed" and node.cloud_provider != "aws" else None,
    )


def node_facts(scenario: Scenario, node: NodeSpec) -> NodeFacts:
    """The facts the collector derives for ``node``: from its Node object, with its ConfigMap's overrides."""
    return node_facts_from_node(scenario.cluster, node.name, node_object(node), node_overrides(node)).facts


def sharing_config(node: NodeSpec) -> dict[str, tuple[SharingMode, int]]:
    """What the node's device-plugin configuration tells the collector (NVML cannot tell time-slicing apart)."""
    return {gpu.uuid: (_MODES[gpu.sharing.mode], gpu.sharing.replicas) for gpu in node.gpus}


def pod_object(pod: SimPod) -> dict:
    """The simulated pod as the Kubernetes API server would serialise it."""
    first = pod.containers[0]
    obj = make_pod_object(
        pod.namespace, pod.name, pod.uid, pod.node_name,
        labels=pod.labels, annotations=pod.annotations,
        gpu_requests=first.gpu_requests, container_ids=[c.container_id for c in pod.containers],
        env=first.env, owner=(pod.owner_kind, pod.owner_name) if pod.owner_kind and pod.owner_name else None,
        privileged=first.privileged, containers=[c.name for c in pod.containers],
        started_at_unix_ms=pod.started_at_unix_ms,
    )
    # make_pod_object puts requests/env on the first container only; give every container its own.
    for spec_container, container in zip(obj["spec"]["containers"], pod.containers):
        if container is first:
            continue
        limits = {name: str(count) for name, count in container.gpu_requests.items()}
        if limits:
            resources = spec_container.setdefault("resources", {})
            resources.setdefault("limits", {}).update(limits)
            resources.setdefault("requests", {}).update(limits)
        if container.env:
            spec_container["env"] = [{"name": k, "value": v} for k, v in container.env.items()]
        if container.privileged:
            spec_container.setdefault("securityContext", {})["privileged"] = True
    # DRA: the pod names its ResourceClaims, and each container the claims it uses.
    claims = list(dict.fromkeys(d.claim for c in pod.containers for d in c.claim_devices))
    if claims:
        obj["spec"]["resourceClaims"] = [{"name": claim, "resourceClaimName": claim} for claim in claims]
        for spec_container, container in zip(obj["spec"]["containers"], pod.containers):
            used = list(dict.fromkeys(d.claim for d in container.claim_devices))
            if used:
                spec_container.setdefault("resources", {})["claims"] = [{"name": claim} for claim in used]
    return obj


def kubelet_assignments(pods: tuple[SimPod, ...], scenario: Scenario | None = None, node: NodeSpec | None = None):
    """What the kubelet's PodResources List returns for ``pods``: device-plugin devices, and on a DRA ``node`` the
    claim devices (``dynamic_resources``)."""
    plugin = tuple(
        (pod.namespace, pod.name, container.name, assignment.resource_name, tuple(assignment.device_ids))
        for pod in pods
        for container in pod.containers
        for assignment in container.assigned_devices
    )
    if scenario is None or node is None or node.allocation != "dra":
        return plugin
    return plugin + tuple(sim_dra.dynamic_assignments(scenario.seed, node, pods))


def dra_assignments(scenario: Scenario, node: NodeSpec, pods: tuple[SimPod, ...]):
    """(namespace, pod) → container → DeviceAssignments of the claim devices of ``pods``, resolved by the
    collector's own ``services.collector.dra`` rules over the node's ResourceSlices and the claims."""
    if node.allocation != "dra":
        return {}
    items = [ContainerClaimDevice(a.namespace, a.pod_name, a.container_name, a.claim_namespace, a.claim_name,
                                  a.driver_name, a.pool_name, a.device_name, a.cdi_ids)
             for a in sim_dra.dynamic_assignments(scenario.seed, node, pods)]
    grouped, _ = resolve_claim_devices(items, slice_devices(sim_dra.resource_slices(node), node.name),
                                       sim_dra.claims_for(scenario.seed, node, pods))
    return grouped


def namespace_object(namespace: NamespaceSpec) -> dict:
    """The scenario's namespace as the Kubernetes API server would serialise its Namespace object."""
    return make_namespace_object(namespace.name, namespace.labels)


def _pod_event(pod: SimPod, event_type: PodEventType, scenario: Scenario, now_ms: int,
               claimed: Mapping[str, tuple] | None = None) -> PodEvent:
    event = pod_event_from_object(pod_object(pod), event_type, scenario.cluster, now_ms)
    assignments = {c.name: c.assigned_devices for c in pod.containers if c.assigned_devices}
    for container, devices in (claimed or {}).items():
        assignments[container] = tuple(assignments.get(container, ())) + tuple(devices)
    # The labels of the Namespace object, read as the collector's namespace watch reads them.
    labels = namespace_event_from_object(namespace_object(_namespace_spec(scenario, pod.namespace)), event_type,
                                         now_ms).labels
    return with_namespace_labels(with_assignments(event, assignments), labels)


def _namespace_spec(scenario: Scenario, name: str) -> NamespaceSpec:
    return NamespaceSpec(name, scenario.namespace_labels(name))


@dataclass(frozen=True)
class SimulatedTick:
    sampled_at_unix_ms: int
    sample: NodeSample
    pod_events: tuple[PodEvent, ...]
    # ``SimWorld.truth`` of the node at the tick (``node_streams(with_truth=True)``; None otherwise)
    truth: tuple | None = None


def node_streams(scenario: Scenario, node_name: str, proc_root: Path | None = None, *,
                 with_truth: bool = False) -> Iterator[SimulatedTick]:
    """Every tick of ``node_name`` through the collector's own sampling code, with the pod events that precede
    it (ADDED when a pod appears, DELETED when it is gone). Deterministic for a scenario. ``with_truth``: each
    tick also carries ``SimWorld.truth`` of the node at the tick's (scenario) time, taken while the world has
    that instant's GPUs computed for the NVML calls."""
    node = scenario.node(node_name)
    world = SimWorld(scenario)
    clock = ManualClock(scenario.start_unix_ms)
    backend = NvmlBackend(simulated_pynvml(world, clock, node_name), clock, sharing_by_gpu_uuid=sharing_config(node))
    owned_root = proc_root is None
    root = Path(tempfile.mkdtemp(prefix="gpumeter-proc-")) if owned_root else proc_root
    identities = ProcessIdentityCache(root)
    facts = node_facts(scenario, node)
    interval_ms = int(round(scenario.interval_seconds * 1000))
    skew_ms = node.clock_offset_seconds * 1000
    known: dict[str, SimPod] = {}
    # DRA pods' claim devices as last published: they change as the pods sharing a claim come and go, and the
    # collector republishes a pod whose devices changed (MODIFIED), as its kubelet refresh does.
    claimed: dict[str, Mapping[str, tuple]] = {}
    previous_ms: int | None = None
    try:
        for sequence, now_ms in enumerate(scenario.tick_times_ms()):
            clock.set_ms(now_ms)
            world.step(now_ms)
            world.write_proc(root, node_name)
            events = []
            running = world.pods_at(now_ms, node_name)
            current = {pod.uid: pod for pod in running}
            by_pod = dra_assignments(scenario, node, running)
            # Deletions first, as the API server orders them: a pod recreated under its name (a StatefulSet's) is
            # deleted before its successor can be created.
            for uid, pod in known.items():
                if uid not in current:
                    events.append(_pod_event(pod, PodEventType.DELETED, scenario, now_ms,
                                             claimed.pop(uid, None)))
            for uid, pod in current.items():
                now_claimed = by_pod.get((pod.namespace, pod.name), {})
                if uid not in known:
                    events.append(_pod_event(pod, PodEventType.ADDED, scenario, now_ms, now_claimed))
                elif now_claimed != claimed.get(uid, {}):
                    events.append(_pod_event(pod, PodEventType.MODIFIED, scenario, now_ms, now_claimed))
                if now_claimed:
                    claimed[uid] = now_claimed
            known = current
            reading = backend.read()
            # As the collector publishes them: device ids in uuid form, whatever the device plugin's id strategy,
            # and only the HAMi claims the kubelet's ids back.
            events = [with_hami_checked(with_devices_resolved(e, backend.uuid_by_index),
                                        node_units=backend.uuid_by_index.values())[0] for e in events]
            sample = assemble_node_sample(
                facts,
                TickInfo(sequence, scenario.start_unix_ms, now_ms,
                         interval_ms if previous_ms is None else now_ms - previous_ms),
                reading.devices,
                identities.lookup,
                reading.node_errors,
            )
            previous_ms = now_ms
            identities.retain_only(pid for device in reading.devices for pid in device.process_pids)
            if skew_ms:
                sample, events = _on_node_clock(sample, events, skew_ms)
            yield SimulatedTick(now_ms, sample, tuple(events),
                                world.truth(now_ms, node_name) if with_truth else None)
    finally:
        if owned_root:
            shutil.rmtree(root, ignore_errors=True)


def _on_node_clock(sample: NodeSample, events: list[PodEvent], skew_ms: int) -> tuple[NodeSample, list[PodEvent]]:
    """The tick and pod events as a node whose clock is ``skew_ms`` off stamps them (``NodeSpec.clock_offset_seconds``):
    its collector's times and its kubelet's (a pod's start) read that much off; ``SimulatedTick.sampled_at_unix_ms``
    stays the scenario's time, when the broker appends them."""
    sample = dataclasses.replace(sample, sampled_at_unix_ms=sample.sampled_at_unix_ms + skew_ms,
                                 collector_started_at_unix_ms=sample.collector_started_at_unix_ms + skew_ms)
    events = [dataclasses.replace(e, observed_at_unix_ms=e.observed_at_unix_ms + skew_ms,
                                  started_at_unix_ms=None if e.started_at_unix_ms is None
                                  else e.started_at_unix_ms + skew_ms) for e in events]
    return sample, events


class SimulatedNode:
    """The simulated peers of one collector process: fake proc root, FakeKubelet, FakeApiServer, the simulated
    NVML library."""

    def __init__(self, scenario: Scenario, node_name: str, time_scale: float, workdir: Path) -> None:
        from simulator.apiserver import FakeApiServer
        from simulator.kubelet import FakeKubelet

        self.scenario = scenario
        self.node = scenario.node(node_name)
        self.world = SimWorld(scenario)
        self.clock = ScaledClock(scenario.start_unix_ms, time_scale)
        self.workdir = workdir
        self.proc_root = workdir / "proc"
        self.proc_root.mkdir(parents=True, exist_ok=True)
        self.kubelet_socket = workdir / "kubelet.sock"
        self._pods: tuple[SimPod, ...] = ()
        self.kubelet = FakeKubelet(str(self.kubelet_socket),
                                   lambda: kubelet_assignments(self._pods, self.scenario, self.node))
        self.apiserver = FakeApiServer()
        self._served: dict[str, SimPod] = {}
        self._claims: dict[tuple[str, str], dict] = {}
        self._api_started = False
        self.backend = NvmlBackend(simulated_pynvml(self.world, self.clock, node_name), self.clock,
                                   sharing_by_gpu_uuid=sharing_config(self.node))

    @property
    def overrides(self) -> NodeFactOverrides:
        return node_overrides(self.node)

    async def start(self) -> None:
        await self.kubelet.start()
        self.apiserver.put_node(node_object(self.node))
        for namespace in self.scenario.all_namespaces():
            self.apiserver.add_namespace(namespace_object(namespace))
        if self.node.allocation == "dra":
            for obj in sim_dra.resource_slices(self.node):
                self.apiserver.put_resource_slice(obj)
        await self.apiserver.start()
        self._api_started = True
        await self.sync(self.clock.now_ms())

    async def stop(self) -> None:
        await self.apiserver.stop()
        await self.kubelet.stop()

    async def sync(self, now_ms: int) -> None:
        """Bring the simulated node to ``now_ms``: processes, proc files, kubelet and API server contents."""
        self.world.step(max(now_ms, self.scenario.start_unix_ms))
        self.world.write_proc(self.proc_root, self.node.name)
        self._pods = self.world.pods_at(now_ms, self.node.name)
        current = {pod.uid: pod for pod in self._pods}
        if not self._api_started:
            return
        # Deletions first: the API server refuses a pod whose name a live pod holds (a recreated StatefulSet pod).
        # As on a real server, where the kubelet deletes a stopped pod with gracePeriodSeconds=0: the pod is marked
        # (MODIFIED, deletionTimestamp), then removed (DELETED).
        for uid in list(self._served):
            if uid not in current:
                self.apiserver.mark_pod_deleting(uid, at_unix_ms=now_ms)
                self.apiserver.delete_pod(uid)
        for uid, pod in current.items():
            if uid not in self._served:
                self.apiserver.add_pod(pod_object(pod))
        self._served = current
        if self.node.allocation == "dra":
            claims = sim_dra.claims_for(self.scenario.seed, self.node, self._pods)
            for key in set(self._claims) - set(claims):
                self.apiserver.delete_resource_claim(*key)
            for key, claim in claims.items():
                if self._claims.get(key) != claim:
                    self.apiserver.put_resource_claim(claim)
            self._claims = claims


def scenario_node_names(scenario: Scenario) -> tuple[str, ...]:
    return tuple(node.name for node in scenario.nodes)

