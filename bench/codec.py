"""Codec: single-object Avro encode/decode per record type against JSON (stdlib), and bytes per message.

For every record type gpumeter puts on a topic, one realistic record (a ``NodeSample`` of 8 GPUs × 8 processes
with 64-hex container ids, a ``PodEvent`` with its device assignment, a ``GpuShare`` and a ``CostRecord`` out of
the real engine and billing on that fleet, a ``Violation``, a ``DeadLetter`` carrying a whole ``NodeSample``) is
encoded and decoded by:

* **avro** — ``schemas.typed.codec_for(T)``: typed record ↔ single-object Avro bytes, what the services run;
* **json** — the baseline: the same record's ``to_avro()`` dict through ``json.dumps``/``json.loads`` and back to
  the typed record with ``from_avro`` (bytes fields as base64 text, which JSON needs), so both sides do the same
  typed-record work and differ only in the serialisation;
* **avro-hinted** — the proposed fix (``docs/performance.md``): the same Avro wire bytes, but with the writer
  schema parsed the way fastavro caches it (``parse_schema`` with its default write hint) instead of
  ``_write_hint=False``, which makes fastavro re-parse the schema on every call. The run checks that the hinted
  variant produces byte-identical messages with the same fingerprint.

Each figure is µs per record (best of the repetitions, CPU time), and the message size in bytes.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import fastavro
from fastavro.schema import to_parsing_canonical_form

from schemas.codec import HEADER_BYTES
from schemas.packed import PackedNodeSample
from schemas.records import (
    DeadLetter,
    NodeSample,
    Severity,
    ShareSubjectKind,
    Violation,
    ViolationState,
)
from schemas.typed import codec_for
from services.billing.catalog import bundled_catalog
from services.billing.costing import bill_node_window

from bench.attribution import build_input, engine_with_pods, run_engine, share_rows
from bench.common import Target, alternate

_BYTES_FIELDS = {DeadLetter: ("source_key", "raw_bytes")}


def sample_records() -> dict[str, Any]:
    """One realistic record of every type, from the benchmark fleet through the real engine and billing."""
    data = build_input(nodes=1, ticks=61)
    shares = [s for s in share_rows(run_engine(engine_with_pods(data), data.avro_messages))
              if s.window_start_unix_ms == data.fleet.start_unix_ms]
    pod_share = next(s for s in shares if s.subject_kind is ShareSubjectKind.POD)
    priced = bill_node_window(shares, bundled_catalog())
    pod_cost = next(c for c in priced.costs if c.pod_uid == pod_share.pod_uid)
    sample = data.fleet.node_sample(0, 30)
    violation = Violation(
        fingerprint="5f0c2a9e4b7d1c3a",
        rule="gpu_memory_over_request",
        severity=Severity.WARNING,
        state=ViolationState.FIRING,
        cluster=sample.cluster,
        node_name=sample.node_name,
        gpu_uuid=pod_share.gpu_uuid,
        namespace=pod_share.namespace,
        pod_name=pod_share.pod_name,
        pod_uid=pod_share.pod_uid,
        team=pod_share.labels.get("team"),
        summary=f"{pod_share.namespace}/{pod_share.pod_name} holds 31% of {pod_share.gpu_uuid} with 1 of 8 replicas",
        evidence={"memory_share": 0.31, "replica_share": 0.125, "window_seconds": 60.0},
        first_seen_unix_ms=sample.sampled_at_unix_ms - 300_000,
        last_seen_unix_ms=sample.sampled_at_unix_ms,
        resolved_at_unix_ms=None,
    )
    dead_letter = DeadLetter(
        reason_code="LATE",
        reason=f"tick {sample.collector_started_at_unix_ms}/{sample.sequence} of node {sample.node_name} belongs to "
               "a window that is already closed",
        error_type="LateMessage",
        service="attributor",
        source_topic="gpumeter.node-samples.v1",
        source_partition=7,
        source_offset=123_456_789,
        source_key=sample.node_name.encode(),
        raw_bytes=codec_for(NodeSample).encode(sample),
        failed_at_unix_ms=sample.sampled_at_unix_ms + 75_000,
    )
    return {
        "NodeSample": sample,
        "PodEvent": data.pod_events[0],
        "GpuShare": pod_share,
        "CostRecord": pod_cost,
        "Violation": violation,
        "DeadLetter": dead_letter,
    }


# ---------------------------------------------------------------------------------------------------------------
# the variants


def _json_safe(record_type: type, d: dict[str, Any]) -> dict[str, Any]:
    for name in _BYTES_FIELDS.get(record_type, ()):
        if d[name] is not None:
            d[name] = base64.b64encode(d[name]).decode("ascii")
    return d


def _json_restore(record_type: type, d: dict[str, Any]) -> dict[str, Any]:
    for name in _BYTES_FIELDS.get(record_type, ()):
        if d[name] is not None:
            d[name] = base64.b64decode(d[name])
    return d


@dataclass(frozen=True)
class Variant:
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]


def avro_variant(record_type: type) -> Variant:
    codec = codec_for(record_type)
    return Variant(codec.encode, codec.decode)


def json_variant(record_type: type) -> Variant:
    def encode(record: Any) -> bytes:
        return json.dumps(_json_safe(record_type, record.to_avro())).encode()

    def decode(data: bytes) -> Any:
        return record_type.from_avro(_json_restore(record_type, json.loads(data)))

    return Variant(encode, decode)


def hinted_variant(record_type: type) -> Variant:
    """The proposed fix: fastavro's own cached parse of the same writer schema (same bytes on the wire)."""
    codec = codec_for(record_type)
    registered = codec.avro.schema
    hinted = fastavro.parse_schema(dict(registered.schema_json))
    if to_parsing_canonical_form(hinted) != registered.canonical_form:
        raise AssertionError(f"{record_type.__name__}: the hinted schema has another canonical form")
    header = registered.header
    # NodeSample's wire record is v4, packed columns (schemas.packed); every other type's is its to_avro dict.
    if record_type is NodeSample:
        to_wire = lambda r: PackedNodeSample.from_node_sample(r).to_avro()  # noqa: E731
        from_wire = lambda d: PackedNodeSample.from_avro(d).to_node_sample()  # noqa: E731
    else:
        to_wire, from_wire = (lambda r: r.to_avro()), record_type.from_avro

    def encode(record: Any) -> bytes:
        buffer = io.BytesIO()
        buffer.write(header)
        fastavro.schemaless_writer(buffer, hinted, to_wire(record))
        return buffer.getvalue()

    def decode(data: bytes) -> Any:
        body = io.BytesIO(data)
        body.seek(HEADER_BYTES)
        return from_wire(fastavro.schemaless_reader(body, hinted, None))

    return Variant(encode, decode)


def _loop(fn: Callable[[Any], Any], arg: Any, iterations: int) -> Callable[[Any], None]:
    def body(_: Any) -> None:
        for _ in range(iterations):
            fn(arg)
    return body


def measure(iterations: Mapping[str, int] | int, repeats: int) -> dict[str, Any]:
    """µs per encode and decode of each record type for each variant, and bytes per message.

    ``iterations``: calls per timed run (per record type, or one number for all)."""
    records = sample_records()
    out: dict[str, Any] = {}
    for name, record in records.items():
        record_type = type(record)
        n = iterations if isinstance(iterations, int) else iterations[name]
        variants = {"avro": avro_variant(record_type), "json": json_variant(record_type),
                    "avro_hinted": hinted_variant(record_type)}
        messages = {v: variant.encode(record) for v, variant in variants.items()}
        for v, variant in variants.items():
            if variant.decode(messages[v]) != record:
                raise AssertionError(f"{name}: {v} does not round-trip")
        if messages["avro_hinted"] != messages["avro"]:
            raise AssertionError(f"{name}: the hinted encoder writes other bytes")
        runs = []
        for v, variant in variants.items():
            runs.append((f"{v}.encode", lambda: None, _loop(variant.encode, record, n)))
            runs.append((f"{v}.decode", lambda: None, _loop(variant.decode, messages[v], n)))
        series = alternate(runs, repeats)
        figures: dict[str, Any] = {"iterations": n}
        for v in variants:
            figures[v] = {
                "bytes": len(messages[v]),
                "encode_us": round(series[f"{v}.encode"].best_cpu_s / n * 1e6, 2),
                "decode_us": round(series[f"{v}.decode"].best_cpu_s / n * 1e6, 2),
                "encode_us_median": round(series[f"{v}.encode"].median_cpu_s / n * 1e6, 2),
                "decode_us_median": round(series[f"{v}.decode"].median_cpu_s / n * 1e6, 2),
            }
        figures["avro_bytes_vs_json"] = round(len(messages["avro"]) / len(messages["json"]), 3)
        figures["avro_decode_vs_json"] = round(figures["avro"]["decode_us"] / max(figures["json"]["decode_us"],
                                                                                  1e-9), 2)
        figures["hinted_decode_saving_us"] = round(figures["avro"]["decode_us"] - figures["avro_hinted"]["decode_us"],
                                                   2)
        out[name] = figures
    return out


ITERATIONS = {"NodeSample": 400, "PodEvent": 3000, "GpuShare": 5000, "CostRecord": 5000, "Violation": 5000,
              "DeadLetter": 3000}


def run(quick: bool) -> tuple[dict[str, Any], list[Target], list[str]]:
    iterations = {k: max(v // 5, 20) for k, v in ITERATIONS.items()} if quick else ITERATIONS
    figures = measure(iterations, repeats=3 if quick else 7)
    node = figures["NodeSample"]
    notes = [
        "json = the record's to_avro() dict through the stdlib json module and back through from_avro (bytes as "
        "base64): the same typed-record work as avro, a different serialisation",
        "avro_hinted = the proposed codec fix (same bytes on the wire, checked): fastavro's cached schema parse",
    ]
    targets = [Target(
        "codec (no numeric target)", "measure Avro vs JSON per record",
        f"NodeSample 8x8: {node['avro']['bytes']:,} B Avro vs {node['json']['bytes']:,} B JSON; decode "
        f"{node['avro']['decode_us']} us vs {node['json']['decode_us']} us",
        True,
    )]
    return figures, targets, notes
