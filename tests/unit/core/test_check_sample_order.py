"""``check_sample`` names the first impossible value in its documented order, whatever else is wrong in the tick.

The reference below is the check written as one plain walk over the documented order (the implementation's
first form); the implementation tests each group of values at once and walks them only to name a failure, so the
two must agree on every tick: the same ``OutOfRange`` message, or both accept it.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumeter.errors import OutOfRange
from gpumeter.validation import EARLIEST_UNIX_MS, check_sample
from schemas.records import GpuDeviceSample, NodeSample, SharingMode

NOW = 1_782_864_000_000
SKEW_MS = 120_000
MAX_AGE_MS = 7 * 86_400_000
GIB = 1 << 30


def _first_duplicate(values):
    seen = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None


def reference_check_sample(sample, now_unix_ms, max_clock_skew_ms, max_age_ms=None):
    where = f"node {sample.node_name} tick {sample.collector_started_at_unix_ms}/{sample.sequence}"
    value = sample.sampled_at_unix_ms
    if value < EARLIEST_UNIX_MS:
        raise OutOfRange(f"{where}: sampled_at {value} is before 2000-01-01 (ms since the Unix epoch expected)")
    if value > now_unix_ms + max_clock_skew_ms:
        raise OutOfRange(f"{where}: sampled_at {value} is {value - now_unix_ms} ms in the future (allowed clock skew "
                         f"{max_clock_skew_ms} ms)")
    if max_age_ms is not None and sample.sampled_at_unix_ms < now_unix_ms - max_age_ms:
        raise OutOfRange(f"{where}: sampled_at {sample.sampled_at_unix_ms} is {now_unix_ms - sample.sampled_at_unix_ms}"
                         f" ms old (at most {max_age_ms} ms allowed)")
    if sample.sequence < 0:
        raise OutOfRange(f"{where}: negative sequence {sample.sequence}")
    if sample.interval_ms < 0:
        raise OutOfRange(f"{where}: negative interval_ms {sample.interval_ms}")
    duplicate = _first_duplicate(sample.pod_uids)
    if duplicate is not None:
        raise OutOfRange(f"{where}: pod_uids lists {duplicate!r} twice")
    duplicate = _first_duplicate(dev.uuid for dev in sample.devices)
    if duplicate is not None:
        raise OutOfRange(f"{where}: device {duplicate} listed twice")
    gpus = {dev.uuid: dev for dev in sample.devices if dev.parent_uuid is None}
    pod_count = len(sample.pod_uids)
    for dev in sample.devices:
        unit = f"{where} device {dev.uuid}"
        if dev.parent_uuid is not None and dev.parent_uuid not in gpus:
            raise OutOfRange(f"{unit}: MIG instance of GPU {dev.parent_uuid}, which is not in the tick")
        for name in ("memory_total_bytes", "memory_used_bytes", "memory_free_bytes", "memory_reserved_bytes"):
            if getattr(dev, name) < 0:
                raise OutOfRange(f"{unit}: negative {name} {getattr(dev, name)}")
        for name in ("memory_used_bytes", "memory_free_bytes", "memory_reserved_bytes"):
            if getattr(dev, name) > dev.memory_total_bytes:
                raise OutOfRange(f"{unit}: {name} {getattr(dev, name)} > total {dev.memory_total_bytes}")
        for name in ("gpu_utilization_percent", "memory_utilization_percent"):
            value = getattr(dev, name)
            if value is not None and not 0 <= value <= 100:
                raise OutOfRange(f"{unit}: {name} {value} outside [0, 100]")
        if dev.power_milliwatts is not None and dev.power_milliwatts < 0:
            raise OutOfRange(f"{unit}: negative power_milliwatts {dev.power_milliwatts}")
        if dev.replicas < 1:
            raise OutOfRange(f"{unit}: replicas {dev.replicas} < 1")
        total_slices = dev.mig_total_compute_slices or (
            gpus[dev.parent_uuid].mig_total_compute_slices if dev.parent_uuid is not None else 0)
        if dev.mig_compute_slices < 0 or dev.mig_total_compute_slices < 0 or (
                total_slices > 0 and dev.mig_compute_slices > total_slices):
            raise OutOfRange(f"{unit}: MIG slices {dev.mig_compute_slices} of {total_slices}")
        lengths = {len(dev.process_pids), len(dev.process_pod_index),
                   len(dev.process_used_memory_bytes), len(dev.process_sm_utilization_percent)}
        if len(lengths) != 1:
            raise OutOfRange(
                f"{unit}: per-process arrays differ in length (pids {len(dev.process_pids)}, pods "
                f"{len(dev.process_pod_index)}, memory "
                f"{len(dev.process_used_memory_bytes)}, sm {len(dev.process_sm_utilization_percent)})"
            )
        duplicate = _first_duplicate(dev.process_pids)
        if duplicate is not None:
            raise OutOfRange(f"{unit}: process {duplicate} listed twice")
        for pid, pod, used, sm in zip(dev.process_pids, dev.process_pod_index, dev.process_used_memory_bytes,
                                      dev.process_sm_utilization_percent):
            if pid < 0:
                raise OutOfRange(f"{unit}: negative pid {pid}")
            if not -1 <= pod < pod_count:
                raise OutOfRange(f"{unit}: process {pid} names pod {pod} of {pod_count} (unknown pod)")
            if used < -1:
                raise OutOfRange(f"{unit}: process {pid} has negative used memory {used}")
            if used > dev.memory_total_bytes:
                raise OutOfRange(f"{unit}: process {pid} uses {used} bytes of {dev.memory_total_bytes}")
            if not -1 <= sm <= 100:
                raise OutOfRange(f"{unit}: process {pid} SM utilization {sm} outside [-1, 100]")


def _outcome(check, sample):
    try:
        check(sample, NOW, SKEW_MS, MAX_AGE_MS)
    except OutOfRange as exc:
        return ("OutOfRange", str(exc), exc.reason_code)
    return None


# Values mostly possible, one in eight impossible, so that ticks with one, several or no faults all come up.
def _mostly(good, bad):
    # (5, not 0: hypothesis draws the ends of a range more often than the middle.)
    return st.integers(min_value=0, max_value=7).flatmap(lambda k: bad if k == 5 else good)


small_ints = st.integers(min_value=-3, max_value=3)


@st.composite
def devices(draw, uuid, parent_uuid):
    total = draw(_mostly(st.just(80 * GIB), st.sampled_from([0, -1, 10 * GIB])))
    n = draw(st.integers(min_value=0, max_value=4))
    def arr(good, bad, length=n):
        length = draw(_mostly(st.just(length), st.integers(min_value=0, max_value=5)))
        return tuple(draw(_mostly(good, bad)) for _ in range(length))
    return GpuDeviceSample(
        uuid=uuid,
        parent_uuid=parent_uuid,
        index=0,
        model="m",
        sharing_mode=SharingMode.MIG if parent_uuid else SharingMode.TIME_SLICING,
        replicas=draw(_mostly(st.just(2), small_ints)),
        mig_gpu_instance_id=None,
        mig_compute_instance_id=None,
        mig_profile=None,
        mig_compute_slices=draw(_mostly(st.integers(min_value=0, max_value=7), small_ints)),
        # A total of 2 makes slices over the total come up often (on the device, or on its parent for an instance).
        mig_total_compute_slices=draw(_mostly(st.sampled_from([0, 7, 2]), small_ints)),
        memory_total_bytes=total,
        memory_used_bytes=draw(_mostly(st.just(4 * GIB), st.sampled_from([-1, 81 * GIB, 0]))),
        memory_free_bytes=draw(_mostly(st.just(70 * GIB), st.sampled_from([-1, 81 * GIB]))),
        memory_reserved_bytes=draw(_mostly(st.just(GIB), st.sampled_from([-1, 81 * GIB]))),
        gpu_utilization_percent=draw(_mostly(st.sampled_from([None, 0, 50, 100]), st.sampled_from([-1, 101]))),
        memory_utilization_percent=draw(_mostly(st.sampled_from([None, 7]), st.sampled_from([-1, 140]))),
        power_milliwatts=draw(_mostly(st.sampled_from([None, 1000]), st.just(-1))),
        process_utilization_supported=True,
        errors=(),
        process_pids=arr(st.integers(min_value=0, max_value=6), st.just(-1)),
        process_pod_index=arr(st.integers(min_value=-1, max_value=2), st.sampled_from([-2, 3, 9])),
        process_used_memory_bytes=arr(st.sampled_from([-1, 0, GIB]), st.sampled_from([-2, 81 * GIB])),
        process_sm_utilization_percent=arr(st.sampled_from([-1, 0, 40, 100]), st.sampled_from([-2, 101])),
    )


@st.composite
def samples(draw):
    uuids = draw(st.lists(st.sampled_from(["GPU-0", "GPU-1", "GPU-2"]), max_size=3))
    devs = []
    for uuid in uuids:
        # Instances of GPU-0 (in the tick when drawn) and of GPU-9 (never in it).
        parent = draw(st.sampled_from([None, None, "GPU-0", "GPU-9"]))
        devs.append(draw(devices(uuid if parent is None else f"MIG-{uuid}", parent)))
    sampled_at = draw(_mostly(st.just(NOW - 5000), st.sampled_from(
        [EARLIEST_UNIX_MS - 1, NOW + SKEW_MS + 1, NOW - MAX_AGE_MS - 1, NOW + SKEW_MS])))
    return NodeSample(
        cluster="c",
        node_name="n",
        sequence=draw(_mostly(st.just(4), st.just(-1))),
        collector_started_at_unix_ms=NOW - 3_600_000,
        sampled_at_unix_ms=sampled_at,
        interval_ms=draw(_mostly(st.just(1000), st.sampled_from([-1, 0]))),
        cloud_provider="aws",
        region="r",
        instance_type="i",
        price_model="on_demand",
        pod_uids=draw(_mostly(st.just(("a", "b", "c")), st.sampled_from([("a", "a", "b"), (), ("a", "b", "c", "b")]))),
        node_errors=(),
        devices=tuple(devs),
    )


@settings(max_examples=600, deadline=None)
@given(samples())
def test_the_same_first_impossible_value_is_named_as_by_a_plain_walk(sample):
    assert _outcome(check_sample, sample) == _outcome(reference_check_sample, sample)


def test_the_generated_ticks_cover_both_outcomes_and_every_kind_of_fault():
    # The property above is only as good as what it compares: make sure faults of every group come up.
    seen: set[str] = set()
    accepted = 0

    @settings(max_examples=1200, deadline=None, database=None, derandomize=True)
    @given(samples())
    def collect(sample):
        nonlocal accepted
        outcome = _outcome(reference_check_sample, sample)
        if outcome is None:
            accepted += 1
        else:
            detail = outcome[1].split(": ", 1)[1]
            seen.add(detail.split(" ")[0])
            if detail.startswith("MIG slices "):
                slices, total = map(int, detail[len("MIG slices "):].split(" of "))
                if slices > total > 0:
                    seen.add("MIG slices over the total")

    collect()
    assert accepted > 0
    for first_word in ("sampled_at", "negative", "pod_uids", "device", "MIG", "memory_used_bytes", "replicas",
                       "per-process", "process", "gpu_utilization_percent", "MIG slices over the total"):
        assert first_word in seen, (first_word, sorted(seen))


@pytest.mark.parametrize("values", [
    {"process_sm_utilization_percent": (float("nan"),)},
    {"process_used_memory_bytes": (float("nan"),)},
    {"gpu_utilization_percent": float("nan")},
])
def test_a_nan_is_named_like_any_other_impossible_value(values):
    dev = GpuDeviceSample(
        "GPU-0", None, 0, "m", SharingMode.EXCLUSIVE, 1, None, None, None, 0, 0, 80 * GIB, 4 * GIB, 70 * GIB, GIB,
        50, 7, 1000, True, (), (10,), (0,), (0,), (GIB,), (30,),
    )
    sample = NodeSample("c", "n", 1, NOW - 3_600_000, NOW - 5000, 1000, "aws", "r", "i", "on_demand", ("c0",),
                        ("a",), (), (dataclasses.replace(dev, **values),))
    expected = _outcome(reference_check_sample, sample)
    assert _outcome(check_sample, sample) == expected


@pytest.mark.parametrize("parent_total, instance_total, slices, named", [
    (7, 0, 8, "MIG slices 8 of 7"),  # the instance leaves the total to its parent
    (7, 0, 7, None),
    (7, 3, 4, "MIG slices 4 of 3"),  # its own total wins
    (0, 0, 9, None),  # no total known anywhere: nothing to compare with
])
def test_instance_slices_are_compared_with_the_parent_total_when_the_instance_has_none(parent_total, instance_total,
                                                                                      slices, named):
    parent = GpuDeviceSample(
        "GPU-0", None, 0, "m", SharingMode.MIG, 1, None, None, None, 0, parent_total, 80 * GIB, 0, 79 * GIB, GIB,
        None, None, None, False, (), (), (), (), (),
    )
    instance = dataclasses.replace(parent, uuid="MIG-0", parent_uuid="GPU-0", mig_compute_slices=slices,
                                   mig_total_compute_slices=instance_total, memory_total_bytes=10 * GIB,
                                   memory_free_bytes=9 * GIB, memory_reserved_bytes=0)
    sample = NodeSample("c", "n", 1, NOW - 3_600_000, NOW - 5000, 1000, "aws", "r", "i", "on_demand", (), (),
                        (parent, instance))
    outcome = _outcome(check_sample, sample)
    assert outcome == _outcome(reference_check_sample, sample)
    assert (outcome is None) == (named is None)
    if named is not None:
        assert outcome[1].endswith(f"device MIG-0: {named}")
