"""One chat choice's reply when the request offered tools: the model's text turned into
OpenAI's `tool_calls`, whole or as streamed `delta.tool_calls` fragments, and the choice's
finish_reason "tool_calls" when it ended by making calls.

Two ways in: under tool_choice "required" or a named function the output was constrained to a
JSON document (forced.py), read back when the choice ends; under "auto" the model writes calls
in its family's own format and the server's `--tool-call-parser` finds them, as they stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.server.api_error import APIError
from kvfleet.runtime.server.tool_calls.call_id import new_call_id
from kvfleet.runtime.server.tool_calls.forced import calls_from_forced_output
from kvfleet.runtime.server.tool_calls.parsed_call import ParsedToolCall
from kvfleet.runtime.server.tool_calls.parser_base import ToolCallParser
from kvfleet.runtime.server.tool_calls.parsers import get_parser
from kvfleet.runtime.server.tool_calls.request import ToolsRequest


def tool_call_replies(
    tools: ToolsRequest | None,
    params: SamplingParams,
    parser_name: str | None,
    auto_enabled: bool,
) -> Callable[[], ToolCallReply] | None:
    """What makes each choice's ToolCallReply, or None when no call may be made. tool_choice
    "auto" needs the server's parser (`--enable-auto-tool-choice --tool-call-parser`, as in
    vLLM): without one, calls would come back as plain text."""
    if tools is None or tools.choice == "none":
        return None
    parser = None
    if tools.choice == "auto":
        if not auto_enabled or parser_name is None:
            raise APIError(
                400,
                'tool_choice: "auto" (the default when tools are given) needs a server '
                "started with --enable-auto-tool-choice and --tool-call-parser; use "
                '"required", a named function or "none"',
                param="tool_choice",
            )
        parser = get_parser(parser_name)
        if parser.needs_special_tokens:
            params.skip_special_tokens = False
    elif parser_name is not None:
        parser = get_parser(parser_name)  # only for its call ids
    return lambda: ToolCallReply(tools, parser)


class ToolCallReply:
    """Reads one choice's text for tool calls (`parser`: the server's, for tool_choice auto)."""

    def __init__(self, tools: ToolsRequest, parser: ToolCallParser | None) -> None:
        self.tools = tools
        self.forced = tools.choice in ("required", "named")
        self.parser = parser
        self._streamer = parser.streamer() if parser is not None and not self.forced else None
        self._text: list[str] = []
        self._calls = 0

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole choice: its message and finish_reason."""
        calls: list[ParsedToolCall] = []
        content: str | None = text
        if self.forced:
            calls = self._forced_calls(text, finish_reason)
            content = None if calls else text
        elif self.parser is not None:
            extracted = self.parser.extract(text)
            calls, content = extracted.calls, extracted.content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if not calls:
            return message, finish_reason
        message["tool_calls"] = [
            {
                "id": self._new_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
        return message, "tool_calls" if finish_reason == "stop" else finish_reason

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The delta fragments a streamed piece of text settles."""
        if self.forced:
            self._text.append(text)  # one JSON document: read when it is complete
            return []
        if self._streamer is None:
            return [{"content": text}] if text else []
        return self._streamer.feed(text)

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The fragments held back until the end, and the choice's finish_reason."""
        if self.forced:
            text = "".join(self._text)
            calls = self._forced_calls(text, finish_reason)
            if not calls:
                return ([{"content": text}] if text else []), finish_reason
            fragments = []
            for index, call in enumerate(calls):
                fragments.extend(_call_fragments(index, self._new_id(), call))
            return fragments, "tool_calls" if finish_reason == "stop" else finish_reason
        if self._streamer is None:
            return [], finish_reason
        fragments = self._streamer.finish()
        made = bool(self._streamer.calls)
        return fragments, "tool_calls" if made and finish_reason == "stop" else finish_reason

    def _forced_calls(self, text: str, finish_reason: str | None) -> list[ParsedToolCall]:
        if finish_reason != "stop":
            return []  # cut short (length, abort): the document is incomplete, shown as text
        try:
            return calls_from_forced_output(self.tools, text)
        except ValueError:
            return []

    def _new_id(self) -> str:
        return self.parser.new_call_id() if self.parser is not None else new_call_id()


def _call_fragments(index: int, call_id: str, call: ParsedToolCall) -> list[dict[str, Any]]:
    """A call as OpenAI streams it: id, type and name first, then the arguments."""
    head = {"index": index, "id": call_id, "type": "function"}
    return [
        {"tool_calls": [{**head, "function": {"name": call.name, "arguments": ""}}]},
        {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
    ]
