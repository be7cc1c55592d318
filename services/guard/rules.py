"""The guard's rules: pure functions over the typed records that say which conditions are true NOW.

Nothing here keeps state, reads a clock or talks to Kafka. Each rule takes what it needs (a ``NodeSample``, the
node's pods as ``PodView``s, an ``IdleRun``, a ``BudgetSpend``, times passed in) and returns a tuple of
``Condition``s, one per subject the condition holds for. ``services/guard/engine.py`` keeps the state (pods,
idle runs, spend, when a node was last heard) and turns conditions into violations with a hold-down; the rules,
their thresholds and evidence keys are documented in ``docs/guard.md``.

A ``Condition``'s identity is its ``fingerprint``: a stable hash of the rule, the subject fields and
``qualifier`` (the budget period). Its severity, summary and evidence describe the current state and may change
while the identity stays the same.
"""

from __future__ import annotations

import hashlib
import json
from calendar import monthrange
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

from gpumeter.errors import InvalidMessage
from schemas.records import (
    CostSubjectKind,
    GpuDeviceSample,
    GpuShare,
    NodeSample,
    PodContainer,
    PodEvent,
    PodEventType,
    Severity,
    ShareSubjectKind,
    SharingMode,
)
from schemas.devices import (
    NO_DEVICES_VALUES,
    REPLICA_SEPARATOR,
    VALUE_FROM_MARK,
    VISIBLE_DEVICES_ENV,
    CoveringCount,
    DeviceIdKind,
    DeviceRef,
    covers,
    holds_whole,
    is_gpu_resource,
    parse_device_id,
)
from schemas.pods import TERMINAL_PHASES, PodAssignment, fold_assignments, fold_life, is_stale
from services.guard.config import (
    PERIOD_DAY,
    PERIOD_MONTH,
    RULE_BUDGET_EXCEEDED,
    RULE_CLOCK_SKEW,
    RULE_GPU_ERROR,
    RULE_IDLE_ALLOCATION,
    RULE_SHARED_MEMORY_PRESSURE,
    RULE_STALE_NODE,
    RULE_UNREQUESTED_GPU_USE,
    RULE_VISIBILITY_LEAK,
    GuardConfig,
)

NO_GPU_VALUES = NO_DEVICES_VALUES
_POD_MEMO_MAX = 256
GPU_IS_LOST = "GPU_IS_LOST"
FINGERPRINT_HEX_CHARS = 16
SUBJECT_NAMESPACE = "namespace"
SUBJECT_TEAM = "team"


# ----------------------------------------------------------------------------------------------------------------
# Conditions


def fingerprint_of(
    rule: str,
    cluster: str,
    node_name: str | None = None,
    gpu_uuid: str | None = None,
    namespace: str | None = None,
    pod_name: str | None = None,
    pod_uid: str | None = None,
    team: str | None = None,
    qualifier: str = "",
) -> str:
    """16 hex characters of SHA-256 over the rule and the subject: the same subject always gives the same value,
    across processes and restarts (no Python ``hash``)."""
    identity = json.dumps(
        [rule, cluster, node_name, gpu_uuid, namespace, pod_name, pod_uid, team, qualifier],
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return hashlib.sha256(identity.encode("ascii")).hexdigest()[:FINGERPRINT_HEX_CHARS]


@dataclass(frozen=True, slots=True)
class Condition:
    """One rule holding for one subject now. ``evidence`` keys carry their units (``memory_used_bytes``,
    ``idle_seconds``, ``wasted_cost_micro_usd``; ``*_flag`` is 0 or 1; ``*_count`` a count)."""

    rule: str
    severity: Severity
    cluster: str
    node_name: str | None
    gpu_uuid: str | None
    namespace: str | None
    pod_name: str | None
    pod_uid: str | None
    team: str | None
    summary: str
    evidence: Mapping[str, float]
    qualifier: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "evidence", MappingProxyType({k: float(v) for k, v in self.evidence.items()}))

    @property
    def fingerprint(self) -> str:
        """The subject's fingerprint. A pod subject's ``team`` (its team label, carried for routing) is not part of
        it: the pod uid identifies the pod, and relabelling a pod must not turn its violation into a new one."""
        team = None if self.pod_uid is not None else self.team
        return fingerprint_of(self.rule, self.cluster, self.node_name, self.gpu_uuid, self.namespace,
                              self.pod_name, self.pod_uid, team, self.qualifier)


def _condition(rule: str, severity: Severity, cluster: str, summary: str, evidence: Mapping[str, float], *,
               node_name: str | None = None, gpu_uuid: str | None = None, pod: "PodView | None" = None,
               namespace: str | None = None, team: str | None = None, qualifier: str = "") -> Condition:
    return Condition(
        rule=rule,
        severity=severity,
        cluster=cluster,
        node_name=node_name,
        gpu_uuid=gpu_uuid,
        namespace=pod.namespace if pod is not None else namespace,
        pod_name=pod.name if pod is not None else None,
        pod_uid=pod.uid if pod is not None else None,
        team=team,
        summary=summary,
        evidence=evidence,
        qualifier=qualifier,
    )


# ----------------------------------------------------------------------------------------------------------------
# Pods as the rules see them


@dataclass(frozen=True, slots=True)
class PodView:
    """The latest known state of one pod, built from its PodEvents by ``apply_pod_event``.

    ``device_ids``: the GPU device ids the device plugin assigned to any of its containers (each once).
    ``device_refs``: those that parse as NVIDIA ids; ``unparsed_device_ids`` the rest (the ``index`` id strategy),
    which cannot be tied to a GPU: rules that need the assignment skip such a pod rather than guess.
    """

    uid: str
    cluster: str
    node_name: str
    namespace: str
    name: str
    labels: Mapping[str, str]
    phase: str
    gpu_requests: Mapping[str, int]
    containers: tuple[PodContainer, ...]
    device_ids: tuple[str, ...]
    device_refs: tuple[DeviceRef, ...]
    unparsed_device_ids: tuple[str, ...]
    observed_at_unix_ms: int
    resource_version: str
    ended_at_unix_ms: int | None
    deleted_at_unix_ms: int | None
    assignments: tuple[PodAssignment, ...] = ()
    # Answers that depend on this view alone, asked again at every tick of its node (which units its ids reach,
    # whether its spec can show GPUs at all): a changed pod is a new view (``apply_pod_event``, ``replace``), which
    # starts with an empty memo.
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def alive(self) -> bool:
        """Neither deleted nor in a terminal phase."""
        return self.ended_at_unix_ms is None

    @property
    def requests_gpu(self) -> bool:
        """Whether the pod or any container requests a GPU resource (nvidia.com/gpu, .shared, mig-*)."""
        requests = [self.gpu_requests] + [c.gpu_requests for c in self.containers]
        return any(is_gpu_resource(r) and n > 0 for req in requests for r, n in req.items())

    @property
    def assignment_known(self) -> bool:
        """Whether the pod's assigned GPUs are known well enough to call a GPU unassigned: every id parsed, and
        a pod requesting GPUs has its assignment (before the kubelet reports it, nothing can be judged)."""
        if self.unparsed_device_ids:
            return False
        return bool(self.device_refs) or not self.requests_gpu

    def covers(self, device: GpuDeviceSample) -> bool:
        """Whether one of the pod's assigned ids names ``device`` (a GPU id covers the GPU and its MIG units)."""
        return self.replica_count_on(device) > 0

    def replica_count_on(self, device: GpuDeviceSample) -> int:
        """How many of the pod's ids name ``device``: its replicas of a shared GPU (0 when none)."""
        key = (device.uuid, device.parent_uuid, device.mig_gpu_instance_id, device.mig_compute_instance_id)
        count = self._memo.get(key)
        if count is None:
            if len(self._memo) >= _POD_MEMO_MAX:
                self._memo.clear()  # a pod's node has a few units; only a malformed stream gets here
            count = self._memo[key] = sum(1 for ref in self.device_refs if ref_covers(ref, device))
        return count

    def spec_shows_gpus(self, envvar_honoured: bool) -> bool:
        """Whether any container is privileged or sets NVIDIA_VISIBLE_DEVICES (honoured: ``envvar_honoured``) to
        something that gives GPUs: when not, ``visibility_leak_spec`` has nothing to judge."""
        key = ("spec", envvar_honoured)
        shows = self._memo.get(key)
        if shows is None:
            shows = self._memo[key] = any(
                c.privileged or (envvar_honoured and c.visible_devices_env is not None
                                 and c.visible_devices_env.strip().lower() not in NO_GPU_VALUES)
                for c in self.containers)
        return shows

    def team(self, label_key: str) -> str | None:
        return self.labels.get(label_key) or None


def ref_covers(ref: DeviceRef, device: GpuDeviceSample) -> bool:
    """Whether the device id ``ref`` reaches the unit ``device`` (``schemas.devices.covers``: a GPU id covers the
    GPU and, when MIG is on, each of its instances; a MIG id its instance only)."""
    return covers(ref, device.uuid, device.parent_uuid, device.mig_gpu_instance_id, device.mig_compute_instance_id)


def ref_holds_whole(ref: DeviceRef, unit_uuid: str, parent_uuid: str | None,
                    device: GpuDeviceSample | None) -> bool:
    """Whether ``ref`` gives its pod the whole unit (``schemas.devices.holds_whole``: a plain id that names a GPU
    without MIG, or a MIG instance). ``device`` (the unit's latest sample) gives the instance ids the legacy
    ``MIG-GPU-<uuid>/<gi>/<ci>`` form needs."""
    gi = device.mig_gpu_instance_id if device is not None else None
    ci = device.mig_compute_instance_id if device is not None else None
    return holds_whole(ref, unit_uuid, parent_uuid, gi, ci)


def parse_device_ids(device_ids: Iterable[str]) -> tuple[tuple[DeviceRef, ...], tuple[str, ...]]:
    """(the ids that parse as NVIDIA device ids, parsed; the ids that do not)."""
    refs: list[DeviceRef] = []
    unparsed: list[str] = []
    for device_id in device_ids:
        ref = parse_device_id(device_id)
        if ref.kind is DeviceIdKind.OTHER:
            unparsed.append(device_id)
        else:
            refs.append(ref)
    return tuple(refs), tuple(unparsed)


def apply_pod_event(previous: PodView | None, event: PodEvent) -> PodView:
    """The pod after ``event``, by the fold rules of ``schemas.pods`` (stale events are ignored; a deletion
    without assignments keeps the ones known before). Pure."""
    if previous is not None and is_stale(previous.observed_at_unix_ms, previous.resource_version,
                                         previous.deleted_at_unix_ms is not None, event):
        return previous
    previous_assignments = previous.assignments if previous is not None else ()
    assignments = fold_assignments(previous_assignments, event)
    ids = tuple(a.device_id for a in assignments)
    refs, unparsed = parse_device_ids(ids)
    ended, deleted = fold_life(previous.ended_at_unix_ms if previous is not None else None,
                               previous.deleted_at_unix_ms if previous is not None else None, event)
    return PodView(
        uid=event.uid,
        cluster=event.cluster,
        node_name=event.node_name,
        namespace=event.namespace,
        name=event.name,
        labels=MappingProxyType(dict(event.labels)),
        phase=event.phase,
        gpu_requests=MappingProxyType(dict(event.gpu_requests)),
        containers=tuple(event.containers),
        device_ids=ids,
        device_refs=refs,
        unparsed_device_ids=unparsed,
        observed_at_unix_ms=event.observed_at_unix_ms,
        resource_version=event.resource_version,
        ended_at_unix_ms=ended,
        deleted_at_unix_ms=deleted,
        assignments=assignments,
    )


def is_exempt(pod: PodView, config: GuardConfig) -> bool:
    """Pods of ``exempt_namespaces``, and pods labelled ``<exempt_label>: "true"`` in ``exempt_label_namespaces``
    (node agents that see every GPU by design: the device plugin, DCGM, the gpumeter collector). The label is
    honoured nowhere else: a pod's owner writes it, and a tenant cannot take itself out of the guard's sight."""
    answer = pod._memo.get("exempt")
    if answer is not None and answer[0] is config:
        return answer[1]
    exempt = _is_exempt(pod, config)
    pod._memo["exempt"] = (config, exempt)
    return exempt


def _is_exempt(pod: PodView, config: GuardConfig) -> bool:
    if pod.namespace in config.exempt_namespaces:
        return True
    return (
        bool(config.exempt_label)
        and pod.namespace in config.exempt_label_namespaces
        and pod.labels.get(config.exempt_label, "").lower() == "true"
    )


def _pod_text(pod: PodView) -> str:
    return f"{pod.namespace}/{pod.name}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# ----------------------------------------------------------------------------------------------------------------
# Per-pod usage in one sample


@dataclass
class _Usage:
    memory_bytes: int = 0
    memory_unknown: int = 0
    processes: int = 0
    units: dict[str, GpuDeviceSample] | None = None


def _process_pod_uid(sample: NodeSample, index: int) -> str | None:
    if 0 <= index < len(sample.pod_uids):
        return sample.pod_uids[index]
    return None


def usage_by_pod_and_unit(sample: NodeSample) -> dict[tuple[str, str], _Usage]:
    """(pod uid, unit uuid) → memory and process count of the processes the collector tied to that pod (read
    only by the rules: one sample's rules share it)."""
    usage: dict[tuple[str, str], _Usage] = {}
    for device in sample.devices:
        for i, pod_index in enumerate(device.process_pod_index):
            uid = _process_pod_uid(sample, pod_index)
            if uid is None:
                continue
            cell = usage.setdefault((uid, device.uuid), _Usage(units={device.uuid: device}))
            used = device.process_used_memory_bytes[i] if i < len(device.process_used_memory_bytes) else -1
            if used >= 0:
                cell.memory_bytes += used
            else:
                cell.memory_unknown += 1
            cell.processes += 1
    return usage


# ----------------------------------------------------------------------------------------------------------------
# visibility_leak


def visibility_leak(sample: NodeSample, pods: Mapping[str, PodView], config: GuardConfig,
                    usage: Mapping[tuple[str, str], _Usage] | None = None, *,
                    spec_pods: Sequence[PodView] | None = None) -> tuple[Condition, ...]:
    """CRITICAL, per (pod, unit): a pod's process runs on a GPU or MIG unit none of the pod's assigned device ids
    names; and per pod (``gpu_uuid`` None): ``visibility_leak_spec`` for each alive pod of the sample's node.

    ``pods``: the node's pods by uid. Processes of unknown pods, of exempt pods, and of pods whose assignment is
    not known (``PodView.assignment_known``) are not judged. ``usage``: ``usage_by_pod_and_unit(sample)`` when
    the caller has it (the rules of one sample share it), else computed here. ``spec_pods``: of ``pods``, the
    alive ones of the sample's node whose spec can show GPUs (``PodView.spec_shows_gpus``), in uid order, when the
    caller keeps them (they change only with the pods); None: found here.
    """
    if not config.rule_enabled(RULE_VISIBILITY_LEAK):
        return ()
    out: list[Condition] = []
    for (uid, unit_uuid), usage in sorted((usage if usage is not None else usage_by_pod_and_unit(sample)).items()):
        pod = pods.get(uid)
        if pod is None or is_exempt(pod, config) or not pod.assignment_known:
            continue
        device = usage.units[unit_uuid] if usage.units else None
        if device is None or pod.covers(device):
            continue
        holders = sorted(_pod_text(p) for p in pods.values() if p.uid != uid and p.alive and p.covers(device))
        owner = f"assigned to {', '.join(holders)}" if holders else "assigned to no pod"
        kind = "MIG instance" if device.parent_uuid else "GPU"
        out.append(_condition(
            RULE_VISIBILITY_LEAK, Severity.CRITICAL, sample.cluster,
            f"pod {_pod_text(pod)} runs {usage.processes} process(es) using {_gib(usage.memory_bytes)} on {kind} "
            f"{unit_uuid} of node {sample.node_name}, which the device plugin did not assign to it ({owner})",
            {
                "memory_used_bytes": usage.memory_bytes,
                "process_count": usage.processes,
                "assigned_device_count": len(pod.device_ids),
                "other_holders_count": len(holders),
            },
            node_name=sample.node_name, gpu_uuid=unit_uuid, pod=pod, team=pod.team(config.team_label_key),
        ))
    if spec_pods is None:
        spec_pods = [pods[uid] for uid in sorted(pods)
                     if pods[uid].node_name == sample.node_name and pods[uid].cluster == sample.cluster]
    for pod in spec_pods:
        out.extend(visibility_leak_spec(pod, sample.devices, config))
    return tuple(out)


def _entry_is_own(entry: str, pod: PodView, devices: Sequence[GpuDeviceSample]) -> bool:
    """Whether one NVIDIA_VISIBLE_DEVICES entry names only units the pod was assigned."""
    ref = parse_device_id(entry)
    if ref.kind is not DeviceIdKind.OTHER:
        if any(parse_device_id(own).base_id == ref.base_id for own in pod.device_ids):
            return True
        targets = [d for d in devices if ref_covers(ref, d)]
    elif entry.isdigit():
        targets = [d for d in devices if d.index == int(entry)]
    else:
        # "0:1" (a MIG device by index) and anything else cannot be resolved from NVML's view: not provably own.
        return False
    return bool(targets) and all(pod.covers(d) for d in targets)


def visibility_leak_spec(pod: PodView, devices: Sequence[GpuDeviceSample],
                         config: GuardConfig) -> tuple[Condition, ...]:
    """CRITICAL, per pod: an alive, non-exempt pod with a container that is privileged (it sees every GPU of the
    node) or whose spec sets NVIDIA_VISIBLE_DEVICES itself to ``all``, to a value from a ConfigMap/Secret
    (unknowable), or to ids/indices naming a unit the pod was not assigned — whether or not it uses a GPU.
    ``void``, ``none`` and empty give no GPU and are fine. ``devices``: the node's latest units (to resolve
    indices; without them an index counts as not the pod's own). Where the toolkit does not honour the variable
    (``config.visible_devices_envvar_honoured`` false) only privileged containers are a spec leak: what a container
    then mounts (volume-mounts device lists, CDI, a hostPath of ``/dev/nvidia*``) is not in the pod's records, and
    only its use shows (``visibility_leak``, the process condition)."""
    if not config.rule_enabled(RULE_VISIBILITY_LEAK) or not pod.alive:
        return ()
    if not pod.spec_shows_gpus(config.visible_devices_envvar_honoured) or is_exempt(pod, config):
        return ()
    privileged = all_count = value_from = ids_count = foreign_entries = 0
    for container in pod.containers:
        if container.privileged:
            privileged += 1
        value = container.visible_devices_env
        if value is None or not config.visible_devices_envvar_honoured:
            continue
        text = value.strip()
        if text.lower() in NO_GPU_VALUES:
            continue
        if text == VALUE_FROM_MARK:
            value_from += 1
        elif text.lower() == "all":
            all_count += 1
        else:
            foreign = [e for e in (e.strip() for e in text.split(",")) if e and not _entry_is_own(e, pod, devices)]
            if foreign:
                ids_count += 1
                foreign_entries += len(foreign)
    if not (privileged or all_count or value_from or ids_count):
        return ()
    reasons = []
    if privileged:
        reasons.append(f"{privileged} privileged container(s) see every GPU of the node")
    if all_count:
        reasons.append(f"{all_count} container(s) set {VISIBLE_DEVICES_ENV}=all")
    if value_from:
        reasons.append(f"{value_from} container(s) take {VISIBLE_DEVICES_ENV} from a ConfigMap, Secret or field")
    if ids_count:
        reasons.append(f"{ids_count} container(s) set {VISIBLE_DEVICES_ENV} naming {foreign_entries} device(s) "
                       f"outside the pod's assignment")
    requested = sum(n for r, n in pod.gpu_requests.items() if is_gpu_resource(r))
    return (_condition(
        RULE_VISIBILITY_LEAK, Severity.CRITICAL, pod.cluster,
        f"pod {_pod_text(pod)} on node {pod.node_name} can see GPUs the device plugin did not give it: "
        + "; ".join(reasons) + f" (it requests {requested} GPU device(s))",
        {
            "privileged_containers_count": privileged,
            "visible_devices_all_containers_count": all_count,
            "visible_devices_value_from_containers_count": value_from,
            "visible_devices_ids_containers_count": ids_count,
            "unassigned_visible_devices_count": foreign_entries,
            "gpu_requested_count": requested,
        },
        node_name=pod.node_name, pod=pod, team=pod.team(config.team_label_key),
    ),)


# ----------------------------------------------------------------------------------------------------------------
# unrequested_gpu_use


def unrequested_gpu_use(sample: NodeSample, pods: Mapping[str, PodView], config: GuardConfig,
                        usage: Mapping[tuple[str, str], _Usage] | None = None) -> tuple[Condition, ...]:
    """WARNING, per pod: a known, non-exempt pod that requests no GPU resource and holds no assigned GPU id has
    processes on the node's GPUs using at least ``unrequested_min_memory_bytes`` of GPU memory in total.
    ``usage``: as ``visibility_leak``'s."""
    if not config.rule_enabled(RULE_UNREQUESTED_GPU_USE):
        return ()
    per_pod: dict[str, _Usage] = {}
    by_unit = usage if usage is not None else usage_by_pod_and_unit(sample)
    for (uid, unit_uuid), usage in by_unit.items():
        cell = per_pod.setdefault(uid, _Usage(units={}))
        cell.memory_bytes += usage.memory_bytes
        cell.memory_unknown += usage.memory_unknown
        cell.processes += usage.processes
        cell.units[unit_uuid] = usage.units[unit_uuid]
    out: list[Condition] = []
    for uid in sorted(per_pod):
        usage = per_pod[uid]
        pod = pods.get(uid)
        # The cheap tests first (requests_gpu walks every container's requests): all of them must pass.
        if pod is None or pod.device_ids or usage.processes == 0:
            continue
        if usage.memory_bytes < config.unrequested_min_memory_bytes or is_exempt(pod, config) or pod.requests_gpu:
            continue
        units = sorted(usage.units or ())
        out.append(_condition(
            RULE_UNREQUESTED_GPU_USE, Severity.WARNING, sample.cluster,
            f"pod {_pod_text(pod)} requests no GPU but uses {_gib(usage.memory_bytes)} of GPU memory on "
            f"{len(units)} GPU unit(s) of node {sample.node_name} ({', '.join(units)})",
            {
                "memory_used_bytes": usage.memory_bytes,
                "process_count": usage.processes,
                "memory_unknown_process_count": usage.memory_unknown,
                "gpu_units_count": len(units),
            },
            node_name=sample.node_name, pod=pod, team=pod.team(config.team_label_key),
        ))
    return tuple(out)


# ----------------------------------------------------------------------------------------------------------------
# shared_memory_pressure


def same_objects(first: Sequence[object], second: Iterable[object]) -> bool:
    """Whether ``second`` holds exactly ``first``'s objects, in order (identity, not equality: a pod view that
    changed is a new object, so cached facts about the old ones are stale)."""
    second = tuple(second)
    return len(first) == len(second) and all(a is b for a, b in zip(first, second))


def replica_refs_of(pods: Mapping[str, PodView]) -> CoveringCount:
    """The replica ids (``::N``) of the alive pods, one count per id (two pods naming one replica: two)."""
    return CoveringCount(ref for pod in pods.values() if pod.alive for ref in pod.device_refs
                         if ref.replica is not None)


def _sharing_of(device: GpuDeviceSample, replica_refs: CoveringCount) -> tuple[bool, int]:
    """(shared?, replicas) of a unit: time-sliced or MPS by the sample, or by replica ids (``::N``) naming it.
    ``replica_refs``: ``replica_refs_of`` the node's pods (taken once per sample, not per unit)."""
    by_sample = device.sharing_mode in (SharingMode.TIME_SLICING, SharingMode.MPS) or (
        device.sharing_mode is SharingMode.UNKNOWN and device.replicas > 1
    )
    if by_sample and device.replicas > 1:
        return True, device.replicas  # the sample says how many: the pods' ids are not counted
    naming = replica_refs.count(device.uuid, device.parent_uuid, device.mig_gpu_instance_id,
                                device.mig_compute_instance_id)
    if not by_sample and not naming:
        return False, 1
    return True, max(1, naming)


def shared_memory_pressure(sample: NodeSample, pods: Mapping[str, PodView], config: GuardConfig,
                           usage: Mapping[tuple[str, str], _Usage] | None = None,
                           replica_refs: CoveringCount | None = None) -> tuple[Condition, ...]:
    """WARNING, on time-sliced and MPS units (no memory isolation between sharers):

    * per unit: used memory above ``shared_memory_used_above_percent`` of the capacity (total − driver reserve);
    * per (pod, unit): a known pod using more than its fair share × ``shared_memory_fair_share_factor``, the
      fair share being capacity / replicas × the replicas the pod holds on the unit (at least one).

    ``usage``: as ``visibility_leak``'s; ``replica_refs``: ``CoveringCount`` of the alive pods' replica ids when
    the caller keeps it (it changes only with the node's pods), else taken here.
    """
    if not config.rule_enabled(RULE_SHARED_MEMORY_PRESSURE):
        return ()
    if usage is None:
        usage = usage_by_pod_and_unit(sample)
    if replica_refs is None:
        replica_refs = replica_refs_of(pods)
    by_unit: dict[str, list[str]] = {}
    for uid, unit in usage:
        by_unit.setdefault(unit, []).append(uid)
    out: list[Condition] = []
    for device in sample.devices:
        shared, replicas = _sharing_of(device, replica_refs)
        capacity = device.memory_total_bytes - device.memory_reserved_bytes
        if not shared or capacity <= 0:
            continue
        used = device.memory_used_bytes
        used_percent = 100.0 * used / capacity
        sharers = sorted(by_unit.get(device.uuid, ()))
        if used_percent > config.shared_memory_used_above_percent:
            out.append(_condition(
                RULE_SHARED_MEMORY_PRESSURE, Severity.WARNING, sample.cluster,
                f"shared GPU unit {device.uuid} on node {sample.node_name} has {used_percent:.1f} % of its "
                f"{_gib(capacity)} in use (threshold {config.shared_memory_used_above_percent:g} %): its "
                f"{len(sharers)} pod(s) are at risk of running out of memory",
                {
                    "memory_used_bytes": used,
                    "memory_capacity_bytes": capacity,
                    "memory_used_percent": used_percent,
                    "threshold_percent": config.shared_memory_used_above_percent,
                    "replicas_count": replicas,
                    "pods_count": len(sharers),
                },
                node_name=sample.node_name, gpu_uuid=device.uuid,
            ))
        fair_share = capacity / replicas
        for uid in sharers:
            pod = pods.get(uid)
            if pod is None:
                continue
            held = max(1, pod.replica_count_on(device))
            limit = fair_share * held * config.shared_memory_fair_share_factor
            pod_bytes = usage[(uid, device.uuid)].memory_bytes
            if pod_bytes > limit:
                out.append(_condition(
                    RULE_SHARED_MEMORY_PRESSURE, Severity.WARNING, sample.cluster,
                    f"pod {_pod_text(pod)} uses {_gib(pod_bytes)} of shared GPU unit {device.uuid} on node "
                    f"{sample.node_name}, above its fair share of {_gib(limit)} ({held} of {replicas} replicas "
                    f"of {_gib(capacity)}): its neighbours may run out of memory",
                    {
                        "memory_used_bytes": pod_bytes,
                        "fair_share_bytes": limit,
                        "memory_capacity_bytes": capacity,
                        "replicas_count": replicas,
                        "pod_replicas_count": held,
                    },
                    node_name=sample.node_name, gpu_uuid=device.uuid, pod=pod, team=pod.team(config.team_label_key),
                ))
    return tuple(out)


# ----------------------------------------------------------------------------------------------------------------
# gpu_error


NODE_ERROR_KEY = ""
"""The ``gpu_error_counts`` key of errors tied to no device (``nvmlInit``, ``nvmlDeviceGetCount``)."""


def gpu_error_counts(sample: NodeSample, config: GuardConfig) -> dict[str, tuple[int, bool, tuple[str, ...]]]:
    """Physical GPU uuid (a MIG unit's parent; ``NODE_ERROR_KEY`` for node errors) → (errors not ignored by
    ``gpu_error_ignored``, whether one is GPU_IS_LOST, the distinct ``function:CODE`` texts). GPUs without
    such errors are left out."""
    out: dict[str, tuple[int, bool, tuple[str, ...]]] = {}
    packed = getattr(sample, "packed", None)
    if packed is not None and not packed.device_errors and not sample.node_errors:
        return out  # a v4 tick without errors: no device object needs building to know it

    def add(key: str, errors: Iterable) -> None:
        kept = [e for e in errors if not config.is_error_ignored(e.nvml_function, e.error_code)]
        if not kept:
            return
        count, lost, texts = out.get(key, (0, False, ()))
        names = list(texts)
        for e in kept:
            text = f"{e.nvml_function}:{e.error_code}"
            if text not in names:
                names.append(text)
        out[key] = (count + len(kept), lost or any(e.error_code == GPU_IS_LOST for e in kept), tuple(names))

    add(NODE_ERROR_KEY, sample.node_errors)
    for device in sample.devices:
        add(device.parent_uuid or device.uuid, device.errors)
    return out


def gpu_error(sample: NodeSample, config: GuardConfig, consecutive_samples: Mapping[str, int],
              counts: Mapping[str, tuple[int, bool, tuple[str, ...]]] | None = None) -> tuple[Condition, ...]:
    """Per physical GPU (MIG units count towards their parent): CRITICAL when NVML reports it lost
    (GPU_IS_LOST, at once); WARNING for other NVML errors not in ``gpu_error_ignored`` once they have been in
    ``gpu_error_min_consecutive_samples`` consecutive samples. Node-level NVML errors (init, device count):
    CRITICAL per node, at once. ``consecutive_samples``: key of ``gpu_error_counts`` → consecutive samples with
    errors, this one included (kept by the engine). ``counts``: ``gpu_error_counts(sample, config)`` when the
    caller has it."""
    if not config.rule_enabled(RULE_GPU_ERROR):
        return ()
    out: list[Condition] = []
    if counts is None:
        counts = gpu_error_counts(sample, config)
    for key, (count, lost, texts) in sorted(counts.items()):
        streak = max(1, consecutive_samples.get(key, 1))
        node_level = key == NODE_ERROR_KEY
        if not (lost or node_level) and streak < config.gpu_error_min_consecutive_samples:
            continue
        severity = Severity.CRITICAL if (lost or node_level) else Severity.WARNING
        what = f"node {sample.node_name}" if node_level else f"GPU {key} on node {sample.node_name}"
        state = "is lost (GPU_IS_LOST)" if lost else "reports NVML errors"
        out.append(_condition(
            RULE_GPU_ERROR, severity, sample.cluster,
            f"{what} {state}: {', '.join(texts)} in the last {streak} sample(s)",
            {"error_count": count, "gpu_lost_flag": 1 if lost else 0, "consecutive_error_samples": streak},
            node_name=sample.node_name, gpu_uuid=None if node_level else key,
        ))
    return tuple(out)


# ----------------------------------------------------------------------------------------------------------------
# clock_skew


def clock_skew(cluster: str, node_name: str, offset_ms: int, config: GuardConfig) -> tuple[Condition, ...]:
    """WARNING: the node's clock is off the broker's append time by more than ``clock_skew_threshold_seconds``
    (``offset_ms``: its offset as ``gpumeter.clockskew.NodeClocks`` measures it, + ahead). Its ticks are
    corrected and billed in the right windows; the node's NTP is what to fix."""
    if not config.rule_enabled(RULE_CLOCK_SKEW) or abs(offset_ms) <= config.clock_skew_threshold_seconds * 1000:
        return ()
    direction = "ahead of" if offset_ms > 0 else "behind"
    return (_condition(
        RULE_CLOCK_SKEW, Severity.WARNING, cluster,
        f"the clock of node {node_name} is {abs(offset_ms) / 1000:.1f} s {direction} the broker's (more than "
        f"{config.clock_skew_threshold_seconds} s): its timestamps are corrected; check its time sync (NTP)",
        {"clock_skew_seconds": offset_ms / 1000, "threshold_seconds": config.clock_skew_threshold_seconds},
        node_name=node_name,
    ),)


# ----------------------------------------------------------------------------------------------------------------
# stale_node


def stale_node(cluster: str, node_name: str, last_heard_unix_ms: int, interval_ms: int, now_ms: int,
               config: GuardConfig) -> tuple[Condition, ...]:
    """WARNING: nothing heard from the node's collector for more than max(``stale_node_intervals`` × its
    interval, ``stale_node_min_seconds``). ``last_heard_unix_ms``: when its newest sample arrived."""
    if not config.rule_enabled(RULE_STALE_NODE):
        return ()
    threshold_ms = max(config.stale_node_intervals * max(interval_ms, 0), config.stale_node_min_seconds * 1000)
    silent_ms = now_ms - last_heard_unix_ms
    if silent_ms <= threshold_ms:
        return ()
    return (_condition(
        RULE_STALE_NODE, Severity.WARNING, cluster,
        f"the collector of node {node_name} has been silent for {silent_ms / 1000:.0f} s (more than "
        f"{threshold_ms / 1000:.0f} s): its GPUs are neither metered nor guarded",
        {
            "silent_seconds": silent_ms / 1000,
            "threshold_seconds": threshold_ms / 1000,
            "interval_seconds": interval_ms / 1000,
            "last_heard_unix_ms": last_heard_unix_ms,
        },
        node_name=node_name,
    ),)


# ----------------------------------------------------------------------------------------------------------------
# idle_allocation


IDLE = "idle"
BUSY = "busy"
UNKNOWN = "unknown"
_UNKNOWN_COMPUTE = 1.0 - 1e-9


def classify_unit_window(rows: Sequence[GpuShare], pods: Mapping[str, PodView], config: GuardConfig,
                         device: GpuDeviceSample | None = None) -> dict[str, tuple[str, GpuShare]]:
    """For one unit's complete rows of one window: pod uid → (``idle`` | ``busy`` | ``unknown``, its row), for
    the pods that hold the whole unit (``ref_holds_whole``: a whole GPU or a MIG instance).

    ``idle``: compute_share below ``idle_compute_below_percent``. ``unknown``: the window had no compute
    information (the attribution then gives all compute to UNATTRIBUTED: a lost GPU, failing utilization
    reads); unknown is not idle. ``device``: the unit's latest sample, for legacy MIG ids.
    """
    unattributed = next((r for r in rows if r.subject_kind is ShareSubjectKind.UNATTRIBUTED), None)
    compute_unknown = unattributed is not None and unattributed.compute_share >= _UNKNOWN_COMPUTE
    out: dict[str, tuple[str, GpuShare]] = {}
    for row in rows:
        if row.subject_kind is not ShareSubjectKind.POD or row.pod_uid is None:
            continue
        pod = pods.get(row.pod_uid)
        if pod is None or not any(ref_holds_whole(ref, row.gpu_uuid, row.parent_gpu_uuid, device)
                                  for ref in pod.device_refs):
            continue
        if compute_unknown and row.compute_share == 0.0:
            verdict = UNKNOWN
        elif row.compute_share * 100.0 < config.idle_compute_below_percent:
            verdict = IDLE
        else:
            verdict = BUSY
        out[row.pod_uid] = (verdict, row)
    return out


@dataclass(frozen=True, slots=True)
class IdleRun:
    """A pod's unbroken run of idle windows on a unit it holds whole.

    ``since_unix_ms``: start of the run's first window; ``idle_seconds``: covered seconds of its idle windows;
    ``compute_share_seconds``: Σ compute_share × covered seconds (mean = that / idle_seconds);
    ``wasted_cost_micro_usd``: the pod's cost on the unit for the run's windows, from CostRecords;
    ``updated_at_unix_ms``: when its newest window arrived.
    """

    cluster: str
    node_name: str
    gpu_uuid: str
    pod_uid: str
    since_unix_ms: int
    last_window_start_unix_ms: int
    window_seconds: int
    idle_seconds: float
    compute_share_seconds: float
    windows: int
    memory_used_bytes_avg: float
    wasted_cost_micro_usd: int
    updated_at_unix_ms: int

    @property
    def compute_percent_avg(self) -> float:
        return 100.0 * self.compute_share_seconds / self.idle_seconds if self.idle_seconds > 0 else 0.0


def advance_idle_run(run: IdleRun | None, verdict: str, row: GpuShare, now_ms: int,
                     cost_of_window: Mapping[int, int]) -> IdleRun | None:
    """The run after one window's verdict: an idle window starts or extends it, a busy one ends it (None), an
    unknown one leaves it as it was (apart from the window reached). A window at or before the run's last is a
    redelivery and changes nothing. ``cost_of_window``: costs already known for the pod on the unit, by window
    start (they count when the run starts at or before their window)."""
    window = row.window_start_unix_ms
    if run is not None and window <= run.last_window_start_unix_ms:
        return run
    if verdict == BUSY:
        return None
    if verdict == UNKNOWN:
        return None if run is None else replace(run, last_window_start_unix_ms=window, updated_at_unix_ms=now_ms)
    covered = max(0.0, row.covered_seconds)
    if run is None:
        return IdleRun(
            cluster=row.cluster, node_name=row.node_name, gpu_uuid=row.gpu_uuid, pod_uid=row.pod_uid or "",
            since_unix_ms=window, last_window_start_unix_ms=window, window_seconds=row.window_seconds,
            idle_seconds=covered, compute_share_seconds=row.compute_share * covered, windows=1,
            memory_used_bytes_avg=row.memory_used_bytes_avg,
            wasted_cost_micro_usd=sum(c for w, c in cost_of_window.items() if w >= window),
            updated_at_unix_ms=now_ms,
        )
    return replace(
        run,
        last_window_start_unix_ms=window,
        idle_seconds=run.idle_seconds + covered,
        compute_share_seconds=run.compute_share_seconds + row.compute_share * covered,
        windows=run.windows + 1,
        memory_used_bytes_avg=row.memory_used_bytes_avg,
        updated_at_unix_ms=now_ms,
    )


def idle_allocation(run: IdleRun, pod: PodView | None, config: GuardConfig) -> tuple[Condition, ...]:
    """WARNING: a pod has held a whole GPU or MIG instance with compute below ``idle_compute_below_percent`` for
    at least ``idle_for_seconds`` of covered time. Evidence carries the money the idle allocation cost so far."""
    if not config.rule_enabled(RULE_IDLE_ALLOCATION) or pod is None or run.idle_seconds < config.idle_for_seconds:
        return ()
    kind = "MIG instance" if run.gpu_uuid.upper().startswith("MIG-") else "GPU"
    return (_condition(
        RULE_IDLE_ALLOCATION, Severity.WARNING, run.cluster,
        f"pod {_pod_text(pod)} has held {kind} {run.gpu_uuid} on node {run.node_name} for {run.idle_seconds / 60:.1f} "
        f"min at {run.compute_percent_avg:.1f} % compute (threshold {config.idle_compute_below_percent:g} %), "
        f"costing {run.wasted_cost_micro_usd / 1e6:.6f} USD so far",
        {
            "idle_seconds": run.idle_seconds,
            "compute_percent_avg": run.compute_percent_avg,
            "threshold_compute_percent": config.idle_compute_below_percent,
            "wasted_cost_micro_usd": run.wasted_cost_micro_usd,
            "memory_used_bytes_avg": run.memory_used_bytes_avg,
            "idle_since_unix_ms": run.since_unix_ms,
            "windows_count": run.windows,
        },
        node_name=run.node_name, gpu_uuid=run.gpu_uuid, pod=pod, team=pod.team(config.team_label_key),
    ),)


# ----------------------------------------------------------------------------------------------------------------
# budget_exceeded


DAY_MS = 86_400_000
_PERIOD_BOUNDS_MAX = 4096
_period_bounds_by_day: dict[tuple[str, int], tuple[int, int]] = {}


def period_bounds(period: str, t_unix_ms: int) -> tuple[int, int]:
    """[start, end) in Unix ms of the UTC day or calendar month containing ``t_unix_ms``.

    Every instant of one UTC day has the same bounds (Unix time counts no leap seconds: a day is 86,400,000 ms
    from a multiple of it), so they are worked out once per (period, day) and kept: the guard asks for them eight
    times per cost line (its namespace's and team's day and month, when counted and when judged)."""
    key = (period, t_unix_ms // DAY_MS)
    bounds = _period_bounds_by_day.get(key)
    if bounds is None:
        if len(_period_bounds_by_day) >= _PERIOD_BOUNDS_MAX:
            _period_bounds_by_day.clear()
        bounds = _calendar_bounds(period, t_unix_ms)
        _period_bounds_by_day[key] = bounds
    return bounds


def _calendar_bounds(period: str, t_unix_ms: int) -> tuple[int, int]:
    moment = datetime.fromtimestamp(t_unix_ms / 1000, tz=timezone.utc)
    if period == PERIOD_DAY:
        start = datetime(moment.year, moment.month, moment.day, tzinfo=timezone.utc)
        start_ms = int(start.timestamp()) * 1000
        return start_ms, start_ms + 86_400_000
    if period == PERIOD_MONTH:
        start = datetime(moment.year, moment.month, 1, tzinfo=timezone.utc)
        days = monthrange(moment.year, moment.month)[1]
        start_ms = int(start.timestamp()) * 1000
        return start_ms, start_ms + days * 86_400_000
    raise ValueError(f"unknown budget period {period!r}")


def cost_subject(cost_namespace: str | None, cost_labels: Mapping[str, str], subject_kind: CostSubjectKind,
                 config: GuardConfig) -> tuple[str | None, str | None]:
    """(namespace, team) a cost line counts towards; POD lines only (buckets belong to no namespace)."""
    if subject_kind is not CostSubjectKind.POD:
        return None, None
    return cost_namespace or None, cost_labels.get(config.team_label_key) or None


@dataclass(frozen=True, slots=True)
class BudgetSpend:
    """What a namespace or team (``kind``) spent in one UTC period, against its budget."""

    cluster: str
    kind: str
    name: str
    period: str
    period_start_unix_ms: int
    period_end_unix_ms: int
    spent_micro_usd: int
    budget_micro_usd: int


def budget_exceeded(spend: BudgetSpend, now_ms: int, config: GuardConfig) -> tuple[Condition, ...]:
    """CRITICAL when the period's spend is above the budget; WARNING (forecast) before that when the spend
    extrapolated linearly to the period's end (spend × period length / elapsed) is above the budget ×
    ``budget_forecast_warning_fraction`` and at least ``budget_forecast_min_elapsed_fraction`` of the period
    has passed (an extrapolation from the first minutes is noise). One fingerprint per (subject, period kind):
    the warning becomes critical in place, and a new period starts from zero."""
    if not config.rule_enabled(RULE_BUDGET_EXCEEDED):
        return ()
    length = spend.period_end_unix_ms - spend.period_start_unix_ms
    elapsed = min(max(now_ms - spend.period_start_unix_ms, 1), length)
    elapsed_fraction = elapsed / length
    forecast = spend.spent_micro_usd * length / elapsed
    budget = spend.budget_micro_usd
    exceeded = spend.spent_micro_usd > budget
    warn = (not exceeded and elapsed_fraction >= config.budget_forecast_min_elapsed_fraction
            and forecast > budget * config.budget_forecast_warning_fraction)
    if not (exceeded or warn):
        return ()
    label = "daily" if spend.period == PERIOD_DAY else "monthly"
    start = datetime.fromtimestamp(spend.period_start_unix_ms / 1000, tz=timezone.utc)
    period_text = start.strftime("%Y-%m-%d") if spend.period == PERIOD_DAY else start.strftime("%Y-%m")
    who = f"{spend.kind} {spend.name}"
    if exceeded:
        summary = (f"{who} spent {spend.spent_micro_usd / 1e6:.6f} USD in {period_text} (UTC), above its {label} "
                   f"budget of {budget / 1e6:.6f} USD")
    else:
        summary = (f"{who} is on course to spend {forecast / 1e6:.6f} USD in {period_text} (UTC), above "
                   f"{config.budget_forecast_warning_fraction:g} × its {label} budget of {budget / 1e6:.6f} USD "
                   f"({spend.spent_micro_usd / 1e6:.6f} USD so far)")
    evidence = {
        "spent_micro_usd": spend.spent_micro_usd,
        "budget_micro_usd": budget,
        "forecast_micro_usd": forecast,
        "spent_fraction": spend.spent_micro_usd / budget if budget > 0 else float(spend.spent_micro_usd > 0),
        "period_elapsed_fraction": elapsed_fraction,
        "period_start_unix_ms": spend.period_start_unix_ms,
        "period_end_unix_ms": spend.period_end_unix_ms,
        "forecast_flag": 0 if exceeded else 1,
    }
    return (_condition(
        RULE_BUDGET_EXCEEDED, Severity.CRITICAL if exceeded else Severity.WARNING, spend.cluster, summary, evidence,
        namespace=spend.name if spend.kind == SUBJECT_NAMESPACE else None,
        team=spend.name if spend.kind == SUBJECT_TEAM else None,
        qualifier=spend.period,
    ),)


__all__ = [
    "BUSY",
    "BudgetSpend",
    "Condition",
    "IDLE",
    "IdleRun",
    "NODE_ERROR_KEY",
    "PodView",
    "SUBJECT_NAMESPACE",
    "SUBJECT_TEAM",
    "UNKNOWN",
    "advance_idle_run",
    "apply_pod_event",
    "budget_exceeded",
    "classify_unit_window",
    "cost_subject",
    "fingerprint_of",
    "gpu_error",
    "gpu_error_counts",
    "idle_allocation",
    "is_exempt",
    "parse_device_ids",
    "period_bounds",
    "ref_covers",
    "ref_holds_whole",
    "shared_memory_pressure",
    "stale_node",
    "unrequested_gpu_use",
    "usage_by_pod_and_unit",
    "visibility_leak",
    "visibility_leak_spec",
]
