"""PostgreSQL's cost lines by dictionary ids (migration 0014, ``services.billing.line_ids``) on a real server: a
ledger written at 0013 upgraded answers every reader as before to the micro-dollar (and as the recorded ledger
did), a true-up writes through the ids, the downgrade gives 0013's rows back, a range read scans only its days'
partitions, and concurrent writers of new nodes, GPUs and pods get one id per key."""

from __future__ import annotations

import threading

import pytest
from alembic import command
from sqlalchemy import text

from services.billing.ledger import Ledger, _alembic_config
from services.billing.line_storage import zero_line_gpu_ids
from tests.integration.test_ledger_postgres import database_url, everything  # noqa: F401 (a fixture)
from tests.unit.billing.conftest import WINDOW_START_MS, sample_costs
from tests.unit.billing.data import make_ledger_0007 as recorded
from tests.unit.billing.ledger_outputs import output_digests
from tests.unit.billing.test_ledger_compact import FIXTURE, assert_answers

pytestmark = pytest.mark.postgres


def lines_rows(ledger: Ledger) -> list[tuple]:
    """Every ``cost_lines`` row (0013's table or 0014's view), all columns, sorted."""
    with ledger.engine.connect() as connection:
        return sorted(tuple(row) for row in connection.execute(text("SELECT * FROM cost_lines")))


def zero_line_texts(ledger: Ledger) -> list[str]:
    with ledger.engine.connect() as connection:
        return list(connection.execute(text("SELECT zero_lines FROM node_bills WHERE zero_lines IS NOT NULL"))
                    .scalars())


def relkind(ledger: Ledger, name: str) -> str | None:
    with ledger.engine.connect() as connection:
        return connection.execute(text("SELECT relkind FROM pg_class WHERE relname = :n"), {"n": name}).scalar()


def test_a_ledger_written_at_0013_answers_the_same_after_the_upgrade_and_after_going_back(database_url):
    ledger = Ledger(database_url)
    ledger.migrate()
    # A ledger at 0013: written by Ledger.write at head, then taken down to 0013 (0015 drops the hourly FOCUS
    # grain, 0014 gives the lines back their 0013 table and the zero lines their uuids).
    priced = recorded.results()
    ledger.write([c for r in priced for c in r.costs], [r.bill for r in priced])
    with ledger.engine.begin() as connection:
        command.downgrade(_alembic_config(connection), "0013_lean_lines")
    assert relkind(ledger, "cost_lines") == "p" and relkind(ledger, "cost_line_rows") is None
    assert not any(zero_line_gpu_ids(text_) for text_ in zero_line_texts(ledger))
    start, end = FIXTURE["start_ms"], FIXTURE["end_ms"]
    # Every report grouping (list and trued), the FOCUS export and /allocation, as digests of their output.
    answers = {grain: output_digests(ledger, start, end, grain=grain) for grain in ("minute", "auto")}
    rows = lines_rows(ledger)
    assert rows

    with ledger.engine.begin() as connection:
        command.upgrade(_alembic_config(connection), "0015_focus_hourly")
    assert relkind(ledger, "cost_lines") == "v" and relkind(ledger, "cost_line_rows") == "p"
    # The view gives every column of every row as the table held it; every reader answers as at 0013.
    assert lines_rows(ledger) == rows
    assert {grain: output_digests(ledger, start, end, grain=grain) for grain in ("minute", "auto")} == answers
    # At head (0016 packs the rows by node-window: test_ledger_line_packs_postgres) the same.
    assert ledger.migrate() == Ledger.head_revision()
    assert relkind(ledger, "cost_line_rows") is None and relkind(ledger, "cost_line_packs") == "p"
    assert lines_rows(ledger) == rows
    # Trued up through the ids (the view is read-only): as the recorded ledger was at 0007.
    assert recorded._reconcile(ledger, recorded.FOCUS) == FIXTURE["reconcile"]
    assert_answers(ledger, FIXTURE["outputs"])
    with ledger.engine.connect() as connection:
        counts = connection.execute(text(
            "SELECT (SELECT count(*) FROM ledger_nodes), (SELECT count(DISTINCT (cluster, node_name)) FROM "
            "cost_lines), (SELECT count(*) FROM ledger_gpus), (SELECT count(*) FROM (SELECT gpu_uuid FROM cost_lines "
            "UNION SELECT gpu_uuid FROM focus_line_hourly) u)"
        )).one()
    # The GPUs: the lines' and, from 0017, those the hourly FOCUS lines name (a unit only zero lines name).
    assert counts[0] == counts[1] and counts[2] == counts[3]
    # A true-up through the ids (the view is read-only): the amended bill answers as it did at 0007.
    assert recorded._reconcile(ledger, recorded.FOCUS_AMENDED) == FIXTURE["amended"]["reconcile"]
    assert_answers(ledger, FIXTURE["amended"]["outputs"])
    amended = lines_rows(ledger)
    assert amended != rows

    with ledger.engine.begin() as connection:
        command.downgrade(_alembic_config(connection), "0013_lean_lines")
    assert relkind(ledger, "cost_lines") == "p" and relkind(ledger, "ledger_nodes") is None
    assert lines_rows(ledger) == amended
    assert_answers(ledger, FIXTURE["amended"]["outputs"])
    assert ledger.migrate() == Ledger.head_revision()
    assert relkind(ledger, "cost_line_rows") is None and relkind(ledger, "cost_line_packs") == "p"
    assert lines_rows(ledger) == amended
    assert_answers(ledger, FIXTURE["amended"]["outputs"])
    ledger.close()


def test_a_ledger_written_at_head_answers_as_the_recorded_one(database_url, tmp_path):
    """Written at head: the same answers as the recorded ledger; the bills' zero lines name their GPUs by id on
    PostgreSQL, and ``bills()`` gives them back as SQLite stores them (uuids)."""
    ledger = Ledger(database_url)
    ledger.migrate()
    priced = recorded.results()
    result = ledger.write([c for r in priced for c in r.costs], [r.bill for r in priced])
    assert result.bills_written == len(priced)
    with ledger.engine.connect() as connection:
        stored = [z for (z,) in connection.execute(text("SELECT zero_lines FROM node_bills WHERE zero_lines IS "
                                                        "NOT NULL"))]
    lite = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    lite.migrate()
    lite.write([c for r in priced for c in r.costs], [r.bill for r in priced])
    assert stored and all(zero_line_gpu_ids(z) for z in stored)
    assert sum(map(len, stored)) < sum(len(b["zero_lines"]) for b in lite.bills() if b["zero_lines"])
    assert ledger.bills() == lite.bills()
    assert list(ledger.iter_cost_lines()) == list(lite.iter_cost_lines())
    lite.close()
    assert recorded._reconcile(ledger, recorded.FOCUS) == FIXTURE["reconcile"]
    assert_answers(ledger, FIXTURE["outputs"])
    assert recorded._reconcile(ledger, recorded.FOCUS_AMENDED) == FIXTURE["amended"]["reconcile"]
    assert_answers(ledger, FIXTURE["amended"]["outputs"])
    ledger.close()


def test_a_range_read_through_the_view_scans_only_its_days_partitions(database_url):
    ledger = Ledger(database_url)
    ledger.migrate()
    day_ms = 86_400_000
    for day in range(3):
        ledger.write(*everything(sample_costs(2, start_ms=WINDOW_START_MS + day * day_ms)))
    start = WINDOW_START_MS + day_ms - WINDOW_START_MS % day_ms
    with ledger.engine.connect() as connection:
        plan = "\n".join(connection.execute(text(
            "EXPLAIN SELECT namespace, sum(cost_micro_usd) FROM cost_lines WHERE window_start_unix_ms >= :s "
            "AND window_start_unix_ms < :e GROUP BY namespace"), {"s": start, "e": start + day_ms}).scalars())
        attached = set(connection.execute(text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'cost_line_packs'::regclass")).scalars())
    scanned = {name for name in attached if name in plan}
    assert len(attached) >= 3 and len(scanned) == 1, plan
    ledger.close()


def test_concurrent_writers_of_new_nodes_gpus_and_pods_get_one_id_per_key(database_url):
    Ledger(database_url).migrate()
    batches = [sample_costs(3, start_ms=WINDOW_START_MS + i * 600_000) for i in range(4)]
    barrier = threading.Barrier(len(batches))
    errors = []

    def write(batch):
        try:
            with Ledger(database_url) as own:
                barrier.wait(30)
                own.write(*everything(batch))
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(batch,)) for batch in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    with Ledger(database_url) as ledger:
        with ledger.engine.connect() as connection:
            for table, key in (("ledger_nodes", "cluster, node_name"), ("ledger_gpus", "gpu_uuid"),
                               ("ledger_pods", "pod_uid, namespace, pod_name, absent"),
                               ("ledger_line_kinds", "subject_kind, shared_from, sharing_method, method, cost_basis, "
                                                     "window_seconds")):
                total, distinct = connection.execute(text(
                    f"SELECT count(*), count(DISTINCT ({key})) FROM {table}")).one()
                assert total == distinct > 0
        costs = [c for batch in batches for r in batch for c in r.costs]
        assert sorted(ledger.iter_cost_lines(), key=repr) == sorted(costs, key=repr)
