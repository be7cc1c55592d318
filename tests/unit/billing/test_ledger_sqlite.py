"""The SQL ledger on SQLite: migrations, idempotent bulk writes, totals and query helpers."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter, defaultdict

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import event, inspect, text
from sqlalchemy.dialects import sqlite

from schemas.records import CostSubjectKind
from services.billing.costing import bill_node_window
from services.billing.catalog import PriceCatalog
from services.billing.ledger import ONLY_ON, VERSION_TABLE, Grouping, Ledger, LedgerError, metadata
from tests.unit.billing.conftest import WINDOW_START_MS, sample_costs, sample_shares


def everything(results):
    return [c for r in results for c in r.costs], [r.bill for r in results]


def test_tables_exist_only_after_the_migration_and_match_the_model(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'fresh.sqlite3'}")
    assert inspect(ledger.engine).get_table_names() == []
    assert ledger.current_revision() is None
    with pytest.raises(LedgerError, match="schema revision none"):
        ledger.require_schema()
    assert ledger.migrate() == Ledger.head_revision()
    assert ledger.migrate() == Ledger.head_revision()  # a second run is a no-op
    assert set(inspect(ledger.engine).get_table_names()) == {"cost_lines", "label_sets", "node_bills", "price_versions",
                                                             "trueups", "cost_rollup_hourly", "cost_rollup_daily",
                                                             "ledger_retention", "bill_rollup_hourly",
                                                             "bill_rollup_daily", "pod_rollup_hourly",
                                                             "pod_rollup_daily", "focus_charge_hourly",
                                                             "focus_line_hourly", VERSION_TABLE}
    with ledger.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={
            "version_table": VERSION_TABLE, "compare_type": True,
            # PostgreSQL's own index of the lines (migration 0013) is not SQLite's.
            "include_object": lambda obj, name, type_, reflected, compare_to: reflected or obj.info.get(
                ONLY_ON, "sqlite") == "sqlite"})
        assert compare_metadata(context, metadata) == []
    ledger.require_schema()
    ledger.close()


def test_write_then_totals_equal_the_node_bills(sqlite_ledger):
    results = sample_costs()
    costs, bills = everything(results)
    outcome = sqlite_ledger.write(costs, bills)
    assert (outcome.bills_written, outcome.bills_skipped, outcome.lines_written) == (len(bills), 0, len(costs))
    totals = sqlite_ledger.totals()
    assert totals.bill_micro_usd == sum(b.node_cost_micro_usd for b in bills)
    assert totals.cost_micro_usd == totals.bill_micro_usd
    assert (totals.cost_lines, totals.node_windows) == (len(costs), len(bills))
    expected_by_kind = Counter()
    for cost in costs:
        expected_by_kind[cost.subject_kind.value] += cost.cost_micro_usd
    assert dict(totals.by_subject_kind) == dict(expected_by_kind)
    stored = list(sqlite_ledger.iter_cost_lines())
    def key(c):
        return (c.window_start_unix_ms, c.node_name, c.gpu_uuid or "", c.subject_kind.value, c.pod_uid or "")

    assert sorted(stored, key=key) == sorted(costs, key=key)
    bill_rows = sqlite_ledger.bills()
    assert [r["node_cost_micro_usd"] for r in bill_rows] == [
        b.node_cost_micro_usd for b in sorted(bills, key=lambda b: (b.window_start_unix_ms, b.cluster, b.node_name))]
    with sqlite_ledger.engine.connect() as connection:
        versions = connection.execute(text("SELECT price_version, split_rule FROM price_versions")).all()
    assert {v for v, _ in versions} == {b.price_version for b in bills}


def test_the_same_shares_delivered_twice_bill_once(sqlite_ledger):
    catalog = PriceCatalog.load()
    results = sample_costs()
    assert sqlite_ledger.write(*everything(results)).bills_written == len(results)
    before = sqlite_ledger.totals()

    # Redelivered through a fresh consumer (state lost): every node-window is costed again.
    again = [bill_node_window(window, catalog) for window in sample_shares()]
    assert len(again) == len(results)
    outcome = sqlite_ledger.write(*everything(again))
    assert (outcome.bills_written, outcome.bills_skipped, outcome.lines_written) == (0, len(results), 0)
    assert sqlite_ledger.totals() == before

    # A batch mixing a redelivered node-window with a new one writes only the new one.
    newer = sample_costs(1, start_ms=results[-1].bill.window_start_unix_ms + 60_000)
    outcome = sqlite_ledger.write(*everything(results[:1] + newer))
    assert (outcome.bills_written, outcome.bills_skipped) == (len(newer), 1)
    after = sqlite_ledger.totals()
    assert after.bill_micro_usd == before.bill_micro_usd + sum(r.bill.node_cost_micro_usd for r in newer)
    assert after.cost_micro_usd == after.bill_micro_usd


def test_a_write_that_does_not_reconcile_is_refused_whole(sqlite_ledger):
    costs, bills = everything(sample_costs(1))
    tampered = [dataclasses.replace(costs[0], cost_micro_usd=costs[0].cost_micro_usd + 1)] + costs[1:]
    with pytest.raises(LedgerError, match="refusing"):
        sqlite_ledger.write(tampered, bills)
    with pytest.raises(LedgerError, match="without its node bill"):
        sqlite_ledger.write(costs, bills[:1])
    with pytest.raises(LedgerError, match="two different cost lines"):
        sqlite_ledger.write(costs + [dataclasses.replace(costs[0], cost_share=0.5)], bills)
    assert sqlite_ledger.totals().node_windows == 0
    assert sqlite_ledger.write([], []).bills_written == 0


def test_writes_are_bulk_not_per_row(sqlite_ledger):
    costs, bills = everything(sample_costs(10))
    assert len(costs) > 400
    statements = []
    listener = lambda *args: statements.append(args[2])  # noqa: E731
    event.listen(sqlite_ledger.engine, "before_cursor_execute", listener)
    try:
        sqlite_ledger.write(costs, bills)
    finally:
        event.remove(sqlite_ledger.engine, "before_cursor_execute", listener)
    inserts = [s for s in statements if s.lstrip().upper().startswith("INSERT")]
    # At most one per table written (price versions, bills, label sets, lines, eight rollup tables), never per row.
    assert 3 <= len(inserts) <= 12
    assert len(inserts) == len({s.split("(")[0] for s in inserts})
    assert sqlite_ledger.totals().cost_lines == len(costs)


def test_cost_by_groups_by_namespace_label_node_and_gpu(sqlite_ledger):
    costs, bills = everything(sample_costs(2))
    sqlite_ledger.write(costs, bills)
    expected = {kind: defaultdict(int) for kind in ("namespace", "team", "node", "gpu")}
    for c in costs:
        expected["namespace"][(c.subject_kind.value, c.namespace)] += c.cost_micro_usd
        expected["team"][(c.subject_kind.value, c.labels.get("team"))] += c.cost_micro_usd
        expected["node"][(c.subject_kind.value, c.node_name)] += c.cost_micro_usd
        expected["gpu"][(c.subject_kind.value, c.gpu_uuid)] += c.cost_micro_usd
    for name, grouping in (("namespace", Grouping("namespace")), ("team", Grouping.parse("label:team")),
                           ("node", Grouping.parse("node")), ("gpu", Grouping.parse("gpu"))):
        rows = sqlite_ledger.cost_by(grouping)
        assert {(r.subject_kind, r.group): r.cost_micro_usd for r in rows} == dict(expected[name]), name
    window = sqlite_ledger.cost_by(Grouping("node"), start_ms=bills[-1].window_start_unix_ms)
    assert sum(r.cost_micro_usd for r in window) == sum(
        b.node_cost_micro_usd for b in bills if b.window_start_unix_ms == bills[-1].window_start_unix_ms)
    assert {r.subject_kind for r in sqlite_ledger.cost_by(Grouping("gpu"))} == {k.value for k in CostSubjectKind}


def test_bad_urls_and_groupings_are_typed_errors(tmp_path):
    for url in ("not a url", "mysql+pymysql://u@h/db", "sqlite+nodriver:///x"):
        with pytest.raises(LedgerError):
            Ledger(url)
    ledger = Ledger(f"sqlite:///{tmp_path / 'missing-dir' / 'x.sqlite3'}")
    with pytest.raises(LedgerError):
        ledger.migrate()
    from gpumeter.errors import ConfigError

    for bad in ("pods", "pod:x", "label:", "label:bad key", "node:x"):
        with pytest.raises(ConfigError):
            Grouping.parse(bad)
    assert Ledger.from_env({"GPUMETER_LEDGER_URL": "postgres://u@h/db"}).url == "postgresql+psycopg://u@h/db"


def test_unpublished_windows_are_reported_until_marked_published(sqlite_ledger):
    results = sample_costs()
    keys = {r.bill.key for r in results}
    first = sqlite_ledger.write(*everything(results))
    assert first.written == keys and first.unpublished == frozenset()
    # Redelivered before anything was marked published: every window comes back to be published.
    assert sqlite_ledger.write(*everything(results)).unpublished == keys
    marked = sorted(keys, key=lambda k: k.window_start_unix_ms)[:1]
    assert sqlite_ledger.mark_published(marked, 123) == 1
    assert sqlite_ledger.mark_published(marked, 456) == 0  # marking is once
    assert sqlite_ledger.write(*everything(results)).unpublished == keys - set(marked)
    # A recomputed bill that differs from the stored one is not republished (the ledger keeps the first).
    changed = [
        dataclasses.replace(r, bill=dataclasses.replace(r.bill, price=dataclasses.replace(r.bill.price,
                                                                                          price_version="other")))
        for r in results
    ]
    assert {r.bill.price_version for r in changed} == {"other"}
    assert sqlite_ledger.write(*everything(changed)).unpublished == frozenset()


def test_only_the_publisher_whose_write_inserted_a_window_is_told_to_publish_it(tmp_path):
    """Two billing instances (consumer groups) on one ledger: the ledger is the arbiter of who publishes."""
    url = f"sqlite:///{tmp_path / 'shared.sqlite3'}"
    results = sample_costs()
    keys = {r.bill.key for r in results}
    with Ledger(url, publisher="group-a") as a, Ledger(url, publisher="group-b") as b:
        a.migrate()
        first = a.write(*everything(results))
        assert first.written == keys
        # The other group writes the same windows before the first one's cost records were acknowledged.
        second = b.write(*everything(results))
        assert (second.written, second.unpublished, second.others) == (frozenset(), frozenset(), keys)
        # The first group re-reading them (a crash between the ledger and Kafka) publishes them, once marked no more.
        assert a.write(*everything(results)).unpublished == keys
        assert a.mark_published(keys, 1) == len(keys)
        assert a.write(*everything(results)).unpublished == b.write(*everything(results)).others == frozenset()
        assert {row["publisher"] for row in a.bills()} == {"group-a"}


def test_a_bill_written_before_publishers_were_recorded_is_claimed_by_one_publisher_only(tmp_path):
    url = f"sqlite:///{tmp_path / 'legacy.sqlite3'}"
    results = sample_costs()
    keys = {r.bill.key for r in results}
    with Ledger(url) as legacy, Ledger(url, publisher="group-a") as a, Ledger(url, publisher="group-b") as b:
        legacy.migrate()
        legacy.write(*everything(results))  # as revision 0002 wrote them: no publisher, never published
        assert {row["publisher"] for row in legacy.bills()} == {None}
        assert b.write(*everything(results)).unpublished == keys  # the first to find them claims them
        assert a.write(*everything(results)).others == keys
        assert b.write(*everything(results)).unpublished == keys
        assert {row["publisher"] for row in legacy.bills()} == {"group-b"}


@pytest.mark.parametrize("break_it, what", [
    (lambda db: db.parent.rename(db.parent.with_name("elsewhere")), "does not exist"),
    (lambda db: db.with_name(db.name + "-wal").mkdir(), "-wal is not a regular file"),
    (lambda db: os.mkfifo(db.with_name(db.name + "-shm")), "-shm is not a regular file"),
    (lambda db: (db.unlink(), db.mkdir()), "ledger.sqlite3 is not a regular file"),
], ids=["folder gone", "wal a folder", "shm a fifo", "database a folder"])
def test_unusable_sqlite_files_are_reported_before_sqlite_touches_them_and_retried(tmp_path, break_it, what):
    """A ledger whose files cannot be used says which and why, without calling SQLite (which maps the -shm), as a
    ``LedgerUnusable`` billing retries; once the files are fixed the same ledger works."""
    import shutil

    from services.billing.ledger import LedgerUnusable
    from services.billing.service import is_transient_ledger_error

    folder = tmp_path / "ledger"
    folder.mkdir()
    db = folder / "ledger.sqlite3"
    with Ledger(f"sqlite:///{db}") as ledger:
        ledger.migrate()
    backup = tmp_path / "backup.sqlite3"
    shutil.copy(db, backup)
    ledger = Ledger(f"sqlite:///{db}")
    connects = []
    event.listen(ledger.engine, "connect", lambda *args: connects.append(1))
    break_it(db)
    with pytest.raises(LedgerUnusable, match=what) as refused:
        ledger.migrate()
    assert is_transient_ledger_error(refused.value) and connects == []  # SQLite never opened it
    # fixed: the folder back, the stray files gone, the database restored
    if not folder.exists():
        folder.with_name("elsewhere").rename(folder)
    for stray in (db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm"), db):
        if stray.is_dir():
            stray.rmdir()
        elif stray.exists() and not stray.is_file():
            stray.unlink()
    if not db.exists():
        shutil.copy(backup, db)
    assert ledger.migrate() == Ledger.head_revision()
    assert ledger.close()


def _all_rows(ledger):
    with ledger.engine.connect() as connection:
        return {table: sorted(connection.execute(text(f"SELECT * FROM {table}")).all(), key=repr)
                for table in ("node_bills", "cost_lines", "price_versions")}


class _CoreLinesInsert:
    """The cost lines through SQLAlchemy's Core ``INSERT ... ON CONFLICT DO NOTHING`` executemany."""

    def execute(self, connection, rows):
        from services.billing.ledger import LINE_COLUMNS, cost_lines

        connection.execute(sqlite.insert(cost_lines).on_conflict_do_nothing(),
                           [dict(zip(LINE_COLUMNS, row)) for row in rows])


def test_the_bulk_line_insert_stores_what_the_core_statement_stores(tmp_path, monkeypatch):
    """The cost lines go through one bulk statement (``Ledger._insert_lines``, ``bulk_rows``); every column of
    every row must be what SQLAlchemy's Core statement stores for the same lines."""
    import services.billing.ledger as ledger_module

    fast, core = (Ledger(f"sqlite:///{tmp_path / name}") for name in ("fast.sqlite3", "core.sqlite3"))
    odd = dataclasses.replace  # lines as awkward as the ledger takes: unicode labels, None names, shared lines
    results = sample_costs(2) + sample_costs(2, start_ms=WINDOW_START_MS + 600_000, sharing="idle=weighted")
    costs, bills = everything(results)
    costs = [odd(c, labels={**c.labels, "tëam": "ünï \"q\"", "n": "1"}, namespace=None) if i % 3 == 0 else c
             for i, c in enumerate(costs)]
    assert any(c.shared_from is not None for c in costs)
    bulk = ledger_module._LINES_INSERT
    try:
        for ledger, lines_insert in ((fast, bulk), (core, _CoreLinesInsert())):
            monkeypatch.setattr(ledger_module, "_LINES_INSERT", lines_insert)
            ledger.migrate()
            outcome = ledger.write(costs, bills)
            assert outcome.lines_written == len(costs)
            assert ledger.write(costs, bills).lines_written == 0  # a repeat inserts nothing
        assert _all_rows(fast) == _all_rows(core)
        assert _all_rows(fast)["cost_lines"]
        assert sorted(fast.iter_cost_lines(), key=repr) == sorted(core.iter_cost_lines(), key=repr)
    finally:
        fast.close()
        core.close()


def test_line_values_are_the_line_row_in_column_order():
    from services.billing.ledger import LINE_COLUMNS, _line_row, _line_values

    for result in sample_costs(1) + sample_costs(1, sharing="idle=even"):
        for cost in result.costs:
            row = _line_row(cost, 7)
            assert tuple(row) == LINE_COLUMNS
            assert _line_values(cost, 7) == tuple(row.values())


def test_a_line_offered_twice_in_one_write_is_one_line(sqlite_ledger):
    """The same cost record twice (a batch holding a redelivered message's records again) is one line: counted
    once in the bill's check, stored once; an equal copy of it too."""
    results = sample_costs(2)
    costs, bills = everything(results)
    repeated = costs + costs[:3] + [dataclasses.replace(costs[3])]
    outcome = sqlite_ledger.write(repeated, bills)
    assert outcome.lines_written == len(costs) and outcome.bills_written == len(bills)
    totals = sqlite_ledger.totals()
    assert (totals.cost_lines, totals.cost_micro_usd) == (len(costs), sum(c.cost_micro_usd for c in costs))
