"""The ledger keeps a pod's direct and shared lines apart (migration 0006): round trip, upgrade, publishing."""

from __future__ import annotations

import pytest
from alembic import command
from sqlalchemy import text

from schemas.records import CostSubjectKind
from services.billing.ledger import Ledger, LedgerError, _alembic_config
from tests.unit.billing.conftest import sample_costs

SHARING = "idle=weighted,unattributed=even,node_other=weighted"  # as the policy describes itself


def everything(results):
    return [c for r in results for c in r.costs], [r.bill for r in results]


def key(c):
    return (c.window_start_unix_ms, c.node_name, c.gpu_uuid or "", c.subject_kind.value, c.pod_uid or "",
            c.shared_from or "")


def test_shared_lines_round_trip_and_a_redelivery_bills_nothing_twice(sqlite_ledger):
    results = sample_costs(2, sharing=SHARING)
    costs, bills = everything(results)
    shared = [c for c in costs if c.is_shared]
    # A pod has a shared line per shared bucket beside its direct lines: the key tells them apart.
    assert shared and {(c.shared_from, c.sharing_method) for c in shared} == {
        (CostSubjectKind.IDLE, "weighted"), (CostSubjectKind.NODE_OTHER, "weighted"),
        (CostSubjectKind.UNATTRIBUTED, "even")}
    first = sqlite_ledger.write(costs, bills)
    assert (first.bills_written, first.lines_written) == (len(bills), len(costs))
    stored = list(sqlite_ledger.iter_cost_lines())
    assert sorted(stored, key=key) == sorted(costs, key=key)
    assert {row["sharing"] for row in sqlite_ledger.bills()} == {SHARING}
    again = sqlite_ledger.write(costs, bills)
    assert (again.bills_written, again.lines_written, again.lines_skipped) == (0, 0, len(costs))
    totals = sqlite_ledger.totals()
    assert totals.cost_micro_usd == totals.bill_micro_usd == sum(b.node_cost_micro_usd for b in bills)
    assert set(totals.by_subject_kind) == {"POD", "DRIVER_RESERVED", "UNAVAILABLE"}  # the kept buckets
    sources = {(r.shared_from, r.sharing_method): r.cost_micro_usd for r in sqlite_ledger.shared_by_source()}
    assert sources == {(k.value, m): sum(c.cost_micro_usd for c in shared if (c.shared_from, c.sharing_method)
                                         == (k, m))
                       for k, m in {(c.shared_from, c.sharing_method) for c in shared}}
    assert sqlite_ledger.sharing_policies() == ((SHARING, len(bills)),)


def test_another_costing_of_a_stored_window_is_never_published_as_if_it_were_the_stored_one(sqlite_ledger):
    """A node-window written, then redelivered after billing was restarted with another sharing policy: the
    ledger keeps the first costing, and the second's records (other lines) are not published in its name."""
    kept = sample_costs(1)
    sqlite_ledger.write(*everything(kept))
    shared = sample_costs(1, sharing=SHARING)
    result = sqlite_ledger.write(*everything(shared))
    assert result.bills_written == 0 and not result.unpublished
    assert sqlite_ledger.write(*everything(kept)).unpublished == {r.bill.key for r in kept}


def _revision_0005(url: str) -> Ledger:
    ledger = Ledger(url)
    with ledger.engine.begin() as connection:
        command.upgrade(_alembic_config(connection), "0005_carried_label_keys")
    return ledger


def test_the_upgrade_keeps_every_line_as_a_direct_one_and_every_bill_as_kept(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.sqlite3'}"
    ledger = _revision_0005(url)
    with ledger.engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO price_versions VALUES ('v1', 'aws', 'us-east-1', 'g6.xlarge', 'on_demand', '0.8048', 1, "
            "'0.5976', '0.2072', 'marginal', 'test', 'test')"))
        connection.execute(text(
            "INSERT INTO node_bills (window_start_unix_ms, cluster, node_name, window_seconds, billed_milliseconds, "
            "provider, region, instance_type, price_model, gpu_count, node_cost_micro_usd, gpu_cost_micro_usd, "
            "node_other_micro_usd, price_version) VALUES (60000, 'c', 'n', 60, 60000, 'aws', 'us-east-1', "
            "'g6.xlarge', 'on_demand', 1, 13413, 9960, 3453, 'v1')"))
        for gpu, kind, pod, cost in (("GPU-0", "POD", "p", 9000), ("GPU-0", "IDLE", "", 960), ("", "NODE_OTHER", "",
                                                                                              3453)):
            connection.execute(text(
                "INSERT INTO cost_lines (window_start_unix_ms, cluster, node_name, gpu_uuid, subject_kind, pod_uid, "
                "window_seconds, labels, cost_share, cost_micro_usd, instance_type, price_model, price_version) "
                f"VALUES (60000, 'c', 'n', '{gpu}', '{kind}', '{pod}', 60, '{{}}', 1.0, {cost}, 'g6.xlarge', "
                "'on_demand', 'v1')"))
    assert ledger.migrate() == Ledger.head_revision() == "0018_bill_ids"
    lines = list(ledger.iter_cost_lines())
    assert [(c.subject_kind, c.shared_from, c.sharing_method, c.method, c.gpu_fraction) for c in lines] == [
        (CostSubjectKind.NODE_OTHER, None, "", "", 0.0), (CostSubjectKind.IDLE, None, "", "", 0.0),
        (CostSubjectKind.POD, None, "", "", 0.0)]
    assert [b["sharing"] for b in ledger.bills()] == ["keep"]
    assert ledger.totals().cost_micro_usd == ledger.totals().bill_micro_usd == 13413
    # The key now has room for the pod's shared line beside its direct ones.
    with ledger.engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO cost_lines (window_start_unix_ms, cluster, node_name, gpu_uuid, subject_kind, pod_uid, "
            "window_seconds, cost_share, cost_micro_usd, shared_from, sharing_method) VALUES (60000, 'c', 'n', "
            "'GPU-0', 'POD', 'p', 60, 1.0, 0, 'IDLE', 'weighted')"))
    # A ledger holding shared lines cannot go back to a key that has no room for them.
    with ledger.engine.begin() as connection, pytest.raises(RuntimeError, match="shared cost lines"):
        command.downgrade(_alembic_config(connection), "0005_carried_label_keys")
    ledger.close()


def test_a_ledger_without_shared_lines_downgrades(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'round.sqlite3'}")
    ledger.migrate()
    ledger.write(*everything(sample_costs(1)))
    with ledger.engine.begin() as connection:
        command.downgrade(_alembic_config(connection), "0005_carried_label_keys")
    assert ledger.current_revision() == "0005_carried_label_keys"
    with pytest.raises(LedgerError):
        ledger.require_schema()
    assert ledger.migrate() == "0018_bill_ids"
    assert ledger.totals().cost_micro_usd == ledger.totals().bill_micro_usd
    ledger.close()
