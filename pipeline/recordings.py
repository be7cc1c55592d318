"""Replay's input: records from a scenario (the simulator and the collector's real sampling code) or from a
recording file, in the order the attributor receives them.

Recording format (``*.gmrec``)
------------------------------
A binary file: the 21-byte header ``gpumeter-recording/1\\n``, then frames until the end of the file. A frame
is ``received_at_unix_ms`` (int64, big-endian), ``length`` (uint32, big-endian), then ``length`` bytes: one
Avro single-object message (``C3 01`` + CRC-64-AVRO fingerprint + body), byte for byte what the ``node-samples``
and ``pod-events`` topics carry. The fingerprint names the writer schema and so the record type (``NodeSample``
or ``PodEvent``); old recordings stay readable through Avro schema resolution as long as the registry holds
their writer schema. A broken frame structure (bad header, a frame cut short) raises ``RecordingError``; a frame
whose message does not decode is dead-lettered with the codec's reason code and replay carries on, as the
streaming consumer does. INPUT may also be a directory: every ``*.gmrec`` in it (sorted by name) is read and the
files are merged by (received_at, pod events before samples, file order, frame order); one file is replayed in
its own order. ``record_scenario`` and ``gpumeter replay --record`` write recordings.
"""

from __future__ import annotations

import heapq
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Sequence, Union

from gpumeter.errors import ConfigError, InvalidMessage, WrongRecordType
from schemas.codec import HEADER_BYTES, MAGIC, default_registry
from schemas.records import RECORD_TYPES, NodeSample, PodEvent
from schemas.typed import codec_for

RECORDING_MAGIC = b"gpumeter-recording/1\n"
RECORDING_SUFFIX = ".gmrec"
_FRAME_HEADER = struct.Struct(">qI")
MAX_FRAME_BYTES = 64 * 1024 * 1024

InputMessage = Union[NodeSample, PodEvent]


class RecordingError(InvalidMessage):
    """A recording whose structure is broken: not a recording, a frame cut short, an absurd frame length."""

    reason_code = "BAD_RECORDING"


# ----------------------------------------------------------------------------------------------------------------
# Input records


@dataclass(frozen=True, slots=True)
class InputRecord:
    """One input message and the time it reached the attributor (``received_at_unix_ms``)."""

    received_at_unix_ms: int
    message: InputMessage

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
    """Writes a recording file (header on open, one frame per ``write``). Use as a context manager."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.count = 0
        self._file: IO[bytes] | None = None

    def __enter__(self) -> "RecordingWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "wb")
        self._file.write(RECORDING_MAGIC)
        return self

    def write(self, record: InputRecord) -> None:
        assert self._file is not None, "RecordingWriter is used as a context manager"
        payload = encode_message(record.message)
        self._file.write(_FRAME_HEADER.pack(record.received_at_unix_ms, len(payload)))
        self._file.write(payload)
        self.count += 1

    def __exit__(self, *exc_info: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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


def iter_frames(path: str | Path) -> Iterator[RecordedFrame]:
    """The frames of one recording file, in file order. Raises ``RecordingError`` for a broken structure."""
    path = Path(path)
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise RecordingError(f"cannot read recording {path}: {exc.strerror or exc}") from exc
    with handle:
        header = handle.read(len(RECORDING_MAGIC))
        if header != RECORDING_MAGIC:
            raise RecordingError(f"{path} is not a gpumeter recording (it does not start with "
                                 f"{RECORDING_MAGIC!r})")
        position = 0
        while True:
            head = handle.read(_FRAME_HEADER.size)
            if not head:
                return
            if len(head) < _FRAME_HEADER.size:
                raise RecordingError(f"{path}: frame {position} is cut short in its header")
            received_at, length = _FRAME_HEADER.unpack(head)
            if length > MAX_FRAME_BYTES:
                raise RecordingError(f"{path}: frame {position} claims {length} bytes (more than "
                                     f"{MAX_FRAME_BYTES}): not a recording, or a corrupt one")
            payload = handle.read(length)
            if len(payload) < length:
                raise RecordingError(f"{path}: frame {position} is cut short ({len(payload)} of {length} bytes)")
            yield RecordedFrame(received_at, payload, f"{path.name}#{position}", position)
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


def recorded_inputs(path: str | Path) -> Iterator[InputRecord | InvalidInput]:
    def stream(index: int, file: Path) -> Iterator[tuple[tuple[int, int, int, int], InputRecord | InvalidInput]]:
        for frame in iter_frames(file):
            try:
                message = decode_message(frame.payload)
            except InvalidMessage as exc:
                # Undecodable: no kind to order by; it sorts with samples (after the instant's pod events).
                yield (frame.received_at_unix_ms, 1, index, frame.position), InvalidInput(
                    frame.source, frame.received_at_unix_ms, exc, payload=frame.payload)
                continue
            key = (frame.received_at_unix_ms, _kind_rank(message), index, frame.position)
            yield key, InputRecord(frame.received_at_unix_ms, message)

    files = recording_files(path)
    if len(files) == 1:
        # One file is replayed in its own order (what a consumer of one partition saw).
        for _key, item in stream(0, files[0]):
            yield item
        return
    for _key, item in heapq.merge(*(stream(i, f) for i, f in enumerate(files)), key=lambda pair: pair[0]):
        yield item


def is_recording(path: str | Path) -> bool:
    """Whether ``path`` is a recording file or a directory (a directory is read as recordings)."""
    path = Path(path)
    if path.is_dir():
        return True
    try:
        with open(path, "rb") as handle:
            return handle.read(len(RECORDING_MAGIC)) == RECORDING_MAGIC
    except OSError:
        return False
