"""A real, throwaway Prometheus server on loopback (the build ``gpumeter.devtools.gotools`` makes), and what a PromQL
expression reads, from Prometheus' own parser.

Contract:

* ``PrometheusServer(binary, scrape_configs=..., rule_groups=...)``: ``start()`` writes ``prometheus.yml`` (the given
  scrape configs, a global scrape and rule evaluation interval of ``interval_seconds``, the rule groups in a rule
  file of their own, as a PrometheusRule's ``spec.groups``) and a TSDB folder into a fresh temporary folder,
  starts the server on a free port of 127.0.0.1, waits until ``GET /-/ready`` answers 200 and returns its base URL;
  ``stop()`` ends it (SIGTERM, then SIGKILL after a timeout) and removes the folder. Also a context manager.
* ``api(path, **params)`` is the ``data`` of a ``/api/v1/<path>`` answer (POSTed as a form, so long queries fit);
  an answer whose ``status`` is not ``success`` raises ``PrometheusApiError`` carrying Prometheus' ``errorType``
  and ``error``. ``parse(expr)`` is the server's syntax tree of ``expr`` (``/api/v1/parse_query``: the parser
  every query goes through, as the JSON tree its UI's explain view reads); ``query(expr, at_s)`` an instant query's
  result; ``targets()`` the active scrape targets; ``rules()`` the loaded rules with their ``health`` and
  ``lastError`` from their last evaluation; ``api_get`` as ``api`` for the endpoints that take GET only.
* Pure functions over such a tree (no server needed): ``selectors(tree)`` every vector or range selector with its
  metric name and label matchers; ``metric_names(tree)``; ``labels_read(tree)`` every label name the expression
  matches on or groups by (``by``/``without``, ``on``/``ignoring``, ``group_left``/``group_right``);
  ``output_labels(tree)`` the labels every series of the result is sure to carry as far as the expression decides
  (an aggregation ``by (a, b)`` keeps exactly a and b), or None where it passes the input series' own labels on.

The deployment tests read the chart's alert rules and the Grafana dashboard's queries through ``parse``; the
Prometheus integration test (tests/integration/test_prometheus_scrape.py) has the server scrape the services.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Sequence

import yaml

from gpumeter.devtools.alertmanager import free_port

RULE_FILE = "rules.yml"  # beside prometheus.yml, which names it relative to itself


class PrometheusServerError(RuntimeError):
    """The server could not be started or did not answer."""


class PrometheusApiError(RuntimeError):
    """An API answer whose status was not ``success``: ``error_type`` and ``error`` are Prometheus' own words."""

    def __init__(self, path: str, error_type: str, error: str) -> None:
        super().__init__(f"/api/v1/{path}: {error_type}: {error}")
        self.error_type = error_type
        self.error = error


class PrometheusServer:
    """One throwaway Prometheus (module docstring). ``start()`` returns its base URL."""

    def __init__(self, binary: Path, *, scrape_configs: Sequence[dict] = (), rule_groups: Sequence[dict] = (),
                 interval_seconds: float = 1.0, base_dir: Path | None = None) -> None:
        self.binary = binary
        self.scrape_configs = list(scrape_configs)
        self.rule_groups = list(rule_groups)
        self.interval_seconds = interval_seconds
        self.base_dir = base_dir
        self.port = 0
        self.root: Path | None = None
        self._process: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        assert self.root is not None
        return self.root / "prometheus.log"

    def log_tail(self) -> str:
        if self.root is None or not self.log_file.exists():
            return ""
        return self.log_file.read_text(errors="replace")[-4000:]

    def config(self) -> dict:
        interval = f"{int(self.interval_seconds * 1000)}ms"
        config = {"global": {"scrape_interval": interval, "evaluation_interval": interval,
                             "scrape_timeout": interval},
                  "scrape_configs": self.scrape_configs}
        if self.rule_groups:
            config["rule_files"] = [RULE_FILE]
        return config

    def start(self, timeout_s: float = 60.0) -> str:
        """Start the server and wait until it is ready; return its base URL."""
        if self._process is not None:
            return self.url
        self.root = Path(tempfile.mkdtemp(prefix="gpumeter-prometheus-", dir=self.base_dir or "/tmp"))
        config_file = self.root / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        if self.rule_groups:
            (self.root / RULE_FILE).write_text(yaml.safe_dump({"groups": self.rule_groups}, sort_keys=False))
        self.port = free_port()
        command = [
            str(self.binary),
            f"--config.file={config_file}",
            f"--storage.tsdb.path={self.root / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        try:
            self._log = open(self.log_file, "wb")
            # cwd: the build has no web UI assets embedded; the server would look for them here (the API needs none).
            self._process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, cwd=self.root)
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _wait_ready(self, timeout_s: float) -> None:
        assert self._process is not None
        deadline = time.monotonic() + timeout_s
        problem = "no answer yet"
        while True:
            code = self._process.poll()
            if code is not None:
                raise PrometheusServerError(f"Prometheus exited with {code} at start:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
                    problem = f"HTTP {response.status}"
            except urllib.error.HTTPError as exc:
                problem = f"HTTP {exc.code}"
            except (urllib.error.URLError, OSError) as exc:
                problem = repr(exc)
            if time.monotonic() > deadline:
                raise PrometheusServerError(f"Prometheus on port {self.port} not ready within {timeout_s:.0f} s "
                                            f"({problem}):\n{self.log_tail()}")
            time.sleep(0.05)

    def api(self, path: str, **params: Any) -> Any:
        """The ``data`` of ``POST /api/v1/<path>`` with ``params`` as a form (module docstring)."""
        body = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None}).encode()
        request = urllib.request.Request(f"{self.url}/api/v1/{path}", data=body, method="POST",
                                         headers={"Content-Type": "application/x-www-form-urlencoded"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as exc:  # 400 and 422 carry Prometheus' error document
            try:
                answer = json.load(exc)
            except ValueError:
                raise PrometheusServerError(f"/api/v1/{path}: HTTP {exc.code}") from exc
        if answer.get("status") != "success":
            raise PrometheusApiError(path, answer.get("errorType", "?"), answer.get("error", "?"))
        return answer["data"]

    def parse(self, expr: str) -> dict:
        """Prometheus' syntax tree of ``expr``; a syntax error raises ``PrometheusApiError`` (``bad_data``)."""
        return self.api("parse_query", query=expr)

    def query(self, expr: str, at_s: float | None = None) -> list[dict]:
        """An instant query's result at ``at_s`` (Unix seconds; None: now): [{"metric": labels, "value": ...}]
        for a vector, or a scalar's or string's [time, value] pair."""
        data = self.api("query", query=expr, time=None if at_s is None else f"{at_s:.3f}")
        return data["result"]

    def targets(self) -> list[dict]:
        """The active scrape targets (``labels``, ``health``, ``lastError``, ``scrapeUrl``, ...)."""
        return self.api_get("targets", state="active")["activeTargets"]

    def rules(self) -> list[dict]:
        """Every loaded rule (``name``, ``type``, ``health``, ``lastError``, ``state`` of an alert, ...)."""
        return [rule for group in self.api_get("rules")["groups"] for rule in group["rules"]]

    def api_get(self, path: str, **params: Any) -> Any:
        """As ``api``, with GET (the endpoints that take no POST)."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as exc:
            raise PrometheusServerError(f"/api/v1/{path}: HTTP {exc.code}") from exc
        if answer.get("status") != "success":
            raise PrometheusApiError(path, answer.get("errorType", "?"), answer.get("error", "?"))
        return answer["data"]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, SIGKILL after ``timeout_s``) and remove its folder. Safe to call twice."""
        process, self._process = self._process, None
        try:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout_s)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
            if self.root is not None:
                shutil.rmtree(self.root, ignore_errors=True)
                self.root = None

    def __enter__(self) -> "PrometheusServer":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# -- reading the parser's tree ------------------------------------------------------------------------------------

class Selector(NamedTuple):
    """A vector or range selector: its metric name ("" when it names none) and matchers (label, op, value), the
    ``__name__`` matcher of the name left out."""

    metric: str
    matchers: tuple[tuple[str, str, str], ...]


# Aggregations that return input series whole (their labels as they were), not one series per group.
_SELECTING_AGGREGATIONS = frozenset({"topk", "bottomk", "limitk", "limit_ratio"})
# Functions whose result has no labels of the input's.
_LABEL_FREE_FUNCTIONS = frozenset({"vector", "scalar", "time", "pi", "day_of_month", "day_of_week", "day_of_year",
                                   "days_in_month", "hour", "minute", "month", "year"})


def nodes(tree: dict | None) -> Iterator[dict]:
    """Every node of ``tree``, depth first, the root first."""
    if not tree:
        return
    yield tree
    kind = tree.get("type")
    if kind == "aggregation":
        yield from nodes(tree.get("param"))
        yield from nodes(tree.get("expr"))
    elif kind == "binaryExpr":
        yield from nodes(tree.get("lhs"))
        yield from nodes(tree.get("rhs"))
    elif kind == "call":
        for arg in tree.get("args", []):
            yield from nodes(arg)
    elif kind in ("parenExpr", "unaryExpr", "subquery"):
        yield from nodes(tree.get("expr"))


def selectors(tree: dict) -> list[Selector]:
    """Every vector and range selector of ``tree``, in the order they are written."""
    found = []
    for node in nodes(tree):
        if node["type"] in ("vectorSelector", "matrixSelector"):
            name = node.get("name") or ""
            matchers = tuple((m["name"], m["type"], m["value"]) for m in node.get("matchers", [])
                             if not (m["name"] == "__name__" and m["type"] == "=" and m["value"] == name))
            found.append(Selector(name, matchers))
    return found


def metric_names(tree: dict) -> set[str]:
    """The metric names the selectors of ``tree`` name."""
    return {s.metric for s in selectors(tree) if s.metric}


def labels_read(tree: dict) -> set[str]:
    """Every label name ``tree`` matches on or groups by (module docstring)."""
    labels = {label for s in selectors(tree) for label, _, _ in s.matchers}
    for node in nodes(tree):
        if node["type"] == "aggregation":
            labels |= set(node.get("grouping") or [])
        elif node["type"] == "binaryExpr" and node.get("matching"):
            labels |= set(node["matching"].get("labels") or []) | set(node["matching"].get("include") or [])
    return labels


def _is_scalar(tree: dict) -> bool:
    kind = tree["type"]
    if kind == "numberLiteral":
        return True
    if kind in ("parenExpr", "unaryExpr"):
        return _is_scalar(tree["expr"])
    if kind == "call":
        return tree["func"].get("returnType") == "scalar"
    if kind == "binaryExpr":
        return _is_scalar(tree["lhs"]) and _is_scalar(tree["rhs"])
    return False


def output_labels(tree: dict) -> frozenset[str] | None:
    """The labels each series of ``tree``'s result carries by the expression's own doing (module docstring): a
    grouping aggregation's ``by`` labels, none for an aggregation without grouping, and None (the input's labels,
    whatever they are) for selectors and what passes them on."""
    kind = tree["type"]
    if kind in ("vectorSelector", "matrixSelector"):
        return None
    if kind in ("numberLiteral", "stringLiteral"):
        return frozenset()
    if kind in ("parenExpr", "unaryExpr", "subquery"):
        return output_labels(tree["expr"])
    if kind == "aggregation":
        if tree["op"] in _SELECTING_AGGREGATIONS:
            return output_labels(tree["expr"])
        if tree.get("without"):
            return None
        grouping = frozenset(tree.get("grouping") or [])
        if tree["op"] == "count_values" and (tree.get("param") or {}).get("type") == "stringLiteral":
            grouping |= {tree["param"]["val"]}
        return grouping
    if kind == "call":
        name = tree["func"]["name"]
        if name in _LABEL_FREE_FUNCTIONS:
            return frozenset()
        vectors = [a for a in tree.get("args", []) if a["type"] not in ("numberLiteral", "stringLiteral")]
        return output_labels(vectors[0]) if vectors else frozenset()
    if kind == "binaryExpr":
        lhs, rhs = tree["lhs"], tree["rhs"]
        if _is_scalar(rhs):
            return output_labels(lhs)
        if _is_scalar(lhs):
            return output_labels(rhs)
        matching = tree.get("matching") or {}
        if matching.get("card") == "one-to-one" and matching.get("on"):
            return frozenset(matching.get("labels") or [])
        side = rhs if matching.get("card") == "one-to-many" else lhs
        return output_labels(side)
    raise ValueError(f"a node of an unknown type: {kind!r}")
