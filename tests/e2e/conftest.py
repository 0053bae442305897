"""The e2e tests run the operator fixtures of tests/operator (emulator + kopf), re-exposed here.

tests/operator/conftest.py is loaded under its own module name, `operator_fixtures`, so its
fixtures and helpers (eventually, isvc_with, ...) can be imported without clashing with the
other conftest modules; the emulator itself is the one in tests/operator/emulator.py.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_OPERATOR_TESTS = Path(__file__).resolve().parents[1] / "operator"
if str(_OPERATOR_TESTS) not in sys.path:
    sys.path.insert(0, str(_OPERATOR_TESTS))  # for its `from emulator import ...`


def _load_operator_fixtures():
    name = "operator_fixtures"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _OPERATOR_TESTS / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_fixtures = _load_operator_fixtures()
kube = _fixtures.kube
operator = _fixtures.operator
operator_registration = _fixtures.operator_registration
