"""The node-window records: exact bytes on the wire, the row and line views, and shapes that cannot be."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from schemas.codec import HEADER_BYTES
from schemas.examples import load_examples
from schemas.records import (
    CostRecord,
    CostSubjectKind,
    GpuShare,
    NodeWindowCost,
    NodeWindowShares,
    RecordShapeError,
    SharingMode,
    ShareSubjectKind,
    UnitShares,
    WindowPod,
)
from schemas.typed import codec_for


# Avro binary, written out by hand from the specification (not by fastavro): what the bytes must be.
def _long(n: int) -> bytes:
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n & ~0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _str(s: str) -> bytes:
    b = s.encode()
    return _long(len(b)) + b


def _double(x: float) -> bytes:
    return struct.pack("<d", x)


def _array(items: list[bytes]) -> bytes:
    return (_long(len(items)) + b"".join(items) + b"\x00") if items else b"\x00"


def _null() -> bytes:
    return _long(0)  # union branch 0: null


def _some(encoded: bytes) -> bytes:
    return _long(1) + encoded


POD = WindowPod("uid-1", "ml", "train-0", {"team": "vision"}, ("team",), "Job", "train", 4000, 2**34)
UNIT = UnitShares("GPU-a", None, "NVIDIA L4", 1.0, SharingMode.TIME_SLICING, "per_process_sm", 6, 60.0,
                  (ShareSubjectKind.POD, ShareSubjectKind.IDLE), (0, -1), (1.5e9, 0.0), (0.5, 0.25), (0.75, 0.25),
                  (0.5, 0.5))
SHARES = NodeWindowShares("c", "n1", 60_000, 60, 60.0, "aws", "us-east-1", "us-east-1a", "aws:///i-1", "g6.xlarge",
                          "on_demand", "memory", (POD,), (UNIT,))


def test_node_window_shares_has_these_exact_bytes():
    pod = (_str("uid-1") + _some(_str("ml")) + _some(_str("train-0")) + _long(1) + _str("team") + _str("vision")
           + b"\x00" + _array([_str("team")]) + _some(_str("Job")) + _some(_str("train")) + _long(4000)
           + _long(2**34))
    unit = (_str("GPU-a") + _null() + _str("NVIDIA L4") + _double(1.0) + _long(2) + _str("per_process_sm")
            + _long(6) + _double(60.0) + _array([_long(0), _long(1)]) + _array([_long(0), _long(-1)])
            + _array([_double(1.5e9), _double(0.0)]) + _array([_double(0.5), _double(0.25)])
            + _array([_double(0.75), _double(0.25)]) + _array([_double(0.5), _double(0.5)])
            + _null() + _null())  # a whole GPU: no MIG profile, no GPU instance id
    body = (_str("c") + _str("n1") + _long(60_000) + _long(60) + _double(60.0) + _str("aws") + _str("us-east-1")
            + _str("us-east-1a") + _str("aws:///i-1") + _str("g6.xlarge") + _str("on_demand") + _str("memory")
            + _array([pod]) + _array([unit]))
    encoded = codec_for(NodeWindowShares).encode(SHARES)
    assert encoded[:2] == b"\xc3\x01" and encoded[HEADER_BYTES:] == body
    assert codec_for(NodeWindowShares).decode(encoded) == SHARES


def test_a_mig_unit_carries_its_profile_and_gpu_instance_id_on_the_wire_and_in_its_rows():
    mig = dataclasses.replace(UNIT, gpu_uuid="MIG-b", parent_gpu_uuid="GPU-a", sharing_mode=SharingMode.MIG,
                              mig_profile="3g.40gb", mig_gpu_instance_id=2)
    shares = dataclasses.replace(SHARES, units=(mig,))
    encoded = codec_for(NodeWindowShares).encode(shares)
    assert encoded.endswith(_some(_str("3g.40gb")) + _some(_long(2)) + b"\x00")  # the last unit, then the array end
    assert codec_for(NodeWindowShares).decode(encoded) == shares
    rows = shares.rows()
    assert {(r.mig_profile, r.mig_gpu_instance_id) for r in rows} == {("3g.40gb", 2)}
    assert NodeWindowShares.from_rows(rows) == shares


def test_node_window_cost_has_these_exact_bytes():
    cost = NodeWindowCost(
        "c", "n1", 60_000, 60, 60_000, "aws", "us-east-1", "us-east-1a", "aws:///i-1", "g6.xlarge", "on_demand",
        "v1", "0.805", "marginal", 1, 13_417, 9_000, 4_417, "idle=weighted", (POD,), ("GPU-a",), (0, -1),
        (CostSubjectKind.POD, CostSubjectKind.NODE_OTHER), (0, -1), (1.0, 1.0), (9_000, 4_417),
        (None, None), ("", ""), ("per_process_sm", ""), ("memory", ""), (0.5, 0.0), (0.75, 0.0), (1.0, 0.0))
    cost.check_shape()
    pod = (_str("uid-1") + _some(_str("ml")) + _some(_str("train-0")) + _long(1) + _str("team") + _str("vision")
           + b"\x00" + _array([_str("team")]) + _some(_str("Job")) + _some(_str("train")) + _long(4000)
           + _long(2**34))
    body = (_str("c") + _str("n1") + _long(60_000) + _long(60) + _long(60_000) + _str("aws") + _str("us-east-1")
            + _str("us-east-1a") + _str("aws:///i-1") + _str("g6.xlarge") + _str("on_demand") + _str("v1")
            + _str("0.805") + _str("marginal") + _long(1) + _long(13_417) + _long(9_000) + _long(4_417)
            + _str("idle=weighted") + _array([pod]) + _array([_str("GPU-a")]) + _array([_long(0), _long(-1)])
            + _array([_long(0), _long(4)]) + _array([_long(0), _long(-1)]) + _array([_double(1.0), _double(1.0)])
            + _array([_long(9_000), _long(4_417)]) + _array([_null(), _null()]) + _array([_str(""), _str("")])
            + _array([_str("per_process_sm"), _str("")]) + _array([_str("memory"), _str("")])
            + _array([_double(0.5), _double(0.0)]) + _array([_double(0.75), _double(0.0)])
            + _array([_double(1.0), _double(0.0)]))
    encoded = codec_for(NodeWindowCost).encode(cost)
    assert encoded[HEADER_BYTES:] == body
    assert codec_for(NodeWindowCost).decode(encoded) == cost


def test_rows_carry_every_share_field_and_name_the_pod_once_for_all_its_rows():
    rows = SHARES.rows()
    assert [r.subject_kind for r in rows] == [ShareSubjectKind.POD, ShareSubjectKind.IDLE]
    pod_row, idle_row = rows
    assert (pod_row.pod_uid, pod_row.namespace, pod_row.labels, pod_row.workload_name, pod_row.cpu_request_millicores,
            pod_row.memory_request_bytes, pod_row.carried_label_keys) == (
        "uid-1", "ml", {"team": "vision"}, "train", 4000, 2**34, ("team",))
    assert (idle_row.pod_uid, idle_row.labels, idle_row.carried_label_keys, idle_row.cpu_request_millicores) == (
        None, {}, (), 0)
    assert {(r.units_in_node, r.rows_in_unit, r.zone, r.provider_id, r.cost_basis) for r in rows} == {
        (1, 2, "us-east-1a", "aws:///i-1", "memory")}
    assert NodeWindowShares.from_rows(rows) == SHARES


@pytest.mark.parametrize("breaks,match", [
    (lambda w: dataclasses.replace(w, units=(dataclasses.replace(UNIT, cost_share=(1.0,)),)), "cost_share has 1"),
    (lambda w: dataclasses.replace(w, units=(dataclasses.replace(UNIT, subject_pod_index=(1, -1)),)), "pod 1 of 1"),
    (lambda w: dataclasses.replace(w, units=(dataclasses.replace(UNIT, subject_pod_index=(0, 0)),)), "IDLE row"),
])
def test_a_shares_record_whose_arrays_do_not_line_up_is_a_shape_error(breaks, match):
    with pytest.raises(RecordShapeError, match=match):
        breaks(SHARES).check_shape()


def test_rows_of_two_node_windows_or_a_split_unit_or_a_pod_described_twice_are_no_node_window():
    rows = list(load_examples(NodeWindowShares)[0].rows())
    other = dataclasses.replace(rows[0], window_start_unix_ms=rows[0].window_start_unix_ms + 60_000)
    with pytest.raises(RecordShapeError, match="rows of"):
        NodeWindowShares.from_rows(rows + [other])
    first_unit = [r for r in rows if r.gpu_uuid == rows[0].gpu_uuid]
    rest = [r for r in rows if r.gpu_uuid != rows[0].gpu_uuid]
    with pytest.raises(RecordShapeError, match="not together"):
        NodeWindowShares.from_rows(first_unit[:1] + rest + first_unit[1:])
    pod_rows = [i for i, r in enumerate(rows) if r.subject_kind is ShareSubjectKind.POD]
    relabelled = list(rows)
    relabelled[pod_rows[-1]] = dataclasses.replace(rows[pod_rows[-1]], pod_uid=rows[pod_rows[0]].pod_uid,
                                                   pod_name="someone-else")
    with pytest.raises(RecordShapeError, match="two ways"):
        NodeWindowShares.from_rows(relabelled)
    with pytest.raises(RecordShapeError):
        NodeWindowShares.from_rows([])


def test_a_cost_record_whose_lines_do_not_add_up_or_line_up_is_a_shape_error():
    cost = load_examples(NodeWindowCost)[0]
    cost.check_shape()
    with pytest.raises(RecordShapeError, match="add up"):
        dataclasses.replace(cost, node_cost_micro_usd=cost.node_cost_micro_usd + 1).check_shape()
    with pytest.raises(RecordShapeError, match="line_method has"):
        dataclasses.replace(cost, line_method=cost.line_method[:-1]).check_shape()
    pods = [i for i, k in enumerate(cost.line_subject_kinds) if k is CostSubjectKind.POD]
    bad = list(cost.line_pod_index)
    bad[pods[0]] = len(cost.pods)
    with pytest.raises(RecordShapeError, match="POD line names pod"):
        dataclasses.replace(cost, line_pod_index=tuple(bad)).check_shape()


def test_cost_lines_round_trip_through_the_flat_records():
    for cost in load_examples(NodeWindowCost):
        records = cost.cost_records()
        assert all(isinstance(r, CostRecord) for r in records)
        assert sum(r.cost_micro_usd for r in records) == cost.node_cost_micro_usd
        again = NodeWindowCost.from_cost_records(
            records, billed_milliseconds=cost.billed_milliseconds, cloud_provider=cost.cloud_provider,
            region=cost.region, zone=cost.zone, provider_id=cost.provider_id,
            price_per_hour_usd=cost.price_per_hour_usd, split_rule=cost.split_rule, gpu_count=cost.gpu_count,
            gpu_cost_micro_usd=cost.gpu_cost_micro_usd, sharing=cost.sharing,
            pods={p.pod_uid: p for p in cost.pods})
        assert again == cost


def test_a_share_row_view_is_what_a_gpu_share_is():
    assert all(isinstance(r, GpuShare) for r in load_examples(NodeWindowShares)[0].rows())
