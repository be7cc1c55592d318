"""PostgreSQL time partitions of the ledger: which partition holds a time (pure), and creating and dropping them.

On PostgreSQL (from revision 0010) the tables that grow with time are ``PARTITION BY RANGE`` of their time column,
one partition per ``SCHEMES`` entry's unit, UTC:

=====================  ========================  ======  =========================================
table                  column                    unit    partition name
=====================  ========================  ======  =========================================
``node_bills``         ``window_start_unix_ms``  day     ``node_bills_p20261203`` (up to 0017; a view from 0018)
``node_bill_rows``     ``window_start_unix_ms``  day     ``node_bill_rows_p20261203`` (from 0018)
``cost_lines``         ``window_start_unix_ms``  day     ``cost_lines_p20261203`` (0010 to 0013)
``cost_line_rows``     ``window_start_unix_ms``  day     ``cost_line_rows_p20261203`` (0014 and 0015)
``cost_line_packs``    ``window_start_unix_ms``  day     ``cost_line_packs_p20261203`` (from 0016)
``cost_rollup_hourly`` ``period_start_unix_ms``  day     ``cost_rollup_hourly_p20261203``
``cost_rollup_daily``  ``period_start_unix_ms``  month   ``cost_rollup_daily_p202612``
``bill_rollup_hourly`` ``period_start_unix_ms``  day     ``bill_rollup_hourly_p20261203`` (from 0012)
``bill_rollup_daily``  ``period_start_unix_ms``  month   ``bill_rollup_daily_p202612`` (from 0012)
``pod_rollup_hourly``  ``period_start_unix_ms``  day     ``pod_rollup_hourly_p20261203`` (from 0012)
``pod_rollup_daily``   ``period_start_unix_ms``  month   ``pod_rollup_daily_p202612`` (from 0012)
``focus_charge_hourly`` ``period_start_unix_ms`` day     ``focus_charge_hourly_p20261203`` (from 0015)
``focus_line_hourly``  ``period_start_unix_ms``  day     ``focus_line_hourly_p20261203`` (0015; a view from 0017)
``focus_line_hourly_rows`` ``period_start_unix_ms`` day  ``focus_line_hourly_rows_p20261203`` (from 0017)
=====================  ========================  ======  =========================================

A partition covers [its start, its end) of the column: a UTC day, or a UTC calendar month. Retention horizons are
whole UTC days (``services.billing.retention``), so a daily partition is either wholly kept or wholly past; a
monthly one (the daily rollups') keeps its rows until the whole month is past the horizon -- rows no reader asks
for, since every reader starts at the horizon (``rollups.plan``). There is no DEFAULT partition: a row whose
partition is missing is refused by PostgreSQL, so every writer makes sure of it first (``Ledger.write``). From
revision 0014 the lines are ``cost_line_rows`` (``cost_lines`` is a view over them: ``services.billing.line_ids``),
from 0016 ``cost_line_packs`` (one row of arrays per node-window: ``services.billing.line_packs``); a scheme whose
table is not a partitioned table of the database (``cost_lines`` from 0014, ``cost_line_rows`` before 0014 and from
0016, ``cost_line_packs`` before 0016) is passed over. From 0018 the node bills are ``node_bill_rows``
(``node_bills`` is a view over them: ``services.billing.bill_ids``).

**Creating** (``ensure``): in a transaction of its own, serialised by a transaction-level advisory lock (so two
writers needing the same day create it once; the second finds it there), each missing partition is created as a
plain table ``(LIKE parent INCLUDING DEFAULTS INCLUDING CONSTRAINTS)`` and then attached (``ALTER TABLE parent
ATTACH PARTITION ... FOR VALUES FROM (start) TO (end)``), which clones the parent's primary key, indexes and
foreign keys onto it. Measured on PostgreSQL 15 (``pg_locks`` of the creating transaction): ``CREATE TABLE ...
PARTITION OF node_bills`` takes ACCESS EXCLUSIVE on ``node_bills`` -- every reader (a month's report) would wait
for it and every later reader behind it -- while ``ATTACH`` takes SHARE UPDATE EXCLUSIVE on the parent, which
readers and writers pass (before revision 0013 dropped the ``cost_lines`` -> ``node_bills`` foreign key, also
SHARE ROW EXCLUSIVE on the table at its other end, for a few milliseconds). Billing creates the partitions ahead
(``AHEAD_DAYS``, at start and hourly, with its clock), and so does ``gpumeter ledger retention``; a write into a
day nobody created yet creates it first.

**Dropping** (``drop``): ``ALTER TABLE parent DETACH PARTITION p`` and ``DROP TABLE p``, in one short transaction
per partition, ``cost_lines``' day before ``node_bills``' (a line never outlives its bill). DETACH takes ACCESS
EXCLUSIVE on the parent (before 0013 also on ``cost_lines`` for a ``node_bills`` partition: the key's check), so it
waits for running reads; ``lock_timeout`` bounds that wait (``DROP_LOCK_TIMEOUT_MS``) and the retention fails,
to be run again, rather than queue every writer behind a long report. No row is deleted: nothing for VACUUM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Iterable, Iterator

from sqlalchemy import text
from sqlalchemy.engine import Connection

DAY_MS = 86_400_000
DAY = "day"
MONTH = "month"
# How many days past ``now`` the partitions exist (billing's periodic ``ensure`` and retention's).
AHEAD_DAYS = 7
# How long a DETACH waits for the parent's running reads before retention gives up (and is run again).
DROP_LOCK_TIMEOUT_MS = 10_000
# The rollups' pages are left this full (percent) when written: every write of a period updates its rows again, and
# an update that finds room on its row's page is a HOT update (no new index entry), which a full page forbids.
# Measured (bench/ledger_month.py's fleet, A/B in one run): 70 halves the upserts' time; the rows are ~1/40 of the
# minute grain's bytes, so the free space costs little.
ROLLUP_FILLFACTOR = 70
# Serialises every creation of partitions in one database (any constant, the same in every gpumeter process).
_PARTITION_LOCK_ID = 0x67706D7061727473  # "gpmparts"


@dataclass(frozen=True, slots=True)
class Scheme:
    """How a table is partitioned: by ``column``, one partition per ``unit`` (``day`` or ``month``, UTC); each
    partition created with ``fillfactor`` (percent; None: PostgreSQL's 100)."""

    table: str
    column: str
    unit: str
    fillfactor: int | None = None


SCHEMES = (
    Scheme("node_bills", "window_start_unix_ms", DAY),
    # The node bills by ids from 0018 (``node_bills`` is a view over them on PostgreSQL).
    Scheme("node_bill_rows", "window_start_unix_ms", DAY),
    Scheme("cost_line_rows", "window_start_unix_ms", DAY),
    Scheme("cost_line_packs", "window_start_unix_ms", DAY),
    Scheme("cost_rollup_hourly", "period_start_unix_ms", DAY, ROLLUP_FILLFACTOR),
    Scheme("cost_rollup_daily", "period_start_unix_ms", MONTH, ROLLUP_FILLFACTOR),
    Scheme("bill_rollup_hourly", "period_start_unix_ms", DAY, ROLLUP_FILLFACTOR),
    Scheme("bill_rollup_daily", "period_start_unix_ms", MONTH, ROLLUP_FILLFACTOR),
    Scheme("pod_rollup_hourly", "period_start_unix_ms", DAY, ROLLUP_FILLFACTOR),
    Scheme("pod_rollup_daily", "period_start_unix_ms", MONTH, ROLLUP_FILLFACTOR),
    # The lines' table from 0010 to 0013 (a view from 0014): what a ledger at those revisions partitions.
    Scheme("cost_lines", "window_start_unix_ms", DAY),
    Scheme("focus_charge_hourly", "period_start_unix_ms", DAY, ROLLUP_FILLFACTOR),
    Scheme("focus_line_hourly", "period_start_unix_ms", DAY, ROLLUP_FILLFACTOR),
    # The hourly FOCUS lines by ids from 0017 (``focus_line_hourly`` is a view over them on PostgreSQL).
    Scheme("focus_line_hourly_rows", "period_start_unix_ms", DAY, ROLLUP_FILLFACTOR),
)
SCHEME_BY_TABLE = {scheme.table: scheme for scheme in SCHEMES}
# What the minute retention drops, in this order (a line never outlives its bill).
MINUTE_TABLES = ("cost_line_packs", "cost_line_rows", "cost_lines", "node_bills", "node_bill_rows")
# How many lines a row of a table holds, where not one (a pack holds a node-window's: ``line_packs``).
_LINES_PER_ROW = {"cost_line_packs": "cardinality(cost_micro_usd)"}


@dataclass(frozen=True, slots=True, order=True)
class Partition:
    """One partition: ``table``'s rows with the column in [start_ms, end_ms)."""

    start_ms: int
    end_ms: int
    table: str
    name: str


# -- pure: names and ranges ---------------------------------------------------------------------------------------


def _utc(ms: int) -> datetime:
    return datetime.fromtimestamp(ms // 1000, tz=timezone.utc)


def _ms(moment: datetime) -> int:
    return int(moment.timestamp()) * 1000


def partition_of(scheme: Scheme, ms: int) -> Partition:
    """The partition of ``scheme`` that holds the time ``ms``."""
    if scheme.unit == DAY:
        start = ms - ms % DAY_MS
        return Partition(start, start + DAY_MS, scheme.table, f"{scheme.table}_p{_utc(start):%Y%m%d}")
    moment = _utc(ms)
    first = datetime(moment.year, moment.month, 1, tzinfo=timezone.utc)
    following = datetime(moment.year + moment.month // 12, moment.month % 12 + 1, 1, tzinfo=timezone.utc)
    return Partition(_ms(first), _ms(following), scheme.table, f"{scheme.table}_p{first:%Y%m}")


def covering(scheme: Scheme, start_ms: int, end_ms: int) -> list[Partition]:
    """The partitions of ``scheme`` that hold any time in [start_ms, end_ms), oldest first."""
    out = []
    at = start_ms
    while at < end_ms:
        part = partition_of(scheme, at)
        out.append(part)
        at = part.end_ms
    return out


def wanted(start_ms: int, end_ms: int, schemes: Iterable[Scheme] = SCHEMES) -> list[Partition]:
    """Every table's partitions for the times in [start_ms, end_ms)."""
    return [part for scheme in schemes for part in covering(scheme, start_ms, end_ms)]


def for_times(times_ms: Iterable[int], schemes: Iterable[Scheme] = SCHEMES) -> set[Partition]:
    """Every table's partitions holding any of ``times_ms`` (the window starts of a write)."""
    schemes = tuple(schemes)
    return {partition_of(scheme, ms) for ms in set(times_ms) for scheme in schemes}


_NAME = re.compile(r"^(?P<table>[a-z_]+)_p(?P<date>\d{6}|\d{8})$")


def parse_name(name: str) -> Partition | None:
    """The partition a name made by ``partition_of`` stands for; None for any other name."""
    match = _NAME.match(name)
    if match is None or match["table"] not in SCHEME_BY_TABLE:
        return None
    scheme = SCHEME_BY_TABLE[match["table"]]
    digits = match["date"]
    if len(digits) != (8 if scheme.unit == DAY else 6):
        return None
    try:
        moment = datetime.strptime(digits, "%Y%m%d" if scheme.unit == DAY else "%Y%m").replace(tzinfo=timezone.utc)
    except ValueError:
        return None
    part = partition_of(scheme, _ms(moment))
    return part if part.name == name else None


def past(partitions: Iterable[Partition], horizon_ms: int) -> list[Partition]:
    """The partitions wholly before ``horizon_ms`` (their every row older than it), oldest first."""
    return sorted(part for part in partitions if part.end_ms <= horizon_ms)


# -- SQL (PostgreSQL) ---------------------------------------------------------------------------------------------


def partitioned(connection: Connection) -> bool:
    """Whether this database's ledger tables are partitioned (PostgreSQL from revision 0010): its node bills
    (``node_bills``, from 0018 ``node_bill_rows``)."""
    if connection.dialect.name != "postgresql":
        return False
    return bool(connection.execute(text(
        "SELECT count(*) FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid "
        "WHERE c.relname IN ('node_bills', 'node_bill_rows') "
        "AND c.relnamespace = to_regnamespace(current_schema())::oid")).scalar())


def existing(connection: Connection, tables: Iterable[str] | None = None) -> set[Partition]:
    """The partitions attached to the ledger's partitioned tables (all of them, or those of ``tables``)."""
    names = tuple(tables or SCHEME_BY_TABLE)
    rows = connection.execute(text(
        "SELECT child.relname FROM pg_inherits i JOIN pg_class parent ON parent.oid = i.inhparent "
        "JOIN pg_class child ON child.oid = i.inhrelid "
        "WHERE parent.relname = ANY(:tables) AND parent.relnamespace = to_regnamespace(current_schema())::oid"),
        {"tables": list(names)}).scalars()
    return {part for part in map(parse_name, rows) if part is not None}


def partitioned_tables(connection: Connection) -> set[str]:
    """The names of this schema's partitioned tables."""
    return set(connection.execute(text(
        "SELECT c.relname FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid "
        "WHERE c.relnamespace = to_regnamespace(current_schema())::oid")).scalars())


def create(connection: Connection, part: Partition) -> None:
    """Create ``part`` detached and attach it (module docstring: ATTACH, not ``CREATE ... PARTITION OF``)."""
    scheme = SCHEME_BY_TABLE.get(part.table)
    fill = f" WITH (fillfactor = {int(scheme.fillfactor)})" if scheme is not None and scheme.fillfactor else ""
    connection.execute(text(f'CREATE TABLE IF NOT EXISTS "{part.name}" '
                            f'(LIKE "{part.table}" INCLUDING DEFAULTS INCLUDING CONSTRAINTS){fill}'))
    connection.execute(text(f'ALTER TABLE "{part.table}" ATTACH PARTITION "{part.name}" '
                            f"FOR VALUES FROM ({int(part.start_ms)}) TO ({int(part.end_ms)})"))


def ensure_in(connection: Connection, parts: Iterable[Partition]) -> list[Partition]:
    """Create those of ``parts`` not attached yet, under the advisory lock (inside the caller's transaction, which
    should do nothing else: the locks ATTACH takes last until it ends). Returns those it created."""
    connection.execute(text("SELECT pg_advisory_xact_lock(:lock)"), {"lock": _PARTITION_LOCK_ID})
    tables = partitioned_tables(connection)
    parts = {part for part in parts if part.table in tables}
    missing = sorted(parts - existing(connection, {part.table for part in parts}))
    # Bills before lines: up to 0012 a line partition's foreign key is cloned from the parent's (names node_bills).
    order = {scheme.table: index for index, scheme in enumerate(SCHEMES)}
    missing.sort(key=lambda part: (order[part.table], part.start_ms))
    for part in missing:
        create(connection, part)
    return missing


def drop(connection: Connection, part: Partition) -> None:
    """Detach and drop ``part`` (in the caller's transaction, with ``lock_timeout`` set: module docstring)."""
    connection.execute(text(f"SET LOCAL lock_timeout = {int(DROP_LOCK_TIMEOUT_MS)}"))
    connection.execute(text(f'ALTER TABLE "{part.table}" DETACH PARTITION "{part.name}"'))
    connection.execute(text(f'DROP TABLE "{part.name}"'))


def rows_in(connection: Connection, part: Partition) -> int:
    """How many rows ``part`` holds (what dropping it removes); for a table of packed lines, how many lines."""
    per_row = _LINES_PER_ROW.get(part.table)
    count = "count(*)" if per_row is None else f"coalesce(sum({per_row}), 0)"
    return int(connection.execute(text(f'SELECT {count} FROM "{part.name}"')).scalar())


def iter_past(connection: Connection, tables: Iterable[str], horizon_ms: int) -> Iterator[Partition]:
    """The attached partitions of ``tables`` wholly before ``horizon_ms``: per day, in ``tables``' order."""
    order = {table: index for index, table in enumerate(tables)}
    for part in sorted(past(existing(connection, tuple(order)), horizon_ms),
                       key=lambda p: (p.start_ms, order[p.table])):
        yield part
