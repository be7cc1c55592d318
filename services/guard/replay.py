"""The guard offline without the runner: ``GuardEngine`` driven from already-timed inputs, and ``violations.jsonl``.

``gpumeter replay`` (``pipeline/replay.py``) runs the guard's own processor (``services.guard.processor``) on the
runner over its in-memory broker, as the stream does; this module keeps what is handy beside it:
``violation_json`` (the ``violations.jsonl`` object of one published record) and ``replay_violations(records,
shares, costs, config)``, which feeds a ``GuardEngine`` directly from timed inputs -- for tools and tests that hold
the attributor's and billing's output rather than run them. ``GuardReplay`` is its engine wrapper: each pod event
and sample when received, each share row and cost line when available, the clock once per new instant, and
``finish(end_ms)`` at the end (the clock moves on; the end of the input is not taken for the nodes going silent).
"""

from __future__ import annotations

import heapq
from typing import Any, Iterable, Iterator, Union

from schemas.records import CostRecord, GpuShare, NodeSample, PodEvent, Violation
from gpumeter.clock import iso_utc
from services.guard.config import GuardConfig
from services.guard.engine import GuardEngine

VIOLATIONS_FILE = "violations.jsonl"

GuardInput = Union[NodeSample, PodEvent, GpuShare, CostRecord]


def violation_json(violation: Violation, published_at_unix_ms: int) -> dict[str, Any]:
    """The ``violations.jsonl`` object of one published record: ``rule``, ``state`` and ``severity`` (lower
    case), the subject (``cluster``, ``node``, ``gpu_uuid``, ``namespace``, ``pod``, ``pod_uid``, ``team``),
    ``fingerprint``, ``summary``, ``evidence``, and ``first_seen``, ``last_seen``, ``resolved_at`` and
    ``published_at`` in ISO 8601 UTC (each also as ``*_unix_ms``)."""
    resolved = violation.resolved_at_unix_ms
    return {
        "published_at": iso_utc(published_at_unix_ms),
        "published_at_unix_ms": published_at_unix_ms,
        "fingerprint": violation.fingerprint,
        "rule": violation.rule,
        "state": violation.state.value.lower(),
        "severity": violation.severity.value.lower(),
        "cluster": violation.cluster,
        "node": violation.node_name,
        "gpu_uuid": violation.gpu_uuid,
        "namespace": violation.namespace,
        "pod": violation.pod_name,
        "pod_uid": violation.pod_uid,
        "team": violation.team,
        "summary": violation.summary,
        "evidence": dict(sorted(violation.evidence.items())),
        "first_seen": iso_utc(violation.first_seen_unix_ms),
        "first_seen_unix_ms": violation.first_seen_unix_ms,
        "last_seen": iso_utc(violation.last_seen_unix_ms),
        "last_seen_unix_ms": violation.last_seen_unix_ms,
        "resolved_at": None if resolved is None else iso_utc(resolved),
        "resolved_at_unix_ms": resolved,
    }


class GuardReplay:
    """One ``GuardEngine`` fed by a replay. Each method returns what the engine published at ``now_ms``;
    ``published`` keeps every (time, record) for the caller's summary."""

    def __init__(self, config: GuardConfig | None = None) -> None:
        self.engine = GuardEngine(config or GuardConfig())
        self.published: list[tuple[int, Violation]] = []

    def _keep(self, now_ms: int, violations: tuple[Violation, ...]) -> tuple[Violation, ...]:
        self.published.extend((now_ms, v) for v in violations)
        return violations

    def clock(self, now_ms: int) -> tuple[Violation, ...]:
        return self._keep(now_ms, self.engine.on_clock(now_ms))

    def pod_event(self, event: PodEvent, now_ms: int) -> tuple[Violation, ...]:
        return self._keep(now_ms, self.engine.on_pod_event(event, now_ms))

    def sample(self, sample: NodeSample, now_ms: int) -> tuple[Violation, ...]:
        return self._keep(now_ms, self.engine.on_sample(sample, now_ms))

    def share(self, share: GpuShare, now_ms: int) -> tuple[Violation, ...]:
        return self._keep(now_ms, self.engine.on_share(share, now_ms))

    def cost(self, cost: CostRecord, now_ms: int) -> tuple[Violation, ...]:
        return self._keep(now_ms, self.engine.on_cost(cost, now_ms))

    def finish(self, end_ms: int) -> tuple[Violation, ...]:
        """The end of the input at ``end_ms``: hold-downs and budget periods advance, staleness is not judged."""
        return self._keep(end_ms, self.engine.on_clock(end_ms, detect_stale=False))

    def dispatch(self, record: GuardInput, now_ms: int) -> tuple[Violation, ...]:
        """The method for ``record``'s type."""
        if isinstance(record, NodeSample):
            return self.sample(record, now_ms)
        if isinstance(record, PodEvent):
            return self.pod_event(record, now_ms)
        if isinstance(record, GpuShare):
            return self.share(record, now_ms)
        if isinstance(record, CostRecord):
            return self.cost(record, now_ms)
        raise TypeError(f"the guard reads NodeSample, PodEvent, GpuShare and CostRecord, got {type(record).__name__}")


_RANK = {PodEvent: 0, NodeSample: 1, GpuShare: 2, CostRecord: 3}


def _timed(items: Iterable[Any], stream: int) -> Iterator[tuple[tuple[int, int, int, int], GuardInput]]:
    for seq, item in enumerate(items):
        if isinstance(item, tuple):
            at, record = item
        else:  # an attributor InputRecord: received_at_unix_ms and message
            at, record = item.received_at_unix_ms, item.message
        yield (int(at), _RANK.get(type(record), 9), stream, seq), record


def replay_violations(
    records: Iterable[Any],
    shares: Iterable[tuple[int, GpuShare]],
    costs: Iterable[tuple[int, CostRecord]],
    config: GuardConfig | None = None,
    *,
    end_unix_ms: int | None = None,
) -> tuple[Violation, ...]:
    """Every record the guard publishes over timed inputs, in order.

    ``records``: pod events and samples as ``(received_at_unix_ms, record)`` pairs or attributor
    ``InputRecord``s; ``shares`` and ``costs``: ``(available_at_unix_ms, record)`` — when the window was closed
    and priced. Each stream in time order; they are merged by time (at one instant: pod events, samples, shares,
    costs), the clock runs once per new instant, and ``finish`` runs at ``end_unix_ms`` (default: the last
    input's time).
    """
    guard = GuardReplay(config)
    out: list[Violation] = []
    last: int | None = None
    merged = heapq.merge(_timed(records, 0), _timed(shares, 1), _timed(costs, 2), key=lambda pair: pair[0])
    for (at, _, _, _), record in merged:
        if last is None or at > last:
            last = at
            out.extend(guard.clock(at))
        out.extend(guard.dispatch(record, at))
    if last is not None or end_unix_ms is not None:
        out.extend(guard.finish(max(x for x in (last, end_unix_ms) if x is not None)))
    return tuple(out)


__all__ = ["GuardReplay", "VIOLATIONS_FILE", "replay_violations", "violation_json"]
