"""``Ledger.write`` of two code trees, A/B batch by batch in one run (issue 24's ingest): the same fleet minutes
(``bench.ledger_month``'s 1,000-GPU fleet) written through each tree's ``Ledger.write`` into a ledger of its own
on one PostgreSQL server, alternating every batch.

Each tree runs in a worker process of its own (``PYTHONPATH`` = the tree; the old one an extracted copy, e.g.
``git archive main | tar -x -C /tmp/ingest_base``), which migrates its ledger to its head, prices the fleet's
minutes and then writes batch ``i`` when told; the driver tells the two in turn, the first swapped every batch, so
this machine's drifting load falls on both alike. Per tree: ms per node-window of the write's wall time and of
the worker's CPU (median and best), and the node-windows per second over all its batches. Then the two ledgers'
contents are compared: every table and view the ledger has (``CONTENT``), each as the MD5 of its rows' text in
order -- the writes must leave the same ledger, byte for byte, ids included.

``python -m bench.ingest_ab --old-tree /tmp/ingest_base --minutes 8 --warmup-minutes 2`` (prints JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# Every relation whose rows a reader sees (the views and the tables under them), compared after the run.
CONTENT = ("cost_lines", "cost_line_packs", "node_bills", "node_bill_rows", "label_sets", "price_versions",
           "ledger_nodes", "ledger_gpus", "ledger_pods", "ledger_line_kinds", "ledger_bill_kinds",
           "ledger_bill_names", "ledger_zero_sets", "cost_rollup_hourly", "cost_rollup_daily", "bill_rollup_hourly",
           "bill_rollup_daily", "pod_rollup_hourly", "pod_rollup_daily", "focus_charge_hourly", "focus_line_hourly",
           "focus_line_hourly_rows")

# The worker: one tree's Ledger.write, batch by batch on command (a JSON line in, a JSON line out).
_WORKER = """
import json, sys, time
from bench.ledger_month import MonthFleet
from services.billing.ledger import Ledger
url, nodes, warmup, minutes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
fleet = MonthFleet(nodes)
ledger = Ledger(url)
ledger.migrate()
for batch in fleet.batches(0, warmup):
    ledger.write([c for w in batch for c in w.costs], [w.bill for w in batch])
batches = [([c for w in b for c in w.costs], [w.bill for w in b]) for b in fleet.batches(warmup, minutes)]
print(json.dumps({"batches": len(batches)}), flush=True)
for line in sys.stdin:
    index = json.loads(line)["batch"]
    costs, bills = batches[index]
    started, cpu = time.perf_counter(), time.process_time()
    result = ledger.write(costs, bills)
    wall_ms, cpu_ms = (time.perf_counter() - started) * 1000, (time.process_time() - cpu) * 1000
    if result.bills_written != len(bills):
        raise SystemExit(f"{result.bills_written} of {len(bills)} new bills written")
    print(json.dumps({"wall_ms": wall_ms, "cpu_ms": cpu_ms, "node_windows": len(bills)}), flush=True)
ledger.close()
"""


def _worker(tree: Path, url: str, nodes: int, warmup: int, minutes: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen([sys.executable, "-c", _WORKER, url, str(nodes), str(warmup), str(minutes)],
                            cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _ask(worker: subprocess.Popen, message: dict[str, Any] | None = None) -> dict[str, Any]:
    assert worker.stdin is not None and worker.stdout is not None
    if message is not None:
        worker.stdin.write(json.dumps(message) + "\n")
        worker.stdin.flush()
    line = worker.stdout.readline()
    if not line:
        raise RuntimeError(f"a worker ended (exit {worker.wait()})")
    return json.loads(line)


def content_digests(url: str) -> dict[str, str]:
    """MD5 of each ``CONTENT`` relation's rows (their text, in order)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return {name: connection.execute(text(
                f"SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) || ':' || count(*) "
                f"FROM {name} t")).scalar_one() for name in CONTENT}
    finally:
        engine.dispose()


def run_ab(old_tree: Path, new_tree: Path, *, nodes: int, warmup_minutes: int, minutes: int) -> dict[str, Any]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from gpumeter.devtools.postgres import PostgresServer

    trees = {"old": old_tree, "new": new_tree}
    with PostgresServer() as server:
        admin = create_engine(server.url, isolation_level="AUTOCOMMIT")
        urls = {}
        with admin.connect() as connection:
            for name in trees:
                connection.execute(text(f'CREATE DATABASE "ab_{name}"'))
                urls[name] = make_url(server.url).set(database=f"ab_{name}").render_as_string(hide_password=False)
        admin.dispose()
        workers = {name: _worker(tree, urls[name], nodes, warmup_minutes, minutes) for name, tree in trees.items()}
        try:
            counts = {name: _ask(worker)["batches"] for name, worker in workers.items()}
            if len(set(counts.values())) != 1:
                raise RuntimeError(f"the trees' fleets differ: {counts}")
            wall: dict[str, list[float]] = {name: [] for name in trees}
            cpu: dict[str, list[float]] = {name: [] for name in trees}
            load = [os.getloadavg()[0]]
            started = time.monotonic()
            for index in range(counts["old"]):
                order = list(trees) if index % 2 == 0 else list(trees)[::-1]
                for name in order:
                    answer = _ask(workers[name], {"batch": index})
                    wall[name].append(answer["wall_ms"] / answer["node_windows"])
                    cpu[name].append(answer["cpu_ms"] / answer["node_windows"])
                if index % 5 == 4:
                    load.append(os.getloadavg()[0])
            elapsed = time.monotonic() - started
        finally:
            for worker in workers.values():
                if worker.stdin is not None:
                    worker.stdin.close()
            for worker in workers.values():
                worker.wait(timeout=120)
        digests = {name: content_digests(url) for name, url in urls.items()}
    out: dict[str, Any] = {"nodes": nodes, "warmup_minutes": warmup_minutes, "minutes": minutes,
                           "batches": counts["old"], "seconds": round(elapsed, 1),
                           "load_1min": {"min": min(load), "max": max(load)}}
    for name in trees:
        out[name] = {"median_ms_per_node_window": round(statistics.median(wall[name]), 3),
                     "best_ms_per_node_window": round(min(wall[name]), 3),
                     "cpu_median_ms_per_node_window": round(statistics.median(cpu[name]), 3),
                     "node_windows_per_s": round(len(wall[name]) * 1000 / sum(wall[name]), 1)}
    out["new_over_old"] = {key: round(out["new"][key] / out["old"][key], 3)
                           for key in ("median_ms_per_node_window", "cpu_median_ms_per_node_window",
                                       "node_windows_per_s")}
    differing = sorted(name for name in CONTENT if digests["old"][name] != digests["new"][name])
    out["contents_identical"] = not differing
    out["differing"] = differing
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-tree", type=Path, required=True, help="an extracted copy of the code to compare")
    parser.add_argument("--new-tree", type=Path, default=REPO)
    parser.add_argument("--nodes", type=int, default=125)
    parser.add_argument("--warmup-minutes", type=int, default=2)
    parser.add_argument("--minutes", type=int, default=8)
    args = parser.parse_args(argv)
    result = run_ab(args.old_tree.resolve(), args.new_tree.resolve(), nodes=args.nodes,
                    warmup_minutes=args.warmup_minutes, minutes=args.minutes)
    print(json.dumps(result, indent=2))
    return 0 if result["contents_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
