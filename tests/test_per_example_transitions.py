"""Per-example parameters through the public ops, on every backend: transitions (B, T, T) (one matrix
per sentence) and (B, L, T, T) (one per position), start / end (B, T). Each op against brute-force
enumeration of every tag sequence of each sentence (its own transitions), and against the shared
(T, T) case where the per-example tensors are copies of one matrix."""
import math

import pytest
import torch

import brute_force
import crfkit
from conftest import random_crf


def per_example_crf(B, L, T, per_position, dtype=torch.float64, seed=0, forbid=0.0):
    """emissions, transitions (B, T, T) or (B, L, T, T), lengths (ragged, with 0 and L), start, end (B, T);
    a share `forbid` of the transition / start / end scores are -inf."""
    emissions, _, lengths, _, _ = random_crf(B, L, T, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    shape = (B, L, T, T) if per_position else (B, T, T)
    transitions = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    start, end = (torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    if forbid:
        for x in (transitions, start, end):
            x.masked_fill_(torch.rand(x.shape, generator=g) < forbid, -math.inf)
    return emissions, transitions, lengths, start, end


def enumerate_sentence(emissions, transitions, start, end, lengths, b):
    """brute_force.all_sequences for sentence b, with its own transitions ((T, T) or (L, T, T))."""
    return brute_force.all_sequences(emissions[b], transitions[b], start[b], end[b], int(lengths[b]))


@pytest.mark.parametrize("per_position", [False, True], ids=["per_sentence", "per_position"])
@pytest.mark.parametrize("L, T, forbid", [(1, 3, 0.0), (3, 2, 0.0), (4, 3, 0.0), (4, 3, 0.3), (3, 1, 0.0)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_op_against_enumeration(backend, per_position, L, T, forbid, dtype):
    B = 5
    emissions, transitions, lengths, start, end = per_example_crf(B, L, T, per_position, dtype, seed=L * 7 + T,
                                                                  forbid=forbid)
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    seqs = [enumerate_sentence(emissions.double(), transitions.double(), start.double(), end.double(), lengths, b)
            for b in range(B)]
    k = max(len(s) for s in seqs) + 2
    log_z = crfkit.log_partition(emissions, transitions, lengths, start, end)
    mu = crfkit.marginals(emissions, transitions, lengths, start, end)
    counts = crfkit.expected_transition_counts(emissions, transitions, lengths, start, end)
    best = crfkit.viterbi(emissions, transitions, lengths, start, end)
    kbest = crfkit.kbest_viterbi(emissions, transitions, k, lengths, start, end)
    for b in range(B):
        n = int(lengths[b])
        expected = brute_force.log_partition(seqs[b])
        if expected == -math.inf:
            assert log_z[b].item() == -math.inf
        else:
            assert log_z[b].item() == pytest.approx(expected, rel=tol, abs=tol)
        expected_mu = torch.tensor(brute_force.marginals(seqs[b], L, T), dtype=torch.float64)
        torch.testing.assert_close(mu[b].double(), expected_mu, atol=tol * 10, rtol=0)
        pair = torch.zeros(T, T, dtype=torch.float64)
        for score, seq in seqs[b]:
            for i in range(1, n):
                pair[seq[i - 1], seq[i]] += math.exp(score - expected)
        torch.testing.assert_close(counts[b].double(), pair, atol=tol * 10, rtol=0)
        if seqs[b]:
            assert best.paths[b, :n].tolist() == list(seqs[b][0][1])
            assert best.scores[b].item() == pytest.approx(seqs[b][0][0], rel=tol, abs=tol)
        else:
            assert best.scores[b].item() == -math.inf and bool((best.paths[b] == -1).all())
        for j in range(k):
            if j < len(seqs[b]):
                score, seq = seqs[b][j]
                if dtype == torch.float64:  # the complete order (float32 ties may round apart)
                    assert kbest.paths[b, j, :n].tolist() == list(seq), (b, j)
                assert kbest.scores[b, j].item() == pytest.approx(score, rel=tol, abs=tol)
                assert kbest.log_probs[b, j].item() == pytest.approx(score - expected, rel=tol, abs=tol * 10)
            else:
                assert kbest.scores[b, j].item() == -math.inf and bool((kbest.paths[b, j] == -1).all())
    # sequence_score of the enumerated sequences.
    tags = torch.zeros(B, 1, L, dtype=torch.long)
    for b in range(B):
        if seqs[b]:
            tags[b, 0, :int(lengths[b])] = torch.tensor(seqs[b][-1][1], dtype=torch.long)
    scores = crfkit.sequence_score(emissions, transitions, tags, lengths, start, end)
    for b in range(B):
        if seqs[b]:
            assert scores[b, 0].item() == pytest.approx(seqs[b][-1][0], rel=tol, abs=tol)


@pytest.mark.parametrize("form", ["(B, T, T)", "(B, 1, T, T)", "(B, L, T, T)"])
def test_copies_of_one_matrix_give_the_shared_results(backend, form):
    emissions, transitions, lengths, start, end = random_crf(6, 7, 4, seed=3)
    B, L, T = emissions.shape
    expanded = {"(B, T, T)": transitions.expand(B, T, T), "(B, 1, T, T)": transitions.expand(B, 1, T, T),
                "(B, L, T, T)": transitions.expand(B, L, T, T)}[form].clone()
    start_b, end_b = start.expand(B, T).clone(), end.expand(B, T).clone()
    shared = crfkit.kbest_viterbi(emissions, transitions, 4, lengths, start, end)
    each = crfkit.kbest_viterbi(emissions, expanded, 4, lengths, start_b, end_b)
    assert torch.equal(shared.paths, each.paths)
    torch.testing.assert_close(each.scores, shared.scores, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(crfkit.marginals(emissions, expanded, lengths, start_b, end_b),
                               crfkit.marginals(emissions, transitions, lengths, start, end))
    # Gradients: the per-example ones sum over the batch to the shared ones.
    params = [x.clone().requires_grad_() for x in (emissions, transitions, start, end)]
    crfkit.log_partition(params[0], params[1], lengths, params[2], params[3]).sum().backward()
    per = [x.clone().requires_grad_() for x in (emissions, expanded, start_b, end_b)]
    crfkit.log_partition(per[0], per[1], lengths, per[2], per[3]).sum().backward()
    torch.testing.assert_close(per[0].grad, params[0].grad)
    torch.testing.assert_close(per[1].grad.reshape(B, -1, T, T).sum((0, 1)), params[1].grad)
    torch.testing.assert_close(per[2].grad.sum(0), params[2].grad)
    torch.testing.assert_close(per[3].grad.sum(0), params[3].grad)


@pytest.mark.parametrize("per_position", [False, True], ids=["per_sentence", "per_position"])
def test_gradients_pass_gradcheck(backend, per_position):
    emissions, transitions, lengths, start, end = per_example_crf(3, 4, 3, per_position, seed=11)
    inputs = [x.clone().requires_grad_() for x in (emissions, transitions, start, end)]

    def log_z(em, tr, st, en):
        return crfkit.log_partition(em, tr, lengths, st, en)

    def path_scores(em, tr, st, en):
        return crfkit.kbest_viterbi(em, tr, 3, lengths, st, en).log_probs.masked_fill(lengths[:, None] == 0, 0)

    def tag_scores(em, tr, st, en):
        tags = torch.tensor([[0, 1, 2, 0], [2, 2, 1, 0], [1, 0, 0, 2]])
        return crfkit.sequence_score(em, tr, tags, lengths, st, en)

    for function in (log_z, path_scores, tag_scores):
        assert torch.autograd.gradcheck(function, inputs), function.__name__
    assert torch.autograd.gradcheck(lambda em, tr, st, en: crfkit.marginals(em, tr, lengths, st, en), inputs)


def test_forbidden_everywhere_gives_zero_gradients_not_nan(backend):
    emissions, transitions, lengths, start, end = per_example_crf(3, 4, 2, True, seed=5)
    start[0] = -math.inf  # sentence 0 (of length L) allows no sequence
    inputs = [x.clone().requires_grad_() for x in (emissions, transitions, start, end)]
    log_z = crfkit.log_partition(inputs[0], inputs[1], lengths, inputs[2], inputs[3])
    assert log_z[0].item() == -math.inf and bool(torch.isfinite(log_z[1:]).all())
    (log_z * torch.tensor([1.0, 1.0, 1.0], dtype=log_z.dtype)).masked_fill(log_z == -math.inf, 0).sum().backward()
    for x in inputs:
        assert bool(torch.isfinite(x.grad).all())
    assert bool((inputs[0].grad[0] == 0).all()) and bool((inputs[1].grad[0] == 0).all())


def test_per_position_transitions_follow_a_mask_with_holes():
    # With a mask, transitions[b, p] scores the move from the previous REAL position into p.
    emissions, transitions, _, start, end = per_example_crf(2, 5, 3, True, seed=2)
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 1, 1, 0, 1]], dtype=torch.bool)
    log_z = crfkit.log_partition(emissions, transitions, start=start, end=end, mask=mask)
    best = crfkit.kbest_viterbi(emissions, transitions, 3, start=start, end=end, mask=mask)
    for b in range(2):
        real = mask[b].nonzero().squeeze(1)
        seqs = brute_force.all_sequences(emissions[b, real], transitions[b, real], start[b], end[b], len(real))
        assert log_z[b].item() == pytest.approx(brute_force.log_partition(seqs), rel=1e-12)
        for j in range(3):
            assert best.paths[b, j, real].tolist() == list(seqs[j][1])
        assert bool((best.paths[b][:, ~mask[b]] == -1).all())


def test_the_distribution_of_per_position_crfs_has_the_exact_kl():
    p_args = per_example_crf(3, 3, 2, True, seed=8)
    q_args = per_example_crf(3, 3, 2, True, seed=9)
    q_args = (q_args[0], q_args[1], p_args[2], q_args[3], q_args[4])  # the same lengths
    p, q = crfkit.LinearChainCRF(*p_args), crfkit.LinearChainCRF(*q_args)
    kl = p.kl_divergence(q)
    for b in range(3):
        ps = {seq: s for s, seq in enumerate_sentence(*p_args[:2], p_args[3], p_args[4], p_args[2], b)}
        qs = {seq: s for s, seq in enumerate_sentence(*q_args[:2], q_args[3], q_args[4], q_args[2], b)}
        lp, lq = brute_force.log_partition([(s, k) for k, s in ps.items()]), brute_force.log_partition(
            [(s, k) for k, s in qs.items()])
        expected = sum(math.exp(s - lp) * ((s - lp) - (qs[seq] - lq)) for seq, s in ps.items())
        assert kl[b].item() == pytest.approx(expected, abs=1e-10)


@pytest.mark.parametrize("transitions_shape, start_shape, message", [
    ((3, 2, 4, 4), (4,), r"transitions must have shape \(4, 4\) or \(3, 4, 4\) or \(3, 1, 4, 4\) or \(3, 5, 4, 4\)"),
    ((2, 4, 4), (4,), r"transitions must have shape .*got \(2, 4, 4\)"),
    ((4, 4), (2, 4), r"start must have shape \(4,\) or \(3, 4\)"),
    ((3, 4, 4), (3, 5), r"start must have shape"),
])
def test_bad_per_example_shapes_name_the_argument(transitions_shape, start_shape, message):
    emissions = torch.randn(3, 5, 4)
    with pytest.raises(ValueError, match=message):
        crfkit.log_partition(emissions, torch.randn(transitions_shape), start=torch.randn(start_shape))


def test_the_compiled_backend_runs_per_example_transitions_in_its_cpu_kernels():
    if "compiled" not in crfkit.backend_info()["available"]:
        pytest.skip("the compiled extension is not built")
    with crfkit.use_backend("compiled"):
        per_example = torch.zeros(2, 1, 3, 3)
        assert crfkit.backends.for_transitions(per_example).__name__.endswith("compiled")
        assert crfkit.backends.for_transitions(torch.zeros(2, 1, 3, 3, device="meta")) is crfkit.reference


@pytest.mark.parametrize("per_position", [False, True], ids=["per_sentence", "per_position"])
def test_torch_compile_traces_per_example_transitions(per_position):
    # The compiled backend's ops have fakes for per-example shapes (the reference, with its
    # data-dependent checks, is not traceable: as for shared transitions, tests/test_parity.py).
    if "compiled" not in crfkit.backend_info()["available"]:
        pytest.skip("the compiled extension is not built")
    from conftest import check_compile_matches_eager
    emissions, transitions, lengths, start, end = per_example_crf(3, 5, 4, per_position, seed=12)
    check_compile_matches_eager(emissions, transitions, lengths, start, end, crfkit.use_backend("compiled"))


@pytest.mark.parametrize("per_example", [False, True])
def test_counts_of_one_position_sentences_are_zero_with_forbidden_transitions(backend, per_example):
    # No transition is read at L = 1: the counts are 0, not 0 * -inf = NaN.
    emissions, transitions, lengths, start, end = random_crf(3, 1, 3, seed=4)
    transitions[0, 1] = -math.inf
    if per_example:
        transitions = transitions.expand(3, 3, 3).clone()
    counts = crfkit.expected_transition_counts(emissions, transitions, lengths, start, end)
    assert torch.equal(counts, torch.zeros(3, 3, 3, dtype=counts.dtype))
