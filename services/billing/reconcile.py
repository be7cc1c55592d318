"""``gpumeter reconcile --bill FILE``: true the ledger's node-windows up to a cloud bill (FOCUS or AWS CUR 2.0).

Reads the bill (``services.billing.bills``), the ledger's node-windows of the bill's scope, re-prices them
(``services.billing.trueup``) and stores the trued-up cost beside the list-price cost (``Ledger.apply_trueup``);
then says what matched and what did not: nodes billed but never seen, nodes seen but not billed, node-windows the
bill's line items do not cover, charges no node-window was there to take.

* **Idempotent.** The bill's digest identifies it; applying the same bill to the same ledger again writes
  nothing (``0 node-windows changed``).
* **An amended bill** (the provider's export for the same period, re-issued with late credits or corrections) is a
  different digest: applying it re-prices the scope from the new bill alone and replaces the trued-up values
  there -- the last bill applied wins for its scope; every bill applied stays listed in ``trueups``. Windows
  the ledger gained since an earlier run (late billing) are trued up with the rest.
* ``--dry-run`` computes and prints, writing nothing.

Exit status: 0 when applied (or computed, with ``--dry-run``); with ``--strict``, 1 when anything did not match
(billed but never seen, seen but not billed, not covered, not allocated); 2 on an unreadable bill, a usage or a
ledger error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Mapping

from gpumeter.clock import Clock, SystemClock
from gpumeter.errors import GpumeterError
from gpumeter.safetext import escape_control
from services.billing.bills import BASES, BILL_FORMATS, read_bill
from services.billing.costing import iso_utc
from services.billing.ledger import DEFAULT_LEDGER_URL, LEDGER_URL_ENV, Ledger, TrueUpWrite
from services.billing.report import usd_text
from services.billing.trueup import TrueUp, true_up


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bill", required=True, type=Path, metavar="FILE",
                        help="the billing export: FOCUS (.csv, .csv.gz, .parquet) or AWS CUR 2.0 (.csv, .csv.gz)")
    parser.add_argument("--bill-format", default="auto", choices=("auto", *BILL_FORMATS),
                        help="the export's format (default: from its columns)")
    parser.add_argument("--basis", default="effective", choices=BASES,
                        help="effective: amortized, after discounts, Savings Plans and credits (default); "
                             "billed: the cash view")
    parser.add_argument("--ledger-url", default=None,
                        help=f"SQLAlchemy URL of the ledger (default: ${LEDGER_URL_ENV} or {DEFAULT_LEDGER_URL})")
    parser.add_argument("--dry-run", action="store_true", help="compute and print, write nothing")
    parser.add_argument("--strict", action="store_true", help="exit 1 when anything did not match")
    parser.add_argument("--format", default="table", choices=("table", "json"))


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def summary_json(result: TrueUp, written: TrueUpWrite | None) -> dict[str, Any]:
    """Machine-readable summary (also stored with the bill in the ledger's ``trueups`` row)."""
    bill = result.bill
    return {
        "bill": bill.name,
        "format": bill.format,
        "basis": bill.basis,
        "trueup_id": bill.digest(),
        "scope_start": iso_utc(bill.scope_start_ms),
        "scope_end": iso_utc(bill.scope_end_ms),
        "rows": bill.rows,
        "line_items": len(bill.items),
        "skipped": [{"reason": s.reason, "rows": s.rows, "cost": str(s.cost)} for s in bill.skipped],
        "scope_node_windows": result.scope_windows,
        "trued_node_windows": len(result.windows),
        "list_micro_usd": result.list_micro_usd,
        "trued_micro_usd": result.trued_micro_usd,
        "machines": [
            {"provider_id": m.provider_id, "nodes": [f"{c}/{n}" for c, n in m.nodes],
             "resource_ids": list(m.resource_ids),
             "line_items": m.line_items, "charges": {k: str(v) for k, v in m.charges.items()},
             "billed_micro_usd": m.billed_micro_usd, "trued_micro_usd": m.trued_micro_usd,
             "list_micro_usd": m.list_micro_usd, "windows_trued": m.windows_trued,
             "windows_not_covered": m.windows_not_covered,
             "not_covered_list_micro_usd": m.not_covered_list_micro_usd,
             "unallocated_micro_usd": m.unallocated_micro_usd,
             "unallocated_line_items": [i.origin for i in m.unallocated]}
            for m in result.machines],
        "billed_not_seen": [
            {"resource_id": u.resource_id, "line_items": u.line_items, "cost": str(u.cost), "charges": list(u.charges),
             "ambiguous_with": list(u.ambiguous_with)} for u in result.billed_not_seen],
        "seen_not_billed": [
            {"cluster": u.cluster, "node": u.node_name, "provider_id": u.provider_id, "node_windows": u.windows,
             "list_micro_usd": u.list_micro_usd} for u in result.seen_not_billed],
        "complete": result.complete,
        "written": None if written is None else {
            "node_windows_changed": written.windows_changed, "cost_lines_changed": written.lines_changed,
            "first_time": written.first_time},
    }


def format_table(result: TrueUp, written: TrueUpWrite | None) -> str:
    bill = result.bill
    skipped = ", ".join(f"{s.reason} {s.rows}" for s in bill.skipped)
    out = [f"bill {escape_control(bill.name)} ({bill.format}, {bill.basis} cost), {iso_utc(bill.scope_start_ms)} to "
           f"{iso_utc(bill.scope_end_ms)}: {bill.rows} rows, {len(bill.items)} line items of resources"
           + (f" (not a node's: {skipped})" if skipped else ""),
           f"trued up: {len(result.machines)} machines, {len(result.windows)} of {result.scope_windows} node-windows "
           f"in the scope: list {usd_text(result.list_micro_usd)} USD -> billed {usd_text(result.trued_micro_usd)} USD"]
    for m in result.machines:
        nodes = ", ".join(escape_control(f"{c}/{n}") for c, n in m.nodes)
        charges = ", ".join(f"{kind} {cost}" for kind, cost in m.charges.items())
        out.append(f"  {nodes} ({escape_control(m.provider_id)}): {m.windows_trued} node-windows, list "
                   f"{usd_text(m.list_micro_usd)} -> {usd_text(m.trued_micro_usd)} USD; "
                   f"{_count(m.line_items, 'line item')} ({charges})")
        if m.windows_not_covered:
            out.append(f"    not covered by the bill's line items: {m.windows_not_covered} node-windows (list "
                       f"{usd_text(m.not_covered_list_micro_usd)} USD), left at list price")
        if m.unallocated:
            out.append(f"    billed but not allocated (no node-window in the charge period): "
                       f"{usd_text(m.unallocated_micro_usd)} USD, {_count(len(m.unallocated), 'line item')}, e.g. "
                       f"{m.unallocated[0].origin}")
    for u in result.billed_not_seen:
        why = (f"names {len(u.ambiguous_with)} machines: {', '.join(u.ambiguous_with)}" if u.ambiguous_with
               else "no node in the ledger is this machine")
        out.append(f"billed but never seen: {escape_control(u.resource_id)} {u.cost} USD "
                   f"({_count(u.line_items, 'line item')}: {', '.join(u.charges)}; {why})")
    for u in result.seen_not_billed:
        out.append(f"seen but not billed: {escape_control(u.cluster)}/{escape_control(u.node_name)} "
                   f"({escape_control(u.provider_id) or 'no provider id'}): {u.windows} node-windows, list "
                   f"{usd_text(u.list_micro_usd)} USD")
    if written is None:
        out.append(f"dry run: nothing written (true-up {bill.digest()[:12]})")
    else:
        again = "" if written.first_time else " (this bill was applied before)"
        out.append(f"ledger: {written.windows_changed} node-windows and {written.lines_changed} cost lines changed "
                   f"(true-up {written.trueup_id[:12]}{again})")
    return "\n".join(out) + "\n"


def main(args: argparse.Namespace, env: Mapping[str, str], *, clock: Clock | None = None,
         out=None, err=None) -> int:
    """Reconcile; exit status as in the module docstring."""
    out = out or sys.stdout
    err = err or sys.stderr
    clock = clock or SystemClock()
    try:
        bill = read_bill(args.bill, fmt=args.bill_format, basis=args.basis)
        with Ledger(args.ledger_url or env.get(LEDGER_URL_ENV) or DEFAULT_LEDGER_URL) as ledger:
            ledger.require_schema()
            result = true_up(bill, ledger.trueup_windows(start_ms=bill.scope_start_ms, end_ms=bill.scope_end_ms))
            written = None
            if not args.dry_run:
                written = ledger.apply_trueup(result, applied_at_unix_ms=clock.now_ms(),
                                              summary=json.dumps(summary_json(result, None), sort_keys=True))
    except GpumeterError as exc:
        print(f"gpumeter reconcile: {exc}", file=err)
        return 2
    if args.format == "json":
        out.write(json.dumps(summary_json(result, written), indent=2) + "\n")
    else:
        out.write(format_table(result, written))
    return 1 if args.strict and not result.complete else 0
