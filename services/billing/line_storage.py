"""What a cost line stores in the ledger (revision 0008): zero lines folded into their bill, labels stored once. Pure.

**Zero lines.** A line that carries no cost and no share (``is_zero_line``) is not a ``cost_lines`` row: its
node bill lists it in ``node_bills.zero_lines`` and every reader gets it back (``zero_line_record``) exactly as it
was written. Such a line is a bucket's (subject kind not POD, no pod, not shared) with ``cost_micro_usd`` 0,
``cost_share``, ``memory_share`` and ``compute_share`` 0.0, no namespace, pod name, labels or carried label keys,
no sharing method, and its bill's window length, instance type, price model and price version (every line has
those). What is left of it -- unit, kind, attribution method, cost basis and GPU fraction -- is what the bill's
column keeps, as compact JSON: first the (method, cost basis, GPU fraction) most of its units share, then one
entry per unit in key order (``gpu_uuid``, '' for node-level) with one letter per zero line's kind (I IDLE,
D DRIVER_RESERVED, A UNATTRIBUTED, V UNAVAILABLE, O NODE_OTHER), followed by the unit's own method, cost basis
and GPU fraction where they are not the first entry's::

    [["exclusive","memory",1.0],["GPU-0f7a…","V"],["GPU-acc9…","AV"],["MIG-1c…","DV","mig_instance","memory",0.5]]

NULL: none. On PostgreSQL from revision 0014 a unit is named by its ``ledger_gpus`` id, a JSON number, instead of
its uuid (``services.billing.line_ids``: a bill's 24 zero lines named 8 uuids in ~1,150 bytes); readers give the
uuid back (``decode_zero_lines(text, gpu_uuids)``), and a text may mix both (bills written before 0014). The GPU
fraction is the line's float, written as ``repr`` writes it (it reads back bit for bit). A
zero line's trued-up cost is 0 once its node-window is trued up (the true-up apportions by list cost: a line of
list cost 0 gets 0) and NULL before, as a stored line's is.

**Label sets.** A line's labels and carried label keys are a ``label_sets`` row, referenced by
``cost_lines.label_set_id``: the first 8 bytes of the SHA-256 of the set's canonical JSON
(``label_set_json``), as a signed 64-bit integer (``label_set_id``); 0 is the empty set (no labels, no carried
keys: every bucket line), which SQLite stores in no bytes at all.

Both are stored formats (migration ``0008_compact_lines`` writes them with these functions): change them only with
a migration that rewrites what is stored.
"""

from __future__ import annotations

import hashlib
import json
import math
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

from schemas.records import CostRecord, CostSubjectKind

EMPTY_LABEL_SET_ID = 0
_EMPTY: Mapping[str, str] = MappingProxyType({})


def _is_zero(value: float) -> bool:
    # -0.0 == 0 but does not read back as 0.0: such a line is stored as it is.
    return value == 0 and math.copysign(1.0, value) > 0


def is_zero_line(cost: CostRecord, window_seconds: int, instance_type: str, price_model: str,
                 price_version: str) -> bool:
    """Whether ``cost`` is a zero line of a bill with these facts (see the module docstring)."""
    return (cost.cost_micro_usd == 0 and cost.subject_kind is not CostSubjectKind.POD and cost.pod_uid is None
            and cost.shared_from is None and _is_zero(cost.cost_share) and _is_zero(cost.memory_share)
            and _is_zero(cost.compute_share) and cost.namespace is None and cost.pod_name is None
            and not cost.labels and not cost.carried_label_keys and cost.sharing_method == ""
            and cost.window_seconds == window_seconds and cost.instance_type == instance_type
            and cost.price_model == price_model and cost.price_version == price_version)


ZeroLine = tuple[str, str, str, str, float]  # (gpu_uuid or '', subject kind, method, cost basis, gpu fraction)


# One letter per bucket kind in ``node_bills.zero_lines`` (a POD line is never a zero line).
_KIND_LETTERS = {"IDLE": "I", "DRIVER_RESERVED": "D", "UNATTRIBUTED": "A", "UNAVAILABLE": "V", "NODE_OTHER": "O"}
_LETTER_KINDS = {letter: kind for kind, letter in _KIND_LETTERS.items()}


def encode_zero_lines(lines: Iterable[ZeroLine], gpu_ids: Mapping[str, int] | None = None) -> str | None:
    """The ``node_bills.zero_lines`` text of one bill's zero lines (None: none); see the module docstring. With
    ``gpu_ids`` (uuid, '' included, -> id) each unit is written as its id."""
    units: dict[tuple[str, str, str, float], list[str]] = {}
    for gpu_uuid, kind, method, basis, fraction in sorted(lines, key=lambda z: (z[0], z[1])):
        units.setdefault((gpu_uuid, method, basis, fraction), []).append(_KIND_LETTERS[kind])
    if not units:
        return None
    attributes = [unit[1:] for unit in units]
    default = max(attributes, key=attributes.count)  # the first of the most common
    entries: list[list] = [list(default)]
    for (gpu, *rest), letters in units.items():
        entry = [gpu if gpu_ids is None else gpu_ids[gpu], "".join(letters)]
        if tuple(rest) != default:
            entry.extend(rest)
        entries.append(entry)
    return json.dumps(entries, separators=(",", ":"), ensure_ascii=False)


def zero_line_gpu_ids(text: str | None) -> set[int]:
    """The GPU ids (not uuids) a ``zero_lines`` text names."""
    if not text:
        return set()
    _default, *entries = json.loads(text)
    return {entry[0] for entry in entries if isinstance(entry[0], int)}


def decode_zero_lines(text: str | None, gpu_uuids: Mapping[int, str] | None = None) -> list[ZeroLine]:
    """``encode_zero_lines``' lines back, in key order (gpu_uuid, kind); a unit named by its id is given its uuid
    from ``gpu_uuids`` (``KeyError`` when it lacks it)."""
    if not text:
        return []
    default, *entries = json.loads(text)
    out = []
    for gpu, letters, *rest in entries:
        if isinstance(gpu, int):
            if gpu_uuids is None:
                raise KeyError(f"zero lines name the GPU id {gpu} and no GPU ids were given")
            gpu = gpu_uuids[gpu]
        method, basis, fraction = rest or default
        out.extend((gpu, _LETTER_KINDS[letter], method, basis, float(fraction)) for letter in letters)
    out.sort(key=lambda z: (z[0], z[1]))
    return out


def zero_line_record(bill: Mapping[str, Any], line: ZeroLine) -> CostRecord:
    """The ``CostRecord`` of a zero line of ``bill`` (a ``node_bills`` row's columns)."""
    gpu_uuid, kind, method, basis, fraction = line
    return CostRecord(
        cluster=bill["cluster"], node_name=bill["node_name"], window_start_unix_ms=bill["window_start_unix_ms"],
        window_seconds=bill["window_seconds"], gpu_uuid=gpu_uuid or None, subject_kind=CostSubjectKind(kind),
        pod_uid=None, namespace=None, pod_name=None, labels=_EMPTY, cost_share=0.0, cost_micro_usd=0,
        instance_type=bill["instance_type"], price_model=bill["price_model"], price_version=bill["price_version"],
        carried_label_keys=(), shared_from=None, sharing_method="", method=method, cost_basis=basis,
        memory_share=0.0, compute_share=0.0, gpu_fraction=fraction)


def label_set_json(labels: Mapping[str, str], carried_label_keys: Sequence[str]) -> str:
    """The canonical JSON of a label set: ``[{labels, keys sorted}, [carried keys in their order]]``."""
    return json.dumps([dict(sorted(labels.items())), list(carried_label_keys)], separators=(",", ":"),
                      ensure_ascii=False)


def label_set_id(labels: Mapping[str, str], carried_label_keys: Sequence[str]) -> int:
    """The ``label_sets`` id of a line's labels and carried keys (0: the empty set)."""
    if not labels and not carried_label_keys:
        return EMPTY_LABEL_SET_ID
    digest = hashlib.sha256(label_set_json(labels, carried_label_keys).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big", signed=True)
