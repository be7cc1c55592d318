"""Device ids in every form the NVIDIA device plugin hands out are attributed alike.

With ``deviceIDStrategy: index`` the kubelet's PodResources lists NVML indexes (``0``, ``0::3`` for a replica,
``0:1`` for MIG device 1 of GPU 0) instead of uuids; with CDI (``deviceListStrategy: cdi-*``) names look like
``nvidia.com/gpu=0``. The collector resolves them to uuids through NVML (``NvmlBackend.uuid_by_index``,
``schemas.devices.resolve_device_id``), so the attributor, billing and the guard see one form. Checked through
the real path: every shipped sharing mode replayed with index ids gives byte-identical shares, costs and
violations.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gpumeter.clock import ManualClock
from pipeline.recordings import scenario_records
from pipeline.replay import replay
from schemas.devices import DeviceIdKind, parse_device_id, resolve_device_id, resolve_visible_devices
from schemas.records import PodEvent
from services.collector.nvml_backend import NvmlBackend
from services.collector.simulation import sharing_config
from simulator.nvml_driver import simulated_pynvml
from simulator.scenario import load_scenario
from simulator.world import SimWorld

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = ("demo", "time_slicing", "mig_mixed", "mps", "exclusive")
UUIDS = {"0": "GPU-aaaa", "1": "GPU-bbbb", "1:0": "MIG-cccc", "1:2": "MIG-dddd"}


@pytest.mark.parametrize("given, resolved", [
    ("0", "GPU-aaaa"),
    ("0::3", "GPU-aaaa::3"),
    ("1:2", "MIG-dddd"),
    ("nvidia.com/gpu=0", "GPU-aaaa"),
    ("nvidia.com/gpu=0::1", "GPU-aaaa::1"),
    ("nvidia.com/mig-1g.10gb=1:0", "MIG-cccc"),
    ("nvidia.com/gpu=GPU-eeee", "GPU-eeee"),
    ("nvidia.com/gpu=all", "all"),
    ("GPU-ffff::2", "GPU-ffff::2"),  # already a uuid
    ("7", "7"),  # an index no device has: unchanged, names no unit
    ("1:9", "1:9"),
    ("k8s.gpu.nvidia.com/claim=0b1c-gpu-0", "k8s.gpu.nvidia.com/claim=0b1c-gpu-0"),  # a DRA claim device
    ("", ""),
])
def test_index_and_cdi_ids_resolve_to_uuids_and_nothing_else_changes(given, resolved):
    assert resolve_device_id(given, UUIDS) == resolved


def test_resolved_ids_parse_as_the_units_they_name():
    assert parse_device_id(resolve_device_id("0::3", UUIDS)).kind is DeviceIdKind.GPU
    assert parse_device_id(resolve_device_id("1:2", UUIDS)).mig_uuid == "MIG-dddd"
    assert parse_device_id(resolve_device_id("7", UUIDS)).kind is DeviceIdKind.OTHER


@pytest.mark.parametrize("value, resolved", [
    ("0,1", "GPU-aaaa,GPU-bbbb"),
    ("0, nvidia.com/gpu=1", "GPU-aaaa,GPU-bbbb"),
    ("all", "all"),
    ("none", "none"),
    ("", ""),
    (None, None),
    ("GPU-aaaa", "GPU-aaaa"),
])
def test_visible_devices_are_resolved_item_by_item(value, resolved):
    assert resolve_visible_devices(value, UUIDS) == resolved


def test_the_nvml_backend_names_every_gpu_and_mig_device_by_its_index():
    scenario = load_scenario(REPO / "scenarios" / "mig_mixed.yaml")
    node = scenario.nodes[0]
    clock = ManualClock(scenario.start_unix_ms + 30_000)
    backend = NvmlBackend(simulated_pynvml(SimWorld(scenario), clock, node.name), clock,
                          sharing_by_gpu_uuid=sharing_config(node))
    assert backend.uuid_by_index == {}  # nothing read yet
    devices = backend.read().devices
    by_index = backend.uuid_by_index
    gpus = [d for d in devices if d.parent_uuid is None]
    migs = [d for d in devices if d.parent_uuid is not None]
    assert {by_index[str(d.index)] for d in gpus} == {d.uuid for d in gpus}
    mig_ids = {key: uuid for key, uuid in by_index.items() if ":" in key}
    assert sorted(mig_ids.values()) == sorted(d.uuid for d in migs)
    # MIG device j of GPU i is the scenario's instance j (nvmlDeviceGetMigDeviceHandleByIndex order).
    gpu = node.gpus[0]
    assert [mig_ids[f"{gpu.index}:{j}"] for j in range(len(gpu.sharing.mig_instances))] == [
        spec.uuid for spec in gpu.sharing.mig_instances]


def _with_index_ids(name: str, tmp_path: Path) -> Path:
    raw = yaml.safe_load((REPO / "scenarios" / f"{name}.yaml").read_text())
    for node in raw["nodes"]:
        node["device_id_strategy"] = "index"
    path = tmp_path / f"{name}-index.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML
    return path


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_scenario_with_index_ids_is_attributed_billed_and_guarded_as_with_uuids(name, tmp_path):
    by_uuid = replay(REPO / "scenarios" / f"{name}.yaml", tmp_path / "uuid")
    by_index = replay(_with_index_ids(name, tmp_path), tmp_path / "index")
    assert by_uuid.share_rows > 0 and by_uuid.dead_letters == by_index.dead_letters == {}
    for output in ("shares.jsonl", "costs.jsonl", "bills.jsonl", "violations.jsonl", "truth.jsonl"):
        assert (tmp_path / "index" / output).read_bytes() == (tmp_path / "uuid" / output).read_bytes(), output


def test_the_collector_publishes_index_ids_resolved(tmp_path):
    scenario = load_scenario(_with_index_ids("time_slicing", tmp_path))
    given = [a.device_id for pod in scenario.pods for c in pod.containers for a in c.devices]
    assert given and not any(d.startswith(("GPU-", "MIG-")) for d in given), given  # the kubelet says "0::1"
    events = [r.message for r in scenario_records(scenario) if isinstance(r.message, PodEvent)]
    ids = [d for e in events for c in e.containers for a in c.assigned_devices for d in a.device_ids]
    assert ids and all(parse_device_id(d).kind is DeviceIdKind.GPU for d in ids), ids
