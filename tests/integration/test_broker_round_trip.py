"""Every record type through the real broker: produce single-object Avro, consume, decode, compare."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from aiokafka import AIOKafkaConsumer

from gpumeter.kafka.admin import create_topics
from gpumeter.kafka.producer import PartlyEnqueued, RecordProducer, refused_for_good
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


def _cost_records(count: int, prefix: str) -> list:
    from schemas.records import CostRecord

    example = load_examples(CostRecord)[0]
    return [dataclasses.replace(example, pod_name=f"{prefix}-{i}", cost_micro_usd=i) for i in range(count)]


async def test_a_batch_lands_as_one_send_per_record_would(kafka_settings, topic_catalog, group_id):
    """``send_batch``: the records of a key on the partition ``send`` picks for it, in order, each once -- across
    several batches when they do not fit one (a 2 KiB batch here)."""
    producer = RecordProducer(kafka_settings, max_batch_bytes=2048)
    await producer.start()
    batched, single = _cost_records(40, "batched"), _cost_records(7, "single")
    try:
        futures = await producer.send_batch(topic_catalog.costs, batched, key=b"node-a")
        assert len(futures) == 40 and 1 < len({id(f) for f in futures}) < 40  # several batches, not 40 sends
        for record in single:
            await producer.send(topic_catalog.costs, record, key=b"node-b")
        await producer.flush()
    finally:
        await producer.stop()
    messages = await _consume_all(kafka_settings, topic_catalog.costs, 47, group_id)
    codec = codec_for(type(batched[0]))
    by_key = {key: [m for m in messages if m.key == key] for key in (b"node-a", b"node-b")}
    assert [codec.decode(m.value) for m in by_key[b"node-a"]] == batched
    assert [codec.decode(m.value) for m in by_key[b"node-b"]] == single
    assert {m.partition for m in by_key[b"node-a"]} == {partition_for_node("node-a", 3)}
    assert {m.partition for m in by_key[b"node-b"]} == {partition_for_node("node-b", 3)}


async def test_a_record_too_large_stops_a_batch_as_send_refuses_it(kafka_settings, topic_catalog, group_id):
    """A record over ``max_request_size`` is refused for good as ``send`` refuses it; the records before it are
    enqueued (their futures in ``PartlyEnqueued``) and delivered, nothing after it is."""
    settings = dataclasses.replace(kafka_settings, max_request_size_bytes=65536)
    records = _cost_records(5, "fits")
    records[3] = dataclasses.replace(records[3], labels={"big": "x" * 100_000})
    producer = RecordProducer(settings)
    await producer.start()
    try:
        with pytest.raises(PartlyEnqueued) as refused:
            await producer.send_batch(topic_catalog.costs, records, key=b"node-c")
        assert refused_for_good(refused.value)
        assert len(refused.value.enqueued) == 3
        await asyncio.gather(*refused.value.enqueued)
    finally:
        await producer.stop()
    messages = await _consume_all(settings, topic_catalog.costs, 3, group_id)
    codec = codec_for(type(records[0]))
    assert [codec.decode(m.value) for m in messages if m.key == b"node-c"] == records[:3]
