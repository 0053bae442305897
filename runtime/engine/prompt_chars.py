"""The most characters a text prompt can hold and still fit in max_model_len tokens.

A prompt longer than that is certain to be too long, so the server refuses it by its length
alone instead of spending a tokenizer thread's second on a megabyte of text. The bound is only
given where it is certain: a byte-level or byte-fallback BPE tokenizer (every character ends
up in some vocabulary token, none is dropped or merged into an unknown token) whose normalizer
never makes the text shorter. Elsewhere there is no early refusal; the prompt is tokenized.
"""

from __future__ import annotations

import json
from typing import Any

# Normalizers whose output is never shorter than their input.
_NEVER_SHRINK = frozenset({"Prepend", "NFD", "NFKD", "Lowercase"})


def max_prompt_chars(backend: Any, max_model_len: int) -> int | None:
    """`backend`: a `tokenizers.Tokenizer`. A text of more characters than the result encodes
    to more than max_model_len tokens; None when that cannot be promised for this tokenizer."""
    if type(backend.model).__name__ != "BPE":
        return None
    pre = backend.pre_tokenizer
    byte_level = pre is not None and '"ByteLevel"' in pre.__getstate__().decode()
    if not (byte_level or backend.model.byte_fallback):
        return None
    normalizer = backend.normalizer
    if normalizer is not None and not never_shrinks(json.loads(normalizer.__getstate__())):
        return None
    # A token's vocabulary string is at least as long as the text it stands for: one symbol per
    # byte at byte level, one per character otherwise, "<0x0A>" for one byte of fallback.
    longest = max(len(t) for t in backend.get_vocab(with_added_tokens=True))
    return max_model_len * longest


def never_shrinks(config: dict[str, Any]) -> bool:
    """Whether a normalizer (its JSON form) can never make a text shorter."""
    kind = config.get("type")
    if kind == "Sequence":
        return all(never_shrinks(c) for c in config.get("normalizers", []))
    if kind == "Replace":
        pattern = config.get("pattern", {})
        # A regex pattern may match any length: only a plain string replaced by something at
        # least as long is safe.
        return "String" in pattern and len(config.get("content", "")) >= len(pattern["String"])
    return kind in _NEVER_SHRINK
