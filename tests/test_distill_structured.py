"""crfkit.distill's structure-level losses and crfkit.LinearChainCRF against brute-force
enumeration of every tag sequence (n up to 5, T up to 4), on every backend: p_j, p_sum, the
residual, k-best cross entropy, fuzzy loss, Top-K / Top-WK, hard NLL, token KD, exact cross
entropy, entropy and KL; gradients by gradcheck in float64; the numerical edge cases."""
import math

import pytest
import torch

import brute_force
import crfkit
from conftest import random_crf
from crfkit import distill

TOL = 1e-10
SIZES = [(1, 3), (2, 2), (3, 3), (4, 2), (5, 2), (3, 4), (4, 3)]  # (n, T)


def score(seq, em, tr, st, en):
    if not seq:
        return 0.0
    s = st[seq[0]] + em[0][seq[0]]
    for i in range(1, len(seq)):
        s += tr[seq[i - 1]][seq[i]] + em[i][seq[i]]
    return s + en[seq[-1]]


def enumerate_losses(teacher, student, lengths, K):
    """Per sentence, every loss computed from the enumerated distributions with plain floats."""
    (te, tt, ts, tn), (se, stt, ss, sn) = ([x.tolist() for x in crf] for crf in (teacher, student))
    out = []
    for b, n in enumerate(lengths.tolist()):
        t_seqs = brute_force.all_sequences(teacher[0][b], teacher[1], teacher[2], teacher[3], n)
        s_seqs = brute_force.all_sequences(student[0][b], student[1], student[2], student[3], n)
        log_zt, log_zs = brute_force.log_partition(t_seqs), brute_force.log_partition(s_seqs)
        if not t_seqs:  # the teacher allows nothing: every loss is defined as 0
            out.append(dict(ce=0.0, fuzzy=0.0, topk=0.0, topwk=0.0, exact_ce=0.0, entropy=0.0, kl=0.0))
            continue
        top = [seq for _, seq in t_seqs[:K]]
        p_t = [math.exp(score(y, te[b], tt, ts, tn) - log_zt) for y in top]
        log_p_s = [score(y, se[b], stt, ss, sn) - log_zs for y in top]
        p_sum_t, p_sum_s = sum(p_t), sum(math.exp(v) for v in log_p_s)
        exhausted = len(t_seqs) <= K
        residual = 0.0 if exhausted else -(1 - p_sum_t) * math.log(1 - p_sum_s)
        exact_ce = -sum(math.exp(s - log_zt) * (score(y, se[b], stt, ss, sn) - log_zs) for s, y in t_seqs)
        entropy = -sum(math.exp(s - log_zt) * (s - log_zt) for s, y in t_seqs)
        out.append(dict(
            ce=-sum(p * v for p, v in zip(p_t, log_p_s)) + residual,
            fuzzy=-p_sum_t * math.log(p_sum_s) + residual,
            topk=-sum(log_p_s) / len(top),
            topwk=-sum(p / p_sum_t * v for p, v in zip(p_t, log_p_s)),
            exact_ce=exact_ce, entropy=entropy, kl=exact_ce - entropy,
        ))
    return out


def two_crfs(B, n, T, seed, constrained=False):
    e_t, t_t, lengths, s_t, n_t = random_crf(B, n, T, seed=seed)
    e_s, t_s, _, s_s, n_s = random_crf(B, n, T, seed=seed + 1000)
    if constrained and T > 2:  # the same structure for both, as a BIO teacher and student share
        for tr in (t_t, t_s):
            tr[0, 1] = -math.inf
        for st in (s_t, s_s):
            st[1] = -math.inf
    if B > 3:
        lengths[3] = 1
    return (e_t, t_t, s_t, n_t), (e_s, t_s, s_s, n_s), lengths


@pytest.mark.parametrize("n,T", SIZES)
@pytest.mark.parametrize("constrained", [False, True])
def test_losses_match_enumeration(backend, n, T, constrained):
    teacher, student, lengths = two_crfs(5, n, T, seed=17 * n + T, constrained=constrained)
    e_t, t_t, s_t, n_t = teacher
    e_s, t_s, s_s, n_s = student
    for K in sorted({1, 3, T**n - 1, T**n, T**n + 2} - {0}):
        expected = enumerate_losses(teacher, student, lengths, K)
        kb = crfkit.kbest_viterbi(e_t, t_t, K, lengths, s_t, n_t)
        args = (e_s, t_s, kb, lengths, s_s, n_s)
        got = {
            "ce": distill.kbest_cross_entropy(*args, reduction="none"),
            "fuzzy": distill.fuzzy_loss(*args, reduction="none"),
            "topk": distill.topk_loss(*args, weighting="uniform", reduction="none"),
            "topwk": distill.topk_loss(*args, weighting="teacher", reduction="none"),
        }
        for name, values in got.items():
            want = torch.tensor([e[name] for e in expected], dtype=torch.float64)
            assert torch.allclose(values, want, atol=TOL, rtol=TOL), (name, K, values, want)
    teacher_crf = crfkit.LinearChainCRF(e_t, t_t, lengths, s_t, n_t)
    student_crf = crfkit.LinearChainCRF(e_s, t_s, lengths, s_s, n_s)
    expected = enumerate_losses(teacher, student, lengths, 1)
    for name, values in (("exact_ce", distill.crf_cross_entropy(teacher_crf, student_crf, "none")),
                         ("kl", distill.crf_kl_divergence(teacher_crf, student_crf, "none")),
                         ("entropy", teacher_crf.entropy())):
        want = torch.tensor([e[name] for e in expected], dtype=torch.float64)
        assert torch.allclose(values, want, atol=TOL, rtol=TOL), (name, values, want)


def test_kbest_cross_entropy_reaches_the_exact_cross_entropy(backend):
    teacher, student, lengths = two_crfs(4, 4, 3, seed=5)
    t_crf, s_crf = (crfkit.LinearChainCRF(*teacher[:2], lengths, *teacher[2:]),
                    crfkit.LinearChainCRF(*student[:2], lengths, *student[2:]))
    exact = distill.crf_cross_entropy(t_crf, s_crf, "none")
    gaps = []
    for K in (1, 5, 20, 81, 90):
        kb = t_crf.kbest(K)
        approx = distill.kbest_cross_entropy(student[0], student[1], kb, lengths, *student[2:], reduction="none")
        gaps.append((approx - exact).abs().max().item())
    assert gaps[-1] < 1e-12 and gaps[-2] < 1e-12  # K >= 3^4: every sequence is a candidate
    assert gaps[0] > 1e-3  # the residual approximation differs for small K


def test_exhausted_candidate_set_has_zero_residual_and_no_nan(backend):
    # 2 tags, length 2 with one forbidden transition: 3 sequences; K = 3 and K = 10.
    emissions = torch.randn(2, 2, 2, dtype=torch.float64)
    transitions = torch.tensor([[0.0, -math.inf], [0.5, -0.2]], dtype=torch.float64)
    s_emissions = torch.randn(2, 2, 2, dtype=torch.float64, requires_grad=True)
    s_transitions = torch.tensor([[0.1, -math.inf], [0.0, 0.3]], dtype=torch.float64, requires_grad=True)
    for K in (3, 10):
        kb = crfkit.kbest_viterbi(emissions, transitions, K)
        ce = distill.kbest_cross_entropy(s_emissions, s_transitions, kb, reduction="none")
        fuzzy = distill.fuzzy_loss(s_emissions, s_transitions, kb, reduction="none")
        # No residual: CE is exactly the sum over the candidates, fuzzy is -log p_sum^s = 0.
        p_t = kb.log_probs.exp().nan_to_num(0.0)
        log_p_s = crfkit.LinearChainCRF(s_emissions, s_transitions).log_prob(kb.paths.clamp(min=0))
        direct = -(p_t * torch.where(kb.log_probs > -math.inf, log_p_s, 0)).sum(1)
        assert torch.equal(ce, direct)
        assert fuzzy.abs().max() < 1e-15
        (ce.sum() + fuzzy.sum()).backward()
        assert torch.isfinite(s_emissions.grad).all() and torch.isfinite(s_transitions.grad).all()
        s_emissions.grad = s_transitions.grad = None


def test_p_sum_near_one_in_float32_is_finite():
    # A very peaked teacher (p_sum^t within 1e-9 of 1) and a student whose top-K mass rounds
    # to 1 in float32 while the teacher's residual is not 0: finite loss and gradients.
    T, L = 4, 6
    emissions = torch.zeros(2, L, T)
    emissions[:, :, 0] = 30.0
    transitions = torch.zeros(T, T)
    kb = crfkit.kbest_viterbi(emissions, transitions, 3)
    assert (1 - kb.log_probs.exp().sum(1)).abs().max() < 1e-6
    flat = torch.zeros(2, L, T)  # a teacher with a large residual
    kb_flat = crfkit.kbest_viterbi(flat, transitions, 3)
    for teacher_kb in (kb, kb_flat):
        s_emissions = (emissions * 2).requires_grad_()
        s_transitions = transitions.clone().requires_grad_()
        for loss_fn in (distill.kbest_cross_entropy, distill.fuzzy_loss):
            loss = loss_fn(s_emissions, s_transitions, teacher_kb)
            loss.backward()
            assert torch.isfinite(loss)
            assert torch.isfinite(s_emissions.grad).all() and torch.isfinite(s_transitions.grad).all()
            s_emissions.grad = s_transitions.grad = None
    # Where float32 resolves it (p_sum^s = 1 - O(0.1)), the residual pushes an over-confident
    # student's top-K mass down: descending lowers tag 0 at positions 1.., shared by all 3
    # candidates ([0,0,..], [1,0,..], [2,0,..]).
    s_emissions = (emissions / 6).requires_grad_()
    distill.fuzzy_loss(s_emissions, transitions, kb_flat).backward()
    assert (s_emissions.grad[:, 1:, 0] > 0).all()


def test_length_zero_one_and_all_forbidden_sentences(backend):
    T = 3
    emissions, transitions, _, start, end = random_crf(4, 3, T, seed=3)
    lengths = torch.tensor([0, 1, 3, 2])
    emissions[3, :2] = -math.inf  # sentence 3: every sequence forbidden
    kb = crfkit.kbest_viterbi(emissions, transitions, 4, lengths, start, end)
    s_emissions = torch.randn(4, 3, T, dtype=torch.float64, requires_grad=True)
    for loss_fn in (distill.kbest_cross_entropy, distill.fuzzy_loss, distill.topk_loss):
        loss = loss_fn(s_emissions, transitions, kb, lengths, start, end, reduction="none")
        assert loss[0] == 0 and loss[3] == 0 and torch.isfinite(loss).all()
        loss.sum().backward()
        assert torch.isfinite(s_emissions.grad).all() and (s_emissions.grad[3] == 0).all()
        s_emissions.grad = None
    teacher = crfkit.LinearChainCRF(emissions, transitions, lengths, start, end)
    student = crfkit.LinearChainCRF(s_emissions, transitions, lengths, start, end)
    for value in (teacher.entropy(), teacher.cross_entropy(student), teacher.kl_divergence(student)):
        assert value[0] == 0 and value[3] == 0 and torch.isfinite(value).all()
    # Length 1: sequences are single tags, the CRF is a softmax over start + emission + end.
    p = torch.softmax(start + emissions[1, 0] + end, 0)
    assert teacher.entropy()[1].item() == pytest.approx(-(p * p.log()).sum().item(), abs=TOL)


@pytest.mark.parametrize("loss_name", ["ce", "fuzzy", "topk", "topwk", "exact_ce", "kl", "nll", "token_em",
                                       "token_pos"])
def test_gradcheck_in_the_student(loss_name):
    teacher, student, lengths = two_crfs(3, 3, 3, seed=11, constrained=True)
    kb = crfkit.kbest_viterbi(teacher[0], teacher[1], 4, lengths, *teacher[2:])
    t_crf = crfkit.LinearChainCRF(teacher[0], teacher[1], lengths, *teacher[2:])

    def loss(e, t, s, n):
        if loss_name == "ce":
            return distill.kbest_cross_entropy(e, t, kb, lengths, s, n)
        if loss_name == "fuzzy":
            return distill.fuzzy_loss(e, t, kb, lengths, s, n)
        if loss_name in ("topk", "topwk"):
            return distill.topk_loss(e, t, kb, lengths, s, n, weighting="uniform" if loss_name == "topk" else "teacher")
        if loss_name == "nll":
            return distill.crf_nll(e, t, kb.paths[:, 0], lengths, s, n)
        if loss_name == "token_em":
            return distill.token_kd(e, teacher[0], lengths, temperature=2.0)
        if loss_name == "token_pos":
            return distill.token_kd(e, teacher[0], lengths, source="marginals", student_transitions=t,
                                    teacher_transitions=teacher[1], student_start=s, student_end=n,
                                    teacher_start=teacher[2], teacher_end=teacher[3], temperature=2.0)
        s_crf = crfkit.LinearChainCRF(e, t, lengths, s, n)
        return (distill.crf_cross_entropy if loss_name == "exact_ce" else distill.crf_kl_divergence)(t_crf, s_crf)

    # Only the finite (allowed) entries of the student's parameters are perturbed.
    e_s, t_s, s_s, n_s = (x.clone() for x in student)
    finite = [torch.isfinite(x) for x in (t_s, s_s)]

    def with_free(e, t_free, s_free, n):
        t = torch.where(finite[0], t_free, t_s)
        s = torch.where(finite[1], s_free, s_s)
        return loss(e, t, s, n)

    inputs = [x.clone().masked_fill(~torch.isfinite(x), 0).requires_grad_() for x in (e_s, t_s, s_s, n_s)]
    assert torch.autograd.gradcheck(with_free, inputs)


def test_token_kd_matches_a_loop():
    B, L, T = 3, 4, 5
    student, teacher = torch.randn(B, L, T, dtype=torch.float64), torch.randn(B, L, T, dtype=torch.float64)
    lengths = torch.tensor([4, 0, 2])
    student[2, 2:] = float("nan")  # padding is never read
    tau = 1.5
    expected = []
    for b in range(B):
        total = 0.0
        for i in range(int(lengths[b])):
            p_t = torch.softmax(teacher[b, i] / tau, 0)
            log_p_s = torch.log_softmax(student[b, i] / tau, 0)
            total -= (p_t * log_p_s).sum().item()
        expected.append(total * tau**2)
    got = distill.token_kd(student, teacher, lengths, temperature=tau, reduction="none")
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), atol=1e-12)
    assert distill.token_kd(student, teacher, lengths, temperature=tau).item() == pytest.approx(sum(expected) / 3)

    # TOKEN-POS: the same with CRF marginals of (scores / tau).
    transitions = torch.randn(T, T, dtype=torch.float64)
    mu_t = crfkit.marginals(teacher / tau, transitions / tau, lengths)
    mu_s = crfkit.marginals(student.nan_to_num(0) / tau, transitions / tau, lengths)
    expected_pos = -(mu_t * mu_s.clamp(min=1e-300).log()).sum((1, 2)) * tau**2
    got_pos = distill.token_kd(student, teacher, lengths, source="marginals", student_transitions=transitions,
                               teacher_transitions=transitions, temperature=tau, reduction="none")
    assert torch.allclose(got_pos, expected_pos, atol=1e-12)


def test_expected_transition_counts_match_enumeration(backend):
    emissions, transitions, lengths, start, end = random_crf(4, 4, 3, seed=9)
    transitions[2, 0] = -math.inf
    counts = crfkit.expected_transition_counts(emissions, transitions, lengths, start, end)
    for b in range(4):
        seqs = brute_force.all_sequences(emissions[b], transitions, start, end, int(lengths[b]))
        log_z = brute_force.log_partition(seqs)
        want = torch.zeros(3, 3, dtype=torch.float64)
        for s, seq in seqs:
            for a, c in zip(seq, seq[1:]):
                want[a, c] += math.exp(s - log_z)
        assert torch.allclose(counts[b], want, atol=TOL)


def test_linear_chain_crf_agrees_with_the_ops(backend):
    emissions, transitions, lengths, start, end = random_crf(5, 6, 4, seed=2)
    dist = crfkit.LinearChainCRF(emissions, transitions, lengths, start, end)
    assert torch.equal(dist.log_partition, crfkit.log_partition(emissions, transitions, lengths, start, end))
    assert torch.equal(dist.marginals, crfkit.marginals(emissions, transitions, lengths, start, end))
    scores, paths = crfkit.viterbi(emissions, transitions, lengths, start, end)
    assert torch.equal(dist.argmax, paths) and torch.equal(dist.max, scores)
    kb = dist.kbest(3)
    assert torch.equal(kb.paths, crfkit.kbest_viterbi(emissions, transitions, 3, lengths, start, end).paths)
    assert torch.allclose(dist.log_prob(kb.paths[:, 0].clamp(min=0)), kb.log_probs[:, 0], atol=TOL)
    present = kb.log_probs > -math.inf
    assert torch.allclose(dist.log_prob(kb.paths.clamp(min=0))[present], kb.log_probs[present], atol=TOL)
    kl_self = dist.kl_divergence(dist)
    assert kl_self.abs().max() < 1e-12 and (dist.entropy() >= 0).all()
    assert "batch=5" in repr(dist)


def test_bad_arguments_are_named():
    emissions, transitions, lengths, start, end = random_crf(2, 3, 3, seed=1)
    kb = crfkit.kbest_viterbi(emissions, transitions, 2, lengths)
    with pytest.raises(ValueError, match="reduction"):
        distill.kbest_cross_entropy(emissions, transitions, kb, lengths, reduction="avg")
    with pytest.raises(TypeError, match="kb must be a crfkit.KBest"):
        distill.kbest_cross_entropy(emissions, transitions, kb.paths, lengths)
    with pytest.raises(ValueError, match="kb.paths has shape"):
        distill.fuzzy_loss(emissions[:1], transitions, kb, lengths[:1])
    with pytest.raises(ValueError, match="were the teacher's k-best computed with the same lengths"):
        distill.kbest_cross_entropy(emissions, transitions, kb, lengths=torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="kb.log_probs"):
        distill.kbest_cross_entropy(emissions, transitions, (kb.scores, kb.paths, kb.log_probs[:, :1]), lengths)
    with pytest.raises(ValueError, match="transitions must have shape"):
        distill.kbest_cross_entropy(emissions, transitions[:2, :2], kb, lengths)
    with pytest.raises(ValueError, match="weighting"):
        distill.topk_loss(emissions, transitions, kb, lengths, weighting="soft")
    with pytest.raises(ValueError, match="temperature"):
        distill.token_kd(emissions, emissions, lengths, temperature=0)
    with pytest.raises(ValueError, match="source"):
        distill.token_kd(emissions, emissions, lengths, source="posterior")
    with pytest.raises(ValueError, match="needs student_transitions"):
        distill.token_kd(emissions, emissions, lengths, source="marginals")
    with pytest.raises(ValueError, match="same shape"):
        distill.token_kd(emissions, emissions[:, :2], lengths)
    dist = crfkit.LinearChainCRF(emissions, transitions, lengths)
    with pytest.raises(TypeError, match="teacher must be a crfkit.LinearChainCRF"):
        distill.crf_cross_entropy(emissions, dist)
    with pytest.raises(ValueError, match="same lengths"):
        dist.cross_entropy(crfkit.LinearChainCRF(emissions, transitions))
    with pytest.raises(ValueError, match="emissions must have 3 dimensions"):
        crfkit.LinearChainCRF(emissions[0], transitions)


def test_reductions_and_empty_batch():
    emissions, transitions, lengths, start, end = random_crf(4, 3, 3, seed=4)
    kb = crfkit.kbest_viterbi(emissions, transitions, 3, lengths)
    student = torch.randn(4, 3, 3, dtype=torch.float64)
    per = distill.kbest_cross_entropy(student, transitions, kb, lengths, reduction="none")
    assert distill.kbest_cross_entropy(student, transitions, kb, lengths).item() == pytest.approx(per.mean().item())
    assert (distill.kbest_cross_entropy(student, transitions, kb, lengths, reduction="sum").item()
            == pytest.approx(per.sum().item()))
    empty = crfkit.kbest_viterbi(emissions[:0], transitions, 3, lengths[:0])
    assert distill.kbest_cross_entropy(student[:0], transitions, empty, lengths[:0]).item() == 0
