"""The hourly FOCUS grain's column builder (``focus.focus_hour_columns``, ``FocusColumns`` and the writers) against
the row semantics it replaced: the rows, the CSV and the Parquet file the row-dict code made (``_reference_*``
below: that code, kept here as the oracle, reading the same lines as ``FocusHourLine`` objects) on adversarial
input -- zero lines and a charge that billed nothing, trued-up and amended charges, labels with unicode, commas and
quotes, empty label sets and label sets whose tags read the same, MIG and exclusive GPUs, several price versions
in one node-hour, a charge with one line, shares that JSON writes as ``NaN``/``Infinity``, texts with ``%`` and
non-ASCII, money from 1 micro-dollar to 2**53 + 1 and past -- read by ids (PostgreSQL's) and by texts (SQLite's).
And a money column's double is ``micro / 10**6`` correctly rounded: the same double as ``float(Decimal)``."""

from __future__ import annotations

import csv
import io
import random
import dataclasses
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any, Mapping

import pytest

from services.billing import focus
from services.billing.focus import (
    COLUMNS,
    DATETIME_COLUMNS,
    FOCUS_VERSION,
    HOURS_DECIMALS,
    INTEGER_COLUMNS,
    MONEY_COLUMNS,
    QUANTITY_COLUMNS,
    FocusCharge,
    FocusColumns,
    HourLines,
    focus_hour_columns,
    hour_units,
    usd_decimal,
    write_focus_csv_chunks,
    write_focus_parquet_chunks,
)
from services.billing.focus_rollups import hour_lines_of_texts
from services.billing.money import apportion

HOUR_MS = 3_600_000
T0 = 1_782_864_000_000  # a whole UTC hour

# -- the oracle: the row-dict code the columns replaced (services/billing/focus.py before, unchanged but for names) --

_MS_PER_HOUR = 3_600_000
_ORIGIN_TAG_KEYS = ("gpumeter.io/cluster", "gpumeter.io/node")
_BUCKET_ORDER = focus._BUCKET_ORDER
_HOURS_QUANTUM = Decimal(1).scaleb(-HOURS_DECIMALS)
_json = focus._json
_method_text = focus._method_text


@dataclass(frozen=True, slots=True)
class FocusHourLine:
    subject_kind: str
    pod_uid: str
    gpu_uuid: str
    shared_from: str
    sharing_method: str
    method: str
    cost_basis: str
    namespace: str
    pod_name: str
    labels: Mapping[str, str]
    cost_micro_usd: int
    billed_micro_usd: int
    cost_lines: int
    trued_lines: int
    billed_ms: int
    cost_share_ms: float
    memory_share_ms: float
    compute_share_ms: float
    gpu_ms: float


def _reference_rows(charges, lines, *, billing_account_id=None) -> list[dict[str, Any]]:
    charges = sorted(charges, key=lambda c: c.link)
    known = {c.link for c in charges}
    orphans = set(lines) - known
    if orphans:
        raise ValueError(f"hourly FOCUS lines without their origin charge: {sorted(orphans)[:3]}")
    rows: list[dict[str, Any]] = []
    for charge in charges:
        rows.extend(_reference_charge_rows(charge, lines.get(charge.link, ()), billing_account_id))
    return rows


def _reference_charge_rows(charge, lines, billing_account_id):
    total = charge.node_cost_micro_usd
    listed = sum(line.cost_micro_usd for line in lines)
    if listed != total:
        raise ValueError(f"{charge.link}: lines add up to {listed} micro-USD, the origin charge says {total}")
    groups: dict[tuple, list] = {}
    tags_text: dict[int, str] = {}
    for line in lines:
        if line.subject_kind == "POD" and line.pod_uid:
            labels = line.labels
            text = tags_text.get(id(labels))
            if text is None:
                text = tags_text[id(labels)] = _json({k: v for k, v in labels.items() if k not in _ORIGIN_TAG_KEYS})
            key = (0, line.pod_uid, line.namespace, line.pod_name, text)
        else:
            key = (_BUCKET_ORDER.get(line.subject_kind, 99), line.subject_kind)
        groups.setdefault(key, []).append(line)
    keys = sorted(groups)
    row_costs = [sum(line.cost_micro_usd for line in groups[key]) for key in keys]
    weights = [Fraction(c) for c in row_costs] if any(row_costs) else [Fraction(1)] * len(keys)
    quantities = apportion(hour_units(charge.billed_milliseconds), weights) if keys else ()
    basis = "+".join(sorted({line.cost_basis for line in lines if line.cost_basis})) or "unknown"
    common = focus._origin_columns(
        cluster=charge.cluster, node_name=charge.node_name, provider=charge.provider, region=charge.region,
        zone=charge.zone, provider_id=charge.provider_id, instance_type=charge.instance_type,
        price_model=charge.price_model, price_version=charge.price_version,
        price_per_hour_usd=charge.price_per_hour_usd, split_rule=charge.split_rule, sharing=charge.sharing,
        basis=basis, start_ms=charge.period_start_unix_ms, end_ms=charge.period_start_unix_ms + _MS_PER_HOUR,
        description=f"{charge.instance_type} {charge.price_model} GPU node {charge.node_name}, hour of "
                    f"{charge.window_seconds} s windows",
        billing_account_id=billing_account_id)
    template = dict.fromkeys(COLUMNS)
    template.update(common)
    origin_ms = charge.billed_milliseconds
    element_count = len(lines)
    rows = []
    for key, list_micro, units in zip(keys, row_costs, quantities):
        group = groups[key]
        is_pod = key[0] == 0
        billed_micro = shared_micro = 0
        gpu_ms = 0.0
        elements = []
        for line in sorted(group, key=lambda l: (l.shared_from != "", l.gpu_uuid, l.shared_from)):
            billed_micro += line.billed_micro_usd
            ratio = line.cost_micro_usd / total if total else 1.0 / element_count
            element: dict[str, Any] = {"AllocatedRatio": ratio}
            share = line.cost_share_ms / origin_ms if origin_ms else 0.0
            if line.shared_from:
                shared_micro += line.cost_micro_usd
                element.update(UsageUnit="Shared", x_SharedFrom=line.shared_from.lower(),
                               x_SharingMethod=line.sharing_method, x_CostShare=share)
            elif line.gpu_uuid:
                if is_pod:
                    gpu_ms += line.gpu_ms
                element.update(UsageUnit="GPU-Hours", UsageQuantity=line.gpu_ms / _MS_PER_HOUR,
                               x_GpuUuid=line.gpu_uuid, x_Method=_method_text(line.method, line.cost_basis),
                               x_MeasuredBy=line.method, x_CostShare=share,
                               x_MemoryShare=line.memory_share_ms / origin_ms if origin_ms else 0.0,
                               x_ComputeShare=line.compute_share_ms / origin_ms if origin_ms else 0.0)
                if not is_pod:
                    element["x_Bucket"] = line.subject_kind.lower()
            else:
                element.update(UsageUnit="GPU-Hours" if line.subject_kind == "UNAVAILABLE" else "Hours",
                               x_Bucket=line.subject_kind.lower())
            element["x_Lines"] = line.cost_lines
            elements.append(element)
        first = group[0]
        row = template.copy()
        quantity = Decimal(units).scaleb(-HOURS_DECIMALS)
        row.update({
            "BilledCost": usd_decimal(billed_micro),
            "EffectiveCost": usd_decimal(billed_micro),
            "ListCost": usd_decimal(list_micro),
            "ContractedCost": usd_decimal(list_micro),
            "PricingQuantity": quantity,
            "ConsumedQuantity": quantity,
            "AllocatedMethodDetails": _json({"Elements": elements}),
            "AllocatedResourceId": first.pod_uid if is_pod else None,
            "AllocatedResourceName": f"{first.namespace}/{first.pod_name}" if is_pod else None,
            "AllocatedTags": key[4] if is_pod else None,
            "x_Namespace": first.namespace if is_pod else None,
            "x_PodName": first.pod_name if is_pod else None,
            "x_PodUid": first.pod_uid if is_pod else None,
            "x_Subject": "pod" if is_pod else first.subject_kind.lower(),
            "x_DirectCost": usd_decimal(list_micro - shared_micro),
            "x_SharedCost": usd_decimal(shared_micro),
            "x_ListCostMicroUsd": list_micro,
            "x_BilledCostMicroUsd": billed_micro,
            "x_GpuHours": (Decimal(gpu_ms) / _MS_PER_HOUR).quantize(_HOURS_QUANTUM) if is_pod else None,
        })
        rows.append(row)
    return rows


def _reference_csv(rows) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow(["" if row.get(column) is None else str(row.get(column)) for column in COLUMNS])
    return buffer.getvalue()


def _reference_parquet(chunks, path, metadata) -> None:
    from datetime import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    def table(rows):
        fields, arrays = [], []
        for column in COLUMNS:
            values = [row.get(column) for row in rows]
            if column in DATETIME_COLUMNS:
                kind = pa.timestamp("ms", tz="UTC")
                values = [None if v is None else datetime.fromisoformat(v.replace("Z", "+00:00")) for v in values]
            elif column in MONEY_COLUMNS or column in QUANTITY_COLUMNS:
                kind = pa.float64()
                values = [None if v is None else float(v) for v in values]
            elif column in INTEGER_COLUMNS:
                kind = pa.int64()
            else:
                kind = pa.string()
            fields.append(pa.field(column, kind))
            arrays.append(pa.array(values, type=kind))
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata={"focus_version": FOCUS_VERSION,
                                                                               **metadata}))

    writer = None
    try:
        for rows in chunks:
            made = table(rows)
            if writer is None:
                writer = pq.ParquetWriter(str(path), made.schema)
            if rows:
                writer.write_table(made)
        if writer is None:
            writer = pq.ParquetWriter(str(path), table([]).schema)
    finally:
        if writer is not None:
            writer.close()


# -- adversarial input ------------------------------------------------------------------------------------------------

LABELS: dict[int, dict[str, str]] = {
    0: {},
    11: {"team": "ml", "app": "trainer"},
    12: {"team": "ml", "app": "trainer", "gpumeter.io/cluster": "c1"},  # the same tags once the origin's are dropped
    13: {"team": "Ωmega, \"quoted\"", "note": "a,b\nc", "emoji": "🚀"},
    14: {"gpumeter.io/node": "n", "gpumeter.io/cluster": "c"},  # only the origin's: empty tags
    15: {"pct": "100%", "path": "a\\b", "ünï": "cödé"},
}
KINDS = [  # (subject_kind, shared_from, sharing_method, method, cost_basis)
    ("POD", "", "", "memory", "memory"),
    ("POD", "", "", "mig_instance", "memory"),
    ("POD", "", "", "exclusive", "compute"),
    ("POD", "", "", "blend:0.5", "blend:0.5"),
    ("POD", "", "", "request", ""),
    ("POD", "IDLE", "weighted", "memory", "memory"),
    ("POD", "NODE_OTHER", "even%s", "memory", "memory"),
    ("POD", "UNATTRIBUTED", "weighted", "mem%d", "compute"),
    ("IDLE", "", "", "memory", "memory"),
    ("UNAVAILABLE", "", "", "", ""),
    ("NODE_OTHER", "", "", "", ""),
    ("UNATTRIBUTED", "", "", "memory", "memory"),
    ("DRIVER_RESERVED", "", "", "memory", "memory"),
    ("MYSTERY", "", "", "x", "y"),
]
POD_KINDS = [k for k in KINDS if k[0] == "POD"]
BUCKET_KINDS = [k for k in KINDS if k[0] != "POD"]
GPUS = ["GPU-1", "GPU-2", "MIG-3/\"q\"", "GPU-ü", "GPU-%s"]
PODS = [("uid-a", "ml", "trainer-0"), ("uid-b", "ml", "trainer-1"), ("uid-c", "ñs", "pöd, \"x\""),
        ("uid-d", "", ""), ("uid-a", "ml", "trainer-0b")]
MICRO_EDGES = [0, 1, 2, 999_999, 1_000_001, 2**53 - 1, 2**53, 2**53 + 1, 10**15 + 1]
SHARE_EDGES = [0.0, 1.0, 0.1, 1 / 3, 1e-7, 5e-324, 1e17, 123456.789]


def _charge(period_ms, node, price_version, total, billed, billed_ms, *, zone="us-east-1a", sharing="keep",
            provider="aws", price="98.32"):
    return FocusCharge(period_ms, "c1", node, f"aws:///{zone}/i-{node}", zone, price_version, sharing, 60,
                       provider, "us-east-1", "p5.48xlarge", "on_demand", 60, billed_ms, total, billed, 0, price,
                       "marginal")


def adversarial(seed: int = 7) -> tuple[list[FocusCharge], list[dict[str, Any]]]:
    """Charges and their lines (dicts of every field), shuffled: see the module docstring."""
    rng = random.Random(seed)
    charges, lines = [], []

    def add(charge_args, specs):
        made = []
        for spec in specs:
            kind, pod, gpu, label, cost = spec[:5]
            billed = spec[5] if len(spec) > 5 else cost
            shares = spec[6] if len(spec) > 6 else None
            billed_ms = rng.choice([60_000, 3_540_000, 59_999])
            cost_share, memory, compute = shares or (rng.choice(SHARE_EDGES) * billed_ms, rng.random() * billed_ms,
                                                     rng.random() * billed_ms)
            gpu_ms = spec[7] if len(spec) > 7 else cost_share * rng.choice([1.0, 3 / 7, 0.5]) if gpu else 0.0
            made.append(dict(kind=kind, pod=pod, gpu=gpu, label=label, cost=cost, billed=billed,
                             cost_lines=rng.randint(1, 60), trued_lines=int(billed != cost), billed_ms=billed_ms,
                             cost_share_ms=cost_share, memory_share_ms=memory, compute_share_ms=compute,
                             gpu_ms=gpu_ms))
        charge = _charge(*charge_args[:1], *charge_args[1:3], sum(m["cost"] for m in made),
                         sum(m["billed"] for m in made), *charge_args[3:4], **(charge_args[4] if len(charge_args) > 4
                                                                                 else {}))
        charges.append(charge)
        for m in made:
            m["link"] = charge.link
            m["period"] = charge.period_start_unix_ms
        lines.extend(made)

    none = ("", "", "")
    for hour in range(3):
        period = T0 + hour * HOUR_MS
        for n in range(4):
            node = f"n{n}"
            specs = []
            for _ in range(rng.randint(1, 5)):
                pod = rng.choice(PODS)
                label = rng.choice(list(LABELS))
                for kind in rng.sample(POD_KINDS, rng.randint(1, 3)):
                    specs.append((kind, pod, rng.choice(GPUS) if not kind[1] or rng.random() < 0.5 else "",
                                  label, rng.choice(MICRO_EDGES[:5] + [rng.randint(0, 10**7)])))
            for kind in rng.sample(BUCKET_KINDS, rng.randint(0, len(BUCKET_KINDS))):
                gpu = rng.choice(GPUS) if kind[0] in ("IDLE", "UNATTRIBUTED", "DRIVER_RESERVED") else ""
                specs.append((kind, none, gpu, 0, rng.choice([0, 0, 1, rng.randint(0, 10**6)])))
            trued = [(s[:5] + (s[4] // 2 if s[4] % 3 == 0 else s[4] + 7,)) if rng.random() < 0.3 else s
                     for s in specs]
            add((period, node, "v1", 3_600_000), trued)
        # Several price versions in one node-hour, each its own charge; the second's provider unknown, no zone.
        add((period, "n0", "v2", 1_800_000, {"zone": "", "provider": "onprem", "price": "0.000001"}),
            [(KINDS[0], PODS[0], "GPU-1", 11, 5), (KINDS[10], none, "", 0, 0)])
    # A charge with one line; money past 2**53; a charge that billed nothing and no time; a pod kind without a uid;
    # the same (GPU, shared from) twice in a row (two kinds): the lines' order decides, as before.
    add((T0, "one", "v1", 60_000), [(KINDS[2], PODS[1], "GPU-2", 13, 2**53 + 1)])
    add((T0, "big", "v1", 3_600_000), [(KINDS[0], PODS[0], "GPU-1", 11, 2**53 + 1, 2**53 - 1),
                                       (KINDS[8], none, "GPU-1", 0, 1), (KINDS[9], none, "", 0, 0)])
    add((T0, "zero", "v1", 0), [(KINDS[0], PODS[2], "GPU-1", 15, 0), (KINDS[8], none, "GPU-1", 0, 0),
                                (KINDS[10], none, "", 0, 0), (("POD", "", "", "memory", "memory"), none, "GPU-2",
                                                              0, 0)])
    # Nothing billed over billed time: the hours still divide over the rows (equal weights).
    add((T0, "free", "v1", 3_599_999), [(KINDS[0], PODS[0], "GPU-1", 11, 0), (KINDS[1], PODS[1], "GPU-2", 0, 0),
                                        (KINDS[8], none, "GPU-1", 0, 0), (KINDS[10], none, "", 0, 0)])
    add((T0, "ties", "v1", 3_600_000), [(KINDS[0], PODS[0], "GPU-1", 11, 3), (KINDS[3], PODS[0], "GPU-1", 12, 4),
                                        (KINDS[5], PODS[0], "", 11, 2), (KINDS[4], PODS[0], "", 12, 1)])
    # Shares JSON writes as NaN and Infinity (no Decimal of them: a bucket's GPU time is not summed).
    add((T0, "nonfinite", "v1", 3_600_000),
        [(KINDS[0], PODS[1], "GPU-2", 0, 10, 10, (float("nan"), float("inf"), 0.5)),
         (KINDS[5], PODS[1], "", 0, 5, 5, (float("-inf"), 0.0, 0.0)),
         (KINDS[8], none, "GPU-1", 0, 5, 5, (1.0, 1.0, float("nan")))])
    lines[-1]["gpu_ms"] = float("inf")
    # A pod's GPU time is summed in its elements' order (floats: 1 + 1 + 1e16 is not 1e16 + 1 + 1).
    add((T0, "order", "v1", 3_600_000), [(KINDS[0], PODS[3], "MIG-3/\"q\"", 11, 1, 1, (1e16, 0.0, 0.0), 1e16),
                                         (KINDS[1], PODS[3], "GPU-2", 11, 1, 1, (1.0, 0.0, 0.0), 1.0),
                                         (KINDS[2], PODS[3], "GPU-1", 11, 1, 1, (1.0, 0.0, 0.0), 1.0)])
    ordered = lines[-3:]
    rng.shuffle(lines)
    rng.shuffle(charges)
    lines[:] = [m for m in lines if all(m is not o for o in ordered)] + ordered  # read in this order, unsorted
    return charges, lines


def reference_input(lines):
    out: dict[tuple, list] = {}
    for m in lines:
        kind, pod = m["kind"], m["pod"]
        out.setdefault(m["link"], []).append(FocusHourLine(
            kind[0], pod[0], m["gpu"], kind[1], kind[2], kind[3], kind[4], pod[1], pod[2], LABELS[m["label"]],
            m["cost"], m["billed"], m["cost_lines"], m["trued_lines"], m["billed_ms"], m["cost_share_ms"],
            m["memory_share_ms"], m["compute_share_ms"], m["gpu_ms"]))
    return out


_MEASURES = ("cost", "billed", "cost_lines", "trued_lines", "billed_ms", "cost_share_ms", "memory_share_ms",
             "compute_share_ms", "gpu_ms")


def by_ids(charges, lines):
    """As PostgreSQL's reader gives them: dictionary ids, and charge ids that repeat from hour to hour (an origin
    charge is its hour and its id)."""
    kinds = {kind: 100 + i for i, kind in enumerate(dict.fromkeys(m["kind"] for m in lines))}
    pods = {pod: 200 + i for i, pod in enumerate(dict.fromkeys(m["pod"] for m in lines))}
    gpus = {gpu: 300 + i for i, gpu in enumerate(dict.fromkeys(m["gpu"] for m in lines))}
    per_hour: dict[int, int] = {}
    ids = {}
    for charge in charges:
        ids[charge.link] = per_hour[charge.period_start_unix_ms] = per_hour.get(charge.period_start_unix_ms, 0) + 1
    rows = [(m["period"], ids[m["link"]], kinds[m["kind"]], pods[m["pod"]], gpus[m["gpu"]], m["label"],
             *(m[name] for name in _MEASURES)) for m in lines]
    return ([(ids[c.link], c) for c in charges],
            HourLines(rows, {v: k for k, v in kinds.items()}, {v: k for k, v in pods.items()},
                      {v: k for k, v in gpus.items()}, LABELS))


def by_texts(charges, lines):
    """As SQLite's reader gives them: ``lines_of``' text rows through ``hour_lines_of_texts``."""
    rows = [(*m["link"], m["kind"][0], m["pod"][0], m["gpu"], *m["kind"][1:], *m["pod"][1:], m["label"],
             *(m[name] for name in _MEASURES)) for m in lines]
    return ([(c.link, c) for c in charges], HourLines(*hour_lines_of_texts(rows), LABELS))


READERS = {"ids": by_ids, "texts": by_texts}


def _same(a, b) -> bool:
    # NaN is not equal to itself: values compare by type and text.
    return type(a) is type(b) and repr(a) == repr(b)


@pytest.mark.parametrize("reader", sorted(READERS))
def test_the_columns_are_the_rows_csv_and_parquet_the_row_code_made(reader, tmp_path):
    charges, lines = adversarial()
    expected = _reference_rows(charges, reference_input(lines), billing_account_id="acct")
    keyed, hour_lines = READERS[reader](charges, lines)
    columns = focus_hour_columns(keyed, hour_lines, billing_account_id="acct")
    assert len(columns) == len(expected) > 50
    rows = columns.rows()
    for got, want in zip(rows, expected):
        assert list(got) == list(COLUMNS)
        bad = [c for c in COLUMNS if not _same(got[c], want[c])]
        assert not bad, [(c, got[c], want[c]) for c in bad]
    assert [row["AllocatedMethodDetails"] for row in columns] == [row["AllocatedMethodDetails"] for row in expected]
    # The CSV, byte for byte.
    out = io.StringIO()
    assert write_focus_csv_chunks([columns], out) == len(expected)
    assert out.getvalue() == _reference_csv(expected)
    assert focus.focus_csv(columns) == _reference_csv(expected)
    # The Parquet file, byte for byte: two chunks (two row groups) and an empty one between.
    half = len(charges) // 2
    first = sorted(charges, key=lambda c: c.link)[:half]
    split = {c.link for c in first}
    parts = []
    for chosen in ([c for c in charges if c.link in split], [], [c for c in charges if c.link not in split]):
        links = {c.link for c in chosen}
        part = [m for m in lines if m["link"] in links]
        parts.append((chosen, part))
    made = [focus_hour_columns(*READERS[reader](chosen, part), billing_account_id="acct") for chosen, part in parts]
    wanted = [_reference_rows(chosen, reference_input(part), billing_account_id="acct") for chosen, part in parts]
    assert write_focus_parquet_chunks(made, tmp_path / "new.parquet", metadata={"gpumeter_grain": "hour"}) == len(
        expected)
    _reference_parquet(wanted, tmp_path / "old.parquet", {"gpumeter_grain": "hour"})
    assert (tmp_path / "new.parquet").read_bytes() == (tmp_path / "old.parquet").read_bytes()


def test_no_lines_make_an_empty_dataset_with_the_schema(tmp_path):
    columns = focus_hour_columns([], HourLines([], {}, {}, {}, {}))
    assert len(columns) == 0 and columns.rows() == []
    assert focus.focus_csv(columns) == _reference_csv([])
    write_focus_parquet_chunks([columns], tmp_path / "new.parquet", metadata={"gpumeter_grain": "hour"})
    _reference_parquet([[]], tmp_path / "old.parquet", {"gpumeter_grain": "hour"})
    assert (tmp_path / "new.parquet").read_bytes() == (tmp_path / "old.parquet").read_bytes()


def test_lines_without_their_charge_or_that_do_not_add_up_are_refused():
    charges, lines = adversarial()
    keyed, hour_lines = by_ids(charges, lines)
    with pytest.raises(ValueError, match="without their origin charge"):
        focus_hour_columns(keyed[1:], hour_lines)
    wrong = [(key, FocusCharge(*(getattr(c, f) + 1 if f == "node_cost_micro_usd" else getattr(c, f)
                                 for f in FocusCharge.__slots__))) for key, c in keyed]
    with pytest.raises(ValueError, match="add up"):
        focus_hour_columns(wrong, hour_lines)


@pytest.mark.parametrize("dictionary", ["kinds", "pods", "gpus", "labels"])
def test_a_line_naming_an_id_its_dictionary_lacks_is_refused_with_the_id(dictionary):
    charges, lines = adversarial()
    keyed, hour_lines = by_ids(charges, lines)
    # A POD line's: its kind, pod, GPU and label set are all looked up.
    line = next(line for line in hour_lines.lines
                if hour_lines.kinds[line[2]][0] == "POD" and hour_lines.pods[line[3]][0])
    missing = line[{"kinds": 2, "pods": 3, "gpus": 4, "labels": 5}[dictionary]]
    held = dict(getattr(hour_lines, dictionary))
    del held[missing]
    broken = dataclasses.replace(hour_lines, **{dictionary: held})
    what = {"kinds": "kind", "pods": "pod", "gpus": "GPU", "labels": "label set"}[dictionary]
    with pytest.raises(ValueError, match=f"names {what} {missing!r}, which the ledger's {what} dictionary"):
        focus_hour_columns(keyed, broken)


MONEY_EDGES = [0, 1, 5, 999_999, 1_000_000, 1_000_001, 123_456_789, 2**53 - 1, 2**53, 2**53 + 1, 2**53 + 3,
               2**62 + 1, 2**63 - 1, 2**64 + 1, 10**22 + 1, -1, -(2**53 + 1), 2_258_848_920_572_997_260]


def test_a_money_columns_double_is_the_correctly_rounded_quotient_as_the_decimals_float():
    # float(Decimal) and int / int are both the correctly rounded quotient; float(micro) / 1e6 is not past 2**53
    # (2**53 + 1 rounds twice), which is why the columns divide exactly.
    rng = random.Random(3)
    values = MONEY_EDGES + [rng.randrange(0, 2**53) for _ in range(2000)] + [rng.randrange(2**53, 2**62)
                                                                          for _ in range(2000)]
    assert float(2**53 + 1) / 1e6 != float(usd_decimal(2**53 + 1))
    for chunk in (values, [v for v in values if abs(v) <= 2**53], [1, 2**53 + 1]):
        got = list(focus._scaled_floats(chunk, 10**6))
        assert got == [float(usd_decimal(v)) for v in chunk]
        assert [float(x) for x in focus._scaled_floats(chunk, 10**HOURS_DECIMALS)] == [
            float(Decimal(v).scaleb(-HOURS_DECIMALS)) for v in chunk]
    # And through the columns: a row's Decimal, its CSV text and its Parquet double from the same micro-dollars.
    per_row = {column: [None] * len(MONEY_EDGES) for column in COLUMNS}
    micro = {column: MONEY_EDGES for column in focus._MICRO_COLUMNS}
    for column in micro:
        del per_row[column]
    columns = FocusColumns({}, (), per_row, micro)
    table = columns.arrow_table()
    for column in micro:
        assert table.column(column).to_pylist() == [float(usd_decimal(v)) for v in MONEY_EDGES]
        assert [row[column] for row in columns] == [usd_decimal(v) for v in MONEY_EDGES]


def test_texts_from_one_buffer_are_the_array_pyarrow_makes_and_other_texts_are_left_to_it():
    import pyarrow as pa

    texts = ['{"Elements":[]}', "", "a,b", '"q"']
    assert focus._text_array(texts).equals(pa.array(texts, pa.string()))
    assert focus._text_array(["ascii", "ünïcode"]) is None  # its UTF-8 bytes are more than its characters
    assert focus._text_array(["a", None]) is None and focus._text_array([]) is None
    assert focus._arrow_array("AllocatedMethodDetails", ["ascii", "ünïcode"], pa.string()).equals(
        pa.array(["ascii", "ünïcode"], pa.string()))
