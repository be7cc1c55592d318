"""Forged text never reaches an output as it was written.

A tenant names things (namespaces, pods, labels), and whoever can write to a topic can name anything. Three
outputs read those names: the report's CSV (a cell ``=HYPERLINK(...)`` is a formula in a spreadsheet), the log
lines (a newline in a pod name forges a line of its own, an ANSI sequence rewrites the operator's terminal) and
the Alertmanager payload (CRLF, ANSI and HTML in a label reach every receiver). So:

* names of the wrong syntax are refused on input (``gpumeter.validation``, dead-lettered ``INVALID_NAME``; the
  bad-input table of ``test_bad_input`` has a case per topic), here through the guard end to end;
* the report neutralises formula prefixes in CSV cells and escapes control characters (here from a ledger that
  holds such names anyway, as an older release may have written);
* every service's log handlers escape control characters and mask secrets (here through the real
  ``start_logging`` in a process of its own, and through the guard's own logging);
* the Alertmanager payload escapes control characters in labels and annotations, whatever record it is given.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import logging
import subprocess
import sys
from types import MappingProxyType

import pytest

from gpumeter import cli
from gpumeter.logflood import guard_root_handlers
from schemas.records import CostSubjectKind, Severity, Violation, ViolationState
from tests.unit.billing.conftest import sample_costs

FORGED_GROUPS = ['=HYPERLINK("http://evil.example/?x","click")', "+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)",
                 "\tx=1", "\r=1", "two\nlines,and \x1b[31mred"]


def _report(ledger_url: str, by: str, fmt: str, capsys) -> str:
    from services.billing import report

    args = cli.build_parser("report").parse_args(["report", "--ledger-url", ledger_url, "--by", by, "--format", fmt,
                                                  "--end", "2099-01-01T00:00:00Z", "--window", "36500d"])
    assert report.main(args, {}) == 0
    return capsys.readouterr().out


@pytest.fixture
def sqlite_ledger(tmp_path):
    from services.billing.ledger import Ledger

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    ledger.migrate()
    yield ledger
    ledger.close()


def test_a_forged_name_in_the_ledger_is_no_formula_in_the_report_csv_and_one_line_in_the_table(sqlite_ledger,
                                                                                                capsys):
    results = sample_costs(1)
    costs, n = [], 0
    for cost in (c for r in results for c in r.costs):
        if cost.subject_kind is CostSubjectKind.POD:
            forged = FORGED_GROUPS[n % len(FORGED_GROUPS)]
            cost = dataclasses.replace(cost, namespace=forged, labels=MappingProxyType({"team": forged}))
            n += 1
        costs.append(cost)
    assert n >= len(FORGED_GROUPS)
    sqlite_ledger.write(costs, [r.bill for r in results])
    url = sqlite_ledger.url
    for by in ("namespace", "label:team"):
        rows = list(csv.reader(io.StringIO(_report(url, by, "csv", capsys))))
        groups = [row[1] for row in rows[1:] if row[0] == "pod"]
        assert len(groups) == len(FORGED_GROUPS)
        for cell in groups:
            assert not cell.startswith(("=", "+", "-", "@", "\t", "\r")), cell  # OWASP: no formula prefix
            assert not any(ch in cell for ch in "\n\r\t\x1b"), cell
        assert sorted(g for g in groups if g.startswith("'")) == sorted(
            ["'" + g.replace("\t", "\\t").replace("\r", "\\r") for g in FORGED_GROUPS[:-1]])
        assert "two\\nlines,and \\x1b[31mred" in groups
        table = _report(url, by, "table", capsys)
        assert "\x1b" not in table and "\r" not in table and "\t" not in table
        pod_rows = [line for line in table.splitlines() if line.startswith("pod ")]
        assert len(pod_rows) == len(FORGED_GROUPS)  # no name broke its row in two


LOGGING_SCRIPT = r"""
import logging, sys
from gpumeter.entrypoint import start_logging
start_logging("guard", "INFO", {})
log = logging.getLogger("gpumeter.test")
log.warning("pod %s deleted", "train-0\n2030-01-01 00:00:00,000 INFO gpumeter.guard all clear\x1b[2J\u2028x")
log.info("ledger %s", "postgresql://billing:PG@SECRET7@db/ledger?sslpassword=SECRET8")
try:
    raise ValueError("bad pod name 'a\rb' at postgresql://u:SECRET9@db/x")
except ValueError:
    log.exception("failed for %s", "x\ny")
"""


def test_every_services_log_handler_keeps_a_record_on_one_line_and_masks_secrets():
    result = subprocess.run([sys.executable, "-c", LOGGING_SCRIPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    records = [line for line in lines if " gpumeter.test " in line]
    assert len(records) == 3, result.stderr  # one line per record, the traceback's frames below the third
    assert records[0].endswith("pod train-0\\n2030-01-01 00:00:00,000 INFO gpumeter.guard all clear\\x1b[2J\\u2028x "
                               "deleted")
    assert not any(line.startswith("2030-01-01") for line in lines)  # the forged line is not a line
    assert "\x1b" not in result.stderr and "\u2028" not in result.stderr and "\r" not in result.stderr
    for secret in ("SECRET7", "SECRET8", "SECRET9"):
        assert secret not in result.stderr
    assert "postgresql://billing:***@db/ledger?sslpassword=***" in records[1]
    assert "failed for x\\ny" in records[2] and "ValueError: bad pod name 'a\\rb'" in result.stderr


def test_the_guard_refuses_forged_names_and_never_alerts_or_logs_them(caplog):
    from tests.unit.guard.test_guard_processor import Guard, leaky

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    guard_root_handlers()
    caplog.set_level(logging.INFO)
    try:
        guard = Guard()  # the guard's processor on its runner, over the in-memory broker
        now = guard.clock.now_ms()
        forged = [
            dataclasses.replace(leaky(now), uid="uid-nl", name="notebook-0\nINFO gpumeter.guard all clear"),
            dataclasses.replace(leaky(now), uid="uid-html",
                                labels=MappingProxyType({"team": "<img src=x onerror=alert(1)>"})),
            dataclasses.replace(leaky(now), uid="uid-ansi", namespace="research\x1b[8m"),
            dataclasses.replace(leaky(now), uid="uid-crlf", name="nb\r\nX-Injected: 1"),
        ]
        results = []
        for event in forged:
            guard.pod(event)
            results.append(guard.run())
        guard.pod(leaky(now))
        fired = guard.run()  # a real leaky pod still fires
    finally:
        root.removeHandler(handler)
    assert results == [()] * len(forged)
    assert [letter.reason_code for letter in guard.dead_letters()] == ["INVALID_NAME"] * len(forged)
    assert fired and fired[0].rule == "visibility_leak"
    # Only the real pod's violations were emitted: the topic (and so the Alertmanager sink, fed what is emitted).
    assert {v.pod_uid for _, v in guard.violations()} == {"uid-1"}
    out = stream.getvalue()
    assert not any(line.startswith("INFO gpumeter.guard all clear") or line.startswith("X-Injected")
                   for line in out.splitlines())
    assert "\x1b" not in out and "\r" not in out


def test_the_alertmanager_payload_escapes_control_characters_of_any_record():
    from services.guard.alertmanager import to_alertmanager

    violation = Violation(
        fingerprint="fp", rule="visibility_leak", severity=Severity.CRITICAL, state=ViolationState.FIRING,
        cluster="prod", node_name="node\r\nX-Evil: 1", gpu_uuid="GPU-0", namespace="ns\x1b[2J", pod_name="p\n\u2028q",
        pod_uid="u\x07", team="t\x00", summary="pod ns/p\nINJECTED leaks", evidence={},
        first_seen_unix_ms=1_780_000_000_000, last_seen_unix_ms=1_780_000_000_000, resolved_at_unix_ms=None)
    alert = to_alertmanager(violation)
    for raw in ("\r", "\n", "\x1b", "\u2028", "\x07", "\x00"):
        assert all(raw not in value for value in alert["labels"].values())
        assert all(raw not in value for name, value in alert["annotations"].items() if name != "description")
    assert alert["labels"]["node"] == "node\\r\\nX-Evil: 1" and alert["labels"]["namespace"] == "ns\\x1b[2J"
    assert alert["annotations"]["summary"] == "pod ns/p\\nINJECTED leaks"
    assert alert["annotations"]["pod_uid"] == "u\\x07"
    description = alert["annotations"]["description"].split("\n")
    assert description[0] == "pod ns/p\\nINJECTED leaks." and description[1].startswith("Subject: cluster prod, node")
    assert all("\x1b" not in line and "\r" not in line for line in description)


@pytest.mark.parametrize("text, cell", [("=1+2", "'=1+2"), ("+1", "'+1"), ("-1", "'-1"), ("@x", "'@x"),
                                        ("\tx", "'\\tx"), ("\rx", "'\\rx"), ("team-a", "team-a"), ("", "")])
def test_csv_cells_follow_the_owasp_rule(text, cell):
    from gpumeter.safetext import csv_cell

    assert csv_cell(text) == cell
