"""How a node's hourly price splits into its GPUs and the rest (``node_other``). Pure; exact rationals.

The cloud bills a GPU node as one line item (AWS, Azure) or as a machine plus GPUs billed per GPU-hour on top
(GCP). gpumeter divides that line item into ``gpu_count`` equal per-GPU parts and one ``node_other`` part, so that
``node = gpu_count × gpu + node_other`` holds exactly (``fractions.Fraction``). The rule is chosen by
``SplitPolicy.rule``:

``auto`` (default)
    ``sku`` when the price has a per-GPU SKU figure (the cloud's own GPU line, or an ``AssetClass=gpu``
    override); otherwise ``marginal`` when the instance's vCPU and memory counts and the provider's
    general-purpose rates for its region are known; otherwise ``weights`` when the counts are known; otherwise
    ``gpu_fraction``.
``sku``
    GPU part = ``gpu_count × SKU price``; the rest is ``node_other``. A SKU total above the node price is a
    ``PriceError``.
``marginal``
    The node's CPU and memory cost what the same provider charges for them on its general-purpose machines in
    the same region (``prices/rates/``, each rate with its derivation and date; for spot and committed nodes the
    on-demand rates scaled by the node's own discount): ``node_other = vCPUs × cpu rate + GiB × ram rate``; the
    GPUs get the rest. This is what a FinOps team means by "the GPU premium": on a p5.48xlarge the GPUs carry
    74 % of the price, not the 34 % OpenCost's default weights give them. A CPU-and-memory part above the node
    price is a ``PriceError``.
``weights``
    OpenCost's default unit prices used as weights: CPU 0.031611 per vCPU-hour, RAM 0.004237 per GiB-hour, GPU
    0.95 per GPU-hour (configurable). GPU part = node × g·W_gpu / (c·W_cpu + m·W_ram + g·W_gpu).
``gpu_fraction``
    A fixed share of the node price goes to the GPUs; default 0.70, the share Grafana's cloudcost-exporter uses.
``gpu_only`` (never configured; chosen when a node has no node price but a per-GPU price, e.g. on-premises)
    node = ``gpu_count × GPU price``; ``node_other`` is 0.

Billing is per second: over ``s`` seconds a rate ``r`` per hour costs ``r × s / 3600`` (``costing`` applies it to
the node's covered seconds, kept to the millisecond). A MIG instance costs ``gpu_fraction`` of its physical GPU's
part, so the instances of one GPU plus its unassigned capacity cost exactly that GPU.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Mapping

from gpumeter.errors import ConfigError
from services.billing.catalog import PriceCatalog, PriceError, PriceQuote, PriceSource

SECONDS_PER_HOUR = 3600
MICRO_USD_PER_USD = 1_000_000

OPENCOST_CPU_USD_PER_VCPU_HOUR = Decimal("0.031611")
OPENCOST_RAM_USD_PER_GIB_HOUR = Decimal("0.004237")
OPENCOST_GPU_USD_PER_GPU_HOUR = Decimal("0.95")
DEFAULT_GPU_FRACTION = Decimal("0.70")


class SplitRule(enum.StrEnum):
    SKU = "sku"
    MARGINAL = "marginal"
    WEIGHTS = "weights"
    GPU_FRACTION = "gpu_fraction"
    GPU_ONLY = "gpu_only"


CONFIGURABLE_RULES = ("auto", SplitRule.SKU.value, SplitRule.MARGINAL.value, SplitRule.WEIGHTS.value,
                      SplitRule.GPU_FRACTION.value)


@dataclass(frozen=True, slots=True)
class SplitPolicy:
    """Which split rule applies and its parameters (see the module docstring)."""

    rule: str = "auto"
    cpu_usd_per_vcpu_hour: Decimal = OPENCOST_CPU_USD_PER_VCPU_HOUR
    ram_usd_per_gib_hour: Decimal = OPENCOST_RAM_USD_PER_GIB_HOUR
    gpu_usd_per_gpu_hour: Decimal = OPENCOST_GPU_USD_PER_GPU_HOUR
    gpu_fraction: Decimal = DEFAULT_GPU_FRACTION

    def __post_init__(self) -> None:
        if self.rule not in CONFIGURABLE_RULES:
            raise ConfigError(f"split rule {self.rule!r} is not one of {CONFIGURABLE_RULES}")
        if not (0 <= self.gpu_fraction <= 1):
            raise ConfigError(f"GPU fraction must be within [0, 1], got {self.gpu_fraction}")
        weights = (self.cpu_usd_per_vcpu_hour, self.ram_usd_per_gib_hour, self.gpu_usd_per_gpu_hour)
        if any(w < 0 for w in weights) or self.gpu_usd_per_gpu_hour == 0:
            raise ConfigError("split weights must be >= 0 and the GPU weight > 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "SplitPolicy":
        """``GPUMETER_BILLING_SPLIT_RULE`` (auto|sku|marginal|weights|gpu_fraction), ``GPUMETER_BILLING_GPU_FRACTION``,
        ``GPUMETER_BILLING_SPLIT_WEIGHTS`` (``cpu=0.031611,ram=0.004237,gpu=0.95``)."""
        values: dict[str, object] = {}
        if env.get("GPUMETER_BILLING_SPLIT_RULE"):
            values["rule"] = env["GPUMETER_BILLING_SPLIT_RULE"].strip().lower()
        if env.get("GPUMETER_BILLING_GPU_FRACTION"):
            values["gpu_fraction"] = _config_decimal(env["GPUMETER_BILLING_GPU_FRACTION"], "GPU fraction")
        names = {"cpu": "cpu_usd_per_vcpu_hour", "ram": "ram_usd_per_gib_hour", "gpu": "gpu_usd_per_gpu_hour"}
        for item in filter(None, (p.strip() for p in env.get("GPUMETER_BILLING_SPLIT_WEIGHTS", "").split(","))):
            name, sep, value = item.partition("=")
            if not sep or name.strip() not in names:
                raise ConfigError(f"split weight {item!r} is not cpu=|ram=|gpu=<number>")
            values[names[name.strip()]] = _config_decimal(value, f"{name} weight")
        return cls(**values)  # type: ignore[arg-type]


def _config_decimal(text: str, what: str) -> Decimal:
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        raise ConfigError(f"{what} {text!r} is not a number") from None
    if not value.is_finite():
        raise ConfigError(f"{what} {text!r} is not finite")
    return value


DEFAULT_SPLIT_POLICY = SplitPolicy()


def _fraction_text(value: Fraction, places: int = 12) -> str:
    """A rational as a decimal string, rounded half-even to ``places`` (for display and the ledger)."""
    quantum = Decimal(1).scaleb(-places)
    return str((Decimal(value.numerator) / Decimal(value.denominator)).quantize(quantum))


@dataclass(frozen=True, slots=True)
class NodePrice:
    """One node's hourly rate and its exact split: ``node = gpu_count × gpu + node_other`` (USD per hour).

    ``price_version`` identifies the rows and rule used (provider, region, type, model, source dates, rule and a
    digest of every figure), so a ledger line can be traced back to the price that made it.
    """

    provider: str
    region: str
    instance_type: str
    price_model: str
    node_usd_per_hour: Fraction
    gpu_count: int
    gpu_usd_per_hour: Fraction
    node_other_usd_per_hour: Fraction
    split_rule: SplitRule
    sources: tuple[PriceSource, ...]
    derivation: str = ""
    price_version: str = ""

    def __post_init__(self) -> None:
        if self.gpu_count < 1:
            raise PriceError(f"a priced node has at least one GPU, got {self.gpu_count}")
        if self.gpu_usd_per_hour < 0 or self.node_other_usd_per_hour < 0:
            raise PriceError("GPU and node_other rates cannot be negative")
        if self.gpu_count * self.gpu_usd_per_hour + self.node_other_usd_per_hour != self.node_usd_per_hour:
            raise PriceError("GPU parts and node_other do not add up to the node price")
        if not self.price_version:
            object.__setattr__(self, "price_version", self._version_id())

    def _version_id(self) -> str:
        canonical = "|".join(
            [
                self.provider, self.region, self.instance_type, self.price_model,
                str(self.node_usd_per_hour), str(self.gpu_count), str(self.gpu_usd_per_hour),
                str(self.node_other_usd_per_hour), self.split_rule.value, self.derivation,
                *(f"{s.origin}|{s.source}|{s.source_date}" for s in self.sources),
            ]
        )
        digest = hashlib.sha256(canonical.encode()).hexdigest()[:12]
        dates = "+".join(sorted({s.source_date for s in self.sources})) or "undated"
        return (f"{self.provider or '-'}:{self.region or '-'}:{self.instance_type or '-'}:{self.price_model}"
                f"@{dates}/{self.split_rule.value}-{digest}")

    @property
    def price_per_hour_usd_text(self) -> str:
        return _fraction_text(self.node_usd_per_hour)

    def describe(self) -> dict[str, str | int]:
        """Flat, printable view (what the ledger's ``price_versions`` table stores)."""
        return {
            "price_version": self.price_version,
            "provider": self.provider,
            "region": self.region,
            "instance_type": self.instance_type,
            "price_model": self.price_model,
            "price_per_hour_usd": _fraction_text(self.node_usd_per_hour),
            "gpu_count": self.gpu_count,
            "gpu_price_per_hour_usd": _fraction_text(self.gpu_usd_per_hour),
            "node_other_price_per_hour_usd": _fraction_text(self.node_other_usd_per_hour),
            "split_rule": self.split_rule.value,
            "derivation": self.derivation,
            "sources": "; ".join(s.describe() for s in self.sources),
        }


def split_node_price(
    quote: PriceQuote, *, observed_gpu_count: int, policy: SplitPolicy = DEFAULT_SPLIT_POLICY
) -> NodePrice:
    """Split ``quote`` by ``policy``. ``observed_gpu_count`` (physical GPUs seen in the window) is used only when
    the catalog does not know the instance's GPU count."""
    gpu_count = quote.spec.gpu_count or observed_gpu_count
    if gpu_count < 1:
        raise PriceError(f"{quote.instance_type}: unknown GPU count and no GPU observed")
    sku = Fraction(quote.gpu_sku_price_per_hour_usd) if quote.gpu_sku_price_per_hour_usd is not None else None
    common = dict(
        provider=quote.provider, region=quote.region, instance_type=quote.instance_type,
        price_model=quote.price_model, gpu_count=gpu_count, sources=quote.sources, derivation=quote.derivation,
    )
    if quote.node_price_per_hour_usd is None:
        assert sku is not None
        return NodePrice(node_usd_per_hour=gpu_count * sku, gpu_usd_per_hour=sku,
                         node_other_usd_per_hour=Fraction(0), split_rule=SplitRule.GPU_ONLY, **common)
    node = Fraction(quote.node_price_per_hour_usd)
    rule = policy.rule
    counts_known = quote.spec.vcpu_count is not None and quote.spec.memory_gib is not None
    derivation = quote.derivation
    if rule == "auto":
        if sku is not None:
            rule = SplitRule.SKU
        elif counts_known and quote.marginal is not None and _marginal_part(quote) < node:
            rule = SplitRule.MARGINAL
        elif counts_known:
            rule = SplitRule.WEIGHTS
        else:
            rule = SplitRule.GPU_FRACTION
    rule = SplitRule(rule)
    sources = quote.sources
    if rule is SplitRule.SKU:
        if sku is None:
            raise PriceError(f"{quote.instance_type}: split rule 'sku' but no per-GPU SKU price is known")
        gpu_part = gpu_count * sku
        if gpu_part > node:
            raise PriceError(
                f"{quote.instance_type}: {gpu_count} GPUs x {quote.gpu_sku_price_per_hour_usd}/h exceed the node "
                f"price {quote.node_price_per_hour_usd}/h"
            )
    elif rule is SplitRule.MARGINAL:
        if not counts_known or quote.marginal is None:
            raise PriceError(f"{quote.instance_type}: split rule 'marginal' needs the vCPU and memory counts and "
                             f"general-purpose rates for {quote.provider}/{quote.region}/{quote.price_model}")
        other = _marginal_part(quote)
        if other >= node:
            raise PriceError(f"{quote.instance_type}: its CPU and memory at general-purpose rates "
                             f"({float(other):.6f}/h) are not below the node price {quote.node_price_per_hour_usd}/h")
        gpu_part = node - other
        derivation = "; ".join(filter(None, (derivation, f"marginal: {quote.marginal.derivation}")))
        sources = quote.sources + tuple(s for s in quote.marginal.sources if s not in quote.sources)
    elif rule is SplitRule.WEIGHTS:
        if quote.spec.vcpu_count is None or quote.spec.memory_gib is None:
            raise PriceError(f"{quote.instance_type}: split rule 'weights' needs the vCPU and memory counts")
        gpu_weight = gpu_count * Fraction(policy.gpu_usd_per_gpu_hour)
        total_weight = (
            quote.spec.vcpu_count * Fraction(policy.cpu_usd_per_vcpu_hour)
            + Fraction(quote.spec.memory_gib) * Fraction(policy.ram_usd_per_gib_hour)
            + gpu_weight
        )
        gpu_part = node * gpu_weight / total_weight
    else:
        gpu_part = node * Fraction(policy.gpu_fraction)
    common.update(sources=sources, derivation=derivation)
    return NodePrice(node_usd_per_hour=node, gpu_usd_per_hour=gpu_part / gpu_count,
                     node_other_usd_per_hour=node - gpu_part, split_rule=rule, **common)


def _marginal_part(quote: PriceQuote) -> Fraction:
    """The node's vCPUs and memory at its general-purpose rates, per hour."""
    assert quote.marginal is not None and quote.spec.vcpu_count is not None and quote.spec.memory_gib is not None
    rates = quote.marginal
    return rates.scale * (quote.spec.vcpu_count * Fraction(rates.cpu_usd_per_vcpu_hour)
                          + Fraction(quote.spec.memory_gib) * Fraction(rates.ram_usd_per_gib_hour))


def price_node(
    catalog: PriceCatalog,
    *,
    provider: str,
    region: str,
    instance_type: str,
    price_model: str,
    node_name: str = "",
    gpu_model: str = "",
    observed_gpu_count: int,
    policy: SplitPolicy = DEFAULT_SPLIT_POLICY,
) -> NodePrice:
    """Catalog lookup plus split, in one call."""
    quote = catalog.quote(provider=provider, region=region, instance_type=instance_type, price_model=price_model,
                          node_name=node_name, gpu_model=gpu_model)
    return split_node_price(quote, observed_gpu_count=observed_gpu_count, policy=policy)


def split_table(catalog: PriceCatalog, rules: tuple[str, ...] = ("marginal", "weights", "gpu_fraction", "sku")) -> str:
    """A Markdown table of every catalog row: its price, and its GPUs' part and node_other under each rule
    (``-`` where a rule cannot price it), plus the rule ``auto`` picks. What ``docs/billing.md`` shows."""
    head = ["instance type", "provider / region", "price model", "GPUs", "USD/h", "auto"]
    for rule in rules:
        head += [f"{rule}: GPUs", f"{rule}: node_other"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in sorted(catalog.rows, key=lambda r: (r.provider, r.region, r.instance_type.lower(), r.price_model)):
        facts = dict(provider=row.provider, region=row.region, instance_type=row.instance_type,
                     price_model=row.price_model, observed_gpu_count=row.gpu_count)
        auto = price_node(catalog, **facts)
        cells = [row.instance_type, f"{row.provider} {row.region}", row.price_model,
                 f"{row.gpu_count}× {row.gpu_model}", _money(auto.node_usd_per_hour), auto.split_rule.value]
        for rule in rules:
            try:
                price = price_node(catalog, **facts, policy=SplitPolicy(rule=rule))
            except PriceError:
                cells += ["-", "-"]
                continue
            gpus = price.gpu_usd_per_hour * price.gpu_count
            cells += [f"{_money(gpus)} ({_percent(gpus / price.node_usd_per_hour)})",
                      f"{_money(price.node_other_usd_per_hour)} "
                      f"({_percent(price.node_other_usd_per_hour / price.node_usd_per_hour)})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _money(value: Fraction) -> str:
    return str((Decimal(value.numerator) / Decimal(value.denominator)).quantize(Decimal("0.0001")))


def _percent(value: Fraction) -> str:
    return f"{(Decimal(value.numerator) * 100 / Decimal(value.denominator)).quantize(Decimal('0.1'))} %"
