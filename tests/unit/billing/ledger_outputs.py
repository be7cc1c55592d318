"""What readers get from a ledger, as JSON-able data: every ``gpumeter report`` grouping in both cost bases, the
FOCUS export, ``/allocation`` answers and the lines as records. The migration test (``test_ledger_compact``)
compares these before and after migrations 0008 and 0009; ``data/make_ledger_0007.py`` recorded them at revision
0007 (with this file: it must keep running on that revision's code, where a report has no grain).

From revision 0009 on a report says which grain it read (``read from: ...`` in the table, ``grain`` in the json, a
``grain`` row in the csv when it read a rollup): ``report_text`` checks that statement against the report's plan
exactly and leaves it out, so the rest of the text is compared byte for byte with what 0007 printed."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from gpumeter.clock import ManualClock
from services.billing.allocation import parse_query
from services.billing.api import AllocationApi
from services.billing.costing import cost_record_json
from services.billing.export import focus_dataset
from services.billing.focus import focus_csv
from services.billing.ledger import Grouping, Ledger
from services.billing.report import build_report, format_report

GROUPINGS = ("namespace", "pod", "label:team", "node", "gpu")
ALLOCATION_QUERIES = (
    {"aggregate": "namespace"},
    {"aggregate": "namespace", "shareIdle": "true"},
    {"aggregate": "pod", "step": "1h"},
    {"aggregate": "node", "includeIdle": "true", "idleByNode": "true"},
    {"aggregate": "cluster", "includeIdle": "true"},
    {"aggregate": "label:team", "shareIdle": "true", "idleByNode": "true"},
)


def _iso(ms: int) -> str:
    from gpumeter.clock import iso_utc

    return iso_utc(ms)


def report_text(report: Any, fmt: str) -> str:
    """``format_report(report, fmt)`` less what it says about the grain it read, which is checked here to be
    exactly the report's plan (``report.plan``; a report of revision 0007's code has none: its text as it is)."""
    text = format_report(report, fmt)
    plan = getattr(report, "plan", None)
    if plan is None:
        return text
    assert not plan.adjusted  # a range moved by retention is no answer of revision 0007's
    if fmt == "json":
        document = json.loads(text)
        grain = document.pop("grain")
        assert grain["read_from"] == plan.describe() and grain["moved_by_retention"] is False
        assert [s["grain"] for s in grain["segments"]] == [s.grain for s in plan.segments]
        return json.dumps(document, indent=2) + "\n"
    lines = text.splitlines(keepends=True)
    said = [i for i, line in enumerate(lines) if line.startswith(("read from: ", "grain,"))]
    # The table always says it; the csv only when a rollup answered (it always read the cost lines before).
    if fmt == "table":
        wanted = ["read from: "]
    else:
        wanted = ["grain,"] if plan.grains() != ("minute",) else []
    assert [lines[i][:len(w)] for i, w in zip(said, wanted)] == wanted and len(said) == len(wanted)
    assert all(plan.describe() in lines[i] for i in said)
    return "".join(line for i, line in enumerate(lines) if i not in said)


def ledger_outputs(ledger: Ledger, start_ms: int, end_ms: int, *, grain: str | None = None) -> dict[str, Any]:
    """The readers' answers over windows starting in [start_ms, end_ms); the reports read at ``grain``
    (``build_report``'s; None: its default, and the only choice at revision 0007)."""
    out: dict[str, Any] = {}
    at = {} if grain is None else {"grain": grain}
    for by in GROUPINGS:
        for cost in ("list", "trued"):
            report = build_report(ledger, Grouping.parse(by), start_ms=start_ms, end_ms=end_ms, cost=cost, **at)
            for fmt in ("json", "table", "csv"):
                out[f"report {by} {cost} {fmt}"] = report_text(report, fmt)
    out["focus csv"] = focus_csv(focus_dataset(ledger, start_ms=start_ms, end_ms=end_ms))
    api = AllocationApi(ledger, None, clock=ManualClock(end_ms), max_window_seconds=93 * 86_400, max_steps=1000)
    for params in ALLOCATION_QUERIES:
        query = parse_query({"window": f"{_iso(start_ms)},{_iso(end_ms)}", **params}, end_ms,
                            max_window_seconds=93 * 86_400, max_steps=1000)
        answer = api.answer(query)
        # Which grain it read (revision 0012 on): said, and left out of what is compared with revision 0007's.
        grain = answer["gpumeter"].pop("grain", None)
        assert grain is None or grain
        out[f"allocation {sorted(params.items())}"] = answer
    out["lines"] = [{**cost_record_json(c), "carried_label_keys": list(c.carried_label_keys)}
                    for c in ledger.iter_cost_lines(start_ms=start_ms, end_ms=end_ms)]
    out["billed"] = [billed for _, billed in ledger.billed_cost_lines(start_ms=start_ms, end_ms=end_ms)]
    out["totals"] = {cost: repr(ledger.totals(start_ms=start_ms, end_ms=end_ms, cost=cost))
                     for cost in ("list", "trued")}
    out["trueup windows"] = repr(ledger.trueup_windows(start_ms=start_ms, end_ms=end_ms))
    return out


def output_digests(ledger: Ledger, start_ms: int, end_ms: int, *, grain: str | None = None) -> dict[str, str]:
    """``ledger_outputs`` as the SHA-256 of each answer's canonical JSON (what ``data/ledger_0007.json`` keeps)."""
    return {name: hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
            for name, value in ledger_outputs(ledger, start_ms, end_ms, grain=grain).items()}
