"""The files of ``gpumeter record``: a directory of rotating version-2 recordings (``pipeline.recordings``), the
store of the ``RecorderProcessor``'s changes (``pipeline.recorder``).

**Names.** ``<bucket start, UTC, YYYYmmddTHHMMSSZ>-<part, 4 digits>.gmrec``: sorting by name is time order. A file
being written is ``<name>.partial`` (replay reads only ``*.gmrec``); closing it ends its compressed member, fsyncs
it, renames it to its name and fsyncs the directory. ``part`` is one more than the highest part of that bucket
already in the directory: a restart within an hour starts a new part, it never appends to a file.

**Durability.** ``apply`` writes frames through the file's compressor (buffered: not yet durable). ``sync()`` ends
the current compressed member, flushes and fsyncs: everything written before it reads back whole. The command
syncs before every commit of its consumer offsets (the driver's checkpoint hook, every ``sync_interval_seconds``)
and at every rotation, so no committed offset stands past a frame that is not on disk.

**Crash recovery** (``recover()``, at start): a ``.partial`` file left by a recorder that died is salvaged -- its
whole frames (up to the last one before the torn end) rewritten into its ``.gmrec`` name, the partial removed. Its
frames after the last sync were never committed, so the recorder reads them again and writes them again into its
next file: the same bytes at the same received time (the Kafka timestamp), which replay takes as it takes any
redelivery -- a repeated tick is dropped by the attributor's engine, a repeated pod event (same time, same resource
version) is ignored by the pod index. Nothing is lost; what is repeated, replay tolerates. ``recover`` also returns
the pod state at the end of the last file (its snapshot and own pod events) and its bucket, to start from.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
from pathlib import Path
from typing import Any, Sequence

from gpumeter.stream.contract import Settled
from pipeline.recorder import CloseFile, Frame, OpenFile, WriteFrame, pod_state_of
from pipeline.recordings import RECORDING_SUFFIX, RecordingWriter, iter_frames

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
_NAME = re.compile(r"^(\d{8}T\d{6}Z)-(\d{4,})" + re.escape(RECORDING_SUFFIX) + r"(" + re.escape(PARTIAL_SUFFIX)
                   + r")?$")
_STAMP = "%Y%m%dT%H%M%SZ"


def file_stamp(bucket_start_unix_ms: int) -> str:
    return dt.datetime.fromtimestamp(bucket_start_unix_ms / 1000, dt.timezone.utc).strftime(_STAMP)


def bucket_of_name(name: str) -> int | None:
    """The bucket start of a recorder file's name (None: not one of its names)."""
    match = _NAME.match(name)
    if match is None:
        return None
    stamp = dt.datetime.strptime(match.group(1), _STAMP).replace(tzinfo=dt.timezone.utc)
    return int(stamp.timestamp() * 1000)


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RecordingDirectory:
    """The ``Store`` of ``RecorderProcessor`` changes over ``directory``. See the module docstring.

    ``metrics``: a ``gpumeter.metrics.ServiceMetrics`` holding the ``gpumeter_record_*`` counters (frames and their
    bytes as written, files finished, syncs), or None."""

    def __init__(self, directory: str | Path, *, compression: str = "gzip", metrics: Any = None) -> None:
        self.directory = Path(directory)
        self.compression = compression
        self._writer: RecordingWriter | None = None
        self._final: Path | None = None
        self.files_closed: list[Path] = []
        self.syncs = 0
        self._metrics = metrics
        RecordingWriter(self.directory / "probe", version=2, compression=compression)  # checks the compression

    # -- start --

    def recover(self) -> tuple[dict[bytes, Frame], int | None]:
        """Salvage ``.partial`` files left by a crash; then the pod state at the end of the last file and its
        bucket (empty and None for an empty directory)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for partial in sorted(self.directory.glob(f"*{RECORDING_SUFFIX}{PARTIAL_SUFFIX}")):
            self._salvage(partial)
        files = sorted(p for p in self.directory.iterdir() if bucket_of_name(p.name) is not None
                       and p.name.endswith(RECORDING_SUFFIX))
        if not files:
            return {}, None
        last = files[-1]
        state = pod_state_of(Frame(f.received_at_unix_ms, f.payload) for f in iter_frames(last))
        return state, bucket_of_name(last.name)

    def _salvage(self, partial: Path) -> None:
        frames = list(iter_frames(partial, tolerate_torn_end=True))
        final = partial.with_name(partial.name[: -len(PARTIAL_SUFFIX)])
        if frames:
            scratch = partial.with_name(final.name + ".salvage")
            with RecordingWriter(scratch, version=2, compression=self.compression, fsync_on_close=True) as writer:
                for frame in frames:
                    writer.write_frame(frame.received_at_unix_ms, frame.payload, snapshot=frame.snapshot)
            os.replace(scratch, final)
        partial.unlink()
        _fsync_directory(self.directory)
        log.warning("salvaged %s: %d whole frames kept as %s (what followed the last sync is read again)", partial,
                    len(frames), final.name if frames else "nothing")

    # -- the Store --

    def apply(self, changes: Sequence[Any]) -> Sequence[Settled]:
        frames = payload_bytes = 0
        for change in changes:
            if isinstance(change, WriteFrame):
                if self._writer is None:
                    raise RuntimeError("a frame to write with no file open")
                self._writer.write_frame(change.frame.received_at_unix_ms, change.frame.payload)
                frames += 1
                payload_bytes += len(change.frame.payload)
            elif isinstance(change, OpenFile):
                self._open(change)
            elif isinstance(change, CloseFile):
                self.close()
            else:
                raise TypeError(f"not a recorder change: {change!r}")
        if self._metrics is not None and frames:
            self._metrics.get("gpumeter_record_frames_total").inc(frames)
            self._metrics.get("gpumeter_record_payload_bytes_total").inc(payload_bytes)
        return [Settled()] * len(changes)

    def published(self, changes: Sequence[Any], now_ms: int) -> None:
        """Nothing to do: the recorder's changes owe no records."""

    def _open(self, change: OpenFile) -> None:
        if self._writer is not None:
            self.close()
        self.directory.mkdir(parents=True, exist_ok=True)
        stamp = file_stamp(change.bucket_start_unix_ms)
        parts = [int(m.group(2)) for p in self.directory.iterdir()
                 if (m := _NAME.match(p.name)) is not None and m.group(1) == stamp]
        final = self.directory / f"{stamp}-{max(parts, default=-1) + 1:04d}{RECORDING_SUFFIX}"
        writer = RecordingWriter(final.with_name(final.name + PARTIAL_SUFFIX), version=2,
                                 compression=self.compression, fsync_on_close=True)
        writer.__enter__()
        for frame in change.snapshot:
            writer.write_frame(frame.received_at_unix_ms, frame.payload, snapshot=True)
        self._writer, self._final = writer, final

    def sync(self) -> None:
        """Make every frame written so far durable (see the module docstring)."""
        if self._writer is not None:
            self._writer.sync()
            self.syncs += 1
            if self._metrics is not None:
                self._metrics.get("gpumeter_record_syncs_total").inc()

    def close(self) -> None:
        """Finish the open file: end, fsync, rename to its name, fsync the directory."""
        writer, final = self._writer, self._final
        if writer is None or final is None:
            return
        self._writer = self._final = None
        writer.close()
        os.replace(writer.path, final)
        _fsync_directory(self.directory)
        self.files_closed.append(final)
        if self._metrics is not None:
            self._metrics.get("gpumeter_record_files_finished_total").inc()
        log.info("recorded %s (%d frames)", final.name, writer.count)

    @property
    def open_path(self) -> Path | None:
        return self._writer.path if self._writer is not None else None


__all__ = ["PARTIAL_SUFFIX", "RecordingDirectory", "bucket_of_name", "file_stamp"]
