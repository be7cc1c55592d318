"""Example payloads for every record type; see README.md in this folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from schemas.codec import AVRO_DIR
from schemas.packed import OBJECT_VERSION

# Record types whose newest version is not the one their record class's from_avro reads (schemas.packed).
OBJECT_VERSIONS = {"NodeSample": OBJECT_VERSION}

EXAMPLES_DIR = Path(__file__).parent


def _bytes_fields(record_name: str, version: int) -> tuple[str, ...]:
    """The top-level ``bytes`` fields of ``record_name`` at ``version``, from its ``.avsc``."""
    schema = json.loads((AVRO_DIR / f"{record_name}.v{version}.avsc").read_text())
    return tuple(f["name"] for f in schema["fields"] if f["type"] == "bytes" or "bytes" in f["type"])


def example_versions(record_name: str) -> tuple[int, ...]:
    """The versions of ``record_name`` that ship example payloads, oldest first."""
    prefix = f"{record_name}.v"
    return tuple(sorted(int(p.name[len(prefix):-len(".json")]) for p in EXAMPLES_DIR.glob(f"{prefix}*.json")))


def load_example_dicts(record_name: str, version: int | None = None) -> list[dict[str, Any]]:
    """The example records of ``record_name`` (e.g. "NodeSample") as Avro dicts of ``version`` (None: the newest
    version with examples that the record class's ``from_avro`` reads: NodeSample v3, v4 being packed columns)."""
    if version is None:
        newest = OBJECT_VERSIONS.get(record_name)
        version = max(v for v in example_versions(record_name) if newest is None or v <= newest)
    records = json.loads((EXAMPLES_DIR / f"{record_name}.v{version}.json").read_text())
    for record in records:
        for name in _bytes_fields(record_name, version):
            if isinstance(record.get(name), str):
                record[name] = record[name].encode("latin-1")
    return records


def load_examples(record_type: type, version: int | None = None) -> list[Any]:
    """The example records of ``record_type`` as typed records (``version`` as in ``load_example_dicts``)."""
    return [record_type.from_avro(d) for d in load_example_dicts(record_type.__name__, version)]
