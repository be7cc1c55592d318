"""How each example payload of the chain is produced by the real code (the tests compare, never regenerate)."""

from __future__ import annotations

import itertools
from fractions import Fraction

from schemas.records import GpuShare, NodeSample, NodeWindowCost, NodeWindowShares
from services.attributor.attribution import AttributionPolicy, attribute_node_window
from services.attributor.pod_index import PodIndex
from services.attributor.windows import NodeWindow
from services.billing.catalog import PriceCatalog, parse_override_csv
from services.billing.costing import bill_node_window, window_cost_record
from services.billing.sharing import SharingPolicy
from simulator.scenario import load_scenario
from services.collector.simulation import node_streams

WINDOW_SECONDS = 60

# (scenario, node, tick index) of each NodeSample example after the first (the first is hand-written).
COLLECTED = (
    ("scenarios/mig_mixed.yaml", "gpu-nc24-mig", 1),  # A100 in MIG: 3g + 2g + 1g + 1g, one instance unused
    ("scenarios/mps.yaml", "gpu-g6-xl-mps", 2),  # L4 under MPS: the server and three clients
    ("scenarios/faults.yaml", "gpu-faulty", 7),  # two GPUs, GPU 1 lost (Xid 79)
)
# The on-premises node of faults.yaml has no bundled price: the price its example is billed at.
OVERRIDE_CSV = ("AssetClass,InstanceID,InstanceIDField,MarketPriceHourly,GpuCount,Source,SourceDate\n"
                "node,gpu-faulty,metadata.name,8.0,2,example price,2026-07\n")


def collected_sample(scenario_path: str, node: str, tick_index: int) -> NodeSample:
    """The NodeSample the collector's own code (NVML backend on the simulator, cgroups, assembly) makes."""
    scenario = load_scenario(scenario_path)
    return next(itertools.islice(node_streams(scenario, node), tick_index, None)).sample


def one_tick_window(sample: NodeSample) -> NodeWindow:
    window_ms = WINDOW_SECONDS * 1000
    start = sample.sampled_at_unix_ms // window_ms * window_ms
    return NodeWindow(sample.cluster, sample.node_name, start, WINDOW_SECONDS, (sample,))


def attributed_shares(sample: NodeSample) -> tuple[GpuShare, ...]:
    """The attributor's rows for the one-tick window of ``sample`` (no pod events: pods by uid only)."""
    return attribute_node_window(one_tick_window(sample), PodIndex.empty(), AttributionPolicy())


def catalog() -> PriceCatalog:
    return PriceCatalog.load().with_overrides(parse_override_csv(OVERRIDE_CSV, "example-prices.csv"))


def billed(shares: tuple[GpuShare, ...]):
    return bill_node_window(shares, catalog())


def slice_fraction(slices: int, total: int) -> Fraction:
    return Fraction(slices, total)


def window_shares(sample: NodeSample) -> NodeWindowShares:
    """The attributor's one record of the one-tick window of ``sample``."""
    return NodeWindowShares.from_rows(attributed_shares(sample))


# The sharing policy of the last NodeWindowCost example (the others keep every bucket): shared lines on the wire.
SHARED_EXAMPLE_POLICY = "all=weighted"


def window_cost(shares: NodeWindowShares, sharing: str = "keep") -> NodeWindowCost:
    """Billing's one record of that node-window's bill and lines, under the sharing policy ``sharing``."""
    return window_cost_record(bill_node_window(shares.rows(), catalog(), sharing=SharingPolicy.parse(sharing)), shares)
