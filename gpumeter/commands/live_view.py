"""What ``gpumeter run``'s live view shows, computed from topic records. Pure: no Kafka, no terminal, no clock.

The view is a ``ViewState`` folded from the records of three topics (``apply_records(state, records)`` returns a
new state and never changes its input):

* **node-window-shares** (as ``GpuShare`` rows, ``NodeWindowShares.rows()``): the rows of one GPU unit (a whole
  GPU or a MIG instance) for one window are collected until all ``rows_in_unit`` of them are in (duplicates after an attributor restart are dropped by
  (subject kind, pod uid)); a complete unit-window replaces the one shown for that unit when it is not older.
  ``bar_segments(unit)`` turns it into a bar whose cells add up to the bar's width and whose percentages add up to
  100.0 exactly: pods, then idle, driver-reserved and unattributed (largest remainder, so nothing is lost to
  rounding and what is on screen visibly sums to the whole GPU).
* **costs** (``CostRecord``): micro-dollars summed by namespace and by the team label; lines billed to no pod are
  their own groups (``(idle)``, ``(driver reserved)``, ``(unattributed)``, ``(node, not GPU)``), so both tables
  add up to the same total, the sum of the node bills. Of each group's cost, the part that came from buckets
  billing's sharing policy shared to its pods (shared lines, ``CostRecord.shared_from``) is also summed: a
  group's cost is its direct part plus its shared part. A cost line seen twice (same window, node, GPU, subject
  kind, pod and shared bucket) counts once, as in the ledger.
* **violations** (``Violation``): the newest record per fingerprint (the topic is compacted by fingerprint, so
  arrival order per key is the truth); ``active_violations`` lists those FIRING, most severe first.
* **dead-letters** (``DeadLetter``): counted by (service, reason code).

``progress_line`` is the one-line summary printed instead of the live view when the output is not a terminal.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

from schemas.records import (
    CostRecord,
    CostSubjectKind,
    DeadLetter,
    GpuShare,
    Severity,
    ShareSubjectKind,
    Violation,
    ViolationState,
)

BAR_WIDTH_CELLS = 40
PERCENT_TENTHS = 1000  # percentages are shown to 0.1 %: 1000 tenths make the whole
NO_TEAM = "(no team label)"
BUCKET_GROUPS: Mapping[CostSubjectKind, str] = MappingProxyType({
    CostSubjectKind.IDLE: "(idle)",
    CostSubjectKind.DRIVER_RESERVED: "(driver reserved)",
    CostSubjectKind.UNATTRIBUTED: "(unattributed)",
    CostSubjectKind.UNAVAILABLE: "(unavailable GPU)",
    CostSubjectKind.NODE_OTHER: "(node, not GPU)",
})
SHARE_BUCKET_LABELS: Mapping[ShareSubjectKind, str] = MappingProxyType({
    ShareSubjectKind.IDLE: "idle",
    ShareSubjectKind.DRIVER_RESERVED: "reserved",
    ShareSubjectKind.UNATTRIBUTED: "unattributed",
    ShareSubjectKind.UNAVAILABLE: "unavailable",
})
_SHARE_KIND_ORDER = {
    ShareSubjectKind.POD: 0,
    ShareSubjectKind.IDLE: 1,
    ShareSubjectKind.DRIVER_RESERVED: 2,
    ShareSubjectKind.UNATTRIBUTED: 3,
    ShareSubjectKind.UNAVAILABLE: 4,
}
_SEVERITY_ORDER = {Severity.CRITICAL: 0, Severity.WARNING: 1, Severity.INFO: 2}
# Cost-line keys are kept this far (event time) behind a node's newest billed window, to recognise a re-sent
# line without the memory growing with the run's length.
DEFAULT_DEDUPE_HORIZON_MS = 3_600_000


# ----------------------------------------------------------------------------------------------------------------
# Apportioning


def apportion(weights: Sequence[float], total: int) -> tuple[int, ...]:
    """Whole parts of ``total`` in proportion to ``weights`` that add up to ``total`` exactly (largest remainder).

    Each part is the floor of its exact quota, plus one for the largest fractional remainders until the parts add
    up; ties go to the earlier weight. Negative and NaN weights count as 0. All-zero weights give all-zero parts
    (nothing to show, and nothing made up).
    """
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    clean = [w if (w > 0 and not math.isnan(w)) else 0.0 for w in weights]
    weight_sum = math.fsum(clean)
    if weight_sum <= 0 or not math.isfinite(weight_sum):
        return tuple(0 for _ in clean)
    quotas = [w * total / weight_sum for w in clean]
    parts = [math.floor(q) for q in quotas]
    left = total - sum(parts)
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - parts[i]), i))
    for i in by_remainder[:left]:
        parts[i] += 1
    return tuple(parts)


def tenths_text(tenths: int) -> str:
    """``123`` → ``12.3%``."""
    return f"{tenths // 10}.{tenths % 10}%"


def usd_text(micro_usd: int) -> str:
    """Exact USD with six decimals: ``1234567`` → ``$1.234567``."""
    sign = "-" if micro_usd < 0 else ""
    whole, fraction = divmod(abs(micro_usd), 1_000_000)
    return f"{sign}${whole}.{fraction:06d}"


def iso_utc(unix_ms: int) -> str:
    return datetime.fromtimestamp(unix_ms / 1000, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ----------------------------------------------------------------------------------------------------------------
# Shares


@dataclass(frozen=True, slots=True, order=True)
class UnitKey:
    """One GPU unit: a whole GPU, a MIG instance, or a MIG GPU's capacity outside any instance."""

    cluster: str
    node_name: str
    gpu_uuid: str


def _row_key(share: GpuShare) -> tuple[str, str]:
    return (share.subject_kind.value, share.pod_uid or "")


def _row_order(share: GpuShare) -> tuple:
    return (_SHARE_KIND_ORDER[share.subject_kind], share.namespace or "", share.pod_name or "", share.pod_uid or "")


@dataclass(frozen=True, slots=True)
class UnitWindow:
    """Every row of one unit for one window, in display order (pods by namespace and name, then the buckets)."""

    key: UnitKey
    window_start_unix_ms: int
    window_seconds: int
    rows: tuple[GpuShare, ...]

    @classmethod
    def of(cls, rows: Iterable[GpuShare]) -> "UnitWindow":
        ordered = tuple(sorted(rows, key=_row_order))
        first = ordered[0]
        return cls(UnitKey(first.cluster, first.node_name, first.gpu_uuid), first.window_start_unix_ms,
                   first.window_seconds, ordered)

    @property
    def first(self) -> GpuShare:
        return self.rows[0]

    @property
    def is_mig_instance(self) -> bool:
        return self.first.parent_gpu_uuid is not None

    def describe(self) -> str:
        """``H100 80GB HBM3 …9f11``, ``A100-SXM4-80GB MIG 49.6% …1a2b`` (an instance and its fraction of the GPU) or
        ``A100-SXM4-80GB outside MIG 0.8% …2632`` (a MIG GPU's capacity in no instance): model, part, uuid tail."""
        share = self.first
        model = share.gpu_model.removeprefix("NVIDIA ").strip()
        tail = "…" + share.gpu_uuid[-4:]
        if share.parent_gpu_uuid is not None:
            return f"{model} MIG {share.gpu_fraction * 100:.1f}% {tail}"
        if share.gpu_fraction < 1.0 - 1e-9:
            return f"{model} outside MIG {share.gpu_fraction * 100:.1f}% {tail}"
        return f"{model} {tail}"


@dataclass(frozen=True, slots=True)
class BarSegment:
    """One subject's part of a unit's bar: ``cells`` of the bar and ``tenths`` of a percent of the unit."""

    kind: ShareSubjectKind
    label: str
    namespace: str | None
    pod_uid: str | None
    share: float
    cells: int
    tenths: int

    @property
    def percent_text(self) -> str:
        return tenths_text(self.tenths)


def bar_segments(unit: UnitWindow, width_cells: int = BAR_WIDTH_CELLS) -> tuple[BarSegment, ...]:
    """The unit's rows as bar segments: cells add up to ``width_cells`` and tenths of a percent to 1000 (when the
    unit's cost shares are not all zero), each by largest remainder over the rows' ``cost_share``."""
    shares = [row.cost_share for row in unit.rows]
    cells = apportion(shares, width_cells)
    tenths = apportion(shares, PERCENT_TENTHS)
    return tuple(
        BarSegment(
            kind=row.subject_kind,
            label=((row.pod_name or row.pod_uid or "?") if row.subject_kind is ShareSubjectKind.POD
                   else SHARE_BUCKET_LABELS[row.subject_kind]),
            namespace=row.namespace,
            pod_uid=row.pod_uid,
            share=row.cost_share,
            cells=c,
            tenths=t,
        )
        for row, c, t in zip(unit.rows, cells, tenths)
    )


# ----------------------------------------------------------------------------------------------------------------
# Costs and violations


@dataclass(frozen=True, slots=True)
class CostRow:
    """One group of a cost table; ``tenths`` of a percent of the table's total (the rows add up to 1000).
    ``shared_micro_usd`` of ``cost_micro_usd`` came from buckets shared to the group's pods; the rest is direct."""

    group: str
    is_bucket: bool
    cost_micro_usd: int
    tenths: int
    shared_micro_usd: int = 0

    @property
    def direct_micro_usd(self) -> int:
        return self.cost_micro_usd - self.shared_micro_usd

    @property
    def usd(self) -> str:
        return usd_text(self.cost_micro_usd)

    @property
    def direct_usd(self) -> str:
        return usd_text(self.direct_micro_usd)

    @property
    def shared_usd(self) -> str:
        return usd_text(self.shared_micro_usd)

    @property
    def percent_text(self) -> str:
        return tenths_text(self.tenths)


@dataclass(frozen=True, slots=True)
class ViolationRow:
    rule: str
    severity: Severity
    subject: str
    summary: str
    first_seen_unix_ms: int
    last_seen_unix_ms: int
    fingerprint: str


def violation_subject(violation: Violation) -> str:
    """``scratch/debug-shell on gpu-p5-a GPU …9f11``: the most specific subject the violation names."""
    parts = []
    if violation.namespace and violation.pod_name:
        parts.append(f"{violation.namespace}/{violation.pod_name}")
    elif violation.namespace:
        parts.append(f"namespace {violation.namespace}")
    elif violation.team:
        parts.append(f"team {violation.team}")
    if violation.node_name:
        parts.append(("on " if parts else "") + violation.node_name)
    if violation.gpu_uuid:
        parts.append(f"GPU …{violation.gpu_uuid[-4:]}")
    return " ".join(parts) or violation.cluster


# ----------------------------------------------------------------------------------------------------------------
# The state


@dataclass(frozen=True, slots=True)
class ViewState:
    """Everything the view shows, folded from topic records (see the module docstring). Build with
    ``ViewState.empty()`` and ``apply_records``; never mutated."""

    team_label: str = "team"
    dedupe_horizon_ms: int = DEFAULT_DEDUPE_HORIZON_MS
    units: Mapping[UnitKey, UnitWindow] = field(default_factory=lambda: MappingProxyType({}))
    pending: Mapping[tuple[UnitKey, int], Mapping[tuple[str, str], GpuShare]] = field(
        default_factory=lambda: MappingProxyType({}))
    unit_windows_completed: int = 0
    cost_by_namespace: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    cost_by_team: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # Of the above, what came from shared lines (buckets the sharing policy shared to the group's pods).
    shared_by_namespace: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    shared_by_team: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    cost_total_micro_usd: int = 0
    billed_node_windows: int = 0
    cost_lines_seen: Mapping[tuple[str, str, int], frozenset] = field(default_factory=lambda: MappingProxyType({}))
    newest_billed_window_ms: Mapping[tuple[str, str], int] = field(default_factory=lambda: MappingProxyType({}))
    violations: Mapping[str, Violation] = field(default_factory=lambda: MappingProxyType({}))
    dead_letters: Mapping[tuple[str, str], int] = field(default_factory=lambda: MappingProxyType({}))
    shares_seen: int = 0
    costs_seen: int = 0
    violations_seen: int = 0

    @classmethod
    def empty(cls, team_label: str = "team", dedupe_horizon_ms: int = DEFAULT_DEDUPE_HORIZON_MS) -> "ViewState":
        return cls(team_label=team_label, dedupe_horizon_ms=dedupe_horizon_ms)

    @property
    def newest_window_start_ms(self) -> int | None:
        """The start of the newest complete unit-window shown, or None before the first."""
        return max((u.window_start_unix_ms for u in self.units.values()), default=None)


def apply_records(state: ViewState,
                  records: Iterable[GpuShare | CostRecord | Violation | DeadLetter]) -> ViewState:
    """``state`` with ``records`` applied in order. Records of other types raise ``TypeError``."""
    units = dict(state.units)
    pending = {k: dict(v) for k, v in state.pending.items()}
    completed = state.unit_windows_completed
    by_namespace = dict(state.cost_by_namespace)
    by_team = dict(state.cost_by_team)
    shared_namespace = dict(state.shared_by_namespace)
    shared_team = dict(state.shared_by_team)
    total = state.cost_total_micro_usd
    billed = state.billed_node_windows
    lines_seen = dict(state.cost_lines_seen)
    newest_billed = dict(state.newest_billed_window_ms)
    violations = dict(state.violations)
    dead_letters = dict(state.dead_letters)
    counts = {"shares": state.shares_seen, "costs": state.costs_seen, "violations": state.violations_seen}
    touched_units: set[UnitKey] = set()
    touched_nodes: set[tuple[str, str]] = set()

    for record in records:
        if isinstance(record, GpuShare):
            counts["shares"] += 1
            key = UnitKey(record.cluster, record.node_name, record.gpu_uuid)
            shown = units.get(key)
            if shown is not None and record.window_start_unix_ms < shown.window_start_unix_ms:
                continue  # an older window re-emitted: the newer one stays on screen
            rows = pending.setdefault((key, record.window_start_unix_ms), {})
            rows.setdefault(_row_key(record), record)
            if len(rows) >= record.rows_in_unit:
                del pending[(key, record.window_start_unix_ms)]
                unit = UnitWindow.of(rows.values())
                if shown is None or shown.window_start_unix_ms < unit.window_start_unix_ms:
                    completed += 1
                units[key] = unit
                touched_units.add(key)
        elif isinstance(record, CostRecord):
            counts["costs"] += 1
            node = (record.cluster, record.node_name)
            newest = newest_billed.get(node)
            if newest is not None and record.window_start_unix_ms < newest - state.dedupe_horizon_ms:
                continue  # older than anything still remembered: a re-send of a long-billed window
            node_window = (record.cluster, record.node_name, record.window_start_unix_ms)
            line_key = (record.gpu_uuid or "", record.subject_kind.value, record.pod_uid or "",
                        record.shared_from.value if record.shared_from is not None else "")
            seen = lines_seen.get(node_window)
            if seen is None:
                billed += 1
                seen = frozenset()
            if line_key in seen:
                continue
            lines_seen[node_window] = seen | {line_key}
            if newest is None or record.window_start_unix_ms > newest:
                newest_billed[node] = record.window_start_unix_ms
                touched_nodes.add(node)
            if record.subject_kind is CostSubjectKind.POD:
                namespace = record.namespace or "(no namespace)"
                team = record.labels.get(state.team_label) or NO_TEAM
            else:
                namespace = team = BUCKET_GROUPS[record.subject_kind]
            by_namespace[namespace] = by_namespace.get(namespace, 0) + record.cost_micro_usd
            by_team[team] = by_team.get(team, 0) + record.cost_micro_usd
            if record.shared_from is not None:
                shared_namespace[namespace] = shared_namespace.get(namespace, 0) + record.cost_micro_usd
                shared_team[team] = shared_team.get(team, 0) + record.cost_micro_usd
            total += record.cost_micro_usd
        elif isinstance(record, Violation):
            counts["violations"] += 1
            violations[record.fingerprint] = record
        elif isinstance(record, DeadLetter):
            key = (record.service, record.reason_code)
            dead_letters[key] = dead_letters.get(key, 0) + 1
        else:
            raise TypeError(f"the live view takes GpuShare, CostRecord, Violation and DeadLetter records, not "
                            f"{type(record)!r}")

    # Incomplete windows older than what a unit shows can no longer change the screen.
    for pending_key in [k for k in pending if k[0] in touched_units]:
        unit_key, start = pending_key
        if start <= units[unit_key].window_start_unix_ms:
            del pending[pending_key]
    for node in touched_nodes:
        horizon = newest_billed[node] - state.dedupe_horizon_ms
        for node_window in [k for k in lines_seen if (k[0], k[1]) == node and k[2] < horizon]:
            del lines_seen[node_window]

    return replace(
        state,
        units=MappingProxyType(units),
        pending=MappingProxyType({k: MappingProxyType(v) for k, v in pending.items()}),
        unit_windows_completed=completed,
        cost_by_namespace=MappingProxyType(by_namespace),
        cost_by_team=MappingProxyType(by_team),
        shared_by_namespace=MappingProxyType(shared_namespace),
        shared_by_team=MappingProxyType(shared_team),
        cost_total_micro_usd=total,
        billed_node_windows=billed,
        cost_lines_seen=MappingProxyType(lines_seen),
        newest_billed_window_ms=MappingProxyType(newest_billed),
        violations=MappingProxyType(violations),
        dead_letters=MappingProxyType(dead_letters),
        shares_seen=counts["shares"],
        costs_seen=counts["costs"],
        violations_seen=counts["violations"],
    )


# ----------------------------------------------------------------------------------------------------------------
# Views of the state


def unit_windows(state: ViewState) -> tuple[UnitWindow, ...]:
    """The units shown, by cluster, node, physical GPU (MIG instances under their parent), then uuid."""
    return tuple(
        sorted(state.units.values(),
               key=lambda u: (u.key.cluster, u.key.node_name, u.first.parent_gpu_uuid or u.key.gpu_uuid,
                              u.first.parent_gpu_uuid is not None, u.key.gpu_uuid))
    )


def cost_rows(costs: Mapping[str, int], shared: Mapping[str, int] | None = None) -> tuple[CostRow, ...]:
    """A cost table: groups billed to pods by cost (largest first, then name), then the buckets by name; percents
    of the total add up to 100.0. ``shared``: the part of each group's cost that was shared to it."""
    groups = sorted(costs.items(), key=lambda item: (item[0] in BUCKET_GROUPS.values(), -item[1], item[0]))
    tenths = apportion([cost for _, cost in groups], PERCENT_TENTHS)
    bucket_names = set(BUCKET_GROUPS.values())
    shared = shared or {}
    return tuple(CostRow(group, group in bucket_names, cost, t, shared.get(group, 0))
                 for (group, cost), t in zip(groups, tenths))


def namespace_costs(state: ViewState) -> tuple[CostRow, ...]:
    return cost_rows(state.cost_by_namespace, state.shared_by_namespace)


def team_costs(state: ViewState) -> tuple[CostRow, ...]:
    return cost_rows(state.cost_by_team, state.shared_by_team)


def shared_total_micro_usd(state: ViewState) -> int:
    """What the sharing policy moved from buckets to pods so far (0 when every bucket is kept)."""
    return sum(state.shared_by_namespace.values())


def active_violations(state: ViewState) -> tuple[ViolationRow, ...]:
    """Violations whose newest record is FIRING: most severe first, then oldest first."""
    firing = [v for v in state.violations.values() if v.state is ViolationState.FIRING]
    firing.sort(key=lambda v: (_SEVERITY_ORDER.get(v.severity, 9), v.first_seen_unix_ms, v.rule, v.fingerprint))
    return tuple(
        ViolationRow(v.rule, v.severity, violation_subject(v), v.summary, v.first_seen_unix_ms, v.last_seen_unix_ms,
                     v.fingerprint)
        for v in firing
    )


def resolved_count(state: ViewState) -> int:
    return sum(1 for v in state.violations.values() if v.state is ViolationState.RESOLVED)


# ----------------------------------------------------------------------------------------------------------------
# Process health


class ProcessState(enum.StrEnum):
    RUNNING = "running"
    RESTARTING = "restarting"  # exited unexpectedly; will be started again after a backoff
    FAILED = "failed"  # exited unexpectedly and is not restarted
    STOPPING = "stopping"
    STOPPED = "stopped"  # stopped by the run on purpose


@dataclass(frozen=True, slots=True)
class ProcessHealth:
    name: str
    pid: int | None
    state: ProcessState
    restarts: int
    exit_code: int | None
    uptime_seconds: float

    @property
    def healthy(self) -> bool:
        return self.state in (ProcessState.RUNNING, ProcessState.STOPPING, ProcessState.STOPPED)


def health_summary(health: Sequence[ProcessHealth]) -> str:
    """``7/7 running`` plus what is not (``attributor restarting (exit -9), 1 restart``)."""
    running = sum(1 for h in health if h.state is ProcessState.RUNNING)
    text = f"{running}/{len(health)} running"
    problems = [
        f"{h.name} {h.state.value}" + (f" (exit {h.exit_code})" if h.exit_code is not None else "")
        for h in health if h.state in (ProcessState.RESTARTING, ProcessState.FAILED)
    ]
    restarts = sum(h.restarts for h in health)
    if problems:
        text += ", " + ", ".join(problems)
    if restarts:
        text += f", {restarts} restart{'s' if restarts != 1 else ''}"
    return text


def progress_line(state: ViewState, health: Sequence[ProcessHealth], elapsed_seconds: float,
                  sim_now_unix_ms: int | None = None, top_groups: int = 3) -> str:
    """One line for a non-terminal output: time, windows, cost so far (top namespaces; then the top teams, as
    direct + shared when the sharing policy shares anything), violations, processes."""
    parts = [f"t+{elapsed_seconds:5.0f}s"]
    if sim_now_unix_ms is not None:
        parts.append(f"sim {iso_utc(sim_now_unix_ms)}")
    parts.append(f"unit-windows {state.unit_windows_completed}")
    cost = f"cost {usd_text(state.cost_total_micro_usd)} in {state.billed_node_windows} node-windows"
    pods = [row for row in namespace_costs(state) if not row.is_bucket][:top_groups]
    if pods:
        cost += " (" + ", ".join(f"{row.group} {row.usd}" for row in pods) + ")"
    parts.append(cost)
    if shared_total_micro_usd(state):
        teams = [row for row in team_costs(state) if not row.is_bucket][:top_groups]
        parts.append(f"shared {usd_text(shared_total_micro_usd(state))} to pods; by {state.team_label}: "
                     + ", ".join(f"{row.group} {row.direct_usd} + {row.shared_usd}" for row in teams))
    active = active_violations(state)
    violations = f"violations firing {len(active)}"
    if active:
        rules = sorted({row.rule for row in active})
        violations += " (" + ", ".join(rules) + ")"
    parts.append(violations)
    parts.append("processes " + health_summary(health))
    return " | ".join(parts)
