"""The Faust app the attributor runs on: ``faust.App`` whose worker consumer fetches as every streaming consumer of
gpumeter does (``KafkaSettings.consumer_fetch_kwargs``: the broker answers a fetch once it holds
``fetch_min_bytes`` for it, or after ``fetch_max_wait_ms``).

Faust 0.15 builds its worker consumer with ``fetch_max_wait_ms=1500`` and aiokafka's ``fetch_min_bytes=1`` and has
no setting for either: every fetch came back with the few records that arrived since the last one, and at a
fleet's steady 1 Hz the attributor spent more CPU on the fetch round trips (and made the broker spend more) than
on its records (docs/performance.md, "Fetches that wait for data"). The app's transport makes that consumer with
a consumer thread that sets both on the consumer it creates, before it starts: aiokafka reads them when ``start``
builds its fetcher. Everything else is Faust's own.
"""

from __future__ import annotations

from typing import Any, Mapping

import faust
from faust.transport.drivers import aiokafka as faust_aiokafka

from gpumeter.errors import ConfigError


def apply_consumer_fetch(consumer: Any, fetch: Mapping[str, int]) -> None:
    """Set ``fetch`` (``fetch_min_bytes``, ``fetch_max_wait_ms``) on an aiokafka consumer not yet started. Raises
    ``ConfigError`` when the consumer keeps no such setting (an aiokafka that changed how it stores them: the
    attributor must not start with fetches silently left at the defaults), or when it already started."""
    if getattr(consumer, "_fetcher", None) is not None:
        raise ConfigError("the consumer's fetch settings can only be set before it starts")
    for name, value in fetch.items():
        attribute = f"_{name}"
        if not hasattr(consumer, attribute):
            raise ConfigError(f"this aiokafka's consumer keeps no {attribute}: cannot set {name} on Faust's consumer "
                              f"(aiokafka {getattr(faust_aiokafka.aiokafka, '__version__', '?')})")
        setattr(consumer, attribute, int(value))


class _ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        apply_consumer_fetch(consumer, self.app.consumer_fetch)
        return consumer


class _Consumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
        return _ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class _Transport(faust_aiokafka.Transport):
    Consumer = _Consumer


class FetchTunedApp(faust.App):
    """``faust.App`` whose worker consumer fetches with ``consumer_fetch`` (``KafkaSettings.consumer_fetch_kwargs``);
    the broker URLs must be ``kafka://`` ones (Faust's aiokafka transport, the one the attributor runs on)."""

    def __init__(self, *args: Any, consumer_fetch: Mapping[str, int], **kwargs: Any) -> None:
        self.consumer_fetch = dict(consumer_fetch)
        super().__init__(*args, **kwargs)

    def _new_transport(self) -> Any:
        urls = self.conf.broker_consumer
        if any(url.scheme not in ("kafka", "aiokafka") for url in urls):
            raise ConfigError(f"the attributor runs on Faust's aiokafka transport, not {urls[0]}")
        return _Transport(urls, self)


__all__ = ["FetchTunedApp", "apply_consumer_fetch"]
