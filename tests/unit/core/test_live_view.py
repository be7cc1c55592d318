"""The live view of ``gpumeter run`` (``gpumeter.commands.live_view``) and the orchestrator's pure helpers
(``gpumeter.commands.run``).

The realistic inputs are the demo scenario's own: its ticks through the attributor's engine (as ``gpumeter replay``
drives it) and every closed node-window priced by billing's ``bill_node_window`` from the bundled catalog — three
nodes, exclusive, time-sliced and MIG GPUs, teams as labels.
"""

from __future__ import annotations

import asyncio
import math
import re
import signal
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumeter.commands import live_view
from gpumeter.commands.run import plan, supervisor, view
from gpumeter.commands.live_view import (
    BAR_WIDTH_CELLS,
    BUCKET_GROUPS,
    NO_TEAM,
    PERCENT_TENTHS,
    ProcessHealth,
    ProcessState,
    UnitKey,
    UnitWindow,
    ViewState,
    apply_records,
)
from schemas.records import (
    CostSubjectKind,
    DeadLetter,
    PodEvent,
    Severity,
    ShareSubjectKind,
    Violation,
    ViolationState,
)

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "scenarios" / "demo.yaml"


# ----------------------------------------------------------------------------------------------------------------
# The demo scenario through the engine and billing


class Demo:
    def __init__(self) -> None:
        from services.attributor.engine import AttributionEngine, EngineConfig
        from pipeline.recordings import scenario_records
        from services.billing.catalog import bundled_catalog
        from services.billing.costing import bill_node_window
        from simulator.scenario import load_scenario

        self.scenario = load_scenario(DEMO)
        engine = AttributionEngine(EngineConfig(window_seconds=60, grace_seconds=10))
        catalog = self.catalog = bundled_catalog()
        self.windows = []
        self.shares, self.costs, self.bills = [], [], []
        for item in scenario_records(self.scenario):
            message = item.message
            if isinstance(message, PodEvent):
                engine.on_pod_event(message)
                continue
            output = engine.on_sample(message, item.received_at_unix_ms)
            for window in output.windows:
                self.windows.append(window.shares)
                self.shares.extend(window.shares)
                priced = bill_node_window(window.shares, catalog)
                self.costs.extend(priced.costs)
                self.bills.append(priced.bill)
            if output.windows:
                engine.record_emitted(output.windows)
                engine.take_table_changes()

    def costs_with(self, sharing: str) -> tuple[list, list]:
        """The same node-windows billed under the sharing policy ``sharing``: (cost records, bills)."""
        from services.billing.costing import bill_node_window
        from services.billing.pricing import DEFAULT_SPLIT_POLICY
        from services.billing.sharing import SharingPolicy

        priced = [bill_node_window(w, self.catalog, DEFAULT_SPLIT_POLICY, SharingPolicy.parse(sharing))
                  for w in self.windows]
        return [c for p in priced for c in p.costs], [p.bill for p in priced]

    def unit_windows(self) -> dict[tuple[UnitKey, int], list]:
        groups: dict[tuple[UnitKey, int], list] = defaultdict(list)
        for share in self.shares:
            groups[(UnitKey(share.cluster, share.node_name, share.gpu_uuid), share.window_start_unix_ms)].append(share)
        return groups


@pytest.fixture(scope="module")
def demo() -> Demo:
    data = Demo()
    assert data.shares and data.costs and len({b.node_name for b in data.bills}) == 3
    return data


# ----------------------------------------------------------------------------------------------------------------
# Apportioning


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=30),
       st.integers(min_value=0, max_value=2000))
def test_apportioned_parts_add_up_and_stay_within_one_of_their_quota(weights, total):
    parts = live_view.apportion(weights, total)
    weight_sum = math.fsum(weights)
    if weight_sum == 0:
        assert parts == tuple(0 for _ in weights)
        return
    assert sum(parts) == total
    for weight, part in zip(weights, parts):
        quota = weight * total / weight_sum
        assert quota - 1 < part < quota + 1
        if weight == 0:
            assert part == 0


def test_apportion_ignores_nan_and_negative_weights_and_gives_ties_to_the_first():
    assert live_view.apportion([float("nan"), -1.0, 1.0, 1.0, 1.0], 4) == (0, 0, 2, 1, 1)
    with pytest.raises(ValueError):
        live_view.apportion([1.0], -1)


# ----------------------------------------------------------------------------------------------------------------
# Share bars


def test_every_demo_unit_bar_fills_the_width_and_its_percentages_add_to_100(demo):
    groups = demo.unit_windows()
    modes = set()
    for (key, start), rows in groups.items():
        unit = UnitWindow.of(rows)
        segments = live_view.bar_segments(unit)
        assert len(segments) == len(rows) == rows[0].rows_in_unit
        assert sum(s.cells for s in segments) == BAR_WIDTH_CELLS, (key, start)
        assert sum(s.tenths for s in segments) == PERCENT_TENTHS, (key, start)
        total = math.fsum(r.cost_share for r in rows)
        for segment in segments:
            assert abs(segment.cells - segment.share / total * BAR_WIDTH_CELLS) < 1
            assert abs(segment.tenths - segment.share / total * PERCENT_TENTHS) < 1
        kinds = [s.kind for s in segments]
        # Pods first, then idle, driver-reserved, unattributed and unavailable, each bucket exactly once.
        assert kinds[-4:] == [ShareSubjectKind.IDLE, ShareSubjectKind.DRIVER_RESERVED, ShareSubjectKind.UNATTRIBUTED,
                              ShareSubjectKind.UNAVAILABLE]
        assert all(k is ShareSubjectKind.POD for k in kinds[:-4])
        modes.add(rows[0].sharing_mode.value)
    assert {"EXCLUSIVE", "TIME_SLICING", "MIG"} <= modes


def test_a_shared_gpu_bar_shows_each_pod_by_name_in_its_share(demo):
    time_sliced = [UnitWindow.of(rows) for rows in demo.unit_windows().values()
                   if rows[0].sharing_mode.value == "TIME_SLICING" and
                   sum(1 for r in rows if r.subject_kind is ShareSubjectKind.POD) >= 3]
    assert time_sliced, "the demo's L4 has three time-sliced pods"
    unit = time_sliced[-1]
    segments = live_view.bar_segments(unit)
    pods = {s.label: s for s in segments if s.kind is ShareSubjectKind.POD}
    expected = {r.pod_name: r.cost_share for r in unit.rows if r.subject_kind is ShareSubjectKind.POD}
    assert set(pods) == set(expected)
    for name, share in expected.items():
        assert pods[name].share == share


def test_the_newest_complete_window_of_every_unit_is_shown(demo):
    state = apply_records(ViewState.empty(), demo.shares)
    newest: dict[UnitKey, int] = {}
    for key, start in demo.unit_windows():
        newest[key] = max(newest.get(key, start), start)
    assert {k: u.window_start_unix_ms for k, u in state.units.items()} == newest
    assert state.unit_windows_completed == len(demo.unit_windows())
    assert not state.pending
    # Replayed in the opposite order of windows (an old window re-emitted late), the screen does not go back.
    by_window = sorted(demo.shares, key=lambda s: -s.window_start_unix_ms)
    again = apply_records(ViewState.empty(), by_window)
    assert {k: u.window_start_unix_ms for k, u in again.units.items()} == newest


def test_a_unit_window_shows_only_once_all_its_rows_are_in_and_duplicates_count_once(demo):
    groups = demo.unit_windows()
    key, start = next(k for k in sorted(groups) if len(groups[k]) >= 5)  # pods and the four buckets
    rows = groups[(key, start)]
    partial = apply_records(ViewState.empty(), rows[:-1] + rows[:1])  # one row missing, one duplicated
    assert key not in partial.units
    assert len(partial.pending[(key, start)]) == len(rows) - 1
    complete = apply_records(partial, rows[-1:])
    assert complete.units[key].rows == UnitWindow.of(rows).rows
    assert complete.unit_windows_completed == 1
    # The input state is untouched: folding is pure.
    assert key not in partial.units and (key, start) in partial.pending
    # The whole window re-emitted (an attributor restart) changes nothing and is not counted again.
    repeated = apply_records(complete, rows)
    assert repeated.units == complete.units and repeated.unit_windows_completed == 1


def test_unit_order_puts_mig_instances_under_their_gpu(demo):
    state = apply_records(ViewState.empty(), demo.shares)
    units = live_view.unit_windows(state)
    assert [u.key.node_name for u in units] == sorted(u.key.node_name for u in units)
    mig = [u for u in units if u.is_mig_instance]
    assert mig and all("MIG" in u.describe() for u in mig)
    whole = [u for u in units if u.first.sharing_mode.value == "EXCLUSIVE"]
    assert all("MIG" not in u.describe() and u.describe().endswith(u.key.gpu_uuid[-4:]) for u in whole)


# ----------------------------------------------------------------------------------------------------------------
# Costs


def _expected_groups(costs, team_label="team"):
    by_namespace: dict[str, int] = defaultdict(int)
    by_team: dict[str, int] = defaultdict(int)
    for cost in costs:
        if cost.subject_kind is CostSubjectKind.POD:
            by_namespace[cost.namespace] += cost.cost_micro_usd
            by_team[cost.labels.get(team_label) or NO_TEAM] += cost.cost_micro_usd
        else:
            by_namespace[BUCKET_GROUPS[cost.subject_kind]] += cost.cost_micro_usd
            by_team[BUCKET_GROUPS[cost.subject_kind]] += cost.cost_micro_usd
    return dict(by_namespace), dict(by_team)


def test_costs_are_grouped_by_namespace_and_team_and_add_up_to_the_node_bills(demo):
    state = apply_records(ViewState.empty(), demo.costs)
    by_namespace, by_team = _expected_groups(demo.costs)
    assert dict(state.cost_by_namespace) == by_namespace
    assert dict(state.cost_by_team) == by_team
    bills_total = sum(b.node_cost_micro_usd for b in demo.bills)
    assert state.cost_total_micro_usd == bills_total
    assert state.billed_node_windows == len(demo.bills)
    for rows in (live_view.namespace_costs(state), live_view.team_costs(state)):
        assert sum(r.cost_micro_usd for r in rows) == bills_total
        assert sum(r.tenths for r in rows) == PERCENT_TENTHS
        pods = [r for r in rows if not r.is_bucket]
        buckets = [r for r in rows if r.is_bucket]
        assert rows == tuple(pods + buckets)
        assert [r.cost_micro_usd for r in pods] == sorted((r.cost_micro_usd for r in pods), reverse=True)
    assert "scratch" in state.cost_by_namespace  # the leaky pod's namespace has a line of its own
    assert {r.group for r in live_view.team_costs(state)} >= {"foundation", "assistants", "platform"}


def test_with_sharing_each_team_shows_its_direct_and_shared_cost_and_the_tables_still_add_up(demo):
    costs, bills = demo.costs_with("idle=weighted,node_other=weighted")
    state = apply_records(ViewState.empty(), costs)
    assert state.cost_total_micro_usd == sum(b.node_cost_micro_usd for b in bills)
    shared_by_team: dict[str, int] = defaultdict(int)
    for cost in costs:
        if cost.is_shared:
            shared_by_team[cost.labels.get("team") or NO_TEAM] += cost.cost_micro_usd
    assert shared_by_team and dict(state.shared_by_team) == dict(shared_by_team)
    by_namespace, by_team = _expected_groups(costs)
    assert dict(state.cost_by_team) == by_team and dict(state.cost_by_namespace) == by_namespace
    kept = {c.subject_kind for c in costs if c.subject_kind is not CostSubjectKind.POD and c.cost_micro_usd}
    assert CostSubjectKind.IDLE not in kept and CostSubjectKind.NODE_OTHER not in kept
    for rows in (live_view.namespace_costs(state), live_view.team_costs(state)):
        assert sum(r.cost_micro_usd for r in rows) == state.cost_total_micro_usd
        assert all(r.direct_micro_usd + r.shared_micro_usd == r.cost_micro_usd for r in rows)
        assert sum(r.shared_micro_usd for r in rows) == live_view.shared_total_micro_usd(state) > 0
    # Each team's direct part is what it paid with every bucket kept.
    kept_state = apply_records(ViewState.empty(), demo.costs)
    assert {r.group: r.direct_micro_usd for r in live_view.team_costs(state) if not r.is_bucket} == {
        r.group: r.cost_micro_usd for r in live_view.team_costs(kept_state) if not r.is_bucket}
    # A re-sent shared line counts once; two shared lines of one pod (idle, node_other) are two lines.
    again = apply_records(state, [c for c in costs if c.is_shared])
    assert again.cost_total_micro_usd == state.cost_total_micro_usd
    line = "shared " + live_view.usd_text(live_view.shared_total_micro_usd(state))
    assert line in live_view.progress_line(state, [], 10.0)
    assert "shared" not in live_view.progress_line(kept_state, [], 10.0)


def test_the_rendered_view_shows_each_teams_direct_and_shared_cost(demo):
    from rich.console import Console

    costs, _ = demo.costs_with("idle=weighted,node_other=weighted")
    state = apply_records(ViewState.empty(), costs)
    console = Console(width=240, record=True, color_system=None)
    console.print(view.render_view(state, [], "header line"))
    text = console.export_text()
    assert "direct" in text and "shared" in text
    for row in live_view.team_costs(state):
        cells = r"\s+".join(re.escape(cell) for cell in (row.group, row.usd, row.direct_usd, row.shared_usd))
        assert re.search(cells, text), row


def test_a_cost_line_sent_twice_counts_once(demo):
    once = apply_records(ViewState.empty(), demo.costs)
    twice = apply_records(once, demo.costs[: len(demo.costs) // 2])
    assert twice.cost_total_micro_usd == once.cost_total_micro_usd
    assert dict(twice.cost_by_team) == dict(once.cost_by_team)
    assert twice.billed_node_windows == once.billed_node_windows


def test_pods_without_the_team_label_are_their_own_team_group(demo):
    state = apply_records(ViewState.empty(team_label="model"), demo.costs)
    _, by_model = _expected_groups(demo.costs, "model")
    assert dict(state.cost_by_team) == by_model
    unlabelled = sum(c.cost_micro_usd for c in demo.costs
                     if c.subject_kind is CostSubjectKind.POD and "model" not in c.labels)
    assert state.cost_by_team.get(NO_TEAM, 0) == unlabelled
    assert any(c.subject_kind is CostSubjectKind.POD and "model" not in c.labels for c in demo.costs)


def test_old_cost_lines_are_forgotten_beyond_the_horizon_without_changing_totals(demo):
    horizon_ms = 120_000
    state = apply_records(ViewState.empty(dedupe_horizon_ms=horizon_ms), demo.costs)
    for (cluster, node, start) in state.cost_lines_seen:
        assert start >= state.newest_billed_window_ms[(cluster, node)] - horizon_ms
    assert state.cost_total_micro_usd == sum(b.node_cost_micro_usd for b in demo.bills)


# ----------------------------------------------------------------------------------------------------------------
# Violations, dead letters, progress


def _violation(fingerprint: str, state: ViolationState, severity: Severity = Severity.CRITICAL,
               first_seen: int = 1_000, **subject) -> Violation:
    fields = {"node_name": "gpu-p5-a", "gpu_uuid": "GPU-aaaa-1234", "namespace": "scratch",
              "pod_name": "debug-shell", "pod_uid": "uid-1", "team": "platform", **subject}
    return Violation(
        fingerprint=fingerprint, rule="visibility_leak" if severity is Severity.CRITICAL else "shared_memory_pressure",
        severity=severity, state=state, cluster="demo", summary=f"summary {fingerprint}",
        evidence={"memory_used_bytes": 5.0}, first_seen_unix_ms=first_seen, last_seen_unix_ms=first_seen + 60_000,
        resolved_at_unix_ms=first_seen + 60_000 if state is ViolationState.RESOLVED else None, **fields,
    )


def test_active_violations_are_the_firing_ones_most_severe_first():
    records = [
        _violation("w1", ViolationState.FIRING, Severity.WARNING, first_seen=500, pod_name=None, pod_uid=None),
        _violation("c1", ViolationState.FIRING, first_seen=2_000),
        _violation("c0", ViolationState.FIRING, first_seen=1_000),
        _violation("r1", ViolationState.FIRING),
        _violation("r1", ViolationState.RESOLVED),
    ]
    state = apply_records(ViewState.empty(), records)
    active = live_view.active_violations(state)
    assert [row.fingerprint for row in active] == ["c0", "c1", "w1"]
    assert live_view.resolved_count(state) == 1
    assert active[0].subject == "scratch/debug-shell on gpu-p5-a GPU …1234"
    assert active[2].subject == "namespace scratch on gpu-p5-a GPU …1234"
    # Firing again after it resolved: active again.
    refired = apply_records(state, [_violation("r1", ViolationState.FIRING, first_seen=9_000)])
    assert [row.fingerprint for row in live_view.active_violations(refired)] == ["c0", "c1", "r1", "w1"]


def test_dead_letters_are_counted_by_service_and_reason():
    def letter(service, reason):
        return DeadLetter(reason, "why", "InvalidMessage", service, "t", 0, 1, None, b"x", 5)

    state = apply_records(ViewState.empty(), [letter("attributor", "LATE"), letter("attributor", "LATE"),
                                              letter("billing", "NO_PRICE")])
    assert dict(state.dead_letters) == {("attributor", "LATE"): 2, ("billing", "NO_PRICE"): 1}


def test_records_of_other_types_are_refused():
    with pytest.raises(TypeError):
        apply_records(ViewState.empty(), ["not a record"])


def test_progress_line_states_cost_violations_and_process_health(demo):
    state = apply_records(ViewState.empty(), [*demo.shares, *demo.costs,
                                              _violation("c0", ViolationState.FIRING)])
    health = [
        ProcessHealth("collector gpu-p5-a", 10, ProcessState.RUNNING, 0, None, 12.0),
        ProcessHealth("attributor", 11, ProcessState.RESTARTING, 2, -9, 0.0),
    ]
    line = live_view.progress_line(state, health, 42.0, demo.bills[0].window_start_unix_ms)
    assert live_view.usd_text(sum(b.node_cost_micro_usd for b in demo.bills)) in line
    assert f"in {len(demo.bills)} node-windows" in line
    assert f"unit-windows {len(demo.unit_windows())}" in line
    top = live_view.namespace_costs(state)[0]
    assert f"{top.group} {top.usd}" in line
    assert "violations firing 1 (visibility_leak)" in line
    assert "1/2 running, attributor restarting (exit -9), 2 restarts" in line


def test_money_and_percent_text_are_exact():
    assert live_view.usd_text(1_234_567) == "$1.234567"
    assert live_view.usd_text(-5) == "-$0.000005"
    assert live_view.tenths_text(1000) == "100.0%"
    assert live_view.tenths_text(7) == "0.7%"


# ----------------------------------------------------------------------------------------------------------------
# The orchestrator's pure helpers (gpumeter.commands.run)


@given(st.integers(min_value=1_600_000_000_000, max_value=2_000_000_000_000), st.integers(min_value=1, max_value=3600))
def test_simulated_time_starts_on_the_first_window_boundary_not_before_now(now_ms, window_seconds):
    start = plan.simulated_start_ms(now_ms, window_seconds)
    assert start % (window_seconds * 1000) == 0
    assert now_ms <= start < now_ms + window_seconds * 1000


@given(st.floats(min_value=0.1, max_value=100), st.one_of(st.none(), st.floats(min_value=1, max_value=86_400)),
       st.integers(min_value=1, max_value=3600))
def test_the_clock_skew_allowance_covers_how_far_simulated_time_runs_ahead(scale, duration, window_seconds):
    allowance = plan.clock_skew_allowance_seconds(scale, duration, window_seconds)
    wall = duration if duration is not None else plan.UNBOUNDED_RUN_SKEW_WALL_SECONDS
    # Simulated time starts up to one window ahead and gains (scale - 1) s per wall second.
    assert allowance >= window_seconds + (scale - 1) * wall
    assert allowance >= 120


def test_the_scenario_copy_moves_only_the_start():
    from simulator.scenario import load_scenario

    original = load_scenario(DEMO)
    start_ms = plan.simulated_start_ms(1_800_000_000_000, 60)
    shifted = load_scenario(plan.shifted_scenario_text(DEMO.read_text(), start_ms))
    assert shifted.start_unix_ms == start_ms != original.start_unix_ms
    assert replace(shifted, start_unix_ms=original.start_unix_ms) == original


def _config(tmp_path, **changes) -> plan.RunConfig:
    values = dict(scenario=DEMO, workdir=tmp_path / "w", run_id="20261129-120000-abcd")
    values.update(changes)
    return plan.RunConfig(**values)


def test_service_specs_run_every_part_of_the_pipeline_on_the_runs_topics(tmp_path):
    config = _config(tmp_path, time_scale=10.0, window_seconds=60)
    nodes = ("gpu-p5-a", "gpu-g6-ts", "gpu-a100-mig")
    skew = plan.clock_skew_allowance_seconds(10.0, 60.0, 60)
    specs = plan.service_specs(config, nodes, tmp_path / "scenario.yaml", "127.0.0.1:9", skew, with_guard=True)
    by_name = {s.name: s for s in specs}
    assert set(by_name) == {f"collector {n}" for n in nodes} | {"attributor", "billing", "guard"}

    def flag(spec, name):
        return spec.argv[spec.argv.index(name) + 1]

    for spec in specs:
        assert flag(spec, "--bootstrap-servers") == "127.0.0.1:9"
        assert flag(spec, "--topic-prefix") == config.prefix == "run-20261129-120000-abcd."
        assert flag(spec, "--metrics-port") == "0"  # several services on one host: no port clashes
        assert flag(spec, "--metrics-address") == "127.0.0.1"  # and were one enabled, only this machine's
        assert spec.argv[:3] == (sys.executable, "-m", "gpumeter.cli")
    for node in nodes:
        collector = by_name[f"collector {node}"]
        assert flag(collector, "--node") == node
        assert flag(collector, "--simulate") == str(tmp_path / "scenario.yaml")
        assert flag(collector, "--time-scale") == "10"
        assert not collector.restart  # its simulated clock would start over
    attributor = by_name["attributor"]
    assert flag(attributor, "--window-seconds") == "60"
    assert flag(attributor, "--max-clock-skew-seconds") == str(skew)
    assert attributor.restart and attributor.data_dir_flag == "--data-dir"
    assert attributor.drain_group == "run-20261129-120000-abcd.gpumeter-attributor"
    billing = by_name["billing"]
    assert flag(billing, "--ledger-url") == f"sqlite:///{tmp_path / 'w' / 'ledger.sqlite3'}"
    assert flag(billing, "--group") == billing.drain_group
    # Stopped in pipeline order: collectors, attributor, billing, guard.
    order = sorted(specs, key=lambda s: s.stop_group)
    assert [s.name.split()[0] for s in order] == ["collector"] * 3 + ["attributor", "billing", "guard"]
    without = plan.service_specs(config, nodes, tmp_path / "s.yaml", "127.0.0.1:9", skew, with_guard=False)
    assert "guard" not in {s.name for s in without}
    # --metrics-port N: one loopback port each, consecutive, in the specs' order (a local Prometheus scrapes them).
    served = plan.service_specs(_config(tmp_path, metrics_port=19_100), nodes, tmp_path / "s.yaml", "127.0.0.1:9",
                                skew, with_guard=True)
    assert [(s.name, flag(s, "--metrics-port"), flag(s, "--metrics-address")) for s in served] == [
        (name, str(19_100 + i), "127.0.0.1") for i, name in enumerate(
            [f"collector {n}" for n in nodes] + ["attributor", "billing", "guard"])]


def test_run_config_refuses_unusable_settings(tmp_path):
    from gpumeter.errors import ConfigError

    for changes in ({"duration_seconds": 0}, {"time_scale": 0}, {"window_seconds": 0}, {"partitions": 0},
                    {"scenario": tmp_path / "missing.yaml"}, {"metrics_port": -1}, {"metrics_port": 65_001}):
        with pytest.raises(ConfigError):
            _config(tmp_path, **changes)
    assert _config(tmp_path).owns_topics and not _config(tmp_path, topic_prefix="x.").owns_topics


def test_restart_backoff_doubles_up_to_its_cap():
    delays = [None]
    for _ in range(8):
        delays.append(supervisor.next_backoff_seconds(delays[-1]))
    assert delays[1:] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def _process(tmp_path, code: str, restart: bool, name: str = "worker x") -> supervisor.ManagedProcess:
    spec = plan.ServiceSpec(name=name, argv=(sys.executable, "-c", code), restart=restart, stop_group=0)
    (tmp_path / "logs").mkdir(exist_ok=True)
    return supervisor.ManagedProcess(spec, tmp_path, tmp_path / "logs", {})


def _wait_exit(process: supervisor.ManagedProcess) -> None:
    process.process.wait(20)


def test_a_service_that_exits_is_restarted_after_its_backoff(tmp_path):
    process = _process(tmp_path, "import sys; print('hello'); sys.exit(3)", restart=True)
    process.start(now=100.0)
    first_pid = process.pid
    _wait_exit(process)
    assert process.check(now=101.0)
    assert (process.state, process.exit_code) == (ProcessState.RESTARTING, 3)
    assert not process.check(now=101.5)  # the 1 s backoff has not passed
    assert process.check(now=102.0)
    assert process.state is ProcessState.RUNNING and process.restarts == 1 and process.pid != first_pid
    _wait_exit(process)
    process.check(now=103.0)
    assert process.state is ProcessState.RESTARTING  # next restart after 2 s
    assert not process.check(now=104.5) and process.check(now=105.0)
    _wait_exit(process)
    log = process.log_path.read_text()
    assert log.count("\nhello\n") == 3 and log.count("=== gpumeter run: start") == 3
    assert process.health(now=106.0).restarts == 2


def test_a_collector_that_exits_is_not_restarted(tmp_path):
    process = _process(tmp_path, "import sys; sys.exit(1)", restart=False)
    process.start(now=0.0)
    _wait_exit(process)
    assert process.check(now=1.0)
    assert process.state is ProcessState.FAILED and not process.check(now=100.0)
    assert not process.health(now=100.0).healthy


async def test_stop_asks_first_and_kills_a_process_that_ignores_sigterm(tmp_path):
    polite = _process(tmp_path, "import signal, sys, time\n"
                                "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                                "print('ready', flush=True)\n"
                                "time.sleep(60)", restart=True, name="polite")
    stubborn = _process(tmp_path, "import signal, time\n"
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                  "print('ready', flush=True)\n"
                                  "time.sleep(60)", restart=True, name="stubborn")
    for process in (polite, stubborn):
        process.start(now=0.0)
    for process in (polite, stubborn):
        for _ in range(200):
            if "\nready\n" in process.log_path.read_text():
                break
            await asyncio.sleep(0.05)
    assert await polite.stop(timeout_s=10) == 0
    assert polite.state is ProcessState.STOPPED
    assert await stubborn.stop(timeout_s=0.5) == -signal.SIGKILL
    assert stubborn.state is ProcessState.FAILED  # it did not stop when asked


def test_the_rendered_view_shows_every_unit_adding_up_to_100_and_the_cost_total(demo):
    from rich.console import Console

    state = apply_records(ViewState.empty(), [*demo.shares, *demo.costs, _violation("c0", ViolationState.FIRING)])
    health = [ProcessHealth("attributor", 11, ProcessState.RUNNING, 1, None, 30.0)]
    console = Console(width=220, record=True, color_system=None)
    console.print(view.render_view(state, health, "header line"))
    text = console.export_text()
    unit_lines = [line for line in text.splitlines() if any(u.key.gpu_uuid[-4:] in line for u in state.units.values())]
    assert len(unit_lines) == len(state.units)
    assert all("= 100.0%" in line for line in unit_lines)
    assert all(line.count("█") + line.count("░") + line.count("▒") + line.count("▓") == BAR_WIDTH_CELLS
               for line in unit_lines)
    # The total and, nothing being shared, its direct part: in the namespace and the team tables.
    assert text.count(live_view.usd_text(state.cost_total_micro_usd)) == 4
    assert "visibility_leak" in text and "scratch/debug-shell" in text


def test_the_runs_sharing_policy_reaches_billing_and_is_checked_at_start(tmp_path):
    from gpumeter.errors import ConfigError

    nodes = ("gpu-p5-a",)
    plain = plan.service_specs(_config(tmp_path), nodes, tmp_path / "s.yaml", "127.0.0.1:9", 120, with_guard=False)
    assert "--sharing" not in next(s for s in plain if s.name == "billing").argv
    config = _config(tmp_path, sharing="node_other=weighted, idle=weighted")
    specs = plan.service_specs(config, nodes, tmp_path / "s.yaml", "127.0.0.1:9", 120, with_guard=False)
    billing = next(s for s in specs if s.name == "billing")
    assert billing.argv[billing.argv.index("--sharing") + 1] == "idle=weighted,node_other=weighted"
    with pytest.raises(ConfigError):
        _config(tmp_path, sharing="idle=spread")


def test_a_time_scaled_run_takes_no_clock_correction_and_raises_no_clock_skew(tmp_path):
    """A time-scaled run's ticks read ahead of the broker's append time by design: the attributor's threshold and
    the guard's clock_skew threshold cover what the speed-up gains (before, the attributor took a collector that
    started late for a skewed node and billed its first tick a window early); a run at real time keeps the
    defaults."""
    nodes = ("gpu-p5-a",)
    skew = plan.clock_skew_allowance_seconds(10.0, 60.0, 60)
    scaled = {s.name: s for s in plan.service_specs(_config(tmp_path, time_scale=10.0, window_seconds=60), nodes,
                                                     tmp_path / "scenario.yaml", "127.0.0.1:9", skew,
                                                     with_guard=True)}
    argv = scaled["attributor"].argv
    assert argv[argv.index("--clock-skew-threshold-seconds") + 1] == str(skew)
    assert dict(scaled["guard"].env) == {"GPUMETER_GUARD_CLOCK_SKEW_THRESHOLD_SECONDS": str(skew)}
    real = {s.name: s for s in plan.service_specs(_config(tmp_path, time_scale=1.0, window_seconds=60), nodes,
                                                   tmp_path / "scenario.yaml", "127.0.0.1:9", 120,
                                                   with_guard=True)}
    assert "--clock-skew-threshold-seconds" not in real["attributor"].argv
    assert real["guard"].env == ()
    # The value is one each service accepts.
    import argparse

    from services.attributor.settings import add_arguments, attributor_settings
    from services.guard.config import GuardConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(list(argv[argv.index("attributor") + 1:]))
    assert attributor_settings(args, env={}).clock_skew_threshold_seconds == skew
    assert GuardConfig.load(None, env=dict(scaled["guard"].env)).clock_skew_threshold_seconds == skew
