"""The Kafka driver hands its processor each fetched batch at once, dead-letters per message, tells it of its
partitions (the contract's ``on_assigned`` / ``on_revoked``), and never commits past input whose effect is not
durable -- a revocation in the middle of a batch included. No broker: a fake consumer records the commits."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from gpumeter.clock import ManualClock
from gpumeter.kafka.driver import KafkaDriver
from gpumeter.settings import KafkaSettings
from gpumeter.stream.contract import DEAD_LETTERS, NOTHING, Emit, Input, ProcessorDefaults, Result, Settled
from gpumeter.stream.deadletter import RawMessage
from gpumeter.stream.runner import MessageRunner
from schemas.examples import load_examples
from schemas.records import DeadLetter, PodEvent
from schemas.typed import codec_for

NOW = 1_795_000_100_000
TOPIC = "t.pods"


class Batched(ProcessorDefaults):
    """Each pod event's uid becomes a state change; every call of ``handle_batch`` is recorded. ``on_revoked``
    hands over a change per revoked partition (state it kept in memory, to be made durable before the commit)."""

    service = "batched"
    inputs = (Input("pods", PodEvent),)

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.assigned: list[frozenset] = []
        self.revoked: list[frozenset] = []

    def handle(self, event, position):
        return Result(changes=(event.record.uid,))

    def handle_batch(self, events):
        self.batches.append([position.offset for _, position in events])
        return super().handle_batch(events)

    def on_clock(self, now_ms, caught_up=True):
        return NOTHING

    def on_assigned(self, partitions):
        self.assigned.append(frozenset(partitions))
        return NOTHING

    def on_revoked(self, partitions):
        self.revoked.append(frozenset(partitions))
        return Result(changes=tuple(f"flush-{topic}-{partition}" for topic, partition in sorted(partitions)))


class Store:
    """Applies changes when ``gate`` is open (a worker thread waits on it); ``fail`` makes ``apply`` raise."""

    def __init__(self) -> None:
        self.durable: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail: Exception | None = None

    def apply(self, changes):
        self.entered.set()
        self.gate.wait(10)
        if self.fail is not None:
            raise self.fail
        self.durable.extend(changes)
        return [Settled() for _ in changes]

    def published(self, changes, now_ms):
        pass


class FakeConsumer:
    def __init__(self) -> None:
        self.commits: list[dict[tuple[str, int], int]] = []

    async def commit(self, offsets):
        self.commits.append({(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items()})


class AcknowledgingProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    async def send(self, topic, record, *, key=None, partition=None):
        self.sent.append((topic, record))
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def partitions_for(self, topic):
        return {0}


def _driver(processor=None, store=None):
    processor = processor or Batched()
    clock = ManualClock(NOW)
    runner = MessageRunner(processor, {"pods": TOPIC}, clock, log_dead_letters=False)
    producer = AcknowledgingProducer()
    driver = KafkaDriver(runner, kafka=KafkaSettings(), outputs={DEAD_LETTERS: "t.dead"}, producer=producer,
                         clock=clock, consumer_group="g", store=store)
    driver._consumer = FakeConsumer()
    return driver, processor, producer


def _pod(uid: str) -> bytes:
    pod = dataclasses.replace(load_examples(PodEvent)[0], uid=uid, observed_at_unix_ms=NOW - 1_000)
    return codec_for(PodEvent).encode(pod)


def _messages(partition: int, values: list[bytes], start: int = 0) -> list[RawMessage]:
    return [RawMessage(TOPIC, partition, start + i, b"k", value, NOW) for i, value in enumerate(values)]


async def test_a_fetched_batch_reaches_the_processor_at_once_and_a_bad_message_is_dead_lettered_alone():
    store = Store()
    driver, processor, producer = _driver(store=store)
    await driver._assigned({(TOPIC, 0)})
    batch = _messages(0, [_pod("a"), b"\x00not avro", _pod("b"), _pod("c")])
    assert await driver.handle_messages(batch) == 4
    assert processor.batches == [[0, 2, 3]]  # one call, the bad message left out
    assert store.durable == ["a", "b", "c"]
    await driver.checkpoint()
    (letter_topic, letter), = producer.sent
    assert letter_topic == "t.dead" and isinstance(letter, DeadLetter) and letter.source_offset == 1
    assert driver._consumer.commits == [{(TOPIC, 0): 4}]


async def test_partitions_assigned_and_revoked_are_the_processor_s_to_hear_of():
    store = Store()
    driver, processor, _ = _driver(store=store)
    await driver._assigned({(TOPIC, 0), (TOPIC, 1)})
    await driver._assigned({(TOPIC, 0), (TOPIC, 1)})  # nothing new
    assert processor.assigned == [frozenset({(TOPIC, 0), (TOPIC, 1)})]
    await driver.handle_messages(_messages(1, [_pod("a")]))
    await driver._revoked({(TOPIC, 1)})
    assert processor.revoked == [frozenset({(TOPIC, 1)})]
    # What the processor handed over at revocation is durable before the revoked partition's last commit.
    assert store.durable == ["a", f"flush-{TOPIC}-1"]
    assert driver._consumer.commits == [{(TOPIC, 1): 1}]


async def test_a_revocation_in_the_middle_of_a_batch_commits_only_once_the_batch_is_durable():
    store = Store()
    driver, processor, _ = _driver(store=store)
    await driver._assigned({(TOPIC, 0)})
    await driver.handle_messages(_messages(0, [_pod("a")]))
    await driver.checkpoint()
    store.gate.clear()
    store.entered.clear()  # set by the first batch's write: the wait below must see this batch's

    async def as_run_handles_it():
        # ``run`` handles each fetched batch under the driver's lock, which a revocation waits for.
        async with driver._lock:
            return await driver.handle_messages(_messages(0, [_pod("b"), _pod("c")], start=1))

    batch = asyncio.ensure_future(as_run_handles_it())
    await asyncio.to_thread(store.entered.wait, 10)  # the batch's changes are being written
    revocation = asyncio.ensure_future(driver._revoked({(TOPIC, 0)}))
    await asyncio.sleep(0.05)
    assert not revocation.done() and driver._consumer.commits == [{(TOPIC, 0): 1}]
    store.gate.set()
    await batch
    await revocation
    assert store.durable == ["a", "b", "c", f"flush-{TOPIC}-0"]
    assert driver._consumer.commits == [{(TOPIC, 0): 1}, {(TOPIC, 0): 3}]


async def test_a_revocation_whose_state_cannot_be_made_durable_commits_nothing():
    store = Store()
    driver, processor, _ = _driver(store=store)
    await driver._assigned({(TOPIC, 0)})
    await driver.handle_messages(_messages(0, [_pod("a"), _pod("b")]))
    store.fail = RuntimeError("ledger gone")
    await driver._revoked({(TOPIC, 0)})
    # The processor's revocation state is not durable: the offsets stay where they were (none committed), so the
    # new owner reads the partition again from the last commit; the partition is given up all the same.
    assert driver._consumer.commits == []
    assert driver.taken == {}


def test_the_drivers_consumer_fetches_as_the_kafka_settings_say(monkeypatch) -> None:
    """Billing's and the guard's consumer (the driver's) is made with ``KafkaSettings.consumer_fetch_kwargs``."""
    import aiokafka

    made: list[dict] = []

    class Stop(Exception):
        pass

    class Recording:
        def __init__(self, *args, **kwargs) -> None:
            made.append(kwargs)
            raise Stop

    monkeypatch.setattr(aiokafka, "AIOKafkaConsumer", Recording)
    clock = ManualClock(NOW)
    runner = MessageRunner(Batched(), {"pods": TOPIC}, clock, log_dead_letters=False)
    kafka = KafkaSettings(consumer_fetch_min_bytes=4096, consumer_fetch_max_wait_ms=250)
    driver = KafkaDriver(runner, kafka=kafka, outputs={DEAD_LETTERS: "t.dead"}, producer=AcknowledgingProducer(),
                         clock=clock, consumer_group="g")
    with pytest.raises(Stop):
        asyncio.run(driver.run(asyncio.Event()))
    assert [(m["fetch_min_bytes"], m["fetch_max_wait_ms"]) for m in made] == [(4096, 250)]


class Owing(Store):
    """Each change owes three records of its key on ``out``, then one on ``whole`` (billing's cost lines and
    bill), and the change ``"state"`` one ``latest_wins`` record more of the same key."""

    def apply(self, changes):
        super().apply(changes)
        out = []
        for change in changes:
            key = change.encode()
            emits = tuple(Emit("out", key, f"{change}-{i}") for i in range(3)) + (Emit("whole", key, change),)
            if change == "c":
                emits += (Emit("out", key, "c-state", latest_wins=True), Emit("out", key, "c-state2",
                                                                                  latest_wins=True))
            out.append(Settled(owed=emits))
        return out


class BatchingProducer(AcknowledgingProducer):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[str, bytes, list, int | None]] = []

    async def send_batch(self, topic, records, *, key, partition=None):
        self.batches.append((topic, key, list(records), partition))
        self.sent += [(topic, record) for record in records]
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return [future] * len(records)


async def test_consecutive_records_of_one_key_and_output_go_to_the_producer_as_one_batch():
    store = Owing()
    processor = Batched()
    clock = ManualClock(NOW)
    runner = MessageRunner(processor, {"pods": TOPIC}, clock, log_dead_letters=False)
    producer = BatchingProducer()
    driver = KafkaDriver(runner, kafka=KafkaSettings(), outputs={DEAD_LETTERS: "t.dead", "out": "t.out",
                                                                 "whole": "t.whole"},
                         producer=producer, clock=clock, consumer_group="g", store=store)
    driver._consumer = FakeConsumer()
    await driver._assigned({(TOPIC, 0)})
    assert await driver.handle_messages(_messages(0, [_pod("a"), _pod("b"), _pod("c")])) == 3
    await driver.checkpoint()
    # Every record once, in the order owed; the runs of three in one batch each; the bill and the compacted
    # states (latest_wins: never batched) one send each.
    assert [record for _, record in producer.sent] == [
        "a-0", "a-1", "a-2", "a", "b-0", "b-1", "b-2", "b", "c-0", "c-1", "c-2", "c", "c-state", "c-state2"]
    assert producer.batches == [("t.out", key.encode(), [f"{key}-{i}" for i in range(3)], None)
                                for key in "abc"]
    assert driver._consumer.commits == [{(TOPIC, 0): 3}]
