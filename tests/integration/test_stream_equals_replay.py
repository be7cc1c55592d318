"""The streaming services through the real broker equal ``gpumeter replay`` on the same input. On a scenario: the
attributor's share rows, then -- billing reading the attributor's node-window records -- the same cost lines, the
same bills in the ledger, and each bill's ``NodeWindowCost`` holding exactly its lines. On a recording with bad
messages among the scenario's: the attributor, billing and the guard dead-letter exactly what replay's services
dead-letter (the same messages, by the same service, for the same reason). (That the guard publishes replay's
violations record for record is ``test_guard_rules_broker``.)

Every shipped scenario, its clock moved to end just before now so that the worker's wall clock and the replay's
scenario clock agree on what is past; everything else is the scenario as shipped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import re
import struct
import uuid
from pathlib import Path

import pytest
import yaml

from gpumeter.kafka.producer import RecordProducer
from schemas.catalog import partition_for_node, pod_event_key
from gpumeter.clock import iso_utc
from gpumeter.errors import InvalidMessage
from schemas.records import CostRecord, DeadLetter, NodeSample, NodeWindowCost, NodeWindowShares, PodEvent
from schemas.typed import codec_for
from pipeline.recordings import RECORDING_MAGIC, decode_message, iter_frames, scenario_records
from pipeline.replay import read_jsonl, replay, share_json
from services.billing.costing import cost_record_json
from services.billing.ledger import Ledger
from services.billing.main import serve as serve_billing
from services.billing.settings import BillingSettings
from services.guard.main import serve as serve_guard
from services.guard.settings import GuardSettings
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


SCENARIOS = sorted(p.stem for p in (REPO / "scenarios").glob("*.yaml"))
POD_LINGER_S = 3600  # longer than any shipped scenario: the worker's wall clock never retires a pod replay keeps


def _shifted_scenario(tmp_path: Path, name: str = "two_nodes") -> Path:
    """The shipped scenario moved to end just before now, so the worker's wall clock and the replay's scenario
    clock agree on what is in the past (no tick from the future, every pod within its linger time)."""
    text = (REPO / "scenarios" / f"{name}.yaml").read_text()
    duration_s = yaml.safe_load(text)["duration_seconds"]
    start = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=duration_s + 60)).replace(microsecond=0)
    shifted, count = re.subn(r'^start: "[^"]+"', f'start: "{start.strftime("%Y-%m-%dT%H:%M:%SZ")}"', text,
                             flags=re.MULTILINE)
    assert count == 1
    path = tmp_path / f"{name}_now.yaml"
    path.write_text(shifted)
    return path


def _letters(letters, service: str) -> list[tuple[str, str]]:
    return sorted((d.reason_code, d.payload_sha256) for d in letters if d.service == service)


async def _produce_as_collected(producer: RecordProducer, catalog, message, payload: bytes) -> None:
    """``payload`` (the encoded ``message``) where the collector puts it: a sample keyed by its node, a pod event by
    ``<node>/<uid>``, on the node's partition."""
    partition = partition_for_node(message.node_name, PARTITIONS)
    if isinstance(message, NodeSample):
        await producer.send_bytes(catalog.node_samples, payload, key=message.node_name.encode(), partition=partition)
    else:
        await producer.send_bytes(catalog.pod_events, payload, key=pod_event_key(message.node_name, message.uid),
                                  partition=partition)


async def _attributed(kafka_settings, catalog, tmp_path: Path, name: str, share_rows: int) -> Outputs:
    """A ``gpumeter attributor`` worker run over the input until ``share_rows`` rows (and 2 s more) are out."""
    worker = AttributorProcess(kafka_settings, tmp_path, name, "--window-seconds", str(WINDOW_S),
                               "--grace-seconds", str(GRACE_S), "--pod-linger-seconds", str(POD_LINGER_S)).start()
    outputs = Outputs(kafka_settings, catalog, f"g{uuid.uuid4().hex[:8]}")
    await outputs.consumer.start()
    try:
        await outputs.poll_until(lambda: len(outputs.shares) >= share_rows, 90, "all shares", worker.log)
        await outputs.drain(2.0)
    finally:
        await outputs.consumer.stop()
        worker.stop()
    return outputs


@pytest.mark.parametrize("name", SCENARIOS)
async def test_streaming_shares_and_costs_equal_replay_on_a_scenario(name, kafka_settings, topic_catalog, tmp_path):
    scenario_path = _shifted_scenario(tmp_path, name)
    summary = replay(scenario_path, tmp_path / "replay", window_seconds=WINDOW_S, grace_seconds=GRACE_S,
                     pod_linger_ms=POD_LINGER_S * 1000)
    expected = sorted(read_jsonl(tmp_path / "replay" / "shares.jsonl"), key=lambda r: sorted(r.items()).__repr__())
    assert expected and summary.share_rows == len(expected)
    replay_letters = read_jsonl(tmp_path / "replay" / "dead_letters.jsonl")

    producer = RecordProducer(kafka_settings)
    await producer.start()
    try:
        for record in scenario_records(load_scenario(scenario_path)):
            await _produce_as_collected(producer, topic_catalog, record.message,
                                        codec_for(type(record.message)).encode(record.message))
        await producer.flush()
    finally:
        await producer.stop()

    outputs = await _attributed(kafka_settings, topic_catalog, tmp_path, "equal", len(expected))
    streamed = sorted((share_json(s) for s in outputs.shares), key=lambda r: sorted(r.items()).__repr__())
    assert _letters(outputs.dead_letters, "attributor") == sorted(
        (d["reason_code"], d["payload_sha256"]) for d in replay_letters if d["service"] == "attributor")
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
    letters = [d for d in await read_topic(kafka_settings, topic_catalog.dead_letters, DeadLetter)
               if d.service == "billing"]
    assert _letters(letters, "billing") == sorted(
        (d["reason_code"], d["payload_sha256"]) for d in replay_letters if d["service"] == "billing")
    assert {d.reason_code for d in letters} <= {"NO_PRICE"}
    unpriced = {(w.node_name, w.window_start_unix_ms) for w in codec_windows(letters)}
    assert unpriced == {(u.node_name, u.window_start_unix_ms) for u in summary.unpriced}
    assert len(unpriced) == len(letters)


# ----------------------------------------------------------------------------------------------------------------
# Bad input: the same dead letters, from the same services, through the broker and in replay


def _bad_recording(scenario_path: Path, path: Path) -> tuple[int, list[bytes]]:
    """The scenario's input with bad messages among it, as a recording: bytes that are no Avro message, a header
    cut short, a record of another type, a sample from two hours ahead, a pod with a name the API server would
    refuse, and an early tick held back until after its window closed. Returns (frames, the bad payloads)."""
    records = list(scenario_records(load_scenario(scenario_path)))
    samples = [r for r in records if isinstance(r.message, NodeSample)]
    held_back = samples[1]
    records.remove(held_back)
    first = samples[0].message
    pod = next(r.message for r in records if not isinstance(r.message, NodeSample))
    middle = records[len(records) // 2].received_at_unix_ms
    bad: list[tuple[int, bytes]] = [
        (middle, b"\x00garbage, not a single-object message"),
        (middle, b"\xc3\x01\x00"),
        (middle, codec_for(DeadLetter).encode(DeadLetter("X", "x", "X", "svc", "t", 0, 0, None, b"", 0))),
        (middle, codec_for(NodeSample).encode(dataclasses.replace(
            first, sampled_at_unix_ms=middle + 2 * 3_600_000, sequence=first.sequence + 10_000))),
        (middle, codec_for(PodEvent).encode(dataclasses.replace(pod, uid="uid-forged",
                                                                name="pod\nINFO all clear"))),
    ]
    frames = [(r.received_at_unix_ms, codec_for(type(r.message)).encode(r.message)) for r in records]
    at = next(i for i, (t, _) in enumerate(frames) if t >= middle)
    frames[at:at] = bad
    late = (records[-1].received_at_unix_ms, codec_for(NodeSample).encode(held_back.message))
    frames.append(late)
    with path.open("wb") as handle:
        handle.write(RECORDING_MAGIC)
        for received_at, payload in frames:
            handle.write(struct.pack(">qI", received_at, len(payload)))
            handle.write(payload)
    return len(frames), [payload for _, payload in bad] + [late[1]]


def _letter_key(service: str, reason_code: str, topic: str, sha256: str) -> tuple[str, str, str, str]:
    return (service, reason_code, topic, sha256)


async def test_bad_input_is_dead_lettered_alike_by_the_stream_and_replay(kafka_settings, topic_catalog, tmp_path):
    """A recording with bad messages among a scenario's: the stream's three services (the attributor worker,
    billing, the guard, through the broker) dead-letter exactly the messages replay dead-letters, each by the same
    service with the same reason -- and bill the rest alike."""
    recording = tmp_path / "bad.gmrec"
    frame_count, bad_payloads = _bad_recording(_shifted_scenario(tmp_path), recording)
    summary = replay(recording, tmp_path / "replay", window_seconds=WINDOW_S, grace_seconds=GRACE_S,
                     pod_linger_ms=POD_LINGER_S * 1000)
    replayed = read_jsonl(tmp_path / "replay" / "dead_letters.jsonl")
    expected = sorted(_letter_key(d["service"], d["reason_code"], d["source_topic"], d["payload_sha256"])
                      for d in replayed)
    # Replay's own account: every bad message refused, by both services reading the samples topic where both
    # read it, the late tick by the attributor only, the unpriced node-windows by billing.
    assert {d["reason_code"] for d in replayed} == {"CORRUPT", "TRUNCATED", "WRONG_RECORD_TYPE", "OUT_OF_RANGE",
                                                    "INVALID_NAME", "LATE", "NO_PRICE"}
    bad_shas = {hashlib.sha256(p).hexdigest() for p in bad_payloads}
    assert {d["payload_sha256"] for d in replayed if d["reason_code"] != "NO_PRICE"} == bad_shas
    assert summary.samples + summary.pod_events == frame_count - 3  # three frames do not decode at all

    producer = RecordProducer(kafka_settings)
    await producer.start()
    try:
        for frame in iter_frames(recording):
            try:
                message = decode_message(frame.payload)
            except InvalidMessage:
                # What does not decode has no node to route by: it goes where replay puts it, the samples topic.
                await producer.send_bytes(topic_catalog.node_samples, frame.payload, partition=0)
                continue
            await _produce_as_collected(producer, topic_catalog, message, frame.payload)
        await producer.flush()
    finally:
        await producer.stop()

    outputs = await _attributed(kafka_settings, topic_catalog, tmp_path, "bad", summary.share_rows)
    assert len(outputs.shares) == summary.share_rows

    billing_group, guard_group = f"b{uuid.uuid4().hex[:8]}", f"gd{uuid.uuid4().hex[:8]}"
    stop = asyncio.Event()
    billing = asyncio.create_task(serve_billing(BillingSettings(
        kafka=kafka_settings, ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", consumer_group=billing_group,
        metrics_port=0, topic_partitions=PARTITIONS), stop=stop))
    guard = asyncio.create_task(serve_guard(GuardSettings(
        kafka=kafka_settings, consumer_group=guard_group, metrics_port=0, topic_partitions=PARTITIONS,
        state_path=tmp_path / "guard.state", snapshot_interval_seconds=0.2), stop=stop))
    try:
        await wait_until_committed_to_end(kafka_settings, billing_group, topic_catalog.node_window_shares, "billing")
        for topic in (topic_catalog.node_samples, topic_catalog.pod_events, topic_catalog.node_window_shares,
                      topic_catalog.node_window_costs):
            await wait_until_committed_to_end(kafka_settings, guard_group, topic, "the guard")
    finally:
        stop.set()
        assert await asyncio.wait_for(billing, 60) == 0
        assert await asyncio.wait_for(guard, 60) == 0
    letters = await read_topic(kafka_settings, topic_catalog.dead_letters, DeadLetter)
    prefix = kafka_settings.topic_prefix
    streamed = sorted(_letter_key(d.service, d.reason_code, d.source_topic[len(prefix):], d.payload_sha256)
                      for d in letters)
    assert streamed == expected
    costs = await read_topic(kafka_settings, topic_catalog.costs, CostRecord)
    by_line = lambda r: sorted(r.items()).__repr__()  # noqa: E731
    assert sorted((cost_record_json(c) for c in costs), key=by_line) == sorted(
        read_jsonl(tmp_path / "replay" / "costs.jsonl"), key=by_line)
