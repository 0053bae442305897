"""Where a JSON object or array that arrives in pieces ends: brackets counted outside strings,
so that the value is parsed once, when it is whole."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class JsonSpan:
    """Fed the text from a value's opening `{` or `[`; says where its closing bracket is.

    Brackets are only counted, not matched: `json.loads` judges the finished span."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def feed(self, text: str) -> int | None:
        """The index in text just past the value's end, or None if it goes on past text."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return None
