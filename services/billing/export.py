"""``gpumeter export focus --out FILE.parquet``: the ledger's windows as a FOCUS dataset (``services.billing.focus``).

``focus_dataset(ledger, start_ms=, end_ms=)`` reads the node bills of the windows starting in [start_ms, end_ms),
their price versions and their cost lines with what each was billed (``Ledger.billed_cost_lines``: the trued-up cost
where a reconcile stored one, else the list cost), and maps them to FOCUS rows. ``--out`` ending ``.parquet`` writes
Parquet (pyarrow), ``.csv`` the same rows as ``gpumeter report --format focus`` prints. Exit codes: 0 written, 2 on
a usage or ledger error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Mapping

from gpumeter.clock import Clock, SystemClock
from gpumeter.errors import ConfigError, GpumeterError
from services.billing.focus import FocusBill, FocusLine, focus_csv, focus_rows, write_focus_parquet
from services.billing.ledger import DEFAULT_LEDGER_URL, LEDGER_URL_ENV, Ledger

DATASETS = ("focus",)


def focus_dataset(ledger: Ledger, *, start_ms: int, end_ms: int, cluster: str | None = None,
                  billing_account_id: str | None = None) -> list[dict[str, Any]]:
    """The FOCUS rows of the windows starting in [start_ms, end_ms) (``focus_rows``); ``MinuteLinesDropped`` when
    the range starts before the minute lines retention keeps (the rows are made from them)."""
    ledger.require_minute_lines(start_ms, "the FOCUS export")
    bills = ledger.bills(start_ms=start_ms, end_ms=end_ms, cluster=cluster)
    prices = ledger.price_versions(b["price_version"] for b in bills)
    lines = [FocusLine(record, None if billed == record.cost_micro_usd else billed)
             for record, billed in ledger.billed_cost_lines(start_ms=start_ms, end_ms=end_ms, cluster=cluster)]
    try:
        return focus_rows([FocusBill.of(b, prices[b["price_version"]]) for b in bills], lines,
                          billing_account_id=billing_account_id)
    except ValueError as exc:
        raise GpumeterError(f"the ledger cannot be exported as FOCUS: {exc}") from exc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", choices=DATASETS, help="what to export: focus (FOCUS 1.3 cost and usage rows)")
    parser.add_argument("--out", required=True, type=Path, metavar="FILE",
                        help="FILE.parquet (Parquet) or FILE.csv (CSV, as gpumeter report --format focus)")
    parser.add_argument("--window", default="24h", help="how far back from --end (90m, 24h, 7d; default 24h)")
    parser.add_argument("--end", default=None, help="end, ISO 8601 (default: now)")
    parser.add_argument("--cluster", default=None, help="only this cluster (default: all)")
    parser.add_argument("--billing-account-id", default=None,
                        help="the rows' BillingAccountId (default: the cluster name)")
    parser.add_argument("--ledger-url", default=None,
                        help=f"SQLAlchemy URL of the ledger (default: ${LEDGER_URL_ENV} or {DEFAULT_LEDGER_URL})")


def main(args: argparse.Namespace, env: Mapping[str, str], *, clock: Clock | None = None, out=None,
         err=None) -> int:
    from services.billing.report import parse_duration_seconds, parse_instant_ms

    out = out or sys.stdout
    err = err or sys.stderr
    clock = clock or SystemClock()
    try:
        suffix = args.out.suffix.lower()
        if suffix not in (".parquet", ".csv"):
            raise ConfigError(f"--out {args.out}: the file name must end in .parquet or .csv")
        end_ms = parse_instant_ms(args.end) if args.end else clock.now_ms()
        start_ms = end_ms - parse_duration_seconds(args.window) * 1000
        with Ledger(args.ledger_url or env.get(LEDGER_URL_ENV) or DEFAULT_LEDGER_URL) as ledger:
            ledger.require_schema()
            rows = focus_dataset(ledger, start_ms=start_ms, end_ms=end_ms, cluster=args.cluster,
                                 billing_account_id=args.billing_account_id)
        if suffix == ".parquet":
            write_focus_parquet(rows, args.out)
        else:
            args.out.write_text(focus_csv(rows), encoding="utf-8")
    except (GpumeterError, OSError) as exc:
        print(f"gpumeter export: {exc}", file=err)
        return 2
    print(f"wrote {len(rows)} FOCUS rows to {args.out}", file=out)
    return 0
