"""Property tests: for any pods, processes, modes, policies and missing or absurd data, every unit's shares add up
to 1 (within 1e-9) for memory, compute and cost, and stay within [0, 1]."""

from __future__ import annotations

import math
from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.records import NvmlError, PodEventType, SharingMode, ShareSubjectKind
from services.attributor.attribution import (
    AttributionPolicy,
    CostBasis,
    MpsCompute,
    attribute_node_window,
    attribute_node_window_detailed,
)
from services.attributor.pod_index import PodIndex, apply_pod_events
from services.attributor.windows import NodeWindow
from tests.unit.attributor import GIB, device, node_sample, pod_event

WINDOW_S = 60
START = 1_700_000_040_000 - (1_700_000_040_000 % (WINDOW_S * 1000))
TOL = 1e-9
BUCKETS = (ShareSubjectKind.IDLE, ShareSubjectKind.DRIVER_RESERVED, ShareSubjectKind.UNATTRIBUTED,
           ShareSubjectKind.UNAVAILABLE)
PROPERTY_SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

memory_bytes = st.one_of(
    st.integers(min_value=0, max_value=80 * GIB),
    st.integers(min_value=-(2**40), max_value=2**45),  # negative and absurd
    st.just(0),
)
utilization = st.one_of(st.none(), st.integers(min_value=0, max_value=100), st.integers(min_value=-50, max_value=400))
modes = st.sampled_from(list(SharingMode))
policies = st.builds(
    AttributionPolicy,
    cost_basis=st.sampled_from(list(CostBasis)),
    blend_alpha=st.floats(min_value=0.0, max_value=1.0),
    mps_compute=st.sampled_from(list(MpsCompute)),
)


@st.composite
def processes(draw, n_pod_uids):
    count = draw(st.integers(min_value=0, max_value=8))
    return [
        (
            draw(st.integers(min_value=-2, max_value=n_pod_uids + 1)),  # -1 unknown; out of range too
            draw(memory_bytes),
            draw(st.integers(min_value=-1, max_value=150)),
        )
        for _ in range(count)
    ]


@st.composite
def gpu_device(draw, uuid, n_pod_uids, *, parent_uuid=None, gi=None, slices=0, total_slices=0, mode=None):
    total = draw(st.one_of(st.just(80 * GIB), st.integers(min_value=-GIB, max_value=2**44), st.just(0)))
    errors = ()
    if draw(st.booleans()) and draw(st.booleans()):
        errors = (NvmlError(draw(st.sampled_from(["nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetUtilizationRates"])),
                            "UNKNOWN", "x"),)
    return device(
        uuid,
        total=total,
        used=draw(memory_bytes),
        reserved=draw(st.one_of(st.just(0), st.integers(min_value=-GIB, max_value=2 * GIB), memory_bytes)),
        free=draw(memory_bytes),
        util=draw(utilization),
        mode=mode if mode is not None else draw(modes),
        replicas=draw(st.integers(min_value=0, max_value=10)),
        procs=draw(processes(n_pod_uids)),
        per_process_supported=draw(st.booleans()),
        parent_uuid=parent_uuid,
        gi=gi,
        ci=0 if gi is not None else None,
        slices=slices,
        total_slices=total_slices,
        errors=errors,
    )


@st.composite
def scenarios(draw):
    n_pods = draw(st.integers(min_value=0, max_value=5))
    uids = [f"pod-{i}" for i in range(n_pods)]
    n_gpus = draw(st.integers(min_value=1, max_value=3))
    layouts = []
    for g in range(n_gpus):
        if draw(st.booleans()) and draw(st.booleans()):
            total_slices = draw(st.sampled_from([7, 4, 0]))
            instances = draw(st.lists(st.integers(min_value=1, max_value=4), min_size=0, max_size=4))
            layouts.append(("mig", f"GPU-{g}", total_slices, instances))
        else:
            layouts.append(("gpu", f"GPU-{g}", 0, []))

    # Pod events: random claims on random ids of this node's GPUs and instances.
    ids = []
    for kind, uuid, _, instances in layouts:
        if kind == "gpu":
            ids += [uuid] + [f"{uuid}::{r}" for r in range(3)]
        else:
            ids += [f"MIG-{uuid}-{i}" for i in range(len(instances))]
            ids += [f"MIG-{uuid}/{i}/0" for i in range(len(instances))]
            ids += [f"MIG-{uuid}-{i}::{r}" for i in range(len(instances)) for r in range(2)]
            ids.append(uuid)
    events = []
    for uid in uids:
        claimed = draw(st.lists(st.sampled_from(ids), max_size=3, unique=True)) if ids else []
        resource = draw(st.sampled_from(["nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-1g.10gb"]))
        started = draw(st.one_of(st.none(), st.integers(min_value=START - 10_000, max_value=START + 70_000)))
        annotations = draw(st.one_of(st.just({}), st.builds(
            lambda v: {"gpumeter.io/mps-active-thread-percentage": v},
            st.sampled_from(["25", "100", "0", "-3", "abc", "50%", "250"]),
        )))
        events.append(pod_event(uid, devices=[(resource, claimed)] if claimed else [], started_at_unix_ms=started,
                                annotations=annotations, observed_at_unix_ms=START - 20_000))
        if draw(st.booleans()) and draw(st.booleans()):
            events.append(pod_event(uid, devices=[(resource, claimed)] if claimed else [], started_at_unix_ms=started,
                                    annotations=annotations, event_type=PodEventType.DELETED,
                                    observed_at_unix_ms=draw(st.integers(min_value=START, max_value=START + 60_000)),
                                    phase="Succeeded", resource_version="2"))
    index = apply_pod_events(PodIndex.empty(), events)

    n_ticks = draw(st.integers(min_value=1, max_value=8))
    times = sorted(draw(st.lists(st.integers(min_value=START, max_value=START + WINDOW_S * 1000 - 1),
                                 min_size=n_ticks, max_size=n_ticks)))
    sample_uids = uids + (["stranger"] if draw(st.booleans()) else [])
    samples = []
    for seq, t in enumerate(times):
        devices = []
        for kind, uuid, total_slices, instances in layouts:
            if draw(st.integers(min_value=0, max_value=5)) == 0:
                continue  # this device is missing from this tick
            if kind == "gpu":
                devices.append(draw(gpu_device(uuid, len(sample_uids))))
            else:
                devices.append(draw(gpu_device(uuid, 0, mode=SharingMode.MIG, total_slices=total_slices)))
                for i, slices in enumerate(instances):
                    devices.append(draw(gpu_device(f"MIG-{uuid}-{i}", len(sample_uids), parent_uuid=uuid, gi=i,
                                                   slices=slices, total_slices=total_slices,
                                                   mode=SharingMode.MIG)))
        interval = draw(st.one_of(st.just(1000), st.integers(min_value=-5000, max_value=200_000)))
        samples.append(node_sample(t, devices, pod_uids=sample_uids, sequence=seq, interval_ms=interval))
    return NodeWindow("c1", "node-a", START, WINDOW_S, tuple(samples)), index


def _units(shares):
    units = defaultdict(list)
    for s in shares:
        units[s.gpu_uuid].append(s)
    return units


@PROPERTY_SETTINGS
@given(scenarios(), policies)
def test_every_unit_conserves_memory_compute_and_cost(scenario, policy):
    window, index = scenario
    shares = attribute_node_window(window, index, policy)
    units = _units(shares)
    for uuid, rows in units.items():
        for field in ("memory_share", "compute_share", "cost_share"):
            values = [getattr(r, field) for r in rows]
            assert abs(math.fsum(values) - 1.0) <= TOL, (uuid, field, values)
            assert all(-1e-12 <= v <= 1.0 + TOL for v in values), (uuid, field, values)
        kinds = [r.subject_kind for r in rows]
        assert [k for k in kinds if k is not ShareSubjectKind.POD] == list(BUCKETS)
        pod_uids = [r.pod_uid for r in rows if r.subject_kind is ShareSubjectKind.POD]
        assert len(pod_uids) == len(set(pod_uids)) and None not in pod_uids
        assert {r.rows_in_unit for r in rows} == {len(rows)}
        assert all(r.memory_used_bytes_avg >= 0.0 for r in rows)
        assert all(0.0 <= r.gpu_fraction <= 1.0 for r in rows)
        assert all(0.0 <= r.covered_seconds <= WINDOW_S for r in rows)
    assert {s.units_in_node for s in shares} <= {len(units)}


@PROPERTY_SETTINGS
@given(scenarios(), policies)
def test_attribution_is_deterministic(scenario, policy):
    window, index = scenario
    assert attribute_node_window(window, index, policy) == attribute_node_window(window, index, policy)


@PROPERTY_SETTINGS
@given(
    instances=st.lists(st.integers(min_value=1, max_value=3), min_size=0, max_size=4),
    total_slices=st.sampled_from([7, 8]),
    n_ticks=st.integers(min_value=1, max_value=5),
)
def test_mig_units_of_one_gpu_add_up_to_the_whole_gpu(instances, total_slices, n_ticks):
    # Keep the instances within the GPU: a real MIG layout never holds more slices than the GPU has.
    kept, used = [], 0
    for slices in instances:
        if used + slices <= total_slices:
            kept.append(slices)
            used += slices
    samples = []
    for k in range(n_ticks):
        parent = device("GPU-P", mode=SharingMode.MIG, util=None, total_slices=total_slices)
        children = [
            device(f"MIG-{i}", parent_uuid="GPU-P", gi=i, ci=0, slices=s, total_slices=total_slices,
                   total=10 * GIB * s, util=None, mode=SharingMode.MIG)
            for i, s in enumerate(kept)
        ]
        samples.append(node_sample(START + k * 1000, [parent, *children]))
    detail = attribute_node_window_detailed(NodeWindow("c1", "node-a", START, WINDOW_S, tuple(samples)),
                                            PodIndex.empty(), AttributionPolicy())
    fractions = {u.unit_uuid: u.gpu_fraction for u in detail.units}
    assert abs(math.fsum(fractions.values()) - 1.0) <= TOL
    for i, s in enumerate(kept):
        assert abs(fractions[f"MIG-{i}"] - s / total_slices) <= TOL
    assert ("GPU-P" in fractions) == (used < total_slices)


@PROPERTY_SETTINGS
@given(
    usage=st.lists(st.tuples(st.integers(min_value=0, max_value=80 * GIB), st.integers(min_value=0, max_value=100)),
                   min_size=1, max_size=10),
    basis=st.sampled_from(["memory", "compute", "blend:0.3", "request"]),
)
def test_an_exclusive_owner_alive_all_window_pays_exactly_the_whole_gpu(usage, basis):
    index = apply_pod_events(PodIndex.empty(), [pod_event("owner", devices=[("nvidia.com/gpu", ["GPU-0"])],
                                                          started_at_unix_ms=START - 1)])
    samples = [
        node_sample(START + k * 1000, [device(used=m, util=u, mode=SharingMode.EXCLUSIVE, procs=[(0, m, u)])],
                    pod_uids=["owner"])
        for k, (m, u) in enumerate(usage)
    ]
    shares = attribute_node_window(NodeWindow("c1", "node-a", START, WINDOW_S, tuple(samples)), index,
                                   AttributionPolicy.parse(basis))
    owner = next(s for s in shares if s.pod_uid == "owner")
    assert abs(owner.cost_share - 1.0) <= TOL
    assert owner.sharing_mode is SharingMode.EXCLUSIVE
    # Usage is still reported as measured.
    expected_memory = math.fsum(m for m, _ in usage) / len(usage) / (80 * GIB)
    assert abs(owner.memory_share - expected_memory) <= TOL
