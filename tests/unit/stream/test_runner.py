"""The one runner: every kind of bad message becomes one dead letter, and good ones reach the processor typed."""

from __future__ import annotations

import dataclasses

import pytest

from gpumeter.clock import ManualClock
from gpumeter.errors import InvalidMessage, OutOfRange
from gpumeter.kafka.deadletter import RawMessage
from gpumeter.stream.contract import DEAD_LETTERS, NOTHING, Emit, Event, Input, Position, Result
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

    def on_clock(self, now_ms):
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
