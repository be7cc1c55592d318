"""Deciding how one GPU unit is shared, from what NVML saw and what the kubelet assigned.

Pure: no I/O, no clock. Two kinds of evidence exist and they can disagree:

* the samples: ``GpuDeviceSample.sharing_mode`` (MIG from NVML, MPS from the MPS server, time-slicing from the
  device-plugin configuration) and ``replicas``, plus the MIG structure itself (``parent_uuid``);
* the pods: the device ids the kubelet handed out (``GPU-<uuid>``, ``GPU-<uuid>::N``, ``MIG-<uuid>``,
  ``MIG-GPU-<uuid>/<gi>/<ci>``) and their resource names (``nvidia.com/gpu``, ``nvidia.com/gpu.shared``,
  ``nvidia.com/mig-*``).

A unit allocated through a DRA ResourceClaim that holds it alone (``DeviceAssignment.owning_claim``, which the
collector sets from the platform's allocation, never from the claim's config) is the claim's: when every pod
holding it holds it through that one claim, those pods pay it together (``ModeDecision.claim_owners``), split by
use, whatever sharing the claim configures -- nobody outside the claim can be scheduled onto it.

The device ids are what the pods were actually given, so where the two disagree the ids win (``::N`` replica ids
mean a shared GPU whatever the sample said; one pod holding the plain id means an exclusive GPU). A GPU held
through HAMi (``hami.io/vgpu``, from HAMi's allocation annotation) is shared like a replica -- even by one pod,
whose vGPU is a share, not the GPU: attributed by use, never owned. MIG structure
comes from NVML and cannot be contradicted by a pod. Every decision carries ``evidence`` saying what it rests on
and ``conflict`` when the evidence disagreed, so nothing is guessed silently.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from schemas.devices import REPLICA_SEPARATOR, is_hami_resource, is_mig_resource, is_shared_resource, unit_keys
from schemas.records import GpuDeviceSample, SharingMode

class UnitKind(enum.StrEnum):
    """What a unit of attribution is."""

    GPU = "GPU"  # a whole physical GPU with MIG off
    MIG_INSTANCE = "MIG_INSTANCE"  # one MIG instance (its own memory and compute slices)
    MIG_UNASSIGNED = "MIG_UNASSIGNED"  # the capacity of a MIG-enabled GPU that lies in no instance


def device_keys(
    kind: UnitKind, unit_uuid: str, parent_uuid: str | None, device: GpuDeviceSample | None
) -> tuple[str, ...]:
    """The base device ids that name this unit (``schemas.devices.unit_keys``): what the kubelet would have handed a
    pod holding it. A MIG instance is named by its own ``MIG-<uuid>`` and by ``MIG-<parent>/<gi>/<ci>``; a whole
    GPU, and the unassigned capacity of a MIG GPU (so a pod holding the plain id is seen), by the GPU's uuid."""
    instance = kind is UnitKind.MIG_INSTANCE
    gi = device.mig_gpu_instance_id if instance and device is not None else None
    ci = device.mig_compute_instance_id if instance and device is not None else None
    return unit_keys(unit_uuid, parent_uuid, gi, ci, mig_instance=instance)


@dataclass(frozen=True, slots=True)
class UnitAssignment:
    """One pod's claim on one unit: the ids it was given that name the unit."""

    pod_uid: str
    resource_names: tuple[str, ...]
    device_ids: tuple[str, ...]
    owning_claims: tuple[str | None, ...] = ()  # per device id: the DRA claim holding it alone (None: none)

    @property
    def owning_claim(self) -> str | None:
        """The one DRA claim through which the pod holds every one of its ids of the unit, else None."""
        claims = set(self.owning_claims)
        if len(claims) != 1 or len(self.owning_claims) != len(self.device_ids):
            return None
        return claims.pop()

    @property
    def replica_ids(self) -> int:
        return sum(1 for d in self.device_ids if REPLICA_SEPARATOR in d)

    @property
    def plain_ids(self) -> int:
        return sum(1 for d in self.device_ids if REPLICA_SEPARATOR not in d)

    @property
    def shared_resource(self) -> bool:
        return any(is_shared_resource(r) for r in self.resource_names)

    @property
    def mig_resource(self) -> bool:
        return any(is_mig_resource(r) for r in self.resource_names)

    @property
    def hami_resource(self) -> bool:
        """Held as a HAMi vGPU (``schemas.devices.HAMI_RESOURCE``): a share of the GPU, never the whole of it."""
        return any(is_hami_resource(r) for r in self.resource_names)

    def claim_replicas(self, unit_replicas: int) -> int:
        """How many of the unit's ``unit_replicas`` slots this pod holds: one per replica id, all for a plain id."""
        if self.plain_ids:
            return max(unit_replicas, 1)
        return self.replica_ids


@dataclass(frozen=True, slots=True)
class ModeDecision:
    """How a unit was shared in a window and why.

    ``dedicated_owner`` is the uid of the one pod that holds the whole unit (an exclusive GPU, or a MIG instance
    no one else was given); it pays the unit's cost. ``claim_owners`` are the uids of the pods that hold the unit
    through the one DRA claim it is allocated to (``owning_claim``) when that is not a single pod's plain id: they
    pay the unit's cost together, split by use. ``conflict`` is True when samples and device ids disagreed.
    """

    mode: SharingMode
    dedicated_owner: str | None
    evidence: str
    conflict: bool
    sample_mode: SharingMode
    replicas: int
    claim_owners: tuple[str, ...] = ()
    owning_claim: str | None = None


def majority_sample_mode(devices: Iterable[tuple[GpuDeviceSample, float]]) -> tuple[SharingMode, bool]:
    """The sharing mode the samples report for most of the window (by weight), and whether it changed.

    Ties are broken by a fixed order so the answer is deterministic.
    """
    weights: dict[SharingMode, float] = {}
    for device, weight in devices:
        mode = device.sharing_mode
        weights[mode] = weights.get(mode, 0.0) + max(weight, 0.0)
    return majority_of(weights)


def majority_of(weights: Mapping[SharingMode, float]) -> tuple[SharingMode, bool]:
    """``majority_sample_mode`` of a window whose ticks' weights per sharing mode are ``weights`` (each summed in
    tick order, negative weights as 0)."""
    if not weights:
        return SharingMode.UNKNOWN, False
    order = _MODE_ORDER
    best = max(weights.items(), key=lambda item: (item[1], -order.index(item[0])))[0]
    return best, len(weights) > 1


_MODE_ORDER = (SharingMode.MIG, SharingMode.MPS, SharingMode.TIME_SLICING, SharingMode.EXCLUSIVE, SharingMode.UNKNOWN)


def owning_claim_of(assignments: Sequence[UnitAssignment]) -> tuple[str | None, bool]:
    """The DRA claim that holds the unit alone, when every one of ``assignments`` holds it through that claim
    (None otherwise), and whether the holders name several such claims -- which the platform never allocates (a
    device that allows one allocation goes to one claim): a conflict."""
    claims = {a.owning_claim for a in assignments}
    named = {c for a in assignments for c in a.owning_claims if c is not None}
    if len(claims) == 1 and None not in claims:
        return claims.pop(), False
    return None, len(named) > 1


def _claim_decision(kind: UnitKind, mode: SharingMode, claim: str, assignments: Sequence[UnitAssignment],
                    notes: list[str], conflict: bool, sample_mode: SharingMode, replicas: int) -> ModeDecision:
    owners = tuple(sorted(a.pod_uid for a in assignments))
    what = "MIG instance" if kind is UnitKind.MIG_INSTANCE else "GPU"
    notes.insert(0, f"{what} allocated to DRA claim {claim} alone: its {len(owners)} pod(s) {list(owners)} pay it "
                    "together, split by use")
    return ModeDecision(mode, None, "; ".join(notes), conflict, sample_mode, replicas, owners, claim)


_DECISIONS: dict[tuple, ModeDecision] = {}
_DECISIONS_MAX = 16_384


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

    Pure, and asked again with the same evidence for every unit of every window (its first tick, its close): the
    decision (immutable) is remembered per evidence, for the evidence's exact types (a plain ``str`` mode equals its
    ``SharingMode`` but is not read alike); the memory is emptied when it holds ``_DECISIONS_MAX`` of them.
    """
    key = (kind, type(kind), sample_mode, type(sample_mode), replicas, type(replicas), tuple(assignments),
           sample_mode_changed)
    try:
        decision = _DECISIONS.get(key)
    except TypeError:  # evidence that cannot be a key (an assignment of unhashable fields): decided every time
        return _decide_mode(kind, sample_mode, replicas, assignments, sample_mode_changed)
    if decision is None:
        decision = _decide_mode(kind, sample_mode, replicas, assignments, sample_mode_changed)
        if len(_DECISIONS) >= _DECISIONS_MAX:
            _DECISIONS.clear()
        _DECISIONS[key] = decision
    return decision


def _decide_mode(kind: UnitKind, sample_mode: SharingMode, replicas: int, assignments: Sequence[UnitAssignment],
                 sample_mode_changed: bool) -> ModeDecision:
    replicas = max(int(replicas), 1)
    notes: list[str] = []
    if sample_mode_changed:
        notes.append(f"sample sharing_mode changed within the window; majority {sample_mode}")
    owners = sorted(a.pod_uid for a in assignments)
    claim, claims_conflict = owning_claim_of(assignments) if assignments else (None, False)
    if claims_conflict:
        notes.append("pods hold the unit through several DRA claims that each should hold it alone")

    if kind is UnitKind.MIG_UNASSIGNED:
        conflict = bool(assignments)
        notes.insert(0, "MIG capacity in no instance: all idle")
        if assignments:
            notes.append(f"pods {owners} hold the plain id of a MIG-enabled GPU; ignored")
        return ModeDecision(SharingMode.MIG, None, "; ".join(notes), conflict, sample_mode, replicas)

    if kind is UnitKind.MIG_INSTANCE:
        conflict = claims_conflict
        notes.insert(0, "MIG instance (parent_uuid set by NVML)")
        if sample_mode is not SharingMode.MIG:
            conflict = True
            notes.append(f"sample said {sample_mode}; NVML structure wins")
        replicated = any(a.replica_ids for a in assignments) or replicas > 1
        owner = None
        if claim is not None and (len(assignments) > 1 or replicated):
            return _claim_decision(kind, SharingMode.MIG, claim, assignments, notes, conflict, sample_mode, replicas)
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
    # A HAMi vGPU is a share of the GPU by its plain id: time-shared with the GPU's other pods, like a replica.
    replicated_ids = [a for a in assignments if a.replica_ids or a.shared_resource or a.hami_resource]
    plain_holders = [a for a in assignments if a.plain_ids and not (a.shared_resource or a.hami_resource)]
    hami_holders = [a for a in replicated_ids if a.hami_resource]
    mig_claims = [a for a in assignments if a.mig_resource]
    conflict = claims_conflict
    if mig_claims:
        conflict = True
        notes.append(f"pods {sorted(a.pod_uid for a in mig_claims)} hold a MIG resource for a GPU with MIG off")

    owner: str | None = None
    if claim is not None and not (len(plain_holders) == 1 and len(assignments) == 1):
        # The claim's pods share the GPU among themselves (time-slicing, or the MPS daemon the driver starts for
        # the claim): the mode says how they split it, not who pays.
        mode = SharingMode.MPS if sample_mode is SharingMode.MPS else SharingMode.TIME_SLICING
        return _claim_decision(kind, mode, claim, assignments, notes, conflict, sample_mode, replicas)
    if replicated_ids and not plain_holders:
        mode = SharingMode.MPS if sample_mode is SharingMode.MPS else SharingMode.TIME_SLICING
        notes.insert(0, f"{len(replicated_ids)} pods hold replica ids (::N or .shared)" if not hami_holders else
                     f"{len(replicated_ids)} pods hold replica ids (::N or .shared) or HAMi vGPUs "
                     f"({len(hami_holders)}, hami.io/vgpu-devices-allocated): attributed by use")
        if sample_mode in (SharingMode.EXCLUSIVE,) and len(hami_holders) == len(replicated_ids):
            # HAMi shares a GPU by its own CUDA interception, not the device plugin's time-slicing: the device
            # plugin's configuration (what the sample reports) says nothing of it.
            notes.append(f"sample said {sample_mode}: HAMi shares GPUs without the device plugin's time-slicing")
        elif sample_mode in (SharingMode.EXCLUSIVE,):
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
