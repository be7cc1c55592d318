"""OpenCost's /allocation over the ledger: parameters, the allocation shape, shareIdle/includeIdle, and totals
equal to ``gpumeter report`` (the WSGI app called in-process on a SQLite ledger; over HTTP on PostgreSQL in
tests/integration/test_allocation_api.py)."""

from __future__ import annotations

import io
import json
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from wsgiref.util import setup_testing_defaults

import pytest

from gpumeter.clock import ManualClock
from services.billing.allocation import BadQuery, parse_query, parse_window
from services.billing.api import AllocationApi, ApiSettings, add_arguments, api_settings
from services.billing.ledger import Grouping, Ledger, LedgerError
from services.billing.report import build_report
from tests.unit.billing.conftest import WINDOW_START_MS, sample_costs

WINDOWS = 3
END_MS = WINDOW_START_MS + WINDOWS * 60_000


def ms(text: str) -> int:
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def iso(unix_ms: int) -> str:
    return datetime.fromtimestamp(unix_ms / 1000, tz=timezone.utc).isoformat(timespec="seconds").replace("+00:00",
                                                                                                          "Z")


NOW = ms("2026-12-02T15:37:20Z")  # a Wednesday


@pytest.mark.parametrize(("window", "start", "end"), [
    ("today", "2026-12-02T00:00:00Z", "2026-12-03T00:00:00Z"),
    ("yesterday", "2026-12-01T00:00:00Z", "2026-12-02T00:00:00Z"),
    ("week", "2026-11-29T00:00:00Z", "2026-12-02T15:37:20Z"),  # weeks start on Sunday, as OpenCost's
    ("lastweek", "2026-11-22T00:00:00Z", "2026-11-29T00:00:00Z"),
    ("month", "2026-12-01T00:00:00Z", "2026-12-02T15:37:20Z"),
    ("lastmonth", "2026-11-01T00:00:00Z", "2026-12-01T00:00:00Z"),
    ("24h", "2026-12-01T16:00:00Z", "2026-12-02T16:00:00Z"),  # rounded forward to the hour
    ("45m", "2026-12-02T14:53:00Z", "2026-12-02T15:38:00Z"),
    ("7d", "2026-11-26T00:00:00Z", "2026-12-03T00:00:00Z"),  # rounded forward to midnight
    ("2w", "2026-11-19T00:00:00Z", "2026-12-03T00:00:00Z"),
    ("2h offset 1h", "2026-12-02T12:37:20Z", "2026-12-02T14:37:20Z"),
    ("1586822400,1586908800", "2020-04-14T00:00:00Z", "2020-04-15T00:00:00Z"),
    ("2020-04-01T00:00:00Z,2020-04-03T00:00:00Z", "2020-04-01T00:00:00Z", "2020-04-03T00:00:00Z"),
])
def test_the_window_forms_of_opencost(window, start, end):
    assert parse_window(window, NOW) == (ms(start), ms(end))


@pytest.mark.parametrize(("params", "says"), [
    ({}, "window is required"),
    ({"window": "fortnight"}, "is not one of today"),
    ({"window": "2020-04-03T00:00:00Z,2020-04-01T00:00:00Z"}, "ends before it starts"),
    ({"window": "400d"}, "at most 93 days"),
    ({"window": "1d", "aggregate": "controller"}, "is not one of namespace, pod, node, cluster or label:<key>"),
    ({"window": "1d", "aggregate": "label:"}, "label:<key> needs a Kubernetes label key"),
    ({"window": "1d", "aggregate": "label:bad key"}, "label:<key> needs a Kubernetes label key"),
    ({"window": "1d", "step": "30s"}, "is not a duration"),
    ({"window": "1d", "step": "0m"}, "shorter than 60 s"),
    ({"window": "90d", "step": "1m"}, "at most 1000"),
    ({"window": "1d", "includeIdle": "yes"}, "is not true or false"),
    ({"window": "1d", "filter": "namespace:ml"}, "unsupported parameter filter"),
])
def test_bad_parameters_are_refused_with_what_is_wrong_and_what_is_allowed(params, says):
    with pytest.raises(BadQuery) as caught:
        parse_query(params, NOW)
    assert says in str(caught.value)


def test_steps_split_the_window_and_accumulate_merges_them():
    query = parse_query({"window": "2020-04-01T00:00:00Z,2020-04-01T02:30:00Z", "step": "1h"}, NOW)
    assert [(iso(s), iso(e)) for s, e in query.steps] == [
        ("2020-04-01T00:00:00Z", "2020-04-01T01:00:00Z"), ("2020-04-01T01:00:00Z", "2020-04-01T02:00:00Z"),
        ("2020-04-01T02:00:00Z", "2020-04-01T02:30:00Z")]
    merged = parse_query({"window": "2020-04-01T00:00:00Z,2020-04-01T02:30:00Z", "step": "1h", "accumulate": "true"},
                         NOW)
    assert len(merged.steps) == 1
    assert (query.include_idle, query.share_idle, query.idle_by_node) == (False, False, False)


# --------------------------------------------------------------------------------------------------------------
# The app on a ledger


def call(app, path="/allocation", query="", method="GET", *, headers=None, seen=None):
    """(status code, JSON body or raw bytes); ``seen`` (a dict) gets the response headers."""
    environ = {"PATH_INFO": path, "QUERY_STRING": query, "REQUEST_METHOD": method}
    for name, value in (headers or {}).items():
        environ["HTTP_" + name.upper().replace("-", "_")] = value
    setup_testing_defaults(environ)
    environ["wsgi.input"] = io.BytesIO(b"")
    status = []
    body = b"".join(app(environ, lambda s, headers: status.append((s, headers))))
    code = int(status[0][0].split()[0])
    if seen is not None:
        seen.update(dict(status[0][1]))
    if dict(status[0][1]).get("Content-Type") != "application/json":
        return code, body
    return code, json.loads(body) if body else None


def fallback(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"metrics"]


def window_param(start=WINDOW_START_MS, end=END_MS) -> str:
    return f"window={iso(start)},{iso(end)}"


@pytest.fixture
def api(sqlite_ledger):
    def make(sharing="keep"):
        results = sample_costs(WINDOWS, sharing=sharing)
        sqlite_ledger.write([c for r in results for c in r.costs], [r.bill for r in results])
        reader = Ledger(sqlite_ledger.url, read_only=True)
        return AllocationApi(reader, fallback, clock=ManualClock(END_MS), max_window_seconds=93 * 86_400,
                             max_steps=1000), results
    return make


def report_by(ledger, by):
    report = build_report(ledger, Grouping.parse(by), start_ms=WINDOW_START_MS, end_ms=END_MS)
    lines = {}
    for line in report.lines:
        if line.kind == "pod":
            name = "__unallocated__" if line.group.startswith("(no ") else line.group
        else:
            name = f"__{line.kind}__"
        lines[name] = lines.get(name, 0) + line.cost_micro_usd
    return report, lines


@pytest.mark.parametrize("sharing", ["keep", "idle=weighted,node_other=weighted"])
def test_allocations_by_team_with_idle_equal_the_report_by_team(api, sqlite_ledger, sharing):
    app, results = api(sharing)
    code, body = call(app, query=f"{window_param()}&aggregate=label:team&includeIdle=true&shareIdle=true")
    assert code == 200 and body["code"] == 200 and len(body["data"]) == 1
    (allocations,) = body["data"]
    report, lines = report_by(sqlite_ledger, "label:team")
    assert {name: a["totalCostMicroUsd"] for name, a in allocations.items()} == lines
    assert sum(a["totalCostMicroUsd"] for a in allocations.values()) == report.total_micro_usd
    assert body["gpumeter"]["reconciliation"] == {"allocationsMicroUsd": report.total_micro_usd,
                                                  "nodeBillsMicroUsd": report.total_micro_usd, "reconciled": True}
    research = allocations["research"]
    assert research["properties"] == {"labels": {"team": "research"}}
    assert research["window"] == {"start": iso(WINDOW_START_MS), "end": iso(END_MS)} and research["minutes"] == 3
    assert research["totalCost"] == pytest.approx(research["totalCostMicroUsd"] / 1e6)
    assert research["totalCost"] == pytest.approx(research["gpuCost"] + research["sharedCost"])
    line = next(l for l in report.lines if l.group == "research")
    assert research["directCostMicroUsd"] == line.direct_micro_usd
    assert research["directCostMicroUsd"] + research["gpuCostIdleMicroUsd"] + research["sharedCostMicroUsd"] == \
        line.cost_micro_usd
    assert research["methods"] == ["memory_proxy"] and research["costBasis"] == ["memory"]
    if sharing == "keep":
        assert "__idle__" in allocations and research["sharedFrom"] == {}
        assert body["gpumeter"]["warnings"] and "kept IDLE" in body["gpumeter"]["warnings"][0]
    else:
        assert "__idle__" not in allocations and "__node_other__" not in allocations
        assert set(research["sharedFrom"]) == {"node_other"} and research["gpuCostIdle"] > 0
        assert not body["gpumeter"]["warnings"]


def test_without_share_idle_the_idle_billing_shared_goes_back_to_idle_exactly(api, sqlite_ledger):
    app, results = api("idle=weighted,node_other=weighted")
    shared_idle = sum(c.cost_micro_usd for r in results for c in r.costs if c.shared_from
                      and c.shared_from.value == "IDLE")
    _, with_share = call(app, query=f"{window_param()}&aggregate=namespace&includeIdle=true&shareIdle=true")
    _, without = call(app, query=f"{window_param()}&aggregate=namespace&includeIdle=true&shareIdle=false")
    (shared_set,), (plain_set,) = with_share["data"], without["data"]
    assert plain_set["__idle__"]["totalCostMicroUsd"] == plain_set["__idle__"]["gpuCostIdleMicroUsd"] == shared_idle
    assert sum(a["gpuCostIdleMicroUsd"] for a in shared_set.values()) == shared_idle
    for name, allocation in shared_set.items():
        assert plain_set[name]["totalCostMicroUsd"] == allocation["totalCostMicroUsd"] - \
            allocation["gpuCostIdleMicroUsd"]
    assert sum(a["totalCostMicroUsd"] for a in plain_set.values()) == sum(
        a["totalCostMicroUsd"] for a in shared_set.values())
    # Without includeIdle the buckets are left out, as OpenCost leaves idle out.
    _, pods_only = call(app, query=f"{window_param()}&aggregate=namespace")
    assert not [n for n in pods_only["data"][0] if n.startswith("__")]


def test_steps_pods_nodes_and_gpu_hours(api, sqlite_ledger):
    app, results = api()
    code, body = call(app, query=f"{window_param()}&aggregate=pod&step=1m&includeIdle=true&idleByNode=true")
    assert code == 200 and len(body["data"]) == WINDOWS
    for (index, allocations), result in zip(enumerate(body["data"]), [r for r in results][::2]):
        start = WINDOW_START_MS + index * 60_000
        bills = sum(r.bill.node_cost_micro_usd for r in results if r.bill.window_start_unix_ms == start)
        assert sum(a["totalCostMicroUsd"] for a in allocations.values()) == bills
        assert {a["start"] for a in allocations.values()} == {iso(start)}
    first = body["data"][0]
    train = first["ml/pod-train-0"]
    assert train["properties"] == {"namespace": "ml", "pod": "pod-train-0"}
    bill = next(r.bill for r in results if r.bill.node_name == "aws-node" and r.bill.window_start_unix_ms ==
                WINDOW_START_MS)
    assert train["gpuHours"] == pytest.approx(0.55 * bill.billed_milliseconds / 3_600_000)
    assert train["memoryShare"] == pytest.approx(0.55) and train["computeShare"] == pytest.approx(0.55)
    assert {"aws-node/__idle__", "gcp-node/__idle__", "aws-node/__node_other__"} <= set(first)
    assert first["aws-node/__idle__"]["properties"] == {"node": "aws-node"}
    _, by_node = call(app, query=f"{window_param()}&aggregate=node")
    per_node = defaultdict(int)
    for r in results:
        for c in r.costs:
            if c.subject_kind.value == "POD":
                per_node[c.node_name] += c.cost_micro_usd
    assert {n: a["totalCostMicroUsd"] for n, a in by_node["data"][0].items()} == dict(per_node)


def test_clear_errors_for_bad_requests_paths_and_methods(api):
    app, _ = api()
    code, body = call(app, query="window=soon")
    assert code == 400 and body["code"] == 400 and "is not one of today" in body["message"]
    code, body = call(app, query=f"{window_param()}&window=24h")
    assert code == 400 and "more than once: window" in body["message"]
    assert call(app, "/allocation/summary", query="window=1d")[0] == 404
    code, body = call(app, query="window=1d", method="POST")
    assert code == 405 and "read-only" in body["message"]
    assert call(app, "/model/allocation", query=f"{window_param()}")[0] == 200
    assert call(app, "/healthz") == (200, b"metrics")  # the service's own paths, on the same server


def test_every_bad_query_is_a_400_with_a_reason(api):
    """More than 50 parameters made parse_qs raise outside the handler (a 500 with a traceback); a date that matches
    the RFC 3339 shape but does not exist made fromisoformat raise (issue 22)."""
    app, _ = api()
    many = "&".join(f"p{i}=1" for i in range(51))
    code, body = call(app, query=f"{window_param()}&{many}")
    assert code == 400 and "more than 50 query parameters" in body["message"]
    code, body = call(app, query="&".join([window_param(), *(f"p{i}=1" for i in range(49))]))
    assert code == 400 and "more than 50" not in body["message"]  # 50 are parsed (and p0 is no parameter)
    code, body = call(app, query="window=2026-13-01T00:00:00Z,2026-12-01T00:00:00Z")
    assert code == 400 and "not a pair of valid RFC 3339" in body["message"]
    code, body = call(app, query="window=2026-04-31T00:00:00Z,2026-05-01T00:00:00Z")
    assert code == 400 and body["code"] == 400


def test_a_token_file_makes_allocation_need_a_bearer_token_and_leaves_health_and_metrics_open(api, tmp_path):
    from services.billing.api import TokenFile

    tokens = tmp_path / "tokens"
    tokens.write_text("first-token\n\n  second-token  \n")
    app, _ = api()
    app.tokens = TokenFile(tokens)
    headers = {}
    code, body = call(app, query=window_param(), seen=headers)
    assert code == 401 and body == {"code": 401, "message": "a bearer token is required"}
    assert headers["WWW-Authenticate"] == 'Bearer realm="gpumeter"'
    headers = {}
    code, body = call(app, query=window_param(), headers={"Authorization": "Bearer first-token-x"}, seen=headers)
    assert code == 401 and headers["WWW-Authenticate"] == 'Bearer realm="gpumeter", error="invalid_token"'
    assert call(app, query=window_param(), headers={"Authorization": "Basic Zmlyc3QtdG9rZW4="})[0] == 401
    for token in ("first-token", "second-token"):
        code, body = call(app, query=window_param(), headers={"Authorization": f"Bearer {token}"})
        assert code == 200 and body["code"] == 200
    assert call(app, query=window_param(), headers={"Authorization": "bearer first-token"})[0] == 200
    # The service's own paths are for probes and Prometheus: no token.
    assert call(app, "/healthz") == (200, b"metrics") and call(app, "/metrics") == (200, b"metrics")


def test_a_rotated_token_file_takes_effect_without_a_restart_and_an_unreadable_one_fails_closed(api, tmp_path):
    import os

    from services.billing.api import TokenFile

    tokens = tmp_path / "tokens"
    tokens.write_text("old-token\n")
    app, _ = api()
    app.tokens = TokenFile(tokens)
    bearer = lambda token: {"Authorization": f"Bearer {token}"}  # noqa: E731
    assert call(app, query=window_param(), headers=bearer("old-token"))[0] == 200
    # A Secret volume swaps the file: another inode (and here another size), read again at the next request.
    replacement = tmp_path / "tokens.new"
    replacement.write_text("new-token-2\n")
    os.replace(replacement, tokens)
    assert call(app, query=window_param(), headers=bearer("old-token"))[0] == 401
    assert call(app, query=window_param(), headers=bearer("new-token-2"))[0] == 200
    tokens.unlink()
    code, body = call(app, query=window_param(), headers=bearer("new-token-2"))
    assert code == 503 and "authentication" in body["message"]
    tokens.write_text("")  # readable, but no token: nobody is let in
    assert call(app, query=window_param(), headers=bearer("new-token-2"))[0] == 401


def test_a_token_file_that_is_missing_or_empty_at_start_is_a_config_error(tmp_path):
    from gpumeter.errors import ConfigError
    from services.billing.api import TokenFile

    with pytest.raises(ConfigError, match="cannot be read"):
        TokenFile(tmp_path / "absent")
    (tmp_path / "empty").write_text("\n \n")
    with pytest.raises(ConfigError, match="holds no token"):
        TokenFile(tmp_path / "empty")


def test_the_api_reads_and_never_writes(sqlite_ledger, tmp_path):
    results = sample_costs(1)
    reader = Ledger(sqlite_ledger.url, read_only=True)
    with pytest.raises(LedgerError):
        reader.write([c for r in results for c in r.costs], [r.bill for r in results])
    assert sqlite_ledger.totals().cost_lines == 0
    reader.close()
    fresh = Ledger(f"sqlite:///{tmp_path / 'fresh.sqlite3'}", read_only=True)
    with pytest.raises(LedgerError):
        fresh.migrate()  # creating the tables is a write
    fresh.close()


def test_the_settings():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = api_settings(parser.parse_args(["--port", "9100"]), {"GPUMETER_API_MAX_WINDOW_DAYS": "31",
                                                                      "GPUMETER_LEDGER_URL": "postgresql://u:pw@db/x"})
    assert (settings.metrics_port, settings.max_window_days) == (9100, 31)
    assert settings.token_file is None
    assert api_settings(parser.parse_args(["--token-file", "/a"]), {"GPUMETER_API_TOKEN_FILE": "/b"}).token_file \
        == Path("/a")
    assert api_settings(parser.parse_args([]), {"GPUMETER_API_TOKEN_FILE": "/b"}).token_file == Path("/b")
    assert "pw" not in json.dumps(settings.describe())
    for bad in ({"metrics_port": 0}, {"max_window_days": 0}, {"max_steps": 0}, {"address": "not an address!"}):
        with pytest.raises(Exception):
            ApiSettings(**bad)
