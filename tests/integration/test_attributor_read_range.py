"""The attributor's direct read of an offset range (used when Faust resumes past its durable state)."""

from __future__ import annotations

import pytest

from gpumeter.clock import ManualClock
from gpumeter.kafka.producer import RecordProducer
from gpumeter.metrics import ServiceMetrics
from services.attributor.app import AttributorStream
from services.attributor.settings import AttributorSettings

pytestmark = pytest.mark.integration


async def test_read_range_yields_exactly_the_offsets_asked_for(kafka_settings, topic_catalog, tmp_path):
    producer = RecordProducer(kafka_settings)
    await producer.start()
    try:
        for i in range(10):
            await producer.send_bytes(topic_catalog.node_samples, f"v{i}".encode(), key=b"n", partition=1)
        await producer.flush()
    finally:
        await producer.stop()
    settings = AttributorSettings(kafka=kafka_settings, partitions=3, data_dir=tmp_path, metrics_port=0,
                                  window_seconds=20, grace_seconds=2, pod_linger_seconds=600)
    stream = AttributorStream(settings, ManualClock(0), ServiceMetrics("attributor"))
    got = [(r.offset, r.value) async for r in stream._read_range(topic_catalog.node_samples, 1, 3, 7)]
    assert got == [(i, f"v{i}".encode()) for i in range(3, 7)]
    assert [r.offset async for r in stream._read_range(topic_catalog.node_samples, 1, 8, 50)] == [8, 9]
