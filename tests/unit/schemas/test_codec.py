"""The single-object codec: exact bytes, round trips, evolution, an independent decoder, and bad input."""

from __future__ import annotations

import io
import json
import struct
from dataclasses import fields

import avro.io
import avro.schema
import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumeter.errors import (
    CorruptMessage,
    InvalidMessage,
    SchemaEncodeError,
    TruncatedMessage,
    UnknownSchema,
    WrongRecordType,
)
from schemas.codec import AVRO_DIR, AvroCodec, SchemaRegistry, crc64_avro, default_registry, make_registered_schema
from schemas.examples import example_versions, load_example_dicts, load_examples
from schemas.packed import PACKED_VERSION
from schemas.records import RECORD_TYPES, NodeSample, PodEvent
from schemas.typed import RecordCodec, codec_for

RECORD_NAMES = [name.split(".")[1] for name in RECORD_TYPES]


def _versions(record_name: str) -> list[int]:
    return sorted(int(p.name[len(record_name) + 2:-len(".avsc")]) for p in AVRO_DIR.glob(f"{record_name}.v*.avsc"))


def _schema_file(record_name: str, version: int) -> dict:
    return json.loads((AVRO_DIR / f"{record_name}.v{version}.avsc").read_text())


def test_crc64_avro_matches_the_specification_vectors():
    # The empty input's fingerprint is the algorithm's initial value, and "null"'s is fixed by the spec's
    # reference implementation (Avro's Java SchemaNormalization.fingerprint64 of the schema "null").
    assert crc64_avro(b"") == 0xC15D213AA4D7A795
    assert crc64_avro(b'"null"') == 0x63DD24E7CC258F8A


def test_crc64_avro_matches_fastavro_and_the_apache_avro_package():
    for registered in default_registry():
        fastavro_hex = fastavro.schema.fingerprint(registered.canonical_form, "CRC-64-AVRO")
        # fastavro prints the fingerprint's little-endian bytes; the single-object header carries the same bytes.
        assert bytes.fromhex(fastavro_hex) == struct.pack("<Q", registered.fingerprint)
        apache = avro.schema.parse(registered.canonical_form)
        assert apache.fingerprint("CRC-64-AVRO") == struct.pack("<Q", registered.fingerprint)


def test_single_object_header_exact_bytes():
    schema = make_registered_schema(
        {"type": "record", "name": "Tiny", "namespace": "t", "fields": [{"name": "n", "type": "int"}]}, 1
    )
    codec = AvroCodec(SchemaRegistry([schema]), "t.Tiny")
    encoded = codec.encode({"n": 1})
    canonical = '{"name":"t.Tiny","type":"record","fields":[{"name":"n","type":"int"}]}'
    assert schema.canonical_form == canonical
    expected_fingerprint = struct.pack("<Q", crc64_avro(canonical.encode()))
    # C3 01, fingerprint little-endian, then the zig-zag varint of 1 (0x02).
    assert encoded == b"\xc3\x01" + expected_fingerprint + b"\x02"
    assert encoded.hex() == "c301" + expected_fingerprint.hex() + "02"


@pytest.mark.parametrize("record_name", RECORD_NAMES)
def test_every_record_type_round_trips_its_examples(record_name):
    record_type = RECORD_TYPES[f"gpumeter.{record_name}"]
    examples = load_examples(record_type)
    assert examples, "every record type ships example payloads"
    codec = codec_for(record_type)
    for record in examples:
        encoded = codec.encode(record)
        assert encoded[:2] == b"\xc3\x01"
        assert codec.decode(encoded) == record


# Versions that begin a new generation of their record: no Avro resolution reads an older version into them (a
# new shape, not added fields); their topic carries no older version and code converts between the two
# (NodeSample v4: packed columns, schemas/packed.py, tests/unit/schemas/test_packed.py).
GENERATION_STARTS = {"NodeSample": (PACKED_VERSION,)}


def _generation(record_name: str, version: int) -> int:
    return sum(1 for start in GENERATION_STARTS.get(record_name, ()) if version >= start)


@pytest.mark.parametrize("record_name", RECORD_NAMES)
def test_dataclass_fields_match_the_avsc_fields(record_name):
    """The typed record has exactly the fields of the newest version its from_avro speaks, in its order (NodeSample:
    v3; v4's typed layer, PackedNodeSample, is checked in test_packed.py)."""
    record_type = RECORD_TYPES[f"gpumeter.{record_name}"]
    schema = _schema_file(record_name, RecordCodec(record_type).avro.schema.version)
    assert [f.name for f in fields(record_type)] == [f["name"] for f in schema["fields"]]


@pytest.mark.parametrize("record_name", RECORD_NAMES)
def test_each_version_reads_every_version_before_it(record_name):
    """A reader of any version reads what every older version wrote: the fields it keeps resolve, the fields it
    adds have defaults, the fields it drops are skipped. (Whether an older reader reads a newer version is the
    topic's question: the next test.)"""
    versions = _versions(record_name)
    assert versions == list(range(1, len(versions) + 1))
    for newer in versions[1:]:
        for older in range(1, newer):
            reads = _reads(_schema_file(record_name, older), _schema_file(record_name, newer))
            if _generation(record_name, older) == _generation(record_name, newer):
                assert reads, (older, newer)
            else:  # a declared generation start really is one: else it would not need a topic of its own
                assert not reads, (older, newer)


def _all_topic_specs():
    from schemas.catalog import ALL_TOPICS, LEGACY_TOPICS

    return ALL_TOPICS + LEGACY_TOPICS


@pytest.mark.parametrize("spec", _all_topic_specs(), ids=lambda spec: spec.name)
def test_no_topic_carries_two_record_versions_that_do_not_read_each_other(spec):
    """Every reader of a topic reads every record on it: each pair of the versions the topic carries reads each
    other both ways, so a version that drops a field without a default, or adds an enum symbol to an enum without a
    default, must go to a new topic (``schemas/catalog.py``)."""
    name = spec.record_type.__name__
    assert set(spec.record_versions) <= set(_versions(name)), spec.record_versions
    for a in spec.record_versions:
        for b in spec.record_versions:
            assert _reads(_schema_file(name, a), _schema_file(name, b)), (spec.name, a, b)


def test_the_reads_rule_sees_a_dropped_field_and_an_added_symbol():
    """The checker itself, on the two changes that need a new topic."""
    v1 = _schema_file("NodeSample", 1)
    v3 = _schema_file("NodeSample", 3)
    assert _reads(v1, v3) and not _reads(v3, v1)  # a v1 reader needs container_ids, which v3 does not write
    old_enum = {"type": "enum", "name": "E", "symbols": ["A"]}
    new_enum = {"type": "enum", "name": "E", "symbols": ["A", "B"]}
    assert _reads(old_enum, new_enum) and not _reads(new_enum, old_enum)
    assert _reads(new_enum, {**old_enum, "default": "A"})


def _reads(writer, reader) -> bool:
    """Whether a reader of schema ``reader`` reads what ``writer`` wrote, by Avro's resolution rules (names
    matched, reader fields absent from the writer need defaults, writer fields absent from the reader are
    skipped, every writer enum symbol is the reader's or the reader's enum has a default; unions alike)."""
    if isinstance(writer, list) or isinstance(reader, list):
        writers = writer if isinstance(writer, list) else [writer]
        readers = reader if isinstance(reader, list) else [reader]
        return all(any(_reads(w, r) for r in readers) for w in writers)
    if isinstance(writer, str) or isinstance(reader, str):
        return writer == reader
    if writer.get("type") != reader.get("type"):
        return False
    kind = writer["type"]
    if kind == "record":
        written = {f["name"]: f for f in writer["fields"]}
        return writer["name"] == reader["name"] and all(
            _reads(written[f["name"]]["type"], f["type"]) if f["name"] in written else "default" in f
            for f in reader["fields"])
    if kind == "enum":
        return writer["name"] == reader["name"] and (
            set(writer["symbols"]) <= set(reader["symbols"]) or "default" in reader)
    if kind == "array":
        return _reads(writer["items"], reader["items"])
    if kind == "map":
        return _reads(writer["values"], reader["values"])
    return {k: v for k, v in writer.items() if k != "doc"} == {k: v for k, v in reader.items() if k != "doc"}


def _within(actual, example) -> bool:
    """``example`` is ``actual`` less the fields a newer reader added (recursively, in records and lists)."""
    if isinstance(example, dict) and isinstance(actual, dict):
        return all(k in actual and _within(actual[k], v) for k, v in example.items())
    if isinstance(example, list) and isinstance(actual, list):
        return len(example) == len(actual) and all(_within(a, e) for a, e in zip(actual, example))
    return actual == example


@pytest.mark.parametrize("record_name", RECORD_NAMES)
def test_the_examples_of_every_version_are_read_by_the_newest_reader(record_name):
    """A message written by any registered version decodes into today's typed record, new fields defaulted."""
    record_type = RECORD_TYPES[f"gpumeter.{record_name}"]
    newest = RecordCodec(record_type)
    newest_fields = {name for _record, name in _field_names(newest.avro.schema.schema_json)}
    for version in example_versions(record_name):
        if _generation(record_name, version) != _generation(record_name, newest.avro.schema.version):
            continue  # another generation: converted by code, tested with it (test_packed.py)
        writer = AvroCodec(default_registry(), f"gpumeter.{record_name}", version)
        for example in load_example_dicts(record_name, version):
            record = newest.decode(writer.encode(example))
            assert _within(record.to_avro(), _without(example, newest_fields))


def _field_names(schema):
    return ((record, field["name"]) for record, field in _all_fields(schema))


def _without(example, kept_names):
    """``example`` less the fields no version of the newest schema has (those a newer version dropped)."""
    if isinstance(example, dict):
        return {k: _without(v, kept_names) for k, v in example.items() if k in kept_names}
    if isinstance(example, list):
        return [_without(v, kept_names) for v in example]
    return example


def _all_fields(schema):
    if isinstance(schema, dict):
        if schema.get("type") == "record":
            for field in schema["fields"]:
                yield schema["name"], field
                yield from _all_fields(field["type"])
        elif schema.get("type") in ("array", "map"):
            yield from _all_fields(schema.get("items") or schema.get("values"))
    elif isinstance(schema, list):
        for branch in schema:
            yield from _all_fields(branch)


@pytest.mark.parametrize("record_name", RECORD_NAMES)
def test_every_field_has_a_doc(record_name):
    for version in _versions(record_name):
        schema = _schema_file(record_name, version)
        missing = [f"{record}.{field['name']}" for record, field in _all_fields(schema) if not field.get("doc")]
        assert missing == [], version


@pytest.mark.parametrize("record_name", RECORD_NAMES)
def test_the_apache_avro_package_decodes_our_body(record_name):
    """An independent Avro implementation reads what fastavro wrote after the 10-byte header."""
    registered = default_registry().get(f"gpumeter.{record_name}")
    apache_schema = avro.schema.parse(json.dumps(registered.schema_json))
    codec = AvroCodec(default_registry(), registered.full_name)
    for record in load_example_dicts(record_name, registered.version):
        encoded = codec.encode(record)
        decoder = avro.io.BinaryDecoder(io.BytesIO(encoded[10:]))
        decoded = avro.io.DatumReader(apache_schema).read(decoder)
        assert decoded == record


def _evolved(schema_json: dict) -> dict:
    evolved = json.loads(json.dumps(schema_json))
    evolved["fields"].append(
        {"name": "gpu_clock_mhz", "type": "int", "default": -1, "doc": "v2 test field with a default."}
    )
    return evolved


def _v1_v2_registry():
    v1 = default_registry().get("gpumeter.NodeSample", 1)
    v2 = make_registered_schema(_evolved(dict(v1.schema_json)), 2)
    return SchemaRegistry([v1, v2]), v1, v2


def test_v1_reader_reads_a_v2_message():
    registry, _v1, v2 = _v1_v2_registry()
    example = load_example_dicts("NodeSample", 1)[0]
    v2_bytes = AvroCodec(registry, "gpumeter.NodeSample", 2).encode({**example, "gpu_clock_mhz": 1980})
    assert v2_bytes[2:10] == struct.pack("<Q", v2.fingerprint)
    v1_record = RecordCodec(NodeSample, registry, version=1).decode(v2_bytes)
    assert v1_record == NodeSample.from_avro(example)


def test_v2_reader_reads_a_v1_message_with_the_default():
    registry, v1, _v2 = _v1_v2_registry()
    example = load_example_dicts("NodeSample", 1)[0]
    v1_bytes = AvroCodec(registry, "gpumeter.NodeSample", 1).encode(example)
    assert v1_bytes[2:10] == struct.pack("<Q", v1.fingerprint)
    decoded = AvroCodec(registry, "gpumeter.NodeSample", 2).decode(v1_bytes)
    assert decoded["gpu_clock_mhz"] == -1
    assert {k: v for k, v in decoded.items() if k != "gpu_clock_mhz"} == example


def test_unknown_fingerprint_is_a_typed_error():
    encoded = codec_for(PodEvent).encode(load_examples(PodEvent)[0])
    tampered = encoded[:2] + b"\x00" * 8 + encoded[10:]
    with pytest.raises(UnknownSchema) as info:
        codec_for(PodEvent).decode(tampered)
    assert info.value.reason_code == "UNKNOWN_SCHEMA"


def test_wrong_record_type_is_a_typed_error():
    encoded = codec_for(PodEvent).encode(load_examples(PodEvent)[0])
    with pytest.raises(WrongRecordType):
        codec_for(NodeSample).decode(encoded)


@pytest.mark.parametrize("cut", [0, 1, 2, 9, 10, 11, 50, -1])
def test_truncated_messages_are_typed_errors(cut):
    encoded = codec_for(NodeSample).encode(load_examples(NodeSample)[0])
    with pytest.raises(InvalidMessage) as info:
        codec_for(NodeSample).decode(encoded[:cut])
    assert isinstance(info.value, (TruncatedMessage, CorruptMessage))
    if cut >= 10 or cut == -1:
        assert isinstance(info.value, TruncatedMessage)


def test_trailing_bytes_are_corrupt():
    encoded = codec_for(PodEvent).encode(load_examples(PodEvent)[0])
    with pytest.raises(CorruptMessage):
        codec_for(PodEvent).decode(encoded + b"\x00")


def test_bad_magic_is_corrupt():
    encoded = codec_for(PodEvent).encode(load_examples(PodEvent)[0])
    with pytest.raises(CorruptMessage):
        codec_for(PodEvent).decode(b"\x00\x01" + encoded[2:])


def test_a_record_that_does_not_fit_its_schema_is_an_encode_error():
    with pytest.raises(SchemaEncodeError):
        AvroCodec(default_registry(), "gpumeter.PodEvent").encode({"event_type": "ADDED"})


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_never_escape_as_anything_but_invalid_message(data):
    for record_type in (NodeSample, PodEvent):
        try:
            codec_for(record_type).decode(data)
        except InvalidMessage:
            pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_bodies_with_a_valid_header_raise_invalid_message(data):
    encoded = bytearray(codec_for(NodeSample).encode(load_examples(NodeSample)[0]))
    flips = data.draw(st.lists(st.tuples(st.integers(10, len(encoded) - 1), st.integers(0, 255)), min_size=1, max_size=6))
    for position, value in flips:
        encoded[position] = value
    try:
        decoded = codec_for(NodeSample).decode(bytes(encoded))
    except InvalidMessage:
        return
    assert isinstance(decoded, NodeSample)
