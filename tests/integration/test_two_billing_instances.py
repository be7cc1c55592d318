"""Two ``gpumeter billing`` processes with different consumer groups on one ledger: every cost record once.

Each instance reads every share and writes every node-window; the ledger keeps the first write. Before the ledger
arbitrated who publishes, the second writer of a node-window found its bill not yet marked published (the first
was still waiting for Kafka's acknowledgement) and published its cost records too: every record could reach the
costs topic twice. Now only the instance whose write inserted the node-window publishes it. On PostgreSQL (where
concurrent writers of one node-window meet on the bill's key). A SQLite file takes one billing only: a second one
on the same file is refused at start (``test_ledger_files.py::
test_a_report_and_a_second_billing_leave_running_billing_its_sqlite_ledger_whole``); the arbitration itself is also
checked on SQLite, in one process (``tests/unit/billing/test_ledger_sqlite.py``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from schemas.records import CostRecord
from services.billing.catalog import PriceCatalog
from services.billing.costing import bill_node_window
from services.billing.ledger import Ledger
from tests.integration.test_billing_stream import (  # noqa: F401 - ledger_url is a fixture
    ledger_url,
    produce_shares,
    sums_by_node_window,
    wait_until_committed_to_end,
)
from tests.integration.topic_reading import read_topic
from tests.unit.billing.conftest import sample_shares

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
WINDOWS = 15  # x 2 nodes: 30 node-windows, 150 cost records


class BillingProcess:
    """One ``gpumeter billing`` in a subprocess of its own, output to a log file."""

    def __init__(self, kafka_settings, ledger_url: str, group: str, log_path: Path) -> None:
        self.group = group
        self.log_path = log_path
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("GPUMETER_")},
                    "PYTHONPATH": str(REPO_ROOT)}
        self.command = [sys.executable, "-m", "gpumeter.cli", "billing", "--metrics-port", "0",
                        "--bootstrap-servers", kafka_settings.bootstrap_servers,
                        "--topic-prefix", kafka_settings.topic_prefix, "--partitions", "3",
                        "--ledger-url", ledger_url, "--group", group]
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(self.command, cwd=REPO_ROOT, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def wait_assigned(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "assigned [" not in self.log():
            assert self.process.poll() is None, self.log()[-4000:]
            assert time.monotonic() < deadline, self.log()[-4000:]
            await asyncio.sleep(0.2)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


async def two_instances_publish_each_record_once(kafka_settings, topic_catalog, url: str, tmp_path: Path) -> None:
    with Ledger(url) as ledger:
        ledger.migrate()  # ahead of both, so that their start-up migrations find nothing to do
    windows = sample_shares(WINDOWS)
    catalog = PriceCatalog.load()
    expected = [c for shares in windows for c in bill_node_window(shares, catalog).costs]
    tag = uuid.uuid4().hex[:6]
    instances = [BillingProcess(kafka_settings, url, f"billing-{name}-{tag}", tmp_path / f"{name}.log")
                 for name in ("one", "two")]
    try:
        for instance in instances:
            instance.start()
        for instance in instances:
            await instance.wait_assigned()
        await produce_shares(kafka_settings, topic_catalog.node_window_shares, windows)
        for instance in instances:
            await wait_until_committed_to_end(kafka_settings, instance.group, topic_catalog.node_window_shares,
                                              f"{instance.group} billed everything")
    finally:
        codes = [instance.stop() for instance in instances]
    assert codes == [0, 0], [instance.log()[-3000:] for instance in instances]

    costs = await read_topic(kafka_settings, topic_catalog.costs, CostRecord)
    keys = Counter((c.node_name, c.window_start_unix_ms, c.gpu_uuid or "", c.subject_kind.value, c.pod_uid or "")
                   for c in costs)
    twice = {key: n for key, n in keys.items() if n > 1}
    assert not twice, f"{len(twice)} of {len(keys)} cost records on the topic more than once"
    assert sorted(costs, key=repr) == sorted(expected, key=repr)
    with Ledger(url) as ledger:
        bills = {(b["node_name"], b["window_start_unix_ms"]): b for b in ledger.bills()}
        assert sums_by_node_window(costs) == {k: b["node_cost_micro_usd"] for k, b in bills.items()}
        # Each node-window was published by the group whose write inserted it, and marked so.
        assert {b["publisher"] for b in bills.values()} <= {i.group for i in instances}
        assert all(b["published_at_unix_ms"] is not None for b in bills.values())


@pytest.mark.postgres
async def test_two_billing_groups_on_postgres_publish_each_cost_record_once(kafka_settings, topic_catalog,
                                                                            ledger_url, tmp_path):
    await two_instances_publish_each_record_once(kafka_settings, topic_catalog, ledger_url, tmp_path)
