"""Windows go out (one NodeWindowShares each) without the agent waiting for Kafka; they are recorded as emitted
only once acknowledged."""

from __future__ import annotations

import asyncio

import pytest

from gpumeter.clock import ManualClock
from gpumeter.metrics import ServiceMetrics
from gpumeter.settings import KafkaSettings
from schemas.records import NodeWindowShares
from schemas.typed import codec_for
from services.attributor.app import AttributorStream, WindowDeliveryFailed
from services.attributor.engine import AttributionEngine
from services.attributor.settings import AttributorSettings
from tests.unit.attributor.test_engine import BASE, CONFIG, NOW, WINDOW_S, pods_of, two_pod_tick

PARTITION = 1


class FakeSharesTopic:
    """Records what is sent; each send returns a future the test settles, as Kafka's acknowledgement would."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, bytes, asyncio.Future]] = []

    async def send(self, *, key: bytes, value: bytes) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.sent.append((key, value, future))
        return future

    def acknowledge(self, upto: int | None = None) -> None:
        for _, _, future in self.sent[:upto]:
            if not future.done():
                future.set_result(None)


def _stream(tmp_path) -> tuple[AttributorStream, FakeSharesTopic]:
    settings = AttributorSettings(kafka=KafkaSettings(topic_prefix="t."), partitions=3, data_dir=tmp_path,
                                  metrics_port=0, window_seconds=WINDOW_S, grace_seconds=2, pod_linger_seconds=600)
    stream = AttributorStream(settings, ManualClock(NOW), ServiceMetrics("attributor"))
    topic = FakeSharesTopic()
    stream.shares_topic = topic
    return stream, topic


def _closed_windows(engine: AttributionEngine, nodes=("n1", "n2")):
    """Two closed windows of each node (ticks up to just past the second window's end plus the grace period)."""
    windows = []
    for node in nodes:
        for event in pods_of(node):
            engine.on_pod_event(event)
    position = 0
    for k in range(2 * WINDOW_S + 3):  # past the second window's end plus the grace period
        for node in nodes:
            position += 1
            windows.extend(engine.on_sample(two_pod_tick(BASE + k * 1000, node, k), NOW, position).windows)
    engine.take_table_changes()
    return tuple(windows)


async def test_windows_are_sent_at_once_and_recorded_only_once_acknowledged(tmp_path):
    stream, topic = _stream(tmp_path)
    engine = AttributionEngine(CONFIG)
    windows = _closed_windows(engine)
    assert len(windows) == 4
    await stream._send_windows(PARTITION, windows[:2])
    await stream._send_windows(PARTITION, windows[2:])
    # Every window is on its way as one record, in order, keyed by its node, before anything is acknowledged;
    # each record holds exactly the window's rows.
    sent = [(key, codec_for(NodeWindowShares).decode(value)) for key, value, _ in topic.sent]
    assert [(key, record.rows()) for key, record in sent] == [(w.node_name.encode(), w.shares) for w in windows]

    stream._settle(PARTITION, engine)
    changes = engine.take_table_changes()
    assert (changes.progress, changes.deleted_sample_keys) == ((), ())

    # The first batch acknowledged, the second only in part: only the first is recorded.
    topic.acknowledge(3)
    stream._settle(PARTITION, engine)
    changes = engine.take_table_changes()
    assert set(changes.deleted_sample_keys) == set(windows[0].sample_keys + windows[1].sample_keys)
    assert stream._in_flight[PARTITION] == [(windows[2:], [f for _, _, f in topic.sent[2:]])]

    topic.acknowledge()
    stream._settle(PARTITION, engine)
    changes = engine.take_table_changes()
    assert set(changes.deleted_sample_keys) == set(windows[2].sample_keys + windows[3].sample_keys)
    assert stream._in_flight[PARTITION] == []
    # Each node's progress now stands after both its windows.
    assert {p.node_name: p.closed_before_unix_ms for p in changes.progress} == {
        "n1": BASE + 2 * WINDOW_S * 1000, "n2": BASE + 2 * WINDOW_S * 1000}
    await asyncio.sleep(0)  # done callbacks run on the loop's next turn
    closed = stream.metrics.get("gpumeter_attributor_windows_closed_total")
    assert closed._value.get() == 4


async def test_a_window_kafka_refused_stops_the_worker_and_leaves_it_to_be_emitted_again(tmp_path):
    stream, topic = _stream(tmp_path)
    engine = AttributionEngine(CONFIG)
    windows = _closed_windows(engine, nodes=("n1",))
    await stream._send_windows(PARTITION, windows)
    topic.acknowledge()
    failed = asyncio.get_running_loop().create_future()
    failed.set_exception(OSError("broker gone"))
    topic.sent[-1] = (topic.sent[-1][0], topic.sent[-1][1], failed)
    stream._in_flight[PARTITION] = [(windows, [f for _, _, f in topic.sent])]
    with pytest.raises(WindowDeliveryFailed, match="broker gone"):
        stream._settle(PARTITION, engine)
    changes = engine.take_table_changes()
    assert (changes.progress, changes.deleted_sample_keys) == ((), ())  # nothing marked done: the ticks stay
