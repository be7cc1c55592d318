"""The hourly FOCUS grain (``services.billing.focus_rollups``, ``focus.focus_hour_rows``, ``export.focus_export``):
per node-hour the rows add up to the node's minute bills to the micro-dollar, per (node-hour, pod) a row is the sum
of that pod's minute rows, ratios add up to 1 per origin charge, redeliveries and true-ups keep the rollups exact,
retention of the minute lines leaves the hourly export unchanged, and migration 0015 backfills what the writes keep.
"""

from __future__ import annotations

import argparse
import io
import json
from collections import defaultdict
from decimal import Decimal
from fractions import Fraction

import pytest
from alembic import command
from sqlalchemy import inspect

from services.billing import export as export_module
from services.billing import focus_rollups
from services.billing import report as report_module
from services.billing.export import choose_grain, focus_dataset, focus_export, focus_hour_chunks
from services.billing.focus import hour_units, iso_z
from services.billing.ledger import FOCUS_ROLLUPS, Ledger, _alembic_config
from services.billing.retention import RetentionSettings, retain
from services.billing.rollups import DAY_MS, HOUR_MS
from tests.unit.billing.conftest import WINDOW_START_MS, sample_costs

HOUR0 = WINDOW_START_MS - WINDOW_START_MS % HOUR_MS
# 100 one-minute node-windows per node from 20 minutes into HOUR0: two whole-ish hours and a partial one.
FIRST_MS = HOUR0 + 20 * 60_000
WINDOWS = 100
END_MS = HOUR0 + 3 * HOUR_MS
SHARED = "idle=weighted,node_other=weighted"


def write(ledger, sharing="keep", windows=WINDOWS, start_ms=FIRST_MS):
    results = sample_costs(windows, start_ms=start_ms, sharing=sharing)
    ledger.write([c for r in results for c in r.costs], [r.bill for r in results])
    return results


def hour_rows(ledger, start_ms=HOUR0, end_ms=END_MS):
    return [row for chunk in focus_hour_chunks(ledger, start_ms=start_ms, end_ms=end_ms, chunk_hours=2)
            for row in chunk]


def hour_of(ms):
    return ms - ms % HOUR_MS


def subject(row):
    return row["x_PodUid"] if row["x_Subject"] == "pod" else row["x_Subject"]


def by_node_hour_subject(rows, hourly):
    """(node, hour start ISO, subject) -> the rows, the minute rows moved to their hour."""
    out = defaultdict(list)
    for row in rows:
        start = row["ChargePeriodStart"]
        if not hourly:
            from datetime import datetime

            ms = int(datetime.fromisoformat(start.replace("Z", "+00:00")).timestamp() * 1000)
            start = iso_z(hour_of(ms))
        out[(row["x_NodeName"], start, subject(row))].append(row)
    return out


def elements(row):
    return json.loads(row["AllocatedMethodDetails"])["Elements"]


@pytest.mark.parametrize("sharing", ["keep", SHARED, "all=even"])
def test_hourly_rows_are_the_sums_of_the_minute_rows_and_add_up_to_each_node_hours_bills(sqlite_ledger, sharing):
    results = write(sqlite_ledger, sharing)
    hourly = hour_rows(sqlite_ledger)
    minute = focus_dataset(sqlite_ledger, start_ms=HOUR0, end_ms=END_MS)
    assert len(hourly) < len(minute) / 30
    # Per node-hour: the node's minute bills of the hour, to the micro-dollar, and their billed hours exactly.
    bills = defaultdict(lambda: [0, 0])
    window_ms = {}
    for result in results:
        bill = result.bill
        window_ms[(bill.node_name, iso_z(bill.window_start_unix_ms))] = bill.billed_milliseconds
        sums = bills[(bill.node_name, iso_z(hour_of(bill.window_start_unix_ms)))]
        sums[0] += bill.node_cost_micro_usd
        sums[1] += bill.billed_milliseconds
    exact_gpu_hours = defaultdict(Fraction)
    for result in results:
        bill = result.bill
        for c in result.costs:
            if c.pod_uid and c.gpu_uuid and c.shared_from is None:
                exact_gpu_hours[(bill.node_name, iso_z(hour_of(bill.window_start_unix_ms)), c.pod_uid)] += (
                    Fraction(c.cost_share) * Fraction(c.gpu_fraction) * Fraction(bill.billed_milliseconds, HOUR_MS))
    origins = defaultdict(list)
    for row in hourly:
        assert row["ChargePeriodEnd"] == iso_z(hour_of(_ms(row["ChargePeriodStart"])) + HOUR_MS)
        origins[(row["x_NodeName"], row["ChargePeriodStart"])].append(row)
    assert set(origins) == set(bills)
    for key, group in origins.items():
        micro, billed_ms = bills[key]
        for column in ("BilledCost", "EffectiveCost", "ListCost", "ContractedCost"):
            assert sum(r[column] for r in group) == Decimal(micro).scaleb(-6), column
        assert sum(r["x_ListCostMicroUsd"] for r in group) == micro
        assert sum(r["PricingQuantity"] for r in group) == Decimal(hour_units(billed_ms)).scaleb(-10)
        # Over an origin charge the ratios add up to 1: exactly in the rationals they are, 1e-12 as JSON floats.
        ratios = [e["AllocatedRatio"] for r in group for e in elements(r)]
        assert abs(sum(Fraction(x) for x in ratios) - 1) < Fraction(1, 10**12)
        assert sum(Fraction(r["x_ListCostMicroUsd"], micro) for r in group) == 1
        for column in ("ResourceId", "SkuPriceId", "ChargeDescription", "Tags", "AllocatedMethodId"):
            assert len({r[column] for r in group}) == 1
    # Per (node-hour, pod or bucket): the hourly row is the sum of the minute rows of the hour.
    hours, minutes = by_node_hour_subject(hourly, True), by_node_hour_subject(minute, False)
    assert set(hours) == set(minutes)
    for key, (row,) in hours.items():
        group = minutes[key]
        for column in ("x_ListCostMicroUsd", "x_BilledCostMicroUsd"):
            assert row[column] == sum(r[column] for r in group), (key, column)
        for column in ("x_DirectCost", "x_SharedCost"):
            assert row[column] == sum(r[column] for r in group), (key, column)
        if row["x_Subject"] == "pod":
            # Within 1e-9 of the exact GPU-hours of the pod's minute lines; each minute row is rounded to 1e-10.
            assert abs(Fraction(row["x_GpuHours"]) - exact_gpu_hours[key]) <= Fraction(1, 10**9)
            assert abs(row["x_GpuHours"] - sum(r["x_GpuHours"] for r in group)) <= Decimal("0.5e-10") * (
                len(group) + 1)
            assert row["AllocatedTags"] == group[0]["AllocatedTags"]
            assert row["AllocatedResourceName"] == group[0]["AllocatedResourceName"]
        # Element by element (one per line identity): GPU-hours summed, ratios of the hour's origin charge, shares
        # time-weighted over the hour's billed time, the minute lines counted.
        minute_elements = defaultdict(list)
        weights = defaultdict(list)
        for r in group:
            for e in elements(r):
                minute_elements[(e.get("x_GpuUuid"), e.get("x_SharedFrom"))].append(e)
                weights[(e.get("x_GpuUuid"), e.get("x_SharedFrom"))].append(
                    window_ms[(r["x_NodeName"], r["ChargePeriodStart"])])
        hour_elements = {(e.get("x_GpuUuid"), e.get("x_SharedFrom")): e for e in elements(row)}
        assert set(hour_elements) == set(minute_elements)
        node_hour_ms = bills[key[:2]][1]
        for element_key, element in hour_elements.items():
            parts = minute_elements[element_key]
            assert element["x_Lines"] == len(parts)
            if "UsageQuantity" in element:
                assert element["UsageQuantity"] == pytest.approx(sum(p["UsageQuantity"] for p in parts),
                                                                 rel=1e-12, abs=1e-12)
            if "x_CostShare" in element:
                # Time-weighted: each minute's share by its window's billed time, over the hour's.
                assert element["x_CostShare"] == pytest.approx(sum(
                    p["x_CostShare"] * ms for p, ms in zip(parts, weights[element_key])) / node_hour_ms,
                    rel=1e-12, abs=1e-15)
            assert {k for k in element if k != "x_Lines"} == set(parts[0])


def _ms(iso):
    from datetime import datetime

    return int(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() * 1000)


def test_a_pod_there_half_the_hour_has_half_its_share_and_the_shares_of_a_gpu_add_up_to_1(sqlite_ledger):
    write(sqlite_ledger, windows=60, start_ms=HOUR0)
    hourly = hour_rows(sqlite_ledger, HOUR0, HOUR0 + HOUR_MS)
    per_gpu = defaultdict(float)
    for row in hourly:
        for e in elements(row):
            if "x_GpuUuid" in e and "x_SharedFrom" not in e:
                per_gpu[(row["x_NodeName"], e["x_GpuUuid"])] += e["x_CostShare"]
    assert per_gpu and all(total == pytest.approx(1.0, abs=1e-9) for total in per_gpu.values())
    # The same windows of the first half hour only: every share is the minute's, halved over a whole hour's origin.
    second = Ledger(sqlite_ledger.url.replace("ledger.sqlite3", "half.sqlite3"))
    second.migrate()
    write(second, windows=30, start_ms=HOUR0)
    half = hour_rows(second, HOUR0, HOUR0 + HOUR_MS)
    minute = focus_dataset(second, start_ms=HOUR0, end_ms=HOUR0 + 60_000)
    pod = next(r for r in minute if r["x_Subject"] == "pod")
    share = elements(pod)[0]["x_CostShare"]
    row = next(r for r in half if r["x_PodUid"] == pod["x_PodUid"])
    assert elements(row)[0]["x_CostShare"] == pytest.approx(share, rel=1e-12)  # 30 of 30 billed minutes
    second.close()


def test_a_redelivered_node_window_adds_nothing(sqlite_ledger):
    results = write(sqlite_ledger)
    tables = (focus_rollups.rows_of(sqlite_ledger.read, FOCUS_ROLLUPS.charges),
              focus_rollups.rows_of(sqlite_ledger.read, FOCUS_ROLLUPS.lines))
    rows = hour_rows(sqlite_ledger)
    again = sqlite_ledger.write([c for r in results[40:60] for c in r.costs], [r.bill for r in results[40:60]])
    assert again.bills_written == 0 and again.bills_skipped == 20
    assert (focus_rollups.rows_of(sqlite_ledger.read, FOCUS_ROLLUPS.charges),
            focus_rollups.rows_of(sqlite_ledger.read, FOCUS_ROLLUPS.lines)) == tables
    assert hour_rows(sqlite_ledger) == rows


def test_a_trueup_moves_the_hourly_billed_cost_with_its_minute_lines(sqlite_ledger):
    from tests.unit.billing.test_reconcile import FOCUS, FOCUS_AMENDED, T10, run, world

    results = world()
    sqlite_ledger.write([c for r in results for c in r.costs], [r.bill for r in results])
    start = hour_of(min(r.bill.window_start_unix_ms for r in results))
    end = hour_of(max(r.bill.window_start_unix_ms for r in results)) + HOUR_MS

    def assert_hourly_equals_minute():
        hourly = [r for c in focus_hour_chunks(sqlite_ledger, start_ms=start, end_ms=end) for r in c]
        minute = focus_dataset(sqlite_ledger, start_ms=start, end_ms=end)
        hours, minutes = by_node_hour_subject(hourly, True), by_node_hour_subject(minute, False)
        assert set(hours) == set(minutes)
        for key, (row,) in hours.items():
            for column in ("x_ListCostMicroUsd", "x_BilledCostMicroUsd", "BilledCost", "ListCost"):
                assert row[column] == sum(r[column] for r in minutes[key]), (key, column)
        return sum(r["x_BilledCostMicroUsd"] for r in hourly)

    listed = assert_hourly_equals_minute()
    assert run(sqlite_ledger, FOCUS)[0] == 0
    trued = assert_hourly_equals_minute()
    assert trued != listed
    run(sqlite_ledger, FOCUS_AMENDED, now_ms=T10 + 2 * DAY_MS)
    assert assert_hourly_equals_minute() not in (trued, listed)
    run(sqlite_ledger, FOCUS, now_ms=T10 + 3 * DAY_MS)
    assert assert_hourly_equals_minute() == trued


def test_retention_of_the_minute_lines_leaves_the_hourly_export_unchanged(sqlite_ledger):
    results = write(sqlite_ledger)
    before = hour_rows(sqlite_ledger)
    assert choose_grain(sqlite_ledger, start_ms=HOUR0, end_ms=END_MS).grain == "hour"
    now = HOUR0 - HOUR0 % DAY_MS + 16 * DAY_MS  # the minute lines' horizon (14 days) is past the whole range
    result = retain(sqlite_ledger, RetentionSettings(), now_ms=now)
    assert result.deleted["minute"] > 0 and result.bills_deleted == len(results)
    assert hour_rows(sqlite_ledger) == before
    chosen, chunks = focus_export(sqlite_ledger, start_ms=HOUR0, end_ms=END_MS)
    assert chosen.grain == "hour" and [r for c in chunks for r in c] == before
    with pytest.raises(Exception, match="retention kept them"):
        focus_export(sqlite_ledger, start_ms=HOUR0, end_ms=END_MS, grain="minute")
    # The hourly retention drops them with the hourly rollups: then the hourly grain refuses, never empty.
    retain(sqlite_ledger, RetentionSettings(hourly_rollups_days=15, daily_rollups_days=400), now_ms=now)
    assert focus_rollups.rows_of(sqlite_ledger.read, FOCUS_ROLLUPS.lines) == {}
    with pytest.raises(Exception, match="hold hours from"):
        choose_grain(sqlite_ledger, start_ms=HOUR0, end_ms=END_MS, grain="hour")


def test_auto_is_hourly_over_whole_hours_the_rollups_hold_and_minute_otherwise(sqlite_ledger):
    write(sqlite_ledger)
    assert choose_grain(sqlite_ledger, start_ms=HOUR0, end_ms=END_MS).describe() == (
        "hour (hourly FOCUS rollups, 3 hours)")
    partial = choose_grain(sqlite_ledger, start_ms=HOUR0 + 60_000, end_ms=END_MS)
    assert partial.grain == "minute" and "not whole UTC hours" in partial.reason
    with pytest.raises(Exception, match="not whole UTC hours"):
        choose_grain(sqlite_ledger, start_ms=HOUR0 + 60_000, end_ms=END_MS, grain="hour")
    assert choose_grain(sqlite_ledger, start_ms=HOUR0, end_ms=END_MS, grain="minute").grain == "minute"
    # Hourly FOCUS rows that no longer add up to the hours' bills (here: deleted behind the ledger's back) are not
    # read by auto; --grain hour refuses.
    with sqlite_ledger.transaction() as connection:
        connection.execute(FOCUS_ROLLUPS.charges.delete().where(
            FOCUS_ROLLUPS.charges.c.period_start_unix_ms == HOUR0 + HOUR_MS))
    assert "hourly bill rollups" in choose_grain(sqlite_ledger, start_ms=HOUR0, end_ms=END_MS).reason
    with pytest.raises(Exception, match="hourly bill rollups"):
        choose_grain(sqlite_ledger, start_ms=HOUR0, end_ms=END_MS, grain="hour")


def _export(ledger, out, *flags):
    parser = argparse.ArgumentParser()
    export_module.add_arguments(parser)
    args = parser.parse_args(["focus", "--out", str(out), "--ledger-url", ledger.url, *flags])
    stdout, stderr = io.StringIO(), io.StringIO()
    code = export_module.main(args, {}, out=stdout, err=stderr)
    return code, stdout.getvalue(), stderr.getvalue()


def test_the_commands_say_which_grain_they_used(sqlite_ledger, tmp_path):
    import pyarrow.parquet as pq

    write(sqlite_ledger)
    whole = ["--end", iso_z(END_MS), "--window", "3h"]
    code, out, _ = _export(sqlite_ledger, tmp_path / "h.parquet", *whole)
    assert code == 0 and out.endswith("grain: hour (hourly FOCUS rollups, 3 hours)\n")
    table = pq.read_table(tmp_path / "h.parquet")
    assert table.schema.metadata[b"gpumeter_grain"] == b"hour" and table.num_rows == len(hour_rows(sqlite_ledger))
    code, out, _ = _export(sqlite_ledger, tmp_path / "m.csv", "--end", iso_z(END_MS - 60_000), "--window", "3h")
    assert code == 0 and "grain: minute (minute cost lines: the range" in out
    code, _, err = _export(sqlite_ledger, tmp_path / "x.csv", "--end", iso_z(END_MS - 60_000), "--window", "3h",
                           "--grain", "hour")
    assert code == 2 and "not whole UTC hours" in err and not (tmp_path / "x.csv").exists()
    code, out, _ = _export(sqlite_ledger, tmp_path / "h.csv", *whole, "--grain", "hour")
    csv_text = (tmp_path / "h.csv").read_text()
    assert code == 0 and len(csv_text.splitlines()) == len(hour_rows(sqlite_ledger)) + 1
    assert not list(tmp_path.glob("*.partial"))
    # gpumeter report --format focus: the same CSV, the grain on stderr.
    parser = argparse.ArgumentParser()
    report_module.add_arguments(parser)
    args = parser.parse_args(["--format", "focus", "--ledger-url", sqlite_ledger.url, *whole])
    stdout, stderr = io.StringIO(), io.StringIO()
    assert report_module.main(args, {}, out=stdout, err=stderr) == 0
    assert stdout.getvalue() == csv_text and "FOCUS grain: hour" in stderr.getvalue()
    args = parser.parse_args(["--format", "table", "--grain", "hour", "--ledger-url", sqlite_ledger.url, *whole])
    assert report_module.main(args, {}, out=io.StringIO(), err=stderr) == 2


def _approx_rows(rows):
    """Rollup rows with their float sums rounded (the backfill adds the same products in another order)."""
    return {key: tuple(round(v, 3) if isinstance(v, float) else v for v in values) for key, values in rows.items()}


def test_migration_0015_backfills_what_the_writes_keep_and_its_hourly_export_equals_the_minute_sums(tmp_path):
    """A ledger written and trued up, taken down to 0013 (the FOCUS rollups dropped) and upgraded again: the
    backfill from the minute lines, zero lines and true-ups equals what ``Ledger.write`` and ``apply_trueup`` kept,
    and the hourly export equals the minute export's sums."""
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    ledger.migrate()
    check_the_backfill_equals_the_writes(ledger)
    ledger.close()


def check_the_backfill_equals_the_writes(ledger):
    """The migration test's body, on any migrated, empty ledger (PostgreSQL: tests/integration)."""
    from tests.unit.billing.data import make_ledger_0007 as recorded

    results = recorded.results()
    written = ledger.write([c for r in results for c in r.costs], [r.bill for r in results])
    assert written.lines_elided > 0
    assert recorded._reconcile(ledger, recorded.FOCUS).startswith("0\n")
    write(ledger, SHARED)
    kept = (focus_rollups.rows_of(ledger.read, FOCUS_ROLLUPS.charges),
            focus_rollups.rows_of(ledger.read, FOCUS_ROLLUPS.lines))
    assert any(v[3] for v in kept[1].values())  # trued lines among them
    with ledger.engine.begin() as connection:
        # Down to 0014 only: on PostgreSQL the bills written since keep their zero lines' GPU ids, which the
        # backfill must turn back into uuids (``ledger_gpus``).
        command.downgrade(_alembic_config(connection), "0014_line_ids")
        assert not {"focus_charge_hourly", "focus_line_hourly"} & set(inspect(connection).get_table_names())
        command.upgrade(_alembic_config(connection), "head")
    backfilled = (focus_rollups.rows_of(ledger.read, FOCUS_ROLLUPS.charges),
                  focus_rollups.rows_of(ledger.read, FOCUS_ROLLUPS.lines))
    assert backfilled[0] == kept[0]
    assert _approx_rows(backfilled[1]) == _approx_rows(kept[1])
    starts = [r.bill.window_start_unix_ms for r in results] + [FIRST_MS]
    start, end = hour_of(min(starts)), END_MS
    hourly = [r for c in focus_hour_chunks(ledger, start_ms=start, end_ms=end) for r in c]
    minute = focus_dataset(ledger, start_ms=start, end_ms=end)
    hours, minutes = by_node_hour_subject(hourly, True), by_node_hour_subject(minute, False)
    assert set(hours) == set(minutes)
    for key, (row,) in hours.items():
        for column in ("x_ListCostMicroUsd", "x_BilledCostMicroUsd"):
            assert row[column] == sum(r[column] for r in minutes[key])
        if row["x_Subject"] == "pod":
            # Each minute row is rounded to 1e-10 h, the hourly row once.
            assert abs(row["x_GpuHours"] - sum(r["x_GpuHours"] for r in minutes[key])) <= Decimal("0.5e-10") * (
                len(minutes[key]) + 1)


def test_the_upgrade_of_a_ledger_whose_minute_lines_retention_dropped_records_from_when_it_holds(sqlite_ledger):
    write(sqlite_ledger)
    write(sqlite_ledger, start_ms=FIRST_MS + 20 * DAY_MS)
    now = HOUR0 - HOUR0 % DAY_MS + 16 * DAY_MS
    retain(sqlite_ledger, RetentionSettings(), now_ms=now)
    horizon = HOUR0 - HOUR0 % DAY_MS + 2 * DAY_MS
    with sqlite_ledger.engine.begin() as connection:
        # Down to 0014 only: on PostgreSQL the bills written since keep their zero lines' GPU ids, which the
        # backfill must turn back into uuids (``ledger_gpus``).
        command.downgrade(_alembic_config(connection), "0014_line_ids")
        command.upgrade(_alembic_config(connection), "head")
    assert focus_rollups.kept_from(sqlite_ledger.read, FOCUS_ROLLUPS.charges.metadata.tables["ledger_retention"]) \
        == horizon
    # The hours before it were summed from no minute lines: never exported as costing nothing.
    assert "hold hours from" in choose_grain(sqlite_ledger, start_ms=HOUR0, end_ms=END_MS).reason
    with pytest.raises(Exception, match="hold hours from"):
        choose_grain(sqlite_ledger, start_ms=HOUR0, end_ms=END_MS, grain="hour")
    later = FIRST_MS + 20 * DAY_MS
    assert choose_grain(sqlite_ledger, start_ms=hour_of(later), end_ms=hour_of(later) + 3 * HOUR_MS).grain == "hour"


def test_id_rows_map_each_text_key_to_its_charge_and_dictionary_ids_and_refuse_a_key_without_one():
    link = (3_600_000, "c", "n1", "aws:///i-1", "us-east-1a", "v1", "exclusive", 60)
    pod_line = (*link, "POD", "uid-1", "GPU-1", "", "", "tick", "list", "ns", "pod-a", 7)
    bucket = (*link, "IDLE", "", "GPU-1", "", "", "tick", "list", "", "", 0)
    measures = {pod_line: [10, 11, 1, 0, 60_000, 0.5, 0.25, 0.75, 0.125],
                bucket: [0, 0, 2, 1, 120_000, 0.0, 0.0, 0.0, 0.0]}
    charges = {link: 42}
    gpus = {"GPU-1": 5}
    pods = {("uid-1", "ns", "pod-a", 0): 8, ("", "", "", 3): 9}  # a bucket's pod: both names absent
    kinds = {("POD", "", "", "tick", "list", 60): 2, ("IDLE", "", "", "tick", "list", 60): 3}
    rows = focus_rollups.id_rows(measures, charges, gpus, pods, kinds)
    assert [dict(zip(focus_rollups.ID_LINE_COLUMNS, row)) for row in rows] == [
        {"period_start_unix_ms": 3_600_000, "charge_id": 42, "label_set_id": 7, "cost_micro_usd": 10,
         "billed_micro_usd": 11, "cost_share_ms": 0.5, "memory_share_ms": 0.25, "compute_share_ms": 0.75,
         "gpu_ms": 0.125, "billed_ms": 60_000, "cost_lines": 1, "trued_lines": 0, "gpu_id": 5, "pod_id": 8,
         "kind_id": 2},
        {"period_start_unix_ms": 3_600_000, "charge_id": 42, "label_set_id": 0, "cost_micro_usd": 0,
         "billed_micro_usd": 0, "cost_share_ms": 0.0, "memory_share_ms": 0.0, "compute_share_ms": 0.0,
         "gpu_ms": 0.0, "billed_ms": 120_000, "cost_lines": 2, "trued_lines": 1, "gpu_id": 5, "pod_id": 9,
         "kind_id": 3}]
    for missing in ({}, charges), ({}, gpus), ({}, pods), ({}, kinds):
        maps = [charges, gpus, pods, kinds]
        maps[[id(m) for m in maps].index(id(missing[1]))] = missing[0]
        with pytest.raises(LookupError, match="2 of 2 hourly FOCUS lines have no"):
            focus_rollups.id_rows(measures, *maps)
