"""``gpumeter report`` against the real broker: node-windows the attributor emitted that are not in the ledger.

The ledger reconciles with itself whatever billing missed: a billing service that stopped, crash-loops or retries
one record forever leaves it consistent. The report therefore also reads what was emitted for its windows (the
node-window-shares topic, and billing's dead letters) and warns about every node-window that should be in the ledger and
is not, with why when billing said why; and it exits 1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from gpumeter import cli
from services.billing.costing import iso_utc
from services.billing.main import serve
from services.billing.settings import BillingSettings
from tests.integration.test_billing_stream import produce_shares, wait_until_committed_to_end
from tests.unit.billing.conftest import WINDOW_START_MS, sample_shares

pytestmark = [pytest.mark.integration]


async def test_the_report_warns_about_emitted_windows_that_are_not_in_the_ledger(kafka_settings, topic_catalog,
                                                                                 group_id, tmp_path, capsys):
    billed = sample_shares(1)  # 2 node-windows
    unpriced = [tuple(dataclasses.replace(s, instance_type="no-such-instance") for s in billed[0])]
    later = sample_shares(1, start_ms=WINDOW_START_MS + 60_000)  # emitted while billing is down
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    settings = BillingSettings(kafka=kafka_settings, ledger_url=ledger_url, consumer_group=group_id, metrics_port=0,
                               topic_partitions=3)
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, stop=stop))
    try:
        await produce_shares(kafka_settings, topic_catalog.node_window_shares, billed)
        await produce_shares(kafka_settings, topic_catalog.node_window_shares,
                             [tuple(dataclasses.replace(s, node_name="node-unpriced") for s in unpriced[0])])
        await wait_until_committed_to_end(kafka_settings, group_id, topic_catalog.node_window_shares,
                                          "the billed windows")
    finally:
        stop.set()
        assert await asyncio.wait_for(service, 30) == 0
    await produce_shares(kafka_settings, topic_catalog.node_window_shares, later)

    async def report(*extra: str) -> tuple[int, dict]:
        # As a command line runs it: in a thread of its own, outside this test's event loop.
        code = await asyncio.to_thread(cli.main, ["report", "--format", "json", "--window", "1h", "--ledger-url",
                                                  ledger_url, "--end", iso_utc(WINDOW_START_MS + 10 * 60_000), *extra])
        return code, json.loads(capsys.readouterr().out)

    # The ledger on its own reconciles, and says it could not check what was emitted.
    code, alone = await report()
    assert code == 0 and alone["reconciliation"]["reconciled"] is True and alone["emitted"] is None

    code, checked = await report("--bootstrap-servers", kafka_settings.bootstrap_servers, "--topic-prefix",
                           kafka_settings.topic_prefix, "--settle-seconds", "0")
    assert code == 1
    assert checked["reconciliation"]["reconciled"] is True  # what is in the ledger still adds up
    emitted = checked["emitted"]
    assert emitted["node_windows"] == 5
    missing = {(m["node"], m["window_start"], tuple(m["dead_letter_reasons"])) for m in emitted["missing_from_ledger"]}
    assert missing == {("node-unpriced", iso_utc(WINDOW_START_MS), ("NO_PRICE",))} | {
        (s[0].node_name, iso_utc(s[0].window_start_unix_ms), ()) for s in later}
    assert emitted["statement"].startswith("WARNING: 3 of 5 node-windows emitted")
    assert "2 never billed" in emitted["statement"] and "NO_PRICE 1" in emitted["statement"]

    # Emitted a moment ago is in flight, not missing.
    code, settling = await report("--bootstrap-servers", kafka_settings.bootstrap_servers, "--topic-prefix",
                            kafka_settings.topic_prefix, "--settle-seconds", "3600")
    assert code == 0 and settling["emitted"]["missing_from_ledger"] == [] and settling["emitted"]["in_flight"] == 3
