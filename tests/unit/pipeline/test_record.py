"""``gpumeter record`` without a broker: the recorder's rotation and snapshots (``pipeline.recorder``, a clock passed
in), the files (``pipeline.recording_store``: names, compression, crash salvage) and the reader's compression
detection and snapshot handling (``pipeline.recordings``); and a scenario recorded into rotated files replays --
as a directory -- to the scenario's own bills, and a later file alone to its pods (its snapshot)."""

from __future__ import annotations

import dataclasses
import gzip
import lzma
from pathlib import Path

import pytest

from gpumeter.stream.contract import Event, Position
from pipeline.recorder import (
    POD_EVENTS,
    SAMPLES,
    CloseFile,
    Frame,
    OpenFile,
    RecorderProcessor,
    WriteFrame,
)
from pipeline.recording_store import PARTIAL_SUFFIX, RecordingDirectory, bucket_of_name
from pipeline.recordings import (
    GZIP_MAGIC,
    RECORDING_MAGIC_V2,
    XZ_MAGIC,
    RecordingError,
    RecordingWriter,
    encode_message,
    iter_frames,
    read_recording,
    recorded_inputs,
    scenario_records,
)
from pipeline.replay import read_jsonl, replay
from schemas.catalog import pod_event_key
from schemas.records import NodeSample, PodEvent, PodEventType
from simulator.scenario import load_scenario

REPO = Path(__file__).resolve().parents[3]
HOUR_MS = 3_600_000
T0 = 1_780_000_000_000 - 1_780_000_000_000 % HOUR_MS  # the start of an hour


def _records(name: str):
    return list(scenario_records(load_scenario(REPO / "scenarios" / f"{name}.yaml")))


def _event(record, offset: int = 0, *, at: int | None = None) -> tuple[Event, Position]:
    message = record.message
    role = POD_EVENTS if isinstance(message, PodEvent) else SAMPLES
    key = pod_event_key(message.node_name, message.uid) if role == POD_EVENTS else message.node_name.encode()
    stamp = record.received_at_unix_ms if at is None else at
    return Event(role, encode_message(message), key, stamp, stamp), Position(role, 0, offset)


def _pod(records, **changes) -> PodEvent:
    pod = next(r.message for r in records if isinstance(r.message, PodEvent))
    return dataclasses.replace(pod, **changes)


def _record(processor: RecorderProcessor, store: RecordingDirectory, records, *, clock_every_ms: int = 0) -> None:
    """Feed ``records`` as the driver would (one event at a time, the clock ticking at each received time)."""
    for offset, record in enumerate(records):
        event, position = _event(record, offset)
        store.apply(processor.on_clock(record.received_at_unix_ms).changes)
        store.apply(processor.handle(event, position).changes)
    store.apply(processor.close().changes)
    store.close()


# ----------------------------------------------------------------------------------------------------------------
# Rotation and snapshots (pure)


def test_frames_rotate_by_received_hour_and_the_clock_closes_a_quiet_file():
    records = _records("two_nodes")
    sample = next(r for r in records if isinstance(r.message, NodeSample))
    processor = RecorderProcessor(rotation_seconds=3600, close_grace_seconds=60)
    first = processor.handle(*_event(sample, at=T0 + 10)).changes
    assert [type(c) for c in first] == [OpenFile, WriteFrame]
    assert first[0].bucket_start_unix_ms == T0 and first[1].frame == Frame(T0 + 10, encode_message(sample.message))
    # Same hour: no rotation. A frame of an earlier hour (a partition behind) goes into the open file.
    assert [type(c) for c in processor.handle(*_event(sample, at=T0 + HOUR_MS - 1)).changes] == [WriteFrame]
    assert [type(c) for c in processor.handle(*_event(sample, at=T0 - 5)).changes] == [WriteFrame]
    # The next hour's first frame closes this file and opens the next.
    rotated = processor.handle(*_event(sample, at=T0 + HOUR_MS)).changes
    assert [type(c) for c in rotated] == [CloseFile, OpenFile, WriteFrame]
    assert rotated[1].bucket_start_unix_ms == T0 + HOUR_MS
    # The clock closes the quiet file once its hour and the grace are over, not before.
    assert not processor.on_clock(T0 + 2 * HOUR_MS + 59_999)
    assert processor.on_clock(T0 + 2 * HOUR_MS + 60_000).changes == (CloseFile(),)
    assert not processor.on_clock(T0 + 3 * HOUR_MS)
    # A late frame after that opens a file that sorts after the last one, never before it.
    late = processor.handle(*_event(sample, at=T0 + 10)).changes
    assert [type(c) for c in late] == [OpenFile, WriteFrame] and late[0].bucket_start_unix_ms == T0 + HOUR_MS


def test_the_snapshot_holds_the_last_event_of_each_live_pod_and_no_deleted_pod():
    records = _records("two_nodes")
    processor = RecorderProcessor(rotation_seconds=60, close_grace_seconds=0)
    a1 = _pod(records, uid="pod-a", resource_version="1", event_type=PodEventType.ADDED)
    a2 = dataclasses.replace(a1, resource_version="2", event_type=PodEventType.MODIFIED)
    b1 = _pod(records, uid="pod-b", resource_version="1", event_type=PodEventType.ADDED)
    b2 = dataclasses.replace(b1, resource_version="2", event_type=PodEventType.DELETED)
    c1 = _pod(records, uid="pod-c", resource_version="1", event_type=PodEventType.ADDED)
    for at, pod in ((T0 + 1, a1), (T0 + 2, b1), (T0 + 3, a2), (T0 + 4, b2), (T0 + 5, c1)):
        processor.handle(Event(POD_EVENTS, encode_message(pod), pod_event_key(pod.node_name, pod.uid), at, at),
                         Position(POD_EVENTS, 0, at))
    # A tombstone of the compacted topic drops its pod too; undecodable bytes are recorded but change no state.
    processor.handle(Event(POD_EVENTS, None, pod_event_key(c1.node_name, "pod-c"), T0 + 6, T0 + 6),
                     Position(POD_EVENTS, 0, 6))
    garbage = processor.handle(Event(POD_EVENTS, b"\x00not avro", b"k", T0 + 7, T0 + 7), Position(POD_EVENTS, 0, 7))
    assert garbage.changes == (WriteFrame(Frame(T0 + 7, b"\x00not avro")),)
    sample = next(r for r in records if isinstance(r.message, NodeSample))
    rotated = processor.handle(*_event(sample, at=T0 + 60_000)).changes
    assert isinstance(rotated[1], OpenFile)
    assert rotated[1].snapshot == (Frame(T0 + 3, encode_message(a2)),)


# ----------------------------------------------------------------------------------------------------------------
# Files: compression detection, v1 and v2, a torn end


@pytest.mark.parametrize("compression, magic", [("none", RECORDING_MAGIC_V2), ("gzip", GZIP_MAGIC),
                                                ("lzma", XZ_MAGIC)])
def test_each_compression_reads_back_the_same_frames_detected_by_magic_bytes(tmp_path, compression, magic):
    records = _records("two_nodes")[:20]
    path = tmp_path / f"{compression}.gmrec"
    with RecordingWriter(path, version=2, compression=compression) as writer:
        writer.write_frame(records[0].received_at_unix_ms, encode_message(records[0].message), snapshot=True)
        writer.sync()  # a member ends here: the file is several members, read as one
        for record in records[1:]:
            writer.write(record)
    data = path.read_bytes()
    assert data.startswith(magic)
    if compression == "gzip":
        assert gzip.decompress(data).startswith(RECORDING_MAGIC_V2)
    elif compression == "lzma":
        assert lzma.decompress(data).startswith(RECORDING_MAGIC_V2)
    frames = list(iter_frames(path))
    assert [f.snapshot for f in frames] == [True] + [False] * (len(records) - 1)
    assert [(f.received_at_unix_ms, f.payload) for f in frames] == [
        (r.received_at_unix_ms, encode_message(r.message)) for r in records]
    assert [r.message for r in read_recording(path)] == [r.message for r in records]


@pytest.mark.parametrize("compression", ["none", "gzip", "lzma"])
def test_a_torn_end_is_an_error_unless_salvaging(tmp_path, compression):
    records = _records("two_nodes")[:20]
    path = tmp_path / "torn.gmrec"
    with RecordingWriter(path, version=2, compression=compression) as writer:
        for record in records[:10]:
            writer.write(record)
        writer.sync()
        synced = path.stat().st_size
        for record in records[10:]:
            writer.write(record)
    data = path.read_bytes()
    path.write_bytes(data[: synced + (len(data) - synced) // 2])  # the last member torn in its middle
    with pytest.raises(RecordingError, match="cut short"):
        list(iter_frames(path))
    kept = list(iter_frames(path, tolerate_torn_end=True))
    assert 10 <= len(kept) < 20
    assert [f.payload for f in kept] == [encode_message(r.message) for r in records[:len(kept)]]


def test_a_partial_file_left_by_a_crash_is_salvaged_and_the_pod_state_recovered(tmp_path):
    records = _records("churn")
    store = RecordingDirectory(tmp_path, compression="gzip")
    processor = RecorderProcessor(rotation_seconds=60, close_grace_seconds=0)
    for offset, record in enumerate(records[: len(records) // 2]):
        store.apply(processor.handle(*_event(record, offset)).changes)
    store.sync()
    written = store.open_path
    assert written is not None and written.name.endswith(PARTIAL_SUFFIX)
    store._writer._raw.write(b"\x1f\x8b\x08torn")  # the start of a member that never ended: the crash
    store._writer._raw.flush()
    # A new recorder on the directory: the partial is salvaged under its name, the state is the dead one's.
    again = RecordingDirectory(tmp_path, compression="gzip")
    pods, last_bucket = again.recover()
    assert not list(tmp_path.glob(f"*{PARTIAL_SUFFIX}"))
    salvaged = written.with_name(written.name[: -len(PARTIAL_SUFFIX)])
    assert salvaged.exists() and bucket_of_name(salvaged.name) == last_bucket == processor.open_bucket_unix_ms
    assert pods == processor.pods and pods


# ----------------------------------------------------------------------------------------------------------------
# A scenario recorded into rotated files replays to the same bills


@pytest.fixture(scope="module")
def churn_direct(tmp_path_factory):
    out = tmp_path_factory.mktemp("direct")
    summary = replay(REPO / "scenarios" / "churn.yaml", out)
    return summary, out


def test_a_directory_of_rotated_files_replays_to_the_bills_of_the_run_and_a_later_file_alone_to_its_pods(
        tmp_path, churn_direct):
    direct, direct_out = churn_direct
    records = _records("churn")
    folder = tmp_path / "rec"
    _record(RecorderProcessor(rotation_seconds=60, close_grace_seconds=0), RecordingDirectory(folder), records)
    files = sorted(folder.glob("*.gmrec"))
    assert len(files) >= 3 and not list(folder.glob(f"*{PARTIAL_SUFFIX}"))
    assert all(f.read_bytes().startswith(GZIP_MAGIC) for f in files)
    snapshots = [sum(fr.snapshot for fr in iter_frames(f)) for f in files]
    assert snapshots[0] == 0 and all(n > 0 for n in snapshots[1:])

    # The directory: snapshot frames already read are skipped; the same inputs, the same outputs.
    out = tmp_path / "dir"
    summary = replay(folder, out)
    assert (summary.samples, summary.pod_events) == (direct.samples, direct.pod_events)
    for name in ("bills.jsonl", "costs.jsonl", "shares.jsonl", "dead_letters.jsonl"):
        assert (out / name).read_bytes() == (direct_out / name).read_bytes(), name

    # A later file alone starts from its snapshot: every pod alive at its start is known.
    later = files[-2]
    alone = tmp_path / "alone"
    summary = replay(later, alone)
    # Nothing refused for want of a pod; the churn scenario's unpriced node is unpriced here too.
    assert direct.dead_letters == {"NO_PRICE": 4} and set(summary.dead_letters) <= {"NO_PRICE"}
    snapshot_pods = {r.message.uid for r, f in zip(read_recording(later), iter_frames(later)) if f.snapshot}
    assert snapshot_pods
    # Its windows (the file is one whole window here) are the run's, row for row and bill for bill: the pods
    # alive at its start are named, not left unattributed (the run's own unattributed rows are there as well).
    shares = read_jsonl(alone / "shares.jsonl")
    windows = {s["window_start_unix_ms"] for s in shares}
    assert shares and windows
    in_windows = lambda rows: sorted((r for r in rows if r["window_start_unix_ms"] in windows), key=repr)  # noqa
    assert in_windows(shares) == in_windows(read_jsonl(direct_out / "shares.jsonl"))
    assert snapshot_pods & {s["pod_uid"] for s in shares}
    bills = read_jsonl(alone / "bills.jsonl")
    assert sorted(bills, key=repr) == sorted(  # (churn's node has no price: none on either side)
        (b for b in read_jsonl(direct_out / "bills.jsonl")
         if any(b["window_start"] == s["window_start"] for s in shares)), key=repr)


def test_a_repeated_snapshot_or_pod_event_in_a_directory_is_read_once(tmp_path):
    records = _records("two_nodes")
    pod = next(r for r in records if isinstance(r.message, PodEvent))
    later = records[-1]
    with RecordingWriter(tmp_path / "a.gmrec", version=2) as writer:
        writer.write(pod)
    with RecordingWriter(tmp_path / "b.gmrec", version=2, compression="gzip") as writer:
        writer.write_frame(pod.received_at_unix_ms, encode_message(pod.message), snapshot=True)
        writer.write(later)
    assert [r.message for r in recorded_inputs(tmp_path)] == [pod.message, later.message]
    # Alone, b replays its snapshot.
    assert [r.message for r in recorded_inputs(tmp_path / "b.gmrec")] == [pod.message, later.message]


def test_frames_recorded_partition_by_partition_replay_in_received_order_as_a_directory_and_alone(tmp_path):
    """The driver hands the recorder each fetched partition's messages in turn, so a file holds frames out of
    received-time order (a partition read behind another: its frames land, late, in the open file). Replay orders
    each file's frames by received time: the directory replays to the scenario's bills, one file alone replays."""
    scenario = REPO / "scenarios" / "two_nodes.yaml"
    records = _records("two_nodes")
    nodes = [n.name for n in load_scenario(scenario).nodes]
    # Partition by partition (one node's pod events and samples, then the next node's), as a backlog is fetched.
    by_partition = sorted(records, key=lambda r: nodes.index(r.message.node_name))
    folder = tmp_path / "rec"
    _record(RecorderProcessor(rotation_seconds=20, close_grace_seconds=0), RecordingDirectory(folder), by_partition)
    files = sorted(folder.glob("*.gmrec"))
    assert len(files) >= 3
    times = [f.received_at_unix_ms for f in iter_frames(files[-1]) if not f.snapshot]
    assert times != sorted(times)  # the case at hand: a file whose frames are not in received order

    direct = tmp_path / "direct"
    replay(scenario, direct)
    out = tmp_path / "dir"
    replay(folder, out)
    for name in ("bills.jsonl", "costs.jsonl", "shares.jsonl", "dead_letters.jsonl"):
        assert (out / name).read_bytes() == (direct / name).read_bytes(), name
    alone = replay(files[-1], tmp_path / "alone")
    # (two_nodes' spot node has no price: its node-windows are NO_PRICE, here as in the run.)
    assert set(alone.dead_letters) <= {"NO_PRICE"} and alone.samples == sum(
        isinstance(r.message, NodeSample) for r in read_recording(files[-1]))
