"""PostgreSQL's cost lines by dictionary ids (revision 0014): the rows, the dictionaries, the ids' cache.

A PostgreSQL ledger stores a cost line as a ``cost_line_rows`` row of numbers only, and the view ``cost_lines``
gives every reader the columns it had before (the same names, types and values: SQLite's ``cost_lines`` table, and
PostgreSQL's up to 0013), so no reader's SQL changes:

=====================  ================================================================================
``ledger_nodes``       ``node_id`` (int4) per (cluster, node name)
``ledger_gpus``        ``gpu_id`` (int4) per GPU uuid ('' for a node-level line)
``ledger_pods``        ``pod_id`` (int4) per (pod uid, namespace, pod name): '' and NULL told apart by
                       ``absent`` (bit 1: namespace NULL, bit 2: pod name NULL), so the key has no NULL
``ledger_line_kinds``  ``kind_id`` (int2) per (subject kind, shared from, sharing method, attribution method,
                       cost basis, window seconds): what a line is, a few dozen combinations in a ledger
``cost_line_rows``     per line: the 8-byte columns first (window start, label set, list and trued-up
                       micro-dollars, the four shares and fractions), then the three ids (int4), then the
                       kind (int2) -- no padding between them; a (window start, node id) index;
                       partitioned by day like ``cost_lines`` was
=====================  ================================================================================

A row is 102 bytes (104 aligned; 0013's was 226 with its text) and its index entry ~8 (``bench/ledger_month.py``
measured the bytes per line, heap and index, after ``VACUUM FULL``, A/B against 0013's layout). From revision 0016
the rows are gone: a node-window's lines are one ``cost_line_packs`` row of arrays of the same values
(``services.billing.line_packs``); the dictionaries, ``resolve`` and ``row_values`` stay as they are.

**Ids** are assigned once and never change or go (retention drops line rows, never dictionary rows: a few thousand
pods a day). ``resolve`` gives the ids of a write's lines in a short transaction of its own, before the write's:
per dictionary one ``INSERT ... SELECT FROM unnest(...) ORDER BY key ON CONFLICT DO NOTHING`` of the keys this
process has not cached, then one ``SELECT`` of their ids (a new statement: in READ COMMITTED it sees the rows a
concurrent writer committed, which the insert waited for and skipped). Two writers of one new key both get the
one id; an id whose write then fails is kept unused. The cache (``IdCache``, bounded: cleared when full) makes a
write of known nodes, GPUs and pods touch no dictionary at all. From revision 0018 the node bills' dictionaries
(bill kinds, and the names of publishers and true-ups: ``services.billing.bill_ids``) are resolved the same way, in
the same transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Sequence

from sqlalchemy import (
    BigInteger,
    Column,
    Double,
    Identity,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    UniqueConstraint,
    bindparam,
    select,
    text,
)
from sqlalchemy.engine import Connection

from schemas.records import CostRecord
from services.billing.rollups import KIND_TEXT

ROWS_TABLE = "cost_line_rows"
# The ``only_on`` mark of ``cost_line_rows``: PostgreSQL at these revisions (0016 packs the lines by node-window).
ROWS_REVISIONS = "postgresql 0014-0015"
# Ids remembered per kind and handle: more than a fleet's nodes, GPUs and two weeks of pods; cleared when full.
CACHE_ENTRIES = 262_144
NAMESPACE_ABSENT = 1
POD_NAME_ABSENT = 2

# Where each dictionary's key columns and id are, for ``resolve``: (table, id column, key columns, their SQL types).
_KINDS = {
    "nodes": ("ledger_nodes", "node_id", ("cluster", "node_name"), ("text", "text")),
    "gpus": ("ledger_gpus", "gpu_id", ("gpu_uuid",), ("text",)),
    "pods": ("ledger_pods", "pod_id", ("pod_uid", "namespace", "pod_name", "absent"), ("text", "text", "text", "int2")),
    "kinds": ("ledger_line_kinds", "kind_id",
              ("subject_kind", "shared_from", "sharing_method", "method", "cost_basis", "window_seconds"),
              ("text", "text", "text", "text", "text", "int4")),
    # The node bills' dictionaries (revision 0018, ``services.billing.bill_ids``): what a node's bills repeat, and
    # the publishers and true-up ids they name.
    "bill_kinds": ("ledger_bill_kinds", "bill_kind_id",
                   ("provider", "region", "zone", "provider_id", "instance_type", "price_model", "price_version",
                    "sharing", "gpu_model", "window_seconds", "gpu_count"),
                   ("text",) * 9 + ("int4", "int4")),
    "names": ("ledger_bill_names", "name_id", ("name",), ("text",)),
}

# ``cost_line_rows``' columns a write fills, in ``row_values``' order (``trued_cost_micro_usd`` starts NULL).
ROW_COLUMNS = ("window_start_unix_ms", "label_set_id", "cost_micro_usd", "cost_share", "memory_share",
               "compute_share", "gpu_fraction", "node_id", "gpu_id", "pod_id", "kind_id")


@dataclass(frozen=True, slots=True)
class LineIdTables:
    """The dictionary tables and the lines' rows (PostgreSQL only: ``info`` names the dialect)."""

    nodes: Table
    gpus: Table
    pods: Table
    kinds: Table
    rows: Table


def define_tables(metadata: MetaData, only_on: str) -> LineIdTables:
    """Add revision 0014's tables to the ledger's ``metadata``, marked ``{only_on: "postgresql"}`` (the rows
    ``{only_on: ROWS_REVISIONS}``: not head's)."""
    info = {only_on: "postgresql"}
    nodes = Table(
        "ledger_nodes", metadata,
        Column("node_id", Integer, Identity(), nullable=False),
        Column("cluster", String(253), nullable=False),
        Column("node_name", String(253), nullable=False),
        PrimaryKeyConstraint("node_id"), UniqueConstraint("cluster", "node_name", name="uq_ledger_nodes"),
        info=info)
    gpus = Table(
        "ledger_gpus", metadata,
        Column("gpu_id", Integer, Identity(), nullable=False),
        Column("gpu_uuid", String(128), nullable=False),
        PrimaryKeyConstraint("gpu_id"), UniqueConstraint("gpu_uuid", name="uq_ledger_gpus"),
        info=info)
    pods = Table(
        "ledger_pods", metadata,
        Column("pod_id", Integer, Identity(), nullable=False),
        Column("pod_uid", String(128), nullable=False),
        Column("namespace", String(253), nullable=False),
        Column("pod_name", String(253), nullable=False),
        Column("absent", SmallInteger, nullable=False),
        PrimaryKeyConstraint("pod_id"),
        UniqueConstraint("pod_uid", "namespace", "pod_name", "absent", name="uq_ledger_pods"),
        info=info)
    kinds = Table(
        "ledger_line_kinds", metadata,
        Column("kind_id", SmallInteger, Identity(), nullable=False),
        Column("subject_kind", String(16), nullable=False),
        Column("shared_from", String(16), nullable=False),
        Column("sharing_method", String(16), nullable=False),
        Column("method", String(32), nullable=False),
        Column("cost_basis", String(32), nullable=False),
        Column("window_seconds", Integer, nullable=False),
        PrimaryKeyConstraint("kind_id"),
        UniqueConstraint("subject_kind", "shared_from", "sharing_method", "method", "cost_basis", "window_seconds",
                         name="uq_ledger_line_kinds"),
        info=info)
    rows = Table(
        ROWS_TABLE, metadata,
        Column("window_start_unix_ms", BigInteger, nullable=False),
        Column("label_set_id", BigInteger, nullable=False),
        Column("cost_micro_usd", BigInteger, nullable=False),
        Column("trued_cost_micro_usd", BigInteger, nullable=True),
        Column("cost_share", Double, nullable=False),
        Column("memory_share", Double, nullable=False),
        Column("compute_share", Double, nullable=False),
        Column("gpu_fraction", Double, nullable=False),
        Column("node_id", Integer, nullable=False),
        Column("gpu_id", Integer, nullable=False),
        Column("pod_id", Integer, nullable=False),
        Column("kind_id", SmallInteger, nullable=False),
        Index(None, "window_start_unix_ms", "node_id"),
        # Revisions 0014 and 0015 only: from 0016 the lines are ``cost_line_packs`` (``line_packs``).
        info={only_on: ROWS_REVISIONS})
    return LineIdTables(nodes, gpus, pods, kinds, rows)


# -- pure: keys and the cache --------------------------------------------------------------------------------------


def pod_key(cost: CostRecord) -> tuple[str, str, str, int]:
    """A line's ``ledger_pods`` key: (pod uid or '', namespace or '', pod name or '', which of the two are NULL)."""
    namespace, name = cost.namespace, cost.pod_name
    absent = (NAMESPACE_ABSENT if namespace is None else 0) | (POD_NAME_ABSENT if name is None else 0)
    return (cost.pod_uid or "", namespace or "", name or "", absent)


def line_keys(cost: CostRecord) -> tuple[tuple[str, str], str, tuple[str, str, str, int],
                                         tuple[str, str, str, str, str, int]]:
    """A line's dictionary keys: (node, GPU, pod, kind: (subject kind, shared from, sharing method, method, cost
    basis, window seconds))."""
    return ((cost.cluster, cost.node_name), cost.gpu_uuid or "", pod_key(cost),
            (KIND_TEXT[cost.subject_kind], KIND_TEXT[cost.shared_from], cost.sharing_method, cost.method,
             cost.cost_basis, cost.window_seconds))


class IdCache:
    """Ids known to be stored, per dictionary (``nodes``, ``gpus``, ``pods``, ``kinds``; from 0018 the bills'
    ``bill_kinds`` and ``names``, ``services.billing.bill_ids``): at most ``entries`` each;
    and the uuids of GPU ids read back (``gpu_uuids``, for the bills' zero lines), as many.
    ``make_room`` empties a kind that a batch's new keys would grow past it (its ids are read again from the
    database when next needed), so that every key of one batch is cached at once."""

    def __init__(self, entries: int = CACHE_ENTRIES) -> None:
        if entries < 1:
            raise ValueError("an id cache holds at least one entry per kind")
        self.entries = entries
        self._ids: dict[str, dict[Hashable, int]] = {kind: {} for kind in _KINDS}
        self._gpu_uuids: dict[int, str] = {}

    def gpu_uuids(self) -> Mapping[int, str]:
        """The uuids of the GPU ids known now (``add_gpu_uuids``)."""
        return self._gpu_uuids

    def add_gpu_uuids(self, uuids: Mapping[int, str]) -> None:
        """Remember GPU ids' uuids read from ``ledger_gpus`` (emptied first when they would pass ``entries``)."""
        if len(self._gpu_uuids) + len(uuids) > self.entries:
            self._gpu_uuids.clear()
        self._gpu_uuids.update(uuids)

    def get(self, kind: str) -> Mapping[Hashable, int]:
        """The ids of ``kind`` known now."""
        return self._ids[kind]

    def make_room(self, kind: str, keys: set[Hashable]) -> set[Hashable]:
        """The keys of ``keys`` (one batch's) not cached, after emptying ``kind`` if adding them would pass
        ``entries``; ``LookupError`` when the batch alone has more keys than that."""
        if len(keys) > self.entries:
            raise LookupError(f"{len(keys)} {kind} in one batch, more than the id cache holds ({self.entries})")
        known = self._ids[kind]
        missing = {key for key in keys if key not in known}
        if missing and len(known) + len(missing) > self.entries:
            known.clear()
            missing = set(keys)
        return missing

    def add(self, kind: str, ids: Mapping[Hashable, int]) -> None:
        """Remember ``ids`` (key -> id); ``make_room`` made room for them."""
        known = self._ids[kind]
        if len(known) + len(ids) > self.entries:
            raise LookupError(f"{kind}: {len(known) + len(ids)} ids would pass the cache's {self.entries}")
        known.update(ids)

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._ids.values())


# -- SQL (PostgreSQL) ----------------------------------------------------------------------------------------------


def _resolve_kind(connection: Connection, kind: str, keys: Sequence[tuple]) -> dict[tuple, int]:
    table, id_column, columns, types = _KINDS[kind]
    names = ", ".join(columns)
    arrays = ", ".join(f"CAST(:k{index} AS {sql}[])" for index, sql in enumerate(types))
    params = {f"k{index}": [key[index] for key in keys] for index in range(len(columns))}
    connection.execute(text(
        f"INSERT INTO {table} ({names}) SELECT * FROM unnest({arrays}) AS k ({names}) ORDER BY {names} "
        "ON CONFLICT DO NOTHING"), params)
    match = " AND ".join(f"t.{name} = k.{name}" for name in columns)
    found = {tuple(row[1:]): int(row[0]) for row in connection.execute(text(
        f"SELECT t.{id_column}, {', '.join(f't.{name}' for name in columns)} FROM {table} t "
        f"JOIN unnest({arrays}) AS k ({names}) ON {match}"), params)}
    return found


def find_ids(connection: Connection, kind: str, keys: Iterable[Hashable]) -> dict[Hashable, int]:
    """The stored ids of ``keys`` of ``kind`` (as ``IdCache`` keys them: a one-column key by its value), read in
    ``connection``'s transaction; nothing is inserted, and keys without a row are left out. What a writer that
    found a key missing from its cache reads (``focus_rollups``: a true-up's lines)."""
    table, id_column, columns, types = _KINDS[kind]
    single = len(columns) == 1
    rows = sorted((key,) if single else key for key in keys)
    if not rows:
        return {}
    names = ", ".join(columns)
    arrays = ", ".join(f"CAST(:k{index} AS {sql}[])" for index, sql in enumerate(types))
    params = {f"k{index}": [key[index] for key in rows] for index in range(len(columns))}
    match = " AND ".join(f"t.{name} = k.{name}" for name in columns)
    return {(row[1] if single else tuple(row[1:])): int(row[0]) for row in connection.execute(text(
        f"SELECT t.{id_column}, {', '.join(f't.{name}' for name in columns)} FROM {table} t "
        f"JOIN unnest({arrays}) AS k ({names}) ON {match}"), params)}


def missing_keys(cache: IdCache, lines: Iterable[CostRecord], gpus: Iterable[str] = (),
                 more: Mapping[str, set] | None = None) -> dict[str, set]:
    """Per kind, the dictionary keys of ``lines`` (and the GPU uuids ``gpus``: the zero lines' units, which their
    bill names by id; and ``more``'s keys per kind: the bills', ``bill_ids.wanted_keys``) whose ids ``cache`` lacks
    (after making room for the batch: a kind emptied for it lists every key of the batch again). Pure."""
    more = more or {}
    nodes, pods, kinds = set(more.get("nodes", ())), set(), set()
    gpus = set(gpus)
    for cost in lines:
        node, gpu, pod, kind = line_keys(cost)
        nodes.add(node)
        gpus.add(gpu)
        pods.add(pod)
        kinds.add(kind)
    wanted = {}
    for kind, keys in (("nodes", nodes), ("gpus", gpus), ("pods", pods), ("kinds", kinds),
                       ("bill_kinds", set(more.get("bill_kinds", ()))), ("names", set(more.get("names", ())))):
        missing = cache.make_room(kind, keys)
        if missing:
            wanted[kind] = missing
    return wanted


def resolve(connection: Connection, cache: IdCache, wanted: Mapping[str, set]) -> None:
    """Insert the keys of ``wanted`` (``missing_keys``), read their ids into ``cache`` (module docstring). Run it
    in a transaction of its own, committed before the lines' write."""
    for kind, keys in wanted.items():
        # One-column keys are cached by their value, the others by their tuple (what ``line_keys`` gives).
        single = len(_KINDS[kind][2]) == 1
        rows = sorted((key,) for key in keys) if single else sorted(keys)
        found = _resolve_kind(connection, kind, rows)
        if len(found) != len(rows):
            raise LookupError(f"{kind}: {len(rows) - len(found)} keys have no id after inserting them")
        cache.add(kind, {(key[0] if single else key): found[key] for key in rows})


def row_values(cost: CostRecord, label_set: int, cache: IdCache) -> tuple:
    """The ``cost_line_rows`` row of ``cost`` (``ROW_COLUMNS`` order); its ids must be in ``cache``
    (``resolve``)."""
    node, gpu, pod, kind = line_keys(cost)
    return (cost.window_start_unix_ms, label_set, cost.cost_micro_usd, cost.cost_share, cost.memory_share,
            cost.compute_share, cost.gpu_fraction, cache.get("nodes")[node], cache.get("gpus")[gpu],
            cache.get("pods")[pod], cache.get("kinds")[kind])


def gpu_uuids(read, tables: LineIdTables, cache: IdCache, ids: set[int]) -> Mapping[int, str]:
    """The uuids of the GPU ``ids`` (a bill's zero lines name their units by id), from ``cache`` and, for those it
    lacks, one ``SELECT`` through ``read`` (a statement -> rows)."""
    known = cache.gpu_uuids()
    out = {i: known[i] for i in ids if i in known}
    missing = [i for i in ids if i not in out]
    if missing:
        g = tables.gpus.c
        found = {int(i): uuid for i, uuid in read(select(g.gpu_id, g.gpu_uuid).where(g.gpu_id.in_(missing)))}
        if len(found) != len(missing):
            raise LookupError(f"zero lines name GPU ids ledger_gpus lacks: {sorted(set(missing) - set(found))}")
        cache.add_gpu_uuids(found)
        out.update(found)
    return out


def uses_ids(connection: Connection) -> bool:
    """Whether this ledger stores its lines by ids (PostgreSQL from revision 0014)."""
    if connection.dialect.name != "postgresql":
        return False
    return connection.execute(text(f"SELECT to_regclass('{ROWS_TABLE}') IS NOT NULL")).scalar() is True


def trueup_update(tables: LineIdTables):
    """The statement that sets one line's ``trued_cost_micro_usd`` by its text key (bound as ``b_start``,
    ``b_cluster``, ``b_node``, ``b_gpu``, ``b_kind``, ``b_pod``, ``b_shared``; the value ``b_trued``): what
    ``apply_trueup`` writes through, the view being read-only. It finds the line by the (window, node id) index."""
    r, n, g, p, k = tables.rows.c, tables.nodes.c, tables.gpus.c, tables.pods.c, tables.kinds.c
    return (tables.rows.update()
            .where(r.window_start_unix_ms == bindparam("b_start"),
                   r.node_id == select(n.node_id).where(n.cluster == bindparam("b_cluster"),
                                                        n.node_name == bindparam("b_node")).scalar_subquery(),
                   r.gpu_id == select(g.gpu_id).where(g.gpu_uuid == bindparam("b_gpu")).scalar_subquery(),
                   r.kind_id.in_(select(k.kind_id).where(k.subject_kind == bindparam("b_kind"),
                                                         k.shared_from == bindparam("b_shared"))),
                   r.pod_id.in_(select(p.pod_id).where(p.pod_uid == bindparam("b_pod"))))
            .values(trued_cost_micro_usd=bindparam("b_trued")))
