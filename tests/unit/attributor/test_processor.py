"""The attributor's processor on the one contract, driven through ``MessageRunner`` and ``MemoryDriver``: the same
windows the engine attributes, bad input dead-lettered by the runner, and the table writes a driver must make."""

from __future__ import annotations

import dataclasses

import pytest

from gpumeter.clock import ManualClock
from gpumeter.stream.contract import DEAD_LETTERS, Result, Settled
from gpumeter.stream.memory import MemoryBroker, MemoryDriver
from gpumeter.stream.runner import MessageRunner
from schemas.catalog import TopicCatalog, partition_for_node, pod_event_key
from schemas.records import DeadLetter, NodeSample, NodeWindowShares, PodEvent
from schemas.typed import codec_for
from services.attributor.engine import NodeProgress, progress_table_key, sample_table_key
from services.attributor.processor import (
    PODS_TABLE,
    POD_EVENTS,
    SAMPLES,
    SAMPLES_TABLE,
    WINDOW_SHARES,
    AttributorProcessor,
    TableWrite,
    input_topics,
    output_topics,
)
from tests.unit.attributor import CLUSTER
from tests.unit.attributor.test_engine import (
    BASE,
    CONFIG,
    GRACE_S,
    IDLE_S,
    NOW,
    WINDOW_MS,
    expected_windows,
    pods_of,
    ticks,
    two_pod_tick,
)

PARTITIONS = 3
NODE = "n1"
P = partition_for_node(NODE, PARTITIONS)
OTHER = (P + 1) % PARTITIONS
TOPICS = {SAMPLES: "t.samples", POD_EVENTS: "t.pods"}
OUTPUTS = {WINDOW_SHARES: "t.shares", DEAD_LETTERS: "t.dead"}
SAMPLE_CODEC, POD_CODEC = codec_for(NodeSample), codec_for(PodEvent)


class TableStore:
    """The driver's store as the Faust tables: applies every ``TableWrite`` in order, keeps them all."""

    def __init__(self) -> None:
        self.writes: list[TableWrite] = []
        self.tables: dict[tuple[int, str], dict[str, bytes]] = {}

    def apply(self, changes):
        for change in changes:
            self.write(change)
        return [Settled() for _ in changes]

    def write(self, change: TableWrite) -> None:
        self.writes.append(change)
        table = self.tables.setdefault((change.partition, change.table), {})
        if change.value is None:
            table.pop(change.key, None)
        else:
            table[change.key] = change.value

    def published(self, changes, now_ms):
        pass


class Setup:
    def __init__(self) -> None:
        self.broker = MemoryBroker()
        for topic in (*TOPICS.values(), *OUTPUTS.values()):
            self.broker.create(topic, PARTITIONS)
        self.processor = AttributorProcessor(CONFIG, PARTITIONS)
        self.runner = MessageRunner(self.processor, TOPICS, ManualClock(NOW))
        self.store = TableStore()
        self.driver = MemoryDriver(self.runner, self.broker, OUTPUTS, self.store)

    def pods(self, node: str = NODE, partition: int | None = None) -> list[PodEvent]:
        """The node's pods, on its partition (the collector sends them there) unless told otherwise."""
        events = pods_of(node)
        at = partition_for_node(node, PARTITIONS) if partition is None else partition
        for event in events:
            self.broker.produce("t.pods", pod_event_key(node, event.uid), POD_CODEC.encode(event),
                                timestamp_ms=event.observed_at_unix_ms, partition=at)
        return events

    def sample(self, sample: NodeSample, partition: int | None = None, timestamp_ms: int | None = None):
        return self.broker.produce("t.samples", sample.node_name.encode(), SAMPLE_CODEC.encode(sample),
                                   timestamp_ms=sample.sampled_at_unix_ms if timestamp_ms is None else timestamp_ms,
                                   partition=partition)

    def run(self) -> int:
        # As ``gpumeter replay`` would: what was produced is durable at once, so it is acknowledged before the next
        # message (the changes that follow go to the store like any other).
        count = self.driver.run(before_message=lambda message: self.store.apply(
            self.processor.acknowledge_all().changes))
        self.store.apply(self.processor.acknowledge_all().changes)
        return count

    def shares(self) -> list[tuple[int, bytes, NodeWindowShares]]:
        codec = codec_for(NodeWindowShares)
        return [(p, m.key, codec.decode(m.value)) for p in range(PARTITIONS) for m in self.broker.messages("t.shares", p)]

    def letters(self) -> list[DeadLetter]:
        return self.broker.records("t.dead", DeadLetter)


def test_the_roles_are_the_catalogs_topics():
    catalog = TopicCatalog(prefix="x.")
    assert input_topics(catalog) == {SAMPLES: catalog.node_samples, POD_EVENTS: catalog.pod_events}
    assert output_topics(catalog) == {WINDOW_SHARES: catalog.node_window_shares, DEAD_LETTERS: catalog.dead_letters}
    assert [(i.name, i.record_type, i.tombstones) for i in AttributorProcessor(CONFIG, 3).inputs] == [
        (POD_EVENTS, PodEvent, True), (SAMPLES, NodeSample, False)]  # pods first at one instant


def test_each_closed_window_is_one_node_window_shares_record_keyed_by_its_node():
    s = Setup()
    pods = s.pods()
    samples = ticks(NODE, windows=3)
    for sample in samples:
        s.sample(sample)
    assert s.run() == len(pods) + len(samples)
    expected = expected_windows(samples, pods)
    # Ticks closed the first two windows; the third is open until the clock says its node went silent.
    assert s.shares() == [(P, NODE.encode(), NodeWindowShares.from_rows(expected[(NODE, BASE + k * WINDOW_MS)]))
                          for k in range(2)]
    third_closes_at = BASE + 3 * WINDOW_MS + (GRACE_S + IDLE_S) * 1000
    assert s.driver.tick(third_closes_at - 1) == Result()
    assert s.driver.tick(third_closes_at + 5_000, caught_up=False) == Result()  # a backlog's silence says nothing
    ticked = s.driver.tick(third_closes_at)
    assert [e.record for e in ticked.emits] == [NodeWindowShares.from_rows(expected[(NODE, BASE + 2 * WINDOW_MS)])]
    assert [(p, key) for p, key, _ in s.shares()] == [(P, NODE.encode())] * 3
    assert s.processor.in_flight(P) == ((CLUSTER, NODE, BASE + 2 * WINDOW_MS),)
    assert s.letters() == []


def test_the_table_writes_are_the_pods_and_progress_records_a_rebuild_needs():
    s = Setup()
    pods = s.pods()
    samples = ticks(NODE, windows=3)
    for sample in samples:
        s.sample(sample)
    s.run()
    # Each pod as the engine keeps it, then the node's progress as written when window 1 was acknowledged (before
    # tick 23): done before window 2, every input up to offset 22 processed, window 2's first tick (offset 20)
    # where a rebuild reads again from.
    assert s.store.tables[(P, PODS_TABLE)] == {
        pod_event_key(NODE, e.uid).decode(): POD_CODEC.encode(s.processor.engine(P).pod_record(e)) for e in pods}
    progress = NodeProgress(CLUSTER, NODE, BASE + 2 * WINDOW_MS, 22, 20)
    assert s.store.tables[(P, SAMPLES_TABLE)] == {progress_table_key(CLUSTER, NODE): progress.encode()}
    # Acknowledging window 2 moves it on (its ticks' keys deleted, nothing left to re-read) -- in the order a
    # changelog must hold them: the progress record before the deletes.
    s.driver.tick(BASE + 3 * WINDOW_MS + (GRACE_S + IDLE_S) * 1000)
    acked = s.processor.acknowledge(P, [s.shares()[-1][2]])
    assert acked.changes == (
        TableWrite(P, SAMPLES_TABLE, progress_table_key(CLUSTER, NODE),
                   NodeProgress(CLUSTER, NODE, BASE + 3 * WINDOW_MS, 29, None).encode()),
        *(TableWrite(P, SAMPLES_TABLE, sample_table_key(t), None) for t in samples[20:]),
    )
    assert s.processor.in_flight(P) == ()
    assert s.processor.acknowledge(P, [s.shares()[-1][2]]) == Result()  # once only


def test_a_window_is_recorded_done_only_once_acknowledged():
    s = Setup()
    s.pods()
    for sample in ticks(NODE, windows=2):
        s.sample(sample)
    s.driver.run()  # nothing acknowledged
    windows = [(CLUSTER, NODE, BASE)]
    assert s.processor.in_flight(P) == tuple(windows)
    # The node's progress as written at its first tick (where to read again from), and not moved since: window 0
    # is in flight.
    assert s.store.tables[(P, SAMPLES_TABLE)] == {
        progress_table_key(CLUSTER, NODE): NodeProgress(CLUSTER, NODE, BASE - WINDOW_MS, 0, 0).encode()}
    (_, _, record), = s.shares()
    assert s.processor.acknowledge(OTHER, [record]) == Result()  # not a window of that partition
    changes = s.processor.acknowledge(P, [record]).changes
    assert changes[0] == TableWrite(P, SAMPLES_TABLE, progress_table_key(CLUSTER, NODE),
                                    NodeProgress(CLUSTER, NODE, BASE + WINDOW_MS, 19, 10).encode())


def test_a_tick_of_a_closed_window_is_dead_lettered_late_and_changes_no_window():
    s = Setup()
    pods = s.pods()
    samples = ticks(NODE, windows=2)
    for sample in samples:
        s.sample(sample)
    late = dataclasses.replace(two_pod_tick(BASE + 3_500, NODE, 3), sequence=999)
    position = s.sample(late, timestamp_ms=samples[-1].sampled_at_unix_ms + 1)
    s.run()
    (letter,) = s.letters()
    assert (letter.reason_code, letter.service, letter.source_topic, letter.source_partition, letter.source_offset,
            letter.raw_bytes) == ("LATE", "attributor", "t.samples", P, position.offset, SAMPLE_CODEC.encode(late))
    assert s.runner.dead_lettered == 1 and s.processor.engine(P).late_rejected == 1
    assert [record for _, _, record in s.shares()] == [
        NodeWindowShares.from_rows(expected_windows(samples, pods)[(NODE, BASE)])]  # as without the late tick


def test_records_on_the_wrong_partition_or_key_are_dead_lettered_and_change_nothing():
    s = Setup()
    s.pods(partition=OTHER)
    wrong_key = dataclasses.replace(pods_of(NODE)[0], uid="elsewhere")
    s.broker.produce("t.pods", pod_event_key(NODE, "another-uid"), POD_CODEC.encode(wrong_key),
                     timestamp_ms=BASE - 50_000, partition=P)
    s.sample(ticks(NODE, windows=1)[0], partition=OTHER)
    s.run()
    assert [(d.reason_code, d.source_topic, d.source_partition) for d in s.letters()] == [
        ("WRONG_PARTITION", "t.pods", OTHER), ("WRONG_PARTITION", "t.pods", OTHER), ("WRONG_KEY", "t.pods", P),
        ("WRONG_PARTITION", "t.samples", OTHER)]
    assert s.store.writes == [] and s.shares() == []
    assert s.processor.engine(OTHER) is None  # nothing was handled on that partition


def test_a_pod_tombstone_deletes_its_table_entry_and_a_keyless_one_is_dead_lettered():
    s = Setup()
    (first, _) = s.pods()
    key = pod_event_key(NODE, first.uid)
    s.broker.produce("t.pods", key, None, timestamp_ms=BASE, partition=P)
    position = s.broker.produce("t.pods", None, None, timestamp_ms=BASE + 1, partition=P)
    s.run()
    assert s.store.writes[-1] == TableWrite(P, PODS_TABLE, key.decode(), None)
    assert key.decode() not in s.store.tables[(P, PODS_TABLE)] and len(s.store.tables[(P, PODS_TABLE)]) == 1
    (letter,) = s.letters()
    assert (letter.reason_code, letter.source_offset) == ("EMPTY", position.offset)


def test_a_pod_too_large_to_store_is_dead_lettered():
    s = Setup()
    smallest = min(len(POD_CODEC.encode(e)) for e in pods_of(NODE))
    processor = AttributorProcessor(CONFIG, PARTITIONS, max_stored_pod_bytes=smallest - 1)
    s.runner = MessageRunner(processor, TOPICS, ManualClock(NOW))
    s.driver = MemoryDriver(s.runner, s.broker, OUTPUTS, s.store)
    s.pods()
    s.run()
    assert [d.reason_code for d in s.letters()] == ["TOO_LARGE", "TOO_LARGE"]
    assert s.store.writes == []


def test_an_impossible_pod_event_is_out_of_range_before_the_processor_keeps_anything():
    # Two days ahead of its append: beyond any clock correction (gpumeter.clockskew.MAX_CLOCK_CORRECTION_MS).
    s = Setup()
    future = dataclasses.replace(pods_of(NODE)[0], observed_at_unix_ms=NOW + 2 * 86_400_000)
    s.broker.produce("t.pods", pod_event_key(NODE, future.uid), POD_CODEC.encode(future), timestamp_ms=NOW,
                     partition=P)
    s.run()
    assert [d.reason_code for d in s.letters()] == ["OUT_OF_RANGE"]
    assert s.processor.engine(P) is None


def test_a_pod_event_of_a_clock_ahead_of_the_broker_is_corrected_not_refused():
    # The node's clock is an hour ahead: its pod event reads an hour after the broker appended it. Judged as it
    # reads it would be from the future (OUT_OF_RANGE); the broker's append time says by how much to correct it.
    s = Setup()
    pod = pods_of(NODE)[0]
    ahead = dataclasses.replace(pod, observed_at_unix_ms=pod.observed_at_unix_ms + 3600_000,
                                started_at_unix_ms=None if pod.started_at_unix_ms is None
                                else pod.started_at_unix_ms + 3600_000)
    s.broker.produce("t.pods", pod_event_key(NODE, pod.uid), POD_CODEC.encode(ahead),
                     timestamp_ms=pod.observed_at_unix_ms, partition=P)
    s.run()
    assert s.letters() == []
    stored = POD_CODEC.decode(s.store.writes[-1].value)
    assert (stored.observed_at_unix_ms, stored.started_at_unix_ms) == (pod.observed_at_unix_ms,
                                                                       pod.started_at_unix_ms)


def test_restore_rebuilds_from_the_tables_and_says_where_to_read_again():
    s = Setup()
    s.pods()
    samples = ticks(NODE, windows=3)
    for sample in samples:
        s.sample(sample)
    s.run()
    tables = s.store.tables
    open_samples = list(tables[(P, SAMPLES_TABLE)].items()) + [("n1|progress|broken", b"{")]
    rebuilt = AttributorProcessor(CONFIG, PARTITIONS)
    (restored,) = rebuilt.restore({P}, open_samples, tables[(P, PODS_TABLE)].items()).values()
    assert (restored.partition, restored.resume_samples_from, restored.pods, restored.nodes_with_progress) == (
        P, 20, 2, 1)
    assert restored.result == Result(changes=(TableWrite(P, SAMPLES_TABLE, "n1|progress|broken", None),))
    assert rebuilt.restore({P}, open_samples, ()) == {}  # a partition with an engine is not rebuilt again
    # Read again from offset 20, the rebuilt processor closes window 2 as the first one did.
    runner = MessageRunner(rebuilt, TOPICS, ManualClock(NOW))
    for message in s.broker.messages("t.samples", P, 20):
        assert runner.step(message).result.emits == ()
    closes_at = BASE + 3 * WINDOW_MS + (GRACE_S + IDLE_S) * 1000
    assert runner.tick(closes_at).emits == s.driver.tick(closes_at).emits


@pytest.mark.parametrize("caught_up", [True, False])
def test_on_clock_covers_every_partition_with_one_caught_up(caught_up):
    s = Setup()
    s.pods()
    other_node = next(f"n{i}" for i in range(2, 50) if partition_for_node(f"n{i}", PARTITIONS) == OTHER)
    s.pods(other_node)
    for node in (NODE, other_node):
        for sample in ticks(node, windows=1):
            s.sample(sample)
    s.run()
    closes_at = BASE + WINDOW_MS + (GRACE_S + IDLE_S) * 1000
    assert s.processor.on_clock_partition(P, closes_at, caught_up=False) == Result()
    result = s.processor.on_clock(closes_at, caught_up)
    assert sorted((e.key, e.record.window_start_unix_ms) for e in result.emits) == (
        sorted([(NODE.encode(), BASE), (other_node.encode(), BASE)]) if caught_up else [])
