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
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable

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


__all__ = ["SeriesBook"]
