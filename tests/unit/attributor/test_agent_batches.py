"""The attributor's Faust agents take their input in batches (``Stream.take_events``) and hand each to the runner
at once: the windows, dead letters and table writes are the same as one message at a time, wherever the batches
are cut, bad input among them; and each message's table writes are made inside its own event (Faust writes a
table's changelog to the current event's partition)."""

from __future__ import annotations

import asyncio
import json

import pytest

from gpumeter.stream.deadletter import RawMessage
from schemas.catalog import pod_event_key
from schemas.records import NodeSample, PodEvent
from schemas.typed import codec_for
from tests.unit.attributor.test_engine import BASE, WINDOW_S, pods_of, two_pod_tick
from tests.unit.attributor.test_rebalance_kept_partition import NODES, Worker

TICKS = 2 * WINDOW_S + 3


class TrackingTables(dict):
    """A table that records, per write, the partition of the message whose event was current."""

    def __init__(self, current: list[int | None]) -> None:
        super().__init__()
        self.current = current
        self.writes: list[tuple[str, int | None]] = []

    def __setitem__(self, key, value):
        self.writes.append((key, self.current[0]))
        super().__setitem__(key, value)


async def _run(tmp_path, batch_size: int, acknowledge_every: int):
    """The input fed in batches of ``batch_size``; Kafka acknowledges what was sent after every
    ``acknowledge_every`` messages (a multiple of ``batch_size``: acknowledgements are seen between batches)."""
    worker = Worker(tmp_path)
    current: list[int | None] = [None]
    worker.stream.open_samples = TrackingTables(current)
    worker.stream.pods = TrackingTables(current)
    pods = [event for node in NODES for event in pods_of(node)]
    pod_records = [worker.append(worker.catalog.pod_events, pod_event_key(e.node_name, e.uid),
                                 codec_for(PodEvent).encode(e)) for e in pods]
    ticks = [worker.append(worker.catalog.node_samples, s.node_name.encode(), codec_for(NodeSample).encode(s))
             for s in (two_pod_tick(BASE + k * 1000, node, k) for k in range(TICKS) for node in NODES)]
    # Bad bytes in the middle of the samples, and the first tick again once its window closed (a redelivery).
    middle = len(ticks) // 2
    ticks.insert(middle, worker.append(worker.catalog.node_samples, b"n1", b"\x00not avro"))
    ticks.append(worker.append(worker.catalog.node_samples, b"n1", ticks[0].value))

    async def feed(records, process):
        for start in range(0, len(records), batch_size):
            batch = records[start:start + batch_size]
            await process(batch, lambda index, batch=batch: current.__setitem__(0, batch[index].offset))
            if (start + len(batch)) % acknowledge_every == 0:
                worker.shares.acknowledge()
                await asyncio.sleep(0)

    await feed(pod_records, worker.stream.process_pod_events)
    await feed(ticks, worker.stream.process_samples)
    return worker


@pytest.mark.parametrize("batch_size", [7, 1000])
async def test_batches_give_what_one_message_at_a_time_gives(tmp_path, batch_size):
    one = await _run(tmp_path / "one", 1, batch_size)
    batched = await _run(tmp_path / "batched", batch_size, batch_size)
    assert [(w.node_name, w.window_start_unix_ms, w.rows()) for w in batched.windows()] == [
        (w.node_name, w.window_start_unix_ms, w.rows()) for w in one.windows()]
    assert len(one.windows()) == 2 * len(NODES)
    assert [value for _, value, _ in batched.dead.sent] == [value for _, value, _ in one.dead.sent]
    assert len(one.dead.sent) == 1  # the bad bytes; the redelivered tick is dropped, not dead-lettered
    assert dict(batched.stream.pods) == dict(one.stream.pods)
    # The progress records: the same windows done and the same re-read positions. ``position`` (every input at or
    # below it was processed when the record was written) is written with the acknowledgements, which a batch
    # hears of at its end rather than at the next message: as far as the batch went, never behind one at a time.
    progress_one, progress_batched = _progress(one), _progress(batched)
    assert {k: {**v, "position": None} for k, v in progress_batched.items()} == {
        k: {**v, "position": None} for k, v in progress_one.items()}
    assert progress_one and all(progress_batched[k]["position"] >= v["position"] for k, v in progress_one.items())


def _progress(worker) -> dict[str, dict]:
    return {key: json.loads(value) for key, value in worker.stream.open_samples.items()}


async def test_each_message_s_table_writes_are_made_inside_its_own_event(tmp_path):
    worker = await _run(tmp_path, 1000, 1000)
    writes = worker.stream.open_samples.writes
    assert writes and all(offset is not None for _, offset in writes)
    # Not all in the batch's last event: the progress records of the windows that closed come with their ticks.
    assert len({offset for _, offset in writes}) > 1


def test_raw_messages_keep_their_positions():
    raw = RawMessage("t", 1, 2, b"k", b"v", 3)
    assert (raw.partition, raw.offset) == (1, 2)
