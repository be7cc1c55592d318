"""``gpumeter reconcile --bill FILE``: the ledger's node-windows trued up to a bill written by us in the published
formats (``tests/fixtures/bills/``: FOCUS 1.0 CSV, AWS CUR 2.0 CSV; FOCUS Parquet written here from the same rows).

The ledger holds four machines over 2026-11-10 10:00-12:10 UTC (5-minute windows), costed by billing at list
price: a spot g5.xlarge (``i-…0001``, running past the bill's last line item), a p4d.24xlarge (``i-…0002``: its
first hour covered by a Savings Plan, then half an hour on demand -- a partial hour, its last window half covered --
and a promotional credit over the whole month), a g4dn.xlarge the AWS bill does not charge (``i-…0003``) and a GCP
a2-highgpu-1g (not the AWS bill's at all). The bill also charges an instance gpumeter never saw, tax, a Savings
Plan fee, data transfer and an EBS volume.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
from dataclasses import replace
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
from sqlalchemy import select

from gpumeter import cli
from gpumeter.clock import ManualClock
from schemas.records import ShareSubjectKind
from services.billing import reconcile
from services.billing import report as report_module
from services.billing.bills import read_bill
from services.billing.catalog import PriceCatalog
from services.billing.costing import bill_node_window
from services.billing.ledger import Grouping, cost_lines, node_bills, trueups
from services.billing.report import build_report, parse_instant_ms
from services.billing.trueup import true_up
from tests.unit.billing.conftest import Unit, bucket, node_window, pod, shared_gpus

REPO = Path(__file__).resolve().parents[3]
BILLS = REPO / "tests" / "fixtures" / "bills"
FOCUS = BILLS / "focus_1_0_aws.csv"
FOCUS_AMENDED = BILLS / "focus_1_0_aws_amended.csv"
CUR2 = BILLS / "cur2_aws.csv"

T10 = parse_instant_ms("2026-11-10T10:00:00Z")
WINDOW_S = 300
SPOT = "aws:///us-east-1a/i-0a1b2c3d4e5f60001"
ON_DEMAND = "aws:///us-east-1b/i-0a1b2c3d4e5f60002"
UNBILLED = "aws:///us-east-1c/i-0a1b2c3d4e5f60003"
GCP = "gce://gpumeter-example/us-central1-a/gpu-gcp-c"
# What the bill charges each machine (effective cost), to the micro-dollar: 2 × 0.3617; 15.370349 + 10.978821 - 5.
SPOT_BILLED = 723_400
ON_DEMAND_BILLED = 21_349_170
ON_DEMAND_BILLED_CASH = 5_978_821  # billed basis: 21.957642 - 21.957642 + 10.978821 - 5


def _windows(node, provider_id, count, *, units, last_covered=None, **facts):
    out = []
    for index in range(count):
        covered = last_covered if last_covered is not None and index == count - 1 else None
        shares = node_window(units, node=node, window_start_ms=T10 + index * WINDOW_S * 1000, window_seconds=WINDOW_S,
                             covered_seconds=covered, **facts)
        out.append(tuple(replace(s, provider_id=provider_id, zone=provider_id.split("/")[3]) for s in shares))
    return out


def world():
    """The ledger's node-windows, costed by billing at list price (spot from a configured 60 % discount)."""
    catalog = PriceCatalog.load(spot_discounts={"aws": Decimal("0.6")})
    spot_rows = [pod("train-a", 0.6, "ml", team="research"), pod("notebook-a", 0.3, "ml", team="research"),
                 bucket(ShareSubjectKind.IDLE, 0.1)]
    on_demand_rows = [pod("serve-b", 0.55, "serving", team="prod"), pod("batch-b", 0.4, "ml", team="research"),
                      bucket(ShareSubjectKind.IDLE, 0.04), bucket(ShareSubjectKind.DRIVER_RESERVED, 0.01)]
    windows = (
        _windows("gpu-spot-a", SPOT, 26, units=[Unit("GPU-spot-0", spot_rows)], instance_type="g5.xlarge",
                 price_model="spot", gpu_model="NVIDIA A10G")
        + _windows("gpu-od-b", ON_DEMAND, 18, units=shared_gpus(8, on_demand_rows, prefix="GPU-od-"),
                   last_covered=150.0)
        + _windows("gpu-od-d", UNBILLED, 12, units=[Unit("GPU-od-d-0", [pod("dev-d", 1.0, "dev")])],
                   instance_type="g4dn.xlarge", gpu_model="Tesla T4")
        + _windows("gpu-gcp-c", GCP, 24, units=[Unit("GPU-gcp-0", [pod("embed-c", 0.7, "serving", team="prod"),
                                                                     bucket(ShareSubjectKind.IDLE, 0.3)])],
                   provider="gcp", region="us-central1", instance_type="a2-highgpu-1g")
    )
    return [bill_node_window(shares, catalog) for shares in windows]


@pytest.fixture
def ledger(sqlite_ledger):
    results = world()
    sqlite_ledger.write([c for r in results for c in r.costs], [r.bill for r in results])
    return sqlite_ledger


def run(ledger, bill, *flags, now_ms=T10 + 86_400_000):
    parser = argparse.ArgumentParser()
    reconcile.add_arguments(parser)
    args = parser.parse_args(["--bill", str(bill), "--ledger-url", ledger.url, *flags])
    out, err = io.StringIO(), io.StringIO()
    code = reconcile.main(args, {}, clock=ManualClock(now_ms), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def snapshot(ledger):
    """Every stored column of every bill, line and true-up."""
    with ledger.engine.connect() as connection:
        return {table.name: sorted(tuple(row) for row in connection.execute(select(table)))
                for table in (node_bills, cost_lines, trueups)}


def trued_by_machine(ledger):
    with ledger.engine.connect() as connection:
        rows = connection.execute(select(node_bills.c.provider_id, node_bills.c.trued_cost_micro_usd)).all()
    out = {}
    for provider_id, trued in rows:
        out.setdefault(provider_id, []).append(trued)
    return out


def list_columns(ledger):
    with ledger.engine.connect() as connection:
        bills = connection.execute(select(*(c for c in node_bills.c if c.name not in ("trued_cost_micro_usd",
                                                                                          "trueup_id")))).all()
        lines = connection.execute(select(*(c for c in cost_lines.c if c.name != "trued_cost_micro_usd"))).all()
    return sorted(map(tuple, bills)), sorted(map(tuple, lines))


def trued_values(ledger):
    with ledger.engine.connect() as connection:
        windows = {tuple(r[:3]): r[3] for r in connection.execute(
            select(node_bills.c.window_start_unix_ms, node_bills.c.cluster, node_bills.c.node_name,
                   node_bills.c.trued_cost_micro_usd))}
        lines = {tuple(r[:6]): r[6] for r in connection.execute(
            select(cost_lines.c.window_start_unix_ms, cost_lines.c.cluster, cost_lines.c.node_name,
                   cost_lines.c.gpu_uuid, cost_lines.c.subject_kind, cost_lines.c.pod_uid,
                   cost_lines.c.trued_cost_micro_usd))}
    return windows, lines


def test_a_focus_bill_trues_each_machine_up_to_the_micro_dollar_keeping_each_pods_proportion(ledger):
    before = list_columns(ledger)
    code, out, err = run(ledger, FOCUS)
    assert code == 0, err

    machines = trued_by_machine(ledger)
    # The trued-up windows of each billed machine add up to what the bill charged it, exactly.
    assert sum(v for v in machines[SPOT] if v is not None) == SPOT_BILLED
    assert sum(machines[ON_DEMAND]) == ON_DEMAND_BILLED
    # The spot machine ran 10 minutes past the bill's last line item: those two windows keep no trued-up cost.
    assert machines[SPOT].count(None) == 2 and len(machines[SPOT]) == 26
    # The machines the bill does not charge keep their list price only.
    assert set(machines[GCP]) == set(machines[UNBILLED]) == {None}
    # Nothing of the list-price ledger changed.
    assert list_columns(ledger) == before

    # Per window the lines add up to the window, and each line keeps its share of the window's list price.
    windows, lines = trued_values(ledger)
    with ledger.engine.connect() as connection:
        listed = {tuple(r[:6]): r[6] for r in connection.execute(
            select(cost_lines.c.window_start_unix_ms, cost_lines.c.cluster, cost_lines.c.node_name,
                   cost_lines.c.gpu_uuid, cost_lines.c.subject_kind, cost_lines.c.pod_uid,
                   cost_lines.c.cost_micro_usd))}
    per_window = {}
    for key, trued in lines.items():
        per_window.setdefault(key[:3], []).append((trued, listed[key]))
    for key, trued_window in windows.items():
        pairs = per_window[key]
        if trued_window is None:
            assert {t for t, _ in pairs} == {None}
            continue
        assert sum(t for t, _ in pairs) == trued_window
        list_window = sum(l for _, l in pairs)
        for trued, list_micro in pairs:
            assert abs(trued - Fraction(trued_window * list_micro, list_window)) < 1

    # The report says what matched and what did not.
    assert "billed but never seen: i-0fffffffffffffff9 3.06 USD" in out
    assert "seen but not billed: prod/gpu-od-d (aws:///us-east-1c/i-0a1b2c3d4e5f60003): 12 node-windows" in out
    assert "gpu-gcp-c" not in out  # an AWS bill says nothing of a GCP node
    assert "not covered by the bill's line items: 2 node-windows" in out
    assert "not a node's: tax without a resource id 1, usage of service category Networking 1" in out
    assert "42 of 56 node-windows" in out
    # --strict makes the mismatches an exit status.
    assert run(ledger, FOCUS, "--strict")[0] == 1


def test_the_partial_hour_lands_on_the_windows_that_ran_in_it(ledger):
    """The on-demand machine ran 11:00-11:27:30 of its second, on-demand hour: that hour's 10.978821 USD (plus
    its share of the month's credit) is on those six windows, the last one half covered."""
    run(ledger, FOCUS)
    windows, _ = trued_values(ledger)
    second_hour = [trued for (start, _cluster, node), trued in windows.items()
                   if node == "gpu-od-b" and start >= T10 + 3_600_000]
    assert len(second_hour) == 6
    bill = read_bill(FOCUS)
    result = true_up(bill, ledger.trueup_windows(start_ms=bill.scope_start_ms, end_ms=bill.scope_end_ms))
    machine = next(m for m in result.machines if m.provider_id == ON_DEMAND)
    assert not machine.unallocated and machine.windows_not_covered == 0
    # The credit (-5 over the month) is spread by list price over all 18 windows; the second hour's windows carry
    # 10.978821 USD of usage less their part of it, the half-covered last window half as much as a full one.
    on_demand_windows = {k: v for k, v in windows.items() if k[2] == "gpu-od-b"}
    by_start = dict(sorted((k[0], v) for k, v in on_demand_windows.items()))
    last, full = by_start[T10 + 17 * 300_000], by_start[T10 + 16 * 300_000]
    assert abs(Fraction(last) - Fraction(full, 2)) <= 1
    credit_share = Fraction(-5_000_000) * Fraction(5 + Fraction(1, 2), 17 + Fraction(1, 2))
    assert abs(sum(second_hour) - (10_978_821 + credit_share)) <= len(second_hour)


def test_running_it_twice_on_the_same_bill_changes_nothing(ledger):
    run(ledger, FOCUS)
    first = snapshot(ledger)
    code, out, _ = run(ledger, FOCUS, now_ms=T10 + 2 * 86_400_000)
    assert code == 0
    assert "ledger: 0 node-windows and 0 cost lines changed" in out and "applied before" in out
    assert snapshot(ledger) == first


def test_an_amended_bill_replaces_the_trued_up_cost_of_its_scope_and_both_bills_are_listed(ledger):
    """The provider's re-issued export for the month adds a late credit of -0.1234 USD to the spot machine."""
    before = list_columns(ledger)
    run(ledger, FOCUS)
    _, out, _ = run(ledger, FOCUS_AMENDED, now_ms=T10 + 2 * 86_400_000)
    machines = trued_by_machine(ledger)
    assert sum(v for v in machines[SPOT] if v is not None) == SPOT_BILLED - 123_400
    assert sum(machines[ON_DEMAND]) == ON_DEMAND_BILLED
    runs = ledger.trueup_runs()
    assert [r["bill_name"] for r in runs] == ["focus_1_0_aws.csv", "focus_1_0_aws_amended.csv"]
    assert runs[0]["bill_scope"] == runs[1]["bill_scope"] != ""  # two versions of one bill
    with ledger.engine.connect() as connection:
        ids = set(connection.execute(select(node_bills.c.provider, node_bills.c.trueup_id)).all())
    assert ids == {("aws", runs[1]["trueup_id"]), ("gcp", None)}
    assert list_columns(ledger) == before
    # Applying the first bill again makes it the one that counts, as it was.
    run(ledger, FOCUS)
    assert sum(v for v in trued_by_machine(ledger)[SPOT] if v is not None) == SPOT_BILLED


def _focus_bill(path: Path, rows: list[dict]) -> Path:
    """A FOCUS bill of ``rows`` (column -> value; the rest empty) in the fixture's columns."""
    header = next(csv.reader(FOCUS.open(encoding="utf-8")))
    with path.open("w", encoding="utf-8", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=header, lineterminator="\n")
        writer.writeheader()
        writer.writerows({c: row.get(c, "") for c in header} for row in rows)
    return path


def _usage(resource, provider, account, start, end, cost):
    return {"ResourceId": resource, "ProviderName": provider, "PublisherName": provider, "InvoiceIssuerName": provider,
            "BillingAccountId": account, "BillingCurrency": "USD", "BillingPeriodStart": "2026-11-01T00:00:00Z",
            "BillingPeriodEnd": "2026-12-01T00:00:00Z", "ChargePeriodStart": start, "ChargePeriodEnd": end,
            "ChargeCategory": "Usage", "ServiceCategory": "Compute", "BilledCost": cost, "EffectiveCost": cost,
            "ListCost": cost, "ContractedCost": cost}


def test_bills_of_other_providers_and_accounts_leave_each_others_machines_alone(ledger, tmp_path):
    """A GCP bill trues the GCP node up; the AWS bill applied again leaves it so. A second AWS payer account's bill
    charging the g4dn.xlarge keeps it when the first account's bill, which does not charge it, is applied again."""
    gcp_bill = _focus_bill(tmp_path / "gcp.csv", [
        _usage("//compute.googleapis.com/projects/gpumeter-example/zones/us-central1-a/instances/gpu-gcp-c",
               "Google Cloud", "01ABCD-234567-89EFGH", f"2026-11-10T{h}:00:00Z", f"2026-11-10T{h + 1}:00:00Z", "2.6")
        for h in (10, 11)])
    other_account = _focus_bill(tmp_path / "aws-other.csv", [
        _usage("i-0a1b2c3d4e5f60003", "AWS", "999999999999", "2026-11-10T10:00:00Z", "2026-11-10T11:00:00Z",
               "0.2104")])
    run(ledger, FOCUS)
    code, out, _ = run(ledger, gcp_bill, now_ms=T10 + 2 * 86_400_000)
    assert code == 0 and "seen but not billed" not in out and "gpu-spot-a" not in out
    assert sum(trued_by_machine(ledger)[GCP]) == 5_200_000
    run(ledger, other_account, now_ms=T10 + 3 * 86_400_000)
    assert sum(trued_by_machine(ledger)[UNBILLED]) == 210_400
    _, out, _ = run(ledger, FOCUS, now_ms=T10 + 4 * 86_400_000)
    machines = trued_by_machine(ledger)
    assert sum(machines[GCP]) == 5_200_000 and sum(machines[UNBILLED]) == 210_400
    assert sum(v for v in machines[SPOT] if v is not None) == SPOT_BILLED
    assert "seen but not billed" not in out  # the g4dn.xlarge is the other account's bill's now


def test_cur2_and_focus_exports_of_the_same_charges_true_up_alike(ledger, tmp_path):
    run(ledger, FOCUS)
    from_focus = trued_values(ledger)
    code, out, err = run(ledger, CUR2)
    assert code == 0, err
    assert trued_values(ledger) == from_focus
    assert "billed but never seen: i-0fffffffffffffff9 3.06 USD" in out
    assert "SavingsPlanNegation (not part of the effective cost) 1" in out and "SavingsPlanRecurringFee 1" in out
    # Cash basis: the Savings Plan's covered hour is negated, the fee is not the machine's.
    run(ledger, CUR2, "--basis", "billed")
    assert sum(trued_by_machine(ledger)[ON_DEMAND]) == ON_DEMAND_BILLED_CASH


def _focus_parquet(source: Path, target: Path) -> None:
    """The FOCUS CSV's rows as Parquet with the spec's types: Date/Time as UTC timestamps, Decimal as decimals."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datetime import datetime

    rows = list(csv.DictReader(source.open(encoding="utf-8")))
    dates = {"BillingPeriodStart", "BillingPeriodEnd", "ChargePeriodStart", "ChargePeriodEnd"}
    money = {"BilledCost", "EffectiveCost", "ListCost", "ContractedCost", "ListUnitPrice", "ContractedUnitPrice",
             "PricingQuantity", "ConsumedQuantity"}
    columns, fields = {}, []
    for name in rows[0]:
        values = [r[name] or None for r in rows]
        if name in dates:
            kind = pa.timestamp("s", tz="UTC")
            values = [datetime.fromisoformat(v.replace("Z", "+00:00")) if v else None for v in values]
        elif name in money:
            kind = pa.decimal128(38, 10)
            values = [Decimal(v) if v else None for v in values]
        else:
            kind = pa.string()
        columns[name] = values
        fields.append(pa.field(name, kind))
    pq.write_table(pa.table(columns, schema=pa.schema(fields)), target)


def test_a_focus_parquet_export_reads_as_its_csv(ledger, tmp_path):
    parquet = tmp_path / "focus.parquet"
    _focus_parquet(FOCUS, parquet)
    assert read_bill(parquet).digest() == read_bill(FOCUS).digest()
    run(ledger, FOCUS)
    from_csv = trued_values(ledger)
    code, out, err = run(ledger, parquet)
    assert code == 0, err
    assert "ledger: 0 node-windows and 0 cost lines changed" in out  # the same bill, so the same true-up
    assert trued_values(ledger) == from_csv


def test_the_report_shows_the_trued_up_cost_with_a_flag(ledger):
    start, end = T10, T10 + 3 * 3_600_000
    listed = build_report(ledger, Grouping.parse("label:team"), start_ms=start, end_ms=end)
    run(ledger, FOCUS)
    trued = build_report(ledger, Grouping.parse("label:team"), start_ms=start, end_ms=end, cost="trued")
    assert trued.reconciliation.reconciled and trued.trued_windows == 42
    machines = trued_by_machine(ledger)
    with ledger.engine.connect() as connection:
        at_list = sum(connection.execute(select(node_bills.c.node_cost_micro_usd)
                                         .where(node_bills.c.trued_cost_micro_usd.is_(None))).scalars())
    assert trued.total_micro_usd == SPOT_BILLED + ON_DEMAND_BILLED + at_list
    assert trued.total_micro_usd != listed.total_micro_usd
    assert build_report(ledger, Grouping("namespace"), start_ms=start, end_ms=end) == replace(
        build_report(ledger, Grouping("namespace"), start_ms=start, end_ms=end), cost="list")
    assert len(machines[SPOT]) == 26

    parser = argparse.ArgumentParser()
    report_module.add_arguments(parser)
    args = parser.parse_args(["--cost", "trued", "--by", "label:team", "--end", "2026-11-10T13:00:00Z",
                              "--window", "3h", "--ledger-url", ledger.url, "--format", "json"])
    out = io.StringIO()
    assert report_module.main(args, {}, out=out, err=io.StringIO()) == 0
    body = json.loads(out.getvalue())
    assert (body["cost"], body["trued_node_windows"], body["total_micro_usd"]) == ("trued", 42, trued.total_micro_usd)
    args = parser.parse_args(["--cost", "trued", "--end", "2026-11-10T13:00:00Z", "--window", "3h",
                              "--ledger-url", ledger.url])
    out = io.StringIO()
    assert report_module.main(args, {}, out=out, err=io.StringIO()) == 0
    assert "trued up to the invoice: 42 of 80 node-windows, the rest at list price" in out.getvalue()


def test_the_command_is_wired_into_gpumeter_and_rejects_a_bill_it_cannot_use(ledger, tmp_path, capsys,
                                                                               monkeypatch):
    monkeypatch.setattr(reconcile, "SystemClock", lambda: ManualClock(T10))
    assert cli.main(["reconcile", "--bill", str(FOCUS), "--ledger-url", ledger.url, "--format", "json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert {m["provider_id"]: m["trued_micro_usd"] for m in body["machines"]} == {
        SPOT: SPOT_BILLED, ON_DEMAND: ON_DEMAND_BILLED}
    assert body["written"]["first_time"] is True
    euros = tmp_path / "eur.csv"
    euros.write_text(FOCUS.read_text().replace(",USD,", ",EUR,"))
    before = snapshot(ledger)
    assert cli.main(["reconcile", "--bill", str(euros), "--ledger-url", ledger.url]) == 2
    assert "BillingCurrency 'EUR'" in capsys.readouterr().err
    assert snapshot(ledger) == before


def test_shared_lines_are_trued_up_as_lines_of_their_own_and_each_window_still_adds_up(sqlite_ledger):
    """With billing's sharing policy a pod has a shared line per bucket beside its direct line (same unit-less key
    but for ``shared_from``): the true-up must reach each of them, not only the first of a (gpu, kind, pod)."""
    from services.billing.sharing import SharingPolicy

    catalog = PriceCatalog.load(spot_discounts={"aws": Decimal("0.6")})
    sharing = SharingPolicy.parse("idle=weighted,node_other=even")
    rows = [pod("train-a", 0.6, "ml", team="research"), pod("notebook-a", 0.3, "ml", team="research"),
            bucket(ShareSubjectKind.IDLE, 0.1)]
    windows = _windows("gpu-spot-a", SPOT, 26, units=[Unit("GPU-spot-0", rows)], instance_type="g5.xlarge",
                       price_model="spot", gpu_model="NVIDIA A10G")
    results = [bill_node_window(shares, catalog, sharing=sharing) for shares in windows]
    sqlite_ledger.write([c for r in results for c in r.costs], [r.bill for r in results])
    shared_lines = [c for r in results for c in r.costs if c.shared_from is not None]
    assert shared_lines  # the policy shared idle and node_other to the pods

    code, _out, err = run(sqlite_ledger, FOCUS)
    assert code == 0, err
    with sqlite_ledger.engine.connect() as connection:
        lines = connection.execute(select(cost_lines.c.window_start_unix_ms, cost_lines.c.shared_from,
                                          cost_lines.c.cost_micro_usd, cost_lines.c.trued_cost_micro_usd)).all()
        bills = dict(connection.execute(select(node_bills.c.window_start_unix_ms,
                                               node_bills.c.trued_cost_micro_usd)).all())
    trued_windows = {start for start, trued in bills.items() if trued is not None}
    assert len(trued_windows) == 24  # the two windows past the bill's last line item stay untrued
    assert sum(bills[s] for s in trued_windows) == SPOT_BILLED
    for start in trued_windows:
        mine = [(shared, listed, trued) for s, shared, listed, trued in lines if s == start]
        assert all(trued is not None for _, _, trued in mine)
        assert sum(trued for _, _, trued in mine) == bills[start]
        shared = [(listed, trued) for shared_from, listed, trued in mine if shared_from]
        assert shared and all(abs(trued - listed * bills[start] / sum(l for _, l, _ in mine)) < 1
                              for listed, trued in shared)
