"""Ledger at fleet scale (issue 24): a 1,000-GPU cluster's node-windows through the ledger's real write path into
PostgreSQL -- sustained ingest, bytes on disk per 1,000 GPU-days at each grain, and month-long reads.

**The fleet.** ``FLEET_NODES`` nodes like a ``p5.48xlarge`` (8 × H100 80GB), each the benchmark simulator's node
(``bench.simulator.fleet_scenario_yaml``: 2 exclusive GPUs, 2 time-sliced into 4 replicas, 2 MPS with 4, 2 MIG
with 3g/2g/1g/1g instances; 25 pods, one replaced mid-run), attributed by the real engine from the simulator's
ticks (``template_record``), then renamed per node (its GPUs, pods, namespaces and team labels differ from node to
node) and per *pod epoch*: every node's pods are replaced by new ones (new uids) every ``2 + node % 7`` hours, so
a month holds the pod churn of a real cluster. Each (node, epoch) is priced once by billing's real costing
(``bill_node_window``, bundled catalog) and its lines are then moved to each minute's window: the shares of one
pod epoch are the same every minute (which changes no row count and no byte count of the ledger).

**Ingest**: ``ingest_hours`` of the whole fleet (one node-window per node per minute) written with
``Ledger.write`` in batches of ``BATCH_NODE_WINDOWS`` node-windows (billing writes one batch per fetch), in time
order; node-windows per second of the writes' wall time (the costing and cloning around them not counted). The
server is ``gpumeter.devtools.postgres.PostgresServer`` (loopback, ``fsync=off``: the CPU of client and server,
not a disk's commit latency).

**Storage**: ``pg_total_relation_size`` (table, indexes, TOAST) of every ledger table after the ingest and a
``VACUUM FULL`` (the rollups' upserts leave dead row versions that later periods reuse), per grain
(``GRAIN_OF_TABLE``), scaled to 1,000 GPU-days: the minute and hourly grains grow with time (× 24 / hours
written), the daily grain with days (its rows for the hours written are the day's rows: the same keys). Then what
the default retention of a 1,000-GPU cluster holds (minute lines ``MINUTE_RETENTION_DAYS``, hourly rollups
``HOUR_RETENTION_DAYS``, daily rollups ``DAY_RETENTION_DAYS``; node bills with the minute lines, as retention
drops them). On PostgreSQL the ledger's tables are partitioned by day (revision 0010): a table's bytes are its
partitions'.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from schemas.records import NodeWindowShares

from services.billing import partitions
from services.billing.retention import (
    DEFAULT_DAILY_ROLLUPS_DAYS,
    DEFAULT_HOURLY_ROLLUPS_DAYS,
    DEFAULT_MINUTE_LINES_DAYS,
)

from bench.common import Target

WINDOW_SECONDS = 60
WINDOW_MS = WINDOW_SECONDS * 1000
HOUR_MS = 3_600_000
FLEET_NODES = 125  # × 8 GPUs = 1,000 GPUs
GPUS_PER_NODE = 8
BATCH_NODE_WINDOWS = 50
NAMESPACES = ("training", "research", "serving", "batch", "inference", "eval", "platform", "data")
TEAMS = ("assistants", "search", "ranking", "media", "foundation", "research", "ads", "vision", "speech",
         "safety", "infra", "growth")
TARGET_INGEST_NODE_WINDOWS_PER_S = 250.0  # issue 24: 10x what 10,000 GPUs at 1-minute windows produce
TARGET_RETAINED_GB_FOR_1000_GPUS = 20.0
# The ledger's default retention (``services.billing.retention``).
MINUTE_RETENTION_DAYS = DEFAULT_MINUTE_LINES_DAYS
HOUR_RETENTION_DAYS = DEFAULT_HOURLY_ROLLUPS_DAYS
DAY_RETENTION_DAYS = DEFAULT_DAILY_ROLLUPS_DAYS


def template_record() -> NodeWindowShares:
    """One whole node-window of the benchmark simulator's node, attributed by the real engine from its ticks."""
    from bench.simulator import load_fleet
    from pipeline.recordings import scenario_records
    from schemas.records import NodeSample
    from services.attributor.engine import AttributionEngine, EngineConfig

    scenario = load_fleet(1, duration_seconds=3 * WINDOW_SECONDS)
    engine = AttributionEngine(EngineConfig(window_seconds=WINDOW_SECONDS, grace_seconds=10))
    records: list[NodeWindowShares] = []
    for position, item in enumerate(scenario_records(scenario)):
        if isinstance(item.message, NodeSample):
            output = engine.on_sample(item.message, item.received_at_unix_ms, position)
            records.extend(w.record for w in output.windows if w.record is not None)
            engine.record_emitted(output.windows)
        else:
            engine.on_pod_event(item.message)
        engine.take_table_changes()
    whole = [r for r in records if r.node_covered_seconds >= WINDOW_SECONDS]
    if not whole:
        raise AssertionError("the simulator's node gave no whole node-window")
    return whole[0]


def node_name(node: int) -> str:
    return f"gpu-p5-{node:04d}"


def epoch_of(node: int, minute: int) -> int:
    """The node's pod epoch at ``minute`` of the run: its pods are replaced every ``2 + node % 7`` hours, nodes
    out of step with each other."""
    return (minute // 60 + node) // (2 + node % 7)


def node_record(template: NodeWindowShares, node: int, epoch: int) -> NodeWindowShares:
    """``template`` as node ``node`` in pod epoch ``epoch``: its own GPUs, its own pods (new uids each epoch),
    namespaces and team labels spread over the fleet."""
    name = node_name(node)
    suffix = f"-{node:04d}"
    pods = []
    for i, pod in enumerate(template.pods):
        labels = dict(pod.labels)
        labels["team"] = TEAMS[(node + i) % len(TEAMS)]
        pods.append(dataclasses.replace(
            pod, pod_uid=f"{pod.pod_uid}{suffix}-e{epoch}", pod_name=f"{pod.pod_name or 'pod'}{suffix}-e{epoch}",
            namespace=NAMESPACES[(node + i // 4) % len(NAMESPACES)], labels=labels,
            workload_name=f"{pod.workload_name or 'w'}{suffix}"))
    units = tuple(dataclasses.replace(
        u, gpu_uuid=u.gpu_uuid + suffix,
        parent_gpu_uuid=None if u.parent_gpu_uuid is None else u.parent_gpu_uuid + suffix) for u in template.units)
    return dataclasses.replace(template, node_name=name, provider_id=f"aws:///us-east-1a/i-{node:017x}",
                               pods=tuple(pods), units=units)


class MonthFleet:
    """The fleet's node-windows in time order, priced: ``windows(first_minute, minutes)``."""

    def __init__(self, nodes: int = FLEET_NODES, start_unix_ms: int | None = None) -> None:
        from services.billing.catalog import bundled_catalog

        self.nodes = nodes
        self.template = template_record()
        self.start_unix_ms = (self.template.window_start_unix_ms // (24 * HOUR_MS)) * 24 * HOUR_MS \
            if start_unix_ms is None else start_unix_ms
        self._catalog = bundled_catalog()
        self._priced: dict[int, tuple[int, Any]] = {}  # node -> (epoch, its NodeWindowCost at the template's start)

    @property
    def gpus(self) -> int:
        return self.nodes * GPUS_PER_NODE

    def priced(self, node: int, epoch: int) -> Any:
        from services.billing.costing import bill_node_window

        known = self._priced.get(node)
        if known is None or known[0] != epoch:
            record = node_record(self.template, node, epoch)
            known = self._priced[node] = (epoch, bill_node_window(record.rows(), self._catalog))
        return known[1]

    def window(self, node: int, minute: int) -> Any:
        """Node ``node``'s priced node-window at ``minute`` of the run (a ``NodeWindowCost``)."""
        from services.billing.costing import NodeWindowCost

        priced = self.priced(node, epoch_of(node, minute))
        start = self.start_unix_ms + minute * WINDOW_MS
        return NodeWindowCost(
            costs=tuple(dataclasses.replace(c, window_start_unix_ms=start) for c in priced.costs),
            bill=dataclasses.replace(priced.bill, window_start_unix_ms=start),
            parts=priced.parts)

    def batches(self, first_minute: int, minutes: int, size: int = BATCH_NODE_WINDOWS) -> Iterator[list[Any]]:
        """The node-windows of ``minutes`` minutes from ``first_minute``, minute by minute, in batches of
        ``size``."""
        batch: list[Any] = []
        for minute in range(first_minute, first_minute + minutes):
            for node in range(self.nodes):
                batch.append(self.window(node, minute))
                if len(batch) == size:
                    yield batch
                    batch = []
        if batch:
            yield batch


@dataclass(frozen=True)
class Ingest:
    node_windows: int
    cost_lines_offered: int
    write_wall_s: float

    @property
    def node_windows_per_s(self) -> float:
        return self.node_windows / self.write_wall_s if self.write_wall_s > 0 else 0.0


def ingest(ledger: Any, fleet: MonthFleet, first_minute: int, minutes: int) -> Ingest:
    """Write ``minutes`` minutes of the fleet with ``Ledger.write``, one call per batch; only the writes timed.
    Raises unless every node-window was inserted (the keys are all new)."""
    windows = lines = 0
    spent = 0.0
    for batch in fleet.batches(first_minute, minutes):
        costs = [c for w in batch for c in w.costs]
        bills = [w.bill for w in batch]
        started = time.perf_counter()
        result = ledger.write(costs, bills)
        spent += time.perf_counter() - started
        inserted = getattr(result, "inserted_windows", None)
        if inserted is not None and inserted != len(batch):
            raise AssertionError(f"a batch of {len(batch)} new node-windows inserted {inserted}")
        windows += len(batch)
        lines += len(costs)
    return Ingest(windows, lines, spent)


# Which grain each table of the ledger holds (tables not named here are counted as "other").
GRAIN_OF_TABLE = {
    "cost_lines": "minute",  # up to revision 0013; from 0014 a view over cost_line_rows and the dictionaries
    "cost_line_rows": "minute",
    "cost_line_packs": "minute",  # from 0016
    # The dictionaries of the lines' ids (0014): counted with the minute grain, as if they grew with time (the
    # nodes and GPUs do not; the pods do, with the churn).
    "ledger_nodes": "minute",
    "ledger_gpus": "minute",
    "ledger_pods": "minute",
    "ledger_line_kinds": "minute",
    "node_bills": "minute",  # up to revision 0017; from 0018 a view over node_bill_rows and its dictionaries
    "node_bill_rows": "minute",
    # The bills' dictionaries (0018): counted with the minute grain, as if they grew with time (a node's bill kinds
    # and zero sets are a few rows each).
    "ledger_bill_kinds": "minute",
    "ledger_bill_names": "minute",
    "ledger_zero_sets": "minute",
    "label_sets": "minute",
    "cost_rollup_hourly": "hour",
    "cost_rollup_daily": "day",
    "bill_rollup_hourly": "hour",
    "bill_rollup_daily": "day",
    "pod_rollup_hourly": "hour",
    "pod_rollup_daily": "day",
    "focus_charge_hourly": "hour",
    "focus_line_hourly": "hour",
    "focus_line_hourly_rows": "hour",
    "price_versions": "other",
}


def table_bytes(connection: Any) -> dict[str, int]:
    """Every table of the ledger's schema with its bytes on disk (table, indexes, TOAST); a partitioned table's
    are its partitions' (revision 0010: the parent itself stores nothing)."""
    from sqlalchemy import text

    rows = connection.execute(text(
        "SELECT c.relname, CASE WHEN c.relkind = 'p' THEN (SELECT coalesce(sum(pg_total_relation_size(t.relid)), 0) "
        "FROM pg_partition_tree(c.oid) t WHERE t.isleaf) ELSE pg_total_relation_size(c.oid) END FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.relkind IN ('r', 'p') AND n.nspname = current_schema() AND NOT c.relispartition"))
    return {name: int(size) for name, size in rows}


def table_rows(connection: Any, names: Sequence[str]) -> dict[str, int]:
    from sqlalchemy import text

    return {name: int(connection.execute(text(f'SELECT count(*) FROM "{name}"')).scalar_one()) for name in names}


def storage_per_1000_gpu_days(sizes: dict[str, int], rows: dict[str, int], hours_written: float,
                              gpus: int) -> dict[str, Any]:
    """Bytes (and rows) per 1,000 GPU-days at each grain, from what ``hours_written`` hours of ``gpus`` GPUs left
    on disk; and the default retention's total for a 1,000-GPU cluster."""
    per_grain: dict[str, dict[str, float]] = {}
    for name, size in sizes.items():
        grain = GRAIN_OF_TABLE.get(name, "other")
        entry = per_grain.setdefault(grain, {"bytes": 0.0, "rows": 0.0, "tables": []})  # type: ignore[dict-item]
        entry["bytes"] += size
        entry["rows"] += rows.get(name, 0)
        entry["tables"].append(name)  # type: ignore[union-attr]
    scale_gpus = 1000.0 / gpus
    out: dict[str, Any] = {}
    for grain, entry in per_grain.items():
        if grain == "other":  # constants and bookkeeping (price versions, the schema's revision): no growth
            out[grain] = {"tables": sorted(entry["tables"]), "bytes": round(entry["bytes"])}  # type: ignore[arg-type]
            continue
        # Minute lines and hourly rollups grow with the hours written; a day's daily rollup rows are the ones the
        # first hours made (the same keys).
        time_scale = 24.0 / hours_written if grain in ("minute", "hour") else 1.0
        out[grain] = {
            "tables": sorted(entry["tables"]),  # type: ignore[arg-type]
            "bytes_per_1000_gpu_days": round(entry["bytes"] * time_scale * scale_gpus),
            "rows_per_1000_gpu_days": round(entry["rows"] * time_scale * scale_gpus),
        }
    retained = 0.0
    for grain, days in (("minute", MINUTE_RETENTION_DAYS), ("hour", HOUR_RETENTION_DAYS),
                        ("day", DAY_RETENTION_DAYS)):
        if grain in out:
            retained += out[grain]["bytes_per_1000_gpu_days"] * days
    out["default_retention_bytes_for_1000_gpus"] = round(retained)
    out["default_retention_days"] = {"minute": MINUTE_RETENTION_DAYS, "hour": HOUR_RETENTION_DAYS,
                                     "day": DAY_RETENTION_DAYS}
    return out


# ---------------------------------------------------------------------------------------------------------------
# A month to read


# (hourly table, daily table, their summed columns): the line, bill and pod rollups.
ROLLUP_TABLES = (
    ("cost_rollup_hourly", "cost_rollup_daily", ("cost_micro_usd", "billed_micro_usd", "cost_lines", "trued_lines")),
    ("bill_rollup_hourly", "bill_rollup_daily", ("node_windows", "billed_milliseconds", "node_cost_micro_usd",
                                                 "gpu_cost_micro_usd", "node_other_micro_usd", "billed_micro_usd",
                                                 "trued_windows", "zero_lines")),
    ("pod_rollup_hourly", "pod_rollup_daily", ("cost_micro_usd", "cost_lines", "gpu_ms", "memory_ms", "compute_ms",
                                               "unit_ms")),
    # The hourly FOCUS grain (``services.billing.focus_rollups``): hourly only.
    ("focus_charge_hourly", None, ()),
    ("focus_line_hourly", None, ()),  # a view over the next from 0017 on PostgreSQL (not a table: not copied)
    ("focus_line_hourly_rows", None, ()),
)


def fill_month(connection: Any, *, first_window_ms: int, hours_written: int, days: int) -> dict[str, int]:
    """Copy what the written hours left at each grain over ``days`` days, by SQL, as a month of the same fleet
    would have left it: node bills at every minute of the month (the written hours' bills, moved), hourly rollups
    at every hour, daily rollups at every day (the written hours' sums × 24 / hours: the day's). Minute lines are
    not copied (a month of them is 100 million rows; they are kept ``MINUTE_RETENTION_DAYS`` and read only where a
    query's grain is minutes). Requires the written hours to start at a day's start. Rows per table after."""
    from sqlalchemy import inspect, text

    if first_window_ms % (24 * HOUR_MS) or 24 % hours_written:
        raise ValueError("the written hours must start at midnight UTC and divide a day")
    inspector = inspect(connection)
    tables = set(inspector.get_table_names())
    copies = 24 // hours_written * days  # of the written hours, the original included
    if partitions.partitioned(connection):
        # The month's partitions (billing would have made each day's ahead of it).
        partitions.ensure_in(connection, partitions.wanted(first_window_ms, first_window_ms + days * 24 * HOUR_MS))

    def columns(table: str) -> list[str]:
        return [c["name"] for c in inspector.get_columns(table)]

    def copy(table: str, time_column: str, step_ms: int, count: int, scale: int = 1,
             measures: tuple[str, ...] = ()) -> None:
        names = columns(table)
        def value(n: str) -> str:
            if n == time_column:
                return f'"{n}" + CAST(k AS BIGINT) * {step_ms}'  # k * step overflows a 32-bit integer
            return f'"{n}" * {scale}' if n in measures else f'"{n}"'

        selected = ", ".join(value(n) for n in names)
        quoted = ", ".join(f'"{n}"' for n in names)
        connection.execute(text(f'INSERT INTO "{table}" ({quoted}) SELECT {selected} FROM "{table}" '
                                f"CROSS JOIN generate_series(1, {count - 1}) AS k"))

    # The bills' table: ``node_bill_rows`` from 0018 (``node_bills`` is then a view over it).
    copy("node_bill_rows" if "node_bill_rows" in tables else "node_bills", "window_start_unix_ms",
         hours_written * HOUR_MS, copies)
    for hourly, daily, measures in ROLLUP_TABLES:
        if hourly in tables:
            copy(hourly, "period_start_unix_ms", hours_written * HOUR_MS, copies)
        if daily is not None and daily in tables:
            scale = 24 // hours_written
            connection.execute(text(
                f'UPDATE "{daily}" SET ' + ", ".join(f'"{m}" = "{m}" * {scale}' for m in measures)))
            copy(daily, "period_start_unix_ms", 24 * HOUR_MS, days)
    connection.execute(text("ANALYZE"))
    return table_rows(connection, sorted(t for t in tables if t in GRAIN_OF_TABLE))


def timed_read(read: Any, repeats: int = 2) -> tuple[float, Any]:
    """Best wall seconds of ``repeats`` calls of ``read()`` and its last result."""
    best = float("inf")
    result = None
    for _ in range(repeats):
        started = time.perf_counter()
        result = read()
        best = min(best, time.perf_counter() - started)
    return best, result


def month_reads(url: str, *, start_ms: int, days: int, hours_of_lines: int) -> dict[str, Any]:
    """The month's reads on the filled ledger, as the commands run them: ``gpumeter report --by namespace`` over
    the month (built and formatted as its table; lines and node bills from the daily rollups);
    ``GET /allocation?window=<the month>&aggregate=namespace`` (``AllocationApi.answer``: the daily pod and line
    rollups, the bill rollups) over the whole month, and by pod over the hours that have minute lines (what it
    reads), with what a month would take at the same cost per hour; the FOCUS export at minute grain
    (``focus_dataset``, minute lines) over those hours likewise, and the month's at hourly grain
    (``focus_month``)."""
    from gpumeter.clock import ManualClock
    from services.billing import report as report_module
    from services.billing.allocation import parse_query
    from services.billing.api import AllocationApi
    from services.billing.export import focus_dataset
    from services.billing.ledger import Grouping, Ledger

    end_ms = start_ms + days * 24 * HOUR_MS
    lines_end_ms = start_ms + hours_of_lines * HOUR_MS
    month_per_lines = days * 24 / hours_of_lines
    ledger = Ledger(url)
    try:
        report_s, report = timed_read(lambda: report_module.build_report(
            ledger, Grouping.parse("namespace"), start_ms=start_ms, end_ms=end_ms))
        text_out = report_module.format_report(report)
        plan = getattr(report, "plan", None)

        api = AllocationApi(ledger, None, clock=ManualClock(end_ms), max_window_seconds=93 * 86_400, max_steps=1000)

        def allocation(aggregate: str, until_ms: int) -> dict[str, Any]:
            window = f"{_rfc3339(start_ms)},{_rfc3339(until_ms)}"
            query = parse_query({"window": window, "aggregate": aggregate, "accumulate": "true",
                                 "includeIdle": "true"}, until_ms)
            return api.answer(query)

        allocation_s, answer = timed_read(lambda: allocation("namespace", end_ms))
        by_pod_s, by_pod = timed_read(lambda: allocation("pod", lines_end_ms))
        focus_s, focus = timed_read(lambda: focus_dataset(ledger, start_ms=start_ms, end_ms=lines_end_ms),
                                    repeats=1)
        month_focus = focus_month(ledger, start_ms=start_ms, end_ms=end_ms)
    finally:
        ledger.close()
    return {
        "days": days,
        "report_by_namespace_s": round(report_s, 3),
        "report_lines": len(report.lines),
        "report_reconciles": report.reconciliation.lines_total_micro_usd == report.reconciliation.node_bills_micro_usd,
        "report_grain": plan.describe() if plan is not None else "minute (cost lines)",
        "report_text_bytes": len(text_out),
        "minute_lines_hours": hours_of_lines,
        "allocation_namespace_month_s": round(allocation_s, 3),
        "allocation_namespace_grain": answer["gpumeter"]["grain"],
        "allocation_namespace_reconciles": answer["gpumeter"]["reconciliation"]["reconciled"],
        "allocation_namespace_allocations": len(answer["data"][0]),
        "allocation_pod_s_over_minute_lines": round(by_pod_s, 3),
        "allocation_pod_s_month_at_that_rate": round(by_pod_s * month_per_lines, 1),
        "allocation_pod_grain": by_pod["gpumeter"]["grain"],
        "focus_export_s_over_minute_lines": round(focus_s, 3),
        "focus_export_s_month_at_that_rate": round(focus_s * month_per_lines, 1),
        "focus_rows_over_minute_lines": len(focus),
        **month_focus,
    }


def focus_month(ledger: Any, *, start_ms: int, end_ms: int) -> dict[str, Any]:
    """The month's FOCUS export as ``gpumeter export focus --window 30d --out FILE.parquet`` makes it (grain auto:
    the whole hours of the month from the hourly FOCUS rollups, a day of rows at a time into one Parquet file):
    its wall seconds, the rows building alone (the same chunks, not written), its rows and bytes, the grain and the
    worker processes (``gpumeter export focus``'s default ``--workers``)."""
    import os
    import tempfile
    from pathlib import Path

    from services.billing.export import default_workers, focus_export
    from services.billing.focus import write_focus_parquet_chunks

    # The command's worker processes (one per core, at most 4: ``--workers``'s default).
    workers = default_workers()
    started = time.perf_counter()
    grain, chunks = focus_export(ledger, start_ms=start_ms, end_ms=end_ms, workers=workers)
    rows = sum(len(chunk) for chunk in chunks)
    build_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "month.parquet"
        started = time.perf_counter()
        grain, chunks = focus_export(ledger, start_ms=start_ms, end_ms=end_ms, workers=workers)
        written = write_focus_parquet_chunks(chunks, path, metadata={"gpumeter_grain": grain.grain})
        export_s = time.perf_counter() - started
        size = os.path.getsize(path)
    if written != rows:
        raise AssertionError(f"the export wrote {written} rows, the rows built were {rows}")
    return {"focus_month_grain": grain.describe(), "focus_month_rows": rows, "focus_month_workers": workers,
            "focus_month_rows_s": round(build_s, 1), "focus_month_export_parquet_s": round(export_s, 1),
            "focus_month_parquet_bytes": size}


def _rfc3339(unix_ms: int) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(unix_ms / 1000, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------------------------------------------
# A/B: the lines' layout at revision 0015 (a row of ids per line, 0014) against 0016's (a node-window's lines one
# row of arrays), in one run

AB_REVISIONS = ("0015_focus_hourly", "head")
AB_ROUNDS = 4
AB_MINUTES_PER_ROUND = 4
AB_READ_ROUNDS = 3
# The tables holding one minute of lines at each revision (what "bytes per line" counts).
LINE_TABLES = ("cost_lines", "cost_line_rows", "cost_line_packs")
DICTIONARIES = ("ledger_nodes", "ledger_gpus", "ledger_pods", "ledger_line_kinds")
# The tables holding the node bills at each revision (0018: the rows of ids and the bills' own dictionaries).
BILL_TABLES = ("node_bills", "node_bill_rows", "ledger_bill_kinds", "ledger_bill_names", "ledger_zero_sets")
# The bills' A/B (``--bills``): 0017's ``node_bills`` table against 0018's rows of ids.
BILLS_AB_REVISIONS = ("0017_focus_line_ids", "head")


def layout_ab(server_url: str, fleet: MonthFleet, *, rounds: int = AB_ROUNDS,
              minutes: int = AB_MINUTES_PER_ROUND, read_rounds: int = AB_READ_ROUNDS,
              revisions: tuple[str, str] = AB_REVISIONS) -> dict[str, Any]:
    """Two ledgers on one server, one at each of ``revisions`` (``AB_REVISIONS``: the first migrated only that far:
    head's code writes its lines as rows of ids, ``cost_line_rows``, the second as packs, ``cost_line_packs``;
    ``BILLS_AB_REVISIONS``: the bills as 0017's table, and as 0018's rows of ids), holding the
    same fleet minutes, written by ``Ledger.write`` in ``rounds`` alternating rounds of ``minutes`` minutes each
    (the first round's order swapped each round): the write rates of both layouts. Then each ``VACUUM FULL`` and
    its lines' bytes (heap, indexes and TOAST) per stored line, its dictionaries' bytes (a fixed fleet's nodes and
    GPUs, and its pods: not per line), and its node bills' bytes per bill (``BILL_TABLES``: from 0018 the rows and
    the bills' dictionaries). Then the reads, alternating over ``read_rounds`` rounds, best of each: ``GET
    /allocation`` by pod over the minutes written (minute lines and bills), the FOCUS export at minute grain
    (``focus_dataset``) over them, one SQL sum by namespace and pod over the view, and the bills
    (``Ledger.bills``, every column); their answers must be equal."""
    from alembic import command
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from gpumeter.clock import ManualClock
    from services.billing.allocation import parse_query
    from services.billing.api import AllocationApi
    from services.billing.export import focus_dataset
    from services.billing.ledger import Ledger, _alembic_config

    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    ledgers: dict[str, Any] = {}
    rates: dict[str, list[float]] = {revision: [] for revision in revisions}
    try:
        for revision in revisions:
            name = f"ab_{revision.replace('_', '')[:12].lower()}"
            with admin.connect() as connection:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
                connection.execute(text(f'CREATE DATABASE "{name}"'))
            ledger = Ledger(make_url(server_url).set(database=name).render_as_string(hide_password=False))
            if revision == "head":
                ledger.migrate()
            else:
                with ledger.engine.begin() as connection:
                    command.upgrade(_alembic_config(connection), revision)
            ledgers[revision] = ledger
        for index in range(rounds):
            order = revisions if index % 2 == 0 else revisions[::-1]
            for revision in order:
                written = ingest(ledgers[revision], fleet, index * minutes, minutes)
                rates[revision].append(round(written.node_windows_per_s, 1))
        out: dict[str, Any] = {}
        for revision, ledger in ledgers.items():
            with ledger.engine.connect() as connection:
                connection.execution_options(isolation_level="AUTOCOMMIT").execute(text("VACUUM FULL ANALYZE"))
                sizes = table_bytes(connection)
                lines = int(connection.execute(text("SELECT count(*) FROM cost_lines")).scalar_one())
                bills = int(connection.execute(text("SELECT count(*) FROM node_bills")).scalar_one())
            line_bytes = sum(sizes.get(name, 0) for name in LINE_TABLES)
            out[revision] = {"node_windows_per_s_by_round": rates[revision],
                             # Every round writes as many node-windows: all rounds' rate is the harmonic mean.
                             "node_windows_per_s_total": round(
                                 len(rates[revision]) / sum(1 / r for r in rates[revision]), 1),
                             "lines": lines, "line_bytes": line_bytes, "bytes_per_line": round(line_bytes / lines, 1),
                             "dictionary_bytes": sum(sizes.get(name, 0) for name in DICTIONARIES),
                             "bill_bytes": sum(sizes.get(name, 0) for name in BILL_TABLES),
                             "bytes_per_bill": round(sum(sizes.get(name, 0) for name in BILL_TABLES) / bills, 1),
                             "bill_bytes_by_table": {name: sizes[name] for name in BILL_TABLES if name in sizes}}
        out["lines_insert"] = lines_insert_ab(ledgers, fleet, first_minute=rounds * minutes)
        out["bills_insert"] = bills_insert_ab(ledgers, fleet, first_minute=rounds * minutes)
        out["writes"] = writes_ab(ledgers, fleet, first_minute=rounds * minutes)
        start_ms = fleet.start_unix_ms
        end_ms = start_ms + rounds * minutes * WINDOW_MS

        def by_pod(ledger: Any) -> Any:
            api = AllocationApi(ledger, None, clock=ManualClock(end_ms), max_window_seconds=93 * 86_400,
                                max_steps=1000)
            query = parse_query({"window": f"{_rfc3339(start_ms)},{_rfc3339(end_ms)}", "aggregate": "pod",
                                 "accumulate": "true", "includeIdle": "true"}, end_ms)
            return api.answer(query)["data"]

        def sql_sum(ledger: Any) -> Any:
            with ledger.engine.connect() as connection:
                return sorted((tuple(row) for row in connection.execute(text(
                    "SELECT namespace, pod_name, sum(cost_micro_usd), count(*) FROM cost_lines "
                    "WHERE window_start_unix_ms >= :s AND window_start_unix_ms < :e GROUP BY 1, 2"),
                    {"s": start_ms, "e": end_ms})), key=repr)

        reads = {"allocation_by_pod": by_pod,
                 "focus_minute": lambda ledger: focus_dataset(ledger, start_ms=start_ms, end_ms=end_ms),
                 "sql_sum_by_pod": sql_sum,
                 "bills": lambda ledger: ledger.bills(start_ms=start_ms, end_ms=end_ms)}
        timings: dict[str, dict[str, list[float]]] = {revision: {r: [] for r in reads} for revision in revisions}
        answers: dict[str, dict[str, Any]] = {revision: {} for revision in revisions}
        for index in range(read_rounds):
            order = revisions if index % 2 == 0 else revisions[::-1]
            for read_name, read in reads.items():
                for revision in order:
                    seconds, answers[revision][read_name] = timed_read(lambda: read(ledgers[revision]), repeats=1)
                    timings[revision][read_name].append(round(seconds, 3))
        for read_name in reads:
            first, second = (answers[revision][read_name] for revision in revisions)
            if first != second:
                raise AssertionError(f"{read_name} answers differently over the two layouts")
        for revision in revisions:
            out[revision]["reads_s"] = {name: min(times) for name, times in timings[revision].items()}
            out[revision]["reads_s_by_round"] = timings[revision]
        old, new = (out[revision] for revision in revisions)
        inserts = out["lines_insert"]
        ratios = {"bytes_per_line": round(new["bytes_per_line"] / old["bytes_per_line"], 3),
                  "bytes_per_bill": round(new["bytes_per_bill"] / old["bytes_per_bill"], 3),
                  "lines_insert_ms": round(inserts[revisions[1]]["median_ms_per_node_window"]
                                           / inserts[revisions[0]]["median_ms_per_node_window"], 3),
                  "bills_insert_ms": round(out["bills_insert"][revisions[1]]["median_ms_per_node_window"]
                                           / out["bills_insert"][revisions[0]]["median_ms_per_node_window"], 3),
                  "write_ms": round(out["writes"][revisions[1]]["median_ms_per_node_window"]
                                    / out["writes"][revisions[0]]["median_ms_per_node_window"], 3),
                  "node_windows_per_s": round(new["node_windows_per_s_total"] / old["node_windows_per_s_total"], 3),
                  **{f"{name}_s": round(new["reads_s"][name] / old["reads_s"][name], 3) for name in reads}}
        return {"rounds": rounds, "minutes_per_round": minutes, "node_windows_per_round": minutes * fleet.nodes,
                "read_rounds": read_rounds, **out, "new_over_old": ratios}
    finally:
        for ledger in ledgers.values():
            ledger.close()
        admin.dispose()


def lines_insert_ab(ledgers: dict[str, Any], fleet: MonthFleet, *, first_minute: int, minutes: int = 4,
                    repeats: int = 2) -> dict[str, Any]:
    """The lines' insert alone (``Ledger._insert_lines``: what the layouts differ in), A/B: ``minutes`` more
    minutes of the fleet in batches of ``BATCH_NODE_WINDOWS`` node-windows, their stored lines (zero lines left on
    the bill) inserted into each ledger in a transaction rolled back, alternating, ``repeats`` times; ms per
    node-window (wall and this process's CPU), median and best. The rest of a write (bills, six rollup upserts)
    is the same code in both and most of its time, so the whole write's rate hides the difference in this
    machine's noise."""
    import statistics

    from services.billing.line_storage import is_zero_line

    batches = []
    for batch in fleet.batches(first_minute, minutes):
        batches.append(([c for w in batch for c in w.costs
                         if not is_zero_line(c, w.bill.window_seconds, w.bill.instance_type, w.bill.price_model,
                                             w.bill.price_version)], len(batch)))
    for ledger in ledgers.values():
        ledger._ensure_partitions_for({fleet.start_unix_ms + first_minute * WINDOW_MS})
        for kept, _windows in batches:
            ledger._resolve_ids(kept, [])
    wall: dict[str, list[float]] = {revision: [] for revision in ledgers}
    cpu: dict[str, list[float]] = {revision: [] for revision in ledgers}
    for index, (kept, windows) in enumerate(batches * repeats):
        order = list(ledgers) if index % 2 == 0 else list(ledgers)[::-1]
        for revision in order:
            ledger = ledgers[revision]
            with ledger.engine.connect() as connection:
                transaction = connection.begin()
                started, started_cpu = time.perf_counter(), time.process_time()
                ledger._insert_lines(connection, kept)
                connection.exec_driver_sql("SELECT 1")  # the insert's statements done
                wall[revision].append((time.perf_counter() - started) * 1000 / windows)
                cpu[revision].append((time.process_time() - started_cpu) * 1000 / windows)
                transaction.rollback()
    return {revision: {"median_ms_per_node_window": round(statistics.median(wall[revision]), 3),
                       "best_ms_per_node_window": round(min(wall[revision]), 3),
                       "client_cpu_median_ms_per_node_window": round(statistics.median(cpu[revision]), 3),
                       "batches": len(wall[revision])} for revision in ledgers}


def bills_insert_ab(ledgers: dict[str, Any], fleet: MonthFleet, *, first_minute: int, minutes: int = 4,
                    repeats: int = 2) -> dict[str, Any]:
    """The bills' insert alone, A/B (what 0017's ``node_bills`` table and 0018's ``node_bill_rows`` differ in):
    ``minutes`` more minutes of the fleet in batches of ``BATCH_NODE_WINDOWS`` node-windows, their bills (zero lines
    encoded as ``Ledger.write`` encodes them, ids resolved first as it does) inserted into each ledger in a
    transaction rolled back, alternating, ``repeats`` times: 0017's one ``INSERT ... ON CONFLICT DO NOTHING
    RETURNING`` of the bills' columns, 0018's ``Ledger._insert_bill_rows`` (zero sets the handle knows of skipped,
    as in a steady write). ms per node-window (wall and this process's CPU), median and best."""
    import statistics

    from services.billing.ledger import _bill_row, _zero_line, encode_zero_lines, node_bills
    from services.billing.line_storage import is_zero_line

    batches = []
    for batch in fleet.batches(first_minute, minutes):
        zeros = {w.bill.key: [_zero_line(c) for c in w.costs
                              if is_zero_line(c, w.bill.window_seconds, w.bill.instance_type, w.bill.price_model,
                                              w.bill.price_version)] for w in batch}
        batches.append(([w.bill for w in batch], zeros))
    rows_of: dict[str, list[dict]] = {}
    for revision, ledger in ledgers.items():
        ledger._ensure_partitions_for({fleet.start_unix_ms + first_minute * WINDOW_MS})
        rows_of[revision] = []
        for bills, zeros in batches:
            rows = [{**_bill_row(b), "publisher": ledger.publisher} for b in bills]
            ledger._resolve_ids([], {z[0] for lines in zeros.values() for z in lines}, rows)
            gpu_ids = ledger._ids.get("gpus")
            rows_of[revision].append({(b.window_start_unix_ms, b.cluster, b.node_name): {
                **row, "zero_lines": encode_zero_lines(zeros[b.key], gpu_ids), "zero_line_count": len(zeros[b.key])}
                for b, row in zip(bills, rows)})
    pk = [node_bills.c.window_start_unix_ms, node_bills.c.cluster, node_bills.c.node_name]
    wall: dict[str, list[float]] = {revision: [] for revision in ledgers}
    cpu: dict[str, list[float]] = {revision: [] for revision in ledgers}
    for index in range(len(batches) * repeats):
        order = list(ledgers) if index % 2 == 0 else list(ledgers)[::-1]
        for revision in order:
            ledger = ledgers[revision]
            bill_rows = rows_of[revision][index % len(batches)]
            with ledger.engine.connect() as connection:
                transaction = connection.begin()
                started, started_cpu = time.perf_counter(), time.process_time()
                if ledger._bill_rows:
                    inserted, _sets = ledger._insert_bill_rows(connection, bill_rows)
                else:
                    inserted = connection.execute(ledger._insert(node_bills).on_conflict_do_nothing().returning(*pk),
                                                  list(bill_rows.values())).all()
                connection.exec_driver_sql("SELECT 1")  # the insert's statements done
                wall[revision].append((time.perf_counter() - started) * 1000 / len(bill_rows))
                cpu[revision].append((time.process_time() - started_cpu) * 1000 / len(bill_rows))
                transaction.rollback()
            if len(inserted) != len(bill_rows):
                raise AssertionError(f"{revision}: {len(inserted)} of {len(bill_rows)} new bills inserted")
    return {revision: {"median_ms_per_node_window": round(statistics.median(wall[revision]), 3),
                       "best_ms_per_node_window": round(min(wall[revision]), 3),
                       "client_cpu_median_ms_per_node_window": round(statistics.median(cpu[revision]), 3),
                       "batches": len(wall[revision])} for revision in ledgers}


def writes_ab(ledgers: dict[str, Any], fleet: MonthFleet, *, first_minute: int, minutes: int = 8) -> dict[str, Any]:
    """The whole ``Ledger.write``, A/B batch by batch: ``minutes`` more minutes of the fleet (after every other
    write: new node-windows), each batch of ``BATCH_NODE_WINDOWS`` written to each ledger in turn (committed), the
    first ledger swapped every batch; ms per node-window (wall and this process's CPU), median and best. Alternating
    every batch rather than every round keeps this machine's drifting load out of the ratio."""
    import statistics

    wall: dict[str, list[float]] = {revision: [] for revision in ledgers}
    cpu: dict[str, list[float]] = {revision: [] for revision in ledgers}
    for index, batch in enumerate(fleet.batches(first_minute, minutes)):
        costs = [c for w in batch for c in w.costs]
        bills = [w.bill for w in batch]
        order = list(ledgers) if index % 2 == 0 else list(ledgers)[::-1]
        for revision in order:
            started, started_cpu = time.perf_counter(), time.process_time()
            result = ledgers[revision].write(costs, bills)
            wall[revision].append((time.perf_counter() - started) * 1000 / len(batch))
            cpu[revision].append((time.process_time() - started_cpu) * 1000 / len(batch))
            if result.bills_written != len(batch):
                raise AssertionError(f"{revision}: {result.bills_written} of {len(batch)} new bills written")
    return {revision: {"median_ms_per_node_window": round(statistics.median(wall[revision]), 3),
                       "best_ms_per_node_window": round(min(wall[revision]), 3),
                       "client_cpu_median_ms_per_node_window": round(statistics.median(cpu[revision]), 3),
                       "batches": len(wall[revision])} for revision in ledgers}


def storage_only(nodes: int = FLEET_NODES, ingest_minutes: int = 60) -> dict[str, Any]:
    """``measure``'s ingest and storage alone (``python -m bench.ledger_month --storage``): ``ingest_minutes`` of the
    fleet into a fresh ledger at head on a throwaway server, ``VACUUM FULL``, the bytes per grain and the default
    retention's total (no month filled, no reads)."""
    from sqlalchemy import create_engine, text

    from gpumeter.devtools.postgres import PostgresServer
    from services.billing.ledger import Ledger

    fleet = MonthFleet(nodes)
    with PostgresServer() as server:
        ledger = Ledger(server.url)
        try:
            ledger.migrate()
            written = ingest(ledger, fleet, 0, ingest_minutes)
        finally:
            ledger.close()
        admin = create_engine(server.url, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as connection:
                connection.execute(text("VACUUM FULL ANALYZE"))
                sizes = table_bytes(connection)
                rows = table_rows(connection, sorted(sizes))
        finally:
            admin.dispose()
    return {"ingest": {"node_windows": written.node_windows, "write_wall_s": round(written.write_wall_s, 3),
                       "node_windows_per_s": round(written.node_windows_per_s, 1)},
            "tables": {name: {"bytes": sizes[name], "rows": rows.get(name, 0)} for name in sorted(sizes)},
            "storage": storage_per_1000_gpu_days(sizes, rows, ingest_minutes / 60, fleet.gpus)}


def layouts_only(nodes: int = FLEET_NODES) -> dict[str, Any]:
    """The lines' layout A/B alone (``python -m bench.ledger_month --layouts``), on a throwaway server. Since
    revision 0017 head's writer cannot write a ledger at 0015 (``AB_REVISIONS``' first: its hourly FOCUS charges
    have no ids): refused with that reason; its figures of 2026-12-04 are in docs/billing.md."""
    from gpumeter.devtools.postgres import PostgresServer

    if head_writes(AB_REVISIONS[0]) is False:
        raise SystemExit("--layouts: head's writer cannot write a ledger at 0015 since 0017 (the hourly FOCUS "
                         "charges' ids); the lines' A/B of 2026-12-04 is in docs/billing.md; --bills A/Bs 0017 "
                         "against head")

    fleet = MonthFleet(nodes)
    with PostgresServer() as server:
        return layout_ab(server.url, fleet)


def head_writes(revision: str) -> bool:
    """Whether head's ``Ledger.write`` can write a ledger at ``revision``: from 0017 on (its hourly FOCUS charges'
    ids, ``focus_rollups``)."""
    from alembic.script import ScriptDirectory
    from alembic.config import Config

    from services.billing.ledger import MIGRATIONS_DIR

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    script = ScriptDirectory.from_config(config)
    order = [r.revision for r in script.walk_revisions()]  # head first
    return revision == "head" or order.index(revision) <= order.index("0017_focus_line_ids")


def bills_only(nodes: int = FLEET_NODES) -> dict[str, Any]:
    """The bills' layout A/B alone (``python -m bench.ledger_month --bills``: 0017's ``node_bills`` table against
    0018's rows of ids, ``layout_ab`` with ``BILLS_AB_REVISIONS``), on a throwaway server."""
    from gpumeter.devtools.postgres import PostgresServer

    fleet = MonthFleet(nodes)
    with PostgresServer() as server:
        return layout_ab(server.url, fleet, revisions=BILLS_AB_REVISIONS, read_rounds=2)


# ---------------------------------------------------------------------------------------------------------------
# The benchmark


def measure(nodes: int = FLEET_NODES, ingest_minutes: int = 60, days: int = 30) -> dict[str, Any]:
    """Ingest ``ingest_minutes`` of ``nodes`` nodes into a fresh PostgreSQL ledger, the storage it takes, then
    the month filled (``fill_month``) and read (``month_reads``)."""
    from sqlalchemy import create_engine, text

    from gpumeter.devtools.postgres import PostgresServer
    from services.billing.ledger import Ledger

    if ingest_minutes % 60:
        raise ValueError("ingest whole hours")
    fleet = MonthFleet(nodes)
    hours = ingest_minutes // 60
    with PostgresServer() as server:
        admin = create_engine(server.url, isolation_level="AUTOCOMMIT")
        ledger = Ledger(server.url)
        try:
            ledger.migrate()
            written = ingest(ledger, fleet, 0, ingest_minutes)
        finally:
            ledger.close()
        try:
            with admin.connect() as connection:
                # FULL: a rollup row is updated by every write of its period, and the dead versions plain VACUUM
                # leaves in the file are space the next periods reuse, not bytes a day of history keeps.
                connection.execute(text("VACUUM FULL ANALYZE"))
                sizes = table_bytes(connection)
                rows = table_rows(connection, sorted(sizes))
                started = time.perf_counter()
                month_rows = fill_month(connection, first_window_ms=fleet.start_unix_ms, hours_written=hours,
                                        days=days)
                fill_s = time.perf_counter() - started
            reads = month_reads(server.url, start_ms=fleet.start_unix_ms, days=days, hours_of_lines=hours)
            # The bills' A/B (0017 against head): head's writer no longer writes a 0015 ledger (0017 gave the
            # hourly FOCUS charges ids), so the lines' A/B (``AB_REVISIONS``) is not run here any more.
            layouts = layout_ab(server.url, fleet, revisions=BILLS_AB_REVISIONS)
        finally:
            admin.dispose()
    return {
        "fleet": {"nodes": nodes, "gpus": fleet.gpus, "share_rows_per_node_window": fleet.template.row_count,
                  "pods_per_node": len(fleet.template.pods)},
        "ingest": {"minutes": ingest_minutes, "node_windows": written.node_windows,
                   "cost_lines_offered": written.cost_lines_offered,
                   "cost_lines_offered_per_node_window": round(written.cost_lines_offered / written.node_windows, 1),
                   "write_wall_s": round(written.write_wall_s, 3),
                   "node_windows_per_s": round(written.node_windows_per_s, 1),
                   "batch_node_windows": BATCH_NODE_WINDOWS,
                   "server": "throwaway PostgresServer: fsync=off, synchronous_commit=off, loopback TCP"},
        "tables": {name: {"bytes": sizes[name], "rows": rows.get(name, 0)} for name in sorted(sizes)},
        "storage": storage_per_1000_gpu_days(sizes, rows, hours, fleet.gpus),
        "month": {"rows": month_rows, "fill_s": round(fill_s, 1), **reads},
        "bills_layout_ab": layouts,
    }


def run(quick: bool) -> tuple[dict[str, Any], list[Target], list[str]]:
    """``make bench``'s month of a 1,000-GPU cluster (quick: 10 nodes, 2 days)."""
    figures = measure(nodes=10 if quick else FLEET_NODES, ingest_minutes=60, days=2 if quick else 30)
    ingest_rate = figures["ingest"]["node_windows_per_s"]
    storage = figures["storage"]
    retained_gb = storage["default_retention_bytes_for_1000_gpus"] / 1e9
    month = figures["month"]
    per_grain = ", ".join(f"{grain} {storage[grain]['bytes_per_1000_gpu_days'] / 1e6:,.1f} MB"
                          for grain in ("minute", "hour", "day") if grain in storage)
    targets = [
        Target("ledger ingest (PostgreSQL)", f">= {TARGET_INGEST_NODE_WINDOWS_PER_S:,.0f} node-windows/s",
               f"{ingest_rate:,.1f} node-windows/s ({figures['ingest']['cost_lines_offered_per_node_window']} "
               f"lines offered each, batches of {BATCH_NODE_WINDOWS})",
               ingest_rate >= TARGET_INGEST_NODE_WINDOWS_PER_S,
               "" if ingest_rate >= TARGET_INGEST_NODE_WINDOWS_PER_S else "see docs/billing.md, storage"),
        Target("ledger storage, default retention of 1,000 GPUs",
               f"< {TARGET_RETAINED_GB_FOR_1000_GPUS:.0f} GB",
               f"{retained_gb:,.1f} GB (per 1,000 GPU-days: {per_grain})",
               retained_gb < TARGET_RETAINED_GB_FOR_1000_GPUS,
               "" if retained_gb < TARGET_RETAINED_GB_FOR_1000_GPUS else "the minute lines; see docs/billing.md"),
        Target("30-day report by namespace", "< 2 s",
               f"{month['report_by_namespace_s']} s ({month['report_grain']})",
               month["report_by_namespace_s"] < 2.0 and month["report_reconciles"],
               "" if month["report_by_namespace_s"] < 2.0 else "see docs/billing.md"),
        Target("30-day /allocation by namespace", "< 1 s",
               f"{month['allocation_namespace_month_s']} s ({month['allocation_namespace_grain']}; by pod, from "
               f"minute lines, {month['allocation_pod_s_month_at_that_rate']} s for a month at the "
               f"{month['allocation_pod_s_over_minute_lines']} s it took over {month['minute_lines_hours']} h)",
               month["allocation_namespace_month_s"] < 1.0 and month["allocation_namespace_reconciles"],
               "" if month["allocation_namespace_month_s"] < 1.0 else "see docs/billing.md"),
        Target("a month's FOCUS export", "< 60 s",
               f"{month['focus_month_export_parquet_s']} s at hourly grain into Parquet "
               f"({month['focus_month_rows']:,} rows, {month['focus_month_parquet_bytes'] / 1e6:,.0f} MB; "
               f"building the rows {month['focus_month_rows_s']} s; {month['focus_month_grain']}); minute grain "
               f"{month['focus_export_s_month_at_that_rate']} s for a month at the "
               f"{month['focus_export_s_over_minute_lines']} s it took over {month['minute_lines_hours']} h "
               f"({month['focus_rows_over_minute_lines']:,} rows)",
               month["focus_month_export_parquet_s"] < 60.0 and month["focus_month_grain"].startswith("hour"),
               "" if month["focus_month_export_parquet_s"] < 60.0 else "see docs/billing.md, FOCUS export"),
    ]
    notes = [f"the month: node bills and rollups (line, bill and pod) of {figures['ingest']['minutes'] // 60} h "
             f"written through Ledger.write, copied over {month['days']} days by SQL in {month['fill_s']} s; minute "
             "lines only for the written hours"]
    return figures, targets, notes


if __name__ == "__main__":
    import json
    import sys

    parts = {"--layouts": layouts_only, "--bills": bills_only, "--storage": storage_only}
    if len(sys.argv) != 2 or sys.argv[1] not in parts:
        raise SystemExit("usage: python -m bench.ledger_month --layouts|--bills|--storage  (the lines' layout A/B, "
                         "the bills' layout A/B, or the ingest and storage alone; make bench runs the whole month)")
    print(json.dumps(parts[sys.argv[1]](), indent=2))
