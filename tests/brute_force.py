"""Brute-force enumeration of every tag sequence of one sentence: the oracle the reference
implementation is tested against. Tiny sizes only (T**n sequences)."""
from __future__ import annotations

import itertools
import math

NEG_INF = float("-inf")


def all_sequences(emissions, transitions, start, end, n):
    """Every allowed sequence of length n with its score, in crfkit's order: by descending
    score, ties broken by the tags read from the last position backwards, smaller first.

    emissions (L, T), transitions (T, T) or per position (L, T, T) (transitions[i] scores
    y_{i-1} -> y_i; [0] is never read), start (T,), end (T,) as float64 tensors or lists.
    Scores are accumulated ((s + transition) + emission) left to right, as crfkit does.
    Sequences of score -inf (forbidden) are left out. n = 0 gives [(0.0, ())].
    """
    em, tr, st, en = (x.tolist() if hasattr(x, "tolist") else x for x in (emissions, transitions, start, end))
    if n == 0:
        return [(0.0, ())]
    T = len(st)
    per_position = isinstance(tr[0][0], list)
    out = []
    for seq in itertools.product(range(T), repeat=n):
        s = st[seq[0]] + em[0][seq[0]]
        for i in range(1, n):
            s = (s + (tr[i] if per_position else tr)[seq[i - 1]][seq[i]]) + em[i][seq[i]]
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



def expectation(emissions, transitions, lengths, start, end, feature, shape):
    """(B, *shape): E_p[feature(y)] per sentence from every allowed sequence, DIFFERENTIABLE in
    the four score tensors (emissions (B, L, T)). feature(seq) -> float64 tensor of `shape`;
    zero for a length-0 sentence and where no sequence is allowed."""
    import torch

    rows = []
    for b in range(emissions.shape[0]):
        n = int(lengths[b])
        total = emissions.new_zeros(shape)
        seqs = []
        if n:
            seqs = [seq for _, seq in all_sequences(emissions[b].detach(), transitions.detach(), start.detach(),
                                                    end.detach(), n)]
        if seqs:
            scores = []
            for seq in seqs:
                score = start[seq[0]] + emissions[b, 0, seq[0]]
                for i in range(1, n):
                    score = score + transitions[seq[i - 1], seq[i]] + emissions[b, i, seq[i]]
                scores.append(score + end[seq[-1]])
            p = torch.softmax(torch.stack(scores), 0)
            features = torch.stack([feature(seq).to(emissions.dtype) for seq in seqs])
            total = total + torch.einsum("k,k...->...", p, features)
        rows.append(total)
    return torch.stack(rows)
