"""The Grafana dashboard ``deploy/grafana/gpumeter-dashboard.json``, built in code with grafana-foundation-sdk.

Contract:

* ``build_dashboard()`` returns the dashboard (the SDK's ``Dashboard`` model): uid ``gpumeter-costs``, a
  ``datasource`` variable of type ``prometheus`` that every panel, target and query variable uses
  (``${datasource}``), the ``namespace``, ``team`` and ``node`` variables, and five rows -- cost, teams (direct and
  shared cost per team), shares, guard (violations firing by rule and severity, their state changes) and pipeline.
  Every query names only metrics of ``gpumeter.metrics.METRICS`` (tests/unit/billing/test_dashboard.py checks it);
  money is shown in dollars (the counters count micro-dollars: ``/ 1e6``).
* ``dashboard_json()`` is its JSON text as committed: keys sorted, two-space indent, one trailing newline. The same
  text on every run, so the committed file can be compared with it.

Command line (people, CI): ``python -m gpumeter.devtools.dashboard`` writes ``DASHBOARD_PATH``; ``--check`` writes
nothing and exits 1, saying so, when the committed file is not what the code builds (edit this module, never the
JSON). grafana-foundation-sdk comes with the ``test`` extra (``make deps``); this module is never imported by a
service.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, common as common_builders, dashboard, prometheus, stat, table
from grafana_foundation_sdk.builders import timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    Threshold,
    VariableOption,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from gpumeter.devtools.cache import REPO_ROOT

DASHBOARD_PATH = REPO_ROOT / "deploy" / "grafana" / "gpumeter-dashboard.json"
UID = "gpumeter-costs"
PROMETHEUS = DataSourceRef(type_val="prometheus", uid="${datasource}")

# The pod selectors the panels share (the dashboard's variables).
PODS = 'namespace=~"$namespace",team=~"$team"'
NODES = 'node=~"$node"'
PER_HOUR_USD = " * 3600 / 1e6"  # micro-dollars per second -> dollars per hour


class _Ids:
    """Panel ids in the order panels are added: unique, and stable while the order is."""

    def __init__(self) -> None:
        self.last = 0

    def __call__(self) -> int:
        self.last += 1
        return self.last


def _query(expr: str, ref_id: str = "A", legend: str = "", *, instant: bool = False,
           table_format: bool = False) -> prometheus.Dataquery:
    query = (
        prometheus.Dataquery()
        .datasource(PROMETHEUS)
        .expr(expr)
        .legend_format(legend)
        .ref_id(ref_id)
        .format(PromQueryFormat.TABLE if table_format else PromQueryFormat.TIME_SERIES)
    )
    return query.instant() if instant else query.range()


def _stat(ids: _Ids, title: str, expr: str, unit: str, decimals: int) -> stat.Panel:
    return (
        stat.Panel()
        .id(ids())
        .title(title)
        .datasource(PROMETHEUS)
        .span(6)
        .height(4)
        .unit(unit)
        .decimals(decimals)
        .color_scheme(dashboard.FieldColor().mode("thresholds"))
        .thresholds(dashboard.ThresholdsConfig().mode("absolute").steps([_step("blue")]))
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False))
        .color_mode(common.BigValueColorMode.VALUE)
        .graph_mode(common.BigValueGraphMode.NONE)
        .text_mode(common.BigValueTextMode.AUTO)
        .justify_mode(common.BigValueJustifyMode.AUTO)
        .orientation(common.VizOrientation.AUTO)
        .with_target(_query(expr, instant=True))
    )


def _step(color: str) -> Threshold:
    return Threshold(value=None, color=color)


def _timeseries(ids: _Ids, title: str, unit: str, targets: list[prometheus.Dataquery], *, width: int, height: int,
                stacked: bool = True, bars: bool = False, fill_opacity: int = 20, share: bool = False,
                description: str = "") -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .id(ids())
        .title(title)
        .datasource(PROMETHEUS)
        .span(width)
        .height(height)
        .unit(unit)
        .draw_style(common.GraphDrawStyle.BARS if bars else common.GraphDrawStyle.LINE)
        .line_width(1)
        .fill_opacity(fill_opacity)
        .stacking(common_builders.StackingConfig()
                  .mode(common.StackingMode.NORMAL if stacked else common.StackingMode.NONE).group("A"))
        .show_points(common.VisibilityMode.NEVER)
        .span_nulls(False)
        .color_scheme(dashboard.FieldColor().mode("palette-classic"))
        .legend(common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.TABLE)
                .placement(common.LegendPlacement.RIGHT).show_legend(True).calcs(["mean", "max"]))
        .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                 .sort(common.SortOrder.DESCENDING))
    )
    if description:
        panel = panel.description(description)
    if share:
        panel = panel.min(0).max(1)
    for target in targets:
        panel = panel.with_target(target)
    return panel


def _bars(ids: _Ids, title: str, expr: str, legend: str, description: str) -> bargauge.Panel:
    """Dollars over the dashboard's time range, one bar per series, largest first."""
    return (
        bargauge.Panel()
        .id(ids())
        .title(title)
        .description(description)
        .datasource(PROMETHEUS)
        .span(12)
        .height(9)
        .unit("currencyUSD")
        .decimals(2)
        .min(0)
        .color_scheme(dashboard.FieldColor().mode("palette-classic"))
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False))
        .display_mode(common.BarGaugeDisplayMode.BASIC)
        .orientation(common.VizOrientation.HORIZONTAL)
        .with_target(_query(f"sort_desc({expr})", legend=legend, instant=True))
    )


def _query_variable(name: str, label: str, metric: str, metric_label: str) -> dashboard.QueryVariable:
    query = f"label_values({metric}, {metric_label})"
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(PROMETHEUS)
        .query({"query": query, "refId": f"{name}-var"})
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .sort(VariableSort.ALPHABETICAL_ASC)
        .current(VariableOption(selected=True, text="All", value="$__all"))
    )


def build_dashboard():
    """The dashboard model (module docstring)."""
    ids = _Ids()
    pod_cost = "gpumeter_pod_gpu_cost_micro_usd_total"
    shared_cost = "gpumeter_pod_shared_cost_micro_usd_total"
    builder = (
        dashboard.Dashboard("gpumeter: GPU costs and shares")
        .uid(UID)
        .description("Per-pod GPU cost and shares from the gpumeter billing service, and the guard's violations; "
                     "money is exact in the ledger (gpumeter report), these panels are its Prometheus view. "
                     "Generated by gpumeter/devtools/dashboard.py: edit the code, not the JSON.")
        .tags(["gpumeter", "gpu", "cost"])
        .timezone("utc")
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .refresh("1m")
        .time("now-24h", "now")
        .version(1)
        .annotation(dashboard.AnnotationQuery().name("Annotations & Alerts").built_in(1).type("dashboard")
                    .datasource(DataSourceRef(type_val="grafana", uid="-- Grafana --")).enable(True).hide(True)
                    .icon_color("rgba(0, 211, 255, 1)"))
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
                       .multi(False).include_all(False))
        .with_variable(_query_variable("namespace", "Namespace", pod_cost, "namespace"))
        .with_variable(_query_variable("team", "Team", pod_cost, "team"))
        .with_variable(_query_variable("node", "Node", "gpumeter_node_cost_micro_usd_total", "node"))
        # -- cost --
        .with_row(dashboard.Row("Cost").id(ids()))
        .with_panel(_stat(ids, "Node bills in range",
                          f"sum(increase(gpumeter_node_cost_micro_usd_total{{{NODES}}}[$__range])) / 1e6",
                          "currencyUSD", 2))
        .with_panel(_stat(ids, "Billed to pods in range",
                          f"sum(increase({pod_cost}{{{PODS}}}[$__range])) / 1e6", "currencyUSD", 2))
        .with_panel(_stat(ids, "Idle + unattributed share",
                          f'sum(increase(gpumeter_bucket_cost_micro_usd_total{{kind=~"idle|unattributed",{NODES}}}'
                          f"[$__range])) / sum(increase(gpumeter_node_cost_micro_usd_total{{{NODES}}}[$__range]))",
                          "percentunit", 1))
        .with_panel(_stat(ids, "Dead letters in range", "sum(increase(gpumeter_dead_letters_total[$__range]))",
                          "short", 0))
        .with_panel(_timeseries(
            ids, "Cost by namespace", "currencyUSD",
            [_query(f"sum by (namespace) (rate({pod_cost}{{{PODS}}}[$__rate_interval])){PER_HOUR_USD}",
                    legend="{{namespace}}")], width=12, height=9))
        .with_panel(_timeseries(
            ids, "Cost by team (direct, and shared by the sharing policy)", "currencyUSD",
            [_query(f"sum by (team) (rate({pod_cost}{{{PODS}}}[$__rate_interval])){PER_HOUR_USD}",
                    legend="{{team}}"),
             _query(f"sum by (team) (rate({shared_cost}{{{PODS}}}[$__rate_interval])){PER_HOUR_USD}", "B",
                    legend="{{team}} shared")], width=12, height=9))
        .with_panel(
            table.Panel()
            .id(ids())
            .title("Top pods by cost")
            .datasource(PROMETHEUS)
            .span(12)
            .height(10)
            .unit("currencyUSD")
            .decimals(4)
            .align(common.FieldTextAlignment.AUTO)
            .inspect(False)
            .show_header(True)
            .sort_by([common_builders.TableSortByFieldState().display_name("Value").desc(True)])
            .with_target(_query(f"topk(20, sum by (namespace, pod, team) (increase({pod_cost}{{{PODS}}}"
                                "[$__range])) / 1e6)", instant=True, table_format=True)))
        .with_panel(_timeseries(
            ids, "Idle and unattributed cost", "currencyUSD",
            [_query(f"sum by (kind) (rate(gpumeter_bucket_cost_micro_usd_total{{{NODES}}}[$__rate_interval]))"
                    f"{PER_HOUR_USD}", legend="{{kind}}")], width=12, height=10))
        .with_panel(_timeseries(
            ids, "Node bills", "currencyUSD",
            [_query(f"sum by (node, instance_type) (rate(gpumeter_node_cost_micro_usd_total{{{NODES}}}"
                    f"[$__rate_interval])){PER_HOUR_USD}", legend="{{node}} ({{instance_type}})")],
            width=24, height=8))
        # -- teams --
        .with_row(dashboard.Row("Teams").id(ids()))
        .with_panel(_bars(
            ids, "Direct cost per team in range",
            f"sum by (team) (increase({pod_cost}{{{PODS}}}[$__range])) / 1e6", "{{team}}",
            "What each team's pods used themselves (their direct lines)."))
        .with_panel(_bars(
            ids, "Shared cost per team in range, by bucket",
            f"sum by (team, shared_from) (increase({shared_cost}{{{PODS}}}[$__range])) / 1e6",
            "{{team}} ({{shared_from}})",
            "The buckets no pod used (idle, unattributed, node_other, ...) that the sharing policy shared to each "
            "team's pods; empty with the default policy, which keeps them."))
        # -- shares --
        .with_row(dashboard.Row("Shares").id(ids()))
        .with_panel(_timeseries(
            ids, "Memory share per pod per GPU", "percentunit",
            [_query(f"gpumeter_pod_gpu_memory_share{{{PODS}}}",
                    legend="{{namespace}}/{{pod}} on {{gpu_uuid}} ({{Hostname}})")],
            width=12, height=9, stacked=False, fill_opacity=10, share=True))
        .with_panel(_timeseries(
            ids, "Compute share per pod per GPU", "percentunit",
            [_query(f"gpumeter_pod_gpu_compute_share{{{PODS}}}",
                    legend="{{namespace}}/{{pod}} on {{gpu_uuid}} ({{Hostname}})")],
            width=12, height=9, stacked=False, fill_opacity=10, share=True))
        # -- guard --
        .with_row(dashboard.Row("Guard").id(ids()))
        .with_panel(_timeseries(
            ids, "Guard violations firing by rule and severity", "short",
            [_query("sum by (rule, severity) (gpumeter_guard_violations_firing)",
                    legend="{{rule}} ({{severity}})")], width=12, height=8, fill_opacity=10,
            description="Violations the guard holds firing now (gpumeter violations --active lists them)."))
        .with_panel(_timeseries(
            ids, "Guard violation state changes", "short",
            [_query("sum by (rule, state) (increase(gpumeter_guard_violation_transitions_total"
                    "[$__rate_interval]))", legend="{{rule}} {{state}}")],
            width=12, height=8, stacked=False, bars=True, fill_opacity=10))
        # -- pipeline --
        .with_row(dashboard.Row("Pipeline").id(ids()))
        .with_panel(_timeseries(
            ids, "Dead letters", "short",
            [_query("sum by (service, reason_code) (rate(gpumeter_dead_letters_total[$__rate_interval]))",
                    legend="{{service}} {{reason_code}}"),
             _query("sum by (service) (rate(gpumeter_dead_letters_truncated_total[$__rate_interval]))", "B",
                    legend="{{service}} cut to fit")],
            width=8, height=8, stacked=False, bars=True, fill_opacity=10))
        .with_panel(_timeseries(
            ids, "Ledger rows", "short",
            [_query("sum(rate(gpumeter_billing_ledger_rows_written_total[$__rate_interval]))", legend="written"),
             _query("sum(rate(gpumeter_billing_duplicate_rows_total[$__rate_interval]))", "B",
                    legend="already in the ledger")],
            width=8, height=8, stacked=False, fill_opacity=10))
        .with_panel(_timeseries(
            ids, "Messages consumed", "short",
            [_query("sum by (service, topic) (rate(gpumeter_messages_consumed_total[$__rate_interval]))",
                    legend="{{service}} {{topic}}")],
            width=8, height=8, stacked=False, fill_opacity=10))
        .with_panel(_timeseries(
            ids, "Recent dead-letter ratio", "percentunit",
            [_query("max by (service) (gpumeter_recent_dead_letter_ratio)", legend="{{service}}")],
            width=24, height=6, stacked=False, fill_opacity=10,
            description="Share of each consumer's input of the last GPUMETER_DEAD_LETTER_WINDOW_SECONDS that was "
                        "dead-lettered; above GPUMETER_DEAD_LETTER_MAX_RATIO its /healthz says degraded."))
    )
    return builder.build()


def dashboard_json() -> str:
    """The dashboard's JSON text as committed (module docstring)."""
    return JSONEncoder(sort_keys=True, indent=2).encode(build_dashboard()) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpumeter.devtools.dashboard",
                                     description="Write (or check) deploy/grafana/gpumeter-dashboard.json.")
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed file differs")
    parser.add_argument("--output", type=Path, default=DASHBOARD_PATH, help=f"default {DASHBOARD_PATH}")
    args = parser.parse_args(argv)
    text = dashboard_json()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else None
        if current != text:
            print(f"{args.output} is not what gpumeter/devtools/dashboard.py builds: run "
                  "python -m gpumeter.devtools.dashboard", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output} ({len(text):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
