"""The topic catalog: every topic gpumeter uses, its record type, key, partitioning, retention and who reads it.

Topic names carry a prefix (``TopicCatalog(prefix=...)``) so tests and parallel deployments stay apart.
Samples and pod events are partitioned by node name with Kafka's murmur2, so a node's samples and its pods'
events land in the same partition number (Faust has no stream joins; the attributor joins a stream to a table).

**Topic versions.** A topic's name ends in its own version (``.v1``, ``.v2``). Within a topic, records evolve only
in ways every reader of the topic keeps reading (fields added with defaults, enum symbols added once the enum has
a default). A record version that older readers cannot read -- one that drops fields, or adds an enum symbol to an
enum without a default -- goes to a new topic version, and ``record_versions`` says which versions of its record
type each topic carries (``tests/unit/schemas/test_codec.py`` checks that no topic carries two versions that do not
read each other). The topics an older release wrote (``LEGACY_TOPICS``) keep their data for the readers of that
release until their retention ends: no gpumeter service writes them, ``gpumeter topics create`` does not create
them, and docs/migration-v2.md and docs/migration-v4.md say how to move.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from schemas.records import (
    CostRecord,
    DeadLetter,
    GpuShare,
    NodeSample,
    NodeWindowCost,
    NodeWindowShares,
    PodEvent,
    Violation,
)


@dataclass(frozen=True)
class TopicSpec:
    """One topic. ``name`` excludes the catalog prefix."""

    name: str
    record_type: type
    key: str
    partitions: int
    cleanup_policy: str
    retention_ms: int
    producers: tuple[str, ...]
    consumers: tuple[str, ...]
    doc: str
    extra_config: tuple[tuple[str, str], ...] = field(default=())
    record_versions: tuple[int, ...] = (1,)  # the versions of record_type written to this topic

    def config(self) -> dict[str, str]:
        config = {"cleanup.policy": self.cleanup_policy, "retention.ms": str(self.retention_ms)}
        config.update(dict(self.extra_config))
        return config


HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS

NODE_SAMPLES = TopicSpec(
    name="gpumeter.node-samples.v3",
    record_type=NodeSample,
    key="node_name",
    partitions=12,
    cleanup_policy="delete",
    retention_ms=DAY_MS,
    producers=("collector",),
    consumers=("attributor", "guard"),
    doc="One NodeSample per node per tick (the hot topic). NodeSample v4: packed little-endian columns (bytes "
        "fields, read with numpy.frombuffer), pod uids as 16-byte binary (schemas.packed). "
        "Stamped by the broker (LogAppendTime): the clock a node's own is measured against (gpumeter.clockskew).",
    extra_config=(("message.timestamp.type", "LogAppendTime"),),
    record_versions=(4,),
)
POD_EVENTS = TopicSpec(
    name="gpumeter.pod-events.v1",
    record_type=PodEvent,
    key="<node_name>/<pod uid>, partitioned by node_name",
    partitions=12,
    cleanup_policy="compact",
    retention_ms=-1,
    producers=("collector",),
    consumers=("attributor", "guard"),
    doc="Pod changes on GPU nodes; compacted to the latest state per pod. PodEvent v3: a DRA device's owning claim, "
        "the namespace's labels. Stamped by the broker (LogAppendTime).",
    extra_config=(("min.compaction.lag.ms", str(HOUR_MS)), ("delete.retention.ms", str(DAY_MS)),
                  ("message.timestamp.type", "LogAppendTime")),
    record_versions=(1, 2, 3),
)
NODE_WINDOW_SHARES = TopicSpec(
    name="gpumeter.node-window-shares.v1",
    record_type=NodeWindowShares,
    key="node_name, partitioned by node_name",
    partitions=12,
    cleanup_policy="delete",
    retention_ms=7 * DAY_MS,
    producers=("attributor",),
    consumers=("billing", "guard"),
    doc="One NodeWindowShares per node and window: every unit's subjects' shares, adding up to 1 per unit.",
)
NODE_WINDOW_COSTS = TopicSpec(
    name="gpumeter.node-window-costs.v1",
    record_type=NodeWindowCost,
    key="node_name, partitioned by node_name",
    partitions=12,
    cleanup_policy="delete",
    retention_ms=30 * DAY_MS,
    producers=("billing",),
    consumers=("guard",),
    doc="One NodeWindowCost per node-window bill, with all its cost lines, adding up to the bill exactly.",
)
COSTS = TopicSpec(
    name="gpumeter.costs.v2",
    record_type=CostRecord,
    key="node_name",
    partitions=12,
    cleanup_policy="delete",
    retention_ms=30 * DAY_MS,
    producers=("billing",),
    consumers=("external cost consumers", "gpumeter run's live view"),
    doc="The realtime per-pod cost stream: one CostRecord per line, one batch per node-window, adding up to the "
        "node bills exactly. CostRecord v2 (the UNAVAILABLE subject, direct and shared lines).",
    record_versions=(2,),
)
VIOLATIONS = TopicSpec(
    name="gpumeter.violations.v1",
    record_type=Violation,
    key="fingerprint",
    partitions=3,
    cleanup_policy="compact",
    retention_ms=-1,
    producers=("guard",),
    consumers=("alerting", "gpumeter violations"),
    doc="Guardrail violations; the latest record per fingerprint is its state.",
)
DEAD_LETTERS = TopicSpec(
    name="gpumeter.dead-letters.v1",
    record_type=DeadLetter,
    key="source topic",
    partitions=3,
    cleanup_policy="delete",
    retention_ms=14 * DAY_MS,
    producers=("collector", "attributor", "billing", "guard"),
    consumers=("operators",),
    doc="Every input a service rejected, whole, with the reason.",
    record_versions=(1, 2),
)
# One record per (window, unit, subject), what the attributor wrote before the node-window records
# (docs/migration-v2.md). GpuShare v2 added the UNAVAILABLE subject to an enum that v1 readers have without a
# default, so v2 records had a topic of their own.
GPU_SHARES = TopicSpec(
    name="gpumeter.gpu-shares.v2",
    record_type=GpuShare,
    key="node_name",
    partitions=12,
    cleanup_policy="delete",
    retention_ms=7 * DAY_MS,
    producers=("attributor before node-window records",),
    consumers=("billing and guard before node-window records",),
    doc="Per (window, GPU unit, subject) shares that add up to 1 per unit and window. GpuShare v2.",
    record_versions=(2,),
)
GPU_SHARES_V1 = TopicSpec(
    name="gpumeter.gpu-shares.v1",
    record_type=GpuShare,
    key="node_name",
    partitions=12,
    cleanup_policy="delete",
    retention_ms=7 * DAY_MS,
    producers=("attributor before GpuShare v2",),
    consumers=("billing and guard before GpuShare v2",),
    doc="GpuShare v1 rows (no UNAVAILABLE subject).",
)
NODE_SAMPLES_V2 = TopicSpec(
    name="gpumeter.node-samples.v2",
    record_type=NodeSample,
    key="node_name",
    partitions=12,
    cleanup_policy="delete",
    retention_ms=DAY_MS,
    producers=("collector before NodeSample v4",),
    consumers=("attributor and guard before NodeSample v4",),
    doc="NodeSample v3 per node per tick (arrays of int/long per process, pod uids as strings); "
        "docs/migration-v4.md.",
    extra_config=(("message.timestamp.type", "LogAppendTime"),),
    record_versions=(3,),
)
NODE_SAMPLES_V1 = TopicSpec(
    name="gpumeter.node-samples.v1",
    record_type=NodeSample,
    key="node_name",
    partitions=12,
    cleanup_policy="delete",
    retention_ms=DAY_MS,
    producers=("collector before node-window records",),
    consumers=("attributor and guard before node-window records",),
    doc="NodeSample v1 and v2 per node per tick, with container ids.",
    record_versions=(1, 2),
)
COSTS_V1 = TopicSpec(
    name="gpumeter.costs.v1",
    record_type=CostRecord,
    key="node_name",
    partitions=12,
    cleanup_policy="delete",
    retention_ms=30 * DAY_MS,
    producers=("billing before node-window records",),
    consumers=("external cost consumers of CostRecord v1",),
    doc="CostRecord v1 lines (no UNAVAILABLE subject, no shared lines).",
)

ALL_TOPICS: tuple[TopicSpec, ...] = (NODE_SAMPLES, POD_EVENTS, NODE_WINDOW_SHARES, NODE_WINDOW_COSTS, COSTS,
                                     VIOLATIONS, DEAD_LETTERS)
LEGACY_TOPICS: tuple[TopicSpec, ...] = (NODE_SAMPLES_V2, NODE_SAMPLES_V1, GPU_SHARES_V1, GPU_SHARES, COSTS_V1)


@dataclass(frozen=True)
class TopicCatalog:
    """The catalog under one name prefix, optionally with another partition count for every topic."""

    prefix: str = ""
    partitions_override: int | None = None

    def name(self, spec: TopicSpec) -> str:
        return self.prefix + spec.name

    def partitions(self, spec: TopicSpec) -> int:
        return self.partitions_override or spec.partitions

    def __iter__(self) -> Iterator[TopicSpec]:
        return iter(ALL_TOPICS)

    @property
    def node_samples(self) -> str:
        return self.name(NODE_SAMPLES)

    @property
    def pod_events(self) -> str:
        return self.name(POD_EVENTS)

    @property
    def node_window_shares(self) -> str:
        return self.name(NODE_WINDOW_SHARES)

    @property
    def node_window_costs(self) -> str:
        return self.name(NODE_WINDOW_COSTS)

    @property
    def costs(self) -> str:
        return self.name(COSTS)

    @property
    def violations(self) -> str:
        return self.name(VIOLATIONS)

    @property
    def dead_letters(self) -> str:
        return self.name(DEAD_LETTERS)


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash (the Java client's ``Utils.murmur2``), as a signed 32-bit int."""
    length = len(data)
    seed = 0x9747B28C
    m = 0x5BD1E995
    r = 24
    h = (seed ^ length) & 0xFFFFFFFF
    length4 = length // 4
    for i in range(length4):
        i4 = i * 4
        k = (data[i4] & 0xFF) + ((data[i4 + 1] & 0xFF) << 8) + ((data[i4 + 2] & 0xFF) << 16) + ((data[i4 + 3] & 0xFF) << 24)
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    extra = length % 4
    index = length & ~3
    if extra == 3:
        h ^= (data[index + 2] & 0xFF) << 16
    if extra >= 2:
        h ^= (data[index + 1] & 0xFF) << 8
    if extra >= 1:
        h ^= data[index] & 0xFF
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for_node(node_name: str, partition_count: int) -> int:
    """The partition of every sample and pod event of ``node_name``: Kafka's default partitioner on the node name."""
    return (murmur2(node_name.encode("utf-8")) & 0x7FFFFFFF) % partition_count


def pod_event_key(node_name: str, pod_uid: str) -> bytes:
    """Compaction key of a pod event: one live record per pod."""
    return f"{node_name}/{pod_uid}".encode("utf-8")
