"""pytest-benchmark: crfkit side by side with the peer CRF libraries on the quick cells of
benchmarks/bench_peers.py ((B, L, T) in {(32, 128, 9), (256, 128, 37), (1, 512, 9)}; every op,
k-best with K in {1, 5, 15}).

    python -m pytest benchmarks/test_bench_peers.py --benchmark-only
    python -m pytest benchmarks/test_bench_peers.py --benchmark-only -k "kbest and K5"

Not part of the main test suite (testpaths = ["tests"]). One benchmark per (cell, library); the
benchmarks of a cell share a group, so pytest-benchmark prints crfkit next to the peers.
Each test runs its correctness check first, on the cell's inputs (benchmarks/cases.py):
- crfkit: its compiled result must agree with its reference (cases.check_case), asserted;
- a peer: its result must agree with crfkit's (bench_peers.check_peer). A peer that disagrees
  or crashes is an expected failure (xfail, with the reason) and is not timed; a peer that is not
  installed, has no such op, would take over the budget for one call, or runs out of memory
  (torch-struct at large T: checked in a capped subprocess first) is skipped.
CRFKIT_BENCH_THREADS=N sets torch's number of threads, CRFKIT_BENCH_BUDGET=S the per-call budget
(10 s), CRFKIT_BENCH_PEERS=a,b keeps those peers.
"""
from __future__ import annotations

import os
from typing import Dict, Tuple

import pytest
import torch

import bench_peers
import cases
import peers

if os.environ.get("CRFKIT_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["CRFKIT_BENCH_THREADS"]))

# the peers' own notices (torch.distributions validation of torch-struct, uint8 masks in torch.where)
pytestmark = [pytest.mark.filterwarnings("ignore:.*does not define `arg_constraints`"),
              pytest.mark.filterwarnings("ignore:where received a uint8 condition tensor")]

CASES = bench_peers.grid(full=False)
PEERS = tuple(p for p in os.environ.get("CRFKIT_BENCH_PEERS", "").split(",") if p) or peers.NAMES
LIBRARIES = ("crfkit",) + PEERS
_CHECKS: Dict[Tuple[str, cases.Case], dict] = {}


def _case_id(case: cases.Case) -> str:
    return case.id.replace("log_partition_fwd_bwd", "logZ_fwd_bwd").replace("log_partition", "logZ")


def _peer_check(name: str, case: cases.Case) -> dict:
    """bench_peers' correctness check of a peer on a cell (once per cell), with the timed callable."""
    key = (name, case)
    if key not in _CHECKS:
        peer = peers.load(name)
        budget = cases.budget_from_env()
        x = bench_peers.peer_inputs(peer, cases.inputs_for(case))
        if peer.memory_estimate(case.op, x, case.K) > bench_peers.ISOLATE_BYTES:
            # check in a capped subprocess first: an out-of-memory there must not take pytest down
            task = {"kind": "cell", "lib": name, "op": case.op, "B": case.B, "L": case.L, "T": case.T,
                    "K": case.K, "threads": torch.get_num_threads(), "budget": budget, "rounds": 0,
                    "min_run_time": 0.0}
            result = bench_peers._run_child(task, bench_peers.MEM_CAP_GB, timeout_s=max(120.0, 30 * budget))
            if result["status"] != "ok":
                _CHECKS[key] = {"status": result["status"], "fn": None, "single_s": None}
                return _CHECKS[key]
        _CHECKS[key] = bench_peers.check_peer(peer, case, x, bench_peers.crfkit_result(case, x), budget)
    return _CHECKS[key]


def _crfkit_check(case: cases.Case) -> cases.Check:
    key = ("crfkit", case)
    if key not in _CHECKS:
        _CHECKS[key] = {"check": cases.check_case(case, cases.budget_from_env())}
    return _CHECKS[key]["check"]


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_peer_side_by_side(benchmark, case: cases.Case, library: str):
    benchmark.group = _case_id(case)
    benchmark.extra_info.update(op=case.op, B=case.B, L=case.L, T=case.T, K=case.K, library=library,
                                tokens=case.B * case.L)
    if library == "crfkit":
        check = _crfkit_check(case)
        assert not check.wrong, f"{case.id}: crfkit compiled disagrees with its reference: {check.status}"
        benchmark.extra_info["correctness"] = check.status
        benchmark(cases.callable_for(case, "compiled"))
        return
    try:
        peer = peers.load(library)
    except peers.PeerUnavailable as error:
        pytest.skip(f"not installed: {error}")
    if case.op not in peer.supports:
        pytest.skip(f"{library} has no {case.op}")
    check = _peer_check(library, case)
    status = check["status"]
    if status.startswith(("skipped", "failed: out of memory")):
        pytest.skip(f"{library}: {status}")
    if status != "ok":  # WRONG, or the peer crashed: the peer's defect, reported, not timed
        pytest.xfail(f"{library} {case.id}: {status}")
    benchmark.extra_info.update(correctness="agrees with crfkit", version=peer.version, how=peer.how(case.op))
    if check["single_s"] > 1.0:  # a slow peer: a few single calls instead of pytest-benchmark's calibration
        benchmark.pedantic(check["fn"], rounds=3, iterations=1)
    else:
        benchmark(check["fn"])
