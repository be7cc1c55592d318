"""What ``gpumeter record`` decides, free of Kafka and of files: which frame goes to which file, when a file is
closed, and the pod state each new file starts with.

``RecorderProcessor`` is a processor of the one contract (``gpumeter.stream.contract``) over two raw inputs (record
type ``bytes``: the runner hands it each message's value undecoded), the node-samples and pod-events topics. Its
results carry no emits, only changes for its store (``pipeline.recording_store.RecordingDirectory``), in order:

* ``OpenFile(bucket_start_unix_ms, snapshot)``: start the file of the rotation bucket ``[start, start +
  rotation)``; ``snapshot`` is the last event (time and bytes, as received) of every pod alive at that moment, to be
  written first as snapshot frames.
* ``WriteFrame(received_at_unix_ms, payload)``: one message, bytes unchanged.
* ``CloseFile()``: the current file is complete.

**Time.** A frame's time is the message's Kafka timestamp (the broker's LogAppendTime on both topics: when the
attributor could first read it), else the runner's clock. It is deterministic: reading the same offsets again
gives the same frames, so a recorder restarted from its last commit re-writes byte-identical frames, which replay
recognises (see ``pipeline.recordings``).

**Rotation** by received time: a frame whose bucket (``floor(t / rotation)``) is later than the open file's closes
it and opens the frame's bucket's file; a frame of an earlier bucket (another partition running behind) goes into
the open file, which is never reopened; the first file after none is open takes ``max(frame's bucket, last
bucket)`` so that names stay in time order. The clock closes a file too: ``on_clock(now)`` closes the open file
once ``now`` is ``close_grace`` past its bucket's end, so an hour's file is finished when the hour is over even
if the input stops.

**Pod state** (the snapshot): per pod (``node/uid``, the compaction key) its last decodable ``PodEvent``
message; a ``DELETED`` event or a tombstone drops the pod. Undecodable bytes are recorded (replay dead-letters them,
as the stream does) and leave the state alone. ``pod_state_of(frames)`` rebuilds the state from a file's frames
(its snapshot, then its own pod events): what a restarted recorder starts from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from gpumeter.errors import ConfigError, InvalidMessage
from gpumeter.stream.contract import NOTHING, Event, Input, Position, ProcessorDefaults, Result
from schemas.catalog import pod_event_key
from schemas.records import PodEvent, PodEventType

SERVICE_NAME = "recorder"
SAMPLES = "samples"
POD_EVENTS = "pod_events"
DEFAULT_ROTATION_SECONDS = 3600
DEFAULT_CLOSE_GRACE_SECONDS = 60


@dataclass(frozen=True, slots=True)
class Frame:
    """One recorded message: when it was received and its bytes, unchanged."""

    received_at_unix_ms: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class OpenFile:
    """Open the file of the bucket starting at ``bucket_start_unix_ms``; write ``snapshot`` first, flagged."""

    bucket_start_unix_ms: int
    snapshot: tuple[Frame, ...]


@dataclass(frozen=True, slots=True)
class WriteFrame:
    frame: Frame


@dataclass(frozen=True, slots=True)
class CloseFile:
    """Finish the open file (durably)."""


def bucket_of(received_at_unix_ms: int, rotation_ms: int) -> int:
    """The start of the rotation bucket holding ``received_at_unix_ms``."""
    return received_at_unix_ms - received_at_unix_ms % rotation_ms


def _pod_event(payload: bytes) -> PodEvent | None:
    from pipeline.recordings import decode_message

    try:
        message = decode_message(payload)
    except InvalidMessage:
        return None
    return message if isinstance(message, PodEvent) else None


def apply_pod_frame(state: dict[bytes, Frame], frame: Frame) -> None:
    """``state`` (pod key -> its last event) after the pod-event ``frame`` (in place; undecodable: no change)."""
    event = _pod_event(frame.payload)
    if event is None:
        return
    key = pod_event_key(event.node_name, event.uid)
    if event.event_type is PodEventType.DELETED:
        state.pop(key, None)
    else:
        state[key] = frame


def pod_state_of(frames: Iterable[Frame]) -> dict[bytes, Frame]:
    """The pod state after ``frames`` (pod events, in order; other messages are ignored): a file's snapshot and
    own pod events give the state at its end."""
    state: dict[bytes, Frame] = {}
    for frame in frames:
        apply_pod_frame(state, frame)
    return state


class RecorderProcessor(ProcessorDefaults):
    """See the module docstring. ``pods``: the pod state to start from (a restarted recorder's, from its last
    file); ``last_bucket_unix_ms``: the bucket of the last file written (names never go back before it)."""

    service = SERVICE_NAME
    # Both take a message without value: the recorder stores nothing for it and rejects nothing (a dead letter is
    # the attributor's to write, not a second one from here).
    inputs = (Input(POD_EVENTS, bytes, tombstones=True), Input(SAMPLES, bytes, tombstones=True))

    def __init__(self, *, rotation_seconds: int = DEFAULT_ROTATION_SECONDS,
                 close_grace_seconds: int = DEFAULT_CLOSE_GRACE_SECONDS,
                 pods: Mapping[bytes, Frame] | None = None, last_bucket_unix_ms: int | None = None) -> None:
        if rotation_seconds <= 0:
            raise ConfigError(f"rotation must be > 0 seconds, not {rotation_seconds}")
        if close_grace_seconds < 0:
            raise ConfigError(f"close grace must be >= 0 seconds, not {close_grace_seconds}")
        self.rotation_ms = rotation_seconds * 1000
        self.close_grace_ms = close_grace_seconds * 1000
        self.pods: dict[bytes, Frame] = dict(pods or {})
        self.last_bucket_unix_ms = last_bucket_unix_ms
        self.open_bucket_unix_ms: int | None = None
        self.files_opened = 0
        self.frames = 0

    def snapshot(self) -> tuple[Frame, ...]:
        """The pod state as snapshot frames, in received order (then by bytes: deterministic)."""
        return tuple(sorted(self.pods.values(), key=lambda f: (f.received_at_unix_ms, f.payload)))

    def _open(self, bucket: int) -> OpenFile:
        if self.last_bucket_unix_ms is not None:
            bucket = max(bucket, self.last_bucket_unix_ms)
        self.open_bucket_unix_ms = self.last_bucket_unix_ms = bucket
        self.files_opened += 1
        return OpenFile(bucket, self.snapshot())

    def handle(self, event: Event, position: Position) -> Result:
        if event.record is None:
            # A tombstone of the compacted pod-events topic: nothing to record; the pod is gone.
            if event.input == POD_EVENTS and event.key is not None:
                self.pods.pop(event.key, None)
            return NOTHING
        received_at = event.timestamp_ms if event.timestamp_ms is not None else event.received_at_unix_ms
        frame = Frame(received_at, event.record)
        bucket = bucket_of(received_at, self.rotation_ms)
        changes: list[object] = []
        if self.open_bucket_unix_ms is None:
            changes.append(self._open(bucket))
        elif bucket > self.open_bucket_unix_ms:
            changes.append(CloseFile())
            changes.append(self._open(bucket))
        changes.append(WriteFrame(frame))
        self.frames += 1
        if event.input == POD_EVENTS:
            apply_pod_frame(self.pods, frame)
        return Result(changes=tuple(changes))

    def on_clock(self, now_ms: int, caught_up: bool = True) -> Result:
        if (self.open_bucket_unix_ms is not None
                and now_ms >= self.open_bucket_unix_ms + self.rotation_ms + self.close_grace_ms):
            self.open_bucket_unix_ms = None
            return Result(changes=(CloseFile(),))
        return NOTHING

    def close(self) -> Result:
        """The changes that finish the open file (at stop)."""
        if self.open_bucket_unix_ms is None:
            return NOTHING
        self.open_bucket_unix_ms = None
        return Result(changes=(CloseFile(),))


def changes_frames(changes: Sequence[object]) -> list[Frame]:
    """The frames ``changes`` write (tests and tools)."""
    return [c.frame for c in changes if isinstance(c, WriteFrame)]


__all__ = ["CloseFile", "Frame", "OpenFile", "RecorderProcessor", "WriteFrame", "apply_pod_frame", "bucket_of",
           "pod_state_of"]
