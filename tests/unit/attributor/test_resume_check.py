"""After a rebuild, the first record of a partition is checked once against the partition's newest progress."""

from __future__ import annotations

import logging

import pytest

from gpumeter.clock import ManualClock
from gpumeter.kafka.deadletter import RawMessage
from gpumeter.metrics import ServiceMetrics
from gpumeter.settings import KafkaSettings
from services.attributor.app import AttributorStream
from services.attributor.settings import AttributorSettings

TOPIC = "t.gpumeter.node-samples.v1"


def _stream(tmp_path) -> AttributorStream:
    settings = AttributorSettings(kafka=KafkaSettings(topic_prefix="t."), partitions=3, data_dir=tmp_path,
                                  metrics_port=0, window_seconds=20, grace_seconds=2, pod_linger_seconds=600)
    return AttributorStream(settings, ManualClock(0), ServiceMetrics("attributor"))


def _raw(offset: int) -> RawMessage:
    return RawMessage(TOPIC, 1, offset, b"node", b"x")


@pytest.mark.parametrize("first_offset", [7, 10])
async def test_a_first_record_at_or_before_the_progress_is_silent(tmp_path, caplog, first_offset):
    resume = {1: 10}
    with caplog.at_level(logging.WARNING, logger="services.attributor.app"):
        await _stream(tmp_path)._check_resume(TOPIC, resume, _raw(first_offset))
    assert resume == {}
    assert caplog.records == []


async def test_a_first_record_past_the_progress_is_logged_once(tmp_path, caplog):
    stream = _stream(tmp_path)
    resume = {1: 18}
    with caplog.at_level(logging.WARNING, logger="services.attributor.app"):
        await stream._check_resume(TOPIC, resume, _raw(36))
        await stream._check_resume(TOPIC, resume, _raw(37))
    assert [r.getMessage() for r in caplog.records] == [
        f"{TOPIC}[1]: resumed at offset 36, past the newest progress record (18); ticks in between are either in "
        "the table already or were committed before their changelog writes"
    ]
