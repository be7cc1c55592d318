"""Trued-up cost beside the list-price cost: node_bills/cost_lines.trued_cost_micro_usd, node_bills.trueup_id, and
the trueups table (one row per bill `gpumeter reconcile` applied).

Additive only: the list-price columns are not touched; every new column is NULL until a bill is applied
(``services.billing.ledger.Ledger.apply_trueup``).

Revision ID: 0006_c2_trueup
Revises: 0005_carried_label_keys
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_c2_trueup"
down_revision = "0005_carried_label_keys"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node_bills") as batch:
        batch.add_column(sa.Column("trued_cost_micro_usd", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("trueup_id", sa.String(64), nullable=True))
    with op.batch_alter_table("cost_lines") as batch:
        batch.add_column(sa.Column("trued_cost_micro_usd", sa.BigInteger(), nullable=True))
    op.create_table(
        "trueups",
        sa.Column("trueup_id", sa.String(64), nullable=False),
        sa.Column("bill_name", sa.Text(), nullable=False),
        sa.Column("bill_format", sa.String(16), nullable=False),
        sa.Column("basis", sa.String(16), nullable=False),
        sa.Column("bill_scope", sa.Text(), nullable=False),
        sa.Column("scope_start_unix_ms", sa.BigInteger(), nullable=False),
        sa.Column("scope_end_unix_ms", sa.BigInteger(), nullable=False),
        sa.Column("applied_at_unix_ms", sa.BigInteger(), nullable=False),
        sa.Column("line_items", sa.Integer(), nullable=False),
        sa.Column("billed_micro_usd", sa.BigInteger(), nullable=False),
        sa.Column("trued_micro_usd", sa.BigInteger(), nullable=False),
        sa.Column("summary", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("trueup_id", name="pk_trueups"),
    )


def downgrade() -> None:
    op.drop_table("trueups")
    with op.batch_alter_table("cost_lines") as batch:
        batch.drop_column("trued_cost_micro_usd")
    # Not in batch mode: recreating node_bills would drop a table cost_lines' foreign key points at (SQLite has had
    # ALTER TABLE ... DROP COLUMN since 3.35).
    op.drop_column("node_bills", "trueup_id")
    op.drop_column("node_bills", "trued_cost_micro_usd")
