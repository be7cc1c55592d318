"""PostgreSQL: ``cost_lines`` without its foreign keys and its primary key; a (window, cluster, node) index instead.

Every line is inserted by ``Ledger.write`` in the transaction that inserts its bill (a write refuses a line whose
bill is not in it, drops a repeated line, and inserts the lines of exactly the bills its insert created; a bill's
primary key makes a node-window's insert happen once), its label set first; retention drops a day's lines before
its bills and never drops a label set. The foreign keys checked that again, one trigger call per line and key, and
the 7-column primary key (137 of a line's 378 bytes with the key's text columns) made every line unique again. On
the bench's fleet (``bench/ledger_month.py``, A/B in one run) the keys' triggers were half of inserting the lines,
and a line with a plain index on its node-window instead of the primary key takes 248 bytes. ``apply_trueup`` finds
a line's row through that index (a node-window's few dozen lines). Without the foreign keys a DETACH of a
``node_bills`` partition no longer locks ``cost_lines``.

SQLite keeps both (its ledger is small, its lines table is ``WITHOUT ROWID`` -- the primary key *is* the table --
and dropping them would rebuild its largest table).

Revision ID: 0013_lean_lines
Revises: 0012_bill_rollups
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0013_lean_lines"
down_revision = "0012_bill_rollups"
branch_labels = None
depends_on = None

_KEYS = (("fk_cost_lines_node_bills", "(window_start_unix_ms, cluster, node_name)",
          "node_bills (window_start_unix_ms, cluster, node_name)"),
         ("fk_cost_lines_label_sets", "(label_set_id)", "label_sets (label_set_id)"))
_PRIMARY_KEY = ("pk_cost_lines",
                "(window_start_unix_ms, cluster, node_name, gpu_uuid, subject_kind, pod_uid, shared_from)")
_INDEX = ("ix_cost_lines_window_start_unix_ms_cluster_node_name", "(window_start_unix_ms, cluster, node_name)")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for name, _columns, _referred in _KEYS:
        op.execute(f'ALTER TABLE cost_lines DROP CONSTRAINT IF EXISTS "{name}"')
    op.execute(f'CREATE INDEX "{_INDEX[0]}" ON cost_lines {_INDEX[1]}')
    op.execute(f'ALTER TABLE cost_lines DROP CONSTRAINT "{_PRIMARY_KEY[0]}"')


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f'ALTER TABLE cost_lines ADD CONSTRAINT "{_PRIMARY_KEY[0]}" PRIMARY KEY {_PRIMARY_KEY[1]}')
    op.execute(f'DROP INDEX "{_INDEX[0]}"')
    for name, columns, referred in _KEYS:
        op.execute(f'ALTER TABLE cost_lines ADD CONSTRAINT "{name}" FOREIGN KEY {columns} REFERENCES {referred}')
