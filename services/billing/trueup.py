"""True-up to the invoice: re-price each node's windows so that they add up to what the bill charged. Pure.

``true_up(bill, windows)`` takes a parsed bill (``services.billing.bills``) and the ledger's node-windows of the
bill's scope, each with its list-price cost lines, and returns the trued-up cost of every window and line it
could true up. Nothing is overwritten: the ledger keeps the list-price cost beside the trued-up one.

Rules:

* **Scope.** The bill's billing period, and of the ledger's windows in it those of the bill's providers (an AWS
  bill says nothing of a GCP node). A window another bill -- other accounts, or another provider's -- trued up is
  that bill's and is left alone, unless this bill charges its machine; a window an earlier version of this bill
  (same providers, accounts and period) trued up is this bill's to set again.
* **Machines.** A node-window belongs to the machine of its provider id (``node_bills.provider_id``, the Node's
  ``spec.providerID``). A line item belongs to the machine whose provider id it names
  (``gpumeter.provider_ids.resource_matches``: the instance id is the resource id's last segment; Azure's whole
  path). A line item naming no machine of the ledger is *billed but never seen*; one naming two is *ambiguous*
  and used for neither. A machine with windows in the scope and no line item is *seen but not billed*.
* **Charge periods.** A line item ``[start, end)`` applies to the machine's windows that overlap it, each weighted
  by its list-price cost times the share of the window inside the period (all weights zero: by billed time
  instead). So an hourly line item for a machine that ran half of that hour lands on the windows of that half
  hour, per-second billing and partial hours included; a line item over a whole month (a credit) spreads over
  every window of the month. A line item no window overlaps is *billed but not allocated*. A window of a billed
  machine that no line item covers is *not covered*: it keeps no trued-up cost.
* **Money.** Each window's exact share of its machine's line items is a rational. The machine's total is rounded
  half up to the micro-dollar once, ``round_half_up(Σ allocated line items × 10^6)``, and apportioned over its
  windows by largest remainder on those exact shares (signed: a window may be credited more than it cost). Each
  window's trued-up micro-dollars are then apportioned over its cost lines by their list-price micro-dollars (a
  pod keeps its proportion of the window, within one micro-dollar; a window whose lines all cost 0 at list price
  puts it on its ``NODE_OTHER`` line). So per machine the trued-up windows equal the allocated bill exactly, and
  per window the trued-up lines equal the trued-up window exactly.
* **Deterministic.** The result depends on the bill's line items and the ledger's list-price lines only, not on
  their order: running it again on the same bill and ledger gives the same numbers.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import Iterable, Mapping, Sequence

from gpumeter.provider_ids import instance_id_of, resource_key, resource_matches
from services.billing.bills import Bill, BillLineItem
from services.billing.costing import NodeWindowKey, apportion
from services.billing.pricing import MICRO_USD_PER_USD

NODE_OTHER = "NODE_OTHER"

# The ledger's cost line key: (window_start_unix_ms, cluster, node_name, gpu_uuid, subject_kind, pod_uid,
# shared_from): a pod's shared lines are lines of their own, trued up in proportion like every other.
LineKey = tuple


@dataclass(frozen=True, slots=True)
class LedgerLine:
    """One cost line at list price: its ledger key and micro-dollars."""

    key: LineKey
    subject_kind: str
    cost_micro_usd: int


@dataclass(frozen=True, slots=True)
class LedgerWindow:
    """One node-window of the ledger at list price, with its cost lines (which add up to ``node_cost_micro_usd``);
    ``provider`` its node's cloud, ``trueup_scope`` the scope key of the bill that last trued it up (empty: none)."""

    cluster: str
    node_name: str
    window_start_unix_ms: int
    window_seconds: int
    billed_milliseconds: int
    node_cost_micro_usd: int
    provider_id: str
    lines: tuple[LedgerLine, ...]
    provider: str = ""
    trueup_scope: str = ""

    @property
    def key(self) -> NodeWindowKey:
        return NodeWindowKey(self.cluster, self.node_name, self.window_start_unix_ms)

    @property
    def end_unix_ms(self) -> int:
        return self.window_start_unix_ms + self.window_seconds * 1000


@dataclass(frozen=True, slots=True)
class MachineTrueUp:
    """One billed machine: what the bill charged it, what of that landed on its windows, and how."""

    provider_id: str
    nodes: tuple[tuple[str, str], ...]  # (cluster, node_name)
    resource_ids: tuple[str, ...]
    line_items: int
    charges: Mapping[str, Decimal]  # charge kind -> cost, as billed
    billed_micro_usd: int  # round_half_up(every line item of the machine)
    trued_micro_usd: int  # what its windows now carry (= the allocated line items, rounded)
    list_micro_usd: int  # those windows at list price
    windows_trued: int
    windows_not_covered: int
    not_covered_list_micro_usd: int
    unallocated: tuple[BillLineItem, ...]  # line items no window of the machine overlaps

    @property
    def unallocated_micro_usd(self) -> int:
        return self.billed_micro_usd - self.trued_micro_usd


@dataclass(frozen=True, slots=True)
class UnseenResource:
    """A resource the bill charged that no node of the ledger is (or that names two: ``ambiguous``)."""

    resource_id: str
    line_items: int
    cost: Decimal
    charges: tuple[str, ...]
    ambiguous_with: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class UnbilledNode:
    """A node the ledger has in the bill's scope whose machine the bill never charged."""

    cluster: str
    node_name: str
    provider_id: str
    windows: int
    list_micro_usd: int


@dataclass(frozen=True)
class TrueUp:
    """The outcome: trued-up micro-dollars per node-window and per cost line of every trued window (windows of the
    scope not in ``windows`` keep no trued-up cost), and what did not match."""

    bill: Bill
    windows: Mapping[NodeWindowKey, int]
    lines: Mapping[LineKey, int]
    machines: tuple[MachineTrueUp, ...]
    billed_not_seen: tuple[UnseenResource, ...]
    seen_not_billed: tuple[UnbilledNode, ...]
    scope_windows: int = 0
    scope_keys: frozenset = field(default_factory=frozenset)

    @property
    def trued_micro_usd(self) -> int:
        return sum(self.windows.values())

    @property
    def list_micro_usd(self) -> int:
        return sum(m.list_micro_usd for m in self.machines)

    @property
    def complete(self) -> bool:
        """Every charge of the bill landed on a node-window and every node-window of the scope was trued up."""
        return (not self.billed_not_seen and not self.seen_not_billed
                and all(not m.unallocated and not m.windows_not_covered for m in self.machines))


def round_half_up(value: Fraction) -> int:
    return math.floor(value + Fraction(1, 2))


def apportion_quotas(total: int, quotas: Sequence[Fraction]) -> tuple[int, ...]:
    """Integers within one of each exact (signed) quota that add up to ``total`` (largest remainder: floors, then one
    more each to the largest fractional parts, ties to the lower index). ``total`` must lie within
    [Σ floor(q), Σ floor(q) + len(quotas)] -- as ``round_half_up(Σ q)`` always does."""
    shares = [math.floor(q) for q in quotas]
    left = total - sum(shares)
    if not 0 <= left <= len(quotas):
        raise ValueError(f"{total} cannot be apportioned over quotas summing to {float(sum(quotas, Fraction(0)))}")
    ranking = sorted(range(len(quotas)), key=lambda i: (shares[i] - quotas[i], i))
    for index in ranking[:left]:
        shares[index] += 1
    return tuple(shares)


def _apportion_signed(total: int, weights: Sequence[int]) -> tuple[int, ...]:
    if total >= 0:
        return apportion(total, [Fraction(w) for w in weights])
    return tuple(-share for share in apportion(-total, [Fraction(w) for w in weights]))


def _lines_of(window: LedgerWindow, trued: int) -> dict[LineKey, int]:
    weights = [line.cost_micro_usd for line in window.lines]
    if not any(weights):
        others = [i for i, line in enumerate(window.lines) if line.subject_kind == NODE_OTHER]
        if not others:
            raise ValueError(f"{window.key}: no cost line to carry {trued} micro-USD")
        weights = [1 if i == others[0] else 0 for i in range(len(window.lines))]
    return dict(zip((line.key for line in window.lines), _apportion_signed(trued, weights)))


def _micro(cost: Decimal) -> Fraction:
    return Fraction(cost) * MICRO_USD_PER_USD


def _overlaps(windows: Sequence[LedgerWindow], starts: Sequence[int], item: BillLineItem,
              ) -> list[tuple[int, Fraction]]:
    """(window index, weight) of the windows overlapping the item's charge period."""
    out = []
    longest_ms = max(w.window_seconds for w in windows) * 1000
    for index in range(bisect_left(starts, item.start_ms - longest_ms), len(windows)):
        window = windows[index]
        if window.window_start_unix_ms >= item.end_ms:
            break
        overlap = min(window.end_unix_ms, item.end_ms) - max(window.window_start_unix_ms, item.start_ms)
        if overlap > 0:
            out.append((index, Fraction(overlap, window.window_seconds * 1000)))
    weighted = [(i, share * windows[i].node_cost_micro_usd) for i, share in out]
    if any(weight for _, weight in weighted):
        return weighted
    weighted = [(i, share * windows[i].billed_milliseconds) for i, share in out]
    return weighted if any(weight for _, weight in weighted) else []


def true_up(bill: Bill, windows: Iterable[LedgerWindow]) -> TrueUp:
    """True ``windows`` (the ledger's node-windows of the bill's scope) up to ``bill`` (see the module docstring)."""
    by_machine: dict[str, list[LedgerWindow]] = defaultdict(list)
    unidentified: dict[tuple[str, str], list[LedgerWindow]] = defaultdict(list)
    providers = set(bill.providers)
    for window in windows:
        if providers and window.provider not in providers:
            continue
        if window.provider_id.strip():
            by_machine[window.provider_id.strip()].append(window)
        else:
            unidentified[(window.cluster, window.node_name)].append(window)
    by_instance: dict[str, list[str]] = defaultdict(list)
    for provider_id in by_machine:
        by_instance[instance_id_of(provider_id).lower()].append(provider_id)

    items_of: dict[str, list[BillLineItem]] = defaultdict(list)
    unseen: dict[str, list[BillLineItem]] = defaultdict(list)
    ambiguous: dict[str, tuple[str, ...]] = {}
    for item in sorted(bill.items, key=lambda i: (i.resource_id, i.start_ms, i.end_ms, i.origin)):
        machines = [p for p in by_instance.get(resource_key(item.resource_id), ())
                    if resource_matches(p, item.resource_id)]
        if len(machines) == 1:
            items_of[machines[0]].append(item)
        else:
            unseen[item.resource_id].append(item)
            if len(machines) > 1:
                ambiguous[item.resource_id] = tuple(sorted(machines))

    trued_windows: dict[NodeWindowKey, int] = {}
    trued_lines: dict[LineKey, int] = {}
    machines_out = []
    for provider_id in sorted(items_of):
        machine_windows = sorted(by_machine[provider_id],
                                 key=lambda w: (w.window_start_unix_ms, w.cluster, w.node_name))
        starts = [w.window_start_unix_ms for w in machine_windows]
        exact = [Fraction(0)] * len(machine_windows)
        covered = [False] * len(machine_windows)
        unallocated = []
        charges: dict[str, Decimal] = defaultdict(Decimal)
        billed_exact = Fraction(0)
        for item in items_of[provider_id]:
            charges[item.charge] += item.cost
            amount = _micro(item.cost)
            billed_exact += amount
            weights = _overlaps(machine_windows, starts, item)
            if not weights:
                unallocated.append(item)
                continue
            weight_sum = sum(weight for _, weight in weights)
            for index, weight in weights:
                exact[index] += amount * weight / weight_sum
                covered[index] = True
        indices = [i for i, is_covered in enumerate(covered) if is_covered]
        quotas = [exact[i] for i in indices]
        total = round_half_up(sum(quotas, Fraction(0)))
        for i, micro in zip(indices, apportion_quotas(total, quotas)):
            window = machine_windows[i]
            trued_windows[window.key] = micro
            trued_lines.update(_lines_of(window, micro))
        not_covered = [w for w, is_covered in zip(machine_windows, covered) if not is_covered]
        machines_out.append(MachineTrueUp(
            provider_id=provider_id,
            nodes=tuple(sorted({(w.cluster, w.node_name) for w in machine_windows})),
            resource_ids=tuple(sorted({i.resource_id for i in items_of[provider_id]})),
            line_items=len(items_of[provider_id]),
            charges=dict(sorted(charges.items())),
            billed_micro_usd=round_half_up(billed_exact),
            trued_micro_usd=total,
            list_micro_usd=sum(machine_windows[i].node_cost_micro_usd for i in indices),
            windows_trued=len(indices),
            windows_not_covered=len(not_covered),
            not_covered_list_micro_usd=sum(w.node_cost_micro_usd for w in not_covered),
            unallocated=tuple(unallocated),
        ))

    scope_keys = {w.key for provider_id in items_of for w in by_machine[provider_id]}

    def unclaimed(ws: list[LedgerWindow]) -> list[LedgerWindow]:
        mine = [w for w in ws if w.trueup_scope in ("", bill.scope_key)]
        scope_keys.update(w.key for w in mine)
        return mine

    unbilled = [UnbilledNode(cluster, node, "", len(mine), sum(w.node_cost_micro_usd for w in mine))
                for (cluster, node), ws in unidentified.items() if (mine := unclaimed(ws))]
    for provider_id, ws in by_machine.items():
        if provider_id in items_of:
            continue
        ws = unclaimed(ws)
        for cluster, node in sorted({(w.cluster, w.node_name) for w in ws}):
            mine = [w for w in ws if (w.cluster, w.node_name) == (cluster, node)]
            unbilled.append(UnbilledNode(cluster, node, provider_id, len(mine),
                                         sum(w.node_cost_micro_usd for w in mine)))
    unseen_out = tuple(
        UnseenResource(resource, len(items), sum((i.cost for i in items), Decimal(0)),
                       tuple(sorted({i.charge for i in items})), ambiguous.get(resource, ()))
        for resource, items in sorted(unseen.items()))
    return TrueUp(bill, trued_windows, trued_lines, tuple(machines_out), unseen_out,
                  tuple(sorted(unbilled, key=lambda u: (u.cluster, u.node_name, u.provider_id))),
                  scope_windows=len(scope_keys), scope_keys=frozenset(scope_keys))

