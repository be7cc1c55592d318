"""Deciding how one GPU unit is shared, from what NVML saw and what the kubelet assigned.

Pure: no I/O, no clock. Two kinds of evidence exist and they can disagree:

* the samples: ``GpuDeviceSample.sharing_mode`` (MIG from NVML, MPS from the MPS server, time-slicing from the
  device-plugin configuration) and ``replicas``, plus the MIG structure itself (``parent_uuid``);
* the pods: the device ids the kubelet handed out (``GPU-<uuid>``, ``GPU-<uuid>::N``, ``MIG-<uuid>``,
  ``MIG-GPU-<uuid>/<gi>/<ci>``) and their resource names (``nvidia.com/gpu``, ``nvidia.com/gpu.shared``,
  ``nvidia.com/mig-*``).

The device ids are what the pods were actually given, so where the two disagree the ids win (``::N`` replica ids
mean a shared GPU whatever the sample said; one pod holding the plain id means an exclusive GPU). MIG structure
comes from NVML and cannot be contradicted by a pod. Every decision carries ``evidence`` saying what it rests on
and ``conflict`` when the evidence disagreed, so nothing is guessed silently.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Sequence

from schemas.records import GpuDeviceSample, SharingMode

SHARED_RESOURCE_SUFFIX = ".shared"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
REPLICA_SEPARATOR = "::"


class UnitKind(enum.StrEnum):
    """What a unit of attribution is."""

    GPU = "GPU"  # a whole physical GPU with MIG off
    MIG_INSTANCE = "MIG_INSTANCE"  # one MIG instance (its own memory and compute slices)
    MIG_UNASSIGNED = "MIG_UNASSIGNED"  # the capacity of a MIG-enabled GPU that lies in no instance


class DeviceIdKind(enum.StrEnum):
    GPU = "GPU"  # GPU-<uuid>
    MIG_UUID = "MIG_UUID"  # MIG-<uuid>
    MIG_PATH = "MIG_PATH"  # MIG-GPU-<uuid>/<gi>/<ci>
    OTHER = "OTHER"  # anything else (another vendor's plugin, an index): never matches a unit


@dataclass(frozen=True, slots=True)
class DeviceRef:
    """A parsed device-plugin id. ``base_id`` is the id without its ``::N`` replica suffix."""

    device_id: str
    base_id: str
    replica: int | None
    kind: DeviceIdKind
    gpu_uuid: str | None  # the physical GPU for GPU and MIG_PATH ids
    mig_gpu_instance_id: int | None
    mig_compute_instance_id: int | None

    @property
    def is_replica(self) -> bool:
        return self.replica is not None


def parse_device_id(device_id: str) -> DeviceRef:
    """Parse one device-plugin id. Never raises: an id of no known form is kind OTHER."""
    base_id, sep, tail = device_id.partition(REPLICA_SEPARATOR)
    replica: int | None = None
    if sep:
        # A malformed replica suffix still marks a replica: the plugin only appends "::" for shared devices.
        replica = int(tail) if tail.isdigit() else -1
    if base_id.startswith("MIG-GPU-"):
        path = base_id[len("MIG-") :].split("/")
        if len(path) == 3 and path[1].isdigit() and path[2].isdigit():
            return DeviceRef(device_id, base_id, replica, DeviceIdKind.MIG_PATH, path[0], int(path[1]), int(path[2]))
        return DeviceRef(device_id, base_id, replica, DeviceIdKind.OTHER, None, None, None)
    if base_id.startswith("MIG-"):
        return DeviceRef(device_id, base_id, replica, DeviceIdKind.MIG_UUID, None, None, None)
    if base_id.startswith("GPU-"):
        return DeviceRef(device_id, base_id, replica, DeviceIdKind.GPU, base_id, None, None)
    return DeviceRef(device_id, base_id, replica, DeviceIdKind.OTHER, None, None, None)


def device_keys(
    kind: UnitKind, unit_uuid: str, parent_uuid: str | None, device: GpuDeviceSample | None
) -> tuple[str, ...]:
    """The base device ids that name this unit: what the kubelet would have handed a pod holding it.

    A MIG instance is named by its own ``MIG-<uuid>`` and by ``MIG-<parent>/<gi>/<ci>``; a whole GPU by its uuid.
    The unassigned capacity of a MIG GPU is named by nothing a pod can hold; the parent uuid is returned so a pod
    holding the plain id of a MIG-enabled GPU is seen (and reported as a conflict).
    """
    if kind is UnitKind.MIG_INSTANCE:
        keys = [unit_uuid]
        if (
            parent_uuid is not None
            and device is not None
            and device.mig_gpu_instance_id is not None
            and device.mig_compute_instance_id is not None
        ):
            keys.append(f"MIG-{parent_uuid}/{device.mig_gpu_instance_id}/{device.mig_compute_instance_id}")
        return tuple(keys)
    return (unit_uuid,)


@dataclass(frozen=True, slots=True)
class UnitAssignment:
    """One pod's claim on one unit: the ids it was given that name the unit."""

    pod_uid: str
    resource_names: tuple[str, ...]
    device_ids: tuple[str, ...]

    @property
    def replica_ids(self) -> int:
        return sum(1 for d in self.device_ids if REPLICA_SEPARATOR in d)

    @property
    def plain_ids(self) -> int:
        return sum(1 for d in self.device_ids if REPLICA_SEPARATOR not in d)

    @property
    def shared_resource(self) -> bool:
        return any(r.endswith(SHARED_RESOURCE_SUFFIX) for r in self.resource_names)

    @property
    def mig_resource(self) -> bool:
        return any(r.startswith(MIG_RESOURCE_PREFIX) for r in self.resource_names)

    def claim_replicas(self, unit_replicas: int) -> int:
        """How many of the unit's ``unit_replicas`` slots this pod holds: one per replica id, all for a plain id."""
        if self.plain_ids:
            return max(unit_replicas, 1)
        return self.replica_ids


@dataclass(frozen=True, slots=True)
class ModeDecision:
    """How a unit was shared in a window and why.

    ``dedicated_owner`` is the uid of the one pod that holds the whole unit (an exclusive GPU, or a MIG instance
    no one else was given); it pays the unit's cost. ``conflict`` is True when samples and device ids disagreed.
    """

    mode: SharingMode
    dedicated_owner: str | None
    evidence: str
    conflict: bool
    sample_mode: SharingMode
    replicas: int


def majority_sample_mode(devices: Iterable[tuple[GpuDeviceSample, float]]) -> tuple[SharingMode, bool]:
    """The sharing mode the samples report for most of the window (by weight), and whether it changed.

    Ties are broken by a fixed order so the answer is deterministic.
    """
    weights: dict[SharingMode, float] = {}
    for device, weight in devices:
        mode = device.sharing_mode
        weights[mode] = weights.get(mode, 0.0) + max(weight, 0.0)
    if not weights:
        return SharingMode.UNKNOWN, False
    order = _MODE_ORDER
    best = max(weights.items(), key=lambda item: (item[1], -order.index(item[0])))[0]
    return best, len(weights) > 1


_MODE_ORDER = (SharingMode.MIG, SharingMode.MPS, SharingMode.TIME_SLICING, SharingMode.EXCLUSIVE, SharingMode.UNKNOWN)


def decide_mode(
    kind: UnitKind,
    sample_mode: SharingMode,
    replicas: int,
    assignments: Sequence[UnitAssignment],
    *,
    sample_mode_changed: bool = False,
) -> ModeDecision:
    """Decide the unit's sharing mode.

    ``sample_mode`` and ``replicas`` come from the unit's samples (``majority_sample_mode`` and the largest
    ``replicas`` seen); ``assignments`` are the pods holding ids that name the unit, alive during the window.
    """
    replicas = max(int(replicas), 1)
    notes: list[str] = []
    if sample_mode_changed:
        notes.append(f"sample sharing_mode changed within the window; majority {sample_mode}")
    owners = sorted(a.pod_uid for a in assignments)

    if kind is UnitKind.MIG_UNASSIGNED:
        conflict = bool(assignments)
        notes.insert(0, "MIG capacity in no instance: all idle")
        if assignments:
            notes.append(f"pods {owners} hold the plain id of a MIG-enabled GPU; ignored")
        return ModeDecision(SharingMode.MIG, None, "; ".join(notes), conflict, sample_mode, replicas)

    if kind is UnitKind.MIG_INSTANCE:
        conflict = False
        notes.insert(0, "MIG instance (parent_uuid set by NVML)")
        if sample_mode is not SharingMode.MIG:
            conflict = True
            notes.append(f"sample said {sample_mode}; NVML structure wins")
        replicated = any(a.replica_ids for a in assignments) or replicas > 1
        owner = None
        if len(assignments) == 1 and not replicated:
            owner = assignments[0].pod_uid
            notes.append(f"held by one pod {owner}")
        elif assignments:
            notes.append(f"shared by {len(assignments)} pods" + (" through replica ids" if replicated else ""))
            if len(assignments) > 1 and not replicated:
                conflict = True
                notes.append("several pods hold the plain instance id")
        else:
            notes.append("no pod holds the instance")
        for a in assignments:
            if not a.mig_resource and not any(r == "nvidia.com/gpu" for r in a.resource_names):
                notes.append(f"pod {a.pod_uid} holds it through {list(a.resource_names)}")
        return ModeDecision(SharingMode.MIG, owner, "; ".join(notes), conflict, sample_mode, replicas)

    # A whole GPU.
    if sample_mode is SharingMode.MIG:
        # The windowing turns MIG parents into MIG_UNASSIGNED units; a GPU unit reporting MIG means the mode
        # changed inside the window. Its non-MIG ticks are attributed by usage.
        notes.append("sample said MIG for a GPU with no instances")
        sample_mode = SharingMode.UNKNOWN
    replicated_ids = [a for a in assignments if a.replica_ids or a.shared_resource]
    plain_holders = [a for a in assignments if a.plain_ids and not a.shared_resource]
    mig_claims = [a for a in assignments if a.mig_resource]
    conflict = False
    if mig_claims:
        conflict = True
        notes.append(f"pods {sorted(a.pod_uid for a in mig_claims)} hold a MIG resource for a GPU with MIG off")

    owner: str | None = None
    if replicated_ids and not plain_holders:
        mode = SharingMode.MPS if sample_mode is SharingMode.MPS else SharingMode.TIME_SLICING
        notes.insert(0, f"{len(replicated_ids)} pods hold replica ids (::N or .shared)")
        if sample_mode in (SharingMode.EXCLUSIVE,):
            conflict = True
            notes.append(f"sample said {sample_mode} with replicas={replicas}; device ids win")
        elif sample_mode is SharingMode.UNKNOWN:
            notes.append("sample mode UNKNOWN; device ids decide")
    elif plain_holders and not replicated_ids and len(plain_holders) == 1 and len(assignments) == 1:
        mode = SharingMode.EXCLUSIVE
        owner = plain_holders[0].pod_uid
        notes.insert(0, f"one pod {owner} holds the plain GPU id")
        if sample_mode in (SharingMode.TIME_SLICING, SharingMode.MPS):
            conflict = True
            notes.append(f"sample said {sample_mode} with replicas={replicas}; device ids win")
    elif plain_holders:
        # Several pods holding one GPU, or plain and replica ids mixed: the ids are inconsistent with any
        # single-owner reading, so attribute by usage.
        mode = SharingMode.MPS if sample_mode is SharingMode.MPS else SharingMode.TIME_SLICING
        conflict = True
        notes.insert(
            0,
            f"{len(plain_holders)} pods hold the plain id and {len(replicated_ids)} replica ids: inconsistent, "
            "attributed by usage",
        )
    else:
        if sample_mode is SharingMode.UNKNOWN:
            if replicas > 1:
                mode = SharingMode.TIME_SLICING
                notes.insert(0, f"no pod holds the GPU; sample mode UNKNOWN with replicas={replicas}")
            else:
                mode = SharingMode.UNKNOWN
                notes.insert(0, "no pod holds the GPU and the sample does not say how it is shared; by usage")
        else:
            mode = sample_mode
            notes.insert(0, f"no pod holds the GPU; sample said {sample_mode}")
    return ModeDecision(mode, owner, "; ".join(notes), conflict, sample_mode, replicas)
