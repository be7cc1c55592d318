"""NodeSample v4 (packed columns): the typed layer against its .avsc, exact bytes, exact conversion to and from the
NodeSample objects (every shipped example, every scenario's samples, arbitrary samples), and bad input."""

from __future__ import annotations

import dataclasses
import json
import pickle
import struct
import typing
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumeter.errors import CorruptMessage, InvalidMessage, SchemaEncodeError
from pipeline.recordings import scenario_records
from schemas.codec import AVRO_DIR, MAGIC, AvroCodec, default_registry
from schemas.examples import example_versions, load_example_dicts, load_examples
from schemas.packed import (
    COLUMNS,
    MISSING_I4,
    MISSING_I8,
    NULLABLE_COLUMNS,
    SHARING_MODE_CODES,
    DecodedPackedNodeSample,
    NodeSampleCodec,
    PackedNodeSample,
)
from schemas.records import GpuDeviceSample, NodeSample, NvmlError, SharingMode
from schemas.typed import RecordCodec, codec_for
from simulator.scenario import load_scenario

REPO = Path(__file__).resolve().parents[3]
V3 = json.loads((AVRO_DIR / "NodeSample.v3.avsc").read_text())
V4 = json.loads((AVRO_DIR / "NodeSample.v4.avsc").read_text())
V3_DEVICE_FIELDS = [f["name"] for f in V3["fields"] if f["name"] == "devices"
                    for f in f["type"]["items"]["fields"]]


# -- one definition -------------------------------------------------------------------------------------------------


def test_the_typed_record_has_the_avsc_fields_in_order_with_matching_types():
    hints = typing.get_type_hints(PackedNodeSample)
    assert [f.name for f in fields(PackedNodeSample)] == [f["name"] for f in V4["fields"]]
    for f in V4["fields"]:
        kind = f["type"] if isinstance(f["type"], str) else f["type"]["type"]
        expected = {"bytes": np.ndarray, "string": str, "long": int, "int": int, "array": tuple}[kind]
        assert typing.get_origin(hints[f["name"]]) in (expected,) or hints[f["name"]] is expected, f["name"]


def test_every_bytes_field_doc_states_dtype_unit_and_length_rule():
    bytes_fields = [f for f in V4["fields"] if f["type"] == "bytes"]
    assert sorted(COLUMNS) == sorted(f["name"] for f in bytes_fields)
    for f in bytes_fields:
        column = COLUMNS[f["name"]]
        dtype = f["doc"].split(",")[0]
        assert np.dtype("V16" if dtype == "uuid16" else dtype) == column.dtype, f["name"]
        assert column.dtype.itemsize in (1, 2, 4, 8, 16) and column.unit and column.per, f["name"]
        assert f["doc"].startswith(f"{dtype}, {column.unit}, one per {column.per}."), f["name"]
        assert dtype == "uuid16" or dtype[0] == "<" or column.dtype.itemsize == 1, f"{f['name']}: little-endian"
    for name in NULLABLE_COLUMNS:
        sentinel = MISSING_I8 if COLUMNS[name].dtype.itemsize == 8 else MISSING_I4
        assert str(sentinel) in next(f["doc"] for f in V4["fields"] if f["name"] == name), name
    mode_doc = next(f["doc"] for f in V4["fields"] if f["name"] == "device_sharing_mode")
    assert ", ".join(m.value for m in SHARING_MODE_CODES) in mode_doc
    assert set(SHARING_MODE_CODES) == set(SharingMode)


def test_every_v3_field_has_its_v4_field():
    """Nothing NodeSample v3 says is lost: each top-level field keeps its name (pod_uids packed), each device
    field is a device column or list (the process fields per process), the per-device errors in device_errors."""
    v4_names = {f["name"] for f in V4["fields"]}
    assert {f["name"] for f in V3["fields"]} - {"devices"} <= v4_names
    renamed = {"uuid": "device_uuids", "errors": "device_errors", "process_pids": "process_pid",
               "mps_server_pids": "mps_server_pids",
               "process_utilization_supported": "device_process_utilization_supported"}
    for name in V3_DEVICE_FIELDS:
        v4_name = renamed.get(name) or (name if name.startswith("process_") else f"device_{name}")
        assert v4_name in v4_names, name


def test_the_nullable_columns_are_the_v3_nullable_device_figures():
    nullable = {f["name"] for f in V3["fields"][12]["type"]["items"]["fields"]
                if isinstance(f["type"], list) and f["type"][1] in ("int", "long")}
    assert set(NULLABLE_COLUMNS.values()) == nullable
    assert {f"device_{n}" for n in nullable} == set(NULLABLE_COLUMNS)


# -- exact bytes ----------------------------------------------------------------------------------------------------


def _long(n: int) -> bytes:
    zigzag = (n << 1) ^ (n >> 63)
    out = bytearray()
    while zigzag >= 0x80:
        out.append((zigzag & 0x7F) | 0x80)
        zigzag >>= 7
    out.append(zigzag)
    return bytes(out)


def _str(s: str) -> bytes:
    return _long(len(s.encode())) + s.encode()


def _blob(b: bytes) -> bytes:
    return _long(len(b)) + b


def _tiny_sample() -> NodeSample:
    device = GpuDeviceSample(
        "GPU-0", None, 0, "M", SharingMode.EXCLUSIVE, 1, None, None, None, 0, 0, 16, 8, 8, 0, 50, None, None, True,
        (), (7,), (0,), (8,), (30,), ())
    return NodeSample("c", "n", 1, 2, 3, 4, "aws", "r", "i", "p", ("00000000-0000-0000-0000-000000000001",), (),
                      (device,), "z", "")


def test_exact_bytes_of_a_one_process_tick():
    encoded = codec_for(NodeSample).encode(_tiny_sample())
    header = MAGIC + struct.pack("<Q", default_registry().get("gpumeter.NodeSample", 4).fingerprint)
    i4 = lambda *v: struct.pack(f"<{len(v)}i", *v)  # noqa: E731
    i8 = lambda *v: struct.pack(f"<{len(v)}q", *v)  # noqa: E731
    body = b"".join([
        _str("c"), _str("n"), _long(1), _long(2), _long(3), _long(4), _str("aws"), _str("r"), _str("i"), _str("p"),
        _str("z"), _str(""),
        _long(0),  # node_errors: empty array
        _blob(bytes(15) + b"\x01"), _blob(b""), _long(0),  # pod_uids, no text slots, no texts
        _long(1) + _str("GPU-0") + _long(0),  # device_uuids
        _long(1) + _str("M") + _long(0),  # device_texts
        _blob(b"\x00\x00"), _blob(b"\xff\xff"), _blob(b"\xff\xff"),  # model texts[0]; no parent, no MIG profile
        _blob(b"\x01"),  # device_sharing_mode: EXCLUSIVE
        _blob(i4(0)), _blob(i4(1)), _blob(i4(MISSING_I4)), _blob(i4(MISSING_I4)), _blob(i4(0)), _blob(i4(0)),
        _blob(i8(16)), _blob(i8(8)), _blob(i8(8)), _blob(i8(0)),
        _blob(i4(50)), _blob(i4(MISSING_I4)), _blob(i8(MISSING_I8)), _blob(b"\x01"),
        _blob(i4(1)), _blob(i4(0)),  # one process, no MPS server
        _long(0),  # device_errors
        _blob(i4(7)), _blob(i4(0)), _blob(i8(8)), _blob(i4(30)), _blob(b""),
    ])
    assert encoded == header + body
    assert codec_for(NodeSample).decode(encoded) == _tiny_sample()


# -- exact conversion -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [v for v in example_versions("NodeSample") if v < 4])
def test_every_shipped_example_round_trips_v3_v4_into_identical_objects(version):
    codec = codec_for(NodeSample)
    for example in load_example_dicts("NodeSample", version):
        written = AvroCodec(default_registry(), "gpumeter.NodeSample", version).encode(example)
        as_today = RecordCodec(NodeSample).decode(written)  # the v3 reader
        assert codec.decode(written) == as_today  # the old topic's records, read by the v4 codec
        assert codec.decode(codec.encode(as_today)) == as_today
        assert PackedNodeSample.from_node_sample(as_today).to_node_sample() == as_today


def test_the_v4_examples_are_the_v3_examples_packed():
    v3 = load_examples(NodeSample, 3)
    v4 = [PackedNodeSample.from_avro(d) for d in load_example_dicts("NodeSample", 4)]
    assert v4 == [PackedNodeSample.from_node_sample(s) for s in v3]
    assert [p.to_node_sample() for p in v4] == v3


@pytest.mark.parametrize("scenario", sorted(p.name for p in (REPO / "scenarios").glob("*.yaml")))
def test_every_scenario_sample_round_trips_into_an_identical_object(scenario):
    codec = codec_for(NodeSample)
    samples = [r.message for r in scenario_records(load_scenario(REPO / "scenarios" / scenario))
               if isinstance(r.message, NodeSample)]
    assert samples
    for sample in samples:
        v3_bytes = RecordCodec(NodeSample).encode(sample)
        assert codec.decode(codec.encode(sample)) == sample == codec.decode(v3_bytes)


_ints = st.integers(-(2**31) + 1, 2**31 - 1)
_longs = st.integers(-(2**63) + 1, 2**63 - 1)


@st.composite
def _devices(draw, pods: int):
    n = draw(st.integers(0, 4))
    nullable = st.none() | _ints
    return GpuDeviceSample(
        draw(st.text(max_size=8)), draw(st.none() | st.text(max_size=8)), draw(_ints), draw(st.text(max_size=8)),
        draw(st.sampled_from(list(SharingMode))), draw(_ints), draw(nullable), draw(nullable),
        draw(st.none() | st.text(max_size=5)), draw(_ints), draw(_ints), draw(_longs), draw(_longs), draw(_longs),
        draw(_longs), draw(nullable), draw(nullable), draw(st.none() | _longs), draw(st.booleans()),
        tuple(draw(st.lists(st.builds(NvmlError, st.text(max_size=5), st.text(max_size=5), st.text(max_size=5)),
                            max_size=2))),
        tuple(draw(st.lists(_ints, min_size=n, max_size=n))),
        tuple(draw(st.lists(st.integers(-1, max(pods - 1, -1)), min_size=n, max_size=n))),
        tuple(draw(st.lists(_longs, min_size=n, max_size=n))),
        tuple(draw(st.lists(_ints, min_size=n, max_size=n))),
        tuple(draw(st.lists(_ints, max_size=2))),
    )


@st.composite
def _samples(draw):
    uids = draw(st.lists(st.uuids().map(str) | st.text(max_size=12), max_size=5))
    return NodeSample(
        draw(st.text(max_size=5)), draw(st.text(max_size=5)), draw(_longs), draw(_longs), draw(_longs), draw(_ints),
        "aws", "r", "i", "p", tuple(uids),
        tuple(draw(st.lists(st.builds(NvmlError, st.text(max_size=5), st.text(max_size=5), st.text(max_size=5)),
                            max_size=2))),
        tuple(draw(st.lists(_devices(len(uids)), max_size=4))), draw(st.text(max_size=4)), draw(st.text(max_size=4)))


@given(_samples())
@settings(max_examples=150, deadline=None)
def test_any_sample_round_trips_exactly(sample):
    codec = codec_for(NodeSample)
    assert codec.decode(codec.encode(sample)) == sample
    assert codec.decode(RecordCodec(NodeSample).encode(sample)) == sample


def test_a_uid_not_in_canonical_form_keeps_its_slot_and_text():
    sample = dataclasses.replace(_tiny_sample(), pod_uids=("pod-uid-a", "0F6E4B2A-1C3D-4E5F-8A9B-0C1D2E3F4A5B",
                                                           "0f6e4b2a-1c3d-4e5f-8a9b-0c1d2e3f4a5b"))
    packed = PackedNodeSample.from_node_sample(sample)
    assert packed.pod_uid_text_slots.tolist() == [0, 1]
    assert packed.pod_uid_texts == ("pod-uid-a", "0F6E4B2A-1C3D-4E5F-8A9B-0C1D2E3F4A5B")
    assert codec_for(NodeSample).decode(codec_for(NodeSample).encode(sample)) == sample


def test_decoding_gives_read_only_arrays_of_the_column_dtypes():
    codec: NodeSampleCodec = codec_for(NodeSample)
    for sample in load_examples(NodeSample, 3):
        packed = codec.decode_packed(codec.encode(sample))
        for name, column in COLUMNS.items():
            array = getattr(packed, name)
            assert array.dtype == column.dtype and not array.flags.writeable, name
        assert packed.process_device.tolist() == [i for i, d in enumerate(sample.devices) for _ in d.process_pids]
        assert packed.process_used_memory_bytes.tolist() == [m for d in sample.devices
                                                             for m in d.process_used_memory_bytes]


@given(_samples())
@settings(max_examples=100, deadline=None)
def test_a_decoded_record_is_the_packed_record_with_the_message_bytes_as_its_columns(sample):
    codec: NodeSampleCodec = codec_for(NodeSample)
    built = PackedNodeSample.from_node_sample(sample)
    decoded = codec.decode_packed(codec.encode(sample))
    assert type(decoded) is DecodedPackedNodeSample
    for name in COLUMNS:
        raw = decoded.raw_columns[name]
        assert raw == decoded.column_bytes(name) == built.column_bytes(name) == built.raw_columns[name], name
        if name != "pod_uids":
            assert decoded.column_values(name) == built.column_values(name) == getattr(built, name).tolist(), name
        array = getattr(decoded, name)  # made on first read, over the message's bytes (no copy), then kept
        assert array.base is raw and getattr(decoded, name) is array and not array.flags.writeable, name
    assert decoded == built and built == decoded
    assert decoded.to_node_sample() == sample and decoded.device_samples() == built.device_samples()
    assert decoded.to_avro() == built.to_avro()
    unpickled = pickle.loads(pickle.dumps(decoded))
    assert type(unpickled) is PackedNodeSample and unpickled == built
    power = np.arange(len(built.device_uuids), dtype="<i8")
    replaced = dataclasses.replace(decoded, node_name="other", device_power_milliwatts=power)
    assert replaced == dataclasses.replace(built, node_name="other", device_power_milliwatts=power)
    assert replaced.raw_columns["device_power_milliwatts"] == power.tobytes()
    assert decoded == built  # the record replace started from is unchanged


def test_a_decoded_record_reads_the_same_on_a_big_endian_machine(monkeypatch):
    """Where ``memoryview.cast`` would read the columns in the machine's order (big-endian), the values come
    through numpy's little-endian dtypes: the same record, values and verdicts."""
    import schemas.packed as packed_module
    from gpumeter.validation import check_packed_sample

    def verdict(record: PackedNodeSample, now_ms: int) -> str | None:
        try:
            check_packed_sample(record, now_ms, 60_000)
        except InvalidMessage as exc:
            return str(exc)
        return None

    codec: NodeSampleCodec = codec_for(NodeSample)
    samples = load_examples(NodeSample, 3)
    assert any(d.process_pids for s in samples for d in s.devices)  # the per-process columns are read too
    little = [(codec.decode_packed(codec.encode(s)), s) for s in samples]
    verdicts = [verdict(record, s.sampled_at_unix_ms) for record, s in little]
    monkeypatch.setattr(packed_module, "_LITTLE_ENDIAN", False)
    for (expected, sample), expected_verdict in zip(little, verdicts):
        decoded = codec.decode_packed(codec.encode(sample))
        assert decoded == expected and decoded.to_node_sample() == sample
        for name in COLUMNS:
            if name != "pod_uids":
                assert decoded.column_values(name) == getattr(expected, name).tolist(), name
        assert verdict(decoded, sample.sampled_at_unix_ms) == expected_verdict


def test_from_avro_on_a_subclass_builds_that_subclass():
    class Tagged(PackedNodeSample):
        __slots__ = ()

    record = PackedNodeSample.from_node_sample(_tiny_sample()).to_avro()
    tagged = Tagged.from_avro(record)
    assert type(tagged) is Tagged and tagged == PackedNodeSample.from_avro(record)


# -- what v4 cannot carry, and bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("change", [
    {"gpu_utilization_percent": MISSING_I4},  # the missing sentinel
    {"power_milliwatts": MISSING_I8},
    {"process_pids": (2**31,), "process_pod_index": (0,), "process_used_memory_bytes": (1,),
     "process_sm_utilization_percent": (1,)},  # over int32, which v3's int field does not hold either
])
def test_a_figure_its_column_cannot_carry_is_an_encode_error(change):
    sample = _tiny_sample()
    sample = dataclasses.replace(sample, devices=(dataclasses.replace(sample.devices[0], **change),))
    with pytest.raises(SchemaEncodeError):
        codec_for(NodeSample).encode(sample)


@pytest.mark.parametrize("column", sorted(COLUMNS))
def test_a_column_breaking_its_length_rule_is_corrupt(column):
    codec = codec_for(NodeSample)
    record = PackedNodeSample.from_node_sample(_tiny_sample()).to_avro()
    itemsize = COLUMNS[column].dtype.itemsize
    if column != "pod_uids":  # a pod slot no process points at is a listed pod, not a broken rule
        with pytest.raises(CorruptMessage):
            codec.decode(codec.packed.encode({**record, column: record[column] + bytes(itemsize)}))
    record[column] = record[column] + b"\x00" if itemsize > 1 else record[column][:0] + b"\x00\x00\x00"
    with pytest.raises(CorruptMessage):
        codec.decode(codec.packed.encode(record))


def test_a_negative_count_or_a_stray_device_error_is_corrupt():
    codec = codec_for(NodeSample)
    base = PackedNodeSample.from_node_sample(_tiny_sample()).to_avro()
    for change in ({"device_process_count": struct.pack("<i", -1)},
                   {"device_errors": [{"device": 1, "nvml_function": "f", "error_code": "e", "message": "m"}]},
                   {"pod_uid_text_slots": struct.pack("<i", 1), "pod_uid_texts": ["x"]},
                   {"device_texts": []}, {"device_model": struct.pack("<h", -1)},
                   {"device_parent_uuid": struct.pack("<h", 1)}, {"device_mig_profile": struct.pack("<h", -2)}):
        with pytest.raises(CorruptMessage):
            codec.decode(codec.packed.encode({**base, **change}))


def test_a_v3_reader_does_not_read_v4():
    encoded = codec_for(NodeSample).encode(_tiny_sample())
    with pytest.raises(InvalidMessage):
        AvroCodec(default_registry(), "gpumeter.NodeSample", 3).decode(encoded)


@given(st.binary(max_size=300))
@settings(max_examples=200, deadline=None)
def test_arbitrary_bodies_after_a_v4_header_raise_only_invalid_message(body):
    codec = codec_for(NodeSample)
    try:
        decoded = codec.decode(codec.packed.schema.header + body)
    except InvalidMessage:
        return
    assert isinstance(decoded, NodeSample)


def test_device_texts_are_listed_once():
    mig = dataclasses.replace(_tiny_sample().devices[0], uuid="MIG-1", parent_uuid="GPU-0", mig_profile="1g.10gb",
                              mig_gpu_instance_id=1, mig_compute_instance_id=0, process_pids=(), process_pod_index=(),
                              process_used_memory_bytes=(), process_sm_utilization_percent=())
    sample = dataclasses.replace(_tiny_sample(), devices=(_tiny_sample().devices[0], mig))
    packed = PackedNodeSample.from_node_sample(sample)
    assert packed.device_texts == ("M", "GPU-0", "1g.10gb")
    assert packed.device_model.tolist() == [0, 0]
    assert packed.device_parent_uuid.tolist() == [-1, 1] and packed.device_mig_profile.tolist() == [-1, 2]
    assert codec_for(NodeSample).decode(codec_for(NodeSample).encode(sample)) == sample


# -- what ticks of one node share -----------------------------------------------------------------------------------


def _two_device_tick(sequence: int, counts: tuple[int, int], sm: tuple[int, ...]) -> NodeSample:
    """Two devices whose processes are cut ``counts`` from the same five pids, memory figures and pod slots."""
    pids, slots, memory = (101, 102, 103, 104, 105), (0, 1, 0, 1, 0), (10, 20, 30, 40, 50)
    cut = counts[0]
    devices = tuple(
        GpuDeviceSample(f"GPU-{d}", None, d, "M", SharingMode.TIME_SLICING, 4, None, None, None, 0, 0, 1000, 150,
                        850, 0, 60, None, None, True, (), pids[a:b], slots[a:b], memory[a:b], sm[a:b], ())
        for d, (a, b) in enumerate(((0, cut), (cut, 5))))
    return NodeSample("c", "n", sequence, 2, 1_000 * sequence, 1000, "aws", "r", "i", "p",
                      ("00000000-0000-0000-0000-000000000001", "00000000-0000-0000-0000-000000000002"), (), devices,
                      "z", "")


def test_ticks_of_one_node_share_what_they_repeat_and_keep_what_changes():
    codec = codec_for(NodeSample)
    first, second = (_two_device_tick(n, (2, 3), sm) for n, sm in ((1, (1, 2, 3, 4, 5)), (2, (5, 4, 3, 2, 1))))
    a, b = codec.decode(codec.encode(first)), codec.decode(codec.encode(second))
    assert (a, b) == (first, second)
    for dev_a, dev_b in zip(a.devices, b.devices):
        # One object per repeated value: what an open window holds per tick (bench: bytes per open tick).
        assert dev_a.process_pids is dev_b.process_pids
        assert dev_a.process_pod_index is dev_b.process_pod_index
        assert dev_a.process_used_memory_bytes is dev_b.process_used_memory_bytes
        assert dev_a.uuid is dev_b.uuid
        assert dev_a.process_sm_utilization_percent != dev_b.process_sm_utilization_percent
    assert a.node_name is b.node_name and a.pod_uids is b.pod_uids


def test_the_same_process_columns_cut_differently_per_device_decode_as_cut():
    # Same bytes in every process column, other per-device counts: a shared value keyed by the bytes alone would
    # hand the second tick the first tick's cut.
    codec = codec_for(NodeSample)
    two_three, four_one = _two_device_tick(1, (2, 3), (1, 2, 3, 4, 5)), _two_device_tick(2, (4, 1), (1, 2, 3, 4, 5))
    assert codec.decode(codec.encode(two_three)) == two_three
    decoded = codec.decode(codec.encode(four_one))
    assert decoded == four_one
    assert [d.process_pids for d in decoded.devices] == [(101, 102, 103, 104), (105,)]


def test_the_shared_values_are_bounded(monkeypatch):
    import schemas.packed as packed

    monkeypatch.setattr(packed, "_SEGMENTS_MAX", 8)
    codec = codec_for(NodeSample)
    for n in range(40):
        sample = _two_device_tick(n, (2, 3), (1, 2, 3, 4, 5))
        sample = dataclasses.replace(sample, node_name=f"n{n}", devices=tuple(
            dataclasses.replace(d, process_pids=tuple(p + 10 * n for p in d.process_pids)) for d in sample.devices))
        assert codec.decode(codec.encode(sample)) == sample
    assert len(packed._PID_SEGMENTS) <= 8 and len(packed._TEXT_TUPLES) <= 8
