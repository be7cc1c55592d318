"""The collector's tick loop and pod-event path, wired from parts that are each tested on their own.

Per tick: NVML backend sample → pid → (container, pod) from cgroups → one NodeSample → buffered publisher.
Per pod change: the pod watch's PodEvent, merged with the devices the kubelet assigned to each container, its
HAMi claims checked against them (``pods.with_hami_checked``; a refused claim is logged and counted as
``gpumeter_collector_pod_warnings_total{reason="HAMI_ANNOTATION_UNTRUSTED"}``) → buffered publisher (keyed
``<node>/<pod uid>``, partitioned by node). Assignments are re-read every ``kubelet_refresh_seconds`` and a pod
whose published form changed is published again as MODIFIED.
Per namespace change (``podwatch.NamespaceWatcher``): the namespace's labels, as its Namespace object has them, go
on every event of its pods (``PodEvent.namespace_labels``); when they change, the namespace's pods on this node are
published again as MODIFIED (``namespaces`` has the rules).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Awaitable, Callable, Mapping

from gpumeter.clock import Clock
from schemas.catalog import TopicCatalog, pod_event_key
from schemas.records import DeviceAssignment, NodeSample, PodEvent, PodEventType
from schemas.typed import codec_for
from services.collector.assemble import (
    NodeFacts,
    TickInfo,
    assemble_node_sample,
    nvml_error_counts,
    unmapped_process_count,
)
from services.collector.cgroup import CgroupReadError
from services.collector.dra import DraResolver, NvmlMigDevice
from services.collector.namespaces import NamespaceEvent, NamespaceLabels, with_namespace_labels
from services.collector.pods import (
    HAMI_ANNOTATION_UNTRUSTED,
    with_assignments,
    with_devices_resolved,
    with_hami_checked,
)
from services.collector.podresources.client import (
    ContainerClaimDevice,
    ContainerDeviceAssignment,
    PodAssignment,
    PodResourcesError,
)
from services.collector.publisher import BufferedPublisher, OutboundRecord

log = logging.getLogger(__name__)


def group_assignments(
    assignments: tuple[ContainerDeviceAssignment, ...],
) -> dict[tuple[str, str], dict[str, tuple[DeviceAssignment, ...]]]:
    """(namespace, pod) → container → its DeviceAssignments, in the kubelet's order (device-plugin devices;
    DRA claim devices are left to ``DraResolver``)."""
    grouped: dict[tuple[str, str], dict[str, list[DeviceAssignment]]] = {}
    for item in assignments:
        if not isinstance(item, ContainerDeviceAssignment):
            continue
        containers = grouped.setdefault((item.namespace, item.pod_name), {})
        containers.setdefault(item.container_name, []).append(
            DeviceAssignment(item.resource_name, tuple(item.device_ids))
        )
    return {pod: {c: tuple(a) for c, a in containers.items()} for pod, containers in grouped.items()}


def merge_assignments(
    into: dict[tuple[str, str], dict[str, tuple[DeviceAssignment, ...]]],
    more: Mapping[tuple[str, str], Mapping[str, tuple[DeviceAssignment, ...]]],
) -> dict[tuple[str, str], dict[str, tuple[DeviceAssignment, ...]]]:
    """``into`` with each container's ``more`` assignments appended (a container can hold both kinds)."""
    for pod, containers in more.items():
        target = into.setdefault(pod, {})
        for container, assignments in containers.items():
            target[container] = tuple(target.get(container, ())) + tuple(assignments)
    return into


async def _no_slices():
    return ()


async def _no_claim(namespace: str, name: str):
    return None


def _assignments_of(event: PodEvent) -> dict[str, tuple[DeviceAssignment, ...]]:
    return {c.name: c.assigned_devices for c in event.containers if c.assigned_devices}


class CollectorService:
    def __init__(
        self,
        *,
        facts: NodeFacts,
        interval_seconds: float,
        clock: Clock,
        backend,
        identities,
        publisher: BufferedPublisher,
        catalog: TopicCatalog,
        kubelet=None,
        metrics=None,
        before_tick: Callable[[int], Awaitable[None]] | None = None,
        dra: DraResolver | None = None,
    ) -> None:
        self.facts = facts
        self.interval_seconds = interval_seconds
        self.clock = clock
        self.backend = backend
        self.identities = identities
        self.publisher = publisher
        self.catalog = catalog
        self.kubelet = kubelet
        self.metrics = metrics
        self.before_tick = before_tick
        # Without an API server no claim device resolves: each is published with its CDI id (names no unit).
        self.dra = dra if dra is not None else DraResolver(facts.node_name, _no_slices, _no_claim)
        self.started_at_unix_ms = clock.now_ms()
        self.sequence = 0
        self._last_sampled_at_ms: int | None = None
        # Per pod uid: the merged view (HAMi claims and the kubelet's ids, placeholders included), which later
        # assignments are merged into, and what was published of it (claims checked).
        self._pods: dict[str, PodEvent] = {}
        self._published: dict[str, PodEvent] = {}
        self._assignments: dict[tuple[str, str], dict[str, tuple[DeviceAssignment, ...]]] = {}
        self.namespace_labels = NamespaceLabels()
        self.kubelet_available: bool | None = None
        self._nvml_migs: tuple[NvmlMigDevice, ...] = ()
        self.cgroup_read_errors = 0

    # -- ticks ---------------------------------------------------------------------------------------------

    def _identity_of(self, pid: int):
        try:
            return self.identities.lookup(pid)
        except CgroupReadError as exc:
            self.cgroup_read_errors += 1
            log.debug("cgroup of pid %d unreadable: %s", pid, exc)
            return None

    async def tick(self) -> NodeSample:
        """Sample once and hand the NodeSample to the publisher; returns it."""
        now_ms = self.clock.now_ms()
        if self.before_tick is not None:
            await self.before_tick(now_ms)
        raw_devices, node_errors = self.backend.read()
        # For DRA MIG devices published without a uuid (DynamicMIG): what NVML lists now.
        self._nvml_migs = tuple(NvmlMigDevice(d.uuid, d.parent_uuid, getattr(d, "mig_profile", None))
                                for d in raw_devices if getattr(d, "parent_uuid", None))
        interval_ms = (
            int(round(self.interval_seconds * 1000)) if self._last_sampled_at_ms is None
            else max(1, now_ms - self._last_sampled_at_ms)
        )
        self._last_sampled_at_ms = now_ms
        sample = assemble_node_sample(
            self.facts,
            TickInfo(self.sequence, self.started_at_unix_ms, now_ms, interval_ms),
            raw_devices,
            self._identity_of,
            node_errors,
        )
        self.sequence += 1
        self.identities.retain_only(pid for device in raw_devices for pid in device.process_pids)
        self.publisher.offer(
            OutboundRecord(
                topic=self.catalog.node_samples,
                key=self.facts.node_name.encode(),
                partition=None,
                value=codec_for(NodeSample).encode(sample),
                kind="sample",
            )
        )
        if self.metrics:
            self.metrics.get("gpumeter_collector_ticks_total").inc()
            unmapped = unmapped_process_count(sample)
            if unmapped:
                self.metrics.get("gpumeter_collector_unmapped_processes_total").inc(unmapped)
            for (function, code), count in nvml_error_counts(sample).items():
                self.metrics.get("gpumeter_collector_nvml_errors_total").labels(function, code).inc(count)
        return sample

    async def run_ticks(self, stop: asyncio.Event, real_interval_s: float, max_ticks: int | None = None) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while not stop.is_set() and (max_ticks is None or self.sequence < max_ticks):
            started = loop.time()
            await self.tick()
            if self.metrics:
                self.metrics.get("gpumeter_collector_tick_seconds").observe(loop.time() - started)
                self.metrics.beat()
            next_at += real_interval_s
            delay = next_at - loop.time()
            if delay < 0:  # we fell behind (a slow NVML call): skip, don't burst
                next_at = loop.time()
                delay = 0
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass

    # -- pods ----------------------------------------------------------------------------------------------

    async def refresh_assignments(self) -> None:
        """Re-read the kubelet's assignments; republish pods whose devices changed."""
        if self.kubelet is None:
            return
        try:
            assignments = await self.kubelet.list()
        except PodResourcesError as exc:
            self._kubelet_down(exc)
            return
        self.kubelet_available = True
        self.dra.sharing_by_uuid.clear()  # rebuilt from every pod's claims
        self._assignments = await self._grouped(assignments)
        by_index = self._uuid_by_index()
        for uid, event in list(self._pods.items()):
            current = self._assignments.get((event.namespace, event.name), {})
            updated = with_devices_resolved(with_assignments(event, current) if current else event, by_index)
            if self._checked(updated)[0] != self._published.get(uid):
                # New devices, ids in index or CDI form that NVML's indexes now resolve, or a HAMi claim that the
                # kubelet's ids (or NVML's list of the node's GPUs) now back or no longer back.
                await self._publish_pod(
                    replace(updated, event_type=PodEventType.MODIFIED, observed_at_unix_ms=self.clock.now_ms())
                )
            else:
                self._pods[uid] = updated

    async def _grouped(
        self, assignments: tuple[PodAssignment, ...]
    ) -> dict[tuple[str, str], dict[str, tuple[DeviceAssignment, ...]]]:
        """Device-plugin assignments and DRA claim devices (resolved through the node's ResourceSlices), per pod
        and container."""
        grouped = group_assignments(assignments)
        claims = [a for a in assignments if isinstance(a, ContainerClaimDevice)]
        if claims:
            unresolved_before = self.dra.unresolved_total
            merge_assignments(grouped, await self.dra.assignments(claims, self._nvml_migs))
            if self.metrics and self.dra.unresolved_total > unresolved_before:
                self.metrics.get("gpumeter_collector_dra_devices_unresolved_total").inc(
                    self.dra.unresolved_total - unresolved_before)
        if hasattr(self.backend, "claimed_sharing"):
            # The next samples of a GPU a shared claim holds say TIME_SLICING/MPS, as its claim configures.
            self.backend.claimed_sharing = dict(self.dra.sharing_by_uuid)
        return grouped

    def _kubelet_down(self, exc: Exception) -> None:
        if self.kubelet_available is not False:
            log.warning("kubelet PodResources API unavailable, mapping by cgroups only: %s", exc)
        self.kubelet_available = False
        if self.metrics:
            self.metrics.get("gpumeter_collector_kubelet_unavailable_total").inc()

    async def on_pod_event(self, event: PodEvent) -> None:
        """Called by the pod watch for every change of a pod on this node."""
        if event.event_type != PodEventType.DELETED and self.kubelet is not None:
            try:
                assignments = await self._grouped(await self.kubelet.get(event.namespace, event.name))
                self.kubelet_available = True
                self._assignments.update(assignments)
            except PodResourcesError as exc:
                self._kubelet_down(exc)
            per_container = self._assignments.get((event.namespace, event.name), {})
            if per_container:
                event = with_assignments(event, per_container)
        elif event.event_type == PodEventType.DELETED:
            previous = self._pods.get(event.uid)
            if previous is not None:
                event = with_assignments(event, _assignments_of(previous))
        await self._publish_pod(self._with_namespace_labels(with_devices_resolved(event, self._uuid_by_index())))

    async def on_namespace_event(self, event: NamespaceEvent) -> None:
        """Called by the namespace watch for every change of a Namespace: its labels go on its pods' events from
        now on, and when they changed, the namespace's pods on this node are published again (MODIFIED)."""
        if not self.namespace_labels.apply(event):
            return
        now_ms = self.clock.now_ms()
        for uid, pod in list(self._pods.items()):
            if pod.namespace == event.name and dict(pod.namespace_labels) != dict(event.labels):
                await self._publish_pod(replace(with_namespace_labels(pod, event.labels),
                                                event_type=PodEventType.MODIFIED, observed_at_unix_ms=now_ms))

    def _with_namespace_labels(self, event: PodEvent) -> PodEvent:
        # Only the Namespace object's labels, never the pod's: a namespace not known (not read yet, or deleted
        # before its last pod's deletion was read) keeps what was last published for the pod.
        labels = self.namespace_labels.labels_of(event.namespace)
        if labels is None:
            previous = self._pods.get(event.uid)
            labels = previous.namespace_labels if previous is not None else {}
        return with_namespace_labels(event, labels)

    def _uuid_by_index(self) -> Mapping[str, str]:
        # Before the first NVML read the indexes are unknown: ids in index form stay as they are until the next
        # refresh of the assignments resolves them and republishes the pod.
        return getattr(self.backend, "uuid_by_index", {})

    def _checked(self, event: PodEvent) -> tuple[PodEvent, tuple[str, ...]]:
        return with_hami_checked(event, node_units=self._uuid_by_index().values(),
                                 kubelet_answered=self.kubelet is not None and self.kubelet_available is True)

    async def _publish_pod(self, merged: PodEvent) -> None:
        event, refusals = self._checked(merged)
        for detail in refusals:
            log.warning("pod on node %s published without its HAMi allocation: %s", self.facts.node_name, detail)
            if self.metrics:
                self.metrics.get("gpumeter_collector_pod_warnings_total").labels(HAMI_ANNOTATION_UNTRUSTED).inc()
        if event.event_type == PodEventType.DELETED:
            self._pods.pop(event.uid, None)
            self._published.pop(event.uid, None)
            self._assignments.pop((event.namespace, event.name), None)
        else:
            self._pods[event.uid] = merged
            self._published[event.uid] = event
        self.publisher.offer(
            OutboundRecord(
                topic=self.catalog.pod_events,
                key=pod_event_key(self.facts.node_name, event.uid),
                partition=None,
                value=codec_for(PodEvent).encode(event),
                kind="pod_event",
                partition_by_node=self.facts.node_name,
            )
        )
