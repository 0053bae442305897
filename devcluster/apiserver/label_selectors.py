"""Label and field selectors of list and watch requests, matched as the API server does."""

from __future__ import annotations

import re
from typing import Any


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality, inequality, set (in/notin) and existence requirements, comma-separated."""
    for req in re.split(r",(?![^()]*\))", selector):
        req = req.strip()
        if not req:
            continue
        if m := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", req):
            values = {v.strip() for v in m[3].split(",")}
            inside = labels.get(m[1]) in values
            if inside != (m[2] == "in"):
                return False
        elif "!=" in req:
            k, v = req.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in req:
            k, v = req.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif req.startswith("!"):
            if req[1:] in labels:
                return False
        elif req not in labels:
            return False
    return True


def field_matches(selector: str, obj: dict[str, Any]) -> bool:
    """`a.b=value` and `a.b!=value` requirements on dotted paths, comma-separated."""
    for req in filter(None, (r.strip() for r in selector.split(","))):
        negate = "!=" in req
        key, value = req.split("!=" if negate else "=", 1)
        node: Any = obj
        for part in key.lstrip("=").split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if (str(node) == value) == negate:
            return False
    return True
