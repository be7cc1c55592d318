"""The streaming attributor through the real broker equals ``gpumeter replay`` on the same scenario.

The scenario's clock is moved to just before now, so the worker's wall clock and the replay's scenario clock agree
on which pods are still within their linger time; everything else is the scenario as shipped.
"""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path

import pytest

from gpumeter.kafka.producer import RecordProducer
from schemas.catalog import partition_for_node, pod_event_key
from schemas.records import NodeSample
from pipeline.recordings import scenario_records
from pipeline.replay import read_jsonl, replay, share_json
from simulator.scenario import load_scenario
from tests.integration.test_attributor_stream import PARTITIONS, AttributorProcess, Outputs

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WINDOW_S, GRACE_S = 20, 2


def _shifted_scenario(tmp_path: Path) -> Path:
    text = (REPO / "scenarios" / "two_nodes.yaml").read_text()
    start = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=3)).replace(microsecond=0)
    shifted = text.replace('start: "2026-07-01T00:00:00Z"', f'start: "{start.strftime("%Y-%m-%dT%H:%M:%SZ")}"')
    assert shifted != text
    path = tmp_path / "two_nodes_now.yaml"
    path.write_text(shifted)
    return path


async def test_streaming_shares_equal_replay_on_a_scenario(kafka_settings, topic_catalog, tmp_path):
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
