"""The guard's state machine: firing, refresh cadence, hold-down, flapping, refire, suppression, dedup, every
stateful rule through the engine, and snapshot/restore."""

from __future__ import annotations

import json

import pytest

from gpumeter.errors import InvalidMessage, OutOfRange
from schemas.records import CostSubjectKind, NodeWindowCost, PodEventType, Severity, ViolationState
from services.guard.config import Budget, GuardConfig
from services.guard.engine import GuardEngine
from services.guard.replay import replay_violations
from services.guard.rules import fingerprint_of, period_bounds
from tests.unit.guard import (
    CLUSTER,
    GIB,
    GPU_A,
    GPU_B,
    NODE,
    T0,
    UID_1,
    UID_2,
    container,
    cost,
    device,
    nvml_error,
    pod_event,
    proc,
    sample,
    unit_window,
)

S = 1000
FAST = GuardConfig(hold_down_seconds=30, refresh_seconds=60, stale_node_intervals=3, stale_node_min_seconds=0,
                   idle_for_seconds=120)


def owner():
    return pod_event(UID_1, "owner-0", containers=[container(devices=[("nvidia.com/gpu", [GPU_A])])])


def quiet_leaker(**kwargs):
    # No NVIDIA_VISIBLE_DEVICES in its spec (the image sets it): only its processes give it away.
    return pod_event(UID_2, "leaker", namespace="scratch", containers=[container()], **kwargs)


def leak_sample(t, leaking=True):
    processes = [proc(1, 0, 10 * GIB)] + ([proc(2, 1, 2 * GIB)] if leaking else [])
    return sample([device(GPU_A, processes=processes)], [UID_1, UID_2], t=t)


def leak_fp():
    return fingerprint_of("visibility_leak", CLUSTER, NODE, GPU_A, "scratch", "leaker", UID_2)


def started(config=FAST):
    engine = GuardEngine(config)
    assert engine.on_pod_event(owner(), T0) == ()
    assert engine.on_pod_event(quiet_leaker(), T0) == ()
    return engine


def only(records, rule="visibility_leak"):
    return [r for r in records if r.rule == rule]


# ----------------------------------------------------------------------------------------------------------------
# The state machine


def test_a_condition_fires_once_refreshes_at_the_cadence_and_resolves_after_the_hold_down():
    engine = started()
    (fired,) = only(engine.on_sample(leak_sample(T0), T0))
    assert fired.state is ViolationState.FIRING and fired.fingerprint == leak_fp()
    assert (fired.first_seen_unix_ms, fired.last_seen_unix_ms, fired.resolved_at_unix_ms) == (T0, T0, None)
    for t in range(10, 60, 10):
        assert only(engine.on_sample(leak_sample(T0 + t * S), T0 + t * S)) == []
    (refresh,) = only(engine.on_sample(leak_sample(T0 + 60 * S), T0 + 60 * S))
    assert refresh.state is ViolationState.FIRING and refresh.fingerprint == fired.fingerprint
    assert (refresh.first_seen_unix_ms, refresh.last_seen_unix_ms) == (T0, T0 + 60 * S)
    assert only(engine.on_sample(leak_sample(T0 + 70 * S), T0 + 70 * S)) == []
    # Gone from t=80: nothing until the hold-down has passed, then one RESOLVED record.
    for t in (80, 90, 100):
        assert only(engine.on_sample(leak_sample(T0 + t * S, leaking=False), T0 + t * S)) == []
        assert leak_fp() in {v.fingerprint for v in engine.active()}
    assert only(engine.on_clock(T0 + 109 * S)) == []
    (resolved,) = only(engine.on_clock(T0 + 110 * S))
    assert resolved.state is ViolationState.RESOLVED and resolved.fingerprint == fired.fingerprint
    assert (resolved.first_seen_unix_ms, resolved.last_seen_unix_ms, resolved.resolved_at_unix_ms) == (
        T0, T0 + 70 * S, T0 + 110 * S)
    assert leak_fp() not in {v.fingerprint for v in engine.active()}


def test_flapping_inside_the_hold_down_neither_resolves_nor_refires():
    engine = started()
    assert len(only(engine.on_sample(leak_sample(T0), T0))) == 1
    pattern = [False, True, False, False, True, False]  # never clear for 30 s in a row
    for i, leaking in enumerate(pattern, start=1):
        t = T0 + i * 10 * S
        assert only(engine.on_sample(leak_sample(t, leaking), t)) == [], i
    (active,) = only(engine.active())
    assert (active.first_seen_unix_ms, active.last_seen_unix_ms) == (T0, T0 + 50 * S)
    # Clear since t=60: resolves at t=90, not before.
    assert only(engine.on_clock(T0 + 89 * S)) == []
    (resolved,) = only(engine.on_clock(T0 + 90 * S))
    assert resolved.state is ViolationState.RESOLVED and resolved.last_seen_unix_ms == T0 + 50 * S


def test_a_resolved_violation_that_comes_back_is_a_new_firing_with_the_same_fingerprint():
    engine = started()
    engine.on_sample(leak_sample(T0), T0)
    engine.on_sample(leak_sample(T0 + 10 * S, leaking=False), T0 + 10 * S)
    (resolved,) = only(engine.on_clock(T0 + 40 * S))
    (again,) = only(engine.on_sample(leak_sample(T0 + 50 * S), T0 + 50 * S))
    assert again.fingerprint == resolved.fingerprint and again.state is ViolationState.FIRING
    assert (again.first_seen_unix_ms, again.resolved_at_unix_ms) == (T0 + 50 * S, None)


def test_refire_suppression_holds_a_comeback_back_until_it_has_passed():
    engine = started(GuardConfig(hold_down_seconds=0, refresh_seconds=60, refire_suppression_seconds=100))
    engine.on_sample(leak_sample(T0), T0)
    (resolved,) = only(engine.on_sample(leak_sample(T0 + 10 * S, leaking=False), T0 + 10 * S))
    assert resolved.resolved_at_unix_ms == T0 + 10 * S
    assert only(engine.on_sample(leak_sample(T0 + 50 * S), T0 + 50 * S)) == []
    assert only(engine.active()) == []
    assert only(engine.on_clock(T0 + 109 * S)) == []
    (fired,) = only(engine.on_clock(T0 + 110 * S))
    assert fired.state is ViolationState.FIRING and fired.first_seen_unix_ms == T0 + 50 * S
    # A comeback that goes away again during the suppression is never published.
    (resolved,) = only(engine.on_sample(leak_sample(T0 + 120 * S, leaking=False), T0 + 120 * S))
    assert resolved.state is ViolationState.RESOLVED
    engine.on_sample(leak_sample(T0 + 130 * S), T0 + 130 * S)
    assert only(engine.on_sample(leak_sample(T0 + 140 * S, leaking=False), T0 + 140 * S)) == []
    assert only(engine.on_clock(T0 + 300 * S)) == []


def test_a_severity_change_is_published_at_once_under_the_same_fingerprint():
    engine = GuardEngine(FAST)
    power = nvml_error("nvmlDeviceGetPowerUsage", "NOT_SUPPORTED")
    lost = nvml_error("nvmlDeviceGetMemoryInfo", "GPU_IS_LOST")
    assert engine.on_sample(sample([device(GPU_A, errors=[power])], t=T0), T0) == ()
    (warning,) = engine.on_sample(sample([device(GPU_A, errors=[power])], t=T0 + 10 * S), T0 + 10 * S)
    assert (warning.rule, warning.severity) == ("gpu_error", Severity.WARNING)
    (critical,) = engine.on_sample(sample([device(GPU_A, errors=[lost])], t=T0 + 20 * S), T0 + 20 * S)
    assert critical.severity is Severity.CRITICAL and critical.fingerprint == warning.fingerprint
    assert critical.first_seen_unix_ms == warning.first_seen_unix_ms == T0 + 10 * S


def test_a_lost_gpu_that_comes_back_resolves_after_the_hold_down():
    # The simulator's GPU loss is permanent (as without a reboot); a reboot that brings the GPU back, by hand.
    engine = GuardEngine(FAST)
    lost = nvml_error("nvmlDeviceGetHandleByIndex", "GPU_IS_LOST")
    (fired,) = engine.on_sample(sample([device(GPU_A, errors=[lost], utilization=None)], t=T0), T0)
    assert (fired.severity, fired.evidence["gpu_lost_flag"]) == (Severity.CRITICAL, 1.0)
    assert engine.on_sample(sample([device(GPU_A)], t=T0 + 10 * S), T0 + 10 * S) == ()
    assert engine.on_sample(sample([device(GPU_A)], t=T0 + 20 * S), T0 + 20 * S) == ()
    (resolved,) = engine.on_sample(sample([device(GPU_A)], t=T0 + 40 * S), T0 + 40 * S)
    assert (resolved.fingerprint, resolved.state) == (fired.fingerprint, ViolationState.RESOLVED)
    assert (resolved.last_seen_unix_ms, resolved.resolved_at_unix_ms) == (T0, T0 + 40 * S)


def test_the_same_condition_from_pod_events_and_samples_is_one_violation():
    engine = GuardEngine(FAST)
    loud = pod_event(UID_2, "loud", namespace="scratch", containers=[container(env="all")])
    (fired,) = engine.on_pod_event(loud, T0)
    assert fired.rule == "visibility_leak" and fired.gpu_uuid is None
    for t in range(10, 50, 10):
        assert engine.on_sample(sample([device(GPU_A)], t=T0 + t * S), T0 + t * S) == ()
    assert len(engine.active()) == 1
    # The deletion retracts the pod scope; the node's next sample retracts the sample scope: clear from then.
    gone = pod_event(UID_2, "loud", namespace="scratch", containers=[container(env="all")],
                     event_type=PodEventType.DELETED, t=T0 + 55 * S)
    assert engine.on_pod_event(gone, T0 + 55 * S) == ()
    assert engine.on_sample(sample([device(GPU_A)], t=T0 + 60 * S), T0 + 60 * S) == ()
    assert engine.on_clock(T0 + 89 * S) == ()
    (resolved,) = engine.on_clock(T0 + 90 * S)
    assert resolved.fingerprint == fired.fingerprint and resolved.state is ViolationState.RESOLVED


def test_a_redelivered_older_sample_changes_nothing():
    engine = started()
    engine.on_sample(leak_sample(T0 + 10 * S, leaking=False), T0 + 10 * S)
    assert engine.on_sample(leak_sample(T0), T0 + 11 * S) == ()
    assert engine.old_samples_ignored == 1 and engine.active() == ()


def test_active_lists_the_most_severe_first():
    engine = started()
    engine.on_sample(leak_sample(T0), T0)
    assert [(v.severity, v.rule) for v in engine.active()] == [
        (Severity.CRITICAL, "visibility_leak"), (Severity.WARNING, "unrequested_gpu_use")]


# ----------------------------------------------------------------------------------------------------------------
# stale_node


def test_a_silent_node_goes_stale_on_the_clock_and_resolves_when_it_is_heard_again():
    engine = GuardEngine(FAST)
    engine.on_sample(sample([device(GPU_A)], t=T0), T0)
    assert engine.on_clock(T0 + 30 * S) == ()
    (stale,) = engine.on_clock(T0 + 31 * S)
    assert (stale.rule, stale.node_name, stale.severity) == ("stale_node", NODE, Severity.WARNING)
    assert stale.evidence["silent_seconds"] == 31.0
    assert engine.on_sample(sample([device(GPU_A)], t=T0 + 50 * S), T0 + 50 * S) == ()
    assert engine.on_clock(T0 + 79 * S) == ()
    (resolved,) = engine.on_clock(T0 + 80 * S)
    assert resolved.fingerprint == stale.fingerprint and resolved.state is ViolationState.RESOLVED
    # The end of a finite input is not silence.
    assert engine.on_clock(T0 + 500 * S, detect_stale=False) == ()


def test_a_node_silent_past_the_forget_time_is_forgotten_and_its_violations_resolve():
    config = GuardConfig(hold_down_seconds=0, stale_node_intervals=1, stale_node_min_seconds=0,
                         stale_node_forget_seconds=100)
    engine = GuardEngine(config)
    engine.on_pod_event(owner(), T0)
    engine.on_pod_event(quiet_leaker(), T0)
    assert {v.rule for v in engine.on_sample(leak_sample(T0), T0)} == {"visibility_leak", "unrequested_gpu_use"}
    (stale,) = engine.on_clock(T0 + 20 * S)
    forgotten = engine.on_clock(T0 + 101 * S)
    assert {(v.rule, v.state) for v in forgotten} == {
        ("stale_node", ViolationState.RESOLVED), ("visibility_leak", ViolationState.RESOLVED),
        ("unrequested_gpu_use", ViolationState.RESOLVED)}
    assert engine.active() == ()


# ----------------------------------------------------------------------------------------------------------------
# idle_allocation through shares and costs


def _feed(engine, rows, t):
    out = []
    for row in rows:
        out.extend(engine.on_share(row, t))
    return out


def test_idle_allocation_fires_with_the_money_wasted_and_resolves_when_the_pod_gets_busy():
    engine = GuardEngine(FAST)
    engine.on_pod_event(owner(), T0)
    w = [T0 + i * 60 * S for i in range(4)]
    # The cost of the first window arrives before its shares; the second's after.
    assert engine.on_cost(cost(GPU_A, window_start=w[0], micro_usd=100, pod_uid=UID_1, namespace="default"),
                          w[1] + 5 * S) == ()
    rows0 = unit_window(GPU_A, w[0], [(UID_1, 0.01)])
    assert _feed(engine, rows0[:-1], w[1] + 10 * S) == []  # incomplete: no verdict yet
    assert _feed(engine, rows0[-1:], w[1] + 10 * S) == []  # 60 s idle: not long enough
    (fired,) = _feed(engine, unit_window(GPU_A, w[1], [(UID_1, 0.03)]), w[2] + 10 * S)
    assert (fired.rule, fired.pod_uid, fired.gpu_uuid) == ("idle_allocation", UID_1, GPU_A)
    assert fired.evidence["idle_seconds"] == 120.0 and fired.evidence["wasted_cost_micro_usd"] == 100
    assert fired.evidence["compute_percent_avg"] == pytest.approx(2.0)
    assert engine.on_cost(cost(GPU_A, window_start=w[1], micro_usd=250, pod_uid=UID_1, namespace="default"),
                          w[2] + 11 * S) == ()  # evidence only: the refresh is not due
    (active,) = engine.active()
    assert active.evidence["wasted_cost_micro_usd"] == 350
    # A redelivered window changes nothing.
    assert _feed(engine, unit_window(GPU_A, w[1], [(UID_1, 0.03)]), w[2] + 12 * S) == []
    assert engine.duplicate_shares_ignored == 5  # each row of the redelivered unit: 1 pod + 4 buckets
    assert _feed(engine, unit_window(GPU_A, w[2], [(UID_1, 0.6)]), w[3] + 10 * S) == []
    (resolved,) = engine.on_clock(w[3] + 40 * S)
    assert resolved.state is ViolationState.RESOLVED and resolved.evidence["wasted_cost_micro_usd"] == 350


def test_the_nodes_role_counts_bills_into_idle_runs_and_keeps_only_costs_read_before_their_shares():
    """The ``nodes`` role's engine (no budgets) over bills: a cost read before its unit's shares is kept until a
    run starting at its window counts it; one read after them goes straight into the run; a redelivered bill adds
    nothing; nothing is kept of a window the unit's shares have passed."""
    engine = GuardEngine(FAST, budgets=False)
    engine.on_pod_event(owner(), T0)
    w = [T0 + i * 60 * S for i in range(4)]

    def bill_of(window, micro_usd):
        return _bill([cost(GPU_A, window_start=window, micro_usd=micro_usd, pod_uid=UID_1, namespace="default"),
                      cost(None, window_start=window, micro_usd=7, kind=CostSubjectKind.NODE_OTHER)])

    def early():
        return [(uid, window, micro_usd) for _, _, _, uid, window, micro_usd
                in json.loads(engine.snapshot())["early_costs"]]

    assert engine.on_window_cost(bill_of(w[0], 100), w[1] + 5 * S) == ()
    assert engine.on_window_cost(bill_of(w[0], 100), w[1] + 6 * S) == ()  # redelivered
    assert early() == [(UID_1, w[0], 100)] and engine.redelivered_bills_ignored == 1
    assert _feed(engine, unit_window(GPU_A, w[0], [(UID_1, 0.01)]), w[1] + 10 * S) == []
    assert early() == []  # counted by the run that starts at its window
    (fired,) = _feed(engine, unit_window(GPU_A, w[1], [(UID_1, 0.03)]), w[2] + 10 * S)
    assert fired.evidence["wasted_cost_micro_usd"] == 100
    assert engine.on_window_cost(bill_of(w[1], 250), w[2] + 11 * S) == ()
    assert engine.on_window_cost(bill_of(w[1], 250), w[2] + 12 * S) == ()  # redelivered
    (active,) = engine.active()
    assert active.evidence["wasted_cost_micro_usd"] == 350 and early() == []
    state = json.loads(engine.snapshot())
    assert state["line_costs"] == [] and state["bills"] == [[CLUSTER, NODE, [w[0], w[1]]]]
    assert state["spend"] == []


def test_unknown_compute_does_not_end_an_idle_run_and_a_pod_that_lets_go_does():
    engine = GuardEngine(GuardConfig(hold_down_seconds=0, idle_for_seconds=120))
    engine.on_pod_event(owner(), T0)
    w = [T0 + i * 60 * S for i in range(5)]
    _feed(engine, unit_window(GPU_A, w[0], [(UID_1, 0.0)]), w[1])
    assert _feed(engine, unit_window(GPU_A, w[1], [(UID_1, 0.0)], unattributed_compute=1.0), w[2]) == []
    (fired,) = _feed(engine, unit_window(GPU_A, w[2], [(UID_1, 0.0)]), w[3])
    assert fired.evidence["idle_seconds"] == 120.0 and fired.evidence["windows_count"] == 2
    (resolved,) = _feed(engine, unit_window(GPU_A, w[3], []), w[4])  # no row for the pod: it let go
    assert resolved.state is ViolationState.RESOLVED


def test_an_idle_run_without_news_expires():
    engine = GuardEngine(GuardConfig(hold_down_seconds=0, idle_for_seconds=60, idle_evidence_max_age_seconds=300))
    engine.on_pod_event(owner(), T0)
    (fired,) = _feed(engine, unit_window(GPU_A, T0, [(UID_1, 0.0)]), T0 + 70 * S)
    assert engine.on_clock(T0 + 370 * S) == ()
    (resolved,) = engine.on_clock(T0 + 371 * S)
    assert resolved.fingerprint == fired.fingerprint


# ----------------------------------------------------------------------------------------------------------------
# budget_exceeded through costs


DAY = period_bounds("day", T0)


def _budget_config(**kwargs):
    return GuardConfig(hold_down_seconds=30, budget_forecast_min_elapsed_fraction=1.0,
                       namespace_budgets={"ml": Budget(day_micro_usd=1_000)},
                       team_budgets={"*": Budget(month_micro_usd=1_500)}, **kwargs)


def _budget_engine(**kwargs):
    return GuardEngine(_budget_config(**kwargs))


def test_a_namespace_over_its_day_budget_fires_and_a_new_day_resolves_it():
    engine = _budget_engine()
    t = DAY[1] - 120 * S  # two minutes before midnight
    line = cost(GPU_A, window_start=t - 60 * S, micro_usd=600, pod_uid=UID_1, namespace="ml", team="vision")
    assert engine.on_cost(line, t) == ()
    assert engine.on_cost(line, t + 1) == ()  # redelivered: replaces itself, 600 in total
    second = cost(GPU_B, window_start=t - 60 * S, micro_usd=401, pod_uid=UID_1, namespace="ml", team="vision")
    (fired,) = engine.on_cost(second, t + 2)
    assert (fired.rule, fired.namespace, fired.team, fired.severity) == ("budget_exceeded", "ml", None,
                                                                         Severity.CRITICAL)
    assert fired.evidence["spent_micro_usd"] == 1_001 and fired.evidence["budget_micro_usd"] == 1_000
    assert engine.on_clock(DAY[1] - 1) == ()
    assert engine.on_clock(DAY[1]) == ()  # a new day: clear, hold-down starts
    (resolved,) = engine.on_clock(DAY[1] + 30 * S)
    assert resolved.fingerprint == fired.fingerprint and resolved.state is ViolationState.RESOLVED


def test_team_budgets_use_the_team_label_and_the_default_entry():
    engine = _budget_engine()
    t = DAY[0] + 3_600 * S
    engine.on_cost(cost(GPU_A, window_start=t, micro_usd=900, pod_uid=UID_1, namespace="a", team="vision"), t)
    (fired,) = engine.on_cost(cost(GPU_B, window_start=t, micro_usd=601, pod_uid=UID_2, namespace="b",
                                   team="vision"), t)
    assert (fired.team, fired.namespace) == ("vision", None)
    assert fired.evidence["spent_micro_usd"] == 1_501


def test_bucket_lines_and_lines_older_than_the_dedup_horizon_do_not_count():
    engine = _budget_engine(cost_dedup_horizon_seconds=3_600)
    t = DAY[0] + 6 * 3_600 * S
    engine.on_cost(cost(GPU_A, window_start=t, micro_usd=10, pod_uid=UID_1, namespace="ml"), t)
    late = cost(GPU_A, window_start=t - 3_601 * S, micro_usd=5_000, pod_uid=UID_1, namespace="ml")
    assert engine.on_cost(late, t) == () and engine.late_costs_ignored == 1
    idle = cost(GPU_A, window_start=t, micro_usd=5_000, kind=CostSubjectKind.IDLE)
    assert engine.on_cost(idle, t) == ()
    fine = cost(GPU_B, window_start=t, micro_usd=990, pod_uid=UID_1, namespace="ml")
    assert engine.on_cost(fine, t) == ()  # 1000 in total: at the budget, not past it
    assert engine.on_cost(cost(GPU_B, window_start=t, micro_usd=991, pod_uid=UID_1, namespace="ml"), t)


def test_a_cost_line_no_calendar_can_place_is_bad_input():
    engine = _budget_engine()
    for window in (-60_000, 2**62):
        with pytest.raises(OutOfRange):
            engine.on_cost(cost(GPU_A, window_start=window, micro_usd=1, pod_uid=UID_1, namespace="ml"), T0)


def _bill(lines):
    return NodeWindowCost.from_cost_records(
        lines, billed_milliseconds=60_000, cloud_provider="aws", region="us-east-1", zone="us-east-1a",
        provider_id="", price_per_hour_usd="1.0", split_rule="memory", gpu_count=2,
        gpu_cost_micro_usd=sum(line.cost_micro_usd for line in lines), sharing="time-slicing")


def test_a_bill_taken_whole_is_its_lines_taken_one_by_one():
    """``on_window_cost`` against ``on_cost`` over the bill's ``cost_records()``: the same violations in the same
    order and the same state, through an idle run's wasted cost, a budget crossed in the middle of a bill, a
    redelivered bill, a bill older than the dedup horizon and bucket lines."""
    config = GuardConfig(hold_down_seconds=30, refresh_seconds=60, idle_for_seconds=120,
                         budget_forecast_min_elapsed_fraction=1.0, cost_dedup_horizon_seconds=3_600,
                         namespace_budgets={"ml": Budget(day_micro_usd=2_000)},
                         team_budgets={"*": Budget(month_micro_usd=2_500)})
    events = [e for e in _timeline() if e[0] != "cost"]
    for k in range(3):
        w = T0 + k * 60 * S
        lines = [cost(GPU_A, window_start=w, micro_usd=700, pod_uid=UID_1, namespace="ml", team="vision"),
                 cost(GPU_A, window_start=w, micro_usd=50, kind=CostSubjectKind.IDLE),
                 cost(GPU_B, window_start=w, micro_usd=300 + k, pod_uid=UID_2, namespace="scratch", team="vision"),
                 cost(None, window_start=w, micro_usd=20, kind=CostSubjectKind.NODE_OTHER)]
        events.append(("bill", _bill(lines), w + 71 * S))
    events.append(("bill", events[-1][1], T0 + 200 * S))  # redelivered
    old = T0 - 2 * 3_600 * S
    events.append(("bill", _bill([cost(GPU_A, window_start=old, micro_usd=9_000, pod_uid=UID_1, namespace="ml")]),
                   T0 + 201 * S))
    events.sort(key=lambda e: e[2])

    def run(whole: bool):
        engine = GuardEngine(config)
        out, states = [], []
        for kind, record, t in events:
            if kind == "bill" and whole:
                out.extend(engine.on_window_cost(record, t))
            elif kind == "bill":
                out.extend(v for line in record.cost_records() for v in engine.on_cost(line, t))
            else:
                out.extend(_run(engine, [(kind, record, t)]))
            states.append(engine.snapshot())
        return out, states, engine

    whole_out, whole_states, whole = run(True)
    lines_out, lines_states, by_line = run(False)
    assert {"idle_allocation", "budget_exceeded"} <= {v.rule for v in whole_out}
    assert sum(v.rule == "budget_exceeded" for v in whole_out) >= 2  # the namespace's day and the team's month
    assert whole.late_costs_ignored == by_line.late_costs_ignored == 1
    assert whole_out == lines_out
    # The same state but for the dedup (the windows of the bills taken whole, a redelivery counted, against the
    # lines taken one by one).
    assert [_without_dedup(s) for s in whole_states] == [_without_dedup(s) for s in lines_states]
    assert json.loads(whole_states[-1])["bills"] and not json.loads(lines_states[-1])["bills"]
    assert json.loads(lines_states[-1])["line_costs"] and not json.loads(whole_states[-1])["line_costs"]
    assert (whole.redelivered_bills_ignored, by_line.redelivered_bills_ignored) == (1, 0)


def _without_dedup(snapshot: bytes) -> dict:
    state = json.loads(snapshot)
    del state["bills"], state["line_costs"], state["counters"]["redelivered_bills_ignored"]
    return state


def _ml_bill(window, pods, micro_usd_each, node=NODE, namespaces=("ml",)):
    """A bill of ``pods`` pod lines on GPU_A (``micro_usd_each`` each), their namespaces taken in turn from
    ``namespaces``, plus a node_other line."""
    lines = [cost(GPU_A, window_start=window, micro_usd=micro_usd_each, pod_uid=f"{UID_1[:-3]}{i:03d}",
                  namespace=namespaces[i % len(namespaces)], node=node) for i in range(pods)]
    lines.append(cost(None, window_start=window, micro_usd=7, kind=CostSubjectKind.NODE_OTHER, node=node))
    return _bill(lines)


def test_a_budgets_engine_keeps_a_bill_s_window_not_its_lines():
    """The budgets role's engine (``idle=False``) keeps of a bill its window: its state, and the checkpoint that
    writes it, grows with the bills, not with their lines."""
    states = {}  # the state but for the spend
    for pods in (8, 64):
        engine = GuardEngine(_budget_config(), idle=False)
        t = DAY[0] + 3_600 * S
        for k in range(30):
            engine.on_window_cost(_ml_bill(t + k * 60 * S, pods, 1, namespaces=("ml", "a", "b")), t + k * 60 * S)
        state = json.loads(engine.snapshot())
        assert state["line_costs"] == state["early_costs"] == []
        assert state["bills"] == [[CLUSTER, NODE, [t + k * 60 * S for k in range(30)]]]
        del state["spend"]  # the sums: 8 or 64 lines' worth
        states[pods] = state
    assert states[64] == states[8]
    # The engine of the all role judges idle allocation: a cost read before its unit's shares is kept.
    engine = GuardEngine(_budget_config())
    engine.on_window_cost(_ml_bill(DAY[0], 8, 1), DAY[0])
    assert len(json.loads(engine.snapshot())["early_costs"]) == 8


@pytest.mark.parametrize("idle", [False, True])
def test_a_node_window_s_spend_counts_once_from_its_first_bill_across_a_restore(idle):
    config = _budget_config()
    t = DAY[0] + 3_600 * S
    engine = GuardEngine(config, idle=idle)
    assert engine.on_window_cost(_ml_bill(t, 6, 100), t) == ()  # 600 of the day's 1000
    restored = GuardEngine.restore(config, engine.snapshot(), idle=idle)
    assert restored.on_window_cost(_ml_bill(t, 6, 100), t + S) == ()  # redelivered: still 600
    assert restored.on_window_cost(_ml_bill(t, 9, 100), t + 2 * S) == ()  # costed again: the first bill stands
    assert restored.redelivered_bills_ignored == 2
    assert restored.on_window_cost(_ml_bill(t + 60 * S, 4, 100), t + 3 * S) == ()  # 1000: at the budget
    (fired,) = restored.on_window_cost(_ml_bill(t + 120 * S, 1, 1), t + 4 * S)
    assert fired.rule == "budget_exceeded" and fired.evidence["spent_micro_usd"] == 1_001


def test_a_version_1_snapshot_keeps_its_bills_deduplicated():
    """A state file written before bills were kept whole holds their pod lines one by one: restored, their windows
    are the bills counted, so a bill redelivered after the upgrade does not count twice."""
    config = _budget_config()
    t = DAY[0] + 3_600 * S
    engine = GuardEngine(config)  # version 1 wrote a cell per pod line, as an engine judging idle allocation does
    engine.on_window_cost(_ml_bill(t, 6, 100, namespaces=("ml", "a")), t)
    state = json.loads(engine.snapshot())
    state["costs"] = [[*cell[:5], cell[5], "ml" if i % 2 == 0 else "a", None]
                      for i, cell in enumerate(state.pop("early_costs"))]  # version 1's cells: one per pod line
    del state["bills"], state["line_costs"], state["counters"]["redelivered_bills_ignored"]
    state["version"] = 1
    old = json.dumps(state).encode()
    for idle in (False, True):
        restored = GuardEngine.restore(config, old, idle=idle)
        assert json.loads(restored.snapshot())["bills"] == json.loads(engine.snapshot())["bills"]
        assert len(json.loads(restored.snapshot())["early_costs"]) == (6 if idle else 0)
        assert restored.on_window_cost(_ml_bill(t, 6, 100, namespaces=("ml", "a")), t + S) == ()
        assert restored.on_window_cost(_ml_bill(t + 60 * S, 7, 100), t + 2 * S) == ()  # ml: 300 + 700
        assert restored.on_window_cost(_ml_bill(t + 120 * S, 1, 1), t + 3 * S)


def test_the_cost_state_of_a_node_no_longer_billed_goes_after_the_horizon():
    config = _budget_config(cost_dedup_horizon_seconds=3_600)
    t = DAY[0] + 3_600 * S
    engine = GuardEngine(config, idle=False)
    engine.on_window_cost(_ml_bill(t, 2, 100, node="gone"), t)
    engine.on_window_cost(_ml_bill(t, 2, 100), t)
    engine.on_window_cost(_ml_bill(t + 3_600 * S, 2, 100), t + 3_600 * S)
    engine.on_clock(t + 3_661 * S, detect_stale=False)  # not caught up: a backlog's nodes are late, not gone
    assert {node for _, node, _ in json.loads(engine.snapshot())["bills"]} == {"gone", NODE}
    engine.on_clock(t + 3_661 * S)
    state = json.loads(engine.snapshot())
    assert [node for _, node, _ in state["bills"]] == [NODE]
    assert [node for _, node, _ in state["cost_window_max"]] == [NODE]
    assert state["bills"] == [[CLUSTER, NODE, [t, t + 3_600 * S]]]


def test_a_bill_no_calendar_can_place_is_refused_before_any_line_counts():
    engine = _budget_engine()
    before = engine.snapshot()
    for window in (-60_000, 2**62):
        bill = _bill([cost(GPU_A, window_start=window, micro_usd=1, pod_uid=UID_1, namespace="ml")])
        with pytest.raises(OutOfRange):
            engine.on_window_cost(bill, T0)
    assert engine.snapshot() == before


# ----------------------------------------------------------------------------------------------------------------
# snapshot / restore


def _timeline():
    """Every kind of input, with every rule firing and most resolving, in time order."""
    events = [("pod", owner(), T0), ("pod", quiet_leaker(), T0),
              ("pod", pod_event(UID_2 + "x", "loud", namespace="scratch", containers=[container(privileged=True)]),
               T0)]
    power = nvml_error("nvmlDeviceGetPowerUsage", "NOT_SUPPORTED")
    for i in range(12):
        t = T0 + i * 10 * S
        devices = [device(GPU_A, processes=[proc(1, 0, 10 * GIB)] + ([proc(2, 1, 2 * GIB)] if i < 6 else [])),
                   device(GPU_B, index=1, errors=[power] if 3 <= i < 7 else [])]
        events.append(("sample", sample(devices, [UID_1, UID_2], t=t), t))
        events.append(("sample", sample([device(GPU_A)], node="other-node", t=t), t))
    for k in range(3):
        w = T0 + k * 60 * S
        for row in unit_window(GPU_A, w, [(UID_1, 0.0 if k < 2 else 0.5)]):
            events.append(("share", row, w + 70 * S))
        events.append(("cost", cost(GPU_A, window_start=w, micro_usd=700, pod_uid=UID_1, namespace="ml"),
                       w + 71 * S))
    events.append(("clock", None, T0 + 400 * S))
    events.sort(key=lambda e: e[2])
    return events


def _run(engine, events):
    out = []
    for kind, record, t in events:
        if kind == "pod":
            out.extend(engine.on_pod_event(record, t))
        elif kind == "sample":
            out.extend(engine.on_sample(record, t))
        elif kind == "share":
            out.extend(engine.on_share(record, t))
        elif kind == "cost":
            out.extend(engine.on_cost(record, t))
        out.extend(engine.on_clock(t))
    return out


def test_a_restored_engine_continues_exactly_as_the_uninterrupted_one():
    config = GuardConfig(hold_down_seconds=30, refresh_seconds=60, idle_for_seconds=120, stale_node_intervals=3,
                         stale_node_min_seconds=0, namespace_budgets={"ml": Budget(day_micro_usd=1_000)},
                         budget_forecast_min_elapsed_fraction=1.0)
    events = _timeline()
    whole = GuardEngine(config)
    all_out = _run(whole, events)
    assert {v.rule for v in all_out} == {"visibility_leak", "unrequested_gpu_use", "gpu_error", "idle_allocation",
                                         "budget_exceeded", "stale_node"}
    for cut in (len(events) // 3, len(events) // 2, len(events) - 3):
        first = GuardEngine(config)
        head = _run(first, events[:cut])
        data = first.snapshot()
        restored = GuardEngine.restore(config, data)
        assert restored.snapshot() == data
        tail = _run(restored, events[cut:])
        assert head + tail == all_out, cut
        assert restored.active() == whole.active()
        assert restored.snapshot() == whole.snapshot()


def test_a_snapshot_is_json_and_garbage_is_refused():
    engine = started()
    engine.on_sample(leak_sample(T0), T0)
    state = json.loads(engine.snapshot())
    assert state["version"] == 2 and len(state["tracked"]) == 2
    for data in (b"not json", b"{}", json.dumps({**state, "version": 99}).encode(), b"[1, 2]"):
        with pytest.raises(InvalidMessage) as info:
            GuardEngine.restore(FAST, data)
        assert info.value.reason_code == "CORRUPT"


# ----------------------------------------------------------------------------------------------------------------
# replay_violations


def test_replay_violations_equals_driving_the_engine_by_hand():
    events = _timeline()
    records = [(t, r) for kind, r, t in events if kind in ("pod", "sample")]
    shares = [(t, r) for kind, r, t in events if kind == "share"]
    costs = [(t, r) for kind, r, t in events if kind == "cost"]
    config = FAST
    got = replay_violations(records, shares, costs, config, end_unix_ms=T0 + 400 * S)
    engine = GuardEngine(config)
    expected = []
    last = None
    merged = sorted([(t, 0 if k == "pod" else 1 if k == "sample" else 2 if k == "share" else 3, i, k, r)
                     for i, (k, r, t) in enumerate(events) if k != "clock"])
    for t, _, _, kind, record in merged:
        if last is None or t > last:
            last = t
            expected.extend(engine.on_clock(t))
        method = {"pod": engine.on_pod_event, "sample": engine.on_sample, "share": engine.on_share,
                  "cost": engine.on_cost}[kind]
        expected.extend(method(record, t))
    expected.extend(engine.on_clock(T0 + 400 * S, detect_stale=False))
    assert got == tuple(expected)
    assert any(v.state is ViolationState.RESOLVED for v in got)
