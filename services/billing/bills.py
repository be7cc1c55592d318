"""Cloud billing exports read as the line items ``gpumeter reconcile`` trues nodes up to. Pure parsers, one reader.

Two formats, told apart by their header (``detect_format``):

``focus``
    The FinOps Foundation's FOCUS 1.0 columns (a 1.1/1.2/1.3 export is a superset and reads the same), as CSV or
    Parquet. Read: ``ResourceId``, ``ChargePeriodStart``, ``ChargePeriodEnd`` (inclusive start, exclusive end,
    ISO 8601 UTC), ``ChargeCategory`` (Usage, Purchase, Tax, Credit, Adjustment), ``EffectiveCost`` (amortized:
    after discounts, Savings Plans, reservations and committed-use discounts), ``BilledCost`` (cash basis),
    ``BillingCurrency``; when present ``BillingPeriodStart``/``BillingPeriodEnd`` (the bill's scope),
    ``ServiceCategory`` and ``PricingCategory`` (Standard, Dynamic = spot, Committed).
``cur2``
    AWS Cost and Usage Report 2.0 (Data Exports), CSV. Read: ``line_item_resource_id`` (the instance id),
    ``line_item_usage_start_date``/``line_item_usage_end_date``, ``line_item_line_item_type``,
    ``line_item_product_code``, ``line_item_usage_type``, ``line_item_unblended_cost``,
    ``line_item_currency_code``, ``savings_plan_savings_plan_effective_cost``, ``reservation_effective_cost``,
    ``pricing_term``, ``identity_line_item_id`` and ``bill_billing_period_start_date``/``_end_date``.

A ``.gz`` file is decompressed on the way in (both providers write gzip'd CSV).

**Which rows are a node's charges** (``BillLineItem``): rows with a resource id that are

* the machine's running time -- FOCUS ``ChargeCategory`` Usage whose ``ServiceCategory`` is Compute (or absent);
  CUR ``Usage``, ``SavingsPlanCoveredUsage`` or ``DiscountedUsage`` of ``AmazonEC2`` whose usage type is an
  instance-hour type (``BoxUsage``, ``SpotUsage``, ``DedicatedUsage``, ``HostBoxUsage``, region prefix allowed);
* credits, refunds and discounts naming the resource -- FOCUS Credit and Adjustment; CUR ``Credit``, ``Refund``
  and the discount types (``EdpDiscount``, ``BundledDiscount``, ``PrivateRateDiscount``, ``DistributorDiscount``,
  ``SppDiscount``, ``Discount``);
* on the billed basis only, CUR ``SavingsPlanNegation`` (the negation of covered usage's on-demand cost).

Everything else is counted in ``Bill.skipped`` by reason with its cost (tax, purchases, commitment fees, other
services, other charges of a resource such as its data transfer, rows without a resource id) -- nothing is
silently dropped.

**Cost basis** (``basis``): ``effective`` (default) takes what each charge really cost once amortized: FOCUS
``EffectiveCost``; CUR ``savings_plan_savings_plan_effective_cost`` for ``SavingsPlanCoveredUsage``,
``reservation_effective_cost`` for ``DiscountedUsage``, ``line_item_unblended_cost`` otherwise, and
``SavingsPlanNegation`` left out (the usual amortized-cost rule of AWS's CUR query library). ``billed`` takes the
cash view: FOCUS ``BilledCost``; CUR ``line_item_unblended_cost`` of every kept row, negations included. CUR's
``net_*`` columns are not read: the discounts they fold in are read as their own line items, so nothing is
counted twice.

Money stays ``Decimal`` as written in the file. A currency other than USD, a missing column, an unparsable date or
number, an end before its start, or an unknown FOCUS charge category is a ``BillError`` naming the file and line;
nothing of such a bill is used.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import re
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from gpumeter.errors import GpumeterError
from services.billing.catalog import normalize_provider

BILL_FORMATS = ("focus", "cur2")
BASES = ("effective", "billed")
CURRENCY = "USD"

FOCUS_REQUIRED = ("ResourceId", "ChargePeriodStart", "ChargePeriodEnd", "ChargeCategory", "EffectiveCost",
                  "BilledCost", "BillingCurrency")
CUR2_REQUIRED = ("line_item_resource_id", "line_item_usage_start_date", "line_item_usage_end_date",
                 "line_item_line_item_type", "line_item_product_code", "line_item_usage_type",
                 "line_item_unblended_cost", "line_item_currency_code")

FOCUS_CHARGE_CATEGORIES = ("Usage", "Purchase", "Tax", "Credit", "Adjustment")
_FOCUS_PRICING = {"standard": "on_demand", "dynamic": "spot", "committed": "committed"}

_CUR_USAGE_TYPES = ("Usage", "SavingsPlanCoveredUsage", "DiscountedUsage")
_CUR_CREDIT_TYPES = ("Credit", "Refund")
_CUR_DISCOUNT_TYPES = ("EdpDiscount", "BundledDiscount", "PrivateRateDiscount", "DistributorDiscount",
                       "SppDiscount", "Discount")
_CUR_FEE_TYPES = ("Tax", "Fee", "RIFee", "SavingsPlanRecurringFee", "SavingsPlanUpfrontFee")
_INSTANCE_HOURS = re.compile(r"(^|-)(BoxUsage|SpotUsage|DedicatedUsage|HostBoxUsage)(:|$)")


class BillError(GpumeterError):
    """A billing export that cannot be read or used as it is."""


@dataclass(frozen=True, slots=True)
class BillLineItem:
    """One charge of one resource over ``[start_ms, end_ms)`` (milliseconds since the Unix epoch, UTC).

    ``cost`` is in the bill's basis, USD, as written (negative for credits). ``charge`` is ``usage`` (the
    machine's running time), ``credit``, ``discount`` or ``adjustment``; ``pricing`` what the row says of its
    price (``on_demand``, ``spot``, ``committed`` or empty); ``kind`` the row's own type (CUR line item type, FOCUS
    charge and pricing category); ``origin`` the file and line."""

    resource_id: str
    start_ms: int
    end_ms: int
    cost: Decimal
    charge: str
    pricing: str
    kind: str
    origin: str
    line_item_id: str = ""


@dataclass(frozen=True, slots=True)
class Skipped:
    """Rows of one reason that are not a node's charges, and what they cost in the bill's basis."""

    reason: str
    rows: int
    cost: Decimal


@dataclass(frozen=True)
class Bill:
    """A parsed billing export: its line items (see the module docstring), the time it covers (``scope``: the
    billing periods it names, else the span of its charge periods), the providers it is of (FOCUS
    ``ProviderName``; a CUR is AWS's; empty: not said) and the billing accounts (FOCUS ``BillingAccountId``, CUR
    ``bill_payer_account_id``; empty: not said)."""

    name: str
    format: str
    basis: str
    scope_start_ms: int
    scope_end_ms: int
    items: tuple[BillLineItem, ...]
    skipped: tuple[Skipped, ...] = ()
    rows: int = 0
    providers: tuple[str, ...] = ()
    accounts: tuple[str, ...] = ()
    _digest: str = field(default="", init=False, repr=False, compare=False)

    @property
    def scope_key(self) -> str:
        """Which bill this is, whatever version: providers, billing accounts and billing period. An amended export
        of the same accounts and period has the same scope key and another digest."""
        return (f"{','.join(self.providers)}|{','.join(self.accounts)}|{self.scope_start_ms}|"
                f"{self.scope_end_ms}")

    def digest(self) -> str:
        """A stable id of what this bill says (format, basis, scope and every line item, in a canonical order):
        the same export read twice -- or the same rows as CSV and as Parquet -- has the same digest; an amended
        export has another."""
        if not self._digest:
            hasher = hashlib.sha256(f"{self.format}|{self.basis}|{self.scope_key}".encode())
            for item in sorted(self.items, key=_canonical):
                hasher.update(("\n" + "|".join(_canonical(item))).encode())
            object.__setattr__(self, "_digest", hasher.hexdigest())
        return self._digest

    @property
    def total_cost(self) -> Decimal:
        return sum((item.cost for item in self.items), Decimal(0))


def _canonical(item: BillLineItem) -> tuple[str, ...]:
    return (item.resource_id, str(item.start_ms), str(item.end_ms), format(item.cost.normalize(), "f"), item.charge,
            item.pricing, item.kind, item.line_item_id)


# -- values -------------------------------------------------------------------------------------------------------


def parse_instant_ms(value: Any, column: str, where: str) -> int:
    """An ISO 8601 instant (``2026-11-01T00:00:00Z``, fractions and offsets allowed, a space for ``T``; no zone means
    UTC; a bare date is its midnight UTC) or a ``datetime`` → ms since the Unix epoch."""
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, date):
        moment = datetime(value.year, value.month, value.day)
    else:
        text = str(value or "").strip()
        if not text:
            raise BillError(f"{where}: {column} is empty")
        try:
            moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise BillError(f"{where}: {column} {text!r} is not an ISO 8601 date/time") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    delta = moment - datetime(1970, 1, 1, tzinfo=timezone.utc)
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def parse_money(value: Any, column: str, where: str, *, required: bool = True) -> Decimal | None:
    """A decimal amount as written (``Decimal``; a float from Parquet through its shortest repr)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise BillError(f"{where}: {column} is empty")
        return None
    if isinstance(value, Decimal):
        number = value
    elif isinstance(value, bool):
        raise BillError(f"{where}: {column} {value!r} is not a number")
    elif isinstance(value, (int, float)):
        number = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    else:
        try:
            number = Decimal(str(value).strip())
        except InvalidOperation:
            raise BillError(f"{where}: {column} {value!r} is not a number") from None
    if not number.is_finite():
        raise BillError(f"{where}: {column} {value!r} is not a finite number")
    return number


def _text(row: Mapping[str, Any], column: str) -> str:
    value = row.get(column)
    return "" if value is None else str(value).strip()


# -- formats ------------------------------------------------------------------------------------------------------


def focus_provider(name: str) -> str:
    """gpumeter's provider name (``aws``, ``gcp``, ``azure``) for a FOCUS ``ProviderName`` (``AWS``, ``Google
    Cloud``, ``Microsoft``); any other name lower-cased; empty for empty."""
    key = name.strip().lower()
    if key in ("aws", "amazon web services") or key.startswith("amazon"):
        return "aws"
    if key.startswith("google") or key == "gcp":
        return "gcp"
    if key.startswith("microsoft") or key.startswith("azure"):
        return "azure"
    return normalize_provider(key)


def detect_format(header: Sequence[str]) -> str:
    """``focus`` or ``cur2`` from a header; ``BillError`` for anything else."""
    names = set(header)
    if "ChargePeriodStart" in names and "EffectiveCost" in names:
        return "focus"
    if "line_item_line_item_type" in names:
        return "cur2"
    raise BillError("not a FOCUS export (no ChargePeriodStart/EffectiveCost columns) nor an AWS CUR 2.0 export "
                    "(no line_item_line_item_type column)")


class _Collector:
    def __init__(self, name: str, fmt: str, basis: str) -> None:
        if basis not in BASES:
            raise BillError(f"cost basis {basis!r} is not one of {BASES}")
        self.name, self.format, self.basis = name, fmt, basis
        self.items: list[BillLineItem] = []
        self.skipped: dict[str, list] = {}
        self.periods: list[tuple[int, int]] = []
        self.providers: set[str] = set()
        self.accounts: set[str] = set()
        self.rows = 0

    def skip(self, reason: str, cost: Decimal | None) -> None:
        entry = self.skipped.setdefault(reason, [0, Decimal(0)])
        entry[0] += 1
        entry[1] += cost or Decimal(0)

    def period(self, row: Mapping[str, Any], start_column: str, end_column: str, where: str) -> None:
        if _text(row, start_column):
            start = parse_instant_ms(row.get(start_column), start_column, where)
            end = parse_instant_ms(row.get(end_column), end_column, where)
            if end <= start:
                raise BillError(f"{where}: {end_column} is not after {start_column}")
            self.periods.append((start, end))

    def charge_period(self, row: Mapping[str, Any], start_column: str, end_column: str,
                      where: str) -> tuple[int, int]:
        start = parse_instant_ms(row.get(start_column), start_column, where)
        end = parse_instant_ms(row.get(end_column), end_column, where)
        if end <= start:
            raise BillError(f"{where}: {end_column} is not after {start_column}")
        return start, end

    def bill(self) -> Bill:
        spans = self.periods or [(i.start_ms, i.end_ms) for i in self.items]
        if not spans:
            raise BillError(f"{self.name}: no billing period and no line item of a resource: nothing to true up to")
        skipped = tuple(Skipped(reason, count, cost) for reason, (count, cost) in sorted(self.skipped.items()))
        return Bill(self.name, self.format, self.basis, min(s for s, _ in spans), max(e for _, e in spans),
                    tuple(self.items), skipped, self.rows, tuple(sorted(self.providers - {""})),
                    tuple(sorted(self.accounts - {""})))


def _check_columns(header: Sequence[str], required: Sequence[str], name: str, fmt: str) -> None:
    missing = [c for c in required if c not in header]
    if missing:
        raise BillError(f"{name}: a {fmt} export needs the columns {missing}")


def parse_focus_rows(rows: Iterable[Mapping[str, Any]], header: Sequence[str], *, name: str,
                     basis: str = "effective", first_line: int = 2) -> Bill:
    """FOCUS rows (CSV text values or Parquet values) → ``Bill``. ``first_line`` numbers the rows in errors."""
    _check_columns(header, FOCUS_REQUIRED, name, "FOCUS")
    out = _Collector(name, "focus", basis)
    for line, row in enumerate(rows, start=first_line):
        where = f"{name}:{line}"
        out.rows += 1
        currency = _text(row, "BillingCurrency")
        if currency != CURRENCY:
            raise BillError(f"{where}: BillingCurrency {currency!r}: gpumeter's ledger is in {CURRENCY}")
        out.period(row, "BillingPeriodStart", "BillingPeriodEnd", where)
        out.providers.add(focus_provider(_text(row, "ProviderName")))
        out.accounts.add(_text(row, "BillingAccountId"))
        effective = parse_money(row.get("EffectiveCost"), "EffectiveCost", where)
        billed = parse_money(row.get("BilledCost"), "BilledCost", where)
        cost = effective if basis == "effective" else billed
        category = _text(row, "ChargeCategory")
        if category not in FOCUS_CHARGE_CATEGORIES:
            raise BillError(f"{where}: ChargeCategory {category!r} is not one of {FOCUS_CHARGE_CATEGORIES}")
        start, end = out.charge_period(row, "ChargePeriodStart", "ChargePeriodEnd", where)
        resource = _text(row, "ResourceId")
        if not resource:
            out.skip(f"{category.lower()} without a resource id", cost)
            continue
        pricing_category = _text(row, "PricingCategory")
        if category == "Usage":
            service = _text(row, "ServiceCategory")
            if service and service != "Compute":
                out.skip(f"usage of service category {service}", cost)
                continue
            charge = "usage"
        elif category in ("Credit", "Adjustment"):
            charge = category.lower()
        else:
            out.skip(category.lower(), cost)
            continue
        assert cost is not None
        kind = category + (f"/{pricing_category}" if pricing_category else "")
        out.items.append(BillLineItem(resource, start, end, cost, charge,
                                      _FOCUS_PRICING.get(pricing_category.lower(), ""), kind, where))
    return out.bill()


def parse_cur2_rows(rows: Iterable[Mapping[str, Any]], header: Sequence[str], *, name: str,
                    basis: str = "effective", first_line: int = 2) -> Bill:
    """AWS CUR 2.0 rows → ``Bill`` (see the module docstring for which rows and which cost)."""
    _check_columns(header, CUR2_REQUIRED, name, "CUR 2.0")
    out = _Collector(name, "cur2", basis)
    for line, row in enumerate(rows, start=first_line):
        where = f"{name}:{line}"
        out.rows += 1
        currency = _text(row, "line_item_currency_code")
        if currency != CURRENCY:
            raise BillError(f"{where}: line_item_currency_code {currency!r}: gpumeter's ledger is in {CURRENCY}")
        out.period(row, "bill_billing_period_start_date", "bill_billing_period_end_date", where)
        out.providers.add("aws")
        out.accounts.add(_text(row, "bill_payer_account_id"))
        line_type = _text(row, "line_item_line_item_type")
        unblended = parse_money(row.get("line_item_unblended_cost"), "line_item_unblended_cost", where)
        assert unblended is not None
        start, end = out.charge_period(row, "line_item_usage_start_date", "line_item_usage_end_date", where)
        resource = _text(row, "line_item_resource_id")
        cost = unblended
        if line_type in _CUR_USAGE_TYPES:
            if basis == "effective" and line_type == "SavingsPlanCoveredUsage":
                cost = _required(row, "savings_plan_savings_plan_effective_cost", header, where, line_type)
            elif basis == "effective" and line_type == "DiscountedUsage":
                cost = _required(row, "reservation_effective_cost", header, where, line_type)
            if not resource:
                out.skip(f"{line_type} without a resource id", cost)
                continue
            if _text(row, "line_item_product_code") != "AmazonEC2" or not _INSTANCE_HOURS.search(
                    _text(row, "line_item_usage_type")):
                out.skip("other charges of a resource (not an EC2 instance's running time)", cost)
                continue
            charge = "usage"
        elif line_type == "SavingsPlanNegation":
            if basis == "effective":
                out.skip("SavingsPlanNegation (not part of the effective cost)", Decimal(0))
                continue
            if not resource:
                out.skip("SavingsPlanNegation without a resource id", cost)
                continue
            charge = "adjustment"
        elif line_type in _CUR_CREDIT_TYPES or line_type in _CUR_DISCOUNT_TYPES:
            if not resource:
                out.skip(f"{line_type} without a resource id", cost)
                continue
            charge = "credit" if line_type in _CUR_CREDIT_TYPES else "discount"
        elif line_type in _CUR_FEE_TYPES:
            out.skip(line_type, cost)
            continue
        else:
            out.skip(f"line item type {line_type or '(empty)'}", cost)
            continue
        term = _text(row, "pricing_term")
        pricing = ("committed" if line_type in ("SavingsPlanCoveredUsage", "DiscountedUsage")
                   else {"Spot": "spot", "OnDemand": "on_demand"}.get(term, ""))
        out.items.append(BillLineItem(resource, start, end, cost, charge, pricing,
                                      line_type + (f"/{term}" if term else ""), where,
                                      _text(row, "identity_line_item_id")))
    return out.bill()


def _required(row: Mapping[str, Any], column: str, header: Sequence[str], where: str, line_type: str) -> Decimal:
    if column not in header:
        raise BillError(f"{where}: a {line_type} row's effective cost is in {column}, a column this export lacks "
                        "(use --basis billed, or export the Savings Plan and reservation columns)")
    value = parse_money(row.get(column), column, where)
    assert value is not None
    return value


def parse_bill_rows(rows: Iterable[Mapping[str, Any]], header: Sequence[str], *, name: str, fmt: str = "auto",
                    basis: str = "effective", first_line: int = 2) -> Bill:
    """Rows of either format (``fmt`` ``auto`` detects it from the header)."""
    fmt = detect_format(header) if fmt == "auto" else fmt
    if fmt == "focus":
        return parse_focus_rows(rows, header, name=name, basis=basis, first_line=first_line)
    if fmt == "cur2":
        return parse_cur2_rows(rows, header, name=name, basis=basis, first_line=first_line)
    raise BillError(f"bill format {fmt!r} is not one of {BILL_FORMATS} (or auto)")


def parse_bill_csv(text: str, *, name: str, fmt: str = "auto", basis: str = "effective") -> Bill:
    """A CSV export's text → ``Bill``."""
    reader = csv.DictReader(io.StringIO(text.lstrip("\ufeff")))
    header = tuple(reader.fieldnames or ())
    return parse_bill_rows(_complete(reader, name), header, name=name, fmt=fmt, basis=basis)


def _complete(reader: csv.DictReader, name: str) -> Iterator[dict]:
    for row in reader:
        if None in row or any(v is None for v in row.values()):
            raise BillError(f"{name}:{reader.line_num}: wrong number of fields")
        yield row


# -- files --------------------------------------------------------------------------------------------------------


def read_bill(path: Path | str, *, fmt: str = "auto", basis: str = "effective") -> Bill:
    """Read a billing export file: ``.csv`` or ``.csv.gz`` (FOCUS or CUR 2.0), ``.parquet`` (FOCUS; pyarrow)."""
    path = Path(path)
    name = path.name
    try:
        if path.suffix == ".parquet":
            return _read_parquet(path, fmt=fmt, basis=basis)
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        text = raw.decode("utf-8")
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise BillError(f"cannot read the bill {path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise BillError(f"the bill {path} is not UTF-8 text: {exc}") from None
    return parse_bill_csv(text, name=name, fmt=fmt, basis=basis)


def _read_parquet(path: Path, *, fmt: str, basis: str) -> Bill:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise BillError(f"cannot read the Parquet bill {path}: {exc}") from exc
    header = tuple(parquet.schema_arrow.names)

    def rows() -> Iterator[dict]:
        try:
            for batch in parquet.iter_batches():
                yield from batch.to_pylist()
        except (OSError, pa.ArrowException) as exc:
            raise BillError(f"cannot read the Parquet bill {path}: {exc}") from exc

    return parse_bill_rows(rows(), header, name=path.name, fmt=fmt, basis=basis, first_line=1)
