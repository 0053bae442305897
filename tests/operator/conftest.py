"""The operator tests' fixtures: defined in kube_harness.py and operator_processes.py (see
their docstrings), exposed here."""

from kube_harness import kube, operator, operator_registration
from operator_processes import cluster

__all__ = ["cluster", "kube", "operator", "operator_registration"]
