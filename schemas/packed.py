"""NodeSample v4, the packed hot-topic record: its typed layer (``PackedNodeSample``, numpy arrays), the exact
conversion to and from today's ``NodeSample`` objects, and its codec.

One definition: the column table (``COLUMNS``: every ``bytes`` field, its numpy dtype, unit and length rule) is read
from ``schemas/avro/NodeSample.v4.avsc`` at import, from each field's ``doc``, which starts ``<dtype>, <unit>, one
per <thing>.``; ``PackedNodeSample``'s fields are the ``.avsc``'s fields in its order (tests/unit/schemas/
test_packed.py checks both). Decoding reads the Avro record with fastavro (a ``bytes`` field comes out as ``bytes``)
into a ``DecodedPackedNodeSample``, which keeps those bytes and views a column with ``numpy.frombuffer`` when it is
first read: no Python object per value, and no array for a column its reader takes as bytes (``raw_columns``).

Conversion contract: ``PackedNodeSample.from_node_sample(s).to_node_sample() == s`` for every ``NodeSample`` whose
figures fit the v3 schema's types, except the two a packed column cannot say apart from "missing": a device figure
equal to its column's sentinel (the dtype's minimum), which ``from_node_sample`` refuses with ``SchemaEncodeError``.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import uuid
from dataclasses import dataclass, fields
from typing import Any, Mapping

import numpy as np

from schemas.codec import AVRO_DIR, AvroCodec, RegisteredSchema, SchemaRegistry, default_registry
from schemas.errors import CorruptMessage, SchemaEncodeError, WrongRecordType
from schemas.records import GpuDeviceSample, NodeSample, NvmlError, SharingMode

PACKED_VERSION = 4
OBJECT_VERSION = 3  # the newest NodeSample version whose Avro dicts NodeSample.to_avro/from_avro speak
SCHEMA_PATH = AVRO_DIR / f"NodeSample.v{PACKED_VERSION}.avsc"

SHARING_MODE_CODES: tuple[SharingMode, ...] = (
    SharingMode.UNKNOWN, SharingMode.EXCLUSIVE, SharingMode.TIME_SLICING, SharingMode.MPS, SharingMode.MIG,
)
"""device_sharing_mode's symbol indexes, in the order its doc lists them (a test checks the doc)."""
_MODE_CODE = {mode: code for code, mode in enumerate(SHARING_MODE_CODES)}

MISSING_I4 = -(2**31)
MISSING_I8 = -(2**63)
NULLABLE_COLUMNS: Mapping[str, str] = {
    "device_mig_gpu_instance_id": "mig_gpu_instance_id",
    "device_mig_compute_instance_id": "mig_compute_instance_id",
    "device_gpu_utilization_percent": "gpu_utilization_percent",
    "device_memory_utilization_percent": "memory_utilization_percent",
    "device_power_milliwatts": "power_milliwatts",
}
"""Device columns whose v3 field is nullable: None travels as the dtype's minimum (the field's doc says so)."""

_DOC_HEAD = re.compile(r"^(<[iu][1248]|uuid16), ([^,]+), one per ([^.]+)\.")


@dataclass(frozen=True, slots=True)
class Column:
    """One packed ``bytes`` field: ``dtype`` (numpy notation; uuid16 is ``V16``), ``unit``, and ``per``: what its
    length counts (``device``, ``process``, ``pod``, ``MPS server pid``, ``pod uid not in canonical UUID form``)."""

    name: str
    dtype: np.dtype
    unit: str
    per: str


def _columns_from_avsc(schema: Mapping[str, Any]) -> dict[str, Column]:
    columns = {}
    for f in schema["fields"]:
        if f["type"] != "bytes":
            continue
        match = _DOC_HEAD.match(f["doc"])
        if match is None:
            raise ValueError(f"{SCHEMA_PATH.name}: {f['name']}'s doc does not start '<dtype>, <unit>, one per <x>.'")
        dtype, unit, per = match.groups()
        columns[f["name"]] = Column(f["name"], np.dtype("V16" if dtype == "uuid16" else dtype), unit, per)
    return columns


SCHEMA_JSON: Mapping[str, Any] = json.loads(SCHEMA_PATH.read_text())
COLUMNS: Mapping[str, Column] = _columns_from_avsc(SCHEMA_JSON)
DEVICE_COLUMNS = tuple(n for n, c in COLUMNS.items() if c.per == "device")
PROCESS_COLUMNS = tuple(n for n, c in COLUMNS.items() if c.per == "process")
_DEVICE_LAYOUT = tuple((n, COLUMNS[n].dtype.itemsize) for n in DEVICE_COLUMNS)
_PROCESS_LAYOUT = tuple((n, COLUMNS[n].dtype.itemsize) for n in PROCESS_COLUMNS)
_NULLABLE_POSITIONS = tuple(DEVICE_COLUMNS.index(n) for n in NULLABLE_COLUMNS)
# to_node_sample unpacks the device columns in this order.
assert DEVICE_COLUMNS == (
    "device_model", "device_parent_uuid", "device_mig_profile", "device_sharing_mode", "device_index",
    "device_replicas", "device_mig_gpu_instance_id",
    "device_mig_compute_instance_id", "device_mig_compute_slices", "device_mig_total_compute_slices",
    "device_memory_total_bytes", "device_memory_used_bytes", "device_memory_free_bytes",
    "device_memory_reserved_bytes", "device_gpu_utilization_percent", "device_memory_utilization_percent",
    "device_power_milliwatts", "device_process_utilization_supported", "device_process_count",
    "device_mps_server_count"), DEVICE_COLUMNS
assert set(COLUMNS) == {*DEVICE_COLUMNS, *PROCESS_COLUMNS, "pod_uids", "pod_uid_text_slots", "mps_server_pids"}


def _column(name: str, values: Any) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=np.int64)
        info = np.iinfo(COLUMNS[name].dtype)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise OverflowError(f"{name} holds a value outside {COLUMNS[name].dtype}")
        return array.astype(COLUMNS[name].dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise SchemaEncodeError(f"NodeSample v4 column {name} does not fit: {exc}") from exc


_UID_TEXTS: dict[tuple[bytes, bytes, tuple[str, ...]], tuple[str, ...]] = {}
"""Pod lists seen, by their packed bytes -> their text (``_remember``: cleared when full)."""

# What a node repeats from tick to tick, shared between the ticks that repeat it: an attributor holds every tick of
# every open window (a window and its grace: ~70 ticks of each of its nodes), and a decoded tick is mostly the
# per-process tuples (pids, pod slots, memory: a process's allocation moves rarely) and the device names. One
# object per distinct value instead of one per tick cuts what an open tick holds (``make bench``: attribution
# core, bytes per open tick) and the lists ``tolist`` would build. Each maps the packed bytes (with the per-device
# counts that cut them) -> the per-device tuples; a dict per column so that a column whose values change every
# tick (SM utilization is not cached at all) cannot push the others out. Every one of these dicts, ``_UID_TEXTS``
# included, is cleared when it holds ``_SEGMENTS_MAX`` entries (``_remember``): the bound is what matters (16,384
# entries of a few hundred bytes: a few MiB), not an eviction policy, and a node's next tick fills its entry again.
_SEGMENTS_MAX = 16_384
_PID_SEGMENTS: dict[tuple[bytes, bytes], tuple[tuple[int, ...], ...]] = {}
_POD_SLOT_SEGMENTS: dict[tuple[bytes, bytes], tuple[tuple[int, ...], ...]] = {}
_MEMORY_SEGMENTS: dict[tuple[bytes, bytes], tuple[tuple[int, ...], ...]] = {}
_MPS_SEGMENTS: dict[tuple[bytes, bytes], tuple[tuple[int, ...], ...]] = {}
_TEXT_TUPLES: dict[tuple[str, ...], tuple[str, ...]] = {}


def forget_shared_values() -> None:
    """Empty the decoder's shared values (the pod lists' texts and what ticks repeat): the next decode of each
    node builds them again. For measurements of what a decoded tick holds (``make bench``) and for tests."""
    for cache in (_UID_TEXTS, _PID_SEGMENTS, _POD_SLOT_SEGMENTS, _MEMORY_SEGMENTS, _MPS_SEGMENTS, _TEXT_TUPLES):
        cache.clear()


def _split(values: list, counts: list[int]) -> tuple[tuple, ...]:
    """``values`` cut into consecutive tuples of ``counts[i]`` entries."""
    out = []
    start = 0
    for count in counts:
        end = start + count
        out.append(tuple(values[start:end]))
        start = end
    return tuple(out)


def _remember(cache: dict, key: Any, value: Any) -> Any:
    """Store ``value`` under ``key`` in one of the shared-value dicts, emptying it first when it is full; return
    ``value``."""
    if len(cache) >= _SEGMENTS_MAX:
        cache.clear()
    cache[key] = value
    return value


def _shared_texts(texts: tuple[str, ...]) -> tuple[str, ...]:
    """The one tuple (and strings) for ``texts`` (device uuids, models, profiles: the same every tick)."""
    found = _TEXT_TUPLES.get(texts)
    if found is None:
        found = _remember(_TEXT_TUPLES, texts, texts)
    return found


@functools.lru_cache(maxsize=65_536)
def _uid_bytes(uid: str) -> bytes | None:
    """The 16 bytes of a canonical (lowercase, hyphenated) UUID text, else None; cached: a node's pods tick again
    every second."""
    try:
        parsed = uuid.UUID(uid)
    except (ValueError, TypeError, AttributeError):
        return None
    return parsed.bytes if str(parsed) == uid else None


@dataclass(frozen=True, slots=True, eq=False)
class PackedNodeSample:
    """A NodeSample v4 record: Avro fields in ``.avsc`` order; every ``bytes`` field is a read-only numpy array of
    its column's dtype (``COLUMNS``), lists are tuples. Equal when every field is (arrays: same dtype and values)."""

    cluster: str
    node_name: str
    sequence: int
    collector_started_at_unix_ms: int
    sampled_at_unix_ms: int
    interval_ms: int
    cloud_provider: str
    region: str
    instance_type: str
    price_model: str
    zone: str
    provider_id: str
    node_errors: tuple[NvmlError, ...]
    pod_uids: np.ndarray
    pod_uid_text_slots: np.ndarray
    pod_uid_texts: tuple[str, ...]
    device_uuids: tuple[str, ...]
    device_texts: tuple[str, ...]
    device_model: np.ndarray
    device_parent_uuid: np.ndarray
    device_mig_profile: np.ndarray
    device_sharing_mode: np.ndarray
    device_index: np.ndarray
    device_replicas: np.ndarray
    device_mig_gpu_instance_id: np.ndarray
    device_mig_compute_instance_id: np.ndarray
    device_mig_compute_slices: np.ndarray
    device_mig_total_compute_slices: np.ndarray
    device_memory_total_bytes: np.ndarray
    device_memory_used_bytes: np.ndarray
    device_memory_free_bytes: np.ndarray
    device_memory_reserved_bytes: np.ndarray
    device_gpu_utilization_percent: np.ndarray
    device_memory_utilization_percent: np.ndarray
    device_power_milliwatts: np.ndarray
    device_process_utilization_supported: np.ndarray
    device_process_count: np.ndarray
    device_mps_server_count: np.ndarray
    device_errors: tuple[tuple[int, NvmlError], ...]
    process_pid: np.ndarray
    process_pod_index: np.ndarray
    process_used_memory_bytes: np.ndarray
    process_sm_utilization_percent: np.ndarray
    mps_server_pids: np.ndarray

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedNodeSample):
            return NotImplemented
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray):
                if not isinstance(b, np.ndarray) or a.dtype != b.dtype or not np.array_equal(a, b):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]

    @property
    def device_count(self) -> int:
        return len(self.device_uuids)

    @property
    def process_count(self) -> int:
        return len(self.process_pid)

    @property
    def pod_count(self) -> int:
        return len(self.pod_uids)

    @property
    def process_device(self) -> np.ndarray:
        """Per process: its device's position in the device columns (derived from device_process_count)."""
        return np.repeat(np.arange(self.device_count, dtype=np.int32), self.device_process_count)

    def device_parent_uuid_strings(self) -> tuple[str | None, ...]:
        """Per device: its parent GPU's uuid (a MIG instance), else None."""
        texts = self.device_texts
        return tuple([texts[i] if i >= 0 else None for i in self.device_parent_uuid.tolist()])

    def pod_uid_strings(self) -> tuple[str, ...]:
        """The pod uids as text, in slot order. One tuple per distinct pod list: a node's ticks mostly repeat its
        list, and the same tuple object lets the engine's identity-keyed lookups hit (``_UID_TEXTS``)."""
        raw = self.column_bytes("pod_uids")
        key = (raw, self.column_bytes("pod_uid_text_slots"), self.pod_uid_texts)
        uids = _UID_TEXTS.get(key)
        if uids is None:
            h = raw.hex()
            texts = [f"{h[i:i + 8]}-{h[i + 8:i + 12]}-{h[i + 12:i + 16]}-{h[i + 16:i + 20]}-{h[i + 20:i + 32]}"
                     for i in range(0, len(h), 32)]
            for slot, text in zip(self.pod_uid_text_slots.tolist(), self.pod_uid_texts):
                texts[slot] = text
            uids = _remember(_UID_TEXTS, key, tuple(texts))
        return uids

    # -- Avro dicts ------------------------------------------------------------------------------------------------

    def to_avro(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, np.ndarray):
                d[f.name] = value.tobytes()
            elif f.name == "node_errors":
                d[f.name] = [e.to_avro() for e in value]
            elif f.name == "device_errors":
                d[f.name] = [{"device": device, **e.to_avro()} for device, e in value]
            elif isinstance(value, tuple):
                d[f.name] = list(value)
            else:
                d[f.name] = value
        return d

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> "PackedNodeSample":
        """The record of a v4 Avro dict. Raises ``CorruptMessage`` when a column's length breaks its rule. Called
        on ``PackedNodeSample``, it returns a ``DecodedPackedNodeSample``: the same value, whose arrays are made
        from ``d``'s bytes when first read."""
        record = DecodedPackedNodeSample.decoded(d)
        if cls is PackedNodeSample or cls is DecodedPackedNodeSample:
            return record
        return cls(*[getattr(record, f.name) for f in fields(PackedNodeSample)])

    @property
    def raw_columns(self) -> Mapping[str, bytes]:
        """Every column's packed little-endian bytes by field name, as its Avro ``bytes`` field carries them. A
        record decoded from a message (``DecodedPackedNodeSample``) hands out the bytes it was decoded from; this
        one packs its arrays (a copy of each, every call)."""
        return {name: getattr(self, name).tobytes() for name in COLUMNS}

    def column_bytes(self, name: str) -> bytes:
        """Column ``name``'s packed bytes (``raw_columns[name]``, without packing the others)."""
        return getattr(self, name).tobytes()

    def column_values(self, name: str) -> list[int]:
        """Column ``name``'s values as Python ints, in order (its array's ``tolist()``; not for ``pod_uids``)."""
        return getattr(self, name).tolist()

    def _segments(self, cache: dict, name: str, counts_raw: bytes, counts: list[int]) -> tuple[tuple, ...]:
        """Column ``name`` cut per device by ``counts`` (``counts_raw``: their packed bytes), one shared tuple
        per value."""
        key = (self.column_bytes(name), counts_raw)
        found = cache.get(key)
        if found is None:
            found = _remember(cache, key, _split(self.column_values(name), counts))
        return found

    # -- NodeSample objects ----------------------------------------------------------------------------------------

    @classmethod
    def from_node_sample(cls, sample: NodeSample) -> "PackedNodeSample":
        """The packed form of ``sample``. Raises ``SchemaEncodeError`` for a figure its column cannot carry."""
        devices = sample.devices
        uid_bytes = [_uid_bytes(uid) for uid in sample.pod_uids]
        text_slots = [i for i, raw in enumerate(uid_bytes) if raw is None]
        texts: dict[str, int] = {}
        device_values: dict[str, list] = {name: [] for name in DEVICE_COLUMNS}
        for dev in devices:
            for name in DEVICE_COLUMNS:
                device_values[name].append(_device_figure(dev, name, texts))
        process = {name: [] for name in PROCESS_COLUMNS}
        mps: list[int] = []
        for dev in devices:
            process["process_pid"].extend(dev.process_pids)
            process["process_pod_index"].extend(dev.process_pod_index)
            process["process_used_memory_bytes"].extend(dev.process_used_memory_bytes)
            process["process_sm_utilization_percent"].extend(dev.process_sm_utilization_percent)
            mps.extend(dev.mps_server_pids)
        for name, v3_name in NULLABLE_COLUMNS.items():
            if any(v == _missing(name) for v in device_values[name]):
                raise SchemaEncodeError(f"NodeSample v4 {name}: {v3_name} equal to the missing sentinel")
            device_values[name] = [_missing(name) if v is None else v for v in device_values[name]]
        return cls(
            sample.cluster, sample.node_name, sample.sequence, sample.collector_started_at_unix_ms,
            sample.sampled_at_unix_ms, sample.interval_ms, sample.cloud_provider, sample.region,
            sample.instance_type, sample.price_model, sample.zone, sample.provider_id, tuple(sample.node_errors),
            np.frombuffer(b"".join(raw or bytes(16) for raw in uid_bytes), dtype=COLUMNS["pod_uids"].dtype),
            _column("pod_uid_text_slots", text_slots), tuple(sample.pod_uids[i] for i in text_slots),
            tuple(dev.uuid for dev in devices), tuple(texts),
            *(_column(name, device_values[name]) for name in DEVICE_COLUMNS),
            tuple((position, e) for position, dev in enumerate(devices) for e in dev.errors),
            *(_column(name, process[name]) for name in PROCESS_COLUMNS),
            _column("mps_server_pids", mps),
        )

    def to_node_sample(self, message: bytes | None = None) -> NodeSample:
        """The ``NodeSample`` this record says, exactly as v3 decoding would build it (equal to it field by field).
        Its ``devices`` are built from the columns when first read (``PackedBackedNodeSample``): a reader that
        works on the columns (``packed``) never pays for a Python object per device and per process value.
        ``message``: the single-object Avro message this record was decoded from, if any (kept, so that the
        sample can let its columns go: ``PackedBackedNodeSample.release_columns``)."""
        cluster, node_name, cloud_provider, region, instance_type, price_model, zone, provider_id = _shared_texts(
            (self.cluster, self.node_name, self.cloud_provider, self.region, self.instance_type, self.price_model,
             self.zone, self.provider_id))
        return PackedBackedNodeSample.over(self, (
            cluster, node_name, self.sequence, self.collector_started_at_unix_ms, self.sampled_at_unix_ms,
            self.interval_ms, cloud_provider, region, instance_type, price_model,
            self.pod_uid_strings(), self.node_errors, None, zone, provider_id,
        ), message)

    def device_samples(self) -> tuple[GpuDeviceSample, ...]:
        """The ``GpuDeviceSample`` of every device, in column order, exactly as v3 decoding builds them."""
        values = self.column_values
        columns = [values(name) for name in DEVICE_COLUMNS]
        for position in _NULLABLE_POSITIONS:
            sentinel = _missing(DEVICE_COLUMNS[position])
            column = columns[position]
            if sentinel in column:
                columns[position] = [None if v == sentinel else v for v in column]
        texts = _shared_texts(self.device_texts)
        (models, parents, profiles, modes, index, replicas, gi, ci, slices, total_slices, mem_total, mem_used,
         mem_free, mem_reserved, gpu_util, mem_util, power, supported, process_counts, mps_counts) = columns
        codes = SHARING_MODE_CODES
        modes = [codes[c] if c < len(codes) else SharingMode.UNKNOWN for c in modes]
        errors: list[list[NvmlError]] = [[] for _ in self.device_uuids]
        for position, error in self.device_errors:
            errors[position].append(error)
        counts_raw = self.column_bytes("device_process_count")
        pids = self._segments(_PID_SEGMENTS, "process_pid", counts_raw, process_counts)
        pods = self._segments(_POD_SLOT_SEGMENTS, "process_pod_index", counts_raw, process_counts)
        memory = self._segments(_MEMORY_SEGMENTS, "process_used_memory_bytes", counts_raw, process_counts)
        sm = _split(values("process_sm_utilization_percent"), process_counts)  # new every tick: not cached
        mps = self._segments(_MPS_SEGMENTS, "mps_server_pids", self.column_bytes("device_mps_server_count"),
                             mps_counts)
        devices = []
        for i, device_uuid in enumerate(_shared_texts(self.device_uuids)):
            devices.append(GpuDeviceSample(
                device_uuid, texts[parents[i]] if parents[i] >= 0 else None, index[i], texts[models[i]], modes[i],
                replicas[i], gi[i], ci[i], texts[profiles[i]] if profiles[i] >= 0 else None, slices[i],
                total_slices[i], mem_total[i], mem_used[i], mem_free[i], mem_reserved[i], gpu_util[i], mem_util[i],
                power[i], supported[i] != 0, tuple(errors[i]), pids[i], pods[i], memory[i], sm[i], mps[i],
            ))
        return tuple(devices)


_new_object = object.__new__


_NON_COLUMN_SETTERS = tuple((f.name, PackedNodeSample.__dict__[f.name].__set__) for f in fields(PackedNodeSample)
                            if f.name not in COLUMNS)
_COLUMN_DTYPES = {name: column.dtype for name, column in COLUMNS.items()}
# The struct format of each integer column's items (memoryview.cast: the column's values without an array)
_STRUCT_CODES = {name: ("bhiq" if dtype.kind == "i" else "BHIQ")[dtype.itemsize.bit_length() - 1]
                 for name, dtype in _COLUMN_DTYPES.items() if dtype.kind in "iu"}


class DecodedPackedNodeSample(PackedNodeSample):
    """A ``PackedNodeSample`` decoded from a v4 message: equal to the record with the same fields, immutable like
    it. It keeps the Avro record's ``bytes`` fields as they came (``raw_columns``: no copy) and makes a column's
    array when it is first read, so a reader that works on the bytes (the range checks' caches, the attributor's
    lane, which copies them into its chunk) pays for no array per column, and letting the record go frees a
    few bytes objects instead of ~27 arrays. The length rules are checked when it is made, as ``from_avro``
    always has."""

    __slots__ = ("_columns", "_arrays")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The record of these field values (``PackedNodeSample``'s), its columns' bytes packed from the arrays
        given: what ``dataclasses.replace`` of a decoded record makes."""
        record = PackedNodeSample(*args, **kwargs)
        for name, set_field in _NON_COLUMN_SETTERS:
            set_field(self, getattr(record, name))
        arrays = {name: getattr(record, name) for name in COLUMNS}
        _set_columns(self, {name: array.tobytes() for name, array in arrays.items()})
        _set_arrays(self, arrays)

    @classmethod
    def decoded(cls, d: Mapping[str, Any]) -> "DecodedPackedNodeSample":
        """The record of the v4 Avro dict ``d`` (``PackedNodeSample.from_avro``'s checks; ``CorruptMessage``)."""
        devices = len(d["device_uuids"])
        for name, itemsize in _DEVICE_LAYOUT:
            raw = d[name]
            if len(raw) != devices * itemsize:
                _length_error(name, raw, itemsize, devices)
        if devices:
            texts = len(d["device_texts"])
            models = column_ints(d["device_model"], "h")
            optional = column_ints(d["device_parent_uuid"] + d["device_mig_profile"], "h")
            if min(models) < 0 or max(models) >= texts or min(optional) < -1 or max(optional) >= texts:
                raise CorruptMessage("NodeSample v4 device text indexes point outside device_texts")
        # Summed as unsigned: a negative count becomes one no message's length can match.
        processes = sum(column_ints(d["device_process_count"], "I"))
        mps_pids = sum(column_ints(d["device_mps_server_count"], "I"))
        for name, itemsize in _PROCESS_LAYOUT:
            raw = d[name]
            if len(raw) != processes * itemsize:
                _length_error(name, raw, itemsize, processes)
        raw = d["mps_server_pids"]
        if len(raw) != mps_pids * 4:
            _length_error("mps_server_pids", raw, 4, mps_pids)
        raw = d["pod_uids"]
        if len(raw) % 16:
            _length_error("pod_uids", raw, 16, None)
        pod_count = len(raw) // 16
        raw, texts = d["pod_uid_text_slots"], d["pod_uid_texts"]
        if len(raw) != len(texts) * 4:
            _length_error("pod_uid_text_slots", raw, 4, len(texts))
        if texts:
            slots = column_ints(raw, "i")
            if min(slots) < 0 or max(slots) >= pod_count or any(b <= a for a, b in zip(slots, slots[1:])):
                raise CorruptMessage("NodeSample v4 pod_uid_text_slots are not ascending pod slots")
        device_errors = d["device_errors"]
        if device_errors and any(not 0 <= e["device"] < devices for e in device_errors):
            raise CorruptMessage("NodeSample v4 device_errors names a device that is not in the tick")
        node_errors = d["node_errors"]
        # Every message of the hot topic: its fields other than the columns set through their slots (the frozen
        # dataclass's __init__ goes through object.__setattr__ once per field, about twice the cost).
        record = _new_object(cls)
        for set_field, value in zip(_DECODED_SETTERS, (
                d["cluster"], d["node_name"], d["sequence"], d["collector_started_at_unix_ms"],
                d["sampled_at_unix_ms"], d["interval_ms"], d["cloud_provider"], d["region"], d["instance_type"],
                d["price_model"], d["zone"], d["provider_id"],
                tuple([NvmlError.from_avro(e) for e in node_errors]) if node_errors else (),
                tuple(texts), tuple(d["device_uuids"]), tuple(d["device_texts"]),
                tuple([(e["device"], NvmlError.from_avro(e)) for e in device_errors]) if device_errors else (),
                d, {})):
            set_field(record, value)
        return record

    @property
    def raw_columns(self) -> Mapping[str, bytes]:
        """Every column's bytes by field name: the Avro record this was decoded from (its other fields too)."""
        return self._columns

    def column_bytes(self, name: str) -> bytes:
        return self._columns[name]

    def column_values(self, name: str) -> list[int]:
        values = column_ints(self._columns[name], _STRUCT_CODES[name])
        return values.tolist() if type(values) is memoryview else values

    def __reduce__(self) -> tuple:
        return (PackedNodeSample, tuple(getattr(self, f.name) for f in fields(PackedNodeSample)))


def _lazy_column(name: str) -> property:
    dtype, frombuffer = _COLUMN_DTYPES[name], np.frombuffer

    def column(self: DecodedPackedNodeSample) -> np.ndarray:
        arrays = self._arrays
        array = arrays.get(name)
        if array is None:
            array = arrays[name] = frombuffer(self._columns[name], dtype)
        return array

    column.__name__ = name
    return property(column, doc=f"{name}: {_COLUMN_DTYPES[name]} ({COLUMNS[name].unit}), made on first read")


for _name in COLUMNS:
    setattr(DecodedPackedNodeSample, _name, _lazy_column(_name))
del _name
_set_columns = DecodedPackedNodeSample.__dict__["_columns"].__set__
_set_arrays = DecodedPackedNodeSample.__dict__["_arrays"].__set__
_DECODED_SETTERS = (*(setter for name, setter in _NON_COLUMN_SETTERS), _set_columns, _set_arrays)

_NODE_SAMPLE_FIELDS = tuple(f.name for f in fields(NodeSample))
_DEVICES_SLOT = NodeSample.__dict__["devices"]  # the dataclass's slot for ``devices``, under the property below


def _lazy_devices(sample: "PackedBackedNodeSample") -> tuple[GpuDeviceSample, ...]:
    try:
        return _DEVICES_SLOT.__get__(sample, NodeSample)
    except AttributeError:  # not built yet: the slot is empty until the first read
        packed = sample.packed
        if packed is None:  # its columns were let go: decoded again from the message they came from
            packed = _codec().decode_packed(sample._message)
        devices = packed.device_samples()
        _DEVICES_SLOT.__set__(sample, devices)
        return devices


@functools.lru_cache(maxsize=1)
def _codec() -> "NodeSampleCodec":
    return NodeSampleCodec()


class PackedBackedNodeSample(NodeSample):
    """A ``NodeSample`` decoded from a v4 record, which it keeps (``packed``): its ``devices`` are built from the
    record's columns on first read, so a consumer that reads the columns (the attributor's engine) makes no object
    per device or process value. Equal to (and hashes as) the ``NodeSample`` with the same fields; immutable like
    it. ``dataclasses.replace`` of one gives a sample with its devices built and no ``packed`` (its fields may no
    longer be the record's)."""

    __slots__ = ("packed", "_message")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        NodeSample.__init__(self, *args, **kwargs)
        object.__setattr__(self, "packed", None)
        object.__setattr__(self, "_message", None)

    @classmethod
    def over(cls, packed: PackedNodeSample, values: tuple, message: bytes | None = None) -> "PackedBackedNodeSample":
        """The sample with ``values`` (NodeSample's fields in order, ``devices`` None) whose devices ``packed``
        holds (decoded from ``message``, when given)."""
        # Once per decoded message: each field set through its slot (``object.__setattr__`` costs about twice that)
        sample = object.__new__(cls)
        for set_field, value in zip(_OVER_SETTERS, values):
            if set_field is not None:  # devices: built on first read
                set_field(sample, value)
        _set_packed(sample, packed)
        _set_message(sample, message)
        return sample

    def release_columns(self) -> None:
        """Let the record's arrays go (``packed`` becomes None) where the message they were decoded from is kept:
        a reader done with the columns keeps ~3.5 KB of message instead of ~9 KB of arrays per 8-GPU tick, and
        ``devices`` are still built, from the message, if anything reads them. The sample's value is unchanged."""
        if self._message is not None:
            object.__setattr__(self, "packed", None)

    devices = property(_lazy_devices, lambda self, value: _DEVICES_SLOT.__set__(self, value))  # type: ignore

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NodeSample):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in _NODE_SAMPLE_FIELDS)

    __hash__ = NodeSample.__hash__

    def __reduce__(self) -> tuple:
        return (NodeSample, tuple(getattr(self, name) for name in _NODE_SAMPLE_FIELDS))


_OVER_SETTERS = tuple(None if name == "devices" else NodeSample.__dict__[name].__set__ for name in _NODE_SAMPLE_FIELDS)
_set_packed = PackedBackedNodeSample.__dict__["packed"].__set__
_set_message = PackedBackedNodeSample.__dict__["_message"].__set__


def _device_figure(dev: GpuDeviceSample, column: str, texts: dict[str, int]) -> Any:
    if column in _TEXT_ATTRIBUTES:
        text = getattr(dev, _TEXT_ATTRIBUTES[column])
        return -1 if text is None else texts.setdefault(text, len(texts))
    if column == "device_sharing_mode":
        try:
            return _MODE_CODE[SharingMode(dev.sharing_mode)]
        except ValueError as exc:
            raise SchemaEncodeError(f"NodeSample v4: sharing mode {dev.sharing_mode!r} has no code") from exc
    if column == "device_process_utilization_supported":
        return 1 if dev.process_utilization_supported else 0
    if column == "device_process_count":
        lengths = {len(dev.process_pids), len(dev.process_pod_index), len(dev.process_used_memory_bytes),
                   len(dev.process_sm_utilization_percent)}
        if len(lengths) != 1:
            raise SchemaEncodeError(f"device {dev.uuid}'s process columns differ in length: {sorted(lengths)}")
        return len(dev.process_pids)
    if column == "device_mps_server_count":
        return len(dev.mps_server_pids)
    return getattr(dev, column[len("device_"):])


_TEXT_ATTRIBUTES = {"device_model": "model", "device_parent_uuid": "parent_uuid", "device_mig_profile": "mig_profile"}


def _missing(column: str) -> int:
    return MISSING_I8 if COLUMNS[column].dtype.itemsize == 8 else MISSING_I4


_LITTLE_ENDIAN = sys.byteorder == "little"


def column_ints(raw: bytes, code: str) -> Any:
    """The little-endian integers of ``raw`` (``code``: a struct format of fixed size, "b"/"B" 8-bit, "h"/"H"
    16-bit, "i"/"I" 32-bit, "q"/"Q" 64-bit, lowercase signed) for a few Python-level min/max/sum calls or reads: a
    memoryview on little-endian machines (no numpy call's overhead for a handful of values), a list elsewhere."""
    if _LITTLE_ENDIAN:
        return memoryview(raw).cast(code)
    return np.frombuffer(raw, _INT_DTYPES[code]).tolist()


_INT_DTYPES = {"b": "<i1", "B": "<u1", "h": "<i2", "H": "<u2", "i": "<i4", "I": "<u4", "q": "<i8", "Q": "<u8"}


def _length_error(name: str, raw: bytes, itemsize: int, count: int | None) -> None:
    if len(raw) % itemsize:
        raise CorruptMessage(f"NodeSample v4 {name}: {len(raw)} bytes is not a whole number of {itemsize}-byte "
                             "entries")
    raise CorruptMessage(f"NodeSample v4 {name} has {len(raw) // itemsize} entries, its length rule says {count}")


# ------------------------------------------------------------------------------------------------------------------
# The codec


class NodeSampleCodec:
    """``codec_for(NodeSample)``: encodes a ``NodeSample`` as v4 (what the collector writes to the hot topic) and
    decodes any registered NodeSample version -- v4 on the fast path, v1-v3 through Avro resolution to v3 (the old
    topic, during the migration) -- into ``NodeSample`` objects, or with ``decode_packed`` into ``PackedNodeSample``.
    Every failure is an ``InvalidMessage`` subclass."""

    record_type = NodeSample

    def __init__(self, registry: SchemaRegistry | None = None) -> None:
        registry = registry or default_registry()
        self.packed = AvroCodec(registry, "gpumeter.NodeSample", PACKED_VERSION)
        self.objects = AvroCodec(registry, "gpumeter.NodeSample", OBJECT_VERSION)
        self.avro = self.packed
        self._packed_schema: RegisteredSchema = self.packed.schema

    def encode(self, record: NodeSample) -> bytes:
        return self.encode_packed(PackedNodeSample.from_node_sample(record))

    def encode_packed(self, record: PackedNodeSample) -> bytes:
        return self.packed.encode(record.to_avro())

    def decode(self, data: bytes) -> NodeSample:
        writer = self.packed.writer_of(data)
        if writer.full_name == "gpumeter.NodeSample" and writer.version < PACKED_VERSION:
            return NodeSample.from_avro(self.objects.decode_body(data, writer))
        return self._packed(data, writer).to_node_sample(data)

    def decode_packed(self, data: bytes) -> PackedNodeSample:
        """The v4 record in ``data`` as arrays; an older NodeSample version is converted."""
        return self._packed(data, self.packed.writer_of(data))

    def _packed(self, data: bytes, writer: RegisteredSchema) -> PackedNodeSample:
        if writer.full_name != "gpumeter.NodeSample":
            raise WrongRecordType(f"expected gpumeter.NodeSample, got {writer.full_name} v{writer.version}")
        if writer.version < PACKED_VERSION:
            return PackedNodeSample.from_node_sample(NodeSample.from_avro(self.objects.decode_body(data, writer)))
        if writer.fingerprint != self._packed_schema.fingerprint:
            raise WrongRecordType(f"NodeSample v{writer.version} is newer than this reader's v{PACKED_VERSION}")
        return PackedNodeSample.from_avro(self.packed.decode_body(data, writer))
