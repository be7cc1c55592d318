"""Billing's CPU per node-window in two checkouts, as alternating subprocesses (A, B, B, A, ...), each the best of
3 runs of ``bench.billing``'s two workloads (repeating nodes, new nodes) on a fresh SQLite ledger, with the garbage
collector set as billing's main sets it.

``python -m bench.billing_ab TREE_A TREE_B [ROUNDS]`` (e.g. a worktree of main and this checkout). Each process
imports one tree only, so neither tree's modules, caches or allocations sit beside the other's: in this checkout
``bench.billing --baseline``'s in-process variants measured the same code 1.07-1.17x apart (docs/performance.md).
Prints the best CPU ms per node-window of each tree and workload.
"""

from __future__ import annotations

import json
import subprocess
import sys

# Each child sets the garbage collector as billing's main does (``gpumeter.entrypoint.tune_garbage_collector``): at
# CPython's default young threshold the bench spent ~2-3 ms per node-window in full collections the service does not
# make (docs/performance.md).
CHILD = r'''
import json, tempfile
from gpumeter.entrypoint import tune_garbage_collector
tune_garbage_collector()
from bench.billing import workload, run_once
out = {}
for name, work in (("repeating", workload("repeating", 50, 6)), ("new", workload("new", 300, 1))):
    best = float("inf")
    for _ in range(3):
        with tempfile.TemporaryDirectory() as d:
            run = run_once(work, f"sqlite:///{d}/ledger.sqlite3")
        best = min(best, run.cpu_s / work.node_windows * 1000)
    out[name] = best
print(json.dumps(out))
'''


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    trees = argv[:2]
    rounds = int(argv[2]) if len(argv) == 3 else 4
    results: dict[str, list[dict[str, float]]] = {tree: [] for tree in trees}
    for n in range(rounds):
        for tree in trees if n % 2 == 0 else trees[::-1]:
            done = subprocess.run([sys.executable, "-c", CHILD], cwd=tree, env={"PYTHONPATH": tree, "PATH": "/usr/bin:/bin"},
                                  capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-4000:], file=sys.stderr)
                return 1
            results[tree].append(json.loads(done.stdout.strip().splitlines()[-1]))
    for tree in trees:
        best = {name: round(min(r[name] for r in results[tree]), 3) for name in results[tree][0]}
        print(json.dumps({"tree": tree, "best_cpu_ms_per_node_window": best}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
