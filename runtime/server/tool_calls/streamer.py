"""A tool-call parser's streamed form: text deltas in, OpenAI chat delta fragments out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfleet.runtime.server.tool_calls.content_spacing import ContentSpacing
from kvfleet.runtime.server.tool_calls.parsed_call import ParsedToolCall
from kvfleet.runtime.server.tool_calls.scanner import Event, Scanner


@dataclass(slots=True)
class ToolCallStreamer:
    """Feeds a scanner the model's deltas and turns what it settles into delta fragments:
    `{"content": ...}`, and for each call a first fragment with its id and name, then one with
    its arguments, as OpenAI streams them."""

    scanner: Scanner
    new_id: Callable[[], str]
    calls: list[ParsedToolCall] = field(default_factory=list)  # made so far, in order
    _spacing: ContentSpacing = field(default_factory=ContentSpacing)

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        """The fragments that delta_text settles (text that may start a call is held back)."""
        return self._fragments(self.scanner.feed(delta_text))

    def finish(self) -> list[dict[str, Any]]:
        """The fragments left at the end of the message: what was held back, settled."""
        out = self._fragments(self.scanner.finish())
        _add_content(out, self._spacing.finish())
        return out

    def _fragments(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, str):
                _add_content(out, self._spacing.text(event))
                continue
            self._spacing.call()
            index = len(self.calls)
            self.calls.append(event)
            out.append(
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": self.new_id(),
                            "type": "function",
                            "function": {"name": event.name, "arguments": ""},
                        }
                    ]
                }
            )
            out.append(
                {"tool_calls": [{"index": index, "function": {"arguments": event.arguments}}]}
            )
        return out


def _add_content(out: list[dict[str, Any]], text: str) -> None:
    if not text:
        return
    if out and "content" in out[-1]:
        out[-1]["content"] += text
    else:
        out.append({"content": text})
