"""The 300 % case: three pods time-slicing one GPU, each busy.

dcgm-exporter in ``--kubernetes-virtual-gpus`` mode copies the device's value to every pod sharing the GPU, so
three sharers of a GPU that is busy all the time add up to 300 % utilization (and three times the memory in use).
Ours splits the device's busy time by per-process SM utilization, so the pods add up to 100 % of the GPU.
"""

from __future__ import annotations

import math

import pytest

from schemas.records import SharingMode, ShareSubjectKind
from services.attributor.attribution import AttributionPolicy, attribute_node_window
from services.attributor.pod_index import PodIndex, apply_pod_events
from services.attributor.windows import NodeWindow
from tests.unit.attributor import GIB, device, node_sample, pod_event

WINDOW_START = 1_700_000_040_000 - (1_700_000_040_000 % 60_000)
PODS = ("pod-a", "pod-b", "pod-c")


def _dcgm_style_per_pod(samples, pods):
    """What a per-device exporter reports per pod: the device's utilization and used memory, copied to each pod
    that holds a replica, averaged over the window."""
    util = sum(d.gpu_utilization_percent for s in samples for d in s.devices) / len(samples)
    used = sum(d.memory_used_bytes for s in samples for d in s.devices) / len(samples)
    return {uid: (util, used) for uid in pods}


def _scenario():
    # Time-slicing runs one context at a time; each pod's kernels keep the GPU busy for its slice, so the device
    # counter reads 100 % and each process's SM utilization is about a third.
    sm = (34, 33, 33)
    mem = (20 * GIB, 12 * GIB, 8 * GIB)
    dev = device(
        total=80 * GIB,
        reserved=GIB // 2,
        used=sum(mem),
        util=100,
        mode=SharingMode.TIME_SLICING,
        replicas=4,
        procs=[(i, mem[i], sm[i]) for i in range(3)],
    )
    samples = [node_sample(WINDOW_START + k * 1000, [dev], pod_uids=PODS) for k in range(60)]
    pods = apply_pod_events(
        PodIndex.empty(),
        [pod_event(uid, devices=[("nvidia.com/gpu.shared", [f"GPU-0::{i}"])]) for i, uid in enumerate(PODS)],
    )
    return samples, pods, sm, mem, dev


def test_three_busy_time_slicing_pods_sum_to_100_not_300_percent():
    samples, pods, sm, mem, dev = _scenario()
    shares = attribute_node_window(NodeWindow("c1", "node-a", WINDOW_START, 60, tuple(samples)), pods,
                                   AttributionPolicy())
    pod_rows = {s.pod_uid: s for s in shares if s.subject_kind is ShareSubjectKind.POD}
    assert set(pod_rows) == set(PODS)

    theirs = _dcgm_style_per_pod(samples, PODS)
    theirs_util_sum = sum(util for util, _ in theirs.values())
    theirs_memory_sum = sum(used for _, used in theirs.values())
    ours_util_sum = 100.0 * math.fsum(r.compute_share for r in pod_rows.values())
    ours_memory_sum = math.fsum(r.memory_used_bytes_avg for r in pod_rows.values())

    # The device is busy all the time and shared by three pods.
    assert theirs_util_sum == pytest.approx(len(PODS) * dev.gpu_utilization_percent) == 300.0
    assert ours_util_sum == pytest.approx(100.0, abs=1e-9)
    # Each pod's part follows its own SM time.
    for i, uid in enumerate(PODS):
        assert pod_rows[uid].compute_share == pytest.approx(sm[i] / sum(sm), abs=1e-12)
    # Memory: theirs counts the device's used memory once per pod; ours gives each pod its processes' memory.
    assert theirs_memory_sum == pytest.approx(len(PODS) * dev.memory_used_bytes)
    assert ours_memory_sum == pytest.approx(dev.memory_used_bytes)
    for i, uid in enumerate(PODS):
        assert pod_rows[uid].memory_share == pytest.approx(mem[i] / dev.memory_total_bytes, abs=1e-12)
    # And the whole GPU, buckets included, is 100 % for memory, compute and cost.
    for field in ("memory_share", "compute_share", "cost_share"):
        assert math.fsum(getattr(s, field) for s in shares) == pytest.approx(1.0, abs=1e-9)
    assert sum(1 for s in shares if s.subject_kind is ShareSubjectKind.IDLE and s.compute_share == 0.0) == 1
