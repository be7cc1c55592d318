"""OpenCost's ``/allocation`` over the ledger: query parameters in, allocation sets out. Pure (the clock's ``now`` and
the ledger's summed rows are passed in).

**Query** (``parse_query``): OpenCost's parameters, with its forms:

* ``window`` (required): ``today``, ``yesterday``, ``week``, ``month``, ``lastweek``, ``lastmonth`` (UTC);
  ``<n>m|h|d|w`` (the past n units, rounded forward to the unit as OpenCost does: ``24h`` ends at the next full
  hour, ``7d`` at the next midnight, ``2w`` too); ``<n><u> offset <m><u>``; a pair of Unix seconds
  ``1586822400,1586908800``; a pair of RFC 3339 UTC times ``2020-04-01T00:00:00Z,2020-04-03T00:00:00Z``.
  At most ``max_window_seconds`` long; it covers the ledger windows that *start* in [start, end), as
  ``gpumeter report`` does.
* ``aggregate``: ``namespace`` (default), ``pod``, ``node``, ``cluster`` or ``label:<key>``.
* ``step``: a duration (``1h``, ``1d``): one allocation set per step of the window (at most ``max_steps``; a window
  that is not a whole number of steps ends with a shorter one); default the whole window. ``accumulate=true``
  merges them into one.
* ``includeIdle`` (default false): also the cost no pod carries, as allocations of their own: ``__idle__`` and the
  other buckets billing's sharing policy kept (``__driver_reserved__``, ``__unattributed__``, ``__unavailable__``,
  ``__node_other__``); with ``idleByNode=true`` one of each per node (``<node>/__idle__``). With includeIdle the
  allocations add up to the node bills of the window exactly (``gpumeter.reconciliation``).
* ``shareIdle`` (default false, as OpenCost): idle cost billing *shared* to pods (sharing policy ``idle=...``) is
  shown in their ``gpuCost`` (and ``gpuCostIdle``); with false it is moved back to ``__idle__``, exactly (the
  shared lines say what they came from). Idle that billing *kept* is never re-shared here: sharing is billing's,
  in one place, and the response warns when shareIdle asked for what the ledger's policy did not do.
* ``resolution`` and ``cluster`` (a cluster to keep) are accepted; any other parameter is a 400.

**Allocation** (OpenCost's JSON names where they apply): ``name``, ``properties`` (``namespace``, ``pod``,
``node``, ``cluster``, ``labels``), ``window`` {``start``, ``end``}, ``start``, ``end``, ``minutes``, ``gpuHours``
(GPU-hours paid: cost share × GPU fraction × billed hours), ``gpuCost``, ``gpuCostIdle``, ``sharedCost`` (buckets
other than idle that billing shared to the allocation's pods), ``totalCost`` (USD); gpumeter's own: ``directCost``
(the pods' own use), ``sharedFrom`` (per bucket: method and cost), ``gpuMemoryHours``/``gpuComputeHours``
(memory and compute share × GPU fraction × billed hours) and ``memoryShare``/``computeShare`` (those over the GPU
capacity-hours of the units the allocation was on), ``methods`` (attribution methods of its units), ``costBasis``,
and every cost in exact micro-dollars (``totalCostMicroUsd``, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Mapping, Sequence

from gpumeter.errors import GpumeterError

AGGREGATES = ("namespace", "pod", "node", "cluster")
KNOWN_PARAMETERS = ("window", "aggregate", "step", "accumulate", "includeIdle", "shareIdle", "idleByNode",
                    "resolution", "cluster")
IDLE_NAME = "__idle__"
UNALLOCATED = "__unallocated__"
BUCKET_NAMES = {"IDLE": IDLE_NAME, "DRIVER_RESERVED": "__driver_reserved__", "UNATTRIBUTED": "__unattributed__",
                "UNAVAILABLE": "__unavailable__", "NODE_OTHER": "__node_other__"}
GPU_BUCKETS = ("IDLE", "DRIVER_RESERVED", "UNATTRIBUTED", "UNAVAILABLE")
DEFAULT_MAX_WINDOW_SECONDS = 93 * 86_400
DEFAULT_MAX_STEPS = 1_000
MIN_STEP_SECONDS = 60
_UNIT_MS = {"m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 7 * 86_400_000}
_DURATION = re.compile(r"^(\d+)(m|h|d|w)$")
_DURATION_OFFSET = re.compile(r"^(\d+)(m|h|d|w) offset (\d+)(m|h|d|w)$")
_TIMESTAMPS = re.compile(r"^(\d+)[,-](\d+)$")
_RFC3339 = r"\d\d\d\d-\d\d-\d\dT\d\d:\d\d:\d\dZ"
_RFC3339_PAIR = re.compile(f"^({_RFC3339}),({_RFC3339})$")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,251}[A-Za-z0-9])?$")
_TRUE = {"true": True, "1": True, "false": False, "0": False, "": False}


class BadQuery(GpumeterError):
    """A query parameter the API cannot answer (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class AllocationQuery:
    start_ms: int
    end_ms: int
    aggregate: str  # namespace | pod | node | cluster | label
    label_key: str | None
    steps: tuple[tuple[int, int], ...]
    include_idle: bool
    share_idle: bool
    idle_by_node: bool
    cluster: str | None

    @property
    def step_ms(self) -> int:
        return self.steps[0][1] - self.steps[0][0]

    def describe_aggregate(self) -> str:
        return f"label:{self.label_key}" if self.aggregate == "label" else self.aggregate


def _utc(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _day_start(moment: datetime) -> datetime:
    return moment.replace(hour=0, minute=0, second=0, microsecond=0)


def parse_window(text: str, now_ms: int) -> tuple[int, int]:
    """OpenCost's window forms (see the module docstring) → [start_ms, end_ms). ``BadQuery`` otherwise."""
    window = (text or "").strip()
    now = _utc(now_ms)
    today = _day_start(now)
    weekday = (today.weekday() + 1) % 7  # OpenCost's weeks start on Sunday
    if window == "today":
        return _ms(today), _ms(today + timedelta(days=1))
    if window == "yesterday":
        return _ms(today - timedelta(days=1)), _ms(today)
    if window == "week":
        return _ms(today - timedelta(days=weekday)), now_ms
    if window == "lastweek":
        start = today - timedelta(days=weekday + 7)
        return _ms(start), _ms(start + timedelta(days=7))
    if window == "month":
        return _ms(today.replace(day=1)), now_ms
    if window == "lastmonth":
        end = today.replace(day=1)
        return _ms((end - timedelta(days=1)).replace(day=1)), _ms(end)
    match = _DURATION.match(window)
    if match:
        count, unit = int(match[1]), match[2]
        if unit == "w":
            end = _ms(today + timedelta(days=1))
            return end - count * _UNIT_MS["w"], end
        end = (now_ms // _UNIT_MS[unit] + 1) * _UNIT_MS[unit]
        return end - count * _UNIT_MS[unit], end
    match = _DURATION_OFFSET.match(window)
    if match:
        end = now_ms - int(match[3]) * _UNIT_MS[match[4]]
        return end - int(match[1]) * _UNIT_MS[match[2]], end
    match = _TIMESTAMPS.match(window)
    if match:
        return int(match[1]) * 1000, int(match[2]) * 1000
    match = _RFC3339_PAIR.match(window)
    if match:
        try:
            return tuple(_ms(datetime.fromisoformat(m.replace("Z", "+00:00"))) for m in (match[1], match[2]))
        except ValueError as exc:  # the shape matched, the date does not exist (month 13, 31 April)
            raise BadQuery(f"window {text!r} is not a pair of valid RFC 3339 UTC times: {exc}") from None
    raise BadQuery(f"window {text!r} is not one of today, yesterday, week, month, lastweek, lastmonth, a duration "
                   "(45m, 24h, 7d, 2w), '<duration> offset <duration>', a pair of Unix seconds (1586822400,"
                   "1586908800) or of RFC 3339 UTC times (2020-04-01T00:00:00Z,2020-04-03T00:00:00Z)")


def _flag(params: Mapping[str, str], name: str) -> bool:
    value = params.get(name, "false").strip().lower()
    if value not in _TRUE:
        raise BadQuery(f"{name}={params[name]!r} is not true or false")
    return _TRUE[value]


def parse_query(params: Mapping[str, str], now_ms: int, *, max_window_seconds: int = DEFAULT_MAX_WINDOW_SECONDS,
                max_steps: int = DEFAULT_MAX_STEPS) -> AllocationQuery:
    """The query of ``params`` (each parameter given once); ``BadQuery`` with what is wrong and what is allowed."""
    unknown = sorted(set(params) - set(KNOWN_PARAMETERS))
    if unknown:
        raise BadQuery(f"unsupported parameter{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; gpumeter's "
                       f"/allocation takes {', '.join(KNOWN_PARAMETERS)}")
    if not params.get("window"):
        raise BadQuery("window is required (e.g. window=24h, window=7d, window=today or an RFC 3339 pair)")
    start_ms, end_ms = parse_window(params["window"], now_ms)
    if end_ms <= start_ms:
        raise BadQuery(f"window {params['window']!r} ends before it starts")
    if end_ms - start_ms > max_window_seconds * 1000:
        raise BadQuery(f"window {params['window']!r} is {(end_ms - start_ms) / 86_400_000:g} days; at most "
                       f"{max_window_seconds / 86_400:g} days per query")
    aggregate_text = params.get("aggregate", "namespace").strip()
    kind, sep, key = aggregate_text.partition(":")
    if kind == "label":
        if not sep or not _LABEL_KEY.match(key):
            raise BadQuery(f"aggregate={aggregate_text!r}: label:<key> needs a Kubernetes label key")
        aggregate, label_key = "label", key
    elif sep or kind not in AGGREGATES:
        raise BadQuery(f"aggregate={aggregate_text!r} is not one of {', '.join(AGGREGATES)} or label:<key>")
    else:
        aggregate, label_key = kind, None
    step_ms = end_ms - start_ms
    if params.get("step") and not _flag({"accumulate": params.get("accumulate", "false")}, "accumulate"):
        match = _DURATION.match(params["step"].strip())
        if not match:
            raise BadQuery(f"step={params['step']!r} is not a duration such as 1h or 1d")
        step_ms = int(match[1]) * _UNIT_MS[match[2]]
        if step_ms < MIN_STEP_SECONDS * 1000:
            raise BadQuery(f"step={params['step']!r} is shorter than {MIN_STEP_SECONDS} s")
    elif params.get("accumulate"):
        _flag(params, "accumulate")
    count = -(-(end_ms - start_ms) // step_ms)
    if count > max_steps:
        raise BadQuery(f"step={params.get('step')!r} makes {count} allocation sets; at most {max_steps}")
    steps = tuple((s, min(s + step_ms, end_ms)) for s in range(start_ms, end_ms, step_ms))
    cluster = params.get("cluster") or None
    return AllocationQuery(start_ms, end_ms, aggregate, label_key, steps, _flag(params, "includeIdle"),
                           _flag(params, "shareIdle"), _flag(params, "idleByNode"), cluster)


# -- the ledger's sums, and what the API makes of them -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PodSum:
    """Pod lines of one (step, group) summed per (shared bucket, method, attribution method, cost basis)."""

    step: int
    group: str | None
    shared_from: str  # '' for direct lines
    sharing_method: str
    method: str
    cost_basis: str
    cost_micro_usd: int
    lines: int
    gpu_hours: float
    memory_gpu_hours: float
    compute_gpu_hours: float
    unit_hours: float


@dataclass(frozen=True, slots=True)
class BucketSum:
    """Lines of one (step, node or None, bucket kind) no pod carries -- or, ``shared`` True, the IDLE billing
    shared to pods (what ``shareIdle=false`` moves back)."""

    step: int
    node: str | None
    kind: str
    shared: bool
    cost_micro_usd: int
    lines: int


@dataclass
class _Allocation:
    name: str
    properties: dict[str, Any]
    direct: int = 0
    idle: int = 0  # shared idle shown in gpuCost
    gpu_bucket: int = 0  # a GPU bucket's own cost (bucket allocations)
    idle_bucket: int = 0  # of which IDLE (kept, or moved back from the pods)
    other_bucket: int = 0  # node_other's own cost (its allocation)
    shared: dict[str, list] = field(default_factory=dict)  # bucket -> [method, micro-dollars], shown in sharedCost
    gpu_hours: float = 0.0
    memory_hours: float = 0.0
    compute_hours: float = 0.0
    unit_hours: float = 0.0
    methods: set = field(default_factory=set)
    bases: set = field(default_factory=set)

    @property
    def shared_micro(self) -> int:
        return sum(amount for _, amount in self.shared.values())

    @property
    def gpu_micro(self) -> int:
        return self.direct + self.idle + self.gpu_bucket

    @property
    def total_micro(self) -> int:
        return self.gpu_micro + self.shared_micro + self.other_bucket


def _usd(micro: int) -> float:
    return round(micro / 1_000_000, 6)


def _iso(ms: int) -> str:
    return _utc(ms).isoformat(timespec="seconds").replace("+00:00", "Z")


def _group_properties(query: AllocationQuery, group: str | None) -> dict[str, Any]:
    if query.aggregate == "label":
        return {"labels": {query.label_key: group}} if group is not None else {}
    if query.aggregate == "pod" and group is not None:
        namespace, _, pod = group.partition("/")
        return {"namespace": namespace, "pod": pod}
    return {query.aggregate: group} if group is not None else {}


def allocation_sets(query: AllocationQuery, pods: Iterable[PodSum], buckets: Iterable[BucketSum]
                    ) -> list[dict[str, dict[str, Any]]]:
    """One allocation set (name → allocation JSON) per step of ``query`` (one in all when accumulated)."""
    sets: list[dict[str, _Allocation]] = [{} for _ in query.steps]
    for row in pods:
        name = row.group if row.group is not None else UNALLOCATED
        allocation = sets[row.step].setdefault(name, _Allocation(name, _group_properties(query, row.group)))
        if not row.shared_from:
            allocation.direct += row.cost_micro_usd
            allocation.gpu_hours += row.gpu_hours
            allocation.memory_hours += row.memory_gpu_hours
            allocation.compute_hours += row.compute_gpu_hours
            allocation.unit_hours += row.unit_hours
            if row.method:
                allocation.methods.add(row.method)
            if row.cost_basis:
                allocation.bases.add(row.cost_basis)
        elif row.shared_from == "IDLE":
            if query.share_idle:
                allocation.idle += row.cost_micro_usd
        else:
            entry = allocation.shared.setdefault(row.shared_from.lower(), [row.sharing_method, 0])
            entry[1] += row.cost_micro_usd
    if query.include_idle:
        for row in buckets:
            if row.shared and query.share_idle:
                continue  # stays in the pods' gpuCost
            base = BUCKET_NAMES[row.kind]
            name = f"{row.node}/{base}" if row.node is not None else base
            properties = {"node": row.node} if row.node is not None else {}
            allocation = sets[row.step].setdefault(name, _Allocation(name, properties))
            if row.kind in GPU_BUCKETS:
                allocation.gpu_bucket += row.cost_micro_usd
                if row.kind == "IDLE":
                    allocation.idle_bucket += row.cost_micro_usd
            else:
                allocation.other_bucket += row.cost_micro_usd
    out = []
    for (start, end), allocations in zip(query.steps, sets):
        if query.cluster is not None:
            for allocation in allocations.values():
                allocation.properties.setdefault("cluster", query.cluster)
        out.append({name: _json(a, start, end) for name, a in sorted(allocations.items())})
    return out


def _json(a: _Allocation, start: int, end: int) -> dict[str, Any]:
    idle = a.idle + a.idle_bucket
    return {
        "name": a.name,
        "properties": a.properties,
        "window": {"start": _iso(start), "end": _iso(end)},
        "start": _iso(start),
        "end": _iso(end),
        "minutes": (end - start) / 60_000,
        "gpuHours": round(a.gpu_hours, 9),
        "gpuCost": _usd(a.gpu_micro),
        "gpuCostIdle": _usd(idle),
        "sharedCost": _usd(a.shared_micro),
        "totalCost": _usd(a.total_micro),
        "directCost": _usd(a.direct),
        "sharedFrom": {kind: {"method": method, "cost": _usd(amount), "costMicroUsd": amount}
                       for kind, (method, amount) in sorted(a.shared.items())},
        "gpuMemoryHours": round(a.memory_hours, 9),
        "gpuComputeHours": round(a.compute_hours, 9),
        "memoryShare": round(a.memory_hours / a.unit_hours, 9) if a.unit_hours else 0.0,
        "computeShare": round(a.compute_hours / a.unit_hours, 9) if a.unit_hours else 0.0,
        "methods": sorted(a.methods),
        "costBasis": sorted(a.bases),
        "totalCostMicroUsd": a.total_micro,
        "gpuCostMicroUsd": a.gpu_micro,
        "gpuCostIdleMicroUsd": idle,
        "directCostMicroUsd": a.direct,
        "sharedCostMicroUsd": a.shared_micro,
    }


def response(query: AllocationQuery, sets: Sequence[Mapping[str, Mapping[str, Any]]], *,
             policies: Sequence[tuple[str, int]], bills_micro_usd: int, grain: str | None = None) -> dict[str, Any]:
    """OpenCost's response envelope (``code``, ``data``) and gpumeter's notes: the query as understood, the sharing
    policies of the window's node-windows, a warning where shareIdle asked for sharing billing did not do, --
    with includeIdle -- the reconciliation of the allocations to the node bills, and ``grain``: which grain the
    allocations were summed from (``daily rollups (29 days), minute cost lines (30 minutes)``)."""
    warnings = []
    kept_idle = sum(count for policy, count in policies
                    if not any(item.startswith("idle=") for item in policy.split(",")))
    if query.share_idle and kept_idle:
        warnings.append(f"shareIdle=true: billing's sharing policy kept IDLE as its own line in {kept_idle} of the "
                        f"window's {sum(c for _, c in policies)} node-windows, and the API does not re-share it "
                        "(sharing is billing's: GPUMETER_BILLING_SHARING=idle=weighted); it is in __idle__ "
                        "(includeIdle=true)")
    notes: dict[str, Any] = {
        "window": {"start": _iso(query.start_ms), "end": _iso(query.end_ms)},
        "aggregate": query.describe_aggregate(),
        "sharingPolicies": [{"policy": policy, "nodeWindows": count} for policy, count in policies],
        "warnings": warnings,
    }
    if grain is not None:
        notes["grain"] = grain
    if query.include_idle:
        total = sum(a["totalCostMicroUsd"] for step in sets for a in step.values())
        notes["reconciliation"] = {"allocationsMicroUsd": total, "nodeBillsMicroUsd": bills_micro_usd,
                                   "reconciled": total == bills_micro_usd}
    return {"code": 200, "data": list(sets), "gpumeter": notes}


def error_response(code: int, message: str) -> dict[str, Any]:
    return {"code": code, "message": message}
