"""What a request's prompt starts with, as bytes to hash: the router's prefix signal.

The router does not tokenize (it must not load a tokenizer, and it need not agree with the
engine token for token): a key only has to be equal for requests whose prompts start alike.
Text is cut at about `CHARS_PER_TOKEN` characters per token, token-id prompts at the token.
A prompt shorter than one KV block has no cacheable prefix, so it gives no key.
"""

from __future__ import annotations

from typing import Any

CHARS_PER_TOKEN = 4  # English text through a BPE tokenizer: about 4 characters a token


def prefix_key(body: Any, chat: bool, key_tokens: int, block_tokens: int) -> bytes | None:
    """The key of a parsed /v1/completions (`chat` False) or /v1/chat/completions body: its
    model and its prompt's first `key_tokens` tokens (or their characters' worth); None when
    the body has no prompt of at least `block_tokens` tokens to go by."""
    if not isinstance(body, dict):
        return None
    model = body.get("model")
    head = _chat_head(body.get("messages")) if chat else _prompt_head(body.get("prompt"))
    if head is None:
        return None
    if isinstance(head, str):
        if len(head) < block_tokens * CHARS_PER_TOKEN:
            return None
        prefix = head[: key_tokens * CHARS_PER_TOKEN].encode("utf-8", "surrogatepass")
    else:
        if len(head) < block_tokens:
            return None
        prefix = b"ids:" + ",".join(map(str, head[:key_tokens])).encode()
    # Different models never share a cache: the model is part of the key.
    return f"{model if isinstance(model, str) else ''}\x00".encode() + prefix


def _prompt_head(prompt: Any) -> str | list[int] | None:
    """A completion's prompt: a string, token ids, or a list of either (a batch is routed by
    its first prompt: it is served on one replica as a whole)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        return _prompt_head(prompt[0]) if isinstance(prompt[0], str | list) else None
    return None


def _chat_head(messages: Any) -> str | None:
    """The conversation through its first user message, roles and text: a long system prompt
    alone fills the key (every user of it meets the same cache); after a short one the first
    question does, which every later turn of the conversation repeats (so the turns come
    back to the replica that holds their history)."""
    if not isinstance(messages, list) or not messages:
        return None
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            return None
        parts.append(f"{m.get('role', '')}\x00{_content_text(m.get('content'))}\x00")
        if m.get("role") == "user":
            break
    return "".join(parts)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only the text ones say what is cached
        return "".join(
            p.get("text", "")
            for p in content
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""
