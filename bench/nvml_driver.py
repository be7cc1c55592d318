"""NvmlBackend.read() over the simulated NVML library: node reads per CPU second, 8 GPUs × 8 processes.

``python -m bench.nvml_driver [--repeats N] [--ticks N]`` reads one generated node (``bench.collector.scenario_yaml``:
8 × H100 time-sliced, one single-process pod per replica) through ``NvmlBackend`` for ``--ticks`` ticks over
nvidia-ml-py's own code on the C-level simulator (``simulator.nvml_driver.simulated_pynvml``) and prints node reads
(one ``NvmlReading``: 8 GPU samples) and C calls per CPU second; the world's own computation is included.

The module-level stand-in that replaced the whole ``pynvml`` module (``simulator/fake_pynvml.py``) was measured
against it by this benchmark at commit 22628e4, alternating in one run, with identical readings: 922 node reads per
CPU second over the stand-in, 658 over pynvml on the C-level simulator (CPU ratio 1.40; docs/performance.md,
"NVML simulator"). The stand-in was then removed.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from bench.collector import NODE, scenario_yaml
from bench.common import alternate, machine_info
from gpumeter.clock import ManualClock
from services.collector.nvml_backend import NvmlBackend
from services.collector.simulation import sharing_config
from simulator.nvml_driver import simulated_pynvml
from simulator.scenario import load_scenario
from simulator.world import SimWorld

GPUS, PROCESSES_PER_GPU = 8, 8


def measure(ticks: int, repeats: int) -> dict[str, Any]:
    scenario = load_scenario(scenario_yaml(GPUS, PROCESSES_PER_GPU, duration_seconds=ticks + 10))
    node = scenario.node(NODE)
    times = scenario.tick_times_ms()[: ticks + 1]

    def setup() -> tuple[NvmlBackend, ManualClock, Any]:
        world, clock = SimWorld(scenario), ManualClock(times[0])
        nvml = simulated_pynvml(world, clock, NODE)
        backend = NvmlBackend(nvml, clock, sharing_by_gpu_uuid=sharing_config(node))
        backend.read()  # warm-up, untimed: nvmlInit and the backend's caches
        nvml.nvmlLib.call_counts.clear()
        return backend, clock, nvml.nvmlLib

    def body(state: tuple[NvmlBackend, ManualClock, Any]) -> int:
        backend, clock, library = state
        for t in times[1:]:
            clock.set_ms(t)
            backend.read()
        if library.callback_exceptions:
            raise AssertionError(f"the simulated library raised: {library.callback_exceptions[0]!r}")
        return sum(library.call_counts.values())

    calls: list[int] = []
    series = alternate([("ctypes_driver", setup, body)], repeats, lambda _, n: calls.append(n))["ctypes_driver"]
    return {
        "gpus": GPUS,
        "processes": GPUS * PROCESSES_PER_GPU,
        "ticks": ticks,
        "repeats": repeats,
        "median_cpu_s": round(series.median_cpu_s, 4),
        "node_reads_per_cpu_s": round(ticks / series.median_cpu_s, 1),
        "gpu_samples_per_cpu_s": round(ticks * GPUS / series.median_cpu_s, 1),
        "c_calls_per_node_read": calls[0] / ticks,
        "machine": machine_info(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(json.dumps(measure(args.ticks, args.repeats), indent=2))


if __name__ == "__main__":
    main()
