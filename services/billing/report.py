"""``gpumeter report``: costs from the ledger by namespace, label, node or GPU, reconciled to the node bills.

Contract:

* ``build_report(ledger, grouping, start_ms=, end_ms=)`` reads the cost lines of the windows starting in
  [start_ms, end_ms) grouped by (subject kind, group) and, separately, the node bills of the same windows.
  Pod costs are one line per group value (namespace, label value, node or GPU); the buckets — idle,
  driver_reserved, unattributed and node_other — are always lines of their own (per node or GPU when grouping by
  those, else one line each). Pods without the grouping label form the line ``(no <key> label)``.
* The **reconciliation** compares the sum of the report's lines with the sum of the node bills, computed by two
  independent queries; the report says "reconciled" only when they are equal to the micro-dollar, and states
  the difference otherwise (and ``gpumeter report`` exits 1).
* ``format_report(report, fmt)`` renders ``table`` (people), ``csv`` or ``json`` (machines). Money is shown in USD
  with six decimals and, in csv/json, also as exact integer micro-dollars. Pure. Group names are text others
  chose: in csv a cell starting with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return gets a leading ``'``
  (OWASP's rule against formula injection) and control characters are escaped, in the table control characters
  are escaped (``gpumeter.safetext``).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any, Mapping, Sequence

from gpumeter.clock import Clock, SystemClock
from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.safetext import csv_cell, escape_control
from schemas.records import CostSubjectKind
from services.billing.costing import iso_utc
from services.billing.ledger import DEFAULT_LEDGER_URL, LEDGER_URL_ENV, CostGroupRow, Grouping, Ledger

FORMATS = ("table", "csv", "json")
LINE_ORDER = ("pod", "idle", "driver_reserved", "unattributed", "node_other")
_KIND_TO_LINE = {kind.value: kind.value.lower() for kind in CostSubjectKind}
_DURATION_RE = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration_seconds(text: str) -> int:
    """``90m``, ``24h``, ``7d``, ``2w``, ``3600s`` → seconds (> 0); ``ConfigError`` otherwise."""
    match = _DURATION_RE.match(text or "")
    if not match or int(match.group(1)) == 0:
        raise ConfigError(f"window {text!r} is not a duration like 90m, 24h or 7d")
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def parse_instant_ms(text: str) -> int:
    """An ISO 8601 instant (``2026-11-29T17:00:00Z``; no zone means UTC) → ms since the Unix epoch."""
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"{text!r} is not an ISO 8601 time such as 2026-11-29T17:00:00Z") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


def usd_text(micro_usd: int) -> str:
    """Exact USD with six decimals: 1234567 → ``1.234567``."""
    return str(Decimal(micro_usd).scaleb(-6).quantize(Decimal("0.000001")))


@dataclass(frozen=True, slots=True)
class ReportLine:
    """One line: ``kind`` is ``pod`` or a bucket (idle, driver_reserved, unattributed, node_other)."""

    kind: str
    group: str | None
    cost_micro_usd: int
    cost_lines: int


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


@dataclass(frozen=True, slots=True)
class Report:
    grouping: Grouping
    start_ms: int
    end_ms: int
    cluster: str | None
    lines: tuple[ReportLine, ...]
    reconciliation: Reconciliation

    @property
    def total_micro_usd(self) -> int:
        return sum(line.cost_micro_usd for line in self.lines)


def report_lines(rows: Sequence[CostGroupRow], grouping: Grouping) -> tuple[ReportLine, ...]:
    """Ledger rows → report lines: pods by cost (largest first), then each bucket kind in ``LINE_ORDER``."""
    lines = []
    for row in rows:
        kind = _KIND_TO_LINE.get(row.subject_kind)
        if kind is None:
            raise GpumeterError(f"ledger holds an unknown subject kind {row.subject_kind!r}")
        group = row.group
        if kind == "pod" and group is None and grouping.kind == "label":
            group = f"(no {grouping.label_key} label)"
        lines.append(ReportLine(kind, group, row.cost_micro_usd, row.cost_lines))
    return tuple(
        sorted(
            lines,
            key=lambda l: (LINE_ORDER.index(l.kind), -l.cost_micro_usd if l.kind == "pod" else 0, l.group or ""),
        )
    )


def build_report(ledger: Ledger, grouping: Grouping, *, start_ms: int, end_ms: int,
                 cluster: str | None = None) -> Report:
    """Query the ledger for the report of windows starting in [start_ms, end_ms)."""
    if end_ms <= start_ms:
        raise ConfigError("the report's end must be after its start")
    rows = ledger.cost_by(grouping, start_ms=start_ms, end_ms=end_ms, cluster=cluster)
    lines = report_lines(rows, grouping)
    totals = ledger.totals(start_ms=start_ms, end_ms=end_ms, cluster=cluster)
    reconciliation = Reconciliation(
        lines_total_micro_usd=sum(line.cost_micro_usd for line in lines),
        node_bills_micro_usd=totals.bill_micro_usd,
        node_windows=totals.node_windows,
    )
    return Report(grouping, start_ms, end_ms, cluster, lines, reconciliation)


def _share_text(part: int, total: int) -> str:
    return f"{(Decimal(part) * 100 / total).quantize(Decimal('0.01'))}%" if total else "-"


def _title(report: Report) -> str:
    scope = f"cluster {report.cluster}" if report.cluster else "all clusters"
    return (f"gpumeter costs by {report.grouping.describe()}, windows starting {iso_utc(report.start_ms)} "
            f"to {iso_utc(report.end_ms)} ({scope})")


def _format_table(report: Report) -> str:
    header = ("kind", report.grouping.describe(), "cost_usd", "share", "lines")
    total = report.total_micro_usd
    body = [
        (line.kind, escape_control(line.group) if line.group is not None else "-", usd_text(line.cost_micro_usd),
         _share_text(line.cost_micro_usd, total), str(line.cost_lines))
        for line in report.lines
    ]
    footer = ("TOTAL", "", usd_text(total), _share_text(total, total), str(sum(l.cost_lines for l in report.lines)))
    widths = [max(len(row[i]) for row in (header, *body, footer)) for i in range(len(header))]

    def render(row: Sequence[str]) -> str:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(width) for cell, width in zip(row[2:], widths[2:])]
        return "  ".join(cells).rstrip()

    rule = "-" * len(render(header))
    out = [_title(report), render(header), rule, *(render(r) for r in body), rule, render(footer),
           f"reconciliation: {report.reconciliation.statement()}"]
    return "\n".join(out) + "\n"


def _format_csv(report: Report) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["kind", "group", "cost_usd", "cost_micro_usd", "cost_lines"])
    for line in report.lines:
        # The group is a namespace, label value, node or GPU someone else chose: never a formula.
        writer.writerow([line.kind, csv_cell(line.group or ""), usd_text(line.cost_micro_usd), line.cost_micro_usd,
                         line.cost_lines])
    rec = report.reconciliation
    writer.writerow(["total", "", usd_text(report.total_micro_usd), report.total_micro_usd,
                     sum(l.cost_lines for l in report.lines)])
    writer.writerow(["node_bills", f"{rec.node_windows} node-windows", usd_text(rec.node_bills_micro_usd),
                     rec.node_bills_micro_usd, ""])
    writer.writerow(["reconciliation", "reconciled" if rec.reconciled else "mismatch",
                     usd_text(rec.difference_micro_usd), rec.difference_micro_usd, ""])
    return buffer.getvalue()


def report_as_json(report: Report) -> dict[str, Any]:
    rec = report.reconciliation
    return {
        "by": report.grouping.describe(),
        "window_start": iso_utc(report.start_ms),
        "window_end": iso_utc(report.end_ms),
        "cluster": report.cluster,
        "currency": "USD",
        "lines": [
            {"kind": l.kind, "group": l.group, "cost_usd": usd_text(l.cost_micro_usd),
             "cost_micro_usd": l.cost_micro_usd, "cost_lines": l.cost_lines}
            for l in report.lines
        ],
        "total_micro_usd": report.total_micro_usd,
        "total_usd": usd_text(report.total_micro_usd),
        "reconciliation": {
            "lines_total_micro_usd": rec.lines_total_micro_usd,
            "node_bills_micro_usd": rec.node_bills_micro_usd,
            "node_windows": rec.node_windows,
            "difference_micro_usd": rec.difference_micro_usd,
            "reconciled": rec.reconciled,
            "statement": rec.statement(),
        },
    }


def format_report(report: Report, fmt: str = "table") -> str:
    """Render ``report`` as ``table``, ``csv`` or ``json``."""
    if fmt == "table":
        return _format_table(report)
    if fmt == "csv":
        return _format_csv(report)
    if fmt == "json":
        return json.dumps(report_as_json(report), indent=2) + "\n"
    raise ConfigError(f"format {fmt!r} is not one of {FORMATS}")


# -- command line (``gpumeter report``) ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--window", default="24h", help="how far back from --end (90m, 24h, 7d; default 24h)")
    parser.add_argument("--end", default=None, help="end of the report, ISO 8601 (default: now)")
    parser.add_argument("--by", default="namespace", help="namespace | label:<key> | node | gpu")
    parser.add_argument("--format", default="table", choices=FORMATS)
    parser.add_argument("--cluster", default=None, help="only this cluster (default: all)")
    parser.add_argument("--ledger-url", default=None,
                        help=f"SQLAlchemy URL of the ledger (default: ${LEDGER_URL_ENV} or {DEFAULT_LEDGER_URL})")


def main(args: argparse.Namespace, env: Mapping[str, str], *, clock: Clock | None = None,
         out=None, err=None) -> int:
    """Print the report; exit 0 when it reconciles, 1 when it does not, 2 on a usage or ledger error."""
    out = out or sys.stdout
    err = err or sys.stderr
    clock = clock or SystemClock()
    try:
        grouping = Grouping.parse(args.by)
        end_ms = parse_instant_ms(args.end) if args.end else clock.now_ms()
        start_ms = end_ms - parse_duration_seconds(args.window) * 1000
        with Ledger(args.ledger_url or env.get(LEDGER_URL_ENV) or DEFAULT_LEDGER_URL) as ledger:
            ledger.require_schema()
            report = build_report(ledger, grouping, start_ms=start_ms, end_ms=end_ms, cluster=args.cluster)
    except GpumeterError as exc:
        print(f"gpumeter report: {exc}", file=err)
        return 2
    out.write(format_report(report, args.format))
    return 0 if report.reconciliation.reconciled else 1
