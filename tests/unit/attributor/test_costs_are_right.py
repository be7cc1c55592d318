"""Who pays, through the whole real path: scenario → NVML simulator → collector's backend, cgroups and assembly →
NodeSample → attributor → billing (``gpumeter replay``). Each test is a defect that once priced pods wrongly while
every share still added up to 1 (issue 13): MIG by memory, owners paying for time they were not alive, a retried
Job taken for sharing, one GPU's failed read losing the node's tick, the MPS server taking a client's compute, a
leak paid by its victim, a lost GPU billed to its owner.
"""

from __future__ import annotations

import math
from collections import defaultdict
from fractions import Fraction
from pathlib import Path

import pytest

from services.attributor.attribution import AttributionPolicy
from pipeline.replay import read_jsonl, replay
from services.billing.catalog import PriceCatalog, parse_override_csv
from services.billing.costing import gpu_fraction_exact

TOL = 1e-9
HEAD = """
cluster: sim-right
seed: 7
start: "2026-07-01T00:00:00Z"
interval_seconds: 10
duration_seconds: {duration}
nodes:
  - name: node-a
    cloud_provider: aws
    region: us-east-1
    instance_type: {instance_type}
    gpus:
{gpus}
pods:
{pods}
"""
A10G = """      - model: NVIDIA A10G
        count: {count}
        memory_total_bytes: 24146608128
        driver_reserved_bytes: 293601280
        sharing: {sharing}
"""


def run(tmp_path: Path, text: str, *, policy: AttributionPolicy | None = None, catalog: PriceCatalog | None = None,
        name: str = "s"):
    scenario = tmp_path / f"{name}.yaml"
    scenario.write_text(text)
    out = tmp_path / f"{name}-out"
    summary = replay(scenario, out, policy=policy, catalog=catalog)
    return summary, out


def units(out: Path) -> dict[tuple[str, str], dict[str, dict]]:
    """(window start, unit) -> subject (pod name or bucket kind) -> share row."""
    by_unit: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for row in read_jsonl(out / "shares.jsonl"):
        subject = row["pod"] if row["subject_kind"] == "pod" else row["subject_kind"]
        by_unit[(row["window_start"], row["gpu_uuid"])][subject] = row
    return by_unit


def first_window(out: Path) -> dict[str, dict[str, dict]]:
    """unit -> subject -> row of the first window."""
    rows = units(out)
    start = min(w for w, _ in rows)
    return {u: subjects for (w, u), subjects in rows.items() if w == start}


def assert_conserved(out: Path) -> None:
    for key, subjects in units(out).items():
        for field in ("memory_share", "compute_share", "cost_share"):
            assert math.fsum(r[field] for r in subjects.values()) == pytest.approx(1.0, abs=1e-9), (key, field)
    bills = {(b["node"], b["window_start"]): b["node_cost_micro_usd"] for b in read_jsonl(out / "bills.jsonl")}
    costs: dict[tuple[str, str], int] = defaultdict(int)
    for c in read_jsonl(out / "costs.jsonl"):
        costs[(c["node"], c["window_start"])] += c["cost_micro_usd"]
    assert dict(costs) == bills


# --------------------------------------------------------------------------------------------------------------
# 1. MIG instances are priced by slices


def test_mig_instances_are_priced_by_their_slices_and_a_full_gpu_leaves_no_idle_remainder(tmp_path):
    summary, out = run(tmp_path, Path("scenarios/mig_mixed.yaml").read_text())
    assert summary.dead_letter_count == 0
    window = first_window(out)
    fractions = {}
    for unit, subjects in window.items():
        row = next(iter(subjects.values()))
        fractions[unit] = (row["parent_gpu_uuid"], gpu_fraction_exact(row["gpu_fraction"]))
    mig = sorted(f for parent, f in fractions.values() if parent is not None)
    assert mig == [Fraction(1, 7), Fraction(1, 7), Fraction(2, 7), Fraction(3, 7)]
    # 3 + 2 + 1 + 1 = 7 slices: no unit for the GPU's own remainder, nothing of it billed to IDLE.
    assert all(parent is not None for parent, _ in fractions.values())
    assert_conserved(out)


def test_a_partly_partitioned_mig_gpu_bills_its_free_slices_as_idle(tmp_path):
    gpus = """      - model: NVIDIA A100-SXM4-80GB
        memory_total_bytes: 85899345920
        driver_reserved_bytes: 638582784
        sharing: {mode: mig, instances: [3g.40gb, 2g.20gb]}
"""
    pods = """  - name: trainer
    node: node-a
    containers:
      - name: c
        devices: [{resource: nvidia.com/mig-3g.40gb, gpu: 0, instance: 0}]
        processes: [{name: python, memory: {bytes: 8GiB}, compute: 0.5}]
"""
    prices = parse_override_csv("AssetClass,InstanceType,MarketPriceHourly,GpuCount,Source,SourceDate\n"
                                "node,mig-test,4.0,1,test,2026-07\n", "p.csv")
    text = HEAD.format(duration=60, instance_type="mig-test", gpus=gpus, pods=pods)
    _summary, out = run(tmp_path, text, catalog=PriceCatalog.load().with_overrides(prices))
    window = first_window(out)
    by_fraction = {}
    for unit, subjects in window.items():
        row = next(iter(subjects.values()))
        by_fraction[unit] = gpu_fraction_exact(row["gpu_fraction"])
    assert sorted(by_fraction.values()) == [Fraction(2, 7), Fraction(2, 7), Fraction(3, 7)]
    remainder = next(u for u, subjects in window.items() if next(iter(subjects.values()))["parent_gpu_uuid"] is None)
    assert by_fraction[remainder] == Fraction(2, 7)
    assert window[remainder]["idle"]["cost_share"] == 1.0
    assert_conserved(out)


# --------------------------------------------------------------------------------------------------------------
# 2, 3. Exclusive owners pay only while alive; holders in turn are not sharers


def test_an_exclusive_owner_starting_inside_the_window_pays_only_its_ticks(tmp_path):
    pods = """  - name: late-owner
    node: node-a
    start_seconds: 25
    containers:
      - name: c
        devices: [{resource: nvidia.com/gpu, gpu: 0}]
        processes: [{name: python, memory: {preallocate_fraction: 0.9}, compute: 0.4}]
"""
    text = HEAD.format(duration=60, instance_type="g5.xlarge", gpus=A10G.format(count=1, sharing="{mode: exclusive}"),
                       pods=pods)
    _summary, out = run(tmp_path, text)
    (subjects,) = first_window(out).values()
    owner = subjects["late-owner"]
    # Ticks at 10..50 s: alive at 30, 40 and 50 (3 of 5); the two before it started were an empty GPU.
    assert owner["cost_share"] == pytest.approx(0.6, abs=TOL)
    assert owner["method"] == "exclusive" and owner["sharing_mode"] == "exclusive"
    empty = subjects["idle"]["cost_share"] + subjects["driver_reserved"]["cost_share"]
    assert empty == pytest.approx(0.4, abs=TOL)
    assert subjects["idle"]["cost_share"] > 0.39
    assert_conserved(out)


def test_a_job_retried_onto_the_same_gpu_pays_each_attempt_its_own_ticks(tmp_path):
    pods = """  - name: job-attempt-1
    node: node-a
    end_seconds: 48
    containers:
      - name: c
        devices: [{resource: nvidia.com/gpu, gpu: 0}]
        processes: [{name: python, memory: {bytes: 6GiB}, compute: 0.7}]
  - name: job-attempt-2
    node: node-a
    start_seconds: 50
    containers:
      - name: c
        devices: [{resource: nvidia.com/gpu, gpu: 0}]
        processes: [{name: python, memory: {bytes: 6GiB}, compute: 0.7}]
"""
    text = HEAD.format(duration=60, instance_type="g5.xlarge", gpus=A10G.format(count=1, sharing="{mode: exclusive}"),
                       pods=pods)
    _summary, out = run(tmp_path, text)
    (subjects,) = first_window(out).values()
    assert subjects["job-attempt-1"]["cost_share"] == pytest.approx(0.8, abs=TOL)
    assert subjects["job-attempt-2"]["cost_share"] == pytest.approx(0.2, abs=TOL)
    assert subjects["idle"]["cost_share"] == 0.0
    assert {r["sharing_mode"] for r in subjects.values()} == {"exclusive"}
    assert {r["method"] for r in subjects.values()} == {"exclusive"}
    assert_conserved(out)


# --------------------------------------------------------------------------------------------------------------
# 5. The MPS server holds no compute of its own


def test_mps_threads_split_busy_time_by_each_clients_cap_and_nothing_to_the_server(tmp_path):
    # mps.yaml: four replicas (25 % of the threads each by the device plugin), ocr-0's client capped at 20 % by
    # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in its spec; the MPS server is a host process on the GPU.
    _summary, out = run(tmp_path, Path("scenarios/mps.yaml").read_text(),
                        policy=AttributionPolicy.parse("memory", "threads"))
    for (_window, _unit), subjects in units(out).items():
        assert subjects["unattributed"]["compute_share"] == pytest.approx(0.0, abs=TOL)
        pods = {name: r for name, r in subjects.items() if r["subject_kind"] == "pod"}
        busy = 1.0 - subjects["idle"]["compute_share"]
        assert math.fsum(r["compute_share"] for r in pods.values()) == pytest.approx(busy, abs=1e-9)
        shares = {name: pods[name]["compute_share"] for name in ("asr-0", "tts-0", "ocr-0")}
        assert shares["asr-0"] == pytest.approx(busy * 25 / 70, abs=1e-9)
        assert shares["tts-0"] == pytest.approx(busy * 25 / 70, abs=1e-9)
        assert shares["ocr-0"] == pytest.approx(busy * 20 / 70, abs=1e-9)
    assert_conserved(out)


# --------------------------------------------------------------------------------------------------------------
# 6. A leaking pod pays for its use; the owner the rest


def test_a_pod_leaking_onto_an_owned_gpu_pays_its_use_and_the_owner_the_rest(tmp_path):
    _summary, out = run(tmp_path, Path("scenarios/visibility_leak.yaml").read_text())
    owned = [s for s in units(out).values() if "ranker-0" in s and "cuda-debug" in s]
    assert owned
    for subjects in owned:
        leak = subjects["cuda-debug"]
        use = max(leak["memory_share"], leak["compute_share"])
        assert use > 0.0 and leak["cost_share"] == pytest.approx(use, abs=TOL)
        assert subjects["ranker-0"]["cost_share"] == pytest.approx(1.0 - use, abs=TOL)
        assert subjects["idle"]["cost_share"] == 0.0
    assert_conserved(out)


def test_a_pod_leaking_onto_a_dedicated_mig_instance_pays_its_use(tmp_path):
    gpus = """      - model: NVIDIA A100-SXM4-80GB
        memory_total_bytes: 85899345920
        driver_reserved_bytes: 638582784
        sharing: {mode: mig, instances: [3g.40gb, 3g.40gb]}
"""
    pods = """  - name: owner
    node: node-a
    containers:
      - name: c
        devices: [{resource: nvidia.com/mig-3g.40gb, gpu: 0, instance: 0}]
        processes: [{name: python, memory: {bytes: 4GiB}, compute: 0.3}]
  - name: leaker
    node: node-a
    containers:
      - name: shell
        env: {NVIDIA_VISIBLE_DEVICES: all}
        processes: [{name: python, devices: [{gpu: 0, instance: 0}], memory: {bytes: 12GiB}, compute: 0.5}]
"""
    prices = parse_override_csv("AssetClass,InstanceType,MarketPriceHourly,GpuCount,Source,SourceDate\n"
                                "node,mig-test,4.0,1,test,2026-07\n", "p.csv")
    text = HEAD.format(duration=60, instance_type="mig-test", gpus=gpus, pods=pods)
    _summary, out = run(tmp_path, text, catalog=PriceCatalog.load().with_overrides(prices))
    (subjects,) = [s for s in first_window(out).values() if "owner" in s]
    leak = subjects["leaker"]
    assert leak["memory_share"] > 0.2
    assert leak["cost_share"] == pytest.approx(max(leak["memory_share"], leak["compute_share"]), abs=TOL)
    assert subjects["owner"]["cost_share"] == pytest.approx(1.0 - leak["cost_share"], abs=TOL)
    assert_conserved(out)


# --------------------------------------------------------------------------------------------------------------
# 7. A lost GPU is UNAVAILABLE, not its owner's


def test_a_lost_gpus_time_is_unavailable_and_its_owner_stops_paying(tmp_path):
    prices = parse_override_csv("AssetClass,InstanceID,InstanceIDField,MarketPriceHourly,GpuCount,Source,SourceDate\n"
                                "node,gpu-faulty,metadata.name,8.0,2,test,2026-07\n", "p.csv")
    _summary, out = run(tmp_path, Path("scenarios/faults.yaml").read_text(),
                        catalog=PriceCatalog.load().with_overrides(prices))
    lost = None
    for (window, unit), subjects in sorted(units(out).items()):
        if subjects["unavailable"]["cost_share"] > 0:
            lost = unit
    assert lost is not None
    windows = sorted((w, s) for (w, u), s in units(out).items() if u == lost)
    # The GPU is lost at 60 s: the first window is all its owner's, every later one all unavailable.
    first, *after = windows
    assert first[1]["unavailable"]["cost_share"] == 0.0
    assert after and all(s["unavailable"]["cost_share"] == 1.0 for _, s in after)
    assert all(r["cost_share"] == 0.0 for _, s in after for r in s.values() if r["subject_kind"] == "pod")
    costs = [c for c in read_jsonl(out / "costs.jsonl") if c["gpu_uuid"] == lost and c["subject_kind"] == "unavailable"]
    assert sum(c["cost_micro_usd"] for c in costs) > 0
    assert_conserved(out)
