"""The FOCUS export passes the FinOps Foundation's validator (``focus-validator`` 1.0.0, FOCUS 1.0 rules).

The validator runs in a virtualenv of its own, built once per machine from the project's wheel cache
(``.cache/venvs/focus-validator-1.0.0``; ``focus_validator_constraints.txt`` says why it cannot share the project's).
Its CSV and Parquet inputs are exports of the demo scenario billed through the real chain (simulated collector,
attributor engine, billing, SQLite ledger), with every bucket kept and with idle and node_other shared.

focus-validator 1.0.0's "1.0" rule set still names four columns by their FOCUS 1.0-preview names (``ResourceID``,
``InvoiceIssuer``, ``Provider``, ``Publisher``; FOCUS 1.0 renamed them ``ResourceId``, ``InvoiceIssuerName``,
``ProviderName``, ``PublisherName`` -- ``specification/columns/*.md`` at FOCUS_Spec tag v1.0) and its
``SkuPriceId_Nullable`` query reads the 1.0-preview column ``ChargeType`` (``ChargeCategory`` in 1.0: "MUST NOT be
null when ChargeClass is not Correction and ChargeCategory is Usage or Purchase"). An export in FOCUS 1.0's names
therefore fails exactly those five checks, which the first test proves; the others run the validator's own rule
files with exactly those names corrected (``PATCHES``), every other rule as shipped, and require it to pass. A row
made wrong on purpose must fail it, so the validator is seen to validate.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from gpumeter.devtools.cache import cache_dir, wheels_dir

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = Path(__file__).with_name("focus_validator_constraints.txt")
VALIDATOR = "focus-validator==1.0.0"
DEMO = REPO / "scenarios" / "demo.yaml"
# focus-validator 1.0.0's 1.0 rule files: FOCUS 1.0-preview column name -> FOCUS 1.0 column name.
RENAMED = {"ResourceID": "ResourceId", "InvoiceIssuer": "InvoiceIssuerName", "Provider": "ProviderName",
           "Publisher": "PublisherName"}
SKU_PRICE_QUERY = ("SELECT CASE\n"
                   "    WHEN ChargeCategory IN ('Purchase', 'Usage') AND (ChargeClass IS NULL OR ChargeClass <> "
                   "'Correction') AND SkuPriceId IS NULL THEN FALSE\n"
                   "    ELSE TRUE\n"
                   "END AS check_output\n"
                   "FROM df;\n")
PREVIEW_FAILURES = {"InvoiceIssuer_Required", "Provider_Required", "Publisher_Required", "ResourceID_Required",
                    "SkuPriceId_Nullable"}


@pytest.fixture(scope="session")
def validator_venv() -> Path:
    """A virtualenv with focus-validator 1.0.0 (built once; reused while its stamp is there)."""
    from gpumeter.devtools.pip_install import install

    venv = cache_dir() / "venvs" / "focus-validator-1.0.0"
    stamp = venv / ".installed-stamp"
    if stamp.is_file() and stamp.read_text() == CONSTRAINTS.read_text():
        return venv
    building = venv.with_name(venv.name + f".building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(building)], check=True)
    python = str(building / "bin" / "python")
    code = install(["-c", str(CONSTRAINTS), VALIDATOR, "multimethod<1.11", "poetry-core"],
                   label="focus-validator", wheels=wheels_dir(), python=python, project_root=REPO)
    assert code == 0, "installing focus-validator failed (see the output above)"
    (building / ".installed-stamp").write_text(CONSTRAINTS.read_text())
    shutil.rmtree(venv, ignore_errors=True)
    building.rename(venv)  # the venv's scripts use absolute paths: run it as `python -m`, never its scripts
    return venv


def _site_packages(venv: Path) -> Path:
    (found,) = (venv / "lib").glob("python3*/site-packages")
    return found


@pytest.fixture(scope="session")
def patched_rules(validator_venv, tmp_path_factory) -> Path:
    """The validator's own rule sets with the five 1.0-preview leftovers corrected to FOCUS 1.0's names."""
    shipped = _site_packages(validator_venv) / "focus_validator" / "rules" / "version_sets"
    rules = tmp_path_factory.mktemp("focus-rules") / "version_sets"
    shutil.copytree(shipped, rules)
    changed = []
    for path in sorted((rules / "1.0").glob("*.yaml")):
        text = path.read_text()
        for old, new in RENAMED.items():
            if f"column_id: {old}\n" in text:
                text = text.replace(f"column_id: {old}\n", f"column_id: {new}\n")
                changed.append(path.name)
        if "ChargeType" in text:
            head, _, _ = text.partition("  sql_query: |\n")
            text = head.replace("ChargeType", "ChargeCategory") + "  sql_query: |\n" + "".join(
                f"    {line}\n" for line in SKU_PRICE_QUERY.splitlines())
            changed.append(path.name)
        path.write_text(text)
    # Exactly the files of those names and that query, nothing else.
    assert sorted(changed) == sorted([f"{old}_{check}.yaml" for old in RENAMED
                                      for check in ("IsString", "Required", "NotNull" if old != "ResourceID"
                                                    else "Nullable")] + ["SkuPriceId_Nullable.yaml"])
    return rules


def validate(venv: Path, data: Path, tmp_path: Path, rules: Path | None = None) -> tuple[set[str], int, str]:
    """Run the validator on ``data``; (failed or errored check names, checks run (none skipped), its output)."""
    report = tmp_path / f"{data.stem}-{'patched' if rules else 'shipped'}.xml"
    argv = [str(venv / "bin" / "python"), "-m", "focus_validator.main", "--data-file", str(data),
            "--validate-version", "1.0", "--output-type", "unittest", "--output-destination", str(report)]
    if rules is not None:
        argv += ["--rule-set-path", str(rules)]
    # Its currency-code list is read from a path relative to the working directory (focus_validator/utils/...).
    done = subprocess.run(argv, cwd=_site_packages(venv), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    cases = ElementTree.parse(report).getroot().iter("testcase")
    failed, ran = set(), 0
    for case in cases:
        ran += 1
        assert case.find("skipped") is None, case.get("name")
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(case.get("name", "").split(" :: ")[0].split(" - ")[0].strip())
    return failed, ran, done.stdout + done.stderr


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """The demo scenario billed through the real chain into a ledger, exported as FOCUS CSV and Parquet, with every
    bucket kept and with idle and node_other shared, at the minute grain and at the hourly one (``-hour``)."""
    from schemas.records import PodEvent
    from services.attributor.engine import AttributionEngine, EngineConfig
    from pipeline.recordings import scenario_records
    from services.billing.catalog import bundled_catalog
    from services.billing.costing import bill_node_window
    from services.billing.export import focus_dataset, focus_hour_chunks
    from services.billing.focus import focus_csv, write_focus_parquet
    from services.billing.ledger import Ledger
    from services.billing.pricing import DEFAULT_SPLIT_POLICY
    from services.billing.sharing import SharingPolicy
    from simulator.scenario import load_scenario

    folder = tmp_path_factory.mktemp("focus-exports")
    engine = AttributionEngine(EngineConfig(window_seconds=60, grace_seconds=10))
    windows = []
    for item in scenario_records(load_scenario(DEMO)):
        if isinstance(item.message, PodEvent):
            engine.on_pod_event(item.message)
            continue
        output = engine.on_sample(item.message, item.received_at_unix_ms)
        windows += [w.shares for w in output.windows]
        if output.windows:
            engine.record_emitted(output.windows)
            engine.take_table_changes()
    files = {}
    for name, sharing in (("kept", "keep"), ("shared", "idle=weighted,node_other=weighted")):
        ledger = Ledger(f"sqlite:///{folder / name}.sqlite3")
        ledger.migrate()
        priced = [bill_node_window(w, bundled_catalog(), DEFAULT_SPLIT_POLICY, SharingPolicy.parse(sharing))
                  for w in windows]
        ledger.write([c for p in priced for c in p.costs], [p.bill for p in priced])
        start = min(p.bill.window_start_unix_ms for p in priced)
        last = max(p.bill.window_start_unix_ms for p in priced)
        rows = focus_dataset(ledger, start_ms=start, end_ms=last + 1)
        hour = 3_600_000
        hourly = [row for chunk in focus_hour_chunks(ledger, start_ms=start - start % hour,
                                                     end_ms=last - last % hour + hour) for row in chunk]
        ledger.close()
        assert len(rows) > 50 and 0 < len(hourly) < len(rows)
        for suffix, dataset in (("", rows), ("-hour", hourly)):
            files[f"{name}{suffix}.csv"] = folder / f"{name}{suffix}.csv"
            files[f"{name}{suffix}.csv"].write_text(focus_csv(dataset))
            files[f"{name}{suffix}.parquet"] = folder / f"{name}{suffix}.parquet"
            write_focus_parquet(dataset, files[f"{name}{suffix}.parquet"])
    return files


@pytest.mark.parametrize("name", ["kept.csv", "shared.parquet"])
def test_the_shipped_rules_fail_only_on_their_focus_1_0_preview_names(validator_venv, exports, tmp_path, name):
    failed, ran, _ = validate(validator_venv, exports[name], tmp_path)
    assert ran > 100
    assert failed == PREVIEW_FAILURES


@pytest.mark.parametrize("name", ["kept.csv", "kept.parquet", "shared.csv", "shared.parquet", "kept-hour.csv",
                                  "kept-hour.parquet", "shared-hour.csv", "shared-hour.parquet"])
def test_the_export_passes_the_focus_validator(validator_venv, patched_rules, exports, tmp_path, name):
    failed, ran, output = validate(validator_venv, exports[name], tmp_path, patched_rules)
    assert not failed, output
    assert ran > 100  # every rule of the 1.0 set ran; none was skipped for a missing column


def test_a_wrong_row_fails_the_validator(validator_venv, patched_rules, exports, tmp_path):
    rows = list(csv.DictReader(io.StringIO(exports["shared.csv"].read_text())))
    rows[1]["BillingCurrency"] = "DOLLARS"
    rows[2]["BilledCost"] = ""
    path = tmp_path / "broken.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    failed, _, _ = validate(validator_venv, path, tmp_path, patched_rules)
    assert failed == {"BillingCurrency_IsCurrencyCode", "BilledCost_NotNull"}
