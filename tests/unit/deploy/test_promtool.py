"""The chart's alert rules through Prometheus' own checker: ``promtool`` (built from source once,
``gpumeter.devtools.gotools``) parses the rendered PrometheusRule as Prometheus loads it (``check rules``) and runs a
unit test of every alert (``test rules``): input series of a failure the alert is there for, on which it must fire
with exactly its labels and annotations, and healthy series of the same metrics, on which it must stay silent. A
test file that expects the wrong thing is shown to fail, so that a pass means something. The Grafana dashboard's
queries (its variables as Grafana fills them in) are parsed by the same code (as recording rules)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.unit.deploy.manifests import of_kind
from tests.unit.deploy.test_helm import MONITORING, helm, helm_env, render  # noqa: F401  (fixtures)

NS = "metering"
COLLECTOR, ATTRIBUTOR, BILLING = "acme-gpumeter-collector", "acme-gpumeter-attributor", "acme-gpumeter-billing"
ALERT_LABELS = {"team": "platform"}  # ci/monitoring-values.yaml's prometheusRule.alertLabels


def _series(metric: str, job: str, values: str, **labels: str) -> dict:
    text = ", ".join(f'{k}="{v}"' for k, v in {"namespace": NS, "job": job, **labels}.items())
    return {"series": f"{metric}{{{text}}}", "values": values}


def _alert(severity: str, annotations: dict[str, str], **labels: str) -> dict:
    return {"exp_labels": {"severity": severity, **ALERT_LABELS, "namespace": NS, **labels},
            "exp_annotations": annotations}


# alert -> (eval time, input series of the failure, what fires; healthy input series, on which nothing fires)
CASES = {
    "GpumeterTargetDown": (
        "15m",
        [_series("up", COLLECTOR, "0x20", pod="c-1")],
        [_alert("warning", {"summary": "A gpumeter metrics endpoint cannot be scraped.",
                            "description": f"{COLLECTOR} pod c-1 has not answered /metrics for 10 minutes."},
                job=COLLECTOR, pod="c-1")],
        [_series("up", COLLECTOR, "1x20", pod="c-1")],
    ),
    "GpumeterCollectorStalled": (
        "12m",
        [_series("gpumeter_collector_ticks_total", COLLECTOR, "100+0x20", pod="c-1")],
        [_alert("critical", {"summary": "A collector's tick loop has stopped; its node's GPU use goes unmeasured.",
                             "description": "Collector c-1 has run no tick for minutes while answering scrapes."},
                pod="c-1")],
        [_series("gpumeter_collector_ticks_total", COLLECTOR, "0+60x20", pod="c-1")],
    ),
    "GpumeterConsumerStalled": (
        "30m",
        [_series("gpumeter_messages_consumed_total", ATTRIBUTOR, "500+0x40", pod="a-0", topic="samples"),
         _series("gpumeter_collector_samples_sent_total", COLLECTOR, "0+60x40", pod="c-1")],
        [_alert("critical", {"summary": "A gpumeter service consumes nothing while the collectors publish.",
                             "description": f"{ATTRIBUTOR} has consumed no input message while collectors keep "
                                            "sending samples."},
                job=ATTRIBUTOR)],
        [_series("gpumeter_messages_consumed_total", ATTRIBUTOR, "0+60x40", pod="a-0", topic="samples"),
         _series("gpumeter_collector_samples_sent_total", COLLECTOR, "0+60x40", pod="c-1")],
    ),
    "GpumeterAttributionLagging": (
        "15m",
        [_series("gpumeter_attributor_window_lag_seconds", ATTRIBUTOR, "400x20", pod="a-0")],
        [_alert("warning", {"summary": "The attributor emits windows late; it is behind its input.",
                            "description": "Attributor a-0 emits windows 6m 40s after they close."}, pod="a-0")],
        [_series("gpumeter_attributor_window_lag_seconds", ATTRIBUTOR, "75x20", pod="a-0")],
    ),
    "GpumeterCollectorBacklog": (
        "15m",
        [_series("gpumeter_collector_buffer_depth", COLLECTOR, "6000x20", pod="c-1")],
        [_alert("warning", {"summary": "A collector's records wait for Kafka.",
                            "description": "Collector c-1 holds 6000 records Kafka has not acknowledged."},
                pod="c-1")],
        [_series("gpumeter_collector_buffer_depth", COLLECTOR, "12x20", pod="c-1")],
    ),
    "GpumeterCollectorDroppingRecords": (
        "15m",
        [_series("gpumeter_collector_buffer_dropped_total", COLLECTOR, "0+6x20", pod="c-1")],
        [_alert("critical", {"summary": "A collector's buffer is full and records are lost.",
                             "description": "Collector c-1 dropped 60 records in 10 minutes (Kafka unreachable for "
                                            "too long)."}, pod="c-1")],
        [_series("gpumeter_collector_buffer_dropped_total", COLLECTOR, "7+0x20", pod="c-1")],
    ),
    "GpumeterDeadLetterRate": (
        "25m",
        [_series("gpumeter_dead_letters_total", BILLING, "0+5x30", pod="b-0", topic="shares"),
         _series("gpumeter_messages_consumed_total", BILLING, "0+100x30", pod="b-0", topic="shares")],
        [_alert("warning", {"summary": "Many input messages are dead-lettered.",
                            "description": f"{BILLING} dead-letters 5% of its input from shares."},
                job=BILLING, topic="shares")],
        [_series("gpumeter_dead_letters_total", BILLING, "0+0x30", pod="b-0", topic="shares"),
         _series("gpumeter_messages_consumed_total", BILLING, "0+100x30", pod="b-0", topic="shares")],
    ),
    "GpumeterKubeletUnavailable": (
        "30m",
        [_series("gpumeter_collector_kubelet_unavailable_total", COLLECTOR, "0+1x40", pod="c-1")],
        [_alert("warning", {"summary": "A collector cannot reach the kubelet's PodResources API and maps processes "
                                       "by cgroup alone.",
                            "description": "Collector c-1 cannot reach the kubelet pod-resources socket."},
                pod="c-1")],
        [_series("gpumeter_collector_kubelet_unavailable_total", COLLECTOR, "3+0x40", pod="c-1")],
    ),
}


@pytest.fixture(scope="module")
def promtool(go_tools):
    def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run([str(go_tools["promtool"]), *args], capture_output=True, text=True, timeout=120,
                              cwd=cwd)

    return run


def _rule_file(render, tmp_path: Path, *values_files: str) -> tuple[Path, list[dict]]:
    (rule,) = of_kind(render("acme", NS, *values_files), "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path, [r for group in rule["spec"]["groups"] for r in group["rules"]]


@pytest.mark.parametrize("guard_mode", sorted(MONITORING))
def test_promtool_loads_the_rendered_rules(render, promtool, tmp_path, guard_mode):
    path, rules = _rule_file(render, tmp_path, *MONITORING[guard_mode])
    result = promtool("check", "rules", path.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout + result.stderr


def _test_file(tmp_path: Path, tests: list[dict]) -> Path:
    path = tmp_path / "rules_test.yaml"
    path.write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests},
                                   sort_keys=False))
    return path


def _cases(alert: str) -> list[dict]:
    eval_time, failing, fires, healthy = CASES[alert]
    return [
        {"interval": "1m", "input_series": failing,
         "alert_rule_test": [{"eval_time": eval_time, "alertname": alert, "exp_alerts": fires}]},
        {"interval": "1m", "input_series": healthy,
         "alert_rule_test": [{"eval_time": eval_time, "alertname": alert, "exp_alerts": []}]},
    ]


def test_every_alert_has_a_case(render, tmp_path):
    _, rules = _rule_file(render, tmp_path, *MONITORING["single"])
    assert {r["alert"] for r in rules} == set(CASES)


@pytest.mark.parametrize("alert", sorted(CASES))
def test_each_alert_fires_on_its_failure_and_not_on_healthy_series(render, promtool, tmp_path, alert):
    _rule_file(render, tmp_path, *MONITORING["single"])
    result = promtool("test", "rules", _test_file(tmp_path, _cases(alert)).name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_case_expecting_the_wrong_thing_fails(render, promtool, tmp_path):
    _rule_file(render, tmp_path, *MONITORING["single"])
    eval_time, failing, fires, healthy = CASES["GpumeterCollectorStalled"]
    wrong = [{"interval": "1m", "input_series": healthy,  # a ticking collector: nothing fires, the case says it does
              "alert_rule_test": [{"eval_time": eval_time, "alertname": "GpumeterCollectorStalled",
                                   "exp_alerts": fires}]}]
    result = promtool("test", "rules", _test_file(tmp_path, wrong).name, cwd=tmp_path)
    assert result.returncode != 0 and "GpumeterCollectorStalled" in result.stdout + result.stderr


# -- the Grafana dashboard's queries, parsed by Prometheus itself ---------------------------------------------------

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "gpumeter-dashboard.json"
# What Grafana puts in place of its variables before a query reaches Prometheus: a duration for its own, the
# selected values (a regex alternation) for the dashboard's.
GRAFANA_DURATIONS = {"__range": "1h", "__rate_interval": "1m", "__interval": "30s", "__range_s": "3600"}
VARIABLE_RE = re.compile(r"\$\{?(\w+)\}?")
LABEL_VALUES_RE = re.compile(r"^label_values\((.+),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)$")


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panels = []
    for panel in dashboard["panels"]:
        panels += [panel, *panel.get("panels", [])]
    queries = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            found = LABEL_VALUES_RE.match(query)
            assert found, f"variable {variable['name']}: a query Grafana's Prometheus source does not take: {query}"
            queries.append(f"count by ({found.group(2)}) ({found.group(1)})")  # what label_values asks
    return [VARIABLE_RE.sub(lambda m: GRAFANA_DURATIONS.get(m.group(1), "a|b"), q) for q in queries]


def test_every_dashboard_query_parses_in_prometheus(promtool, tmp_path):
    queries = _dashboard_queries()
    assert len(queries) > 20
    rules = [{"record": f"dashboard:query_{i}", "expr": q} for i, q in enumerate(queries)]
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", "dashboard.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout + result.stderr
    # The check reads PromQL for real: a query with one parenthesis missing is refused.
    broken = [{"record": "dashboard:broken", "expr": queries[0].replace(")", "", 1)}]
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": broken}]}))
    assert promtool("check", "rules", "broken.yaml", cwd=tmp_path).returncode != 0
