"""The FOCUS export: one row per pod (or kept bucket) per charge period, adding up to the node bills exactly, with
FOCUS 1.3's split-cost-allocation columns as the 1.3 specification defines them.

The 1.3 rules are encoded here, each with its source in the FinOps Foundation's FOCUS_Spec repository
(https://github.com/FinOps-Open-Cost-and-Usage-Spec/FOCUS_Spec, CC BY 4.0): the column definitions
``specification/datasets/cost_and_usage/columns/{allocatedmethodid,allocatedmethoddetails,allocatedresourceid,
allocatedresourcename,allocatedtags}.md`` and the requirements model
``specification/requirements_model/model_rules/attributes/datageneratorcalculatedsplitcostallocationhandling.json``
(rule ids ``DataGeneratorCalculatedSplitCostAllocationHandling-A-00N-M``, cited where checked). FOCUS 1.0 itself is
checked by the FinOps Foundation's validator (``tests/integration/test_focus_validator.py``).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
from collections import defaultdict
from dataclasses import replace
from decimal import Decimal
from fractions import Fraction

import pytest

from services.billing import export as export_module
from services.billing import report as report_module
from services.billing.export import focus_dataset
from services.billing.focus import (
    COLUMNS,
    CUSTOM_COLUMNS,
    FOCUS_COLUMNS,
    FocusBill,
    FocusLine,
    focus_csv,
    focus_rows,
    hour_units,
    write_focus_parquet,
)
from tests.unit.billing.conftest import WINDOW_START_MS, sample_costs

WINDOWS = 2
END_MS = WINDOW_START_MS + WINDOWS * 60_000
SHARED = "idle=weighted,node_other=weighted"
# FOCUS 1.0's Mandatory columns (specification/columns/*.md at tag v1.0, "Feature level: Mandatory").
MANDATORY_1_0 = ("BilledCost", "BillingAccountId", "BillingAccountName", "BillingCurrency", "BillingPeriodEnd",
                 "BillingPeriodStart", "ChargeCategory", "ChargeClass", "ChargeDescription", "ChargePeriodEnd",
                 "ChargePeriodStart", "ContractedCost", "EffectiveCost", "InvoiceIssuerName", "ListCost",
                 "PricingQuantity", "PricingUnit", "ProviderName", "PublisherName", "ServiceCategory", "ServiceName")
NULLABLE_1_0 = ("ChargeClass",)  # null unless the row corrects an earlier one
# Aggregatable metrics (A-003: allocated charges sum up to the origin charge) and dimensions (A-004: allocated
# charges carry the origin's values) of the dataset.
METRICS = ("BilledCost", "EffectiveCost", "ListCost", "ContractedCost", "PricingQuantity", "ConsumedQuantity")
ORIGIN_DIMENSIONS = ("BillingAccountId", "BillingAccountName", "BillingCurrency", "BillingPeriodEnd",
                     "BillingPeriodStart", "ChargeCategory", "ChargeClass", "ChargeDescription", "ChargeFrequency",
                     "ChargePeriodEnd", "ChargePeriodStart", "InvoiceIssuerName", "PricingUnit", "ConsumedUnit",
                     "ProviderName", "PublisherName", "ServiceProviderName", "HostProviderName", "ServiceCategory",
                     "ServiceName", "AvailabilityZone", "RegionId", "RegionName", "ResourceId", "ResourceName",
                     "ResourceType", "SkuId", "SkuPriceId", "SubAccountId", "Tags", "ListUnitPrice",
                     "ContractedUnitPrice", "PricingCategory", "AllocatedMethodId")
X_KEY = re.compile(r"^x_[A-Z][A-Za-z0-9]*$")  # "x_" followed by PascalCase (allocatedmethoddetails.md)


def dataset(ledger, sharing="keep"):
    results = sample_costs(WINDOWS, sharing=sharing)
    ledger.write([c for r in results for c in r.costs], [r.bill for r in results])
    return results, focus_dataset(ledger, start_ms=WINDOW_START_MS, end_ms=END_MS)


def origins(rows):
    by_origin = defaultdict(list)
    for row in rows:
        by_origin[(row["x_ClusterName"], row["ResourceName"], row["ChargePeriodStart"])].append(row)
    return by_origin


@pytest.mark.parametrize("sharing", ["keep", SHARED, "all=even"])
def test_one_row_per_pod_or_kept_bucket_per_charge_period_adding_up_to_each_node_bill(sqlite_ledger, sharing):
    results, rows = dataset(sqlite_ledger, sharing)
    assert [tuple(row) for row in rows] == [COLUMNS] * len(rows)
    by_origin = origins(rows)
    assert len(by_origin) == len(results)
    for result in results:
        bill = result.bill
        group = by_origin[(bill.cluster, bill.node_name, _iso(bill.window_start_unix_ms))]
        pods = {c.pod_uid for c in result.costs if c.pod_uid}
        kept = {c.subject_kind.value.lower() for c in result.costs if c.subject_kind.value != "POD"}
        assert sorted(r["x_Subject"] for r in group) == sorted(["pod"] * len(pods) + list(kept))
        assert {r["AllocatedResourceId"] for r in group if r["x_Subject"] == "pod"} == pods
        # To the micro-dollar, and the time to the millisecond: the origin charge, split.
        total = Decimal(bill.node_cost_micro_usd).scaleb(-6)
        for column in ("BilledCost", "EffectiveCost", "ListCost", "ContractedCost"):
            assert sum(r[column] for r in group) == total, column
        assert sum(r["x_ListCostMicroUsd"] for r in group) == bill.node_cost_micro_usd
        hours = sum(r["PricingQuantity"] for r in group)
        assert hours == Decimal(hour_units(bill.billed_milliseconds)).scaleb(-10) == sum(
            r["ConsumedQuantity"] for r in group)
        assert abs(hours - Decimal(bill.billed_milliseconds) / 3_600_000) <= Decimal("0.5e-10")
        assert sum(r["x_DirectCost"] + r["x_SharedCost"] for r in group) == total
        if sharing != "keep":
            assert all(r["x_SharedCost"] > 0 for r in group if r["x_Subject"] == "pod")
        assert {r["x_SharingPolicy"] for r in group} == {bill.sharing}


@pytest.mark.parametrize("sharing", ["keep", SHARED])
def test_the_focus_1_0_columns_are_there_and_the_mandatory_ones_filled(sqlite_ledger, sharing):
    _, rows = dataset(sqlite_ledger, sharing)
    assert set(MANDATORY_1_0) <= set(FOCUS_COLUMNS)
    for row in rows:
        for column in MANDATORY_1_0:
            if column not in NULLABLE_1_0:
                assert row[column] is not None, column
        assert row["ServiceProviderName"]  # FOCUS 1.2+ (CAU-ServiceProviderName-C-003-M): never null
        assert row["BillingCurrency"] == "USD" and row["ChargeCategory"] == "Usage"
        assert row["BillingPeriodStart"] <= row["ChargePeriodStart"] < row["ChargePeriodEnd"] <= row["BillingPeriodEnd"]
        json.loads(row["Tags"])
    assert all(re.fullmatch(r"[A-Z][A-Za-z]+", c) for c in FOCUS_COLUMNS)  # FOCUS columns are PascalCase
    assert all(X_KEY.match(c) for c in CUSTOM_COLUMNS)  # custom columns are x_-prefixed


@pytest.mark.parametrize("sharing", ["keep", SHARED, "all=requests"])
def test_the_1_3_split_cost_allocation_columns_follow_the_specification(sqlite_ledger, sharing):
    results, rows = dataset(sqlite_ledger, sharing)
    for group in origins(rows).values():
        ratios = Fraction(0)
        for row in group:
            allocated = row["x_Subject"] == "pod"
            # allocatedmethodid.md: String, not null for a charge related to a split cost allocation (every row).
            assert isinstance(row["AllocatedMethodId"], str) and row["AllocatedMethodId"].startswith("gpumeter/")
            # allocatedresourceid.md: not null for the allocated portion, null for the unallocated portion.
            assert (row["AllocatedResourceId"] is not None) == allocated
            # allocatedresourcename.md: null exactly when AllocatedResourceId is null.
            assert (row["AllocatedResourceName"] is None) == (row["AllocatedResourceId"] is None)
            # allocatedtags.md: a JSON object (KeyValueFormat) for the allocated resource; none of the keys of Tags.
            if allocated:
                tags = json.loads(row["AllocatedTags"])
                assert isinstance(tags, dict) and not set(tags) & set(json.loads(row["Tags"]))
                assert all(isinstance(v, str) for v in tags.values())
            else:
                assert row["AllocatedTags"] is None
            # allocatedmethoddetails.md: a JSON object whose top-level key Elements is an array of entry objects:
            # AllocatedRatio numeric (required), UsageUnit a string required when UsageQuantity is given, custom
            # keys x_ + PascalCase.
            details = json.loads(row["AllocatedMethodDetails"])
            assert set(details) == {"Elements"} and details["Elements"]
            for element in details["Elements"]:
                assert isinstance(element["AllocatedRatio"], (int, float)) and 0 <= element["AllocatedRatio"] <= 1
                if "UsageQuantity" in element:
                    assert isinstance(element["UsageUnit"], str) and isinstance(element["UsageQuantity"], float)
                for name in set(element) - {"AllocatedRatio", "UsageUnit", "UsageQuantity"}:
                    assert X_KEY.match(name), name
                ratios += Fraction(element["AllocatedRatio"])
        # "The sum of Elements[*].AllocatedRatio across all allocated charges related to a single origin charge
        # MUST be equal to 1" (allocatedmethoddetails.md).
        assert abs(ratios - 1) < Fraction(1, 10**12)
        # dimension columns of allocated charges match the origin's; A-005: the same Tags.
        for column in ORIGIN_DIMENSIONS:
            assert len({row[column] for row in group}) == 1, column
        assert len({row["AllocatedResourceId"] for row in group if row["AllocatedResourceId"]}) == len(
            [row for row in group if row["AllocatedResourceId"]])  # locally unique within ResourceId and period
    methods = {row["AllocatedMethodId"] for row in rows}
    assert methods == {f"gpumeter/memory/{results[0].bill.sharing}"}


def test_the_method_details_say_memory_compute_slices_and_the_sharing_of_each_part(sqlite_ledger):
    _, rows = dataset(sqlite_ledger, SHARED)
    pod = next(r for r in rows if r["x_Subject"] == "pod" and r["x_PodName"] == "pod-train-0")
    elements = json.loads(pod["AllocatedMethodDetails"])["Elements"]
    unit, *shared = elements
    assert unit["UsageUnit"] == "GPU-Hours" and unit["x_Method"] == "memory" and unit["x_MeasuredBy"] == "memory_proxy"
    assert unit["x_GpuUuid"] == "GPU-aws-0000" and unit["x_CostShare"] == pytest.approx(0.55)
    assert {(e["x_SharedFrom"], e["x_SharingMethod"]) for e in shared} == {("idle", "weighted"),
                                                                          ("node_other", "weighted")}
    assert json.loads(pod["AllocatedTags"]) == {"team": "research", "model": "llama"}
    assert pod["AllocatedResourceName"] == "ml/pod-train-0" and pod["ResourceName"] == "aws-node"
    assert pod["ResourceId"] == "aws-node"  # no provider id on these bills: the node's name


def test_a_mig_instance_is_allocated_by_its_slices_and_an_exclusive_gpu_to_its_owner():
    from schemas.records import CostRecord, CostSubjectKind

    bill = FocusBill("c", "n", 0, 60, 60_000, "azure", "eastus", "", "azure:///subscriptions/s/vm-7", "Standard_NC24",
                     "on_demand", "v1", "3.673", "marginal", "keep", 1000)
    base = dict(cluster="c", node_name="n", window_start_unix_ms=0, window_seconds=60, namespace="ml",
                pod_name="p", labels={}, instance_type="Standard_NC24", price_model="on_demand", price_version="v1",
                cost_basis="memory")
    lines = [FocusLine(CostRecord(gpu_uuid="MIG-1", subject_kind=CostSubjectKind.POD, pod_uid="u", cost_share=1.0,
                                  cost_micro_usd=600, method="mig_instance", gpu_fraction=3 / 7, **base)),
             FocusLine(CostRecord(gpu_uuid="GPU-2", subject_kind=CostSubjectKind.POD, pod_uid="u", cost_share=1.0,
                                  cost_micro_usd=400, method="exclusive", gpu_fraction=1.0, **base))]
    (row,) = focus_rows([bill], lines)
    elements = json.loads(row["AllocatedMethodDetails"])["Elements"]
    assert [(e["x_GpuUuid"], e["x_Method"], e["AllocatedRatio"]) for e in elements] == [
        ("GPU-2", "exclusive", 0.4), ("MIG-1", "slices", 0.6)]
    assert elements[1]["UsageQuantity"] == pytest.approx(3 / 7 / 60)  # a 3g instance for one minute, in GPU-hours
    assert row["ResourceId"] == "vm-7"  # the instance id from the provider id, as the bill names the VM
    assert row["ProviderName"] == "Microsoft Azure" and row["PricingCategory"] == "Standard"


def test_billed_cost_is_the_trued_up_cost_where_one_is_stored_and_the_list_cost_otherwise(sqlite_ledger):
    results, _ = dataset(sqlite_ledger)
    bills = sqlite_ledger.bills()
    prices = sqlite_ledger.price_versions(b["price_version"] for b in bills)
    lines = [FocusLine(c, c.cost_micro_usd // 2 if c.node_name == "aws-node" else None)
             for c in sqlite_ledger.iter_cost_lines()]
    rows = focus_rows([FocusBill.of(b, prices[b["price_version"]]) for b in bills], lines)
    for row in rows:
        if row["ResourceName"] == "aws-node":
            assert row["x_BilledCostMicroUsd"] == sum(
                c.cost_micro_usd // 2 for r in results for c in r.costs
                if c.node_name == "aws-node" and _iso(c.window_start_unix_ms) == row["ChargePeriodStart"]
                and _row_of(c) == (row["x_Subject"], row["x_PodUid"]))
            assert row["BilledCost"] == row["EffectiveCost"] < row["ListCost"] == row["ContractedCost"]
        else:
            assert row["BilledCost"] == row["ListCost"]
    # The ledger's one read of what a line was billed: today the list cost.
    assert all(billed == c.cost_micro_usd for c, billed in sqlite_ledger.billed_cost_lines())


def test_lines_without_their_bill_or_that_do_not_add_up_are_refused():
    results = sample_costs(1)
    result = results[0]
    bill = FocusBill(result.bill.cluster, result.bill.node_name, result.bill.window_start_unix_ms, 60,
                     result.bill.billed_milliseconds, "aws", "us-east-1", "", "", "p4d.24xlarge", "on_demand", "v",
                     "1", "marginal", "keep", result.bill.node_cost_micro_usd)
    lines = [FocusLine(c) for c in result.costs]
    assert focus_rows([bill], lines)
    with pytest.raises(ValueError, match="without their node bill"):
        focus_rows([], lines)
    with pytest.raises(ValueError, match="add up"):
        focus_rows([bill], lines[1:])
    with pytest.raises(ValueError, match="add up"):
        focus_rows([replace(bill, node_cost_micro_usd=bill.node_cost_micro_usd + 1)], lines)


def test_csv_and_parquet_hold_the_same_rows(sqlite_ledger, tmp_path):
    import pyarrow.parquet as pq

    _, rows = dataset(sqlite_ledger, SHARED)
    parsed = list(csv.DictReader(io.StringIO(focus_csv(rows))))
    assert len(parsed) == len(rows) and list(parsed[0]) == list(COLUMNS)
    for text, row in zip(parsed, rows):
        assert text["BilledCost"] == str(row["BilledCost"]) and text["AllocatedTags"] == (row["AllocatedTags"] or "")
        assert text["ChargeClass"] == ""  # null is an empty cell
    path = tmp_path / "focus.parquet"
    write_focus_parquet(rows, path)
    table = pq.read_table(path)
    assert table.column_names == list(COLUMNS) and table.num_rows == len(rows)
    assert str(table.schema.field("ChargePeriodStart").type) == "timestamp[ms, tz=UTC]"
    assert str(table.schema.field("BilledCost").type) == "double"
    assert table.column("x_ListCostMicroUsd").to_pylist() == [r["x_ListCostMicroUsd"] for r in rows]
    assert table.schema.metadata[b"focus_version"] == b"1.3"


def test_the_command_lines_write_the_dataset(sqlite_ledger, tmp_path):
    results, rows = dataset(sqlite_ledger, SHARED)
    url = sqlite_ledger.url
    end = _iso(END_MS)
    parser = argparse.ArgumentParser()
    report_module.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    args = parser.parse_args(["--format", "focus", "--ledger-url", url, "--end", end, "--window", "2m"])
    assert report_module.main(args, {}, out=out, err=err) == 0, err.getvalue()
    assert out.getvalue() == focus_csv(rows)

    parser = argparse.ArgumentParser()
    export_module.add_arguments(parser)
    target = tmp_path / "export.parquet"
    args = parser.parse_args(["focus", "--out", str(target), "--ledger-url", url, "--end", end, "--window", "2m",
                              "--billing-account-id", "acct-42"])
    out = io.StringIO()
    assert export_module.main(args, {}, out=out, err=err) == 0, err.getvalue()
    assert f"wrote {len(rows)} FOCUS rows" in out.getvalue()
    import pyarrow.parquet as pq

    assert set(pq.read_table(target).column("BillingAccountId").to_pylist()) == {"acct-42"}
    args = parser.parse_args(["focus", "--out", str(tmp_path / "x.xlsx"), "--ledger-url", url])
    assert export_module.main(args, {}, out=io.StringIO(), err=err) == 2
    assert ".parquet or .csv" in err.getvalue()


def _iso(unix_ms: int) -> str:
    from services.billing.focus import iso_z

    return iso_z(unix_ms)


def _row_of(cost):
    return ("pod", cost.pod_uid) if cost.pod_uid else (cost.subject_kind.value.lower(), None)
