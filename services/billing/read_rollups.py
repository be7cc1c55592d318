"""Hourly and daily rollups of the node bills and of the pods' lines: what a report's pricing, totals and sharing
policies and ``/allocation``'s pod allocations read over whole hours and days, instead of millions of minute rows.

**Bill rollups** (``bill_rollup_hourly`` / ``bill_rollup_daily``): one row per (period, cluster, node, price version,
instance type, price model, provider, region, zone, GPU model, sharing policy) -- everything ``node_pricing``,
``bill_totals``, ``sharing_policies`` and ``trued_coverage`` group by -- summing the node bills whose window *starts*
in the period: ``node_windows`` (how many), ``billed_milliseconds``, ``node_cost_micro_usd``, ``gpu_cost_micro_usd``,
``node_other_micro_usd`` (list price, never changed), ``billed_micro_usd`` (``COALESCE(trued, list)``: what ``--cost
trued`` reads), ``trued_windows`` (bills with a trued-up cost) and ``zero_lines`` (the zero lines the bills list:
``node_bills.zero_line_count``). Exact integers.

**Pod rollups** (``pod_rollup_hourly`` / ``pod_rollup_daily``): one row per (period, cluster, node, namespace, team
label key and value, bucket shared, sharing method, attribution method, cost basis) summing the POD lines of the
node-windows starting in the period: ``cost_micro_usd`` (list), ``cost_lines``, and the GPU time ``/allocation``
reports, in milliseconds (floats: ``/allocation`` shows hours to 1e-9): ``gpu_ms`` (cost share × GPU fraction ×
the bill's billed milliseconds), ``memory_ms`` and ``compute_ms`` (memory / compute share × GPU fraction × billed
ms) and ``unit_ms`` (GPU fraction × billed ms). The buckets' side of ``/allocation`` is in the line rollups
(``services.billing.rollups``: subject kind, bucket shared, node, list cost, lines with zero lines counted).

**Maintained as bills land**, exactly as the line rollups: ``Ledger.write`` calls ``add_written`` in its transaction
with exactly the bills its insert created and their lines (a redelivery adds nothing, a failed write nothing);
``apply_trueup`` calls ``add_trued`` with every bill whose trued-up cost it changed (the pods' rollups hold list
cost only and do not move). Upserts in key order (``INSERT ... ON CONFLICT DO UPDATE SET x = x + excluded.x``).

Retention drops them with the line rollups of the same grain (``services.billing.retention``); the grain plan is
``rollups.plan``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Double,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    case,
    func,
    select,
)
from sqlalchemy.engine import Connection

from schemas.records import CostRecord, CostSubjectKind
from services.billing.bulk_rows import add_sums
from services.billing.costing import NodeBill, NodeWindowKey
from services.billing.rollups import DAY, HOUR, KIND_TEXT, ROLLUP_GRAINS, Segment, add_into, period_start

BILL_DIMENSIONS = ("period_start_unix_ms", "cluster", "node_name", "price_version", "instance_type", "price_model",
                   "provider", "region", "zone", "gpu_model", "sharing")
BILL_MEASURES = ("node_windows", "billed_milliseconds", "node_cost_micro_usd", "gpu_cost_micro_usd",
                 "node_other_micro_usd", "billed_micro_usd", "trued_windows", "zero_lines")
POD_DIMENSIONS = ("period_start_unix_ms", "cluster", "node_name", "namespace", "team_key", "team", "has_team",
                  "shared_from", "sharing_method", "method", "cost_basis")
POD_MEASURES = ("cost_micro_usd", "cost_lines", "gpu_ms", "memory_ms", "compute_ms", "unit_ms")
BILL_TABLE_NAMES = {HOUR: "bill_rollup_hourly", DAY: "bill_rollup_daily"}
POD_TABLE_NAMES = {HOUR: "pod_rollup_hourly", DAY: "pod_rollup_daily"}
# A ``ledger_retention`` row: the oldest period the pod rollups hold (migration 0012 could only sum the minute lines
# retention had kept); absent: they hold every period.
POD_ROLLUPS_FROM = "pod_rollups"


def bill_columns() -> list[Column]:
    """The bill rollup's columns (migration 0012 creates them from the same list)."""
    return [
        Column("period_start_unix_ms", BigInteger, nullable=False),
        Column("cluster", String(253), nullable=False),
        Column("node_name", String(253), nullable=False),
        Column("price_version", String(255), nullable=False),
        Column("instance_type", String(128), nullable=False),
        Column("price_model", String(16), nullable=False),
        Column("provider", String(64), nullable=False),
        Column("region", String(64), nullable=False),
        Column("zone", String(64), nullable=False),
        Column("gpu_model", String(128), nullable=False),
        Column("sharing", String(255), nullable=False),
        *(Column(name, BigInteger, nullable=False) for name in BILL_MEASURES),
    ]


def pod_columns() -> list[Column]:
    """The pod rollup's columns (migration 0012 creates them from the same list)."""
    return [
        Column("period_start_unix_ms", BigInteger, nullable=False),
        Column("cluster", String(253), nullable=False),
        Column("node_name", String(253), nullable=False),
        Column("namespace", String(253), nullable=False),
        Column("team_key", String(317), nullable=False),
        Column("team", Text, nullable=False),
        Column("has_team", Boolean, nullable=False),
        Column("shared_from", String(16), nullable=False),
        Column("sharing_method", String(16), nullable=False),
        Column("method", String(32), nullable=False),
        Column("cost_basis", String(32), nullable=False),
        Column("cost_micro_usd", BigInteger, nullable=False),
        Column("cost_lines", BigInteger, nullable=False),
        *(Column(name, Double, nullable=False) for name in ("gpu_ms", "memory_ms", "compute_ms", "unit_ms")),
    ]


@dataclass(frozen=True)
class ReadRollupTables:
    """The tables of ``define_tables``, by grain."""

    bills: Mapping[str, Table]
    pods: Mapping[str, Table]


def define_tables(metadata: MetaData) -> ReadRollupTables:
    """Add the bill and pod rollup tables (created by migration 0012) to the ledger's ``metadata``."""
    bills = {grain: Table(BILL_TABLE_NAMES[grain], metadata, *bill_columns(), PrimaryKeyConstraint(*BILL_DIMENSIONS))
             for grain in ROLLUP_GRAINS}
    pods = {grain: Table(POD_TABLE_NAMES[grain], metadata, *pod_columns(), PrimaryKeyConstraint(*POD_DIMENSIONS))
            for grain in ROLLUP_GRAINS}
    return ReadRollupTables(bills, pods)


# -- pure: rows --------------------------------------------------------------------------------------------------


def bill_key(bill: Mapping[str, Any], grain: str) -> tuple:
    """The bill rollup key (``BILL_DIMENSIONS`` order) of a bill's columns (a ``node_bills`` row or ``_bill_row``)."""
    return (period_start(int(bill["window_start_unix_ms"]), grain), bill["cluster"], bill["node_name"],
            bill["price_version"], bill["instance_type"], bill["price_model"], bill["provider"], bill["region"],
            bill["zone"] or "", bill["gpu_model"] or "", bill["sharing"])


def written_bill_rows(bills: Iterable[Mapping[str, Any]]) -> dict[str, dict[tuple, list[int]]]:
    """Per grain, what newly written bills (column dicts with ``zero_line_count``; not trued up) add. Pure."""
    out: dict[str, dict[tuple, list[int]]] = {grain: {} for grain in ROLLUP_GRAINS}
    for bill in bills:
        cost = int(bill["node_cost_micro_usd"])
        values = (1, int(bill["billed_milliseconds"]), cost, int(bill["gpu_cost_micro_usd"]),
                  int(bill["node_other_micro_usd"]), cost, 0, int(bill["zero_line_count"]))
        for grain in ROLLUP_GRAINS:
            add_into(out[grain], bill_key(bill, grain), values)
    return out


@dataclass(frozen=True, slots=True)
class BillTruedChange:
    """A bill (its columns) whose trued-up cost ``apply_trueup`` changes from ``before`` to ``after`` (None: none)."""

    bill: Mapping[str, Any]
    before: int | None
    after: int | None


def trued_bill_rows(changes: Iterable[BillTruedChange]) -> dict[str, dict[tuple, list[int]]]:
    """Per grain, what the changes move: the difference of ``COALESCE(trued, list)`` and of the trued count. Pure."""
    out: dict[str, dict[tuple, list[int]]] = {grain: {} for grain in ROLLUP_GRAINS}
    for change in changes:
        listed = int(change.bill["node_cost_micro_usd"])
        billed = ((listed if change.after is None else change.after)
                  - (listed if change.before is None else change.before))
        trued = (change.after is not None) - (change.before is not None)
        if not billed and not trued:
            continue
        for grain in ROLLUP_GRAINS:
            add_into(out[grain], bill_key(change.bill, grain), (0, 0, 0, 0, 0, billed, trued, 0))
    return {grain: {k: v for k, v in rows.items() if any(v)} for grain, rows in out.items()}


def pod_key(cost: CostRecord, grain: str, *, team_key: str) -> tuple:
    """The pod rollup key (``POD_DIMENSIONS`` order) of a POD line."""
    team = cost.labels.get(team_key)
    return (period_start(cost.window_start_unix_ms, grain), cost.cluster, cost.node_name, cost.namespace or "",
            team_key, team or "", team is not None, KIND_TEXT[cost.shared_from],
            cost.sharing_method, cost.method, cost.cost_basis)


def written_pod_rows(costs: Iterable[CostRecord], bills: Mapping[NodeWindowKey, NodeBill], *,
                     team_key: str) -> dict[str, dict[tuple, list]]:
    """Per grain, what the POD lines of newly written node-windows add (the GPU time in milliseconds with the
    bill's billed milliseconds, as ``Ledger.allocation_sums`` computes it per line). Pure."""
    out: dict[str, dict[tuple, list]] = {grain: {} for grain in ROLLUP_GRAINS}
    for cost in costs:
        if cost.subject_kind is not CostSubjectKind.POD:
            continue
        billed_ms = bills[NodeWindowKey(cost.cluster, cost.node_name, cost.window_start_unix_ms)].billed_milliseconds
        values = (cost.cost_micro_usd, 1, cost.cost_share * cost.gpu_fraction * billed_ms,
                  cost.memory_share * cost.gpu_fraction * billed_ms, cost.compute_share * cost.gpu_fraction * billed_ms,
                  cost.gpu_fraction * billed_ms)
        for grain in ROLLUP_GRAINS:
            add_into(out[grain], pod_key(cost, grain, team_key=team_key), values)
    return out


# -- SQL: maintaining --------------------------------------------------------------------------------------------


def _upsert(connection: Connection, tables: Mapping[str, Table], dimensions: tuple[str, ...],
            measures: tuple[str, ...], rows: Mapping[str, Mapping[tuple, list]]) -> int:
    return sum(add_sums(connection, tables[grain], dimensions, measures,
                        [(*key, *values) for key, values in grain_rows.items()])
               for grain, grain_rows in rows.items() if grain_rows)


def add_written(connection: Connection, tables: ReadRollupTables, bill_rows: Iterable[Mapping[str, Any]],
                costs: Iterable[CostRecord], bills: Mapping[NodeWindowKey, NodeBill], *, team_key: str) -> int:
    """``Ledger.write``'s hook: roll up the bills its insert created (``bill_rows``: their ``node_bills`` columns)
    and their POD lines."""
    return (_upsert(connection, tables.bills, BILL_DIMENSIONS, BILL_MEASURES, written_bill_rows(bill_rows))
            + _upsert(connection, tables.pods, POD_DIMENSIONS, POD_MEASURES,
                      written_pod_rows(costs, bills, team_key=team_key)))


def add_trued(connection: Connection, tables: ReadRollupTables, changes: Iterable[BillTruedChange]) -> int:
    """``Ledger.apply_trueup``'s hook: move the bill rollups' trued-up sums by the bills' changes."""
    return _upsert(connection, tables.bills, BILL_DIMENSIONS, BILL_MEASURES, trued_bill_rows(changes))


# -- SQL: reading ------------------------------------------------------------------------------------------------


def _range(table: Table, segment: Segment, cluster: str | None) -> list:
    conditions = [table.c.period_start_unix_ms >= segment.start_ms, table.c.period_start_unix_ms < segment.end_ms]
    if cluster is not None:
        conditions.append(table.c.cluster == cluster)
    return conditions


def bill_totals(read: Callable[[Any], list], tables: ReadRollupTables, segment: Segment, *, cluster: str | None,
                cost: str) -> tuple[int, int]:
    """(micro-dollars, node-windows) of a segment's bills, as ``Ledger.bill_totals``."""
    table = tables.bills[segment.grain]
    micro = table.c.node_cost_micro_usd if cost == "list" else table.c.billed_micro_usd
    (total, count), = read(select(func.coalesce(func.sum(micro), 0), func.coalesce(func.sum(table.c.node_windows), 0))
                           .where(*_range(table, segment, cluster)))
    return int(total), int(count)


def trued_coverage(read: Callable[[Any], list], tables: ReadRollupTables, segment: Segment, *,
                   cluster: str | None) -> tuple[int, int]:
    """(node-windows trued up, node-windows), as ``Ledger.trued_coverage``."""
    table = tables.bills[segment.grain]
    (trued, count), = read(select(func.coalesce(func.sum(table.c.trued_windows), 0),
                                  func.coalesce(func.sum(table.c.node_windows), 0))
                           .where(*_range(table, segment, cluster)))
    return int(trued), int(count)


def sharing_policies(read: Callable[[Any], list], tables: ReadRollupTables, segment: Segment, *,
                     cluster: str | None) -> list[tuple[str, int]]:
    """(sharing policy, node-windows), as ``Ledger.sharing_policies``."""
    table = tables.bills[segment.grain]
    rows = read(select(table.c.sharing, func.sum(table.c.node_windows)).where(*_range(table, segment, cluster))
                .group_by(table.c.sharing))
    return [(sharing, int(count)) for sharing, count in rows]


def node_pricing(read: Callable[[Any], list], tables: ReadRollupTables, segment: Segment, price_versions: Table, *,
                 cluster: str | None) -> list[tuple]:
    """(cluster, node, instance type, price model, split rule, price version, node-windows, node, GPU and
    node_other micro-USD), as ``Ledger.node_pricing``."""
    t, p = tables.bills[segment.grain], price_versions
    keys = (t.c.cluster, t.c.node_name, t.c.instance_type, t.c.price_model, p.c.split_rule, t.c.price_version)
    rows = read(select(*keys, func.sum(t.c.node_windows), func.sum(t.c.node_cost_micro_usd),
                       func.sum(t.c.gpu_cost_micro_usd), func.sum(t.c.node_other_micro_usd))
                .join(p, p.c.price_version == t.c.price_version).where(*_range(t, segment, cluster))
                .group_by(*keys))
    return [(*row[:6], *(int(v) for v in row[6:])) for row in rows]


def pod_group_expression(table: Table, aggregate: str):
    """The pod rollup's value for an ``/allocation`` aggregate (namespace, node, cluster, label)."""
    if aggregate == "namespace":
        return func.nullif(table.c.namespace, "")
    if aggregate in ("node", "cluster"):
        return table.c.node_name if aggregate == "node" else table.c.cluster
    if aggregate == "label":
        return case((table.c.has_team, table.c.team), else_=None)
    raise ValueError(f"the pod rollups cannot aggregate by {aggregate!r}")


def pod_sums(read: Callable[[Any], list], tables: ReadRollupTables, segment: Segment, *, aggregate: str,
             start_ms: int, step_ms: int, cluster: str | None) -> list[tuple]:
    """(step, group, shared from, sharing method, method, cost basis, micro-USD, lines, gpu ms, memory ms, compute
    ms, unit ms) of a segment's pod rollup rows, as ``Ledger.allocation_sums``' pod part; every period of the
    segment lies in one step (``read_plan.allocation_segments``)."""
    table = tables.pods[segment.grain]
    inner = (select(((table.c.period_start_unix_ms - start_ms) // step_ms).label("step"),
                    pod_group_expression(table, aggregate).label("grp"), table.c.shared_from,
                    table.c.sharing_method, table.c.method, table.c.cost_basis, table.c.cost_micro_usd,
                    table.c.cost_lines, table.c.gpu_ms, table.c.memory_ms, table.c.compute_ms, table.c.unit_ms)
             .where(*_range(table, segment, cluster)).subquery())
    keys = (inner.c.step, inner.c.grp, inner.c.shared_from, inner.c.sharing_method, inner.c.method,
            inner.c.cost_basis)
    rows = read(select(*keys, func.sum(inner.c.cost_micro_usd), func.sum(inner.c.cost_lines),
                       func.sum(inner.c.gpu_ms), func.sum(inner.c.memory_ms), func.sum(inner.c.compute_ms),
                       func.sum(inner.c.unit_ms)).group_by(*keys))
    return [(int(st), grp, sf, sm, m, cb, int(cost), int(lines), float(g or 0), float(mem or 0), float(comp or 0),
             float(unit or 0)) for st, grp, sf, sm, m, cb, cost, lines, g, mem, comp, unit in rows]


def other_pod_team_keys(read: Callable[[Any], list], tables: ReadRollupTables, segment: Segment,
                        cluster: str | None, team_key: str) -> int:
    """Pod rollup rows of ``segment`` keyed by another team label than ``team_key``."""
    table = tables.pods[segment.grain]
    (count,), = read(select(func.count()).where(table.c.team_key != team_key, *_range(table, segment, cluster)))
    return int(count)


def bill_rows_of(read: Callable[[Any], list], table: Table) -> dict[tuple, tuple]:
    """A bill or pod rollup table's rows, key -> measures (tests and checks)."""
    dimensions = BILL_DIMENSIONS if table.name in BILL_TABLE_NAMES.values() else POD_DIMENSIONS
    measures = BILL_MEASURES if table.name in BILL_TABLE_NAMES.values() else POD_MEASURES
    out = {}
    for row in read(select(table)):
        m = row._mapping
        out[tuple(bool(m[n]) if n == "has_team" else m[n] for n in dimensions)] = tuple(m[n] for n in measures)
    return out


def roll_rows(rows: Mapping[tuple, tuple], grain: str) -> dict[tuple, list]:
    """Rollup rows (key first column: the period) summed into the periods of ``grain``. Pure."""
    out: dict[tuple, list] = {}
    for key, values in rows.items():
        add_into(out, (period_start(key[0], grain), *key[1:]), values)
    return dict(out)
