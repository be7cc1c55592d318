"""The example payloads are what the real producers make, and what the real consumers read (one seam, both sides).

Each test fails when one side changes what it produces or assumes without the other: the MIG defect of issue 13
(the collector sent ``mig_total_compute_slices = 0`` on instances while the attributor's tests set 7 by hand, so
instances were priced by memory) could not have passed these.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from schemas.examples import load_example_dicts, load_examples
from schemas.records import (
    CostRecord,
    CostSubjectKind,
    GpuShare,
    NodeSample,
    NodeWindowCost,
    NodeWindowShares,
    ShareSubjectKind,
)
from services.billing.costing import gpu_fraction_exact
from gpumeter.validation import check_sample
from schemas.codec import AvroCodec, default_registry
from schemas.typed import RecordCodec, codec_for
from tests.unit.seam import chain

# The versions the collector, the attributor and billing write today.
SAMPLES = load_examples(NodeSample, 3)
SHARES = load_examples(GpuShare, 3)
COSTS = load_examples(CostRecord, 2)
COLLECTED_SAMPLES = SAMPLES[1:]


@pytest.mark.parametrize("spec,example", list(zip(chain.COLLECTED, COLLECTED_SAMPLES)), ids=lambda v: str(v)[:40])
def test_the_collector_produces_the_node_sample_examples(spec, example):
    produced = chain.collected_sample(*spec)
    assert produced.to_avro() == example.to_avro()


@pytest.mark.parametrize("example", COLLECTED_SAMPLES, ids=lambda s: s.node_name)
def test_every_collected_example_passes_the_consumers_range_checks(example):
    check_sample(example, example.sampled_at_unix_ms, 120_000)


@pytest.mark.parametrize("example", COLLECTED_SAMPLES, ids=lambda s: s.node_name)
def test_the_attributor_produces_the_share_examples_from_the_node_samples(example):
    expected = [s for s in SHARES if s.node_name == example.node_name]
    assert list(chain.attributed_shares(example)) == expected


def test_mig_instances_are_priced_by_their_slices_from_what_the_collector_sends():
    mig = next(s for s in COLLECTED_SAMPLES if any(d.parent_uuid for d in s.devices))
    parent = next(d for d in mig.devices if d.parent_uuid is None)
    instances = [d for d in mig.devices if d.parent_uuid is not None]
    # What NVML gives, carried on every instance: its compute slices and the GPU's total.
    assert {d.mig_total_compute_slices for d in instances} == {parent.mig_total_compute_slices} == {7}
    assert sorted(d.mig_compute_slices for d in instances) == [1, 1, 2, 3]
    shares = chain.attributed_shares(mig)
    fractions = {s.gpu_uuid: s.gpu_fraction for s in shares}
    for d in instances:
        assert gpu_fraction_exact(fractions[d.uuid]) == Fraction(d.mig_compute_slices, 7), d.mig_profile
    # Every slice is in an instance: no remainder unit of the parent is emitted, so nothing is billed to idle.
    assert parent.uuid not in fractions


def test_the_mps_server_holds_no_compute_of_its_own():
    mps = next(s for s in COLLECTED_SAMPLES if any(d.mps_server_pids for d in s.devices))
    device = mps.devices[0]
    (server,) = device.mps_server_pids
    server_pod = device.process_pod_index[device.process_pids.index(server)]
    assert server_pod == -1  # the server is a host process of no pod
    rows = {s.subject_kind: s for s in chain.attributed_shares(mps) if s.subject_kind is not ShareSubjectKind.POD}
    # The busy time is the clients': nothing of it is left to UNATTRIBUTED for the server process.
    assert rows[ShareSubjectKind.UNATTRIBUTED].compute_share == 0.0


def test_the_billing_produces_the_cost_examples_from_the_share_examples():
    expected = list(COSTS[1:])
    produced: list[CostRecord] = []
    for example in COLLECTED_SAMPLES:
        rows = tuple(s for s in SHARES if s.node_name == example.node_name)
        produced += chain.billed(rows).costs
    assert produced == expected


def test_a_lost_gpu_costs_unavailable_and_its_pods_nothing():
    faulty = next(s for s in COLLECTED_SAMPLES if any(d.unavailable for d in s.devices))
    lost = next(d for d in faulty.devices if d.unavailable)
    lines = [c for c in COSTS if c.node_name == faulty.node_name and c.gpu_uuid == lost.uuid]
    unavailable = [c for c in lines if c.subject_kind is CostSubjectKind.UNAVAILABLE]
    assert len(unavailable) == 1 and unavailable[0].cost_micro_usd > 0
    assert all(c.cost_micro_usd == 0 for c in lines if c.subject_kind is not CostSubjectKind.UNAVAILABLE)


@pytest.mark.parametrize("record_type", [NodeSample, GpuShare, CostRecord], ids=lambda t: t.__name__)
def test_what_v1_writers_wrote_reads_as_v2_with_the_defaults(record_type):
    name = f"gpumeter.{record_type.__name__}"
    for v1 in load_example_dicts(record_type.__name__, 1):
        v1_bytes = AvroCodec(default_registry(), name, 1).encode(v1)
        record = codec_for(record_type).decode(v1_bytes)
        # The newest version the record class speaks (NodeSample: v3; v4, packed, is in tests/unit/schemas/test_packed.py)
        assert record == record_type.from_avro(RecordCodec(record_type).avro.decode(v1_bytes))
        if record_type is NodeSample:
            assert (record.zone, record.provider_id) == ("", "")
            assert all(d.mps_server_pids == () for d in record.devices)
        elif record_type is GpuShare:
            assert (record.zone, record.provider_id) == ("", "")


WINDOW_SHARES = load_examples(NodeWindowShares)
WINDOW_COSTS = load_examples(NodeWindowCost)


@pytest.mark.parametrize("sample,example", list(zip(COLLECTED_SAMPLES, WINDOW_SHARES)), ids=lambda v: v.node_name)
def test_the_attributor_produces_the_node_window_examples_and_their_rows_are_the_share_examples(sample, example):
    assert chain.window_shares(sample) == example
    example.check_shape()
    # One content, two shapes: the node-window's rows are the flat share examples of its node.
    assert list(example.rows()) == [s for s in SHARES if s.node_name == example.node_name]
    assert NodeWindowShares.from_rows(example.rows()) == example


def test_billing_produces_the_node_window_cost_examples_and_their_lines_are_the_cost_examples():
    produced = [chain.window_cost(w) for w in WINDOW_SHARES]
    produced.append(chain.window_cost(WINDOW_SHARES[0], chain.SHARED_EXAMPLE_POLICY))
    assert produced == WINDOW_COSTS
    for cost in WINDOW_COSTS:
        cost.check_shape()
    flat = [c for cost in WINDOW_COSTS[:-1] for c in cost.cost_records()]
    assert flat == list(COSTS[1:])
    shared = WINDOW_COSTS[-1]
    assert any(kind is not None for kind in shared.line_shared_from)  # shared lines are on the wire
    assert sum(shared.line_cost_micro_usd) == shared.node_cost_micro_usd == WINDOW_COSTS[0].node_cost_micro_usd
