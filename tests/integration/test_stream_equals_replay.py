"""The streaming attributor and billing through the real broker equal ``gpumeter replay`` on the same scenario:
the same share rows, then -- billing reading the attributor's node-window records -- the same cost lines, the same
bills in the ledger, and each bill's ``NodeWindowCost`` holding exactly its lines.

The scenario's clock is moved to just before now, so the worker's wall clock and the replay's scenario clock agree
on which pods are still within their linger time; everything else is the scenario as shipped.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from pathlib import Path

import pytest

from gpumeter.kafka.producer import RecordProducer
from schemas.catalog import partition_for_node, pod_event_key
from gpumeter.clock import iso_utc
from schemas.records import CostRecord, DeadLetter, NodeSample, NodeWindowCost, NodeWindowShares
from schemas.typed import codec_for
from pipeline.recordings import scenario_records
from pipeline.replay import read_jsonl, replay, share_json
from services.billing.costing import cost_record_json
from services.billing.ledger import Ledger
from services.billing.main import serve as serve_billing
from services.billing.settings import BillingSettings
from simulator.scenario import load_scenario
from tests.integration.test_attributor_stream import PARTITIONS, AttributorProcess, Outputs
from tests.integration.test_billing_stream import wait_until_committed_to_end
from tests.integration.topic_reading import read_topic

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WINDOW_S, GRACE_S = 20, 2


def codec_windows(letters: list[DeadLetter]) -> list[NodeWindowShares]:
    """The node-windows billing's dead letters hold (whole: none of these is cut to fit)."""
    assert not any(d.truncated for d in letters)
    return [codec_for(NodeWindowShares).decode(d.raw_bytes) for d in letters]


def _shifted_scenario(tmp_path: Path) -> Path:
    text = (REPO / "scenarios" / "two_nodes.yaml").read_text()
    start = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=3)).replace(microsecond=0)
    shifted = text.replace('start: "2026-07-01T00:00:00Z"', f'start: "{start.strftime("%Y-%m-%dT%H:%M:%SZ")}"')
    assert shifted != text
    path = tmp_path / "two_nodes_now.yaml"
    path.write_text(shifted)
    return path


async def test_streaming_shares_and_costs_equal_replay_on_a_scenario(kafka_settings, topic_catalog, tmp_path):
    scenario_path = _shifted_scenario(tmp_path)
    summary = replay(scenario_path, tmp_path / "replay", window_seconds=WINDOW_S, grace_seconds=GRACE_S,
                     pod_linger_ms=600_000)
    expected = sorted(read_jsonl(tmp_path / "replay" / "shares.jsonl"), key=lambda r: sorted(r.items()).__repr__())
    assert expected and summary.share_rows == len(expected)

    producer = RecordProducer(kafka_settings)
    await producer.start()
    try:
        for record in scenario_records(load_scenario(scenario_path)):
            message = record.message
            partition = partition_for_node(message.node_name, PARTITIONS)
            if isinstance(message, NodeSample):
                await producer.send(topic_catalog.node_samples, message, key=message.node_name.encode(),
                                    partition=partition)
            else:
                await producer.send(topic_catalog.pod_events, message,
                                    key=pod_event_key(message.node_name, message.uid), partition=partition)
        await producer.flush()
    finally:
        await producer.stop()

    worker = AttributorProcess(kafka_settings, tmp_path, "equal", "--window-seconds", str(WINDOW_S),
                               "--grace-seconds", str(GRACE_S)).start()
    outputs = Outputs(kafka_settings, topic_catalog, f"g{uuid.uuid4().hex[:8]}")
    await outputs.consumer.start()
    try:
        await outputs.poll_until(lambda: len(outputs.shares) >= len(expected), 90, "all shares", worker.log)
        await outputs.drain(2.0)
    finally:
        await outputs.consumer.stop()
        worker.stop()
    streamed = sorted((share_json(s) for s in outputs.shares), key=lambda r: sorted(r.items()).__repr__())
    assert outputs.dead_letters == []
    assert streamed == expected

    # Billing over the node-window records the attributor wrote: replay's costs and bills, line for line.
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    group = f"b{uuid.uuid4().hex[:8]}"
    settings = BillingSettings(kafka=kafka_settings, ledger_url=ledger_url, consumer_group=group, metrics_port=0,
                               topic_partitions=PARTITIONS)
    stop = asyncio.Event()
    billing = asyncio.create_task(serve_billing(settings, stop=stop))
    try:
        await wait_until_committed_to_end(kafka_settings, group, topic_catalog.node_window_shares, "billing")
    finally:
        stop.set()
        assert await asyncio.wait_for(billing, 60) == 0
    by_line = lambda r: sorted(r.items()).__repr__()  # noqa: E731
    costs = await read_topic(kafka_settings, topic_catalog.costs, CostRecord)
    assert sorted((cost_record_json(c) for c in costs), key=by_line) == sorted(
        read_jsonl(tmp_path / "replay" / "costs.jsonl"), key=by_line)
    replay_bills = {(b["node"], b["window_start"]): b["node_cost_micro_usd"]
                    for b in read_jsonl(tmp_path / "replay" / "bills.jsonl")}
    with Ledger(ledger_url) as ledger:
        assert {(b["node_name"], iso_utc(b["window_start_unix_ms"])): b["node_cost_micro_usd"]
                for b in ledger.bills()} == replay_bills
    window_costs = await read_topic(kafka_settings, topic_catalog.node_window_costs, NodeWindowCost)
    assert len(window_costs) == len(replay_bills)
    assert sorted((c for w in window_costs for c in w.cost_records()), key=repr) == sorted(costs, key=repr)
    # What billing could not price is what replay reports unpriced: each such node-window's message dead-lettered
    # NO_PRICE, nothing else dead-lettered.
    letters = await read_topic(kafka_settings, topic_catalog.dead_letters, DeadLetter)
    assert {d.reason_code for d in letters} <= {"NO_PRICE"}
    unpriced = {(w.node_name, w.window_start_unix_ms) for w in codec_windows(letters)}
    assert unpriced == {(u.node_name, u.window_start_unix_ms) for u in summary.unpriced}
    assert len(unpriced) == len(letters)
