"""``SamplePlans.quiet`` says True exactly when the three per-process sample rules find nothing, on random ticks of
random nodes -- whole, MIG, time-sliced and MPS units; pods that own units, share them by replica ids, request none,
leak by env or privilege, are exempt or unknown -- while the plan is kept, and when memory, pods or process lists
change between ticks (the plan must then be rebuilt); for ticks as objects and as decoded from NodeSample v4 (read
on the record's columns). And through the engine: a guard fed the same ticks with and without plans publishes the
same violations."""

from __future__ import annotations

import dataclasses
import random

import pytest

from schemas.records import NodeSample, PodEventType, SharingMode
from schemas.typed import codec_for
from services.guard.config import GuardConfig
from services.guard.engine import GuardEngine
from services.guard.rules import (
    apply_pod_event,
    gpu_error_counts,
    replica_refs_of,
    shared_memory_pressure,
    unrequested_gpu_use,
    usage_by_pod_and_unit,
    visibility_leak,
)
from services.guard.sample_plan import SamplePlans
from tests.unit.guard import CLUSTER, GIB, NODE, T0, container, device, nvml_error, pod_event, proc, sample

CODEC = codec_for(NodeSample)

GPUS = [f"GPU-{n:08x}-0000-4000-8000-0000000000{n:02x}" for n in range(4)]
MIGS = [f"MIG-{n:08x}-0000-4000-8000-0000000000{n:02x}" for n in range(2)]
CONFIGS = {
    "default": GuardConfig(),
    "tight": GuardConfig(shared_memory_used_above_percent=60.0, shared_memory_fair_share_factor=1.0,
                         unrequested_min_memory_bytes=GIB),
    "no env": GuardConfig(visible_devices_envvar_honoured=False, exempt_namespaces=("kube-system",)),
}


def random_units(rng: random.Random) -> list[dict]:
    """The node's units: GPU 0 split into two MIG instances, the others whole, time-sliced or MPS."""
    units = [dict(uuid=MIGS[0], parent=GPUS[0], gi=1, ci=0, index=0),
             dict(uuid=MIGS[1], parent=GPUS[0], gi=2, ci=0, index=0)]
    for n in range(1, 4):
        mode = rng.choice([SharingMode.EXCLUSIVE, SharingMode.TIME_SLICING, SharingMode.MPS, SharingMode.UNKNOWN])
        replicas = rng.choice([1, 2, 4]) if mode is not SharingMode.EXCLUSIVE else 1
        units.append(dict(uuid=GPUS[n], index=n, mode=mode, replicas=replicas))
    return units


def random_pods(rng: random.Random, count: int, units: list[dict]) -> list:
    """Pod ``n`` is meant for unit ``n % len(units)``: mostly it holds that unit's id (a MIG uuid, its GPU's uuid,
    the GPU's uuid or replica ids of it), sometimes another unit's, an index id, or none."""
    events = []
    for n in range(count):
        uid = f"00000000-0000-4000-8000-{n:012d}"
        unit = units[n % len(units)]
        kind = rng.random()
        if kind < 0.85:
            if unit.get("parent"):
                ids = [rng.choice([unit["uuid"], unit["parent"]])]
            elif unit.get("replicas", 1) > 1 and rng.random() < 0.7:
                ids = [f"{unit['uuid']}::{r}" for r in rng.sample(range(4), rng.choice([1, 2]))]
            else:
                ids = [unit["uuid"]]
        elif kind < 0.9:
            ids = [rng.choice(GPUS[1:] + MIGS)]
        elif kind < 0.93:
            ids = ["3"]  # an index id: the assignment is not known
        else:
            ids = []
        env = rng.choice(["all", "void", GPUS[2], "1", "0:1"]) if rng.random() < 0.1 else None
        privileged = rng.random() < 0.02
        requests = None if ids or rng.random() < 0.7 else {"nvidia.com/gpu": 1}
        namespace = rng.choice(["ml", "ml", "research", "kube-system"])
        c = container(devices=[("nvidia.com/gpu", ids)] if ids else [], env=env, privileged=privileged,
                      requests=requests)
        events.append(pod_event(uid, f"pod-{n}", namespace=namespace, containers=[c]))
    return events


def random_tick(rng: random.Random, units: list[dict], pod_count: int, layout: list[list[int]], t: int,
                columns: bool = False, slots: list[int] | None = None):
    """A tick whose process lists follow ``layout`` (per unit, the pod index of each process; -1 no pod, a
    number past the pods: an index the tick's pods do not have) with fresh memory figures, now and then an NVML
    error; ``columns``: as the v4 record decodes it (a sample on its columns)."""
    devices = []
    for unit, pods in zip(units, layout):
        processes = [proc(1000 + i, p, rng.choice([-1, rng.randrange(0, 30 * GIB), rng.randrange(0, 2 * GIB)]))
                     for i, p in enumerate(pods)]
        total = 40 * GIB if unit.get("parent") else 80 * GIB
        used = min(total, sum(max(p[2], 0) for p in processes) + rng.randrange(0, 4 * GIB))
        devices.append(device(unit["uuid"], index=unit["index"], parent=unit.get("parent"),
                              mode=unit.get("mode", SharingMode.EXCLUSIVE), replicas=unit.get("replicas", 1),
                              gi=unit.get("gi"), ci=unit.get("ci"), total=total,
                              reserved=rng.choice([GIB // 2, total, 0]), used=used, processes=processes,
                              errors=[nvml_error("nvmlDeviceGetPowerUsage", "NOT_SUPPORTED")]
                              if rng.random() < 0.03 else ()))
    node_errors = [nvml_error("nvmlDeviceGetCount", "UNKNOWN")] if rng.random() < 0.02 else []
    order = slots if slots is not None else list(range(pod_count))  # which pod each of the tick's slots names
    tick = sample(devices, [f"00000000-0000-4000-8000-{n:012d}" for n in order], t=t, node_errors=node_errors)
    if columns:
        data = CODEC.encode(tick)
        assert CODEC.decode(data) == tick  # (compared: its devices built; the tick handed out is a fresh one)
        decoded = CODEC.decode(data)
        assert decoded.packed is not None
        return decoded
    return tick


def random_layout(rng: random.Random, units: list[dict], pod_count: int,
                  counts: list[int] | None = None) -> list[list[int]]:
    """Mostly processes of pods whose position matches the unit's (``pod n`` runs on unit ``n % units``: some
    own it, some do not), some of no pod or of an index past the tick's pods."""
    def process_pod(u: int) -> int:
        if rng.random() < 0.1:
            return rng.choice([-1, pod_count + 1])
        mine = [p for p in range(pod_count) if p % len(units) == u]
        return rng.choice(mine) if mine and rng.random() < 0.9 else rng.randrange(pod_count)

    return [[process_pod(u) for _ in range(rng.randrange(0, 5) if counts is None else counts[u])]
            for u in range(len(units))]


def devices_built(tick) -> bool:
    try:
        NodeSample.__dict__["devices"].__get__(tick)  # the dataclass's slot, under PackedBackedNodeSample's property
    except AttributeError:
        return False
    return True


def rules_find_nothing(tick, pods, config, spec_pods, replica_refs) -> bool:
    usage = usage_by_pod_and_unit(tick)
    return not (visibility_leak(tick, pods, config, usage, spec_pods=spec_pods)
                + unrequested_gpu_use(tick, pods, config, usage)
                + shared_memory_pressure(tick, pods, config, usage, replica_refs))


@pytest.mark.parametrize("columns", [False, True], ids=["objects", "columns"])
@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_quiet_is_true_exactly_when_the_three_rules_find_nothing(config_name, columns):
    config = CONFIGS[config_name]
    rng = random.Random(f"sample-plan-{config_name}")
    verdicts = {True: 0, False: 0}
    rebuilt = 0
    for node_round in range(80):
        units = random_units(rng)
        pod_count = rng.randrange(1, 8)
        events = random_pods(rng, pod_count, units)
        views = {e.uid: apply_pod_event(None, e) for e in events}
        layout = random_layout(rng, units, pod_count)
        slots = None
        plans = SamplePlans(config)
        for tick_number in range(12):
            change = rng.random()
            if change < 0.15:  # a pod changes: a new view of it
                event = rng.choice(random_pods(rng, pod_count, units))
                views = dict(views)
                views[event.uid] = apply_pod_event(None, event)
            elif change < 0.3:
                layout = random_layout(rng, units, pod_count)
            elif change < 0.4:  # the same process counts, other owners
                layout = random_layout(rng, units, pod_count, [len(pods_of_unit) for pods_of_unit in layout])
            elif change < 0.5:  # the same process lists, the pods in other slots
                slots = rng.sample(range(pod_count), pod_count)
            tick = random_tick(rng, units, pod_count, layout, T0 + tick_number * 1000, columns, slots)
            pods = {uid: views[uid] for uid in sorted(views)}
            spec_pods = [pods[uid] for uid in sorted(pods)]
            refs = replica_refs_of(pods)
            before = plans._plans.get(NODE)
            verdict = plans.quiet(NODE, tick, pods, spec_pods, refs)
            kept = plans._plans.get(NODE) is before
            rebuilt += not kept
            if columns and kept:  # read on the columns: no device object was built for the verdict
                assert not devices_built(tick)
            assert verdict == rules_find_nothing(tick, pods, config, spec_pods, refs), (node_round, tick_number)
            plain = dataclasses.replace(tick) if columns else tick
            assert gpu_error_counts(tick, config) == gpu_error_counts(plain, config)
            verdicts[verdict] += 1
    # Both verdicts, and plans kept as well as rebuilt, occur often enough for the comparison to mean something.
    assert verdicts[True] > 80 and verdicts[False] > 80, verdicts
    assert 80 < rebuilt < 80 * 12 * 0.8, rebuilt


def test_a_guard_with_plans_publishes_what_the_rules_alone_publish():
    """The engine with its plans, and the same engine whose plans never call a tick quiet (every tick judged by
    the rules): the same violations, tick after tick, as pods come, change and go."""
    config = CONFIGS["tight"]
    rng = random.Random("sample-plan-engine")
    units = random_units(rng)
    pod_count = 6
    fast, slow = GuardEngine(config), GuardEngine(config)
    slow._sample_plans.quiet = lambda *args: False  # type: ignore[method-assign]
    layout = random_layout(rng, units, pod_count)
    published = 0
    for n, event in enumerate(random_pods(rng, pod_count, units)):
        assert fast.on_pod_event(event, T0 + n) == slow.on_pod_event(event, T0 + n)
    for tick_number in range(400):
        now = T0 + 1000 + tick_number * 10_000
        if rng.random() < 0.1:
            event = dataclasses.replace(rng.choice(random_pods(rng, pod_count, units)), observed_at_unix_ms=now,
                                        resource_version=str(now))
            assert fast.on_pod_event(event, now) == slow.on_pod_event(event, now)
        if rng.random() < 0.1:
            layout = random_layout(rng, units, pod_count)
        tick = random_tick(rng, units, pod_count, layout, now, columns=tick_number % 2 == 1)
        out = fast.on_sample(tick, now)
        assert out == slow.on_sample(tick, now), tick_number
        published += len(out)
    assert published > 20


@pytest.mark.parametrize("case", ["unit over its threshold", "pod a byte over its fair share", "pod at its share"])
def test_quiet_at_the_edges_of_the_shared_memory_thresholds(case):
    """A time-sliced GPU of 80 GiB in two replicas, nothing reserved, the tight config (60 %, fair share × 1):
    a unit 90 % used with no process; a pod at 40 GiB + 1 byte over its two processes, one of unknown memory
    (it counts for nothing, not for -1); a pod at exactly 40 GiB. The verdict is the rules' at each edge."""
    config = CONFIGS["tight"]
    gpu = GPUS[1]
    owner = pod_event("00000000-0000-4000-8000-000000000001", "owner",
                      containers=[container(devices=[("nvidia.com/gpu", [f"{gpu}::0"])])])
    pods = {owner.uid: apply_pod_event(None, owner)}
    processes = {
        "unit over its threshold": [],
        "pod a byte over its fair share": [proc(1, 0, 40 * GIB + 1), proc(2, 0, -1)],
        "pod at its share": [proc(1, 0, 40 * GIB)],
    }[case]
    used = 72 * GIB if case == "unit over its threshold" else 40 * GIB + 1
    tick = sample([device(gpu, index=1, mode=SharingMode.TIME_SLICING, replicas=2, total=80 * GIB, reserved=0,
                          used=used, processes=processes)], [owner.uid])
    spec_pods, refs = list(pods.values()), replica_refs_of(pods)
    expected_quiet = case == "pod at its share"
    assert rules_find_nothing(tick, pods, config, spec_pods, refs) is expected_quiet
    assert SamplePlans(config).quiet(NODE, tick, pods, spec_pods, refs) is expected_quiet


@pytest.mark.parametrize("columns", [False, True], ids=["objects", "columns"])
def test_the_same_process_lists_naming_other_pods_are_judged_anew(columns):
    """Two ticks with the same processes, the tick's pod slots swapped: the process of GPU 1 belongs to its owner
    in the first (quiet) and to the owner of GPU 2 in the second (a leak): the plan of the first is not reused."""
    config = CONFIGS["default"]
    a = pod_event("00000000-0000-4000-8000-00000000000a", "a",
                  containers=[container(devices=[("nvidia.com/gpu", [GPUS[1]])])])
    b = pod_event("00000000-0000-4000-8000-00000000000b", "b",
                  containers=[container(devices=[("nvidia.com/gpu", [GPUS[2]])])])
    pods = {e.uid: apply_pod_event(None, e) for e in (a, b)}
    spec_pods, refs = list(pods.values()), replica_refs_of(pods)
    plans = SamplePlans(config)
    verdicts = []
    for t, slots in ((T0, [a.uid, b.uid]), (T0 + 1000, [b.uid, a.uid])):
        tick = sample([device(GPUS[1], index=1, processes=[proc(7, 0, 4 * GIB)]),
                       device(GPUS[2], index=2)], slots, t=t)
        if columns:
            tick = CODEC.decode(CODEC.encode(tick))
        verdicts.append(plans.quiet(NODE, tick, pods, spec_pods, refs))
        assert verdicts[-1] == rules_find_nothing(tick, pods, config, spec_pods, refs)
    assert verdicts == [True, False]


def test_the_engines_pods_per_node_follow_every_pod_change():
    """The engine keeps each node's pods (``_NodePods``) until one of them changes, instead of checking every pod
    at every tick: against an engine that makes them afresh at every use, the same violations, call after call,
    while pods arrive, change, move between two nodes, are deleted and are pruned after their linger; and after
    every call each node's kept pods are exactly its pods now."""
    config = dataclasses.replace(CONFIGS["tight"], pod_linger_seconds=30)

    class Afresh(GuardEngine):
        def _node_pods_of(self, key):
            self._node_pod_views.pop(key, None)
            return super()._node_pods_of(key)

    rng = random.Random("pods-per-node")
    units = random_units(rng)
    pod_count = 6
    nodes = (NODE, "gpu-node-2")
    kept, afresh = GuardEngine(config), Afresh(config)
    layouts = {node: random_layout(rng, units, pod_count) for node in nodes}
    published = moved = deleted = pruned = 0

    def same(call, *args):
        out = getattr(kept, call)(*args)
        assert out == getattr(afresh, call)(*args), (call, args)
        for node in nodes:
            key = (CLUSTER, node)
            fresh = tuple(kept._pods[uid] for uid in kept._node_pods.get(key, ()) if uid in kept._pods)
            assert kept._node_pods_of(key).views == fresh and all(
                a is b for a, b in zip(kept._node_pods_of(key).views, fresh)), (call, node)
        return out

    for n, event in enumerate(random_pods(rng, pod_count, units)):
        same("on_pod_event", event, T0 + n)
    for step in range(600):
        now = T0 + 1000 + step * 5_000
        change = rng.random()
        if change < 0.25:
            event = dataclasses.replace(rng.choice(random_pods(rng, pod_count, units)), observed_at_unix_ms=now,
                                        resource_version=str(now), node_name=rng.choice(nodes))
            if rng.random() < 0.3:
                event = dataclasses.replace(event, event_type=PodEventType.DELETED)
                deleted += 1
            previous = kept._pods.get(event.uid)
            moved += previous is not None and previous.node_name != event.node_name
            same("on_pod_event", event, now)
        elif change < 0.35:
            before = len(kept._pods)
            same("on_clock", now)
            pruned += before - len(kept._pods)
        node = rng.choice(nodes)
        if rng.random() < 0.1:
            layouts[node] = random_layout(rng, units, pod_count)
        tick = dataclasses.replace(random_tick(rng, units, pod_count, layouts[node], now, columns=False),
                                   node_name=node)
        published += len(same("on_sample", tick, now))
    # Every kind of change happened, and the rules spoke often enough for the comparison to mean something.
    assert moved > 5 and deleted > 5 and pruned > 5 and published > 20, (moved, deleted, pruned, published)
