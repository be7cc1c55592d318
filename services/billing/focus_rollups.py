"""The hourly FOCUS grain: per UTC hour, each node's origin charge and the per-pod, per-GPU sums of its cost lines,
from which ``services.billing.focus.focus_hour_columns`` builds one FOCUS row per (hour, origin charge, pod or kept
bucket) without reading the minute lines.

**Origin charges** (``focus_charge_hourly``): one row per (UTC hour, cluster, node, provider id, zone, price
version, sharing policy, window length, provider, region, instance type, price model) -- every dimension an
allocated charge shares with its origin (FOCUS 1.3) -- summing the node bills whose window *starts* in the hour:
``node_windows``, ``billed_milliseconds``, ``node_cost_micro_usd`` (list), ``billed_micro_usd`` (``COALESCE(trued,
list)``) and ``trued_windows``. Normally one per node-hour; a node whose price version, policy or instance changed
within the hour has one per pricing (each its own origin charge, as each of its minute bills is).

**Allocated lines** (``focus_line_hourly``): one row per (hour, the origin charge's link -- cluster, node, provider
id, zone, price version, sharing policy, window length -- and the line's identity within a node-window: subject
kind, pod uid, GPU uuid, bucket shared -- with what a FOCUS element says of it: sharing method, attribution method,
cost basis, namespace, pod name, label set), summing the cost lines (zero lines included: they are elements of
their bucket's row) of the node-windows starting in the hour:

* ``cost_micro_usd`` (list), ``billed_micro_usd`` (trued-up or list), ``cost_lines``, ``trued_lines``: exact
  integers;
* ``billed_ms``: the billed milliseconds of the lines' bills (one per line): how long the element was there;
* ``cost_share_ms``, ``memory_share_ms``, ``compute_share_ms``: Σ share × the bill's billed milliseconds; and
  ``gpu_ms``: Σ cost share × GPU fraction × billed milliseconds (the GPU time a minute row's ``UsageQuantity`` and
  ``x_GpuHours`` are, in ms). Floats (the shares are): GPU-hours to 1e-9.

Labels are the line's ``label_sets`` id (content-addressed, never deleted: ``services.billing.line_storage``), so a
row holds a pod's labels without repeating them.

**Maintained as bills land**, as the other rollups (``services.billing.rollups``): ``Ledger.write`` calls
``add_written`` in its transaction with exactly the bills its insert created and all their lines (a redelivery adds
nothing, a failed write nothing); ``apply_trueup`` calls ``add_trued`` with every bill and line whose trued-up
cost it changed. Upserts in key order. On PostgreSQL both tables are partitioned by UTC day
(``services.billing.partitions``), and retention drops them with the hourly rollups (``hourly_rollups_days``).
Migration ``0015_focus_hourly`` creates and backfills them from the minute lines there are; where retention had
already dropped minute lines, a ``ledger_retention`` row ``focus_rollups`` records from when they hold.

**PostgreSQL stores the lines by ids** (migration ``0017_focus_line_ids``): in ``focus_line_hourly_rows``, of
numbers only (``ID_LINE_COLUMNS``: the 8-byte columns first, then the 4-byte ones, then the 2-byte kind, so no
padding lies between them) -- its origin charge by ``focus_charge_hourly.charge_id`` (a sequence), its GPU, pod
and line kind by the ids of revision 0014's dictionaries (``ledger_gpus``, ``ledger_pods``, ``ledger_line_kinds``,
``services.billing.line_ids``: ``Ledger.write`` resolves them, zero lines' kinds included, before its
transaction) -- and its one index is the primary key the upserts need. Its pod is the dictionary row of
``focus_pod_key`` (an empty namespace or pod name is the absent one: the hourly key never told '' from NULL). The
writers give the same text keys as on SQLite; the upsert maps them to ids in Python, from the writer's id cache
and, for what it lacks, the dictionaries, and sends the rows of numbers by binary ``COPY`` (``_upsert_lines_by_ids``);
``focus_line_hourly`` is a view with the text layout's columns over them (what ``rows_of`` reads), and the export
joins the ids back itself (``line_select``), so every reader gets the same ``LINE_DIMENSIONS`` rows.
SQLite keeps the text columns (its ledger is small).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Callable, Iterable, Mapping

from sqlalchemy import (
    BigInteger,
    Column,
    Double,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    and_,
    func,
    select,
    text,
)
from sqlalchemy.engine import Connection

from schemas.records import CostRecord
from services.billing import line_ids
from services.billing.bulk_rows import BulkInsert, add_sums
from services.billing.costing import NodeWindowKey
from services.billing.line_ids import NAMESPACE_ABSENT, POD_NAME_ABSENT, IdCache
from services.billing.line_storage import label_set_id
from services.billing.rollups import HOUR_MS, KIND_TEXT, TruedChange, add_into

CHARGE_TABLE = "focus_charge_hourly"
LINE_TABLE = "focus_line_hourly"
# The origin charge a line belongs to (in both tables, in this order).
LINK = ("period_start_unix_ms", "cluster", "node_name", "provider_id", "zone", "price_version", "sharing",
        "window_seconds")
CHARGE_DIMENSIONS = (*LINK, "provider", "region", "instance_type", "price_model")
CHARGE_MEASURES = ("node_windows", "billed_milliseconds", "node_cost_micro_usd", "billed_micro_usd",
                   "trued_windows")
LINE_DIMENSIONS = (*LINK, "subject_kind", "pod_uid", "gpu_uuid", "shared_from", "sharing_method", "method",
                   "cost_basis", "namespace", "pod_name", "label_set_id")
LINE_MEASURES = ("cost_micro_usd", "billed_micro_usd", "cost_lines", "trued_lines", "billed_ms", "cost_share_ms",
                 "memory_share_ms", "compute_share_ms", "gpu_ms")
# A ``ledger_retention`` row: the oldest hour these rollups hold (migration 0015 could only sum the minute lines
# retention had kept); absent: every hour the ledger has.
FOCUS_ROLLUPS_FROM = "focus_rollups"


def _link_columns() -> list[Column]:
    return [
        Column("period_start_unix_ms", BigInteger, nullable=False),
        Column("cluster", String(253), nullable=False),
        Column("node_name", String(253), nullable=False),
        Column("provider_id", String(512), nullable=False),
        Column("zone", String(64), nullable=False),
        Column("price_version", String(255), nullable=False),
        Column("sharing", String(255), nullable=False),
        Column("window_seconds", Integer, nullable=False),
    ]


def charge_columns() -> list[Column]:
    """``focus_charge_hourly``'s columns (migration 0015 freezes the same list)."""
    return [*_link_columns(),
            Column("provider", String(64), nullable=False),
            Column("region", String(64), nullable=False),
            Column("instance_type", String(128), nullable=False),
            Column("price_model", String(16), nullable=False),
            *(Column(name, BigInteger, nullable=False) for name in CHARGE_MEASURES)]


def line_columns() -> list[Column]:
    """``focus_line_hourly``'s columns (migration 0015 freezes the same list)."""
    return [*_link_columns(),
            Column("subject_kind", String(16), nullable=False),
            Column("pod_uid", String(128), nullable=False),
            Column("gpu_uuid", String(128), nullable=False),
            Column("shared_from", String(16), nullable=False),
            Column("sharing_method", String(16), nullable=False),
            Column("method", String(32), nullable=False),
            Column("cost_basis", String(32), nullable=False),
            Column("namespace", String(253), nullable=False),
            Column("pod_name", String(253), nullable=False),
            Column("label_set_id", BigInteger, nullable=False),
            *(Column(name, BigInteger, nullable=False) for name in LINE_MEASURES[:5]),
            *(Column(name, Double, nullable=False) for name in LINE_MEASURES[5:])]


# PostgreSQL from 0017: the lines by ids in ``ROWS_TABLE``, in this column order (``id_line_columns``), keyed by
# ``ID_LINE_KEY`` (its one index); ``focus_line_hourly`` is a view of the text columns over it;
# ``focus_charge_hourly.charge_id`` (from a sequence) names an origin charge.
ROWS_TABLE = "focus_line_hourly_rows"
ID_LINE_KEY = ("period_start_unix_ms", "charge_id", "label_set_id", "pod_id", "gpu_id", "kind_id")
ID_LINE_COLUMNS = ("period_start_unix_ms", "charge_id", "label_set_id", "cost_micro_usd", "billed_micro_usd",
                   "cost_share_ms", "memory_share_ms", "compute_share_ms", "gpu_ms", "billed_ms", "cost_lines",
                   "trued_lines", "gpu_id", "pod_id", "kind_id")
CHARGE_ID_SEQUENCE = "focus_charge_hourly_charge_id_seq"
# The dictionary columns a line's text key resolves through (``ledger_line_kinds`` also has ``window_seconds``).
_KIND_COLUMNS = ("subject_kind", "shared_from", "sharing_method", "method", "cost_basis")


def id_line_columns() -> list[Column]:
    """PostgreSQL's ``focus_line_hourly_rows`` columns (migration 0017 freezes the same DDL): 8-byte, then 4-byte,
    then the 2-byte kind."""
    return [*(Column(name, BigInteger, nullable=False) for name in ID_LINE_COLUMNS[:5]),
            *(Column(name, Double, nullable=False) for name in ID_LINE_COLUMNS[5:9]),
            *(Column(name, Integer, nullable=False) for name in ID_LINE_COLUMNS[9:14]),
            Column("kind_id", SmallInteger, nullable=False)]


@dataclass(frozen=True)
class FocusRollupTables:
    charges: Table
    # SQLite's table; on PostgreSQL from 0017 a view of the same columns over ``rows``.
    lines: Table
    rows: Table


def define_tables(metadata: MetaData, only_on: str) -> FocusRollupTables:
    """Add the tables (created by migrations 0015 and 0016) to the ledger's ``metadata``: ``only_on`` marks those of
    one dialect (``rows`` and the charges' ``charge_id``: PostgreSQL's; the text ``lines``: SQLite's table)."""
    return FocusRollupTables(
        Table(CHARGE_TABLE, metadata, *charge_columns(),
              Column("charge_id", BigInteger, nullable=False, info={only_on: "postgresql"}),
              PrimaryKeyConstraint(*CHARGE_DIMENSIONS)),
        Table(LINE_TABLE, metadata, *line_columns(), PrimaryKeyConstraint(*LINE_DIMENSIONS),
              info={only_on: "sqlite"}),
        Table(ROWS_TABLE, metadata, *id_line_columns(), PrimaryKeyConstraint(*ID_LINE_KEY),
              info={only_on: "postgresql"}))


def focus_pod_key(pod_uid: str, namespace: str, pod_name: str) -> tuple[str, str, str, int]:
    """The ``ledger_pods`` key a hourly line's pod (its text key's uid, namespace, pod name) is stored by: an
    empty namespace or pod name is the absent one (``line_ids.pod_key``'s bits), so every real line's pod -- a
    Kubernetes pod has a namespace and a name, a bucket neither -- is the row its minute lines use."""
    return (pod_uid, namespace, pod_name,
            (NAMESPACE_ABSENT if namespace == "" else 0) | (POD_NAME_ABSENT if pod_name == "" else 0))


# -- pure: rows --------------------------------------------------------------------------------------------------


def link_of(bill: Mapping[str, Any]) -> tuple:
    """The ``LINK`` of a bill's columns (a ``node_bills`` row or the ledger's ``_bill_row``)."""
    start = int(bill["window_start_unix_ms"])
    return (start - start % HOUR_MS, bill["cluster"], bill["node_name"], bill.get("provider_id") or "",
            bill.get("zone") or "", bill["price_version"], bill["sharing"], int(bill["window_seconds"]))


def charge_key(bill: Mapping[str, Any]) -> tuple:
    """The ``CHARGE_DIMENSIONS`` of a bill's columns."""
    return (*link_of(bill), bill["provider"], bill["region"], bill["instance_type"], bill["price_model"])


def line_key(link: tuple, cost: CostRecord, label_set: int) -> tuple:
    """The ``LINE_DIMENSIONS`` of a line of a bill whose link is ``link``."""
    return (*link, KIND_TEXT[cost.subject_kind], cost.pod_uid or "", cost.gpu_uuid or "",
            KIND_TEXT[cost.shared_from], cost.sharing_method, cost.method, cost.cost_basis, cost.namespace or "",
            cost.pod_name or "", label_set)


def _label_set_of(cost: CostRecord) -> int:
    return label_set_id(cost.labels, cost.carried_label_keys)


def written_rows(bill_rows: Iterable[Mapping[str, Any]], costs: Iterable[CostRecord], *,
                 label_set: Callable[[CostRecord], int] = _label_set_of) -> tuple[dict, dict]:
    """(charge rows, line rows) that newly written bills (their columns; not trued up) and all their lines add:
    key -> measures. ``label_set``: a line's ``label_sets`` id (the ledger passes its cached one). Pure."""
    charges: dict[tuple, list] = {}
    links: dict[tuple[int, str, str], tuple[tuple, int]] = {}
    for bill in bill_rows:
        cost = int(bill["node_cost_micro_usd"])
        billed_ms = int(bill["billed_milliseconds"])
        add_into(charges, charge_key(bill), (1, billed_ms, cost, cost, 0))
        links[(int(bill["window_start_unix_ms"]), bill["cluster"], bill["node_name"])] = (link_of(bill), billed_ms)
    lines: dict[tuple, list] = {}
    for cost in costs:
        link, billed_ms = links[(cost.window_start_unix_ms, cost.cluster, cost.node_name)]
        micro = cost.cost_micro_usd
        share_ms = cost.cost_share * billed_ms
        add_into(lines, line_key(link, cost, label_set(cost)),
                 (micro, micro, 1, 0, billed_ms, share_ms, cost.memory_share * billed_ms,
                  cost.compute_share * billed_ms, share_ms * cost.gpu_fraction))
    return charges, lines


def trued_rows(bill_changes: Iterable[Any], line_changes: Iterable[TruedChange],
               bills: Mapping[NodeWindowKey, Mapping[str, Any]]) -> tuple[dict, dict]:
    """(charge rows, line rows) that a true-up moves: the difference of ``COALESCE(trued, list)`` and of the trued
    counts. ``bill_changes``: ``read_rollups.BillTruedChange``s (their ``bill`` columns with ``provider_id``);
    ``line_changes``: ``rollups.TruedChange``s, whose bills' columns ``bills`` holds by node-window. Pure."""
    charges: dict[tuple, list] = {}
    for change in bill_changes:
        listed = int(change.bill["node_cost_micro_usd"])
        billed = ((listed if change.after is None else change.after)
                  - (listed if change.before is None else change.before))
        trued = (change.after is not None) - (change.before is not None)
        if billed or trued:
            add_into(charges, charge_key(change.bill), (0, 0, 0, billed, trued))
    lines: dict[tuple, list] = {}
    for change in line_changes:
        cost = change.cost
        listed = cost.cost_micro_usd
        billed = ((listed if change.after is None else change.after)
                  - (listed if change.before is None else change.before))
        trued = (change.after is not None) - (change.before is not None)
        if not billed and not trued:
            continue
        bill = bills[NodeWindowKey(cost.cluster, cost.node_name, cost.window_start_unix_ms)]
        add_into(lines, line_key(link_of(bill), cost, _label_set_of(cost)), (0, billed, 0, trued, 0, 0.0, 0.0, 0.0, 0.0))
    return ({k: v for k, v in charges.items() if any(v)}, {k: v for k, v in lines.items() if any(v)})


# -- SQL: maintaining --------------------------------------------------------------------------------------------


def _upsert(connection: Connection, tables: FocusRollupTables, charges: Mapping[tuple, list],
            lines: Mapping[tuple, list], ids: IdCache | None = None) -> int:
    out = 0
    if charges:
        if connection.dialect.name == "postgresql":
            out += _upsert_charges_by_ids(connection, charges)
        else:
            out += add_sums(connection, tables.charges, CHARGE_DIMENSIONS, CHARGE_MEASURES,
                            [(*key, *values) for key, values in charges.items()])
    if lines:
        if connection.dialect.name == "postgresql":
            out += _upsert_lines_by_ids(connection, tables, lines, ids)
        else:
            out += add_sums(connection, tables.lines, LINE_DIMENSIONS, LINE_MEASURES,
                            [(*key, *values) for key, values in lines.items()])
    return out


_LINK_WIDTH = len(LINK)
_CHARGE_TYPES = ("bigint", *("text",) * 6, "int4", *("text",) * 4, *("bigint",) * 5)
# A new charge's id from the sequence (drawn for every row offered, kept only by a new one: a bigint lasts).
_UPSERT_CHARGES = (
    f"INSERT INTO {CHARGE_TABLE} AS t ({', '.join((*CHARGE_DIMENSIONS, *CHARGE_MEASURES))}, charge_id) "
    f"SELECT k.*, nextval('{CHARGE_ID_SEQUENCE}') FROM unnest("
    + ", ".join(f"CAST(:c{index} AS {sql}[])" for index, sql in enumerate(_CHARGE_TYPES)) + ") AS k ("
    + ", ".join((*CHARGE_DIMENSIONS, *CHARGE_MEASURES)) + f") ORDER BY {', '.join(CHARGE_DIMENSIONS)} "
    f"ON CONFLICT ({', '.join(CHARGE_DIMENSIONS)}) DO UPDATE SET "
    + ", ".join(f"{name} = t.{name} + excluded.{name}" for name in CHARGE_MEASURES))
# The origin charge of each link: the least ``charge_id`` of the charges sharing the link (a node-hour priced two
# ways under one price version has two charges; its lines name the first), as 0017's migration numbered them.
_LINK_CHARGE_IDS = (
    "SELECT " + ", ".join(f"k.{name}" for name in LINK) + ", (SELECT min(c.charge_id) FROM "
    f"{CHARGE_TABLE} c WHERE " + " AND ".join(f"c.{name} = k.{name}" for name in LINK) + ") FROM unnest("
    + ", ".join(f"CAST(:l{index} AS {sql}[])" for index, sql in enumerate(_CHARGE_TYPES[:_LINK_WIDTH]))
    + ") AS k (" + ", ".join(LINK) + ")")


def _upsert_charges_by_ids(connection: Connection, charges: Mapping[tuple, list]) -> int:
    """Add ``charges`` (key -> measures) into PostgreSQL's ``focus_charge_hourly`` (from 0017), a new one with its
    ``charge_id`` (``bulk_rows``' staging table would copy a sequence default: it has none)."""
    rows = [(*key, *values) for key, values in charges.items()]
    connection.execute(text(_UPSERT_CHARGES), {f"c{index}": list(column) for index, column in enumerate(zip(*rows))})
    return len(rows)


def charge_ids(connection: Connection, links: Iterable[tuple]) -> dict[tuple, int]:
    """The origin ``charge_id`` of each of ``links`` (``LINK`` tuples) in PostgreSQL's ``focus_charge_hourly``
    (``_LINK_CHARGE_IDS``), read in ``connection``'s transaction; a link without a charge is left out."""
    links = sorted(set(links))
    if not links:
        return {}
    params = {f"l{index}": list(column) for index, column in enumerate(zip(*links))}
    found = connection.execute(text(_LINK_CHARGE_IDS), params)
    return {tuple(row[:_LINK_WIDTH]): int(row[_LINK_WIDTH]) for row in found if row[_LINK_WIDTH] is not None}


# Positions in a ``LINE_DIMENSIONS`` key of what a line's dictionary ids are found by (``line_ids.line_keys``).
_KIND_AT = (8, 11, 12, 13, 14, 7)  # subject kind, shared from, sharing method, method, cost basis, window seconds
_KIND_OF = itemgetter(*_KIND_AT)
_POD_UID, _GPU, _NAMESPACE, _POD_NAME, _LABEL_SET = 9, 10, 15, 16, 17
_ROW_UPSERTS: dict[int, BulkInsert] = {}


def id_rows(lines: Mapping[tuple, list], charges: Mapping[tuple, int], gpus: Mapping[str, int],
            pods: Mapping[tuple, int], kinds: Mapping[tuple, int]) -> list[tuple]:
    """``lines`` (``LINE_DIMENSIONS`` key -> ``LINE_MEASURES``) as ``focus_line_hourly_rows`` rows
    (``ID_LINE_COLUMNS`` order), their link, GPU, pod (``focus_pod_key``) and kind looked up in the maps given.
    ``LookupError`` naming how many lines have no id in them. Pure."""
    out = []
    unknown = 0
    kind_of = _KIND_OF
    for key, v in lines.items():
        try:
            out.append((key[0], charges[key[:_LINK_WIDTH]], key[_LABEL_SET], v[0], v[1], v[5], v[6], v[7], v[8], v[4],
                        v[2], v[3], gpus[key[_GPU]], pods[focus_pod_key(key[_POD_UID], key[_NAMESPACE],
                                                                        key[_POD_NAME])],
                        kinds[kind_of(key)]))
        except KeyError:
            unknown += 1
    if unknown:
        raise LookupError(f"{unknown} of {len(lines)} hourly FOCUS lines have no GPU, pod or kind id in the "
                          "ledger's dictionaries")
    return out


def _upsert_lines_by_ids(connection: Connection, tables: FocusRollupTables, lines: Mapping[tuple, list],
                         ids: IdCache | None) -> int:
    """Add ``lines`` (text key -> measures) into PostgreSQL's ``focus_line_hourly`` by ids: the keys mapped to
    their origin charge's ``charge_id`` (upserted before, in the same transaction: one ``SELECT`` per write for
    its links) and the dictionaries' ids -- from ``ids``, the writer's cache (``Ledger.write`` resolved every
    key of its lines before its transaction), those it lacks read from the dictionaries -- in Python, then the
    rows of numbers by ``bulk_rows``' binary ``COPY`` and one ``INSERT ... SELECT ... ON CONFLICT DO UPDATE`` in
    key order. Until 2026-12-05 the text keys went as 28 array parameters into one ``INSERT ... SELECT FROM
    unnest(...)`` joined to the dictionaries: psycopg dumped the arrays element by element in Python (~2 ms of
    client CPU per node-window, 82 lines each) and the join cost the server ~1.3 ms (docs/billing.md).
    ``LookupError`` when a key has no ids (nothing of it is then added: the caller's transaction fails)."""
    links = charge_ids(connection, {key[:_LINK_WIDTH] for key in lines})
    maps = [ids.get(kind) if ids is not None else {} for kind in ("gpus", "pods", "kinds")]
    try:
        rows = id_rows(lines, links, *maps)
    except LookupError:
        # Keys the cache lacks (a true-up's lines; a cache emptied for room): read from the dictionaries, and
        # refused when they are not there either.
        maps = [{**known, **line_ids.find_ids(connection, kind, {key for key in wanted if key not in known})}
                for known, (kind, wanted) in zip(maps, (
                    ("gpus", {key[_GPU] for key in lines}),
                    ("pods", {focus_pod_key(key[_POD_UID], key[_NAMESPACE], key[_POD_NAME]) for key in lines}),
                    ("kinds", {_KIND_OF(key) for key in lines})))]
        rows = id_rows(lines, links, *maps)
    upsert = _ROW_UPSERTS.get(id(tables.rows))
    if upsert is None or upsert.table is not tables.rows:
        upsert = _ROW_UPSERTS[id(tables.rows)] = BulkInsert(tables.rows, ID_LINE_COLUMNS, conflict=ID_LINE_KEY,
                                                            add=ID_LINE_COLUMNS[3:12])
    upsert.execute(connection, rows)
    return len(rows)


def add_written(connection: Connection, tables: FocusRollupTables, bill_rows: Iterable[Mapping[str, Any]],
                costs: Iterable[CostRecord], *, label_set: Callable[[CostRecord], int] = _label_set_of,
                ids: IdCache | None = None) -> int:
    """``Ledger.write``'s hook: the bills its insert created (their columns) and every line of them. ``ids``: the
    writer's dictionary ids (PostgreSQL), which it resolved for these lines."""
    return _upsert(connection, tables, *written_rows(bill_rows, costs, label_set=label_set), ids=ids)


def add_trued(connection: Connection, tables: FocusRollupTables, bill_changes: Iterable[Any],
              line_changes: Iterable[TruedChange], bills: Mapping[NodeWindowKey, Mapping[str, Any]]) -> int:
    """``Ledger.apply_trueup``'s hook (``trued_rows``)."""
    return _upsert(connection, tables, *trued_rows(bill_changes, line_changes, bills))


# -- SQL: reading ------------------------------------------------------------------------------------------------


def kept_from(read: Callable[[Any], list], retention: Table) -> int | None:
    """The oldest hour these rollups hold: the later of the hourly grain's retention horizon and the backfill's
    ``focus_rollups`` row; None when both are absent (every hour)."""
    kept = dict(read(select(retention.c.grain, retention.c.kept_from_unix_ms)
                     .where(retention.c.grain.in_(("hour", FOCUS_ROLLUPS_FROM)))))
    values = [int(v) for v in kept.values()]
    return max(values) if values else None


def _range(table: Table, start_ms: int, end_ms: int, cluster: str | None) -> list:
    conditions = [table.c.period_start_unix_ms >= start_ms, table.c.period_start_unix_ms < end_ms]
    if cluster is not None:
        conditions.append(table.c.cluster == cluster)
    return conditions


def window_totals(read: Callable[[Any], list], tables: FocusRollupTables, start_ms: int, end_ms: int,
                  cluster: str | None) -> tuple[int, int]:
    """(node-windows, list micro-USD) of the origin charges of the hours in [start_ms, end_ms)."""
    t = tables.charges
    (windows, micro), = read(select(func.coalesce(func.sum(t.c.node_windows), 0),
                                    func.coalesce(func.sum(t.c.node_cost_micro_usd), 0))
                             .where(*_range(t, start_ms, end_ms, cluster)))
    return int(windows), int(micro)


def charges_of(read: Callable[[Any], list], tables: FocusRollupTables, start_ms: int, end_ms: int,
               cluster: str | None, *, with_ids: bool = False) -> list[tuple]:
    """The origin charges of the hours in [start_ms, end_ms), as tuples (``CHARGE_DIMENSIONS``, then
    ``CHARGE_MEASURES``, then -- ``with_ids``, PostgreSQL's ledger from 0017 -- the ``charge_id``)."""
    t = tables.charges
    names = (*CHARGE_DIMENSIONS, *CHARGE_MEASURES)
    columns = [*(t.c[n] for n in names), *([t.c.charge_id] if with_ids else [])]
    return [tuple(row) for row in read(select(*columns).where(*_range(t, start_ms, end_ms, cluster)))]


_GPUS = Table("ledger_gpus", MetaData(), Column("gpu_id", Integer), Column("gpu_uuid", String))
_PODS = Table("ledger_pods", MetaData(), Column("pod_id", Integer), Column("pod_uid", String),
              Column("namespace", String), Column("pod_name", String))
_KINDS = Table("ledger_line_kinds", MetaData(), Column("kind_id", SmallInteger),
               *(Column(name, String) for name in _KIND_COLUMNS))
# The charges' link and id (0016, PostgreSQL): the ledger's ``focus_charge_hourly`` has no ``charge_id`` on SQLite.
_CHARGE_IDS = Table(CHARGE_TABLE, MetaData(), *_link_columns(), Column("charge_id", BigInteger))


def line_select(tables: FocusRollupTables, *, by_ids: bool):
    """(a ``SELECT`` of the allocated lines as rows of ``LINE_DIMENSIONS``, then ``LINE_MEASURES``, the table whose
    columns ``_range`` bounds): the table's columns on SQLite; on PostgreSQL (``by_ids``) the rows' ids joined to
    the origin charge's link and the dictionaries' texts -- the view's rows, with the charges' time bound as well
    as the lines' (``lines_of``: the view's join would read every charge)."""
    if not by_ids:
        t = tables.lines
        return select(*(t.c[n] for n in (*LINE_DIMENSIONS, *LINE_MEASURES))), t
    t, c, g, p, k = tables.rows, _CHARGE_IDS, _GPUS, _PODS, _KINDS
    texts = {"subject_kind": k.c.subject_kind, "pod_uid": p.c.pod_uid, "gpu_uuid": g.c.gpu_uuid,
             "shared_from": k.c.shared_from, "sharing_method": k.c.sharing_method, "method": k.c.method,
             "cost_basis": k.c.cost_basis, "namespace": p.c.namespace, "pod_name": p.c.pod_name,
             "label_set_id": t.c.label_set_id}
    columns = [*(c.c[n] for n in LINK), *(texts[n].label(n) for n in LINE_DIMENSIONS[len(LINK):]),
               *(t.c[n] for n in LINE_MEASURES)]
    joined = (t.join(c, and_(c.c.period_start_unix_ms == t.c.period_start_unix_ms,
                             c.c.charge_id == t.c.charge_id))
              .join(g, g.c.gpu_id == t.c.gpu_id).join(p, p.c.pod_id == t.c.pod_id)
              .join(k, k.c.kind_id == t.c.kind_id))
    return select(*columns).select_from(joined), c


def _line_range(table: Table, by_ids: bool, tables: FocusRollupTables, start_ms: int, end_ms: int,
                cluster: str | None) -> list:
    # By ids: the lines' and the charges' time both bound (each table's partitions pruned), the cluster the charge's.
    conditions = _range(table, start_ms, end_ms, cluster)
    if by_ids:
        conditions += _range(tables.rows, start_ms, end_ms, None)
    return conditions


def lines_of(read: Callable[[Any], list], tables: FocusRollupTables, start_ms: int, end_ms: int,
             cluster: str | None, *, by_ids: bool = False) -> list:
    """The allocated lines of the hours in [start_ms, end_ms), as rows (``LINE_DIMENSIONS``, then
    ``LINE_MEASURES``), unordered. ``by_ids``: the ledger is PostgreSQL's (``line_select``)."""
    statement, table = line_select(tables, by_ids=by_ids)
    return read(statement.where(*_line_range(table, by_ids, tables, start_ms, end_ms, cluster)))


def label_sets_of(read: Callable[[Any], list], label_sets: Table, ids: Iterable[int]) -> dict[int, dict[str, str]]:
    """The labels of the ``label_sets`` ids (0, the empty set, is no row: {})."""
    wanted = sorted({int(i) for i in ids if i})
    out: dict[int, dict[str, str]] = {0: {}}
    for start in range(0, len(wanted), 5000):
        for i, labels in read(select(label_sets.c.label_set_id, label_sets.c.labels)
                              .where(label_sets.c.label_set_id.in_(wanted[start:start + 5000]))):
            out[int(i)] = dict(labels)
    return out


# What the FOCUS export reads of a line: its hour, its origin charge's key, its kind's, pod's and GPU's keys (the charge id and
# the dictionaries' ids on PostgreSQL, texts on SQLite), its label set id, then ``LINE_MEASURES``
# (``focus.HOUR_LINE_FIELDS``).
_ID_LINES = (
    "SELECT t.period_start_unix_ms, t.charge_id, t.kind_id, t.pod_id, t.gpu_id, t.label_set_id, "
    + ", ".join(f"t.{name}" for name in LINE_MEASURES)
    + f" FROM {ROWS_TABLE} t JOIN {CHARGE_TABLE} c ON c.period_start_unix_ms = t.period_start_unix_ms "
    "AND c.charge_id = t.charge_id WHERE t.period_start_unix_ms >= %(start)s AND t.period_start_unix_ms < %(end)s "
    "AND c.period_start_unix_ms >= %(start)s AND c.period_start_unix_ms < %(end)s")
_ID_DICTIONARIES = (
    ("kinds", f"SELECT kind_id, {', '.join(_KIND_COLUMNS)} FROM ledger_line_kinds WHERE kind_id = ANY(%(ids)s)", 2),
    ("pods", "SELECT pod_id, pod_uid, namespace, pod_name FROM ledger_pods WHERE pod_id = ANY(%(ids)s)", 3),
    ("gpus", "SELECT gpu_id, gpu_uuid FROM ledger_gpus WHERE gpu_id = ANY(%(ids)s)", 4),
)


def hour_lines_by_ids(connection: Connection, start_ms: int, end_ms: int,
                      cluster: str | None) -> tuple[list[tuple], dict, dict, dict]:
    """PostgreSQL's (from 0017) allocated lines of the hours in [start_ms, end_ms) as the FOCUS export reads them:
    (lines, kinds, pods, gpus) -- each line a tuple of ``focus.HOUR_LINE_FIELDS`` with the ids as keys (those of
    the origin charges ``charges_of(with_ids=True)`` reads: the lines and the charges both bound by time, the
    cluster the charge's; a charge is its hour and id), and the dictionaries' rows of the ids the lines name: kind id -> (``_KIND_COLUMNS``),
    pod id -> (pod_uid, namespace, pod_name), GPU id -> gpu_uuid. The same lines as ``lines_of(by_ids=True)``
    without joining the texts on every row: read through the driver's binary cursor as plain tuples (numbers
    only), the texts once per id."""
    sql = _ID_LINES + (" AND c.cluster = %(cluster)s" if cluster is not None else "")
    raw = connection.connection.driver_connection
    with raw.cursor(binary=True) as cursor:
        cursor.execute(sql, {"start": start_ms, "end": end_ms, "cluster": cluster})
        lines = cursor.fetchall()
        dictionaries = {}
        for name, query, at in _ID_DICTIONARIES:
            cursor.execute(query, {"ids": sorted({line[at] for line in lines})})
            width = len(cursor.description)
            dictionaries[name] = ({row[0]: row[1] for row in cursor.fetchall()} if width == 2
                                  else {row[0]: tuple(row[1:]) for row in cursor.fetchall()})
    return lines, dictionaries["kinds"], dictionaries["pods"], dictionaries["gpus"]


def hour_lines_of_texts(rows: Iterable[Any]) -> tuple[list[tuple], dict, dict, dict]:
    """``lines_of``' rows (the text layout: SQLite's table) as ``hour_lines_by_ids`` gives PostgreSQL's: the charge
    key its ``LINK``, the kind, pod and GPU keys their texts (each dictionary maps a text key to itself)."""
    width = len(LINK)
    lines, kinds, pods, gpus = [], {}, {}, {}
    for row in rows:
        kind = (row[width], row[width + 3], row[width + 4], row[width + 5], row[width + 6])
        pod = (row[width + 1], row[width + 7], row[width + 8])
        gpu = row[width + 2]
        kinds.setdefault(kind, kind)
        pods.setdefault(pod, pod)
        gpus.setdefault(gpu, gpu)
        lines.append((row[0], tuple(row[:width]), kind, pod, gpu, row[width + 9], *row[width + 10:]))
    return lines, kinds, pods, gpus


def rows_of(read: Callable[[Any], list], table: Table) -> dict[tuple, tuple]:
    """A table's rows, key -> measures (tests and checks; on PostgreSQL ``focus_line_hourly`` is the view)."""
    dimensions, measures = ((CHARGE_DIMENSIONS, CHARGE_MEASURES) if table.name == CHARGE_TABLE
                            else (LINE_DIMENSIONS, LINE_MEASURES))
    return {tuple(row._mapping[n] for n in dimensions): tuple(row._mapping[n] for n in measures)
            for row in read(select(*(table.c[n] for n in (*dimensions, *measures))))}
