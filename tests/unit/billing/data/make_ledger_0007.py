"""Records ``ledger_0007.json``: a ledger written by the code of revision 0007 (commit 285f5cf, before migration
0008), its rows and what its readers answered. Run it on that commit's code (this reproduces the file byte for
byte):

    mkdir /tmp/g7 && git archive 285f5cf | tar -x -C /tmp/g7
    cp tests/unit/billing/ledger_outputs.py /tmp/g7/tests/unit/billing/
    mkdir /tmp/g7/tests/unit/billing/data
    cp tests/unit/billing/data/__init__.py tests/unit/billing/data/make_ledger_0007.py /tmp/g7/tests/unit/billing/data/
    cd /tmp/g7 && PYTHONPATH=/tmp/g7 python tests/unit/billing/data/make_ledger_0007.py OUT.json

The ledger: node-windows with zero-cost bucket lines (cost and every share 0), a MIG node, pods with and without
labels (carried label keys), a node-window shared by a sharing policy, and a FOCUS true-up applied by
``gpumeter reconcile``; then the amended bill's reconcile output as a second answer (``amended``)."""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

from sqlalchemy import select

from gpumeter.clock import ManualClock
from schemas.records import ShareSubjectKind
from services.billing import reconcile
from services.billing.catalog import PriceCatalog
from services.billing.costing import bill_node_window
from services.billing.ledger import Ledger, cost_lines, node_bills, price_versions, trueups
from services.billing.sharing import SharingPolicy
from tests.unit.billing.conftest import Row, Unit, bucket, node_window, pod
from tests.unit.billing.ledger_outputs import output_digests

REPO = Path(__file__).resolve().parents[4]
FOCUS = REPO / "tests" / "fixtures" / "bills" / "focus_1_0_aws.csv"
FOCUS_AMENDED = REPO / "tests" / "fixtures" / "bills" / "focus_1_0_aws_amended.csv"
T10 = 1_794_304_800_000  # 2026-11-10T10:00:00Z, the fixture bills' day
WINDOW_S = 300
SPOT = "aws:///us-east-1a/i-0a1b2c3d4e5f60001"
ON_DEMAND = "aws:///us-east-1b/i-0a1b2c3d4e5f60002"
MIG = "aws:///us-east-1c/i-0a1b2c3d4e5f60009"
START_MS, END_MS = T10 - 3_600_000, T10 + 6 * 3_600_000
TABLES = (price_versions, node_bills, cost_lines, trueups)


def _zero(kind: ShareSubjectKind) -> Row:
    return bucket(kind, 0.0)


def _windows(node, provider_id, count, *, units, **facts):
    out = []
    for index in range(count):
        shares = node_window(units, node=node, window_start_ms=T10 + index * WINDOW_S * 1000,
                             window_seconds=WINDOW_S, covered_seconds=WINDOW_S - (index % 3) * 7.5, **facts)
        out.append(tuple(replace(s, provider_id=provider_id, zone=provider_id.split("/")[3]) for s in shares))
    return out


def results():
    catalog = PriceCatalog.load(spot_discounts={"aws": Decimal("0.6")})
    spot = [pod("train-a", 0.6, "ml", team="research", model="llama"), pod("notebook-a", 0.3, "ml"),
            bucket(ShareSubjectKind.IDLE, 0.1), _zero(ShareSubjectKind.DRIVER_RESERVED),
            _zero(ShareSubjectKind.UNATTRIBUTED), _zero(ShareSubjectKind.UNAVAILABLE)]
    on_demand = [pod("serve-b", 0.55, "serving", team="prod"), pod("batch-b", 0.4, "ml", team="research"),
                 bucket(ShareSubjectKind.IDLE, 0.05), _zero(ShareSubjectKind.UNAVAILABLE),
                 _zero(ShareSubjectKind.UNATTRIBUTED)]
    od_units = [Unit(f"GPU-od-{i:04d}", [replace(r, pod_uid=f"{r.pod_uid}-{i}" if r.pod_uid else None)
                                         for r in on_demand]) for i in range(8)]
    mig_units = [Unit("MIG-a-0", [pod("mig-x", 0.8, "ml", team="research"), bucket(ShareSubjectKind.IDLE, 0.2),
                                  _zero(ShareSubjectKind.UNAVAILABLE)], parent="GPU-mig-0", fraction=3 / 7),
                 Unit("MIG-a-1", [bucket(ShareSubjectKind.IDLE, 1.0), _zero(ShareSubjectKind.DRIVER_RESERVED),
                                  _zero(ShareSubjectKind.UNAVAILABLE)], parent="GPU-mig-0", fraction=4 / 7)]
    keep = (_windows("gpu-spot-a", SPOT, 8, units=[Unit("GPU-spot-0", spot)], instance_type="g5.xlarge",
                     price_model="spot", gpu_model="NVIDIA A10G")
            + _windows("gpu-od-b", ON_DEMAND, 4, units=od_units))
    shared = _windows("gpu-mig-c", MIG, 4, units=mig_units)
    policy = SharingPolicy.parse("idle=weighted,unattributed=even")
    return ([bill_node_window(s, catalog) for s in keep]
            + [bill_node_window(s, catalog, sharing=policy) for s in shared])


def _reconcile(ledger: Ledger, bill: Path) -> str:
    parser = argparse.ArgumentParser()
    reconcile.add_arguments(parser)
    args = parser.parse_args(["--bill", str(bill), "--ledger-url", ledger.url])
    out, err = io.StringIO(), io.StringIO()
    code = reconcile.main(args, {}, clock=ManualClock(T10 + 86_400_000), out=out, err=err)
    return f"{code}\n{out.getvalue()}\n{err.getvalue()}"


def _rows(ledger: Ledger) -> dict[str, list[dict]]:
    with ledger.engine.connect() as connection:
        return {t.name: {"columns": [c.name for c in t.columns],
                         "values": [list(r) for r in connection.execute(select(t).order_by(*t.primary_key.columns))]}
                for t in TABLES}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Ledger(f"sqlite:///{tmp}/ledger.sqlite3")
        assert ledger.migrate() == "0007_sharing"
        priced = results()
        ledger.write([c for r in priced for c in r.costs], [r.bill for r in priced])
        first = _reconcile(ledger, FOCUS)
        record = {"revision": ledger.migrate(), "start_ms": START_MS, "end_ms": END_MS, "rows": _rows(ledger),
                  "reconcile": first, "outputs": output_digests(ledger, START_MS, END_MS)}
        record["amended"] = {"reconcile": _reconcile(ledger, FOCUS_AMENDED),
                             "outputs": output_digests(ledger, START_MS, END_MS)}
        ledger.close()
    Path(sys.argv[1]).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
