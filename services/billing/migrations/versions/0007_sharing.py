"""Sharing: a pod's cost splits into direct lines and shared lines, and each unit line keeps how it was attributed.

cost_lines:

* ``shared_from`` (part of the primary key; '' for a direct line): the bucket of the node-window (IDLE,
  DRIVER_RESERVED, UNATTRIBUTED, UNAVAILABLE, NODE_OTHER) whose cost a pod's shared line carries under billing's
  sharing policy. A pod has at most one shared line per bucket kind and node-window, beside its direct lines.
* ``sharing_method``: weighted, even or requests for a shared line; '' otherwise.
* ``method``, ``cost_basis``, ``memory_share``, ``compute_share``, ``gpu_fraction``: the unit's attribution
  method and cost basis and the subject's shares, as the share row said (what the FOCUS export's allocation
  details and the allocation API report); '' and 0 for node-level lines and lines written before this revision.

node_bills.sharing: the sharing policy the node-window's lines were shared by (``keep``: none); 'keep' for bills
written before this revision, which kept every bucket.

Revision ID: 0007_sharing
Revises: 0006_c2_trueup
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_sharing"
down_revision = "0006_c2_trueup"
branch_labels = None
depends_on = None

_OLD_KEY = ["window_start_unix_ms", "cluster", "node_name", "gpu_uuid", "subject_kind", "pod_uid"]


def upgrade() -> None:
    # SQLite cannot alter a primary key: batch mode copies the table ("recreate"); PostgreSQL alters it in place.
    with op.batch_alter_table("cost_lines", recreate="auto") as batch:
        batch.add_column(sa.Column("shared_from", sa.String(16), nullable=False, server_default=""))
        batch.add_column(sa.Column("sharing_method", sa.String(16), nullable=False, server_default=""))
        batch.add_column(sa.Column("method", sa.String(32), nullable=False, server_default=""))
        batch.add_column(sa.Column("cost_basis", sa.String(32), nullable=False, server_default=""))
        batch.add_column(sa.Column("memory_share", sa.Double(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("compute_share", sa.Double(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("gpu_fraction", sa.Double(), nullable=False, server_default="0"))
        batch.drop_constraint("pk_cost_lines", type_="primary")
        batch.create_primary_key("pk_cost_lines", [*_OLD_KEY, "shared_from"])
    with op.batch_alter_table("node_bills") as batch:
        batch.add_column(sa.Column("sharing", sa.String(255), nullable=False, server_default="keep"))


def downgrade() -> None:
    # Shared lines have no place in the old key, and dropping them would leave node-windows that no longer add up
    # to their bills: a ledger that shared anything cannot go back.
    shared = op.get_bind().execute(sa.text("SELECT count(*) FROM cost_lines WHERE shared_from <> ''")).scalar()
    if shared:
        raise RuntimeError(f"the ledger holds {shared} shared cost lines; revision 0006 cannot represent them")
    # Not in batch mode: recreating node_bills would drop a table cost_lines' foreign key points at (SQLite has had
    # ALTER TABLE ... DROP COLUMN since 3.35).
    op.drop_column("node_bills", "sharing")
    with op.batch_alter_table("cost_lines", recreate="auto") as batch:
        batch.drop_constraint("pk_cost_lines", type_="primary")
        batch.create_primary_key("pk_cost_lines", _OLD_KEY)
        for name in ("gpu_fraction", "compute_share", "memory_share", "cost_basis", "method", "sharing_method",
                     "shared_from"):
            batch.drop_column(name)
