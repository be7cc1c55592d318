"""Replay: re-pricing recorded history end to end, and the 40-node scenario hour.

* **recording**: the benchmark fleet (``bench.simulator.fleet_scenario_yaml``: 8 GPUs and 25 pods per node, every
  sharing mode) recorded as ``gpumeter record`` writes it (recording format version 2, gzip), then
  ``replay()`` of that file into a temporary folder: reading and decoding the frames, the attributor, billing
  (its ledger on an in-memory SQLite), the guard, and the JSON-lines output -- what ``gpumeter replay FILE``
  does. Measured as GPU-samples (node samples × GPUs per node) per CPU-second of this one process: one core.
  Issue 24's goal: >= 50,000.
* **scenario**: ``replay()`` of the 40-node hour, the scenario side -- the simulator answering the collector's real
  sampling code, and the simulator's truth -- in ``SCENARIO_WORKERS`` worker processes (``os.cpu_count()``),
  wall seconds (and the CPU of this process and of the workers). Issue 24's goal: < 20 s.

Both come with the CPU seconds of each of replay's stages (``pipeline.replay.REPLAY_STAGES``, taken through its
``on_stage`` hook), which is where the time goes.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from bench.common import Target
from bench.simulator import HOUR_S, fleet_scenario_yaml

TARGET_GPU_SAMPLES_PER_S = 50_000
TARGET_SCENARIO_S = 20.0
GPUS_PER_NODE = 8
SCENARIO_WORKERS = os.cpu_count() or 1  # replay's default: the scenario side in a process per core
RECORDING_NODES, QUICK_RECORDING_NODES = 10, 4
SCENARIO_NODES, QUICK_SCENARIO_NODES = 40, 4
QUICK_DURATION_S = 600


def record_fleet(nodes: int, duration_seconds: int, path: Path) -> int:
    """Record the fleet's input as ``gpumeter record`` writes it (version 2, gzip); how many frames."""
    from pipeline.recordings import RecordingWriter, encode_message, scenario_records
    from simulator.scenario import load_scenario

    scenario = load_scenario(fleet_scenario_yaml(nodes, duration_seconds))
    with RecordingWriter(path, version=2, compression="gzip") as writer:
        for record in scenario_records(scenario):
            writer.write_frame(record.received_at_unix_ms, encode_message(record.message))
    return writer.count


def timed_replay(source: Path, out: Path, **options: Any) -> tuple[dict[str, float], float, float, Any]:
    """``replay(source, out)``: CPU seconds per stage, total CPU and wall seconds, and its summary."""
    from pipeline.replay import replay

    stages: dict[str, float] = defaultdict(float)
    current: list[Any] = [None, 0.0]

    def on_stage(name: str) -> None:
        now = time.process_time()
        if current[0] is not None:
            stages[current[0]] += now - current[1]
        current[0], current[1] = name, now

    cpu0, wall0 = time.process_time(), time.perf_counter()
    summary = replay(source, out, on_stage=on_stage, **options)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {name: round(seconds, 3) for name, seconds in stages.items()}, cpu, wall, summary


def _figures(stages: dict[str, float], cpu: float, wall: float, summary: Any, nodes: int,
             duration_seconds: int) -> dict[str, Any]:
    if summary.unpriced or summary.dead_letter_count:
        raise AssertionError(f"the fleet replay left {len(summary.unpriced)} node-window(s) unpriced and "
                             f"{summary.dead_letter_count} input(s) dead-lettered: not the workload described")
    gpu_samples = summary.samples * GPUS_PER_NODE
    return {
        "nodes": nodes,
        "duration_s": duration_seconds,
        "samples": summary.samples,
        "gpu_samples": gpu_samples,
        "cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "gpu_samples_per_cpu_s": round(gpu_samples / cpu),
        "stage_cpu_s": stages,
        "stage_cpu_us_per_gpu_sample": {name: round(s / gpu_samples * 1e6, 1) for name, s in stages.items()},
        "share_rows": summary.share_rows,
        "cost_rows": summary.cost_rows,
        "bills": summary.bills,
    }


def _in_scratch(fn: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="gpumeter-bench-replay-"))
    try:
        return fn(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def measure_recording(nodes: int, duration_seconds: int) -> dict[str, Any]:
    """Replay of a recorded fleet (see the module docstring), once."""

    def run(workdir: Path) -> dict[str, Any]:
        path = workdir / "fleet.gmrec"
        frames = record_fleet(nodes, duration_seconds, path)
        figures = _figures(*timed_replay(path, workdir / "out"), nodes, duration_seconds)
        return {**figures, "frames": frames, "recording_bytes": path.stat().st_size}

    return _in_scratch(run)


def measure_scenario(nodes: int, duration_seconds: int) -> dict[str, Any]:
    """Replay of the fleet scenario (see the module docstring), once."""

    def run(workdir: Path) -> dict[str, Any]:
        path = workdir / "fleet.yaml"
        path.write_text(fleet_scenario_yaml(nodes, duration_seconds))
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        figures = _figures(*timed_replay(path, workdir / "out", workers=SCENARIO_WORKERS), nodes, duration_seconds)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        workers_cpu = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
        return {**figures, "scenario_workers": SCENARIO_WORKERS, "workers_cpu_s": round(workers_cpu, 3)}

    return _in_scratch(run)


def _largest(stages: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:g} s" for name, seconds in sorted(stages.items(), key=lambda kv: -kv[1]))


def run(quick: bool) -> tuple[dict[str, Any], list[Target], list[str]]:
    duration = QUICK_DURATION_S if quick else HOUR_S
    recording = measure_recording(QUICK_RECORDING_NODES if quick else RECORDING_NODES, duration)
    scenario = measure_scenario(QUICK_SCENARIO_NODES if quick else SCENARIO_NODES, duration)
    rate = recording["gpu_samples_per_cpu_s"]
    rate_met = rate >= TARGET_GPU_SAMPLES_PER_S and not quick
    scenario_met = scenario["wall_s"] < TARGET_SCENARIO_S and not quick
    targets = [
        Target(f"replay of a recording ({recording['nodes']} nodes x {GPUS_PER_NODE} GPUs x "
               f"{duration / HOUR_S:g} h, gzip), end to end, one core",
               f">= {TARGET_GPU_SAMPLES_PER_S:,} GPU-samples/s",
               f"{rate:,} GPU-samples/s ({recording['cpu_s']} s CPU for {recording['gpu_samples']:,})", rate_met,
               "" if rate_met else f"CPU per stage: {_largest(recording['stage_cpu_s'])}; see docs/performance.md"),
        Target(f"replay of the scenario {scenario['nodes']} nodes x {GPUS_PER_NODE} GPUs x {duration / HOUR_S:g} h "
               f"({SCENARIO_WORKERS or 'no'} worker processes)",
               f"< {TARGET_SCENARIO_S:g} s (40 nodes x 8 GPUs x 1 h)",
               f"{scenario['wall_s']} s wall, {scenario['cpu_s']} s CPU (+ {scenario['workers_cpu_s']} s in the "
               f"workers)", scenario_met,
               "" if scenario_met else f"CPU per stage: {_largest(scenario['stage_cpu_s'])}; see "
               "docs/performance.md"),
    ]
    notes = ["one run each; GPU-samples = node samples x 8 GPUs; stages as pipeline.replay.REPLAY_STAGES"]
    return {"recording": recording, "scenario": scenario}, targets, notes
