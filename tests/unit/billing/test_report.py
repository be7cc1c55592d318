"""Reports from the ledger: by namespace, team label, node and GPU; formats; reconciliation to the node bills."""

from __future__ import annotations

import argparse
import csv
import io
import json
from collections import defaultdict

import pytest
from sqlalchemy import text

from gpumeter.clock import ManualClock
from gpumeter.errors import ConfigError
from services.billing import report as report_module
from services.billing.costing import iso_utc
from services.billing.ledger import Grouping
from services.billing.report import (
    build_report,
    format_report,
    parse_duration_seconds,
    parse_instant_ms,
    usd_text,
)
from tests.unit.billing.conftest import WINDOW_START_MS, sample_costs

WINDOWS = 3
END_MS = WINDOW_START_MS + WINDOWS * 60_000


@pytest.fixture
def filled_ledger(sqlite_ledger):
    results = sample_costs(WINDOWS)
    sqlite_ledger.write([c for r in results for c in r.costs], [r.bill for r in results])
    return sqlite_ledger, results


def expected_lines(results, key):
    """(kind, group) → micro-dollars, computed from the cost records themselves."""
    sums = defaultdict(int)
    for cost in (c for r in results for c in r.costs):
        sums[(cost.subject_kind.value.lower(), key(cost))] += cost.cost_micro_usd
    return dict(sums)


def lines_of(report):
    return {(line.kind, line.group): line.cost_micro_usd for line in report.lines}


def test_by_namespace_reconciles_to_the_node_bills(filled_ledger):
    ledger, results = filled_ledger
    report = build_report(ledger, Grouping("namespace"), start_ms=WINDOW_START_MS, end_ms=END_MS)
    assert lines_of(report) == expected_lines(results, lambda c: c.namespace)
    bills_total = sum(r.bill.node_cost_micro_usd for r in results)
    assert report.total_micro_usd == bills_total
    rec = report.reconciliation
    assert (rec.node_bills_micro_usd, rec.node_windows, rec.reconciled) == (bills_total, len(results), True)
    # Buckets are lines of their own, after the pods.
    kinds = [line.kind for line in report.lines]
    assert kinds == sorted(kinds, key=["pod", "idle", "driver_reserved", "unattributed", "unavailable",
                                       "node_other"].index)
    assert {"idle", "driver_reserved", "unattributed", "unavailable", "node_other"} <= set(kinds)
    assert all(line.group is None for line in report.lines if line.kind != "pod")
    pod_costs = [line.cost_micro_usd for line in report.lines if line.kind == "pod"]
    assert pod_costs == sorted(pod_costs, reverse=True)


def test_by_team_label_puts_unlabelled_pods_on_their_own_line(filled_ledger):
    ledger, results = filled_ledger
    report = build_report(ledger, Grouping.parse("label:team"), start_ms=WINDOW_START_MS, end_ms=END_MS)
    expected = expected_lines(results, lambda c: c.labels.get("team"))
    expected = {(k, g if g is not None or k != "pod" else "(no team label)"): v for (k, g), v in expected.items()}
    assert lines_of(report) == expected
    assert ("pod", "(no team label)") in expected
    assert report.reconciliation.reconciled
    assert report.total_micro_usd == sum(r.bill.node_cost_micro_usd for r in results)


def test_by_node_and_gpu_and_a_narrower_window(filled_ledger):
    ledger, results = filled_ledger
    by_node = build_report(ledger, Grouping("node"), start_ms=WINDOW_START_MS, end_ms=END_MS)
    assert lines_of(by_node) == expected_lines(results, lambda c: c.node_name)
    by_gpu = build_report(ledger, Grouping("gpu"), start_ms=WINDOW_START_MS, end_ms=END_MS)
    assert lines_of(by_gpu) == expected_lines(results, lambda c: c.gpu_uuid)
    last = build_report(ledger, Grouping("node"), start_ms=END_MS - 60_000, end_ms=END_MS)
    last_bills = [r.bill for r in results if r.bill.window_start_unix_ms == END_MS - 60_000]
    assert last.total_micro_usd == sum(b.node_cost_micro_usd for b in last_bills)
    assert last.reconciliation.node_windows == len(last_bills) == 2
    assert last.reconciliation.reconciled


def test_by_pod_is_one_line_per_namespace_and_name_summing_its_incarnations(filled_ledger):
    ledger, results = filled_ledger
    pods = [c for r in results for c in r.costs if c.subject_kind.value == "POD"]
    recreated = pods[0]
    # The pod deleted and created again under its name (a StatefulSet's): its first window's lines get a new uid.
    with ledger.engine.begin() as connection:
        changed = connection.execute(text("UPDATE cost_lines SET pod_uid = 'uid-of-the-new-incarnation' "
                                          "WHERE pod_uid = :uid AND window_start_unix_ms = :start"),
                                     {"uid": recreated.pod_uid, "start": WINDOW_START_MS}).rowcount
    assert changed >= 1
    report = build_report(ledger, Grouping.parse("pod"), start_ms=WINDOW_START_MS, end_ms=END_MS)
    expected = expected_lines(results, lambda c: f"{c.namespace}/{c.pod_name}" if c.pod_name else None)
    assert lines_of(report) == expected
    name = f"{recreated.namespace}/{recreated.pod_name}"
    assert expected[("pod", name)] == sum(c.cost_micro_usd for c in pods
                                          if (c.namespace, c.pod_name) == (recreated.namespace, recreated.pod_name))
    assert report.reconciliation.reconciled
    assert report.grouping.describe() == "pod" and name in format_report(report, "table")
    # A pod line the attributor could not name is a line of its own, not a blank.
    with ledger.engine.begin() as connection:
        connection.execute(text("UPDATE cost_lines SET namespace = NULL, pod_name = NULL WHERE pod_uid = :uid"),
                           {"uid": recreated.pod_uid})
    unnamed = build_report(ledger, Grouping.parse("pod"), start_ms=WINDOW_START_MS, end_ms=END_MS)
    assert ("pod", "(pod name unknown)") in lines_of(unnamed) and unnamed.reconciliation.reconciled


def test_a_ledger_that_does_not_add_up_is_reported_as_a_mismatch(filled_ledger):
    ledger, _ = filled_ledger
    with ledger.engine.begin() as connection:
        connection.execute(text("UPDATE cost_lines SET cost_micro_usd = cost_micro_usd + 7 "
                                "WHERE subject_kind = 'IDLE' AND gpu_uuid = 'GPU-gcp-0' AND "
                                "window_start_unix_ms = :start"), {"start": WINDOW_START_MS})
    report = build_report(ledger, Grouping("namespace"), start_ms=WINDOW_START_MS, end_ms=END_MS)
    assert report.reconciliation.difference_micro_usd == 7
    assert not report.reconciliation.reconciled
    assert "MISMATCH by 0.000007 USD" in report.reconciliation.statement()


def test_formats(filled_ledger):
    ledger, results = filled_ledger
    report = build_report(ledger, Grouping.parse("label:team"), start_ms=WINDOW_START_MS, end_ms=END_MS)
    total = sum(r.bill.node_cost_micro_usd for r in results)

    table = format_report(report, "table")
    assert "label:team" in table and "TOTAL" in table and usd_text(total) in table
    assert f"reconciliation: total {usd_text(total)} USD vs the sum of {len(results)} node bills" in table
    *_, reconciliation, emitted = table.splitlines()
    assert reconciliation.startswith("reconciliation: ") and reconciliation.endswith("reconciled, equal to the "
                                                                                    "micro-dollar")
    assert emitted == (
        "emitted windows: not checked against the node-window-shares topic (no Kafka bootstrap servers given)")

    rows = list(csv.DictReader(io.StringIO(format_report(report, "csv"))))
    lines = [r for r in rows if r["kind"] not in ("total", "node_bills", "reconciliation", "node_pricing")]
    assert sum(int(r["cost_micro_usd"]) for r in lines) == total
    by_kind = {r["kind"]: r for r in rows}
    assert int(by_kind["total"]["cost_micro_usd"]) == int(by_kind["node_bills"]["cost_micro_usd"]) == total
    assert by_kind["reconciliation"]["group"] == "reconciled"

    document = json.loads(format_report(report, "json"))
    assert document["by"] == "label:team" and document["total_micro_usd"] == total
    assert document["window_start"] == iso_utc(WINDOW_START_MS)
    assert document["reconciliation"]["reconciled"] is True
    assert sum(line["cost_micro_usd"] for line in document["lines"]) == total
    assert {line["kind"] for line in document["lines"]} == {"pod", "idle", "driver_reserved", "unattributed",
                                                             "unavailable", "node_other"}
    with pytest.raises(ConfigError):
        format_report(report, "xml")


def test_the_report_says_how_each_node_was_split_and_what_went_to_node_other(filled_ledger):
    ledger, results = filled_ledger
    report = build_report(ledger, Grouping("namespace"), start_ms=WINDOW_START_MS, end_ms=END_MS)
    expected = defaultdict(lambda: [0, 0, 0, set()])
    for r in results:
        entry = expected[r.bill.node_name]
        entry[0] += 1
        entry[1] += r.bill.node_cost_micro_usd
        entry[2] += r.bill.node_other_micro_usd
        entry[3].add(r.bill.price.split_rule.value)
    assert {p.node_name: [p.node_windows, p.node_cost_micro_usd, p.node_other_micro_usd, {p.split_rule}]
            for p in report.pricing} == {k: v for k, v in expected.items()}
    node_other = sum(r.bill.node_other_micro_usd for r in results)
    assert report.node_other_micro_usd == node_other
    table = format_report(report, "table")
    assert f"node_other: {usd_text(node_other)} USD" in table
    for p in report.pricing:
        assert f"{p.node_name} ({p.instance_type}, {p.price_model}): split rule {p.split_rule}" in table
    rows = [r for r in csv.DictReader(io.StringIO(format_report(report, "csv"))) if r["kind"] == "node_pricing"]
    assert sum(int(r["cost_micro_usd"]) for r in rows) == node_other
    document = json.loads(format_report(report, "json"))
    assert sum(p["node_other_micro_usd"] for p in document["pricing"]) == document["node_other_micro_usd"]


def _args(**overrides):
    parser = argparse.ArgumentParser()
    report_module.add_arguments(parser)
    argv = []
    for name, value in overrides.items():
        argv += [f"--{name.replace('_', '-')}", value]
    return parser.parse_args(argv)


def test_command_line_reports_and_exit_codes(filled_ledger, tmp_path):
    ledger, results = filled_ledger
    out, err = io.StringIO(), io.StringIO()
    clock = ManualClock(END_MS)
    code = report_module.main(_args(window="3m", by="namespace", format="json"), {"GPUMETER_LEDGER_URL": ledger.url},
                              clock=clock, out=out, err=err)
    assert code == 0, err.getvalue()
    document = json.loads(out.getvalue())
    assert document["total_micro_usd"] == sum(r.bill.node_cost_micro_usd for r in results)
    assert document["window_end"] == iso_utc(END_MS)

    with ledger.engine.begin() as connection:
        connection.execute(text("DELETE FROM cost_lines WHERE subject_kind = 'NODE_OTHER'"))
    assert report_module.main(_args(window="3m", ledger_url=ledger.url), {}, clock=clock, out=io.StringIO(),
                              err=io.StringIO()) == 1

    empty_err = io.StringIO()
    fresh = f"sqlite:///{tmp_path / 'never-migrated.sqlite3'}"
    assert report_module.main(_args(ledger_url=fresh), {}, clock=clock, out=io.StringIO(), err=empty_err) == 2
    assert "schema revision" in empty_err.getvalue()
    assert report_module.main(_args(ledger_url=ledger.url, by="colour"), {}, clock=clock, out=io.StringIO(),
                              err=io.StringIO()) == 2


def test_durations_and_instants():
    assert [parse_duration_seconds(t) for t in ("90m", "24h", "7d", "3600s", "2w")] == [
        5400, 86400, 604800, 3600, 1209600]
    for bad in ("", "0h", "24", "1.5h", "h"):
        with pytest.raises(ConfigError):
            parse_duration_seconds(bad)
    assert parse_instant_ms(iso_utc(WINDOW_START_MS)) == WINDOW_START_MS
    assert parse_instant_ms("2026-11-29T17:00:00") == parse_instant_ms("2026-11-29T18:00:00+01:00")
    with pytest.raises(ConfigError):
        parse_instant_ms("yesterday")
    assert usd_text(1_234_567) == "1.234567" and usd_text(-7) == "-0.000007"


def _with_carried_labels(results, carried: str):
    """``results`` as the attributor makes them when it carries only ``carried`` (comma-separated) labels."""
    import dataclasses

    from schemas.records import CostSubjectKind

    keys = carried.split(",")
    out = []
    for result in results:
        costs = tuple(
            dataclasses.replace(c, labels={k: v for k, v in c.labels.items() if k in keys},
                                carried_label_keys=tuple(sorted(keys)))
            if c.subject_kind is CostSubjectKind.POD else c for c in result.costs)
        out.append(dataclasses.replace(result, costs=costs))
    return out


def test_grouping_by_a_label_that_was_not_carried_says_so(sqlite_ledger):
    results = _with_carried_labels(sample_costs(WINDOWS), "model,team")
    sqlite_ledger.write([c for r in results for c in r.costs], [r.bill for r in results])
    pods = [c for r in results for c in r.costs if c.subject_kind.value == "POD"]

    by_owner = build_report(sqlite_ledger, Grouping.parse("label:owner"), start_ms=WINDOW_START_MS, end_ms=END_MS)
    assert [line.group for line in by_owner.lines if line.kind == "pod"] == ["(label owner not carried)"]
    carriage = by_owner.carriage
    assert (carriage.lines_not_carried, carriage.pod_lines, carriage.carried_elsewhere) == (len(pods), len(pods),
                                                                                             ("model,team",))
    assert carriage.cost_not_carried_micro_usd == sum(c.cost_micro_usd for c in pods)
    table = format_report(by_owner, "table")
    assert "labels: label 'owner' was not carried on" in table and "GPUMETER_GROUPING_LABELS" in table
    assert json.loads(format_report(by_owner, "json"))["labels_not_carried"]["cost_lines"] == len(pods)
    assert by_owner.reconciliation.reconciled

    by_team = build_report(sqlite_ledger, Grouping.parse("label:team"), start_ms=WINDOW_START_MS, end_ms=END_MS)
    assert by_team.carriage is None  # carried: pods without it simply had none
    assert "(no team label)" in {line.group for line in by_team.lines}


def test_every_emitted_window_must_be_in_the_ledger_once_it_had_time_to_be_billed():
    from services.billing.costing import NodeWindowKey
    from services.billing.report import check_emitted

    keys = [NodeWindowKey("c", f"node-{i}", WINDOW_START_MS) for i in range(5)]
    emitted = {keys[0]: 1_000, keys[1]: 1_000, keys[2]: 2_000, keys[3]: 2_000, keys[4]: 100_000}
    check = check_emitted(emitted, {keys[2]: frozenset({"NO_PRICE"})}, {keys[0]}, now_ms=110_000,
                          settle_seconds=60)
    assert not check.complete and (check.emitted, check.in_flight) == (4, 1)
    assert check.missing == ((keys[1], frozenset()), (keys[2], frozenset({"NO_PRICE"})), (keys[3], frozenset()))
    assert check.statement().startswith("WARNING: 3 of 4 node-windows emitted more than 60 s ago are NOT in the "
                                        "ledger (2 never billed (billing behind, stopped or stuck); dead-lettered "
                                        "by billing: NO_PRICE 1;")
    assert check_emitted(emitted, {}, set(keys), now_ms=110_000).complete


# --- sharing: direct and shared parts ------------------------------------------------------------------------------


def _team_parts(results, team_label="team"):
    """(team or None) → [direct, shared] micro-dollars of the pod lines, from the cost records themselves."""
    parts = defaultdict(lambda: [0, 0])
    for cost in (c for r in results for c in r.costs if c.subject_kind.value == "POD"):
        parts[cost.labels.get(team_label)][1 if cost.is_shared else 0] += cost.cost_micro_usd
    return {team: tuple(v) for team, v in parts.items()}


def test_with_every_bucket_kept_the_table_is_what_it_was(filled_ledger):
    ledger, _ = filled_ledger
    report = build_report(ledger, Grouping.parse("label:team"), start_ms=WINDOW_START_MS, end_ms=END_MS)
    assert not report.shares_anything and report.shared_micro_usd == 0
    table = format_report(report, "table").splitlines()
    assert table[1].split() == ["kind", "label:team", "cost_usd", "share", "lines"]
    assert not [line for line in table if line.startswith(("sharing:", "allocated to pods:"))]
    assert all(line.direct_micro_usd == line.cost_micro_usd for line in report.lines)


def test_a_shared_report_splits_every_teams_cost_into_direct_and_shared_and_gives_pods_the_whole_bill(
        sqlite_ledger):
    results = sample_costs(WINDOWS, sharing="idle=weighted,node_other=weighted,driver_reserved=even,"
                                           "unattributed=requests,unavailable=weighted")
    sqlite_ledger.write([c for r in results for c in r.costs], [r.bill for r in results])
    report = build_report(sqlite_ledger, Grouping.parse("label:team"), start_ms=WINDOW_START_MS, end_ms=END_MS)
    bills = sum(r.bill.node_cost_micro_usd for r in results)
    assert report.reconciliation.reconciled and report.total_micro_usd == bills
    # Every node-window has pods: every bucket went to them, the pods carry the whole bill.
    assert {line.kind for line in report.lines} == {"pod"} and report.pods_micro_usd == bills
    parts = _team_parts(results)
    assert {line.group: (line.direct_micro_usd, line.shared_micro_usd) for line in report.lines} == {
        (team if team is not None else "(no team label)"): p for team, p in parts.items()}
    assert report.shared_micro_usd == sum(s for _, s in parts.values()) > 0
    assert {(s.shared_from, s.sharing_method) for s in report.shared_sources} == {
        ("IDLE", "weighted"), ("NODE_OTHER", "weighted"), ("DRIVER_RESERVED", "even"), ("UNATTRIBUTED", "requests"),
        ("UNAVAILABLE", "weighted")}

    table = format_report(report, "table")
    lines = table.splitlines()
    assert lines[1].split() == ["kind", "label:team", "cost_usd", "direct_usd", "shared_usd", "share", "lines"]
    research = next(line for line in report.lines if line.group == "research")
    (row,) = [line.split() for line in lines if line.split()[:2] == ["pod", "research"]]
    assert row[2:5] == [usd_text(research.cost_micro_usd), usd_text(research.direct_micro_usd),
                        usd_text(research.shared_micro_usd)]
    assert f"allocated to pods: {usd_text(bills)} USD, 100.00% of the node bills" in table
    assert "sharing: idle=weighted,driver_reserved=even,unattributed=requests,unavailable=weighted," \
           f"node_other=weighted ({len(results)} node-windows)" in table

    rows = list(csv.DictReader(io.StringIO(format_report(report, "csv"))))
    pods = [r for r in rows if r["kind"] == "pod"]
    assert {r["group"]: (int(r["direct_micro_usd"]), int(r["shared_micro_usd"])) for r in pods} == {
        line.group: (line.direct_micro_usd, line.shared_micro_usd) for line in report.lines}
    assert all(int(r["direct_micro_usd"]) + int(r["shared_micro_usd"]) == int(r["cost_micro_usd"]) for r in pods)
    assert sum(int(r["cost_micro_usd"]) for r in rows if r["kind"] == "shared_from") == report.shared_micro_usd
    assert [r["group"] for r in rows if r["kind"] == "sharing_policy"] == [report.sharing_policies[0][0]]

    document = json.loads(format_report(report, "json"))
    assert document["pods_micro_usd"] == bills and document["shared_micro_usd"] == report.shared_micro_usd
    assert all(l["direct_micro_usd"] + l["shared_micro_usd"] == l["cost_micro_usd"] for l in document["lines"])
    assert sum(s["cost_micro_usd"] for s in document["sharing"]["shared_to_pods"]) == report.shared_micro_usd


def test_a_window_without_pods_keeps_its_buckets_under_any_policy(sqlite_ledger):
    from services.billing.catalog import PriceCatalog
    from services.billing.costing import bill_node_window
    from services.billing.pricing import DEFAULT_SPLIT_POLICY
    from services.billing.sharing import SharingPolicy
    from schemas.records import ShareSubjectKind
    from tests.unit.billing.conftest import Unit, bucket, node_window

    empty = node_window([Unit("GPU-gcp-0", [bucket(ShareSubjectKind.IDLE, 1.0)])], node="gcp-node",
                        provider="gcp", region="us-central1", instance_type="a2-highgpu-1g")
    priced = bill_node_window(empty, PriceCatalog.load(), DEFAULT_SPLIT_POLICY, SharingPolicy.parse("all=weighted"))
    sqlite_ledger.write(priced.costs, [priced.bill])
    report = build_report(sqlite_ledger, Grouping("namespace"), start_ms=WINDOW_START_MS, end_ms=END_MS)
    assert {line.kind for line in report.lines} == {"idle", "node_other"} and report.pods_micro_usd == 0
    assert report.shares_anything  # the policy shares, there was nobody to share to
    table = format_report(report, "table")
    assert "allocated to pods: 0.000000 USD, 0.00% of the node bills" in table
    # What is kept is named bucket by bucket, so an unallocated part of the bill says where it is.
    idle, other = (sum(l.cost_micro_usd for l in report.lines if l.kind == kind) for kind in ("idle", "node_other"))
    assert idle > 0 and other > 0
    assert (f"kept as buckets {usd_text(idle + other)} USD (idle {usd_text(idle)}, node_other {usd_text(other)})"
            in table)
