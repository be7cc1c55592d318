"""Windows go out (one NodeWindowShares each) without the agent waiting for Kafka; they are recorded as emitted
only once acknowledged, and the table writes that follow are made by the partition's next event."""

from __future__ import annotations

import asyncio

import pytest

from gpumeter.clock import ManualClock
from gpumeter.stream.deadletter import RawMessage
from gpumeter.metrics import ServiceMetrics
from gpumeter.settings import KafkaSettings
from schemas.catalog import pod_event_key
from schemas.records import NodeSample, NodeWindowShares, PodEvent
from schemas.typed import codec_for
from services.attributor.app import AttributorStream, WindowDeliveryFailed
from services.attributor.engine import AttributionEngine, NodeProgress, progress_table_key
from services.attributor.settings import AttributorSettings
from tests.unit.attributor import CLUSTER
from tests.unit.attributor.test_engine import BASE, NOW, WINDOW_MS, WINDOW_S, pods_of, two_pod_tick

PREFIX = "t."
PARTITION = 0  # one partition: every node's records are on it


class FakeTopic:
    """Records what is sent; each send returns a future the test settles, as Kafka's acknowledgement would."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, bytes, asyncio.Future]] = []

    async def send(self, *, key: bytes, value: bytes) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.sent.append((key, value, future))
        return future

    def acknowledge(self, upto: int | None = None) -> None:
        for _, _, future in self.sent[:upto]:
            if not future.done():
                future.set_result(None)


class Harness:
    """The stream with plain dicts as its tables and fake topics (Faust's need a running worker)."""

    def __init__(self, tmp_path, open_samples=None) -> None:
        settings = AttributorSettings(kafka=KafkaSettings(topic_prefix=PREFIX), partitions=1, data_dir=tmp_path,
                                      metrics_port=0, window_seconds=WINDOW_S, grace_seconds=2,
                                      pod_linger_seconds=600)
        self.stream = AttributorStream(settings, ManualClock(NOW), ServiceMetrics("attributor"))
        self.stream.open_samples = dict(open_samples or {})
        self.stream.pods = {}
        self.shares = self.stream.shares_topic = FakeTopic()
        self.dead = self.stream.dead_letters_topic = FakeTopic()
        self.offsets = {"samples": 0, "pods": 0}
        self.catalog = settings.kafka.catalog

    async def pod(self, event: PodEvent) -> None:
        offset = self.offsets["pods"]
        self.offsets["pods"] += 1
        await self.stream.process_pod_event(RawMessage(self.catalog.pod_events, PARTITION, offset,
                                                       pod_event_key(event.node_name, event.uid),
                                                       codec_for(PodEvent).encode(event), NOW))

    async def sample(self, sample: NodeSample) -> None:
        offset = self.offsets["samples"]
        self.offsets["samples"] += 1
        await self.stream.process_sample(RawMessage(self.catalog.node_samples, PARTITION, offset,
                                                    sample.node_name.encode(), codec_for(NodeSample).encode(sample),
                                                    NOW))

    def progress(self, node: str) -> NodeProgress:
        return NodeProgress.decode(self.stream.open_samples[progress_table_key(CLUSTER, node)])

    def sent(self) -> list[tuple[bytes, NodeWindowShares]]:
        return [(key, codec_for(NodeWindowShares).decode(value)) for key, value, _ in self.shares.sent]


async def _two_windows_each(h: Harness, nodes=("n1", "n2")):
    """Pods, then ticks of each node up to just past its second window's end plus the grace period: two windows of
    each close, one per tick that closes it. Returns the pods and samples."""
    pods = [event for node in nodes for event in pods_of(node)]
    for event in pods:
        await h.pod(event)
    samples = []
    for k in range(2 * WINDOW_S + 3):
        for node in nodes:
            samples.append(two_pod_tick(BASE + k * 1000, node, k))
            await h.sample(samples[-1])
    return pods, samples


async def test_windows_are_sent_at_once_and_recorded_only_once_acknowledged(tmp_path):
    h = Harness(tmp_path)
    pods, samples = await _two_windows_each(h)
    # Every window is on its way as one record, in the order closed, keyed by its node, before anything is
    # acknowledged; each record holds exactly the rows the engine attributes to the window.
    engine = AttributionEngine(h.stream.settings.engine_config())
    for event in pods:
        engine.on_pod_event(event)
    windows = [w for position, sample in enumerate(samples) for w in engine.on_sample(sample, NOW, position).windows]
    assert [(w.node_name, w.window_start_unix_ms) for w in windows] == [
        ("n1", BASE), ("n2", BASE), ("n1", BASE + WINDOW_MS), ("n2", BASE + WINDOW_MS)]
    assert [(key, record.rows()) for key, record in h.sent()] == [(w.node_name.encode(), w.shares) for w in windows]
    # Nothing acknowledged: each node's progress is still the one its first tick wrote.
    for node in ("n1", "n2"):
        assert h.progress(node).closed_before_unix_ms == BASE - WINDOW_MS

    # Three acknowledged: the next event of the partition records them; n2's second window stays in flight.
    h.shares.acknowledge(3)
    await h.pod(pods[0])  # seen before: changes nothing itself
    assert (h.progress("n1").closed_before_unix_ms, h.progress("n2").closed_before_unix_ms) == (
        BASE + 2 * WINDOW_MS, BASE + WINDOW_MS)
    assert h.stream.processor.in_flight(PARTITION) == ((CLUSTER, "n2", BASE + WINDOW_MS),)

    h.shares.acknowledge()
    await h.pod(pods[0])
    assert h.progress("n2").closed_before_unix_ms == BASE + 2 * WINDOW_MS
    assert h.stream.processor.in_flight(PARTITION) == ()
    await asyncio.sleep(0)  # done callbacks run on the loop's next turn
    closed = h.stream.metrics.get("gpumeter_attributor_windows_closed_total")
    assert closed._value.get() == 4
    assert h.dead.sent == []


async def test_a_window_kafka_refused_stops_the_worker_and_leaves_it_to_be_emitted_again(tmp_path):
    h = Harness(tmp_path)
    pods, _ = await _two_windows_each(h, nodes=("n1",))
    h.shares.acknowledge(1)
    key, value, _ = h.shares.sent[1]
    failed = asyncio.get_running_loop().create_future()
    failed.set_exception(OSError("broker gone"))
    h.shares.sent[1] = (key, value, failed)
    h.stream._in_flight[PARTITION][1] = (h.stream._in_flight[PARTITION][1][0], [failed])
    before = dict(h.stream.open_samples)
    with pytest.raises(WindowDeliveryFailed, match="broker gone"):
        await h.pod(pods[0])
    # Nothing marked done, not even the window that was delivered: the event that would have written it failed.
    assert h.stream.open_samples == before
    assert h.progress("n1").closed_before_unix_ms == BASE - WINDOW_MS


async def test_table_writes_of_a_rebuild_are_made_by_the_partitions_next_event(tmp_path):
    h = Harness(tmp_path, open_samples={"n1|progress|broken": b"{"})
    await h.pod(pods_of("n1")[0])
    # The rebuild (before the event) found the entry unreadable; the event deleted it, and stored the pod.
    assert list(h.stream.open_samples) == []
    assert list(h.stream.pods) == [pod_event_key("n1", pods_of("n1")[0].uid).decode()]


async def test_a_backlog_read_to_its_end_closes_its_due_windows_at_once(tmp_path):
    """A partition assigned and behind (a restart's backlog): while it is read its windows wait (its own ticks'
    time closes them, not the clock); the batch that reads it to its end runs its clock at once, so windows the
    clock has closed go out then, not at the next timer tick. A partition caught up all along does not run the
    clock per batch."""
    from faust.types import TP

    h = Harness(tmp_path)
    stream = h.stream
    caught_up = {PARTITION: False}
    stream._caught_up = lambda partition: caught_up[partition]
    await stream._on_partitions_assigned(None, [TP(h.catalog.node_samples, PARTITION)])
    stream._ready = True  # the rebalance hook ran (nothing to rebuild in this harness)
    assert stream._behind == {PARTITION}
    for event in pods_of("n1"):
        await h.pod(event)
    for k in range(WINDOW_S - 1):  # all but the last tick of the window, read while behind
        await h.sample(two_pod_tick(BASE + k * 1000, "n1", k))
    assert h.sent() == []  # NOW is an hour past the window: only the clock closes it, and not while behind
    caught_up[PARTITION] = True
    await h.sample(two_pod_tick(BASE + (WINDOW_S - 1) * 1000, "n1", WINDOW_S - 1))  # the backlog's last
    assert [(record.node_name, record.window_start_unix_ms) for _, record in h.sent()] == [("n1", BASE)]
    assert stream._behind == set()

    # Caught up all along: a batch leaves the due windows to the timer. Ticks of a later window at the clock's
    # time, then the clock past that window's end + grace + idle allowance: another node's tick (a batch) leaves
    # n1's window open; the timer closes it.
    start = NOW - NOW % WINDOW_MS
    for k in range(WINDOW_S):
        stream.clock.set_ms(start + k * 1000)
        await h.sample(two_pod_tick(start + k * 1000, "n1", k))
    assert len(h.sent()) == 1
    stream.clock.set_ms(start + WINDOW_MS + stream.settings.grace_seconds * 1000
                        + stream.settings.idle_close_seconds * 1000 + 1000)
    for event in pods_of("n2"):
        await h.pod(event)
    await h.sample(two_pod_tick(stream.clock.now_ms() - 500, "n2", 0))
    assert len(h.sent()) == 1
    await stream._clock_timer()
    assert ("n1", start) in [(record.node_name, record.window_start_unix_ms) for _, record in h.sent()][1:]
