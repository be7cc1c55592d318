"""``gpumeter prices import FILE... --out DIR``: the providers' own price lists into the catalog's price files.

Reads each FILE (an AWS Price List offer file in JSON or CSV, ``aws ec2 describe-spot-price-history`` output, GCP
Cloud Billing Catalog SKUs, Azure Retail Prices; told apart by their shape -- ``services.billing.price_import``),
and writes ``DIR/<provider>.csv`` (the bundled layout, ``PRICE_COLUMNS``: GPU instance types, on-demand and spot,
each row with its source and date) and, where the input allows deriving them, ``DIR/rates/<provider>.csv``. What
it writes is loaded back through the catalog before it is kept, so ``--price-dir DIR`` (``gpumeter replay``,
``GPUMETER_BILLING_PRICE_DIR``) reads it as it reads the bundled files. A folder given to ``--price-dir`` is the
whole catalog: to add to the bundled prices, import into a copy of ``services/billing/prices``.

Exit status: 0 when written; 2 on a file that cannot be read or imported (nothing is written then).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Mapping

from gpumeter.errors import GpumeterError
from services.billing.catalog import PriceCatalog, PriceError, parse_price_csv, parse_rates_csv
from services.billing.price_import import (
    DEFAULT_FACTS,
    DEFAULT_GCP_RATES_FAMILY,
    import_prices,
    load_instance_facts,
    render_price_csv,
    render_rates_csv,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="prices_command", required=True, metavar="ACTION")
    imp = sub.add_parser("import", help="the providers' own price lists into the catalog's CSV",
                         description=__doc__.splitlines()[0])
    imp.add_argument("files", nargs="+", type=Path, metavar="FILE",
                     help="AWS offer file (JSON or CSV), AWS spot price history (JSON), GCP SKUs (JSON), "
                          "Azure Retail Prices (JSON)")
    imp.add_argument("--out", required=True, type=Path, metavar="DIR",
                     help="folder for <provider>.csv and rates/<provider>.csv (created; those files replaced)")
    imp.add_argument("--source-date", default=None, metavar="YYYY-MM-DD",
                     help="when the GCP or Azure prices were retrieved (default: their newest effective date)")
    imp.add_argument("--region", action="append", default=[], help="keep only this region (repeatable)")
    imp.add_argument("--facts", type=Path, default=DEFAULT_FACTS,
                     help="instance facts CSV (default: the bundled prices/facts/instance_types.csv)")
    imp.add_argument("--gcp-rates-family", default=DEFAULT_GCP_RATES_FAMILY,
                     help="GCP machine family whose core and RAM SKUs are the rates "
                          f"(default {DEFAULT_GCP_RATES_FAMILY})")


def main(args: argparse.Namespace, env: Mapping[str, str], *, out=None, err=None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        documents = []
        for path in args.files:
            try:
                documents.append((path.name, path.read_text(encoding="utf-8")))
            except (OSError, UnicodeDecodeError) as exc:
                raise PriceError(f"cannot read {path}: {exc}") from None
        result = import_prices(documents, load_instance_facts(args.facts), source_date=args.source_date,
                               regions=args.region, gcp_rates_family=args.gcp_rates_family)
        if not result.prices:
            raise PriceError("no GPU instance type's price in these files (see what was skipped above)")
        files: dict[Path, str] = {}
        for provider in sorted({p.provider for p in result.prices}):
            files[args.out / f"{provider}.csv"] = render_price_csv(p for p in result.prices if p.provider == provider)
        for provider in sorted({r.provider for r in result.rates}):
            files[args.out / "rates" / f"{provider}.csv"] = render_rates_csv(
                r for r in result.rates if r.provider == provider)
        rows = [row for path, text in files.items() if path.parent == args.out
                for row in parse_price_csv(text, path.name)]
        rates = [rate for path, text in files.items() if path.parent != args.out
                 for rate in parse_rates_csv(text, f"rates/{path.name}")]
        PriceCatalog(tuple(rows), rates=tuple(rates))  # what the catalog will load: validated before it is written
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    except (GpumeterError, OSError) as exc:
        print(f"gpumeter prices import: {exc}", file=err)
        return 2
    for name, fmt in result.formats:
        print(f"read {name} ({fmt})", file=out)
    counts = Counter((p.provider, p.price_model) for p in result.prices)
    for (provider, model), count in sorted(counts.items()):
        print(f"  {provider} {model}: {count} GPU instance type prices", file=out)
    for rate in result.rates:
        print(f"  {rate.provider} {rate.region} {rate.price_model} rates: {rate.row()['cpu_usd_per_vcpu_hour']} per "
              f"vCPU-hour, {rate.row()['ram_usd_per_gib_hour']} per GiB-hour", file=out)
    for reason, count in sorted(result.skipped.items()):
        print(f"  skipped {count}: {reason}", file=out)
    for path in files:
        print(f"wrote {path}", file=out)
    return 0
