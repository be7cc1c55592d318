"""Replay's input: records from a scenario (the simulator and the collector's real sampling code) or from a
recording file, in the order the attributor receives them.

Recording format (``*.gmrec``)
------------------------------
A binary file, plain or compressed as a whole (gzip or xz; the reader tells them apart by their magic bytes --
``1f 8b`` gzip, ``fd 37 7a 58 5a 00`` xz, anything else is read as plain -- so any of the three is read the same
way; a compressed file may be several concatenated members, as ``gpumeter record`` writes them). Inside, a header
then frames until the end of the data.

**Version 1** (header ``gpumeter-recording/1\\n``, 21 bytes): a frame is ``received_at_unix_ms`` (int64,
big-endian), ``length`` (uint32, big-endian), then ``length`` bytes: one Avro single-object message (``C3 01`` +
CRC-64-AVRO fingerprint + body), byte for byte what the ``node-samples`` and ``pod-events`` topics carry.

**Version 2** (header ``gpumeter-recording/2\\n``): a frame is ``received_at_unix_ms`` (int64, big-endian),
``flags`` (uint8), ``length`` (uint32, big-endian), then the message as in version 1. Flag ``0x01``
(``FLAG_SNAPSHOT``) marks a **snapshot frame**: a pod event received before this file began, copied at its start
(with its original time and bytes) so that the file replays on its own; ``gpumeter record`` writes them (the last
event of every pod alive when the file was opened). Other flag bits are reserved: a frame with one set is a
``RecordingError`` (a newer format this reader does not know).

The fingerprint names the writer schema and so the record type (``NodeSample`` or ``PodEvent``); old recordings
stay readable through Avro schema resolution as long as the registry holds their writer schema. A broken frame
structure (bad header, a frame cut short, a compressed stream cut short) raises ``RecordingError``; a frame
whose message does not decode is dead-lettered with the codec's reason code and replay carries on, as the
streaming consumer does.

Frames are replayed in received order: each file's frames are ordered by (received_at, pod events before
samples, frame order) -- a file ``gpumeter record`` writes holds its frames in the order it read them, and with
several partitions that is not received order (each fetched partition's messages come in turn; a partition read
behind another puts earlier frames after later ones), so a file is read whole before it is replayed. INPUT may
also be a directory: every ``*.gmrec`` in it (sorted by name) is read and the files are merged by (received_at,
pod events before samples, file order, frame order), each file read only when the merge reaches its earliest
frame (a first pass over the directory finds it), so replaying a month holds the hour being replayed and the
files whose late frames overlap it, not the month; one file alone is replayed with its snapshot frames. In a
directory, a **snapshot frame already read** -- the same received time and the same
bytes as a pod event of an earlier file, which is where ``gpumeter record`` copied it from -- is skipped, and so
is a pod event already read as a snapshot frame: a directory of consecutive files replays as the run it was cut
from, and a directory whose first files were deleted (retention) starts from its first file's snapshot. (A
repeated pod event would be harmless anyway -- the pod index ignores an event with the time and resource
version it holds -- but skipped, it is neither counted nor handed to the guard twice.) ``record_scenario`` and
``gpumeter replay --record`` write version 1 recordings, plain; ``gpumeter record`` (``pipeline/record.py``)
writes version 2, compressed, one file per hour.
"""

from __future__ import annotations

import gzip
import hashlib
import heapq
import lzma
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Sequence, Union

from gpumeter.errors import ConfigError, InvalidMessage, WrongRecordType
from schemas.codec import HEADER_BYTES, MAGIC, default_registry
from schemas.records import RECORD_TYPES, NodeSample, PodEvent
from schemas.typed import codec_for

RECORDING_MAGIC_V1 = b"gpumeter-recording/1\n"
RECORDING_MAGIC_V2 = b"gpumeter-recording/2\n"
RECORDING_MAGIC = RECORDING_MAGIC_V1  # what plain version-1 files start with (the default writer's)
RECORDING_SUFFIX = ".gmrec"
_FRAME_HEADER = struct.Struct(">qI")
_FRAME_HEADER_V2 = struct.Struct(">qBI")
FLAG_SNAPSHOT = 0x01
_KNOWN_FLAGS = FLAG_SNAPSHOT
GZIP_MAGIC = b"\x1f\x8b"
XZ_MAGIC = b"\xfd7zXZ\x00"
COMPRESSIONS = ("none", "gzip", "lzma")
MAX_FRAME_BYTES = 64 * 1024 * 1024

InputMessage = Union[NodeSample, PodEvent]


class RecordingError(InvalidMessage):
    """A recording whose structure is broken: not a recording, a frame cut short, an absurd frame length."""

    reason_code = "BAD_RECORDING"


# ----------------------------------------------------------------------------------------------------------------
# Input records


@dataclass(frozen=True, slots=True)
class InputRecord:
    """One input message and the time it reached the attributor (``received_at_unix_ms``); ``payload``: the bytes
    it was recorded as (None when it was not read from a recording), not part of its identity."""

    received_at_unix_ms: int
    message: InputMessage
    payload: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def node_name(self) -> str:
        return self.message.node_name


@dataclass(frozen=True, slots=True)
class RecordedFrame:
    """One frame of a recording: the stored time, the raw single-object message, and where it was."""

    received_at_unix_ms: int
    payload: bytes
    source: str
    position: int
    snapshot: bool = False  # a version-2 snapshot frame (a pod event from before the file began)


def _kind_rank(message: InputMessage) -> int:
    # Pod events first: a tick's pods must be known when the tick's window closes at the same instant.
    return 0 if isinstance(message, PodEvent) else 1


def scenario_nodes(scenario: Any, node: str | None) -> tuple[str, ...]:
    """The names of ``node`` (checked to be the scenario's) or of every node of the scenario, in its order."""
    names = tuple(n.name for n in scenario.nodes)
    if node is None:
        return names
    if node not in names:
        raise ConfigError(f"the scenario has no node {node!r} (nodes: {', '.join(names)})")
    return (node,)


def scenario_records(scenario: Any, nodes: Sequence[str] | None = None) -> Iterator[InputRecord]:
    """The scenario's pod events and samples for ``nodes`` (default: all, in scenario order), from the
    collector's sampling code, merged in time order: at each instant every pod event before any sample."""
    from services.collector.simulation import node_streams, scenario_node_names

    names = tuple(nodes) if nodes is not None else scenario_node_names(scenario)

    def stream(index: int, name: str) -> Iterator[tuple[tuple[int, int, int, int], InputRecord]]:
        seq = 0
        for tick in node_streams(scenario, name):
            for event in tick.pod_events:
                yield (tick.sampled_at_unix_ms, 0, index, seq), InputRecord(tick.sampled_at_unix_ms, event)
                seq += 1
            yield (tick.sampled_at_unix_ms, 1, index, seq), InputRecord(tick.sampled_at_unix_ms, tick.sample)
            seq += 1

    for _key, record in heapq.merge(*(stream(i, n) for i, n in enumerate(names)), key=lambda item: item[0]):
        yield record


@dataclass(frozen=True, slots=True)
class EncodedInput:
    """One scenario input message as a worker process produced it (``scenario_encoded_records``): already encoded
    (``payload``: the single-object Avro bytes its topic carries, byte for byte ``encode_message`` of the record),
    with what replay needs to put it on its topic without decoding it: ``node_name``, whether it is a pod event
    (else a ``NodeSample``), its topic ``key`` and, for a sample, ``sampled_at_unix_ms`` and ``truth``: the
    scenario time of the tick and ``SimWorld.truth`` of the node then (the worker's world had it computed)."""

    received_at_unix_ms: int
    node_name: str
    is_pod_event: bool
    key: bytes
    payload: bytes
    sampled_at_unix_ms: int | None
    truth: tuple[int, tuple] | None = None


SCENARIO_WORKER_BATCH_TICKS = 32
"""Ticks of one node a scenario worker process sends at a time (each batch a pickled list of encoded messages)."""
_WORKER_QUEUE_BATCHES = 8  # batches a worker may be ahead of the merge: bounds the memory held in flight


def _encoded_node_stream(scenario: Any, index: int, name: str) -> Iterator[tuple[tuple[int, int, int, int],
                                                                                  EncodedInput]]:
    """One node's messages as ``scenario_records``' ``stream`` orders them (same merge key), encoded."""
    from schemas.catalog import pod_event_key
    from services.collector.simulation import node_streams

    node_key = name.encode("utf-8")
    seq = 0
    for tick in node_streams(scenario, name, with_truth=True):
        now = tick.sampled_at_unix_ms
        for event in tick.pod_events:
            yield (now, 0, index, seq), EncodedInput(now, name, True, pod_event_key(name, event.uid),
                                                     encode_message(event), None)
            seq += 1
        sample = tick.sample
        yield (now, 1, index, seq), EncodedInput(now, name, False, node_key, encode_message(sample),
                                                 sample.sampled_at_unix_ms, (now, tick.truth))
        seq += 1


def _scenario_worker(scenario: Any, indexed_names: Sequence[tuple[int, str]], queue: Any) -> None:
    """A worker process: its nodes' streams merged in the replay's order, sent in batches; then ``None`` (done) or
    ``("error", text)``."""
    import traceback

    try:
        merged = heapq.merge(*(_encoded_node_stream(scenario, i, n) for i, n in indexed_names),
                             key=lambda item: item[0])
        batch: list[tuple[tuple[int, int, int, int], EncodedInput]] = []
        limit = SCENARIO_WORKER_BATCH_TICKS * len(indexed_names)
        for item in merged:
            batch.append(item)
            if len(batch) >= limit:
                queue.put(batch)
                batch = []
        if batch:
            queue.put(batch)
        queue.put(None)
    except BaseException:  # noqa: BLE001 -- the parent raises it; a worker must not die silently
        queue.put(("error", traceback.format_exc()))


def _from_worker(process: Any, queue: Any) -> Iterator[tuple[tuple[int, int, int, int], EncodedInput]]:
    while True:
        batch = queue.get()
        if batch is None:
            process.join()
            return
        if isinstance(batch, tuple):
            raise RuntimeError(f"a scenario worker process failed:\n{batch[1]}")
        yield from batch


def scenario_encoded_records(scenario: Any, nodes: Sequence[str] | None = None, *,
                             workers: int) -> Iterator[EncodedInput]:
    """``scenario_records`` simulated in ``workers`` processes (the nodes dealt round-robin; at most one process per
    node), each message encoded there: the same messages in the same order (the merge key is
    ``scenario_records``'), so a replay of them is byte-identical to one of ``scenario_records``. The processes
    are forked (the scenario is not pickled) and stopped when the iterator is closed or fails."""
    import multiprocessing

    names = tuple(nodes) if nodes is not None else tuple(n.name for n in scenario.nodes)
    count = max(1, min(workers, len(names)))
    context = multiprocessing.get_context("fork")
    started: list[tuple[Any, Any]] = []
    try:
        for w in range(count):
            queue = context.Queue(maxsize=_WORKER_QUEUE_BATCHES)
            mine = [(i, n) for i, n in enumerate(names) if i % count == w]
            process = context.Process(target=_scenario_worker, args=(scenario, mine, queue), daemon=True,
                                      name=f"gpumeter-replay-sim-{w}")
            process.start()
            started.append((process, queue))
        for _key, record in heapq.merge(*(_from_worker(p, q) for p, q in started), key=lambda item: item[0]):
            yield record
    finally:
        for process, queue in started:
            if process.is_alive():
                process.terminate()
            process.join()
            queue.close()
            queue.cancel_join_thread()


# ----------------------------------------------------------------------------------------------------------------
# Recordings


def encode_message(message: InputMessage) -> bytes:
    """The single-object Avro message of ``message`` (what its topic carries)."""
    return codec_for(type(message)).encode(message)


def decode_message(payload: bytes) -> InputMessage:
    """A recorded single-object message back to its record. Raises ``InvalidMessage`` subclasses: the codec's,
    or ``WrongRecordType`` for a record type replay does not read."""
    if len(payload) >= HEADER_BYTES and payload[:2] == MAGIC:
        (fingerprint,) = struct.unpack_from("<Q", payload, 2)
        writer = default_registry().by_fingerprint(fingerprint)
        if writer is not None:
            record_type = RECORD_TYPES.get(writer.full_name)
            if record_type not in (NodeSample, PodEvent):
                raise WrongRecordType(f"replay reads NodeSample and PodEvent, got {writer.full_name}")
            return codec_for(record_type).decode(payload)
    # Not decodable: let the codec name the reason (corrupt, truncated, unknown schema).
    return codec_for(NodeSample).decode(payload)


class RecordingWriter:
    """Writes a recording file (header on open, one frame per ``write``). Use as a context manager.

    ``version``: 1 (the default: what ``gpumeter replay --record`` has always written) or 2 (frames carry flags:
    ``write_frame(..., snapshot=True)``). ``compression``: ``none`` (default), ``gzip`` or ``lzma`` (xz). A
    compressed file is a sequence of members: ``sync()`` ends the current member, flushes and fsyncs, so that what
    was written before it reads back whole even if the process dies right after; the next write starts a new
    member. ``close()`` ends the last member (and fsyncs when ``fsync_on_close``)."""

    def __init__(self, path: str | Path, *, version: int = 1, compression: str = "none",
                 fsync_on_close: bool = False) -> None:
        if version not in (1, 2):
            raise ConfigError(f"recording version must be 1 or 2, not {version!r}")
        if compression not in COMPRESSIONS:
            raise ConfigError(f"recording compression must be one of {', '.join(COMPRESSIONS)}, not {compression!r}")
        self.path = Path(path)
        self.version = version
        self.compression = compression
        self.fsync_on_close = fsync_on_close
        self.count = 0
        self._raw: IO[bytes] | None = None
        self._member: IO[bytes] | None = None

    def __enter__(self) -> "RecordingWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._raw = open(self.path, "wb")
        self._out().write(RECORDING_MAGIC_V2 if self.version == 2 else RECORDING_MAGIC_V1)
        return self

    def _out(self) -> IO[bytes]:
        assert self._raw is not None, "RecordingWriter is used as a context manager"
        if self._member is None:
            if self.compression == "gzip":
                # mtime 0: the same frames give the same bytes (no time in the gzip header).
                self._member = gzip.GzipFile(fileobj=self._raw, mode="wb", mtime=0)  # type: ignore[assignment]
            elif self.compression == "lzma":
                self._member = lzma.LZMAFile(self._raw, "wb", format=lzma.FORMAT_XZ)  # type: ignore[assignment]
            else:
                self._member = self._raw
        return self._member

    def write(self, record: InputRecord) -> None:
        self.write_frame(record.received_at_unix_ms, encode_message(record.message))

    def write_frame(self, received_at_unix_ms: int, payload: bytes, *, snapshot: bool = False) -> None:
        """One frame of ``payload`` (the message's bytes, unchanged). ``snapshot`` needs version 2."""
        out = self._out()
        if self.version == 2:
            out.write(_FRAME_HEADER_V2.pack(received_at_unix_ms, FLAG_SNAPSHOT if snapshot else 0, len(payload)))
        else:
            if snapshot:
                raise ConfigError("snapshot frames need a version 2 recording")
            out.write(_FRAME_HEADER.pack(received_at_unix_ms, len(payload)))
        out.write(payload)
        self.count += 1

    def _end_member(self) -> None:
        if self._member is not None and self._member is not self._raw:
            self._member.close()  # ends the member; the file object under it stays open
        self._member = None

    def sync(self) -> None:
        """Make every frame written so far durable: end the compressed member, flush, fsync."""
        if self._raw is None:
            return
        self._end_member()
        self._raw.flush()
        os.fsync(self._raw.fileno())

    def close(self) -> None:
        if self._raw is None:
            return
        try:
            self._end_member()
            self._raw.flush()
            if self.fsync_on_close:
                os.fsync(self._raw.fileno())
        finally:
            self._raw.close()
            self._raw = None

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def write_recording(records: Iterable[InputRecord], path: str | Path) -> int:
    """Write ``records`` in order to the recording ``path``; returns how many."""
    with RecordingWriter(path) as writer:
        for record in records:
            writer.write(record)
    return writer.count


def record_scenario(scenario_path: str | Path, path: str | Path, *, node: str | None = None) -> int:
    """Record a scenario's pod events and samples (one node's, or all) to ``path``, in replay order."""
    from simulator.scenario import load_scenario

    scenario = load_scenario(Path(scenario_path))
    return write_recording(scenario_records(scenario, scenario_nodes(scenario, node)), path)


def _open_data(path: Path) -> IO[bytes]:
    """``path`` opened for reading its data: decompressed when it starts with gzip's or xz's magic bytes."""
    handle = open(path, "rb")
    head = handle.read(len(XZ_MAGIC))
    handle.seek(0)
    if head.startswith(GZIP_MAGIC):
        return gzip.GzipFile(fileobj=handle, mode="rb")  # type: ignore[return-value]
    if head.startswith(XZ_MAGIC):
        return lzma.LZMAFile(handle, "rb")  # type: ignore[return-value]
    return handle


def _read_exactly(handle: IO[bytes], size: int) -> bytes:
    """Up to ``size`` bytes; fewer only at the end of the data. A compressed stream cut short reads as its end
    (``_CutShort``)."""
    try:
        data = handle.read(size)
    except EOFError as exc:  # gzip/xz: the compressed stream ends before its end-of-stream marker
        raise _CutShort(str(exc)) from exc
    except (OSError, lzma.LZMAError, zlib.error) as exc:
        raise RecordingError(f"corrupt compressed data: {exc}") from exc
    return data


class _CutShort(Exception):
    pass


def iter_frames(path: str | Path, *, tolerate_torn_end: bool = False) -> Iterator[RecordedFrame]:
    """The frames of one recording file (plain, gzip or xz; version 1 or 2), in file order. Raises
    ``RecordingError`` for a broken structure -- unless ``tolerate_torn_end``, where a file whose end is torn (a
    frame or a compressed member cut short: a writer that died mid-write) ends at its last whole frame."""
    path = Path(path)
    try:
        handle = _open_data(path)
    except OSError as exc:
        raise RecordingError(f"cannot read recording {path}: {exc.strerror or exc}") from exc
    with handle:
        try:
            header = _read_exactly(handle, len(RECORDING_MAGIC_V1))
        except _CutShort:
            header = b""
        if header == RECORDING_MAGIC_V1:
            frame_header, flagged = _FRAME_HEADER, False
        elif header == RECORDING_MAGIC_V2:
            frame_header, flagged = _FRAME_HEADER_V2, True
        else:
            if tolerate_torn_end and not header:
                return
            raise RecordingError(f"{path} is not a gpumeter recording (it does not start with "
                                 f"{RECORDING_MAGIC_V1!r} or {RECORDING_MAGIC_V2!r}, plain, gzip or xz)")
        position = 0
        while True:
            try:
                head = _read_exactly(handle, frame_header.size)
                if not head:
                    return
                if len(head) < frame_header.size:
                    raise _CutShort(f"{path}: frame {position} is cut short in its header")
                if flagged:
                    received_at, flags, length = frame_header.unpack(head)
                else:
                    (received_at, length), flags = frame_header.unpack(head), 0
                if flags & ~_KNOWN_FLAGS:
                    raise RecordingError(f"{path}: frame {position} has unknown flags {flags:#04x} (a newer "
                                         f"recording format?)")
                if length > MAX_FRAME_BYTES:
                    raise RecordingError(f"{path}: frame {position} claims {length} bytes (more than "
                                         f"{MAX_FRAME_BYTES}): not a recording, or a corrupt one")
                payload = _read_exactly(handle, length)
                if len(payload) < length:
                    raise _CutShort(f"{path}: frame {position} is cut short ({len(payload)} of {length} bytes)")
            except _CutShort as exc:
                if tolerate_torn_end:
                    return
                reason = str(exc) if str(exc).startswith(str(path)) else (
                    f"{path}: frame {position} is cut short (compressed data ends early: {exc})")
                raise RecordingError(reason) from None
            yield RecordedFrame(received_at, payload, f"{path.name}#{position}", position,
                                bool(flags & FLAG_SNAPSHOT))
            position += 1


def recording_files(path: str | Path) -> tuple[Path, ...]:
    """The recording files of ``path``: itself, or every ``*.gmrec`` in a directory, sorted by name."""
    path = Path(path)
    if path.is_dir():
        files = tuple(sorted(p for p in path.iterdir() if p.name.endswith(RECORDING_SUFFIX) and p.is_file()))
        if not files:
            raise RecordingError(f"{path} holds no *{RECORDING_SUFFIX} recording")
        return files
    return (path,)


def read_recording(path: str | Path) -> Iterator[InputRecord]:
    """Every record of a recording (file or directory) in replay order; undecodable messages raise."""
    for item in recorded_inputs(path):
        if isinstance(item, InvalidInput):
            raise item.error
        yield item


@dataclass(frozen=True, slots=True)
class InvalidInput:
    """An input message that cannot be used: dead-lettered with ``error.reason_code``."""

    source: str
    received_at_unix_ms: int
    error: InvalidMessage
    message: InputMessage | None = None
    payload: bytes | None = None  # the recorded bytes, as the topic carried them


def _frame_key(frame: RecordedFrame) -> tuple[int, bytes]:
    return frame.received_at_unix_ms, hashlib.blake2b(frame.payload, digest_size=16).digest()


def recorded_inputs(path: str | Path) -> Iterator[InputRecord | InvalidInput]:
    """Every input of a recording (file or directory; see the module docstring for the order and for what a
    directory skips), undecodable messages as ``InvalidInput``."""

    def stream(index: int, file: Path) -> list[tuple[tuple[int, int, int, int],
                                                     tuple[RecordedFrame, InputRecord | InvalidInput]]]:
        items: list[tuple[tuple[int, int, int, int], tuple[RecordedFrame, InputRecord | InvalidInput]]] = []
        for frame in iter_frames(file):
            try:
                message = decode_message(frame.payload)
            except InvalidMessage as exc:
                # Undecodable: no kind to order by; it sorts with samples (after the instant's pod events).
                items.append(((frame.received_at_unix_ms, 1, index, frame.position), (frame, InvalidInput(
                    frame.source, frame.received_at_unix_ms, exc, payload=frame.payload))))
                continue
            key = (frame.received_at_unix_ms, _kind_rank(message), index, frame.position)
            items.append((key, (frame, InputRecord(frame.received_at_unix_ms, message, frame.payload))))
        # A file's frames are in the order they were read, which is not received order when several partitions
        # were: a recorder gets each fetched partition's messages in turn, so a partition read behind another
        # puts earlier frames after later ones. Replay (and the merge of a directory's files) is in received order.
        items.sort(key=lambda item: item[0])
        return items

    files = recording_files(path)
    if len(files) == 1:
        # One file is replayed on its own, snapshot frames included.
        for _key, (_frame, item) in stream(0, files[0]):
            yield item
        return
    # Pod events read so far, by (received_at, digest of the bytes): a snapshot frame is a copy of one of them.
    seen: set[tuple[int, bytes]] = set()
    seen_as_snapshot: set[tuple[int, bytes]] = set()
    for frame, item in _merged_lazily(files, stream):
        if isinstance(item, InputRecord) and isinstance(item.message, PodEvent):
            key = _frame_key(frame)
            if key in seen and (frame.snapshot or key in seen_as_snapshot):
                continue
            seen.add(key)
            if frame.snapshot:
                seen_as_snapshot.add(key)
        yield item


def _merged_lazily(files: Sequence[Path], load: Any) -> Iterator[tuple[RecordedFrame, InputRecord | InvalidInput]]:
    """The items of every file, merged by key, each file read (``load(index, file)``: its items sorted by key)
    only once the merge reaches its earliest frame: a month of hourly files holds the files that overlap in time,
    not the month. A first pass finds each file's earliest received time without keeping a frame (a file may
    hold frames from before its name's hour: read late; never from after it)."""
    earliest = []
    for index, file in enumerate(files):
        first = min((frame.received_at_unix_ms for frame in iter_frames(file)), default=None)
        if first is not None:
            earliest.append((first, index, file))
    earliest.sort()
    waiting = iter(earliest)
    following = next(waiting, None)
    heap: list[tuple[Any, int, Any, Iterator[Any]]] = []  # (key, file index, item, the file's rest)
    while heap or following is not None:
        # A file whose earliest frame is no later than the merge's next one may hold a frame before it (at the
        # same time: a pod event before a sample): read it in first.
        while following is not None and (not heap or following[0] <= heap[0][0][0]):
            _first, index, file = following
            items = iter(load(index, file))
            head = next(items, None)
            if head is not None:
                heapq.heappush(heap, (head[0], index, head[1], items))
            following = next(waiting, None)
        if not heap:
            continue
        _key, index, value, items = heapq.heappop(heap)
        yield value
        head = next(items, None)
        if head is not None:
            heapq.heappush(heap, (head[0], index, head[1], items))


def is_recording(path: str | Path) -> bool:
    """Whether ``path`` is a recording file (plain or compressed, version 1 or 2) or a directory (a directory is
    read as recordings)."""
    path = Path(path)
    if path.is_dir():
        return True
    try:
        with _open_data(path) as handle:
            return _read_exactly(handle, len(RECORDING_MAGIC_V1)) in (RECORDING_MAGIC_V1, RECORDING_MAGIC_V2)
    except (OSError, RecordingError, _CutShort):
        return False
