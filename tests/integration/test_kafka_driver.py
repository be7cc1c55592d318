"""The aiokafka driver on the session's real broker, with a small processor and store of this test's own.

The processor turns each pod event into one state change (the pod's name) that owes an echo of the event on the
output topic, partitioned by the event's node; the store refuses the change of a pod named ``refuse-me`` and is
unavailable for its first ``apply``. What must come out:

* every good event echoed once, in input order per partition, on its node's partition;
* one dead letter per bad message (garbage bytes) and per change the store refused, each carrying the message's
  own bytes, and the refused pod never echoed;
* the store retried after ``StoreUnavailable`` (nothing lost), told of exactly the echoed changes once their
  records were acknowledged;
* input committed only after that: a second driver of the same group reads nothing again, and one started after
  more input reads only the new messages;
* the clock ticked with ``caught_up`` once the input is read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from gpumeter.clock import SystemClock
from gpumeter.errors import InvalidMessage
from gpumeter.kafka.admin import ensure_topics
from gpumeter.kafka.driver import KafkaDriver
from gpumeter.kafka.producer import RecordProducer
from gpumeter.stream.contract import DEAD_LETTERS, NOTHING, Emit, Input, Result, Settled, StoreUnavailable
from gpumeter.stream.runner import MessageRunner
from schemas.catalog import partition_for_node
from schemas.examples import load_examples
from schemas.records import DeadLetter, PodEvent
from schemas.typed import codec_for
from tests.integration.topic_reading import read_messages

pytestmark = pytest.mark.integration

PARTITIONS = 3
WAIT_S = 30.0
GARBAGE = b"\xc3\x01 not a PodEvent"


class EchoPods:
    service = "echo"
    inputs = (Input("pods", PodEvent),)

    def __init__(self) -> None:
        self.ticks: list[tuple[int, bool]] = []

    def handle(self, event, position):
        return Result(changes=((event.record.name, event.record),))

    def on_clock(self, now_ms, caught_up=True):
        self.ticks.append((now_ms, caught_up))
        return NOTHING


class Refused(InvalidMessage):
    reason_code = "REFUSED"


class PodStore:
    """Refuses ``refuse-me``; unavailable for the first ``apply``; remembers what it applied and was published."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0
        self.applied: list[str] = []
        self.published_names: list[str] = []

    def apply(self, changes):
        with self.lock:
            self.calls += 1
            if self.calls == 1:
                raise StoreUnavailable("not yet")
            out = []
            for name, record in changes:
                if name == "refuse-me":
                    out.append(Settled(rejected=Refused(f"{name} is refused")))
                    continue
                self.applied.append(name)
                out.append(Settled(owed=(Emit("echo", record.uid.encode(), record,
                                              partition_by_node=record.node_name),)))
            return out

    def published(self, changes, now_ms):
        with self.lock:
            self.published_names.extend(name for name, _ in changes)


def _pods(count: int, now_ms: int, start: int = 0) -> list[PodEvent]:
    example = load_examples(PodEvent)[0]
    return [dataclasses.replace(example, uid=f"uid-{i}", name=f"pod-{i}", node_name=f"node-{i % 5}",
                                observed_at_unix_ms=now_ms) for i in range(start, start + count)]


async def _produce(settings, topic: str, items) -> None:
    producer = RecordProducer(settings)
    await producer.start()
    try:
        for item in items:
            if isinstance(item, bytes):
                await producer.send_bytes(topic, item, key=b"node-0", partition=0)
            else:
                await producer.send(topic, item, key=item.node_name.encode(),
                                    partition=partition_for_node(item.node_name, PARTITIONS))
    finally:
        await producer.stop()


async def _run_until(driver: KafkaDriver, done, describe, timeout_s: float = WAIT_S) -> None:
    stop = asyncio.Event()
    task = asyncio.ensure_future(driver.run(stop))
    deadline = time.monotonic() + timeout_s
    try:
        while not done():
            if task.done():
                task.result()
                pytest.fail("the driver stopped by itself")
            if time.monotonic() > deadline:
                pytest.fail(f"the driver did not get there in time: {describe()}")
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def _driver(settings, topics, processor, store, group, producer) -> KafkaDriver:
    runner = MessageRunner(processor, {"pods": topics["in"]}, SystemClock())
    return KafkaDriver(runner, kafka=settings, outputs={"echo": topics["out"], DEAD_LETTERS: topics["dead"]},
                       producer=producer, clock=SystemClock(), consumer_group=group, store=store,
                       tick_seconds=0.2, retry_initial_seconds=0.05, retry_max_seconds=0.2, poll_timeout_ms=100)


def test_the_driver_settles_through_the_store_dead_letters_and_commits_after_the_output(kafka_settings, group_id):
    async def scenario():
        prefix = kafka_settings.topic_prefix
        topics = {"in": prefix + "in", "out": prefix + "out", "dead": prefix + "dead"}
        await ensure_topics(kafka_settings, {name: (PARTITIONS, {}) for name in topics.values()}, 1)
        now_ms = SystemClock().now_ms()
        pods = _pods(6, now_ms)
        refused = dataclasses.replace(pods[2], name="refuse-me", uid="uid-refused")
        first = [pods[0], pods[1], GARBAGE, refused, *pods[2:]]
        await _produce(kafka_settings, topics["in"], first)

        store = PodStore()
        processor = EchoPods()
        producer = RecordProducer(kafka_settings)
        await producer.start()
        try:
            driver = _driver(kafka_settings, topics, processor, store, group_id, producer)
            await _run_until(driver, lambda: len(store.published_names) == len(pods)
                             and any(caught for _, caught in processor.ticks),
                             lambda: f"published {store.published_names}, ticks {processor.ticks[-3:]}")
            assert store.calls >= 2  # the first apply was unavailable and retried
            assert sorted(store.applied) == sorted(p.name for p in pods)
            assert sorted(store.published_names) == sorted(p.name for p in pods)

            echoed = await read_messages(kafka_settings, topics["out"])
            decode = codec_for(PodEvent).decode
            assert sorted(decode(m.value).uid for m in echoed) == sorted(p.uid for p in pods)
            for message in echoed:
                record = decode(message.value)
                assert message.partition == partition_for_node(record.node_name, PARTITIONS)
                assert message.key == record.uid.encode()
            per_partition: dict[int, list[str]] = {}
            for message in echoed:
                per_partition.setdefault(message.partition, []).append(decode(message.value).uid)
            for partition, uids in per_partition.items():
                expected = [p.uid for p in pods if partition_for_node(p.node_name, PARTITIONS) == partition]
                assert uids == expected

            letters = [codec_for(DeadLetter).decode(m.value) for m in await read_messages(kafka_settings,
                                                                                        topics["dead"])]
            by_reason = {letter.reason_code: letter for letter in letters}
            assert sorted(by_reason) == ["CORRUPT", "REFUSED"] or sorted(by_reason) == ["REFUSED", "UNKNOWN_SCHEMA"]
            assert len(letters) == 2
            assert by_reason["REFUSED"].raw_bytes == codec_for(PodEvent).encode(refused)
            assert all(letter.service == "echo" and letter.source_topic == topics["in"] for letter in letters)

            # Committed: a second driver of the group reads nothing again, then only what is new.
            more = _pods(2, now_ms, start=10)
            again = PodStore()
            again.calls = 1  # available from the start
            second = _driver(kafka_settings, topics, EchoPods(), again, group_id, producer)
            await _produce(kafka_settings, topics["in"], more)
            await _run_until(second, lambda: len(again.published_names) == len(more),
                             lambda: f"published {again.published_names}")
            assert sorted(again.applied) == sorted(p.name for p in more)
        finally:
            await producer.stop()

    asyncio.run(scenario())
