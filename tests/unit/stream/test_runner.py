"""The one runner: every kind of bad message becomes one dead letter, and good ones reach the processor typed."""

from __future__ import annotations

import dataclasses

import pytest

from gpumeter.clock import ManualClock
from gpumeter.errors import InvalidMessage, OutOfRange
from gpumeter.stream.deadletter import RawMessage
from gpumeter.stream.contract import DEAD_LETTERS, NOTHING, Emit, Event, Input, Position, Result, Settled
from gpumeter.stream.memory import MemoryBroker, MemoryDriver
from gpumeter.stream.runner import MessageRunner
from gpumeter.validation import check_pod_event
from schemas.examples import load_examples
from schemas.records import DeadLetter, NodeSample, PodEvent
from schemas.typed import codec_for

NOW = 1_795_000_100_000


class Echo:
    """A processor that emits each pod event's uid as a pod event again, and rejects pods named 'reject-me'."""

    service = "echo"
    inputs = (Input("pods", PodEvent, lambda record, now: check_pod_event(record, now, 120_000)),
              Input("samples", NodeSample))

    def __init__(self) -> None:
        self.seen: list[tuple[Event, Position]] = []
        self.ticks: list[int] = []

    def handle(self, event, position):
        self.seen.append((event, position))
        if event.input == "pods" and event.record.name == "reject-me":
            return Result(rejected=(InvalidMessage("named to be rejected", reason_code="NAMED"),))
        if event.input == "pods" and event.record.name == "raise-me":
            raise OutOfRange("raised")
        if event.input == "pods":
            return Result(emits=(Emit("out", event.record.uid.encode(), event.record),))
        return NOTHING

    def on_clock(self, now_ms, caught_up=True):
        self.ticks.append(now_ms)
        return NOTHING


def _runner():
    return MessageRunner(Echo(), {"pods": "t.pods", "samples": "t.samples"}, ManualClock(NOW))


def _pod(**changes):
    example = load_examples(PodEvent)[0]
    return dataclasses.replace(example, **{"observed_at_unix_ms": NOW - 1_000, **changes})


def _message(topic, value, offset=0, key=b"k"):
    return RawMessage(topic, 0, offset, key, value, NOW)


def _letter(step) -> DeadLetter:
    (emit,) = step.result.emits
    assert emit.output == DEAD_LETTERS and emit.key == step.position.topic.encode()
    return emit.record


def test_a_good_message_reaches_the_processor_typed_with_its_position():
    runner = _runner()
    pod = _pod()
    step = runner.step(_message("t.pods", codec_for(PodEvent).encode(pod), offset=7))
    assert step.handled and step.dead_lettered == 0
    assert step.position == Position("t.pods", 0, 7)
    ((event, position),) = runner.processor.seen
    assert (event.input, event.record, event.key, event.received_at_unix_ms) == ("pods", pod, b"k", NOW)
    assert step.result.emits == (Emit("out", pod.uid.encode(), pod),)


@pytest.mark.parametrize("topic, value, reason", [
    ("t.other", b"\xc3\x01" + b"\x00" * 8, "WRONG_TOPIC"),
    ("t.pods", None, "EMPTY"),
    ("t.pods", b"\x00\x01", "CORRUPT"),
    ("t.pods", b"\xc3\x01\x00", "TRUNCATED"),
    ("t.pods", b"\xc3\x01" + b"\xff" * 8 + b"x", "UNKNOWN_SCHEMA"),
    ("t.samples", codec_for(PodEvent).encode(load_examples(PodEvent)[0]), "WRONG_RECORD_TYPE"),
])
def test_every_kind_of_bad_bytes_is_one_dead_letter(topic, value, reason):
    runner = _runner()
    step = runner.step(_message(topic, value))
    assert not step.handled and step.dead_lettered == 1 and runner.processor.seen == []
    letter = _letter(step)
    assert (letter.reason_code, letter.service, letter.source_topic, letter.source_offset) == (reason, "echo", topic, 0)
    assert letter.raw_bytes == (value or b"")


def test_a_range_check_a_raised_error_and_a_result_rejection_each_dead_letter_the_message():
    runner = _runner()
    future = _pod(observed_at_unix_ms=NOW + 10 * 3600_000)
    assert _letter(runner.step(_message("t.pods", codec_for(PodEvent).encode(future)))).reason_code == "OUT_OF_RANGE"
    assert runner.processor.seen == []  # the check ran before the processor
    raised = runner.step(_message("t.pods", codec_for(PodEvent).encode(_pod(name="raise-me"))))
    assert not raised.handled and _letter(raised).reason_code == "OUT_OF_RANGE"
    rejected = runner.step(_message("t.pods", codec_for(PodEvent).encode(_pod(name="reject-me"))))
    assert rejected.handled and _letter(rejected).reason_code == "NAMED"
    assert runner.dead_lettered == 3 and runner.consumed == 3


def test_the_memory_driver_reads_in_time_order_and_produces_encoded_records():
    broker = MemoryBroker()
    for topic in ("t.pods", "t.samples", "t.out", "t.dead"):
        broker.create(topic, 3)
    runner = _runner()
    codec = codec_for(PodEvent)
    late, early = _pod(uid="late"), _pod(uid="early")
    broker.produce("t.pods", b"a", codec.encode(late), timestamp_ms=NOW + 5)
    broker.produce("t.pods", b"b", codec.encode(early), timestamp_ms=NOW + 1)
    broker.produce("t.pods", b"c", b"garbage", timestamp_ms=NOW + 3)
    driver = MemoryDriver(runner, broker, {"out": "t.out", DEAD_LETTERS: "t.dead"})
    assert driver.run() == 3
    assert [e.record.uid for e, _ in runner.processor.seen] == ["early", "late"]
    assert sorted(p.uid for p in broker.records("t.out", PodEvent)) == ["early", "late"]
    (letter,) = broker.records("t.dead", DeadLetter)
    assert letter.reason_code == "CORRUPT" and letter.raw_bytes == b"garbage"
    assert driver.run() == 0  # its positions moved on


class Ledgerish:
    """A processor whose every pod event is a state change owing an echo; the store refuses 'refuse-me'."""

    service = "ledgerish"
    inputs = (Input("pods", PodEvent),)

    def handle(self, event, position):
        return Result(emits=(Emit("out", b"first", event.record),), changes=(event.record,))

    def on_clock(self, now_ms, caught_up=True):
        return Result(changes=("tick",))


class RefusingStore:
    def __init__(self, refuse_ticks=False):
        self.applied, self.published_uids, self.refuse_ticks = [], [], refuse_ticks

    def apply(self, changes):
        out = []
        for change in changes:
            if change == "tick":
                out.append(Settled(rejected=InvalidMessage("no", reason_code="NO")) if self.refuse_ticks
                           else Settled())
            elif change.name == "refuse-me":
                out.append(Settled(rejected=InvalidMessage("refused", reason_code="REFUSED")))
            else:
                self.applied.append(change.uid)
                out.append(Settled(owed=(Emit("out", b"owed", change),)))
        return out

    def published(self, changes, now_ms):
        self.published_uids.extend(c.uid for c in changes)


def test_settling_puts_each_step_s_emits_first_then_what_its_changes_owe_or_the_dead_letter_of_a_refusal():
    runner = MessageRunner(Ledgerish(), {"pods": "t.pods"}, ManualClock(NOW))
    codec = codec_for(PodEvent)
    good, refused = _pod(uid="good"), _pod(uid="bad", name="refuse-me")
    steps = []
    for offset, pod in enumerate((good, refused)):
        message = _message("t.pods", codec.encode(pod), offset)
        steps.append((message, runner.step(message).result))
    store = RefusingStore()
    settled = store.apply([change for _, result in steps for change in result.changes])
    settlement = runner.settle(steps, settled)
    assert [(e.output, e.key) for e in settlement.emits] == [("out", b"first"), ("out", b"owed"), ("out", b"first"),
                                                             (DEAD_LETTERS, b"t.pods")]
    assert settlement.emits[3].record.raw_bytes == codec.encode(refused)
    assert settlement.emits[3].record.reason_code == "REFUSED"
    assert [c.uid for c in settlement.published] == ["good"]
    with pytest.raises(RuntimeError, match="more outcomes"):
        runner.settle(steps[:1], settled)


def test_a_refused_change_of_a_clock_tick_is_a_bug_not_a_dead_letter():
    runner = MessageRunner(Ledgerish(), {"pods": "t.pods"}, ManualClock(NOW))
    with pytest.raises(RuntimeError, match="clock tick"):
        runner.settle([(None, runner.tick(NOW))], RefusingStore(refuse_ticks=True).apply(["tick"]))


def test_the_memory_driver_settles_through_the_store_like_the_kafka_driver():
    broker = MemoryBroker()
    for topic in ("t.pods", "t.out", "t.dead"):
        broker.create(topic, 1)
    codec = codec_for(PodEvent)
    broker.produce("t.pods", b"a", codec.encode(_pod(uid="good")), timestamp_ms=NOW + 1)
    broker.produce("t.pods", b"b", codec.encode(_pod(uid="bad", name="refuse-me")), timestamp_ms=NOW + 2)
    store = RefusingStore()
    runner = MessageRunner(Ledgerish(), {"pods": "t.pods"}, ManualClock(NOW))
    driver = MemoryDriver(runner, broker, {"out": "t.out", DEAD_LETTERS: "t.dead"}, store)
    assert driver.run() == 2
    assert [m.key for m in broker.messages("t.out", 0)] == [b"first", b"owed", b"first"]
    assert store.applied == ["good"] and store.published_uids == ["good"]
    (letter,) = broker.records("t.dead", DeadLetter)
    assert letter.reason_code == "REFUSED"
