"""Ledger: rows/s of bulk writes against per-row inserts, on SQLite and on PostgreSQL.

The rows are real billing output: one node-window of the benchmark fleet (8 GPUs × 8 pods) through the engine and
``bill_node_window`` gives 89 cost lines and 1 node bill; it is cloned (other node names and window starts) into as
many node-windows as a run needs, so every run inserts new keys (the ledger is idempotent and would skip repeats).

Variants, each on a freshly migrated database (``Ledger.migrate()``), alternated in the same run:

* **bulk** — ``Ledger.write`` of ``BULK_WINDOWS`` node-windows per call: one transaction, executemany (multi-row
  ``VALUES``);
* **per_window** — ``Ledger.write`` once per node-window: what the billing service does today (one transaction
  of 90 rows per node-window);
* **per_row** — the baseline: one ``INSERT ... ON CONFLICT DO NOTHING`` statement per row through the same
  SQLAlchemy engine and tables, the rows of a node-window in one transaction (the same atomicity as the ledger).
  On PostgreSQL its database is migrated to ``PER_ROW_REVISION`` only: from 0014 on the lines, and from 0018 the
  bills, are stored as dictionary ids and per-node-window packs, which have no row-at-a-time form (``node_bills``
  and ``cost_lines`` became views); 0013's plain tables are what one statement per row wrote.

Rows/s counts cost lines plus node bills per wall second (the database server's work is part of it; on SQLite it
runs in this process). PostgreSQL is ``gpumeter.devtools.postgres.PostgresServer``: a throwaway server on loopback
with ``fsync=off`` and ``synchronous_commit=off`` (its data is thrown away), so the figures show the client and
server CPU cost, not a disk's commit latency; SQLite runs in WAL mode with ``synchronous=NORMAL`` on a local file.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from sqlalchemy import func, select

from services.billing.catalog import bundled_catalog
from services.billing.costing import NodeWindowCost, bill_node_window
from services.billing.ledger import (
    Ledger,
    _bill_row,
    _line_row,
    _zero_line,
    cost_lines,
    label_sets,
    node_bills,
    price_versions,
)
from services.billing.line_storage import encode_zero_lines, is_zero_line

from bench.attribution import build_input, engine_with_pods, run_engine, share_rows
from bench.common import Target, alternate

BULK_WINDOWS = 50
PER_ROW_REVISION = "0013_lean_lines"  # PostgreSQL: the last revision whose lines and bills are plain rows
WINDOW_MS = 60_000


def template_window() -> NodeWindowCost:
    """One priced node-window of the benchmark fleet (89 cost lines and its bill)."""
    data = build_input(nodes=1, ticks=61)
    shares = [s for s in share_rows(run_engine(engine_with_pods(data), data.avro_messages))
              if s.window_start_unix_ms == data.fleet.start_unix_ms]
    return bill_node_window(shares, bundled_catalog())


class WindowFactory:
    """Clones of the template with fresh (node, window start) keys: ``take(n)`` never repeats a key."""

    def __init__(self, template: NodeWindowCost, nodes: int = 100) -> None:
        self.template = template
        self.nodes = nodes
        self._next = 0

    def take(self, count: int) -> list[NodeWindowCost]:
        out = []
        for _ in range(count):
            k = self._next
            self._next += 1
            node = f"{self.template.bill.node_name}-{k % self.nodes:03d}"
            start = self.template.bill.window_start_unix_ms + (k // self.nodes) * WINDOW_MS
            costs = tuple(dataclasses.replace(c, node_name=node, window_start_unix_ms=start)
                          for c in self.template.costs)
            bill = dataclasses.replace(self.template.bill, node_name=node, window_start_unix_ms=start)
            out.append(NodeWindowCost(costs=costs, bill=bill, parts=self.template.parts))
        return out


def rows_in(windows: Sequence[NodeWindowCost]) -> int:
    return sum(len(w.costs) + 1 for w in windows)


def write_bulk(ledger: Ledger, windows: Sequence[NodeWindowCost]) -> int:
    written = 0
    for i in range(0, len(windows), BULK_WINDOWS):
        chunk = windows[i:i + BULK_WINDOWS]
        result = ledger.write([c for w in chunk for c in w.costs], [w.bill for w in chunk])
        written += result.lines_written + result.bills_written
    return written


def write_per_window(ledger: Ledger, windows: Sequence[NodeWindowCost]) -> int:
    written = 0
    for w in windows:
        result = ledger.write(w.costs, (w.bill,))
        written += result.lines_written + result.bills_written
    return written


def stored_lines(w: NodeWindowCost) -> list:
    """The lines of ``w`` that are ``cost_lines`` rows (the others are zero lines, kept on the bill)."""
    b = w.bill
    return [c for c in w.costs
            if not is_zero_line(c, b.window_seconds, b.instance_type, b.price_model, b.price_version)]


def write_per_row(ledger: Ledger, windows: Sequence[NodeWindowCost]) -> int:
    """The baseline: one INSERT statement per row, one transaction per node-window. Returns the lines sent, zero
    lines (on their bill's row) included (the drivers do not all report a row count for ``ON CONFLICT DO
    NOTHING``; ``measure_backend`` counts what is stored)."""
    insert = ledger._insert
    sent = 0
    for w in windows:
        kept = stored_lines(w)
        # PostgreSQL: the day's partitions first (0010), as ``Ledger.write`` makes sure of them.
        ledger._ensure_partitions_for({w.bill.window_start_unix_ms})
        kept_ids = {id(c) for c in kept}
        zero = [_zero_line(c) for c in w.costs if id(c) not in kept_ids]
        with ledger.engine.begin() as connection:
            connection.execute(insert(price_versions).on_conflict_do_nothing(), w.bill.price.describe())
            connection.execute(insert(node_bills).on_conflict_do_nothing(),
                               {**_bill_row(w.bill), "zero_lines": encode_zero_lines(zero)})
            sent += 1 + len(zero)
            for cost in kept:
                label_set = ledger._label_set(cost)
                if label_set:
                    connection.execute(insert(label_sets).on_conflict_do_nothing(), {
                        "label_set_id": label_set, "labels": dict(sorted(cost.labels.items())),
                        "carried_label_keys": ",".join(cost.carried_label_keys)})
                connection.execute(insert(cost_lines).on_conflict_do_nothing(), _line_row(cost, label_set))
                sent += 1
    return sent


def migrate_to(ledger: Ledger, revision: str) -> None:
    """``ledger.migrate()`` stopped at ``revision`` (alembic ``upgrade <revision>``)."""
    from alembic import command

    from services.billing.ledger import _alembic_config

    with ledger.engine.begin() as connection:
        config = _alembic_config(connection)
        config.attributes["team_label"] = ledger.team_label
        command.upgrade(config, revision)


VARIANTS = {"bulk": write_bulk, "per_window": write_per_window, "per_row": write_per_row}


def measure_backend(url_of: Callable[[str], str], windows_per_run: int, repeats: int,
                    template: NodeWindowCost) -> dict[str, Any]:
    """Rows/s of every variant; ``url_of(variant)`` is that variant's own empty database (migrated here)."""
    factory = WindowFactory(template)
    ledgers = {name: Ledger(url_of(name)) for name in VARIANTS}
    try:
        for name, ledger in ledgers.items():
            if name == "per_row" and ledger.dialect == "postgresql":
                migrate_to(ledger, PER_ROW_REVISION)
            else:
                ledger.migrate()
        expected = rows_in([template]) * windows_per_run

        def check(name: str, written: Any) -> None:
            if written != expected:
                raise AssertionError(f"{name} wrote {written} rows, expected {expected}")

        series = alternate(
            [(name, lambda: factory.take(windows_per_run), lambda ws, fn=fn, ledger=ledgers[name]: fn(ledger, ws))
             for name, fn in VARIANTS.items()],
            repeats,
            check,
        )
        stored = {}
        for name, ledger in ledgers.items():
            with ledger.engine.connect() as connection:
                stored[name] = connection.execute(select(func.count()).select_from(cost_lines)).scalar_one()
            rows = len(stored_lines(template)) * windows_per_run * repeats
            if stored[name] != rows:
                raise AssertionError(f"{name} stored {stored[name]} cost lines, expected {rows}")
        out: dict[str, Any] = {"rows_per_run": expected, "node_windows_per_run": windows_per_run,
                               "bulk_node_windows_per_write": BULK_WINDOWS}
        for name, s in series.items():
            out[name] = s.summary(expected, "rows")
            out[name]["cost_lines_stored"] = stored[name]
            out[name]["zero_lines_on_bills"] = ((len(template.costs) - len(stored_lines(template)))
                                                * windows_per_run * repeats)
        out["bulk_vs_per_row"] = round(series["per_row"].best_wall_s / max(series["bulk"].best_wall_s, 1e-9), 2)
        out["per_window_vs_per_row"] = round(
            series["per_row"].best_wall_s / max(series["per_window"].best_wall_s, 1e-9), 2)
        out["bulk_vs_per_window"] = round(
            series["per_window"].best_wall_s / max(series["bulk"].best_wall_s, 1e-9), 2)
        return out
    finally:
        for ledger in ledgers.values():
            ledger.close()


def measure(windows_per_run: int, repeats: int, postgres: bool = True) -> dict[str, Any]:
    template = template_window()
    figures: dict[str, Any] = {"rows_per_node_window": len(template.costs) + 1}
    with tempfile.TemporaryDirectory(prefix="gpumeter-bench-ledger-") as tmp:
        figures["sqlite"] = measure_backend(lambda name: f"sqlite:///{Path(tmp)}/ledger-{name}.sqlite3",
                                            windows_per_run, repeats, template)
    if postgres:
        from gpumeter.devtools.postgres import PostgresServer
        from sqlalchemy import create_engine, text
        from sqlalchemy.engine import make_url

        with PostgresServer() as server:
            admin = create_engine(server.url, isolation_level="AUTOCOMMIT")
            with admin.connect() as connection:
                for name in VARIANTS:
                    connection.execute(text(f'CREATE DATABASE "bench_{name}"'))
            admin.dispose()
            base = make_url(server.url)
            figures["postgresql"] = measure_backend(
                lambda name: base.set(database=f"bench_{name}").render_as_string(hide_password=False),
                windows_per_run, repeats, template)
            figures["postgresql"]["server"] = "throwaway PostgresServer: fsync=off, synchronous_commit=off, loopback TCP"
    return figures


def run(quick: bool) -> tuple[dict[str, Any], list[Target], list[str]]:
    figures = measure(windows_per_run=20 if quick else 100, repeats=2 if quick else 3)
    targets = []
    for backend in ("sqlite", "postgresql"):
        f = figures.get(backend)
        if f is None:
            continue
        targets.append(Target(
            f"ledger on {backend} (no numeric target)", "measure bulk vs per-row rows/s",
            f"bulk {f['bulk']['rows_per_wall_s']:,.0f} rows/s, per node-window {f['per_window']['rows_per_wall_s']:,.0f},"
            f" per row {f['per_row']['rows_per_wall_s']:,.0f} ({f['bulk_vs_per_row']}x)",
            True,
        ))
    notes = ["rows = cost lines + node bills; every run inserts new keys and the stored count is checked"]
    return figures, targets, notes
