"""What a device-plugin id and a GPU resource name mean: the one owner of that knowledge for every service.

The collector records the ids the kubelet handed each container (PodResources API) and the ``NVIDIA_VISIBLE_DEVICES``
a spec sets; the attributor decides from them who holds a unit; the guard who may see one. They must agree, so the
grammar and the matching rules live here, in the schema package the three share.

Device ids (NVIDIA device plugin, ``deviceIDStrategy: uuid``):

* ``GPU-<uuid>`` — a whole GPU; ``GPU-<uuid>::<n>`` — replica ``n`` of a time-sliced or MPS-shared GPU;
* ``MIG-<uuid>`` — a MIG device by its own UUID; ``MIG-GPU-<uuid>/<gi>/<ci>`` — by parent GPU, GPU instance and
  compute instance (older drivers); either with ``::<n>``: a replica of a shared MIG device.

Other forms of the same devices -- the index strategy (``0``, ``0::3``, MIG ``0:1``) and CDI names
(``nvidia.com/gpu=0``) -- are turned into these by the collector, which knows the node's NVML indexes
(``resolve_device_id``), so every reader sees uuid forms. Anything else parses as kind ``OTHER`` (never raises): it names a unit only if it is that unit's uuid verbatim, and
reaches none. Hex digits of known forms are lowercased, as NVML reports UUIDs (units are named by NVML's strings). Two questions are answered about an id and a unit, and they differ on purpose:

* ``covers`` — could a container given this id reach the unit (visibility): a GPU id reaches the GPU and every MIG
  instance on it;
* ``names_unit`` — is the unit what the id hands out (attribution: who holds it): a GPU id names a whole GPU, a
  MIG id its instance; the plain id of a MIG-enabled GPU names none of its instances.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

REPLICA_SEPARATOR = "::"
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
MPS_THREAD_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
VALUE_FROM_MARK = "<valueFrom>"
"""What the collector records for ``NVIDIA_VISIBLE_DEVICES`` set from a ConfigMap, Secret or field ref."""
NO_DEVICES_VALUES = frozenset({"", "void", "none"})
"""``NVIDIA_VISIBLE_DEVICES`` values that give a container no GPU (``none``: driver libraries only)."""

GPU_RESOURCE = "nvidia.com/gpu"
HAMI_RESOURCE = "hami.io/vgpu"
"""The resource name the collector records for the GPUs HAMi allocated (``schemas.hami``): not a name the kubelet
advertises (HAMi's device plugin registers ``nvidia.com/gpu``, as slots), the mark that a HAMi vGPU -- a share of a
GPU that HAMi's CUDA interception limits, time-shared with the GPU's other pods -- was given, by HAMi's annotation."""
HAMI_REQUEST_RESOURCES = frozenset({"nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores"})
"""HAMi's quantities of a vGPU: device memory (MiB), device memory (percent), SMs (percent). Requests, not device
counts: kept with a container's GPU requests, never counted as devices."""
SHARED_RESOURCE_SUFFIX = ".shared"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
# nvidia.com/gpu, its time-slicing rename nvidia.com/gpu.shared, and MIG mixed-strategy profiles such as
# nvidia.com/mig-1g.10gb, nvidia.com/mig-1g.10gb+me, nvidia.com/mig-1c.3g.40gb (and their ".shared" renames).
# Profile names grow with each GPU generation, so any name under nvidia.com/mig- counts.
_GPU_RESOURCE = re.compile(r"nvidia\.com/(?:gpu(?:\.shared)?|mig-[0-9a-z][0-9a-z.+-]*)")

_CDI_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*/[A-Za-z0-9][A-Za-z0-9._-]*=(?P<device>.+)")
_INDEX_ID = re.compile(r"(?:0|[1-9][0-9]{0,3})(?::(?:0|[1-9][0-9]{0,3}))?")
_INSTANCE_PATH = re.compile(r"(?P<gpu>GPU-[^/]+)/(?P<gi>0|[1-9][0-9]{0,8})/(?P<ci>0|[1-9][0-9]{0,8})")


class DeviceIdKind(enum.StrEnum):
    GPU = "GPU"  # GPU-<uuid>
    MIG_UUID = "MIG_UUID"  # MIG-<uuid>
    MIG_PATH = "MIG_PATH"  # MIG-GPU-<uuid>/<gi>/<ci>
    OTHER = "OTHER"  # anything else (another vendor's plugin, the index strategy): names no unit


@dataclass(frozen=True, slots=True)
class DeviceRef:
    """A parsed device id. ``base_id`` is the id without its ``::N`` replica suffix, lowercased where it is a known
    form; ``gpu_uuid`` the physical GPU (GPU and MIG_PATH ids), ``mig_uuid`` the instance (MIG_UUID ids)."""

    device_id: str
    base_id: str
    replica: int | None
    kind: DeviceIdKind
    gpu_uuid: str | None
    mig_uuid: str | None
    mig_gpu_instance_id: int | None
    mig_compute_instance_id: int | None

    @property
    def is_replica(self) -> bool:
        return self.replica is not None

    @property
    def is_mig(self) -> bool:
        return self.kind in (DeviceIdKind.MIG_UUID, DeviceIdKind.MIG_PATH)


def parse_device_id(device_id: str) -> DeviceRef:
    """Parse one device id. Never raises: an id of no known form is kind ``OTHER``. The forms are told apart by
    their prefixes (``GPU-``, ``MIG-``, ``MIG-GPU-…/<gi>/<ci>``), not by the UUID's shape, so a new UUID format of
    a driver still parses; what follows a prefix is lowercased."""
    text = device_id if isinstance(device_id, str) else str(device_id)
    base, sep, tail = text.partition(REPLICA_SEPARATOR)
    replica: int | None = None
    if sep:
        # A malformed replica suffix still marks a replica: the plugin only appends "::" for shared devices.
        replica = int(tail) if tail.isdigit() and len(tail) < 10 else -1
    if base.startswith("MIG-GPU-"):
        match = _INSTANCE_PATH.fullmatch(base[len("MIG-"):])
        if match and len(match.group("gpu")) > len("GPU-"):
            gpu = "GPU-" + match.group("gpu")[len("GPU-"):].lower()
            gi, ci = int(match.group("gi")), int(match.group("ci"))
            return DeviceRef(text, f"MIG-{gpu}/{gi}/{ci}", replica, DeviceIdKind.MIG_PATH, gpu, None, gi, ci)
        return DeviceRef(text, base, replica, DeviceIdKind.OTHER, None, None, None, None)
    if base.startswith("MIG-") and len(base) > len("MIG-") and "/" not in base:
        mig = "MIG-" + base[len("MIG-"):].lower()
        return DeviceRef(text, mig, replica, DeviceIdKind.MIG_UUID, None, mig, None, None)
    if base.startswith("GPU-") and len(base) > len("GPU-") and "/" not in base:
        gpu = "GPU-" + base[len("GPU-"):].lower()
        return DeviceRef(text, gpu, replica, DeviceIdKind.GPU, gpu, None, None, None)
    return DeviceRef(text, base, replica, DeviceIdKind.OTHER, None, None, None, None)


def resolve_device_id(device_id: str, uuid_by_index: Mapping[str, str]) -> str:
    """``device_id`` in the uuid form the rest of this module reads, where it is another form of the same device:

    * a CDI name (``<vendor>/<class>=<device>``, e.g. ``nvidia.com/gpu=0``, ``nvidia.com/gpu=GPU-<uuid>``,
      ``nvidia.com/gpu=all``; the device plugin's ``deviceListStrategy: cdi-annotations|cdi-cri``) is its device
      part, resolved in turn;
    * an index id (``deviceIDStrategy: index``: ``0``, ``0::3`` for a replica, ``0:1`` for MIG device 1 of GPU 0)
      is the uuid ``uuid_by_index`` maps it to (``NvmlBackend.uuid_by_index``), its replica suffix kept.

    Anything else, an index no device has included, is returned as it is (a uuid id, or an id that names no
    unit). Never raises."""
    text = device_id if isinstance(device_id, str) else str(device_id)
    cdi = _CDI_NAME.fullmatch(text)
    device = cdi.group("device") if cdi is not None else text
    base, sep, tail = device.partition(REPLICA_SEPARATOR)
    if _INDEX_ID.fullmatch(base):
        uuid = uuid_by_index.get(base)
        if uuid is not None:
            return uuid + sep + tail
    if cdi is not None and (device == "all" or base.startswith(("GPU-", "MIG-"))):
        return device
    # Another CDI device (a DRA claim's ``k8s.gpu.nvidia.com/claim=<uid>-gpu-0``) says nothing of its uuid here.
    return text


def resolve_visible_devices(value: str | None, uuid_by_index: Mapping[str, str]) -> str | None:
    """An ``NVIDIA_VISIBLE_DEVICES`` value with each listed device in uuid form (``resolve_device_id``); ``all``,
    ``none``, ``void``, an empty value and ``VALUE_FROM_MARK`` are kept as they are."""
    if value is None or value == VALUE_FROM_MARK:
        return value
    items = [item.strip() for item in value.split(",")]
    resolved = [resolve_device_id(item, uuid_by_index) if item else item for item in items]
    return ",".join(resolved) if resolved != items else value


def base_device_id(device_id: str) -> str:
    """The id without its replica suffix, in the form ``unit_keys`` names units by."""
    return parse_device_id(device_id).base_id


def is_gpu_resource(resource_name: str) -> bool:
    """True for the extended resources the NVIDIA device plugin advertises for GPUs and MIG devices (each a count
    of devices), and for ``HAMI_RESOURCE`` (the GPUs HAMi allocated, by its annotation)."""
    return isinstance(resource_name, str) and (
        _GPU_RESOURCE.fullmatch(resource_name) is not None or resource_name == HAMI_RESOURCE)


def is_hami_request_resource(resource_name: str) -> bool:
    """HAMi's vGPU quantities (``nvidia.com/gpumem``, ``nvidia.com/gpumem-percentage``, ``nvidia.com/gpucores``):
    requested with a GPU, recorded with its requests, but MiB and percent, not devices."""
    return resource_name in HAMI_REQUEST_RESOURCES


def is_hami_resource(resource_name: str) -> bool:
    """The collector's record of a GPU HAMi allocated (``HAMI_RESOURCE``)."""
    return resource_name == HAMI_RESOURCE


def is_shared_resource(resource_name: str) -> bool:
    """A time-slicing or MPS rename (``nvidia.com/gpu.shared``, ``nvidia.com/mig-1g.10gb.shared``)."""
    return resource_name.endswith(SHARED_RESOURCE_SUFFIX)


def is_mig_resource(resource_name: str) -> bool:
    return resource_name.startswith(MIG_RESOURCE_PREFIX)


def unit_keys(unit_uuid: str, parent_uuid: str | None, gpu_instance_id: int | None,
              compute_instance_id: int | None, *, mig_instance: bool) -> tuple[str, ...]:
    """The base ids that name a unit (``names_unit``): a whole GPU by its uuid; a MIG instance by ``MIG-<uuid>``
    and, when its instance ids are known, ``MIG-<parent>/<gi>/<ci>``. The capacity of a MIG-enabled GPU in no
    instance is named by nothing a pod can hold: its parent uuid is returned, so a pod holding the plain id of a
    MIG-enabled GPU is seen (and reported as a conflict)."""
    unit = base_device_id(unit_uuid)  # NVML's uuid in the form a device id takes
    if not mig_instance:
        return (unit,)
    keys = [unit]
    if parent_uuid is not None and gpu_instance_id is not None and compute_instance_id is not None:
        keys.append(f"MIG-{base_device_id(parent_uuid)}/{gpu_instance_id}/{compute_instance_id}")
    return tuple(keys)


def names_unit(ref: DeviceRef, unit_uuid: str, parent_uuid: str | None, gpu_instance_id: int | None,
               compute_instance_id: int | None) -> bool:
    """Whether ``ref`` hands out the unit (a whole GPU when ``parent_uuid`` is None, else a MIG instance)."""
    return ref.base_id in unit_keys(unit_uuid, parent_uuid, gpu_instance_id, compute_instance_id,
                                    mig_instance=parent_uuid is not None)


def covers(ref: DeviceRef, unit_uuid: str, parent_uuid: str | None, gpu_instance_id: int | None,
           compute_instance_id: int | None) -> bool:
    """Whether a container given ``ref`` can reach the unit: a GPU id (plain or ``::N``) reaches that GPU and,
    when MIG is on, each of its instances; a MIG id its instance only."""
    unit = unit_uuid.lower()
    parent = parent_uuid.lower() if parent_uuid is not None else None
    if ref.kind is DeviceIdKind.GPU:
        gpu = ref.gpu_uuid.lower()  # type: ignore[union-attr]
        return gpu == unit or gpu == parent
    if ref.kind is DeviceIdKind.MIG_UUID:
        return ref.mig_uuid.lower() == unit  # type: ignore[union-attr]
    if ref.kind is DeviceIdKind.MIG_PATH:
        return (ref.gpu_uuid.lower() == parent  # type: ignore[union-attr]
                and ref.mig_gpu_instance_id == gpu_instance_id
                and ref.mig_compute_instance_id == compute_instance_id)
    return False


class CoveringCount:
    """How many of ``refs`` reach a unit: ``count(...)`` equals ``sum(covers(ref, ...) for ref in refs)``, by
    looking the unit up among the refs' targets (counted once) rather than testing every ref per unit."""

    __slots__ = ("_counts",)

    def __init__(self, refs: Iterable[DeviceRef]) -> None:
        counts: dict[tuple, int] = {}
        for ref in refs:
            if ref.kind is DeviceIdKind.GPU:
                target: tuple = ("gpu", ref.gpu_uuid.lower())  # type: ignore[union-attr]
            elif ref.kind is DeviceIdKind.MIG_UUID:
                target = ("mig", ref.mig_uuid.lower())  # type: ignore[union-attr]
            elif ref.kind is DeviceIdKind.MIG_PATH:
                target = ("path", ref.gpu_uuid.lower(),  # type: ignore[union-attr]
                          ref.mig_gpu_instance_id, ref.mig_compute_instance_id)
            else:
                continue  # an OTHER id reaches no unit
            counts[target] = counts.get(target, 0) + 1
        self._counts = counts

    def count(self, unit_uuid: str, parent_uuid: str | None, gpu_instance_id: int | None,
              compute_instance_id: int | None) -> int:
        counts = self._counts
        if not counts:
            return 0
        unit = unit_uuid.lower()
        n = counts.get(("gpu", unit), 0) + counts.get(("mig", unit), 0)
        if parent_uuid is not None:
            parent = parent_uuid.lower()
            if parent != unit:  # a GPU id equal to both counts once, as covers' ``or``
                n += counts.get(("gpu", parent), 0)
            n += counts.get(("path", parent, gpu_instance_id, compute_instance_id), 0)
        return n


def holds_whole(ref: DeviceRef, unit_uuid: str, parent_uuid: str | None, gpu_instance_id: int | None,
                compute_instance_id: int | None) -> bool:
    """Whether ``ref`` gives its pod the whole unit: a plain (no ``::N``) id that names it."""
    return ref.replica is None and names_unit(ref, unit_uuid, parent_uuid, gpu_instance_id, compute_instance_id)
