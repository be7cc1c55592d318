"""The providers' own price lists turned into the catalog's price files. Pure: documents in, rows out.

``import_prices(documents, facts)`` reads each document, tells its format by its shape (``detect_price_format``),
and returns the price rows of the GPU instance types (``PRICE_COLUMNS``: on-demand and spot, each with its source
and date) and the general-purpose rates the documents allow deriving (``RATE_COLUMNS``). ``render_price_csv`` and
``render_rates_csv`` write them in the bundled layout; ``gpumeter prices import`` (``prices_cli``) is the command.

Formats:

``aws-offer-json`` / ``aws-offer-csv``
    The AWS Price List Bulk API offer file of ``AmazonEC2`` (``/offers/v1.0/aws/AmazonEC2/current/[<region>/]
    index.json|csv``): JSON ``products`` (``sku``, ``productFamily``, ``attributes``) and ``terms.OnDemand``
    (``priceDimensions`` … ``pricePerUnit.USD``); CSV: five metadata rows (``FormatVersion``, ``Disclaimer``,
    ``Publication Date``, ``Version``, ``OfferCode``) then one row per price with the product's attributes.
    Kept: ``Compute Instance`` products on ``Linux``, ``Shared`` tenancy, ``capacitystatus`` ``Used``,
    ``preInstalledSw`` ``NA``, the ``OnDemand`` term's ``Hrs`` dimension in USD, ``marketoption`` ``OnDemand``
    where given. Region: ``regionCode`` (older files: the ``location`` name). vCPUs, memory and GPU count come
    from the product's own attributes (``vcpu``, ``memory``, ``gpu``); the GPU model from gpumeter's instance
    facts. Dated by the file's publication date.
``aws-spot``
    ``aws ec2 describe-spot-price-history`` output (``SpotPriceHistory``: ``AvailabilityZone``, ``InstanceType``,
    ``ProductDescription``, ``SpotPrice``, ``Timestamp``). Kept: ``Linux/UNIX`` (and ``Linux/UNIX (Amazon
    VPC)``). The spot price of a region is the mean over its availability zones of each zone's latest price,
    rounded to 10 decimals (AWS's own precision); the notes list the zones and their prices. Dated by the newest
    timestamp. Instance facts from an offer file in the same import, else gpumeter's instance facts.
``gcp-skus``
    Cloud Billing Catalog API ``services/6F81-5844-456A/skus`` (Compute Engine): ``description``,
    ``category`` (``resourceFamily`` Compute, ``resourceGroup``, ``usageType`` OnDemand | Preemptible),
    ``serviceRegions``, ``pricingInfo[].pricingExpression`` (``usageUnit`` ``h`` or ``GiBy.h``,
    ``tieredRates[].unitPrice`` ``units`` + ``nanos``). GCP bills an accelerator-optimized machine as its
    family's cores and memory plus its GPUs, so a machine type's price is ``vCPUs × "<family> Instance Core"
    + GiB × "<family> Instance Ram" + GPUs × "<GPU> running in …"`` (spot: the ``Spot Preemptible`` SKUs), the
    GPU SKU's price also written as the row's ``gpu_sku_price_per_hour_usd``; the machine types' counts and
    the SKU names come from gpumeter's instance facts. Dated by ``--source-date`` (else the newest
    ``effectiveTime`` of the SKUs used, said so in the notes).
``azure-retail``
    Azure Retail Prices API (``prices.azure.com/api/retail/prices``): ``Items`` with ``armSkuName``,
    ``armRegionName``, ``retailPrice``, ``unitOfMeasure`` ``1 Hour``, ``type`` ``Consumption``, ``productName``
    (``… Series`` is Linux, ``… Series Windows`` is not kept), ``skuName`` (``… Spot`` is spot; ``… Low
    Priority`` only where no Spot price is given), ``isPrimaryMeterRegion``. The latest ``effectiveStartDate``
    wins. Instance facts from gpumeter's. Dated like GCP's.

**Rates** (``prices/rates/``), where the input has what they need: AWS and Azure, per region and price model,
solved from two general-purpose instance types of one generation with different memory per vCPU (``cpu × v +
ram × m = price`` for both; AWS ``c7i.xlarge`` and ``r7i.xlarge``, Azure ``Standard_D4s_v5`` and
``Standard_E4s_v5``: the pairs the bundled rates use), when both are priced in the same document set; GCP, the
chosen machine family's own ``Instance Core`` and ``Instance Ram`` SKUs (default ``A2``, as the bundled GCP
rates: exactly the machine part of an A2 machine), on-demand and spot.

**Instance facts** (``prices/facts/instance_types.csv``): per provider and instance type, the GPU model and count,
vCPUs and GiB, and for GCP the machine family and GPU SKU name -- the facts the price documents themselves do not
carry. Only GPU instance types become price rows (``gpu_count`` ≥ 1); the reference types feed the rates.

Nothing is guessed: a document of another shape, a non-USD price, two different prices for one row, or an AWS
offer whose vCPUs/memory/GPUs disagree with gpumeter's facts is a ``PriceImportError``; what is left out is
counted in ``ImportResult.skipped`` by reason.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from services.billing.catalog import (
    DEFAULT_PRICE_DIR,
    PRICE_COLUMNS,
    RATE_COLUMNS,
    PriceError,
    normalize_provider,
)

DEFAULT_FACTS = DEFAULT_PRICE_DIR / "facts" / "instance_types.csv"
FACT_COLUMNS = ("provider", "instance_type", "gpu_model", "gpu_count", "vcpu_count", "memory_gib",
                "gcp_machine_family", "gcp_gpu_sku", "source", "source_date", "notes")
PRICE_FORMATS = ("aws-offer-json", "aws-offer-csv", "aws-spot", "gcp-skus", "azure-retail")
RATE_PAIRS = {"aws": ("c7i.xlarge", "r7i.xlarge"), "azure": ("Standard_D4s_v5", "Standard_E4s_v5")}
DEFAULT_GCP_RATES_FAMILY = "A2"
_TEN_PLACES = Decimal("1e-10")
_SPOT_DESCRIPTIONS = ("Linux/UNIX", "Linux/UNIX (Amazon VPC)")
# Older offer files name the region only by its location; the regions gpumeter's users run GPUs in.
_AWS_LOCATIONS = {
    "US East (N. Virginia)": "us-east-1", "US East (Ohio)": "us-east-2", "US West (N. California)": "us-west-1",
    "US West (Oregon)": "us-west-2", "Canada (Central)": "ca-central-1", "EU (Ireland)": "eu-west-1",
    "EU (London)": "eu-west-2", "EU (Paris)": "eu-west-3", "EU (Frankfurt)": "eu-central-1",
    "EU (Stockholm)": "eu-north-1", "Asia Pacific (Tokyo)": "ap-northeast-1", "Asia Pacific (Seoul)": "ap-northeast-2",
    "Asia Pacific (Singapore)": "ap-southeast-1", "Asia Pacific (Sydney)": "ap-southeast-2",
    "Asia Pacific (Mumbai)": "ap-south-1", "South America (Sao Paulo)": "sa-east-1",
}
_GCP_SKU = re.compile(r"^(?:Spot Preemptible |Preemptible )?(?P<stem>.+?) running in (?P<geo>.+)$")
_AWS_ZONE = re.compile(r"^(?P<region>[a-z]{2}(?:-gov)?-[a-z]+-\d+)")


class PriceImportError(PriceError):
    """A price document that cannot be imported as it is."""


@dataclass(frozen=True, slots=True)
class InstanceFacts:
    """What an instance type is, beside its price (see the module docstring)."""

    provider: str
    instance_type: str
    gpu_model: str
    gpu_count: int
    vcpu_count: int
    memory_gib: Decimal
    gcp_machine_family: str = ""
    gcp_gpu_sku: str = ""
    source: str = ""


@dataclass(frozen=True, slots=True)
class ImportedPrice:
    provider: str
    region: str
    instance_type: str
    price_model: str
    price_per_hour_usd: Decimal
    facts: InstanceFacts
    source: str
    source_date: str
    notes: str
    gpu_sku_price_per_hour_usd: Decimal | None = None

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.provider, self.region, self.instance_type.lower(), self.price_model)

    def row(self) -> dict[str, str]:
        return {
            "provider": self.provider, "region": self.region, "instance_type": self.instance_type,
            "price_model": self.price_model, "price_per_hour_usd": _text(self.price_per_hour_usd),
            "gpu_model": self.facts.gpu_model, "gpu_count": str(self.facts.gpu_count),
            "vcpu_count": str(self.facts.vcpu_count), "memory_gib": _text(self.facts.memory_gib),
            "gpu_sku_price_per_hour_usd": "" if self.gpu_sku_price_per_hour_usd is None
            else _text(self.gpu_sku_price_per_hour_usd),
            "source": self.source, "source_kind": "list_price", "source_date": self.source_date, "notes": self.notes,
        }


@dataclass(frozen=True, slots=True)
class ImportedRates:
    provider: str
    region: str
    price_model: str
    cpu_usd_per_vcpu_hour: Decimal
    ram_usd_per_gib_hour: Decimal
    derived_from: str
    source: str
    source_date: str
    notes: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.provider, self.region, self.price_model)

    def row(self) -> dict[str, str]:
        return {
            "provider": self.provider, "region": self.region, "price_model": self.price_model,
            "cpu_usd_per_vcpu_hour": _text(self.cpu_usd_per_vcpu_hour),
            "ram_usd_per_gib_hour": _text(self.ram_usd_per_gib_hour), "derived_from": self.derived_from,
            "source": self.source, "source_kind": "list_price", "source_date": self.source_date, "notes": self.notes,
        }


@dataclass
class ImportResult:
    prices: list[ImportedPrice] = field(default_factory=list)
    rates: list[ImportedRates] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    formats: list[tuple[str, str]] = field(default_factory=list)  # (document name, format)

    def skip(self, reason: str, count: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count


def _text(value: Decimal) -> str:
    return format(value.normalize(), "f")


def _decimal(value: Any, what: str, where: str) -> Decimal:
    try:
        number = Decimal(str(value).strip().replace(",", ""))
    except (InvalidOperation, ValueError):
        raise PriceImportError(f"{where}: {what} {value!r} is not a number") from None
    if not number.is_finite() or number < 0:
        raise PriceImportError(f"{where}: {what} {value!r} must be a finite number >= 0")
    return number


# -- instance facts -----------------------------------------------------------------------------------------------


def parse_instance_facts(text: str, origin: str) -> dict[tuple[str, str], InstanceFacts]:
    """The instance facts file (``FACT_COLUMNS``) → {(provider, instance type in lower case): facts}."""
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in FACT_COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise PriceImportError(f"{origin}: missing columns {missing}")
    facts: dict[tuple[str, str], InstanceFacts] = {}
    for line, raw in enumerate(reader, start=2):
        where = f"{origin}:{line}"
        provider = normalize_provider(raw["provider"])
        instance_type = raw["instance_type"].strip()
        key = (provider, instance_type.lower())
        if not provider or not instance_type or key in facts:
            raise PriceImportError(f"{where}: provider and instance_type are required and unique")
        try:
            gpu_count, vcpu_count = int(raw["gpu_count"]), int(raw["vcpu_count"])
        except ValueError:
            raise PriceImportError(f"{where}: gpu_count and vcpu_count must be whole numbers") from None
        facts[key] = InstanceFacts(provider, instance_type, raw["gpu_model"].strip(), gpu_count, vcpu_count,
                                   _decimal(raw["memory_gib"], "memory_gib", where),
                                   raw["gcp_machine_family"].strip(), raw["gcp_gpu_sku"].strip(),
                                   f"{raw['source'].strip()} ({raw['source_date'].strip()})")
    return facts


def load_instance_facts(path: Path = DEFAULT_FACTS) -> dict[tuple[str, str], InstanceFacts]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PriceImportError(f"cannot read instance facts {path}: {exc}") from exc
    return parse_instance_facts(text, Path(path).name)


# -- documents ----------------------------------------------------------------------------------------------------


def detect_price_format(text: str) -> tuple[str, Any]:
    """(format, parsed document) from a document's text (see the module docstring for the shapes)."""
    head = text.lstrip("\ufeff").lstrip()
    if head.startswith('"FormatVersion"') or head.startswith("FormatVersion,"):
        return "aws-offer-csv", head
    try:
        document = json.loads(head)
    except ValueError:
        raise PriceImportError("neither JSON nor an AWS offer CSV (which starts with its FormatVersion row)") from None
    if isinstance(document, Mapping):
        if "products" in document and "terms" in document:
            return "aws-offer-json", document
        if "SpotPriceHistory" in document:
            return "aws-spot", document
        if "skus" in document:
            return "gcp-skus", document
        if "Items" in document:
            return "azure-retail", document
    raise PriceImportError("not a price document gpumeter knows: an AWS offer file (products, terms), AWS spot "
                           "price history (SpotPriceHistory), GCP Cloud Billing Catalog SKUs (skus) or Azure "
                           "Retail Prices (Items)")


@dataclass(frozen=True, slots=True)
class _AwsProduct:
    region: str
    instance_type: str
    vcpu: str
    memory: str
    gpu: str
    price: Decimal
    where: str


def _aws_keep(attributes: Mapping[str, str]) -> str | None:
    """Why an offer product is not a plain Linux on-demand instance (None: it is)."""
    checks = (("operatingSystem", "Linux"), ("tenancy", "Shared"), ("capacitystatus", "Used"),
              ("preInstalledSw", "NA"))
    for name, wanted in checks:
        if attributes.get(name, "") != wanted:
            return f"aws offer: {name} not {wanted}"
    if attributes.get("marketoption", "OnDemand") != "OnDemand":
        return "aws offer: marketoption not OnDemand"
    return None


def _aws_region(attributes: Mapping[str, str]) -> str:
    return (attributes.get("regionCode") or _AWS_LOCATIONS.get(attributes.get("location", ""), "")).lower()


def _aws_offer_json(document: Mapping[str, Any], name: str, result: ImportResult) -> tuple[list[_AwsProduct], str,
                                                                                          str]:
    products = document.get("products") or {}
    on_demand = (document.get("terms") or {}).get("OnDemand") or {}
    out = []
    for sku, product in products.items():
        if product.get("productFamily") not in ("Compute Instance", "Compute Instance (bare metal)"):
            result.skip("aws offer: not a compute instance")
            continue
        attributes = product.get("attributes") or {}
        reason = _aws_keep(attributes)
        if reason:
            result.skip(reason)
            continue
        prices = []
        for term in (on_demand.get(sku) or {}).values():
            for dimension in (term.get("priceDimensions") or {}).values():
                if dimension.get("unit") == "Hrs" and str(dimension.get("beginRange", "0")) == "0":
                    usd = (dimension.get("pricePerUnit") or {}).get("USD")
                    if usd is None:
                        raise PriceImportError(f"{name}: product {sku} has no USD price")
                    prices.append(_decimal(usd, "pricePerUnit.USD", f"{name}: product {sku}"))
        if len(set(prices)) != 1:
            result.skip("aws offer: no single on-demand hourly price")
            continue
        out.append(_AwsProduct(_aws_region(attributes), attributes.get("instanceType", ""),
                               attributes.get("vcpu", ""), attributes.get("memory", ""), attributes.get("gpu", ""),
                               prices[0], f"{name}: product {sku}"))
    version = f"{document.get('offerCode', 'AmazonEC2')} version {document.get('version', '?')}"
    return out, version, str(document.get("publicationDate", ""))[:10]


_CSV_ATTRIBUTES = {"Operating System": "operatingSystem", "Tenancy": "tenancy", "CapacityStatus": "capacitystatus",
                   "Pre Installed S/W": "preInstalledSw", "MarketOption": "marketoption", "Region Code": "regionCode",
                   "Location": "location"}


def _aws_offer_csv(text: str, name: str, result: ImportResult) -> tuple[list[_AwsProduct], str, str]:
    lines = io.StringIO(text)
    reader = csv.reader(lines)
    metadata = {}
    for _ in range(5):
        row = next(reader, None)
        if not row or len(row) < 2:
            raise PriceImportError(f"{name}: an AWS offer CSV starts with five metadata rows")
        metadata[row[0]] = row[1]
    header = next(reader, None) or []
    for column in ("TermType", "Unit", "PricePerUnit", "Currency", "Product Family", "Instance Type", "vCPU",
                   "Memory", "Operating System", "Tenancy"):
        if column not in header:
            raise PriceImportError(f"{name}: the offer CSV has no {column!r} column")
    out = []
    for line, values in enumerate(reader, start=7):
        row = dict(zip(header, values))
        where = f"{name}:{line}"
        if row.get("TermType") != "OnDemand":
            result.skip("aws offer: not the OnDemand term")
            continue
        if row.get("Product Family") not in ("Compute Instance", "Compute Instance (bare metal)"):
            result.skip("aws offer: not a compute instance")
            continue
        attributes = {key: row.get(column, "") for column, key in _CSV_ATTRIBUTES.items()}
        if "MarketOption" not in header:
            attributes.pop("marketoption")
        reason = _aws_keep(attributes)
        if reason:
            result.skip(reason)
            continue
        if row.get("Unit") != "Hrs" or row.get("StartingRange", "0") not in ("0", ""):
            result.skip("aws offer: not an hourly price")
            continue
        if row.get("Currency") != "USD":
            raise PriceImportError(f"{where}: Currency {row.get('Currency')!r}, the catalog is in USD")
        out.append(_AwsProduct(_aws_region(attributes), row.get("Instance Type", ""), row.get("vCPU", ""),
                               row.get("Memory", ""), row.get("GPU", ""),
                               _decimal(row.get("PricePerUnit"), "PricePerUnit", where), where))
    version = f"{metadata.get('OfferCode', 'AmazonEC2')} version {metadata.get('Version', '?')}"
    return out, version, metadata.get("Publication Date", "")[:10]


def _count_attribute(text: str) -> int:
    cleaned = (text or "").strip()
    return int(cleaned) if cleaned.isdigit() else 0


def _aws_offer(products: list[_AwsProduct], version: str, date: str, name: str, kind: str,
               facts: Mapping[tuple[str, str], InstanceFacts], result: ImportResult,
               offer_facts: dict[tuple[str, str], InstanceFacts], reference: dict) -> list[ImportedPrice]:
    if not re.match(r"^\d{4}-\d{2}-\d{2}$", date):
        raise PriceImportError(f"{name}: no publication date in the offer file")
    source = f"AWS Price List Bulk API offer file ({kind}), {version}, published {date}: {name}"
    by_key: dict[tuple[str, str], _AwsProduct] = {}
    for product in products:
        if not product.region:
            result.skip("aws offer: region unknown")
            continue
        key = (product.region, product.instance_type.lower())
        first = by_key.setdefault(key, product)
        if first.price != product.price:
            raise PriceImportError(f"{product.where}: {product.instance_type} in {product.region} costs "
                                   f"{product.price}/h here and {first.price}/h at {first.where}")
    out = []
    for (region, type_lower), product in sorted(by_key.items()):
        known = facts.get(("aws", type_lower))
        gpus = _count_attribute(product.gpu)
        try:
            vcpu = int(product.vcpu)
            memory = _decimal(product.memory.replace("GiB", ""), "memory", product.where)
        except ValueError:
            result.skip("aws offer: vCPU or memory not given")
            continue
        if known is not None and (known.vcpu_count, known.memory_gib, known.gpu_count) != (vcpu, memory, gpus):
            raise PriceImportError(
                f"{product.where}: {product.instance_type} has {vcpu} vCPUs, {memory} GiB and {gpus} GPUs in the "
                f"offer, {known.vcpu_count}, {known.memory_gib} and {known.gpu_count} in gpumeter's instance facts")
        instance = InstanceFacts("aws", product.instance_type, known.gpu_model if known else "", gpus, vcpu, memory,
                                 source="the offer file's product attributes")
        offer_facts[("aws", type_lower)] = instance
        reference[("aws", region, "on_demand", type_lower)] = (instance, product.price, source, date)
        if gpus < 1:
            result.skip("aws offer: not a GPU instance type")
            continue
        out.append(ImportedPrice("aws", region, product.instance_type, "on_demand", product.price, instance, source,
                                 date, "vCPUs, memory and GPU count from the offer's product attributes"
                                 + ("" if known else "; GPU model not in gpumeter's instance facts")))
    return out


def _aws_spot(document: Mapping[str, Any], name: str, facts: Mapping[tuple[str, str], InstanceFacts],
              result: ImportResult, reference: dict) -> list[ImportedPrice]:
    latest: dict[tuple[str, str], tuple[str, Decimal]] = {}
    names: dict[str, str] = {}
    for index, entry in enumerate(document.get("SpotPriceHistory") or []):
        where = f"{name}: SpotPriceHistory[{index}]"
        if entry.get("ProductDescription") not in _SPOT_DESCRIPTIONS:
            result.skip("aws spot: not Linux/UNIX")
            continue
        zone, instance_type = str(entry.get("AvailabilityZone", "")), str(entry.get("InstanceType", ""))
        stamp = str(entry.get("Timestamp", ""))
        try:
            moment = datetime.fromisoformat(stamp.replace("Z", "+00:00")).isoformat()
        except ValueError:
            raise PriceImportError(f"{where}: Timestamp {stamp!r} is not ISO 8601") from None
        price = _decimal(entry.get("SpotPrice"), "SpotPrice", where)
        key = (zone, instance_type.lower())
        names[instance_type.lower()] = instance_type
        if key not in latest or latest[key][0] < moment:
            latest[key] = (moment, price)
    if not latest:
        raise PriceImportError(f"{name}: no Linux/UNIX spot price")
    newest = max(moment for moment, _ in latest.values())
    date = newest[:10]
    by_region: dict[tuple[str, str], list[tuple[str, Decimal]]] = defaultdict(list)
    for (zone, type_lower), (_moment, price) in latest.items():
        match = _AWS_ZONE.match(zone)
        if not match:
            raise PriceImportError(f"{name}: availability zone {zone!r} names no region")
        by_region[(match["region"], type_lower)].append((zone, price))
    source = (f"AWS EC2 DescribeSpotPriceHistory (aws ec2 describe-spot-price-history), Linux/UNIX, the latest "
              f"price of each availability zone as of {newest}: {name}")
    out = []
    for (region, type_lower), zones in sorted(by_region.items()):
        mean = (sum((p for _, p in zones), Decimal(0)) / len(zones)).quantize(_TEN_PLACES, ROUND_HALF_EVEN)
        known = facts.get(("aws", type_lower))
        zones_text = ", ".join(f"{zone} {_text(price)}" for zone, price in sorted(zones))
        if known is None:
            result.skip("aws spot: instance type not in an offer file or gpumeter's instance facts")
            continue
        reference[("aws", region, "spot", type_lower)] = (known, mean, source, date)
        if known.gpu_count < 1:
            result.skip("aws spot: not a GPU instance type")
            continue
        out.append(ImportedPrice("aws", region, names[type_lower], "spot", mean, known, source, date,
                                 f"spot prices vary; the mean over {len(zones)} zones ({zones_text}); instance facts "
                                 f"from {known.source}"))
    return out


def _unit_price(sku: Mapping[str, Any], where: str) -> tuple[Decimal, str, str]:
    """(price per usage unit, usage unit, effective time) of a GCP SKU's current pricing."""
    infos = sku.get("pricingInfo") or []
    if not infos:
        raise PriceImportError(f"{where}: no pricingInfo")
    info = max(infos, key=lambda i: str(i.get("effectiveTime", "")))
    expression = info.get("pricingExpression") or {}
    tiers = sorted(expression.get("tieredRates") or [], key=lambda t: float(t.get("startUsageAmount", 0) or 0))
    if not tiers:
        raise PriceImportError(f"{where}: no tieredRates")
    price = tiers[0].get("unitPrice") or {}
    if price.get("currencyCode", "USD") != "USD":
        raise PriceImportError(f"{where}: priced in {price.get('currencyCode')!r}, the catalog is in USD")
    try:
        value = Decimal(str(price.get("units") or "0")) + Decimal(int(price.get("nanos") or 0)).scaleb(-9)
    except (InvalidOperation, ValueError):
        raise PriceImportError(f"{where}: unitPrice {price!r} is not units + nanos") from None
    return value, str(expression.get("usageUnit", "")), str(info.get("effectiveTime", ""))


def _gcp(document: Mapping[str, Any], name: str, facts: Mapping[tuple[str, str], InstanceFacts],
         result: ImportResult, source_date: str | None, rates_family: str) -> tuple[list[ImportedPrice],
                                                                                   list[ImportedRates]]:
    gcp_types = [f for (provider, _), f in facts.items() if provider == "gcp" and f.gcp_machine_family]
    stems: dict[str, tuple[str, str]] = {}
    for fact in gcp_types:
        stems[f"{fact.gcp_machine_family} Instance Core"] = ("core", fact.gcp_machine_family)
        stems[f"{fact.gcp_machine_family} Instance Ram"] = ("ram", fact.gcp_machine_family)
        if fact.gcp_gpu_sku:
            stems[fact.gcp_gpu_sku] = ("gpu", fact.gcp_gpu_sku)
    rates_family_upper = rates_family.upper()
    stems.setdefault(f"{rates_family_upper} Instance Core", ("core", rates_family_upper))
    stems.setdefault(f"{rates_family_upper} Instance Ram", ("ram", rates_family_upper))
    units = {"core": "h", "ram": "GiBy.h", "gpu": "h"}
    components: dict[tuple[str, str, str, str], tuple[Decimal, str, str]] = {}
    for index, sku in enumerate(document.get("skus") or []):
        where = f"{name}: skus[{index}] {sku.get('skuId', '?')}"
        category = sku.get("category") or {}
        usage_type = category.get("usageType")
        if category.get("resourceFamily") != "Compute" or usage_type not in ("OnDemand", "Preemptible"):
            result.skip("gcp: not on-demand or spot compute")
            continue
        match = _GCP_SKU.match(str(sku.get("description", "")))
        component = stems.get(match["stem"]) if match else None
        if component is None:
            result.skip("gcp: not a SKU of a machine type in gpumeter's instance facts")
            continue
        price, unit, effective = _unit_price(sku, where)
        if unit != units[component[0]]:
            raise PriceImportError(f"{where}: {sku.get('description')!r} is priced per {unit!r}, expected "
                                   f"{units[component[0]]!r}")
        model = "spot" if usage_type == "Preemptible" else "on_demand"
        label = f"{sku.get('description')} ({sku.get('skuId', '?')})"
        for region in sku.get("serviceRegions") or []:
            key = (model, component[0], component[1], str(region).lower())
            if key in components and components[key][0] != price:
                raise PriceImportError(f"{where}: two prices for {key}: {components[key][0]} and {price}")
            components[key] = (price, label, effective)
    used_times = [effective for _, _, effective in components.values() if effective]
    date = source_date or (max(used_times)[:10] if used_times else "")
    if not re.match(r"^\d{4}-\d{2}-\d{2}$", date):
        raise PriceImportError(f"{name}: give --source-date (the SKUs carry no effectiveTime)")
    dated_note = "" if source_date else f"; dated by the SKUs' newest effectiveTime ({date}), not a retrieval date"
    source = f"Google Cloud Billing Catalog API, services/6F81-5844-456A/skus (Compute Engine): {name}"
    regions = sorted({key[3] for key in components})
    prices: list[ImportedPrice] = []
    for fact in sorted(gcp_types, key=lambda f: f.instance_type):
        for model in ("on_demand", "spot"):
            for region in regions:
                core = components.get((model, "core", fact.gcp_machine_family, region))
                ram = components.get((model, "ram", fact.gcp_machine_family, region))
                gpu = components.get((model, "gpu", fact.gcp_gpu_sku, region))
                if core is None or ram is None or gpu is None:
                    continue
                total = fact.vcpu_count * core[0] + fact.memory_gib * ram[0] + fact.gpu_count * gpu[0]
                notes = (f"GCP bills the machine type's {fact.vcpu_count} vCPUs x {_text(core[0])} + "
                         f"{_text(fact.memory_gib)} GiB x {_text(ram[0])} + {fact.gpu_count} GPU x {_text(gpu[0])}: "
                         f"{core[1]}; {ram[1]}; {gpu[1]}; machine counts from {fact.source}{dated_note}")
                prices.append(ImportedPrice("gcp", region, fact.instance_type, model, total, fact, source, date, notes,
                                            gpu_sku_price_per_hour_usd=gpu[0]))
    rates = []
    for model in ("on_demand", "spot"):
        for region in regions:
            core = components.get((model, "core", rates_family_upper, region))
            ram = components.get((model, "ram", rates_family_upper, region))
            if core is None or ram is None:
                continue
            derived = f"the {rates_family_upper} machine family's own vCPU and memory SKUs: {core[1]}; {ram[1]}"
            rates.append(ImportedRates("gcp", region, model, core[0], ram[0], derived, source, date,
                                       dated_note.lstrip("; ")))
    if not prices:
        result.skip("gcp: no machine type with its core, RAM and GPU SKUs all priced in a region")
    return prices, rates


def _azure(document: Mapping[str, Any], name: str, facts: Mapping[tuple[str, str], InstanceFacts],
           result: ImportResult, source_date: str | None, reference: dict) -> list[ImportedPrice]:
    chosen: dict[tuple[str, str, str], tuple[int, str, Decimal, str]] = {}  # (region, type, model) -> best
    names: dict[str, str] = {}
    for index, item in enumerate(document.get("Items") or []):
        where = f"{name}: Items[{index}]"
        if item.get("serviceName", "Virtual Machines") != "Virtual Machines" or item.get("type") != "Consumption":
            result.skip("azure: not a Virtual Machines consumption price")
            continue
        if item.get("unitOfMeasure") != "1 Hour":
            result.skip("azure: not an hourly price")
            continue
        if item.get("currencyCode", "USD") != "USD":
            raise PriceImportError(f"{where}: currencyCode {item.get('currencyCode')!r}, the catalog is in USD")
        if str(item.get("productName", "")).endswith("Windows"):
            result.skip("azure: Windows")
            continue
        if item.get("isPrimaryMeterRegion") is False:
            result.skip("azure: not the primary meter region")
            continue
        arm_sku = str(item.get("armSkuName", ""))
        if ("azure", arm_sku.lower()) not in facts:
            result.skip("azure: VM size not in gpumeter's instance facts")
            continue
        sku_name = f"{item.get('skuName', '')} {item.get('meterName', '')}"
        model, rank = (("spot", 2) if "Spot" in sku_name else ("spot", 1) if "Low Priority" in sku_name
                       else ("on_demand", 2))
        effective = str(item.get("effectiveStartDate", ""))
        price = _decimal(item.get("retailPrice"), "retailPrice", where)
        key = (str(item.get("armRegionName", "")).lower(), arm_sku.lower(), model)
        label = (f"{item.get('productName', '')} / {item.get('skuName', '')} (meterId {item.get('meterId', '?')}, "
                 f"effective {effective[:10] or '?'})")
        names[arm_sku.lower()] = arm_sku
        best = chosen.get(key)
        candidate = (rank, effective, price, label)  # Spot before Low Priority, then the latest price
        if best is not None and best[:2] == candidate[:2] and best[2] != price:
            raise PriceImportError(f"{where}: two prices for {key}: {best[2]} and {price}")
        if best is None or candidate[:2] > best[:2]:
            chosen[key] = candidate
    times = [effective for _rank, effective, *_ in chosen.values() if effective]
    date = source_date or (max(times)[:10] if times else "")
    if not re.match(r"^\d{4}-\d{2}-\d{2}$", date):
        raise PriceImportError(f"{name}: give --source-date (the items carry no effectiveStartDate)")
    dated_note = "" if source_date else f"; dated by the newest effectiveStartDate ({date}), not a retrieval date"
    source = f"Azure Retail Prices API (prices.azure.com/api/retail/prices): {name}"
    out = []
    for (region, type_lower, model), (rank, _effective, price, label) in sorted(chosen.items()):
        fact = facts[("azure", type_lower)]
        reference[("azure", region, model, type_lower)] = (fact, price, source, date)
        if fact.gpu_count < 1:
            continue
        spot_kind = " (Low Priority: no Spot price given)" if model == "spot" and rank == 1 else ""
        out.append(ImportedPrice("azure", region, names[type_lower], model, price, fact, source, date,
                                 f"Linux, pay-as-you-go{spot_kind}: {label}; instance facts from {fact.source}"
                                 f"{dated_note}"))
    return out


def _solved_rates(reference: Mapping[tuple[str, str, str, str], tuple], result: ImportResult) -> list[ImportedRates]:
    """Rates solved from each provider's reference pair, per region and price model where both are priced."""
    out = []
    keys = sorted({(p, r, m) for p, r, m, _ in reference})
    for provider, region, model in keys:
        pair = RATE_PAIRS.get(provider)
        if not pair:
            continue
        first = reference.get((provider, region, model, pair[0].lower()))
        second = reference.get((provider, region, model, pair[1].lower()))
        if first is None or second is None:
            continue
        (f1, p1, source, date), (f2, p2) = first, second[:2]
        v1, m1, v2, m2 = Decimal(f1.vcpu_count), f1.memory_gib, Decimal(f2.vcpu_count), f2.memory_gib
        det = v1 * m2 - v2 * m1
        if det == 0:
            continue
        cpu = ((p1 * m2 - p2 * m1) / det).quantize(Decimal("1e-12"), ROUND_HALF_EVEN)
        ram = ((v1 * p2 - v2 * p1) / det).quantize(Decimal("1e-12"), ROUND_HALF_EVEN)
        if cpu < 0 or ram < 0:
            result.skip(f"{provider} rates: the reference pair gives a negative rate")
            continue
        out.append(ImportedRates(
            provider, region, model, cpu.normalize(), ram.normalize(),
            f"solved from {f1.instance_type} ({f1.vcpu_count} vCPU, {_text(m1)} GiB, {_text(p1)}/h) and "
            f"{f2.instance_type} ({f2.vcpu_count} vCPU, {_text(m2)} GiB, {_text(p2)}/h): cpu x vCPUs + ram x GiB = "
            "price for both", source, date))
    return out


def import_prices(documents: Sequence[tuple[str, str]], facts: Mapping[tuple[str, str], InstanceFacts], *,
                  source_date: str | None = None, regions: Iterable[str] = (),
                  gcp_rates_family: str = DEFAULT_GCP_RATES_FAMILY) -> ImportResult:
    """Price rows and rates from ``documents`` ((name, text) each, any of ``PRICE_FORMATS``). AWS offer files are
    read first, so a spot price history in the same import takes its instance facts from them. ``regions``: keep
    only these (all when empty)."""
    if source_date is not None and not re.match(r"^\d{4}-\d{2}-\d{2}$", source_date):
        raise PriceImportError(f"source date {source_date!r} is not YYYY-MM-DD")
    result = ImportResult()
    parsed = []
    for name, text in documents:
        try:
            fmt, document = detect_price_format(text)
        except PriceImportError as exc:
            raise PriceImportError(f"{name}: {exc}") from None
        result.formats.append((name, fmt))
        parsed.append((name, fmt, document))
    parsed.sort(key=lambda entry: entry[1] not in ("aws-offer-json", "aws-offer-csv"))
    offer_facts: dict[tuple[str, str], InstanceFacts] = {}
    reference: dict[tuple[str, str, str, str], tuple] = {}
    prices: list[ImportedPrice] = []
    rates: list[ImportedRates] = []
    for name, fmt, document in parsed:
        if fmt == "aws-offer-json":
            products, version, date = _aws_offer_json(document, name, result)
            prices += _aws_offer(products, version, date, name, "JSON", facts, result, offer_facts, reference)
        elif fmt == "aws-offer-csv":
            products, version, date = _aws_offer_csv(document, name, result)
            prices += _aws_offer(products, version, date, name, "CSV", facts, result, offer_facts, reference)
        elif fmt == "aws-spot":
            prices += _aws_spot(document, name, {**facts, **offer_facts}, result, reference)
        elif fmt == "gcp-skus":
            gcp_prices, gcp_rates = _gcp(document, name, facts, result, source_date, gcp_rates_family)
            prices += gcp_prices
            rates += gcp_rates
        else:
            prices += _azure(document, name, facts, result, source_date, reference)
    rates += _solved_rates(reference, result)
    wanted = {r.strip().lower() for r in regions if r.strip()}
    seen: dict[tuple, ImportedPrice] = {}
    for price in prices:
        if wanted and price.region not in wanted:
            continue
        first = seen.setdefault(price.key, price)
        if first is not price and first.price_per_hour_usd != price.price_per_hour_usd:
            raise PriceImportError(f"two prices for {price.key}: {first.price_per_hour_usd} ({first.source}) and "
                                   f"{price.price_per_hour_usd} ({price.source})")
    result.prices = sorted(seen.values(), key=lambda p: p.key)
    rate_keys: dict[tuple, ImportedRates] = {}
    for rate in rates:
        if not wanted or rate.region in wanted:
            rate_keys.setdefault(rate.key, rate)
    result.rates = sorted(rate_keys.values(), key=lambda r: r.key)
    return result


def _render(columns: Sequence[str], rows: Iterable[Mapping[str, str]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(row)
    return buffer.getvalue()


def render_price_csv(prices: Iterable[ImportedPrice]) -> str:
    """The catalog's price file (``PRICE_COLUMNS``) of ``prices``."""
    return _render(PRICE_COLUMNS, (p.row() for p in prices))


def render_rates_csv(rates: Iterable[ImportedRates]) -> str:
    """The catalog's rates file (``RATE_COLUMNS``) of ``rates``."""
    return _render(RATE_COLUMNS, (r.row() for r in rates))
