"""PostgreSQL: a node-window's cost lines as one row of arrays (``cost_line_packs``), the view ``cost_lines`` over it.

At 0014/0015 a line is a ``cost_line_rows`` row: 116.5 bytes a line after ``VACUUM FULL`` with its index entry,
much of it per-row overhead (tuple header, line pointer, index entry). Now a node-window's lines are one
``cost_line_packs`` row, (window start, node id) its primary key, one array per line column
(``services.billing.line_packs``); ``cost_lines`` stays a view with 0013's columns, names, types and values.

The upgrade creates ``cost_line_packs`` partitioned by day as ``cost_line_rows`` was (a partition for each of its
partitions, the same bounds; plain where it was not), copies the lines partition by partition (``INSERT ... SELECT
... array_agg(... ORDER BY gpu_id, kind_id, pod_id) GROUP BY window, node``, set-based; a window none of whose lines
is trued up gets a NULL ``trued_cost_micro_usd``), checks that every line was moved, drops ``cost_line_rows`` and
creates the view. The downgrade unpacks them back into 0014's ``cost_line_rows`` (partitioned likewise, its index)
and 0014's view. The dictionaries (0014) and the bills' zero lines are untouched.

The SQL is frozen here (``VIEW_SELECT`` is ``line_packs.VIEW_SELECT`` at this revision; a unit test compares them).

SQLite: nothing changes (its ``cost_lines`` table stays).

Revision ID: 0016_line_packs
Revises: 0015_focus_hourly
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

revision = "0016_line_packs"
down_revision = "0015_focus_hourly"
branch_labels = None
depends_on = None

# (array column, element type) in the row's order.
_ARRAYS = (("label_set_id", "bigint"), ("cost_micro_usd", "bigint"), ("trued_cost_micro_usd", "bigint"),
           ("cost_share", "double precision"), ("memory_share", "double precision"),
           ("compute_share", "double precision"), ("gpu_fraction", "double precision"), ("gpu_id", "integer"),
           ("pod_id", "integer"), ("kind_id", "smallint"))
_NAMES = ", ".join(name for name, _type in _ARRAYS)
_PACKS = ("CREATE TABLE cost_line_packs (window_start_unix_ms bigint NOT NULL, node_id integer NOT NULL, "
          + ", ".join(f"{name} {sql}[]" + ("" if name == "trued_cost_micro_usd" else " NOT NULL")
                      for name, sql in _ARRAYS)
          + ", CONSTRAINT pk_cost_line_packs PRIMARY KEY (window_start_unix_ms, node_id))")
# The lines of a pack in (gpu id, kind id, pod id) order: unique in a node-window (the line's key).
_ORDER = "ORDER BY gpu_id, kind_id, pod_id"
_PACK_SELECT = (
    "SELECT window_start_unix_ms, node_id, "
    + ", ".join(f"CASE WHEN count(trued_cost_micro_usd) = 0 THEN NULL ELSE array_agg({name} {_ORDER}) END"
                if name == "trued_cost_micro_usd" else f"array_agg({name} {_ORDER})" for name, _type in _ARRAYS)
    + ' FROM "{source}" GROUP BY window_start_unix_ms, node_id ORDER BY window_start_unix_ms, node_id')

VIEW_SELECT = (
    "SELECT p.window_start_unix_ms, n.cluster, n.node_name, g.gpu_uuid, k.subject_kind, d.pod_uid, "
    "k.window_seconds, "
    "CAST(CASE WHEN d.absent & 1 = 0 THEN d.namespace END AS varchar(253)) AS namespace, "
    "CAST(CASE WHEN d.absent & 2 = 0 THEN d.pod_name END AS varchar(253)) AS pod_name, "
    "u.label_set_id, u.cost_share, u.cost_micro_usd, u.trued_cost_micro_usd, "
    "k.shared_from, k.sharing_method, k.method, k.cost_basis, u.memory_share, u.compute_share, u.gpu_fraction "
    "FROM cost_line_packs p "
    f"CROSS JOIN LATERAL unnest({', '.join(f'p.{name}' for name, _type in _ARRAYS)}) AS u ({_NAMES}) "
    "JOIN ledger_nodes n ON n.node_id = p.node_id "
    "JOIN ledger_gpus g ON g.gpu_id = u.gpu_id "
    "JOIN ledger_pods d ON d.pod_id = u.pod_id "
    "JOIN ledger_line_kinds k ON k.kind_id = u.kind_id"
)

# 0014's rows, index and view, for the downgrade.
_ROWS = ("CREATE TABLE cost_line_rows (window_start_unix_ms bigint NOT NULL, label_set_id bigint NOT NULL, "
         "cost_micro_usd bigint NOT NULL, trued_cost_micro_usd bigint, cost_share double precision NOT NULL, "
         "memory_share double precision NOT NULL, compute_share double precision NOT NULL, "
         "gpu_fraction double precision NOT NULL, node_id integer NOT NULL, gpu_id integer NOT NULL, "
         "pod_id integer NOT NULL, kind_id smallint NOT NULL)")
_ROWS_INDEX = ("CREATE INDEX ix_cost_line_rows_window_start_unix_ms_node_id "
               "ON cost_line_rows (window_start_unix_ms, node_id)")
_ROWS_COLUMNS = ("window_start_unix_ms, label_set_id, cost_micro_usd, trued_cost_micro_usd, cost_share, "
                 "memory_share, compute_share, gpu_fraction, node_id, gpu_id, pod_id, kind_id")
_UNPACK_SELECT = (
    "SELECT p.window_start_unix_ms, u.label_set_id, u.cost_micro_usd, u.trued_cost_micro_usd, u.cost_share, "
    "u.memory_share, u.compute_share, u.gpu_fraction, p.node_id, u.gpu_id, u.pod_id, u.kind_id "
    f'FROM "{{source}}" p CROSS JOIN LATERAL unnest({", ".join(f"p.{name}" for name, _type in _ARRAYS)}) '
    f"AS u ({_NAMES}) ORDER BY p.window_start_unix_ms, p.node_id")
_VIEW_0014 = (
    "SELECT l.window_start_unix_ms, n.cluster, n.node_name, g.gpu_uuid, k.subject_kind, p.pod_uid, "
    "k.window_seconds, "
    "CAST(CASE WHEN p.absent & 1 = 0 THEN p.namespace END AS varchar(253)) AS namespace, "
    "CAST(CASE WHEN p.absent & 2 = 0 THEN p.pod_name END AS varchar(253)) AS pod_name, "
    "l.label_set_id, l.cost_share, l.cost_micro_usd, l.trued_cost_micro_usd, "
    "k.shared_from, k.sharing_method, k.method, k.cost_basis, l.memory_share, l.compute_share, l.gpu_fraction "
    "FROM cost_line_rows l "
    "JOIN ledger_nodes n ON n.node_id = l.node_id "
    "JOIN ledger_gpus g ON g.gpu_id = l.gpu_id "
    "JOIN ledger_pods p ON p.pod_id = l.pod_id "
    "JOIN ledger_line_kinds k ON k.kind_id = l.kind_id"
)


def _partitions(connection, table: str) -> list[tuple[str, str]] | None:
    """(partition name, bound clause) of each partition of ``table``; None when it is not partitioned."""
    if not connection.execute(text(
            "SELECT count(*) FROM pg_partitioned_table WHERE partrelid = CAST(:t AS regclass)"), {"t": table}).scalar():
        return None
    return [tuple(row) for row in connection.execute(text(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i JOIN pg_class c "
        "ON c.oid = i.inhrelid WHERE i.inhparent = CAST(:t AS regclass) ORDER BY c.relname"), {"t": table})]


def _create_like(connection, create: str, table: str, parts: list[tuple[str, str]] | None, source: str) -> list[str]:
    """``create`` (``table``'s DDL), partitioned by window start as ``source`` was, with a partition per one of
    ``parts`` (renamed from ``source``'s names to ``table``'s); returns ``source``'s tables to copy from, one per
    partition (or ``source`` itself when it is not partitioned)."""
    if parts is None:
        connection.execute(text(create))
        return [source]
    connection.execute(text(f"{create} PARTITION BY RANGE (window_start_unix_ms)"))
    for name, bound in parts:
        child = table + name[len(source):]
        connection.execute(text(f'CREATE TABLE "{child}" (LIKE "{table}" INCLUDING DEFAULTS INCLUDING CONSTRAINTS)'))
        connection.execute(text(f'ALTER TABLE "{table}" ATTACH PARTITION "{child}" {bound}'))
    return [name for name, _bound in parts]


def upgrade() -> None:
    connection = op.get_bind()
    if connection.dialect.name != "postgresql":
        return
    parts = _partitions(connection, "cost_line_rows")
    sources = _create_like(connection, _PACKS, "cost_line_packs", parts, "cost_line_rows")
    for source in sources:
        connection.execute(text(f"INSERT INTO cost_line_packs (window_start_unix_ms, node_id, {_NAMES}) "
                                + _PACK_SELECT.format(source=source)))
    moved = connection.execute(text(
        "SELECT coalesce(sum(cardinality(cost_micro_usd)), 0) FROM cost_line_packs")).scalar()
    before = connection.execute(text("SELECT count(*) FROM cost_line_rows")).scalar()
    if moved != before:
        raise RuntimeError(f"0016 packed {moved} of {before} cost lines")
    connection.execute(text("DROP VIEW cost_lines"))
    connection.execute(text("DROP TABLE cost_line_rows"))
    connection.execute(text(f"CREATE VIEW cost_lines AS {VIEW_SELECT}"))
    connection.execute(text("ANALYZE cost_line_packs"))


def downgrade() -> None:
    connection = op.get_bind()
    if connection.dialect.name != "postgresql":
        return
    parts = _partitions(connection, "cost_line_packs")
    sources = _create_like(connection, _ROWS, "cost_line_rows", parts, "cost_line_packs")
    connection.execute(text(_ROWS_INDEX))
    for source in sources:
        connection.execute(text(f"INSERT INTO cost_line_rows ({_ROWS_COLUMNS}) "
                                + _UNPACK_SELECT.format(source=source)))
    moved = connection.execute(text("SELECT count(*) FROM cost_line_rows")).scalar()
    before = connection.execute(text(
        "SELECT coalesce(sum(cardinality(cost_micro_usd)), 0) FROM cost_line_packs")).scalar()
    if moved != before:
        raise RuntimeError(f"0016's downgrade unpacked {moved} of {before} cost lines")
    connection.execute(text("DROP VIEW cost_lines"))
    connection.execute(text("DROP TABLE cost_line_packs"))
    connection.execute(text(f"CREATE VIEW cost_lines AS {_VIEW_0014}"))
    connection.execute(text("ANALYZE cost_line_rows"))
