"""End to end through ``gpumeter replay``: a scenario's namespaces and their labels reach the pod events the
collector's code makes, and with ``GPUMETER_GROUPING_LABEL_SOURCE`` the costs group by the namespace's team, not
the one a pod claims for itself."""

from __future__ import annotations

import argparse
import io
from collections import defaultdict

import pytest

from pipeline import cli as replay_cli
from pipeline.recordings import scenario_records
from pipeline.replay import read_jsonl
from schemas.records import PodEvent
from simulator.scenario import ScenarioError, load_scenario

SCENARIO = """
cluster: sim-namespaces
seed: 5
start: "2026-07-01T00:00:00Z"
interval_seconds: 10
duration_seconds: 120
namespaces:
  - name: research
    labels: {team: research}
  - name: search
    labels: {team: search, cost-center: cc-7}
nodes:
  - name: gpu-a
    region: us-east-1
    instance_type: g5.12xlarge
    gpus:
      - model: NVIDIA A10G
        count: 4
        memory_total_bytes: 24146608128
        sharing: {mode: exclusive}
pods:
  - namespace: research
    name: claims-search
    node: gpu-a
    labels: {team: search}
    containers:
      - name: main
        devices: [{resource: nvidia.com/gpu, gpu: 0}]
        processes: [{name: python, memory: {bytes: 8GiB}, compute: 0.5}]
  - namespace: sandbox
    name: unlabelled-namespace
    node: gpu-a
    labels: {team: search}
    containers:
      - name: main
        devices: [{resource: nvidia.com/gpu, gpu: 1}]
        processes: [{name: python, memory: {bytes: 4GiB}, compute: 0.5}]
  - namespace: search
    name: no-own-label
    node: gpu-a
    containers:
      - name: main
        devices: [{resource: nvidia.com/gpu, gpu: 2}, {resource: nvidia.com/gpu, gpu: 3}]
        processes: [{name: python, memory: {bytes: 2GiB}, compute: 0.5}]
"""


def _replay(tmp_path, source: str | None) -> dict:
    """Cost micro-USD per (pod, team label) of the replay with ``source`` as GPUMETER_GROUPING_LABEL_SOURCE."""
    scenario = tmp_path / "namespaces.yaml"
    scenario.write_text(SCENARIO)
    out = tmp_path / f"out-{source}"
    parser = argparse.ArgumentParser()
    replay_cli.add_arguments(parser)
    env = {} if source is None else {"GPUMETER_GROUPING_LABEL_SOURCE": source}
    err = io.StringIO()
    assert replay_cli.main(parser.parse_args([str(scenario), "--out", str(out)]), env, out=io.StringIO(),
                           err=err) == 0, err.getvalue()
    by_pod: dict[tuple[str | None, str | None], int] = defaultdict(int)
    for line in read_jsonl(out / "costs.jsonl"):
        by_pod[(line["pod"], line["labels"].get("team"))] += line["cost_micro_usd"]
    return dict(by_pod)


def _by_team(by_pod: dict) -> dict:
    teams: dict[str | None, int] = defaultdict(int)
    for (pod, team), micro in by_pod.items():
        if pod is not None:
            teams[team] += micro
    return dict(teams)


def test_the_collectors_pod_events_carry_the_scenarios_namespace_labels():
    scenario = load_scenario(SCENARIO)
    events = [r.message for r in scenario_records(scenario) if isinstance(r.message, PodEvent)]
    labels = {e.name: dict(e.namespace_labels) for e in events}
    assert labels["claims-search"] == {"kubernetes.io/metadata.name": "research", "team": "research"}
    assert labels["unlabelled-namespace"] == {"kubernetes.io/metadata.name": "sandbox"}
    assert labels["no-own-label"]["team"] == "search"


def test_costs_by_team_follow_the_configured_label_source(tmp_path):
    by_pod = _replay(tmp_path, None)
    cost = {pod: micro for (pod, _team), micro in by_pod.items() if pod is not None}
    assert all(micro > 0 for micro in cost.values()) and len(cost) == 3
    # Today's default: the pods' own labels, so a pod in research bills itself to search.
    assert _by_team(by_pod) == {"search": cost["claims-search"] + cost["unlabelled-namespace"],
                                None: cost["no-own-label"]}
    # From the namespace only: the pod's own label no longer decides, and a namespace without one sets none.
    assert _by_team(_replay(tmp_path, "namespace")) == {
        "research": cost["claims-search"], "search": cost["no-own-label"], None: cost["unlabelled-namespace"]}
    # The namespace, else the pod.
    assert _by_team(_replay(tmp_path, "namespace,pod")) == {
        "research": cost["claims-search"], "search": cost["no-own-label"] + cost["unlabelled-namespace"]}
    # Per key: team from the namespace; nothing else changes what anyone pays.
    per_key = _replay(tmp_path, "team=namespace")
    assert _by_team(per_key) == _by_team(_replay(tmp_path, "namespace"))
    assert sum(per_key.values()) == sum(by_pod.values())


def test_a_namespace_is_declared_once_with_a_valid_name():
    with pytest.raises(ScenarioError, match=r"namespaces\[1\].name"):
        load_scenario(SCENARIO.replace("name: search\n    labels", "name: research\n    labels", 1))
    with pytest.raises(ScenarioError, match=r"namespaces\[0\].name"):
        load_scenario(SCENARIO.replace("name: research\n", "name: Research_\n", 1))
    with pytest.raises(ScenarioError, match=r"namespaces\[0\]"):
        load_scenario(SCENARIO.replace("labels: {team: research}", "labels: {team: research}\n    owner: x", 1))
