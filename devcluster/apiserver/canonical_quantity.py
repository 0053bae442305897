"""Kubernetes resource quantities as the API server stores them (k8s.io/apimachinery
resource.Quantity): parsed with its grammar, rounded up to nano precision, and written back in
canonical form — `0.5` becomes `500m`, `1000` becomes `1k`, `1024Mi` becomes `1Gi`, while
`1000Mi` and `1.5Gi` (`1536Mi`) keep a binary suffix. A controller that compares its rendered
`cpu: "0.5"` with the stored `500m` sees a difference that is not one.
"""

from __future__ import annotations

import re
from decimal import ROUND_UP, Decimal

# The apimachinery grammar: a signed decimal number, then a binary-SI, decimal-SI or exponent
# suffix. Anything else fails to decode (the server answers 400 before validation runs).
PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
_NUMBER = re.compile(r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)$")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {exp: suffix for suffix, exp in _DECIMAL.items()}
_BINARY_SUFFIX = {0: "", **{exp: suffix for suffix, exp in _BINARY.items()}}
_NANO = Decimal("1e-9")


class QuantityError(ValueError):
    """Not a Kubernetes quantity; the message is the API server's."""

    def __init__(self, text: object) -> None:
        super().__init__(f"quantities must match the regular expression '{PATTERN}'")
        self.text = text


def parse_quantity(text: str | int | float) -> tuple[Decimal, str]:
    """The exact value (rounded up to 1n) and the format its suffix implies:
    "BinarySI", "DecimalSI" or "DecimalExponent"."""
    if isinstance(text, bool):
        raise QuantityError(text)
    raw = repr(text) if isinstance(text, float) else str(text)
    m = re.fullmatch(r"([+-]?[0-9.]+)(.*)", raw)
    if m is None or not _NUMBER.match(m[1]):
        raise QuantityError(text)
    number, suffix = Decimal(m[1]), m[2]
    if suffix in _BINARY:
        value, fmt = number * Decimal(1024) ** _BINARY[suffix], "BinarySI"
    elif suffix in _DECIMAL:
        value, fmt = number.scaleb(_DECIMAL[suffix]), "DecimalSI"
    elif re.fullmatch(r"[eE][+-]?[0-9]+", suffix):
        value, fmt = number.scaleb(int(suffix[1:])), "DecimalExponent"
    else:
        raise QuantityError(text)
    # Precision below nano is rounded up (away from zero), as the API server does.
    return value.quantize(_NANO, rounding=ROUND_UP) if value % _NANO else value, fmt


def canonical_quantity(text: str | int | float) -> str:
    """The quantity as the API server stores and returns it."""
    value, fmt = parse_quantity(text)
    if value == 0:
        return "0"
    if fmt == "BinarySI" and (abs(value) < 1024 or value != value.to_integral_value()):
        fmt = "DecimalSI"  # small or fractional binary amounts are shown in decimal, unrounded
    if fmt == "BinarySI":
        amount, exponent = int(value), 0
        while amount % 1024 == 0 and exponent < 6:
            amount, exponent = amount // 1024, exponent + 1
        return f"{amount}{_BINARY_SUFFIX[exponent]}"
    # Decimal: an integer mantissa without trailing zeros, then the exponent brought down to a
    # multiple of 3 so that an SI suffix can name it.
    sign, digits, exponent = value.normalize().as_tuple()
    assert isinstance(exponent, int)
    mantissa = int("".join(map(str, digits))) * (-1 if sign else 1)
    shift = exponent % 3
    mantissa, exponent = mantissa * 10**shift, exponent - shift
    if fmt == "DecimalExponent":
        return f"{mantissa}" if exponent == 0 else f"{mantissa}e{exponent}"
    if exponent in _DECIMAL_SUFFIX:
        return f"{mantissa}{_DECIMAL_SUFFIX[exponent]}"
    return f"{mantissa}e{exponent}"
