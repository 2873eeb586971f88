"""crfkit's new op arguments and ops against peers, on CPU: sampling, marginals with `allowed` /
a mask with holes, partial log-likelihood, per-example transitions, and the cost of the new
arguments when they are not used.

    python benchmarks/bench_new_ops.py [--quick | --full] [--threads 1] [--out PATH] [--parts a,b]
    python benchmarks/bench_new_ops.py --overhead-only

Parts (--parts picks some; --overhead-only is --parts overhead):
  sample       crfkit.sample with replacement (n = 1, 10, 100) and without (n = 10) against
               torch-struct's LinearChainCRF(...).sample((n,)) (with replacement only).
  marginals    crfkit.marginals(allowed=...) (random partial labels: ~30% of the real positions
               restricted to one or two tags) and crfkit.marginals(mask=...) (a mask with holes:
               ~15% of the real positions masked), against crfkit without the argument (base), the
               same by hand in crfkit (-inf emissions / compacted input) and torch-struct on the
               equivalent potentials (-inf emissions / compacted input).
  partial_nll  crfkit.partial_nll forward and forward + backward against pytorch-partial-crf 0.2.1
               (PartialCRF: its denominator minus its numerator with the same possible-tag mask).
  per_example  crfkit.log_partition forward + backward and crfkit.viterbi with transitions
               (B, T, T) and (B, L, T, T), against torch-struct (per-position potentials), crfkit's
               reference backend and crfkit with the shared (T, T) matrix (context, other inputs).
  overhead     crfkit.log_partition / viterbi / kbest_viterbi(k=5), no_grad, with NO new argument:
               this checkout ("after") against --before-commit (default HEAD, the last commit; once the
               new ops are committed, pass the last commit without them) as "before": a git worktree of
               it in a fresh temp folder (--before-tree), removed afterwards, with this checkout's built
               crfkit/_C.abi3.so and _build_info.py copied in; each in its own subprocess, rounds
               interleaved before, after, before, after, ...; both results must be identical first.
--quick (default) runs every part on its first shapes; --full adds the larger ones (listed in
the output). Inputs: benchmarks/cases.py's seeded inputs (emissions randn*3, transitions / start /
end randn, lengths in [L/2, L] with sentence 0 of length L), float32; the extra tensors (partial
labels, holes, per-example transitions) are seeded by (B, L, T) too.

For every cell, in one process on the same inputs: every contender's result is checked first
(crfkit against its float64 reference or its reference backend, a peer against crfkit; the check
used is written beside it); a contender that disagrees is WRONG and not timed, one that raises is
"failed: ...", one whose single call would exceed --budget seconds is "skipped: too slow".
Timing as benchmarks/bench_peers.py: median of torch.utils.benchmark blocked_autorange
(benchmarks/run.py's median_ms), --rounds interleaved rounds, the smallest round median (a call
over 1 s gets one round). torch-struct cells whose scan is expected to need over --isolate-mb run
in a subprocess under an address-space cap (--mem-cap-gb), so that running out of memory is
"failed: out of memory" instead of taking the machine down. speed-up = peer ms / crfkit ms.

Writes <out>.md and <out>.json (default runs/bench/new_ops; the committed results:
--out benchmarks/results/new_ops). Peers: bash benchmarks/peers/install.sh (torch-struct,
pytorch-partial-crf, with pip --no-deps).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import cases  # noqa: E402  (benchmarks/ is not a package)
import run as core_run  # noqa: E402  (timing and machine helpers of benchmarks/run.py)

import crfkit  # noqa: E402

PARTS = ("sample", "marginals", "partial_nll", "per_example", "overhead")
PART_TITLE = {
    "sample": "1. Sampling",
    "marginals": "2. Marginals with allowed tags / a mask with holes",
    "partial_nll": "3. Partial log-likelihood",
    "per_example": "4. Per-example transitions",
    "overhead": "5. Cost of the new arguments when unused (before / after)",
}
# (B, L, T) per part: --quick runs the first ones, --full all.
SHAPES = {
    "sample": ((32, 128, 9), (1, 128, 9), (256, 32, 37)),
    "marginals": ((32, 128, 9), (1, 128, 9), (256, 32, 37)),
    "partial_nll": ((32, 128, 9), (1, 128, 9), (256, 32, 37)),
    "per_example": ((32, 128, 9), (256, 32, 37)),
    "overhead": ((1, 16, 9), (32, 128, 9)),
}
QUICK_SHAPES = {"sample": 2, "marginals": 2, "partial_nll": 2, "per_example": 1, "overhead": 2}
SAMPLE_DRAWS = ((1, True), (10, True), (100, True), (10, False))  # (n, replacement)
OVERHEAD_OPS = ("log_partition", "viterbi", "kbest")
KBEST_K = 5

RESTRICTED_SHARE = 0.30  # partial labels: share of the real positions restricted to one or two tags
HOLE_SHARE = 0.15  # mask with holes: share of the real positions masked
Z_LIMIT = 5.0  # sampling check: |z| of the marginal test above this is WRONG
Z_MIN_UNITS = 30  # fewer (sentence, draw) units: no marginal test, validity only

BUDGET_S = 10.0
ISOLATE_MB = 256
MEM_CAP_GB = 8.0
CHILD_BASE_GB = 3.0  # address space of a bare torch + crfkit process, added to the cap
RESULT_TAG = "@@bench_new_ops "
BEFORE_PREFIX = "crfkit-before-"  # part 5's worktree: a fresh folder of the temp dir (outside the checkout)

SCORE_TOL, PROB_TOL, COUNT_TOL, TIE_TOL = cases.SCORE_TOL, cases.PROB_TOL, cases.COUNT_TOL, cases.TIE_TOL
REL_TOL = 1e-4  # partial NLL values, peer against crfkit (relative)


class Skip(Exception):
    """A contender declines the cell (reported as "skipped: <why>")."""


# ---- inputs ---------------------------------------------------------------------------------------
def _generator(tag: str, B: int, L: int, T: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"crfkit-new-ops-{tag}-{B}-{L}-{T}".encode()))


_INPUTS: Dict[Tuple[int, int, int], cases.Inputs] = {}


def inputs(B: int, L: int, T: int) -> cases.Inputs:
    if (B, L, T) not in _INPUTS:
        _INPUTS[(B, L, T)] = cases.make_inputs(B, L, T)
    return _INPUTS[(B, L, T)]


def valid_positions(lengths: torch.Tensor, L: int) -> torch.Tensor:
    return torch.arange(L) < lengths[:, None]


def partial_labels(x: cases.Inputs) -> torch.Tensor:
    """allowed (B, L, T) bool: RESTRICTED_SHARE of the real positions allow one random tag (half of
    them) or two distinct random tags (the other half); every other position allows every tag."""
    B, L, T = x.emissions.shape
    gen = _generator("allowed", B, L, T)
    restricted = (torch.rand(B, L, generator=gen) < RESTRICTED_SHARE) & valid_positions(x.lengths, L)
    first = torch.randint(0, T, (B, L), generator=gen)
    second = (first + torch.randint(1, max(T, 2), (B, L), generator=gen)) % T
    two = torch.rand(B, L, generator=gen) < 0.5
    one_hot = torch.nn.functional.one_hot
    chosen = one_hot(first, T).bool() | (one_hot(second, T).bool() & two[..., None])
    return torch.where(restricted[..., None], chosen, torch.ones(B, L, T, dtype=torch.bool))


def holes_mask(x: cases.Inputs) -> torch.Tensor:
    """mask (B, L) bool: the real positions (< lengths) less HOLE_SHARE of them, anywhere."""
    B, L, T = x.emissions.shape
    gen = _generator("holes", B, L, T)
    return valid_positions(x.lengths, L) & (torch.rand(B, L, generator=gen) >= HOLE_SHARE)


def compact_order(mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order (B, L): original position of each compact position, inverse (B, L), lengths (B,))."""
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    return order, torch.argsort(order, dim=1), mask.sum(1)


def per_example_transitions(x: cases.Inputs, kind: str) -> torch.Tensor:
    B, L, T = x.emissions.shape
    gen = _generator(f"transitions-{kind}", B, L, T)
    shape = (B, T, T) if kind == "BTT" else (B, L, T, T)
    return torch.randn(*shape, generator=gen)


# ---- checks ---------------------------------------------------------------------------------------
def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: dict) -> Optional[str]:
    return cases._close(name, got.double(), want.double(), tol)


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want.double()).abs() / want.double().abs().clamp(min=1e-12)).max())


def marginal_z(paths: torch.Tensor, mu: torch.Tensor, lengths: torch.Tensor) -> Tuple[Optional[float], int]:
    """A loose test of sampled paths (B, N, L) against the marginals mu (B, L, T): for each
    (sentence, draw) unit, u = mean over its positions of mu[b, i, y_i]; under exact sampling
    E[u] = mean_i sum_t mu[b, i, t]^2. Units are independent (sentences and draws), so
    z = mean(u - E[u]) / its standard error is about N(0, 1). (z, units); z None below Z_MIN_UNITS."""
    B, N, L = paths.shape
    keep = lengths > 0
    units = int(keep.sum()) * N
    if units < Z_MIN_UNITS:
        return None, units
    valid = valid_positions(lengths, L)
    mu = mu.double()
    p = mu.unsqueeze(1).expand(B, N, L, mu.shape[2]).gather(3, paths.clamp(min=0).unsqueeze(3)).squeeze(3)
    n_pos = lengths.clamp(min=1).double()
    u = (p * valid[:, None]).sum(2) / n_pos[:, None]
    e = ((mu ** 2).sum(2) * valid).sum(1) / n_pos
    d = (u - e[:, None])[keep].flatten()
    se = float(d.std()) / math.sqrt(d.numel())
    return (float(d.mean()) / se if se > 0 else 0.0), units


def check_paths_shape(paths: torch.Tensor, x: cases.Inputs, n: int) -> Optional[str]:
    B, L, T = x.emissions.shape
    if tuple(paths.shape) != (B, n, L) or paths.dtype != torch.long:
        return f"paths have shape {tuple(paths.shape)} {paths.dtype}, expected {(B, n, L)} int64"
    valid = valid_positions(x.lengths, L)[:, None].expand(B, n, L)
    if bool((paths[~valid] != -1).any()):
        return "paths are not -1 at every padded position"
    real = paths[valid]
    if bool(((real < 0) | (real >= T)).any()):
        return f"paths hold tags outside [0, {T}) at real positions"
    return None


def z_note(z: Optional[float], units: int) -> Tuple[Optional[str], str]:
    if z is None:
        return None, f"marginal test not run ({units} units < {Z_MIN_UNITS})"
    note = f"marginal test z = {z:+.2f} over {units} (sentence, draw) units"
    return (f"sampled tags disagree with crfkit.marginals: {note}" if abs(z) > Z_LIMIT else None), note


# ---- contenders -----------------------------------------------------------------------------------
@dataclass
class Contender:
    """make() -> (fn, check): fn() is the timed call; check(fn()) -> (error or None, note).
    make may raise Skip. memory: bytes its largest intermediate is expected to take."""

    make: Callable[[], Tuple[Callable[[], Any], Callable[[Any], Tuple[Optional[str], str]]]]
    memory: int = 0
    role: str = "peer"  # "crfkit" (the base of speed-ups), "crfkit-other", "peer"


def _torch_struct():
    import peers  # benchmarks/peers (benchmarks/ is on sys.path)

    try:
        return peers.load("torch-struct")
    except peers.PeerUnavailable as error:
        raise Skip(f"not installed: {error}") from error


class Lazy:
    """A value computed on first use (crfkit's result a peer is compared with)."""

    def __init__(self, fn):
        self.fn, self.done, self.value = fn, False, None

    def __call__(self):
        if not self.done:
            self.value, self.done = self.fn(), True
        return self.value


def ts_memory(op: str, x: cases.Inputs) -> int:
    B, L, C = x.emissions.shape
    bin_n = 2 ** int(math.ceil(math.log2(max(L - 1, 2))))
    first_level = 4 * B * (bin_n // 2) * C ** 3
    return first_level * {"log_partition": 2, "sample": 32}.get(op, 4)


# -- 1. sampling
def sample_contenders(spec: dict) -> Dict[str, Contender]:
    B, L, T, n, replacement = spec["B"], spec["L"], spec["T"], spec["n"], spec["replacement"]
    x = inputs(B, L, T)
    mu = Lazy(lambda: crfkit.marginals(x.emissions, x.transitions, x.lengths, x.start, x.end))

    def make_crfkit():
        gen = _generator(f"sample-{n}-{replacement}", B, L, T)

        def fn():
            with torch.no_grad():
                return crfkit.sample(x.emissions, x.transitions, n, x.lengths, x.start, x.end,
                                     replacement=replacement, generator=gen)

        def check(out):
            paths, log_probs = out
            error = check_paths_shape(paths, x, n)
            if error:
                return error, "shape / padding / tag range"
            d = [t.double() for t in (x.emissions, x.transitions, x.start, x.end)]
            want = (crfkit.reference.sequence_score(d[0], d[1], paths.clamp(min=0), x.lengths, d[2], d[3])
                    - crfkit.reference.log_partition(d[0], d[1], x.lengths, d[2], d[3])[:, None])
            error = _close("log_probs against float64 sequence_score - log Z", log_probs, want, SCORE_TOL)
            if error:
                return error, "log_probs"
            notes = ["valid paths (shape, -1 padding, tags in range)", "log_probs = float64 score - log Z"]
            if not replacement:
                for b in range(B):
                    rows = {tuple(p.tolist()) for p in paths[b]}
                    if len(rows) < n:
                        return f"sentence {b}: {n - len(rows)} repeated rows without replacement", "distinct rows"
                notes.append("rows distinct")
                paths = paths[:, :1]  # the first draw without replacement is distributed as P
            error, note = z_note(*marginal_z(paths, mu(), x.lengths))
            notes.append(note + ("" if replacement else " (row 0 only)"))
            return error, "; ".join(notes)
        return fn, check

    out = {"crfkit": Contender(make_crfkit, role="crfkit")}
    if not replacement:
        return out

    def make_ts():
        ts = _torch_struct()
        state = ts._setup(x)
        if n > 10:  # one scan pass per 10 draws: estimate from one pass before the whole call
            begin = time.perf_counter()
            ts._dist(state, x.emissions).sample((10,))
            estimate = (time.perf_counter() - begin) * math.ceil(n / 10)
            if estimate > spec["budget"]:
                raise Skip(f"too slow (one call ~{estimate:.3g} s: {math.ceil(n / 10)} passes of "
                           f"{estimate / math.ceil(n / 10):.3g} s)")

        def fn():
            torch.manual_seed(zlib.crc32(f"ts-{B}-{L}-{T}-{n}".encode()))
            return ts._dist(state, x.emissions).sample((n,))

        def check(out):
            edges = out.detach()
            if tuple(edges.shape) != (n, B, L - 1, T, T):
                return f"samples have shape {tuple(edges.shape)}, expected {(n, B, L - 1, T, T)}", "shape"
            tags = ts._tags(edges, x.lengths)  # (n, B, L), -1 padded
            one_hot = torch.nn.functional.one_hot
            real_edge = (torch.arange(L - 1) < (x.lengths - 1)[:, None]).to(edges.dtype)  # (B, L-1)
            rebuilt = (one_hot(tags[..., 1:].clamp(min=0), T)[..., :, None]
                       * one_hot(tags[..., :-1].clamp(min=0), T)[..., None, :]).to(edges.dtype)
            rebuilt = rebuilt * real_edge[None, :, :, None, None]
            if not torch.equal(rebuilt, edges):
                bad = int((rebuilt != edges).flatten(2).any(2).sum())
                return f"{bad} of {n * B} samples are not one tag sequence (edges not one-hot or not chained)", \
                    "edges one-hot and chained"
            notes = ["valid sequences (one-hot edges, chained, zero at padding)"]
            error, note = z_note(*marginal_z(tags.permute(1, 0, 2), mu(), x.lengths))
            notes.append(note)
            return error, "; ".join(notes)
        return fn, check

    out["torch-struct"] = Contender(make_ts, memory=ts_memory("sample", x))
    return out


# -- 2. marginals with allowed / holes
def marginals_contenders(spec: dict) -> Dict[str, Contender]:
    B, L, T, variant = spec["B"], spec["L"], spec["T"], spec["variant"]
    x = inputs(B, L, T)
    e, tr, ln, s, en = x.emissions, x.transitions, x.lengths, x.start, x.end
    if variant == "allowed":
        allowed = partial_labels(x)
        forbidden = ~allowed
        zero_at = forbidden | ~valid_positions(ln, L)[..., None]

        def truth():
            d = [t.double() for t in (e.masked_fill(forbidden, float("-inf")), tr, s, en)]
            return crfkit.reference.marginals(d[0], d[1], ln, d[2], d[3])

        def call():
            return crfkit.marginals(e, tr, ln, s, en, allowed=allowed)

        def by_hand():
            return crfkit.marginals(e.masked_fill(forbidden, float("-inf")), tr, ln, s, en)
        truth_note = "float64 reference on -inf emissions"
    else:
        mask = holes_mask(x)
        order, inverse, ln_c = compact_order(mask)
        L_c = int(ln_c.max())
        zero_at = ~mask[..., None].expand(B, L, T)

        def compact(t):
            return t.gather(1, order[..., None].expand(B, L, T))

        def back(mu_c):  # compact (B, L_c, T) -> original positions, 0 at the holes and padding
            full = torch.nn.functional.pad(mu_c, (0, 0, 0, L - mu_c.shape[1]))
            return full.gather(1, inverse[..., None].expand(B, L, T))

        def truth():
            d = [t.double() for t in (compact(e), tr, s, en)]
            return back(crfkit.reference.marginals(d[0], d[1], ln_c, d[2], d[3]))

        def call():
            return crfkit.marginals(e, tr, None, s, en, mask=mask)

        def by_hand():
            return back(crfkit.marginals(compact(e)[:, :L_c].contiguous(), tr, ln_c, s, en))
        truth_note = "float64 reference on the compacted input"
    want = Lazy(call)
    truth = Lazy(truth)

    def make_crfkit():
        def fn():
            with torch.no_grad():
                return call()

        def check(out):
            if bool((out[zero_at] != 0).any()):
                return "marginals are not 0 at forbidden tags / masked positions", "zeros"
            error = _close("marginals", out, truth(), PROB_TOL)
            return error, f"against the {truth_note}; 0 where forbidden / masked"
        return fn, check

    def make_base():
        def fn():
            with torch.no_grad():
                return crfkit.marginals(e, tr, ln, s, en)
        return fn, lambda out: (None, "the op of benchmarks/bench_peers.py (other inputs: no argument)")

    def make_by_hand():
        def fn():
            with torch.no_grad():
                return by_hand()
        return fn, lambda out: (_close("marginals", out, want(), PROB_TOL), "against crfkit with the argument")

    def make_ts():
        ts = _torch_struct()
        if variant == "allowed":
            state = ts._setup(x)

            def fn():
                with torch.enable_grad():
                    return ts._dist(state, e.masked_fill(forbidden, float("-inf"))).marginals

            def convert(out):
                return ts._marginals_convert(state, out).masked_fill(~valid_positions(ln, L)[..., None], 0)
        else:
            x_c = cases.Inputs(compact(e)[:, :L_c].contiguous(), tr, ln_c, s, en)
            state = ts._setup(x_c)

            def fn():
                with torch.enable_grad():
                    return ts._dist(state, compact(e)[:, :L_c]).marginals

            def convert(out):
                mu_c = ts._marginals_convert(state, out).masked_fill(~valid_positions(ln_c, L_c)[..., None], 0)
                return back(mu_c)

        def check(out):
            return _close("marginals", convert(out), want(), PROB_TOL), "against crfkit with the argument"
        return fn, check

    return {"crfkit": Contender(make_crfkit, role="crfkit"),
            "crfkit base": Contender(make_base, role="crfkit-other"),
            "crfkit by hand": Contender(make_by_hand, role="crfkit-other"),
            "torch-struct": Contender(make_ts, memory=ts_memory("marginals", x))}


# -- 3. partial NLL
def partial_nll_contenders(spec: dict) -> Dict[str, Contender]:
    B, L, T, op = spec["B"], spec["L"], spec["T"], spec["op"]
    x = inputs(B, L, T)
    e, tr, ln, s, en = x.emissions, x.transitions, x.lengths, x.start, x.end
    allowed = partial_labels(x)
    forbidden = ~allowed

    def crfkit_call():
        if op == "fwd":
            with torch.no_grad():
                return (crfkit.partial_nll(e, tr, allowed, ln, s, en),)
        leaves = [t.detach().requires_grad_() for t in (e, tr, s, en)]
        nll = crfkit.partial_nll(leaves[0], leaves[1], allowed, ln, leaves[2], leaves[3])
        return (nll.detach(), *torch.autograd.grad(nll.sum(), leaves))
    want = Lazy(crfkit_call)

    def compare(got, want_, got_label: str, want_label: str) -> Optional[str]:
        if got[0].shape != want_[0].shape:
            return f"NLL: shape {tuple(got[0].shape)} != {tuple(want_[0].shape)}"
        rel = max_rel(got[0], want_[0])
        if not rel <= REL_TOL:
            b = int(((got[0].double() - want_[0].double()).abs() / want_[0].double().abs()).nan_to_num(
                float("inf")).argmax())
            return (f"NLL differs by {rel:.3g} relative (> {REL_TOL:g}); worst sentence {b}: {got_label} "
                    f"{got[0][b].item():.6g}, {want_label} {want_[0][b].item():.6g}")
        if op == "fwd_bwd":
            for name, g, w, tol in zip(("d/d emissions", "d/d transitions", "d/d start", "d/d end"), got[1:],
                                       want_[1:], (PROB_TOL, COUNT_TOL, COUNT_TOL, COUNT_TOL)):
                error = _close(name, g, w, tol)
                if error:
                    return error
        return None

    def make_crfkit():
        def check(out):
            d = [t.double().detach().requires_grad_() for t in (e, tr, s, en)]
            ref = crfkit.reference
            nll = (ref.log_partition(d[0], d[1], ln, d[2], d[3])
                   - ref.log_partition(d[0].masked_fill(forbidden, float("-inf")), d[1], ln, d[2], d[3]))
            truth = (nll.detach(), *torch.autograd.grad(nll.sum(), d)) if op == "fwd_bwd" else (nll.detach(),)
            rel = max_rel(out[0], truth[0])
            return compare(out, truth, "crfkit", "float64 reference"), \
                f"against float64 reference log Z - log Z(-inf emissions) (max rel {rel:.2g})" + \
                (", and its autograd gradients" if op == "fwd_bwd" else "")
        return crfkit_call, check

    def make_peer():
        try:
            from pytorch_partial_crf import PartialCRF
            import pytorch_partial_crf
        except Exception as error:
            raise Skip(f"not installed: import pytorch_partial_crf failed: {type(error).__name__}: {error}")
        del pytorch_partial_crf
        crf = PartialCRF(T)
        with torch.no_grad():
            crf.transitions.copy_(tr)  # [from, to], as crfkit
            crf.start_transitions.copy_(s)
            crf.end_transitions.copy_(en)
        mask = valid_positions(ln, L).to(torch.uint8)
        possible = allowed.to(torch.uint8)
        tags = torch.zeros(B, L, dtype=torch.long)  # its _numerator_score reads only possible_tags
        own = e.clone()  # the peer may write into the emissions it is given (see the notes)
        params = (crf.transitions, crf.start_transitions, crf.end_transitions)

        def nll(emissions):  # PartialCRF.forward's computation, per sentence and with any possible-tag mask
            gold = crf._numerator_score(emissions, tags, mask, possible)
            forward = crf._denominator_score(emissions, mask)
            return forward - gold

        def fn():
            if op == "fwd":
                with torch.no_grad():
                    return (nll(own),)
            leaf = own.detach().requires_grad_()
            value = nll(leaf)
            return (value.detach(), *torch.autograd.grad(value.sum(), (leaf, *params)))

        def check(out):
            got = tuple(t.detach() for t in out)
            rel = max_rel(got[0], want()[0])
            error = compare(got, want(), "peer", "crfkit")
            if error and bool((own != e).any()):
                error += (f" (its numerator wrote -100 into {int((own != e).sum())} emissions of the tensor it "
                          "was given, which its denominator then read)")
            note = f"against crfkit, NLL to {REL_TOL:g} relative (max rel {rel:.2g})" + (
                "; gradients (emissions, transitions, start, end)" if op == "fwd_bwd" else "")
            if not error and op == "fwd" and B > 1:  # its public forward() on what it can express
                single = allowed.sum(2) == 1
                labels = torch.where(single, allowed.to(torch.uint8).argmax(2), -1)
                one_hot_or_all = torch.where(single[..., None], allowed, torch.ones_like(allowed))
                with torch.no_grad():
                    public = float(crf(e.clone(), labels, mask))
                ours = float(crfkit.partial_nll(e, tr, one_hot_or_all, ln, s, en).sum())
                if abs(public - ours) > REL_TOL * abs(ours):
                    return f"its public forward() gives {public:.6g}, crfkit {ours:.6g}", note
                note += f"; its public forward() (tags -1 = unlabeled) agrees ({abs(public - ours) / abs(ours):.1g})"
            return error, note
        return fn, check

    return {"crfkit": Contender(make_crfkit, role="crfkit"), "pytorch-partial-crf": Contender(make_peer)}


# -- 4. per-example transitions
def ts_per_position_potentials(x: cases.Inputs, emissions: torch.Tensor, transitions: torch.Tensor,
                               end_at: torch.Tensor) -> torch.Tensor:
    """torch-struct's edge potentials [b, n, to, from] with transitions (B, T, T) or (B, L, T, T)
    (crfkit's transitions[b, i] scores y_{i-1} -> y_i: edge n uses transitions[b, n + 1])."""
    into = transitions.transpose(-1, -2)[:, None] if transitions.dim() == 3 else transitions[:, 1:].transpose(-1, -2)
    edge = emissions[:, 1:, :, None] + into  # (B, L-1, to, from)
    first = (emissions[:, 0] + x.start)[:, None, None, :]
    edge = torch.cat([edge[:, :1] + first, edge[:, 1:]], dim=1)
    return edge + end_at[:, :, None, None] * x.end[None, None, :, None]


def check_viterbi(got, want, x: cases.Inputs, transitions: torch.Tensor) -> Optional[str]:
    """Scores close; differing paths must tie in float64 (cases._check_viterbi, per-example transitions)."""
    error = _close("viterbi score", got[1], want[1], SCORE_TOL)
    if error:
        return error
    differs = (got[0] != want[0]).any(1)
    if differs.any():
        d = [t.double() for t in (x.emissions[differs], transitions[differs], x.start, x.end)]
        got_s, want_s = (crfkit.reference.sequence_score(d[0], d[1], p[differs].clamp(min=0), x.lengths[differs],
                                                         d[2], d[3]) for p in (got[0], want[0]))
        untied = ~torch.isclose(got_s, want_s, **TIE_TOL)
        if untied.any():
            return f"viterbi paths differ in {int(untied.sum())} of {len(differs)} sentences beyond a float32 tie"
    return None


def independent_float64(x: cases.Inputs, transitions: torch.Tensor, op: str):
    """This script's own float64 forward algorithm (not crfkit's code) with transitions (B, T, T) or
    (B, L, T, T): (log Z, d/d emissions, d/d transitions) by autograd, or the Viterbi scores (max-sum)."""
    B, L, T = x.emissions.shape
    e = x.emissions.double().requires_grad_(op == "fwd_bwd")
    tr = transitions.double().requires_grad_(op == "fwd_bwd")
    reduce = torch.logsumexp if op == "fwd_bwd" else (lambda t, dim: t.max(dim).values)
    with torch.set_grad_enabled(op == "fwd_bwd"):
        alpha = x.start.double() + e[:, 0]
        for i in range(1, L):
            into = tr if tr.dim() == 3 else tr[:, i]
            step = reduce(alpha[:, :, None] + into, 1) + e[:, i]
            alpha = torch.where((i < x.lengths)[:, None], step, alpha)
        total = reduce(alpha + x.end.double(), 1)
    if op == "fwd_bwd":
        return (total.detach(), *torch.autograd.grad(total.sum(), (e, tr)))
    return total


def per_example_contenders(spec: dict) -> Dict[str, Contender]:
    B, L, T, kind, op = spec["B"], spec["L"], spec["T"], spec["transitions"], spec["op"]
    x = inputs(B, L, T)
    e, ln, s, en = x.emissions, x.lengths, x.start, x.end
    tr_pe = per_example_transitions(x, kind)

    def call(backend: str, transitions: torch.Tensor):
        with crfkit.use_backend(backend):
            if op == "viterbi":
                with torch.no_grad():
                    best = crfkit.viterbi(e, transitions, ln, s, en)
                return best.paths, best.scores
            emissions = e.detach().requires_grad_()
            leaf = transitions.detach().requires_grad_()
            log_z = crfkit.log_partition(emissions, leaf, ln, s, en)
            return (log_z.detach(), *torch.autograd.grad(log_z.sum(), (emissions, leaf)))

    prepared = tr_pe if tr_pe.dim() == 4 else tr_pe.unsqueeze(1)  # crfkit._arguments.per_example_form
    spec["ran"] = crfkit.backends.for_transitions(prepared).__name__.rsplit(".", 1)[-1]  # which backend ran
    reference = Lazy(lambda: call("reference", tr_pe))
    compiled = Lazy(lambda: call("compiled", tr_pe))

    def compare(got, want_) -> Optional[str]:
        if op == "viterbi":
            return check_viterbi(got, want_, x, tr_pe)
        return (_close("log Z", got[0], want_[0], SCORE_TOL) or _close("d logZ/d emissions", got[1], want_[1], PROB_TOL)
                or _close("d logZ/d transitions", got[2], want_[2], COUNT_TOL))

    def make(backend, against, note):
        def fn():
            return call(backend, tr_pe)
        return fn, lambda out: (compare(out, against()), note)

    def make_crfkit():
        def check(out):
            truth = independent_float64(x, tr_pe, op)
            if op == "viterbi":
                error = _close("viterbi score against the independent float64 max-sum", out[1], truth, SCORE_TOL)
                rescored = crfkit.reference.sequence_score(e.double(), tr_pe.double(), out[0].clamp(min=0), ln,
                                                           s.double(), en.double())
                error = error or _close("viterbi paths' float64 scores", rescored, truth, SCORE_TOL)
            else:
                error = compare(out, truth)
            error = error or compare(out, reference())
            return error, ("against this script's float64 forward algorithm (max-sum for Viterbi) and crfkit's "
                           "reference backend")
        return (lambda: call("compiled", tr_pe)), check

    def make_shared():
        return (lambda: call("compiled", x.transitions)), \
            lambda out: (None, "context: the same op with the shared (T, T) matrix (other inputs)")

    def make_ts():
        ts = _torch_struct()
        state = ts._setup(x)
        lib, end_at = ts.lib, state["end_at"]
        leaf = tr_pe.detach().clone().requires_grad_()

        def fn():
            if op == "viterbi":
                with torch.enable_grad():
                    return lib.LinearChainCRF(ts_per_position_potentials(x, e, leaf, end_at), lengths=ln).argmax
            emissions = e.detach().requires_grad_()
            log_z = lib.LinearChainCRF(ts_per_position_potentials(x, emissions, leaf, end_at), lengths=ln).partition
            return (log_z.detach(), *torch.autograd.grad(log_z.sum(), (emissions, leaf)))

        def check(out):
            if op == "viterbi":
                with torch.enable_grad():
                    score = lib.LinearChainCRF(ts_per_position_potentials(x, e, leaf, end_at), lengths=ln).max
                out = (ts._tags(out.detach(), ln), score.detach())
            return compare(out, compiled()), "against crfkit (compiled)"
        return fn, check

    return {"crfkit": Contender(make_crfkit, role="crfkit"),
            "crfkit shared (T, T)": Contender(make_shared, role="crfkit-other"),
            "crfkit reference": Contender(lambda: make("reference", compiled, "the base of crfkit's check"),
                                          role="crfkit-other"),
            "torch-struct": Contender(make_ts, memory=ts_memory("log_partition_fwd_bwd" if op == "fwd_bwd"
                                                                else "viterbi", x))}


CONTENDERS = {"sample": sample_contenders, "marginals": marginals_contenders, "partial_nll": partial_nll_contenders,
              "per_example": per_example_contenders}


# ---- the grid -------------------------------------------------------------------------------------
def cells(part: str, full: bool, budget: float, only_shapes: Optional[List[Tuple[int, int, int]]] = None) -> List[dict]:
    shapes = only_shapes or (SHAPES[part] if full else SHAPES[part][:QUICK_SHAPES[part]])
    out = []
    for B, L, T in shapes:
        base = {"part": part, "B": B, "L": L, "T": T, "budget": budget}
        if part == "sample":
            out += [{**base, "n": n, "replacement": rep} for n, rep in SAMPLE_DRAWS]
        elif part == "marginals":
            out += [{**base, "variant": v} for v in ("allowed", "holes")]
        elif part == "partial_nll":
            out += [{**base, "op": op} for op in ("fwd", "fwd_bwd")]
        elif part == "per_example":
            out += [{**base, "transitions": k, "op": op} for k in ("BTT", "BLTT") for op in ("fwd_bwd", "viterbi")]
        elif part == "overhead":
            out += [{**base, "op": op} for op in OVERHEAD_OPS]
    return out


def cell_name(spec: dict) -> str:
    shape = f"({spec['B']}, {spec['L']}, {spec['T']})"
    extra = {k: v for k, v in spec.items() if k not in ("part", "B", "L", "T", "budget", "ran")}
    return f"{spec['part']} {shape} " + " ".join(f"{k}={v}" for k, v in extra.items())


# ---- checking and timing --------------------------------------------------------------------------
def _failure(error: BaseException) -> str:
    text = str(error)
    if isinstance(error, MemoryError) or "can't allocate memory" in text.lower() or "out of memory" in text.lower() \
            or ("alloc" in text.lower() and "bytes" in text.lower()):
        return "failed: out of memory"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"failed: {type(error).__name__}: {first[:200]}"


def check_contender(contender: Contender) -> Tuple[dict, Optional[Callable]]:
    """Run the contender once and check it: ({"status", "note", "single_s"}, fn if ok)."""
    entry: Dict[str, Any] = {"status": None, "note": None, "single_s": None}
    try:
        fn, check = contender.make()
        begin = time.perf_counter()
        out = fn()
        entry["single_s"] = time.perf_counter() - begin
        error, entry["note"] = check(out)
        del out
    except Skip as why:
        entry["status"] = f"skipped: {why}"
        return entry, None
    except Exception as error:  # MemoryError, RuntimeError (a peer's crash), ...
        entry["status"] = _failure(error)
        return entry, None
    if error:
        entry["status"] = f"WRONG: {error}"
        return entry, None
    entry["status"] = "ok"
    return entry, fn


def time_rounds(timers: Dict[str, Tuple[Callable, float]], rounds: int, min_run_time: float):
    out: Dict[str, List[float]] = {name: [] for name in timers}
    load = core_run.OtherLoad().start()
    for r in range(rounds):
        for name, (fn, single_s) in timers.items():
            if r == 0 or single_s < 1.0:
                out[name].append(core_run.median_ms(fn, min_run_time))
    return out, load.stop()


def _cap_address_space(cap_gb: float):
    limit = int((cap_gb + CHILD_BASE_GB) * 2**30)

    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return apply


def run_child(task: dict, cap_gb: float, timeout_s: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", json.dumps(task)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              preexec_fn=_cap_address_space(cap_gb))
    except subprocess.TimeoutExpired:
        return {"status": f"failed: subprocess timed out after {timeout_s:.0f} s"}
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    if proc.returncode < 0:
        return {"status": f"failed: subprocess killed by signal {-proc.returncode}"}
    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
    if "memory" in tail.lower() or "alloc" in tail.lower():
        return {"status": "failed: out of memory"}
    return {"status": f"failed: subprocess exited {proc.returncode}: {tail[:200]}"}


def child(task: dict) -> dict:
    torch.set_num_threads(task["threads"])
    contender = CONTENDERS[task["spec"]["part"]](task["spec"])[task["name"]]
    entry, fn = check_contender(contender)
    entry["rounds_ms"], entry["other_load"] = [], None
    if fn is not None and task["rounds"]:
        medians, entry["other_load"] = time_rounds({"x": (fn, entry["single_s"])}, task["rounds"],
                                                   task["min_run_time"])
        entry["rounds_ms"] = medians["x"]
    return entry


def run_cell(spec: dict, args) -> dict:
    contenders = CONTENDERS[spec["part"]](spec)
    row: Dict[str, Any] = {**spec, "name": cell_name(spec), "entries": {}, "other_load": None}
    timers: Dict[str, Tuple[Callable, float]] = {}
    for name, contender in contenders.items():
        entry: Dict[str, Any] = {"role": contender.role, "isolated": False, "rounds_ms": [], "ms": None}
        row["entries"][name] = entry
        if contender.memory > args.isolate_mb * 2**20:
            entry["isolated"] = True
            task = {"spec": spec, "name": name, "threads": torch.get_num_threads(), "rounds": args.rounds,
                    "min_run_time": args.min_run_time}
            entry.update(run_child(task, args.mem_cap_gb, timeout_s=max(300.0, 30 * args.budget)))
            continue
        result, fn = check_contender(contender)
        entry.update(result)
        if fn is not None:
            timers[name] = (fn, result["single_s"])
    medians, row["other_load"] = time_rounds(timers, args.rounds, args.min_run_time)
    for name, values in medians.items():
        row["entries"][name]["rounds_ms"] = values
    for entry in row["entries"].values():
        if entry["rounds_ms"]:
            entry["ms"] = min(entry["rounds_ms"])
    base = row["entries"]["crfkit"]["ms"]
    for entry in row["entries"].values():
        entry["speedup"] = entry["ms"] / base if entry["ms"] and base else None
    timers.clear()
    return row


# ---- 5. before / after ---------------------------------------------------------------------------
def _overhead_fn(op: str, x: cases.Inputs):
    e, tr, ln, s, en = x.emissions, x.transitions, x.lengths, x.start, x.end
    if op == "log_partition":
        def fn():
            with torch.no_grad():
                return (crfkit.log_partition(e, tr, ln, s, en),)
    elif op == "viterbi":
        def fn():
            with torch.no_grad():
                return tuple(crfkit.viterbi(e, tr, ln, s, en))
    else:
        def fn():
            with torch.no_grad():
                return tuple(crfkit.kbest_viterbi(e, tr, KBEST_K, ln, s, en))
    return fn


def overhead_worker(threads: int) -> int:
    """A subprocess of part 5: answers JSON requests on stdin ("result" / "time" of one cell)."""
    torch.set_num_threads(threads)
    hello = {"crfkit_file": crfkit.__file__, "crfkit_version": crfkit.__version__,
             "backend_info": {k: (list(v) if isinstance(v, tuple) else v) for k, v in crfkit.backend_info().items()},
             "has_new_ops": hasattr(crfkit, "partial_nll"), "torch_threads": torch.get_num_threads()}
    print(RESULT_TAG + json.dumps(hello), flush=True)
    fns: Dict[str, Callable] = {}
    for line in sys.stdin:
        request = json.loads(line)
        if request["cmd"] == "quit":
            break
        key = f"{request['op']}-{request['B']}-{request['L']}-{request['T']}"
        if key not in fns:
            fns[key] = _overhead_fn(request["op"], cases.make_inputs(request["B"], request["L"], request["T"]))
        if request["cmd"] == "result":
            reply = {"result": [t.tolist() for t in fns[key]()]}
        else:
            reply = {"ms": core_run.median_ms(fns[key], request["min_run_time"])}
        print(RESULT_TAG + json.dumps(reply), flush=True)
    return 0


class Worker:
    def __init__(self, tree: Path, threads: int):
        env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads))
        self.tree = tree
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--_worker", str(threads)],
                                     cwd=str(tree), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.hello = self._read()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT_TAG):
                return json.loads(line[len(RESULT_TAG):])
        raise RuntimeError(f"the worker in {self.tree} exited ({self.proc.wait()}) without answering")

    def ask(self, **request) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class OtherLoadBesides(core_run.OtherLoad):
    """core_run.OtherLoad that also counts the CPU time of the given subprocesses (the workers)
    as this benchmark's own, not as other processes'."""

    def __init__(self, pids: List[int]):
        self.pids = pids

    def _sample(self):
        sample = core_run.OtherLoad._sample()
        if sample is None:
            return None
        busy, own, now = sample
        tick = os.sysconf("SC_CLK_TCK")
        for pid in self.pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                own += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            except (OSError, ValueError, IndexError):
                return None
        return busy, own, now


def _git(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True, check=check)


def make_before_tree(path: Path, commit: str = "HEAD") -> str:
    """A git worktree of `commit` at path (outside the checkout), with this checkout's built extension.
    path may be an empty folder (the fresh temp folder of the default); an existing worktree of this
    checkout there is replaced."""
    if path.exists() and any(path.iterdir()):
        listed = _git("worktree", "list", "--porcelain").stdout
        if f"worktree {path}\n" not in listed + "\n":
            raise RuntimeError(f"{path} exists and is not a worktree of {ROOT}: remove it or pass --before-tree")
        remove_before_tree(path)
    _git("worktree", "add", "--detach", str(path), commit)
    for name in ("_C.abi3.so", "_build_info.py"):
        if (ROOT / "crfkit" / name).exists():
            shutil.copy2(ROOT / "crfkit" / name, path / "crfkit" / name)
    return _git("-C", str(path), "rev-parse", "--short", "HEAD").stdout.strip()


def remove_before_tree(path: Path) -> None:
    if _git("worktree", "remove", str(path), check=False).returncode != 0:
        _git("worktree", "remove", "--force", str(path), check=False)


def _same(a, b) -> Optional[str]:
    ta = [torch.tensor(v) for v in a]
    tb = [torch.tensor(v) for v in b]
    for i, (x, y) in enumerate(zip(ta, tb)):
        if x.shape != y.shape:
            return f"output {i}: shape {tuple(x.shape)} != {tuple(y.shape)}"
        if not torch.equal(x, y):
            if x.is_floating_point():
                return f"output {i}: max |difference| {float((x - y).abs().nan_to_num(float('inf')).max()):.3g}"
            return f"output {i}: {int((x != y).sum())} values differ"
    return None


def run_overhead(specs: List[dict], args) -> Tuple[List[dict], dict]:
    # a fresh folder by default, so that two runs at once cannot remove each other's tree
    tree = Path(args.before_tree) if args.before_tree else Path(tempfile.mkdtemp(prefix=BEFORE_PREFIX))
    try:
        before_commit = make_before_tree(tree, args.before_commit)
    except Exception:
        if not args.before_tree and tree.exists() and not any(tree.iterdir()):
            tree.rmdir()
        raise
    info: Dict[str, Any] = {"before_tree": str(tree), "before_commit": before_commit,
                            "before_rev": args.before_commit}
    workers: Dict[str, Worker] = {}
    rows = []
    try:
        workers["before"] = Worker(tree, torch.get_num_threads())
        workers["after"] = Worker(ROOT, torch.get_num_threads())
        for label, worker in workers.items():
            info[label] = worker.hello
            expected = (tree if label == "before" else ROOT) / "crfkit" / "__init__.py"
            if Path(worker.hello["crfkit_file"]).resolve() != expected.resolve():
                raise RuntimeError(f"the {label} worker imported {worker.hello['crfkit_file']}, not {expected}")
        for spec in specs:
            request = {"op": spec["op"], "B": spec["B"], "L": spec["L"], "T": spec["T"]}
            row: Dict[str, Any] = {**spec, "name": cell_name(spec), "before_rounds_ms": [], "after_rounds_ms": []}
            difference = _same(workers["before"].ask(cmd="result", **request)["result"],
                               workers["after"].ask(cmd="result", **request)["result"])
            row["status"] = f"WRONG: before and after differ: {difference}" if difference else "ok (identical results)"
            if not difference:
                load = OtherLoadBesides([w.proc.pid for w in workers.values()]).start()
                for _ in range(args.overhead_rounds):
                    for label in ("before", "after"):
                        row[f"{label}_rounds_ms"].append(workers[label].ask(
                            cmd="time", min_run_time=args.overhead_min_run_time, **request)["ms"])
                row["other_load"] = load.stop()
            for label in ("before", "after"):
                row[f"{label}_ms"] = min(row[f"{label}_rounds_ms"]) if row[f"{label}_rounds_ms"] else None
            row["ratio"] = row["after_ms"] / row["before_ms"] if row["before_ms"] else None
            rows.append(row)
            print(f"[overhead] {row['name']}: before {core_run._ms(row['before_ms'])} ms, after "
                  f"{core_run._ms(row['after_ms'])} ms, ratio {row['ratio'] and round(row['ratio'], 3)} | "
                  f"{row['status']}", file=sys.stderr, flush=True)
    finally:
        for worker in workers.values():
            worker.close()
        remove_before_tree(tree)
    info["before_tree_removed"] = not tree.exists()
    return rows, info


# ---- report ---------------------------------------------------------------------------------------
def _ms(x: Optional[float]) -> str:
    return core_run._ms(x)


def _short(status: Optional[str]) -> str:
    if status is None:
        return "-"
    for prefix, text in (("WRONG", "WRONG"), ("skipped: too slow", "too slow"), ("skipped: not installed",
                         "not installed"), ("skipped", "skipped"), ("failed: out of memory", "OOM"),
                         ("failed", "failed")):
        if status.startswith(prefix):
            return text
    return status


def _cell(entry: Optional[dict]) -> str:
    if entry is None:
        return "-"
    if entry["status"] == "ok":
        return _ms(entry["ms"]) if entry["ms"] is not None else "ok (untimed)"
    return _short(entry["status"])


def _speedup(row: dict, name: str) -> str:
    entry = row["entries"].get(name)
    return f"{entry['speedup']:.1f}x" if entry and entry.get("speedup") else "-"


def _load(row: dict) -> str:
    return "-" if row.get("other_load") is None else f"{100 * row['other_load']:.0f}%"


def _shape(row: dict) -> str:
    return f"({row['B']}, {row['L']}, {row['T']})"


def part_table(part: str, rows: List[dict]) -> List[str]:
    table = core_run._table
    if part == "sample":
        body = [[_shape(r), str(r["n"]), "yes" if r["replacement"] else "no", _cell(r["entries"]["crfkit"]),
                 _cell(r["entries"].get("torch-struct")) if r["replacement"] else "n/a (with replacement only)",
                 _speedup(r, "torch-struct"), _load(r)] for r in rows]
        return table(["(B, L, T)", "n", "replacement", "crfkit ms", "torch-struct ms", "speed-up", "others' CPU"],
                     body)
    if part == "marginals":
        body = []
        for r in rows:
            e = r["entries"]
            base, ours = e["crfkit base"]["ms"], e["crfkit"]["ms"]
            body.append([_shape(r), "allowed=" if r["variant"] == "allowed" else "mask= (holes)", _cell(e["crfkit"]),
                         _cell(e["crfkit base"]), f"{ours / base:.2f}" if ours and base else "-",
                         _cell(e["crfkit by hand"]), _cell(e["torch-struct"]), _speedup(r, "torch-struct"),
                         _load(r)])
        return table(["(B, L, T)", "argument", "crfkit ms", "crfkit base ms", "crfkit / base", "crfkit by hand ms",
                      "torch-struct ms", "speed-up", "others' CPU"], body)
    if part == "partial_nll":
        body = [[_shape(r), "forward" if r["op"] == "fwd" else "forward + backward", _cell(r["entries"]["crfkit"]),
                 _cell(r["entries"]["pytorch-partial-crf"]), _speedup(r, "pytorch-partial-crf"), _load(r)]
                for r in rows]
        return table(["(B, L, T)", "op", "crfkit ms", "pytorch-partial-crf ms", "speed-up", "others' CPU"], body)
    if part == "per_example":
        body = [[_shape(r), "(B, T, T)" if r["transitions"] == "BTT" else "(B, L, T, T)",
                 "log Z fwd+bwd" if r["op"] == "fwd_bwd" else "Viterbi", r.get("ran", "?"),
                 _cell(r["entries"]["crfkit"]),
                 _cell(r["entries"]["crfkit shared (T, T)"]), _cell(r["entries"]["crfkit reference"]),
                 _speedup(r, "crfkit reference"), _cell(r["entries"]["torch-struct"]), _speedup(r, "torch-struct"),
                 _load(r)] for r in rows]
        return table(["(B, L, T)", "transitions", "op", "backend that ran", "crfkit ms", "crfkit shared (T, T) ms",
                      "crfkit reference ms", "vs reference", "torch-struct ms", "speed-up vs torch-struct",
                      "others' CPU"], body)
    body = [[{"kbest": f"kbest_viterbi k={KBEST_K}"}.get(r["op"], r["op"]), _shape(r), _ms(r["before_ms"]),
             _ms(r["after_ms"]), f"{r['ratio']:.3f}" if r["ratio"] else "-",
             " / ".join(_ms(v) for v in r["before_rounds_ms"]), " / ".join(_ms(v) for v in r["after_rounds_ms"]),
             _load(r), r["status"]] for r in rows]
    return table(["op (no_grad)", "(B, L, T)", "before ms", "after ms", "after / before", "before rounds",
                  "after rounds", "others' CPU", "results"], body)


PART_NOTES = {
    "sample": (
        "crfkit: `crfkit.sample(emissions, transitions, n, lengths, start, end, replacement=..., generator=g)` "
        "under no_grad (paths and log_probs). torch-struct: `LinearChainCRF(potentials, lengths).sample((n,))` "
        "(potentials built inside the timed call, as in benchmarks/peers/torch_struct_peer.py); it samples with "
        "replacement only, by autograd through its parallel scan (MultiSampledSemiring: one scan and backward per 10 "
        "draws), and returns one-hot edges (n, B, L-1, T, T), converted to tags untimed. Checks: crfkit's paths "
        "valid (shape, -1 padding, tags in range), its log_probs equal to the float64 sequence_score - log Z, rows "
        "distinct without replacement; torch-struct's samples valid tag sequences (one-hot, chained edges, zero at "
        "padding); both: a marginal test of the sampled tags against crfkit.marginals where there are at least "
        f"{Z_MIN_UNITS} (sentence, draw) units (z = standardised mean of mu[b, i, y_i] minus its expectation "
        f"sum_t mu[b, i, t]^2; WRONG beyond |z| > {Z_LIMIT:g}; without replacement on row 0, which is an exact "
        "draw from P). The test column of 'Checks' gives z."),
    "marginals": (
        "crfkit: `crfkit.marginals(..., allowed=allowed)` (RESTRICTED_SHARE = 30% of the real positions "
        "restricted to one random tag or two) or `crfkit.marginals(emissions, transitions, None, start, end, "
        "mask=mask)` (15% of the real positions masked, anywhere). crfkit base: `crfkit.marginals` of the same "
        "emissions with lengths and no argument (crfkit / base = the argument's cost). crfkit by hand: the same "
        "without the argument: -inf emissions (`masked_fill` in the timed call), or the real positions gathered to "
        "the front, lengths = mask.sum(1), and the marginals gathered back (in the timed call). torch-struct: its "
        "marginals on -inf emissions (it handles -inf: no NaN) or on the compacted input (compaction in the timed "
        "call, edge-to-tag conversion and moving back untimed). crfkit is checked against the float64 reference on "
        "the equivalent input, and 0 at forbidden tags / holes; the others against crfkit."),
    "partial_nll": (
        "crfkit: `crfkit.partial_nll(emissions, transitions, allowed, lengths, start, end)` (B,), under no_grad "
        "(forward) or with autograd.grad of its sum w.r.t. emissions, transitions, start and end (forward + "
        "backward). pytorch-partial-crf 0.2.1: `PartialCRF(T)` with transitions [from, to], start_transitions, "
        "end_transitions set to crfkit's, a uint8 mask from lengths, and the possible-tag mask allowed.to(uint8): "
        "the timed call is what its forward() computes, `_denominator_score(e, mask) - _numerator_score(e, tags, "
        "mask, possible)`, per sentence (its forward() returns the batch sum and builds the possible-tag mask "
        "from tags, -1 = unlabeled: one tag or all, so it cannot express the two-tag positions; the check also "
        "compares its public forward() with crfkit on the one-tag / unlabeled part). It forbids with a score of -100 "
        "(IMPOSSIBLE_SCORE), not -inf. The peer gets its own copy of the emissions (see 'Peer conventions')."),
    "per_example": (
        "crfkit: `crfkit.log_partition` (autograd.grad of log Z.sum() w.r.t. emissions and the per-example "
        "transitions) and `crfkit.viterbi` (no_grad) with transitions (B, T, T) or (B, L, T, T) (transitions[b, i] "
        "scores y_{i-1} -> y_i), compiled backend; crfkit reference: the same under "
        "`crfkit.use_backend(\"reference\")` (vs reference = reference ms / crfkit ms); crfkit shared (T, T): the "
        "same op with the shared matrix, for context (other inputs). torch-struct: its log_potentials are per "
        "position already: edge[b, n, to, from] = transitions[b, n+1, from, to] + emissions[b, n+1, to] (+ start and "
        "the first emission on edge 0, end on each sentence's last edge), built inside the timed call; Viterbi by "
        ".argmax (its score .max untimed). Checks: crfkit against this script's own float64 forward algorithm "
        "(independent_float64: log Z and its autograd gradients, or the max-sum Viterbi score, which the returned "
        "paths must also score) and against its reference backend; torch-struct against crfkit "
        "(benchmarks/cases.py's tolerances; differing Viterbi paths must tie in float64). 'backend that "
        "ran': crfkit.backends.for_transitions of the prepared transitions under the default (compiled) backend "
        "(crfkit/backends/compiled.py's PER_EXAMPLE_DEVICES says where its kernels take per-example transitions; "
        "elsewhere the reference runs them)."),
    "overhead": (
        "One call of `crfkit.log_partition` / `crfkit.viterbi` / `crfkit.kbest_viterbi(k=5)` under no_grad with "
        "lengths, start and end and no new argument, in two subprocesses: 'before' imports crfkit from a git "
        "worktree of --before-commit (see the line below) with this checkout's built extension copied in, "
        "'after' from this checkout (each worker's crfkit.__file__ is verified). The two results must be "
        "identical before timing. "
        "Rounds interleaved (before, after, before, after, ...), each a blocked_autorange median; the smallest "
        "round median is reported, the rounds beside it."),
}

PEER_CONVENTIONS = [
    "torch-struct 0.5: potentials (B, N-1, C, C) indexed [to, from] with emissions, start and end folded in "
    "(benchmarks/peers/torch_struct_peer.py); no start / end parameters, no generator argument (samples from "
    "torch's global generator); sampling only with replacement, via one-hot edge 'gradients' of its scan, 10 draws "
    "per scan pass (16 bits per float, 10 used); its parallel scan broadcasts to B * L/2 * C^3 floats (times 16 "
    "for sampling), so large T runs out of memory.",
    "torch-struct with a mask with holes: it takes only left-aligned lengths, so the input is compacted first "
    "(what crfkit's mask= does inside); sentences of length 1 cannot be represented.",
    "pytorch-partial-crf 0.2.1 declares torch < 2 (installed with --no-deps) and runs under torch "
    f"{torch.__version__}. Conventions: transitions [from, to], start_transitions, end_transitions (as crfkit); "
    "mask (B, L) uint8, left-aligned (its numerator reads the end score at mask.sum() - 1); unlabeled positions are "
    "tag -1 (all tags possible), otherwise one tag; forbidden tags get -100, not -inf, so a forbidden tag keeps a "
    "weight of about e^-100 (far below float32 resolution here); forward() returns the sum over the batch. "
    "Its _numerator_score writes -100 in place into `emissions.transpose(0, 1).contiguous()`, which for B = 1 is "
    "the caller's own tensor (contiguous() returns it): the denominator then reads the modified emissions (the "
    "NLL comes out near 0), and with emissions that require grad (a leaf) it raises 'a view of a leaf Variable that "
    "requires grad is being used in an in-place operation'. For B > 1 the transpose is copied and the caller's "
    "emissions are untouched.",
]


def markdown(env: dict, rows: Dict[str, List[dict]], overhead_info: Optional[dict], args) -> str:
    m = env["machine"]
    info = env["backend_info"]
    lines = ["# crfkit's new ops and arguments against peers, on CPU", ""]
    lines += [f"- command: `{env['command']}`",
              f"- date: {env['date']}; crfkit {env['crfkit']} (git {env['crfkit_git']})",
              f"- machine: {m['cpu']}, {m['nproc']} CPUs ({m['nproc_available']} available); torch {env['torch']}, "
              f"python {env['python']}, torch threads {m['torch_num_threads']}",
              f"- load average (1, 5, 15 min): {core_run._load(m['load_average_at_start'])} at start, "
              f"{core_run._load(m['load_average_at_end'])} at end",
              f"- crfkit backend: {info.get('backend')}, cpu_isa: {info.get('cpu_isa')}",
              f"- timing: median of blocked_autorange (min_run_time {args.min_run_time} s), the smallest of "
              f"{args.rounds} interleaved rounds (part 5: {args.overhead_rounds} rounds of min_run_time "
              f"{args.overhead_min_run_time} s); others' CPU: share of the "
              "machine's CPU time other processes used while the cell was timed (over ~10%: unreliable).",
              f"- grid: {env['grid']}; speed-up = peer ms / crfkit ms; ms of one call.",
              ""]
    busy = [r for part_rows in rows.values() for r in part_rows if (r.get("other_load") or 0) > core_run.BUSY]
    if busy:
        n_rows = sum(len(v) for v in rows.values())
        lines += [f"**Other processes used more than {core_run.BUSY:.0%} of the CPUs during {len(busy)} of {n_rows} "
                  "cells: those timings are unreliable.**", ""]
    for part in PARTS:
        if part not in rows:
            continue
        lines += [f"## {PART_TITLE[part]}", "", PART_NOTES[part], ""]
        if part == "overhead" and overhead_info and "error" in overhead_info:
            lines += [f"**Not run: {overhead_info['error']}**", ""]
        elif part == "overhead" and overhead_info:
            b, a = overhead_info.get("before", {}), overhead_info.get("after", {})
            if b.get("has_new_ops"):
                lines += [f"**Warning: the 'before' crfkit (commit {overhead_info['before_commit']}, from "
                          f"--before-commit {overhead_info.get('before_rev')}) already has the new ops "
                          "(crfkit.partial_nll): this table does not measure their cost. Rerun with --before-commit "
                          "set to the last commit without them.**", ""]
            lines += [f"before: commit {overhead_info['before_commit']} ({b.get('crfkit_file')}, backend "
                      f"{b.get('backend_info', {}).get('backend')}, new ops present: {b.get('has_new_ops')}); after: "
                      f"{env['crfkit_git']} ({a.get('crfkit_file')}, backend "
                      f"{a.get('backend_info', {}).get('backend')}, new ops present: {a.get('has_new_ops')}). "
                      f"Worktree {overhead_info['before_tree']} removed "
                      f"afterwards: {overhead_info.get('before_tree_removed')}.", ""]
        lines += part_table(part, rows[part]) + [""]
    lines += ["## Checks", "", "Every contender of every cell: its status and the check it passed (or why not).", ""]
    for part in PARTS:
        for r in rows.get(part, []):
            if part == "overhead":
                lines.append(f"- {r['name']}: {r['status']}")
                continue
            for name, e in r["entries"].items():
                text = e["status"] if e["status"] != "ok" else "ok"
                lines.append(f"- {r['name']}, {name}: {text}" + (f" ({e['note']})" if e.get("note") else ""))
    problems = [f"- {r['name']}, {name}: {e['status']}" for part in PARTS for r in rows.get(part, []) if part !=
                "overhead" for name, e in r["entries"].items() if e["status"].startswith(("WRONG", "failed"))]
    problems += [f"- {r['name']}: {r['status']}" for r in rows.get("overhead", []) if r["status"].startswith("WRONG")]
    crfkit_wrong = [r["name"] + ", " + name for part in PARTS if part != "overhead" for r in rows.get(part, [])
                    for name, e in r["entries"].items() if e["role"] != "peer" and e["status"] != "ok"]
    crfkit_wrong += [r["name"] for r in rows.get("overhead", []) if not r["status"].startswith("ok")]
    lines += ["", "## Disagreements and failures", ""]
    lines += problems or ["- none: every contender agreed where it ran."]
    lines += ["", f"crfkit's own results (crfkit, its by-hand and reference variants, before / after): "
              f"{len(crfkit_wrong)} not ok" + (": " + "; ".join(crfkit_wrong) if crfkit_wrong else "") + ".", ""]
    lines += ["## Peer conventions", ""] + [f"- {text}" for text in PEER_CONVENTIONS] + [""]
    versions = env.get("peer_versions", {})
    if versions:
        lines += ["Installed: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".", ""]
    return "\n".join(lines) + "\n"


def peer_versions() -> Dict[str, str]:
    import importlib.metadata

    out = {}
    for dist in ("torch-struct", "pytorch-partial-crf"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the first shapes of each part (default)")
    mode.add_argument("--full", action="store_true", help="every shape: " + "; ".join(
        f"{p} {', '.join(map(str, s))}" for p, s in SHAPES.items()))
    parser.add_argument("--parts", help="comma-separated parts to run (default: all): " + ", ".join(PARTS))
    parser.add_argument("--overhead-only", action="store_true", help="part 5 alone (= --parts overhead)")
    parser.add_argument("--shapes", help="run these shapes in every part instead of the grid's, e.g. 8x16x5,1x16x5 "
                        "(B x L x T)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default %(default)s)")
    parser.add_argument("--out", help="output path without extension (default runs/bench/new_ops; "
                        "--out benchmarks/results/new_ops updates the committed results)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (default %(default)s)")
    parser.add_argument("--overhead-rounds", type=int, default=10,
                        help="interleaved before / after rounds of part 5 (default %(default)s)")
    parser.add_argument("--overhead-min-run-time", type=float, default=0.2,
                        help="blocked_autorange min_run_time of part 5 (s): shorter rounds, more of them, so that "
                        "the smallest round median is less often one disturbed by other processes")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="blocked_autorange min_run_time (s)")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help="skip a peer whose single call would exceed this many seconds (default %(default)s)")
    parser.add_argument("--isolate-mb", type=int, default=ISOLATE_MB,
                        help="run torch-struct cells expected to need more in a capped subprocess")
    parser.add_argument("--mem-cap-gb", type=float, default=MEM_CAP_GB,
                        help="address-space cap of that subprocess (+%g GiB for the process)" % CHILD_BASE_GB)
    parser.add_argument("--before-commit", default="HEAD",
                        help="the commit part 5 times as 'before' (default %(default)s: the last commit; once the "
                        "new ops are committed, the last commit without them)")
    parser.add_argument("--before-tree", help="where part 5 puts the git worktree of --before-commit (default: a "
                        f"fresh folder {BEFORE_PREFIX}* of the temp dir; removed afterwards)")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv[1:])

    if args._worker is not None:
        return overhead_worker(args._worker)
    if args._child:
        task = json.loads(args._child)
        try:
            result = child(task)
        except Exception as error:
            result = {"status": _failure(error)}
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0

    torch.set_num_threads(args.threads)
    parts = ["overhead"] if args.overhead_only else (args.parts.split(",") if args.parts else list(PARTS))
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    out = Path(args.out) if args.out else ROOT / "runs" / "bench" / "new_ops"
    only = core_run._parse_shapes(args.shapes) if args.shapes else None
    env = core_run.environment(argv)
    env["peer_versions"] = peer_versions()
    rows: Dict[str, List[dict]] = {}
    overhead_info = None
    for part in PARTS:
        if part not in parts:
            continue
        specs = cells(part, args.full, args.budget, only)
        if part == "overhead":
            try:
                rows[part], overhead_info = run_overhead(specs, args)
            except Exception as error:  # the before tree could not be made or imported: say so, keep the rest
                rows[part], overhead_info = [], {"error": f"{type(error).__name__}: {error}"}
                print(f"[overhead] failed: {overhead_info['error']}", file=sys.stderr, flush=True)
            continue
        rows[part] = []
        for i, spec in enumerate(specs, 1):
            row = run_cell(spec, args)
            rows[part].append(row)
            text = ", ".join(f"{n} {_cell(e)}" for n, e in row["entries"].items())
            print(f"[{part} {i}/{len(specs)}] {row['name']}: {text} | others {_load(row)}", file=sys.stderr,
                  flush=True)
            for n, e in row["entries"].items():
                if e["status"] != "ok":
                    print(f"    {n}: {e['status']}", file=sys.stderr, flush=True)
    env["machine"]["load_average_at_end"] = list(os.getloadavg())
    env.update(min_run_time=args.min_run_time, rounds=args.rounds, overhead_rounds=args.overhead_rounds,
               overhead_min_run_time=args.overhead_min_run_time,
               budget_s=args.budget, grid=f"shapes {args.shapes}" if args.shapes else "full" if args.full else "quick",
               parts=parts)
    text = markdown(env, rows, overhead_info, args)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.md").write_text(text)
    Path(f"{out}.json").write_text(json.dumps({**env, "overhead": overhead_info, "parts": rows}, indent=2) + "\n")
    print(text)
    print(f"wrote {out}.md, {out}.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
