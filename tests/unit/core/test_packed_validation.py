"""The range and name checks on NodeSample v4 arrays (``check_packed_sample``) judge as ``check_sample`` does on
the objects: the same verdict, reason code and message for every bad sample of test_bad_input.py, every value
reported on purpose, and every scenario's samples; a good tick is judged without converting it to objects."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gpumeter.errors import InvalidMessage, SchemaEncodeError
from gpumeter.validation import check_packed_sample, check_sample
from pipeline.recordings import scenario_records
from schemas.packed import DecodedPackedNodeSample, PackedNodeSample
from schemas.records import NodeSample, NvmlError
from schemas.typed import codec_for
from simulator.scenario import load_scenario
from tests.unit.core.test_bad_input import DAY_MS, NAME_CASES, NOW_MS, POSSIBLE_SAMPLES, SAMPLE_CASES, SAMPLES, _dev
from tests.unit.attributor import GIB, device
from tests.unit.core.test_bad_input import _sample

REPO = Path(__file__).resolve().parents[3]
SKEW_MS = 120_000
MAX_AGE_MS = 7 * DAY_MS


@dataclasses.dataclass(frozen=True)
class _Clock:
    now_ms: int = NOW_MS


def _packed_forms(sample: NodeSample) -> list[PackedNodeSample]:
    """``sample``'s v4 record built from its objects, and as decoded from its message (the form the attributor and
    the guard judge: its columns are the message's bytes, its arrays made when read); the first alone where v4
    cannot carry the sample (no such message exists)."""
    built = PackedNodeSample.from_node_sample(sample)
    codec = codec_for(NodeSample)
    try:
        message = codec.encode(sample)
    except SchemaEncodeError:
        return [built]
    decoded = codec.decode_packed(message)
    assert type(decoded) is DecodedPackedNodeSample
    return [built, decoded]


def _verdict(check, sample, now_ms: int = NOW_MS):
    try:
        check(sample, now_ms, SKEW_MS, MAX_AGE_MS)
    except InvalidMessage as exc:
        return type(exc).__name__, exc.reason_code, str(exc)
    return None


EXTRA_CASES = [
    ("a process over its device's memory", lambda h: _sample(h, [_dev(process_used_memory_bytes=(200 * 2**30,))])),
    ("over the total of a device whose memory info failed", lambda h: _sample(h, [_dev(
        process_used_memory_bytes=(200 * 2**30,),
        errors=(NvmlError("nvmlDeviceGetMemoryInfo", "UNKNOWN", "x"),))])),
    ("an MPS server that is not among the processes", lambda h: _sample(h, [_dev(mps_server_pids=(99,))])),
    ("an MPS server among the processes", lambda h: _sample(h, [_dev(mps_server_pids=(_dev().process_pids[0],))])),
    ("the same pod uid twice", lambda h: dataclasses.replace(_sample(h), pod_uids=(
        "0f6e4b2a-1c3d-4e5f-8a9b-0c1d2e3f4a5b", "0f6e4b2a-1c3d-4e5f-8a9b-0c1d2e3f4a5b"))),
    ("negative power", lambda h: _sample(h, [_dev(power_milliwatts=-1)])),
    ("memory utilization under 0", lambda h: _sample(h, [_dev(memory_utilization_percent=-3)])),
    ("a negative pid", lambda h: _sample(h, [_dev(process_pids=(-4,))])),
]
CASES = SAMPLE_CASES + NAME_CASES[SAMPLES] + POSSIBLE_SAMPLES + EXTRA_CASES


@pytest.mark.parametrize("build", [b for _, b in CASES], ids=[n for n, _ in CASES])
def test_the_arrays_are_judged_as_the_objects_are(build):
    sample = build(_Clock())
    expected = _verdict(check_sample, sample)
    for packed in _packed_forms(sample):
        assert _verdict(check_packed_sample, packed) == expected, type(packed).__name__


def test_every_case_reaches_the_check_as_a_decoded_record_too():
    """The comparison above judges the decoded form of every case: each is a message v4 carries."""
    assert all(len(_packed_forms(build(_Clock()))) == 2 for _, build in CASES)


def test_the_bad_cases_are_bad_and_the_possible_ones_possible():
    """The comparison above is not between two checks that accept everything."""
    assert all(_verdict(check_sample, b(_Clock())) is not None for _, b in SAMPLE_CASES + NAME_CASES[SAMPLES])
    assert all(_verdict(check_sample, b(_Clock())) is None for _, b in POSSIBLE_SAMPLES)


@pytest.mark.parametrize("scenario", ["two_nodes.yaml", "mig_mixed.yaml", "mps.yaml", "faults.yaml"])
def test_every_scenario_sample_is_judged_alike(scenario):
    records = [r for r in scenario_records(load_scenario(REPO / "scenarios" / scenario))
               if isinstance(r.message, NodeSample)]
    for record in records:
        now_ms = record.received_at_unix_ms
        expected = _verdict(check_sample, record.message, now_ms)
        for packed in _packed_forms(record.message):
            assert _verdict(check_packed_sample, packed, now_ms) == expected


def test_a_good_tick_is_judged_on_its_arrays(monkeypatch):
    sample = dataclasses.replace(_sample(_Clock()), pod_uids=("0f6e4b2a-1c3d-4e5f-8a9b-0c1d2e3f4a5b",))
    packed = PackedNodeSample.from_node_sample(sample)
    assert packed.pod_uid_texts == ()
    check_packed_sample(packed, NOW_MS, SKEW_MS, MAX_AGE_MS)  # its names, once

    def no_objects(self):
        raise AssertionError("converted to objects")

    monkeypatch.setattr(PackedNodeSample, "to_node_sample", no_objects)
    check_packed_sample(packed, NOW_MS, SKEW_MS, MAX_AGE_MS)


_UIDS = ("0f6e4b2a-1c3d-4e5f-8a9b-0c1d2e3f4a5b", "1f6e4b2a-1c3d-4e5f-8a9b-0c1d2e3f4a5b")


def _gpus(**changes_of_third) -> NodeSample:
    """Four whole GPUs of two sizes (80 GiB, then 24 GiB from the third) with canonical pod uids: a tick judged on
    its arrays; ``changes_of_third`` change the third (24 GiB) GPU."""
    devices = []
    for i in range(4):
        total = 80 * GIB if i < 2 else 24 * GIB
        dev = device(f"GPU-{i}", total=total, used=10 * GIB, util=40, index=i,
                     procs=[(0, 3 * GIB, 20), (1, 2 * GIB, 10)])
        devices.append(dataclasses.replace(dev, process_pids=(100 + i, 200 + i)))
    if changes_of_third:
        devices[2] = dataclasses.replace(devices[2], **changes_of_third)
    return dataclasses.replace(_sample(_Clock(), devices), pod_uids=_UIDS)


TICK_TO_TICK_CASES = [
    ("a good tick again", {}),
    ("used above the 24 GiB GPU's total (below the 80 GiB one's)", {"memory_used_bytes": 30 * GIB}),
    ("free above the 24 GiB GPU's total", {"memory_free_bytes": 30 * GIB}),
    ("negative free memory", {"memory_free_bytes": -1}),
    ("utilization unknown", {"gpu_utilization_percent": None}),
    ("memory utilization over 100 %", {"memory_utilization_percent": 101}),
    ("power unknown", {"power_milliwatts": None}),
    ("negative power", {"power_milliwatts": -5}),
    ("a process over the 24 GiB GPU (its memory seen before under 80 GiB)",
     {"process_used_memory_bytes": (30 * GIB, 2 * GIB)}),
    ("SM utilization under -1", {"process_sm_utilization_percent": (-2, 10)}),
    ("reserved above total", {"memory_reserved_bytes": 25 * GIB}),
    ("no replica", {"replicas": 0}),
]


@pytest.mark.parametrize("changes", [c for _, c in TICK_TO_TICK_CASES], ids=[n for n, _ in TICK_TO_TICK_CASES])
def test_what_moves_tick_to_tick_is_judged_every_tick(changes):
    """What the array checks remember of a node's earlier ticks (its devices' totals, its processes' memory)
    never lets a later tick's new values through: each tick after good ones is judged as ``check_sample`` judges
    it, on its arrays where it is good."""
    good = PackedNodeSample.from_node_sample(_gpus())
    over_80 = _gpus(process_used_memory_bytes=(30 * GIB, 2 * GIB))
    over_80 = dataclasses.replace(over_80, devices=tuple(
        dataclasses.replace(d, memory_total_bytes=80 * GIB, memory_free_bytes=70 * GIB) for d in over_80.devices))
    for seen in (good, PackedNodeSample.from_node_sample(over_80)):
        assert _verdict(check_packed_sample, seen) is None  # remembered
    sample = _gpus(**changes)
    forms = _packed_forms(sample)
    assert len(forms) == 2  # every case here is one v4 carries
    for packed in forms:
        assert _verdict(check_packed_sample, packed) == _verdict(check_sample, sample), type(packed).__name__


def test_the_tick_to_tick_cases_are_bad_and_good_as_named():
    verdicts = {name: _verdict(check_sample, _gpus(**changes)) for name, changes in TICK_TO_TICK_CASES}
    good = {"a good tick again", "utilization unknown", "power unknown"}
    assert {name for name, verdict in verdicts.items() if verdict is None} == good


NAME_ENGINE_CASES = [
    ("a pod uid with a newline", {"pod_uids": ("pod-a\nINFO all clear",)}),
    ("a pod uid with HTML", {"pod_uids": ("<b>pod</b>",)}),
    ("a node name with ANSI", {"node_name": "gpu-node-a\x1b[2J"}),
    ("a GPU uuid with HTML", {"devices": (_dev(uuid="<i>GPU-0</i>"),)}),
]


@pytest.mark.parametrize("changes", [c for _, c in NAME_ENGINE_CASES], ids=[n for n, _ in NAME_ENGINE_CASES])
def test_the_engine_refuses_a_decoded_tick_s_bad_names_as_check_sample_does(changes):
    """The engine checks a v4 tick's names on its record (``check_packed_sample_names``, handed the pod uids the
    decoded sample carries): the same ``InvalidName`` as ``check_sample`` on the objects, after good ticks of the
    same node."""
    from schemas.records import NodeSample as _NodeSample
    from schemas.typed import codec_for
    from services.attributor.engine import AttributionEngine, EngineConfig

    codec = codec_for(_NodeSample)
    engine = AttributionEngine(EngineConfig())
    good = _sample(_Clock())
    engine.on_sample(codec.decode(codec.encode(good)), NOW_MS)
    bad = dataclasses.replace(good, sequence=8, **changes)
    expected = _verdict(check_sample, bad)
    assert expected is not None and expected[1] == "INVALID_NAME"
    decoded = codec.decode(codec.encode(bad))
    assert decoded.packed is not None
    assert _verdict(lambda s, now, *_: engine.on_sample(s, now), decoded) == expected
