"""gpumeter.devtools.prometheus: the throwaway server of our Prometheus build, and the readers of its parser's syntax
tree that the deployment and dashboard tests check PromQL with (metric names, matchers, the labels grouped by, the
labels a result keeps). The trees come from the real parser (the session's ``promql`` server), so the readers are
checked against what Prometheus makes of each form, not against a tree written by hand."""

from __future__ import annotations

import pytest

from gpumeter.devtools.prometheus import (
    PrometheusApiError,
    PrometheusServer,
    Selector,
    labels_read,
    metric_names,
    output_labels,
    selectors,
)

pytestmark = pytest.mark.network


def test_the_readers_tell_metrics_from_functions_keywords_and_labels(promql):
    tree = promql.parse('sum by (a, b) (rate(x_total{c="1", d=~"e|f"}[5m])) / on (g) group_left (h) y > bool 0.5 '
                        'and max without (i) (z offset 1h)')
    assert metric_names(tree) == {"x_total", "y", "z"}
    assert labels_read(tree) == {"a", "b", "c", "d", "g", "h", "i"}
    assert selectors(promql.parse('a{x="1", y!="2"} / on (b) c and d{e=~"f"}')) == [
        Selector("a", (("x", "=", "1"), ("y", "!=", "2"))), Selector("c", ()), Selector("d", (("e", "=~", "f"),))]
    # Functions and aggregations are not metrics, even when spelt like one; a metric named like a keyword is.
    assert metric_names(promql.parse("rate(sum_total[1m]) + count(max_over_time(bool_gauge[1m]))")) == {
        "sum_total", "bool_gauge"}
    # A selector by __name__ alone names no metric: the tests that read metric names refuse it.
    (nameless,) = selectors(promql.parse('{__name__=~"gpumeter_.*", job="x"}'))
    assert nameless.metric == "" and ("__name__", "=~", "gpumeter_.*") in nameless.matchers


@pytest.mark.parametrize("expr, labels", [
    ("x", None),
    ("sum(x)", frozenset()),
    ("sum by (a, b) (rate(x[5m])) * 3600 / 1e6", frozenset({"a", "b"})),
    ("sum without (a) (x)", None),
    ("topk(20, sum by (namespace, pod) (increase(x[1h])) / 1e6)", frozenset({"namespace", "pod"})),
    ("sort_desc(sum by (team) (x))", frozenset({"team"})),
    ("max by (service) (x) > 0.5", frozenset({"service"})),
    ("sum by (a) (x) / on (a) sum by (a, b) (y)", frozenset({"a"})),
    ("sum by (a) (x) / sum(y)", frozenset({"a"})),
    ('count_values("v", x)', frozenset({"v"})),
    ("vector(1)", frozenset()),
    ("1 + 2", frozenset()),
])
def test_output_labels_follow_prometheus_result_labels(promql, expr, labels):
    assert output_labels(promql.parse(expr)) == labels


def test_a_syntax_error_is_prometheus_own_bad_data(promql):
    with pytest.raises(PrometheusApiError) as raised:
        promql.parse("sum(rate(x[5m])")
    assert raised.value.error_type == "bad_data" and "unclosed left parenthesis" in raised.value.error
    with pytest.raises(PrometheusApiError):
        promql.parse("sum by (a) rate(x[5m])")  # a by clause wants its parentheses before the body


def test_a_server_starts_answers_queries_and_is_removed_on_stop(go_tools, tmp_path):
    server = PrometheusServer(go_tools["prometheus"], base_dir=tmp_path)
    with server:
        root = server.root
        assert root is not None and (root / "prometheus.yml").is_file()
        assert server.query("vector(42)")[0]["value"][1] == "42"
        assert server.query("1 + 1")[1] == "2"  # a scalar: [time, value]
        assert server.targets() == []
        version = server.api_get("status/buildinfo")["version"]
        assert version == "3.16.0"
    assert not root.exists()
    server.stop()  # twice: nothing to do
