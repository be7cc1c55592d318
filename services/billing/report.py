"""``gpumeter report``: costs from the ledger by namespace, pod, label, node or GPU, reconciled to the node bills.

Contract:

* ``build_report(ledger, grouping, start_ms=, end_ms=)`` reads the cost lines of the windows starting in
  [start_ms, end_ms) grouped by (subject kind, group) and, separately, the node bills of the same windows.
  Pod costs are one line per group value (namespace, ``<namespace>/<name>``, label value, node or GPU); the
  buckets — idle,
  driver_reserved, unattributed and node_other — are always lines of their own (per node or GPU when grouping by
  those, else one line each). Pods without the grouping label form the line ``(no <key> label)``. By pod, the
  incarnations of a pod recreated under its name (a StatefulSet's: new uid, same name) are one line, their sum
  (the ledger keeps each one's lines under its uid); pod lines the attributor could not name form ``(pod name
  unknown)``.
* The **reconciliation** compares the sum of the report's lines with the sum of the node bills, computed by two
  independent queries; the report says "reconciled" only when they are equal to the micro-dollar, and states
  the difference otherwise (and ``gpumeter report`` exits 1).
* The **pricing** section says, per node and price, which split rule divided its price between its GPUs and
  ``node_other``, and how much of its bills went to ``node_other`` (a line no team pays).
* **Trued-up cost** (``--cost trued``): every line and node bill at its cost trued up to the invoice
  (``gpumeter reconcile``) where it has one and at list price elsewhere; the report says how many of its
  node-windows were trued up. The default, ``--cost list``, is the list-price ledger as billing wrote it.
* **Direct and shared.** With a sharing policy (``services.billing.sharing``) a pod line's cost is its direct part
  (its own use) plus its shared part (buckets of its node-windows shared to it); every format shows both, the
  buckets left are the kept ones, and a **sharing** section says which policy billed how many node-windows, how
  much of each bucket went to pods by which method, and what share of the node bills the pods carry. With every
  bucket kept (the default) the table is exactly what it was before sharing existed.
* ``format_report(report, fmt)`` renders ``table`` (people), ``csv`` or ``json`` (machines); ``gpumeter report
  --format focus`` writes the report's windows as a FOCUS cost and usage dataset instead
  (``services.billing.focus``). Money is shown in USD
  with six decimals and, in csv/json, also as exact integer micro-dollars. Pure. Group names are text others
  chose: in csv a cell starting with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return gets a leading ``'``
  (OWASP's rule against formula injection) and control characters are escaped, in the table control characters
  are escaped (``gpumeter.safetext``).
* **Labels not carried.** The attributor carries only its grouping labels on share rows (and so on cost lines),
  and every pod line names them (``CostRecord.carried_label_keys``, kept by the ledger). Grouping by a label the lines did not
  carry, the report says so: ``(label <key> not carried)`` instead of ``(no <key> label)`` when no line carried
  it, and a note with the lines and cost concerned otherwise.
* **Emitted windows not in the ledger.** Reconciling the ledger with itself cannot show what never reached it.
  With Kafka configured (``--bootstrap-servers`` or ``KAFKA_BOOTSTRAP_SERVERS``), ``gpumeter report`` also reads
  what the attributor emitted for the report's windows (``services.billing.emitted``) and ``check_emitted``
  compares: every node-window emitted more than ``--settle-seconds`` ago must be in the ledger; one that is not
  is listed as dead-lettered by billing (with the reason codes) or as not billed (billing behind, stopped or
  stuck), and ``gpumeter report`` exits 1. Without Kafka the report says the check was not made.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any, Mapping, Sequence

from gpumeter.clock import Clock, SystemClock
from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.safetext import csv_cell, escape_control
from schemas.records import CostSubjectKind
from services.billing.costing import NodeWindowKey, iso_utc
from services.billing import grain_reads, rollups
from services.billing.export import focus_export
from services.billing.focus import write_focus_csv_chunks
from services.billing.time_args import parse_duration_seconds, parse_instant_ms  # noqa: F401 (report's names too)
from services.billing.ledger import (
    COST_BASES,
    DEFAULT_LEDGER_URL,
    LEDGER_URL_ENV,
    ROLLUPS,
    CostGroupRow,
    Grouping,
    Ledger,
    NodePricingRow,
    SharedSourceRow,
)

FORMATS = ("table", "csv", "json", "focus")
GRAIN_CHOICES = ("auto", "minute")  # auto: the coarsest grain that answers; minute: the cost lines only
LINE_ORDER = ("pod", "idle", "driver_reserved", "unattributed", "unavailable", "node_other")
_KIND_TO_LINE = {kind.value: kind.value.lower() for kind in CostSubjectKind}
def usd_text(micro_usd: int) -> str:
    """Exact USD with six decimals: 1234567 → ``1.234567``."""
    return str(Decimal(micro_usd).scaleb(-6).quantize(Decimal("0.000001")))


@dataclass(frozen=True, slots=True)
class ReportLine:
    """One line: ``kind`` is ``pod`` or a bucket (idle, driver_reserved, unattributed, unavailable, node_other).
    ``shared_micro_usd`` of a pod line is the part of its cost shared to its pods from buckets; the rest is
    direct (a bucket line is all direct: it is the bucket, kept)."""

    kind: str
    group: str | None
    cost_micro_usd: int
    cost_lines: int
    shared_micro_usd: int = 0

    @property
    def direct_micro_usd(self) -> int:
        return self.cost_micro_usd - self.shared_micro_usd


@dataclass(frozen=True, slots=True)
class Reconciliation:
    """The report's total against the node bills of the same windows."""

    lines_total_micro_usd: int
    node_bills_micro_usd: int
    node_windows: int

    @property
    def difference_micro_usd(self) -> int:
        return self.lines_total_micro_usd - self.node_bills_micro_usd

    @property
    def reconciled(self) -> bool:
        return self.difference_micro_usd == 0

    def statement(self) -> str:
        head = (f"total {usd_text(self.lines_total_micro_usd)} USD vs the sum of {self.node_windows} node bills "
                f"{usd_text(self.node_bills_micro_usd)} USD")
        if self.reconciled:
            return f"{head}: reconciled, equal to the micro-dollar"
        return f"{head}: MISMATCH by {usd_text(self.difference_micro_usd)} USD"


DEFAULT_SETTLE_SECONDS = 120


@dataclass(frozen=True, slots=True)
class EmittedCheck:
    """The report's node-windows as the attributor emitted them, against the ledger (``check_emitted``).

    ``emitted``: node-windows emitted at least the settle time ago; ``missing``: those of them not in the ledger,
    each with the reason codes billing dead-lettered its rows with (empty: not billed at all); ``in_flight``:
    emitted more recently and not in the ledger yet (not counted as missing)."""

    emitted: int
    missing: tuple[tuple[NodeWindowKey, frozenset[str]], ...]
    in_flight: int
    settle_seconds: int

    @property
    def complete(self) -> bool:
        return not self.missing

    def statement(self) -> str:
        head = f"{self.emitted} node-windows emitted more than {self.settle_seconds} s ago"
        flight = f"; {self.in_flight} emitted since, not billed yet" if self.in_flight else ""
        if self.complete:
            return f"{head}: every one is in the ledger{flight}"
        reasons: dict[str, int] = {}
        unbilled = 0
        for _key, codes in self.missing:
            if not codes:
                unbilled += 1
            for code in codes:
                reasons[code] = reasons.get(code, 0) + 1
        parts = []
        if unbilled:
            parts.append(f"{unbilled} never billed (billing behind, stopped or stuck)")
        if reasons:
            parts.append("dead-lettered by billing: " + ", ".join(f"{code} {n}" for code, n in sorted(reasons.items())))
        oldest = min(key.window_start_unix_ms for key, _ in self.missing)
        return (f"WARNING: {len(self.missing)} of {head} are NOT in the ledger ({'; '.join(parts)}; oldest window "
                f"{iso_utc(oldest)}){flight}")


def check_emitted(emitted_at_ms: Mapping[NodeWindowKey, int], dead_lettered: Mapping[NodeWindowKey, frozenset[str]],
                  billed: set[NodeWindowKey], *, now_ms: int,
                  settle_seconds: int = DEFAULT_SETTLE_SECONDS) -> EmittedCheck:
    """Compare what was emitted (node-window -> when its newest row was) with the ledger's node-windows. Pure."""
    settled = {key for key, at in emitted_at_ms.items() if at <= now_ms - settle_seconds * 1000}
    missing = tuple(sorted(((key, frozenset(dead_lettered.get(key, ()))) for key in settled - billed),
                           key=lambda item: (item[0].window_start_unix_ms, item[0].cluster, item[0].node_name)))
    in_flight = len(set(emitted_at_ms) - settled - billed)
    return EmittedCheck(len(settled), missing, in_flight, settle_seconds)


@dataclass(frozen=True, slots=True)
class LabelCarriage:
    """Grouping by ``label_key``: pod lines whose share rows named the labels they carried and left it out."""

    label_key: str
    lines_not_carried: int
    cost_not_carried_micro_usd: int
    pod_lines: int
    carried_elsewhere: tuple[str, ...]  # the label sets those lines did carry

    def statement(self) -> str:
        return (f"label {self.label_key!r} was not carried on {self.lines_not_carried} of {self.pod_lines} pod lines "
                f"({usd_text(self.cost_not_carried_micro_usd)} USD): the attributor carries only the labels of "
                f"GPUMETER_GROUPING_LABELS (here {' / '.join(self.carried_elsewhere) or 'none'}); those lines are "
                "in the line without the label")


@dataclass(frozen=True, slots=True)
class Report:
    grouping: Grouping
    start_ms: int
    end_ms: int
    cluster: str | None
    lines: tuple[ReportLine, ...]
    reconciliation: Reconciliation
    carriage: LabelCarriage | None = None  # a label grouping some lines did not carry
    emitted: EmittedCheck | None = None  # None: not checked (no Kafka)
    pricing: tuple[NodePricingRow, ...] = ()
    cost: str = "list"  # the cost basis: list | trued
    trued_windows: int = 0  # node-windows with a trued-up cost (counted for cost="trued" only)
    shared_sources: tuple[SharedSourceRow, ...] = ()  # what the sharing policy moved from buckets to pods
    sharing_policies: tuple[tuple[str, int], ...] = ()  # (policy, node-windows billed under it)
    plan: rollups.Plan | None = None  # which grain answered which part of the range (None: cost lines only)
    bills_plan: rollups.Plan | None = None  # which grain the node bills (reconciliation, pricing) were read from

    @property
    def total_micro_usd(self) -> int:
        return sum(line.cost_micro_usd for line in self.lines)

    @property
    def shared_micro_usd(self) -> int:
        return sum(line.shared_micro_usd for line in self.lines)

    @property
    def pods_micro_usd(self) -> int:
        """What the pod lines carry, direct and shared: the part of the bill allocated to pods."""
        return sum(line.cost_micro_usd for line in self.lines if line.kind == "pod")

    @property
    def shares_anything(self) -> bool:
        """Whether any of the report's node-windows was billed under a policy that shares a bucket."""
        return bool(self.shared_sources) or any(policy != "keep" for policy, _ in self.sharing_policies)

    @property
    def node_other_micro_usd(self) -> int:
        return sum(row.node_other_micro_usd for row in self.pricing)


def label_carriage(rows: Sequence[CostGroupRow], label_key: str) -> LabelCarriage | None:
    """From the pod lines grouped by their carried label keys: those that carried other labels but not ``label_key``
    (None when every line carried it, or named nothing -- rows from before labels were selected)."""
    pod_rows = [r for r in rows if r.subject_kind == CostSubjectKind.POD.value]
    left_out = [r for r in pod_rows if r.group is not None and label_key not in r.group.split(",")]
    if not left_out:
        return None
    return LabelCarriage(label_key, sum(r.cost_lines for r in left_out), sum(r.cost_micro_usd for r in left_out),
                         sum(r.cost_lines for r in pod_rows), tuple(sorted({r.group for r in left_out})))


def report_lines(rows: Sequence[CostGroupRow], grouping: Grouping,
                 carriage: LabelCarriage | None = None) -> tuple[ReportLine, ...]:
    """Ledger rows → report lines: pods by cost (largest first), then each bucket kind in ``LINE_ORDER``."""
    lines = []
    for row in rows:
        kind = _KIND_TO_LINE.get(row.subject_kind)
        if kind is None:
            raise GpumeterError(f"ledger holds an unknown subject kind {row.subject_kind!r}")
        group = row.group
        if kind == "pod" and group is None and grouping.kind == "pod":
            group = "(pod name unknown)"
        if kind == "pod" and group is None and grouping.kind == "label":
            not_carried = carriage is not None and carriage.lines_not_carried == carriage.pod_lines
            group = f"(label {grouping.label_key} not carried)" if not_carried else f"(no {grouping.label_key} label)"
        lines.append(ReportLine(kind, group, row.cost_micro_usd, row.cost_lines, row.shared_micro_usd))
    return tuple(
        sorted(
            lines,
            key=lambda l: (LINE_ORDER.index(l.kind), -l.cost_micro_usd if l.kind == "pod" else 0, l.group or ""),
        )
    )


def plan_report(ledger: Ledger, grouping: Grouping, *, start_ms: int, end_ms: int, cluster: str | None = None,
                grain: str = "auto") -> rollups.Plan:
    """Which grain answers which part of [start_ms, end_ms) (``services.billing.rollups.plan``): the rollups when
    ``grain`` is ``auto`` and they keep the grouping (namespace, node, or the label they were keyed by), the cost
    lines otherwise; the range moved inwards past what retention dropped."""
    if grain not in GRAIN_CHOICES:
        raise ConfigError(f"grain {grain!r} is not one of {GRAIN_CHOICES}")
    kept = rollups.kept_from(ledger.read, ROLLUPS)
    use_rollups = grain == "auto" and grouping.kind in rollups.ROLLUP_GROUPINGS
    planned = rollups.plan(start_ms, end_ms, rollups=use_rollups, kept_from=kept)
    if use_rollups and grouping.kind == "label" and any(
            rollups.other_team_keys(ledger.read, ROLLUPS, segment, cluster, grouping.label_key)
            for segment in planned.segments if segment.grain != rollups.MINUTE):
        planned = rollups.plan(start_ms, end_ms, rollups=False, kept_from=kept)  # not the rollups' team label
    return planned


def _segment_rows(ledger: Ledger, grouping: Grouping, segment: rollups.Segment, cluster: str | None,
                  cost: str) -> tuple[list[tuple], list[tuple], list[tuple]]:
    """A segment's (kind, group, micro, lines, shared) rows, its carried-label-key rows (label groupings) and its
    shared-source rows, from the cost lines or a rollup."""
    a, b = segment.start_ms, segment.end_ms
    if segment.grain == rollups.MINUTE:
        rows = [(r.subject_kind, r.group, r.cost_micro_usd, r.cost_lines, r.shared_micro_usd)
                for r in ledger.cost_by(grouping, start_ms=a, end_ms=b, cluster=cluster, cost=cost)]
        carried = [] if grouping.kind != "label" else [
            (r.subject_kind, r.group, r.cost_micro_usd, r.cost_lines)
            for r in ledger.cost_by_carried_label_keys(start_ms=a, end_ms=b, cluster=cluster)]
        shared = [(r.shared_from, r.sharing_method, r.cost_micro_usd, r.cost_lines)
                  for r in ledger.shared_by_source(start_ms=a, end_ms=b, cluster=cluster, cost=cost)]
        return rows, carried, shared
    rows = rollups.cost_by(ledger.read, ROLLUPS, segment, grouping.kind, cluster=cluster, cost=cost)
    carried = [] if grouping.kind != "label" else rollups.cost_by_carried_label_keys(
        ledger.read, ROLLUPS, segment, cluster=cluster)
    return rows, carried, rollups.shared_by_source(ledger.read, ROLLUPS, segment, cluster=cluster, cost=cost)


def build_report(ledger: Ledger, grouping: Grouping, *, start_ms: int, end_ms: int,
                 cluster: str | None = None, cost: str = "list", grain: str = "auto") -> Report:
    """Query the ledger for the report of windows starting in [start_ms, end_ms), in the ``cost`` basis (``list``
    or ``trued``), from the coarsest grain that answers it (``plan_report``; ``grain="minute"``: the cost lines
    only). The report's range is the plan's: the asked one unless retention dropped a part of it."""
    if end_ms <= start_ms:
        raise ConfigError("the report's end must be after its start")
    planned = plan_report(ledger, grouping, start_ms=start_ms, end_ms=end_ms, cluster=cluster, grain=grain)
    parts = [_segment_rows(ledger, grouping, segment, cluster, cost) for segment in planned.segments]
    rows = [CostGroupRow(kind, group, micro, count, shared)
            for kind, group, micro, count, shared in rollups.merge([p[0] for p in parts], 3)]
    start_ms, end_ms = planned.start_ms, planned.end_ms
    carriage = None
    if grouping.kind == "label":
        carriage = label_carriage([CostGroupRow(kind, group, micro, count)
                                   for kind, group, micro, count in rollups.merge([p[1] for p in parts], 2)],
                                  grouping.label_key)
    shared_sources = tuple(sorted((SharedSourceRow(*row) for row in rollups.merge([p[2] for p in parts], 2)),
                                  key=lambda r: (r.shared_from, r.sharing_method)))
    lines = report_lines(rows, grouping, carriage)
    # The node bills of the same windows, from their own rollups over whole hours and days (whatever the
    # grouping): an independent sum to reconcile the lines with.
    bills_plan = grain_reads.bill_plan(ledger, start_ms, end_ms, use_rollups=grain == "auto")
    if bills_plan.adjusted:  # never reconcile lines and bills of different ranges
        bills_plan = planned
    bills = grain_reads.summarize_bills(ledger, bills_plan, cluster=cluster, cost=cost, trued=cost == "trued")
    reconciliation = Reconciliation(
        lines_total_micro_usd=sum(line.cost_micro_usd for line in lines),
        node_bills_micro_usd=bills.bills_micro_usd,
        node_windows=bills.node_windows,
    )
    return Report(grouping, start_ms, end_ms, cluster, lines, reconciliation, carriage, pricing=bills.pricing,
                  cost=cost, trued_windows=bills.trued_windows, shared_sources=shared_sources,
                  sharing_policies=bills.sharing_policies, plan=planned, bills_plan=bills_plan)


def _share_text(part: int, total: int) -> str:
    return f"{(Decimal(part) * 100 / total).quantize(Decimal('0.01'))}%" if total else "-"


def _title(report: Report) -> str:
    scope = f"cluster {report.cluster}" if report.cluster else "all clusters"
    title = (f"gpumeter costs by {report.grouping.describe()}, windows starting {iso_utc(report.start_ms)} "
             f"to {iso_utc(report.end_ms)} ({scope})")
    return f"{title}; {_cost_text(report)}" if report.cost == "trued" else title


def _cost_text(report: Report) -> str:
    return (f"trued up to the invoice: {report.trued_windows} of {report.reconciliation.node_windows} node-windows, "
            "the rest at list price")


def _format_table(report: Report) -> str:
    total = report.total_micro_usd
    split = report.shares_anything  # direct and shared columns only when something was shared

    def money(line_cost: int, line_shared: int) -> tuple[str, ...]:
        if not split:
            return (usd_text(line_cost),)
        return (usd_text(line_cost), usd_text(line_cost - line_shared), usd_text(line_shared))

    header = ("kind", report.grouping.describe(), *(("cost_usd", "direct_usd", "shared_usd") if split else
                                                    ("cost_usd",)), "share", "lines")
    body = [
        (line.kind, escape_control(line.group) if line.group is not None else "-",
         *money(line.cost_micro_usd, line.shared_micro_usd), _share_text(line.cost_micro_usd, total),
         str(line.cost_lines))
        for line in report.lines
    ]
    footer = ("TOTAL", "", *money(total, report.shared_micro_usd), _share_text(total, total),
              str(sum(l.cost_lines for l in report.lines)))
    widths = [max(len(row[i]) for row in (header, *body, footer)) for i in range(len(header))]

    def render(row: Sequence[str]) -> str:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(width) for cell, width in zip(row[2:], widths[2:])]
        return "  ".join(cells).rstrip()

    rule = "-" * len(render(header))
    out = [_title(report), render(header), rule, *(render(r) for r in body), rule, render(footer),
           *_grain_lines(report), *_pricing_lines(report), *_sharing_lines(report),
           f"reconciliation: {report.reconciliation.statement()}"]
    if report.carriage is not None:
        out.append(f"labels: {report.carriage.statement()}")
    out.append(f"emitted windows: {_emitted_text(report)}")
    return "\n".join(out) + "\n"


def _grain_lines(report: Report) -> list[str]:
    """Which grain the report read, and the range retention moved it to."""
    plan = report.plan
    if plan is None:
        return []
    out = [f"read from: {plan.describe()}"]
    if report.bills_plan is not None:
        out[0] += f"; node bills from {report.bills_plan.describe().replace('cost lines', 'node bills')}"
    if plan.adjusted:
        out.append(f"retention: asked for windows starting {iso_utc(plan.asked_start_ms)} to "
                   f"{iso_utc(plan.asked_end_ms)}; what was kept covers {iso_utc(plan.start_ms)} to "
                   f"{iso_utc(plan.end_ms)} only (the finer grains before it were dropped)")
    return out


def _pricing_lines(report: Report) -> list[str]:
    """How each node's price was split between its GPUs and the rest (node_other, a line no team pays)."""
    if not report.pricing:
        return []
    bills = report.reconciliation.node_bills_micro_usd
    out = [f"node_other: {usd_text(report.node_other_micro_usd)} USD, "
           f"{_share_text(report.node_other_micro_usd, bills)} of the node bills; priced per node:"]
    for row in report.pricing:
        out.append(f"  {escape_control(row.node_name)} ({escape_control(row.instance_type)}, {row.price_model}): "
                   f"split rule {row.split_rule}, "
                   f"node_other {_share_text(row.node_other_micro_usd, row.node_cost_micro_usd)} of "
                   f"{usd_text(row.node_cost_micro_usd)} USD over {row.node_windows} node-windows")
    return out


def _sharing_lines(report: Report) -> list[str]:
    """Which sharing policy billed the report's node-windows, what it moved to pods, and the pods' part of the
    bill (nothing when every bucket was kept: the table is then what it always was)."""
    if not report.shares_anything:
        return []
    bills = report.reconciliation.node_bills_micro_usd
    policies = ", ".join(f"{escape_control(policy)} ({count} node-windows)"
                         for policy, count in report.sharing_policies)
    moved = ", ".join(f"{row.shared_from.lower()} {usd_text(row.cost_micro_usd)} USD {row.sharing_method}"
                      for row in report.shared_sources) or "nothing"
    kept = report.total_micro_usd - report.pods_micro_usd
    by_bucket: dict[str, int] = {}
    for line in report.lines:
        if line.kind != "pod" and line.cost_micro_usd:
            by_bucket[line.kind] = by_bucket.get(line.kind, 0) + line.cost_micro_usd
    kept_text = f"kept as buckets {usd_text(kept)} USD"
    if by_bucket:
        # Which buckets the policy keeps, so a policy that leaves some of the bill unallocated says where it is.
        kept_text += " (" + ", ".join(f"{kind} {usd_text(micro)}" for kind, micro in sorted(by_bucket.items())) + ")"
    return [f"sharing: {policies}; shared to pods: {moved}",
            f"allocated to pods: {usd_text(report.pods_micro_usd)} USD, {_share_text(report.pods_micro_usd, bills)} "
            f"of the node bills (direct {usd_text(report.pods_micro_usd - report.shared_micro_usd)}, shared "
            f"{usd_text(report.shared_micro_usd)}); {kept_text}"]


def _emitted_text(report: Report) -> str:
    if report.emitted is None:
        return "not checked against the node-window-shares topic (no Kafka bootstrap servers given)"
    return report.emitted.statement()


def _format_csv(report: Report) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    # direct_* and shared_* come after the columns of before sharing, so readers of those keep working.
    writer.writerow(["kind", "group", "cost_usd", "cost_micro_usd", "cost_lines", "direct_usd", "direct_micro_usd",
                     "shared_usd", "shared_micro_usd"])
    for line in report.lines:
        # The group is a namespace, pod, label value, node or GPU someone else chose: never a formula.
        writer.writerow([line.kind, csv_cell(line.group or ""), usd_text(line.cost_micro_usd), line.cost_micro_usd,
                         line.cost_lines, usd_text(line.direct_micro_usd), line.direct_micro_usd,
                         usd_text(line.shared_micro_usd), line.shared_micro_usd])
    rec = report.reconciliation
    shared = report.shared_micro_usd
    writer.writerow(["total", "", usd_text(report.total_micro_usd), report.total_micro_usd,
                     sum(l.cost_lines for l in report.lines), usd_text(report.total_micro_usd - shared),
                     report.total_micro_usd - shared, usd_text(shared), shared])
    writer.writerow(["node_bills", f"{rec.node_windows} node-windows", usd_text(rec.node_bills_micro_usd),
                     rec.node_bills_micro_usd, ""])
    writer.writerow(["reconciliation", "reconciled" if rec.reconciled else "mismatch",
                     usd_text(rec.difference_micro_usd), rec.difference_micro_usd, ""])
    # One row per node and price: the group names node, instance type, price model and split rule; the money is
    # the node_other part of its bills, the count its node-windows.
    for row in report.pricing:
        writer.writerow(["node_pricing",
                         csv_cell(f"{row.node_name}/{row.instance_type}/{row.price_model}/{row.split_rule}"),
                         usd_text(row.node_other_micro_usd), row.node_other_micro_usd, row.node_windows])
    # One row per sharing policy (count: its node-windows) and per bucket shared (money: what went to pods).
    for policy, count in report.sharing_policies if report.shares_anything else ():
        writer.writerow(["sharing_policy", csv_cell(policy), "", "", count])
    for row in report.shared_sources:
        writer.writerow(["shared_from", csv_cell(f"{row.shared_from.lower()}/{row.sharing_method}"),
                         usd_text(row.cost_micro_usd), row.cost_micro_usd, row.cost_lines])
    if report.carriage is not None:
        writer.writerow(["labels_not_carried", csv_cell(report.carriage.label_key),
                         usd_text(report.carriage.cost_not_carried_micro_usd),
                         report.carriage.cost_not_carried_micro_usd, report.carriage.lines_not_carried])
    if report.plan is not None and (report.plan.adjusted or set(report.plan.grains()) - {rollups.MINUTE}):
        # Only when it differs from what the csv always was (cost lines over the asked range).
        writer.writerow(["grain", csv_cell(report.plan.describe()), "", "", ""])
    if report.cost == "trued":
        writer.writerow(["cost_basis", "trued", "", "", report.trued_windows])
    if report.emitted is not None:
        writer.writerow(["emitted_not_in_ledger", f"{report.emitted.emitted} node-windows emitted", "", "",
                         len(report.emitted.missing)])
    return buffer.getvalue()


def report_as_json(report: Report) -> dict[str, Any]:
    rec = report.reconciliation
    return {
        "by": report.grouping.describe(),
        "window_start": iso_utc(report.start_ms),
        "window_end": iso_utc(report.end_ms),
        "cluster": report.cluster,
        "currency": "USD",
        "cost": report.cost,
        "trued_node_windows": report.trued_windows if report.cost == "trued" else None,
        "lines": [
            {"kind": l.kind, "group": l.group, "cost_usd": usd_text(l.cost_micro_usd),
             "cost_micro_usd": l.cost_micro_usd, "cost_lines": l.cost_lines,
             "direct_usd": usd_text(l.direct_micro_usd), "direct_micro_usd": l.direct_micro_usd,
             "shared_usd": usd_text(l.shared_micro_usd), "shared_micro_usd": l.shared_micro_usd}
            for l in report.lines
        ],
        "total_micro_usd": report.total_micro_usd,
        "total_usd": usd_text(report.total_micro_usd),
        "shared_micro_usd": report.shared_micro_usd,
        "pods_micro_usd": report.pods_micro_usd,
        "sharing": {
            "policies": [{"policy": policy, "node_windows": count} for policy, count in report.sharing_policies],
            "shared_to_pods": [
                {"shared_from": row.shared_from.lower(), "method": row.sharing_method,
                 "cost_micro_usd": row.cost_micro_usd, "cost_usd": usd_text(row.cost_micro_usd),
                 "cost_lines": row.cost_lines} for row in report.shared_sources],
        },
        "node_other_micro_usd": report.node_other_micro_usd,
        "grain": None if report.plan is None else {
            "read_from": report.plan.describe(),
            "segments": [{"grain": s.grain, "window_start": iso_utc(s.start_ms), "window_end": iso_utc(s.end_ms)}
                         for s in report.plan.segments],
            "asked_window_start": iso_utc(report.plan.asked_start_ms),
            "asked_window_end": iso_utc(report.plan.asked_end_ms),
            "moved_by_retention": report.plan.adjusted,
            "node_bills_read_from": None if report.bills_plan is None else
            report.bills_plan.describe().replace("cost lines", "node bills"),
        },
        "pricing": [
            {"cluster": r.cluster, "node": r.node_name, "instance_type": r.instance_type,
             "price_model": r.price_model, "split_rule": r.split_rule, "price_version": r.price_version,
             "node_windows": r.node_windows, "node_cost_micro_usd": r.node_cost_micro_usd,
             "gpu_cost_micro_usd": r.gpu_cost_micro_usd, "node_other_micro_usd": r.node_other_micro_usd}
            for r in report.pricing
        ],
        "reconciliation": {
            "lines_total_micro_usd": rec.lines_total_micro_usd,
            "node_bills_micro_usd": rec.node_bills_micro_usd,
            "node_windows": rec.node_windows,
            "difference_micro_usd": rec.difference_micro_usd,
            "reconciled": rec.reconciled,
            "statement": rec.statement(),
        },
        "labels_not_carried": None if report.carriage is None else {
            "label": report.carriage.label_key,
            "cost_lines": report.carriage.lines_not_carried,
            "cost_micro_usd": report.carriage.cost_not_carried_micro_usd,
            "carried": list(report.carriage.carried_elsewhere),
            "statement": report.carriage.statement(),
        },
        "emitted": None if report.emitted is None else {
            "node_windows": report.emitted.emitted,
            "missing_from_ledger": [
                {"cluster": key.cluster, "node": key.node_name, "window_start": iso_utc(key.window_start_unix_ms),
                 "dead_letter_reasons": sorted(codes)} for key, codes in report.emitted.missing],
            "in_flight": report.emitted.in_flight,
            "settle_seconds": report.emitted.settle_seconds,
            "statement": report.emitted.statement(),
        },
    }


def format_report(report: Report, fmt: str = "table") -> str:
    """Render ``report`` as ``table``, ``csv`` or ``json`` (``focus`` is not a rendering of the grouped report:
    ``main`` writes it from the ledger's lines)."""
    if fmt == "table":
        return _format_table(report)
    if fmt == "csv":
        return _format_csv(report)
    if fmt == "json":
        return json.dumps(report_as_json(report), indent=2) + "\n"
    raise ConfigError(f"format {fmt!r} is not one of table, csv, json")


# -- command line (``gpumeter report``) ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--window", default="24h", help="how far back from --end (90m, 24h, 7d; default 24h)")
    parser.add_argument("--end", default=None, help="end of the report, ISO 8601 (default: now)")
    parser.add_argument("--by", default="namespace", help="namespace | pod (namespace/name) | label:<key> | node | gpu")
    parser.add_argument("--format", default="table", choices=FORMATS,
                        help="table | csv | json | focus (the windows' FOCUS rows as CSV, not grouped; default table)")
    parser.add_argument("--cost", default="list", choices=COST_BASES,
                        help="list: the list-price ledger (default); trued: trued up to the invoice where "
                             "gpumeter reconcile applied a bill, list price elsewhere")
    parser.add_argument("--grain", default="auto", choices=(*GRAIN_CHOICES, "hour"),
                        help="auto: whole days from the daily rollups, whole hours from the hourly ones, the edges "
                             "from the cost lines, where the rollups keep the grouping (default); minute: the cost "
                             "lines only; with --format focus: the FOCUS rows' grain (hour: per node-hour, auto: "
                             "hour when the range is whole hours the rollups hold; gpumeter export --grain)")
    parser.add_argument("--cluster", default=None, help="only this cluster (default: all)")
    parser.add_argument("--ledger-url", default=None,
                        help=f"SQLAlchemy URL of the ledger (default: ${LEDGER_URL_ENV} or {DEFAULT_LEDGER_URL})")
    parser.add_argument("--bootstrap-servers", default=None,
                        help="Kafka, to check that every node-window the attributor emitted is in the ledger "
                             "(env KAFKA_BOOTSTRAP_SERVERS; without it the check is not made)")
    parser.add_argument("--topic-prefix", default=None, help="prefix of every topic name (env "
                                                             "GPUMETER_KAFKA_TOPIC_PREFIX)")
    parser.add_argument("--settle-seconds", type=int, default=DEFAULT_SETTLE_SECONDS,
                        help="node-windows emitted more recently are in flight, not missing "
                             f"(default {DEFAULT_SETTLE_SECONDS})")


def _kafka_to_check(args: argparse.Namespace, env: Mapping[str, str]):
    """The Kafka settings for the emitted-windows check, or None when no bootstrap servers were given."""
    from gpumeter.settings import KafkaSettings

    if not (getattr(args, "bootstrap_servers", None) or env.get("KAFKA_BOOTSTRAP_SERVERS")
            or env.get("GPUMETER_KAFKA_BOOTSTRAP_SERVERS")):
        return None
    from gpumeter.config import load

    return load(KafkaSettings, args, env, defaults={"client_id": "gpumeter-report"})


def main(args: argparse.Namespace, env: Mapping[str, str], *, clock: Clock | None = None,
         out=None, err=None) -> int:
    """Print the report; exit 0 when it reconciles (and every emitted node-window is in the ledger, when checked),
    1 when not, 2 on a usage, ledger or Kafka error."""
    out = out or sys.stdout
    err = err or sys.stderr
    clock = clock or SystemClock()
    try:
        grouping = Grouping.parse(args.by)
        end_ms = parse_instant_ms(args.end) if args.end else clock.now_ms()
        start_ms = end_ms - parse_duration_seconds(args.window) * 1000
        settle_seconds = getattr(args, "settle_seconds", DEFAULT_SETTLE_SECONDS)
        if settle_seconds < 0:
            raise ConfigError("--settle-seconds must be >= 0")
        kafka = _kafka_to_check(args, env)
        grain = getattr(args, "grain", "auto")
        if grain == "hour" and args.format != "focus":
            raise ConfigError("--grain hour is the FOCUS rows' grain (--format focus); a report reads whole hours "
                              "from the hourly rollups with --grain auto")
        with Ledger(args.ledger_url or env.get(LEDGER_URL_ENV) or DEFAULT_LEDGER_URL) as ledger:
            ledger.require_schema()
            report = build_report(ledger, grouping, start_ms=start_ms, end_ms=end_ms, cluster=args.cluster,
                                  cost=getattr(args, "cost", "list"), grain="auto" if grain == "hour" else grain)
            focus_text = focus_grain = None
            if args.format == "focus":
                focus_grain, chunks = focus_export(ledger, start_ms=start_ms, end_ms=end_ms, cluster=args.cluster,
                                                   grain=grain)
                buffer = io.StringIO()
                write_focus_csv_chunks(chunks, buffer)
                focus_text = buffer.getvalue()
            if kafka is not None:
                from services.billing.emitted import read_emitted

                emitted = read_emitted(kafka, kafka.catalog, start_ms=start_ms, end_ms=end_ms, cluster=args.cluster)
                billed = {NodeWindowKey(b["cluster"], b["node_name"], b["window_start_unix_ms"])
                          for b in ledger.bills(start_ms=start_ms, end_ms=end_ms, cluster=args.cluster)}
                report = replace(report, emitted=check_emitted(emitted.emitted_at_ms, emitted.dead_lettered, billed,
                                                               now_ms=clock.now_ms(), settle_seconds=settle_seconds))
    except GpumeterError as exc:
        print(f"gpumeter report: {exc}", file=err)
        return 2
    out.write(focus_text if focus_text is not None else format_report(report, args.format))
    complete = report.emitted is None or report.emitted.complete
    if focus_text is not None:
        # The FOCUS rows have no room for the checks or the grain: they are said where people read them.
        print(f"gpumeter report: FOCUS grain: {focus_grain.describe()}", file=err)
        if not report.reconciliation.reconciled:
            print(f"gpumeter report: reconciliation: {report.reconciliation.statement()}", file=err)
        if not complete:
            print(f"gpumeter report: emitted windows: {_emitted_text(report)}", file=err)
    return 0 if report.reconciliation.reconciled and complete else 1
