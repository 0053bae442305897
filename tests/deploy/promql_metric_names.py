"""Metric names referenced by a PromQL expression (or a Grafana `label_values(...)` query).

A small lexer, not a full parser: it drops what cannot be a metric name (strings, label
matchers, ranges, grouping label lists, numbers, durations, Grafana variables, functions,
aggregations and keywords) and keeps every remaining identifier.
"""

from __future__ import annotations

import re

FUNCTIONS = frozenset(
    [
        "abs",
        "absent",
        "absent_over_time",
        "ceil",
        "changes",
        "clamp",
        "clamp_max",
        "clamp_min",
        "day_of_month",
        "day_of_week",
        "day_of_year",
        "days_in_month",
        "delta",
        "deriv",
        "exp",
        "floor",
        "histogram_avg",
        "histogram_count",
        "histogram_fraction",
        "histogram_quantile",
        "histogram_stddev",
        "histogram_stdvar",
        "histogram_sum",
        "double_exponential_smoothing",
        "holt_winters",
        "hour",
        "idelta",
        "increase",
        "irate",
        "label_join",
        "label_replace",
        "ln",
        "log2",
        "log10",
        "minute",
        "month",
        "predict_linear",
        "rate",
        "resets",
        "round",
        "scalar",
        "sgn",
        "sort",
        "sort_desc",
        "sort_by_label",
        "sort_by_label_desc",
        "sqrt",
        "time",
        "timestamp",
        "vector",
        "year",
        "avg_over_time",
        "min_over_time",
        "max_over_time",
        "sum_over_time",
        "count_over_time",
        "quantile_over_time",
        "stddev_over_time",
        "stdvar_over_time",
        "last_over_time",
        "present_over_time",
        "mad_over_time",
        "acos",
        "acosh",
        "asin",
        "asinh",
        "atan",
        "atanh",
        "cos",
        "cosh",
        "sin",
        "sinh",
        "tan",
        "tanh",
        "deg",
        "rad",
        "pi",
        "info",
        "start",
        "end",
    ]
)
AGGREGATIONS = frozenset(
    [
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    ]
)
KEYWORDS = frozenset(
    [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "offset",
        "and",
        "or",
        "unless",
        "atan2",
        "inf",
        "nan",
    ]
)
# Grafana's templating helpers wrap a PromQL selector; their other arguments are label names.
GRAFANA_QUERY = re.compile(r"^\s*(label_values|query_result|metrics)\s*\((.*)\)\s*$", re.S)

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
# by/without/on/ignoring/group_left/group_right take a parenthesised list of label names.
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_TOKEN = re.compile(
    r"(?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[a-zA-Z]*)"
    r"|(?P<variable>\$\{?\w+\}?)"
    r"|(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
)


def metric_names(expr: str) -> set[str]:
    """Every metric name `expr` selects from."""
    grafana = GRAFANA_QUERY.match(expr)
    if grafana is not None:
        helper, args = grafana.groups()
        if helper == "label_values":
            # label_values(label) or label_values(selector, label): drop the label argument.
            head, _, _ = args.rpartition(",")
            return metric_names(head) if head else set()
        return metric_names(args) if helper == "query_result" else set()

    text = _STRING.sub('""', expr)
    text = _BRACES.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names: set[str] = set()
    for match in _TOKEN.finditer(text):
        name = match.group("name")
        if name is None:
            continue
        rest = text[match.end() :].lstrip()
        if name in KEYWORDS or name in AGGREGATIONS:
            continue
        if rest.startswith("(") and name in FUNCTIONS:
            continue
        if rest.startswith("("):
            raise ValueError(f"unknown PromQL function {name!r} in {expr!r}")
        names.add(name)
    return names
