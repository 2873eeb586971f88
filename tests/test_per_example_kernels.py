"""The CPU kernels for per-example transitions (csrc/cpu/per_example.cpp), called as
torch.ops.crfkit.*: transitions (B, Lt, T, T) with Lt = 1 (one matrix per sentence) or Lt = L (one
per position; [:, 0] is never read), start / end (B, T).

Checked against brute-force enumeration of every tag sequence (tiny CRFs, every length 0..L in one
batch, -inf entries), against the 2-D kernels with the shared (T, T) matrix expanded (decoders and
sequence scores bit for bit, the rest to rounding), log Z's gradients against autograd through a
pure-torch forward and by gradcheck, and bad arguments."""
import itertools
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
DTYPES = [torch.float64, torch.float32]
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def per_example_crf(L, T, Lt, dtype, seed, forbid=0.0, integer=False, copies=2):
    """emissions (B, L, T), transitions (B, Lt, T, T), lengths (B,) with every length 0..L `copies`
    times, start, end (B, T); a fraction `forbid` of all scores set to -inf."""
    g = torch.Generator().manual_seed(seed)
    B = copies * (L + 1)

    def draw(*shape):
        x = torch.randint(-1, 2, shape, generator=g).double() if integer else torch.randn(*shape, generator=g,
                                                                                           dtype=torch.float64)
        if forbid:
            x[torch.rand(shape, generator=g) < forbid] = NEG_INF
        return x.to(dtype)

    lengths = torch.arange(B) % (L + 1)
    return draw(B, L, T), draw(B, Lt, T, T), lengths, draw(B, T), draw(B, T)


def sentence_transitions(transitions, b):
    """Sentence b's transitions for brute_force.all_sequences: (T, T), or (L, T, T) per position."""
    return transitions[b, 0] if transitions.shape[1] == 1 else transitions[b]


def enumerate_all(emissions, transitions, lengths, start, end):
    return [brute_force.all_sequences(emissions[b].double(), sentence_transitions(transitions, b).double(),
                                      start[b].double(), end[b].double(), int(lengths[b]))
            for b in range(emissions.shape[0])]


def brute_force_counts(seqs, L, T):
    """Pairwise marginals per position (L, T, T): [i, s, t] = P(y_{i-1} = s, y_i = t), [0] = 0."""
    counts = torch.zeros(L, T, T, dtype=torch.float64)
    log_z = brute_force.log_partition(seqs)
    for score, seq in seqs:
        p = math.exp(score - log_z)
        for i in range(1, len(seq)):
            counts[i, seq[i - 1], seq[i]] += p
    return counts


# ---- 1. brute force -----------------------------------------------------------------------------

BRUTE_CASES = [(L, T, per_position, dtype) for L, T in [(1, 1), (2, 1), (3, 2), (4, 2), (2, 3), (4, 3)]
               for per_position in (False, True) for dtype in DTYPES]


def _ids(case):
    L, T, per_position, dtype = case
    return f"L{L}-T{T}-{'per_position' if per_position else 'per_sentence'}-{str(dtype)[6:]}"


@pytest.mark.parametrize("case", BRUTE_CASES, ids=_ids)
@pytest.mark.parametrize("forbid", [0.0, 0.25])
def test_probabilities_match_enumeration(case, forbid):
    L, T, per_position, dtype = case
    em, tr, ln, st, en = per_example_crf(L, T, L if per_position else 1, dtype, seed=L * 31 + T, forbid=forbid)
    tol = TOL[dtype]
    log_z = ops.log_partition(em, tr, ln, st, en)
    mu = ops.marginals(em, tr, ln, st, en)
    counts = ops.expected_transition_counts(em, tr, ln, st, en)
    log_z2, mu2, pair_counts = ops.log_partition_with_marginals(em, tr, ln, st, en)
    assert torch.equal(log_z, log_z2) and torch.equal(mu, mu2)
    assert counts.shape == (em.shape[0], T, T) and pair_counts.shape == tr.shape
    for b, seqs in enumerate(enumerate_all(em, tr, ln, st, en)):
        want_log_z = brute_force.log_partition(seqs)
        if want_log_z == NEG_INF:
            assert log_z[b].item() == NEG_INF
        else:
            assert log_z[b].item() == pytest.approx(want_log_z, **{"rel": tol["rtol"], "abs": tol["atol"]})
        want_mu = torch.tensor(brute_force.marginals(seqs, L, T), dtype=torch.float64) if seqs else torch.zeros(L, T)
        torch.testing.assert_close(mu[b].double(), want_mu.double(), **tol)
        want_pairs = brute_force_counts(seqs, L, T) if seqs else torch.zeros(L, T, T, dtype=torch.float64)
        torch.testing.assert_close(counts[b].double(), want_pairs.sum(0), **tol)
        want = want_pairs if per_position else want_pairs.sum(0, keepdim=True)
        torch.testing.assert_close(pair_counts[b].double(), want, **tol)


def check_decoders(em, tr, ln, st, en, exact_scores):
    """Viterbi, k-best (k above every sentence's number of sequences) and the log-probs against the
    complete enumeration order; scores bit for bit where exact_scores."""
    enumerations = enumerate_all(em, tr, ln, st, en)
    k = max(len(seqs) for seqs in enumerations) + 3
    v_scores, v_paths = ops.viterbi(em, tr, ln, st, en)
    k_scores, k_paths = ops.kbest_viterbi(em, tr, k, ln, st, en)
    lp_scores, lp_paths, log_probs = ops.kbest_viterbi_with_log_probs(em, tr, k, ln, st, en)
    assert torch.equal(lp_scores, k_scores) and torch.equal(lp_paths, k_paths)
    one_scores, one_paths = ops.kbest_viterbi(em, tr, 1, ln, st, en)
    assert torch.equal(one_scores[:, 0], v_scores) and torch.equal(one_paths[:, 0], v_paths)
    log_z = ops.log_partition(em, tr, ln, st, en)

    def same(got, want):
        if exact_scores:
            assert got == want
        else:
            assert got == pytest.approx(want, rel=1e-5, abs=1e-5)

    for b, seqs in enumerate(enumerations):
        n = int(ln[b])
        if seqs:
            assert v_paths[b, :n].tolist() == list(seqs[0][1])
            same(v_scores[b].item(), seqs[0][0])
        else:
            assert v_scores[b].item() == NEG_INF
            assert (v_paths[b] == -1).all()
        assert (v_paths[b, n:] == -1).all()
        for j in range(k):
            if j < len(seqs):
                score, seq = seqs[j]
                assert k_paths[b, j, :n].tolist() == list(seq), (b, j)
                same(k_scores[b, j].item(), score)
                assert log_probs[b, j].item() == pytest.approx(score - log_z[b].item(), abs=1e-5)
            else:
                assert k_scores[b, j].item() == NEG_INF and log_probs[b, j].item() == NEG_INF
                assert (k_paths[b, j] == -1).all()
            assert (k_paths[b, j, n:] == -1).all()
        if n == 0:  # the empty path: score 0, log-prob 0
            assert k_scores[b, 0].item() == 0 and log_probs[b, 0].item() == 0 and v_scores[b].item() == 0


@pytest.mark.parametrize("case", BRUTE_CASES, ids=_ids)
@pytest.mark.parametrize("forbid", [0.0, 0.25])
def test_decoders_match_enumeration(case, forbid):
    L, T, per_position, dtype = case
    em, tr, ln, st, en = per_example_crf(L, T, L if per_position else 1, dtype, seed=L * 7 + T, forbid=forbid)
    # float32 sums differ from the enumeration's float64 ones in rounding (not in order here)
    check_decoders(em, tr, ln, st, en, exact_scores=dtype == torch.float64)


@pytest.mark.parametrize("case", BRUTE_CASES, ids=_ids)
def test_ties_follow_the_documented_rule(case):
    # Scores in {-1, 0, 1} (and -inf): sums are exact in both dtypes and many sequences tie.
    L, T, per_position, dtype = case
    em, tr, ln, st, en = per_example_crf(L, T, L if per_position else 1, dtype, seed=L * 5 + T, forbid=0.1,
                                         integer=True)
    check_decoders(em, tr, ln, st, en, exact_scores=True)


def test_all_scores_equal_orders_by_reversed_tags():
    zeros = torch.zeros(1, 2, 2, dtype=torch.float64)
    for Lt in (1, 2):
        scores, paths = ops.kbest_viterbi(zeros, torch.zeros(1, Lt, 2, 2, dtype=torch.float64), 4,
                                          torch.tensor([2]), torch.zeros(1, 2, dtype=torch.float64),
                                          torch.zeros(1, 2, dtype=torch.float64))
        assert paths[0].tolist() == [[0, 0], [1, 0], [0, 1], [1, 1]]
        assert scores[0].tolist() == [0.0] * 4


@pytest.mark.parametrize("case", BRUTE_CASES, ids=_ids)
def test_sequence_score_matches_the_enumeration_scores(case):
    L, T, per_position, dtype = case
    em, tr, ln, st, en = per_example_crf(L, T, L if per_position else 1, dtype, seed=L * 3 + T, forbid=0.2)
    B = em.shape[0]
    tags = torch.tensor([list(seq) for seq in itertools.islice(itertools.cycle(itertools.product(range(T), repeat=L)),
                                                                B * 3)]).reshape(B, 3, L)
    got = ops.sequence_score(em, tr, tags, ln, st, en)
    for b in range(B):
        n = int(ln[b])
        for j in range(3):
            y = tags[b, j, :n].tolist()
            if n == 0:
                assert got[b, j].item() == 0
                continue
            # the kernels' order, in the tensors' dtype: ((score + transition) + emission), then + end
            m = sentence_transitions(tr, b)
            score = st[b, y[0]] + em[b, 0, y[0]]
            for i in range(1, n):
                score = (score + (m[i] if per_position else m)[y[i - 1], y[i]]) + em[b, i, y[i]]
            assert got[b, j].item() == (score + en[b, y[-1]]).item()


# ---- 2. identity with the 2-D kernels ------------------------------------------------------------

IDENTITY_SHAPES = [(1, 1, 1), (5, 7, 5), (9, 33, 9), (12, 16, 3), (10, 20, 40), (64, 24, 9)]  # (B, L, T)


def expanded(transitions, start, end, B, L, per_position):
    """The shared parameters expanded to the per-example shapes, contiguous."""
    T = transitions.shape[0]
    tr = transitions.expand(B, L if per_position else 1, T, T).contiguous()
    return tr, start.expand(B, T).contiguous(), end.expand(B, T).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_position", [False, True])
@pytest.mark.parametrize("B,L,T", IDENTITY_SHAPES)
def test_decoders_and_scores_equal_the_2d_kernels_bit_for_bit(B, L, T, per_position, dtype):
    em, tr, ln, st, en = random_crf(B, L, T, dtype=dtype, scale=2.0)
    tr[0, -1] = NEG_INF  # a forbidden transition
    tr4, st2, en2 = expanded(tr, st, en, B, L, per_position)
    for k in (1, 2, 7):
        for want, got in zip(ops.kbest_viterbi(em, tr, k, ln, st, en), ops.kbest_viterbi(em, tr4, k, ln, st2, en2)):
            assert torch.equal(got, want), k
        want = ops.kbest_viterbi_with_log_probs(em, tr, k, ln, st, en)
        got = ops.kbest_viterbi_with_log_probs(em, tr4, k, ln, st2, en2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        torch.testing.assert_close(got[2], want[2], **TOL[dtype])  # log Z: see below
    for want, got in zip(ops.viterbi(em, tr, ln, st, en), ops.viterbi(em, tr4, ln, st2, en2)):
        assert torch.equal(got, want)
    tags = torch.randint(0, T, (B, 3, L))
    assert torch.equal(ops.sequence_score(em, tr4, tags, ln, st2, en2), ops.sequence_score(em, tr, tags, ln, st, en))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_position", [False, True])
@pytest.mark.parametrize("B,L,T", IDENTITY_SHAPES)
def test_probabilities_and_gradients_equal_the_2d_kernels(B, L, T, per_position, dtype):
    # Not bit for bit: the 2-D kernels run in probability space (scaled exponentials, SIMD lanes),
    # these in log space; both in double inside, so they agree to rounding.
    em, tr, ln, st, en = random_crf(B, L, T, dtype=dtype, scale=2.0)
    tr[0, -1] = NEG_INF
    tr4, st2, en2 = expanded(tr, st, en, B, L, per_position)
    tol = TOL[dtype]

    def close(got, want):
        torch.testing.assert_close(got, want, **tol)

    close(ops.log_partition(em, tr4, ln, st2, en2), ops.log_partition(em, tr, ln, st, en))
    close(ops.marginals(em, tr4, ln, st2, en2), ops.marginals(em, tr, ln, st, en))
    close(ops.expected_transition_counts(em, tr4, ln, st2, en2), ops.expected_transition_counts(em, tr, ln, st, en))
    log_z, mu, counts = ops.log_partition_with_marginals(em, tr4, ln, st2, en2)
    want_log_z, want_mu, want_counts = ops.log_partition_with_marginals(em, tr, ln, st, en)
    close(log_z, want_log_z)
    close(mu, want_mu)
    close(counts.sum(1), want_counts)
    assert counts.shape == tr4.shape
    if per_position:
        assert (counts[:, 0] == 0).all()

    g = torch.linspace(-1.0, 2.0, B, dtype=dtype)
    grads = ops.log_partition_backward(g, em, tr4, ln, st2, en2)
    want = ops.log_partition_backward(g, em, tr, ln, st, en)
    assert [x.shape for x in grads] == [em.shape, tr4.shape, st2.shape, en2.shape]
    close(grads[0], want[0])
    close(grads[1].sum((0, 1)), want[1])
    close(grads[2].sum(0), want[2])
    close(grads[3].sum(0), want[3])
    # From the marginals: the same gradients per example, and the 2-D op's arithmetic on its own
    # marginals (emissions' gradient bit for bit, the batch sums to rounding).
    from_marginals = ops.log_partition_backward_from_marginals(g, mu, counts, ln)
    for got, expect in zip(from_marginals, grads):
        close(got, expect)
    want_from = ops.log_partition_backward_from_marginals(g, want_mu, want_counts, ln)
    got_from = ops.log_partition_backward_from_marginals(g, want_mu, want_counts.unsqueeze(1).contiguous(), ln)
    assert torch.equal(got_from[0], want_from[0])
    close(got_from[1].sum((0, 1)), want_from[1])
    close(got_from[2].sum(0), want_from[2])
    close(got_from[3].sum(0), want_from[3])


def test_expanded_and_strided_arguments_are_accepted():
    # Non-contiguous per-example arguments (expanded, or a slice) are copied to dense memory first.
    em, tr, ln, st, en = random_crf(6, 9, 4, scale=2.0)
    B, L, T = em.shape
    dense = expanded(tr, st, en, B, L, True)
    want = ops.viterbi(em, *dense[:1], ln, *dense[1:])
    wide = torch.zeros(B, L, T, 2 * T, dtype=em.dtype)
    wide[..., ::2] = dense[0]
    for tr4 in (tr.expand(B, L, T, T), wide[..., ::2]):
        got = ops.viterbi(em, tr4, ln, st.expand(B, T), en.expand(B, T))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(ops.log_partition(em, tr.expand(B, 1, T, T), ln, st.expand(B, T), en.expand(B, T)),
                               ops.log_partition(em, tr, ln, st, en), rtol=1e-10, atol=1e-10)


# ---- 3. gradients --------------------------------------------------------------------------------

def log_z_torch(em, tr, ln, st, en):
    """log Z (B,) by the forward algorithm in pure torch, differentiable by autograd."""
    out = []
    for b in range(em.shape[0]):
        n = int(ln[b])
        if n == 0:
            out.append(em.new_zeros(()))
            continue
        alpha = st[b] + em[b, 0]
        for i in range(1, n):
            alpha = torch.logsumexp(alpha[:, None] + tr[b, i if tr.shape[1] > 1 else 0], 0) + em[b, i]
        out.append(torch.logsumexp(alpha + en[b], 0))
    return torch.stack(out)


class KernelLogZ(torch.autograd.Function):
    """log Z through the kernels: forward log_partition, backward log_partition_backward."""

    @staticmethod
    def forward(ctx, em, tr, st, en, ln):
        ctx.save_for_backward(em, tr, st, en, ln)
        return ops.log_partition(em, tr, ln, st, en)

    @staticmethod
    def backward(ctx, grad):
        em, tr, st, en, ln = ctx.saved_tensors
        return (*ops.log_partition_backward(grad.contiguous(), em, tr, ln, st, en), None)


@pytest.mark.parametrize("per_position", [False, True])
@pytest.mark.parametrize("L,T", [(1, 3), (4, 2), (6, 4)])
def test_log_partition_backward_matches_autograd(L, T, per_position):
    em, tr, ln, st, en = per_example_crf(L, T, L if per_position else 1, torch.float64, seed=11 * L + T)
    g = torch.randn(em.shape[0], dtype=torch.float64)
    params = [x.clone().requires_grad_() for x in (em, tr, st, en)]
    log_z = log_z_torch(params[0], params[1], ln, params[2], params[3])
    torch.testing.assert_close(ops.log_partition(em, tr, ln, st, en), log_z.detach(), rtol=1e-12, atol=1e-12)
    want = torch.autograd.grad(log_z, params, g, allow_unused=True)
    want = [torch.zeros_like(p) if w is None else w for w, p in zip(want, params)]
    got = ops.log_partition_backward(g, em, tr, ln, st, en)
    for name, a, b in zip(("emissions", "transitions", "start", "end"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    if per_position:
        assert (got[1][:, 0] == 0).all()  # transitions[:, 0] is never read
    # The same from the marginals (the compiled backend's differentiable log Z).
    _, mu, counts = ops.log_partition_with_marginals(em, tr, ln, st, en)
    for name, a, b in zip(("emissions", "transitions", "start", "end"),
                          ops.log_partition_backward_from_marginals(g, mu, counts, ln), want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("per_position", [False, True])
def test_gradcheck(per_position):
    em, tr, ln, st, en = per_example_crf(3, 3, 3 if per_position else 1, torch.float64, seed=5, copies=1)
    inputs = [x.clone().requires_grad_() for x in (em, tr, st, en)]
    assert torch.autograd.gradcheck(lambda *xs: KernelLogZ.apply(*xs, ln), inputs)


@pytest.mark.parametrize("per_position", [False, True])
def test_forbidden_and_empty_sentences_get_zero_gradients(per_position):
    L, T = 4, 3
    em, tr, ln, st, en = per_example_crf(L, T, L if per_position else 1, torch.float64, seed=3, copies=1)
    st[1] = NEG_INF  # sentence 1: no first tag allowed
    tr[2, :, :, 0] = NEG_INF  # sentence 2 (length 2): every path ends in 0 or leaves it
    tr[2, :, :, 1:] = NEG_INF
    ln[3] = 0
    g = torch.ones(em.shape[0], dtype=torch.float64)
    log_z = ops.log_partition(em, tr, ln, st, en)
    assert log_z[1].item() == NEG_INF and log_z[2].item() == NEG_INF and log_z[3].item() == 0
    assert log_z[0].item() == 0  # length 0
    outputs = [*ops.log_partition_backward(g, em, tr, ln, st, en), ops.marginals(em, tr, ln, st, en),
               *ops.log_partition_with_marginals(em, tr, ln, st, en)[1:],
               ops.expected_transition_counts(em, tr, ln, st, en)]
    for out in outputs:
        assert not out.isnan().any()
        assert (out[[0, 1, 2, 3]] == 0).all()
    scores, paths = ops.viterbi(em, tr, ln, st, en)
    assert scores[:4].tolist() == [0.0, NEG_INF, NEG_INF, 0.0] and (paths[:4] == -1).all()


# ---- 4. bad input --------------------------------------------------------------------------------

def _calls(em, tr, ln, st, en):
    B, L, T = em.shape
    return {
        "log_partition": lambda: ops.log_partition(em, tr, ln, st, en),
        "marginals": lambda: ops.marginals(em, tr, ln, st, en),
        "log_partition_backward": lambda: ops.log_partition_backward(em.new_ones(B), em, tr, ln, st, en),
        "log_partition_with_marginals": lambda: ops.log_partition_with_marginals(em, tr, ln, st, en),
        "expected_transition_counts": lambda: ops.expected_transition_counts(em, tr, ln, st, en),
        "viterbi": lambda: ops.viterbi(em, tr, ln, st, en),
        "kbest_viterbi": lambda: ops.kbest_viterbi(em, tr, 3, ln, st, en),
        "kbest_viterbi_with_log_probs": lambda: ops.kbest_viterbi_with_log_probs(em, tr, 3, ln, st, en),
        "sequence_score": lambda: ops.sequence_score(em, tr, torch.zeros(B, 1, L, dtype=torch.long), ln, st, en),
    }


OPS = ["log_partition", "marginals", "log_partition_backward", "log_partition_with_marginals",
       "expected_transition_counts", "viterbi", "kbest_viterbi", "kbest_viterbi_with_log_probs", "sequence_score"]


def _bad(case):
    """(emissions, transitions, lengths, start, end) broken in one way, and the message expected."""
    B, L, T = 3, 5, 4
    em, tr, ln, st, en = per_example_crf(L, T, 1, torch.float64, seed=1, copies=1)
    em, ln = em[:B], ln[:B]
    tr, st, en = tr[:B], st[:B], en[:B]
    if case == "Lt":
        return em, torch.zeros(B, 2, T, T, dtype=em.dtype), ln, st, en, r"transitions must be .*Lt = 1 or seq_len"
    if case == "batch":
        return em, torch.zeros(B + 1, 1, T, T, dtype=em.dtype), ln, st, en, r"transitions must be .*\(3, 1 or 5, 4, 4\)"
    if case == "tags":
        return em, torch.zeros(B, 1, T, T + 1, dtype=em.dtype), ln, st, en, r"transitions must be"
    if case == "start":
        return em, tr, ln, st[0], en, r"start must be \(batch, num_tags\) = \(3, 4\) when transitions are per example"
    if case == "end":
        return em, tr, ln, st, en[:, None], r"end must be \(batch, num_tags\)"
    if case == "nan":
        tr = tr.clone()
        tr[1, 0, 2, 3] = math.nan
        return em, tr, ln, st, en, r"transitions contains NaN or \+inf"
    if case == "inf":
        st = st.clone()
        st[2, 1] = math.inf
        return em, tr, ln, st, en, r"start contains NaN or \+inf"
    if case == "length":
        return em, tr, torch.tensor([1, 6, 0]), st, en, r"lengths\[1\] = 6 is outside \[0, seq_len = 5\]"
    if case == "dtype":
        return em, tr.float(), ln, st, en, r"must have the dtype of emissions"
    if case == "emissions":
        em = em.clone()
        em[2, 0, 1] = math.nan
        return em, tr, torch.tensor([1, 2, 3]), st, en, r"emissions\[2\] contains NaN or \+inf"
    raise AssertionError(case)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", ["Lt", "batch", "tags", "start", "end", "nan", "inf", "length", "dtype", "emissions"])
def test_bad_arguments_raise_naming_them(op, case):
    *args, message = _bad(case)
    with pytest.raises((ValueError, RuntimeError), match=message):
        _calls(*args)[op]()


def test_bad_arguments_of_the_other_ops():
    em, tr, ln, st, en = per_example_crf(4, 3, 1, torch.float64, seed=2, copies=1)
    B, L, T = em.shape
    with pytest.raises(RuntimeError, match=r"per-example transitions .* not supported by marginals_backward"):
        ops.marginals_backward(torch.zeros_like(em), em, tr, ln, st, en)
    with pytest.raises(RuntimeError, match=r"not supported by expected_transition_counts_backward"):
        ops.expected_transition_counts_backward(torch.zeros(B, T, T, dtype=em.dtype), em, tr, ln, st, en)
    _, mu, counts = ops.log_partition_with_marginals(em, tr, ln, st, en)
    with pytest.raises(ValueError, match=r"transition_counts must be .*Lt = 1 or seq_len"):
        ops.log_partition_backward_from_marginals(em.new_ones(B), mu, counts.expand(B, 2, T, T), ln)
    with pytest.raises(ValueError, match=r"grad_log_z must be \(batch,\)"):
        ops.log_partition_backward_from_marginals(em.new_ones(B + 1), mu, counts, ln)
    with pytest.raises(ValueError, match=r"lengths\[0\] = 9 is outside"):
        ops.log_partition_backward_from_marginals(em.new_ones(B), mu, counts, torch.full((B,), 9))
    with pytest.raises(ValueError, match=r"grad_log_z must be"):
        ops.log_partition_backward(em.new_ones(B, 1), em, tr, ln, st, en)
    with pytest.raises(ValueError, match=r"k must be at least 1"):
        ops.kbest_viterbi(em, tr, 0, ln, st, en)
    with pytest.raises(ValueError, match=r"tags\[1, 0, 0\] = 3 is not a tag index"):
        ops.sequence_score(em, tr, torch.full((B, 1, L), T), ln, st, en)
