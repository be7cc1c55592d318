"""A node's clock measured against the broker's: the offset to take off a collector's timestamps.

A collector stamps its ticks (``sampled_at``) and pod events (``observed_at``, ``started_at``) with its node's
clock, and a node's clock drifts (NTP down, a VM resumed). The broker stamps every message of the input topics
with its own clock when it appends it (``message.timestamp.type=LogAppendTime``, ``schemas.catalog``; the
in-memory broker of ``gpumeter replay`` appends at the recording's capture time), and that is the clock gpumeter
trusts. Per message, ``measured = sampled_at - appended_at = skew - delay``: the node's skew less the time the
message spent between the sampling and the append (never negative). So a positive measurement proves a clock
ahead by at least that much, while a negative one is a clock behind *or* a delayed message (a collector's
buffer draining after an outage, a backlog produced at once) -- one message cannot tell them apart.

``NodeClocks.observe`` decides, per node and in input order, the ``offset_ms`` to subtract from the node's
timestamps (0: the node's clock is trusted as it reads). The rules, deterministic for the same sequence of
(sampled_at, appended_at) -- replay and the stream decide alike:

* a measurement within ``threshold_ms`` of 0 agrees with the broker: offset 0 (a clock put right is trusted at
  once: a message cannot arrive before it was sent, so it is not a delayed message of a skewed clock);
* one a day or more off (``MAX_CLOCK_CORRECTION_MS``) is no drift: it moves nothing;
* one within ``tolerance_ms`` of the offset in effect keeps it (the delay's jitter does not move it);
* otherwise a new offset (the measurement itself) is taken only when it is *confirmed*: the node's previous message
  measured the same within ``tolerance_ms`` (at most half the tick interval) -- or there was no previous one and the
  clock reads ahead (a delay never makes a message look early) or the caller says the message would be late on its
  own clock (its window is closed, so taking it as it reads loses it anyway). Such an offset, taken from one message
  alone, is provisional: if the node's next message does not agree with it, it is dropped (it was a delayed message,
  a buffer drained from the collector's start, not the clock). A message of a buffer draining does not confirm its
  neighbour (consecutive ticks differ by their interval, while they were appended together), nor does a lone forged
  or garbled timestamp, so neither moves a node's offset; a clock that really moved is confirmed by its second
  message, and the first one is taken with the offset that was in effect (``ClockReading.moved``).

The offset is only ever a measurement of the node's own messages; nothing a tenant writes enters it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Mapping

DEFAULT_CLOCK_SKEW_THRESHOLD_SECONDS = 5
MAX_CLOCK_CORRECTION_MS = 86_400_000
"""The bound on offsets taken: a clock a day or more off is broken rather than drifting (and its ticks older than
anything the samples topic keeps); its messages are judged as they read."""
CLOCK_SKEW_TOLERANCE_MS = 1000
"""How far two measurements of one clock may differ and still agree: the jitter of a live collector's delay
(sampling, a producer batch, the append), and below any collector's tick interval, so that ticks of a buffer
drained at once never agree with each other."""


@dataclass(frozen=True, slots=True)
class ClockReading:
    """What one message told of its node's clock. ``offset_ms``: what to subtract from the message's timestamps
    (the offset in effect after it); ``measured_ms``: its own ``sampled_at - appended_at``; ``moved``: it
    disagrees with that offset and did not confirm a new one (the node's clock may just have moved)."""

    offset_ms: int
    measured_ms: int
    moved: bool


class NodeClocks:
    """The clock offset of every node seen (see the module docstring). Mutable; one caller at a time."""

    def __init__(self, threshold_ms: int = DEFAULT_CLOCK_SKEW_THRESHOLD_SECONDS * 1000,
                 tolerance_ms: int = CLOCK_SKEW_TOLERANCE_MS) -> None:
        if threshold_ms < 0 or tolerance_ms < 0:
            raise ValueError("the clock skew threshold and tolerance are not negative")
        self.threshold_ms = threshold_ms
        self.tolerance_ms = tolerance_ms
        self._offsets: dict[Hashable, int] = {}
        self._last: dict[Hashable, int] = {}
        self._provisional: set[Hashable] = set()  # offsets set by a node's first message alone

    def observe(self, node: Hashable, timestamp_ms: int, appended_at_ms: int,
                late_on_own_clock: Callable[[], bool] = lambda: False, interval_ms: int | None = None
                ) -> ClockReading:
        """Take one message of ``node`` stamped ``timestamp_ms`` by the node and appended at ``appended_at_ms`` by
        the broker; return the offset to apply to it. ``late_on_own_clock`` (asked only when it matters): whether
        the message, taken as it reads, would be refused as late. ``interval_ms``: the node's time since its
        previous message (a tick's ``interval_ms``): the tolerance is at most half of it, so that two messages
        sent at once a tick apart never agree."""
        measured = timestamp_ms - appended_at_ms
        previous = self._last.get(node)
        offset = self._offsets.get(node, 0)
        self._last[node] = measured
        tolerance = self.tolerance_ms if interval_ms is None else min(self.tolerance_ms, max(interval_ms, 0) // 2)
        if abs(measured) <= self.threshold_ms:
            new = 0
        elif abs(measured) >= MAX_CLOCK_CORRECTION_MS:
            return ClockReading(offset, measured, True)
        elif abs(measured - offset) <= tolerance:
            new = offset
        elif previous is not None and abs(measured - previous) <= tolerance:
            new = measured
        elif previous is None and (measured > 0 or late_on_own_clock()):
            self._offsets[node] = measured
            self._provisional.add(node)
            return ClockReading(measured, measured, False)
        elif node in self._provisional:
            # The node's first message set the offset alone and this one does not bear it out: that was a delayed
            # message (a buffer drained from the collector's start), not the node's clock.
            self._provisional.discard(node)
            self._offsets.pop(node, None)
            return ClockReading(0, measured, True)
        else:
            return ClockReading(offset, measured, True)
        self._provisional.discard(node)
        if new:
            self._offsets[node] = new
        else:
            self._offsets.pop(node, None)
        return ClockReading(new, measured, False)

    def offset(self, node: Hashable) -> int:
        """The offset in effect for ``node`` (0: none, or never seen)."""
        return self._offsets.get(node, 0)

    def offsets(self) -> Mapping[Hashable, int]:
        """Every node's offset in effect, nodes whose clock agrees with the broker included (0)."""
        return {node: self._offsets.get(node, 0) for node in self._last}

    def forget(self, node: Hashable) -> None:
        """Drop what is known of ``node`` (gone silent)."""
        self._offsets.pop(node, None)
        self._last.pop(node, None)
        self._provisional.discard(node)


__all__ = ["CLOCK_SKEW_TOLERANCE_MS", "DEFAULT_CLOCK_SKEW_THRESHOLD_SECONDS", "MAX_CLOCK_CORRECTION_MS", "ClockReading",
           "NodeClocks"]
