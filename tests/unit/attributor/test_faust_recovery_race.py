"""A changelog partition assigned while a recovery pass runs is seeked from the start, never with ``None``.

faust-streaming's recovery builds its seek offsets at the start of a pass and seeks them later; a rebalance in
between adds partitions with the offset ``None`` and the plain ``Recovery`` hands that to the consumer, which
(``aiokafka.AIOKafkaConsumer.seek``) refuses it with ``ValueError`` and stops the worker (``make bench``'s
two-worker phase). The consumer below refuses exactly what aiokafka refuses.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from faust.tables.recovery import Recovery
from faust.types import TP

from gpumeter.clock import ManualClock
from gpumeter.metrics import ServiceMetrics
from gpumeter.settings import KafkaSettings
from services.attributor.app import AttributorStream
from services.attributor.faust_tables import NOTHING_READ_OFFSET, SafeSeekRecovery
from services.attributor.settings import AttributorSettings

OLD = TP("app-open_samples-changelog", 5)  # offsets built by this pass
NEW = TP("app-pods-changelog", 8)  # assigned by a rebalance after the pass built its offsets


class AiokafkaLikeConsumer:
    """Records seeks; refuses an offset as ``AIOKafkaConsumer.seek`` does (not an int, or negative)."""

    def __init__(self) -> None:
        self.seeks: dict[TP, int] = {}

    async def seek_wait(self, partitions):
        for tp, offset in partitions.items():
            if not isinstance(offset, int) or offset < 0:
                raise ValueError("Offset must be a positive integer")
            self.seeks[tp] = offset


def offsets_mid_pass() -> Counter:
    offsets = Counter()
    offsets[OLD] = 41  # read up to here by an earlier pass
    offsets[NEW] = None  # what Recovery._add writes for a partition with nothing persisted
    return offsets


def test_the_plain_recovery_passes_none_to_the_consumer():
    # The defect this module exists for, on faust's own code: if it is ever fixed upstream this test says so.
    offsets = offsets_mid_pass()
    with pytest.raises(ValueError, match="positive integer"):
        asyncio.run(Recovery.__new__(Recovery)._seek_offsets(AiokafkaLikeConsumer(), {OLD, NEW}, offsets, "standby"))


def test_a_partition_without_an_offset_is_read_from_the_start_and_the_others_where_they_were():
    consumer, offsets = AiokafkaLikeConsumer(), offsets_mid_pass()
    recovery = SafeSeekRecovery.__new__(SafeSeekRecovery)  # the method reads nothing of the service's own state
    asyncio.run(recovery._seek_offsets(consumer, {OLD, NEW}, offsets, "standby"))
    assert consumer.seeks == {OLD: 41, NEW: 0}
    # Kept, so that what compares the offsets with the highwaters afterwards (standby_remaining) compares ints.
    assert offsets[NEW] == NOTHING_READ_OFFSET and offsets[OLD] == 41


def test_the_attributor_app_recovers_its_tables_with_the_safe_recovery(tmp_path):
    settings = AttributorSettings(kafka=KafkaSettings(topic_prefix="t."), partitions=1, data_dir=tmp_path,
                                  metrics_port=0)
    stream = AttributorStream(settings, ManualClock(0), ServiceMetrics("attributor"))
    assert type(stream.app.tables.recovery) is SafeSeekRecovery


def test_tables_have_no_standby_copies_unless_configured(tmp_path):
    # Faust's own default is one standby: every worker would read the other workers' changelogs at each start
    # and rebalance, which a rebuild (changelog, pod events, samples) makes useless.
    def app_of(**overrides):
        settings = AttributorSettings(kafka=KafkaSettings(topic_prefix="t."), partitions=1, data_dir=tmp_path,
                                      metrics_port=0, **overrides)
        return AttributorStream(settings, ManualClock(0), ServiceMetrics("attributor")).app

    assert app_of().conf.table_standby_replicas == 0
    assert app_of(table_standby_replicas=2).conf.table_standby_replicas == 2
