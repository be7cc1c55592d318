"""Offline replay: the stream's three services on their own runners over an in-memory broker.

``replay(input_path, out_dir, ...)`` reads a **scenario** (YAML, run through the simulator and the collector's
real sampling code by ``services.collector.simulation.node_streams``) or a **recording** (below), produces every
input message to a ``MemoryBroker`` (``gpumeter.stream.memory``) as the collectors produce it to Kafka -- samples
keyed by node, pod events by ``<node>/<uid>``, stamped with the time the attributor received them; a recorded frame
that does not decode goes, bytes unchanged, where a sample would -- and runs the attributor's, billing's and the
guard's processors (``AttributorProcessor``, ``BillingProcessor`` with its ``LedgerStore`` on an in-memory SQLite
ledger, ``GuardProcessor``) each under the ``MessageRunner`` it runs under in the stream, through a
``MemoryDriver``. So replay decodes, checks, dead-letters, attributes, prices, bills and guards exactly as the
stream does, bad input included: a message the stream would dead-letter is dead-lettered here, by the same
service, with the same reason. It writes:

``shares.jsonl``
    One object per ``GpuShare`` row of every ``NodeWindowShares`` the attributor emitted (see ``share_json``): at
    least ``window_start`` (ISO 8601 UTC), ``window_seconds``, ``node``, ``gpu_uuid`` (GPU or MIG instance),
    ``subject_kind`` (``pod`` | ``idle`` | ``driver_reserved`` | ``unattributed``), ``pod_uid`` (null for
    buckets), ``namespace``, ``pod``, ``memory_share``, ``compute_share``, ``cost_share``, ``method``; plus every
    other ``GpuShare`` field.
``costs.jsonl``
    One object per ``CostRecord`` billing published (``services.billing.costing.cost_record_json``):
    ``window_start``, ``node``, ``gpu_uuid`` (null for node-level lines), ``subject_kind`` (the four above or
    ``node_other``), ``pod_uid``, ``namespace``, ``labels``, ``cost_micro_usd``, ... Per node-window they add up
    to the bill exactly.
``bills.jsonl``
    One object per node-window billing's ledger took as a new bill (``NodeBill.as_json``): ``node``,
    ``window_start``, ``window_seconds``, ``instance_type``, ``price_per_hour_usd``, ``node_cost_micro_usd``, and
    the GPU / node_other split.
``dead_letters.jsonl``
    Every dead letter any of the three services wrote, in service order (attributor, billing, guard), each as
    ``dead_letter_json``: ``service``, ``reason_code`` (``LATE``, ``OUT_OF_RANGE``, ``CORRUPT``, ``NO_PRICE``,
    ...), ``reason``, ``source_topic``, ``source_offset``, ``input`` (the recording frame, when it was one).
    Bytes on the node-samples topic that do not decode are dead-lettered by both services that read it (the
    attributor and the guard), as in the stream. Empty for a clean, priced input.
``truth.jsonl`` (scenarios only)
    The simulator's ground truth on the same windows and units, over the ticks the attributor took (defined in
    ``pipeline/truth.py``).
``violations.jsonl``
    Every record the guard published on its violations topic, in order (``services.guard.replay.violation_json``):
    ``rule``, ``state`` (``firing`` | ``resolved``), ``severity``, ``node``, ``gpu_uuid``, ``namespace``, ``pod``,
    ``fingerprint``, ``first_seen``, ``last_seen``, ``resolved_at``, ``published_at`` (ISO 8601 UTC),
    ``evidence``, ...

Every file is written in a deterministic order with sorted keys: the same input and options give byte-identical
files.

How the services are driven (what their streaming drivers do, with the input's own time as the clock)
----------------------------------------------------------------------------------------------------
The input is put on the broker a chunk at a time (``CHUNK_MESSAGES`` messages, to the end of the chunk's last
instant): the attributor, billing and the guard each read everything on the broker, in that order, the outputs
are written, and the broker forgets the chunk (``MemoryBroker.trim``) -- memory holds one chunk of input and what
it produced, not the run (the ledger, the services' own state and the output's dead letters excepted). As no
service stamps what it produces later than the instant it reads, after a chunk every message up to its last
instant has been read by every service and none earlier can come, so the chunks change nothing of the output
(``tests/unit/pipeline/test_replay_chunks.py``). Records decoded from the broker's bytes are shared for the chunk
by the three runners and the output (``MessageRunner(decoded=...)``); a recorded frame goes on the broker as its
recorded bytes, decoded once.

Each service reads its input topics in the order a caught-up consumer would (by time; at one instant in the
order of its inputs: pod events before samples, then node-window shares and costs). Before each message the
service's clock is the message's time, and at each new instant its timer runs first (``on_clock``), as a perfectly
punctual timer with the input caught up. What a service produces is stamped with the time it was produced at, so
the next service reads it when the stream would. At the end of input the attributor's timer runs at ``last time +
window + grace + idle_close`` rather than a flush: that is the instant at which the streaming timer would have
closed every open window, so both paths close the last windows through the same rule; the guard's timer runs there
too, without judging the nodes silent (the end of the input is not their silence).

The recording format is defined in ``pipeline/recordings.py``.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from json.encoder import encode_basestring
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from gpumeter.clock import ManualClock, iso_utc
from gpumeter.errors import ConfigError
from gpumeter.stream.deadletter import RawMessage
from gpumeter.stream.contract import Emit, Settled
from gpumeter.stream.memory import MemoryBroker, MemoryDriver
from gpumeter.stream.runner import MessageRunner
from pipeline.recordings import (
    RECORDING_MAGIC_V1,
    RECORDING_MAGIC_V2,
    RECORDING_SUFFIX,
    EncodedInput,
    InputRecord,
    InvalidInput,
    RecordingWriter,
    is_recording,
    recorded_inputs,
    scenario_encoded_records,
    scenario_nodes,
    scenario_records,
)
from pipeline.truth import TruthAccumulator
from schemas.catalog import ALL_TOPICS, TopicCatalog, pod_event_key
from schemas.pods import GroupingLabelSources
from schemas.records import CostRecord, DeadLetter, GpuShare, NodeSample, NodeWindowShares, PodEvent, Violation
from schemas.typed import codec_for
from services.attributor.attribution import AttributionPolicy
from services.attributor.engine import EngineConfig
from services.attributor.pod_index import DEFAULT_GROUPING_LABELS, DEFAULT_LINGER_MS
from services.attributor.processor import POD_EVENTS, SAMPLES, AttributorProcessor
from services.attributor.processor import input_topics as attributor_inputs
from services.attributor.processor import output_topics as attributor_outputs
from services.billing.catalog import PriceCatalog, bundled_catalog
from services.billing.costing import cost_record_json
from services.billing.ledger import Ledger
from services.billing.pricing import DEFAULT_SPLIT_POLICY, SplitPolicy
from services.billing.service import SERVICE_NAME as SERVICE_NAME_BILLING
from services.billing.service import BillingProcessor, LedgerStore, NoPrice, billing_inputs, billing_outputs
from services.billing.sharing import KEEP_ALL, SharingPolicy
from services.guard.config import GuardConfig
from services.guard.processor import GuardProcessor, guard_outputs, guard_topics
from services.guard.replay import VIOLATIONS_FILE, violation_json

SHARES_FILE = "shares.jsonl"
TRUTH_FILE = "truth.jsonl"
COSTS_FILE = "costs.jsonl"
BILLS_FILE = "bills.jsonl"
DEAD_LETTERS_FILE = "dead_letters.jsonl"

DEFAULT_BATCH_SIZE = 2000
"""Messages of one instant a replayed processor handles at once, by default (the output is the same for any).
As the Kafka driver's fetch (``max_poll_records`` 2000): billing writes every node-window of one instant in one
``Ledger.write`` instead of one each (a third of billing's time at one a batch)."""

REPLAY_STAGES = ("input", "ledger_setup", "attributor", "billing", "guard", "output")
"""Replay's stages, in order, as ``on_stage`` names them: reading the input (decoding recorded frames or running
the simulator and the collector's sampling code) and producing it to the broker; creating the in-memory ledger;
each service's processor over its input; writing the output files (decoding the topics, the truth)."""

INPUT_SCENARIO = "scenario"
INPUT_RECORDING = "recording"

# ----------------------------------------------------------------------------------------------------------------
# JSON lines


_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
"""Every output line's encoder (made once: ``json.dumps`` with options makes one per call)."""


def _dumps(obj: Mapping[str, Any]) -> str:
    return _ENCODER.encode(obj)


def _value_json(value: Any) -> str:
    """``value`` as ``_dumps`` writes it inside an object, byte for byte (the common types without the encoder's
    per-call set-up: ``float.__repr__``, ``int.__repr__``, ``encode_basestring``, as ``json``'s encoder does)."""
    kind = type(value)
    if kind is float:
        if value != value or value in (math.inf, -math.inf):
            raise ValueError(f"Out of range float values are not JSON compliant: {value!r}")
        return float.__repr__(value)
    if kind is str:
        return encode_basestring(value)
    if kind is int:
        return int.__repr__(value)
    if value is None:
        return "null"
    return _ENCODER.encode(value)


def _field(key: str, value: Any) -> str:
    """One ``"key":value`` member of a ``_dumps`` object."""
    return f"{encode_basestring(key)}:{_value_json(value)}"


def share_json(share: GpuShare) -> dict[str, Any]:
    """The ``shares.jsonl`` object of one ``GpuShare`` (enum values in lower case, times in ISO 8601 UTC)."""
    return {
        "window_start": iso_utc(share.window_start_unix_ms),
        "window_start_unix_ms": share.window_start_unix_ms,
        "window_seconds": share.window_seconds,
        "cluster": share.cluster,
        "node": share.node_name,
        "cloud_provider": share.cloud_provider,
        "region": share.region,
        "instance_type": share.instance_type,
        "price_model": share.price_model,
        "node_covered_seconds": share.node_covered_seconds,
        "units_in_node": share.units_in_node,
        "rows_in_unit": share.rows_in_unit,
        "gpu_uuid": share.gpu_uuid,
        "parent_gpu_uuid": share.parent_gpu_uuid,
        "gpu_model": share.gpu_model,
        "gpu_fraction": share.gpu_fraction,
        "sharing_mode": share.sharing_mode.value.lower(),
        "subject_kind": share.subject_kind.value.lower(),
        "pod_uid": share.pod_uid,
        "namespace": share.namespace,
        "pod": share.pod_name,
        "labels": dict(share.labels),
        "workload_kind": share.workload_kind,
        "workload_name": share.workload_name,
        "memory_used_bytes_avg": share.memory_used_bytes_avg,
        "memory_share": share.memory_share,
        "compute_share": share.compute_share,
        "cost_share": share.cost_share,
        "method": share.method,
        "sample_count": share.sample_count,
        "covered_seconds": share.covered_seconds,
        "mig_profile": share.mig_profile,
        "mig_gpu_instance_id": share.mig_gpu_instance_id,
    }


class _KeptFields:
    """``_field`` for objects whose values repeat from line to line (a cost line's window, node, pod, labels): the
    members of strings, ints, None and string-keyed label maps are kept, at most ``limit`` of them (then
    forgotten), and ``line(obj)`` is ``_dumps(obj)``, byte for byte, for an object with the keys ``keys``."""

    def __init__(self, keys: Sequence[str], limit: int = 200_000) -> None:
        self._keys = tuple(sorted(keys))
        self._key_set = frozenset(keys)
        self._kept: dict[tuple[str, Any], str] = {}
        self._limit = limit

    def field(self, key: str, value: Any) -> str:
        kind = type(value)
        if kind is str or kind is int or value is None:
            kept_key: tuple[str, Any] = (key, value)  # never a float: 1 == 1.0 but they are written apart
        elif kind is dict and all(type(v) is str for v in value.values()):
            kept_key = (key, tuple(value.items()))
        else:
            return _field(key, value)
        member = self._kept.get(kept_key)
        if member is None:
            if len(self._kept) >= self._limit:
                self._kept.clear()
            member = self._kept[kept_key] = _field(key, value)
        return member

    def line(self, obj: Mapping[str, Any]) -> str:
        if obj.keys() != self._key_set:
            return _dumps(obj)
        field = self.field
        return "{" + ",".join([field(key, obj[key]) for key in self._keys]) + "}"


_SHARE_WINDOW_KEYS = ("window_start", "window_start_unix_ms", "window_seconds", "cluster", "node", "cloud_provider",
                      "region", "instance_type", "price_model", "node_covered_seconds", "units_in_node")
_SHARE_UNIT_KEYS = ("rows_in_unit", "gpu_uuid", "parent_gpu_uuid", "gpu_model", "gpu_fraction", "sharing_mode",
                    "method", "sample_count", "covered_seconds", "mig_profile", "mig_gpu_instance_id")
_SHARE_POD_KEYS = ("pod_uid", "namespace", "pod", "labels", "workload_kind", "workload_name")
_SHARE_ROW_KEYS = ("subject_kind", "memory_used_bytes_avg", "memory_share", "compute_share", "cost_share")
_SHARE_KEYS = tuple(sorted(_SHARE_WINDOW_KEYS + _SHARE_UNIT_KEYS + _SHARE_POD_KEYS + _SHARE_ROW_KEYS))
_COST_KEYS = ("window_start", "window_seconds", "cluster", "node", "gpu_uuid", "subject_kind", "pod_uid", "namespace",
              "pod", "labels", "cost_share", "cost_micro_usd", "instance_type", "price_model", "price_version",
              "shared_from", "sharing_method", "method", "cost_basis", "memory_share", "compute_share",
              "gpu_fraction")
_NO_POD = {key: _field(key, {} if key == "labels" else None) for key in _SHARE_POD_KEYS}


def share_lines(record: NodeWindowShares) -> list[str]:
    """The ``shares.jsonl`` lines (without their newline) of one node-window: byte for byte
    ``_dumps(share_json(row))`` for each row of ``record.rows()``, in that order, built from the record's
    columns -- what the window, a unit and a pod have in common is encoded once, not once per row."""
    window = {
        "window_start": _field("window_start", iso_utc(record.window_start_unix_ms)),
        "window_start_unix_ms": _field("window_start_unix_ms", record.window_start_unix_ms),
        "window_seconds": _field("window_seconds", record.window_seconds),
        "cluster": _field("cluster", record.cluster),
        "node": _field("node", record.node_name),
        "cloud_provider": _field("cloud_provider", record.cloud_provider),
        "region": _field("region", record.region),
        "instance_type": _field("instance_type", record.instance_type),
        "price_model": _field("price_model", record.price_model),
        "node_covered_seconds": _field("node_covered_seconds", record.node_covered_seconds),
        "units_in_node": _field("units_in_node", len(record.units)),
    }
    pods = [{
        "pod_uid": _field("pod_uid", pod.pod_uid),
        "namespace": _field("namespace", pod.namespace),
        "pod": _field("pod", pod.pod_name),
        "labels": _field("labels", dict(pod.labels)),
        "workload_kind": _field("workload_kind", pod.workload_kind),
        "workload_name": _field("workload_name", pod.workload_name),
    } for pod in record.pods]
    kinds: dict[Any, str] = {}
    lines: list[str] = []
    for unit in record.units:
        rows_in_unit = len(unit.subject_kinds)
        base = {
            **window,
            "rows_in_unit": _field("rows_in_unit", rows_in_unit),
            "gpu_uuid": _field("gpu_uuid", unit.gpu_uuid),
            "parent_gpu_uuid": _field("parent_gpu_uuid", unit.parent_gpu_uuid),
            "gpu_model": _field("gpu_model", unit.gpu_model),
            "gpu_fraction": _field("gpu_fraction", unit.gpu_fraction),
            "sharing_mode": _field("sharing_mode", unit.sharing_mode.value.lower()),
            "method": _field("method", unit.method),
            "sample_count": _field("sample_count", unit.sample_count),
            "covered_seconds": _field("covered_seconds", unit.covered_seconds),
            "mig_profile": _field("mig_profile", unit.mig_profile),
            "mig_gpu_instance_id": _field("mig_gpu_instance_id", unit.mig_gpu_instance_id),
        }
        for i in range(rows_in_unit):
            index = unit.subject_pod_index[i]
            kind = unit.subject_kinds[i]
            kind_field = kinds.get(kind)
            if kind_field is None:
                kind_field = kinds[kind] = _field("subject_kind", kind.value.lower())
            fields = {
                **base,
                **(pods[index] if index >= 0 else _NO_POD),
                "subject_kind": kind_field,
                "memory_used_bytes_avg": _field("memory_used_bytes_avg", unit.memory_used_bytes_avg[i]),
                "memory_share": _field("memory_share", unit.memory_share[i]),
                "compute_share": _field("compute_share", unit.compute_share[i]),
                "cost_share": _field("cost_share", unit.cost_share[i]),
            }
            lines.append("{" + ",".join([fields[key] for key in _SHARE_KEYS]) + "}")
    return lines


# ----------------------------------------------------------------------------------------------------------------
# Replay


@dataclass(frozen=True, slots=True)
class UnpricedWindow:
    """A node-window billing could not price (no catalog row): its shares are written, its costs are not."""

    cluster: str
    node_name: str
    window_start_unix_ms: int
    reason: str


@dataclass(frozen=True, slots=True)
class ReplaySummary:
    """What one replay read and wrote. ``files`` maps each output name to its path."""

    input_kind: str
    nodes: tuple[str, ...]
    samples: int
    pod_events: int
    windows: int
    share_rows: int
    truth_rows: int
    cost_rows: int
    bills: int
    node_cost_micro_usd: int
    dead_letters: Mapping[str, int]
    unpriced: tuple[UnpricedWindow, ...]
    duplicates_ignored: int
    recorded: int
    files: Mapping[str, Path]
    violation_rows: int = 0
    violations_firing_at_end: int = 0

    @property
    def dead_letter_count(self) -> int:
        return sum(self.dead_letters.values())


def _is_scenario_path(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in (".yaml", ".yml")


class _Outputs:
    """The output files, opened together and written line by line."""

    def __init__(self, out_dir: Path, with_truth: bool) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        names = [SHARES_FILE, COSTS_FILE, BILLS_FILE, DEAD_LETTERS_FILE, VIOLATIONS_FILE] + (
            [TRUTH_FILE] if with_truth else [])
        if not with_truth:
            # A truth left by an earlier scenario replay into this folder would not belong to these shares.
            (out_dir / TRUTH_FILE).unlink(missing_ok=True)
        self.paths = {name: out_dir / name for name in names}
        self._files = {name: open(path, "w", encoding="utf-8", newline="\n") for name, path in self.paths.items()}
        self.counts: Counter[str] = Counter()

    def write(self, name: str, obj: Mapping[str, Any]) -> None:
        self._files[name].write(_dumps(obj) + "\n")
        self.counts[name] += 1

    def write_lines(self, name: str, lines: Sequence[str]) -> None:
        """Lines already encoded as ``write`` would encode them (without their newline)."""
        if lines:
            self._files[name].write("\n".join(lines) + "\n")
            self.counts[name] += len(lines)

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()


REPLAY_TOPICS = TopicCatalog(prefix="replay.")
"""The topics of replay's in-memory broker (one partition each: one consumer reads them all, in order)."""


CHUNK_MESSAGES = 20_000
"""Input messages replay puts on its broker at a time (the chunk goes on to the end of its last instant): each
service reads the chunk, the output is written and the broker forgets it, so memory holds one chunk, not the run."""


_Input = InputRecord | InvalidInput | EncodedInput


def _chunks(items: Iterable[_Input], size: int) -> Iterator[list[_Input]]:
    """``items`` (in received order) cut into lists of at least ``size`` -- the last one fewer -- never inside an
    instant: every message of a received time is in one chunk."""
    chunk: list[_Input] = []
    for item in items:
        if len(chunk) >= size and item.received_at_unix_ms != chunk[-1].received_at_unix_ms:
            yield chunk
            chunk = []
        chunk.append(item)
    if chunk:
        yield chunk


def _records(broker: MemoryBroker, topic: str, record_type: type,
             decoded: Mapping[tuple[type, bytes], Any]) -> Iterator[Any]:
    """The records of ``topic``, decoded once: taken from ``decoded`` where a runner decoded the same bytes."""
    codec = codec_for(record_type)
    for message in broker.messages(topic, 0):
        record = decoded.get((record_type, message.value))
        yield record if record is not None else codec.decode(message.value)


def dead_letter_json(letter: DeadLetter, input_source: str | None = None) -> dict[str, Any]:
    """The ``dead_letters.jsonl`` object of one dead letter: which service refused what and why (``service``,
    ``reason_code``, ``reason``, ``error_type``), where the message was (``source_topic`` without replay's prefix,
    ``source_offset``; ``input``: the recording frame it came from, ``file#frame``, when it was one), when
    (``failed_at``), and the message itself (``payload_length_bytes``, ``payload_sha256``, ``truncated``)."""
    topic = letter.source_topic
    if topic.startswith(REPLAY_TOPICS.prefix):
        topic = topic[len(REPLAY_TOPICS.prefix):]
    return {
        "service": letter.service,
        "reason_code": letter.reason_code,
        "reason": letter.reason,
        "error_type": letter.error_type,
        "source_topic": topic,
        "source_offset": letter.source_offset,
        "input": input_source,
        "failed_at": iso_utc(letter.failed_at_unix_ms),
        "failed_at_unix_ms": letter.failed_at_unix_ms,
        "payload_length_bytes": letter.payload_length_bytes,
        "payload_sha256": letter.payload_sha256,
        "truncated": letter.truncated,
    }


def _unpriced(letter: DeadLetter) -> UnpricedWindow:
    window = codec_for(NodeWindowShares).decode(letter.raw_bytes)
    return UnpricedWindow(window.cluster, window.node_name, window.window_start_unix_ms, letter.reason)


class _KeptBills:
    """Billing's ledger store, keeping each bill it settled as new (what ``bills.jsonl`` lists, in order)."""

    def __init__(self, store: LedgerStore) -> None:
        self.store = store
        self.bills: list[Any] = []

    def apply(self, changes: Sequence[Any]) -> Sequence[Settled]:
        settled = self.store.apply(changes)
        self.bills.extend(change.priced.bill for change, outcome in zip(changes, settled)
                          if outcome.rejected is None and outcome.owed)
        return settled

    def published(self, changes: Sequence[Any], now_ms: int) -> None:
        self.store.published(changes, now_ms)


class _Stage:
    """One service's processor on the in-memory broker: the runner it runs on in the stream, a ``MemoryDriver``."""

    def __init__(self, processor: Any, inputs: Mapping[str, str], outputs: Mapping[str, str], broker: MemoryBroker,
                 clock: ManualClock, *, store: Any = None, on_produced: Any = None, batch_size: int = 1,
                 decoded: dict[tuple[type, bytes], Any] | None = None) -> None:
        self.clock = clock  # the service's own: each moves through the input's time on its own
        self.runner = MessageRunner(processor, inputs, clock, log_dead_letters=False,  # dead_letters.jsonl has them
                                    decoded=decoded)
        self.driver = MemoryDriver(self.runner, broker, outputs, store, on_produced, batch_size=batch_size)
        self.last_tick_ms: int | None = None

    def run(self, *, tick_until_ms: int | None = None) -> int:
        """Step every message; before each, the clock moves to its time and, once per new instant up to
        ``tick_until_ms`` (None: every instant), the processor's clock runs with the input caught up."""

        def before(message: RawMessage) -> None:
            now = message.timestamp_ms or 0
            self.clock.set_ms(now)
            if self.last_tick_ms is None or now > self.last_tick_ms:
                self.last_tick_ms = now
                self.driver.tick(now, caught_up=tick_until_ms is None or now <= tick_until_ms)

        return self.driver.run(before_message=before)

    def finish(self, end_ms: int, *, caught_up: bool) -> None:
        self.clock.set_ms(end_ms)
        self.last_tick_ms = end_ms
        self.driver.tick(end_ms, caught_up)


def replay(
    input_path: str | Path,
    out_dir: str | Path,
    *,
    window_seconds: int = 60,
    grace_seconds: int = 10,
    policy: AttributionPolicy | None = None,
    catalog: PriceCatalog | None = None,
    split_policy: SplitPolicy = DEFAULT_SPLIT_POLICY,
    sharing: SharingPolicy = KEEP_ALL,
    node: str | None = None,
    idle_close_seconds: int = 30,
    max_clock_skew_seconds: int = 120,
    pod_linger_ms: int = DEFAULT_LINGER_MS,
    record_path: str | Path | None = None,
    guard_config: GuardConfig | None = None,
    grouping_labels: tuple[str, ...] | None = DEFAULT_GROUPING_LABELS,
    grouping_label_sources: GroupingLabelSources = GroupingLabelSources(),
    batch_size: int = DEFAULT_BATCH_SIZE,
    on_stage: Callable[[str], None] | None = None,
    workers: int | None = None,
) -> ReplaySummary:
    """Replay ``input_path`` (a scenario YAML, a recording file, or a directory of recordings) into ``out_dir``.

    ``policy`` is the attribution policy (default: memory cost basis); ``catalog`` and ``split_policy`` price the
    nodes (default: the bundled price files; a node-window no row prices is dead-lettered ``NO_PRICE`` by billing,
    as in the stream, listed in ``ReplaySummary.unpriced`` and gets no cost or bill lines); ``sharing`` is
    billing's sharing policy (default: every bucket kept). ``node`` keeps one node's input only.
    ``record_path`` also writes the replayed input as a recording (what was decoded and kept by ``node``).
    ``guard_config``: the guard's thresholds for ``violations.jsonl`` (default ``GuardConfig()``).
    ``grouping_labels``: the pod labels share rows carry, as the streaming attributor's ``GPUMETER_GROUPING_LABELS``
    (None: every label); ``grouping_label_sources`` where their values come from, as its
    ``GPUMETER_GROUPING_LABEL_SOURCE`` (default: the pod's labels). ``batch_size``: the most messages of one
    instant each service's processor handles at once (``MemoryDriver``); the output does not depend on it.
    ``on_stage`` (a profiler's hook; nothing in the output depends on it) is called with the name of each stage as
    replay enters it (``REPLAY_STAGES``, in that order) and with ``"end"`` when it returns.
    ``workers``: for a scenario, the processes that simulate its nodes and take its truth
    (``scenario_encoded_records``; None: ``os.cpu_count()`` when it has several nodes; 0 or 1: in this process);
    the output is byte-identical whatever the number.
    Raises ``ScenarioError``, ``RecordingError`` (broken recording structure) or ``ConfigError`` (bad options,
    unknown input, unknown node).
    """
    stage = on_stage if on_stage is not None else (lambda name: None)
    stage("input")
    input_path = Path(input_path)
    out = Path(out_dir)
    config = EngineConfig(
        window_seconds=window_seconds,
        grace_seconds=grace_seconds,
        idle_close_seconds=idle_close_seconds,
        max_clock_skew_seconds=max_clock_skew_seconds,
        pod_linger_ms=pod_linger_ms,
        policy=policy or AttributionPolicy(),
        grouping_labels=None if grouping_labels is None else tuple(sorted(set(grouping_labels))),
        grouping_label_sources=grouping_label_sources,
    )
    catalog = catalog if catalog is not None else bundled_catalog()

    truth: TruthAccumulator | None = None
    inputs: Iterable[_Input]
    if not input_path.exists():
        raise ConfigError(f"replay input {input_path} does not exist")
    if _is_scenario_path(input_path):
        from simulator.scenario import load_scenario

        scenario = load_scenario(input_path)
        input_kind = INPUT_SCENARIO
        names = scenario_nodes(scenario, node)
        processes = (os.cpu_count() or 1) if workers is None else workers
        if workers is not None and workers > 1 or processes > 1 and len(names) > 1:
            inputs = scenario_encoded_records(scenario, names, workers=processes)
        else:
            inputs = scenario_records(scenario, names)
        truth = TruthAccumulator(scenario, window_seconds)
    elif is_recording(input_path):
        input_kind = INPUT_RECORDING
        inputs = recorded_inputs(input_path)
        if node is not None:
            inputs = (r for r in inputs if not isinstance(r, InputRecord) or r.node_name == node)
    else:
        raise ConfigError(f"replay input {input_path} is neither a scenario (.yaml) nor a recording "
                          f"(a file starting {RECORDING_MAGIC_V1!r} or {RECORDING_MAGIC_V2!r}, plain or compressed, or a "
                          f"directory of *{RECORDING_SUFFIX})")

    broker = MemoryBroker()
    for spec in ALL_TOPICS:
        broker.create(REPLAY_TOPICS.name(spec), 1)
    # Records decoded from the broker's bytes, shared by the three runners and the output (every sample is read by
    # the attributor, the guard and the truth): kept for one chunk of input, as the broker's messages are.
    decoded: dict[tuple[type, bytes], Any] = {}
    nodes: dict[str, None] = {}
    counts: Counter[str] = Counter()
    latest_ms: int | None = None
    # What each input message was, by its position on the broker: where a recorded frame came from.
    sources: dict[tuple[str, int], str] = {}
    # The simulator's truth of a worker's sample, by its position on the broker (kept for one chunk).
    simulated_truth: dict[tuple[str, int], tuple[int, tuple]] = {}

    def produce(item: _Input) -> None:
        nonlocal latest_ms
        now = item.received_at_unix_ms
        latest_ms = now if latest_ms is None else max(latest_ms, now)
        if isinstance(item, InvalidInput):
            # Bytes that do not decode reach the topic a sample would (no record type to tell otherwise).
            at = broker.produce(REPLAY_TOPICS.node_samples, None, item.payload, timestamp_ms=now, partition=0)
            sources[(at.topic, at.offset)] = item.source
            return
        if isinstance(item, EncodedInput):
            # Simulated and encoded by a worker process: its bytes go on the topic, decoded once by the runners.
            nodes.setdefault(item.node_name, None)
            if recorder is not None:
                recorder.write_frame(now, item.payload)
            if item.is_pod_event:
                counts["pod_events"] += 1
                broker.produce(REPLAY_TOPICS.pod_events, item.key, item.payload, timestamp_ms=now, partition=0)
            else:
                counts["samples"] += 1
                latest_ms = max(latest_ms, item.sampled_at_unix_ms)
                at = broker.produce(REPLAY_TOPICS.node_samples, item.key, item.payload, timestamp_ms=now,
                                    partition=0)
                if item.truth is not None:
                    simulated_truth[(at.topic, at.offset)] = item.truth
            return
        message = item.message
        nodes.setdefault(message.node_name, None)
        if recorder is not None:
            recorder.write(item)
        if isinstance(message, PodEvent):
            counts["pod_events"] += 1
            topic, key = REPLAY_TOPICS.pod_events, pod_event_key(message.node_name, message.uid)
        else:
            counts["samples"] += 1
            latest_ms = max(latest_ms, message.sampled_at_unix_ms)
            topic, key = REPLAY_TOPICS.node_samples, message.node_name.encode("utf-8")
        if item.payload is None:
            broker.produce_record(topic, Emit(SAMPLES if topic == REPLAY_TOPICS.node_samples else POD_EVENTS, key,
                                              message), now)
        else:
            # A recorded frame: the bytes the topic carried, and the record they decode to (decoded already).
            broker.produce(topic, key, item.payload, timestamp_ms=now, partition=0)
            decoded[(type(message), item.payload)] = message

    # The three services, each on its runner over the broker, in the order their input exists.
    attributor = AttributorProcessor(config, 1)
    attribution = _Stage(attributor, attributor_inputs(REPLAY_TOPICS), attributor_outputs(REPLAY_TOPICS), broker,
                         ManualClock(0), on_produced=attributor.acknowledge_all, batch_size=batch_size,
                         decoded=decoded)
    stage("ledger_setup")
    ledger = Ledger("sqlite://")
    ledger.migrate()
    store = _KeptBills(LedgerStore(ledger))
    billing = _Stage(BillingProcessor(catalog=catalog, policy=split_policy, sharing=sharing,
                                      max_clock_skew_seconds=max_clock_skew_seconds),
                     billing_inputs(REPLAY_TOPICS), billing_outputs(REPLAY_TOPICS), broker, ManualClock(0),
                     store=store, batch_size=batch_size, decoded=decoded)
    guard_clock = ManualClock(0)
    guard_processor = GuardProcessor(guard_config or GuardConfig(), guard_clock)
    guard = _Stage(guard_processor, guard_topics(REPLAY_TOPICS), guard_outputs(REPLAY_TOPICS), broker, guard_clock,
                   batch_size=batch_size, decoded=decoded)

    outputs = _Outputs(out, with_truth=truth is not None)
    # Dead letters by service, in the order the services run over the input (dead_letters.jsonl's order).
    letters: dict[str, list[dict[str, Any]]] = {attributor.service: [], SERVICE_NAME_BILLING: [],
                                                guard_processor.service: []}
    dead: Counter[str] = Counter()
    unpriced: list[UnpricedWindow] = []
    seen_ticks: set[tuple[str, int, int]] = set()
    cost_fields = _KeptFields(_COST_KEYS)

    def write_out() -> None:
        """Write what the services produced since the last call, then let the broker forget it."""
        stage("output")
        sample_letters: set[tuple[str, int]] = set()
        for message in broker.messages(REPLAY_TOPICS.dead_letters, 0):
            letter = codec_for(DeadLetter).decode(message.value)
            if letter.service == attributor.service:
                sample_letters.add((letter.source_topic, letter.source_offset))
            dead[letter.reason_code] += 1
            letters.setdefault(letter.service, []).append(dead_letter_json(letter, sources.get(
                (letter.source_topic, letter.source_offset))))
            if letter.service == SERVICE_NAME_BILLING and letter.reason_code == NoPrice.reason_code:
                unpriced.append(_unpriced(letter))
        for record in _records(broker, REPLAY_TOPICS.node_window_shares, NodeWindowShares, decoded):
            counts["windows"] += 1
            outputs.write_lines(SHARES_FILE, share_lines(record))
        outputs.write_lines(COSTS_FILE, [cost_fields.line(cost_record_json(record))
                                         for record in _records(broker, REPLAY_TOPICS.costs, CostRecord, decoded)])
        for bill in store.bills:
            outputs.write(BILLS_FILE, bill.as_json())
            counts["node_cost_micro"] += bill.node_cost_micro_usd
        store.bills.clear()
        for message in broker.messages(REPLAY_TOPICS.violations, 0):
            outputs.write(VIOLATIONS_FILE, violation_json(codec_for(Violation).decode(message.value),
                                                          message.timestamp_ms or 0))
        # The ticks the attributor took (not dead-lettered, not a repeat of one it had): the truth's input.
        sample_codec = codec_for(NodeSample)
        for message in broker.messages(REPLAY_TOPICS.node_samples, 0):
            if (message.topic, message.offset) in sample_letters or message.value is None:
                continue
            sample = decoded.get((NodeSample, message.value)) or sample_codec.decode(message.value)
            tick = (sample.node_name, sample.collector_started_at_unix_ms, sample.sequence)
            if tick in seen_ticks:
                counts["duplicates"] += 1
                continue
            seen_ticks.add(tick)
            if truth is not None:
                truth.add_tick(sample, simulated_truth.get((message.topic, message.offset)))
        broker.trim()
        decoded.clear()
        simulated_truth.clear()

    recorder = RecordingWriter(record_path) if record_path is not None else None
    try:
        if recorder is not None:
            recorder.__enter__()
        stage("input")  # reading and decoding the input happens as the chunks are taken
        for chunk in _chunks(inputs, CHUNK_MESSAGES):
            for item in chunk:
                produce(item)
            # Every message of the chunk's instants is on the broker and none later: each service reads all of
            # them, and what it produces (stamped at most the chunk's last instant) is there for the next.
            stage("attributor")
            attribution.run()
            stage("billing")
            billing.run()
            stage("guard")
            guard.run()
            write_out()
            stage("input")
        if latest_ms is not None:
            # End of input: the first instant at which the streaming timer would have closed every open window.
            input_end_ms = latest_ms
            end_ms = latest_ms + (window_seconds + grace_seconds + idle_close_seconds) * 1000
            stage("attributor")
            attribution.finish(end_ms, caught_up=True)
            stage("billing")
            billing.run()
            stage("guard")
            # The guard's clock judges silence only within the input: its end is not the nodes going silent.
            guard.run(tick_until_ms=input_end_ms)
            guard.finish(end_ms, caught_up=False)
            write_out()
        for service_letters in letters.values():
            for obj in service_letters:
                outputs.write(DEAD_LETTERS_FILE, obj)
        if truth is not None:
            for row in truth.take_closed(None):
                outputs.write(TRUTH_FILE, row)
    finally:
        if recorder is not None:
            recorder.__exit__(None, None, None)
        ledger.close()
        outputs.close()
    stage("end")

    return ReplaySummary(
        input_kind=input_kind,
        nodes=tuple(nodes),
        samples=counts["samples"],
        pod_events=counts["pod_events"],
        windows=counts["windows"],
        share_rows=outputs.counts[SHARES_FILE],
        truth_rows=outputs.counts[TRUTH_FILE],
        cost_rows=outputs.counts[COSTS_FILE],
        bills=outputs.counts[BILLS_FILE],
        node_cost_micro_usd=counts["node_cost_micro"],
        dead_letters=dict(sorted(dead.items())),
        unpriced=tuple(unpriced),
        duplicates_ignored=counts["duplicates"],
        recorded=recorder.count if recorder is not None else 0,
        files=dict(outputs.paths),
        violation_rows=outputs.counts[VIOLATIONS_FILE],
        violations_firing_at_end=len(guard_processor.engine.active()),
    )


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every object of a JSON-lines file (for tests and tools reading replay's output)."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


__all__ = [
    "BILLS_FILE",
    "COSTS_FILE",
    "DEAD_LETTERS_FILE",
    "ReplaySummary",
    "SHARES_FILE",
    "TRUTH_FILE",
    "UnpricedWindow",
    "VIOLATIONS_FILE",
    "read_jsonl",
    "replay",
    "share_json",
    "share_lines",
]
