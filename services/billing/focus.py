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
class HourLines:
    """The allocated lines (``focus_line_hourly`` rows: one line identity's minute lines of an hour, summed) of
    some hours, as ``focus_hour_columns`` reads them: each of ``lines`` a row of ``HOUR_LINE_FIELDS`` -- its hour,
    its origin charge's key (with the hour, a charge's identity), the keys of its kind, pod and GPU in the dictionaries below, its label set id, then the sums
    (``focus_rollups.LINE_MEASURES``) -- so the rows a database returns are the lines as they are, no object per
    line. ``kinds``: kind key -> (subject_kind, shared_from, sharing_method, method, cost_basis); ``pods``: pod key
    -> (pod_uid, namespace, pod_name); ``gpus``: GPU key -> gpu_uuid (``""``: none); ``labels``: label set id ->
    labels. A key is whatever the reader has (PostgreSQL's dictionary ids; SQLite's texts)."""

    lines: Sequence[Sequence[Any]]
    kinds: Mapping[Any, tuple[str, str, str, str, str]]
    pods: Mapping[Any, tuple[str, str, str]]
    gpus: Mapping[Any, str]
    labels: Mapping[int, Mapping[str, str]]


HOUR_LINE_FIELDS = ("period_start_unix_ms", "charge", "kind", "pod", "gpu", "label_set_id", "cost_micro_usd", "billed_micro_usd",
                    "cost_lines", "trued_lines", "billed_ms", "cost_share_ms", "memory_share_ms", "compute_share_ms",
                    "gpu_ms")

_ORIGIN_TAG_KEYS = (f"{TAG_PREFIX}cluster", f"{TAG_PREFIX}node")
_BUCKET_ORDER = {kind.value: 1 + index for index, kind in enumerate(SHAREABLE_KINDS)}
_HOURS_QUANTUM = Decimal(1).scaleb(-HOURS_DECIMALS)
# The per-row columns ``focus_hour_columns`` fills; every other column is its origin charge's.
_MICRO_COLUMNS = {"BilledCost": "billed", "EffectiveCost": "billed", "ListCost": "listed",
                  "ContractedCost": "listed", "x_DirectCost": "direct", "x_SharedCost": "shared"}
_UNITS_COLUMNS = {"PricingQuantity": "units", "ConsumedQuantity": "units"}
_ROW_COLUMNS = {"AllocatedMethodDetails": "details", "AllocatedResourceId": "uid", "AllocatedResourceName": "name",
                "AllocatedTags": "tags", "x_Namespace": "namespace", "x_PodName": "pod_name", "x_PodUid": "uid",
                "x_Subject": "subject", "x_ListCostMicroUsd": "listed", "x_BilledCostMicroUsd": "billed",
                "x_GpuHours": "gpu_hours"}


def _method_text(method: str, cost_basis: str) -> str:
    if method == METHOD_MIG:
        return "slices"
    if method == METHOD_EXCLUSIVE:
        return "exclusive"
    return cost_basis or method


try:  # the C encoder ``json`` itself uses for a string (ASCII-escaped, quoted)
    from _json import encode_basestring_ascii as _json_string
except ImportError:  # pragma: no cover - CPython has the C module
    from json.encoder import py_encode_basestring_ascii as _json_string


def _format_part(text: str) -> str:
    return text.replace("%", "%%")


def _element_format(shared_from: str, sharing_method: str, subject_kind: str, method: str, cost_basis: str,
                    has_gpu: bool, is_pod: bool) -> tuple[int, str]:
    """(which values, the %-format) of one element's JSON text, keys sorted as ``_json`` sorts them: 0 a shared
    line (ratio, cost share, lines), 1 a GPU line (ratio, usage, compute share, cost share, GPU uuid text, lines,
    memory share), 2 a bucket without a GPU (ratio, lines). Floats go in by ``%r`` (``json``'s own float text for a
    finite float); the fixed texts are ``json``'s."""
    if shared_from:
        return 0, ('{"AllocatedRatio":%r,"UsageUnit":"Shared","x_CostShare":%r,"x_Lines":%s,"x_SharedFrom":'
                   + _format_part(_json_string(shared_from.lower())) + ',"x_SharingMethod":'
                   + _format_part(_json_string(sharing_method)) + '}')
    if has_gpu:
        bucket = "" if is_pod else ',"x_Bucket":' + _format_part(_json_string(subject_kind.lower()))
        return 1, ('{"AllocatedRatio":%r,"UsageQuantity":%r,"UsageUnit":"GPU-Hours"' + bucket
                   + ',"x_ComputeShare":%r,"x_CostShare":%r,"x_GpuUuid":%s,"x_Lines":%s,"x_MeasuredBy":'
                   + _format_part(_json_string(method)) + ',"x_MemoryShare":%r,"x_Method":'
                   + _format_part(_json_string(_method_text(method, cost_basis))) + '}')
    unit = "GPU-Hours" if subject_kind == "UNAVAILABLE" else "Hours"
    return 2, ('{"AllocatedRatio":%r,"UsageUnit":"' + unit + '","x_Bucket":'
               + _format_part(_json_string(subject_kind.lower())) + ',"x_Lines":%s}')


def _element_dict(which: int, values: tuple, kind: tuple, gpu_uuid: str, is_pod: bool) -> dict[str, Any]:
    """The element as a dict (what ``_element_format``'s text is the JSON of): for values JSON writes otherwise
    (NaN, infinities), encoded by ``_json`` itself."""
    subject_kind, shared_from, sharing_method, method, cost_basis = kind
    if which == 0:
        ratio, share, lines = values
        return {"AllocatedRatio": ratio, "UsageUnit": "Shared", "x_SharedFrom": shared_from.lower(),
                "x_SharingMethod": sharing_method, "x_CostShare": share, "x_Lines": lines}
    if which == 1:
        ratio, usage, compute, share, _uuid_text, lines, memory = values
        element = {"AllocatedRatio": ratio, "UsageUnit": "GPU-Hours", "UsageQuantity": usage, "x_GpuUuid": gpu_uuid,
                   "x_Method": _method_text(method, cost_basis), "x_MeasuredBy": method, "x_CostShare": share,
                   "x_MemoryShare": memory, "x_ComputeShare": compute, "x_Lines": lines}
        if not is_pod:
            element["x_Bucket"] = subject_kind.lower()
        return element
    ratio, lines = values
    return {"AllocatedRatio": ratio, "UsageUnit": "GPU-Hours" if subject_kind == "UNAVAILABLE" else "Hours",
            "x_Bucket": subject_kind.lower(), "x_Lines": lines}


def _entry(dictionary: Mapping[Any, Any], key: Any, what: str) -> Any:
    """``dictionary[key]``; ``ValueError`` naming the key when a line names one its dictionary lacks (a ledger whose
    lines outlived a dictionary row, or a reader's bug): refused, never exported as a wrong or missing row."""
    try:
        return dictionary[key]
    except KeyError:
        raise ValueError(f"an hourly FOCUS line names {what} {key!r}, which the ledger's {what} dictionary does not "
                         "hold") from None


def focus_hour_columns(charges: Iterable[tuple[Any, FocusCharge]], hour_lines: HourLines, *,
                       billing_account_id: str | None = None) -> "FocusColumns":
    """The hourly grain's rows, as columns: per origin charge (``charges``: (its key in the lines' second field,
    the charge)), one row per pod (and label set) and one per kept bucket, ChargePeriodStart/End the hour; the rows of
    a charge ordered pods by (uid, namespace, name, tags) then the kept buckets, the charges by ``link``. What each
    column means over the hour (docs/billing.md, "FOCUS export"):

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

    The origin charge's ~45 columns are made once per charge (``FocusColumns.origin``), JSON texts once per
    distinct value (a label set's tags, a kind's and a GPU's texts), and no row is a dict: the rows are the
    columns' (``FocusColumns.rows``). Raises ``ValueError`` for lines without their origin charge, lines that do
    not add up to it, or lines naming a kind, pod, GPU or label set their dictionaries lack."""
    keyed = sorted(charges, key=lambda pair: pair[1].link)
    by_charge: dict[Any, list] = {}
    for line in hour_lines.lines:
        charge_key = line[:2]
        bucket = by_charge.get(charge_key)
        if bucket is None:
            by_charge[charge_key] = [line]
        else:
            bucket.append(line)
    orphans = set(by_charge) - {(charge.period_start_unix_ms, key) for key, charge in keyed}
    if orphans:
        raise ValueError("hourly FOCUS lines without their origin charge: "
                         f"{sorted(key for _period, key in orphans)[:3]}")
    kinds, pods, gpus, labels = hour_lines.kinds, hour_lines.pods, hour_lines.gpus, hour_lines.labels
    # Per distinct (kind, pod, GPU, label set), once: the line's row key (a pod's with its tags text, made once per
    # label set; a kept bucket's), and its element's sort key, shape and %-format (``_element_format``).
    made_of: dict[tuple, tuple] = {}
    tags_texts: dict[int, str] = {}

    def made(identity: tuple) -> tuple:
        kind_key, pod_key, gpu_key, label_id = identity
        kind = _entry(kinds, kind_key, "kind")
        pod = _entry(pods, pod_key, "pod")
        if kind[0] == "POD" and pod[0]:
            text = tags_texts.get(label_id)
            if text is None:
                text = tags_texts[label_id] = _json({k: v for k, v in _entry(labels, label_id, "label set").items()
                                                     if k not in _ORIGIN_TAG_KEYS})
            row_key = (0, *pod, text)
        else:
            row_key = (_BUCKET_ORDER.get(kind[0], 99), kind[0])
        uuid = _entry(gpus, gpu_key, "GPU")
        which, form = _element_format(kind[1], kind[2], kind[0], kind[3], kind[4], bool(uuid), row_key[0] == 0)
        out = made_of[identity] = (row_key, (kind[1] != "", uuid, kind[1]), which, form,
                                   _json_string(uuid) if which == 1 else None, kind[4])
        return out

    origin: dict[str, list] = {column: [] for column in COLUMNS if column not in _MICRO_COLUMNS
                               and column not in _UNITS_COLUMNS and column not in _ROW_COLUMNS}
    repeats: list[int] = []
    out: dict[str, list] = {name: [] for name in ("billed", "listed", "direct", "shared", "units", "details", "uid",
                                                  "name", "tags", "namespace", "pod_name", "subject", "gpu_hours")}
    billed_out, listed_out, direct_out, shared_out = out["billed"], out["listed"], out["direct"], out["shared"]
    units_out, details_out, uid_out, name_out = out["units"], out["details"], out["uid"], out["name"]
    tags_out, namespace_out, pod_name_out = out["tags"], out["namespace"], out["pod_name"]
    subject_out, gpu_hours_out = out["subject"], out["gpu_hours"]
    gpu_hours_of: dict[float, Decimal] = {}
    for charge_key, charge in keyed:
        lines = by_charge.get((charge.period_start_unix_ms, charge_key), ())
        total = charge.node_cost_micro_usd
        # Each row's lines as (element sort key, line, what ``made`` says of its identity), in the lines' order.
        groups: dict[tuple, list] = {}
        bases = set()
        for line in lines:
            known = made_of.get(line[2:6]) or made(line[2:6])
            group = groups.get(known[0])
            if group is None:
                groups[known[0]] = [(known[1], line, known)]
            else:
                group.append((known[1], line, known))
            bases.add(known[5])
        keys = sorted(groups)
        row_costs = [sum([item[1][6] for item in groups[key]]) for key in keys]
        listed = sum(row_costs)
        if listed != total:
            raise ValueError(f"{charge.link}: lines add up to {listed} micro-USD, the origin charge says {total}")
        weights = row_costs if any(row_costs) else [1] * len(keys)
        quantities = apportion(hour_units(charge.billed_milliseconds), weights) if keys else ()
        basis = "+".join(sorted(basis for basis in bases if basis)) or "unknown"
        common = _origin_columns(
            cluster=charge.cluster, node_name=charge.node_name, provider=charge.provider, region=charge.region,
            zone=charge.zone, provider_id=charge.provider_id, instance_type=charge.instance_type,
            price_model=charge.price_model, price_version=charge.price_version,
            price_per_hour_usd=charge.price_per_hour_usd, split_rule=charge.split_rule, sharing=charge.sharing,
            basis=basis, start_ms=charge.period_start_unix_ms, end_ms=charge.period_start_unix_ms + _MS_PER_HOUR,
            description=f"{charge.instance_type} {charge.price_model} GPU node {charge.node_name}, hour of "
                        f"{charge.window_seconds} s windows",
            billing_account_id=billing_account_id)
        for column, values in origin.items():
            values.append(common.get(column))
        repeats.append(len(keys))
        origin_ms = charge.billed_milliseconds
        element_count = len(lines)
        for key, list_micro, units in zip(keys, row_costs, quantities):
            is_pod = key[0] == 0
            billed_micro = shared_micro = 0
            gpu_ms = 0.0
            texts = []
            group = groups[key]
            if len(group) > 1:
                group.sort(key=_first)  # stable: equal keys keep the lines' order, as before
            for _order, line, (_row, _sort, which, form, gpu_text, _basis) in group:
                cost = line[6]
                billed_micro += line[7]
                # int / int is correctly rounded: the same float as float(Fraction(cost, total)).
                ratio = cost / total if total else 1.0 / element_count
                if which == 1:
                    if is_pod:
                        gpu_ms += line[14]
                    if origin_ms:
                        values = (ratio, line[14] / _MS_PER_HOUR, line[13] / origin_ms, line[11] / origin_ms,
                                  gpu_text, line[8], line[12] / origin_ms)
                    else:
                        values = (ratio, line[14] / _MS_PER_HOUR, 0.0, 0.0, gpu_text, line[8], 0.0)
                    finite = ratio + values[1] + values[2] + values[3] + values[6]
                elif which == 0:
                    shared_micro += cost
                    values = (ratio, line[11] / origin_ms if origin_ms else 0.0, line[8])
                    finite = ratio + values[1]
                else:
                    values = (ratio, line[8])
                    finite = ratio
                if finite - finite == 0.0:  # every float finite: JSON's float text is repr's
                    texts.append(form % values)
                else:
                    texts.append(_json(_element_dict(which, values, kinds[line[2]], gpus[line[4]], is_pod)))
            billed_out.append(billed_micro)
            listed_out.append(list_micro)
            direct_out.append(list_micro - shared_micro)
            shared_out.append(shared_micro)
            units_out.append(units)
            details_out.append('{"Elements":[' + ",".join(texts) + "]}")
            if is_pod:
                uid_out.append(key[1])
                name_out.append(f"{key[2]}/{key[3]}")
                tags_out.append(key[4])
                namespace_out.append(key[2])
                pod_name_out.append(key[3])
                subject_out.append("pod")
                hours = gpu_hours_of.get(gpu_ms)
                if hours is None:
                    hours = gpu_hours_of[gpu_ms] = (Decimal(gpu_ms) / _MS_PER_HOUR).quantize(_HOURS_QUANTUM)
                gpu_hours_out.append(hours)
            else:
                uid_out.append(None)
                name_out.append(None)
                tags_out.append(None)
                namespace_out.append(None)
                pod_name_out.append(None)
                subject_out.append(key[1].lower())
                gpu_hours_out.append(None)
    return FocusColumns(origin, repeats,
                        {column: out[name] for column, name in _ROW_COLUMNS.items()},
                        {column: out[name] for column, name in _MICRO_COLUMNS.items()},
                        {column: out[name] for column, name in _UNITS_COLUMNS.items()})


def _first(item: tuple) -> Any:
    return item[0]


# -- columns, and the writers ---------------------------------------------------------------------------------------


class FocusColumns:
    """Rows of the dataset held column by column: what the hourly grain builds (``focus_hour_columns``) and what the
    writers take (``FocusColumns.of``: rows as ``focus_rows`` makes them, too).

    * ``origin``: column -> its value per origin charge, for the columns every row of a charge shares (FOCUS 1.3);
      ``repeats``: how many rows each charge has, in order;
    * ``per_row``: column -> its value per row, as a row holds it (text, int, ``Decimal``, None);
    * ``micro``: the money columns, per row in micro-dollars (a row's ``Decimal`` is ``usd_decimal`` of it; the
      Parquet double ``micro / 10**6``, correctly rounded as ``float(Decimal)`` is: the same double);
    * ``units``: the quantities, per row in 1e-10 hours (``Decimal(units).scaleb(-10)``; ``units / 10**10``).

    Every column of ``COLUMNS`` is in exactly one of them. ``rows()`` (and iterating) gives the rows as dicts in
    ``COLUMNS`` order with the values ``focus_rows`` gives (what the tests and row readers use); the writers never
    make them."""

    __slots__ = ("origin", "repeats", "per_row", "micro", "units", "_count")

    def __init__(self, origin: Mapping[str, Sequence[Any]], repeats: Sequence[int],
                 per_row: Mapping[str, Sequence[Any]], micro: Mapping[str, Sequence[int]] | None = None,
                 units: Mapping[str, Sequence[int]] | None = None) -> None:
        self.origin, self.repeats, self.per_row = dict(origin), list(repeats), dict(per_row)
        self.micro, self.units = dict(micro or {}), dict(units or {})
        missing = set(COLUMNS).difference(self.origin, self.per_row, self.micro, self.units)
        if missing:
            raise ValueError(f"FOCUS columns without values: {sorted(missing)}")
        self._count = sum(self.repeats) if self.origin else len(next(iter(self.per_row.values()), ()))

    @classmethod
    def of(cls, chunk: "FocusColumns | Sequence[Mapping[str, Any]]") -> "FocusColumns":
        """``chunk`` as columns: itself, or rows (``focus_rows``'; a column a row lacks is null) transposed."""
        if isinstance(chunk, FocusColumns):
            return chunk
        return cls({}, (), dict(zip(COLUMNS, _columns_of(chunk))))

    def __len__(self) -> int:
        return self._count

    def _charge_of_row(self) -> list[int]:
        return [index for index, count in enumerate(self.repeats) for _ in range(count)]

    def rows(self) -> list[dict[str, Any]]:
        """The rows as ``focus_rows`` gives them (column -> value: ``Decimal`` money and quantities, text times)."""
        charge = self._charge_of_row()
        out = []
        for i in range(self._count):
            row = {}
            for column in COLUMNS:
                if column in self.per_row:
                    row[column] = self.per_row[column][i]
                elif column in self.micro:
                    row[column] = usd_decimal(self.micro[column][i])
                elif column in self.units:
                    row[column] = Decimal(self.units[column][i]).scaleb(-HOURS_DECIMALS)
                else:
                    row[column] = self.origin[column][charge[i]]
            out.append(row)
        return out

    def __iter__(self):
        return iter(self.rows())

    def text_columns(self) -> list[list[str]]:
        """Each column's CSV cells (``COLUMNS`` order): ``str`` of the row's value, empty for null; an origin
        charge's made once and repeated."""
        charge = self._charge_of_row() if self.origin else []
        out = []
        for column in COLUMNS:
            if column in self.per_row:
                out.append(["" if v is None else str(v) for v in self.per_row[column]])
            elif column in self.micro:
                out.append([str(usd_decimal(v)) for v in self.micro[column]])
            elif column in self.units:
                out.append([str(Decimal(v).scaleb(-HOURS_DECIMALS)) for v in self.units[column]])
            else:
                texts = ["" if v is None else str(v) for v in self.origin[column]]
                out.append([texts[c] for c in charge])
        return out

    def arrow_table(self, metadata: Mapping[str, str] | None = None):
        """The columns as a pyarrow table: times ``timestamp[ms, UTC]``, money and quantities ``double``, the
        micro-dollar columns ``int64``, text ``string``; an origin charge's values converted once and taken for
        its rows."""
        import numpy as np
        import pyarrow as pa

        taken = None
        if self.origin:
            taken = pa.array(np.repeat(np.arange(len(self.repeats), dtype=np.int64),
                                       np.asarray(self.repeats, dtype=np.int64)), type=pa.int64())
        fields, arrays = [], []
        for column in COLUMNS:
            kind = _arrow_type(column)
            if column in self.per_row:
                array = _arrow_array(column, self.per_row[column], kind)
            elif column in self.micro:
                array = pa.array(_scaled_floats(self.micro[column], 10**6), type=kind)
            elif column in self.units:
                array = pa.array(_scaled_floats(self.units[column], 10**HOURS_DECIMALS), type=kind)
            else:
                array = _arrow_array(column, self.origin[column], kind).take(taken)
            fields.append(pa.field(column, kind))
            arrays.append(array)
        return pa.Table.from_arrays(arrays, schema=pa.schema(
            fields, metadata={"focus_version": FOCUS_VERSION, **(metadata or {})}))


def _scaled_floats(values: Sequence[int], scale: int):
    """``value / scale`` of each integer as the correctly rounded double (what ``float`` of its ``Decimal`` is):
    numpy's division where every value converts to a double exactly (|v| <= 2**53), Python's int / int otherwise."""
    import numpy as np

    try:
        ints = np.asarray(values, dtype=np.int64)
    except OverflowError:
        ints = None
    if ints is not None and (not len(ints) or (int(ints.min()) >= -2**53 and int(ints.max()) <= 2**53)):
        return ints.astype(np.float64) / float(scale)
    return [v / scale for v in values]


def focus_csv(rows: "Sequence[Mapping[str, Any]] | FocusColumns") -> str:
    """The rows as CSV (RFC 4180, a header of the column names; null is an empty cell). No cell is rewritten
    against spreadsheet formulas: FOCUS consumers read the values as they are (every text here is a name
    Kubernetes validated, a JSON object or gpumeter's own)."""
    buffer = io.StringIO()
    write_focus_csv_chunks([rows], buffer)
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


def _arrow_type(column: str):
    import pyarrow as pa

    if column in DATETIME_COLUMNS:
        return pa.timestamp("ms", tz="UTC")
    if column in MONEY_COLUMNS or column in QUANTITY_COLUMNS:
        return pa.float64()
    if column in INTEGER_COLUMNS:
        return pa.int64()
    return pa.string()


def _text_array(values: Sequence[Any]):
    """Texts without a null, all ASCII (JSON's texts are), as an Arrow string array made from one buffer and their
    offsets; None where they are not (``pa.array`` converts those). The same array ``pa.array`` makes, without its
    growing a buffer string by string (with pyarrow's allocator 0.5-0.8 s for a day's 75 MB of
    ``AllocatedMethodDetails``, against ~0.1 s)."""
    import numpy as np
    import pyarrow as pa

    if not values or not all(type(value) is str for value in values):
        return None
    data = "".join(values).encode("utf-8")
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    if len(data) != int(lengths.sum()) or len(data) >= 2**31:
        return None  # a non-ASCII text (its UTF-8 bytes are more than its characters), or past int32 offsets
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.StringArray.from_buffers(len(values), pa.py_buffer(offsets), pa.py_buffer(data))


def _arrow_array(column: str, values: Sequence[Any], kind):
    """One column's values as a row holds them (ISO text times, ``Decimal`` money, ints, text) as an Arrow array."""
    import pyarrow as pa

    if column == "AllocatedMethodDetails":
        array = _text_array(values)
        if array is not None:
            return array
    if column in DATETIME_COLUMNS:
        # A few distinct times (a period's start and end, its month) on many rows: each parsed once.
        parsed = {v: datetime.fromisoformat(v.replace("Z", "+00:00")) for v in set(values) if v is not None}
        values = [None if v is None else parsed[v] for v in values]
    elif column in MONEY_COLUMNS or column in QUANTITY_COLUMNS:
        values = [None if v is None else float(v) for v in values]
    return pa.array(values, type=kind)


def _arrow_table(rows: "Sequence[Mapping[str, Any]] | FocusColumns", metadata: Mapping[str, str] | None = None):
    """The chunk's Arrow table: a chunk that is one already (``export.focus_hour_tables``'s, made by
    ``FocusColumns.arrow_table`` in a worker) with the schema's metadata set as ``arrow_table`` sets it."""
    import pyarrow as pa

    if isinstance(rows, pa.Table):
        return rows.replace_schema_metadata({"focus_version": FOCUS_VERSION, **(metadata or {})})
    return FocusColumns.of(rows).arrow_table(metadata)


def write_focus_parquet(rows: "Sequence[Mapping[str, Any]] | FocusColumns", path: Path) -> None:
    """The rows as a Parquet file (pyarrow): times ``timestamp[ms, UTC]``, money and quantities ``double`` (the
    exact micro-dollars are in ``x_ListCostMicroUsd``/``x_BilledCostMicroUsd``), text ``string``."""
    import pyarrow.parquet as pq

    pq.write_table(_arrow_table(rows), str(path))


def write_focus_parquet_chunks(chunks: Iterable["Sequence[Mapping[str, Any]] | FocusColumns"], path: Path, *,
                               metadata: Mapping[str, str] | None = None) -> int:
    """``write_focus_parquet`` of rows that come a chunk at a time (one row group per chunk: a month of a fleet's
    rows need not be in memory at once), each chunk rows or ``FocusColumns``; ``metadata`` joins the schema's
    (``gpumeter_grain``). Returns the rows."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.parquet as pq

    writer = None
    count = 0
    # A row group is encoded and compressed in a thread (pyarrow lets go of the GIL) while the next chunk is made;
    # one at a time, in order, so the file is the one a loop writes.
    with ThreadPoolExecutor(1) as background:
        written = None
        try:
            for chunk in chunks:
                table = _arrow_table(chunk, metadata)
                if writer is None:
                    writer = pq.ParquetWriter(str(path), table.schema)
                if written is not None:
                    written.result()
                    written = None
                if table.num_rows:
                    written = background.submit(writer.write_table, table)
                count += table.num_rows
            if written is not None:
                written.result()
            if writer is None:
                writer = pq.ParquetWriter(str(path), _arrow_table([], metadata).schema)
        finally:
            if written is not None:
                written.exception()  # wait: the writer is closed after its last row group, never during it
            if writer is not None:
                writer.close()
    return count


def write_focus_csv_chunks(chunks: Iterable["Sequence[Mapping[str, Any]] | FocusColumns"], stream: Any) -> int:
    """``focus_csv`` of rows that come a chunk at a time (rows or ``FocusColumns``), written to a text ``stream``;
    returns the rows."""
    writer = csv.writer(stream, lineterminator="\n")
    writer.writerow(COLUMNS)
    count = 0
    for chunk in chunks:
        if not isinstance(chunk, (FocusColumns, Sequence)):
            raise TypeError(f"a CSV is written from rows or FocusColumns (exact values), not {type(chunk).__name__}")
        columns = FocusColumns.of(chunk)
        writer.writerows(zip(*columns.text_columns()))
        count += len(columns)
    return count
