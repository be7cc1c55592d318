"""PostgreSQL: ``cost_lines`` without its foreign keys (to ``node_bills`` and ``label_sets``).

Every line is inserted by ``Ledger.write`` in the transaction that inserts its bill (a write refuses a line whose
bill is not in it, and inserts the lines of exactly the bills its insert created) and its label set first;
retention drops a day's lines before its bills, and never drops a label set. The keys checked that again, one
trigger call per line and key: on the bench's fleet (``bench/ledger_month.py``, A/B in one run) they were half the
time of inserting the lines. Without them a DETACH of a ``node_bills`` partition no longer locks ``cost_lines``.
SQLite keeps them (its ledger is small; dropping them there would rebuild its largest table).

Revision ID: 0013_lines_without_foreign_keys
Revises: 0012_bill_rollups
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0013_lines_without_foreign_keys"
down_revision = "0012_bill_rollups"
branch_labels = None
depends_on = None

_KEYS = (("fk_cost_lines_node_bills", "(window_start_unix_ms, cluster, node_name)",
          "node_bills (window_start_unix_ms, cluster, node_name)"),
         ("fk_cost_lines_label_sets", "(label_set_id)", "label_sets (label_set_id)"))


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for name, _columns, _referred in _KEYS:
        op.execute(f'ALTER TABLE cost_lines DROP CONSTRAINT IF EXISTS "{name}"')


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for name, columns, referred in _KEYS:
        op.execute(f'ALTER TABLE cost_lines ADD CONSTRAINT "{name}" FOREIGN KEY {columns} REFERENCES {referred}')
