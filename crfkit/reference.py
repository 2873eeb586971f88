"""Plain-PyTorch reference for every crfkit op: log space, one loop over positions, no tricks.

It is the parity oracle for the compiled kernels (and is itself checked against brute-force
enumeration in tests/test_reference.py) and the fallback when the extension is missing.
Gradients come from autograd. Argument checking is crfkit._arguments' job (crfkit.functional
calls it before a backend); these functions assume well-formed inputs but accept the same
optional arguments as the public API.

Shapes: emissions (B, L, T); transitions (T, T) as [from, to], or per example (B, Lt, T, T) with
Lt = 1 (one matrix per sentence) or Lt = L (transitions[b, i] scores y_{i-1} -> y_i; [:, 0] is
never read); start, end (T,), or (B, T) beside per-example transitions; lengths (B,).
Scores are accumulated as ((score + transitions) + emissions) left to right, exactly like the
compiled kernels, so decoded scores and ties agree to the last bit.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

NEG_INF = float("-inf")

# As a backend (crfkit.backends.CRFBackend): these functions check no lengths or tags, so the
# front end checks their values on every device.
VALUES_CHECKED_ON_DEVICE = ()
# Every op here takes per-example transitions (B, Lt, T, T) and start / end (B, T), on any device ("*").
PER_EXAMPLE_DEVICES = ("*",)


def _defaults(emissions: Tensor, lengths: Optional[Tensor], start: Optional[Tensor], end: Optional[Tensor]):
    B, L, T = emissions.shape
    if lengths is None:
        lengths = torch.full((B,), L, dtype=torch.long, device=emissions.device)
    if start is None:
        start = emissions.new_zeros(T)
    if end is None:
        end = emissions.new_zeros(T)
    return lengths.long(), start, end


def _check_values(emissions: Tensor, transitions: Tensor, lengths: Tensor, start: Tensor, end: Tensor):
    """NaN / +inf checks that the compiled kernels do while they scan, with their messages."""
    def bad(x):
        return torch.isnan(x) | (x == float("inf"))

    for name, x, what in (("transitions", transitions, "a transition"), ("start", start, "a first tag"),
                          ("end", end, "a last tag")):
        if bool(bad(x).any()):
            raise ValueError(f"crfkit: {name} contains NaN or +inf (use -inf to forbid {what})")
    valid = _valid_positions(lengths, emissions.shape[1]).unsqueeze(-1)
    bad_sentences = (bad(emissions) & valid).flatten(1).any(1).nonzero()
    if len(bad_sentences):
        raise ValueError(f"crfkit: emissions[{int(bad_sentences[0])}] contains NaN or +inf within its length "
                         "(use -inf to forbid a tag)")


def _valid_positions(lengths: Tensor, L: int) -> Tensor:
    """(B, L) bool: position i of sentence b is real."""
    return torch.arange(L, device=lengths.device) < lengths.unsqueeze(1)


def transitions_at(transitions: Tensor, i: int) -> Tensor:
    """The transition scores into position i >= 1: (T, T) shared by the batch, or (B, T, T) for
    per-example transitions (B, Lt, T, T) or (B, T, T). Both broadcast against (B, T, 1) forward
    scores."""
    if transitions.dim() <= 3:
        return transitions
    return transitions[:, i if transitions.shape[1] > 1 else 0]


def tag_scores(scores: Tensor, tags: Tensor) -> Tensor:
    """start / end scores of given tags: scores (T,) or (B, T), tags (B, N) -> (B, N)."""
    return scores[tags] if scores.dim() == 1 else scores.gather(1, tags)


def forward_log_scores(emissions: Tensor, transitions: Tensor, lengths: Optional[Tensor] = None,
                       start: Optional[Tensor] = None) -> Tensor:
    """alpha (B, L, T): alpha[b, i, t] = log of the summed exp-scores of the prefixes y_0 .. y_i
    with y_i = t (start and the emissions up to position i included); -inf at padded positions.
    log Z = logsumexp_t(alpha[b, n - 1, t] + end[t]). Differentiable."""
    lengths, start, _ = _defaults(emissions, lengths, start, None)
    B, L, T = emissions.shape
    valid = _valid_positions(lengths, L)
    emissions = emissions.masked_fill(~valid.unsqueeze(-1), 0)
    alphas = []
    if L > 0:
        alpha = start + emissions[:, 0]
        alphas.append(alpha)
        for i in range(1, L):
            alpha = safe_logsumexp(alpha.unsqueeze(2) + transitions_at(transitions, i), dim=1) + emissions[:, i]
            alphas.append(alpha)
    out = torch.stack(alphas, 1) if alphas else emissions.new_zeros(B, 0, T)
    return out.masked_fill(~valid.unsqueeze(-1), NEG_INF)


def backward_log_scores(emissions: Tensor, transitions: Tensor, lengths: Optional[Tensor] = None,
                        end: Optional[Tensor] = None) -> Tensor:
    """beta (B, L, T): beta[b, i, t] = log of the summed exp-scores of the suffixes after position
    i given y_i = t (the transitions and emissions of positions i+1 .. n-1, and end); -inf at padded
    positions. alpha + beta - log Z is the log of the marginals. Differentiable."""
    lengths, _, end = _defaults(emissions, lengths, None, end)
    B, L, T = emissions.shape
    valid = _valid_positions(lengths, L)
    emissions = emissions.masked_fill(~valid.unsqueeze(-1), 0)
    end = end.expand(B, T)
    betas = [end] * L
    beta = end
    for i in range(L - 2, -1, -1):
        into_next = transitions_at(transitions, i + 1) + (emissions[:, i + 1] + beta).unsqueeze(1)  # (B, T, T)
        step = safe_logsumexp(into_next, dim=2)
        # The last position of sentence b is n - 1: its beta is end; positions after it are padding.
        beta = torch.where((i + 1 < lengths).unsqueeze(1), step, end)
        betas[i] = beta
    out = torch.stack(betas, 1) if L else emissions.new_zeros(B, 0, T)
    return out.masked_fill(~valid.unsqueeze(-1), NEG_INF)


def safe_logsumexp(x: Tensor, dim: int) -> Tensor:
    """logsumexp whose value is -inf and whose gradient is 0 (not NaN) when every term is -inf."""
    m = x.amax(dim, keepdim=True).detach()
    m = m.masked_fill(~torch.isfinite(m), 0)
    s = (x - m).exp().sum(dim)
    nonzero = s > 0
    out = torch.where(nonzero, s, torch.ones_like(s)).log() + m.squeeze(dim)
    return torch.where(nonzero, out, torch.full_like(out, NEG_INF))


def log_partition(emissions, transitions, lengths=None, start=None, end=None) -> Tensor:
    """log Z per sentence: (B,). A length-0 sentence has one empty sequence: log Z = 0."""
    lengths, start, end = _defaults(emissions, lengths, start, end)
    _check_values(emissions, transitions, lengths, start, end)
    B, L, T = emissions.shape
    if L == 0:
        return emissions.sum(dim=(1, 2))  # zeros that stay in the autograd graph
    # Padded positions may hold anything; zero them so that not even a NaN gradient leaks.
    emissions = emissions.masked_fill(~_valid_positions(lengths, L).unsqueeze(-1), 0)
    alpha = start + emissions[:, 0]
    for i in range(1, L):
        step = safe_logsumexp(alpha.unsqueeze(2) + transitions_at(transitions, i), dim=1) + emissions[:, i]
        alpha = torch.where((i < lengths).unsqueeze(1), step, alpha)
    log_z = safe_logsumexp(alpha + end, dim=1)
    return torch.where(lengths == 0, torch.zeros_like(log_z), log_z)


def marginals(emissions, transitions, lengths=None, start=None, end=None) -> Tensor:
    """P(y_i = t | x) = d log Z / d emissions[b, i, t]: (B, L, T), zero at padded positions.

    Differentiable (the graph is kept) when grad mode is on and an input requires grad.
    """
    if emissions.numel() == 0:
        return torch.zeros_like(emissions)
    create_graph = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (emissions, transitions, start, end)
    )
    with torch.enable_grad():
        leaf = emissions if emissions.requires_grad else emissions.detach().requires_grad_()
        log_z = log_partition(leaf, transitions, lengths, start, end)
        (mu,) = torch.autograd.grad(log_z.sum(), leaf, create_graph=create_graph)
    return mu


def expected_transition_counts(emissions, transitions, lengths=None, start=None, end=None) -> Tensor:
    """E[number of s -> t transitions] per sentence: (B, T, T), the pairwise marginals
    P(y_{i-1} = s, y_i = t | x) summed over positions i (whatever the shape of transitions).
    Differentiable (the graph is kept) when grad mode is on and an input requires grad."""
    counts = transition_gradients(emissions, transitions, lengths, start, end)
    return counts.sum(1) if counts.dim() == 4 else counts


def transition_gradients(emissions, transitions, lengths=None, start=None, end=None) -> Tensor:
    """d log Z_b / d transitions for each sentence b: (B, T, T) for transitions (T, T) or
    (B, 1, T, T), the pairwise marginals summed over positions; (B, L, T, T) for per-position
    transitions (B, L, T, T): the pairwise marginals P(y_{i-1} = s, y_i = t | x) at each position
    (0 at position 0 and at padding).

    The kernels take one (T, T) transitions tensor shared by the batch and so only give the batch
    sum; here each sentence gets its own copy of the transitions (the log-space recursion
    broadcasts over a (B, T, T) tensor unchanged) and autograd returns the per-sentence gradient.
    """
    B, L, T = emissions.shape
    per_sentence_shape = (B, T, T) if transitions.dim() == 2 else tuple(transitions.shape)
    if B == 0 or L <= 1:  # no transition is ever read: zeros, connected to the inputs' graph
        # (nan_to_num: a -inf score must not turn 0 * score into NaN)
        finite = transitions.nan_to_num(0.0, 0.0, 0.0).sum() + emissions.nan_to_num(0.0, 0.0, 0.0).sum()
        return emissions.new_zeros(per_sentence_shape) + 0 * finite
    create_graph = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (emissions, transitions, start, end)
    )
    with torch.enable_grad():
        per_sentence = transitions.expand(B, T, T) if transitions.dim() == 2 else transitions
        # A leaf to differentiate against when nothing is recorded, or when only the emissions
        # (or start / end) require grad and the transitions are frozen.
        if not create_graph or not per_sentence.requires_grad:
            per_sentence = per_sentence.detach().clone().requires_grad_()
        log_z = log_partition(emissions, per_sentence, lengths, start, end)
        (counts,) = torch.autograd.grad(log_z.sum(), per_sentence, create_graph=create_graph)
    return counts


def marginals_and_transition_counts(emissions, transitions, lengths=None, start=None, end=None):
    """(marginals, expected_transition_counts): two autograd passes here, one after the other
    (the compiled backend gets both from one forward-backward)."""
    return (marginals(emissions, transitions, lengths, start, end),
            expected_transition_counts(emissions, transitions, lengths, start, end))


def viterbi(emissions, transitions, lengths=None, start=None, end=None):
    """Best path and its score: (scores (B,), paths (B, L) int64); the first row of k-best."""
    scores, paths = kbest_viterbi(emissions, transitions, 1, lengths, start, end)[:2]
    return scores[:, 0], paths[:, 0]


def kbest_viterbi(emissions, transitions, k: int, lengths=None, start=None, end=None):
    """The k best distinct sequences: (scores (B, k), paths (B, k, L), log_probs (B, k)).

    Each (position, tag) keeps its k best prefixes ending there, sorted; the k best at the next
    position come from a stable descending sort over the T*k extended candidates, laid out
    predecessor-major so that ties go to the smaller predecessor tag, then the earlier rank.
    Missing rows (fewer than k allowed sequences) hold path -1 and score -inf.
    """
    lengths, start, end = _defaults(emissions, lengths, start, end)
    _check_values(emissions, transitions, lengths, start, end)
    B, L, T = emissions.shape
    paths = torch.full((B, k, L), -1, dtype=torch.long, device=emissions.device)
    if L == 0:
        scores = emissions.new_full((B, k), NEG_INF)
        scores[:, 0] = 0
        return scores, paths, scores.clone()
    emissions = emissions.masked_fill(~_valid_positions(lengths, L).unsqueeze(-1), 0)
    lists = emissions.new_full((B, T, k), NEG_INF)  # lists[b, t, r]: r-th best prefix ending in t
    lists = torch.cat([(start + emissions[:, 0]).unsqueeze(2), lists[:, :, 1:]], dim=2)
    backpointers = []  # backpointers[i - 1][b, t, r] = s * k + r' of the prefix extended at i
    for i in range(1, L):
        into = transitions_at(transitions, i).view(-1, T, 1, T)  # (1 or B, from, 1, to)
        cand = (lists.unsqueeze(3) + into).permute(0, 3, 1, 2).reshape(B, T, T * k)
        values, codes = cand.sort(dim=2, descending=True, stable=True)
        step = values[..., :k] + emissions[:, i].unsqueeze(2)
        lists = torch.where((i < lengths).view(B, 1, 1), step, lists)
        backpointers.append(codes[..., :k])
    final = (lists + end.view(-1, T, 1)).reshape(B, T * k)
    scores, codes = final.sort(dim=1, descending=True, stable=True)
    scores, codes = scores[:, :k], codes[:, :k]
    tag, rank = codes // k, codes % k
    for i in reversed(range(L)):
        active = (i < lengths).unsqueeze(1)
        paths[:, :, i] = torch.where(active, tag, -1)
        if i > 0:
            code = backpointers[i - 1].reshape(B, T * k).gather(1, tag * k + rank)
            tag, rank = torch.where(active, code // k, tag), torch.where(active, code % k, rank)
    missing = scores == NEG_INF
    paths = paths.masked_fill(missing.unsqueeze(2), -1)
    empty = (lengths == 0).unsqueeze(1)
    first = torch.arange(k, device=emissions.device) == 0
    scores = torch.where(empty, torch.where(first, 0.0, NEG_INF).to(scores.dtype), scores)
    log_z = log_partition(emissions, transitions, lengths, start, end)
    return scores, paths, log_probs_from_scores(scores, log_z)


def log_probs_from_scores(scores: Tensor, log_z: Tensor) -> Tensor:
    """scores (B, K) - log Z (B,), keeping -inf for missing rows (even where log Z is -inf too).

    log Z is -inf only when every row is missing; clamped to the dtype's lowest finite value
    there, -inf - log Z stays -inf instead of NaN. (Two ops instead of the compare, select and
    subtract of a torch.where: 7-11 us instead of 12-27 us per call, which is felt by small
    k-best calls. Gradients agree with the select wherever the upstream gradient at missing rows
    is 0, as it is through exp, softmax, masking, clamp or nan_to_num.)"""
    return scores - log_z.clamp(min=torch.finfo(log_z.dtype).min).unsqueeze(1)


def log_likelihood_from_scores(scores: Tensor, log_z: Tensor) -> Tensor:
    """log P(y) = s(y) - log Z of given sequences: scores (B,) or (B, N), log_z (B,).

    Where log Z = -inf (every sequence of the sentence forbidden, so each score is -inf too)
    the result is -inf with gradient 0, not NaN: the sequence has no probability, and such a
    sentence gives no gradient (as its marginals give none). Unlike log_probs_from_scores, the
    upstream gradient there need not be 0: a loss sums these."""
    log_z = log_z if scores.dim() == 1 else log_z.unsqueeze(1)
    return torch.where(log_z == NEG_INF, NEG_INF, scores - log_z)


def sequence_score(emissions, transitions, tags, lengths=None, start=None, end=None) -> Tensor:
    """Score of given tag sequences: tags (B, L) -> (B,), or (B, N, L) -> (B, N)."""
    lengths, start, end = _defaults(emissions, lengths, start, end)
    _check_values(emissions, transitions, lengths, start, end)
    squeeze = tags.dim() == 2
    if squeeze:
        tags = tags.unsqueeze(1)
    B, N, L = tags.shape
    valid = _valid_positions(lengths, L).unsqueeze(1)  # (B, 1, L)
    safe = torch.where(valid, tags, 0)
    emit = emissions.unsqueeze(1).expand(B, N, L, emissions.shape[2]).gather(3, safe.unsqueeze(3)).squeeze(3)
    scores = emissions.new_zeros(B, N)
    if L > 0:
        scores = tag_scores(start, safe[:, :, 0]) + emit[:, :, 0]
        batch = torch.arange(B, device=tags.device).view(B, 1)
        for i in range(1, L):
            into = transitions_at(transitions, i)
            prev, cur = safe[:, :, i - 1], safe[:, :, i]
            pair = into[prev, cur] if into.dim() == 2 else into[batch, prev, cur]
            step = (scores + pair) + emit[:, :, i]
            scores = torch.where(valid[:, :, i], step, scores)
        last = safe.gather(2, (lengths - 1).clamp(min=0).view(B, 1, 1).expand(B, N, 1)).squeeze(2)
        scores = scores + tag_scores(end, last)
        scores = torch.where((lengths == 0).unsqueeze(1), torch.zeros_like(scores), scores)
    return scores.squeeze(1) if squeeze else scores


def gumbel_noise(shape, like: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """Standard Gumbel noise -log(-log(U)) of `shape`, U uniform in [tiny, 1) (so the noise is
    finite), in the dtype and on the device of `like`, from `generator` (torch's default when
    None). torch.rand draws its elements one after the other on the CPU, so one call of shape
    (L, *rest) gives what L calls of shape rest give in turn: the compiled sampling kernel's noise
    (all positions at once) is then the PyTorch sampler's (one position at a time), bit for bit.
    (torch.rand is several times faster than exponential_ on the CPU.)"""
    u = torch.rand(shape, dtype=like.dtype, device=like.device, generator=generator)
    return u.clamp_(min=torch.finfo(like.dtype).tiny).log_().neg_().log_().neg_()


def sample_with_replacement(emissions, transitions, n: int, lengths=None, start=None, end=None,
                            generator: Optional[torch.Generator] = None) -> Tensor:
    """n exact samples per sentence, with replacement: paths (B, n, L) int64, -1 at padded
    positions and in every row of a sentence with no allowed sequence (forward filtering,
    backward sampling by the Gumbel-max trick, in PyTorch: crfkit/sampling.py, which also draws
    without replacement). Every random number comes from `generator`. Not differentiable."""
    from .sampling import sample  # (crfkit.sampling builds on this module's forward scores)

    lengths, start, end = _defaults(emissions, lengths, start, end)
    return sample(emissions, transitions, n, lengths, start, end, replacement=True, generator=generator)


def sample_without_replacement(emissions, transitions, n: int, lengths=None, start=None, end=None,
                               generator: Optional[torch.Generator] = None) -> Tensor:
    """n distinct sequences per sentence, an exact sample without replacement in the order of
    sequential drawing: paths (B, n, L) int64, -1 at padded positions and in the rows after the
    last allowed sequence (stochastic beam search, the Gumbel-top-k trick over the CRF's
    right-to-left factorisation, in PyTorch: crfkit/sampling.py). Every random number comes from
    `generator`. Not differentiable."""
    from .sampling import sample  # (crfkit.sampling builds on this module's forward scores)

    lengths, start, end = _defaults(emissions, lengths, start, end)
    return sample(emissions, transitions, n, lengths, start, end, replacement=False, generator=generator)


def gradients_by_autograd(fn, inputs, grad_output: Tensor):
    """Gradients of <fn(emissions, transitions, lengths, start, end), grad_output> for
    inputs = (emissions, transitions, lengths, start, end), by autograd over fn (a function of
    this module), in the order of the inputs with None for lengths. The backends' derivative
    where they have no kernel of their own (the counts' on CUDA, higher orders in numba).
    Under create_graph (grad mode on inside a backward) the inputs that require grad are used as
    they are, so that the result can be differentiated again."""
    emissions, transitions, lengths, start, end = inputs
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        params = [x if create_graph and x.requires_grad else x.detach().requires_grad_()
                  for x in (emissions, transitions, start, end)]
        out = fn(params[0], params[1], lengths, params[2], params[3])
        grads = torch.autograd.grad(out, params, grad_output, allow_unused=True, create_graph=create_graph)
    filled = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, params)]
    return filled[0], filled[1], None, filled[2], filled[3]
