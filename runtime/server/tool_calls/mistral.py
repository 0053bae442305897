"""Mistral's formats: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers before
v11) and `[TOOL_CALLS]name[ARGS]{...}` per call (v11 on; v13 puts `[CALL_ID]id` before
`[ARGS]`; without special tokens in the text, `[TOOL_CALLS]name{...}`)."""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field

from kvfleet.runtime.server.tool_calls.call_id import new_mistral_call_id
from kvfleet.runtime.server.tool_calls.json_span import JsonSpan
from kvfleet.runtime.server.tool_calls.parsed_call import (
    ParsedToolCall,
    arguments_json,
    call_from_object,
)
from kvfleet.runtime.server.tool_calls.parser_base import ToolCallParser
from kvfleet.runtime.server.tool_calls.scanner import BufferedScanner, Event

MARKER, CALL_ID, ARGS = "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-")
_ID_CHARS = frozenset(string.ascii_letters + string.digits)


@dataclass(slots=True)
class MistralScanner(BufferedScanner):
    """Text passes on until `[TOOL_CALLS]`; what follows it is judged once its JSON closes.
    A marker followed by no call stays text, as does the call's text, and scanning goes on."""

    state: str = "outside"  # outside | after | header | object | array
    name: str = ""  # the call's name, in the v11 form
    span: JsonSpan = field(default_factory=JsonSpan)
    value_at: int = 0  # where in buf the JSON value being read starts
    scanned: int = 0  # how much of buf the span (or the header) has seen

    def _scan(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self.buf:
            if self.state == "outside":
                if not self._take_text_before(MARKER, final, events):
                    break
                self.state, self.scanned = "after", len(MARKER)
                continue
            if self.state in ("object", "array"):
                end = self.span.feed(self.buf[self.scanned :])
                if end is None:
                    self.scanned = len(self.buf)
                    if not final:
                        break
                    self._give_up(events, len(self.buf))
                    continue
                stop = self.scanned + end
                calls = self._calls(self.buf[self.value_at : stop])
                if calls:
                    events.extend(calls)
                    self.buf, self.state = self.buf[stop:], "outside"
                else:
                    self._give_up(events, stop)
                continue
            # after the marker, or in a v11 call's name and tokens before its arguments
            step = self._after() if self.state == "after" else self._header()
            if step is None:
                if not final:
                    break
                self._give_up(events, len(self.buf))
            elif step < 0:
                self._give_up(events, -step)
            else:
                self.state = "array" if self.buf[step] == "[" else "object"
                self.value_at, self.scanned = step, step
                self.span = JsonSpan()
        return events

    def _give_up(self, events: list[Event], upto: int) -> None:
        """buf up to `upto` is no call: text, and scanning resumes after it."""
        events.append(self.buf[:upto])
        self.buf, self.state = self.buf[upto:], "outside"

    def _after(self) -> int | None:
        """Right after the marker: where the array's `[` is, or (a name starting) what
        `_header` says; None if undecided, minus the length of the text that is no call."""
        rest = self.buf[self.scanned :].lstrip()
        at = len(self.buf) - len(rest)
        if not rest:
            return None
        if rest[0] == "[":
            return at
        if rest[0] in _NAME_CHARS:
            self.state, self.scanned = "header", at
            return self._header()
        return -at

    def _header(self) -> int | None:
        """A v11 call's `name[CALL_ID]id[ARGS]`: where its `{` is, None if undecided, or minus
        the length of the text that is no call."""
        buf, i, n = self.buf, self.scanned, len(self.buf)
        start = i
        while i < n and buf[i] in _NAME_CHARS:
            i += 1
        self.name = buf[start:i]
        for token, tail_chars in ((CALL_ID, _ID_CHARS), (ARGS, frozenset())):
            i = _skip_space(buf, i)
            if i == n or token.startswith(buf[i:]):
                return None
            if buf.startswith(token, i):
                i += len(token)
                while i < n and buf[i] in tail_chars:
                    i += 1
        i = _skip_space(buf, i)
        if i == n:
            return None
        return i if buf[i] == "{" else -i

    def _calls(self, text: str) -> list[ParsedToolCall]:
        try:
            value = json.loads(text)
            if self.state == "object":
                if not isinstance(value, dict):
                    return []
                return [ParsedToolCall(name=self.name, arguments=arguments_json(value))]
        except (ValueError, RecursionError):
            return []
        if not isinstance(value, list) or not value:
            return []
        calls = [call_from_object(item, keyless=True) for item in value]
        return [] if None in calls else calls  # type: ignore[return-value]


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class MistralParser(ToolCallParser):
    """`--tool-call-parser mistral`: Mistral 7B v0.3, Nemo, Small 3.x, Devstral and kin.

    Its call ids are 9 letters and digits: Mistral's templates refuse a turn with others."""

    name = "mistral"
    needs_special_tokens = True

    def scanner(self) -> MistralScanner:
        return MistralScanner()

    def new_call_id(self) -> str:
        return new_mistral_call_id()
