"""The history's tool turns: an assistant's calls and the tools' answers, checked and put in
the form Hugging Face chat templates read (a call's arguments as a mapping, not a string)."""

from __future__ import annotations

import json
from typing import Any

from kvfleet.runtime.server.tool_calls.field_error import field_error, json_type


def chat_message(m: dict[str, Any], where: str) -> dict[str, Any]:
    """A "tool" message, or an "assistant" one (with or without `tool_calls`), for the chat
    template; `where` names it in errors ("messages[2]")."""
    role = m.get("role")
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise field_error(
                f"{where}.tool_call_id", f"must be a string, got {json_type(call_id)}"
            )
        content = _text(m.get("content"), f"{where}.content", required=True)
        return {"role": "tool", "tool_call_id": call_id, "content": content}
    if role != "assistant":
        raise ValueError(f"{where} is a {role!r} message, neither a tool nor an assistant one")
    message: dict[str, Any] = {
        "role": "assistant",
        "content": _text(m.get("content"), f"{where}.content", required=False),
    }
    calls = m.get("tool_calls")
    if calls is None or calls == []:
        return message
    if not isinstance(calls, list):
        raise field_error(f"{where}.tool_calls", f"must be an array, got {json_type(calls)}")
    message["tool_calls"] = [_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    return message


def _call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise field_error(where, f"must be an object, got {json_type(call)}")
    call_id = call.get("id")
    if not isinstance(call_id, str):
        raise field_error(f"{where}.id", f"must be a string, got {json_type(call_id)}")
    if call.get("type") != "function":
        raise field_error(f"{where}.type", f"must be 'function', got {call.get('type')!r}")
    function = call.get("function")
    if not isinstance(function, dict):
        raise field_error(f"{where}.function", f"must be an object, got {json_type(function)}")
    name = function.get("name")
    if not isinstance(name, str):
        raise field_error(f"{where}.function.name", f"must be a string, got {json_type(name)}")
    raw = function.get("arguments")
    if not isinstance(raw, str):
        raise field_error(
            f"{where}.function.arguments",
            f"must be a string holding a JSON object, got {json_type(raw)}",
        )
    try:
        arguments = json.loads(raw)
    except (ValueError, RecursionError):
        raise field_error(
            f"{where}.function.arguments", f"must hold a JSON object, got {raw[:80]!r}"
        ) from None
    if not isinstance(arguments, dict):
        raise field_error(
            f"{where}.function.arguments", f"must hold a JSON object, got {json_type(arguments)}"
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _text(content: Any, where: str, required: bool) -> str:
    """Content as one string: a string, or an array of text parts joined."""
    if content is None:
        if required:
            raise field_error(where, "is required (a string or an array of text parts), got null")
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise field_error(
            where, f"must be a string or an array of text parts, got {json_type(content)}"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise field_error(
                f"{where}[{j}]", 'only text parts are supported ({"type": "text", ...})'
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise field_error(f"{where}[{j}].text", f"must be a string, got {json_type(text)}")
        texts.append(text)
    return "".join(texts)
