"""Tumbling windows of node samples: a pure, deterministic state machine shared by streaming and replay.

Rules (``docs/attribution.md`` has the reasons):

* Windows are ``[k * window_ms, (k + 1) * window_ms)`` in Unix time: aligned to epoch multiples of
  ``window_seconds``, the same on every node and every run. A tick belongs to the window containing its
  ``sampled_at_unix_ms`` (its whole ``interval_ms`` counts there).
* The watermark of a node is the largest ``sampled_at_unix_ms`` seen from that node (event time). A window closes
  when ``end + grace <= watermark``. ``advance(watermark_ms)`` moves every node's watermark to a clock-driven
  value as well, so a node that stops sending still has its windows closed; pass ``now - allowed clock skew``.
* A tick for a window that is already closed (``window start < closed_before`` of its node) is rejected as late:
  the caller dead-letters it (``LateSample.error()`` gives the ``LateMessage``). A tick within the grace period
  amends its open window.
* A tick already seen (same node, ``collector_started_at_unix_ms`` and ``sequence``) is ignored, whether its
  window is still open or one of the ``closed_key_retention`` most recently closed windows of the node, so a
  redelivery after a restart is neither counted twice nor dead-lettered.

The accumulator is immutable: ``add``, ``advance`` and ``flush`` return a new one. State is kept per node so that
copying on write touches one node's entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping, NamedTuple

from gpumeter.errors import ConfigError, LateMessage
from schemas.records import NodeSample

NodeKey = tuple[str, str]  # (cluster, node_name)
TickKey = tuple[int, int]  # (collector_started_at_unix_ms, sequence)
_EMPTY: Mapping = MappingProxyType({})
_NEVER = -(2**62)


@dataclass(frozen=True, slots=True)
class NodeWindow:
    """One node's samples in one window, sorted by (sampled_at, collector start, sequence)."""

    cluster: str
    node_name: str
    window_start_unix_ms: int
    window_seconds: int
    samples: tuple[NodeSample, ...]

    @property
    def window_end_unix_ms(self) -> int:
        return self.window_start_unix_ms + self.window_seconds * 1000


@dataclass(frozen=True, slots=True)
class LateSample:
    """A tick that arrived after its window was closed. ``metadata`` is what the caller passed to ``add``."""

    sample: NodeSample
    window_start_unix_ms: int
    closed_before_unix_ms: int
    watermark_unix_ms: int
    metadata: Any = None
    node_watermark_unix_ms: int | None = None
    clock_watermark_unix_ms: int | None = None
    clock_note: str = ""

    @property
    def reason(self) -> str:
        # Which watermark closed the window: the node's own (its newest tick) or the attributor's clock (shared
        # by every node of the partition, so it must never read as another node's).
        own = self.node_watermark_unix_ms
        clock = self.clock_watermark_unix_ms
        if own is None and clock is None:
            marks = f"watermark {self.watermark_unix_ms}"
        else:
            marks = (f"the node's own watermark {'none' if own is None else own} (its newest tick), the "
                     f"attributor's clock watermark {'none' if clock is None else clock}")
        return (
            f"tick {self.sample.collector_started_at_unix_ms}/{self.sample.sequence} of node "
            f"{self.sample.node_name} sampled at {self.sample.sampled_at_unix_ms} belongs to window "
            f"{self.window_start_unix_ms}, already closed for this node (windows before "
            f"{self.closed_before_unix_ms} are closed; {marks}){self.clock_note}"
        )

    def error(self) -> LateMessage:
        return LateMessage(self.reason)


@dataclass(frozen=True, slots=True)
class _OpenWindow:
    samples: tuple[NodeSample, ...]
    keys: frozenset[TickKey]


@dataclass(frozen=True, slots=True)
class _NodeState:
    watermark_unix_ms: int
    closed_before_unix_ms: int
    open_windows: Mapping[int, _OpenWindow]  # window start -> window
    recent_closed_keys: tuple[frozenset[TickKey], ...]  # newest last


class AddResult(NamedTuple):
    state: "WindowAccumulator"
    closed: tuple[NodeWindow, ...]
    rejected: tuple[LateSample, ...]


class AdvanceResult(NamedTuple):
    state: "WindowAccumulator"
    closed: tuple[NodeWindow, ...]


@dataclass(frozen=True, slots=True)
class WindowAccumulator:
    """Tumbling-window state over many nodes. Immutable; every operation returns a new accumulator."""

    window_seconds: int = 60
    grace_seconds: int = 10
    closed_key_retention: int = 2
    duplicates_ignored: int = 0
    _nodes: Mapping[NodeKey, _NodeState] = field(default_factory=lambda: _EMPTY)
    _clock_watermark_unix_ms: int = _NEVER

    def __post_init__(self) -> None:
        if not isinstance(self.window_seconds, int) or self.window_seconds <= 0:
            raise ConfigError(f"window_seconds must be a positive integer, got {self.window_seconds!r}")
        if not isinstance(self.grace_seconds, int) or self.grace_seconds < 0:
            raise ConfigError(f"grace_seconds must be a non-negative integer, got {self.grace_seconds!r}")
        if self.closed_key_retention < 0:
            raise ConfigError(f"closed_key_retention must be >= 0, got {self.closed_key_retention!r}")

    @property
    def window_ms(self) -> int:
        return self.window_seconds * 1000

    def window_start_of(self, t_unix_ms: int) -> int:
        """Start of the window containing ``t_unix_ms`` (floor to a multiple of the window, also before 1970)."""
        return (t_unix_ms // self.window_ms) * self.window_ms

    def closed_before_for(self, watermark_unix_ms: int) -> int:
        """Windows starting before the returned time are closed at ``watermark_unix_ms``."""
        if watermark_unix_ms <= _NEVER:
            return _NEVER
        return ((watermark_unix_ms - self.grace_seconds * 1000) // self.window_ms) * self.window_ms

    def nodes(self) -> tuple[NodeKey, ...]:
        return tuple(sorted(self._nodes))

    def watermark(self, cluster: str, node_name: str) -> int | None:
        """The node's watermark (its largest sampled_at, or the clock-driven watermark if larger)."""
        state = self._nodes.get((cluster, node_name))
        if state is None:
            return None
        return max(state.watermark_unix_ms, self._clock_watermark_unix_ms)

    def is_closed(self, cluster: str, node_name: str, t_unix_ms: int) -> bool:
        """Whether a tick of the node sampled at ``t_unix_ms`` would be late (its window is closed)."""
        state = self._nodes.get((cluster, node_name))
        closed_before = self.closed_before_for(self._clock_watermark_unix_ms)
        if state is not None:
            closed_before = max(closed_before, state.closed_before_unix_ms)
        return self.window_start_of(t_unix_ms) < closed_before

    def open_window_starts(self, cluster: str, node_name: str) -> tuple[int, ...]:
        state = self._nodes.get((cluster, node_name))
        return tuple(sorted(state.open_windows)) if state is not None else ()

    def open_sample_count(self) -> int:
        return sum(len(w.samples) for s in self._nodes.values() for w in s.open_windows.values())

    def add(self, sample: NodeSample, metadata: Any = None) -> AddResult:
        """Add one tick. Returns the new state, the windows this tick's watermark closed (oldest first) and the
        tick itself in ``rejected`` when its window was already closed."""
        # Once per tick of every node: the window arithmetic is inlined (``window_start_of``, ``closed_before_for``)
        key: NodeKey = (sample.cluster, sample.node_name)
        state = self._nodes.get(key)
        window_ms = self.window_seconds * 1000
        clock_watermark = self._clock_watermark_unix_ms
        clock_closed = self.closed_before_for(clock_watermark)
        if state is None:
            state = _NodeState(_NEVER, clock_closed, _EMPTY, ())
        tick: TickKey = (sample.collector_started_at_unix_ms, sample.sequence)
        sampled_at = sample.sampled_at_unix_ms
        start = sampled_at // window_ms * window_ms
        state_closed = state.closed_before_unix_ms
        closed_before = state_closed if state_closed >= clock_closed else clock_closed

        if start < closed_before:
            if any(tick in keys for keys in state.recent_closed_keys):
                return AddResult(self._replace(self._nodes, duplicates=1), (), ())
            watermark = max(state.watermark_unix_ms, clock_watermark)
            late = LateSample(sample, start, closed_before, watermark, metadata,
                              None if state.watermark_unix_ms <= _NEVER else state.watermark_unix_ms,
                              None if clock_watermark <= _NEVER else clock_watermark)
            return AddResult(self, (), (late,))

        open_windows = state.open_windows
        window = open_windows.get(start)
        if window is not None and tick in window.keys:
            return AddResult(self._replace(self._nodes, duplicates=1), (), ())
        if window is None:
            window = _OpenWindow((sample,), frozenset((tick,)))
        else:
            window = _OpenWindow(window.samples + (sample,), window.keys | {tick})
        open_windows = dict(open_windows)
        open_windows[start] = window
        watermark = state.watermark_unix_ms
        if sampled_at > watermark:
            watermark = sampled_at
        new_state = _NodeState(watermark, state_closed, MappingProxyType(open_windows), state.recent_closed_keys)
        # ``_close_node``'s test, first: the tick closes nothing unless it moves the node's closed-before
        # boundary (every open window starts at or after it: an earlier tick is late, above).
        effective = watermark if watermark >= clock_watermark else clock_watermark
        closed: tuple[NodeWindow, ...] = ()
        if self.closed_before_for(effective) > state_closed:
            new_state, closed = self._close_node(key, new_state)
        nodes = dict(self._nodes)
        nodes[key] = new_state
        return AddResult(self._replace(nodes), closed, ())

    def advance(self, watermark_unix_ms: int) -> AdvanceResult:
        """Move the clock-driven watermark to ``watermark_unix_ms`` (never back) and close every node's windows
        whose end + grace <= it. Closed windows come sorted by (window start, cluster, node)."""
        if watermark_unix_ms <= self._clock_watermark_unix_ms:
            return AdvanceResult(self, ())
        advanced = WindowAccumulator(
            self.window_seconds,
            self.grace_seconds,
            self.closed_key_retention,
            self.duplicates_ignored,
            self._nodes,
            watermark_unix_ms,
        )
        nodes = dict(self._nodes)
        closed: list[NodeWindow] = []
        for key in sorted(self._nodes):
            nodes[key], node_closed = advanced._close_node(key, self._nodes[key])
            closed.extend(node_closed)
        closed.sort(key=_window_order)
        return AdvanceResult(advanced._replace(nodes), tuple(closed))

    def flush(self) -> AdvanceResult:
        """Close every open window now (end of a replay's input). Sorted by (window start, cluster, node)."""
        closed: list[NodeWindow] = []
        nodes: dict[NodeKey, _NodeState] = {}
        for key in sorted(self._nodes):
            state = self._nodes[key]
            starts = sorted(state.open_windows)
            closed.extend(self._node_window(key, s, state.open_windows[s]) for s in starts)
            closed_before = state.closed_before_unix_ms
            keys = state.recent_closed_keys
            if starts:
                closed_before = max(closed_before, starts[-1] + self.window_ms)
                keys = self._retain(keys, [state.open_windows[s].keys for s in starts])
            nodes[key] = _NodeState(state.watermark_unix_ms, closed_before, _EMPTY, keys)
        closed.sort(key=_window_order)
        return AdvanceResult(self._replace(nodes), tuple(closed))

    def _close_node(self, key: NodeKey, state: _NodeState) -> tuple[_NodeState, tuple[NodeWindow, ...]]:
        watermark = max(state.watermark_unix_ms, self._clock_watermark_unix_ms)
        closed_before = max(state.closed_before_unix_ms, self.closed_before_for(watermark))
        due = sorted(s for s in state.open_windows if s < closed_before)
        if not due and closed_before == state.closed_before_unix_ms:
            return state, ()
        open_windows = state.open_windows
        keys = state.recent_closed_keys
        if due:
            open_windows = MappingProxyType({s: w for s, w in state.open_windows.items() if s >= closed_before})
            keys = self._retain(keys, [state.open_windows[s].keys for s in due])
        closed = tuple(self._node_window(key, s, state.open_windows[s]) for s in due)
        return _NodeState(state.watermark_unix_ms, closed_before, open_windows, keys), closed

    def _retain(
        self, keys: tuple[frozenset[TickKey], ...], new: Iterable[frozenset[TickKey]]
    ) -> tuple[frozenset[TickKey], ...]:
        if self.closed_key_retention == 0:
            return ()
        return (keys + tuple(new))[-self.closed_key_retention :]

    def _node_window(self, key: NodeKey, start: int, window: _OpenWindow) -> NodeWindow:
        samples = tuple(
            sorted(window.samples, key=lambda s: (s.sampled_at_unix_ms, s.collector_started_at_unix_ms, s.sequence))
        )
        return NodeWindow(key[0], key[1], start, self.window_seconds, samples)

    def _replace(self, nodes: Mapping[NodeKey, _NodeState], duplicates: int = 0) -> "WindowAccumulator":
        # This accumulator's settings, already validated: built without ``__post_init__`` (once per tick).
        replaced = object.__new__(WindowAccumulator)
        set_field = object.__setattr__
        set_field(replaced, "window_seconds", self.window_seconds)
        set_field(replaced, "grace_seconds", self.grace_seconds)
        set_field(replaced, "closed_key_retention", self.closed_key_retention)
        set_field(replaced, "duplicates_ignored", self.duplicates_ignored + duplicates)
        set_field(replaced, "_nodes", nodes if isinstance(nodes, MappingProxyType) else MappingProxyType(nodes))
        set_field(replaced, "_clock_watermark_unix_ms", self._clock_watermark_unix_ms)
        return replaced


def _window_order(window: NodeWindow) -> tuple[int, str, str]:
    return (window.window_start_unix_ms, window.cluster, window.node_name)
