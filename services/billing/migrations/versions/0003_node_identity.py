"""node_bills.zone and node_bills.provider_id: which machine of the cloud a node-window's bill is for.

The provider id (the Node's spec.providerID) is what a cloud's billing export names the machine by (the AWS
instance id is its last segment); the true-up to an invoice matches on it. Rows written before this revision
have empty values.

Revision ID: 0003_node_identity
Revises: 0002_published_marker
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_node_identity"
down_revision = "0002_published_marker"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node_bills") as batch:
        batch.add_column(sa.Column("zone", sa.String(64), nullable=False, server_default=""))
        batch.add_column(sa.Column("provider_id", sa.String(512), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("node_bills") as batch:
        batch.drop_column("provider_id")
        batch.drop_column("zone")
