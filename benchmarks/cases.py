"""The benchmark grid of crfkit's core ops, their inputs, and the correctness check that runs
before any timing. Shared by benchmarks/run.py (a report) and benchmarks/test_bench_ops.py
(pytest-benchmark).

What is measured: one call of a PUBLIC crfkit function (crfkit.log_partition, crfkit.marginals,
crfkit.viterbi, crfkit.kbest_viterbi), including its argument checks, under
`crfkit.use_backend(backend)`; the same callable runs the "compiled" (C++) and the "reference"
(plain PyTorch) implementation. Inputs are built once per case and are not part of the timing.

Grid (NER-like shapes, float32): T in {9, 37}, L in {32, 128, 512}, B in {1, 32, 256}, and
K in {1, 5, 15} for k-best. The quick subset (CI / smoke) is (B, L, T) in {(32, 128, 9),
(1, 128, 9), (32, 32, 37)} with K = 5.

Correctness (every cell, before timing): the compiled result is compared with the reference
result on the same inputs (see `Op.check`). A cell that disagrees is WRONG and is not timed.
Reference cells whose single call would take longer than a budget (~10 s) are skipped
("skipped: too slow"); the compiled result of such a cell is then checked against the reference
on the first few sentences of the batch instead.
"""
from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import crfkit

BACKENDS = ("compiled", "reference")

TAGS = (9, 37)
LENGTHS = (32, 128, 512)
BATCHES = (1, 32, 256)
KS = (1, 5, 15)

QUICK_SHAPES = ((32, 128, 9), (1, 128, 9), (32, 32, 37))  # (B, L, T)
QUICK_KS = (5,)

# Headline cells and the project's targets (ratio reference / compiled).
HEADLINE_SHAPE = (32, 128, 9)  # (B, L, T)
TARGETS = {("kbest", 5): 50.0, ("log_partition_fwd_bwd", None): 5.0}

REFERENCE_BUDGET_S = 10.0  # skip a reference cell whose single call would take longer
CHECK_BATCH = 4  # sentences checked when the full reference call is too slow (then 1 if still too slow)

# float32 tolerances, compiled vs reference
SCORE_TOL = dict(rtol=1e-4, atol=1e-3)  # log Z, Viterbi / k-best scores, log-probs
PROB_TOL = dict(rtol=1e-3, atol=1e-4)  # marginals and d log Z / d emissions (values in [0, 1])
COUNT_TOL = dict(rtol=1e-3, atol=1e-3)  # d log Z / d transitions (expected counts, up to B*L)
TIE_TOL = dict(rtol=1e-6, atol=1e-5)  # k-best rows this close (a few float32 ulps) may be swapped


# ---- cases and inputs ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One cell of the grid: an op at one shape (K only for "kbest", its k, and the samplers, their n)."""

    op: str
    B: int
    L: int
    T: int
    K: Optional[int] = None

    @property
    def shape(self) -> Tuple[int, int, int]:
        return (self.B, self.L, self.T)

    @property
    def id(self) -> str:
        k = f"-K{self.K}" if self.K is not None else ""
        return f"{self.op}-B{self.B}-L{self.L}-T{self.T}{k}"


@dataclass
class Inputs:
    """Arguments of the public functions for one (B, L, T); k is set per k-best cell."""

    emissions: torch.Tensor  # (B, L, T) float32, randn * 3
    transitions: torch.Tensor  # (T, T) randn
    lengths: torch.Tensor  # (B,) int64 in [L // 2, L], lengths[0] = L
    start: torch.Tensor  # (T,) randn
    end: torch.Tensor  # (T,) randn
    k: Optional[int] = None

    @property
    def tokens(self) -> int:
        """B * L: the positions of the padded batch (what tokens/s counts)."""
        return self.emissions.shape[0] * self.emissions.shape[1]

    def to(self, device) -> "Inputs":
        """The same inputs on `device`."""
        return Inputs(self.emissions.to(device), self.transitions.to(device), self.lengths.to(device),
                      self.start.to(device), self.end.to(device), self.k)

    def with_k(self, k: Optional[int]) -> "Inputs":
        return Inputs(self.emissions, self.transitions, self.lengths, self.start, self.end, k)

    def head(self, batch: int) -> "Inputs":
        """The first `batch` sentences (sentence 0 has the full length)."""
        return Inputs(self.emissions[:batch], self.transitions, self.lengths[:batch], self.start, self.end, self.k)

    def truncated(self, length: int) -> "Inputs":
        """The first `length` positions of every sentence (used to estimate the cost of a call)."""
        return Inputs(self.emissions[:, :length], self.transitions, self.lengths.clamp(max=length),
                      self.start, self.end, self.k)


def make_inputs(B: int, L: int, T: int, dtype=torch.float32) -> Inputs:
    """Seeded random inputs; the seed depends only on (B, L, T), so every op of a shape and
    both entry points see the same tensors."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"crfkit-bench-{B}-{L}-{T}".encode()))
    emissions = torch.randn(B, L, T, generator=gen, dtype=dtype) * 3
    transitions = torch.randn(T, T, generator=gen, dtype=dtype)
    lengths = torch.randint(L // 2, L + 1, (B,), generator=gen, dtype=torch.long)
    lengths[0] = L
    start = torch.randn(T, generator=gen, dtype=dtype)
    end = torch.randn(T, generator=gen, dtype=dtype)
    return Inputs(emissions, transitions, lengths, start, end)


_INPUTS: Dict[Tuple[int, int, int], Inputs] = {}


def inputs_for(case: Case) -> Inputs:
    """Inputs of a case (cached per shape)."""
    if case.shape not in _INPUTS:
        _INPUTS[case.shape] = make_inputs(*case.shape)
    return _INPUTS[case.shape].with_k(case.K)


# ---- the ops: what is called, and how two results are compared ------------------------------------
def _log_partition(x: Inputs, backend: str):
    with crfkit.use_backend(backend), torch.no_grad():
        return (crfkit.log_partition(x.emissions, x.transitions, x.lengths, x.start, x.end),)


def _log_partition_fwd_bwd(x: Inputs, backend: str):
    emissions = x.emissions.detach().requires_grad_()
    transitions = x.transitions.detach().requires_grad_()
    with crfkit.use_backend(backend):
        log_z = crfkit.log_partition(emissions, transitions, x.lengths, x.start, x.end)
        grad_e, grad_t = torch.autograd.grad(log_z.sum(), (emissions, transitions))
    return log_z.detach(), grad_e, grad_t


def _marginals(x: Inputs, backend: str):
    with crfkit.use_backend(backend), torch.no_grad():
        return (crfkit.marginals(x.emissions, x.transitions, x.lengths, x.start, x.end),)


def _viterbi(x: Inputs, backend: str):
    with crfkit.use_backend(backend), torch.no_grad():
        best = crfkit.viterbi(x.emissions, x.transitions, x.lengths, x.start, x.end)
        return best.paths, best.scores  # the harness's order, the peers' (benchmarks/peers)


def _kbest(x: Inputs, backend: str):
    with crfkit.use_backend(backend), torch.no_grad():
        best = crfkit.kbest_viterbi(x.emissions, x.transitions, x.k, x.lengths, x.start, x.end)
        return best.paths, best.scores, best.log_probs  # the harness's order, the peers' (benchmarks/peers)


def _sample(x: Inputs, backend: str, replacement: bool = True):
    # A generator seeded alike on each call: every backend draws the same noise in the same order.
    with crfkit.use_backend(backend), torch.no_grad():
        drawn = crfkit.sample(x.emissions, x.transitions, x.k, x.lengths, x.start, x.end, replacement=replacement,
                              generator=torch.Generator().manual_seed(0))
        return drawn.paths, drawn.log_probs


def _sample_without(x: Inputs, backend: str):
    return _sample(x, backend, replacement=False)


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: dict) -> Optional[str]:
    """None if close, else a one-line description of the worst difference."""
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if torch.allclose(got, want, **tol):
        return None
    bad = ~torch.isclose(got, want, **tol)
    diff = (got - want).abs().masked_fill(~bad, 0).nan_to_num(nan=float("inf"))
    where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    return (f"{name}: {int(bad.sum())} of {got.numel()} values differ, worst at {where}: "
            f"got {got[where].item():.6g}, expected {want[where].item():.6g}")


def _check_log_partition(got, want, x: Inputs) -> Optional[str]:
    return _close("log Z", got[0], want[0], SCORE_TOL)


def _check_fwd_bwd(got, want, x: Inputs) -> Optional[str]:
    return (_close("log Z", got[0], want[0], SCORE_TOL)
            or _close("d logZ/d emissions", got[1], want[1], PROB_TOL)
            or _close("d logZ/d transitions", got[2], want[2], COUNT_TOL))


def _check_marginals(got, want, x: Inputs) -> Optional[str]:
    return _close("marginals", got[0], want[0], PROB_TOL)


def _check_viterbi(got, want, x: Inputs) -> Optional[str]:
    """Scores close; a path that differs from crfkit's is still right when both paths, rescored
    in float64, tie within TIE_TOL: in float32 two paths that close are ordered by rounding (on
    the seeded (32, 512, 9) inputs torch-struct's and allencrf's differing paths score 5e-5
    HIGHER in float64 than crfkit's; they were reported WRONG before this rule)."""
    error = _close("viterbi score", got[1], want[1], SCORE_TOL)
    if error:
        return error
    differs = (got[0] != want[0]).any(1)
    if differs.any():
        emissions, transitions, start, end = (t.double() for t in (x.emissions, x.transitions, x.start, x.end))
        got_score, want_score = (
            crfkit.reference.sequence_score(emissions[differs], transitions, paths[differs].clamp(min=0),
                                            x.lengths[differs], start, end)
            for paths in (got[0], want[0]))
        untied = ~torch.isclose(got_score, want_score, **TIE_TOL)
        if untied.any():
            b = int(differs.nonzero()[untied.nonzero()[0]])
            gap = float((got_score - want_score)[untied][0])
            return (f"viterbi paths differ in {int(untied.sum())} of {len(differs)} sentences beyond a float32 "
                    f"tie (first: b={b}, float64 score of the path minus crfkit's: {gap:.3g})")
    return None


def repeated_paths(paths: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor) -> Optional[str]:
    """Describe the sentences whose k-best rows (those with a finite score) repeat a path; None
    if none do."""
    dup = []
    for b in range(paths.shape[0]):
        rows = [tuple(p.tolist()) for p, s in zip(paths[b], scores[b]) if s != float("-inf")]
        if len(set(rows)) < len(rows):
            dup.append(b)
    if not dup:
        return None
    L = paths.shape[-1]
    short = sum(int(lengths[b]) < L for b in dup)
    return (f"{len(dup)} of {paths.shape[0]} sentences get repeated paths (first: sentence {dup[0]}, length "
            f"{int(lengths[dup[0]])} of L={L}; {short} of them shorter than L)")


def _check_kbest(got, want, x: Inputs) -> Optional[str]:
    """Scores and log-probs close; paths equal in every row whose reference score is not tied
    (within TIE_TOL) with a neighbouring row, since tied rows may legitimately come in another
    order; and every returned path really has its returned score (crfkit.reference.sequence_score)
    and differs from the sentence's other rows. The last row counts as tied: the first sequence
    left out of the list may tie with it, and the lists cannot show that (a peer listing that
    sequence instead was reported WRONG on long sentences at K = 15)."""
    paths, scores, log_probs = got
    ref_paths, ref_scores, ref_log_probs = want
    error = _close("k-best scores", scores, ref_scores, SCORE_TOL) or _close(
        "k-best log_probs", log_probs, ref_log_probs, SCORE_TOL)
    if error:
        return error
    near = torch.isclose(ref_scores[:, 1:], ref_scores[:, :-1], **TIE_TOL)  # row r ~ row r+1
    tied = torch.zeros_like(ref_scores, dtype=torch.bool)
    tied[:, 1:] |= near
    tied[:, :-1] |= near
    tied[:, -1] = True
    differs = (paths != ref_paths).any(2) & ~tied
    if differs.any():
        b, r = (int(i) for i in differs.nonzero()[0])
        return f"k-best paths differ in {int(differs.sum())} untied rows (first: sentence {b}, row {r})"
    repeated = repeated_paths(paths, scores, x.lengths)
    if repeated:
        return repeated
    found = scores != float("-inf")
    rescored = crfkit.reference.sequence_score(x.emissions, x.transitions, paths.clamp(min=0), x.lengths,
                                               x.start, x.end)
    return _close("k-best scores of the returned paths", rescored[found], scores[found], SCORE_TOL)


# Rows (sentence, draw) of the compiled kernel that may differ from the reference's for the same
# noise: the kernel computes in double, the float32 reference rounds its forward scores and logits
# to float32, which decides a near tie differently about once in 10^5 draws (crfkit/sampling.py).
SAMPLE_ROWS_DIFFERING = 1e-3


# Without replacement a near tie decided differently changes a sentence's set of rows (the kernel's
# keys are in double, the float32 reference's in float32): about 1 sentence in 1,000 in the tests
# (tests/test_sampling_kernels.py::test_float32_rows_equal_the_pytorch_path_in_float64_on_the_same_noise);
# the share of sentences that may differ.
SAMPLE_SENTENCES_DIFFERING = 0.05


def _check_sample(got, want, x: Inputs, replacement: bool = True) -> Optional[str]:
    (paths, log_probs), (ref_paths, ref_log_probs) = got, want
    if paths.shape != ref_paths.shape:
        return f"paths have shape {tuple(paths.shape)}, reference {tuple(ref_paths.shape)}"
    same = (paths == ref_paths).all(2)
    if replacement:
        share = 1 - float(same.float().mean())
        if share > SAMPLE_ROWS_DIFFERING:
            return f"{share:.2%} of the rows differ from the reference's for the same generator"
    else:
        share = 1 - float(same.all(1).float().mean())
        if share > SAMPLE_SENTENCES_DIFFERING:
            return f"{share:.2%} of the sentences' rows differ from the reference's for the same generator"
        same = same & same.all(1, keepdim=True)
    return _close("log-probabilities of the rows both drew", log_probs[same], ref_log_probs[same], SCORE_TOL)


def _check_sample_without(got, want, x: Inputs) -> Optional[str]:
    return _check_sample(got, want, x, replacement=False)


@dataclass(frozen=True)
class Op:
    """run(inputs, backend) calls the public function under that backend and returns a tuple
    of tensors; check(compiled_result, reference_result, inputs) returns None or what differs."""

    run: Callable[[Inputs, str], tuple]
    check: Callable[[tuple, tuple, Inputs], Optional[str]]
    doc: str


OPS: Dict[str, Op] = {
    "log_partition": Op(_log_partition, _check_log_partition,
                        "crfkit.log_partition forward only, under torch.no_grad"),
    "log_partition_fwd_bwd": Op(_log_partition_fwd_bwd, _check_fwd_bwd,
                                "crfkit.log_partition forward + backward (autograd.grad of log Z.sum() "
                                "w.r.t. emissions and transitions)"),
    "marginals": Op(_marginals, _check_marginals, "crfkit.marginals, under torch.no_grad"),
    "viterbi": Op(_viterbi, _check_viterbi, "crfkit.viterbi (paths and scores), under torch.no_grad"),
    "kbest": Op(_kbest, _check_kbest,
                "crfkit.kbest_viterbi with k = K (paths, scores and log-probs, which include a log Z), "
                "under torch.no_grad"),
    "sample": Op(_sample, _check_sample,
                 "crfkit.sample with replacement, n = K draws per sentence (paths and log-probs, which "
                 "include a sequence_score and a log Z), generator seeded alike per call, under torch.no_grad: "
                 "the compiled backend's C++ kernel on the CPU against the reference's PyTorch path"),
    "sample_without": Op(_sample_without, _check_sample_without,
                         "crfkit.sample without replacement (stochastic beam search), n = K distinct rows per "
                         "sentence (paths and log-probs), generator seeded alike per call, under torch.no_grad: "
                         "the compiled backend's C++ kernel on the CPU against the reference's PyTorch path"),
}
# The ops whose cells have a K: k-best (k = K) and sampling (n = K rows).
WITH_K = ("kbest", "sample", "sample_without")


# ---- the grid ---------------------------------------------------------------------------------
# The shapes of the project's targets (the peer comparison and the roofline at B >= 32).
TARGET_SHAPES = ((32, 128, 9), (256, 128, 37), (1, 512, 9))
TARGET_KS = (5, 15)


def grid(full: bool = False, limit: Optional[int] = None, ops: Optional[Sequence[str]] = None,
         shapes: Optional[Sequence[Tuple[int, int, int]]] = None) -> List[Case]:
    """The cells, grouped by shape (small shapes first). `shapes` replaces the grid's shapes
    (with K in TARGET_KS for k-best). `limit` keeps the first `limit` cells, `ops` keeps only
    those ops (both are for smoke-testing a code path, e.g. the full grid)."""
    if shapes:
        shapes, ks = list(shapes), TARGET_KS
    elif full:
        shapes = [(B, L, T) for T in TAGS for L in LENGTHS for B in BATCHES]
        ks = KS
    else:
        shapes, ks = list(QUICK_SHAPES), QUICK_KS
    cases = []
    for B, L, T in shapes:
        for op in OPS:
            if op in WITH_K:
                cases.extend(Case(op, B, L, T, k) for k in ks)
            else:
                cases.append(Case(op, B, L, T))
    if ops:
        unknown = set(ops) - set(OPS)
        if unknown:
            raise ValueError(f"unknown ops {sorted(unknown)}; choose from {list(OPS)}")
        cases = [c for c in cases if c.op in ops]
    return cases[:limit] if limit is not None else cases


def budget_from_env() -> float:
    """The reference budget of the pytest entry point: CRFKIT_BENCH_BUDGET seconds (default 10)."""
    return float(os.environ.get("CRFKIT_BENCH_BUDGET") or REFERENCE_BUDGET_S)


def grid_from_env() -> List[Case]:
    """The pytest grid: quick, or full when CRFKIT_BENCH_FULL=1; CRFKIT_BENCH_LIMIT=N keeps the
    first N cells and CRFKIT_BENCH_OPS=a,b keeps those ops."""
    full = os.environ.get("CRFKIT_BENCH_FULL", "") == "1"
    limit = os.environ.get("CRFKIT_BENCH_LIMIT")
    ops = [o for o in os.environ.get("CRFKIT_BENCH_OPS", "").split(",") if o]
    return grid(full, int(limit) if limit else None, ops or None)


# ---- correctness, with a time budget for the reference ----------------------------------------
def _timed(fn: Callable[[], tuple]) -> Tuple[tuple, float]:
    begin = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - begin


def reference_within_budget(op: str, x: Inputs, budget_s: float) -> Tuple[Optional[tuple], float]:
    """Run the reference on x if its single call should take at most budget_s seconds.

    The reference is a Python loop over positions, so its cost is linear in L: a call on the
    first 16 positions is timed and extrapolated (the probe is repeated before giving up, in
    case another process slowed it down). Returns (result, seconds of the full call), or
    (None, estimated seconds) when over budget.
    """
    L = x.emissions.shape[1]
    probe = min(L, 16)
    if probe == L:
        return _timed(lambda: OPS[op].run(x, "reference"))
    estimate = float("inf")
    for _ in range(2):
        estimate = min(estimate, _timed(lambda: OPS[op].run(x.truncated(probe), "reference"))[1] * L / probe)
        if estimate <= budget_s:
            break
    if estimate > budget_s:
        return None, estimate
    result, seconds = _timed(lambda: OPS[op].run(x, "reference"))
    return result, seconds


@dataclass
class Check:
    """Outcome of the correctness check of one cell.

    status: "ok", "ok (first n of B sentences)", "WRONG...", "ERROR: ..." or "unchecked: ...".
    reference_s: seconds of the one reference call (None when it was over budget, and
    reference_estimate_s then holds the estimate that made it skip).
    """

    status: str
    reference_s: Optional[float] = None
    reference_estimate_s: Optional[float] = None

    @property
    def wrong(self) -> bool:
        """The cell must not be timed."""
        return self.status.startswith(("WRONG", "ERROR"))

    @property
    def reference_skipped(self) -> bool:
        return self.reference_s is None


def check_case(case: Case, budget_s: float = REFERENCE_BUDGET_S) -> Check:
    """Compare the compiled result with the reference on the case's inputs. When the full
    reference call is over budget, compare on the first CHECK_BATCH sentences instead."""
    op, x = OPS[case.op], inputs_for(case)
    try:
        got = op.run(x, "compiled")
        want, ref_s = reference_within_budget(case.op, x, budget_s)
        if want is not None:
            error = op.check(got, want, x)
            return Check(f"WRONG: {error}" if error else "ok", reference_s=ref_s)
        for n in sorted({min(case.B, CHECK_BATCH), 1}, reverse=True):
            want = reference_within_budget(case.op, x.head(n), budget_s)[0] if n < case.B else None
            if want is not None:
                break
        if want is None:
            return Check(f"unchecked: reference too slow (one call ~{ref_s:.2g} s)", reference_estimate_s=ref_s)
        error = op.check(op.run(x.head(n), "compiled"), want, x.head(n))
    except Exception as error:  # a crash is a result of the cell, not a failure of the benchmark
        return Check(f"ERROR: {type(error).__name__}: {error}")
    status = f"WRONG (first {n} of {case.B} sentences): {error}" if error else f"ok (first {n} of {case.B} sentences)"
    return Check(status, reference_estimate_s=ref_s)


def check_against_compiled(case: Case, backend: str) -> str:
    """Compare another backend (numba) with the compiled kernels on the case's inputs: "ok",
    "WRONG: ..." or "ERROR: ..." (the compiled result is itself checked by check_case)."""
    op, x = OPS[case.op], inputs_for(case)
    try:
        error = op.check(op.run(x, backend), op.run(x, "compiled"), x)
    except Exception as error:  # a crash is a result of the cell
        return f"ERROR: {type(error).__name__}: {error}"
    return f"WRONG: {error}" if error else "ok"


def floor_callable_for(case: Case, backend: str) -> Callable[[], tuple]:
    """The same call on one position per sentence, (B, 1, T): what a call costs beyond its
    kernels' work (argument checks, dispatch, output allocation, threads, autograd), the
    "call floor" of the roofline report. The emissions are copied to a dense (B, 1, T) tensor
    so that the call takes the same argument path as the full one."""
    run, x = OPS[case.op].run, inputs_for(case).truncated(1)
    x = Inputs(x.emissions.contiguous(), x.transitions, x.lengths, x.start, x.end, x.k)
    return lambda: run(x, backend)


def callable_for(case: Case, backend: str) -> Callable[[], tuple]:
    """The zero-argument function that is timed: one call of the op on the case's inputs."""
    run, x = OPS[case.op].run, inputs_for(case)
    return lambda: run(x, backend)
