"""Retention (``services.billing.retention``) and reports over the rollups (``report.build_report``'s plan): minute
lines past retention are dropped while every rollup and bill stays the same, and a report read from the rollups
equals the report read from the minute lines to the micro-dollar."""

from __future__ import annotations

import argparse
import csv
import io
import json
from functools import lru_cache

import pytest
from sqlalchemy import func, select

from gpumeter import cli
from gpumeter.clock import ManualClock
from gpumeter.errors import ConfigError
from services.billing import report as report_module
from services.billing import retention
from services.billing.ledger import ROLLUPS, Grouping, LedgerError, cost_lines
from services.billing.report import build_report, format_report
from services.billing.retention import RetentionSettings, retain
from services.billing.rollups import DAY, DAY_MS, HOUR, HOUR_MS, MINUTE, Segment, plan, rows_of, split
from tests.unit.billing.conftest import WINDOW_START_MS, sample_shares

DAY0 = WINDOW_START_MS - WINDOW_START_MS % DAY_MS
DAYS = 20
# Four node-window pairs a day, at minutes that fall in every part of a plan (edges, inner hours, whole days).
MINUTES_OF_DAY = (5, 7 * 60 + 30, 13 * 60 + 59, 23 * 60 + 58)
GROUPINGS = ("namespace", "node", "label:team")


@lru_cache(maxsize=1)
def history():
    """Node-window costs over ``DAYS`` days, the aws node's idle shared to its pods."""
    from services.billing.catalog import PriceCatalog
    from services.billing.costing import bill_node_window
    from services.billing.pricing import DEFAULT_SPLIT_POLICY
    from services.billing.sharing import SharingPolicy

    catalog = PriceCatalog.load()
    sharing = SharingPolicy.parse("idle=weighted")
    return tuple(bill_node_window(shares, catalog, DEFAULT_SPLIT_POLICY, sharing)
                 for day in range(DAYS) for minute in MINUTES_OF_DAY
                 for shares in sample_shares(1, start_ms=DAY0 + day * DAY_MS + minute * 60_000))


@pytest.fixture
def ledger(sqlite_ledger):
    results = history()
    sqlite_ledger.write([c for r in results for c in r.costs], [r.bill for r in results])
    return sqlite_ledger


def comparable(report):
    """Everything a report says but which grain it read."""
    return (report.start_ms, report.end_ms, report.lines, report.reconciliation, report.carriage, report.pricing,
            report.shared_sources, report.sharing_policies, report.trued_windows)


def rollup_rows(ledger):
    return rows_of(ledger.read, ROLLUPS.by_grain[HOUR]), rows_of(ledger.read, ROLLUPS.by_grain[DAY])


def snapshot(ledger, bills_from_ms=None):
    """The rollups, and the node bills from ``bills_from_ms`` (all of them by default)."""
    return (*rollup_rows(ledger), ledger.bills(start_ms=bills_from_ms))


def bill_count(ledger, start_ms, end_ms):
    """Node bills stored for windows in [start_ms, end_ms), counted in SQL (no reader's retention check)."""
    from services.billing.ledger import node_bills

    (count,), = ledger.read(select(func.count()).select_from(node_bills).where(
        node_bills.c.window_start_unix_ms >= start_ms, node_bills.c.window_start_unix_ms < end_ms))
    return int(count)


def line_count(ledger, start_ms, end_ms):
    (count,), = ledger.read(select(func.count()).select_from(cost_lines).where(
        cost_lines.c.window_start_unix_ms >= start_ms, cost_lines.c.window_start_unix_ms < end_ms))
    return int(count)


# -- the plan (pure) ------------------------------------------------------------------------------------------


def test_split_reads_whole_days_then_whole_hours_then_the_minutes_at_the_edges():
    start, end = DAY0 + 7 * 60_000, DAY0 + 3 * DAY_MS + 14 * HOUR_MS + 31 * 60_000
    assert split(start, end) == (
        Segment(MINUTE, start, DAY0 + HOUR_MS), Segment(HOUR, DAY0 + HOUR_MS, DAY0 + DAY_MS),
        Segment(DAY, DAY0 + DAY_MS, DAY0 + 3 * DAY_MS),
        Segment(HOUR, DAY0 + 3 * DAY_MS, DAY0 + 3 * DAY_MS + 14 * HOUR_MS),
        Segment(MINUTE, DAY0 + 3 * DAY_MS + 14 * HOUR_MS, end))
    assert split(DAY0 + 60_000, DAY0 + 50 * 60_000) == (Segment(MINUTE, DAY0 + 60_000, DAY0 + 50 * 60_000),)
    assert split(DAY0 + 23 * HOUR_MS, DAY0 + DAY_MS + 2 * HOUR_MS) == (
        Segment(HOUR, DAY0 + 23 * HOUR_MS, DAY0 + DAY_MS + 2 * HOUR_MS),)
    assert split(start, end, rollups=False) == (Segment(MINUTE, start, end),)


def test_the_plan_moves_the_range_past_what_retention_dropped_never_reporting_it_as_zero():
    start, end = DAY0 + 7 * 60_000, DAY0 + 10 * DAY_MS + 31 * 60_000
    kept = {MINUTE: DAY0 + 6 * DAY_MS, HOUR: DAY0 + 2 * DAY_MS}
    planned = plan(start, end, kept_from=kept)
    # The first day's minutes and hours are gone: the range starts where the daily rollups answer.
    assert (planned.start_ms, planned.end_ms, planned.adjusted) == (DAY0 + DAY_MS, end, True)
    assert planned.segments[0] == Segment(DAY, DAY0 + DAY_MS, DAY0 + 10 * DAY_MS)
    by_lines = plan(start, end, rollups=False, kept_from=kept)
    assert (by_lines.start_ms, by_lines.segments) == (DAY0 + 6 * DAY_MS, (Segment(MINUTE, DAY0 + 6 * DAY_MS, end),))
    gone = plan(DAY0, DAY0 + HOUR_MS, rollups=False, kept_from=kept)
    assert gone.segments == () and gone.start_ms == gone.end_ms


# -- reports over the rollups equal reports over the lines --------------------------------------------------------


@pytest.mark.parametrize("by", GROUPINGS)
@pytest.mark.parametrize("cost", ["list", "trued"])
def test_a_month_like_report_from_the_rollups_equals_the_report_from_the_minute_lines(ledger, by, cost):
    grouping = Grouping.parse(by)
    start, end = DAY0 + 7 * 60_000, DAY0 + (DAYS - 1) * DAY_MS + 14 * HOUR_MS + 31 * 60_000
    rolled = build_report(ledger, grouping, start_ms=start, end_ms=end, cost=cost)
    lines = build_report(ledger, grouping, start_ms=start, end_ms=end, cost=cost, grain="minute")
    assert rolled.plan.grains() == (DAY, HOUR, MINUTE) and lines.plan.grains() == (MINUTE,)
    assert comparable(rolled) == comparable(lines)
    assert rolled.reconciliation.reconciled and rolled.total_micro_usd > 0
    assert rolled.shared_sources  # the idle shared to pods, from the rollups' shared_from
    table = format_report(rolled, "table")
    assert "read from: daily rollups (18 days), hourly rollups (37 hours), minute cost lines (84 minutes)" in table
    document = json.loads(format_report(rolled, "json"))
    assert [s["grain"] for s in document["grain"]["segments"]] == [MINUTE, HOUR, DAY, HOUR, MINUTE]


def test_groupings_the_rollups_do_not_keep_read_the_lines(ledger):
    start, end = DAY0, DAY0 + 3 * DAY_MS
    for by in ("pod", "gpu", "label:model"):
        report = build_report(ledger, Grouping.parse(by), start_ms=start, end_ms=end)
        assert report.plan.grains() == (MINUTE,) and report.reconciliation.reconciled


def test_gpumeter_report_says_which_grain_it_read(ledger):
    from services.billing.costing import iso_utc

    parser = argparse.ArgumentParser()
    report_module.add_arguments(parser)
    end_ms = DAY0 + 5 * DAY_MS + 10 * HOUR_MS + 30 * 60_000
    args = parser.parse_args(["--ledger-url", ledger.url, "--window", "3d", "--end", iso_utc(end_ms),
                              "--format", "csv"])
    out, err = io.StringIO(), io.StringIO()
    assert report_module.main(args, {}, clock=ManualClock(end_ms), out=out, err=err) == 0, err.getvalue()
    rows = {row["kind"]: row for row in csv.DictReader(io.StringIO(out.getvalue()))}
    assert rows["grain"]["group"] == "daily rollups (2 days), hourly rollups (23 hours), minute cost lines (60 minutes)"
    assert rows["reconciliation"]["group"] == "reconciled"


# -- retention -------------------------------------------------------------------------------------------------


def test_retention_drops_minute_lines_past_it_while_every_rollup_and_bill_stays_the_same(ledger):
    """Minute lines and their node bills go together (the bills now have a retention: theirs); every rollup, and
    every bill and report over the kept range, stays the same to the micro-dollar."""
    now = DAY0 + DAYS * DAY_MS + 10 * HOUR_MS
    horizon = DAY0 + (DAYS - 14) * DAY_MS  # now less 14 days, down to midnight UTC
    whole = (DAY0, DAY0 + DAYS * DAY_MS)
    rollups_before = rollup_rows(ledger)
    kept_bills = ledger.bills(start_ms=horizon)
    reports = {by: build_report(ledger, Grouping.parse(by), start_ms=horizon, end_ms=whole[1]) for by in GROUPINGS}
    whole_by_namespace = build_report(ledger, Grouping("namespace"), start_ms=whole[0], end_ms=whole[1])
    kept_lines = line_count(ledger, horizon, whole[1])
    dropped_lines = line_count(ledger, *whole) - kept_lines
    dropped_bills = bill_count(ledger, *whole) - len(kept_bills)
    assert dropped_lines > 0 and dropped_bills > 0

    result = retain(ledger, RetentionSettings(), now_ms=now)

    def midnight_before(ms):
        return ms - ms % DAY_MS

    assert result.kept_from_ms == {MINUTE: horizon, HOUR: midnight_before(now - 92 * DAY_MS),
                                   DAY: midnight_before(now - 400 * DAY_MS)}
    assert result.deleted == {MINUTE: dropped_lines, HOUR: 0, DAY: 0}
    # The node bills go with their minute lines: nothing keeps a bill forever any more.
    assert result.bills_deleted == dropped_bills and result.dropped_partitions == ()
    assert line_count(ledger, whole[0], horizon) == 0 and line_count(ledger, horizon, whole[1]) == kept_lines
    assert bill_count(ledger, whole[0], horizon) == 0
    assert snapshot(ledger, horizon) == (*rollups_before, kept_bills)
    for by, report in reports.items():
        # A report over the kept range is the same as before, to the micro-dollar.
        again = build_report(ledger, Grouping.parse(by), start_ms=horizon, end_ms=whole[1])
        assert comparable(again) == comparable(report) and again.reconciliation.reconciled
    # Over the dropped range a report by namespace reads the line and bill rollups: the same, still reconciled.
    again = build_report(ledger, Grouping("namespace"), start_ms=whole[0], end_ms=whole[1])
    assert comparable(again) == comparable(whole_by_namespace) and again.reconciliation.reconciled
    # At minute grain its lines and node bills are gone: the range moves to what is kept, never reported as zero.
    minute = build_report(ledger, Grouping("namespace"), start_ms=whole[0], end_ms=whole[1], grain="minute")
    assert minute.start_ms == horizon and minute.plan.adjusted and minute.reconciliation.reconciled
    by_pod = build_report(ledger, Grouping("pod"), start_ms=whole[0], end_ms=whole[1])
    assert by_pod.start_ms == horizon and by_pod.reconciliation.reconciled
    # Running it again drops nothing more.
    again = retain(ledger, RetentionSettings(), now_ms=now + 60_000)
    assert (again.deleted, again.bills_deleted) == ({MINUTE: 0, HOUR: 0, DAY: 0}, 0)
    assert snapshot(ledger, horizon) == (*rollups_before, kept_bills)


def test_every_reader_of_node_bills_refuses_a_range_whose_bills_retention_dropped(ledger):
    """Each would otherwise answer the dropped part as zero (no bills, no node-windows, no cost)."""
    from services.billing.ledger import MinuteLinesDropped

    now = DAY0 + DAYS * DAY_MS
    horizon = DAY0 + (DAYS - 14) * DAY_MS
    end = DAY0 + DAYS * DAY_MS
    ranged = {"totals": ledger.totals, "bill_totals": ledger.bill_totals, "bills": ledger.bills,
              "node_pricing": ledger.node_pricing, "sharing_policies": ledger.sharing_policies,
              "trued_coverage": ledger.trued_coverage, "trueup_windows": ledger.trueup_windows,
              "billed_cost_lines": lambda **kw: list(ledger.billed_cost_lines(**kw))}
    kept = {name: read(start_ms=horizon, end_ms=end) for name, read in ranged.items()}
    retain(ledger, RetentionSettings(), now_ms=now)
    for name, read in ranged.items():
        with pytest.raises(MinuteLinesDropped, match="retention kept them from"):
            read(start_ms=horizon - 60_000, end_ms=end)
        assert read(start_ms=horizon, end_ms=end) == kept[name], name
    for name in ("totals", "bill_totals", "bills", "node_pricing", "sharing_policies", "trued_coverage"):
        with pytest.raises(MinuteLinesDropped):
            ranged[name]()  # from the first window: the dropped ones too


def test_hourly_retention_keeps_the_daily_rollups_and_a_horizon_never_moves_back(ledger):
    now = DAY0 + DAYS * DAY_MS + 10 * HOUR_MS
    hourly_before, daily_before, bills = snapshot(ledger)
    settings = RetentionSettings(minute_lines_days=3, hourly_rollups_days=15, daily_rollups_days=400,
                                 delete_batch_hours=5)
    result = retain(ledger, settings, now_ms=now)
    hour_horizon = DAY0 + (DAYS - 15) * DAY_MS
    minute_horizon = DAY0 + (DAYS - 3) * DAY_MS
    assert result.kept_from_ms[HOUR] == hour_horizon and result.deleted[HOUR] > 0
    hourly, daily, bills_after = snapshot(ledger, minute_horizon)
    assert hourly == {k: v for k, v in hourly_before.items() if k.period_start_unix_ms >= hour_horizon}
    assert daily == daily_before
    assert bills_after == tuple(b for b in bills if b["window_start_unix_ms"] >= minute_horizon)
    assert result.bills_deleted == len(bills) - len(bills_after) > 0
    # Lengthening a retention afterwards cannot bring back what is gone: the horizons stay.
    longer = retain(ledger, RetentionSettings(), now_ms=now)
    assert longer.kept_from_ms[MINUTE] == minute_horizon and longer.kept_from_ms[HOUR] == hour_horizon


def test_retention_settings_keep_finer_grains_no_longer_than_coarser_ones():
    with pytest.raises(ConfigError, match="must not shrink"):
        RetentionSettings(minute_lines_days=30, hourly_rollups_days=20)
    assert RetentionSettings().days() == {MINUTE: 14, HOUR: 92, DAY: 400}


def test_the_command_applies_it_with_the_clock_given(ledger):
    out, err = io.StringIO(), io.StringIO()
    parser = argparse.ArgumentParser()
    retention.add_arguments(parser)
    now = DAY0 + DAYS * DAY_MS
    args = parser.parse_args(["retention", "--ledger-url", ledger.url, "--minute-lines-days", "10"])
    assert retention.main(args, {}, clock=ManualClock(now), out=out, err=err) == 0, err.getvalue()
    assert "minute cost lines: kept from" in out.getvalue()
    assert "node bills: kept from 2026-11-28T00:00:00Z (with the minute lines), 80 rows deleted" in out.getvalue()
    assert line_count(ledger, DAY0, now - 10 * DAY_MS) == 0 and line_count(ledger, now - 10 * DAY_MS, now) > 0
    assert bill_count(ledger, DAY0, now - 10 * DAY_MS) == 0 and bill_count(ledger, now - 10 * DAY_MS, now) > 0
    assert "ledger" in cli.SUBCOMMANDS


def test_every_runs_it_again_on_the_clock_until_stopped_and_survives_a_failed_run(ledger):
    """``--every`` (docker compose has no scheduler): each run reads the clock anew, a run that fails is reported and
    the next one tries again, and setting the stop event ends the loop with 0."""
    import threading

    out, err = io.StringIO(), io.StringIO()
    parser = argparse.ArgumentParser()
    retention.add_arguments(parser)
    args = parser.parse_args(["retention", "--ledger-url", ledger.url, "--minute-lines-days", "10",
                              "--every", "0.001"])
    stop = threading.Event()
    clock = ManualClock(DAY0 + (DAYS - 2) * DAY_MS)
    runs = []
    real_retain = retention.retain

    def counting_retain(led, settings, *, now_ms):
        runs.append(now_ms)
        if len(runs) == 1:
            raise LedgerError("the database went away")
        if len(runs) == 2:
            clock.set_ms(DAY0 + DAYS * DAY_MS)  # the next run sees the clock move on
        else:
            stop.set()
        return real_retain(led, settings, now_ms=now_ms)

    retention.retain = counting_retain
    try:
        assert retention.main(args, {}, clock=clock, out=out, err=err, stop=stop) == 0
    finally:
        retention.retain = real_retain
    assert runs == [DAY0 + (DAYS - 2) * DAY_MS, DAY0 + (DAYS - 2) * DAY_MS, DAY0 + DAYS * DAY_MS]
    assert "the database went away" in err.getvalue()
    assert out.getvalue().count("minute cost lines: kept from") == 2
    now = DAY0 + DAYS * DAY_MS
    assert line_count(ledger, DAY0, now - 10 * DAY_MS) == 0 and line_count(ledger, now - 10 * DAY_MS, now) > 0


def test_every_refuses_unusable_settings_and_a_non_positive_period(ledger):
    parser = argparse.ArgumentParser()
    retention.add_arguments(parser)
    for argv, message in ((["--every", "0"], "--every must be > 0"),
                          (["--every", "5", "--minute-lines-days", "500"], "must not shrink")):
        err = io.StringIO()
        args = parser.parse_args(["retention", "--ledger-url", ledger.url, *argv])
        assert retention.main(args, {}, clock=ManualClock(DAY0), out=io.StringIO(), err=err) == 2
        assert message in err.getvalue()


def test_retention_over_compact_lines_keeps_label_sets_and_zero_lines_and_the_reports_from_the_rollups(
        sqlite_ledger):
    """Revision 0008's storage under retention: the minute lines' rows go, and their bills with the zero lines they
    list; the label sets (which outlive lines) stay; the rollups still count every line, zero lines included."""
    from services.billing.ledger import label_sets, node_bills
    from services.billing.line_storage import decode_zero_lines
    from tests.unit.billing.data import make_ledger_0007 as recorded

    priced = recorded.results()
    assert sqlite_ledger.write([c for r in priced for c in r.costs], [r.bill for r in priced]).lines_elided > 0
    recorded._reconcile(sqlite_ledger, recorded.FOCUS)
    start, end = recorded.START_MS, recorded.END_MS
    rollups_before = rollup_rows(sqlite_ledger)
    (sets_before,), = sqlite_ledger.read(select(func.count()).select_from(label_sets))
    lines_before = sqlite_ledger.totals(start_ms=start, end_ms=end).cost_lines
    zero = sum(len(decode_zero_lines(text)) for text, in sqlite_ledger.read(select(node_bills.c.zero_lines)))
    bills_before = bill_count(sqlite_ledger, start, end)
    by_namespace_before = build_report(sqlite_ledger, Grouping("namespace"), start_ms=start, end_ms=end)

    result = retain(sqlite_ledger, RetentionSettings(), now_ms=end + 30 * DAY_MS)

    assert zero > 0 and result.deleted[MINUTE] == lines_before - zero  # the rows; the zero lines were none
    assert result.bills_deleted == bills_before > 0
    assert line_count(sqlite_ledger, start, end) == 0 and bill_count(sqlite_ledger, start, end) == 0
    assert rollup_rows(sqlite_ledger) == rollups_before
    assert sum(sums.cost_lines for sums in rollups_before[0].values()) == lines_before  # zero lines counted
    (sets_after,), = sqlite_ledger.read(select(func.count()).select_from(label_sets))
    assert sets_after == sets_before > 1
    # By namespace the rollups answer, to the micro-dollar of the bills that are gone; at minute grain it refuses.
    again = build_report(sqlite_ledger, Grouping("namespace"), start_ms=start, end_ms=end)
    assert again.reconciliation.reconciled and comparable(again) == comparable(by_namespace_before)
    minute = build_report(sqlite_ledger, Grouping("namespace"), start_ms=start, end_ms=end, grain="minute")
    assert minute.plan.segments == () and minute.plan.adjusted and minute.lines == ()
    # By pod the minute lines are needed: the range is moved past them, never reported as costing nothing.
    by_pod = build_report(sqlite_ledger, Grouping("pod"), start_ms=start, end_ms=end)
    assert by_pod.plan.segments == () and by_pod.plan.adjusted and by_pod.lines == ()


def test_allocation_by_pod_and_the_focus_export_refuse_a_range_whose_minute_lines_retention_dropped(ledger):
    # By pod /allocation, and the FOCUS export, are summed from minute lines: over a dropped range they would say
    # it cost nothing. By namespace over whole days the rollups answer it, the same as before.
    from gpumeter.clock import iso_utc
    from services.billing.api import AllocationApi
    from services.billing.export import focus_dataset
    from services.billing.ledger import MinuteLinesDropped
    from tests.unit.billing.test_allocation import call

    now = DAY0 + DAYS * DAY_MS + 10 * HOUR_MS
    horizon = DAY0 + (DAYS - 14) * DAY_MS
    end = DAY0 + DAYS * DAY_MS
    app = AllocationApi(ledger, None, clock=ManualClock(now), max_window_seconds=93 * 86_400, max_steps=1000)
    whole = f"window={iso_utc(DAY0)},{iso_utc(end)}"
    before = call(app, query=f"{whole}&aggregate=namespace&includeIdle=true")
    assert before[0] == 200 and before[1]["gpumeter"]["grain"] == "daily rollups (20 days)"
    assert call(app, query=f"{whole}&aggregate=pod")[0] == 200
    retain(ledger, RetentionSettings(), now_ms=now)

    assert call(app, query=f"{whole}&aggregate=namespace&includeIdle=true") == before
    code, body = call(app, query=f"{whole}&aggregate=pod")
    assert code == 400 and iso_utc(horizon) in body["message"]
    code, body = call(app, query=f"window={iso_utc(horizon)},{iso_utc(end)}&aggregate=pod")
    assert code == 200 and body["data"]
    with pytest.raises(MinuteLinesDropped, match="FOCUS export"):
        focus_dataset(ledger, start_ms=DAY0, end_ms=end)
    assert focus_dataset(ledger, start_ms=horizon, end_ms=end)
