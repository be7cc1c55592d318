"""``gpumeter violations [--active] [--format table|json]``: the guard's violations as the topic holds them now.

Contract:

* ``read_violations(kafka, topic)`` reads every partition of the compacted violations topic from the beginning to
  the end offsets it had when the read began (``read_committed``), and keeps the latest record per key (the
  fingerprint: a key always lands in one partition, so offset order is time order). A tombstone removes its
  key. Records that cannot be decoded are counted and skipped, not fatal (the service dead-letters nothing it
  produces itself; a foreign writer is an operator's problem, reported on stderr).
* ``--active`` keeps only FIRING violations.
* Output (``format_violations``, pure): ``table`` for people (rich when available, else plain columns), ``json``
  for machines: a list of ``violation_json`` objects, firing before resolved, then by severity (critical first),
  rule and fingerprint.

Exit codes: 0 (also when there is nothing to show), 1 when Kafka cannot be read, 2 for unusable flags.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from gpumeter.config import load
from gpumeter.errors import ConfigError, GpumeterError, InvalidMessage
from gpumeter.settings import KafkaSettings
from schemas.records import Severity, Violation, ViolationState
from schemas.typed import codec_for
from gpumeter.clock import iso_utc

FORMATS = ("table", "json")
_SEVERITY_ORDER = {Severity.CRITICAL: 0, Severity.WARNING: 1, Severity.INFO: 2}
_STATE_ORDER = {ViolationState.FIRING: 0, ViolationState.RESOLVED: 1}


class ViolationsReadError(GpumeterError):
    """The violations topic could not be read (Kafka unreachable, topic missing, read timed out)."""


@dataclass(frozen=True)
class ViolationsView:
    """What the topic holds: the latest violation per fingerprint and how many records were unreadable."""

    violations: tuple[Violation, ...]
    records_read: int
    undecodable: int


def violation_json(violation: Violation) -> dict[str, Any]:
    """One violation as JSON: the fields of ``gpumeter replay``'s ``violations.jsonl`` objects
    (``services.guard.replay.violation_json``) but ``published_at``, which the topic does not keep: state and
    severity in lower case, subject names ``node`` and ``pod``, times as ISO 8601 UTC plus the exact
    ``*_unix_ms``."""
    return {
        "fingerprint": violation.fingerprint,
        "rule": violation.rule,
        "severity": violation.severity.value.lower(),
        "state": violation.state.value.lower(),
        "cluster": violation.cluster,
        "node": violation.node_name,
        "gpu_uuid": violation.gpu_uuid,
        "namespace": violation.namespace,
        "pod": violation.pod_name,
        "pod_uid": violation.pod_uid,
        "team": violation.team,
        "summary": violation.summary,
        "evidence": dict(sorted(violation.evidence.items())),
        "first_seen": iso_utc(violation.first_seen_unix_ms),
        "last_seen": iso_utc(violation.last_seen_unix_ms),
        "resolved_at": None if violation.resolved_at_unix_ms is None else iso_utc(violation.resolved_at_unix_ms),
        "first_seen_unix_ms": violation.first_seen_unix_ms,
        "last_seen_unix_ms": violation.last_seen_unix_ms,
        "resolved_at_unix_ms": violation.resolved_at_unix_ms,
    }


def latest_per_key(records: Iterable[tuple[bytes | None, bytes | None]]) -> tuple[dict[bytes, bytes], int]:
    """Compaction's view of ``(key, value)`` records in offset order: the last value per key, tombstones
    removing theirs. Returns it and the count of keyless records (ignored: compaction would reject them)."""
    latest: dict[bytes, bytes] = {}
    keyless = 0
    for key, value in records:
        if key is None:
            keyless += 1
        elif value is None:
            latest.pop(key, None)
        else:
            latest[key] = value
    return latest, keyless


def decode_latest(latest: Mapping[bytes, bytes]) -> tuple[list[Violation], int]:
    """Decode every latest value; returns the violations and how many values were not ``Violation`` records."""
    codec = codec_for(Violation)
    violations, undecodable = [], 0
    for value in latest.values():
        try:
            violations.append(codec.decode(value))
        except InvalidMessage:
            undecodable += 1
    return violations, undecodable


def sort_violations(violations: Iterable[Violation]) -> list[Violation]:
    return sorted(violations, key=lambda v: (_STATE_ORDER[v.state], _SEVERITY_ORDER[v.severity], v.rule,
                                             v.fingerprint))


async def read_violations(kafka: KafkaSettings, topic: str, *, timeout_s: float = 30.0) -> ViolationsView:
    """The latest violation per fingerprint on ``topic`` (see the module docstring)."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.errors import KafkaError
    from aiokafka.structs import TopicPartition

    from gpumeter.kafka.admin import partition_numbers

    try:
        numbers = (await partition_numbers(kafka, (topic,), timeout_s)).get(topic)
    except asyncio.TimeoutError as exc:
        raise ViolationsReadError(f"no answer from Kafka at {kafka.bootstrap_servers} in {timeout_s:g} s") from exc
    except (KafkaError, OSError) as exc:
        raise ViolationsReadError(f"cannot reach Kafka at {kafka.bootstrap_servers}: {exc!r}") from exc
    if not numbers:
        raise ViolationsReadError(f"topic {topic} does not exist on {kafka.bootstrap_servers}")
    consumer = AIOKafkaConsumer(**kafka.client_kwargs(), group_id=None, enable_auto_commit=False,
                                isolation_level="read_committed", auto_offset_reset="earliest")
    records: dict[int, list[tuple[bytes | None, bytes | None]]] = {}
    try:
        try:
            await asyncio.wait_for(consumer.start(), timeout_s)
        except (KafkaError, OSError) as exc:
            raise ViolationsReadError(f"cannot reach Kafka at {kafka.bootstrap_servers}: {exc!r}") from exc
        partitions = [TopicPartition(topic, p) for p in numbers]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)

        async def drain() -> None:
            while [tp for tp in partitions if await consumer.position(tp) < ends[tp]]:
                batch = await consumer.getmany(*partitions, timeout_ms=200)
                for tp, messages in batch.items():
                    for message in messages:
                        if message.offset < ends[tp]:
                            records.setdefault(tp.partition, []).append((message.key, message.value))

        await asyncio.wait_for(drain(), timeout_s)
    except asyncio.TimeoutError as exc:
        raise ViolationsReadError(f"reading {topic} from {kafka.bootstrap_servers} took over {timeout_s:g} s") from exc
    except (KafkaError, OSError) as exc:
        raise ViolationsReadError(f"cannot read {topic} from {kafka.bootstrap_servers}: {exc!r}") from exc
    finally:
        await consumer.stop()
    latest: dict[bytes, bytes] = {}
    read = 0
    for partition in sorted(records):
        part_latest, _ = latest_per_key(records[partition])
        latest.update(part_latest)
        read += len(records[partition])
    violations, undecodable = decode_latest(latest)
    return ViolationsView(violations=tuple(sort_violations(violations)), records_read=read, undecodable=undecodable)


_TABLE_COLUMNS = ("STATE", "SEVERITY", "RULE", "NODE", "GPU", "NAMESPACE/POD", "FIRST SEEN", "LAST SEEN",
                  "SUMMARY")


def _row(violation: Violation) -> tuple[str, ...]:
    if violation.namespace and violation.pod_name:
        subject = f"{violation.namespace}/{violation.pod_name}"
    else:
        subject = violation.namespace or violation.pod_name or violation.team or "-"
    last = (iso_utc(violation.resolved_at_unix_ms) if violation.state is ViolationState.RESOLVED
            and violation.resolved_at_unix_ms is not None else iso_utc(violation.last_seen_unix_ms))
    return (violation.state.value.lower(), violation.severity.value.lower(), violation.rule,
            violation.node_name or "-", violation.gpu_uuid or "-", subject, iso_utc(violation.first_seen_unix_ms),
            last, violation.summary)


def _plain_table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(column), *(len(row[i]) for row in rows)) for i, column in enumerate(_TABLE_COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(_TABLE_COLUMNS, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines) + "\n"


def format_violations(violations: Sequence[Violation], fmt: str = "table", *, use_rich: bool = True) -> str:
    """``json``: a list of ``violation_json`` objects; ``table``: one row per violation (or a line saying there
    are none). Pure."""
    if fmt == "json":
        return json.dumps([violation_json(v) for v in violations], indent=2, sort_keys=False) + "\n"
    if fmt != "table":
        raise ConfigError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if not violations:
        return "no violations\n"
    rows = [_row(v) for v in violations]
    if use_rich:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            use_rich = False
    if not use_rich:
        return _plain_table(rows)
    table = Table(*_TABLE_COLUMNS, show_lines=False)
    for row in rows:
        table.add_row(*row)
    buffer = io.StringIO()
    Console(file=buffer, width=200, color_system=None, force_terminal=False).print(table)
    return buffer.getvalue()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--active", action="store_true", help="only firing violations")
    parser.add_argument("--format", choices=FORMATS, default="table", help="table (default) or json")
    parser.add_argument("--bootstrap-servers", help="Kafka bootstrap servers (env KAFKA_BOOTSTRAP_SERVERS)")
    parser.add_argument("--topic-prefix", help="prefix of every topic name (env GPUMETER_KAFKA_TOPIC_PREFIX)")
    parser.add_argument("--timeout", dest="timeout_seconds", type=float, default=30.0,
                        help="seconds to wait for Kafka (default 30)")


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    try:
        kafka = load(KafkaSettings, args, env, defaults={"client_id": "gpumeter-violations"})
        if args.timeout_seconds <= 0:
            raise ConfigError("the timeout must be > 0 seconds")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        view = asyncio.run(read_violations(kafka, kafka.catalog.violations, timeout_s=args.timeout_seconds))
    except GpumeterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if view.undecodable:
        print(f"warning: {view.undecodable} records on {kafka.catalog.violations} are not Violation records "
              "(skipped)", file=sys.stderr)
    violations = [v for v in view.violations if not args.active or v.state is ViolationState.FIRING]
    sys.stdout.write(format_violations(violations, args.format))
    sys.stdout.flush()
    return 0
