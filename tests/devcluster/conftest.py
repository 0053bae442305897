"""The dev cluster's tests' fixtures: defined in tests/kube_harness.py (see its docstring),
exposed here."""

from kube_harness import kube, operator, operator_registration

__all__ = ["kube", "operator", "operator_registration"]
