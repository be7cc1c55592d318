"""``gpumeter ledger retention``: drop the ledger's minute cost lines and rollups past their retention.

What is kept how long (``RetentionSettings``; docs/billing.md, "Rollups and retention"):

* **minute cost lines** (``cost_lines``): ``minute_lines_days`` (default 14). They are what a report by pod, GPU or
  any label but the team needs, what the FOCUS export and ``/allocation`` read, and what a true-up apportions over
  (``gpumeter reconcile`` of a bill whose windows' lines are gone refuses: run it within this retention, or raise it).
* **hourly rollups**: ``hourly_rollups_days`` (default 92, a quarter); **daily rollups**: ``daily_rollups_days``
  (default 400: a year and a month, for year-on-year); each at least the finer grain's.
* **node bills**, price versions and true-ups: kept. A bill is one row per node-window, what true-up and
  ``reconcile`` read and what every report reconciles its lines against; it is the proof of the rollups' sums.
  The zero lines a bill lists (``node_bills.zero_lines``, ``services.billing.line_storage``) stay with it: they
  carry no money, and the rollups already count them. **Label sets** (``label_sets``) are never deleted: a set is
  shared by lines of any age (content-addressed), so a line's set outlives the line.

``retain(ledger, settings, now_ms=)``: the clock is passed in. Per grain the horizon is ``now`` less the
retention, rounded down to a UTC day boundary (so a grain keeps whole days, and an hour or day is either all there
or all gone). The horizon is recorded in ``ledger_retention`` *first*, in its own transaction -- so a report
already avoids the range that is being deleted -- then rows older than it are deleted by ranges of window start
(``delete_batch_hours`` of windows per transaction: a ranged ``DELETE`` on the primary key's leading column, short
transactions that never hold the SQLite write lock for long). A horizon never moves back: lengthening a retention
keeps what is left and cannot bring back what was dropped. Running it again deletes nothing more.

On PostgreSQL this is the same ranged, batched ``DELETE`` (no declarative partitions yet: see docs/billing.md).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Mapping

from sqlalchemy import delete, func, select
from sqlalchemy.exc import SQLAlchemyError

from gpumeter import config
from gpumeter.clock import Clock, SystemClock
from gpumeter.config import at_least, between, integer, load, non_empty, setting, settings_repr, validate
from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.redact import mask_url
from services.billing.ledger import (
    DEFAULT_LEDGER_URL,
    LEDGER_URL_ENV,
    READ_ROLLUPS,
    ROLLUPS,
    Ledger,
    LedgerError,
    cost_lines,
)
from services.billing.rollups import DAY, DAY_MS, HOUR, HOUR_MS, MINUTE

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
    """Per grain: the horizon now in force and the rows this run deleted."""

    kept_from_ms: Mapping[str, int]
    deleted: Mapping[str, int]


def _tables():
    """Per grain, the tables (and their time column) its horizon applies to: the line, bill and pod rollups of a
    grain go together."""
    return {MINUTE: [(cost_lines, cost_lines.c.window_start_unix_ms)],
            **{grain: [(table, table.c.period_start_unix_ms)
                       for table in (ROLLUPS.by_grain[grain], READ_ROLLUPS.bills[grain], READ_ROLLUPS.pods[grain])]
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
    step = settings.delete_batch_hours * HOUR_MS
    deleted = {}
    for grain, tables in _tables().items():
        count = 0
        for data, column in tables:
            with ledger.transaction() as connection:
                oldest = connection.execute(select(func.min(column)).where(column < kept[grain])).scalar()
            if oldest is not None:
                start = int(oldest) - int(oldest) % HOUR_MS
                while start < kept[grain]:
                    end = min(start + step, kept[grain])
                    with ledger.transaction() as connection:
                        count += connection.execute(delete(data).where(column >= start, column < end)).rowcount
                    start = end
        deleted[grain] = count
    return RetentionResult(kept, deleted)


# -- command line (``gpumeter ledger retention``) -----------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``gpumeter ledger retention [--now ISO] [settings]``."""
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    retention = actions.add_parser("retention", help="drop minute cost lines and rollups past their retention",
                                   description=__doc__.splitlines()[0])
    config.add_arguments(retention, RetentionSettings)
    retention.add_argument("--now", default=None, help="the clock's time, ISO 8601 (default: now)")


def main(args: argparse.Namespace, env: Mapping[str, str], *, clock: Clock | None = None, out=None,
         err=None) -> int:
    """Apply the retention; 0 done, 2 on a usage or ledger error."""
    from services.billing.report import parse_instant_ms

    out = out or sys.stdout
    err = err or sys.stderr
    clock = clock or SystemClock()
    try:
        settings = load(RetentionSettings, args, env)
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
    print("node bills: kept (true-up and every report reconcile against them)", file=out)
    return 0
