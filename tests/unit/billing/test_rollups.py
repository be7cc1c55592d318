"""The ledger's hourly and daily rollups (``services.billing.rollups``): kept by ``Ledger.write`` for exactly the
node-windows it inserts, moved by ``apply_trueup``, backfilled by migration 0009; every grain reconciles to the
minute lines and the node bills to the micro-dollar."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from functools import lru_cache

import pytest
from alembic import command
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import inspect, select

from schemas.records import ShareSubjectKind
from services.billing import rollups
from services.billing.ledger import ROLLUPS, Ledger, _alembic_config, cost_lines, label_sets, node_bills
from services.billing.line_storage import decode_zero_lines
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
    """The rollup rows of ``grain`` recomputed here from what the ledger stores (not by the module's own key
    function): the ``cost_lines`` rows with their label sets and bills, and the zero lines their bills list (no
    cost, a trued-up cost of 0 where the bill is trued up, NULL elsewhere): what the rollups must equal."""
    step = {HOUR: HOUR_MS, DAY: DAY_MS}[grain]
    out = defaultdict(lambda: [0, 0, 0, 0])
    c, b, l = cost_lines.c, node_bills.c, label_sets.c
    with ledger.engine.connect() as connection:
        rows = connection.execute(
            select(cost_lines, l.labels, l.carried_label_keys, b.sharing.label("bill_sharing"),
                   b.gpu_model.label("bill_gpu_model"))
            .select_from(cost_lines.join(label_sets, l.label_set_id == c.label_set_id)
                         .join(node_bills, (b.window_start_unix_ms == c.window_start_unix_ms)
                               & (b.cluster == c.cluster) & (b.node_name == c.node_name)))).all()
        bills = connection.execute(select(node_bills).where(b.zero_lines.is_not(None))).all()
    lines = [dict(row._mapping) for row in rows]
    for bill in bills:
        m = bill._mapping
        for gpu, kind, *_ in decode_zero_lines(m["zero_lines"]):
            lines.append({"window_start_unix_ms": m["window_start_unix_ms"], "cluster": m["cluster"],
                          "node_name": m["node_name"], "bill_gpu_model": m["gpu_model"], "bill_sharing": m["sharing"],
                          "namespace": None, "labels": {}, "subject_kind": kind, "shared_from": "",
                          "sharing_method": "", "carried_label_keys": "", "cost_micro_usd": 0,
                          "trued_cost_micro_usd": None if m["trued_cost_micro_usd"] is None else 0})
    for m in lines:
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


def assert_every_grain_reconciles(ledger, team_key="team"):
    """Hourly = the lines; daily = the lines = the hourly rows of each day; per hour and per day the rollups add up
    to the node bills, list and trued-or-list, to the micro-dollar."""
    hourly, daily = stored(ledger, HOUR), stored(ledger, DAY)
    assert hourly == reference(ledger, HOUR, team_key)
    assert daily == reference(ledger, DAY, team_key) == rollups.roll(hourly, DAY)
    for grain_rows, step in ((hourly, HOUR_MS), (daily, DAY_MS)):
        assert by_period(grain_rows, "cost_micro_usd") == bills_by_period(ledger, step)
        assert by_period(grain_rows, "billed_micro_usd") == bills_by_period(ledger, step, "trued")
    # Every line billing wrote, zero lines included: the count every reader reports.
    assert sum(s.cost_lines for s in daily.values()) == ledger.totals().cost_lines


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


def test_a_trueup_moves_the_rows_its_lines_were_rolled_up_in_whatever_team_label_reconcile_runs_with(tmp_path):
    """Billing rolled the lines up under its team label ("owner"); `gpumeter reconcile` opens the ledger with the
    default ("team"): the trued sums still move in the rows the lines are in -- before, they went to rows keyed
    "team" that no line was in, and the rollups no longer equalled the minute lines."""
    from tests.unit.billing.test_reconcile import FOCUS, run, world

    ledger = Ledger(f"sqlite:///{tmp_path / 'l.sqlite3'}", team_label="owner")
    ledger.migrate()
    results = world()
    # Half the pods carry the billing's label too, so rows keyed "owner" hold values as well as ''.
    costs = [replace(c, labels={**c.labels, "owner": c.labels["team"]}) if "team" in c.labels and i % 2 else c
             for i, c in enumerate(c for r in results for c in r.costs)]
    ledger.write(costs, [r.bill for r in results])
    assert {k.team_key for k in stored(ledger, HOUR)} == {"owner"}
    assert run(ledger, FOCUS)[0] == 0
    trued = stored(ledger, HOUR)
    assert {k.team_key for k in trued} == {"owner"} and sum(s.trued_lines for s in trued.values()) > 0
    assert_every_grain_reconciles(ledger, "owner")
    ledger.close()


def test_a_trueup_refuses_a_node_hour_rolled_up_under_two_team_labels(tmp_path):
    from tests.unit.billing.test_reconcile import FOCUS, run, world

    url = f"sqlite:///{tmp_path / 'l.sqlite3'}"
    results = world()
    half = len(results) // 2
    for team_label, part in (("team", results[:half]), ("owner", results[half:])):
        with Ledger(url, team_label=team_label) as ledger:
            ledger.migrate()
            ledger.write(*everything(part))
    with Ledger(url) as ledger:
        hours = defaultdict(set)
        for key in stored(ledger, HOUR):
            hours[(key.period_start_unix_ms, key.cluster, key.node_name)].add(key.team_key)
        assert any(len(keys) == 2 for keys in hours.values())  # the label changed within a node's hour
        before = stored(ledger, HOUR)
        code, _out, err = run(ledger, FOCUS)
        assert code == 2 and "rolled up under the team labels ['owner', 'team']" in err
        assert stored(ledger, HOUR) == before  # nothing written


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


def test_the_upgrade_backfills_rollups_equal_to_every_line_of_a_ledger_written_at_0007(tmp_path):
    """The recorded ledger of revision 0007 (every line a row, zero lines included, a FOCUS true-up applied),
    upgraded through 0008 (zero lines onto their bills, labels into label sets) to 0009: the rollups sum and count
    every line 0007 stored, the trued ones included."""
    from tests.unit.billing.test_ledger_compact import FIXTURE, ledger_at_0007

    ledger = ledger_at_0007(f"sqlite:///{tmp_path / 'old.sqlite3'}")
    assert ledger.migrate() == Ledger.head_revision() == "0018_bill_ids"
    hourly, daily = stored(ledger, HOUR), stored(ledger, DAY)
    assert hourly == reference(ledger, HOUR) and daily == reference(ledger, DAY) == rollups.roll(hourly, DAY)
    columns = FIXTURE["rows"]["cost_lines"]["columns"]
    old = [dict(zip(columns, values)) for values in FIXTURE["rows"]["cost_lines"]["values"]]
    zero = [r for r in old if r["cost_micro_usd"] == 0 and r["subject_kind"] != "POD"]
    assert zero and any(r["trued_cost_micro_usd"] == 0 for r in zero)  # the fixture has zero lines, trued ones too
    assert sum(s.cost_lines for s in daily.values()) == len(old) == ledger.totals().cost_lines
    assert sum(s.trued_lines for s in daily.values()) == sum(r["trued_cost_micro_usd"] is not None for r in old)
    assert sum(s.cost_micro_usd for s in daily.values()) == sum(r["cost_micro_usd"] for r in old)
    assert sum(s.billed_micro_usd for s in daily.values()) == sum(
        r["cost_micro_usd"] if r["trued_cost_micro_usd"] is None else r["trued_cost_micro_usd"] for r in old)
    assert {k.gpu_model for k in hourly} == {""}  # bills of before 0009 name no GPU model
    assert by_period(hourly, "cost_micro_usd") == bills_by_period(ledger, HOUR_MS)
    assert by_period(hourly, "billed_micro_usd") == bills_by_period(ledger, HOUR_MS, "trued")
    # And it keeps them from there on: a new node-window adds to them.
    ledger.write(*everything(sample_costs(1, start_ms=FIXTURE["end_ms"] + HOUR_MS)))
    assert stored(ledger, HOUR) == reference(ledger, HOUR)
    ledger.close()


def _without_gpu_model(rows):
    out = defaultdict(RollupSums)
    for key, sums in rows.items():
        out[replace(key, gpu_model="")] += sums
    return dict(out)


def test_the_rollups_ledger_write_keeps_equal_the_migrations_backfill_of_the_same_ledger(tmp_path):
    """``add_written`` (from the CostRecords, at write time) and the migration's backfill (from what is stored:
    rows, label sets, zero lines on their bills) agree, zero lines and trued-up ones included: node-windows written
    by ``Ledger.write`` and trued up by ``gpumeter reconcile``, then the rollups dropped (down to 0008) and
    backfilled (up to 0009) -- the same rows (the GPU model aside: going back to 0008 drops it)."""
    from tests.unit.billing.data import make_ledger_0007 as recorded

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    ledger.migrate()
    priced = recorded.results()
    costs, bills = everything(priced)
    assert ledger.write(costs, bills).lines_elided > 0
    assert recorded._reconcile(ledger, recorded.FOCUS).startswith("0\n")
    written = stored(ledger, HOUR), stored(ledger, DAY)
    assert_every_grain_reconciles(ledger)
    assert sum(s.cost_lines for s in written[1].values()) == len(costs) == ledger.totals().cost_lines
    # Zero lines of trued-up node-windows count as trued lines (their trued-up cost reads 0).
    assert any(s.trued_lines and not s.cost_micro_usd and k.subject_kind != "POD" for k, s in written[0].items())
    with ledger.engine.begin() as connection:
        command.downgrade(_alembic_config(connection), "0008_compact_lines")
        assert not {"cost_rollup_hourly", "cost_rollup_daily"} & set(inspect(connection).get_table_names())
        command.upgrade(_alembic_config(connection), "head")
    backfilled = stored(ledger, HOUR), stored(ledger, DAY)
    assert backfilled == (_without_gpu_model(written[0]), _without_gpu_model(written[1]))
    assert backfilled[0] == reference(ledger, HOUR)
    ledger.close()
