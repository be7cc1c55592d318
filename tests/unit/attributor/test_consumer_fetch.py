"""The streaming consumers fetch as ``KafkaSettings`` says: the attributor's Faust worker consumer (Faust has no
setting for it: ``services.attributor.faust_transport``) and the ``KafkaDriver``'s consumer of billing and the
guard (its test: ``tests/unit/stream/test_kafka_driver_batches.py``). No broker: aiokafka consumers connect only
when started."""

from __future__ import annotations

import asyncio

import pytest

from gpumeter.clock import ManualClock
from gpumeter.errors import ConfigError
from gpumeter.metrics import ServiceMetrics
from gpumeter.settings import KafkaSettings
from services.attributor.app import AttributorStream
from services.attributor.faust_transport import apply_consumer_fetch
from services.attributor.settings import AttributorSettings


def _worker_consumer(tmp_path, kafka: KafkaSettings):
    settings = AttributorSettings(kafka=kafka, partitions=2, data_dir=tmp_path, metrics_port=0)
    stream = AttributorStream(settings, ManualClock(1_796_000_000_000), ServiceMetrics("attributor"))
    app = stream.app
    thread = app.consumer._thread  # the consumer thread Faust's worker runs (made, not started)
    return thread._create_worker_consumer(app.transport)


def test_settings_default_to_fetches_that_wait_for_data() -> None:
    kafka = KafkaSettings()
    assert kafka.consumer_fetch_kwargs() == {"fetch_min_bytes": 262_144, "fetch_max_wait_ms": 500}
    loaded = KafkaSettings.from_env({"GPUMETER_KAFKA_CONSUMER_FETCH_MIN_BYTES": "1",
                                     "GPUMETER_KAFKA_CONSUMER_FETCH_MAX_WAIT_MS": "250"})
    assert loaded.consumer_fetch_kwargs() == {"fetch_min_bytes": 1, "fetch_max_wait_ms": 250}
    with pytest.raises(ConfigError):
        KafkaSettings.from_env({"GPUMETER_KAFKA_CONSUMER_FETCH_MIN_BYTES": "0"})
    with pytest.raises(ConfigError):
        KafkaSettings.from_env({"GPUMETER_KAFKA_CONSUMER_FETCH_MAX_WAIT_MS": "-1"})


def test_the_attributors_worker_consumer_fetches_as_configured(tmp_path) -> None:
    async def main() -> None:
        consumer = _worker_consumer(tmp_path, KafkaSettings(consumer_fetch_min_bytes=123_456,
                                                            consumer_fetch_max_wait_ms=77))
        assert (consumer._fetch_min_bytes, consumer._fetch_max_wait_ms) == (123_456, 77)
        default = _worker_consumer(tmp_path / "d", KafkaSettings())
        assert (default._fetch_min_bytes, default._fetch_max_wait_ms) == (262_144, 500)
        # The rest is Faust's own: its group, manual commits
        assert consumer._group_id == "gpumeter-attributor" and consumer._enable_auto_commit is False
        for made in (consumer, default):
            await made.stop()  # never started: nothing to close but aiokafka's bookkeeping

    asyncio.run(main())


def test_a_consumer_without_the_setting_or_already_started_is_refused() -> None:
    class Changed:  # an aiokafka that stores its fetch settings under other names
        _fetcher = None

    with pytest.raises(ConfigError, match="_fetch_min_bytes"):
        apply_consumer_fetch(Changed(), {"fetch_min_bytes": 1})

    class Started:
        _fetch_min_bytes = 1
        _fetcher = object()

    with pytest.raises(ConfigError, match="before it starts"):
        apply_consumer_fetch(Started(), {"fetch_min_bytes": 2})
