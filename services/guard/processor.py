"""The guard's logic on the processing contract (``gpumeter.stream.contract``): input records in, violations out.
No Kafka, no asyncio: the same ``GuardProcessor`` runs under ``KafkaDriver`` (``services/guard/main.py``) and
``MemoryDriver`` (the tests, and pipeline replay).

Inputs, by role (``guard_topics`` maps them to the catalog's topics), each range-checked by the runner before
``handle`` (``gpumeter.validation``: ``OUT_OF_RANGE``, with ``max_clock_skew_seconds`` and
``max_sample_age_seconds``):

* ``samples`` (``NodeSample``, ``check_node_sample``) → ``GuardEngine.on_sample``;
* ``pod_events`` (``PodEvent``, ``check_pod_event``) → ``on_pod_event``; a tombstone of the compacted topic is
  skipped (the pod's DELETED event precedes it; its key carries nothing else);
* ``window_shares`` (``NodeWindowShares``, ``check_window_shares``) → ``on_share`` row by row
  (``NodeWindowShares.rows()``);
* ``window_costs`` (``NodeWindowCost``, ``check_window_cost``) → ``on_window_cost``: ``on_cost`` line by line
  (the lines of ``NodeWindowCost.cost_records()``), read from the bill's columns.

The engine's time is the runner's clock when the record was handed over (``Event.received_at_unix_ms``), and
``on_clock(now_ms, caught_up)`` runs ``engine.on_clock(now_ms, detect_stale=caught_up)``: silent nodes are judged
only while the driver has read all its input (during a backlog its samples are late, the nodes are not silent).

Output: every violation the engine returns is one ``Emit`` to ``violations``, keyed by its fingerprint, in the
engine's order, ``latest_wins`` (the compacted topic's latest record per fingerprint is its state: an older state
is never re-sent over a newer one). Metrics, as the violations are emitted:
``gpumeter_guard_violation_transitions_total{rule,state}`` once per state change of a fingerprint (not per
refresh), ``gpumeter_guard_violations_firing{rule,severity}`` from ``engine.active()`` (a series that dropped to
zero stays at 0). Bad input never reaches the processor: the runner dead-letters it.

Rebuild: a guard without a usable state file seeds its engine from the violations topic's last state per
fingerprint (``begin_rebuild``, ``GuardEngine.adopt``) and then emits nothing while it re-reads its input
(``rebuilding``; the runner's dead letters still go out); ``finish_rebuild()`` -- the driver's
``on_read_to_start`` -- returns what the topic must hear (``GuardEngine.settle``). Nothing old fires again: a pod
deleted long ago whose alert had resolved is replayed, found resolved, and dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

from gpumeter.clock import Clock
from gpumeter.stream.contract import DEAD_LETTERS, NOTHING, Emit, Event, Input, Position, Result
from gpumeter.validation import (
    DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS,
    DEFAULT_MAX_SAMPLE_AGE_SECONDS,
    check_node_sample,
    check_pod_event,
    check_window_cost,
    check_window_shares,
)
from schemas.catalog import TopicCatalog
from schemas.records import NodeSample, NodeWindowCost, NodeWindowShares, PodEvent, Violation, ViolationState
from services.guard.config import RULE_BUDGET_EXCEEDED, GuardConfig
from services.guard.engine import GuardEngine

log = logging.getLogger(__name__)

SERVICE_NAME = "guard"

# Roles (gpumeter.stream.contract: the driver maps them to topics).
SAMPLES = "samples"
POD_EVENTS = "pod_events"
WINDOW_SHARES = "window_shares"
WINDOW_COSTS = "window_costs"
VIOLATIONS = "violations"

# Roles of a guard instance (``gpumeter guard --role``): ``all`` -- every rule over every partition, one instance;
# ``nodes`` -- every rule but budgets, over the partitions its consumer group assigns it (``NodeGuardProcessor``,
# ``services/guard/nodes.py``); ``budgets`` -- ``budget_exceeded`` over every partition of the cost lines.
ROLE_ALL = "all"
ROLE_NODES = "nodes"
ROLE_BUDGETS = "budgets"
ROLES = (ROLE_ALL, ROLE_NODES, ROLE_BUDGETS)

# The metrics this service exports (all names from gpumeter.metrics.METRICS).
GUARD_METRICS = (
    "gpumeter_messages_consumed_total",
    "gpumeter_dead_letters_total",
    "gpumeter_dead_letters_truncated_total",
    "gpumeter_recent_dead_letter_ratio",
    "gpumeter_guard_violations_firing",
    "gpumeter_guard_violation_transitions_total",
)


def guard_topics(topics: TopicCatalog, role: str = ROLE_ALL) -> dict[str, str]:
    """The input roles of a guard of ``role`` -> topics of ``topics`` (what ``MessageRunner`` binds): the
    ``budgets`` role reads the cost lines only, the others all four node-keyed topics."""
    if role == ROLE_BUDGETS:
        return {WINDOW_COSTS: topics.node_window_costs}
    return {SAMPLES: topics.node_samples, POD_EVENTS: topics.pod_events,
            WINDOW_SHARES: topics.node_window_shares, WINDOW_COSTS: topics.node_window_costs}


def engine_options(role: str) -> dict[str, bool]:
    """``GuardEngine``'s ``budgets`` and ``idle`` for a guard of ``role``: the ``nodes`` role judges no budget, the
    ``budgets`` role (which reads no share windows) no idle allocation, ``all`` both."""
    return {"budgets": role != ROLE_NODES, "idle": role != ROLE_BUDGETS}


def guard_inputs(max_clock_skew_ms: int, max_sample_age_ms: int, role: str = ROLE_ALL) -> tuple[Input, ...]:
    """The inputs of a guard of ``role`` with their range checks, in the order of precedence at one instant
    (``gpumeter.stream.contract.Processor.inputs``): a sample is judged with the pods that started at its
    instant."""
    skew_ms, age_ms = max_clock_skew_ms, max_sample_age_ms
    costs = Input(WINDOW_COSTS, NodeWindowCost, lambda cost, now_ms: check_window_cost(cost, now_ms, skew_ms))
    if role == ROLE_BUDGETS:
        return (costs,)
    return (
        Input(POD_EVENTS, PodEvent, lambda event, now_ms: check_pod_event(event, now_ms, skew_ms), tombstones=True),
        Input(SAMPLES, NodeSample, lambda sample, now_ms: check_node_sample(sample, now_ms, skew_ms, age_ms)),
        Input(WINDOW_SHARES, NodeWindowShares, lambda shares, now_ms: check_window_shares(shares, now_ms, skew_ms)),
        costs,
    )


def guard_outputs(topics: TopicCatalog) -> dict[str, str]:
    """The guard's output roles -> topics of ``topics`` (what a driver produces to)."""
    return {VIOLATIONS: topics.violations, DEAD_LETTERS: topics.dead_letters}


@dataclass
class GuardStats:
    """``violations_emitted``: every violation record emitted (refreshes included); ``transitions``: the state
    changes among them; ``clock_runs``: ``on_clock`` calls; ``by_input``: records handled per input role."""

    violations_emitted: int = 0
    transitions: int = 0
    clock_runs: int = 0
    by_input: dict[str, int] = field(default_factory=dict)


class GuardProcessor:
    """The guard on the processing contract (see the module docstring). ``engine``: the engine to drive (one
    restored from a state file); None: a fresh ``GuardEngine`` for ``role`` (``engine_options``). ``clock``: the time of
    ``begin_rebuild``/``finish_rebuild`` (input and ticks carry their own). ``metrics``: a ``ServiceMetrics`` with
    ``GUARD_METRICS``, or None. ``role``: ``all`` (every input, every rule) or ``budgets`` (cost lines only:
    ``budget_exceeded``; a rebuild adopts only that rule's violations). ``firing_gauge=False``: leave the firing
    gauge to the caller (``NodeGuardProcessor`` sums it over its partitions' processors)."""

    service = SERVICE_NAME

    def __init__(self, config: GuardConfig, clock: Clock, *, engine: GuardEngine | None = None, metrics: Any = None,
                 max_clock_skew_seconds: int = DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS,
                 max_sample_age_seconds: int = DEFAULT_MAX_SAMPLE_AGE_SECONDS, role: str = ROLE_ALL,
                 firing_gauge: bool = True) -> None:
        if role not in (ROLE_ALL, ROLE_BUDGETS):
            raise ValueError(f"a GuardProcessor runs role {ROLE_ALL!r} or {ROLE_BUDGETS!r}, not {role!r}")
        self.config = config
        self.clock = clock
        self.engine = engine if engine is not None else GuardEngine(config, **engine_options(role))
        self.metrics = metrics
        self.max_clock_skew_ms = max_clock_skew_seconds * 1000
        self.max_sample_age_ms = max_sample_age_seconds * 1000
        self.role = role
        self.inputs = guard_inputs(self.max_clock_skew_ms, self.max_sample_age_ms, role)
        self.firing_gauge = firing_gauge
        self.stats = GuardStats()
        self._states: dict[str, ViolationState] = {v.fingerprint: v.state for v in self.engine.active()
                                                   if v.state is ViolationState.FIRING}
        self._firing_series: set[tuple[str, str]] = set()
        self._rebuild_states: dict[str, Violation] | None = None
        self._refresh_firing_gauge()

    # -- the contract --

    def handle(self, event: Event, position: Position) -> Result:
        """The violations of one checked input record (none for a pod-events tombstone), emitted unless a rebuild
        holds them back. The engine raising ``InvalidMessage`` rejects the record."""
        self.stats.by_input[event.input] = self.stats.by_input.get(event.input, 0) + 1
        record, now_ms = event.record, event.received_at_unix_ms
        if record is None:
            return NOTHING
        engine = self.engine
        if event.input == SAMPLES:
            violations = engine.on_sample(record, now_ms, event.timestamp_ms)
        elif event.input == POD_EVENTS:
            violations = engine.on_pod_event(record, now_ms)
        elif event.input == WINDOW_SHARES:
            violations = tuple(v for share in record.rows() for v in engine.on_share(share, now_ms))
        elif event.input == WINDOW_COSTS:
            violations = engine.on_window_cost(record, now_ms)
        else:
            raise ValueError(f"the guard has no input {event.input!r}")  # the runner only hands over its inputs
        return self._emit(violations)

    def on_clock(self, now_ms: int, caught_up: bool = True) -> Result:
        """``engine.on_clock(now_ms, detect_stale=caught_up)``, emitted unless a rebuild holds it back."""
        self.stats.clock_runs += 1
        return self._emit(self.engine.on_clock(now_ms, detect_stale=caught_up))

    # -- rebuild --

    @property
    def rebuilding(self) -> bool:
        return self._rebuild_states is not None

    def begin_rebuild(self, last_states: Iterable[Violation]) -> tuple[Violation, ...]:
        """Seed the engine from the violations topic (its last state per fingerprint) and hold violations back
        until ``finish_rebuild``. Returns the violations firing now (the ones whose alerts' leases to renew)."""
        states = {v.fingerprint: v for v in last_states if self.role == ROLE_ALL or v.rule == RULE_BUDGET_EXCEEDED}
        self.engine.adopt(states.values(), self.clock.now_ms())
        self._rebuild_states = states
        firing = tuple(v for v in self.engine.active() if v.state is ViolationState.FIRING)
        self._states = {v.fingerprint: v.state for v in firing}
        self._refresh_firing_gauge()
        log.info("rebuilding from the violations topic: %d fingerprints, %d firing; no violation is emitted "
                 "until the input is re-read", len(states), len(firing))
        return firing

    def finish_rebuild(self) -> Result:
        """The input is re-read: what the topic must hear (``GuardEngine.settle``); from now on violations are
        emitted. Nothing when no rebuild is under way."""
        states, self._rebuild_states = self._rebuild_states, None
        if states is None:
            return NOTHING
        settled = self.engine.settle(states, self.clock.now_ms())
        log.info("rebuilt from the violations topic: %d violations to publish", len(settled))
        self._refresh_firing_gauge()
        return self._emit(settled)

    def snapshot(self) -> bytes:
        """The engine's state (``GuardEngine.snapshot``): what a state file keeps with the positions it covers."""
        return self.engine.snapshot()

    # -- output --

    def _emit(self, violations: Iterable[Violation]) -> Result:
        violations = tuple(violations)
        if not violations or self.rebuilding:
            return NOTHING
        changed = False
        for violation in violations:
            self.stats.violations_emitted += 1
            if self._states.get(violation.fingerprint) is not violation.state:
                changed = True
                self.stats.transitions += 1
                if self.metrics is not None:
                    self.metrics.get("gpumeter_guard_violation_transitions_total").labels(
                        violation.rule, violation.state.value.lower()).inc()
                log.info("%s %s %s: %s", violation.state.value, violation.rule, violation.fingerprint,
                         violation.summary)
            if violation.state is ViolationState.FIRING:
                self._states[violation.fingerprint] = violation.state
            else:
                self._states.pop(violation.fingerprint, None)
        if changed:
            self._refresh_firing_gauge()
        return Result(emits=tuple(Emit(VIOLATIONS, v.fingerprint.encode("utf-8"), v, latest_wins=True)
                                  for v in violations))

    def _refresh_firing_gauge(self) -> None:
        if self.metrics is None or not self.firing_gauge:
            return
        self._firing_series = set_firing_gauge(self.metrics, self.engine.active(), self._firing_series)


def set_firing_gauge(metrics: Any, active: Iterable[Violation], series_seen: set[tuple[str, str]]
                     ) -> set[tuple[str, str]]:
    """``gpumeter_guard_violations_firing{rule,severity}`` from the ``active`` violations; returns the series set so
    far (series that dropped to zero stay at 0: a missing series reads as "no data", not "nothing firing")."""
    counts: dict[tuple[str, str], int] = {}
    for violation in active:
        if violation.state is ViolationState.FIRING:
            series = (violation.rule, violation.severity.value.lower())
            counts[series] = counts.get(series, 0) + 1
    gauge = metrics.get("gpumeter_guard_violations_firing")
    for series in series_seen | set(counts):
        gauge.labels(*series).set(counts.get(series, 0))
    return series_seen | set(counts)


__all__ = ["GUARD_METRICS", "POD_EVENTS", "ROLES", "ROLE_ALL", "ROLE_BUDGETS", "ROLE_NODES", "SAMPLES", "SERVICE_NAME",
           "VIOLATIONS", "WINDOW_COSTS", "WINDOW_SHARES", "GuardProcessor", "GuardStats", "engine_options",
           "guard_inputs", "guard_outputs", "guard_topics", "set_firing_gauge"]
