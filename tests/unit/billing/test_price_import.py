"""``gpumeter prices import``: the providers' own price lists into the catalog's price files, offline, on recorded
samples in the providers' shapes (``tests/fixtures/prices/README.md``); a spot node priced at its region's
imported spot rate end to end."""

from __future__ import annotations

import io
import json
from decimal import Decimal
from pathlib import Path

import pytest

from gpumeter import cli
from pipeline import cli as replay_cli
from services.billing.catalog import PriceCatalog, parse_price_csv, parse_rates_csv
from services.billing.price_import import (
    PriceImportError,
    detect_price_format,
    import_prices,
    load_instance_facts,
    render_price_csv,
    render_rates_csv,
)
from services.billing.pricing import price_node
from simulator.scenario import load_scenario
from services.collector.simulation import node_facts, node_object

REPO = Path(__file__).resolve().parents[3]
PRICES = REPO / "tests" / "fixtures" / "prices"
FACTS = load_instance_facts()


def read(name):
    return (name, (PRICES / name).read_text(encoding="utf-8"))


def imported(*names, **options):
    return import_prices([read(n) for n in names], FACTS, **options)


def rows(result, **match):
    return {(p.provider, p.region, p.instance_type, p.price_model): p for p in result.prices
            if all(getattr(p, k) == v for k, v in match.items())}


@pytest.mark.parametrize("name,fmt", [
    ("aws_ec2_offer_us-east-1.json", "aws-offer-json"), ("aws_ec2_offer_us-east-1.csv", "aws-offer-csv"),
    ("aws_spot_price_history.json", "aws-spot"), ("gcp_compute_skus.json", "gcp-skus"),
    ("azure_retail_prices.json", "azure-retail"),
])
def test_each_format_is_told_by_its_shape(name, fmt):
    assert detect_price_format(read(name)[1])[0] == fmt


def test_the_aws_offer_file_gives_linux_on_demand_gpu_prices_and_the_general_purpose_rates():
    result = imported("aws_ec2_offer_us-east-1.json")
    prices = rows(result)
    assert {k: p.price_per_hour_usd for k, p in prices.items()} == {
        ("aws", "us-east-1", "g5.xlarge", "on_demand"): Decimal("1.006"),
        ("aws", "us-east-1", "p5.48xlarge", "on_demand"): Decimal("55.04"),
    }
    p5 = prices[("aws", "us-east-1", "p5.48xlarge", "on_demand")]
    assert (p5.facts.vcpu_count, p5.facts.memory_gib, p5.facts.gpu_count, p5.facts.gpu_model) == (
        192, Decimal(2048), 8, "NVIDIA H100 80GB HBM3")
    assert p5.source_date == "2026-11-28" and "AmazonEC2 version 20261128023145" in p5.source
    # Windows, a capacity reservation, pre-installed SQL, dedicated tenancy, storage: not a node's list price.
    assert {r: n for r, n in result.skipped.items() if r.startswith("aws offer")} == {
        "aws offer: operatingSystem not Linux": 1, "aws offer: capacitystatus not Used": 1,
        "aws offer: preInstalledSw not NA": 1, "aws offer: tenancy not Shared": 1,
        "aws offer: not a compute instance": 1, "aws offer: not a GPU instance type": 2}
    (rates,) = result.rates
    assert (rates.provider, rates.region, rates.price_model, rates.cpu_usd_per_vcpu_hour,
            rates.ram_usd_per_gib_hour) == ("aws", "us-east-1", "on_demand", Decimal("0.03745"), Decimal("0.0035875"))
    assert "c7i.xlarge" in rates.derived_from and "r7i.xlarge" in rates.derived_from
    # The bundled rates were solved the same way from the same two prices.
    bundled = {r.key: r for r in PriceCatalog.load().rates}[("aws", "us-east-1", "on_demand")]
    assert (bundled.cpu_usd_per_vcpu_hour, bundled.ram_usd_per_gib_hour) == (rates.cpu_usd_per_vcpu_hour,
                                                                             rates.ram_usd_per_gib_hour)


def test_the_offer_file_as_csv_gives_the_same_rows():
    def comparable(result):
        return [{k: v for k, v in p.row().items() if k not in ("source", "notes")} for p in result.prices]

    assert comparable(imported("aws_ec2_offer_us-east-1.csv")) == comparable(imported("aws_ec2_offer_us-east-1.json"))


def test_the_spot_price_of_a_region_is_the_mean_of_its_zones_latest_prices():
    result = imported("aws_spot_price_history.json", "aws_ec2_offer_us-east-1.json")
    spot = rows(result, price_model="spot")
    g5 = spot[("aws", "us-east-1", "g5.xlarge", "spot")]
    # us-east-1a's latest (0.3812 at 01:12, not 0.4021 the evening before), 1b 0.3623, 1c 0.3734 (Linux, not Windows).
    assert g5.price_per_hour_usd == Decimal("0.3723")
    assert "us-east-1a 0.3812, us-east-1b 0.3623, us-east-1c 0.3734" in g5.notes
    assert g5.source_date == "2026-11-28"
    assert spot[("aws", "us-west-2", "g5.xlarge", "spot")].price_per_hour_usd == Decimal("0.3309")
    assert spot[("aws", "us-east-1", "p5.48xlarge", "spot")].facts.gpu_count == 8
    spot_rates = {r.key: r for r in result.rates}[("aws", "us-east-1", "spot")]
    assert (spot_rates.cpu_usd_per_vcpu_hour, spot_rates.ram_usd_per_gib_hour) == (Decimal("0.01498"),
                                                                                   Decimal("0.001435"))
    assert result.skipped["aws spot: not Linux/UNIX"] == 1
    assert result.skipped["aws spot: instance type not in an offer file or gpumeter's instance facts"] == 1


def test_gcp_machine_types_are_their_cores_memory_and_gpus_from_the_sku_catalog():
    result = imported("gcp_compute_skus.json", source_date="2026-11-30")
    prices = rows(result, region="us-central1")
    on_demand = prices[("gcp", "us-central1", "a2-highgpu-1g", "on_demand")]
    spot = prices[("gcp", "us-central1", "a2-highgpu-1g", "spot")]
    # 12 x 0.031611 + 85 x 0.004237 + 2.933908 (the SKUs as OpenCost's GCP test records them): the bundled on-demand
    # list price to the micro-dollar; the sample's Spot Preemptible SKUs sum to the bundled spot price.
    assert (on_demand.price_per_hour_usd, on_demand.gpu_sku_price_per_hour_usd) == (Decimal("3.673385"),
                                                                                    Decimal("2.933908"))
    assert spot.price_per_hour_usd == Decimal("1.293355")
    bundled = PriceCatalog.load()
    assert bundled.row("gcp", "us-central1", "a2-highgpu-1g", "on_demand").price_per_hour_usd == Decimal("3.673385")
    assert bundled.row("gcp", "us-central1", "a2-highgpu-1g", "spot").price_per_hour_usd == Decimal("1.293355")
    assert prices[("gcp", "us-central1", "a2-highgpu-8g", "on_demand")].price_per_hour_usd == Decimal("29.38708")
    assert prices[("gcp", "us-central1", "a3-highgpu-8g", "on_demand")].facts.gpu_count == 8
    assert ("gcp", "us-east1", "a3-highgpu-8g", "on_demand") not in rows(result)  # its SKUs are Iowa's only
    assert not [p for p in result.prices if "ultragpu" in p.instance_type]  # no A100 80GB SKU in the sample
    assert on_demand.source_date == "2026-11-30"
    rates = {r.key: r for r in result.rates}
    assert (rates[("gcp", "us-central1", "on_demand")].cpu_usd_per_vcpu_hour,
            rates[("gcp", "us-central1", "spot")].ram_usd_per_gib_hour) == (Decimal("0.031611"), Decimal("0.001491"))
    # Commitments, DWS-attached GPUs and families gpumeter has no machine type of are left out, counted.
    assert result.skipped == {"gcp: not on-demand or spot compute": 1,
                              "gcp: not a SKU of a machine type in gpumeter's instance facts": 2}
    undated = imported("gcp_compute_skus.json")
    assert undated.prices[0].source_date == "2026-11-02" and "not a retrieval date" in undated.prices[0].notes


def test_azure_linux_pay_as_you_go_and_spot_prices_and_rates():
    result = imported("azure_retail_prices.json")
    prices = rows(result)
    assert {k: p.price_per_hour_usd for k, p in prices.items()} == {
        ("azure", "eastus", "Standard_NC24ads_A100_v4", "on_demand"): Decimal("3.673"),
        ("azure", "eastus", "Standard_NC24ads_A100_v4", "spot"): Decimal("0.7346"),  # Spot, not Low Priority
        ("azure", "westus2", "Standard_NC24ads_A100_v4", "on_demand"): Decimal("3.673"),
        ("azure", "westus2", "Standard_NC24ads_A100_v4", "spot"): Decimal("0.8816"),
    }
    assert "Low Priority: no Spot price given" in prices[("azure", "westus2", "Standard_NC24ads_A100_v4", "spot")].notes
    assert result.skipped == {"azure: Windows": 1, "azure: not a Virtual Machines consumption price": 2}
    rates = {r.key: r for r in result.rates}
    # D4s_v5 at its current price (0.192, not the older 0.188) and E4s_v5: the bundled Azure rates.
    assert (rates[("azure", "eastus", "on_demand")].cpu_usd_per_vcpu_hour,
            rates[("azure", "eastus", "on_demand")].ram_usd_per_gib_hour) == (Decimal("0.033"), Decimal("0.00375"))
    assert ("azure", "eastus", "spot") in rates


def test_documents_that_cannot_be_true_are_refused():
    with pytest.raises(PriceImportError, match="not a price document"):
        import_prices([("x.json", "{}")], FACTS)
    euros = read("azure_retail_prices.json")[1].replace('"currencyCode": "USD"', '"currencyCode": "EUR"', 1)
    with pytest.raises(PriceImportError, match="currencyCode 'EUR'"):
        import_prices([("eur.json", euros)], FACTS)
    lying = read("aws_ec2_offer_us-east-1.json")[1].replace('"vcpu": "192"', '"vcpu": "96"')
    with pytest.raises(PriceImportError, match="p5.48xlarge has 96 vCPUs.*192.*instance facts"):
        import_prices([("lying.json", lying)], FACTS)
    other = json.loads(read("aws_ec2_offer_us-east-1.json")[1])
    other["products"]["Z1"] = dict(other["products"]["8PUGAPNQRU3C2ZN5"], sku="Z1")
    other["terms"]["OnDemand"]["Z1"] = json.loads(json.dumps(other["terms"]["OnDemand"]["8PUGAPNQRU3C2ZN5"])
                                                  .replace("1.0060000000", "1.1"))
    with pytest.raises(PriceImportError, match="g5.xlarge in us-east-1 costs"):
        import_prices([("two.json", json.dumps(other))], FACTS)


def test_what_is_written_loads_as_the_catalog_and_prices_nodes():
    result = imported("aws_ec2_offer_us-east-1.json", "aws_spot_price_history.json", "gcp_compute_skus.json",
                      "azure_retail_prices.json")
    text = render_price_csv(result.prices)
    catalog = PriceCatalog(parse_price_csv(text, "imported.csv"),
                           rates=parse_rates_csv(render_rates_csv(result.rates), "rates/imported.csv"))
    price = price_node(catalog, provider="aws", region="us-east-1", instance_type="g5.xlarge", price_model="spot",
                       observed_gpu_count=1)
    assert price.node_usd_per_hour == Decimal("0.3723") and price.split_rule.value == "marginal"
    gcp = price_node(catalog, provider="gcp", region="us-central1", instance_type="a2-highgpu-1g",
                     price_model="spot", observed_gpu_count=1)
    assert (gcp.split_rule.value, gcp.gpu_usd_per_hour) == ("sku", Decimal("1.033084"))


def test_a_spot_node_is_priced_at_its_regions_imported_spot_rate_end_to_end(tmp_path, capsys):
    """prices import (offer file + spot history) → --price-dir → replay of a node whose Node object says
    karpenter.sh/capacity-type: spot. The bundled catalog has no AWS spot price: without the import it is unpriced."""
    out_dir = tmp_path / "prices"
    assert cli.main(["prices", "import", str(PRICES / "aws_ec2_offer_us-east-1.json"),
                     str(PRICES / "aws_spot_price_history.json"), "--out", str(out_dir)]) == 0
    said = capsys.readouterr().out
    assert "aws spot: 3 GPU instance type prices" in said and f"wrote {out_dir / 'aws.csv'}" in said
    assert (out_dir / "rates" / "aws.csv").is_file()

    scenario = load_scenario(PRICES / "spot_g5.yaml")
    (node,) = scenario.nodes
    assert node_object(node)["metadata"]["labels"]["karpenter.sh/capacity-type"] == "spot"
    assert node_facts(scenario, node).price_model == "spot"

    def replay(*flags):
        import argparse

        parser = argparse.ArgumentParser()
        replay_cli.add_arguments(parser)
        args = parser.parse_args([str(PRICES / "spot_g5.yaml"), "--out", str(tmp_path / f"out{len(flags)}"), *flags])
        return replay_cli.main(args, {}, out=io.StringIO(), err=io.StringIO())

    assert replay() == 1  # bundled prices: no spot price for the node
    assert replay("--price-dir", str(out_dir)) == 0
    bills = [json.loads(line) for line in (tmp_path / "out2" / "bills.jsonl").read_text().splitlines()]
    assert bills and {(b["price_model"], b["price_per_hour_usd"]) for b in bills} == {("spot", 0.3723)}
    assert all(b["price_version"].startswith("aws:us-east-1:g5.xlarge:spot@2026-11-28/") for b in bills)


def test_an_import_that_cannot_be_done_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"Items": [{"type": "Consumption", "unitOfMeasure": "1 Hour", "currencyCode": "EUR"}]}')
    assert cli.main(["prices", "import", str(PRICES / "aws_ec2_offer_us-east-1.json"), str(bad), "--out",
                     str(tmp_path / "out")]) == 2
    assert "currencyCode 'EUR'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
