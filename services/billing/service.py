"""The billing service's logic on the one runner: node-windows of shares in, node bills into the ledger, costs out.

Two parts, neither holding a Kafka client; ``services/billing/main.py`` runs them on ``gpumeter.kafka.driver``'s
``KafkaDriver`` and ``gpumeter replay`` on ``gpumeter.stream.memory``'s ``MemoryDriver``, so the stream and replay
bill alike, bad input included.

``BillingProcessor`` (``gpumeter.stream.contract.Processor``), per message of the node-window-shares topic -- one
node-window whole (the runner has decoded it and checked it with ``gpumeter.validation.check_window_shares``:
``OUT_OF_RANGE`` for a window impossible on its own, e.g. one that has not ended yet beyond
``max_clock_skew_seconds``, which billed would take the real window's ledger keys):
prices its rows (``NodeWindowShares.rows()``) with ``bill_node_window`` and the configured sharing policy (buckets
kept or shared to the node-window's pods, ``services.billing.sharing``) and returns the priced window as its one
state change (``PricedWindow``). No price for the node (``PriceError``) rejects the message ``NO_PRICE``; shares
that cannot all be true together (``InconsistentShares``, ``OutOfRange``) reject it with that reason. It never
emits by itself: what goes out depends on the ledger.

``LedgerStore`` (``gpumeter.stream.contract.Store``) makes the priced windows of a batch durable in one
``Ledger.write`` (one transaction; a node-window twice in one batch -- a redelivery -- is written in a second call,
since one write may not hold two bills of a node-window) and answers per window what it owes: if and only if the
ledger says its bill is new, or it was billed but never marked published and is not on its way from this process
already, its ``CostRecord``s (role ``costs``, one batch keyed by node name) and its ``NodeWindowCost`` (role
``window_costs``: the bill and every line in one record); a bill the ledger already holds owes nothing. Once the
driver saw every owed record acknowledged it calls ``published``, which marks those windows published in the
ledger. Ledger failures:

* unreachable (connection refused, server restarting, connection lost) → ``StoreUnavailable``: the driver retries
  the same changes with backoff, forever, without consuming further or committing (a window written before the
  failure in the same call keeps its outcome: it is not mistaken for a duplicate on the retry);
* the database refusing the values (``DataError``/``IntegrityError``) → the batch's windows are written again one
  at a time, and each one refused on its own is answered ``LEDGER_REJECTED`` (its message is dead-lettered, the
  others are billed);
* anything else (missing schema, a write that would not reconcile) is a bug or a deployment error: it propagates
  and stops the service without committing.

The driver commits input only after every owed record is acknowledged, so a crash re-reads exactly what was not
billed and published yet, and the ledger's first-write-wins keeps the redelivery harmless. A crash after the ledger
commit and before the published mark leaves the window unpublished: its redelivery is a duplicate the ledger
reports as never published, and its records are published then (once: the mark follows).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence

from sqlalchemy import exc as sa_exc

from gpumeter.errors import InvalidMessage
from gpumeter.kafka.outbox import next_backoff_seconds
from gpumeter.stream.contract import DEAD_LETTERS, NOTHING, Emit, Event, Input, Position, Result, Settled
from gpumeter.stream.contract import StoreUnavailable
from gpumeter.validation import DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS, check_window_shares
from schemas.catalog import TopicCatalog
from schemas.records import CostRecord, GpuShare, NodeWindowShares
from services.billing.catalog import PriceCatalog, PriceError
from services.billing.costing import NodeWindowCost, NodeWindowKey, bill_node_window, window_cost_record
from services.billing.ledger import LedgerError, LedgerUnusable, WriteResult
from services.billing.metric_series import BillingSeries
from services.billing.pricing import DEFAULT_SPLIT_POLICY, SplitPolicy
from services.billing.sharing import KEEP_ALL, SharingPolicy

log = logging.getLogger(__name__)

SERVICE_NAME = "billing"

# Input and output roles (gpumeter.stream.contract); ``billing_topics`` maps them to the catalog's topics.
WINDOW_SHARES = "window_shares"
COSTS = "costs"
WINDOW_COSTS = "window_costs"

# The metrics this service exports (all names from gpumeter.metrics.METRICS).
BILLING_METRICS = (
    "gpumeter_messages_consumed_total",
    "gpumeter_dead_letters_total",
    "gpumeter_dead_letters_truncated_total",
    "gpumeter_recent_dead_letter_ratio",
    "gpumeter_pod_gpu_cost_micro_usd_total",
    "gpumeter_pod_shared_cost_micro_usd_total",
    "gpumeter_pod_gpu_memory_share",
    "gpumeter_pod_gpu_compute_share",
    "gpumeter_node_cost_micro_usd_total",
    "gpumeter_bucket_cost_micro_usd_total",
    "gpumeter_billing_ledger_rows_written_total",
    "gpumeter_billing_duplicate_rows_total",
)


def billing_inputs(topics: TopicCatalog) -> dict[str, str]:
    """The processor's input roles -> topic names."""
    return {WINDOW_SHARES: topics.node_window_shares}


def billing_outputs(topics: TopicCatalog) -> dict[str, str]:
    """The output roles (the store's owed records, the runner's dead letters) -> topic names."""
    return {COSTS: topics.costs, WINDOW_COSTS: topics.node_window_costs, DEAD_LETTERS: topics.dead_letters}


class NoPrice(InvalidMessage):
    """A node-window no price in the catalog covers."""

    reason_code = "NO_PRICE"


class LedgerRejected(InvalidMessage):
    """A node-window whose values the ledger's database refused (too long, out of range)."""

    reason_code = "LEDGER_REJECTED"


# -- the processor ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PricedWindow:
    """One node-window as it arrived (``record``, and its rows ``shares``: one ``GpuShare`` per unit and subject)
    and its costing: the state change the ledger makes durable."""

    record: NodeWindowShares
    shares: tuple[GpuShare, ...]
    priced: NodeWindowCost

    @property
    def key(self) -> NodeWindowKey:
        return NodeWindowKey(self.record.cluster, self.record.node_name, self.record.window_start_unix_ms)

    def owed(self) -> tuple[Emit, ...]:
        """What a new bill publishes: its cost lines (flat, in bill order), then the whole bill in one record."""
        node_key = self.record.node_name.encode("utf-8")
        lines = tuple(Emit(COSTS, node_key, record) for record in self.priced.costs)
        return lines + (Emit(WINDOW_COSTS, node_key, window_cost_record(self.priced, self.record)),)


class BillingProcessor:
    """Prices node-windows (see the module docstring). Pure: no Kafka, no ledger, no clock of its own (the
    runner's clock judges timestamps)."""

    service = SERVICE_NAME

    def __init__(self, *, catalog: PriceCatalog, policy: SplitPolicy = DEFAULT_SPLIT_POLICY,
                 sharing: SharingPolicy = KEEP_ALL,
                 max_clock_skew_seconds: int = DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS) -> None:
        self.catalog = catalog
        self.policy = policy
        self.sharing = sharing
        self.max_clock_skew_ms = max_clock_skew_seconds * 1000
        self.inputs = (Input(WINDOW_SHARES, NodeWindowShares, self._check),)

    def _check(self, record: NodeWindowShares, now_ms: int) -> None:
        check_window_shares(record, now_ms, self.max_clock_skew_ms)

    def handle(self, event: Event, position: Position) -> Result:
        record: NodeWindowShares = event.record
        shares = record.rows()
        try:
            priced = bill_node_window(shares, self.catalog, self.policy, self.sharing)
        except PriceError as exc:
            raise NoPrice(f"{record.cluster}/{record.node_name}: {exc}") from exc
        return Result(changes=(PricedWindow(record, shares, priced),))

    def on_clock(self, now_ms: int, caught_up: bool = True) -> Result:
        return NOTHING


# -- the ledger as the runner's store -----------------------------------------------------------------------------


def is_transient_ledger_error(error: LedgerError) -> bool:
    """True when the database could not be reached or the connection broke, or a SQLite file cannot be used safely
    for now (retry); False for anything else."""
    if isinstance(error, LedgerUnusable):
        return error.retry
    cause = error.__cause__
    if isinstance(cause, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError,
                          sa_exc.TimeoutError)):
        return True
    return isinstance(cause, sa_exc.DBAPIError) and bool(cause.connection_invalidated)


def is_rejected_by_ledger(error: LedgerError) -> bool:
    """True when the database refused the values themselves (the same write would fail again)."""
    return isinstance(error.__cause__, (sa_exc.DataError, sa_exc.IntegrityError))


class LedgerWriter(Protocol):
    def write(self, costs: Iterable[CostRecord], bills: Iterable[Any]) -> WriteResult: ...

    def mark_published(self, keys: Iterable[Any], published_at_unix_ms: int) -> int: ...


@dataclass
class BillingStats:
    windows_billed: int = 0
    windows_already_billed: int = 0
    windows_republished: int = 0
    windows_rejected_by_ledger: int = 0
    cost_records_owed: int = 0
    ledger_writes: int = 0


def _distinct_runs(changes: Sequence[PricedWindow]) -> list[list[PricedWindow]]:
    """``changes`` cut, in order, into runs without two windows of the same key."""
    runs: list[list[PricedWindow]] = []
    keys: set[NodeWindowKey] = set()
    for change in changes:
        if not runs or change.key in keys:
            runs.append([])
            keys = set()
        runs[-1].append(change)
        keys.add(change.key)
    return runs


class LedgerStore:
    """The billing ledger as the runner's ``Store`` (see the module docstring). ``metrics``: the service's
    ``ServiceMetrics`` (None: none kept); the per-pod series (``BillingSeries``) move with each new bill."""

    def __init__(self, ledger: LedgerWriter, *, metrics: Any = None, team_label: str = "team",
                 series_memory_seconds: float = 3600.0) -> None:
        self.ledger = ledger
        self.metrics = metrics
        self.stats = BillingStats()
        self._publishing: set[NodeWindowKey] = set()  # owed by this process, not yet marked published
        self._unmarked: set[NodeWindowKey] = set()  # acknowledged, marking them published failed: tried again
        # Outcomes of a call that failed part-way (StoreUnavailable), by the change object the retry passes again.
        self._partial: dict[int, tuple[PricedWindow, Settled]] = {}
        # Labelled series by the nodes that hold them (services.billing.metric_series): a pod's series go once a
        # newer window of its node lacks it, a node's once it has billed nothing for series_memory_seconds.
        self.series = None if not metrics else BillingSeries(
            metrics, team_label=team_label, node_memory_ms=int(series_memory_seconds * 1000))

    def apply(self, changes: Sequence[PricedWindow]) -> list[Settled]:
        pending = [change for change in changes if not self._done(change)]
        for run in _distinct_runs(pending):
            self._write(run)
        outcomes = [self._partial.pop(id(change))[1] for change in changes]
        return outcomes

    def _done(self, change: PricedWindow) -> bool:
        entry = self._partial.get(id(change))
        return entry is not None and entry[0] is change

    def _write(self, run: list[PricedWindow]) -> None:
        """One ``Ledger.write`` of ``run`` (distinct node-windows); each outcome goes to ``_partial``."""
        costs = [cost for change in run for cost in change.priced.costs]
        bills = [change.priced.bill for change in run]
        try:
            self.stats.ledger_writes += 1
            result = self.ledger.write(costs, bills)
        except LedgerError as exc:
            if is_transient_ledger_error(exc):
                more = f" and {len(run) - 1} more node-windows" if len(run) > 1 else ""
                raise StoreUnavailable(f"ledger unavailable writing {run[0].key}{more}: {exc}") from exc
            if not is_rejected_by_ledger(exc):
                raise
            if len(run) > 1:
                # One refused node-window refuses the whole transaction: alone, each one is billed or refused.
                log.warning("the ledger refused a write of %d node-windows, writing them one at a time: %s",
                            len(run), exc)
                for change in run:
                    self._write([change])
                return
            self.stats.windows_rejected_by_ledger += 1
            self._partial[id(run[0])] = (run[0], Settled(rejected=LedgerRejected(str(exc))))
            return
        for change in run:
            self._partial[id(change)] = (change, self._settled(change, result))

    def _settled(self, change: PricedWindow, result: WriteResult) -> Settled:
        key = change.key
        lines = len(change.priced.costs)
        # Never marked published, and not already on its way from this process (a redelivery in the same batch
        # as the first delivery): publish it.
        republish = key in result.unpublished and key not in self._publishing
        if key in result.written:
            self.stats.windows_billed += 1
            self._observe_new_bill(change)
            log.debug("billed %s: %d micro-USD in %d cost records", key, change.priced.bill.node_cost_micro_usd,
                      lines)
        elif republish:
            self.stats.windows_republished += 1
            log.info("%s was in the ledger but never published: publishing its cost records now", key)
        else:
            self.stats.windows_already_billed += 1
            if self.metrics:
                self.metrics.get("gpumeter_billing_duplicate_rows_total").inc(lines)
            log.debug("%s is already in the ledger: nothing published", key)
            return Settled()
        self._publishing.add(key)
        self.stats.cost_records_owed += lines
        return Settled(owed=change.owed())

    def published(self, changes: Sequence[PricedWindow], now_ms: int) -> None:
        keys = {change.key for change in changes} | self._unmarked
        try:
            self.ledger.mark_published(tuple(keys), now_ms)
        except LedgerError as exc:
            # Left unmarked, they are published once more after a restart: at least once, never lost.
            self._unmarked = keys
            log.warning("could not mark %d node-windows published, will retry: %s", len(keys), exc)
            return
        self._unmarked = set()
        self._publishing.difference_update(keys)

    def _observe_new_bill(self, change: PricedWindow) -> None:
        if not self.metrics:
            return
        # The ledger writes every line of a new bill.
        self.metrics.get("gpumeter_billing_ledger_rows_written_total").inc(len(change.priced.costs))
        self.series.observe(change.key, change.shares, change.priced)


__all__ = [
    "BILLING_METRICS",
    "COSTS",
    "SERVICE_NAME",
    "WINDOW_COSTS",
    "WINDOW_SHARES",
    "BillingProcessor",
    "BillingStats",
    "LedgerRejected",
    "LedgerStore",
    "NoPrice",
    "PricedWindow",
    "billing_inputs",
    "billing_outputs",
    "is_rejected_by_ledger",
    "is_transient_ledger_error",
    "next_backoff_seconds",
]
