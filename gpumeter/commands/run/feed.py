"""Kafka for ``gpumeter run``: the local development broker, the view's feed of decoded records (no consumer
group, nothing committed), consumer lag for the drain, and deleting the run's own topics."""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.settings import KafkaSettings



def ensure_broker(progress: Callable[[str], None], env: Mapping[str, str]) -> str:
    """The local development broker's bootstrap servers (127.0.0.1:$GPUMETER_KAFKA_PORT, default 9092), starting
    it when it is not running."""
    from gpumeter.devtools import kafka_broker

    progress("Kafka: checking Apache Kafka's pinned jars (the first run downloads them from Maven Central)...")
    try:
        port = int(env.get("GPUMETER_KAFKA_PORT") or "9092")
    except ValueError as exc:
        raise ConfigError(f"GPUMETER_KAFKA_PORT: {exc}") from exc
    try:
        kafka_broker.ensure_kafka_jars(log=progress)
        progress(f"Kafka: starting (or reusing) the local broker on 127.0.0.1:{port}...")
        code = kafka_broker.main(["start", "--port", str(port)])
    except kafka_broker.BrokerError as exc:
        raise GpumeterError(f"the local Kafka broker: {exc}") from exc
    if code != 0:
        raise GpumeterError(f"the local Kafka broker did not start (exit {code})")
    return f"127.0.0.1:{port}"


class TopicFeed:
    """Reads the view's topics from the beginning (no consumer group, nothing committed) and decodes them."""

    def __init__(self, kafka: KafkaSettings) -> None:
        from schemas.records import CostRecord, DeadLetter, NodeWindowShares, Violation
        from schemas.typed import codec_for

        catalog = kafka.catalog
        self.kafka = kafka
        self.shares_topic = catalog.node_window_shares  # its records are shown as their rows
        self.codecs = {
            catalog.node_window_shares: codec_for(NodeWindowShares),
            catalog.costs: codec_for(CostRecord),
            catalog.violations: codec_for(Violation),
            catalog.dead_letters: codec_for(DeadLetter),
        }
        self.consumer = None
        self.undecodable = 0

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer

        self.consumer = AIOKafkaConsumer(
            *self.codecs, **self.kafka.client_kwargs(), group_id=None, auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        await self.consumer.start()

    async def poll(self, timeout_ms: int = 200) -> list:
        """Decoded records that arrived, in partition order, a node-window's shares as its ``GpuShare`` rows;
        undecodable ones are counted and skipped (the services dead-letter bad input; the view only shows)."""
        from gpumeter.errors import InvalidMessage

        assert self.consumer is not None
        batch = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=5000)
        records = []
        for tp, messages in batch.items():
            codec = self.codecs[tp.topic]
            for message in messages:
                if message.value is None:
                    continue  # a compaction tombstone
                try:
                    record = codec.decode(message.value)
                except InvalidMessage:
                    self.undecodable += 1
                    continue
                if tp.topic == self.shares_topic:
                    records.extend(record.rows())
                else:
                    records.append(record)
        return records

    async def lag(self, admin, group: str, topics: Sequence[str]) -> int:
        """Messages of ``topics`` not yet committed by ``group`` (a partition it never committed counts whole)."""
        from aiokafka import TopicPartition

        assert self.consumer is not None
        partitions = [TopicPartition(topic, p) for topic in topics
                      for p in sorted(self.consumer.partitions_for_topic(topic) or ())]
        if not partitions:
            return 0
        ends = await self.consumer.end_offsets(partitions)
        committed = await admin.list_consumer_group_offsets(group, partitions=partitions)
        total = 0
        for tp in partitions:
            meta = committed.get(tp)
            position = meta.offset if meta is not None and meta.offset >= 0 else 0
            total += max(ends.get(tp, 0) - position, 0)
        return total

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()


async def delete_run_topics(kafka: KafkaSettings, prefix: str) -> list[str]:
    """Delete every topic whose name starts with ``prefix`` (the catalog's and Faust's changelogs)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**kafka.client_kwargs())
    await admin.start()
    try:
        names = [name for name in await admin.list_topics() if name.startswith(prefix)]
        if names:
            await admin.delete_topics(names)
        return sorted(names)
    finally:
        await admin.close()

