"""The hand-written writers (``schemas.fastwrite``: NodeWindowShares, CostRecord, NodeWindowCost) write exactly
fastavro's bytes, and leave any value of another type than the schema's to the generic path."""

from __future__ import annotations

import dataclasses
import io
import math

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.codec import SchemaEncodeError
from schemas.examples import load_example_dicts
from schemas.fastwrite import write_long
from schemas.records import (
    CostRecord,
    CostSubjectKind,
    NodeWindowCost,
    NodeWindowShares,
    SharingMode,
    ShareSubjectKind,
    UnitShares,
    WindowPod,
)
from schemas.typed import RecordCodec, codec_for

HYPOTHESIS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
DOUBLES = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True)
LONGS = st.integers(-(1 << 63), (1 << 63) - 1)


def fastavro_bytes(codec: RecordCodec, record) -> bytes:
    """What the generic path writes: ``to_avro`` through fastavro, behind the single-object header."""
    buffer = io.BytesIO()
    buffer.write(codec.avro._header)
    fastavro.schemaless_writer(buffer, codec.avro.schema.parsed, record.to_avro())
    return buffer.getvalue()


COST_RECORDS = st.builds(
    CostRecord,
    cluster=TEXT, node_name=TEXT, window_start_unix_ms=LONGS, window_seconds=st.integers(-(1 << 31), (1 << 31) - 1),
    gpu_uuid=st.none() | TEXT, subject_kind=st.sampled_from(CostSubjectKind), pod_uid=st.none() | TEXT,
    namespace=st.none() | TEXT, pod_name=st.none() | TEXT, labels=st.dictionaries(TEXT, TEXT, max_size=4),
    cost_share=DOUBLES, cost_micro_usd=LONGS, instance_type=TEXT, price_model=TEXT, price_version=TEXT,
    carried_label_keys=st.lists(TEXT, max_size=3).map(tuple), shared_from=st.none() | st.sampled_from(CostSubjectKind),
    sharing_method=TEXT, method=TEXT, cost_basis=TEXT, memory_share=DOUBLES, compute_share=DOUBLES,
    gpu_fraction=DOUBLES,
)


def test_the_cost_record_codec_has_the_fast_writer():
    assert codec_for(CostRecord)._fast is not None


@HYPOTHESIS
@given(st.lists(COST_RECORDS, min_size=1, max_size=4))
def test_fast_cost_records_are_fastavro_s_bytes(records):
    codec = codec_for(CostRecord)
    # Several in a row: the writer's cache of the fields a node-window's lines share must follow each record.
    for record in records + records[:1]:
        assert codec._fast is not None
        assert codec.avro._header + codec._fast(record) == fastavro_bytes(codec, record)
        assert codec.decode(codec.encode(record)) == record or _has_nan(record)


def _has_nan(record: CostRecord) -> bool:
    return any(math.isnan(getattr(record, name)) for name in
               ("cost_share", "memory_share", "compute_share", "gpu_fraction"))


def test_the_example_cost_records_encode_to_the_same_bytes():
    codec = codec_for(CostRecord)
    examples = [CostRecord.from_avro(d) for d in load_example_dicts("CostRecord", 2)]
    assert examples
    for record in examples:
        assert codec.encode(record) == fastavro_bytes(codec, record)


@pytest.mark.parametrize("n", [0, 1, -1, 63, -64, 64, -65, 300, -(1 << 63), (1 << 63) - 1, 1_795_000_020_000])
def test_longs_are_zigzag_varints(n):
    buffer = io.BytesIO()
    fastavro.schemaless_writer(buffer, "long", n)
    assert write_long(n) == buffer.getvalue()


def test_values_of_other_types_take_the_generic_path():
    codec = codec_for(CostRecord)
    line = CostRecord(cluster="c", node_name="n", window_start_unix_ms=60_000, window_seconds=60, gpu_uuid="GPU-1",
                      subject_kind=CostSubjectKind.POD, pod_uid="p", namespace="ns", pod_name="pod",
                      labels={"team": "a"}, cost_share=1.0, cost_micro_usd=7, instance_type="i", price_model="m",
                      price_version="v")
    codec.encode(line)  # fills the writer's cache with this node-window
    # An int where the schema says double: fastavro writes it as a double; so does the generic path here.
    as_int = dataclasses.replace(line, cost_share=1)
    with pytest.raises(TypeError):
        codec._fast(as_int)
    assert codec.encode(as_int) == fastavro_bytes(codec, as_int) == codec.encode(line)
    # Whatever the generic path does with odd values (write them, or refuse them), encode does the same; a float
    # window length equal to the cached int one must not reuse the writer's cache.
    for odd in (dict(window_seconds=60.0), dict(window_start_unix_ms=60_000.0), dict(node_name=None),
                dict(cost_micro_usd=1 << 64), dict(labels={"team": 1}), dict(subject_kind="NOT_A_KIND")):
        record = dataclasses.replace(line, **odd)
        assert outcome(lambda: codec.encode(record)) == outcome(lambda: codec.avro.encode(record.to_avro())), odd


def outcome(encode):
    try:
        return encode()
    except SchemaEncodeError:
        return SchemaEncodeError


INTS = st.integers(-(1 << 31), (1 << 31) - 1)
WINDOW_PODS = st.builds(
    WindowPod, pod_uid=TEXT, namespace=st.none() | TEXT, pod_name=st.none() | TEXT,
    labels=st.dictionaries(TEXT, TEXT, max_size=3), carried_label_keys=st.lists(TEXT, max_size=2).map(tuple),
    workload_kind=st.none() | TEXT, workload_name=st.none() | TEXT, cpu_request_millicores=LONGS,
    memory_request_bytes=LONGS,
)


def tuples(items):
    return st.lists(items, max_size=6).map(tuple)


NODE_WINDOW_COSTS = st.builds(
    NodeWindowCost,
    cluster=TEXT, node_name=TEXT, window_start_unix_ms=LONGS, window_seconds=INTS, billed_milliseconds=LONGS,
    cloud_provider=TEXT, region=TEXT, zone=TEXT, provider_id=TEXT, instance_type=TEXT, price_model=TEXT,
    price_version=TEXT, price_per_hour_usd=TEXT, split_rule=TEXT, gpu_count=INTS, node_cost_micro_usd=LONGS,
    gpu_cost_micro_usd=LONGS, node_other_micro_usd=LONGS, sharing=TEXT, pods=tuples(WINDOW_PODS),
    unit_uuids=tuples(TEXT), line_unit_index=tuples(INTS), line_subject_kinds=tuples(st.sampled_from(CostSubjectKind)),
    line_pod_index=tuples(INTS), line_cost_share=tuples(DOUBLES), line_cost_micro_usd=tuples(LONGS),
    line_shared_from=tuples(st.none() | st.sampled_from(CostSubjectKind)), line_sharing_method=tuples(TEXT),
    line_method=tuples(TEXT), line_cost_basis=tuples(TEXT), line_memory_share=tuples(DOUBLES),
    line_compute_share=tuples(DOUBLES), line_gpu_fraction=tuples(DOUBLES),
)


def test_the_node_window_cost_codec_has_the_fast_writer():
    assert codec_for(NodeWindowCost)._fast is not None


@HYPOTHESIS
@given(NODE_WINDOW_COSTS)
def test_fast_node_window_costs_are_fastavro_s_bytes(record):
    codec = codec_for(NodeWindowCost)
    assert codec.avro._header + codec._fast(record) == fastavro_bytes(codec, record)


def test_the_example_node_window_costs_encode_to_the_same_bytes():
    codec = codec_for(NodeWindowCost)
    examples = [NodeWindowCost.from_avro(d) for d in load_example_dicts("NodeWindowCost", 1)]
    assert examples
    for record in examples:
        assert codec.encode(record) == fastavro_bytes(codec, record)
        assert codec.decode(codec.encode(record)) == record
        # Odd values: whatever the generic path does with them, encode does the same.
        for odd in (dict(line_cost_share=(1,) * len(record.line_cost_share)), dict(gpu_count=2.0),
                    dict(line_subject_kinds=("NOPE",)), dict(sharing=None)):
            changed = dataclasses.replace(record, **odd)
            assert outcome(lambda: codec.encode(changed)) == outcome(lambda: codec.avro.encode(changed.to_avro()))


UNIT_SHARES = st.integers(0, 5).flatmap(lambda n: st.builds(
    UnitShares, gpu_uuid=TEXT, parent_gpu_uuid=st.none() | TEXT, gpu_model=TEXT, gpu_fraction=DOUBLES,
    sharing_mode=st.sampled_from(SharingMode), method=TEXT, sample_count=INTS, covered_seconds=DOUBLES,
    subject_kinds=st.lists(st.sampled_from(ShareSubjectKind), min_size=n, max_size=n).map(tuple),
    subject_pod_index=st.lists(INTS, min_size=n, max_size=n).map(tuple),
    memory_used_bytes_avg=st.lists(DOUBLES, min_size=n, max_size=n).map(tuple),
    memory_share=st.lists(DOUBLES, min_size=n, max_size=n).map(tuple),
    compute_share=st.lists(DOUBLES, min_size=n, max_size=n).map(tuple),
    cost_share=st.lists(DOUBLES, min_size=n, max_size=n).map(tuple),
    mig_profile=st.none() | TEXT, mig_gpu_instance_id=st.none() | INTS,
))
NODE_WINDOW_SHARES = st.builds(
    NodeWindowShares,
    cluster=TEXT, node_name=TEXT, window_start_unix_ms=LONGS, window_seconds=INTS, node_covered_seconds=DOUBLES,
    cloud_provider=TEXT, region=TEXT, zone=TEXT, provider_id=TEXT, instance_type=TEXT, price_model=TEXT,
    cost_basis=TEXT, pods=tuples(WINDOW_PODS), units=tuples(UNIT_SHARES),
)


def test_the_node_window_shares_codec_has_the_fast_writer():
    assert codec_for(NodeWindowShares)._fast is not None


@HYPOTHESIS
@given(NODE_WINDOW_SHARES)
def test_fast_node_window_shares_are_fastavro_s_bytes(record):
    codec = codec_for(NodeWindowShares)
    assert codec.avro._header + codec._fast(record) == fastavro_bytes(codec, record)


def test_the_example_node_window_shares_encode_to_the_same_bytes():
    codec = codec_for(NodeWindowShares)
    examples = [NodeWindowShares.from_avro(d) for d in load_example_dicts("NodeWindowShares", 1)]
    assert examples
    for record in examples:
        assert codec.encode(record) == fastavro_bytes(codec, record)
        assert codec.decode(codec.encode(record)) == record
        unit = record.units[0]
        # Odd values: whatever the generic path does with them, encode does the same.
        for odd in (dict(units=(dataclasses.replace(unit, memory_share=(1,) * len(unit.memory_share)),)),
                    dict(units=(dataclasses.replace(unit, sharing_mode="NOPE"),)), dict(window_seconds=60.0),
                    dict(zone=None), dict(units=(dataclasses.replace(unit, mig_gpu_instance_id=1 << 40),))):
            changed = dataclasses.replace(record, **odd)
            assert outcome(lambda: codec.encode(changed)) == outcome(lambda: codec.avro.encode(changed.to_avro()))
