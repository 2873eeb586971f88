"""`allowed` (partial labels, forced tags), crfkit.partial_nll and `mask` with holes / left padding,
through the public ops on every backend: against brute-force enumeration restricted to the allowed
sequences, and against the sentences with their masked positions removed."""
import math

import pytest
import torch

import brute_force
import crfkit
from conftest import random_crf


def random_allowed(B, L, T, seed, share=0.5):
    """(B, L, T) bool: each position allows a random non-empty subset of the tags."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(B, L, T, generator=g) < share
    allowed[torch.arange(B)[:, None], torch.arange(L)[None, :], torch.randint(0, T, (B, L), generator=g)] = True
    return allowed


def allowed_sequences(seqs, allowed_b):
    return [(s, seq) for s, seq in seqs if all(bool(allowed_b[i, t]) for i, t in enumerate(seq))]


@pytest.mark.parametrize("L, T", [(1, 3), (3, 2), (4, 3), (2, 4)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_allowed_restricts_every_op_to_the_allowed_sequences(backend, L, T, dtype):
    emissions, transitions, lengths, start, end = random_crf(5, L, T, dtype=dtype, seed=L * 5 + T)
    transitions[0, 1] = -math.inf  # a constraint too
    allowed = random_allowed(5, L, T, seed=L + T)
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    log_z = crfkit.log_partition(emissions, transitions, lengths, start, end, allowed=allowed)
    mu = crfkit.marginals(emissions, transitions, lengths, start, end, allowed=allowed)
    kbest = crfkit.kbest_viterbi(emissions, transitions, 6, lengths, start, end, allowed=allowed)
    best = crfkit.viterbi(emissions, transitions, lengths, start, end, allowed=allowed)
    nll = crfkit.partial_nll(emissions, transitions, allowed, lengths, start, end)
    for b in range(5):
        n = int(lengths[b])
        every = brute_force.all_sequences(emissions[b].double(), transitions.double(), start.double(), end.double(), n)
        seqs = allowed_sequences(every, allowed[b])
        expected = brute_force.log_partition(seqs)
        if expected == -math.inf:
            assert log_z[b].item() == -math.inf and nll[b].item() == math.inf
        else:
            assert log_z[b].item() == pytest.approx(expected, rel=tol, abs=tol)
            expected_nll = brute_force.log_partition(every) - expected
            assert nll[b].item() == pytest.approx(expected_nll, rel=tol * 10, abs=tol * 10)
        expected_mu = torch.tensor(brute_force.marginals(seqs, L, T), dtype=torch.float64)
        torch.testing.assert_close(mu[b].double(), expected_mu, atol=tol * 10, rtol=0)
        for j in range(6):
            if j < len(seqs):
                assert kbest.scores[b, j].item() == pytest.approx(seqs[j][0], rel=tol, abs=tol)
                if dtype == torch.float64:
                    assert kbest.paths[b, j, :n].tolist() == list(seqs[j][1])
            else:
                assert kbest.scores[b, j].item() == -math.inf
        if seqs:
            assert best.paths[b, :n].tolist() == list(seqs[0][1]) or dtype == torch.float32


def test_one_hot_allowed_tags_give_the_ordinary_nll(backend):
    emissions, transitions, lengths, start, end = random_crf(6, 7, 5, seed=1)
    gold = torch.randint(0, 5, (6, 7))
    one_hot = torch.nn.functional.one_hot(gold, 5).bool()
    partial = crfkit.partial_nll(emissions, transitions, one_hot, lengths, start, end)
    ordinary = (crfkit.log_partition(emissions, transitions, lengths, start, end)
                - crfkit.sequence_score(emissions, transitions, gold, lengths, start, end))
    torch.testing.assert_close(partial, ordinary, rtol=1e-12, atol=1e-12)
    # ... and the crfkit.CRF module's loss with allowed= is that of the gold tags.
    crf = crfkit.CRF(5).double()
    torch.testing.assert_close(crf(emissions, allowed=one_hot, lengths=lengths, reduction="none"),
                               crf(emissions, gold, lengths=lengths, reduction="none"), rtol=1e-12, atol=1e-12)


def test_partial_nll_gradients(backend):
    emissions, transitions, lengths, start, end = random_crf(3, 4, 3, seed=4)
    allowed = random_allowed(3, 4, 3, seed=9)
    inputs = [x.clone().requires_grad_() for x in (emissions, transitions, start, end)]

    def loss(em, tr, st, en):
        return crfkit.partial_nll(em, tr, allowed, lengths, st, en)

    assert torch.autograd.gradcheck(loss, inputs)
    # The gradient with respect to emissions is marginals - marginals given the allowed set.
    em = emissions.clone().requires_grad_()
    crfkit.partial_nll(em, transitions, allowed, lengths, start, end).sum().backward()
    expected = (crfkit.marginals(emissions, transitions, lengths, start, end)
                - crfkit.marginals(emissions, transitions, lengths, start, end, allowed=allowed))
    torch.testing.assert_close(em.grad, expected)


def test_a_position_that_allows_no_tag_is_an_error():
    emissions, transitions, lengths, _, _ = random_crf(3, 4, 3, ragged=False)
    allowed = torch.ones(3, 4, 3, dtype=torch.bool)
    allowed[2, 1] = False
    with pytest.raises(ValueError, match=r"allowed\[2, 1\] allows no tag"):
        crfkit.log_partition(emissions, transitions, allowed=allowed)
    # ... but at a padded position it does not matter.
    crfkit.log_partition(emissions, transitions, torch.tensor([4, 4, 1]), allowed=allowed)


@pytest.mark.parametrize("bad, error, message", [
    (torch.ones(3, 4, 3, dtype=torch.uint8), TypeError, "allowed must be a bool tensor"),
    (torch.ones(3, 4, 2, dtype=torch.bool), ValueError, r"allowed must have shape \(batch, seq_len, num_tags\)"),
    ([[True]], TypeError, "allowed must be a bool tensor"),
])
def test_bad_allowed_names_the_argument(bad, error, message):
    emissions, transitions, *_ = random_crf(3, 4, 3)
    with pytest.raises(error, match=message):
        crfkit.viterbi(emissions, transitions, allowed=bad)


MASKS = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [0, 1, 0, 0, 0]],
                     dtype=torch.bool)  # a hole, left padding, full, empty, one real position


def test_a_mask_with_holes_gives_what_the_sentences_without_the_masked_positions_give(backend):
    emissions, transitions, _, start, end = random_crf(5, 5, 3, seed=6)
    allowed = random_allowed(5, 5, 3, seed=6)
    log_z = crfkit.log_partition(emissions, transitions, start=start, end=end, mask=MASKS, allowed=allowed)
    mu = crfkit.marginals(emissions, transitions, start=start, end=end, mask=MASKS)
    best = crfkit.viterbi(emissions, transitions, start=start, end=end, mask=MASKS)
    kbest = crfkit.kbest_viterbi(emissions, transitions, 3, start=start, end=end, mask=MASKS)
    tags = torch.randint(0, 3, (5, 5))
    scores = crfkit.sequence_score(emissions, transitions, tags, start=start, end=end, mask=MASKS)
    counts = crfkit.expected_transition_counts(emissions, transitions, start=start, end=end, mask=MASKS)
    for b in range(5):
        real = MASKS[b].nonzero().squeeze(1)
        em = emissions[b:b + 1, real]
        torch.testing.assert_close(log_z[b:b + 1], crfkit.log_partition(em, transitions, start=start, end=end,
                                                                        allowed=allowed[b:b + 1, real]))
        torch.testing.assert_close(mu[b, real], crfkit.marginals(em, transitions, start=start, end=end)[0])
        assert bool((mu[b, ~MASKS[b]] == 0).all())
        assert torch.equal(best.paths[b, real], crfkit.viterbi(em, transitions, start=start, end=end).paths[0])
        assert bool((best.paths[b, ~MASKS[b]] == -1).all()) and bool((kbest.paths[b][:, ~MASKS[b]] == -1).all())
        compact = crfkit.kbest_viterbi(em, transitions, 3, start=start, end=end)
        assert torch.equal(kbest.paths[b][:, real], compact.paths[0])
        torch.testing.assert_close(kbest.log_probs[b], compact.log_probs[0])
        torch.testing.assert_close(scores[b:b + 1], crfkit.sequence_score(em, transitions, tags[b:b + 1, real],
                                                                          start=start, end=end))
        torch.testing.assert_close(counts[b:b + 1], crfkit.expected_transition_counts(em, transitions, start=start,
                                                                                      end=end))


def test_gradients_through_a_mask_with_holes(backend):
    emissions, transitions, _, start, end = random_crf(5, 5, 3, seed=7)
    em = emissions.clone().requires_grad_()
    crfkit.log_partition(em, transitions, start=start, end=end, mask=MASKS).sum().backward()
    torch.testing.assert_close(em.grad, crfkit.marginals(emissions, transitions, start=start, end=end, mask=MASKS))
    assert torch.autograd.gradcheck(lambda e, t: crfkit.marginals(e, t, start=start, end=end, mask=MASKS),
                                    [emissions.clone().requires_grad_(), transitions.clone().requires_grad_()])


def test_a_left_aligned_mask_is_the_same_as_its_lengths(backend):
    emissions, transitions, lengths, start, end = random_crf(6, 5, 3, seed=8)
    mask = torch.arange(5) < lengths[:, None]
    assert torch.equal(crfkit.kbest_viterbi(emissions, transitions, 4, start=start, end=end, mask=mask).paths,
                       crfkit.kbest_viterbi(emissions, transitions, 4, lengths, start, end).paths)
    torch.testing.assert_close(crfkit.log_partition(emissions, transitions, start=start, end=end, mask=mask),
                               crfkit.log_partition(emissions, transitions, lengths, start, end), rtol=0, atol=0)


def test_the_distribution_takes_masks_with_holes_and_allowed():
    emissions, transitions, _, start, end = random_crf(5, 5, 3, seed=10)
    allowed = random_allowed(5, 5, 3, seed=10)
    crf = crfkit.LinearChainCRF(emissions, transitions, start=start, end=end, mask=MASKS, allowed=allowed)
    torch.testing.assert_close(crf.marginals, crfkit.marginals(emissions, transitions, start=start, end=end,
                                                               mask=MASKS, allowed=allowed))
    torch.testing.assert_close(crf.log_partition, crfkit.log_partition(emissions, transitions, start=start, end=end,
                                                                       mask=MASKS, allowed=allowed))
    assert bool((crf.argmax[~MASKS] == -1).all())
    best = crf.kbest(2)
    found = best.log_probs > -math.inf  # (a sentence may allow fewer than 2 sequences)
    torch.testing.assert_close(crf.log_prob(best.paths.clamp(min=0))[found], best.log_probs[found])
    assert bool((crf.entropy() >= -1e-12).all())
    other = crfkit.LinearChainCRF(emissions * 0.5, transitions, start=start, end=end, mask=MASKS)
    assert bool((crf.kl_divergence(other) >= -1e-9).all())
    with pytest.raises(ValueError, match="the same mask"):
        crf.kl_divergence(crfkit.LinearChainCRF(emissions, transitions, MASKS.sum(1)))  # same lengths, no holes


@pytest.mark.parametrize("kwargs, error, message", [
    ({"mask": torch.ones(5, 4, dtype=torch.bool)}, ValueError, r"mask must have shape \(batch, seq_len\) = \(5, 5\)"),
    ({"mask": torch.ones(5, 5)}, TypeError, "mask must be a bool"),
    ({"mask": torch.full((5, 5), 2)}, ValueError, "mask must hold only 0 and 1"),
    ({"mask": MASKS, "lengths": torch.full((5,), 5)}, ValueError, "give lengths or mask, not both"),
])
def test_bad_masks_name_the_argument(kwargs, error, message):
    emissions, transitions, *_ = random_crf(5, 5, 3)
    with pytest.raises(error, match=message):
        crfkit.marginals(emissions, transitions, **kwargs)


def test_the_crf_module_takes_allowed_in_every_method():
    torch.manual_seed(0)
    crf = crfkit.CRF(3).double()
    emissions = torch.randn(2, 4, 3, dtype=torch.float64)
    allowed = random_allowed(2, 4, 3, seed=3)
    transitions, start, end = crf.constrained_parameters()
    assert torch.equal(crf.decode(emissions, allowed=allowed).paths,
                       crfkit.viterbi(emissions, transitions, start=start, end=end, allowed=allowed).paths)
    torch.testing.assert_close(crf.marginals(emissions, allowed=allowed),
                               crfkit.marginals(emissions, transitions, start=start, end=end, allowed=allowed))
    torch.testing.assert_close(crf(emissions, allowed=allowed, reduction="sum"),
                               crfkit.partial_nll(emissions, transitions, allowed, start=start, end=end).sum())
    with pytest.raises(ValueError, match="give tags .* or allowed .*, exactly one"):
        crf(emissions)
