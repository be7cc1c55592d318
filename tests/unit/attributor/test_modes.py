"""Sharing-mode decisions from samples and device ids, and the pod index they are looked up in."""

from __future__ import annotations

import pytest

from gpumeter.errors import ConfigError
from schemas.records import PodEventType, SharingMode
from schemas.devices import DeviceIdKind, parse_device_id
from services.attributor.modes import (
    UnitAssignment,
    UnitKind,
    decide_mode,
    device_keys,
    majority_sample_mode,
)
from services.attributor.pod_index import PodIndex, apply_pod_event, apply_pod_events, prune_pod_index
from tests.unit.attributor import device, pod_event

# ---------------------------------------------------------------------------------------------------------------
# Device ids


@pytest.mark.parametrize(
    "device_id, kind, base, replica, gpu, gi, ci",
    [
        ("GPU-1a2b", DeviceIdKind.GPU, "GPU-1a2b", None, "GPU-1a2b", None, None),
        ("GPU-1a2b::7", DeviceIdKind.GPU, "GPU-1a2b", 7, "GPU-1a2b", None, None),
        ("MIG-9f00", DeviceIdKind.MIG_UUID, "MIG-9f00", None, None, None, None),
        ("MIG-9f00::2", DeviceIdKind.MIG_UUID, "MIG-9f00", 2, None, None, None),
        ("MIG-GPU-1a2b/3/0", DeviceIdKind.MIG_PATH, "MIG-GPU-1a2b/3/0", None, "GPU-1a2b", 3, 0),
        ("MIG-GPU-1a2b/x/0", DeviceIdKind.OTHER, "MIG-GPU-1a2b/x/0", None, None, None, None),
        ("0", DeviceIdKind.OTHER, "0", None, None, None, None),
        ("GPU-1a2b::bad", DeviceIdKind.GPU, "GPU-1a2b", -1, "GPU-1a2b", None, None),
    ],
)
def test_parse_device_id(device_id, kind, base, replica, gpu, gi, ci):
    ref = parse_device_id(device_id)
    assert (ref.kind, ref.base_id, ref.replica, ref.gpu_uuid, ref.mig_gpu_instance_id, ref.mig_compute_instance_id) \
        == (kind, base, replica, gpu, gi, ci)
    assert ref.is_replica == (replica is not None)


def test_device_keys_name_a_mig_instance_both_ways():
    inst = device("MIG-abc", parent_uuid="GPU-P", gi=3, ci=1, mode=SharingMode.MIG)
    # Keys are in the normal form of a device id (hex lowercased after the prefix), as the pod index keys them.
    assert device_keys(UnitKind.MIG_INSTANCE, "MIG-abc", "GPU-P", inst) == ("MIG-abc", "MIG-GPU-p/3/1")
    assert device_keys(UnitKind.GPU, "GPU-0", None, device("GPU-0")) == ("GPU-0",)


def test_claims():
    plain = UnitAssignment("p", ("nvidia.com/gpu",), ("GPU-0",))
    replicas = UnitAssignment("q", ("nvidia.com/gpu.shared",), ("GPU-0::1", "GPU-0::4"))
    assert (plain.plain_ids, plain.replica_ids, plain.claim_replicas(8)) == (1, 0, 8)
    assert (replicas.plain_ids, replicas.replica_ids, replicas.claim_replicas(8)) == (0, 2, 2)
    assert replicas.shared_resource and not plain.shared_resource
    assert UnitAssignment("m", ("nvidia.com/mig-1g.10gb",), ("MIG-x",)).mig_resource


# ---------------------------------------------------------------------------------------------------------------
# Decisions


def A(uid, resource, *ids):
    return UnitAssignment(uid, (resource,), ids)


def test_replica_ids_make_a_time_sliced_gpu_even_when_the_sample_says_exclusive():
    d = decide_mode(UnitKind.GPU, SharingMode.EXCLUSIVE, 1, [A("a", "nvidia.com/gpu", "GPU-0::0")])
    assert d.mode is SharingMode.TIME_SLICING and d.conflict and d.dedicated_owner is None
    assert "device ids win" in d.evidence and "EXCLUSIVE" in d.evidence


def test_replica_ids_with_mps_samples_are_mps():
    d = decide_mode(UnitKind.GPU, SharingMode.MPS, 4, [A("a", "nvidia.com/gpu", "GPU-0::0"),
                                                      A("b", "nvidia.com/gpu", "GPU-0::1")])
    assert d.mode is SharingMode.MPS and not d.conflict


def test_renamed_shared_resource_means_shared():
    d = decide_mode(UnitKind.GPU, SharingMode.UNKNOWN, 1, [A("a", "nvidia.com/gpu.shared", "GPU-0")])
    assert d.mode is SharingMode.TIME_SLICING and d.dedicated_owner is None


def test_one_plain_holder_is_exclusive_even_when_the_sample_says_time_slicing():
    d = decide_mode(UnitKind.GPU, SharingMode.TIME_SLICING, 4, [A("a", "nvidia.com/gpu", "GPU-0")])
    assert d.mode is SharingMode.EXCLUSIVE and d.dedicated_owner == "a" and d.conflict
    agreeing = decide_mode(UnitKind.GPU, SharingMode.EXCLUSIVE, 1, [A("a", "nvidia.com/gpu", "GPU-0")])
    assert agreeing.mode is SharingMode.EXCLUSIVE and agreeing.dedicated_owner == "a" and not agreeing.conflict


def test_several_plain_holders_are_a_conflict_attributed_by_usage():
    d = decide_mode(UnitKind.GPU, SharingMode.EXCLUSIVE, 1,
                    [A("a", "nvidia.com/gpu", "GPU-0"), A("b", "nvidia.com/gpu", "GPU-0")])
    assert d.mode is SharingMode.TIME_SLICING and d.conflict and d.dedicated_owner is None


def test_a_decision_is_made_once_per_evidence_and_never_handed_to_other_evidence():
    from services.attributor import modes

    holders = [A("a", "nvidia.com/gpu", "GPU-0::0"), A("b", "nvidia.com/gpu", "GPU-0::1")]
    first = decide_mode(UnitKind.GPU, SharingMode.MPS, 4, holders)
    # The same evidence (equal assignments, new objects): the same decision object, not decided again.
    again = decide_mode(UnitKind.GPU, SharingMode.MPS, 4, [A("a", "nvidia.com/gpu", "GPU-0::0"),
                                                           A("b", "nvidia.com/gpu", "GPU-0::1")])
    assert again is first
    # Evidence that differs in any part gets its own decision, as if nothing were remembered.
    variants = [
        (UnitKind.GPU, SharingMode.TIME_SLICING, 4, holders, False),
        (UnitKind.GPU, SharingMode.MPS, 4, holders, True),
        (UnitKind.GPU, SharingMode.MPS, 4, holders[:1], False),
        (UnitKind.MIG_INSTANCE, SharingMode.MPS, 4, holders, False),
        (UnitKind.GPU, SharingMode.MPS, 5, holders, False),
        # A plain str equals its SharingMode but is not read alike (``is SharingMode.MIG``).
        (UnitKind.GPU, SharingMode.MIG, 1, [], False),
        (UnitKind.GPU, "MIG", 1, [], False),
    ]
    remembered = [decide_mode(k, m, r, a, sample_mode_changed=c) for k, m, r, a, c in variants]
    modes._DECISIONS.clear()
    fresh = [decide_mode(k, m, r, a, sample_mode_changed=c) for k, m, r, a, c in variants]
    assert remembered == fresh
    assert remembered[-2] != remembered[-1]  # the str and the enum are decided apart


def test_without_pods_the_sample_decides_and_says_so():
    assert decide_mode(UnitKind.GPU, SharingMode.MPS, 4, []).mode is SharingMode.MPS
    d = decide_mode(UnitKind.GPU, SharingMode.UNKNOWN, 3, [])
    assert d.mode is SharingMode.TIME_SLICING and "replicas=3" in d.evidence
    d = decide_mode(UnitKind.GPU, SharingMode.UNKNOWN, 1, [])
    assert d.mode is SharingMode.UNKNOWN and "by usage" in d.evidence


def test_mig_resource_on_a_gpu_with_mig_off_is_a_conflict():
    d = decide_mode(UnitKind.GPU, SharingMode.EXCLUSIVE, 1, [A("a", "nvidia.com/mig-1g.10gb", "GPU-0")])
    assert d.conflict and "MIG off" in d.evidence


def test_mig_instance_decisions():
    held = decide_mode(UnitKind.MIG_INSTANCE, SharingMode.MIG, 1, [A("a", "nvidia.com/mig-1g.10gb", "MIG-x")])
    assert held.mode is SharingMode.MIG and held.dedicated_owner == "a" and not held.conflict
    sliced = decide_mode(UnitKind.MIG_INSTANCE, SharingMode.MIG, 2,
                         [A("a", "nvidia.com/mig-1g.10gb", "MIG-x::0"), A("b", "nvidia.com/mig-1g.10gb", "MIG-x::1")])
    assert sliced.dedicated_owner is None and not sliced.conflict
    mislabelled = decide_mode(UnitKind.MIG_INSTANCE, SharingMode.EXCLUSIVE, 1, [])
    assert mislabelled.mode is SharingMode.MIG and mislabelled.conflict
    assert "NVML structure wins" in mislabelled.evidence


def test_mig_remainder_is_idle_and_flags_plain_claims():
    d = decide_mode(UnitKind.MIG_UNASSIGNED, SharingMode.MIG, 1, [A("a", "nvidia.com/gpu", "GPU-P")])
    assert d.mode is SharingMode.MIG and d.conflict and d.dedicated_owner is None and "all idle" in d.evidence


def test_majority_sample_mode_by_weight():
    ts, ex = device(mode=SharingMode.TIME_SLICING), device(mode=SharingMode.EXCLUSIVE)
    assert majority_sample_mode([(ts, 1.0), (ex, 3.0)]) == (SharingMode.EXCLUSIVE, True)
    assert majority_sample_mode([(ts, 2.0), (ts, 2.0)]) == (SharingMode.TIME_SLICING, False)
    # Ties resolve the same way every time.
    assert majority_sample_mode([(ex, 1.0), (ts, 1.0)]) == majority_sample_mode([(ts, 1.0), (ex, 1.0)])
    assert majority_sample_mode([]) == (SharingMode.UNKNOWN, False)


# ---------------------------------------------------------------------------------------------------------------
# Pod index


def test_lookup_by_uid_and_by_device_id_including_replicas():
    index = apply_pod_events(
        PodIndex.empty(),
        [
            pod_event("a", devices=[("nvidia.com/gpu.shared", ["GPU-0::0", "GPU-0::3"])]),
            pod_event("b", devices=[("nvidia.com/gpu.shared", ["GPU-0::1"])]),
            pod_event("m", devices=[("nvidia.com/mig-1g.10gb", ["MIG-GPU-1/7/0"])]),
        ],
    )
    assert index.pod("a").namespace == "ml" and index.pod("nope") is None
    assert [p.uid for p in index.pods_for_device("GPU-0")] == ["a", "b"]
    assert [p.uid for p in index.pods_for_device("GPU-0::1")] == ["a", "b"]
    assert [p.uid for p in index.pods_for_device("MIG-GPU-1/7/0")] == ["m"]
    claims = index.assignments_for(["GPU-0"])
    assert [(info.uid, claim.device_ids) for info, claim in claims] == [("a", ("GPU-0::0", "GPU-0::3")),
                                                                        ("b", ("GPU-0::1",))]
    assert len(index) == 3 and "b" in index and index.uids == ("a", "b", "m")


def test_apply_is_pure_and_ignores_stale_and_duplicate_events():
    first = pod_event("a", devices=[("nvidia.com/gpu", ["GPU-0"])], observed_at_unix_ms=100, resource_version="5")
    index = apply_pod_event(PodIndex.empty(), first)
    moved = pod_event("a", devices=[("nvidia.com/gpu", ["GPU-1"])], observed_at_unix_ms=200, resource_version="6",
                      event_type=PodEventType.MODIFIED)
    newer = apply_pod_event(index, moved)
    assert [p.uid for p in index.pods_for_device("GPU-0")] == ["a"]  # the old snapshot is untouched
    assert newer.pods_for_device("GPU-0") == () and [p.uid for p in newer.pods_for_device("GPU-1")] == ["a"]
    assert apply_pod_event(newer, first).pod("a").resource_version == "6"  # older event: ignored
    assert apply_pod_event(newer, moved) is newer  # duplicate


def test_life_from_start_time_to_terminal_phase_or_deletion():
    index = apply_pod_events(
        PodIndex.empty(),
        [
            pod_event("a", started_at_unix_ms=1000, observed_at_unix_ms=1000),
            pod_event("a", started_at_unix_ms=1000, observed_at_unix_ms=5000, phase="Succeeded",
                      event_type=PodEventType.MODIFIED, resource_version="2"),
            pod_event("a", started_at_unix_ms=1000, observed_at_unix_ms=9000, phase="Succeeded",
                      event_type=PodEventType.DELETED, resource_version="3"),
            pod_event("u", started_at_unix_ms=None, observed_at_unix_ms=9000),
        ],
    )
    a = index.pod("a")
    assert (a.started_at_unix_ms, a.ended_at_unix_ms, a.deleted_at_unix_ms) == (1000, 5000, 9000)
    assert not a.alive_at(999) and a.alive_at(1000) and a.alive_at(4999) and not a.alive_at(5000)
    assert a.overlaps(0, 1001) and not a.overlaps(5000, 6000)
    # No start time known: alive since forever.
    assert index.pod("u").alive_at(-10**12)


def test_deleted_pods_linger_then_go():
    linger_ms = 60_000
    deleted_at = 10_000
    index = apply_pod_events(
        PodIndex.empty(linger_ms),
        [
            pod_event("a", devices=[("nvidia.com/gpu", ["GPU-0"])], observed_at_unix_ms=0),
            pod_event("a", devices=[("nvidia.com/gpu", ["GPU-0"])], observed_at_unix_ms=deleted_at,
                      event_type=PodEventType.DELETED, resource_version="2"),
        ],
    )
    kept = prune_pod_index(index, deleted_at + linger_ms - 1)
    assert kept.pod("a") is not None and [p.uid for p in kept.pods_for_device("GPU-0")] == ["a"]
    gone = prune_pod_index(index, deleted_at + linger_ms)
    assert gone.pod("a") is None and gone.pods_for_device("GPU-0") == ()
    # Another pod's later event moves the clock too.
    later = apply_pod_event(index, pod_event("b", observed_at_unix_ms=deleted_at + linger_ms + 5))
    assert later.pod("a") is None and later.pod("b") is not None
    with pytest.raises(ConfigError):
        PodIndex.empty(-1)


def test_deletion_without_assignments_keeps_the_known_ones():
    index = apply_pod_events(
        PodIndex.empty(),
        [
            pod_event("a", devices=[("nvidia.com/gpu", ["GPU-0"])], observed_at_unix_ms=0),
            pod_event("a", observed_at_unix_ms=10, event_type=PodEventType.DELETED, resource_version="2"),
        ],
    )
    assert [p.uid for p in index.pods_for_device("GPU-0")] == ["a"]
