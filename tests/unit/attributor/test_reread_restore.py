"""Open windows are not stored: a rebuilt engine starts from the progress records alone and re-reads its input
from ``resume_position``; what it emits then, together with what went out before the crash, is what an
uninterrupted run emits (windows emitted twice are identical), and nothing re-read is called late."""

from __future__ import annotations

import pytest

from services.attributor.processor import resume_position
from services.attributor.engine import AttributionEngine, NodeProgress
from tests.unit.attributor.test_engine import CONFIG, NOW, WINDOW_S, pods_of, ticks

NODES = ("n1", "n2", "n3")


def _input():
    """Pod events first, then the three nodes' ticks interleaved; each item is (position, record)."""
    pods = [e for node in NODES for e in pods_of(node)]
    per_node = [ticks(node, windows=4) for node in NODES]
    samples = [s for group in zip(*per_node) for s in group]
    return pods, list(enumerate(samples))


class Run:
    """Drives one engine like the streaming app: a window is acknowledged ``ack_lag`` inputs after it closed;
    progress records land in ``table``."""

    def __init__(self, engine: AttributionEngine, table: dict[str, NodeProgress], ack_lag: int) -> None:
        self.engine = engine
        self.table = table
        self.ack_lag = ack_lag
        self.pending: list[tuple[int, tuple]] = []  # (closed at step, windows)
        self.emitted = []
        self.late = 0
        self.step = 0

    def feed(self, position: int, sample) -> None:
        self.step += 1
        out = self.engine.on_sample(sample, NOW, position)
        self.late += len(out.late)
        if out.windows:
            self.emitted.extend(out.windows)
            self.pending.append((self.step, out.windows))
        due = [w for at, w in self.pending if self.step - at >= self.ack_lag]
        self.pending = [(at, w) for at, w in self.pending if self.step - at < self.ack_lag]
        for windows in due:
            self.engine.record_emitted(windows)
        for progress in self.engine.take_table_changes().progress:
            self.table[progress.table_key] = progress


def _by_window(windows):
    out = {}
    for w in windows:
        key = (w.node_name, w.window_start_unix_ms)
        assert out.setdefault(key, w.shares) == w.shares, f"{key} emitted twice with different shares"
    return out


def _uninterrupted(pods, samples):
    engine = AttributionEngine(CONFIG)
    for event in pods:
        engine.on_pod_event(event)
    run = Run(engine, {}, ack_lag=0)
    for position, sample in samples:
        run.feed(position, sample)
    return _by_window(run.emitted + list(engine.flush().windows))


@pytest.mark.parametrize("ack_lag", [0, 1, 5])
@pytest.mark.parametrize("crash_after", [1, 7, 29, 30, 31, 45, 61, 90, 119])
def test_a_rebuild_from_progress_records_and_a_re_read_emits_what_an_uninterrupted_run_does(crash_after, ack_lag):
    pods, samples = _input()
    expected = _uninterrupted(pods, samples)

    table: dict[str, NodeProgress] = {}
    first = AttributionEngine(CONFIG)
    for event in pods:
        first.on_pod_event(event)
    before = Run(first, table, ack_lag)
    for position, sample in samples[:crash_after]:
        before.feed(position, sample)
    # The crash: what was in flight (closed, not acknowledged) is lost with the process; the table survives.

    rebuilt = AttributionEngine(CONFIG)
    assert rebuilt.restore([], pods, table.values()).windows == ()
    start = resume_position(table.values())
    assert start <= crash_after
    after = Run(rebuilt, table, ack_lag)
    for position, sample in samples[start:]:
        after.feed(position, sample)
    emitted = before.emitted + after.emitted + list(rebuilt.flush().windows)

    assert before.late == after.late == 0
    # Every window acknowledged before the crash is not emitted again; every other window is.
    assert _by_window(emitted) == expected
    acknowledged = {(w.node_name, w.window_start_unix_ms) for w in before.emitted} - {
        (w.node_name, w.window_start_unix_ms) for _, ws in before.pending for w in ws}
    again = [(w.node_name, w.window_start_unix_ms) for w in after.emitted]
    assert not acknowledged & set(again)


def test_resume_position_is_the_oldest_unacknowledged_window_else_past_the_newest_position():
    def progress(node, position, reread):
        return NodeProgress("c1", node, 0, position, reread)

    assert resume_position([]) == 0
    assert resume_position([progress("a", 40, None), progress("b", 90, None)]) == 91
    assert resume_position([progress("a", 40, 12), progress("b", 90, 70), progress("c", 95, None)]) == 12
    # Records written before the field existed decode without it.
    old = b'{"closed_before_unix_ms": 0, "cluster": "c1", "node_name": "a", "position": 7}'
    assert NodeProgress.decode(old) == progress("a", 7, None)
    assert NodeProgress.decode(progress("a", 7, 3).encode()) == progress("a", 7, 3)


def test_the_first_tick_of_a_node_records_where_to_re_read_from():
    pods, samples = _input()
    engine = AttributionEngine(CONFIG)
    for event in pods:
        engine.on_pod_event(event)
    engine.take_table_changes()
    position, sample = samples[0]
    engine.on_sample(sample, NOW, position)
    (progress,) = engine.take_table_changes().progress
    assert (progress.node_name, progress.reread_from_position) == (sample.node_name, position)
    # Further ticks of the same open window write nothing.
    for position, sample in samples[1:2 * len(NODES)]:
        engine.on_sample(sample, NOW, position)
    assert {p.node_name for p in engine.take_table_changes().progress} == set(NODES) - {samples[0][1].node_name}
    assert WINDOW_S > 2  # the ticks above are all in the first window
