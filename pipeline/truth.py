"""The simulator's ground truth on replay's windows and units (``truth.jsonl``).

For each window ``[k·W, (k+1)·W)``, unit (whole GPU or MIG instance, as ``gpu_uuid``) and pod (``pod_uid`` null
for processes of no pod: host processes and MPS servers together), over the replayed ticks of the unit's node
whose ``sampled_at`` lies in the window — the ticks the attribution puts in that window. A tick at which the
unit's GPU was lost counts with its weight and no pod's use: that time was nobody's (the attribution's
UNAVAILABLE bucket).

* ``w_t = clamp(interval_ms_t, 0, W)``, the tick weight the attribution uses (equal weights when all are 0);
* ``true_memory_share = Σ w_t · M_t / (Σ w_t · T)``, with ``M_t`` the pod's ``true_memory_bytes`` on the unit at
  the tick (``SimWorld.truth``: the sum of its processes' ``usedGpuMemory``) and ``T`` the unit's
  ``memory_total_bytes`` including the driver reserve — the denominator of ``memory_share``;
* ``true_compute_share = Σ w_t · C_t / Σ w_t``, with ``C_t`` the pod's ``true_compute_fraction`` (time-slicing:
  GPU time granted; MPS: compute received; MIG: share of the instance's time) — a fraction of the unit's time
  like ``compute_share``.

* ``true_occupancy_share = Σ w_t · [the pod had a context on the unit at t] / Σ w_t``: how long it held the unit
  (what MIG attribution measures, NVML having no utilization for MIG instances).

Ticks where the pod had no context on the unit count as 0. The truth is taken at the sampling instants, as the
samples are, so it measures the attribution's error on what was sampled; what sampling itself misses between
ticks is bounded separately in ``docs/attribution.md`` ("Error to expect against the truth").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpumeter.clock import iso_utc
from schemas.records import NodeSample


# ----------------------------------------------------------------------------------------------------------------
# Ground truth


@dataclass
class _TruthCell:
    weight_ms: int = 0
    ticks: int = 0
    # pod uid (None: no pod) -> [Σ w·bytes, Σ w·compute, Σ w, Σ bytes, Σ compute, ticks present]
    # (the unweighted sums serve when every weight is 0, as the attribution then weighs ticks equally)
    pods: dict[str | None, list] = field(default_factory=dict)


class TruthAccumulator:
    """Ground truth per (window, unit, pod) over the replayed ticks (defined in this module's docstring)."""

    def __init__(self, scenario: Any, window_seconds: int) -> None:
        from simulator.world import SimWorld

        self._world = SimWorld(scenario)
        self._window_ms = window_seconds * 1000
        self._window_seconds = window_seconds
        self._units: dict[str, tuple[tuple[int, Any], ...]] = {}
        for node in scenario.nodes:
            self._units[node.name] = tuple(
                (gpu.index, unit) for gpu in node.gpus for unit in self._world.units_of_gpu(node.name, gpu.index)
            )
        self._cells: dict[tuple[int, str, str], _TruthCell] = {}
        # A node's clock offset (``NodeSpec.clock_offset_seconds``): its ticks read that far off the truth's time.
        self._skew_ms = {node.name: node.clock_offset_seconds * 1000 for node in scenario.nodes}
        self._unit_info: dict[str, Any] = {unit.uuid: unit for units in self._units.values() for _, unit in units}

    def add_tick(self, sample: NodeSample, simulated: tuple[int, tuple] | None = None) -> None:
        """Count one replayed tick. ``simulated``: (time, ``SimWorld.truth`` of the node then) as the simulator
        took it at the tick (``EncodedInput.truth``), used when that time is the tick's; else asked here."""
        node = sample.node_name
        t = sample.sampled_at_unix_ms - self._skew_ms.get(node, 0)
        weight = min(max(sample.interval_ms, 0), self._window_ms)
        window_start = (t // self._window_ms) * self._window_ms
        by_unit: dict[str, list] = {}
        rows = simulated[1] if simulated is not None and simulated[0] == t else self._world.truth(t, node)
        for row in rows:
            by_unit.setdefault(row.gpu_uuid, []).append(row)
        for gpu_index, unit in self._units.get(node, ()):
            cell = self._cells.setdefault((window_start, node, unit.uuid), _TruthCell())
            cell.weight_ms += weight
            cell.ticks += 1
            if self._world.gpu_lost(node, gpu_index, t):
                continue
            for row in by_unit.get(unit.uuid, ()):
                acc = cell.pods.setdefault(row.pod_uid, [0, 0.0, 0, 0, 0.0, 0])
                acc[0] += weight * row.true_memory_bytes
                acc[1] += weight * row.true_compute_fraction
                acc[2] += weight
                acc[3] += row.true_memory_bytes
                acc[4] += row.true_compute_fraction
                acc[5] += 1

    def take_closed(self, before_unix_ms: int | None) -> list[dict[str, Any]]:
        """Rows of the windows that end at or before ``before_unix_ms`` (None: all), in a stable order."""
        keys = sorted(k for k in self._cells if before_unix_ms is None or k[0] + self._window_ms <= before_unix_ms)
        rows: list[dict[str, Any]] = []
        for key in keys:
            cell = self._cells.pop(key)
            window_start, node, unit_uuid = key
            unit = self._unit_info[unit_uuid]
            total = unit.memory_total_bytes
            for pod_uid in sorted(cell.pods, key=lambda u: (u is None, u or "")):
                weighted_bytes, weighted_compute, weight_present, bytes_sum, compute_sum, ticks_present = cell.pods[
                    pod_uid]
                if cell.weight_ms > 0:
                    memory_bytes = weighted_bytes / cell.weight_ms
                    compute = weighted_compute / cell.weight_ms
                    occupancy = weight_present / cell.weight_ms
                else:
                    memory_bytes = bytes_sum / cell.ticks
                    compute = compute_sum / cell.ticks
                    occupancy = ticks_present / cell.ticks
                rows.append(
                    {
                        "window_start": iso_utc(window_start),
                        "window_start_unix_ms": window_start,
                        "window_seconds": self._window_seconds,
                        "node": node,
                        "gpu_uuid": unit_uuid,
                        "parent_gpu_uuid": unit.parent_uuid,
                        "pod_uid": pod_uid,
                        "true_memory_bytes_avg": memory_bytes,
                        "true_memory_share": memory_bytes / total,
                        "true_compute_share": compute,
                        "true_occupancy_share": occupancy,
                        "sample_count": cell.ticks,
                        "covered_seconds": min(cell.weight_ms, self._window_ms) / 1000.0,
                    }
                )
        return rows
