"""The cluster's DNS domain is configurable: a cluster whose kubelets use another domain than
cluster.local gets a status.url that resolves there. (The chart's clusterDomain reaching a
running operator's status is checked in test_rbac_coverage.py.)"""

from __future__ import annotations

import argparse

import pytest
from kvfleet.operator import cmd_operator
from kvfleet.operator.handlers import OperatorConfig, reconcile
from kvfleet.operator.render import check_cluster_domain, service_url
from kvfleet.operator.status import compute_status

ISVC = {
    "metadata": {"name": "chat", "namespace": "ml", "generation": 1},
    "spec": {"model": {"uri": "bundled"}},
}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cmd_operator.register(parser.add_subparsers())
    return parser.parse_args(["operator", *argv])


def test_status_url_is_under_the_cluster_domain():
    assert service_url("chat", "ml") == "http://chat.ml.svc.cluster.local"
    assert service_url("chat", "ml", "corp.example") == "http://chat.ml.svc.corp.example"
    assert compute_status(ISVC, None)["url"] == "http://chat.ml.svc.cluster.local"
    status = compute_status(ISVC, None, cluster_domain="k8s.example.internal")
    assert status["url"] == "http://chat.ml.svc.k8s.example.internal"


def test_reconcile_reports_the_configured_domain():
    class NoDeployment:  # an API server that has nothing yet; the spec is refused first
        def get(self, *_):
            return None

    config = OperatorConfig(api=NoDeployment(), cluster_domain="corp.example", max_gpus_per_node=1)  # type: ignore[arg-type]
    unservable = {**ISVC, "spec": {"model": {"uri": "bundled"}, "resources": {"gpus": 2}}}
    assert reconcile(config, unservable)["url"] == "http://chat.ml.svc.corp.example"


def test_flag_env_and_default(monkeypatch):
    monkeypatch.delenv("KVFLEET_CLUSTER_DOMAIN", raising=False)
    assert parse().cluster_domain == "cluster.local"
    assert parse("--cluster-domain", "corp.example.").cluster_domain == "corp.example"
    monkeypatch.setenv("KVFLEET_CLUSTER_DOMAIN", "k8s.example.internal")
    assert parse().cluster_domain == "k8s.example.internal"
    assert parse("--cluster-domain=corp.example").cluster_domain == "corp.example"


@pytest.mark.parametrize(
    "bad", ["", "Cluster.Local", "cluster_local", "-x.local", "a..b", "a" * 64]
)
def test_a_domain_that_is_no_dns_name_is_refused_at_start(bad, capsys):
    with pytest.raises(ValueError, match="cluster domain"):
        check_cluster_domain(bad)
    with pytest.raises(SystemExit):
        parse(f"--cluster-domain={bad}")
    assert "--cluster-domain: cluster domain" in capsys.readouterr().err
