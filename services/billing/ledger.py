"""The SQL ledger of costs: SQLite file by default, PostgreSQL by URL (SQLAlchemy 2.x Core).

Tables (created only by the alembic migrations in ``services/billing/migrations``; ``Ledger.migrate()`` runs
``upgrade head``):

``price_versions``
    One row per ``NodePrice.price_version``: the rate, its split and the sources it came from.
``node_bills``
    One row per (window_start_unix_ms, cluster, node_name): the node's line item for the window and its split, its
    price version (``price_versions``; its lines have the bill's instance type, price model and price version and
    do not repeat them), and ``zero_lines``: the node-window's lines that carry no cost and no share, which are
    not ``cost_lines`` rows (``services.billing.line_storage``). On PostgreSQL from revision 0018 a view of these
    columns over ``node_bill_rows``, the bills as dictionary ids (``services.billing.bill_ids``): every reader reads
    it as the table it is on SQLite; ``write``, ``mark_published``, a publisher's claim and ``apply_trueup`` write
    the rows.
``cost_lines``
    One row per (window_start_unix_ms, cluster, node_name, gpu_uuid or '', subject_kind, pod_uid or '',
    shared_from or ''): a ``CostRecord`` that is not a zero line. A pod's direct lines (its own use of each unit)
    have ``shared_from`` ''; its shared lines (one per bucket kind its node-window shared to pods,
    ``services.billing.sharing``) name the bucket and the method. References its node bill, which records the
    sharing policy (``node_bills.sharing``), and its label set (``label_set_id``). On PostgreSQL (revision 0014)
    a view of these columns over the lines as dictionary ids (``services.billing.line_ids``): from revision 0016
    over ``cost_line_packs``, one row of arrays per node-window (``services.billing.line_packs``; 0014 and 0015:
    ``cost_line_rows``, a row per line); every reader reads it as the table it is on SQLite; ``write`` and
    ``apply_trueup`` write the packs (or rows).
``label_sets``
    One row per distinct (labels, carried label keys) of the lines, content-addressed (``line_storage``).
``trueups``
    One row per bill applied by ``gpumeter reconcile`` (``trueup_id``: the bill's digest): its file, format,
    basis, scope (``bill_scope``: providers, billing accounts and period, the same for every version of one bill)
    and totals.

**Trued-up cost** (``apply_trueup``): ``node_bills.trued_cost_micro_usd`` and ``cost_lines.trued_cost_micro_usd``
hold what a node-window and each of its lines cost once trued up to the invoice (``services.billing.trueup``),
beside the list-price ``node_cost_micro_usd`` / ``cost_micro_usd``, which are never changed. NULL: not trued up
(never reconciled, not billed, or outside the bill's line items). ``node_bills.trueup_id`` names the bill that
last set the window (also when it left it NULL: that bill did not charge it). Per trued window its trued lines
add up to its trued cost, checked before anything is written. Reads take ``cost="trued"`` for
``COALESCE(trued, list)``.

**The ledger is the arbiter of who publishes.** A ``Ledger`` opened with ``publisher=`` (billing: its consumer
group) records that name on every bill its write inserts (``node_bills.publisher``). A skipped node-window is
reported ``unpublished`` (its cost records still to be published) only to the publisher that inserted it -- the
same group after a crash between the ledger commit and Kafka's acknowledgement -- never to another instance that
merely wrote it again; a bill from before the column existed (no publisher) is claimed by the first publisher
that finds it unpublished, with a conditional UPDATE, so exactly one does. Every cost record therefore reaches the
costs topic from one instance only, however many instances with different groups bill the same shares.

Writes are idempotent and all-or-nothing per node-window. ``Ledger.write(costs, bills)`` checks that every cost line
has its bill in the same call and that each node-window's lines add up to its bill, then, in one transaction,
inserts the price versions and the bills (with their zero lines) with ``INSERT ... ON CONFLICT DO NOTHING
RETURNING``, and the label sets and cost lines of exactly the bills that were new (again ``ON CONFLICT DO NOTHING``;
a line priced otherwise than its bill is refused). A redelivered node-window — or any part of one — therefore never
bills twice, and a node-window is never half-written: on PostgreSQL a concurrent writer of the same node-window
waits on the bill's key and then skips it. The first write of a node-window wins: a later, different costing of it
(say, after a price change) is skipped too, never mixed in. Every reader gets the zero lines back: counted in the
sums and line counts, listed by ``iter_cost_lines``, ``billed_cost_lines`` and ``trueup_windows``.
Inserts are bulk (executemany, which SQLAlchemy batches into multi-row ``VALUES``).

Database errors are wrapped in ``LedgerError``. A SQLite file ledger's files are checked before every use
(``services.billing.sqlite_files``: folder, database, ``-wal`` and ``-shm`` writable, the mapped ``-shm`` neither
made unwritable nor cut; never by opening them, which would drop SQLite's locks): SQLite maps the ``-shm``, and a
mapping its file can no longer back kills the process with SIGBUS. Unfit files raise ``LedgerUnusable`` without
calling SQLite, and ``close()`` then leaves the connections open (``abandoned_ledgers``) rather than write the index
while closing.
"""

from __future__ import annotations

import re
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Double,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    bindparam,
    case,
    create_engine,
    event,
    func,
    literal,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from gpumeter.clock import iso_utc
from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.redact import mask_secrets, mask_url
from schemas.records import CostRecord, CostSubjectKind
from services.billing import bill_ids, focus_rollups, line_ids, line_packs, partitions, read_rollups, rollups
from services.billing.bulk_rows import DO_NOTHING, BulkInsert
from services.billing.rollups import KIND_TEXT
from services.billing.costing import NodeBill, NodeWindowKey
from services.billing.line_storage import (
    EMPTY_LABEL_SET_ID,
    ZeroLine,
    decode_zero_lines,
    encode_zero_lines,
    is_zero_line,
    label_set_id,
    zero_line_gpu_ids,
    zero_line_record,
)
from services.billing.sqlite_files import SqliteFiles
from services.billing.trueup import LedgerLine, LedgerWindow, TrueUp

if TYPE_CHECKING:
    from services.billing.allocation import AllocationQuery, BucketSum, PodSum

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
VERSION_TABLE = "gpumeter_billing_alembic_version"
DEFAULT_LEDGER_URL = "sqlite:///gpumeter-ledger.sqlite3"
LEDGER_URL_ENV = "GPUMETER_LEDGER_URL"
# Any constant works; it only has to be the same for every gpumeter process migrating one database.
_MIGRATION_LOCK_ID = 0x6770756D6574  # "gpumet"

NO_GPU = ""
NO_POD = ""
_LABEL_ID_CACHE = 65_536  # label-set ids remembered per handle (cleared when full)


class LedgerError(GpumeterError):
    """The ledger cannot be opened, migrated, written or read, or a write would break conservation."""


class MinuteLinesDropped(GpumeterError):
    """A read that needs minute cost lines over a range retention has dropped them from: it would report that part
    as costing nothing. Not a ``LedgerError``: the ledger is fine, the question is not answerable."""


class LedgerUnusable(LedgerError):
    """The SQLite ledger's files cannot be used safely now (``services.billing.sqlite_files``): SQLite was not
    called. ``retry``: waiting may cure it (a file made unwritable); else the process must exit without closing
    the ledger (a ``-shm`` truncated under its mapping)."""

    def __init__(self, message: str, *, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


# Engines whose SQLite files became unusable while mapped: kept referenced so that nothing ever closes them (closing
# writes the WAL index: SIGBUS); the process exits without finalising them (``abandoned_ledgers``).
_ABANDONED: list[Engine] = []
_ABANDONED_REASONS: list[str] = []


def abandoned_ledgers() -> tuple[str, ...]:
    """Why each ledger this process could not close safely was left open (empty: none was)."""
    return tuple(_ABANDONED_REASONS)


metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "pk": "pk_%(table_name)s",
        "fk": "fk_%(table_name)s_%(referred_table_name)s",
    }
)

# ``info`` key naming the one dialect whose ledger has a table, constraint or index: SQLite's ``cost_lines`` is a
# table with its primary and foreign keys (WITHOUT ROWID: the key is the table); PostgreSQL's is a view (migration
# 0014) over ``cost_line_rows`` and its dictionaries (``services.billing.line_ids``: no keys -- ``Ledger.write``
# alone inserts a line, with its bill -- and a (window, node id) index); from 0016 over ``cost_line_packs``
# (``services.billing.line_packs``: a node-window's lines one row, keyed by (window, node id)).
ONLY_ON = "gpumeter_only_on"

LABELS_TYPE = JSON().with_variant(postgresql.JSONB(), "postgresql")

price_versions = Table(
    "price_versions",
    metadata,
    Column("price_version", String(255), nullable=False),
    Column("provider", String(64), nullable=False),
    Column("region", String(64), nullable=False),
    Column("instance_type", String(128), nullable=False),
    Column("price_model", String(16), nullable=False),
    Column("price_per_hour_usd", String(40), nullable=False),
    Column("gpu_count", Integer, nullable=False),
    Column("gpu_price_per_hour_usd", String(40), nullable=False),
    Column("node_other_price_per_hour_usd", String(40), nullable=False),
    Column("split_rule", String(16), nullable=False),
    Column("derivation", Text, nullable=False),
    Column("sources", Text, nullable=False),
    PrimaryKeyConstraint("price_version"),
)

node_bills = Table(
    "node_bills",
    metadata,
    Column("window_start_unix_ms", BigInteger, nullable=False),
    Column("cluster", String(253), nullable=False),
    Column("node_name", String(253), nullable=False),
    Column("window_seconds", Integer, nullable=False),
    Column("billed_milliseconds", BigInteger, nullable=False),
    Column("provider", String(64), nullable=False),
    Column("region", String(64), nullable=False),
    Column("instance_type", String(128), nullable=False),
    Column("price_model", String(16), nullable=False),
    Column("gpu_count", Integer, nullable=False),
    Column("node_cost_micro_usd", BigInteger, nullable=False),
    Column("gpu_cost_micro_usd", BigInteger, nullable=False),
    Column("node_other_micro_usd", BigInteger, nullable=False),
    Column("price_version", String(255), nullable=False),
    Column("published_at_unix_ms", BigInteger, nullable=True),
    Column("publisher", String(255), nullable=True),
    Column("zone", String(64), nullable=False, server_default=""),
    Column("provider_id", String(512), nullable=False, server_default=""),
    Column("trued_cost_micro_usd", BigInteger, nullable=True),
    Column("trueup_id", String(64), nullable=True),
    Column("sharing", String(255), nullable=False, server_default="keep"),
    Column("zero_lines", Text, nullable=True),
    Column("gpu_model", String(128), nullable=False, server_default=""),
    # How many zero lines ``zero_lines`` lists: what the bill rollups count, without decoding it.
    Column("zero_line_count", Integer, nullable=False, server_default="0"),
    PrimaryKeyConstraint("window_start_unix_ms", "cluster", "node_name"),
    ForeignKeyConstraint(["price_version"], ["price_versions.price_version"]),
    Index(None, "node_name", "window_start_unix_ms"),
    # A table on SQLite (and PostgreSQL up to 0017); on PostgreSQL from 0018 a view of these columns over
    # ``BILL_IDS.rows`` and the dictionaries (``services.billing.bill_ids``): what every reader selects.
    info={ONLY_ON: "sqlite"},
)

label_sets = Table(
    "label_sets",
    metadata,
    Column("label_set_id", BigInteger, nullable=False, autoincrement=False),
    Column("labels", LABELS_TYPE, nullable=False),
    Column("carried_label_keys", Text, nullable=False),
    PrimaryKeyConstraint("label_set_id"),
)

cost_lines = Table(
    "cost_lines",
    metadata,
    Column("window_start_unix_ms", BigInteger, nullable=False),
    Column("cluster", String(253), nullable=False),
    Column("node_name", String(253), nullable=False),
    Column("gpu_uuid", String(128), nullable=False),
    Column("subject_kind", String(16), nullable=False),
    Column("pod_uid", String(128), nullable=False),
    Column("window_seconds", Integer, nullable=False),
    Column("namespace", String(253), nullable=True),
    Column("pod_name", String(253), nullable=True),
    Column("label_set_id", BigInteger, nullable=False, server_default="0"),
    Column("cost_share", Double, nullable=False),
    Column("cost_micro_usd", BigInteger, nullable=False),
    Column("trued_cost_micro_usd", BigInteger, nullable=True),
    Column("shared_from", String(16), nullable=False, server_default=""),
    Column("sharing_method", String(16), nullable=False, server_default=""),
    Column("method", String(32), nullable=False, server_default=""),
    Column("cost_basis", String(32), nullable=False, server_default=""),
    Column("memory_share", Double, nullable=False, server_default="0"),
    Column("compute_share", Double, nullable=False, server_default="0"),
    Column("gpu_fraction", Double, nullable=False, server_default="0"),
    PrimaryKeyConstraint("window_start_unix_ms", "cluster", "node_name", "gpu_uuid", "subject_kind", "pod_uid",
                         "shared_from"),
    ForeignKeyConstraint(
        ["window_start_unix_ms", "cluster", "node_name"],
        ["node_bills.window_start_unix_ms", "node_bills.cluster", "node_bills.node_name"],
    ),
    ForeignKeyConstraint(["label_set_id"], ["label_sets.label_set_id"]),
    Index(None, "namespace", "window_start_unix_ms"),
    # SQLite: the rows live in the primary key's B-tree, not in a rowid table beside a copy of the key.
    sqlite_with_rowid=False,
    # A table on SQLite; on PostgreSQL a view of these columns over ``LINE_IDS.rows`` (what every reader selects).
    info={ONLY_ON: "sqlite"},
)

# PostgreSQL's lines by dictionary ids (migration 0014, ``services.billing.line_ids``).
LINE_IDS = line_ids.define_tables(metadata, ONLY_ON)
# PostgreSQL's lines packed by node-window (migration 0016, ``services.billing.line_packs``).
LINE_PACKS = line_packs.define_table(metadata, ONLY_ON)
# PostgreSQL's node bills by dictionary ids (migration 0018, ``services.billing.bill_ids``).
BILL_IDS = bill_ids.define_tables(metadata, ONLY_ON)

trueups = Table(
    "trueups",
    metadata,
    Column("trueup_id", String(64), nullable=False),
    Column("bill_name", Text, nullable=False),
    Column("bill_format", String(16), nullable=False),
    Column("basis", String(16), nullable=False),
    Column("bill_scope", Text, nullable=False),
    Column("scope_start_unix_ms", BigInteger, nullable=False),
    Column("scope_end_unix_ms", BigInteger, nullable=False),
    Column("applied_at_unix_ms", BigInteger, nullable=False),
    Column("line_items", Integer, nullable=False),
    Column("billed_micro_usd", BigInteger, nullable=False),
    Column("trued_micro_usd", BigInteger, nullable=False),
    Column("summary", Text, nullable=False),
    PrimaryKeyConstraint("trueup_id"),
)

# Hourly and daily rollups of the cost lines and the retention horizons (``services.billing.rollups``).
ROLLUPS = rollups.define_tables(metadata)
# Hourly and daily rollups of the node bills and the pods' lines (``services.billing.read_rollups``).
READ_ROLLUPS = read_rollups.define_tables(metadata)
# The hourly FOCUS grain: origin charges and per-pod, per-GPU line sums (``services.billing.focus_rollups``).
FOCUS_ROLLUPS = focus_rollups.define_tables(metadata, ONLY_ON)

COST_BASES = ("list", "trued")

_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,251}[A-Za-z0-9])?$")
GROUP_KINDS = ("namespace", "pod", "label", "node", "gpu")


@dataclass(frozen=True, slots=True)
class Grouping:
    """How cost lines are grouped: ``namespace``, ``pod``, ``label`` (with ``label_key``), ``node`` or ``gpu``.

    ``pod`` groups by ``<namespace>/<name>``, as ``/allocation?aggregate=pod`` does: a pod deleted and created again
    under its name (a StatefulSet's, with a new uid) is one line, the sum of its incarnations, whose own lines the
    ledger keeps apart by ``pod_uid``."""

    kind: str
    label_key: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ConfigError(f"cannot group by {self.kind!r}; expected namespace, pod, label:<key>, node or gpu")
        if self.kind == "label":
            if not self.label_key or not _LABEL_KEY_RE.match(self.label_key):
                raise ConfigError(f"{self.label_key!r} is not a Kubernetes label key")
        elif self.label_key is not None:
            raise ConfigError(f"grouping by {self.kind} takes no label key")

    @classmethod
    def parse(cls, text: str) -> "Grouping":
        """``namespace`` | ``pod`` | ``label:<key>`` | ``node`` | ``gpu``."""
        kind, sep, key = text.strip().partition(":")
        if kind == "label":
            return cls("label", key if sep else None)
        if sep:
            raise ConfigError(f"cannot group by {text!r}; expected namespace, pod, label:<key>, node or gpu")
        return cls(kind)

    def describe(self) -> str:
        return f"label:{self.label_key}" if self.kind == "label" else self.kind


@dataclass(frozen=True, slots=True)
class WriteResult:
    """What one ``write`` did: node-windows newly billed or already present, and cost lines inserted."""

    bills_written: int
    bills_skipped: int
    lines_written: int
    lines_skipped: int
    # Skipped node-windows already in the ledger, with the same total, price version and sharing, whose cost
    # records were never marked published and that this ledger's publisher inserted (or claimed): the caller
    # publishes them now (the ledger's lines are identical to the given ones).
    unpublished: frozenset = frozenset()
    written: frozenset = frozenset()
    # Skipped node-windows not yet published that another publisher inserted: theirs to publish, not the caller's.
    others: frozenset = frozenset()
    # Of ``lines_written``, the zero lines kept on their bills rather than as rows (``line_storage``).
    lines_elided: int = 0


@dataclass(frozen=True, slots=True)
class LedgerTotals:
    """Sums over a time range: cost lines (also per subject kind) and node bills."""

    cost_micro_usd: int
    cost_lines: int
    bill_micro_usd: int
    node_windows: int
    by_subject_kind: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class CostGroupRow:
    """Cost lines of one subject kind and group value (None where the grouping has no value, e.g. a bucket's
    namespace or node_other's GPU). ``shared_micro_usd``: the part of ``cost_micro_usd`` on shared lines (buckets
    shared to pods by the sharing policy); the rest is direct."""

    subject_kind: str
    group: str | None
    cost_micro_usd: int
    cost_lines: int
    shared_micro_usd: int = 0

    @property
    def direct_micro_usd(self) -> int:
        return self.cost_micro_usd - self.shared_micro_usd


@dataclass(frozen=True, slots=True)
class SharedSourceRow:
    """Shared lines summed per bucket they came from and the method that shared it."""

    shared_from: str
    sharing_method: str
    cost_micro_usd: int
    cost_lines: int


@dataclass(frozen=True, slots=True)
class NodePricingRow:
    """The bills of one node under one price version: its split rule and how its cost divides."""

    cluster: str
    node_name: str
    instance_type: str
    price_model: str
    split_rule: str
    price_version: str
    node_windows: int
    node_cost_micro_usd: int
    gpu_cost_micro_usd: int
    node_other_micro_usd: int


@dataclass(frozen=True, slots=True)
class TrueUpWrite:
    """What ``apply_trueup`` did: the bill's id, node-windows and cost lines whose trued-up value changed, and
    whether the bill was recorded now (False: applied before)."""

    trueup_id: str
    windows_changed: int
    lines_changed: int
    first_time: bool


def normalize_url(url: str) -> str:
    """``postgres://`` and ``postgresql://`` use the installed psycopg 3 driver."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def _bill_row(bill: NodeBill) -> dict[str, Any]:
    return {
        "window_start_unix_ms": bill.window_start_unix_ms,
        "cluster": bill.cluster,
        "node_name": bill.node_name,
        "window_seconds": bill.window_seconds,
        "billed_milliseconds": bill.billed_milliseconds,
        "provider": bill.provider,
        "region": bill.region,
        "instance_type": bill.instance_type,
        "price_model": bill.price_model,
        "gpu_count": bill.gpu_count,
        "node_cost_micro_usd": bill.node_cost_micro_usd,
        "gpu_cost_micro_usd": bill.gpu_cost_micro_usd,
        "node_other_micro_usd": bill.node_other_micro_usd,
        "price_version": bill.price_version,
        "zone": bill.zone,
        "provider_id": bill.provider_id,
        "sharing": bill.sharing,
        "gpu_model": bill.gpu_model,
    }


NOT_SHARED = ""

# What each cost line was billed: the trued-up cost where ``gpumeter reconcile`` stored one, else the list cost.
# The one place that reads it for exports: the FOCUS export's BilledCost and EffectiveCost come from here.
BILLED_COST = func.coalesce(cost_lines.c.trued_cost_micro_usd, cost_lines.c.cost_micro_usd)

# A line's node bill, and its lines with their label sets (what a reader of labels selects from).
_BILL_OF_LINE = ((node_bills.c.window_start_unix_ms == cost_lines.c.window_start_unix_ms)
                 & (node_bills.c.cluster == cost_lines.c.cluster) & (node_bills.c.node_name == cost_lines.c.node_name))
_WITH_LABELS = cost_lines.join(label_sets, label_sets.c.label_set_id == cost_lines.c.label_set_id)


def _shared_from(cost: CostRecord) -> str:
    return KIND_TEXT[cost.shared_from]


def _line_key(cost: CostRecord) -> tuple:
    return (cost.window_start_unix_ms, cost.cluster, cost.node_name, cost.gpu_uuid or NO_GPU,
            KIND_TEXT[cost.subject_kind], cost.pod_uid or NO_POD, KIND_TEXT[cost.shared_from])


def _line_values(cost: CostRecord, label_set: int) -> tuple:
    """``_line_row(cost, label_set)``'s values, in its order (``LINE_COLUMNS``): the row of the bulk insert."""
    return (cost.window_start_unix_ms, cost.cluster, cost.node_name, cost.gpu_uuid or NO_GPU,
            KIND_TEXT[cost.subject_kind], cost.pod_uid or NO_POD, cost.window_seconds, cost.namespace, cost.pod_name,
            label_set, cost.cost_share, cost.cost_micro_usd, KIND_TEXT[cost.shared_from], cost.sharing_method,
            cost.method, cost.cost_basis, cost.memory_share, cost.compute_share, cost.gpu_fraction)


LINE_COLUMNS = ("window_start_unix_ms", "cluster", "node_name", "gpu_uuid", "subject_kind", "pod_uid",
                "window_seconds", "namespace", "pod_name", "label_set_id", "cost_share", "cost_micro_usd",
                "shared_from", "sharing_method", "method", "cost_basis", "memory_share", "compute_share",
                "gpu_fraction")


_LINES_INSERT = BulkInsert(cost_lines, LINE_COLUMNS, conflict=DO_NOTHING)
# PostgreSQL from 0014: the lines' rows of ids (no key: a line is inserted once, with its new bill).
_LINE_ROWS_INSERT = BulkInsert(LINE_IDS.rows, line_ids.ROW_COLUMNS)
# PostgreSQL from 0016: one pack of arrays per node-window (its primary key: a new bill's window has none yet).
_LINE_PACKS_INSERT = BulkInsert(LINE_PACKS, line_packs.PACK_COLUMNS)


def _line_row(cost: CostRecord, label_set: int) -> dict[str, Any]:
    """The ``cost_lines`` row of ``cost`` whose labels are the label set ``label_set`` (``line_storage``)."""
    return dict(zip(LINE_COLUMNS, _line_values(cost, label_set)))


def _zero_line_key(key: NodeWindowKey, line: ZeroLine) -> tuple:
    return (key.window_start_unix_ms, key.cluster, key.node_name, line[0], line[1], NO_POD, NOT_SHARED)


def _zero_line(cost: CostRecord) -> ZeroLine:
    return (cost.gpu_uuid or NO_GPU, cost.subject_kind.value, cost.method, cost.cost_basis, cost.gpu_fraction)


def _alembic_config(connection: Connection):
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


class Ledger:
    """A cost ledger at ``url`` (``sqlite:///path`` or ``postgresql+psycopg://...``). See the module docstring."""

    def __init__(self, url: str = DEFAULT_LEDGER_URL, *, publisher: str | None = None,
                 read_only: bool = False, team_label: str = rollups.DEFAULT_TEAM_LABEL) -> None:
        self.url = normalize_url(url)
        # The pod label the rollups keep as the team (billing's ``team_label``; services.billing.rollups).
        self.team_label = team_label
        # A reader that cannot write even by mistake: every connection is read-only in the database itself
        # (SQLite ``query_only``, PostgreSQL read-only sessions); ``migrate`` and ``write`` then fail.
        self.read_only = read_only
        # Who this handle writes as (see the module docstring); None: a reader, or a writer that publishes nothing
        # and so may be told of every unpublished bill.
        self.publisher = publisher
        shown = mask_url(url)
        try:
            parsed = make_url(self.url)
        except (ArgumentError, ValueError):
            # Not the library's message: it quotes the piece it could not read (a port), which may be a password's.
            raise LedgerError(f"cannot open ledger {shown!r}: the URL does not parse (a port that is not a number, "
                              "or an unencoded '@', ':' or '/' in the user name or password: percent-encode them)"
                              ) from None
        if parsed.host is not None and "@" in parsed.host:
            # SQLAlchemy ends the password at its first "@": the rest of it would be sent out as the host name.
            raise LedgerError(f"cannot open ledger {shown!r}: an '@' after the user info (percent-encode '@' in a "
                              "user name or password as %40)")
        try:
            backend = parsed.get_backend_name()
            if backend not in ("sqlite", "postgresql"):
                raise LedgerError(f"ledger dialect {backend!r} is not supported (sqlite or postgresql)")
            in_memory = backend == "sqlite" and parsed.database in (None, "", ":memory:")
            if in_memory:
                # One shared connection, or every pooled connection would see its own empty database.
                self.engine: Engine = create_engine(self.url, poolclass=StaticPool,
                                                    connect_args={"check_same_thread": False})
            else:
                self.engine = create_engine(self.url, pool_pre_ping=True)
        except (ArgumentError, NoSuchModuleError, ValueError) as exc:
            raise LedgerError(f"cannot open ledger {shown!r}: {mask_secrets(str(exc))}") from exc
        self.dialect = self.engine.dialect.name
        # Label sets this handle knows are in the database (it inserted or checked them in a committed write), and
        # the ids of label sets seen: a pod's lines carry the same labels window after window.
        self._stored_label_sets: set[int] = set()
        self._label_ids: dict[tuple, int] = {}
        # PostgreSQL from 0014: the dictionary ids of nodes, GPUs, pods and line kinds known to be stored
        # (``line_ids``); ``_by_ids`` None until this handle looked whether the ledger stores its lines by ids.
        self._ids = line_ids.IdCache()
        self._by_ids: bool | None = None if backend == "postgresql" else False
        # PostgreSQL from 0016: the lines are packed by node-window (``line_packs``); looked at with ``_by_ids``.
        self._packed: bool | None = None if backend == "postgresql" else False
        # PostgreSQL from 0018: the bills are ``node_bill_rows`` of ids (``bill_ids``); looked at with ``_by_ids``.
        self._bill_rows: bool | None = None if backend == "postgresql" else False
        # Zero sets (``bill_ids``) this handle knows are stored (it inserted or checked them in a committed write).
        self._stored_zero_sets: set[int] = set()
        # A SQLite file's -wal/-shm are checked before every use (sqlite_files): a -shm that cannot back its
        # mapping kills the process with SIGBUS as soon as SQLite touches it.
        self._files = SqliteFiles(Path(parsed.database)) if backend == "sqlite" and not in_memory else None
        self._connections = 0
        # PostgreSQL's time partitions this handle knows are attached (``services.billing.partitions``); None until
        # it looked whether the tables are partitioned, False when they are not (SQLite, or before revision 0010).
        self._partitions: set[partitions.Partition] | None | bool = None if backend == "postgresql" else False
        self._partition_schemes: tuple[partitions.Scheme, ...] = partitions.SCHEMES
        if self.dialect == "sqlite":
            event.listen(self.engine, "connect",
                         lambda dbapi, _record: _sqlite_pragmas(dbapi, in_memory, read_only=read_only))
            event.listen(self.engine, "connect", lambda _dbapi, _record: self._count_connections(1))
            event.listen(self.engine, "close", lambda _dbapi, _record: self._count_connections(-1))
            event.listen(self.engine, "close_detached", lambda _dbapi: self._count_connections(-1))
        elif read_only:
            event.listen(self.engine, "connect", lambda dbapi, _record: _postgres_read_only(dbapi))

    @property
    def sqlite_file(self) -> Path | None:
        """The database file of a SQLite file ledger; None for PostgreSQL and an in-memory SQLite."""
        return None if self._files is None else self._files.path

    def _count_connections(self, change: int) -> None:
        self._connections = max(0, self._connections + change)

    def _check_files(self, *, write: bool) -> None:
        if self._files is None:
            return
        problem = self._files.problem(write=write, mapped=self._connections > 0)
        if problem is not None:
            raise LedgerUnusable(f"ledger {self!r} cannot be used: {problem.reason}", retry=problem.retry)

    @contextmanager
    def _begin(self) -> Iterator[Connection]:
        """``engine.begin()`` once the files passed their check for a write."""
        self._check_files(write=True)
        with self.engine.begin() as connection:
            yield connection
        if self._files is not None:
            self._files.remember(mapped=self._connections > 0)

    def transaction(self):
        """A write transaction of its own (``services.billing.retention``), after the files' check."""
        return self._begin()

    def insert(self, table: Table):
        """The dialect's ``INSERT`` of ``table`` (with ``on_conflict_do_*``)."""
        return self._insert(table)

    @contextmanager
    def _connect(self) -> Iterator[Connection]:
        """``engine.connect()`` once the files passed their check for a read."""
        self._check_files(write=False)
        with self.engine.connect() as connection:
            yield connection
        if self._files is not None:
            self._files.remember(mapped=self._connections > 0)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Ledger":
        """The ledger named by ``GPUMETER_LEDGER_URL``, else the SQLite file ``gpumeter-ledger.sqlite3``."""
        return cls(env.get(LEDGER_URL_ENV) or DEFAULT_LEDGER_URL)

    def __repr__(self) -> str:
        return f"Ledger({mask_url(self.url)!r})"

    def close(self) -> bool:
        """Close every connection. Returns False, closing nothing, when this process has the SQLite files mapped
        and they cannot be used safely (closing writes the WAL index: SIGBUS): the engine is then kept open for
        good and ``abandoned_ledgers()`` says why; the entrypoint exits without finalising it. Every committed
        transaction is in the WAL already."""
        if self._files is not None and self._connections > 0:
            problem = self._files.problem(write=False, mapped=True)
            if problem is not None:
                _ABANDONED.append(self.engine)
                _ABANDONED_REASONS.append(f"{self!r}: {problem.reason}")
                return False
        self.engine.dispose()
        return True

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _insert(self, table: Table):
        return (postgresql.insert(table) if self.dialect == "postgresql" else sqlite.insert(table))

    # -- schema -----------------------------------------------------------------------------------------------

    def migrate(self) -> str:
        """Bring the schema to the newest migration (alembic ``upgrade head``); return that revision.

        Safe to run from several processes at once on PostgreSQL (an advisory lock serialises them).
        """
        from alembic import command

        try:
            with self._begin() as connection:
                if self.dialect == "postgresql":
                    connection.execute(text("SELECT pg_advisory_xact_lock(:lock)"), {"lock": _MIGRATION_LOCK_ID})
                config = _alembic_config(connection)
                # Migration 0009 backfills the rollups' team from this label.
                config.attributes["team_label"] = self.team_label
                command.upgrade(config, "head")
        except SQLAlchemyError as exc:
            raise LedgerError(f"migrating {self!r} failed: {exc}") from exc
        finally:
            # The upgrade may have partitioned the tables (0010) or moved the lines to ids (0014): look again before
            # the next write.
            self._partitions = None if self.dialect == "postgresql" else False
            self._partition_schemes = partitions.SCHEMES
            self._by_ids = None if self.dialect == "postgresql" else False
            self._packed = None if self.dialect == "postgresql" else False
            self._bill_rows = None if self.dialect == "postgresql" else False
        revision = self.current_revision()
        assert revision is not None
        return revision

    def current_revision(self) -> str | None:
        """The schema's migration revision, or None for a database no migration has touched."""
        from alembic.runtime.migration import MigrationContext

        try:
            with self._connect() as connection:
                context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
                return context.get_current_revision()
        except SQLAlchemyError as exc:
            raise LedgerError(f"cannot read the schema revision of {self!r}: {exc}") from exc

    @staticmethod
    def head_revision() -> str:
        from alembic.script import ScriptDirectory
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS_DIR))
        head = ScriptDirectory.from_config(config).get_current_head()
        assert head is not None
        return head

    def require_schema(self) -> None:
        """``LedgerError`` unless the schema is at the newest migration."""
        current, head = self.current_revision(), self.head_revision()
        if current != head:
            raise LedgerError(
                f"{self!r} is at schema revision {current or 'none'}, expected {head}: run the billing service "
                "once or Ledger.migrate()"
            )

    # -- writing ----------------------------------------------------------------------------------------------

    def write(self, costs: Iterable[CostRecord], bills: Iterable[NodeBill]) -> WriteResult:
        """Record node-windows idempotently (see the module docstring). Every cost line's node-window must have
        its bill in ``bills`` and the lines of each node-window must add up to its bill, else ``LedgerError``
        and nothing is written."""
        # Node-windows are keyed by plain (start, cluster, node) tuples inside -- the order of a line's key and of
        # the bills' primary key -- not by a NodeWindowKey per line, compared and hashed in Python ~6 times a line.
        by_window: dict[tuple[int, str, str], tuple[NodeWindowKey, NodeBill]] = {}
        for bill in bills:
            key = bill.key
            first = by_window.setdefault((key.window_start_unix_ms, key.cluster, key.node_name), (key, bill))[1]
            if first != bill:
                raise LedgerError(f"two different bills for {bill.key} in one write")
        lines: dict[tuple, CostRecord] = {}
        sums: dict[tuple[int, str, str], int] = defaultdict(int)
        kept: list[tuple[tuple[int, str, str], CostRecord]] = []
        zeros: dict[tuple[int, str, str], list[ZeroLine]] = defaultdict(list)
        zero_kinds: dict[tuple, CostRecord] = {}
        for cost in costs:
            window = (cost.window_start_unix_ms, cost.cluster, cost.node_name)
            found = by_window.get(window)
            if found is None:
                key = NodeWindowKey(cost.cluster, cost.node_name, cost.window_start_unix_ms)
                raise LedgerError(f"cost line for {key} without its node bill in the same write")
            bill = found[1]
            line_key = _line_key(cost)
            first_line = lines.get(line_key)
            if first_line is None:
                # A line offered twice (the same record, or an equal one) is one line: counted once.
                lines[line_key] = cost
                sums[window] += cost.cost_micro_usd
                if is_zero_line(cost, bill.window_seconds, bill.instance_type, bill.price_model,
                                bill.price_version):
                    zeros[window].append(_zero_line(cost))
                    # One of each kind: the hourly FOCUS lines (PostgreSQL) name a zero line's kind and pod by id.
                    zero_kinds.setdefault((cost.subject_kind, cost.method, cost.cost_basis, cost.window_seconds,
                                           cost.namespace, cost.pod_name), cost)
                else:
                    kept.append((window, cost))
            elif first_line != cost:
                raise LedgerError(f"two different cost lines for {line_key} in one write")
        for window, (key, bill) in by_window.items():
            if sums.get(window, 0) != bill.node_cost_micro_usd:
                raise LedgerError(
                    f"cost lines of {key} add up to {sums.get(window, 0)} micro-USD, the bill says "
                    f"{bill.node_cost_micro_usd}: refusing to write a ledger that does not reconcile"
                )
        if not by_window:
            return WriteResult(0, 0, 0, 0)
        starts = {window[0] for window in by_window}
        self._ensure_partitions_for(starts)
        self._resolve_ids([*(cost for _window, cost in kept), *zero_kinds.values()],
                          {z[0] for lines in zeros.values() for z in lines},
                          [_bill_row(bill) for _key, bill in by_window.values()])
        try:
            return self._write(by_window, lines, kept, zeros)
        except LedgerError as exc:
            if not _missing_partition(exc) or self._partitions in (None, False):
                raise
            # A partition this handle knew of was dropped since (retention of an old day, by another process):
            # create it again and write once more -- the write was all or nothing.
            self._partitions = None
            self._ensure_partitions_for(starts)
            return self._write(by_window, lines, kept, zeros)

    def _write(self, by_window: dict[tuple[int, str, str], tuple[NodeWindowKey, NodeBill]],
               lines: dict[tuple, CostRecord], kept: list[tuple[tuple[int, str, str], CostRecord]],
               zeros: dict[tuple[int, str, str], list[ZeroLine]]) -> WriteResult:
        """``write``'s transaction, for node-windows checked by it (keyed by (start, cluster, node))."""
        versions = {b.price_version: b.price.describe() for _, b in by_window.values()}
        pk = [node_bills.c.window_start_unix_ms, node_bills.c.cluster, node_bills.c.node_name]
        added_label_sets: set[int] = set()
        added_zero_sets: set[int] = set()
        # PostgreSQL from 0014: the zero lines name their units by GPU id (``line_storage``).
        gpu_ids = self._ids.get("gpus") if self._by_ids else None
        try:
            with self._begin() as connection:
                connection.execute(self._insert(price_versions).on_conflict_do_nothing(), list(versions.values()))
                bill_rows = {w: {**_bill_row(b), "publisher": self.publisher,
                                 "zero_lines": encode_zero_lines(zeros.get(w, ()), gpu_ids),
                                 "zero_line_count": len(zeros.get(w, ()))} for w, (_, b) in by_window.items()}
                if self._bill_rows:
                    new_windows, added_zero_sets = self._insert_bill_rows(connection, bill_rows)
                else:
                    inserted = connection.execute(
                        self._insert(node_bills).on_conflict_do_nothing().returning(*pk), list(bill_rows.values()),
                    ).all()
                    new_windows = {(start, cluster, node) for start, cluster, node in inserted}
                new_lines = []
                for window, cost in kept:
                    if window not in new_windows:
                        continue
                    bill = by_window[window][1]
                    if (cost.price_version != bill.price_version or cost.instance_type != bill.instance_type
                            or cost.price_model != bill.price_model):
                        # Raised inside the transaction: nothing of this write is committed.
                        raise LedgerError(f"cost line {_line_key(cost)} is priced as {cost.instance_type} "
                                          f"{cost.price_model} {cost.price_version}, its bill as {bill.instance_type} "
                                          f"{bill.price_model} {bill.price_version}: the ledger keeps them once, on "
                                          "the bill")
                    new_lines.append(cost)
                if new_lines:
                    added_label_sets = self._insert_lines(connection, new_lines)
                if new_windows:
                    # Every line of the new node-windows, zero lines included (the rollups count them as every
                    # reader does: services.billing.rollups).
                    new_costs = [cost for line_key, cost in lines.items() if line_key[:3] in new_windows]
                    new_bills = dict(by_window[w] for w in new_windows)
                    rollups.add_written(connection, ROLLUPS, new_costs, new_bills, team_key=self.team_label)
                    read_rollups.add_written(connection, READ_ROLLUPS, [bill_rows[w] for w in new_windows],
                                             new_costs, new_bills, team_key=self.team_label)
                    focus_rollups.add_written(connection, FOCUS_ROLLUPS, [bill_rows[w] for w in new_windows],
                                              new_costs, label_set=self._label_set,
                                              ids=self._ids if self._by_ids else None)
                unpublished, others = self._unpublished(connection, dict(
                    pair for window, pair in by_window.items() if window not in new_windows))
        except SQLAlchemyError as exc:
            raise LedgerError(f"writing {len(by_window)} node-windows to {self!r} failed: {exc}") from exc
        self._stored_label_sets |= added_label_sets
        if len(self._stored_zero_sets) + len(added_zero_sets) > line_ids.CACHE_ENTRIES:
            self._stored_zero_sets.clear()
        self._stored_zero_sets |= added_zero_sets
        elided = sum(len(zeros.get(window, ())) for window in new_windows)
        written = len(new_lines) + elided
        return WriteResult(
            bills_written=len(new_windows),
            bills_skipped=len(by_window) - len(new_windows),
            lines_written=written,
            lines_skipped=len(lines) - written,
            unpublished=frozenset(unpublished),
            written=frozenset(by_window[w][0] for w in new_windows),
            others=frozenset(others),
            lines_elided=elided,
        )

    def ensure_partitions(self, now_ms: int, *, days_ahead: int = partitions.AHEAD_DAYS) -> int:
        """On a partitioned PostgreSQL ledger, create the partitions of the UTC days from ``now_ms``'s through
        ``days_ahead`` days after it (``services.billing.partitions``); returns how many it created (0 on SQLite).
        Billing calls it at start and hourly with its clock, ``gpumeter ledger retention`` with its own."""
        start = now_ms - now_ms % partitions.DAY_MS
        return self._ensure_partitions(partitions.wanted(start, start + (days_ahead + 1) * partitions.DAY_MS))

    def _ensure_partitions_for(self, starts: Iterable[int]) -> None:
        """Make sure the partitions holding windows starting at ``starts`` exist, before a write's transaction."""
        if self._partitions is False:
            return
        needed = partitions.for_times(starts, self._partition_schemes)
        if self._partitions is None or not needed <= self._partitions:
            self._ensure_partitions(needed)

    def _ensure_partitions(self, needed: Iterable[partitions.Partition]) -> int:
        if self._partitions is False or self.read_only:
            return 0
        needed = set(needed)
        try:
            # A transaction of its own: ATTACH's locks last until commit, and a write's transaction takes long.
            with self._begin() as connection:
                if self._partitions is None and not partitions.partitioned(connection):
                    self._partitions = False
                    return 0
                created = partitions.ensure_in(connection, needed)
                known = partitions.existing(connection)
                tables = partitions.partitioned_tables(connection)
                # Only the schemes of this revision's partitioned tables (0014: cost_line_rows, not cost_lines).
                self._partition_schemes = tuple(s for s in partitions.SCHEMES if s.table in tables)
        except SQLAlchemyError as exc:
            raise LedgerError(f"creating the partitions of {self!r} failed: {exc}") from exc
        self._partitions = known
        return len(created)

    def _resolve_ids(self, costs: Iterable[CostRecord], gpus: Iterable[str],
                     bill_rows: Iterable[Mapping[str, Any]] = ()) -> None:
        """On a ledger of lines by ids (PostgreSQL from 0014), make sure the id cache holds every id of ``costs``
        and of the GPU uuids ``gpus`` (the zero lines'), and from 0018 of the bills' ``bill_rows`` (their
        ``node_bills`` columns: node, bill kind) and this handle's publisher, in a short transaction of its own
        before the write's (``line_ids``, ``bill_ids``)."""
        if self._by_ids is False:
            return
        try:
            if self._by_ids is None:
                with self._connect() as connection:
                    self._uses_ids(connection)
                if not self._by_ids:
                    return
            costs = list(costs)
            more = bill_ids.wanted_keys(bill_rows, self.publisher) if self._bill_rows else None
            wanted = line_ids.missing_keys(self._ids, costs, gpus, more)
            # The hourly FOCUS lines' pods (``focus_rollups.focus_pod_key``) where an empty (not absent) namespace
            # or pod name makes them other rows than the minute lines' (no Kubernetes pod has one).
            known = self._ids.get("pods")
            odd = {key for cost in costs if cost.namespace == "" or cost.pod_name == ""
                   for key in [focus_rollups.focus_pod_key(cost.pod_uid or "", cost.namespace or "",
                                                           cost.pod_name or "")] if key not in known}
            if odd:
                wanted.setdefault("pods", set()).update(odd)
            if wanted:
                with self._begin() as connection:
                    line_ids.resolve(connection, self._ids, wanted)
        except SQLAlchemyError as exc:
            raise LedgerError(f"storing the ids of the cost lines' nodes, GPUs and pods in {self!r} failed: {exc}"
                              ) from exc

    def _label_set(self, cost: CostRecord) -> int:
        labels, carried = cost.labels, cost.carried_label_keys
        if not labels and not carried:
            return EMPTY_LABEL_SET_ID
        key = (frozenset(labels.items()), carried)
        found = self._label_ids.get(key)
        if found is None:
            if len(self._label_ids) >= _LABEL_ID_CACHE:
                self._label_ids.clear()
            found = self._label_ids[key] = label_set_id(labels, carried)
        return found

    def _insert_label_sets(self, connection: Connection, wanted: dict[int, CostRecord]) -> set[int]:
        """Insert the label sets of ``wanted`` (id -> a line carrying it) not yet known to be stored; returns their
        ids. ``LedgerError`` when a stored set of the same id holds other labels (a 64-bit hash collision)."""
        new = {i: c for i, c in wanted.items() if i != EMPTY_LABEL_SET_ID and i not in self._stored_label_sets}
        if not new:
            return set()
        connection.execute(self._insert(label_sets).on_conflict_do_nothing(),
                           [{"label_set_id": i, "labels": dict(sorted(c.labels.items())),
                             "carried_label_keys": ",".join(c.carried_label_keys)} for i, c in new.items()])
        l = label_sets.c
        for i, labels, carried in connection.execute(
                select(l.label_set_id, l.labels, l.carried_label_keys).where(l.label_set_id.in_(list(new)))):
            cost = new[i]
            if dict(labels) != dict(cost.labels) or carried != ",".join(cost.carried_label_keys):
                raise LedgerError(f"label set {i} holds {labels} / {carried!r}, not the {dict(cost.labels)} / "
                                  f"{cost.carried_label_keys} whose id it is: refusing to mix them up")
        return set(new)

    def _insert_lines(self, connection: Connection, costs: list[CostRecord]) -> set[int]:
        """Insert the cost lines of ``costs`` (no zero line among them), skipping any already there, and the label
        sets they reference first; returns the label sets inserted. One bulk statement (``bulk_rows``)."""
        ids = [self._label_set(c) for c in costs]
        added = self._insert_label_sets(connection, dict(zip(ids, costs)))
        if self._packed:
            cache = self._ids
            _LINE_PACKS_INSERT.execute_copy(connection, line_packs.copy_payload(line_packs.pack_rows(
                line_ids.row_values(c, i, cache) for c, i in zip(costs, ids))))
        elif self._by_ids:
            cache = self._ids
            _LINE_ROWS_INSERT.execute(connection, [line_ids.row_values(c, i, cache) for c, i in zip(costs, ids)])
        else:
            _LINES_INSERT.execute(connection, [_line_values(c, i) for c, i in zip(costs, ids)])
        return added

    def _unpublished(self, connection, existing: dict[NodeWindowKey, NodeBill]
                     ) -> tuple[set[NodeWindowKey], set[NodeWindowKey]]:
        """Of the ``existing`` bills (skipped by this write): those never published that are this publisher's to
        publish (inserted by it, or claimed now because no one had), and those that are another publisher's."""
        if not existing:
            return set(), set()
        c = node_bills.c
        starts = {k.window_start_unix_ms for k in existing}
        stored = connection.execute(
            select(c.window_start_unix_ms, c.cluster, c.node_name, c.node_cost_micro_usd, c.price_version,
                   c.publisher, c.sharing)
            .where(c.published_at_unix_ms.is_(None), c.window_start_unix_ms.in_(starts))
        ).all()
        ours, others = set(), set()
        for start, cluster, node, cost, version, publisher, sharing in stored:
            key = NodeWindowKey(cluster, node, start)
            bill = existing.get(key)
            # Only the same costing (total, price, sharing) may be published for what the ledger holds.
            if (bill is None or bill.node_cost_micro_usd != cost or bill.price_version != version
                    or bill.sharing != sharing):
                continue
            if self.publisher is None or publisher == self.publisher:
                ours.add(key)
            elif publisher is None and self._claim(connection, start, cluster, node):
                ours.add(key)  # a bill from before publishers were recorded: claimed by this one alone
            else:
                others.add(key)
        return ours, others

    def _claim(self, connection: Connection, start: int, cluster: str, node: str) -> bool:
        """Set this handle's publisher on the stored bill of (start, cluster, node) if it has none and is not
        published; whether it did (exactly one concurrent claimer does)."""
        c = node_bills.c
        if self._bill_rows:
            r = BILL_IDS.rows.c
            statement = bill_ids.update_by_key(BILL_IDS, LINE_IDS.nodes, r.publisher_id.is_(None),
                                               r.published_at_unix_ms.is_(None),
                                               publisher_id=self._name_id(connection, self.publisher))
            params = {"b_start": start, "b_cluster": cluster, "b_node": node}
            return connection.execute(statement, params).rowcount == 1
        return connection.execute(
            update(node_bills)
            .where(c.window_start_unix_ms == start, c.cluster == cluster, c.node_name == node,
                   c.publisher.is_(None), c.published_at_unix_ms.is_(None))
            .values(publisher=self.publisher)).rowcount == 1

    def mark_published(self, keys: Iterable[NodeWindowKey], published_at_unix_ms: int) -> int:
        """Record that the cost records of ``keys`` were acknowledged on the costs topic; returns rows updated."""
        keys = list(keys)
        if not keys:
            return 0
        c = node_bills.c
        updated = 0
        try:
            with self._begin() as connection:
                if self.dialect == "postgresql":
                    self._uses_ids(connection)
                if self._bill_rows:
                    # PostgreSQL from 0018: ``node_bills`` is a view over ``node_bill_rows`` (``bill_ids``).
                    r = BILL_IDS.rows.c
                    statement = bill_ids.update_by_key(BILL_IDS, LINE_IDS.nodes, r.published_at_unix_ms.is_(None),
                                                       published_at_unix_ms=published_at_unix_ms)
                    for key in keys:
                        updated += connection.execute(statement, {
                            "b_start": key.window_start_unix_ms, "b_cluster": key.cluster,
                            "b_node": key.node_name}).rowcount
                    return updated
                for key in keys:
                    updated += connection.execute(
                        update(node_bills)
                        .where(c.window_start_unix_ms == key.window_start_unix_ms, c.cluster == key.cluster,
                               c.node_name == key.node_name, c.published_at_unix_ms.is_(None))
                        .values(published_at_unix_ms=published_at_unix_ms)
                    ).rowcount
        except SQLAlchemyError as exc:
            raise LedgerError(f"marking {len(keys)} node-windows published in {self!r} failed: {exc}") from exc
        return updated

    # -- reading ----------------------------------------------------------------------------------------------

    @staticmethod
    def _range(table: Table, start_ms: int | None, end_ms: int | None, cluster: str | None) -> list:
        conditions = []
        if start_ms is not None:
            conditions.append(table.c.window_start_unix_ms >= start_ms)
        if end_ms is not None:
            conditions.append(table.c.window_start_unix_ms < end_ms)
        if cluster is not None:
            conditions.append(table.c.cluster == cluster)
        return conditions

    def minute_lines_kept_from(self) -> int | None:
        """The oldest window start whose minute cost lines retention still keeps; None when it dropped none."""
        return rollups.kept_from(self.read, ROLLUPS).get(rollups.MINUTE)

    def require_minute_lines(self, start_ms: int, what: str) -> None:
        """Raise ``MinuteLinesDropped`` when ``what`` (a read of minute lines from ``start_ms``) starts before the
        minute lines retention keeps."""
        kept = self.minute_lines_kept_from()
        if kept is not None and start_ms < kept:
            raise MinuteLinesDropped(
                f"{what} needs the minute cost lines and node bills, and retention kept them from {iso_utc(kept)} "
                "only: ask for a range from then (the rollups are kept longer)")

    def _require_bills(self, start_ms: int | None, end_ms: int | None, what: str) -> None:
        """``require_minute_lines`` for a read of node bills in [start_ms, end_ms) (None: unbounded; an empty range
        reads nothing): the bills go with the minute lines (``services.billing.retention``), and a range without
        them would read as zero."""
        if start_ms is not None and end_ms is not None and end_ms <= start_ms:
            return
        self.require_minute_lines(-(2 ** 62) if start_ms is None else start_ms, what)

    def read(self, statement) -> list:
        """All rows of a Core ``statement`` (``LedgerError`` on a database error): for the rollups' queries."""
        return self._read(statement)

    def _read(self, statement) -> list:
        try:
            with self._connect() as connection:
                return connection.execute(statement).all()
        except SQLAlchemyError as exc:
            raise LedgerError(f"reading {self!r} failed: {exc}") from exc

    @staticmethod
    def cost_expression(table: Table, cost: str):
        """The cost column of ``table`` for a cost basis: ``list`` as billed at list price, ``trued`` the trued-up
        cost where there is one and the list price elsewhere."""
        if cost not in COST_BASES:
            raise ConfigError(f"cost basis {cost!r} is not one of {COST_BASES}")
        listed = table.c.node_cost_micro_usd if table is node_bills else table.c.cost_micro_usd
        return listed if cost == "list" else func.coalesce(table.c.trued_cost_micro_usd, listed)

    def _zero_lines(self, start_ms: int | None, end_ms: int | None, cluster: str | None
                    ) -> list[tuple[Mapping[str, Any], list[ZeroLine]]]:
        """(bill columns, its zero lines) of the bills with zero lines in the range (``line_storage``)."""
        self._require_bills(start_ms, end_ms, "reading the bills' zero lines")
        b = node_bills.c
        rows = self._read(
            select(b.window_start_unix_ms, b.cluster, b.node_name, b.window_seconds, b.instance_type,
                   b.price_model, b.price_version, b.zero_lines)
            .where(b.zero_lines.is_not(None), *self._range(node_bills, start_ms, end_ms, cluster))
        )
        uuids = self._zero_line_gpu_uuids(self._read, [row.zero_lines for row in rows])
        return [(row._mapping, decode_zero_lines(row.zero_lines, uuids)) for row in rows]

    def _zero_line_gpu_uuids(self, read, texts: Iterable[str | None]) -> Mapping[int, str] | None:
        """The uuids of the GPU ids that the ``zero_lines`` texts name (PostgreSQL from 0014), read with ``read``
        (a statement -> rows) where the id cache lacks them; None when they name none."""
        ids: set[int] = set()
        for zero_text in texts:
            ids |= zero_line_gpu_ids(zero_text)
        if not ids:
            return None
        try:
            return line_ids.gpu_uuids(read, LINE_IDS, self._ids, ids)
        except LookupError as exc:
            raise LedgerError(f"reading the zero lines of {self!r}: {exc}") from exc

    def totals(self, *, start_ms: int | None = None, end_ms: int | None = None,
               cluster: str | None = None, cost: str = "list") -> LedgerTotals:
        """Sums of cost lines and node bills for windows starting in [start_ms, end_ms), in the ``cost`` basis."""
        self._require_bills(start_ms, end_ms, "reading the ledger's totals")
        line_rows = self._read(
            select(cost_lines.c.subject_kind, func.coalesce(func.sum(self.cost_expression(cost_lines, cost)), 0),
                   func.count())
            .where(*self._range(cost_lines, start_ms, end_ms, cluster))
            .group_by(cost_lines.c.subject_kind)
        )
        (bill_sum, bill_count), = self._read(
            select(func.coalesce(func.sum(self.cost_expression(node_bills, cost)), 0), func.count())
            .where(*self._range(node_bills, start_ms, end_ms, cluster))
        )
        by_kind = {kind: int(total) for kind, total, _ in line_rows}
        count = sum(int(n) for _, _, n in line_rows)
        for _bill, zero in self._zero_lines(start_ms, end_ms, cluster):
            for line in zero:
                by_kind.setdefault(line[1], 0)
            count += len(zero)
        by_kind = dict(sorted(by_kind.items()))
        return LedgerTotals(
            cost_micro_usd=sum(by_kind.values()),
            cost_lines=count,
            bill_micro_usd=int(bill_sum),
            node_windows=int(bill_count),
            by_subject_kind=by_kind,
        )

    def bill_totals(self, *, start_ms: int | None = None, end_ms: int | None = None,
                    cluster: str | None = None, cost: str = "list") -> tuple[int, int]:
        """(micro-dollars, node-windows) of the node bills of windows starting in [start_ms, end_ms), in the
        ``cost`` basis: one SQL aggregate over the bills, which every grain keeps. What a report's reconciliation
        and ``/allocation`` compare their lines with; ``totals`` also reads the lines (and every bill's zero
        lines), which over a month of a fleet is millions of rows."""
        self._require_bills(start_ms, end_ms, "reading the node bills' totals")
        (bill_sum, bill_count), = self._read(
            select(func.coalesce(func.sum(self.cost_expression(node_bills, cost)), 0), func.count())
            .where(*self._range(node_bills, start_ms, end_ms, cluster))
        )
        return int(bill_sum), int(bill_count)

    def cost_by(self, grouping: Grouping, *, start_ms: int | None = None, end_ms: int | None = None,
                cluster: str | None = None, cost: str = "list") -> tuple[CostGroupRow, ...]:
        """Cost lines summed per (subject kind, group value) for windows starting in [start_ms, end_ms), in the
        ``cost`` basis."""
        if grouping.kind == "namespace":
            group = cost_lines.c.namespace
        elif grouping.kind == "pod":
            group = cost_lines.c.namespace + "/" + cost_lines.c.pod_name
        elif grouping.kind == "node":
            group = cost_lines.c.node_name
        elif grouping.kind == "gpu":
            group = func.nullif(cost_lines.c.gpu_uuid, NO_GPU)
        else:
            group = label_sets.c.labels[grouping.label_key].as_string()
        micro = self.cost_expression(cost_lines, cost)
        shared = case((cost_lines.c.shared_from != NOT_SHARED, micro), else_=0)
        # Grouping over a subquery keeps PostgreSQL from seeing two differently-bound copies of the expression.
        inner = (
            select(cost_lines.c.subject_kind.label("kind"), group.label("grp"), micro.label("micro"),
                   shared.label("shared"))
            .select_from(_WITH_LABELS if grouping.kind == "label" else cost_lines)
            .where(*self._range(cost_lines, start_ms, end_ms, cluster))
            .subquery()
        )
        rows = self._read(
            select(inner.c.kind, inner.c.grp, func.sum(inner.c.micro), func.count(), func.sum(inner.c.shared))
            .group_by(inner.c.kind, inner.c.grp)
        )
        sums = {(kind, grp): [int(total), int(count), int(shared_sum or 0)]
                for kind, grp, total, count, shared_sum in rows}
        for bill, zero in self._zero_lines(start_ms, end_ms, cluster):
            for gpu_uuid, kind, *_ in zero:
                grp = (bill["node_name"] if grouping.kind == "node"
                       else gpu_uuid or None if grouping.kind == "gpu" else None)
                sums.setdefault((kind, grp), [0, 0, 0])[1] += 1
        return tuple(CostGroupRow(kind, grp, total, count, shared_sum)
                     for (kind, grp), (total, count, shared_sum) in sums.items())

    def shared_by_source(self, *, start_ms: int | None = None, end_ms: int | None = None,
                         cluster: str | None = None, cost: str = "list") -> tuple[SharedSourceRow, ...]:
        """Shared lines summed per (bucket shared, method) for windows starting in [start_ms, end_ms), in the
        ``cost`` basis."""
        c = cost_lines.c
        rows = self._read(
            select(c.shared_from, c.sharing_method, func.sum(self.cost_expression(cost_lines, cost)), func.count())
            .where(c.shared_from != NOT_SHARED, *self._range(cost_lines, start_ms, end_ms, cluster))
            .group_by(c.shared_from, c.sharing_method)
            .order_by(c.shared_from, c.sharing_method)
        )
        return tuple(SharedSourceRow(kind, method, int(total), int(count)) for kind, method, total, count in rows)

    def sharing_policies(self, *, start_ms: int | None = None, end_ms: int | None = None,
                         cluster: str | None = None) -> tuple[tuple[str, int], ...]:
        """(sharing policy, node-windows billed under it) for windows starting in [start_ms, end_ms)."""
        self._require_bills(start_ms, end_ms, "reading the bills' sharing policies")
        c = node_bills.c
        rows = self._read(
            select(c.sharing, func.count()).where(*self._range(node_bills, start_ms, end_ms, cluster))
            .group_by(c.sharing).order_by(c.sharing)
        )
        return tuple((sharing, int(count)) for sharing, count in rows)

    def cost_by_carried_label_keys(self, *, start_ms: int | None = None, end_ms: int | None = None,
                                   cluster: str | None = None) -> tuple[CostGroupRow, ...]:
        """Cost lines summed per (subject kind, carried label keys) -- the keys comma-separated, None where the
        lines name none -- for windows starting in [start_ms, end_ms)."""
        keys = func.nullif(label_sets.c.carried_label_keys, "")
        inner = (
            select(cost_lines.c.subject_kind.label("kind"), keys.label("grp"), cost_lines.c.cost_micro_usd)
            .select_from(_WITH_LABELS)
            .where(*self._range(cost_lines, start_ms, end_ms, cluster))
            .subquery()
        )
        rows = self._read(
            select(inner.c.kind, inner.c.grp, func.sum(inner.c.cost_micro_usd), func.count())
            .group_by(inner.c.kind, inner.c.grp)
        )
        sums = {(kind, grp): [int(total), int(count)] for kind, grp, total, count in rows}
        for _bill, zero in self._zero_lines(start_ms, end_ms, cluster):
            for _gpu, kind, *_ in zero:
                sums.setdefault((kind, None), [0, 0])[1] += 1
        return tuple(CostGroupRow(kind, grp, total, count) for (kind, grp), (total, count) in sums.items())

    def bills(self, *, start_ms: int | None = None, end_ms: int | None = None,
              cluster: str | None = None) -> tuple[dict[str, Any], ...]:
        """The node bills for windows starting in [start_ms, end_ms), oldest first, as column dicts."""
        self._require_bills(start_ms, end_ms, "reading the node bills")
        rows = self._read(
            select(node_bills).where(*self._range(node_bills, start_ms, end_ms, cluster))
            .order_by(node_bills.c.window_start_unix_ms, node_bills.c.cluster, node_bills.c.node_name)
        )
        out = tuple(dict(row._mapping) for row in rows)
        uuids = self._zero_line_gpu_uuids(self._read, [bill["zero_lines"] for bill in out])
        if uuids is not None:
            # Units named by GPU id (PostgreSQL from 0014): the text SQLite stores, with their uuids.
            for bill in out:
                if zero_line_gpu_ids(bill["zero_lines"]):
                    bill["zero_lines"] = encode_zero_lines(decode_zero_lines(bill["zero_lines"], uuids))
        return out

    def node_pricing(self, *, start_ms: int | None = None, end_ms: int | None = None,
                     cluster: str | None = None) -> tuple[NodePricingRow, ...]:
        """Per node and price: which split rule priced its bills and how much of them went to node_other, for
        windows starting in [start_ms, end_ms)."""
        self._require_bills(start_ms, end_ms, "reading the node pricing")
        rows = self._read(
            select(node_bills.c.cluster, node_bills.c.node_name, node_bills.c.instance_type,
                   node_bills.c.price_model, price_versions.c.split_rule, node_bills.c.price_version,
                   func.count(), func.sum(node_bills.c.node_cost_micro_usd),
                   func.sum(node_bills.c.gpu_cost_micro_usd), func.sum(node_bills.c.node_other_micro_usd))
            .join(price_versions, price_versions.c.price_version == node_bills.c.price_version)
            .where(*self._range(node_bills, start_ms, end_ms, cluster))
            .group_by(node_bills.c.cluster, node_bills.c.node_name, node_bills.c.instance_type,
                      node_bills.c.price_model, price_versions.c.split_rule, node_bills.c.price_version)
            .order_by(node_bills.c.cluster, node_bills.c.node_name, node_bills.c.price_version)
        )
        return tuple(
            NodePricingRow(c, n, it, pm, rule, pv, int(count), int(node), int(gpu), int(other))
            for c, n, it, pm, rule, pv, count, node, gpu, other in rows
        )

    def iter_cost_lines(self, *, start_ms: int | None = None, end_ms: int | None = None,
                        cluster: str | None = None) -> Iterator[CostRecord]:
        """The stored cost lines as ``CostRecord``s, in key order."""
        for record, _billed in self.billed_cost_lines(start_ms=start_ms, end_ms=end_ms, cluster=cluster):
            yield record

    def billed_cost_lines(self, *, start_ms: int | None = None, end_ms: int | None = None,
                          cluster: str | None = None) -> Iterator[tuple[CostRecord, int]]:
        """The stored cost lines, each with what it was billed (``BILLED_COST``), in key order (by code point, as
        SQLite and a PostgreSQL of collation C order them), zero lines included (billed 0)."""
        c, b, l = cost_lines.c, node_bills.c, label_sets.c
        rows = self._read(
            select(*(c[name] for name in _RECORD_COLUMNS), l.labels, l.carried_label_keys, b.instance_type,
                   b.price_model, b.price_version, BILLED_COST.label("billed_micro_usd"))
            .select_from(_WITH_LABELS.join(node_bills, _BILL_OF_LINE))
            .where(*self._range(cost_lines, start_ms, end_ms, cluster))
        )
        out = [(_cost_record(row._mapping), int(row._mapping["billed_micro_usd"])) for row in rows]
        for bill, zero in self._zero_lines(start_ms, end_ms, cluster):
            out.extend((zero_line_record(bill, line), 0) for line in zero)
        out.sort(key=lambda pair: _line_key(pair[0]))
        yield from out

    def allocation_sums(self, query: "AllocationQuery", *, start_ms: int | None = None,
                        end_ms: int | None = None) -> tuple[list["PodSum"], list["BucketSum"]]:
        """What ``services.billing.allocation`` folds into OpenCost allocations: pod lines per (step, group,
        shared bucket, sharing method, method, cost basis) with their GPU-hours (cost, memory and compute share ×
        GPU fraction × billed hours, and the units' capacity-hours), and the lines no pod carries -- plus the IDLE
        shared to pods -- per (step, node when ``idle_by_node``, kind). ``start_ms``/``end_ms``: only the windows
        starting in that part of the query's range (steps still counted from its start;
        ``services.billing.grain_reads`` reads the rest from rollups)."""
        first = query.start_ms if start_ms is None else start_ms
        last = query.end_ms if end_ms is None else end_ms
        from services.billing.allocation import BucketSum, PodSum

        c, b = cost_lines.c, node_bills.c
        step = ((c.window_start_unix_ms - query.start_ms) // query.step_ms).label("step")
        if query.aggregate == "namespace":
            group = c.namespace
        elif query.aggregate == "pod":
            group = c.namespace + "/" + c.pod_name
        elif query.aggregate == "node":
            group = c.node_name
        elif query.aggregate == "cluster":
            group = c.cluster
        else:
            group = label_sets.c.labels[query.label_key].as_string()
        joined = (_WITH_LABELS if query.aggregate == "label" else cost_lines).join(node_bills, _BILL_OF_LINE)
        in_range = self._range(cost_lines, first, last, query.cluster)
        billed_ms = b.billed_milliseconds
        # Grouping over a subquery keeps PostgreSQL from seeing two differently-bound copies of an expression.
        inner = (
            select(step, group.label("grp"), c.shared_from, c.sharing_method, c.method, c.cost_basis,
                   c.cost_micro_usd, (c.cost_share * c.gpu_fraction * billed_ms).label("gpu_ms"),
                   (c.memory_share * c.gpu_fraction * billed_ms).label("memory_ms"),
                   (c.compute_share * c.gpu_fraction * billed_ms).label("compute_ms"),
                   (c.gpu_fraction * billed_ms).label("unit_ms"))
            .select_from(joined).where(c.subject_kind == CostSubjectKind.POD.value, *in_range).subquery()
        )
        keys = (inner.c.step, inner.c.grp, inner.c.shared_from, inner.c.sharing_method, inner.c.method,
                inner.c.cost_basis)
        pod_rows = self._read(
            select(*keys, func.sum(inner.c.cost_micro_usd), func.count(), func.sum(inner.c.gpu_ms),
                   func.sum(inner.c.memory_ms), func.sum(inner.c.compute_ms), func.sum(inner.c.unit_ms))
            .group_by(*keys)
        )
        hour = 3_600_000.0
        pods = [PodSum(int(st), grp, shared_from, sharing_method, method, basis, int(cost), int(lines),
                       float(gpu or 0) / hour, float(memory or 0) / hour, float(compute or 0) / hour,
                       float(unit or 0) / hour)
                for st, grp, shared_from, sharing_method, method, basis, cost, lines, gpu, memory, compute, unit
                in pod_rows]
        kind = case((c.shared_from == NOT_SHARED, c.subject_kind), else_=c.shared_from).label("kind")
        shared = (c.shared_from != NOT_SHARED).label("shared")
        node = (c.node_name if query.idle_by_node else literal(None, String)).label("node")
        inner = (
            select(step, node, kind, shared, c.cost_micro_usd)
            .where((c.subject_kind != CostSubjectKind.POD.value) | (c.shared_from == CostSubjectKind.IDLE.value),
                   *in_range)
            .subquery()
        )
        keys = (inner.c.step, inner.c.node, inner.c.kind, inner.c.shared)
        bucket_rows = self._read(select(*keys, func.sum(inner.c.cost_micro_usd), func.count()).group_by(*keys))
        sums = {(int(st), node_name, kind_name, bool(is_shared)): [int(cost), int(lines)]
                for st, node_name, kind_name, is_shared, cost, lines in bucket_rows}
        for bill, zero in self._zero_lines(first, last, query.cluster):
            st = (bill["window_start_unix_ms"] - query.start_ms) // query.step_ms
            node_name = bill["node_name"] if query.idle_by_node else None
            for _gpu, kind_name, *_ in zero:
                sums.setdefault((st, node_name, kind_name, False), [0, 0])[1] += 1
        buckets = [BucketSum(st, node_name, kind_name, is_shared, cost, lines)
                   for (st, node_name, kind_name, is_shared), (cost, lines) in sums.items()]
        return pods, buckets

    def price_versions(self, versions: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The ``price_versions`` rows of ``versions``, by version."""
        versions = sorted(set(versions))
        if not versions:
            return {}
        rows = self._read(select(price_versions).where(price_versions.c.price_version.in_(versions)))
        return {row._mapping["price_version"]: dict(row._mapping) for row in rows}


    # -- true-up to the invoice ---------------------------------------------------------------------------------

    def trued_coverage(self, *, start_ms: int | None = None, end_ms: int | None = None,
                       cluster: str | None = None) -> tuple[int, int]:
        """(node-windows with a trued-up cost, node-windows) for windows starting in [start_ms, end_ms)."""
        self._require_bills(start_ms, end_ms, "reading the true-up coverage")
        (trued, total), = self._read(
            select(func.count(node_bills.c.trued_cost_micro_usd), func.count())
            .where(*self._range(node_bills, start_ms, end_ms, cluster))
        )
        return int(trued), int(total)

    def trueup_windows(self, *, start_ms: int, end_ms: int) -> tuple[LedgerWindow, ...]:
        """The node-windows starting in [start_ms, end_ms) with their list-price cost lines (in key order): what
        ``services.billing.trueup.true_up`` reprices."""
        self._require_bills(start_ms, end_ms, "the true-up (gpumeter reconcile)")
        b, c = node_bills.c, cost_lines.c
        bills = self._read(
            select(b.window_start_unix_ms, b.cluster, b.node_name, b.window_seconds, b.billed_milliseconds,
                   b.node_cost_micro_usd, b.provider_id, b.provider, trueups.c.bill_scope)
            .select_from(node_bills.outerjoin(trueups, trueups.c.trueup_id == b.trueup_id))
            .where(b.window_start_unix_ms >= start_ms, b.window_start_unix_ms < end_ms)
            .order_by(b.window_start_unix_ms, b.cluster, b.node_name)
        )
        lines: dict[NodeWindowKey, list[LedgerLine]] = defaultdict(list)
        for start, cluster, node, gpu, kind, pod, shared_from, micro in self._read(
                select(c.window_start_unix_ms, c.cluster, c.node_name, c.gpu_uuid, c.subject_kind, c.pod_uid,
                       c.shared_from, c.cost_micro_usd)
                .where(c.window_start_unix_ms >= start_ms, c.window_start_unix_ms < end_ms)):
            lines[NodeWindowKey(cluster, node, start)].append(
                LedgerLine((start, cluster, node, gpu, kind, pod, shared_from), kind, int(micro)))
        for bill, zero in self._zero_lines(start_ms, end_ms, None):
            key = NodeWindowKey(bill["cluster"], bill["node_name"], bill["window_start_unix_ms"])
            lines[key].extend(LedgerLine(_zero_line_key(key, line), line[1], 0) for line in zero)
        for window_lines in lines.values():
            window_lines.sort(key=lambda line: line.key)
        return tuple(
            LedgerWindow(cluster, node, start, seconds, int(billed), int(cost), provider_id or "",
                         tuple(lines.get(NodeWindowKey(cluster, node, start), ())), provider, scope or "")
            for start, cluster, node, seconds, billed, cost, provider_id, provider, scope in bills)

    def apply_trueup(self, result: TrueUp, *, applied_at_unix_ms: int, summary: str = "{}") -> TrueUpWrite:
        """Store ``result``: every node-window of its scope (``TrueUp.scope_keys``: not those another bill trued
        up) gets the trued-up cost it says (NULL where it says none) and ``trueup_id`` = the bill's digest, every
        line of those windows likewise; only values that differ
        are written, in one transaction, and the bill is recorded in ``trueups`` (once per digest). So applying
        the same bill again changes nothing; applying an amended bill replaces the trued-up values of its scope
        (the list-price columns are never touched). ``LedgerError`` (nothing written) when a trued window's lines
        do not add up to it or a window or line it names is not in the ledger."""
        bill = result.bill
        trueup_id = bill.digest()
        sums: dict[NodeWindowKey, int] = defaultdict(int)
        for key, micro in result.lines.items():
            sums[NodeWindowKey(key[1], key[2], key[0])] += micro
        for key, micro in result.windows.items():
            if sums.get(key, 0) != micro:
                raise LedgerError(f"trued-up lines of {key} add up to {sums.get(key, 0)} micro-USD, its trued-up "
                                  f"cost is {micro}: refusing to write a true-up that does not reconcile")
        if set(sums) - set(result.windows):
            raise LedgerError("trued-up lines for node-windows without a trued-up cost")
        b, c = node_bills.c, cost_lines.c
        scope = result.scope_keys
        changed_windows = changed_lines = 0
        try:
            with self._begin() as connection:
                if self.dialect == "postgresql":
                    self._uses_ids(connection)
                current, zero_lines, bill_columns = {}, {}, {}
                zero_texts = []
                for row in connection.execute(
                        select(b.window_start_unix_ms, b.cluster, b.node_name, b.trued_cost_micro_usd, b.trueup_id,
                               b.zero_lines, b.window_seconds, b.instance_type, b.price_model, b.price_version,
                               b.sharing, b.gpu_model, b.provider, b.region, b.zone, b.node_cost_micro_usd,
                               b.provider_id)
                        .where(b.window_start_unix_ms >= bill.scope_start_ms,
                               b.window_start_unix_ms < bill.scope_end_ms)):
                    m = row._mapping
                    key = NodeWindowKey(m["cluster"], m["node_name"], m["window_start_unix_ms"])
                    current[key] = (m["trued_cost_micro_usd"], m["trueup_id"])
                    bill_columns[key] = m
                    if m["zero_lines"]:
                        zero_texts.append((key, m))
                uuids = self._zero_line_gpu_uuids(lambda statement: connection.execute(statement).all(),
                                                  [m["zero_lines"] for _key, m in zero_texts])
                for key, m in zero_texts:
                    zero_lines[key] = (m, decode_zero_lines(m["zero_lines"], uuids))
                missing = (set(result.windows) | set(scope)) - set(current)
                if missing:
                    raise LedgerError(f"{len(missing)} node-windows of the true-up are not in the ledger, e.g. "
                                      f"{min(missing)}")
                window_updates = [
                    {"b_start": key.window_start_unix_ms, "b_cluster": key.cluster, "b_node": key.node_name,
                     "b_trued": result.windows.get(key), "b_run": trueup_id}
                    for key in sorted(scope)
                    if current[key] != (result.windows.get(key), trueup_id)
                ]
                # The bill rollups' trued-up sums move with every bill whose trued-up cost changes.
                bill_changes = [
                    read_rollups.BillTruedChange(bill_columns[key], current[key][0], result.windows.get(key))
                    for key in sorted(scope) if current[key][0] != result.windows.get(key)]
                read_rollups.add_trued(connection, READ_ROLLUPS, bill_changes)
                if window_updates and self._bill_rows:
                    # PostgreSQL from 0018: the bills are ``node_bill_rows``, the true-up's id a name's id.
                    run_id = self._name_id(connection, trueup_id)
                    connection.execute(
                        bill_ids.update_by_key(BILL_IDS, LINE_IDS.nodes, trued_cost_micro_usd=bindparam("b_trued"),
                                               trueup_name_id=literal(run_id)),
                        window_updates)
                elif window_updates:
                    connection.execute(
                        update(node_bills)
                        .where(b.window_start_unix_ms == bindparam("b_start"), b.cluster == bindparam("b_cluster"),
                               b.node_name == bindparam("b_node"))
                        .values(trued_cost_micro_usd=bindparam("b_trued"), trueup_id=bindparam("b_run")),
                        window_updates)
                line_updates = []
                # What the rollups' trued-up sums move by: every line whose trued-up cost changes, stored or zero
                # (services.billing.rollups).
                trued_changes = []
                for row in connection.execute(
                        select(*(c[name] for name in _RECORD_COLUMNS), c.trued_cost_micro_usd, label_sets.c.labels,
                               label_sets.c.carried_label_keys, b.instance_type, b.price_model, b.price_version,
                               b.sharing.label("bill_sharing"), b.gpu_model.label("bill_gpu_model"))
                        .select_from(_WITH_LABELS.join(node_bills, _BILL_OF_LINE))
                        .where(c.window_start_unix_ms >= bill.scope_start_ms,
                               c.window_start_unix_ms < bill.scope_end_ms)):
                    m = row._mapping
                    start, cluster, node, gpu, kind, pod, shared_from, trued = (
                        m["window_start_unix_ms"], m["cluster"], m["node_name"], m["gpu_uuid"], m["subject_kind"],
                        m["pod_uid"], m["shared_from"], m["trued_cost_micro_usd"])
                    if NodeWindowKey(cluster, node, start) not in scope:
                        continue
                    line_key = (start, cluster, node, gpu, kind, pod, shared_from)
                    wanted = result.lines.get(line_key)
                    if (wanted is None) != (NodeWindowKey(cluster, node, start) not in result.windows):
                        raise LedgerError(f"no trued-up cost for the line {line_key} of a trued-up node-window")
                    if trued != wanted:
                        line_updates.append({"b_start": start, "b_cluster": cluster, "b_node": node, "b_gpu": gpu,
                                             "b_kind": kind, "b_pod": pod, "b_shared": shared_from,
                                             "b_trued": wanted})
                        trued_changes.append(rollups.TruedChange(_cost_record(m), m["bill_gpu_model"],
                                                                 m["bill_sharing"], trued, wanted))
                # A zero line's trued-up cost is 0 in a trued window, NULL elsewhere (``line_storage``): it changes
                # when its window becomes trued or stops being so, and the rollups count it as a trued line then,
                # as 0007 counted the row it was (billed sums do not move: 0 either way).
                zero_changed = 0
                for key, (row_of_bill, zero) in zero_lines.items():
                    if key not in scope:
                        continue
                    for line in zero:
                        line_key = _zero_line_key(key, line)
                        wanted = result.lines.get(line_key)
                        if (wanted is None) != (key not in result.windows):
                            raise LedgerError(f"no trued-up cost for the line {line_key} of a trued-up node-window")
                        if wanted not in (None, 0):
                            raise LedgerError(f"the true-up gives {wanted} micro-USD to the line {line_key}, whose "
                                              "list cost is 0: a line without cost cannot carry a trued-up cost")
                    before = None if current[key][0] is None else 0
                    after = 0 if key in result.windows else None
                    if before != after:
                        zero_changed += len(zero)
                        trued_changes.extend(
                            rollups.TruedChange(zero_line_record(row_of_bill, line), row_of_bill["gpu_model"],
                                                row_of_bill["sharing"], before, after) for line in zero)
                rollups.add_trued(connection, ROLLUPS, trued_changes, team_key=self.team_label)
                focus_rollups.add_trued(connection, FOCUS_ROLLUPS, bill_changes, trued_changes, bill_columns)
                if line_updates and self._uses_ids(connection) and self._packed:
                    # PostgreSQL from 0016: ``cost_lines`` is a view; a node-window's lines are one pack, whose
                    # trued-up array is rewritten (``line_packs``).
                    try:
                        line_packs.write_trued(connection, line_updates)
                    except LookupError as exc:  # raised in the transaction: nothing of the true-up is written
                        raise LedgerError(f"true-up {trueup_id[:12]}: {exc}") from exc
                elif line_updates and self._by_ids:
                    # PostgreSQL at 0014 and 0015: ``cost_lines`` is a view; its rows are ``cost_line_rows``.
                    connection.execute(line_ids.trueup_update(LINE_IDS), line_updates)
                elif line_updates:
                    connection.execute(
                        update(cost_lines)
                        .where(c.window_start_unix_ms == bindparam("b_start"), c.cluster == bindparam("b_cluster"),
                               c.node_name == bindparam("b_node"), c.gpu_uuid == bindparam("b_gpu"),
                               c.subject_kind == bindparam("b_kind"), c.pod_uid == bindparam("b_pod"),
                               c.shared_from == bindparam("b_shared"))
                        .values(trued_cost_micro_usd=bindparam("b_trued")),
                        line_updates)
                changed_windows, changed_lines = len(window_updates), len(line_updates) + zero_changed
                recorded = connection.execute(
                    self._insert(trueups).on_conflict_do_nothing().returning(trueups.c.trueup_id),
                    [{"trueup_id": trueup_id, "bill_name": bill.name, "bill_format": bill.format,
                      "basis": bill.basis, "bill_scope": bill.scope_key, "scope_start_unix_ms": bill.scope_start_ms,
                      "scope_end_unix_ms": bill.scope_end_ms, "applied_at_unix_ms": applied_at_unix_ms,
                      "line_items": len(bill.items),
                      "billed_micro_usd": sum(m.billed_micro_usd for m in result.machines),
                      "trued_micro_usd": result.trued_micro_usd, "summary": summary}],
                ).all()
        except SQLAlchemyError as exc:
            raise LedgerError(f"writing the true-up {trueup_id[:12]} to {self!r} failed: {exc}") from exc
        except rollups.MixedTeamLabels as exc:
            raise LedgerError(f"true-up {trueup_id[:12]}: {exc}") from exc
        return TrueUpWrite(trueup_id, changed_windows, changed_lines, bool(recorded))

    def _uses_ids(self, connection: Connection) -> bool:
        """Whether the lines are stored by dictionary ids; also looks whether they are packed (``_packed``) and
        whether the bills are rows of ids (``_bill_rows``)."""
        if self._by_ids is None:
            self._bill_rows = bill_ids.uses_bill_rows(connection)
            self._packed = self._bill_rows or line_packs.uses_packs(connection)
            self._by_ids = self._packed or line_ids.uses_ids(connection)
        return self._by_ids

    def _name_id(self, connection: Connection, name: str) -> int:
        """The ``ledger_bill_names`` id of ``name`` (PostgreSQL from 0018): cached, else inserted if new and read
        in ``connection``'s transaction (``bill_ids``)."""
        known = self._ids.get("names").get(name)
        if known is None:
            known = bill_ids.name_id(connection, BILL_IDS, name)
        return known

    def _insert_bill_rows(self, connection: Connection, bill_rows: Mapping[tuple[int, str, str], Mapping[str, Any]]
                          ) -> tuple[set[tuple[int, str, str]], set[int]]:
        """PostgreSQL from 0018: insert the bills (their ``node_bills`` columns by (start, cluster, node)) as
        ``node_bill_rows``, skipping those already there, and their zero sets first (``bill_ids``); returns the
        node-windows inserted and the zero sets stored. The ids are in the cache (``_resolve_ids``)."""
        texts = {row["zero_lines"] for row in bill_rows.values() if row["zero_lines"] is not None}
        try:
            stored = bill_ids.insert_zero_sets(
                connection, BILL_IDS, [t for t in texts if bill_ids.zero_set_id(t) not in self._stored_zero_sets])
        except LookupError as exc:  # raised in the write's transaction: nothing of it is committed
            raise LedgerError(f"refusing to mix up zero lines: {exc}") from exc
        nodes, kinds = self._ids.get("nodes"), self._ids.get("bill_kinds")
        publisher = None if self.publisher is None else self._name_id(connection, self.publisher)
        window_of: dict[tuple[int, int], tuple[int, str, str]] = {}
        values = []
        for window, row in bill_rows.items():
            node = nodes[bill_ids.node_key(row)]
            window_of[(window[0], node)] = window
            values.append(bill_ids.row_values(row, node_id=node, bill_kind_id=kinds[bill_ids.kind_key(row)],
                                              publisher_id=publisher))
        r = BILL_IDS.rows.c
        inserted = connection.execute(
            postgresql.insert(BILL_IDS.rows).on_conflict_do_nothing().returning(r.window_start_unix_ms, r.node_id),
            values).all()
        return {window_of[(start, node)] for start, node in inserted}, stored

    def trueup_runs(self) -> tuple[dict[str, Any], ...]:
        """Every bill applied, oldest first, as column dicts."""
        return tuple(dict(row._mapping) for row in self._read(
            select(trueups).order_by(trueups.c.applied_at_unix_ms, trueups.c.trueup_id)))


_RECORD_COLUMNS = ("window_start_unix_ms", "cluster", "node_name", "window_seconds", "gpu_uuid", "subject_kind",
                   "pod_uid", "namespace", "pod_name", "cost_share", "cost_micro_usd", "shared_from",
                   "sharing_method", "method", "cost_basis", "memory_share", "compute_share", "gpu_fraction")


def _cost_record(m: Mapping[str, Any]) -> CostRecord:
    """The ``CostRecord`` of a stored line joined with its label set and bill."""
    return CostRecord(
        cluster=m["cluster"],
        node_name=m["node_name"],
        window_start_unix_ms=m["window_start_unix_ms"],
        window_seconds=m["window_seconds"],
        gpu_uuid=m["gpu_uuid"] or None,
        subject_kind=CostSubjectKind(m["subject_kind"]),
        pod_uid=m["pod_uid"] or None,
        namespace=m["namespace"],
        pod_name=m["pod_name"],
        labels=MappingProxyType(dict(m["labels"])),
        cost_share=m["cost_share"],
        cost_micro_usd=int(m["cost_micro_usd"]),
        instance_type=m["instance_type"],
        price_model=m["price_model"],
        price_version=m["price_version"],
        carried_label_keys=tuple(filter(None, (m["carried_label_keys"] or "").split(","))),
        shared_from=CostSubjectKind(m["shared_from"]) if m["shared_from"] else None,
        sharing_method=m["sharing_method"],
        method=m["method"],
        cost_basis=m["cost_basis"],
        memory_share=float(m["memory_share"]),
        compute_share=float(m["compute_share"]),
        gpu_fraction=float(m["gpu_fraction"]),
    )


def _missing_partition(error: LedgerError) -> bool:
    """Whether ``error`` is PostgreSQL's refusal of a row no partition holds (SQLSTATE 23514)."""
    cause = error.__cause__
    original = getattr(cause, "orig", None)
    return getattr(original, "sqlstate", None) == "23514" and "no partition" in str(original)


def _sqlite_pragmas(dbapi_connection: Any, in_memory: bool, *, read_only: bool = False) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        if not in_memory and not read_only:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
        if read_only:
            cursor.execute("PRAGMA query_only=ON")
    finally:
        cursor.close()


def _postgres_read_only(dbapi_connection: Any) -> None:
    # psycopg opens a transaction for this statement; commit it so the setting holds for the session.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
    finally:
        cursor.close()
    dbapi_connection.commit()
