"""Offline replay: node samples and pod events through the streaming attributor's own engine, with no broker.

``replay(input_path, out_dir, ...)`` reads a **scenario** (YAML, run through the simulator and the collector's
real sampling code by ``services.collector.simulation.node_streams``) or a **recording** (below), drives one
``AttributionEngine`` (``services/attributor/engine.py``, the code the Faust app runs per partition) exactly as the
streaming agents do, prices every closed node-window with billing's ``bill_node_window``, and writes:

``shares.jsonl``
    One object per ``GpuShare`` row (see ``share_json``): at least ``window_start`` (ISO 8601 UTC),
    ``window_seconds``, ``node``, ``gpu_uuid`` (GPU or MIG instance), ``subject_kind`` (``pod`` | ``idle`` |
    ``driver_reserved`` | ``unattributed``), ``pod_uid`` (null for buckets), ``namespace``, ``pod``,
    ``memory_share``, ``compute_share``, ``cost_share``, ``method``; plus every other ``GpuShare`` field.
``costs.jsonl``
    One object per ``CostRecord`` (``services.billing.costing.cost_record_json``): ``window_start``, ``node``,
    ``gpu_uuid`` (null for node-level lines), ``subject_kind`` (the four above or ``node_other``), ``pod_uid``,
    ``namespace``, ``labels``, ``cost_micro_usd``, ... Per node-window they add up to the bill exactly.
``bills.jsonl``
    One object per priced node-window (``NodeBill.as_json``): ``node``, ``window_start``, ``window_seconds``,
    ``instance_type``, ``price_per_hour_usd``, ``node_cost_micro_usd``, and the GPU / node_other split.
``dead_letters.jsonl``
    What the streaming path would dead-letter: late ticks (``LATE``), impossible ticks (``OUT_OF_RANGE``),
    undecodable recorded messages, node-windows billing rejects. Empty for a clean input.
``truth.jsonl`` (scenarios only)
    The simulator's ground truth on the same windows and units, defined below.
``violations.jsonl``
    What the guard (``services/guard``, thresholds from ``guard_config``) publishes over the same input, one
    record per line in publication order (``services.guard.replay.violation_json``): ``rule``, ``state``
    (``firing`` | ``resolved``), ``severity``, ``node``, ``gpu_uuid``, ``namespace``, ``pod``, ``fingerprint``,
    ``first_seen``, ``last_seen``, ``resolved_at`` (ISO 8601 UTC), ``evidence``, ... The guard is fed each pod
    event and sample when received, each share row and cost line when its window is closed and priced, and the
    clock once per new instant; at the end of input its clock moves to the final instant without judging the
    nodes silent (``GuardReplay.finish``).

Every file is written in a deterministic order with sorted keys: the same input and options give byte-identical
files.

How the engine is driven (what the Faust app does, with the input's own time as the clock)
------------------------------------------------------------------------------------------
Inputs are processed in order; each has a ``received_at_unix_ms`` (scenario: the tick time; recording: the time
stored with the message, the Kafka record timestamp when recorded from a topic). Before each input the clock
``on_clock(received_at)`` runs once per new instant (a perfectly punctual timer with the input caught up); a pod
event goes to ``on_pod_event``, a sample to ``on_sample(sample, received_at)``. Closed windows are written and
acknowledged (``record_emitted``); the state-table changes a streaming app would write are discarded. At the end
of input replay calls ``on_clock`` at ``last time + window + grace + idle_close`` rather than ``engine.flush()``:
that is the instant at which the streaming timer would have closed every open window, so both paths close the
last windows through the same rule.

Ground truth (``truth.jsonl``)
------------------------------
For each window ``[k·W, (k+1)·W)``, unit (whole GPU or MIG instance, as ``gpu_uuid``) and pod (``pod_uid`` null
for processes of no pod: host processes and MPS servers together), over the replayed ticks of the unit's node
whose ``sampled_at`` lies in the window — the ticks the attribution puts in that window. A tick at which the
unit's GPU was lost counts with its weight and no pod's use: that time was nobody's (the attribution's
UNAVAILABLE bucket).

* ``w_t = clamp(interval_ms_t, 0, W)``, the tick weight the attribution uses (equal weights when all are 0);
* ``true_memory_share = Σ w_t · M_t / (Σ w_t · T)``, with ``M_t`` the pod's ``true_memory_bytes`` on the unit at
  the tick (``SimWorld.truth``: the sum of its processes' ``usedGpuMemory``) and ``T`` the unit's
  ``memory_total_bytes`` including the driver reserve — the denominator of ``memory_share``;
* ``true_compute_share = Σ w_t · C_t / Σ w_t``, with ``C_t`` the pod's ``true_compute_fraction`` (time-slicing:
  GPU time granted; MPS: compute received; MIG: share of the instance's time) — a fraction of the unit's time
  like ``compute_share``.

* ``true_occupancy_share = Σ w_t · [the pod had a context on the unit at t] / Σ w_t``: how long it held the unit
  (what MIG attribution measures, NVML having no utilization for MIG instances).

Ticks where the pod had no context on the unit count as 0. The truth is taken at the sampling instants, as the
samples are, so it measures the attribution's error on what was sampled; what sampling itself misses between
ticks is bounded separately in ``docs/attribution.md`` ("Error to expect against the truth").

Recording format (``*.gmrec``)
------------------------------
A binary file: the 21-byte header ``gpumeter-recording/1\\n``, then frames until the end of the file. A frame
is ``received_at_unix_ms`` (int64, big-endian), ``length`` (uint32, big-endian), then ``length`` bytes: one
Avro single-object message (``C3 01`` + CRC-64-AVRO fingerprint + body), byte for byte what the ``node-samples``
and ``pod-events`` topics carry. The fingerprint names the writer schema and so the record type (``NodeSample``
or ``PodEvent``); old recordings stay readable through Avro schema resolution as long as the registry holds
their writer schema. A broken frame structure (bad header, a frame cut short) raises ``RecordingError``; a frame
whose message does not decode is dead-lettered with the codec's reason code and replay carries on, as the
streaming consumer does. INPUT may also be a directory: every ``*.gmrec`` in it (sorted by name) is read and the
files are merged by (received_at, pod events before samples, file order, frame order); one file is replayed in
its own order. ``record_scenario`` and ``gpumeter replay --record`` write recordings.
"""

from __future__ import annotations

import heapq
import json
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Mapping, Sequence, Union

from gpumeter.errors import ConfigError, InvalidMessage, WrongRecordType
from schemas.codec import HEADER_BYTES, MAGIC, default_registry
from schemas.records import RECORD_TYPES, GpuShare, NodeSample, PodEvent, Violation
from schemas.typed import codec_for
from services.attributor.attribution import AttributionPolicy
from services.attributor.engine import AttributionEngine, EngineConfig, WindowResult
from services.attributor.pod_index import DEFAULT_GROUPING_LABELS, DEFAULT_LINGER_MS
from services.billing.catalog import PriceCatalog, PriceError, bundled_catalog
from services.billing.costing import bill_node_window, cost_record_json, iso_utc
from services.billing.pricing import DEFAULT_SPLIT_POLICY, SplitPolicy
from services.billing.sharing import KEEP_ALL, SharingPolicy
from services.guard.config import GuardConfig
from services.guard.replay import VIOLATIONS_FILE, GuardReplay, violation_json

RECORDING_MAGIC = b"gpumeter-recording/1\n"
RECORDING_SUFFIX = ".gmrec"
_FRAME_HEADER = struct.Struct(">qI")
MAX_FRAME_BYTES = 64 * 1024 * 1024

SHARES_FILE = "shares.jsonl"
TRUTH_FILE = "truth.jsonl"
COSTS_FILE = "costs.jsonl"
BILLS_FILE = "bills.jsonl"
DEAD_LETTERS_FILE = "dead_letters.jsonl"

INPUT_SCENARIO = "scenario"
INPUT_RECORDING = "recording"

InputMessage = Union[NodeSample, PodEvent]


class RecordingError(InvalidMessage):
    """A recording whose structure is broken: not a recording, a frame cut short, an absurd frame length."""

    reason_code = "BAD_RECORDING"


# ----------------------------------------------------------------------------------------------------------------
# Input records


@dataclass(frozen=True, slots=True)
class InputRecord:
    """One input message and the time it reached the attributor (``received_at_unix_ms``)."""

    received_at_unix_ms: int
    message: InputMessage

    @property
    def node_name(self) -> str:
        return self.message.node_name


@dataclass(frozen=True, slots=True)
class RecordedFrame:
    """One frame of a recording: the stored time, the raw single-object message, and where it was."""

    received_at_unix_ms: int
    payload: bytes
    source: str
    position: int


def _kind_rank(message: InputMessage) -> int:
    # Pod events first: a tick's pods must be known when the tick's window closes at the same instant.
    return 0 if isinstance(message, PodEvent) else 1


def scenario_records(scenario: Any, nodes: Sequence[str] | None = None) -> Iterator[InputRecord]:
    """The scenario's pod events and samples for ``nodes`` (default: all, in scenario order), from the
    collector's sampling code, merged in time order: at each instant every pod event before any sample."""
    from services.collector.simulation import node_streams, scenario_node_names

    names = tuple(nodes) if nodes is not None else scenario_node_names(scenario)

    def stream(index: int, name: str) -> Iterator[tuple[tuple[int, int, int, int], InputRecord]]:
        seq = 0
        for tick in node_streams(scenario, name):
            for event in tick.pod_events:
                yield (tick.sampled_at_unix_ms, 0, index, seq), InputRecord(tick.sampled_at_unix_ms, event)
                seq += 1
            yield (tick.sampled_at_unix_ms, 1, index, seq), InputRecord(tick.sampled_at_unix_ms, tick.sample)
            seq += 1

    for _key, record in heapq.merge(*(stream(i, n) for i, n in enumerate(names)), key=lambda item: item[0]):
        yield record


# ----------------------------------------------------------------------------------------------------------------
# Recordings


def encode_message(message: InputMessage) -> bytes:
    """The single-object Avro message of ``message`` (what its topic carries)."""
    return codec_for(type(message)).encode(message)


def decode_message(payload: bytes) -> InputMessage:
    """A recorded single-object message back to its record. Raises ``InvalidMessage`` subclasses: the codec's,
    or ``WrongRecordType`` for a record type replay does not read."""
    if len(payload) >= HEADER_BYTES and payload[:2] == MAGIC:
        (fingerprint,) = struct.unpack_from("<Q", payload, 2)
        writer = default_registry().by_fingerprint(fingerprint)
        if writer is not None:
            record_type = RECORD_TYPES.get(writer.full_name)
            if record_type not in (NodeSample, PodEvent):
                raise WrongRecordType(f"replay reads NodeSample and PodEvent, got {writer.full_name}")
            return codec_for(record_type).decode(payload)
    # Not decodable: let the codec name the reason (corrupt, truncated, unknown schema).
    return codec_for(NodeSample).decode(payload)


class RecordingWriter:
    """Writes a recording file (header on open, one frame per ``write``). Use as a context manager."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.count = 0
        self._file: IO[bytes] | None = None

    def __enter__(self) -> "RecordingWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "wb")
        self._file.write(RECORDING_MAGIC)
        return self

    def write(self, record: InputRecord) -> None:
        assert self._file is not None, "RecordingWriter is used as a context manager"
        payload = encode_message(record.message)
        self._file.write(_FRAME_HEADER.pack(record.received_at_unix_ms, len(payload)))
        self._file.write(payload)
        self.count += 1

    def __exit__(self, *exc_info: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def write_recording(records: Iterable[InputRecord], path: str | Path) -> int:
    """Write ``records`` in order to the recording ``path``; returns how many."""
    with RecordingWriter(path) as writer:
        for record in records:
            writer.write(record)
    return writer.count


def record_scenario(scenario_path: str | Path, path: str | Path, *, node: str | None = None) -> int:
    """Record a scenario's pod events and samples (one node's, or all) to ``path``, in replay order."""
    from simulator.scenario import load_scenario

    scenario = load_scenario(Path(scenario_path))
    return write_recording(scenario_records(scenario, _scenario_nodes(scenario, node)), path)


def iter_frames(path: str | Path) -> Iterator[RecordedFrame]:
    """The frames of one recording file, in file order. Raises ``RecordingError`` for a broken structure."""
    path = Path(path)
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise RecordingError(f"cannot read recording {path}: {exc.strerror or exc}") from exc
    with handle:
        header = handle.read(len(RECORDING_MAGIC))
        if header != RECORDING_MAGIC:
            raise RecordingError(f"{path} is not a gpumeter recording (it does not start with "
                                 f"{RECORDING_MAGIC!r})")
        position = 0
        while True:
            head = handle.read(_FRAME_HEADER.size)
            if not head:
                return
            if len(head) < _FRAME_HEADER.size:
                raise RecordingError(f"{path}: frame {position} is cut short in its header")
            received_at, length = _FRAME_HEADER.unpack(head)
            if length > MAX_FRAME_BYTES:
                raise RecordingError(f"{path}: frame {position} claims {length} bytes (more than "
                                     f"{MAX_FRAME_BYTES}): not a recording, or a corrupt one")
            payload = handle.read(length)
            if len(payload) < length:
                raise RecordingError(f"{path}: frame {position} is cut short ({len(payload)} of {length} bytes)")
            yield RecordedFrame(received_at, payload, f"{path.name}#{position}", position)
            position += 1


def recording_files(path: str | Path) -> tuple[Path, ...]:
    """The recording files of ``path``: itself, or every ``*.gmrec`` in a directory, sorted by name."""
    path = Path(path)
    if path.is_dir():
        files = tuple(sorted(p for p in path.iterdir() if p.name.endswith(RECORDING_SUFFIX) and p.is_file()))
        if not files:
            raise RecordingError(f"{path} holds no *{RECORDING_SUFFIX} recording")
        return files
    return (path,)


def read_recording(path: str | Path) -> Iterator[InputRecord]:
    """Every record of a recording (file or directory) in replay order; undecodable messages raise."""
    for item in _recorded_inputs(path):
        if isinstance(item, InvalidInput):
            raise item.error
        yield item


@dataclass(frozen=True, slots=True)
class InvalidInput:
    """An input message that cannot be used: dead-lettered with ``error.reason_code``."""

    source: str
    received_at_unix_ms: int
    error: InvalidMessage
    message: InputMessage | None = None


def _recorded_inputs(path: str | Path) -> Iterator[InputRecord | InvalidInput]:
    def stream(index: int, file: Path) -> Iterator[tuple[tuple[int, int, int, int], InputRecord | InvalidInput]]:
        for frame in iter_frames(file):
            try:
                message = decode_message(frame.payload)
            except InvalidMessage as exc:
                # Undecodable: no kind to order by; it sorts with samples (after the instant's pod events).
                yield (frame.received_at_unix_ms, 1, index, frame.position), InvalidInput(
                    frame.source, frame.received_at_unix_ms, exc)
                continue
            key = (frame.received_at_unix_ms, _kind_rank(message), index, frame.position)
            yield key, InputRecord(frame.received_at_unix_ms, message)

    files = recording_files(path)
    if len(files) == 1:
        # One file is replayed in its own order (what a consumer of one partition saw).
        for _key, item in stream(0, files[0]):
            yield item
        return
    for _key, item in heapq.merge(*(stream(i, f) for i, f in enumerate(files)), key=lambda pair: pair[0]):
        yield item


def is_recording(path: str | Path) -> bool:
    """Whether ``path`` is a recording file or a directory (a directory is read as recordings)."""
    path = Path(path)
    if path.is_dir():
        return True
    try:
        with open(path, "rb") as handle:
            return handle.read(len(RECORDING_MAGIC)) == RECORDING_MAGIC
    except OSError:
        return False


# ----------------------------------------------------------------------------------------------------------------
# JSON lines


def _dumps(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False)


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
    }


# ----------------------------------------------------------------------------------------------------------------
# Ground truth


@dataclass
class _TruthCell:
    weight_ms: int = 0
    ticks: int = 0
    # pod uid (None: no pod) -> [Σ w·bytes, Σ w·compute, Σ w, Σ bytes, Σ compute, ticks present]
    # (the unweighted sums serve when every weight is 0, as the attribution then weighs ticks equally)
    pods: dict[str | None, list] = field(default_factory=dict)


class _TruthAccumulator:
    """Ground truth per (window, unit, pod) over the replayed ticks (definition in the module docstring)."""

    def __init__(self, scenario: Any, window_seconds: int) -> None:
        from simulator.world import SimWorld

        self._world = SimWorld(scenario)
        self._window_ms = window_seconds * 1000
        self._window_seconds = window_seconds
        self._units: dict[str, tuple[tuple[int, Any], ...]] = {}
        for node in scenario.nodes:
            self._units[node.name] = tuple(
                (gpu.index, unit) for gpu in node.gpus for unit in self._world.units_of_gpu(node.name, gpu.index)
            )
        self._cells: dict[tuple[int, str, str], _TruthCell] = {}
        self._unit_info: dict[str, Any] = {unit.uuid: unit for units in self._units.values() for _, unit in units}

    def add_tick(self, sample: NodeSample) -> None:
        node = sample.node_name
        t = sample.sampled_at_unix_ms
        weight = min(max(sample.interval_ms, 0), self._window_ms)
        window_start = (t // self._window_ms) * self._window_ms
        by_unit: dict[str, list] = {}
        for row in self._world.truth(t, node):
            by_unit.setdefault(row.gpu_uuid, []).append(row)
        for gpu_index, unit in self._units.get(node, ()):
            cell = self._cells.setdefault((window_start, node, unit.uuid), _TruthCell())
            cell.weight_ms += weight
            cell.ticks += 1
            if self._world.gpu_lost(node, gpu_index, t):
                continue
            for row in by_unit.get(unit.uuid, ()):
                acc = cell.pods.setdefault(row.pod_uid, [0, 0.0, 0, 0, 0.0, 0])
                acc[0] += weight * row.true_memory_bytes
                acc[1] += weight * row.true_compute_fraction
                acc[2] += weight
                acc[3] += row.true_memory_bytes
                acc[4] += row.true_compute_fraction
                acc[5] += 1

    def take_closed(self, before_unix_ms: int | None) -> list[dict[str, Any]]:
        """Rows of the windows that end at or before ``before_unix_ms`` (None: all), in a stable order."""
        keys = sorted(k for k in self._cells if before_unix_ms is None or k[0] + self._window_ms <= before_unix_ms)
        rows: list[dict[str, Any]] = []
        for key in keys:
            cell = self._cells.pop(key)
            window_start, node, unit_uuid = key
            unit = self._unit_info[unit_uuid]
            total = unit.memory_total_bytes
            for pod_uid in sorted(cell.pods, key=lambda u: (u is None, u or "")):
                weighted_bytes, weighted_compute, weight_present, bytes_sum, compute_sum, ticks_present = cell.pods[
                    pod_uid]
                if cell.weight_ms > 0:
                    memory_bytes = weighted_bytes / cell.weight_ms
                    compute = weighted_compute / cell.weight_ms
                    occupancy = weight_present / cell.weight_ms
                else:
                    memory_bytes = bytes_sum / cell.ticks
                    compute = compute_sum / cell.ticks
                    occupancy = ticks_present / cell.ticks
                rows.append(
                    {
                        "window_start": iso_utc(window_start),
                        "window_start_unix_ms": window_start,
                        "window_seconds": self._window_seconds,
                        "node": node,
                        "gpu_uuid": unit_uuid,
                        "parent_gpu_uuid": unit.parent_uuid,
                        "pod_uid": pod_uid,
                        "true_memory_bytes_avg": memory_bytes,
                        "true_memory_share": memory_bytes / total,
                        "true_compute_share": compute,
                        "true_occupancy_share": occupancy,
                        "sample_count": cell.ticks,
                        "covered_seconds": min(cell.weight_ms, self._window_ms) / 1000.0,
                    }
                )
        return rows


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


def _scenario_nodes(scenario: Any, node: str | None) -> tuple[str, ...]:
    names = tuple(n.name for n in scenario.nodes)
    if node is None:
        return names
    if node not in names:
        raise ConfigError(f"the scenario has no node {node!r} (nodes: {', '.join(names)})")
    return (node,)


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

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()


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
) -> ReplaySummary:
    """Replay ``input_path`` (a scenario YAML, a recording file, or a directory of recordings) into ``out_dir``.

    ``policy`` is the attribution policy (default: memory cost basis); ``catalog`` and ``split_policy`` price the
    nodes (default: the bundled price files; a node-window no row prices is listed in ``ReplaySummary.unpriced``
    and gets no cost or bill lines); ``sharing`` is billing's sharing policy (default: every bucket kept).
    ``node`` keeps one node's input only.
    ``record_path`` also writes the replayed input as a recording (what was decoded and kept by ``node``).
    ``guard_config``: the guard's thresholds for ``violations.jsonl`` (default ``GuardConfig()``).
    ``grouping_labels``: the pod labels share rows carry, as the streaming attributor's ``GPUMETER_GROUPING_LABELS``
    (None: every label).
    Raises ``ScenarioError``, ``RecordingError`` (broken recording structure) or ``ConfigError`` (bad options,
    unknown input, unknown node).
    """
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
    )
    catalog = catalog if catalog is not None else bundled_catalog()

    truth: _TruthAccumulator | None = None
    inputs: Iterable[InputRecord | InvalidInput]
    if not input_path.exists():
        raise ConfigError(f"replay input {input_path} does not exist")
    if _is_scenario_path(input_path):
        from simulator.scenario import load_scenario

        scenario = load_scenario(input_path)
        input_kind = INPUT_SCENARIO
        inputs = scenario_records(scenario, _scenario_nodes(scenario, node))
        truth = _TruthAccumulator(scenario, window_seconds)
    elif is_recording(input_path):
        input_kind = INPUT_RECORDING
        inputs = _recorded_inputs(input_path)
        if node is not None:
            inputs = (r for r in inputs if not isinstance(r, InputRecord) or r.node_name == node)
    else:
        raise ConfigError(f"replay input {input_path} is neither a scenario (.yaml) nor a recording "
                          f"(a file starting {RECORDING_MAGIC!r} or a directory of *{RECORDING_SUFFIX})")

    engine = AttributionEngine(config)
    guard = GuardReplay(guard_config)
    outputs = _Outputs(out, with_truth=truth is not None)
    recorder = RecordingWriter(record_path) if record_path is not None else None
    nodes: dict[str, None] = {}
    samples = pod_events = windows = duplicates = 0
    node_cost_micro = 0
    dead: Counter[str] = Counter()
    unpriced: list[UnpricedWindow] = []
    last_clock: int | None = None
    latest_ms: int | None = None

    def dead_letter(reason_code: str, reason: str, source: str, received_at: int, error_type: str,
                    message: InputMessage | None = None) -> None:
        dead[reason_code] += 1
        outputs.write(DEAD_LETTERS_FILE, {
            "reason_code": reason_code,
            "reason": reason,
            "error_type": error_type,
            "source": source,
            "received_at": iso_utc(received_at),
            "received_at_unix_ms": received_at,
            "record_type": None if message is None else type(message).__name__,
            "node": None if message is None else message.node_name,
        })

    def guarded(violations: Sequence[Violation], now_ms: int) -> None:
        for violation in violations:
            outputs.write(VIOLATIONS_FILE, violation_json(violation, now_ms))

    def emit(results: Sequence[WindowResult], now_ms: int) -> None:
        nonlocal windows, node_cost_micro
        for result in results:
            windows += 1
            for share in result.shares:
                outputs.write(SHARES_FILE, share_json(share))
                guarded(guard.share(share, now_ms), now_ms)
            if result.shares:
                try:
                    cost = bill_node_window(result.shares, catalog, split_policy, sharing)
                except PriceError as exc:
                    unpriced.append(UnpricedWindow(result.cluster, result.node_name, result.window_start_unix_ms,
                                                   str(exc)))
                except InvalidMessage as exc:
                    dead_letter(exc.reason_code, str(exc), f"window {result.node_name}@"
                                f"{iso_utc(result.window_start_unix_ms)}", result.window_end_unix_ms,
                                type(exc).__name__)
                else:
                    for record in cost.costs:
                        outputs.write(COSTS_FILE, cost_record_json(record))
                        guarded(guard.cost(record, now_ms), now_ms)
                    outputs.write(BILLS_FILE, cost.bill.as_json())
                    node_cost_micro += cost.bill.node_cost_micro_usd
        if results:
            # Written and priced: what the streaming app does once the rows are acknowledged.
            engine.record_emitted(results)
            engine.take_table_changes()

    try:
        if recorder is not None:
            recorder.__enter__()
        for item in inputs:
            now = item.received_at_unix_ms
            latest_ms = now if latest_ms is None else max(latest_ms, now)
            if last_clock is None or now > last_clock:
                last_clock = now
                guarded(guard.clock(now), now)
                emit(engine.on_clock(now).windows, now)
                if truth is not None:
                    for row in truth.take_closed(now):
                        outputs.write(TRUTH_FILE, row)
            if isinstance(item, InvalidInput):
                dead_letter(item.error.reason_code, str(item.error), item.source, now, type(item.error).__name__)
                continue
            message = item.message
            nodes.setdefault(message.node_name, None)
            if recorder is not None:
                recorder.write(item)
            if isinstance(message, PodEvent):
                pod_events += 1
                engine.on_pod_event(message)
                guarded(guard.pod_event(message, now), now)
                continue
            samples += 1
            latest_ms = max(latest_ms, message.sampled_at_unix_ms)
            try:
                result = engine.on_sample(message, now)
            except InvalidMessage as exc:
                dead_letter(exc.reason_code, str(exc), f"{message.node_name} tick "
                            f"{message.collector_started_at_unix_ms}/{message.sequence}", now, type(exc).__name__,
                            message)
                continue
            guarded(guard.sample(message, now), now)
            for late in result.late:
                error = late.error()
                dead_letter(error.reason_code, late.reason, f"{message.node_name} tick "
                            f"{message.collector_started_at_unix_ms}/{message.sequence}", now, type(error).__name__,
                            message)
            if result.duplicate:
                duplicates += 1
            if result.accepted and truth is not None:
                truth.add_tick(message)
            emit(result.windows, now)
        if latest_ms is not None:
            # End of input: the first instant at which the streaming timer would have closed every open window.
            end_ms = latest_ms + (window_seconds + grace_seconds + idle_close_seconds) * 1000
            emit(engine.on_clock(end_ms).windows, end_ms)
            guarded(guard.finish(end_ms), end_ms)
        if truth is not None:
            for row in truth.take_closed(None):
                outputs.write(TRUTH_FILE, row)
    finally:
        outputs.close()
        if recorder is not None:
            recorder.__exit__(None, None, None)

    return ReplaySummary(
        input_kind=input_kind,
        nodes=tuple(nodes),
        samples=samples,
        pod_events=pod_events,
        windows=windows,
        share_rows=outputs.counts[SHARES_FILE],
        truth_rows=outputs.counts[TRUTH_FILE],
        cost_rows=outputs.counts[COSTS_FILE],
        bills=outputs.counts[BILLS_FILE],
        node_cost_micro_usd=node_cost_micro,
        dead_letters=dict(sorted(dead.items())),
        unpriced=tuple(unpriced),
        duplicates_ignored=duplicates,
        recorded=recorder.count if recorder is not None else 0,
        files=dict(outputs.paths),
        violation_rows=outputs.counts[VIOLATIONS_FILE],
        violations_firing_at_end=len(guard.engine.active()),
    )


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every object of a JSON-lines file (for tests and tools reading replay's output)."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


__all__ = [
    "BILLS_FILE",
    "COSTS_FILE",
    "DEAD_LETTERS_FILE",
    "InputRecord",
    "InvalidInput",
    "RECORDING_MAGIC",
    "RECORDING_SUFFIX",
    "RecordedFrame",
    "RecordingError",
    "RecordingWriter",
    "ReplaySummary",
    "SHARES_FILE",
    "TRUTH_FILE",
    "UnpricedWindow",
    "VIOLATIONS_FILE",
    "decode_message",
    "encode_message",
    "is_recording",
    "iter_frames",
    "read_jsonl",
    "read_recording",
    "record_scenario",
    "recording_files",
    "replay",
    "scenario_records",
    "share_json",
    "write_recording",
]
