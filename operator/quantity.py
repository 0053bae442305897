"""Kubernetes byte quantities (16Gi, 500M, 1.5Ti) to integers and back, without the client.

The kubernetes client has a parser, but importing it pulls in the whole generated client; the
render functions stay light. The grammar is the CRD's: a decimal number and an optional suffix.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

GI = 1024**3
_SUFFIXES = {
    "": 1,
    "k": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "P": 1000**5,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "Pi": 1024**5,
}
_QUANTITY = re.compile(r"^(?P<number>[0-9]+(\.[0-9]+)?)(?P<suffix>k|Ki|Mi|Gi|Ti|Pi|M|G|T|P)?$")


def parse_bytes(quantity: str | int) -> int:
    """Bytes in a quantity such as "16Gi" or 17179869184 (rounded up); ValueError if malformed."""
    if isinstance(quantity, int) and not isinstance(quantity, bool):
        if quantity < 0:
            raise ValueError(f"{quantity} is negative")
        return quantity
    m = _QUANTITY.match(str(quantity))
    if not m:
        raise ValueError(f"{quantity!r} is not a byte quantity such as 16Gi, 500Mi or 20G")
    return math.ceil(Decimal(m["number"]) * _SUFFIXES[m["suffix"] or ""])


def whole_gi(n_bytes: int) -> str:
    """`n_bytes` rounded up to whole gibibytes, as a quantity ("19Gi")."""
    return f"{max(1, math.ceil(n_bytes / GI))}Gi"
