"""Scenario loading: the examples, the documented example, resolved identifiers, and every kind of bad input."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from gpumeter.errors import GpumeterError
from schemas.devices import DeviceIdKind, parse_device_id
from simulator.scenario import (
    GIB,
    MIB,
    MIG_PROFILES_BY_MEMORY_CLASS,
    ComputeSpec,
    MemorySpec,
    ScenarioError,
    deterministic_gpu_uuid,
    deterministic_pod_uid,
    load_scenario,
)

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = sorted((REPO / "scenarios").glob("*.yaml"))
REQUIRED_EXAMPLES = {
    "exclusive",
    "time_slicing",
    "mps",
    "mig_mixed",
    "visibility_leak",
    "churn",
    "two_nodes",
    "demo",
}

H100 = {
    "model": "NVIDIA H100 80GB HBM3",
    "memory_total_bytes": 85520809984,
    "driver_reserved_bytes": 597688320,
}

BASE = {
    "cluster": "c",
    "seed": 1,
    "start": "2026-07-01T00:00:00Z",
    "interval_seconds": 10,
    "duration_seconds": 100,
    "nodes": [
        {
            "name": "n1",
            "region": "us-east-1",
            "instance_type": "p5.48xlarge",
            "gpus": [
                {**H100, "sharing": {"mode": "exclusive"}},
                {**H100, "sharing": {"mode": "time_slicing", "replicas": 4}},
                {**H100, "sharing": {"mode": "mig", "instances": ["3g.40gb", "2g.20gb", "1g.10gb"]}},
                {"model": "NVIDIA L4", "memory_total_bytes": "23034MiB", "sharing": {"mode": "mps", "replicas": 2}},
            ],
        }
    ],
    "pods": [
        {
            "namespace": "ml",
            "name": "a",
            "node": "n1",
            "containers": [
                {
                    "name": "main",
                    "devices": [{"resource": "nvidia.com/gpu", "gpu": 0}],
                    "processes": [{"name": "python", "memory": {"bytes": "1GiB"}, "compute": 0.5}],
                }
            ],
        },
        {
            "namespace": "ml",
            "name": "b",
            "node": "n1",
            "containers": [
                {
                    "devices": [
                        {"resource": "nvidia.com/gpu.shared", "gpu": 1, "replica": 3},
                        {"resource": "nvidia.com/mig-2g.20gb", "gpu": 2, "instance": 1},
                    ],
                    "processes": [{"name": "python", "memory": {"preallocate_fraction": 0.5}}],
                }
            ],
        },
    ],
}


def _load(doc) -> object:
    return load_scenario(yaml.safe_dump(doc, sort_keys=False))


def _error(mutate) -> ScenarioError:
    doc = copy.deepcopy(BASE)
    mutate(doc)
    with pytest.raises(ScenarioError) as info:
        _load(doc)
    return info.value


# ---- the examples ---------------------------------------------------------------------------------------------


def test_every_required_example_exists():
    assert REQUIRED_EXAMPLES <= {p.stem for p in SCENARIOS}


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_example_loads_and_is_small(path):
    scenario = load_scenario(path)
    assert scenario.nodes and scenario.tick_times_ms()
    # small enough to replay in a second or two
    units = sum(len(g.sharing.mig_instances) or 1 for n in scenario.nodes for g in n.gpus)
    assert len(scenario.tick_times_ms()) * units <= 1000


def test_example_shapes_match_their_descriptions():
    ts = load_scenario(REPO / "scenarios/time_slicing.yaml")
    gpu = ts.nodes[0].gpus[0]
    assert (gpu.sharing.mode, gpu.sharing.replicas) == ("time_slicing", 4)
    assert len([p for p in ts.pods if p.node == ts.nodes[0].name]) == 3

    mig = load_scenario(REPO / "scenarios/mig_mixed.yaml")
    instances = mig.nodes[0].gpus[0].sharing.mig_instances
    assert {i.profile.name for i in instances} == {"1g.10gb", "2g.20gb", "3g.40gb"}
    assigned = {d.device_id for p in mig.pods for c in p.containers for d in c.devices}
    assert len([i for i in instances if i.uuid not in assigned]) == 1

    leak = load_scenario(REPO / "scenarios/visibility_leak.yaml")
    leaky = [p for p in leak.pods if any(c.env.get("NVIDIA_VISIBLE_DEVICES") == "all" for c in p.containers)]
    assert leaky and all(not c.requests and not c.devices for c in leaky[0].containers)
    assert all(c.processes for c in leaky[0].containers)

    churn = load_scenario(REPO / "scenarios/churn.yaml")
    assert any(p.start_seconds > 0 for p in churn.pods) and any(p.end_seconds is not None for p in churn.pods)

    two = load_scenario(REPO / "scenarios/two_nodes.yaml")
    assert len(two.nodes) == 2
    assert len({g.sharing.mode for n in two.nodes for g in n.gpus}) >= 2

    demo = load_scenario(REPO / "scenarios/demo.yaml")
    assert len(demo.nodes) == 3
    modes = [{g.sharing.mode for g in n.gpus} for n in demo.nodes]
    assert {"exclusive"} in modes and {"time_slicing"} in modes and {"mig"} in modes
    p5 = next(n for n in demo.nodes if len(n.gpus) == 8)
    assert all("H100" in g.model for g in p5.gpus)
    assert {p.labels.get("team") for p in demo.pods} >= {"foundation", "research", "ranking"}
    assert any(c.env.get("NVIDIA_VISIBLE_DEVICES") == "all" and not c.devices for p in demo.pods for c in p.containers)


def test_the_documented_full_example_loads():
    text = (REPO / "docs/scenarios.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert blocks
    scenario = load_scenario(blocks[0])
    assert scenario.nodes[0].gpus[0].uuid == "GPU-0f1e2d3c-4b5a-4697-8877-665544332211"
    assert len(scenario.nodes[0].gpus) == 4  # count: 2 expanded
    assert scenario.process_exit_races and scenario.host_processes


def test_every_field_of_the_full_example_is_documented():
    text = (REPO / "docs/scenarios.md").read_text()
    example = yaml.safe_load(re.findall(r"```yaml\n(.*?)```", text, re.S)[0])
    data_maps = {"labels", "annotations", "env", "requests"}  # their keys are data, not fields

    def keys(value):
        if isinstance(value, dict):
            for key, item in value.items():
                yield key
                if key not in data_maps:
                    yield from keys(item)
        elif isinstance(value, list):
            for item in value:
                yield from keys(item)

    found = set(keys(example))
    assert {"preallocate_fraction", "ramp", "steps", "mps_active_thread_percentage", "instances"} <= found
    assert sorted(k for k in found if f"`{k}`" not in text) == []


# ---- resolution ------------------------------------------------------------------------------------------------


def test_identifiers_are_deterministic_for_a_seed_and_change_with_it():
    first, again = _load(BASE), _load(BASE)
    assert first == again
    other = copy.deepcopy(BASE)
    other["seed"] = 2
    changed = _load(other)
    assert first.nodes[0].gpus[0].uuid != changed.nodes[0].gpus[0].uuid
    assert first.pods[0].uid != changed.pods[0].uid
    assert first.pods[0].containers[0].container_id != changed.pods[0].containers[0].container_id
    assert first.nodes[0].gpus[0].uuid == deterministic_gpu_uuid(1, "n1", 0)
    assert first.pods[0].uid == deterministic_pod_uid(1, "ml", "a")
    assert re.fullmatch(r"[0-9a-f]{64}", first.pods[0].containers[0].container_id)


def test_given_identifiers_are_kept():
    doc = copy.deepcopy(BASE)
    doc["nodes"][0]["gpus"][0]["uuid"] = "GPU-00000000-1111-4222-8333-444444444444"
    doc["pods"][0]["uid"] = "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"
    scenario = _load(doc)
    assert scenario.nodes[0].gpus[0].uuid == "GPU-00000000-1111-4222-8333-444444444444"
    assert scenario.pods[0].uid == "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"
    assert scenario.pods[0].containers[0].devices[0].device_id == "GPU-00000000-1111-4222-8333-444444444444"


def test_device_ids_are_what_the_device_plugin_hands_out():
    scenario = _load(BASE)
    gpus = scenario.nodes[0].gpus
    whole = scenario.pods[0].containers[0].devices[0]
    replica, mig = scenario.pods[1].containers[0].devices
    assert parse_device_id(whole.device_id).gpu_uuid == gpus[0].uuid
    ref = parse_device_id(replica.device_id)
    assert (ref.kind, ref.gpu_uuid, ref.replica) == (DeviceIdKind.GPU, gpus[1].uuid, 3)
    ref = parse_device_id(mig.device_id)
    assert ref.kind is DeviceIdKind.MIG_UUID and ref.mig_uuid == gpus[2].sharing.mig_instances[1].uuid
    # requests default to the assignments
    assert dict(scenario.pods[1].containers[0].requests) == {"nvidia.com/gpu.shared": 1, "nvidia.com/mig-2g.20gb": 1}


def test_mig_instances_get_distinct_ids_slices_and_memory():
    gpu = _load(BASE).nodes[0].gpus[2]
    instances = gpu.sharing.mig_instances
    assert len({i.gpu_instance_id for i in instances}) == len(instances)
    assert len({i.uuid for i in instances}) == len(instances)
    slice_bytes = (gpu.memory_total_bytes - gpu.driver_reserved_bytes) // 8 // MIB * MIB
    for instance in instances:
        assert instance.memory_total_bytes == instance.profile.memory_slices * slice_bytes
        assert instance.compute_instance_id == 0
    assert sum(i.profile.compute_slices for i in instances) <= 7
    assert [i.profile.name for i in instances] == ["3g.40gb", "2g.20gb", "1g.10gb"]


def test_mig_profile_tables_use_seven_compute_and_eight_memory_slices():
    for table in MIG_PROFILES_BY_MEMORY_CLASS.values():
        full = max(table.values(), key=lambda p: p.compute_slices)
        assert (full.compute_slices, full.memory_slices) == (7, 8)
        for profile in table.values():
            assert profile.name.startswith(f"{profile.compute_slices}g.")
            assert profile.max_instances * profile.compute_slices <= 7


def test_count_expands_gpus_with_their_own_indices_and_uuids():
    scenario = load_scenario(REPO / "scenarios/demo.yaml")
    p5 = next(n for n in scenario.nodes if len(n.gpus) == 8)
    assert [g.index for g in p5.gpus] == list(range(8))
    assert len({g.uuid for g in p5.gpus}) == 8


def test_sizes_and_times():
    doc = copy.deepcopy(BASE)
    doc["start"] = "2026-07-01T00:00:00+00:00"
    scenario = _load(doc)
    assert scenario.nodes[0].gpus[3].memory_total_bytes == 23034 * MIB
    assert scenario.start_unix_ms == 1782864000000
    assert scenario.tick_times_ms() == tuple(scenario.start_unix_ms + k * 10_000 for k in range(1, 11))


def test_memory_and_compute_specs():
    ramp = MemorySpec("ramp", from_bytes=GIB, to_bytes=3 * GIB, over_seconds=10)
    assert ramp.wanted_bytes(0, 0) == GIB
    assert ramp.wanted_bytes(5, 0) == 2 * GIB
    assert ramp.wanted_bytes(50, 0) == 3 * GIB
    steps = MemorySpec("steps", steps=((0, GIB), (30, 2 * GIB)))
    assert (steps.wanted_bytes(29.9, 0), steps.wanted_bytes(30, 0)) == (GIB, 2 * GIB)
    assert MemorySpec("preallocate", fraction=0.25).wanted_bytes(0, 8 * GIB) == 2 * GIB
    compute = ComputeSpec(((0, 0.2), (60, 0.9)))
    assert (compute.demand(59), compute.demand(60)) == (0.2, 0.9)


def test_load_from_path_string_and_path(tmp_path):
    target = tmp_path / "s.yaml"
    target.write_text(yaml.safe_dump(BASE))
    assert load_scenario(target) == load_scenario(str(target)) == _load(BASE)


# ---- errors ----------------------------------------------------------------------------------------------------


def test_scenario_error_is_a_gpumeter_error_with_a_path():
    err = _error(lambda d: d.pop("cluster"))
    assert isinstance(err, GpumeterError)
    assert err.path == "cluster" and str(err) == "cluster: is required"


def _set(path, value):
    def mutate(doc):
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


POD0C = ["pods", 0, "containers", 0]
POD1C = ["pods", 1, "containers", 0]

BAD = [
    ("unknown top field", _set(["clustr"], "x"), "<top>", "unknown field(s): clustr"),
    ("unknown gpu field", _set(["nodes", 0, "gpus", 0, "memory"], 1), "nodes[0].gpus[0]", "unknown field(s): memory"),
    ("non-UTC start", _set(["start"], "2026-07-01T00:00:00+02:00"), "start", "UTC"),
    ("naive start", _set(["start"], "2026-07-01 00:00:00"), "start", "UTC"),
    ("garbage start", _set(["start"], "yesterday"), "start", "ISO 8601"),
    ("interval too small", _set(["interval_seconds"], 0.5), "interval_seconds", "at least 1"),
    ("duration below interval", _set(["duration_seconds"], 5), "duration_seconds", "at least 10"),
    ("bad price model", _set(["nodes", 0, "price_model"], "reserved"), "nodes[0].price_model", "on_demand"),
    ("bad runtime", _set(["nodes", 0, "container_runtime"], "podman"), "nodes[0].container_runtime", "containerd"),
    ("bad size", _set(["nodes", 0, "gpus", 0, "memory_total_bytes"], "80 gigs"), "nodes[0].gpus[0].memory_total_bytes", "not a size"),
    ("bad gpu uuid", _set(["nodes", 0, "gpus", 0, "uuid"], "GPU-123"), "nodes[0].gpus[0].uuid", "not an NVML GPU uuid"),
    ("one replica", _set(["nodes", 0, "gpus", 1, "sharing"], {"mode": "time_slicing", "replicas": 1}), "nodes[0].gpus[1].sharing.replicas", "at least 2"),
    ("unknown mode", _set(["nodes", 0, "gpus", 0, "sharing"], {"mode": "vgpu"}), "nodes[0].gpus[0].sharing.mode", "exclusive"),
    ("mig on an L4", _set(["nodes", 0, "gpus", 3, "sharing"], {"mode": "mig", "instances": ["1g.10gb"]}), "nodes[0].gpus[3].sharing.mode", "does not support MIG"),
    ("40GB profile on 80GB", _set(["nodes", 0, "gpus", 2, "sharing", "instances"], ["1g.5gb"]), "nodes[0].gpus[2].sharing.instances[0]", "not a MIG profile"),
    ("too many slices", _set(["nodes", 0, "gpus", 2, "sharing", "instances"], ["4g.40gb", "3g.40gb", "1g.10gb"]), "nodes[0].gpus[2].sharing.instances[2]", "too many"),
    ("too many of a profile", _set(["nodes", 0, "gpus", 2, "sharing", "instances"], ["3g.40gb"] * 3), "nodes[0].gpus[2].sharing.instances[2]", "at most 2"),
    ("missing node", _set(["pods", 0, "node"], "n9"), "pods[0].node", "no node named 'n9'"),
    ("bad pod uid", _set(["pods", 0, "uid"], "ABC"), "pods[0].uid", "not a lowercase dashed pod UID"),
    ("replica out of range", _set(POD1C + ["devices", 0, "replica"], 4), "pods[1].containers[0].devices[0].replica", "at most 3"),
    ("replica missing", _set(POD1C + ["devices", 0], {"resource": "nvidia.com/gpu.shared", "gpu": 1}), "pods[1].containers[0].devices[0].replica", "say which replica"),
    ("shared name on exclusive", _set(POD0C + ["devices", 0, "resource"], "nvidia.com/gpu.shared"), "pods[0].containers[0].devices[0].resource", "nvidia.com/gpu"),
    ("wrong mig profile", _set(POD1C + ["devices", 1, "resource"], "nvidia.com/mig-1g.10gb"), "pods[1].containers[0].devices[1].resource", "nvidia.com/mig-2g.20gb"),
    ("instance out of range", _set(POD1C + ["devices", 1, "instance"], 3), "pods[1].containers[0].devices[1].instance", "at most 2"),
    ("requests mismatch", _set(POD0C + ["requests"], {"nvidia.com/gpu": 2}), "pods[0].containers[0].requests", "must equal"),
    ("invisible device", _set(POD0C + ["processes", 0, "devices"], [0, 1]), "pods[0].containers[0].processes[0].devices[1]", "not visible"),
    ("whole MIG GPU as target", _set(POD1C + ["processes", 0, "devices"], [2]), "pods[1].containers[0].processes[0].devices[0]", "MIG mode"),
    ("two memory forms", _set(POD0C + ["processes", 0, "memory"], {"bytes": 1, "preallocate_fraction": 0.1}), "pods[0].containers[0].processes[0].memory", "exactly one"),
    ("demand above one", _set(POD0C + ["processes", 0, "compute"], 1.5), "pods[0].containers[0].processes[0].compute", "at most 1"),
    ("steps not increasing", _set(POD0C + ["processes", 0, "compute"], [[0, 0.1], [0, 0.2]]), "pods[0].containers[0].processes[0].compute[1][0]", "increase"),
    ("steps not from 0", _set(POD0C + ["processes", 0, "compute"], [[5, 0.1]]), "pods[0].containers[0].processes[0].compute[0][0]", "starts at 0"),
    ("mps cap off MPS", _set(POD0C + ["processes", 0, "mps_active_thread_percentage"], 50), "pods[0].containers[0].processes[0].mps_active_thread_percentage", "MPS"),
    ("end before start", _set(["pods", 0, "end_seconds"], 0), "pods[0].end_seconds", "after start_seconds"),
    ("time beyond duration", _set(["pods", 0, "start_seconds"], 500), "pods[0].start_seconds", "at most 100"),
    ("fault function", _set(["nodes", 0, "faults"], [{"kind": "nvml_error", "function": "nvmlDeviceGetFanSpeed"}]), "nodes[0].faults[0].function", "not an NVML function"),
    ("fault error", _set(["nodes", 0, "faults"], [{"kind": "nvml_error", "function": "*", "error": "BROKEN"}]), "nodes[0].faults[0].error", "not an NVML error name"),
    ("fault gpu", _set(["nodes", 0, "faults"], [{"kind": "gpu_lost", "gpu": 4, "at_seconds": 1}]), "nodes[0].faults[0].gpu", "at most 3"),
    ("node fault with gpu", _set(["nodes", 0, "faults"], [{"kind": "nvml_error", "function": "nvmlInit", "gpu": 0}]), "nodes[0].faults[0].gpu", "takes no device"),
    ("race on unknown process", _set(["process_exit_races"], [{"pod": "ml/a", "process": "java", "at_seconds": 5}]), "process_exit_races[0].process", "no process 'java'"),
    ("host process in kubepods", _set(["host_processes"], [{"node": "n1", "name": "x", "cgroup": "/kubepods/x", "devices": [0], "memory": {"bytes": 1}}]), "host_processes[0].cgroup", "outside the kubepods"),
]


@pytest.mark.parametrize("mutate,path,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_invalid_scenarios_name_the_bad_path(mutate, path, fragment):
    err = _error(mutate)
    assert err.path == path, str(err)
    assert fragment in str(err)


def test_double_assignment_at_the_same_time_is_rejected_but_not_in_sequence():
    doc = copy.deepcopy(BASE)
    clone = copy.deepcopy(doc["pods"][0])
    clone["name"] = "a2"
    doc["pods"].append(clone)
    with pytest.raises(ScenarioError) as info:
        _load(doc)
    assert info.value.path == "pods[2].containers[0].devices[0]" and "already assigned" in str(info.value)
    doc["pods"][0]["end_seconds"] = 40
    clone["start_seconds"] = 40
    assert len(_load(doc).pods) == 3


def test_leaks_are_allowed_only_with_visible_devices_all_or_privileged():
    doc = copy.deepcopy(BASE)
    doc["pods"].append(
        {
            "namespace": "x",
            "name": "leak",
            "node": "n1",
            "containers": [{"processes": [{"name": "p", "devices": [1], "memory": {"bytes": 1}}]}],
        }
    )
    with pytest.raises(ScenarioError, match="not visible"):
        _load(doc)
    doc["pods"][-1]["containers"][0]["env"] = {"NVIDIA_VISIBLE_DEVICES": "all"}
    assert _load(doc).pods[-1].containers[0].processes[0].devices[0].gpu == 1
    del doc["pods"][-1]["containers"][0]["env"]
    doc["pods"][-1]["containers"][0]["privileged"] = True
    assert _load(doc).pods[-1].containers[0].privileged


def test_yaml_syntax_errors_and_unreadable_files_are_scenario_errors(tmp_path):
    with pytest.raises(ScenarioError, match=r"line \d+"):
        load_scenario("cluster: [unclosed\nseed: 1\n")
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")
    with pytest.raises(ScenarioError, match="empty"):
        load_scenario("\n")
    with pytest.raises(ScenarioError, match="mapping"):
        load_scenario("- a\n- b\n")


def test_duplicate_keys_are_rejected_not_silently_dropped():
    text = yaml.safe_dump(BASE, sort_keys=False) + "seed: 5\n"
    with pytest.raises(ScenarioError) as info:
        load_scenario(text)
    assert "duplicate key 'seed'" in str(info.value) and info.value.path.startswith("line ")


@pytest.mark.parametrize("argv", [
    ["--simulate", "scenarios/demo.yaml", "--node", "no-such-node"],  # a node the scenario does not have
    ["--node", "gpu-node-1", "--kube-api", "none"],  # with GPUMETER_SHARING unreadable (below)
])
def test_the_collector_refuses_a_node_the_scenario_lacks_or_bad_sharing_in_one_line(argv, capsys):
    from gpumeter import cli

    argv = [str(REPO / a) if a.endswith(".yaml") else a for a in argv]
    env = {"GPUMETER_SHARING": "GPU-1=sometimes", "GPUMETER_METRICS_PORT": "0"}
    args = cli.build_parser("collector").parse_args(["collector", *argv])
    from services.collector import main as collector_main

    assert collector_main.main(args, env) == 2
    out, err = capsys.readouterr()
    lines = (out + err).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out + err
    if "--simulate" in argv:
        assert "no-such-node" in lines[0] and "gpu-p5-a" in lines[0]  # what is missing, and what there is
    else:
        assert "sometimes" in lines[0]


# ---- a pod recreated under its name (a StatefulSet's) ----------------------------------------------------------


def _recreated(first_end: float, second_start: float, **second) -> dict:
    """BASE with pod ml/a deleted at ``first_end`` and created again on its GPU at ``second_start``."""
    doc = copy.deepcopy(BASE)
    doc["pods"][0]["end_seconds"] = first_end
    again = copy.deepcopy(BASE["pods"][0])
    again.update({"start_seconds": second_start, **second})
    doc["pods"].append(again)
    return doc


def test_a_pod_recreated_under_its_name_is_a_new_pod_with_its_own_uid():
    from simulator.world import SimWorld

    scenario = _load(_recreated(40, 40))
    old, new = scenario.pods[0], scenario.pods[2]
    assert old.key == new.key == "ml/a"
    # The first keeps the uid it always had; the second's comes from its start as well, and so do its ids.
    assert old.uid == deterministic_pod_uid(1, "ml", "a")
    assert new.uid == deterministic_pod_uid(1, "ml", "a", 40) != old.uid
    assert new.containers[0].container_id != old.containers[0].container_id
    world = SimWorld(scenario)
    at = lambda seconds: scenario.start_unix_ms + seconds * 1000  # noqa: E731
    assert [p.uid for p in world.pods_at(at(30)) if p.name == "a"] == [old.uid]
    assert [p.uid for p in world.pods_at(at(40)) if p.name == "a"] == [new.uid]
    processes = [p for p in world.processes if p.pod_key == "ml/a"]
    assert {p.pod_uid for p in processes} == {old.uid, new.uid}
    assert len({p.pid for p in processes}) == 2 and len({p.cgroup_path for p in processes}) == 2
    # Truth per uid: at 30 s the old incarnation uses GPU 0, at 40 s the new one, never both.
    truth_pods = lambda seconds: {r.pod_uid for r in world.truth(at(seconds))  # noqa: E731
                                  if r.gpu_uuid == scenario.nodes[0].gpus[0].uuid}
    assert truth_pods(30) == {old.uid} and truth_pods(40) == {new.uid}
    # A given uid is kept; a gap between the two lives is allowed.
    given = _load(_recreated(40, 60, uid="aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"))
    assert given.pods[2].uid == "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"


@pytest.mark.parametrize(("first_end", "second_start", "lives"), [
    (50, 40, "from 40 s on and so is pods[0] from 0 s to 50 s"),
    (None, 40, "from 40 s on and so is pods[0] from 0 s on"),
])
def test_two_pods_of_one_name_alive_at_once_are_refused_naming_both(first_end, second_start, lives):
    doc = _recreated(first_end, second_start)
    if first_end is None:
        del doc["pods"][0]["end_seconds"]
    with pytest.raises(ScenarioError) as info:
        _load(doc)
    assert info.value.path == "pods[2]"
    assert f"pod ml/a is alive {lives}" in str(info.value)
    assert "only one pod of a name is alive at a time" in str(info.value)


def test_an_exit_race_on_a_recreated_pod_is_the_incarnation_alive_then():
    from simulator.world import SimWorld

    doc = _recreated(40, 40)
    doc["process_exit_races"] = [{"pod": "ml/a", "process": "python", "at_seconds": 60}]
    scenario = _load(doc)
    new = scenario.pods[2]
    assert scenario.process_exit_races[0].pod_uid == new.uid
    ends = {p.pod_uid: p.exit_race_ms for p in SimWorld(scenario).processes if p.pod_key == "ml/a"}
    assert ends == {scenario.pods[0].uid: None, new.uid: scenario.start_unix_ms + 60_000}
    doc = _recreated(40, 60)
    doc["process_exit_races"] = [{"pod": "ml/a", "process": "python", "at_seconds": 50}]
    with pytest.raises(ScenarioError, match="no pod ml/a is alive then") as info:
        _load(doc)
    assert info.value.path == "process_exit_races[0].at_seconds"
