"""Whether a JSON Schema a request brings (a tool's parameters, a response_format) is valid
against its draft's meta-schema, and if not, where and why.

Checked on the event loop, in every request that brings a schema: jsonschema-rs (Rust, the
validator schemathesis uses) does it in well under a millisecond, where the pure-Python
`jsonschema` package took 1.5 ms for a one-function tool and 110 ms for an 8 KB schema,
holding the GIL (its Draft 2020-12 meta-schema resolves `$dynamicRef`s at each level).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jsonschema_rs

# The drafts jsonschema-rs carries meta-schemas for, as `$schema` names them (a trailing "#"
# or the other scheme make no difference). Any other `$schema` would be fetched over the
# network by jsonschema-rs: such a schema is checked as Draft 2020-12, the default, instead.
_KNOWN_DRAFTS = frozenset(
    f"{scheme}://json-schema.org/{path}"
    for scheme in ("http", "https")
    for path in (
        "draft-04/schema",
        "draft-06/schema",
        "draft-07/schema",
        "draft/2019-09/schema",
        "draft/2020-12/schema",
    )
)


@dataclass(slots=True, frozen=True)
class SchemaProblem:
    """Why a schema is invalid: `path` leads from the schema's root to the offending value."""

    path: tuple[str | int, ...]
    message: str

    @property
    def pointer(self) -> str:
        """`path` as a JSON Pointer fragment ("#/properties/a/type"), as errors name it."""
        parts = (str(p).replace("~", "~0").replace("/", "~1") for p in self.path)
        return "#" + "".join(f"/{p}" for p in parts)


def schema_problem(schema: dict[str, Any]) -> SchemaProblem | None:
    """The first way `schema` breaks its draft's meta-schema (`$schema`, else Draft 2020-12),
    or None when it is valid."""
    draft = schema.get("$schema")
    if isinstance(draft, str) and draft.rstrip("#") not in _KNOWN_DRAFTS:
        schema = {k: v for k, v in schema.items() if k != "$schema"}
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as exc:
        return SchemaProblem(tuple(exc.instance_path), exc.message)
    return None
