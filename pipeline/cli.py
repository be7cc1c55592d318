"""``gpumeter replay INPUT --out DIR``: the attributor, billing and the guard over a scenario or a recording, no
broker.

Options read the same ``GPUMETER_*`` variables as the streaming attributor (window, grace, policy) and the
billing service (prices, split rule, sharing policy); a flag overrides its variable. ``--idle spread`` (env
``GPUMETER_IDLE_HANDLING=spread``), which used to spread idle cost in the attributor, is billing's sharing policy
``idle=weighted`` now (an explicit ``idle=...`` in ``--sharing`` wins). The guard's thresholds come from
``--guard-config FILE`` (else ``GPUMETER_GUARD_CONFIG``) and ``GPUMETER_GUARD_*`` (``services/guard/config.py``).
See ``pipeline/replay.py`` for the outputs, the ground truth and the recording format.

Exit status: 0 when done; 1 when some node-window had no price (its shares are written, its costs are not;
``--allow-unpriced`` makes that 0); 2 on a usage error or an input that cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

from gpumeter.errors import ConfigError, GpumeterError
from services.attributor.attribution import AttributionPolicy
from schemas.pods import GroupingLabelSources
from services.attributor.pod_index import DEFAULT_GROUPING_LABELS
from services.attributor.settings import parse_label_keys, parse_label_sources
from services.billing.catalog import PriceCatalog, PriceError
from services.billing.costing import iso_utc
from services.billing.pricing import SplitPolicy
from services.billing.sharing import SHARING_ENV, SharingPolicy
from services.guard.config import GuardConfig

# option -> (environment variable, converter, default): the streaming attributor's variables.
_ENGINE_OPTIONS: dict[str, tuple[str, Callable[[str], Any], Any]] = {
    "window_seconds": ("GPUMETER_WINDOW_SECONDS", int, 60),
    "grace_seconds": ("GPUMETER_GRACE_SECONDS", int, 10),
    "idle_close_seconds": ("GPUMETER_IDLE_CLOSE_SECONDS", int, 30),
    "max_clock_skew_seconds": ("GPUMETER_MAX_CLOCK_SKEW_SECONDS", int, 120),
    "pod_linger_seconds": ("GPUMETER_POD_LINGER_SECONDS", int, 900),
    "cost_basis": ("GPUMETER_COST_BASIS", str, "memory"),
    "idle_handling": ("GPUMETER_IDLE_HANDLING", str, "keep"),
    "sharing": (SHARING_ENV, str, ""),
    "mps_compute": ("GPUMETER_MPS_COMPUTE", str, "memory"),
    "mps_thread_annotation": ("GPUMETER_MPS_THREAD_ANNOTATION", str, ""),
    "grouping_labels": ("GPUMETER_GROUPING_LABELS", parse_label_keys, DEFAULT_GROUPING_LABELS),
    "grouping_label_source": ("GPUMETER_GROUPING_LABEL_SOURCE", parse_label_sources, GroupingLabelSources()),
}

# Price variables PriceCatalog.from_env and SplitPolicy.from_env read, and the flag that overrides each.
_PRICE_ENV_FLAGS = {
    "GPUMETER_BILLING_PRICE_DIR": "price_dir",
    "GPUMETER_BILLING_PRICE_OVERRIDE_CSV": "price_override_csv",
    "GPUMETER_BILLING_SPOT_DISCOUNTS": "spot_discounts",
    "GPUMETER_BILLING_SPLIT_RULE": "split_rule",
    "GPUMETER_BILLING_GPU_FRACTION": "gpu_fraction",
    "GPUMETER_BILLING_SPLIT_WEIGHTS": "split_weights",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", metavar="INPUT", type=Path,
                        help="a scenario (.yaml), a recording (.gmrec) or a directory of recordings")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="output directory: shares.jsonl, costs.jsonl, bills.jsonl, dead_letters.jsonl, "
                             "violations.jsonl (and truth.jsonl for a scenario)")
    parser.add_argument("--window-seconds", type=int, help="tumbling window (default 60; env GPUMETER_WINDOW_SECONDS)")
    parser.add_argument("--grace-seconds", type=int,
                        help="late ticks within this amend their window (default 10; env GPUMETER_GRACE_SECONDS)")
    parser.add_argument("--idle-close-seconds", type=int,
                        help="timer allowance before a silent node's window closes (default 30)")
    parser.add_argument("--max-clock-skew-seconds", type=int,
                        help="ticks sampled further ahead of their arrival are dead-lettered (default 120)")
    parser.add_argument("--pod-linger-seconds", type=int, help="how long a deleted pod stays known (default 900)")
    parser.add_argument("--cost-basis", help="memory | compute | blend:<alpha> | request (default memory)")
    parser.add_argument("--idle", "--idle-handling", dest="idle_handling",
                        help="keep | spread (deprecated: spread is --sharing idle=weighted)")
    parser.add_argument("--sharing", help="billing's sharing policy: keep | <bucket>=weighted|even|requests,... "
                                          f"(buckets idle, driver_reserved, unattributed, unavailable, node_other, "
                                          f"all; env {SHARING_ENV}; default keep)")
    parser.add_argument("--mps-compute", help="memory | threads (default memory)")
    parser.add_argument("--mps-thread-annotation",
                        help="a pod annotation the platform writes whose value is the MPS active-thread percentage "
                             "(default: none is read)")
    parser.add_argument("--grouping-labels", type=parse_label_keys,
                        help="pod labels the share rows carry, comma-separated (default team,model; "
                             "env GPUMETER_GROUPING_LABELS)")
    parser.add_argument("--grouping-label-source", type=parse_label_sources,
                        help="where grouping labels come from: pod | namespace | namespace,pod, or per key "
                             "team=namespace;model=namespace,pod (default pod; env GPUMETER_GROUPING_LABEL_SOURCE)")
    parser.add_argument("--node", help="replay this node only")
    parser.add_argument("--record", type=Path, metavar="FILE",
                        help="also write the replayed input as a recording (.gmrec) to FILE")
    parser.add_argument("--price-dir", type=Path, help="folder of price CSVs (env GPUMETER_BILLING_PRICE_DIR)")
    parser.add_argument("--price-override", dest="price_override_csv", type=Path,
                        help="OpenCost-style custom price CSV (env GPUMETER_BILLING_PRICE_OVERRIDE_CSV)")
    parser.add_argument("--spot-discounts", help="derive spot prices: aws=0.6,azure=0.5")
    parser.add_argument("--split-rule", help="auto | sku | weights | gpu_fraction (env GPUMETER_BILLING_SPLIT_RULE)")
    parser.add_argument("--gpu-fraction", help="GPU share of the node price for the gpu_fraction rule")
    parser.add_argument("--split-weights", help="cpu=0.031611,ram=0.004237,gpu=0.95 for the weights rule")
    parser.add_argument("--guard-config", type=Path, metavar="FILE",
                        help="the guard's thresholds and budgets (YAML/JSON) for violations.jsonl "
                             "(env GPUMETER_GUARD_CONFIG; GPUMETER_GUARD_* override single values)")
    parser.add_argument("--allow-unpriced", action="store_true",
                        help="exit 0 even when some node-window had no price")


def _option(args: argparse.Namespace, env: Mapping[str, str], name: str) -> Any:
    variable, convert, default = _ENGINE_OPTIONS[name]
    value = getattr(args, name, None)
    if value is not None:
        return value
    raw = env.get(variable)
    if raw:
        try:
            return convert(raw.strip())
        except ValueError as exc:
            raise ConfigError(f"{variable}={raw!r}: {exc}") from None
    return default


def sharing_with_idle_handling(sharing_text: str, idle_handling: str) -> SharingPolicy:
    """The sharing policy of ``--sharing``, with the deprecated ``--idle spread`` as ``idle=weighted`` (what it
    was: idle cost to the pods by their cost) unless ``--sharing`` says what idle gets."""
    idle = (idle_handling or "keep").strip().lower()
    if idle not in ("keep", "spread"):
        raise ConfigError(f"idle handling {idle_handling!r} is not keep or spread (deprecated: use --sharing)")
    prefix = "idle=weighted," if idle == "spread" else ""
    return SharingPolicy.parse(prefix + (sharing_text or ""))


def replay_options(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    """The keyword arguments of ``replay`` from flags over env over defaults. Raises ``ConfigError``."""
    values = {name: _option(args, env, name) for name in _ENGINE_OPTIONS}
    policy = AttributionPolicy.parse(values.pop("cost_basis"), values.pop("mps_compute"),
                                    values.pop("mps_thread_annotation"))
    sharing = sharing_with_idle_handling(values.pop("sharing"), values.pop("idle_handling"))
    price_env = {variable: env[variable] for variable in _PRICE_ENV_FLAGS if env.get(variable)}
    for variable, attribute in _PRICE_ENV_FLAGS.items():
        value = getattr(args, attribute, None)
        if value is not None:
            price_env[variable] = str(value)
    try:
        catalog = PriceCatalog.from_env(price_env)
    except PriceError as exc:
        raise ConfigError(f"price catalog: {exc}") from exc
    return {
        "window_seconds": values["window_seconds"],
        "grace_seconds": values["grace_seconds"],
        "idle_close_seconds": values["idle_close_seconds"],
        "max_clock_skew_seconds": values["max_clock_skew_seconds"],
        "pod_linger_ms": values["pod_linger_seconds"] * 1000,
        "policy": policy,
        "grouping_labels": tuple(sorted(set(values["grouping_labels"]))),
        "grouping_label_sources": values["grouping_label_source"],
        "catalog": catalog,
        "split_policy": SplitPolicy.from_env(price_env),
        "sharing": sharing,
        "node": args.node,
        "record_path": args.record,
        "guard_config": GuardConfig.load(getattr(args, "guard_config", None), env),
    }


def main(args: argparse.Namespace, env: Mapping[str, str], *, out: TextIO | None = None,
         err: TextIO | None = None) -> int:
    """Run the replay and print a summary; exit status as in the module docstring."""
    from pipeline.replay import replay

    out = out or sys.stdout
    err = err or sys.stderr
    try:
        summary = replay(args.input, args.out, **replay_options(args, env))
    except GpumeterError as exc:
        print(f"gpumeter replay: {exc}", file=err)
        return 2
    print(f"replayed {summary.input_kind} {args.input}: {summary.samples} samples and {summary.pod_events} pod "
          f"events from {len(summary.nodes)} node(s)", file=out)
    print(f"  {summary.windows} node-windows, {summary.share_rows} share rows, {summary.cost_rows} cost lines, "
          f"{summary.bills} bills totalling {summary.node_cost_micro_usd / 1e6:.6f} USD", file=out)
    if summary.truth_rows:
        print(f"  {summary.truth_rows} truth rows", file=out)
    if summary.violation_rows:
        print(f"  {summary.violation_rows} violation records, {summary.violations_firing_at_end} still firing at the "
              f"end", file=out)
    if summary.recorded:
        print(f"  recorded {summary.recorded} messages to {args.record}", file=out)
    for reason_code, count in summary.dead_letters.items():
        print(f"  dead-lettered {count} input(s): {reason_code} (see {summary.files['dead_letters.jsonl']})",
              file=out)
    for name, path in summary.files.items():
        print(f"  wrote {path}", file=out)
    if summary.unpriced:
        reasons: dict[str, list[str]] = {}
        for window in summary.unpriced:
            reasons.setdefault(window.reason, []).append(iso_utc(window.window_start_unix_ms))
        for reason, starts in reasons.items():
            print(f"gpumeter replay: {len(starts)} node-window(s) not priced, from {starts[0]}: {reason}", file=err)
        return 0 if args.allow_unpriced else 1
    return 0
