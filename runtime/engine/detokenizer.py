"""Incremental detokenizing and stop strings.

`tokenizers`' DecodeStream (Rust) turns one token at a time into text and holds back bytes of a
character split across tokens, so text never ends in half a character. Stop strings are looked
for only in the new tail of the text; while a stop string could still be completing, its
possible start is held back from what is shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizers.decoders import DecodeStream


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: Any  # tokenizers.Tokenizer (the fast backend)
    stop: list[str]
    skip_special_tokens: bool = True
    include_stop_str: bool = False  # cut after a matched stop string rather than before it
    text: str = ""
    _stream: DecodeStream = field(init=False)
    _max_stop_len: int = field(init=False)

    def __post_init__(self) -> None:
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

    def add(self, token_id: int, check_stop: bool) -> str | None:
        """Append one token's text; return the stop string it completed, if any (the text is
        then cut just before it, or just after it with `include_stop_str`)."""
        piece = self._stream.step(self.tokenizer, token_id)
        if not piece:
            return None
        tail_start = max(len(self.text) - self._max_stop_len + 1, 0)
        self.text += piece
        if not (check_stop and self.stop):
            return None
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, tail_start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[: best[0] + (len(best[1]) if self.include_stop_str else 0)]
        return best[1]

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: a trailing partial stop string is held back until decided."""
        if finished or self._max_stop_len <= 1:
            return self.text
        return self.text[: max(len(self.text) - self._max_stop_len + 1, 0)]
