"""The e2e tests run the operator harness of tests/operator (emulator + kopf), exposed here."""

from __future__ import annotations

import sys
from pathlib import Path

_OPERATOR_TESTS = Path(__file__).resolve().parents[1] / "operator"
if str(_OPERATOR_TESTS) not in sys.path:
    sys.path.insert(0, str(_OPERATOR_TESTS))  # kube_harness and its `from emulator import ...`

from kube_harness import kube, operator, operator_registration  # noqa: E402

__all__ = ["kube", "operator", "operator_registration"]
