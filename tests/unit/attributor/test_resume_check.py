"""After a rebuild, the first record of a partition must not lie past where the partition's tables end."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpumeter.clock import ManualClock
from gpumeter.kafka.deadletter import RawMessage
from gpumeter.metrics import ServiceMetrics
from gpumeter.settings import KafkaSettings
from services.attributor.app import AttributorStream, WindowGap
from services.attributor.settings import AttributorSettings

TOPIC = "t.gpumeter.node-samples.v1"


def _stream(tmp_path, earliest_offset: int) -> AttributorStream:
    settings = AttributorSettings(kafka=KafkaSettings(topic_prefix="t."), partitions=3, data_dir=tmp_path,
                                  metrics_port=0, window_seconds=20, grace_seconds=2, pod_linger_seconds=600)
    stream = AttributorStream(settings, ManualClock(0), ServiceMetrics("attributor"))

    async def earliest_offsets(*tps):
        return {tp: earliest_offset for tp in tps}

    stream.app = SimpleNamespace(consumer=SimpleNamespace(earliest_offsets=earliest_offsets))
    return stream


def _raw(offset: int) -> RawMessage:
    return RawMessage(TOPIC, 1, offset, b"node", b"x")


@pytest.mark.parametrize("first_offset", [7, 10])
async def test_a_first_record_at_or_before_the_tables_end_is_processed(tmp_path, first_offset):
    stream = _stream(tmp_path, earliest_offset=0)
    resume = {1: 10}
    await stream._check_resume(TOPIC, resume, _raw(first_offset))
    assert resume == {}, "checked once: later records of the partition are not checked again"
    await stream._check_resume(TOPIC, resume, _raw(500))


async def test_a_first_record_past_the_tables_end_stops_the_worker(tmp_path):
    stream = _stream(tmp_path, earliest_offset=0)
    with pytest.raises(WindowGap, match="resumed at offset 36, but the tables end at 18"):
        await stream._check_resume(TOPIC, {1: 18}, _raw(36))


async def test_records_gone_to_retention_are_accepted_as_lost(tmp_path):
    stream = _stream(tmp_path, earliest_offset=30)
    resume = {1: 18}
    await stream._check_resume(TOPIC, resume, _raw(36))
    assert resume == {}
