"""A StatefulSet pod deleted and created again under its name (``scenarios/statefulset_restart.yaml``): a new uid
on the same GPU, through the whole replay (simulator → collector → attributor → billing → ledger). Each
incarnation is billed for exactly the ticks it was alive, against the simulator's truth and against the
scenario's own times; a report by pod shows the name once, the sum of both, and the report reconciles.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest
from sqlalchemy import text

from pipeline import replay as replay_module
from pipeline.replay import read_jsonl, replay
from schemas.records import PodEventType
from services.billing.catalog import PriceCatalog, parse_override_csv
from services.billing.costing import iso_utc
from services.billing.ledger import Grouping, Ledger
from services.billing.report import build_report
from services.collector.simulation import SimulatedNode, node_streams, pod_object
from simulator.scenario import load_scenario

REPO = Path(__file__).resolve().parents[3]
SCENARIO = REPO / "scenarios" / "statefulset_restart.yaml"
WINDOW_MS = 60_000
EXACT = 1e-9


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """The scenario replayed with a priced node, its ledger kept on disk: (scenario, output dir, ledger URL)."""
    scenario = load_scenario(SCENARIO)
    tmp = tmp_path_factory.mktemp("statefulset")
    url = f"sqlite:///{tmp / 'ledger.sqlite3'}"
    prices = parse_override_csv("AssetClass,InstanceID,InstanceIDField,MarketPriceHourly,GpuCount,Source,SourceDate\n"
                                f"node,{scenario.nodes[0].name},metadata.name,11.873125,4,test price,2026-07\n",
                                "p.csv")
    with pytest.MonkeyPatch.context() as patch:
        # The replay bills into an in-memory ledger it closes; this one stays for the report.
        patch.setattr(replay_module, "Ledger", lambda _url: Ledger(url))
        summary = replay(SCENARIO, tmp / "out", window_seconds=WINDOW_MS // 1000,
                         catalog=PriceCatalog.load().with_overrides(prices))
    assert summary.dead_letters == {} and summary.unpriced == ()
    return scenario, tmp / "out", url


def _alive_ticks(scenario, pod) -> dict[str, int]:
    """Window start (ISO) → ticks of that window at which ``pod`` was alive, from the scenario's own times."""
    start = scenario.start_unix_ms + round(pod.start_seconds * 1000)
    end = None if pod.end_seconds is None else scenario.start_unix_ms + round(pod.end_seconds * 1000)
    alive: dict[int, int] = defaultdict(int)
    for t in scenario.tick_times_ms():
        if start <= t and (end is None or t < end):
            alive[iso_utc(t // WINDOW_MS * WINDOW_MS)] += 1
    return dict(alive)


def _ticks_per_window(scenario) -> dict[str, int]:
    ticks: dict[str, int] = defaultdict(int)
    for t in scenario.tick_times_ms():
        ticks[iso_utc(t // WINDOW_MS * WINDOW_MS)] += 1
    return ticks


def test_the_scenario_recreates_llm_0_on_its_gpu_with_a_new_uid(replayed):
    scenario, _, _ = replayed
    incarnations = [p for p in scenario.pods if p.key == "serve/llm-0"]
    assert len(incarnations) == 2 and incarnations[0].uid != incarnations[1].uid
    assert incarnations[0].end_seconds == incarnations[1].start_seconds
    gpus = {(c.devices[0].gpu, c.devices[0].device_id) for p in incarnations for c in p.containers}
    assert len(gpus) == 1
    # The restart falls inside a window: that window bills both.
    assert incarnations[1].start_seconds * 1000 % WINDOW_MS != 0


def test_each_incarnation_pays_for_exactly_its_own_alive_ticks(replayed):
    scenario, out, _ = replayed
    gpu_uuid = scenario.nodes[0].gpus[0].uuid
    ticks = _ticks_per_window(scenario)
    shares = [r for r in read_jsonl(out / "shares.jsonl") if r["gpu_uuid"] == gpu_uuid]
    truth = {(r["window_start"], r["pod_uid"]): r for r in read_jsonl(out / "truth.jsonl")
             if r["gpu_uuid"] == gpu_uuid}
    costs = [c for c in read_jsonl(out / "costs.jsonl") if c["gpu_uuid"] == gpu_uuid]
    incarnations = [p for p in scenario.pods if p.key == "serve/llm-0"]
    both = 0
    for pod in incarnations:
        alive = _alive_ticks(scenario, pod)
        rows = {r["window_start"]: r for r in shares if r["pod_uid"] == pod.uid}
        assert set(rows) == set(alive), pod.uid  # no window of the other incarnation's life
        for window, row in rows.items():
            assert row["pod"] == "llm-0" and row["namespace"] == "serve"
            expected = alive[window] / ticks[window]
            assert row["cost_share"] == pytest.approx(expected, abs=EXACT), (pod.uid, window)
            assert row["cost_share"] == pytest.approx(truth[(window, pod.uid)]["true_occupancy_share"], abs=EXACT)
            assert row["memory_share"] == pytest.approx(truth[(window, pod.uid)]["true_memory_share"], abs=EXACT)
        lines = {c["window_start"]: c for c in costs if c["pod_uid"] == pod.uid}
        assert set(lines) == set(rows)
        assert all(lines[w]["cost_share"] == rows[w]["cost_share"] and lines[w]["cost_micro_usd"] > 0
                   for w in lines)
        both += sum(1 for w in alive if 0 < alive[w] < ticks[w])
    # The restart window: the two incarnations split the GPU by ticks, nothing left idle.
    assert both == 2
    restart = {w for w in _alive_ticks(scenario, incarnations[0]) if w in _alive_ticks(scenario, incarnations[1])}
    assert len(restart) == 1
    window = restart.pop()
    in_window = [r for r in shares if r["window_start"] == window]
    assert {r["subject_kind"] for r in in_window if r["cost_share"] > 0} == {"pod"}
    assert sum(r["cost_share"] for r in in_window) == pytest.approx(1.0, abs=EXACT)


def test_a_report_by_pod_shows_the_name_once_with_both_incarnations_and_reconciles(replayed):
    scenario, out, url = replayed
    costs = [c for c in read_jsonl(out / "costs.jsonl") if c["subject_kind"] == "pod"]
    by_uid: dict[str, int] = defaultdict(int)
    for c in costs:
        if (c["namespace"], c["pod"]) == ("serve", "llm-0"):
            by_uid[c["pod_uid"]] += c["cost_micro_usd"]
    assert set(by_uid) == {p.uid for p in scenario.pods if p.key == "serve/llm-0"}
    assert all(cost > 0 for cost in by_uid.values())
    with Ledger(url) as ledger:
        report = build_report(ledger, Grouping.parse("pod"), start_ms=scenario.start_unix_ms,
                              end_ms=scenario.end_unix_ms + WINDOW_MS)
        # The ledger keeps each incarnation's own lines, under its uid.
        with ledger.engine.connect() as connection:
            kept = dict(connection.execute(text(
                "SELECT pod_uid, SUM(cost_micro_usd) FROM cost_lines WHERE namespace = 'serve' AND pod_name = 'llm-0' "
                "GROUP BY pod_uid")).all())
    lines = {line.group: line.cost_micro_usd for line in report.lines if line.kind == "pod"}
    assert lines["serve/llm-0"] == sum(by_uid.values())
    assert lines["serve/embed-0"] == sum(c["cost_micro_usd"] for c in costs
                                         if (c["namespace"], c["pod"]) == ("serve", "embed-0"))
    assert set(lines) == {p.key for p in scenario.pods}
    assert report.reconciliation.reconciled
    assert report.total_micro_usd == sum(b["node_cost_micro_usd"] for b in read_jsonl(out / "bills.jsonl"))
    assert kept == by_uid


def test_the_collector_sees_the_old_incarnation_deleted_before_the_new_one_is_added(tmp_path):
    """As the API server orders them: the name is free before its new pod is created."""
    scenario = load_scenario(SCENARIO)
    old, new = (p for p in scenario.pods if p.key == "serve/llm-0")
    restart_ms = scenario.start_unix_ms + round(new.start_seconds * 1000)
    ticks = {tick.sampled_at_unix_ms: tick for tick in node_streams(scenario, scenario.nodes[0].name, tmp_path / "proc")}
    events = [(e.event_type, e.uid) for e in ticks[restart_ms].pod_events if e.name == "llm-0"]
    assert events == [(PodEventType.DELETED, old.uid), (PodEventType.ADDED, new.uid)]


async def test_the_simulated_api_server_has_one_pod_of_the_name_at_a_time(tmp_path):
    """The collector's simulated node deletes the old pod before it creates its successor (the fake API server,
    as the real one, refuses a name a live pod holds)."""
    scenario = load_scenario(SCENARIO)
    old, new = (p for p in scenario.pods if p.key == "serve/llm-0")
    node = SimulatedNode(scenario, scenario.nodes[0].name, 1.0, tmp_path)
    node._api_started = True  # its peers are driven directly: no socket is opened
    served = []
    for t in scenario.tick_times_ms():
        await node.sync(t)
        served.append(sorted(p["metadata"]["uid"] for p in node.apiserver.pods().values()
                             if p["metadata"]["name"] == "llm-0"))
    assert [old.uid] in served and [new.uid] in served
    assert all(len(uids) == 1 for uids in served)
    # Creating the old incarnation again while its successor lives is what the real server refuses (409).
    current = next(p for p in node.world.pods_at(scenario.end_unix_ms - 1) if p.name == "llm-0")
    with pytest.raises(ValueError, match="serve/llm-0 already exists"):
        node.apiserver.add_pod(pod_object(dataclasses.replace(current, uid=old.uid)))
