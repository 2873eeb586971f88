"""crfkit._validation: the scalar-argument checks shared by the package."""
import argparse
import math

import pytest
import torch

from crfkit._validation import (
    CRF_REDUCTIONS,
    LOSS_REDUCTIONS,
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_reduction,
    cli_int,
    cli_number,
)

NAN, INF = float("nan"), float("inf")


# --------------------------------------------------------------------------- check_int
@pytest.mark.parametrize("kwargs,value", [
    ({}, 0), ({}, -7), ({}, 10 ** 30),
    ({"minimum": 1}, 1), ({"minimum": 1}, 5),
    ({"minimum": 0}, 0),
    ({"minimum": 3}, 3),
    ({"maximum": 4}, 4), ({"maximum": 4}, -100),
    ({"minimum": 1, "maximum": 5}, 1), ({"minimum": 1, "maximum": 5}, 5),
    ({"minimum": 2, "maximum": 2}, 2),
])
def test_check_int_accepts(kwargs, value):
    result = check_int("n", value, **kwargs)
    assert result == value and type(result) is int


def test_check_int_optional():
    assert check_int("n", None, optional=True) is None
    assert check_int("n", 3, minimum=1, optional=True) == 3
    with pytest.raises(TypeError, match=r"^n must be an int, got None \(NoneType\)$"):
        check_int("n", None)
    with pytest.raises(TypeError, match=r"^n must be an int or None, got 1.5 \(float\)$"):
        check_int("n", 1.5, optional=True)
    with pytest.raises(ValueError, match=r"^n must be a positive int or None, got 0$"):
        check_int("n", 0, minimum=1, optional=True)


@pytest.mark.parametrize("value", [True, False])
def test_check_int_rejects_bool(value):
    with pytest.raises(TypeError, match=rf"^flag must be an int, got {value} \(bool\)$"):
        check_int("flag", value)
    with pytest.raises(TypeError, match="flag must be an int"):
        check_int("flag", value, minimum=0, maximum=1)


@pytest.mark.parametrize("value,type_name", [
    (2.0, "float"), ("3", "str"), (None, "NoneType"), ([1], "list"), (torch.tensor(1), "Tensor"), (NAN, "float"),
])
def test_check_int_rejects_other_types(value, type_name):
    with pytest.raises(TypeError, match=rf"^size must be an int, got .* \({type_name}\)$"):
        check_int("size", value, minimum=1)


def test_check_int_type_error_can_be_value_error():
    with pytest.raises(ValueError, match=r"^k must be an int, got '3' \(str\)$"):
        check_int("k", "3", minimum=1, type_error=ValueError)
    with pytest.raises(ValueError, match=r"^k must be an int, got True \(bool\)$"):
        check_int("k", True, minimum=1, type_error=ValueError)


@pytest.mark.parametrize("kwargs,value,expected", [
    ({"minimum": 1}, 0, "a positive int"),
    ({"minimum": 1}, -3, "a positive int"),
    ({"minimum": 0}, -1, "a non-negative int"),
    ({"minimum": 3}, 2, "an int >= 3"),
    ({"minimum": -2}, -3, "an int >= -2"),
    ({"maximum": 4}, 5, "an int <= 4"),
    ({"minimum": 1, "maximum": 5}, 0, "an int in 1 .. 5"),
    ({"minimum": 1, "maximum": 5}, 6, "an int in 1 .. 5"),
    ({"minimum": 0, "maximum": 0}, 1, "an int in 0 .. 0"),
])
def test_check_int_out_of_range(kwargs, value, expected):
    with pytest.raises(ValueError, match=rf"^width must be {expected}, got {value}$"):
        check_int("width", value, **kwargs)


def test_check_int_large_value_in_message_is_exact():
    with pytest.raises(ValueError, match=rf"^n must be an int <= 10, got {10 ** 20}$"):
        check_int("n", 10 ** 20, maximum=10)


# --------------------------------------------------------------------------- check_number
@pytest.mark.parametrize("kwargs,value", [
    ({}, 0), ({}, -1.5), ({}, 1e300),
    ({"minimum": 0}, 0), ({"minimum": 0}, 0.0), ({"minimum": 0}, 3),
    ({"minimum": 0, "open_minimum": True}, 1e-300),
    ({"minimum": 0, "maximum": 1}, 0), ({"minimum": 0, "maximum": 1}, 1), ({"minimum": 0, "maximum": 1}, 0.5),
    ({"minimum": 0, "maximum": 1, "open_maximum": True}, 0.0),
    ({"minimum": 0, "maximum": 1, "open_maximum": True}, 0.999),
    ({"maximum": -1}, -1), ({"maximum": 2, "open_maximum": True}, 1.99),
    ({"minimum": 0.5}, 0.5), ({"minimum": 0.5, "open_minimum": True}, 0.6),
])
def test_check_number_accepts(kwargs, value):
    result = check_number("x", value, **kwargs)
    assert result == value and type(result) is float


@pytest.mark.parametrize("value", [True, False])
def test_check_number_rejects_bool(value):
    with pytest.raises(TypeError, match=rf"^x must be a real number, got {value} \(bool\)$"):
        check_number("x", value)


@pytest.mark.parametrize("value,type_name", [
    ("1.0", "str"), (None, "NoneType"), (torch.tensor(0.5), "Tensor"), (1j, "complex"), ([0.5], "list"),
])
def test_check_number_rejects_other_types(value, type_name):
    with pytest.raises(TypeError, match=rf"^rate must be a real number, got .* \({type_name}\)$"):
        check_number("rate", value, minimum=0)
    with pytest.raises(ValueError, match=rf"^rate must be a real number, got .* \({type_name}\)$"):
        check_number("rate", value, minimum=0, type_error=ValueError)


@pytest.mark.parametrize("kwargs,expected", [
    ({}, "a finite number"),
    ({"minimum": 0}, "a finite non-negative number"),
    ({"minimum": 0, "open_minimum": True}, "a finite positive number"),
    ({"minimum": 0, "maximum": 1}, r"a number in \[0, 1\]"),
    ({"minimum": 0, "maximum": 1, "open_maximum": True}, r"a number in \[0, 1\)"),
    ({"minimum": 0, "maximum": 1, "open_minimum": True}, r"a number in \(0, 1\]"),
])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_check_number_rejects_nan_and_infinity(kwargs, expected, value):
    with pytest.raises(ValueError, match=rf"^tau must be {expected}, got {value!r}$"):
        check_number("tau", value, **kwargs)


@pytest.mark.parametrize("kwargs,value,expected", [
    ({"minimum": 0}, -1e-9, "a finite non-negative number"),
    ({"minimum": 0, "open_minimum": True}, 0, "a finite positive number"),
    ({"minimum": 0, "open_minimum": True}, 0.0, "a finite positive number"),
    ({"minimum": 0.5}, 0.4, "a finite number >= 0.5"),
    ({"minimum": 2, "open_minimum": True}, 2, "a finite number > 2"),
    ({"maximum": 1}, 1.5, "a finite number <= 1"),
    ({"maximum": 1, "open_maximum": True}, 1, "a finite number < 1"),
    ({"minimum": 0, "maximum": 1}, -0.1, r"a number in \[0, 1\]"),
    ({"minimum": 0, "maximum": 1}, 1.5, r"a number in \[0, 1\]"),
    ({"minimum": 0, "maximum": 1, "open_maximum": True}, 1, r"a number in \[0, 1\)"),
    ({"minimum": 0, "maximum": 1, "open_minimum": True}, 0, r"a number in \(0, 1\]"),
    ({"minimum": 1e-8, "maximum": 0.25}, 1e-9, r"a number in \[1e-08, 0.25\]"),
])
def test_check_number_out_of_range(kwargs, value, expected):
    with pytest.raises(ValueError, match=rf"^p must be {expected}, got {value!r}$"):
        check_number("p", value, **kwargs)


def test_check_number_returns_float_of_int():
    assert check_number("x", 3) == 3.0 and isinstance(check_number("x", 3), float)
    assert math.isclose(check_number("x", 0.1, minimum=0, maximum=1), 0.1)


# --------------------------------------------------------------------------- check_bool
def test_check_bool():
    assert check_bool("freeze", True) is True
    assert check_bool("freeze", False) is False
    for value, type_name in ((1, "int"), (0, "int"), ("True", "str"), (None, "NoneType"),
                             (torch.tensor(True), "Tensor")):
        with pytest.raises(TypeError, match=rf"^freeze must be a bool, got .* \({type_name}\)$"):
            check_bool("freeze", value)


# --------------------------------------------------------------------------- check_choice
def test_check_choice_accepts():
    assert check_choice("mode", "b", ("a", "b", "c")) == "b"
    assert check_choice("mode", "a", ["a"]) == "a"


@pytest.mark.parametrize("value,given", [
    ("d", "'d'"), ("A", "'A'"), ("", "''"), (None, "None"), (1, "1"), (True, "True"), (("a",), r"\('a',\)"),
])
def test_check_choice_rejects(value, given):
    with pytest.raises(ValueError, match=rf"^mode must be one of 'a', 'b', 'c', got {given}$"):
        check_choice("mode", value, ("a", "b", "c"))


def test_check_choice_two_choices_and_unhashable():
    with pytest.raises(ValueError, match=r"^approximate must be 'none' or 'tanh', got 'fast'$"):
        check_choice("approximate", "fast", ("none", "tanh"))
    with pytest.raises(ValueError, match=r"^mode must be 'a' or 'b', got \[\]$"):
        check_choice("mode", [], ("a", "b"))
    with pytest.raises(ValueError, match=r"^mode must be 'a' or 'b', got tensor"):
        check_choice("mode", torch.zeros(3), ("a", "b"))


def test_check_choice_long_value_is_shortened():
    with pytest.raises(ValueError) as info:
        check_choice("mode", "x" * 1000, ("a", "b"))
    assert "mode must be 'a' or 'b', got 'x" in str(info.value) and len(str(info.value)) < 100


# --------------------------------------------------------------------------- reductions
def test_reduction_constants():
    assert LOSS_REDUCTIONS == ("mean", "sum", "none")
    assert CRF_REDUCTIONS == ("mean", "sum", "none", "token_mean")


def test_check_reduction():
    for reduction in LOSS_REDUCTIONS:
        assert check_reduction(reduction) == reduction
    assert check_reduction("token_mean", CRF_REDUCTIONS) == "token_mean"
    with pytest.raises(ValueError, match=r"^reduction must be one of 'mean', 'sum', 'none', got 'token_mean'$"):
        check_reduction("token_mean")
    with pytest.raises(ValueError, match=r"^reduction must be one of 'mean', 'sum', 'none', got None$"):
        check_reduction(None)
    with pytest.raises(ValueError, match=r"^pool must be one of 'mean', 'sum', 'none', got 'max'$"):
        check_reduction("max", name="pool")


# --------------------------------------------------------------------------- argparse types
def _parser(option_type):
    parser = argparse.ArgumentParser(prog="prog", exit_on_error=False)
    parser.add_argument("--value", type=option_type)
    return parser


@pytest.mark.parametrize("option_type,text,expected", [
    (cli_int(minimum=1), "3", 3), (cli_int(minimum=0), "0", 0), (cli_int(), "-4", -4),
    (cli_int(minimum=1, maximum=5), "5", 5),
    (cli_number(minimum=0, open_minimum=True), "1e-3", 1e-3), (cli_number(), "-2.5", -2.5),
    (cli_number(minimum=0, maximum=1, open_maximum=True), "0", 0.0),
])
def test_cli_types_accept(option_type, text, expected):
    value = _parser(option_type).parse_args(["--value", text]).value
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("option_type,text,message", [
    (cli_int(minimum=1), "0", "expected a positive int, got '0'"),
    (cli_int(minimum=0), "-1", "expected a non-negative int, got '-1'"),
    (cli_int(minimum=1), "2.0", "expected a positive int, got '2.0'"),
    (cli_int(minimum=1), "x", "expected a positive int, got 'x'"),
    (cli_int(minimum=1, maximum=5), "6", "expected an int in 1 .. 5, got '6'"),
    (cli_number(minimum=0, open_minimum=True), "0", "expected a finite positive number, got '0'"),
    (cli_number(minimum=0, open_minimum=True), "nan", "expected a finite positive number, got 'nan'"),
    (cli_number(), "inf", "expected a finite number, got 'inf'"),
    (cli_number(minimum=0, maximum=1, open_maximum=True), "1", "expected a number in [0, 1), got '1'"),
    (cli_number(), "fast", "expected a finite number, got 'fast'"),
])
def test_cli_types_reject_with_the_option_named(option_type, text, message):
    with pytest.raises(argparse.ArgumentError) as info:
        _parser(option_type).parse_args(["--value", text])
    assert str(info.value) == f"argument --value: {message}"
