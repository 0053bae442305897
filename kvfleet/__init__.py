"""kvfleet: run large language models on Kubernetes.

This package is deliberately light: importing it (or `kvfleet.contract`) pulls in no torch,
so the operator and the runtime can share names without sharing dependencies.
"""

__version__ = "0.1.0"
