"""The hourly FOCUS grain, A/B in one run (issue 24): the FOCUS export at hourly grain of the same ledger by the code
of two trees, and (``--layouts``) the bytes per ``focus_line_hourly`` row at revision 0015 (text columns) against
0017 (ids).

One ledger is written through ``Ledger.write`` at head (``bench.ledger_month``'s fleet: ``--nodes`` nodes,
``--minutes`` minutes), filled to ``--days`` days (``ledger_month.fill_month``: the written hours' rows copied by
SQL) and exported ``--rounds`` times by the code of ``--old-tree`` (an extracted copy of the commit before, e.g.
``git archive main | tar -x -C DIR``) and by this tree, alternating which goes first, each in a subprocess of its
own (``gpumeter export focus`` as a function: ``focus_export`` into Parquet, grain auto; this tree's with
``--workers`` worker processes where its ``focus_export`` has them), timed inside: wall, the process's CPU and its
worker processes' CPU. The two Parquet files are compared (rows and bytes). ``--profile`` runs one more export of
this tree's under cProfile and prints the top functions.

``--layouts`` (the 0017 A/B): the ledger is cloned (``CREATE DATABASE ... TEMPLATE``) and the clone taken down to
0015 (0016's downgrade moves the rows back to the text table); each is ``VACUUM FULL``-ed and its hourly FOCUS
lines' bytes (heap and index, per row) and charges' bytes measured, and the old tree exports the 0015 clone (an
old tree that reads 0015's text layout).

``python -m bench.focus_ab --old-tree /tmp/base --nodes 125 --minutes 60 --days 2`` (prints JSON).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HOUR_MS = 3_600_000
REPO = Path(__file__).resolve().parent.parent

# What the subprocess runs: the month's export as ``gpumeter export focus --out X.parquet`` makes it.
_EXPORT = """
import json, sys, time
from services.billing.ledger import Ledger
from services.billing.export import focus_export
from services.billing.focus import write_focus_parquet_chunks
from pathlib import Path
import inspect, os, resource
url, start, end, out, profile = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
workers = int(sys.argv[6])
options = {"workers": workers} if "workers" in inspect.signature(focus_export).parameters else {}
def run():
    with Ledger(url) as ledger:
        grain, chunks = focus_export(ledger, start_ms=start, end_ms=end, **options)
        return grain.describe(), write_focus_parquet_chunks(chunks, Path(out), metadata={"gpumeter_grain": grain.grain})
if __name__ == "__main__":
    started, cpu = time.perf_counter(), time.process_time()
    load = os.getloadavg()[0]
    if profile:
        import cProfile, pstats
        profiler = cProfile.Profile()
        grain, rows = profiler.runcall(run)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    else:
        grain, rows = run()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu,
                      "workers_cpu_s": children.ru_utime + children.ru_stime, "grain": grain, "rows": rows,
                      "workers": options.get("workers", 1), "load_before": load, "load_after": os.getloadavg()[0]}))
"""


def _export(tree: Path, url: str, start_ms: int, end_ms: int, out: Path, profile: bool = False,
            workers: int = 1) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", _EXPORT, url, str(start_ms), str(end_ms), str(out),
                           "1" if profile else "", str(workers)], cwd=tree, env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode:
        raise RuntimeError(f"export in {tree} failed: {done.stderr[-3000:]}")
    if profile:
        sys.stderr.write(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _line_bytes(connection: Any, tables: tuple[str, ...]) -> dict[str, Any]:
    from sqlalchemy import text

    from bench.ledger_month import table_bytes

    sizes = table_bytes(connection)
    rows = int(connection.execute(text("SELECT count(*) FROM focus_line_hourly")).scalar_one())
    charges = int(connection.execute(text("SELECT count(*) FROM focus_charge_hourly")).scalar_one())
    line_bytes = sum(sizes.get(name, 0) for name in tables)
    return {"line_rows": rows, "line_bytes": line_bytes, "bytes_per_line_row": round(line_bytes / rows, 1),
            "charge_rows": charges, "charge_bytes": sizes["focus_charge_hourly"],
            "bytes_per_charge_row": round(sizes["focus_charge_hourly"] / charges, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-tree", type=Path, required=True)
    parser.add_argument("--nodes", type=int, default=125)
    parser.add_argument("--minutes", type=int, default=60)
    parser.add_argument("--days", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--workers", type=int, default=1, help="this tree's export's worker processes (default 1)")
    parser.add_argument("--layouts", action="store_true",
                        help="the 0015 text layout against 0017's ids: the old tree exports a 0015 clone")
    args = parser.parse_args(argv)

    from alembic import command
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from bench.ledger_month import MonthFleet, fill_month, ingest
    from gpumeter.devtools.postgres import PostgresServer
    from services.billing.ledger import Ledger, _alembic_config

    fleet = MonthFleet(args.nodes)
    out: dict[str, Any] = {"nodes": args.nodes, "gpus": fleet.gpus, "minutes": args.minutes, "days": args.days}
    with PostgresServer() as server:
        admin = create_engine(server.url, isolation_level="AUTOCOMMIT")
        urls = {name: make_url(server.url).set(database=name).render_as_string(hide_password=False)
                for name in ("focus_new", "focus_old")}
        try:
            with admin.connect() as connection:
                connection.execute(text('CREATE DATABASE "focus_new"'))
            ledger = Ledger(urls["focus_new"])
            ledger.migrate()
            written = ingest(ledger, fleet, 0, args.minutes)
            ledger.close()
            out["node_windows_per_s_head"] = round(written.node_windows_per_s, 1)
            new = create_engine(urls["focus_new"])
            engines = [new]
            if args.layouts:
                with admin.connect() as connection:
                    connection.execute(text('CREATE DATABASE "focus_old" TEMPLATE "focus_new"'))
                old = create_engine(urls["focus_old"])
                with old.begin() as connection:
                    command.downgrade(_alembic_config(connection), "0015_focus_hourly")
                layouts = {}
                for name, engine, tables in (("0015_text", old, ("focus_line_hourly",)),
                                             ("0017_ids", new, ("focus_line_hourly_rows",))):
                    with engine.connect() as connection:
                        connection.execution_options(isolation_level="AUTOCOMMIT").execute(
                            text("VACUUM FULL ANALYZE"))
                        layouts[name] = _line_bytes(connection, tables)
                out["layouts"] = layouts
                out["bytes_per_line_row_ratio_old_over_new"] = round(
                    layouts["0015_text"]["bytes_per_line_row"] / layouts["0017_ids"]["bytes_per_line_row"], 2)
                engines.append(old)
            else:
                urls["focus_old"] = urls["focus_new"]  # both trees export the one ledger
            for engine in engines:
                with engine.begin() as connection:
                    fill_month(connection, first_window_ms=fleet.start_unix_ms, hours_written=args.minutes // 60,
                               days=args.days)
                engine.dispose()
            start, end = fleet.start_unix_ms, fleet.start_unix_ms + args.days * 24 * HOUR_MS
            runs: dict[str, list] = {"old": [], "new": []}
            with tempfile.TemporaryDirectory() as folder:
                files = {"old": Path(folder) / "old.parquet", "new": Path(folder) / "new.parquet"}
                trees = {"old": args.old_tree.resolve(), "new": REPO}
                dbs = {"old": urls["focus_old"], "new": urls["focus_new"]}
                for index in range(args.rounds):
                    for side in (("old", "new") if index % 2 == 0 else ("new", "old")):
                        runs[side].append(_export(trees[side], dbs[side], start, end, files[side],
                                                  workers=args.workers if side == "new" else 1))
                digests = {side: hashlib.sha256(path.read_bytes()).hexdigest()[:16] for side, path in files.items()}
                import pyarrow.parquet as pq

                tables = {side: pq.read_table(path) for side, path in files.items()}
                out["export"] = {
                    side: {"s_by_round": [round(r["s"], 2) for r in runs[side]],
                           "cpu_s_by_round": [round(r["cpu_s"], 2) for r in runs[side]],
                           "workers_cpu_s_by_round": [round(r["workers_cpu_s"], 2) for r in runs[side]],
                           "load_by_round": [round(r["load_before"], 1) for r in runs[side]],
                           "workers": runs[side][0]["workers"], "rows": runs[side][0]["rows"],
                           "grain": runs[side][0]["grain"], "parquet_sha256_16": digests[side]}
                    for side in runs}
                out["export"]["same_rows"] = tables["old"].equals(tables["new"])
                out["export"]["same_bytes"] = digests["old"] == digests["new"]
                best = {side: min(r["s"] for r in runs[side]) for side in runs}
                out["export"]["ratio_old_over_new"] = round(best["old"] / best["new"], 2)
                # The client's CPU, its workers' included (the export is Python-bound; a shared machine's wall
                # time is not).
                cpu = {side: min(r["cpu_s"] + r["workers_cpu_s"] for r in runs[side]) for side in runs}
                out["export"]["cpu_ratio_old_over_new"] = round(cpu["old"] / cpu["new"], 2)
                if args.profile:
                    _export(REPO, dbs["new"], start, end, files["new"], profile=True)
        finally:
            admin.dispose()
    out["measured_at_utc"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
