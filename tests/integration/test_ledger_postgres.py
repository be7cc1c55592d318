"""The ledger and the report on a real PostgreSQL server (started by the session fixture ``postgres_url``)."""

from __future__ import annotations

import threading
import uuid
from collections import defaultdict

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, event, inspect, text
from sqlalchemy.engine import make_url

from services.billing.catalog import PriceCatalog
from services.billing.costing import bill_node_window
from services.billing.ledger import VERSION_TABLE, Grouping, Ledger, metadata
from services.billing.report import build_report, format_report
from tests.unit.billing.conftest import WINDOW_START_MS, sample_costs, sample_shares

pytestmark = pytest.mark.postgres

WINDOWS = 3
END_MS = WINDOW_START_MS + WINDOWS * 60_000


@pytest.fixture
def database_url(postgres_url):
    """A database of this test's own on the session server, dropped afterwards."""
    name = f"ledger_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(postgres_url).set(database=name).render_as_string(hide_password=False)
    yield url
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def pg_ledger(database_url):
    ledger = Ledger(database_url)
    ledger.migrate()
    yield ledger
    ledger.close()


def everything(results):
    return [c for r in results for c in r.costs], [r.bill for r in results]


def test_migrations_create_the_schema_once_even_when_run_concurrently(database_url):
    ledger = Ledger(database_url)
    assert ledger.dialect == "postgresql"
    assert inspect(ledger.engine).get_table_names() == []
    revisions, errors = [], []

    def migrate():
        try:
            with Ledger(database_url) as own:
                revisions.append(own.migrate())
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=migrate) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == [] and revisions == [Ledger.head_revision()] * 3
    from tests.integration.test_ledger_partitions_postgres import PARTITION_FILTERS

    with ledger.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE, "compare_type": True,
                                                               **PARTITION_FILTERS})
        assert compare_metadata(context, metadata) == []
        labels_type = connection.execute(text(
            "SELECT data_type FROM information_schema.columns WHERE table_name = 'label_sets' "
            "AND column_name = 'labels'")).scalar_one()
    assert labels_type == "jsonb"
    ledger.close()


def test_write_redelivery_and_totals(pg_ledger):
    catalog = PriceCatalog.load()
    windows = sample_shares(WINDOWS)
    results = [bill_node_window(w, catalog) for w in windows]
    costs, bills = everything(results)
    outcome = pg_ledger.write(costs, bills)
    assert (outcome.bills_written, outcome.lines_written) == (len(bills), len(costs))
    first = pg_ledger.totals()
    assert first.cost_micro_usd == first.bill_micro_usd == sum(b.node_cost_micro_usd for b in bills)

    # The same shares delivered twice, to a consumer that lost its state: the same ledger totals.
    again = [bill_node_window(window[::-1], catalog) for window in windows]
    outcome = pg_ledger.write(*everything(again))
    assert (outcome.bills_written, outcome.bills_skipped, outcome.lines_written) == (0, len(bills), 0)
    assert pg_ledger.totals() == first

    def key(c):
        return (c.window_start_unix_ms, c.node_name, c.gpu_uuid or "", c.subject_kind.value, c.pod_uid or "")

    assert sorted(pg_ledger.iter_cost_lines(), key=key) == sorted(costs, key=key)


def test_concurrent_writers_of_the_same_node_windows_bill_them_once(pg_ledger, database_url):
    costs, bills = everything(sample_costs(WINDOWS))
    barrier = threading.Barrier(3)
    outcomes, errors = [], []

    def write():
        try:
            with Ledger(database_url) as own:
                barrier.wait(30)
                outcomes.append(own.write(costs, bills))
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert sum(o.bills_written for o in outcomes) == len(bills)
    assert sum(o.lines_written for o in outcomes) == len(costs)
    totals = pg_ledger.totals()
    assert totals.cost_micro_usd == totals.bill_micro_usd == sum(b.node_cost_micro_usd for b in bills)
    assert totals.cost_lines == len(costs)


def focus_upsert(statement: str) -> bool:
    return statement.lstrip().startswith("INSERT INTO focus_line_hourly_rows")


def test_bulk_write_uses_batched_statements(pg_ledger):
    """A write's statements do not grow with its lines; the dictionary ids (``line_ids``) are one insert and one
    select per kind for the keys a handle has not seen, and none once it has (its id cache)."""
    first, second = sample_costs(60), sample_costs(60, start_ms=WINDOW_START_MS + 60 * 60_000)
    costs, bills = everything(first)
    assert len(costs) > 3000

    def statements_of(costs, bills):
        statements = []
        listener = lambda *args: statements.append(args[2])  # noqa: E731
        event.listen(pg_ledger.engine, "before_cursor_execute", listener)
        try:
            pg_ledger.write(costs, bills)
        finally:
            event.remove(pg_ledger.engine, "before_cursor_execute", listener)
        return statements

    statements = statements_of(costs, bills)
    inserts = [s for s in statements if s.lstrip().upper().startswith("INSERT")]
    # (The hourly FOCUS lines' upsert names the dictionaries too, resolving its keys in SQL: not one of theirs.)
    dictionaries = [s for s in statements if ("ledger_nodes" in s or "ledger_gpus" in s or "ledger_pods" in s
                                              or "ledger_line_kinds" in s) and not focus_upsert(s)]
    assert len([s for s in statements if focus_upsert(s)]) == 1
    assert len(dictionaries) == 8  # an insert and a select of each of the four kinds
    assert len(inserts) <= 12 + 4
    assert pg_ledger.totals().cost_lines == len(costs)
    # The next windows of the same nodes, GPUs and pods: their ids are cached.
    costs, bills = everything(second)
    statements = statements_of(costs, bills)
    assert not [s for s in statements if "ledger_" in s and "ledger_retention" not in s and not focus_upsert(s)]
    assert len([s for s in statements if s.lstrip().upper().startswith("INSERT")]) <= 12
    assert pg_ledger.totals().cost_lines == len(costs) + len(everything(first)[0])


@pytest.mark.parametrize("by", ["namespace", "label:team", "label:model", "node", "gpu"])
def test_report_from_postgres_reconciles_to_the_node_bills(pg_ledger, by):
    results = sample_costs(WINDOWS)
    pg_ledger.write(*everything(results))
    grouping = Grouping.parse(by)
    report = build_report(pg_ledger, grouping, start_ms=WINDOW_START_MS, end_ms=END_MS)
    group_of = {
        "namespace": lambda c: c.namespace,
        "node": lambda c: c.node_name,
        "gpu": lambda c: c.gpu_uuid,
    }.get(grouping.kind, lambda c: c.labels.get(grouping.label_key))
    expected = defaultdict(int)
    for cost in (c for r in results for c in r.costs):
        group = group_of(cost)
        if group is None and cost.subject_kind.value == "POD" and grouping.kind == "label":
            group = f"(no {grouping.label_key} label)"
        expected[(cost.subject_kind.value.lower(), group)] += cost.cost_micro_usd
    assert {(line.kind, line.group): line.cost_micro_usd for line in report.lines} == dict(expected)
    bills_total = sum(r.bill.node_cost_micro_usd for r in results)
    assert report.total_micro_usd == report.reconciliation.node_bills_micro_usd == bills_total
    assert report.reconciliation.reconciled and report.reconciliation.node_windows == len(results)
    assert "reconciled, equal to the micro-dollar" in format_report(report, "table")


def test_the_sharing_migration_keeps_old_lines_direct_and_makes_room_for_shared_ones(database_url):
    """0006 on PostgreSQL: the primary key is altered in place; lines written before are direct, bills 'keep'."""
    from alembic import command

    from services.billing.ledger import _alembic_config

    ledger = Ledger(database_url)
    with ledger.engine.begin() as connection:
        command.upgrade(_alembic_config(connection), "0005_carried_label_keys")
    with ledger.engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO price_versions VALUES ('v1', 'aws', 'us-east-1', 'g6.xlarge', 'on_demand', '0.8', 1, '0.6', "
            "'0.2', 'marginal', 'test', 'test')"))
        connection.execute(text(
            "INSERT INTO node_bills (window_start_unix_ms, cluster, node_name, window_seconds, billed_milliseconds, "
            "provider, region, instance_type, price_model, gpu_count, node_cost_micro_usd, gpu_cost_micro_usd, "
            "node_other_micro_usd, price_version) VALUES (0, 'c', 'n', 60, 60000, 'aws', 'us-east-1', 'g6.xlarge', "
            "'on_demand', 1, 13333, 10000, 3333, 'v1')"))
        connection.execute(text(
            "INSERT INTO cost_lines (window_start_unix_ms, cluster, node_name, gpu_uuid, subject_kind, pod_uid, "
            "window_seconds, labels, cost_share, cost_micro_usd, instance_type, price_model, price_version) VALUES "
            "(0, 'c', 'n', 'GPU-0', 'POD', 'p', 60, '{}', 1.0, 13333, 'g6.xlarge', 'on_demand', 'v1')"))
    assert ledger.migrate() == Ledger.head_revision() == "0018_bill_ids"
    (old,) = list(ledger.iter_cost_lines(end_ms=1))
    assert (old.shared_from, old.sharing_method) == (None, "")
    assert [b["sharing"] for b in ledger.bills(end_ms=1)] == ["keep"]
    from tests.integration.test_ledger_partitions_postgres import PARTITION_FILTERS

    with ledger.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE, "compare_type": True,
                                                               **PARTITION_FILTERS})
        assert compare_metadata(context, metadata) == []
    shared = sample_costs(1, sharing="all=weighted", start_ms=WINDOW_START_MS)
    assert ledger.write(*everything(shared)).bills_written == len(shared)
    assert ledger.totals().cost_micro_usd == ledger.totals().bill_micro_usd
    ledger.close()


def test_rollups_retention_and_reports_over_the_rollups_on_postgresql(database_url):
    """The rollups' upserts, the trued-up sums, the backfill's SQL and retention's dropped partitions on PostgreSQL:
    every grain equals the lines, a report from the rollups equals the report from the lines, and retention drops
    minute lines and their bills only."""
    from services.billing.retention import RetentionSettings, retain
    from services.billing.rollups import DAY, DAY_MS, HOUR, MINUTE
    from tests.unit.billing.test_retention import DAY0, DAYS, comparable, history, line_count, snapshot
    from tests.unit.billing.test_rollups import assert_every_grain_reconciles

    ledger = Ledger(database_url)
    ledger.migrate()
    results = history()
    half = len(results) // 2
    ledger.write(*everything(results[:half]))
    ledger.write(*everything(results))  # the first half again, redelivered beside the second
    assert_every_grain_reconciles(ledger)
    start, end = DAY0 + 7 * 60_000, DAY0 + (DAYS - 1) * DAY_MS + 14 * 3_600_000 + 31 * 60_000
    for by in ("namespace", "label:team"):
        rolled = build_report(ledger, Grouping.parse(by), start_ms=start, end_ms=end, cost="trued")
        assert rolled.plan.grains() == (DAY, HOUR, MINUTE)
        assert comparable(rolled) == comparable(build_report(ledger, Grouping.parse(by), start_ms=start,
                                                             end_ms=end, cost="trued", grain="minute"))
    now = DAY0 + DAYS * DAY_MS
    before = snapshot(ledger, now - 14 * DAY_MS)
    result = retain(ledger, RetentionSettings(), now_ms=now)
    assert result.deleted[MINUTE] > 0 and line_count(ledger, DAY0, now - 14 * DAY_MS) == 0
    # The rollups all stay, the bills from the horizon (those before went with their lines: partitions dropped).
    assert snapshot(ledger, now - 14 * DAY_MS) == before and result.bills_deleted > 0
    ledger.close()


def test_the_compact_lines_migration_keeps_every_answer_to_the_micro_dollar(database_url):
    """0008 on PostgreSQL: a ledger written at 0007 (the recorded rows), upgraded, answers every report grouping,
    the FOCUS export and /allocation as it did at 0007, and the amended bill's true-up as it did then."""
    from tests.unit.billing.test_ledger_compact import check_upgrade_keeps_every_answer

    from tests.integration.test_ledger_partitions_postgres import PARTITION_FILTERS

    check_upgrade_keeps_every_answer(database_url)
    ledger = Ledger(database_url)
    with ledger.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE, "compare_type": True,
                                                               **PARTITION_FILTERS})
        assert compare_metadata(context, metadata) == []
    ledger.close()


def test_the_compact_lines_migration_goes_back_with_every_line_a_row_again(database_url):
    from alembic import command

    from services.billing.ledger import _alembic_config
    from tests.unit.billing.test_ledger_compact import FIXTURE, ledger_at_0007

    ledger = ledger_at_0007(database_url)
    ledger.migrate()
    columns = FIXTURE["rows"]["cost_lines"]["columns"]
    with ledger.engine.begin() as connection:
        command.downgrade(_alembic_config(connection), "0007_sharing")
        rows = connection.execute(text(f"SELECT {', '.join(columns)} FROM cost_lines")).all()
    ledger.close()
    assert sorted(map(tuple, rows)) == sorted(tuple(v) for v in FIXTURE["rows"]["cost_lines"]["values"])


def test_bill_and_pod_rollups_reports_and_allocation_over_them_on_postgresql(database_url):
    """0012 on PostgreSQL: the bill and pod rollups' upserts, a true-up's move, the backfill's SQL; a report's node
    bills and /allocation from the rollups equal the minute answers, also after retention dropped the minute
    lines and the node bills."""
    from services.billing.rollups import DAY_MS, HOUR_MS
    from tests.unit.billing import test_read_rollups as reads
    from tests.unit.billing.test_retention import DAY0, DAYS

    ledger = Ledger(database_url)
    ledger.migrate()
    reads.write_history(ledger)
    reads.assert_rollups_are_the_bills_and_pod_lines(ledger)
    reads.check_reports_over_rollups_equal_minute_data(
        ledger, DAY0 + 7 * 60_000, DAY0 + (DAYS - 1) * DAY_MS + 14 * HOUR_MS + 31 * 60_000,
        ("namespace", "label:team", "pod"))
    for aggregate in ("namespace", "node", "cluster", "label:team"):
        reads.check_allocation_over_rollups(ledger, aggregate, reads.QUERIES[:5])
    whole = (DAY0, DAY0 + DAYS * DAY_MS)
    before = {by: build_report(ledger, Grouping.parse(by), start_ms=whole[0], end_ms=whole[1], cost="trued")
              for by in ("namespace", "node")}
    reads.drop_minute_data(ledger, whole[1] + 10 * HOUR_MS)
    for by, report in before.items():
        again = build_report(ledger, Grouping.parse(by), start_ms=whole[0], end_ms=whole[1], cost="trued")
        assert reads.comparable(again) == reads.comparable(report) and again.reconciliation.reconciled
    ledger.close()


def test_the_bill_rollups_follow_a_trueup_and_the_backfill_equals_them_on_postgresql(database_url):
    from tests.unit.billing import test_read_rollups as reads
    from tests.unit.billing.data import make_ledger_0007 as recorded

    ledger = Ledger(database_url)
    ledger.migrate()
    ledger.write(*everything(recorded.results()))
    recorded._reconcile(ledger, recorded.FOCUS)
    reads.assert_rollups_are_the_bills_and_pod_lines(ledger)
    reads.check_upgrade_backfills_what_write_keeps(ledger)
    ledger.close()


def test_the_hourly_focus_grain_on_postgresql(database_url):
    """0015 on PostgreSQL: the hourly FOCUS rollups' upserts (the bulk path), a redelivery, a true-up's move,
    retention dropping the minute partitions (the hourly export unchanged) and then the hourly ones, the backfill's
    SQL -- the unit tests' checks, on a PostgreSQL ledger each."""
    from tests.unit.billing import test_focus_hourly as hourly

    def fresh():
        engine = create_engine(database_url)
        with engine.begin() as connection:
            connection.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
        engine.dispose()
        ledger = Ledger(database_url)
        ledger.migrate()
        return ledger

    for check in (lambda l: hourly.test_hourly_rows_are_the_sums_of_the_minute_rows_and_add_up_to_each_node_hours_bills(
                      l, hourly.SHARED),
                  hourly.test_a_redelivered_node_window_adds_nothing,
                  hourly.test_a_trueup_moves_the_hourly_billed_cost_with_its_minute_lines,
                  hourly.test_retention_of_the_minute_lines_leaves_the_hourly_export_unchanged,
                  hourly.check_the_backfill_equals_the_writes):
        ledger = fresh()
        try:
            check(ledger)
        finally:
            ledger.close()


def test_postgresqls_cost_lines_have_no_keys_and_sqlites_keep_them(database_url, tmp_path):
    """Migration 0013: on PostgreSQL the lines are checked by ``Ledger.write`` alone (the foreign keys' per-line
    triggers were half of inserting them; the primary key a third of a line's bytes), found by a (window, cluster,
    node) index; a write there still refuses a line without its bill, a repeated line and a redelivered node-window
    write nothing twice, and a true-up finds its lines. SQLite keeps its keys."""
    from services.billing.ledger import LedgerError

    ledger = Ledger(database_url)
    ledger.migrate()
    with ledger.engine.connect() as connection:
        keys = connection.execute(text(
            "SELECT contype FROM pg_constraint WHERE contype IN ('f', 'p') "
            "AND conrelid = 'cost_line_packs'::regclass")).all()
        indexes = set(connection.execute(text(
            "SELECT indexname FROM pg_indexes WHERE tablename = 'cost_line_packs'")).scalars())
        # From 0014 the lines are ids and ``cost_lines`` is a view over them (``line_ids``); from 0016 a
        # node-window's lines are one row (``line_packs``), keyed by (window start, node id): no key per line.
        kind = connection.execute(text("SELECT relkind FROM pg_class WHERE relname = 'cost_lines'")).scalar()
    assert [tuple(key) for key in keys] == [("p",)] and kind == "v"
    assert indexes == {"pk_cost_line_packs"}
    results = [bill_node_window(w, PriceCatalog.load()) for w in sample_shares(2)]
    costs, bills = everything(results)
    with pytest.raises(LedgerError, match="without its node bill"):
        ledger.write(costs, [])
    first = ledger.write(costs + costs[:5], bills)
    assert first.lines_written == len(costs) and ledger.write(costs, bills).lines_written == 0
    stored = ledger.totals()
    assert (stored.cost_lines, stored.cost_micro_usd) == (len(costs), sum(c.cost_micro_usd for c in costs))
    ledger.close()
    lite = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    lite.migrate()
    with lite.engine.connect() as connection:
        referred = {row[2] for row in connection.execute(text("PRAGMA foreign_key_list(cost_lines)"))}
    assert referred == {"node_bills", "label_sets"}
    lite.close()
