"""Sharing policies: which buckets of a node-window stay lines of their own and which are shared to its pods. Pure.

A node-window's cost lines (``services.billing.costing``) are the pods' own use of each unit (**direct** lines) and
the buckets no pod used: IDLE, DRIVER_RESERVED, UNATTRIBUTED and UNAVAILABLE per unit, UNAVAILABLE for GPUs billed
but not reported, and the node's NODE_OTHER. ``SharingPolicy`` says, per bucket kind, what becomes of it:

* ``keep`` (the default for every kind): the bucket stays its own line, as before sharing existed;
* ``weighted``: the node-window's total of that kind goes to the node-window's pods in proportion to their direct
  cost (the GPU cost each pod's own use was billed in this node-window); equally when every pod's is 0;
* ``even``: in equal parts to the node-window's pods;
* ``requests``: in proportion to ``cpu / Σcpu + memory / Σmemory`` over the pods' effective CPU and memory
  requests (``GpuShare.cpu_request_millicores`` / ``memory_request_bytes``; a resource nobody requests is left
  out of the sum); equally when no pod requests either.

The pods of a node-window are the distinct pods with a POD row on any of its units (a pod on three GPUs counts
once, with its direct cost on all three). A node-window without pods keeps every bucket (there is nobody to share
to). A shared bucket's lines are replaced by one **shared line** per (pod, kind): ``subject_kind`` POD, ``gpu_uuid``
None, the pod's namespace, name and labels, ``shared_from`` the kind, ``sharing_method`` the method and
``cost_share`` the pod's fraction of that bucket. Its micro-dollars are the kind's total apportioned over the pods
by largest remainder (ties to the smaller pod uid), so the node-window's lines still add up to its bill exactly,
every shared part is within one micro-dollar of its exact quota, and a pod with weight 0 gets 0. Kinds are shared
in the order IDLE, DRIVER_RESERVED, UNATTRIBUTED, UNAVAILABLE, NODE_OTHER; the result does not depend on the
input order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

from gpumeter.errors import ConfigError
from schemas.records import CostRecord, CostSubjectKind
from services.billing.money import apportion

SHARING_ENV = "GPUMETER_BILLING_SHARING"


class ShareMethod(enum.StrEnum):
    KEEP = "keep"
    WEIGHTED = "weighted"
    EVEN = "even"
    REQUESTS = "requests"


# The bucket kinds a policy covers, in the order they are shared; the policy's field for each.
SHAREABLE_KINDS: tuple[CostSubjectKind, ...] = (
    CostSubjectKind.IDLE,
    CostSubjectKind.DRIVER_RESERVED,
    CostSubjectKind.UNATTRIBUTED,
    CostSubjectKind.UNAVAILABLE,
    CostSubjectKind.NODE_OTHER,
)
_FIELD_OF_KIND = {kind: kind.value.lower() for kind in SHAREABLE_KINDS}
_KIND_OF_NAME = {name: kind for kind, name in _FIELD_OF_KIND.items()}
# "unavailable" also names the lost-unit bucket the issue calls it by.
_ALIASES = {"lost": CostSubjectKind.UNAVAILABLE, "reserved": CostSubjectKind.DRIVER_RESERVED}


@dataclass(frozen=True, slots=True)
class SharingPolicy:
    """What happens to each bucket kind of a node-window (see the module docstring). Immutable; ``KEEP_ALL`` is
    the default: every bucket its own line."""

    idle: ShareMethod = ShareMethod.KEEP
    driver_reserved: ShareMethod = ShareMethod.KEEP
    unattributed: ShareMethod = ShareMethod.KEEP
    unavailable: ShareMethod = ShareMethod.KEEP
    node_other: ShareMethod = ShareMethod.KEEP

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), ShareMethod):
                raise ConfigError(f"sharing of {f.name}: {getattr(self, f.name)!r} is not a ShareMethod")

    def method_for(self, kind: CostSubjectKind) -> ShareMethod:
        """The method for a bucket kind (``KEEP`` for POD, which is never shared)."""
        name = _FIELD_OF_KIND.get(kind)
        return ShareMethod.KEEP if name is None else getattr(self, name)

    @property
    def shares_anything(self) -> bool:
        return any(self.method_for(kind) is not ShareMethod.KEEP for kind in SHAREABLE_KINDS)

    def describe(self) -> str:
        """``keep`` when nothing is shared, else the shared kinds: ``idle=weighted,node_other=even`` (the text
        ``parse`` reads, and what the ledger records per node-window)."""
        shared = [f"{_FIELD_OF_KIND[k]}={self.method_for(k)}" for k in SHAREABLE_KINDS
                  if self.method_for(k) is not ShareMethod.KEEP]
        return ",".join(shared) if shared else "keep"

    @classmethod
    def parse(cls, text: str | None) -> "SharingPolicy":
        """``keep`` (or empty) | ``all=<method>`` | ``<kind>=<method>[,<kind>=<method>...]``; kinds ``idle``,
        ``driver_reserved``, ``unattributed``, ``unavailable``, ``node_other``; methods ``keep``, ``weighted``,
        ``even``, ``requests``. Later items override earlier ones (``all=weighted,node_other=keep``). Raises
        ``ConfigError``."""
        values: dict[str, ShareMethod] = {}
        for item in (text or "").split(","):
            item = item.strip()
            if not item or item.lower() == ShareMethod.KEEP.value:
                continue
            name, sep, method_text = item.partition("=")
            if not sep:
                raise ConfigError(f"sharing item {item!r} is not <bucket>=<method> (e.g. idle=weighted)")
            try:
                method = ShareMethod(method_text.strip().lower())
            except ValueError:
                raise ConfigError(f"sharing method {method_text.strip()!r} is not one of "
                                  f"{', '.join(m.value for m in ShareMethod)}") from None
            key = name.strip().lower()
            if key == "all":
                for kind in SHAREABLE_KINDS:
                    values[_FIELD_OF_KIND[kind]] = method
                continue
            kind = _KIND_OF_NAME.get(key) or _ALIASES.get(key)
            if kind is None:
                raise ConfigError(f"cannot share {name.strip()!r}: the buckets are "
                                  f"{', '.join(_FIELD_OF_KIND.values())} (or all)")
            values[_FIELD_OF_KIND[kind]] = method
        return cls(**values)


KEEP_ALL = SharingPolicy()


@dataclass(frozen=True, slots=True)
class PodRequests:
    """A pod's effective requests, as its share rows carry them."""

    cpu_request_millicores: int = 0
    memory_request_bytes: int = 0


def share_weights(method: ShareMethod, direct_micro_usd: Sequence[int],
                  requests: Sequence[PodRequests]) -> tuple[Fraction, ...]:
    """Each pod's weight under ``method`` (pods in one order in both sequences); never all zero for a non-empty
    list of pods (a degenerate basis falls back to equal weights)."""
    n = len(direct_micro_usd)
    if method is ShareMethod.WEIGHTED:
        weights = tuple(Fraction(max(c, 0)) for c in direct_micro_usd)
    elif method is ShareMethod.REQUESTS:
        cpu_total = sum(r.cpu_request_millicores for r in requests)
        memory_total = sum(r.memory_request_bytes for r in requests)
        weights = tuple(
            (Fraction(r.cpu_request_millicores, cpu_total) if cpu_total else Fraction(0))
            + (Fraction(r.memory_request_bytes, memory_total) if memory_total else Fraction(0))
            for r in requests
        )
    elif method is ShareMethod.EVEN:
        weights = (Fraction(1),) * n
    else:
        raise ValueError(f"{method} shares nothing")
    if n and not any(weights):
        return (Fraction(1),) * n
    return weights


def apply_sharing(costs: Iterable[CostRecord], requests: Mapping[str, PodRequests],
                  policy: SharingPolicy) -> tuple[CostRecord, ...]:
    """The cost lines of one node-window after ``policy``: direct lines and kept buckets as they were (in their
    order), then the shared lines by kind (``SHAREABLE_KINDS`` order) and pod uid. ``requests`` maps pod uid to
    its requests (pods missing from it request nothing). Lines that are already shared are an error (sharing is
    applied once)."""
    costs = tuple(costs)
    if any(c.is_shared for c in costs):
        raise ValueError("cost lines that are already shared cannot be shared again")
    if not policy.shares_anything:
        return costs
    pods: dict[str, CostRecord] = {}
    direct: dict[str, int] = {}
    for cost in costs:
        if cost.subject_kind is CostSubjectKind.POD and cost.pod_uid:
            pods.setdefault(cost.pod_uid, cost)
            direct[cost.pod_uid] = direct.get(cost.pod_uid, 0) + cost.cost_micro_usd
    if not pods:
        return costs
    uids = sorted(pods)
    pod_requests = [requests.get(uid, PodRequests()) for uid in uids]
    kept: list[CostRecord] = []
    totals: dict[CostSubjectKind, int] = {}
    for cost in costs:
        method = policy.method_for(cost.subject_kind)
        if cost.subject_kind is CostSubjectKind.POD or method is ShareMethod.KEEP:
            kept.append(cost)
        else:
            totals[cost.subject_kind] = totals.get(cost.subject_kind, 0) + cost.cost_micro_usd
    shared: list[CostRecord] = []
    for kind in SHAREABLE_KINDS:
        if kind not in totals:
            continue
        method = policy.method_for(kind)
        weights = share_weights(method, [direct[uid] for uid in uids], pod_requests)
        weight_sum = sum(weights, Fraction(0))
        for uid, weight, amount in zip(uids, weights, apportion(totals[kind], weights)):
            pod = pods[uid]
            shared.append(replace(
                pod,
                gpu_uuid=None,
                cost_share=float(weight / weight_sum),
                cost_micro_usd=amount,
                shared_from=kind,
                sharing_method=method.value,
                method="",
                cost_basis="",
                memory_share=0.0,
                compute_share=0.0,
                gpu_fraction=0.0,
            ))
    return tuple(kept) + tuple(shared)


def requests_by_pod(rows: Iterable) -> Mapping[str, PodRequests]:
    """Pod uid → requests, from share rows (``GpuShare``; every POD row of a pod carries the same requests; the
    largest is taken should they differ)."""
    found: dict[str, PodRequests] = {}
    for row in rows:
        uid = getattr(row, "pod_uid", None)
        if not uid:
            continue
        current = found.get(uid, PodRequests())
        found[uid] = PodRequests(max(current.cpu_request_millicores, row.cpu_request_millicores),
                                 max(current.memory_request_bytes, row.memory_request_bytes))
    return MappingProxyType(found)
