"""Alerts and the dashboard only reference series kvfleet really exports: a renamed metric
would otherwise leave an alert that can never fire and an empty panel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from promql_metric_names import metric_names

from kvfleet import contract

MONITORING = Path(__file__).resolve().parents[2] / "manifests" / "monitoring"
EXPORTED = contract.exposed_names() | contract.operator_exposed_names()


def alert_rules() -> list[dict]:
    rule = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, query) for every panel target and every templating variable query."""
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    queries = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            queries.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            queries.append((f"variable {var['name']}", query))
    return queries


@pytest.mark.parametrize(
    "expr,expected",
    [
        (
            'histogram_quantile(0.95, sum by (le, pod) (rate(a:b_bucket{x="y", le!="1"}[5m])))',
            {"a:b_bucket"},
        ),
        (
            "sum without (pod) (foo) / on (ns) group_left (name) bar_total > 0.5",
            {"foo", "bar_total"},
        ),
        ('max(x{model_name=~"$model"}) offset 1h', {"x"}),
        ("rate(c_total[$__rate_interval]) * 1e3 and d unless 2", {"c_total", "d"}),
        ('label_values(up{job="k"}, namespace)', {"up"}),
        ("label_values(namespace)", set()),
    ],
)
def test_metric_name_extraction(expr: str, expected: set[str]) -> None:
    assert metric_names(expr) == expected


def test_unknown_function_is_reported_not_mistaken_for_a_metric() -> None:
    with pytest.raises(ValueError, match="ratee"):
        metric_names("ratee(foo[5m])")


def test_alerts_cover_the_issue_list() -> None:
    names = {r["alert"] for r in alert_rules()}
    assert {
        "KvfleetQueueDepthHigh",
        "KvfleetKVCacheNearlyFull",
        "KvfleetTimeToFirstTokenHigh",
        "KvfleetRequestErrorRateHigh",
        "KvfleetInferenceServiceNotReady",
    } <= names
    by_name = {r["alert"]: r for r in alert_rules()}
    assert contract.INFERENCESERVICE_READY in metric_names(
        by_name["KvfleetInferenceServiceNotReady"]["expr"]
    )
    kv = by_name["KvfleetKVCacheNearlyFull"]
    assert contract.KV_CACHE_USAGE_PERC in metric_names(kv["expr"])
    assert "0.95" in kv["expr"] and kv["for"] == "5m"


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_alert_references_only_exported_metrics(rule: dict) -> None:
    names = metric_names(rule["expr"])
    assert names, f"{rule['alert']} selects no metric"
    assert names <= EXPORTED, f"{rule['alert']} uses unknown series {sorted(names - EXPORTED)}"


@pytest.mark.parametrize("where,query", dashboard_queries(), ids=lambda x: x)
def test_dashboard_query_references_only_exported_metrics(where: str, query: str) -> None:
    names = metric_names(query)
    assert names, f"{where} selects no metric"
    assert names <= EXPORTED, f"{where} uses unknown series {sorted(names - EXPORTED)}"


def test_dashboard_shows_what_the_issue_asks_for() -> None:
    used = set().union(*(metric_names(q) for _, q in dashboard_queries()))
    for name in (
        contract.NUM_REQUESTS_RUNNING,
        contract.NUM_REQUESTS_WAITING,
        contract.KV_CACHE_USAGE_PERC,
        f"{contract.TIME_TO_FIRST_TOKEN}_bucket",
        f"{contract.INTER_TOKEN_LATENCY}_bucket",
        f"{contract.GENERATION_TOKENS}_total",
        contract.INFERENCESERVICE_REPLICAS,
    ):
        assert name in used, f"dashboard has no panel for {name}"
