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

from . import backends
from ._arguments import check_k, check_tensor, is_compiling, prepare, prepare_tags


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


def log_partition(emissions: Tensor, transitions: Tensor, lengths: Optional[Tensor] = None,
                  start: Optional[Tensor] = None, end: Optional[Tensor] = None) -> Tensor:
    """log Z(x) = logsumexp over all tag sequences of their score: (B,).

    Differentiable in emissions, transitions, start and end; the gradient with respect to
    emissions is the marginals, computed by an analytic forward-backward kernel. In the compiled
    backend on the CPU a differentiable call computes those gradients in its forward (the
    backward then only scales them), so evaluation should run under torch.no_grad(); the
    gradient is not differentiable again there (a second derivative raises; the reference
    backend has them).
    """
    return backends.current().log_partition(*prepare(emissions, transitions, lengths, start, end))


def marginals(emissions: Tensor, transitions: Tensor, lengths: Optional[Tensor] = None,
              start: Optional[Tensor] = None, end: Optional[Tensor] = None) -> Tensor:
    """P(y_i = t | x): (B, L, T), zero at padded positions.

    Differentiable in emissions, transitions, start and end: the gradient is a Hessian-vector
    product of log Z. In the compiled backend (CPU and CUDA) it is an analytic kernel (the
    tangent of the forward-backward in the direction of the upstream gradient, computed in
    double); that gradient is differentiable once only (differentiating it again, a third
    derivative of log Z, raises; the reference backend has those). In the other backends it is
    taken by autograd through the reference implementation, which is slower.
    """
    return backends.current().marginals(*prepare(emissions, transitions, lengths, start, end))


def marginals_and_transition_counts(emissions: Tensor, transitions: Tensor, lengths: Optional[Tensor] = None,
                                    start: Optional[Tensor] = None,
                                    end: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(marginals(...), expected_transition_counts(...)), from one forward-backward where the
    backend can (crfkit.distribution's exact entropy, cross entropy and KL need both). Not
    exported by the crfkit package: crfkit.LinearChainCRF is its user-facing form."""
    return backends.current().marginals_and_transition_counts(*prepare(emissions, transitions, lengths, start, end))


def expected_transition_counts(emissions: Tensor, transitions: Tensor, lengths: Optional[Tensor] = None,
                               start: Optional[Tensor] = None, end: Optional[Tensor] = None) -> Tensor:
    """Expected number of s -> t transitions per sentence: (B, T, T), i.e. the pairwise
    marginals P(y_{i-1} = s, y_i = t | x) summed over positions. With marginals() it gives
    every expectation of a score, E_p[s_q(y)], hence exact CRF cross entropy and KL divergence.

    The compiled backend has CPU and CUDA kernels for it (the per-sentence transition gradients
    of the log Z backward); the other backends run the reference (autograd through its log Z),
    which is slower. Differentiable: in the compiled backend on the CPU the gradient is an
    analytic kernel (a Hessian-vector product of log Z, as the marginals'; differentiable once
    only); on CUDA and in the other backends it is autograd through the reference.
    """
    return backends.current().expected_transition_counts(*prepare(emissions, transitions, lengths, start, end))


def viterbi(emissions: Tensor, transitions: Tensor, lengths: Optional[Tensor] = None,
            start: Optional[Tensor] = None, end: Optional[Tensor] = None) -> BestPath:
    """The best tag sequence: BestPath(scores (B,), paths (B, L) int64); paths are -1 at padded
    positions. scores are differentiable (they are the sequence scores of the paths)."""
    return BestPath(*backends.current().viterbi(*prepare(emissions, transitions, lengths, start, end)))


def kbest_viterbi(emissions: Tensor, transitions: Tensor, k: int, lengths: Optional[Tensor] = None,
                  start: Optional[Tensor] = None, end: Optional[Tensor] = None) -> KBest:
    """The k highest-scoring DISTINCT tag sequences, best first (exact k-best Viterbi).

    Returns KBest(scores (B, k), paths (B, k, L) int64, log_probs (B, k)) with
    log_probs = scores - log_partition. Row 0 equals viterbi(). Rows beyond the number of
    allowed sequences of a sentence have path -1 and score / log_prob -inf; padded positions
    are -1. scores and log_probs are differentiable. Ties: see the module docstring.
    """
    check_k(k)
    emissions, transitions, lengths, start, end = prepare(emissions, transitions, lengths, start, end)
    return KBest(*backends.current().kbest_viterbi(emissions, transitions, k, lengths, start, end))


def sequence_score(emissions: Tensor, transitions: Tensor, tags: Tensor, lengths: Optional[Tensor] = None,
                   start: Optional[Tensor] = None, end: Optional[Tensor] = None) -> Tensor:
    """Score s(x, y) of given tag sequences, differentiable.

    tags (B, L) -> (B,), or (B, N, L) -> (B, N) for N sequences per sentence. Tags at real
    positions must lie in [0, T); values at padded positions are ignored (e.g. -100).
    """
    emissions, transitions, lengths, start, end = prepare(emissions, transitions, lengths, start, end)
    B, L, T = emissions.shape
    tags3, one_per_sentence = prepare_tags(tags, lengths, B, L, T, emissions.device)
    scores = backends.current().sequence_score(emissions, transitions, tags3, lengths, start, end)
    return scores.squeeze(1) if one_per_sentence else scores


def lengths_from_mask(mask: Tensor) -> Tensor:
    """(B, L) bool mask of real positions -> (B,) int64 lengths. The mask must be left-aligned
    (each row a run of True followed by False): crfkit does not support holes."""
    check_tensor("mask", mask, 2, "(batch, seq_len)")
    mask = mask.bool()
    lengths = mask.sum(1)
    prefix = torch.arange(mask.shape[1], device=mask.device) < lengths.unsqueeze(1)
    if not is_compiling() and not torch.equal(prefix, mask):
        raise ValueError("mask must be left-aligned (True for the first lengths[b] positions, then False)")
    return lengths
