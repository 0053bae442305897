"""Configuration errors and the values they are read from: one exception type every engine
setting raises (the CLI turns it into a one-line start-up error), and byte sizes."""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field and the limit."""


def parse_bytes(text: str | int, field: str = "kv_cache_memory") -> int:
    """'2GiB' → 2147483648; plain integers are bytes."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise ConfigError(
                f"{field}: cannot read {text!r} as a size (examples: 512MiB, 2GiB, 1000000)"
            )
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if value <= 0:
        raise ConfigError(f"{field}: must be > 0 bytes, got {value}")
    return value
