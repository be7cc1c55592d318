"""The range and name checks on NodeSample v4 arrays (``check_packed_sample``) judge as ``check_sample`` does on
the objects: the same verdict, reason code and message for every bad sample of test_bad_input.py, every value
reported on purpose, and every scenario's samples; a good tick is judged without converting it to objects."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gpumeter.errors import InvalidMessage
from gpumeter.validation import check_packed_sample, check_sample
from pipeline.recordings import scenario_records
from schemas.packed import PackedNodeSample
from schemas.records import NodeSample, NvmlError
from simulator.scenario import load_scenario
from tests.unit.core.test_bad_input import DAY_MS, NAME_CASES, NOW_MS, POSSIBLE_SAMPLES, SAMPLE_CASES, SAMPLES, _dev
from tests.unit.core.test_bad_input import _sample

REPO = Path(__file__).resolve().parents[3]
SKEW_MS = 120_000
MAX_AGE_MS = 7 * DAY_MS


@dataclasses.dataclass(frozen=True)
class _Clock:
    now_ms: int = NOW_MS


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
    assert _verdict(check_packed_sample, PackedNodeSample.from_node_sample(sample)) == expected


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
        packed = PackedNodeSample.from_node_sample(record.message)
        assert _verdict(check_packed_sample, packed, now_ms) == _verdict(check_sample, record.message, now_ms)


def test_a_good_tick_is_judged_on_its_arrays(monkeypatch):
    sample = dataclasses.replace(_sample(_Clock()), pod_uids=("0f6e4b2a-1c3d-4e5f-8a9b-0c1d2e3f4a5b",))
    packed = PackedNodeSample.from_node_sample(sample)
    assert packed.pod_uid_texts == ()
    check_packed_sample(packed, NOW_MS, SKEW_MS, MAX_AGE_MS)  # its names, once

    def no_objects(self):
        raise AssertionError("converted to objects")

    monkeypatch.setattr(PackedNodeSample, "to_node_sample", no_objects)
    check_packed_sample(packed, NOW_MS, SKEW_MS, MAX_AGE_MS)
