"""The worked example of docs/billing.md's sharing section, computed by the real costing and sharing code (the doc's
table is this module's output; ``tests/unit/billing/test_sharing_doc.py`` fails when they disagree).

One node-window of one hour on a node billed 10 USD/h: two GPUs at 4 USD/h each and 2 USD/h of ``node_other``.
GPU-0 is time-sliced by ``train`` (60 % of its cost share, requesting 4 CPUs and 16 GiB) and ``serve`` (20 %, 2 CPUs
and 48 GiB), 20 % of it idle; GPU-1 is idle all hour, no pod on it.
"""

from __future__ import annotations

from fractions import Fraction
from types import MappingProxyType

from schemas.records import CostSubjectKind, GpuShare, ShareSubjectKind, SharingMode
from services.billing.costing import price_node_window
from services.billing.pricing import NodePrice, SplitRule
from services.billing.sharing import ShareMethod, SharingPolicy

GIB = 2**30
PODS = (("train", 0.6, 4000, 16 * GIB), ("serve", 0.2, 2000, 48 * GIB))
METHODS = (ShareMethod.KEEP, ShareMethod.WEIGHTED, ShareMethod.EVEN, ShareMethod.REQUESTS)


def example_price() -> NodePrice:
    return NodePrice(provider="aws", region="us-east-1", instance_type="example.2gpu", price_model="on_demand",
                     node_usd_per_hour=Fraction(10), gpu_count=2, gpu_usd_per_hour=Fraction(4),
                     node_other_usd_per_hour=Fraction(2), split_rule=SplitRule.WEIGHTS, sources=())


def example_shares() -> tuple[GpuShare, ...]:
    units = {
        "GPU-0": [(ShareSubjectKind.POD, uid, share, cpu, memory) for uid, share, cpu, memory in PODS]
        + [(ShareSubjectKind.IDLE, None, 0.2, 0, 0)],
        "GPU-1": [(ShareSubjectKind.IDLE, None, 1.0, 0, 0)],
    }
    rows = []
    for gpu, subjects in units.items():
        subjects = subjects + [(kind, None, 0.0, 0, 0) for kind in (ShareSubjectKind.DRIVER_RESERVED,
                                                                     ShareSubjectKind.UNATTRIBUTED,
                                                                     ShareSubjectKind.UNAVAILABLE)]
        for kind, uid, share, cpu, memory in subjects:
            rows.append(GpuShare(
                cluster="example", node_name="node-a", window_start_unix_ms=0, window_seconds=3600,
                node_covered_seconds=3600.0, units_in_node=2, rows_in_unit=len(subjects), cloud_provider="aws",
                region="us-east-1", instance_type="example.2gpu", price_model="on_demand", gpu_uuid=gpu,
                parent_gpu_uuid=None, gpu_model="NVIDIA L4", gpu_fraction=1.0,
                sharing_mode=SharingMode.TIME_SLICING, subject_kind=kind, pod_uid=uid,
                namespace="ml" if uid else None, pod_name=uid, labels=MappingProxyType({"team": uid} if uid else {}),
                workload_kind=None, workload_name=None, memory_used_bytes_avg=0.0, memory_share=share,
                compute_share=share, cost_share=share, method="per_process_sm", sample_count=3600,
                covered_seconds=3600.0, cpu_request_millicores=cpu, memory_request_bytes=memory,
                cost_basis="memory"))
    return tuple(rows)


def _usd(micro: int) -> str:
    whole, fraction = divmod(micro, 1_000_000)
    return f"{whole}.{fraction:06d}"


def example_table() -> str:
    """The doc's table: one column per method (idle and node_other shared by it), a line per cost line."""
    shares, price = example_shares(), example_price()
    columns = []
    for method in METHODS:
        policy = SharingPolicy(idle=method, node_other=method)
        priced = price_node_window(shares, price, policy)
        cells: dict[str, int] = {}
        for cost in priced.costs:
            if cost.subject_kind is CostSubjectKind.POD:
                part = f"shared {cost.shared_from.value.lower()}" if cost.shared_from is not None else "direct"
                key = f"{cost.pod_uid} {part}"
            else:
                key = f"{cost.subject_kind.value.lower()} (kept)"
            cells[key] = cells.get(key, 0) + cost.cost_micro_usd
        cells["TOTAL"] = sum(c.cost_micro_usd for c in priced.costs)
        assert cells["TOTAL"] == priced.bill.node_cost_micro_usd
        columns.append((policy.describe(), cells))
    order = [f"{uid} {part}" for uid, *_ in PODS for part in ("direct", "shared idle", "shared node_other")]
    order += [f"{kind} (kept)" for kind in ("idle", "driver_reserved", "unattributed", "unavailable", "node_other")]
    rows = [key for key in order if any(cells.get(key) for _, cells in columns)] + ["TOTAL"]
    header = "| line (USD) | " + " | ".join(f"`{name}`" for name, _ in columns) + " |"
    lines = [header, "|---|" + "---:|" * len(columns)]
    for key in rows:
        label = f"**{key}**" if key == "TOTAL" else key
        lines.append(f"| {label} | " + " | ".join(_usd(cells.get(key, 0)) for _, cells in columns) + " |")
    pod_names = {uid for uid, *_ in PODS}
    shares_of_bill = []
    for _, cells in columns:
        carried = sum(amount for key, amount in cells.items() if key.split()[0] in pod_names)
        shares_of_bill.append(f"{carried * 100 / cells['TOTAL']:.0f} %")
    lines.append("| pods' part of the bill | " + " | ".join(shares_of_bill) + " |")
    return "\n".join(lines)
