"""Typed codecs: bytes <-> the immutable records of ``schemas.records``."""

from __future__ import annotations

from typing import Generic, TypeVar

from schemas.codec import AvroCodec, SchemaRegistry, default_registry
from schemas.records import RECORD_TYPES

T = TypeVar("T")

_FULL_NAMES = {cls: name for name, cls in RECORD_TYPES.items()}


class RecordCodec(Generic[T]):
    """Encodes and decodes one record type. ``decode`` raises only ``InvalidMessage`` subclasses."""

    def __init__(self, record_type: type[T], registry: SchemaRegistry | None = None, version: int | None = None):
        self.record_type = record_type
        self.avro = AvroCodec(registry or default_registry(), _FULL_NAMES[record_type], version)

    def encode(self, record: T) -> bytes:
        return self.avro.encode(record.to_avro())  # type: ignore[attr-defined]

    def decode(self, data: bytes) -> T:
        return self.record_type.from_avro(self.avro.decode(data))  # type: ignore[attr-defined]


_CODECS: dict[type, RecordCodec] = {}


def codec_for(record_type: type[T]) -> RecordCodec[T]:
    """The shared codec of ``record_type`` over the default registry (built once)."""
    codec = _CODECS.get(record_type)
    if codec is None:
        codec = _CODECS[record_type] = RecordCodec(record_type)
    return codec
