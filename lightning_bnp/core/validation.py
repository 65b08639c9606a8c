"""Argument checks shared by every public constructor (pure Python; the core never imports Lightning).

Each check names the argument and the value in its message, and returns the value in the form the
caller stores (e.g. an ``int`` given for a float as ``float``; a bare pattern string as a one-item list):

* floats accept ``int`` and ``float`` and refuse ``bool``, strings and non-finite values (``inf``, NaN);
* ints refuse ``bool`` and non-integers (``2.0``, ``"2"``);
* bools refuse everything but ``True``/``False`` (the string ``"false"`` would otherwise be truthy);
* a pattern list is ``None``, a non-empty list of strings, or one bare string, taken as **one** pattern
  (``include: net.0`` in a LightningCLI YAML file means ``["net.0"]``, not ``["n", "e", …]``).

A wrong type raises ``TypeError``, a value out of range ``ValueError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["check_bool", "check_choice", "check_float", "check_int", "check_patterns", "check_str_list"]


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return ""


def check_float(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """A finite real number in the given interval, returned as ``float``.

    Raises:
        TypeError: ``value`` is a ``bool`` or not an ``int``/``float``.
        ValueError: ``value`` is not finite or outside the interval.
    """
    spec = " ".join(filter(None, ("a finite number", _interval(low, high, low_open, high_open))))
    message = f"`{name}` must be {spec}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{message} ({type(value).__name__})")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(message)
    if low is not None and (number <= low if low_open else number < low):
        raise ValueError(message)
    if high is not None and (number >= high if high_open else number > high):
        raise ValueError(message)
    return number


def check_int(name: str, value: Any, *, low: int | None = None) -> int:
    """An ``int`` (not a ``bool``) of at least ``low``.

    Raises:
        TypeError: ``value`` is a ``bool`` or not an ``int``.
        ValueError: ``value`` < ``low``.
    """
    message = f"`{name}` must be an integer{'' if low is None else f' >= {low}'}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{message} ({type(value).__name__})")
    if low is not None and value < low:
        raise ValueError(message)
    return value


def check_bool(name: str, value: Any) -> bool:
    """``True`` or ``False`` and nothing else.

    Raises:
        TypeError: ``value`` is not a ``bool`` (e.g. the string ``"false"``, or ``0``).
    """
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool (True or False), got {value!r} ({type(value).__name__})")
    return value


def check_choice(name: str, value: Any, choices: Sequence[str]) -> Any:
    """One of ``choices``.

    Raises:
        ValueError: ``value`` is not one of them.
    """
    if not isinstance(value, str) or value not in choices:
        options = f"{choices[0]!r} or {choices[1]!r}" if len(choices) == 2 else f"one of {[str(c) for c in choices]}"
        raise ValueError(f"`{name}` must be {options}, got {value!r}")
    return value


def check_str_list(name: str, value: Any) -> list[str]:
    """A list of strings; a bare string is a list of one.

    Raises:
        TypeError: ``value`` is neither a string nor a sequence of strings.
    """
    if isinstance(value, str):
        return [value]
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"`{name}` must be a string or a list of strings, got {value!r}")
    return list(value)


def check_patterns(name: str, value: Any) -> list[str] | None:
    """``None`` or a non-empty list of glob patterns; a bare string is **one** pattern.

    Raises:
        TypeError: ``value`` is neither ``None``, a string nor a sequence of strings.
        ValueError: ``value`` is an empty list.
    """
    if value is None:
        return None
    patterns = check_str_list(name, value)
    if not patterns:
        raise ValueError(f"`{name}` must be None or a non-empty list of patterns, got []")
    return patterns
