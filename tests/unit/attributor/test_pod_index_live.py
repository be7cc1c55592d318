"""``LivePodIndex``: the in-place pod index gives exactly what the pure ``apply_pod_event`` gives, event by event,
and its snapshots stay as they were taken."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumeter.errors import ConfigError
from schemas.records import PodEventType
from services.attributor.attribution import AttributionPolicy, attribute_node_window
from services.attributor.pod_index import LivePodIndex, PodIndex, apply_pod_event
from services.attributor.windows import NodeWindow
from tests.unit.attributor import CLUSTER, GIB, NODE, device, node_sample, pod_event

UIDS = ("a", "b", "c", "d")
DEVICE_SETS = (
    (),
    (("nvidia.com/gpu", ("GPU-0",)),),
    (("nvidia.com/gpu.shared", ("GPU-0::0", "GPU-0::1")),),
    (("nvidia.com/gpu.shared", ("GPU-1::0",)),),
    (("nvidia.com/mig-1g.10gb", ("MIG-GPU-2/7/0",)), ("nvidia.com/gpu", ("GPU-1",))),
)

events_strategy = st.lists(
    st.builds(
        lambda uid, t, kind, phase, rv, devices: pod_event(
            uid, devices=devices, event_type=kind, observed_at_unix_ms=t, phase=phase, resource_version=str(rv),
            started_at_unix_ms=None if t % 3 == 0 else max(t - 50, 0),
        ),
        st.sampled_from(UIDS),
        st.integers(min_value=0, max_value=400),
        st.sampled_from(list(PodEventType)),
        st.sampled_from(["Pending", "Running", "Succeeded", "Failed"]),
        st.integers(min_value=1, max_value=3),
        st.sampled_from(DEVICE_SETS),
    ),
    max_size=40,
)


def _pruned_as_the_pure_index_says(before: PodIndex, after: PodIndex, uid: str) -> tuple[str, ...]:
    # The engine's derivation from two pure snapshots (before this index existed): known uids in order, then the
    # event's own one, each once.
    out: list[str] = []
    for u in before.uids + (uid,):
        if u not in after and u not in out:
            out.append(u)
    return tuple(out)


@settings(max_examples=300, deadline=None)
@given(events_strategy, st.sampled_from([0, 1, 30, 100, 10_000]))
def test_live_index_matches_the_pure_index_after_every_event(events, linger_ms):
    pure = PodIndex.empty(linger_ms)
    live = LivePodIndex(linger_ms)
    assert live.snapshot() == pure
    for event in events:
        after = apply_pod_event(pure, event)
        change = live.apply(event)
        assert change.changed == (after is not pure)
        assert change.pruned == _pruned_as_the_pure_index_says(pure, after, event.uid)
        snapshot = live.snapshot()
        assert snapshot == after  # pods, device map, clock and next expiry
        assert live.uids == after.uids and len(live) == len(after)
        for uid in UIDS:
            assert live.pod(uid) == after.pod(uid) and (uid in live) == (uid in after)
        for base in ("GPU-0", "GPU-1", "GPU-2", "MIG-GPU-2/7/0"):
            assert live.pods_for_device(base) == after.pods_for_device(base)
            assert live.assignments_for([base]) == after.assignments_for([base])
        pure = after


def test_a_snapshot_does_not_change_with_later_events_and_is_shared_until_one():
    live = LivePodIndex(60_000)
    live.apply(pod_event("a", devices=[("nvidia.com/gpu", ["GPU-0"])], observed_at_unix_ms=0))
    first = live.snapshot()
    assert live.snapshot() is first
    assert live.apply(pod_event("a", devices=[("nvidia.com/gpu", ["GPU-0"])], observed_at_unix_ms=0)).changed is False
    assert live.snapshot() is first  # a repeated event changes nothing
    live.apply(pod_event("b", devices=[("nvidia.com/gpu", ["GPU-0"])], observed_at_unix_ms=10))
    live.apply(pod_event("a", devices=[("nvidia.com/gpu", ["GPU-0"])], observed_at_unix_ms=20,
                         event_type=PodEventType.DELETED, resource_version="2"))
    assert first.uids == ("a",) and first.pod("a").deleted_at_unix_ms is None
    assert [p.uid for p in first.pods_for_device("GPU-0")] == ["a"]
    second = live.snapshot()
    assert second is not first and second.uids == ("a", "b") and second.pod("a").deleted_at_unix_ms == 20
    # The deleted pod goes once another event moves the clock past its linger; the snapshot keeps it.
    change = live.apply(pod_event("c", observed_at_unix_ms=20 + 60_000))
    assert change == (True, ("a",))
    assert live.pod("a") is None and [p.uid for p in live.pods_for_device("GPU-0")] == ["b"]
    assert second.pod("a") is not None


def test_pruned_pods_come_sorted_and_a_pod_deleted_long_ago_goes_on_arrival():
    live = LivePodIndex(100)
    for uid in ("z", "y", "x"):
        live.apply(pod_event(uid, devices=[("nvidia.com/gpu", ["GPU-0"])], observed_at_unix_ms=500,
                             event_type=PodEventType.DELETED))
    live.apply(pod_event("w", observed_at_unix_ms=550))
    assert live.uids == ("w", "x", "y", "z")
    assert live.apply(pod_event("w", observed_at_unix_ms=600, resource_version="2")) == (True, ("x", "y", "z"))
    assert live.pods_for_device("GPU-0") == () and live.snapshot()._next_expiry_ms == PodIndex.empty()._next_expiry_ms
    # A deletion older than the clock minus linger: the pod is dropped as it comes (the event still changed it).
    assert live.apply(pod_event("b", observed_at_unix_ms=400, event_type=PodEventType.DELETED)) == (True, ("b",))
    assert live.uids == ("w",)


def test_negative_linger_is_a_config_error():
    with pytest.raises(ConfigError):
        LivePodIndex(-1)


def test_attribution_reads_the_live_index_as_its_snapshot():
    live = LivePodIndex()
    for uid, replica in (("a", 0), ("b", 1)):
        live.apply(pod_event(uid, devices=[("nvidia.com/gpu.shared", [f"GPU-0::{replica}"])]))
    dev = device("GPU-0", used=5 * GIB, util=60, replicas=2, procs=[(0, 3 * GIB, 30), (1, GIB, 20)])
    window = NodeWindow(CLUSTER, NODE, 60_000, 60, (node_sample(60_000, [dev], pod_uids=["a", "b"]),))
    rows = attribute_node_window(window, live, AttributionPolicy())
    assert rows == attribute_node_window(window, live.snapshot(), AttributionPolicy())
    assert [r.pod_name for r in rows if r.pod_uid] == ["pod-a", "pod-b"]
