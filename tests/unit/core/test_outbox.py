"""The shared outbox of the billing and guard services, against a fake producer whose futures the tests settle:
records are kept until acknowledged, failures (a failed or cancelled future, or ``DeliveryError`` at enqueue) are
re-sent after pauses that back off, ``latest_wins`` records are re-sent only while they are the newest of their
(topic, key), ``flush(retry=False)`` gives up without losing anything, and a stop ends the pauses."""

from __future__ import annotations

import asyncio

import pytest

from gpumeter.kafka.outbox import Outbox, Outgoing, newest_per_key, next_backoff_seconds, pause_unless_stopping
from gpumeter.kafka.producer import DeliveryError, PartlyEnqueued

ACK = "ack"
FAIL = "fail"  # the future fails (the broker did not acknowledge)
REFUSE = "refuse"  # send raises DeliveryError (the producer could not enqueue)
CANCEL = "cancel"
PENDING = "pending"  # the future stays pending until the test settles it


class FakeProducer:
    """Answers each send with the next scripted outcome (ACK once the script is used up)."""

    def __init__(self, *outcomes: str) -> None:
        self.outcomes = list(outcomes)
        self.sent: list[tuple[str, bytes | None, object]] = []
        self.acknowledged: list[tuple[str, bytes | None, object]] = []
        self.pending: list[asyncio.Future] = []

    async def send(self, topic, record, *, key=None):
        outcome = self.outcomes.pop(0) if self.outcomes else ACK
        self.sent.append((topic, key, record))
        if outcome == REFUSE:
            raise DeliveryError("cannot enqueue: buffer full")
        future = asyncio.get_running_loop().create_future()
        if outcome == ACK:
            future.set_result(None)
            self.acknowledged.append((topic, key, record))
        elif outcome == FAIL:
            future.set_exception(DeliveryError("NOT_ENOUGH_REPLICAS"))
        elif outcome == CANCEL:
            future.cancel()
        else:
            self.pending.append(future)
        return future


class BatchingProducer(FakeProducer):
    """A ``FakeProducer`` with ``send_batch``: each call is one batch whose future (shared by its records) settles
    by the next scripted outcome; ``PARTLY`` enqueues the first record alone and then refuses the rest."""

    def __init__(self, *outcomes: str) -> None:
        super().__init__(*outcomes)
        self.batches: list[tuple[str, bytes, list, int | None]] = []

    async def send_batch(self, topic, records, *, key, partition=None):
        outcome = self.outcomes.pop(0) if self.outcomes else ACK
        self.batches.append((topic, key, list(records), partition))
        if outcome == REFUSE:
            raise DeliveryError("cannot enqueue: buffer full")
        future = asyncio.get_running_loop().create_future()
        if outcome == PARTLY:
            future.set_result(None)
            self.acknowledged.append((topic, key, records[0]))
            raise PartlyEnqueued("cannot enqueue: buffer full", [future])
        if outcome == ACK:
            future.set_result(None)
            self.acknowledged += [(topic, key, record) for record in records]
        elif outcome == FAIL:
            future.set_exception(DeliveryError("NOT_ENOUGH_REPLICAS"))
        else:
            self.pending.append(future)
        return [future] * len(records)


PARTLY = "partly"


class Pauses:
    """Records the pauses instead of sleeping; ``stop_at`` raises ``Stopped`` on that pause (1-based)."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.seconds: list[float] = []
        self.stop_at = stop_at

    async def __call__(self, seconds: float) -> None:
        self.seconds.append(seconds)
        if self.stop_at is not None and len(self.seconds) >= self.stop_at:
            raise Stopped()


class Stopped(Exception):
    pass


def outbox_with(producer: FakeProducer, pauses: Pauses | None = None, retries: list | None = None) -> Outbox:
    return Outbox(producer, pause=pauses or Pauses(), retry_initial_seconds=0.5, retry_max_seconds=2.0,
                  on_retry=(lambda: retries.append(1)) if retries is not None else None)


async def test_acknowledged_records_are_forgotten_without_a_pause():
    producer = FakeProducer()
    pauses = Pauses()
    outbox = outbox_with(producer, pauses)
    await outbox.send("t", b"k1", "r1")
    await outbox.send("u", None, "r2")
    assert len(outbox) == 2  # kept until a flush saw them acknowledged
    assert await outbox.flush() is True
    assert len(outbox) == 0
    assert producer.sent == [("t", b"k1", "r1"), ("u", None, "r2")]
    assert pauses.seconds == []
    assert await outbox.flush() is True  # nothing left: nothing to do


async def test_failed_records_are_sent_again_with_backoff_until_acknowledged():
    # r1 fails three times in a row, r2 is acknowledged at once: only r1 is sent again.
    producer = FakeProducer(FAIL, ACK, FAIL, CANCEL)
    pauses = Pauses()
    retries: list = []
    outbox = outbox_with(producer, pauses, retries)
    await outbox.send("t", b"a", "r1")
    await outbox.send("t", b"b", "r2")
    assert await outbox.flush() is True
    assert [r for _, _, r in producer.sent] == ["r1", "r2", "r1", "r1", "r1"]
    assert [r for _, _, r in producer.acknowledged] == ["r2", "r1"]
    assert pauses.seconds == [0.5, 1.0, 2.0]  # doubled, capped at retry_max_seconds
    assert len(retries) == 3
    assert len(outbox) == 0


async def test_a_record_the_producer_refuses_to_enqueue_is_kept_and_sent_at_the_flush():
    producer = FakeProducer(REFUSE)
    pauses = Pauses()
    outbox = outbox_with(producer, pauses)
    outgoing = await outbox.send("t", b"k", "r")  # does not raise
    assert outgoing.future is None and isinstance(outgoing.error, DeliveryError) and outgoing.failed()
    assert await outbox.flush() is True
    assert producer.acknowledged == [("t", b"k", "r")]
    assert pauses.seconds == [0.5]


async def test_flush_waits_for_pending_futures_and_does_not_resend_them():
    producer = FakeProducer(PENDING, PENDING)
    outbox = outbox_with(producer)
    await outbox.send("t", b"a", "r1")
    await outbox.send("t", b"b", "r2")
    flush = asyncio.ensure_future(outbox.flush())
    await asyncio.sleep(0)
    assert not flush.done()
    producer.pending[0].set_result(None)
    await asyncio.sleep(0)
    assert not flush.done()  # r2 is not acknowledged yet
    producer.pending[1].set_result(None)
    assert await flush is True
    assert len(producer.sent) == 2


async def test_without_retry_a_failure_returns_false_and_keeps_every_record():
    producer = FakeProducer(ACK, FAIL)
    pauses = Pauses()
    outbox = outbox_with(producer, pauses)
    await outbox.send("t", b"a", "r1")
    await outbox.send("t", b"b", "r2")
    assert await outbox.flush(retry=False) is False
    assert len(outbox) == 2 and pauses.seconds == [] and len(producer.sent) == 2
    # A later flush with retries sends the failed one again (and only it).
    assert await outbox.flush() is True
    assert [r for _, _, r in producer.sent] == ["r1", "r2", "r2"]
    assert len(outbox) == 0


async def test_only_the_newest_record_of_a_key_is_sent_again_when_it_carries_the_latest_state():
    # a1, b1, a2, a3 (latest_wins) and two plain records with key a; every first attempt fails but a3's.
    producer = FakeProducer(FAIL, FAIL, FAIL, ACK, FAIL, FAIL, FAIL)
    outbox = outbox_with(producer)
    await outbox.send("v", b"a", "a1", latest_wins=True)
    await outbox.send("v", b"b", "b1", latest_wins=True)
    await outbox.send("v", b"a", "a2", latest_wins=True)
    await outbox.send("v", b"a", "a3", latest_wins=True)  # delivered: a's newest state
    await outbox.send("dl", b"a", "letter1")  # plain records: every one counts
    await outbox.send("dl", b"a", "letter2")
    await outbox.send("w", b"a", "w1", latest_wins=True)  # the same key on another topic is another state
    assert await outbox.flush() is True
    resent = [r for _, _, r in producer.sent[7:]]
    assert resent == ["b1", "letter1", "letter2", "w1"]


async def test_a_newer_failed_record_of_a_key_is_sent_again_and_the_older_one_never():
    producer = FakeProducer(FAIL, FAIL, FAIL)
    outbox = outbox_with(producer)
    await outbox.send("v", b"a", "old", latest_wins=True)
    await outbox.send("v", b"a", "new", latest_wins=True)
    assert await outbox.flush() is True
    assert [r for _, _, r in producer.sent] == ["old", "new", "new", "new"]
    assert [r for _, _, r in producer.acknowledged] == ["new"]


async def test_a_pause_that_raises_ends_the_flush_and_keeps_the_records():
    producer = FakeProducer(FAIL, FAIL, FAIL)
    pauses = Pauses(stop_at=2)
    outbox = outbox_with(producer, pauses)
    await outbox.send("t", b"k", "r")
    with pytest.raises(Stopped):
        await outbox.flush()
    assert pauses.seconds == [0.5, 1.0]
    assert len(outbox) == 1 and producer.acknowledged == []


async def test_errors_other_than_delivery_errors_are_bugs_and_propagate():
    class Broken:
        async def send(self, topic, record, *, key=None):
            raise TypeError("cannot encode record")

    outbox = outbox_with(Broken())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await outbox.send("t", b"k", "r")


def test_retry_pauses_must_be_positive_and_ordered():
    for initial, maximum in ((0, 1.0), (-1.0, 1.0), (2.0, 1.0)):
        with pytest.raises(ValueError):
            Outbox(FakeProducer(), pause=Pauses(), retry_initial_seconds=initial, retry_max_seconds=maximum)
    assert [next_backoff_seconds(d, 4.0) for d in (0.5, 1.0, 2.0, 4.0)] == [1.0, 2.0, 4.0, 4.0]


def test_newest_per_key_keeps_the_failed_records_no_newer_record_of_their_key_follows():
    older, newer, other = Outgoing(b"a", None, "v"), Outgoing(b"a", None, "v"), Outgoing(b"b", None, "v")
    elsewhere = Outgoing(b"a", None, "w")
    outbox = [older, other, elsewhere, newer]
    assert newest_per_key(outbox, [older, other]) == [other]
    assert newest_per_key(outbox, [older, newer, elsewhere]) == [newer, elsewhere]
    assert newest_per_key(outbox, []) == []


# -- pause_unless_stopping ---------------------------------------------------------------------------------------


async def test_a_pause_sleeps_when_not_stopping():
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    await pause_unless_stopping(1.5, sleep=sleep, stopping=asyncio.Event(), stopped=Stopped)
    assert slept == [1.5]


async def test_a_pause_raises_at_once_when_already_stopping():
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    stopping = asyncio.Event()
    stopping.set()
    with pytest.raises(Stopped):
        await pause_unless_stopping(1.0, sleep=sleep, stopping=stopping, stopped=Stopped)
    assert slept == []


async def test_a_stop_during_the_pause_cuts_it_short_and_cancels_the_sleep():
    forever = asyncio.Event()
    sleeping = asyncio.Event()
    cancelled: list[bool] = []

    async def sleep(_seconds: float) -> None:
        sleeping.set()
        try:
            await forever.wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    stopping = asyncio.Event()
    pause = asyncio.ensure_future(pause_unless_stopping(3600, sleep=sleep, stopping=stopping, stopped=Stopped))
    await sleeping.wait()
    stopping.set()
    with pytest.raises(Stopped):
        await pause
    await asyncio.sleep(0)
    assert cancelled == [True]


async def test_send_many_hands_the_records_over_as_one_batch_and_keeps_each_one():
    producer = BatchingProducer(ACK, PENDING)  # r0's send, then the batch
    outbox = outbox_with(producer)
    first = await outbox.send("t", b"k0", "r0")
    kept = await outbox.send_many("t", b"k", ["r1", "r2", "r3"], partition=4)
    assert producer.batches == [("t", b"k", ["r1", "r2", "r3"], 4)]
    assert len(outbox) == 4
    assert [o.record for o in kept] == ["r1", "r2", "r3"] and {o.key for o in kept} == {b"k"}
    assert [o.sequence for o in kept] == [first.sequence + 1, first.sequence + 2, first.sequence + 3]
    assert len({id(o.future) for o in kept}) == 1  # the batch's future
    assert outbox.oldest_pending == kept[0].sequence  # r0 was acknowledged, the batch is not yet
    producer.pending[0].set_result(None)
    assert await outbox.flush() is True
    assert len(outbox) == 0


async def test_a_failed_batch_is_sent_again_whole_and_nothing_else():
    # The batch fails: at the flush every one of its records is sent again, in order; the record acknowledged
    # before it is not.
    producer = BatchingProducer(ACK, FAIL)  # r0's send, then the batch
    pauses = Pauses()
    outbox = outbox_with(producer, pauses)
    await outbox.send("t", b"a", "r0")
    kept = await outbox.send_many("t", b"k", ["r1", "r2", "r3"])
    assert all(o.failed() for o in kept)
    assert await outbox.flush() is True
    assert [r for _, _, r in producer.sent] == ["r0", "r1", "r2", "r3"]  # the re-sends go one by one
    assert [r for _, _, r in producer.acknowledged] == ["r0", "r1", "r2", "r3"]
    assert pauses.seconds == [0.5]


async def test_a_batch_the_producer_refuses_is_kept_whole_and_sent_at_the_flush():
    producer = BatchingProducer(REFUSE)
    outbox = outbox_with(producer)
    kept = await outbox.send_many("t", b"k", ["r1", "r2"])  # does not raise
    assert all(o.future is None and isinstance(o.error, DeliveryError) and o.failed() for o in kept)
    assert await outbox.flush() is True
    assert [r for _, _, r in producer.acknowledged] == ["r1", "r2"]


async def test_a_batch_enqueued_in_part_keeps_what_went_and_sends_the_rest_again():
    producer = BatchingProducer(PARTLY)
    outbox = outbox_with(producer)
    kept = await outbox.send_many("t", b"k", ["r1", "r2", "r3"])
    assert not kept[0].failed() and kept[0].error is None
    assert all(o.failed() and isinstance(o.error, PartlyEnqueued) for o in kept[1:])
    assert await outbox.flush() is True
    assert [r for _, _, r in producer.sent] == ["r2", "r3"]  # r1 was on its way: never sent twice
    assert [r for _, _, r in producer.acknowledged] == ["r1", "r2", "r3"]


async def test_send_many_sends_one_by_one_through_a_producer_without_batches():
    producer = FakeProducer(ACK, FAIL)
    outbox = outbox_with(producer)
    kept = await outbox.send_many("t", b"k", ["r1", "r2"])
    assert [o.record for o in kept] == ["r1", "r2"] and not kept[0].failed() and kept[1].failed()
    assert await outbox.flush() is True
    assert [r for _, _, r in producer.sent] == ["r1", "r2", "r2"]
