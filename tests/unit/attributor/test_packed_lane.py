"""The packed lane (``attribution._PackedLane``) sums whole-GPU ticks from their NodeSample v4 columns; the object
path sums the same ticks from ``GpuDeviceSample`` objects. Their records must be equal bit for bit: every shipped
scenario is attributed twice by the engine, once from decoded v4 messages (which take the lane wherever it can run)
and once from the same samples as plain ``NodeSample`` objects (which never do), under each cost basis."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pipeline.recordings import scenario_records
from schemas.records import NodeSample
from schemas.typed import codec_for
from services.attributor import attribution
from services.attributor.attribution import AttributionPolicy
from services.attributor.engine import AttributionEngine, EngineConfig
from simulator.scenario import load_scenario

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = sorted(p.stem for p in (REPO / "scenarios").glob("*.yaml"))
POLICIES = {
    "memory": AttributionPolicy(),
    "compute": AttributionPolicy.parse(cost_basis="compute"),
    "blend_mps_threads": AttributionPolicy.parse(cost_basis="blend", mps_compute="threads"),
}


def _plain(sample: NodeSample) -> NodeSample:
    return NodeSample(*[getattr(sample, f.name) for f in dataclasses.fields(NodeSample)])


def _attribute(records: list, policy: AttributionPolicy, packed: bool) -> list:
    engine = AttributionEngine(EngineConfig(policy=policy, max_sample_age_seconds=None))
    decode, encode = codec_for(NodeSample).decode, codec_for(NodeSample).encode
    out = []
    for position, record in enumerate(records):
        message = record.message
        if not isinstance(message, NodeSample):
            engine.on_pod_event(message)
            continue
        sample = decode(encode(message))
        output = engine.on_sample(sample if packed else _plain(sample), record.received_at_unix_ms, position)
        out.extend(w.record for w in output.windows)
        engine.record_emitted(output.windows)
        engine.take_table_changes()
    output = engine.flush()
    out.extend(w.record for w in output.windows)
    return out


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lane_and_object_path_give_identical_records(scenario: str, policy: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    records = list(scenario_records(load_scenario(REPO / "scenarios" / f"{scenario}.yaml")))
    taken = []
    take = attribution._PackedLane.take
    monkeypatch.setattr(attribution._PackedLane, "take", lambda lane, *a: (taken.append(1), take(lane, *a))[1])
    through_lane = _attribute(records, POLICIES[policy], packed=True)
    lane_ticks = len(taken)
    through_objects = _attribute(records, POLICIES[policy], packed=False)
    assert len(taken) == lane_ticks  # plain samples never take the lane
    assert through_lane == through_objects
    assert any(r is not None for r in through_lane)
    if scenario in ("two_nodes", "time_slicing", "exclusive", "churn", "faults", "demo"):
        assert lane_ticks > 0, "the lane never ran: nothing was compared"


def _randomized_ticks(seed: int, ticks: int) -> tuple[list, list]:
    """Pod events and ticks of two 4-GPU nodes whose figures take every branch of the per-tick sums: process
    memory and SM of -1 (no sample) and 0, processes of no known pod, device memory that includes the reserved
    part (v2) or processes that report more than the device uses, utilization missing / 0 / 100, no processes,
    per-process utilization unsupported, used memory beyond the unreserved capacity (clamped), intervals longer
    than the window, and a pod list that changes."""
    import random

    from bench.workload import Fleet

    rng = random.Random(seed)
    fleet = Fleet(2, gpus_per_node=4, pods_per_gpu=3)
    events = [e for node in range(2) for e in fleet.pod_events(node)]
    samples = []
    for tick in range(ticks):
        for node in range(2):
            sample = fleet.node_sample(node, tick)
            pods = len(sample.pod_uids)
            if tick % 23 >= 20:  # a stretch with a shorter pod list: the lane closes and opens again
                pods = pods - 1
                sample = dataclasses.replace(sample, pod_uids=sample.pod_uids[:pods])
            devices = []
            for dev in sample.devices:
                total = dev.memory_total_bytes
                reserved = rng.choice((0, 0, 512 << 20, 1 << 30))
                n = rng.choice((0, 1, 3, 3, 5))
                memory = tuple(rng.choice((-1, 0, 1 << 20, rng.randrange(1 << 30, 8 << 30))) for _ in range(n))
                used = max(sum(m for m in memory if m > 0) + rng.choice((0, 1 << 28, -(1 << 28))), 0)
                used = min(used + (reserved if rng.random() < 0.5 else 0), total)
                free = total - used if rng.random() < 0.7 else max(total - used - reserved, 0)
                if reserved and rng.random() < 0.1:  # more in use than the capacity outside the reserve
                    used, free = total - reserved // 2, 0
                devices.append(dataclasses.replace(
                    dev, memory_reserved_bytes=reserved, memory_used_bytes=used, memory_free_bytes=free,
                    gpu_utilization_percent=rng.choice((None, 0, 37, 100, rng.randrange(0, 101))),
                    process_utilization_supported=rng.random() < 0.8,
                    process_pids=tuple(range(100, 100 + n)),
                    process_pod_index=tuple(rng.randrange(-1, pods) for _ in range(n)),
                    process_used_memory_bytes=memory,
                    process_sm_utilization_percent=tuple(rng.choice((-1, 0, 5, 60, 100)) for _ in range(n)),
                ))
            interval = rng.choice((1000, 1000, 1000, 2500, 61_000)) if tick else 1000
            samples.append(dataclasses.replace(sample, devices=tuple(devices), interval_ms=interval))
    return events, samples


def _with_churn(records: list, events: list, seed: int) -> list:
    """``records`` with pod events among the ticks, as a live cluster has them: a label changed every few seconds
    (the pod index's generation moves, no unit's holders do) and one pod of each node deleted (its unit's holders
    change mid-window)."""
    import random

    from pipeline.recordings import InputRecord
    from schemas.records import PodEventType

    rng = random.Random(seed)
    out = []
    deleted: set[str] = set()
    for position, record in enumerate(records):
        out.append(record)
        if not isinstance(record.message, NodeSample) or position % 5:
            continue
        event = rng.choice(events)
        at = record.received_at_unix_ms
        if position > len(records) // 2 and event.node_name not in deleted:
            deleted.add(event.node_name)
            change = dataclasses.replace(event, event_type=PodEventType.DELETED, observed_at_unix_ms=at,
                                         resource_version=str(10_000 + position), phase="Succeeded")
        else:
            change = dataclasses.replace(event, event_type=PodEventType.MODIFIED, observed_at_unix_ms=at,
                                         resource_version=str(10_000 + position),
                                         labels={**event.labels, "churn": str(position)})
        out.append(InputRecord(at, change))
    return out


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_lane_equals_object_path_on_randomized_figures(seed: int, policy: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.recordings import InputRecord

    events, samples = _randomized_ticks(seed, 150)
    records = [InputRecord(samples[0].sampled_at_unix_ms, e) for e in events]
    records += [InputRecord(s.sampled_at_unix_ms + 500, s) for s in samples]
    records = _with_churn(records, events, seed)
    taken = []
    take = attribution._PackedLane.take
    monkeypatch.setattr(attribution._PackedLane, "take", lambda lane, *a: (taken.append(1), take(lane, *a))[1])
    through_lane = _attribute(records, POLICIES[policy], packed=True)
    assert len(taken) > len(samples) // 4, "the lane took too few ticks to compare anything"
    assert through_lane == _attribute(records, POLICIES[policy], packed=False)
    assert sum(r is not None for r in through_lane) >= 4


@pytest.mark.parametrize("seed", [4, 5])
def test_lane_units_carry_the_same_decisions_and_data_quality(seed: int) -> None:
    """Below the record: each unit's ``UnitAttribution`` (decision, method, coverage and the data-quality counts
    no record carries) is the same from the lane as from objects."""
    from services.attributor.attribution import OpenNodeWindow
    from services.attributor.pod_index import LivePodIndex
    from services.attributor.windows import NodeWindow

    events, samples = _randomized_ticks(seed, 60)
    pods = LivePodIndex()
    for event in events:
        pods.apply(event)
    node = samples[0].node_name
    decode, encode = codec_for(NodeSample).decode, codec_for(NodeSample).encode
    start = samples[0].sampled_at_unix_ms // 60_000 * 60_000
    ticks = [decode(encode(s)) for s in samples if s.node_name == node and s.sampled_at_unix_ms < start + 60_000]
    policy = AttributionPolicy.parse(cost_basis="blend")
    attributed = []
    for packed in (True, False):
        window = OpenNodeWindow(60, policy)
        for sample in ticks:
            window.add(sample if packed else _plain(sample), pods, pods.generation)
        node_window = NodeWindow(ticks[0].cluster, node, start, 60, tuple(window.samples))
        attributed.append(window.attribute_units(node_window, pods))
    assert len(attributed[0]) == 4
    assert attributed[0] == attributed[1]
    assert any(unit.quality != type(unit.quality)() for _, unit in attributed[0])


@pytest.mark.parametrize("chunk", [1, 4, 16, 32])
def test_the_lane_s_close_reads_its_last_devices_without_decoding_again(chunk: int,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each tick the lane takes lets its arrays go, except the newest, which the close reads its units' last devices
    from (rather than decoding its message again); after the close no tick holds its arrays."""
    from bench.workload import Fleet
    from schemas.packed import NodeSampleCodec
    from services.attributor.attribution import OpenNodeWindow
    from services.attributor.pod_index import LivePodIndex
    from services.attributor.windows import NodeWindow

    monkeypatch.setattr(attribution, "_LANE_CHUNK_TICKS", chunk)
    fleet = Fleet(1, 4, 3)
    pods = LivePodIndex()
    for event in fleet.pod_events(0):
        pods.apply(event)
    codec = codec_for(NodeSample)
    samples = [fleet.node_sample(0, tick) for tick in range(60)]
    start = samples[0].sampled_at_unix_ms // 60_000 * 60_000
    samples = [s for s in samples if s.sampled_at_unix_ms < start + 60_000]
    ticks = [codec.decode(codec.encode(s)) for s in samples]
    policy = AttributionPolicy()
    window = OpenNodeWindow(60, policy)
    for sample in ticks:
        window.add(sample, pods, pods.generation)
    assert window._lane is not None and len(ticks) > chunk + 2
    # A tick taken by the lane lets its arrays go at once (its figures wait in the chunk's columns), but for the
    # newest, whose devices the close reads.
    assert [t for t in ticks if t.packed is not None] == [ticks[-1]]

    def no_decode(self, data):
        raise AssertionError("a tick decoded again")

    monkeypatch.setattr(NodeSampleCodec, "decode_packed", no_decode)
    node_window = NodeWindow(ticks[0].cluster, ticks[0].node_name, start, 60, tuple(window.samples))
    attributed = window.attribute_units(node_window, pods)
    assert all(t.packed is None for t in ticks)
    assert {d.uuid: d for d, _ in attributed} == {d.uuid: d for d in ticks[-1].devices}
    plain = OpenNodeWindow(60, policy)
    for sample in samples:  # the same ticks as objects: the object path
        plain.add(sample, pods, pods.generation)
    assert attributed == plain.attribute_units(NodeWindow(ticks[0].cluster, ticks[0].node_name, start, 60,
                                                          tuple(plain.samples)), pods)
