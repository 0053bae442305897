"""The non-apply patch formats a client may send: JSON merge patch (RFC 7386; strategic-merge
patches are merged the same way, lists replaced) and JSON patch (RFC 6902)."""

from __future__ import annotations

import copy
from typing import Any


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: dicts merge recursively, null deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class PatchTestFailed(Exception):
    """A JSON-patch `test` op did not hold (the server answers 422)."""


def json_patch(target: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 add/remove/replace/test, enough for kopf's finalizer and annotation writes."""
    doc = copy.deepcopy(target)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.setdefault(part, {})
        last = parts[-1] if parts else ""
        kind = op["op"]
        if kind == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if current != op.get("value"):
                raise PatchTestFailed(
                    f"test failed at {op['path']}: {current!r} != {op.get('value')!r}"
                )
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                idx = len(parent) if last == "-" else int(last)
                if kind == "add":
                    parent.insert(idx, op["value"])
                else:
                    parent[idx] = op["value"]
            else:
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                parent.pop(last, None)
    return doc
