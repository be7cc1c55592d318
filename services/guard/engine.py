"""The guard's state: conditions from the rules → violations that fire, stay, and resolve after a hold-down.

No Kafka here (the service in ``services/guard/`` decodes messages and calls this; ``services/guard/replay.py``
drives it offline). Every method takes the time explicitly (``now_ms``, Unix ms; the engine never reads a clock)
and returns the ``Violation`` records to publish, in order:

* a **FIRING** record when a violation starts (``first_seen`` = now), when its severity changes, and — at most
  once per ``refresh_seconds`` per fingerprint — when its condition is seen again (a refresh with a newer
  ``last_seen``, so a compacted topic and Alertmanager see it is still alive);
* a **RESOLVED** record once its condition has been false for ``hold_down_seconds`` (``resolved_at`` = that
  moment, ``last_seen`` = the last time it was true). A condition that comes back inside the hold-down cancels it
  (no resolve, no new record); one that comes back after the resolve starts a new violation with the same
  fingerprint and a fresh ``first_seen`` (or, with ``refire_suppression_seconds``, once that long has passed
  since the resolve and the condition still holds).

Conditions are kept per **scope** — the set of rules one input re-evaluates: a node's samples (visibility,
unrequested use, shared memory, NVML errors, and the spec check of the node's pods), one pod's spec (its
events), one unit's idle runs (its share windows and costs), one budget subject and period, one node's
silence. A scope re-evaluated without a condition it had before retracts it; a violation is true while any scope
asserts its fingerprint, so the same condition from several inputs is one violation (deduplicated).

Times: ``now_ms`` never goes back inside the engine (an earlier value counts as the latest seen). Silence is
measured from arrival times (``now_ms`` of ``on_sample``), so ``on_clock`` must only be called while the input
is caught up (during a backlog, the backlog's own samples are late, not the nodes silent), as for the attributor.

Budgets sum every cost line of a cluster: one engine must see all of a cluster's CostRecords (a single consumer
of the costs topic, or one engine per cluster). ``GuardEngine(config, budgets=False)`` keeps no spend and judges no
budget (an engine that sees only some nodes: the guard's ``nodes`` role); every other rule needs one node's input
only, so such engines split the nodes between them. ``GuardEngine(config, idle=False)`` judges no idle allocation
(an engine that reads no share windows: the guard's ``budgets`` role) and so keeps no cost per pod and unit.

Cost dedup, for ``cost_dedup_horizon_seconds`` behind the newest window of the cost's node (a cost older than that
is ignored, ``late_costs_ignored`` counting its pod lines): a **bill** (``on_window_cost``) is counted once per
node-window -- the first delivery counts, as the ledger's first write of a node-window is the bill
(``services/billing/ledger.py``), and a redelivery adds nothing (``redelivered_bills_ignored``); all the engine
keeps of a bill is its window; a **line** (``on_cost``, for tools holding the flat cost lines) redelivered replaces
that line, kept per (node, window, unit, pod). A node-window arrives one way or the other, never both: the two are
not deduplicated against each other. Idle allocation counts a pod's cost on a unit into its idle run when the run
covers the cost's window; a run starts at a share window newer than the unit's last, so an engine that judges it
keeps a cost only while its window is newer than its unit's last share window (a cost read before its shares),
per (node, unit, pod, window). A node whose newest cost window is a horizon behind the clock (``on_clock`` while
caught up) has left: its cost state goes.

``snapshot()`` → bytes (JSON) and ``GuardEngine.restore(config, data)`` carry the whole state across a restart
(a snapshot of version 1, from before bills were kept whole, is read too: its pod lines' windows are its bills,
and the lines of windows newer than their unit's last share window its early costs).
Without a snapshot (none kept, or a damaged one), the last state of every fingerprint on the compacted
violations topic stands in for it: ``adopt(last_states, now)`` seeds a fresh engine with the firing ones (kept
under their fingerprint and ``first_seen``, clearing unless the re-read input asserts them again) and the
resolution times of the resolved ones; the caller re-reads its input while publishing nothing, then
``settle(last_states, now)`` returns what the topic must hear so that it says what the engine knows: a violation
firing now that the topic has resolved or never heard of (unless the re-read only replayed it: it is clearing,
and the topic resolved it -- dropped silently), a new severity, and a resolution for what the topic has firing
and the engine does not.
Not thread-safe: one caller at a time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

from gpumeter.clockskew import NodeClocks
from gpumeter.errors import InvalidMessage, OutOfRange
from schemas.devices import CoveringCount
from schemas.pods import PodAssignment
from schemas.records import (
    CostRecord,
    CostSubjectKind,
    GpuDeviceSample,
    GpuShare,
    NodeSample,
    NodeWindowCost,
    PodContainer,
    PodEvent,
    Severity,
    Violation,
    ViolationState,
)
from services.guard.config import PERIODS, GuardConfig
from services.guard.sample_plan import SamplePlans
from services.guard.rules import (
    SUBJECT_NAMESPACE,
    SUBJECT_TEAM,
    BudgetSpend,
    Condition,
    IdleRun,
    PodView,
    advance_idle_run,
    apply_pod_event,
    budget_exceeded,
    classify_unit_window,
    clock_skew,
    cost_subject,
    gpu_error,
    gpu_error_counts,
    idle_allocation,
    parse_device_ids,
    period_bounds,
    replica_refs_of,
    same_objects,
    shared_memory_pressure,
    stale_node,
    unrequested_gpu_use,
    usage_by_pod_and_unit,
    visibility_leak,
    visibility_leak_spec,
)

SNAPSHOT_VERSION = 2
_SNAPSHOT_VERSIONS_READ = (1, 2)  # 1: no bills; its pod lines' windows are its bills
MAX_WINDOW_START_UNIX_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z: datetime's range
_SEVERITY_RANK = {Severity.CRITICAL: 0, Severity.WARNING: 1, Severity.INFO: 2}

NodeKey = tuple[str, str]
_BUDGET_SCOPES_MAX = 65_536  # a cache: cleared whole when full
_NO_COSTS: Mapping[int, int] = MappingProxyType({})


def _check_cost_window(node_name: str, window_start_unix_ms: int) -> None:
    if not 0 <= window_start_unix_ms <= MAX_WINDOW_START_UNIX_MS:
        raise OutOfRange(f"cost line of node {node_name}: window start {window_start_unix_ms} ms is outside "
                         "1970..9999")


def _scope(*parts: str) -> str:
    return json.dumps(list(parts), separators=(",", ":"), ensure_ascii=False)


@dataclass
class _Tracked:
    """One violation the engine knows: published (firing) or held back by refire suppression."""

    condition: Condition
    first_seen_ms: int
    last_seen_ms: int
    scopes: dict[str, None]
    cleared_since_ms: int | None
    published: bool
    last_published_ms: int | None
    published_severity: Severity | None


@dataclass
class _Node:
    cluster: str
    node_name: str
    last_heard_ms: int
    last_sampled_at_ms: int
    interval_ms: int
    device_source: NodeSample | tuple[GpuDeviceSample, ...]  # the latest tick, or its devices (a restore)
    error_streaks: dict[str, int]

    @property
    def devices(self) -> tuple[GpuDeviceSample, ...]:
        """The latest tick's units: built from a v4 tick's columns only when something reads them."""
        source = self.device_source
        return source if isinstance(source, tuple) else source.devices


@dataclass(frozen=True)
class _NodePods:
    """A node's pods as its sample rules read them, with what follows from them alone, kept until one of the node's
    pods changes (``GuardEngine._pods_changed``): ``pods`` by uid, ``replica_refs``
    (``rules.replica_refs_of``), and ``spec_pods``: the alive pods, in uid order, whose spec can show GPUs at all
    (the only ones ``visibility_leak_spec`` can judge a leak)."""

    views: tuple[PodView, ...]
    pods: dict[str, PodView]
    replica_refs: CoveringCount
    spec_pods: tuple[PodView, ...]

    @classmethod
    def of(cls, key: NodeKey, views: tuple[PodView, ...], config: GuardConfig) -> "_NodePods":
        pods = {view.uid: view for view in views}
        honoured = config.visible_devices_envvar_honoured
        spec = tuple(pods[uid] for uid in sorted(pods)
                     if (pods[uid].cluster, pods[uid].node_name) == key and pods[uid].alive
                     and pods[uid].spec_shows_gpus(honoured))
        return cls(views, pods, replica_refs_of(pods), spec)


def _violation(t: _Tracked, fingerprint: str, state: ViolationState, resolved_at_ms: int | None) -> Violation:
    c = t.condition
    return Violation(
        fingerprint=fingerprint,
        rule=c.rule,
        severity=c.severity,
        state=state,
        cluster=c.cluster,
        node_name=c.node_name,
        gpu_uuid=c.gpu_uuid,
        namespace=c.namespace,
        pod_name=c.pod_name,
        pod_uid=c.pod_uid,
        team=c.team,
        summary=c.summary,
        evidence=c.evidence,
        first_seen_unix_ms=t.first_seen_ms,
        last_seen_unix_ms=t.last_seen_ms,
        resolved_at_unix_ms=resolved_at_ms,
    )


class GuardEngine:
    """Rules → violations with state; see the module docstring for the contract of every method."""

    def __init__(self, config: GuardConfig, *, budgets: bool = True, idle: bool = True) -> None:
        self.config = config
        self.budgets = budgets
        self.idle = idle
        self.clocks = NodeClocks(config.clock_skew_threshold_seconds * 1000)
        self._now_ms: int | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._scopes: dict[str, dict[str, None]] = {}
        self._resolved_at: dict[str, int] = {}
        self._clearing: dict[str, None] = {}
        self._nodes: dict[NodeKey, _Node] = {}
        self._pods: dict[str, PodView] = {}
        self._node_pods: dict[NodeKey, dict[str, None]] = {}
        # A cache: a node's entry goes whenever one of its pods changes, arrives, leaves or is pruned
        # (``_pods_changed``), not checked pod by pod at every tick.
        self._node_pod_views: dict[NodeKey, _NodePods] = {}
        self._scope_strings: dict[tuple[str, str, str], str] = {}  # (kind, cluster, node) -> _scope of it
        self._budget_scopes: dict[tuple[str, str, str, str], str] = {}  # (cluster, kind, name, period) -> _scope
        self._sample_plans = SamplePlans(config)  # a cache: checked against each tick's structure and pods
        # idle_allocation: runs per unit, pending share rows per (node, window, unit), last window per unit
        self._idle_runs: dict[tuple[str, str, str], dict[str, IdleRun]] = {}
        self._unit_rows: dict[tuple[str, str, int, str], list[GpuShare]] = {}
        self._unit_last_window: dict[tuple[str, str, str], int] = {}
        self._share_window_max: dict[NodeKey, int] = {}
        # lines taken one by one (on_cost): (cluster, node, unit, pod uid) -> window -> (micro-USD, namespace, team)
        self._line_costs: dict[tuple[str, str, str, str], dict[int, tuple[int, str | None, str | None]]] = {}
        self._line_keys_by_node: dict[NodeKey, dict[tuple[str, str, str, str], None]] = {}
        # bills taken whole (on_window_cost): node -> windows counted
        self._bills: dict[NodeKey, dict[int, None]] = {}
        # idle allocation's costs read before their unit's shares: (cluster, node, unit) -> pod uid -> window ->
        # micro-USD
        self._early_costs: dict[tuple[str, str, str], dict[str, dict[int, int]]] = {}
        self._early_units_by_node: dict[NodeKey, dict[tuple[str, str, str], None]] = {}
        self._cost_window_max: dict[NodeKey, int] = {}
        # (cluster, kind, name, period, period start) -> micro-USD; subjects ever seen
        self._spend: dict[tuple[str, str, str, str, int], int] = {}
        self._budget_subjects: dict[tuple[str, str, str], None] = {}
        self.late_costs_ignored = 0
        self.redelivered_bills_ignored = 0
        self.old_samples_ignored = 0
        self.duplicate_shares_ignored = 0

    # -- inputs ----------------------------------------------------------------------------------------------------

    def on_sample(self, sample: NodeSample, now_ms: int, appended_at_ms: int | None = None) -> tuple[Violation, ...]:
        """One collector tick: the node is alive; its sample rules and its pods' spec check are re-evaluated.
        A tick not newer than the node's newest (a redelivery) changes nothing but the clock. ``appended_at_ms``:
        the broker's append time (None: unknown): the node's clock is measured against it
        (``gpumeter.clockskew``, as the attributor does), its tick's ``sampled_at`` corrected by the offset, and
        ``clock_skew`` judged from it."""
        now = self._tick(now_ms)
        out: list[Violation] = []
        key = (sample.cluster, sample.node_name)
        offset_ms = 0
        if appended_at_ms is not None:
            offset_ms = self.clocks.observe(key, sample.sampled_at_unix_ms, appended_at_ms,
                                            interval_ms=sample.interval_ms).offset_ms
            if offset_ms:
                sample = replace(sample, sampled_at_unix_ms=sample.sampled_at_unix_ms - offset_ms)
        node = self._nodes.get(key)
        if node is not None and sample.sampled_at_unix_ms <= node.last_sampled_at_ms:
            self.old_samples_ignored += 1
            self._expire(now, out)
            return tuple(out)
        counts = gpu_error_counts(sample, self.config)
        previous_streaks = node.error_streaks if node is not None else {}
        streaks = {k: previous_streaks.get(k, 0) + 1 for k in counts}
        interval = sample.interval_ms if sample.interval_ms > 0 else (node.interval_ms if node is not None else 0)
        self._nodes[key] = _Node(sample.cluster, sample.node_name, now, sample.sampled_at_unix_ms, interval,
                                 sample, streaks)
        node_pods = self._node_pods_of(key)
        pods = node_pods.pods
        if self._sample_plans.quiet(key, sample, pods, node_pods.spec_pods, node_pods.replica_refs):
            process_conditions: tuple[Condition, ...] = ()  # what the three rules would find: nothing
        else:
            usage = usage_by_pod_and_unit(sample)  # the three rules' common input, taken once
            process_conditions = (
                visibility_leak(sample, pods, self.config, usage, spec_pods=node_pods.spec_pods)
                + unrequested_gpu_use(sample, pods, self.config, usage)
                + shared_memory_pressure(sample, pods, self.config, usage, node_pods.replica_refs)
            )
        conditions = (
            process_conditions
            + gpu_error(sample, self.config, streaks, counts)
            + clock_skew(sample.cluster, sample.node_name, offset_ms, self.config)
        )
        self._reconcile(self._node_scope("sample", key), conditions, now, out)
        self._reconcile(self._node_scope("stale", key), (), now, out)
        self._expire(now, out)
        return tuple(out)

    def on_pod_event(self, event: PodEvent, now_ms: int) -> tuple[Violation, ...]:
        """A pod changed: its spec is checked at once (``visibility_leak_spec``); the node's sample rules see it
        from the node's next sample. Events older than the pod's newest are ignored."""
        now = self._tick(now_ms)
        out: list[Violation] = []
        previous = self._pods.get(event.uid)
        view = apply_pod_event(previous, event)
        if view is not previous:
            if previous is not None and (previous.cluster, previous.node_name) != (view.cluster, view.node_name):
                self._node_pods.get((previous.cluster, previous.node_name), {}).pop(view.uid, None)
                self._pods_changed((previous.cluster, previous.node_name))
            self._pods_changed((view.cluster, view.node_name))
            self._pods[view.uid] = view
            self._node_pods.setdefault((view.cluster, view.node_name), {})[view.uid] = None
            node = self._nodes.get((view.cluster, view.node_name))
            devices = node.devices if node is not None else ()
            self._reconcile(_scope("spec", view.cluster, view.uid), visibility_leak_spec(view, devices, self.config),
                            now, out)
        self._expire(now, out)
        return tuple(out)

    def on_share(self, share: GpuShare, now_ms: int) -> tuple[Violation, ...]:
        """One GpuShare row. A unit's rows are gathered until its ``rows_in_unit`` have arrived; then the pods that
        hold the unit whole get an idle verdict for the window and ``idle_allocation`` is re-evaluated for the
        unit. Rows of a window at or before the unit's last processed one are redeliveries and ignored."""
        now = self._tick(now_ms)
        out: list[Violation] = []
        unit_key = (share.cluster, share.node_name, share.gpu_uuid)
        last = self._unit_last_window.get(unit_key)
        window = share.window_start_unix_ms
        if last is not None and window <= last:
            self.duplicate_shares_ignored += 1
            self._expire(now, out)
            return tuple(out)
        rows_key = (share.cluster, share.node_name, window, share.gpu_uuid)
        rows = self._unit_rows.setdefault(rows_key, [])
        if any(r.subject_kind is share.subject_kind and r.pod_uid == share.pod_uid for r in rows):
            self.duplicate_shares_ignored += 1
        else:
            rows.append(share)
        node_key = (share.cluster, share.node_name)
        newest = self._share_window_max.get(node_key)
        if newest is None or window > newest:
            self._share_window_max[node_key] = window
            self._drop_incomplete_rows(node_key, window - 2 * share.window_seconds * 1000)
        if len(rows) >= share.rows_in_unit:
            del self._unit_rows[rows_key]
            self._unit_last_window[unit_key] = window
            self._process_unit(rows, now, out)
        self._expire(now, out)
        return tuple(out)

    def on_cost(self, cost: CostRecord, now_ms: int) -> tuple[Violation, ...]:
        """One cost line: POD lines add to their namespace's and team's spend for the UTC day and month of the
        window (budgets re-evaluated for those subjects) and to the pod's idle run on the unit when the window is
        part of it. A redelivered line replaces the first; one older than the dedup horizon is ignored. Raises
        ``OutOfRange`` for a window start no calendar can place (before 1970 or after 9999)."""
        _check_cost_window(cost.node_name, cost.window_start_unix_ms)
        now = self._tick(now_ms)
        out: list[Violation] = []
        if cost.subject_kind is CostSubjectKind.POD and cost.pod_uid is not None and cost.gpu_uuid is not None:
            cluster, node_name, window = cost.cluster, cost.node_name, cost.window_start_unix_ms
            if self._late_cost(cluster, node_name, window):
                self.late_costs_ignored += 1
            else:
                namespace, team = cost_subject(cost.namespace, cost.labels, CostSubjectKind.POD, self.config)
                old = self._put_line(cluster, node_name, window, cost.gpu_uuid, cost.pod_uid, cost.cost_micro_usd,
                                     namespace, team)
                if self.budgets:
                    if old is not None:
                        # A redelivery replaces the line it repeats: take the old one out where it was counted.
                        self._add_spend(cluster, window, old[1], old[2], -old[0])
                    self._add_spend(cluster, window, namespace, team, cost.cost_micro_usd)
                self._newest_cost_window(cluster, node_name, window)
                self._judge_budgets(cluster, namespace, team, now, out)
                self._take_idle_cost(cluster, node_name, window, cost.gpu_uuid, cost.pod_uid,
                                     cost.cost_micro_usd - (old[0] if old is not None else 0), now, out)
        self._expire(now, out)
        return tuple(out)

    def on_window_cost(self, cost: NodeWindowCost, now_ms: int) -> tuple[Violation, ...]:
        """One bill, read from its columns (no ``CostRecord`` per line): every pod line taken as ``on_cost`` would,
        in line order -- the same violations in the same order, and the same state but for how the dedup keeps it
        -- except that the spend of a node-window counts once, from its first bill: a redelivery's lines are judged
        again (refreshes) and count nothing (``redelivered_bills_ignored``). Raises ``OutOfRange`` as ``on_cost``
        does, before any line is taken."""
        _check_cost_window(cost.node_name, cost.window_start_unix_ms)
        now = self._tick(now_ms)
        out: list[Violation] = []
        cluster, node_name, window = cost.cluster, cost.node_name, cost.window_start_unix_ms
        pods, units, pod_kind = cost.pods, cost.unit_uuids, CostSubjectKind.POD
        # Per line: (unit uuid, pod index, micro-USD) for a pod line, None for any other.
        lines = [(units[unit], pod_index, micro_usd) if kind is pod_kind and pod_index >= 0 and unit >= 0 else None
                 for kind, unit, pod_index, micro_usd in zip(cost.line_subject_kinds, cost.line_unit_index,
                                                             cost.line_pod_index, cost.line_cost_micro_usd)]
        if self._late_cost(cluster, node_name, window):
            self.late_costs_ignored += sum(line is not None for line in lines)
            if lines:
                self._expire(now, out)
            return tuple(out)
        # Who each pod's lines count towards: only an engine that judges budgets asks.
        subjects = ([cost_subject(pod.namespace, pod.labels, pod_kind, self.config) for pod in pods]
                    if self.budgets else [])
        counted = self._bills.setdefault((cluster, node_name), {})
        first_delivery = window not in counted
        if first_delivery:
            counted[window] = None
        else:
            self.redelivered_bills_ignored += 1
        self._newest_cost_window(cluster, node_name, window)
        for line in lines:
            if line is not None:
                gpu_uuid, pod_index, micro_usd = line
                if self.budgets:
                    namespace, team = subjects[pod_index]
                    if first_delivery:
                        self._add_spend(cluster, window, namespace, team, micro_usd)
                    self._judge_budgets(cluster, namespace, team, now, out)
                self._take_idle_cost(cluster, node_name, window, gpu_uuid, pods[pod_index].pod_uid,
                                     micro_usd if first_delivery else 0, now, out)
            self._expire(now, out)
        return tuple(out)

    def _late_cost(self, cluster: str, node_name: str, window: int) -> bool:
        """A cost of ``window`` is older than the dedup horizon behind its node's newest cost window."""
        newest = self._cost_window_max.get((cluster, node_name))
        return newest is not None and window < newest - self.config.cost_dedup_horizon_seconds * 1000

    def _put_line(self, cluster: str, node_name: str, window: int, gpu_uuid: str, pod_uid: str, cost_micro_usd: int,
                  namespace: str | None, team: str | None) -> tuple[int, str | None, str | None] | None:
        """Keep one line taken by ``on_cost`` per (node, unit, pod, window); returns the one it replaces (None: the
        first)."""
        line_key = (cluster, node_name, gpu_uuid, pod_uid)
        cells = self._line_costs.get(line_key)
        if cells is None:
            cells = self._line_costs[line_key] = {}
            self._line_keys_by_node.setdefault((cluster, node_name), {})[line_key] = None
        old = cells.get(window)
        cells[window] = (cost_micro_usd, namespace, team)
        return old

    def _newest_cost_window(self, cluster: str, node_name: str, window: int) -> None:
        """``window`` has costs of the node: when it is its newest, what falls behind the horizon goes."""
        node_key = (cluster, node_name)
        newest = self._cost_window_max.get(node_key)
        if newest is None or window > newest:
            self._cost_window_max[node_key] = window
            self._prune_costs(node_key, window - self.config.cost_dedup_horizon_seconds * 1000)

    def _judge_budgets(self, cluster: str, namespace: str | None, team: str | None, now: int,
                       out: list[Violation]) -> None:
        """After one pod line's spend is counted: its subjects' budgets re-evaluated (hold-downs not yet expired)."""
        if not self.budgets:
            return
        for kind, name in ((SUBJECT_NAMESPACE, namespace), (SUBJECT_TEAM, team)):
            if name is None:
                continue
            self._budget_subjects[(cluster, kind, name)] = None
            for period in PERIODS:
                self._evaluate_budget(cluster, kind, name, period, now, out)

    def _take_idle_cost(self, cluster: str, node_name: str, window: int, gpu_uuid: str, pod_uid: str,
                        delta_micro_usd: int, now: int, out: list[Violation]) -> None:
        """``delta_micro_usd``: what one pod line changed of the pod's cost on the unit in ``window``. Added to the
        pod's idle run there when the run covers the window, and kept while the window is newer than the unit's
        last share window (a run starting at it, or before it, counts it); hold-downs not yet expired."""
        if not self.idle or not delta_micro_usd:
            return
        unit_key = (cluster, node_name, gpu_uuid)
        last_share_window = self._unit_last_window.get(unit_key)
        if last_share_window is None or window > last_share_window:
            self._keep_early_cost(unit_key, pod_uid, window, delta_micro_usd)
        runs = self._idle_runs.get(unit_key)
        run = runs.get(pod_uid) if runs else None
        if run is not None and window >= run.since_unix_ms:
            runs[pod_uid] = replace(run, wasted_cost_micro_usd=run.wasted_cost_micro_usd + delta_micro_usd)
            self._evaluate_idle(unit_key, now, out)

    def on_clock(self, now_ms: int, *, detect_stale: bool = True) -> tuple[Violation, ...]:
        """Time passed: silent nodes (``stale_node``; a node silent for ``stale_node_forget_seconds`` is forgotten
        with everything tied to it), budget periods rolling over, idle runs without news for
        ``idle_evidence_max_age_seconds`` dropped, deleted pods pruned after ``pod_linger_seconds``, refire
        suppression ending, hold-downs expiring. ``detect_stale=False`` at the end of a finite input (replay):
        the input's end is not the nodes going silent."""
        now = self._tick(now_ms)
        out: list[Violation] = []
        if detect_stale:
            self._forget_costs(now)
            for key in list(self._nodes):
                node = self._nodes[key]
                if now - node.last_heard_ms > self.config.stale_node_forget_seconds * 1000:
                    self._forget_node(key, now, out)
                    continue
                self._reconcile(self._node_scope("stale", key),
                                stale_node(node.cluster, node.node_name, node.last_heard_ms, node.interval_ms, now,
                                           self.config), now, out)
        for cluster, kind, name in list(self._budget_subjects):
            for period in PERIODS:
                self._evaluate_budget(cluster, kind, name, period, now, out)
        max_age_ms = self.config.idle_evidence_max_age_seconds * 1000
        for unit_key in list(self._idle_runs):
            runs = self._idle_runs[unit_key]
            stale = [uid for uid, run in runs.items() if now - run.updated_at_unix_ms > max_age_ms]
            if stale:
                for uid in stale:
                    del runs[uid]
                self._evaluate_idle(unit_key, now, out)
        self._prune(now, out)
        if self.config.refire_suppression_seconds:
            for fingerprint, t in list(self._tracked.items()):
                if not t.published and t.scopes and not self._suppressed(fingerprint, now):
                    self._publish(fingerprint, t, now, out)
        self._expire(now, out)
        return tuple(out)

    # -- rebuilding from the violations topic ---------------------------------------------------------------------

    def adopt(self, last_states: Iterable[Violation], now_ms: int) -> None:
        """Seed a fresh engine with the violations topic's last state per fingerprint (see the module docstring)."""
        now = self._tick(now_ms)
        for v in last_states:
            if v.state is ViolationState.FIRING:
                condition = Condition(rule=v.rule, severity=v.severity, cluster=v.cluster, node_name=v.node_name,
                                      gpu_uuid=v.gpu_uuid, namespace=v.namespace, pod_name=v.pod_name,
                                      pod_uid=v.pod_uid, team=v.team, summary=v.summary, evidence=v.evidence)
                # No scope asserts it yet: it resolves after the hold-down unless the re-read input holds it.
                self._tracked[v.fingerprint] = _Tracked(condition, v.first_seen_unix_ms, v.last_seen_unix_ms, {},
                                                        now, True, v.last_seen_unix_ms, v.severity)
                self._clearing[v.fingerprint] = None
            elif v.resolved_at_unix_ms is not None and self.config.refire_suppression_seconds > 0:
                self._resolved_at[v.fingerprint] = v.resolved_at_unix_ms

    def settle(self, last_states: Mapping[str, Violation], now_ms: int) -> tuple[Violation, ...]:
        """After ``adopt`` and the re-read: what to publish so that the topic says what the engine knows."""
        now = self._tick(now_ms)
        out: list[Violation] = []
        for fp, t in list(self._tracked.items()):
            if not t.published:
                continue
            last = last_states.get(fp)
            if last is not None and last.state is ViolationState.FIRING:
                if last.severity is not t.condition.severity:
                    self._publish(fp, t, now, out)
                continue
            if last is not None and t.cleared_since_ms is not None:
                # Resolved on the topic and not holding now: the re-read replayed history.
                del self._tracked[fp]
                self._clearing.pop(fp, None)
                for scope in t.scopes:
                    self._scopes.get(scope, {}).pop(fp, None)
                continue
            self._publish(fp, t, now, out)
        for fp, last in last_states.items():
            if last.state is ViolationState.FIRING and fp not in self._tracked:
                out.append(replace(last, state=ViolationState.RESOLVED, resolved_at_unix_ms=now))
                if self.config.refire_suppression_seconds > 0:
                    self._resolved_at[fp] = now
        return tuple(out)

    # -- views -----------------------------------------------------------------------------------------------------

    def active(self) -> tuple[Violation, ...]:
        """The published violations that are firing now (including those inside their hold-down), most severe
        first, then by rule and first_seen."""
        rows = [
            _violation(t, fp, ViolationState.FIRING, None) for fp, t in self._tracked.items() if t.published
        ]
        rows.sort(key=lambda v: (_SEVERITY_RANK[v.severity], v.rule, v.first_seen_unix_ms, v.fingerprint))
        return tuple(rows)

    @property
    def now_ms(self) -> int | None:
        """The latest time the engine was given."""
        return self._now_ms

    # -- the state machine -----------------------------------------------------------------------------------------

    def _tick(self, now_ms: int) -> int:
        if self._now_ms is None or now_ms > self._now_ms:
            self._now_ms = int(now_ms)
        return self._now_ms

    def _reconcile(self, scope: str, conditions: Iterable[Condition], now: int, out: list[Violation]) -> None:
        if not conditions and scope not in self._scopes:
            return  # nothing held in the scope and nothing to hold: most budget re-evaluations
        current: dict[str, Condition] = {}
        for condition in conditions:
            fp = condition.fingerprint
            held = current.get(fp)
            if held is None or _SEVERITY_RANK[condition.severity] < _SEVERITY_RANK[held.severity]:
                current[fp] = condition
        previous = self._scopes.get(scope, {})
        for fp, condition in current.items():
            self._assert(fp, scope, condition, now, out)
        for fp in previous:
            if fp not in current:
                self._retract(fp, scope, now)
        if current:
            self._scopes[scope] = dict.fromkeys(current)
        else:
            self._scopes.pop(scope, None)

    def _assert(self, fp: str, scope: str, condition: Condition, now: int, out: list[Violation]) -> None:
        t = self._tracked.get(fp)
        if t is None:
            t = _Tracked(condition, now, now, {scope: None}, None, False, None, None)
            self._tracked[fp] = t
            if not self._suppressed(fp, now):
                self._publish(fp, t, now, out)
            return
        t.scopes[scope] = None
        t.condition = condition
        t.last_seen_ms = max(t.last_seen_ms, now)
        t.cleared_since_ms = None
        self._clearing.pop(fp, None)
        if not t.published:
            if not self._suppressed(fp, now):
                self._publish(fp, t, now, out)
            return
        due = t.last_published_ms is None or now - t.last_published_ms >= self.config.refresh_seconds * 1000
        if t.published_severity is not condition.severity or due:
            self._publish(fp, t, now, out)

    def _suppressed(self, fp: str, now: int) -> bool:
        """Whether ``fp`` resolved less than ``refire_suppression_seconds`` ago."""
        resolved = self._resolved_at.get(fp)
        return resolved is not None and now < resolved + self.config.refire_suppression_seconds * 1000

    def _retract(self, fp: str, scope: str, now: int) -> None:
        t = self._tracked.get(fp)
        if t is None:
            return
        t.scopes.pop(scope, None)
        if not t.scopes and t.cleared_since_ms is None:
            t.cleared_since_ms = now
            self._clearing[fp] = None

    def _publish(self, fp: str, t: _Tracked, now: int, out: list[Violation]) -> None:
        t.published = True
        t.last_published_ms = now
        t.published_severity = t.condition.severity
        out.append(_violation(t, fp, ViolationState.FIRING, None))

    def _expire(self, now: int, out: list[Violation]) -> None:
        hold_ms = self.config.hold_down_seconds * 1000
        due = []
        for fp in self._clearing:
            t = self._tracked[fp]
            if t.cleared_since_ms is not None and now - t.cleared_since_ms >= hold_ms:
                due.append((t.cleared_since_ms, fp))
        for _, fp in sorted(due):
            t = self._tracked.pop(fp)
            del self._clearing[fp]
            if t.published:
                out.append(_violation(t, fp, ViolationState.RESOLVED, now))
                if self.config.refire_suppression_seconds > 0:
                    self._resolved_at[fp] = now

    # -- rules that need state -------------------------------------------------------------------------------------

    def _node_pods_of(self, key: NodeKey) -> _NodePods:
        """``_NodePods`` of the node's pods now: the cached one until one of them changes (``_pods_changed``)."""
        cached = self._node_pod_views.get(key)
        if cached is None:
            pods = self._pods
            views = tuple(pods[uid] for uid in self._node_pods.get(key, ()) if uid in pods)
            cached = self._node_pod_views[key] = _NodePods.of(key, views, self.config)
        return cached

    def _pods_changed(self, key: NodeKey) -> None:
        """A pod of node ``key`` changed, arrived, left or was pruned: its ``_NodePods`` is made again at its next
        use. Every change to ``_pods`` or ``_node_pods`` outside a restore (which starts with no cache) calls
        this, or drops the node whole (``_forget_node``)."""
        self._node_pod_views.pop(key, None)

    def _node_scope(self, kind: str, key: NodeKey) -> str:
        """``_scope(kind, *key)``, made once per node (every tick reconciles two of them)."""
        name = (kind, key[0], key[1])
        scope = self._scope_strings.get(name)
        if scope is None:
            scope = self._scope_strings[name] = _scope(kind, *key)
        return scope

    def _process_unit(self, rows: Sequence[GpuShare], now: int, out: list[Violation]) -> None:
        first = rows[0]
        unit_key = (first.cluster, first.node_name, first.gpu_uuid)
        node = self._nodes.get((first.cluster, first.node_name))
        device = next((d for d in node.devices if d.uuid == first.gpu_uuid), None) if node is not None else None
        verdicts = classify_unit_window(rows, self._pods, self.config, device)
        early = self._early_costs.get(unit_key, {})
        runs = self._idle_runs.get(unit_key, {})
        updated: dict[str, IdleRun] = {}
        for uid, (verdict, row) in verdicts.items():
            run = advance_idle_run(runs.get(uid), verdict, row, now, early.get(uid, _NO_COSTS))
            if run is not None:
                updated[uid] = run
        # Runs of pods with no row in this window no longer hold the unit (ended, reassigned): they end here.
        if updated:
            self._idle_runs[unit_key] = updated
        else:
            self._idle_runs.pop(unit_key, None)
        if updated or runs:
            self._evaluate_idle(unit_key, now, out)
        # No run can start at this window or before it any more: the costs kept for that go.
        self._drop_early_costs(unit_key, first.window_start_unix_ms)

    def _evaluate_idle(self, unit_key: tuple[str, str, str], now: int, out: list[Violation]) -> None:
        runs = self._idle_runs.get(unit_key, {})
        if not runs:
            self._idle_runs.pop(unit_key, None)
        conditions: list[Condition] = []
        for uid in sorted(runs):
            conditions.extend(idle_allocation(runs[uid], self._pods.get(uid), self.config))
        self._reconcile(_scope("idle", *unit_key), conditions, now, out)

    def _add_spend(self, cluster: str, window: int, namespace: str | None, team: str | None, amount: int) -> None:
        for kind, name in ((SUBJECT_NAMESPACE, namespace), (SUBJECT_TEAM, team)):
            if name is None:
                continue
            for period in PERIODS:
                key = (cluster, kind, name, period, period_bounds(period, window)[0])
                self._spend[key] = self._spend.get(key, 0) + amount

    def _evaluate_budget(self, cluster: str, kind: str, name: str, period: str, now: int,
                         out: list[Violation]) -> None:
        budget = self.config.namespace_budget(name) if kind == SUBJECT_NAMESPACE else self.config.team_budget(name)
        limit = budget.for_period(period) if budget is not None else None
        conditions: tuple[Condition, ...] = ()
        if limit is not None:
            start, end = period_bounds(period, now)
            spent = self._spend.get((cluster, kind, name, period, start), 0)
            conditions = budget_exceeded(BudgetSpend(cluster, kind, name, period, start, end, spent, limit), now,
                                         self.config)
        self._reconcile(self._budget_scope(cluster, kind, name, period), conditions, now, out)

    def _budget_scope(self, cluster: str, kind: str, name: str, period: str) -> str:
        """``_scope("budget", cluster, kind, name, period)``, made once per subject and period (every cost line
        re-evaluates four of them)."""
        key = (cluster, kind, name, period)
        scope = self._budget_scopes.get(key)
        if scope is None:
            if len(self._budget_scopes) >= _BUDGET_SCOPES_MAX:
                self._budget_scopes.clear()
            scope = self._budget_scopes[key] = _scope("budget", cluster, kind, name, period)
        return scope

    # -- pruning ---------------------------------------------------------------------------------------------------

    def _drop_incomplete_rows(self, node_key: NodeKey, before_window_ms: int) -> None:
        for key in [k for k in self._unit_rows if (k[0], k[1]) == node_key and k[2] < before_window_ms]:
            del self._unit_rows[key]

    def _prune_costs(self, node_key: NodeKey, before_window_ms: int) -> None:
        keys = self._line_keys_by_node.get(node_key, {})
        for line_key in list(keys):
            cells = self._line_costs.get(line_key, {})
            for window in [w for w in cells if w < before_window_ms]:
                del cells[window]
            if not cells:
                self._line_costs.pop(line_key, None)
                del keys[line_key]
        if not keys:
            self._line_keys_by_node.pop(node_key, None)
        for unit_key in list(self._early_units_by_node.get(node_key, ())):
            self._drop_early_costs(unit_key, before_window_ms - 1)
        bills = self._bills.get(node_key)
        if bills is not None:
            for window in [w for w in bills if w < before_window_ms]:
                del bills[window]

    def _keep_early_cost(self, unit_key: tuple[str, str, str], pod_uid: str, window: int, micro_usd: int) -> None:
        pods = self._early_costs.get(unit_key)
        if pods is None:
            pods = self._early_costs[unit_key] = {}
            self._early_units_by_node.setdefault(unit_key[:2], {})[unit_key] = None
        cells = pods.setdefault(pod_uid, {})
        cells[window] = cells.get(window, 0) + micro_usd

    def _drop_early_costs(self, unit_key: tuple[str, str, str], through_window_ms: int) -> None:
        """The unit's costs kept for idle runs of windows up to ``through_window_ms`` go."""
        pods = self._early_costs.get(unit_key)
        if pods is None:
            return
        for uid in list(pods):
            cells = pods[uid]
            for window in [w for w in cells if w <= through_window_ms]:
                del cells[window]
            if not cells:
                del pods[uid]
        if not pods:
            del self._early_costs[unit_key]
            units = self._early_units_by_node.get(unit_key[:2])
            if units is not None:
                units.pop(unit_key, None)
                if not units:
                    del self._early_units_by_node[unit_key[:2]]

    def _forget_costs(self, now: int) -> None:
        """Nodes whose newest cost window is a dedup horizon behind ``now`` have left (or stopped being billed):
        everything kept of their costs goes (a node that comes back starts afresh)."""
        horizon_ms = self.config.cost_dedup_horizon_seconds * 1000
        for node_key in [k for k, newest in self._cost_window_max.items() if newest < now - horizon_ms]:
            del self._cost_window_max[node_key]
            self._bills.pop(node_key, None)
            for line_key in self._line_keys_by_node.pop(node_key, {}):
                self._line_costs.pop(line_key, None)
            for unit_key in self._early_units_by_node.pop(node_key, {}):
                self._early_costs.pop(unit_key, None)

    def _forget_node(self, key: NodeKey, now: int, out: list[Violation]) -> None:
        cluster, node_name = key
        del self._nodes[key]
        self._reconcile(_scope("stale", *key), (), now, out)
        self._reconcile(_scope("sample", *key), (), now, out)
        for unit_key in [k for k in self._idle_runs if (k[0], k[1]) == key]:
            del self._idle_runs[unit_key]
            self._reconcile(_scope("idle", *unit_key), (), now, out)
        self._node_pod_views.pop(key, None)
        self._scope_strings.pop(("sample", *key), None)
        self._scope_strings.pop(("stale", *key), None)
        self._sample_plans.forget(key)
        for uid in list(self._node_pods.pop(key, {})):
            self._pods.pop(uid, None)
            self._reconcile(_scope("spec", cluster, uid), (), now, out)
        self._share_window_max.pop(key, None)
        for unit_key in [k for k in self._unit_last_window if (k[0], k[1]) == key]:
            del self._unit_last_window[unit_key]
        self._drop_incomplete_rows(key, 2**62)

    def _prune(self, now: int, out: list[Violation]) -> None:
        linger_ms = self.config.pod_linger_seconds * 1000
        for uid, pod in list(self._pods.items()):
            if pod.deleted_at_unix_ms is not None and now - pod.deleted_at_unix_ms >= linger_ms:
                del self._pods[uid]
                self._node_pods.get((pod.cluster, pod.node_name), {}).pop(uid, None)
                self._pods_changed((pod.cluster, pod.node_name))
                self._reconcile(_scope("spec", pod.cluster, uid), (), now, out)
        horizon_ms = self.config.cost_dedup_horizon_seconds * 1000
        for key in [k for k in self._spend if period_bounds(k[3], k[4])[1] < now - horizon_ms]:
            del self._spend[key]
        suppression_ms = self.config.refire_suppression_seconds * 1000
        for fp in [fp for fp, at in self._resolved_at.items() if now - at >= suppression_ms]:
            del self._resolved_at[fp]

    # -- snapshot / restore ----------------------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The whole state as JSON bytes (deterministic for a given state); ``restore`` reads it back."""
        state = {
            "version": SNAPSHOT_VERSION,
            "now_ms": self._now_ms,
            "tracked": [
                {
                    "fingerprint": fp,
                    "condition": _condition_json(t.condition),
                    "first_seen_ms": t.first_seen_ms,
                    "last_seen_ms": t.last_seen_ms,
                    "scopes": list(t.scopes),
                    "cleared_since_ms": t.cleared_since_ms,
                    "published": t.published,
                    "last_published_ms": t.last_published_ms,
                    "published_severity": None if t.published_severity is None else str(t.published_severity),
                }
                for fp, t in self._tracked.items()
            ],
            "scopes": {scope: list(fps) for scope, fps in self._scopes.items()},
            "resolved_at": dict(self._resolved_at),
            "nodes": [
                {
                    "cluster": n.cluster,
                    "node_name": n.node_name,
                    "last_heard_ms": n.last_heard_ms,
                    "last_sampled_at_ms": n.last_sampled_at_ms,
                    "interval_ms": n.interval_ms,
                    "devices": [d.to_avro() for d in n.devices],
                    "error_streaks": dict(n.error_streaks),
                }
                for n in self._nodes.values()
            ],
            "pods": [_pod_json(p) for p in self._pods.values()],
            "idle_runs": [asdict(run) for runs in self._idle_runs.values() for run in runs.values()],
            "unit_rows": [r.to_avro() for rows in self._unit_rows.values() for r in rows],
            "unit_last_window": [[*k, w] for k, w in self._unit_last_window.items()],
            "share_window_max": [[*k, w] for k, w in self._share_window_max.items()],
            "line_costs": [
                [*line_key, window, cost, namespace, team]
                for line_key, cells in self._line_costs.items()
                for window, (cost, namespace, team) in cells.items()
            ],
            "early_costs": [
                [*unit_key, uid, window, cost]
                for unit_key, pods in self._early_costs.items()
                for uid, cells in pods.items()
                for window, cost in cells.items()
            ],
            "bills": [[*node_key, list(windows)] for node_key, windows in self._bills.items() if windows],
            "cost_window_max": [[*k, w] for k, w in self._cost_window_max.items()],
            "spend": [[*k, v] for k, v in self._spend.items()],
            "budget_subjects": [list(k) for k in self._budget_subjects],
            "counters": {
                "late_costs_ignored": self.late_costs_ignored,
                "redelivered_bills_ignored": self.redelivered_bills_ignored,
                "old_samples_ignored": self.old_samples_ignored,
                "duplicate_shares_ignored": self.duplicate_shares_ignored,
            },
        }
        return json.dumps(state, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")

    @classmethod
    def restore(cls, config: GuardConfig, data: bytes, *, budgets: bool = True, idle: bool = True) -> "GuardEngine":
        """An engine in the state ``snapshot`` wrote, under ``config`` (thresholds may have changed since), with
        ``budgets`` and ``idle`` as the constructor takes them. Raises ``InvalidMessage`` (reason ``CORRUPT``) for
        bytes ``snapshot`` did not write."""
        engine = cls(config, budgets=budgets, idle=idle)
        try:
            state = json.loads(data)
            if not isinstance(state, dict) or state.get("version") not in _SNAPSHOT_VERSIONS_READ:
                raise ValueError(f"not a guard snapshot of version {' or '.join(map(str, _SNAPSHOT_VERSIONS_READ))}")
            engine._now_ms = state["now_ms"]
            for item in state["tracked"]:
                severity = item["published_severity"]
                engine._tracked[item["fingerprint"]] = _Tracked(
                    condition=_condition_from_json(item["condition"]),
                    first_seen_ms=int(item["first_seen_ms"]),
                    last_seen_ms=int(item["last_seen_ms"]),
                    scopes=dict.fromkeys(item["scopes"]),
                    cleared_since_ms=item["cleared_since_ms"],
                    published=bool(item["published"]),
                    last_published_ms=item["last_published_ms"],
                    published_severity=None if severity is None else Severity(severity),
                )
            engine._clearing = {fp: None for fp, t in engine._tracked.items() if t.cleared_since_ms is not None}
            engine._scopes = {scope: dict.fromkeys(fps) for scope, fps in state["scopes"].items()}
            engine._resolved_at = {fp: int(at) for fp, at in state["resolved_at"].items()}
            for n in state["nodes"]:
                key = (n["cluster"], n["node_name"])
                engine._nodes[key] = _Node(
                    n["cluster"], n["node_name"], int(n["last_heard_ms"]), int(n["last_sampled_at_ms"]),
                    int(n["interval_ms"]), tuple(GpuDeviceSample.from_avro(d) for d in n["devices"]),
                    {k: int(v) for k, v in n["error_streaks"].items()},
                )
            for p in state["pods"]:
                view = _pod_from_json(p)
                engine._pods[view.uid] = view
                engine._node_pods.setdefault((view.cluster, view.node_name), {})[view.uid] = None
            for r in state["idle_runs"]:
                run = IdleRun(**r)
                engine._idle_runs.setdefault((run.cluster, run.node_name, run.gpu_uuid), {})[run.pod_uid] = run
            for r in state["unit_rows"]:
                share = GpuShare.from_avro(r)
                engine._unit_rows.setdefault(
                    (share.cluster, share.node_name, share.window_start_unix_ms, share.gpu_uuid), []).append(share)
            engine._unit_last_window = {(c, n, u): int(w) for c, n, u, w in state["unit_last_window"]}
            engine._share_window_max = {(c, n): int(w) for c, n, w in state["share_window_max"]}
            if state["version"] >= 2:
                for cluster, node, unit, uid, window, cost, namespace, team in state["line_costs"]:
                    engine._put_line(cluster, node, int(window), unit, uid, int(cost), namespace, team)
                for cluster, node, unit, uid, window, cost in state["early_costs"]:
                    engine._keep_early_cost((cluster, node, unit), uid, int(window), int(cost))
                engine._bills = {(cluster, node): dict.fromkeys(map(int, windows))
                                 for cluster, node, windows in state["bills"]}
            else:  # version 1: a cell per pod line the guard took from its bills
                for cluster, node, unit, uid, window, cost, _namespace, _team in state["costs"]:
                    engine._bills.setdefault((cluster, node), {})[int(window)] = None
                    last_share_window = engine._unit_last_window.get((cluster, node, unit))
                    if idle and (last_share_window is None or int(window) > last_share_window):
                        engine._keep_early_cost((cluster, node, unit), uid, int(window), int(cost))
            engine._cost_window_max = {(c, n): int(w) for c, n, w in state["cost_window_max"]}
            engine._spend = {(c, k, n, p, int(s)): int(v) for c, k, n, p, s, v in state["spend"]}
            engine._budget_subjects = {(c, k, n): None for c, k, n in state["budget_subjects"]}
            counters = state["counters"]
            engine.late_costs_ignored = int(counters["late_costs_ignored"])
            engine.redelivered_bills_ignored = int(counters.get("redelivered_bills_ignored", 0))
            engine.old_samples_ignored = int(counters["old_samples_ignored"])
            engine.duplicate_shares_ignored = int(counters["duplicate_shares_ignored"])
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise InvalidMessage(f"not a guard snapshot: {exc!r}", reason_code="CORRUPT") from None
        return engine


def _condition_json(c: Condition) -> dict[str, Any]:
    return {
        "rule": c.rule,
        "severity": str(c.severity),
        "cluster": c.cluster,
        "node_name": c.node_name,
        "gpu_uuid": c.gpu_uuid,
        "namespace": c.namespace,
        "pod_name": c.pod_name,
        "pod_uid": c.pod_uid,
        "team": c.team,
        "summary": c.summary,
        "evidence": dict(c.evidence),
        "qualifier": c.qualifier,
    }


def _condition_from_json(d: Mapping[str, Any]) -> Condition:
    return Condition(
        rule=d["rule"], severity=Severity(d["severity"]), cluster=d["cluster"], node_name=d["node_name"],
        gpu_uuid=d["gpu_uuid"], namespace=d["namespace"], pod_name=d["pod_name"], pod_uid=d["pod_uid"],
        team=d["team"], summary=d["summary"], evidence=d["evidence"], qualifier=d["qualifier"],
    )


def _pod_json(p: PodView) -> dict[str, Any]:
    return {
        "uid": p.uid,
        "cluster": p.cluster,
        "node_name": p.node_name,
        "namespace": p.namespace,
        "name": p.name,
        "labels": dict(p.labels),
        "phase": p.phase,
        "gpu_requests": dict(p.gpu_requests),
        "containers": [c.to_avro() for c in p.containers],
        "device_ids": list(p.device_ids),
        "assignments": [[a.container_name, a.resource_name, a.device_id] for a in p.assignments],
        "observed_at_unix_ms": p.observed_at_unix_ms,
        "resource_version": p.resource_version,
        "ended_at_unix_ms": p.ended_at_unix_ms,
        "deleted_at_unix_ms": p.deleted_at_unix_ms,
    }


def _pod_from_json(d: Mapping[str, Any]) -> PodView:
    ids = tuple(d["device_ids"])
    refs, unparsed = parse_device_ids(ids)
    # Snapshots written before assignments were kept name the ids only.
    assignments = tuple(PodAssignment(*entry) for entry in d.get("assignments", [["", "", i] for i in ids]))
    return PodView(
        uid=d["uid"], cluster=d["cluster"], node_name=d["node_name"], namespace=d["namespace"], name=d["name"],
        labels=MappingProxyType(dict(d["labels"])), phase=d["phase"],
        gpu_requests=MappingProxyType({k: int(v) for k, v in d["gpu_requests"].items()}),
        containers=tuple(PodContainer.from_avro(c) for c in d["containers"]), device_ids=ids, device_refs=refs,
        unparsed_device_ids=unparsed, observed_at_unix_ms=int(d["observed_at_unix_ms"]),
        resource_version=d["resource_version"], ended_at_unix_ms=d["ended_at_unix_ms"],
        deleted_at_unix_ms=d["deleted_at_unix_ms"], assignments=assignments,
    )


__all__ = ["GuardEngine", "SNAPSHOT_VERSION"]
