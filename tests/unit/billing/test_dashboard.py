"""The Grafana dashboard under deploy/: valid JSON Grafana can import, Prometheus as a variable, and PromQL that
only names metrics and labels gpumeter really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gpumeter.metrics import METRICS
from services.billing.service import BILLING_METRICS

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "gpumeter-dashboard.json"

METRIC_RE = re.compile(r"\b(gpumeter_[a-zA-Z0-9_]+)")
SELECTOR_RE = re.compile(r"\b(gpumeter_[a-zA-Z0-9_]+)\s*\{([^}]*)\}")
MATCHER_RE = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*\"")
GROUPING_RE = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LABEL_VALUES_RE = re.compile(r"label_values\(\s*(gpumeter_[a-zA-Z0-9_]+)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)")
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"job", "instance"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def all_panels(dashboard: dict) -> list[dict]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def expressions(dashboard: dict) -> list[str]:
    return [t["expr"] for p in all_panels(dashboard) for t in p.get("targets", [])]


def variable_queries(dashboard: dict) -> list[str]:
    queries = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def known_labels(metric: str) -> set[str]:
    definition = METRICS[metric]
    return set(definition.labels) | TARGET_LABELS


def test_dashboard_is_a_grafana_dashboard_with_a_prometheus_datasource_variable(dashboard):
    assert dashboard["schemaVersion"] >= 38
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert target["expr"].strip()
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == "${datasource}"


def test_panels_do_not_overlap(dashboard):
    cells = {}
    for panel in all_panels(dashboard):
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_every_metric_name_in_the_promql_exists(dashboard):
    used = set()
    for text in expressions(dashboard) + variable_queries(dashboard):
        names = METRIC_RE.findall(text)
        assert names, f"no gpumeter metric in {text!r}"
        used.update(names)
    unknown = used - set(METRICS)
    assert not unknown, f"metrics not in gpumeter.metrics.METRICS: {sorted(unknown)}"


def test_every_label_in_the_promql_belongs_to_its_metric(dashboard):
    for expr in expressions(dashboard):
        metrics_in_expr = set(METRIC_RE.findall(expr))
        for metric, matchers in SELECTOR_RE.findall(expr):
            for label, _op in MATCHER_RE.findall(matchers):
                assert label in known_labels(metric), f"{metric} has no label {label!r} ({expr})"
        for grouping in GROUPING_RE.findall(expr):
            for label in filter(None, (part.strip() for part in grouping.split(","))):
                assert any(label in known_labels(m) for m in metrics_in_expr), f"no metric of {expr!r} has {label!r}"
    for query in variable_queries(dashboard):
        for metric, label in LABEL_VALUES_RE.findall(query):
            assert label in known_labels(metric), query


def test_every_metric_the_billing_service_exports_is_on_the_dashboard(dashboard):
    used = {name for text in expressions(dashboard) for name in METRIC_RE.findall(text)}
    assert set(BILLING_METRICS) <= used, sorted(set(BILLING_METRICS) - used)


def test_the_brief_panels_are_there(dashboard):
    titles = [p["title"].lower() for p in all_panels(dashboard)]
    for words in (("namespace",), ("team",), ("top pods",), ("memory share",), ("compute share",),
                  ("idle", "unattributed"), ("dead letters",), ("ledger rows",)):
        assert any(all(w in t for w in words) for t in titles), words


def test_money_is_shown_in_dollars_not_micro_dollars(dashboard):
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            if "cost_micro_usd" in target["expr"] and panel["fieldConfig"]["defaults"]["unit"] == "currencyUSD":
                assert "/ 1e6" in target["expr"], panel["title"]
