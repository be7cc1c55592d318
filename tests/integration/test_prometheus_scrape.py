"""A real Prometheus (our build, gpumeter.devtools.gotools) scrapes the pipeline's services and answers every
Grafana panel's query with the series the panel shows; the chart's alert rules evaluate on that data without error.

``gpumeter run`` runs the pipeline over ``scenarios/demo.yaml`` on the session's Kafka broker, each process serving
/metrics on a loopback port of its own (``--metrics-port``): three simulated collectors, the attributor, billing
(sharing ``node_other`` to the pods, so the shared-cost series exist) and the guard (the demo's leaky pod raises a
violation). An oversized message on the node-window-shares topic makes billing and the guard dead-letter it, cut to
fit (the dead-letter panels' series). Prometheus scrapes each process as the chart's ServiceMonitors
(``ci/monitoring-values.yaml``, release ``acme`` in ``metering``) have prometheus-operator scrape its pods: the job,
namespace, service, endpoint, pod and container target labels, ``honorLabels`` as the chart sets it per role; and it
loads the chart's rendered PrometheusRule.

What must hold, asked of Prometheus while the run goes on:

* every process is a healthy target;
* every panel query of deploy/grafana/gpumeter-dashboard.json (Grafana's variables filled in as "All" sends them)
  returns series, each carrying the labels the query groups by and its legend shows, with a value; every query
  variable's ``label_values`` has values; billing's per-pod series keep the namespaces of the billed pods, and a
  ``service`` label shown is gpumeter's own service name, not the Kubernetes Service's (the chart's honorLabels);
* every alert rule has been evaluated with health ``ok``, and every selector of its expression selects series (its
  job and namespace matchers meet the target labels the ServiceMonitors give);
* the check is not vacuous: a query grouping by a label the metric lacks fails it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from aiokafka import AIOKafkaProducer

from gpumeter.devtools.prometheus import PrometheusServer, output_labels, selectors
from gpumeter.settings import KafkaSettings
from schemas.catalog import TopicCatalog
from tests.unit.deploy.manifests import of_kind, pod_spec, workloads
from tests.unit.deploy.test_helm import MONITORING, helm, helm_env, render  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "scenarios" / "demo.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "gpumeter-dashboard.json"
RELEASE, NAMESPACE = "acme", "metering"
RUN_SECONDS = 240  # an upper bound: the test stops the run (SIGINT) once it has asked its questions
TIME_SCALE = 10
WINDOW_SECONDS = 60
SCRAPE_SECONDS = 1.0
# What Grafana sends for its own variables (a scrape every second: 20 s holds several samples), and for the
# dashboard's multi-value variables with "All" selected (their allValue).
GRAFANA_VARIABLES = {"__range": "10m", "__rate_interval": "20s", "__interval": "5s", "namespace": ".*",
                     "team": ".*", "node": ".*"}
VARIABLE_RE = re.compile(r"\$\{?(\w+)\}?")
LEGEND_LABEL_RE = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
LABEL_VALUES_RE = re.compile(r"^label_values\((.+),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)$")
ONE_MIB_UNCOMPRESSED = b"\x00" + random.Random(25).randbytes(1_040_000)  # no record; under message.max.bytes
WAIT_S = 150.0
# The `service` label values gpumeter's own series carry (each service's metrics registry names itself)
GPUMETER_SERVICES = frozenset({"collector", "attributor", "billing", "api", "guard", "record", "recorder"})


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1 now."""
    for _ in range(200):
        first = random.randrange(20_000, 60_000)
        sockets = []
        try:
            for port in range(first, first + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def role_of(process_name: str) -> str:
    """The chart component a process of ``gpumeter run`` is (its name: "collector <node>", "attributor", ...)."""
    return process_name.split()[0]


def scrape_configs(docs: list[dict], processes: list[dict]) -> list[dict]:
    """Prometheus' scrape configs for the run's processes, as prometheus-operator makes them of the chart's
    ServiceMonitors: per monitor its honorLabels and path, per pod the target labels it sets (job: the Service's
    name; namespace, service, endpoint: the port's name, pod, container: the one with that port)."""
    services = of_kind(docs, "Service")
    configs = []
    for monitor in of_kind(docs, "ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        (service,) = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
        (endpoint,) = monitor["spec"]["endpoints"]
        component = service["metadata"]["labels"]["app.kubernetes.io/component"]
        (workload,) = [w for w in workloads(docs) if w["kind"] != "CronJob" and service["spec"]["selector"].items()
                       <= w["spec"]["template"]["metadata"]["labels"].items()]
        (container,) = [c["name"] for c in pod_spec(workload)["containers"]
                        if endpoint["port"] in {p.get("name") for p in c.get("ports", [])}]
        name = service["metadata"]["name"]
        targets = []
        for index, process in enumerate(p for p in processes if role_of(p["name"]) == component):
            argv = process["argv"]
            port = argv[argv.index("--metrics-port") + 1]
            labels = {"job": name, "namespace": NAMESPACE, "service": name, "endpoint": endpoint["port"],
                      "pod": f"{workload['metadata']['name']}-{index}", "container": container}
            targets.append({"targets": [f"127.0.0.1:{port}"], "labels": labels})
        if targets:
            configs.append({"job_name": f"serviceMonitor/{NAMESPACE}/{monitor['metadata']['name']}/0",
                            "honor_labels": endpoint["honorLabels"], "metrics_path": endpoint["path"],
                            "scheme": endpoint["scheme"], "static_configs": targets})
    return configs


def panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, query as Prometheus gets it, legend format) of every panel target."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panels = []
    for panel in dashboard["panels"]:
        panels += [panel, *panel.get("panels", [])]
    return [(panel["title"], VARIABLE_RE.sub(lambda m: GRAFANA_VARIABLES[m.group(1)], target["expr"]),
             target.get("legendFormat") or "")
            for panel in panels for target in panel.get("targets", [])]


def variable_queries() -> list[tuple[str, str]]:
    """(metric selector, label) of every query variable's ``label_values``."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    found = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            match = LABEL_VALUES_RE.match(query)
            assert match, query
            found.append((match.group(1), match.group(2)))
    return found


def shown_labels(prometheus: PrometheusServer, expr: str, legend: str) -> set[str]:
    """The labels a panel shows of ``expr``'s series: those it groups by, those its legend names."""
    grouped = output_labels(prometheus.parse(expr)) or frozenset()
    return set(grouped) | set(LEGEND_LABEL_RE.findall(legend))


def panel_problem(prometheus: PrometheusServer, expr: str, legend: str) -> str | None:
    """What is wrong with ``expr``'s answer now (None: it returns series, each with every shown label and a value)."""
    result = prometheus.query(expr)
    if not result:
        return "no series"
    wanted = shown_labels(prometheus, expr, legend)
    for series in result:
        missing = sorted(label for label in wanted if not series["metric"].get(label))
        if missing:
            return f"a series without {missing}: {series['metric']}"
        if "service" in wanted and series["metric"]["service"] not in GPUMETER_SERVICES:
            return f"a series whose service is not one of gpumeter's ({series['metric']['service']!r})"
        if series["value"][1] in ("NaN", ""):
            return f"no value: {series}"
    return None


def selector_text(metric: str, matchers: tuple[tuple[str, str, str], ...]) -> str:
    return metric + "{" + ", ".join(f"{label}{op}{json.dumps(value)}" for label, op, value in matchers) + "}"


def alert_problems(prometheus: PrometheusServer, alerts: list[dict]) -> list[str]:
    """Rules not evaluated fine, and alert selectors that select nothing."""
    problems = []
    loaded = {rule["name"]: rule for rule in prometheus.rules()}
    for alert in alerts:
        rule = loaded.get(alert["alert"])
        if rule is None or rule["health"] != "ok":
            problems.append(f"{alert['alert']}: {rule and (rule['health'], rule.get('lastError'))}")
            continue
        for selector in selectors(prometheus.parse(alert["expr"])):
            text = selector_text(selector.metric, selector.matchers)
            if not prometheus.query(text):
                problems.append(f"{alert['alert']}: {text} selects nothing")
    return problems


def dashboard_problems(prometheus: PrometheusServer, namespaces: set[str]) -> list[str]:
    problems = [f"{title}: {expr}: {problem}" for title, expr, legend in panel_queries()
                if (problem := panel_problem(prometheus, expr, legend))]
    for metric, label in variable_queries():
        values = {s["metric"].get(label) for s in prometheus.query(f"count by ({label}) ({metric})")}
        if not values or None in values:
            problems.append(f"label_values({metric}, {label}): {values}")
        if label == "namespace" and not values <= namespaces:
            problems.append(f"label_values({metric}, namespace): {sorted(values)} are not the scenario's "
                            f"{sorted(namespaces)}")
    return problems


def _processes(workdir: Path) -> list[dict]:
    path = workdir / "processes.json"
    return json.loads(path.read_text())["processes"] if path.exists() else []


async def _dead_letter_bait(settings: KafkaSettings, topic: str) -> None:
    """A value over the producer's request budget on ``topic``: its consumers dead-letter it, cut to fit."""
    producer = AIOKafkaProducer(**settings.client_kwargs(), max_request_size=8 << 20, acks="all")
    await producer.start()
    try:
        await (await producer.send(topic, ONE_MIB_UNCOMPRESSED, key=b"gpu-p5-a"))
    finally:
        await producer.stop()


def test_prometheus_scrapes_the_services_and_answers_every_panel_and_alert(kafka_bootstrap, go_tools, render,
                                                                           tmp_path):
    docs = render(RELEASE, NAMESPACE, *MONITORING["single"])
    (rule,) = of_kind(docs, "PrometheusRule")
    alerts = [r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r]
    scenario = yaml.safe_load(SCENARIO.read_text())
    namespaces = {pod["namespace"] for pod in scenario["pods"]}

    prefix = f"prom{uuid.uuid4().hex[:8]}."
    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, client_id="gpumeter-test")
    workdir = tmp_path / "run"
    log_path = tmp_path / "run.log"
    command = [sys.executable, "-m", "gpumeter.cli", "run", "--no-live", "--duration", str(RUN_SECONDS),
               "--time-scale", str(TIME_SCALE), "--window-seconds", str(WINDOW_SECONDS),
               "--scenario", str(SCENARIO), "--bootstrap-servers", kafka_bootstrap, "--topic-prefix", prefix,
               "--workdir", str(workdir), "--sharing", "node_other=weighted", "--metrics-port", str(free_ports(6))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMETER_")}
    with log_path.open("w") as log:
        run = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    prometheus = None
    try:
        deadline = time.monotonic() + 60
        while len(_processes(workdir)) < 6:
            assert run.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.2)
        processes = _processes(workdir)
        configs = scrape_configs(docs, processes)
        assert sorted(c["job_name"].split("/")[2] for c in configs) == [
            f"{RELEASE}-gpumeter-{role}" for role in ("attributor", "billing", "collector", "guard")]
        assert sum(len(c["static_configs"]) for c in configs) == len(processes) == 6
        prometheus = PrometheusServer(go_tools["prometheus"], scrape_configs=configs,
                                      rule_groups=rule["spec"]["groups"], interval_seconds=SCRAPE_SECONDS,
                                      base_dir=tmp_path)
        prometheus.start()
        asyncio.run(_dead_letter_bait(settings, TopicCatalog(prefix=prefix).node_window_shares))

        # Ask until every answer is right (series appear as the run goes: the first bills after a window closes,
        # the violation once the guard has seen the leaky pod), then once more for the record.
        deadline = time.monotonic() + WAIT_S
        while True:
            assert run.poll() is None, "the run ended early\n" + log_path.read_text()[-4000:]
            targets = prometheus.targets()
            problems = [f"target {t['scrapeUrl']} {t['health']}: {t['lastError']}" for t in targets
                        if t["health"] != "up"]
            problems += [f"{len(targets)} targets"] if len(targets) != 6 else []
            problems += dashboard_problems(prometheus, namespaces)
            problems += alert_problems(prometheus, alerts)
            if not problems or time.monotonic() > deadline:
                break
            time.sleep(2.0)
        assert problems == [], "\n".join(problems) + "\n" + prometheus.log_tail()

        # Not vacuous: a panel grouping by a label its metric lacks, or naming one in its legend, fails.
        by_team = next(e for _, e, _ in panel_queries() if e.startswith("sum by (team) (rate(gpumeter_pod_gpu"))
        assert panel_problem(prometheus, by_team, "{{team}}") is None
        assert panel_problem(prometheus, by_team.replace("by (team)", "by (tenant)"), "").startswith(
            "a series without ['tenant']")
        assert panel_problem(prometheus, by_team, "{{tenant}}").startswith("a series without ['tenant']")
        assert panel_problem(prometheus, by_team.replace("gpumeter_pod_gpu", "gpumeter_pod_gpus"), "") == "no series"
    finally:
        if prometheus is not None:
            prometheus.stop()
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            try:
                run.wait(90)
            except subprocess.TimeoutExpired:
                run.kill()
                run.wait(30)
