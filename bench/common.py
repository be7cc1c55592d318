"""What every benchmark shares: the machine's facts, CPU/wall timing, alternating A/B runs, result files.

Timing rules (why the figures can be trusted on a shared 2-core machine):

* Each figure is the **best of several repetitions** (the run least disturbed by other work: noise only ever adds
  time), and its spread (median) is kept next to it.
* gpumeter's code and its baseline run **alternately** in the same process (A, B, A, B, ...), so a burst of other
  load hits both: the ratio between them is robust where absolute figures are not.
* Per-core throughput is computed from the process's **CPU time** (``time.process_time``), which other processes
  on the machine do not inflate the way they inflate wall time; wall time is recorded too.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
RESULT_FORMAT = 1


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """Cores (online and usable by this process), CPU model, memory, Python and the libraries that set the pace."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 0
    memory_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / (1024 * 1024), 1)
    except OSError:
        pass
    versions: dict[str, str] = {}
    for module in ("fastavro", "aiokafka", "faust", "sqlalchemy", "psycopg"):
        try:
            versions[module] = str(__import__(module).__version__)
        except Exception:  # a module that is missing or has no version is simply not listed
            continue
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {
        "cores_online": os.cpu_count(),
        "cores_usable": usable,
        "cpu_model": cpu_model(),
        "memory_gib": memory_gib,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "libraries": versions,
        "load_average_at_start": load,
    }


@dataclass(frozen=True)
class Timing:
    """One measured run: CPU seconds of this process and wall seconds."""

    cpu_s: float
    wall_s: float


def timed(fn: Callable[[], Any]) -> tuple[Timing, Any]:
    """Run ``fn`` once; its CPU and wall time, and what it returned."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    value = fn()
    cpu1, wall1 = time.process_time(), time.perf_counter()
    return Timing(cpu1 - cpu0, wall1 - wall0), value


@dataclass
class Series:
    """Repeated timings of one variant."""

    name: str
    timings: list[Timing] = field(default_factory=list)

    @property
    def best_cpu_s(self) -> float:
        return min(t.cpu_s for t in self.timings)

    @property
    def best_wall_s(self) -> float:
        return min(t.wall_s for t in self.timings)

    @property
    def median_cpu_s(self) -> float:
        return statistics.median(t.cpu_s for t in self.timings)

    def summary(self, units: float, unit_name: str) -> dict[str, Any]:
        """Rates per CPU second and per wall second for ``units`` of work per run (best run), plus the spread."""
        best_cpu = max(self.best_cpu_s, 1e-9)
        return {
            "runs": len(self.timings),
            "best_cpu_s": round(self.best_cpu_s, 6),
            "median_cpu_s": round(self.median_cpu_s, 6),
            "best_wall_s": round(self.best_wall_s, 6),
            f"{unit_name}_per_cpu_s": round(units / best_cpu, 1),
            f"{unit_name}_per_wall_s": round(units / max(self.best_wall_s, 1e-9), 1),
            f"cpu_us_per_{unit_name.rstrip('s')}": round(best_cpu / units * 1e6, 3) if units else None,
        }


def alternate(variants: Sequence[tuple[str, Callable[[], Any], Callable[[Any], Any]]], repeats: int,
              check: Callable[[str, Any], None] | None = None) -> dict[str, Series]:
    """Run each variant ``repeats`` times, interleaved (A, B, A, B, ...). A variant is (name, setup, body):
    ``setup()`` builds what ``body`` works on and is not timed; ``body(state)`` is timed. ``check(name, result)``
    runs after each body, untimed. A garbage collection runs before each body so that one variant's garbage is
    not collected on the other's time."""
    series = {name: Series(name) for name, _, _ in variants}
    for _ in range(repeats):
        for name, setup, body in variants:
            state = setup()
            gc.collect()
            timing, value = timed(lambda: body(state))
            series[name].timings.append(timing)
            if check is not None:
                check(name, value)
    return series


@dataclass(frozen=True)
class Target:
    """A goal from the issue and whether this run met it. ``cause`` says what limits it when it was not met."""

    name: str
    goal: str
    measured: str
    met: bool
    cause: str = ""


def write_result(name: str, *, quick: bool, figures: Mapping[str, Any], targets: Sequence[Target],
                 notes: Sequence[str] = (), started_unix_s: float, results_dir: Path = RESULTS_DIR,
                 machine: Mapping[str, Any] | None = None, command: str | None = None,
                 duration_s: float | None = None) -> Path:
    """Write ``results_dir/<name>.json`` (atomically) and return its path.

    ``machine``: the machine the figures were taken on, where that is not this one (``machine_info()`` of the
    machine that ran them, carried back in their files); ``command``: what produced them, where not bench.run;
    ``duration_s``: how long they took, where not since ``started_unix_s`` (figures written after they were taken)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    document = {
        "format": RESULT_FORMAT,
        "benchmark": name,
        "quick": quick,
        "started_at_unix_s": round(started_unix_s, 3),
        "duration_s": round(duration_s if duration_s is not None else time.time() - started_unix_s, 1),
        "machine": dict(machine) if machine is not None else machine_info(),
        "command": command or " ".join([Path(sys.executable).name, "-m", "bench.run", *sys.argv[1:]]),
        "figures": figures,
        "targets": [asdict(t) for t in targets],
        "notes": list(notes),
    }
    path = results_dir / f"{name}.json"
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")
    partial.replace(path)
    return path


def read_results(results_dir: Path = RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """Every result file present, by benchmark name."""
    out = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(document, dict) and "benchmark" in document:
            out[document["benchmark"]] = document
    return out


def fmt_int(value: float) -> str:
    return f"{value:,.0f}"


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs"
