"""PostgreSQL's cost lines packed by node-window (revision 0016): ``cost_line_packs``, the view ``cost_lines``.

From 0014 a PostgreSQL line was a ``cost_line_rows`` row of numbers (``services.billing.line_ids``): 102 bytes of
data, and per row a tuple header (24 bytes), a line pointer (4) and an index entry (~8 more in the (window, node)
index) -- 116.5 bytes a line after ``VACUUM FULL`` (``bench/ledger_month.py``), ~58 lines a node-window. Now a
node-window's stored lines are ONE ``cost_line_packs`` row: its window start and node id, then one PostgreSQL
array per line column, element i of every array being line i:

=========================  ========  =======================================================================
array                      element   what
=========================  ========  =======================================================================
``label_set_id``           int8      the line's label set (``line_storage``)
``cost_micro_usd``         int8      list cost
``trued_cost_micro_usd``   int8      trued-up cost; the whole array NULL while no line of the window is trued
``cost_share``             float8    the four shares and fractions, bit for bit
``memory_share``           float8
``compute_share``          float8
``gpu_fraction``           float8
``gpu_id``                 int4      ``ledger_gpus`` id
``pod_id``                 int4      ``ledger_pods`` id
``kind_id``                int2      ``ledger_line_kinds`` id
=========================  ========  =======================================================================

The lines of a pack are in (gpu id, kind id, pod id) order (unique in a node-window: the line's key), the order
the writer (``pack_rows``) and the migration both use. The row's primary key is (window start, node id); the table
is partitioned by day like ``cost_line_rows`` was, so retention still drops whole days and a time range still
prunes to its days' partitions through the view.

**Why arrays, not ``bytea`` columns.** The view must give every reader 0013's columns by SQL alone: ``unnest`` of
several arrays at once (``unnest(a, b, ...)``, zipped, a NULL array read as NULLs) reads arrays in C; a ``bytea``
of little-endian columns has no cast to ``float8`` in SQL and would need a function per element. Their bytes are
the same but for the arrays' 20-byte headers (~3.5 bytes a line at 58 lines a pack).
The pack (~3.4 KB) is past PostgreSQL's TOAST threshold (~2 KB), so it is compressed (pglz, the default
``EXTENDED`` storage): the repeated ids, label sets and shares of one node-window compress to about half
(measured with ``bench/ledger_month.py``'s fleet: 36.7 bytes a line with the index and TOAST; uncompressed,
``PLAIN``, 72.0).

**The view** ``cost_lines`` gives 0013's (and 0014's) columns, names, types and values: ``VIEW_SELECT``, a
``LATERAL unnest`` of the pack joined to the dictionaries. A range of window starts on the view is a range on
``cost_line_packs.window_start_unix_ms``: the planner prunes the partitions.

**True-up** rewrites the pack's ``trued_cost_micro_usd`` array (``trued_array``), one ``UPDATE`` per node-window
whose trued-up lines change, rather than keeping trued-up costs in a side table: a true-up gives a value to every
line of each window it trues up (``apply_trueup``), so a side table would hold one row per line again -- the
per-row bytes this layout removes -- for every trued month, and every reader of ``cost_lines`` would join it. The
array is written whole (a NULL array: no line trued), in the true-up's one transaction.
"""

from __future__ import annotations

import struct
from typing import Iterable, Mapping, Sequence

import numpy as np

from sqlalchemy import BigInteger, Column, Double, Integer, MetaData, PrimaryKeyConstraint, SmallInteger, Table, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

PACKS_TABLE = "cost_line_packs"

# The packed columns: (name, element type), in the row's order after (window start, node id).
PACK_ARRAYS = (
    ("label_set_id", BigInteger), ("cost_micro_usd", BigInteger), ("trued_cost_micro_usd", BigInteger),
    ("cost_share", Double), ("memory_share", Double), ("compute_share", Double), ("gpu_fraction", Double),
    ("gpu_id", Integer), ("pod_id", Integer), ("kind_id", SmallInteger),
)
# Their SQL element types, for the migration's DDL.
PACK_SQL_TYPES = {"label_set_id": "bigint", "cost_micro_usd": "bigint", "trued_cost_micro_usd": "bigint",
                  "cost_share": "double precision", "memory_share": "double precision",
                  "compute_share": "double precision", "gpu_fraction": "double precision", "gpu_id": "integer",
                  "pod_id": "integer", "kind_id": "smallint"}
# What a write fills, in ``pack_rows``' order (``trued_cost_micro_usd`` starts NULL).
PACK_COLUMNS = ("window_start_unix_ms", "node_id", "label_set_id", "cost_micro_usd", "cost_share", "memory_share",
                "compute_share", "gpu_fraction", "gpu_id", "pod_id", "kind_id")
# ``line_ids.ROW_COLUMNS``' positions of the packed values, in ``PACK_COLUMNS[2:]``'s order.
_ROW_INDEX = {"window_start_unix_ms": 0, "label_set_id": 1, "cost_micro_usd": 2, "cost_share": 3,
              "memory_share": 4, "compute_share": 5, "gpu_fraction": 6, "node_id": 7, "gpu_id": 8, "pod_id": 9,
              "kind_id": 10}
_PACKED = tuple(_ROW_INDEX[name] for name in PACK_COLUMNS[2:])

_NAMES = ", ".join(name for name, _type in PACK_ARRAYS)
# The view: 0013's columns in 0013's order (so ``SELECT *`` reads the same), each its old type.
VIEW_SELECT = (
    "SELECT p.window_start_unix_ms, n.cluster, n.node_name, g.gpu_uuid, k.subject_kind, d.pod_uid, "
    "k.window_seconds, "
    "CAST(CASE WHEN d.absent & 1 = 0 THEN d.namespace END AS varchar(253)) AS namespace, "
    "CAST(CASE WHEN d.absent & 2 = 0 THEN d.pod_name END AS varchar(253)) AS pod_name, "
    "u.label_set_id, u.cost_share, u.cost_micro_usd, u.trued_cost_micro_usd, "
    "k.shared_from, k.sharing_method, k.method, k.cost_basis, u.memory_share, u.compute_share, u.gpu_fraction "
    "FROM cost_line_packs p "
    f"CROSS JOIN LATERAL unnest({', '.join(f'p.{name}' for name, _type in PACK_ARRAYS)}) AS u ({_NAMES}) "
    "JOIN ledger_nodes n ON n.node_id = p.node_id "
    "JOIN ledger_gpus g ON g.gpu_id = u.gpu_id "
    "JOIN ledger_pods d ON d.pod_id = u.pod_id "
    "JOIN ledger_line_kinds k ON k.kind_id = u.kind_id"
)


def define_table(metadata: MetaData, only_on: str) -> Table:
    """Add ``cost_line_packs`` to the ledger's ``metadata``, marked ``{only_on: "postgresql"}``."""
    return Table(
        PACKS_TABLE, metadata,
        Column("window_start_unix_ms", BigInteger, nullable=False),
        Column("node_id", Integer, nullable=False),
        *(Column(name, ARRAY(element), nullable=name == "trued_cost_micro_usd") for name, element in PACK_ARRAYS),
        PrimaryKeyConstraint("window_start_unix_ms", "node_id"),
        info={only_on: "postgresql"})


# -- pure ----------------------------------------------------------------------------------------------------------


def pack_rows(rows: Iterable[Sequence]) -> list[tuple]:
    """The ``cost_line_packs`` rows (``PACK_COLUMNS`` order) of lines given as ``line_ids.row_values`` tuples:
    one per (window start, node id), its lines in (gpu id, kind id, pod id) order, in (window start, node id)
    order. ``ValueError`` when two lines of a node-window have the same (gpu, kind, pod) ids (one line twice)."""
    windows: dict[tuple[int, int], list[Sequence]] = {}
    for row in rows:
        windows.setdefault((row[0], row[7]), []).append(row)
    out = []
    for (start, node), lines in sorted(windows.items()):
        lines.sort(key=lambda r: (r[8], r[10], r[9]))
        for before, after in zip(lines, lines[1:]):
            if (before[8], before[10], before[9]) == (after[8], after[10], after[9]):
                raise ValueError(f"two lines of the node-window ({start}, node id {node}) with the same gpu, kind "
                                 "and pod ids")
        out.append((start, node, *([r[i] for r in lines] for i in _PACKED)))
    return out


# PostgreSQL's binary COPY: the signature, flags and header extension; each row's field count; the end.
COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
COPY_TRAILER = struct.pack(">h", -1)
# Each packed column's element: (type oid, numpy dtype of (length, value) big-endian), ``PACK_COLUMNS[2:]`` order.
_INT8, _INT4, _INT2, _FLOAT8 = ((20, np.dtype([("n", ">i4"), ("v", ">i8")])),
                                (23, np.dtype([("n", ">i4"), ("v", ">i4")])),
                                (21, np.dtype([("n", ">i4"), ("v", ">i2")])),
                                (701, np.dtype([("n", ">i4"), ("v", ">f8")])))
_ELEMENTS = (_INT8, _INT8, _FLOAT8, _FLOAT8, _FLOAT8, _FLOAT8, _INT4, _INT4, _INT2)
_ROW_HEAD = struct.Struct(">hiqii")  # field count; window start (length 8, int8); node id (length 4, int4)


def copy_payload(packs: Sequence[tuple]) -> bytes:
    """``packs`` (``pack_rows``' rows, non-empty arrays without NULLs) as one binary ``COPY`` of ``PACK_COLUMNS``,
    signature to trailer: the bytes psycopg's ``write_row`` sends for them, built a column at a time with numpy
    (psycopg dumps a list element by element in Python: ~0.5 ms a node-window, an eighth of ingest's budget)."""
    out = [COPY_SIGNATURE]
    for pack in packs:
        start, node, *columns = pack
        out.append(_ROW_HEAD.pack(len(PACK_COLUMNS), 8, start, 4, node))
        for values, (oid, dtype) in zip(columns, _ELEMENTS):
            count = len(values)
            elements = np.empty(count, dtype)
            elements["n"] = dtype["v"].itemsize
            elements["v"] = values
            body = elements.tobytes()
            # The array: its length, then one dimension, no NULL, element type, [count] from 1, the elements.
            out.append(struct.pack(">iiiiii", 20 + len(body), 1, 0, oid, count, 1))
            out.append(body)
    out.append(COPY_TRAILER)
    return b"".join(out)


LineKey = tuple[str, str, str, str]  # (gpu uuid or '', subject kind, pod uid or '', shared from or '')


def trued_array(current: Sequence[int | None] | None, keys: Sequence[LineKey],
                wanted: Mapping[LineKey, int | None]) -> list[int | None] | None:
    """A pack's new ``trued_cost_micro_usd``: ``current`` (None: no line trued) with the line at each position
    whose key (``keys``, the pack's order) is in ``wanted`` set to its value; None when no line is trued then.
    ``KeyError`` when ``wanted`` names a line the pack lacks."""
    values = list(current) if current is not None else [None] * len(keys)
    if len(values) != len(keys):
        raise ValueError(f"a pack of {len(keys)} lines with {len(values)} trued-up costs")
    position = {key: index for index, key in enumerate(keys)}
    for key, value in wanted.items():
        values[position[key]] = value
    return None if all(value is None for value in values) else values


# -- SQL (PostgreSQL) ----------------------------------------------------------------------------------------------


def uses_packs(connection: Connection) -> bool:
    """Whether this ledger packs its lines by node-window (PostgreSQL from revision 0016)."""
    if connection.dialect.name != "postgresql":
        return False
    return connection.execute(text(f"SELECT to_regclass('{PACKS_TABLE}') IS NOT NULL")).scalar() is True


_PACK_LINES = text(
    "SELECT w.s, w.c, w.n, p.node_id, p.trued_cost_micro_usd, u.ord, g.gpu_uuid, k.subject_kind, d.pod_uid, "
    "k.shared_from "
    "FROM unnest(CAST(:starts AS bigint[]), CAST(:clusters AS text[]), CAST(:nodes AS text[])) AS w (s, c, n) "
    "JOIN ledger_nodes ln ON ln.cluster = w.c AND ln.node_name = w.n "
    "JOIN cost_line_packs p ON p.window_start_unix_ms = w.s AND p.node_id = ln.node_id "
    "AND p.window_start_unix_ms >= :lo AND p.window_start_unix_ms <= :hi "
    "CROSS JOIN LATERAL unnest(p.gpu_id, p.kind_id, p.pod_id) WITH ORDINALITY AS u (gpu_id, kind_id, pod_id, ord) "
    "JOIN ledger_gpus g ON g.gpu_id = u.gpu_id JOIN ledger_pods d ON d.pod_id = u.pod_id "
    "JOIN ledger_line_kinds k ON k.kind_id = u.kind_id "
    "ORDER BY w.s, w.c, w.n, u.ord")
_SET_TRUED = text("UPDATE cost_line_packs SET trued_cost_micro_usd = CAST(:trued AS bigint[]) "
                  "WHERE window_start_unix_ms = :start AND node_id = :node")


def write_trued(connection: Connection, updates: Sequence[Mapping]) -> int:
    """Set the trued-up costs of ``updates`` (``apply_trueup``'s: ``b_start``, ``b_cluster``, ``b_node``,
    ``b_gpu``, ``b_kind``, ``b_pod``, ``b_shared``, ``b_trued``), one pack ``UPDATE`` per node-window; returns the
    packs updated. ``LookupError`` when a line is in no pack."""
    by_window: dict[tuple[int, str, str], dict[LineKey, int | None]] = {}
    for u in updates:
        by_window.setdefault((u["b_start"], u["b_cluster"], u["b_node"]), {})[
            (u["b_gpu"], u["b_kind"], u["b_pod"], u["b_shared"])] = u["b_trued"]
    if not by_window:
        return 0
    windows = sorted(by_window)
    packs: dict[tuple[int, str, str], tuple[int, list | None, list[LineKey]]] = {}
    for start, cluster, node, node_id, trued, _ord, gpu, kind, pod, shared in connection.execute(_PACK_LINES, {
            "starts": [w[0] for w in windows], "clusters": [w[1] for w in windows], "nodes": [w[2] for w in windows],
            "lo": windows[0][0], "hi": windows[-1][0]}):
        packs.setdefault((start, cluster, node), (node_id, trued, []))[2].append((gpu, kind, pod, shared))
    sets = []
    for window, wanted in by_window.items():
        if window not in packs:
            raise LookupError(f"the true-up names lines of the node-window {window}, which has no packed lines")
        node_id, current, keys = packs[window]
        try:
            sets.append({"start": window[0], "node": node_id, "trued": trued_array(current, keys, wanted)})
        except KeyError as exc:
            raise LookupError(f"the true-up names the line {exc} of {window}, not in its pack") from exc
    connection.execute(_SET_TRUED, sets)
    return len(sets)
