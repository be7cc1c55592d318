"""The guard processor without Kafka: the real engine behind the one runner, over the in-memory broker.

Bad input is dead-lettered by the runner and the guard carries on; violations go out keyed by fingerprint, and
only violations reach the Alertmanager sink; the transition counter moves once per state change (not per refresh)
and the firing gauge follows the engine; under the Kafka driver a failed delivery is re-sent (with a pause that
counts as the loop going round) before the state file is written; the state the checkpoint writes restores the
same engine; a rebuild from the violations topic publishes only what the topic does not know."""

from __future__ import annotations

import asyncio
import dataclasses

from gpumeter.clock import ManualClock
from gpumeter.stream.deadletter import RawMessage
from gpumeter.kafka.driver import KafkaDriver
from gpumeter.kafka.producer import DeliveryError
from gpumeter.metrics import ServiceMetrics
from gpumeter.settings import KafkaSettings
from gpumeter.stream.contract import DEAD_LETTERS, Emit
from gpumeter.stream.memory import MemoryBroker, MemoryDriver
from gpumeter.stream.runner import MessageRunner
from schemas.catalog import TopicCatalog
from schemas.records import DeadLetter, PodEvent, PodEventType, Violation, ViolationState
from schemas.typed import codec_for
from services.guard.config import GuardConfig
from services.guard.engine import GuardEngine
from services.guard.main import alert_on_emitted
from services.guard.processor import GUARD_METRICS, VIOLATIONS, GuardProcessor, guard_outputs, guard_topics
from services.guard.state import GuardStateStore, StateCheckpoint
from tests.unit.attributor import pod_event

TOPICS = TopicCatalog(prefix="unit.")
START_MS = 1_780_000_000_000
HOLD_DOWN_SECONDS = 60
REFRESH_SECONDS = 120


class Guard:
    """A ``GuardProcessor`` on a ``MessageRunner`` over a ``MemoryDriver``: ``feed`` produces to an input topic,
    ``run`` reads everything new, ``tick`` runs the clock."""

    def __init__(self, clock: ManualClock | None = None) -> None:
        self.config = GuardConfig(hold_down_seconds=HOLD_DOWN_SECONDS, refresh_seconds=REFRESH_SECONDS)
        self.clock = clock or ManualClock(START_MS)
        self.metrics = ServiceMetrics("guard", GUARD_METRICS, clock=self.clock)
        self.processor = GuardProcessor(self.config, self.clock, metrics=self.metrics)
        self.broker = MemoryBroker()
        for topic in (*guard_topics(TOPICS).values(), *guard_outputs(TOPICS).values()):
            self.broker.create(topic)
        self.runner = MessageRunner(self.processor, guard_topics(TOPICS), self.clock, metrics=self.metrics)
        self.driver = MemoryDriver(self.runner, self.broker, guard_outputs(TOPICS))

    @property
    def engine(self) -> GuardEngine:
        return self.processor.engine

    def feed(self, topic: str, value: bytes | None, key: bytes | None = b"k"):
        return self.broker.produce(topic, key, value, timestamp_ms=self.clock.now_ms())

    def pod(self, event: PodEvent):
        return self.feed(TOPICS.pod_events, codec_for(PodEvent).encode(event))

    def run(self) -> tuple[Violation, ...]:
        """Read everything new; the violations that produced."""
        before = len(self.violations())
        self.driver.run()
        return tuple(v for _, v in self.violations()[before:])

    def tick(self) -> tuple[Violation, ...]:
        return tuple(e.record for e in self.driver.tick(self.clock.now_ms()).emits)

    def violations(self) -> list[tuple[bytes, Violation]]:
        decode = codec_for(Violation).decode
        return [(m.key, decode(m.value)) for m in self.broker.messages(TOPICS.violations, 0)]

    def dead_letters(self) -> list[DeadLetter]:
        return self.broker.records(TOPICS.dead_letters, DeadLetter)

    def metric(self, name: str, **labels) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def leaky(observed_ms: int, event_type: PodEventType = PodEventType.ADDED) -> PodEvent:
    event = pod_event("uid-1", namespace="research", name="notebook-0", observed_at_unix_ms=observed_ms,
                      event_type=event_type, resource_version=str(observed_ms))
    (container,) = event.containers
    return dataclasses.replace(event, containers=(dataclasses.replace(container, visible_devices_env="all"),))


def test_garbage_is_dead_lettered_and_the_next_message_is_processed():
    guard = Guard()
    garbage = guard.feed(TOPICS.node_samples, b"\xc3\x01 garbage")
    guard.clock.advance_ms(1)
    guard.pod(leaky(guard.clock.now_ms()))
    (fired,) = guard.run()
    assert fired.rule == "visibility_leak"
    (letter,) = guard.dead_letters()
    assert (letter.service, letter.source_topic, letter.source_offset, letter.raw_bytes) == (
        "guard", TOPICS.node_samples, garbage.offset, b"\xc3\x01 garbage")
    assert guard.driver.positions == {(TOPICS.node_samples, 0): 1, (TOPICS.pod_events, 0): 1}
    assert guard.metric("gpumeter_dead_letters_total", service="guard", topic=TOPICS.node_samples,
                        reason_code=letter.reason_code) == 1
    assert guard.metric("gpumeter_messages_consumed_total", service="guard", topic=TOPICS.node_samples) == 1


def test_a_pod_events_tombstone_is_skipped_other_empty_values_and_foreign_topics_are_dead_lettered():
    guard = Guard()
    guard.feed(TOPICS.pod_events, None, key=b"node-a/uid-9")
    assert guard.run() == () and guard.dead_letters() == []
    assert guard.metric("gpumeter_messages_consumed_total", service="guard", topic=TOPICS.pod_events) == 1
    guard.feed(TOPICS.node_window_costs, None)
    guard.run()
    (letter,) = guard.dead_letters()
    assert (letter.reason_code, letter.source_topic) == ("EMPTY", TOPICS.node_window_costs)
    assert guard.driver.positions == {(TOPICS.pod_events, 0): 1, (TOPICS.node_window_costs, 0): 1}

    # A topic the guard does not read (a wiring bug): the runner's WRONG_TOPIC, the engine never sees it.
    step = guard.runner.step(RawMessage(TOPICS.costs, 0, 0, b"k", b"\x00", START_MS))
    ((emit,),) = (step.result.emits,)
    assert (emit.output, emit.record.reason_code, step.handled) == (DEAD_LETTERS, "WRONG_TOPIC", False)


def test_violations_go_out_by_fingerprint_and_metrics_count_state_changes_not_refreshes():
    guard = Guard()
    guard.pod(leaky(guard.clock.now_ms()))
    (fired,) = guard.run()
    assert fired.state is ViolationState.FIRING
    # The same spec again after the refresh interval: a refresh record, not a new state.
    guard.clock.advance_ms(REFRESH_SECONDS * 1000)
    guard.pod(dataclasses.replace(leaky(guard.clock.now_ms()), event_type=PodEventType.MODIFIED))
    (refresh,) = guard.run()
    assert (refresh.fingerprint, refresh.state) == (fired.fingerprint, ViolationState.FIRING)
    assert refresh.last_seen_unix_ms > fired.last_seen_unix_ms
    labels = {"rule": fired.rule, "state": "firing"}
    assert guard.metric("gpumeter_guard_violation_transitions_total", **labels) == 1
    assert guard.metric("gpumeter_guard_violations_firing", rule=fired.rule, severity="critical") == 1

    # Deleted: nothing until the hold-down has passed, then RESOLVED.
    guard.clock.advance_ms(1_000)
    guard.pod(leaky(guard.clock.now_ms(), PodEventType.DELETED))
    assert guard.run() == ()
    guard.clock.advance_ms(HOLD_DOWN_SECONDS * 1000 - 1)
    assert guard.tick() == ()
    guard.clock.advance_ms(1)
    (resolved,) = guard.tick()
    assert (resolved.fingerprint, resolved.state) == (fired.fingerprint, ViolationState.RESOLVED)
    assert guard.metric("gpumeter_guard_violation_transitions_total", rule=fired.rule, state="resolved") == 1
    assert guard.metric("gpumeter_guard_violation_transitions_total", **labels) == 1
    assert guard.metric("gpumeter_guard_violations_firing", rule=fired.rule, severity="critical") == 0

    sent = guard.violations()
    assert [v for _, v in sent] == [fired, refresh, resolved]
    assert all(key == v.fingerprint.encode() for key, v in sent)
    assert guard.processor.stats.violations_emitted == 3 and guard.processor.stats.transitions == 2


def test_every_violation_emitted_reaches_the_sink_and_nothing_else_does():
    class RecordingSink:
        def __init__(self) -> None:
            self.updates: list[Violation] = []

        def update(self, violations) -> None:
            self.updates.extend(violations)

    guard = Guard()
    guard.pod(leaky(guard.clock.now_ms()))
    (fired,) = guard.run()
    sink = RecordingSink()
    on_emitted = alert_on_emitted(sink)
    letter = Emit(DEAD_LETTERS, b"t", object())
    on_emitted([letter, Emit(VIOLATIONS, fired.fingerprint.encode(), fired, latest_wins=True)])
    on_emitted([letter])
    assert sink.updates == [fired]


class RecordingProducer:
    """Encodes every record with its real codec and acknowledges it, or fails the first ``fail_first`` sends."""

    def __init__(self, fail_first: int = 0) -> None:
        self.fail_first = fail_first
        self.delivered: list[tuple[str, bytes | None, object]] = []
        self.attempts = 0

    async def send(self, topic, record, *, key=None, partition=None):
        codec_for(type(record)).encode(record)
        self.attempts += 1
        if self.attempts <= self.fail_first:
            raise DeliveryError("broker down")
        self.delivered.append((topic, key, record))
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


async def test_a_failed_delivery_is_sent_again_with_a_beating_pause_before_the_state_is_written(tmp_path):
    """Under the Kafka driver (no broker needed to settle and checkpoint): the violation whose first send failed
    is re-sent after one retry pause, which counts as the loop going round, and only then does the checkpoint
    hook write the state file."""
    clock = ManualClock(START_MS)
    metrics = ServiceMetrics("guard", GUARD_METRICS, clock=clock, max_silence_seconds=10)
    processor = GuardProcessor(GuardConfig(), clock, metrics=metrics)
    runner = MessageRunner(processor, guard_topics(TOPICS), clock, metrics=metrics)
    producer = RecordingProducer(fail_first=1)
    store = GuardStateStore(tmp_path / "guard.state")
    saved_after: list[list] = []

    class Checkpoint(StateCheckpoint):
        async def __call__(self, positions):
            saved_after.append(list(producer.delivered))
            return await super().__call__(positions)

    async def no_sleep(_seconds: float) -> None:
        return None

    driver = KafkaDriver(runner, kafka=KafkaSettings(topic_prefix="unit."), outputs=guard_outputs(TOPICS),
                         producer=producer, clock=clock, consumer_group="g", metrics=metrics,
                         checkpoint=Checkpoint(processor, store, clock, topics=guard_topics(TOPICS).values()),
                         sleep=no_sleep)
    message = RawMessage(TOPICS.pod_events, 0, 0, b"k", codec_for(PodEvent).encode(leaky(clock.now_ms())),
                         clock.now_ms())
    step = runner.step(message)
    ((fired_emit,),) = (step.result.emits,)
    fired = fired_emit.record
    await driver.settle(((message, step.result),))
    assert producer.delivered == []
    clock.advance_ms(11_000)
    assert not metrics.heartbeat.check().alive
    await driver._checkpoint(retry=True)  # what the driver runs after a batch: flush, then the hook, then commit
    assert producer.delivered == [(TOPICS.violations, fired.fingerprint.encode(), fired)]
    assert driver.delivery_retries == 1
    assert metrics.heartbeat.check().alive  # the retry pause beat
    assert saved_after == [producer.delivered] and store.load() is not None


async def test_the_checkpoint_writes_the_engine_with_its_positions_and_the_state_restores_the_same_engine(
        tmp_path):
    guard = Guard()
    guard.pod(leaky(guard.clock.now_ms()))
    guard.run()
    store = GuardStateStore(tmp_path / "guard.state")
    checkpoint = StateCheckpoint(guard.processor, store, guard.clock, topics=guard_topics(TOPICS).values())
    positions = {(TOPICS.pod_events, 0): 1, (TOPICS.node_samples, 2): 7}
    assert await checkpoint(positions) == positions  # what the driver then commits
    state = store.load()
    assert state is not None and state.positions == positions and state.saved_at_unix_ms == START_MS
    restored = GuardEngine.restore(guard.config, state.engine_bytes)
    assert restored.active() == guard.engine.active() and len(restored.active()) == 1
    assert checkpoint.snapshots == 1


async def test_without_a_state_file_the_checkpoint_commits_the_positions_and_takes_no_snapshot(monkeypatch):
    guard = Guard()
    guard.pod(leaky(guard.clock.now_ms()))
    guard.run()
    taken = []
    monkeypatch.setattr(guard.processor, "snapshot", lambda: taken.append(1) or b"")
    checkpoint = StateCheckpoint(guard.processor, None, guard.clock, topics=guard_topics(TOPICS).values())
    positions = {(TOPICS.pod_events, 0): 1, (TOPICS.node_samples, 2): 7}
    assert await checkpoint(positions) == positions
    assert taken == [] and checkpoint.snapshots == 0


async def test_the_checkpoint_writes_and_commits_nothing_while_rebuilding_and_commits_when_the_file_fails(
        tmp_path):
    guard = Guard()
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    failing = StateCheckpoint(guard.processor, GuardStateStore(blocker / "guard.state"), guard.clock,
                              topics=guard_topics(TOPICS).values())
    positions = {(TOPICS.pod_events, 0): 3}
    assert await failing(positions) == positions and failing.snapshots == 0  # logged; committing is still safe
    guard.processor.begin_rebuild(())
    store = GuardStateStore(tmp_path / "guard.state")
    assert await StateCheckpoint(guard.processor, store, guard.clock, topics=guard_topics(TOPICS).values())(
        positions) is None
    assert store.load() is None


def test_a_rebuild_from_the_violations_topic_publishes_only_what_the_topic_does_not_know():
    """The four cases of a guard that lost its state: a resolved leak replayed (ADDED, DELETED) stays silent; a
    firing one still leaky keeps its first_seen and is not sent again; a firing one whose pod was deleted resolves
    after the hold-down; a new one fires. Nothing is published before ``finish_rebuild``; no state while
    rebuilding is taken as published."""
    first = Guard()
    clock = first.clock

    def pod(uid: str, event_type: PodEventType = PodEventType.ADDED) -> PodEvent:
        return dataclasses.replace(leaky(clock.now_ms(), event_type), uid=uid, name=f"nb-{uid}")

    for uid in ("gone", "stays", "deleted"):
        first.pod(pod(uid))
    first.pod(pod("gone", PodEventType.DELETED))
    first.run()
    clock.advance_ms(HOLD_DOWN_SECONDS * 1000)
    first.tick()
    topic = {v.fingerprint: v for _, v in first.violations()}  # the compacted topic's last states
    by_pod = {v.pod_uid: v for v in topic.values()}
    assert by_pod["gone"].state is ViolationState.RESOLVED
    assert by_pod["stays"].state is by_pod["deleted"].state is ViolationState.FIRING

    clock.advance_ms(600_000)  # ten minutes later a guard without state starts: pod events from the beginning
    second = Guard(ManualClock(clock.now_ms()))
    firing = second.processor.begin_rebuild(topic.values())
    assert sorted(v.pod_uid for v in firing) == ["deleted", "stays"]  # the firing ones' leases to renew
    assert second.metric("gpumeter_guard_violations_firing", rule="visibility_leak", severity="critical") == 2
    for uid, event_type in (("gone", PodEventType.ADDED), ("stays", PodEventType.ADDED),
                            ("deleted", PodEventType.ADDED), ("gone", PodEventType.DELETED),
                            ("deleted", PodEventType.DELETED), ("new", PodEventType.ADDED)):
        second.pod(dataclasses.replace(pod(uid, event_type), observed_at_unix_ms=clock.now_ms()))
    second.run()
    assert second.tick() == ()
    assert second.violations() == [] and second.processor.rebuilding
    settled = second.processor.finish_rebuild()  # the driver's on_read_to_start; it produces the result
    second.driver.emit(settled.emits, second.clock.now_ms())
    assert [(e.record.pod_uid, e.record.state) for e in settled.emits] == [("new", ViolationState.FIRING)]
    assert second.processor.finish_rebuild().emits == ()  # once only
    second.clock.advance_ms(HOLD_DOWN_SECONDS * 1000)
    second.tick()
    after = [(v.pod_uid, v.state) for _, v in second.violations()]
    assert after == [("new", ViolationState.FIRING), ("deleted", ViolationState.RESOLVED)]
    resolved = second.violations()[1][1]
    assert resolved.first_seen_unix_ms == by_pod["deleted"].first_seen_unix_ms
    assert {v.pod_uid: v.first_seen_unix_ms for v in second.engine.active()} == {
        "stays": by_pod["stays"].first_seen_unix_ms, "new": second.clock.now_ms() - HOLD_DOWN_SECONDS * 1000}
    # Only what was emitted counts: the new leak's FIRING and the deleted one's RESOLVED.
    assert second.metric("gpumeter_guard_violation_transitions_total", rule="visibility_leak", state="firing") == 1
    assert second.metric("gpumeter_guard_violation_transitions_total", rule="visibility_leak",
                         state="resolved") == 1
