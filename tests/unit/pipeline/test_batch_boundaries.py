"""A processor's output does not depend on where its input was cut into batches.

Every driver hands its processor what it fetched as one batch (``MessageRunner.step_batch``: one ``handle_batch``
call); the contract (``gpumeter.stream.contract``) says the same input cut differently gives the same records. Held
here for the three services' processors as replay runs them (``MemoryDriver``): shipped scenarios, and one with bad
input among the good (dead letters in the middle of a batch), replayed in batches of 1, 7 and 1000 messages, every
output file compared byte for byte. The check itself is shown to catch a processor that counts its batches.
"""

from __future__ import annotations

import dataclasses
import struct
from collections import defaultdict
from pathlib import Path

import pytest

from gpumeter.clock import ManualClock
from gpumeter.stream.contract import DEAD_LETTERS, Emit, Input, Result
from gpumeter.stream.memory import MemoryBroker, MemoryDriver
from gpumeter.stream.runner import MessageRunner
from pipeline.recordings import RECORDING_MAGIC, scenario_records
from pipeline.replay import replay
from schemas.records import DeadLetter, NodeSample, PodEvent
from schemas.typed import codec_for
from services.billing.catalog import PriceCatalog, parse_override_csv
from simulator.scenario import load_scenario

REPO = Path(__file__).resolve().parents[3]
BATCH_SIZES = (1, 7, 1000)
OUTPUT_FILES = ("shares.jsonl", "costs.jsonl", "bills.jsonl", "dead_letters.jsonl", "violations.jsonl")
SCENARIOS = ("two_nodes", "faults", "guard_budget", "churn")


def _catalog(*scenarios: Path) -> PriceCatalog:
    """A node price for every node of ``scenarios``, so that every node-window is billed."""
    lines = ["AssetClass,InstanceID,InstanceIDField,MarketPriceHourly,GpuCount,Source,SourceDate"]
    for index, node in enumerate(n for path in scenarios for n in load_scenario(path).nodes):
        price = f"{len(node.gpus) * 2.718281 + 0.314159 * (index + 1):.6f}"
        lines.append(f"node,{node.name},metadata.name,{price},{len(node.gpus)},test price,2026-07")
    return PriceCatalog.load().with_overrides(parse_override_csv("\n".join(lines) + "\n", "test-prices.csv"))


def _bad_recording(scenario_path: Path, path: Path) -> None:
    """The scenario's input with bad messages at one instant among good ones (as the stream-equals-replay test
    builds it): bytes that are no Avro message, a header cut short, a record of another type, a sample from two
    hours ahead, a pod the API server would refuse; and an early tick held back until its window closed."""
    records = list(scenario_records(load_scenario(scenario_path)))
    samples = [r for r in records if isinstance(r.message, NodeSample)]
    held_back = samples[1]
    records.remove(held_back)
    first = samples[0].message
    pod = next(r.message for r in records if not isinstance(r.message, NodeSample))
    middle = records[len(records) // 2].received_at_unix_ms
    bad = [
        b"\x00garbage, not a single-object message",
        b"\xc3\x01\x00",
        codec_for(DeadLetter).encode(DeadLetter("X", "x", "X", "svc", "t", 0, 0, None, b"", 0)),
        codec_for(NodeSample).encode(dataclasses.replace(first, sampled_at_unix_ms=middle + 2 * 3_600_000,
                                                         sequence=first.sequence + 10_000)),
        codec_for(PodEvent).encode(dataclasses.replace(pod, uid="uid-forged", name="pod\nINFO all clear")),
    ]
    frames = [(r.received_at_unix_ms, codec_for(type(r.message)).encode(r.message)) for r in records]
    at = next(i for i, (t, _) in enumerate(frames) if t >= middle)
    instant = frames[at][0]
    same = sum(1 for t, _ in frames[at:] if t == instant)
    assert same > 1
    # Interleaved with the good messages of that instant, so that a batch holds both.
    for offset, payload in enumerate(bad):
        frames.insert(at + min(2 * offset + 1, same + offset), (instant, payload))
    frames.append((records[-1].received_at_unix_ms, codec_for(NodeSample).encode(held_back.message)))
    with path.open("wb") as handle:
        handle.write(RECORDING_MAGIC)
        for received_at, payload in frames:
            handle.write(struct.pack(">qI", received_at, len(payload)))
            handle.write(payload)


@pytest.fixture
def batch_sizes_seen(monkeypatch):
    """service -> the sizes of the batches its runner was handed."""
    seen: dict[str, list[int]] = defaultdict(list)
    original = MessageRunner.step_batch

    def spy(self, messages):
        batch = list(messages)
        seen[self.service].append(len(batch))
        return original(self, batch)

    monkeypatch.setattr(MessageRunner, "step_batch", spy)
    return seen


def _replayed(source: Path, out: Path, catalog: PriceCatalog, batch_size: int) -> dict[str, bytes]:
    replay(source, out, catalog=catalog, batch_size=batch_size)
    return {name: (out / name).read_bytes() for name in OUTPUT_FILES}


def _assert_invariant(source: Path, tmp_path: Path, catalog: PriceCatalog, seen: dict[str, list[int]]) -> dict:
    outputs = {}
    for size in BATCH_SIZES:
        seen.clear()
        outputs[size] = _replayed(source, tmp_path / f"batch-{size}", catalog, size)
        if size > 1:
            # Not vacuous: each service was handed batches of more than one message.
            assert {service: max(sizes) > 1 for service, sizes in seen.items()} == {
                "attributor": True, "billing": True, "guard": True}, size
        else:
            assert {max(sizes) for sizes in seen.values()} == {1}
    for size in BATCH_SIZES[1:]:
        for name in OUTPUT_FILES:
            assert outputs[size][name] == outputs[1][name], (size, name)
    return outputs[1]


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_scenario_replays_to_the_same_bytes_whatever_the_batch_size(tmp_path, batch_sizes_seen, name):
    scenario = REPO / "scenarios" / f"{name}.yaml"
    outputs = _assert_invariant(scenario, tmp_path, _catalog(scenario), batch_sizes_seen)
    assert outputs["shares.jsonl"] and outputs["costs.jsonl"] and outputs["bills.jsonl"]


def test_bad_input_in_a_batch_is_dead_lettered_alone_and_the_rest_goes_on(tmp_path, batch_sizes_seen):
    scenario = REPO / "scenarios" / "two_nodes.yaml"
    recording = tmp_path / "bad.gpumeter-rec"
    _bad_recording(scenario, recording)
    outputs = _assert_invariant(recording, tmp_path, _catalog(scenario), batch_sizes_seen)
    letters = outputs["dead_letters.jsonl"].decode().splitlines()
    # Both readers of node-samples dead-letter its bad bytes; the late tick and the forged pod are the attributor's.
    assert len(letters) >= 6
    assert outputs["shares.jsonl"] and outputs["costs.jsonl"]
    clean = _replayed(scenario, tmp_path / "clean", _catalog(scenario), 1000)
    assert clean["dead_letters.jsonl"] == b""


# ----------------------------------------------------------------------------------------------------------------
# The check has teeth: a processor whose output depends on its batches is caught.


class CountsBatches:
    """Emits, per pod event, how many events its batch held: exactly what the contract forbids."""

    service = "counter"
    inputs = (Input("pods", PodEvent),)

    def handle(self, event, position):  # pragma: no cover - handle_batch is used
        raise AssertionError("handle_batch is the one called")

    def handle_batch(self, events):
        return [Result(emits=(Emit("out", str(len(events)).encode(), event.record),)) for event, _ in events]

    def on_clock(self, now_ms, caught_up=True):
        return Result()


def _memory_output(batch_size: int) -> list[bytes | None]:
    broker = MemoryBroker()
    for topic in ("t.pods", "t.out", "t.dead"):
        broker.create(topic, 1)
    pod = load_scenario(REPO / "scenarios" / "two_nodes.yaml")
    event = next(r.message for r in scenario_records(pod) if isinstance(r.message, PodEvent))
    for index in range(10):
        broker.produce("t.pods", b"k", codec_for(PodEvent).encode(event), timestamp_ms=1_000 + index // 5)
    runner = MessageRunner(CountsBatches(), {"pods": "t.pods"}, ManualClock(1_000))
    MemoryDriver(runner, broker, {"out": "t.out", DEAD_LETTERS: "t.dead"}, batch_size=batch_size).run()
    return [m.key for m in broker.messages("t.out", 0)]


def test_a_processor_whose_output_depends_on_its_batches_is_caught():
    assert _memory_output(1) == [b"1"] * 10
    # Batches never span two instants (a caught-up consumer's timer runs between them): 5 + 5, or 3 + 2 per instant.
    assert _memory_output(1000) == [b"5"] * 10
    assert _memory_output(3) == [b"3", b"3", b"3", b"2", b"2"] * 2
