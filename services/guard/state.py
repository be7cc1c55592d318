"""The guard's state on disk: the engine's snapshot with the input positions it covers, in one file replaced
atomically (``GuardStateStore``), and the driver's checkpoint hook that writes it (``StateCheckpoint``).

The engine's state lives in memory. At every checkpoint (``KafkaDriver``: every ``snapshot_interval_seconds`` and
at stop, once every record produced so far is acknowledged) ``StateCheckpoint`` writes the engine's snapshot
together with the positions read so far, and hands those positions back to be committed to the consumer group. A
restart restores the engine from the file and reads on from the positions in it, so state and input never
disagree; what was read after the last snapshot is read again and the engine re-derives the same violations (the
compacted topic and Alertmanager both deduplicate by fingerprint). The file also records the role that wrote it
and the input topics its positions cover (``check_state``): a guard of another role, or reading other topics,
refuses it (``GuardStateMismatch``) rather than adopt rules' state and positions of input it never reads. While a
rebuild from the violations topic is under way nothing is written or committed: the engine holds back what the
topic has not heard, and a state file then would lose it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from gpumeter.clock import Clock
from gpumeter.errors import GpumeterError

log = logging.getLogger(__name__)

TopicPartition = tuple[str, int]


class GuardStateError(GpumeterError):
    """The state file cannot be read back (corrupt, truncated, another format) or cannot be written."""


class GuardStateMismatch(GuardStateError):
    """The state file is readable but not this guard's: another role wrote it, or its positions cover other input
    topics (``check_state``)."""


STATE_MAGIC = b"GPUMETER-GUARD-STATE 1\n"

# The role every state file written before files recorded their role came from: the guard had no other then.
LEGACY_ROLE = "all"


@dataclass(frozen=True)
class GuardState:
    """The engine's snapshot and the input positions (next offset to read per topic-partition) it covers.
    ``role``: the guard role that wrote it (``services.guard.processor.ROLES``); ``topics``: every input topic
    that guard read, the ones its positions cover (a partition without a position is covered by none of the state).
    Both None in a file written before they were recorded (``LEGACY_ROLE`` wrote it, its topics unknown)."""

    engine_bytes: bytes
    positions: Mapping[TopicPartition, int]
    saved_at_unix_ms: int
    role: str | None = None
    topics: frozenset[str] | None = None


def encode_state(state: GuardState) -> bytes:
    """``STATE_MAGIC``, one JSON header line (positions, role, input topics, length and SHA-256 of the engine
    bytes), the bytes."""
    header = {
        "saved_at_unix_ms": state.saved_at_unix_ms,
        "positions": [[topic, partition, offset] for (topic, partition), offset in sorted(state.positions.items())],
        "engine_bytes": len(state.engine_bytes),
        "engine_sha256": hashlib.sha256(state.engine_bytes).hexdigest(),
    }
    # Left out when unknown: a state without them encodes as a file written before they were recorded.
    if state.role is not None:
        header["role"] = state.role
    if state.topics is not None:
        header["topics"] = sorted(state.topics)
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
        role = header.get("role")
        if role is not None and not isinstance(role, str):
            raise TypeError(f"role {role!r} is no string")
        topics = header.get("topics")
        if topics is not None:
            if not isinstance(topics, list) or not all(isinstance(t, str) for t in topics):
                raise TypeError(f"topics {topics!r} is no list of names")
            topics = frozenset(topics)
    except (ValueError, KeyError, TypeError) as exc:
        raise GuardStateError(f"unreadable guard state header: {exc!r}") from exc
    body = rest[end + 1:]
    if len(body) != length:
        raise GuardStateError(f"guard state holds {len(body)} engine bytes, its header says {length}")
    if hashlib.sha256(body).hexdigest() != digest:
        raise GuardStateError("guard state engine bytes do not match their checksum")
    return GuardState(engine_bytes=body, positions=positions, saved_at_unix_ms=saved_at, role=role, topics=topics)


def check_state(state: GuardState, role: str, topics: Iterable[str]) -> None:
    """Raises ``GuardStateMismatch`` unless ``state`` is one a guard of ``role`` reading ``topics`` wrote: the same
    role (a file that records none: ``LEGACY_ROLE``), the same input topics where the file records them, and no
    position outside them. A ``budgets`` guard restoring an ``all`` file would judge nodes it does not watch
    (``stale_node`` for every one of them) and an ``all`` guard restoring a ``budgets`` file would take the
    node-keyed topics as covered by a state that never read them."""
    topics = frozenset(topics)
    written_by = state.role if state.role is not None else LEGACY_ROLE
    if written_by != role:
        raise GuardStateMismatch(f"written by the guard's {written_by!r} role"
                                 f"{' (a file that records no role)' if state.role is None else ''}, "
                                 f"this guard runs {role!r}")
    if state.topics is not None and state.topics != topics:
        raise GuardStateMismatch(f"covers input topics {sorted(state.topics)}, this guard reads {sorted(topics)}")
    foreign = sorted({topic for topic, _ in state.positions} - topics)
    if foreign:
        raise GuardStateMismatch(f"holds positions of {foreign}, which this guard does not read ({sorted(topics)})")


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

    def move_aside(self, now_ms: int, why: str = "corrupt") -> Path | None:
        """Rename an unusable file to ``<name>.<why>-<now_ms>`` (kept for a post-mortem; ``why``: ``corrupt``, or
        ``foreign`` for another guard's file); returns the new path."""
        target = self.path.with_name(f"{self.path.name}.{why}-{now_ms}")
        try:
            os.replace(self.path, target)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise GuardStateError(f"cannot move {self.path} aside: {exc}") from exc
        return target


class StateCheckpoint:
    """``KafkaDriver``'s checkpoint hook for the guard: called with the positions read so far, once everything
    produced from them is acknowledged; writes ``GuardState(processor.snapshot(), positions, now, processor.role,
    topics)`` with ``store`` (None: no state file, and no snapshot taken) and returns the positions to commit.
    ``topics``: every input topic the guard reads (what the positions cover, ``check_state``). Returns None (nothing
    written, nothing committed) while ``processor.rebuilding``. A state file that cannot be written is logged and
    the positions are committed anyway: a restart prefers the (older) state file's own positions, and without any
    state file pod events are re-read from the start regardless."""

    def __init__(self, processor: Any, store: GuardStateStore | None, clock: Clock, *, topics: Iterable[str]
                 ) -> None:
        self.processor = processor
        self.store = store
        self.clock = clock
        self.topics = frozenset(topics)
        self.snapshots = 0

    async def __call__(self, positions: Mapping[TopicPartition, int]) -> Mapping[TopicPartition, int] | None:
        if self.processor.rebuilding:
            return None
        if self.store is None:
            return dict(positions)  # no state file: nothing to snapshot the engine for
        # The snapshot is taken before any await: the driver holds its lock, so no input or tick moves the engine
        # between the positions it handed over and this snapshot.
        state = GuardState(engine_bytes=self.processor.snapshot(), positions=dict(positions),
                           saved_at_unix_ms=self.clock.now_ms(), role=self.processor.role, topics=self.topics)
        if self.store is not None:
            try:
                await asyncio.to_thread(self.store.save, state)
                self.snapshots += 1
            except GuardStateError as exc:
                log.error("state not saved, a restart re-reads from the previous snapshot: %s", exc)
        return state.positions


__all__ = ["LEGACY_ROLE", "STATE_MAGIC", "GuardState", "GuardStateError", "GuardStateMismatch", "GuardStateStore",
           "StateCheckpoint", "check_state", "decode_state", "encode_state"]
