"""The one processing contract every service's logic is written against: ``handle(event, position) -> Result``.

A **processor** is the whole of a service's logic, free of Kafka: the runner (``gpumeter.stream.runner``) decodes
each consumed message into a typed record, checks it, and hands it to the processor as an ``Event`` with its
``Position``; the processor answers with an immutable ``Result`` — the records to emit, the state changes its
driver must make durable before the input is committed, and rejections of the event it found only after decoding
(each becomes a dead letter through the runner, like a message that did not decode). ``on_clock(now_ms)`` is the
same for time passing (windows of silent nodes closing, violations resolving).

Drivers hand the runner what they fetched as one batch; the runner decodes and checks each message (a bad one is
dead-lettered on its own, the rest go on) and hands the processor every good one in one ``handle_batch`` call,
which answers per event, in order. A processor that does per-batch work (one ledger write, one pass over a node's
samples) implements it; the default (``handle_each``) calls ``handle`` per event. Either way the result must not
depend on where the batches were cut: the same input in batches of 1, 7 or 1000 gives the same records. Partitions
come and go through ``on_assigned`` / ``on_revoked`` (default: nothing to do), called by every driver: its result
is settled like a batch's, before a revoked partition's input is committed for the last time.

The same processor runs under every driver: an aiokafka consumer group (billing, guard), a Faust worker (the
attributor), and the in-memory broker (``gpumeter.stream.memory``) that ``gpumeter replay`` and the tests use. What
a driver adds is transport: fetching, producing, committing after what the results asked for is durable. So
replay and the stream produce the same records, bad input included, by construction.

Outputs and inputs are named by role (``Input.name``, ``Emit.output``: ``samples``, ``pod_events``,
``window_shares``, ``costs``, ...); the driver maps roles to topics (``schemas.catalog``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Generic, Mapping, Protocol, Sequence, TypeVar

from gpumeter.errors import InvalidMessage

T = TypeVar("T")

DEAD_LETTERS = "dead_letters"
"""The output role of dead letters, which the runner emits for every rejected message."""

TopicPartition = tuple[str, int]
"""A partition of an input topic, as drivers assign and revoke it: (topic, partition)."""


@dataclass(frozen=True, slots=True, order=True)
class Position:
    """Where a message was read: its topic, partition and offset (the in-memory broker numbers alike)."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class Event(Generic[T]):
    """One decoded, checked input record. ``input`` is its role; ``received_at_unix_ms`` the runner's clock when it
    was handed over (what range checks judge timestamps against); ``timestamp_ms`` the message's own."""

    input: str
    record: T
    key: bytes | None
    received_at_unix_ms: int
    timestamp_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Emit:
    """One record to produce. ``partition_by_node``: send it to ``partition_for_node(this)`` (co-partitioned with
    the node's samples) instead of by key; ``latest_wins``: it is a state on a compacted topic (an older state of
    the same key is never re-sent over a newer one)."""

    output: str
    key: bytes | None
    record: Any
    partition_by_node: str | None = None
    latest_wins: bool = False


@dataclass(frozen=True, slots=True)
class Result:
    """What one ``handle`` or ``on_clock`` produced. ``emits`` go out in order; ``changes`` are the processor's own
    state changes (its driver applies them before committing the input they came from); ``rejected`` are reasons
    the event itself is bad, found after decoding (each is dead-lettered with the event's bytes)."""

    emits: tuple[Emit, ...] = ()
    changes: tuple[Any, ...] = ()
    rejected: tuple[InvalidMessage, ...] = ()

    def __add__(self, other: "Result") -> "Result":
        if not other:
            return self
        if not self:
            return other
        return Result(self.emits + other.emits, self.changes + other.changes, self.rejected + other.rejected)

    def __bool__(self) -> bool:
        return bool(self.emits or self.changes or self.rejected)


NOTHING = Result()


@dataclass(frozen=True)
class Input:
    """One input role of a processor: the record type its messages decode to (``bytes``: not decoded, the record is
    the message's value as the topic carried it), and the range check the runner applies before ``handle``
    (``check(record, now_ms)`` raises ``InvalidMessage``; None: none)."""

    name: str
    record_type: type
    check: Callable[[Any, int], None] | None = None
    tombstones: bool = False  # a message without value is a deletion (compacted topics) rather than bad input


class Processor(Protocol):
    """A service's logic. ``service`` names it in dead letters and metrics. ``inputs`` are in the order of
    precedence at one instant: a driver that orders its input (the in-memory broker) reads messages of the same
    time in this order (a pod event before the sample of its instant)."""

    service: str
    inputs: Sequence[Input]

    def handle(self, event: Event, position: Position) -> Result:
        """The result of one input record. Raises ``InvalidMessage`` to reject it (dead-lettered by the runner);
        any other exception is a bug and stops the service."""
        ...

    def on_clock(self, now_ms: int, caught_up: bool = True) -> Result:
        """The result of time passing to ``now_ms``. ``caught_up``: whether the driver has read every input that
        existed at ``now_ms`` (false during a backlog, and at the end of a replay's input: silence then is not a
        node's silence, so nothing may be judged from it)."""
        ...

    # Optional (the runner falls back to ``handle_each`` / nothing): ``handle_batch``, ``on_assigned``,
    # ``on_revoked``; ``ProcessorDefaults`` has them for a processor to inherit.


def handle_each(processor: Processor, events: Sequence[tuple[Event, Position]]) -> list[Result | InvalidMessage]:
    """The default ``handle_batch``: ``processor.handle`` per event, in order; an ``InvalidMessage`` it raises is
    that event's outcome (the runner dead-letters that message alone) and the next event is handled."""
    outcomes: list[Result | InvalidMessage] = []
    for event, position in events:
        try:
            outcomes.append(processor.handle(event, position))
        except InvalidMessage as error:
            outcomes.append(error)
    return outcomes


class ProcessorDefaults:
    """The optional part of the processor contract, for a processor to inherit.

    ``handle_batch(events)``: the outcome of each ``(event, position)`` of one batch, in order -- its ``Result``,
    or the ``InvalidMessage`` that rejects it outright (as ``handle`` raising it would). A batch is what one fetch
    brought (consecutive in each partition, partitions in no promised order; under the in-memory driver, messages
    of one instant in the order of ``inputs``). The outcomes must not depend on where batches were cut: the same
    input cut differently gives the same records, in the same order. Default: ``handle`` per event.

    ``on_assigned(partitions)`` / ``on_revoked(partitions)``: the driver now reads ``partitions`` (topic,
    partition) / stops reading them. ``on_revoked`` comes after the last batch of those partitions and before
    their last commit; its result is settled (emitted, its changes made durable) before that commit, so state a
    processor flushes there is never behind a committed offset (a driver that cannot make it durable commits
    nothing). An eager rebalance (aiokafka's) revokes every partition and assigns the kept ones again, so
    ``on_revoked`` leaves nothing undurable behind; the Faust driver tells only of partitions lost and gained.
    Default: nothing to do."""

    def handle_batch(self, events: Sequence[tuple[Event, Position]]) -> Sequence[Result | InvalidMessage]:
        return handle_each(self, events)  # type: ignore[arg-type]

    def on_assigned(self, partitions: Collection[TopicPartition]) -> Result:
        return NOTHING

    def on_revoked(self, partitions: Collection[TopicPartition]) -> Result:
        return NOTHING


@dataclass(frozen=True, slots=True)
class Settled:
    """What became of one state change once the driver's ``Store`` applied it: the records it now owes (produced
    after the change is durable, in order), or why the store refused it (the input it came from is dead-lettered
    with that reason, and its owed records are not produced)."""

    owed: tuple[Emit, ...] = ()
    rejected: InvalidMessage | None = None


class Store(Protocol):
    """Where a processor's state changes become durable before the input they came from is committed (billing:
    the ledger). The same store runs under every driver, so what is durable and what is owed is decided alike.

    ``apply`` is blocking (a Kafka driver runs it in a worker thread); it answers one ``Settled`` per change, in
    order, and raises ``StoreUnavailable`` when nothing was applied and a retry may succeed (the driver backs off
    and retries the same changes). ``published(changes, now_ms)``: every record those changes owed was
    acknowledged downstream."""

    def apply(self, changes: Sequence[Any]) -> Sequence[Settled]: ...

    def published(self, changes: Sequence[Any], now_ms: int) -> None: ...


class StoreUnavailable(Exception):
    """Raised by ``Store.apply`` when it applied nothing and the same call may succeed later (the store is
    unreachable or restarting)."""


@dataclass(frozen=True, slots=True)
class Step:
    """What the runner made of one message: the processor's result (its emits, then the dead letters of anything
    rejected, as emits to ``DEAD_LETTERS``), and whether the message was handled at all."""

    position: Position
    result: Result
    handled: bool
    dead_lettered: int = 0


@dataclass
class Inputs:
    """A processor's inputs by role and, once the driver binds them, by topic."""

    by_role: Mapping[str, Input]
    by_topic: dict[str, Input] = field(default_factory=dict)

    @classmethod
    def of(cls, processor: Processor, topics: Mapping[str, str]) -> "Inputs":
        """``topics``: role -> topic name."""
        by_role = {i.name: i for i in processor.inputs}
        missing = set(by_role) - set(topics)
        if missing:
            raise ValueError(f"no topic for input role(s) {sorted(missing)} of {processor.service}")
        return cls(by_role, {topics[name]: spec for name, spec in by_role.items()})


__all__ = ["DEAD_LETTERS", "NOTHING", "Emit", "Event", "Input", "Inputs", "Position", "Processor", "ProcessorDefaults",
           "Result", "Settled", "Step", "Store", "StoreUnavailable", "TopicPartition", "handle_each"]
