"""Declarative time partitions on PostgreSQL: ``node_bills``, ``cost_lines`` and the rollups.

On PostgreSQL each of ``node_bills`` and ``cost_lines`` (by ``window_start_unix_ms``), ``cost_rollup_hourly`` and
``cost_rollup_daily`` (by ``period_start_unix_ms``) becomes ``PARTITION BY RANGE`` of that column, one partition
per UTC day (the daily rollups: per UTC month), as ``services.billing.partitions`` names and creates them. An
existing ledger's rows move: per table, the old table is renamed aside (its primary key and indexes with it), the
partitioned table is created with the same columns, defaults and NOT NULLs (``LIKE``), the same primary key (its
leading column is the time column, as partitioning requires) and the same secondary indexes, the partitions that
cover the old rows are created, the rows are copied (``INSERT ... SELECT``), the foreign keys are added again
(``cost_lines`` -> ``node_bills``, ``label_sets``; ``node_bills`` -> ``price_versions``) and the old tables are
dropped -- all in the migration's one transaction. Partitions ahead of today are created by billing at start and
by every write that needs one (``Ledger.write``), not here: a migration has no clock.

SQLite: nothing changes (no partitions; its retention deletes ranges).

Downgrade (PostgreSQL): the same moves back into plain tables.

Revision ID: 0010_partitions
Revises: 0009_rollups
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from services.billing import partitions

revision = "0010_partitions"
down_revision = "0009_rollups"
branch_labels = None
depends_on = None


def _definitions(connection, tables: tuple[str, ...]) -> tuple[dict, dict, list]:
    """Per table: its primary key (name, definition) and its other indexes' definitions; and every foreign key
    (table, name, definition) that belongs to or points at one of ``tables``."""
    primary, indexes, foreign = {}, {}, []
    for table in tables:
        name, definition = connection.execute(text(
            "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = CAST(:t AS regclass) AND contype = 'p'"), {"t": table}).one()
        primary[table] = (name, definition)
        indexes[table] = [tuple(row) for row in connection.execute(text(
            "SELECT i.relname, pg_get_indexdef(i.oid) FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
            "WHERE x.indrelid = CAST(:t AS regclass) AND NOT x.indisprimary ORDER BY i.relname"), {"t": table})]
    for owner, name, definition in connection.execute(text(
            "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE contype = 'f' AND conparentid = 0 "
            "AND (conrelid = ANY(CAST(:ts AS regclass[])) OR confrelid = ANY(CAST(:ts AS regclass[]))) "
            "ORDER BY 1, 2"), {"ts": list(tables)}):
        foreign.append((owner, name, definition))
    return primary, indexes, foreign


# The tables this revision partitions, as they are at this revision (``partitions.SCHEMES`` may change later).
_SCHEMES = (
    partitions.Scheme("node_bills", "window_start_unix_ms", partitions.DAY),
    partitions.Scheme("cost_lines", "window_start_unix_ms", partitions.DAY),
    partitions.Scheme("cost_rollup_hourly", "period_start_unix_ms", partitions.DAY),
    partitions.Scheme("cost_rollup_daily", "period_start_unix_ms", partitions.MONTH),
)


def _rebuild(*, partition: bool) -> None:
    """Move every table of ``_SCHEMES`` into a new table of the same definition, partitioned or not."""
    connection = op.get_bind()
    if connection.dialect.name != "postgresql":
        return
    tables = tuple(scheme.table for scheme in _SCHEMES)
    aside = {table: f"{table}_{'0009' if partition else '0010'}" for table in tables}
    primary, indexes, foreign = _definitions(connection, tables)
    for owner, name, _definition in foreign:
        connection.execute(text(f'ALTER TABLE "{owner}" DROP CONSTRAINT "{name}"'))
    for table in tables:
        connection.execute(text(f'ALTER TABLE "{table}" RENAME TO "{aside[table]}"'))
        pk_name, _ = primary[table]
        connection.execute(text(f'ALTER TABLE "{aside[table]}" RENAME CONSTRAINT "{pk_name}" TO "{pk_name}_old"'))
        for index, _definition in indexes[table]:
            connection.execute(text(f'ALTER INDEX "{index}" RENAME TO "{index}_old"'))
    for scheme in _SCHEMES:
        table, old = scheme.table, aside[scheme.table]
        by = f" PARTITION BY RANGE ({scheme.column})" if partition else ""
        connection.execute(text(f'CREATE TABLE "{table}" (LIKE "{old}" INCLUDING DEFAULTS INCLUDING CONSTRAINTS)'
                                f"{by}"))
        pk_name, pk_definition = primary[table]
        connection.execute(text(f'ALTER TABLE "{table}" ADD CONSTRAINT "{pk_name}" {pk_definition}'))
        for _index, definition in indexes[table]:
            connection.execute(text(definition))
        if partition:
            low, high = connection.execute(text(f'SELECT min({scheme.column}), max({scheme.column}) FROM "{old}"')
                                           ).one()
            if low is not None:
                partitions.ensure_in(connection, partitions.covering(scheme, int(low), int(high) + 1))
        connection.execute(text(f'INSERT INTO "{table}" SELECT * FROM "{old}"'))
    for owner, name, definition in foreign:
        connection.execute(text(f'ALTER TABLE "{owner}" ADD CONSTRAINT "{name}" {definition}'))
    # Lines before bills: the old lines' foreign key named the old bills.
    for table in reversed(tables):
        connection.execute(text(f'DROP TABLE "{aside[table]}"'))
    for table in tables:
        connection.execute(text(f'ANALYZE "{table}"'))


def upgrade() -> None:
    _rebuild(partition=True)


def downgrade() -> None:
    _rebuild(partition=False)
