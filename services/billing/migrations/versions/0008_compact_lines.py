"""What a cost line stores: zero lines folded into their bill, labels stored once, prices read from the bill.

* ``node_bills.zero_lines`` (TEXT, NULL: none): the node-window's zero lines -- lines with no cost and no share
  (``services.billing.line_storage.is_zero_line``) -- as compact JSON, one entry per unit; they are no longer
  ``cost_lines`` rows. Readers get them back as they were.
* ``label_sets`` (``label_set_id`` BIGINT primary key, ``labels`` JSON/JSONB, ``carried_label_keys`` TEXT): each
  distinct (labels, carried label keys) once; the id is content-addressed (``line_storage.label_set_id``), 0 the
  empty set. ``cost_lines.label_set_id`` (BIGINT, foreign key) replaces ``cost_lines.labels`` and
  ``cost_lines.carried_label_keys``.
* ``cost_lines.instance_type``, ``price_model`` and ``price_version`` are dropped: every line has its bill's
  (``node_bills``, which references ``price_versions``); the upgrade refuses a ledger where one does not.
* On SQLite ``cost_lines`` becomes a ``WITHOUT ROWID`` table (its rows in the primary key's B-tree, the key
  stored once).

The upgrade copies ``cost_lines`` into its new shape (``INSERT ... SELECT``, set-based on both databases) and
fills ``zero_lines`` from the lines it leaves out: a line is left out when it is a zero line and its trued-up cost
is what a zero line's reads as (NULL in a window not trued up, 0 in one that is). The downgrade puts every line
back as a row.

Revision ID: 0008_compact_lines
Revises: 0007_sharing
Create Date: 2026-12-03
"""

from __future__ import annotations

import json
from collections import defaultdict

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from services.billing.line_storage import decode_zero_lines, encode_zero_lines, label_set_id

revision = "0008_compact_lines"
down_revision = "0007_sharing"
branch_labels = None
depends_on = None

_KEY = ["window_start_unix_ms", "cluster", "node_name", "gpu_uuid", "subject_kind", "pod_uid", "shared_from"]
_BILL_KEY = ["window_start_unix_ms", "cluster", "node_name"]
_LABELS = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_NAMESPACE_INDEX = "ix_cost_lines_namespace_window_start_unix_ms"
# Columns both shapes of cost_lines have, in this order.
_COMMON = ["window_start_unix_ms", "cluster", "node_name", "gpu_uuid", "subject_kind", "pod_uid", "window_seconds",
           "namespace", "pod_name", "cost_share", "cost_micro_usd", "trued_cost_micro_usd", "shared_from",
           "sharing_method", "method", "cost_basis", "memory_share", "compute_share", "gpu_fraction"]
_ZERO_LINE = (
    "o.subject_kind <> 'POD' AND o.pod_uid = '' AND o.shared_from = '' AND o.sharing_method = '' "
    "AND o.cost_micro_usd = 0 AND o.cost_share = 0 AND o.memory_share = 0 AND o.compute_share = 0 "
    "AND o.namespace IS NULL AND o.pod_name IS NULL AND o.carried_label_keys = '' AND m.label_set_id = 0 "
    "AND o.window_seconds = b.window_seconds "
    "AND ((o.trued_cost_micro_usd IS NULL AND b.trued_cost_micro_usd IS NULL) "
    "OR (o.trued_cost_micro_usd = 0 AND b.trued_cost_micro_usd IS NOT NULL))"
)
_JOIN_BILL = " AND ".join(f"b.{c} = o.{c}" for c in _BILL_KEY)


def _new_cost_lines(name: str) -> None:
    op.create_table(
        name,
        sa.Column("window_start_unix_ms", sa.BigInteger(), nullable=False),
        sa.Column("cluster", sa.String(253), nullable=False),
        sa.Column("node_name", sa.String(253), nullable=False),
        sa.Column("gpu_uuid", sa.String(128), nullable=False),
        sa.Column("subject_kind", sa.String(16), nullable=False),
        sa.Column("pod_uid", sa.String(128), nullable=False),
        sa.Column("window_seconds", sa.Integer(), nullable=False),
        sa.Column("namespace", sa.String(253), nullable=True),
        sa.Column("pod_name", sa.String(253), nullable=True),
        sa.Column("label_set_id", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("cost_share", sa.Double(), nullable=False),
        sa.Column("cost_micro_usd", sa.BigInteger(), nullable=False),
        sa.Column("trued_cost_micro_usd", sa.BigInteger(), nullable=True),
        sa.Column("shared_from", sa.String(16), nullable=False, server_default=""),
        sa.Column("sharing_method", sa.String(16), nullable=False, server_default=""),
        sa.Column("method", sa.String(32), nullable=False, server_default=""),
        sa.Column("cost_basis", sa.String(32), nullable=False, server_default=""),
        sa.Column("memory_share", sa.Double(), nullable=False, server_default="0"),
        sa.Column("compute_share", sa.Double(), nullable=False, server_default="0"),
        sa.Column("gpu_fraction", sa.Double(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint(*_KEY, name="pk_cost_lines"),
        sa.ForeignKeyConstraint(_BILL_KEY, [f"node_bills.{c}" for c in _BILL_KEY], name="fk_cost_lines_node_bills"),
        sa.ForeignKeyConstraint(["label_set_id"], ["label_sets.label_set_id"], name="fk_cost_lines_label_sets"),
        sqlite_with_rowid=False,
    )


def _old_cost_lines(name: str) -> None:
    op.create_table(
        name,
        sa.Column("window_start_unix_ms", sa.BigInteger(), nullable=False),
        sa.Column("cluster", sa.String(253), nullable=False),
        sa.Column("node_name", sa.String(253), nullable=False),
        sa.Column("gpu_uuid", sa.String(128), nullable=False),
        sa.Column("subject_kind", sa.String(16), nullable=False),
        sa.Column("pod_uid", sa.String(128), nullable=False),
        sa.Column("window_seconds", sa.Integer(), nullable=False),
        sa.Column("namespace", sa.String(253), nullable=True),
        sa.Column("pod_name", sa.String(253), nullable=True),
        sa.Column("labels", _LABELS, nullable=False),
        sa.Column("cost_share", sa.Double(), nullable=False),
        sa.Column("cost_micro_usd", sa.BigInteger(), nullable=False),
        sa.Column("instance_type", sa.String(128), nullable=False),
        sa.Column("price_model", sa.String(16), nullable=False),
        sa.Column("price_version", sa.String(255), nullable=False),
        sa.Column("carried_label_keys", sa.Text(), nullable=False, server_default=""),
        sa.Column("trued_cost_micro_usd", sa.BigInteger(), nullable=True),
        sa.Column("shared_from", sa.String(16), nullable=False, server_default=""),
        sa.Column("sharing_method", sa.String(16), nullable=False, server_default=""),
        sa.Column("method", sa.String(32), nullable=False, server_default=""),
        sa.Column("cost_basis", sa.String(32), nullable=False, server_default=""),
        sa.Column("memory_share", sa.Double(), nullable=False, server_default="0"),
        sa.Column("compute_share", sa.Double(), nullable=False, server_default="0"),
        sa.Column("gpu_fraction", sa.Double(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint(*_KEY, name="pk_cost_lines"),
        sa.ForeignKeyConstraint(_BILL_KEY, [f"node_bills.{c}" for c in _BILL_KEY], name="fk_cost_lines_node_bills"),
    )


def _set_aside(name: str) -> None:
    """Rename cost_lines to ``name``, its index dropped and (PostgreSQL: names are per schema) its key renamed."""
    op.drop_index(_NAMESPACE_INDEX, table_name="cost_lines")
    op.rename_table("cost_lines", name)
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f'ALTER TABLE "{name}" RENAME CONSTRAINT pk_cost_lines TO pk_{name}')


# The stored JSON's text on both databases (SQLite keeps JSON as text; PostgreSQL's jsonb prints its own).
_LABELS_TEXT = "CAST(o.labels AS TEXT)"


def upgrade() -> None:
    bind = op.get_bind()
    mismatched = bind.execute(sa.text(
        f"SELECT count(*) FROM cost_lines o JOIN node_bills b ON {_JOIN_BILL} WHERE o.instance_type <> "
        "b.instance_type OR o.price_model <> b.price_model OR o.price_version <> b.price_version")).scalar()
    if mismatched:
        raise RuntimeError(f"{mismatched} cost lines are priced otherwise than their node bill; revision 0008 keeps "
                           "the instance type, price model and price version on the bill only")
    _set_aside("cost_lines_0007")
    op.add_column("node_bills", sa.Column("zero_lines", sa.Text(), nullable=True))
    label_sets = op.create_table(
        "label_sets",
        sa.Column("label_set_id", sa.BigInteger(), nullable=False, autoincrement=False),
        sa.Column("labels", _LABELS, nullable=False),
        sa.Column("carried_label_keys", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("label_set_id", name="pk_label_sets"),
    )
    # Each distinct stored (labels, carried keys) once, by its text as stored, to its content-addressed id.
    label_map = op.create_table(
        "label_map_0008",
        sa.Column("labels_text", sa.Text(), nullable=False),
        sa.Column("carried_label_keys", sa.Text(), nullable=False),
        sa.Column("label_set_id", sa.BigInteger(), nullable=False),
    )
    sets, mapping = {}, []
    for labels_text, carried in bind.execute(sa.text(
            f"SELECT DISTINCT {_LABELS_TEXT}, o.carried_label_keys FROM cost_lines_0007 o")):
        labels = json.loads(labels_text)
        keys = tuple(filter(None, carried.split(",")))
        ident = label_set_id(labels, keys)
        sets[ident] = {"label_set_id": ident, "labels": dict(sorted(labels.items())), "carried_label_keys": carried}
        mapping.append({"labels_text": labels_text, "carried_label_keys": carried, "label_set_id": ident})
    sets[0] = {"label_set_id": 0, "labels": {}, "carried_label_keys": ""}
    op.bulk_insert(label_sets, list(sets.values()))
    if mapping:
        op.bulk_insert(label_map, mapping)
    _new_cost_lines("cost_lines")
    columns = ", ".join(_COMMON)
    selected = ", ".join(f"o.{c}" for c in _COMMON)
    source = (f"FROM cost_lines_0007 o JOIN label_map_0008 m ON m.labels_text = {_LABELS_TEXT} "
              f"AND m.carried_label_keys = o.carried_label_keys JOIN node_bills b ON {_JOIN_BILL}")
    op.execute(f"INSERT INTO cost_lines ({columns}, label_set_id) SELECT {selected}, m.label_set_id {source} "
               f"WHERE NOT ({_ZERO_LINE})")
    zeros = defaultdict(list)
    for start, cluster, node, gpu, kind, method, basis, fraction in bind.execute(sa.text(
            f"SELECT o.window_start_unix_ms, o.cluster, o.node_name, o.gpu_uuid, o.subject_kind, o.method, "
            f"o.cost_basis, o.gpu_fraction {source} WHERE {_ZERO_LINE}")):
        zeros[(start, cluster, node)].append((gpu, kind, method, basis, float(fraction)))
    if zeros:
        bind.execute(
            sa.text("UPDATE node_bills SET zero_lines = :zero WHERE window_start_unix_ms = :start "
                    "AND cluster = :cluster AND node_name = :node"),
            [{"zero": encode_zero_lines(lines), "start": start, "cluster": cluster, "node": node}
             for (start, cluster, node), lines in zeros.items()])
    op.drop_table("label_map_0008")
    op.drop_table("cost_lines_0007")
    op.create_index(_NAMESPACE_INDEX, "cost_lines", ["namespace", "window_start_unix_ms"])


def downgrade() -> None:
    bind = op.get_bind()
    _set_aside("cost_lines_0008")
    _old_cost_lines("cost_lines")
    columns = ", ".join(_COMMON)
    selected = ", ".join(f"o.{c}" for c in _COMMON)
    op.execute(
        f"INSERT INTO cost_lines ({columns}, labels, carried_label_keys, instance_type, price_model, price_version) "
        f"SELECT {selected}, l.labels, l.carried_label_keys, b.instance_type, b.price_model, b.price_version "
        f"FROM cost_lines_0008 o JOIN label_sets l ON l.label_set_id = o.label_set_id JOIN node_bills b ON "
        f"{_JOIN_BILL}")
    lines = sa.table("cost_lines", *(sa.column(c) for c in _COMMON),
                     sa.column("labels", _LABELS), sa.column("carried_label_keys"), sa.column("instance_type"),
                     sa.column("price_model"), sa.column("price_version"))
    rows = []
    for start, cluster, node, seconds, instance, model, version, trued, zero in bind.execute(sa.text(
            "SELECT window_start_unix_ms, cluster, node_name, window_seconds, instance_type, price_model, "
            "price_version, trued_cost_micro_usd, zero_lines FROM node_bills WHERE zero_lines IS NOT NULL")):
        for gpu, kind, method, basis, fraction in decode_zero_lines(zero):
            rows.append({"window_start_unix_ms": start, "cluster": cluster, "node_name": node, "gpu_uuid": gpu,
                         "subject_kind": kind, "pod_uid": "", "window_seconds": seconds, "namespace": None,
                         "pod_name": None, "cost_share": 0.0, "cost_micro_usd": 0,
                         "trued_cost_micro_usd": None if trued is None else 0, "shared_from": "",
                         "sharing_method": "", "method": method, "cost_basis": basis, "memory_share": 0.0,
                         "compute_share": 0.0, "gpu_fraction": fraction, "labels": {}, "carried_label_keys": "",
                         "instance_type": instance, "price_model": model, "price_version": version})
    if rows:
        op.bulk_insert(lines, rows)
    op.drop_table("cost_lines_0008")
    op.drop_table("label_sets")
    # Not in batch mode: recreating node_bills would drop a table cost_lines' foreign key points at.
    op.drop_column("node_bills", "zero_lines")
    op.create_index(_NAMESPACE_INDEX, "cost_lines", ["namespace", "window_start_unix_ms"])
