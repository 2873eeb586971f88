"""Every backend against the reference on larger random inputs (values and gradients, float64
to about 1e-10, float32 to about 1e-4 relative), gradcheck in float64, opcheck on each
registered op, torch.compile(fullgraph=True), and hypothesis property tests."""
import functools
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import crfkit
from crfkit.backends import op_table
from conftest import check_compile_matches_eager, random_crf

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=1e-4)}
SHAPES = [(1, 1, 1), (5, 1, 3), (6, 7, 5), (8, 33, 9), (4, 64, 37), (3, 20, 100)]  # (B, L, T)


def all_outputs(emissions, transitions, lengths, start, end, k=4):
    """Values and gradients of every op, for comparing two backends."""
    params = [x.detach().clone().requires_grad_() for x in (emissions, transitions, start, end)]
    em, tr, s, e = params
    log_z = crfkit.log_partition(em, tr, lengths, s, e)
    mu = crfkit.marginals(em.detach(), tr.detach(), lengths, s.detach(), e.detach())
    scores, paths = crfkit.viterbi(em, tr, lengths, s, e)
    best = crfkit.kbest_viterbi(em, tr, k, lengths, s, e)
    gold = torch.randint(0, emissions.shape[2], emissions.shape[:2], generator=torch.Generator().manual_seed(1))
    seq = crfkit.sequence_score(em, tr, gold, lengths, s, e)
    finite = torch.isfinite(best.log_probs)
    objective = (log_z * torch.linspace(0.5, 1.5, log_z.shape[0], dtype=log_z.dtype)).sum() + seq.sum() \
        + best.log_probs[finite].sum() + scores.sum()
    grads = torch.autograd.grad(objective, params, allow_unused=True)  # L = 1 uses no transition
    grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
    return dict(log_z=log_z, marginals=mu, viterbi_paths=paths, viterbi_scores=scores,
                kbest_paths=best.paths, kbest_scores=best.scores, kbest_log_probs=best.log_probs,
                sequence_score=seq,
                **{f"grad_{n}": g for n, g in zip(("emissions", "transitions", "start", "end"), grads)})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,L,T", SHAPES)
def test_backend_matches_reference(backend, dtype, B, L, T):
    inputs = random_crf(B, L, T, dtype=dtype, scale=2.0)
    got = all_outputs(*inputs)
    with crfkit.use_backend("reference"):
        want = all_outputs(*inputs)
    for name in want:
        if "paths" in name:
            assert torch.equal(got[name], want[name]), name
        else:
            torch.testing.assert_close(got[name], want[name], **TOL[dtype], msg=name)


@pytest.mark.parametrize("B,L,T", [(4, 16, 5), (2, 40, 9)])
def test_float32_close_to_float64_truth(backend, B, L, T):
    em, tr, ln, s, e = random_crf(B, L, T, scale=3.0)
    with crfkit.use_backend("reference"):
        truth = crfkit.log_partition(em, tr, ln, s, e), crfkit.marginals(em, tr, ln, s, e)
    got = (crfkit.log_partition(em.float(), tr.float(), ln, s.float(), e.float()),
           crfkit.marginals(em.float(), tr.float(), ln, s.float(), e.float()))
    torch.testing.assert_close(got[0].double(), truth[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[1].double(), truth[1], rtol=1e-4, atol=1e-5)


def test_gradcheck_float64(backend):
    em, tr, ln, s, e = random_crf(3, 5, 3)
    params = tuple(x.requires_grad_() for x in (em, tr, s, e))
    assert torch.autograd.gradcheck(lambda a, b, c, d: crfkit.log_partition(a, b, ln, c, d), params)
    tags = torch.randint(0, 3, (3, 5))
    assert torch.autograd.gradcheck(lambda a, b, c, d: crfkit.sequence_score(a, b, tags, ln, c, d), params)
    # k-best log-probs: piecewise smooth; the random inputs are far from any tie.
    assert torch.autograd.gradcheck(
        lambda a, b, c, d: crfkit.kbest_viterbi(a, b, 4, ln, c, d).log_probs.clamp(min=-1e3), params)
    # marginals are differentiable too (second derivatives of log Z: in the compiled backend on the
    # CPU the marginals_backward kernel, tests/test_marginals_backward.py), in all four inputs.
    assert torch.autograd.gradcheck(lambda a, b, c, d: crfkit.marginals(a, b, ln, c, d), params)


def test_gradient_of_log_partition_is_the_marginals(backend):
    em, tr, ln, s, e = random_crf(4, 9, 4)
    em.requires_grad_()
    (grad,) = torch.autograd.grad(crfkit.log_partition(em, tr, ln, s, e).sum(), em)
    torch.testing.assert_close(grad, crfkit.marginals(em.detach(), tr, ln, s, e), rtol=1e-12, atol=1e-12)


def test_kbest_row0_is_viterbi_and_scores_are_path_scores(backend):
    em, tr, ln, s, e = random_crf(16, 30, 9, dtype=torch.float32, scale=2.0)
    scores, paths = crfkit.viterbi(em, tr, ln, s, e)
    best = crfkit.kbest_viterbi(em, tr, 7, ln, s, e)
    assert torch.equal(best.paths[:, 0], paths)
    assert torch.equal(best.scores[:, 0], scores)
    # Recomputing each path's score gives the decoder's score bit for bit (same summation order).
    found = torch.isfinite(best.scores)  # missing rows (-1 paths) have no score to recompute
    assert torch.equal(crfkit.sequence_score(em, tr, best.paths, ln, s, e)[found], best.scores[found])
    assert (best.scores[:, :-1] >= best.scores[:, 1:]).all()


@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
def test_opcheck_every_op():
    em, tr, ln, s, e = random_crf(3, 6, 4)
    req = [x.clone().requires_grad_() for x in (em, tr, s, e)]
    cases = op_table.example_arguments(torch.ops.crfkit, req[0], req[1], ln, req[2], req[3],
                                       tags=torch.randint(0, 4, (3, 2, 6)), k=5,
                                       grad_log_z=torch.ones(3, dtype=torch.float64),
                                       grad_scores=torch.ones(3, 2, dtype=torch.float64),
                                       grad_marginals=torch.randn(3, 6, 4, dtype=torch.float64))
    for name, args in cases.items():
        torch.library.opcheck(getattr(torch.ops.crfkit, name), args)


@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
def test_op_table_lists_every_registered_op():
    # crfkit/backends/op_table.py is the one list of the ops that the fakes, the opcheck cases
    # and the emulator's tools derive from: it must hold every op csrc/crfkit.cpp defines.
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("crfkit::")}
    assert registered == set(op_table.OPS)
    for name in op_table.OPS:
        assert str(getattr(torch.ops.crfkit, name).default._schema) == op_table.schema("crfkit", name)


@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
@pytest.mark.parametrize("threads", [1, 2])  # with 2, B = 1 runs both kernels side by side
@pytest.mark.parametrize("B,T,k", [(0, 3, 2), (1, 5, 4), (1, 9, 1), (2, 9, 7), (6, 5, 300), (21, 9, 5), (21, 37, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kbest_with_log_probs_equals_the_separate_ops(threads, B, T, k, dtype):
    # One op for a k-best without gradient (compiled.kbest_viterbi): its outputs must be those
    # of kbest_viterbi and of log_probs_from_scores(log_partition), bit for bit, however its
    # two kernels are scheduled; 300 exceeds the sequences of the short sentences.
    em, tr, ln, s, e = random_crf(B, 7, T, dtype=dtype)
    if B > 1:
        tr[1, 2] = -math.inf  # a forbidden transition
        ln[1] = 4
        em[1] = -math.inf  # a sentence with nothing allowed: every row missing, log Z = -inf
        ln[0] = 0  # the empty sentence: one row, score 0, log-prob 0
    ops = torch.ops.crfkit
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        scores, paths, log_probs = ops.kbest_viterbi_with_log_probs(em, tr, k, ln, s, e)
    finally:
        torch.set_num_threads(saved)
    want_scores, want_paths = ops.kbest_viterbi(em, tr, k, ln, s, e)
    want_log_probs = crfkit.reference.log_probs_from_scores(want_scores, ops.log_partition(em, tr, ln, s, e))
    assert torch.equal(scores, want_scores) and torch.equal(paths, want_paths)
    assert torch.equal(log_probs, want_log_probs)
    assert not log_probs.isnan().any()
    if B > 1:
        assert log_probs[0, 0] == 0 and (log_probs[1] == -math.inf).all()
    # and the public call takes it without gradient, the two differentiable ops with
    with crfkit.use_backend("compiled"):
        public = crfkit.kbest_viterbi(em, tr, k, ln, s, e)
        differentiable = crfkit.kbest_viterbi(em.clone().requires_grad_(), tr, k, ln, s, e)
    for got in (public, differentiable):
        assert torch.equal(got.paths, paths) and torch.equal(got.scores.detach(), scores)
        assert torch.equal(got.log_probs.detach(), log_probs)
    assert differentiable.log_probs.requires_grad


@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
@pytest.mark.parametrize("B", [1, 5])
def test_kbest_with_log_probs_rejects_what_the_separate_ops_reject(B):
    em, tr, ln, s, e = random_crf(B, 4, 3)
    ops = torch.ops.crfkit
    bad = em.clone()
    bad[B - 1, 0, 1] = math.nan
    with pytest.raises(ValueError, match=rf"emissions\[{B - 1}\] contains NaN or \+inf"):
        ops.kbest_viterbi_with_log_probs(bad, tr, 2, ln, s, e)
    with pytest.raises(ValueError, match=r"lengths\[0\] = 5 is outside"):
        ops.kbest_viterbi_with_log_probs(em, tr, 2, torch.full((B,), 5), s, e)
    with pytest.raises(ValueError, match="k must be at least 1"):
        ops.kbest_viterbi_with_log_probs(em, tr, 0, ln, s, e)
    with pytest.raises(RuntimeError, match="not differentiable"):
        ops.kbest_viterbi_with_log_probs(em.requires_grad_(), tr, 2, ln, s, e)
    with torch.no_grad():
        ops.kbest_viterbi_with_log_probs(em, tr, 2, ln, s, e)  # fine without gradient


def _hard_cases(B, scale):
    """Inputs with a forbidden transition, a sentence with nothing allowed (log Z = -inf), a
    length-0 sentence and, from B = 8 on, a lane that leaves the fast path's range while the
    others of its lane group stay."""
    em, tr, ln, s, e = random_crf(B, 9, 5, scale=scale)
    tr[1, 2] = -math.inf
    em[2, :3] = -math.inf
    if B > 6:
        em[7] *= 1e4
    return em, tr, ln, s, e


@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
@pytest.mark.parametrize("scale", [1.0, 1e4])  # 1e4: the exact log-space path
@pytest.mark.parametrize("B", [6, 21])  # 6: under one lane group of 8 (AVX-512); 21: lane groups (prob_lanes.h)
def test_log_partition_with_marginals_equals_the_separate_ops(scale, B):
    # The op behind a differentiable log Z (crfkit/backends/compiled.py) computes log Z, the marginals and
    # the expected transition counts in one pass: each must be what its own op gives, and its
    # backward what the backward that reruns the forward gives, for any upstream gradient.
    em, tr, ln, s, e = _hard_cases(B, scale)
    ops = torch.ops.crfkit
    log_z, mu, counts = ops.log_partition_with_marginals(em, tr, ln, s, e)
    assert torch.equal(log_z, ops.log_partition(em, tr, ln, s, e))  # bit for bit
    assert log_z[2] == -math.inf and log_z[1] == 0  # sentence 1 has length 0
    assert torch.equal(counts, ops.expected_transition_counts(em, tr, ln, s, e))
    torch.testing.assert_close(mu, ops.marginals(em, tr, ln, s, e), rtol=1e-12, atol=1e-12)
    assert (mu[2] == 0).all() and (counts[2] == 0).all() and (mu[1] == 0).all()
    grad = torch.randn(B, dtype=torch.float64)
    grad[4] = 0
    grad[3] = math.inf  # infinite upstream gradient: non-finite where used, 0 past the length
    from_marginals = ops.log_partition_backward_from_marginals(grad, mu, counts, ln)
    rerun = ops.log_partition_backward(grad, em, tr, ln, s, e)
    assert (from_marginals[0][3, ln[3]:] == 0).all()
    finite = grad.isfinite()
    torch.testing.assert_close(from_marginals[0][finite], rerun[0][finite], rtol=1e-12, atol=1e-12)
    grad[3] = 0
    from_marginals = ops.log_partition_backward_from_marginals(grad, mu, counts, ln)
    rerun = ops.log_partition_backward(grad, em, tr, ln, s, e)
    for got, want in zip(from_marginals, rerun):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="transition_counts must have the dtype of marginals"):
        ops.log_partition_backward_from_marginals(grad, mu, counts.float(), ln)
    with pytest.raises(ValueError, match="grad_log_z must be"):
        ops.log_partition_backward_from_marginals(grad[:-1], mu, counts, ln)
    with pytest.raises(ValueError, match="lengths"):
        ops.log_partition_backward_from_marginals(grad, mu, counts, ln + 10)


@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 2, 9, 37, 64, 65])  # 65: above kMaxLaneTags, never lanes
@pytest.mark.parametrize("scale", [1.0, 30.0])  # 30: scores far apart, some lanes leave the fast path
@pytest.mark.parametrize("kernel", ["lanes", "per_sentence"])
def test_log_partition_lanes_match_the_reference(monkeypatch, dtype, T, scale, kernel):
    # log Z, marginals and the gradients run on batch lanes (prob_lanes.h: groups of 8 doubles
    # with AVX-512, 4 with AVX2) or one sentence at a time; CRFKIT_LOG_PARTITION_LANES forces
    # either, so both are checked on every build whatever its default. 37 sentences, 3 of
    # length 0: full groups and a partial one, lanes that end at different positions, a
    # forbidden transition and a sentence with no allowed path (log Z = -inf).
    monkeypatch.setenv("CRFKIT_LOG_PARTITION_LANES", "1" if kernel == "lanes" else "0")
    em, tr, ln, start, end = _lane_case(dtype, T, L=20, seed=300 + T)
    em = em * scale
    em[3, 4] = -math.inf

    def outputs():
        params = [x.clone().requires_grad_() for x in (em, tr, start, end)]
        log_z = crfkit.log_partition(params[0], params[1], ln, params[2], params[3])
        finite = log_z.isfinite()
        weights = torch.linspace(0.5, 1.5, log_z.shape[0], dtype=dtype)
        grads = torch.autograd.grad((log_z[finite] * weights[finite]).sum(), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        return [log_z, crfkit.marginals(em, tr, ln, start, end), *grads]

    with crfkit.use_backend("compiled"):
        got = outputs()
    with crfkit.use_backend("reference"):
        want = outputs()
    assert got[0][3] == -math.inf and (got[1][3] == 0).all()
    assert (got[0][[1, 10, 20]] == 0).all()
    for name, g, w in zip(["log_z", "marginals", "grad_emissions", "grad_transitions", "grad_start", "grad_end"],
                          got, want):
        torch.testing.assert_close(g, w, **TOL[dtype], msg=name)


@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
def test_log_z_is_the_lane_value_when_only_the_lane_backward_fails():
    # State 0 at position 3 is reachable, but its backward probability is e^-110 of the largest
    # (its only way on is to tag 1, at -20, whose emission is -90): the lanes' forward keeps
    # its range, their backward does not, and the sentences are redone one at a time. log Z
    # must still be the lanes' value, as log_partition gives it (the two differ in the last
    # bits), and the marginals the reference's.
    g = torch.Generator().manual_seed(5)
    em = torch.randn(8, 6, 3, dtype=torch.float64, generator=g)
    em[:, 4] = torch.tensor([0.0, -90.0, 0.0])
    tr = torch.randn(3, 3, dtype=torch.float64, generator=g)
    tr[0] = torch.tensor([-math.inf, -20.0, -math.inf])
    s, e = torch.randn(3, dtype=torch.float64, generator=g), torch.randn(3, dtype=torch.float64, generator=g)
    ln = torch.full((8,), 6)
    ops = torch.ops.crfkit
    log_z, mu, counts = ops.log_partition_with_marginals(em, tr, ln, s, e)
    assert torch.equal(log_z, ops.log_partition(em, tr, ln, s, e))
    torch.testing.assert_close(mu, crfkit.reference.marginals(em, tr, ln, s, e), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(counts, crfkit.reference.expected_transition_counts(em, tr, ln, s, e),
                               rtol=1e-12, atol=1e-12)


# A build for torch 2.10's stable ABI allocates afresh instead (csrc/cpu/recycled_memory.h).
_needs_recycling = pytest.mark.skipif(
    "compiled" not in crfkit.backends.available() or not crfkit._C.recycles_memory(),
    reason="this build of crfkit._C does not recycle CPU buffers (built for torch 2.10's stable ABI)")


@_needs_recycling
@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_counts_without_transitions_are_zero_in_recycled_memory(dtype):
    # The lane groups' backward writes each sentence's (T, T) counts whole, and a group with no
    # transition at all (every sentence of length 0 or 1: lanes take the longest first, so the
    # last groups here) writes nothing: those rows must still come out 0 when the counts'
    # recycled buffer (over 64 KiB at T = 37) was left full of NaN by an earlier call.
    B, L, T = 24, 3, 37
    em, tr, _, s, e = random_crf(B, L, T, dtype=dtype, ragged=False)
    lengths = torch.tensor([3] * 8 + [1, 0] * 8)
    ops = torch.ops.crfkit
    crfkit.release_cached_memory()
    earlier = ops.log_partition_with_marginals(em, tr, torch.full((B,), L), s, e)
    for x in earlier:
        x.fill_(math.nan)
    del earlier, x  # their buffers are kept, NaN-filled
    assert crfkit.cached_memory() >= B * T * T * em.element_size()
    _, mu, counts = ops.log_partition_with_marginals(em, tr, lengths, s, e)
    assert torch.equal(counts[8:], torch.zeros_like(counts[8:]))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(counts, crfkit.reference.expected_transition_counts(em, tr, lengths, s, e), **tol)
    torch.testing.assert_close(mu, crfkit.reference.marginals(em, tr, lengths, s, e), **tol)
    crfkit.release_cached_memory()


@_needs_recycling
@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
@pytest.mark.parametrize("B", [6, 21])
def test_recycled_memory_leaves_no_trace(B):
    # The marginals, counts and emissions gradient of a differentiable log Z live in recycled
    # buffers (csrc/cpu/recycled_memory.h). Computed in buffers left full of NaN by an earlier
    # call they must equal, bit for bit, those computed in fresh memory;
    # release_cached_memory() frees the kept buffers.
    em, tr, ln, s, e = random_crf(B, 2000, 5)  # the marginals: over the 64 KiB recycled from
    ops = torch.ops.crfkit
    crfkit.release_cached_memory()
    fresh = ops.log_partition_with_marginals(em, tr, ln, s, e)
    fresh_copies = [x.clone() for x in fresh]
    for x in fresh:
        x.fill_(math.nan)
    del fresh  # their buffers are kept, NaN-filled
    assert crfkit.cached_memory() >= em.numel() * 8
    reused = ops.log_partition_with_marginals(em, tr, ln, s, e)
    for got, want in zip(reused, fresh_copies):
        assert torch.equal(got, want)
    grad = torch.randn(B, dtype=torch.float64)
    first = [x.clone() for x in ops.log_partition_backward_from_marginals(grad, reused[1], reused[2], ln)]
    crfkit.release_cached_memory()
    for x in ops.log_partition_backward_from_marginals(grad, reused[1], reused[2], ln):
        x.fill_(math.nan)  # freed at once: NaN in the cache again
    for got, want in zip(ops.log_partition_backward_from_marginals(grad, reused[1], reused[2], ln), first):
        assert torch.equal(got, want)
    del reused
    assert crfkit.release_cached_memory() > 0
    assert crfkit.cached_memory() == 0


@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
def test_log_partition_gradient_is_differentiable_once_only():
    # The compiled backward scales marginals computed in the forward: a second derivative through
    # it must raise, not come out silently without the marginals' own derivative.
    em, tr, ln, s, e = random_crf(3, 5, 4)
    em.requires_grad_()
    log_z = crfkit.log_partition(em, tr, ln, s, e)
    (grad,) = torch.autograd.grad((log_z ** 2).sum(), em, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once only"):
        torch.autograd.grad(grad.sum(), em)
    log_z = crfkit.log_partition(em, tr, ln, s, e)
    (grad,) = torch.autograd.grad(log_z.sum(), em, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once only"):
        (grad.sum() + em.sum()).backward()
    with crfkit.use_backend("reference"):  # where second derivatives are wanted
        log_z = crfkit.log_partition(em, tr, ln, s, e)
        (grad,) = torch.autograd.grad(log_z.sum(), em, create_graph=True)
        (hessian_row,) = torch.autograd.grad(grad[0, 0, 0], em)
    assert hessian_row[0, 0, 0] > 0  # the variance of a tag indicator


@pytest.mark.parametrize("T", [1, 3, 9, 16, 37, 64])
def test_lane_groups_match_the_reference(backend, T):
    # B = 21: two full lane groups of 8 and a partial one in the C++ backend, sorted by length,
    # with lanes that leave the fast path (scores of 1e4), a sentence where every tag is
    # forbidden at one position (log Z = -inf), lengths 0, 1 and L, a forbidden transition,
    # and a zero upstream gradient. Every lane must give the reference's values.
    B, L = 21, 12
    em, tr, ln, s, e = random_crf(B, L, T, scale=2.0)
    ln[2], ln[3], ln[5], ln[6] = 1, L, L - 1, L
    em[5] *= 1e4
    em[6, 4] = -math.inf
    tr[0, T - 1] = -math.inf if T > 1 else tr[0, 0]
    weights = torch.linspace(0.5, 1.5, B, dtype=torch.float64)
    weights[9] = 0

    def outputs():
        params = [x.clone().requires_grad_() for x in (em, tr, s, e)]
        log_z = crfkit.log_partition(*params[:2], ln, *params[2:])
        finite = torch.isfinite(log_z)
        grads = torch.autograd.grad((log_z[finite] * weights[finite]).sum(), params)
        return (log_z, crfkit.marginals(em, tr, ln, s, e),
                crfkit.expected_transition_counts(em, tr, ln, s, e), *grads)

    got = outputs()
    with crfkit.use_backend("reference"):
        want = outputs()
    assert torch.isinf(want[0][6])
    for name, a, b in zip(("log_z", "marginals", "counts", "d_emissions", "d_transitions", "d_start", "d_end"),
                          got, want):
        torch.testing.assert_close(a, b, **TOL[torch.float64], msg=name)


@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
def test_torch_compile_fullgraph():
    em, tr, ln, s, e = random_crf(4, 12, 5, dtype=torch.float32)
    check_compile_matches_eager(em, tr, ln, s, e, crfkit.use_backend("compiled"))


@settings(max_examples=60, deadline=None)
@given(B=st.integers(0, 5), L=st.integers(0, 9), T=st.integers(1, 6), k=st.integers(1, 12),
       seed=st.integers(0, 2**16), forbid=st.booleans())
def test_properties(B, L, T, k, seed, forbid):
    em, tr, ln, s, e = random_crf(B, L, T, seed=seed, scale=2.0)
    if forbid:
        tr[torch.rand(T, T, generator=torch.Generator().manual_seed(seed)) < 0.3] = -math.inf
    for name in crfkit.backends.available():
        with crfkit.use_backend(name):
            log_z = crfkit.log_partition(em, tr, ln, s, e)
            mu = crfkit.marginals(em, tr, ln, s, e)
            best = crfkit.kbest_viterbi(em, tr, k, ln, s, e)
            scores, paths = crfkit.viterbi(em, tr, ln, s, e)
        assert not torch.isnan(log_z).any() and not torch.isnan(mu).any() and not torch.isnan(best.log_probs).any()
        valid = torch.arange(L) < ln.unsqueeze(1)
        possible = torch.isfinite(log_z)
        row_sums = mu.sum(-1)
        torch.testing.assert_close(row_sums[valid & possible.unsqueeze(1)],
                                   torch.ones_like(row_sums[valid & possible.unsqueeze(1)]))
        assert (row_sums[~valid | ~possible.unsqueeze(1)] == 0).all()
        assert (best.log_probs <= 1e-12).all()
        assert (torch.logsumexp(best.log_probs, 1)[possible] <= 1e-12).all()
        assert torch.equal(best.paths[:, 0], paths) and torch.equal(best.scores[:, 0], scores)
        # Distinct rows: no two valid rows of a sentence are the same path.
        for b in range(B):
            rows = [tuple(p) for p, sc in zip(best.paths[b].tolist(), best.scores[b].tolist()) if sc > -math.inf]
            assert len(rows) == len(set(rows))
            # Rows exist for exactly min(k, number of allowed sequences) when that count is small.
            if T ** int(ln[b]) <= k and not forbid:
                assert len(rows) == T ** int(ln[b])


def test_kbest_with_k1_matches_the_reference(backend):
    # k = 1 takes the Viterbi kernel in the compiled backend: same rows, log-probs and gradients.
    em, tr, ln, s, e = random_crf(9, 12, 5, integer=True)  # integer scores: many exact ties
    outs = {}
    for name in (backend, "reference"):
        with crfkit.use_backend(name):
            em_req = em.clone().requires_grad_()
            best = crfkit.kbest_viterbi(em_req, tr, 1, ln, s, e)
            finite = torch.isfinite(best.log_probs)
            (grad,) = torch.autograd.grad(best.log_probs[finite].sum(), em_req)
            outs[name] = (best.paths, best.scores, best.log_probs, grad)
    assert torch.equal(outs[backend][0], outs["reference"][0])
    for got, want in zip(outs[backend][1:], outs["reference"][1:]):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 8, 9, 16, 17, 64, 65, 130])  # around whole SIMD vectors of tags
@pytest.mark.parametrize("viterbi_kernel", ["lanes", "per_sentence"])
def test_decoders_with_ties_equal_the_reference_exactly(backend, monkeypatch, dtype, T, viterbi_kernel):
    # Integer scores make many exact ties; the kernels' in-register argmax over predecessors
    # (T up to 8 vectors) and its generic fallback must pick the same paths, scores bit for bit,
    # and so must the Viterbi that decodes sentences side by side in SIMD lanes (a partial group
    # here; full ones in test_viterbi_lane_groups_equal_the_reference_exactly).
    monkeypatch.setenv("CRFKIT_VITERBI_LANES", "1" if viterbi_kernel == "lanes" else "0")
    gen = torch.Generator().manual_seed(T)
    em = torch.randint(-3, 4, (5, 20, T), generator=gen).to(dtype)
    tr = torch.randint(-3, 4, (T, T), generator=gen).to(dtype)
    tr[0, T // 2] = -math.inf
    ln = torch.tensor([20, 1, 7, 0, 13])
    scores, paths = crfkit.viterbi(em, tr, ln)
    with crfkit.use_backend("reference"):
        want_scores, want_paths = crfkit.viterbi(em, tr, ln)
    assert torch.equal(paths, want_paths)
    assert torch.equal(scores, want_scores)
    best = crfkit.kbest_viterbi(em[:, :6], tr, 5, ln.clamp(max=6))
    with crfkit.use_backend("reference"):
        want = crfkit.kbest_viterbi(em[:, :6], tr, 5, ln.clamp(max=6))
    assert torch.equal(best.paths, want.paths)
    assert torch.equal(best.scores, want.scores)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 2, 9, 17, 37, 64])
@pytest.mark.parametrize("kernel", ["lanes", "per_sentence", "auto"])
def test_viterbi_lane_groups_equal_the_reference_exactly(backend, monkeypatch, dtype, T, kernel):
    # The compiled Viterbi decodes groups of 16 float / 8 double sentences side by side (one per
    # SIMD lane), sorted by length, or one sentence at a time; CRFKIT_VITERBI_LANES forces either
    # (unset: a cost model chooses). 37 sentences, 3 of length 0, make full groups and a partial
    # one; integer scores make many exact ties; one transition is forbidden and one sentence has
    # no allowed path at all (score -inf, path -1). Paths and scores must equal the reference's.
    monkeypatch.setenv("CRFKIT_VITERBI_LANES", {"lanes": "1", "per_sentence": "0", "auto": ""}[kernel])
    em, tr, ln, start, end = _lane_case(dtype, T, L=20, seed=100 + T)
    scores, paths = crfkit.viterbi(em, tr, ln, start, end)
    with crfkit.use_backend("reference"):
        want_scores, want_paths = crfkit.viterbi(em, tr, ln, start, end)
    assert torch.equal(paths, want_paths)
    assert torch.equal(scores, want_scores)
    assert scores[3] == -math.inf and (paths[3] == -1).all()
    assert (scores[[1, 10, 20]] == 0).all() and (paths[[1, 10, 20]] == -1).all()


def _lane_case(dtype, T, L=12, seed=None):
    """Inputs for the lane decoders (Viterbi and k-best): 37 sentences, 3 of length 0, make full
    lane groups and a partial one, whose lanes end at different positions; integer scores make many exact ties
    (the tie rule decides which paths are listed and in which order); one transition is forbidden and sentence 3
    has no allowed
    path at all (every row missing)."""
    gen = torch.Generator().manual_seed(200 + T if seed is None else seed)
    B = 37
    em = torch.randint(-3, 4, (B, L, T), generator=gen).to(dtype)
    tr = torch.randint(-3, 4, (T, T), generator=gen).to(dtype)
    if T > 1:
        tr[0, T // 2] = -math.inf
    start = torch.randint(-2, 3, (T,), generator=gen).to(dtype)
    end = torch.randint(-2, 3, (T,), generator=gen).to(dtype)
    ln = torch.randint(1, L + 1, (B,), generator=gen)
    ln[[0, 9, 30]] = L
    ln[[1, 10, 20]] = 0
    ln[[2, 11, 25]] = 1
    ln[[4, 26]] = 2
    ln[3] = 7
    em[3, 4] = -math.inf  # every tag forbidden at one position: no allowed path
    return em, tr, ln, start, end


@functools.lru_cache(maxsize=None)
def _kbest_lane_reference(dtype, T, k):
    with crfkit.use_backend("reference"):
        want = crfkit.kbest_viterbi(*_lane_case(dtype, T)[:2], k, *_lane_case(dtype, T)[2:])
    return want.paths, want.scores


@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 2, 9, 16, 17, 37, 64])
@pytest.mark.parametrize("kernel", ["lanes", "per_sentence", "auto"])
def test_kbest_lane_groups_equal_the_reference_exactly(monkeypatch, dtype, T, kernel):
    # The compiled k-best decodes groups of 16 float / 8 double sentences side by side (one per
    # SIMD lane, csrc/cpu/kbest_lanes.h), sorted by length, or one sentence at a time;
    # CRFKIT_VITERBI_LANES forces either (unset: a cost model chooses). k = 15 and 40 exceed the
    # number of sequences of the short sentences (T^length), and 40 needs two-byte backpointers
    # at T >= 7 (lists kept in memory instead of registers). Paths and scores must equal the
    # reference's, bit for bit.
    monkeypatch.setenv("CRFKIT_VITERBI_LANES", {"lanes": "1", "per_sentence": "0", "auto": ""}[kernel])
    em, tr, ln, start, end = _lane_case(dtype, T)
    for k in (2, 5, 15, 40):
        with crfkit.use_backend("compiled"):
            best = crfkit.kbest_viterbi(em, tr, k, ln, start, end)
        want_paths, want_scores = _kbest_lane_reference(dtype, T, k)
        assert torch.equal(best.paths, want_paths), k
        assert torch.equal(best.scores, want_scores), k
        assert (best.scores[3] == -math.inf).all() and (best.paths[3] == -1).all()
        assert (best.scores[[1, 10, 20], 0] == 0).all() and (best.paths[[1, 10, 20]] == -1).all()
        if k > T:  # a length-1 sentence has T sequences: the rows after them are missing
            assert (best.scores[[2, 11, 25], T:] == -math.inf).all()
            assert torch.isfinite(best.scores[[2, 11, 25], :T]).all()


def _pruned_kbest_case(dtype, T, scores, L=24, B=6, seed=0):
    """Inputs for the per-sentence k-best's pruned merge (kbest_step_pruned in
    csrc/cpu/kbest.cpp): 'spread' scores (continuous, wide) leave one list per tag almost
    everywhere; 'steps' (multiples of 1/4 in a narrow range) leave two or more lists and make
    exact ties at the pruning bound; 'flat' (-1, 0, 1) makes so many ties that the step falls back
    to the full merge rounds. Tag 1 is forbidden after every tag (no list survives for it) and
    sentence 2 has no allowed path at one position."""
    gen = torch.Generator().manual_seed(seed + 31 * T)
    def draw(*shape):
        if scores == "spread":
            return torch.randn(*shape, generator=gen, dtype=torch.float64).mul(3).to(dtype)
        if scores == "steps":
            return torch.randint(-6, 7, shape, generator=gen).to(dtype) / 4
        return torch.randint(-1, 2, shape, generator=gen).to(dtype)
    em, tr, start, end = draw(B, L, T), draw(T, T), draw(T), draw(T)
    if T > 2:
        tr[:, 1] = -math.inf
    ln = torch.randint(1, L + 1, (B,), generator=gen)
    ln[0] = L
    if B > 2:
        em[2, 0] = -math.inf
    return em, tr, ln, start, end


@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [3, 9, 16, 17, 37])  # whole and partial vectors of 16 predecessors
@pytest.mark.parametrize("scores", ["spread", "steps", "flat"])
@pytest.mark.parametrize("kernel", ["per_sentence", "lanes"])
def test_pruned_kbest_merge_equals_the_reference_exactly(monkeypatch, dtype, T, scores, kernel):
    # Both k-best decoders merge only the lists that can still reach a tag's K best (those
    # whose head is at least the K-th entry of the best list). The per-sentence one has fast
    # paths for one and two lists and a general merge for more; the lane decoder
    # (merge_lanes_pruned in csrc/cpu/kbest_lanes.h, 9 <= T <= 16 with one-byte codes) a two-way
    # merge where every active lane of a group has at most two such lists, the full merge
    # otherwise. k = 2, 5, 16, 17 and 30 cover lists within one and across two vectors of 16
    # (the masked copy of a whole list), and T * k above 256 needs two-byte backpointers (lists
    # in memory in the lane decoder). The lanes get 20 sentences: full groups and a partial one.
    # Paths and scores must equal the reference's, bit for bit.
    monkeypatch.setenv("CRFKIT_VITERBI_LANES", "1" if kernel == "lanes" else "0")
    em, tr, ln, start, end = _pruned_kbest_case(dtype, T, scores, B=20 if kernel == "lanes" else 6)
    for k in (2, 5, 16, 17, 30):
        with crfkit.use_backend("compiled"):
            best = crfkit.kbest_viterbi(em, tr, k, ln, start, end)
        with crfkit.use_backend("reference"):
            want = crfkit.kbest_viterbi(em, tr, k, ln, start, end)
        assert torch.equal(best.paths, want.paths), k
        assert torch.equal(best.scores, want.scores), k
        assert (best.scores[2] == -math.inf).all() and (best.paths[2] == -1).all()


@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
def test_kbest_with_four_byte_backpointers_equals_the_reference():
    # T * k > 65536 codes need four-byte backpointers (the widest type of backpointers.h).
    em, tr, ln, start, end = _pruned_kbest_case(torch.float32, 260, "spread", L=3, B=2)
    best = crfkit.kbest_viterbi(em, tr, 256, ln, start, end)
    with crfkit.use_backend("reference"):
        want = crfkit.kbest_viterbi(em, tr, 256, ln, start, end)
    assert torch.equal(best.paths, want.paths)
    assert torch.equal(best.scores, want.scores)


@pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")
@pytest.mark.parametrize("seed", range(8))
def test_random_constrained_cases_equal_the_reference(monkeypatch, seed):
    # Seeded random cases across the kernels' branches at once: batch sizes around the lane
    # groups, T around whole vectors, k beyond the number of sequences, integer (tie-heavy),
    # normal and wide scores, and random -inf masks on transitions, start and end, with the lane
    # or per-sentence decoders forced or chosen by the cost models. Decoders must equal the
    # reference bit for bit; log Z, marginals and (float64) its gradients to the usual tolerances.
    rng = torch.Generator().manual_seed(seed)
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]
    for case in range(12):
        dtype = pick([torch.float32, torch.float64])
        B, L, T, k = pick([1, 3, 17, 33]), pick([1, 2, 5, 20]), pick([2, 3, 9, 16, 17, 37]), pick([2, 5, 15, 40])
        kind = pick(["integer", "normal", "wide"])
        def draw(*shape):
            if kind == "integer":
                return torch.randint(-2, 3, shape, generator=rng).to(dtype)
            scale = 3 if kind == "normal" else 40
            return torch.randn(*shape, generator=rng, dtype=torch.float64).mul(scale).to(dtype)
        em, tr, start, end = draw(B, L, T), draw(T, T), draw(T), draw(T)
        tr[torch.rand(T, T, generator=rng) < pick([0.0, 0.3, 0.8])] = -math.inf
        start[torch.rand(T, generator=rng) < pick([0.0, 0.5])] = -math.inf
        end[torch.rand(T, generator=rng) < pick([0.0, 0.5])] = -math.inf
        ln = torch.randint(0, L + 1, (B,), generator=rng)
        monkeypatch.setenv("CRFKIT_VITERBI_LANES", pick(["", "0", "1"]))
        context = f"case {case}: B={B} L={L} T={T} k={k} {dtype} {kind}"
        outs = {}
        for name in ("compiled", "reference"):
            with crfkit.use_backend(name), torch.no_grad():
                outs[name] = (crfkit.log_partition(em, tr, ln, start, end),
                              crfkit.marginals(em, tr, ln, start, end),
                              *crfkit.viterbi(em, tr, ln, start, end),
                              *crfkit.kbest_viterbi(em, tr, k, ln, start, end))
        got, want = outs["compiled"], outs["reference"]
        tol = dict(TOL[dtype])
        if kind == "wide":  # log Z of scores in the hundreds: the absolute error grows with them
            tol["atol"] = 1e-2 if dtype == torch.float32 else 1e-8
        torch.testing.assert_close(got[0], want[0], **tol, msg=context)  # log Z
        marginal_atol = 1e-4 if dtype == torch.float32 else 1e-9
        torch.testing.assert_close(got[1], want[1], atol=marginal_atol, rtol=1e-3, msg=context)
        names = ("viterbi paths", "viterbi scores", "kbest paths", "kbest scores")
        for a, b, what in zip(got[2:6], want[2:6], names):
            assert torch.equal(a, b), f"{context}: {what}"
        torch.testing.assert_close(got[6], want[6], **tol, msg=context)  # k-best log-probs
        if dtype == torch.float64 and B > 0:
            grads = {}
            for name in ("compiled", "reference"):
                em_req, tr_req = em.clone().requires_grad_(), tr.clone().requires_grad_()
                with crfkit.use_backend(name):
                    log_z = crfkit.log_partition(em_req, tr_req, ln, start, end)
                finite = torch.isfinite(log_z)
                g = torch.autograd.grad(log_z[finite].sum(), (em_req, tr_req), allow_unused=True)
                grads[name] = [torch.zeros_like(x) if d is None else d for d, x in zip(g, (em, tr))]
            for a, b in zip(grads["compiled"], grads["reference"]):
                torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9, msg=context)
