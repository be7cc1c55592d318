"""The hourly FOCUS grain: ``focus_charge_hourly`` (each node's origin charge per UTC hour) and ``focus_line_hourly``
(its per-pod, per-GPU line sums), from which ``gpumeter export focus --grain hour`` builds its rows
(``services.billing.focus_rollups``).

**Backfilled** now from the node bills and minute lines in the ledger, a UTC day of windows at a time: the stored
lines summed by SQL (``cost_lines`` as revision 0013 has it, with their bills), the zero lines decoded from their
bills (``node_bills.zero_lines``) and added in Python, so the rows equal what ``Ledger.write`` keeps from here on.
Where retention had already dropped minute lines, a ``ledger_retention`` row ``focus_rollups`` records the minute
horizon: the hourly FOCUS grain holds nothing older.

The columns are frozen here (as they are at this revision), not read from the service code. On PostgreSQL
(partitioned since 0010) both tables are ``PARTITION BY RANGE (period_start_unix_ms)`` by UTC day, and the
partitions covering the backfill are created first; retention drops them with the hourly rollups.

Revision ID: 0015_focus_hourly
Revises: 0014_line_ids
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from services.billing import partitions
from services.billing.line_storage import decode_zero_lines

revision = "0015_focus_hourly"
down_revision = "0014_line_ids"
branch_labels = None
depends_on = None

_CHARGE_TABLE = "focus_charge_hourly"
_LINE_TABLE = "focus_line_hourly"
_LINK = ("period_start_unix_ms", "cluster", "node_name", "provider_id", "zone", "price_version", "sharing",
         "window_seconds")
_CHARGE_DIMENSIONS = (*_LINK, "provider", "region", "instance_type", "price_model")
_CHARGE_MEASURES = ("node_windows", "billed_milliseconds", "node_cost_micro_usd", "billed_micro_usd",
                    "trued_windows")
_LINE_DIMENSIONS = (*_LINK, "subject_kind", "pod_uid", "gpu_uuid", "shared_from", "sharing_method", "method",
                    "cost_basis", "namespace", "pod_name", "label_set_id")
_LINE_MEASURES = ("cost_micro_usd", "billed_micro_usd", "cost_lines", "trued_lines", "billed_ms", "cost_share_ms",
                  "memory_share_ms", "compute_share_ms", "gpu_ms")
_SCHEMES = (partitions.Scheme(_CHARGE_TABLE, "period_start_unix_ms", partitions.DAY),
            partitions.Scheme(_LINE_TABLE, "period_start_unix_ms", partitions.DAY))
_RETENTION_ROW = "focus_rollups"
_HOUR_MS = 3_600_000
_DAY_MS = 86_400_000
_BATCH = 10_000


def _link_columns() -> list[sa.Column]:
    return [
        sa.Column("period_start_unix_ms", sa.BigInteger(), nullable=False),
        sa.Column("cluster", sa.String(253), nullable=False),
        sa.Column("node_name", sa.String(253), nullable=False),
        sa.Column("provider_id", sa.String(512), nullable=False),
        sa.Column("zone", sa.String(64), nullable=False),
        sa.Column("price_version", sa.String(255), nullable=False),
        sa.Column("sharing", sa.String(255), nullable=False),
        sa.Column("window_seconds", sa.Integer(), nullable=False),
    ]


def _charge_columns() -> list[sa.Column]:
    return [*_link_columns(),
            sa.Column("provider", sa.String(64), nullable=False),
            sa.Column("region", sa.String(64), nullable=False),
            sa.Column("instance_type", sa.String(128), nullable=False),
            sa.Column("price_model", sa.String(16), nullable=False),
            *(sa.Column(name, sa.BigInteger(), nullable=False) for name in _CHARGE_MEASURES)]


def _line_columns() -> list[sa.Column]:
    return [*_link_columns(),
            sa.Column("subject_kind", sa.String(16), nullable=False),
            sa.Column("pod_uid", sa.String(128), nullable=False),
            sa.Column("gpu_uuid", sa.String(128), nullable=False),
            sa.Column("shared_from", sa.String(16), nullable=False),
            sa.Column("sharing_method", sa.String(16), nullable=False),
            sa.Column("method", sa.String(32), nullable=False),
            sa.Column("cost_basis", sa.String(32), nullable=False),
            sa.Column("namespace", sa.String(253), nullable=False),
            sa.Column("pod_name", sa.String(253), nullable=False),
            sa.Column("label_set_id", sa.BigInteger(), nullable=False),
            *(sa.Column(name, sa.BigInteger(), nullable=False) for name in _LINE_MEASURES[:5]),
            *(sa.Column(name, sa.Double(), nullable=False) for name in _LINE_MEASURES[5:])]


_BILL_COLUMNS = ("window_start_unix_ms", "cluster", "node_name", "provider_id", "zone", "price_version", "sharing",
                 "window_seconds", "provider", "region", "instance_type", "price_model", "billed_milliseconds",
                 "node_cost_micro_usd", "trued_cost_micro_usd", "zero_lines")
_LINE_COLUMNS = ("window_start_unix_ms", "cluster", "node_name", "gpu_uuid", "subject_kind", "pod_uid", "namespace",
                 "pod_name", "label_set_id", "cost_share", "cost_micro_usd", "trued_cost_micro_usd", "shared_from",
                 "sharing_method", "method", "cost_basis", "memory_share", "compute_share", "gpu_fraction")


def _add(out: dict, key: tuple, values) -> None:
    sums = out.get(key)
    if sums is None:
        out[key] = list(values)
    else:
        for i, value in enumerate(values):
            sums[i] += value


def _link(start: int, bill) -> tuple:
    return (start - start % _HOUR_MS, bill["cluster"], bill["node_name"], bill["provider_id"] or "",
            bill["zone"] or "", bill["price_version"], bill["sharing"], int(bill["window_seconds"]))


def _backfill_day(connection, bills, lines, day: int, gpu_uuids: dict[int, str]) -> None:
    b, c = bills.c, lines.c
    charges: dict[tuple, list] = {}
    line_rows: dict[tuple, list] = {}
    for row in connection.execute(sa.select(*(b[n] for n in _BILL_COLUMNS))
                                  .where(b.window_start_unix_ms >= day, b.window_start_unix_ms < day + _DAY_MS)):
        m = row._mapping
        start = int(m["window_start_unix_ms"])
        link = _link(start, m)
        listed = int(m["node_cost_micro_usd"])
        trued = m["trued_cost_micro_usd"]
        billed_ms = int(m["billed_milliseconds"])
        _add(charges, (*link, m["provider"], m["region"], m["instance_type"], m["price_model"]),
             (1, billed_ms, listed, listed if trued is None else int(trued), int(trued is not None)))
        # A zero line: a bucket's, no cost, no share, no pod or labels; trued (0) where its window is trued up.
        for gpu, kind, method, basis, _fraction in decode_zero_lines(m["zero_lines"], gpu_uuids):
            _add(line_rows, (*link, kind, "", gpu, "", "", method, basis, "", "", 0),
                 (0, 0, 1, int(trued is not None), billed_ms, 0.0, 0.0, 0.0, 0.0))
    if not charges:
        return
    billed_ms = b.billed_milliseconds
    inner = (
        sa.select((c.window_start_unix_ms - c.window_start_unix_ms % _HOUR_MS).label("period_start_unix_ms"),
                  c.cluster, c.node_name, b.provider_id, b.zone, b.price_version, b.sharing, b.window_seconds,
                  c.subject_kind, c.pod_uid, c.gpu_uuid, c.shared_from, c.sharing_method, c.method, c.cost_basis,
                  sa.func.coalesce(c.namespace, "").label("namespace"),
                  sa.func.coalesce(c.pod_name, "").label("pod_name"), c.label_set_id,
                  c.cost_micro_usd, sa.func.coalesce(c.trued_cost_micro_usd, c.cost_micro_usd).label("billed"),
                  c.trued_cost_micro_usd, billed_ms.label("billed_ms"),
                  (c.cost_share * billed_ms).label("cost_share_ms"),
                  (c.memory_share * billed_ms).label("memory_share_ms"),
                  (c.compute_share * billed_ms).label("compute_share_ms"),
                  (c.cost_share * billed_ms * c.gpu_fraction).label("gpu_ms"))
        .select_from(lines.join(bills, (b.window_start_unix_ms == c.window_start_unix_ms) & (b.cluster == c.cluster)
                                & (b.node_name == c.node_name)))
        .where(c.window_start_unix_ms >= day, c.window_start_unix_ms < day + _DAY_MS)
        .subquery())
    keys = [inner.c[n] for n in _LINE_DIMENSIONS]
    for row in connection.execute(
            sa.select(*keys, sa.func.sum(inner.c.cost_micro_usd), sa.func.sum(inner.c.billed), sa.func.count(),
                      sa.func.count(inner.c.trued_cost_micro_usd), sa.func.sum(inner.c.billed_ms),
                      sa.func.sum(inner.c.cost_share_ms), sa.func.sum(inner.c.memory_share_ms),
                      sa.func.sum(inner.c.compute_share_ms), sa.func.sum(inner.c.gpu_ms)).group_by(*keys)):
        key, values = tuple(row[:len(_LINE_DIMENSIONS)]), row[len(_LINE_DIMENSIONS):]
        _add(line_rows, (*key[:-1], int(key[-1])),
             (*(int(v) for v in values[:5]), *(float(v or 0) for v in values[5:])))
    for name, dimensions, measures, rows in (
            (_CHARGE_TABLE, _CHARGE_DIMENSIONS, _CHARGE_MEASURES, charges),
            (_LINE_TABLE, _LINE_DIMENSIONS, _LINE_MEASURES, line_rows)):
        table = sa.table(name, *(sa.column(n) for n in (*dimensions, *measures)))
        dicts = [dict(zip((*dimensions, *measures), (*key, *values))) for key, values in sorted(rows.items())]
        for i in range(0, len(dicts), _BATCH):
            connection.execute(sa.insert(table), dicts[i:i + _BATCH])


def upgrade() -> None:
    connection = op.get_bind()
    split = partitions.partitioned(connection)
    by = {"postgresql_partition_by": "RANGE (period_start_unix_ms)"} if split else {}
    op.create_table(_CHARGE_TABLE, *_charge_columns(),
                    sa.PrimaryKeyConstraint(*_CHARGE_DIMENSIONS, name=f"pk_{_CHARGE_TABLE}"), **by)
    op.create_table(_LINE_TABLE, *_line_columns(),
                    sa.PrimaryKeyConstraint(*_LINE_DIMENSIONS, name=f"pk_{_LINE_TABLE}"), **by)
    bills = sa.table("node_bills", *(sa.column(n) for n in _BILL_COLUMNS))
    lines = sa.table("cost_lines", *(sa.column(n) for n in _LINE_COLUMNS))
    low, high = connection.execute(sa.select(sa.func.min(bills.c.window_start_unix_ms),
                                             sa.func.max(bills.c.window_start_unix_ms))).one()
    if low is not None:
        if split:
            partitions.ensure_in(connection, [part for scheme in _SCHEMES
                                              for part in partitions.covering(scheme, int(low), int(high) + 1)])
        # From 0014 a PostgreSQL bill's zero lines name their GPUs by id (``ledger_gpus``): give them their uuids.
        gpu_uuids: dict[int, str] = {}
        if sa.inspect(connection).has_table("ledger_gpus"):
            gpu_uuids = dict(connection.execute(sa.text("SELECT gpu_id, gpu_uuid FROM ledger_gpus")).all())
        day = int(low) - int(low) % _DAY_MS
        while day <= int(high):
            _backfill_day(connection, bills, lines, day, gpu_uuids)
            day += _DAY_MS
    retention = sa.table("ledger_retention", sa.column("grain"), sa.column("kept_from_unix_ms"),
                         sa.column("applied_at_unix_ms"))
    dropped = connection.execute(sa.select(retention.c.kept_from_unix_ms, retention.c.applied_at_unix_ms)
                                 .where(retention.c.grain == "minute")).first()
    if dropped is not None:
        op.execute(sa.insert(retention).values(grain=_RETENTION_ROW, kept_from_unix_ms=dropped[0],
                                               applied_at_unix_ms=dropped[1]))


def downgrade() -> None:
    op.execute(sa.text(f"DELETE FROM ledger_retention WHERE grain = '{_RETENTION_ROW}'"))
    op.drop_table(_LINE_TABLE)
    op.drop_table(_CHARGE_TABLE)
