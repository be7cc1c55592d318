"""Worlds of one scenario share its structure and observations (what keeps a replay linear in node count), never
their time or their /proc bookkeeping, and answer exactly as a world with nothing shared does."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from simulator import world as world_module
from simulator.scenario import load_scenario
from simulator.world import SimWorld, _h, _h_next, _h_prefix

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = sorted(p.stem for p in (REPO / "scenarios").glob("*.yaml"))


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_world_sharing_with_others_answers_as_a_world_of_its_own(name):
    shared_scenario = load_scenario(REPO / "scenarios" / f"{name}.yaml")
    alone = SimWorld(load_scenario(REPO / "scenarios" / f"{name}.yaml"))  # another object: nothing shared
    first, second = SimWorld(shared_scenario), SimWorld(shared_scenario)
    times = shared_scenario.tick_times_ms()
    for t in times:
        # The first world computes each instant; the second is answered from what the first computed.
        assert first.truth(t) == alone.truth(t)
        assert second.truth(t) == alone.truth(t)
        assert second.process_observations(t) == alone.process_observations(t)
        assert second.pods_at(t) == alone.pods_at(t)
        for node in shared_scenario.nodes:
            assert second.pods_at(t, node.name) == alone.pods_at(t, node.name)
            for gpu in node.gpus:
                assert second.observation_at(t, node.name, gpu.index) == alone.observation_at(t, node.name,
                                                                                             gpu.index)


def test_worlds_of_one_scenario_keep_their_own_time_and_proc_files(tmp_path):
    scenario = load_scenario(REPO / "scenarios" / "churn.yaml")
    ahead, behind = SimWorld(scenario), SimWorld(scenario)
    times = scenario.tick_times_ms()
    ahead.step(times[-1])
    assert behind.now_ms == scenario.start_unix_ms
    behind.step(times[0])  # the other world being later does not stop this one from going to an earlier time
    with pytest.raises(ValueError):
        ahead.step(times[0])
    node = scenario.nodes[0].name
    written_ahead = ahead.write_proc(tmp_path / "ahead", node)
    written_behind = behind.write_proc(tmp_path / "behind", node)
    assert written_ahead != written_behind  # churn: other pods run at the end than at the start
    for root, pids in ((tmp_path / "ahead", written_ahead), (tmp_path / "behind", written_behind)):
        assert sorted(int(p.name) for p in root.iterdir()) == list(pids)


def test_the_shared_structure_goes_with_its_scenario():
    # Judged by this scenario's own entry: other tests' scenarios may be collected (and their entries dropped) by
    # any collection in between, so the table's length says nothing about this one.
    scenario = load_scenario(REPO / "scenarios" / "demo.yaml")
    key = id(scenario)
    assert key not in world_module._STRUCTURES
    first = SimWorld(scenario)
    structure = world_module._STRUCTURES[key]
    second = SimWorld(scenario)
    assert world_module._STRUCTURES[key] is structure  # the second world shares the first one's structure
    del first, second, structure, scenario
    gc.collect()
    assert key not in world_module._STRUCTURES


@pytest.mark.parametrize("parts", [(7, "sm", 1234, "GPU-1"), (0, "ts", 99, "MIG-x"), (2026, "pid")])
@pytest.mark.parametrize("last", [0, 1_782_864_000_000, "x"])
def test_the_hash_from_a_saved_prefix_is_the_hash_of_the_whole(parts, last):
    prefix = _h_prefix(*parts)
    assert _h_next(prefix, last) == _h(*parts, last)
    assert _h_next(prefix, last) == _h(*parts, last)  # the saved state is copied, not consumed
