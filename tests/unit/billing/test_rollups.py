"""The ledger's hourly and daily rollups (``services.billing.rollups``): kept by ``Ledger.write`` for exactly the
node-windows it inserts, moved by ``apply_trueup``, backfilled by migration 0009; every grain reconciles to the
minute lines and the node bills to the micro-dollar."""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache

import pytest
from alembic import command
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import insert, select

from schemas.records import ShareSubjectKind
from services.billing import rollups
from services.billing.ledger import (ROLLUPS, Ledger, _alembic_config, _bill_row, _line_row, cost_lines, node_bills,
                                     price_versions)
from services.billing.rollups import DAY, DAY_MS, HOUR, HOUR_MS, RollupKey, RollupSums
from tests.unit.billing.conftest import WINDOW_START_MS, Row, Unit, bucket, node_window, sample_costs

DAY0 = WINDOW_START_MS - WINDOW_START_MS % DAY_MS


@lru_cache(maxsize=1)
def catalog():
    from services.billing.catalog import PriceCatalog

    return PriceCatalog.load()


def everything(results):
    return [c for r in results for c in r.costs], [r.bill for r in results]


def reference(ledger, grain, team_key="team"):
    """The rollup rows of ``grain`` recomputed here from the stored cost lines and their bills (not by the module's
    own key function): what the rollups must equal."""
    step = {HOUR: HOUR_MS, DAY: DAY_MS}[grain]
    out = defaultdict(lambda: [0, 0, 0, 0])
    c, b = cost_lines.c, node_bills.c
    with ledger.engine.connect() as connection:
        rows = connection.execute(
            select(cost_lines, b.sharing.label("bill_sharing"), b.gpu_model.label("bill_gpu_model"))
            .select_from(cost_lines.join(node_bills, (b.window_start_unix_ms == c.window_start_unix_ms)
                                         & (b.cluster == c.cluster) & (b.node_name == c.node_name)))).all()
    for row in rows:
        m = row._mapping
        labels = m["labels"]
        key = RollupKey(m["window_start_unix_ms"] // step * step, m["cluster"], m["node_name"], m["bill_gpu_model"],
                        m["bill_sharing"], m["namespace"] or "", team_key, labels.get(team_key, ""),
                        team_key in labels, m["subject_kind"], m["shared_from"], m["sharing_method"],
                        m["carried_label_keys"])
        trued = m["trued_cost_micro_usd"]
        sums = out[key]
        sums[0] += m["cost_micro_usd"]
        sums[1] += m["cost_micro_usd"] if trued is None else trued
        sums[2] += 1
        sums[3] += trued is not None
    return {key: RollupSums(*sums) for key, sums in out.items()}


def stored(ledger, grain):
    return rollups.rows_of(ledger._read, ROLLUPS.by_grain[grain])


def bills_by_period(ledger, step, cost="list"):
    out = defaultdict(int)
    for bill in ledger.bills():
        micro = bill["node_cost_micro_usd"] if cost == "list" or bill["trued_cost_micro_usd"] is None else \
            bill["trued_cost_micro_usd"]
        out[bill["window_start_unix_ms"] // step * step] += micro
    return dict(out)


def by_period(rows, field):
    out = defaultdict(int)
    for key, sums in rows.items():
        out[key.period_start_unix_ms] += getattr(sums, field)
    return dict(out)


def assert_every_grain_reconciles(ledger):
    """Hourly = the lines; daily = the lines = the hourly rows of each day; per hour and per day the rollups add up
    to the node bills, list and trued-or-list, to the micro-dollar."""
    hourly, daily = stored(ledger, HOUR), stored(ledger, DAY)
    assert hourly == reference(ledger, HOUR)
    assert daily == reference(ledger, DAY) == rollups.roll(hourly, DAY)
    for grain_rows, step in ((hourly, HOUR_MS), (daily, DAY_MS)):
        assert by_period(grain_rows, "cost_micro_usd") == bills_by_period(ledger, step)
        assert by_period(grain_rows, "billed_micro_usd") == bills_by_period(ledger, step, "trued")


def test_rollups_are_the_lines_of_the_written_node_windows_and_a_redelivery_adds_nothing(sqlite_ledger):
    # 90 minutes from 23:20 UTC: two hours across midnight, two days.
    start = DAY0 + DAY_MS - 40 * 60_000
    results = sample_costs(90, start_ms=start, sharing="idle=weighted")
    costs, bills = everything(results)
    first = sqlite_ledger.write(costs[: len(costs) // 2], bills[: len(bills) // 2])
    assert first.bills_written == len(bills) // 2
    sqlite_ledger.write(costs, bills)
    before = stored(sqlite_ledger, HOUR), stored(sqlite_ledger, DAY)
    again = sqlite_ledger.write(costs, bills)
    assert again.bills_written == 0
    assert (stored(sqlite_ledger, HOUR), stored(sqlite_ledger, DAY)) == before
    assert_every_grain_reconciles(sqlite_ledger)
    hourly = before[0]
    assert {k.period_start_unix_ms for k in hourly} == {DAY0 + DAY_MS - HOUR_MS, DAY0 + DAY_MS}
    assert {k.period_start_unix_ms for k in before[1]} == {DAY0, DAY0 + DAY_MS}
    assert {k.gpu_model for k in hourly} == {"NVIDIA A100-SXM4-40GB"}
    assert {(k.team, k.has_team) for k in hourly if k.subject_kind == "POD"} == {
        ("research", True), ("prod", True), ("", False)}
    assert sum(s.cost_lines for s in hourly.values()) == len(costs)


def test_a_write_that_fails_adds_nothing_to_the_rollups(sqlite_ledger):
    results = sample_costs(2)
    costs, bills = everything(results)
    broken = [c for c in costs if c is not costs[0]]  # the first node-window no longer adds up to its bill
    with pytest.raises(Exception):
        sqlite_ledger.write(broken, bills)
    assert stored(sqlite_ledger, HOUR) == {} == stored(sqlite_ledger, DAY)


def test_the_team_label_is_the_ledgers_setting(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.sqlite3'}", team_label="model")
    ledger.migrate()
    ledger.write(*everything(sample_costs(2)))
    rows = stored(ledger, HOUR)
    assert {k.team_key for k in rows} == {"model"}
    assert {k.team for k in rows if k.has_team} == {"llama"}
    assert rows == reference(ledger, HOUR, "model")
    ledger.close()


def test_a_trueup_moves_the_trued_sums_of_the_rollups_with_its_lines(sqlite_ledger):
    from tests.unit.billing.test_reconcile import FOCUS, FOCUS_AMENDED, run, world

    sqlite_ledger.write(*everything(world()))
    listed = stored(sqlite_ledger, HOUR)
    assert run(sqlite_ledger, FOCUS)[0] == 0
    trued = stored(sqlite_ledger, HOUR)
    assert sum(s.trued_lines for s in trued.values()) > 0
    assert {k: s.cost_micro_usd for k, s in trued.items()} == {k: s.cost_micro_usd for k, s in listed.items()}
    assert_every_grain_reconciles(sqlite_ledger)
    # An amended bill replaces the trued values; applying the first again restores them exactly.
    run(sqlite_ledger, FOCUS_AMENDED, now_ms=WINDOW_START_MS + 2 * DAY_MS)
    assert_every_grain_reconciles(sqlite_ledger)
    run(sqlite_ledger, FOCUS, now_ms=WINDOW_START_MS + 3 * DAY_MS)
    assert stored(sqlite_ledger, HOUR) == trued
    assert_every_grain_reconciles(sqlite_ledger)


# -- the property: random bills, random batches, redeliveries ---------------------------------------------------

_NAMESPACES = st.sampled_from(["ml", "serving", "dev", None])
_TEAMS = st.sampled_from([None, "research", "prod", ""])
_POLICIES = st.sampled_from(["keep", "idle=weighted", "all=even", "idle=even,node_other=weighted"])


@st.composite
def node_windows(draw):
    """A random node-window's share rows: 1-3 GPUs, each with 0-3 pods and idle taking the rest."""
    node = draw(st.sampled_from(["n1", "n2", "n3"]))
    minute = draw(st.integers(0, 3 * 24 * 60 - 1))
    units = []
    for gpu in range(draw(st.integers(1, 3))):
        weights = draw(st.lists(st.integers(1, 3), max_size=3))  # at most 9 tenths: idle takes the rest
        rows = []
        for index, weight in enumerate(weights):
            team = draw(_TEAMS)
            labels = {} if team is None else {"team": team}
            rows.append(Row(ShareSubjectKind.POD, weight / 10, f"{node}-{gpu}-{index}", draw(_NAMESPACES), labels))
        rest = 10 - sum(weights)
        if rest:
            rows.append(bucket(draw(st.sampled_from([ShareSubjectKind.IDLE, ShareSubjectKind.UNATTRIBUTED])),
                               rest / 10))
        units.append(Unit(f"GPU-{node}-{gpu}", rows))
    model = {"n1": "NVIDIA A100-SXM4-40GB", "n2": "NVIDIA H100 80GB HBM3", "n3": "NVIDIA A100-SXM4-40GB"}[node]
    return node_window(units, node=node, window_start_ms=DAY0 + minute * 60_000, gpu_model=model,
                       covered_seconds=float(draw(st.integers(1, 60))))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(windows=st.lists(node_windows(), min_size=1, max_size=12), policy=_POLICIES,
       cuts=st.lists(st.integers(0, 12), max_size=3), redeliver=st.lists(st.integers(0, 11), max_size=4))
def test_every_grain_reconciles_to_the_bills_for_random_bills_batches_and_redeliveries(windows, policy, cuts,
                                                                                      redeliver):
    from services.billing.costing import bill_node_window
    from services.billing.pricing import DEFAULT_SPLIT_POLICY
    from services.billing.sharing import SharingPolicy

    sharing = SharingPolicy.parse(policy)
    results = [bill_node_window(shares, catalog(), DEFAULT_SPLIT_POLICY, sharing) for shares in windows]
    unique = list({r.bill.key: r for r in results}.values())
    ledger = Ledger("sqlite://")
    ledger.migrate()
    edges = sorted({0, len(unique), *(min(c, len(unique)) for c in cuts)})
    for a, b in zip(edges, edges[1:]):
        # New node-windows with redelivered ones written before: only the new ones are rolled up.
        redelivered = [unique[i] for i in sorted(set(redeliver)) if i < a]
        assert ledger.write(*everything(unique[a:b] + redelivered)).bills_written == b - a
        # A redelivery alone: skipped, never added twice.
        again = [unique[i] for i in sorted(set(redeliver)) if i < b]
        if again:
            assert ledger.write(*everything(again)).bills_written == 0
    assert_every_grain_reconciles(ledger)
    assert sum(s.cost_lines for s in stored(ledger, DAY).values()) == sum(len(r.costs) for r in unique)
    ledger.close()


# -- migration 0009: the rollups of a ledger written before them ------------------------------------------------


def test_the_upgrade_backfills_rollups_equal_to_the_lines_of_a_ledger_written_at_0007(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'old.sqlite3'}")
    with ledger.engine.begin() as connection:
        command.upgrade(_alembic_config(connection), "0007_sharing")
    start = DAY0 + DAY_MS - 30 * 60_000
    results = sample_costs(70, start_ms=start, sharing="idle=weighted,node_other=even")
    costs, bills = everything(results)
    with ledger.engine.begin() as connection:
        # What Ledger.write stored at 0007: the same rows, without the columns of 0009.
        connection.execute(insert(price_versions), list({b.price_version: b.price.describe() for b in bills}.values()))
        connection.execute(insert(node_bills),
                           [{k: v for k, v in _bill_row(b).items() if k != "gpu_model"} for b in bills])
        connection.execute(insert(cost_lines), [_line_row(c) for c in costs])
        # A line trued up before the upgrade keeps its trued value in the rollups' trued sums.
        first = costs[0]
        connection.execute(cost_lines.update().where(
            cost_lines.c.window_start_unix_ms == first.window_start_unix_ms, cost_lines.c.node_name == first.node_name,
            cost_lines.c.gpu_uuid == (first.gpu_uuid or ""), cost_lines.c.subject_kind == first.subject_kind.value,
            cost_lines.c.pod_uid == (first.pod_uid or ""), cost_lines.c.shared_from == "")
            .values(trued_cost_micro_usd=first.cost_micro_usd + 7))
    assert ledger.migrate() == Ledger.head_revision()
    hourly, daily = stored(ledger, HOUR), stored(ledger, DAY)
    assert hourly == reference(ledger, HOUR) and daily == reference(ledger, DAY) == rollups.roll(hourly, DAY)
    assert sum(s.billed_micro_usd - s.cost_micro_usd for s in daily.values()) == 7
    assert sum(s.trued_lines for s in daily.values()) == 1
    assert {k.gpu_model for k in hourly} == {""}  # bills of before 0009 name no GPU model
    assert by_period(hourly, "cost_micro_usd") == bills_by_period(ledger, HOUR_MS)
    # And it keeps them from there on: a new node-window adds to them.
    ledger.write(*everything(sample_costs(1, start_ms=start + 70 * 60_000)))
    assert stored(ledger, HOUR) == reference(ledger, HOUR)
    ledger.close()
