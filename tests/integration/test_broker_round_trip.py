"""Every record type through the real broker: produce single-object Avro, consume, decode, compare."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer

from gpumeter.kafka.admin import create_topics
from gpumeter.kafka.producer import RecordProducer
from schemas.catalog import ALL_TOPICS, TopicCatalog, partition_for_node
from schemas.examples import load_examples
from schemas.typed import codec_for

pytestmark = pytest.mark.integration


async def _consume_all(settings, topic: str, count: int, group: str) -> list:
    consumer = AIOKafkaConsumer(topic, **settings.client_kwargs(), group_id=group, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    messages = []
    try:
        while len(messages) < count:
            batch = await asyncio.wait_for(consumer.getmany(timeout_ms=500), 30)
            for records in batch.values():
                messages.extend(records)
    finally:
        await consumer.stop()
    return messages


async def test_every_record_type_round_trips_through_the_broker(kafka_settings, topic_catalog, group_id):
    producer = RecordProducer(kafka_settings)
    await producer.start()
    expected = {}
    try:
        for spec in ALL_TOPICS:
            records = load_examples(spec.record_type)
            expected[spec.name] = records
            for record in records:
                await producer.send(topic_catalog.name(spec), record, key=b"k")
        await producer.flush()
    finally:
        await producer.stop()
    for spec in ALL_TOPICS:
        messages = await _consume_all(kafka_settings, topic_catalog.name(spec), len(expected[spec.name]), group_id)
        decoded = [codec_for(spec.record_type).decode(m.value) for m in messages]
        assert decoded == expected[spec.name]
        assert all(m.key == b"k" for m in messages)


async def test_topic_creation_is_idempotent_and_follows_the_catalog(kafka_settings):
    catalog = TopicCatalog(prefix=kafka_settings.topic_prefix + "idem.")
    first = await create_topics(kafka_settings, catalog)
    second = await create_topics(kafka_settings, catalog)
    assert [r.created for r in first] == [True] * len(ALL_TOPICS)
    assert [r.created for r in second] == [False] * len(ALL_TOPICS)
    assert {r.name: r.partitions for r in second} == {catalog.name(s): s.partitions for s in ALL_TOPICS}


async def test_default_partitioner_agrees_with_partition_for_node(kafka_settings, topic_catalog):
    """Keyed by node name, a sample lands where partition_for_node says: pod events can be sent there too."""
    producer = RecordProducer(kafka_settings)
    await producer.start()
    try:
        for node in ("gpu-node-a", "gpu-node-b", "n" * 40, "ip-10-0-3-17.ec2.internal"):
            future = await producer.send_bytes(topic_catalog.node_samples, b"x", key=node.encode())
            metadata = await future
            assert metadata.partition == partition_for_node(node, 3)
    finally:
        await producer.stop()
