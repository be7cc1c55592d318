"""GPUs allocated through Dynamic Resource Allocation (DRA): the one owner of what NVIDIA's DRA driver's names mean.

With DRA (``resource.k8s.io/v1``, GA since Kubernetes 1.34) a pod gets GPUs through ResourceClaims, and the kubelet
PodResources API lists them per container under ``dynamic_resources``: claim name and namespace, and per device
the driver, pool and device name plus claim-scoped CDI ids (``k8s.gpu.nvidia.com/claim=<claim uid>-gpu-0``). None
of these names a GPU: the device name is the driver's (``gpu-<minor>`` for a whole GPU,
``gpu-<minor>-mig-<profile without dots>-<profile id>-<placement start>`` for a MIG device) and only the node's
ResourceSlices, where the driver publishes each device with a ``uuid`` attribute, map it to the GPU.

Pure functions here; the API reading is ``services.collector.podwatch.DraApiReader`` and the wiring
``DraResolver`` (which keeps the last slices and re-lists them when a device name is not known: MIG devices are
created and published while the node runs).

How a claim device becomes the ``DeviceAssignment`` the attributor and the guard read (``claim_device_assignment``):

* Its uuid from the slice (``GPU-…`` / ``MIG-…``, the form of ``schemas.devices``), and a resource name in the
  device plugin's vocabulary (``nvidia.com/gpu``, ``nvidia.com/mig-<profile>``), so one evidence model
  (``services.attributor.modes``) serves both allocation paths.
* Who owns it. A device allocated to a claim is the claim's alone -- the scheduler allocates it to no other
  claim -- unless the platform lets several claims have it (KEP-5075 consumable capacity: the slice's device sets
  ``allowMultipleAllocations``, and each allocation result names a ``shareID``). So a claim's device carries the
  claim (``DeviceAssignment.owning_claim``, ``<namespace>/<name>``) and the claim's pods pay it together for every
  tick any of them holds it (``services.attributor.modes``), whatever sharing config the claim's owner writes: a
  tenant's config says how the claim's pods share the device among themselves, never who pays. A device shared
  across claims carries no owning claim and is billed by use.
* Sharing among the claim's pods. It is shared only between the pods the claim is reserved for
  (``status.reservedFor``). A claim with no sharing config reserved for one pod gives it the whole device: the
  plain id (exclusive, or a MIG instance held by one pod). A claim whose NVIDIA config sets a sharing strategy
  (``GpuConfig`` / ``MigDeviceConfig`` ``sharing.strategy``: ``TimeSlicing`` or ``MPS``), or one reserved for
  several pods (the driver time-slices them by default), shares the device: each pod gets a replica-style id
  ``<uuid>::<k>`` (``k`` its place in ``reservedFor``) under the ``.shared`` resource name, what the device
  plugin's time-slicing hands out, so ``modes`` splits the unit among the claim's pods by use. Whether it is MPS
  or time-slicing is then what the samples say (NVML lists MPS clients when the driver runs an MPS daemon for the
  claim), as with the device plugin. (A configured strategy makes the claim shared even while one pod uses it,
  so a pod's ids do not flip between exclusive and shared as the other pods of its claim come and go.) A device
  shared across claims is always shared: a replica-style id under ``.shared``, even for one pod.
* A MIG device a slice publishes without ``uuid`` (the driver's DynamicMIG mode announces MIG devices before it
  creates them) is the MIG device NVML lists on its ``parentUUID`` with its ``profile``, when exactly one has it.
* A device that cannot be resolved (no slice names it, even after a fresh list; no ``uuid`` and no unique NVML
  match) keeps its CDI id (or ``<driver>/<pool>/<device>``):
  an id of kind OTHER, which names no unit, so the pod's use goes where unassigned use goes, and the guard treats
  the pod's assignment as unknown rather than missing. Devices of other drivers are not GPUs of ours: dropped.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence

from schemas.devices import GPU_RESOURCE, MIG_RESOURCE_PREFIX, REPLICA_SEPARATOR, SHARED_RESOURCE_SUFFIX
from schemas.records import DeviceAssignment, SharingMode
from services.collector.podresources.client import ContainerClaimDevice as ClaimDevice

log = logging.getLogger(__name__)

DRIVER_NAME = "gpu.nvidia.com"
CDI_CLAIM_KIND = "k8s.gpu.nvidia.com/claim"
CONFIG_API_GROUP = "resource.nvidia.com"
CONFIG_KINDS = ("GpuConfig", "MigDeviceConfig")
TIME_SLICING = "TimeSlicing"
MPS = "MPS"
DEVICE_TYPE_GPU = "gpu"
DEVICE_TYPE_MIG = "mig"

_MIG_NAME = re.compile(r"gpu-(?P<minor>\d+)-mig-(?P<profile>.+)-(?P<profile_id>\d+)-(?P<placement>\d+)")
_GPU_NAME = re.compile(r"gpu-(?P<minor>\d+)")


@dataclass(frozen=True, slots=True)
class SliceDevice:
    """One device of a ResourceSlice: ``uuid`` None when the slice gives none; ``multiple_allocations`` its
    ``allowMultipleAllocations`` (KEP-5075 consumable capacity: several claims may be allocated the device)."""

    driver: str
    pool: str
    name: str
    uuid: str | None
    device_type: str | None
    parent_uuid: str | None
    profile: str | None
    multiple_allocations: bool = False


@dataclass(frozen=True, slots=True)
class MigDeviceName:
    """What a MIG device name of the NVIDIA driver says: parent minor, profile (dots removed), GI profile id and
    placement start."""

    parent_minor: int
    profile: str
    profile_id: int
    placement_start: int


@dataclass(frozen=True, slots=True)
class ClaimSharing:
    """How a claim's device is shared: ``strategy`` TimeSlicing, MPS or None (no sharing config), and the pods the
    claim is reserved for, in ``status.reservedFor`` order."""

    strategy: str | None
    consumers: tuple[str, ...]

    @property
    def shared(self) -> bool:
        """A sharing strategy is configured, or several pods use the claim (the driver then time-slices)."""
        return self.strategy is not None or len(self.consumers) > 1


def parse_mig_device_name(name: str) -> MigDeviceName | None:
    """``gpu-0-mig-1g10gb-19-0`` → its parts; None for any other name."""
    match = _MIG_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        return None
    return MigDeviceName(int(match["minor"]), match["profile"], int(match["profile_id"]), int(match["placement"]))


def is_whole_gpu_name(name: str) -> bool:
    return isinstance(name, str) and _GPU_NAME.fullmatch(name) is not None


def attribute_value(attribute: Any) -> str | int | bool | None:
    """A DeviceAttribute's value (``{"string": …}``, ``{"int": …}``, ``{"bool": …}``, ``{"version": …}``)."""
    if not isinstance(attribute, Mapping):
        return None
    for key in ("string", "int", "bool", "version"):
        if key in attribute:
            return attribute[key]
    return None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def slice_devices(slices: Iterable[Any], node_name: str | None = None) -> dict[tuple[str, str, str], SliceDevice]:
    """(driver, pool, device name) → device, over ResourceSlice objects as the API server serialises them.

    Slices of another node (when ``node_name`` is given) are skipped, and of a pool only the newest generation
    counts: the driver republishes a pool with a higher ``spec.pool.generation`` and older slices are stale. A
    malformed slice or device is skipped, never raised on."""
    newest: dict[tuple[str, str], int] = {}
    kept: list[tuple[str, str, int, Mapping[str, Any]]] = []
    for obj in slices:
        spec = _mapping(_mapping(obj).get("spec"))
        driver = _text(spec.get("driver"))
        pool = _mapping(spec.get("pool"))
        pool_name = _text(pool.get("name"))
        if driver is None or pool_name is None:
            continue
        if node_name is not None and spec.get("nodeName") not in (None, node_name):
            continue
        generation = pool.get("generation") if isinstance(pool.get("generation"), int) else 0
        newest[(driver, pool_name)] = max(newest.get((driver, pool_name), generation), generation)
        kept.append((driver, pool_name, generation, spec))
    out: dict[tuple[str, str, str], SliceDevice] = {}
    for driver, pool_name, generation, spec in kept:
        if generation != newest[(driver, pool_name)]:
            continue
        for device in _list(spec.get("devices")):
            device = _mapping(device)
            name = _text(device.get("name"))
            if name is None:
                continue
            attributes = _mapping(device.get("attributes"))

            def attr(key: str) -> str | None:
                # Attribute names may be qualified with the driver's domain (gpu.nvidia.com/uuid).
                value = attribute_value(attributes.get(key, attributes.get(f"{driver}/{key}")))
                return value if isinstance(value, str) and value else None

            out[(driver, pool_name, name)] = SliceDevice(
                driver, pool_name, name, attr("uuid"), attr("type"), attr("parentUUID"), attr("profile"),
                device.get("allowMultipleAllocations") is True)
    return out


def _config_entries(claim: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    # The allocation's copy holds the DeviceClass's configuration too (source FromClass, before FromClaim);
    # before allocation only the claim's own spec has any.
    allocation = _mapping(_mapping(_mapping(claim.get("status")).get("allocation")).get("devices"))
    entries = _list(allocation.get("config"))
    if not entries:
        entries = _list(_mapping(_mapping(claim.get("spec")).get("devices")).get("config"))
    return [_mapping(e) for e in entries]


def claim_result_of(claim: Mapping[str, Any] | None, driver: str, pool: str, device: str) -> Mapping[str, Any]:
    """The allocation result of ``claim`` for ``device`` (``status.allocation.devices.results``; {} when none)."""
    if not isinstance(claim, Mapping):
        return {}
    allocation = _mapping(_mapping(_mapping(claim.get("status")).get("allocation")).get("devices"))
    for result in _list(allocation.get("results")):
        result = _mapping(result)
        if result.get("driver") == driver and result.get("pool") == pool and result.get("device") == device:
            return result
    return {}


def claim_request_of(claim: Mapping[str, Any], driver: str, pool: str, device: str) -> str | None:
    """The request of ``claim`` that ``device`` was allocated for (``status.allocation.devices.results``)."""
    return _text(claim_result_of(claim, driver, pool, device).get("request"))


def shared_across_claims(device: SliceDevice | None, result: Mapping[str, Any]) -> bool:
    """Whether the platform may allocate ``device`` to several claims (KEP-5075 consumable capacity): the slice
    allows multiple allocations, or the allocation ``result`` names a ``shareID`` (one share of such a device).
    Only the slice and the allocation say it, never the claim's config."""
    return (device is not None and device.multiple_allocations) or _text(result.get("shareID")) is not None


def claim_identity(item: ClaimDevice) -> str:
    """``<namespace>/<name>`` of the claim a kubelet claim device is allocated to."""
    namespace, name = item.claim_key
    return f"{namespace}/{name}"


def claim_sharing(claim: Mapping[str, Any] | None, request: str | None = None) -> ClaimSharing:
    """The sharing of one request's devices of ``claim`` (None: the claim is not known; nothing is shared).

    The strategy is the last NVIDIA config (``opaque.driver`` gpu.nvidia.com, ``parameters.kind`` GpuConfig or
    MigDeviceConfig) that applies to the request (its ``requests`` empty or naming it), as the driver applies class
    configs first and the claim's after them. Consumers are the pods of ``status.reservedFor``."""
    if not isinstance(claim, Mapping):
        return ClaimSharing(None, ())
    strategy: str | None = None
    for entry in _config_entries(claim):
        requests = [r for r in _list(entry.get("requests")) if isinstance(r, str)]
        if requests and (request is None or request not in requests):
            continue
        opaque = _mapping(entry.get("opaque"))
        if opaque.get("driver") != DRIVER_NAME:
            continue
        parameters = _mapping(opaque.get("parameters"))
        if parameters.get("kind") not in CONFIG_KINDS:
            continue
        sharing = _mapping(parameters.get("sharing"))
        if _text(sharing.get("strategy")) is not None:
            strategy = sharing["strategy"]
    consumers = tuple(
        ref["name"] for ref in (_mapping(r) for r in _list(_mapping(claim.get("status")).get("reservedFor")))
        if ref.get("resource") == "pods" and _text(ref.get("name")) is not None
    )
    return ClaimSharing(strategy, consumers)


def resource_name_of(device: SliceDevice, shared: bool) -> str:
    """The device plugin's resource name for the same device: ``nvidia.com/gpu`` or ``nvidia.com/mig-<profile>``,
    with the ``.shared`` rename when the claim is shared."""
    if (device.uuid or "").startswith("MIG-") or device.device_type == DEVICE_TYPE_MIG:
        base = MIG_RESOURCE_PREFIX + (device.profile or "unknown")
    else:
        base = GPU_RESOURCE
    return base + SHARED_RESOURCE_SUFFIX if shared else base


def claim_device_assignment(item: ClaimDevice, device: SliceDevice | None, sharing: ClaimSharing, *,
                            across_claims: bool = False) -> DeviceAssignment:
    """The ``DeviceAssignment`` one claim device stands for (see the module docstring). ``device`` None: unresolved;
    ``across_claims``: the device is shared across claims (``shared_across_claims``), so no claim owns it."""
    if device is None or device.uuid is None:
        return DeviceAssignment(GPU_RESOURCE, (item.fallback_id,))
    owner = None if across_claims else claim_identity(item)
    if not sharing.shared and not across_claims:
        return DeviceAssignment(resource_name_of(device, False), (device.uuid,), owner)
    try:
        replica = sharing.consumers.index(item.pod_name)
    except ValueError:
        # Not (yet) in reservedFor: a place no listed pod has.
        replica = len(sharing.consumers)
    return DeviceAssignment(resource_name_of(device, True), (f"{device.uuid}{REPLICA_SEPARATOR}{replica}",), owner)


@dataclass(frozen=True, slots=True)
class NvmlMigDevice:
    """A MIG device NVML lists on the node: its uuid, its GPU's and its profile (``1g.10gb``)."""

    uuid: str
    parent_uuid: str
    profile: str | None


def mig_uuid_by_profile(device: SliceDevice, nvml_migs: Iterable[NvmlMigDevice]) -> str | None:
    """The uuid of a MIG device the slice publishes without one (the driver's DynamicMIG mode announces MIG
    devices before it creates them): the one MIG device NVML lists on its parent GPU with its profile, when
    exactly one has it (NVML's GPU instance placement is not read, so two such instances stay ambiguous)."""
    if device.parent_uuid is None or device.profile is None:
        return None
    candidates = [m.uuid for m in nvml_migs if m.parent_uuid == device.parent_uuid and m.profile == device.profile]
    return candidates[0] if len(candidates) == 1 else None


def resolve_claim_devices(
    items: Sequence[ClaimDevice],
    devices: Mapping[tuple[str, str, str], SliceDevice],
    claims: Mapping[tuple[str, str], Mapping[str, Any] | None],
    nvml_migs: Sequence[NvmlMigDevice] = (),
) -> tuple[dict[tuple[str, str], dict[str, tuple[DeviceAssignment, ...]]], tuple[ClaimDevice, ...]]:
    """(namespace, pod) → container → the DeviceAssignments of its claim devices of ``DRIVER_NAME`` (others are
    skipped), in the kubelet's order; and the items that did not resolve to a uuid. ``devices`` is
    ``slice_devices`` of the node's slices, ``claims`` the ResourceClaims by (namespace, name) (None: unknown),
    ``nvml_migs`` the MIG devices NVML lists (for MIG devices a slice gives no uuid: ``mig_uuid_by_profile``)."""
    grouped: dict[tuple[str, str], dict[str, list[DeviceAssignment]]] = {}
    unresolved: list[ClaimDevice] = []
    for item in items:
        if item.driver_name != DRIVER_NAME:
            continue
        device = devices.get((item.driver_name, item.pool_name, item.device_name))
        if device is not None and device.uuid is None and device.device_type == DEVICE_TYPE_MIG:
            uuid = mig_uuid_by_profile(device, nvml_migs)
            if uuid is not None:
                device = replace(device, uuid=uuid)
        claim = claims.get(item.claim_key)
        result = claim_result_of(claim, item.driver_name, item.pool_name, item.device_name)
        if device is None or device.uuid is None:
            unresolved.append(item)
        containers = grouped.setdefault((item.namespace, item.pod_name), {})
        containers.setdefault(item.container_name, []).append(
            claim_device_assignment(item, device, claim_sharing(claim, _text(result.get("request"))),
                                    across_claims=shared_across_claims(device, result)))
    return ({pod: {c: tuple(a) for c, a in containers.items()} for pod, containers in grouped.items()},
            tuple(unresolved))


def claimed_sharing(
    items: Sequence[ClaimDevice],
    devices: Mapping[tuple[str, str, str], SliceDevice],
    claims: Mapping[tuple[str, str], Mapping[str, Any] | None],
) -> dict[str, tuple[SharingMode, int]]:
    """GPU uuid → (mode, replicas) for the whole GPUs that shared claims hold: MPS for an ``MPS`` strategy, else
    TIME_SLICING, with one replica per pod of the claim (of the claims, for a GPU shared across claims). What the
    collector's samples report for those GPUs (NVML cannot tell time-slicing from exclusive use; the claim's
    config says it, as the device plugin's does). The mode says how the GPU's pods share it, not who pays: that is
    the claim's (``DeviceAssignment.owning_claim``)."""
    out: dict[str, tuple[SharingMode, int]] = {}
    across: dict[str, set[tuple[str, str]]] = {}
    for item in items:
        device = devices.get((item.driver_name, item.pool_name, item.device_name))
        if item.driver_name != DRIVER_NAME or device is None or device.uuid is None:
            continue
        if not device.uuid.startswith("GPU-"):
            continue  # a MIG device: NVML says MIG
        claim = claims.get(item.claim_key)
        result = claim_result_of(claim, item.driver_name, item.pool_name, item.device_name)
        sharing = claim_sharing(claim, _text(result.get("request")))
        mode = SharingMode.MPS if sharing.strategy == MPS else SharingMode.TIME_SLICING
        if shared_across_claims(device, result):
            pods = across.setdefault(device.uuid, set())
            pods.add((item.namespace, item.pod_name))
            out[device.uuid] = (mode, len(pods))
        elif sharing.shared:
            out[device.uuid] = (mode, max(len(sharing.consumers), 1))
    return out


SliceLister = Callable[[], Awaitable[Sequence[Mapping[str, Any]]]]
ClaimReader = Callable[[str, str], Awaitable[Mapping[str, Any] | None]]


class DraResolver:
    """Turns the kubelet's claim devices into ``DeviceAssignment``s, reading slices and claims through the API.

    ``list_slices()`` returns the node's ResourceSlices, ``read_claim(namespace, name)`` one ResourceClaim (None
    when it is gone); either may raise, which leaves the last known answer in use. Counters: ``unresolved_total``
    (claim devices published unresolved), ``foreign_total`` (devices of other drivers, dropped); each distinct
    problem is logged once."""

    def __init__(self, node_name: str, list_slices: SliceLister, read_claim: ClaimReader) -> None:
        self.node_name = node_name
        self._list_slices = list_slices
        self._read_claim = read_claim
        self._devices: dict[tuple[str, str, str], SliceDevice] = {}
        self._listed = False
        self._claims: dict[tuple[str, str], Mapping[str, Any] | None] = {}
        self._logged: set[tuple[str, ...]] = set()
        self.sharing_by_uuid: dict[str, tuple[SharingMode, int]] = {}
        """The shared claims' GPUs as last resolved (``claimed_sharing``)."""
        self.unresolved_total = 0
        self.foreign_total = 0
        self.slice_lists_total = 0

    async def _refresh_slices(self) -> None:
        try:
            slices = await self._list_slices()
        except Exception as exc:  # the API client's errors are many; the last slices stay in use
            self._log_once(("slices",), "listing ResourceSlices of node %s failed: %s", self.node_name, exc)
            return
        self.slice_lists_total += 1
        self._listed = True
        self._devices = slice_devices(slices, self.node_name)

    async def _claim(self, key: tuple[str, str]) -> Mapping[str, Any] | None:
        try:
            self._claims[key] = await self._read_claim(*key)
        except Exception as exc:  # keep the last known claim
            self._log_once(("claim", *key), "reading ResourceClaim %s/%s failed: %s", *key, exc)
        return self._claims.get(key)

    def _log_once(self, key: tuple[str, ...], message: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(message, *args)

    async def assignments(
        self, items: Sequence[ClaimDevice], nvml_migs: Sequence[NvmlMigDevice] = ()
    ) -> dict[tuple[str, str], dict[str, tuple[DeviceAssignment, ...]]]:
        """(namespace, pod) → container → the DeviceAssignments of its claim devices, in the kubelet's order;
        ``nvml_migs``: the MIG devices NVML last listed (see ``resolve_claim_devices``)."""
        ours = []
        for item in items:
            if item.driver_name == DRIVER_NAME:
                ours.append(item)
                continue
            self.foreign_total += 1
            self._log_once(("driver", item.driver_name), "ignoring DRA devices of driver %s (not NVIDIA GPUs)",
                           item.driver_name)
        if not ours:
            return {}
        if not self._listed or any((i.driver_name, i.pool_name, i.device_name) not in self._devices for i in ours):
            await self._refresh_slices()
        claims = {key: await self._claim(key) for key in dict.fromkeys(i.claim_key for i in ours)}
        grouped, unresolved = resolve_claim_devices(ours, self._devices, claims, nvml_migs)
        self.sharing_by_uuid.update(claimed_sharing(ours, self._devices, claims))
        for item in unresolved:
            self.unresolved_total += 1
            device = self._devices.get((item.driver_name, item.pool_name, item.device_name))
            self._log_once(
                ("device", item.pool_name, item.device_name, *item.claim_key),
                "DRA device %s/%s of claim %s/%s (pod %s/%s) is %s: its GPU use is unassigned",
                item.pool_name, item.device_name, *item.claim_key, item.namespace, item.pod_name,
                "in no ResourceSlice of the node" if device is None else "published without a uuid")
        return grouped
