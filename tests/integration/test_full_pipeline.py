"""The whole pipeline as separate processes on the real broker: ``gpumeter run`` over ``scenarios/demo.yaml``.

``gpumeter run --no-live`` runs on the session broker under a topic prefix of this test's own: three simulated
collectors (exclusive H100s, a time-sliced L4, a MIG A100), the attributor, billing with its SQLite ledger and the
guard, each its own OS process. As soon as the first shares are out, the attributor is killed with SIGKILL; the
run's supervisor starts it again and the run carries on to its end, then stops everything and prints its report.

What must hold, read back from the topics and the ledger:

* shares conserve: every (node, window, GPU unit) has exactly its ``rows_in_unit`` rows, whose memory, compute
  and cost shares each add up to 1, and every node-window has its ``units_in_node`` units; a window emitted twice
  (once by the killed worker, again by its successor) is the same window;
* costs reconcile to the node prices: the ledger's cost lines add up to its node bills, per node-window and in
  total; each bill is the bundled catalog's hourly price × the billed seconds (the node's covered seconds the
  shares carry), rounded half up to the micro-dollar; the costs topic holds exactly the ledger's lines;
* the kill left no gap and no duplicate: per node every window from the first (the simulated start) to the last
  is billed, including windows the restarted attributor closed; ledger keys are unique, and no node-window was
  costed two different ways;
* the leaky pod (``scratch/debug-shell``, ``NVIDIA_VISIBLE_DEVICES=all``, running on another pod's GPU) raises
  ``visibility_leak`` on the violations topic.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from fractions import Fraction
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer

from gpumeter.settings import KafkaSettings
from schemas.catalog import TopicCatalog
from schemas.records import CostRecord, GpuShare, NodeSample, NodeWindowShares, Violation, ViolationState
from schemas.typed import codec_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "scenarios" / "demo.yaml"
RUN_SECONDS = 45
TIME_SCALE = 10
WINDOW_SECONDS = 60
WINDOW_MS = WINDOW_SECONDS * 1000


class Topics:
    """The run's node-samples, node-window-shares, costs and violations topics, read from the beginning as they fill."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.catalog = TopicCatalog(prefix=settings.topic_prefix)
        self.consumer = AIOKafkaConsumer(
            self.catalog.node_window_shares, self.catalog.costs, self.catalog.violations, self.catalog.node_samples,
            **settings.client_kwargs(),
            group_id=None, auto_offset_reset="earliest", enable_auto_commit=False,
        )
        self.shares: list[GpuShare] = []
        self.costs: list[CostRecord] = []
        self.violations: list[Violation] = []
        self.first_sample_ms: dict[str, int] = {}  # per node, the first tick its collector published

    async def poll(self, timeout_ms: int = 200) -> int:
        batch = await self.consumer.getmany(timeout_ms=timeout_ms)
        count = 0
        for tp, records in batch.items():
            for record in records:
                count += 1
                if tp.topic == self.catalog.node_window_shares:
                    self.shares.extend(codec_for(NodeWindowShares).decode(record.value).rows())
                elif tp.topic == self.catalog.costs:
                    self.costs.append(codec_for(CostRecord).decode(record.value))
                elif tp.topic == self.catalog.node_samples:
                    sample = codec_for(NodeSample).decode(record.value)
                    first = self.first_sample_ms.get(sample.node_name, sample.sampled_at_unix_ms)
                    self.first_sample_ms[sample.node_name] = min(first, sample.sampled_at_unix_ms)
                elif record.value is not None:
                    self.violations.append(codec_for(Violation).decode(record.value))
        return count

    async def drain(self, idle_s: float = 3.0) -> None:
        last_new = time.monotonic()
        while time.monotonic() - last_new < idle_s:
            if await self.poll(300):
                last_new = time.monotonic()


def _processes(workdir: Path) -> dict[str, dict]:
    path = workdir / "processes.json"
    if not path.exists():
        return {}
    return {p["name"]: p for p in json.loads(path.read_text())["processes"]}


def _output(log_path: Path) -> str:
    return log_path.read_text(errors="replace") if log_path.exists() else ""


async def test_the_pipeline_conserves_shares_reconciles_costs_and_survives_an_attributor_kill(kafka_bootstrap,
                                                                                              tmp_path):
    from gpumeter.commands.run.plan import guard_available

    assert guard_available(), "the guard service is part of the pipeline"
    prefix = f"e2e{uuid.uuid4().hex[:8]}."
    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, client_id="gpumeter-test")
    workdir = tmp_path / "run"
    log_path = tmp_path / "run.log"
    command = [sys.executable, "-m", "gpumeter.cli", "run", "--no-live", "--duration", str(RUN_SECONDS),
               "--time-scale", str(TIME_SCALE), "--window-seconds", str(WINDOW_SECONDS),
               "--scenario", str(SCENARIO), "--bootstrap-servers", kafka_bootstrap, "--topic-prefix", prefix,
               "--workdir", str(workdir), "--progress-seconds", "5"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMETER_")}
    with log_path.open("w") as log:
        orchestrator = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    topics = Topics(settings)
    try:
        deadline = time.monotonic() + 60
        while not (workdir / "run.json").exists() or not _processes(workdir):
            assert orchestrator.poll() is None, _output(log_path)[-4000:]
            assert time.monotonic() < deadline, _output(log_path)[-4000:]
            await asyncio.sleep(0.2)
        await topics.consumer.start()

        # The first shares are out: kill the attributor that wrote them, mid-run.
        deadline = time.monotonic() + 60
        while not topics.shares:
            assert orchestrator.poll() is None, _output(log_path)[-4000:]
            assert time.monotonic() < deadline, "no shares within 60 s\n" + _output(log_path)[-4000:]
            await topics.poll()
        first_attributor = _processes(workdir)["attributor"]
        os.kill(first_attributor["pid"], signal.SIGKILL)
        shares_before_kill = len(topics.shares)
        newest_before_kill = max(s.window_start_unix_ms for s in topics.shares)

        # The run's supervisor starts it again.
        deadline = time.monotonic() + 30
        while _processes(workdir)["attributor"]["restarts"] < 1:
            assert time.monotonic() < deadline, "the attributor was not restarted\n" + _output(log_path)[-4000:]
            await topics.poll()
        second_attributor = _processes(workdir)["attributor"]
        assert second_attributor["pid"] != first_attributor["pid"]

        deadline = time.monotonic() + RUN_SECONDS + 120
        while orchestrator.poll() is None:
            assert time.monotonic() < deadline, "the run did not end\n" + _output(log_path)[-4000:]
            await topics.poll()
        await topics.drain()
    finally:
        if orchestrator.poll() is None:
            orchestrator.send_signal(signal.SIGINT)
            try:
                orchestrator.wait(60)
            except subprocess.TimeoutExpired:
                orchestrator.kill()
        await topics.consumer.stop()

    output = _output(log_path)
    assert orchestrator.returncode == 0, output[-6000:]
    run_info = json.loads((workdir / "run.json").read_text())
    processes = _processes(workdir)
    assert processes["attributor"]["restarts"] == 1
    assert all(p["state"] == "stopped" and p["exit_code"] == 0 for p in processes.values()), processes
    assert {name for name in processes} == {
        "collector gpu-p5-a", "collector gpu-g6-ts", "collector gpu-a100-mig", "attributor", "billing", "guard"}

    # -- shares conserve ------------------------------------------------------------------------------------------
    rows: dict[tuple[str, int, str], dict[tuple[str, str], GpuShare]] = defaultdict(dict)
    for share in topics.shares:
        key = (share.node_name, share.window_start_unix_ms, share.gpu_uuid)
        identity = (share.subject_kind.value, share.pod_uid or "")
        first = rows[key].setdefault(identity, share)
        assert first == share, f"{key} {identity} emitted twice with different values"
    units_per_window: dict[tuple[str, int], set[str]] = defaultdict(set)
    for (node, start, gpu), unit_rows in rows.items():
        sample = next(iter(unit_rows.values()))
        assert len(unit_rows) == sample.rows_in_unit, (node, start, gpu)
        for field in ("memory_share", "compute_share", "cost_share"):
            total = sum(getattr(r, field) for r in unit_rows.values())
            assert abs(total - 1.0) <= 1e-9, (node, start, gpu, field, total)
        units_per_window[(node, start)].add(gpu)
    for (node, start), units in units_per_window.items():
        in_node = {r.units_in_node for (n, s, _), unit_rows in rows.items() if (n, s) == (node, start)
                   for r in unit_rows.values()}
        assert in_node == {len(units)}, (node, start)
    assert {r.sharing_mode.value for unit_rows in rows.values() for r in unit_rows.values()} == {
        "EXCLUSIVE", "TIME_SLICING", "MIG"}
    after_kill = topics.shares[shares_before_kill:]
    assert any(s.window_start_unix_ms > newest_before_kill + WINDOW_MS for s in after_kill), \
        "the restarted attributor closed no further window"

    # -- costs reconcile to the node prices -----------------------------------------------------------------------
    from services.billing.catalog import bundled_catalog
    from services.billing.ledger import Ledger

    catalog = bundled_catalog()
    with Ledger(run_info["ledger_url"]) as ledger:
        bills = ledger.bills()
        lines = list(ledger.iter_cost_lines())
        totals = ledger.totals()
    assert bills and lines
    assert totals.cost_micro_usd == totals.bill_micro_usd == sum(b["node_cost_micro_usd"] for b in bills)
    lines_by_window: dict[tuple[str, int], list[CostRecord]] = defaultdict(list)
    for line in lines:
        lines_by_window[(line.node_name, line.window_start_unix_ms)].append(line)
    covered = {(s.node_name, s.window_start_unix_ms): s.node_covered_seconds for s in topics.shares}
    for bill in bills:
        key = (bill["node_name"], bill["window_start_unix_ms"])
        assert sum(line.cost_micro_usd for line in lines_by_window[key]) == bill["node_cost_micro_usd"], key
        row = catalog.row(bill["provider"], bill["region"], bill["instance_type"], bill["price_model"])
        assert row is not None, key
        # Billed time: the seconds the attributor covered, to the millisecond, at most the window.
        assert bill["billed_milliseconds"] == min(math.floor(covered[key] * 1000 + 0.5), WINDOW_MS), key
        exact_micro_usd = Fraction(row.price_per_hour_usd) * bill["billed_milliseconds"] * 1_000_000 / 3_600_000
        assert bill["node_cost_micro_usd"] == math.floor(exact_micro_usd + Fraction(1, 2)), key  # half up
    instance_types = {b["instance_type"] for b in bills}
    assert instance_types == {"p5.48xlarge", "g6.xlarge", "Standard_NC24ads_A100_v4"}
    # Every node-window the attributor emitted was billed, and nothing else.
    assert set(lines_by_window) == {(b["node_name"], b["window_start_unix_ms"]) for b in bills}
    assert {(b["node_name"], b["window_start_unix_ms"]) for b in bills} == set(units_per_window)
    # The costs topic carries exactly the ledger's lines (a re-sent line would have to be identical).
    topic_lines: dict[tuple, CostRecord] = {}
    for cost in topics.costs:
        key = (cost.node_name, cost.window_start_unix_ms, cost.gpu_uuid or "", cost.subject_kind.value,
               cost.pod_uid or "")
        assert topic_lines.setdefault(key, cost) == cost, f"two different cost lines for {key}"
    ledger_lines = {(l.node_name, l.window_start_unix_ms, l.gpu_uuid or "", l.subject_kind.value, l.pod_uid or ""): l
                    for l in lines}
    assert len(ledger_lines) == len(lines)  # ledger keys are unique
    assert topic_lines == ledger_lines
    assert "reconciled, equal to the micro-dollar" in output
    assert "MISMATCH" not in output

    # -- no gap, no duplicate across the kill ---------------------------------------------------------------------
    starts_by_node: dict[str, list[int]] = defaultdict(list)
    for bill in bills:
        starts_by_node[bill["node_name"]].append(bill["window_start_unix_ms"])
    assert set(starts_by_node) == set(run_info["nodes"])
    simulated_start = run_info["simulated_start_unix_ms"]
    for node, starts in starts_by_node.items():
        assert len(starts) == len(set(starts)), node
        starts.sort()
        # Billed from the window of the node's first tick: the scenario clock runs from the run's start, so a
        # collector that took longer to start (a loaded machine) has its first tick in a later window.
        first_tick_ms = topics.first_sample_ms[node]
        assert first_tick_ms >= simulated_start, node
        assert starts[0] == first_tick_ms - (first_tick_ms - simulated_start) % WINDOW_MS, (node, first_tick_ms)
        assert starts == list(range(starts[0], starts[-1] + WINDOW_MS, WINDOW_MS)), f"{node} has a gap: {starts}"
        assert starts[-1] > newest_before_kill + WINDOW_MS, f"{node}: no window after the kill"

    # -- the leaky pod raises visibility_leak ---------------------------------------------------------------------
    leaks = [v for v in topics.violations if v.rule == "visibility_leak" and v.state is ViolationState.FIRING]
    assert leaks, [(v.rule, v.state, v.pod_name) for v in topics.violations]
    assert {(v.namespace, v.pod_name, v.node_name) for v in leaks} == {("scratch", "debug-shell", "gpu-p5-a")}
    assert all(v.severity.value == "CRITICAL" for v in leaks)
    assert "violations firing" in output and "visibility_leak" in output
