"""Every producer gathers a partition's records into batches of ``KafkaSettings.producer_batch_bytes`` (the setting,
at most the max request size): the attributor's Faust app (whose own default, 16 KiB, holds one node-window's
shares record, so that each send waited out the broker's answer to the one before) and the services'
``RecordProducer``. No broker: aiokafka producers connect only when started."""

from __future__ import annotations

import asyncio

import pytest

from gpumeter.clock import ManualClock
from gpumeter.errors import ConfigError
from gpumeter.kafka.producer import RecordProducer
from gpumeter.metrics import ServiceMetrics
from gpumeter.settings import DEFAULT_PRODUCER_BATCH_MAX_BYTES, KafkaSettings
from services.attributor.app import AttributorStream
from services.attributor.settings import AttributorSettings


def _attributor_producer(tmp_path, kafka: KafkaSettings):
    settings = AttributorSettings(kafka=kafka, partitions=2, data_dir=tmp_path, metrics_port=0)
    stream = AttributorStream(settings, ManualClock(1_796_000_000_000), ServiceMetrics("attributor"))
    return stream.app.producer._new_producer()  # the AIOKafkaProducer Faust's producer would start (not started)


def test_the_batch_size_is_a_setting_bounded_by_the_request_size() -> None:
    assert KafkaSettings().producer_batch_bytes == DEFAULT_PRODUCER_BATCH_MAX_BYTES == 524_288
    loaded = KafkaSettings.from_env({"GPUMETER_KAFKA_PRODUCER_BATCH_MAX_BYTES": "65536"})
    assert loaded.producer_batch_max_bytes == 65_536
    with pytest.raises(ConfigError):
        KafkaSettings.from_env({"GPUMETER_KAFKA_PRODUCER_BATCH_MAX_BYTES": "1024"})  # below 16 KiB
    # A batch goes out in one request: a request size lowered below the batch size bounds the batches too.
    assert KafkaSettings(max_request_size_bytes=262_144).producer_batch_bytes == 262_144
    assert KafkaSettings(producer_batch_max_bytes=65_536).producer_batch_bytes == 65_536


def test_the_attributors_faust_producer_batches_as_configured(tmp_path) -> None:
    async def main() -> None:
        default = _attributor_producer(tmp_path / "d", KafkaSettings())
        configured = _attributor_producer(tmp_path / "c", KafkaSettings(producer_batch_max_bytes=300_000))
        bounded = _attributor_producer(tmp_path / "b", KafkaSettings(max_request_size_bytes=200_000))
        try:
            # Not Faust's 16 KiB: a shares record of a node-window (~12 KB) would fill a batch on its own.
            assert default._message_accumulator._batch_size == DEFAULT_PRODUCER_BATCH_MAX_BYTES
            assert configured._message_accumulator._batch_size == 300_000
            assert bounded._message_accumulator._batch_size == 200_000
        finally:
            for made in (default, configured, bounded):
                await made.stop()

    asyncio.run(main())


def test_the_services_record_producer_batches_as_configured() -> None:
    async def main() -> None:
        default = RecordProducer(KafkaSettings())
        configured = RecordProducer(KafkaSettings(producer_batch_max_bytes=100_000))
        explicit = RecordProducer(KafkaSettings(producer_batch_max_bytes=100_000), max_batch_bytes=2048)
        sizes = [p._producer._message_accumulator._batch_size for p in (default, configured, explicit)]
        for made in (default, configured, explicit):
            await made._producer.stop()
        assert sizes == [DEFAULT_PRODUCER_BATCH_MAX_BYTES, 100_000, 2048]

    asyncio.run(main())
