"""A rebalance hands over exactly what was taken in: a tick Faust consumed but no agent processed before a revocation
is processed after it, on a partition the worker keeps.

The interleaving, forced here step by step (on the broker it is a matter of timing, seen once in four CI runs of
``test_two_attributor_workers_rebalancing_mid_run_emit_what_one_worker_emits``: a window of 9 of its 10 ticks):
Faust fetched a tick and queued it for the samples agent; a second worker joins and the revocation suspends the
flow before the agent processed the tick; Faust skips the queued tick and acknowledges it, and its revocation
commit moves the group's offset past it. The worker keeps the partition; after the rebalance hook Faust seeks it to
the group's committed offset. The stream here is the real ``AttributorStream`` with plain dicts as tables, fake
output topics, and a fake group that does what Faust does with committed offsets.
"""

from __future__ import annotations

import asyncio

from faust.types import TP

from gpumeter.clock import ManualClock
from gpumeter.stream.deadletter import RawMessage
from gpumeter.metrics import ServiceMetrics
from gpumeter.settings import KafkaSettings
from schemas.catalog import pod_event_key
from schemas.records import NodeSample, NodeWindowShares, PodEvent
from schemas.typed import codec_for
from services.attributor.app import AttributorStream
from services.attributor.engine import AttributionEngine
from services.attributor.settings import AttributorSettings
from tests.unit.attributor.test_emit_in_flight import FakeTopic
from tests.unit.attributor.test_engine import BASE, NOW, WINDOW_MS, WINDOW_S, pods_of, two_pod_tick

PARTITION = 0  # one partition: every node's records are on it
NODES = ("n1", "n2")
TICKS = 3 * WINDOW_S + 3  # three windows of each node close, the fourth stays open


class Worker:
    """One worker's ``AttributorStream`` over a recorded input log, in a group whose committed offsets are kept
    here. ``_seek_positions`` and ``_commit_positions`` (Faust's consumer thread) and ``_read_range`` (Kafka) are
    replaced by the log and the group; everything else is the app's own code."""

    def __init__(self, tmp_path, *, commits_fail: bool = False) -> None:
        settings = AttributorSettings(kafka=KafkaSettings(topic_prefix="t."), partitions=1, data_dir=tmp_path,
                                      metrics_port=0, window_seconds=WINDOW_S, grace_seconds=2,
                                      pod_linger_seconds=600)
        self.catalog = settings.kafka.catalog
        self.stream = stream = AttributorStream(settings, ManualClock(NOW), ServiceMetrics("attributor"))
        stream.open_samples, stream.pods = {}, {}
        self.shares = stream.shares_topic = FakeTopic()
        self.dead = stream.dead_letters_topic = FakeTopic()
        self.log: dict[str, list[RawMessage]] = {self.catalog.node_samples: [], self.catalog.pod_events: []}
        self.committed: dict[TP, int] = {}  # the group's committed offsets
        self.reads: list[tuple[str, int, int]] = []
        self.commits_fail = commits_fail

        async def seek_positions(offsets):
            pass  # Faust seeks to the committed offsets right after the hook anyway

        async def commit_positions(offsets):
            if not self.commits_fail:  # the app logs a failed commit and goes on
                self.committed.update(offsets)

        async def read_range(topic, partition, start, stop):
            self.reads.append((topic, start, stop))
            for raw in self.log[topic][start:stop]:
                yield raw

        async def committed_positions(tps):
            return {tp: self.committed.get(tp) for tp in tps}

        stream._seek_positions, stream._commit_positions, stream._read_range = (
            seek_positions, commit_positions, read_range)
        stream._committed_positions = committed_positions

    def append(self, topic: str, key: bytes, value: bytes) -> RawMessage:
        raw = RawMessage(topic, PARTITION, len(self.log[topic]), key, value, NOW)
        self.log[topic].append(raw)
        return raw

    async def process(self, raw: RawMessage) -> None:
        if raw.topic == self.catalog.node_samples:
            await self.stream.process_sample(raw)
        else:
            await self.stream.process_pod_event(raw)

    async def rebalance_keeping_the_partition(self) -> None:
        """The revocation and assignment hooks as Faust calls them when this worker keeps its partition; then Faust
        seeks the partition to the group's committed offset."""
        tps = {TP(topic, PARTITION) for topic in self.log}
        await self.stream._on_partitions_revoked(None, tps)
        await self.stream._on_partitions_assigned(None, tps)
        await self.stream._on_rebalance_complete(None)

    def windows(self) -> list[NodeWindowShares]:
        return [codec_for(NodeWindowShares).decode(value) for _, value, _ in self.shares.sent]


def uninterrupted_windows(pods: list[PodEvent], samples: list[NodeSample], config) -> list[NodeWindowShares]:
    engine = AttributionEngine(config)
    for event in pods:
        engine.on_pod_event(event)
    return [NodeWindowShares.from_rows(w.shares)
            for position, sample in enumerate(samples) for w in engine.on_sample(sample, NOW, position).windows]


async def _run_with_a_tick_consumed_but_not_processed(worker: Worker) -> tuple[list[NodeWindowShares], int]:
    """Pods and ticks of two nodes; the worker processes them in order up to a tick in the middle of each node's
    second window, which Faust took in but no agent processed when the revocation came, and which Faust's
    revocation commit went past. After the rebalance the worker reads on from the group's committed offset.
    Returns the uninterrupted run's windows and the offset of the tick."""
    pods = [event for node in NODES for event in pods_of(node)]
    samples = [two_pod_tick(BASE + k * 1000, node, k) for k in range(TICKS) for node in NODES]
    pod_records = [worker.append(worker.catalog.pod_events, pod_event_key(e.node_name, e.uid),
                                 codec_for(PodEvent).encode(e)) for e in pods]
    tick_records = [worker.append(worker.catalog.node_samples, s.node_name.encode(), codec_for(NodeSample).encode(s))
                    for s in samples]
    consumed = next(r.offset for r, s in zip(tick_records, samples)
                    if s.sampled_at_unix_ms == BASE + WINDOW_MS + 4000 and s.node_name == NODES[0])

    for raw in pod_records + tick_records[:consumed]:
        await worker.process(raw)
    # The revocation: Faust skips the tick still queued for the agent, acknowledges it, and commits past it.
    worker.committed[TP(worker.catalog.pod_events, PARTITION)] = len(pod_records)
    worker.committed[TP(worker.catalog.node_samples, PARTITION)] = consumed + 1
    await worker.rebalance_keeping_the_partition()

    resume_at = worker.committed[TP(worker.catalog.node_samples, PARTITION)]
    for raw in tick_records[resume_at:]:
        await worker.process(raw)
    worker.shares.acknowledge()
    await asyncio.sleep(0)
    return uninterrupted_windows(pods, samples, worker.stream.settings.engine_config()), consumed


async def test_a_tick_faust_committed_past_before_any_agent_processed_it_is_processed_on_a_kept_partition(tmp_path):
    worker = Worker(tmp_path)
    expected, consumed = await _run_with_a_tick_consumed_but_not_processed(worker)
    # Every window whole: the second window of n1 has its 10 ticks, not the 9 Faust's offset left.
    assert [(w.node_name, w.window_start_unix_ms, w.rows()) for w in worker.windows()] == [
        (w.node_name, w.window_start_unix_ms, w.rows()) for w in expected]
    assert len(expected) == 3 * len(NODES)
    # The group's offset is where the worker's engine stands, so Faust sought there: nothing read twice, nothing
    # read from Kafka on the side, no redelivered tick taken for a late one.
    assert worker.committed[TP(worker.catalog.node_samples, PARTITION)] == consumed
    assert worker.reads == []
    assert worker.dead.sent == []


async def test_when_that_commit_fails_the_skipped_tick_is_read_from_kafka_first(tmp_path):
    worker = Worker(tmp_path, commits_fail=True)  # another rebalance under way: Faust's offset stands
    expected, consumed = await _run_with_a_tick_consumed_but_not_processed(worker)
    assert [(w.node_name, w.window_start_unix_ms, w.rows()) for w in worker.windows()] == [
        (w.node_name, w.window_start_unix_ms, w.rows()) for w in expected]
    assert worker.reads == [(worker.catalog.node_samples, consumed, consumed + 1)]
    assert worker.dead.sent == []


async def test_the_processor_hears_through_the_contract_of_the_partitions_lost_and_only_those(tmp_path):
    """Faust's revocation hook names every partition held; the processor's ``on_revoked`` (the contract's) is told
    of the partitions not assigned again, and keeps the engine of the one kept."""
    settings = AttributorSettings(kafka=KafkaSettings(topic_prefix="t."), partitions=2, data_dir=tmp_path,
                                  metrics_port=0, window_seconds=WINDOW_S, grace_seconds=2)
    stream = AttributorStream(settings, ManualClock(NOW), ServiceMetrics("attributor"))
    stream.open_samples, stream.pods = {}, {}

    async def nothing(offsets):
        pass

    async def read_nothing(topic, partition, start, stop):
        return
        yield

    stream._seek_positions = stream._commit_positions = nothing
    stream._read_range = read_nothing
    catalog = settings.kafka.catalog
    held = {TP(topic, p) for topic in (catalog.node_samples, catalog.pod_events) for p in (0, 1)}
    await stream._on_partitions_assigned(None, held)
    await stream._on_rebalance_complete(None)
    assert stream.processor.partitions() == (0, 1)
    revoked: list[frozenset] = []
    on_revoked = stream.processor.on_revoked
    stream.processor.on_revoked = lambda partitions: (revoked.append(frozenset(partitions)), on_revoked(partitions))[1]

    await stream._on_partitions_revoked(None, held)
    await stream._on_partitions_assigned(None, {tp for tp in held if tp.partition == 0})
    await stream._on_rebalance_complete(None)
    assert revoked == [frozenset({(catalog.node_samples, 1), (catalog.pod_events, 1)})]
    assert stream.processor.partitions() == (0,)


async def worker_a_stopped_halfway(tmp_path, *, bad_pod_record: bool = False
                                   ) -> tuple[Worker, list[PodEvent], list[NodeSample]]:
    """Worker A over the pods and ticks of ``NODES`` (and, with ``bad_pod_record``, a pod-events record that is no
    PodEvent): it handles every pod record and the first half of the ticks, its windows acknowledged, and stops;
    the group's committed offsets are what Faust committed for it, every record A's agents handled. Returns A,
    the pods and the ticks."""
    a = Worker(tmp_path)
    pods = [event for node in NODES for event in pods_of(node)]
    samples = [two_pod_tick(BASE + k * 1000, node, k) for k in range(TICKS) for node in NODES]
    pod_records = [a.append(a.catalog.pod_events, pod_event_key(e.node_name, e.uid), codec_for(PodEvent).encode(e))
                   for e in pods]
    if bad_pod_record:
        pod_records.append(a.append(a.catalog.pod_events, pod_event_key(NODES[0], "not-a-pod"), b"no avro here"))
    tick_records = [a.append(a.catalog.node_samples, s.node_name.encode(), codec_for(NodeSample).encode(s))
                    for s in samples]
    handled = len(tick_records) // 2
    for raw in pod_records + tick_records[:handled]:
        await a.process(raw)
    a.shares.acknowledge()
    await asyncio.sleep(0)
    a.committed[TP(a.catalog.pod_events, PARTITION)] = len(pod_records)
    a.committed[TP(a.catalog.node_samples, PARTITION)] = handled
    return a, pods, samples


async def test_a_rebuilt_partition_reads_its_pod_events_on_from_the_groups_commit_not_again_from_the_start(tmp_path):
    """Worker A handles a partition's pods (one of them a record that is no PodEvent: dead-lettered) and part of
    its ticks, and stops; worker B is assigned the partition and rebuilds it from A's tables. B's preload applies
    every pod event; its pods stream then goes on from the group's commit, so the bad record is not dead-lettered
    a second time and no pod is applied a third time, and A's and B's windows are the uninterrupted run's."""
    a, pods, samples = await worker_a_stopped_halfway(tmp_path / "a", bad_pod_record=True)
    assert len(a.dead.sent) == 1  # the bad pod record, once

    b = Worker(tmp_path / "b")
    b.log, b.committed = a.log, a.committed  # one broker, one group
    b.stream.open_samples, b.stream.pods = dict(a.stream.open_samples), dict(a.stream.pods)  # the changelogs
    tps = {TP(topic, PARTITION) for topic in b.log}
    await b.stream._on_partitions_assigned(None, tps)
    await b.stream._on_rebalance_complete(None)
    # Faust seeks each partition to the group's commit, which the rebalance hook left where B must go on.
    assert b.committed[TP(b.catalog.pod_events, PARTITION)] == len(a.log[a.catalog.pod_events])
    for topic in (b.catalog.pod_events, b.catalog.node_samples):
        for raw in b.log[topic][b.committed[TP(topic, PARTITION)]:]:
            await b.process(raw)
    b.shares.acknowledge()
    await asyncio.sleep(0)

    assert b.dead.sent == []
    assert b.reads == [(b.catalog.pod_events, 0, None)]  # the preload: the pod events once, from the start
    expected = uninterrupted_windows(pods, samples, b.stream.settings.engine_config())
    emitted = {(w.node_name, w.window_start_unix_ms): w.rows() for w in a.windows() + b.windows()}
    assert emitted == {(w.node_name, w.window_start_unix_ms): w.rows() for w in expected}
    assert len(expected) == 3 * len(NODES)
