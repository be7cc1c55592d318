"""Tumbling windows: alignment, grace, late ticks, duplicates, several nodes, clock-driven closing."""

from __future__ import annotations

import pytest

from gpumeter.errors import ConfigError, LateMessage
from services.attributor.windows import WindowAccumulator
from tests.unit.attributor import device, node_sample

WINDOW_S = 60
GRACE_S = 10
WINDOW_MS = WINDOW_S * 1000
BASE = 1_700_000_000_000 - (1_700_000_000_000 % WINDOW_MS)  # a window start


def tick(t, node="node-a", sequence=None, started=1, cluster="c1"):
    return node_sample(t, [device()], node=node, cluster=cluster, sequence=sequence if sequence is not None else t,
                       collector_started_at_unix_ms=started)


def feed(acc, samples):
    closed, rejected = [], []
    for s in samples:
        acc, c, r = acc.add(s)
        closed.extend(c)
        rejected.extend(r)
    return acc, closed, rejected


@pytest.mark.parametrize("window_seconds", [1, 60, 300, 3600])
def test_windows_are_aligned_to_epoch_multiples(window_seconds):
    acc = WindowAccumulator(window_seconds, 0)
    for t in (0, 1, BASE + 12_345, BASE + 59_999, -1, -window_seconds * 1000):
        start = acc.window_start_of(t)
        assert start % (window_seconds * 1000) == 0
        assert start <= t < start + window_seconds * 1000


def test_a_window_closes_when_its_end_plus_grace_is_reached():
    acc = WindowAccumulator(WINDOW_S, GRACE_S)
    acc, closed, _ = feed(acc, [tick(BASE + k * 1000) for k in range(60)])
    assert closed == []
    # Next window, before end + grace: still open.
    acc, closed, _ = feed(acc, [tick(BASE + WINDOW_MS + GRACE_S * 1000 - 1)])
    assert closed == [] and acc.open_window_starts("c1", "node-a") == (BASE, BASE + WINDOW_MS)
    acc, closed, _ = feed(acc, [tick(BASE + WINDOW_MS + GRACE_S * 1000)])
    assert [w.window_start_unix_ms for w in closed] == [BASE]
    w = closed[0]
    assert (w.cluster, w.node_name, w.window_seconds, w.window_end_unix_ms) == ("c1", "node-a", WINDOW_S,
                                                                                 BASE + WINDOW_MS)
    assert [s.sampled_at_unix_ms for s in w.samples] == [BASE + k * 1000 for k in range(60)]
    assert acc.open_window_starts("c1", "node-a") == (BASE + WINDOW_MS,)


def test_ticks_within_grace_amend_their_window_and_come_out_sorted():
    acc = WindowAccumulator(WINDOW_S, GRACE_S)
    order = [BASE + 5000, BASE + WINDOW_MS + 1000, BASE + 1000, BASE + WINDOW_MS + 5000, BASE + 3000]
    acc, closed, rejected = feed(acc, [tick(t) for t in order])
    assert closed == [] and rejected == []
    acc, closed = acc.flush()
    assert [w.window_start_unix_ms for w in closed] == [BASE, BASE + WINDOW_MS]
    assert [s.sampled_at_unix_ms for s in closed[0].samples] == sorted(t for t in order if t < BASE + WINDOW_MS)


def test_late_tick_is_rejected_with_its_metadata_and_a_late_reason():
    acc = WindowAccumulator(WINDOW_S, GRACE_S)
    acc, closed, _ = feed(acc, [tick(BASE + 1000), tick(BASE + WINDOW_MS + GRACE_S * 1000)])
    assert [w.window_start_unix_ms for w in closed] == [BASE]
    late = tick(BASE + 2000)
    before = acc
    acc, closed, rejected = acc.add(late, {"offset": 42})
    assert closed == () and acc is before
    (r,) = rejected
    assert r.sample is late and r.metadata == {"offset": 42} and r.window_start_unix_ms == BASE
    assert r.closed_before_unix_ms == BASE + WINDOW_MS
    err = r.error()
    assert isinstance(err, LateMessage) and err.reason_code == "LATE" and str(BASE) in err.detail
    # A window that never had a tick but lies before the watermark's boundary is late too.
    _, _, rejected = acc.add(tick(BASE - WINDOW_MS + 1))
    assert len(rejected) == 1


def test_duplicate_ticks_are_ignored_in_open_and_recently_closed_windows():
    acc = WindowAccumulator(WINDOW_S, GRACE_S, closed_key_retention=1)
    first = tick(BASE + 1000, sequence=7)
    acc, _, _ = feed(acc, [first, tick(BASE + 2000, sequence=8)])
    redelivered = tick(BASE + 1000, sequence=7)
    acc, closed, rejected = acc.add(redelivered)
    assert closed == () and rejected == () and acc.duplicates_ignored == 1
    # Same sequence from a restarted collector is a different tick.
    acc, _, _ = acc.add(tick(BASE + 1500, sequence=7, started=2))
    acc, closed, _ = acc.add(tick(BASE + WINDOW_MS + GRACE_S * 1000, sequence=9))
    assert [len(w.samples) for w in closed] == [3]
    # After closing, a redelivery of a tick it held is still a duplicate, not late.
    acc, closed, rejected = acc.add(redelivered)
    assert closed == () and rejected == () and acc.duplicates_ignored == 2
    # A tick of the closed window that it never held is late.
    _, _, rejected = acc.add(tick(BASE + 3000, sequence=99))
    assert len(rejected) == 1


def test_closed_key_retention_zero_makes_redeliveries_late():
    acc = WindowAccumulator(WINDOW_S, 0, closed_key_retention=0)
    acc, closed, _ = feed(acc, [tick(BASE + 1000), tick(BASE + WINDOW_MS)])
    assert len(closed) == 1
    _, _, rejected = acc.add(tick(BASE + 1000))
    assert len(rejected) == 1


def test_nodes_have_their_own_watermarks():
    acc = WindowAccumulator(WINDOW_S, GRACE_S)
    acc, closed, _ = feed(
        acc,
        [tick(BASE + 1000, node="a"), tick(BASE + 1000, node="b"),
         tick(BASE + 2 * WINDOW_MS, node="a")],  # moves only a's watermark
    )
    assert [(w.node_name, w.window_start_unix_ms) for w in closed] == [("a", BASE)]
    assert acc.open_window_starts("c1", "b") == (BASE,)
    # b's ticks for its open window are still on time.
    acc, closed, rejected = acc.add(tick(BASE + 30_000, node="b"))
    assert rejected == () and closed == ()
    assert acc.watermark("c1", "a") == BASE + 2 * WINDOW_MS and acc.watermark("c1", "b") == BASE + 30_000
    assert acc.nodes() == (("c1", "a"), ("c1", "b"))
    # The same node name in another cluster is another node.
    acc, _, _ = acc.add(tick(BASE + 1000, node="a", cluster="c2"))
    assert acc.open_window_starts("c2", "a") == (BASE,)


def test_clock_driven_watermark_closes_silent_nodes():
    acc = WindowAccumulator(WINDOW_S, GRACE_S)
    acc, _, _ = feed(acc, [tick(BASE + 1000, node="a"), tick(BASE + 1000, node="b"), tick(BASE + WINDOW_MS, node="b")])
    acc2, closed = acc.advance(BASE + WINDOW_MS + GRACE_S * 1000 - 1)
    assert closed == ()
    acc2, closed = acc2.advance(BASE + WINDOW_MS + GRACE_S * 1000)
    assert [(w.node_name, w.window_start_unix_ms) for w in closed] == [("a", BASE), ("b", BASE)]
    assert acc.open_window_starts("c1", "a") == (BASE,)  # the earlier state is untouched
    # The clock never goes back.
    acc3, closed = acc2.advance(BASE)
    assert acc3 is acc2 and closed == ()
    # A node first seen after the clock moved: its ticks before the boundary are late.
    _, _, rejected = acc2.add(tick(BASE + 5000, node="new"))
    assert len(rejected) == 1


def test_flush_closes_everything_in_order_and_later_ticks_for_them_are_late():
    acc = WindowAccumulator(WINDOW_S, GRACE_S)
    acc, _, _ = feed(acc, [tick(BASE + WINDOW_MS + 1, node="b"), tick(BASE + 1, node="a"), tick(BASE + 1, node="b")])
    acc, closed = acc.flush()
    starts = [(w.window_start_unix_ms, w.node_name) for w in closed]
    assert starts == [(BASE, "a"), (BASE, "b"), (BASE + WINDOW_MS, "b")]
    assert acc.open_sample_count() == 0
    _, _, rejected = acc.add(tick(BASE + 2, node="a"))
    assert len(rejected) == 1


def test_same_input_gives_same_windows():
    samples = [tick(BASE + (k * 7919) % (3 * WINDOW_MS), node=f"n{k % 3}", sequence=k) for k in range(200)]
    runs = []
    for _ in range(2):
        acc, closed, rejected = feed(WindowAccumulator(WINDOW_S, GRACE_S), samples)
        acc, rest = acc.flush()
        runs.append((closed + list(rest), rejected))
    assert runs[0] == runs[1]
    assert sum(len(w.samples) for w in runs[0][0]) + len(runs[0][1]) == len(samples)


@pytest.mark.parametrize("kwargs", [{"window_seconds": 0}, {"window_seconds": 1.5}, {"grace_seconds": -1},
                                    {"closed_key_retention": -1}])
def test_bad_configuration(kwargs):
    with pytest.raises(ConfigError):
        WindowAccumulator(**kwargs)


@pytest.mark.parametrize("seed", range(12))
def test_each_tick_closes_exactly_the_windows_its_watermark_passes(seed):
    """Against a plain model, tick by tick (jitter, ticks out of order, late ones, redeliveries, a clock that moves
    now and then): every add closes the open windows whose end + grace the node's watermark (or the clock's) has
    reached, oldest first, and only those; a tick of a closed window is late."""
    import random

    rng = random.Random(seed)
    grace_s = rng.choice([0, 5, 10, 30])
    acc = WindowAccumulator(WINDOW_S, grace_s, closed_key_retention=0)
    grace_ms = grace_s * 1000
    open_starts: dict[int, set] = {}
    watermark = clock = -(2**62)
    closed_before = -(2**62)
    t = BASE
    for sequence in range(400):
        t += rng.choice([1000, 1000, 1000, 2500, 7000, 40_000])
        at = t - rng.choice([0, 0, 0, 0, 3000, 15_000, 75_000])  # now and then an older tick
        if rng.random() < 0.05:
            clock = max(clock, t - rng.choice([0, 30_000, 90_000]))
            acc, advanced = acc.advance(clock)
            boundary = max(closed_before, (clock - grace_ms) // WINDOW_MS * WINDOW_MS)
            due = sorted(s for s in open_starts if s < boundary)
            assert [w.window_start_unix_ms for w in advanced] == due
            for s in due:
                del open_starts[s]
            closed_before = boundary
        acc, closed, rejected = acc.add(tick(at, sequence=sequence))
        start = at // WINDOW_MS * WINDOW_MS
        if start < closed_before:
            assert rejected and not closed
            continue
        assert not rejected
        open_starts.setdefault(start, set()).add(sequence)
        watermark = max(watermark, at)
        boundary = max(closed_before, (max(watermark, clock) - grace_ms) // WINDOW_MS * WINDOW_MS)
        due = sorted(s for s in open_starts if s < boundary)
        assert [(w.window_start_unix_ms, len(w.samples)) for w in closed] == [(s, len(open_starts[s])) for s in due]
        for s in due:
            del open_starts[s]
        closed_before = boundary
        assert acc.closed_before_for(max(watermark, clock)) <= closed_before
