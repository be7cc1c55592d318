"""The price catalog: bundled figures, validation of price files, the OpenCost-style override, spot prices."""

from __future__ import annotations

import csv
import io
from decimal import Decimal

import pytest

from gpumeter.errors import GpumeterError
from services.billing.catalog import (
    BUNDLED_PRICE_FILES,
    DEFAULT_PRICE_DIR,
    PRICE_COLUMNS,
    SOURCE_KINDS,
    PriceCatalog,
    PriceError,
    load_price_dir,
    normalize_gpu_model,
    normalize_price_model,
    normalize_provider,
    parse_override_csv,
    parse_price_csv,
    parse_spot_discounts,
)

# /work/shared/reference/gpu-facts.md, "Cloud billing": the figures the bundled files must carry exactly.
REFERENCE_PRICES = {
    ("aws", "us-east-1", "p5.48xlarge", "on_demand"): "55.04",
    ("aws", "us-east-1", "p4d.24xlarge", "on_demand"): "21.957642",
    ("aws", "us-east-1", "p5en.48xlarge", "on_demand"): "63.296",
    ("aws", "us-east-1", "p6-b200.48xlarge", "on_demand"): "113.9328",
    ("aws", "us-east-1", "g5.xlarge", "on_demand"): "1.006",
    ("aws", "us-east-1", "g6.xlarge", "on_demand"): "0.8048",
    ("aws", "us-east-1", "g4dn.xlarge", "on_demand"): "0.526",
    # karpenter-provider-aws zz_generated.pricing_aws.go, generated 2026-01-19 for us-east-1
    ("aws", "us-east-1", "g5.12xlarge", "on_demand"): "5.672",
    ("aws", "us-east-1", "g6.12xlarge", "on_demand"): "4.6016",
    ("gcp", "us-central1", "a2-highgpu-1g", "on_demand"): "3.673385",
    ("gcp", "us-central1", "a2-highgpu-1g", "spot"): "1.293355",
    ("azure", "eastus", "Standard_NC24ads_A100_v4", "on_demand"): "3.673",
}
REFERENCE_GCP_MACHINE_WITHOUT_GPU = Decimal("0.73948")

HEADER = ",".join(PRICE_COLUMNS)


def price_line(**overrides: str) -> str:
    values = {
        "provider": "aws", "region": "us-east-1", "instance_type": "x1.gpu", "price_model": "on_demand",
        "price_per_hour_usd": "10", "gpu_model": "NVIDIA L4", "gpu_count": "2", "vcpu_count": "8",
        "memory_gib": "32", "gpu_sku_price_per_hour_usd": "", "source": "https://example.invalid/prices",
        "source_kind": "list_price", "source_date": "2026-07", "notes": "",
    }
    values.update(overrides)
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="").writerow([values[c] for c in PRICE_COLUMNS])
    return buffer.getvalue()


def price_file(*lines: str) -> str:
    return "\n".join([HEADER, *lines]) + "\n"


OVERRIDE_HEADER = "EndTimestamp,InstanceID,Region,AssetClass,InstanceIDField,InstanceType,MarketPriceHourly,Version"


@pytest.fixture(scope="module")
def catalog() -> PriceCatalog:
    return PriceCatalog.load()


def test_bundled_files_carry_the_reference_figures_exactly(catalog):
    for (provider, region, instance_type, model), figure in REFERENCE_PRICES.items():
        row = catalog.row(provider, region, instance_type, model)
        assert row is not None, (provider, region, instance_type, model)
        assert row.price_per_hour_usd == Decimal(figure)
    assert {r.key for r in catalog.rows} == {(p, r, t.lower(), m) for p, r, t, m in REFERENCE_PRICES}


def test_gcp_gpu_sku_is_the_machine_type_price_taken_from_the_total(catalog):
    row = catalog.row("gcp", "us-central1", "a2-highgpu-1g", "on_demand")
    assert row.price_per_hour_usd - row.gpu_count * row.gpu_sku_price_per_hour_usd == REFERENCE_GCP_MACHINE_WITHOUT_GPU


def test_every_bundled_row_names_its_source_kind_and_date(catalog):
    files = {p.name for p in DEFAULT_PRICE_DIR.glob("*.csv")}
    assert files == set(BUNDLED_PRICE_FILES)
    for row in catalog.rows:
        assert row.source.source.strip()
        assert row.source.source_kind in SOURCE_KINDS
        assert row.source.source_date[:4].isdigit()
        assert row.source.origin.split(":")[0] in files
    azure = catalog.row("azure", "eastus", "Standard_NC24ads_A100_v4", "on_demand")
    assert azure.source.source_kind == "third_party_transcription"
    assert "verif" in (azure.notes + azure.source.source).lower()


def test_only_sourced_spot_prices_are_bundled(catalog):
    spot_rows = [r for r in catalog.rows if r.price_model == "spot"]
    assert [(r.provider, r.instance_type) for r in spot_rows] == [("gcp", "a2-highgpu-1g")]
    assert not [r for r in catalog.rows if r.price_model == "committed"]


def test_spot_and_on_demand_are_different_prices(catalog):
    on_demand = catalog.quote(provider="gcp", region="us-central1", instance_type="a2-highgpu-1g",
                              price_model="on_demand")
    spot = catalog.quote(provider="gce", region="US-CENTRAL1", instance_type="a2-highgpu-1g",
                         price_model="preemptible")
    assert spot.price_model == "spot"
    assert spot.node_price_per_hour_usd == Decimal(REFERENCE_PRICES[("gcp", "us-central1", "a2-highgpu-1g", "spot")])
    assert on_demand.node_price_per_hour_usd == Decimal("3.673385")
    assert spot.node_price_per_hour_usd < on_demand.node_price_per_hour_usd
    # The source gives no GPU/machine split for spot, so no SKU figure is carried over from on-demand.
    assert spot.gpu_sku_price_per_hour_usd is None
    assert on_demand.gpu_sku_price_per_hour_usd is not None


def test_aws_spot_needs_an_override_or_a_configured_discount(catalog):
    with pytest.raises(PriceError) as raised:
        catalog.quote(provider="aws", region="us-east-1", instance_type="p5.48xlarge", price_model="spot")
    assert "custom price CSV" in str(raised.value) and "spot discount" in str(raised.value)
    assert isinstance(raised.value, GpumeterError)

    override = parse_override_csv(
        OVERRIDE_HEADER + ",PriceModel,Provider\n,,us-east-1,node,,p5.48xlarge,21.5,,spot,aws\n", "custom.csv"
    )
    with_override = PriceCatalog(catalog.rows, override)
    quote = with_override.quote(provider="aws", region="us-east-1", instance_type="p5.48xlarge", price_model="spot")
    assert quote.node_price_per_hour_usd == Decimal("21.5")
    assert quote.sources[0].origin == "custom.csv:2"
    # The override is for spot only: on-demand still comes from the bundled file.
    od = with_override.quote(provider="aws", region="us-east-1", instance_type="p5.48xlarge",
                             price_model="on_demand")
    assert od.node_price_per_hour_usd == Decimal("55.04")

    discounted = PriceCatalog(catalog.rows, spot_discounts=parse_spot_discounts("aws=0.6"))
    derived = discounted.quote(provider="aws", region="us-east-1", instance_type="p5.48xlarge", price_model="spot")
    assert derived.node_price_per_hour_usd == Decimal("55.04") * (1 - Decimal("0.6"))
    assert "discount" in derived.derivation


def test_override_by_instance_type_replaces_the_bundled_price_and_keeps_instance_facts(catalog):
    rows = parse_override_csv(OVERRIDE_HEADER + "\n,,,node,,P4D.24XLARGE,15.25,v3\n", "custom.csv")
    quote = PriceCatalog(catalog.rows, rows).quote(
        provider="aws", region="us-east-1", instance_type="p4d.24xlarge", price_model="on_demand")
    assert quote.node_price_per_hour_usd == Decimal("15.25")
    bundled = catalog.row("aws", "us-east-1", "p4d.24xlarge", "on_demand")
    assert (quote.spec.gpu_count, quote.spec.vcpu_count, quote.spec.memory_gib) == (
        bundled.gpu_count, bundled.vcpu_count, bundled.memory_gib)
    assert quote.sources[0].source_kind == "custom" and "v3" in quote.sources[0].source


def test_override_precedence_node_name_then_region_then_price_model(catalog):
    text = (
        OVERRIDE_HEADER + ",PriceModel\n"
        ",,,node,,g5.xlarge,0.9,,\n"
        ",,us-east-1,node,,g5.xlarge,0.8,,\n"
        ",,us-east-1,node,,g5.xlarge,0.3,,spot\n"
        ",gpu-node-7,,node,metadata.name,,0.5,,\n"
    )
    custom = PriceCatalog(catalog.rows, parse_override_csv(text, "custom.csv"))

    def price(node_name: str = "", region: str = "us-east-1", model: str = "on_demand") -> Decimal:
        return custom.quote(provider="aws", region=region, instance_type="g5.xlarge", price_model=model,
                            node_name=node_name).node_price_per_hour_usd

    assert price() == Decimal("0.8")
    assert price(region="eu-west-1") == Decimal("0.9")
    assert price(model="spot") == Decimal("0.3")
    assert price(node_name="gpu-node-7") == Decimal("0.5")
    assert price(node_name="gpu-node-8") == Decimal("0.8")


def test_gpu_model_override_prices_gpus_and_on_prem_nodes(catalog):
    text = OVERRIDE_HEADER + "\n,,,gpu,,NVIDIA-H100-80GB-HBM3,2.10,\n"
    custom = PriceCatalog(catalog.rows, parse_override_csv(text, "custom.csv"))
    quote = custom.quote(provider="aws", region="us-east-1", instance_type="p5.48xlarge", price_model="on_demand",
                         gpu_model="NVIDIA H100 80GB HBM3")
    assert quote.node_price_per_hour_usd == Decimal("55.04")
    assert quote.gpu_sku_price_per_hour_usd == Decimal("2.10")
    on_prem = custom.quote(provider="", region="", instance_type="dgx-h100", price_model="",
                           gpu_model="NVIDIA H100 80GB HBM3")
    assert on_prem.node_price_per_hour_usd is None
    assert on_prem.gpu_sku_price_per_hour_usd == Decimal("2.10")
    with pytest.raises(PriceError):
        custom.quote(provider="", region="", instance_type="dgx-a100", price_model="",
                     gpu_model="NVIDIA A100-SXM4-80GB")


def test_override_rows_of_other_asset_classes_are_skipped_and_bad_rows_refused():
    ok = parse_override_csv(OVERRIDE_HEADER + "\n,pvc-1,,pv,metadata.name,,0.04,\n,,,node,,m5.large,0.096,\n", "o.csv")
    assert [r.match for r in ok] == ["m5.large"]
    bad = {
        "asset class": ",,,gpu-ish,,x,1,",
        "id field": ",i-0abc,,node,spec.providerID,,1,",
        "no target": ",,,node,,,1,",
        "price": ",,,node,,m5.large,-1,",
        "not a number": ",,,node,,m5.large,cheap,",
    }
    for what, line in bad.items():
        with pytest.raises(PriceError):
            parse_override_csv(OVERRIDE_HEADER + "\n" + line + "\n", f"{what}.csv")
    with pytest.raises(PriceError, match="missing columns"):
        parse_override_csv("InstanceType,Price\nm5.large,1\n", "o.csv")
    with pytest.raises(PriceError, match="unknown columns"):
        parse_override_csv(OVERRIDE_HEADER + ",Colour\n,,,node,,m5.large,1,,red\n", "o.csv")
    duplicate = OVERRIDE_HEADER + "\n,,,node,,m5.large,1,\n,,,node,,M5.LARGE,2,\n"
    with pytest.raises(PriceError, match="duplicate"):
        PriceCatalog((), parse_override_csv(duplicate, "o.csv"))


def test_price_file_validation_refuses_bad_rows():
    assert parse_price_csv(price_file(price_line()), "ok.csv")[0].price_per_hour_usd == Decimal("10")
    bad = {
        "empty source": price_line(source=""),
        "bad kind": price_line(source_kind="blog"),
        "bad date": price_line(source_date="July 2026"),
        "negative": price_line(price_per_hour_usd="-1"),
        "nan": price_line(price_per_hour_usd="NaN"),
        "no gpus": price_line(gpu_count="0"),
        "price model": price_line(price_model="hourly"),
        "sku above node": price_line(gpu_sku_price_per_hour_usd="6"),
        "no provider": price_line(provider=""),
    }
    for what, line in bad.items():
        with pytest.raises(PriceError):
            parse_price_csv(price_file(line), f"{what}.csv")
    with pytest.raises(PriceError, match="missing columns"):
        parse_price_csv("provider,region\naws,us-east-1\n", "short.csv")
    with pytest.raises(PriceError, match="number of fields"):
        parse_price_csv(price_file(price_line() + ",extra"), "long.csv")


def test_catalog_refuses_duplicates_and_disagreeing_instance_facts():
    first = parse_price_csv(price_file(price_line()), "a.csv")
    with pytest.raises(PriceError, match="duplicate"):
        PriceCatalog(first + parse_price_csv(price_file(price_line(price_per_hour_usd="11")), "b.csv"))
    spot_other_facts = parse_price_csv(price_file(price_line(price_model="spot", gpu_count="4")), "b.csv")
    with pytest.raises(PriceError, match="disagree"):
        PriceCatalog(first + spot_other_facts)


def test_load_from_a_folder_and_from_env(tmp_path):
    (tmp_path / "prices").mkdir()
    (tmp_path / "prices" / "mine.csv").write_text(price_file(price_line()))
    (tmp_path / "custom.csv").write_text(OVERRIDE_HEADER + "\n,,,node,,x1.gpu,7.5,\n")
    loaded = PriceCatalog.from_env({
        "GPUMETER_BILLING_PRICE_DIR": str(tmp_path / "prices"),
        "GPUMETER_BILLING_PRICE_OVERRIDE_CSV": str(tmp_path / "custom.csv"),
        "GPUMETER_BILLING_SPOT_DISCOUNTS": "aws=0.5",
    })
    assert len(loaded.rows) == 1
    assert loaded.quote(provider="aws", region="us-east-1", instance_type="x1.gpu",
                        price_model="on_demand").node_price_per_hour_usd == Decimal("7.5")
    assert loaded.spot_discounts == {"aws": Decimal("0.5")}
    with pytest.raises(PriceError):
        load_price_dir(tmp_path / "nothing-here")
    with pytest.raises(PriceError):
        PriceCatalog.load(override_csv=tmp_path / "missing.csv")
    for bad in ("aws", "aws=1", "aws=-0.1", "aws=x"):
        with pytest.raises(PriceError):
            parse_spot_discounts(bad)


def test_normalisation():
    assert normalize_provider(" GCE ") == "gcp" and normalize_provider("AKS") == "azure"
    assert normalize_provider("onprem") == "onprem"
    assert [normalize_price_model(m) for m in ("", "On-Demand", "Spot", "reserved")] == [
        "on_demand", "on_demand", "spot", "committed"]
    with pytest.raises(PriceError):
        normalize_price_model("auction")
    assert normalize_gpu_model("NVIDIA A100-SXM4-40GB") == normalize_gpu_model("a100 sxm4_40gb") == "a100 sxm4 40gb"
