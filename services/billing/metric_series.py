"""Which labelled Prometheus series billing still exports, so that series of pods and nodes that are gone go away.

Without this every pod that ever ran keeps its ``gpumeter_pod_gpu_cost_micro_usd_total`` series for the life of
the process (1,003 series after 1,000 pods came and went), and Prometheus stores each one.

``SeriesBook`` (pure; one per metric) knows, for each label set, the nodes that hold it and the window start in
which each node last billed it:

* ``observe(node, window, label_sets, prune=True)``: the label sets a node billed in a window. With ``prune``, a
  label set the node held whose last window is older than this one, and that this window lacks, is let go by the
  node -- the pod ended (or lost its GPU, or changed its team label) on that node; a window older than the node's
  newest (billed late) lets nothing go. A label set no node holds any more is removed from the metric: a counter
  then stops at its last value, which Prometheus has scraped at least one window before (its ``increase()`` and
  ``rate()`` treat a series that comes back as a reset).
* ``forget(node)``: the node is gone (no window of it for the billing service's memory horizon): it lets go of
  every label set it held.

``remove(label_set)`` is the metric's own ``remove``.

``BillingSeries`` (pure: no clock, no Kafka; one per billing processor) moves billing's labelled series for each
newly billed node-window -- node cost, kept buckets, each pod's direct and shared cost, each pod's memory and
compute share of each GPU unit -- and keeps them bounded with one ``SeriesBook`` per metric: a pod's series go
once a newer window of its node is billed without them, a node's (and whatever of its pods is left) once no
window of it was billed for ``node_memory_ms``.

The per-pod series carry dcgm-exporter's labels (``gpumeter.metrics.DCGM_JOIN_LABELS``) beside ``namespace``,
``pod`` and ``team``, filled from what a ``GpuShare`` knows (``dcgm_labels``):

* ``UUID``: the physical GPU's UUID, as dcgm-exporter reports it -- a MIG instance's ``parent_gpu_uuid``, else the
  unit's ``gpu_uuid`` (a time-sliced or MPS GPU is one unit under its own UUID);
* ``modelName``: the unit's ``gpu_model`` (NVML's name of the GPU; a MIG instance carries its parent's);
* ``Hostname`` and ``hostname``: the node name (dcgm-exporter's spelling before and after its #655);
* ``GPU_I_PROFILE``, ``GPU_I_ID``: a MIG instance's profile (``3g.40gb``) and GPU instance id, as NVML gave them to
  the collector and the attributor carried them (``GpuShare.mig_profile``, ``mig_gpu_instance_id``); empty for a
  whole GPU (Prometheus stores an empty label as no label, which is what dcgm-exporter shows for a whole GPU) and
  when NVML could not say;
* ``container``: empty. Shares are per pod: no GpuShare field names a container, and a pod's GPU time is not
  split between its containers;
* a shared line (a bucket of the node shared to the pod) belongs to no GPU: ``UUID`` and ``modelName`` empty too.

The direct-cost counter is per pod and GPU (its ``UUID``); the share gauges keep ``gpu_uuid``, the unit's own id
(``MIG-...`` for an instance), so that two instances of one GPU held by one pod stay two series.
"""

from __future__ import annotations

import logging
from typing import Callable, Hashable, Iterable, Mapping, Sequence

from gpumeter.metrics import child_factory
from schemas.records import CostSubjectKind, GpuShare, ShareSubjectKind
from services.billing.costing import NodeWindowCost, NodeWindowKey

log = logging.getLogger(__name__)

NodeKey = tuple[str, str]
LabelSet = tuple[str, ...]


class SeriesBook:
    """The label sets of one metric, by the nodes that hold them (see the module docstring)."""

    def __init__(self, remove: Callable[..., None]) -> None:
        self._remove = remove
        self._held: dict[Hashable, dict[LabelSet, int]] = {}  # node -> label set -> last window start
        self._newest: dict[Hashable, int] = {}
        self._holders: dict[LabelSet, set[Hashable]] = {}

    def observe(self, node: Hashable, window_start_ms: int, label_sets: Iterable[LabelSet], *,
                prune: bool = True) -> None:
        held = self._held.setdefault(node, {})
        present = set(label_sets)
        for labels in present:
            if held.get(labels, window_start_ms - 1) < window_start_ms:
                held[labels] = window_start_ms
            self._holders.setdefault(labels, set()).add(node)
        newest = self._newest.get(node)
        if newest is not None and window_start_ms < newest:
            return  # billed late: the newer windows already said what is gone
        self._newest[node] = window_start_ms
        if prune:
            for labels in [labels for labels, last in held.items() if last < window_start_ms and labels not in present]:
                self._let_go(node, labels)

    def forget(self, node: Hashable) -> None:
        for labels in list(self._held.get(node, ())):
            self._let_go(node, labels)
        self._held.pop(node, None)
        self._newest.pop(node, None)

    def _let_go(self, node: Hashable, labels: LabelSet) -> None:
        self._held[node].pop(labels, None)
        holders = self._holders.get(labels)
        if holders is None:
            return
        holders.discard(node)
        if not holders:
            del self._holders[labels]
            try:
                self._remove(*labels)
            except KeyError:
                pass  # never created (or removed already): nothing to take away

    def __len__(self) -> int:
        return len(self._holders)

    def __contains__(self, labels: LabelSet) -> bool:
        return labels in self._holders


def dcgm_labels(share: GpuShare | None, node_name: str) -> tuple[str, ...]:
    """The values of ``gpumeter.metrics.DCGM_JOIN_LABELS`` for a pod's line on ``share``'s GPU unit (None: a line
    of no GPU) on node ``node_name`` (the module docstring says what each one holds)."""
    uuid = model = profile = instance = ""
    if share is not None:
        uuid = share.parent_gpu_uuid or share.gpu_uuid
        model = share.gpu_model
        profile = share.mig_profile or ""
        instance = "" if share.mig_gpu_instance_id is None else str(share.mig_gpu_instance_id)
    return ("", uuid, profile, instance, model, node_name, node_name)


POD_COST = "gpumeter_pod_gpu_cost_micro_usd_total"
SHARED_COST = "gpumeter_pod_shared_cost_micro_usd_total"
MEMORY_SHARE = "gpumeter_pod_gpu_memory_share"
COMPUTE_SHARE = "gpumeter_pod_gpu_compute_share"
NODE_COST = "gpumeter_node_cost_micro_usd_total"
BUCKET_COST = "gpumeter_bucket_cost_micro_usd_total"
_LABELLED = (POD_COST, SHARED_COST, MEMORY_SHARE, COMPUTE_SHARE, NODE_COST, BUCKET_COST)


class BillingSeries:
    """Billing's labelled series, moved by each newly billed node-window and kept bounded (module docstring).

    ``metrics`` is the service's ``gpumeter.metrics.ServiceMetrics`` (with the six metrics above); ``team_label``
    the pod label whose value is the ``team`` label. ``observe(key, shares, priced)`` takes a node-window the
    ledger billed for the first time: its share rows and what it cost. ``series_count()`` is the number of label
    sets held per metric (the share gauges are one book: memory and compute go together)."""

    def __init__(self, metrics, *, team_label: str, node_memory_ms: int) -> None:
        self.metrics = metrics
        self.team_label = team_label
        self.node_memory_ms = node_memory_ms
        self._node_newest: dict[tuple[str, str], int] = {}
        self._newest_window_ms: int | None = None
        # Each metric's children through ``gpumeter.metrics.child_factory``: prometheus_client's ``labels()``
        # checks and converts its arguments on every call and builds a new child through the constructor, which
        # validates every label name again (~227 calls per bench node-window, a fifth of billing's CPU; most of it
        # making the children of pods first seen, as every pod is after a restart).
        self._children: dict[str, Callable[[LabelSet], object]] = {
            name: child_factory(self.metrics.get(name)) for name in _LABELLED}
        self._books: dict[str, SeriesBook] = {
            name: SeriesBook(self._remover(name)) for name in (POD_COST, SHARED_COST, NODE_COST, BUCKET_COST)
        }
        remove_memory, remove_compute = self._remover(MEMORY_SHARE), self._remover(COMPUTE_SHARE)

        def remove_share(*labels: str) -> None:
            remove_memory(*labels)
            remove_compute(*labels)

        self._books[MEMORY_SHARE] = SeriesBook(remove_share)

    def _remover(self, name: str) -> Callable[..., None]:
        return self.metrics.get(name).remove

    def _child(self, name: str) -> Callable[[LabelSet], object]:
        """``labels -> metric.labels(*labels)`` (see ``_children``)."""
        return self._children[name]

    def series_count(self) -> dict[str, int]:
        return {name: len(book) for name, book in self._books.items()}

    def _team(self, labels: Mapping[str, str]) -> str:
        return labels.get(self.team_label, "")

    def observe(self, key: NodeWindowKey, shares: Sequence[GpuShare], priced: NodeWindowCost) -> None:
        bill = priced.bill
        node = (key.cluster, key.node_name)
        start_ms = key.window_start_unix_ms
        units = {share.gpu_uuid: share for share in shares}
        node_labels = (bill.node_name, bill.instance_type)
        self._child(NODE_COST)(node_labels).inc(bill.node_cost_micro_usd)
        pod_cost, shared_cost, bucket_cost = self._child(POD_COST), self._child(SHARED_COST), self._child(BUCKET_COST)
        pods: set[tuple[str, ...]] = set()
        shared: set[tuple[str, ...]] = set()
        buckets: set[tuple[str, ...]] = set()
        for record in priced.costs:
            if record.subject_kind is CostSubjectKind.POD:
                pod = (record.namespace or "", record.pod_name or "", self._team(record.labels))
                gpu = dcgm_labels(units.get(record.gpu_uuid) if record.gpu_uuid else None, key.node_name)
                if record.shared_from is not None:
                    labels = (*pod, record.shared_from.value.lower(), *gpu)
                    shared_cost(labels).inc(record.cost_micro_usd)
                    shared.add(labels)
                    continue
                labels = (*pod, *gpu)
                pod_cost(labels).inc(record.cost_micro_usd)
                pods.add(labels)
            else:
                labels = (bill.node_name, record.subject_kind.value.lower())
                bucket_cost(labels).inc(record.cost_micro_usd)
                buckets.add(labels)
        self._books[POD_COST].observe(node, start_ms, pods)
        self._books[SHARED_COST].observe(node, start_ms, shared)
        # A node's own series are few and bounded: kept (a bucket missing from one window is no news) until the
        # node is gone.
        self._books[NODE_COST].observe(node, start_ms, (node_labels,), prune=False)
        self._books[BUCKET_COST].observe(node, start_ms, buckets, prune=False)
        self._set_share_gauges(key, shares)
        self._forget_gone_nodes(node, start_ms)

    def _set_share_gauges(self, key: NodeWindowKey, shares: Sequence[GpuShare]) -> None:
        node = (key.cluster, key.node_name)
        newest = self._node_newest.get(node)
        if newest is not None and newest > key.window_start_unix_ms:
            return  # an older window billed late: the gauges already show a newer one
        memory, compute = self._child(MEMORY_SHARE), self._child(COMPUTE_SHARE)
        series: set[tuple[str, ...]] = set()
        for share in shares:
            if share.subject_kind is not ShareSubjectKind.POD:
                continue
            labels = (share.namespace or "", share.pod_name or "", self._team(share.labels), share.gpu_uuid,
                      *dcgm_labels(share, key.node_name))
            series.add(labels)
            memory(labels).set(share.memory_share)
            compute(labels).set(share.compute_share)
        self._books[MEMORY_SHARE].observe(node, key.window_start_unix_ms, series)

    def _forget_gone_nodes(self, node: tuple[str, str], start_ms: int) -> None:
        """Remember ``node``'s newest billed window; when the newest window of all moves on, forget the series of
        every node that billed nothing for the memory horizon (scaled down, renamed, gone)."""
        if self._node_newest.get(node, start_ms - 1) < start_ms:
            self._node_newest[node] = start_ms
        if self._newest_window_ms is not None and start_ms <= self._newest_window_ms:
            return
        self._newest_window_ms = start_ms
        horizon = start_ms - self.node_memory_ms
        for gone in [n for n, newest in self._node_newest.items() if newest < horizon]:
            del self._node_newest[gone]
            for book in self._books.values():
                book.forget(gone)
            log.info("no window of node %s/%s for %.0f s: its metric series are removed", gone[0], gone[1],
                     self.node_memory_ms / 1000)


__all__ = ["BillingSeries", "SeriesBook", "dcgm_labels"]
