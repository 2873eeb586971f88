"""pytest-benchmark over crfkit's core ops: op x backend x case (benchmarks/cases.py).

    python -m pytest benchmarks/ --benchmark-only                       # quick subset
    CRFKIT_BENCH_FULL=1 python -m pytest benchmarks/ --benchmark-only   # full grid (long)

Not part of the main test suite (testpaths = ["tests"]). Each test first asserts that the
compiled result agrees with the reference on the cell's inputs (checked once per cell, shared
by both backends' tests), then times one call of the public function under its backend.
Results of one cell are grouped together, so pytest-benchmark prints compiled next to
reference. Reference cells whose single call would exceed ~10 s are skipped.
CRFKIT_BENCH_LIMIT=N / CRFKIT_BENCH_OPS=a,b cut the grid (see cases.grid_from_env);
CRFKIT_BENCH_THREADS=N sets torch's number of threads, CRFKIT_BENCH_BUDGET=S the reference budget.
"""
from __future__ import annotations

import os
from typing import Dict

import pytest
import torch

import cases

if os.environ.get("CRFKIT_BENCH_THREADS"):  # e.g. 1 for steadier numbers on a shared small machine
    torch.set_num_threads(int(os.environ["CRFKIT_BENCH_THREADS"]))

CASES = cases.grid_from_env()
_CHECKS: Dict[cases.Case, cases.Check] = {}


def checked(case: cases.Case) -> cases.Check:
    """The correctness check of a cell, run once and shared by its tests."""
    if case not in _CHECKS:
        _CHECKS[case] = cases.check_case(case, cases.budget_from_env())
    return _CHECKS[case]


@pytest.mark.parametrize("backend", cases.BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op(benchmark, case: cases.Case, backend: str):
    check = checked(case)
    assert not check.wrong, f"{case.id}: compiled disagrees with the reference: {check.status}"
    if backend == "reference" and check.reference_skipped:
        pytest.skip(f"skipped: too slow (one reference call ~{check.reference_estimate_s:.2g} s)")
    benchmark.group = case.id
    benchmark.extra_info.update(op=case.op, B=case.B, L=case.L, T=case.T, K=case.K, backend=backend,
                                tokens=case.B * case.L, correctness=check.status)
    benchmark(cases.callable_for(case, backend))
