"""The split of a node's hourly price into per-GPU parts and node_other."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import pytest

from gpumeter.errors import ConfigError
from services.billing.catalog import PriceCatalog, PriceError, parse_override_csv
from services.billing.pricing import (
    DEFAULT_GPU_FRACTION,
    OPENCOST_CPU_USD_PER_VCPU_HOUR,
    OPENCOST_GPU_USD_PER_GPU_HOUR,
    OPENCOST_RAM_USD_PER_GIB_HOUR,
    NodePrice,
    SplitPolicy,
    SplitRule,
    price_node,
    split_node_price,
)

OVERRIDE_HEADER = "EndTimestamp,InstanceID,Region,AssetClass,InstanceIDField,InstanceType,MarketPriceHourly,Version"


@pytest.fixture(scope="module")
def catalog() -> PriceCatalog:
    return PriceCatalog.load()


def quote(catalog, provider, region, instance_type, model="on_demand", **kw):
    return catalog.quote(provider=provider, region=region, instance_type=instance_type, price_model=model, **kw)


def test_gcp_uses_the_per_gpu_sku_and_keeps_the_machine_as_node_other(catalog):
    q = quote(catalog, "gcp", "us-central1", "a2-highgpu-1g")
    price = split_node_price(q, observed_gpu_count=1)
    assert price.split_rule is SplitRule.SKU
    assert price.gpu_usd_per_hour == Fraction(q.gpu_sku_price_per_hour_usd)
    assert price.node_other_usd_per_hour == Fraction(q.node_price_per_hour_usd - q.gpu_sku_price_per_hour_usd)
    assert price.node_other_usd_per_hour == Fraction(Decimal("0.73948"))


def test_aws_without_a_gpu_sku_splits_at_the_general_purpose_rates_by_default(catalog):
    q = quote(catalog, "aws", "us-east-1", "p5.48xlarge")
    price = split_node_price(q, observed_gpu_count=8)
    assert price.split_rule is SplitRule.MARGINAL
    row = catalog.row("aws", "us-east-1", "p5.48xlarge", "on_demand")
    # The rates file's figures, solved from c7i.xlarge and r7i.xlarge: the CPUs and memory cost what they cost
    # on AWS's general-purpose machines; the GPUs the rest.
    other = row.vcpu_count * Fraction("0.03745") + Fraction(row.memory_gib) * Fraction("0.0035875")
    assert price.node_other_usd_per_hour == other == Fraction("14.5376")
    assert price.gpu_count * price.gpu_usd_per_hour == Fraction(row.price_per_hour_usd) - other
    assert "c7i.xlarge" in price.derivation and any("rates/general_purpose.csv" in s.origin for s in price.sources)


def test_marginal_for_a_spot_node_scales_the_rates_by_its_own_discount(catalog):
    spot = split_node_price(quote(catalog, "gcp", "us-central1", "a2-highgpu-1g", "spot"), observed_gpu_count=1)
    on_demand = split_node_price(quote(catalog, "gcp", "us-central1", "a2-highgpu-1g"), observed_gpu_count=1,
                                 policy=SplitPolicy(rule="marginal"))
    assert spot.split_rule is SplitRule.MARGINAL
    ratio = spot.node_usd_per_hour / on_demand.node_usd_per_hour
    assert spot.node_other_usd_per_hour == on_demand.node_other_usd_per_hour * ratio
    assert "over its on-demand list price" in spot.derivation


def test_marginal_is_refused_where_cpu_and_memory_would_cost_the_whole_node(catalog):
    custom = catalog.with_overrides(parse_override_csv(
        "AssetClass,InstanceType,MarketPriceHourly,Provider,Region,Source,SourceDate\n"
        "node,p5.48xlarge,10.0,aws,us-east-1,negotiated,2026-07\n", "o.csv"))
    q = quote(custom, "aws", "us-east-1", "p5.48xlarge")
    with pytest.raises(PriceError, match="not below the node price"):
        split_node_price(q, observed_gpu_count=8, policy=SplitPolicy(rule="marginal"))


def test_the_weights_rule_is_opencosts_default_unit_prices(catalog):
    q = quote(catalog, "aws", "us-east-1", "p5.48xlarge")
    price = split_node_price(q, observed_gpu_count=8, policy=SplitPolicy(rule="weights"))
    assert price.split_rule is SplitRule.WEIGHTS
    row = catalog.row("aws", "us-east-1", "p5.48xlarge", "on_demand")
    cpu = row.vcpu_count * Fraction(OPENCOST_CPU_USD_PER_VCPU_HOUR)
    ram = Fraction(row.memory_gib) * Fraction(OPENCOST_RAM_USD_PER_GIB_HOUR)
    gpu = row.gpu_count * Fraction(OPENCOST_GPU_USD_PER_GPU_HOUR)
    expected_gpu_part = Fraction(row.price_per_hour_usd) * gpu / (cpu + ram + gpu)
    assert price.gpu_count == row.gpu_count == 8
    assert price.gpu_count * price.gpu_usd_per_hour == expected_gpu_part
    assert price.node_other_usd_per_hour == Fraction(row.price_per_hour_usd) - expected_gpu_part


def test_fixed_gpu_fraction_rule_and_its_default(catalog):
    q = quote(catalog, "aws", "us-east-1", "g6.xlarge")
    price = split_node_price(q, observed_gpu_count=1, policy=SplitPolicy(rule="gpu_fraction"))
    assert DEFAULT_GPU_FRACTION == Decimal("0.70")
    assert price.gpu_usd_per_hour == Fraction(q.node_price_per_hour_usd) * Fraction(DEFAULT_GPU_FRACTION)
    half_policy = SplitPolicy(rule="gpu_fraction", gpu_fraction=Decimal("0.5"))
    half = split_node_price(q, observed_gpu_count=1, policy=half_policy)
    assert half.gpu_usd_per_hour == half.node_other_usd_per_hour == Fraction(q.node_price_per_hour_usd) / 2


def test_auto_falls_back_to_gpu_fraction_without_cpu_and_memory_counts(catalog):
    custom = PriceCatalog(catalog.rows, parse_override_csv(
        OVERRIDE_HEADER + ",GpuCount\n,,,node,,bare-metal-4gpu,12,,4\n", "custom.csv"))
    q = quote(custom, "onprem", "dc1", "bare-metal-4gpu")
    price = split_node_price(q, observed_gpu_count=2)
    assert price.split_rule is SplitRule.GPU_FRACTION
    assert price.gpu_count == 4  # the override's count, not the observed one
    assert price.gpu_count * price.gpu_usd_per_hour == Fraction(12) * Fraction(DEFAULT_GPU_FRACTION)
    with pytest.raises(PriceError, match="vCPU"):
        split_node_price(q, observed_gpu_count=2, policy=SplitPolicy(rule="weights"))
    with pytest.raises(PriceError, match="SKU"):
        split_node_price(q, observed_gpu_count=2, policy=SplitPolicy(rule="sku"))


def test_a_node_priced_only_per_gpu_has_no_node_other(catalog):
    custom = PriceCatalog(catalog.rows, parse_override_csv(
        OVERRIDE_HEADER + "\n,,,gpu,,NVIDIA L40S,1.25,\n", "custom.csv"))
    price = price_node(custom, provider="", region="", instance_type="workstation", price_model="",
                       gpu_model="NVIDIA L40S", observed_gpu_count=3)
    assert price.split_rule is SplitRule.GPU_ONLY
    assert price.node_usd_per_hour == 3 * Fraction(Decimal("1.25"))
    assert price.node_other_usd_per_hour == 0


def test_sku_above_the_node_price_is_refused(catalog):
    custom = PriceCatalog(catalog.rows, parse_override_csv(
        OVERRIDE_HEADER + "\n,,,gpu,,Tesla T4,0.60,\n", "custom.csv"))
    with pytest.raises(PriceError, match="exceed"):
        price_node(custom, provider="aws", region="us-east-1", instance_type="g4dn.xlarge", price_model="on_demand",
                   gpu_model="Tesla T4", observed_gpu_count=1)


@pytest.mark.parametrize("rule", ["auto", "weights", "gpu_fraction"])
def test_every_bundled_price_splits_exactly(catalog, rule):
    for row in catalog.rows:
        q = quote(catalog, row.provider, row.region, row.instance_type, row.price_model)
        price = split_node_price(q, observed_gpu_count=row.gpu_count, policy=SplitPolicy(rule=rule))
        assert price.gpu_count * price.gpu_usd_per_hour + price.node_other_usd_per_hour == Fraction(
            row.price_per_hour_usd)
        assert 0 < price.gpu_usd_per_hour and price.node_other_usd_per_hour >= 0
        assert price.describe()["price_per_hour_usd"].startswith(str(row.price_per_hour_usd))


def test_price_versions_identify_the_price_and_its_split(catalog):
    q = quote(catalog, "aws", "us-east-1", "g5.xlarge")
    marginal = split_node_price(q, observed_gpu_count=1)
    again = split_node_price(q, observed_gpu_count=1)
    fraction = split_node_price(q, observed_gpu_count=1, policy=SplitPolicy(rule="gpu_fraction"))
    assert marginal.price_version == again.price_version
    assert marginal.price_version != fraction.price_version
    # Both sources' dates: the instance's price row and the general-purpose rates.
    assert marginal.price_version.startswith("aws:us-east-1:g5.xlarge:on_demand@2026-01-19+2026-07/marginal-")
    assert len(marginal.price_version) <= 255


def test_node_price_invariant_is_enforced():
    with pytest.raises(PriceError):
        NodePrice(provider="aws", region="r", instance_type="t", price_model="on_demand",
                  node_usd_per_hour=Fraction(10), gpu_count=2, gpu_usd_per_hour=Fraction(4),
                  node_other_usd_per_hour=Fraction(1), split_rule=SplitRule.SKU, sources=())


def test_split_policy_from_env():
    policy = SplitPolicy.from_env({
        "GPUMETER_BILLING_SPLIT_RULE": "Weights",
        "GPUMETER_BILLING_SPLIT_WEIGHTS": "cpu=0.05, ram=0.01, gpu=2",
        "GPUMETER_BILLING_GPU_FRACTION": "0.8",
    })
    assert (policy.rule, policy.cpu_usd_per_vcpu_hour, policy.ram_usd_per_gib_hour, policy.gpu_usd_per_gpu_hour,
            policy.gpu_fraction) == ("weights", Decimal("0.05"), Decimal("0.01"), Decimal("2"), Decimal("0.8"))
    assert SplitPolicy.from_env({}) == SplitPolicy()
    for bad in ({"GPUMETER_BILLING_SPLIT_RULE": "even"}, {"GPUMETER_BILLING_GPU_FRACTION": "1.5"},
                {"GPUMETER_BILLING_SPLIT_WEIGHTS": "disk=1"}, {"GPUMETER_BILLING_SPLIT_WEIGHTS": "gpu=0"},
                {"GPUMETER_BILLING_GPU_FRACTION": "most"}):
        with pytest.raises(ConfigError):
            SplitPolicy.from_env(bad)
