"""Per-mode and per-policy attribution with numbers derived in each test from its inputs."""

from __future__ import annotations

import dataclasses
import math

import pytest

from gpumeter.errors import ConfigError
from schemas.records import GpuShare, NvmlError, PodEventType, SharingMode, ShareSubjectKind
from schemas.typed import codec_for
from services.attributor.attribution import (
    METHOD_EXCLUSIVE,
    METHOD_MEMORY_PROXY,
    METHOD_MIG_INSTANCE,
    METHOD_MPS_MEMORY,
    METHOD_MPS_THREADS,
    METHOD_PER_PROCESS_SM,
    METHOD_REQUEST,
    AttributionPolicy,
    CostBasis,
    MpsCompute,
    attribute_node_window,
    attribute_node_window_detailed,
    attribute_unit,
    attribute_unit_detailed,
    split_units,
)
from services.attributor.modes import UnitKind
from services.attributor.pod_index import PodIndex, apply_pod_events
from services.attributor.windows import NodeWindow
from tests.unit.attributor import GIB, device, node_sample, pod_event

W0 = 1_700_000_040_000 - (1_700_000_040_000 % 60_000)  # a window start aligned to 60 s
TOL = 1e-12


def window(samples, start=W0, seconds=60):
    return NodeWindow("c1", "node-a", start, seconds, tuple(samples))


def by_subject(shares, unit=None):
    out = {}
    for s in shares:
        if unit is not None and s.gpu_uuid != unit:
            continue
        key = s.pod_uid if s.subject_kind is ShareSubjectKind.POD else s.subject_kind
        out[key] = s
    return out


def index_of(*events, linger_ms=600_000):
    return apply_pod_events(PodIndex.empty(linger_ms), events)


def assert_conserves(shares):
    units = {}
    for s in shares:
        units.setdefault(s.gpu_uuid, []).append(s)
    for rows in units.values():
        for field in ("memory_share", "compute_share", "cost_share"):
            assert math.fsum(getattr(r, field) for r in rows) == pytest.approx(1.0, abs=1e-9), field


# ---------------------------------------------------------------------------------------------------------------
# Time-slicing


def test_time_slicing_per_process_sm_is_normalised_to_device_busy_time():
    total, reserved, used = 80 * GIB, 1 * GIB, 31 * GIB
    mem_a, mem_b = 20 * GIB, 10 * GIB
    util, sm_a, sm_b = 60, 30, 10
    dev = device(
        total=total, reserved=reserved, used=used, util=util, replicas=4, procs=[(0, mem_a, sm_a), (1, mem_b, sm_b)]
    )
    pods = index_of(
        pod_event("a", devices=[("nvidia.com/gpu.shared", ["GPU-0::0"])]),
        pod_event("b", devices=[("nvidia.com/gpu.shared", ["GPU-0::1"])]),
    )
    samples = [node_sample(W0 + k * 1000, [dev], pod_uids=["a", "b"]) for k in range(60)]
    shares = attribute_node_window(window(samples), pods, AttributionPolicy())
    rows = by_subject(shares)

    busy = util / 100
    assert rows["a"].compute_share == pytest.approx(busy * sm_a / (sm_a + sm_b), abs=TOL)
    assert rows["b"].compute_share == pytest.approx(busy * sm_b / (sm_a + sm_b), abs=TOL)
    assert rows[ShareSubjectKind.IDLE].compute_share == pytest.approx(1 - busy, abs=TOL)
    assert rows["a"].memory_share == pytest.approx(mem_a / total, abs=TOL)
    assert rows["b"].memory_share == pytest.approx(mem_b / total, abs=TOL)
    assert rows[ShareSubjectKind.DRIVER_RESERVED].memory_share == pytest.approx(reserved / total, abs=TOL)
    # Used memory no process explains (31 - 30 GiB) is unattributed; free memory is idle.
    assert rows[ShareSubjectKind.UNATTRIBUTED].memory_share == pytest.approx((used - mem_a - mem_b) / total, abs=TOL)
    assert rows[ShareSubjectKind.IDLE].memory_share == pytest.approx((total - reserved - used) / total, abs=TOL)
    assert rows["a"].memory_used_bytes_avg == pytest.approx(mem_a)
    # Default policy: cost follows memory.
    assert rows["a"].cost_share == pytest.approx(rows["a"].memory_share, abs=TOL)
    assert {s.method for s in shares} == {METHOD_PER_PROCESS_SM}
    assert {s.sharing_mode for s in shares} == {SharingMode.TIME_SLICING}
    assert rows["a"].namespace == "ml" and rows["a"].pod_name == "pod-a" and rows["a"].labels["team"] == "team-a"
    assert rows["a"].workload_kind == "Deployment" and rows["a"].workload_name == "wl-a"
    assert_conserves(shares)


def test_memory_proxy_splits_busy_time_by_memory_when_per_process_utilization_is_missing():
    mem_a, mem_b, util = 6 * GIB, 2 * GIB, 80
    dev = device(used=mem_a + mem_b, util=util, replicas=2, per_process_supported=False,
                 procs=[(0, mem_a, -1), (1, mem_b, -1)])
    samples = [node_sample(W0 + k * 1000, [dev], pod_uids=["a", "b"]) for k in range(10)]
    shares = attribute_node_window(window(samples), PodIndex.empty(), AttributionPolicy())
    rows = by_subject(shares)
    busy = util / 100
    assert rows["a"].compute_share == pytest.approx(busy * mem_a / (mem_a + mem_b), abs=TOL)
    assert rows["b"].compute_share == pytest.approx(busy * mem_b / (mem_a + mem_b), abs=TOL)
    assert {s.method for s in shares} == {METHOD_MEMORY_PROXY}
    assert_conserves(shares)


def test_shares_are_time_weighted_by_tick_interval():
    total = 80 * GIB
    # Tick 1 stands for 1 s with pod a at 8 GiB, tick 2 for 3 s with pod a at 16 GiB.
    ticks = [(1000, 8 * GIB, 20), (3000, 16 * GIB, 60)]
    samples = [
        node_sample(W0 + 1000 * (i + 1), [device(used=m, util=u, procs=[(0, m, u)])], pod_uids=["a"], interval_ms=iv)
        for i, (iv, m, u) in enumerate(ticks)
    ]
    shares = attribute_node_window(window(samples), PodIndex.empty(), AttributionPolicy())
    rows = by_subject(shares)
    weight = sum(iv for iv, _, _ in ticks)
    assert rows["a"].memory_share == pytest.approx(sum(iv * m / total for iv, m, _ in ticks) / weight, abs=TOL)
    assert rows["a"].memory_used_bytes_avg == pytest.approx(sum(iv * m for iv, m, _ in ticks) / weight)
    assert rows["a"].compute_share == pytest.approx(sum(iv * u / 100 for iv, _, u in ticks) / weight, abs=TOL)
    assert rows["a"].sample_count == len(ticks)
    assert rows["a"].covered_seconds == pytest.approx(weight / 1000)
    assert_conserves(shares)


def test_processes_of_no_known_pod_and_pods_without_metadata():
    total = 80 * GIB
    mem_known, mem_unknown, mem_meta_missing = 10 * GIB, 5 * GIB, 3 * GIB
    util = 90
    dev = device(
        used=mem_known + mem_unknown + mem_meta_missing,
        util=util,
        procs=[(0, mem_known, 40), (-1, mem_unknown, 40), (1, mem_meta_missing, 10)],
    )
    pods = index_of(pod_event("a", devices=[("nvidia.com/gpu.shared", ["GPU-0::0"])]))
    samples = [node_sample(W0 + 1000, [dev], pod_uids=["a", "zz-no-event"])]
    rows = by_subject(attribute_node_window(window(samples), pods, AttributionPolicy()))
    assert rows[ShareSubjectKind.UNATTRIBUTED].memory_share == pytest.approx(mem_unknown / total, abs=TOL)
    assert rows[ShareSubjectKind.UNATTRIBUTED].compute_share == pytest.approx(util / 100 * 40 / 90, abs=TOL)
    # The collector's cgroup names the pod: it keeps its usage, without namespace or name until its event comes.
    orphan = rows["zz-no-event"]
    assert orphan.memory_share == pytest.approx(mem_meta_missing / total, abs=TOL)
    assert orphan.namespace is None and orphan.pod_name is None and dict(orphan.labels) == {}


def test_process_memory_above_device_used_is_scaled_into_used():
    total, used = 80 * GIB, 12 * GIB
    mem_a, mem_b = 10 * GIB, 6 * GIB  # 16 GiB reported by processes, 12 GiB used on the device
    dev = device(used=used, util=50, procs=[(0, mem_a, 10), (1, mem_b, 10)])
    win = window([node_sample(W0 + 1000, [dev], pod_uids=["a", "b"])])
    rows = by_subject(attribute_node_window(win, PodIndex.empty(), AttributionPolicy()))
    scale = used / (mem_a + mem_b)
    assert rows["a"].memory_share == pytest.approx(mem_a * scale / total, abs=TOL)
    assert rows["b"].memory_share == pytest.approx(mem_b * scale / total, abs=TOL)
    assert rows[ShareSubjectKind.UNATTRIBUTED].memory_share == pytest.approx(0.0, abs=TOL)
    detail = attribute_unit_detailed(split_units(win)[0], PodIndex.empty(), AttributionPolicy())
    assert detail.quality.ticks_process_memory_scaled == 1


def test_used_memory_that_includes_reserved_is_detected():
    # Older drivers: used includes reserved, used + free = total.
    total, reserved, used_with_reserved = 80 * GIB, 2 * GIB, 12 * GIB
    free = total - used_with_reserved
    dev = device(total=total, reserved=reserved, used=used_with_reserved, free=free, util=0,
                 procs=[(0, used_with_reserved - reserved, 0)])
    rows = by_subject(
        attribute_node_window(window([node_sample(W0, [dev], pod_uids=["a"])]), PodIndex.empty(), AttributionPolicy())
    )
    assert rows[ShareSubjectKind.DRIVER_RESERVED].memory_share == pytest.approx(reserved / total, abs=TOL)
    assert rows["a"].memory_share == pytest.approx((used_with_reserved - reserved) / total, abs=TOL)
    assert rows[ShareSubjectKind.UNATTRIBUTED].memory_share == pytest.approx(0.0, abs=TOL)
    assert rows[ShareSubjectKind.IDLE].memory_share == pytest.approx(free / total, abs=TOL)


def test_assigned_pod_without_processes_gets_a_row():
    pods = index_of(
        pod_event("a", devices=[("nvidia.com/gpu.shared", ["GPU-0::0"])]),
        pod_event("b", devices=[("nvidia.com/gpu.shared", ["GPU-0::1"])]),
    )
    dev = device(used=4 * GIB, util=30, replicas=2, procs=[(0, 4 * GIB, 30)])
    shares = attribute_node_window(window([node_sample(W0, [dev], pod_uids=["a"])]), pods, AttributionPolicy())
    rows = by_subject(shares)
    assert rows["b"].memory_share == 0.0 and rows["b"].compute_share == 0.0 and rows["b"].cost_share == 0.0
    assert {s.rows_in_unit for s in shares} == {6}  # 2 pods + 4 buckets
    assert [s.subject_kind for s in shares] == [ShareSubjectKind.POD] * 2 + [
        ShareSubjectKind.IDLE, ShareSubjectKind.DRIVER_RESERVED, ShareSubjectKind.UNATTRIBUTED,
        ShareSubjectKind.UNAVAILABLE,
    ]


# ---------------------------------------------------------------------------------------------------------------
# Exclusive


def test_exclusive_owner_pays_the_whole_gpu_and_usage_is_still_reported():
    total, used, util = 80 * GIB, 8 * GIB, 25
    pods = index_of(pod_event("owner", devices=[("nvidia.com/gpu", ["GPU-0"])]))
    dev = device(total=total, used=used, util=util, mode=SharingMode.EXCLUSIVE, procs=[(0, used, util)])
    samples = [node_sample(W0 + k * 1000, [dev], pod_uids=["owner"]) for k in range(60)]
    for basis in ("memory", "compute", "blend:0.5"):
        shares = attribute_node_window(window(samples), pods, AttributionPolicy.parse(basis))
        rows = by_subject(shares)
        assert rows["owner"].cost_share == pytest.approx(1.0, abs=TOL)
        assert rows[ShareSubjectKind.IDLE].cost_share == pytest.approx(0.0, abs=TOL)
        assert rows["owner"].memory_share == pytest.approx(used / total, abs=TOL)
        assert rows[ShareSubjectKind.IDLE].memory_share == pytest.approx((total - used) / total, abs=TOL)
        assert rows["owner"].compute_share == pytest.approx(util / 100, abs=TOL)
        assert rows[ShareSubjectKind.IDLE].compute_share == pytest.approx(1 - util / 100, abs=TOL)
        assert {s.method for s in shares} == {METHOD_EXCLUSIVE}
        assert {s.sharing_mode for s in shares} == {SharingMode.EXCLUSIVE}
        assert_conserves(shares)


def test_exclusive_owner_pays_only_for_the_ticks_it_held_the_gpu():
    total, util = 80 * GIB, 0
    ended_at = W0 + 20_000
    pods = index_of(
        pod_event("owner", devices=[("nvidia.com/gpu", ["GPU-0"])], started_at_unix_ms=W0 - 3_600_000),
        pod_event(
            "owner",
            devices=[("nvidia.com/gpu", ["GPU-0"])],
            started_at_unix_ms=W0 - 3_600_000,
            event_type=PodEventType.DELETED,
            observed_at_unix_ms=ended_at,
            phase="Succeeded",
            resource_version="2",
        ),
    )
    samples = [
        node_sample(W0 + k * 1000, [device(total=total, util=util, mode=SharingMode.EXCLUSIVE)]) for k in range(60)
    ]
    owned_ticks = sum(1 for s in samples if s.sampled_at_unix_ms < ended_at)
    rows = by_subject(attribute_node_window(window(samples), pods, AttributionPolicy()))
    owned = owned_ticks / len(samples)
    assert rows["owner"].cost_share == pytest.approx(owned, abs=TOL)
    # The rest of the window is paid by the cost basis: an empty GPU is all idle memory.
    assert rows[ShareSubjectKind.IDLE].cost_share == pytest.approx(1 - owned, abs=TOL)


def test_a_pod_leaking_onto_an_exclusive_gpu_pays_for_its_use_and_the_owner_the_rest():
    # A pod that sees every GPU (NVIDIA_VISIBLE_DEVICES=all) runs on the owner's GPU: it pays what it used (the
    # larger of its memory and compute fractions), the owner the rest of the GPU it reserved.
    total, owner_mem, rogue_mem = 80 * GIB, 10 * GIB, 30 * GIB
    pods = index_of(pod_event("owner", devices=[("nvidia.com/gpu", ["GPU-0"])]), pod_event("rogue"))
    dev = device(total=total, used=owner_mem + rogue_mem, util=100, mode=SharingMode.EXCLUSIVE,
                 procs=[(0, owner_mem, 20), (1, rogue_mem, 80)])
    for basis in ("memory", "compute", "blend:0.3"):
        rows = by_subject(attribute_node_window(window([node_sample(W0, [dev], pod_uids=["owner", "rogue"])]),
                                                pods, AttributionPolicy.parse(basis)))
        assert rows["rogue"].memory_share == pytest.approx(rogue_mem / total, abs=TOL)
        assert rows["rogue"].compute_share == pytest.approx(80 / 100, abs=TOL)
        assert rows["rogue"].cost_share == pytest.approx(max(rogue_mem / total, 0.8), abs=TOL), basis
        assert rows["owner"].cost_share == pytest.approx(1 - 0.8, abs=TOL), basis
        assert rows[ShareSubjectKind.IDLE].cost_share == 0.0


def test_mode_conflict_is_reported_with_its_evidence():
    # The sample says exclusive, but the kubelet handed out replica ids: time-slicing, and the decision says why.
    pods = index_of(
        pod_event("a", devices=[("nvidia.com/gpu", ["GPU-0::0"])]),
        pod_event("b", devices=[("nvidia.com/gpu", ["GPU-0::1"])]),
    )
    dev = device(used=2 * GIB, util=10, mode=SharingMode.EXCLUSIVE, procs=[(0, GIB, 5), (1, GIB, 5)])
    detail = attribute_node_window_detailed(window([node_sample(W0, [dev], pod_uids=["a", "b"])]), pods,
                                            AttributionPolicy())
    (unit,) = detail.units
    assert unit.decision.mode is SharingMode.TIME_SLICING and unit.decision.conflict
    assert unit.decision.sample_mode is SharingMode.EXCLUSIVE and "device ids win" in unit.decision.evidence
    assert {s.sharing_mode for s in detail.shares} == {SharingMode.TIME_SLICING}
    # No owner: nobody pays the whole GPU.
    assert by_subject(detail.shares)["a"].cost_share == pytest.approx(GIB / (80 * GIB), abs=TOL)


# ---------------------------------------------------------------------------------------------------------------
# MPS


def _mps_setup(annotations_a=None, annotations_b=None):
    pods = index_of(
        pod_event("a", devices=[("nvidia.com/gpu.shared", ["GPU-0::0"])], annotations=annotations_a),
        pod_event("b", devices=[("nvidia.com/gpu.shared", ["GPU-0::1", "GPU-0::2"])], annotations=annotations_b),
    )
    mem_a, mem_b, util = 9 * GIB, 3 * GIB, 70
    dev = device(
        used=mem_a + mem_b, util=util, mode=SharingMode.MPS, replicas=4, per_process_supported=False,
        procs=[(0, mem_a, -1), (1, mem_b, -1)],
    )
    samples = [node_sample(W0 + k * 1000, [dev], pod_uids=["a", "b"]) for k in range(5)]
    return pods, samples, mem_a, mem_b, util


def test_mps_memory_proportional_compute():
    pods, samples, mem_a, mem_b, util = _mps_setup()
    shares = attribute_node_window(window(samples), pods, AttributionPolicy())
    rows = by_subject(shares)
    assert rows["a"].compute_share == pytest.approx(util / 100 * mem_a / (mem_a + mem_b), abs=TOL)
    assert {s.method for s in shares} == {METHOD_MPS_MEMORY}
    assert {s.sharing_mode for s in shares} == {SharingMode.MPS}


def test_mps_thread_percentages_from_the_platforms_annotation_or_replicas():
    annotation = "platform.example.com/mps-active-thread-percentage"
    pct_a = 30.0
    pods, samples, _, _, util = _mps_setup(annotations_a={annotation: f"{pct_a:g}"})
    shares = attribute_node_window(window(samples), pods, AttributionPolicy.parse("memory", "threads", annotation))
    rows = by_subject(shares)
    pct_b = 100.0 * 2 / 4  # two of four replicas, no annotation
    busy = util / 100
    assert rows["a"].compute_share == pytest.approx(busy * pct_a / (pct_a + pct_b), abs=TOL)
    assert rows["b"].compute_share == pytest.approx(busy * pct_b / (pct_a + pct_b), abs=TOL)
    assert {s.method for s in shares} == {METHOD_MPS_THREADS}
    assert_conserves(shares)


def test_a_tenants_mps_annotation_moves_no_compute_unless_the_platform_names_it():
    # A pod's owner writes its annotations: with no annotation configured, a pod annotating a small percentage
    # for itself pays what its replicas' cap (the one MPS enforces) gives it, exactly as without the annotation.
    pods_annotated, samples, _, _, util = _mps_setup(
        annotations_a={"gpumeter.io/mps-active-thread-percentage": "1"})
    pods_plain, _, _, _, _ = _mps_setup()
    policy = AttributionPolicy.parse("memory", "threads")
    annotated = by_subject(attribute_node_window(window(samples), pods_annotated, policy))
    plain = by_subject(attribute_node_window(window(samples), pods_plain, policy))
    busy = util / 100
    # a holds one of four replicas (25 %), b two (50 %)
    assert annotated["a"].compute_share == pytest.approx(busy * 25 / 75, abs=TOL)
    assert annotated["a"].compute_share == plain["a"].compute_share
    assert annotated["b"].compute_share == plain["b"].compute_share
    # Named by the platform, the same annotation is read.
    named = by_subject(attribute_node_window(window(samples), pods_annotated, AttributionPolicy.parse(
        "memory", "threads", "gpumeter.io/mps-active-thread-percentage")))
    assert named["a"].compute_share == pytest.approx(busy * 1 / (1 + 50), abs=TOL)


# ---------------------------------------------------------------------------------------------------------------
# MIG


def _mig_sample(t, with_processes=True):
    parent = device("GPU-P", total=80 * GIB, used=12 * GIB, util=None, mode=SharingMode.MIG,
                    per_process_supported=False, total_slices=7)
    small = device("MIG-small", parent_uuid="GPU-P", gi=7, ci=0, profile="1g.10gb", slices=1, total_slices=7,
                   total=10 * GIB, used=4 * GIB if with_processes else 0, util=None, mode=SharingMode.MIG,
                   per_process_supported=False, procs=[(0, 4 * GIB, -1)] if with_processes else [])
    big = device("MIG-big", parent_uuid="GPU-P", gi=1, ci=0, profile="3g.40gb", slices=3, total_slices=7,
                 total=40 * GIB, used=0, util=None, mode=SharingMode.MIG, per_process_supported=False)
    return node_sample(t, [parent, small, big], pod_uids=["a"] if with_processes else [])


def test_mig_instances_and_the_unassigned_remainder_are_units():
    pods = index_of(pod_event("a", devices=[("nvidia.com/mig-1g.10gb", ["MIG-GPU-P/7/0"])]))
    samples = [_mig_sample(W0 + k * 1000, with_processes=k % 2 == 0) for k in range(10)]
    shares = attribute_node_window(window(samples), pods, AttributionPolicy())
    assert_conserves(shares)
    units = {s.gpu_uuid: s for s in shares}
    assert set(units) == {"GPU-P", "MIG-small", "MIG-big"}
    assert {s.units_in_node for s in shares} == {3}
    assert units["MIG-small"].gpu_fraction == pytest.approx(1 / 7)
    assert units["MIG-big"].gpu_fraction == pytest.approx(3 / 7)
    assert units["GPU-P"].gpu_fraction == pytest.approx(1 - 4 / 7)
    assert math.fsum(units[u].gpu_fraction for u in units) == pytest.approx(1.0)
    assert {s.parent_gpu_uuid for s in shares if s.gpu_uuid.startswith("MIG-")} == {"GPU-P"}
    assert {s.sharing_mode for s in shares} == {SharingMode.MIG}
    assert {s.method for s in shares} == {METHOD_MIG_INSTANCE}
    assert {s.gpu_model for s in shares} == {"NVIDIA H100 80GB HBM3"}

    small = by_subject(shares, "MIG-small")
    # Pod a holds the instance (through its MIG-GPU-<uuid>/<gi>/<ci> id): it pays all of it.
    assert small["a"].cost_share == pytest.approx(1.0, abs=TOL)
    busy_ticks = sum(1 for k in range(10) if k % 2 == 0)
    # NVML gives no utilization on MIG: compute is the time a process held the instance.
    assert small["a"].compute_share == pytest.approx(busy_ticks / 10, abs=TOL)
    assert small["a"].memory_share == pytest.approx(busy_ticks / 10 * 4 / 10, abs=TOL)

    remainder = by_subject(shares, "GPU-P")
    assert remainder[ShareSubjectKind.IDLE].memory_share == 1.0
    assert remainder[ShareSubjectKind.IDLE].compute_share == 1.0
    assert remainder[ShareSubjectKind.IDLE].cost_share == 1.0
    # 80 GiB minus the 50 GiB in instances.
    assert remainder[ShareSubjectKind.IDLE].memory_used_bytes_avg == pytest.approx(30 * GIB)

    nobody = by_subject(shares, "MIG-big")
    assert nobody[ShareSubjectKind.IDLE].cost_share == pytest.approx(1.0, abs=TOL)


def test_fully_partitioned_mig_gpu_has_no_remainder_unit():
    parent = device("GPU-P", mode=SharingMode.MIG, util=None, total_slices=7)
    instances = [
        device(f"MIG-{i}", parent_uuid="GPU-P", gi=i, ci=0, slices=1, total_slices=7, total=10 * GIB,
               util=None, mode=SharingMode.MIG)
        for i in range(7)
    ]
    shares = attribute_node_window(window([node_sample(W0, [parent, *instances])]), PodIndex.empty(),
                                   AttributionPolicy())
    assert "GPU-P" not in {s.gpu_uuid for s in shares}
    assert {s.units_in_node for s in shares} == {7}


# ---------------------------------------------------------------------------------------------------------------
# Policies


def _two_pod_window():
    total, mem_a, mem_b, util, sm_a, sm_b = 80 * GIB, 30 * GIB, 10 * GIB, 50, 10, 40
    pods = index_of(
        pod_event("a", devices=[("nvidia.com/gpu.shared", ["GPU-0::0"])]),
        pod_event("b", devices=[("nvidia.com/gpu.shared", ["GPU-0::1"])]),
        pod_event("c", devices=[("nvidia.com/gpu.shared", ["GPU-0::2"])]),
    )
    dev = device(total=total, used=mem_a + mem_b, util=util, replicas=4, procs=[(0, mem_a, sm_a), (1, mem_b, sm_b)])
    samples = [node_sample(W0 + k * 1000, [dev], pod_uids=["a", "b"]) for k in range(4)]
    return pods, window(samples)


def test_compute_and_blend_cost_bases():
    pods, win = _two_pod_window()
    base = by_subject(attribute_node_window(win, pods, AttributionPolicy()))
    compute = by_subject(attribute_node_window(win, pods, AttributionPolicy.parse("compute")))
    alpha = 0.25
    blend = by_subject(attribute_node_window(win, pods, AttributionPolicy.parse(f"blend:{alpha}")))
    for key, row in base.items():
        assert compute[key].cost_share == pytest.approx(row.compute_share, abs=TOL)
        assert blend[key].cost_share == pytest.approx(alpha * row.compute_share + (1 - alpha) * row.memory_share,
                                                      abs=TOL)


def test_request_cost_basis_charges_assigned_replicas():
    pods, win = _two_pod_window()
    shares = attribute_node_window(win, pods, AttributionPolicy.parse("request"))
    rows = by_subject(shares)
    replicas, holders = 4, 3
    for uid in ("a", "b", "c"):
        assert rows[uid].cost_share == pytest.approx(1 / replicas, abs=TOL)
    assert rows[ShareSubjectKind.IDLE].cost_share == pytest.approx((replicas - holders) / replicas, abs=TOL)
    assert {s.method for s in shares} == {METHOD_REQUEST}
    assert_conserves(shares)


def test_idle_is_always_a_row_of_its_own_and_rows_carry_the_cost_basis_and_the_pods_requests():
    """Sharing idle cost to pods is billing's (services.billing.sharing), once, on money; the attributor's rows only
    say what the cost share followed and what each pod requests, for billing's requests policy."""
    pods, win = _two_pod_window()
    policy = AttributionPolicy(cost_basis=CostBasis.BLEND, blend_alpha=0.25)
    shares = attribute_node_window(win, pods, policy)
    rows = by_subject(shares)
    assert rows[ShareSubjectKind.IDLE].cost_share > 0.0
    assert {s.cost_basis for s in shares} == {"blend:0.25"}
    assert {(s.pod_uid, s.cpu_request_millicores, s.memory_request_bytes) for s in shares if s.pod_uid} == {
        (uid, 0, 0) for uid in ("a", "b", "c")}
    requested = index_of(pod_event("a", devices=[("nvidia.com/gpu.shared", ["GPU-0::0"])],
                                   cpu_request_millicores=1500, memory_request_bytes=3 * GIB))
    one = by_subject(attribute_node_window(win, requested, AttributionPolicy()))
    assert (one["a"].cpu_request_millicores, one["a"].memory_request_bytes) == (1500, 3 * GIB)
    assert (one[ShareSubjectKind.IDLE].cpu_request_millicores, one[ShareSubjectKind.IDLE].memory_request_bytes) == (
        0, 0)


def test_policy_parsing():
    p = AttributionPolicy.parse("blend:0.3", "threads")
    assert (p.cost_basis, p.blend_alpha, p.mps_compute) == (CostBasis.BLEND, 0.3, MpsCompute.THREADS)
    assert p.describe() == "cost=blend:0.3 mps=threads"
    assert p.basis_text == "blend:0.3"
    assert AttributionPolicy.parse().cost_basis is CostBasis.MEMORY
    for bad in ("blend:x", "blend:1.5", "blend:-0.1", "blend:nan", "price", ""):
        with pytest.raises(ConfigError):
            AttributionPolicy.parse(bad)
    with pytest.raises(ConfigError):
        AttributionPolicy.parse("memory", "sm")


# ---------------------------------------------------------------------------------------------------------------
# Missing and bad data


def test_unknown_utilization_everywhere_leaves_compute_unattributed():
    dev = device(used=4 * GIB, util=None, per_process_supported=False, procs=[(0, 4 * GIB, -1)])
    unit = split_units(window([node_sample(W0, [dev], pod_uids=["a"])]))[0]
    detail = attribute_unit_detailed(unit, PodIndex.empty(), AttributionPolicy())
    rows = by_subject(detail.rows)
    assert rows[ShareSubjectKind.UNATTRIBUTED].compute_share == 1.0
    assert rows["a"].compute_share == 0.0
    assert detail.quality.ticks_compute_unknown == 1
    assert detail.compute_covered_seconds == 0.0


def test_ticks_without_memory_info_do_not_count_for_memory():
    # The GPU works (utilization and processes are read) but its memory info failed: that tick's memory is
    # unknown, not empty, so it leaves the mean; compute still counts it.
    total, mem = 80 * GIB, 20 * GIB
    good = device(total=total, used=mem, util=40, procs=[(0, mem, 40)])
    no_memory = device(total=0, used=0, util=60, procs=[(0, mem, 60)],
                       errors=[NvmlError("nvmlDeviceGetMemoryInfo", "UNKNOWN", "unknown error")])
    samples = [node_sample(W0 + 1000, [good], pod_uids=["a"]), node_sample(W0 + 2000, [no_memory], pod_uids=["a"])]
    unit = split_units(window(samples))[0]
    detail = attribute_unit_detailed(unit, PodIndex.empty(), AttributionPolicy())
    rows = by_subject(detail.rows)
    assert rows["a"].memory_share == pytest.approx(mem / total, abs=TOL)
    assert rows["a"].compute_share == pytest.approx(0.5, abs=TOL)
    assert rows[ShareSubjectKind.UNAVAILABLE].memory_share == 0.0
    assert rows["a"].sample_count == 2
    assert detail.quality.ticks_memory_invalid == 1 and detail.quality.ticks_unavailable == 0


def test_ticks_of_a_lost_gpu_go_to_unavailable_and_its_owner_does_not_pay_them():
    total, mem = 80 * GIB, 20 * GIB
    pods = index_of(pod_event("a", devices=[("nvidia.com/gpu", ["GPU-0"])]))
    good = device(total=total, used=mem, util=40, mode=SharingMode.EXCLUSIVE, procs=[(0, mem, 40)])
    lost = device(total=0, used=0, util=None, per_process_supported=False, mode=SharingMode.EXCLUSIVE,
                  errors=[NvmlError("nvmlDeviceGetMemoryInfo_v2", "GPU_IS_LOST", "lost")])
    samples = [node_sample(W0 + 1000 * k, [good], pod_uids=["a"]) for k in range(1, 4)]
    samples += [node_sample(W0 + 1000 * k, [lost]) for k in range(4, 5)]
    unit = split_units(window(samples))[0]
    detail = attribute_unit_detailed(unit, pods, AttributionPolicy())
    rows = by_subject(detail.rows)
    assert rows["a"].memory_share == pytest.approx(0.75 * mem / total, abs=TOL)
    assert rows["a"].compute_share == pytest.approx(0.75 * 0.4, abs=TOL)
    assert rows["a"].cost_share == pytest.approx(0.75, abs=TOL)
    for field in ("memory_share", "compute_share", "cost_share"):
        assert getattr(rows[ShareSubjectKind.UNAVAILABLE], field) == pytest.approx(0.25, abs=TOL)
    assert detail.quality.ticks_unavailable == 1


def test_absurd_values_are_clamped_and_counted():
    total = 80 * GIB
    dev = device(total=total, used=200 * GIB, reserved=-5, util=250, procs=[(0, -7, 400), (5, 10 * GIB, -1)])
    unit = split_units(window([node_sample(W0, [dev], pod_uids=["a"], interval_ms=-3)]))[0]
    detail = attribute_unit_detailed(unit, PodIndex.empty(), AttributionPolicy())
    rows = by_subject(detail.rows)
    # used is clamped to total; the only real process memory (10 GiB, of a pod index out of range) is unattributed.
    assert rows[ShareSubjectKind.IDLE].memory_share == 0.0
    assert rows[ShareSubjectKind.UNATTRIBUTED].memory_share == pytest.approx(1.0, abs=TOL)
    assert rows["a"].memory_share == 0.0
    assert rows["a"].compute_share == pytest.approx(1.0, abs=TOL)
    assert detail.quality.ticks_memory_clamped == 1
    assert detail.quality.ticks_utilization_clamped == 1
    assert detail.quality.ticks_zero_weight == 1
    for field in ("memory_share", "compute_share", "cost_share"):
        assert math.fsum(getattr(r, field) for r in detail.rows) == pytest.approx(1.0, abs=1e-9)


def test_busy_with_no_process_is_unattributed():
    rows = by_subject(attribute_node_window(window([node_sample(W0, [device(util=35)])]), PodIndex.empty(),
                                            AttributionPolicy()))
    assert rows[ShareSubjectKind.UNATTRIBUTED].compute_share == pytest.approx(0.35, abs=TOL)
    assert rows[ShareSubjectKind.IDLE].compute_share == pytest.approx(0.65, abs=TOL)


# ---------------------------------------------------------------------------------------------------------------
# Node-level fields


def test_node_fields_and_counts():
    devs = [device(f"GPU-{i}", index=i, util=10) for i in range(3)]
    samples = [node_sample(W0 + k * 1500, devs, interval_ms=1500) for k in range(30)]
    detail = attribute_node_window_detailed(window(samples), PodIndex.empty(), AttributionPolicy())
    shares = detail.shares
    assert len(shares) == 3 * 4  # three units, four buckets each
    assert {s.units_in_node for s in shares} == {3}
    assert {s.rows_in_unit for s in shares} == {4}
    assert {s.node_covered_seconds for s in shares} == {min(30 * 1.5, 60)}
    assert {(s.cloud_provider, s.region, s.instance_type, s.price_model) for s in shares} == {
        ("aws", "us-east-1", "p5.48xlarge", "on_demand")
    }
    assert {(s.cluster, s.node_name, s.window_start_unix_ms, s.window_seconds) for s in shares} == {
        ("c1", "node-a", W0, 60)
    }
    assert [s.gpu_uuid for s in shares[::4]] == ["GPU-0", "GPU-1", "GPU-2"]
    assert [u.kind for u in detail.units] == [UnitKind.GPU] * 3
    # Partial coverage: 10 ticks of 1.5 s.
    partial = attribute_node_window(window(samples[:10]), PodIndex.empty(), AttributionPolicy())
    assert {s.covered_seconds for s in partial} == {15.0}


def test_attribute_unit_matches_node_window_rows():
    pods, win = _two_pod_window()
    unit = split_units(win)[0]
    rows = attribute_unit(unit, pods, AttributionPolicy())
    shares = attribute_node_window(win, pods, AttributionPolicy())
    assert [(r.subject_kind, r.pod_uid, r.memory_share, r.compute_share, r.cost_share) for r in rows] == [
        (s.subject_kind, s.pod_uid, s.memory_share, s.compute_share, s.cost_share) for s in shares
    ]


def test_shares_encode_with_the_gpushare_schema():
    pods, win = _two_pod_window()
    codec = codec_for(GpuShare)
    for share in attribute_node_window(win, pods, AttributionPolicy()):
        assert codec.decode(codec.encode(share)) == share


def test_empty_window_has_no_shares():
    assert attribute_node_window(window([]), PodIndex.empty(), AttributionPolicy()) == ()


# ---------------------------------------------------------------------------------------------------------------
# DRA: a claim owns its device


def claimed(event, claim):
    """``event`` with its devices allocated to the DRA claim ``claim`` alone (``DeviceAssignment.owning_claim``)."""
    containers = tuple(
        dataclasses.replace(c, assigned_devices=tuple(dataclasses.replace(a, owning_claim=claim)
                                                      for a in c.assigned_devices))
        for c in event.containers)
    return dataclasses.replace(event, containers=containers)


def _claim_window(uids, mems, sms, *, claims, mode=SharingMode.TIME_SLICING, util=40, uuid="GPU-0",
                  resource="nvidia.com/gpu.shared", extra_procs=(), extra_uids=(), ticks=6, **dev_kw):
    """``uids`` hold replica ids of ``uuid`` through ``claims`` (one per pod; None: no owning claim), each with one
    process of ``mems[i]`` bytes and ``sms[i]`` % SM."""
    pods = index_of(*(claimed(pod_event(uid, devices=[(resource, [f"{uuid}::{i}"])]), claim)
                      for i, (uid, claim) in enumerate(zip(uids, claims))), *(pod_event(u) for u in extra_uids))
    procs = [(i, m, s) for i, (m, s) in enumerate(zip(mems, sms))] + list(extra_procs)
    used = sum(m for _, m, _ in procs)
    dev = device(uuid, used=used, util=util, mode=mode, replicas=len(uids), procs=procs, **dev_kw)
    samples = [node_sample(W0 + k * 1000, [dev], pod_uids=[*uids, *extra_uids]) for k in range(ticks)]
    return pods, window(samples)


def test_one_pod_alone_in_a_claim_pays_the_whole_gpu_whatever_its_config_says():
    # A TimeSlicing GpuConfig gives the claim's one pod a replica id: before, it paid its 10 GiB of 80 and the
    # platform's IDLE the rest; the GPU is the claim's, so its pod pays it whole.
    pods, win = _claim_window(["a"], [10 * GIB], [30], claims=["ml/a-gpu"])
    detail = attribute_node_window_detailed(win, pods, AttributionPolicy())
    rows = by_subject(detail.shares)
    assert rows["a"].cost_share == 1.0 and rows[ShareSubjectKind.IDLE].cost_share == 0.0
    assert rows["a"].memory_share == pytest.approx(10 / 80, abs=TOL)  # use is still reported as it was
    (unit,) = detail.units
    assert unit.decision.claim_owners == ("a",) and unit.decision.owning_claim == "ml/a-gpu"
    assert unit.decision.mode is SharingMode.TIME_SLICING and not unit.decision.conflict
    assert_conserves(detail.shares)


@pytest.mark.parametrize("basis", ["memory", "compute", "blend:0.3"])
def test_a_claims_pods_pay_its_gpu_together_split_by_their_use(basis):
    mems, sms = [12 * GIB, 6 * GIB, 2 * GIB], [10, 20, 30]
    pods, win = _claim_window(["a", "b", "c"], mems, sms, claims=["ml/shared"] * 3)
    policy = AttributionPolicy.parse(basis)
    shares = attribute_node_window(win, pods, policy)
    rows = by_subject(shares)
    # What each pod would pay of a shared GPU (its use under the basis), scaled up to the whole GPU.
    unowned_pods, unowned_win = _claim_window(["a", "b", "c"], mems, sms, claims=[None] * 3)
    unowned = by_subject(attribute_node_window(unowned_win, unowned_pods, policy))
    use = {uid: unowned[uid].cost_share for uid in "abc"}
    assert math.fsum(use.values()) < 0.5  # by use alone, most of the GPU would be the platform's IDLE
    assert math.fsum(rows[u].cost_share for u in "abc") == pytest.approx(1.0, abs=TOL)
    for uid in "abc":
        assert rows[uid].cost_share == pytest.approx(use[uid] / math.fsum(use.values()), abs=TOL), uid
    assert all(rows[k].cost_share == 0.0 for k in (ShareSubjectKind.IDLE, ShareSubjectKind.DRIVER_RESERVED,
                                                   ShareSubjectKind.UNATTRIBUTED))
    assert_conserves(shares)


def test_an_mps_claims_pods_pay_its_gpu_together():
    pods, win = _claim_window(["a", "b"], [9 * GIB, 3 * GIB], [-1, -1], claims=["ml/mps"] * 2,
                              mode=SharingMode.MPS, per_process_supported=False)
    shares = attribute_node_window(win, pods, AttributionPolicy())
    rows = by_subject(shares)
    assert {s.sharing_mode for s in shares} == {SharingMode.MPS}
    assert rows["a"].cost_share == pytest.approx(0.75, abs=TOL) and rows["b"].cost_share == pytest.approx(0.25)
    assert rows[ShareSubjectKind.IDLE].cost_share == 0.0
    assert_conserves(shares)


def test_a_mig_device_in_one_claim_is_paid_by_its_pods_together():
    parent, uuid = "GPU-p", "MIG-1"
    instance = dict(parent_uuid=parent, gi=1, ci=0, profile="3g.40gb", slices=3, total_slices=7, util=None,
                    mode=SharingMode.MIG, total=40 * GIB)
    pods, win = _claim_window(["a", "b"], [4 * GIB, 12 * GIB], [-1, -1], claims=["ml/mig"] * 2, uuid=uuid,
                              resource="nvidia.com/mig-3g.40gb.shared", **instance)
    win = window([node_sample(s.sampled_at_unix_ms, [device(parent, mode=SharingMode.MIG), *s.devices],
                              pod_uids=s.pod_uids) for s in win.samples])
    shares = attribute_node_window(win, pods, AttributionPolicy())
    rows = by_subject(shares, uuid)
    assert rows["a"].cost_share == pytest.approx(0.25, abs=TOL) and rows["b"].cost_share == pytest.approx(0.75)
    assert rows[ShareSubjectKind.IDLE].cost_share == 0.0 and rows[ShareSubjectKind.IDLE].memory_share > 0.5
    assert_conserves(shares)


def test_a_gpu_shared_across_claims_is_billed_by_use():
    # Consumable capacity: each claim holds a share of the GPU and none owns it (no owning claim): by use, the
    # rest IDLE -- as a device-plugin time-sliced GPU.
    pods, win = _claim_window(["a", "b"], [10 * GIB, 6 * GIB], [10, 20], claims=[None, None])
    rows = by_subject(attribute_node_window(win, pods, AttributionPolicy()))
    assert rows["a"].cost_share == pytest.approx(10 / 80, abs=TOL)
    assert rows["b"].cost_share == pytest.approx(6 / 80, abs=TOL)
    assert rows[ShareSubjectKind.IDLE].cost_share == pytest.approx(64 / 80, abs=TOL)


def test_pods_of_two_claims_on_one_device_are_a_conflict_billed_by_use():
    # The platform never allocates a single-allocation device to two claims: the ids are not believed.
    pods, win = _claim_window(["a", "b"], [10 * GIB, 6 * GIB], [10, 20], claims=["ml/one", "ml/two"])
    detail = attribute_node_window_detailed(win, pods, AttributionPolicy())
    (unit,) = detail.units
    assert unit.decision.conflict and unit.decision.claim_owners == () and "several DRA claims" in \
        unit.decision.evidence
    assert by_subject(detail.shares)["a"].cost_share == pytest.approx(10 / 80, abs=TOL)


def test_a_pod_leaking_onto_a_claims_gpu_pays_its_use_and_the_claims_pods_the_rest():
    pods, win = _claim_window(["a", "b"], [8 * GIB, 8 * GIB], [10, 30], claims=["ml/shared"] * 2,
                              extra_uids=["rogue"], extra_procs=[(2, 20 * GIB, 60)], util=100)
    rows = by_subject(attribute_node_window(win, pods, AttributionPolicy()))
    leak = max(rows["rogue"].memory_share, rows["rogue"].compute_share)
    assert rows["rogue"].cost_share == pytest.approx(leak, abs=TOL) and leak == pytest.approx(0.6, abs=TOL)
    assert rows["a"].cost_share == pytest.approx((1 - leak) / 2, abs=TOL)
    assert rows["b"].cost_share == pytest.approx((1 - leak) / 2, abs=TOL)
    assert rows[ShareSubjectKind.IDLE].cost_share == 0.0


def test_a_claims_pods_that_use_nothing_pay_its_gpu_in_equal_parts():
    pods, win = _claim_window(["a", "b"], [0, 0], [0, 0], claims=["ml/shared"] * 2, util=0)
    rows = by_subject(attribute_node_window(win, pods, AttributionPolicy.parse("compute")))
    assert rows["a"].cost_share == pytest.approx(0.5, abs=TOL) and rows["b"].cost_share == pytest.approx(0.5)


def test_the_request_basis_charges_a_claims_gpu_to_its_pods_whole():
    # Replicas 3 (the samples) but two pods alive in the claim: no replica is free for anyone else.
    pods, win = _claim_window(["a", "b"], [GIB, GIB], [10, 10], claims=["ml/shared"] * 2)
    win = window([node_sample(s.sampled_at_unix_ms, [dataclasses.replace(s.devices[0], replicas=3)],
                              pod_uids=s.pod_uids) for s in win.samples])
    rows = by_subject(attribute_node_window(win, pods, AttributionPolicy.parse("request")))
    assert rows["a"].cost_share == pytest.approx(0.5, abs=TOL) and rows["b"].cost_share == pytest.approx(0.5)
    assert rows[ShareSubjectKind.IDLE].cost_share == 0.0


def test_a_claims_pods_pay_only_the_ticks_one_of_them_holds_the_gpu():
    # The claim's one pod starts mid-window: before it, the GPU is nobody's (IDLE), as for an exclusive owner.
    start = W0 + 4000
    pods = index_of(claimed(pod_event("a", devices=[("nvidia.com/gpu.shared", ["GPU-0::0"])],
                                      started_at_unix_ms=start), "ml/a-gpu"))
    busy = device(used=10 * GIB, util=40, procs=[(0, 10 * GIB, 30)])
    samples = [node_sample(W0 + k * 1000, [busy if W0 + k * 1000 >= start else device()], pod_uids=["a"])
               for k in range(10)]
    rows = by_subject(attribute_node_window(window(samples), pods, AttributionPolicy()))
    assert rows["a"].cost_share == pytest.approx(6 / 10, abs=TOL)
    assert rows[ShareSubjectKind.IDLE].cost_share == pytest.approx(4 / 10, abs=TOL)
