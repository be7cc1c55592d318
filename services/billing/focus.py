"""The ledger as a FOCUS cost and usage dataset (FinOps Open Cost and Usage Specification). Pure mapping; the CSV
and Parquet writers are at the end.

**What a row is.** The origin charge is a node's line item for one window (a ``node_bills`` row): what the cloud
bills for that instance over that time. gpumeter splits it (split cost allocation, FOCUS 1.3), and each row of the
dataset is one allocated charge of it: one row per pod of the node-window (its direct lines on every unit plus its
shared lines) and one per bucket kind the sharing policy kept (idle, driver_reserved, unattributed, unavailable,
node_other: the unallocated portion of the origin charge). ChargePeriodStart/End are the window.

**Columns.** Every FOCUS 1.0 column that is Mandatory (BilledCost, BillingAccountId/Name, BillingCurrency,
BillingPeriodStart/End, ChargeCategory, ChargeClass, ChargeDescription, ChargePeriodStart/End, ContractedCost,
EffectiveCost, InvoiceIssuerName, ListCost, PricingQuantity, PricingUnit, ProviderName, PublisherName,
ServiceCategory, ServiceName) and the Conditional and Recommended ones that apply or that the FinOps Foundation's
validator requires (AvailabilityZone, ChargeFrequency, CommitmentDiscount* (null: gpumeter prices at list),
ConsumedQuantity/Unit, ContractedUnitPrice, ListUnitPrice, PricingCategory, RegionId/Name, ResourceId/Name/Type,
SkuId, SkuPriceId, SubAccountId/Name, Tags); FOCUS 1.2/1.3's ServiceProviderName and HostProviderName; and the
1.3 split-cost-allocation columns:

* ``AllocatedMethodId``: ``gpumeter/<cost basis>/<sharing policy>`` (``gpumeter/memory/keep``,
  ``gpumeter/memory/idle=weighted,node_other=weighted``): one documented method (docs/billing.md) per pair.
* ``AllocatedMethodDetails``: ``{"Elements": [...]}`` with one element per cost line the row carries. A unit line:
  ``AllocatedRatio`` (its share of the origin charge), ``UsageUnit`` ``GPU-Hours``, ``UsageQuantity`` (cost share ×
  GPU fraction × billed hours), ``x_GpuUuid``, ``x_Method`` (``slices`` for a MIG instance, ``exclusive`` for a
  dedicated GPU, else the cost basis: ``memory``, ``compute``, ``blend:<alpha>``, ``request``), ``x_MeasuredBy``
  (the attribution method), ``x_CostShare``, ``x_MemoryShare``, ``x_ComputeShare``. A shared line:
  ``AllocatedRatio``, ``UsageUnit`` ``Shared``, ``x_SharedFrom`` and ``x_SharingMethod``. A kept bucket line:
  ``AllocatedRatio``, ``UsageUnit`` ``GPU-Hours`` (or ``Hours`` for node_other), ``x_Bucket``. Over all rows of an
  origin charge the ratios add up to 1 (exactly in rationals; in the JSON's binary floats within 1e-12).
* ``AllocatedResourceId`` / ``AllocatedResourceName`` / ``AllocatedTags``: the pod's uid, ``namespace/name`` and
  labels (those the attributor carried); null on the kept buckets' rows (the unallocated portion, as FOCUS 1.3
  requires).

Allocated charges keep the origin charge's dimensions (FOCUS 1.3: every dimension of an allocated charge matches
its origin charge): ResourceId is the node's instance id (``spec.providerID``'s last segment; the provider id or
the node name when there is none), ResourceName the node, ChargeDescription, SkuId (instance type), SkuPriceId
(gpumeter's price version), the region, and ``Tags`` -- the origin charge's own tags, ``gpumeter.io/cluster`` and
``gpumeter.io/node`` -- are the same on every row of a node-window. The pods' labels are their tags as allocated
resources: ``AllocatedTags``. Custom columns are ``x_``-prefixed (``x_ClusterName``, ``x_NodeName``, ``x_Namespace``,
``x_PodName``, ``x_PodUid``, ``x_Subject``, ``x_DirectCost``, ``x_SharedCost``, ``x_SharingPolicy``, ``x_CostBasis``,
``x_SplitRule``, ``x_ListCostMicroUsd``, ``x_BilledCostMicroUsd``, ``x_GpuHours``).

**Money.** ListCost and ContractedCost are the lines' list-price micro-dollars (gpumeter prices at list; no
negotiated rate is known to it). BilledCost and EffectiveCost are the billed micro-dollars of each line -- the
trued-up cost where ``gpumeter reconcile`` stored one, else the list cost (``FocusLine.billed_micro_usd``; the
ledger's ``BILLED_COST``, read by ``Ledger.billed_cost_lines``, is the one place that reads it). Per origin charge
the rows add up to the node bill exactly (in micro-dollars, and in the decimal text of the CSV). PricingQuantity
and ConsumedQuantity are the node's billed hours (to 1e-10 h) apportioned over the rows by their list cost
(largest remainder), so they add up to the origin's hours exactly too; PricingUnit and ConsumedUnit are
``Hours``; ListUnitPrice and ContractedUnitPrice the node's hourly rate.
"""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from fractions import Fraction
from operator import itemgetter
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from gpumeter.provider_ids import instance_id_of
from schemas.records import CostRecord, CostSubjectKind
from services.billing.money import apportion
from services.billing.sharing import SHAREABLE_KINDS

FOCUS_VERSION = "1.3"
CURRENCY = "USD"
TAG_PREFIX = "gpumeter.io/"
METHOD_MIG = "mig_instance"
METHOD_EXCLUSIVE = "exclusive"

# FOCUS 1.0's Mandatory columns, then its Conditional/Recommended ones gpumeter fills (or leaves null where they do
# not apply), then 1.2/1.3's, then the custom ones: the dataset's column order.
FOCUS_COLUMNS: tuple[str, ...] = (
    "BilledCost", "BillingAccountId", "BillingAccountName", "BillingCurrency", "BillingPeriodEnd",
    "BillingPeriodStart", "ChargeCategory", "ChargeClass", "ChargeDescription", "ChargePeriodEnd",
    "ChargePeriodStart", "ContractedCost", "EffectiveCost", "InvoiceIssuerName", "ListCost", "PricingQuantity",
    "PricingUnit", "ProviderName", "PublisherName", "ServiceCategory", "ServiceName",
    "AvailabilityZone", "ChargeFrequency", "CommitmentDiscountCategory", "CommitmentDiscountId",
    "CommitmentDiscountName", "CommitmentDiscountStatus", "CommitmentDiscountType", "ConsumedQuantity",
    "ConsumedUnit", "ContractedUnitPrice", "ListUnitPrice", "PricingCategory", "RegionId", "RegionName",
    "ResourceId", "ResourceName", "ResourceType", "SkuId", "SkuPriceId", "SubAccountId", "SubAccountName", "Tags",
    "ServiceProviderName", "HostProviderName",
    "AllocatedMethodId", "AllocatedMethodDetails", "AllocatedResourceId", "AllocatedResourceName", "AllocatedTags",
)
CUSTOM_COLUMNS: tuple[str, ...] = (
    "x_ClusterName", "x_NodeName", "x_Namespace", "x_PodName", "x_PodUid", "x_Subject", "x_DirectCost",
    "x_SharedCost", "x_SharingPolicy", "x_CostBasis", "x_SplitRule", "x_ListCostMicroUsd", "x_BilledCostMicroUsd",
    "x_GpuHours",
)
COLUMNS = FOCUS_COLUMNS + CUSTOM_COLUMNS
MONEY_COLUMNS = ("BilledCost", "ContractedCost", "EffectiveCost", "ListCost", "ContractedUnitPrice", "ListUnitPrice",
                 "x_DirectCost", "x_SharedCost")
QUANTITY_COLUMNS = ("PricingQuantity", "ConsumedQuantity", "x_GpuHours")
DATETIME_COLUMNS = ("BillingPeriodEnd", "BillingPeriodStart", "ChargePeriodEnd", "ChargePeriodStart")
INTEGER_COLUMNS = ("x_ListCostMicroUsd", "x_BilledCostMicroUsd")

_PROVIDERS = {  # provider -> (ProviderName, ServiceName)
    "aws": ("AWS", "Amazon Elastic Compute Cloud"),
    "gcp": ("Google Cloud", "Compute Engine"),
    "azure": ("Microsoft Azure", "Virtual Machines"),
}
_PRICING_CATEGORY = {"on_demand": "Standard", "spot": "Dynamic", "committed": "Committed"}
_MS_PER_HOUR = 3_600_000


@dataclass(frozen=True, slots=True)
class FocusLine:
    """One ledger cost line and what it was billed: ``billed_micro_usd`` is the trued-up cost where a reconcile
    stored one, None where it is the list cost (``record.cost_micro_usd``)."""

    record: CostRecord
    billed_micro_usd: int | None = None

    @property
    def billed(self) -> int:
        return self.record.cost_micro_usd if self.billed_micro_usd is None else self.billed_micro_usd


@dataclass(frozen=True, slots=True)
class FocusBill:
    """The origin charge: one node bill (``node_bills`` row) and its price."""

    cluster: str
    node_name: str
    window_start_unix_ms: int
    window_seconds: int
    billed_milliseconds: int
    provider: str
    region: str
    zone: str
    provider_id: str
    instance_type: str
    price_model: str
    price_version: str
    price_per_hour_usd: str
    split_rule: str
    sharing: str
    node_cost_micro_usd: int

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.cluster, self.node_name, self.window_start_unix_ms)

    @classmethod
    def of(cls, bill: Mapping[str, Any], price: Mapping[str, Any]) -> "FocusBill":
        """From a ``Ledger.bills()`` row and its ``price_versions`` row."""
        return cls(bill["cluster"], bill["node_name"], int(bill["window_start_unix_ms"]), int(bill["window_seconds"]),
                   int(bill["billed_milliseconds"]), bill["provider"], bill["region"], bill.get("zone") or "",
                   bill.get("provider_id") or "", bill["instance_type"], bill["price_model"], bill["price_version"],
                   str(price["price_per_hour_usd"]), str(price.get("split_rule") or ""),
                   bill.get("sharing") or "keep", int(bill["node_cost_micro_usd"]))


_MICRO = Decimal("0.000001")


def usd_decimal(micro_usd: int) -> Decimal:
    return Decimal(micro_usd).scaleb(-6).quantize(_MICRO)


HOURS_DECIMALS = 10


def hour_units(milliseconds: int) -> int:
    """Billed time in units of 1e-10 hours, rounded half up (an hour of milliseconds is no finite decimal)."""
    return int((Fraction(milliseconds * 10**HOURS_DECIMALS, _MS_PER_HOUR) + Fraction(1, 2)).__floor__())


def _decimal(value: Fraction) -> Decimal:
    return (Decimal(value.numerator) / Decimal(value.denominator)).quantize(Decimal("0.0000000001"))


def iso_z(unix_ms: int) -> str:
    moment = datetime.fromtimestamp(unix_ms / 1000, tz=timezone.utc)
    return moment.isoformat(timespec="seconds" if unix_ms % 1000 == 0 else "milliseconds").replace("+00:00", "Z")


def billing_period_ms(unix_ms: int) -> tuple[int, int]:
    """The UTC calendar month that contains ``unix_ms``: [first day 00:00, first day of the next month 00:00)."""
    moment = datetime.fromtimestamp(unix_ms / 1000, tz=timezone.utc)
    start = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return int(start.timestamp() * 1000), int(end.timestamp() * 1000)


def resource_id(bill: FocusBill) -> str:
    """The origin charge's resource: the instance id the cloud bills (what a bill export's resource id is)."""
    return instance_id_of(bill.provider_id) or bill.provider_id or bill.node_name


def _element_method(record: CostRecord) -> str:
    if record.method == METHOD_MIG:
        return "slices"
    if record.method == METHOD_EXCLUSIVE:
        return "exclusive"
    return record.cost_basis or record.method


# ``json.dumps`` with options builds an encoder per call: one, made once, encodes the same text.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def _json(value: Any) -> str:
    return _ENCODER.encode(value)


def _cost_basis(lines: Sequence[FocusLine]) -> str:
    bases = sorted({line.record.cost_basis for line in lines if line.record.cost_basis})
    return "+".join(bases) or "unknown"


def _ratio(amount: int, total: int, elements: int) -> float:
    # A node-window billed 0 (no time covered) has no ratios of its own: its elements share it equally.
    return float(Fraction(amount, total)) if total else 1.0 / elements


def _subject_key(record: CostRecord) -> tuple[int, str]:
    if record.subject_kind is CostSubjectKind.POD and record.pod_uid:
        return (0, record.pod_uid)
    return (1 + SHAREABLE_KINDS.index(record.subject_kind), record.subject_kind.value)


def focus_rows(bills: Iterable[FocusBill], lines: Iterable[FocusLine], *,
               billing_account_id: str | None = None) -> list[dict[str, Any]]:
    """The dataset's rows (column name → value: ``Decimal`` money and quantities, ISO 8601 text times, JSON text,
    None for null), ordered by window, node, then pods by uid and the kept buckets. ``billing_account_id``
    (default: the cluster name) is what the rows' BillingAccountId says. Raises ``ValueError`` for a line whose
    bill is missing or lines that do not add up to their bill."""
    by_bill: dict[tuple[str, str, int], list[FocusLine]] = defaultdict(list)
    for line in lines:
        r = line.record
        by_bill[(r.cluster, r.node_name, r.window_start_unix_ms)].append(line)
    bills = sorted(bills, key=lambda b: (b.window_start_unix_ms, b.cluster, b.node_name))
    known = {b.key for b in bills}
    orphans = set(by_bill) - known
    if orphans:
        raise ValueError(f"cost lines without their node bill: {sorted(orphans)[:3]}")
    rows: list[dict[str, Any]] = []
    for bill in bills:
        rows.extend(_bill_rows(bill, by_bill.get(bill.key, []), billing_account_id))
    return rows


def _origin_columns(*, cluster: str, node_name: str, provider: str, region: str, zone: str, provider_id: str,
                    instance_type: str, price_model: str, price_version: str, price_per_hour_usd: str,
                    split_rule: str, sharing: str, basis: str, start_ms: int, end_ms: int, description: str,
                    billing_account_id: str | None) -> dict[str, Any]:
    """The columns every allocated charge of an origin charge shares with it (FOCUS 1.3), charged over
    [start_ms, end_ms)."""
    provider_name, service_name = _PROVIDERS.get(provider, (provider or "self-managed", "GPU nodes"))
    period_start, period_end = billing_period_ms(start_ms)
    rate = Decimal(price_per_hour_usd)
    return {
        "BillingAccountId": billing_account_id or cluster,
        "BillingAccountName": billing_account_id or cluster,
        "BillingCurrency": CURRENCY,
        "BillingPeriodStart": iso_z(period_start),
        "BillingPeriodEnd": iso_z(period_end),
        "ChargeCategory": "Usage",
        "ChargeClass": None,
        "ChargeDescription": description,
        "ChargeFrequency": "Usage-Based",
        "ChargePeriodStart": iso_z(start_ms),
        "ChargePeriodEnd": iso_z(end_ms),
        "InvoiceIssuerName": provider_name,
        "ProviderName": provider_name,
        "PublisherName": provider_name,
        "ServiceProviderName": provider_name,
        "HostProviderName": provider_name,
        "ServiceCategory": "Compute",
        "ServiceName": service_name,
        "PricingUnit": "Hours",
        "ConsumedUnit": "Hours",
        "ListUnitPrice": rate,
        "ContractedUnitPrice": rate,
        "PricingCategory": _PRICING_CATEGORY.get(price_model, "Other"),
        "AvailabilityZone": zone or None,
        "RegionId": region or None,
        "RegionName": region or None,
        "ResourceId": instance_id_of(provider_id) or provider_id or node_name,
        "ResourceName": node_name,
        "ResourceType": "Virtual Machine",
        "SkuId": instance_type,
        "SkuPriceId": price_version,
        "SubAccountId": None,
        "SubAccountName": None,
        "Tags": _json({f"{TAG_PREFIX}cluster": cluster, f"{TAG_PREFIX}node": node_name}),
        "CommitmentDiscountCategory": None,
        "CommitmentDiscountId": None,
        "CommitmentDiscountName": None,
        "CommitmentDiscountStatus": None,
        "CommitmentDiscountType": None,
        "AllocatedMethodId": f"gpumeter/{basis}/{sharing}",
        "x_ClusterName": cluster,
        "x_NodeName": node_name,
        "x_SharingPolicy": sharing,
        "x_CostBasis": basis,
        "x_SplitRule": split_rule,
    }


def _bill_rows(bill: FocusBill, lines: list[FocusLine], billing_account_id: str | None) -> list[dict[str, Any]]:
    listed = sum(line.record.cost_micro_usd for line in lines)
    if listed != bill.node_cost_micro_usd:
        raise ValueError(f"{bill.key}: lines add up to {listed} micro-USD, the bill says {bill.node_cost_micro_usd}")
    groups: dict[tuple[int, str], list[FocusLine]] = defaultdict(list)
    for line in lines:
        groups[_subject_key(line.record)].append(line)
    keys = sorted(groups)
    list_costs = [Fraction(sum(line.record.cost_micro_usd for line in groups[key])) for key in keys]
    if keys and not any(list_costs):
        list_costs = [Fraction(1)] * len(keys)  # nothing billed: the time still divides over the rows
    # The node's billed hours (to 1e-10 h) apportioned over the rows: their quantities add up to it exactly.
    quantities = apportion(hour_units(bill.billed_milliseconds), list_costs) if keys else ()
    origin_tags = {f"{TAG_PREFIX}cluster": bill.cluster, f"{TAG_PREFIX}node": bill.node_name}
    basis = _cost_basis(lines)
    billed_hours = Fraction(bill.billed_milliseconds, _MS_PER_HOUR)
    element_count = len(lines)
    common = _origin_columns(
        cluster=bill.cluster, node_name=bill.node_name, provider=bill.provider, region=bill.region, zone=bill.zone,
        provider_id=bill.provider_id, instance_type=bill.instance_type, price_model=bill.price_model,
        price_version=bill.price_version, price_per_hour_usd=bill.price_per_hour_usd, split_rule=bill.split_rule,
        sharing=bill.sharing, basis=basis, start_ms=bill.window_start_unix_ms,
        end_ms=bill.window_start_unix_ms + bill.window_seconds * 1000,
        description=f"{bill.instance_type} {bill.price_model} GPU node {bill.node_name}, "
                    f"{bill.window_seconds} s window",
        billing_account_id=billing_account_id)
    rows = []
    for key, group, units in zip(keys, (groups[k] for k in keys), quantities):
        list_micro = sum(line.record.cost_micro_usd for line in group)
        billed_micro = sum(line.billed for line in group)
        shared_micro = sum(line.record.cost_micro_usd for line in group if line.record.is_shared)
        first = group[0].record
        is_pod = key[0] == 0
        elements = []
        gpu_hours = Fraction(0)
        for line in sorted(group, key=lambda l: (l.record.is_shared, l.record.gpu_uuid or "",
                                                 l.record.shared_from or "")):
            r = line.record
            element: dict[str, Any] = {"AllocatedRatio": _ratio(r.cost_micro_usd, bill.node_cost_micro_usd,
                                                                element_count)}
            if r.is_shared:
                assert r.shared_from is not None
                element.update(UsageUnit="Shared", x_SharedFrom=r.shared_from.value.lower(),
                               x_SharingMethod=r.sharing_method, x_CostShare=r.cost_share)
            elif r.gpu_uuid is not None:
                hours = Fraction(r.cost_share) * Fraction(r.gpu_fraction) * billed_hours
                gpu_hours += hours if is_pod else 0
                element.update(UsageUnit="GPU-Hours", UsageQuantity=float(hours), x_GpuUuid=r.gpu_uuid,
                               x_Method=_element_method(r), x_MeasuredBy=r.method, x_CostShare=r.cost_share,
                               x_MemoryShare=r.memory_share, x_ComputeShare=r.compute_share)
                if not is_pod:
                    element["x_Bucket"] = r.subject_kind.value.lower()
            else:
                element.update(UsageUnit="GPU-Hours" if r.subject_kind is CostSubjectKind.UNAVAILABLE else "Hours",
                               x_Bucket=r.subject_kind.value.lower())
            elements.append(element)
        labels = {k: v for k, v in first.labels.items() if k not in origin_tags} if is_pod else None
        row = dict(common)
        row.update({
            "BilledCost": usd_decimal(billed_micro),
            "EffectiveCost": usd_decimal(billed_micro),
            "ListCost": usd_decimal(list_micro),
            "ContractedCost": usd_decimal(list_micro),
            "PricingQuantity": Decimal(units).scaleb(-HOURS_DECIMALS),
            "ConsumedQuantity": Decimal(units).scaleb(-HOURS_DECIMALS),
            "AllocatedMethodDetails": _json({"Elements": elements}),
            "AllocatedResourceId": first.pod_uid if is_pod else None,
            "AllocatedResourceName": f"{first.namespace}/{first.pod_name}" if is_pod else None,
            "AllocatedTags": _json(labels) if is_pod else None,
            "x_Namespace": first.namespace if is_pod else None,
            "x_PodName": first.pod_name if is_pod else None,
            "x_PodUid": first.pod_uid if is_pod else None,
            "x_Subject": "pod" if is_pod else first.subject_kind.value.lower(),
            "x_DirectCost": usd_decimal(list_micro - shared_micro),
            "x_SharedCost": usd_decimal(shared_micro),
            "x_ListCostMicroUsd": list_micro,
            "x_BilledCostMicroUsd": billed_micro,
            "x_GpuHours": _decimal(gpu_hours) if is_pod else None,
        })
        rows.append({column: row.get(column) for column in COLUMNS})
    return rows


# -- the hourly grain ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FocusCharge:
    """An hourly origin charge: a node's bills of one UTC hour with the same pricing (a ``focus_charge_hourly`` row,
    ``services.billing.focus_rollups``) and its price."""

    period_start_unix_ms: int
    cluster: str
    node_name: str
    provider_id: str
    zone: str
    price_version: str
    sharing: str
    window_seconds: int
    provider: str
    region: str
    instance_type: str
    price_model: str
    node_windows: int
    billed_milliseconds: int
    node_cost_micro_usd: int
    billed_micro_usd: int
    trued_windows: int
    price_per_hour_usd: str
    split_rule: str

    @property
    def link(self) -> tuple:
        return (self.period_start_unix_ms, self.cluster, self.node_name, self.provider_id, self.zone,
                self.price_version, self.sharing, self.window_seconds)


@dataclass(frozen=True, slots=True)
class FocusHourLine:
    """An allocated line of an hourly origin charge: a ``focus_line_hourly`` row (one line identity's minute lines
    of the hour, summed) with its labels."""

    subject_kind: str
    pod_uid: str
    gpu_uuid: str
    shared_from: str
    sharing_method: str
    method: str
    cost_basis: str
    namespace: str
    pod_name: str
    labels: Mapping[str, str]
    cost_micro_usd: int
    billed_micro_usd: int
    cost_lines: int
    trued_lines: int
    billed_ms: int
    cost_share_ms: float
    memory_share_ms: float
    compute_share_ms: float
    gpu_ms: float


_ORIGIN_TAG_KEYS = (f"{TAG_PREFIX}cluster", f"{TAG_PREFIX}node")
_BUCKET_ORDER = {kind.value: 1 + index for index, kind in enumerate(SHAREABLE_KINDS)}
_HOURS_QUANTUM = Decimal(1).scaleb(-HOURS_DECIMALS)


def _method_text(method: str, cost_basis: str) -> str:
    if method == METHOD_MIG:
        return "slices"
    if method == METHOD_EXCLUSIVE:
        return "exclusive"
    return cost_basis or method


def focus_hour_rows(charges: Iterable[FocusCharge], lines: Mapping[tuple, Sequence[FocusHourLine]], *,
                    billing_account_id: str | None = None) -> list[dict[str, Any]]:
    """The hourly grain's rows: per origin charge (``charges``, each with its lines in ``lines`` by
    ``FocusCharge.link``), one row per pod (and label set) and one per kept bucket, as ``focus_rows`` makes per
    node-window, ChargePeriodStart/End the hour. What each column means over the hour (docs/billing.md, "FOCUS
    export"):

    * money: the row's lines' micro-dollars summed (exact); per origin charge the rows add up to its bills;
    * ``AllocatedRatio`` of an element: its list micro-dollars over the origin charge's (so they add up to 1 over
      the origin charge exactly in rationals, as at the minute grain); ``UsageQuantity`` and ``x_GpuHours``: the
      GPU-hours of the minute lines summed;
    * ``x_CostShare``, ``x_MemoryShare``, ``x_ComputeShare``: time-weighted over the hour -- Σ share × the window's
      billed milliseconds over the origin charge's billed milliseconds (a pod there half the hour at share 1 shows
      0.5; over a GPU unit present all hour the subjects' shares add up to 1, as each minute's do); ``x_Lines``:
      the minute lines summed into the element;
    * PricingQuantity/ConsumedQuantity: the origin charge's billed hours (to 1e-10 h) apportioned over the rows by
      list cost (largest remainder), so they add up to them exactly.

    Raises ``ValueError`` for lines without their origin charge or lines that do not add up to it."""
    charges = sorted(charges, key=lambda c: c.link)
    known = {c.link for c in charges}
    orphans = set(lines) - known
    if orphans:
        raise ValueError(f"hourly FOCUS lines without their origin charge: {sorted(orphans)[:3]}")
    rows: list[dict[str, Any]] = []
    for charge in charges:
        rows.extend(_charge_rows(charge, lines.get(charge.link, ()), billing_account_id))
    return rows


def _charge_rows(charge: FocusCharge, lines: Sequence[FocusHourLine],
                 billing_account_id: str | None) -> list[dict[str, Any]]:
    total = charge.node_cost_micro_usd
    listed = sum(line.cost_micro_usd for line in lines)
    if listed != total:
        raise ValueError(f"{charge.link}: lines add up to {listed} micro-USD, the origin charge says {total}")
    groups: dict[tuple, list[FocusHourLine]] = {}
    # A label set's tags text, once per labels object (a chunk's lines of one label set share it).
    tags_text: dict[int, str] = {}
    for line in lines:
        if line.subject_kind == "POD" and line.pod_uid:
            labels = line.labels
            text = tags_text.get(id(labels))
            if text is None:
                text = tags_text[id(labels)] = _json({k: v for k, v in labels.items() if k not in _ORIGIN_TAG_KEYS})
            key = (0, line.pod_uid, line.namespace, line.pod_name, text)
        else:
            key = (_BUCKET_ORDER.get(line.subject_kind, 99), line.subject_kind)
        groups.setdefault(key, []).append(line)
    keys = sorted(groups)
    row_costs = [sum(line.cost_micro_usd for line in groups[key]) for key in keys]
    weights = [Fraction(c) for c in row_costs] if any(row_costs) else [Fraction(1)] * len(keys)
    quantities = apportion(hour_units(charge.billed_milliseconds), weights) if keys else ()
    basis = "+".join(sorted({line.cost_basis for line in lines if line.cost_basis})) or "unknown"
    common = _origin_columns(
        cluster=charge.cluster, node_name=charge.node_name, provider=charge.provider, region=charge.region,
        zone=charge.zone, provider_id=charge.provider_id, instance_type=charge.instance_type,
        price_model=charge.price_model, price_version=charge.price_version,
        price_per_hour_usd=charge.price_per_hour_usd, split_rule=charge.split_rule, sharing=charge.sharing,
        basis=basis, start_ms=charge.period_start_unix_ms, end_ms=charge.period_start_unix_ms + _MS_PER_HOUR,
        description=f"{charge.instance_type} {charge.price_model} GPU node {charge.node_name}, hour of "
                    f"{charge.window_seconds} s windows",
        billing_account_id=billing_account_id)
    # Every column, in ``COLUMNS`` order, the origin's values filled: a row is a copy, updated (no reordering).
    template = dict.fromkeys(COLUMNS)
    template.update(common)
    origin_ms = charge.billed_milliseconds
    element_count = len(lines)
    rows = []
    for key, list_micro, units in zip(keys, row_costs, quantities):
        group = groups[key]
        is_pod = key[0] == 0
        billed_micro = shared_micro = 0
        gpu_ms = 0.0
        elements = []
        for line in sorted(group, key=lambda l: (l.shared_from != "", l.gpu_uuid, l.shared_from)):
            billed_micro += line.billed_micro_usd
            # int / int is correctly rounded: the same float as float(Fraction(cost, total)), without the Fraction.
            ratio = line.cost_micro_usd / total if total else 1.0 / element_count
            element: dict[str, Any] = {"AllocatedRatio": ratio}
            share = line.cost_share_ms / origin_ms if origin_ms else 0.0
            if line.shared_from:
                shared_micro += line.cost_micro_usd
                element.update(UsageUnit="Shared", x_SharedFrom=line.shared_from.lower(),
                               x_SharingMethod=line.sharing_method, x_CostShare=share)
            elif line.gpu_uuid:
                if is_pod:
                    gpu_ms += line.gpu_ms
                element.update(UsageUnit="GPU-Hours", UsageQuantity=line.gpu_ms / _MS_PER_HOUR,
                               x_GpuUuid=line.gpu_uuid, x_Method=_method_text(line.method, line.cost_basis),
                               x_MeasuredBy=line.method, x_CostShare=share,
                               x_MemoryShare=line.memory_share_ms / origin_ms if origin_ms else 0.0,
                               x_ComputeShare=line.compute_share_ms / origin_ms if origin_ms else 0.0)
                if not is_pod:
                    element["x_Bucket"] = line.subject_kind.lower()
            else:
                element.update(UsageUnit="GPU-Hours" if line.subject_kind == "UNAVAILABLE" else "Hours",
                               x_Bucket=line.subject_kind.lower())
            element["x_Lines"] = line.cost_lines
            elements.append(element)
        first = group[0]
        row = template.copy()
        quantity = Decimal(units).scaleb(-HOURS_DECIMALS)
        row.update({
            "BilledCost": usd_decimal(billed_micro),
            "EffectiveCost": usd_decimal(billed_micro),
            "ListCost": usd_decimal(list_micro),
            "ContractedCost": usd_decimal(list_micro),
            "PricingQuantity": quantity,
            "ConsumedQuantity": quantity,
            "AllocatedMethodDetails": _json({"Elements": elements}),
            "AllocatedResourceId": first.pod_uid if is_pod else None,
            "AllocatedResourceName": f"{first.namespace}/{first.pod_name}" if is_pod else None,
            "AllocatedTags": key[4] if is_pod else None,
            "x_Namespace": first.namespace if is_pod else None,
            "x_PodName": first.pod_name if is_pod else None,
            "x_PodUid": first.pod_uid if is_pod else None,
            "x_Subject": "pod" if is_pod else first.subject_kind.lower(),
            "x_DirectCost": usd_decimal(list_micro - shared_micro),
            "x_SharedCost": usd_decimal(shared_micro),
            "x_ListCostMicroUsd": list_micro,
            "x_BilledCostMicroUsd": billed_micro,
            "x_GpuHours": (Decimal(gpu_ms) / _MS_PER_HOUR).quantize(_HOURS_QUANTUM) if is_pod else None,
        })
        rows.append(row)
    return rows


# -- writers ------------------------------------------------------------------------------------------------------


def _csv_text(value: Any) -> str:
    if value is None:
        return ""
    return str(value)


def focus_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as CSV (RFC 4180, a header of the column names; null is an empty cell). No cell is rewritten
    against spreadsheet formulas: FOCUS consumers read the values as they are (every text here is a name
    Kubernetes validated, a JSON object or gpumeter's own)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow([_csv_text(row.get(column)) for column in COLUMNS])
    return buffer.getvalue()


_ROW_VALUES = itemgetter(*COLUMNS)


def _columns_of(rows: Sequence[Mapping[str, Any]]) -> list[Sequence[Any]]:
    """The rows' values, column by column (``COLUMNS``' order; a column a row lacks is null): each row's values
    taken in one call and transposed, not looked up cell by cell."""
    try:
        columns = list(zip(*map(_ROW_VALUES, rows)))
    except KeyError:
        columns = [[row.get(column) for row in rows] for column in COLUMNS]
    return columns or [()] * len(COLUMNS)


def _arrow_table(rows: Sequence[Mapping[str, Any]], metadata: Mapping[str, str] | None = None):
    import pyarrow as pa

    fields = []
    arrays = []
    for column, values in zip(COLUMNS, _columns_of(rows)):
        if column in DATETIME_COLUMNS:
            kind = pa.timestamp("ms", tz="UTC")
            # A few distinct times (a period's start and end, its month) on many rows: each parsed once.
            parsed = {v: datetime.fromisoformat(v.replace("Z", "+00:00")) for v in set(values) if v is not None}
            values = [None if v is None else parsed[v] for v in values]
        elif column in MONEY_COLUMNS or column in QUANTITY_COLUMNS:
            kind = pa.float64()
            values = [None if v is None else float(v) for v in values]
        elif column in INTEGER_COLUMNS:
            kind = pa.int64()
        else:
            kind = pa.string()
        fields.append(pa.field(column, kind))
        arrays.append(pa.array(values, type=kind))
    return pa.Table.from_arrays(arrays, schema=pa.schema(
        fields, metadata={"focus_version": FOCUS_VERSION, **(metadata or {})}))


def write_focus_parquet(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """The rows as a Parquet file (pyarrow): times ``timestamp[ms, UTC]``, money and quantities ``double`` (the
    exact micro-dollars are in ``x_ListCostMicroUsd``/``x_BilledCostMicroUsd``), text ``string``."""
    import pyarrow.parquet as pq

    pq.write_table(_arrow_table(rows), str(path))


def write_focus_parquet_chunks(chunks: Iterable[Sequence[Mapping[str, Any]]], path: Path, *,
                               metadata: Mapping[str, str] | None = None) -> int:
    """``write_focus_parquet`` of rows that come a chunk at a time (one row group per chunk: a month of a fleet's
    rows need not be in memory at once); ``metadata`` joins the schema's (``gpumeter_grain``). Returns the rows."""
    import pyarrow.parquet as pq

    writer = None
    count = 0
    try:
        for chunk in chunks:
            table = _arrow_table(chunk, metadata)
            if writer is None:
                writer = pq.ParquetWriter(str(path), table.schema)
            if chunk:
                writer.write_table(table)
            count += len(chunk)
        if writer is None:
            writer = pq.ParquetWriter(str(path), _arrow_table([], metadata).schema)
    finally:
        if writer is not None:
            writer.close()
    return count


def write_focus_csv_chunks(chunks: Iterable[Sequence[Mapping[str, Any]]], stream: Any) -> int:
    """``focus_csv`` of rows that come a chunk at a time, written to a text ``stream``; returns the rows."""
    writer = csv.writer(stream, lineterminator="\n")
    writer.writerow(COLUMNS)
    count = 0
    for chunk in chunks:
        try:
            writer.writerows([["" if v is None else str(v) for v in _ROW_VALUES(row)] for row in chunk])
        except KeyError:
            for row in chunk:
                writer.writerow([_csv_text(row.get(column)) for column in COLUMNS])
        count += len(chunk)
    return count
