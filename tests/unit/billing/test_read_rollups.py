"""The bill and pod rollups (``services.billing.read_rollups``) and the reads that use them
(``services.billing.grain_reads``): kept by ``Ledger.write`` for exactly the bills it inserts, moved by
``apply_trueup``, backfilled by migration 0012; a report's node bills and ``/allocation`` by namespace, node,
cluster or the team label read from them equal what the minute data says, to the micro-dollar (GPU-hours within
1e-9), also after a true-up and after retention dropped the minute lines and the node bills."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
from alembic import command
from sqlalchemy import func, select

from gpumeter.clock import ManualClock, iso_utc
from services.billing import read_rollups
from services.billing.allocation import allocation_sets, parse_query, response
from services.billing.api import AllocationApi
from services.billing.ledger import READ_ROLLUPS, Grouping, Ledger, _alembic_config, node_bills
from services.billing.line_storage import decode_zero_lines
from services.billing.report import build_report, format_report
from services.billing.retention import RetentionSettings, retain
from services.billing.rollups import DAY, DAY_MS, HOUR, HOUR_MS, MINUTE
from tests.unit.billing.conftest import sample_costs
from tests.unit.billing.test_retention import DAY0, DAYS, comparable, history

GROUPINGS = ("namespace", "node", "label:team", "pod", "gpu")
STEP = {HOUR: HOUR_MS, DAY: DAY_MS}


def everything(results):
    return [c for r in results for c in r.costs], [r.bill for r in results]


def write_history(ledger):
    results = history()
    half = len(results) // 2
    ledger.write(*everything(results[:half]))
    ledger.write(*everything(results))  # the first half again, redelivered beside the second
    return ledger


# -- what the rollups must equal, recomputed here from what the ledger stores -------------------------------------


def bill_reference(ledger, grain):
    step = STEP[grain]
    out = defaultdict(lambda: [0] * 8)
    for b in ledger.bills():
        zero = len(decode_zero_lines(b["zero_lines"]))
        assert b["zero_line_count"] == zero
        key = (b["window_start_unix_ms"] // step * step, b["cluster"], b["node_name"], b["price_version"],
               b["instance_type"], b["price_model"], b["provider"], b["region"], b["zone"], b["gpu_model"],
               b["sharing"])
        trued = b["trued_cost_micro_usd"]
        for i, value in enumerate((1, b["billed_milliseconds"], b["node_cost_micro_usd"], b["gpu_cost_micro_usd"],
                                   b["node_other_micro_usd"], b["node_cost_micro_usd"] if trued is None else trued,
                                   trued is not None, zero)):
            out[key][i] += value
    return {key: tuple(values) for key, values in out.items()}


def pod_reference(ledger, grain, team_key="team"):
    step = STEP[grain]
    billed_ms = {(b["cluster"], b["node_name"], b["window_start_unix_ms"]): b["billed_milliseconds"]
                 for b in ledger.bills()}
    out = defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0, 0.0])
    for c in ledger.iter_cost_lines():
        if c.subject_kind.value != "POD":
            continue
        ms = billed_ms[(c.cluster, c.node_name, c.window_start_unix_ms)]
        key = (c.window_start_unix_ms // step * step, c.cluster, c.node_name, c.namespace or "", team_key,
               c.labels.get(team_key, ""), team_key in c.labels, c.shared_from.value if c.shared_from else "",
               c.sharing_method, c.method, c.cost_basis)
        for i, value in enumerate((c.cost_micro_usd, 1, c.cost_share * c.gpu_fraction * ms,
                                   c.memory_share * c.gpu_fraction * ms, c.compute_share * c.gpu_fraction * ms,
                                   c.gpu_fraction * ms)):
            out[key][i] += value
    return {key: tuple(values) for key, values in out.items()}


def stored(ledger, kind, grain):
    tables = READ_ROLLUPS.bills if kind == "bills" else READ_ROLLUPS.pods
    return read_rollups.bill_rows_of(ledger.read, tables[grain])


def assert_close(got, wanted):
    """Rollup rows equal: integers exactly, float milliseconds within 1e-9 relative."""
    assert set(got) == set(wanted)
    for key, values in wanted.items():
        for a, b in zip(got[key], values):
            if isinstance(b, float):
                assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6), (key, got[key], values)
            else:
                assert a == b, (key, got[key], values)


def assert_rollups_are_the_bills_and_pod_lines(ledger):
    for grain in (HOUR, DAY):
        assert stored(ledger, "bills", grain) == bill_reference(ledger, grain)
        assert_close(stored(ledger, "pods", grain), pod_reference(ledger, grain, ledger.team_label))


# -- maintained as bills land and as true-ups move ----------------------------------------------------------------


def test_rollups_are_the_written_bills_and_pod_lines_and_a_redelivery_adds_nothing(sqlite_ledger):
    start = DAY0 + DAY_MS - 40 * 60_000  # 90 minutes across midnight: two hours, two days
    costs, bills = everything(sample_costs(90, start_ms=start, sharing="idle=weighted"))
    sqlite_ledger.write(costs[: len(costs) // 2], bills[: len(bills) // 2])
    sqlite_ledger.write(costs, bills)
    before = {(kind, grain): stored(sqlite_ledger, kind, grain) for kind in ("bills", "pods") for grain in (HOUR, DAY)}
    assert sqlite_ledger.write(costs, bills).bills_written == 0
    assert {(kind, grain): stored(sqlite_ledger, kind, grain) for kind, grain in before} == before
    assert_rollups_are_the_bills_and_pod_lines(sqlite_ledger)
    daily = before[("bills", DAY)]
    assert sum(v[0] for v in daily.values()) == len(bills)
    assert sum(v[2] for v in daily.values()) == sum(b.node_cost_micro_usd for b in bills)


def test_a_trueup_moves_the_bill_rollups_trued_sums_and_an_amended_bill_replaces_them(sqlite_ledger):
    from tests.unit.billing.test_reconcile import FOCUS, FOCUS_AMENDED, run, world

    sqlite_ledger.write(*everything(world()))
    listed = stored(sqlite_ledger, "bills", HOUR)
    assert run(sqlite_ledger, FOCUS)[0] == 0
    trued = stored(sqlite_ledger, "bills", HOUR)
    assert sum(v[6] for v in trued.values()) > 0 and trued != listed
    assert_rollups_are_the_bills_and_pod_lines(sqlite_ledger)
    run(sqlite_ledger, FOCUS_AMENDED, now_ms=DAY0 + 30 * DAY_MS)
    assert_rollups_are_the_bills_and_pod_lines(sqlite_ledger)
    run(sqlite_ledger, FOCUS, now_ms=DAY0 + 31 * DAY_MS)
    assert stored(sqlite_ledger, "bills", HOUR) == trued


# -- reports: node bills from the rollups ----------------------------------------------------------------------


def check_reports_over_rollups_equal_minute_data(ledger, start, end, groupings=GROUPINGS):
    for by in groupings:
        for cost in ("list", "trued"):
            rolled = build_report(ledger, Grouping.parse(by), start_ms=start, end_ms=end, cost=cost)
            minute = build_report(ledger, Grouping.parse(by), start_ms=start, end_ms=end, cost=cost, grain="minute")
            assert rolled.bills_plan.grains() == (DAY, HOUR, MINUTE) and minute.bills_plan.grains() == (MINUTE,)
            assert comparable(rolled) == comparable(minute), (by, cost)
            assert rolled.reconciliation.reconciled and rolled.pricing and rolled.sharing_policies


@pytest.fixture
def ledger(sqlite_ledger):
    return write_history(sqlite_ledger)


def test_a_reports_node_bills_from_the_rollups_equal_those_of_the_minute_bills(ledger):
    start, end = DAY0 + 7 * 60_000, DAY0 + (DAYS - 1) * DAY_MS + 14 * HOUR_MS + 31 * 60_000
    check_reports_over_rollups_equal_minute_data(ledger, start, end)
    report = build_report(ledger, Grouping("namespace"), start_ms=start, end_ms=end)
    assert ("; node bills from daily rollups (18 days), hourly rollups (37 hours), minute node bills (84 minutes)"
            in format_report(report, "table"))


def drop_minute_data(ledger, now_ms):
    """Retention's drop of the minute lines and the node bills with them."""
    result = retain(ledger, RetentionSettings(), now_ms=now_ms)
    assert result.bills_deleted > 0 and result.deleted[MINUTE] > 0
    with ledger.engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(node_bills).where(
            node_bills.c.window_start_unix_ms < result.kept_from_ms[MINUTE])).scalar() == 0
    return result


def test_reports_are_unchanged_after_retention_dropped_the_minute_lines_and_the_node_bills(ledger):
    whole = (DAY0, DAY0 + DAYS * DAY_MS)
    reports = {(by, cost): build_report(ledger, Grouping.parse(by), start_ms=whole[0], end_ms=whole[1], cost=cost)
               for by in ("namespace", "node", "label:team") for cost in ("list", "trued")}
    drop_minute_data(ledger, whole[1] + 10 * HOUR_MS)
    (left,), = ledger.read(select(func.count()).select_from(node_bills))
    assert 0 < left < len(history())
    for (by, cost), report in reports.items():
        again = build_report(ledger, Grouping.parse(by), start_ms=whole[0], end_ms=whole[1], cost=cost)
        assert comparable(again) == comparable(report) and again.reconciliation.reconciled
        assert again.bills_plan.grains() == (DAY,)


def test_a_trued_report_from_the_rollups_is_unchanged_after_retention(sqlite_ledger):
    """The recorded ledger (zero lines, a FOCUS true-up): every report from the rollups, list and trued, is the
    same after its minute lines and node bills are gone."""
    from tests.unit.billing.data import make_ledger_0007 as recorded

    priced = recorded.results()
    sqlite_ledger.write(*everything(priced))
    recorded._reconcile(sqlite_ledger, recorded.FOCUS)
    start, end = recorded.START_MS, recorded.END_MS
    reports = {(by, cost): build_report(sqlite_ledger, Grouping.parse(by), start_ms=start, end_ms=end, cost=cost)
               for by in ("namespace", "node", "label:team") for cost in ("list", "trued")}
    assert reports[("namespace", "trued")].trued_windows > 0
    assert_rollups_are_the_bills_and_pod_lines(sqlite_ledger)
    # The bills' zero lines, counted by the rollups from node_bills.zero_line_count.
    assert sum(v[7] for v in stored(sqlite_ledger, "bills", DAY).values()) > 0
    drop_minute_data(sqlite_ledger, end + 30 * DAY_MS)
    for (by, cost), report in reports.items():
        again = build_report(sqlite_ledger, Grouping.parse(by), start_ms=start, end_ms=end, cost=cost)
        assert comparable(again) == comparable(report) and again.reconciliation.reconciled, (by, cost)


# -- /allocation from the rollups ------------------------------------------------------------------------------


def minute_answer(ledger, query):
    """The answer summed from the minute lines and node bills only (``Ledger.allocation_sums``)."""
    pods, buckets = ledger.allocation_sums(query)
    micro, _ = ledger.bill_totals(start_ms=query.start_ms, end_ms=query.end_ms, cluster=query.cluster)
    return response(query, allocation_sets(query, pods, buckets),
                    policies=ledger.sharing_policies(start_ms=query.start_ms, end_ms=query.end_ms,
                                                     cluster=query.cluster), bills_micro_usd=micro)


HOURS = ("gpuHours", "gpuMemoryHours", "gpuComputeHours", "memoryShare", "computeShare")


def assert_same_allocations(got, wanted):
    """Costs exact, hours within 1e-9 relative (the rollups add the same products in another order)."""
    assert got["code"] == wanted["code"] == 200
    assert len(got["data"]) == len(wanted["data"])
    for got_set, wanted_set in zip(got["data"], wanted["data"]):
        assert sorted(got_set) == sorted(wanted_set)
        for name, allocation in wanted_set.items():
            other = got_set[name]
            assert {k: v for k, v in other.items() if k not in HOURS} == \
                {k: v for k, v in allocation.items() if k not in HOURS}, name
            for k in HOURS:
                assert math.isclose(other[k], allocation[k], rel_tol=1e-9, abs_tol=2e-9), (name, k)
    notes = dict(got["gpumeter"])
    notes.pop("grain")
    assert notes == wanted["gpumeter"]


QUERIES = (
    {},
    {"includeIdle": "true"},
    {"includeIdle": "true", "shareIdle": "true"},
    {"includeIdle": "true", "idleByNode": "true"},
    {"step": "1d", "includeIdle": "true"},
    {"step": "1h"},
    {"step": "1d", "shareIdle": "true", "idleByNode": "true", "includeIdle": "true"},
)


@pytest.mark.parametrize("aggregate", ["namespace", "node", "cluster", "label:team"])
def test_allocation_from_the_rollups_equals_the_allocation_from_the_minute_lines(ledger, aggregate):
    check_allocation_over_rollups(ledger, aggregate)


def check_allocation_over_rollups(ledger, aggregate, queries=QUERIES):
    app = AllocationApi(ledger, None, clock=ManualClock(DAY0 + DAYS * DAY_MS), max_window_seconds=93 * 86_400,
                        max_steps=1000)
    # From 00:07 on the first day to 14:31 on the last but one: minutes, hours and days, steps across them.
    start, end = DAY0 + 7 * 60_000, DAY0 + (DAYS - 2) * DAY_MS + 14 * HOUR_MS + 31 * 60_000
    aligned = (DAY0, DAY0 + (DAYS - 2) * DAY_MS)
    for a, b in ((start, end), aligned):
        for extra in queries:
            params = {"window": f"{iso_utc(a)},{iso_utc(b)}", "aggregate": aggregate, **extra}
            query = parse_query(params, b, max_window_seconds=93 * 86_400, max_steps=1000)
            got = app.answer(query)
            assert_same_allocations(got, minute_answer(ledger, query))
            if extra.get("step") == "1h" and a % HOUR_MS:
                # Steps from :07 past the hour: no hour lies inside one, the minute lines answer.
                assert got["gpumeter"]["grain"].startswith("minute cost lines")
            else:
                assert "rollups" in got["gpumeter"]["grain"], (params, got["gpumeter"]["grain"])
            if (a, b) == aligned and "step" not in extra:
                assert got["gpumeter"]["grain"] == f"daily rollups ({DAYS - 2} days)"
            if extra.get("includeIdle"):
                assert got["gpumeter"]["reconciliation"]["reconciled"]


def test_allocation_by_pod_or_another_label_reads_the_minute_lines(ledger):
    app = AllocationApi(ledger, None, clock=ManualClock(DAY0 + DAYS * DAY_MS), max_window_seconds=93 * 86_400,
                        max_steps=1000)
    for aggregate in ("pod", "label:model"):
        query = parse_query({"window": f"{iso_utc(DAY0)},{iso_utc(DAY0 + 3 * DAY_MS)}", "aggregate": aggregate},
                            DAY0 + 3 * DAY_MS)
        got = app.answer(query)
        assert got["gpumeter"]["grain"] == "minute cost lines (4320 minutes)"
        assert_same_allocations(got, minute_answer(ledger, query))


def test_allocation_from_the_rollups_after_retention_dropped_the_minute_data(ledger):
    app = AllocationApi(ledger, None, clock=ManualClock(DAY0 + DAYS * DAY_MS), max_window_seconds=93 * 86_400,
                        max_steps=1000)
    query = parse_query({"window": f"{iso_utc(DAY0)},{iso_utc(DAY0 + DAYS * DAY_MS)}", "aggregate": "label:team",
                         "includeIdle": "true", "step": "1d"}, DAY0 + DAYS * DAY_MS)
    before = app.answer(query)
    assert_same_allocations(before, minute_answer(ledger, query))
    drop_minute_data(ledger, DAY0 + DAYS * DAY_MS + 10 * HOUR_MS)
    assert app.answer(query) == before


# -- migration 0012 ------------------------------------------------------------------------------------------


def check_upgrade_backfills_what_write_keeps(ledger):
    """Rollups kept by the writes (and a true-up) = those the migration backfills from the same bills and lines."""
    kept = {(kind, grain): stored(ledger, kind, grain) for kind in ("bills", "pods") for grain in (HOUR, DAY)}
    with ledger.engine.begin() as connection:
        command.downgrade(_alembic_config(connection), "0009_rollups")
    assert ledger.migrate() == Ledger.head_revision() == "0018_bill_ids"
    for (kind, grain), rows in kept.items():
        assert_close(stored(ledger, kind, grain), rows)
    assert_rollups_are_the_bills_and_pod_lines(ledger)


def test_the_upgrade_backfills_the_rollups_write_keeps(sqlite_ledger):
    from tests.unit.billing.data import make_ledger_0007 as recorded

    sqlite_ledger.write(*everything(recorded.results()))
    recorded._reconcile(sqlite_ledger, recorded.FOCUS)
    check_upgrade_backfills_what_write_keeps(sqlite_ledger)


def test_an_upgrade_after_retention_holds_pod_rollups_from_its_horizon_only(ledger):
    now = DAY0 + DAYS * DAY_MS + 10 * HOUR_MS
    horizon = retain(ledger, RetentionSettings(), now_ms=now).kept_from_ms[MINUTE]
    with ledger.engine.begin() as connection:
        command.downgrade(_alembic_config(connection), "0009_rollups")
    ledger.migrate()
    app = AllocationApi(ledger, None, clock=ManualClock(now), max_window_seconds=93 * 86_400, max_steps=1000)
    early = parse_query({"window": f"{iso_utc(DAY0)},{iso_utc(horizon)}", "aggregate": "namespace"}, now)
    from services.billing.ledger import MinuteLinesDropped

    with pytest.raises(MinuteLinesDropped, match=iso_utc(horizon)):
        app.answer(early)
    late = parse_query({"window": f"{iso_utc(horizon)},{iso_utc(DAY0 + DAYS * DAY_MS)}", "aggregate": "namespace",
                        "includeIdle": "true"}, now)
    answer = app.answer(late)
    assert answer["gpumeter"]["grain"] == "daily rollups (14 days)"
    assert_same_allocations(answer, minute_answer(ledger, late))
