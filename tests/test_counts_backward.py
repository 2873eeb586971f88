"""The expected transition counts' analytic backward (torch.ops.crfkit.expected_transition_counts_backward,
csrc/cpu/marginals_backward.cpp): their vector-Jacobian product, a Hessian-vector product of log Z
in a direction of the transitions (one per sentence).

Checked against autograd twice through the reference (float64, 1e-10), against counts by
brute-force enumeration of every tag sequence (differentiated by autograd once), by gradcheck
through the public API, and at the edges the marginals' backward is checked at (-inf scores,
every sequence forbidden, length 0, padded positions, lines whose factored sums underflow). The
op itself is not differentiable."""
import math

import pytest
import torch

import brute_force
import crfkit
from conftest import random_crf
from test_marginals_backward import bio_scores

pytestmark = [
    pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built"),
    pytest.mark.usefixtures("one_thread"),
]

NEG_INF = -math.inf
ops = torch.ops.crfkit if "compiled" in crfkit.backends.available() else None


def kernel(grad, emissions, transitions, lengths, start, end):
    return ops.expected_transition_counts_backward(grad, emissions, transitions, lengths, start, end)


def reference_vjp(grad, emissions, transitions, lengths, start, end):
    params = [x.detach().clone().requires_grad_() for x in (emissions, transitions, start, end)]
    counts = crfkit.reference.expected_transition_counts(params[0], params[1], lengths, params[2], params[3])
    grads = torch.autograd.grad(counts, params, grad, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


def assert_matches_reference(emissions, transitions, lengths, start, end, seed=0, tol=1e-10):
    B, _, T = emissions.shape
    grad = torch.randn(B, T, T, generator=torch.Generator().manual_seed(seed), dtype=emissions.dtype)
    got = kernel(grad, emissions, transitions, lengths, start, end)
    want = reference_vjp(grad, emissions, transitions, lengths, start, end)
    for name, g, w in zip(("emissions", "transitions", "start", "end"), got, want):
        assert not w.isnan().any(), f"the reference's {name} gradient has NaN: not a valid oracle"
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=f"grad {name}")
    return got


@pytest.mark.parametrize("B,L,T", [(1, 1, 1), (4, 1, 3), (3, 6, 1), (5, 7, 4), (8, 33, 9), (4, 40, 37), (2, 5, 100)])
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_matches_autograd_through_the_reference(B, L, T, scale):
    em, tr, ln, s, e = random_crf(B, L, T, scale=scale)
    got = assert_matches_reference(em, tr, ln, s, e, seed=B + L + T)
    if T > 1 and L > 1:  # not trivially zero
        assert got[0].abs().sum() > 0 and got[1].abs().sum() > 0


def test_forbidden_scores_and_every_sequence_forbidden():
    trans_mask, start_mask, end_mask = bio_scores()
    em, tr, ln, s, e = random_crf(7, 8, 5, scale=2.0, seed=5)
    em[:, :, 2] += 3.0
    em[3, 2] = NEG_INF
    em[3, 2, 0] = 0.0
    got = assert_matches_reference(em, tr + trans_mask, ln, s + start_mask, e + end_mask)
    assert got[1][0, 2] == 0 and got[2][2] == 0  # O -> I-PER and a start in I-PER are forbidden
    em, tr, ln, s, e = random_crf(4, 6, 3, seed=3)
    ln = torch.tensor([6, 6, 2, 6])
    em[1, 3] = NEG_INF  # sentence 1: no tag allowed at position 3
    got = assert_matches_reference(em, tr, ln, s, e)
    assert (got[0][1] == 0).all() and (got[0][0] != 0).any()


def test_length_zero_and_padded_positions_give_zero_and_are_never_read():
    em, tr, ln, s, e = random_crf(6, 9, 4)
    ln = torch.tensor([9, 0, 3, 1, 7, 0])
    grad = torch.randn(6, 4, 4, dtype=torch.float64)
    clean = kernel(grad, em, tr, ln, s, e)
    dirty_em = em.clone()
    dirty_em[torch.arange(9) >= ln.unsqueeze(1)] = math.nan
    for a, b in zip(clean, kernel(grad, dirty_em, tr, ln, s, e)):
        assert torch.equal(a, b)
    assert (clean[0][1] == 0).all() and (clean[0][5] == 0).all()
    assert_matches_reference(em, tr, ln, s, e)


def test_exact_lines_where_the_factored_sums_underflow():
    # As test_marginals_backward's test of the same name: lines whose factored terms underflow.
    zeros = torch.zeros(2, dtype=torch.float64)
    for em, tr in ((torch.tensor([[[0.0, -1000.0], [0.3, -0.2], [0.1, 0.0]]], dtype=torch.float64),
                    torch.tensor([[-1000.0, -1000.0], [0.0, 0.0]], dtype=torch.float64)),
                   (torch.tensor([[[0.3, -0.2], [0.1, 0.0], [0.0, -1000.0]]], dtype=torch.float64),
                    torch.tensor([[-1000.0, 0.0], [-1000.0, 0.0]], dtype=torch.float64))):
        got = assert_matches_reference(em, tr, torch.tensor([3]), zeros, zeros)
        assert got[0].abs().max() > 1e-3 and got[1].abs().max() > 1e-3
    assert_matches_reference(*random_crf(6, 12, 5, scale=300.0))


def enumerated_counts(emissions, transitions, lengths, start, end):
    """(B, T, T) expected transition counts from every allowed sequence, differentiable."""
    T = emissions.shape[2]

    def pairs(seq):
        x = torch.zeros(T, T, dtype=torch.float64)
        for i in range(1, len(seq)):
            x[seq[i - 1], seq[i]] += 1
        return x

    return brute_force.expectation(emissions, transitions, lengths, start, end, pairs, (T, T))


@pytest.mark.parametrize("n,T", [(1, 2), (2, 3), (3, 2), (4, 3), (3, 4)])
@pytest.mark.parametrize("constrained", [False, True])
def test_matches_brute_force_enumeration(n, T, constrained):
    em, tr, ln, s, e = random_crf(4, n, T, seed=n * 10 + T, scale=1.5)
    if constrained:
        tr[0, T - 1] = NEG_INF
        s[T - 1] = NEG_INF
        e[0] = NEG_INF
        em[3] = NEG_INF  # sentence 3: every sequence forbidden (unless it has length 0)
    params = [x.clone().requires_grad_() for x in (em, tr, s, e)]
    counts = enumerated_counts(params[0], params[1], ln, params[2], params[3])
    torch.testing.assert_close(counts.detach(), ops.expected_transition_counts(em, tr, ln, s, e),
                               rtol=1e-10, atol=1e-12)
    grad = torch.randn(4, T, T, generator=torch.Generator().manual_seed(n + T), dtype=torch.float64)
    if counts.requires_grad:
        want = torch.autograd.grad(counts, params, grad, allow_unused=True)
        want = [torch.zeros_like(p) if w is None else w for w, p in zip(want, params)]
    else:
        want = [torch.zeros_like(p) for p in params]
    for name, g, w in zip(("emissions", "transitions", "start", "end"), kernel(grad, em, tr, ln, s, e), want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=f"grad {name}")


# ---- through the public API ---------------------------------------------------------------------------
def test_public_backward_uses_the_kernel(monkeypatch):
    em, tr, ln, s, e = random_crf(5, 8, 4, scale=2.0)
    grad = torch.randn(5, 4, 4, dtype=torch.float64)

    def backward():
        params = [x.clone().requires_grad_() for x in (em, tr, s, e)]
        with crfkit.use_backend("compiled"):
            crfkit.expected_transition_counts(params[0], params[1], ln, params[2], params[3]).backward(grad)
        return [p.grad for p in params]

    with_kernel = backward()
    for g, w in zip(with_kernel, kernel(grad, em, tr, ln, s, e)):
        assert torch.equal(g, w)
    from crfkit.backends import compiled

    monkeypatch.setitem(compiled._KERNELS, ("expected_transition_counts_backward", "CPU"), False)
    for a, b in zip(with_kernel, backward()):  # the reference path, kept for devices without the kernel
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_gradcheck_and_a_third_derivative_raises():
    em, tr, ln, s, e = random_crf(3, 5, 3)

    def counts(em, tr, s, e):
        with crfkit.use_backend("compiled"):
            return crfkit.expected_transition_counts(em, tr, ln, s, e)

    params = tuple(x.clone().requires_grad_() for x in (em, tr, s, e))
    assert torch.autograd.gradcheck(counts, params)
    grads = torch.autograd.grad(counts(*params), params, torch.randn(3, 3, 3, dtype=torch.float64),
                                create_graph=True)
    with pytest.raises(RuntimeError, match="expected transition counts .* is not differentiable"):
        grads[1].sum().backward()


def test_entropy_with_frozen_transitions():
    # crfkit.LinearChainCRF's entropy differentiates the counts; emissions alone may require grad.
    em, tr, ln, s, e = random_crf(4, 6, 3)
    for requires in ((True, False), (False, True), (True, True)):
        em_p, tr_p = em.clone().requires_grad_(requires[0]), tr.clone().requires_grad_(requires[1])
        with crfkit.use_backend("compiled"):
            h = crfkit.LinearChainCRF(em_p, tr_p, lengths=ln).entropy().sum()
        with crfkit.use_backend("reference"):
            em_r, tr_r = em.clone().requires_grad_(requires[0]), tr.clone().requires_grad_(requires[1])
            h_r = crfkit.LinearChainCRF(em_r, tr_r, lengths=ln).entropy().sum()
        inputs = [x for x, r in ((em_p, requires[0]), (tr_p, requires[1])) if r]
        wanted = [x for x, r in ((em_r, requires[0]), (tr_r, requires[1])) if r]
        for g, w in zip(torch.autograd.grad(h, inputs), torch.autograd.grad(h_r, wanted)):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


def test_bad_arguments_raise():
    em, tr, ln, s, e = random_crf(3, 4, 3)
    grad = torch.randn(3, 3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"grad_counts must be \(batch, num_tags, num_tags\)"):
        kernel(grad[:2], em, tr, ln, s, e)
    with pytest.raises(ValueError, match="grad_counts must have the dtype"):
        kernel(grad.float(), em, tr, ln, s, e)
    with pytest.raises(ValueError, match=r"lengths\[0\] = 5 is outside"):
        kernel(grad, em, tr, torch.tensor([5, 0, 4]), s, e)
