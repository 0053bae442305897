"""What every tool-call parser offers: a finished message split into text and calls, and the
same split made as the message streams."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from kvfleet.runtime.server.tool_calls.call_id import new_call_id
from kvfleet.runtime.server.tool_calls.content_spacing import ContentSpacing
from kvfleet.runtime.server.tool_calls.parsed_call import ExtractedToolCalls, ParsedToolCall
from kvfleet.runtime.server.tool_calls.scanner import Scanner
from kvfleet.runtime.server.tool_calls.streamer import ToolCallStreamer


class ToolCallParser(ABC):
    """A model family's native call format. Text that only looks like a call stays text: no
    text is lost and nothing raises."""

    name: ClassVar[str]
    # The format's markers are special tokens, which detokenizing must then keep.
    needs_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def scanner(self) -> Scanner:
        """A fresh scanner of this format, for one message."""

    def new_call_id(self) -> str:
        """An id for a call the model made."""
        return new_call_id()

    def extract(self, text: str) -> ExtractedToolCalls:
        """A finished message's text (None when only calls) and its calls."""
        scanner = self.scanner()
        spacing = ContentSpacing()
        parts: list[str] = []
        calls: list[ParsedToolCall] = []
        for event in [*scanner.feed(text), *scanner.finish()]:
            if isinstance(event, str):
                parts.append(spacing.text(event))
            else:
                spacing.call()
                calls.append(event)
        parts.append(spacing.finish())
        return ExtractedToolCalls(content="".join(parts) or None, calls=calls)

    def streamer(self) -> ToolCallStreamer:
        """A streamer for one message: feed it each delta, then call finish()."""
        return ToolCallStreamer(self.scanner(), self.new_call_id)
