"""The marginals' analytic backward (torch.ops.crfkit.marginals_backward, csrc/cpu/marginals_backward.cpp):
the vector-Jacobian product of the marginals, a Hessian-vector product of log Z.

Checked against autograd twice through the reference (float64, 1e-10), against marginals by
brute-force enumeration of every tag sequence (differentiated by autograd once), by gradcheck
of crfkit.marginals through the public API, in float32 against float64, and for its edges:
-inf scores (BIO constraints, forbidden starts, ends and transitions), sentences with every
sequence forbidden, length-0 sentences, padded positions, T = 1, L = 1, factored sums that
underflow. The op itself is not differentiable (a third derivative of log Z raises)."""
import math

import pytest
import torch

import brute_force
import crfkit
from conftest import random_crf

pytestmark = [
    pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built"),
    pytest.mark.usefixtures("one_thread"),
]

NEG_INF = -math.inf
ops = torch.ops.crfkit if "compiled" in crfkit.backends.available() else None


def reference_vjp(grad, emissions, transitions, lengths, start, end):
    """Gradients (emissions, transitions, start, end) of <grad, reference.marginals>: autograd
    through the reference's log Z, twice."""
    params = [x.detach().clone().requires_grad_() for x in (emissions, transitions, start, end)]
    mu = crfkit.reference.marginals(params[0], params[1], lengths, params[2], params[3])
    grads = torch.autograd.grad(mu, params, grad, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


def kernel(grad, emissions, transitions, lengths, start, end):
    return ops.marginals_backward(grad, emissions, transitions, lengths, start, end)


def assert_matches_reference(emissions, transitions, lengths, start, end, seed=0, tol=1e-10):
    grad = torch.randn(emissions.shape, generator=torch.Generator().manual_seed(seed), dtype=emissions.dtype)
    got = kernel(grad, emissions, transitions, lengths, start, end)
    want = reference_vjp(grad, emissions, transitions, lengths, start, end)
    for name, g, w in zip(("emissions", "transitions", "start", "end"), got, want):
        assert not w.isnan().any(), f"the reference's {name} gradient has NaN: not a valid oracle"
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=f"grad {name}")
    return got


def bio_scores(T=5):
    labels = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"][:T]
    return crfkit.constraints.allowed_transitions(labels, "BIO").as_scores(torch.float64)


# ---- against autograd through the reference ------------------------------------------------------
@pytest.mark.parametrize("B,L,T", [(1, 1, 1), (4, 1, 3), (3, 6, 1), (5, 7, 4), (8, 33, 9), (4, 40, 37), (2, 5, 100)])
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_matches_autograd_through_the_reference(B, L, T, scale):
    # random_crf's lengths are ragged: L for sentence 0, 0 for sentence 1 (from B = 3), any other.
    em, tr, ln, s, e = random_crf(B, L, T, scale=scale)
    got = assert_matches_reference(em, tr, ln, s, e, seed=B + L + T)
    if T == 1:  # one sequence per sentence: the marginals are constant 1
        assert all((g == 0).all() for g in got)
    else:  # not trivially zero
        assert got[0].abs().sum() > 0 and (L == 1 or got[1].abs().sum() > 0)


def test_length_zero_and_padded_positions_give_zero_and_are_never_read():
    em, tr, ln, s, e = random_crf(6, 9, 4)
    ln = torch.tensor([9, 0, 3, 1, 7, 0])
    grad = torch.randn(em.shape, dtype=torch.float64)
    clean = kernel(grad, em, tr, ln, s, e)
    padded = torch.arange(9) >= ln.unsqueeze(1)  # (B, L)
    em_nan, grad_nan = em.clone(), grad.clone()
    em_nan[padded] = math.nan  # never read: no NaN may leak, no error is raised
    grad_nan[padded] = math.inf
    dirty = kernel(grad_nan, em_nan, tr, ln, s, e)
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
    assert (clean[0][padded] == 0).all() and (clean[0][1] == 0).all()
    assert_matches_reference(em, tr, ln, s, e)


def test_bio_constraints_and_forbidden_tags():
    trans_mask, start_mask, end_mask = bio_scores()
    em, tr, ln, s, e = random_crf(7, 8, 5, scale=2.0, seed=5)
    em[:, :, 2] += 3.0  # the forbidden I-PER tempting everywhere
    em[3, 2] = NEG_INF
    em[3, 2, 0] = 0.0  # only O allowed at one position
    em[5, 0, 1] = NEG_INF
    got = assert_matches_reference(em, tr + trans_mask, ln, s + start_mask, e + end_mask)
    # I-PER may not start a sentence, so its start score gets no gradient; nor does a forbidden
    # transition (O -> I-PER).
    assert got[2][2] == 0 and got[1][0, 2] == 0
    assert not any(g.isnan().any() for g in got)


def test_every_sequence_forbidden_gives_zero_gradients():
    em, tr, ln, s, e = random_crf(4, 6, 3, seed=3)
    ln = torch.tensor([6, 6, 2, 6])
    em[1, 3] = NEG_INF  # sentence 1: no tag allowed at position 3
    em[2, 0, 1:] = NEG_INF  # sentence 2: tag 0 then tag 1, but 0 -> 1 is forbidden
    em[2, 1, [0, 2]] = NEG_INF
    tr[0, 1] = NEG_INF
    got = assert_matches_reference(em, tr, ln, s, e)
    assert ops.log_partition(em, tr, ln, s, e)[1:3].eq(NEG_INF).all()
    assert (got[0][1] == 0).all() and (got[0][2] == 0).all()
    assert (got[0][0] != 0).any() and (got[0][3] != 0).any()
    # and the whole batch forbidden: every gradient 0
    e_none = torch.full_like(e, NEG_INF)
    grad = torch.randn(em.shape, dtype=torch.float64)
    assert all((g == 0).all() for g in kernel(grad, em, tr, ln, s, e_none))


def test_forbidden_transitions_starts_and_ends():
    em, tr, ln, s, e = random_crf(5, 7, 4, seed=11, scale=2.0)
    tr[0, 1] = tr[3, :] = NEG_INF  # a forbidden transition and a tag that nothing may follow
    s[2] = NEG_INF
    e[1] = NEG_INF
    em[0, 4, 0] = NEG_INF
    got = assert_matches_reference(em, tr, ln, s, e)
    assert got[1][0, 1] == 0 and (got[1][3] == 0).all() and got[2][2] == 0 and got[3][1] == 0


def test_exact_columns_where_the_factored_sums_underflow():
    # Every sequence scores -1000 + one emission, so the marginals are far from 0 and 1, but each
    # term of the forward step (p[s] * E[t][s], log_space.h) underflows to 0: alpha_0 = (0, -1000)
    # and leaving tag 0 costs -1000. The reverse for the backward step: entering tag 0 costs -1000
    # and the last emissions are (0, -1000). The kernel must recompute those lines exactly.
    zeros = torch.zeros(2, dtype=torch.float64)
    forward = (torch.tensor([[[0.0, -1000.0], [0.3, -0.2]]], dtype=torch.float64),
               torch.tensor([[-1000.0, -1000.0], [0.0, 0.0]], dtype=torch.float64))
    backward = (torch.tensor([[[0.3, -0.2], [0.0, -1000.0]]], dtype=torch.float64),
                torch.tensor([[-1000.0, 0.0], [-1000.0, 0.0]], dtype=torch.float64))
    for em, tr in (forward, backward):
        got = assert_matches_reference(em, tr, torch.tensor([2]), zeros, zeros)
        assert got[0].abs().max() > 1e-2 and got[1].abs().max() > 1e-2  # a real, non-degenerate gradient
    assert_matches_reference(*random_crf(6, 12, 5, scale=300.0))


# ---- against brute-force enumeration ----------------------------------------------------------------
def enumerated_marginals(emissions, transitions, lengths, start, end):
    """(B, L, T) marginals sum_y p(y) [y_i = t] from every allowed sequence (tests/brute_force.py),
    differentiable in the four score tensors (no log Z recursion, no second autograd pass)."""
    _, L, T = emissions.shape

    def one_hot(seq):
        x = torch.zeros(L, T, dtype=torch.float64)
        x[torch.arange(len(seq)), torch.tensor(seq)] = 1
        return x

    return brute_force.expectation(emissions, transitions, lengths, start, end, one_hot, (L, T))


@pytest.mark.parametrize("n,T", [(1, 1), (1, 3), (2, 3), (3, 2), (4, 3), (5, 2), (3, 4)])
@pytest.mark.parametrize("constrained", [False, True])
def test_matches_brute_force_enumeration(n, T, constrained):
    em, tr, ln, s, e = random_crf(4, n, T, seed=n * 10 + T, scale=1.5)
    if constrained:
        tr[0, T - 1] = NEG_INF
        s[T - 1] = NEG_INF
        e[0] = NEG_INF if T > 1 else 0.0
        em[0, n - 1, min(1, T - 1)] = NEG_INF
        em[3] = NEG_INF  # sentence 3: every sequence forbidden (unless it has length 0)
    params = [x.clone().requires_grad_() for x in (em, tr, s, e)]
    mu = enumerated_marginals(params[0], params[1], ln, params[2], params[3])
    torch.testing.assert_close(mu.detach(), ops.marginals(em, tr, ln, s, e), rtol=1e-10, atol=1e-12)
    grad = torch.randn(em.shape, generator=torch.Generator().manual_seed(n + T), dtype=torch.float64)
    if mu.requires_grad:
        want = torch.autograd.grad(mu, params, grad, allow_unused=True)
        want = [torch.zeros_like(p) if w is None else w for w, p in zip(want, params)]
    else:  # no sentence has a sequence with a gradient (all forbidden, or length 0)
        want = [torch.zeros_like(p) for p in params]
    got = kernel(grad, em, tr, ln, s, e)
    for name, g, w in zip(("emissions", "transitions", "start", "end"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=f"grad {name}")


def test_brute_force_with_bio_constraints():
    trans_mask, start_mask, end_mask = bio_scores()
    em, tr, ln, s, e = random_crf(3, 4, 5, seed=5)
    em[:, :, 2] += 3.0
    tr, s, e = tr + trans_mask, s + start_mask, e + end_mask
    params = [x.clone().requires_grad_() for x in (em, tr, s, e)]
    mu = enumerated_marginals(params[0], params[1], ln, params[2], params[3])
    grad = torch.randn(em.shape, dtype=torch.float64)
    want = torch.autograd.grad(mu, params, grad)
    for g, w in zip(kernel(grad, em, tr, ln, s, e), want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


# ---- through the public API ---------------------------------------------------------------------------
@pytest.fixture
def reference_marginals_forbidden(monkeypatch):
    """The compiled backend, with the reference's marginals made to raise: a backward that still
    took the old path (autograd through the reference) would fail."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the marginals' backward went through the reference")

    monkeypatch.setattr(crfkit.reference, "marginals", forbidden)
    with crfkit.use_backend("compiled"):
        yield


def test_public_backward_uses_the_kernel(reference_marginals_forbidden):
    em, tr, ln, s, e = random_crf(6, 10, 5, scale=2.0)
    params = [x.clone().requires_grad_() for x in (em, tr, s, e)]
    mu = crfkit.marginals(params[0], params[1], ln, params[2], params[3])
    grad = torch.randn_like(mu)
    mu.backward(grad)
    want = kernel(grad, em, tr, ln, s, e)
    for p, w in zip(params, want):
        assert torch.equal(p.grad, w)


def test_gradcheck_of_the_public_marginals(reference_marginals_forbidden):
    # Finite differences of the marginals against the kernel: second derivatives of log Z.
    em, tr, ln, s, e = random_crf(3, 5, 3)
    params = tuple(x.clone().requires_grad_() for x in (em, tr, s, e))
    assert torch.autograd.gradcheck(lambda a, b, c, d: crfkit.marginals(a, b, ln, c, d), params)
    # with forbidden scores (finite differences leave -inf as it is: both sides are 0 there)
    trans_mask, start_mask, end_mask = bio_scores(3)
    em, tr, ln, s, e = random_crf(3, 4, 3, seed=9)
    params = tuple(x.clone().requires_grad_() for x in (em, tr + trans_mask, s + start_mask, e + end_mask))
    assert torch.autograd.gradcheck(lambda a, b, c, d: crfkit.marginals(a, b, ln, c, d), params)


def test_half_precision_and_float32_against_float64():
    em, tr, ln, s, e = random_crf(8, 30, 9, scale=2.0)
    grad = torch.randn(em.shape, dtype=torch.float64)
    truth = kernel(grad, em, tr, ln, s, e)
    got = kernel(grad.float(), em.float(), tr.float(), ln, s.float(), e.float())
    for g, w in zip(got, truth):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=2e-5)
    # float16 emissions: computed in float32 by the front end, the gradient cast back
    em_half = em.half().requires_grad_()
    with crfkit.use_backend("compiled"):
        mu = crfkit.marginals(em_half, tr.float(), ln, s.float(), e.float())
    mu.backward(grad.float())
    assert em_half.grad.dtype == torch.float16
    want = kernel(grad.float(), em.half().float(), tr.float(), ln, s.float(), e.float())[0]
    torch.testing.assert_close(em_half.grad.float(), want, rtol=1e-2, atol=1e-3)


def test_the_reference_path_remains_for_devices_without_the_kernel(monkeypatch):
    # A device without a marginals_backward kernel (a build without CUDA kernels): compiled.py
    # differentiates the reference there.
    from crfkit.backends import compiled

    em, tr, ln, s, e = random_crf(5, 8, 4)
    grad = torch.randn(em.shape, dtype=torch.float64)

    def backward():
        params = [x.clone().requires_grad_() for x in (em, tr, s, e)]
        with crfkit.use_backend("compiled"):
            crfkit.marginals(params[0], params[1], ln, params[2], params[3]).backward(grad)
        return [p.grad for p in params]

    with_kernel = backward()
    monkeypatch.setitem(compiled._KERNELS, ("marginals_backward", "CPU"), False)
    without = backward()
    for a, b in zip(with_kernel, without):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_the_reference_path_can_be_differentiated_again(monkeypatch):
    # Without the kernel, the marginals' derivative is autograd over the reference
    # (reference.gradients_by_autograd), so a third derivative of log Z exists there.
    from crfkit.backends import compiled

    monkeypatch.setitem(compiled._KERNELS, ("marginals_backward", "CPU"), False)
    em, tr, ln, s, e = random_crf(3, 5, 3)

    def marginals(em, tr, s, e):
        with crfkit.use_backend("compiled"):
            return crfkit.marginals(em, tr, ln, s, e)

    params = tuple(x.clone().requires_grad_() for x in (em, tr, s, e))
    assert torch.autograd.gradgradcheck(marginals, params)


def test_a_third_derivative_raises():
    em, tr, ln, s, e = random_crf(3, 5, 3)
    params = [x.clone().requires_grad_() for x in (em, tr, s, e)]
    with crfkit.use_backend("compiled"):
        mu = crfkit.marginals(params[0], params[1], ln, params[2], params[3])
    grad = torch.randn_like(mu)
    grads = torch.autograd.grad(mu, params, grad, create_graph=True)
    for g, w in zip(grads, kernel(grad, em, tr, ln, s, e)):  # the first derivative is right
        assert torch.equal(g.detach(), w)
    with pytest.raises(RuntimeError, match="gradient of the marginals .* is not differentiable"):
        grads[0].sum().backward()
    # the op called directly on tensors that require grad: the same
    out = ops.marginals_backward(torch.randn(em.shape, dtype=torch.float64, requires_grad=True), *params[:2], ln,
                                 *params[2:])
    with pytest.raises(RuntimeError, match="not differentiable"):
        out[1].sum().backward()


def test_deterministic_across_thread_counts():
    em, tr, ln, s, e = random_crf(13, 20, 6, scale=2.0)
    grad = torch.randn(em.shape, dtype=torch.float64)
    one = kernel(grad, em, tr, ln, s, e)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = kernel(grad, em, tr, ln, s, e)
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_bad_arguments_raise():
    em, tr, ln, s, e = random_crf(3, 4, 3)
    grad = torch.randn(em.shape, dtype=torch.float64)
    with pytest.raises(ValueError, match="grad_marginals must be"):
        kernel(grad[:, :3], em, tr, ln, s, e)
    with pytest.raises(ValueError, match="grad_marginals must have the dtype"):
        kernel(grad.float(), em, tr, ln, s, e)
    bad = em.clone()
    bad[2, 0, 1] = math.nan
    ln = torch.tensor([4, 0, 4])
    with pytest.raises(ValueError, match=r"emissions\[2\] contains NaN"):
        kernel(grad, bad, tr, ln, s, e)
    with pytest.raises(ValueError, match=r"lengths\[0\] = 5 is outside"):
        kernel(grad, em, tr, torch.tensor([5, 0, 4]), s, e)
    tr_bad = tr.clone()
    tr_bad[0, 0] = math.inf
    with pytest.raises(ValueError, match="transitions contains NaN"):
        kernel(grad, em, tr_bad, ln, s, e)


def test_torch_compile_traces_the_backward():
    em, tr, ln, s, e = random_crf(4, 6, 3)
    grad = torch.randn(em.shape, dtype=torch.float64)

    def loss(em, tr, s, e):
        return (crfkit.marginals(em, tr, ln, s, e) * grad).sum()

    torch._dynamo.reset()
    with crfkit.use_backend("compiled"):
        compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
        params = [x.clone().requires_grad_() for x in (em, tr, s, e)]
        got = torch.autograd.grad(compiled(*params), params)
    torch._dynamo.reset()
    for g, w in zip(got, kernel(grad, em, tr, ln, s, e)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
