"""After a rebuild, what lies between a partition's newest progress record and its first record is processed first."""

from __future__ import annotations

import pytest

from gpumeter.clock import ManualClock
from gpumeter.stream.deadletter import RawMessage
from gpumeter.metrics import ServiceMetrics
from gpumeter.settings import KafkaSettings
from services.attributor.app import AttributorStream
from services.attributor.settings import AttributorSettings

TOPIC = "t.gpumeter.node-samples.v1"


def _stream(tmp_path, reads: list) -> AttributorStream:
    settings = AttributorSettings(kafka=KafkaSettings(topic_prefix="t."), partitions=3, data_dir=tmp_path,
                                  metrics_port=0, window_seconds=20, grace_seconds=2, pod_linger_seconds=600)
    stream = AttributorStream(settings, ManualClock(0), ServiceMetrics("attributor"))

    async def read_range(topic, partition, start, stop):
        reads.append((topic, partition, start, stop))
        for offset in range(start, stop):
            yield _raw(offset)

    stream._read_range = read_range
    return stream


def _raw(offset: int) -> RawMessage:
    return RawMessage(TOPIC, 1, offset, b"node", b"x")


@pytest.mark.parametrize("first_offset", [7, 10])
async def test_a_first_record_at_or_before_the_progress_reads_nothing_again(tmp_path, first_offset):
    reads, processed = [], []
    resume = {1: 10}
    stream = _stream(tmp_path, reads)

    async def process(raw):
        processed.append(raw.offset)

    await stream._check_resume(TOPIC, resume, _raw(first_offset), process)
    assert (resume, reads, processed) == ({}, [], [])


async def test_records_skipped_by_the_consumer_are_processed_in_order_first_and_only_once(tmp_path):
    reads, processed = [], []
    resume = {1: 18}
    stream = _stream(tmp_path, reads)

    async def process(raw):
        processed.append(raw.offset)

    await stream._check_resume(TOPIC, resume, _raw(36), process)
    await stream._check_resume(TOPIC, resume, _raw(37), process)
    assert reads == [(TOPIC, 1, 18, 36)]
    assert processed == list(range(18, 36))
