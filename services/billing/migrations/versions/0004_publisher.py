"""node_bills.publisher: the billing instance whose write inserted the node-window; only it publishes its costs.

Two billing instances with different consumer groups read every share and write every node-window; the ledger
keeps the first write, but both used to publish the window's cost records (the second saw the bill unpublished
while the first was still waiting for Kafka's acknowledgement). The ledger is the arbiter: the instance (consumer
group) named here publishes, the other only finds the bill there. NULL for bills written before this revision: the
first instance that finds one of them unpublished claims it (one conditional UPDATE, so only one does).

Revision ID: 0004_publisher
Revises: 0003_node_identity
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_publisher"
down_revision = "0003_node_identity"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node_bills") as batch:
        batch.add_column(sa.Column("publisher", sa.String(255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("node_bills") as batch:
        batch.drop_column("publisher")
