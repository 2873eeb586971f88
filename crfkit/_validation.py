"""Checks for scalar arguments (ints, real numbers, flags, string choices), shared by the package.

Each check returns the value (an int, a float, a bool or the chosen str) or raises with a message
that names the argument, says what was expected and what was given:

    check_int("k", 0, minimum=1)           ValueError: k must be a positive int, got 0
    check_int("k", "3", minimum=1)         TypeError: k must be an int, got '3' (str)
    check_number("p", 1.5, minimum=0, maximum=1)
                                           ValueError: p must be a number in [0, 1], got 1.5
    check_choice("reduction", "avg", LOSS_REDUCTIONS)
                                           ValueError: reduction must be one of 'mean', 'sum', 'none', got 'avg'

A bool is never accepted as an int or a number (True is not 1 here), and NaN or an infinity is
never a number in range. A value of the wrong type raises TypeError, unless the call site passes
``type_error=ValueError`` (some public functions have always raised ValueError for both).

The command lines (crfkit.pipeline, crfkit.tag) check their options with the same rules, at parse
time rather than when a stage first uses them (perhaps an hour into a run): ``cli_int`` and
``cli_number`` make argparse ``type=`` functions, and argparse then prints the usage and
"argument --k: expected a positive int, got '0'".
"""
from __future__ import annotations

import argparse
import math
import reprlib
from collections.abc import Sequence
from typing import Optional

__all__ = [
    "LOSS_REDUCTIONS",
    "CRF_REDUCTIONS",
    "check_int",
    "check_number",
    "check_bool",
    "check_choice",
    "check_reduction",
    "cli_int",
    "cli_number",
]

# Reductions of a loss computed per item (per sentence or per position): the mean over the
# counted items, their sum, or no reduction.
LOSS_REDUCTIONS = ("mean", "sum", "none")
# The CRF layers' reductions add the sum over sentences divided by the number of real tokens.
CRF_REDUCTIONS = LOSS_REDUCTIONS + ("token_mean",)


def _given(value) -> str:
    """A value of the wrong type, shortened (a tensor or a long list would fill the message)."""
    return f"{reprlib.repr(value)} ({type(value).__name__})"


def _format_bound(bound) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _int_expectation(minimum: Optional[int], maximum: Optional[int]) -> str:
    if minimum is not None and maximum is not None:
        return f"an int in {minimum} .. {maximum}"
    if minimum is not None:
        return {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
    if maximum is not None:
        return f"an int <= {maximum}"
    return "an int"


def check_int(name: str, value, *, minimum: Optional[int] = None, maximum: Optional[int] = None,
              optional: bool = False, type_error: type = TypeError) -> Optional[int]:
    """``value`` as an int in [minimum, maximum] (either bound may be None: unbounded).

    optional=True also accepts None (and returns it). A non-int (a bool, a float, even 2.0)
    raises ``type_error`` ("{name} must be an int, got ..."); an int out of range raises
    ValueError ("{name} must be a positive int, got 0", "... an int in 1 .. 5, got 7").
    """
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if optional else "an int"
        raise type_error(f"{name} must be {kind}, got {_given(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        expected = _int_expectation(minimum, maximum) + (" or None" if optional else "")
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return value


def _number_expectation(minimum, maximum, open_minimum: bool, open_maximum: bool) -> str:
    if minimum is not None and maximum is not None:
        left = "(" if open_minimum else "["
        right = ")" if open_maximum else "]"
        return f"a number in {left}{_format_bound(minimum)}, {_format_bound(maximum)}{right}"
    if minimum is not None:
        if minimum == 0:
            return "a finite positive number" if open_minimum else "a finite non-negative number"
        return f"a finite number {'>' if open_minimum else '>='} {_format_bound(minimum)}"
    if maximum is not None:
        return f"a finite number {'<' if open_maximum else '<='} {_format_bound(maximum)}"
    return "a finite number"


def check_number(name: str, value, *, minimum: Optional[float] = None, maximum: Optional[float] = None,
                 open_minimum: bool = False, open_maximum: bool = False, type_error: type = TypeError) -> float:
    """``value`` (an int or a float, not a bool) as a finite float in the range given.

    The bounds are inclusive unless open_minimum / open_maximum (minimum=0, open_minimum=True:
    strictly positive). NaN and infinities are always rejected. A non-number raises
    ``type_error`` ("{name} must be a real number, got ..."); a number out of range raises
    ValueError ("{name} must be a finite positive number, got 0.0", "... a number in [0, 1), got 1").
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise type_error(f"{name} must be a real number, got {_given(value)}")
    number = float(value)
    in_range = math.isfinite(number)
    if in_range and minimum is not None:
        in_range = number > minimum if open_minimum else number >= minimum
    if in_range and maximum is not None:
        in_range = number < maximum if open_maximum else number <= maximum
    if not in_range:
        expected = _number_expectation(minimum, maximum, open_minimum, open_maximum)
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return number


def check_bool(name: str, value) -> bool:
    """``value`` if it is a bool (True / False; not 0, 1 or a tensor), else TypeError."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {_given(value)}")
    return value


def _quoted(choices: Sequence[str]) -> str:
    quoted = [repr(choice) for choice in choices]
    if len(quoted) == 2:
        return f"{quoted[0]} or {quoted[1]}"
    return "one of " + ", ".join(quoted)


def check_choice(name: str, value, choices: Sequence[str]) -> str:
    """``value`` if it is one of the strings ``choices``, else ValueError (whatever its type):
    "{name} must be one of 'a', 'b', 'c', got ..." ("must be 'a' or 'b'" for two choices)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be {_quoted(choices)}, got {reprlib.repr(value)}")
    return value


def check_reduction(reduction, choices: Sequence[str] = LOSS_REDUCTIONS, *, name: str = "reduction") -> str:
    """check_choice for a loss's reduction argument (LOSS_REDUCTIONS by default)."""
    return check_choice(name, reduction, choices)


def cli_int(*, minimum: Optional[int] = None, maximum: Optional[int] = None):
    """An argparse ``type=`` that parses an int and applies check_int's range (the bounds as there)."""
    def parse(text: str) -> int:
        try:
            return check_int("value", int(text), minimum=minimum, maximum=maximum)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {_int_expectation(minimum, maximum)}, got {text!r}") from None
    parse.__name__ = "int"
    return parse


def cli_number(*, minimum: Optional[float] = None, maximum: Optional[float] = None, open_minimum: bool = False,
               open_maximum: bool = False):
    """An argparse ``type=`` that parses a float and applies check_number's range (the bounds as there)."""
    def parse(text: str) -> float:
        try:
            return check_number("value", float(text), minimum=minimum, maximum=maximum, open_minimum=open_minimum,
                                open_maximum=open_maximum)
        except ValueError:
            expected = _number_expectation(minimum, maximum, open_minimum, open_maximum)
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    parse.__name__ = "float"
    return parse
