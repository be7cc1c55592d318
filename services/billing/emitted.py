"""What the attributor emitted, read back from Kafka, for ``gpumeter report`` to compare with the ledger.

The ledger alone cannot show what never reached it: a billing service that crash-loops, stops, or retries one
record forever leaves the ledger consistent with itself, and a report on it reconciles. What was emitted is on the
node-window-shares topic; what billing refused is on the dead-letters topic. ``read_emitted`` reads both for the
windows of a report:

* the ``NodeWindowShares`` of every node-window starting in [start_ms, end_ms), from each partition's first record
  stamped at or after ``start_ms`` (a node-window is produced after it ended, so its Kafka timestamp is later than
  the window's start: the attributor's clock is the wall clock) up to the end offsets taken when the read starts;
* the dead letters billing wrote for those node-windows (their values decode as ``NodeWindowShares``; a value cut
  to fit a dead letter -- never a real node-window -- is skipped), from the same time on.

Undecodable values are skipped (billing dead-lettered them; they name no window). This module only reads;
the comparison is ``services.billing.report.check_emitted`` (pure).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gpumeter.errors import GpumeterError, InvalidMessage
from gpumeter.settings import KafkaSettings
from schemas.catalog import TopicCatalog
from schemas.records import DeadLetter, NodeWindowShares
from schemas.typed import codec_for
from services.billing.costing import NodeWindowKey

BILLING_SERVICE = "billing"
READ_TIMEOUT_SECONDS = 60.0


class EmittedUnavailable(GpumeterError):
    """The topics could not be read (Kafka unreachable, a topic missing, the read did not finish in time)."""


@dataclass(frozen=True)
class Emitted:
    """Per node-window of the range: when it was last emitted (ms, the record's Kafka timestamp), and the
    reason codes billing dead-lettered its rows with (empty: none)."""

    emitted_at_ms: dict[NodeWindowKey, int] = field(default_factory=dict)
    dead_lettered: dict[NodeWindowKey, frozenset[str]] = field(default_factory=dict)


def _in_range(shares: NodeWindowShares, start_ms: int, end_ms: int, cluster: str | None) -> bool:
    return start_ms <= shares.window_start_unix_ms < end_ms and (cluster is None or shares.cluster == cluster)


def _key(shares: NodeWindowShares) -> NodeWindowKey:
    return NodeWindowKey(shares.cluster, shares.node_name, shares.window_start_unix_ms)


async def _read_from_time(kafka: KafkaSettings, topic: str, start_ms: int):
    """Every record of ``topic`` stamped at or after ``start_ms``, up to the end offsets taken now."""
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.errors import KafkaError

    from gpumeter.kafka.admin import partition_numbers

    try:
        partitions = (await partition_numbers(kafka, [topic])).get(topic)
    except (KafkaError, OSError) as exc:
        raise EmittedUnavailable(f"cannot read {topic} at {kafka.bootstrap_servers}: {exc!r}") from exc
    if not partitions:
        raise EmittedUnavailable(f"topic {topic} does not exist")
    consumer = AIOKafkaConsumer(**kafka.client_kwargs(), group_id=None, enable_auto_commit=False,
                                isolation_level="read_committed")
    try:
        await consumer.start()
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        starts = await consumer.offsets_for_times({tp: start_ms for tp in tps})
        remaining = {}
        for tp in tps:
            found = starts.get(tp)
            if found is not None and found.offset < ends[tp]:
                consumer.seek(tp, found.offset)
                remaining[tp] = ends[tp]
        records = []
        while remaining:
            batch = await consumer.getmany(*remaining, timeout_ms=500)
            for tp, messages in batch.items():
                records.extend(m for m in messages if m.offset < remaining.get(tp, -1))
            for tp in list(remaining):
                if await consumer.position(tp) >= remaining[tp]:
                    del remaining[tp]
        return records
    except (KafkaError, OSError) as exc:
        raise EmittedUnavailable(f"cannot read {topic} at {kafka.bootstrap_servers}: {exc!r}") from exc
    finally:
        await consumer.stop()


async def read_emitted_async(kafka: KafkaSettings, topics: TopicCatalog, *, start_ms: int, end_ms: int,
                             cluster: str | None = None) -> Emitted:
    shares = await _read_from_time(kafka, topics.node_window_shares, start_ms)
    letters = await _read_from_time(kafka, topics.dead_letters, start_ms)
    emitted: dict[NodeWindowKey, int] = {}
    share_codec = codec_for(NodeWindowShares)
    for record in shares:
        try:
            share = share_codec.decode(record.value or b"")
        except InvalidMessage:
            continue
        if _in_range(share, start_ms, end_ms, cluster):
            key = _key(share)
            emitted[key] = max(emitted.get(key, record.timestamp), record.timestamp)
    dead: dict[NodeWindowKey, set[str]] = {}
    letter_codec = codec_for(DeadLetter)
    for record in letters:
        try:
            letter = letter_codec.decode(record.value or b"")
            if (letter.service != BILLING_SERVICE or letter.source_topic != topics.node_window_shares
                    or letter.truncated):
                continue
            share = share_codec.decode(letter.raw_bytes)
        except InvalidMessage:
            continue
        if _in_range(share, start_ms, end_ms, cluster):
            dead.setdefault(_key(share), set()).add(letter.reason_code)
    return Emitted(emitted, {key: frozenset(reasons) for key, reasons in dead.items()})


def read_emitted(kafka: KafkaSettings, topics: TopicCatalog, *, start_ms: int, end_ms: int,
                 cluster: str | None = None, timeout_seconds: float = READ_TIMEOUT_SECONDS) -> Emitted:
    """``read_emitted_async`` from synchronous code (``gpumeter report``). Raises ``EmittedUnavailable``."""

    async def bounded() -> Emitted:
        try:
            return await asyncio.wait_for(
                read_emitted_async(kafka, topics, start_ms=start_ms, end_ms=end_ms, cluster=cluster),
                timeout_seconds)
        except asyncio.TimeoutError as exc:
            raise EmittedUnavailable(f"reading the emitted windows did not finish in {timeout_seconds:g} s") from exc

    return asyncio.run(bounded())
