"""Billing test helpers: share-row builders for node-windows and a migrated SQLite ledger per test."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Sequence

import pytest

from schemas.records import GpuShare, ShareSubjectKind, SharingMode

WINDOW_START_MS = 1_795_000_020_000 - (1_795_000_020_000 % 60_000)


@dataclass(frozen=True)
class Row:
    """One subject's row of a unit: a pod (``pod_uid`` set) or a bucket."""

    kind: ShareSubjectKind
    cost_share: float
    pod_uid: str | None = None
    namespace: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    cpu_request_millicores: int = 0
    memory_request_bytes: int = 0


@dataclass(frozen=True)
class Unit:
    """A GPU unit: a whole GPU (``parent`` None, fraction 1) or a MIG instance / free MIG capacity."""

    gpu_uuid: str
    rows: Sequence[Row]
    parent: str | None = None
    fraction: float = 1.0


def pod(uid: str, cost_share: float, namespace: str = "default", **labels: str) -> Row:
    return Row(ShareSubjectKind.POD, cost_share, uid, namespace, dict(labels))


def bucket(kind: ShareSubjectKind, cost_share: float) -> Row:
    return Row(kind, cost_share)


def node_window(
    units: Sequence[Unit],
    *,
    cluster: str = "prod",
    node: str = "node-a",
    window_start_ms: int = WINDOW_START_MS,
    window_seconds: int = 60,
    covered_seconds: float | None = None,
    provider: str = "aws",
    region: str = "us-east-1",
    instance_type: str = "p4d.24xlarge",
    price_model: str = "on_demand",
    gpu_model: str = "NVIDIA A100-SXM4-40GB",
) -> tuple[GpuShare, ...]:
    """The GpuShare rows of one complete node-window, counts filled in from ``units``."""
    covered = float(window_seconds) if covered_seconds is None else covered_seconds
    shares = []
    for unit in units:
        for row in unit.rows:
            shares.append(
                GpuShare(
                    cluster=cluster,
                    node_name=node,
                    window_start_unix_ms=window_start_ms,
                    window_seconds=window_seconds,
                    node_covered_seconds=covered,
                    units_in_node=len(units),
                    rows_in_unit=len(unit.rows),
                    cloud_provider=provider,
                    region=region,
                    instance_type=instance_type,
                    price_model=price_model,
                    gpu_uuid=unit.gpu_uuid,
                    parent_gpu_uuid=unit.parent,
                    gpu_model=gpu_model,
                    gpu_fraction=unit.fraction,
                    sharing_mode=SharingMode.MIG if unit.parent else SharingMode.TIME_SLICING,
                    subject_kind=row.kind,
                    pod_uid=row.pod_uid,
                    namespace=row.namespace,
                    pod_name=f"pod-{row.pod_uid}" if row.pod_uid else None,
                    labels=MappingProxyType(dict(row.labels)),
                    workload_kind=None,
                    workload_name=None,
                    memory_used_bytes_avg=0.0,
                    memory_share=row.cost_share,
                    compute_share=row.cost_share,
                    cost_share=row.cost_share,
                    method="memory_proxy",
                    sample_count=60,
                    covered_seconds=covered,
                    cpu_request_millicores=row.cpu_request_millicores,
                    memory_request_bytes=row.memory_request_bytes,
                    cost_basis="memory",
                )
            )
    return tuple(shares)


def shared_gpus(count: int, pods_per_gpu: Sequence[Row], *, prefix: str = "GPU-") -> list[Unit]:
    """``count`` whole GPUs with the same rows (pod uids made unique per GPU)."""
    units = []
    for index in range(count):
        rows = [
            Row(r.kind, r.cost_share, f"{r.pod_uid}-{index}" if r.pod_uid else None, r.namespace, r.labels)
            for r in pods_per_gpu
        ]
        units.append(Unit(f"{prefix}{index:04d}", rows))
    return units


@pytest.fixture
def sqlite_ledger(tmp_path):
    """A migrated SQLite ledger file of its own."""
    from services.billing.ledger import Ledger

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    ledger.migrate()
    yield ledger
    ledger.close()



def sample_shares(windows: int = 3, *, start_ms: int = WINDOW_START_MS) -> list[tuple[GpuShare, ...]]:
    """The rows of ``windows`` minutes of two nodes (an 8-GPU AWS node and a 1-GPU GCP node), one tuple per
    node-window, with pods in two namespaces, two teams, one pod without a team label, and every bucket kind."""
    node_windows = []
    for w in range(windows):
        start = start_ms + w * 60_000
        aws_rows = [
            pod("train", 0.55, "ml", team="research", model="llama"),
            pod("serve", 0.25, "serving", team="prod", model="llama"),
            pod("notebook", 0.05, "ml"),
            bucket(ShareSubjectKind.IDLE, 0.09),
            bucket(ShareSubjectKind.DRIVER_RESERVED, 0.03),
            bucket(ShareSubjectKind.UNATTRIBUTED, 0.02),
            bucket(ShareSubjectKind.UNAVAILABLE, 0.01),
        ]
        node_windows.append(node_window(shared_gpus(8, aws_rows, prefix="GPU-aws-"), node="aws-node",
                                        window_start_ms=start, covered_seconds=60.0 - w % 30))
        node_windows.append(node_window(
            [Unit("GPU-gcp-0", [pod("embed", 0.7, "serving", team="prod"), bucket(ShareSubjectKind.IDLE, 0.3)])],
            node="gcp-node", window_start_ms=start, provider="gcp", region="us-central1",
            instance_type="a2-highgpu-1g",
        ))
    return node_windows


def sample_costs(windows: int = 3, *, start_ms: int = WINDOW_START_MS, sharing: str = "keep"):
    """``sample_shares`` costed with the bundled catalog (buckets shared by ``sharing``, a
    ``SharingPolicy.parse`` text): one ``NodeWindowCost`` per node-window."""
    from services.billing.catalog import PriceCatalog
    from services.billing.costing import bill_node_window
    from services.billing.pricing import DEFAULT_SPLIT_POLICY
    from services.billing.sharing import SharingPolicy

    catalog = PriceCatalog.load()
    policy = SharingPolicy.parse(sharing)
    return [bill_node_window(shares, catalog, DEFAULT_SPLIT_POLICY, policy)
            for shares in sample_shares(windows, start_ms=start_ms)]


def posix_locks_held(pid: int, path: Path) -> list[str]:
    """The POSIX (fcntl) locks ``pid`` holds on ``path`` now, as ``/proc/locks`` lists them (SQLite's locks are these;
    ``path`` is only ``lstat``-ed: opening and closing it here would drop this process's own locks on it)."""
    st = os.lstat(path)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    held = []
    with open("/proc/locks") as locks:
        for line in locks:
            fields = line.split()
            if "->" in fields[:2]:
                continue  # a waiter, not a holder
            kind, access, owner, where = fields[1], fields[3], fields[4], fields[5]
            if kind == "POSIX" and owner == str(pid) and where == device:
                held.append(f"{access} {fields[6]}-{fields[7]}")
    return held


# -- the billing service on the one runner, without a broker ---------------------------------------------------


class CommitRecorder:
    """Stands in for the aiokafka consumer where the driver commits: records what it was asked to commit."""

    def __init__(self) -> None:
        self.positions: dict[tuple[str, int], int] = {}

    async def commit(self, offsets) -> None:
        for tp, meta in offsets.items():
            self.positions[(tp.topic, tp.partition)] = meta.offset


class BillingHarness:
    """``BillingProcessor`` + ``LedgerStore`` under the ``MessageRunner`` in a ``KafkaDriver`` whose consumer is a
    ``CommitRecorder`` (partitions ``owned``): the stream's code path from decoded message to committed offset,
    fed ``RawMessage``s directly. ``handle`` is one fetched batch of one message, ``handle_batch`` one of many,
    ``flush`` the driver's checkpoint (flush the outbox, mark published, commit)."""

    def __init__(self, ledger, producer, *, topics, clock, memory_s: float = 3600.0, catalog=None, sleep=None,
                 metrics=None, sharing=None, owned=None) -> None:
        from gpumeter.kafka.driver import KafkaDriver
        from gpumeter.stream.runner import MessageRunner
        from services.billing.catalog import PriceCatalog
        from services.billing.pricing import DEFAULT_SPLIT_POLICY
        from services.billing.service import BillingProcessor, LedgerStore, billing_inputs, billing_outputs
        from services.billing.sharing import KEEP_ALL

        self.topics = topics
        self.producer = producer
        self.processor = BillingProcessor(catalog=catalog or PriceCatalog.load(), policy=DEFAULT_SPLIT_POLICY,
                                          sharing=sharing or KEEP_ALL)
        self.store = LedgerStore(ledger, metrics=metrics, series_memory_seconds=memory_s)
        self.runner = MessageRunner(self.processor, billing_inputs(topics), clock, metrics=metrics)
        self.driver = KafkaDriver(self.runner, kafka=None, outputs=billing_outputs(topics), producer=producer,
                                  clock=clock, consumer_group="billing-test", store=self.store, metrics=metrics,
                                  retry_initial_seconds=0.5, retry_max_seconds=4.0, sleep=sleep)
        self.consumer = CommitRecorder()
        self.assign(owned or [(topics.node_window_shares, p) for p in range(4)])

    def assign(self, tps) -> None:
        """What the group's assignment does to the driver: these partitions are this member's."""
        self.driver._consumer = self.consumer
        self.driver._owned |= set(tps)

    async def revoke(self, tps) -> None:
        await self.driver._revoked(set(tps))

    async def handle(self, message) -> bool:
        """One message as a batch of its own; whether it was taken (False: dead-lettered)."""
        before = self.runner.dead_lettered
        await self.driver.handle_messages([message])
        return self.runner.dead_lettered == before

    async def handle_batch(self, messages) -> int:
        return await self.driver.handle_messages(messages)

    async def flush(self, *, retry: bool = True) -> bool:
        await self.driver.checkpoint(retry=retry)
        return self.driver.unacknowledged == 0

    def commit_positions(self) -> dict[tuple[str, int], int]:
        """What has been committed so far."""
        return dict(self.consumer.positions)

    @property
    def unacknowledged(self) -> int:
        return self.driver.unacknowledged

    @property
    def stats(self):
        return self.store.stats

    @property
    def dead_lettered(self) -> int:
        return self.runner.dead_lettered

    def stop(self) -> None:
        self.driver.stop()
