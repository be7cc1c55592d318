"""An in-memory broker and the driver that runs processors over it: the stream without Kafka.

``MemoryBroker`` keeps topics of partitions of (key, value bytes, timestamp) with offsets, partitioned as Kafka's
default partitioner does (murmur2 of the key) or by node (``schemas.catalog.partition_for_node``), so what
``gpumeter replay`` and the tests run is the stream's own bytes: every record is encoded on the way in and decoded
by the runner on the way out, and bad bytes meet the same checks and dead letters as on Kafka.

``MemoryDriver(runner, broker, outputs)`` reads the runner's input topics from its own positions, in the order the
messages would be seen on a caught-up consumer (by timestamp, then topic order, partition and offset: a record
produced earlier is read earlier), steps each, produces its emits and hands its state changes to ``apply`` (the
driver's stand-in for what a Kafka driver makes durable before committing). ``run(until_ms)`` also ticks the
processor's clock at ``tick_ms`` boundaries between messages, as a streaming service's timer would.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

from gpumeter.kafka.deadletter import RawMessage
from gpumeter.stream.contract import Emit, Position, Result
from gpumeter.stream.runner import MessageRunner
from schemas.catalog import murmur2, partition_for_node
from schemas.typed import codec_for


@dataclass(frozen=True, slots=True)
class Stored:
    key: bytes | None
    value: bytes | None
    timestamp_ms: int


class MemoryBroker:
    """Topics of partitions in memory. ``create(topic, partitions)`` first; ``produce`` appends."""

    def __init__(self) -> None:
        self._topics: dict[str, list[list[Stored]]] = {}

    def create(self, topic: str, partitions: int = 1) -> None:
        if partitions < 1:
            raise ValueError("a topic has at least one partition")
        existing = self._topics.get(topic)
        if existing is not None and len(existing) != partitions:
            raise ValueError(f"topic {topic} exists with {len(existing)} partitions")
        self._topics.setdefault(topic, [[] for _ in range(partitions)])

    def partitions(self, topic: str) -> int:
        return len(self._topics[topic])

    def produce(self, topic: str, key: bytes | None, value: bytes | None, *, timestamp_ms: int,
                partition: int | None = None) -> Position:
        parts = self._topics[topic]
        if partition is None:
            partition = (murmur2(key) & 0x7FFFFFFF) % len(parts) if key is not None else 0
        parts[partition].append(Stored(key, value, timestamp_ms))
        return Position(topic, partition, len(parts[partition]) - 1)

    def produce_record(self, topic: str, emit: Emit, timestamp_ms: int) -> Position:
        """Encode ``emit.record`` (its type's newest schema) and append it where Kafka would put it."""
        value = codec_for(type(emit.record)).encode(emit.record)
        partition = None
        if emit.partition_by_node is not None:
            partition = partition_for_node(emit.partition_by_node, self.partitions(topic))
        return self.produce(topic, emit.key, value, timestamp_ms=timestamp_ms, partition=partition)

    def messages(self, topic: str, partition: int, offset: int = 0) -> Iterator[RawMessage]:
        for index, stored in enumerate(self._topics[topic][partition][offset:], start=offset):
            yield RawMessage(topic, partition, index, stored.key, stored.value, stored.timestamp_ms)

    def end_offsets(self, topic: str) -> tuple[int, ...]:
        return tuple(len(p) for p in self._topics[topic])

    def records(self, topic: str, record_type: type) -> list[Any]:
        """Every decodable record of ``topic`` (all partitions, by partition then offset)."""
        codec = codec_for(record_type)
        out = []
        for partition in range(self.partitions(topic)):
            for message in self.messages(topic, partition):
                if message.value is not None:
                    out.append(codec.decode(message.value))
        return out


@dataclass
class MemoryDriver:
    """Runs one ``MessageRunner`` over a ``MemoryBroker`` (see the module docstring). ``outputs``: emit role ->
    topic; ``apply(changes, result)``: what a Kafka driver would make durable (e.g. billing's ledger writes) —
    it may return a result of its own (records owed once the changes are durable), produced next."""

    runner: MessageRunner
    broker: MemoryBroker
    outputs: Mapping[str, str]
    apply: Callable[[tuple[Any, ...], Result], Result | None] | None = None
    positions: dict[tuple[str, int], int] = field(default_factory=dict)
    clock_of: Callable[[int], int] | None = None  # a message's timestamp -> the runner clock to set (replay)

    def _pending(self) -> Iterable[RawMessage]:
        streams = []
        topic_order = {topic: n for n, topic in enumerate(self.runner.inputs.by_topic)}
        for topic in self.runner.inputs.by_topic:
            for partition in range(self.broker.partitions(topic)):
                start = self.positions.get((topic, partition), 0)
                streams.append(((m.timestamp_ms or 0, topic_order[topic], partition, m.offset), m)
                               for m in self.broker.messages(topic, partition, start))
        for _, message in heapq.merge(*streams, key=lambda item: item[0]):
            yield message

    def emit(self, result: Result, timestamp_ms: int) -> None:
        for emit in result.emits:
            self.broker.produce_record(self.outputs[emit.output], emit, timestamp_ms)

    def _settle(self, result: Result, timestamp_ms: int) -> None:
        if result.changes and self.apply is not None:
            owed = self.apply(result.changes, result)
            result = Result(result.emits) if owed is None else Result(result.emits) + owed
        self.emit(result, timestamp_ms)

    def run(self, *, on_message: Callable[[RawMessage], None] | None = None,
            before_message: Callable[[RawMessage], None] | None = None) -> int:
        """Step every message not read yet; return how many. ``before_message`` runs first for each (a replay
        moves its clock and ticks there)."""
        count = 0
        for message in list(self._pending()):
            if before_message is not None:
                before_message(message)
            step = self.runner.step(message)
            self.positions[(message.topic, message.partition)] = message.offset + 1
            self._settle(step.result, message.timestamp_ms or 0)
            if on_message is not None:
                on_message(message)
            count += 1
        return count

    def tick(self, now_ms: int) -> Result:
        result = self.runner.tick(now_ms)
        self._settle(result, now_ms)
        return result


__all__ = ["MemoryBroker", "MemoryDriver", "Stored"]
