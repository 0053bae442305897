"""Hermes' format, which Qwen2.5 and Qwen3 use: each call a JSON object in its own block,
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, after any text."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvfleet.runtime.server.tool_calls.parsed_call import call_from_object
from kvfleet.runtime.server.tool_calls.parser_base import ToolCallParser
from kvfleet.runtime.server.tool_calls.scanner import BufferedScanner, Event

START, END = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class HermesScanner(BufferedScanner):
    """Text outside blocks passes on; a block is judged when `</tool_call>` closes it, or at the
    end of the message (models often stop without closing the last one)."""

    inside: bool = False
    searched: int = 0  # how far into an open block END has been looked for

    def _scan(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self.buf:
            if not self.inside:
                if not self._take_text_before(START, final, events):
                    break
                self.inside, self.searched = True, len(START)
                continue
            end = self.buf.find(END, self.searched)
            if end < 0:
                if final:
                    events.append(_block(self.buf[len(START) :], self.buf))
                    self.buf = ""
                else:
                    self.searched = max(len(START), len(self.buf) - len(END) + 1)
                break
            stop = end + len(END)
            events.append(_block(self.buf[len(START) : end], self.buf[:stop]))
            self.buf, self.inside = self.buf[stop:], False
        return events


def _block(body: str, raw: str) -> Event:
    """The block's call, or its raw text when the body is not a call."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return raw
    return call_from_object(obj) or raw


class HermesParser(ToolCallParser):
    """`--tool-call-parser hermes`: Hermes 2/3 and Qwen2.5/Qwen3 models."""

    name = "hermes"

    def scanner(self) -> HermesScanner:
        return HermesScanner()
