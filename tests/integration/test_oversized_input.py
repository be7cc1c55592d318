"""Input the broker accepts but no dead letter could copy whole, on every input topic of every consuming service.

Under the broker's default limits a producer can send a value of about 1 MiB uncompressed, and a far larger one
compressed (the broker checks the compressed batch; consumers get the value whole): here 1 MiB of random bytes
sent uncompressed and 3 MiB sent gzip-compressed, each in front of good input on the same partition. Before the
dead letter was bounded, its copy of the value exceeded the producer's ``max_request_size``: the attributor died
on the same offset after every restart, billing re-sent its outbox forever and the guard froze. Now each service
dead-letters both, every dead letter fits (a prefix of the value, its full length and SHA-256, ``truncated``),
and the input behind them is processed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import random
import struct

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from gpumeter.clock import SystemClock
from gpumeter.stream.deadletter import dead_letter_budget_bytes
from schemas.catalog import partition_for_node, pod_event_key
from schemas.codec import MAGIC
from schemas.records import DeadLetter, NodeWindowShares, Violation, ViolationState
from schemas.typed import codec_for
from services.billing.ledger import Ledger
from services.billing.main import serve as serve_billing
from services.billing.settings import BillingSettings
from services.guard.config import GuardConfig
from services.guard.main import serve as serve_guard
from services.guard.settings import GuardSettings
from tests.integration.test_attributor_stream import (
    PARTITIONS,
    WINDOW_MS,
    AttributorProcess,
    Outputs,
    expected_windows,
    pods_of,
    tick,
)
from tests.integration.test_billing_stream import wait_until_committed_to_end
from tests.integration.topic_reading import read_topic
from tests.unit.attributor import device, node_sample, pod_event
from tests.unit.billing.conftest import Unit, node_window, pod

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ONE_MIB_UNCOMPRESSED = b"\x00" + random.Random(14).randbytes(1_040_000)  # incompressible, under message.max.bytes
THREE_MIB_GZIP = MAGIC + struct.pack("<Q", 0x0123456789ABCDEF) + b"\x07" * (3 << 20)  # a few KiB compressed
OVERSIZED = (ONE_MIB_UNCOMPRESSED, THREE_MIB_GZIP)
WAIT_S = 60.0


async def produce_oversized(settings, topic: str, key: bytes, partition: int) -> None:
    """The two oversized values to ``topic``: the first uncompressed, the second gzip-compressed (a producer of
    each kind, with a max request size that lets them through; the broker keeps its default limits)."""
    for value, compression in ((ONE_MIB_UNCOMPRESSED, None), (THREE_MIB_GZIP, "gzip")):
        producer = AIOKafkaProducer(**settings.client_kwargs(), compression_type=compression,
                                    max_request_size=8 << 20, acks="all")
        await producer.start()
        try:
            await (await producer.send(topic, value, key=key, partition=partition))
        finally:
            await producer.stop()


def assert_fits_and_identifies(letters: list[DeadLetter], service: str, topics: list[str],
                               max_request_size_bytes: int) -> None:
    """Each topic's two oversized values came out as dead letters of ``service`` that fit and identify them."""
    assert sorted((d.source_topic, d.payload_length_bytes) for d in letters) == sorted(
        (t, len(v)) for t in topics for v in OVERSIZED), [(d.source_topic, d.reason_code) for d in letters]
    by_length = {len(v): v for v in OVERSIZED}
    for letter in letters:
        value = by_length[letter.payload_length_bytes]
        encoded = codec_for(DeadLetter).encode(letter)
        key = letter.source_topic.encode()
        assert letter.service == service and letter.truncated
        assert letter.payload_sha256 == hashlib.sha256(value).hexdigest()
        assert value.startswith(letter.raw_bytes) and len(letter.raw_bytes) > 900_000
        assert len(key) + len(encoded) <= dead_letter_budget_bytes(max_request_size_bytes)
        assert DefaultRecordBatchBuilder.estimate_size_in_bytes(key, encoded, []) <= max_request_size_bytes


async def test_billing_dead_letters_oversized_shares_and_bills_the_window_behind_them(kafka_settings, topic_catalog,
                                                                                      group_id, tmp_path):
    now_ms = SystemClock().now_ms()
    start = now_ms // 60_000 * 60_000 - 120_000
    node = "node-behind"
    good = NodeWindowShares.from_rows(
        node_window([Unit("GPU-0", [pod("a", 1.0, "ml", team="t")])], node=node, window_start_ms=start))
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    settings = BillingSettings(kafka=kafka_settings, ledger_url=ledger_url, consumer_group=group_id, metrics_port=0,
                               topic_partitions=PARTITIONS)
    topic = topic_catalog.node_window_shares
    stop = asyncio.Event()
    service = asyncio.create_task(serve_billing(settings, stop=stop))
    try:
        await produce_oversized(kafka_settings, topic, node.encode(), 0)
        producer = AIOKafkaProducer(**kafka_settings.client_kwargs())
        await producer.start()
        try:
            await (await producer.send(topic, codec_for(type(good)).encode(good), key=node.encode(), partition=0))
        finally:
            await producer.stop()
        await wait_until_committed_to_end(kafka_settings, group_id, topic, "billing past the oversized shares")
    finally:
        stop.set()
        code = await asyncio.wait_for(service, 30)
    assert code == 0
    letters = await read_topic(kafka_settings, topic_catalog.dead_letters, DeadLetter)
    assert_fits_and_identifies(letters, "billing", [topic], kafka_settings.max_request_size_bytes)
    assert sorted(d.source_offset for d in letters) == [0, 1]
    with Ledger(ledger_url) as ledger:
        assert [(b["node_name"], b["window_start_unix_ms"]) for b in ledger.bills()] == [(node, start)]


async def test_the_guard_dead_letters_oversized_input_on_every_topic_and_goes_on(kafka_settings, topic_catalog,
                                                                                 group_id, tmp_path):
    now_ms = SystemClock().now_ms()
    node = "guard-oversized-node"
    partition = partition_for_node(node, PARTITIONS)
    inputs = [topic_catalog.node_samples, topic_catalog.pod_events, topic_catalog.node_window_shares,
              topic_catalog.node_window_costs]
    leaky = pod_event("leaky-uid", node=node, observed_at_unix_ms=now_ms, started_at_unix_ms=now_ms)
    (container,) = leaky.containers
    leaky = dataclasses.replace(leaky, containers=(dataclasses.replace(container, visible_devices_env="all"),))
    sample = node_sample(now_ms - 1_000, [device("GPU-0")], node=node)
    settings = GuardSettings(kafka=kafka_settings, consumer_group=group_id, metrics_port=0,
                             topic_partitions=PARTITIONS, state_path=tmp_path / "guard.state",
                             snapshot_interval_seconds=0.5, clock_interval_seconds=0.2)
    stop = asyncio.Event()
    service = asyncio.create_task(serve_guard(settings, config=GuardConfig(), stop=stop, clock=SystemClock()))
    try:
        for topic in inputs:
            key = pod_event_key(node, "big") if topic == topic_catalog.pod_events else node.encode()
            await produce_oversized(kafka_settings, topic, key, partition)
        producer = AIOKafkaProducer(**kafka_settings.client_kwargs())
        await producer.start()
        try:
            await (await producer.send(topic_catalog.pod_events, codec_for(type(leaky)).encode(leaky),
                                       key=pod_event_key(node, leaky.uid), partition=partition))
            await (await producer.send(topic_catalog.node_samples, codec_for(type(sample)).encode(sample),
                                       key=node.encode(), partition=partition))
        finally:
            await producer.stop()
        for topic in inputs:  # the guard checkpointed past everything: its outbox was delivered
            await wait_until_committed_to_end(kafka_settings, group_id, topic, f"the guard past {topic}")
        violations = await read_topic(kafka_settings, topic_catalog.violations, Violation)
        assert any(v.rule == "visibility_leak" and v.pod_uid == leaky.uid and v.state is ViolationState.FIRING
                   for v in violations)
    finally:
        stop.set()
        code = await asyncio.wait_for(service, 30)
    assert code == 0
    letters = await read_topic(kafka_settings, topic_catalog.dead_letters, DeadLetter)
    assert_fits_and_identifies(letters, "guard", inputs, kafka_settings.max_request_size_bytes)


async def test_the_attributor_dead_letters_oversized_input_and_attributes_what_follows(kafka_settings,
                                                                                       topic_catalog, group_id,
                                                                                       tmp_path):
    now_ms = SystemClock().now_ms()
    base = now_ms // WINDOW_MS * WINDOW_MS - 4 * WINDOW_MS
    node = "gpu-node-a"
    partition = partition_for_node(node, PARTITIONS)
    pods = pods_of(node, base)
    ticks = [tick(node, base, k) for k in range(20)]
    closing = tick(node, base, 32)  # past the second window's end + grace: closes it (windows close by ticks only)
    expected = expected_windows(ticks, pods)
    assert sorted(expected) == [(node, base), (node, base + WINDOW_MS)]
    outputs = Outputs(kafka_settings, topic_catalog, group_id)
    await outputs.consumer.start()
    worker = AttributorProcess(kafka_settings, tmp_path, "oversized", "--idle-close-seconds", "600")
    try:
        worker.start()
        await worker.wait_ready(60)
        # The oversized values first, on the node's partition of each input topic, then the node's pods and ticks.
        await produce_oversized(kafka_settings, topic_catalog.pod_events, pod_event_key(node, "big"), partition)
        await produce_oversized(kafka_settings, topic_catalog.node_samples, node.encode(), partition)
        producer = AIOKafkaProducer(**kafka_settings.client_kwargs())
        await producer.start()
        try:
            for p in pods:
                await producer.send(topic_catalog.pod_events, codec_for(type(p)).encode(p),
                                    key=pod_event_key(node, p.uid), partition=partition)
            await producer.flush()
            await asyncio.sleep(1.0)  # pods ahead of samples, as a running collector has them
            for s in ticks + [closing]:
                await producer.send(topic_catalog.node_samples, codec_for(type(s)).encode(s), key=node.encode(),
                                    partition=partition)
            await producer.flush()
        finally:
            await producer.stop()

        def complete() -> bool:
            return set(expected) <= set(outputs.emissions(expected)) and len(outputs.dead_letters) >= 4

        await outputs.poll_until(complete, WAIT_S, "the windows behind the oversized input", worker.log)
        await outputs.drain(1.0)
        assert worker.process.poll() is None, worker.log()[-4000:]
    finally:
        code = worker.stop()
        await outputs.consumer.stop()
    assert code == 0, worker.log()[-4000:]
    for key, rows in expected.items():
        assert all(emission == rows for emission in outputs.emissions(expected)[key]), key
    assert_fits_and_identifies(outputs.dead_letters, "attributor",
                               [topic_catalog.pod_events, topic_catalog.node_samples],
                               kafka_settings.max_request_size_bytes)
    assert "cut to fit" in worker.log()
