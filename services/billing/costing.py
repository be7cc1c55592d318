"""Money for one node-window: share rows in, cost records that add up to the node's bill exactly. Pure.

Contract of ``price_node_window(shares, price)`` (``cost_node_window`` returns just its records):

* ``shares`` are all the ``GpuShare`` rows of one (cluster, node, window): ``units_in_node`` units, each with
  ``rows_in_unit`` rows whose ``cost_share`` add up to 1 (within ``COST_SHARE_TOLERANCE``). Exact duplicates
  (redelivery) are dropped; two different rows for the same (unit, subject kind, pod) are ``InconsistentShares``,
  as are rows that disagree on the node's facts or an incomplete node-window.
* **Billed time** is the node's covered seconds (``node_covered_seconds``, what the attributor saw of the
  window), kept to the millisecond and capped at the window. Billing is per second of that time; the clouds'
  per-instance minimums (AWS: 60 s per launch) are not applied per window.
* **Node line item**: ``node_cost_micro_usd = round_half_up(rate × billed_seconds / 3600)`` in micro-dollars,
  with the rate from ``price`` (``NodePrice``).
* **Level 1, node → parts**: the node's micro-dollars are apportioned (largest remainder) over the parts whose exact
  costs make up the node: every unit (its physical GPU's rate × ``gpu_fraction``), GPU capacity the price bills
  but no unit reported (a GPU missing from the window, fallen off the bus: its own ``UNAVAILABLE`` line with
  ``gpu_uuid`` None), and
  ``node_other`` (its own ``NODE_OTHER`` line, always present). So per node and window the units, the missing
  capacity and ``node_other`` equal the node's line item exactly.
* **Level 2, unit → rows**: each unit's micro-dollars are apportioned over its rows by ``cost_share`` (pods, idle,
  driver_reserved, unattributed, unavailable), so per unit and window the rows equal the unit's cost exactly.
* **Level 3, sharing** (``services.billing.sharing``): the buckets the ``SharingPolicy`` shares (none by
  default) are replaced by shared lines of the node-window's pods, each bucket kind's total apportioned over the
  pods by the kind's method; per node-window the lines still equal the bill exactly. The policy is recorded on
  the bill (``NodeBill.sharing``).
* **Largest remainder** (Hamilton): every part gets the floor of its exact quota; the micro-dollars left go one
  each to the largest fractional remainders. Ties go to the part that sorts first: units by ``gpu_uuid``, rows by
  (subject kind POD < IDLE < DRIVER_RESERVED < UNATTRIBUTED < UNAVAILABLE, ``pod_uid``), then missing capacity,
  then node_other.
  The result does not depend on the input order. Every part is within one micro-dollar of its exact quota, and
  a part whose exact cost is zero gets zero.

``window_cost_record`` turns a priced node-window into the ``NodeWindowCost`` record of the node-window-costs topic.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Iterable, Sequence

from gpumeter.clock import iso_utc  # noqa: F401 - billing's records and reports print times with it
from gpumeter.errors import InvalidMessage, OutOfRange
from schemas.records import CostRecord, CostSubjectKind, GpuShare, NodeWindowShares, ShareSubjectKind
from schemas.records import NodeWindowCost as NodeWindowCostRecord
from services.billing.catalog import PriceCatalog, PriceError, normalize_price_model, normalize_provider
from services.billing.money import apportion
from services.billing.sharing import KEEP_ALL, SharingPolicy, apply_sharing, requests_by_pod
from services.billing.pricing import (
    DEFAULT_SPLIT_POLICY,
    MICRO_USD_PER_USD,
    SECONDS_PER_HOUR,
    NodePrice,
    SplitPolicy,
    price_node,
)

COST_SHARE_TOLERANCE = 1e-6
GPU_FRACTION_TOLERANCE = 1e-6
COVERED_SECONDS_TOLERANCE = 1e-3
# MIG fractions are k/7 or k/8 of a GPU; as floats they are recovered exactly with this denominator bound.
_FRACTION_DENOMINATOR_LIMIT = 1_000_000
_MS_PER_HOUR = SECONDS_PER_HOUR * 1000

_SUBJECT_ORDER = {
    ShareSubjectKind.POD: 0,
    ShareSubjectKind.IDLE: 1,
    ShareSubjectKind.DRIVER_RESERVED: 2,
    ShareSubjectKind.UNATTRIBUTED: 3,
    ShareSubjectKind.UNAVAILABLE: 4,
}


class InconsistentShares(InvalidMessage):
    """Share rows that cannot all be true: conflicting duplicates, disagreeing node facts, an incomplete
    node-window, or cost shares of a unit that do not add up to 1."""

    reason_code = "INCONSISTENT_SHARES"


@dataclass(frozen=True, slots=True, order=True)
class NodeWindowKey:
    cluster: str
    node_name: str
    window_start_unix_ms: int


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What every row of one node-window agrees on, plus the count of physical GPUs its units cover."""

    key: NodeWindowKey
    window_seconds: int
    node_covered_seconds: float
    cloud_provider: str
    region: str
    instance_type: str
    price_model: str
    gpu_model: str
    units_in_node: int
    physical_gpu_fractions: tuple[tuple[str, Fraction], ...]
    zone: str = ""
    provider_id: str = ""

    @property
    def physical_gpu_count(self) -> int:
        return len(self.physical_gpu_fractions)

    @property
    def reported_gpus(self) -> Fraction:
        """Whole GPUs the units stand for (each physical GPU counted at most once)."""
        return sum((min(f, Fraction(1)) for _, f in self.physical_gpu_fractions), Fraction(0))


@dataclass(frozen=True, slots=True)
class UnitCost:
    """One priced part of the node: a unit, missing GPU capacity (``gpu_uuid`` None, subject UNAVAILABLE) or
    node_other (``gpu_uuid`` None, subject NODE_OTHER). ``exact_micro_usd`` is the unrounded cost."""

    gpu_uuid: str | None
    subject_kind: CostSubjectKind | None
    gpu_fraction: Fraction
    exact_micro_usd: Fraction
    cost_micro_usd: int


@dataclass(frozen=True, slots=True)
class NodeBill:
    """The node's line item for one window and how it splits (GPU units + missing capacity vs node_other)."""

    cluster: str
    node_name: str
    window_start_unix_ms: int
    window_seconds: int
    billed_milliseconds: int
    provider: str
    region: str
    instance_type: str
    price_model: str
    gpu_count: int
    node_cost_micro_usd: int
    gpu_cost_micro_usd: int
    node_other_micro_usd: int
    price: NodePrice
    zone: str = ""
    provider_id: str = ""
    sharing: str = KEEP_ALL.describe()  # the SharingPolicy the lines were shared by (``describe()``)
    gpu_model: str = ""  # the node's GPU model, as its share rows named it (the ledger's rollups group by it)

    @property
    def key(self) -> NodeWindowKey:
        return NodeWindowKey(self.cluster, self.node_name, self.window_start_unix_ms)

    @property
    def billed_seconds(self) -> float:
        return self.billed_milliseconds / 1000

    @property
    def price_version(self) -> str:
        return self.price.price_version

    @property
    def price_per_hour_usd(self) -> str:
        return self.price.price_per_hour_usd_text

    def as_json(self) -> dict[str, Any]:
        """The ``bills.jsonl`` object: node, window_start (ISO 8601 UTC), window_seconds, instance_type,
        price_per_hour_usd, node_cost_micro_usd, and the split."""
        return {
            "cluster": self.cluster,
            "node": self.node_name,
            "window_start": iso_utc(self.window_start_unix_ms),
            "window_seconds": self.window_seconds,
            "billed_seconds": self.billed_seconds,
            "provider": self.provider,
            "region": self.region,
            "zone": self.zone,
            "provider_id": self.provider_id,
            "instance_type": self.instance_type,
            "price_model": self.price_model,
            "price_per_hour_usd": float(self.price_per_hour_usd),
            "gpu_count": self.gpu_count,
            "node_cost_micro_usd": self.node_cost_micro_usd,
            "gpu_cost_micro_usd": self.gpu_cost_micro_usd,
            "node_other_micro_usd": self.node_other_micro_usd,
            "split_rule": self.price.split_rule.value,
            "price_version": self.price_version,
            "sharing": self.sharing,
        }


@dataclass(frozen=True, slots=True)
class NodeWindowCost:
    """Everything one node-window costs: the records (units' rows, missing capacity, node_other), the bill, and
    the level-1 parts (units sorted by uuid, then missing capacity, then node_other)."""

    costs: tuple[CostRecord, ...]
    bill: NodeBill
    parts: tuple[UnitCost, ...]


def cost_record_json(record: CostRecord) -> dict[str, Any]:
    """The ``costs.jsonl`` object of one record (subject kinds in lower case, ``gpu_uuid`` null for node lines)."""
    return {
        "window_start": iso_utc(record.window_start_unix_ms),
        "window_seconds": record.window_seconds,
        "cluster": record.cluster,
        "node": record.node_name,
        "gpu_uuid": record.gpu_uuid,
        "subject_kind": record.subject_kind.value.lower(),
        "pod_uid": record.pod_uid,
        "namespace": record.namespace,
        "pod": record.pod_name,
        "labels": dict(record.labels),
        "cost_share": record.cost_share,
        "cost_micro_usd": record.cost_micro_usd,
        "instance_type": record.instance_type,
        "price_model": record.price_model,
        "price_version": record.price_version,
        "shared_from": None if record.shared_from is None else record.shared_from.value.lower(),
        "sharing_method": record.sharing_method or None,
        "method": record.method or None,
        "cost_basis": record.cost_basis or None,
        "memory_share": record.memory_share,
        "compute_share": record.compute_share,
        "gpu_fraction": record.gpu_fraction,
    }


def billed_milliseconds(node_covered_seconds: float, window_seconds: int) -> int:
    """The node's billed time in whole milliseconds; ``OutOfRange`` when it cannot be true."""
    if not math.isfinite(node_covered_seconds) or node_covered_seconds < 0:
        raise OutOfRange(f"node_covered_seconds {node_covered_seconds} must be finite and >= 0")
    if node_covered_seconds > window_seconds + COVERED_SECONDS_TOLERANCE:
        raise OutOfRange(f"node_covered_seconds {node_covered_seconds} exceeds the window ({window_seconds} s)")
    return min(math.floor(node_covered_seconds * 1000 + 0.5), window_seconds * 1000)


def gpu_fraction_exact(value: float) -> Fraction:
    """A unit's ``gpu_fraction`` as an exact rational (1/7 stays 1/7); ``OutOfRange`` outside (0, 1]."""
    if not math.isfinite(value) or value <= 0 or value > 1 + GPU_FRACTION_TOLERANCE:
        raise OutOfRange(f"gpu_fraction {value} must be within (0, 1]")
    return min(Fraction(value).limit_denominator(_FRACTION_DENOMINATOR_LIMIT), Fraction(1))


def _identity(share: GpuShare) -> tuple[str, str, str]:
    return (share.gpu_uuid, share.subject_kind.value, share.pod_uid or "")


def _row_order(share: GpuShare) -> tuple[int, str]:
    return (_SUBJECT_ORDER[share.subject_kind], share.pod_uid or "")


def _key(share: GpuShare) -> NodeWindowKey:
    return NodeWindowKey(share.cluster, share.node_name, share.window_start_unix_ms)


def dedupe_shares(shares: Iterable[GpuShare]) -> tuple[GpuShare, ...]:
    """Drop exact duplicates; ``InconsistentShares`` when two rows share an identity but differ."""
    seen: dict[tuple[NodeWindowKey, tuple[str, str, str]], GpuShare] = {}
    for share in shares:
        ident = (_key(share), _identity(share))
        first = seen.setdefault(ident, share)
        if first is not share and first != share:
            raise InconsistentShares(f"two different rows for {ident} (a redelivered share must be identical)")
    return tuple(seen.values())


_NODE_FIELDS = ("window_seconds", "node_covered_seconds", "cloud_provider", "region", "instance_type",
                "price_model", "units_in_node", "zone", "provider_id")
_UNIT_FIELDS = ("parent_gpu_uuid", "gpu_model", "gpu_fraction", "rows_in_unit")
_node_fields_of = operator.attrgetter(*_NODE_FIELDS)
_unit_fields_of = operator.attrgetter(*_UNIT_FIELDS)


def _fields_to_compare(head: GpuShare, getter: Any) -> tuple | None:
    """``head``'s fields as one tuple when none is NaN: a row's tuple then equals it exactly when every field is
    ``==`` (a tuple compares identical elements as equal, so a shared NaN would pass); None: compare field by
    field."""
    values = getter(head)
    return values if all(v == v for v in values) else None  # noqa: PLR0124 -- v != v: NaN


def _disagreement(row: GpuShare, head: GpuShare, head_fields: tuple | None, getter: Any,
                  names: Sequence[str]) -> str | None:
    """The first of ``names`` on which ``row`` differs from ``head`` (``!=``), or None; at once when the tuples
    are equal."""
    if head_fields is not None and getter(row) == head_fields:
        return None
    return next((name for name in names if getattr(row, name) != getattr(head, name)), None)


def node_facts(shares: Sequence[GpuShare]) -> NodeFacts:
    """Validate that ``shares`` are one complete, consistent node-window (after ``dedupe_shares``) and return
    its facts. Raises ``InconsistentShares`` or ``OutOfRange``."""
    if not shares:
        raise InconsistentShares("no share rows")
    first = shares[0]
    key = _key(first)
    units: dict[str, list[GpuShare]] = {}
    node_fields = _fields_to_compare(first, _node_fields_of)
    for share in shares:
        if _key(share) != key:
            raise InconsistentShares(f"rows of {key} and {_key(share)} in one node-window")
        name = _disagreement(share, first, node_fields, _node_fields_of, _NODE_FIELDS)
        if name is not None:
            raise InconsistentShares(f"{key}: rows disagree on {name}")
        units.setdefault(share.gpu_uuid, []).append(share)
    if first.window_seconds <= 0:
        raise OutOfRange(f"window_seconds {first.window_seconds} must be > 0")
    if first.units_in_node != len(units):
        raise InconsistentShares(f"{key}: {len(units)} units present, units_in_node says {first.units_in_node}")
    physical: dict[str, Fraction] = {}
    for gpu_uuid, rows in units.items():
        head = rows[0]
        unit_fields = _fields_to_compare(head, _unit_fields_of)
        for row in rows:
            name = _disagreement(row, head, unit_fields, _unit_fields_of, _UNIT_FIELDS)
            if name is not None:
                raise InconsistentShares(f"{key} unit {gpu_uuid}: rows disagree on {name}")
            if not math.isfinite(row.cost_share) or not (0 <= row.cost_share <= 1 + COST_SHARE_TOLERANCE):
                raise OutOfRange(f"{key} unit {gpu_uuid}: cost_share {row.cost_share} must be within [0, 1]")
            if (row.subject_kind is ShareSubjectKind.POD) != bool(row.pod_uid):
                raise InconsistentShares(f"{key} unit {gpu_uuid}: a pod row needs a pod_uid, a bucket row has none")
        if head.rows_in_unit != len(rows):
            raise InconsistentShares(f"{key} unit {gpu_uuid}: {len(rows)} rows present, rows_in_unit says "
                                     f"{head.rows_in_unit}")
        total_share = math.fsum(r.cost_share for r in rows)
        if abs(total_share - 1) > COST_SHARE_TOLERANCE:
            raise InconsistentShares(f"{key} unit {gpu_uuid}: cost shares add up to {total_share!r}, not 1")
        parent = head.parent_gpu_uuid or gpu_uuid
        physical[parent] = physical.get(parent, Fraction(0)) + gpu_fraction_exact(head.gpu_fraction)
    for parent, fraction in physical.items():
        if fraction > 1 + Fraction(GPU_FRACTION_TOLERANCE):
            raise InconsistentShares(f"{key}: units of GPU {parent} add up to {float(fraction)} GPUs")
    billed_milliseconds(first.node_covered_seconds, first.window_seconds)
    return NodeFacts(
        key=key,
        window_seconds=first.window_seconds,
        node_covered_seconds=first.node_covered_seconds,
        cloud_provider=first.cloud_provider,
        region=first.region,
        instance_type=first.instance_type,
        price_model=first.price_model,
        gpu_model=first.gpu_model,
        units_in_node=first.units_in_node,
        physical_gpu_fractions=tuple(sorted(physical.items())),
        zone=first.zone,
        provider_id=first.provider_id,
    )


def _check_price_fits(facts: NodeFacts, price: NodePrice) -> None:
    mismatches = []
    if normalize_provider(facts.cloud_provider) != price.provider:
        mismatches.append(f"provider {facts.cloud_provider!r} vs {price.provider!r}")
    if facts.region.strip().lower() != price.region:
        mismatches.append(f"region {facts.region!r} vs {price.region!r}")
    if facts.instance_type.strip().lower() != price.instance_type.lower():
        mismatches.append(f"instance type {facts.instance_type!r} vs {price.instance_type!r}")
    if normalize_price_model(facts.price_model) != price.price_model:
        mismatches.append(f"price model {facts.price_model!r} vs {price.price_model!r}")
    if mismatches:
        raise PriceError(f"{facts.key}: the price is for another node: {', '.join(mismatches)}")
    if facts.physical_gpu_count > price.gpu_count:
        raise PriceError(f"{facts.key}: {facts.physical_gpu_count} GPUs in the window but the price covers "
                         f"{price.gpu_count} ({price.instance_type}); fix the catalog's gpu_count")


def price_node_window(shares: Sequence[GpuShare], price: NodePrice,
                      sharing: SharingPolicy = KEEP_ALL) -> NodeWindowCost:
    """Cost one complete node-window and share its buckets by ``sharing`` (see the module docstring)."""
    rows = dedupe_shares(shares)
    return _price_checked_node_window(rows, node_facts(rows), price, sharing)


def _price_checked_node_window(rows: Sequence[GpuShare], facts: NodeFacts, price: NodePrice,
                               sharing: SharingPolicy) -> NodeWindowCost:
    """``price_node_window`` of ``rows`` already deduplicated and checked into ``facts`` (``bill_node_window``
    checks them once, to look the price up, rather than twice: about 1 ms of a node-window's ~20)."""
    _check_price_fits(facts, price)
    billed_ms = billed_milliseconds(facts.node_covered_seconds, facts.window_seconds)
    scale = Fraction(MICRO_USD_PER_USD * billed_ms, _MS_PER_HOUR)  # billed hours x 10^6: USD/h -> micro-dollars

    units: dict[str, list[GpuShare]] = {}
    for share in rows:
        units.setdefault(share.gpu_uuid, []).append(share)
    unit_ids = sorted(units)
    fractions = [gpu_fraction_exact(units[u][0].gpu_fraction) for u in unit_ids]
    # Units of one GPU may add up to a hair over 1 (float fractions within tolerance): count the GPU once.
    missing_fraction = price.gpu_count - facts.reported_gpus

    parts: list[tuple[str | None, CostSubjectKind | None, Fraction, Fraction]] = [
        (u, None, f, price.gpu_usd_per_hour * f * scale) for u, f in zip(unit_ids, fractions)
    ]
    if missing_fraction > 0:
        parts.append((None, CostSubjectKind.UNAVAILABLE, missing_fraction,
                      price.gpu_usd_per_hour * missing_fraction * scale))
    parts.append((None, CostSubjectKind.NODE_OTHER, Fraction(0), price.node_other_usd_per_hour * scale))

    node_exact = price.node_usd_per_hour * scale
    node_micro = math.floor(node_exact + Fraction(1, 2))
    part_micro = apportion(node_micro, [p[3] for p in parts])

    common = dict(
        cluster=facts.key.cluster,
        node_name=facts.key.node_name,
        window_start_unix_ms=facts.key.window_start_unix_ms,
        window_seconds=facts.window_seconds,
        instance_type=facts.instance_type,
        price_model=price.price_model,
        price_version=price.price_version,
    )
    records: list[CostRecord] = []
    unit_costs: list[UnitCost] = []
    for (gpu_uuid, kind, fraction, exact), micro in zip(parts, part_micro):
        unit_costs.append(UnitCost(gpu_uuid, kind, fraction, exact, micro))
        if gpu_uuid is None:
            assert kind is not None
            records.append(CostRecord(gpu_uuid=None, subject_kind=kind, pod_uid=None, namespace=None, pod_name=None,
                                      labels=MappingProxyType({}), cost_share=1.0, cost_micro_usd=micro,
                                      gpu_fraction=float(fraction), **common))
            continue
        unit_rows = sorted(units[gpu_uuid], key=_row_order)
        row_micro = apportion(micro, [r.cost_share for r in unit_rows])  # floats, at their exact value
        for row, amount in zip(unit_rows, row_micro):
            records.append(
                CostRecord(
                    gpu_uuid=gpu_uuid,
                    subject_kind=CostSubjectKind(row.subject_kind.value),
                    pod_uid=row.pod_uid,
                    namespace=row.namespace,
                    pod_name=row.pod_name,
                    labels=row.labels,
                    cost_share=row.cost_share,
                    cost_micro_usd=amount,
                    carried_label_keys=row.carried_label_keys,
                    method=row.method,
                    cost_basis=row.cost_basis,
                    memory_share=row.memory_share,
                    compute_share=row.compute_share,
                    gpu_fraction=row.gpu_fraction,
                    **common,
                )
            )
    # The pods' requests weigh only a policy that shares (a keep-all policy returns the lines as they are).
    requests = requests_by_pod(rows) if sharing.shares_anything else MappingProxyType({})
    records = list(apply_sharing(records, requests, sharing))
    node_other_micro = part_micro[-1]
    bill = NodeBill(
        cluster=facts.key.cluster,
        node_name=facts.key.node_name,
        window_start_unix_ms=facts.key.window_start_unix_ms,
        window_seconds=facts.window_seconds,
        billed_milliseconds=billed_ms,
        provider=price.provider,
        region=price.region,
        instance_type=facts.instance_type,
        price_model=price.price_model,
        gpu_count=price.gpu_count,
        node_cost_micro_usd=node_micro,
        gpu_cost_micro_usd=node_micro - node_other_micro,
        node_other_micro_usd=node_other_micro,
        price=price,
        zone=facts.zone,
        provider_id=facts.provider_id,
        sharing=sharing.describe(),
        gpu_model=facts.gpu_model,
    )
    return NodeWindowCost(costs=tuple(records), bill=bill, parts=tuple(unit_costs))


def cost_node_window(shares: Sequence[GpuShare], price: NodePrice,
                     sharing: SharingPolicy = KEEP_ALL) -> tuple[CostRecord, ...]:
    """The cost records of one complete node-window (``price_node_window(...).costs``)."""
    return price_node_window(shares, price, sharing).costs


def bill_node_window(
    shares: Sequence[GpuShare], catalog: PriceCatalog, policy: SplitPolicy = DEFAULT_SPLIT_POLICY,
    sharing: SharingPolicy = KEEP_ALL,
) -> NodeWindowCost:
    """Look the node's price up in ``catalog``, split it by ``policy``, cost the node-window and share its
    buckets by ``sharing``."""
    rows = dedupe_shares(shares)
    facts = node_facts(rows)
    price = price_node(
        catalog,
        provider=facts.cloud_provider,
        region=facts.region,
        instance_type=facts.instance_type,
        price_model=facts.price_model,
        node_name=facts.key.node_name,
        gpu_model=facts.gpu_model,
        observed_gpu_count=facts.physical_gpu_count,
        policy=policy,
    )
    return _price_checked_node_window(rows, facts, price, sharing)


def window_cost_record(priced: NodeWindowCost, shares: NodeWindowShares) -> NodeWindowCostRecord:
    """The node-window-costs record of one bill: the bill's figures and every cost line (``priced``), with the
    pods as the node-window's shares described them (``shares``: requests, workload)."""
    bill = priced.bill
    return NodeWindowCostRecord.from_cost_records(
        priced.costs, billed_milliseconds=bill.billed_milliseconds, cloud_provider=bill.provider,
        region=bill.region, zone=bill.zone, provider_id=bill.provider_id, price_per_hour_usd=bill.price_per_hour_usd,
        split_rule=bill.price.split_rule.value, gpu_count=bill.gpu_count, gpu_cost_micro_usd=bill.gpu_cost_micro_usd,
        sharing=bill.sharing, pods={pod.pod_uid: pod for pod in shares.pods})
