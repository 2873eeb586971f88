"""The numba backend: crfkit's CPU kernels written in Python and compiled by numba
(crfkit/backends/numba_kernels.py), for when the C++ extension is not built.

The contract of every backend (crfkit.backends.CRFBackend), with the same results as the
others: log Z, marginals and their gradients to rounding, Viterbi / k-best paths and scores bit
for bit, with the same tie rule. Five ops have numba kernels; the expected transition counts
are the reference's (see the end of this module). Inputs arrive validated by
crfkit._arguments.prepare (contiguous CPU tensors, float32 or float64, start / end given,
lengths int64). Each op is a torch.autograd.Function around a numba kernel:

- log Z: the forward kernel keeps its normalised alpha rows when a gradient will be needed, and
  the backward kernel runs the backward pass over them (marginals, pairwise marginals, first /
  last position marginals, weighted by grad_output). Higher-order derivatives (create_graph)
  and the derivative of the marginals go through crfkit.reference, as in the compiled backend.
- Viterbi / k-best / sequence scores: the gradient is a scatter of ones at the emissions,
  transitions, start and end each path uses (one numba kernel for the three).

The kernels are serial numba functions that release the GIL; a call splits the batch over
torch.get_num_threads() threads (a small thread pool, see _call_over_batch), like the compiled
backend's at::parallel_for. Importing this module raises ImportError when numba is missing. The kernels
are compiled on first use (the exact decoding kernels once per dtype, the others once: they
compute in float64) and cached on disk (numba's cache=True, in __pycache__).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from .. import reference
from . import numba_kernels as kernels

_PARAMETER_ERRORS = {
    1: "crfkit: transitions contains NaN or +inf (use -inf to forbid a transition)",
    2: "crfkit: start contains NaN or +inf (use -inf to forbid a first tag)",
    3: "crfkit: end contains NaN or +inf (use -inf to forbid a last tag)",
}


# Below this much work (roughly B * L * T * T elementary steps) a call runs on the calling thread
# alone: handing work to another thread costs some tens of microseconds.
_PARALLEL_MIN_WORK = 1 << 16
_pool = None
_pool_pid = None
_pool_lock = threading.Lock()


def _workers(count: int) -> ThreadPoolExecutor:
    """A pool of at least `count` threads, created on first use (and again in a forked child,
    which inherits the pool object but not its threads)."""
    global _pool, _pool_pid
    with _pool_lock:
        forked = _pool_pid != os.getpid()
        if _pool is None or forked or _pool._max_workers < count:
            if _pool is not None and not forked:
                _pool.shutdown(wait=False)  # queued work still runs; its threads then exit
            _pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="crfkit-numba")
            _pool_pid = os.getpid()
        return _pool


def _call_over_batch(kernel, *args, batch: int, work: int) -> None:
    """kernel(*args, first, step) over the batch, split across torch.get_num_threads() threads
    (the kernels release the GIL): thread j takes sentences j, j + step, j + 2 step, ..., which
    balances ragged lengths. Idle threads sleep; nothing spin-waits."""
    threads = min(torch.get_num_threads(), batch)
    if threads <= 1 or work < _PARALLEL_MIN_WORK:
        kernel(*args, 0, 1)
        return
    futures = [_workers(threads - 1).submit(kernel, *args, first, threads) for first in range(1, threads)]
    try:
        kernel(*args, 0, threads)
    finally:
        for future in futures:
            future.result()


def _np(x: Tensor) -> np.ndarray:
    """A NumPy view (no copy) of a contiguous CPU tensor."""
    return x.detach().numpy()


def _check(emissions: Tensor, transitions: Tensor, lengths: Tensor, start: Tensor, end: Tensor) -> None:
    """Device, lengths and the NaN / +inf checks of the parameters (emissions are checked by
    the kernels, per sentence, within its length)."""
    if emissions.device.type != "cpu":
        raise ValueError(f"crfkit: the numba backend runs on the CPU, but emissions is on {emissions.device}")
    L = emissions.shape[1]
    code = kernels.check_arguments(_np(transitions), _np(lengths), _np(start), _np(end), L)
    if code == 4:
        raise ValueError(f"crfkit: lengths must lie in [0, seq_len = {L}], got values in "
                         f"[{int(lengths.min())}, {int(lengths.max())}]")
    if code:
        raise ValueError(_PARAMETER_ERRORS[code])


def _raise_if_bad(bad: np.ndarray) -> None:
    if bad.any():
        b = int(np.flatnonzero(bad)[0])
        raise ValueError(f"crfkit: emissions[{b}] contains NaN or +inf within its length (use -inf to forbid a tag)")


def _raise_if_bad_tag(bad_tag: np.ndarray, tags: Tensor, T: int) -> None:
    if bad_tag.any():
        b = int(np.flatnonzero(bad_tag)[0])
        j, i = divmod(int(bad_tag[b]) - 1, tags.shape[2])
        raise ValueError(f"crfkit: tags[{b}, {j}, {i}] = {int(tags[b, j, i])} is not a tag index in [0, {T})")


# ---- log Z and marginals -----------------------------------------------------------------------
def _forward_backward(mode, emissions, transitions, lengths, start, end, *, grad_log_z=None,
                      rows=None, offsets=None, log_z=None):
    """Run kernels.forward_backward; returns float64 (log_z (B,), grad_emissions (B, L, T),
    grad_trans (B, T, T), grad_start (B, T), grad_end (B, T)), the gradients per sentence and
    empty when the mode does not compute them. Unused arguments get empty arrays of the same
    types, so that the kernel is compiled once."""
    B, L, T = emissions.shape
    f64 = dtype = torch.float64  # the kernel computes in float64: compiled once, not per dtype
    emissions, transitions, start, end = (x.to(f64) for x in (emissions, transitions, start, end))
    backward = mode == kernels.MODE_BACKWARD
    if log_z is None:
        log_z = torch.empty(B, dtype=f64)
    if rows is None:
        rows, offsets = torch.empty((0, 0, 0), dtype=f64), torch.empty((0, 0), dtype=f64)
    if grad_log_z is None:
        grad_log_z = torch.empty(0, dtype=dtype)
    want_emissions = mode in (kernels.MODE_BACKWARD, kernels.MODE_MARGINALS)
    grad_emissions = torch.zeros_like(emissions) if want_emissions else torch.empty((0, 0, 0), dtype=dtype)
    grad_trans = torch.zeros((B, T, T), dtype=f64) if backward else torch.empty((0, 0, 0), dtype=f64)
    grad_start = torch.zeros((B, T), dtype=f64) if backward else torch.empty((0, 0), dtype=f64)
    grad_end = torch.zeros((B, T), dtype=f64) if backward else torch.empty((0, 0), dtype=f64)
    bad = np.zeros(B, dtype=np.bool_)
    _call_over_batch(kernels.forward_backward,
                     _np(emissions), _np(transitions), _np(lengths), _np(start), _np(end), _np(grad_log_z), mode,
                     _np(rows), _np(offsets), _np(log_z), _np(grad_emissions), _np(grad_trans), _np(grad_start),
                     _np(grad_end), bad, batch=B, work=emissions.numel() * T)
    _raise_if_bad(bad)
    return log_z, grad_emissions, grad_trans, grad_start, grad_end


class _LogPartition(torch.autograd.Function):
    @staticmethod
    def forward(ctx, emissions, transitions, lengths, start, end):
        _check(emissions, transitions, lengths, start, end)
        keep = any(ctx.needs_input_grad[i] for i in (0, 1, 3, 4))  # not lengths
        if keep:  # keep the alpha rows: the backward then needs no second forward pass
            B, L, T = emissions.shape
            rows = torch.empty((B, L, T), dtype=torch.float64)
            offsets = torch.empty((B, L), dtype=torch.float64)
            log_z = _forward_backward(kernels.MODE_LOG_Z_KEEP, emissions, transitions, lengths, start, end,
                                      rows=rows, offsets=offsets)[0]
            ctx.save_for_backward(emissions, transitions, lengths, start, end)
            ctx.kept = (rows, offsets, log_z)
        else:
            log_z = _forward_backward(kernels.MODE_LOG_Z, emissions, transitions, lengths, start, end)[0]
        return log_z.to(emissions.dtype)

    @staticmethod
    def backward(ctx, grad_log_z):
        saved = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a differentiable gradient
            return reference.gradients_by_autograd(reference.log_partition, saved, grad_log_z)
        emissions, transitions, lengths, start, end = saved
        rows, offsets, log_z = ctx.kept
        grad_log_z = grad_log_z.to(torch.float64).contiguous()
        _, g_emissions, g_trans, g_start, g_end = _forward_backward(
            kernels.MODE_BACKWARD, emissions, transitions, lengths, start, end, grad_log_z=grad_log_z,
            rows=rows, offsets=offsets, log_z=log_z)
        dtype = emissions.dtype
        return (g_emissions.to(dtype), g_trans.sum(0).to(dtype), None, g_start.sum(0).to(dtype),
                g_end.sum(0).to(dtype))


class _Marginals(torch.autograd.Function):
    @staticmethod
    def forward(ctx, emissions, transitions, lengths, start, end):
        _check(emissions, transitions, lengths, start, end)
        mu = _forward_backward(kernels.MODE_MARGINALS, emissions, transitions, lengths, start, end)[1]
        ctx.save_for_backward(emissions, transitions, lengths, start, end)
        return mu.to(emissions.dtype)

    @staticmethod
    def backward(ctx, grad_marginals):
        # A Hessian-vector product of log Z, taken through the reference (autograd twice); the
        # compiled backend has a kernel for it (marginals_backward).
        return reference.gradients_by_autograd(reference.marginals, ctx.saved_tensors, grad_marginals)


# ---- decoding and sequence scores ------------------------------------------------------------
def _scatter_path_scores(grad_scores: Tensor, lengths: Tensor, paths: Tensor, shape, dtype):
    """Gradients of sum grad_scores[b, j] * score(paths[b, j]) for emissions, transitions,
    start and end: (emissions, transitions, start, end)."""
    B, L, T = shape
    f64 = torch.float64  # accumulated in float64 (one compiled kernel), returned in `dtype`
    grad_emissions = torch.zeros((B, L, T), dtype=f64)
    grad_trans = torch.zeros((B, T, T), dtype=f64)
    grad_start = torch.zeros((B, T), dtype=f64)
    grad_end = torch.zeros((B, T), dtype=f64)
    bad_tag = np.zeros(B, dtype=np.int64)
    kernels.scatter_path_scores(_np(grad_scores.to(f64).contiguous()), _np(lengths), _np(paths.contiguous()),
                                _np(grad_emissions), _np(grad_trans), _np(grad_start), _np(grad_end), bad_tag)
    _raise_if_bad_tag(bad_tag, paths, T)
    return (grad_emissions.to(dtype), grad_trans.sum(0).to(dtype), grad_start.sum(0).to(dtype),
            grad_end.sum(0).to(dtype))


class _PathScores(torch.autograd.Function):
    """Base of the ops whose output is the score of some paths (their gradient is a scatter)."""

    @staticmethod
    def _save(ctx, emissions, lengths, paths):
        ctx.mark_non_differentiable(paths)
        ctx.save_for_backward(lengths, paths)
        ctx.shape, ctx.dtype = tuple(emissions.shape), emissions.dtype


class _Viterbi(_PathScores):
    @staticmethod
    def forward(ctx, emissions, transitions, lengths, start, end):
        _check(emissions, transitions, lengths, start, end)
        B, L, T = emissions.shape
        paths = torch.full((B, L), -1, dtype=torch.long)
        scores = torch.empty(B, dtype=emissions.dtype)
        bad = np.zeros(B, dtype=np.bool_)
        _call_over_batch(kernels.viterbi, _np(emissions), _np(transitions), _np(lengths), _np(start), _np(end),
                         _np(paths), _np(scores), bad, batch=B, work=emissions.numel() * T)
        _raise_if_bad(bad)
        _PathScores._save(ctx, emissions, lengths, paths)
        return scores, paths

    @staticmethod
    def backward(ctx, grad_scores, _grad_paths):
        lengths, paths = ctx.saved_tensors
        g_emissions, g_trans, g_start, g_end = _scatter_path_scores(grad_scores.unsqueeze(1), lengths,
                                                                    paths.unsqueeze(1), ctx.shape, ctx.dtype)
        return g_emissions, g_trans, None, g_start, g_end


def _num_sequences_capped(T: int, L: int, cap: int) -> int:
    """min(T ** L, cap) without big numbers: no list needs more entries than there are sequences."""
    count = 1
    for _ in range(L):
        if count >= cap:
            break
        count *= T
    return min(count, cap)


class _KBest(_PathScores):
    @staticmethod
    def forward(ctx, emissions, transitions, k, lengths, start, end):
        _check(emissions, transitions, lengths, start, end)
        B, L, T = emissions.shape
        paths = torch.full((B, k, L), -1, dtype=torch.long)
        scores = torch.full((B, k), float("-inf"), dtype=emissions.dtype)
        bad = np.zeros(B, dtype=np.bool_)
        K = _num_sequences_capped(T, L, k)
        _call_over_batch(kernels.kbest_viterbi, _np(emissions), _np(transitions), _np(lengths),
                         _np(start), _np(end), K, _np(paths), _np(scores), bad, batch=B, work=emissions.numel() * T * K)
        _raise_if_bad(bad)
        _PathScores._save(ctx, emissions, lengths, paths)
        return scores, paths

    @staticmethod
    def backward(ctx, grad_scores, _grad_paths):
        lengths, paths = ctx.saved_tensors
        g_emissions, g_trans, g_start, g_end = _scatter_path_scores(grad_scores, lengths, paths, ctx.shape, ctx.dtype)
        return g_emissions, g_trans, None, None, g_start, g_end


class _SequenceScore(_PathScores):
    @staticmethod
    def forward(ctx, emissions, transitions, tags, lengths, start, end):
        _check(emissions, transitions, lengths, start, end)
        B, L, T = emissions.shape
        scores = torch.empty((B, tags.shape[1]), dtype=emissions.dtype)
        bad = np.zeros(B, dtype=np.bool_)
        bad_tag = np.zeros(B, dtype=np.int64)
        _call_over_batch(kernels.sequence_score, _np(emissions), _np(transitions), _np(lengths),
                         _np(start), _np(end), _np(tags), _np(scores), bad, bad_tag, batch=B,
                         work=emissions.numel() + tags.numel())
        _raise_if_bad_tag(bad_tag, tags, T)
        _raise_if_bad(bad)
        ctx.save_for_backward(lengths, tags)
        ctx.shape, ctx.dtype = tuple(emissions.shape), emissions.dtype
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        lengths, tags = ctx.saved_tensors
        g_emissions, g_trans, g_start, g_end = _scatter_path_scores(grad_scores, lengths, tags, ctx.shape, ctx.dtype)
        return g_emissions, g_trans, None, None, g_start, g_end


# ---- the backend interface: crfkit.backends.CRFBackend ------------------------------------------
# (same order of arguments as crfkit.reference)

# The kernels run on the CPU only, where the front end checks the values of lengths and tags
# before a call (the kernels check them again, and NaN / +inf, while they scan).
VALUES_CHECKED_ON_DEVICE = ()
# Per-example transitions (B, Lt, T, T) run in the reference (crfkit.backends.for_transitions):
# the numba kernels take one (T, T) matrix.
PER_EXAMPLE_DEVICES: tuple = ()

# No numba kernel for the per-sentence transition counts: autograd through the reference's log Z.
expected_transition_counts = reference.expected_transition_counts
# No numba kernel for sampling: the PyTorch forward filtering, backward sampling (crfkit/sampling.py).
sample_with_replacement = reference.sample_with_replacement
sample_without_replacement = reference.sample_without_replacement  # (stochastic beam search, the same module)


def log_partition(emissions: Tensor, transitions: Tensor, lengths: Tensor, start: Tensor, end: Tensor) -> Tensor:
    return _LogPartition.apply(emissions, transitions, lengths, start, end)


def marginals(emissions, transitions, lengths, start, end) -> Tensor:
    return _Marginals.apply(emissions, transitions, lengths, start, end)


def viterbi(emissions, transitions, lengths, start, end):
    return _Viterbi.apply(emissions, transitions, lengths, start, end)


def kbest_viterbi(emissions, transitions, k, lengths, start, end):
    scores, paths = _KBest.apply(emissions, transitions, k, lengths, start, end)
    log_z = log_partition(emissions, transitions, lengths, start, end)
    return scores, paths, reference.log_probs_from_scores(scores, log_z)


def sequence_score(emissions, transitions, tags, lengths, start, end) -> Tensor:
    return _SequenceScore.apply(emissions, transitions, tags.contiguous(), lengths, start, end)


def marginals_and_transition_counts(emissions, transitions, lengths, start, end):
    # No kernel gives both at once here: the marginals' kernel, then the reference's counts.
    return (marginals(emissions, transitions, lengths, start, end),
            expected_transition_counts(emissions, transitions, lengths, start, end))
