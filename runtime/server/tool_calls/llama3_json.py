"""Llama 3.1-3.3's JSON format: the whole message is `{"name": ..., "parameters": {...}}`,
possibly after `<|python_tag|>`, several calls separated by `;`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvfleet.runtime.server.tool_calls.json_span import JsonSpan
from kvfleet.runtime.server.tool_calls.parsed_call import call_from_object
from kvfleet.runtime.server.tool_calls.parser_base import ToolCallParser
from kvfleet.runtime.server.tool_calls.scanner import BufferedScanner, Event

PYTHON_TAG = "<|python_tag|>"
# Llama's template asks for "parameters"; the models also write "arguments" at times.
_ARGUMENT_KEYS = ("parameters", "arguments")


@dataclass(slots=True)
class Llama3JsonScanner(BufferedScanner):
    """Calls only where the message starts with one: a message that starts with anything else
    is text throughout, and so is whatever follows the last call that parses."""

    state: str = "start"  # start | object | between | text
    span: JsonSpan = field(default_factory=JsonSpan)
    object_at: int = 0  # where in buf the object being read starts
    scanned: int = 0  # how much of buf the span has seen

    def _scan(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self.state == "text":
                if self.buf:
                    events.append(self.buf)
                self.buf = ""
                return events
            if self.state == "object":
                end = self.span.feed(self.buf[self.scanned :])
                if end is None:
                    self.scanned = len(self.buf)
                    if final:
                        self.state = "text"  # cut short, by max_tokens most likely
                        continue
                    return events
                stop = self.scanned + end
                call = _call(self.buf[self.object_at : stop])
                if call is None:
                    self.state = "text"
                    continue
                events.append(call)
                self.buf, self.state = self.buf[stop:], "between"
                continue
            at = self._next_object()
            if at is None:  # undecided: wait for more text
                if final:
                    # A lone separator after the last call is part of the calls' syntax.
                    if self.state == "between" and self.buf.strip() in ("", ";"):
                        self.buf = ""
                    self.state = "text"
                    continue
                return events
            if at < 0:
                self.state = "text"
                continue
            self.state, self.object_at, self.scanned = "object", at, at
            self.span = JsonSpan()

    def _next_object(self) -> int | None:
        """Where the next call's `{` is, -1 if what comes is no call, None if undecided."""
        rest = self.buf.lstrip()
        at = len(self.buf) - len(rest)
        opener = PYTHON_TAG if self.state == "start" else ";"
        if rest.startswith(opener):
            after = rest[len(opener) :].lstrip()
            at += len(rest) - len(after)
            rest = after
        elif rest and opener.startswith(rest):
            return None
        if not rest:
            return None
        return at if rest[0] == "{" else -1


def _call(text: str) -> Event | None:
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return call_from_object(obj, _ARGUMENT_KEYS)


class Llama3JsonParser(ToolCallParser):
    """`--tool-call-parser llama3_json`: Llama 3.1, 3.2 and 3.3 with their JSON tool prompt."""

    name = "llama3_json"
    needs_special_tokens = True

    def scanner(self) -> Llama3JsonScanner:
        return Llama3JsonScanner()
