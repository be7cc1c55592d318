"""A quiet tick told cheaply: the guard's three per-process sample rules on a node whose pods and process lists
repeat from tick to tick.

``visibility_leak``, ``unrequested_gpu_use`` and ``shared_memory_pressure`` (``services.guard.rules``) walk every
process of a tick, its pod and the units the pod's ids reach: ~0.25 ms per 8-GPU tick of 64 processes, at every
tick of every node, to find, nearly always, nothing. What they conclude depends on two kinds of input:

* the tick's *structure* -- which pod each process belongs to, the units (uuid, parent, MIG ids, index, sharing
  mode, replicas) -- and the node's pods (``PodView``s, replaced whenever a pod changes): which (pod, unit) pairs
  leak, which pods' specs show GPUs, which pods run processes without requesting a GPU, which units are shared
  and by whom with how many replicas;
* the tick's memory figures: a unit's used, total and reserved memory, each process's used memory.

A ``SamplePlan`` is the first part, worked out once per structure (``SamplePlans.quiet`` keeps one per node, and
builds a new one when the structure or a pod view changes). Per tick ``quiet`` then only adds up the memory of
the processes that matter and compares it with the thresholds, with the same values and the same float
arithmetic as the rules.

Contract: ``quiet(key, sample, pods, spec_pods, replica_refs)`` is True only when those three rules, run on the
sample and pods (``usage_by_pod_and_unit``, the node's ``spec_pods`` and ``replica_refs``), all return nothing;
False means "run them". It never decides a condition itself: a tick that may raise one is judged by the rules
as before, so every condition, its text and evidence, comes from the rules alone
(``tests/unit/guard/test_sample_plan.py`` compares the verdict with the rules on random ticks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

from schemas.devices import CoveringCount
from schemas.packed import column_ints
from schemas.records import NodeSample
from services.guard.config import (
    RULE_SHARED_MEMORY_PRESSURE,
    RULE_UNREQUESTED_GPU_USE,
    GuardConfig,
)
from services.guard.rules import (
    PodView,
    _sharing_of,
    is_exempt,
    same_objects,
    usage_by_pod_and_unit,
    visibility_leak,
)

# (cell index, device position, process position on the device, process position in the tick): one process of a
# (pod, unit) cell, as ``usage_by_pod_and_unit`` walks them.
_Process = tuple[int, int, int, int]


_STRUCTURE_COLUMNS = ("device_parent_uuid", "device_mig_gpu_instance_id", "device_mig_compute_instance_id",
                      "device_index", "device_sharing_mode", "device_replicas", "device_process_count",
                      "process_pod_index", "pod_uids", "pod_uid_text_slots")


def structure_key(sample: NodeSample) -> tuple:
    """What the three rules read from ``sample`` besides its memory figures (the module docstring): from the v4
    record's columns while the sample holds them (no device object is built), else from its devices."""
    packed = getattr(sample, "packed", None)
    if packed is not None:
        raw = packed.raw_columns
        return ("columns", sample.cluster, sample.node_name, packed.device_uuids, packed.device_texts,
                packed.pod_uid_texts, *[raw[name] for name in _STRUCTURE_COLUMNS])
    return ("objects", sample.cluster, sample.node_name, sample.pod_uids, tuple(
        (d.uuid, d.parent_uuid, d.mig_gpu_instance_id, d.mig_compute_instance_id, d.index, d.sharing_mode,
         d.replicas, d.process_pod_index, len(d.process_used_memory_bytes))
        for d in sample.devices))


@dataclass(frozen=True)
class SamplePlan:
    """The structural conclusions of the three rules for one structure and one set of pod views.

    ``always_loud``: ``visibility_leak`` holds whatever the memory (a leaking process or spec): never quiet.
    ``processes``: every process the checks below read, in the rules' walk order; ``cells``: how many cells.
    ``shared``: per shared unit the rules judge (device position, replicas, the sharers with a known pod: (cell
    index, replicas the pod holds)). ``unrequested``: per pod that could be an unrequested user, its cells."""

    key: tuple
    views: tuple[PodView, ...]
    always_loud: bool
    cells: int
    processes: tuple[_Process, ...]
    shared: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]
    unrequested: tuple[tuple[int, ...], ...]


def build_plan(key: tuple, sample: NodeSample, pods: Mapping[str, PodView], config: GuardConfig,
               spec_pods: Sequence[PodView], replica_refs: CoveringCount) -> SamplePlan:
    usage = usage_by_pod_and_unit(sample)
    loud = bool(visibility_leak(sample, pods, config, usage, spec_pods=spec_pods))
    cell_of = {cell: n for n, cell in enumerate(usage)}
    processes: list[_Process] = []
    first = 0
    for position, device in enumerate(sample.devices):
        for i, pod_index in enumerate(device.process_pod_index):
            if 0 <= pod_index < len(sample.pod_uids):
                processes.append((cell_of[(sample.pod_uids[pod_index], device.uuid)], position, i, first + i))
        first += len(device.process_pod_index)
    shared: list[tuple[int, int, tuple[tuple[int, int], ...]]] = []
    if config.rule_enabled(RULE_SHARED_MEMORY_PRESSURE):
        by_unit: dict[str, list[str]] = {}
        for uid, unit in usage:
            by_unit.setdefault(unit, []).append(uid)
        for position, device in enumerate(sample.devices):
            is_shared, replicas = _sharing_of(device, replica_refs)
            if not is_shared:
                continue
            sharers = tuple((cell_of[(uid, device.uuid)], max(1, pods[uid].replica_count_on(device)))
                            for uid in sorted(by_unit.get(device.uuid, ())) if pods.get(uid) is not None)
            shared.append((position, replicas, sharers))
    unrequested: list[tuple[int, ...]] = []
    if config.rule_enabled(RULE_UNREQUESTED_GPU_USE):
        cells_of_pod: dict[str, list[int]] = {}
        for (uid, _), n in cell_of.items():
            cells_of_pod.setdefault(uid, []).append(n)
        for uid, cells in cells_of_pod.items():
            pod = pods.get(uid)
            # usage_by_pod_and_unit makes a cell only for a process: every cell counts at least one.
            if pod is None or pod.device_ids or is_exempt(pod, config) or pod.requests_gpu:
                continue
            unrequested.append(tuple(cells))
    return SamplePlan(key, tuple(pods.values()), loud, len(cell_of), tuple(processes), tuple(shared),
                      tuple(unrequested))


class SamplePlans:
    """One ``SamplePlan`` per node (the module docstring); ``forget(node)`` when the node is gone."""

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self._plans: dict[Hashable, SamplePlan] = {}
        # node -> the pods mapping its plan was built from: while the caller passes that very object again (the
        # engine's cached ``_NodePods.pods``, never changed once made), its views are the plan's
        self._built_from: dict[Hashable, Mapping[str, PodView]] = {}

    def forget(self, node: Hashable) -> None:
        self._plans.pop(node, None)
        self._built_from.pop(node, None)

    def quiet(self, node: Hashable, sample: NodeSample, pods: Mapping[str, PodView], spec_pods: Sequence[PodView],
              replica_refs: CoveringCount) -> bool:
        """Whether ``sample`` of ``node`` is certain to give the three process rules nothing (the module
        docstring), judged from the node's plan, made again when the tick's structure or the pods changed.
        ``pods`` is read, never kept as a promise: passing the same mapping object again says its views are the
        same (a caller that changes a mapping in place passes a new one)."""
        key = structure_key(sample)
        plan = self._plans.get(node)
        if (plan is None or plan.key != key
                or (self._built_from.get(node) is not pods and not same_objects(plan.views, pods.values()))):
            plan = self._plans[node] = build_plan(key, sample, pods, self.config, spec_pods, replica_refs)
        self._built_from[node] = pods
        if plan.always_loud:
            return False
        if not plan.shared and not plan.unrequested:
            return True
        memory = [0] * plan.cells
        packed = getattr(sample, "packed", None)
        if packed is not None:  # the same Python ints the devices would hold, read from the columns' bytes
            raw = packed.raw_columns
            column = column_ints(raw["process_used_memory_bytes"], "q")
            for cell, _, _, flat in plan.processes:
                used = column[flat]
                if used >= 0:
                    memory[cell] += used
            totals = column_ints(raw["device_memory_total_bytes"], "q")
            reserved = column_ints(raw["device_memory_reserved_bytes"], "q")
            used_bytes = column_ints(raw["device_memory_used_bytes"], "q")
        else:
            devices = sample.devices
            for cell, position, i, _ in plan.processes:
                process_memory = devices[position].process_used_memory_bytes
                used = process_memory[i] if i < len(process_memory) else -1
                if used >= 0:
                    memory[cell] += used
            totals = [d.memory_total_bytes for d in devices]
            reserved = [d.memory_reserved_bytes for d in devices]
            used_bytes = [d.memory_used_bytes for d in devices]
        config = self.config
        for position, replicas, sharers in plan.shared:
            capacity = totals[position] - reserved[position]
            if capacity <= 0:
                continue
            if 100.0 * used_bytes[position] / capacity > config.shared_memory_used_above_percent:
                return False
            fair_share = capacity / replicas
            for cell, held in sharers:
                if memory[cell] > fair_share * held * config.shared_memory_fair_share_factor:
                    return False
        for cells in plan.unrequested:
            if sum(memory[cell] for cell in cells) >= config.unrequested_min_memory_bytes:
                return False
        return True


__all__ = ["SamplePlan", "SamplePlans", "build_plan", "structure_key"]
