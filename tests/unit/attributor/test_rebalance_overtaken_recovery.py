"""A partition is rebuilt from tables recovered for the worker's current assignment, and only once whole.

faust-streaming 0.15.3 ends a table-recovery pass with ``on_rebalance_complete`` even when a newer rebalance
overtook the pass (its tables then a partial read of the changelogs), and runs that hook under
``Recovery._wait``, which cancels it at its first suspension once a rebalance is signalled. Seen in make bench's
fleet loads: a worker joining made the first rebuild six partitions from a fraction of their pods and lose the
preload of their pod events; the pass for the newer rebalance then found the partitions "kept" and never rebuilt
them. Here the hook runs under the real ``Recovery._wait`` of the worker's own Faust app, with the
``AttributorStream`` and fakes of ``test_rebalance_kept_partition`` (tables as dicts, a recorded input log).

Worker B takes the partition over from worker A; its samples are processed before its pod events (the two topics
are read concurrently, so that order happens), which only the preload makes right.
"""

from __future__ import annotations

import asyncio

import pytest
from faust.types import TP

from tests.unit.attributor.test_rebalance_kept_partition import (NODES, PARTITION, Worker, uninterrupted_windows,
                                                                  worker_a_stopped_halfway)


def _recovery_error():
    """What ``Recovery._wait`` raises when a rebalance is signalled (faust's own, as the module imports it)."""
    from faust.tables import recovery

    return recovery.RebalanceAgain


async def _worker_a_then_b(tmp_path):
    """A handles every pod event and half the ticks and stops (``worker_a_stopped_halfway``); B shares A's log and
    group, its reads of Kafka suspending as real ones do. Returns (a, b, pods, samples)."""
    a, pods, samples = await worker_a_stopped_halfway(tmp_path / "a")
    assert a.windows()  # some windows came out before the handover

    b = Worker(tmp_path / "b")
    b.log, b.committed = a.log, a.committed  # one broker, one group
    plain_read = b.stream._read_range

    async def suspending_read(topic, partition, start, stop):
        async for raw in plain_read(topic, partition, start, stop):
            await asyncio.sleep(0)  # a read from Kafka gives the loop back
            yield raw

    b.stream._read_range = suspending_read
    return a, b, pods, samples


async def _run_b_to_the_end(a, b, pods, samples):
    """B's pass for its current assignment: the whole tables, no newer rebalance; then B's input from where the
    hook left the group's offsets, samples before pod events."""
    recovery = b.stream.app.tables.recovery
    recovery.signal_recovery_start.clear()
    b.stream.open_samples, b.stream.pods = dict(a.stream.open_samples), dict(a.stream.pods)
    await recovery._wait(b.stream._on_rebalance_complete(None))
    for topic in (b.catalog.node_samples, b.catalog.pod_events):
        for raw in b.log[topic][b.committed[TP(topic, PARTITION)]:]:
            await b.process(raw)
    b.shares.acknowledge()
    await asyncio.sleep(0)

    expected = uninterrupted_windows(pods, samples, b.stream.settings.engine_config())
    emitted = {(w.node_name, w.window_start_unix_ms): w.rows() for w in a.windows() + b.windows()}
    assert emitted == {(w.node_name, w.window_start_unix_ms): w.rows() for w in expected}
    assert len(expected) == 3 * len(NODES)
    b_keys = [(w.node_name, w.window_start_unix_ms) for w in b.windows()]
    # A's windows in flight when it stopped come again from B (at least once); none twice from B itself.
    assert len(b_keys) == len(set(b_keys))
    assert b.dead.sent == []


async def test_a_recovery_pass_overtaken_by_a_newer_rebalance_rebuilds_nothing_from_its_partial_tables(tmp_path):
    a, b, pods, samples = await _worker_a_then_b(tmp_path)
    tps = {TP(topic, PARTITION) for topic in b.log}
    await b.stream._on_partitions_assigned(None, tps)
    # The overtaken pass ends: a sixth of the pods and none of the progress records read when the next rebalance
    # came (which Faust has signalled).
    recovery = b.stream.app.tables.recovery
    b.stream.open_samples = {}
    b.stream.pods = dict(list(a.stream.pods.items())[:len(a.stream.pods) // 6])
    recovery.signal_recovery_start.set()
    with pytest.raises(_recovery_error()):
        await recovery._wait(b.stream._on_rebalance_complete(None))
    assert b.stream.processor.partitions() == ()
    assert b.reads == []

    await _run_b_to_the_end(a, b, pods, samples)
    assert b.reads == [(b.catalog.pod_events, 0, None)]  # one preload, with the whole tables


async def test_a_rebalance_arriving_during_the_preload_leaves_the_partition_to_the_next_pass(tmp_path):
    a, b, pods, samples = await _worker_a_then_b(tmp_path)
    tps = {TP(topic, PARTITION) for topic in b.log}
    await b.stream._on_partitions_assigned(None, tps)
    recovery = b.stream.app.tables.recovery
    b.stream.open_samples, b.stream.pods = dict(a.stream.open_samples), dict(a.stream.pods)
    reading = b.stream._read_range

    async def read_while_a_rebalance_starts(topic, partition, start, stop):
        recovery.signal_recovery_start.set()  # the next rebalance: Faust cancels the hook at its next suspension
        async for raw in reading(topic, partition, start, stop):
            yield raw

    b.stream._read_range = read_while_a_rebalance_starts
    with pytest.raises(_recovery_error()):
        await recovery._wait(b.stream._on_rebalance_complete(None))
    for _ in range(50):  # the hook (and the preload's tasks under it) take the cancellation at the loop's next turns
        if not b.stream.processor.partitions():
            break
        await asyncio.sleep(0)
    assert b.stream.processor.partitions() == ()  # rebuilt, then dropped: not taken for a partition kept
    b.stream._read_range = reading

    await _run_b_to_the_end(a, b, pods, samples)
    assert b.reads == [(b.catalog.pod_events, 0, None)] * 2  # the cut preload, then the whole one
