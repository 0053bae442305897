"""The e2e tests run the operator harness (tests/kube_harness.py: the dev cluster's API server
and kopf), exposed here."""

from kube_harness import kube, operator, operator_registration

__all__ = ["kube", "operator", "operator_registration"]
