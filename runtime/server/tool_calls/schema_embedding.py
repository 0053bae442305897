"""One JSON schema placed inside another: its `$defs` (or draft-07 `definitions`) moved to the
new root, and its local `$ref`s rewritten, so that every reference still resolves from there."""

from __future__ import annotations

from typing import Any

_DEFS_KEYWORDS = ("$defs", "definitions")
# Values of these keywords are data, not schemas: a "$ref" inside them is no reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def embed_schema(
    schema: dict[str, Any], at: str, prefix: str, root_defs: dict[str, Any]
) -> dict[str, Any]:
    """A copy of schema to place at JSON pointer `at` of a new root (e.g.
    "/items/anyOf/0/properties/parameters"); its definitions go into root_defs (the new root's
    `$defs`) named `prefix` + their name."""
    renamed: dict[tuple[str, str], str] = {}
    own: list[tuple[str, Any]] = []
    for keyword in _DEFS_KEYWORDS:
        defs = schema.get(keyword)
        if not isinstance(defs, dict):
            continue
        for name, definition in defs.items():
            new = prefix + name
            if new in root_defs or new in renamed.values():
                new = f"{prefix}{keyword}.{name}"  # the same name under both keywords
            renamed[keyword, name] = new
            own.append((new, definition))

    def ref(target: str) -> str:
        if not target.startswith("#"):
            return target  # a remote reference: nothing here to move
        pointer = target[1:]
        if pointer and not pointer.startswith("/"):
            return target  # an anchor ("#name"): it moves with its schema
        tokens = pointer.split("/")
        if len(tokens) >= 3 and (tokens[1], _unescape(tokens[2])) in renamed:
            rest = "/".join(tokens[3:])
            new = "/$defs/" + _escape(renamed[tokens[1], _unescape(tokens[2])])
            return "#" + new + ("/" + rest if len(tokens) > 3 else "")
        return "#" + at + pointer

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                out[key] = ref(value)
            elif key in _DATA_KEYWORDS:
                out[key] = value
            else:
                out[key] = walk(value)
        return out

    for new, definition in own:
        root_defs[new] = walk(definition)
    body = {k: v for k, v in schema.items() if k not in (*_DEFS_KEYWORDS, "$schema")}
    return walk(body)


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")
