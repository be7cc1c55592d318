"""Hourly and daily rollups of the ledger's cost lines, and the plan that says which grain answers a query.

**What a rollup row is.** One row per (period, cluster, node, GPU model, sharing policy, namespace, team label
value, subject kind, bucket shared, sharing method, carried label keys) and grain (``hour``: periods of 3,600,000
ms; ``day``: 86,400,000 ms, UTC), summing the cost lines of the node-windows that *start* in the period:

* ``cost_micro_usd``: their list-price micro-dollars (``cost_lines.cost_micro_usd``), exact integers;
* ``billed_micro_usd``: their trued-up cost where ``gpumeter reconcile`` stored one, else the list cost
  (``COALESCE(trued, list)``, the ledger's ``BILLED_COST``, what ``--cost trued`` reports);
* ``cost_lines``: how many lines; ``trued_lines``: how many of them carry a trued-up cost.

The namespace is '' where the line has none (a bucket), the team '' with ``has_team`` false where the pod has no
``team_key`` label (a label value may itself be ''); ``team_key`` is the label key the value was read under
(billing's ``team_label``), so a report by ``label:<key>`` uses the rollups only where every row was keyed by that
key. ``gpu_model`` is the node-window's (``NodeBill.gpu_model``; '' for bills written before it was recorded).

**Maintained as bills land** (``add_written``): ``Ledger.write`` calls it inside its transaction with the cost
lines of exactly the node-windows its insert created, so a redelivered node-window (skipped by the insert) never
adds twice and a failed write adds nothing. The rows are summed here first (one row per key and grain per write)
and upserted in key order (``INSERT ... ON CONFLICT DO UPDATE SET x = x + excluded.x`` on SQLite and PostgreSQL:
two writers of one PostgreSQL rollup row serialise on it, in the same order, so they never deadlock).
``apply_trueup`` calls ``add_trued`` in its transaction with every line whose trued-up cost it changed: the
difference of ``COALESCE(trued, list)`` and of the trued-line count goes to the line's rollup rows. So at every
commit, per grain and period, the rollups equal the minute lines, which equal the node bills, to the micro-dollar.

**Which grain answers** (``plan``, pure): a query over the windows starting in [start, end) reads whole days from
the daily rollups, whole hours from the hourly ones, and the minutes at its edges from the cost lines, when it
groups by what the rollups keep (namespace, node, the team label, or nothing); by anything else (pod, GPU, another
label) it reads cost lines only. A grain's rows before its retention horizon (``ledger_retention``, set by
``services.billing.retention``) are gone: the plan then moves the query's start (or end) to what is kept and says
so, rather than report a part of the range as if it cost nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Sequence

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    case,
    func,
    select,
)
from sqlalchemy.engine import Connection

from gpumeter.errors import GpumeterError
from schemas.records import CostRecord, CostSubjectKind
from services.billing.bulk_rows import add_sums
from services.billing.costing import NodeBill, NodeWindowKey

DEFAULT_TEAM_LABEL = "team"
HOUR_MS = 3_600_000
DAY_MS = 86_400_000
MINUTE = "minute"  # the cost lines themselves
HOUR = "hour"
DAY = "day"
GRAINS = (MINUTE, HOUR, DAY)
PERIOD_MS = {HOUR: HOUR_MS, DAY: DAY_MS}
ROLLUP_GRAINS = (HOUR, DAY)
# What a rollup can group by (``Grouping.kind``): the rest needs the cost lines.
ROLLUP_GROUPINGS = ("namespace", "node", "label")

DIMENSIONS = ("period_start_unix_ms", "cluster", "node_name", "gpu_model", "sharing", "namespace", "team_key",
              "team", "has_team", "subject_kind", "shared_from", "sharing_method", "carried_label_keys")
MEASURES = ("cost_micro_usd", "billed_micro_usd", "cost_lines", "trued_lines")
TABLE_NAMES = {HOUR: "cost_rollup_hourly", DAY: "cost_rollup_daily"}
RETENTION_TABLE = "ledger_retention"


def _rollup_table(name: str, metadata: MetaData) -> Table:
    return Table(
        name,
        metadata,
        Column("period_start_unix_ms", BigInteger, nullable=False),
        Column("cluster", String(253), nullable=False),
        Column("node_name", String(253), nullable=False),
        Column("gpu_model", String(128), nullable=False),
        Column("sharing", String(255), nullable=False),
        Column("namespace", String(253), nullable=False),
        Column("team_key", String(317), nullable=False),
        Column("team", Text, nullable=False),
        Column("has_team", Boolean, nullable=False),
        Column("subject_kind", String(16), nullable=False),
        Column("shared_from", String(16), nullable=False),
        Column("sharing_method", String(16), nullable=False),
        Column("carried_label_keys", Text, nullable=False),
        Column("cost_micro_usd", BigInteger, nullable=False),
        Column("billed_micro_usd", BigInteger, nullable=False),
        Column("cost_lines", BigInteger, nullable=False),
        Column("trued_lines", BigInteger, nullable=False),
        PrimaryKeyConstraint(*DIMENSIONS),
    )


@dataclass(frozen=True)
class RollupTables:
    """The tables of ``define_tables``: one per rollup grain, and the retention horizons."""

    by_grain: Mapping[str, Table]
    retention: Table


def define_tables(metadata: MetaData) -> RollupTables:
    """Add the rollup tables (created by migration 0009) to the ledger's ``metadata``."""
    retention = Table(
        RETENTION_TABLE,
        metadata,
        Column("grain", String(16), nullable=False),
        Column("kept_from_unix_ms", BigInteger, nullable=False),
        Column("applied_at_unix_ms", BigInteger, nullable=False),
        PrimaryKeyConstraint("grain"),
    )
    return RollupTables({grain: _rollup_table(TABLE_NAMES[grain], metadata) for grain in ROLLUP_GRAINS}, retention)


# -- pure: rows of lines -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class RollupKey:
    """A rollup row's dimensions (``DIMENSIONS`` order)."""

    period_start_unix_ms: int
    cluster: str
    node_name: str
    gpu_model: str
    sharing: str
    namespace: str
    team_key: str
    team: str
    has_team: bool
    subject_kind: str
    shared_from: str
    sharing_method: str
    carried_label_keys: str


@dataclass(frozen=True, slots=True)
class RollupSums:
    """A rollup row's measures (``MEASURES`` order)."""

    cost_micro_usd: int = 0
    billed_micro_usd: int = 0
    cost_lines: int = 0
    trued_lines: int = 0

    def __add__(self, other: "RollupSums") -> "RollupSums":
        return RollupSums(self.cost_micro_usd + other.cost_micro_usd, self.billed_micro_usd + other.billed_micro_usd,
                          self.cost_lines + other.cost_lines, self.trued_lines + other.trued_lines)


def period_start(window_start_unix_ms: int, grain: str) -> int:
    """The start of the ``grain`` period (UTC) holding a window that starts at ``window_start_unix_ms``."""
    step = PERIOD_MS[grain]
    return window_start_unix_ms - window_start_unix_ms % step


def line_key(cost: CostRecord, grain: str, *, gpu_model: str, sharing: str, team_key: str) -> RollupKey:
    """The rollup row of ``grain`` that ``cost`` (a line of a node-window with that GPU model and policy) adds to."""
    team = cost.labels.get(team_key)
    return RollupKey(
        period_start(cost.window_start_unix_ms, grain), cost.cluster, cost.node_name, gpu_model, sharing,
        cost.namespace or "", team_key, team or "", team is not None, cost.subject_kind.value,
        cost.shared_from.value if cost.shared_from is not None else "", cost.sharing_method,
        ",".join(cost.carried_label_keys))


# Each kind's text ('' for no kind: a line shared from no bucket), looked up: an enum member's ``.value`` is a
# descriptor call, once per line and column (the ledger's writer and every rollup key use this one table).
KIND_TEXT: Mapping[CostSubjectKind | None, str] = MappingProxyType(
    {None: "", **{kind: kind.value for kind in CostSubjectKind}})


def add_into(out: dict[tuple, list], key: tuple, values: Iterable) -> None:
    """Add ``values`` element-wise to ``out[key]`` (a list of sums; created from ``values`` when absent)."""
    sums = out.get(key)
    if sums is None:
        out[key] = list(values)
    else:
        for i, value in enumerate(values):
            sums[i] += value


def written_tuples(costs: Iterable[CostRecord], bills: Mapping[NodeWindowKey, NodeBill], *,
                   team_key: str) -> dict[str, list[tuple]]:
    """Per grain, the rollup rows the cost lines ``costs`` (of the node-windows ``bills``, written now: not trued
    up) add up to, as the upsert sends them: ``(*DIMENSIONS, *MEASURES)`` tuples, one per ``line_key`` row, summed
    over the lines. Pure.

    Summed per hour in plain tuples first and the days from the hours: a write's lines are ~30 times its rollup
    rows, and a ``RollupKey`` per line and grain was most of the ledger's Python time per write (and one per row,
    turned back into a tuple for the upsert, ~0.1 ms a node-window in 2026-12-05's profile: ``add_written`` makes
    none)."""
    facts: dict[tuple[str, str, int], tuple[int, str, str, str, str]] = {}
    hourly: dict[tuple, list[int]] = {}
    for cost in costs:
        window = (cost.cluster, cost.node_name, cost.window_start_unix_ms)
        node = facts.get(window)
        if node is None:
            bill = bills[NodeWindowKey(*window)]
            start = cost.window_start_unix_ms
            node = facts[window] = (start - start % HOUR_MS, cost.cluster, cost.node_name, bill.gpu_model,
                                    bill.sharing)
        team = cost.labels.get(team_key)
        key = (*node, cost.namespace or "", team_key, team or "", team is not None, KIND_TEXT[cost.subject_kind],
               KIND_TEXT[cost.shared_from], cost.sharing_method, ",".join(cost.carried_label_keys))
        sums = hourly.get(key)
        if sums is None:
            hourly[key] = [cost.cost_micro_usd, 1]
        else:
            sums[0] += cost.cost_micro_usd
            sums[1] += 1
    daily: dict[tuple, list[int]] = {}
    for key, (micro_usd, lines) in hourly.items():
        day_key = (key[0] - key[0] % DAY_MS, *key[1:])
        sums = daily.get(day_key)
        if sums is None:
            daily[day_key] = [micro_usd, lines]
        else:
            sums[0] += micro_usd
            sums[1] += lines
    # MEASURES: list cost, billed cost (the list cost: not trued up), lines, trued lines.
    return {grain: [(*key, micro_usd, micro_usd, lines, 0) for key, (micro_usd, lines) in rows.items()]
            for grain, rows in ((HOUR, hourly), (DAY, daily))}


class MixedTeamLabels(GpumeterError):
    """A node's hour was rolled up under two team labels: a line's rollup rows cannot be told (``add_trued``)."""


@dataclass(frozen=True, slots=True)
class TruedChange:
    """One stored line whose trued-up cost ``apply_trueup`` changes from ``before`` to ``after`` (None: none)."""

    cost: CostRecord
    gpu_model: str
    sharing: str
    before: int | None
    after: int | None


def trued_rows(changes: Iterable[TruedChange], *, team_key: str | Callable[[CostRecord], str]
               ) -> dict[str, dict[RollupKey, RollupSums]]:
    """Per grain, what the changes add to the rollup rows: the difference of ``COALESCE(trued, list)`` and of the
    count of trued lines (the list cost and the line count do not change). ``team_key``: the label key the lines
    were rolled up under, or a function of the line giving it. Pure."""
    out: dict[str, dict[RollupKey, RollupSums]] = {grain: defaultdict(RollupSums) for grain in ROLLUP_GRAINS}
    key_of = team_key if callable(team_key) else (lambda _cost: team_key)
    for change in changes:
        listed = change.cost.cost_micro_usd
        billed = (listed if change.after is None else change.after) - (
            listed if change.before is None else change.before)
        trued = (change.after is not None) - (change.before is not None)
        if not billed and not trued:
            continue
        written_key = key_of(change.cost)
        for grain in ROLLUP_GRAINS:
            key = line_key(change.cost, grain, gpu_model=change.gpu_model, sharing=change.sharing,
                           team_key=written_key)
            out[grain][key] += RollupSums(0, billed, 0, trued)
    return {grain: {k: v for k, v in rows.items() if v != RollupSums()} for grain, rows in out.items()}


# -- SQL: maintaining --------------------------------------------------------------------------------------------


def upsert(connection: Connection, tables: RollupTables, rows: Mapping[str, Mapping[RollupKey, RollupSums]]) -> int:
    """Add ``rows`` to the rollup tables in ``connection``'s transaction, in key order, one statement per grain
    (``services.billing.bulk_rows.add_sums``); returns the rows upserted."""
    return _upsert_tuples(connection, tables, {
        grain: [(*key_values(key), *sums_values(sums)) for key, sums in grain_rows.items()]
        for grain, grain_rows in rows.items()})


def _upsert_tuples(connection: Connection, tables: RollupTables, rows: Mapping[str, Sequence[tuple]]) -> int:
    """``upsert`` of rows already ``(*DIMENSIONS, *MEASURES)`` tuples, per grain."""
    return sum(add_sums(connection, tables.by_grain[grain], DIMENSIONS, MEASURES, grain_rows)
               for grain, grain_rows in rows.items() if grain_rows)


def key_values(key: RollupKey) -> tuple:
    """``key``'s values in ``DIMENSIONS`` order."""
    return (key.period_start_unix_ms, key.cluster, key.node_name, key.gpu_model, key.sharing, key.namespace,
            key.team_key, key.team, key.has_team, key.subject_kind, key.shared_from, key.sharing_method,
            key.carried_label_keys)


def sums_values(sums: RollupSums) -> tuple:
    """``sums``' values in ``MEASURES`` order."""
    return (sums.cost_micro_usd, sums.billed_micro_usd, sums.cost_lines, sums.trued_lines)


def add_written(connection: Connection, tables: RollupTables, costs: Iterable[CostRecord],
                bills: Mapping[NodeWindowKey, NodeBill], *, team_key: str) -> int:
    """``Ledger.write``'s hook: roll up the lines of the node-windows it inserted (see the module docstring)."""
    return _upsert_tuples(connection, tables, written_tuples(costs, bills, team_key=team_key))


def add_trued(connection: Connection, tables: RollupTables, changes: Iterable[TruedChange], *,
              team_key: str) -> int:
    """``Ledger.apply_trueup``'s hook: move the rollups' trued-up sums by the lines' changes.

    Each line's rows are found under the team label its node-window was rolled up with when written (billing's
    ``team_label`` then), read from the hourly rows of the line's hour and node -- not under the label of the
    process applying the true-up (``team_key``, used only where the hour holds no row: a ledger rolled up before
    revision 0009 backfilled it). ``MixedTeamLabels`` (nothing written) when a node's hour was rolled up under two
    labels (billing's ``team_label`` changed within that hour): which rows a line is in cannot be told."""
    changes = list(changes)
    if not changes:
        return 0
    hourly = tables.by_grain[HOUR]
    hours = {(c.cost.window_start_unix_ms - c.cost.window_start_unix_ms % HOUR_MS, c.cost.cluster,
              c.cost.node_name) for c in changes}
    written: dict[tuple[int, str, str], set[str]] = defaultdict(set)
    first, last = min(h[0] for h in hours), max(h[0] for h in hours)
    for period, cluster, node, key in connection.execute(
            select(hourly.c.period_start_unix_ms, hourly.c.cluster, hourly.c.node_name, hourly.c.team_key)
            .where(hourly.c.period_start_unix_ms >= first, hourly.c.period_start_unix_ms <= last)
            .distinct()):
        if (period, cluster, node) in hours:
            written[(period, cluster, node)].add(key)
    mixed = sorted(hour for hour, keys in written.items() if len(keys) > 1)
    if mixed:
        period, cluster, node = mixed[0]
        raise MixedTeamLabels(f"the hour starting {period} of {cluster}/{node} was rolled up under the team labels "
                          f"{sorted(written[mixed[0]])} (billing's team label changed within it): the true-up "
                          f"cannot tell which rollup rows its lines are in ({len(mixed)} such node-hours)")

    def key_of(cost: CostRecord) -> str:
        keys = written.get((cost.window_start_unix_ms - cost.window_start_unix_ms % HOUR_MS, cost.cluster,
                            cost.node_name))
        return next(iter(keys)) if keys else team_key

    return upsert(connection, tables, trued_rows(changes, team_key=key_of))


# -- pure: which grain answers a query ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Segment:
    """Windows starting in [start_ms, end_ms), read from ``grain`` (``minute``: the cost lines)."""

    grain: str
    start_ms: int
    end_ms: int


@dataclass(frozen=True, slots=True)
class Plan:
    """How a query over [asked_start_ms, asked_end_ms) is answered: the range it covers ([start_ms, end_ms): the
    asked one unless retention dropped a part of it) and the segments that cover it, oldest first."""

    asked_start_ms: int
    asked_end_ms: int
    start_ms: int
    end_ms: int
    segments: tuple[Segment, ...]

    @property
    def adjusted(self) -> bool:
        return (self.start_ms, self.end_ms) != (self.asked_start_ms, self.asked_end_ms)

    def grains(self) -> tuple[str, ...]:
        """The grains read, coarsest first."""
        used = {s.grain for s in self.segments}
        return tuple(g for g in reversed(GRAINS) if g in used)

    def describe(self) -> str:
        """``day 29 periods, hour 23, minute 59``: what each grain answered."""
        if not self.segments:
            return "nothing (empty range)"
        parts = []
        for grain in self.grains():
            step = PERIOD_MS.get(grain, 60_000)
            periods = sum((s.end_ms - s.start_ms) // step for s in self.segments if s.grain == grain)
            name = {DAY: "daily rollups", HOUR: "hourly rollups", MINUTE: "minute cost lines"}[grain]
            unit = {DAY: "day", HOUR: "hour", MINUTE: "minute"}[grain]
            parts.append(f"{name} ({periods} {unit}{'s' if periods != 1 else ''})")
        return ", ".join(parts)


def _ceil(t: int, step: int) -> int:
    return -(-t // step) * step


def _floor(t: int, step: int) -> int:
    return t // step * step


def split(start_ms: int, end_ms: int, *, rollups: bool = True) -> tuple[Segment, ...]:
    """[start_ms, end_ms) as the coarsest segments: whole UTC days, then whole hours, then minutes at the edges
    (minutes only when ``rollups`` is False). Pure."""
    if start_ms >= end_ms:
        return ()
    if not rollups:
        return (Segment(MINUTE, start_ms, end_ms),)
    hour_a, hour_b = _ceil(start_ms, HOUR_MS), _floor(end_ms, HOUR_MS)
    if hour_a >= hour_b:
        return (Segment(MINUTE, start_ms, end_ms),)
    day_a, day_b = _ceil(start_ms, DAY_MS), _floor(end_ms, DAY_MS)
    out = []
    if start_ms < hour_a:
        out.append(Segment(MINUTE, start_ms, hour_a))
    if day_a < day_b:
        if hour_a < day_a:
            out.append(Segment(HOUR, hour_a, day_a))
        out.append(Segment(DAY, day_a, day_b))
        if day_b < hour_b:
            out.append(Segment(HOUR, day_b, hour_b))
    else:
        out.append(Segment(HOUR, hour_a, hour_b))
    if hour_b < end_ms:
        out.append(Segment(MINUTE, hour_b, end_ms))
    return tuple(out)


def plan(start_ms: int, end_ms: int, *, rollups: bool = True, kept_from: Mapping[str, int] | None = None) -> Plan:
    """The segments answering [start_ms, end_ms) (``split``), the range moved inwards past what retention dropped:
    ``kept_from`` maps a grain to the oldest period start it still holds (grains not in it hold everything). Pure.
    """
    kept = dict(kept_from or {})
    start, end = start_ms, end_ms
    while True:
        segments = split(start, end, rollups=rollups)
        if not segments:
            break
        first, last = segments[0], segments[-1]
        if first.start_ms < kept.get(first.grain, first.start_ms):
            start = min(first.end_ms, kept[first.grain])
            continue
        if last.start_ms < kept.get(last.grain, last.start_ms):
            end = last.start_ms
            continue
        break
    if start >= end:
        start, segments = end, ()
    return Plan(start_ms, end_ms, start, end, segments)


# -- SQL: reading --------------------------------------------------------------------------------------------


def kept_from(read: Callable[[Any], list], tables: RollupTables) -> dict[str, int]:
    """The retention horizons recorded so far: grain -> oldest period start still kept."""
    table = tables.retention
    return {grain: int(kept) for grain, kept in read(select(table.c.grain, table.c.kept_from_unix_ms))}


def _range(table: Table, segment: Segment, cluster: str | None) -> list:
    conditions = [table.c.period_start_unix_ms >= segment.start_ms, table.c.period_start_unix_ms < segment.end_ms]
    if cluster is not None:
        conditions.append(table.c.cluster == cluster)
    return conditions


def _micro(table: Table, cost: str):
    return table.c.cost_micro_usd if cost == "list" else table.c.billed_micro_usd


def group_expression(table: Table, kind: str):
    """The rollup's value for a grouping kind (``ROLLUP_GROUPINGS``; None for the kind-only totals)."""
    if kind == "namespace":
        return func.nullif(table.c.namespace, "")
    if kind == "node":
        return table.c.node_name
    if kind == "label":
        return case((table.c.has_team, table.c.team), else_=None)
    raise ValueError(f"rollups cannot group by {kind!r}")


def other_team_keys(read: Callable[[Any], list], tables: RollupTables, segment: Segment, cluster: str | None,
                    team_key: str) -> int:
    """Rows of ``segment`` keyed by another team label than ``team_key`` (then they cannot answer by it)."""
    table = tables.by_grain[segment.grain]
    (count,), = read(select(func.count()).where(table.c.team_key != team_key, *_range(table, segment, cluster)))
    return int(count)


def cost_by(read: Callable[[Any], list], tables: RollupTables, segment: Segment, kind: str, *,
            cluster: str | None, cost: str) -> list[tuple[str, str | None, int, int, int]]:
    """(subject kind, group, micro-USD, lines, shared micro-USD) of a rollup ``segment``, as ``Ledger.cost_by``."""
    table = tables.by_grain[segment.grain]
    micro = _micro(table, cost)
    shared = case((table.c.shared_from != "", micro), else_=0)
    inner = (select(table.c.subject_kind.label("kind"), group_expression(table, kind).label("grp"),
                    micro.label("micro"), table.c.cost_lines.label("lines"), shared.label("shared"))
             .where(*_range(table, segment, cluster)).subquery())
    rows = read(select(inner.c.kind, inner.c.grp, func.sum(inner.c.micro), func.sum(inner.c.lines),
                       func.sum(inner.c.shared)).group_by(inner.c.kind, inner.c.grp))
    return [(k, g, int(m), int(n), int(s or 0)) for k, g, m, n, s in rows]


def cost_by_carried_label_keys(read: Callable[[Any], list], tables: RollupTables, segment: Segment, *,
                               cluster: str | None) -> list[tuple[str, str | None, int, int]]:
    """(subject kind, carried label keys or None, list micro-USD, lines), as ``Ledger.cost_by_carried_label_keys``."""
    table = tables.by_grain[segment.grain]
    keys = func.nullif(table.c.carried_label_keys, "")
    inner = (select(table.c.subject_kind.label("kind"), keys.label("grp"), table.c.cost_micro_usd,
                    table.c.cost_lines).where(*_range(table, segment, cluster)).subquery())
    rows = read(select(inner.c.kind, inner.c.grp, func.sum(inner.c.cost_micro_usd), func.sum(inner.c.cost_lines))
                .group_by(inner.c.kind, inner.c.grp))
    return [(k, g, int(m), int(n)) for k, g, m, n in rows]


def shared_by_source(read: Callable[[Any], list], tables: RollupTables, segment: Segment, *, cluster: str | None,
                     cost: str) -> list[tuple[str, str, int, int]]:
    """(bucket shared, method, micro-USD, lines) of the shared lines, as ``Ledger.shared_by_source``."""
    table = tables.by_grain[segment.grain]
    rows = read(select(table.c.shared_from, table.c.sharing_method, func.sum(_micro(table, cost)),
                       func.sum(table.c.cost_lines))
                .where(table.c.shared_from != "", *_range(table, segment, cluster))
                .group_by(table.c.shared_from, table.c.sharing_method))
    return [(s, m, int(micro), int(n)) for s, m, micro, n in rows]


def rows_of(read: Callable[[Any], list], table: Table, *, start_ms: int | None = None,
            end_ms: int | None = None) -> dict[RollupKey, RollupSums]:
    """A rollup table's rows (tests and checks)."""
    conditions = []
    if start_ms is not None:
        conditions.append(table.c.period_start_unix_ms >= start_ms)
    if end_ms is not None:
        conditions.append(table.c.period_start_unix_ms < end_ms)
    out = {}
    for row in read(select(table).where(*conditions)):
        m = row._mapping
        out[RollupKey(*(m[name] if name != "has_team" else bool(m[name]) for name in DIMENSIONS))] = RollupSums(
            *(int(m[name]) for name in MEASURES))
    return out


def roll(rows: Mapping[RollupKey, RollupSums], grain: str) -> dict[RollupKey, RollupSums]:
    """``rows`` summed into the periods of ``grain`` (the hourly rows of a day into its daily rows). Pure."""
    out: dict[RollupKey, RollupSums] = defaultdict(RollupSums)
    for key, sums in rows.items():
        out[_with_period(key, period_start(key.period_start_unix_ms, grain))] += sums
    return dict(out)


def _with_period(key: RollupKey, start: int) -> RollupKey:
    values = [getattr(key, name) for name in DIMENSIONS]
    values[0] = start
    return RollupKey(*values)


def merge(parts: Sequence[Iterable[tuple]], width: int) -> list[tuple]:
    """Rows (key columns..., summed columns...) of several segments added up by key: the last ``width`` columns
    are sums. Pure."""
    out: dict[tuple, list[int]] = {}
    for rows in parts:
        for row in rows:
            key, values = tuple(row[:-width]), row[-width:]
            total = out.setdefault(key, [0] * width)
            for i, value in enumerate(values):
                total[i] += value
    return [(*key, *values) for key, values in out.items()]
