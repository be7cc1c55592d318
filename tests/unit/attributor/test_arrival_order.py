"""A window's result does not depend on the order its ticks arrived in: every shipped scenario's ticks fed in
time order and shuffled (each tick up to 35 s out of place, within a 40 s grace, so none is late) give
identical share rows, to the last bit. The window's close orders its ticks; nothing it sums depends on arrival."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pipeline.recordings import scenario_records
from schemas.records import NodeSample, PodEvent
from services.attributor.attribution import AttributionPolicy, CostBasis, MpsCompute
from services.attributor.engine import AttributionEngine, EngineConfig
from simulator.scenario import load_scenario

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = tuple(sorted((REPO / "scenarios").glob("*.yaml")))
GRACE_SECONDS = 40
# A tick may arrive after ticks sampled up to this much later (the scenarios tick every 10-15 s): within grace.
DISPLACEMENT_MS = 35_000


def _inputs(path: Path) -> tuple[list[PodEvent], list[NodeSample]]:
    events, samples = [], []
    for record in scenario_records(load_scenario(path)):
        (events if isinstance(record.message, PodEvent) else samples).append(record.message)
    return events, samples


def _run(events, samples, policy) -> dict:
    engine = AttributionEngine(EngineConfig(window_seconds=60, grace_seconds=GRACE_SECONDS, policy=policy,
                                            max_sample_age_seconds=None, max_clock_skew_seconds=10**6))
    for event in events:
        engine.on_pod_event(event)
    newest = max(s.sampled_at_unix_ms for s in samples)
    windows = []
    for sample in samples:
        output = engine.on_sample(sample, newest)
        assert not output.late, output.late[0].reason
        windows.extend(output.windows)
    windows.extend(engine.flush().windows)
    return {(w.cluster, w.node_name, w.window_start_unix_ms): w.shares for w in windows}


def _shuffled(samples, seed):
    rng = random.Random(seed)
    return sorted(samples, key=lambda s: s.sampled_at_unix_ms + rng.randrange(DISPLACEMENT_MS))


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_ticks_arriving_out_of_order_within_grace_give_identical_shares(path):
    events, samples = _inputs(path)
    for policy in (AttributionPolicy(), AttributionPolicy(CostBasis.BLEND, 0.3, MpsCompute.THREADS)):
        in_order = _run(events, samples, policy)
        assert in_order
        for seed in (1, 2):
            shuffled = _shuffled(samples, seed)
            assert shuffled != samples  # really out of order
            assert _run(events, shuffled, policy) == in_order
