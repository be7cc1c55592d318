"""What readers get from a ledger, as JSON-able data: every ``gpumeter report`` grouping in both cost bases, the
FOCUS export, ``/allocation`` answers and the lines as records. The migration test (``test_ledger_compact``)
compares these before and after migration 0008; ``data/make_ledger_0007.py`` recorded them at revision 0007."""

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


def ledger_outputs(ledger: Ledger, start_ms: int, end_ms: int) -> dict[str, Any]:
    """The readers' answers over windows starting in [start_ms, end_ms)."""
    out: dict[str, Any] = {}
    for by in GROUPINGS:
        for cost in ("list", "trued"):
            report = build_report(ledger, Grouping.parse(by), start_ms=start_ms, end_ms=end_ms, cost=cost)
            for fmt in ("json", "table", "csv"):
                out[f"report {by} {cost} {fmt}"] = format_report(report, fmt)
    out["focus csv"] = focus_csv(focus_dataset(ledger, start_ms=start_ms, end_ms=end_ms))
    api = AllocationApi(ledger, None, clock=ManualClock(end_ms), max_window_seconds=93 * 86_400, max_steps=1000)
    for params in ALLOCATION_QUERIES:
        query = parse_query({"window": f"{_iso(start_ms)},{_iso(end_ms)}", **params}, end_ms,
                            max_window_seconds=93 * 86_400, max_steps=1000)
        out[f"allocation {sorted(params.items())}"] = api.answer(query)
    out["lines"] = [{**cost_record_json(c), "carried_label_keys": list(c.carried_label_keys)}
                    for c in ledger.iter_cost_lines(start_ms=start_ms, end_ms=end_ms)]
    out["billed"] = [billed for _, billed in ledger.billed_cost_lines(start_ms=start_ms, end_ms=end_ms)]
    out["totals"] = {cost: repr(ledger.totals(start_ms=start_ms, end_ms=end_ms, cost=cost))
                     for cost in ("list", "trued")}
    out["trueup windows"] = repr(ledger.trueup_windows(start_ms=start_ms, end_ms=end_ms))
    return out


def output_digests(ledger: Ledger, start_ms: int, end_ms: int) -> dict[str, str]:
    """``ledger_outputs`` as the SHA-256 of each answer's canonical JSON (what ``data/ledger_0007.json`` keeps)."""
    return {name: hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
            for name, value in ledger_outputs(ledger, start_ms, end_ms).items()}
