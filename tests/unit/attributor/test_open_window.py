"""A node window summed as its ticks arrive (``OpenNodeWindow``) closes to exactly the rows of the window attributed
from its ticks at close: for any pods, processes, modes and policies, whether or not the pods changed after the
ticks arrived, however the sums were batched -- and the engine closes its windows that way."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given

from schemas.records import PodEventType, SharingMode
from services.attributor import attribution
from services.attributor.attribution import (
    AttributionPolicy,
    MpsCompute,
    OpenNodeWindow,
    attribute_node_window,
    attribute_node_window_detailed,
)
from services.attributor.engine import AttributionEngine, EngineConfig
from services.attributor.pod_index import LivePodIndex, PodIndex, apply_pod_events
from services.attributor.windows import NodeWindow
from tests.unit.attributor import GIB, device, node_sample, pod_event
from tests.unit.attributor.test_attribution_properties import PROPERTY_SETTINGS, START, WINDOW_S, policies, scenarios


def _summed(window: NodeWindow, pods, policy: AttributionPolicy, generation: int = 0) -> OpenNodeWindow:
    summed = OpenNodeWindow(window.window_seconds, policy)
    for sample in window.samples:
        summed.add(sample, pods, generation)
    return summed


class _Counting:
    """How many units the close attributed from their sums, and how many from their ticks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.from_sums = self.from_ticks = 0
        prepared = attribution._OpenUnit.prepared

        def counted(unit, *args):
            result = prepared(unit, *args)
            if result is None:
                self.from_ticks += 1
            else:
                self.from_sums += 1
            return result

        monkeypatch.setattr(attribution._OpenUnit, "prepared", counted)


@pytest.mark.parametrize("batch_ticks", [1, 3, 8])
@PROPERTY_SETTINGS
@given(scenario=scenarios(), policy=policies)
def test_summed_as_ticks_arrive_equals_attributed_at_close(batch_ticks, scenario, policy):
    window, index = scenario
    original = attribution._SUM_BATCH_TICKS
    attribution._SUM_BATCH_TICKS = batch_ticks
    try:
        summed = _summed(window, index, policy)
    finally:
        attribution._SUM_BATCH_TICKS = original
    expected = attribute_node_window_detailed(window, index, policy)
    got = attribute_node_window_detailed(window, index, policy, summed)
    # Bit for bit: the same floating-point sums in the same order, the same decisions and data-quality counts.
    assert got == expected


def _decoded_v4(window: NodeWindow) -> NodeWindow:
    """``window`` with its ticks as the attributor gets them off the hot topic (NodeSample v4, decoded): the
    engine's packed lane (``attribution._PackedLane``) takes those wherever it can run. Ticks v4 cannot carry (a
    figure equal to a column's missing sentinel, an impossible value) are not drawn."""
    import dataclasses

    from hypothesis import assume

    from gpumeter.errors import InvalidMessage
    from schemas.errors import SchemaEncodeError
    from schemas.records import NodeSample
    from schemas.typed import codec_for

    codec = codec_for(NodeSample)
    samples = []
    for sample in window.samples:
        try:
            samples.append(codec.decode(codec.encode(sample)))
        except (SchemaEncodeError, InvalidMessage, OverflowError):
            assume(False)
    return dataclasses.replace(window, samples=tuple(samples))


@pytest.mark.parametrize("lane_chunk_ticks", [1, 3, 16, 32])
@PROPERTY_SETTINGS
@given(scenario=scenarios(), policy=policies)
def test_ticks_summed_from_their_v4_columns_equal_attributed_at_close(lane_chunk_ticks, scenario, policy):
    window, index = scenario
    window = _decoded_v4(window)
    original = attribution._LANE_CHUNK_TICKS
    attribution._LANE_CHUNK_TICKS = lane_chunk_ticks
    try:
        summed = _summed(window, index, policy)
    finally:
        attribution._LANE_CHUNK_TICKS = original
    expected = attribute_node_window_detailed(window, index, policy)
    got = attribute_node_window_detailed(window, index, policy, summed)
    assert got == expected


@PROPERTY_SETTINGS
@given(scenario=scenarios(), policy=policies)
def test_pods_that_changed_after_the_ticks_arrived_give_the_close_s_rows(scenario, policy):
    # The ticks are summed under no pods at all (their events not in yet), the close sees every pod.
    window, index = scenario
    summed = _summed(window, PodIndex.empty(), policy)
    assert attribute_node_window_detailed(window, index, policy, summed) == attribute_node_window_detailed(
        window, index, policy)


def _time_sliced_pods() -> list:
    return [pod_event(f"pod-{i}", devices=[("nvidia.com/gpu", [f"GPU-0::{i}"])], observed_at_unix_ms=START - 20_000)
            for i in range(3)]


def _time_sliced_window(ticks: int, *, modes: list[SharingMode] | None = None,
                        times: list[int] | None = None) -> tuple[NodeWindow, PodIndex]:
    events = _time_sliced_pods()
    samples = []
    for seq in range(ticks):
        t = times[seq] if times is not None else START + seq * 1000
        mode = modes[seq] if modes is not None else SharingMode.TIME_SLICING
        procs = [(i, (i + 1) * GIB + seq * 1024, 10 * i + seq % 7) for i in range(3)]
        samples.append(node_sample(t, [device("GPU-0", used=8 * GIB, util=60 + seq % 30, mode=mode, replicas=3,
                                              procs=procs)], pod_uids=[f"pod-{i}" for i in range(3)],
                                   sequence=seq))
    ordered = tuple(sorted(samples, key=lambda s: (s.sampled_at_unix_ms, s.sequence)))
    return NodeWindow("c1", "node-a", START, WINDOW_S, ordered), apply_pod_events(PodIndex.empty(), events)


def test_a_steady_window_closes_from_its_sums(monkeypatch):
    window, index = _time_sliced_window(60)
    count = _Counting(monkeypatch)
    policy = AttributionPolicy()
    summed = _summed(window, index, policy)
    assert attribute_node_window(window, index, policy, summed) == attribute_node_window(window, index, policy)
    assert (count.from_sums, count.from_ticks) == (1, 0)


def test_a_unit_whose_holders_changed_after_its_ticks_is_attributed_from_its_ticks(monkeypatch):
    window, index = _time_sliced_window(60)
    policy = AttributionPolicy()
    summed = _summed(window, index, policy)
    # pod-1's deletion, observed after the ticks were summed, ends its life in the middle of the window.
    later = apply_pod_events(index, [pod_event("pod-1", devices=[("nvidia.com/gpu", ["GPU-0::1"])],
                                               event_type=PodEventType.DELETED, phase="Succeeded",
                                               observed_at_unix_ms=START + 30_500, resource_version="2")])
    count = _Counting(monkeypatch)
    assert attribute_node_window(window, later, policy, summed) == attribute_node_window(window, later, policy)
    assert (count.from_sums, count.from_ticks) == (0, 1)


def test_an_epoch_whose_majority_mode_selects_another_branch_is_attributed_from_its_ticks(monkeypatch):
    # Summed under time-slicing (the first tick's mode), decided MPS at close (most of the window's weight).
    modes = [SharingMode.TIME_SLICING] * 10 + [SharingMode.MPS] * 50
    window, index = _time_sliced_window(60, modes=modes)
    policy = AttributionPolicy()
    summed = _summed(window, index, policy)
    count = _Counting(monkeypatch)
    assert attribute_node_window(window, index, policy, summed) == attribute_node_window(window, index, policy)
    assert (count.from_sums, count.from_ticks) == (0, 1)


def test_mps_split_by_threads_is_attributed_from_the_ticks(monkeypatch):
    window, index = _time_sliced_window(20, modes=[SharingMode.MPS] * 20)
    policy = AttributionPolicy(mps_compute=MpsCompute.THREADS)
    summed = _summed(window, index, policy)
    count = _Counting(monkeypatch)
    assert attribute_node_window(window, index, policy, summed) == attribute_node_window(window, index, policy)
    assert (count.from_sums, count.from_ticks) == (0, 1)


def test_a_tick_out_of_order_drops_the_sums_and_the_close_uses_the_ticks():
    times = [START + s * 1000 for s in range(30)]
    times[10], times[11] = times[11], times[10]
    window, index = _time_sliced_window(30, times=times)
    policy = AttributionPolicy()
    summed = OpenNodeWindow(WINDOW_S, policy)
    arrived = sorted(window.samples, key=lambda s: s.sequence)  # arrival order: 11's time before 10's
    for sample in arrived:
        summed.add(sample, index, 0)
    assert not summed.holds(window, policy)
    assert attribute_node_window(window, index, policy, summed) == attribute_node_window(window, index, policy)


def test_the_sums_of_another_window_or_policy_are_not_used():
    window, index = _time_sliced_window(20)
    policy = AttributionPolicy()
    summed = _summed(window, index, policy)
    assert summed.holds(window, policy)
    shorter = NodeWindow(window.cluster, window.node_name, window.window_start_unix_ms, window.window_seconds,
                         window.samples[:-1])
    assert not summed.holds(shorter, policy)
    assert not summed.holds(window, AttributionPolicy(mps_compute=MpsCompute.THREADS))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_engine_closes_from_its_sums_exactly_what_it_closes_from_its_ticks(seed, monkeypatch):
    # Ticks of three nodes interleaved, some late or out of order, pods arriving and leaving as the ticks flow.
    rng = random.Random(seed)

    def run(summing: bool):
        engine = AttributionEngine(EngineConfig())
        if not summing:
            monkeypatch.setattr(engine, "_sum_tick", lambda *args: None)
        results = []
        for kind, item, now in inputs:
            if kind == "pod":
                engine.on_pod_event(item)
                continue
            try:
                output = engine.on_sample(item, now)
            except Exception as exc:  # out-of-range ticks are the caller's dead letters, alike both ways
                results.append(type(exc).__name__)
                continue
            results.extend(w.shares for w in output.windows)
        results.extend(w.shares for w in engine.flush().windows)
        return results

    inputs = []
    for node in ("node-a", "node-b", "node-c"):
        for i in range(4):
            ids = [("nvidia.com/gpu", [f"GPU-{node}::{i}"])]
            inputs.append(("pod", pod_event(f"{node}-pod-{i}", node=node, devices=ids,
                                            observed_at_unix_ms=START - 5_000 + rng.randrange(0, 90_000)), 0))
            if i == 3:
                inputs.append(("pod", pod_event(f"{node}-pod-{i}", node=node, devices=ids,
                                                event_type=PodEventType.DELETED, phase="Succeeded",
                                                resource_version="2",
                                                observed_at_unix_ms=START + rng.randrange(20_000, 140_000)), 0))
    for second in range(150):
        for node in ("node-a", "node-b", "node-c"):
            t = START + second * 1000 + rng.randrange(-3_000, 1_000)
            procs = [(i, rng.randrange(1, 20) * GIB, rng.choice([-1, 0, 5, 40])) for i in range(rng.randrange(0, 5))]
            sample = node_sample(t, [device(f"GPU-{node}", used=30 * GIB, util=rng.randrange(0, 101), replicas=4,
                                            procs=procs)],
                                 pod_uids=[f"{node}-pod-{i}" for i in range(4)], sequence=second, node=node)
            inputs.append(("sample", sample, t + 500))
    # Pod events arrive among the ticks: some before the ticks they concern, some after.
    events = [item for item in inputs if item[0] == "pod"]
    ticks = [item for item in inputs if item[0] == "sample"]
    for event in events:
        ticks.insert(rng.randrange(0, len(ticks)), event)
    inputs = ticks
    summed_results = run(True)
    assert summed_results and summed_results == run(False)


def _summed(window, live, policy, samples=None) -> OpenNodeWindow:
    """An ``OpenNodeWindow`` that took in ``samples`` (the window's, by default) against ``live`` as they came."""
    summed = OpenNodeWindow(WINDOW_S, policy)
    for sample in window.samples if samples is None else samples:
        summed.add(sample, live, live.generation)
    return summed


def _live_time_sliced():
    """The time-sliced window, the live index that knows its pods (each event a change), the default policy, and
    the window summed against that index."""
    window, _ = _time_sliced_window(60)
    live = LivePodIndex()
    for event in _time_sliced_pods():
        assert live.apply(event).changed
    policy = AttributionPolicy()
    return window, live, policy, _summed(window, live, policy)


def test_a_live_index_that_changed_after_the_ticks_is_checked_again(monkeypatch):
    # The engine's own index (``LivePodIndex``): while its generation stays, the holders found as the ticks arrived
    # are the close's; once an event changes it, the close checks them again.
    window, live, policy, summed = _live_time_sliced()
    count = _Counting(monkeypatch)
    assert attribute_node_window(window, live, policy, summed) == attribute_node_window(window, live, policy)
    assert (count.from_sums, count.from_ticks) == (1, 0)

    summed = _summed(window, live, policy)
    generation = live.generation
    assert live.apply(pod_event("pod-1", devices=[("nvidia.com/gpu", ["GPU-0::1"])],
                                event_type=PodEventType.DELETED, phase="Succeeded",
                                observed_at_unix_ms=START + 30_500, resource_version="2")).changed
    assert live.generation != generation
    assert attribute_node_window(window, live, policy, summed) == attribute_node_window(window, live, policy)
    assert (count.from_sums, count.from_ticks) == (1, 1)



def test_a_window_closed_early_hands_out_its_record_until_something_it_read_changes():
    # ``close_early`` (the engine calls it when a node's ticks move on to its next window) attributes the window in
    # its grace; its close hands that record out while every pod lookup it made would find the same pods, and
    # attributes the window again otherwise -- always the record a close from scratch gives.
    from services.attributor.attribution import node_window_record

    window, live, policy, summed = _live_time_sliced()
    summed.close_early(window, live)
    early = node_window_record(window, live, policy, summed)
    assert early is not None and early == node_window_record(window, live, policy)
    assert node_window_record(window, live, policy, summed) is early

    # A pod on another node: the index's generation moves, nothing this window read does.
    generation = live.generation
    assert live.apply(pod_event("elsewhere", node="node-z", devices=[("nvidia.com/gpu", ["GPU-9::0"])],
                                observed_at_unix_ms=START + 61_000)).changed
    assert live.generation != generation
    assert node_window_record(window, live, policy, summed) is early

    # A holder's label changes: the record must carry the new one.
    assert live.apply(pod_event("pod-1", devices=[("nvidia.com/gpu", ["GPU-0::1"])], labels={"team": "vision"},
                                event_type=PodEventType.MODIFIED, observed_at_unix_ms=START + 62_000,
                                resource_version="2")).changed
    again = node_window_record(window, live, policy, summed)
    assert again is not early and again == node_window_record(window, live, policy) and again != early

    # A pod whose process ran here but that the index did not know at the early close arrives before the close
    # (it holds no device id: only the rows' lookup of it by uid finds it).
    summed = _summed(window, live, policy)
    live_without = LivePodIndex()
    for event in _time_sliced_pods()[:2]:
        live_without.apply(event)
    summed.close_early(window, live_without)
    before = node_window_record(window, live_without, policy, summed)
    live_without.apply(pod_event("pod-2", observed_at_unix_ms=START - 20_000))
    after = node_window_record(window, live_without, policy, summed)
    assert after is not before and after == node_window_record(window, live_without, policy)


def test_a_holder_that_arrives_after_the_early_close_is_in_the_close_s_record(monkeypatch):
    # The early close reads each unit's holders from what its ticks were summed against (the index has not moved
    # since): that read is remembered like any other, so a pod that comes to hold the unit before the close --
    # with no process here, so no row of the early record looked it up by uid -- makes the close attribute again.
    from services.attributor.attribution import node_window_record

    window, live, policy, summed = _live_time_sliced()
    count = _Counting(monkeypatch)
    summed.close_early(window, live)
    assert (count.from_sums, count.from_ticks) == (1, 0)
    early = node_window_record(window, live, policy, summed)
    assert early is not None and early == node_window_record(window, live, policy)
    assert live.apply(pod_event("pod-3", devices=[("nvidia.com/gpu", ["GPU-0::3"])],
                                observed_at_unix_ms=START - 20_000)).changed
    again = node_window_record(window, live, policy, summed)
    assert again is not early and again == node_window_record(window, live, policy) and again != early
    assert "pod-3" in {pod.pod_uid for pod in again.pods}


def test_a_tick_taken_in_after_the_early_close_is_attributed_at_the_close():
    from services.attributor.attribution import node_window_record

    window, live, policy, _ = _live_time_sliced()
    summed = _summed(window, live, policy, window.samples[:-1])
    shorter = NodeWindow(window.cluster, window.node_name, window.window_start_unix_ms, window.window_seconds,
                         window.samples[:-1])
    summed.close_early(shorter, live)
    early = node_window_record(shorter, live, policy, summed)
    summed.add(window.samples[-1], live, live.generation)  # a tick of this window, still within its grace
    whole = node_window_record(window, live, policy, summed)
    assert whole is not early and whole == node_window_record(window, live, policy)


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_an_owners_rest_does_not_depend_on_the_order_pods_and_slots_came_in(order):
    # GPU-1 is exclusive (pod-owner holds its plain id) and three pods leak onto it: the owner pays 1 less what the
    # leakers pay (0.1, 0.2 and 0.3 of it), summed -- and a float sum depends on its order. The window summed as its
    # ticks arrive numbers the pods as the ticks list them; the close from ticks numbers each unit's holders first
    # (leak-c holds GPU-0, which comes first). The owner's rest must follow neither numbering (a hypothesis
    # example found it one ulp apart when it did).
    names = ["leak-a", "leak-b", "leak-c", "pod-owner"]
    uids = [names[i] for i in order]
    events = [pod_event("pod-owner", devices=[("nvidia.com/gpu", ["GPU-1"])], observed_at_unix_ms=START - 20_000),
              pod_event("leak-c", devices=[("nvidia.com/gpu", ["GPU-0"])], observed_at_unix_ms=START - 20_000)]
    events += [pod_event(n, observed_at_unix_ms=START - 20_000) for n in ("leak-a", "leak-b")]
    index = apply_pod_events(PodIndex.empty(), events)
    samples = []
    for seq in range(6):
        leaks = [(uids.index(n), 0, sm) for n, sm in (("leak-a", 10), ("leak-b", 20), ("leak-c", 30))]
        samples.append(node_sample(START + seq * 1000, [
            device("GPU-0", util=0, mode=SharingMode.EXCLUSIVE, index=0),
            device("GPU-1", util=60, mode=SharingMode.EXCLUSIVE, procs=leaks, index=1)],
            pod_uids=uids, sequence=seq))
    window = NodeWindow("c1", "node-a", START, WINDOW_S, tuple(samples))
    policy = AttributionPolicy.parse(cost_basis="compute")
    expected = attribute_node_window_detailed(window, index, policy)
    assert any(r.pod_uid == "pod-owner" and r.cost_share > 0 for r in expected.shares)
    assert attribute_node_window_detailed(window, index, policy, _summed(window, index, policy)) == expected
