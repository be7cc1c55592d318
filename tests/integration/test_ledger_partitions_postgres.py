"""The ledger's time partitions on a real PostgreSQL (revision 0010, ``services.billing.partitions``): the migration
moves a ledger's rows into them with every answer unchanged, retention drops whole partitions (no row deleted),
and writes create the partition of a day nobody created yet, also two writers at once."""

from __future__ import annotations

import threading
import time

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from services.billing import partitions
from services.billing.catalog import PriceCatalog
from services.billing.costing import bill_node_window
from services.billing.ledger import ONLY_ON, VERSION_TABLE, Grouping, Ledger, _alembic_config, metadata
from services.billing.report import build_report
from services.billing.retention import RetentionSettings, retain
from services.billing.rollups import DAY, DAY_MS, HOUR, MINUTE
from tests.integration.test_ledger_postgres import database_url, everything  # noqa: F401 (a fixture)
from tests.unit.billing.conftest import WINDOW_START_MS, sample_shares

pytestmark = pytest.mark.postgres

# The partitioned tables at head (from 0014 ``cost_lines`` is a view, from 0016 over ``cost_line_packs``;
# from 0017 ``focus_line_hourly`` one over ``focus_line_hourly_rows``).
TABLES = tuple(scheme.table for scheme in partitions.SCHEMES
               if scheme.table not in ("cost_lines", "cost_line_rows", "focus_line_hourly", "node_bills"))
# The node bills' partitions at head: ``node_bill_rows``' (from 0018 ``node_bills`` is a view: ``bill_ids``).
BILLS = partitions.SCHEME_BY_TABLE["node_bill_rows"]


def attached(ledger: Ledger) -> set[str]:
    with ledger.engine.connect() as connection:
        return {row[0] for row in connection.execute(text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = ANY(:t)"), {"t": list(TABLES)})}


def relations(ledger: Ledger) -> set[str]:
    with ledger.engine.connect() as connection:
        return set(connection.execute(text(
            "SELECT relname FROM pg_class WHERE relkind IN ('r', 'p') AND relnamespace = 'public'::regnamespace"
        )).scalars())


def all_rows(ledger: Ledger, tables=TABLES) -> dict[str, list[tuple]]:
    """Every row of ``tables``, sorted (the labels' JSON as text)."""
    out = {}
    with ledger.engine.connect() as connection:
        for name in tables:
            rows = connection.execute(text(f'SELECT * FROM "{name}"'))
            out[name] = sorted(tuple(str(v) for v in row) for row in rows)
    return out


def rows_outside_partitions(ledger: Ledger, tables=TABLES) -> int:
    with ledger.engine.connect() as connection:
        return sum(connection.execute(text(f'SELECT count(*) FROM ONLY "{name}"')).scalar_one() for name in tables)


def not_a_partition(name, type_, parent_names):
    """``compare_metadata`` name filter: the partitions are not in the metadata, their parents are."""
    return not (type_ == "table" and partitions.parse_name(name) is not None)


def not_to_a_partition(object_, name, type_, reflected, compare_to):
    """``compare_metadata`` object filter: PostgreSQL shows the foreign key to a partitioned table once more per
    partition of it (its internal copies); the one to the parent is compared. The metadata's SQLite-only keys
    (``ONLY_ON``: the cost lines' keys, dropped by migration 0013) are not PostgreSQL's."""
    if not reflected and object_.info.get(ONLY_ON, "postgresql") != "postgresql":
        return False
    return not (type_ == "foreign_key_constraint" and reflected
                and partitions.parse_name(object_.referred_table.name) is not None)


PARTITION_FILTERS = {"include_name": not_a_partition, "include_object": not_to_a_partition}


def deleted_tuples(ledger: Ledger) -> int:
    """Rows ever deleted from the ledger's tables and their partitions (PostgreSQL's statistics, flushed by closing
    every connection that deleted)."""
    ledger.engine.dispose()
    time.sleep(1.5)
    with ledger.engine.connect() as connection:
        connection.execute(text("SELECT pg_stat_clear_snapshot()"))
        return int(connection.execute(text(
            "SELECT coalesce(sum(n_tup_del), 0) FROM pg_stat_user_tables WHERE relname LIKE ANY(:p)"),
            {"p": [f"{name}%" for name in TABLES]}).scalar_one())


def test_the_partitions_migration_moves_a_0009_ledger_into_day_partitions_with_every_answer_unchanged(database_url):
    """0010 moves a 0009 ledger's rows into partitions; 0012 creates its rollups partitioned and backfills them into
    partitions; at head every answer is the one recorded at 0007 (the head code cannot read a 0009 ledger: the
    bills gained a column in 0012)."""
    from tests.unit.billing.test_ledger_compact import FIXTURE, assert_answers, ledger_at_0007
    from tests.unit.billing.data import make_ledger_0007 as recorded

    moved = ("node_bills", "cost_lines", "cost_rollup_hourly", "cost_rollup_daily")  # what 0010 partitions
    ledger = ledger_at_0007(database_url)
    with ledger.engine.begin() as connection:
        command.upgrade(_alembic_config(connection), "0009_rollups")
    start, end = FIXTURE["start_ms"], FIXTURE["end_ms"]
    rows = all_rows(ledger, moved)
    assert attached(ledger) == set() and all(rows.values())

    with ledger.engine.begin() as connection:
        command.upgrade(_alembic_config(connection), "0010_partitions")
    # The rows moved, all of them, into partitions of their day (month), none left outside one.
    assert all_rows(ledger, moved) == rows and rows_outside_partitions(ledger, moved) == 0
    assert ledger.migrate() == Ledger.head_revision()

    with ledger.engine.connect() as connection:
        assert set(connection.execute(text(
            "SELECT c.relname FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid")).scalars()
                   ) == set(TABLES)
    assert rows_outside_partitions(ledger, TABLES) == 0 and all(all_rows(ledger, TABLES).values())
    wanted = {part.name for scheme in partitions.SCHEMES for part in partitions.covering(scheme, start, end)
              if scheme.table in TABLES}
    assert wanted <= attached(ledger)
    assert not {name for name in relations(ledger) if name.endswith(("_0009", "_old"))}
    assert_answers(ledger, FIXTURE["outputs"])
    # The same schema as the metadata says (the partitions aside), and true-up still writes through it.
    with ledger.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE, "compare_type": True,
                                                               **PARTITION_FILTERS})
        assert compare_metadata(context, metadata) == []
    assert recorded._reconcile(ledger, recorded.FOCUS_AMENDED) == FIXTURE["amended"]["reconcile"]
    assert_answers(ledger, FIXTURE["amended"]["outputs"])
    ledger.close()


def test_retention_detaches_and_drops_whole_partitions_and_deletes_no_row(database_url):
    from tests.unit.billing.test_retention import DAY0, DAYS, GROUPINGS, comparable, history, line_count, rollup_rows

    ledger = Ledger(database_url)
    ledger.migrate()
    ledger.write(*everything(history()))
    now = DAY0 + DAYS * DAY_MS + 10 * 3_600_000
    settings = RetentionSettings(minute_lines_days=14, hourly_rollups_days=16, daily_rollups_days=400)
    minute_horizon, hour_horizon = DAY0 + (DAYS - 14) * DAY_MS, DAY0 + (DAYS - 16) * DAY_MS
    end = DAY0 + DAYS * DAY_MS
    hourly, daily = rollup_rows(ledger)
    kept_bills = ledger.bills(start_ms=minute_horizon)
    kept_totals = ledger.bill_totals(start_ms=minute_horizon, end_ms=end, cost="trued")
    reports = {by: build_report(ledger, Grouping.parse(by), start_ms=minute_horizon, end_ms=end)
               for by in GROUPINGS}
    kept_lines = line_count(ledger, minute_horizon, end)
    dropped_lines = line_count(ledger, DAY0, minute_horizon)
    before = attached(ledger)
    deleted_before = deleted_tuples(ledger)

    result = retain(ledger, settings, now_ms=now)

    # Dropped, never deleted: no row deleted anywhere in the ledger's tables.
    assert deleted_tuples(ledger) == deleted_before == 0
    gone = {f"{name}_p{day}" for name in ("cost_line_packs", "node_bill_rows")
            for day in (time.strftime("%Y%m%d", time.gmtime((DAY0 + d * DAY_MS) / 1000)) for d in range(DAYS - 14))}
    gone |= {f"{name}_p{time.strftime('%Y%m%d', time.gmtime((DAY0 + d * DAY_MS) / 1000))}"
             for name in ("cost_rollup_hourly", "bill_rollup_hourly", "pod_rollup_hourly", "focus_charge_hourly",
                          "focus_line_hourly_rows") for d in range(DAYS - 16)}
    assert set(result.dropped_partitions) == gone and gone <= before
    assert attached(ledger) & gone == set() and not relations(ledger) & gone
    assert before - gone <= attached(ledger)
    assert result.deleted[MINUTE] > 0 and result.bills_deleted > 0 and result.deleted[HOUR] > 0
    # The lines dropped are counted as lines (from 0016 a partition holds one row per node-window: line_packs).
    assert result.deleted[MINUTE] == dropped_lines
    assert line_count(ledger, DAY0, minute_horizon) == 0 and line_count(ledger, minute_horizon, end) == kept_lines
    # Every rollup and bill over the kept periods is what it was, to the micro-dollar.
    hourly_after, daily_after = rollup_rows(ledger)
    assert hourly_after == {k: v for k, v in hourly.items() if k.period_start_unix_ms >= hour_horizon}
    assert daily_after == daily
    assert ledger.bills(start_ms=minute_horizon) == kept_bills
    assert ledger.bill_totals(start_ms=minute_horizon, end_ms=end, cost="trued") == kept_totals
    for by, report in reports.items():
        again = build_report(ledger, Grouping.parse(by), start_ms=minute_horizon, end_ms=end)
        assert comparable(again) == comparable(report) and again.reconciliation.reconciled
    # The days ahead exist; running it again drops nothing more.
    assert partitions.partition_of(BILLS, now + 7 * DAY_MS).name in attached(ledger)
    again = retain(ledger, settings, now_ms=now + 60_000)
    assert again.dropped_partitions == () and again.bills_deleted == 0
    ledger.close()


def test_a_write_into_a_day_without_a_partition_creates_it_first(database_url):
    catalog = PriceCatalog.load()
    ledger = Ledger(database_url)
    ledger.migrate()
    assert attached(ledger) == set()
    first = [bill_node_window(w, catalog) for w in sample_shares(2)]
    assert ledger.write(*everything(first)).bills_written == len(first)
    day = partitions.partition_of(BILLS, WINDOW_START_MS)
    assert day.name in attached(ledger)
    # A day this handle knew of, dropped behind its back (another process's retention): written again all the same.
    later = [bill_node_window(w, catalog) for w in sample_shares(1, start_ms=WINDOW_START_MS + 3 * DAY_MS)]
    assert ledger.write(*everything(later)).bills_written == len(later)
    later_day = partitions.partition_of(partitions.SCHEME_BY_TABLE["cost_line_packs"], WINDOW_START_MS + 3 * DAY_MS)
    with Ledger(database_url) as other, other.engine.begin() as connection:
        for part in (later_day, partitions.partition_of(BILLS, later_day.start_ms)):
            partitions.drop(connection, part)
    assert later_day.name not in attached(ledger)
    again = [bill_node_window(w, catalog) for w in sample_shares(1, start_ms=WINDOW_START_MS + 3 * DAY_MS)]
    result = ledger.write(*everything(again))
    assert result.bills_written == len(again) and later_day.name in attached(ledger)
    totals = ledger.totals()
    assert totals.cost_micro_usd == totals.bill_micro_usd > 0
    # Ahead of the clock: idempotent.
    assert ledger.ensure_partitions(WINDOW_START_MS + 10 * DAY_MS) > 0
    assert ledger.ensure_partitions(WINDOW_START_MS + 10 * DAY_MS) == 0
    ledger.close()


def test_two_writers_creating_the_same_days_partition_both_succeed(database_url):
    catalog = PriceCatalog.load()
    Ledger(database_url).migrate()
    start = WINDOW_START_MS + 5 * DAY_MS
    batches = [[bill_node_window(w, catalog) for w in sample_shares(2, start_ms=start + i * 120_000)]
               for i in range(2)]
    barrier = threading.Barrier(2)
    outcomes, errors = [], []

    def write(batch):
        try:
            with Ledger(database_url) as own:
                barrier.wait(30)
                outcomes.append(own.write(*everything(batch)))
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(batch,)) for batch in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert sum(o.bills_written for o in outcomes) == sum(len(batch) for batch in batches)
    with Ledger(database_url) as ledger:
        day = partitions.partition_of(BILLS, start)
        assert {day.name, day.name.replace("node_bill_rows", "cost_line_packs")} <= attached(ledger)
        totals = ledger.totals()
        assert totals.cost_micro_usd == totals.bill_micro_usd == sum(
            r.bill.node_cost_micro_usd for batch in batches for r in batch)
