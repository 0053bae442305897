"""A CRD's `x-kubernetes-validations` rules, compiled and run with a CEL library.

The library is `cel-expr-python` (Google's C++ CEL runtime): it evaluates the CRD's rules as
written, with the strings extension that Kubernetes enables (lowerAscii, split, replace...), RE2
`matches` and cross-type numeric comparison, as the API server's cel-go does. Kubernetes' own
additions (quantity(), url(), isSorted()...) are not available; a rule that uses one fails to
compile here, loudly, when the CRD is loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from cel_expr_python import cel
from cel_expr_python.ext import ext_strings

_ENV = cel.NewEnv(
    variables={"self": cel.Type.DYN, "oldSelf": cel.Type.DYN},
    extensions=[ext_strings.ExtStrings()],
)
# Outside string literals, `oldSelf` makes a rule a transition rule (run on updates only).
_STRINGS = re.compile(r"'(?:\\.|[^'\\])*'|\"(?:\\.|[^\"\\])*\"")


class CelCompileError(ValueError):
    """A rule that does not compile: the API server refuses such a CRD."""


@dataclass(frozen=True, slots=True)
class CelRule:
    """One x-kubernetes-validations entry, compiled."""

    rule: str
    message: str | None
    message_expression: Any  # compiled messageExpression, or None
    reason: str
    field_path: str
    transition: bool
    program: Any

    @classmethod
    def compile(cls, entry: dict[str, Any]) -> CelRule:
        rule = entry["rule"]
        try:
            program = _ENV.compile(rule)
            message_expression = (
                _ENV.compile(entry["messageExpression"]) if "messageExpression" in entry else None
            )
        except RuntimeError as exc:
            raise CelCompileError(f"rule {rule!r} does not compile: {exc}") from exc
        return cls(
            rule=rule,
            message=entry.get("message"),
            message_expression=message_expression,
            reason=entry.get("reason", "FieldValueInvalid"),
            field_path=entry.get("fieldPath", ""),
            transition=bool(re.search(r"\boldSelf\b", _STRINGS.sub("''", rule))),
            program=program,
        )

    def check(self, value: Any, old: Any = None) -> str | None:
        """None when the rule holds for `value`, else the message the API server gives."""
        data = {"self": value} if old is None else {"self": value, "oldSelf": old}
        result = self.program.eval(data=data)
        if result.type().name() == "ERROR":
            return f"{result.plain_value()} evaluating rule: {self.rule}"
        if result.plain_value() is True:
            return None
        if self.message_expression is not None:
            text = self.message_expression.eval(data=data)
            if text.type().name() == "STRING" and text.plain_value().strip():
                return text.plain_value()
        return self.message or f"failed rule: {self.rule}"
