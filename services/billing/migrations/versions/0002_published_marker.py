"""node_bills.published_at_unix_ms: when the window's cost records were acknowledged on the costs topic.

A bill written to the ledger but never published (the service died between the ledger commit and Kafka's
acknowledgement) has NULL here, so a redelivery publishes it then instead of skipping it.

Revision ID: 0002_published_marker
Revises: 0001_initial
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_published_marker"
down_revision = "0001_initial"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node_bills") as batch:
        batch.add_column(sa.Column("published_at_unix_ms", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("node_bills") as batch:
        batch.drop_column("published_at_unix_ms")
