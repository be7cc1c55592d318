"""PostgreSQL's node bills by dictionary ids (migration 0018, ``services.billing.bill_ids``) on a real server: a
trued ledger written at 0017 upgraded answers every reader as before to the micro-dollar and trues up again through
the rows, the downgrade gives 0017's table back; the write path stores one row per bill and each zero set once,
refuses a zero set's id that holds other lines, publishes and claims through the rows; a range read of the view
scans only its days' partitions."""

from __future__ import annotations

import dataclasses

import pytest
from alembic import command
from sqlalchemy import text

from services.billing import bill_ids
from services.billing.ledger import Ledger, LedgerError, _alembic_config
from tests.integration.test_ledger_line_ids_postgres import lines_rows, relkind
from tests.integration.test_ledger_postgres import database_url, everything  # noqa: F401 (a fixture)
from tests.unit.billing.conftest import WINDOW_START_MS, sample_costs
from tests.unit.billing.data import make_ledger_0007 as recorded
from tests.unit.billing.ledger_outputs import output_digests
from tests.unit.billing.test_ledger_compact import FIXTURE, assert_answers

pytestmark = pytest.mark.postgres

GRAINS = ("minute", "auto")
DAY_MS = 86_400_000


def bills_rows(ledger: Ledger) -> list[tuple]:
    """Every ``node_bills`` row (0017's table or 0018's view), all columns in their order, sorted."""
    with ledger.engine.connect() as connection:
        return sorted(tuple(row) for row in connection.execute(text("SELECT * FROM node_bills")))


def bill_columns(ledger: Ledger) -> list[tuple[str, str]]:
    """(name, type) of ``node_bills``' columns in their order."""
    with ledger.engine.connect() as connection:
        return [tuple(row) for row in connection.execute(text(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = "
            "'node_bills'::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum"))]


def count(ledger: Ledger, sql: str) -> int:
    with ledger.engine.connect() as connection:
        return int(connection.execute(text(sql)).scalar_one())


def assert_zero_sets_are_their_texts_ids(ledger: Ledger) -> None:
    """Every stored zero set's id is ``bill_ids.zero_set_id`` of its text (the migration's SQL computes it too),
    and every bill names a stored one or none."""
    with ledger.engine.connect() as connection:
        sets = dict(connection.execute(text("SELECT zero_set_id, zero_lines FROM ledger_zero_sets")).all())
        named = set(connection.execute(text(
            "SELECT DISTINCT zero_set_id FROM node_bill_rows WHERE zero_set_id IS NOT NULL")).scalars())
    assert sets and all(bill_ids.zero_set_id(zero) == i for i, zero in sets.items())
    assert named <= set(sets)


def test_a_trued_ledger_written_at_0017_answers_the_same_after_the_upgrade_and_after_going_back(database_url):
    ledger = Ledger(database_url, publisher="billing-a")
    ledger.migrate()
    priced = recorded.results()
    ledger.write([c for r in priced for c in r.costs], [r.bill for r in priced])
    ledger.mark_published([r.bill.key for r in priced[:5]], 1_794_300_000_000)
    # Trued up at head, then taken down to 0017: a ledger of trued, published and unpublished bills as 0017 held it.
    assert recorded._reconcile(ledger, recorded.FOCUS) == FIXTURE["reconcile"]
    columns = bill_columns(ledger)
    with ledger.engine.begin() as connection:
        command.downgrade(_alembic_config(connection), "0017_focus_line_ids")
    assert relkind(ledger, "node_bills") == "p" and relkind(ledger, "node_bill_rows") is None
    assert relkind(ledger, "ledger_zero_sets") is None and bill_columns(ledger) == columns
    start, end = FIXTURE["start_ms"], FIXTURE["end_ms"]
    # Every report grouping (list and trued), the FOCUS export and /allocation, as digests of their output.
    answers = {grain: output_digests(ledger, start, end, grain=grain) for grain in GRAINS}
    bills, lines = bills_rows(ledger), lines_rows(ledger)
    # The bills hold what the view must give back: trued and not, published and not, with and without zero lines.
    assert any(row[18] is not None for row in bills) and any(row[18] is None for row in bills)
    assert {row[17] for row in bills} == {"billing-a"} and {row[14] is None for row in bills} == {True, False}
    assert any(row[21] is None for row in bills) or all(row[21] for row in bills)

    assert ledger.migrate() == Ledger.head_revision() == "0018_bill_ids"
    assert relkind(ledger, "node_bills") == "v" and relkind(ledger, "node_bill_rows") == "p"
    # The view gives every column of every bill, in 0017's order and types; every reader answers as at 0017.
    assert bill_columns(ledger) == columns and bills_rows(ledger) == bills and lines_rows(ledger) == lines
    assert {grain: output_digests(ledger, start, end, grain=grain) for grain in GRAINS} == answers
    assert_answers(ledger, FIXTURE["outputs"])
    assert_zero_sets_are_their_texts_ids(ledger)
    # A node's bills repeat one kind: fewer kinds than bills, fewer zero sets than bills with zero lines.
    assert count(ledger, "SELECT count(*) FROM ledger_bill_kinds") < len(bills)
    assert count(ledger, "SELECT count(*) FROM ledger_zero_sets") < sum(1 for row in bills if row[21])
    # The amended bill trues the rows up again: as the recorded ledger was at 0007.
    assert recorded._reconcile(ledger, recorded.FOCUS_AMENDED) == FIXTURE["amended"]["reconcile"]
    assert_answers(ledger, FIXTURE["amended"]["outputs"])
    amended, amended_answers = bills_rows(ledger), {grain: output_digests(ledger, start, end, grain=grain)
                                                    for grain in GRAINS}
    assert amended != bills

    with ledger.engine.begin() as connection:
        command.downgrade(_alembic_config(connection), "0017_focus_line_ids")
    assert relkind(ledger, "node_bills") == "p" and bills_rows(ledger) == amended
    assert {grain: output_digests(ledger, start, end, grain=grain) for grain in GRAINS} == amended_answers
    assert ledger.migrate() == "0018_bill_ids"
    assert bills_rows(ledger) == amended
    assert_answers(ledger, FIXTURE["amended"]["outputs"])
    # Written again after the upgrade: the migration's zero set ids are the writer's (nothing new, nothing twice).
    sets = count(ledger, "SELECT count(*) FROM ledger_zero_sets")
    assert ledger.write([c for r in priced for c in r.costs], [r.bill for r in priced]).bills_written == 0
    later = [dataclasses.replace(r, bill=dataclasses.replace(r.bill, window_start_unix_ms=r.bill.window_start_unix_ms
                                                             + 30 * DAY_MS),
                                 costs=tuple(dataclasses.replace(c, window_start_unix_ms=c.window_start_unix_ms
                                                                 + 30 * DAY_MS) for c in r.costs)) for r in priced]
    assert ledger.write([c for r in later for c in r.costs], [r.bill for r in later]).bills_written == len(later)
    assert count(ledger, "SELECT count(*) FROM ledger_zero_sets") == sets
    assert_zero_sets_are_their_texts_ids(ledger)
    ledger.close()


def test_a_write_stores_a_row_per_bill_and_each_zero_set_once(database_url):
    ledger = Ledger(database_url)
    ledger.migrate()
    results = recorded.results()
    costs, bills = everything(results)
    written = ledger.write(costs, bills)
    assert written.bills_written == len(bills) and written.lines_elided > 0
    assert count(ledger, "SELECT count(*) FROM node_bill_rows") == len(bills)
    # A node lists the same zero lines window after window: a set per node at most, named by its bills.
    listed = count(ledger, "SELECT count(*) FROM node_bill_rows WHERE zero_set_id IS NOT NULL")
    sets = count(ledger, "SELECT count(*) FROM ledger_zero_sets")
    assert 0 < sets <= len({b.node_name for b in bills}) < listed
    assert count(ledger, "SELECT count(DISTINCT zero_set_id) FROM node_bill_rows") == sets
    assert_zero_sets_are_their_texts_ids(ledger)
    assert ledger.write(costs, bills).bills_written == 0
    assert count(ledger, "SELECT count(*) FROM node_bill_rows") == len(bills)
    totals = ledger.totals()
    assert totals.cost_micro_usd == totals.bill_micro_usd == sum(b.node_cost_micro_usd for b in bills)
    assert totals.cost_lines == len(costs) and totals.node_windows == len(bills)
    ledger.close()


def test_a_zero_set_id_holding_other_zero_lines_is_refused_and_nothing_is_written(database_url):
    ledger = Ledger(database_url)
    ledger.migrate()
    first, *later = [r for r in recorded.results() if r.bill.node_name == "gpu-spot-a"]
    ledger.write(*everything([first]))
    with ledger.engine.begin() as connection:
        (zero_id, zero_lines), = connection.execute(text("SELECT zero_set_id, zero_lines FROM ledger_zero_sets"))
        connection.execute(text("UPDATE ledger_zero_sets SET zero_lines = :z"), {"z": zero_lines + " "})
    # A fresh handle (this one knows the set is stored and would not look): the node's next windows list the same
    # zero lines, whose id now holds others.
    with Ledger(database_url) as other:
        with pytest.raises(LedgerError, match=f"zero set {zero_id}"):
            other.write(*everything(later))
        assert other.totals().node_windows == 1
    ledger.close()


def test_publishing_and_claiming_go_through_the_rows(database_url):
    """Two billing instances (consumer groups) on one PostgreSQL ledger: only the inserting publisher is told to
    publish, marking published stops it; a bill without publisher is claimed by the first publisher only."""
    results = sample_costs()
    keys = {r.bill.key for r in results}
    with Ledger(database_url, publisher="group-a") as a, Ledger(database_url, publisher="group-b") as b:
        a.migrate()
        assert a.write(*everything(results)).written == keys
        second = b.write(*everything(results))
        assert (second.written, second.unpublished, second.others) == (frozenset(), frozenset(), keys)
        assert a.write(*everything(results)).unpublished == keys
        assert a.mark_published(keys, 1) == len(keys) and a.mark_published(keys, 2) == 0
        assert a.write(*everything(results)).unpublished == b.write(*everything(results)).others == frozenset()
        assert {(row["publisher"], row["published_at_unix_ms"]) for row in a.bills()} == {("group-a", 1)}
        # Bills from before publishers were recorded (0002): the first group to find them claims them.
        later = sample_costs(start_ms=WINDOW_START_MS + 3_600_000)
        later_keys = {r.bill.key for r in later}
        with Ledger(database_url) as legacy:
            legacy.write(*everything(later))
            assert {row["publisher"] for row in legacy.bills(start_ms=WINDOW_START_MS + 3_600_000)} == {None}
        assert b.write(*everything(later)).unpublished == later_keys
        assert a.write(*everything(later)).others == later_keys
        assert b.write(*everything(later)).unpublished == later_keys
        assert {row["publisher"] for row in a.bills(start_ms=WINDOW_START_MS + 3_600_000)} == {"group-b"}
        # A claim racing another (the bill read without publisher, claimed by the other group since) changes
        # nothing: the update's condition, not the read, decides.
        key = min(later_keys)
        with a.engine.begin() as connection:
            assert not a._claim(connection, key.window_start_unix_ms, key.cluster, key.node_name)
        assert {row["publisher"] for row in a.bills(start_ms=WINDOW_START_MS + 3_600_000)} == {"group-b"}
    assert count_names(database_url) == {"group-a", "group-b"}


def count_names(url: str) -> set[str]:
    with Ledger(url) as ledger, ledger.engine.connect() as connection:
        return set(connection.execute(text("SELECT name FROM ledger_bill_names")).scalars())


def test_a_days_range_of_the_bills_view_scans_that_days_partition_only(database_url):
    ledger = Ledger(database_url)
    ledger.migrate()
    for day in range(3):
        ledger.write(*everything(sample_costs(2, start_ms=WINDOW_START_MS + day * DAY_MS)))
    start = WINDOW_START_MS + DAY_MS - WINDOW_START_MS % DAY_MS
    with ledger.engine.connect() as connection:
        plan = "\n".join(connection.execute(text(
            "EXPLAIN SELECT cluster, sum(node_cost_micro_usd), count(*) FROM node_bills "
            "WHERE window_start_unix_ms >= :s AND window_start_unix_ms < :e GROUP BY cluster"),
            {"s": start, "e": start + DAY_MS}).scalars())
        attached = set(connection.execute(text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'node_bill_rows'::regclass")).scalars())
    scanned = {name for name in attached if name in plan}
    assert len(attached) >= 3 and len(scanned) == 1, plan
    # A sum that reads no text of the names or the zero sets does not join them (outer joins to unique keys).
    assert "ledger_zero_sets" not in plan and "ledger_bill_names" not in plan, plan
    ledger.close()
