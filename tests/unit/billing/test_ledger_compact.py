"""What a minute line stores (migration 0008, ``services.billing.line_storage``): zero lines folded into their
bill, labels stored once, prices read from the bill -- and every reader's answer unchanged to the micro-dollar.

``data/ledger_0007.json`` is a ledger written by the code of revision 0007 (``data/make_ledger_0007.py``): its rows
and the digests of what every reader answered over it then (every ``gpumeter report`` grouping in both cost
bases and formats, the FOCUS export, ``/allocation`` answers, the lines as records, the true-up's view), and what
``gpumeter reconcile`` printed for its bill and for the amended bill applied after it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import column, func, select, table, text

from services.billing.ledger import Grouping, Ledger, LedgerError, _alembic_config, cost_lines, label_sets, node_bills
from services.billing.line_storage import decode_zero_lines, encode_zero_lines, is_zero_line, label_set_id
from tests.unit.billing.data import make_ledger_0007 as recorded
from tests.unit.billing.ledger_outputs import output_digests

FIXTURE = json.loads((Path(__file__).parent / "data" / "ledger_0007.json").read_text(encoding="utf-8"))
ORDER = ("price_versions", "node_bills", "cost_lines", "trueups")


def ledger_at_0007(url: str) -> Ledger:
    """A ledger at revision 0007 holding the recorded rows, inserted as they were stored."""
    ledger = Ledger(url)
    with ledger.engine.begin() as connection:
        command.upgrade(_alembic_config(connection), "0007_sharing")
        for name in ORDER:
            rows = FIXTURE["rows"][name]
            columns = rows["columns"]
            target = table(name, *(column(c) for c in columns))
            if name == "cost_lines":
                # The 0007 JSON column: bound as JSON text (PostgreSQL casts it to JSONB).
                values = [dict(zip(columns, v)) for v in rows["values"]]
                for v in values:
                    v["labels"] = json.dumps(v["labels"])
                labels = "CAST(:labels AS JSONB)" if ledger.dialect == "postgresql" else ":labels"
                connection.execute(text(
                    f"INSERT INTO cost_lines ({', '.join(columns)}) VALUES "
                    f"({', '.join(labels if c == 'labels' else ':' + c for c in columns)})"), values)
            else:
                connection.execute(target.insert(), [dict(zip(columns, v)) for v in rows["values"]])
    return ledger


def assert_answers(ledger: Ledger, recorded_outputs: dict[str, str]) -> None:
    """Every reader answers ``recorded_outputs`` (0007's) with the reports read from the minute lines, and again
    with the reports read from the coarsest grain (``grain="auto"``: the hourly rollups answer the fixture's whole
    hours by namespace, node and team), which equal the minute ones line for line."""
    from services.billing.report import build_report
    from services.billing.rollups import HOUR, MINUTE
    from tests.unit.billing.test_retention import comparable

    start, end = FIXTURE["start_ms"], FIXTURE["end_ms"]
    assert output_digests(ledger, start, end, grain="minute") == recorded_outputs
    assert output_digests(ledger, start, end, grain="auto") == recorded_outputs
    for by in ("namespace", "node", "label:team", "pod"):
        for cost in ("list", "trued"):
            rolled = build_report(ledger, Grouping.parse(by), start_ms=start, end_ms=end, cost=cost)
            lines = build_report(ledger, Grouping.parse(by), start_ms=start, end_ms=end, cost=cost, grain="minute")
            assert rolled.plan.grains() == ((MINUTE,) if by == "pod" else (HOUR,))
            assert comparable(rolled) == comparable(lines)


def check_upgrade_keeps_every_answer(url: str) -> None:
    ledger = ledger_at_0007(url)
    try:
        assert ledger.current_revision() == FIXTURE["revision"] == "0007_sharing"
        assert ledger.migrate() == Ledger.head_revision() == "0018_bill_ids"
        assert_answers(ledger, FIXTURE["outputs"])
        with ledger.engine.connect() as connection:
            stored = connection.execute(select(func.count()).select_from(cost_lines)).scalar_one()
            zero = [z for (text_,) in connection.execute(select(node_bills.c.zero_lines))
                    for z in decode_zero_lines(text_)]
            sets = connection.execute(select(func.count()).select_from(label_sets)).scalar_one()
        recorded_lines = FIXTURE["rows"]["cost_lines"]["values"]
        # Every zero line of the fixture left the table for its bill; the rest are rows.
        assert zero and stored + len(zero) == len(recorded_lines)
        columns = FIXTURE["rows"]["cost_lines"]["columns"]
        distinct = {(json.dumps(dict(zip(columns, v))["labels"], sort_keys=True),
                     dict(zip(columns, v))["carried_label_keys"]) for v in recorded_lines}
        assert sets == len(distinct | {("{}", "")})
        # The amended bill, applied after the upgrade, changes what it changed at 0007, and the answers with it.
        assert recorded._reconcile(ledger, recorded.FOCUS_AMENDED) == FIXTURE["amended"]["reconcile"]
        assert_answers(ledger, FIXTURE["amended"]["outputs"])
    finally:
        ledger.close()


def test_the_0008_upgrade_keeps_every_report_export_and_allocation_to_the_micro_dollar(tmp_path):
    check_upgrade_keeps_every_answer(f"sqlite:///{tmp_path / 'old.sqlite3'}")


def test_a_ledger_written_now_answers_as_the_one_written_at_0007(sqlite_ledger):
    """The same node-windows written by today's ``Ledger.write`` and trued up by the same bills: the same answers,
    the same reconcile output (the lines it says changed include the zero lines of the windows trued up)."""
    priced = recorded.results()
    result = sqlite_ledger.write([c for r in priced for c in r.costs], [r.bill for r in priced])
    costs = [c for r in priced for c in r.costs]
    assert result.lines_written == len(costs) and result.lines_elided == len(
        [c for r in priced for c in r.costs if is_zero_line(c, r.bill.window_seconds, r.bill.instance_type,
                                                             r.bill.price_model, r.bill.price_version)]) > 0
    assert recorded._reconcile(sqlite_ledger, recorded.FOCUS) == FIXTURE["reconcile"]
    assert_answers(sqlite_ledger, FIXTURE["outputs"])
    assert recorded._reconcile(sqlite_ledger, recorded.FOCUS_AMENDED) == FIXTURE["amended"]["reconcile"]
    assert_answers(sqlite_ledger, FIXTURE["amended"]["outputs"])


def test_zero_lines_are_no_rows_and_their_bill_says_which_they_were(sqlite_ledger):
    priced = recorded.results()
    costs = [c for r in priced for c in r.costs]
    sqlite_ledger.write(costs, [r.bill for r in priced])
    bills = {(b.cluster, b.node_name, b.window_start_unix_ms): b for b in (r.bill for r in priced)}
    zero = [c for c in costs if is_zero_line(c, *(getattr(bills[(c.cluster, c.node_name, c.window_start_unix_ms)],
                                                          f) for f in ("window_seconds", "instance_type",
                                                                       "price_model", "price_version")))]
    with sqlite_ledger.engine.connect() as connection:
        rows = connection.execute(select(cost_lines.c.gpu_uuid, cost_lines.c.subject_kind,
                                         cost_lines.c.cost_micro_usd)).all()
        listed = {(start, node, *line[:2]) for start, node, text_ in connection.execute(
            select(node_bills.c.window_start_unix_ms, node_bills.c.node_name, node_bills.c.zero_lines))
            for line in decode_zero_lines(text_)}
    assert len(rows) == len(costs) - len(zero)
    assert listed == {(c.window_start_unix_ms, c.node_name, c.gpu_uuid or "", c.subject_kind.value) for c in zero}
    # Every line comes back, zero lines included, as it was written; each node-window adds up to its bill.
    key = lambda c: (c.window_start_unix_ms, c.cluster, c.node_name, c.gpu_uuid or "", c.subject_kind.value,
                     c.pod_uid or "", c.shared_from or "")
    assert list(sqlite_ledger.iter_cost_lines()) == sorted(costs, key=key)
    totals = sqlite_ledger.totals()
    assert totals.cost_micro_usd == totals.bill_micro_usd and totals.cost_lines == len(costs)


def test_labels_are_stored_once_per_distinct_set_and_a_colliding_set_is_refused(sqlite_ledger):
    priced = recorded.results()
    costs = [c for r in priced for c in r.costs]
    sqlite_ledger.write(costs, [r.bill for r in priced])
    with sqlite_ledger.engine.connect() as connection:
        stored = {i: (dict(labels), carried) for i, labels, carried in connection.execute(select(label_sets))}
    wanted = {label_set_id(c.labels, c.carried_label_keys): (dict(c.labels), ",".join(c.carried_label_keys))
              for c in costs} | {0: ({}, "")}
    assert stored == wanted
    # Another set stored under an id of this write's (a hash collision): the write is refused, nothing written.
    day = 86_400_000
    later = recorded.results()
    shifted = [replace(c, window_start_unix_ms=c.window_start_unix_ms + day) for r in later for c in r.costs]
    bills = [replace(r.bill, window_start_unix_ms=r.bill.window_start_unix_ms + day) for r in later]
    victim = next(i for i in wanted if i)
    fresh = Ledger(sqlite_ledger.url)
    with fresh.engine.begin() as connection:
        connection.execute(label_sets.update().where(label_sets.c.label_set_id == victim)
                           .values(labels={"team": "someone-else"}))
    with pytest.raises(LedgerError, match="label set"):
        fresh.write(shifted, bills)
    assert len(fresh.bills()) == len(priced)
    fresh.close()


def test_a_line_priced_otherwise_than_its_bill_is_refused_and_nothing_is_written(sqlite_ledger):
    priced = recorded.results()[:2]
    costs = [c for r in priced for c in r.costs]
    odd = [replace(c, price_version="elsewhere") if c is costs[0] else c for c in costs]
    with pytest.raises(LedgerError, match="keeps them once, on the bill"):
        sqlite_ledger.write(odd, [r.bill for r in priced])
    assert sqlite_ledger.bills() == () and sqlite_ledger.totals().cost_lines == 0


def test_the_downgrade_puts_every_line_back_as_a_row(tmp_path):
    ledger = ledger_at_0007(f"sqlite:///{tmp_path / 'round.sqlite3'}")
    try:
        ledger.migrate()
        with ledger.engine.begin() as connection:
            command.downgrade(_alembic_config(connection), "0007_sharing")
            columns = FIXTURE["rows"]["cost_lines"]["columns"]
            rows = connection.execute(text(f"SELECT {', '.join(columns)} FROM cost_lines")).all()
        back = sorted(tuple(json.loads(v) if c == "labels" else v for c, v in zip(columns, r)) for r in rows)
        assert back == sorted(tuple(v) for v in FIXTURE["rows"]["cost_lines"]["values"])
    finally:
        ledger.close()


def test_the_zero_lines_column_gives_back_every_line_bit_for_bit():
    lines = [("GPU-b", "UNAVAILABLE", "exclusive", "memory", 1.0),
             ("GPU-a", "UNATTRIBUTED", "exclusive", "memory", 1.0),
             ("GPU-a", "DRIVER_RESERVED", "exclusive", "memory", 1.0),
             ("MIG-c", "IDLE", "mig_instance", "compute", 3 / 7), ("", "NODE_OTHER", "", "", 0.0)]
    text_ = encode_zero_lines(lines)
    assert decode_zero_lines(text_) == sorted(lines, key=lambda z: (z[0], z[1]))
    assert [repr(z[4]) for z in decode_zero_lines(text_)] == [repr(z[4]) for z in sorted(lines, key=lambda z: (
        z[0], z[1]))]
    assert encode_zero_lines([]) is None and decode_zero_lines(None) == []


def test_a_line_with_any_share_or_a_negative_zero_is_stored_as_a_row():
    (priced,) = recorded.results()[:1]
    bill = priced.bill
    facts = (bill.window_seconds, bill.instance_type, bill.price_model, bill.price_version)
    zero = next(c for c in priced.costs if is_zero_line(c, *facts))
    for change in ({"memory_share": 1e-9}, {"compute_share": 0.5}, {"cost_share": -0.0}, {"cost_micro_usd": 1},
                   {"labels": {"team": "x"}}, {"carried_label_keys": ("team",)}, {"price_version": "other"}):
        other = replace(zero, **change)
        assert not is_zero_line(other, *facts), change
