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

The ground truth is defined in ``pipeline/truth.py``, the recording format in ``pipeline/recordings.py``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from gpumeter.clock import iso_utc
from gpumeter.errors import ConfigError, InvalidMessage
from pipeline.recordings import (
    RECORDING_MAGIC,
    RECORDING_SUFFIX,
    InputMessage,
    InputRecord,
    InvalidInput,
    RecordingWriter,
    is_recording,
    recorded_inputs,
    scenario_nodes,
    scenario_records,
)
from pipeline.truth import TruthAccumulator
from schemas.records import GpuShare, PodEvent, Violation
from services.attributor.attribution import AttributionPolicy
from services.attributor.engine import AttributionEngine, EngineConfig, WindowResult
from services.attributor.pod_index import DEFAULT_GROUPING_LABELS, DEFAULT_LINGER_MS
from services.billing.catalog import PriceCatalog, PriceError, bundled_catalog
from services.billing.costing import bill_node_window, cost_record_json
from services.billing.pricing import DEFAULT_SPLIT_POLICY, SplitPolicy
from services.billing.sharing import KEEP_ALL, SharingPolicy
from services.guard.config import GuardConfig
from services.guard.replay import VIOLATIONS_FILE, GuardReplay, violation_json

SHARES_FILE = "shares.jsonl"
TRUTH_FILE = "truth.jsonl"
COSTS_FILE = "costs.jsonl"
BILLS_FILE = "bills.jsonl"
DEAD_LETTERS_FILE = "dead_letters.jsonl"

INPUT_SCENARIO = "scenario"
INPUT_RECORDING = "recording"

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
        "mig_profile": share.mig_profile,
        "mig_gpu_instance_id": share.mig_gpu_instance_id,
    }


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

    truth: TruthAccumulator | None = None
    inputs: Iterable[InputRecord | InvalidInput]
    if not input_path.exists():
        raise ConfigError(f"replay input {input_path} does not exist")
    if _is_scenario_path(input_path):
        from simulator.scenario import load_scenario

        scenario = load_scenario(input_path)
        input_kind = INPUT_SCENARIO
        inputs = scenario_records(scenario, scenario_nodes(scenario, node))
        truth = TruthAccumulator(scenario, window_seconds)
    elif is_recording(input_path):
        input_kind = INPUT_RECORDING
        inputs = recorded_inputs(input_path)
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
    "ReplaySummary",
    "SHARES_FILE",
    "TRUTH_FILE",
    "UnpricedWindow",
    "VIOLATIONS_FILE",
    "read_jsonl",
    "replay",
    "share_json",
]
