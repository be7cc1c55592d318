"""What a PromQL expression reads: the metric names of its vector selectors and the label names it matches or
groups by. A tokenizer, not a full parser: enough to tell metric names from functions, aggregations, keywords and
label names in the expressions our alert rules use, and to refuse forms it does not read (``__name__`` matchers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN_RE = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<duration>\d+(?:ms|s|m|h|d|w|y)(?:\d+(?:ms|s|m|h|d|w|y))*\b)
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|0x[0-9a-fA-F]+)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=,(){}\[\]@:])
""", re.VERBOSE)

AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                          "bottomk", "topk", "quantile", "limitk", "limit_ratio"})
LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = LABEL_LIST_KEYWORDS | {"bool", "offset", "and", "or", "unless", "atan2", "inf", "nan"}


class PromQLReadError(ValueError):
    """An expression this reader does not understand."""


@dataclass(frozen=True)
class Reads:
    metrics: frozenset[str]
    labels: frozenset[str]


def tokens(expr: str) -> list[tuple[str, str]]:
    out = []
    position = 0
    while position < len(expr):
        match = _TOKEN_RE.match(expr, position)
        if not match:
            raise PromQLReadError(f"cannot read {expr[position:position + 20]!r} in {expr!r}")
        position = match.end()
        if match.lastgroup not in ("space", "comment"):
            out.append((match.lastgroup, match.group()))
    return out


def reads(expr: str) -> Reads:
    """The metric names and label names ``expr`` reads (see the module doc). Raises PromQLReadError."""
    items = tokens(expr)
    metrics: set[str] = set()
    labels: set[str] = set()
    depth = {"(": 0, "{": 0, "[": 0}
    closing = {")": "(", "}": "{", "]": "["}
    label_list_depth: int | None = None  # the paren depth of an open `by (...)`-style label list
    for index, (kind, text) in enumerate(items):
        following = items[index + 1][1] if index + 1 < len(items) else ""
        if kind == "op" and text in depth:
            depth[text] += 1
            continue
        if kind == "op" and text in closing:
            depth[closing[text]] -= 1
            if depth[closing[text]] < 0:
                raise PromQLReadError(f"unbalanced {text!r} in {expr!r}")
            if text == ")" and label_list_depth is not None and depth["("] < label_list_depth:
                label_list_depth = None
            continue
        if kind != "ident":
            continue
        if depth["{"]:
            if following in ("=", "!=", "=~", "!~"):
                if text == "__name__":
                    raise PromQLReadError(f"__name__ matchers are not read here: {expr!r}")
                labels.add(text)
            continue
        if label_list_depth is not None:
            labels.add(text)
            continue
        if text in LABEL_LIST_KEYWORDS:
            if following != "(":
                raise PromQLReadError(f"{text} without a label list in {expr!r}")
            label_list_depth = depth["("] + 1
            continue
        if text in KEYWORDS:
            continue
        if following == "(" or (text in AGGREGATIONS and following in ("by", "without")):
            continue  # a function or an aggregation
        metrics.add(text)
    if any(depth.values()):
        raise PromQLReadError(f"unbalanced brackets in {expr!r}")
    return Reads(frozenset(metrics), frozenset(labels))


def selectors(expr: str) -> list[tuple[str, tuple[tuple[str, str, str], ...]]]:
    """Every vector selector of ``expr`` that names a metric: (metric, its label matchers)."""
    metric_names = reads(expr).metrics
    items = tokens(expr)
    found = []
    for index, (kind, text) in enumerate(items):
        if kind != "ident" or text not in metric_names:
            continue
        if index > 0 and items[index - 1][1] in ("{", ","):
            continue  # a label name inside another selector's braces
        body = ""
        if index + 1 < len(items) and items[index + 1][1] == "{":
            end = next(i for i in range(index + 1, len(items)) if items[i][1] == "}")
            body = " ".join(t for _, t in items[index + 1:end + 1])
        found.append((text, tuple(matchers(body))))
    return found


def matchers(expr: str) -> list[tuple[str, str, str]]:
    """Every label matcher (label, operator, value) of ``expr``'s selectors; values unquoted (double quotes)."""
    items = tokens(expr)
    found = []
    for index in range(len(items) - 2):
        (k1, label), (k2, op), (k3, value) = items[index:index + 3]
        if k1 == "ident" and k2 == "op" and op in ("=", "!=", "=~", "!~") and k3 == "string":
            found.append((label, op, value[1:-1].encode().decode("unicode_escape")))
    return found
