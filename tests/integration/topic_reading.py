"""Reading what a topic holds, for integration tests: without a consumer group and up to the end offsets taken
when the read starts.

Why not a group and an idle timeout: right after a broker restart the group coordinator can be unavailable for
seconds, a group consumer then fetches nothing (or stops mid-topic for a rebalance), and an idle timeout mistakes
that for the end of the topic. Assigned partitions and end offsets make "everything that was there" exact.
"""

from __future__ import annotations

import time

from aiokafka import AIOKafkaConsumer, TopicPartition

from gpumeter.kafka.admin import partition_numbers
from schemas.typed import codec_for

READ_TIMEOUT_S = 60.0


async def topic_partitions(settings, topic: str) -> list[TopicPartition]:
    """Every partition of ``topic``, from the broker's metadata, in partition order."""
    return [TopicPartition(topic, p) for p in (await partition_numbers(settings, [topic]))[topic]]


async def read_messages(settings, topic: str, timeout_s: float = READ_TIMEOUT_S) -> list:
    """Every message on ``topic`` now, from the beginning up to the end offsets taken at the start (committed ones
    only), partition by partition in offset order. Raises ``TimeoutError`` if the end is not reached in
    ``timeout_s``: a short read must fail the test, not shrink its input."""
    partitions = await topic_partitions(settings, topic)
    consumer = AIOKafkaConsumer(**settings.client_kwargs(), group_id=None, enable_auto_commit=False,
                                isolation_level="read_committed")
    await consumer.start()
    try:
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        by_partition: dict[int, list] = {tp.partition: [] for tp in partitions}
        deadline = time.monotonic() + timeout_s
        while [tp for tp in partitions if await consumer.position(tp) < ends[tp]]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: end offsets {ends} not reached in {timeout_s} s")
            for tp, messages in (await consumer.getmany(timeout_ms=200)).items():
                by_partition[tp.partition].extend(m for m in messages if m.offset < ends[tp])
        return [message for p in sorted(by_partition) for message in by_partition[p]]
    finally:
        await consumer.stop()


async def read_topic(settings, topic: str, record_type) -> list:
    """Every record on ``topic`` now (see ``read_messages``), decoded as ``record_type``."""
    decode = codec_for(record_type).decode
    return [decode(m.value) for m in await read_messages(settings, topic)]


async def read_records(settings, topic: str, decode) -> list[tuple[bytes | None, object]]:
    """Every (key, decoded value) on ``topic`` now (see ``read_messages``)."""
    return [(m.key, decode(m.value)) for m in await read_messages(settings, topic)]


async def end_offsets(settings, topic: str) -> dict[int, int]:
    """The end offset of every partition of ``topic``, by partition number."""
    partitions = await topic_partitions(settings, topic)
    consumer = AIOKafkaConsumer(**settings.client_kwargs(), group_id=None)
    await consumer.start()
    try:
        return {tp.partition: offset for tp, offset in (await consumer.end_offsets(partitions)).items()}
    finally:
        await consumer.stop()
