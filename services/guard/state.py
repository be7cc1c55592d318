"""The guard's state on disk: the engine's snapshot with the input positions it covers, in one file replaced
atomically (``GuardStateStore``), and the driver's checkpoint hook that writes it (``StateCheckpoint``).

The engine's state lives in memory. At every checkpoint (``KafkaDriver``: every ``snapshot_interval_seconds`` and
at stop, once every record produced so far is acknowledged) ``StateCheckpoint`` writes the engine's snapshot
together with the positions read so far, and hands those positions back to be committed to the consumer group. A
restart restores the engine from the file and reads on from the positions in it, so state and input never
disagree; what was read after the last snapshot is read again and the engine re-derives the same violations (the
compacted topic and Alertmanager both deduplicate by fingerprint). While a rebuild from the violations topic is
under way nothing is written or committed: the engine holds back what the topic has not heard, and a state file
then would lose it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from gpumeter.clock import Clock
from gpumeter.errors import GpumeterError

log = logging.getLogger(__name__)

TopicPartition = tuple[str, int]


class GuardStateError(GpumeterError):
    """The state file cannot be read back (corrupt, truncated, another format) or cannot be written."""


STATE_MAGIC = b"GPUMETER-GUARD-STATE 1\n"


@dataclass(frozen=True)
class GuardState:
    """The engine's snapshot and the input positions (next offset to read per topic-partition) it covers."""

    engine_bytes: bytes
    positions: Mapping[TopicPartition, int]
    saved_at_unix_ms: int


def encode_state(state: GuardState) -> bytes:
    """``STATE_MAGIC``, one JSON header line (positions, length and SHA-256 of the engine bytes), the bytes."""
    header = {
        "saved_at_unix_ms": state.saved_at_unix_ms,
        "positions": [[topic, partition, offset] for (topic, partition), offset in sorted(state.positions.items())],
        "engine_bytes": len(state.engine_bytes),
        "engine_sha256": hashlib.sha256(state.engine_bytes).hexdigest(),
    }
    return STATE_MAGIC + json.dumps(header, sort_keys=True).encode("utf-8") + b"\n" + state.engine_bytes


def decode_state(data: bytes) -> GuardState:
    """The inverse of ``encode_state``; ``GuardStateError`` for anything that is not exactly such a file."""
    if not data.startswith(STATE_MAGIC):
        raise GuardStateError("not a guard state file (bad magic)")
    rest = data[len(STATE_MAGIC):]
    end = rest.find(b"\n")
    if end < 0:
        raise GuardStateError("truncated guard state file (no header)")
    try:
        header = json.loads(rest[:end])
        length = int(header["engine_bytes"])
        digest = str(header["engine_sha256"])
        positions = {(str(t), int(p)): int(o) for t, p, o in header["positions"]}
        saved_at = int(header["saved_at_unix_ms"])
    except (ValueError, KeyError, TypeError) as exc:
        raise GuardStateError(f"unreadable guard state header: {exc!r}") from exc
    body = rest[end + 1:]
    if len(body) != length:
        raise GuardStateError(f"guard state holds {len(body)} engine bytes, its header says {length}")
    if hashlib.sha256(body).hexdigest() != digest:
        raise GuardStateError("guard state engine bytes do not match their checksum")
    return GuardState(engine_bytes=body, positions=positions, saved_at_unix_ms=saved_at)


class GuardStateStore:
    """One state file, replaced atomically: write a temporary file beside it, fsync, rename over it, fsync the
    folder. A crash at any point leaves either the old file or the new one, never a mix."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def load(self) -> GuardState | None:
        """The saved state, None when there is no file; ``GuardStateError`` when it cannot be read back."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise GuardStateError(f"cannot read {self.path}: {exc}") from exc
        return decode_state(data)

    def save(self, state: GuardState) -> None:
        data = encode_state(state)
        folder = self.path.parent
        temporary = folder / f".{self.path.name}.{os.getpid()}.tmp"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(temporary, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.path)
            directory = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as exc:
            try:
                temporary.unlink()
            except OSError:
                pass
            raise GuardStateError(f"cannot write {self.path}: {exc}") from exc

    def move_aside(self, now_ms: int) -> Path | None:
        """Rename an unreadable file to ``<name>.corrupt-<now_ms>`` (kept for a post-mortem); returns the new path."""
        target = self.path.with_name(f"{self.path.name}.corrupt-{now_ms}")
        try:
            os.replace(self.path, target)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise GuardStateError(f"cannot move {self.path} aside: {exc}") from exc
        return target


class StateCheckpoint:
    """``KafkaDriver``'s checkpoint hook for the guard: called with the positions read so far, once everything
    produced from them is acknowledged; writes ``GuardState(processor.snapshot(), positions, now)`` with ``store``
    (None: no state file) and returns the positions to commit. Returns None (nothing written, nothing committed)
    while ``processor.rebuilding``. A state file that cannot be written is logged and the positions are committed
    anyway: a restart prefers the (older) state file's own positions, and without any state file pod events are
    re-read from the start regardless."""

    def __init__(self, processor: Any, store: GuardStateStore | None, clock: Clock) -> None:
        self.processor = processor
        self.store = store
        self.clock = clock
        self.snapshots = 0

    async def __call__(self, positions: Mapping[TopicPartition, int]) -> Mapping[TopicPartition, int] | None:
        if self.processor.rebuilding:
            return None
        # The snapshot is taken before any await: the driver holds its lock, so no input or tick moves the engine
        # between the positions it handed over and this snapshot.
        state = GuardState(engine_bytes=self.processor.snapshot(), positions=dict(positions),
                           saved_at_unix_ms=self.clock.now_ms())
        if self.store is not None:
            try:
                await asyncio.to_thread(self.store.save, state)
                self.snapshots += 1
            except GuardStateError as exc:
                log.error("state not saved, a restart re-reads from the previous snapshot: %s", exc)
        return state.positions


__all__ = ["STATE_MAGIC", "GuardState", "GuardStateError", "GuardStateStore", "StateCheckpoint", "decode_state",
           "encode_state"]
