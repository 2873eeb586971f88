"""Brute-force enumeration of every tag sequence of one sentence: the oracle the reference
implementation is tested against. Tiny sizes only (T**n sequences)."""
from __future__ import annotations

import itertools
import math

NEG_INF = float("-inf")


def all_sequences(emissions, transitions, start, end, n):
    """Every allowed sequence of length n with its score, in crfkit's order: by descending
    score, ties broken by the tags read from the last position backwards, smaller first.

    emissions (L, T), transitions (T, T), start (T,), end (T,) as float64 tensors or lists.
    Scores are accumulated ((s + transition) + emission) left to right, as crfkit does.
    Sequences of score -inf (forbidden) are left out. n = 0 gives [(0.0, ())].
    """
    em, tr, st, en = (x.tolist() if hasattr(x, "tolist") else x for x in (emissions, transitions, start, end))
    if n == 0:
        return [(0.0, ())]
    T = len(st)
    out = []
    for seq in itertools.product(range(T), repeat=n):
        s = st[seq[0]] + em[0][seq[0]]
        for i in range(1, n):
            s = (s + tr[seq[i - 1]][seq[i]]) + em[i][seq[i]]
        s = s + en[seq[-1]]
        if s != NEG_INF:
            out.append((s, seq))
    out.sort(key=lambda item: (-item[0], tuple(reversed(item[1]))))
    return out


def log_partition(seqs):
    if not seqs:
        return NEG_INF
    m = max(s for s, _ in seqs)
    return m + math.log(sum(math.exp(s - m) for s, _ in seqs))


def marginals(seqs, L, T):
    """(L, T) list of P(y_i = t); zero rows beyond the length and when nothing is allowed."""
    mu = [[0.0] * T for _ in range(L)]
    log_z = log_partition(seqs)
    for s, seq in seqs:
        p = math.exp(s - log_z)
        for i, t in enumerate(seq):
            mu[i][t] += p
    return mu


def sequence_probabilities(emissions, transitions, start, end, n):
    """(sequences, p): every allowed sequence of length n >= 1 of one sentence (all_sequences)
    and its probability (K,) as a tensor DIFFERENTIABLE in the four score tensors (emissions
    (L, T), transitions, start, end); ([], None) when none is allowed."""
    import torch

    seqs = [seq for _, seq in all_sequences(emissions.detach(), transitions.detach(), start.detach(),
                                            end.detach(), n)]
    if not seqs:
        return [], None
    scores = []
    for seq in seqs:
        score = start[seq[0]] + emissions[0, seq[0]]
        for i in range(1, n):
            score = score + transitions[seq[i - 1], seq[i]] + emissions[i, seq[i]]
        scores.append(score + end[seq[-1]])
    return seqs, torch.softmax(torch.stack(scores), 0)
