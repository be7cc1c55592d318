"""PostgreSQL's cost lines packed by node-window (migration 0016, ``services.billing.line_packs``) on a real server:
a ledger written at 0015 (trued up) upgraded answers every reader as before to the micro-dollar, a true-up
rewrites the packs' trued-up arrays, the downgrade gives 0015's rows back, and the packs hold every line once."""

from __future__ import annotations

import pytest
from alembic import command
from sqlalchemy import text

from services.billing.ledger import Ledger, _alembic_config
from tests.integration.test_ledger_line_ids_postgres import lines_rows, relkind
from tests.integration.test_ledger_postgres import database_url  # noqa: F401 (a fixture)
from tests.unit.billing.data import make_ledger_0007 as recorded
from tests.unit.billing.ledger_outputs import output_digests
from tests.unit.billing.test_ledger_compact import FIXTURE, assert_answers

pytestmark = pytest.mark.postgres

GRAINS = ("minute", "auto")


def packs(ledger: Ledger) -> list[tuple]:
    """(window start, node id, lines, trued-up array) of every pack, sorted."""
    with ledger.engine.connect() as connection:
        return sorted(tuple(row) for row in connection.execute(text(
            "SELECT window_start_unix_ms, node_id, cardinality(cost_micro_usd), trued_cost_micro_usd "
            "FROM cost_line_packs")))


def trued_bills(ledger: Ledger) -> dict[tuple[int, int], int | None]:
    """Each pack's window's trued-up cost, as its bill says (by (window start, node id))."""
    with ledger.engine.connect() as connection:
        return {(start, node): trued for start, node, trued in connection.execute(text(
            "SELECT b.window_start_unix_ms, n.node_id, b.trued_cost_micro_usd FROM node_bills b "
            "JOIN ledger_nodes n ON n.cluster = b.cluster AND n.node_name = b.node_name"))}


def assert_packs_hold_the_lines(ledger: Ledger) -> None:
    """One pack per node-window with stored lines, every line once; a pack's trued-up array NULL exactly where its
    bill is not trued up, and else adding up to the bill's trued-up cost (its zero lines trued to 0)."""
    held = packs(ledger)
    with ledger.engine.connect() as connection:
        lines, windows = connection.execute(text(
            "SELECT count(*), count(DISTINCT (window_start_unix_ms, cluster, node_name)) FROM cost_lines")).one()
    assert len(held) == windows > 0 and sum(n for _s, _n, n, _t in held) == lines
    bills = trued_bills(ledger)
    for start, node, count, trued in held:
        if bills[(start, node)] is None:
            assert trued is None
        else:
            assert len(trued) == count and None not in trued and sum(trued) == bills[(start, node)]


def test_a_trued_ledger_written_at_0015_answers_the_same_after_the_upgrade_and_after_going_back(database_url):
    ledger = Ledger(database_url)
    ledger.migrate()
    priced = recorded.results()
    ledger.write([c for r in priced for c in r.costs], [r.bill for r in priced])
    # Trued up at head, then taken down to 0015: a ledger of trued rows as 0015 held it.
    assert recorded._reconcile(ledger, recorded.FOCUS) == FIXTURE["reconcile"]
    with ledger.engine.begin() as connection:
        command.downgrade(_alembic_config(connection), "0015_focus_hourly")
    assert relkind(ledger, "cost_line_rows") == "p" and relkind(ledger, "cost_line_packs") is None
    start, end = FIXTURE["start_ms"], FIXTURE["end_ms"]
    # Every report grouping (list and trued), the FOCUS export and /allocation, as digests of their output.
    answers = {grain: output_digests(ledger, start, end, grain=grain) for grain in GRAINS}
    rows = lines_rows(ledger)
    assert rows and any(row[12] is not None for row in rows) and any(row[12] is None for row in rows)

    assert ledger.migrate() == Ledger.head_revision() == "0018_bill_ids"
    assert relkind(ledger, "cost_lines") == "v" and relkind(ledger, "cost_line_packs") == "p"
    assert relkind(ledger, "cost_line_rows") is None
    # The view gives every column of every row as the rows held it; every reader answers as at 0015.
    assert lines_rows(ledger) == rows
    assert {grain: output_digests(ledger, start, end, grain=grain) for grain in GRAINS} == answers
    assert_answers(ledger, FIXTURE["outputs"])
    assert_packs_hold_the_lines(ledger)
    # The amended bill trues the packs up again (their arrays rewritten): as the recorded ledger was at 0007.
    assert recorded._reconcile(ledger, recorded.FOCUS_AMENDED) == FIXTURE["amended"]["reconcile"]
    assert_answers(ledger, FIXTURE["amended"]["outputs"])
    assert_packs_hold_the_lines(ledger)
    amended = lines_rows(ledger)
    amended_answers = {grain: output_digests(ledger, start, end, grain=grain) for grain in GRAINS}

    with ledger.engine.begin() as connection:
        command.downgrade(_alembic_config(connection), "0015_focus_hourly")
    assert relkind(ledger, "cost_line_rows") == "p" and relkind(ledger, "cost_line_packs") is None
    assert lines_rows(ledger) == amended
    assert {grain: output_digests(ledger, start, end, grain=grain) for grain in GRAINS} == amended_answers
    assert ledger.migrate() == "0018_bill_ids"
    assert lines_rows(ledger) == amended
    assert_answers(ledger, FIXTURE["amended"]["outputs"])
    ledger.close()


def test_a_true_up_writes_every_trued_line_of_a_window_into_its_pack_and_a_repeat_changes_nothing(database_url):
    ledger = Ledger(database_url)
    ledger.migrate()
    priced = recorded.results()
    ledger.write([c for r in priced for c in r.costs], [r.bill for r in priced])
    untrued = packs(ledger)
    assert all(trued is None for *_rest, trued in untrued)
    assert recorded._reconcile(ledger, recorded.FOCUS) == FIXTURE["reconcile"]
    trued = packs(ledger)
    assert [p[:3] for p in trued] == [p[:3] for p in untrued]
    # Some windows trued up (their whole array), some not (the bill's 12 of 16 node-windows).
    assert any(t is None for *_r, t in trued) and any(t is not None for *_r, t in trued)
    assert_packs_hold_the_lines(ledger)
    with ledger.engine.connect() as connection:
        versions = dict(connection.execute(text(
            "SELECT (window_start_unix_ms, node_id)::text, xmin::text FROM cost_line_packs")).all())
    # The same bill again: no pack written (only values that differ are).
    assert "ledger: 0 node-windows and 0 cost lines changed" in recorded._reconcile(ledger, recorded.FOCUS)
    with ledger.engine.connect() as connection:
        assert dict(connection.execute(text(
            "SELECT (window_start_unix_ms, node_id)::text, xmin::text FROM cost_line_packs")).all()) == versions
    assert packs(ledger) == trued
    ledger.close()
