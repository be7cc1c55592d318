"""PostgreSQL: the hourly FOCUS lines by ids (``focus_line_hourly_rows``), the view ``focus_line_hourly`` over them.

A ``focus_line_hourly`` row (0015) repeated its origin charge's link -- cluster, node, provider id, zone, price
version, sharing policy -- and its own text keys (subject kind, pod uid, GPU uuid, shared from, sharing method,
method, cost basis, namespace, pod name): 18 key columns, ~913 bytes a row with its primary key (bench, 2026-12-04).
Now a row is numbers only (``services.billing.focus_rollups``): its origin charge by ``focus_charge_hourly``'s new
``charge_id`` (``bigint``, from the sequence ``focus_charge_hourly_charge_id_seq``), its GPU, pod and line kind by
the ids of revision 0014's dictionaries (``ledger_gpus``, ``ledger_pods``, ``ledger_line_kinds``), the 8-byte
columns first, then the 4-byte ones, then the 2-byte kind (no padding between them), and one index: the primary
key (hour, charge id, label set, pod, GPU, kind) its upserts need. ``focus_line_hourly`` becomes a view with
0015's columns, names and values, so a reader of it reads what it read before.

The upgrade gives every charge its id (in key order), adds the dictionaries' missing keys (a line's pod is the row
of ``focus_rollups.focus_pod_key``: an empty namespace or pod name is the absent one), creates
``focus_line_hourly_rows`` partitioned by day as ``focus_line_hourly`` was (the same days, fillfactor 70) or plain
where it was not, copies every row (``INSERT ... SELECT``), drops the table and creates the view. The downgrade
moves the rows back into 0015's table (partitioned likewise) and drops the column, the sequence and the rows'
table (the dictionaries' rows stay: 0014's).

SQLite: nothing changes (its ``focus_line_hourly`` table stays; its ledger is small).

Revision ID: 0017_focus_line_ids
Revises: 0016_line_packs
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

revision = "0017_focus_line_ids"
down_revision = "0016_line_packs"
branch_labels = None
depends_on = None

_FILLFACTOR = 70  # partitions.ROLLUP_FILLFACTOR at this revision: the rows are upserted once a minute
_SEQUENCE = "focus_charge_hourly_charge_id_seq"
_LINK = ("cluster", "node_name", "provider_id", "zone", "price_version", "sharing", "window_seconds")
_KIND = ("subject_kind", "shared_from", "sharing_method", "method", "cost_basis")
_ROWS = ("CREATE TABLE focus_line_hourly_rows (period_start_unix_ms bigint NOT NULL, charge_id bigint NOT NULL, "
         "label_set_id bigint NOT NULL, cost_micro_usd bigint NOT NULL, billed_micro_usd bigint NOT NULL, "
         "cost_share_ms double precision NOT NULL, memory_share_ms double precision NOT NULL, "
         "compute_share_ms double precision NOT NULL, gpu_ms double precision NOT NULL, billed_ms integer NOT NULL, "
         "cost_lines integer NOT NULL, trued_lines integer NOT NULL, gpu_id integer NOT NULL, "
         "pod_id integer NOT NULL, kind_id smallint NOT NULL, CONSTRAINT pk_focus_line_hourly_rows PRIMARY KEY "
         "(period_start_unix_ms, charge_id, label_set_id, pod_id, gpu_id, kind_id))")
_ROW_COLUMNS = ("period_start_unix_ms, charge_id, label_set_id, cost_micro_usd, billed_micro_usd, cost_share_ms, "
                "memory_share_ms, compute_share_ms, gpu_ms, billed_ms, cost_lines, trued_lines, gpu_id, pod_id, "
                "kind_id")

# The view: 0015's columns in 0015's order, each its old type.
VIEW_SELECT = (
    "SELECT c.period_start_unix_ms, c.cluster, c.node_name, c.provider_id, c.zone, c.price_version, c.sharing, "
    "c.window_seconds, k.subject_kind, d.pod_uid, g.gpu_uuid, k.shared_from, k.sharing_method, k.method, "
    "k.cost_basis, d.namespace, d.pod_name, l.label_set_id, l.cost_micro_usd, l.billed_micro_usd, "
    "CAST(l.cost_lines AS bigint) AS cost_lines, CAST(l.trued_lines AS bigint) AS trued_lines, "
    "CAST(l.billed_ms AS bigint) AS billed_ms, l.cost_share_ms, l.memory_share_ms, l.compute_share_ms, l.gpu_ms "
    "FROM focus_line_hourly_rows l "
    "JOIN focus_charge_hourly c ON c.period_start_unix_ms = l.period_start_unix_ms AND c.charge_id = l.charge_id "
    "JOIN ledger_gpus g ON g.gpu_id = l.gpu_id "
    "JOIN ledger_pods d ON d.pod_id = l.pod_id "
    "JOIN ledger_line_kinds k ON k.kind_id = l.kind_id"
)

# 0015's table, for the downgrade.
_OLD_TABLE = (
    "CREATE TABLE focus_line_hourly (period_start_unix_ms bigint NOT NULL, cluster varchar(253) NOT NULL, "
    "node_name varchar(253) NOT NULL, provider_id varchar(512) NOT NULL, zone varchar(64) NOT NULL, "
    "price_version varchar(255) NOT NULL, sharing varchar(255) NOT NULL, window_seconds integer NOT NULL, "
    "subject_kind varchar(16) NOT NULL, pod_uid varchar(128) NOT NULL, gpu_uuid varchar(128) NOT NULL, "
    "shared_from varchar(16) NOT NULL, sharing_method varchar(16) NOT NULL, method varchar(32) NOT NULL, "
    "cost_basis varchar(32) NOT NULL, namespace varchar(253) NOT NULL, pod_name varchar(253) NOT NULL, "
    "label_set_id bigint NOT NULL, cost_micro_usd bigint NOT NULL, billed_micro_usd bigint NOT NULL, "
    "cost_lines bigint NOT NULL, trued_lines bigint NOT NULL, billed_ms bigint NOT NULL, "
    "cost_share_ms double precision NOT NULL, memory_share_ms double precision NOT NULL, "
    "compute_share_ms double precision NOT NULL, gpu_ms double precision NOT NULL, "
    "CONSTRAINT pk_focus_line_hourly PRIMARY KEY (period_start_unix_ms, cluster, node_name, provider_id, zone, "
    "price_version, sharing, window_seconds, subject_kind, pod_uid, gpu_uuid, shared_from, sharing_method, method, "
    "cost_basis, namespace, pod_name, label_set_id))")
# ``focus_pod_key``: an empty namespace or pod name is the absent one.
_ABSENT = ("CAST((CASE WHEN o.namespace = '' THEN 1 ELSE 0 END) | (CASE WHEN o.pod_name = '' THEN 2 ELSE 0 END) "
           "AS smallint)")


def _partitions(connection, table: str) -> list[tuple[str, str]] | None:
    """(partition name, bound clause) of each partition of ``table``; None when it is not partitioned."""
    if not connection.execute(text(
            "SELECT count(*) FROM pg_partitioned_table WHERE partrelid = CAST(:t AS regclass)"), {"t": table}).scalar():
        return None
    return [tuple(row) for row in connection.execute(text(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i JOIN pg_class c "
        "ON c.oid = i.inhrelid WHERE i.inhparent = CAST(:t AS regclass) ORDER BY c.relname"), {"t": table})]


def _rename_with_partitions(connection, table: str, to: str, parts: list[tuple[str, str]] | None,
                            constraint: str) -> None:
    """Rename ``table``, its partitions (``table_p...`` -> ``to_p...``) and its primary key out of the way."""
    connection.execute(text(f'ALTER TABLE "{table}" RENAME TO "{to}"'))
    connection.execute(text(f'ALTER TABLE "{to}" RENAME CONSTRAINT "{constraint}" TO "{constraint}_old"'))
    for name, _bound in parts or ():
        connection.execute(text(f'ALTER TABLE "{name}" RENAME TO "{to}{name[len(table):]}"'))


def _create_like(connection, create: str, table: str, parts: list[tuple[str, str]] | None, source: str) -> None:
    """``create`` (``table``'s DDL), partitioned by hour start as ``source`` was, with a partition per one of
    ``parts`` (named from ``source``'s names to ``table``'s), each with the rollups' fillfactor."""
    if parts is None:
        connection.execute(text(create))
        return
    connection.execute(text(f"{create} PARTITION BY RANGE (period_start_unix_ms)"))
    for name, bound in parts:
        child = table + name[len(source):]
        connection.execute(text(f'CREATE TABLE "{child}" (LIKE "{table}" INCLUDING DEFAULTS INCLUDING CONSTRAINTS) '
                                f"WITH (fillfactor = {_FILLFACTOR})"))
        connection.execute(text(f'ALTER TABLE "{table}" ATTACH PARTITION "{child}" {bound}'))


def upgrade() -> None:
    connection = op.get_bind()
    if connection.dialect.name != "postgresql":
        return
    # Every charge its id, in key order (the same ledger gets the same ids); a new one gets it from the sequence in
    # the upsert (no column default: ``bulk_rows``' staging tables copy defaults).
    connection.execute(text(f"CREATE SEQUENCE {_SEQUENCE} AS bigint"))
    connection.execute(text("ALTER TABLE focus_charge_hourly ADD COLUMN charge_id bigint"))
    connection.execute(text(
        "UPDATE focus_charge_hourly c SET charge_id = o.id FROM (SELECT period_start_unix_ms, "
        + ", ".join(_LINK) + f", provider, region, instance_type, price_model, nextval('{_SEQUENCE}') AS id FROM "
        "(SELECT * FROM focus_charge_hourly ORDER BY period_start_unix_ms, " + ", ".join(_LINK)
        + ", provider, region, instance_type, price_model) s) o "
        "WHERE c.period_start_unix_ms = o.period_start_unix_ms AND "
        + " AND ".join(f"c.{name} = o.{name}" for name in (*_LINK, "provider", "region", "instance_type",
                                                            "price_model"))))
    connection.execute(text("ALTER TABLE focus_charge_hourly ALTER COLUMN charge_id SET NOT NULL"))
    connection.execute(text(f"ALTER SEQUENCE {_SEQUENCE} OWNED BY focus_charge_hourly.charge_id"))
    # The keys the rows name that the dictionaries lack (zero lines' kinds, a bucket's pod), in key order.
    connection.execute(text(
        "INSERT INTO ledger_gpus (gpu_uuid) SELECT DISTINCT gpu_uuid FROM focus_line_hourly ORDER BY 1 "
        "ON CONFLICT DO NOTHING"))
    connection.execute(text(
        f"INSERT INTO ledger_pods (pod_uid, namespace, pod_name, absent) SELECT DISTINCT o.pod_uid, o.namespace, "
        f"o.pod_name, {_ABSENT} FROM focus_line_hourly o ORDER BY 1, 2, 3, 4 ON CONFLICT DO NOTHING"))
    kind = ", ".join((*_KIND, "window_seconds"))
    connection.execute(text(
        f"INSERT INTO ledger_line_kinds ({kind}) SELECT DISTINCT {kind} FROM focus_line_hourly ORDER BY {kind} "
        "ON CONFLICT DO NOTHING"))
    parts = _partitions(connection, "focus_line_hourly")
    _rename_with_partitions(connection, "focus_line_hourly", "focus_line_hourly_0015", parts,
                            "pk_focus_line_hourly")
    _create_like(connection, _ROWS, "focus_line_hourly_rows", parts, "focus_line_hourly")
    connection.execute(text(
        f"INSERT INTO focus_line_hourly_rows ({_ROW_COLUMNS}) "
        "SELECT o.period_start_unix_ms, c.charge_id, o.label_set_id, o.cost_micro_usd, o.billed_micro_usd, "
        "o.cost_share_ms, o.memory_share_ms, o.compute_share_ms, o.gpu_ms, o.billed_ms, o.cost_lines, o.trued_lines, "
        "g.gpu_id, d.pod_id, k.kind_id FROM focus_line_hourly_0015 o "
        "JOIN LATERAL (SELECT min(x.charge_id) AS charge_id FROM focus_charge_hourly x "
        "WHERE x.period_start_unix_ms = o.period_start_unix_ms AND "
        + " AND ".join(f"x.{name} = o.{name}" for name in _LINK) + ") c ON c.charge_id IS NOT NULL "
        "JOIN ledger_gpus g ON g.gpu_uuid = o.gpu_uuid "
        f"JOIN ledger_pods d ON d.pod_uid = o.pod_uid AND d.namespace = o.namespace AND d.pod_name = o.pod_name "
        f"AND d.absent = {_ABSENT} "
        "JOIN ledger_line_kinds k ON " + " AND ".join(f"k.{name} = o.{name}" for name in (*_KIND, "window_seconds"))
        + " ORDER BY 1, 2, 3, 14, 13, 15"))
    moved = connection.execute(text("SELECT count(*) FROM focus_line_hourly_rows")).scalar()
    before = connection.execute(text("SELECT count(*) FROM focus_line_hourly_0015")).scalar()
    if moved != before:
        raise RuntimeError(f"0017 moved {moved} of {before} hourly FOCUS lines (a line without its origin charge?)")
    connection.execute(text("DROP TABLE focus_line_hourly_0015"))
    connection.execute(text(f"CREATE VIEW focus_line_hourly AS {VIEW_SELECT}"))
    connection.execute(text("ANALYZE focus_line_hourly_rows"))
    connection.execute(text("ANALYZE focus_charge_hourly"))


def downgrade() -> None:
    connection = op.get_bind()
    if connection.dialect.name != "postgresql":
        return
    parts = _partitions(connection, "focus_line_hourly_rows")
    connection.execute(text("ALTER VIEW focus_line_hourly RENAME TO focus_line_hourly_0017"))
    _create_like(connection, _OLD_TABLE, "focus_line_hourly", parts, "focus_line_hourly_rows")
    connection.execute(text("INSERT INTO focus_line_hourly SELECT * FROM focus_line_hourly_0017"))
    connection.execute(text("DROP VIEW focus_line_hourly_0017"))
    connection.execute(text("DROP TABLE focus_line_hourly_rows"))
    connection.execute(text("ALTER TABLE focus_charge_hourly DROP COLUMN charge_id"))  # drops the owned sequence
    connection.execute(text(f"DROP SEQUENCE IF EXISTS {_SEQUENCE}"))
    connection.execute(text("ANALYZE focus_line_hourly"))
