"""The guard processor without Kafka: the real engine behind it, a recording producer and sink in front.

Bad input is dead-lettered and the processor carries on; violations go out keyed by fingerprint to the producer
and the sink; the transition counter moves once per state change (not per refresh) and the firing gauge follows
the engine; failed deliveries are re-sent, newest state per fingerprint only; the state it snapshots restores
the same engine."""

from __future__ import annotations

import asyncio
import dataclasses

from gpumeter.clock import ManualClock
from gpumeter.kafka.deadletter import RawMessage
from gpumeter.kafka.producer import DeliveryError
from gpumeter.metrics import ServiceMetrics
from schemas.catalog import TopicCatalog
from schemas.records import DeadLetter, PodEvent, PodEventType, Violation, ViolationState
from schemas.typed import codec_for
from services.guard.config import GuardConfig
from services.guard.engine import GuardEngine
from services.guard.service import GUARD_METRICS, GuardProcessor
from tests.unit.attributor import pod_event

TOPICS = TopicCatalog(prefix="unit.")
START_MS = 1_780_000_000_000
HOLD_DOWN_SECONDS = 60
REFRESH_SECONDS = 120


class RecordingProducer:
    """Encodes every record with its real codec and acknowledges it, or fails the first ``fail_first`` sends."""

    def __init__(self, fail_first: int = 0) -> None:
        self.fail_first = fail_first
        self.delivered: list[tuple[str, bytes | None, object]] = []
        self.attempts = 0

    async def send(self, topic, record, *, key=None):
        codec_for(type(record)).encode(record)
        self.attempts += 1
        if self.attempts <= self.fail_first:
            raise DeliveryError("broker down")
        self.delivered.append((topic, key, record))
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


class RecordingSink:
    def __init__(self) -> None:
        self.updates: list[Violation] = []

    def update(self, violations) -> None:
        self.updates.extend(violations)


async def no_sleep(_seconds: float) -> None:
    return None


class Feed:
    def __init__(self) -> None:
        self.offsets: dict[tuple[str, int], int] = {}

    def message(self, topic: str, value: bytes | None, key: bytes | None = b"k", partition: int = 0) -> RawMessage:
        offset = self.offsets.get((topic, partition), 0)
        self.offsets[(topic, partition)] = offset + 1
        return RawMessage(topic, partition, offset, key, value, 0)

    def pod(self, event: PodEvent) -> RawMessage:
        return self.message(TOPICS.pod_events, codec_for(PodEvent).encode(event))


def leaky(observed_ms: int, event_type: PodEventType = PodEventType.ADDED) -> PodEvent:
    event = pod_event("uid-1", namespace="research", name="notebook-0", observed_at_unix_ms=observed_ms,
                      event_type=event_type, resource_version=str(observed_ms))
    (container,) = event.containers
    return dataclasses.replace(event, containers=(dataclasses.replace(container, visible_devices_env="all"),))


def make(fail_first: int = 0):
    config = GuardConfig(hold_down_seconds=HOLD_DOWN_SECONDS, refresh_seconds=REFRESH_SECONDS)
    clock = ManualClock(START_MS)
    producer = RecordingProducer(fail_first)
    sink = RecordingSink()
    metrics = ServiceMetrics("guard", GUARD_METRICS)
    processor = GuardProcessor(engine=GuardEngine(config), producer=producer, topics=TOPICS, clock=clock,
                               sink=sink, metrics=metrics, sleep=no_sleep)
    return processor, producer, sink, metrics, clock, config


def metric(metrics: ServiceMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def violations_sent(producer: RecordingProducer) -> list[tuple[bytes, Violation]]:
    return [(key, record) for topic, key, record in producer.delivered if topic == TOPICS.violations]


async def test_garbage_is_dead_lettered_and_the_next_message_is_processed():
    processor, producer, _, metrics, clock, _ = make()
    feed = Feed()
    garbage = feed.message(TOPICS.node_samples, b"\xc3\x01 garbage")
    assert await processor.handle(garbage) is None
    fired = await processor.handle(feed.pod(leaky(clock.now_ms())))
    assert fired and fired[0].rule == "visibility_leak"
    ((topic, key, letter),) = [d for d in producer.delivered if d[0] == TOPICS.dead_letters]
    assert isinstance(letter, DeadLetter)
    assert (letter.service, letter.source_topic, letter.source_offset, letter.raw_bytes) == (
        "guard", TOPICS.node_samples, garbage.offset, garbage.value)
    assert processor.positions == {(TOPICS.node_samples, 0): 1, (TOPICS.pod_events, 0): 1}
    assert metric(metrics, "gpumeter_dead_letters_total", service="guard", topic=TOPICS.node_samples,
                  reason_code=letter.reason_code) == 1


async def test_a_pod_events_tombstone_is_skipped_other_empty_values_are_dead_lettered():
    processor, producer, _, _, _, _ = make()
    feed = Feed()
    assert await processor.handle(feed.message(TOPICS.pod_events, None, key=b"node-a/uid-9")) is None
    assert producer.delivered == []
    assert await processor.handle(feed.message(TOPICS.costs, None)) is None
    ((_, _, letter),) = producer.delivered
    assert (letter.reason_code, letter.source_topic) == ("EMPTY", TOPICS.costs)
    assert processor.positions == {(TOPICS.pod_events, 0): 1, (TOPICS.costs, 0): 1}


async def test_violations_go_out_by_fingerprint_and_metrics_count_state_changes_not_refreshes():
    processor, producer, sink, metrics, clock, _ = make()
    feed = Feed()
    (fired,) = await processor.handle(feed.pod(leaky(clock.now_ms())))
    assert fired.state is ViolationState.FIRING
    # The same spec again after the refresh interval: a refresh record, not a new state.
    clock.advance_ms(REFRESH_SECONDS * 1000)
    (refresh,) = await processor.handle(feed.pod(dataclasses.replace(leaky(clock.now_ms()),
                                                                     event_type=PodEventType.MODIFIED)))
    assert (refresh.fingerprint, refresh.state) == (fired.fingerprint, ViolationState.FIRING)
    assert refresh.last_seen_unix_ms > fired.last_seen_unix_ms
    labels = {"rule": fired.rule, "state": "firing"}
    assert metric(metrics, "gpumeter_guard_violation_transitions_total", **labels) == 1
    assert metric(metrics, "gpumeter_guard_violations_firing", rule=fired.rule, severity="critical") == 1

    # Deleted: nothing until the hold-down has passed, then RESOLVED.
    clock.advance_ms(1_000)
    assert await processor.handle(feed.pod(leaky(clock.now_ms(), PodEventType.DELETED))) == ()
    clock.advance_ms(HOLD_DOWN_SECONDS * 1000 - 1)
    assert await processor.tick() == ()
    clock.advance_ms(1)
    (resolved,) = await processor.tick()
    assert (resolved.fingerprint, resolved.state) == (fired.fingerprint, ViolationState.RESOLVED)
    assert metric(metrics, "gpumeter_guard_violation_transitions_total", rule=fired.rule, state="resolved") == 1
    assert metric(metrics, "gpumeter_guard_violation_transitions_total", **labels) == 1
    assert metric(metrics, "gpumeter_guard_violations_firing", rule=fired.rule, severity="critical") == 0

    sent = violations_sent(producer)
    assert [v for _, v in sent] == [fired, refresh, resolved] == sink.updates
    assert all(key == v.fingerprint.encode() for key, v in sent)
    assert await processor.flush()
    assert processor.unacknowledged == 0


async def test_a_retry_pause_counts_as_the_loop_going_round():
    processor, _, _, _, clock, _ = make(fail_first=1)
    processor.metrics = ServiceMetrics("guard", GUARD_METRICS, clock=clock, max_silence_seconds=10)
    await processor.handle(Feed().pod(leaky(clock.now_ms())))
    clock.advance_ms(11_000)
    assert not processor.metrics.heartbeat.check().alive
    assert await processor.flush()  # one failed delivery: one pause before the re-send
    assert processor.stats.delivery_retries == 1
    assert processor.metrics.heartbeat.check().alive


async def test_failed_deliveries_are_sent_again_before_flush_returns():
    processor, producer, _, _, clock, _ = make(fail_first=1)
    (fired,) = await processor.handle(Feed().pod(leaky(clock.now_ms())))
    assert violations_sent(producer) == []
    assert await processor.flush()
    assert violations_sent(producer) == [(fired.fingerprint.encode(), fired)]
    assert processor.stats.delivery_retries == 1


async def test_state_restores_the_same_engine():
    processor, _, _, _, clock, config = make()
    await processor.handle(Feed().pod(leaky(clock.now_ms())))
    state = processor.state()
    assert state.positions == processor.positions
    assert GuardEngine.restore(config, state.engine_bytes).active() == processor.engine.active()
    assert len(processor.engine.active()) == 1


async def test_a_rebuild_from_the_violations_topic_publishes_only_what_the_topic_does_not_know():
    """The four cases of a guard that lost its state: a resolved leak replayed (ADDED, DELETED) stays silent; a
    firing one still leaky keeps its first_seen and is not sent again; a firing one whose pod was deleted resolves
    after the hold-down; a new one fires. Nothing is published before ``finish_rebuild``; no state while
    rebuilding is taken as published."""
    first, producer, _, _, clock, _ = make()
    feed = Feed()

    def pod(uid: str, event_type: PodEventType = PodEventType.ADDED) -> PodEvent:
        return dataclasses.replace(leaky(clock.now_ms(), event_type), uid=uid, name=f"nb-{uid}")

    for uid in ("gone", "stays", "deleted"):
        await first.handle(feed.pod(pod(uid)))
    await first.handle(feed.pod(pod("gone", PodEventType.DELETED)))
    clock.advance_ms(HOLD_DOWN_SECONDS * 1000)
    await first.tick()
    topic = {v.fingerprint: v for _, v in violations_sent(producer)}  # the compacted topic's last states
    by_pod = {v.pod_uid: v for v in topic.values()}
    assert by_pod["gone"].state is ViolationState.RESOLVED
    assert by_pod["stays"].state is by_pod["deleted"].state is ViolationState.FIRING

    clock.advance_ms(600_000)  # ten minutes later a guard without state starts: pod events from the beginning
    second, sent, sink, metrics, second_clock, _ = make()
    second_clock.set_ms(clock.now_ms())
    second.begin_rebuild(topic.values())
    assert sorted(v.pod_uid for v in sink.updates) == ["deleted", "stays"]  # the firing ones' leases renewed
    replay = Feed()
    for uid, event_type in (("gone", PodEventType.ADDED), ("stays", PodEventType.ADDED),
                            ("deleted", PodEventType.ADDED), ("gone", PodEventType.DELETED),
                            ("deleted", PodEventType.DELETED), ("new", PodEventType.ADDED)):
        await second.handle(replay.pod(dataclasses.replace(pod(uid, event_type), observed_at_unix_ms=clock.now_ms())))
    await second.tick()
    assert violations_sent(sent) == [] and second.rebuilding
    settled = await second.finish_rebuild()
    assert [(v.pod_uid, v.state) for v in settled] == [("new", ViolationState.FIRING)]
    second_clock.advance_ms(HOLD_DOWN_SECONDS * 1000)
    await second.tick()
    after = [(v.pod_uid, v.state) for _, v in violations_sent(sent)]
    assert after == [("new", ViolationState.FIRING), ("deleted", ViolationState.RESOLVED)]
    resolved = violations_sent(sent)[1][1]
    assert resolved.first_seen_unix_ms == by_pod["deleted"].first_seen_unix_ms
    assert {v.pod_uid: v.first_seen_unix_ms for v in second.engine.active()} == {
        "stays": by_pod["stays"].first_seen_unix_ms, "new": second_clock.now_ms() - HOLD_DOWN_SECONDS * 1000}
