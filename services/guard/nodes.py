"""The guard's ``nodes`` role on the processing contract: every rule but budgets, split by partition, so that the
instances of one consumer group share the nodes between them. No Kafka, no asyncio (``services/guard/main.py``
wires it to ``KafkaDriver``'s group mode and rebalance hooks).

Why it splits: every rule but ``budget_exceeded`` reads one node's input only -- its samples (visibility,
unrequested use, shared memory, NVML errors, clock skew), its pods (the spec check), its share windows and cost
lines (idle allocation), its silence (stale node, known from its own samples) -- and the four input topics are
keyed by node name and co-partitioned (``schemas.catalog.partition_for_node``): partition ``p`` of every topic
holds the same nodes. So one ``GuardProcessor`` (engine without budgets, ``GuardEngine(budgets=False)``) per
partition number holds everything about its nodes, and the group's assignor gives partition ``p`` of all four
topics to one instance (``KafkaDriver(co_partitioned=True)``).

Partition lifecycle (the driver's hooks; partitions are numbers, the same on every input topic):

* ``adopt(partitions, last_states)`` (from the driver's own ``on_assigned`` hook, once the violations topic is read;
  the contract's ``on_assigned`` does nothing): a partition this instance handled until the revocation just before
  resumes with its engine (nobody else owned it in between); any other gets a fresh engine seeded from the
  violations topic's last states of its nodes (``begin_rebuild`` filtered by ``owns``: rule not ``budget_exceeded``,
  node in the partition) and publishes nothing until the driver has read what its partitions held at the
  assignment (``finish_rebuild``, the driver's ``on_read_to_start``). The old owner flushed its violations before
  giving the partition up, so a violation firing there is adopted here under the same fingerprint and
  ``first_seen`` and stays firing when the re-read input holds it: no resolve, no refire.
* ``suspend(partitions)`` (the contract's ``on_revoked``): their engines are suspended (no clock, no output), never
  resolved -- the new owner carries their violations on; suspended engines not assigned back at the next ``adopt``
  are dropped.

Re-reads: a resumed partition is read again from its last commit, and pod events from their beginning (the driver
seeks them there on every assignment); a record at an offset this instance's engine has already handled is
skipped (``stats.reread_skipped``), so an old pod event replayed into a live engine cannot fire what it fired
and resolved long ago. Records of a partition that was never assigned (``MemoryDriver``, which assigns nothing)
open a fresh engine for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Collection, Iterable

from gpumeter.clock import Clock
from gpumeter.stream.contract import NOTHING, Event, Position, Result
from gpumeter.validation import DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS, DEFAULT_MAX_SAMPLE_AGE_SECONDS
from schemas.catalog import partition_for_node
from schemas.records import Violation
from services.guard.config import RULE_BUDGET_EXCEEDED, GuardConfig
from services.guard.engine import GuardEngine
from services.guard.processor import (
    ROLE_NODES,
    SERVICE_NAME,
    GuardProcessor,
    GuardStats,
    engine_options,
    guard_inputs,
    set_firing_gauge,
)

log = logging.getLogger(__name__)


@dataclass
class NodeGuardStats(GuardStats):
    """``GuardStats`` plus ``reread_skipped`` (records at offsets already handled), ``rebuilds`` (partitions
    rebuilt from the violations topic) and ``resumed`` (partitions assigned back to the engine they had)."""

    reread_skipped: int = 0
    rebuilds: int = 0
    resumed: int = 0


class NodeGuardProcessor:
    """See the module docstring. ``partitions``: the partition count of the node-keyed input topics (what
    ``owns`` maps a violation's node with). ``metrics``: a ``ServiceMetrics`` with ``GUARD_METRICS``, or None."""

    service = SERVICE_NAME

    def __init__(self, config: GuardConfig, clock: Clock, *, partitions: int, metrics: Any = None,
                 max_clock_skew_seconds: int = DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS,
                 max_sample_age_seconds: int = DEFAULT_MAX_SAMPLE_AGE_SECONDS) -> None:
        if partitions < 1:
            raise ValueError("partitions must be at least 1")
        self.config = config
        self.clock = clock
        self.partitions = partitions
        self.metrics = metrics
        self.max_clock_skew_seconds = max_clock_skew_seconds
        self.max_sample_age_seconds = max_sample_age_seconds
        self.inputs = guard_inputs(max_clock_skew_seconds * 1000, max_sample_age_seconds * 1000)
        self.stats = NodeGuardStats()
        self._parts: dict[int, GuardProcessor] = {}
        self._suspended: dict[int, GuardProcessor] = {}
        self._read_to: dict[tuple[str, int], int] = {}  # next offset per (topic, partition) its engine has handled
        self._firing_series: set[tuple[str, str]] = set()

    # -- the contract --

    def handle(self, event: Event, position: Position) -> Result:
        """The record's partition's processor handles it, unless that engine has handled its offset already."""
        tp = (position.topic, position.partition)
        if position.offset < self._read_to.get(tp, 0):
            self.stats.reread_skipped += 1
            return NOTHING
        self._read_to[tp] = position.offset + 1
        self.stats.by_input[event.input] = self.stats.by_input.get(event.input, 0) + 1
        part = self._parts.get(position.partition)
        if part is None:
            part = self._parts[position.partition] = self._new_part()
        return self._out(part.handle(event, position))

    def on_clock(self, now_ms: int, caught_up: bool = True) -> Result:
        """Every live partition's ``on_clock`` (suspended ones are no longer this instance's to judge)."""
        self.stats.clock_runs += 1
        result = NOTHING
        for p in sorted(self._parts):
            result = result + self._parts[p].on_clock(now_ms, caught_up)
        return self._out(result)

    # -- partition lifecycle --

    def owns(self, violation: Violation, partition: int) -> bool:
        """Whether ``violation`` is of a node of ``partition`` under a rule this role judges."""
        return (violation.rule != RULE_BUDGET_EXCEEDED and violation.node_name is not None
                and partition_for_node(violation.node_name, self.partitions) == partition)

    def to_rebuild(self, partitions: Iterable[int]) -> set[int]:
        """Which of ``partitions`` ``adopt`` would rebuild (neither live nor suspended here)."""
        return {p for p in partitions if p not in self._parts and p not in self._suspended}

    def on_assigned(self, partitions: Collection[tuple[str, int]]) -> Result:
        """The contract's hook: nothing here -- a partition's engine is adopted by ``adopt`` once the driver's own
        hook has read the violations topic for it (``services.guard.main.rebuild_assigned``)."""
        return NOTHING

    def on_revoked(self, partitions: Collection[tuple[str, int]]) -> Result:
        """The contract's hook: the partitions' engines are suspended (``suspend``); nothing to make durable."""
        self.suspend({p for _, p in partitions})
        return NOTHING

    def adopt(self, partitions: Iterable[int], last_states: Iterable[Violation]) -> None:
        """The group assigned ``partitions`` (see the module docstring); ``last_states``: the violations topic's last
        state per fingerprint (only read for partitions that are rebuilt)."""
        partitions = set(partitions)
        states = tuple(last_states)
        for p in sorted(partitions):
            if p in self._parts:
                continue
            part = self._suspended.pop(p, None)
            if part is not None:
                self._parts[p] = part
                self.stats.resumed += 1
                continue
            self._forget_offsets(p)
            part = self._parts[p] = self._new_part()
            part.begin_rebuild(v for v in states if self.owns(v, p))
            self.stats.rebuilds += 1
        for p in list(self._suspended):
            if p not in partitions:
                del self._suspended[p]
                self._forget_offsets(p)
        self._refresh_firing_gauge()
        log.info("guarding partitions %s (%d rebuilding)", sorted(self._parts),
                 sum(1 for part in self._parts.values() if part.rebuilding))

    def suspend(self, partitions: Iterable[int]) -> None:
        """Suspend the engines of ``partitions``: nothing of theirs is resolved or published any more."""
        for p in partitions:
            part = self._parts.pop(p, None)
            if part is not None:
                self._suspended[p] = part
        self._refresh_firing_gauge()

    @property
    def rebuilding(self) -> bool:
        return any(part.rebuilding for part in self._parts.values())

    def finish_rebuild(self) -> Result:
        """What every partition rebuilt since the last call must publish (``GuardProcessor.finish_rebuild``)."""
        result = NOTHING
        for p in sorted(self._parts):
            result = result + self._parts[p].finish_rebuild()
        self._refresh_firing_gauge()
        return self._out(result)

    # -- views --

    @property
    def owned(self) -> tuple[int, ...]:
        """The partitions whose engines are live here."""
        return tuple(sorted(self._parts))

    def active(self) -> tuple[Violation, ...]:
        """The firing violations of every live partition (``GuardEngine.active``)."""
        return tuple(v for p in sorted(self._parts) for v in self._parts[p].engine.active())

    @property
    def violations_emitted(self) -> int:
        return sum(part.stats.violations_emitted for part in (*self._parts.values(), *self._suspended.values()))

    # -- internals --

    def _new_part(self) -> GuardProcessor:
        return GuardProcessor(self.config, self.clock, engine=GuardEngine(self.config, **engine_options(ROLE_NODES)),
                              metrics=self.metrics, max_clock_skew_seconds=self.max_clock_skew_seconds,
                              max_sample_age_seconds=self.max_sample_age_seconds, firing_gauge=False)

    def _forget_offsets(self, partition: int) -> None:
        for tp in [tp for tp in self._read_to if tp[1] == partition]:
            del self._read_to[tp]

    def _out(self, result: Result) -> Result:
        if result.emits:
            self.stats.violations_emitted += len(result.emits)
            self._refresh_firing_gauge()
        return result

    def _refresh_firing_gauge(self) -> None:
        if self.metrics is not None:
            self._firing_series = set_firing_gauge(self.metrics, self.active(), self._firing_series)


__all__ = ["NodeGuardProcessor", "NodeGuardStats"]
