"""The shared argument checks: one ``pytest.raises(match=...)`` per branch."""

from __future__ import annotations

import math
from typing import Any

import pytest

from lightning_bnp.core.validation import check_bool, check_choice, check_float, check_int, check_patterns


def test_check_float_accepts_ints_and_returns_floats() -> None:
    assert check_float("x", 1, low=0.0) == 1.0 and isinstance(check_float("x", 1), float)
    assert check_float("x", 0.0, low=0.0, high=1.0, high_open=True) == 0.0


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "match"),
    [
        (True, {}, TypeError, r"`x` must be a finite number, got True \(bool\)"),
        ("0.9", {}, TypeError, r"`x` must be a finite number, got '0.9' \(str\)"),
        (None, {}, TypeError, r"`x` must be a finite number, got None \(NoneType\)"),
        (math.inf, {}, ValueError, r"`x` must be a finite number, got inf"),
        (math.nan, {"low": 0.0}, ValueError, r"`x` must be a finite number >= 0, got nan"),
        (-0.5, {"low": 0.0}, ValueError, r"`x` must be a finite number >= 0, got -0.5"),
        (0.0, {"low": 0.0, "low_open": True}, ValueError, r"`x` must be a finite number > 0, got 0.0"),
        (
            1.0,
            {"low": 0, "high": 1, "high_open": True},
            ValueError,
            r"`x` must be a finite number in \[0, 1\), got 1.0",
        ),
        (2.0, {"high": 1.0}, ValueError, r"`x` must be a finite number <= 1, got 2.0"),
    ],
)
def test_check_float_refuses(value: Any, kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        check_float("x", value, **kwargs)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (True, TypeError, r"`n` must be an integer >= 1, got True \(bool\)"),
        (2.0, TypeError, r"`n` must be an integer >= 1, got 2.0 \(float\)"),
        ("2", TypeError, r"`n` must be an integer >= 1, got '2' \(str\)"),
        (0, ValueError, r"`n` must be an integer >= 1, got 0"),
    ],
)
def test_check_int_refuses(value: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        check_int("n", value, low=1)


def test_check_int_and_bool_accept() -> None:
    assert check_int("n", 3, low=1) == 3 and check_bool("b", False) is False


@pytest.mark.parametrize("value", ["false", 0, 1, None])
def test_check_bool_refuses_non_bools(value: Any) -> None:
    with pytest.raises(TypeError, match=rf"`b` must be a bool \(True or False\), got {value!r}"):
        check_bool("b", value)


def test_check_choice() -> None:
    assert check_choice("m", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"`m` must be 'a' or 'b', got 'c'"):
        check_choice("m", "c", ("a", "b"))
    with pytest.raises(ValueError, match=r"`m` must be one of \['a', 'b', 'c'\], got 3"):
        check_choice("m", 3, ("a", "b", "c"))


def test_check_patterns() -> None:
    assert check_patterns("include", None) is None
    assert check_patterns("include", "net.0") == ["net.0"]  # one pattern, not one per character
    assert check_patterns("include", ("a", "b*")) == ["a", "b*"]
    with pytest.raises(ValueError, match=r"`include` must be None or a non-empty list of patterns, got \[\]"):
        check_patterns("include", [])
    with pytest.raises(TypeError, match=r"`include` must be a string or a list of strings, got 3"):
        check_patterns("include", 3)
    with pytest.raises(TypeError, match=r"`exclude` must be a string or a list of strings, got \['fc', 3\]"):
        check_patterns("exclude", ["fc", 3])


def test_check_int_without_a_bound_names_no_bound() -> None:
    with pytest.raises(TypeError, match=r"^`n` must be an integer, got 'a' \(str\)$"):
        check_int("n", "a")


def test_check_float_bounds_are_closed_unless_said_open_and_the_message_shows_which() -> None:
    """Issue 27 (`make mutate` survivors): a closed upper bound accepts the bound itself, an open one refuses it;
    the message writes the interval as it is: ``[0, 1]`` both closed, ``< 1`` / ``<= 1`` for an upper bound alone."""
    assert check_float("x", 1.0, high=1.0) == 1.0
    assert check_float("x", 1, low=0.0, high=1.0) == 1.0
    with pytest.raises(ValueError, match=r"^`x` must be a finite number <= 1, got 1.5$"):
        check_float("x", 1.5, high=1.0)
    with pytest.raises(ValueError, match=r"^`x` must be a finite number < 1, got 1.0$"):
        check_float("x", 1.0, high=1.0, high_open=True)
    with pytest.raises(ValueError, match=r"^`x` must be a finite number in \[0, 1\], got 2.0$"):
        check_float("x", 2.0, low=0.0, high=1.0)
    with pytest.raises(ValueError, match=r"^`x` must be a finite number in \(0, 1\], got 0.0$"):
        check_float("x", 0.0, low=0.0, high=1.0, low_open=True)


@pytest.mark.parametrize(("value", "type_name"), [("false", "str"), (0, "int"), (None, "NoneType")])
def test_check_bool_names_the_type_it_was_given(value: Any, type_name: str) -> None:
    """Issue 27: the message ends with the type of the value given (``'false'`` is a str, not a bool)."""
    with pytest.raises(TypeError, match=rf"^`b` must be a bool \(True or False\), got {value!r} \({type_name}\)$"):
        check_bool("b", value)
