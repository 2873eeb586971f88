"""Every backend (the reference first among them) against brute-force enumeration of all T**n
tag sequences: log Z, marginals, Viterbi and the complete k-best order with scores, on tiny
sizes (n up to 6, T up to 4), with ragged lengths, start / end scores and constraints."""
import math

import pytest
import torch

import crfkit
import brute_force
from conftest import random_crf

SIZES = [(1, 1), (1, 4), (2, 3), (3, 2), (4, 3), (5, 2), (6, 3), (3, 4), (5, 4), (6, 2)]  # (n, T)


def check_against_enumeration(emissions, transitions, lengths, start, end, k_extra=3, tol=1e-10):
    B, L, T = emissions.shape
    enumerations = [brute_force.all_sequences(emissions[b], transitions, start, end, int(lengths[b])) for b in range(B)]
    k = max(len(e) for e in enumerations) + k_extra  # more rows than any sentence has sequences

    log_z = crfkit.log_partition(emissions, transitions, lengths, start, end)
    mu = crfkit.marginals(emissions, transitions, lengths, start, end)
    scores, paths = crfkit.viterbi(emissions, transitions, lengths, start, end)
    best = crfkit.kbest_viterbi(emissions, transitions, k, lengths, start, end)
    for b, seqs in enumerate(enumerations):
        n = int(lengths[b])
        expected_log_z = brute_force.log_partition(seqs)
        if expected_log_z == -math.inf:
            assert log_z[b].item() == -math.inf
        else:
            assert log_z[b].item() == pytest.approx(expected_log_z, abs=tol, rel=tol)
        assert torch.allclose(mu[b], torch.tensor(brute_force.marginals(seqs, L, T), dtype=mu.dtype), atol=tol)
        # Viterbi = the first sequence in crfkit's order (ties included).
        if seqs:
            assert paths[b, :n].tolist() == list(seqs[0][1])
            assert scores[b].item() == seqs[0][0]
        else:
            assert scores[b].item() == -math.inf
        assert (paths[b, n:] == -1).all()
        # k-best: the complete order, exact scores, log-probs, then missing rows.
        for j in range(k):
            if j < len(seqs):
                s, seq = seqs[j]
                assert best.paths[b, j, :n].tolist() == list(seq), (b, j)
                assert best.scores[b, j].item() == s
                assert best.log_probs[b, j].item() == pytest.approx(s - expected_log_z, abs=tol)
            else:
                assert best.scores[b, j].item() == -math.inf and best.log_probs[b, j].item() == -math.inf
                assert (best.paths[b, j] == -1).all()
            assert (best.paths[b, j, n:] == -1).all()


@pytest.mark.parametrize("n,T", SIZES)
def test_random_scores(backend, n, T):
    check_against_enumeration(*random_crf(4, n, T, seed=n * 10 + T))


@pytest.mark.parametrize("n,T", [(3, 2), (4, 3), (5, 3), (6, 2), (4, 4)])
def test_ties_follow_the_documented_rule(backend, n, T):
    # Scores in {-1, 0, 1}: sums are exact in float64 and many sequences tie.
    check_against_enumeration(*random_crf(4, n, T, integer=True, seed=7 * n + T))


def test_all_scores_equal_orders_by_reversed_tags(backend):
    emissions = torch.zeros(1, 2, 2, dtype=torch.float64)
    best = crfkit.kbest_viterbi(emissions, torch.zeros(2, 2, dtype=torch.float64), 4)
    # Read from the last position backwards, smaller first: (0,0), (1,0), (0,1), (1,1).
    assert best.paths[0].tolist() == [[0, 0], [1, 0], [0, 1], [1, 1]]
    assert torch.allclose(best.log_probs[0], torch.full((4,), math.log(0.25), dtype=torch.float64))


@pytest.mark.parametrize("n,T", [(3, 3), (5, 3), (4, 4), (6, 2)])
def test_with_forbidden_transitions_and_tags(backend, n, T):
    emissions, transitions, lengths, start, end = random_crf(4, n, T, seed=n + 31 * T)
    transitions[0, 1] = transitions[T - 1, 0] = -math.inf
    start[T - 1] = -math.inf
    end[1] = -math.inf
    emissions[0, min(1, n - 1), 0] = -math.inf
    check_against_enumeration(emissions, transitions, lengths, start, end)


def test_constraints_from_a_scheme_are_applied_everywhere(backend):
    labels = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    c = crfkit.constraints.allowed_transitions(labels, "BIO")
    trans_mask, start_mask, end_mask = c.as_scores(torch.float64)
    emissions, transitions, lengths, start, end = random_crf(3, 4, 5, seed=5)
    emissions[:, :, 2] += 3.0  # make the forbidden I-PER tempting everywhere
    check_against_enumeration(emissions, transitions + trans_mask, lengths, start + start_mask, end + end_mask)
    best = crfkit.kbest_viterbi(emissions, transitions + trans_mask, 50, lengths, start + start_mask, end + end_mask)
    for b in range(3):
        for j in range(50):
            n = int(lengths[b])
            if best.scores[b, j] > -math.inf:
                assert c.is_allowed(best.paths[b, j, :n].tolist())


def test_every_sequence_forbidden(backend):
    emissions, transitions, lengths, start, end = random_crf(3, 4, 3, seed=3)
    end[:] = -math.inf
    check_against_enumeration(emissions, transitions, lengths, start, end)
