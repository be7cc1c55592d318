"""Simulator: replay seconds per simulated hour as the cluster grows, and the whole 40-node replay.

The scenario is generated here (``fleet_scenario_yaml``): ``nodes`` ``p5.48xlarge``-like nodes (8 × H100 80GB,
priced in the bundled catalog), each GPU pair in one sharing mode — 0-1 exclusive, 2-3 time-sliced into 4
replicas, 4-5 MPS with 4 replicas, 6-7 MIG (3g.40gb, 2g.20gb, 1g.10gb, 1g.10gb; the last instance idle) — and 24
pods per node: one on each exclusive GPU (the second replaced mid-run: one pod ends, another starts), four per
time-sliced or MPS GPU, three per MIG GPU. Memory and compute follow every kind the scenario format has (fixed,
preallocated, ramped, stepped), so each attribution bucket and each NVML path is exercised.

Measured (CPU seconds of this process, best of ``REPEATS``):

* **scenario side**: ``scenario_records`` fully consumed — the simulated world, ``FakeNvml`` answering the
  collector's real ``NvmlBackend``, the fake ``/proc`` and the collector's cgroup reader and sample assembly, for
  every node's every tick — at 10, 20 and 40 nodes; as seconds per simulated hour and per node-hour. The
  linearity ratio is (seconds per node-hour at 40 nodes) / (at 10 nodes): 1.0 is linear.
* **whole replay**: ``replay()`` of the 40-node scenario into a temporary folder — scenario side, the
  attributor's engine, billing, the guard, the ground truth and the JSON-lines output — as ``gpumeter replay``
  does it.
* **NVML calls per node-tick**: the ``FakeNvml`` calls of one node's ticks (what the scenario side's cost grows
  with).

Target (issue 16): the whole replay of 40 nodes × 8 GPUs × 1 h at 10 s ticks in < 20 s.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import Target, timed

TARGET_REPLAY_S = 20.0
NODE_COUNTS = (10, 20, 40)
QUICK_NODE_COUNTS = (2, 4, 8)
HOUR_S = 3600
INTERVAL_S = 10
REPEATS = 2

_H100 = ("        memory_total_bytes: 85520809984\n"
         "        driver_reserved_bytes: 597688320\n")
_MIG_INSTANCES = ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")


def node_name(index: int) -> str:
    return f"gpu-p5-{index:03d}"


def _process(name: str, memory: str, compute: str) -> list[str]:
    return [f"          - name: {name}", f"            memory: {memory}", f"            compute: {compute}"]


def _pod(namespace: str, name: str, node: str, team: str, model: str, device: str, processes: list[str], *,
         start_seconds: int | None = None, end_seconds: int | None = None) -> list[str]:
    lines = [f"  - namespace: {namespace}", f"    name: {name}", f"    node: {node}",
             f"    labels: {{team: {team}, model: {model}}}"]
    if start_seconds is not None:
        lines.append(f"    start_seconds: {start_seconds}")
    if end_seconds is not None:
        lines.append(f"    end_seconds: {end_seconds}")
    lines += ["    containers:", "      - name: main", f"        devices: [{device}]", "        processes:"]
    return lines + processes


def fleet_scenario_yaml(nodes: int, duration_seconds: int = HOUR_S, interval_seconds: int = INTERVAL_S,
                        seed: int = 16) -> str:
    """The benchmark cluster of ``nodes`` nodes (see the module docstring), ticking every ``interval_seconds``
    for ``duration_seconds``. Deterministic: the same arguments give the same text."""
    if nodes < 1:
        raise ValueError("a fleet needs at least one node")
    half = duration_seconds // 2
    lines = ["cluster: bench-sim", f"seed: {seed}", 'start: "2026-07-01T00:00:00Z"',
             f"interval_seconds: {interval_seconds}", f"duration_seconds: {duration_seconds}", "nodes:"]
    for n in range(nodes):
        lines += [f"  - name: {node_name(n)}", "    cloud_provider: aws", "    region: us-east-1",
                  "    instance_type: p5.48xlarge", "    price_model: on_demand",
                  f"    cgroup_driver: {'systemd' if n % 2 == 0 else 'cgroupfs'}", "    container_runtime: containerd",
                  "    gpus:"]
        for sharing in ("{mode: exclusive}", "{mode: time_slicing, replicas: 4}", "{mode: mps, replicas: 4}",
                        f"{{mode: mig, instances: [{', '.join(_MIG_INSTANCES)}]}}"):
            lines += ["      - model: NVIDIA H100 80GB HBM3", "        count: 2", _H100.rstrip("\n"),
                      f"        sharing: {sharing}"]
    lines.append("pods:")
    teams = ("assistants", "search", "ranking", "media", "foundation", "research")
    for n in range(nodes):
        node = node_name(n)
        team = teams[n % len(teams)]
        lines += _pod("training", f"train-{n}", node, "foundation", "llama-3-70b",
                      "{resource: nvidia.com/gpu, gpu: 0}",
                      _process("python", "{preallocate_fraction: 0.92}", f"[[0, 0.6], [{half // 3}, 0.95]]"))
        lines += _pod("research", f"sweep-{n}-a", node, "research", "mixtral-8x7b",
                      "{resource: nvidia.com/gpu, gpu: 1}",
                      _process("python", f"{{ramp: {{from_bytes: 8GiB, to_bytes: 60GiB, over_seconds: {half}}}}}",
                               "0.8"), end_seconds=half)
        lines += _pod("research", f"sweep-{n}-b", node, "research", "mixtral-8x7b",
                      "{resource: nvidia.com/gpu, gpu: 1}",
                      _process("python", "{bytes: 30GiB}", "0.7"), start_seconds=half + 5 * interval_seconds)
        for g in (2, 3, 4, 5):
            for r in range(4):
                kind = "ts" if g < 4 else "mps"
                compute = f"{0.1 + 0.05 * r:.2f}" if r % 2 == 0 else f"[[0, 0.3], [{half}, {0.05 + 0.1 * r:.2f}]]"
                memory = f"{{bytes: {2 + 2 * r}GiB}}" if kind == "ts" else "{preallocate_fraction: 0.5}"
                lines += _pod("serving", f"{kind}-{n}-{g}-{r}", node, team, f"model-{r}",
                              f"{{resource: nvidia.com/gpu.shared, gpu: {g}, replica: {r}}}",
                              _process("python3", memory, compute))
        for g in (6, 7):
            for i, profile in enumerate(_MIG_INSTANCES[:3]):
                lines += _pod("batch", f"mig-{n}-{g}-{i}", node, team, f"mig-model-{i}",
                              f"{{resource: nvidia.com/mig-{profile}, gpu: {g}, instance: {i}}}",
                              _process("python", "{preallocate_fraction: 0.6}", f"{0.3 + 0.2 * i:.1f}"))
    return "\n".join(lines) + "\n"
