"""One GPU's NVML call failing loses nothing of the node's other GPUs, whatever the call (issue 13, defect 4).

Through the real path (scenario → NVML simulator with an ``nvml_error`` fault on GPU 1 → the collector's backend,
cgroups and assembly → NodeSample → range checks → attributor → billing, by ``gpumeter replay``), for every
per-device call the backend makes: no tick is dead-lettered, every window is billed for the whole window, GPU 0
is attributed exactly as in the same run without the fault, and the failing GPU carries its error to the guard.
Before the fix a failed ``nvmlDeviceGetMemoryInfo`` left zeros beside the processes' ``usedGpuMemory``, so
``check_sample`` rejected the whole NodeSample: every GPU of the node lost the tick.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from pipeline.replay import read_jsonl, replay

GPU_CALLS = (
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetMPSComputeRunningProcesses",
    "nvmlDeviceGetProcessUtilization",
)
MIG_CALLS = (
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
    "nvmlDeviceGetAttributes",
    "nvmlDeviceGetGpuInstanceProfileInfo",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetComputeRunningProcesses",
)

SCENARIO = """
cluster: sim-one-gpu-fails
seed: 21
start: "2026-07-01T00:00:00Z"
interval_seconds: 10
duration_seconds: 120
nodes:
  - name: node-a
    cloud_provider: aws
    region: us-east-1
    instance_type: {instance_type}
    gpus:
{gpus}
    faults:
{faults}
pods:
  - name: first
    node: node-a
    containers:
      - name: c
        devices: [{first_device}]
        processes: [{{name: python, memory: {{bytes: 6GiB}}, compute: 0.6}}]
  - name: second
    node: node-a
    containers:
      - name: c
        devices: [{second_device}]
        processes: [{{name: python, memory: {{bytes: 4GiB}}, compute: 0.3}}]
"""
PLAIN = dict(
    instance_type="g5.12xlarge",
    gpus="""      - model: NVIDIA A10G
        count: 2
        memory_total_bytes: 24146608128
        driver_reserved_bytes: 293601280
        sharing: {mode: exclusive}""",
    first_device="{resource: nvidia.com/gpu, gpu: 0}",
    second_device="{resource: nvidia.com/gpu, gpu: 1}",
)
MIG = dict(
    instance_type="p4de-mig-test",
    gpus="""      - model: NVIDIA A100-SXM4-80GB
        count: 2
        memory_total_bytes: 85899345920
        driver_reserved_bytes: 638582784
        sharing: {mode: mig, instances: [3g.40gb, 4g.40gb]}""",
    first_device="{resource: nvidia.com/mig-3g.40gb, gpu: 0, instance: 0}",
    second_device="{resource: nvidia.com/mig-3g.40gb, gpu: 1, instance: 0}",
)
FAULT = "      - {{kind: nvml_error, function: {function}, error: UNKNOWN, gpu: 1, from_seconds: 20, until_seconds: 50}}"


def _replay(tmp_path: Path, shape: dict, function: str | None):
    from services.billing.catalog import PriceCatalog, parse_override_csv

    faults = FAULT.format(function=function) if function else "      []"
    text = SCENARIO.format(faults=faults, **shape)
    if not function:
        text = text.replace("    faults:\n      []\n", "")
    name = function or "clean"
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    prices = parse_override_csv("AssetClass,InstanceType,MarketPriceHourly,GpuCount,Source,SourceDate\n"
                                "node,p4de-mig-test,27.44705,2,test,2026-07\n", "p.csv")
    out = tmp_path / f"{name}-out"
    summary = replay(path, out, catalog=PriceCatalog.load().with_overrides(prices))
    return summary, out


def _gpu0_rows(out: Path, gpu0: str) -> list[dict]:
    return [r for r in read_jsonl(out / "shares.jsonl") if (r["parent_gpu_uuid"] or r["gpu_uuid"]) == gpu0]


@pytest.mark.parametrize("shape,function", [(PLAIN, f) for f in GPU_CALLS] + [(MIG, f) for f in MIG_CALLS],
                         ids=[f"gpu-{f}" for f in GPU_CALLS] + [f"mig-{f}" for f in MIG_CALLS])
def test_one_gpus_failing_call_costs_the_other_gpus_nothing(tmp_path, shape, function):
    clean, clean_out = _replay(tmp_path, shape, None)
    faulty, out = _replay(tmp_path, shape, function)
    assert faulty.dead_letter_count == 0, faulty.dead_letters
    assert faulty.samples == clean.samples
    bills = read_jsonl(out / "bills.jsonl")
    assert [b["billed_seconds"] for b in bills] == [b["billed_seconds"] for b in read_jsonl(clean_out / "bills.jsonl")]
    rows = read_jsonl(out / "shares.jsonl")
    gpu0 = min((r["parent_gpu_uuid"] or r["gpu_uuid"]) for r in rows)
    gpu1 = max((r["parent_gpu_uuid"] or r["gpu_uuid"]) for r in rows)
    assert gpu0 != gpu1
    assert _gpu0_rows(out, gpu0) == _gpu0_rows(clean_out, gpu0)
    # Every window still has every unit of GPU 1, its shares adding up.
    windows: dict[tuple[str, str], float] = defaultdict(float)
    for r in rows:
        if (r["parent_gpu_uuid"] or r["gpu_uuid"]) == gpu1:
            windows[(r["window_start"], r["gpu_uuid"])] += r["cost_share"]
    assert all(abs(v - 1.0) < 1e-9 for v in windows.values())
    assert {w for w, _ in windows} == {b["window_start"] for b in bills}


def test_a_gpus_failed_memory_read_reaches_the_guard_and_leaves_its_memory_unknown_not_empty(tmp_path):
    _clean, clean_out = _replay(tmp_path, PLAIN, None)
    _summary, out = _replay(tmp_path, PLAIN, "nvmlDeviceGetMemoryInfo")
    violations = read_jsonl(out / "violations.jsonl")
    assert any(v["rule"] == "gpu_error" and v["state"] == "firing" and "nvmlDeviceGetMemoryInfo" in v["summary"]
               for v in violations), violations
    first = [r for r in read_jsonl(out / "shares.jsonl") if r["window_start"] == "2026-07-01T00:00:00Z"]
    clean_first = [r for r in read_jsonl(clean_out / "shares.jsonl") if r["window_start"] == "2026-07-01T00:00:00Z"]
    gpu1 = max(r["gpu_uuid"] for r in first)

    def pod_memory(rows):
        return next(r["memory_share"] for r in rows if r["gpu_uuid"] == gpu1 and r["pod"] == "second")

    # Steady memory: the ticks whose memory was read give the same share as the clean run (the unknown ticks left
    # the mean instead of counting as empty), and no share moved to UNAVAILABLE (the GPU worked).
    assert pod_memory(first) == pytest.approx(pod_memory(clean_first), abs=1e-9)
    assert all(r["memory_share"] == 0.0 for r in first if r["gpu_uuid"] == gpu1 and r["subject_kind"] == "unavailable")
