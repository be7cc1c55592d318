"""PostgreSQL's node bills by dictionary ids (revision 0018): ``node_bill_rows``, its dictionaries, the view.

Up to 0017 a PostgreSQL bill was a ``node_bills`` row of 24 columns, ~1,090 bytes with its two indexes
(``bench/ledger_month.py``'s fleet after ``VACUUM FULL``): its zero lines' JSON ~540 bytes, eleven texts that are
the same on every bill of a node (cluster, node name, provider, region, zone, provider id, instance type, price
model, price version, sharing policy, GPU model) ~210, the primary key and the (node name, window) index ~160 with
their texts. Now a bill is a ``node_bill_rows`` row of numbers, and ``node_bills`` a view with 0017's columns,
names, types and values (``VIEW_SELECT``), so no reader changes:

=======================  ==============================================================================
``ledger_nodes``         (0014) ``node_id`` (int4) per (cluster, node name): the lines' own
``ledger_bill_kinds``    ``bill_kind_id`` (int4) per (provider, region, zone, provider id, instance type,
                         price model, price version, sharing, GPU model, window seconds, GPU count): what a
                         node's bills repeat, a few rows per node (a new one per price version or policy)
``ledger_bill_names``    ``name_id`` (int4) per text: the publishers (billing's consumer groups) and the
                         true-ups' ids (``trueups.trueup_id``, a bill's digest) that bills name
``ledger_zero_sets``     ``zero_set_id`` (int8) per ``zero_lines`` text (``line_storage``, its units by GPU
                         id): content-addressed like ``label_sets`` -- the first 8 bytes of the text's
                         SHA-256, signed (``zero_set_id``) -- so a writer needs no round trip for it; a node
                         lists the same zero lines minute after minute
``node_bill_rows``       per bill: the 8-byte columns first (window start, billed ms, node, GPU and other
                         micro-dollars, zero set, published at, trued-up micro-dollars), then the ids (int4:
                         node, bill kind, publisher, true-up) and the zero line count (int4): no padding;
                         primary key (window start, node id), an index (node id, window start);
                         partitioned by day as ``node_bills`` was
=======================  ==============================================================================

**Ids.** The node, bill kind and name ids are assigned once and never change or go, as the lines' are
(``services.billing.line_ids``: the same ``resolve``, the same per-handle ``IdCache``, before the write's
transaction). Retention drops ``node_bill_rows`` partitions, never dictionary rows: a node's bill kinds and zero
sets are few (the zero lines a node lists change with which of its buckets carry nothing: a handful of sets per
node, as its pods come and go), like the label sets (never dropped either: ``services.billing.retention``).

**Writes.** ``Ledger.write`` inserts the zero sets the handle has not stored (``ON CONFLICT DO NOTHING``, then
the texts read back and compared: a 64-bit collision is refused, as for label sets) and the rows with ``ON
CONFLICT (window start, node id) DO NOTHING RETURNING`` -- the same first-write-wins as before. Marking bills
published, claiming one for a publisher and the true-up update ``node_bill_rows`` by (window start, node id),
the node id found by its (cluster, name) in ``ledger_nodes`` (``update_by_key``).

SQLite keeps its ``node_bills`` table (the embedded default's ledger is small).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from sqlalchemy import (
    BigInteger,
    Column,
    Identity,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    bindparam,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection

ROWS_TABLE = "node_bill_rows"
# What a bill kind is: the bill's columns that every bill of a node repeats, in the key's order.
KIND_COLUMNS = ("provider", "region", "zone", "provider_id", "instance_type", "price_model", "price_version",
                "sharing", "gpu_model", "window_seconds", "gpu_count")
KIND_SQL_TYPES = ("text",) * 9 + ("int4", "int4")
# ``node_bill_rows``' columns a write fills, in ``row_values``' order (published, trued up and the true-up start
# NULL).
ROW_COLUMNS = ("window_start_unix_ms", "billed_milliseconds", "node_cost_micro_usd", "gpu_cost_micro_usd",
               "node_other_micro_usd", "zero_set_id", "node_id", "bill_kind_id", "publisher_id", "zero_line_count")

# The view: 0017's ``node_bills`` columns in 0017's order (so ``SELECT *`` reads the same), each its old type. The
# outer joins to names and zero sets are to unique keys: a query that does not read their columns skips them.
VIEW_SELECT = (
    "SELECT b.window_start_unix_ms, n.cluster, n.node_name, k.window_seconds, b.billed_milliseconds, k.provider, "
    "k.region, k.instance_type, k.price_model, k.gpu_count, b.node_cost_micro_usd, b.gpu_cost_micro_usd, "
    "b.node_other_micro_usd, k.price_version, b.published_at_unix_ms, k.zone, k.provider_id, "
    "CAST(p.name AS varchar(255)) AS publisher, b.trued_cost_micro_usd, "
    "CAST(t.name AS varchar(64)) AS trueup_id, k.sharing, z.zero_lines, k.gpu_model, b.zero_line_count "
    "FROM node_bill_rows b "
    "JOIN ledger_nodes n ON n.node_id = b.node_id "
    "JOIN ledger_bill_kinds k ON k.bill_kind_id = b.bill_kind_id "
    "LEFT JOIN ledger_bill_names p ON p.name_id = b.publisher_id "
    "LEFT JOIN ledger_bill_names t ON t.name_id = b.trueup_name_id "
    "LEFT JOIN ledger_zero_sets z ON z.zero_set_id = b.zero_set_id"
)


@dataclass(frozen=True, slots=True)
class BillIdTables:
    """The bills' dictionaries and rows (PostgreSQL from 0018: ``info`` names the dialect)."""

    kinds: Table
    names: Table
    zero_sets: Table
    rows: Table


def define_tables(metadata: MetaData, only_on: str) -> BillIdTables:
    """Add revision 0018's tables to the ledger's ``metadata``, marked ``{only_on: "postgresql"}``."""
    info = {only_on: "postgresql"}
    kinds = Table(
        "ledger_bill_kinds", metadata,
        Column("bill_kind_id", Integer, Identity(), nullable=False),
        Column("provider", String(64), nullable=False),
        Column("region", String(64), nullable=False),
        Column("zone", String(64), nullable=False),
        Column("provider_id", String(512), nullable=False),
        Column("instance_type", String(128), nullable=False),
        Column("price_model", String(16), nullable=False),
        Column("price_version", String(255), nullable=False),
        Column("sharing", String(255), nullable=False),
        Column("gpu_model", String(128), nullable=False),
        Column("window_seconds", Integer, nullable=False),
        Column("gpu_count", Integer, nullable=False),
        PrimaryKeyConstraint("bill_kind_id"),
        UniqueConstraint(*KIND_COLUMNS, name="uq_ledger_bill_kinds"),
        # No foreign key to ``price_versions``: a kind is stored before its write (``resolve``), which inserts the
        # price version in its own transaction; a kind whose write then failed is named by no bill.
        info=info)
    names = Table(
        "ledger_bill_names", metadata,
        Column("name_id", Integer, Identity(), nullable=False),
        Column("name", String(255), nullable=False),
        PrimaryKeyConstraint("name_id"), UniqueConstraint("name", name="uq_ledger_bill_names"),
        info=info)
    zero_sets = Table(
        "ledger_zero_sets", metadata,
        Column("zero_set_id", BigInteger, nullable=False, autoincrement=False),
        Column("zero_lines", Text, nullable=False),
        PrimaryKeyConstraint("zero_set_id"),
        info=info)
    rows = Table(
        ROWS_TABLE, metadata,
        Column("window_start_unix_ms", BigInteger, nullable=False, autoincrement=False),
        Column("billed_milliseconds", BigInteger, nullable=False),
        Column("node_cost_micro_usd", BigInteger, nullable=False),
        Column("gpu_cost_micro_usd", BigInteger, nullable=False),
        Column("node_other_micro_usd", BigInteger, nullable=False),
        Column("zero_set_id", BigInteger, nullable=True),
        Column("published_at_unix_ms", BigInteger, nullable=True),
        Column("trued_cost_micro_usd", BigInteger, nullable=True),
        Column("node_id", Integer, nullable=False, autoincrement=False),
        Column("bill_kind_id", Integer, nullable=False),
        Column("publisher_id", Integer, nullable=True),
        Column("trueup_name_id", Integer, nullable=True),
        Column("zero_line_count", Integer, nullable=False),
        PrimaryKeyConstraint("window_start_unix_ms", "node_id"),
        Index(None, "node_id", "window_start_unix_ms"),
        info=info)
    return BillIdTables(kinds, names, zero_sets, rows)


# -- pure -----------------------------------------------------------------------------------------------------------


def kind_key(bill_row: Mapping[str, Any]) -> tuple:
    """A bill's ``ledger_bill_kinds`` key (``KIND_COLUMNS`` order) from its ``node_bills`` columns."""
    return tuple(bill_row[name] for name in KIND_COLUMNS)


def node_key(bill_row: Mapping[str, Any]) -> tuple[str, str]:
    """A bill's ``ledger_nodes`` key: (cluster, node name)."""
    return (bill_row["cluster"], bill_row["node_name"])


def zero_set_id(zero_lines: str) -> int:
    """The ``ledger_zero_sets`` id of a ``zero_lines`` text: the first 8 bytes of its UTF-8 SHA-256, signed."""
    digest = hashlib.sha256(zero_lines.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def wanted_keys(bill_rows: Iterable[Mapping[str, Any]], publisher: str | None) -> dict[str, set]:
    """The dictionary keys (``line_ids``' kinds ``nodes``, ``bill_kinds``, ``names``) that ``bill_rows`` (their
    ``node_bills`` columns) and the writer's ``publisher`` name. Pure."""
    nodes, kinds = set(), set()
    for row in bill_rows:
        nodes.add(node_key(row))
        kinds.add(kind_key(row))
    return {"nodes": nodes, "bill_kinds": kinds, "names": set() if publisher is None else {publisher}}


def row_values(bill_row: Mapping[str, Any], *, node_id: int, bill_kind_id: int, publisher_id: int | None) -> dict:
    """The ``node_bill_rows`` row (``ROW_COLUMNS``) of a bill's ``node_bills`` columns, its ids given."""
    zero = bill_row["zero_lines"]
    return {"window_start_unix_ms": bill_row["window_start_unix_ms"],
            "billed_milliseconds": bill_row["billed_milliseconds"],
            "node_cost_micro_usd": bill_row["node_cost_micro_usd"],
            "gpu_cost_micro_usd": bill_row["gpu_cost_micro_usd"],
            "node_other_micro_usd": bill_row["node_other_micro_usd"],
            "zero_set_id": None if zero is None else zero_set_id(zero),
            "node_id": node_id, "bill_kind_id": bill_kind_id, "publisher_id": publisher_id,
            "zero_line_count": bill_row["zero_line_count"]}


# -- SQL (PostgreSQL) ----------------------------------------------------------------------------------------------


def uses_bill_rows(connection: Connection) -> bool:
    """Whether this ledger stores its bills by ids (PostgreSQL from revision 0018)."""
    if connection.dialect.name != "postgresql":
        return False
    return connection.execute(text(f"SELECT to_regclass('{ROWS_TABLE}') IS NOT NULL")).scalar() is True


def insert_zero_sets(connection: Connection, tables: BillIdTables, texts: Iterable[str]) -> set[int]:
    """Store the ``zero_lines`` texts (``ON CONFLICT DO NOTHING``); returns their ids. ``LookupError`` when a stored
    set of one of those ids holds another text (a 64-bit hash collision): nothing may be mixed up."""
    by_id = {zero_set_id(t): t for t in set(texts)}
    if not by_id:
        return set()
    from sqlalchemy.dialects import postgresql

    z = tables.zero_sets.c
    connection.execute(postgresql.insert(tables.zero_sets).on_conflict_do_nothing(),
                       [{"zero_set_id": i, "zero_lines": t} for i, t in sorted(by_id.items())])
    for i, stored in connection.execute(select(z.zero_set_id, z.zero_lines).where(z.zero_set_id.in_(list(by_id)))):
        if stored != by_id[i]:
            raise LookupError(f"zero set {i} holds {stored[:80]!r}, not the {by_id[i][:80]!r} whose id it is")
    return set(by_id)


def name_id(connection: Connection, tables: BillIdTables, name: str) -> int:
    """The ``ledger_bill_names`` id of ``name``, inserted if new (in the caller's transaction)."""
    from sqlalchemy.dialects import postgresql

    n = tables.names.c
    connection.execute(postgresql.insert(tables.names).on_conflict_do_nothing(), [{"name": name}])
    return int(connection.execute(select(n.name_id).where(n.name == name)).scalar_one())


def update_by_key(tables: BillIdTables, node_ids: Table, *conditions, **values):
    """``UPDATE node_bill_rows SET values`` of the bill keyed by the bound ``b_start``, ``b_cluster`` and
    ``b_node`` (its node id found in ``node_ids``, ``ledger_nodes``), where also ``conditions`` hold: what the
    ledger's writes of a stored bill go through (``node_bills`` is a view)."""
    r, n = tables.rows.c, node_ids.c
    return (update(tables.rows)
            .where(r.window_start_unix_ms == bindparam("b_start"),
                   r.node_id == select(n.node_id).where(n.cluster == bindparam("b_cluster"),
                                                        n.node_name == bindparam("b_node")).scalar_subquery(),
                   *conditions)
            .values(**values))
