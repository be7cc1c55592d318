"""Replay streams its input: a chunk of input at a time through the three services, the broker then forgetting it.

Held here: the output does not depend on where the input was cut into chunks (shipped scenarios and a recording
with bad input -- dead letters of two services -- replayed in chunks of 3 and 7 messages and in one chunk, every
file compared byte for byte); the broker never holds more than a chunk of input; a chunk never ends inside an
instant; the runners share one decode of each message's bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pipeline.replay as replay_module
from gpumeter.clock import ManualClock
from gpumeter.stream.memory import MemoryBroker
from gpumeter.stream.runner import MessageRunner
from gpumeter.stream.contract import Input, Result
from gpumeter.stream.deadletter import RawMessage
from pipeline.recordings import InputRecord, RecordingWriter, record_scenario, scenario_records
from pipeline.replay import _chunks, replay
from schemas.records import NodeSample
from schemas.typed import codec_for
from simulator.scenario import load_scenario
from tests.unit.pipeline.test_batch_boundaries import OUTPUT_FILES, _bad_recording, _catalog

REPO = Path(__file__).resolve().parents[3]
CHUNK_SIZES = (3, 7)


def _replayed(source: Path, out: Path, catalog, chunk: int, monkeypatch) -> dict[str, bytes]:
    monkeypatch.setattr(replay_module, "CHUNK_MESSAGES", chunk)
    replay(source, out, catalog=catalog)
    names = OUTPUT_FILES + (("truth.jsonl",) if source.suffix == ".yaml" else ())
    return {name: (out / name).read_bytes() for name in names}


def _assert_chunk_invariant(source: Path, tmp_path: Path, catalog, monkeypatch) -> dict[str, bytes]:
    whole = _replayed(source, tmp_path / "whole", catalog, 10**9, monkeypatch)
    for size in CHUNK_SIZES:
        chunked = _replayed(source, tmp_path / f"chunk-{size}", catalog, size, monkeypatch)
        for name, data in whole.items():
            assert chunked[name] == data, (size, name)
    return whole


@pytest.mark.parametrize("name", ("two_nodes", "faults", "guard_budget", "churn"))
def test_a_scenario_replays_to_the_same_bytes_whatever_the_chunks(tmp_path, monkeypatch, name):
    scenario = REPO / "scenarios" / f"{name}.yaml"
    whole = _assert_chunk_invariant(scenario, tmp_path, _catalog(scenario), monkeypatch)
    assert whole["shares.jsonl"] and whole["costs.jsonl"] and whole["bills.jsonl"] and whole["truth.jsonl"]


def test_bad_input_replays_to_the_same_dead_letters_whatever_the_chunks(tmp_path, monkeypatch):
    scenario = REPO / "scenarios" / "two_nodes.yaml"
    recording = tmp_path / "bad.gmrec"
    _bad_recording(scenario, recording)
    whole = _assert_chunk_invariant(recording, tmp_path, _catalog(scenario), monkeypatch)
    assert len(whole["dead_letters.jsonl"].splitlines()) >= 6


def test_dead_letters_of_several_chunks_are_listed_service_by_service(tmp_path, monkeypatch):
    """Bad bytes at the first and the last instant (chunks apart): both readers of node-samples dead-letter each;
    the file lists the attributor's two, then the guard's two, as one chunk would."""
    scenario = REPO / "scenarios" / "two_nodes.yaml"
    records = list(scenario_records(load_scenario(scenario)))
    recording = tmp_path / "bad-twice.gmrec"
    with RecordingWriter(recording) as writer:
        writer.write_frame(records[0].received_at_unix_ms, b"\x00garbage at the start")
        for record in records:
            writer.write(record)
        writer.write_frame(records[-1].received_at_unix_ms, b"\x00garbage at the end")
    whole = _assert_chunk_invariant(recording, tmp_path, _catalog(scenario), monkeypatch)
    letters = [json.loads(line) for line in whole["dead_letters.jsonl"].splitlines()]
    assert [(d["service"], d["input"]) for d in letters] == [
        ("attributor", "bad-twice.gmrec#0"), ("attributor", f"bad-twice.gmrec#{len(records) + 1}"),
        ("guard", "bad-twice.gmrec#0"), ("guard", f"bad-twice.gmrec#{len(records) + 1}")]


def test_the_broker_holds_one_chunk_of_input_not_the_run(tmp_path, monkeypatch):
    scenario = REPO / "scenarios" / "two_nodes.yaml"
    recording = tmp_path / "two.gmrec"
    frames = record_scenario(scenario, recording)
    held: list[int] = []
    produce = MemoryBroker.produce

    def spy(self, topic, key, value, **kwargs):
        position = produce(self, topic, key, value, **kwargs)
        if topic == replay_module.REPLAY_TOPICS.node_samples:
            held.append(sum(1 for _ in self.messages(topic, 0)))
        return position

    monkeypatch.setattr(MemoryBroker, "produce", spy)
    monkeypatch.setattr(replay_module, "CHUNK_MESSAGES", 4)
    summary = replay(recording, tmp_path / "out", catalog=_catalog(scenario))
    assert summary.samples == len(held) >= 20 and frames > summary.samples
    # At most a chunk plus the rest of its last instant (one sample per node) is ever kept.
    assert max(held) <= 4 + len(summary.nodes)


def test_a_chunk_never_ends_inside_an_instant():
    sample = _a_sample()
    times = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4]
    chunks = list(_chunks([InputRecord(t, sample) for t in times], 2))
    assert [[r.received_at_unix_ms for r in c] for c in chunks] == [[0, 0, 0], [1, 1], [2, 3, 3, 3, 3], [4]]
    assert list(_chunks([], 2)) == []


def test_a_trimmed_broker_keeps_its_offsets():
    broker = MemoryBroker()
    broker.create("t", 1)
    for i in range(3):
        broker.produce("t", None, bytes([i]), timestamp_ms=i)
    broker.trim()
    assert list(broker.messages("t", 0)) == [] and broker.end_offsets("t") == (3,)
    position = broker.produce("t", None, b"x", timestamp_ms=5)
    assert position.offset == 3
    assert [(m.offset, m.value) for m in broker.messages("t", 0)] == [(3, b"x")]
    assert [(m.offset, m.value) for m in broker.messages("t", 0, 1)] == [(3, b"x")]
    assert list(broker.messages("t", 0, 4)) == []


def _a_sample() -> NodeSample:
    scenario = load_scenario(REPO / "scenarios" / "two_nodes.yaml")
    return next(r.message for r in scenario_records(scenario) if isinstance(r.message, NodeSample))


class _Reads:
    service = "reads"

    def __init__(self) -> None:
        self.inputs = (Input("samples", NodeSample),)
        self.seen: list[object] = []

    def handle(self, event, position):
        self.seen.append(event.record)
        return Result()

    def on_clock(self, now_ms, caught_up=True):
        return Result()


def test_runners_sharing_a_decode_memo_decode_each_message_once(monkeypatch):
    sample = _a_sample()
    payload = codec_for(NodeSample).encode(sample)
    codec = codec_for(NodeSample)
    calls: list[bytes] = []
    decode = type(codec).decode

    def counting(self, data):
        calls.append(data)
        return decode(self, data)

    monkeypatch.setattr(type(codec), "decode", counting)
    memo: dict = {}
    message = RawMessage("t", 0, 0, b"k", payload, sample.sampled_at_unix_ms)
    readers = [_Reads(), _Reads()]
    for reader in readers:
        runner = MessageRunner(reader, {"samples": "t"}, ManualClock(sample.sampled_at_unix_ms), decoded=memo)
        assert runner.step(message).handled
    assert len(calls) == 1
    assert readers[0].seen[0] is readers[1].seen[0]
    assert readers[0].seen[0] == codec_for(NodeSample).decode(payload) == sample
