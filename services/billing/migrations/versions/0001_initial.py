"""Initial ledger: price_versions, node_bills, cost_lines.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "price_versions",
        sa.Column("price_version", sa.String(255), nullable=False),
        sa.Column("provider", sa.String(64), nullable=False),
        sa.Column("region", sa.String(64), nullable=False),
        sa.Column("instance_type", sa.String(128), nullable=False),
        sa.Column("price_model", sa.String(16), nullable=False),
        sa.Column("price_per_hour_usd", sa.String(40), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("gpu_price_per_hour_usd", sa.String(40), nullable=False),
        sa.Column("node_other_price_per_hour_usd", sa.String(40), nullable=False),
        sa.Column("split_rule", sa.String(16), nullable=False),
        sa.Column("derivation", sa.Text(), nullable=False),
        sa.Column("sources", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("price_version", name="pk_price_versions"),
    )
    op.create_table(
        "node_bills",
        sa.Column("window_start_unix_ms", sa.BigInteger(), nullable=False),
        sa.Column("cluster", sa.String(253), nullable=False),
        sa.Column("node_name", sa.String(253), nullable=False),
        sa.Column("window_seconds", sa.Integer(), nullable=False),
        sa.Column("billed_milliseconds", sa.BigInteger(), nullable=False),
        sa.Column("provider", sa.String(64), nullable=False),
        sa.Column("region", sa.String(64), nullable=False),
        sa.Column("instance_type", sa.String(128), nullable=False),
        sa.Column("price_model", sa.String(16), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("node_cost_micro_usd", sa.BigInteger(), nullable=False),
        sa.Column("gpu_cost_micro_usd", sa.BigInteger(), nullable=False),
        sa.Column("node_other_micro_usd", sa.BigInteger(), nullable=False),
        sa.Column("price_version", sa.String(255), nullable=False),
        sa.PrimaryKeyConstraint("window_start_unix_ms", "cluster", "node_name", name="pk_node_bills"),
        sa.ForeignKeyConstraint(["price_version"], ["price_versions.price_version"],
                                name="fk_node_bills_price_versions"),
    )
    op.create_index("ix_node_bills_node_name_window_start_unix_ms", "node_bills",
                    ["node_name", "window_start_unix_ms"])
    op.create_table(
        "cost_lines",
        sa.Column("window_start_unix_ms", sa.BigInteger(), nullable=False),
        sa.Column("cluster", sa.String(253), nullable=False),
        sa.Column("node_name", sa.String(253), nullable=False),
        sa.Column("gpu_uuid", sa.String(128), nullable=False),
        sa.Column("subject_kind", sa.String(16), nullable=False),
        sa.Column("pod_uid", sa.String(128), nullable=False),
        sa.Column("window_seconds", sa.Integer(), nullable=False),
        sa.Column("namespace", sa.String(253), nullable=True),
        sa.Column("pod_name", sa.String(253), nullable=True),
        sa.Column("labels", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=False),
        sa.Column("cost_share", sa.Double(), nullable=False),
        sa.Column("cost_micro_usd", sa.BigInteger(), nullable=False),
        sa.Column("instance_type", sa.String(128), nullable=False),
        sa.Column("price_model", sa.String(16), nullable=False),
        sa.Column("price_version", sa.String(255), nullable=False),
        sa.PrimaryKeyConstraint("window_start_unix_ms", "cluster", "node_name", "gpu_uuid", "subject_kind",
                                "pod_uid", name="pk_cost_lines"),
        sa.ForeignKeyConstraint(
            ["window_start_unix_ms", "cluster", "node_name"],
            ["node_bills.window_start_unix_ms", "node_bills.cluster", "node_bills.node_name"],
            name="fk_cost_lines_node_bills",
        ),
    )
    op.create_index("ix_cost_lines_namespace_window_start_unix_ms", "cost_lines",
                    ["namespace", "window_start_unix_ms"])


def downgrade() -> None:
    op.drop_index("ix_cost_lines_namespace_window_start_unix_ms", table_name="cost_lines")
    op.drop_table("cost_lines")
    op.drop_index("ix_node_bills_node_name_window_start_unix_ms", table_name="node_bills")
    op.drop_table("node_bills")
    op.drop_table("price_versions")
