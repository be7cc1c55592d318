"""Hand-written Avro writers of the records written for every node-window: the attributor's ``NodeWindowShares``,
billing's ~97 ``CostRecord`` lines and its ``NodeWindowCost``.

``fast_writer(full_name, version, schema_json)`` returns a function ``record -> body bytes`` (the Avro binary body,
without the single-object header) for a record type and schema version listed here, or None. The bytes are
exactly fastavro's ``schemaless_writer`` output for the same record (Avro binary encoding: zig-zag varint longs,
length-prefixed UTF-8 strings, union branch indexes, enum symbol indexes, maps and arrays as one block then 0,
little-endian doubles); ``tests/unit/schemas/test_fastwrite.py`` pins them to fastavro's. The writer skips
``to_avro`` and fastavro's per-call schema dispatch.

Contract: the writer raises on any value that is not of the schema's plain Python type (a long that is not an
``int`` or out of range, a string that is not a ``str``, an enum value outside the symbols, ...); the caller
(``schemas.typed.RecordCodec``) then encodes the record through the generic path, so that whatever fastavro does
with such a value (encode it or raise ``SchemaEncodeError``) is still what happens.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Mapping

_pack_double = struct.Struct("<d").pack
_LONG_MIN = -(1 << 63)
_LONG_MAX = (1 << 63) - 1
_INT_MIN = -(1 << 31)
_INT_MAX = (1 << 31) - 1
# Zig-zag varints of -64..63: one byte each, the most common lengths and counts.
_SMALL = {n: bytes(((n << 1) ^ (n >> 63),)) for n in range(-64, 64)}


def write_long(n: int) -> bytes:
    """Avro ``long``: zig-zag, then base-128 varint, least significant group first."""
    small = _SMALL.get(n) if type(n) is int else None
    if small is not None:
        return small
    if type(n) is not int and type(n) is not bool:
        raise TypeError(f"a long must be an int, not {type(n).__name__}")
    if not _LONG_MIN <= n <= _LONG_MAX:
        raise OverflowError(f"{n} does not fit a long")
    z = ((n << 1) ^ (n >> 63)) & 0xFFFF_FFFF_FFFF_FFFF
    out = bytearray()
    while z > 0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def write_int(n: int) -> bytes:
    if type(n) is int and not _INT_MIN <= n <= _INT_MAX:
        raise OverflowError(f"{n} does not fit an int")
    return write_long(n)


_STRINGS: dict[str, bytes] = {}
_STRINGS_BOUND = 8192  # node, GPU, pod names and labels of a few node-windows; cleared when full


def write_string(text: str) -> bytes:
    """Avro ``string``: the UTF-8 length, then the bytes. Repeated strings (a node-window's GPUs, namespaces,
    label keys) come from a bounded cache."""
    if type(text) is not str:
        raise TypeError(f"a string must be a str, not {type(text).__name__}")
    written = _STRINGS.get(text)
    if written is None:
        data = text.encode("utf-8")
        written = write_long(len(data)) + data
        if len(_STRINGS) >= _STRINGS_BOUND:
            _STRINGS.clear()
        _STRINGS[text] = written
    return written


def write_optional_string(text: str | None) -> bytes:
    """``["null", "string"]``."""
    return b"\x00" if text is None else b"\x02" + write_string(text)


def write_double(value: float) -> bytes:
    if type(value) is not float:
        raise TypeError(f"a double must be a float, not {type(value).__name__}")
    return _pack_double(value)


def write_string_map(values: Mapping[str, str]) -> bytes:
    """``{"type": "map", "values": "string"}``: one block of every entry (in iteration order), then 0."""
    if not values:
        return b"\x00"
    parts = [write_long(len(values))]
    for key, value in values.items():
        parts.append(write_string(key))
        parts.append(write_string(value))
    parts.append(b"\x00")
    return b"".join(parts)


def write_string_array(items: Any) -> bytes:
    if not items:
        return b"\x00"
    return b"".join([write_long(len(items)), *map(write_string, items), b"\x00"])


def _symbols(avro_type: Mapping[str, Any]) -> dict[str, bytes]:
    """An enum type's symbols -> their index as an Avro long."""
    return {symbol: write_long(i) for i, symbol in enumerate(avro_type["symbols"])}


def _enum_indexes(schema_json: Mapping[str, Any], field: str) -> dict[str, bytes]:
    for f in schema_json["fields"]:
        if f["name"] == field:
            return _symbols(f["type"])
    raise KeyError(field)


# -- CostRecord v2 ---------------------------------------------------------------------------------------------

_COST_RECORD_V2_FIELDS = (
    ("cluster", "string"), ("node_name", "string"), ("window_start_unix_ms", "long"), ("window_seconds", "int"),
    ("gpu_uuid", ["null", "string"]), ("subject_kind", "CostSubjectKind"), ("pod_uid", ["null", "string"]),
    ("namespace", ["null", "string"]), ("pod_name", ["null", "string"]), ("labels", "map<string>"),
    ("cost_share", "double"), ("cost_micro_usd", "long"), ("instance_type", "string"), ("price_model", "string"),
    ("price_version", "string"), ("carried_label_keys", "array<string>"),
    ("shared_from", ["null", "CostSubjectKind"]), ("sharing_method", "string"), ("method", "string"),
    ("cost_basis", "string"), ("memory_share", "double"), ("compute_share", "double"), ("gpu_fraction", "double"),
)


def _shape(avro_type: Any) -> Any:
    """A field's type written as in ``_COST_RECORD_V2_FIELDS`` (named types by name, maps and arrays of strings)."""
    if isinstance(avro_type, list):
        return [_shape(t) for t in avro_type]
    if isinstance(avro_type, dict):
        kind = avro_type["type"]
        if kind in ("map", "array") and avro_type.get("values", avro_type.get("items")) == "string":
            return f"{kind}<string>"
        return avro_type.get("name", kind)
    return avro_type.rsplit(".", 1)[-1]


def _cost_record_v2(schema_json: Mapping[str, Any]) -> Callable[[Any], bytes] | None:
    if tuple((f["name"], _shape(f["type"])) for f in schema_json["fields"]) != _COST_RECORD_V2_FIELDS:
        return None
    kinds = _enum_indexes(schema_json, "subject_kind")
    shared = {symbol: b"\x02" + index for symbol, index in kinds.items()}
    # The fields every line of one node-window shares, encoded once per run of equal values. One (key, bytes)
    # tuple, replaced whole: the codec is shared, and a thread sees one pair or the other, never a mix.
    head_cache: list[tuple[Any, bytes]] = [((), b"")]
    price_cache: list[tuple[Any, bytes]] = [((), b"")]

    def write(record: Any) -> bytes:
        head_key = (record.cluster, record.node_name, record.window_start_unix_ms, record.window_seconds)
        if type(head_key[2]) is not int or type(head_key[3]) is not int:  # 60.0 == 60 would hit the cache
            raise TypeError("window_start_unix_ms and window_seconds must be ints")
        cached_key, head = head_cache[0]
        if head_key != cached_key:
            head = (write_string(head_key[0]) + write_string(head_key[1]) + write_long(head_key[2])
                    + write_int(head_key[3]))
            head_cache[0] = (head_key, head)
        price_key = (record.instance_type, record.price_model, record.price_version)
        cached_key, price = price_cache[0]
        if price_key != cached_key:
            price = write_string(price_key[0]) + write_string(price_key[1]) + write_string(price_key[2])
            price_cache[0] = (price_key, price)
        shared_from = record.shared_from
        return b"".join((
            head,
            write_optional_string(record.gpu_uuid),
            kinds[str(record.subject_kind)],
            write_optional_string(record.pod_uid),
            write_optional_string(record.namespace),
            write_optional_string(record.pod_name),
            write_string_map(record.labels),
            write_double(record.cost_share),
            write_long(record.cost_micro_usd),
            price,
            write_string_array(record.carried_label_keys),
            b"\x00" if shared_from is None else shared[str(shared_from)],
            write_string(record.sharing_method),
            write_string(record.method),
            write_string(record.cost_basis),
            write_double(record.memory_share),
            write_double(record.compute_share),
            write_double(record.gpu_fraction),
        ))

    return write


# -- NodeWindowCost v1 -----------------------------------------------------------------------------------------

_WINDOW_POD_FIELDS = (
    ("pod_uid", "string"), ("namespace", ["null", "string"]), ("pod_name", ["null", "string"]),
    ("labels", "map<string>"), ("carried_label_keys", "array<string>"), ("workload_kind", ["null", "string"]),
    ("workload_name", ["null", "string"]), ("cpu_request_millicores", "long"), ("memory_request_bytes", "long"),
)
_NODE_WINDOW_COST_V1_FIELDS = (
    ("cluster", "string"), ("node_name", "string"), ("window_start_unix_ms", "long"), ("window_seconds", "int"),
    ("billed_milliseconds", "long"), ("cloud_provider", "string"), ("region", "string"), ("zone", "string"),
    ("provider_id", "string"), ("instance_type", "string"), ("price_model", "string"), ("price_version", "string"),
    ("price_per_hour_usd", "string"), ("split_rule", "string"), ("gpu_count", "int"),
    ("node_cost_micro_usd", "long"), ("gpu_cost_micro_usd", "long"), ("node_other_micro_usd", "long"),
    ("sharing", "string"), ("pods", ("array", _WINDOW_POD_FIELDS)), ("unit_uuids", "array<string>"),
    ("line_unit_index", "array<int>"), ("line_subject_kinds", "array<CostSubjectKind>"),
    ("line_pod_index", "array<int>"), ("line_cost_share", "array<double>"), ("line_cost_micro_usd", "array<long>"),
    ("line_shared_from", "array<union>"), ("line_sharing_method", "array<string>"),
    ("line_method", "array<string>"), ("line_cost_basis", "array<string>"), ("line_memory_share", "array<double>"),
    ("line_compute_share", "array<double>"), ("line_gpu_fraction", "array<double>"),
)


def _window_shape(avro_type: Any) -> Any:
    if isinstance(avro_type, dict) and avro_type["type"] == "array":
        items = avro_type["items"]
        if isinstance(items, dict) and items.get("type") == "record":
            return ("array", tuple((f["name"], _window_shape(f["type"])) for f in items["fields"]))
        if isinstance(items, list):
            return "array<union>" if [_shape(t) for t in items] == ["null", "CostSubjectKind"] else None
        return f"array<{_shape(items)}>"
    return _shape(avro_type)


def _array(items: Any, write_item: Callable[[Any], bytes]) -> bytes:
    if not items:
        return b"\x00"
    return b"".join([write_long(len(items)), *map(write_item, items), b"\x00"])


def _double_array(values: Any) -> bytes:
    if not values:
        return b"\x00"
    if any(type(v) is not float for v in values):
        raise TypeError("a double must be a float")
    return write_long(len(values)) + struct.pack(f"<{len(values)}d", *values) + b"\x00"


def _window_pod(pod: Any) -> bytes:
    return b"".join((
        write_string(pod.pod_uid), write_optional_string(pod.namespace), write_optional_string(pod.pod_name),
        write_string_map(pod.labels), write_string_array(pod.carried_label_keys),
        write_optional_string(pod.workload_kind), write_optional_string(pod.workload_name),
        write_long(pod.cpu_request_millicores), write_long(pod.memory_request_bytes),
    ))


def _node_window_cost_v1(schema_json: Mapping[str, Any]) -> Callable[[Any], bytes] | None:
    if tuple((f["name"], _window_shape(f["type"])) for f in schema_json["fields"]) != _NODE_WINDOW_COST_V1_FIELDS:
        return None
    kinds = _symbols(next(f["type"]["items"] for f in schema_json["fields"] if f["name"] == "line_subject_kinds"))
    shared = {symbol: b"\x02" + index for symbol, index in kinds.items()}

    def kind(value: Any) -> bytes:
        return kinds[str(value)]

    def shared_from(value: Any) -> bytes:
        return b"\x00" if value is None else shared[str(value)]

    def write(record: Any) -> bytes:
        r = record
        return b"".join((
            write_string(r.cluster), write_string(r.node_name), write_long(r.window_start_unix_ms),
            write_int(r.window_seconds), write_long(r.billed_milliseconds), write_string(r.cloud_provider),
            write_string(r.region), write_string(r.zone), write_string(r.provider_id), write_string(r.instance_type),
            write_string(r.price_model), write_string(r.price_version), write_string(r.price_per_hour_usd),
            write_string(r.split_rule), write_int(r.gpu_count), write_long(r.node_cost_micro_usd),
            write_long(r.gpu_cost_micro_usd), write_long(r.node_other_micro_usd), write_string(r.sharing),
            _array(r.pods, _window_pod), write_string_array(r.unit_uuids), _array(r.line_unit_index, write_int),
            _array(r.line_subject_kinds, kind), _array(r.line_pod_index, write_int),
            _double_array(r.line_cost_share), _array(r.line_cost_micro_usd, write_long),
            _array(r.line_shared_from, shared_from), write_string_array(r.line_sharing_method),
            write_string_array(r.line_method), write_string_array(r.line_cost_basis),
            _double_array(r.line_memory_share), _double_array(r.line_compute_share),
            _double_array(r.line_gpu_fraction),
        ))

    return write


# -- NodeWindowShares v1 ---------------------------------------------------------------------------------------

_UNIT_SHARES_FIELDS = (
    ("gpu_uuid", "string"), ("parent_gpu_uuid", ["null", "string"]), ("gpu_model", "string"),
    ("gpu_fraction", "double"), ("sharing_mode", "SharingMode"), ("method", "string"), ("sample_count", "int"),
    ("covered_seconds", "double"), ("subject_kinds", "array<ShareSubjectKind>"),
    ("subject_pod_index", "array<int>"), ("memory_used_bytes_avg", "array<double>"),
    ("memory_share", "array<double>"), ("compute_share", "array<double>"), ("cost_share", "array<double>"),
    ("mig_profile", ["null", "string"]), ("mig_gpu_instance_id", ["null", "int"]),
)
_NODE_WINDOW_SHARES_V1_FIELDS = (
    ("cluster", "string"), ("node_name", "string"), ("window_start_unix_ms", "long"), ("window_seconds", "int"),
    ("node_covered_seconds", "double"), ("cloud_provider", "string"), ("region", "string"), ("zone", "string"),
    ("provider_id", "string"), ("instance_type", "string"), ("price_model", "string"), ("cost_basis", "string"),
    ("pods", ("array", _WINDOW_POD_FIELDS)), ("units", ("array", _UNIT_SHARES_FIELDS)),
)


def _node_window_shares_v1(schema_json: Mapping[str, Any]) -> Callable[[Any], bytes] | None:
    if tuple((f["name"], _window_shape(f["type"])) for f in schema_json["fields"]) != _NODE_WINDOW_SHARES_V1_FIELDS:
        return None
    unit_fields = {f["name"]: f["type"] for f in
                   next(f["type"]["items"]["fields"] for f in schema_json["fields"] if f["name"] == "units")}
    modes = _symbols(unit_fields["sharing_mode"])
    kinds = _symbols(unit_fields["subject_kinds"]["items"])

    def kind(value: Any) -> bytes:
        return kinds[str(value)]

    def unit(u: Any) -> bytes:
        gi = u.mig_gpu_instance_id
        return b"".join((
            write_string(u.gpu_uuid), write_optional_string(u.parent_gpu_uuid), write_string(u.gpu_model),
            write_double(u.gpu_fraction), modes[str(u.sharing_mode)], write_string(u.method),
            write_int(u.sample_count), write_double(u.covered_seconds), _array(u.subject_kinds, kind),
            _array(u.subject_pod_index, write_int), _double_array(u.memory_used_bytes_avg),
            _double_array(u.memory_share), _double_array(u.compute_share), _double_array(u.cost_share),
            write_optional_string(u.mig_profile), b"\x00" if gi is None else b"\x02" + write_int(gi),
        ))

    def write(record: Any) -> bytes:
        r = record
        return b"".join((
            write_string(r.cluster), write_string(r.node_name), write_long(r.window_start_unix_ms),
            write_int(r.window_seconds), write_double(r.node_covered_seconds), write_string(r.cloud_provider),
            write_string(r.region), write_string(r.zone), write_string(r.provider_id), write_string(r.instance_type),
            write_string(r.price_model), write_string(r.cost_basis), _array(r.pods, _window_pod),
            _array(r.units, unit),
        ))

    return write


_WRITERS: dict[tuple[str, int], Callable[[Mapping[str, Any]], Callable[[Any], bytes] | None]] = {
    ("gpumeter.CostRecord", 2): _cost_record_v2,
    ("gpumeter.NodeWindowCost", 1): _node_window_cost_v1,
    ("gpumeter.NodeWindowShares", 1): _node_window_shares_v1,
}


def fast_writer(full_name: str, version: int, schema_json: Mapping[str, Any]) -> Callable[[Any], bytes] | None:
    """The hand-written body writer of ``full_name`` at ``version`` when there is one and ``schema_json`` is the
    schema it was written for (field names and types, in order); else None."""
    make = _WRITERS.get((full_name, version))
    return None if make is None else make(schema_json)
