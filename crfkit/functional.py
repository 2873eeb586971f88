"""crfkit's public operations on linear-chain CRFs: check the arguments, then run a backend.

Each op is two steps: crfkit._arguments.prepare() checks the arguments and puts them in the
form the backends take, then the current backend (crfkit.backends.current(), which provides
the contract crfkit.backends.CRFBackend) computes the result.

Shapes (batch first):
    emissions    (B, L, T)  emissions[b, i, t]: score of tag t at position i of sentence b
    transitions  (T, T)     transitions[s, t]: score of moving from tag s to tag t
    start, end   (T,)       optional scores of the first / last tag (default 0)
    lengths      (B,)       optional integer lengths; sentence b is positions 0 .. lengths[b]-1
                            (default: all L). Padded positions are never read.
    tags         (B, L)     integer tag indices (values at padded positions are ignored)

Optional, in every op (keyword-only):
    mask         (B, L)     bool, instead of lengths: the real positions, anywhere (holes, left
                            padding, a [CLS] position, first sub-words). Masked positions are
                            skipped and the chain joins across them; position-wise outputs are
                            padding there (paths -1, marginals 0).
    allowed      (B, L, T)  bool: the tags each position may take (partial labels, forced tags);
                            the CRF restricted to them (their emissions -inf). Every real
                            position must allow at least one tag.
Per-example parameters: transitions (B, T, T) (one matrix per sentence) or (B, L, T, T) (one per
position: transitions[b, i] scores y_{i-1} -> y_i, [:, 0] unused; with a mask, the transition
from the previous real position into position i), start / end (B, T). The compiled backend runs
them on the CPU; elsewhere the reference does (crfkit.backends.for_transitions).

Score of a tag sequence y of length n (n >= 1):
    s(y) = start[y_0] + emissions[0, y_0] + sum_{i>=1} (transitions[y_{i-1}, y_i] + emissions[i, y_i]) + end[y_{n-1}]

Conventions, the same in every backend:
- A score of -inf forbids a tag, a transition, a first or last tag, in EVERY operation
  (log Z, marginals, Viterbi, k-best); crfkit.constraints builds such masks for BIO / BIOES / ...
  NaN or +inf anywhere a score is read raises ValueError (RuntimeError from the raw ops).
  So do lengths outside [0, L] and tags outside [0, T) at real positions; with CUDA tensors
  the kernels report those once they have run (the values are not read back to the host
  first: that would wait for the GPU on every call).
- A length-0 sentence has exactly one tag sequence, the empty one, of score 0:
  log Z = 0, marginals 0, Viterbi path all -1 with score 0, k-best row 0 = that empty path
  (score 0, log_prob 0) and the other rows missing.
- If every sequence of a sentence is forbidden: log Z = -inf, marginals 0, gradients 0 (no NaN),
  Viterbi path -1 with score -inf, every k-best row missing; the log-likelihood of any sequence
  (crfkit.CRF, LinearChainCRF.log_prob, the compat layers) is -inf with gradient 0.
- k-best rows that hold no sequence (fewer than k allowed sequences) have path -1 and
  score / log_prob -inf.
- Ties: sequences of equal score are ordered by their tags read from the LAST position
  backwards, smaller tag index first (so among all-equal scores, [1, 0] comes before [0, 1]).
  Viterbi returns the first sequence in that order, identical to k-best row 0.
- dtypes: float32 and float64 are computed as they are; float16 and bfloat16 emissions are
  computed in float32 and the results are float32. transitions / start / end must have the
  dtype of emissions, or float32 (or any half type) when emissions are half precision.
- Non-contiguous and expanded inputs are accepted (copied to contiguous memory first).
"""
from __future__ import annotations

import typing
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import backends, sampling
from ._validation import check_bool, check_int
from .reference import log_likelihood_from_scores
from ._arguments import (Layout, apply_mask_and_allowed, check_k, check_tensor, is_compiling, prepare,
                         prepare_tags)


class BestPath(NamedTuple):
    """Result of viterbi: scores (B,), paths (B, L) int64. Scores come first, as torch.max and
    torch.topk give (values, indices)."""

    scores: Tensor
    paths: Tensor


class KBest(NamedTuple):
    """Result of kbest_viterbi: scores (B, K), paths (B, K, L) int64, log_probs (B, K)."""

    scores: Tensor
    paths: Tensor
    log_probs: Tensor


# TorchScript reads a NamedTuple's field types from __annotations__ and cannot resolve the strings
# that `from __future__ import annotations` leaves there (pytorch issue 95858); resolved here so
# that scripted crfkit.CRF.decode / kbest can return these classes.
for _result in (BestPath, KBest):
    _result.__annotations__.update(typing.get_type_hints(_result))


def _prepared(emissions, transitions, lengths, start, end, mask, allowed):
    """(backend, the five backend arguments, Layout or None): mask and allowed applied
    (crfkit._arguments.apply_mask_and_allowed), then checked and prepared."""
    layout = None
    if mask is not None or allowed is not None:
        emissions, transitions, lengths, layout = apply_mask_and_allowed(emissions, transitions, lengths, mask,
                                                                         allowed)
    args = prepare(emissions, transitions, lengths, start, end)
    return backends.for_transitions(args[1]), args, layout


def _original(layout: Optional[Layout], x: Tensor, dim: int = 1) -> Tensor:
    return x if layout is None else layout.to_original(x, dim)


def log_partition(emissions: Tensor, transitions: Tensor, lengths: Optional[Tensor] = None,
                  start: Optional[Tensor] = None, end: Optional[Tensor] = None, *, mask: Optional[Tensor] = None,
                  allowed: Optional[Tensor] = None) -> Tensor:
    """log Z(x) = logsumexp over all tag sequences of their score: (B,).

    Differentiable in emissions, transitions, start and end; the gradient with respect to
    emissions is the marginals, computed by an analytic forward-backward kernel. In the compiled
    backend on the CPU a differentiable call computes those gradients in its forward (the
    backward then only scales them), so evaluation should run under torch.no_grad(); the
    gradient is not differentiable again there (a second derivative raises; the reference
    backend has them).
    """
    if mask is None and allowed is None:
        args = prepare(emissions, transitions, lengths, start, end)
        return backends.for_transitions(args[1]).log_partition(*args)
    backend, args, _ = _prepared(emissions, transitions, lengths, start, end, mask, allowed)
    return backend.log_partition(*args)


def marginals(emissions: Tensor, transitions: Tensor, lengths: Optional[Tensor] = None,
              start: Optional[Tensor] = None, end: Optional[Tensor] = None, *, mask: Optional[Tensor] = None,
              allowed: Optional[Tensor] = None) -> Tensor:
    """P(y_i = t | x): (B, L, T), zero at padded positions.

    Differentiable in emissions, transitions, start and end: the gradient is a Hessian-vector
    product of log Z. In the compiled backend (CPU and CUDA) it is an analytic kernel (the
    tangent of the forward-backward in the direction of the upstream gradient, computed in
    double); that gradient is differentiable once only (differentiating it again, a third
    derivative of log Z, raises; the reference backend has those). In the other backends it is
    taken by autograd through the reference implementation, which is slower.
    """
    backend, args, layout = _prepared(emissions, transitions, lengths, start, end, mask, allowed)
    return _original(layout, backend.marginals(*args))


def marginals_and_transition_counts(emissions: Tensor, transitions: Tensor, lengths: Optional[Tensor] = None,
                                    start: Optional[Tensor] = None, end: Optional[Tensor] = None, *,
                                    mask: Optional[Tensor] = None,
                                    allowed: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(marginals(...), expected_transition_counts(...)), from one forward-backward where the
    backend can (crfkit.distribution's exact entropy, cross entropy and KL need both). Not
    exported by the crfkit package: crfkit.LinearChainCRF is its user-facing form."""
    backend, args, layout = _prepared(emissions, transitions, lengths, start, end, mask, allowed)
    mu, counts = backend.marginals_and_transition_counts(*args)
    return _original(layout, mu), counts


def expected_transition_counts(emissions: Tensor, transitions: Tensor, lengths: Optional[Tensor] = None,
                               start: Optional[Tensor] = None, end: Optional[Tensor] = None, *,
                               mask: Optional[Tensor] = None, allowed: Optional[Tensor] = None) -> Tensor:
    """Expected number of s -> t transitions per sentence: (B, T, T), i.e. the pairwise
    marginals P(y_{i-1} = s, y_i = t | x) summed over positions. With marginals() it gives
    every expectation of a score, E_p[s_q(y)], hence exact CRF cross entropy and KL divergence.

    The compiled backend has CPU and CUDA kernels for it (the per-sentence transition gradients
    of the log Z backward); the other backends run the reference (autograd through its log Z),
    which is slower. Differentiable: in the compiled backend on the CPU the gradient is an
    analytic kernel (a Hessian-vector product of log Z, as the marginals'; differentiable once
    only); on CUDA and in the other backends it is autograd through the reference.
    """
    backend, args, _ = _prepared(emissions, transitions, lengths, start, end, mask, allowed)
    return backend.expected_transition_counts(*args)


def viterbi(emissions: Tensor, transitions: Tensor, lengths: Optional[Tensor] = None,
            start: Optional[Tensor] = None, end: Optional[Tensor] = None, *, mask: Optional[Tensor] = None,
            allowed: Optional[Tensor] = None) -> BestPath:
    """The best tag sequence: BestPath(scores (B,), paths (B, L) int64); paths are -1 at padded
    positions. scores are differentiable (they are the sequence scores of the paths)."""
    if mask is None and allowed is None:
        args = prepare(emissions, transitions, lengths, start, end)
        return BestPath(*backends.for_transitions(args[1]).viterbi(*args))
    backend, args, layout = _prepared(emissions, transitions, lengths, start, end, mask, allowed)
    scores, paths = backend.viterbi(*args)
    return BestPath(scores, _original(layout, paths))


def kbest_viterbi(emissions: Tensor, transitions: Tensor, k: int, lengths: Optional[Tensor] = None,
                  start: Optional[Tensor] = None, end: Optional[Tensor] = None, *, mask: Optional[Tensor] = None,
                  allowed: Optional[Tensor] = None) -> KBest:
    """The k highest-scoring DISTINCT tag sequences, best first (exact k-best Viterbi).

    Returns KBest(scores (B, k), paths (B, k, L) int64, log_probs (B, k)) with
    log_probs = scores - log_partition. Row 0 equals viterbi(). Rows beyond the number of
    allowed sequences of a sentence have path -1 and score / log_prob -inf; padded positions
    are -1. scores and log_probs are differentiable. Ties: see the module docstring.
    """
    check_k(k)
    backend, (emissions, transitions, lengths, start, end), layout = _prepared(emissions, transitions, lengths, start,
                                                                               end, mask, allowed)
    scores, paths, log_probs = backend.kbest_viterbi(emissions, transitions, k, lengths, start, end)
    return KBest(scores, _original(layout, paths, 2), log_probs)


def sequence_score(emissions: Tensor, transitions: Tensor, tags: Tensor, lengths: Optional[Tensor] = None,
                   start: Optional[Tensor] = None, end: Optional[Tensor] = None, *, mask: Optional[Tensor] = None,
                   allowed: Optional[Tensor] = None) -> Tensor:
    """Score s(x, y) of given tag sequences, differentiable.

    tags (B, L) -> (B,), or (B, N, L) -> (B, N) for N sequences per sentence. Tags at real
    positions must lie in [0, T); values at padded positions are ignored (e.g. -100).
    """
    backend, (emissions, transitions, lengths, start, end), layout = _prepared(emissions, transitions, lengths, start,
                                                                               end, mask, allowed)
    B, L, T = emissions.shape
    if (layout is not None and isinstance(tags, Tensor) and tags.dim() in (2, 3)
            and (tags.shape[0], tags.shape[-1]) == (B, L)):
        tags = layout.to_compact(tags, tags.dim() - 1)  # (tags of another shape: prepare_tags says so)
    tags3, one_per_sentence = prepare_tags(tags, lengths, B, L, T, emissions.device)
    scores = backend.sequence_score(emissions, transitions, tags3, lengths, start, end)
    return scores.squeeze(1) if one_per_sentence else scores


class Samples(NamedTuple):
    """Result of sample: paths (B, n, L) int64 (-1 at padding, and everywhere in a row that holds
    no sequence), log_probs (B, n) (differentiable; -inf for rows that hold no sequence)."""

    paths: Tensor
    log_probs: Tensor


def partial_nll(emissions: Tensor, transitions: Tensor, allowed: Tensor, lengths: Optional[Tensor] = None,
                start: Optional[Tensor] = None, end: Optional[Tensor] = None, *,
                mask: Optional[Tensor] = None) -> Tensor:
    """-log P(y in allowed | x) = log Z - log Z(allowed): (B,), the loss of training from partial or
    incomplete annotation (each position's possible tags: allowed (B, L, T) bool). One-hot allowed
    tags (the gold sequence) give the ordinary negative log-likelihood. +inf where no allowed
    sequence has probability (e.g. the constraints forbid them all), with a finite gradient
    (that of log Z), as crfkit.CRF's NLL of a forbidden gold sequence; 0 where the sentence
    allows no sequence at all."""
    log_z = log_partition(emissions, transitions, lengths, start, end, mask=mask)
    log_z_allowed = log_partition(emissions, transitions, lengths, start, end, mask=mask, allowed=allowed)
    return -log_likelihood_from_scores(log_z_allowed, log_z)


def sample(emissions: Tensor, transitions: Tensor, n: int, lengths: Optional[Tensor] = None,
           start: Optional[Tensor] = None, end: Optional[Tensor] = None, *, mask: Optional[Tensor] = None,
           allowed: Optional[Tensor] = None, replacement: bool = True,
           generator: Optional[torch.Generator] = None) -> Samples:
    """n exact samples of tag sequences per sentence: Samples(paths (B, n, L), log_probs (B, n)).

    replacement=True: independent draws (forward filtering, backward sampling). replacement=False:
    n distinct sequences, an exact sample without replacement in the order it was drawn (Gumbel
    top-k over the CRF's right-to-left factorisation, i.e. stochastic beam search); rows beyond
    the number of allowed sequences hold no sequence (so a length-0 sentence has its empty
    sequence in row 0 only, as in kbest_viterbi). generator: a torch.Generator on the
    emissions' device for every random number, so that a seeded generator repeats the samples.
    log_probs are differentiable (sequence_score - log_partition); rows that hold no sequence
    have log_prob -inf (with replacement: only where the sentence allows no sequence; a length-0
    sentence's rows are then its one empty sequence, log_prob 0).

    Where it runs: the backend's sample_with_replacement (replacement=True) or
    sample_without_replacement (replacement=False), which in the compiled backend are C++ kernels
    on the CPU (csrc/cpu/sampling.cpp) and CUDA kernels on a GPU (csrc/cuda/sampling.cu), both
    for shared and per-example transitions, and everywhere else, i.e. the numba and reference
    backends, the PyTorch path of crfkit/sampling.py. Both
    draw their noise from `generator` in one order and amount, so on the CPU a generator seeded
    alike gives the same paths on each (float64: bit for bit; float32: up to the PyTorch path's
    float32 rounding, which the kernels, computing in double, do not do; see crfkit/sampling.py).
    On CUDA, whose generator does not split one draw into several alike, the kernel's samples
    differ from the PyTorch path's (each exact, and repeatable with its seed).
    """
    check_int("n", n, minimum=1)
    replacement = check_bool("replacement", replacement)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    backend, args, layout = _prepared(emissions, transitions, lengths, start, end, mask, allowed)
    emissions, transitions, lengths, start, end = args
    if generator is not None and generator.device.type != emissions.device.type:
        raise ValueError(f"generator is on {generator.device} but emissions is on {emissions.device}")
    if replacement:
        paths = backend.sample_with_replacement(emissions, transitions, n, lengths, start, end, generator)
    else:
        paths = backend.sample_without_replacement(emissions, transitions, n, lengths, start, end, generator)
    missing = sampling.missing_rows(paths, lengths, replacement)
    scores = backend.sequence_score(emissions, transitions, paths.clamp(min=0), lengths, start, end)
    log_probs = log_likelihood_from_scores(scores, backend.log_partition(*args))
    return Samples(_original(layout, paths, 2), log_probs.masked_fill(missing, float("-inf")))


def lengths_from_mask(mask: Tensor) -> Tensor:
    """(B, L) bool mask of real positions -> (B,) int64 lengths. The mask must be left-aligned
    (each row a run of True followed by False); the ops take any other mask as mask=... ."""
    check_tensor("mask", mask, 2, "(batch, seq_len)")
    mask = mask.bool()
    lengths = mask.sum(1)
    prefix = torch.arange(mask.shape[1], device=mask.device) < lengths.unsqueeze(1)
    if not is_compiling() and not torch.equal(prefix, mask):
        raise ValueError("mask must be left-aligned (True for the first lengths[b] positions, then False); "
                         "pass a mask with holes to the ops as mask=... instead of lengths")
    return lengths
