"""The whitespace that separates text from a call belongs to neither: dropped on both sides,
so that a message of calls alone has no content and text keeps no dangling newlines."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ContentSpacing:
    """Fed text and calls in order; gives back the text to show, whitespace next to calls cut.

    Trailing whitespace is held until it is known whether a call or more text follows."""

    held: str = ""
    after_call: bool = False

    def text(self, text: str) -> str:
        """What of text can be shown now."""
        if self.after_call:
            text = text.lstrip()
            if not text:
                return ""
            self.after_call = False
        text = self.held + text
        shown = text.rstrip()
        self.held = text[len(shown) :]
        return shown

    def call(self) -> None:
        """A call came: the whitespace before it is dropped, and so is that right after it."""
        self.held = ""
        self.after_call = True

    def finish(self) -> str:
        """The whitespace that ended the message, shown when no call came after it."""
        held, self.held = self.held, ""
        return held
