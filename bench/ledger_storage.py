"""Ledger storage: rows and bytes per GPU-day before and after revision 0008 (what a minute line stores).

``python -m bench.ledger_storage [SCENARIO.yaml ...] [--postgres]``: each scenario is replayed (``gpumeter
replay``'s pipeline: attribution, billing, the real ``Ledger.write``) into a SQLite ledger file at the newest
revision (**after**); a copy of it is downgraded to revision 0007 (**before**: migration 0008's downgrade puts
every line back as the row 0007 stored, the same rows today's ``make_ledger_0007.py`` fixture shows). Both are
``VACUUM``-ed and measured in the same run: ``cost_lines`` rows, the database file's bytes, and each table's and
index's bytes (SQLite's ``dbstat``), per GPU-day of the bills (Σ ``gpu_count`` × ``window_seconds`` / 86,400).
``--postgres`` also loads both shapes into a throwaway PostgreSQL server and measures
``pg_total_relation_size`` of the ledger's tables (indexes and TOAST included).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from sqlalchemy import create_engine, text

REPO = Path(__file__).resolve().parents[1]
# Every shipped scenario but faults.yaml, whose nodes are priced by no catalog row on purpose.
TABLES = ("cost_lines", "node_bills", "label_sets", "price_versions")


def replay_into(scenario: Path, url: str, out_dir: Path) -> None:
    """Replay ``scenario`` with billing writing to the ledger at ``url`` (replay's own ledger is in memory)."""
    import pipeline.replay as replay
    from services.billing.ledger import Ledger

    class _FileLedger(Ledger):
        def __init__(self, _url: str, **options: Any) -> None:
            super().__init__(url, **options)

    kept = replay.Ledger
    replay.Ledger = _FileLedger
    try:
        replay.replay(scenario, out_dir)
    finally:
        replay.Ledger = kept


def gpu_days(url: str) -> float:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return float(connection.execute(text(
                "SELECT COALESCE(SUM(gpu_count * window_seconds), 0) FROM node_bills")).scalar()) / 86_400
    finally:
        engine.dispose()


def sqlite_figures(path: Path) -> dict[str, Any]:
    """After ``VACUUM``: ``cost_lines`` rows, the file's bytes, and the bytes each ledger table and its indexes
    use (``dbstat``: page bytes less their unused bytes, so that small tables are not rounded up to a page)."""
    import sqlite3

    db = sqlite3.connect(path)
    try:
        db.execute("VACUUM")
        rows = db.execute("SELECT count(*) FROM cost_lines").fetchone()[0]
        used = dict(db.execute("SELECT tbl_name, 0 FROM sqlite_master WHERE type = 'table'").fetchall())
        owner = dict(db.execute("SELECT name, tbl_name FROM sqlite_master").fetchall())
        for name, size in db.execute("SELECT name, SUM(pgsize - unused) FROM dbstat GROUP BY name"):
            table = owner.get(name, name)
            used[table] = used.get(table, 0) + size
    finally:
        db.close()
    ledger = {t: used.get(t, 0) for t in TABLES if t in used}
    return {"cost_lines_rows": rows, "file_bytes": path.stat().st_size, "used_bytes_by_table": ledger,
            "used_bytes": sum(ledger.values())}


def to_revision(url: str, revision: str) -> None:
    from alembic import command

    from services.billing.ledger import Ledger, _alembic_config

    ledger = Ledger(url)
    try:
        with ledger.engine.begin() as connection:
            command.downgrade(_alembic_config(connection), revision)
    finally:
        ledger.close()


def postgres_figures(after: str) -> dict[str, Any]:
    """The ledger at ``after`` copied into PostgreSQL twice, one copy downgraded to 0007: ``pg_total_relation_size``
    per table after ``VACUUM FULL``."""
    from gpumeter.devtools.postgres import PostgresServer
    from sqlalchemy.engine import make_url

    from services.billing.ledger import Ledger

    out = {}
    with PostgresServer() as server:
        admin = create_engine(server.url, isolation_level="AUTOCOMMIT")
        for name, revision in (("after", None), ("before", "0007_sharing")):
            with admin.connect() as connection:
                connection.execute(text(f'CREATE DATABASE "storage_{name}"'))
            url = make_url(server.url).set(database=f"storage_{name}").render_as_string(hide_password=False)
            copy_ledger(after, url)
            if revision is not None:
                to_revision(url, revision)
            engine = create_engine(url, isolation_level="AUTOCOMMIT")
            with engine.connect() as connection:
                connection.execute(text("VACUUM FULL"))
                sizes = {t: connection.execute(text(f"SELECT pg_total_relation_size('{t}')")).scalar()
                         for t in TABLES if connection.execute(text(f"SELECT to_regclass('{t}')")).scalar()}
                rows = connection.execute(text("SELECT count(*) FROM cost_lines")).scalar()
            engine.dispose()
            out[name] = {"cost_lines_rows": rows, "bytes_by_table": sizes, "bytes": sum(sizes.values())}
        admin.dispose()
    return out


def copy_ledger(source_url: str, target_url: str) -> None:
    """Every row of the newest-revision ledger at ``source_url`` into a freshly migrated one at ``target_url``."""
    from sqlalchemy import select

    from services.billing.ledger import Ledger, cost_lines, label_sets, node_bills, price_versions, trueups

    source, target = Ledger(source_url), Ledger(target_url)
    target.migrate()
    try:
        with source.engine.connect() as src, target.engine.begin() as dst:
            for table in (price_versions, node_bills, label_sets, cost_lines, trueups):
                query = select(table)
                if table is label_sets:
                    query = query.where(label_sets.c.label_set_id != 0)  # the migration stored the empty set
                rows = [dict(r._mapping) for r in src.execute(query)]
                if rows:
                    dst.execute(table.insert(), rows)
    finally:
        source.close()
        target.close()


def measure(scenarios: Sequence[Path], postgres: bool) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpumeter-bench-storage-") as tmp:
        tmp_path = Path(tmp)
        after_path = tmp_path / "after.sqlite3"
        after_url = f"sqlite:///{after_path}"
        from services.billing.ledger import Ledger

        ledger = Ledger(after_url)
        ledger.migrate()
        ledger.close()
        for scenario in scenarios:
            replay_into(scenario, after_url, tmp_path / f"out-{scenario.stem}")
        days = gpu_days(after_url)
        before_path = tmp_path / "before.sqlite3"
        shutil.copy(after_path, before_path)
        to_revision(f"sqlite:///{before_path}", "0007_sharing")
        before, after = sqlite_figures(before_path), sqlite_figures(after_path)
        figures["scenarios"] = [s.name for s in scenarios]
        figures["gpu_days"] = round(days, 4)
        figures["sqlite"] = {
            "before_0007": before, "after_0008": after,
            "rows_per_gpu_day": {"before": round(before["cost_lines_rows"] / days),
                                 "after": round(after["cost_lines_rows"] / days)},
            "used_bytes_per_gpu_day": {"before": round(before["used_bytes"] / days),
                                       "after": round(after["used_bytes"] / days)},
            "file_bytes_per_gpu_day": {"before": round(before["file_bytes"] / days),
                                       "after": round(after["file_bytes"] / days)},
            "rows_ratio": round(after["cost_lines_rows"] / before["cost_lines_rows"], 3),
            "used_bytes_ratio": round(after["used_bytes"] / before["used_bytes"], 3),
            "file_bytes_ratio": round(after["file_bytes"] / before["file_bytes"], 3),
        }
        if postgres:
            pg = postgres_figures(after_url)
            figures["postgresql"] = {
                **pg,
                "bytes_per_gpu_day": {k: round(v["bytes"] / days) for k, v in pg.items()},
                "bytes_ratio": round(pg["after"]["bytes"] / pg["before"]["bytes"], 3),
            }
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", type=Path,
                        default=sorted(p for p in (REPO / "scenarios").glob("*.yaml") if p.name != "faults.yaml"))
    parser.add_argument("--postgres", action="store_true", help="also measure both shapes on PostgreSQL")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.scenarios, args.postgres), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
