"""The reads that reports and ``/allocation`` share, from the coarsest grain that answers (``rollups.plan``): whole
days from the daily rollups, whole hours from the hourly ones, the minutes at the edges from ``node_bills`` and
``cost_lines``.

* ``bill_summary``: a range's node bills -- their total in a cost basis and count (what a report and ``/allocation``
  reconcile with), the per node and price pricing, the sharing policies, the trued-up count -- from the bill
  rollups (``services.billing.read_rollups``) over a plan's hour and day segments and from the node bills over its
  minute segments. Equal to the minute answer to the micro-dollar: the rollups are the bills' exact sums.
* ``allocation_sums``: ``Ledger.allocation_sums``' pods and buckets, from the pod rollups and the line rollups where
  the query aggregates by what they keep (namespace, node, cluster, or the label the rollups keep as the team) and
  every period of a rollup lies inside one step (``allocation_segments``); by pod or another label, from the
  minute lines. A part of the range retention dropped at the grain that would answer it is refused
  (``MinuteLinesDropped``), never reported as costing nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import String, case, func, literal, select

from gpumeter.clock import iso_utc
from gpumeter.errors import ConfigError
from services.billing import read_rollups, rollups
from services.billing.ledger import (
    COST_BASES,
    READ_ROLLUPS,
    ROLLUPS,
    Ledger,
    MinuteLinesDropped,
    NodePricingRow,
    price_versions,
)
from services.billing.rollups import DAY, HOUR, MINUTE, Plan, Segment

if TYPE_CHECKING:
    from services.billing.allocation import AllocationQuery, BucketSum, PodSum

ALLOCATION_ROLLUP_AGGREGATES = ("namespace", "node", "cluster", "label")


@dataclass(frozen=True, slots=True)
class BillSummary:
    """A range's node bills, read at the grains of ``plan``."""

    plan: Plan
    bills_micro_usd: int
    node_windows: int
    pricing: tuple[NodePricingRow, ...]
    sharing_policies: tuple[tuple[str, int], ...]
    trued_windows: int


def bill_plan(ledger: Ledger, start_ms: int, end_ms: int, *, use_rollups: bool = True) -> Plan:
    """The segments the node bills of [start_ms, end_ms) are read from (``rollups.plan`` with the horizons
    retention recorded)."""
    return rollups.plan(start_ms, end_ms, rollups=use_rollups, kept_from=rollups.kept_from(ledger.read, ROLLUPS))


def bill_summary(ledger: Ledger, segments: tuple[Segment, ...], *, cluster: str | None, cost: str = "list",
                 trued: bool = False) -> tuple:
    """(micro-USD in the ``cost`` basis, node-windows, pricing rows, sharing policies, trued-up node-windows when
    ``trued``) of the node bills of ``segments``."""
    total = windows = trued_windows = 0
    pricing: dict[tuple, list[int]] = {}
    policies: dict[str, int] = {}
    if cost not in COST_BASES:
        raise ConfigError(f"cost basis {cost!r} is not one of {COST_BASES}")
    for segment in segments:
        a, b = segment.start_ms, segment.end_ms
        if segment.grain == MINUTE:
            micro, count = ledger.bill_totals(start_ms=a, end_ms=b, cluster=cluster, cost=cost)
            rows = [(r.cluster, r.node_name, r.instance_type, r.price_model, r.split_rule, r.price_version,
                     r.node_windows, r.node_cost_micro_usd, r.gpu_cost_micro_usd, r.node_other_micro_usd)
                    for r in ledger.node_pricing(start_ms=a, end_ms=b, cluster=cluster)]
            shared = ledger.sharing_policies(start_ms=a, end_ms=b, cluster=cluster)
            done = ledger.trued_coverage(start_ms=a, end_ms=b, cluster=cluster)[0] if trued else 0
        else:
            micro, count = read_rollups.bill_totals(ledger.read, READ_ROLLUPS, segment, cluster=cluster, cost=cost)
            rows = read_rollups.node_pricing(ledger.read, READ_ROLLUPS, segment, price_versions, cluster=cluster)
            shared = read_rollups.sharing_policies(ledger.read, READ_ROLLUPS, segment, cluster=cluster)
            done = read_rollups.trued_coverage(ledger.read, READ_ROLLUPS, segment, cluster=cluster)[0] if trued else 0
        total += micro
        windows += count
        trued_windows += done
        for row in rows:
            sums = pricing.setdefault(tuple(row[:6]), [0, 0, 0, 0])
            for i, value in enumerate(row[6:]):
                sums[i] += value
        for policy, count in shared:
            policies[policy] = policies.get(policy, 0) + count
    ordered = sorted(pricing.items(), key=lambda item: (item[0][0], item[0][1], item[0][5]))
    return total, windows, tuple(NodePricingRow(*key, *sums) for key, sums in ordered), \
        tuple(sorted(policies.items())), trued_windows


def summarize_bills(ledger: Ledger, plan: Plan, *, cluster: str | None, cost: str = "list",
                    trued: bool = False) -> BillSummary:
    """``bill_summary`` over ``plan``'s segments."""
    total, windows, pricing, policies, trued_windows = bill_summary(ledger, plan.segments, cluster=cluster,
                                                                    cost=cost, trued=trued)
    return BillSummary(plan, total, windows, pricing, policies, trued_windows)


# -- /allocation ------------------------------------------------------------------------------------------------


def allocation_segments(query: "AllocationQuery", *, use_rollups: bool) -> tuple[Segment, ...]:
    """[start, end) of ``query`` as segments whose every rollup period lies inside one step: each step split
    coarsest (``rollups.split``), adjacent segments of one grain merged. Pure."""
    out: list[Segment] = []
    for start, end in query.steps:
        for segment in rollups.split(start, end, rollups=use_rollups):
            if out and out[-1].grain == segment.grain and out[-1].end_ms == segment.start_ms:
                out[-1] = Segment(segment.grain, out[-1].start_ms, segment.end_ms)
            else:
                out.append(segment)
    return tuple(out)


def allocation_rollups_answer(query: "AllocationQuery") -> bool:
    """Whether the rollups can keep what ``query`` aggregates by (for a label: only if every pod rollup row read
    was keyed by that label, checked in ``plan_allocation``)."""
    return query.aggregate in ALLOCATION_ROLLUP_AGGREGATES


def _kept(ledger: Ledger) -> dict[str, int]:
    """The oldest period each grain of the pod allocations still holds."""
    kept = rollups.kept_from(ledger.read, ROLLUPS)
    pods_from = kept.get(read_rollups.POD_ROLLUPS_FROM)
    if pods_from is not None:
        for grain in (HOUR, DAY):
            kept[grain] = max(kept.get(grain, pods_from), pods_from)
    return kept


def _dropped(segments: tuple[Segment, ...], kept: dict[str, int]) -> Segment | None:
    return next((s for s in segments if s.start_ms < kept.get(s.grain, s.start_ms)), None)


def plan_allocation(ledger: Ledger, query: "AllocationQuery") -> tuple[Segment, ...]:
    """The segments ``query`` is summed from: the rollups' where they answer and are kept, else the minute lines;
    ``MinuteLinesDropped`` when retention dropped a part of the range at the grain that answers it."""
    kept = _kept(ledger)
    segments = ()
    if allocation_rollups_answer(query):
        segments = allocation_segments(query, use_rollups=True)
        if query.aggregate == "label" and any(
                read_rollups.other_pod_team_keys(ledger.read, READ_ROLLUPS, s, query.cluster, query.label_key)
                for s in segments if s.grain != MINUTE):
            segments = ()
        elif _dropped(segments, kept) is not None:
            segments = ()
    if not segments:
        segments = allocation_segments(query, use_rollups=False)
    gone = _dropped(segments, kept)
    if gone is not None:
        name = {MINUTE: "minute cost lines", HOUR: "hourly rollups", DAY: "daily rollups"}[gone.grain]
        raise MinuteLinesDropped(
            f"/allocation by {query.describe_aggregate()} reads {name} for windows from {iso_utc(gone.start_ms)}, "
            f"and retention kept them from {iso_utc(kept[gone.grain])} only: ask for a range from then (by "
            "namespace, node, cluster or the team label over whole hours or days the rollups answer, which are "
            "kept longer)")
    return segments


def describe_segments(segments: tuple[Segment, ...]) -> str:
    """``daily rollups (29 days), ...``: what each grain answered (``Plan.describe``)."""
    if not segments:
        return "nothing (empty range)"
    return Plan(segments[0].start_ms, segments[-1].end_ms, segments[0].start_ms, segments[-1].end_ms,
                segments).describe()


def allocation_sums(ledger: Ledger, query: "AllocationQuery"
                    ) -> tuple[list["PodSum"], list["BucketSum"], tuple[Segment, ...]]:
    """``Ledger.allocation_sums(query)`` from the coarsest grain that answers (``plan_allocation``), with the
    segments read."""
    from services.billing.allocation import BucketSum, PodSum

    segments = plan_allocation(ledger, query)
    pods: dict[tuple, list] = {}
    buckets: dict[tuple, list[int]] = {}
    hour = 3_600_000.0
    for segment in segments:
        if segment.grain == MINUTE:
            pod_rows, bucket_rows = ledger.allocation_sums(query, start_ms=segment.start_ms, end_ms=segment.end_ms)
            for p in pod_rows:
                rollups.add_into(pods, (p.step, p.group, p.shared_from, p.sharing_method, p.method, p.cost_basis),
                     (p.cost_micro_usd, p.lines, p.gpu_hours * hour, p.memory_gpu_hours * hour,
                      p.compute_gpu_hours * hour, p.unit_hours * hour))
            for b in bucket_rows:
                rollups.add_into(buckets, (b.step, b.node, b.kind, b.shared), (b.cost_micro_usd, b.lines))
            continue
        for row in read_rollups.pod_sums(ledger.read, READ_ROLLUPS, segment, aggregate=query.aggregate,
                                         start_ms=query.start_ms, step_ms=query.step_ms, cluster=query.cluster):
            rollups.add_into(pods, row[:6], row[6:])
        for row in _bucket_rows(ledger, query, segment):
            rollups.add_into(buckets, row[:4], row[4:])
    return ([PodSum(*key, int(v[0]), int(v[1]), v[2] / hour, v[3] / hour, v[4] / hour, v[5] / hour)
             for key, v in pods.items()],
            [BucketSum(*key, int(v[0]), int(v[1])) for key, v in buckets.items()], segments)


def _bucket_rows(ledger: Ledger, query: "AllocationQuery", segment: Segment) -> list[tuple]:
    """(step, node or None, kind, shared, micro-USD, lines) of a line rollup segment: the lines no pod carries
    (zero lines counted) and the IDLE shared to pods, as ``Ledger.allocation_sums``' buckets."""
    table = ROLLUPS.by_grain[segment.grain]
    t = table.c
    step = ((t.period_start_unix_ms - query.start_ms) // query.step_ms).label("step")
    kind = case((t.shared_from == "", t.subject_kind), else_=t.shared_from).label("kind")
    shared = (t.shared_from != "").label("shared")
    node = (t.node_name if query.idle_by_node else literal(None, String)).label("node")
    conditions = [t.period_start_unix_ms >= segment.start_ms, t.period_start_unix_ms < segment.end_ms,
                  (t.subject_kind != "POD") | (t.shared_from == "IDLE")]
    if query.cluster is not None:
        conditions.append(t.cluster == query.cluster)
    inner = select(step, node, kind, shared, t.cost_micro_usd, t.cost_lines).where(*conditions).subquery()
    keys = (inner.c.step, inner.c.node, inner.c.kind, inner.c.shared)
    rows = ledger.read(select(*keys, func.sum(inner.c.cost_micro_usd), func.sum(inner.c.cost_lines)).group_by(*keys))
    return [(int(st), node_name, kind_name, bool(is_shared), int(cost), int(lines))
            for st, node_name, kind_name, is_shared, cost, lines in rows]
