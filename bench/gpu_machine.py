"""Checks that need a real GPU machine, run once per lease: NVML's answers against known loads, and core scale-out.

Run on a machine with an NVIDIA GPU (the device tool's H200: 16 cores) from the repository root::

    python3 -m bench.gpu_machine --gpu-load PATH/gpu_load.py --out DIR

It writes into DIR:

* ``nvml_truth.jsonl``: per second, what ``NvmlBackend`` read over the real nvidia-ml-py (every device field) and
  the raw pynvml answers beside it (memory info v1 and v2, the compute and MPS process lists, the raw
  per-process utilization samples with their timestamps, utilization rates), with what each ``gpu_load.py``
  process says it holds and how busy it keeps the GPU (the truth).
* ``nvml_truth_summary.json``: per phase and process: NVML's ``usedGpuMemory`` minus the bytes allocated (the
  CUDA context), the mean per-process SM utilization NVML reported against the process's busy fraction, and how
  many seconds each pid had a sample.
* ``scaleout.json``: the attribution core (decode + engine, ``bench.attribution``) in 1, 2, 4, 8 and 16 worker
  processes, each on its own nodes (as partitions are): the same total work, wall-clock and CPU seconds, speed-up.
* ``machine.json`` (that machine's ``bench.common.machine_info()``) and ``gpu_machine.json``: the result document
  ``bench.run`` renders in docs/performance.md's table. Copy the files into ``bench/results/gpu_machine/`` and
  ``gpu_machine.json`` into ``bench/results/`` (or rebuild it here: ``--result-from DIR --machine-json
  DIR/machine.json``).

Phases of the NVML check: ``time_sliced`` (four processes on GPU 0: 4 GiB busy half the time, 1 GiB idle, a
context only busy a quarter, 2 GiB freed and re-allocated every 10 s) and ``mps`` (the MPS control daemon
started, two clients, then stopped; skipped with the reason when the daemon does not start) and
``sampling_probe`` (three busy processes; every 0.25 s the whole per-process utilization buffer, ``lastSeen`` 0,
through both NVML calls for it; ``--only-probe`` runs it alone). Nothing here
changes the GPU's settings (no MIG change, no reset, no clocks).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

TIME_SLICED_LOADS = (  # (alloc MiB, busy fraction, realloc every s)
    (4096, 0.5, 0.0),
    (1024, 0.0, 0.0),
    (0, 0.25, 0.0),
    (2048, 0.1, 10.0),
)
MPS_LOADS = ((2048, 0.3, 0.0), (512, 0.6, 0.0))


# ---------------------------------------------------------------------------------------------------------------
# NVML against known loads


def _raw(pynvml: Any, handle: Any, last_seen_us: int) -> dict[str, Any]:
    """pynvml's own answers for one GPU, each call's error kept as text."""

    def attempt(fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:  # recorded: the point is to see what the real driver does
            return {"error": f"{type(exc).__name__}: {exc}", "value": getattr(exc, "value", None)}

    def procs(listed: Any) -> Any:
        if isinstance(listed, dict):
            return listed
        return [
            {k: getattr(p, k, None) for k in ("pid", "usedGpuMemory", "gpuInstanceId", "computeInstanceId")}
            for p in listed
        ]

    def mem(info: Any) -> Any:
        if isinstance(info, dict):
            return info
        return {k: getattr(info, k, None) for k in ("total", "free", "used", "reserved", "version")}

    def util_samples(samples: Any) -> Any:
        if isinstance(samples, dict):
            return samples
        return [
            {k: getattr(s, k, None) for k in ("pid", "timeStamp", "smUtil", "memUtil", "encUtil", "decUtil")}
            for s in samples
        ]

    rates = attempt(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle))
    return {
        "memory_v1": mem(attempt(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))),
        "memory_v2": mem(attempt(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2))),
        "compute_processes": procs(attempt(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle))),
        "mps_processes": procs(attempt(lambda: pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle))),
        "process_utilization": util_samples(
            attempt(lambda: pynvml.nvmlDeviceGetProcessUtilization(handle, last_seen_us))
        ),
        "utilization_rates": rates if isinstance(rates, dict) else {"gpu": rates.gpu, "memory": rates.memory},
        "mig_mode": attempt(lambda: list(pynvml.nvmlDeviceGetMigMode(handle))),
    }


def _start_loads(gpu_load: Path, loads: tuple[tuple[int, float, float], ...], seconds: float,
                 env: dict[str, str]) -> list[tuple[subprocess.Popen, dict[str, Any]]]:
    started = []
    for alloc_mib, busy, realloc in loads:
        cmd = [sys.executable, str(gpu_load), "--device", "0", "--alloc-mib", str(alloc_mib), "--busy", str(busy),
               "--seconds", str(seconds)]
        if realloc:
            cmd += ["--realloc-every", str(realloc)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        os.set_blocking(proc.stdout.fileno(), False)
        started.append((proc, {"alloc_mib": alloc_mib, "busy_fraction": busy, "realloc_every_s": realloc,
                               "pid": proc.pid, "lines": [], "stderr": ""}))
    return started


def _drain(started: list[tuple[subprocess.Popen, dict[str, Any]]]) -> None:
    for proc, info in started:
        try:
            chunk = proc.stdout.read()
        except (BlockingIOError, TypeError):
            chunk = None
        if chunk:
            for line in chunk.splitlines():
                try:
                    info["lines"].append(json.loads(line))
                except ValueError:
                    info["lines"].append({"text": line})


def _phase(name: str, gpu_load: Path, loads: tuple[tuple[int, float, float], ...], seconds: float,
           env: dict[str, str], out: Any) -> dict[str, Any]:
    import pynvml

    from gpumeter.clock import SystemClock
    from services.collector.nvml_backend import NvmlBackend

    backend = NvmlBackend(pynvml, SystemClock())
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    started = _start_loads(gpu_load, loads, seconds, env)
    last_seen_us = 0
    ticks = []
    deadline = time.monotonic() + seconds + 2
    while time.monotonic() < deadline and any(p.poll() is None for p, _ in started):
        time.sleep(1.0)
        _drain(started)
        reading = backend.read()
        raw = _raw(pynvml, handle, last_seen_us)
        stamps = [s["timeStamp"] for s in raw["process_utilization"]] if isinstance(raw["process_utilization"],
                                                                                 list) else []
        if stamps:
            last_seen_us = max(stamps)
        tick = {
            "phase": name, "t": time.time(),
            "backend": [asdict(d) for d in reading.devices],
            "backend_node_errors": [asdict(e) for e in reading.node_errors],
            "raw": raw,
            "truth": [{"pid": info["pid"], **(info["lines"][-1] if info["lines"] else {})} for _, info in started],
        }
        out.write(json.dumps(tick, default=str) + "\n")
        ticks.append(tick)
    for proc, info in started:
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        info["stderr"] = err[-2000:]
        info["returncode"] = proc.returncode
    backend.close()
    pynvml.nvmlShutdown()
    return _summarise(name, started, ticks)


def _summarise(name: str, started: list[tuple[subprocess.Popen, dict[str, Any]]],
               ticks: list[dict[str, Any]]) -> dict[str, Any]:
    per_process = []
    for _, info in started:
        pid = info["pid"]
        used, sm_backend, sm_raw, seen_backend = [], [], [], 0
        for tick in ticks:
            for device in tick["backend"]:
                pids = list(device["process_pids"])
                if pid in pids:
                    seen_backend += 1
                    i = pids.index(pid)
                    used.append(device["process_used_memory_bytes"][i])
                    sm_backend.append(device["process_sm_utilization_percent"][i])
            samples = tick["raw"]["process_utilization"]
            if isinstance(samples, list):
                sm_raw.extend(s["smUtil"] for s in samples if s["pid"] == pid)
        alloc = info["alloc_mib"] << 20
        per_process.append({
            "pid": pid, "alloc_mib": info["alloc_mib"], "busy_fraction": info["busy_fraction"],
            "realloc_every_s": info["realloc_every_s"], "returncode": info.get("returncode"),
            "stderr_tail": info["stderr"][-500:],
            "ticks_listed_by_backend": seen_backend, "ticks": len(ticks),
            "used_gpu_memory_bytes_min": min(used) if used else None,
            "used_gpu_memory_bytes_max": max(used) if used else None,
            "context_bytes_min_max": [min(used) - alloc, max(used) - alloc] if used else None,
            "sm_percent_backend_mean": sum(sm_backend) / len(sm_backend) if sm_backend else None,
            "sm_percent_raw_samples": len(sm_raw),
            "sm_percent_raw_mean": sum(sm_raw) / len(sm_raw) if sm_raw else None,
            "gpu_load_last_line": info["lines"][-1] if info["lines"] else None,
        })
    memory = [d for t in ticks for d in t["backend"] if d["index"] == 0]
    return {
        "phase": name, "ticks": len(ticks), "processes": per_process,
        "device0_memory_reserved_bytes": sorted({d["memory_reserved_bytes"] for d in memory})[:5],
        "device0_memory_used_minus_listed_bytes": [
            d["memory_used_bytes"] - sum(x for x in d["process_used_memory_bytes"] if x > 0) for d in memory
        ][-5:],
        "device0_errors": sorted({json.dumps(e) for d in memory for e in d["errors"]}),
        "device0_sharing_modes": sorted({str(d["sharing_mode"]) for d in memory}),
        "device0_mps_server_pids": sorted({p for d in memory for p in d["mps_server_pids"]}),
    }


def _mps_phase(gpu_load: Path, seconds: float, out: Any) -> dict[str, Any]:
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return {"phase": "mps", "skipped": "nvidia-cuda-mps-control not on PATH"}
    root = Path(tempfile.mkdtemp(prefix="mps-"))
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(root / "pipe"), CUDA_MPS_LOG_DIRECTORY=str(root / "log"))
    (root / "pipe").mkdir()
    (root / "log").mkdir()
    started = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, timeout=30)
    if started.returncode != 0:
        return {"phase": "mps", "skipped": f"mps-control -d: rc {started.returncode} {started.stderr[-500:]}"}
    try:
        summary = _phase("mps", gpu_load, MPS_LOADS, seconds, env, out)
    finally:
        subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True, timeout=30)
        time.sleep(2)
    logs = {p.name: p.read_text(errors="replace")[-1500:] for p in (root / "log").glob("*")}
    summary["mps_logs_tail"] = logs
    return summary


PROBE_LOADS = ((256, 0.5, 0.0), (256, 0.25, 0.0), (256, 0.1, 0.0))


def sampling_probe(gpu_load: Path, seconds: float, out: Any, interval_s: float = 0.25) -> dict[str, Any]:
    """What NVML's per-process utilization buffer holds on a time-sliced GPU: every ``interval_s`` ask for every
    buffered sample (``lastSeen`` 0) and for the newer API's (``nvmlDeviceGetProcessesUtilizationInfo``); each
    distinct (pid, timestamp) sample is kept once. Reads only: accounting mode is read, never set."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    started = _start_loads(gpu_load, PROBE_LOADS, seconds, dict(os.environ))
    distinct: dict[tuple[int, int], int] = {}
    distinct_info: dict[tuple[int, int], int] = {}
    calls = 0
    accounting = None
    try:
        accounting = int(pynvml.nvmlDeviceGetAccountingMode(handle))
    except Exception as exc:  # recorded
        accounting = f"{type(exc).__name__}: {exc}"
    deadline = time.monotonic() + seconds + 2
    while time.monotonic() < deadline and any(p.poll() is None for p, _ in started):
        time.sleep(interval_s)
        calls += 1
        record: dict[str, Any] = {"phase": "sampling_probe", "t": time.time()}
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(handle, 0)
            record["all_samples"] = [(s.pid, s.timeStamp, s.smUtil) for s in samples]
            for s in samples:
                distinct[(s.pid, s.timeStamp)] = s.smUtil
        except Exception as exc:
            record["all_samples"] = f"{type(exc).__name__}: {exc}"
        try:
            info = pynvml.nvmlDeviceGetProcessesUtilizationInfo(handle, 0)
            rows = [(u.pid, u.timeStamp, u.smUtil) for u in info]
            record["utilization_info"] = rows
            for pid, stamp, sm in rows:
                distinct_info[(pid, stamp)] = sm
        except Exception as exc:
            record["utilization_info"] = f"{type(exc).__name__}: {exc}"
        try:
            record["device_gpu_percent"] = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        except Exception as exc:
            record["device_gpu_percent"] = f"{type(exc).__name__}: {exc}"
        out.write(json.dumps(record, default=str) + "\n")
    for proc, _ in started:
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    pynvml.nvmlShutdown()

    def per_pid(samples: dict[tuple[int, int], int]) -> dict[str, Any]:
        sums: dict[int, list[int]] = {}
        for (pid, _), sm in samples.items():
            acc = sums.setdefault(pid, [0, 0])
            acc[0] += sm
            acc[1] += 1
        stamps = sorted({stamp for _, stamp in samples})
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        return {"by_pid": {str(pid): {"samples": n, "sm_sum": total} for pid, (total, n) in sums.items()},
                "distinct_timestamps": len(stamps),
                "median_gap_us": sorted(gaps)[len(gaps) // 2] if gaps else None}

    return {"phase": "sampling_probe", "calls": calls, "interval_s": interval_s, "accounting_mode": accounting,
            "loads": [{"pid": info["pid"], "busy_fraction": info["busy_fraction"]} for _, info in started],
            "process_utilization": per_pid(distinct), "processes_utilization_info": per_pid(distinct_info)}


# ---------------------------------------------------------------------------------------------------------------
# attribution core across worker processes


def _core_worker(args: tuple[int, int, Any, Any]) -> dict[str, float]:
    nodes, ticks, barrier, _ = args
    from bench.attribution import build_input, engine_with_pods, run_engine

    data = build_input(nodes, ticks)
    engine = engine_with_pods(data)
    barrier.wait()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    records = run_engine(engine, data.avro_messages)
    return {"start": time.time() - (time.perf_counter() - wall0), "wall_s": time.perf_counter() - wall0,
            "cpu_s": time.process_time() - cpu0, "gpu_samples": data.gpu_samples, "records": len(records)}


def scaleout(total_nodes: int, ticks: int, workers: tuple[int, ...]) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")
    rows = []
    for n in workers:
        with ctx.Manager() as manager:
            barrier = manager.Barrier(n)
            with ctx.Pool(n) as pool:
                results = pool.map(_core_worker, [(total_nodes // n, ticks, barrier, i) for i in range(n)])
        wall = max(r["start"] + r["wall_s"] for r in results) - min(r["start"] for r in results)
        samples = sum(r["gpu_samples"] for r in results)
        rows.append({"workers": n, "wall_s": wall, "cpu_s": sum(r["cpu_s"] for r in results),
                     "gpu_samples": samples, "gpu_samples_per_s": samples / wall,
                     "cpu_s_per_1000_gpu_samples": 1000 * sum(r["cpu_s"] for r in results) / samples})
    base = rows[0]["gpu_samples_per_s"]
    for row in rows:
        row["speedup"] = row["gpu_samples_per_s"] / base
    return {"total_nodes": total_nodes, "ticks": ticks, "cpu_count": os.cpu_count(), "rows": rows}


# ---------------------------------------------------------------------------------------------------------------
# the result file (bench/results/gpu_machine.json, shown in docs/performance.md's table)


def _pct(values: list[float]) -> list[int]:
    total = sum(values)
    return [round(100 * v / total) for v in values] if total else [0 for _ in values]


def _probe_text(probe: dict[str, Any] | None) -> str:
    if not probe or "process_utilization" not in probe:
        return ""
    loads = probe["loads"]
    by_pid = probe["process_utilization"]["by_pid"]
    sums = [by_pid.get(str(load["pid"]), {}).get("sm_sum", 0) for load in loads]
    return (f"; every buffered sample (lastSeen 0, asked every {probe['interval_s']} s) for processes busy "
            f"{', '.join(format(load['busy_fraction'], '.0%') for load in loads)}: summed "
            f"{'/'.join(map(str, _pct(sums)))} % (one sample per process, renewed about every "
            f"{probe['process_utilization']['median_gap_us'] / 1e6:.1f} s)")


def targets_from(summary: dict[str, Any], scale: dict[str, Any] | None) -> list[Any]:
    """The table rows of one lease's files: the core scale-out, and what NVML answered against known loads."""
    from bench.common import Target

    out = []
    if scale:
        rows = scale["rows"]
        speedups = "; ".join(f"{r['workers']}: {r['speedup']:.2f}x" for r in rows[1:])
        worst = min(r["speedup"] / r["workers"] for r in rows)
        cpu = [r["cpu_s_per_1000_gpu_samples"] for r in rows]
        out.append(Target(
            f"attribution core scale-out, {scale['cpu_count']}-core GPU machine (wall-clock)",
            "N worker processes take N x the load (issue 23; each on its own nodes, as partitions are)",
            f"1 worker: {rows[0]['gpu_samples_per_s']:,.0f} GPU-samples/s; {speedups}; CPU-s per 1,000 GPU-samples "
            f"{cpu[0]:.4f} with 1, {cpu[-1]:.4f} with {rows[-1]['workers']} (+{100 * (cpu[-1] / cpu[0] - 1):.0f} %)",
            worst >= 0.85,
            f"no work is duplicated (every worker's records are its own), but each worker's CPU cost per sample "
            f"grows with the workers running (the machine's {scale['cpu_count']} vCPUs are not {scale['cpu_count']} "
            "free cores): worst N x ratio "
            f"{worst:.2f}. The whole stream (Kafka broker, services) could not travel to that machine: Kafka's jars "
            "(44.2 MB) and a Java runtime (none among its image's listed packages), with the services' wheels exceed the 64 MiB a "
            "lease carries"))
    sliced = summary.get("time_sliced") or {}
    procs = sliced.get("processes") or []
    if procs:
        contexts = sorted({c for p in procs if p["context_bytes_min_max"] for c in p["context_bytes_min_max"]})
        out.append(Target(
            "NVML per-process memory on a real GPU (no numeric target)",
            "usedGpuMemory = the bytes a process allocated + its CUDA context, every tick",
            f"{len(procs)} time-sliced processes over {sliced['ticks']} ticks: allocated + "
            f"{', '.join(f'{c:,}' for c in contexts)} B (context, constant per process); device used minus listed "
            f"{max(sliced['device0_memory_used_minus_listed_bytes']):,} B; reserved "
            f"{sliced['device0_memory_reserved_bytes'][0]:,} B",
            len(contexts) == 1))
        busy = [p["busy_fraction"] for p in procs]
        sm_means = [p["sm_percent_backend_mean"] or 0.0 for p in procs]
        out.append(Target(
            "NVML per-process SM utilization, time-sliced real GPU (no numeric target)",
            "each process's share of the device's busy time, as NVML's samples tell it",
            f"processes kept busy {', '.join(f'{b:.0%}' for b in busy)} of the time (kernel time "
            f"{'/'.join(map(str, _pct(busy)))} %): the backend's per-tick SM gave "
            f"{'/'.join(map(str, _pct(sm_means)))} %; raw samples per process "
            f"{', '.join(str(p['sm_percent_raw_samples']) for p in procs)} of {sliced['ticks']} ticks"
            + _probe_text(summary.get("sampling_probe")),
            True))
    mps = summary.get("mps") or {}
    if mps.get("processes"):
        out.append(Target(
            "NVML under MPS on a real GPU (no numeric target)",
            "server told from clients; clients' memory",
            f"sharing modes seen {mps['device0_sharing_modes']}; servers {mps['device0_mps_server_pids']}; each "
            f"client allocated + {mps['processes'][0]['context_bytes_min_max'][0]:,} B",
            bool(mps["device0_mps_server_pids"])))
    return out


def write_device_result(out_dir: Path, results_dir: Path, machine: dict[str, Any] | None = None,
                        started_unix_s: float | None = None, duration_s: float | None = None) -> Path:
    """``results_dir/gpu_machine.json`` from one lease's files in ``out_dir`` (``machine``: that machine's
    ``machine_info()``, where the files do not carry it)."""
    from bench.common import write_result

    summary = json.loads((out_dir / "nvml_truth_summary.json").read_text())
    scale_path = out_dir / "scaleout.json"
    scale = json.loads(scale_path.read_text()) if scale_path.exists() else None
    figures = {"nvml": summary, "scaleout": scale}
    return write_result("gpu_machine", quick=False, figures=figures, targets=targets_from(summary, scale),
                        notes=["taken on a lent GPU machine by python -m bench.gpu_machine; bench.run never runs it"],
                        started_unix_s=started_unix_s or (out_dir / "nvml_truth_summary.json").stat().st_mtime,
                        results_dir=results_dir, machine=machine, command="python3 -m bench.gpu_machine",
                        duration_s=duration_s if duration_s is not None else summary.get("duration_s"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu-load", type=Path, required=True, help="path of shared/device/gpu_load.py")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=35.0, help="length of each NVML phase")
    ap.add_argument("--scaleout-nodes", type=int, default=64, help="nodes split among the workers (multiple of 16)")
    ap.add_argument("--scaleout-ticks", type=int, default=150)
    ap.add_argument("--skip-nvml", action="store_true")
    ap.add_argument("--skip-scaleout", action="store_true")
    ap.add_argument("--only-probe", action="store_true", help="only the sampling probe (no other phase)")
    ap.add_argument("--result-from", type=Path, help="write bench/results/gpu_machine.json from a lease's files")
    ap.add_argument("--machine-json", type=Path, help="with --result-from: that machine's machine_info() as JSON")
    args = ap.parse_args()
    if args.result_from:
        from bench.common import RESULTS_DIR

        machine = json.loads(args.machine_json.read_text()) if args.machine_json else None
        print(write_device_result(args.result_from, RESULTS_DIR, machine))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    summary: dict[str, Any] = {}
    if not args.skip_nvml:
        import pynvml

        summary["pynvml_version"] = getattr(pynvml, "__version__", None)
        with open(args.out / "nvml_truth.jsonl", "w") as out:
            phases = (
                ("time_sliced", lambda: _phase("time_sliced", args.gpu_load, TIME_SLICED_LOADS, args.seconds,
                                               dict(os.environ), out)),
                ("mps", lambda: _mps_phase(args.gpu_load, args.seconds, out)),
                ("sampling_probe", lambda: sampling_probe(args.gpu_load, args.seconds, out)),
            )
            for name, run in phases[2:] if args.only_probe else phases:
                try:
                    summary[name] = run()
                except Exception as exc:  # keep the other phase's findings
                    summary[name] = {"error": f"{type(exc).__name__}: {exc}"}
                print(json.dumps({name: summary[name]}, default=str)[:3000], flush=True)
        summary["duration_s"] = round(time.time() - started, 1)
        (args.out / "nvml_truth_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if not args.skip_scaleout:
        result = scaleout(args.scaleout_nodes, args.scaleout_ticks, (1, 2, 4, 8, 16))
        (args.out / "scaleout.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result), flush=True)
    if not args.skip_nvml:
        from bench.common import machine_info

        (args.out / "machine.json").write_text(json.dumps(machine_info()))
        write_device_result(args.out, args.out, machine_info(), started_unix_s=started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
