"""The price catalog: cloud list prices from data files, plus an OpenCost-style custom CSV override.

Contracts
---------
* **Bundled price files** (``services/billing/prices/{aws,gcp,azure}.csv``), one row per
  (provider, region, instance type, price model) with the columns of ``PRICE_COLUMNS``. Every row names its
  ``source`` (URL or description), ``source_kind`` (``generated_price_list`` | ``list_price`` |
  ``third_party_transcription`` | ``custom``) and ``source_date`` (``YYYY-MM`` or ``YYYY-MM-DD``).
  ``price_per_hour_usd`` is what the cloud bills for the whole node (the one line item);
  ``gpu_sku_price_per_hour_usd`` is set only where the cloud itself bills GPUs as their own SKU on top of the
  machine (GCP). ``gpu_count``, ``vcpu_count`` and ``memory_gib`` are facts of the instance type and must agree
  across the price models of one instance type.
* **General-purpose rates** (``prices/rates/*.csv``, columns ``RATE_COLUMNS``): per (provider, region, price
  model) what the same provider charges for one vCPU-hour and one GiB-hour of memory on its general-purpose
  machines, each row with how it was derived (``derived_from``), its source and date. The ``marginal`` split
  prices a GPU node's CPU and memory at these rates and gives its GPUs the rest.
* **Custom override CSV** in OpenCost's custom-pricing layout (``EndTimestamp, InstanceID, Region, AssetClass,
  InstanceIDField, InstanceType, MarketPriceHourly, Version``) with optional extension columns ``Provider``,
  ``PriceModel``, ``GpuCount``, ``VCPUs``, ``MemoryGiB``, ``Source``, ``SourceDate``:

  - ``AssetClass=node``: ``MarketPriceHourly`` is the node's hourly price, matched by ``InstanceType`` (the
    instance type) or, with ``InstanceIDField=metadata.name``, by ``InstanceID`` = the node's name.
  - ``AssetClass=gpu``: ``MarketPriceHourly`` is the hourly price of **one** GPU, matched by ``InstanceType`` =
    the GPU model (compared after ``normalize_gpu_model``) or by node name as above. It becomes the per-GPU SKU
    price of the split; on nodes with no node price at all (on-premises) the node costs ``GPUs × that price``.
  - Empty ``Region``, ``Provider`` or ``PriceModel`` match any value. Rows of asset classes gpumeter does not
    price (``pv``, ``disk``, ``lb``, ``network``) are skipped; anything else is a ``PriceError``.
  - ``EndTimestamp`` is accepted and not used (as in OpenCost).

* **Lookup** (``PriceCatalog.quote``): the most specific matching override row wins (node name, then region,
  then provider, then price model given), then the bundled row for the exact (provider, region, instance type,
  price model). A spot price can also be derived from the on-demand row when a spot discount is configured for
  the provider (``spot_discounts``); otherwise a spot or committed price must come from a file or an override —
  no figure is ever invented. A node with no price from any of these raises ``PriceError``.

Matching is case-insensitive for provider, region and instance type. Providers and price models are normalised
(``gce``/``gke``/``google`` → ``gcp``; ``on-demand``/``ondemand``/empty → ``on_demand``; ``preemptible`` →
``spot``; ``reserved``/``cud``/``savings_plan`` → ``committed``).
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path
from typing import Mapping

from gpumeter.errors import GpumeterError

DEFAULT_PRICE_DIR = Path(__file__).with_name("prices")
BUNDLED_PRICE_FILES = ("aws.csv", "gcp.csv", "azure.csv")

PRICE_MODELS = ("on_demand", "spot", "committed")
SOURCE_KINDS = ("generated_price_list", "list_price", "third_party_transcription", "custom")

PRICE_COLUMNS = (
    "provider",
    "region",
    "instance_type",
    "price_model",
    "price_per_hour_usd",
    "gpu_model",
    "gpu_count",
    "vcpu_count",
    "memory_gib",
    "gpu_sku_price_per_hour_usd",
    "source",
    "source_kind",
    "source_date",
    "notes",
)

RATES_DIR_NAME = "rates"
RATE_COLUMNS = (
    "provider",
    "region",
    "price_model",
    "cpu_usd_per_vcpu_hour",
    "ram_usd_per_gib_hour",
    "derived_from",
    "source",
    "source_kind",
    "source_date",
    "notes",
)

OVERRIDE_REQUIRED_COLUMNS = ("AssetClass", "MarketPriceHourly")
OVERRIDE_COLUMNS = (
    "EndTimestamp",
    "InstanceID",
    "Region",
    "AssetClass",
    "InstanceIDField",
    "InstanceType",
    "MarketPriceHourly",
    "Version",
    "Provider",
    "PriceModel",
    "GpuCount",
    "VCPUs",
    "MemoryGiB",
    "Source",
    "SourceDate",
)
_PRICED_ASSET_CLASSES = ("node", "gpu")
_SKIPPED_ASSET_CLASSES = ("pv", "disk", "lb", "loadbalancer", "network")
_NODE_NAME_FIELDS = ("metadata.name",)

_PROVIDER_ALIASES = {
    "gce": "gcp",
    "gke": "gcp",
    "google": "gcp",
    "amazon": "aws",
    "ec2": "aws",
    "eks": "aws",
    "microsoft": "azure",
    "aks": "azure",
}
_PRICE_MODEL_ALIASES = {
    "": "on_demand",
    "on_demand": "on_demand",
    "on-demand": "on_demand",
    "ondemand": "on_demand",
    "regular": "on_demand",
    "standard": "on_demand",
    "spot": "spot",
    "preemptible": "spot",
    "lowpriority": "spot",
    "low_priority": "spot",
    "committed": "committed",
    "reserved": "committed",
    "cud": "committed",
    "savings_plan": "committed",
}
_DATE_RE = re.compile(r"^\d{4}-(0[1-9]|1[0-2])(-(0[1-9]|[12]\d|3[01]))?$")


class PriceError(GpumeterError):
    """A price file or override row that cannot be used, or a node no price covers."""


def normalize_provider(provider: str) -> str:
    """Lower-case provider name with common aliases folded (``gce`` → ``gcp``)."""
    key = (provider or "").strip().lower()
    return _PROVIDER_ALIASES.get(key, key)


def normalize_price_model(price_model: str) -> str:
    """One of ``PRICE_MODELS``; empty means on-demand. Raises ``PriceError`` for anything else."""
    key = (price_model or "").strip().lower().replace(" ", "_")
    try:
        return _PRICE_MODEL_ALIASES[key]
    except KeyError:
        raise PriceError(f"unknown price model {price_model!r}; expected one of {PRICE_MODELS}") from None


def normalize_gpu_model(gpu_model: str) -> str:
    """Comparable GPU model name: lower case, ``nvidia`` prefix dropped, runs of space/``-``/``_`` as one space.

    ``NVIDIA A100-SXM4-40GB`` and ``a100 sxm4 40gb`` compare equal.
    """
    text = (gpu_model or "").strip().lower()
    if text.startswith("nvidia"):
        text = text[len("nvidia"):]
    return " ".join(re.split(r"[\s_\-]+", text)).strip()


def _decimal(value: str, column: str, origin: str, *, required: bool) -> Decimal | None:
    text = (value or "").strip()
    if not text:
        if required:
            raise PriceError(f"{origin}: {column} is empty")
        return None
    try:
        number = Decimal(text)
    except InvalidOperation:
        raise PriceError(f"{origin}: {column} {text!r} is not a number") from None
    if not number.is_finite() or number < 0:
        raise PriceError(f"{origin}: {column} {text!r} must be a finite number >= 0")
    return number


def _count(value: str, column: str, origin: str) -> int | None:
    text = (value or "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise PriceError(f"{origin}: {column} {text!r} must be a whole number >= 1")
    return int(text)


@dataclass(frozen=True, slots=True)
class PriceSource:
    """Where one figure came from: the file and line, the upstream source, its kind and date."""

    origin: str
    source: str
    source_kind: str
    source_date: str

    def describe(self) -> str:
        return f"{self.origin} [{self.source_kind} {self.source_date}] {self.source}"


@dataclass(frozen=True, slots=True)
class CatalogRow:
    """One bundled price row (see the module docstring for the columns' meaning)."""

    provider: str
    region: str
    instance_type: str
    price_model: str
    price_per_hour_usd: Decimal
    gpu_model: str
    gpu_count: int
    vcpu_count: int | None
    memory_gib: Decimal | None
    gpu_sku_price_per_hour_usd: Decimal | None
    source: PriceSource
    notes: str

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.provider, self.region, self.instance_type.lower(), self.price_model)


@dataclass(frozen=True, slots=True)
class OverrideRow:
    """One custom-pricing row. ``match`` is a lower-case instance type (node) or a normalised GPU model (gpu);
    ``node_name`` is set instead when the row targets one node by name."""

    asset_class: str
    match: str
    node_name: str | None
    region: str | None
    provider: str | None
    price_model: str | None
    price_per_hour_usd: Decimal
    gpu_count: int | None
    vcpu_count: int | None
    memory_gib: Decimal | None
    source: PriceSource

    @property
    def key(self) -> tuple:
        return (self.asset_class, self.node_name, self.match, self.region, self.provider, self.price_model)

    def specificity(self) -> tuple[bool, bool, bool, bool]:
        return (self.node_name is not None, self.region is not None, self.provider is not None,
                self.price_model is not None)

    def matches(self, *, node_name: str, target: str, region: str, provider: str, price_model: str) -> bool:
        if self.node_name is not None:
            if self.node_name != node_name:
                return False
        elif self.match != target:
            return False
        return (
            (self.region is None or self.region == region)
            and (self.provider is None or self.provider == provider)
            and (self.price_model is None or self.price_model == price_model)
        )


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """Facts of an instance type the split rules need (from the bundled rows or an override)."""

    gpu_count: int | None = None
    vcpu_count: int | None = None
    memory_gib: Decimal | None = None
    gpu_model: str = ""


@dataclass(frozen=True, slots=True)
class GeneralPurposeRates:
    """One rates row: a provider's general-purpose vCPU-hour and GiB-hour prices in one region and price model."""

    provider: str
    region: str
    price_model: str
    cpu_usd_per_vcpu_hour: Decimal
    ram_usd_per_gib_hour: Decimal
    derived_from: str
    source: PriceSource

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.provider, self.region, self.price_model)


@dataclass(frozen=True, slots=True)
class MarginalRates:
    """The CPU and memory rates a node's ``marginal`` split uses (each rate × ``scale``, exact), and how they were
    obtained for this node."""

    cpu_usd_per_vcpu_hour: Decimal
    ram_usd_per_gib_hour: Decimal
    derivation: str
    sources: tuple[PriceSource, ...]
    scale: Fraction = Fraction(1)


@dataclass(frozen=True, slots=True)
class PriceQuote:
    """What the catalog knows about one node's price. At least one of the two prices is set.

    ``node_price_per_hour_usd`` is the node's whole line item per hour (None: no node price, e.g. an on-premises
    node priced per GPU only); ``gpu_sku_price_per_hour_usd`` is the price of one GPU where the cloud or an
    override prices GPUs on their own. ``sources`` lists every row that contributed; ``derivation`` says how a
    figure was derived when it was not read as is (e.g. a configured spot discount).
    """

    provider: str
    region: str
    instance_type: str
    price_model: str
    node_price_per_hour_usd: Decimal | None
    gpu_sku_price_per_hour_usd: Decimal | None
    spec: InstanceSpec
    sources: tuple[PriceSource, ...]
    derivation: str = ""
    marginal: MarginalRates | None = None


def parse_rates_csv(text: str, origin: str) -> tuple[GeneralPurposeRates, ...]:
    """Parse and validate one general-purpose rates file (``RATE_COLUMNS``)."""
    reader = csv.DictReader(io.StringIO(text))
    header = tuple(reader.fieldnames or ())
    missing = [c for c in RATE_COLUMNS if c not in header]
    if missing:
        raise PriceError(f"{origin}: missing columns {missing}")
    rows: list[GeneralPurposeRates] = []
    for line_number, raw in enumerate(reader, start=2):
        where = f"{origin}:{line_number}"
        if None in raw or any(v is None for v in raw.values()):
            raise PriceError(f"{where}: wrong number of fields")
        provider = normalize_provider(raw["provider"])
        region = raw["region"].strip().lower()
        if not provider or not region:
            raise PriceError(f"{where}: provider and region are required")
        cpu = _decimal(raw["cpu_usd_per_vcpu_hour"], "cpu_usd_per_vcpu_hour", where, required=True)
        ram = _decimal(raw["ram_usd_per_gib_hour"], "ram_usd_per_gib_hour", where, required=True)
        assert cpu is not None and ram is not None
        if not raw["derived_from"].strip():
            raise PriceError(f"{where}: derived_from is empty; every rate says how it was obtained")
        rows.append(GeneralPurposeRates(
            provider=provider, region=region, price_model=normalize_price_model(raw["price_model"]),
            cpu_usd_per_vcpu_hour=cpu, ram_usd_per_gib_hour=ram, derived_from=raw["derived_from"].strip(),
            source=_source(raw, where),
        ))
    return tuple(rows)


def _source(raw: Mapping[str, str], where: str) -> PriceSource:
    source_text = raw["source"].strip()
    source_kind = raw["source_kind"].strip()
    source_date = raw["source_date"].strip()
    if not source_text:
        raise PriceError(f"{where}: source is empty; every price row names where it came from")
    if source_kind not in SOURCE_KINDS:
        raise PriceError(f"{where}: source_kind {source_kind!r} is not one of {SOURCE_KINDS}")
    if not _DATE_RE.match(source_date):
        raise PriceError(f"{where}: source_date {source_date!r} is not YYYY-MM or YYYY-MM-DD")
    return PriceSource(where, source_text, source_kind, source_date)


def load_rates_dir(price_dir: Path = DEFAULT_PRICE_DIR) -> tuple[GeneralPurposeRates, ...]:
    """Every ``rates/*.csv`` under ``price_dir`` (none is fine: the marginal split is then not available)."""
    rows: list[GeneralPurposeRates] = []
    for path in sorted((Path(price_dir) / RATES_DIR_NAME).glob("*.csv")):
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PriceError(f"cannot read rates file {path}: {exc}") from exc
        rows.extend(parse_rates_csv(text, f"{RATES_DIR_NAME}/{path.name}"))
    return tuple(rows)


def parse_price_csv(text: str, origin: str) -> tuple[CatalogRow, ...]:
    """Parse and validate one bundled-format price file. ``origin`` names it in errors (``aws.csv``)."""
    reader = csv.DictReader(io.StringIO(text))
    header = tuple(reader.fieldnames or ())
    missing = [c for c in PRICE_COLUMNS if c not in header]
    if missing:
        raise PriceError(f"{origin}: missing columns {missing}")
    rows: list[CatalogRow] = []
    for line_number, raw in enumerate(reader, start=2):
        where = f"{origin}:{line_number}"
        if None in raw or any(v is None for v in raw.values()):
            raise PriceError(f"{where}: wrong number of fields")
        provider = normalize_provider(raw["provider"])
        region = raw["region"].strip().lower()
        instance_type = raw["instance_type"].strip()
        if not provider or not region or not instance_type:
            raise PriceError(f"{where}: provider, region and instance_type are required")
        price_model = normalize_price_model(raw["price_model"])
        price = _decimal(raw["price_per_hour_usd"], "price_per_hour_usd", where, required=True)
        gpu_count = _count(raw["gpu_count"], "gpu_count", where)
        if gpu_count is None:
            raise PriceError(f"{where}: gpu_count is required")
        sku = _decimal(raw["gpu_sku_price_per_hour_usd"], "gpu_sku_price_per_hour_usd", where, required=False)
        assert price is not None
        if sku is not None and sku * gpu_count > price:
            raise PriceError(
                f"{where}: {gpu_count} GPUs x {sku}/h exceed the node price {price}/h; the GPU SKU price is part of "
                "the node's line item"
            )
        source = _source(raw, where)
        rows.append(
            CatalogRow(
                provider=provider,
                region=region,
                instance_type=instance_type,
                price_model=price_model,
                price_per_hour_usd=price,
                gpu_model=raw["gpu_model"].strip(),
                gpu_count=gpu_count,
                vcpu_count=_count(raw["vcpu_count"], "vcpu_count", where),
                memory_gib=_decimal(raw["memory_gib"], "memory_gib", where, required=False),
                gpu_sku_price_per_hour_usd=sku,
                source=source,
                notes=raw["notes"].strip(),
            )
        )
    return tuple(rows)


def parse_override_csv(text: str, origin: str) -> tuple[OverrideRow, ...]:
    """Parse and validate an OpenCost-style custom pricing CSV (see the module docstring)."""
    reader = csv.DictReader(io.StringIO(text))
    by_lower = {name.strip().lower(): name for name in (reader.fieldnames or ())}
    missing = [c for c in OVERRIDE_REQUIRED_COLUMNS if c.lower() not in by_lower]
    if missing:
        raise PriceError(f"{origin}: missing columns {missing}")
    unknown = sorted(set(by_lower) - {c.lower() for c in OVERRIDE_COLUMNS})
    if unknown:
        raise PriceError(f"{origin}: unknown columns {unknown}; known: {list(OVERRIDE_COLUMNS)}")
    rows: list[OverrideRow] = []
    for line_number, raw in enumerate(reader, start=2):
        where = f"{origin}:{line_number}"
        if None in raw:
            raise PriceError(f"{where}: more fields than columns")

        def get(column: str) -> str:
            name = by_lower.get(column.lower())
            return (raw.get(name) or "").strip() if name else ""

        if not any(v.strip() for v in raw.values() if v):
            continue
        asset_class = get("AssetClass").lower()
        if asset_class in _SKIPPED_ASSET_CLASSES:
            continue
        if asset_class not in _PRICED_ASSET_CLASSES:
            raise PriceError(f"{where}: AssetClass {asset_class!r} is not one of {_PRICED_ASSET_CLASSES}")
        instance_id, id_field = get("InstanceID"), get("InstanceIDField")
        node_name: str | None = None
        if instance_id:
            if id_field not in _NODE_NAME_FIELDS:
                raise PriceError(
                    f"{where}: InstanceIDField {id_field!r} is not supported; gpumeter matches one node by "
                    f"{_NODE_NAME_FIELDS[0]} (InstanceID = node name) or a type by InstanceType"
                )
            node_name = instance_id
        instance_type = get("InstanceType")
        if node_name is None and not instance_type:
            raise PriceError(f"{where}: a row needs InstanceType (instance type or GPU model) or InstanceID")
        match = normalize_gpu_model(instance_type) if asset_class == "gpu" else instance_type.lower()
        price = _decimal(get("MarketPriceHourly"), "MarketPriceHourly", where, required=True)
        assert price is not None
        source_date = get("SourceDate")
        if source_date and not _DATE_RE.match(source_date):
            raise PriceError(f"{where}: SourceDate {source_date!r} is not YYYY-MM or YYYY-MM-DD")
        version = get("Version")
        source_text = get("Source") or f"custom price override{f' version {version}' if version else ''}"
        rows.append(
            OverrideRow(
                asset_class=asset_class,
                match=match,
                node_name=node_name,
                region=get("Region").lower() or None,
                provider=normalize_provider(get("Provider")) or None,
                price_model=normalize_price_model(get("PriceModel")) if get("PriceModel") else None,
                price_per_hour_usd=price,
                gpu_count=_count(get("GpuCount"), "GpuCount", where),
                vcpu_count=_count(get("VCPUs"), "VCPUs", where),
                memory_gib=_decimal(get("MemoryGiB"), "MemoryGiB", where, required=False),
                source=PriceSource(where, source_text, "custom", source_date or "unknown"),
            )
        )
    return tuple(rows)


def load_price_dir(price_dir: Path = DEFAULT_PRICE_DIR) -> tuple[CatalogRow, ...]:
    """Every ``*.csv`` in ``price_dir`` (the bundled files by default), parsed and validated."""
    paths = sorted(Path(price_dir).glob("*.csv"))
    if not paths:
        raise PriceError(f"no price files (*.csv) in {price_dir}")
    rows: list[CatalogRow] = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PriceError(f"cannot read price file {path}: {exc}") from exc
        rows.extend(parse_price_csv(text, path.name))
    return tuple(rows)


def load_override_csv(path: Path) -> tuple[OverrideRow, ...]:
    """The override rows of one custom pricing CSV file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PriceError(f"cannot read price override {path}: {exc}") from exc
    return parse_override_csv(text, Path(path).name)


def parse_spot_discounts(text: str) -> dict[str, Decimal]:
    """``"aws=0.6,azure=0.5"`` → {provider: discount}; each discount is a fraction in [0, 1)."""
    discounts: dict[str, Decimal] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        provider, sep, value = item.partition("=")
        if not sep:
            raise PriceError(f"spot discount {item!r} is not provider=fraction")
        discount = _decimal(value, f"spot discount for {provider}", "configuration", required=True)
        assert discount is not None
        if discount >= 1:
            raise PriceError(f"spot discount for {provider} must be below 1, got {discount}")
        discounts[normalize_provider(provider)] = discount
    return discounts


@dataclass(frozen=True)
class PriceCatalog:
    """Validated price rows and override rows with the lookup described in the module docstring."""

    rows: tuple[CatalogRow, ...]
    overrides: tuple[OverrideRow, ...] = ()
    spot_discounts: Mapping[str, Decimal] = field(default_factory=dict)
    rates: tuple[GeneralPurposeRates, ...] = ()
    _by_key: dict = field(init=False, repr=False, compare=False)
    _specs: dict = field(init=False, repr=False, compare=False)
    _rates: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_key: dict[tuple[str, str, str, str], CatalogRow] = {}
        specs: dict[tuple[str, str], CatalogRow] = {}
        for row in self.rows:
            if row.key in by_key:
                raise PriceError(f"{row.source.origin}: duplicate price for {row.key} (first at "
                                 f"{by_key[row.key].source.origin})")
            by_key[row.key] = row
            spec_key = (row.provider, row.instance_type.lower())
            first = specs.setdefault(spec_key, row)
            if (first.gpu_count, first.vcpu_count, first.memory_gib) != (row.gpu_count, row.vcpu_count,
                                                                          row.memory_gib):
                raise PriceError(f"{row.source.origin}: instance facts of {row.instance_type} disagree with "
                                 f"{first.source.origin}")
        seen: dict[tuple, OverrideRow] = {}
        for row in self.overrides:
            if row.key in seen:
                raise PriceError(f"{row.source.origin}: duplicate override (first at {seen[row.key].source.origin})")
            seen[row.key] = row
        for provider, discount in self.spot_discounts.items():
            if not (0 <= discount < 1):
                raise PriceError(f"spot discount for {provider} must be in [0, 1), got {discount}")
        rates: dict[tuple[str, str, str], GeneralPurposeRates] = {}
        for rate in self.rates:
            if rate.key in rates:
                raise PriceError(f"{rate.source.origin}: duplicate rates for {rate.key} (first at "
                                 f"{rates[rate.key].source.origin})")
            rates[rate.key] = rate
        object.__setattr__(self, "_by_key", by_key)
        object.__setattr__(self, "_specs", specs)
        object.__setattr__(self, "_rates", rates)

    @classmethod
    def load(
        cls,
        price_dir: Path | None = None,
        override_csv: Path | None = None,
        *,
        spot_discounts: Mapping[str, Decimal] | None = None,
    ) -> "PriceCatalog":
        """The bundled price files (or ``price_dir``) and their general-purpose rates, plus an optional override
        file and spot discounts."""
        directory = price_dir or DEFAULT_PRICE_DIR
        rows = load_price_dir(directory)
        overrides = load_override_csv(override_csv) if override_csv else ()
        return cls(rows, overrides, dict(spot_discounts or {}), load_rates_dir(directory))

    def with_overrides(self, overrides: tuple[OverrideRow, ...]) -> "PriceCatalog":
        """This catalog with ``overrides`` (parsed custom-pricing rows) in place of its own."""
        return PriceCatalog(self.rows, tuple(overrides), dict(self.spot_discounts), self.rates)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "PriceCatalog":
        """Read ``GPUMETER_BILLING_PRICE_DIR``, ``GPUMETER_BILLING_PRICE_OVERRIDE_CSV`` and
        ``GPUMETER_BILLING_SPOT_DISCOUNTS`` (``aws=0.6,azure=0.5``) from ``env``."""
        price_dir = env.get("GPUMETER_BILLING_PRICE_DIR")
        override = env.get("GPUMETER_BILLING_PRICE_OVERRIDE_CSV")
        return cls.load(
            Path(price_dir) if price_dir else None,
            Path(override) if override else None,
            spot_discounts=parse_spot_discounts(env.get("GPUMETER_BILLING_SPOT_DISCOUNTS", "")),
        )

    def row(self, provider: str, region: str, instance_type: str, price_model: str) -> CatalogRow | None:
        """The bundled row for exactly these node facts, or None."""
        key = (normalize_provider(provider), region.strip().lower(), instance_type.strip().lower(),
               normalize_price_model(price_model))
        return self._by_key.get(key)

    def _best_override(self, asset_class: str, **facts: str) -> OverrideRow | None:
        candidates = [o for o in self.overrides if o.asset_class == asset_class and o.matches(**facts)]
        return max(candidates, key=OverrideRow.specificity, default=None)

    def quote(
        self,
        *,
        provider: str,
        region: str,
        instance_type: str,
        price_model: str,
        node_name: str = "",
        gpu_model: str = "",
    ) -> PriceQuote:
        """The price of one node as the catalog knows it; ``PriceError`` when nothing prices it."""
        provider_n = normalize_provider(provider)
        region_n = region.strip().lower()
        type_n = instance_type.strip().lower()
        model_n = normalize_price_model(price_model)
        facts = dict(node_name=node_name, region=region_n, provider=provider_n, price_model=model_n)
        node_override = self._best_override("node", target=type_n, **facts)
        gpu_override = self._best_override("gpu", target=normalize_gpu_model(gpu_model), **facts)
        listed = self._by_key.get((provider_n, region_n, type_n, model_n))
        spec_row = self._specs.get((provider_n, type_n))
        spec = InstanceSpec(
            gpu_count=spec_row.gpu_count if spec_row else None,
            vcpu_count=spec_row.vcpu_count if spec_row else None,
            memory_gib=spec_row.memory_gib if spec_row else None,
            gpu_model=spec_row.gpu_model if spec_row else gpu_model,
        )
        sources: list[PriceSource] = []
        derivation = ""
        node_price: Decimal | None = None
        sku: Decimal | None = None
        if node_override is not None:
            node_price = node_override.price_per_hour_usd
            sources.append(node_override.source)
            spec = InstanceSpec(
                gpu_count=node_override.gpu_count or spec.gpu_count,
                vcpu_count=node_override.vcpu_count or spec.vcpu_count,
                memory_gib=node_override.memory_gib if node_override.memory_gib is not None else spec.memory_gib,
                gpu_model=spec.gpu_model,
            )
        elif listed is not None:
            node_price = listed.price_per_hour_usd
            sku = listed.gpu_sku_price_per_hour_usd
            sources.append(listed.source)
        elif model_n == "spot" and provider_n in self.spot_discounts:
            on_demand = self._by_key.get((provider_n, region_n, type_n, "on_demand"))
            if on_demand is not None:
                keep = 1 - self.spot_discounts[provider_n]
                node_price = on_demand.price_per_hour_usd * keep
                if on_demand.gpu_sku_price_per_hour_usd is not None:
                    sku = on_demand.gpu_sku_price_per_hour_usd * keep
                sources.append(on_demand.source)
                derivation = f"spot = on_demand x (1 - {self.spot_discounts[provider_n]}) (configured discount)"
        if gpu_override is not None:
            sku = gpu_override.price_per_hour_usd
            sources.append(gpu_override.source)
        if node_price is None and sku is None:
            raise PriceError(
                f"no {model_n} price for {provider_n or '?'}/{region_n or '?'}/{instance_type or '?'}"
                f"{f' (node {node_name})' if node_name else ''}: add an AssetClass=node row (or an AssetClass=gpu "
                "row for the GPU model) to the custom price CSV"
                + (", or configure a spot discount for the provider" if model_n == "spot" else "")
            )
        return PriceQuote(
            provider=provider_n,
            region=region_n,
            instance_type=instance_type.strip(),
            price_model=model_n,
            node_price_per_hour_usd=node_price,
            gpu_sku_price_per_hour_usd=sku,
            spec=spec,
            sources=tuple(sources),
            derivation=derivation,
            marginal=self._marginal_rates(provider_n, region_n, type_n, model_n, node_price),
        )

    def _marginal_rates(self, provider: str, region: str, instance_type: str, price_model: str,
                        node_price: Decimal | None) -> MarginalRates | None:
        """The general-purpose rates for this node: the listed ones for its price model; else the on-demand ones
        scaled by this node's price over its on-demand list price (its spot or committed discount applies to
        the whole machine, CPU and memory included); None when neither is known."""
        listed = self._rates.get((provider, region, price_model))
        if listed is not None:
            return MarginalRates(listed.cpu_usd_per_vcpu_hour, listed.ram_usd_per_gib_hour,
                                 f"{price_model} general-purpose rates: {listed.derived_from}", (listed.source,))
        on_demand = self._rates.get((provider, region, "on_demand"))
        list_row = self._by_key.get((provider, region, instance_type, "on_demand"))
        if on_demand is None or list_row is None or node_price is None or not list_row.price_per_hour_usd:
            return None
        return MarginalRates(
            on_demand.cpu_usd_per_vcpu_hour, on_demand.ram_usd_per_gib_hour,
            f"on-demand general-purpose rates x {node_price}/{list_row.price_per_hour_usd} (this node's price over "
            f"its on-demand list price): {on_demand.derived_from}",
            (on_demand.source, list_row.source),
            Fraction(node_price) / Fraction(list_row.price_per_hour_usd),
        )


def bundled_catalog() -> PriceCatalog:
    """The bundled price files with no override."""
    return PriceCatalog.load()

