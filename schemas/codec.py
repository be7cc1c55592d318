"""Avro single-object encoding with a registry of writer schemas and reader-schema resolution.

Wire format (Avro specification, "Single object encoding"):

    C3 01 | CRC-64-AVRO fingerprint of the writer schema's parsing canonical form, 8 bytes little-endian | body

The body is Avro binary of the record under the writer schema. A consumer decodes with the writer schema the
fingerprint names and resolves it to its own reader schema (fields matched by name; reader-only fields take their
defaults; writer-only fields are skipped). Every failure is an ``InvalidMessage`` subclass; fastavro's own errors
never escape.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import fastavro
from fastavro.schema import to_parsing_canonical_form

from schemas.errors import (
    CorruptMessage,
    SchemaEncodeError,
    TruncatedMessage,
    UnknownSchema,
    WrongRecordType,
)

MAGIC = b"\xc3\x01"
HEADER_BYTES = 10
AVRO_DIR = Path(__file__).parent / "avro"

_CRC64_EMPTY = 0xC15D213AA4D7A795


def _crc64_table() -> list[int]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (_CRC64_EMPTY & -(fp & 1))
        table.append(fp)
    return table


_CRC64_TABLE = _crc64_table()


def crc64_avro(data: bytes) -> int:
    """The Avro specification's 64-bit Rabin fingerprint (CRC-64-AVRO) of ``data``, as an unsigned int."""
    fp = _CRC64_EMPTY
    for byte in data:
        fp = (fp >> 8) ^ _CRC64_TABLE[(fp ^ byte) & 0xFF]
    return fp


@dataclass(frozen=True)
class RegisteredSchema:
    """One writer schema: a record type (Avro full name) at one version."""

    full_name: str
    version: int
    schema_json: Mapping[str, Any]
    parsed: Any
    canonical_form: str
    fingerprint: int

    @property
    def header(self) -> bytes:
        return MAGIC + struct.pack("<Q", self.fingerprint)


def make_registered_schema(schema_json: Mapping[str, Any], version: int) -> RegisteredSchema:
    # The default write hint marks the schema parsed; without it fastavro re-parses it on every call.
    parsed = fastavro.parse_schema(dict(schema_json))
    canonical = to_parsing_canonical_form(parsed)
    full_name = parsed["name"]
    return RegisteredSchema(
        full_name=full_name,
        version=version,
        schema_json=schema_json,
        parsed=parsed,
        canonical_form=canonical,
        fingerprint=crc64_avro(canonical.encode("utf-8")),
    )


class SchemaRegistry:
    """Known writer schemas, by fingerprint and by (record type, version). Immutable after construction."""

    def __init__(self, schemas: list[RegisteredSchema]) -> None:
        self._by_fingerprint: dict[int, RegisteredSchema] = {}
        self._by_name_version: dict[tuple[str, int], RegisteredSchema] = {}
        for schema in schemas:
            other = self._by_fingerprint.get(schema.fingerprint)
            if other is not None and other.full_name != schema.full_name:
                raise ValueError(f"fingerprint collision between {other.full_name} and {schema.full_name}")
            self._by_fingerprint[schema.fingerprint] = schema
            self._by_name_version[(schema.full_name, schema.version)] = schema

    @classmethod
    def from_directory(cls, directory: Path = AVRO_DIR, extra: list[RegisteredSchema] | None = None) -> "SchemaRegistry":
        """Load every ``<Name>.v<N>.avsc`` under ``directory``."""
        schemas = []
        for path in sorted(directory.glob("*.avsc")):
            stem = path.name[: -len(".avsc")]
            _name, _, version = stem.rpartition(".v")
            schemas.append(make_registered_schema(json.loads(path.read_text()), int(version)))
        return cls(schemas + list(extra or []))

    def by_fingerprint(self, fingerprint: int) -> RegisteredSchema | None:
        return self._by_fingerprint.get(fingerprint)

    def get(self, full_name: str, version: int | None = None) -> RegisteredSchema:
        """The schema of ``full_name`` at ``version`` (the highest registered when None)."""
        if version is None:
            versions = [v for (n, v) in self._by_name_version if n == full_name]
            if not versions:
                raise KeyError(full_name)
            version = max(versions)
        return self._by_name_version[(full_name, version)]

    def __iter__(self):
        return iter(self._by_fingerprint.values())


class AvroCodec:
    """Encodes with one writer schema, decodes any registered writer of the same record type into one reader schema."""

    def __init__(self, registry: SchemaRegistry, full_name: str, version: int | None = None) -> None:
        self.registry = registry
        self.schema = registry.get(full_name, version)
        self.full_name = self.schema.full_name
        self._header = self.schema.header

    def encode(self, record: Mapping[str, Any]) -> bytes:
        """Single-object encoding of ``record`` under this codec's schema. Raises SchemaEncodeError."""
        buffer = io.BytesIO()
        buffer.write(self._header)
        try:
            fastavro.schemaless_writer(buffer, self.schema.parsed, record)
        except Exception as exc:  # fastavro raises ValueError, TypeError, AttributeError, KeyError...
            raise SchemaEncodeError(f"{self.full_name} does not fit its schema: {exc!r}") from exc
        return buffer.getvalue()

    def writer_of(self, data: bytes) -> RegisteredSchema:
        """The registered writer schema named by ``data``'s header. Raises InvalidMessage subclasses."""
        if len(data) < HEADER_BYTES:
            if data[: len(MAGIC)] != MAGIC[: len(data)]:
                raise CorruptMessage(f"not a single-object message: starts {data[:2].hex() or 'empty'}")
            raise TruncatedMessage(f"{len(data)} bytes is shorter than the {HEADER_BYTES}-byte header")
        if data[:2] != MAGIC:
            raise CorruptMessage(f"not a single-object message: magic {data[:2].hex()} is not c301")
        (fingerprint,) = struct.unpack_from("<Q", data, 2)
        writer = self.registry.by_fingerprint(fingerprint)
        if writer is None:
            raise UnknownSchema(f"no known schema has fingerprint {fingerprint:016x}")
        return writer

    def decode(self, data: bytes) -> dict[str, Any]:
        """The record in ``data`` resolved to this codec's schema. Raises InvalidMessage subclasses only."""
        writer = self.writer_of(data)
        if writer.full_name != self.full_name:
            raise WrongRecordType(f"expected {self.full_name}, got {writer.full_name} v{writer.version}")
        return self.decode_body(data, writer)

    def decode_body(self, data: bytes, writer: RegisteredSchema) -> dict[str, Any]:
        """The body of ``data``, written with ``writer`` (its header already read: ``writer_of``), resolved to this
        codec's schema. Raises InvalidMessage subclasses only."""
        body = io.BytesIO(data)
        body.seek(HEADER_BYTES)
        reader = None if writer.fingerprint == self.schema.fingerprint else self.schema.parsed
        try:
            record = fastavro.schemaless_reader(body, writer.parsed, reader)
        except EOFError as exc:
            raise TruncatedMessage(f"{self.full_name} body ends early: {exc}") from exc
        except Exception as exc:  # fastavro signals bad bytes with many types (ValueError, IndexError, ...)
            raise CorruptMessage(f"{self.full_name} body does not decode: {type(exc).__name__}: {exc}") from exc
        if body.tell() != len(data):
            raise CorruptMessage(f"{len(data) - body.tell()} trailing bytes after the {self.full_name} body")
        return record


_DEFAULT_REGISTRY: SchemaRegistry | None = None


def default_registry() -> SchemaRegistry:
    """The registry of every schema shipped in ``schemas/avro`` (loaded once)."""
    global _DEFAULT_REGISTRY
    if _DEFAULT_REGISTRY is None:
        _DEFAULT_REGISTRY = SchemaRegistry.from_directory()
    return _DEFAULT_REGISTRY
