"""``SeriesBook``: a label set goes once no node holds it; a late window lets nothing go; a forgotten node lets go
of everything it held. ``BillingSeries``: billing's series carry dcgm-exporter's labels and stay bounded while
10,000 pods come and go."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import generate_latest

from gpumeter.metrics import ServiceMetrics
from schemas.records import CostSubjectKind, ShareSubjectKind
from services.billing.catalog import PriceCatalog
from services.billing.costing import NodeWindowKey, bill_node_window
from services.billing.metric_series import BillingSeries, SeriesBook
from services.billing.pricing import DEFAULT_SPLIT_POLICY
from services.billing.service import BILLING_METRICS
from services.billing.sharing import KEEP_ALL, SharingPolicy
from tests.unit.billing.conftest import WINDOW_START_MS, Unit, bucket, node_window, pod

CATALOG = PriceCatalog.load()


def test_a_label_set_goes_when_its_last_node_bills_a_newer_window_without_it():
    removed: list[tuple] = []
    book = SeriesBook(lambda *labels: removed.append(labels))
    a, b = ("c", "node-a"), ("c", "node-b")
    book.observe(a, 60_000, [("ns", "db-0"), ("ns", "web")])
    book.observe(b, 60_000, [("ns", "db-0")])  # the same pod name on another node (a StatefulSet pod moved)
    book.observe(a, 0, [("ns", "old")])  # billed late: adds, lets nothing go
    assert removed == [] and ("ns", "old") in book
    book.observe(a, 120_000, [("ns", "web")])  # db-0 and old left node-a; node-b still holds db-0
    assert removed == [("ns", "old")] and ("ns", "db-0") in book
    book.observe(b, 120_000, [])
    assert removed == [("ns", "old"), ("ns", "db-0")] and len(book) == 1
    book.observe(a, 180_000, [("ns", "web"), ("x", "y")], prune=False)
    book.observe(a, 240_000, [], prune=False)  # a node's own series stay until the node is forgotten
    assert len(book) == 2
    book.forget(a)
    assert sorted(removed[2:]) == [("ns", "web"), ("x", "y")] and len(book) == 0


# -- BillingSeries: the series billing exports, driven directly (no broker, no ledger) ---------------------------

POD_METRICS = ("gpumeter_pod_gpu_cost_micro_usd_total", "gpumeter_pod_shared_cost_micro_usd_total",
               "gpumeter_pod_gpu_memory_share", "gpumeter_pod_gpu_compute_share")


def scraped(metrics: ServiceMetrics, name: str) -> dict[tuple, float]:
    """The label sets (sorted items) and values of ``name`` in a scrape of the registry."""
    return {tuple(sorted(sample.labels.items())): sample.value
            for family in metrics.registry.collect() for sample in family.samples if sample.name == name}


def billing_series(memory_s: float = 600.0) -> tuple[ServiceMetrics, BillingSeries]:
    metrics = ServiceMetrics("billing", BILLING_METRICS)
    return metrics, BillingSeries(metrics, team_label="team", node_memory_ms=int(memory_s * 1000))


def observe(series: BillingSeries, shares, sharing=KEEP_ALL):
    priced = bill_node_window(shares, CATALOG, DEFAULT_SPLIT_POLICY, sharing)
    first = shares[0]
    series.observe(NodeWindowKey(first.cluster, first.node_name, first.window_start_unix_ms), shares, priced)
    return priced


def test_pod_series_carry_dcgm_exporters_labels_a_mig_instance_under_its_parent_gpus_uuid():
    metrics, series = billing_series()
    units = [Unit("GPU-aaaa", [pod("whole", 0.7, "ml", team="research"), bucket(ShareSubjectKind.IDLE, 0.3)]),
             Unit("MIG-1111", [pod("mig", 1.0, "ml", team="research")], parent="GPU-bbbb", fraction=3 / 7),
             Unit("MIG-2222", [pod("mig", 1.0, "ml", team="research")], parent="GPU-bbbb", fraction=2 / 7),
             Unit("MIG-3333", [bucket(ShareSubjectKind.IDLE, 1.0)], parent="GPU-bbbb", fraction=2 / 7)]
    priced = observe(series, node_window(units, node="gpu-node-7", gpu_model="NVIDIA A100-SXM4-40GB"),
                     SharingPolicy.parse("idle=weighted"))
    node = {"Hostname": "gpu-node-7", "hostname": "gpu-node-7"}
    no_mig = {"container": "", "GPU_I_PROFILE": "", "GPU_I_ID": ""}
    a100 = {"modelName": "NVIDIA A100-SXM4-40GB"}
    direct = {(r.pod_name, r.gpu_uuid): r.cost_micro_usd for r in priced.costs
              if r.subject_kind is CostSubjectKind.POD and not r.is_shared}
    assert scraped(metrics, "gpumeter_pod_gpu_cost_micro_usd_total") == {
        tuple(sorted({"namespace": "ml", "pod": "pod-whole", "team": "research", "UUID": "GPU-aaaa",
                      **a100, **no_mig, **node}.items())): direct["pod-whole", "GPU-aaaa"],
        # Two instances of one GPU that NVML gave no profile for: one series of the parent's UUID, the cost of both.
        tuple(sorted({"namespace": "ml", "pod": "pod-mig", "team": "research", "UUID": "GPU-bbbb",
                      **a100, **no_mig, **node}.items())): direct["pod-mig", "MIG-1111"] + direct["pod-mig", "MIG-2222"],
    }
    # The gauges stay one series per unit (gpu_uuid), joined to dcgm-exporter by the parent's UUID.
    assert scraped(metrics, "gpumeter_pod_gpu_memory_share") == {
        tuple(sorted({"namespace": "ml", "pod": pod_name, "team": "research", "gpu_uuid": unit, "UUID": parent,
                      **a100, **no_mig, **node}.items())): share
        for pod_name, unit, parent, share in (("pod-whole", "GPU-aaaa", "GPU-aaaa", 0.7),
                                              ("pod-mig", "MIG-1111", "GPU-bbbb", 1.0),
                                              ("pod-mig", "MIG-2222", "GPU-bbbb", 1.0))}
    shared = scraped(metrics, "gpumeter_pod_shared_cost_micro_usd_total")
    assert sum(shared.values()) == sum(r.cost_micro_usd for r in priced.costs if r.is_shared) > 0
    for labels in shared:  # a bucket of the node: no GPU of its own
        assert dict(labels)["UUID"] == dict(labels)["modelName"] == "" and dict(labels)["Hostname"] == "gpu-node-7"
    exposition = generate_latest(metrics.registry).decode()
    assert 'UUID="GPU-bbbb"' in exposition and 'modelName="NVIDIA A100-SXM4-40GB"' in exposition


def test_a_mig_instance_carries_its_profile_and_gpu_instance_id_as_dcgm_exporter_does():
    import dataclasses

    metrics, series = billing_series()
    units = [Unit("MIG-1111", [pod("mig", 1.0, "ml", team="research")], parent="GPU-bbbb", fraction=3 / 7),
             Unit("MIG-2222", [pod("mig", 1.0, "ml", team="research")], parent="GPU-bbbb", fraction=2 / 7)]
    instances = {"MIG-1111": ("3g.40gb", 1), "MIG-2222": ("2g.20gb", 5)}
    shares = tuple(dataclasses.replace(s, mig_profile=instances[s.gpu_uuid][0],
                                       mig_gpu_instance_id=instances[s.gpu_uuid][1])
                   for s in node_window(units, node="gpu-node-7", gpu_model="NVIDIA A100-SXM4-40GB"))
    priced = observe(series, shares)
    direct = {r.gpu_uuid: r.cost_micro_usd for r in priced.costs if r.subject_kind is CostSubjectKind.POD}
    costs = scraped(metrics, "gpumeter_pod_gpu_cost_micro_usd_total")
    # One series per instance, told apart by GPU_I_ID as dcgm-exporter's are, under the parent's UUID.
    assert {(dict(k)["UUID"], dict(k)["GPU_I_PROFILE"], dict(k)["GPU_I_ID"]): v for k, v in costs.items()} == {
        ("GPU-bbbb", "3g.40gb", "1"): direct["MIG-1111"], ("GPU-bbbb", "2g.20gb", "5"): direct["MIG-2222"]}
    gauges = scraped(metrics, "gpumeter_pod_gpu_memory_share")
    assert {(dict(k)["gpu_uuid"], dict(k)["GPU_I_ID"]) for k in gauges} == {("MIG-1111", "1"), ("MIG-2222", "5")}


def test_10000_pods_churning_through_windows_leave_only_the_live_pods_series():
    """Four nodes of two GPUs, six pods per GPU, each pod living three windows (a third of them replaced every
    window) and the idle time shared to them; halfway two nodes are replaced by two others. 10,000 pods go
    through, and every scrape shows exactly the pods of each node's newest window -- a replaced node's until it
    has billed nothing for the memory horizon (ten windows) -- each direct-cost counter with the whole cost of its
    pod's life so far."""
    metrics, series = billing_series(memory_s=600.0)
    sharing = SharingPolicy.parse("idle=weighted")
    slots, lifetime, gpus = 6, 3, 2
    seen: set[str] = set()
    cost: dict[str, int] = defaultdict(int)
    most = dict.fromkeys(POD_METRICS, 0)
    newest: dict[str, tuple[int, set[str]]] = {}  # node -> its newest window and the pods in it
    w = 0
    while len(seen) < 10_000:
        nodes = ("n0", "n1", "n2", "n3") if w < 300 else ("n0", "n1", "n4", "n5")
        for node in nodes:
            live: set[str] = set()
            units = []
            for g in range(gpus):
                names = [f"{node}-g{g}-s{s}-{(w + s) // lifetime}" for s in range(slots)]
                live.update(f"pod-{n}" for n in names)
                units.append(Unit(f"GPU-{node}-{g}", [pod(n, 0.15, "ml", team=f"team-{i % 3}")
                                                        for i, n in enumerate(names)]
                                  + [bucket(ShareSubjectKind.IDLE, 0.1)]))
            priced = observe(series, node_window(units, node=node, window_start_ms=WINDOW_START_MS + w * 60_000),
                             sharing)
            for record in priced.costs:
                if record.subject_kind is CostSubjectKind.POD and not record.is_shared:
                    cost[record.pod_name] += record.cost_micro_usd
            newest[node] = (w, live)
            seen |= live
        held = set().union(*(pods for last, pods in newest.values() if last >= w - 10))
        for name in POD_METRICS:
            exported = scraped(metrics, name)
            assert {dict(labels)["pod"] for labels in exported} == held, (w, name)
            most[name] = max(most[name], len(exported))
        counters = scraped(metrics, "gpumeter_pod_gpu_cost_micro_usd_total")
        assert {dict(labels)["pod"]: value for labels, value in counters.items()} == {p: cost[p] for p in held}
        w += 1
    assert len(seen) >= 10_000 and w > 600
    per_node = gpus * slots  # pods of a node's window, one GPU each
    # At most the four nodes' pods, and the two replaced nodes' for ten windows.
    assert most == dict.fromkeys(POD_METRICS, 6 * per_node)
    assert held == set().union(*(newest[n][1] for n in nodes)) and len(held) == 4 * per_node
    # The replaced nodes billed nothing for the memory horizon: their own series went too.
    assert {dict(labels)["node"] for labels in scraped(metrics, "gpumeter_node_cost_micro_usd_total")} == \
        {"n0", "n1", "n4", "n5"}
    assert series.series_count()["gpumeter_pod_gpu_cost_micro_usd_total"] == 4 * per_node


def test_a_pod_series_removed_and_billed_again_is_exported_anew():
    # A pod leaves its node for one window (its series go) and comes back: the series is exported again, from that
    # window's cost (a removed counter starts over, as Prometheus's rate() expects of a new series).
    metrics, series = billing_series()
    windows = [["back", "stays"], ["stays"], ["back", "stays"]]
    priced = []
    for w, names in enumerate(windows):
        idle = bucket(ShareSubjectKind.IDLE, 1.0 - 0.4 * len(names))
        units = [Unit("GPU-aaaa", [pod(n, 0.4, "ml", team="t") for n in names] + [idle])]
        priced.append(observe(series, node_window(units, window_start_ms=WINDOW_START_MS + w * 60_000)))
        exported = {dict(labels)["pod"]: value
                    for labels, value in scraped(metrics, "gpumeter_pod_gpu_cost_micro_usd_total").items()}
        gauges = {dict(labels)["pod"] for labels in scraped(metrics, "gpumeter_pod_gpu_memory_share")}
        assert set(exported) == gauges == {f"pod-{n}" for n in names}
    last = {r.pod_name: r.cost_micro_usd for r in priced[2].costs if r.subject_kind is CostSubjectKind.POD}
    assert exported["pod-back"] == last["pod-back"] > 0
    assert exported["pod-stays"] == sum(r.cost_micro_usd for p in priced for r in p.costs
                                        if r.pod_name == "pod-stays" and r.subject_kind is CostSubjectKind.POD)
