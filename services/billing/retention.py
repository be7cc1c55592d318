"""``gpumeter ledger retention``: drop the ledger's minute cost lines, node bills and rollups past their retention.

What is kept how long (``RetentionSettings``; docs/billing.md, "Rollups and retention"):

* **minute cost lines** (``cost_lines``) **and node bills** (``node_bills``): ``minute_lines_days`` (default 14).
  The lines are what a report by pod, GPU or any label but the team needs, what the FOCUS export and
  ``/allocation`` read; a bill is one row per node-window, what the lines reconcile against, what true-up
  apportions over (with its lines: ``gpumeter reconcile`` of a bill whose windows are gone refuses -- run it within
  this retention, or raise it). The zero lines a bill lists (``node_bills.zero_lines``,
  ``services.billing.line_storage``) go with it. Every reader of lines or bills over a range before the horizon
  refuses with ``MinuteLinesDropped`` rather than report that part as costing nothing.
* **hourly rollups** (of the lines, the bills and the pods: ``services.billing.rollups``, ``read_rollups``; the
  hourly FOCUS grain: ``focus_rollups``):
  ``hourly_rollups_days`` (default 92, a quarter); **daily rollups**: ``daily_rollups_days`` (default 400: a year
  and a month, for year-on-year); each at least the finer grain's.
* Price versions and true-ups: kept (a few rows each). **Label sets** (``label_sets``) are never deleted: a set is
  shared by lines of any age (content-addressed), so a line's set outlives the line. Nor are the dictionaries of
  ids (PostgreSQL: ``services.billing.line_ids`` from 0014, ``services.billing.bill_ids`` from 0018, its zero sets
  content-addressed like the label sets): a few rows per node, GPU and pod.

``retain(ledger, settings, now_ms=)``: the clock is passed in. Per grain the horizon is ``now`` less the
retention, rounded down to a UTC day boundary (so a grain keeps whole days, and an hour or day is either all there
or all gone). The horizon is recorded in ``ledger_retention`` *first*, in its own transaction -- so a reader
already avoids (or refuses) the range that is being dropped -- then what is older goes:

* **SQLite**: ranged ``DELETE`` statements by window start (``delete_batch_hours`` of windows per transaction, on
  the primary key's leading column: short transactions that never hold the write lock for long), the lines of a
  range before its bills (a line never outlives its bill; on SQLite its foreign key names it).
* **PostgreSQL** (partitioned from revision 0010, ``services.billing.partitions``): whole partitions are detached
  and dropped -- never a ``DELETE``, nothing left for VACUUM -- one short transaction per partition, a day's lines
  before its bills. A partition goes only when it lies wholly before the horizon: the daily partitions of lines,
  bills and hourly rollups exactly at it (horizons are whole UTC days); the daily rollups' monthly partitions keep
  their rows until the whole month is past (rows before the horizon that no reader asks for). It also creates the
  partitions of the days ahead (``partitions.AHEAD_DAYS``) with its clock, as billing does.

A horizon never moves back: lengthening a retention keeps what is left and cannot bring back what was dropped.
Running it again drops nothing more.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Mapping

from sqlalchemy import delete, func, select
from sqlalchemy.exc import SQLAlchemyError

from gpumeter import config
from gpumeter.clock import Clock, SystemClock
from gpumeter.config import at_least, between, integer, load, non_empty, setting, settings_repr, validate
from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.redact import mask_url
from services.billing import partitions
from services.billing.ledger import (
    BILL_IDS,
    DEFAULT_LEDGER_URL,
    FOCUS_ROLLUPS,
    LEDGER_URL_ENV,
    READ_ROLLUPS,
    ROLLUPS,
    Ledger,
    LedgerError,
    cost_lines,
    node_bills,
)
from services.billing.rollups import DAY, DAY_MS, HOUR, HOUR_MS, MINUTE
from services.billing.time_args import parse_instant_ms

DEFAULT_MINUTE_LINES_DAYS = 14
DEFAULT_HOURLY_ROLLUPS_DAYS = 92
DEFAULT_DAILY_ROLLUPS_DAYS = 400


@dataclass(frozen=True)
class RetentionSettings:
    """What ``gpumeter ledger retention`` keeps (see the module docstring), validated once."""

    ledger_url: str = setting(DEFAULT_LEDGER_URL, env=LEDGER_URL_ENV, flag="--ledger-url", check=non_empty,
                              secret=True, mask=mask_url, help="SQLAlchemy URL of the ledger")
    minute_lines_days: int = setting(DEFAULT_MINUTE_LINES_DAYS, env="GPUMETER_LEDGER_MINUTE_LINES_DAYS",
                                     flag="--minute-lines-days", parse=integer, check=at_least(1),
                                     help="days of minute cost lines kept (reports by pod, FOCUS, true-up)")
    hourly_rollups_days: int = setting(DEFAULT_HOURLY_ROLLUPS_DAYS, env="GPUMETER_LEDGER_HOURLY_ROLLUPS_DAYS",
                                       flag="--hourly-rollups-days", parse=integer, check=at_least(1),
                                       help="days of hourly rollups kept (at least the minute lines')")
    daily_rollups_days: int = setting(DEFAULT_DAILY_ROLLUPS_DAYS, env="GPUMETER_LEDGER_DAILY_ROLLUPS_DAYS",
                                      flag="--daily-rollups-days", parse=integer, check=at_least(1),
                                      help="days of daily rollups kept (at least the hourly rollups')")
    delete_batch_hours: int = setting(1, env="GPUMETER_LEDGER_RETENTION_BATCH_HOURS", flag="--batch-hours",
                                      parse=integer, check=between(1, 24 * 31),
                                      help="hours of windows deleted per transaction")

    def __post_init__(self) -> None:
        validate(self)
        if not self.minute_lines_days <= self.hourly_rollups_days <= self.daily_rollups_days:
            # A finer grain outliving a coarser one would leave periods only a finer grain answers, which the
            # reports' plan (coarsest first) does not look for.
            raise ConfigError("retention must not shrink with the grain: minute lines <= hourly rollups <= daily "
                              f"rollups days (got {self.minute_lines_days}, {self.hourly_rollups_days}, "
                              f"{self.daily_rollups_days})")

    def __repr__(self) -> str:
        return settings_repr(self)

    def days(self) -> dict[str, int]:
        return {MINUTE: self.minute_lines_days, HOUR: self.hourly_rollups_days, DAY: self.daily_rollups_days}


def horizons(settings: RetentionSettings, now_ms: int) -> dict[str, int]:
    """Per grain, the oldest window start kept: ``now`` less its retention, down to a UTC day boundary. Pure."""
    out = {}
    for grain, days in settings.days().items():
        cut = now_ms - days * DAY_MS
        out[grain] = cut - cut % DAY_MS
    return out


@dataclass(frozen=True, slots=True)
class RetentionResult:
    """Per grain: the horizon now in force and the rows this run removed (``deleted``: the minute grain counts cost
    lines; ``bills_deleted``: node bills, which go with them); ``dropped_partitions``: on PostgreSQL, the
    partitions it detached and dropped, oldest first (empty on SQLite)."""

    kept_from_ms: Mapping[str, int]
    deleted: Mapping[str, int]
    bills_deleted: int = 0
    dropped_partitions: tuple[str, ...] = ()


def _tables():
    """Per grain, the tables it drops, in the order they go (a day's lines before its bills), with their time
    column: the minute lines and their node bills; per rollup grain, the line, bill and pod rollups together."""
    # The hourly FOCUS grain (``focus_rollups``) goes with the hourly rollups; it has no daily grain.
    focus = {HOUR: (FOCUS_ROLLUPS.lines, FOCUS_ROLLUPS.charges), DAY: ()}
    return {MINUTE: ((cost_lines, cost_lines.c.window_start_unix_ms),
                     (node_bills, node_bills.c.window_start_unix_ms)),
            **{grain: tuple((table, table.c.period_start_unix_ms)
                            for table in (ROLLUPS.by_grain[grain], READ_ROLLUPS.bills[grain], READ_ROLLUPS.pods[grain],
                                          *focus[grain]))
               for grain in (HOUR, DAY)}}


def retain(ledger: Ledger, settings: RetentionSettings, *, now_ms: int) -> RetentionResult:
    """Drop what is past retention (module docstring); ``LedgerError`` when the ledger cannot be used."""
    try:
        return _retain(ledger, settings, now_ms)
    except SQLAlchemyError as exc:
        raise LedgerError(f"retention in {ledger!r} failed: {exc}") from exc


def _retain(ledger: Ledger, settings: RetentionSettings, now_ms: int) -> RetentionResult:
    wanted = horizons(settings, now_ms)
    table = ROLLUPS.retention
    with ledger.transaction() as connection:
        recorded = dict(connection.execute(select(table.c.grain, table.c.kept_from_unix_ms)).all())
        kept = {grain: max(horizon, int(recorded.get(grain, horizon))) for grain, horizon in wanted.items()}
        statement = ledger.insert(table)
        connection.execute(
            statement.on_conflict_do_update(index_elements=[table.c.grain],
                                            set_={"kept_from_unix_ms": statement.excluded.kept_from_unix_ms,
                                                  "applied_at_unix_ms": statement.excluded.applied_at_unix_ms}),
            [{"grain": grain, "kept_from_unix_ms": horizon, "applied_at_unix_ms": now_ms}
             for grain, horizon in sorted(kept.items())])
        split = partitions.partitioned(connection)
    if split:
        ledger.ensure_partitions(now_ms)
        return _drop_partitions(ledger, kept)
    step = settings.delete_batch_hours * HOUR_MS
    deleted = {}
    bills = 0
    for grain, tables in _tables().items():
        with ledger.transaction() as connection:
            # A bill's window may have no line row at all (every line a zero line): look at every table.
            found = [connection.execute(select(func.min(column)).where(column < kept[grain])).scalar()
                     for _data, column in tables]
        found = [int(ms) for ms in found if ms is not None]
        oldest = min(found) if found else None
        counts = [0] * len(tables)
        if oldest is not None:
            start = int(oldest) - int(oldest) % HOUR_MS
            while start < kept[grain]:
                end = min(start + step, kept[grain])
                with ledger.transaction() as connection:
                    for index, (data, time_column) in enumerate(tables):
                        counts[index] += connection.execute(
                            delete(data).where(time_column >= start, time_column < end)).rowcount
                start = end
        # The grain's rows; a minute's node bills are counted apart.
        deleted[grain] = counts[0] if grain == MINUTE else sum(counts)
        if grain == MINUTE:
            bills = counts[1]
    return RetentionResult(kept, deleted, bills_deleted=bills)


def _drop_partitions(ledger: Ledger, kept: Mapping[str, int]) -> RetentionResult:
    """PostgreSQL: detach and drop every partition wholly before its grain's horizon (module docstring)."""
    grains = {grain: tuple(data.name for data, _column in tables) for grain, tables in _tables().items()}
    # The lines' partitions are ``cost_line_rows``' at 0014 and 0015, ``cost_line_packs``' from 0016 (``cost_lines``
    # is a view over them); a pack's partition counts its lines. The bills' are ``node_bill_rows``' from 0018
    # (``node_bills``: a view over them).
    grains[MINUTE] = partitions.MINUTE_TABLES
    # The hourly FOCUS lines' partitions are ``focus_line_hourly_rows``' from 0017 (``focus_line_hourly``: a view).
    grains[HOUR] = tuple(FOCUS_ROLLUPS.rows.name if name == FOCUS_ROLLUPS.lines.name else name
                         for name in grains[HOUR])
    deleted = {grain: 0 for grain in grains}
    bills = 0
    dropped = []
    for grain, tables in grains.items():
        with ledger.transaction() as connection:
            doomed = list(partitions.iter_past(connection, tables, kept[grain]))
        for part in doomed:
            with ledger.transaction() as connection:
                rows = partitions.rows_in(connection, part)
                partitions.drop(connection, part)
            if part.table in (node_bills.name, BILL_IDS.rows.name):
                bills += rows
            else:
                deleted[grain] += rows
            dropped.append(part.name)
    return RetentionResult(kept, deleted, bills_deleted=bills, dropped_partitions=tuple(dropped))


# -- command line (``gpumeter ledger retention``) -----------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``gpumeter ledger retention [--now ISO] [settings]``."""
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    retention = actions.add_parser("retention", help="drop minute cost lines, node bills and rollups past their "
                                   "retention",
                                   description=__doc__.splitlines()[0])
    config.add_arguments(retention, RetentionSettings)
    when = retention.add_mutually_exclusive_group()
    when.add_argument("--now", default=None, help="the clock's time, ISO 8601 (default: now)")
    when.add_argument("--every", type=float, default=None, metavar="SECONDS",
                      help="run again every SECONDS until stopped (SIGTERM, SIGINT), for hosts without a "
                      "scheduler (docker compose); a failed run is reported and the next one tries again")


def retention_settings(args: argparse.Namespace, env: Mapping[str, str]) -> RetentionSettings:
    """The settings ``gpumeter ledger retention`` runs with: flags over environment over defaults."""
    return load(RetentionSettings, args, env)


def main(args: argparse.Namespace, env: Mapping[str, str], *, clock: Clock | None = None, out=None,
         err=None, stop: threading.Event | None = None) -> int:
    """Apply the retention once (0 done, 2 on a usage or ledger error), or with ``--every`` repeatedly until
    ``stop`` is set (by SIGTERM/SIGINT unless given): 0 when stopped, 2 for unusable settings; a run that fails
    is reported on ``err`` and the next one tries again."""
    out = out or sys.stdout
    err = err or sys.stderr
    clock = clock or SystemClock()
    every_s = getattr(args, "every", None)
    if every_s is None:
        return _run_once(args, env, clock, out, err)
    if not every_s > 0:
        print(f"gpumeter ledger retention: --every must be > 0 seconds (got {every_s})", file=err)
        return 2
    try:
        retention_settings(args, env)
    except GpumeterError as exc:
        print(f"gpumeter ledger retention: {exc}", file=err)
        return 2
    if stop is None:
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
    while not stop.is_set():
        try:
            _run_once(args, env, clock, out, err)
        except Exception as exc:  # a run's unexpected failure must not end the loop that retries it
            print(f"gpumeter ledger retention: {type(exc).__name__}: {exc}", file=err)
        out.flush()
        stop.wait(every_s)
    return 0


def _run_once(args: argparse.Namespace, env: Mapping[str, str], clock: Clock, out, err) -> int:
    try:
        settings = retention_settings(args, env)
        now_ms = parse_instant_ms(args.now) if getattr(args, "now", None) else clock.now_ms()
        with Ledger(settings.ledger_url) as ledger:
            ledger.require_schema()
            result = retain(ledger, settings, now_ms=now_ms)
    except GpumeterError as exc:
        print(f"gpumeter ledger retention: {exc}", file=err)
        return 2
    from services.billing.costing import iso_utc

    for grain, days in settings.days().items():
        name = {MINUTE: "minute cost lines", HOUR: "hourly rollups", DAY: "daily rollups"}[grain]
        print(f"{name}: kept from {iso_utc(result.kept_from_ms[grain])} ({days} days), "
              f"{result.deleted[grain]} rows deleted", file=out)
    print(f"node bills: kept from {iso_utc(result.kept_from_ms[MINUTE])} (with the minute lines), "
          f"{result.bills_deleted} rows deleted", file=out)
    if result.dropped_partitions:
        print(f"partitions dropped: {', '.join(result.dropped_partitions)}", file=out)
    return 0
