"""Costing: exact conservation to the micro-dollar per unit and per node, rounding, validation, assembly."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumeter.errors import InvalidMessage, OutOfRange
from schemas.records import CostSubjectKind, ShareSubjectKind
from services.billing.catalog import PriceCatalog, PriceError
from services.billing.costing import (
    InconsistentShares,
    apportion,
    bill_node_window,
    cost_node_window,
    cost_record_json,
    price_node_window,
)
from services.billing.pricing import NodePrice, SplitPolicy, SplitRule, price_node
from tests.unit.billing.conftest import WINDOW_START_MS, Unit, bucket, node_window, pod, shared_gpus

BUCKETS = (ShareSubjectKind.IDLE, ShareSubjectKind.DRIVER_RESERVED, ShareSubjectKind.UNATTRIBUTED,
           ShareSubjectKind.UNAVAILABLE)
HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def catalog() -> PriceCatalog:
    return PriceCatalog.load()


def exact_scale(covered_seconds: float, window_seconds: int = 60) -> Fraction:
    """Micro-dollars per USD/hour for the billed time: per-second billing of the covered time, kept to the ms."""
    billed_ms = min(math.floor(covered_seconds * 1000 + 0.5), window_seconds * 1000)
    return Fraction(billed_ms, 3_600_000) * 1_000_000


def synthetic_price(gpu_count: int, gpu_micro: int, other_micro: int) -> NodePrice:
    gpu, other = Fraction(gpu_micro, 10**6), Fraction(other_micro, 10**6)
    return NodePrice(provider="aws", region="us-east-1", instance_type="p4d.24xlarge", price_model="on_demand",
                     node_usd_per_hour=gpu_count * gpu + other, gpu_count=gpu_count, gpu_usd_per_hour=gpu,
                     node_other_usd_per_hour=other, split_rule=SplitRule.WEIGHTS, sources=())


@st.composite
def unit_rows(draw, tag: str):
    pods = draw(st.integers(0, 4))
    kinds = [ShareSubjectKind.POD] * pods + [k for k in BUCKETS if draw(st.booleans())]
    if not kinds:
        kinds = [ShareSubjectKind.IDLE]
    weights = draw(st.lists(st.integers(0, 1000), min_size=len(kinds), max_size=len(kinds)))
    if sum(weights) == 0:
        weights[0] = 1
    total = sum(weights)
    rows = []
    for index, (kind, weight) in enumerate(zip(kinds, weights)):
        if kind is ShareSubjectKind.POD:
            rows.append(pod(f"{tag}-p{index}", weight / total, namespace=f"ns{index % 2}", team=f"t{index % 3}"))
        else:
            rows.append(bucket(kind, weight / total))
    return rows, weights


@st.composite
def node_windows(draw):
    """A random node-window: whole GPUs and MIG-partitioned ones, missing GPUs, any covered time."""
    gpu_count = draw(st.integers(1, 8))
    price = synthetic_price(gpu_count, draw(st.integers(0, 60_000_000)), draw(st.integers(0, 30_000_000)))
    present = draw(st.lists(st.booleans(), min_size=gpu_count, max_size=gpu_count))
    present[draw(st.integers(0, gpu_count - 1))] = True
    units, weights, fractions = [], {}, {}
    for g in range(gpu_count):
        if not present[g]:
            continue
        uuid = f"GPU-{g:02d}"
        if draw(st.booleans()):
            slices = draw(st.sampled_from([7, 8]))
            sizes, used = [], 0
            for size in draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=7)):
                if used + size <= slices:
                    sizes.append(size)
                    used += size
            for i, size in enumerate(sizes):
                rows, w = draw(unit_rows(f"{uuid}-{i}"))
                mig = f"MIG-{g:02d}-{i}"
                units.append(Unit(mig, rows, parent=uuid, fraction=size / slices))
                weights[mig], fractions[mig] = w, Fraction(size, slices)
            if used < slices and draw(st.booleans()):
                units.append(Unit(uuid, [bucket(ShareSubjectKind.IDLE, 1.0)], parent=None,
                                  fraction=(slices - used) / slices))
                weights[uuid], fractions[uuid] = [1], Fraction(slices - used, slices)
        else:
            rows, w = draw(unit_rows(uuid))
            units.append(Unit(uuid, rows))
            weights[uuid], fractions[uuid] = w, Fraction(1)
    covered = draw(st.one_of(st.just(60.0), st.floats(0, 60, allow_nan=False)))
    shares = node_window(units, covered_seconds=covered)
    return price, shares, weights, fractions, covered


@HYPOTHESIS
@given(node_windows(), st.randoms(use_true_random=False))
def test_conservation_to_the_micro_dollar_per_unit_and_per_node(case, random):
    price, shares, weights, fractions, covered = case
    shuffled = list(shares)
    random.shuffle(shuffled)
    result = price_node_window(shuffled, price)
    scale = exact_scale(covered)
    bill = result.bill

    # Per node: the records add up to the node's line item, which is the exact rate x time rounded half up.
    assert bill.node_cost_micro_usd == math.floor(price.node_usd_per_hour * scale + Fraction(1, 2))
    assert sum(c.cost_micro_usd for c in result.costs) == bill.node_cost_micro_usd
    assert bill.gpu_cost_micro_usd + bill.node_other_micro_usd == bill.node_cost_micro_usd
    assert all(c.cost_micro_usd >= 0 for c in result.costs)

    by_unit: dict[str | None, list] = defaultdict(list)
    for cost in result.costs:
        by_unit[cost.gpu_uuid].append(cost)
    parts = {p.gpu_uuid: p.cost_micro_usd for p in result.parts if p.gpu_uuid is not None}
    assert set(parts) == set(fractions)
    for gpu_uuid, fraction in fractions.items():
        unit_cost = parts[gpu_uuid]
        # Per unit: the rows add up to the unit's cost exactly, and that cost is within rounding of its exact
        # value (the unit's fraction of its GPU's rate over the billed time).
        assert sum(c.cost_micro_usd for c in by_unit[gpu_uuid]) == unit_cost
        assert abs(unit_cost - price.gpu_usd_per_hour * fraction * scale) < Fraction(3, 2)
        unit_weights = weights[gpu_uuid]
        assert len(by_unit[gpu_uuid]) == len(unit_weights)
        for cost in by_unit[gpu_uuid]:
            intended = Fraction(unit_cost) * Fraction(cost.cost_share)
            assert abs(cost.cost_micro_usd - intended) < 1 + 1e-6
            if cost.cost_share == 0:
                assert cost.cost_micro_usd == 0

    node_lines = by_unit[None]
    other = [c for c in node_lines if c.subject_kind is CostSubjectKind.NODE_OTHER]
    assert len(other) == 1 and other[0].cost_micro_usd == bill.node_other_micro_usd
    assert abs(other[0].cost_micro_usd - price.node_other_usd_per_hour * scale) < Fraction(3, 2)
    missing_fraction = price.gpu_count - sum(fractions.values())
    missing = [c for c in node_lines if c.subject_kind is CostSubjectKind.UNAVAILABLE]
    if missing_fraction:
        assert len(missing) == 1
        assert abs(missing[0].cost_micro_usd - price.gpu_usd_per_hour * missing_fraction * scale) < Fraction(3, 2)
    else:
        assert missing == []

    # Deterministic: the input order does not matter, and a redelivered copy of every row changes nothing.
    assert price_node_window(list(reversed(shares)) + list(shares), price).costs == result.costs


@HYPOTHESIS
@given(st.integers(0, 10**12), st.lists(st.integers(0, 10**6), min_size=1, max_size=40))
def test_apportion_is_exact_and_within_one_of_each_quota(total, raw_weights):
    if sum(raw_weights) == 0:
        raw_weights[0] = 1
    weights = [Fraction(w) for w in raw_weights]
    shares = apportion(total, weights)
    assert sum(shares) == total
    weight_sum = sum(weights)
    for share, weight in zip(shares, weights):
        quota = total * weight / weight_sum
        assert math.floor(quota) <= share <= math.ceil(quota)


def fraction_apportion(total, weights):
    """The largest-remainder rule in ``Fraction`` arithmetic, as ``apportion`` was first written: the reference
    its integer arithmetic must match exactly."""
    weights = [Fraction(w) for w in weights]
    weight_sum = sum(weights, Fraction(0))
    if weight_sum == 0:
        return (0,) * len(weights)
    quotas = [total * w / weight_sum for w in weights]
    shares = [q.numerator // q.denominator for q in quotas]
    ranking = sorted(range(len(quotas)), key=lambda i: (shares[i] - quotas[i], i))
    for index in ranking[:total - sum(shares)]:
        shares[index] += 1
    return tuple(shares)


WEIGHTS = st.one_of(
    st.integers(0, 10**6),
    st.fractions(min_value=0, max_value=10**4, max_denominator=10**7),
    st.floats(min_value=0, max_value=1, allow_subnormal=True),  # cost shares, taken at their exact binary value
)


@HYPOTHESIS
@given(st.integers(0, 10**12), st.lists(WEIGHTS, min_size=1, max_size=40))
def test_apportion_in_integers_is_the_fraction_rule_exactly(total, weights):
    if not any(weights):
        weights[0] = 1
    assert apportion(total, weights) == fraction_apportion(total, weights)
    # A float weight is its exact rational: the same split as the Fraction of it.
    assert apportion(total, weights) == apportion(total, [Fraction(w) for w in weights])


def test_apportion_of_equal_remainders_and_float_shares_matches_the_fraction_rule():
    thirds = [0.1, 0.2, 0.7, 1 / 3, 1 / 3, 1 / 3]
    for total in (0, 1, 7, 999_999, 10**9 + 7):
        assert apportion(total, thirds) == fraction_apportion(total, thirds)
        assert apportion(total, [Fraction(1, 3)] * 3) == fraction_apportion(total, [Fraction(1, 3)] * 3)


def test_apportion_breaks_ties_by_position_and_refuses_impossible_splits():
    assert apportion(1, [Fraction(1)] * 3) == (1, 0, 0)
    assert apportion(2, [Fraction(1)] * 3) == (1, 1, 0)
    assert apportion(5, [Fraction(0), Fraction(1)]) == (0, 5)
    assert apportion(0, [Fraction(0), Fraction(0)]) == (0, 0)
    with pytest.raises(ValueError):
        apportion(1, [Fraction(0)])
    with pytest.raises(ValueError):
        apportion(-1, [Fraction(1)])


def test_catalog_priced_node_window_bills_the_instance_per_second(catalog):
    units = shared_gpus(8, [pod("train", 0.6, "ml", team="research"), pod("infer", 0.3, "serving", team="prod"),
                            bucket(ShareSubjectKind.IDLE, 0.1)])
    full = bill_node_window(node_window(units), catalog)
    half = bill_node_window(node_window(units, covered_seconds=30.0), catalog)
    row = catalog.row("aws", "us-east-1", "p4d.24xlarge", "on_demand")
    for result, seconds in ((full, 60), (half, 30)):
        exact = Fraction(row.price_per_hour_usd) * 10**6 * seconds / 3600
        assert result.bill.node_cost_micro_usd == math.floor(exact + Fraction(1, 2))
        assert sum(c.cost_micro_usd for c in result.costs) == result.bill.node_cost_micro_usd
        assert result.bill.price_per_hour_usd.startswith(str(row.price_per_hour_usd))
    assert full.bill.billed_seconds == 60 and half.bill.billed_seconds == 30
    # Every GPU is priced the same, so the same pod on each GPU pays within one micro-dollar of the others.
    train = [c.cost_micro_usd for c in full.costs if c.pod_uid and c.pod_uid.startswith("train")]
    assert len(train) == 8 and max(train) - min(train) <= 1


def test_spot_costs_less_than_on_demand_for_the_same_shares(catalog):
    units = [Unit("GPU-a", [pod("p", 0.75), bucket(ShareSubjectKind.IDLE, 0.25)])]
    common = dict(provider="gcp", region="us-central1", instance_type="a2-highgpu-1g")
    on_demand = bill_node_window(node_window(units, **common, price_model="on_demand"), catalog)
    spot = bill_node_window(node_window(units, **common, price_model="spot"), catalog)
    od_rate = catalog.row("gcp", "us-central1", "a2-highgpu-1g", "on_demand").price_per_hour_usd
    spot_rate = catalog.row("gcp", "us-central1", "a2-highgpu-1g", "spot").price_per_hour_usd
    for result, rate in ((on_demand, od_rate), (spot, spot_rate)):
        assert result.bill.node_cost_micro_usd == math.floor(Fraction(rate) * 10**6 / 60 + Fraction(1, 2))
    assert spot.bill.node_cost_micro_usd < on_demand.bill.node_cost_micro_usd
    assert spot.bill.price_model == "spot" and {c.price_model for c in spot.costs} == {"spot"}
    assert spot.bill.price_version != on_demand.bill.price_version
    # On-demand uses GCP's GPU SKU; spot has no SKU figure: its CPUs and memory at the A2 rates, discounted alike.
    assert on_demand.bill.price.split_rule is SplitRule.SKU and spot.bill.price.split_rule is SplitRule.MARGINAL


def test_mig_units_are_priced_by_their_fraction_of_the_gpu(catalog):
    units = [
        Unit("MIG-3g", [pod("a", 1.0)], parent="GPU-0", fraction=3 / 7),
        Unit("MIG-2g", [pod("b", 0.5), bucket(ShareSubjectKind.IDLE, 0.5)], parent="GPU-0", fraction=2 / 7),
        Unit("MIG-1g", [pod("c", 1.0)], parent="GPU-0", fraction=1 / 7),
        Unit("GPU-0", [bucket(ShareSubjectKind.IDLE, 1.0)], parent=None, fraction=1 / 7),
    ]
    shares = node_window(units, instance_type="g6.xlarge", gpu_model="NVIDIA L4", window_seconds=3600)
    result = bill_node_window(shares, catalog, SplitPolicy(rule="gpu_fraction"))
    gpu_rate = result.bill.price.gpu_usd_per_hour
    parts = {p.gpu_uuid: p for p in result.parts}
    for uuid, sevenths in (("MIG-3g", 3), ("MIG-2g", 2), ("MIG-1g", 1), ("GPU-0", 1)):
        assert parts[uuid].gpu_fraction == Fraction(sevenths, 7)
        assert abs(parts[uuid].cost_micro_usd - gpu_rate * 10**6 * Fraction(sevenths, 7)) < Fraction(3, 2)
    gpu_total = sum(parts[u].cost_micro_usd for u in ("MIG-3g", "MIG-2g", "MIG-1g", "GPU-0"))
    assert gpu_total == result.bill.gpu_cost_micro_usd
    assert not [c for c in result.costs if c.gpu_uuid is None and c.subject_kind in (
        CostSubjectKind.UNATTRIBUTED, CostSubjectKind.UNAVAILABLE)]


def test_mig_fractions_a_hair_over_one_count_the_gpu_once(catalog):
    units = [Unit("MIG-a", [pod("a", 1.0)], parent="GPU-0", fraction=0.5000004),
             Unit("MIG-b", [pod("b", 1.0)], parent="GPU-0", fraction=0.5)]
    result = bill_node_window(node_window(units, instance_type="g6.xlarge", gpu_model="NVIDIA L4"), catalog)
    assert sum(c.cost_micro_usd for c in result.costs) == result.bill.node_cost_micro_usd
    assert not [c for c in result.costs if c.gpu_uuid is None and c.subject_kind in (
        CostSubjectKind.UNATTRIBUTED, CostSubjectKind.UNAVAILABLE)]
    over = [Unit("MIG-a", [pod("a", 1.0)], parent="GPU-0", fraction=0.6), units[1]]
    with pytest.raises(InconsistentShares, match="add up to"):
        bill_node_window(node_window(over, instance_type="g6.xlarge", gpu_model="NVIDIA L4"), catalog)


def test_gpu_missing_from_the_window_is_billed_as_its_own_unavailable_line(catalog):
    # A GPU the price bills but NVML no longer lists (fallen off the bus) was nobody's to use: UNAVAILABLE.
    units = shared_gpus(7, [pod("p", 1.0)])
    result = bill_node_window(node_window(units), catalog)
    assert not [c for c in result.costs if c.gpu_uuid is None and c.subject_kind is CostSubjectKind.UNATTRIBUTED]
    missing = [c for c in result.costs if c.gpu_uuid is None and c.subject_kind is CostSubjectKind.UNAVAILABLE]
    assert len(missing) == 1
    per_gpu = result.bill.price.gpu_usd_per_hour * 10**6 / 60
    assert abs(missing[0].cost_micro_usd - per_gpu) < Fraction(3, 2)
    assert sum(c.cost_micro_usd for c in result.costs) == result.bill.node_cost_micro_usd


def test_more_gpus_than_the_instance_has_or_another_node_s_price_is_refused(catalog):
    too_many = node_window(shared_gpus(2, [pod("p", 1.0)]), instance_type="g5.xlarge")
    with pytest.raises(PriceError, match="GPUs"):
        bill_node_window(too_many, catalog)
    shares = node_window(shared_gpus(1, [pod("p", 1.0)]), instance_type="g5.xlarge")
    other_price = price_node(catalog, provider="aws", region="us-east-1", instance_type="g6.xlarge",
                             price_model="on_demand", observed_gpu_count=1)
    with pytest.raises(PriceError, match="another node"):
        cost_node_window(shares, other_price)


def test_inconsistent_or_impossible_rows_are_invalid_messages(catalog):
    good = node_window([Unit("GPU-0", [pod("p", 0.5), bucket(ShareSubjectKind.IDLE, 0.5)])],
                       instance_type="g5.xlarge")
    price = price_node(catalog, provider="aws", region="us-east-1", instance_type="g5.xlarge",
                       price_model="on_demand", observed_gpu_count=1)
    assert len(cost_node_window(good, price)) == 3

    def variant(index: int, **changes):
        rows = list(good)
        rows[index] = dataclasses.replace(rows[index], **changes)
        return rows

    cases = {
        "shares do not add up": variant(0, cost_share=0.4),
        "conflicting duplicate": list(good) + [dataclasses.replace(good[0], cost_share=0.6)],
        "incomplete unit": [good[0]],
        "disagreeing node facts": variant(1, instance_type="g6.xlarge"),
        "window count wrong": [dataclasses.replace(s, units_in_node=2) for s in good],
        "two windows": variant(1, window_start_unix_ms=WINDOW_START_MS + 60_000),
        "pod without uid": variant(0, pod_uid=None),
        "bucket with a uid": variant(1, pod_uid="p2"),
    }
    for what, rows in cases.items():
        with pytest.raises(InconsistentShares):
            cost_node_window(rows, price)
    out_of_range = {
        "covered beyond the window": [dataclasses.replace(s, node_covered_seconds=61.0) for s in good],
        "negative share": variant(0, cost_share=-0.1),
        "zero fraction": [dataclasses.replace(s, gpu_fraction=0.0) for s in good],
    }
    for what, rows in out_of_range.items():
        with pytest.raises(OutOfRange):
            cost_node_window(rows, price)
    assert InconsistentShares("x").reason_code == "INCONSISTENT_SHARES"
    assert issubclass(InconsistentShares, InvalidMessage)


def test_records_carry_the_subject_and_jsonl_fields(catalog):
    shares = node_window([Unit("GPU-0", [pod("p1", 1.0, "ml", team="research")])], instance_type="g5.xlarge")
    result = bill_node_window(shares, catalog)
    pod_cost = next(c for c in result.costs if c.subject_kind is CostSubjectKind.POD)
    assert (pod_cost.pod_uid, pod_cost.namespace, pod_cost.pod_name, dict(pod_cost.labels)) == (
        "p1", "ml", "pod-p1", {"team": "research"})
    assert pod_cost.price_version == result.bill.price_version
    line = cost_record_json(pod_cost)
    assert line["subject_kind"] == "pod" and line["gpu_uuid"] == "GPU-0" and line["node"] == "node-a"
    assert line["window_start"].endswith("Z") and line["cost_micro_usd"] == pod_cost.cost_micro_usd
    other = cost_record_json(next(c for c in result.costs if c.subject_kind is CostSubjectKind.NODE_OTHER))
    assert other["gpu_uuid"] is None and other["subject_kind"] == "node_other" and other["pod_uid"] is None
    bill = result.bill.as_json()
    assert {"node", "window_start", "window_seconds", "instance_type", "price_per_hour_usd",
            "node_cost_micro_usd"} <= set(bill)
    assert Decimal(str(bill["price_per_hour_usd"])) == catalog.row(
        "aws", "us-east-1", "g5.xlarge", "on_demand").price_per_hour_usd


def test_disagreeing_rows_name_the_first_field_they_disagree_on(catalog):
    """Every node and unit field a row of a node-window can disagree on is named, the first in field order; a NaN
    (equal to nothing, itself included) disagrees even when every row shares the one float object."""
    from services.billing.costing import node_facts

    good = node_window([Unit("GPU-0", [pod("p", 0.5), bucket(ShareSubjectKind.IDLE, 0.5)]),
                        Unit("GPU-1", [pod("q", 1.0)])], instance_type="p4d.24xlarge")
    assert node_facts(good).units_in_node == 2
    node_changes = {"window_seconds": 30, "node_covered_seconds": 59.0, "cloud_provider": "gcp", "region": "x",
                    "instance_type": "y", "price_model": "spot", "units_in_node": 3, "zone": "z", "provider_id": "i"}
    for name, value in node_changes.items():
        rows = list(good)
        rows[2] = dataclasses.replace(rows[2], **{name: value})
        with pytest.raises(InconsistentShares, match=f"rows disagree on {name}$"):
            node_facts(rows)
    rows = list(good)
    rows[1] = dataclasses.replace(rows[1], zone="z", region="x")
    with pytest.raises(InconsistentShares, match="rows disagree on region$"):
        node_facts(rows)
    unit_changes = {"parent_gpu_uuid": "GPU-9", "gpu_model": "other", "gpu_fraction": 0.5, "rows_in_unit": 3}
    for name, value in unit_changes.items():
        rows = list(good)
        rows[1] = dataclasses.replace(rows[1], **{name: value})
        with pytest.raises(InconsistentShares, match=f"unit GPU-0: rows disagree on {name}$"):
            node_facts(rows)
    nan = math.nan
    with pytest.raises(InconsistentShares, match="rows disagree on node_covered_seconds$"):
        node_facts([dataclasses.replace(s, node_covered_seconds=nan) for s in good])
    with pytest.raises(InconsistentShares, match="unit GPU-0: rows disagree on gpu_fraction$"):
        node_facts([dataclasses.replace(s, gpu_fraction=nan) for s in good])
