"""The per-partition engine: windows closed by ticks and by the clock, late and repeated ticks, range checks, and
restore from table contents giving the same shares as an uninterrupted run."""

from __future__ import annotations

import dataclasses

import pytest

from gpumeter.errors import ConfigError, InvalidMessage, LateMessage, OutOfRange
from schemas.records import NodeSample, PodEvent, PodEventType
from services.attributor.attribution import AttributionPolicy, attribute_node_window
from services.attributor.engine import (
    AttributionEngine,
    EngineConfig,
    NodeProgress,
    check_sample,
    is_progress_key,
    node_of_table_key,
    pod_table_key,
    progress_table_key,
    sample_table_key,
)
from services.attributor.pod_index import PodIndex, apply_pod_events
from services.attributor.windows import NodeWindow
from tests.unit.attributor import CLUSTER, GIB, device, node_sample, pod_event

WINDOW_S = 10
GRACE_S = 2
IDLE_S = 3
SKEW_S = 60
WINDOW_MS = WINDOW_S * 1000
BASE = 1_700_000_000_000 - (1_700_000_000_000 % WINDOW_MS)  # a window start
NOW = BASE + 3600 * 1000  # wall clock well after the data (range checks only look at the future)
CONFIG = EngineConfig(window_seconds=WINDOW_S, grace_seconds=GRACE_S, idle_close_seconds=IDLE_S,
                      max_clock_skew_seconds=SKEW_S, pod_linger_ms=600_000)


def two_pod_tick(t: int, node: str, k: int, *, started: int = 1) -> NodeSample:
    """Two pods time-slicing GPU-<node>; their memory and SM vary with k so every window has its own numbers."""
    mem_a, mem_b = (4 + k % 5) * GIB, (2 + k % 3) * GIB
    sm_a, sm_b = 10 + k % 7, 5 + k % 4
    dev = device(f"GPU-{node}", used=mem_a + mem_b + GIB, util=min(sm_a + sm_b + 20, 100), replicas=2,
                 procs=[(0, mem_a, sm_a), (1, mem_b, sm_b)])
    return node_sample(t, [dev], node=node, pod_uids=[f"{node}-a", f"{node}-b"], collector_started_at_unix_ms=started,
                       sequence=k)


def pods_of(node: str) -> list[PodEvent]:
    return [
        pod_event(f"{node}-{p}", node=node, devices=[("nvidia.com/gpu.shared", [f"GPU-{node}::{i}"])],
                  observed_at_unix_ms=BASE - 60_000, started_at_unix_ms=BASE - 120_000)
        for i, p in enumerate("ab")
    ]


def ticks(node: str, windows: int = 3) -> list[NodeSample]:
    return [two_pod_tick(BASE + k * 1000, node, k) for k in range(windows * WINDOW_S)]


def expected_windows(samples, pods, policy=AttributionPolicy()):
    """attribute_node_window computed directly on each (node, window) of ``samples``."""
    index = apply_pod_events(PodIndex.empty(600_000), pods)
    groups: dict[tuple[str, int], list[NodeSample]] = {}
    for s in samples:
        start = s.sampled_at_unix_ms // WINDOW_MS * WINDOW_MS
        groups.setdefault((s.node_name, start), []).append(s)
    out = {}
    for (node, start), group in groups.items():
        group.sort(key=lambda s: (s.sampled_at_unix_ms, s.collector_started_at_unix_ms, s.sequence))
        out[(node, start)] = attribute_node_window(NodeWindow(CLUSTER, node, start, WINDOW_S, tuple(group)), index,
                                                   policy)
    return out


class Harness:
    """Drives an engine the way the streaming app does, with dicts for its two tables."""

    def __init__(self, engine: AttributionEngine | None = None) -> None:
        self.engine = engine or AttributionEngine(CONFIG)
        self.samples: dict[str, NodeSample] = {}
        self.progress: dict[str, NodeProgress] = {}
        self.pods: dict[str, PodEvent] = {}
        self.emitted: list = []
        self.dead_letters: list = []
        self.duplicates = 0

    def feed(self, inputs, now_ms: int = NOW) -> None:
        for position, item in inputs:
            if isinstance(item, PodEvent):
                if self.engine.on_pod_event(item):
                    self.pods[pod_table_key(item)] = item
            else:
                out = self.engine.on_sample(item, now_ms, position)
                if out.late:
                    self.dead_letters.append(out.late[0])
                if out.duplicate:
                    self.duplicates += 1
                if out.accepted:
                    self.samples[sample_table_key(item)] = item
                self.emit(out.windows)
            self.apply()

    def emit(self, windows, record: bool = True) -> None:
        self.emitted.extend(windows)
        if record:
            self.engine.record_emitted(windows)

    def clock(self, now_ms: int) -> None:
        self.emit(self.engine.on_clock(now_ms).windows)

    def apply(self, progress: bool = True, deletes: bool = True) -> None:
        changes = self.engine.take_table_changes()
        if progress:
            for record in changes.progress:
                self.progress[record.table_key] = record
        if deletes:
            for key in changes.deleted_sample_keys:
                self.samples.pop(key, None)
                self.progress.pop(key, None)
            for key in changes.deleted_pod_keys:
                self.pods.pop(key, None)

    def restarted(self) -> "Harness":
        """A new worker: a fresh engine restored from these tables (the tables themselves carry over)."""
        fresh = Harness()
        fresh.samples, fresh.progress, fresh.pods = dict(self.samples), dict(self.progress), dict(self.pods)
        out = fresh.engine.restore(fresh.samples.values(), fresh.pods.values(), fresh.progress.values())
        fresh.emit(out.windows)
        return fresh

    def by_window(self):
        result: dict[tuple[str, int], list] = {}
        for w in self.emitted:
            result.setdefault((w.node_name, w.window_start_unix_ms), []).append(w.shares)
        return result


def interleave(*streams):
    """Round-robin merge of per-node tick lists, as one partition would carry them; positions are offsets."""
    merged = []
    for group in zip(*streams):
        merged.extend(group)
    return list(enumerate(merged))


def partition_input(nodes=("node-a", "node-b"), windows=3):
    pods = [p for n in nodes for p in pods_of(n)]
    samples = interleave(*(ticks(n, windows) for n in nodes))
    # Pod events come first on the partition; positions continue after them.
    return pods, [(-len(pods) + i, p) for i, p in enumerate(pods)] + samples


# ----------------------------------------------------------------------------------------------------------------
# Windows closed by ticks and by the clock


def test_windows_close_by_ticks_and_carry_the_direct_attribution():
    pods, inputs = partition_input()
    h = Harness()
    h.feed(inputs)
    samples = [s for _, s in inputs if isinstance(s, NodeSample)]
    expected = expected_windows(samples, pods)
    got = h.by_window()
    # The last window of each node needs end + grace: ticks only reach its end, so it is still open.
    last = BASE + 2 * WINDOW_MS
    assert set(got) == {k for k in expected if k[1] < last}
    for key, emissions in got.items():
        assert emissions == [expected[key]]
    for node in ("node-a", "node-b"):
        assert h.engine.open_window_starts(CLUSTER, node) == (last,)
    # Emitted windows' ticks left the table; the open window's ticks and one progress record per node remain.
    assert set(h.samples) == {sample_table_key(s) for s in samples if s.sampled_at_unix_ms >= last}
    assert {(p.node_name, p.closed_before_unix_ms) for p in h.progress.values()} == {("node-a", last), ("node-b", last)}
    assert all(is_progress_key(k) for k in h.progress)
    rows = [r for emissions in got.values() for r in emissions[0]]
    assert {r.namespace for r in rows if r.pod_uid} == {"ml"}


def test_window_results_name_their_ticks_and_rows():
    pods, inputs = partition_input(nodes=("node-a",), windows=1)
    h = Harness()
    h.feed(inputs)
    assert h.emitted == []
    h.feed([(10_000, two_pod_tick(BASE + WINDOW_MS + GRACE_S * 1000, "node-a", 99))])
    (window,) = h.emitted
    first = [s for _, s in inputs if isinstance(s, NodeSample)]
    assert window.sample_keys == tuple(sample_table_key(s) for s in first)
    assert window.window_end_unix_ms == BASE + WINDOW_MS
    assert len(window.shares) == window.shares[0].rows_in_unit  # one GPU: 2 pods + 4 buckets
    assert {r.pod_uid for r in window.shares} == {"node-a-a", "node-a-b", None}


def test_clock_closes_a_silent_nodes_window_only_after_end_grace_and_idle():
    pods, inputs = partition_input(nodes=("node-a",), windows=1)
    h = Harness()
    h.feed(inputs)
    assert h.emitted == []
    close_at = BASE + WINDOW_MS + (GRACE_S + IDLE_S) * 1000
    h.clock(close_at - 1)
    assert h.emitted == []
    h.clock(close_at)
    samples = [s for _, s in inputs if isinstance(s, NodeSample)]
    assert h.by_window() == {("node-a", BASE): [expected_windows(samples, pods)[("node-a", BASE)]]}
    # The clock cannot write tables: the progress record and deletes wait for the next event of the partition.
    assert len(h.samples) == len(samples)
    h.apply()
    assert h.samples == {}
    assert h.progress[progress_table_key(CLUSTER, "node-a")].closed_before_unix_ms == BASE + WINDOW_MS


def test_clock_never_goes_back_and_new_nodes_obey_it():
    h = Harness()
    h.clock(BASE + 5 * WINDOW_MS)
    assert h.engine.clock_watermark_ms == BASE + 5 * WINDOW_MS - IDLE_S * 1000
    h.clock(BASE)  # an earlier reading changes nothing
    assert h.engine.clock_watermark_ms == BASE + 5 * WINDOW_MS - IDLE_S * 1000
    # A node first heard of now: its tick of a window the clock has closed is late.
    old = two_pod_tick(BASE + WINDOW_MS, "node-new", 1)
    h.feed([(1, old)])
    assert [d.sample for d in h.dead_letters] == [old]


def test_flush_closes_every_open_window_for_a_replay():
    pods, inputs = partition_input(windows=2)
    h = Harness()
    h.feed([(None, item) for _, item in inputs])  # a replay has no positions
    assert len(h.emitted) == 2  # the first window of each node
    h.emit(h.engine.flush().windows)
    samples = [s for _, s in inputs if isinstance(s, NodeSample)]
    assert h.by_window() == {key: [rows] for key, rows in expected_windows(samples, pods).items()}
    assert [w.window_start_unix_ms for w in h.emitted[2:]] == [BASE + WINDOW_MS] * 2
    assert h.engine.flush().windows == ()


# ----------------------------------------------------------------------------------------------------------------
# Late and repeated ticks


def test_a_tick_of_a_closed_window_is_rejected_as_late():
    pods, inputs = partition_input(nodes=("node-a",), windows=2)
    h = Harness()
    h.feed(inputs)
    h.feed([(1000, two_pod_tick(BASE + WINDOW_MS + GRACE_S * 1000, "node-a", 50))])
    late = two_pod_tick(BASE + 500, "node-a", 51)
    out = h.engine.on_sample(late, NOW, 1001)
    assert not out.accepted and out.windows == ()
    (rejected,) = out.late
    assert rejected.sample is late and rejected.metadata == 1001
    error = rejected.error()
    assert isinstance(error, LateMessage) and error.reason_code == "LATE"
    assert h.engine.late_rejected == 1


def test_a_tick_within_grace_amends_its_window():
    pods, inputs = partition_input(nodes=("node-a",), windows=1)
    h = Harness()
    h.feed(inputs[:-1])  # the window's last tick is held back
    h.feed([(500, two_pod_tick(BASE + WINDOW_MS + 1000, "node-a", 200))])  # next window, within grace
    h.feed([inputs[-1]])  # arrives late but within grace
    h.feed([(501, two_pod_tick(BASE + WINDOW_MS + GRACE_S * 1000, "node-a", 201))])
    samples = [s for _, s in inputs if isinstance(s, NodeSample)]
    assert h.by_window() == {("node-a", BASE): [expected_windows(samples, pods)[("node-a", BASE)]]}
    assert h.dead_letters == []


def test_a_repeated_tick_is_a_duplicate_not_stored_twice():
    tick = two_pod_tick(BASE, "node-a", 1)
    engine = AttributionEngine(CONFIG)
    assert engine.on_sample(tick, NOW, 1).accepted
    again = engine.on_sample(tick, NOW, 2)
    assert again.duplicate and not again.accepted and again.late == ()


# ----------------------------------------------------------------------------------------------------------------
# Restore


def run_uninterrupted(inputs):
    h = Harness()
    h.feed(inputs)
    return h


def test_restore_rebuilds_the_same_state_and_shares_as_an_uninterrupted_run():
    pods, inputs = partition_input(windows=4)
    reference = run_uninterrupted(inputs)
    for cut in (len(pods) + 1, len(pods) + 17, len(inputs) // 2, len(inputs) - 3):
        first = Harness()
        first.feed(inputs[:cut])
        second = first.restarted()
        assert second.emitted == []  # every closed window had its progress record: nothing to re-emit
        for node in ("node-a", "node-b"):
            assert second.engine.open_window_starts(CLUSTER, node) == first.engine.open_window_starts(CLUSTER, node)
            assert second.engine.closed_before(CLUSTER, node) == first.engine.closed_before(CLUSTER, node)
        assert second.engine.open_sample_count() == first.engine.open_sample_count()
        assert second.engine.pods.uids == first.engine.pods.uids
        second.feed(inputs[cut:])
        combined = first.by_window()
        for key, emissions in second.by_window().items():
            combined.setdefault(key, []).extend(emissions)
        assert combined == reference.by_window(), cut
        assert second.dead_letters == [] and first.dead_letters == []


def test_redelivered_ticks_after_restore_are_duplicates_not_late():
    pods, inputs = partition_input(windows=4)
    reference = run_uninterrupted(inputs)
    cut = len(inputs) - 20
    first = Harness()
    first.feed(inputs[:cut])
    second = first.restarted()
    # The consumer's committed offset lagged: the last 40 inputs before the crash come again.
    second.feed(inputs[cut - 40:])
    assert second.dead_letters == []
    assert second.duplicates == 40 - sum(1 for _, i in inputs[cut - 40:cut] if isinstance(i, PodEvent))
    combined = first.by_window()
    for key, emissions in second.by_window().items():
        combined.setdefault(key, []).extend(emissions)
    assert combined == reference.by_window()


def test_a_tick_after_the_restored_position_for_a_closed_window_is_late():
    pods, inputs = partition_input(nodes=("node-a",), windows=3)
    first = Harness()
    first.feed(inputs)
    second = first.restarted()
    late = two_pod_tick(BASE + 100, "node-a", 999)
    second.feed([(len(inputs) + 5, late)])
    assert [d.sample for d in second.dead_letters] == [late]


def test_a_window_emitted_but_not_recorded_is_emitted_again_whole():
    pods, inputs = partition_input(nodes=("node-a",), windows=3)
    reference = run_uninterrupted(inputs)
    h = Harness()
    # Crash after the rows went out but before the progress record and deletes were written.
    for position, item in inputs:
        if isinstance(item, PodEvent):
            h.feed([(position, item)])
            continue
        out = h.engine.on_sample(item, NOW, position)
        if out.accepted:
            h.samples[sample_table_key(item)] = item
        if out.windows:
            h.emit(out.windows, record=False)
            break
        h.apply()
    assert len(h.emitted) == 1
    restarted = h.restarted()
    assert [(w.node_name, w.window_start_unix_ms, w.shares) for w in restarted.emitted] == [
        (w.node_name, w.window_start_unix_ms, w.shares) for w in h.emitted
    ]
    assert h.emitted[0].shares == reference.by_window()[("node-a", BASE)][0]


def test_progress_written_but_deletes_lost_leaves_no_partial_window():
    pods, inputs = partition_input(nodes=("node-a",), windows=3)
    reference = run_uninterrupted(inputs)
    h = Harness()
    for position, item in inputs:
        if isinstance(item, PodEvent):
            h.feed([(position, item)])
            continue
        out = h.engine.on_sample(item, NOW, position)
        if out.accepted:
            h.samples[sample_table_key(item)] = item
        h.emit(out.windows)
        # The crash loses every delete (they come after the progress record in the changelog).
        h.apply(deletes=False)
    stale = {k for k, s in h.samples.items() if s.sampled_at_unix_ms < BASE + 2 * WINDOW_MS}
    assert stale
    restarted = h.restarted()
    assert restarted.emitted == []
    restarted.apply()
    assert stale.isdisjoint(restarted.samples)
    restarted.feed([(len(inputs), two_pod_tick(BASE + 3 * WINDOW_MS + GRACE_S * 1000, "node-a", 77))])
    last = ("node-a", BASE + 2 * WINDOW_MS)
    assert restarted.by_window() == {last: reference.by_window().get(last, []) + [
        expected_windows([s for _, s in inputs if isinstance(s, NodeSample)], pods)[last]
    ]}


def test_restore_needs_a_fresh_engine():
    engine = AttributionEngine(CONFIG)
    engine.on_sample(two_pod_tick(BASE, "node-a", 1), NOW, 1)
    with pytest.raises(RuntimeError):
        engine.restore([], [], [])


def test_progress_is_held_back_by_a_window_not_yet_emitted():
    pods, inputs = partition_input(nodes=("node-a",), windows=1)
    h = Harness()
    h.feed(inputs)
    clock_windows = h.engine.on_clock(BASE + WINDOW_MS + (GRACE_S + IDLE_S) * 1000).windows  # rows still in flight
    assert len(clock_windows) == 1
    # A later window closes by ticks and is emitted first.
    h.feed([(100, two_pod_tick(BASE + WINDOW_MS + 500, "node-a", 300))])
    h.feed([(101, two_pod_tick(BASE + 2 * WINDOW_MS + GRACE_S * 1000, "node-a", 301))])
    assert [w.window_start_unix_ms for w in h.emitted] == [BASE + WINDOW_MS]
    assert h.progress[progress_table_key(CLUSTER, "node-a")].closed_before_unix_ms == BASE
    h.emit(clock_windows)
    h.apply()
    assert h.progress[progress_table_key(CLUSTER, "node-a")].closed_before_unix_ms == BASE + 2 * WINDOW_MS


# ----------------------------------------------------------------------------------------------------------------
# Pods


def test_pod_events_change_the_index_once_and_pruned_pods_leave_the_table():
    h = Harness()
    ev = pods_of("node-a")[0]
    h.feed([(0, ev)])
    assert pod_table_key(ev) in h.pods and h.engine.pods.pod(ev.uid) is not None
    assert h.engine.on_pod_event(ev) is False  # the same event again
    stale = dataclasses.replace(ev, observed_at_unix_ms=ev.observed_at_unix_ms - 1, resource_version="0")
    assert h.engine.on_pod_event(stale) is False
    deleted = dataclasses.replace(ev, event_type=PodEventType.DELETED, observed_at_unix_ms=BASE,
                                  resource_version="2")
    h.feed([(1, deleted)])
    assert h.engine.pods.pod(ev.uid).deleted_at_unix_ms == BASE
    # Another pod's event far past the linger prunes the deleted pod; its table entry goes too.
    other = pods_of("node-a")[1]
    later = dataclasses.replace(other, observed_at_unix_ms=BASE + CONFIG.pod_linger_ms, resource_version="9")
    h.feed([(2, later)])
    assert h.engine.pods.pod(ev.uid) is None
    assert set(h.pods) == {pod_table_key(later)}


def test_silent_nodes_are_forgotten_with_their_progress_record():
    pods, inputs = partition_input(nodes=("node-a",), windows=1)
    h = Harness()
    h.feed(inputs)
    h.clock(BASE + WINDOW_MS + (GRACE_S + IDLE_S) * 1000)
    h.apply()
    assert progress_table_key(CLUSTER, "node-a") in h.progress
    h.clock(BASE + 10 * WINDOW_MS)
    h.apply()
    assert h.engine.nodes() == ()
    assert h.progress == {}


# ----------------------------------------------------------------------------------------------------------------
# Range checks


def _dev(**changes):
    return dataclasses.replace(device(used=4 * GIB, util=50, procs=[(0, 2 * GIB, 30)]), **changes)


@pytest.mark.parametrize(
    "sample",
    [
        node_sample(NOW + SKEW_S * 1000 + 1, [_dev()], pod_uids=["a"]),
        node_sample(BASE, [_dev()], pod_uids=["a"], interval_ms=-1),
        node_sample(BASE, [_dev(memory_used_bytes=-1)], pod_uids=["a"]),
        node_sample(BASE, [_dev(memory_free_bytes=-1)], pod_uids=["a"]),
        node_sample(BASE, [_dev(memory_reserved_bytes=-1)], pod_uids=["a"]),
        node_sample(BASE, [_dev(memory_total_bytes=-1, memory_used_bytes=0)], pod_uids=["a"]),
        node_sample(BASE, [_dev(memory_used_bytes=81 * GIB)], pod_uids=["a"]),
        node_sample(BASE, [_dev(memory_reserved_bytes=81 * GIB)], pod_uids=["a"]),
        node_sample(BASE, [_dev(gpu_utilization_percent=101)], pod_uids=["a"]),
        node_sample(BASE, [_dev(gpu_utilization_percent=-1)], pod_uids=["a"]),
        node_sample(BASE, [_dev(memory_utilization_percent=140)], pod_uids=["a"]),
        node_sample(BASE, [_dev(process_pids=(1, 2))], pod_uids=["a"]),
        node_sample(BASE, [_dev(process_sm_utilization_percent=())], pod_uids=["a"]),
        node_sample(BASE, [_dev(process_used_memory_bytes=(-5,))], pod_uids=["a"]),
        node_sample(BASE, [_dev(process_sm_utilization_percent=(101,))], pod_uids=["a"]),
        node_sample(BASE, [_dev(process_sm_utilization_percent=(-2,))], pod_uids=["a"]),
        node_sample(BASE, [device("GPU-ok"), _dev(uuid="GPU-bad", memory_used_bytes=-3)], pod_uids=["a"]),
    ],
)
def test_impossible_ticks_are_out_of_range(sample):
    with pytest.raises(OutOfRange) as info:
        check_sample(sample, NOW, SKEW_S * 1000)
    assert info.value.reason_code == "OUT_OF_RANGE"
    engine = AttributionEngine(CONFIG)
    with pytest.raises(OutOfRange):
        engine.on_sample(sample, NOW, 1)
    assert engine.nodes() == () and engine.take_table_changes().deleted_sample_keys == ()


@pytest.mark.parametrize(
    "sample",
    [
        node_sample(NOW + SKEW_S * 1000, [_dev()], pod_uids=["a"]),  # exactly at the allowed skew
        node_sample(BASE, [_dev(gpu_utilization_percent=None, memory_utilization_percent=None)], pod_uids=["a"]),
        node_sample(BASE, [device(total=0, used=0, util=None)]),  # a lost GPU reports zeros
        node_sample(BASE, [_dev(process_sm_utilization_percent=(-1,))], pod_uids=["a"]),  # NVML's "no sample"
        node_sample(BASE, [_dev(process_pod_index=(-1,))]),  # a process of no known pod
        node_sample(BASE, [_dev(memory_used_bytes=80 * GIB, memory_free_bytes=0)], pod_uids=["a"]),
        node_sample(BASE, [], interval_ms=0),
    ],
)
def test_possible_ticks_pass_the_range_checks(sample):
    check_sample(sample, NOW, SKEW_S * 1000)
    assert AttributionEngine(CONFIG).on_sample(sample, NOW, 1).accepted


# ----------------------------------------------------------------------------------------------------------------
# Keys, records, config


def test_table_keys():
    tick = two_pod_tick(BASE, "node-a", 7, started=123)
    assert sample_table_key(tick) == "node-a|123|7"
    assert node_of_table_key(sample_table_key(tick)) == "node-a"
    key = progress_table_key("c1", "node-a")
    assert is_progress_key(key) and not is_progress_key(sample_table_key(tick))
    assert node_of_table_key(key) == "node-a"
    assert pod_table_key(pods_of("node-a")[0]) == "node-a/node-a-a"


def test_progress_records_round_trip_and_garbage_is_corrupt():
    record = NodeProgress("c1", "node-a", BASE, 42)
    assert NodeProgress.decode(record.encode()) == record
    assert NodeProgress.decode(dataclasses.replace(record, position=None).encode()).position is None
    for garbage in (b"", b"{}", b"[1]", b"\xff\xfe", b'{"cluster": "c", "node_name": "n", "position": 1}'):
        with pytest.raises(InvalidMessage) as info:
            NodeProgress.decode(garbage)
        assert info.value.reason_code == "CORRUPT"


@pytest.mark.parametrize(
    "changes",
    [{"window_seconds": 0}, {"grace_seconds": -1}, {"idle_close_seconds": -1}, {"max_clock_skew_seconds": -5},
     {"pod_linger_ms": -1}],
)
def test_engine_config_rejects_unusable_values(changes):
    with pytest.raises(ConfigError):
        dataclasses.replace(CONFIG, **changes)


# -- clock skew (gpumeter.clockskew): the broker's append time decides ----------------------------------------------


def _behind(sample: NodeSample, skew_ms: int) -> NodeSample:
    return dataclasses.replace(sample, sampled_at_unix_ms=sample.sampled_at_unix_ms + skew_ms)


def test_a_node_whose_clock_is_behind_is_corrected_by_the_brokers_append_time_and_a_clock_step_is_clock_skew():
    engine = AttributionEngine(CONFIG)
    for event in pods_of("n1"):
        engine.on_pod_event(event)
    engine.on_clock(BASE)  # the attributor is caught up at BASE: a tick 10 minutes old is late as it reads
    samples = ticks("n1", windows=2)
    outputs = [engine.on_sample(_behind(s, -600_000), s.sampled_at_unix_ms + 3, k, s.sampled_at_unix_ms)
               for k, s in enumerate(samples)]
    assert all(o.accepted for o in outputs)
    assert engine.clock_offsets() == {(CLUSTER, "n1"): -600_000}
    windows = [w for o in outputs for w in o.windows]
    assert [w.window_start_unix_ms for w in windows] == [BASE]  # the tick's true window, not 10 minutes before
    assert windows[0].shares == expected_windows(samples, pods_of("n1"))[("n1", BASE)]
    # The clock steps another 10 minutes back: the first tick after the step is refused CLOCK_SKEW (not LATE), its
    # message says what the broker's clock said; the second confirms the new offset and is taken.
    t = BASE + len(samples) * 1000
    step = [two_pod_tick(t + k * 1000, "n1", len(samples) + k) for k in range(2)]
    first = engine.on_sample(_behind(step[0], -1_200_000), t, 100, step[0].sampled_at_unix_ms)
    assert first.clock_skew and first.rejection.reason_code == "CLOCK_SKEW"
    assert "-1200.000 s off" in first.rejection.detail and "clock may just have moved" in first.rejection.detail
    second = engine.on_sample(_behind(step[1], -1_200_000), t + 1000, 101, step[1].sampled_at_unix_ms)
    assert second.accepted and engine.clock_offsets() == {(CLUSTER, "n1"): -1_200_000}


def test_a_node_whose_clock_is_ahead_is_corrected_pod_events_too():
    engine = AttributionEngine(CONFIG)
    ahead = 600_000
    for event in pods_of("n1"):
        shifted = dataclasses.replace(event, observed_at_unix_ms=event.observed_at_unix_ms + ahead,
                                      started_at_unix_ms=event.started_at_unix_ms + ahead)
        corrected = engine.corrected_pod_event(shifted, event.observed_at_unix_ms)
        assert corrected == event
        engine.on_pod_event(corrected)
    samples = ticks("n1", windows=2)
    outputs = [engine.on_sample(_behind(s, ahead), s.sampled_at_unix_ms, k, s.sampled_at_unix_ms)
               for k, s in enumerate(samples)]
    assert all(o.accepted for o in outputs)  # before: OUT_OF_RANGE, 600 s in the future (allowed skew 60 s)
    windows = [w for o in outputs for w in o.windows]
    assert windows[0].shares == expected_windows(samples, pods_of("n1"))[("n1", BASE)]


def test_a_late_tick_says_which_watermark_closed_its_window():
    engine = AttributionEngine(CONFIG)
    samples = ticks("n1", windows=3)
    for k, s in enumerate(samples):
        engine.on_sample(s, NOW, k)
    late = engine.on_sample(two_pod_tick(BASE, "n1", 999), NOW, 999)
    assert late.rejection.reason_code == "LATE"
    assert "the node's own watermark" in late.rejection.detail and "attributor's clock watermark none" in \
        late.rejection.detail


def test_ticks_of_two_collectors_of_one_node_are_merged_and_counted():
    engine = AttributionEngine(CONFIG)
    old = [two_pod_tick(BASE + k * 1000, "n1", k, started=1) for k in range(4)]
    new = [two_pod_tick(BASE + k * 1000 + 500, "n1", k, started=BASE + 1500) for k in range(2, 4)]
    flags = [engine.on_sample(s, NOW, None).second_collector for s in (*old[:2], new[0], old[2], new[1], old[3])]
    assert flags == [False, False, False, True, False, True]
    assert engine.second_collector_ticks == 2
