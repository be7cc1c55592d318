"""The partitions' names and ranges (``services.billing.partitions``, pure); PostgreSQL's side is in
tests/integration/test_ledger_partitions_postgres.py."""

from __future__ import annotations

from datetime import datetime, timezone

from services.billing import partitions
from services.billing.partitions import DAY_MS, SCHEME_BY_TABLE, Partition, covering, parse_name, partition_of, past


def ms(*moment: int) -> int:
    return int(datetime(*moment, tzinfo=timezone.utc).timestamp()) * 1000


def test_a_day_partition_holds_its_utc_day_and_a_month_partition_its_calendar_month():
    bills, daily = SCHEME_BY_TABLE["node_bills"], SCHEME_BY_TABLE["cost_rollup_daily"]
    assert partition_of(bills, ms(2026, 12, 3, 23, 59)) == Partition(
        ms(2026, 12, 3), ms(2026, 12, 4), "node_bills", "node_bills_p20261203")
    assert partition_of(bills, ms(2026, 12, 4)).name == "node_bills_p20261204"
    assert partition_of(daily, ms(2026, 12, 31, 12)) == Partition(
        ms(2026, 12, 1), ms(2027, 1, 1), "cost_rollup_daily", "cost_rollup_daily_p202612")
    assert partition_of(daily, ms(2028, 2, 29)).end_ms == ms(2028, 3, 1)


def test_covering_and_names_round_trip():
    lines = SCHEME_BY_TABLE["cost_lines"]
    parts = covering(lines, ms(2026, 12, 30, 10), ms(2027, 1, 2, 0, 1))
    assert [p.name for p in parts] == ["cost_lines_p20261230", "cost_lines_p20261231", "cost_lines_p20270101",
                                       "cost_lines_p20270102"]
    assert all(b.start_ms == a.end_ms for a, b in zip(parts, parts[1:]))
    for scheme in partitions.SCHEMES:
        part = partition_of(scheme, ms(2026, 2, 14, 6))
        assert parse_name(part.name) == part
    for other in ("cost_lines_p20261332", "cost_lines_p202612", "cost_rollup_daily_p20261203", "label_sets_p20261203",
                  "cost_lines", "node_bills_0009"):
        assert parse_name(other) is None


def test_only_partitions_wholly_before_the_horizon_are_past():
    horizon = ms(2026, 12, 15)
    days = covering(SCHEME_BY_TABLE["node_bills"], ms(2026, 12, 13), ms(2026, 12, 17))
    months = covering(SCHEME_BY_TABLE["cost_rollup_daily"], ms(2026, 11, 1), ms(2027, 1, 1))
    assert [p.name for p in past(days + months, horizon)] == [
        "cost_rollup_daily_p202611", "node_bills_p20261213", "node_bills_p20261214"]
    # December is not wholly past on the 15th: its rows stay until the month is.
    assert [p.name for p in past(months, ms(2027, 1, 1))] == ["cost_rollup_daily_p202611", "cost_rollup_daily_p202612"]
    # Eight days: a partition a day of the bills (node_bills up to 0017, node_bill_rows from 0018), the lines
    # (cost_line_packs from 0016; cost_line_rows at 0014 and 0015, cost_lines up to revision 0013), the three hourly
    # rollups and the hourly FOCUS grain's (its charges; its lines: focus_line_hourly up to 0016,
    # focus_line_hourly_rows from 0017), one (December) of the three daily rollups.
    assert len(partitions.wanted(ms(2026, 12, 3), ms(2026, 12, 3) + 8 * DAY_MS)) == 8 * 11 + 3


def test_billing_creates_the_partitions_ahead_at_start_and_every_hour_with_its_clock(monkeypatch):
    import asyncio

    from gpumeter.clock import ManualClock
    from services.billing import main as billing_main
    from services.billing.ledger import LedgerError

    start = 1_796_000_000_000
    clock = ManualClock(start)
    calls = []

    class Ledger:
        def ensure_partitions(self, now_ms):
            calls.append(now_ms)
            if len(calls) == 2:
                raise LedgerError("database away")  # logged; tried again at the next round
            return 3

    monkeypatch.setattr(billing_main, "PARTITIONS_EVERY_SECONDS", 0.01)

    async def run():
        stop = asyncio.Event()
        task = asyncio.create_task(billing_main._keep_partitions_ahead(Ledger(), clock, stop))
        while len(calls) < 3:
            await asyncio.sleep(0.005)
            clock.advance_ms(3_600_000)
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(run())
    assert calls[0] == start and calls == sorted(calls) and calls[-1] > start and len(calls) >= 3
