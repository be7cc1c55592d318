"""``gpumeter collector``: the per-node agent. Wires settings, NVML (real or simulated), cgroups, the kubelet,
the pod watch and the publisher; all behaviour lives in the modules it wires."""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
from pathlib import Path
from typing import Mapping

from gpumeter.clock import SystemClock
from gpumeter.errors import GpumeterError
from gpumeter.entrypoint import start_logging, stop_on
from gpumeter.health import DEFAULT_MAX_SILENCE_SECONDS
from gpumeter.kafka.producer import RecordProducer
from gpumeter.metrics import ServiceMetrics
from services.collector.assemble import NodeFacts
from services.collector.cgroup import ProcessIdentityCache
from services.collector.nodefacts import NodeFactOverrides, NodeReadError, node_facts_from_node, read_node_object
from services.collector.podresources.client import PodResourcesClient
from services.collector.publisher import BufferedPublisher
from services.collector.service import CollectorService
from services.collector.settings import CollectorSettings, add_arguments, collector_settings

log = logging.getLogger("gpumeter.collector")

__all__ = ["add_arguments", "main"]


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    try:
        settings = collector_settings(args, env)
        scenario = _scenario(settings)
        if scenario is None:
            parse_sharing(settings.sharing_config)
    except GpumeterError as exc:
        print(f"error: {exc}")
        return 2
    start_logging("collector", settings.log_level, settings.describe())
    try:
        return asyncio.run(run(settings, scenario))
    except KeyboardInterrupt:
        return 0


def _scenario(settings: CollectorSettings):
    """The simulated scenario (None outside simulate mode), checked to hold this node: ``ScenarioError``."""
    if settings.simulate is None:
        return None
    from simulator.scenario import load_scenario

    scenario = load_scenario(settings.simulate)
    scenario.node(settings.node_name)
    return scenario


async def run(settings: CollectorSettings, scenario=None) -> int:
    """The collector until SIGTERM/SIGINT or the duration; ``scenario``: the loaded simulate-mode scenario (read
    from ``settings.simulate`` when None)."""
    stop = asyncio.Event()
    stop_on(stop, handle_signals=True, duration_seconds=None)  # the duration starts once the collector is set up
    # Liveness: a beat per tick; a slow tick interval must not read as a stuck loop.
    metrics = ServiceMetrics("collector", max_silence_seconds=max(DEFAULT_MAX_SILENCE_SECONDS,
                                                                   3 * settings.interval_seconds))
    metrics.serve(settings.metrics_port, settings.metrics_address)
    workdir = None
    simulated = None
    if settings.simulate is not None:
        from services.collector.simulation import SimulatedNode

        scenario = scenario or _scenario(settings)
        workdir = Path(tempfile.mkdtemp(prefix=f"gpumeter-sim-{settings.node_name}-", dir="/tmp"))
        simulated = SimulatedNode(scenario, settings.node_name, settings.time_scale, workdir)
        await simulated.start()
        clock = simulated.clock
        backend = simulated.backend
        overrides = simulated.overrides
        proc_root = simulated.proc_root
        kubelet_socket = simulated.kubelet_socket
        kube_api = simulated.apiserver.url
        interval_seconds = scenario.interval_seconds
    else:
        import pynvml

        from services.collector.nvml_backend import NvmlBackend

        clock = SystemClock()
        backend = NvmlBackend(pynvml, clock, sharing_by_gpu_uuid=parse_sharing(settings.sharing_config))
        overrides = settings.node_fact_overrides
        proc_root = settings.proc_root
        kubelet_socket = settings.kubelet_socket
        kube_api = settings.kube_api
        interval_seconds = settings.interval_seconds

    api_client = await _api_client(kube_api)
    cluster = settings.cluster_for(scenario.cluster if simulated is not None else None)
    facts, node_read = await _node_facts(api_client, cluster, settings.node_name, overrides)

    delivery_timeout_ms = int(settings.delivery_timeout_seconds * 1000)
    publisher = BufferedPublisher(lambda: RecordProducer(settings.kafka, request_timeout_ms=delivery_timeout_ms),
                                  max_records=settings.buffer_max_records, metrics=metrics,
                                  send_timeout_s=settings.delivery_timeout_seconds,
                                  dead_letter_topic=settings.kafka.catalog.dead_letters,
                                  max_request_size_bytes=settings.kafka.max_request_size_bytes, clock=clock)
    kubelet = PodResourcesClient(kubelet_socket, settings.kubelet_timeout_seconds)
    service = CollectorService(
        dra=_dra_resolver(api_client, settings.node_name),
        facts=facts, interval_seconds=interval_seconds, clock=clock, backend=backend,
        identities=ProcessIdentityCache(proc_root), publisher=publisher, catalog=settings.kafka.catalog,
        kubelet=kubelet, metrics=metrics,
        before_tick=simulated.sync if simulated is not None else None,
    )
    publisher.start()
    tasks = [asyncio.create_task(_refresh_loop(service, settings.kubelet_refresh_seconds, stop))]
    if api_client is not None and not node_read:
        tasks.append(asyncio.create_task(_node_facts_retry(service, api_client, overrides, stop)))
    if api_client is not None:
        from services.collector.podwatch import NamespaceWatcher, PodWatcher

        namespaces = NamespaceWatcher(
            api_client, clock, service.on_namespace_event,
            on_watch_error=lambda kind: metrics.get("gpumeter_collector_namespace_watch_restarts_total").labels(
                kind).inc(),
        )
        tasks.append(asyncio.create_task(namespaces.run()))
        watcher = PodWatcher(
            api_client, settings.node_name, facts.cluster, clock, service.on_pod_event,
            on_watch_error=lambda kind: metrics.get("gpumeter_collector_pod_watch_restarts_total").labels(kind).inc(),
            on_pod_warning=lambda code: metrics.get("gpumeter_collector_pod_warnings_total").labels(code).inc(),
        )
        # Pods are first published with their namespace's labels where the namespaces can be read in time; later
        # labels republish the pods (CollectorService.on_namespace_event). Only the pod watch waits for them: the
        # ticks start now, whatever the API server does.
        tasks.append(asyncio.create_task(_watch_pods_once_synced(watcher, namespaces, stop)))
    stop_on(stop, handle_signals=False, duration_seconds=settings.duration_seconds)
    try:
        await service.run_ticks(stop, interval_seconds / (settings.time_scale if simulated else 1.0))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if api_client is not None:
            await api_client.close()
        await publisher.close(timeout_s=15)
        await kubelet.close()
        if simulated is not None:
            await simulated.stop()
        log.info("stopped after %d ticks; %d records dropped, %d undelivered", service.sequence,
                 publisher.dropped_count, publisher.depth)
    return 0


NAMESPACE_SYNC_WAIT_SECONDS = 10.0


async def _watch_pods_once_synced(pods, namespaces, stop: asyncio.Event) -> None:
    """Run the pod watch once the namespace watch has listed (or ``NAMESPACE_SYNC_WAIT_SECONDS`` went by)."""
    await _until_synced(namespaces, NAMESPACE_SYNC_WAIT_SECONDS, stop)
    if not stop.is_set():
        await pods.run()


async def _until_synced(watcher, wait_s: float, stop: asyncio.Event) -> None:
    """Wait until ``watcher`` has listed once, at most ``wait_s`` seconds (then go on without, saying so)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while not watcher.has_synced and not stop.is_set():
        if loop.time() >= deadline:
            log.warning("namespaces not listed within %.0f s (RBAC: get/list/watch on namespaces?): pods are "
                        "published without their namespace's labels until they are", wait_s)
            return
        await asyncio.sleep(0.05)


async def _refresh_loop(service: CollectorService, every_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await service.refresh_assignments()
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


NODE_READ_ATTEMPTS = 3
NODE_READ_RETRY_SECONDS = 60.0


async def _node_facts(api_client, cluster: str, node_name: str, overrides: NodeFactOverrides
                      ) -> tuple[NodeFacts, bool]:
    """The node's facts from its Node object (a few tries), configuration overriding; whether the Node was read."""
    node = None
    if api_client is not None:
        for attempt in range(NODE_READ_ATTEMPTS):
            try:
                node = await read_node_object(api_client, node_name)
                break
            except NodeReadError as exc:
                log.warning("%s (attempt %d of %d)", exc, attempt + 1, NODE_READ_ATTEMPTS)
                if attempt + 1 < NODE_READ_ATTEMPTS:
                    await asyncio.sleep(1.0 * (attempt + 1))
    resolved = node_facts_from_node(cluster, node_name, node, overrides)
    _log_facts(resolved, node is not None)
    return resolved.facts, node is not None


def _log_facts(resolved, node_read: bool) -> None:
    facts = resolved.facts
    log.info("node facts%s: %s", "" if node_read else " (Node object not read: configuration and defaults only)",
             ", ".join(f"{name}={getattr(facts, name)!r} ({source})" for name, source in resolved.sources.items()))


async def _node_facts_retry(service: CollectorService, api_client, overrides: NodeFactOverrides,
                            stop: asyncio.Event) -> None:
    """Keep trying to read the Node after a failed start, and switch to its facts once it is read."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), NODE_READ_RETRY_SECONDS)
            return
        except asyncio.TimeoutError:
            pass
        try:
            node = await read_node_object(api_client, service.facts.node_name)
        except NodeReadError as exc:
            log.warning("%s; still using the configured node facts", exc)
            continue
        resolved = node_facts_from_node(service.facts.cluster, service.facts.node_name, node, overrides)
        _log_facts(resolved, True)
        service.facts = resolved.facts
        return


def _dra_resolver(api_client, node_name: str):
    """DRA claim devices resolved through this node's ResourceSlices and the pods' claims (None: no API server)."""
    if api_client is None:
        return None
    from services.collector.dra import DraResolver
    from services.collector.podwatch import DraApiReader

    reader = DraApiReader(api_client, node_name)
    return DraResolver(node_name, reader.list_slices, reader.read_claim)


async def _api_client(kube_api: str):
    from services.collector.podwatch import in_cluster_api_client, make_api_client

    if kube_api == "none":
        return None
    if kube_api == "in-cluster":
        return in_cluster_api_client()
    return make_api_client(kube_api, token=None, ca_file=None, verify_ssl=False)


def parse_sharing(text: str):
    """``"<uuid|*>=<exclusive|time_slicing:N|mps:N>,..."`` → {uuid: (SharingMode, replicas)}."""
    from schemas.records import SharingMode
    from gpumeter.errors import ConfigError

    result = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        uuid, _, spec = item.partition("=")
        mode, _, replicas = spec.partition(":")
        try:
            result[uuid] = (SharingMode(mode.upper()), int(replicas or 1))
        except ValueError as exc:
            raise ConfigError(f"bad sharing entry {item!r}: {exc}") from exc
    return result
