"""Billing exports parsed into a node's charges: FOCUS 1.0 and AWS CUR 2.0 (``services/billing/bills.py``), on the
fixtures written in the published column layouts (``tests/fixtures/bills/README.md``)."""

from __future__ import annotations

import gzip
from decimal import Decimal
from pathlib import Path

import pytest

from services.billing.bills import BillError, parse_bill_csv, parse_instant_ms, read_bill

BILLS = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "bills"
NOVEMBER = (parse_instant_ms("2026-11-01T00:00:00Z", "", ""), parse_instant_ms("2026-12-01T00:00:00Z", "", ""))


def charges(bill):
    return sorted((i.resource_id, i.charge, i.pricing, i.cost) for i in bill.items)


def test_focus_rows_become_the_machines_charges_and_the_rest_is_counted():
    bill = read_bill(BILLS / "focus_1_0_aws.csv")
    assert (bill.format, bill.basis, (bill.scope_start_ms, bill.scope_end_ms), bill.rows) == (
        "focus", "effective", NOVEMBER, 8)
    assert charges(bill) == [
        ("i-0a1b2c3d4e5f60001", "usage", "spot", Decimal("0.3617")),
        ("i-0a1b2c3d4e5f60001", "usage", "spot", Decimal("0.3617")),
        ("i-0a1b2c3d4e5f60002", "credit", "", Decimal("-5")),
        ("i-0a1b2c3d4e5f60002", "usage", "committed", Decimal("15.370349")),  # EffectiveCost; BilledCost is 0
        ("i-0a1b2c3d4e5f60002", "usage", "on_demand", Decimal("10.978821")),
        ("i-0fffffffffffffff9", "usage", "on_demand", Decimal("3.06")),
    ]
    assert [(s.reason, s.rows, s.cost) for s in bill.skipped] == [
        ("tax without a resource id", 1, Decimal("3.21")), ("usage of service category Networking", 1, Decimal("0.36"))]
    billed = read_bill(BILLS / "focus_1_0_aws.csv", basis="billed")
    assert sum(i.cost for i in billed.items) == Decimal("9.762221")
    # Whose bill it is: the provider and the payer account, the same in the CUR of the same month.
    assert (bill.providers, bill.accounts) == (("aws",), ("123456789012",))
    assert bill.scope_key == read_bill(BILLS / "cur2_aws.csv").scope_key


def test_cur2_effective_and_billed_cost_follow_the_line_item_types():
    effective = read_bill(BILLS / "cur2_aws.csv")
    assert effective.format == "cur2" and (effective.scope_start_ms, effective.scope_end_ms) == NOVEMBER
    # The same charges as the FOCUS export of the same month.
    assert [c[:2] + c[3:] for c in charges(effective)] == [
        c[:2] + c[3:] for c in charges(read_bill(BILLS / "focus_1_0_aws.csv"))]
    assert {(s.reason, s.rows) for s in effective.skipped} == {
        ("SavingsPlanNegation (not part of the effective cost)", 1), ("SavingsPlanRecurringFee", 1), ("Tax", 1),
        ("other charges of a resource (not an EC2 instance's running time)", 2)}
    billed = read_bill(BILLS / "cur2_aws.csv", basis="billed")
    covered = [i for i in billed.items if i.kind.startswith("SavingsPlan")]
    assert sorted(i.cost for i in covered) == [Decimal("-21.957642"), Decimal("21.957642")]
    assert sum(i.cost for i in billed.items) == Decimal("9.762221")


def test_a_gzipped_export_reads_the_same_and_the_digest_names_the_content(tmp_path):
    gz = tmp_path / "cur2_aws.csv.gz"
    gz.write_bytes(gzip.compress((BILLS / "cur2_aws.csv").read_bytes()))
    plain = read_bill(BILLS / "cur2_aws.csv")
    assert read_bill(gz).digest() == plain.digest()
    assert read_bill(BILLS / "focus_1_0_aws_amended.csv").digest() != read_bill(BILLS / "focus_1_0_aws.csv").digest()
    assert read_bill(BILLS / "cur2_aws.csv", basis="billed").digest() != plain.digest()


HEADER = "ResourceId,ChargePeriodStart,ChargePeriodEnd,ChargeCategory,EffectiveCost,BilledCost,BillingCurrency\n"


@pytest.mark.parametrize("row,message", [
    ("i-1,2026-11-10T10:00:00Z,2026-11-10T11:00:00Z,Usage,1,1,EUR", "BillingCurrency 'EUR'"),
    ("i-1,2026-11-10T11:00:00Z,2026-11-10T10:00:00Z,Usage,1,1,USD", "ChargePeriodEnd is not after"),
    ("i-1,yesterday,2026-11-10T11:00:00Z,Usage,1,1,USD", "'yesterday' is not an ISO 8601"),
    ("i-1,2026-11-10T10:00:00Z,2026-11-10T11:00:00Z,Usage,one,1,USD", "EffectiveCost 'one' is not a number"),
    ("i-1,2026-11-10T10:00:00Z,2026-11-10T11:00:00Z,Refund,1,1,USD", "ChargeCategory 'Refund' is not one of"),
    ("i-1,2026-11-10T10:00:00Z,2026-11-10T11:00:00Z,Usage,,1,USD", "EffectiveCost is empty"),
    ("i-1,2026-11-10T10:00:00Z,2026-11-10T11:00:00Z,Usage,1,1", "wrong number of fields"),
])
def test_a_row_that_cannot_be_true_stops_the_whole_bill_with_its_line(row, message):
    with pytest.raises(BillError, match=message) as error:
        parse_bill_csv(HEADER + row + "\n", name="bill.csv")
    assert "bill.csv:2" in str(error.value)


def test_missing_columns_and_unknown_layouts_are_named():
    with pytest.raises(BillError, match=r"needs the columns \['ResourceId'\]"):
        parse_bill_csv(HEADER.replace("ResourceId,", "") + "\n", name="b.csv")
    with pytest.raises(BillError, match="not a FOCUS export"):
        parse_bill_csv("a,b\n1,2\n", name="b.csv")
    cur_without_sp = (BILLS / "cur2_aws.csv").read_text().replace("savings_plan_savings_plan_effective_cost",
                                                                   "savings_plan_other")
    with pytest.raises(BillError, match="effective cost is in savings_plan_savings_plan_effective_cost"):
        parse_bill_csv(cur_without_sp, name="cur.csv")
    assert parse_bill_csv(cur_without_sp, name="cur.csv", basis="billed").items
