"""Re-pricing node-windows to a bill (``services/billing/trueup.py``): charge periods, partial hours, credits,
matching, and conservation to the micro-dollar (property-tested)."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from services.billing.bills import Bill, BillLineItem
from services.billing.trueup import LedgerLine, LedgerWindow, apportion_quotas, round_half_up, true_up

HOUR = 3_600_000
T0 = 1_793_000_000_000 - 1_793_000_000_000 % HOUR
ID = "aws:///us-east-1a/i-0aaa"


def window(start_ms, cost, *, provider_id=ID, seconds=60, node="n", lines=None, billed_ms=None):
    lines = lines if lines is not None else [("POD", "p1", cost - cost // 3), ("NODE_OTHER", "", cost // 3)]
    return LedgerWindow("c", node, start_ms, seconds, seconds * 1000 if billed_ms is None else billed_ms, cost,
                        provider_id, tuple(LedgerLine((start_ms, "c", node, "g", kind, pod), kind, micro)
                                           for kind, pod, micro in lines))


def item(start_ms, end_ms, cost, resource="i-0aaa", charge="usage"):
    return BillLineItem(resource, start_ms, end_ms, Decimal(cost), charge, "", "Usage", "bill.csv:2")


def bill(*items, scope=(T0, T0 + 24 * HOUR)):
    return Bill("bill.csv", "focus", "effective", scope[0], scope[1], tuple(items))


def test_an_hourly_line_item_of_a_machine_that_ran_half_the_hour_lands_on_that_half():
    windows = [window(T0 + i * 60_000, 1000) for i in range(30)]  # 10:00-10:30 only
    result = true_up(bill(item(T0, T0 + HOUR, "0.5")), windows)
    (machine,) = result.machines
    assert sum(result.windows.values()) == 500_000 and len(result.windows) == 30
    assert not machine.unallocated and machine.windows_not_covered == 0
    assert set(result.windows.values()) <= {16_666, 16_667}


def test_a_window_across_two_line_items_takes_its_share_of_each():
    # One 2-minute window 10:59-11:01 between two hourly line items of 6 USD and 12 USD; a full window each side.
    windows = [window(T0 + 57 * 60_000, 100, seconds=120), window(T0 + 59 * 60_000, 100, seconds=120),
               window(T0 + 61 * 60_000, 100, seconds=120)]
    result = true_up(bill(item(T0, T0 + HOUR, "6"), item(T0 + HOUR, T0 + 2 * HOUR, "12")), windows)
    got = [result.windows[w.key] for w in windows]
    # 6 USD over a full and a half window, 12 USD over a half and a full one.
    assert got == [4_000_000, 2_000_000 + 4_000_000, 8_000_000]


def test_a_credit_over_the_month_spreads_over_every_window_by_list_price_and_may_exceed_a_window():
    windows = [window(T0 + i * 60_000, cost) for i, cost in enumerate((100, 300))]
    result = true_up(bill(item(T0, T0 + HOUR, "0.000004"), item(T0 - 30 * 24 * HOUR, T0 + 30 * 24 * HOUR,
                                                                  "-0.000010", charge="credit")), windows)
    # Exact shares 1 - 2.5 and 3 - 7.5: -6 in all, the tie of remainders to the first window.
    assert [result.windows[w.key] for w in windows] == [-1, -5]
    for w in windows:
        assert sum(result.lines[line.key] for line in w.lines) == result.windows[w.key]


def test_line_items_no_window_overlaps_and_windows_no_line_item_covers_are_reported():
    windows = [window(T0 + i * 60_000, 1000) for i in range(3)] + [window(T0 + 5 * HOUR, 1000)]
    result = true_up(bill(item(T0, T0 + HOUR, "1"), item(T0 + 2 * HOUR, T0 + 3 * HOUR, "2")), windows)
    (machine,) = result.machines
    assert machine.billed_micro_usd == 3_000_000 and machine.trued_micro_usd == 1_000_000
    assert machine.unallocated_micro_usd == 2_000_000 and len(machine.unallocated) == 1
    assert machine.windows_not_covered == 1 and windows[3].key not in result.windows
    assert not result.complete


def test_unknown_ambiguous_and_unbilled_machines():
    # Two GCP projects with an instance of the same name: the bare name is ambiguous, the full resource name is not.
    a, b = "gce://p1/us-central1-a/gpu-1", "gce://p2/us-central1-a/gpu-1"
    windows = [window(T0, 10, provider_id=a, node="a"), window(T0, 10, provider_id=b, node="b"),
               window(T0, 10, provider_id="", node="no-id")]
    result = true_up(bill(item(T0, T0 + HOUR, "1", resource="gpu-1"), item(T0, T0 + HOUR, "1", resource="i-0zzz"),
                          item(T0, T0 + HOUR, "2", resource="//compute.googleapis.com/projects/p2/zones/"
                                                            "us-central1-a/instances/gpu-1")), windows)
    assert {u.resource_id: u.ambiguous_with for u in result.billed_not_seen} == {"gpu-1": (a, b), "i-0zzz": ()}
    assert [(m.provider_id, m.trued_micro_usd) for m in result.machines] == [(b, 2_000_000)]
    assert {(u.node_name, u.provider_id) for u in result.seen_not_billed} == {("a", a), ("no-id", "")}


def test_windows_that_cost_nothing_at_list_price_take_the_bill_by_billed_time_on_node_other():
    windows = [window(T0, 0, lines=[("POD", "p", 0), ("NODE_OTHER", "", 0)]),
               window(T0 + 60_000, 0, lines=[("POD", "p", 0), ("NODE_OTHER", "", 0)], billed_ms=30_000)]
    result = true_up(bill(item(T0, T0 + HOUR, "0.000003")), windows)
    assert [result.windows[w.key] for w in windows] == [2, 1]
    assert [result.lines[line.key] for line in windows[0].lines] == [0, 2]


def test_apportion_quotas_keeps_each_share_within_one_of_its_quota():
    quotas = [Fraction(7, 3), Fraction(-5, 2), Fraction(1, 6)]
    shares = apportion_quotas(round_half_up(sum(quotas, Fraction(0))), quotas)
    assert sum(shares) == 0 and all(abs(s - q) < 1 for s, q in zip(shares, quotas))


@settings(max_examples=150, deadline=None)
@given(
    costs=st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=4), min_size=1, max_size=12),
    items=st.lists(st.tuples(st.integers(0, 14), st.integers(1, 6), st.decimals("-3", "9", places=7)),
                   min_size=1, max_size=6),
)
def test_every_machine_carries_its_bill_exactly_and_every_window_its_lines(costs, items):
    windows = [window(T0 + i * 300_000, sum(lines), seconds=300,
                      lines=[("POD", f"p{j}", micro) for j, micro in enumerate(lines[:-1])]
                      + [("NODE_OTHER", "", lines[-1])])
               for i, lines in enumerate(costs)]
    line_items = [item(T0 + start * 300_000, T0 + (start + length) * 300_000, str(cost))
                  for start, length, cost in items]
    result = true_up(bill(*line_items), windows)
    allocated = sum((Fraction(i.cost) * 1_000_000 for i in line_items if i not in result.machines[0].unallocated),
                    Fraction(0))
    assert sum(result.windows.values()) == round_half_up(allocated)
    for w in windows:
        if w.key not in result.windows:
            assert all(line.key not in result.lines for line in w.lines)
            continue
        trued = [result.lines[line.key] for line in w.lines]
        assert sum(trued) == result.windows[w.key]
        if w.node_cost_micro_usd:
            for line, value in zip(w.lines, trued):
                assert abs(value - Fraction(result.windows[w.key] * line.cost_micro_usd, w.node_cost_micro_usd)) < 1
