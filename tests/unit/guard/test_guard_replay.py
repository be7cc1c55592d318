"""Every guard rule fires and resolves through ``gpumeter replay`` of the guard scenarios, asserted on
``violations.jsonl``; nothing fires on the clean scenario. Expected subjects and times are derived from the
scenario files, the thresholds file and the replay's own shares and costs."""

from __future__ import annotations

import argparse
import io
import re
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import pytest

from pipeline import cli as replay_cli
from pipeline.recordings import InputRecord, scenario_records, write_recording
from pipeline.replay import read_jsonl, replay
from simulator.scenario import load_scenario
from services.guard.config import GuardConfig
from services.guard.rules import fingerprint_of, period_bounds

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = REPO / "scenarios"
THRESHOLDS = SCENARIOS / "guard" / "thresholds.yaml"
CONFIG = GuardConfig.load(THRESHOLDS, {})
HOLD_MS = CONFIG.hold_down_seconds * 1000
ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3})?Z")
REQUIRED_FIELDS = ("rule", "state", "severity", "node", "gpu_uuid", "namespace", "pod", "fingerprint",
                   "first_seen", "last_seen")


@pytest.fixture(scope="module")
def replays(tmp_path_factory):
    """name -> (scenario, violations.jsonl rows, shares rows, costs rows), replayed with the guard thresholds."""
    out = {}
    for name in ("guard_visibility", "guard_idle", "guard_pressure", "guard_budget", "guard_gpu_error"):
        folder = tmp_path_factory.mktemp(name)
        summary = replay(SCENARIOS / f"{name}.yaml", folder, guard_config=CONFIG)
        assert summary.dead_letters == {} and summary.unpriced == (), name
        rows = read_jsonl(folder / "violations.jsonl")
        assert summary.violation_rows == len(rows) > 0
        out[name] = (load_scenario(SCENARIOS / f"{name}.yaml"), rows, read_jsonl(folder / "shares.jsonl"),
                     read_jsonl(folder / "costs.jsonl"))
    return out


def by_fingerprint(rows):
    groups = defaultdict(list)
    for row in rows:
        groups[row["fingerprint"]].append(row)
    return groups


def lifecycle(rows):
    """fingerprint -> (first firing row, resolved row or None); checks each violation's records are in order."""
    out = {}
    for fp, group in by_fingerprint(rows).items():
        states = [r["state"] for r in group]
        assert states[0] == "firing", group
        end = states.index("resolved") + 1 if "resolved" in states else len(states)
        # One violation's records until it resolves: firing ones with the same first_seen, then one resolved.
        assert set(states[: end - 1]) == {"firing"} or end == 1
        first = group[0]
        assert all(r["first_seen"] == first["first_seen"] for r in group[:end])
        assert all(r["published_at_unix_ms"] <= n["published_at_unix_ms"] for r, n in zip(group, group[1:]))
        out[fp] = (first, group[end - 1] if states[end - 1] == "resolved" else None)
    return out


def iso_ms(text):
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def ms(scenario, seconds):
    return scenario.start_unix_ms + round(seconds * 1000)


def first_tick_at_or_after(scenario, t_ms):
    return next(t for t in scenario.tick_times_ms() if t >= t_ms)


def test_every_record_has_the_required_fields_in_iso_8601_utc(replays):
    for name, (_, rows, _, _) in replays.items():
        for row in rows:
            for field in REQUIRED_FIELDS:
                assert field in row, (name, field)
            assert row["state"] in ("firing", "resolved") and row["severity"] in ("warning", "critical")
            assert ISO.fullmatch(row["first_seen"]) and ISO.fullmatch(row["last_seen"])
            assert (row["resolved_at"] is None) == (row["state"] == "firing")
            assert re.fullmatch(r"[0-9a-f]{16}", row["fingerprint"])


# ----------------------------------------------------------------------------------------------------------------
# visibility_leak and unrequested_gpu_use


def _expected_leaks(scenario):
    """From the scenario: (pod, gpu uuid or None) leak subjects, and the pods using GPUs without a request."""
    node = scenario.nodes[0]
    spec_leaks, unit_leaks, unrequested = set(), set(), set()
    for pod in scenario.pods:
        assigned = {d.gpu for c in pod.containers for d in c.devices}
        for c in pod.containers:
            env = c.env.get("NVIDIA_VISIBLE_DEVICES")
            named = set()
            if env and env not in ("void", "none") and env != "all":
                named = {int(x) for x in env.split(",")}
            if c.privileged or env == "all" or (named - assigned):
                spec_leaks.add(pod.name)
            for p in c.processes:
                targets = {t.gpu for t in p.devices}
                for gpu in targets - assigned:
                    unit_leaks.add((pod.name, node.gpus[gpu].uuid))
                if targets and not assigned:
                    unrequested.add(pod.name)
    return spec_leaks, unit_leaks, unrequested


def test_visibility_leaks_fire_while_the_pods_run_and_resolve_after_the_hold_down(replays):
    scenario, rows, _, _ = replays["guard_visibility"]
    spec_leaks, unit_leaks, unrequested = _expected_leaks(scenario)
    assert spec_leaks and unit_leaks and unrequested  # the scenario exercises all three
    pods = {p.name: p for p in scenario.pods}
    leak_rows = [r for r in rows if r["rule"] == "visibility_leak"]
    assert {(r["pod"], r["gpu_uuid"]) for r in leak_rows} == {(p, None) for p in spec_leaks} | unit_leaks
    assert {r["severity"] for r in leak_rows} == {"critical"}
    assert {r["pod"] for r in rows if r["rule"] == "unrequested_gpu_use"} == unrequested
    for first, resolved in lifecycle(rows).values():
        pod = pods[first["pod"]]
        assert first["first_seen_unix_ms"] == first_tick_at_or_after(scenario, ms(scenario, pod.start_seconds))
        assert resolved is not None, first
        # The deletion is seen at the first tick at or after the pod's end; the violation resolves a hold-down
        # later (the scenario's instants are 10 s apart and the hold-down a multiple of them).
        gone = first_tick_at_or_after(scenario, ms(scenario, pod.end_seconds))
        assert resolved["resolved_at_unix_ms"] == gone + HOLD_MS
        assert resolved["last_seen_unix_ms"] < gone
    assert "ranker-0" not in {r["pod"] for r in rows}


def test_the_leaks_evidence_carries_the_leaked_memory(replays):
    scenario, rows, _, _ = replays["guard_visibility"]
    debug = next(p for p in scenario.pods if p.name == "cuda-debug")
    (process,) = debug.containers[0].processes
    wanted = process.memory.bytes
    for row in rows:
        if row["rule"] == "visibility_leak" and row["pod"] == "cuda-debug" and row["gpu_uuid"]:
            # usedGpuMemory = what the process asked for + its CUDA context (256-510 MiB in the simulator)
            assert wanted < row["evidence"]["memory_used_bytes"] <= wanted + (512 << 20)
            assert row["evidence"]["process_count"] == 1


# ----------------------------------------------------------------------------------------------------------------
# idle_allocation


def test_idle_pods_fire_after_the_idle_time_with_their_cost_and_resolve(replays):
    scenario, rows, shares, costs = replays["guard_idle"]
    threshold = CONFIG.idle_compute_below_percent / 100
    idle_rows = [r for r in rows if r["rule"] == "idle_allocation"]
    assert {r["pod"] for r in idle_rows} == {"notebook-0", "mig-idle-0"}
    assert {r["gpu_uuid"][:4] for r in idle_rows} == {"GPU-", "MIG-"}
    cost_of = defaultdict(int)
    for c in costs:
        if c["subject_kind"] == "pod":
            cost_of[(c["pod_uid"], c["gpu_uuid"], c["window_start"])] += c["cost_micro_usd"]
    for first, resolved in lifecycle(idle_rows).values():
        assert resolved is not None
        pod_rows = sorted((s for s in shares
                           if s["pod_uid"] == first["pod_uid"] and s["gpu_uuid"] == first["gpu_uuid"]),
                          key=lambda s: s["window_start_unix_ms"])
        run = []
        for s in pod_rows:
            if s["compute_share"] >= threshold:
                break
            run.append(s)
        covered = 0.0
        fire_window = None
        for s in run:
            covered += s["covered_seconds"]
            if covered >= CONFIG.idle_for_seconds and fire_window is None:
                fire_window = s
        assert fire_window is not None
        assert first["evidence"]["idle_since_unix_ms"] == run[0]["window_start_unix_ms"]
        assert first["evidence"]["idle_seconds"] == pytest.approx(
            sum(s["covered_seconds"] for s in run[: run.index(fire_window) + 1]))
        # The violation resolves with the money of the whole idle run, from costs.jsonl.
        wasted = sum(cost_of[(first["pod_uid"], first["gpu_uuid"], s["window_start"])] for s in run)
        assert resolved["evidence"]["wasted_cost_micro_usd"] == wasted > 0
        assert resolved["evidence"]["idle_seconds"] == pytest.approx(sum(s["covered_seconds"] for s in run))
    assert "mig-busy-0" not in {r["pod"] for r in rows}


# ----------------------------------------------------------------------------------------------------------------
# shared_memory_pressure


def test_shared_memory_pressure_fires_for_the_hog_and_the_full_mps_gpu_and_resolves(replays):
    scenario, rows, _, _ = replays["guard_pressure"]
    ts_node, mps_node = scenario.nodes
    ts_gpu, mps_gpu = ts_node.gpus[0], mps_node.gpus[0]
    hog = next(p for p in scenario.pods if p.name == "hog-0")
    steps = hog.containers[0].processes[0].memory.steps
    fair = (ts_gpu.memory_total_bytes - ts_gpu.driver_reserved_bytes) / ts_gpu.sharing.replicas
    over = [(at, b) for at, b in steps if b > fair]
    assert len(over) == 1
    over_from = over[0][0]
    over_until = next(at for at, _ in steps if at > over_from)
    pressure = [r for r in rows if r["rule"] == "shared_memory_pressure"]
    subjects = {(r["node"], r["gpu_uuid"], r["pod"]) for r in pressure}
    assert subjects == {(ts_node.name, ts_gpu.uuid, "hog-0"), (mps_node.name, mps_gpu.uuid, None)}
    for first, resolved in lifecycle(pressure).values():
        assert first["first_seen_unix_ms"] == first_tick_at_or_after(scenario, ms(scenario, over_from))
        assert resolved["resolved_at_unix_ms"] == first_tick_at_or_after(scenario, ms(scenario, over_until)) + HOLD_MS
        if first["pod"] == "hog-0":
            assert first["evidence"]["fair_share_bytes"] == pytest.approx(fair)
            assert first["evidence"]["memory_used_bytes"] > fair
        else:
            assert first["evidence"]["memory_used_percent"] > CONFIG.shared_memory_used_above_percent


# ----------------------------------------------------------------------------------------------------------------
# budget_exceeded


def test_budgets_warn_then_exceed_before_midnight_and_resolve_when_the_period_rolls_over(replays):
    scenario, rows, _, costs = replays["guard_budget"]
    midnight = period_bounds("day", scenario.end_unix_ms)[0]
    assert scenario.start_unix_ms < midnight < scenario.end_unix_ms
    assert period_bounds("month", midnight)[0] == midnight  # a month boundary too
    budget_rows = [r for r in rows if r["rule"] == "budget_exceeded"]
    cases = {
        ("namespace", "training", "day"): CONFIG.namespace_budget("training").day_micro_usd,
        ("team", "pretraining", "month"): CONFIG.team_budget("pretraining").month_micro_usd,
    }
    for (kind, name, period), budget in cases.items():
        fp = fingerprint_of("budget_exceeded", scenario.cluster, namespace=name if kind == "namespace" else None,
                            team=name if kind == "team" else None, qualifier=period)
        group = [r for r in budget_rows if r["fingerprint"] == fp]
        assert group, (kind, name)
        before = sum(c["cost_micro_usd"] for c in costs if c["subject_kind"] == "pod"
                     and (c["namespace"] if kind == "namespace" else c["labels"].get("team")) == name
                     and iso_ms(c["window_start"]) < midnight)
        assert before > budget  # the scenario spends past the budget before midnight
        severities = [r["severity"] for r in group if r["state"] == "firing"]
        assert severities[0] == "warning" and "critical" in severities
        critical = next(r for r in group if r["severity"] == "critical")
        assert budget < critical["evidence"]["spent_micro_usd"] <= before
        assert critical["published_at_unix_ms"] < midnight
        assert critical["first_seen"] == group[0]["first_seen"]  # the warning became critical in place
        (resolved,) = [r for r in group if r["state"] == "resolved"]
        assert resolved["resolved_at_unix_ms"] == midnight + HOLD_MS
        assert group[-1] is resolved
    # web has budgets far above its spend; team serving has none.
    assert {r["namespace"] or r["team"] for r in budget_rows} == {"training", "pretraining"}


# ----------------------------------------------------------------------------------------------------------------
# gpu_error


def test_an_nvml_error_warns_and_resolves_and_a_lost_gpu_is_critical(replays):
    scenario, rows, _, _ = replays["guard_gpu_error"]
    node = scenario.nodes[0]
    power = next(f for f in node.faults if getattr(f, "function", None) == "nvmlDeviceGetPowerUsage")
    lost = next(f for f in node.faults if not hasattr(f, "function"))
    errors = [r for r in rows if r["rule"] == "gpu_error"]
    cycles = lifecycle(errors)
    by_gpu = {first["gpu_uuid"]: (first, resolved) for first, resolved in cycles.values()}
    assert set(by_gpu) == {node.gpus[power.gpu].uuid, node.gpus[lost.gpu].uuid}
    first, resolved = by_gpu[node.gpus[power.gpu].uuid]
    start, until = ms(scenario, power.from_seconds), ms(scenario, power.until_seconds)
    ticks = [t for t in scenario.tick_times_ms() if start <= t < until]
    assert first["severity"] == "warning"
    assert first["first_seen_unix_ms"] == ticks[CONFIG.gpu_error_min_consecutive_samples - 1]
    assert resolved["resolved_at_unix_ms"] == first_tick_at_or_after(scenario, until) + HOLD_MS
    first, resolved = by_gpu[node.gpus[lost.gpu].uuid]
    assert first["severity"] == "critical" and first["evidence"]["gpu_lost_flag"] == 1
    assert first["first_seen_unix_ms"] == first_tick_at_or_after(scenario, ms(scenario, lost.at_seconds))
    # The simulator cannot bring a lost GPU back: it is still firing at the end.
    assert resolved is None


# ----------------------------------------------------------------------------------------------------------------
# stale_node: a recording with one collector silent for a while


def test_a_collector_silent_in_a_recording_goes_stale_and_resolves_when_it_is_back(tmp_path):
    scenario = load_scenario(SCENARIOS / "guard_pressure.yaml")
    silent = scenario.nodes[1].name
    gap_from, gap_until = ms(scenario, 60), ms(scenario, 150)  # frames in (from, until] are lost
    records = [r for r in scenario_records(scenario)
               if not (r.node_name == silent and gap_from < r.received_at_unix_ms <= gap_until)]
    assert all(isinstance(r, InputRecord) for r in records)
    recording = tmp_path / "gap.gmrec"
    write_recording(records, recording)
    summary = replay(recording, tmp_path / "out", guard_config=CONFIG)
    assert summary.dead_letters == {}
    rows = [r for r in read_jsonl(tmp_path / "out" / "violations.jsonl") if r["rule"] == "stale_node"]
    (cycle,) = lifecycle(rows).values()
    first, resolved = cycle
    assert (first["node"], first["severity"]) == (silent, "warning")
    threshold = max(CONFIG.stale_node_intervals * scenario.interval_ms, CONFIG.stale_node_min_seconds * 1000)
    instants = sorted({r.received_at_unix_ms for r in records})
    assert first["first_seen_unix_ms"] == next(t for t in instants if t - gap_from > threshold)
    back = next(t for t in instants if t > gap_until)
    assert resolved["resolved_at_unix_ms"] == next(t for t in instants if t >= back + HOLD_MS)


# ----------------------------------------------------------------------------------------------------------------
# the clean scenario, the CLI, determinism


def test_nothing_fires_on_the_clean_scenario_with_the_default_thresholds(tmp_path):
    summary = replay(SCENARIOS / "exclusive.yaml", tmp_path)
    assert summary.share_rows > 0
    assert (tmp_path / "violations.jsonl").read_text() == ""
    assert summary.violation_rows == 0 and summary.violations_firing_at_end == 0


def test_nothing_fires_on_the_clean_scenario_with_the_scenario_thresholds_either(tmp_path):
    replay(SCENARIOS / "exclusive.yaml", tmp_path, guard_config=CONFIG)
    assert read_jsonl(tmp_path / "violations.jsonl") == []


def _cli_args(argv):
    parser = argparse.ArgumentParser()
    replay_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_the_cli_takes_a_guard_config_and_refuses_a_bad_one(tmp_path, replays):
    _, expected, _, _ = replays["guard_pressure"]
    out, err = io.StringIO(), io.StringIO()
    args = _cli_args([str(SCENARIOS / "guard_pressure.yaml"), "--out", str(tmp_path / "a"),
                      "--guard-config", str(THRESHOLDS)])
    assert replay_cli.main(args, {}, out=out, err=err) == 0, err.getvalue()
    assert read_jsonl(tmp_path / "a" / "violations.jsonl") == expected
    assert f"{len(expected)} violation records" in out.getvalue()
    # GPUMETER_GUARD_* overrides the file: disabling the rule leaves nothing.
    args = _cli_args([str(SCENARIOS / "guard_pressure.yaml"), "--out", str(tmp_path / "b"),
                      "--guard-config", str(THRESHOLDS)])
    env = {"GPUMETER_GUARD_DISABLED_RULES": "shared_memory_pressure"}
    assert replay_cli.main(args, env, out=io.StringIO(), err=io.StringIO()) == 0
    assert read_jsonl(tmp_path / "b" / "violations.jsonl") == []
    bad = tmp_path / "bad.yaml"
    bad.write_text("hold_down_seconds: -5\n")
    err = io.StringIO()
    args = _cli_args([str(SCENARIOS / "guard_pressure.yaml"), "--out", str(tmp_path / "c"), "--guard-config", str(bad)])
    assert replay_cli.main(args, {}, out=io.StringIO(), err=err) == 2
    assert err.getvalue().startswith("gpumeter replay: ") and "hold_down_seconds" in err.getvalue()


def test_violations_are_byte_for_byte_deterministic(tmp_path):
    for folder in ("a", "b"):
        replay(SCENARIOS / "guard_visibility.yaml", tmp_path / folder, guard_config=CONFIG)
    assert (tmp_path / "a" / "violations.jsonl").read_bytes() == (tmp_path / "b" / "violations.jsonl").read_bytes()


def test_a_tenants_exempt_label_exempts_nothing_and_the_leaker_pays_whatever_the_exemption(tmp_path):
    """The leaking pod of ``visibility_leak.yaml`` labels itself ``gpumeter.io/guard-exempt: "true"``: by default
    the guard still raises its violations; only when the platform lists its namespace in
    ``exempt_label_namespaces`` is it exempt. Either way billing charges it the same cost (issue 22)."""
    text = (SCENARIOS / "visibility_leak.yaml").read_text()
    plain = "    labels: {team: platform}\n"
    assert text.count(plain) == 1
    scenario = tmp_path / "labelled.yaml"
    scenario.write_text(text.replace(plain, '    labels: {team: platform, "gpumeter.io/guard-exempt": "true"}\n'))
    leaker_costs, leaker_rules = [], []
    for name, config in (("default", GuardConfig()), ("listed", GuardConfig(exempt_label_namespaces=("scratch",)))):
        out = tmp_path / name
        summary = replay(scenario, out, guard_config=config)
        assert summary.dead_letters == {} and summary.unpriced == ()
        leaker_rules.append({r["rule"] for r in read_jsonl(out / "violations.jsonl") if r["pod"] == "cuda-debug"})
        leaker_costs.append(sum(c["cost_micro_usd"] for c in read_jsonl(out / "costs.jsonl")
                                if c["pod"] == "cuda-debug"))
    assert leaker_rules == [{"visibility_leak", "unrequested_gpu_use"}, set()]
    assert leaker_costs[0] > 0 and leaker_costs[0] == leaker_costs[1]
