"""A directory of recordings is merged lazily: each file is read when the merge reaches its earliest frame.

Held here: the merge is in received order even when a later file holds frames from before an earlier file's
(frames read late), and a file is not decoded before the merge gets to it (a month of hourly files is not held
at once).
"""

from __future__ import annotations

from pathlib import Path

import pipeline.recordings as recordings
from pipeline.recordings import RecordingWriter, recorded_inputs, scenario_records
from schemas.records import PodEvent
from simulator.scenario import load_scenario

REPO = Path(__file__).resolve().parents[3]


def _records(name: str = "churn"):
    return list(scenario_records(load_scenario(REPO / "scenarios" / f"{name}.yaml")))


def _write(path: Path, records) -> None:
    with RecordingWriter(path, version=2, compression="gzip") as writer:
        for record in records:
            writer.write(record)


def _identity(item):
    return item.received_at_unix_ms, type(item.message).__name__, item.message


def test_files_holding_each_others_times_merge_in_received_order(tmp_path):
    records = _records()
    third = len(records) // 3
    first, second, rest = records[:third], records[third:2 * third], records[2 * third:]
    # Frames of the first period read late: the last file holds them, after its own (not in received order).
    late = first[len(first) // 2:]
    folder = tmp_path / "rec"
    _write(folder / "a.gmrec", first[:len(first) // 2])
    _write(folder / "b.gmrec", second)
    _write(folder / "c.gmrec", rest + late)
    _write(tmp_path / "whole.gmrec", records)
    merged = [_identity(item) for item in recorded_inputs(folder)]
    alone = [_identity(item) for item in recorded_inputs(tmp_path / "whole.gmrec")]
    assert merged == alone
    assert any(isinstance(r.message, PodEvent) for r in late)


def test_a_file_is_decoded_only_when_the_merge_reaches_it(tmp_path, monkeypatch):
    records = _records()
    hours = 5
    size = len(records) // hours
    folder = tmp_path / "rec"
    for hour in range(hours):
        part = records[hour * size:(hour + 1) * size if hour < hours - 1 else len(records)]
        _write(folder / f"{hour:02d}.gmrec", part)
    decoded: list[bytes] = []
    decode = recordings.decode_message

    def counting(payload):
        decoded.append(payload)
        return decode(payload)

    monkeypatch.setattr(recordings, "decode_message", counting)
    items = recorded_inputs(folder)
    next(items)
    # The first file only (a file starting at the instant the first one ends would be read in too; none does).
    assert len(decoded) == size
    assert sum(1 for _ in items) == len(records) - 1
    assert len(decoded) == len(records)
