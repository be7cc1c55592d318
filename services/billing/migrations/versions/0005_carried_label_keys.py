"""cost_lines.carried_label_keys: the label keys a pod line's labels were selected from.

The attributor carries only its grouping labels (GPUMETER_GROUPING_LABELS) on share rows; each POD cost line
keeps the sorted keys, comma-separated (label keys contain no comma), so a report grouped by a label that was not
carried says so instead of calling those pods unlabelled. Empty: every label carried, a bucket line, or a line
written before this revision.

Revision ID: 0005_carried_label_keys
Revises: 0004_publisher
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_carried_label_keys"
down_revision = "0004_publisher"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("cost_lines") as batch:
        batch.add_column(sa.Column("carried_label_keys", sa.Text(), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("cost_lines") as batch:
        batch.drop_column("carried_label_keys")
