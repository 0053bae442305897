"""Cutting an upstream's Server-Sent Events byte stream back into whole events.

The router passes each event on the moment it is complete, never a fragment: should the
upstream die mid-event, the client has only whole events and then the router's error event,
never a half-written line glued to it.
"""

from __future__ import annotations

_SEPARATORS = (b"\r\n\r\n", b"\n\n")
DONE = b"data: [DONE]"


class EventFramer:
    """Feed bytes as they arrive; get back the events they complete (separator included)."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        events = []
        while True:
            cuts = [(i, len(s)) for s in _SEPARATORS if (i := self._buffer.find(s)) >= 0]
            if not cuts:
                return events
            i, n = min(cuts)
            events.append(self._buffer[: i + n])
            self._buffer = self._buffer[i + n :]

    @property
    def pending(self) -> int:
        """Bytes of an event not yet complete."""
        return len(self._buffer)


def is_done(event: bytes) -> bool:
    """Whether the event is OpenAI's end-of-stream marker."""
    return event.strip() == DONE
