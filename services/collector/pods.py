"""Kubernetes Pod JSON object → ``PodEvent``: what gpumeter needs to know about one pod on a GPU node.

Pure functions over the API server's JSON (the ``object`` of a watch event, an item of a PodList, or a model
passed through ``ApiClient.sanitize_for_serialization``). Anything that is not a well-formed Pod raises
``InvalidMessage`` with reason code ``BAD_POD_OBJECT``; no other exception type leaves this module for any input.

Contracts worth knowing:

* Labels and annotations are cut to size (``services.collector.podsize``: caps on count and bytes, long
  annotation values truncated, the cut counted and flagged on the event), so no pod makes an event too large.
* Containers are listed in pod-spec order: init containers, then regular containers, then ephemeral containers
  (debug containers cannot request resources but can set ``NVIDIA_VISIBLE_DEVICES`` and so see GPUs).
* GPU resources are those ``is_gpu_resource`` names: nvidia.com/gpu, nvidia.com/gpu.shared, nvidia.com/mig-*.
  HAMi's quantities (``nvidia.com/gpumem`` MiB, ``nvidia.com/gpumem-percentage``, ``nvidia.com/gpucores`` percent)
  are kept beside them in the same maps, by the same rules, as amounts (never device counts; capped at
  ``MAX_RESOURCE_REQUEST``).
* A container's GPU request per resource is its limit, falling back to its request (extended resources must have
  requests == limits, but either may be the one written). Zero requests are dropped.
* The pod-level ``gpu_requests`` is the pod's *effective* request as the scheduler and the kubelet's device
  manager count it: per resource, the larger of (regular containers + sidecar init containers) and, for each
  run-to-completion init container, its own request plus the sidecars started before it. Devices given to an
  init container are reused by the containers after it, so adding them up would bill GPUs twice. When no init
  container requests GPUs this is the plain sum over the containers.
* CPU and memory requests (what billing's ``requests`` sharing policy weighs): per container,
  ``resources.requests`` of ``cpu`` and ``memory``, falling back to ``resources.limits`` (Kubernetes defaults a
  missing request to the limit), as millicores and bytes rounded up (the API server's own rounding of ``500.5m``
  is to the milli-unit above). The pod's ``cpu_request_millicores`` and ``memory_request_bytes`` are its
  effective requests by the same Kubernetes rule as its GPUs -- init containers count by their peak (a
  run-to-completion init container runs before the app containers, with the sidecars started before it, and
  its CPU and memory are free again once it ends), sidecar init containers (``restartPolicy: Always``) run
  alongside the app containers and add to them -- plus ``spec.overhead`` (a RuntimeClass's per-pod overhead,
  which the scheduler adds). Ephemeral containers cannot have resources. A request that is not a Kubernetes
  quantity, is negative, or exceeds ``MAX_RESOURCE_REQUEST`` is ``BAD_POD_OBJECT`` (the API server rejects such
  pods, so only a forged object has one).
* ``assigned_devices`` is empty here, but for a HAMi pod: the collector fills it from the kubelet PodResources API
  with ``with_assignments``. A pod HAMi scheduled carries ``hami.io/vgpu-devices-allocated`` (``schemas.hami``):
  its containers' GPUs are read from it here, as ``HAMI_RESOURCE`` assignments of canonical ``GPU-<uuid>`` ids,
  because the ids the kubelet gives a HAMi pod are slot placeholders that name no GPU. The annotation is read
  before labels and annotations are cut to size. The pod's owner can write that annotation too, so what is read
  here is only a claim: ``with_hami_checked`` keeps a container's claim only where the kubelet's ids back it
  (all of them HAMi slots, one per GPU named), and is what the collector publishes.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import datetime, timedelta, timezone
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from types import MappingProxyType
from typing import Any, Callable, Collection, Mapping

from gpumeter.errors import InvalidMessage
from schemas.hami import (
    HAMI_ALLOCATED_ANNOTATION,
    HamiAnnotationError,
    containers_of,
    is_hami_placeholder,
    parse_allocation,
)
from schemas.records import DeviceAssignment, PodContainer, PodEvent, PodEventType
from schemas.devices import (
    GPU_RESOURCE,
    HAMI_RESOURCE,
    MPS_THREAD_ENV,
    VALUE_FROM_MARK,
    VISIBLE_DEVICES_ENV,
    is_gpu_resource,
    is_hami_request_resource,
    is_hami_resource,
    parse_device_id,
    resolve_device_id,
    resolve_visible_devices,
)
from services.collector.podsize import ANNOTATION_VALUE_MAX_BYTES, cut_to_size  # noqa: F401 - the rule's caps

BAD_POD_OBJECT = "BAD_POD_OBJECT"
HAMI_ANNOTATION_IGNORED = "HAMI_ANNOTATION_IGNORED"
"""The code ``on_warning`` is called with for a HAMi allocation annotation that cannot be read."""
HAMI_ANNOTATION_UNTRUSTED = "HAMI_ANNOTATION_UNTRUSTED"
"""The code of a container's HAMi allocation that the kubelet's ids do not back (``with_hami_checked``): written
by the pod's owner, or by HAMi for a pod that did not get its GPU through HAMi's device plugin."""

MAX_GPU_REQUEST_COUNT = 2**31 - 1
"""Larger per-container requests are rejected: no node has that many devices, and sums must fit an Avro long."""
MAX_RESOURCE_REQUEST = 2**53
"""Larger CPU (millicores) or memory (bytes) requests are rejected: 8 PiB or 9e12 cores is no node, and sums over
a pod's containers must stay exact and fit an Avro long."""
CPU = "cpu"
MEMORY = "memory"

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_ONE_MS = timedelta(milliseconds=1)

# Kubernetes resource.Quantity: sign, digits, then a binary suffix, a decimal suffix or a decimal exponent.
_QUANTITY_RE = re.compile(
    r"(?P<sign>[+-]?)(?P<number>\d+(?:\.\d*)?|\.\d+)"
    r"(?:(?P<binary>Ki|Mi|Gi|Ti|Pi|Ei)|(?P<decimal>[numkMGTPE])|[eE](?P<exponent>[+-]?\d{1,3}))?"
)
_BINARY_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_SUFFIX = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}

_DEPLOYMENT_OWNER_KIND = "ReplicaSet"
_POD_TEMPLATE_HASH_LABEL = "pod-template-hash"


def pod_event_from_object(
    obj: Mapping[str, Any], event_type: PodEventType, cluster: str, observed_at_unix_ms: int,
    *, on_warning: Callable[[str, str], None] | None = None,
) -> PodEvent:
    """Build the ``PodEvent`` for one Pod object as the API server serialises it.

    Raises ``InvalidMessage`` (reason ``BAD_POD_OBJECT``) when the object is not a Pod we can read: not a
    mapping, no ``metadata.uid``/``namespace``/``name``, or any field of the wrong JSON type. A part of the pod
    that is read but left out is reported as ``on_warning(code, detail)``: a HAMi allocation annotation HAMi would
    not have written (``HAMI_ANNOTATION_IGNORED``; the pod is published without it, see ``_hami_assignments``).
    """
    pod = _mapping(obj, "pod")
    metadata = _mapping(pod.get("metadata"), "metadata")
    spec = _optional_mapping(pod.get("spec"), "spec")
    status = _optional_mapping(pod.get("status"), "status")

    uid = _required_text(metadata.get("uid"), "metadata.uid")
    namespace = _required_text(metadata.get("namespace"), "metadata.namespace")
    name = _required_text(metadata.get("name"), "metadata.name")
    resource_version = _optional_text(metadata.get("resourceVersion"), "metadata.resourceVersion") or ""
    labels = _string_map(metadata.get("labels"), "metadata.labels")
    annotations = _string_map(metadata.get("annotations"), "metadata.annotations")
    workload_kind, workload_name = _workload(metadata.get("ownerReferences"), labels)

    node_name = _optional_text(spec.get("nodeName"), "spec.nodeName") or ""
    phase = _optional_text(status.get("phase"), "status.phase") or "Unknown"
    started_at_unix_ms = _optional_timestamp_ms(status.get("startTime"), "status.startTime")

    container_ids: dict[str, str | None] = {}
    for field in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
        for index, entry in enumerate(_list(status.get(field), f"status.{field}")):
            where = f"status.{field}[{index}]"
            entry = _mapping(entry, where)
            container_name = _required_text(entry.get("name"), f"{where}.name")
            container_ids[container_name] = _container_id(entry.get("containerID"), f"{where}.containerID")

    containers: list[PodContainer] = []
    init_requests: list[tuple[bool, dict[str, int]]] = []
    regular_requests: list[dict[str, int]] = []
    init_resources: list[tuple[bool, dict[str, int]]] = []
    regular_resources: list[dict[str, int]] = []
    names_by_field: dict[str, list[str]] = {"initContainers": [], "containers": [], "ephemeralContainers": []}
    seen_names: set[str] = set()
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for index, entry in enumerate(_list(spec.get(field), f"spec.{field}")):
            where = f"spec.{field}[{index}]"
            entry = _mapping(entry, where)
            container_name = _required_text(entry.get("name"), f"{where}.name")
            if container_name in seen_names:
                raise _bad(f"{where}.name: container name {container_name!r} is used twice in the pod")
            seen_names.add(container_name)
            names_by_field[field].append(container_name)
            gpu_requests = _gpu_requests(entry.get("resources"), f"{where}.resources")
            resources = _cpu_memory_requests(entry.get("resources"), f"{where}.resources")
            security_context = _optional_mapping(entry.get("securityContext"), f"{where}.securityContext")
            containers.append(
                PodContainer(
                    name=container_name,
                    container_id=container_ids.get(container_name),
                    gpu_requests=MappingProxyType(gpu_requests),
                    assigned_devices=(),
                    visible_devices_env=_visible_devices_env(entry.get("env"), f"{where}.env"),
                    privileged=_optional_bool(security_context.get("privileged"), f"{where}.securityContext"),
                    mps_active_thread_percentage=_mps_thread_percentage(entry.get("env"), f"{where}.env"),
                    cpu_request_millicores=resources.get(CPU, 0),
                    memory_request_bytes=resources.get(MEMORY, 0),
                )
            )
            if field == "initContainers":
                restart_policy = _optional_text(entry.get("restartPolicy"), f"{where}.restartPolicy")
                init_requests.append((restart_policy == "Always", gpu_requests))
                init_resources.append((restart_policy == "Always", resources))
            elif field == "containers":
                regular_requests.append(gpu_requests)
                regular_resources.append(resources)
    pod_resources = _effective_pod_requests(init_resources, regular_resources)
    _add_into(pod_resources, _resource_amounts(spec.get("overhead"), "spec.overhead"))
    # Read before the annotations are cut to size: a long allocation must not lose its last containers.
    hami = _hami_assignments(annotations, names_by_field["initContainers"], names_by_field["containers"],
                             f"pod {namespace}/{name}", on_warning)
    if hami:
        containers = [dataclasses.replace(c, assigned_devices=hami[c.name]) if c.name in hami else c
                      for c in containers]

    return cut_to_size(PodEvent(
        event_type=PodEventType(event_type),
        observed_at_unix_ms=observed_at_unix_ms,
        resource_version=resource_version,
        cluster=cluster,
        node_name=node_name,
        uid=uid,
        namespace=namespace,
        name=name,
        labels=MappingProxyType(labels),
        annotations=MappingProxyType(annotations),
        workload_kind=workload_kind,
        workload_name=workload_name,
        phase=phase,
        started_at_unix_ms=started_at_unix_ms,
        gpu_requests=MappingProxyType(_effective_pod_requests(init_requests, regular_requests)),
        containers=tuple(containers),
        cpu_request_millicores=_capped(pod_resources.get(CPU, 0), "the pod's CPU request"),
        memory_request_bytes=_capped(pod_resources.get(MEMORY, 0), "the pod's memory request"),
    ))


def with_assignments(
    event: PodEvent, assignments: Mapping[str, tuple[DeviceAssignment, ...]]
) -> PodEvent:
    """A copy of ``event`` whose containers named in ``assignments`` carry those device assignments.

    Containers not named keep the assignments they had; names that are not containers of the pod are ignored
    (the kubelet and the API server can briefly disagree about a pod that is being replaced).

    A container's ``HAMI_RESOURCE`` assignment (its claim, read from the pod's HAMi annotation) is kept beside the
    kubelet's ids, placeholders included, and given ``HAMI_RESOURCE`` assignments are dropped (the event read its
    own from the annotation): the result is the collector's view of the pod, not yet what it publishes --
    ``with_hami_checked`` decides which claims the kubelet's ids back. Applying an event's own assignments to it
    again changes nothing.
    """
    if not assignments:
        return event
    containers = tuple(
        dataclasses.replace(c, assigned_devices=_merged(c, tuple(assignments[c.name])))
        if c.name in assignments else c
        for c in event.containers
    )
    return dataclasses.replace(event, containers=containers)


def _merged(container: PodContainer, given: tuple[DeviceAssignment, ...]) -> tuple[DeviceAssignment, ...]:
    own = tuple(a for a in container.assigned_devices if is_hami_resource(a.resource_name))
    return own + tuple(a for a in given if not is_hami_resource(a.resource_name))


def with_hami_checked(
    event: PodEvent, *, node_units: Collection[str] = (), kubelet_answered: bool = True,
) -> tuple[PodEvent, tuple[str, ...]]:
    """``event`` (after ``with_assignments``) as the collector publishes it, and the details of the HAMi claims
    refused that are to be flagged (``HAMI_ANNOTATION_UNTRUSTED``).

    The tenant writes the pod's annotations, so a container's HAMi claim (``HAMI_RESOURCE``, from
    ``hami.io/vgpu-devices-allocated``) is kept only where the kubelet backs it: the container's ``nvidia.com/gpu``
    ids are all HAMi slot placeholders (``schemas.hami.is_hami_placeholder``: its devices came through HAMi's
    device plugin, which hands out nothing else), one per GPU the claim names, and, when ``node_units`` (the
    node's GPU and MIG uuids, as NVML lists them) is known, every GPU named is one of this node. The slot's own
    uuid need not be the claimed GPU's: the kubelet picks slots without knowing which GPU HAMi's scheduler chose.
    A kept claim replaces the container's placeholders, which name no GPU.

    Anything else is refused and the container keeps only the kubelet's ids: real GPU ids (a whole GPU through
    another device plugin, which the claim would turn into a share of it), a mix, more or fewer GPUs than slots,
    a GPU of another node, or no ids at all (a pod without a GPU naming someone else's). A refusal is flagged
    when it is certain: always where the kubelet gave ids, and where it gave none only for a running pod
    (its containers were given their devices before they started) when the kubelet answered
    (``kubelet_answered``) and the event is not a deletion. A pod seen before its devices are allocated is
    refused quietly until the kubelet has its slots. Pure; never raises for a well-formed ``PodEvent``."""
    units = {parse_device_id(u).base_id for u in node_units}
    refusals: list[str] = []
    containers: list[PodContainer] = []
    for container in event.containers:
        claimed = [d for a in container.assigned_devices if is_hami_resource(a.resource_name) for d in a.device_ids]
        if not claimed:
            containers.append(container)
            continue
        kubelet = tuple(a for a in container.assigned_devices if not is_hami_resource(a.resource_name))
        gpu_ids = [d for a in kubelet if a.resource_name == GPU_RESOURCE for d in a.device_ids]
        slots = [d for d in gpu_ids if is_hami_placeholder(d)]
        reason: str | None = None
        flagged = True
        if not gpu_ids:
            reason = "the kubelet gave the container no nvidia.com/gpu ids"
            flagged = kubelet_answered and event.phase == "Running"
        elif len(slots) != len(gpu_ids):
            reason = (f"the kubelet gave the container device ids that are not HAMi slots: "
                      f"{', '.join(repr(d[:80]) for d in gpu_ids if not is_hami_placeholder(d))}")
        elif len(slots) != len(claimed):
            reason = f"it names {len(claimed)} GPUs for the {len(slots)} HAMi slots the kubelet gave the container"
        elif units and any(d not in units for d in claimed):
            reason = f"it names GPUs this node does not have: {', '.join(d for d in claimed if d not in units)}"
        if reason is None:
            kept = tuple(a for a in container.assigned_devices if is_hami_resource(a.resource_name))
            kept += tuple(a for a in kubelet if a.resource_name != GPU_RESOURCE)
            containers.append(dataclasses.replace(container, assigned_devices=kept))
            continue
        containers.append(dataclasses.replace(container, assigned_devices=kubelet))
        if flagged and event.event_type is not PodEventType.DELETED:
            refusals.append(f"pod {event.namespace}/{event.name} container {container.name}: "
                            f"{HAMI_ALLOCATED_ANNOTATION} ignored ({', '.join(claimed)}): {reason}")
    published = tuple(containers)
    event = event if published == event.containers else dataclasses.replace(event, containers=published)
    return event, tuple(refusals)


def with_devices_resolved(event: PodEvent, uuid_by_index: Mapping[str, str]) -> PodEvent:
    """``event`` with every device its containers name in uuid form: the kubelet's assigned ids and
    ``NVIDIA_VISIBLE_DEVICES`` (index and CDI forms resolved through the node's NVML indexes,
    ``schemas.devices.resolve_device_id``), so the attributor and the guard see one form whatever the device
    plugin's ``deviceIDStrategy`` and ``deviceListStrategy``. Returns ``event`` itself when nothing changes."""
    containers = tuple(
        dataclasses.replace(
            c,
            assigned_devices=tuple(
                dataclasses.replace(a, device_ids=tuple(resolve_device_id(d, uuid_by_index) for d in a.device_ids))
                for a in c.assigned_devices),
            visible_devices_env=resolve_visible_devices(c.visible_devices_env, uuid_by_index),
        )
        for c in event.containers
    )
    return event if containers == event.containers else dataclasses.replace(event, containers=containers)


def _hami_assignments(annotations: Mapping[str, str], init_containers: list[str], containers: list[str],
                      where: str, on_warning: Callable[[str, str], None] | None
                      ) -> dict[str, tuple[DeviceAssignment, ...]]:
    """Container name -> its ``HAMI_RESOURCE`` assignment, from ``hami.io/vgpu-devices-allocated``: the GPUs
    HAMi's scheduler gave it, as canonical ``GPU-<uuid>`` (``MIG-<uuid>``) ids. An annotation HAMi would not have
    written (``schemas.hami``) is left out with a warning rather than failing the pod: the pod is still attributed
    by its processes' use, under its own name and labels, and its placeholder ids name no GPU."""
    value = annotations.get(HAMI_ALLOCATED_ANNOTATION)
    if not value:
        return {}
    try:
        per_container = containers_of(parse_allocation(value), init_containers, containers)
    except HamiAnnotationError as exc:
        if on_warning is not None:
            on_warning(HAMI_ANNOTATION_IGNORED, f"{where}: {HAMI_ALLOCATED_ANNOTATION} ignored: {exc}")
        return {}
    return {
        name: (DeviceAssignment(HAMI_RESOURCE, tuple(parse_device_id(d.uuid).base_id for d in devices)),)
        for name, devices in per_container.items()
    }


def _effective_pod_requests(
    init_requests: list[tuple[bool, dict[str, int]]], regular_requests: list[dict[str, int]]
) -> dict[str, int]:
    # The Kubernetes rule (KEP-753 sidecars included): sidecars run alongside everything after them, while a
    # run-to-completion init container runs alone (plus the sidecars already started) and hands its devices on.
    total: dict[str, int] = {}
    for requests in regular_requests:
        _add_into(total, requests)
    sidecars_so_far: dict[str, int] = {}
    peak_during_init: dict[str, int] = {}
    for is_sidecar, requests in init_requests:
        if is_sidecar:
            _add_into(sidecars_so_far, requests)
            continue
        during = dict(sidecars_so_far)
        _add_into(during, requests)
        for resource, count in during.items():
            peak_during_init[resource] = max(peak_during_init.get(resource, 0), count)
    _add_into(total, sidecars_so_far)
    for resource, count in peak_during_init.items():
        total[resource] = max(total.get(resource, 0), count)
    return {resource: count for resource, count in sorted(total.items()) if count > 0}


def _add_into(target: dict[str, int], requests: Mapping[str, int]) -> None:
    for resource, count in requests.items():
        target[resource] = target.get(resource, 0) + count


def _gpu_requests(resources: Any, where: str) -> dict[str, int]:
    resources = _optional_mapping(resources, where)
    limits = _optional_mapping(resources.get("limits"), f"{where}.limits")
    requests = _optional_mapping(resources.get("requests"), f"{where}.requests")
    names = {*limits, *requests}
    for resource_name in names:
        if not isinstance(resource_name, str):
            raise _bad(f"{where}: resource name {resource_name!r} is not a string")
    result: dict[str, int] = {}
    for resource_name in sorted(names):
        hami = is_hami_request_resource(resource_name)
        if not (hami or is_gpu_resource(resource_name)):
            continue
        # HAMi's quantities are MiB or percent (an amount, not devices): the larger cap of other amounts.
        cap = MAX_RESOURCE_REQUEST if hami else MAX_GPU_REQUEST_COUNT
        if resource_name in limits:
            count = _quantity_count(limits[resource_name], f"{where}.limits[{resource_name}]", cap)
        else:
            count = _quantity_count(requests[resource_name], f"{where}.requests[{resource_name}]", cap)
        if count > 0:
            result[resource_name] = count
    return result


def _cpu_memory_requests(resources: Any, where: str) -> dict[str, int]:
    """``cpu`` (millicores) and ``memory`` (bytes) a container requests: ``requests``, else ``limits``."""
    resources = _optional_mapping(resources, where)
    requests = _resource_amounts(resources.get("requests"), f"{where}.requests")
    limits = _resource_amounts(resources.get("limits"), f"{where}.limits")
    return {name: requests.get(name, limits.get(name, 0)) for name in (CPU, MEMORY)
            if name in requests or name in limits}


def _resource_amounts(value: Any, where: str) -> dict[str, int]:
    """The ``cpu`` (millicores, rounded up) and ``memory`` (bytes, rounded up) of a resource list."""
    mapping = _optional_mapping(value, where)
    result: dict[str, int] = {}
    for name, scale in ((CPU, 1000), (MEMORY, 1)):
        if name in mapping:
            amount = _quantity(mapping[name], f"{where}[{name}]") * scale
            if amount < 0:
                raise _bad(f"{where}[{name}]: a request cannot be negative, got {mapping[name]!r}")
            result[name] = _capped(int(amount.to_integral_value(rounding=ROUND_CEILING)), f"{where}[{name}]")
    return result


def _capped(amount: int, where: str) -> int:
    if amount > MAX_RESOURCE_REQUEST:
        raise _bad(f"{where}: {amount} is more than any node has")
    return amount


def _quantity(value: Any, where: str) -> Decimal:
    """A Kubernetes quantity ("500m", "2", "1.5", "1Gi", "512M", "129e6", 4) as an exact decimal."""
    if isinstance(value, bool):
        raise _bad(f"{where}: {value!r} is not a quantity")
    if isinstance(value, int):
        return Decimal(value)
    if not isinstance(value, str):
        raise _bad(f"{where}: {type(value).__name__} is not a quantity")
    match = _QUANTITY_RE.fullmatch(value)
    if match is None:
        raise _bad(f"{where}: {value[:64]!r} is not a Kubernetes quantity")
    try:
        amount = Decimal(match["number"])
    except InvalidOperation as exc:  # the regex admits only decimal digits; kept for safety
        raise _bad(f"{where}: {value[:64]!r} is not a Kubernetes quantity") from exc
    if match["binary"]:
        amount *= _BINARY_SUFFIX[match["binary"]]
    elif match["decimal"]:
        amount = amount.scaleb(_DECIMAL_SUFFIX[match["decimal"]])
    elif match["exponent"]:
        amount = amount.scaleb(int(match["exponent"]))
    return -amount if match["sign"] == "-" else amount


def _quantity_count(value: Any, where: str, cap: int = MAX_GPU_REQUEST_COUNT) -> int:
    """A whole, non-negative count from a Kubernetes quantity ("1", "2", "1k", 4), at most ``cap``."""
    amount = _quantity(value, where)
    if amount < 0 or amount != amount.to_integral_value():
        raise _bad(f"{where}: GPU requests are whole non-negative counts, got {value!r}")
    if amount > cap:
        raise _bad(f"{where}: {value!r} devices is not a request any node can satisfy")
    return int(amount)


def _visible_devices_env(env: Any, where: str) -> str | None:
    found: str | None = None
    for index, entry in enumerate(_list(env, where)):
        entry = _mapping(entry, f"{where}[{index}]")
        if _required_text(entry.get("name"), f"{where}[{index}].name") != VISIBLE_DEVICES_ENV:
            continue
        # A later entry with the same name overrides an earlier one, as the kubelet applies them in order.
        if entry.get("valueFrom") is not None:
            _mapping(entry["valueFrom"], f"{where}[{index}].valueFrom")
            found = VALUE_FROM_MARK
        else:
            found = _optional_text(entry.get("value"), f"{where}[{index}].value") or ""
    return found


def _mps_thread_percentage(env: Any, where: str) -> float | None:
    """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` of a container spec: its literal value when within (0, 100]. From a
    ConfigMap or Secret (valueFrom) the collector cannot read it, and an unusable value caps nothing (MPS itself
    ignores it): None either way."""
    found: float | None = None
    for index, entry in enumerate(_list(env, where)):
        entry = _mapping(entry, f"{where}[{index}]")
        if _required_text(entry.get("name"), f"{where}[{index}].name") != MPS_THREAD_ENV:
            continue
        found = None  # a later entry overrides an earlier one
        if entry.get("valueFrom") is None:
            text = (_optional_text(entry.get("value"), f"{where}[{index}].value") or "").strip().rstrip("%")
            try:
                value = float(text)
            except ValueError:
                continue
            if 0.0 < value <= 100.0:
                found = value
    return found


def _container_id(value: Any, where: str) -> str | None:
    text = _optional_text(value, where)
    if not text:
        return None
    # "<runtime>://<id>": containerd://, cri-o://, docker:// (cri-dockerd) and whatever a CRI runtime names itself.
    _, separator, container_id = text.partition("://")
    container_id = container_id if separator else text
    return container_id or None


def _workload(owner_references: Any, labels: Mapping[str, str]) -> tuple[str | None, str | None]:
    controller: tuple[str, str] | None = None
    for index, entry in enumerate(_list(owner_references, "metadata.ownerReferences")):
        where = f"metadata.ownerReferences[{index}]"
        entry = _mapping(entry, where)
        kind = _required_text(entry.get("kind"), f"{where}.kind")
        name = _required_text(entry.get("name"), f"{where}.name")
        if _optional_bool(entry.get("controller"), f"{where}.controller") and controller is None:
            controller = (kind, name)
    if controller is None:
        return None, None
    kind, name = controller
    if kind == _DEPLOYMENT_OWNER_KIND:
        # A Deployment names its ReplicaSets "<deployment>-<pod-template-hash>" and labels their pods with the
        # hash; a ReplicaSet made by anything else (or by hand) lacks that pairing and stays a ReplicaSet.
        template_hash = labels.get(_POD_TEMPLATE_HASH_LABEL)
        suffix = f"-{template_hash}"
        if template_hash and name.endswith(suffix) and len(name) > len(suffix):
            return "Deployment", name[: -len(suffix)]
    return kind, name


def _optional_timestamp_ms(value: Any, where: str) -> int | None:
    text = _optional_text(value, where)
    if not text:
        return None
    try:
        parsed = datetime.fromisoformat(text)
    except (ValueError, OverflowError) as exc:
        raise _bad(f"{where}: {text[:64]!r} is not an RFC 3339 time") from exc
    if parsed.tzinfo is None:
        raise _bad(f"{where}: {text[:64]!r} has no UTC offset")
    return (parsed - _EPOCH) // _ONE_MS


def _string_map(value: Any, where: str) -> dict[str, str]:
    mapping = _optional_mapping(value, where)
    result: dict[str, str] = {}
    for key, item in mapping.items():
        key_text = _required_text(key, f"{where} key")
        result[key_text] = _optional_text(item, f"{where}[{key_text}]") or ""
    return result


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _bad(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _optional_mapping(value: Any, where: str) -> Mapping[str, Any]:
    return MappingProxyType({}) if value is None else _mapping(value, where)


def _list(value: Any, where: str) -> list[Any] | tuple[Any, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise _bad(f"{where}: expected an array, got {type(value).__name__}")
    return value


def _required_text(value: Any, where: str) -> str:
    text = _optional_text(value, where)
    if not text:
        raise _bad(f"{where}: missing or empty")
    return text


def _optional_text(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(f"{where}: expected a string, got {type(value).__name__}")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates from a "\ud800" JSON escape cannot be re-encoded
            raise _bad(f"{where}: not valid Unicode text") from exc
    return value


def _optional_bool(value: Any, where: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"{where}: expected a boolean, got {type(value).__name__}")
    return value


def _bad(detail: str) -> InvalidMessage:
    return InvalidMessage(detail, reason_code=BAD_POD_OBJECT)
