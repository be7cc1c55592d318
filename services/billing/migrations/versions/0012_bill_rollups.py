"""Bill and pod rollups: what month-long reports and ``/allocation`` read over whole hours and days.

* ``node_bills.zero_line_count``: how many zero lines the bill lists (``zero_lines``), filled now for every bill
  (decoded once here, so no reader decodes it to count).
* ``bill_rollup_hourly`` / ``bill_rollup_daily``: the node bills summed per period and (cluster, node, price
  version, instance type, price model, provider, region, zone, GPU model, sharing policy)
  (``services.billing.read_rollups``); **backfilled** now from every bill in the ledger (node bills are kept by
  0009's retention), trued-up sums included.
* ``pod_rollup_hourly`` / ``pod_rollup_daily``: the POD lines summed per period and (cluster, node, namespace, team
  label key and value, bucket shared, sharing method, attribution method, cost basis) with the GPU time
  ``/allocation`` reports; **backfilled** from the minute lines there are (team read under the migrating ledger's
  ``team_label``). Where retention had already dropped minute lines, the pod rollups cannot hold those periods: a
  ``ledger_retention`` row ``pod_rollups`` records from when they do, and ``/allocation`` refuses what is older.

On PostgreSQL (partitioned since 0010) the four tables are ``PARTITION BY RANGE (period_start_unix_ms)``, the
hourly ones by UTC day and the daily ones by UTC month (``services.billing.partitions``), and the partitions
covering the backfill are created first; retention drops them as it drops the line rollups'.

Revision ID: 0012_bill_rollups
Revises: 0010_partitions
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql

from services.billing import partitions
from services.billing.line_storage import decode_zero_lines
from services.billing.read_rollups import (
    BILL_DIMENSIONS,
    BILL_MEASURES,
    BILL_TABLE_NAMES,
    POD_DIMENSIONS,
    POD_MEASURES,
    POD_ROLLUPS_FROM,
    POD_TABLE_NAMES,
    bill_columns,
    pod_columns,
)
from services.billing.rollups import DAY, HOUR

revision = "0012_bill_rollups"
down_revision = "0010_partitions"
branch_labels = None
depends_on = None

# The tables this revision creates partitioned on PostgreSQL, as they are at this revision.
_SCHEMES = (
    partitions.Scheme("bill_rollup_hourly", "period_start_unix_ms", partitions.DAY),
    partitions.Scheme("bill_rollup_daily", "period_start_unix_ms", partitions.MONTH),
    partitions.Scheme("pod_rollup_hourly", "period_start_unix_ms", partitions.DAY),
    partitions.Scheme("pod_rollup_daily", "period_start_unix_ms", partitions.MONTH),
)
_HOUR_MS = 3_600_000
_DAY_MS = 86_400_000
_BATCH = 10_000


def _table(name: str, dimensions, measures):
    return sa.table(name, *(sa.column(n) for n in (*dimensions, *measures)))


def _fill_zero_line_counts(bills) -> None:
    """Decode each bill's zero lines once, a day of windows at a time (a fleet's month is millions of bills)."""
    b = bills.c
    connection = op.get_bind()
    first, last = connection.execute(sa.select(sa.func.min(b.window_start_unix_ms), sa.func.max(b.window_start_unix_ms))
                                      .where(b.zero_lines.is_not(None))).one()
    if first is None:
        return
    statement = (sa.update(bills)
                 .where(b.window_start_unix_ms == sa.bindparam("b_start"), b.cluster == sa.bindparam("b_cluster"),
                        b.node_name == sa.bindparam("b_node"))
                 .values(zero_line_count=sa.bindparam("b_count")))
    day = int(first) - int(first) % _DAY_MS
    while day <= int(last):
        counts = [{"b_start": start, "b_cluster": cluster, "b_node": node, "b_count": len(decode_zero_lines(text))}
                  for start, cluster, node, text in connection.execute(
                      sa.select(b.window_start_unix_ms, b.cluster, b.node_name, b.zero_lines)
                      .where(b.zero_lines.is_not(None), b.window_start_unix_ms >= day,
                             b.window_start_unix_ms < day + _DAY_MS)).all()]
        for i in range(0, len(counts), _BATCH):
            connection.execute(statement, counts[i:i + _BATCH])
        day += _DAY_MS


def _daily_from_hourly(names, dimensions, measures) -> None:
    source = _table(names[HOUR], dimensions, measures).c
    inner = sa.select((source.period_start_unix_ms - source.period_start_unix_ms % _DAY_MS)
                      .label("period_start_unix_ms"), *(source[n] for n in (*dimensions[1:], *measures))).subquery()
    keys = [inner.c[n] for n in dimensions]
    daily = sa.select(*keys, *(sa.func.sum(inner.c[n]) for n in measures)).group_by(*keys)
    op.execute(sa.insert(_table(names[DAY], dimensions, measures)).from_select([*dimensions, *measures], daily))


def _backfill_bills(bills) -> None:
    b = bills.c
    inner = sa.select(
        (b.window_start_unix_ms - b.window_start_unix_ms % _HOUR_MS).label("period_start_unix_ms"), b.cluster,
        b.node_name, b.price_version, b.instance_type, b.price_model, b.provider, b.region,
        sa.func.coalesce(b.zone, "").label("zone"), sa.func.coalesce(b.gpu_model, "").label("gpu_model"), b.sharing,
        b.billed_milliseconds, b.node_cost_micro_usd, b.gpu_cost_micro_usd, b.node_other_micro_usd,
        sa.func.coalesce(b.trued_cost_micro_usd, b.node_cost_micro_usd).label("billed"), b.trued_cost_micro_usd,
        b.zero_line_count).subquery()
    keys = [inner.c[n] for n in BILL_DIMENSIONS]
    hourly = sa.select(*keys, sa.func.count(), sa.func.sum(inner.c.billed_milliseconds),
                       sa.func.sum(inner.c.node_cost_micro_usd), sa.func.sum(inner.c.gpu_cost_micro_usd),
                       sa.func.sum(inner.c.node_other_micro_usd), sa.func.sum(inner.c.billed),
                       sa.func.count(inner.c.trued_cost_micro_usd), sa.func.sum(inner.c.zero_line_count)
                       ).group_by(*keys)
    op.execute(sa.insert(_table(BILL_TABLE_NAMES[HOUR], BILL_DIMENSIONS, BILL_MEASURES))
               .from_select([*BILL_DIMENSIONS, *BILL_MEASURES], hourly))
    _daily_from_hourly(BILL_TABLE_NAMES, BILL_DIMENSIONS, BILL_MEASURES)


def _backfill_pods(bills, team_key: str) -> None:
    labels_type = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
    lines = sa.table("cost_lines", *(sa.column(n) for n in (
        "window_start_unix_ms", "cluster", "node_name", "namespace", "label_set_id", "subject_kind", "shared_from",
        "sharing_method", "method", "cost_basis", "cost_micro_usd", "cost_share", "memory_share", "compute_share",
        "gpu_fraction")))
    label_sets = sa.table("label_sets", sa.column("label_set_id"), sa.column("labels", labels_type))
    c, l, b = lines.c, label_sets.c, bills.c
    team = l.labels[team_key].as_string()
    billed_ms = b.billed_milliseconds
    inner = (
        sa.select((c.window_start_unix_ms - c.window_start_unix_ms % _HOUR_MS).label("period_start_unix_ms"),
                  c.cluster, c.node_name, sa.func.coalesce(c.namespace, "").label("namespace"),
                  sa.literal(team_key).label("team_key"), sa.func.coalesce(team, "").label("team"),
                  sa.case((team.is_(None), sa.false()), else_=sa.true()).label("has_team"),
                  c.shared_from, c.sharing_method, c.method, c.cost_basis, c.cost_micro_usd,
                  (c.cost_share * c.gpu_fraction * billed_ms).label("gpu_ms"),
                  (c.memory_share * c.gpu_fraction * billed_ms).label("memory_ms"),
                  (c.compute_share * c.gpu_fraction * billed_ms).label("compute_ms"),
                  (c.gpu_fraction * billed_ms).label("unit_ms"))
        .select_from(lines.join(label_sets, l.label_set_id == c.label_set_id)
                     .join(bills, (b.window_start_unix_ms == c.window_start_unix_ms) & (b.cluster == c.cluster)
                           & (b.node_name == c.node_name)))
        .where(c.subject_kind == "POD")
        .subquery()
    )
    keys = [inner.c[n] for n in POD_DIMENSIONS]
    hourly = sa.select(*keys, sa.func.sum(inner.c.cost_micro_usd), sa.func.count(), sa.func.sum(inner.c.gpu_ms),
                       sa.func.sum(inner.c.memory_ms), sa.func.sum(inner.c.compute_ms),
                       sa.func.sum(inner.c.unit_ms)).group_by(*keys)
    op.execute(sa.insert(_table(POD_TABLE_NAMES[HOUR], POD_DIMENSIONS, POD_MEASURES))
               .from_select([*POD_DIMENSIONS, *POD_MEASURES], hourly))
    _daily_from_hourly(POD_TABLE_NAMES, POD_DIMENSIONS, POD_MEASURES)
    retention = sa.table("ledger_retention", sa.column("grain"), sa.column("kept_from_unix_ms"),
                         sa.column("applied_at_unix_ms"))
    dropped = op.get_bind().execute(
        sa.select(retention.c.kept_from_unix_ms, retention.c.applied_at_unix_ms)
        .where(retention.c.grain == "minute")).first()
    if dropped is not None:
        op.execute(sa.insert(retention).values(grain=POD_ROLLUPS_FROM, kept_from_unix_ms=dropped[0],
                                               applied_at_unix_ms=dropped[1]))


def upgrade() -> None:
    op.add_column("node_bills", sa.Column("zero_line_count", sa.Integer(), nullable=False, server_default="0"))
    bills = sa.table("node_bills", *(sa.column(n) for n in (
        "window_start_unix_ms", "cluster", "node_name", "price_version", "instance_type", "price_model", "provider",
        "region", "zone", "gpu_model", "sharing", "billed_milliseconds", "node_cost_micro_usd", "gpu_cost_micro_usd",
        "node_other_micro_usd", "trued_cost_micro_usd", "zero_lines", "zero_line_count")))
    _fill_zero_line_counts(bills)
    connection = op.get_bind()
    split = partitions.partitioned(connection)
    by = {"postgresql_partition_by": "RANGE (period_start_unix_ms)"} if split else {}
    for names, columns, dimensions in ((BILL_TABLE_NAMES, bill_columns, BILL_DIMENSIONS),
                                       (POD_TABLE_NAMES, pod_columns, POD_DIMENSIONS)):
        for name in names.values():
            op.create_table(name, *columns(), sa.PrimaryKeyConstraint(*dimensions, name=f"pk_{name}"), **by)
    if split:
        b = bills.c
        low, high = connection.execute(sa.select(sa.func.min(b.window_start_unix_ms),
                                                 sa.func.max(b.window_start_unix_ms))).one()
        if low is not None:
            partitions.ensure_in(connection, [part for scheme in _SCHEMES
                                              for part in partitions.covering(scheme, int(low), int(high) + 1)])
    _backfill_bills(bills)
    _backfill_pods(bills, context.config.attributes.get("team_label") or "team")


def downgrade() -> None:
    op.execute(sa.text(f"DELETE FROM ledger_retention WHERE grain = '{POD_ROLLUPS_FROM}'"))
    for names in (POD_TABLE_NAMES, BILL_TABLE_NAMES):
        for name in names.values():
            op.drop_table(name)
    # Not in batch mode: recreating node_bills would drop a table cost_lines' foreign key points at.
    op.drop_column("node_bills", "zero_line_count")
