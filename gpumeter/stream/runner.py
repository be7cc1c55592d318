"""The one runner: decode, check, hand to the processor, dead-letter what is bad, count, beat. No I/O.

``MessageRunner(processor, topics, clock)`` binds a processor's input roles to topics and turns each consumed
``RawMessage`` into a ``Step`` (``step``) and each clock tick into a ``Result`` (``tick``). Per message, in this
order — the same for every driver, so a message is accepted or rejected alike by the stream and by replay:

1. a message of a topic the processor does not read → ``WRONG_TOPIC``; a message without value → ``EMPTY``
   (unless the input takes tombstones: then its record is None);
2. decode with the input's record type (``schemas.typed``: unknown schema, truncated, corrupt, wrong record type
   are the codec's ``InvalidMessage`` kinds); an input whose record type is ``bytes`` is not decoded: its record
   is the message's value as it is (``gpumeter record`` stores the bytes the topic carried);
3. the input's range check with the runner's clock (``gpumeter.validation``);
4. ``processor.handle(event, position)``: raising ``InvalidMessage`` rejects the message; so does every error in
   the result's ``rejected``.

``step_batch(messages)`` does the same for a fetched batch: steps 1-3 per message (a bad one is dead-lettered on
its own, the rest go on), then one ``processor.handle_batch`` over every good one (``contract.handle_each`` for a
processor without it), then step 4's rejections per message: the same ``Step`` per message as ``step``, in order.
``decoded`` (optional, replay's): a memo ``(record type, bytes) -> record`` shared by runners of one process
that read the same messages, so that each message's bytes are decoded once (records are immutable).
``assigned(partitions)`` / ``revoked(partitions)`` are the processor's ``on_assigned`` / ``on_revoked`` (nothing
for a processor without them); drivers settle their result like a tick's.

A rejected message becomes one dead letter (``gpumeter.stream.deadletter.dead_letter_for``: always within the
producer's request size), emitted to ``DEAD_LETTERS`` keyed by its source topic, counted
(``gpumeter_dead_letters_total``, ``gpumeter_dead_letters_truncated_total``) and logged; the runner carries on.
Any other exception is a bug and propagates. Every message counts in ``gpumeter_messages_consumed_total`` and
every step beats the liveness heartbeat. Every message is also reported to the service's dead-letter window
(``ServiceMetrics.inputs``: one input, dead-lettered or not; a message whose change the store refuses at
``settle`` is reported dead-lettered then), from which ``/healthz`` says whether the service is degraded
(``gpumeter.health``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Mapping, MutableMapping, Sequence

from gpumeter.clock import Clock
from gpumeter.errors import InvalidMessage
from gpumeter.stream.deadletter import RawMessage, cut_text, dead_letter_budget_bytes, dead_letter_for
from gpumeter.settings import DEFAULT_MAX_REQUEST_SIZE_BYTES
from gpumeter.stream.contract import (
    DEAD_LETTERS,
    NOTHING,
    Emit,
    Event,
    Inputs,
    Position,
    Processor,
    Result,
    Settled,
    Step,
    TopicPartition,
    handle_each,
)
from schemas.typed import RecordCodec, codec_for

log = logging.getLogger(__name__)


class WrongTopic(InvalidMessage):
    """A message of a topic the processor does not read (a wiring bug, kept out of the logic)."""

    reason_code = "WRONG_TOPIC"


class EmptyMessage(InvalidMessage):
    """A message without value on an input that takes no tombstones."""

    reason_code = "EMPTY"


@dataclass(frozen=True, slots=True)
class Settlement:
    """What a settled batch produces (``emits``, in order) and the changes whose owed records are among them
    (``published``: what the store hears of once they are acknowledged)."""

    emits: tuple[Emit, ...]
    published: tuple[Any, ...]


def changes_of(steps: Sequence[tuple[RawMessage | None, Result]]) -> list[Any]:
    """Every state change of ``steps``, in order: what a driver hands its store."""
    return [change for _, result in steps for change in result.changes]


class MessageRunner:
    """Runs ``processor`` over raw messages of ``topics`` (role -> topic name). See the module docstring."""

    def __init__(self, processor: Processor, topics: Mapping[str, str], clock: Clock, *, metrics: Any = None,
                 max_request_size_bytes: int = DEFAULT_MAX_REQUEST_SIZE_BYTES, log_dead_letters: bool = True,
                 decoded: MutableMapping[tuple[type, bytes], Any] | None = None) -> None:
        self.processor = processor
        self.service = processor.service
        self.inputs = Inputs.of(processor, topics)
        self.clock = clock
        self.metrics = metrics
        self._consumed_counters: dict[str, Any] = {}  # topic -> its messages-consumed counter
        self.max_request_size_bytes = max_request_size_bytes
        self.log_dead_letters = log_dead_letters  # off where the dead letters are the output (replay's file)
        self._codecs: dict[type, RecordCodec] = {}
        # Records already decoded from the same bytes, shared by the runners of one process that read the same
        # messages (replay: the attributor and the guard both read every sample). Decoding is a function of the
        # bytes and records are immutable, so a hit is what decoding again would give.
        self.decoded = decoded
        self.consumed = 0
        self.dead_lettered = 0
        self.truncated = 0

    def _codec(self, record_type: type) -> RecordCodec:
        codec = self._codecs.get(record_type)
        if codec is None:
            codec = self._codecs[record_type] = codec_for(record_type)
        return codec

    def decode(self, message: RawMessage) -> Event:
        """The message as the processor's ``Event``; raises ``InvalidMessage`` (steps 1-3 of the module doc)."""
        spec = self.inputs.by_topic.get(message.topic)
        if spec is None:
            raise WrongTopic(f"{self.service} reads no topic {message.topic!r}")
        now_ms = self.clock.now_ms()
        if message.value is None:
            if not spec.tombstones:
                raise EmptyMessage("message has no value (tombstone on a non-compacted topic)")
            record = None
        elif spec.record_type is bytes:
            record = message.value  # a raw input: the bytes as the topic carried them (the recorder's)
        elif self.decoded is not None:
            key = (spec.record_type, message.value)
            record = self.decoded.get(key)
            if record is None:
                record = self.decoded[key] = self._codec(spec.record_type).decode(message.value)
            if spec.check is not None:
                spec.check(record, now_ms)
        else:
            record = self._codec(spec.record_type).decode(message.value)
            if spec.check is not None:
                spec.check(record, now_ms)
        return Event(spec.name, record, message.key, now_ms, message.timestamp_ms)

    def step(self, message: RawMessage) -> Step:
        """Run one message through decode, check and the processor; reject it on ``InvalidMessage``."""
        self._count(message)
        position = Position(message.topic, message.partition, message.offset)
        try:
            event = self.decode(message)
            result = self.processor.handle(event, position)
        except InvalidMessage as error:
            return self._rejected(message, position, error)
        return self._handled(message, position, result)

    def step_batch(self, messages: Iterable[RawMessage]) -> list[Step]:
        """Run a fetched batch: decode and check each message, hand the good ones to the processor in one
        ``handle_batch``, and make one ``Step`` per message, in order (as ``step`` would have, one at a time)."""
        batch = list(messages)
        steps: list[Step | None] = [None] * len(batch)
        events: list[tuple[Event, Position]] = []
        indices: list[int] = []
        for index, message in enumerate(batch):
            self._count(message)
            position = Position(message.topic, message.partition, message.offset)
            try:
                events.append((self.decode(message), position))
            except InvalidMessage as error:
                steps[index] = self._rejected(message, position, error)
                continue
            indices.append(index)
        if events:
            handle_batch = getattr(self.processor, "handle_batch", None)
            outcomes = handle_batch(events) if handle_batch is not None else handle_each(self.processor, events)
            if len(outcomes) != len(events):
                raise RuntimeError(f"{self.service}: handle_batch answered {len(outcomes)} outcomes for "
                                   f"{len(events)} events")
            for index, (_, position), outcome in zip(indices, events, outcomes):
                if isinstance(outcome, InvalidMessage):
                    steps[index] = self._rejected(batch[index], position, outcome)
                else:
                    steps[index] = self._handled(batch[index], position, outcome)
        return steps  # type: ignore[return-value]  # every index was filled

    def _count(self, message: RawMessage) -> None:
        self.consumed += 1
        if self.metrics is not None:
            counter = self._consumed_counters.get(message.topic)
            if counter is None:  # one child per topic, looked up once (labels() converts and locks every call)
                counter = self._consumed_counters[message.topic] = self.metrics.get(
                    "gpumeter_messages_consumed_total").labels(self.service, message.topic)
            counter.inc()
            self.metrics.beat()

    def _rejected(self, message: RawMessage, position: Position, error: InvalidMessage) -> Step:
        self._note_input(dead_lettered=True)
        return Step(position, self.reject(message, error), handled=False, dead_lettered=1)

    def _handled(self, message: RawMessage, position: Position, result: Result) -> Step:
        if result.rejected:
            letters = NOTHING
            for error in result.rejected:
                letters = letters + self.reject(message, error)
            result = Result(result.emits, result.changes) + letters
            self._note_input(dead_lettered=True)
            return Step(position, result, handled=True, dead_lettered=len(letters.emits))
        self._note_input(dead_lettered=False)
        return Step(position, result, handled=True)

    def _note_input(self, dead_lettered: bool, *, counted: bool = True) -> None:
        if self.metrics is not None:
            self.metrics.inputs(1 if counted else 0, 1 if dead_lettered else 0)

    def tick(self, now_ms: int, caught_up: bool = True) -> Result:
        """``processor.on_clock(now_ms, caught_up)``."""
        if self.metrics is not None:
            self.metrics.beat()
        return self.processor.on_clock(now_ms, caught_up)

    def assigned(self, partitions: Collection[TopicPartition]) -> Result:
        """``processor.on_assigned(partitions)`` (nothing for a processor without it)."""
        hook = getattr(self.processor, "on_assigned", None)
        return hook(frozenset(partitions)) if hook is not None and partitions else NOTHING

    def revoked(self, partitions: Collection[TopicPartition]) -> Result:
        """``processor.on_revoked(partitions)`` (nothing for a processor without it)."""
        hook = getattr(self.processor, "on_revoked", None)
        return hook(frozenset(partitions)) if hook is not None and partitions else NOTHING

    def settle(self, steps: Sequence[tuple[RawMessage | None, Result]], settled: Sequence[Settled]) -> Settlement:
        """What to produce for ``steps`` (each a message -- None for a clock tick -- with its result, in input
        order) once the store answered ``settled`` for their changes (one per change, in order; empty without a
        store, when every change is taken as durable and owes nothing). Per step: its emits, then per change the
        records it owes, or -- refused by the store -- the dead letter of its message. Every driver settles
        through here, so what goes out, and in what order, is the same under Kafka and in memory."""
        emits: list[Emit] = []
        published: list[Any] = []
        outcomes = iter(settled)
        use_store = bool(settled)
        for message, result in steps:
            emits.extend(result.emits)
            refused = False
            for change in result.changes:
                outcome = next(outcomes) if use_store else Settled()
                if outcome.rejected is None:
                    emits.extend(outcome.owed)
                    if outcome.owed:
                        published.append(change)
                elif message is None:
                    raise RuntimeError(f"{self.service}: the store refused a change of a clock tick: "
                                       f"{outcome.rejected!r}")
                else:
                    emits.extend(self.reject(message, outcome.rejected).emits)
                    refused = True
            if refused:  # the message was counted as an input at its step
                self._note_input(dead_lettered=True, counted=False)
        if use_store and next(outcomes, None) is not None:
            raise RuntimeError(f"{self.service}: the store answered more outcomes than there were changes")
        return Settlement(tuple(emits), tuple(published))

    def reject(self, message: RawMessage, error: InvalidMessage) -> Result:
        """The dead letter of ``message`` for ``error``, as a result to emit; counted and logged."""
        key = message.topic.encode("utf-8")
        letter = dead_letter_for(message, error, self.service, self.clock.now_ms(),
                                 max_request_size_bytes=self.max_request_size_bytes, dead_letter_key=key)
        self.dead_lettered += 1
        if self.metrics is not None:
            self.metrics.get("gpumeter_dead_letters_total").labels(self.service, message.topic,
                                                                  error.reason_code).inc()
        if self.log_dead_letters:
            log.warning("dead-lettered %s[%d]@%d: %s %s", message.topic, message.partition, message.offset,
                        error.reason_code, cut_text(error.detail, 512)[0])
        if letter.truncated:
            self.truncated += 1
            if self.metrics is not None:
                self.metrics.get("gpumeter_dead_letters_truncated_total").labels(self.service, message.topic).inc()
            log.log(logging.WARNING if self.log_dead_letters else logging.DEBUG,
                    "dead letter of %s[%d]@%d cut to fit %d bytes: value %d of %d bytes kept (sha256 %s)",
                    message.topic, message.partition, message.offset,
                    dead_letter_budget_bytes(self.max_request_size_bytes), len(letter.raw_bytes),
                    letter.payload_length_bytes, letter.payload_sha256)
        return Result(emits=(Emit(DEAD_LETTERS, key, letter),))


__all__ = ["EmptyMessage", "MessageRunner", "Settlement", "WrongTopic", "changes_of"]
