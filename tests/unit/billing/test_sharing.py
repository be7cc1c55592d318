"""Sharing policies: buckets kept as lines of their own or shared to the node-window's pods, to the micro-dollar."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumeter.errors import ConfigError
from schemas.records import CostSubjectKind, ShareSubjectKind
from services.billing.costing import price_node_window
from services.billing.pricing import NodePrice, SplitRule
from services.billing.sharing import (
    KEEP_ALL,
    SHAREABLE_KINDS,
    PodRequests,
    ShareMethod,
    SharingPolicy,
    apply_sharing,
    share_weights,
)
from tests.unit.billing.conftest import Row, Unit, bucket, node_window, pod

HYPOTHESIS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BUCKETS = (ShareSubjectKind.IDLE, ShareSubjectKind.DRIVER_RESERVED, ShareSubjectKind.UNATTRIBUTED,
           ShareSubjectKind.UNAVAILABLE)


def price(gpu_count: int, gpu_usd: str = "4.00", other_usd: str = "2.00") -> NodePrice:
    gpu, other = Fraction(gpu_usd), Fraction(other_usd)
    return NodePrice(provider="aws", region="us-east-1", instance_type="p4d.24xlarge", price_model="on_demand",
                     node_usd_per_hour=gpu_count * gpu + other, gpu_count=gpu_count, gpu_usd_per_hour=gpu,
                     node_other_usd_per_hour=other, split_rule=SplitRule.WEIGHTS, sources=())


def requesting(uid: str, share: float, cpu: int, memory: int, **labels: str) -> Row:
    return Row(ShareSubjectKind.POD, share, uid, "ml", dict(labels), cpu, memory)


def by_pod(costs):
    direct, shared = defaultdict(int), defaultdict(int)
    for c in costs:
        if c.subject_kind is CostSubjectKind.POD:
            (shared if c.is_shared else direct)[c.pod_uid] += c.cost_micro_usd
    return dict(direct), dict(shared)


# --------------------------------------------------------------------------------------------------------------
# The policy text


def test_the_policy_reads_and_says_what_it_shares():
    policy = SharingPolicy.parse("idle=weighted, node_other=even,unavailable=requests")
    assert (policy.idle, policy.node_other, policy.unavailable) == (ShareMethod.WEIGHTED, ShareMethod.EVEN,
                                                                    ShareMethod.REQUESTS)
    assert policy.driver_reserved is ShareMethod.KEEP and policy.shares_anything
    assert policy.describe() == "idle=weighted,unavailable=requests,node_other=even"
    assert SharingPolicy.parse(policy.describe()) == policy
    assert SharingPolicy.parse("all=weighted,node_other=keep").describe() == (
        "idle=weighted,driver_reserved=weighted,unattributed=weighted,unavailable=weighted")
    assert SharingPolicy.parse("lost=even").unavailable is ShareMethod.EVEN  # the name for the bucket
    for text in ("", None, "keep", " keep "):
        assert SharingPolicy.parse(text) == KEEP_ALL and KEEP_ALL.describe() == "keep"
    assert not KEEP_ALL.shares_anything


@pytest.mark.parametrize("bad", ["idle", "idle=spread", "pods=even", "idle=weighted,gpu=even", "=even"])
def test_an_unusable_policy_is_a_config_error_naming_the_choices(bad):
    with pytest.raises(ConfigError) as caught:
        SharingPolicy.parse(bad)
    assert any(word in str(caught.value) for word in ("weighted", "node_other", "<bucket>"))


# --------------------------------------------------------------------------------------------------------------
# The methods on a worked node-window


def two_gpus() -> tuple:
    """Two GPUs: GPU-0 time-sliced by train (60 %) and serve (20 %), 20 % idle; GPU-1 a whole idle GPU (no pod);
    train requests 4 CPUs and 16 GiB, serve 2 CPUs and 48 GiB. 1 h at 4 USD per GPU and 2 USD for the rest."""
    gib = 2**30
    units = [
        Unit("GPU-0", [requesting("train", 0.6, 4000, 16 * gib, team="a"),
                       requesting("serve", 0.2, 2000, 48 * gib, team="b"),
                       bucket(ShareSubjectKind.IDLE, 0.2), bucket(ShareSubjectKind.DRIVER_RESERVED, 0.0),
                       bucket(ShareSubjectKind.UNATTRIBUTED, 0.0), bucket(ShareSubjectKind.UNAVAILABLE, 0.0)]),
        Unit("GPU-1", [bucket(ShareSubjectKind.IDLE, 1.0), bucket(ShareSubjectKind.DRIVER_RESERVED, 0.0),
                       bucket(ShareSubjectKind.UNATTRIBUTED, 0.0), bucket(ShareSubjectKind.UNAVAILABLE, 0.0)]),
    ]
    return node_window(units, window_seconds=3600), price(2)


def test_keep_is_todays_lines():
    shares, p = two_gpus()
    costs = price_node_window(shares, p).costs
    assert price_node_window(shares, p, KEEP_ALL).costs == costs
    assert not any(c.is_shared for c in costs)
    assert {c.subject_kind for c in costs if c.cost_micro_usd} == {CostSubjectKind.POD, CostSubjectKind.IDLE,
                                                                  CostSubjectKind.NODE_OTHER}


def test_weighted_shares_by_the_pods_direct_cost_across_the_whole_node_window():
    shares, p = two_gpus()
    result = price_node_window(shares, p, SharingPolicy.parse("idle=weighted,node_other=weighted"))
    direct, shared = by_pod(result.costs)
    # Direct: train 0.6 x 4 USD, serve 0.2 x 4 USD. Idle: 0.2 x 4 + 4 (the pod-less GPU) = 4.8 USD; node_other 2 USD;
    # 6.8 USD shared 3:1.
    assert direct == {"train": 2_400_000, "serve": 800_000}
    assert shared == {"train": 5_100_000, "serve": 1_700_000}
    assert sum(c.cost_micro_usd for c in result.costs) == result.bill.node_cost_micro_usd == 10_000_000
    assert not [c for c in result.costs if c.subject_kind in (CostSubjectKind.IDLE, CostSubjectKind.NODE_OTHER)]
    lines = {(c.pod_uid, c.shared_from): c for c in result.costs if c.is_shared}
    assert lines[("train", CostSubjectKind.IDLE)].cost_micro_usd == 3_600_000
    assert lines[("train", CostSubjectKind.IDLE)].cost_share == pytest.approx(0.75)
    assert {c.sharing_method for c in lines.values()} == {"weighted"}
    assert all(c.gpu_uuid is None and c.labels == lines[(c.pod_uid, CostSubjectKind.IDLE)].labels
               for c in lines.values())
    assert result.bill.sharing == "idle=weighted,node_other=weighted"
    # The buckets with no cost were kept (not shared): their lines stay, at 0.
    assert {c.subject_kind for c in result.costs if not c.is_shared and c.subject_kind is not CostSubjectKind.POD} \
        == {CostSubjectKind.DRIVER_RESERVED, CostSubjectKind.UNATTRIBUTED, CostSubjectKind.UNAVAILABLE}


def test_even_and_requests():
    shares, p = two_gpus()
    _, even = by_pod(price_node_window(shares, p, SharingPolicy.parse("idle=even,node_other=even")).costs)
    assert even == {"train": 3_400_000, "serve": 3_400_000}
    _, by_requests = by_pod(price_node_window(shares, p, SharingPolicy.parse("all=requests")).costs)
    # train: 4/6 of the CPU + 16/64 of the memory = 11/12; serve: 2/6 + 48/64 = 13/12 -> 11:13 of 6.8 USD.
    assert by_requests == {"train": 3_116_667, "serve": 3_683_333}
    assert sum(by_requests.values()) == 6_800_000


def test_a_degenerate_basis_shares_equally_and_a_window_without_pods_keeps_everything():
    assert share_weights(ShareMethod.WEIGHTED, [0, 0], [PodRequests(), PodRequests()]) == (1, 1)
    assert share_weights(ShareMethod.REQUESTS, [5, 9], [PodRequests(), PodRequests()]) == (1, 1)
    assert share_weights(ShareMethod.REQUESTS, [0, 0], [PodRequests(0, 10), PodRequests(0, 30)]) == (
        Fraction(1, 4), Fraction(3, 4))  # nobody requests CPU: memory alone decides
    empty = node_window([Unit("GPU-0", [bucket(k, 1.0 if k is ShareSubjectKind.IDLE else 0.0) for k in BUCKETS])])
    kept = price_node_window(empty, price(1)).costs
    assert price_node_window(empty, price(1), SharingPolicy.parse("all=weighted")).costs == kept


def test_sharing_is_applied_once():
    shares, p = two_gpus()
    shared = price_node_window(shares, p, SharingPolicy.parse("idle=even")).costs
    with pytest.raises(ValueError):
        apply_sharing(shared, {}, SharingPolicy.parse("idle=even"))


# --------------------------------------------------------------------------------------------------------------
# Conservation, for any node-window and policy


methods = st.sampled_from(list(ShareMethod))
policies = st.builds(SharingPolicy, idle=methods, driver_reserved=methods, unattributed=methods,
                     unavailable=methods, node_other=methods)


@st.composite
def node_windows(draw):
    """1-4 GPUs; pods from a pool of 0-5, each on any of the GPUs (so one pod may hold several); any requests,
    cost shares and price; sometimes a GPU the price bills but no unit reported."""
    pool = [f"pod-{i}" for i in range(draw(st.integers(0, 5)))]
    requests = {uid: (draw(st.integers(0, 64_000)), draw(st.integers(0, 2**40))) for uid in pool}
    gpus = draw(st.integers(1, 4))
    units = []
    for g in range(gpus):
        on = [uid for uid in pool if draw(st.booleans())]
        weights = draw(st.lists(st.integers(0, 1000), min_size=len(on) + 4, max_size=len(on) + 4))
        if not sum(weights):
            weights[len(on)] = 1
        total = sum(weights)
        rows = [requesting(uid, w / total, *requests[uid], team=f"t{int(uid[-1]) % 2}")
                for uid, w in zip(on, weights)]
        rows += [bucket(kind, w / total) for kind, w in zip(BUCKETS, weights[len(on):])]
        units.append(Unit(f"GPU-{g}", rows))
    billed_gpus = gpus + draw(st.integers(0, 1))
    p = price(billed_gpus, str(Fraction(draw(st.integers(0, 9_000_000)), 10**6)),
              str(Fraction(draw(st.integers(0, 9_000_000)), 10**6)))
    covered = draw(st.one_of(st.just(60.0), st.floats(0, 60, allow_nan=False)))
    return node_window(units, covered_seconds=covered), p


@HYPOTHESIS
@given(node_windows(), policies, st.randoms(use_true_random=False))
def test_sharing_conserves_every_micro_dollar_and_moves_only_the_shared_buckets(case, policy, random):
    shares, p = case
    kept = price_node_window(shares, p).costs
    shuffled = list(shares)
    random.shuffle(shuffled)
    result = price_node_window(shuffled, p, policy)
    costs = result.costs
    assert sum(c.cost_micro_usd for c in costs) == result.bill.node_cost_micro_usd == sum(
        c.cost_micro_usd for c in kept)
    assert all(c.cost_micro_usd >= 0 for c in costs)
    assert result.bill.sharing == policy.describe()
    # Independent of the input order.
    assert price_node_window(shares, p, policy).costs == costs

    pods = sorted({c.pod_uid for c in kept if c.subject_kind is CostSubjectKind.POD})
    direct_lines = [c for c in costs if c.subject_kind is CostSubjectKind.POD and not c.is_shared]
    assert direct_lines == [c for c in kept if c.subject_kind is CostSubjectKind.POD]  # direct lines never change
    if not pods:
        assert costs == kept
        return
    direct = {uid: sum(c.cost_micro_usd for c in direct_lines if c.pod_uid == uid) for uid in pods}
    requests = {s.pod_uid: PodRequests(s.cpu_request_millicores, s.memory_request_bytes) for s in shares if s.pod_uid}
    for kind in SHAREABLE_KINDS:
        method = policy.method_for(kind)
        before = [c for c in kept if c.subject_kind is kind]
        after = [c for c in costs if c.subject_kind is kind]
        lines = [c for c in costs if c.shared_from is kind]
        if method is ShareMethod.KEEP or not before:
            assert after == before and not lines
            continue
        assert not after
        total = sum(c.cost_micro_usd for c in before)
        assert [c.pod_uid for c in lines] == pods  # one line per pod, by uid
        assert sum(c.cost_micro_usd for c in lines) == total
        weights = share_weights(method, [direct[u] for u in pods], [requests[u] for u in pods])
        weight_sum = sum(weights)
        for line, weight in zip(lines, weights):
            quota = total * weight / weight_sum
            assert abs(line.cost_micro_usd - quota) < 1, (kind, line.pod_uid)  # largest remainder: floor or ceiling
            assert line.sharing_method == method.value and line.gpu_uuid is None
            if weight == 0:
                assert line.cost_micro_usd == 0
        assert sum(line.cost_share for line in lines) == pytest.approx(1.0)


@HYPOTHESIS
@given(node_windows(), policies)
def test_a_pods_shared_lines_carry_its_identity(case, policy):
    shares, p = case
    costs = price_node_window(shares, p, policy).costs
    first = {}
    for c in costs:
        if c.subject_kind is CostSubjectKind.POD and not c.is_shared:
            first.setdefault(c.pod_uid, c)
    for line in (c for c in costs if c.is_shared):
        pod_line = first[line.pod_uid]
        assert (line.namespace, line.pod_name, dict(line.labels), line.carried_label_keys) == (
            pod_line.namespace, pod_line.pod_name, dict(pod_line.labels), pod_line.carried_label_keys)
        assert replace(line, cost_micro_usd=0).price_version == pod_line.price_version
