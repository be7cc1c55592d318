"""The guard's pure rules: each condition holds exactly when its definition (docs/guard.md) says it does."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from schemas.records import CostSubjectKind, PodEventType, Severity, ShareSubjectKind, SharingMode
from services.guard.config import Budget, GuardConfig
from services.guard.rules import (
    BUSY,
    IDLE,
    UNKNOWN,
    BudgetSpend,
    advance_idle_run,
    apply_pod_event,
    budget_exceeded,
    classify_unit_window,
    cost_subject,
    fingerprint_of,
    gpu_error,
    gpu_error_counts,
    idle_allocation,
    period_bounds,
    shared_memory_pressure,
    stale_node,
    unrequested_gpu_use,
    visibility_leak,
    visibility_leak_spec,
)
from tests.unit.guard import (
    CLUSTER,
    GIB,
    GPU_A,
    GPU_B,
    GPU_C,
    MIG_1,
    MIG_2,
    NODE,
    T0,
    UID_1,
    UID_2,
    UID_3,
    container,
    device,
    nvml_error,
    pod_event,
    proc,
    sample,
    unit_window,
)

REPO = Path(__file__).resolve().parents[3]
CONFIG = GuardConfig()


def pods_of(*events):
    views = {}
    for event in events:
        views[event.uid] = apply_pod_event(views.get(event.uid), event)
    return views


def owner_of(gpu: str, uid: str = UID_1, name: str = "owner-0", resource: str = "nvidia.com/gpu", **kwargs):
    return pod_event(uid, name, containers=[container(devices=[(resource, [gpu])])], **kwargs)


def leaker(uid: str = UID_2, name: str = "leaker", env: str | None = "all", privileged: bool = False, **kwargs):
    return pod_event(uid, name, namespace="scratch", containers=[container(env=env, privileged=privileged)], **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# fingerprints


def test_fingerprint_is_16_hex_and_changes_with_every_subject_field():
    base = dict(rule="visibility_leak", cluster="c", node_name="n", gpu_uuid="g", namespace="ns", pod_name="p",
                pod_uid="u", team="t", qualifier="q")
    fp = fingerprint_of(**base)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert fingerprint_of(**base) == fp
    for key in base:
        changed = dict(base, **{key: base[key] + "x"})
        assert fingerprint_of(**changed) != fp, key
    # None and "" are different subjects
    assert fingerprint_of(**dict(base, team=None)) != fingerprint_of(**dict(base, team=""))


def test_fingerprint_is_the_same_in_another_process():
    # Python's hash() is salted per process; the fingerprint must not be.
    code = ("from services.guard.rules import fingerprint_of; "
            "print(fingerprint_of('stale_node', 'c', 'node-1'))")
    outputs = {
        subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {fingerprint_of("stale_node", "c", "node-1")}


# ----------------------------------------------------------------------------------------------------------------
# pods


def test_apply_pod_event_ignores_older_events_and_keeps_assignments_on_deletion():
    added = owner_of(GPU_A, t=T0)
    view = apply_pod_event(None, added)
    assert view.device_ids == (GPU_A,) and view.alive and view.requests_gpu
    older = pod_event(UID_1, "owner-0", t=T0 - 1, phase="Failed")
    assert apply_pod_event(view, older) is view
    deleted = pod_event(UID_1, "owner-0", event_type=PodEventType.DELETED, t=T0 + 5_000)
    gone = apply_pod_event(view, deleted)
    assert gone.device_ids == (GPU_A,)
    assert (gone.ended_at_unix_ms, gone.deleted_at_unix_ms) == (T0 + 5_000, T0 + 5_000) and not gone.alive
    finished = apply_pod_event(view, pod_event(UID_1, "owner-0", t=T0 + 1_000, phase="Succeeded"))
    assert finished.ended_at_unix_ms == T0 + 1_000 and finished.deleted_at_unix_ms is None


def test_apply_pod_event_reads_only_gpu_resources_and_flags_unparsable_ids():
    event = pod_event(UID_1, "p", containers=[container(devices=[("rdma/hca", ["mlx5_0"]),
                                                                 ("nvidia.com/gpu", ["0"])])])
    view = apply_pod_event(None, event)
    assert view.device_ids == ("0",)
    assert view.unparsed_device_ids == ("0",) and not view.assignment_known


# ----------------------------------------------------------------------------------------------------------------
# visibility_leak


def test_a_process_on_a_gpu_assigned_to_another_pod_is_a_critical_leak_per_unit():
    pods = pods_of(owner_of(GPU_A), leaker(env=None))
    s = sample([device(GPU_A, processes=[proc(10, 0, 20 * GIB), proc(11, 1, 3 * GIB), proc(12, 1, GIB)]),
                device(GPU_B, index=1, processes=[proc(13, 1, 2 * GIB)])], [UID_1, UID_2])
    conditions = visibility_leak(s, pods, CONFIG)
    by_unit = {c.gpu_uuid: c for c in conditions}
    assert set(by_unit) == {GPU_A, GPU_B}
    a = by_unit[GPU_A]
    assert (a.rule, a.severity, a.pod_uid, a.namespace, a.node_name) == (
        "visibility_leak", Severity.CRITICAL, UID_2, "scratch", NODE)
    assert a.evidence["memory_used_bytes"] == 4 * GIB and a.evidence["process_count"] == 2
    assert a.evidence["other_holders_count"] == 1 and "default/owner-0" in a.summary
    assert by_unit[GPU_B].evidence["other_holders_count"] == 0 and "assigned to no pod" in by_unit[GPU_B].summary


def test_processes_on_own_units_are_not_leaks_in_every_id_form():
    replica = pod_event(UID_1, "ts", containers=[container(devices=[("nvidia.com/gpu.shared", [GPU_A + "::3"])])])
    mig_new = pod_event(UID_2, "mig-new", containers=[container(devices=[("nvidia.com/mig-1g.10gb", [MIG_1])])])
    legacy = f"MIG-{GPU_B}/7/0"
    mig_old = pod_event(UID_3, "mig-old", containers=[container(devices=[("nvidia.com/mig-1g.10gb", [legacy])])])
    pods = pods_of(replica, mig_new, mig_old)
    s = sample([
        device(GPU_A, mode=SharingMode.TIME_SLICING, replicas=4, processes=[proc(1, 0, GIB)]),
        device(MIG_1, index=1, parent=GPU_C, gi=7, ci=0, processes=[proc(2, 1, GIB)]),
        device(MIG_2, index=2, parent=GPU_B, gi=7, ci=0, processes=[proc(3, 2, GIB)]),
    ], [UID_1, UID_2, UID_3])
    assert visibility_leak(s, pods, CONFIG) == ()
    # The same MIG pods on the other instance are leaks.
    swapped = sample([
        device(MIG_1, index=1, parent=GPU_C, gi=7, ci=0, processes=[proc(3, 2, GIB)]),
        device(MIG_2, index=2, parent=GPU_B, gi=8, ci=0, processes=[proc(3, 2, GIB)]),
    ], [UID_1, UID_2, UID_3])
    assert {(c.pod_uid, c.gpu_uuid) for c in visibility_leak(swapped, pods, CONFIG)} == {(UID_3, MIG_1), (UID_3, MIG_2)}


def test_unknown_pods_pods_without_their_assignment_yet_and_exempt_pods_are_not_judged():
    config = GuardConfig(exempt_label_namespaces=("monitoring",))
    waiting = pod_event(UID_1, "waiting", containers=[container(requests={"nvidia.com/gpu": 1})])
    agent = pod_event(UID_2, "dcgm", namespace="gpu-operator", containers=[container(privileged=True)])
    labelled = pod_event(UID_3, "mine", namespace="monitoring", labels={"gpumeter.io/guard-exempt": "true"},
                         containers=[container(privileged=True)])
    pods = pods_of(waiting, agent, labelled)
    s = sample([device(GPU_A, processes=[proc(1, 0, GIB), proc(2, 1, GIB), proc(3, 2, GIB), proc(4, 3, GIB),
                                         proc(5, -1, GIB)])],
               [UID_1, UID_2, UID_3, "00000000-0000-4000-8000-0000000000ff"])
    assert visibility_leak(s, pods, config) == ()
    assert unrequested_gpu_use(s, pods, config) == ()


def labelled_leaker(namespace: str = "scratch", value: str = "true"):
    return pod_event(UID_2, "leaker", namespace=namespace, labels={"gpumeter.io/guard-exempt": value},
                     containers=[container(env=None)])


def test_a_tenants_own_exempt_label_exempts_nothing_by_default():
    """The label is the pod owner's to write: by default it is honoured in no namespace, so a labelled pod using
    another team's GPU is still judged (issue 22)."""
    pods = pods_of(owner_of(GPU_A), labelled_leaker())
    s = sample([device(GPU_A, processes=[proc(1, 0, 10 * GIB), proc(2, 1, 3 * GIB)])], [UID_1, UID_2])
    (unrequested,) = unrequested_gpu_use(s, pods, CONFIG)
    assert (unrequested.rule, unrequested.pod_uid) == ("unrequested_gpu_use", UID_2)
    (leak,) = visibility_leak(s, pods, CONFIG)
    assert (leak.rule, leak.pod_uid, leak.gpu_uuid) == ("visibility_leak", UID_2, GPU_A)
    # Listing another namespace for the label changes nothing for this one.
    elsewhere = GuardConfig(exempt_label_namespaces=("gpumeter",))
    assert len(unrequested_gpu_use(s, pods, elsewhere)) == 1 and len(visibility_leak(s, pods, elsewhere)) == 1


def test_the_exempt_label_is_honoured_only_in_the_namespaces_the_platform_lists():
    s = sample([device(GPU_A, processes=[proc(1, 0, 10 * GIB), proc(2, 1, 3 * GIB)])], [UID_1, UID_2])
    listed = GuardConfig(exempt_label_namespaces=("scratch",))
    pods = pods_of(owner_of(GPU_A), labelled_leaker())
    assert unrequested_gpu_use(s, pods, listed) == () and visibility_leak(s, pods, listed) == ()
    # In a listed namespace an unlabelled (or not "true") pod is still judged.
    unlabelled = pods_of(owner_of(GPU_A), labelled_leaker(value="false"))
    assert len(unrequested_gpu_use(s, unlabelled, listed)) == 1
    # A whole namespace exempt by exempt_namespaces needs no label.
    by_namespace = GuardConfig(exempt_namespaces=("scratch",))
    assert unrequested_gpu_use(s, unlabelled, by_namespace) == ()


@pytest.mark.parametrize("env", ["", "void", "none", " NONE "])
def test_visible_devices_values_that_give_no_gpu_are_fine(env):
    view = apply_pod_event(None, leaker(env=env))
    assert visibility_leak_spec(view, (), CONFIG) == ()


@pytest.mark.parametrize("env, field", [
    ("all", "visible_devices_all_containers_count"),
    ("<valueFrom>", "visible_devices_value_from_containers_count"),
])
def test_a_spec_that_sets_all_or_an_unknowable_value_leaks_without_using_a_gpu(env, field):
    view = apply_pod_event(None, leaker(env=env))
    (c,) = visibility_leak_spec(view, (), CONFIG)
    assert (c.rule, c.severity, c.gpu_uuid, c.pod_uid) == ("visibility_leak", Severity.CRITICAL, None, UID_2)
    assert c.evidence[field] == 1 and c.evidence["gpu_requested_count"] == 0


def test_privileged_containers_see_every_gpu():
    view = apply_pod_event(None, leaker(env=None, privileged=True))
    (c,) = visibility_leak_spec(view, (), CONFIG)
    assert c.evidence["privileged_containers_count"] == 1


def test_ids_in_the_spec_are_a_leak_only_when_they_name_units_outside_the_assignment():
    devices = (device(GPU_A, index=0), device(GPU_B, index=1))
    own_uuid = pod_event(UID_1, "a", containers=[container(env=GPU_A, devices=[("nvidia.com/gpu", [GPU_A])])])
    own_index = pod_event(UID_1, "a", containers=[container(env="0", devices=[("nvidia.com/gpu", [GPU_A])])])
    other_index = pod_event(UID_1, "a", containers=[container(env="0,1", devices=[("nvidia.com/gpu", [GPU_A])])])
    other_uuid = pod_event(UID_1, "a", containers=[container(env=GPU_B, devices=[("nvidia.com/gpu", [GPU_A])])])
    assert visibility_leak_spec(apply_pod_event(None, own_uuid), devices, CONFIG) == ()
    assert visibility_leak_spec(apply_pod_event(None, own_index), devices, CONFIG) == ()
    for event, foreign in ((other_index, 1), (other_uuid, 1)):
        (c,) = visibility_leak_spec(apply_pod_event(None, event), devices, CONFIG)
        assert c.evidence["unassigned_visible_devices_count"] == foreign
        assert c.evidence["gpu_requested_count"] == 1
    # Without the node's devices an index cannot be shown to be the pod's own.
    (c,) = visibility_leak_spec(apply_pod_event(None, own_index), (), CONFIG)
    assert c.evidence["unassigned_visible_devices_count"] == 1


def test_an_ended_pod_no_longer_leaks_and_the_sample_rule_includes_the_spec_check():
    view = apply_pod_event(None, leaker())
    s = sample([device(GPU_A)], [])
    assert [c.pod_uid for c in visibility_leak(s, {UID_2: view}, CONFIG)] == [UID_2]
    ended = apply_pod_event(view, leaker(event_type=PodEventType.DELETED, t=T0 + 1))
    assert visibility_leak_spec(ended, (), CONFIG) == ()
    assert visibility_leak(s, {UID_2: ended}, CONFIG) == ()


def test_a_disabled_rule_says_nothing():
    config = GuardConfig(disabled_rules=frozenset({"visibility_leak"}))
    assert visibility_leak_spec(apply_pod_event(None, leaker()), (), config) == ()


# ----------------------------------------------------------------------------------------------------------------
# unrequested_gpu_use


def test_gpu_memory_of_a_pod_requesting_no_gpu_is_summed_over_units():
    pods = pods_of(owner_of(GPU_A), leaker(env=None))
    s = sample([device(GPU_A, processes=[proc(1, 0, 10 * GIB), proc(2, 1, 3 * GIB)]),
                device(GPU_B, index=1, processes=[proc(3, 1, 5 * GIB), proc(4, 1, -1)])], [UID_1, UID_2])
    (c,) = unrequested_gpu_use(s, pods, CONFIG)
    assert (c.rule, c.severity, c.pod_uid, c.gpu_uuid) == ("unrequested_gpu_use", Severity.WARNING, UID_2, None)
    assert c.evidence["memory_used_bytes"] == 8 * GIB
    assert c.evidence["process_count"] == 3 and c.evidence["memory_unknown_process_count"] == 1
    assert c.evidence["gpu_units_count"] == 2
    assert unrequested_gpu_use(s, pods, GuardConfig(unrequested_min_memory_bytes=8 * GIB + 1)) == ()
    assert len(unrequested_gpu_use(s, pods, GuardConfig(unrequested_min_memory_bytes=8 * GIB))) == 1


# ----------------------------------------------------------------------------------------------------------------
# shared_memory_pressure


def _ts_device(used_by_pod, total=24 * GIB, reserved=0, replicas=4, mode=SharingMode.TIME_SLICING, extra=0):
    processes = [proc(100 + i, i, b) for i, b in enumerate(used_by_pod)]
    return device(GPU_A, mode=mode, replicas=replicas, total=total, reserved=reserved,
                  used=sum(used_by_pod) + extra, processes=processes)


def _replica_pods(*replica_counts):
    events = []
    for i, count in enumerate(replica_counts):
        uid = f"00000000-0000-4000-8000-0000000001{i:02d}"
        ids = [f"{GPU_A}::{i * 4 + k}" for k in range(count)]
        events.append(pod_event(uid, f"p{i}", containers=[container(devices=[("nvidia.com/gpu.shared", ids)])]))
    return pods_of(*events), [e.uid for e in events]


def test_a_pod_above_its_fair_share_of_a_shared_gpu_fires_and_a_second_replica_doubles_its_share():
    pods, uids = _replica_pods(1, 2)
    fair = 24 * GIB / 4
    s = sample([_ts_device([int(fair) + 1, int(2 * fair) - 1])], uids)
    (c,) = shared_memory_pressure(s, pods, CONFIG)
    assert (c.pod_uid, c.gpu_uuid, c.severity) == (uids[0], GPU_A, Severity.WARNING)
    assert c.evidence["fair_share_bytes"] == fair and c.evidence["replicas_count"] == 4
    s = sample([_ts_device([int(fair), int(2 * fair) + 1])], uids)
    (c,) = shared_memory_pressure(s, pods, CONFIG)
    assert c.pod_uid == uids[1] and c.evidence["fair_share_bytes"] == 2 * fair
    assert c.evidence["pod_replicas_count"] == 2
    assert shared_memory_pressure(s, pods, GuardConfig(shared_memory_fair_share_factor=1.5)) == ()


def test_a_nearly_full_shared_gpu_fires_for_the_unit_with_capacity_excluding_the_reserve():
    pods, uids = _replica_pods(1, 1, 1, 1)
    total, reserved = 24 * GIB, 2 * GIB
    capacity = total - reserved
    threshold = CONFIG.shared_memory_used_above_percent / 100
    each = int(capacity * threshold / 4)
    over = sample([_ts_device([each] * 4, total=total, reserved=reserved, extra=4)], uids)
    (c,) = shared_memory_pressure(over, pods, CONFIG)
    assert (c.gpu_uuid, c.pod_uid) == (GPU_A, None)
    assert c.evidence["memory_capacity_bytes"] == capacity
    assert c.evidence["memory_used_percent"] == pytest.approx(100 * (4 * each + 4) / capacity)
    under = sample([_ts_device([each] * 4, total=total, reserved=reserved, extra=-4)], uids)
    assert shared_memory_pressure(under, pods, CONFIG) == ()


def test_exclusive_gpus_are_never_under_shared_pressure_and_replica_ids_make_a_unit_shared():
    pods = pods_of(owner_of(GPU_A))
    s = sample([device(GPU_A, total=24 * GIB, reserved=0, processes=[proc(1, 0, 23 * GIB)])], [UID_1])
    assert shared_memory_pressure(s, pods, CONFIG) == ()
    pods, uids = _replica_pods(1, 1)
    unknown = sample([_ts_device([20 * GIB, 2 * GIB], mode=SharingMode.UNKNOWN, replicas=1)], uids)
    rules = {(c.pod_uid, c.evidence["replicas_count"]) for c in shared_memory_pressure(unknown, pods, CONFIG)}
    # Two pods hold replica ids: two replicas, fair share 12 GiB; the unit is also above 90 %.
    assert rules == {(uids[0], 2.0), (None, 2.0)}


# ----------------------------------------------------------------------------------------------------------------
# gpu_error


def test_a_lost_gpu_is_critical_at_once_and_counts_its_mig_units_once():
    lost = nvml_error("nvmlDeviceGetHandleByIndex", "GPU_IS_LOST")
    s = sample([device(GPU_A, errors=[lost]), device(MIG_1, parent=GPU_A, errors=[lost]),
                device(GPU_B, index=1)])
    counts = gpu_error_counts(s, CONFIG)
    assert counts == {GPU_A: (2, True, ("nvmlDeviceGetHandleByIndex:GPU_IS_LOST",))}
    (c,) = gpu_error(s, CONFIG, {GPU_A: 1})
    assert (c.gpu_uuid, c.severity, c.pod_uid) == (GPU_A, Severity.CRITICAL, None)
    assert c.evidence == {"error_count": 2.0, "gpu_lost_flag": 1.0, "consecutive_error_samples": 1.0}


def test_other_errors_warn_after_consecutive_samples_unless_ignored():
    power = nvml_error("nvmlDeviceGetPowerUsage", "NOT_SUPPORTED")
    s = sample([device(GPU_A, errors=[power])])
    need = CONFIG.gpu_error_min_consecutive_samples
    assert gpu_error(s, CONFIG, {GPU_A: need - 1}) == ()
    (c,) = gpu_error(s, CONFIG, {GPU_A: need})
    assert c.severity is Severity.WARNING and c.evidence["consecutive_error_samples"] == need
    for pattern in ("nvmlDeviceGetPowerUsage:NOT_SUPPORTED", "*:NOT_SUPPORTED", "nvmlDeviceGetPowerUsage:*"):
        config = GuardConfig(gpu_error_ignored=(pattern,))
        assert gpu_error(s, config, {GPU_A: need}) == () and gpu_error_counts(s, config) == {}
    assert gpu_error_counts(s, GuardConfig(gpu_error_ignored=("nvmlDeviceGetMemoryInfo:*",)))


def test_node_level_nvml_errors_are_critical_for_the_node():
    s = sample([], node_errors=[nvml_error("nvmlInit", "DRIVER_NOT_LOADED")])
    (c,) = gpu_error(s, CONFIG, {})
    assert (c.gpu_uuid, c.node_name, c.severity) == (None, NODE, Severity.CRITICAL)


# ----------------------------------------------------------------------------------------------------------------
# stale_node


def test_a_node_is_stale_after_k_intervals_or_the_minimum_whichever_is_longer():
    config = GuardConfig(stale_node_intervals=3, stale_node_min_seconds=60)
    interval = 10_000
    threshold = max(3 * interval, 60_000)
    assert stale_node(CLUSTER, NODE, T0, interval, T0 + threshold, config) == ()
    (c,) = stale_node(CLUSTER, NODE, T0, interval, T0 + threshold + 1, config)
    assert (c.rule, c.node_name, c.gpu_uuid) == ("stale_node", NODE, None)
    assert c.evidence["threshold_seconds"] == threshold / 1000
    slow = 60_000  # a slow collector: K intervals are longer than the minimum
    assert stale_node(CLUSTER, NODE, T0, slow, T0 + 3 * slow, config) == ()
    assert stale_node(CLUSTER, NODE, T0, slow, T0 + 3 * slow + 1, config)


# ----------------------------------------------------------------------------------------------------------------
# idle_allocation


def test_only_pods_holding_the_whole_unit_get_an_idle_verdict():
    whole = owner_of(GPU_A)
    replica = pod_event(UID_2, "ts", containers=[container(devices=[("nvidia.com/gpu.shared", [GPU_A + "::1"])])])
    pods = pods_of(whole, replica)
    verdicts = classify_unit_window(unit_window(GPU_A, T0, [(UID_1, 0.01), (UID_2, 0.0)]), pods, CONFIG)
    assert {uid: v for uid, (v, _) in verdicts.items()} == {UID_1: IDLE}
    busy = classify_unit_window(unit_window(GPU_A, T0, [(UID_1, CONFIG.idle_compute_below_percent / 100)]), pods,
                                CONFIG)
    assert busy[UID_1][0] == BUSY
    unknown = classify_unit_window(unit_window(GPU_A, T0, [(UID_1, 0.0)], unattributed_compute=1.0), pods, CONFIG)
    assert unknown[UID_1][0] == UNKNOWN


def test_mig_holders_in_both_id_forms_get_a_verdict_for_their_instance_only():
    new = pod_event(UID_1, "new", containers=[container(devices=[("nvidia.com/mig-1g.10gb", [MIG_1])])])
    old = pod_event(UID_2, "old", containers=[container(devices=[("nvidia.com/mig-1g.10gb", [f"MIG-{GPU_B}/9/0"])])])
    pods = pods_of(new, old)
    assert set(classify_unit_window(unit_window(MIG_1, T0, [(UID_1, 0.0)], parent=GPU_C), pods, CONFIG)) == {UID_1}
    legacy_device = device(MIG_2, parent=GPU_B, gi=9, ci=0)
    rows = unit_window(MIG_2, T0, [(UID_2, 0.0)], parent=GPU_B)
    assert set(classify_unit_window(rows, pods, CONFIG, legacy_device)) == {UID_2}
    assert classify_unit_window(rows, pods, CONFIG, None) == {}  # the legacy form needs the instance ids


def test_an_idle_run_accumulates_covered_time_and_costs_and_a_busy_window_ends_it():
    rows = {w: unit_window(GPU_A, T0 + w * 60_000, [(UID_1, 0.02)], covered_seconds=50.0 + w)[0] for w in range(4)}
    costs = {T0 - 60_000: 999, T0: 100}
    run = advance_idle_run(None, IDLE, rows[0], T0 + 70_000, costs)
    assert (run.since_unix_ms, run.idle_seconds, run.wasted_cost_micro_usd, run.windows) == (T0, 50.0, 100, 1)
    run = advance_idle_run(run, UNKNOWN, rows[1], T0 + 130_000, {})
    assert (run.idle_seconds, run.windows, run.last_window_start_unix_ms) == (50.0, 1, T0 + 60_000)
    assert advance_idle_run(run, IDLE, rows[1], T0 + 131_000, {}) is run  # a redelivered window
    run = advance_idle_run(run, IDLE, rows[2], T0 + 190_000, {})
    assert run.idle_seconds == 50.0 + 52.0 and run.windows == 2
    assert run.compute_percent_avg == pytest.approx(2.0)
    assert advance_idle_run(run, BUSY, rows[3], T0 + 250_000, {}) is None


def test_idle_allocation_fires_once_the_run_is_long_enough_with_the_money_wasted():
    pods = pods_of(owner_of(GPU_A))
    config = GuardConfig(idle_for_seconds=120)
    run = advance_idle_run(None, IDLE, unit_window(GPU_A, T0, [(UID_1, 0.0)], covered_seconds=60.0)[0], T0, {T0: 7})
    assert idle_allocation(run, pods[UID_1], config) == ()
    second = unit_window(GPU_A, T0 + 60_000, [(UID_1, 0.0)], covered_seconds=60.0)[0]
    run = advance_idle_run(run, IDLE, second, T0 + 60_000, {})
    (c,) = idle_allocation(run, pods[UID_1], config)
    assert (c.rule, c.severity, c.gpu_uuid, c.pod_uid) == ("idle_allocation", Severity.WARNING, GPU_A, UID_1)
    assert c.evidence["idle_seconds"] == 120.0 and c.evidence["wasted_cost_micro_usd"] == 7
    assert c.evidence["idle_since_unix_ms"] == T0
    assert idle_allocation(run, None, config) == ()


# ----------------------------------------------------------------------------------------------------------------
# budget_exceeded


def _ms(text: str) -> int:
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


@pytest.mark.parametrize("t, period, start, end", [
    ("2026-07-31T23:59:59Z", "day", "2026-07-31T00:00:00Z", "2026-08-01T00:00:00Z"),
    ("2026-07-31T23:59:59Z", "month", "2026-07-01T00:00:00Z", "2026-08-01T00:00:00Z"),
    ("2028-02-29T12:00:00Z", "month", "2028-02-01T00:00:00Z", "2028-03-01T00:00:00Z"),
    ("2026-12-31T00:00:00Z", "month", "2026-12-01T00:00:00Z", "2027-01-01T00:00:00Z"),
])
def test_budget_periods_are_utc_days_and_calendar_months(t, period, start, end):
    assert period_bounds(period, _ms(t)) == (_ms(start), _ms(end))


def test_every_instant_of_a_day_gets_the_bounds_of_its_own_day_and_month():
    """The bounds are kept per (period, UTC day): the last and first milliseconds around midnights, month ends and
    a leap day get their own day's bounds however the kept ones were filled."""
    for edge in ("2026-07-31T00:00:00Z", "2026-08-01T00:00:00Z", "2028-02-29T00:00:00Z", "2028-03-01T00:00:00Z",
                 "2027-01-01T00:00:00Z", "1970-01-02T00:00:00Z"):
        for t in (_ms(edge) - 1, _ms(edge), _ms(edge) + 1, _ms(edge) - 1):
            moment = datetime.fromtimestamp(t / 1000, tz=timezone.utc)
            day = datetime(moment.year, moment.month, moment.day, tzinfo=timezone.utc)
            month = datetime(moment.year, moment.month, 1, tzinfo=timezone.utc)
            next_month = datetime(moment.year + moment.month // 12, moment.month % 12 + 1, 1, tzinfo=timezone.utc)
            assert period_bounds("day", t) == (int(day.timestamp()) * 1000, int(day.timestamp()) * 1000 + 86_400_000)
            assert period_bounds("month", t) == (int(month.timestamp()) * 1000, int(next_month.timestamp()) * 1000)
    with pytest.raises(ValueError):
        period_bounds("week", _ms("2026-07-31T00:00:00Z"))


def _spend(spent, budget, period="day", now="2026-07-31T12:00:00Z"):
    start, end = period_bounds(period, _ms(now))
    return BudgetSpend(CLUSTER, "namespace", "ml", period, start, end, spent, budget), _ms(now)


def test_spend_above_the_budget_is_critical_and_a_forecast_above_it_warns_first():
    spend, now = _spend(600_001, 600_000)
    (c,) = budget_exceeded(spend, now, CONFIG)
    assert (c.severity, c.namespace, c.team, c.qualifier) == (Severity.CRITICAL, "ml", None, "day")
    assert c.evidence["spent_micro_usd"] == 600_001 and c.evidence["forecast_flag"] == 0
    # At the budget is not past it (but at midday it is on course to double it).
    assert [c.severity for c in budget_exceeded(_spend(600_000, 600_000)[0], now, CONFIG)] == [Severity.WARNING]
    # Half the day gone and 300_001 spent: the linear forecast is 600_002.
    spend, now = _spend(300_001, 600_000)
    (c,) = budget_exceeded(spend, now, CONFIG)
    assert c.severity is Severity.WARNING and c.evidence["forecast_micro_usd"] == pytest.approx(600_002)
    assert c.evidence["period_elapsed_fraction"] == pytest.approx(0.5)
    assert budget_exceeded(_spend(299_999, 600_000)[0], now, CONFIG) == ()
    config = GuardConfig(budget_forecast_warning_fraction=0.5)
    assert budget_exceeded(_spend(150_001, 600_000)[0], now, config)[0].severity is Severity.WARNING


def test_no_forecast_from_the_first_minutes_of_a_period():
    config = GuardConfig(budget_forecast_min_elapsed_fraction=0.05)
    early_ms = int(0.04 * 86_400_000)
    start = _ms("2026-07-31T00:00:00Z")
    spend = BudgetSpend(CLUSTER, "team", "research", "day", start, start + 86_400_000, 100, 1_000)
    assert budget_exceeded(spend, start + early_ms, config) == ()  # forecast 2500 > 1000, but too early
    late = start + int(0.06 * 86_400_000)
    (c,) = budget_exceeded(spend, late, config)
    assert (c.team, c.namespace, c.severity) == ("research", None, Severity.WARNING)


def test_day_and_month_budgets_of_one_subject_are_different_violations():
    day = budget_exceeded(_spend(2, 1, "day")[0], _spend(2, 1)[1], CONFIG)[0]
    month = budget_exceeded(_spend(2, 1, "month")[0], _spend(2, 1)[1], CONFIG)[0]
    assert day.fingerprint != month.fingerprint


def test_costs_count_towards_namespace_and_team_for_pod_lines_only():
    config = GuardConfig(team_label_key="squad", namespace_budgets={"*": Budget(day_micro_usd=5)})
    assert cost_subject("ml", {"squad": "vision", "team": "x"}, CostSubjectKind.POD, config) == ("ml", "vision")
    assert cost_subject(None, {}, CostSubjectKind.IDLE, config) == (None, None)
    assert config.namespace_budget("anything") == Budget(day_micro_usd=5)


def test_share_row_kinds_are_not_pods():
    # Bucket rows never get verdicts, even when their compute is low.
    pods = pods_of(owner_of(GPU_A))
    rows = unit_window(GPU_A, T0, [(UID_1, 0.5)])
    assert all(r.subject_kind is not ShareSubjectKind.POD for r in rows[1:])
    assert set(classify_unit_window(rows, pods, CONFIG)) == {UID_1}


def test_conditions_carry_units_in_their_evidence_keys():
    pods = pods_of(owner_of(GPU_A), leaker(env="all"))
    s = sample([device(GPU_A, processes=[proc(1, 1, GIB)])], [UID_1, UID_2])
    allowed_suffixes = ("_bytes", "_count", "_flag", "_seconds", "_percent", "_micro_usd", "_unix_ms",
                        "_fraction", "_percent_avg", "_samples")
    for c in visibility_leak(s, pods, CONFIG) + unrequested_gpu_use(s, pods, CONFIG):
        assert all(key.endswith(allowed_suffixes) for key in c.evidence), c.evidence
        json.dumps(dict(c.evidence))  # JSON-able numbers


def test_a_pod_subject_carries_its_team_label_for_routing_but_not_in_its_fingerprint():
    s = sample([device(GPU_A, processes=[proc(11, 1, 3 * GIB)])], [UID_1, UID_2])
    labelled = dict(labels={"team": "vision", "squad": "eyes"})
    (unlabelled_leak,) = [c for c in visibility_leak(s, pods_of(owner_of(GPU_A), leaker(env=None)), CONFIG)]
    (leak,) = [c for c in visibility_leak(s, pods_of(owner_of(GPU_A), leaker(env=None, **labelled)), CONFIG)]
    assert (unlabelled_leak.team, leak.team) == (None, "vision")
    assert leak.fingerprint == unlabelled_leak.fingerprint == fingerprint_of(
        "visibility_leak", CLUSTER, NODE, GPU_A, "scratch", "leaker", UID_2)
    # The label key comes from the config.
    (squad_leak,) = visibility_leak(s, pods_of(owner_of(GPU_A), leaker(env=None, **labelled)),
                                    GuardConfig(team_label_key="squad"))
    assert squad_leak.team == "eyes" and squad_leak.fingerprint == leak.fingerprint
    # A team subject's team is its identity.
    assert fingerprint_of("budget_exceeded", CLUSTER, team="vision") != fingerprint_of(
        "budget_exceeded", CLUSTER, team="speech")


def test_where_the_toolkit_ignores_the_variable_only_privileged_specs_leak_and_use_still_shows():
    """Hardened nodes (accept-nvidia-visible-devices-envvar-when-unprivileged=false, volume-mounts or CDI device
    lists): NVIDIA_VISIBLE_DEVICES=all opens no GPU, so it is no spec leak; privileged still is, and a process on a
    unit the pod was not given is a leak whatever path got it there."""
    hardened = dataclasses.replace(CONFIG, visible_devices_envvar_honoured=False)
    for env in ("all", "<valueFrom>", GPU_B):
        assert visibility_leak_spec(apply_pod_event(None, leaker(env=env)), (), hardened) == ()
        assert visibility_leak_spec(apply_pod_event(None, leaker(env=env)), (), CONFIG) != ()
    (c,) = visibility_leak_spec(apply_pod_event(None, leaker(env="all", privileged=True)), (), hardened)
    assert c.evidence["privileged_containers_count"] == 1 and c.evidence["visible_devices_all_containers_count"] == 0
    user = pod_event(UID_1, "user", containers=[container(env="all")])
    s = sample([device(GPU_A, processes=[proc(1, 0, GIB)])], [UID_1])
    (leak,) = [c for c in visibility_leak(s, pods_of(user), hardened) if c.gpu_uuid is not None]
    assert (leak.pod_uid, leak.gpu_uuid) == (UID_1, GPU_A)
