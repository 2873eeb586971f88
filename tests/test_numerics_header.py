"""The numeric thresholds every backend shares live in one header, csrc/numerics.h, included by
the CPU (csrc/cpu/) and CUDA (csrc/cuda/) kernels. The numba kernels cannot include it, so their
copies (crfkit/backends/numba_kernels.py, float64 throughout) are held to it here: a change on
one side only fails these tests instead of making the backends' results drift apart. No build
and no GPU needed: the header is parsed as text."""
import ast
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "csrc" / "numerics.h"
NUMBA_KERNELS = ROOT / "crfkit" / "backends" / "numba_kernels.py"

# Each constant of the header (a function template specialised for float and double) and the
# name of the numba kernels' float64 copy.
SHARED = {
    "trusted_sum_min": "TRUSTED_SUM_MIN",
    "pairwise_fast_bound": "PAIRWISE_FAST_BOUND",
}

# `CRFKIT_HOST_DEVICE constexpr double name<double>() { return 0x1p-960; }`
_SPECIALISATION = re.compile(
    r"constexpr\s+(?P<type>float|double)\s+(?P<name>\w+)<(?P=type)>\(\)\s*\{\s*return\s+(?P<value>[^;]+);\s*\}")


def _cpp_literal(text: str) -> float:
    """A C++ floating literal (decimal or hexadecimal, optional f suffix) as a Python float."""
    text = text.strip()
    if text[-1] in "fF":
        text = text[:-1]
    return float.fromhex(text) if text.lower().startswith(("0x", "-0x")) else float(text)


def header_constants() -> dict:
    """{(name, "float" | "double"): value} of every specialisation in csrc/numerics.h."""
    found = {}
    for m in _SPECIALISATION.finditer(HEADER.read_text()):
        key = (m["name"], m["type"])
        assert key not in found, f"csrc/numerics.h defines {key} twice"
        found[key] = _cpp_literal(m["value"])
    return found


def _evaluate(node: ast.AST) -> float:
    """Numbers combined with + - * / ** (the form of the constants in numba_kernels.py)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.Div: lambda a, b: a / b, ast.Pow: lambda a, b: a ** b}
        if type(node.op) in ops:
            return ops[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(f"not a numeric constant expression: {ast.dump(node)}")


def numba_source_constants() -> dict:
    """{NAME: value} of the module-level assignments of numba_kernels.py named in SHARED."""
    wanted = set(SHARED.values())
    found = {}
    for node in ast.parse(NUMBA_KERNELS.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in wanted:
                found[name] = float(_evaluate(node.value))
    return found


def test_header_defines_each_shared_constant_for_float_and_double():
    constants = header_constants()
    names = {name for name, _ in constants}
    assert names == set(SHARED), (f"csrc/numerics.h defines {sorted(names)}; this test maps {sorted(SHARED)} "
                                  "to the numba kernels: add a new constant to SHARED (or say why numba has none)")
    for name in SHARED:
        for dtype in ("float", "double"):
            assert (name, dtype) in constants, f"csrc/numerics.h lacks {name}<{dtype}>"
        # The float value is exact in float32 (no silent rounding of the literal).
        value = constants[(name, "float")]
        assert float(np.float32(value)) == value, f"{name}<float> = {value!r} is not a float32 value"


def test_numba_source_matches_the_header():
    """Without importing numba: the assignments in numba_kernels.py's source."""
    constants, numba_values = header_constants(), numba_source_constants()
    for name, numba_name in SHARED.items():
        assert numba_name in numba_values, f"numba_kernels.py has no module-level {numba_name}"
        assert numba_values[numba_name] == constants[(name, "double")], (
            f"numba_kernels.{numba_name} = {numba_values[numba_name]!r} but csrc/numerics.h has "
            f"{name}<double>() = {constants[(name, 'double')]!r}")


def test_numba_module_matches_the_header():
    pytest.importorskip("numba", reason="the numba backend needs numba")
    from crfkit.backends import numba_kernels

    constants = header_constants()
    for name, numba_name in SHARED.items():
        value = getattr(numba_kernels, numba_name)
        assert isinstance(value, float) and value == constants[(name, "double")], (
            f"numba_kernels.{numba_name} = {value!r} but csrc/numerics.h has {name}<double>() = "
            f"{constants[(name, 'double')]!r}")


def test_the_thresholds_are_defined_only_in_the_header():
    """No second definition in csrc/ (a copy in cpu/ or cuda/ could drift from the header's)."""
    pattern = re.compile(r"\b(" + "|".join(SHARED) + r")<(float|double)>\(\)\s*\{")
    copies = [f"{path.relative_to(ROOT)}: {m.group(0)}"
              for path in sorted((ROOT / "csrc").rglob("*")) if path.is_file() and path != HEADER
              and path.suffix in (".h", ".cpp", ".cu", ".cuh")
              for m in pattern.finditer(path.read_text())]
    assert not copies, "thresholds defined outside csrc/numerics.h:\n" + "\n".join(copies)
