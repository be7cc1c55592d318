"""``gpumeter export focus --out FILE.parquet``: the ledger's windows as a FOCUS dataset (``services.billing.focus``).

Two grains (``--grain``):

* **minute** (``focus_dataset``): reads the node bills of the windows starting in [start_ms, end_ms), their price
  versions and their cost lines with what each was billed (``Ledger.billed_cost_lines``: the trued-up cost where a
  reconcile stored one, else the list cost): one row per pod and kept bucket per node-window.
* **hour** (``focus_hour_chunks``): reads the hourly FOCUS grain (``services.billing.focus_rollups``): one row per
  pod and kept bucket per hourly origin charge (a node's bills of one UTC hour), a day of hours at a time. Needs a
  range of whole UTC hours that the rollups hold (``choose_grain``).
* **auto** (the default): hourly when the range is whole UTC hours and the hourly rollups cover it (retention kept
  it and its origin charges add up to the hours' node bills), minute otherwise.

The command says which grain it used. ``--out`` ending ``.parquet`` writes Parquet (pyarrow; the schema's metadata
says ``gpumeter_grain``), ``.csv`` the same rows as ``gpumeter report --format focus`` prints. Exit codes: 0
written, 2 on a usage or ledger error.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Iterator, Mapping

from sqlalchemy.exc import SQLAlchemyError

from gpumeter.clock import Clock, SystemClock, iso_utc
from gpumeter.errors import ConfigError, GpumeterError
from services.billing import focus_rollups, read_rollups, rollups
from services.billing.rollups import HOUR, HOUR_MS, MINUTE
from services.billing.time_args import parse_duration_seconds, parse_instant_ms
from services.billing.focus import (
    FocusBill,
    FocusCharge,
    FocusColumns,
    FocusLine,
    HourLines,
    focus_hour_columns,
    focus_rows,
    write_focus_csv_chunks,
    write_focus_parquet_chunks,
)
from services.billing.ledger import (
    DEFAULT_LEDGER_URL,
    FOCUS_ROLLUPS,
    LEDGER_URL_ENV,
    READ_ROLLUPS,
    ROLLUPS,
    Ledger,
    LedgerError,
    MinuteLinesDropped,
    label_sets,
)

DATASETS = ("focus",)
GRAINS = ("auto", "hour", "minute")
# Hours read and mapped at a time at the hourly grain: a day of a 1,000-GPU cluster is ~90,000 rows.
CHUNK_HOURS = 24
# Worker processes an hourly Parquet export uses at most (``default_workers``).
MAX_WORKERS = 4


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


@dataclass(frozen=True, slots=True)
class FocusGrain:
    """The grain an export reads (``hour`` or ``minute``) and why."""

    grain: str
    reason: str

    def describe(self) -> str:
        return f"{self.grain} ({self.reason})"


def choose_grain(ledger: Ledger, *, start_ms: int, end_ms: int, cluster: str | None = None,
                 grain: str = "auto") -> FocusGrain:
    """The grain that answers [start_ms, end_ms): ``minute`` as asked; ``hour`` as asked, or ``GpumeterError``
    (``MinuteLinesDropped`` for hours the rollups no longer hold) when the range is not whole UTC hours the hourly
    FOCUS rollups cover; ``auto``: ``hour`` where it would answer, else ``minute``."""
    if grain not in GRAINS:
        raise ConfigError(f"grain {grain!r} is not one of {GRAINS}")
    if grain == MINUTE:
        return FocusGrain(MINUTE, "minute cost lines, as asked")
    hours = (end_ms - start_ms) // HOUR_MS
    why_not = None
    if start_ms % HOUR_MS or end_ms % HOUR_MS:
        why_not = (f"the range {iso_utc(start_ms)} to {iso_utc(end_ms)} is not whole UTC hours")
    else:
        kept = focus_rollups.kept_from(ledger.read, ROLLUPS.retention)
        if kept is not None and start_ms < kept:
            if grain == HOUR:
                raise MinuteLinesDropped(f"the hourly FOCUS rollups hold hours from {iso_utc(kept)} only: ask for a "
                                         "range from then")
            why_not = f"the hourly FOCUS rollups hold hours from {iso_utc(kept)} only"
        elif end_ms > start_ms:
            windows, micro = focus_rollups.window_totals(ledger.read, FOCUS_ROLLUPS, start_ms, end_ms, cluster)
            bill_micro, bill_windows = read_rollups.bill_totals(
                ledger.read, READ_ROLLUPS, rollups.Segment(HOUR, start_ms, end_ms), cluster=cluster,
                cost="list")
            if (windows, micro) != (bill_windows, bill_micro):
                why_not = (f"the hourly FOCUS rollups hold {windows} node-windows ({micro} micro-USD) of the range, "
                           f"the hourly bill rollups {bill_windows} ({bill_micro} micro-USD)")
    if why_not is None:
        return FocusGrain(HOUR, f"hourly FOCUS rollups, {hours} hour{'s' if hours != 1 else ''}")
    if grain == HOUR:
        raise ConfigError(f"--grain hour: {why_not}")
    return FocusGrain(MINUTE, f"minute cost lines: {why_not}")


def _charge(row: tuple, prices: Mapping[str, Mapping[str, Any]]) -> FocusCharge:
    price = prices[row[5]]
    return FocusCharge(*row[:12], *(int(v) for v in row[12:17]), str(price["price_per_hour_usd"]),
                       str(price.get("split_rule") or ""))


def _read_hours(ledger: Ledger, start_ms: int, end_ms: int, cluster: str | None) -> tuple[list, HourLines]:
    """What the hours [start_ms, end_ms) export from: their origin charges, each (its key in the lines, the charge),
    and their lines (``HourLines``). On PostgreSQL the lines are read by ids (``focus_rollups.hour_lines_by_ids``:
    numbers through the driver, the texts once per id), on SQLite as text rows (``focus_rollups.lines_of``)."""
    by_ids = ledger.dialect == "postgresql"
    charge_rows = focus_rollups.charges_of(ledger.read, FOCUS_ROLLUPS, start_ms, end_ms, cluster, with_ids=by_ids)
    if by_ids:
        lines, kinds, pods, gpus = _read_driver(ledger, lambda connection: focus_rollups.hour_lines_by_ids(
            connection, start_ms, end_ms, cluster))
        charges = [(row[-1], row) for row in charge_rows]
    else:
        lines, kinds, pods, gpus = focus_rollups.hour_lines_of_texts(
            focus_rollups.lines_of(ledger.read, FOCUS_ROLLUPS, start_ms, end_ms, cluster))
        charges = [(tuple(row[:len(focus_rollups.LINK)]), row) for row in charge_rows]
    prices = ledger.price_versions({row[5] for row in charge_rows})
    labels = focus_rollups.label_sets_of(ledger.read, label_sets, {line[5] for line in lines})
    return [(key, _charge(row, prices)) for key, row in charges], HourLines(lines, kinds, pods, gpus, labels)


def _chunk_spans(start_ms: int, end_ms: int, chunk_hours: int) -> list[tuple[int, int]]:
    """[start_ms, end_ms) cut into consecutive spans of ``chunk_hours`` hours (the last one shorter), oldest first."""
    spans = []
    at = start_ms
    while at < end_ms:
        spans.append((at, min(end_ms, at + chunk_hours * HOUR_MS)))
        at = spans[-1][1]
    return spans


def focus_hour_chunks(ledger: Ledger, *, start_ms: int, end_ms: int, cluster: str | None = None,
                      billing_account_id: str | None = None, chunk_hours: int = CHUNK_HOURS
                      ) -> Iterator[FocusColumns]:
    """The hourly grain's FOCUS rows (``focus.focus_hour_columns``: columns, no row dicts) of the hours in
    [start_ms, end_ms), ``chunk_hours`` of hours at a time, oldest first (the caller checks the grain answers:
    ``choose_grain``), read by ``_read_hours``. On PostgreSQL the next chunk is read in a thread while this one
    is made and written (the server's time overlaps this process's; SQLite's one connection is not shared)."""
    spans = _chunk_spans(start_ms, end_ms, chunk_hours)
    ahead = ThreadPoolExecutor(1) if ledger.dialect == "postgresql" and len(spans) > 1 else None
    try:
        pending = ahead.submit(_read_hours, ledger, *spans[0], cluster) if ahead and spans else None
        for index, (at, until) in enumerate(spans):
            if pending is not None:
                charges, hour_lines = pending.result()
                pending = (ahead.submit(_read_hours, ledger, *spans[index + 1], cluster)
                           if index + 1 < len(spans) else None)
            else:
                charges, hour_lines = _read_hours(ledger, at, until, cluster)
            try:
                chunk = focus_hour_columns(charges, hour_lines, billing_account_id=billing_account_id)
            except ValueError as exc:
                raise GpumeterError(f"the ledger cannot be exported as FOCUS: {exc}") from exc
            del charges, hour_lines
            yield chunk
    finally:
        if ahead is not None:
            ahead.shutdown(wait=True, cancel_futures=True)


def _read_driver(ledger: Ledger, reader):
    """``reader(connection)`` on a read connection of ``ledger``, the driver's errors as ``LedgerError`` (what
    ``Ledger.read`` makes of them)."""
    dbapi = ledger.engine.dialect.loaded_dbapi
    try:
        with ledger.engine.connect() as connection:
            return reader(connection)
    except (SQLAlchemyError, dbapi.Error) as exc:
        raise LedgerError(f"reading {ledger!r} failed: {exc}") from exc


def default_workers() -> int:
    """Worker processes of an hourly Parquet export from PostgreSQL: one per core, at most ``MAX_WORKERS`` (a day's
    rows do not depend on another's)."""
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


# A worker process's ledger, opened once per process (``_worker_start``).
_WORKER_LEDGER: Ledger | None = None


def _worker_start(url: str) -> None:
    global _WORKER_LEDGER
    _WORKER_LEDGER = Ledger(url)


def _span_table(start_ms: int, end_ms: int, cluster: str | None, billing_account_id: str | None,
                folder: str) -> str:
    """In a worker: the hourly rows of [start_ms, end_ms) (one chunk, ``focus_hour_chunks``) as the Parquet
    writer's Arrow table (``FocusColumns.arrow_table``), written to an Arrow IPC file in ``folder`` whose path it
    returns (the caller maps it: no copy through a pipe)."""
    import pyarrow as pa

    assert _WORKER_LEDGER is not None
    (chunk,) = focus_hour_chunks(_WORKER_LEDGER, start_ms=start_ms, end_ms=end_ms, cluster=cluster,
                                 billing_account_id=billing_account_id, chunk_hours=(end_ms - start_ms) // HOUR_MS)
    table = chunk.arrow_table()
    path = os.path.join(folder, f"{start_ms}.arrow")
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def focus_hour_tables(ledger: Ledger, *, start_ms: int, end_ms: int, cluster: str | None = None,
                      billing_account_id: str | None = None, workers: int = 1,
                      chunk_hours: int = CHUNK_HOURS) -> Iterator[Any]:
    """The hourly rows of ``focus_hour_chunks`` as the Parquet writer's Arrow tables, a chunk each, oldest first
    -- made by up to ``workers`` processes of their own (spawned; each opens the ledger once), at most one per two
    chunks (fewer than two: in this process), at most ``workers + 1`` chunks ahead of the caller, each handed over as an Arrow IPC file in
    a temporary folder (``/dev/shm`` where there is one) that this process maps and deletes (the mapping lives
    as long as the table). The same tables as ``FocusColumns.arrow_table`` of each chunk: the writer writes the same file."""
    import pyarrow as pa

    spans = _chunk_spans(start_ms, end_ms, chunk_hours)
    # A worker takes ~2 s to start (a spawned interpreter's imports): one per two chunks at most, so that an export
    # of a day or two stays in this process (48 hours of the bench's fleet: 5.0 s in one process, 9.0 with two).
    workers = min(workers, len(spans) // 2)
    if workers <= 1:
        for chunk in focus_hour_chunks(ledger, start_ms=start_ms, end_ms=end_ms, cluster=cluster,
                                       billing_account_id=billing_account_id, chunk_hours=chunk_hours):
            yield chunk.arrow_table()
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process holding connections and threads
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="gpumeter-focus-", dir=shm) as folder, ProcessPoolExecutor(
            workers, mp_context=context, initializer=_worker_start,
            initargs=(ledger.url,)) as pool:
        ahead = iter(spans)
        pending = deque(pool.submit(_span_table, *span, cluster, billing_account_id, folder)
                        for span in islice(ahead, workers + 1))
        while pending:
            path = pending.popleft().result()
            for span in islice(ahead, 1):
                pending.append(pool.submit(_span_table, *span, cluster, billing_account_id, folder))
            # The table's buffers keep the mapping (not the file) alive for as long as the caller holds them.
            table = pa.ipc.open_file(pa.memory_map(path)).read_all()
            os.unlink(path)
            yield table


def focus_export(ledger: Ledger, *, start_ms: int, end_ms: int, cluster: str | None = None,
                 billing_account_id: str | None = None, grain: str = "auto", workers: int = 1
                 ) -> tuple[FocusGrain, Iterator[Any]]:
    """The grain that answers (``choose_grain``) and the FOCUS rows at it, a chunk at a time: at hourly grain
    ``FocusColumns`` (a day each), at minute grain one list of row dicts (``focus_rows``); the writers take
    both. ``workers`` > 1 (a Parquet export: ``write_focus_parquet_chunks`` only) on PostgreSQL at hourly grain:
    the chunks are Arrow tables made by that many worker processes (``focus_hour_tables``)."""
    chosen = choose_grain(ledger, start_ms=start_ms, end_ms=end_ms, cluster=cluster, grain=grain)
    if chosen.grain == HOUR:
        if workers > 1 and ledger.dialect == "postgresql":
            return chosen, focus_hour_tables(ledger, start_ms=start_ms, end_ms=end_ms, cluster=cluster,
                                             billing_account_id=billing_account_id, workers=workers)
        return chosen, focus_hour_chunks(ledger, start_ms=start_ms, end_ms=end_ms, cluster=cluster,
                                         billing_account_id=billing_account_id)
    return chosen, iter([focus_dataset(ledger, start_ms=start_ms, end_ms=end_ms, cluster=cluster,
                                       billing_account_id=billing_account_id)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", choices=DATASETS, help="what to export: focus (FOCUS 1.3 cost and usage rows)")
    parser.add_argument("--out", required=True, type=Path, metavar="FILE",
                        help="FILE.parquet (Parquet) or FILE.csv (CSV, as gpumeter report --format focus)")
    parser.add_argument("--window", default="24h", help="how far back from --end (90m, 24h, 7d; default 24h)")
    parser.add_argument("--end", default=None, help="end, ISO 8601 (default: now)")
    parser.add_argument("--cluster", default=None, help="only this cluster (default: all)")
    parser.add_argument("--grain", default="auto", choices=GRAINS,
                        help="hour: one row per pod and bucket per node-hour, from the hourly FOCUS rollups (whole "
                             "UTC hours); minute: per node-window, from the minute cost lines; auto: hour when the "
                             "range is whole hours the rollups hold, else minute (default)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes that make an hourly Parquet export from PostgreSQL, a day each (default: one "
                             f"per core, at most {MAX_WORKERS})")
    parser.add_argument("--billing-account-id", default=None,
                        help="the rows' BillingAccountId (default: the cluster name)")
    parser.add_argument("--ledger-url", default=None,
                        help=f"SQLAlchemy URL of the ledger (default: ${LEDGER_URL_ENV} or {DEFAULT_LEDGER_URL})")


def main(args: argparse.Namespace, env: Mapping[str, str], *, clock: Clock | None = None, out=None,
         err=None) -> int:
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
            workers = getattr(args, "workers", None) or default_workers()
            chosen, chunks = focus_export(ledger, start_ms=start_ms, end_ms=end_ms, cluster=args.cluster,
                                          billing_account_id=args.billing_account_id,
                                          grain=getattr(args, "grain", "auto"),
                                          workers=workers if suffix == ".parquet" else 1)
            # Rows come a day at a time at the hourly grain: written beside the file and moved onto it once all
            # are written, so a failed export leaves no partial dataset under the name asked for.
            partial = args.out.with_name(args.out.name + ".partial")
            try:
                if suffix == ".parquet":
                    count = write_focus_parquet_chunks(chunks, partial, metadata={"gpumeter_grain": chosen.grain})
                else:
                    with partial.open("w", encoding="utf-8", newline="") as stream:
                        count = write_focus_csv_chunks(chunks, stream)
                partial.replace(args.out)
            finally:
                partial.unlink(missing_ok=True)
    except (GpumeterError, OSError) as exc:
        print(f"gpumeter export: {exc}", file=err)
        return 2
    print(f"wrote {count} FOCUS rows to {args.out}; grain: {chosen.describe()}", file=out)
    return 0
