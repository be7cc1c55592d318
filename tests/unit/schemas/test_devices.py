"""Device ids and GPU resource names mean one thing to every service (``schemas.devices``, ``schemas.pods``).

The attributor (who holds a unit) and the guard (who may see one) once parsed ids with two parsers and folded pod
events with two sets of rules; these tests hold both services to the one owner.
"""

from __future__ import annotations

import pytest

from schemas.devices import (
    DeviceIdKind,
    base_device_id,
    covers,
    holds_whole,
    is_gpu_resource,
    names_unit,
    parse_device_id,
    unit_keys,
)
from schemas.records import DeviceAssignment, PodContainer, PodEvent, PodEventType
from services.attributor.modes import UnitKind, device_keys
from services.attributor.pod_index import PodIndex, apply_pod_event
from services.guard.rules import apply_pod_event as guard_apply
from services.guard.rules import ref_holds_whole
from tests.unit.attributor import device

GPU = "GPU-8d4e2f3a-6a0c-4b4e-9a57-0d3c1b2a9f11"
GPU2 = "GPU-1b2c3d4e-5f60-4718-8293-a4b5c6d7e8f9"
MIG = "MIG-5fa449e7-1c2d-4e3f-8a9b-0c1d2e3f4a5b"


@pytest.mark.parametrize("device_id, kind, base, replica", [
    (GPU, DeviceIdKind.GPU, GPU, None),
    (GPU.upper().replace("GPU-", "GPU-") + "::3", DeviceIdKind.GPU, GPU, 3),
    (MIG, DeviceIdKind.MIG_UUID, MIG, None),
    (f"MIG-{GPU}/7/0", DeviceIdKind.MIG_PATH, f"MIG-{GPU}/7/0", None),
    (f"MIG-{GPU}/7/0::1", DeviceIdKind.MIG_PATH, f"MIG-{GPU}/7/0", 1),
    ("0", DeviceIdKind.OTHER, "0", None),
    ("0::2", DeviceIdKind.OTHER, "0", 2),
    ("nvidia.com/gpu=0", DeviceIdKind.OTHER, "nvidia.com/gpu=0", None),
    (f"MIG-{GPU}/x/0", DeviceIdKind.OTHER, f"MIG-{GPU}/x/0", None),
])
def test_device_id_forms(device_id, kind, base, replica):
    ref = parse_device_id(device_id)
    assert (ref.kind, ref.base_id, ref.replica) == (kind, base, replica)
    assert base_device_id(device_id) == base


def test_a_gpu_id_reaches_its_mig_instances_but_holds_none_of_them():
    gpu = parse_device_id(GPU)
    assert covers(gpu, MIG, GPU, 7, 0) and covers(gpu, GPU, None, None, None)
    assert not names_unit(gpu, MIG, GPU, 7, 0) and names_unit(gpu, GPU, None, None, None)
    path = parse_device_id(f"MIG-{GPU}/7/0")
    assert covers(path, MIG, GPU, 7, 0) and names_unit(path, MIG, GPU, 7, 0)
    assert not covers(path, MIG, GPU, 8, 0) and not covers(parse_device_id("0"), GPU, None, None, None)
    assert holds_whole(gpu, GPU, None, None, None) and not holds_whole(parse_device_id(GPU + "::1"), GPU, None,
                                                                        None, None)
    assert unit_keys(MIG, GPU, 7, 0, mig_instance=True) == (MIG, f"MIG-{GPU}/7/0")


@pytest.mark.parametrize("name, gpu", [("nvidia.com/gpu", True), ("nvidia.com/gpu.shared", True),
                                       ("nvidia.com/mig-1g.10gb", True), ("nvidia.com/mig-3g.40gb.shared", True),
                                       ("rdma/hca", False), ("nvidia.com/gpucores", False)])
def test_gpu_resources(name, gpu):
    assert is_gpu_resource(name) is gpu


def _event(uid: str, t: int, ids: tuple[str, ...], *, event_type=PodEventType.ADDED, resource="nvidia.com/gpu",
           rv: str = "1", phase: str = "Running") -> PodEvent:
    return PodEvent(event_type, t, rv, "c", "n", uid, "ml", uid, {}, {}, None, None, phase, 0, {resource: len(ids)},
                    (PodContainer("main", None, {resource: len(ids)}, (DeviceAssignment(resource, ids),), None),))


@pytest.mark.parametrize("ids, unit, parent, gi, ci", [
    ((GPU,), GPU, None, None, None),
    ((GPU.upper(),), GPU, None, None, None),
    ((GPU + "::2",), GPU, None, None, None),
    ((MIG,), MIG, GPU, 7, 0),
    ((f"MIG-{GPU}/7/0",), MIG, GPU, 7, 0),
    ((GPU,), MIG, GPU, 7, 0),  # the plain id of a MIG-enabled GPU holds no instance
    ((GPU2,), GPU, None, None, None),
    (("0",), GPU, None, None, None),  # an index id cannot be tied to a GPU
])
def test_the_attributor_and_the_guard_agree_on_who_holds_a_unit(ids, unit, parent, gi, ci):
    events = [_event("p", 1_000, ids)]
    index = PodIndex.empty()
    for e in events:
        index = apply_pod_event(index, e)
    kind = UnitKind.MIG_INSTANCE if parent is not None else UnitKind.GPU
    sample = device(unit, parent_uuid=parent, gi=gi, ci=ci)
    keys = device_keys(kind, unit, parent, sample)
    attributor_holds = bool(index.assignments_for(keys)) and all(
        claim.plain_ids for _, claim in index.assignments_for(keys))
    view = guard_apply(None, events[0])
    guard_holds = any(ref_holds_whole(ref, unit, parent, sample) for ref in view.device_refs)
    assert attributor_holds == guard_holds


def test_both_folds_keep_a_deleted_pods_devices_and_the_earliest_end():
    added = _event("p", 1_000, (GPU,))
    finished = _event("p", 2_000, (GPU,), event_type=PodEventType.MODIFIED, rv="2", phase="Succeeded")
    deleted = _event("p", 3_000, (), event_type=PodEventType.DELETED, rv="3", phase="Succeeded")
    index, view = PodIndex.empty(), None
    for e in (added, finished, deleted, added):  # the stale ADDED again changes nothing
        index = apply_pod_event(index, e)
        view = guard_apply(view, e)
    info = index.pod("p")
    assert (info.ended_at_unix_ms, info.deleted_at_unix_ms) == (view.ended_at_unix_ms, view.deleted_at_unix_ms) \
        == (2_000, 3_000)
    assert [a.device_id for a in info.assignments] == list(view.device_ids) == [GPU]


def test_covering_count_is_the_number_of_refs_that_cover_each_unit():
    """``CoveringCount.count`` against ``covers`` ref by ref: GPU ids (plain, replicas, upper case) reaching a GPU
    and its MIG instances, MIG uuids, MIG paths with and without instance ids, ids of no known form, repeats."""
    from itertools import product

    from schemas.devices import CoveringCount, covers, parse_device_id

    gpu, other_gpu, mig = "GPU-aaaa-1111", "GPU-bbbb-2222", "MIG-cccc-3333"
    ids = [gpu, gpu + "::0", gpu.upper() + "::1", other_gpu + "::2", mig, mig.upper() + "::1",
           f"MIG-{gpu}/1/0", f"MIG-{gpu}/1/0::3", f"MIG-{gpu}/2/0", "0", "0::1", "nvidia.com/gpu=0", gpu]
    units = [(gpu, None, None, None), (gpu.upper(), None, None, None), (other_gpu, None, None, None),
             (mig, gpu, 1, 0), (mig.upper(), gpu.upper(), 1, 0), (mig, gpu, None, None), ("MIG-dddd", gpu, 2, 0),
             ("MIG-eeee", other_gpu, 1, 0), (gpu, gpu, None, None), ("GPU-none", None, None, None)]
    refs = [parse_device_id(i) for i in ids]
    for size in range(len(refs) + 1):
        subset = refs[:size]
        counting = CoveringCount(subset)
        for unit in units:
            assert counting.count(*unit) == sum(covers(ref, *unit) for ref in subset), (size, unit)
    assert any(counting.count(*u) > 1 for u in units) and any(counting.count(*u) == 0 for u in units)
    assert all(CoveringCount([a, b]).count(*u) == covers(a, *u) + covers(b, *u)
               for a, b in product(refs, repeat=2) for u in units)
