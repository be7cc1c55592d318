"""``gpumeter reconcile`` on the ledger's production path, a real PostgreSQL server (session fixture
``postgres_url``): the bill's machines trued up exactly, nothing changed by a second run, an amended bill replacing
the trued-up cost, the list price untouched."""

from __future__ import annotations

import pytest

from services.billing.ledger import Ledger
from tests.integration.test_ledger_postgres import database_url  # noqa: F401 (the fixture, used by name)
from tests.unit.billing.test_reconcile import (
    FOCUS,
    FOCUS_AMENDED,
    ON_DEMAND,
    ON_DEMAND_BILLED,
    SPOT,
    SPOT_BILLED,
    T10,
    list_columns,
    run,
    snapshot,
    trued_by_machine,
    world,
)

pytestmark = pytest.mark.postgres


def test_a_bill_trues_the_postgres_ledger_up_once_and_an_amended_bill_replaces_it(database_url):  # noqa: F811
    ledger = Ledger(database_url)
    ledger.migrate()
    try:
        results = world()
        ledger.write([c for r in results for c in r.costs], [r.bill for r in results])
        before = list_columns(ledger)
        code, out, err = run(ledger, FOCUS)
        assert code == 0, err
        machines = trued_by_machine(ledger)
        assert sum(v for v in machines[SPOT] if v is not None) == SPOT_BILLED
        assert sum(machines[ON_DEMAND]) == ON_DEMAND_BILLED
        first = snapshot(ledger)
        _, out, _ = run(ledger, FOCUS, now_ms=T10 + 2 * 86_400_000)
        assert "ledger: 0 node-windows and 0 cost lines changed" in out
        assert snapshot(ledger) == first
        run(ledger, FOCUS_AMENDED, now_ms=T10 + 3 * 86_400_000)
        assert sum(v for v in trued_by_machine(ledger)[SPOT] if v is not None) == SPOT_BILLED - 123_400
        assert [r["bill_name"] for r in ledger.trueup_runs()] == ["focus_1_0_aws.csv", "focus_1_0_aws_amended.csv"]
        assert list_columns(ledger) == before
    finally:
        ledger.close()
