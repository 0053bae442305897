"""What a format's parser is built on: a scanner fed the model's text piece by piece that
reports, in order, the text and the calls it has settled."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from kvfleet.runtime.server.tool_calls.parsed_call import ParsedToolCall

# Settled output: text as it is, or a whole call. A scanner reports each piece of text once it
# knows the piece cannot belong to a call, and each call once its JSON is complete and valid.
Event = str | ParsedToolCall


class Scanner(Protocol):
    """Split-invariant: any split of a text into feeds gives the same events, text joined."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


@dataclass(slots=True)
class BufferedScanner(ABC):
    """A scanner that keeps its unsettled text in `buf` and settles what it can on each feed
    (`final`: at the end of the message, everything)."""

    buf: str = ""

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        return self._scan(final=False)

    def finish(self) -> list[Event]:
        return self._scan(final=True)

    @abstractmethod
    def _scan(self, final: bool) -> list[Event]:
        """The events `buf` settles now, removed from it."""

    def _take_text_before(self, marker: str, final: bool, events: list[Event]) -> bool:
        """Settle the text before `marker` (all of it at the end: a partial marker is text);
        True when `buf` now starts with the marker."""
        before, rest = split_at_marker(self.buf, marker)
        if rest is None and final:
            before = self.buf
        if before:
            events.append(before)
        self.buf = self.buf[len(before) :]
        return rest is not None


def held_prefix_len(text: str, marker: str) -> int:
    """How many trailing characters of text could be the start of marker (cut by a delta)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_at_marker(text: str, marker: str) -> tuple[str, str | None]:
    """(the text that is certainly not marker, the rest from marker on or None if absent).

    Without the marker, the rest keeps back a tail that may yet become it."""
    at = text.find(marker)
    if at >= 0:
        return text[:at], text[at:]
    keep = held_prefix_len(text, marker)
    return text[: len(text) - keep], None
