"""Exact sampling of tag sequences from a linear-chain CRF, with or without replacement.

For a sentence of length m >= 1 the CRF's distribution P(y) = exp(s(y)) / Z factorises from right
to left through the forward scores alpha (crfkit.reference.forward_log_scores; alpha[b, i, t] sums
the exp-scores of the prefixes y_0 .. y_i that end in t, start and emissions included):

    P(y_{m-1} = t)             = softmax_t(alpha[m-1, t] + end[t])
    P(y_{i-1} = s | y_i = t)   = softmax_s(alpha[i-1, s] + transitions_i[s, t])

(transitions_i: the transitions into position i, reference.transitions_at: shared (T, T), or each
sentence's own). The product of these conditionals is exactly exp(s(y) - log Z), since
alpha[i, t] = logsumexp_s(alpha[i-1, s] + transitions_i[s, t]) + emissions[i, t] telescopes. So
both samplers below are exact: they draw from the CRF's distribution itself, not from an
approximation (up to the floating-point rounding of alpha and of the noise, whose uniforms have
the dtype's precision: 24 bits in float32, 53 in float64).

- replacement=True: forward filtering, backward sampling. n independent sequences per sentence,
  each tag drawn from its conditional by the Gumbel-max trick (argmax of logits + Gumbel noise),
  right to left.
- replacement=False: n DISTINCT sequences, an exact sample without replacement, by the Gumbel-top-k
  trick over the tree of that factorisation ("stochastic beam search": W. Kool, H. van Hoof and
  M. Welling, "Stochastic Beams and Where to Find Them: The Gumbel-Top-k Trick for Sampling
  Sequences Without Replacement", ICML 2019). Every complete sequence y gets a perturbed
  log-probability G_y = log P(y) + Gumbel(0); the n sequences of largest G_y, in descending order
  of G_y, are distributed as n sequential draws without replacement (Plackett-Luce: the first
  row is distributed as P, the second as P without the first row's sequence, renormalised, ...).
  Those T^m values are never all drawn: top-down (from position m-1 to 0), each partial sequence
  (y_i .. y_{m-1}) gets the maximum of the G_y of its completions, sampled conditionally on its
  parent's value (Kool et al., section 3, in the numerically stable form of their appendix), and
  only the n partial sequences with the largest values are extended at each position. That is
  exact, not a heuristic beam: the n largest G_y descend from the n largest partial values at
  every position. The rows come in descending order of G_y, the order of sequential drawing.

Batches with ragged lengths are processed position by position from L-1 down to 0: a sentence
of length m starts (its first draw, from P(y_{m-1})) at position m-1 and is left untouched
before; every sentence ends at position 0.

Cost: O(B L T^2) for the forward scores (and, without replacement, the normalised conditionals
of each position), then O(B n L T) for the sampling (without replacement, a top-n over the n T
extensions of each sentence at each position). Pure torch, vectorised over the batch and the
samples with one Python loop over positions; runs on any device; no autograd graph. All
randomness comes from `generator` (torch's default generator when None), so a generator seeded
alike on the same device gives the same samples.

crfkit.sample (crfkit.functional) runs replacement=True through the backend's
sample_with_replacement and replacement=False through its sample_without_replacement: in the
compiled backend those are C++ kernels on the CPU (csrc/cpu/sampling.cpp,
torch.ops.crfkit.sample_with_replacement and sample_without_replacement) and CUDA kernels for
shared transitions (csrc/cuda/sampling.cu, checked in the CPU emulator, not yet timed on a GPU),
which do this module's arithmetic in one pass per sentence, in double. Both take the Gumbel
noise of every position at once, (L, B, n, T) in the order drawn here (position L - 1 first;
reference.gumbel_noise): with replacement the noise of each row's logits; without replacement
the unconditioned Gumbels of each beam's T children, which this module draws for every beam
(live or not) before it conditions them on the parent's value (_conditional_gumbels), so that
the conditioning is a function of that noise, which the kernel applies itself. So on the CPU a
generator seeded alike gives the same paths on both (on CUDA one draw of (L, B, n, T) is not the
L draws of (B, n, T) this module makes, so the samples differ, each exact): bit for bit in
float64 (up to two values within an ulp or so of each other: alpha's rounding, and without
replacement the last bit of exp / log, which torch vectorises and the kernel takes from the C
library), and in float32 those of this path run in float64 on the upcast inputs and noise (the
kernels do not round alpha, the logits and the keys to float32).
sample(..., noise=...) takes that noise instead of drawing it. Everywhere else (the numba and
reference backends) crfkit.sample runs this module.

Shapes and conventions follow crfkit.functional: emissions (B, L, T); transitions (T, T), or per
example (B, Lt, T, T) with Lt in {1, L}; start, end (T,) or (B, T); lengths (B,) int64 in [0, L];
-inf forbids a tag, a transition, a first or last tag, which are then never sampled. Returned
paths are (B, n, L) int64, -1 at padded positions (i >= lengths[b]). A row that holds no
sequence is -1 everywhere:

- a sentence whose every sequence is forbidden (log Z = -inf): all n rows;
- replacement=False with fewer than n allowed sequences: the rows after the last allowed one.

A length-0 sentence has one sequence, the empty one, whose path is -1 everywhere too (a valid
sample of log-probability 0): with replacement all n rows are that sequence; without replacement
row 0 is, and rows 1 .. n-1 hold nothing. missing_rows(paths, lengths, replacement) tells them
apart. A caller computing log-probabilities as sequence_score - log_partition (reading -1 as any
tag, e.g. paths.clamp(min=0)) gets 0 for the empty sequence and must set -inf where log Z = -inf
(not -inf - -inf; reference.log_likelihood_from_scores does) and at the missing rows.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._validation import check_bool, check_int
from .reference import forward_log_scores, gumbel_noise, safe_logsumexp, transitions_at

NEG_INF = float("-inf")

__all__ = ["sample", "missing_rows"]


def sample(emissions: Tensor, transitions: Tensor, n: int, lengths: Tensor, start: Tensor, end: Tensor, *,
           replacement: bool = True, generator: Optional[torch.Generator] = None,
           noise: Optional[Tensor] = None) -> Tensor:
    """n tag sequences per sentence drawn exactly from the CRF: paths (B, n, L) int64.

    emissions (B, L, T) float32 / float64; transitions (T, T) or (B, Lt, T, T), Lt in {1, L};
    lengths (B,) int64; start, end (T,) or (B, T): already checked and on one device (crfkit's
    front end prepares them). n: an int >= 1.

    replacement=True: n independent draws per sentence (forward filtering, backward sampling).
    replacement=False: n distinct sequences, an exact sample without replacement, rows in the
    order of sequential drawing (stochastic beam search, Kool, van Hoof and Welling, ICML 2019);
    n may exceed the number of allowed sequences, the extra rows are then missing.

    Paths are -1 at padded positions; rows that hold no sequence are -1 everywhere (see the
    module docstring and missing_rows). Forbidden (-inf) tags and transitions are never sampled.
    Not differentiable (the paths are integers; the caller scores them). All random numbers come
    from `generator`, which must be on the emissions' device.
    noise: the standard Gumbels to use instead of drawing them, shape (L, B, n, T) in the
    emissions' dtype, noise[k] for position L - 1 - k (what this function draws from
    `generator`, in that order; the compiled kernels' argument of the same name). With
    replacement noise[k][b, j] perturbs row j's logits; without, the children of beam j (the
    j-th largest perturbed value so far) before they are conditioned on its value.
    Cost O(B L T^2) + O(B n L T).
    """
    n = check_int("n", n, minimum=1)
    replacement = check_bool("replacement", replacement)
    if noise is not None:
        B, L, T = emissions.shape
        if tuple(noise.shape) != (L, B, n, T) or noise.dtype != emissions.dtype or noise.device != emissions.device:
            raise ValueError(f"noise must be (seq_len, batch, n, num_tags) = {(L, B, n, T)} of dtype "
                             f"{emissions.dtype} on {emissions.device}, got {tuple(noise.shape)} of {noise.dtype} "
                             f"on {noise.device}")
    with torch.no_grad():
        B, L, T = emissions.shape
        if L == 0 or B == 0:
            return torch.full((B, n, L), -1, dtype=torch.long, device=emissions.device)
        alpha = forward_log_scores(emissions, transitions, lengths, start)
        if replacement:
            return _with_replacement(alpha, transitions, n, lengths, end, generator, noise)
        return _without_replacement(alpha, transitions, n, lengths, end, generator, noise)


def missing_rows(paths: Tensor, lengths: Tensor, replacement: bool = True) -> Tensor:
    """(B, n) bool: the rows of sample()'s paths that hold no sequence.

    A row is missing when its sentence has a real position (lengths > 0) and the row is -1
    there; for a length-0 sentence (whose empty path is -1 too) every row holds the empty
    sequence with replacement, only row 0 without. Give missing rows log-probability -inf.
    """
    B, n, L = paths.shape
    if L == 0:
        missing = torch.zeros((B, n), dtype=torch.bool, device=paths.device)
    else:
        missing = (paths[:, :, 0] == -1) & (lengths > 0).unsqueeze(1)
    if not replacement:
        later = torch.arange(n, device=paths.device) > 0
        missing = missing | ((lengths == 0).unsqueeze(1) & later)
    return missing


def _into(transitions: Tensor, tags: Tensor) -> Tensor:
    """transitions[s, tags] for every s: (B, n, T), from transitions (T, T) or (B, T, T) and
    tags (B, n) (the tag at the next position of each row)."""
    if transitions.dim() == 2:
        return transitions.t()[tags]
    T = transitions.shape[-1]
    return transitions.transpose(1, 2).gather(1, tags.unsqueeze(2).expand(-1, -1, T))


def _log_normalise(logits: Tensor) -> Tensor:
    """log_softmax over the last dim that gives -inf (not NaN) where every logit is -inf."""
    lse = safe_logsumexp(logits, dim=-1).unsqueeze(-1)
    finite = lse > NEG_INF
    return torch.where(finite, logits - torch.where(finite, lse, torch.zeros_like(lse)), NEG_INF)


def _last_logits(alpha: Tensor, i: int, end: Tensor) -> Tensor:
    """alpha[:, i] + end: (B, T), the unnormalised log P(y_i = t) for sentences of length i + 1."""
    return alpha[:, i] + end


def _with_replacement(alpha, transitions, n, lengths, end, generator, noise=None) -> Tensor:
    B, L, T = alpha.shape
    paths = torch.full((B, n, L), -1, dtype=torch.long, device=alpha.device)
    tags = torch.zeros((B, n), dtype=torch.long, device=alpha.device)  # the tag at position i + 1
    for i in range(L - 1, -1, -1):
        logits = _last_logits(alpha, i, end).unsqueeze(1)  # (B, 1, T): for sentences whose last position is i
        if i + 1 < L:
            into = alpha[:, i].unsqueeze(1) + _into(transitions_at(transitions, i + 1), tags)  # (B, n, T)
            logits = torch.where((lengths == i + 1).view(B, 1, 1), logits, into)
        else:
            logits = logits.expand(B, n, T)
        # Gumbel-max: the argmax of logits + noise is a draw from softmax(logits); a -inf logit
        # stays -inf and is never the argmax of a row with a finite logit.
        # (csrc/cpu/sampling.cpp does this arithmetic, in double: keep the two in step.)
        gumbels = gumbel_noise((B, n, T), alpha, generator) if noise is None else noise[L - 1 - i]
        chosen = (logits + gumbels).argmax(2)
        active = (i < lengths).unsqueeze(1)
        tags = torch.where(active, chosen, tags)
        paths[:, :, i] = torch.where(active, chosen, -1)
    # log Z = -inf (every sequence forbidden): the draws above are meaningless; no rows.
    last = (lengths - 1).clamp(min=0).view(B, 1, 1).expand(B, 1, T)
    final = alpha.gather(1, last).squeeze(1) + end
    no_sequence = (final.amax(1) == NEG_INF) & (lengths > 0)
    return paths.masked_fill_(no_sequence.view(B, 1, 1), -1)


def _log1mexp(a: Tensor) -> Tensor:
    """log(1 - exp(a)) for a <= 0, accurately (Maechler's two branches); -inf at a = 0."""
    return torch.where(a > -0.6931471805599453, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def _conditional_gumbels(child_phi: Tensor, parent_key: Tensor, generator, gumbels: Optional[Tensor] = None) -> Tensor:
    """Perturbed log-probabilities of the children of each beam, conditioned on their maximum
    being the parent's (Kool et al. 2019, eq. (10), in the numerically stable form of their
    appendix).

    child_phi (B, n, T): log-probability of each extended partial sequence (-inf: impossible);
    parent_key (B, n): the parent's perturbed log-probability (-inf: a dead beam); gumbels
    (B, n, T): the standard Gumbels to use (drawn from generator when None). Returns
    (B, n, T), -inf exactly where child_phi is -inf, with no NaN on the way.

    With G_c = phi_c + Gumbel(0) and Z = max_c G_c, the conditioned value is
    -log(exp(-key) - exp(-Z) + exp(-G_c)) = key - softplus(v), v = key - G_c + log(1 - exp(G_c - Z));
    the child attaining the maximum gets key exactly (v = -inf). An impossible child (G_c = -inf)
    gets v = +inf, hence -inf; a dead beam (key = Z = -inf) has only impossible children and is
    given key = Z = 0 so that no -inf - -inf appears.
    """
    # (csrc/cpu/sampling.cpp does this arithmetic, in double, for the same gumbels: keep the two in step.)
    if gumbels is None:
        gumbels = gumbel_noise(child_phi.shape, child_phi, generator)
    g = child_phi + gumbels
    z = g.amax(2, keepdim=True)
    dead = z == NEG_INF
    z = z.masked_fill(dead, 0)
    key = parent_key.unsqueeze(2).masked_fill(dead, 0)
    v = (key - g) + _log1mexp(g - z)
    # softplus(v) = log(1 + exp(v)); returns v itself above the threshold, where exp(-v) < 1e-17.
    return key - torch.nn.functional.softplus(v, threshold=40)


def _without_replacement(alpha, transitions, n, lengths, end, generator, noise=None) -> Tensor:
    B, L, T = alpha.shape
    device = alpha.device
    # Beams: n partial sequences (y_i .. y_{m-1}) per sentence of length m. Before a sentence starts (and
    # for ever in a length-0 sentence) beam 0 is the root (the empty suffix, probability 1,
    # perturbed value 0: the values' common shift does not change their order) and the others
    # are dead (-inf).
    phi = alpha.new_full((B, n), NEG_INF)  # log P(partial sequence)
    phi[:, 0] = 0
    key = phi.clone()  # its perturbed log-probability (the largest G_y below it)
    tags = torch.zeros((B, n), dtype=torch.long, device=device)  # its first tag y_i
    rows = torch.arange(n, device=device).expand(B, n)
    parents, chosen_tags = [], []  # per step (position L-1 first): parent beam and tag of each beam
    for i in range(L - 1, -1, -1):
        cond = _log_normalise(_last_logits(alpha, i, end)).unsqueeze(1)  # (B, 1, T): log P(y_i), i the last
        if i + 1 < L:
            # table[b, t, s] = log P(y_i = s | y_{i+1} = t): (B, T, T), normalised once per position
            # (O(B T^2), as the forward), then read at each beam's t: (B, n, T).
            table = _log_normalise(alpha[:, i].unsqueeze(1) + transitions_at(transitions, i + 1).transpose(-1, -2))
            into = table.gather(1, tags.unsqueeze(2).expand(B, n, T))
            cond = torch.where((lengths == i + 1).view(B, 1, 1), cond, into)
        child_phi = phi.unsqueeze(2) + cond
        child_key = _conditional_gumbels(child_phi, key, generator, None if noise is None else noise[L - 1 - i])
        top_key, code = child_key.view(B, n * T).topk(n, dim=1)  # sorted, largest first
        active = (i < lengths).unsqueeze(1)
        phi = torch.where(active, child_phi.view(B, n * T).gather(1, code), phi)
        key = torch.where(active, top_key, key)
        tags = torch.where(active, code % T, tags)
        parents.append(torch.where(active, code // T, rows))
        chosen_tags.append(torch.where(active, code % T, -1))
    paths = torch.empty((B, n, L), dtype=torch.long, device=device)
    beam = rows
    for i in range(L):  # the final beams, in descending order of their perturbed value, traced back
        step = L - 1 - i
        paths[:, :, i] = chosen_tags[step].gather(1, beam)
        beam = parents[step].gather(1, beam)
    return paths.masked_fill_((key == NEG_INF).unsqueeze(2), -1)
