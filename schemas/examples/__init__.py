"""Example payloads for every record type; see README.md in this folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from schemas.records import RECORD_TYPES

EXAMPLES_DIR = Path(__file__).parent


def _bytes_fields(record_type: type) -> tuple[str, ...]:
    return tuple(n for n, t in record_type.__annotations__.items() if "bytes" in str(t))


def example_versions(record_name: str) -> tuple[int, ...]:
    """The versions of ``record_name`` that ship example payloads, oldest first."""
    prefix = f"{record_name}.v"
    return tuple(sorted(int(p.name[len(prefix):-len(".json")]) for p in EXAMPLES_DIR.glob(f"{prefix}*.json")))


def load_example_dicts(record_name: str, version: int | None = None) -> list[dict[str, Any]]:
    """The example records of ``record_name`` (e.g. "NodeSample") as Avro dicts of ``version`` (None: the newest
    version with examples)."""
    if version is None:
        version = example_versions(record_name)[-1]
    records = json.loads((EXAMPLES_DIR / f"{record_name}.v{version}.json").read_text())
    record_type = RECORD_TYPES[f"gpumeter.{record_name}"]
    for record in records:
        for name in _bytes_fields(record_type):
            if isinstance(record.get(name), str):
                record[name] = record[name].encode("latin-1")
    return records


def load_examples(record_type: type, version: int | None = None) -> list[Any]:
    """The example records of ``record_type`` as typed records (``version`` as in ``load_example_dicts``)."""
    return [record_type.from_avro(d) for d in load_example_dicts(record_type.__name__, version)]
