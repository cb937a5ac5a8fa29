"""Argument checks shared by the package, so every bad value gets the same clear message.

Python's ``bool`` is an ``int``, and numpy integers are not; a serving engine that silently
took ``max_running=True`` or rejected ``np.int64(8)`` would surprise its caller. These
helpers accept what a user means by an integer or a number, reject the rest with a
``ValueError`` that names the argument and the value, and return the value as a plain
Python number.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["is_int", "check_int", "check_number", "check_choice"]


def is_int(value: object) -> bool:
    """True for Python and numpy integers, False for ``bool`` (which is also an ``int``)."""
    if type(value) is int:  # the common case, without the slow ABC check
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    """``value`` as an ``int``; ``ValueError`` unless it is an integer >= ``minimum``."""
    if not is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    number = int(value)  # type: ignore[call-overload]
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def check_number(
    name: str, value: object, low: float | None = None, high: float | None = None
) -> float:
    """``value`` as a ``float``; ``ValueError`` unless it is a real number in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if (low is not None and number < low) or (high is not None and number > high):
        bounds = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise ValueError(f"{name} must be in {bounds}, got {number}")
    return number


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``; else a ``ValueError`` listing them."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; supported values: {', '.join(allowed)}")
    return value
