"""NvmlBackend.read() over the simulated NVML: samples per CPU second on one node of 8 GPUs × 8 processes.

``python -m bench.nvml_driver [--repeats N] [--ticks N]`` reads one generated node (``bench.collector.scenario_yaml``:
8 × H100 time-sliced, one single-process pod per replica) through ``NvmlBackend`` for ``--ticks`` ticks, over
nvidia-ml-py's own code on the C-level simulator (``simulator.nvml_driver.simulated_pynvml``) and over the
module-level stand-in (``simulator.fake_pynvml.FakeNvml``), alternating A, B, A, B in one run, and checks that both
give identical readings. It prints node reads (one ``NvmlReading``: 8 GPU samples) per CPU second for each and the
CPU ratio; the world's own computation is in both.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

from bench.collector import NODE, scenario_yaml
from bench.common import alternate, machine_info
from gpumeter.clock import ManualClock
from services.collector.nvml_backend import NvmlBackend
from services.collector.simulation import sharing_config
from simulator.scenario import load_scenario
from simulator.world import SimWorld

GPUS, PROCESSES_PER_GPU = 8, 8


def measure(ticks: int, repeats: int) -> dict[str, Any]:
    from simulator.fake_pynvml import FakeNvml
    from simulator.nvml_driver import simulated_pynvml

    scenario = load_scenario(scenario_yaml(GPUS, PROCESSES_PER_GPU, duration_seconds=ticks + 10))
    node = scenario.node(NODE)
    times = scenario.tick_times_ms()[: ticks + 1]

    def setup(make: Callable[[SimWorld, ManualClock], Any]) -> Callable[[], tuple[NvmlBackend, ManualClock]]:
        def build() -> tuple[NvmlBackend, ManualClock]:
            world, clock = SimWorld(scenario), ManualClock(times[0])
            backend = NvmlBackend(make(world, clock), clock, sharing_by_gpu_uuid=sharing_config(node))
            backend.read()  # warm-up, untimed: nvmlInit and the backend's caches
            return backend, clock

        return build

    def body(state: tuple[NvmlBackend, ManualClock]) -> list[Any]:
        backend, clock = state
        readings = []
        for t in times[1:]:
            clock.set_ms(t)
            readings.append(backend.read())
        return readings

    first: dict[str, list[Any]] = {}

    def check(name: str, readings: list[Any]) -> None:
        first.setdefault(name, readings)

    series = alternate(
        [
            ("module_fake", setup(lambda w, c: FakeNvml(w, c, NODE)), body),
            ("ctypes_driver", setup(lambda w, c: simulated_pynvml(w, c, NODE)), body),
        ],
        repeats,
        check,
    )
    if first["module_fake"] != first["ctypes_driver"]:
        raise AssertionError("the module fake and the C-level simulator gave different readings")
    processes = sum(len(d.process_pids) for d in first["ctypes_driver"][0].devices)
    out: dict[str, Any] = {"gpus": GPUS, "processes": processes, "ticks": ticks, "repeats": repeats}
    for name, s in series.items():
        out[name] = {
            "median_cpu_s": round(s.median_cpu_s, 4),
            "best_cpu_s": round(s.best_cpu_s, 4),
            "node_reads_per_cpu_s": round(ticks / s.median_cpu_s, 1),
            "gpu_samples_per_cpu_s": round(ticks * GPUS / s.median_cpu_s, 1),
        }
    out["cpu_ratio_ctypes_over_module"] = round(series["ctypes_driver"].median_cpu_s / series["module_fake"].median_cpu_s, 3)
    out["machine"] = machine_info()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(json.dumps(measure(args.ticks, args.repeats), indent=2))


if __name__ == "__main__":
    main()
