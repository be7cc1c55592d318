"""``gpumeter.clockskew.NodeClocks``: a node's clock offset against the broker's append time, and what must not move
it (a drained buffer, a lone bad timestamp)."""

from __future__ import annotations

from gpumeter.clockskew import MAX_CLOCK_CORRECTION_MS, NodeClocks

T0 = 1_700_000_000_000
TICK = 10_000


def _live(clocks: NodeClocks, skew_ms: int, ticks: int, start: int = T0, node: str = "n", delay_ms: int = 20):
    return [clocks.observe(node, start + k * TICK + skew_ms, start + k * TICK + delay_ms, lambda: True, TICK)
            for k in range(ticks)]


def test_a_clock_behind_is_corrected_from_its_first_late_tick_and_ahead_from_its_first_tick():
    behind = _live(NodeClocks(), -600_000, 5)
    assert [r.offset_ms for r in behind] == [-600_020] * 5
    ahead = _live(NodeClocks(), 600_000, 5)
    assert [r.offset_ms for r in ahead] == [599_980] * 5
    assert not any(r.moved for r in behind + ahead)


def test_a_clock_within_the_threshold_is_taken_as_it_reads():
    assert [r.offset_ms for r in _live(NodeClocks(), -4_000, 5)] == [0] * 5


def test_a_drained_buffer_does_not_move_a_right_clock():
    clocks = NodeClocks()
    _live(clocks, 0, 3)
    # Kafka was away for 5 minutes: the buffered ticks arrive together, at the end.
    end = T0 + 3 * TICK + 300_000
    drained = [clocks.observe("n", T0 + (3 + k) * TICK, end, lambda: True, TICK) for k in range(30)]
    assert {r.offset_ms for r in drained} == {0}


def test_a_drain_from_the_collectors_start_leaves_no_offset_after_its_second_tick():
    clocks = NodeClocks()
    end = T0 + 300_000
    drained = [clocks.observe("n", T0 + k * TICK, end, lambda: True, TICK) for k in range(5)]
    assert drained[0].offset_ms == -300_000  # one tick cannot tell
    assert [r.offset_ms for r in drained[1:]] == [0] * 4


def test_a_lone_forged_timestamp_moves_nothing_and_a_real_clock_step_is_confirmed_by_its_second_tick():
    clocks = NodeClocks()
    _live(clocks, 0, 3)
    forged = clocks.observe("n", T0 + 3 * TICK + 7_200_000, T0 + 3 * TICK, lambda: True, TICK)
    assert (forged.offset_ms, forged.moved) == (0, True)
    assert clocks.observe("n", T0 + 4 * TICK, T0 + 4 * TICK, lambda: True, TICK).offset_ms == 0
    # The clock steps 10 minutes back (a VM resumed): its first tick is taken with the old offset, its second
    # confirms the new one.
    first, second = (clocks.observe("n", T0 + k * TICK - 600_000, T0 + k * TICK, lambda: True, TICK)
                     for k in (5, 6))
    assert (first.offset_ms, first.moved) == (0, True)
    assert (second.offset_ms, second.moved) == (-600_000, False)
    # Put right again: trusted at once.
    assert clocks.observe("n", T0 + 7 * TICK, T0 + 7 * TICK, lambda: True, TICK).offset_ms == 0


def test_a_clock_a_day_or_more_off_is_not_corrected():
    clocks = NodeClocks()
    far = [clocks.observe("n", T0 + k * TICK + MAX_CLOCK_CORRECTION_MS, T0 + k * TICK, lambda: True, TICK)
           for k in range(3)]
    assert {r.offset_ms for r in far} == {0}
