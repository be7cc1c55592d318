"""Range checks of the node-window records: every shipped example passes; each impossible value is refused by name."""

from __future__ import annotations

import dataclasses
import math

import pytest

from gpumeter.errors import InvalidName, OutOfRange
from gpumeter.validation import check_window_cost, check_window_shares
from schemas.examples import load_examples
from schemas.records import NodeWindowCost, NodeWindowShares

SHARES = load_examples(NodeWindowShares)
COSTS = load_examples(NodeWindowCost)
SKEW_MS = 120_000


def _now(record) -> int:
    return record.window_start_unix_ms + record.window_seconds * 1000


@pytest.mark.parametrize("record", SHARES, ids=lambda r: r.node_name)
def test_every_shares_example_passes(record):
    check_window_shares(record, _now(record), SKEW_MS)


@pytest.mark.parametrize("record", COSTS, ids=lambda r: f"{r.node_name}-{r.sharing}")
def test_every_cost_example_passes(record):
    check_window_cost(record, _now(record), SKEW_MS)


def _unit(record, **changes):
    return dataclasses.replace(record, units=(dataclasses.replace(record.units[0], **changes), *record.units[1:]))


def _pod(record, **changes):
    return dataclasses.replace(record, pods=(dataclasses.replace(record.pods[0], **changes), *record.pods[1:]))


SHARES_BROKEN = {
    "window in the future": (lambda w: dataclasses.replace(w, window_start_unix_ms=w.window_start_unix_ms + 600_000),
                             "in the future"),
    "no units": (lambda w: dataclasses.replace(w, units=()), "at least one unit"),
    "unit twice": (lambda w: dataclasses.replace(w, units=(w.units[0], w.units[0])), "listed twice"),
    "pod twice": (lambda w: dataclasses.replace(w, pods=(w.pods[0], w.pods[0], *w.pods[1:])), "listed twice"),
    "arrays apart": (lambda w: _unit(w, memory_share=w.units[0].memory_share[:-1]), "memory_share has"),
    "NaN share": (lambda w: _unit(w, cost_share=(math.nan, *w.units[0].cost_share[1:])), "cost_share nan"),
    "share above 1": (lambda w: _unit(w, compute_share=(1.5, *w.units[0].compute_share[1:])), "outside"),
    "negative memory": (lambda w: _unit(w, memory_used_bytes_avg=(-1.0, *w.units[0].memory_used_bytes_avg[1:])),
                        "must be >= 0"),
    "covered too long": (lambda w: _unit(w, covered_seconds=w.window_seconds * 2.0), "covered_seconds"),
    "zero gpu fraction": (lambda w: _unit(w, gpu_fraction=0.0), "gpu_fraction"),
    "node covered inf": (lambda w: dataclasses.replace(w, node_covered_seconds=math.inf), "node_covered_seconds"),
    "negative requests": (lambda w: _pod(w, cpu_request_millicores=-1), "negative requests"),
}


@pytest.mark.parametrize("name", sorted(SHARES_BROKEN))
def test_an_impossible_shares_record_is_out_of_range(name):
    breaks, match = SHARES_BROKEN[name]
    record = SHARES[0]
    with pytest.raises(OutOfRange, match=match):
        check_window_shares(breaks(record), _now(record), SKEW_MS)


def test_a_forged_name_in_a_shares_record_is_an_invalid_name():
    record = SHARES[0]
    with pytest.raises(InvalidName):
        check_window_shares(_pod(record, namespace="=cmd()"), _now(record), SKEW_MS)
    with pytest.raises(InvalidName):
        check_window_shares(_pod(record, labels={"team": "a\nb"}), _now(record), SKEW_MS)
    with pytest.raises(InvalidName):
        check_window_shares(_unit(record, gpu_uuid="GPU <script>"), _now(record), SKEW_MS)


COST_BROKEN = {
    "lines do not add up": (lambda c: dataclasses.replace(c, node_cost_micro_usd=c.node_cost_micro_usd + 1),
                            "add up"),
    "gpu part above the bill": (lambda c: dataclasses.replace(c, gpu_cost_micro_usd=c.node_cost_micro_usd + 1,
                                                              node_other_micro_usd=-1), "GPU part"),
    "node_other not the rest": (lambda c: dataclasses.replace(c, node_other_micro_usd=c.node_other_micro_usd + 1),
                                "node_other"),
    "negative line": (lambda c: dataclasses.replace(
        c, line_cost_micro_usd=(-5, c.line_cost_micro_usd[1] + c.line_cost_micro_usd[0] + 5,
                                *c.line_cost_micro_usd[2:])), "negative cost line"),
    "billed beyond the window": (lambda c: dataclasses.replace(c, billed_milliseconds=c.window_seconds * 2000),
                                 "billed_milliseconds"),
    "share nan": (lambda c: dataclasses.replace(c, line_memory_share=(math.nan, *c.line_memory_share[1:])),
                  "line_memory_share"),
}


@pytest.mark.parametrize("name", sorted(COST_BROKEN))
def test_an_impossible_cost_record_is_out_of_range(name):
    breaks, match = COST_BROKEN[name]
    record = COSTS[0]
    with pytest.raises(OutOfRange, match=match):
        check_window_cost(breaks(record), _now(record), SKEW_MS)
