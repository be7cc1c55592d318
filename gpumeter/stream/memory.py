"""An in-memory broker and the driver that runs processors over it: the stream without Kafka.

``MemoryBroker`` keeps topics of partitions of (key, value bytes, timestamp) with offsets, partitioned as Kafka's
default partitioner does (murmur2 of the key) or by node (``schemas.catalog.partition_for_node``), so what
``gpumeter replay`` and the tests run is the stream's own bytes: every record is encoded on the way in and decoded
by the runner on the way out, and bad bytes meet the same checks and dead letters as on Kafka.

``MemoryDriver(runner, broker, outputs, store, batch_size=n)`` reads the runner's input topics from its own
positions, in the order the messages would be seen on a caught-up consumer (by timestamp, then the order of the
processor's inputs, partition and offset: a record produced earlier is read earlier), in batches of at most
``batch_size`` messages of one instant (a caught-up consumer's timer runs between instants, never inside a batch),
steps each batch through the runner (``step_batch``: one ``handle_batch`` call), hands the batch's state changes
to the store in one ``apply`` (the same ``Store`` a Kafka driver makes them durable in before committing) and
produces what the runner settles: each step's emits, then what each change owes, or the dead letter of a change
the store refused. Produced records are durable at once, so ``on_produced`` (if given) runs after every settlement
that produced something, and its result is settled too: the acknowledgement a Kafka producer's callback gives
later (the attributor moves a node's progress past an emitted window then). ``tick(now_ms)`` runs the processor's
clock, as a streaming service's timer does; the caller (``gpumeter replay``) decides when. The driver owns every
partition of its inputs: the first ``run`` tells the processor so (``on_assigned``); nothing is ever revoked.

The batch size changes nothing of the output: the tests run the same input in batches of 1, 7 and 1000 and
compare every record byte for byte, which is what holds a processor's batch work to the contract.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from gpumeter.stream.deadletter import RawMessage
from gpumeter.stream.contract import Emit, Position, Result, Store, TopicPartition
from gpumeter.stream.runner import MessageRunner, changes_of
from schemas.catalog import murmur2, partition_for_node
from schemas.typed import codec_for


@dataclass(frozen=True, slots=True)
class Stored:
    key: bytes | None
    value: bytes | None
    timestamp_ms: int


class MemoryBroker:
    """Topics of partitions in memory. ``create(topic, partitions)`` first; ``produce`` appends. ``trim`` forgets
    what every reader has read (as a log's retention does): offsets go on from where they were."""

    def __init__(self) -> None:
        self._topics: dict[str, list[list[Stored]]] = {}
        self._base: dict[tuple[str, int], int] = {}  # the offset of each partition's first kept message

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
        return Position(topic, partition, self._base.get((topic, partition), 0) + len(parts[partition]) - 1)

    def produce_record(self, topic: str, emit: Emit, timestamp_ms: int) -> Position:
        """Encode ``emit.record`` (its type's newest schema) and append it where Kafka would put it."""
        value = codec_for(type(emit.record)).encode(emit.record)
        partition = None
        if emit.partition_by_node is not None:
            partition = partition_for_node(emit.partition_by_node, self.partitions(topic))
        return self.produce(topic, emit.key, value, timestamp_ms=timestamp_ms, partition=partition)

    def messages(self, topic: str, partition: int, offset: int = 0) -> Iterator[RawMessage]:
        """The kept messages of a partition from ``offset`` (from the first kept one when it was trimmed)."""
        base = self._base.get((topic, partition), 0)
        offset = max(offset, base)
        for index, stored in enumerate(self._topics[topic][partition][offset - base:], start=offset):
            yield RawMessage(topic, partition, index, stored.key, stored.value, stored.timestamp_ms)

    def end_offsets(self, topic: str) -> tuple[int, ...]:
        return tuple(self._base.get((topic, p), 0) + len(stored) for p, stored in enumerate(self._topics[topic]))

    def trim(self) -> None:
        """Forget every message: each partition keeps its end offset, where the next produced message goes."""
        for topic, parts in self._topics.items():
            for partition, stored in enumerate(parts):
                self._base[(topic, partition)] = self._base.get((topic, partition), 0) + len(stored)
                stored.clear()

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
    topic; ``store``: where the processor's state changes become durable (``gpumeter.stream.contract.Store``, the
    same one the Kafka driver uses; None: changes owe nothing); ``batch_size``: the most messages handed to the
    processor at once (all of one instant). Each batch is settled at once, as a Kafka driver settles a fetch."""

    runner: MessageRunner
    broker: MemoryBroker
    outputs: Mapping[str, str]
    store: Store | None = None
    on_produced: Callable[[], Result] | None = None
    positions: dict[tuple[str, int], int] = field(default_factory=dict)
    batch_size: int = 1
    assigned: frozenset[TopicPartition] = frozenset()

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError("a batch holds at least one message")

    def _pending(self) -> Iterable[RawMessage]:
        def keyed(rank: int, topic: str, partition: int) -> Iterator[tuple[tuple[int, int, int, int], RawMessage]]:
            start = self.positions.get((topic, partition), 0)
            for m in self.broker.messages(topic, partition, start):
                yield (m.timestamp_ms or 0, rank, partition, m.offset), m

        streams = [keyed(rank, topic, partition)
                   for rank, topic in enumerate(self.runner.inputs.by_topic)
                   for partition in range(self.broker.partitions(topic))]
        for _, message in heapq.merge(*streams, key=lambda item: item[0]):
            yield message

    def _batches(self) -> Iterator[list[RawMessage]]:
        batch: list[RawMessage] = []
        for message in self._pending():
            if batch and (len(batch) >= self.batch_size or message.timestamp_ms != batch[0].timestamp_ms):
                yield batch
                batch = []
            batch.append(message)
        if batch:
            yield batch

    def emit(self, emits: Iterable[Emit], timestamp_ms: int) -> None:
        for emit in emits:
            self.broker.produce_record(self.outputs[emit.output], emit, timestamp_ms)

    def _settle(self, steps: Sequence[tuple[RawMessage | None, Result]], timestamp_ms: int, *,
                acknowledging: bool = False) -> None:
        changes = changes_of(steps)
        settled = self.store.apply(changes) if changes and self.store is not None else ()
        settlement = self.runner.settle(steps, settled)
        self.emit(settlement.emits, timestamp_ms)
        if settlement.published and self.store is not None:
            self.store.published(settlement.published, timestamp_ms)
        if settlement.emits and self.on_produced is not None and not acknowledging:
            acknowledged = self.on_produced()
            if acknowledged:
                self._settle(((None, acknowledged),), timestamp_ms, acknowledging=True)

    def _assign(self) -> None:
        partitions = frozenset((topic, partition) for topic in self.runner.inputs.by_topic
                               for partition in range(self.broker.partitions(topic)))
        new = partitions - self.assigned
        if new:
            self.assigned = partitions
            result = self.runner.assigned(new)
            if result:
                self._settle(((None, result),), 0)

    def run(self, *, before_message: Callable[[RawMessage], None] | None = None) -> int:
        """Step every message not read yet, in the order a caught-up consumer sees them, a batch at a time; return
        how many. ``before_message`` runs first for each, before its batch is handled (a replay moves its clock
        and ticks there; every message of a batch has the same time)."""
        self._assign()
        count = 0
        for batch in list(self._batches()):
            if before_message is not None:
                for message in batch:
                    before_message(message)
            steps = self.runner.step_batch(batch)
            for message in batch:
                self.positions[(message.topic, message.partition)] = message.offset + 1
            self._settle([(message, step.result) for message, step in zip(batch, steps)],
                         batch[0].timestamp_ms or 0)
            count += len(batch)
        return count

    def tick(self, now_ms: int, caught_up: bool = True) -> Result:
        """The processor's clock at ``now_ms``; its records are produced stamped ``now_ms``."""
        result = self.runner.tick(now_ms, caught_up)
        self._settle(((None, result),), now_ms)
        return result


__all__ = ["MemoryBroker", "MemoryDriver", "Stored"]
