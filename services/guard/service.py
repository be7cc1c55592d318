"""The guard service: samples, pod events, node-window shares and costs in from Kafka, violations out, state kept on
disk.

Per message of the four input topics (``DeadLetterGuard``: bad input becomes a ``DeadLetter`` and the service
carries on): decode by topic (``NodeSample``, ``PodEvent``, ``NodeWindowShares``, ``NodeWindowCost``), reject
values no real record holds (``gpumeter.validation``: ``OUT_OF_RANGE``) and hand it to the ``GuardEngine``
(``services/guard/engine.py``: the pure rules) with the clock's time: a node-window's shares row by row
(``NodeWindowShares.rows()``), its bill line by line (``NodeWindowCost.cost_records()``). A clock task calls
``engine.on_clock`` every ``clock_interval_seconds``; silent nodes are judged only while the consumer is caught
up with every partition (during a backlog its samples are late, the nodes are not silent). Whatever the engine
returns (state changes and periodic refreshes) is produced to the violations topic keyed by its fingerprint (compacted: the latest record is the
state) and, when configured, handed to the ``AlertmanagerSink``.

State and offsets: the engine's state lives in memory; every ``snapshot_interval_seconds`` (and at stop) the
service waits until every violation produced so far is acknowledged, then writes the engine's snapshot together
with the input positions it covers to ``state_path`` (``GuardStateStore``: one file, written atomically), then
commits those positions to the consumer group. A restart restores the engine from the file and reads on from the
positions in it, so state and input never disagree; what was read after the last snapshot is read again and the
engine re-derives the same violations (the compacted topic and Alertmanager both deduplicate by fingerprint).
A partition the state file has no position for is read from its beginning (the state covers none of it).
Without a state file (first start, or none configured) pod events are read from the beginning of their compacted
topic -- the rules need every live pod -- and the other topics from the group's committed offsets (else
``auto_offset_reset``). An unreadable state file is moved aside (``<name>.corrupt-<unix ms>``) and the guard
starts without one, loudly. A guard without a state file first reads the compacted violations topic whole (every
fingerprint's last state) and seeds its engine with it, then re-reads its input publishing no violation until it
has read as far as the input reached when it started, and only then publishes what the topic must hear
(``GuardEngine.adopt``/``settle``): a replay of old pod events never fires an alert that had resolved, a firing
violation keeps its fingerprint and ``first_seen``, and one whose condition ended meanwhile is resolved. No state
file is written or offset committed before that.

Budgets span nodes and stale-node detection needs every node, so one guard reads every partition of its input
topics itself (manual assignment; the group only stores offsets): run one replica.

Failures: Kafka not acknowledging produced violations → re-sent with backoff (``gpumeter.kafka.outbox``; only the
newest record of a fingerprint, so a stale state never overwrites a newer one) while nothing is snapshotted or
committed;
Alertmanager unreachable → its alerts stay pending in the sink, consumption goes on.

``GuardProcessor`` and ``GuardStateStore`` hold no Kafka client; ``GuardService`` wires them to aiokafka.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Mapping, Protocol

from gpumeter.clock import Clock
from gpumeter.errors import GpumeterError, InvalidMessage
from gpumeter.kafka.deadletter import DeadLetterGuard, RawMessage
from gpumeter.kafka.outbox import Outbox, Producer
from gpumeter.kafka.processor import (
    ConsumerUnavailable,
    ProcessorLifecycle,
    ServiceStopping,
    input_behind,
    raw_message,
)
from gpumeter.settings import DEFAULT_MAX_REQUEST_SIZE_BYTES
from gpumeter.validation import (
    DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS,
    DEFAULT_MAX_SAMPLE_AGE_SECONDS,
    check_pod_event,
    check_sample,
    check_window_cost,
    check_window_shares,
)
from schemas.catalog import TopicCatalog
from schemas.records import CostRecord, GpuShare, NodeSample, NodeWindowCost, NodeWindowShares, PodEvent, Violation
from schemas.records import ViolationState
from schemas.typed import codec_for

log = logging.getLogger(__name__)

SERVICE_NAME = "guard"
REBUILD_READ_TIMEOUT_S = 300.0  # reading the compacted violations topic whole at a start without state
TopicPartition = tuple[str, int]

# The metrics this service exports (all names from gpumeter.metrics.METRICS).
GUARD_METRICS = (
    "gpumeter_messages_consumed_total",
    "gpumeter_dead_letters_total",
    "gpumeter_dead_letters_truncated_total",
    "gpumeter_guard_violations_firing",
    "gpumeter_guard_violation_transitions_total",
)


class WrongTopic(InvalidMessage):
    """A message from a topic the guard does not read (a wiring bug, kept out of the engine)."""

    reason_code = "WRONG_TOPIC"


class GuardStateError(GpumeterError):
    """The state file cannot be read back (corrupt, truncated, another format) or cannot be written."""


class Engine(Protocol):
    """What the service needs of ``services.guard.engine.GuardEngine``."""

    def adopt(self, last_states: Iterable[Violation], now_ms: int) -> None: ...

    def settle(self, last_states: Mapping[str, Violation], now_ms: int) -> tuple[Violation, ...]: ...

    def on_sample(self, sample: NodeSample, now_ms: int) -> tuple[Violation, ...]: ...

    def on_pod_event(self, event: PodEvent, now_ms: int) -> tuple[Violation, ...]: ...

    def on_share(self, share: GpuShare, now_ms: int) -> tuple[Violation, ...]: ...

    def on_cost(self, cost: CostRecord, now_ms: int) -> tuple[Violation, ...]: ...

    def on_clock(self, now_ms: int, *, detect_stale: bool = True) -> tuple[Violation, ...]: ...

    def active(self) -> Iterable[Violation]: ...

    def snapshot(self) -> bytes: ...


class Sink(Protocol):
    def update(self, violations: Iterable[Violation]) -> None: ...


# -- state on disk ----------------------------------------------------------------------------------------------

STATE_MAGIC = b"GPUMETER-GUARD-STATE 1\n"


@dataclass(frozen=True)
class GuardState:
    """The engine's snapshot and the input positions (next offset to read per topic-partition) it covers."""

    engine_bytes: bytes
    positions: Mapping[TopicPartition, int]
    saved_at_unix_ms: int


def encode_state(state: GuardState) -> bytes:
    """``STATE_MAGIC``, one JSON header line (positions, length and SHA-256 of the engine bytes), the bytes."""
    header = {
        "saved_at_unix_ms": state.saved_at_unix_ms,
        "positions": [[topic, partition, offset] for (topic, partition), offset in sorted(state.positions.items())],
        "engine_bytes": len(state.engine_bytes),
        "engine_sha256": hashlib.sha256(state.engine_bytes).hexdigest(),
    }
    return STATE_MAGIC + json.dumps(header, sort_keys=True).encode("utf-8") + b"\n" + state.engine_bytes


def decode_state(data: bytes) -> GuardState:
    """The inverse of ``encode_state``; ``GuardStateError`` for anything that is not exactly such a file."""
    if not data.startswith(STATE_MAGIC):
        raise GuardStateError("not a guard state file (bad magic)")
    rest = data[len(STATE_MAGIC):]
    end = rest.find(b"\n")
    if end < 0:
        raise GuardStateError("truncated guard state file (no header)")
    try:
        header = json.loads(rest[:end])
        length = int(header["engine_bytes"])
        digest = str(header["engine_sha256"])
        positions = {(str(t), int(p)): int(o) for t, p, o in header["positions"]}
        saved_at = int(header["saved_at_unix_ms"])
    except (ValueError, KeyError, TypeError) as exc:
        raise GuardStateError(f"unreadable guard state header: {exc!r}") from exc
    body = rest[end + 1:]
    if len(body) != length:
        raise GuardStateError(f"guard state holds {len(body)} engine bytes, its header says {length}")
    if hashlib.sha256(body).hexdigest() != digest:
        raise GuardStateError("guard state engine bytes do not match their checksum")
    return GuardState(engine_bytes=body, positions=positions, saved_at_unix_ms=saved_at)


class GuardStateStore:
    """One state file, replaced atomically: write a temporary file beside it, fsync, rename over it, fsync the
    folder. A crash at any point leaves either the old file or the new one, never a mix."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def load(self) -> GuardState | None:
        """The saved state, None when there is no file; ``GuardStateError`` when it cannot be read back."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise GuardStateError(f"cannot read {self.path}: {exc}") from exc
        return decode_state(data)

    def save(self, state: GuardState) -> None:
        data = encode_state(state)
        folder = self.path.parent
        temporary = folder / f".{self.path.name}.{os.getpid()}.tmp"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(temporary, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.path)
            directory = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as exc:
            try:
                temporary.unlink()
            except OSError:
                pass
            raise GuardStateError(f"cannot write {self.path}: {exc}") from exc

    def move_aside(self, now_ms: int) -> Path | None:
        """Rename an unreadable file to ``<name>.corrupt-<now_ms>`` (kept for a post-mortem); returns the new path."""
        target = self.path.with_name(f"{self.path.name}.corrupt-{now_ms}")
        try:
            os.replace(self.path, target)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise GuardStateError(f"cannot move {self.path} aside: {exc}") from exc
        return target


# -- processing -------------------------------------------------------------------------------------------------




@dataclass
class ProcessorStats:
    messages: int = 0
    violations_published: int = 0
    transitions: int = 0
    clock_runs: int = 0
    delivery_retries: int = 0
    by_topic: dict[str, int] = field(default_factory=dict)


class GuardProcessor(ProcessorLifecycle):
    """Feeds decoded input to the engine and publishes what it returns. No Kafka client inside.

    * ``handle(message)``: one input message through ``DeadLetterGuard`` → decode by topic → range checks
      (``gpumeter.validation``, with ``max_clock_skew_seconds`` and ``max_sample_age_seconds``: ``OUT_OF_RANGE``)
      → the engine; its position counts as read whatever became of it. A tombstone on the compacted pod-events
      topic is skipped (a pod's DELETED event precedes it; the topic's key carries nothing else).
    * ``tick(caught_up)``: ``engine.on_clock(now)``; silent nodes are judged only when the input is caught up
      (``detect_stale=caught_up``): while a backlog is read, its samples are late, the nodes are not silent.
    * Violations go to the violations topic keyed by fingerprint, to the sink (if any), and move the metrics:
      ``gpumeter_guard_violation_transitions_total{rule,state}`` once per state change of a fingerprint (not per
      refresh), ``gpumeter_guard_violations_firing{rule,severity}`` from ``engine.active()``.
    * ``flush()``: wait until every violation produced so far is acknowledged, re-sending failures with backoff.
    * ``state()``: the engine's snapshot and the positions it covers (take it right after ``flush()``).
    * ``begin_rebuild(last_states)``: a guard without a usable state file seeds its engine from the violations
      topic's last state per fingerprint (``GuardEngine.adopt``) and then publishes no violation while it re-reads
      its input (``rebuilding``; dead letters still go out); ``finish_rebuild()`` publishes what the topic must
      hear (``GuardEngine.settle``). Nothing old fires again: a pod deleted long ago whose alert had resolved is
      replayed, found resolved, and dropped.
    """

    def __init__(self, *, engine: Engine, producer: Producer, topics: TopicCatalog, clock: Clock,
                 sink: Sink | None = None, metrics=None, retry_initial_seconds: float = 0.5,
                 retry_max_seconds: float = 30.0, positions: Mapping[TopicPartition, int] | None = None,
                 sleep: Callable[[float], Awaitable[None]] | None = None,
                 max_clock_skew_seconds: int = DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS,
                 max_sample_age_seconds: int = DEFAULT_MAX_SAMPLE_AGE_SECONDS,
                 max_request_size_bytes: int = DEFAULT_MAX_REQUEST_SIZE_BYTES) -> None:
        self.engine = engine
        self.max_clock_skew_ms = max_clock_skew_seconds * 1000
        self.max_sample_age_ms = max_sample_age_seconds * 1000
        self.producer = producer
        self.topics = topics
        self.clock = clock
        self.sink = sink
        self.retry_initial_seconds = retry_initial_seconds
        self.retry_max_seconds = retry_max_seconds
        super().__init__(metrics, sleep)
        self.guard = DeadLetterGuard(SERVICE_NAME, topics.dead_letters, self._dead_letter, clock, metrics,
                                     max_request_size_bytes=max_request_size_bytes)
        self.positions: dict[TopicPartition, int] = dict(positions or {})
        self.stats = ProcessorStats()
        # Violations and dead letters; violations are sent ``latest_wins`` (only a fingerprint's newest is re-sent).
        self._outbox = Outbox(producer, pause=self._pause, retry_initial_seconds=retry_initial_seconds,
                              retry_max_seconds=retry_max_seconds, on_retry=self._count_delivery_retry)
        self._states: dict[str, ViolationState] = {v.fingerprint: v.state for v in engine.active()
                                                   if v.state is ViolationState.FIRING}
        self._firing_series: set[tuple[str, str]] = set()
        self._rebuild_states: dict[str, Violation] | None = None
        self._handlers: dict[str, Callable[[bytes, int], tuple[Violation, ...]]] = {
            topics.node_samples: self._sample,
            topics.pod_events: self._pod_event,
            topics.node_window_shares: self._window_shares,
            topics.node_window_costs: self._window_cost,
        }
        self._refresh_firing_gauge()

    @property
    def input_topics(self) -> tuple[str, ...]:
        return tuple(self._handlers)

    # -- input --

    # Decode, range-check (gpumeter.validation: OUT_OF_RANGE), then the engine.

    def _sample(self, value: bytes, now_ms: int) -> tuple[Violation, ...]:
        sample = codec_for(NodeSample).decode(value)
        check_sample(sample, now_ms, self.max_clock_skew_ms, self.max_sample_age_ms)
        return self.engine.on_sample(sample, now_ms)

    def _pod_event(self, value: bytes, now_ms: int) -> tuple[Violation, ...]:
        event = codec_for(PodEvent).decode(value)
        check_pod_event(event, now_ms, self.max_clock_skew_ms)
        return self.engine.on_pod_event(event, now_ms)

    def _window_shares(self, value: bytes, now_ms: int) -> tuple[Violation, ...]:
        shares = codec_for(NodeWindowShares).decode(value)
        check_window_shares(shares, now_ms, self.max_clock_skew_ms)
        return tuple(v for share in shares.rows() for v in self.engine.on_share(share, now_ms))

    def _window_cost(self, value: bytes, now_ms: int) -> tuple[Violation, ...]:
        cost = codec_for(NodeWindowCost).decode(value)
        check_window_cost(cost, now_ms, self.max_clock_skew_ms)
        return tuple(v for line in cost.cost_records() for v in self.engine.on_cost(line, now_ms))

    @property
    def rebuilding(self) -> bool:
        return self._rebuild_states is not None

    def begin_rebuild(self, last_states: Iterable[Violation]) -> None:
        """Seed the engine from the violations topic and hold violations back until ``finish_rebuild``."""
        states = {v.fingerprint: v for v in last_states}
        self.engine.adopt(states.values(), self.clock.now_ms())
        self._rebuild_states = states
        firing = tuple(v for v in self.engine.active() if v.state is ViolationState.FIRING)
        self._states = {v.fingerprint: v.state for v in firing}
        self._refresh_firing_gauge()
        if self.sink is not None and firing:
            self.sink.update(firing)  # renew the leases of what the topic holds firing
        log.info("rebuilding from the violations topic: %d fingerprints, %d firing; no violation is published "
                 "until the input is re-read", len(states), len(firing))

    async def finish_rebuild(self) -> tuple[Violation, ...]:
        """The input is re-read: publish what the topic must hear (``GuardEngine.settle``) and go on normally."""
        states, self._rebuild_states = self._rebuild_states, None
        if states is None:
            return ()
        settled = self.engine.settle(states, self.clock.now_ms())
        log.info("rebuilt from the violations topic: %d violations to publish", len(settled))
        if settled:
            await self.publish(settled)
        else:
            self._refresh_firing_gauge()
        return settled

    async def handle(self, message: RawMessage) -> tuple[Violation, ...] | None:
        """Process one input message; returns the violations it produced (None: dead-lettered or skipped), which
        are published unless a rebuild holds them back."""
        self.positions[(message.topic, message.partition)] = message.offset + 1
        self.stats.messages += 1
        self.stats.by_topic[message.topic] = self.stats.by_topic.get(message.topic, 0) + 1
        if message.value is None and message.topic == self.topics.pod_events:
            if self.metrics:
                self.metrics.get("gpumeter_messages_consumed_total").labels(SERVICE_NAME, message.topic).inc()
            return None
        violations = await self.guard.handle(message, self._process)
        if violations and not self.rebuilding:
            await self.publish(violations)
        return violations

    async def _process(self, message: RawMessage) -> tuple[Violation, ...]:
        handler = self._handlers.get(message.topic)
        if handler is None:
            raise WrongTopic(f"the guard does not read {message.topic}")
        assert message.value is not None
        return tuple(handler(message.value, self.clock.now_ms()))

    async def tick(self, *, caught_up: bool = True) -> tuple[Violation, ...]:
        """Run the engine's clock rules now and publish what they return."""
        self.stats.clock_runs += 1
        violations = tuple(self.engine.on_clock(self.clock.now_ms(), detect_stale=caught_up))
        if violations and not self.rebuilding:
            await self.publish(violations)
        return violations

    # -- output --

    async def publish(self, violations: Iterable[Violation]) -> None:
        """Produce ``violations`` (keyed by fingerprint), hand them to the sink, move the metrics."""
        violations = tuple(violations)
        changed = False
        for violation in violations:
            await self._outbox.send(self.topics.violations, violation.fingerprint.encode("utf-8"), violation,
                                    latest_wins=True)
            self.stats.violations_published += 1
            if self._states.get(violation.fingerprint) is not violation.state:
                changed = True
                self.stats.transitions += 1
                if self.metrics:
                    self.metrics.get("gpumeter_guard_violation_transitions_total").labels(
                        violation.rule, violation.state.value.lower()).inc()
                log.info("%s %s %s: %s", violation.state.value, violation.rule, violation.fingerprint,
                         violation.summary)
            if violation.state is ViolationState.FIRING:
                self._states[violation.fingerprint] = violation.state
            else:
                self._states.pop(violation.fingerprint, None)
        if self.sink is not None:
            self.sink.update(violations)
        if changed:
            self._refresh_firing_gauge()

    def _refresh_firing_gauge(self) -> None:
        if not self.metrics:
            return
        counts: dict[tuple[str, str], int] = {}
        for violation in self.engine.active():
            if violation.state is ViolationState.FIRING:
                series = (violation.rule, violation.severity.value.lower())
                counts[series] = counts.get(series, 0) + 1
        gauge = self.metrics.get("gpumeter_guard_violations_firing")
        # Series that dropped to zero stay at 0 (a missing series reads as "no data", not "nothing firing").
        for series in self._firing_series | set(counts):
            gauge.labels(*series).set(counts.get(series, 0))
        self._firing_series |= set(counts)

    async def _dead_letter(self, topic: str, key: bytes, record: Any) -> None:
        await self._outbox.send(topic, key, record)

    def _count_delivery_retry(self) -> None:
        self.stats.delivery_retries += 1

    @property
    def unacknowledged(self) -> int:
        return len(self._outbox)

    async def flush(self, *, retry: bool = True) -> bool:
        """Wait for every violation and dead letter enqueued so far; re-send failures with backoff (``retry``)
        until all are acknowledged. Returns whether everything was acknowledged."""
        return await self._outbox.flush(retry=retry)

    def state(self) -> GuardState:
        """The engine's snapshot with the positions it covers (consistent: both taken without an await)."""
        return GuardState(engine_bytes=self.engine.snapshot(), positions=dict(self.positions),
                          saved_at_unix_ms=self.clock.now_ms())


# -- the Kafka loop ---------------------------------------------------------------------------------------------


class GuardService:
    """The consumer loop around a ``GuardProcessor``: one aiokafka consumer over the four input topics (every
    partition assigned to it, manual commits, ``read_committed``), the clock task, and checkpoints (flush →
    state file → commit) every ``snapshot_interval_seconds`` and at stop. ``run(stop)`` returns when ``stop`` is
    set. ``restored`` says whether the processor's positions came from a state file (they win over the group's
    committed offsets)."""

    def __init__(self, *, kafka, topics: TopicCatalog, processor: GuardProcessor, consumer_group: str,
                 store: GuardStateStore | None = None, restored: bool = False, auto_offset_reset: str = "earliest",
                 snapshot_interval_seconds: float = 10.0, clock_interval_seconds: float = 1.0,
                 max_poll_records: int = 2000, poll_timeout_ms: int = 500) -> None:
        self.kafka = kafka
        self.topics = topics
        self.processor = processor
        self.consumer_group = consumer_group
        self.store = store
        self.restored = restored
        self.auto_offset_reset = auto_offset_reset
        self.snapshot_interval_seconds = snapshot_interval_seconds
        self.clock_interval_seconds = clock_interval_seconds
        self.max_poll_records = max_poll_records
        self.poll_timeout_ms = poll_timeout_ms
        self._lock = asyncio.Lock()
        self._consumer = None
        self._partitions: tuple = ()
        self._committed: dict[TopicPartition, int] = {}
        self._rebuild_ends: dict = {}
        self.commits = 0
        self.snapshots = 0

    async def run(self, stop: asyncio.Event) -> None:
        from aiokafka import AIOKafkaConsumer
        from aiokafka.errors import KafkaError

        consumer = AIOKafkaConsumer(
            **self.kafka.client_kwargs(),
            group_id=self.consumer_group,
            enable_auto_commit=False,
            auto_offset_reset=self.auto_offset_reset,
            isolation_level="read_committed",
            max_poll_records=self.max_poll_records,
        )
        self._consumer = consumer
        try:
            try:
                await consumer.start()
                await self._assign(consumer)
                if not self.restored:
                    await self._begin_rebuild(consumer)
            except (KafkaError, OSError, asyncio.TimeoutError) as exc:
                raise ConsumerUnavailable(f"cannot reach Kafka at {self.kafka.bootstrap_servers}: {exc!r}") from exc
        except BaseException:
            await consumer.stop()
            raise
        relay = asyncio.ensure_future(self._relay_stop(stop))
        clock = asyncio.ensure_future(self._clock_loop())
        timer = self.processor.clock
        next_checkpoint = timer.monotonic_s() + self.snapshot_interval_seconds
        try:
            while not self.processor.stopping:
                fetch = asyncio.ensure_future(consumer.getmany(timeout_ms=self.poll_timeout_ms))
                await asyncio.wait((fetch, relay, clock), return_when=asyncio.FIRST_COMPLETED)
                if clock.done():
                    clock.result()  # the clock task only ends by raising: surface it
                if not fetch.done():
                    fetch.cancel()
                    break
                batch = fetch.result()
                self.processor.beat()
                self.processor.note_input(tuple(sorted(self.processor.positions.items())),
                                          any(batch.values()) or await input_behind(consumer))
                async with self._lock:
                    for records in batch.values():
                        for record in records:
                            if self.processor.stopping:
                                break
                            await self.processor.handle(raw_message(record))
                    await self._finish_rebuild_when_read(consumer)
                if timer.monotonic_s() >= next_checkpoint:
                    await self.checkpoint()
                    next_checkpoint = timer.monotonic_s() + self.snapshot_interval_seconds
        except ServiceStopping:
            log.info("stopped in the middle of a retry; what was read since the last snapshot is read again")
        finally:
            relay.cancel()
            clock.cancel()
            self.processor.stop()
            async with self._lock:
                try:
                    if await self.processor.flush(retry=False):
                        await self._save_and_commit()
                except Exception as exc:  # best effort: whatever is not in the state file is read again
                    log.warning("final checkpoint failed: %r", exc)
            await consumer.stop()

    async def _assign(self, consumer) -> None:
        from aiokafka.structs import TopicPartition as KafkaTopicPartition

        from gpumeter.kafka.admin import partition_numbers

        known = await partition_numbers(self.kafka, self.processor.input_topics)
        partitions: list[KafkaTopicPartition] = []
        for topic in self.processor.input_topics:
            if topic not in known:
                raise ConsumerUnavailable(f"topic {topic} does not exist (run `gpumeter topics create`)")
            partitions.extend(KafkaTopicPartition(topic, p) for p in known[topic])
        consumer.assign(partitions)
        self._partitions = tuple(partitions)
        positions = self.processor.positions
        from_beginning, to_end = [], []
        for tp in partitions:
            key = (tp.topic, tp.partition)
            if key in positions:
                consumer.seek(tp, positions[key])
                continue
            if tp.topic == self.topics.pod_events or self.restored:
                # Pod events: the rules need every live pod. Restored: the state covers none of this partition.
                from_beginning.append(tp)
                continue
            committed = await consumer.committed(tp)
            if committed is not None:
                consumer.seek(tp, committed)
            elif self.auto_offset_reset == "earliest":
                from_beginning.append(tp)
            else:
                to_end.append(tp)
        if from_beginning:
            await consumer.seek_to_beginning(*from_beginning)
        if to_end:
            await consumer.seek_to_end(*to_end)
        log.info("reading %d partitions of %s (%s)", len(partitions), ", ".join(self.processor.input_topics),
                 "positions from the state file" if self.restored else "no state file: pod events from the start")

    async def _begin_rebuild(self, consumer) -> None:
        """No state file: seed the engine from the violations topic before anything is raised, and note how far
        the input reaches now; until it is read that far, violations are held back (``GuardProcessor``)."""
        from services.guard.violations_cli import ViolationsReadError, read_violations

        try:
            view = await read_violations(self.kafka, self.topics.violations, timeout_s=REBUILD_READ_TIMEOUT_S)
        except ViolationsReadError as exc:
            raise ConsumerUnavailable(f"cannot rebuild from {self.topics.violations}: {exc}") from exc
        if view.undecodable:
            log.warning("%d records on %s are no Violation: ignored", view.undecodable, self.topics.violations)
        self._rebuild_ends = dict(await consumer.end_offsets(list(self._partitions)))
        self.processor.begin_rebuild(view.violations)
        await self._finish_rebuild_when_read(consumer)

    async def _finish_rebuild_when_read(self, consumer) -> None:
        if not self.processor.rebuilding:
            return
        for tp, end in self._rebuild_ends.items():
            if await consumer.position(tp) < end:
                return
        await self.processor.finish_rebuild()

    async def _relay_stop(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.processor.stop()

    async def _clock_loop(self) -> None:
        while True:
            await asyncio.sleep(self.clock_interval_seconds)
            async with self._lock:
                if self.processor.stopping:
                    return
                await self.processor.tick(caught_up=await self._caught_up())

    async def _caught_up(self) -> bool:
        """Whether every assigned partition has been read up to its last stable offset (as of the latest fetch
        response; unknown before the first one counts as not caught up)."""
        consumer = self._consumer
        if consumer is None:
            return False
        for tp in self._partitions:
            end = consumer.last_stable_offset(tp)
            if end is None:
                end = consumer.highwater(tp)
            if end is None or await consumer.position(tp) < end:
                return False
        return True

    async def checkpoint(self) -> None:
        """Flush (with retries), then write the state file and commit the positions it holds."""
        async with self._lock:
            await self.processor.flush()
            await self._save_and_commit()

    async def _save_and_commit(self) -> None:
        if self.processor.rebuilding:
            return  # the engine holds back what the topic has not heard: a state file now would lose it
        state = self.processor.state()
        if self.store is not None:
            try:
                await asyncio.to_thread(self.store.save, state)
                self.snapshots += 1
            except GuardStateError as exc:
                # Committing anyway is safe: a restart prefers the (older) state file's own positions, and
                # without any state file pod events are re-read from the start regardless.
                log.error("state not saved, a restart re-reads from the previous snapshot: %s", exc)
        await self._commit(state.positions)

    async def _commit(self, positions: Mapping[TopicPartition, int]) -> None:
        from aiokafka.errors import KafkaError
        from aiokafka.structs import OffsetAndMetadata, TopicPartition as KafkaTopicPartition

        moved = {tp: p for tp, p in positions.items() if self._committed.get(tp) != p}
        if not moved or self._consumer is None:
            return
        offsets = {KafkaTopicPartition(t, p): OffsetAndMetadata(position, "") for (t, p), position in moved.items()}
        try:
            await self._consumer.commit(offsets)
        except KafkaError as exc:
            log.warning("commit failed, will retry at the next checkpoint: %r", exc)
            return
        self._committed.update(moved)
        self.commits += 1
