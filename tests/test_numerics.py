"""Numerics: large scores, -inf everywhere it may appear, every sequence forbidden, the
probability-space fast path against its exact log-space fallback, half precision inputs,
degenerate sizes (B = 0, L = 0, T = 1) and padding that holds garbage."""
import math

import pytest
import torch

import crfkit
import brute_force
from conftest import random_crf

NEG_INF = float("-inf")


def everything(em, tr, ln, s, e, k=5):
    params = [x.detach().clone().requires_grad_() for x in (em, tr, s, e)]
    log_z = crfkit.log_partition(params[0], params[1], ln, params[2], params[3])
    grads = torch.autograd.grad(log_z.sum(), params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
    mu = crfkit.marginals(em, tr, ln, s, e)
    best = crfkit.kbest_viterbi(em, tr, k, ln, s, e)
    return log_z.detach(), grads, mu, best


def assert_no_nan(*tensors):
    for t in tensors:
        assert not torch.isnan(t).any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_scores_of_magnitude_1e4(backend, dtype):
    em, tr, ln, s, e = random_crf(6, 40, 9, scale=1e4)
    log_z, grads, mu, best = everything(em.to(dtype), tr.to(dtype), ln, s.to(dtype), e.to(dtype))
    assert_no_nan(log_z, mu, best.log_probs, *grads)
    assert torch.isfinite(log_z).all()
    with crfkit.use_backend("reference"):
        truth = crfkit.log_partition(em, tr, ln, s, e), crfkit.marginals(em, tr, ln, s, e)
    torch.testing.assert_close(log_z.double(), truth[0], rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
    tol = 2e-3 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(mu.double(), truth[1], atol=tol, rtol=0)
    valid = torch.arange(40) < ln.unsqueeze(1)
    torch.testing.assert_close(mu.sum(-1)[valid].double(), torch.ones(int(valid.sum()), dtype=torch.float64),
                               atol=tol, rtol=0)


def test_fast_path_and_exact_fallback_agree(backend):
    # Transitions spanning 200 nats in float32: exp(-200) underflows, so some columns of the
    # probability-space product must fall back to exact log space; compare with float64 truth.
    em, tr, ln, s, e = random_crf(5, 30, 6, scale=2.0)
    tr[:, 0] -= 200.0
    tr[2, :] += 150.0
    tr[1, 3] = 180.0
    with crfkit.use_backend("reference"):
        truth = crfkit.log_partition(em, tr, ln, s, e), crfkit.marginals(em, tr, ln, s, e)
    log_z, grads, mu, _ = everything(em.float(), tr.float(), ln, s.float(), e.float())
    torch.testing.assert_close(log_z.double(), truth[0], rtol=1e-6, atol=1e-3)
    torch.testing.assert_close(mu.double(), truth[1], atol=1e-4, rtol=0)
    torch.testing.assert_close(grads[0].double(), truth[1], atol=1e-4, rtol=0)


def test_every_sequence_forbidden_gives_minus_inf_and_zero_gradients(backend):
    em, tr, ln, s, e = random_crf(4, 6, 3, ragged=False)
    tr[:, :] = NEG_INF  # no transition allowed: only length-1 sentences have sequences
    ln = torch.tensor([6, 1, 2, 0])
    log_z, grads, mu, best = everything(em, tr, ln, s, e)
    assert log_z[0] == NEG_INF and log_z[2] == NEG_INF
    assert torch.isfinite(log_z[1]) and log_z[3] == 0
    assert_no_nan(log_z, mu, best.log_probs, best.scores, *grads)
    assert (grads[0][[0, 2]] == 0).all() and (mu[[0, 2]] == 0).all()
    assert (best.scores[[0, 2]] == NEG_INF).all() and (best.paths[[0, 2]] == -1).all()
    assert (best.log_probs[[0, 2]] == NEG_INF).all()
    scores, paths = crfkit.viterbi(em, tr, ln, s, e)
    assert (paths[[0, 2]] == -1).all() and (scores[[0, 2]] == NEG_INF).all()


def test_forbidden_tag_at_a_position_and_forbidden_start_end(backend):
    em, tr, ln, s, e = random_crf(3, 5, 4, ragged=False)
    em[:, 2, :3] = NEG_INF  # only tag 3 allowed at position 2
    s[0] = NEG_INF
    e[3] = NEG_INF
    log_z, grads, mu, best = everything(em, tr, ln, s, e, k=20)
    assert_no_nan(log_z, mu, *grads)
    assert torch.allclose(mu[:, 2, 3], torch.ones(3, dtype=mu.dtype))
    assert (mu[:, 0, 0] == 0).all() and (mu[:, 4, 3] == 0).all()
    found = best.scores > NEG_INF
    assert (best.paths[:, :, 2][found] == 3).all() and (best.paths[:, :, 0][found] != 0).all()


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_use_float32(backend, half):
    em, tr, ln, s, e = random_crf(4, 12, 5, dtype=torch.float32, scale=3.0)
    em_half = em.to(half).requires_grad_()
    log_z = crfkit.log_partition(em_half, tr, ln, s, e)  # float32 parameters with half emissions
    assert log_z.dtype == torch.float32
    (grad,) = torch.autograd.grad(log_z.sum(), em_half)
    assert grad.dtype == half and torch.isfinite(grad).all()
    upcast = em.to(half).float()
    torch.testing.assert_close(log_z, crfkit.log_partition(upcast, tr, ln, s, e))
    torch.testing.assert_close(crfkit.marginals(em.to(half), tr.to(half), ln),
                               crfkit.marginals(upcast, tr.to(half).float(), ln))
    best = crfkit.kbest_viterbi(em.to(half), tr, 3, ln, s, e)
    assert best.scores.dtype == torch.float32 and torch.equal(best.paths,
                                                              crfkit.kbest_viterbi(upcast, tr, 3, ln, s, e).paths)


def test_half_precision_large_scores_do_not_overflow(backend):
    # 60000 fits float16 but sums of many of them do not: float32 accumulation keeps log Z finite.
    em = torch.full((2, 50, 3), 60000.0, dtype=torch.float16)
    log_z = crfkit.log_partition(em, torch.zeros(3, 3, dtype=torch.float16))
    assert torch.isfinite(log_z).all() and log_z[0].item() == pytest.approx(50 * 60000 + 50 * math.log(3), rel=1e-6)


def test_degenerate_sizes(backend):
    for B, L, T in [(0, 5, 3), (3, 0, 4), (0, 0, 2), (4, 7, 1)]:
        em, tr, ln, s, e = random_crf(B, L, T)
        log_z, grads, mu, best = everything(em, tr, ln, s, e, k=3)
        scores, paths = crfkit.viterbi(em, tr, ln, s, e)
        assert log_z.shape == (B,) and mu.shape == (B, L, T) and paths.shape == (B, L)
        assert best.paths.shape == (B, 3, L) and best.scores.shape == (B, 3)
        for b in range(B):
            seqs = brute_force.all_sequences(em[b], tr, s, e, int(ln[b]))
            assert len(seqs) == 1  # T = 1 or n = 0: exactly one sequence
            assert log_z[b].item() == pytest.approx(seqs[0][0]) and scores[b].item() == pytest.approx(seqs[0][0])
            assert best.log_probs[b, 0].item() == pytest.approx(0.0, abs=1e-12)
            assert (best.scores[b, 1:] == NEG_INF).all()
        assert_no_nan(log_z, mu, *grads)


def test_length_zero_sentence_conventions(backend):
    em, tr, _, s, e = random_crf(2, 4, 3)
    ln = torch.tensor([0, 4])
    best = crfkit.kbest_viterbi(em, tr, 2, ln, s, e)
    assert best.scores[0].tolist() == [0.0, NEG_INF] and best.log_probs[0].tolist() == [0.0, NEG_INF]
    assert (best.paths[0] == -1).all()
    assert crfkit.log_partition(em, tr, ln, s, e)[0] == 0
    assert crfkit.sequence_score(em, tr, torch.zeros(2, 4, dtype=torch.long), ln, s, e)[0] == 0


def test_garbage_in_padding_is_never_read(backend):
    em, tr, _, s, e = random_crf(3, 8, 4)
    ln = torch.tensor([8, 3, 5])
    clean = everything(em, tr, ln, s, e)
    dirty_em = em.clone()
    dirty_em[1, 3:] = float("nan")
    dirty_em[2, 5:] = float("inf")
    dirty = everything(dirty_em, tr, ln, s, e)
    torch.testing.assert_close(dirty[0], clean[0])
    for a, b in zip(dirty[1], clean[1]):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(dirty[2], clean[2])
    assert torch.equal(dirty[3].paths, clean[3].paths)


def test_k_larger_than_the_number_of_sequences(backend):
    em, tr, ln, s, e = random_crf(3, 3, 2, ragged=False)
    best = crfkit.kbest_viterbi(em, tr, 1000, ln, s, e)
    assert (torch.isfinite(best.scores).sum(1) == 8).all()
    torch.testing.assert_close(torch.logsumexp(best.log_probs, 1), torch.zeros(3, dtype=torch.float64))
    assert (best.paths[:, 8:] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B", [6, 18])  # 18: the C++ backend runs sentences in lane groups of 8
def test_ranges_around_the_fast_path_limit(backend, dtype, B):
    # Transition / emission ranges from inside the probability-space path's ~104-nat limit to
    # far beyond double's underflow (~745 nats), with forbidden transitions: sentences take the
    # fast path, the exact path, or switch mid-way (the C++ backend decides per sentence and per
    # pass, and in lane groups per lane). All must agree with the reference.
    g = torch.Generator().manual_seed(11)
    for trial in range(12):
        L, T = 9, 4
        em = torch.randn(B, L, T, generator=g, dtype=torch.float64) * [5.0, 30.0, 300.0][trial % 3]
        tr = torch.rand(T, T, generator=g, dtype=torch.float64) * [60.0, 140.0, 900.0, 2000.0][trial % 4]
        tr[torch.rand(T, T, generator=g) < 0.2] = NEG_INF
        em[0] *= 3  # one sentence far out of range
        ln = torch.tensor([9, 9, 5, 1, 0, 7] * (B // 6))
        with crfkit.use_backend("reference"):
            truth = crfkit.log_partition(em, tr, ln), crfkit.marginals(em, tr, ln)
            tr_req = tr.clone().requires_grad_()
            (truth_grad,) = torch.autograd.grad(crfkit.log_partition(em, tr_req, ln).sum(), tr_req)
        tr_req = tr.to(dtype).requires_grad_()
        log_z = crfkit.log_partition(em.to(dtype), tr_req, ln)
        (grad,) = torch.autograd.grad(log_z.sum(), tr_req)
        mu = crfkit.marginals(em.to(dtype), tr.to(dtype), ln)
        tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-5, atol=2e-3)
        torch.testing.assert_close(log_z.double(), truth[0], **tol)
        torch.testing.assert_close(mu.double(), truth[1], atol=tol["atol"] if dtype == torch.float32 else 1e-9, rtol=0)
        torch.testing.assert_close(grad.double(), truth_grad, atol=5e-3 if dtype == torch.float32 else 1e-8, rtol=1e-5)
