"""Typed codecs: bytes <-> the immutable records of ``schemas.records``.

``codec_for(NodeSample)`` is ``schemas.packed.NodeSampleCodec``: it writes NodeSample v4 (packed columns) and reads
every NodeSample version into ``NodeSample`` objects. ``RecordCodec(NodeSample)`` speaks the object form's newest
version (v3) unless told another.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from schemas.codec import AvroCodec, SchemaRegistry, default_registry
from schemas.fastwrite import fast_writer
from schemas.packed import OBJECT_VERSION, NodeSampleCodec
from schemas.records import RECORD_TYPES, NodeSample

T = TypeVar("T")

_FULL_NAMES = {cls: name for name, cls in RECORD_TYPES.items()}
# Record types whose newest Avro version is not the one their to_avro/from_avro speak (NodeSample v4 is packed
# columns, schemas.packed).
_OBJECT_VERSIONS: dict[type, int] = {NodeSample: OBJECT_VERSION}


class RecordCodec(Generic[T]):
    """Encodes and decodes one record type. ``decode`` raises only ``InvalidMessage`` subclasses."""

    def __init__(self, record_type: type[T], registry: SchemaRegistry | None = None, version: int | None = None):
        self.record_type = record_type
        if version is None:
            version = _OBJECT_VERSIONS.get(record_type)
        self.avro = AvroCodec(registry or default_registry(), _FULL_NAMES[record_type], version)
        schema = self.avro.schema
        # A hand-written writer of the same bytes (schemas.fastwrite), where one exists for this schema.
        self._fast = fast_writer(schema.full_name, schema.version, schema.schema_json)

    def encode(self, record: T) -> bytes:
        if self._fast is not None:
            try:
                return self.avro._header + self._fast(record)
            except Exception:  # a value of another type than the schema's: the generic path decides (see fastwrite)
                pass
        return self.avro.encode(record.to_avro())  # type: ignore[attr-defined]

    def decode(self, data: bytes) -> T:
        return self.record_type.from_avro(self.avro.decode(data))  # type: ignore[attr-defined]


_CODECS: dict[type, RecordCodec] = {}


def codec_for(record_type: type[T]) -> RecordCodec[T]:
    """The shared codec of ``record_type`` over the default registry (built once)."""
    codec = _CODECS.get(record_type)
    if codec is None:
        if record_type is NodeSample:
            codec = NodeSampleCodec()  # type: ignore[assignment]
        elif issubclass(record_type, NodeSample):  # a NodeSample decoded from v4 (PackedBackedNodeSample)
            codec = codec_for(NodeSample)  # type: ignore[assignment]
        else:
            codec = RecordCodec(record_type)
        _CODECS[record_type] = codec
    return codec
