"""Billing: CPU per node-window of the billing service's whole path, in one process, and old code against new.

What is measured: bench node-windows (``bench.workload.Fleet``: 8 H100s × 8 time-sliced pods, through the
attribution engine once; 97 cost lines and one node bill each) as the attributor writes them (``NodeWindowShares``
single-object Avro), fed through ``BillingProcessor`` and ``LedgerStore`` on the one runner in memory
(``gpumeter.stream.memory.MemoryDriver``, ``batch_size`` messages per batch as a Kafka fetch hands them): decode
and check, price (``bill_node_window``), one ledger write per batch on a migrated SQLite file (WAL), the Prometheus
series (``ServiceMetrics`` with billing's metrics), the owed records encoded (``CostRecord`` and
``NodeWindowCost``) and the published mark. The broker is a ``MemoryBroker``: no network, no Kafka client.

Two workloads: **repeating** nodes (``nodes`` nodes for ``windows`` consecutive windows: their series exist after
the first) and **new** nodes (every node-window a node not seen before). The template node-window is cloned into
other nodes by renaming the node, its GPUs and its pods (so that series, ledger keys and pods are all distinct).

``--baseline REV`` (``python -m bench.billing --baseline main``) measures the code of another git revision in the
same process: its ``gpumeter``, ``schemas`` and ``services`` packages are extracted (``git archive``) and imported
under their own names into a separate set of modules, swapped into ``sys.modules`` while that variant runs, so the
two variants alternate (A, B, A, B, ... best of N CPU seconds) on the same input bytes. Each run's output (the
ledger's bills and cost lines as its readers see them -- two revisions may store them differently -- and every
produced record's bytes) is compared between the variants before any figure is
reported: a difference stops the run.

``--profile`` prints the top cumulative and internal costs (cProfile) of one run of the current code.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import importlib
import io
import pstats
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

REPO = Path(__file__).resolve().parent.parent
CODE_PACKAGES = ("gpumeter", "schemas", "services")
WINDOW_MS = 60_000
DEFAULT_BATCH = 50


# -- input ------------------------------------------------------------------------------------------------------


def template_shares() -> Any:
    """One bench node-window as the attributor writes it (``NodeWindowShares``)."""
    from bench.attribution import build_input, engine_with_pods, run_engine

    data = build_input(nodes=1, ticks=61)
    return next(record for record in run_engine(engine_with_pods(data), data.avro_messages)
                if record.window_start_unix_ms == data.fleet.start_unix_ms)


def clone(template: Any, node: int, window: int) -> Any:
    """``template`` as node number ``node`` (its GPUs and pods renamed with it) in window number ``window``."""
    suffix = f"-{node:05d}"
    pods = tuple(dataclasses.replace(p, pod_uid=p.pod_uid + suffix, pod_name=(p.pod_name or "") + suffix)
                 for p in template.pods)
    units = tuple(dataclasses.replace(u, gpu_uuid=u.gpu_uuid + suffix,
                                      parent_gpu_uuid=None if u.parent_gpu_uuid is None else u.parent_gpu_uuid + suffix)
                  for u in template.units)
    return dataclasses.replace(template, node_name=template.node_name + suffix,
                               window_start_unix_ms=template.window_start_unix_ms + window * WINDOW_MS,
                               pods=pods, units=units)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Encoded node-windows in stream order: (timestamp ms, key, value). All of one window share its timestamp."""

    name: str
    messages: tuple[tuple[int, bytes, bytes], ...]
    last_window_end_ms: int

    @property
    def node_windows(self) -> int:
        return len(self.messages)


def workload(name: str, nodes: int, windows: int, first_node: int = 0) -> Workload:
    from schemas.records import NodeWindowShares
    from schemas.typed import codec_for

    template = template_shares()
    codec = codec_for(NodeWindowShares)
    out = []
    for w in range(windows):
        for n in range(first_node, first_node + nodes):
            record = clone(template, n, w)
            out.append((record.window_end_unix_ms + 10_000, record.node_name.encode(), codec.encode(record)))
    return Workload(name, tuple(out), template.window_start_unix_ms + windows * WINDOW_MS)


# -- one run on the code now in sys.modules ---------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    cpu_s: float
    wall_s: float
    ledger_url: str
    produced: dict[str, list[tuple[bytes | None, bytes | None]]]


def prepare(work: Workload, url: str, batch_size: int) -> Any:
    """A migrated ledger at ``url`` and the billing service's driver over a broker holding ``work`` (not
    timed)."""
    from gpumeter.clock import ManualClock
    from gpumeter.metrics import ServiceMetrics
    from gpumeter.stream.memory import MemoryBroker, MemoryDriver
    from gpumeter.stream.runner import MessageRunner
    from schemas.catalog import TopicCatalog
    from services.billing.catalog import bundled_catalog
    from services.billing.ledger import Ledger
    from services.billing.service import (BILLING_METRICS, BillingProcessor, LedgerStore, billing_inputs,
                                          billing_outputs)

    ledger = Ledger(url)
    ledger.migrate()
    topics = TopicCatalog(prefix="bench.")
    broker = MemoryBroker()
    outputs = billing_outputs(topics)
    for topic in (topics.node_window_shares, *outputs.values()):
        broker.create(topic, 1)
    for timestamp, key, value in work.messages:
        broker.produce(topics.node_window_shares, key, value, timestamp_ms=timestamp, partition=0)
    clock = ManualClock(work.last_window_end_ms + 60_000)
    metrics = ServiceMetrics("billing", BILLING_METRICS)
    processor = BillingProcessor(catalog=bundled_catalog())
    store = LedgerStore(ledger, metrics=metrics)
    runner = MessageRunner(processor, billing_inputs(topics), clock, metrics=metrics)
    driver = MemoryDriver(runner, broker, outputs, store=store, batch_size=batch_size)
    return driver, ledger, outputs


def run_once(work: Workload, url: str, batch_size: int = DEFAULT_BATCH, profile: cProfile.Profile | None = None
             ) -> Run:
    driver, ledger, outputs = prepare(work, url, batch_size)
    gc.collect()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if profile is not None:
        profile.enable()
    count = driver.run()
    if profile is not None:
        profile.disable()
    cpu1, wall1 = time.process_time(), time.perf_counter()
    assert count == work.node_windows, (count, work.node_windows)
    produced = {role: [(m.key, m.value) for m in driver.broker.messages(topic, 0)] for role, topic in outputs.items()}
    ledger.close()
    return Run(cpu1 - cpu0, wall1 - wall0, url, produced)


def ledger_view(url: str) -> dict[str, list]:
    """Every bill (its columns but ``zero_lines``) and every cost line (``Ledger.iter_cost_lines``, as JSON) of
    the ledger at ``url``, read by the active code tree's ``Ledger``: what two variants must agree on."""
    from services.billing.costing import cost_record_json
    from services.billing.ledger import Ledger

    with Ledger(url) as ledger:
        bills = [{k: v for k, v in b.items() if k != "zero_lines"} for b in ledger.bills()]
        lines = [{**cost_record_json(c), "carried_label_keys": list(c.carried_label_keys)}
                 for c in ledger.iter_cost_lines()]
    return {"node_bills": bills, "cost_lines": sorted(lines, key=repr)}


class Databases:
    """A fresh ledger URL per run: a SQLite file in a temporary directory, or a new database on a throwaway
    PostgreSQL server (``gpumeter.devtools.postgres.PostgresServer``: fsync off, loopback)."""

    def __init__(self, postgres: bool) -> None:
        self.postgres = postgres
        self._tmp = tempfile.TemporaryDirectory(prefix="gpumeter-bench-billing-")
        self._count = 0
        self._server = None
        if postgres:
            from gpumeter.devtools.postgres import PostgresServer

            self._server = PostgresServer()
            self._server.__enter__()

    def new(self) -> str:
        self._count += 1
        if self._server is None:
            return f"sqlite:///{Path(self._tmp.name) / f'ledger-{self._count}.sqlite3'}"
        from sqlalchemy import create_engine, text
        from sqlalchemy.engine import make_url

        admin = create_engine(self._server.url, isolation_level="AUTOCOMMIT")
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "bench_billing_{self._count}"'))
        admin.dispose()
        return make_url(self._server.url).set(database=f"bench_billing_{self._count}").render_as_string(
            hide_password=False)

    def close(self) -> None:
        if self._server is not None:
            self._server.__exit__(None, None, None)
        self._tmp.cleanup()


# -- code trees ---------------------------------------------------------------------------------------------------


def _is_code(name: str) -> bool:
    return name.split(".", 1)[0] in CODE_PACKAGES


class CodeTree:
    """One revision's ``gpumeter``/``schemas``/``services`` modules, imported on their own (see the module
    docstring); ``active()`` swaps them into ``sys.modules`` for the code run inside it."""

    def __init__(self, name: str, root: Path | None) -> None:
        self.name = name
        self.root = root
        self.modules: dict[str, Any] = {}
        with self.active():
            for module in ("services.billing.service", "services.billing.ledger", "services.billing.catalog",
                           "gpumeter.stream.memory", "gpumeter.stream.runner", "gpumeter.metrics", "gpumeter.clock",
                           "schemas.typed", "schemas.catalog"):
                importlib.import_module(module)

    @contextmanager
    def active(self) -> Iterator[None]:
        saved = {n: m for n, m in sys.modules.items() if _is_code(n)}
        for n in saved:
            del sys.modules[n]
        sys.modules.update(self.modules)
        if self.root is not None:
            sys.path.insert(0, str(self.root))
        try:
            yield
        finally:
            if self.root is not None:
                sys.path.remove(str(self.root))
            self.modules = {n: m for n, m in sys.modules.items() if _is_code(n)}
            for n in self.modules:
                del sys.modules[n]
            sys.modules.update(saved)


def extract(revision: str, into: Path) -> Path:
    """The code packages of ``revision`` (git archive) under ``into``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", revision, *CODE_PACKAGES],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


# -- reports ------------------------------------------------------------------------------------------------------


def profile_run(work: Workload, databases: Databases, batch_size: int, top: int = 30) -> str:
    profile = cProfile.Profile()
    run = run_once(work, databases.new(), batch_size, profile)
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    print(f"{work.name}: {run.cpu_s / work.node_windows * 1000:.2f} ms CPU per node-window under cProfile", file=out)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def compare(work: Workload, trees: Sequence[CodeTree], databases: Databases, repeats: int, batch_size: int
            ) -> dict[str, Any]:
    """Alternate the trees ``repeats`` times on ``work``; best CPU per node-window of each and the ratio of the
    first to each other. Every run's ledger rows and produced bytes must equal the first tree's."""
    best: dict[str, float] = {t.name: float("inf") for t in trees}
    reference: tuple[Any, Any] | None = None
    for _ in range(repeats):
        for tree in trees:
            url = databases.new()
            with tree.active():
                run = run_once(work, url, batch_size)
                # What the ledger says (its readers' view), not how it stores it: two revisions may store
                # differently (revision 0008 keeps zero lines on their bill, labels in label_sets).
                outputs = (ledger_view(url), run.produced)
            if reference is None:
                reference = outputs
            elif outputs != reference:
                diff = [t for t in reference[0] if reference[0][t] != outputs[0].get(t)]
                diff += [r for r in reference[1] if reference[1][r] != outputs[1].get(r)]
                raise SystemExit(f"{work.name}: {tree.name}'s output differs from {trees[0].name}'s: {diff}")
            best[tree.name] = min(best[tree.name], run.cpu_s)
    per_window = {name: cpu / work.node_windows * 1000 for name, cpu in best.items()}
    first = trees[0].name
    return {"workload": work.name, "ledger": "postgresql" if databases.postgres else "sqlite",
            "node_windows": work.node_windows, "batch_size": batch_size, "repeats": repeats,
            "best_cpu_ms_per_node_window": {n: round(v, 3) for n, v in per_window.items()},
            "ratio_to_" + first: {n: round(v / per_window[first], 3) for n, v in per_window.items()}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="git revision to measure against, in the same process (e.g. main)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    parser.add_argument("--nodes", type=int, default=30, help="repeating workload: nodes (x --windows windows)")
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--new-nodes", type=int, default=300, help="new-nodes workload: node-windows")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top costs of one run")
    parser.add_argument("--only", choices=("repeating", "new"))
    parser.add_argument("--postgres", action="store_true", help="the ledger on a throwaway PostgreSQL server")
    args = parser.parse_args(argv)
    works = []
    if args.only in (None, "repeating"):
        works.append(workload("repeating", args.nodes, args.windows))
    if args.only in (None, "new"):
        works.append(workload("new", args.new_nodes, 1, first_node=10_000))
    databases = Databases(args.postgres)
    try:
        if args.profile:
            for work in works:
                print(profile_run(work, databases, args.batch))
            return 0
        with tempfile.TemporaryDirectory() as tmp:
            trees = [CodeTree("current", None)]
            if args.baseline:
                trees.insert(0, CodeTree(args.baseline, extract(args.baseline, Path(tmp))))
            for work in works:
                print(compare(work, trees, databases, args.repeats, args.batch), flush=True)
    finally:
        databases.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
