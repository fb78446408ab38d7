"""Kubernetes resource quantities (``500m``, ``1Gi``, ``2e3``), read as the API server reads them.

The Kubernetes platform checks a job's requests before it asks for a pod, the
scaler raises a memory limit after an out-of-memory kill, and the test cluster
(``tests/support/kube``) refuses what a real API server refuses: one exact
(decimal, never float) reading for all three.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal

__all__ = ["QUANTITY_PATTERN", "QuantityError", "format_bytes", "parse_quantity", "quantity_in_units"]

#: the pattern the real API server quotes when it refuses a quantity
QUANTITY_PATTERN = "^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"

_SUFFIXES: dict[str, Decimal] = {
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40, "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"),
    "T": Decimal("1e12"), "P": Decimal("1e15"), "E": Decimal("1e18"),
}
# the binary and decimal suffixes are tried before the exponent form, so "1E" is one exa and "1E3" is a thousand
_QUANTITY = re.compile(r"([+-]?)(\d+(?:\.\d*)?|\.\d+)(?:(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?|[eE]([+-]?\d+))")


class QuantityError(ValueError):
    """A string that is not a Kubernetes quantity."""


def parse_quantity(value: str | int | float) -> Decimal:
    """The exact value of a quantity (``"1Gi"`` -> 1073741824, ``"250m"`` -> 0.25); raises QuantityError."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is not a quantity")
    if isinstance(value, int | float):
        return Decimal(str(value))
    match = _QUANTITY.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise QuantityError(f"{value!r} is not a quantity: quantities must match the regular expression "
                            f"'{QUANTITY_PATTERN}' (for example 500m, 2, 1.5Gi, 128Mi, 1e3)")
    sign, number, suffix, exponent = match.groups()
    magnitude = Decimal(number) * (Decimal(10) ** int(exponent) if exponent is not None else _SUFFIXES[suffix or ""])
    return -magnitude if sign == "-" else magnitude


def quantity_in_units(value: str | int | float, divisor: str | int | float = "1") -> str:
    """``value / divisor`` rounded up to a whole number, as ``resourceFieldRef`` reports it (``"1Gi"``, ``"1Mi"``
    -> ``"1024"``; cpu ``"250m"``, ``"1"`` -> ``"1"``)."""
    result = (parse_quantity(value) / parse_quantity(divisor)).to_integral_value(rounding=ROUND_CEILING)
    return str(int(result))


def format_bytes(size: float) -> str:
    """Bytes as the quantity a person writes: whole ``Gi`` when it is one, else ``Mi`` rounded up (``12Gi``,
    ``12800Mi``)."""
    mib = -(-int(size) // 2**20)
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"
