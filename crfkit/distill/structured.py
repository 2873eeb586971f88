"""Structure-level distillation losses on linear-chain CRFs: those of the multi-grained paper
(Zhou et al., *Multi-Grained Knowledge Distillation for Named Entity Recognition*, NAACL 2021:
k-best distillation) and the points it is compared with. docs/METHODS.md states the maths.

Notation, per sentence x: the teacher's k-best Viterbi gives sequences y_1..y_K with teacher
log-probabilities log p_j^t; the student gives log p_j^s = s_student(x, y_j) - log Z_student(x)
for the same sequences (ONE student log Z per sentence, shared by the K terms);
p_sum = sum_j p_j (the mass of the candidate set), for teacher and student.

    L_seq_ce    = - sum_j p_j^t log p_j^s - (1 - p_sum^t) log(1 - p_sum^s)    kbest_cross_entropy
    L_seq_fuzzy = - p_sum^t log p_sum^s - (1 - p_sum^t) log(1 - p_sum^s)      fuzzy_loss
    L_hard      = - log P_s(y_hard)                                            crf_nll
    L_token     = - sum_i sum_k P_t(y_i = k) log P_s(y_i = k)                  token_kd
    Top-K       = - 1/K sum_j log p_j^s                 (Wang et al. 2020)     topk_loss(weighting="uniform")
    Top-WK      = - sum_j (p_j^t / p_sum^t) log p_j^s   (Wang et al. 2020)     topk_loss(weighting="teacher")
    exact CE    = - E_teacher[log P_student(y)]          (all T^n sequences)   crf_cross_entropy
    exact KL    = KL(P_teacher || P_student)                                   crf_kl_divergence

Shapes: student_emissions (B, L, T), student_transitions (T, T), lengths (B,), start / end (T,);
the teacher's k-best `kb` is a crfkit.KBest (or any (scores, paths, log_probs) triple) with
paths (B, K, L) and log_probs (B, K), as crfkit.kbest_viterbi returns it.

Reductions: 'mean' over the B sentences (the papers' 1/N sum; 0 for B = 0), 'sum', or 'none'
(per sentence, (B,)). Length-0 sentences contribute 0 to every loss (their one empty sequence has
probability 1 under both models); so do sentences for which the teacher allows no sequence.

Numerics (each is tested):
- log(1 - p_sum) is log1mexp(log p_sum), computed from log p_sum = logsumexp_j log p_j, never as
  1 - exp(...) (which cancels when p_sum is near 1).
- When the candidate set is exhausted (the teacher has fewer than K allowed sequences, seen as
  k-best rows with log_prob -inf), the teacher's residual mass is exactly 0 and the residual
  term is exactly 0, never 0 * -inf = NaN, even though log(1 - p_sum^s) is then -inf. A teacher
  residual 1 - p_sum^t below K * eps (eps of the teacher's log-probs' dtype) is rounding, e.g.
  when K equals the number of sequences exactly, and counts as 0 too.
- When the teacher leaves residual mass but the student's p_sum^s rounds to 1 in the working
  precision, log(1 - p_sum^s) would be -inf; it is evaluated at the largest log p_sum^s below 0
  that the dtype resolves (-eps), so the loss stays finite; the gradient is that of the formula
  at that point and still pushes p_sum^s down.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import backends
from .. import functional as crf_ops
from .._arguments import check_tensor, prepare, prepare_lengths
from .._validation import check_number, check_reduction
from ..reference import safe_logsumexp  # -inf with gradient 0 (not NaN) when every term is -inf
from ..distribution import LinearChainCRF
from ..nn import reduce_per_sentence  # (B,) -> 'mean' (0 for B = 0, not NaN), 'sum' or 'none'

NEG_INF = float("-inf")


# ---- helpers ---------------------------------------------------------------------------------
def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, accurate everywhere (Maechler 2012): log(-expm1(x)) near 0,
    log1p(-exp(x)) far from it. log1mexp(0) = -inf, log1mexp(-inf) = 0."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _unpack_kbest(kb, B: int, L: int, device):
    """Return (paths (B, K, L) int64, log_probs (B, K)) from a KBest-like argument, checked."""
    try:
        paths, log_probs = kb.paths, kb.log_probs
    except AttributeError:
        if isinstance(kb, (tuple, list)) and len(kb) == 3:
            _, paths, log_probs = kb
        else:
            raise TypeError("kb must be a crfkit.KBest (scores, paths, log_probs) as returned by "
                            f"crfkit.kbest_viterbi, got {type(kb).__name__}") from None
    if not isinstance(paths, Tensor) or paths.dim() != 3 or paths.is_floating_point():
        raise ValueError(f"kb.paths must be an integer tensor (batch, k, seq_len), got "
                         f"{getattr(paths, 'shape', type(paths).__name__)}")
    if tuple(paths.shape[::2]) != (B, L):
        raise ValueError(f"kb.paths has shape {tuple(paths.shape)} but the student's emissions are "
                         f"(batch, seq_len) = ({B}, {L}); the teacher and student must see the same positions")
    K = paths.shape[1]
    if not isinstance(log_probs, Tensor) or tuple(log_probs.shape) != (B, K) or not log_probs.is_floating_point():
        raise ValueError(f"kb.log_probs must be a floating-point tensor of shape ({B}, {K}), got "
                         f"{getattr(log_probs, 'shape', type(log_probs).__name__)}")
    if paths.device != device or log_probs.device != device:
        raise ValueError(f"kb is on {paths.device} but the student's emissions are on {device}")
    if K < 1:
        raise ValueError("kb must hold at least one sequence per sentence (k >= 1)")
    return paths.long(), log_probs


def _candidate_log_probs(student_emissions, student_transitions, kb, lengths, start, end):
    """The ingredients of the k-best losses, per sentence.

    Returns (log_p_teacher (B, K), log_p_student (B, K), present (B, K) bool, exhausted (B,) bool,
    has_teacher (B,) bool, (K, the teacher log-probs' dtype)). Rows that hold no sequence (missing) have log_p -inf
    in both.
    """
    check_tensor("student_emissions", student_emissions, 3, "(batch, seq_len, num_tags)")
    B, L, T = student_emissions.shape
    paths, log_p_teacher = _unpack_kbest(kb, B, L, student_emissions.device)
    emissions, transitions, lengths, start, end = prepare(student_emissions, student_transitions, lengths, start, end)

    present = log_p_teacher > NEG_INF  # (B, K): the row holds a sequence
    real = torch.arange(L, device=paths.device) < lengths.view(B, 1, 1)  # (B, 1, L)
    if not torch.compiler.is_compiling():
        # The teacher's paths must be tag sequences of exactly the student's lengths.
        inside = (paths >= 0) & (paths < T)
        bad = present.unsqueeze(2) & ((real & ~inside) | (~real & (paths != -1)))
        if bool(bad.any()):
            b, j = (int(v) for v in bad.any(2).nonzero()[0])
            raise ValueError(f"kb.paths[{b}, {j}] is not a tag sequence of length lengths[{b}] = "
                             f"{int(lengths[b])} over {T} tags (padding must be -1); were the teacher's "
                             "k-best computed with the same lengths?")
    # Missing rows are -1 everywhere; score a stand-in path (all 0) and select the row away.
    safe_paths = torch.where(present.unsqueeze(2), paths, torch.zeros_like(paths))
    # The arguments are checked above (and the paths against them): call the backend directly
    # rather than the public ops, which would check everything again.
    backend = backends.current()
    student_scores = backend.sequence_score(emissions, transitions, safe_paths.contiguous(), lengths,
                                            start, end)  # (B, K)
    student_log_z = backend.log_partition(emissions, transitions, lengths, start, end)  # (B,): ONE per sentence
    log_p_student = torch.where(present, student_scores - student_log_z.unsqueeze(1),
                                torch.full_like(student_scores, NEG_INF))
    k_and_teacher_dtype = (paths.shape[1], log_p_teacher.dtype)  # K and the precision of the teacher's log-probs
    log_p_teacher = log_p_teacher.to(log_p_student.dtype)
    has_teacher = present[:, 0]
    # Fewer than K sequences exist (given the teacher's constraints): the set holds all of them.
    exhausted = ~present.all(1)
    return log_p_teacher, log_p_student, present, exhausted, has_teacher, k_and_teacher_dtype


def _residual_term(log_psum_teacher: Tensor, log_psum_student: Tensor, exhausted: Tensor, k: int,
                   teacher_dtype: torch.dtype) -> Tensor:
    """-(1 - p_sum^t) log(1 - p_sum^s): (B,), exactly 0 where the candidate set is exhausted."""
    residual_teacher = -torch.expm1(log_psum_teacher)  # 1 - p_sum^t, accurate near p_sum^t = 1
    # p_sum^s that rounds to 1 would give log(1 - p_sum^s) = -inf: evaluate at the nearest
    # resolvable point instead (value clamped, gradient passed through; see the module docstring).
    eps = torch.finfo(log_psum_student.dtype).eps
    near_one = log_psum_student > -eps
    # value -eps, gradient of the identity (the unselected branch is never NaN-multiplied)
    log_psum_student = torch.where(near_one, log_psum_student - (log_psum_student + eps).detach(), log_psum_student)
    log_residual_student = log1mexp(log_psum_student)
    # A teacher residual below the resolution of its K probabilities (K eps) is rounding, as
    # when K equals the number of sequences exactly: it is 0, like an exhausted set.
    keep = ~exhausted & (residual_teacher > k * torch.finfo(teacher_dtype).eps)
    safe = torch.where(keep, log_residual_student, torch.zeros_like(log_residual_student))
    return torch.where(keep, -residual_teacher * safe, torch.zeros_like(safe))


def _cross_entropy_terms(p_teacher: Tensor, log_p_student: Tensor, present: Tensor) -> Tensor:
    """-sum_j p_j^t log p_j^s over the present rows: (B,). Missing rows add exactly 0."""
    safe = torch.where(present, log_p_student, torch.zeros_like(log_p_student))
    return -(torch.where(present, p_teacher, torch.zeros_like(p_teacher)) * safe).sum(1)


# ---- the multi-grained paper ---------------------------------------------------------------
def kbest_cross_entropy(student_emissions: Tensor, student_transitions: Tensor, kb,
                        lengths: Optional[Tensor] = None, start: Optional[Tensor] = None,
                        end: Optional[Tensor] = None, reduction: str = "mean") -> Tensor:
    """The multi-grained paper's fine-grained k-best cross entropy with the residual mass:

        L_seq_ce = - sum_j p_j^t log p_j^s - (1 - p_sum^t) log(1 - p_sum^s)

    Args:
        student_emissions (B, L, T), student_transitions (T, T), start / end (T,): the student CRF.
        kb: the teacher's crfkit.kbest_viterbi(...) result on the same sentences (paths
            (B, K, L), log_probs (B, K)); the teacher's log-probabilities are used as given (detach
            them if the teacher must not be trained).
        lengths (B,): the sentences' lengths (default: all L); the teacher's paths must match.
    Returns a scalar, or (B,) with reduction='none'. Differentiable in the student's scores.
    Equals the exact cross entropy crf_cross_entropy when K covers every sequence.
    """
    check_reduction(reduction)
    log_p_t, log_p_s, present, exhausted, has_teacher, k_and_teacher_dtype = _candidate_log_probs(
        student_emissions, student_transitions, kb, lengths, start, end)
    loss = _cross_entropy_terms(log_p_t.exp(), log_p_s, present)
    loss = loss + _residual_term(safe_logsumexp(log_p_t, 1), safe_logsumexp(log_p_s, 1), exhausted,
                                 *k_and_teacher_dtype)
    return reduce_per_sentence(torch.where(has_teacher, loss, torch.zeros_like(loss)), reduction)


def fuzzy_loss(student_emissions: Tensor, student_transitions: Tensor, kb,
               lengths: Optional[Tensor] = None, start: Optional[Tensor] = None,
               end: Optional[Tensor] = None, reduction: str = "mean") -> Tensor:
    """The multi-grained paper's coarse-grained fuzzy loss: binary cross entropy on the candidate set's mass
    (the fuzzy CRF of Shang et al. 2018 applied to the teacher's k-best):

        L_seq_fuzzy = - p_sum^t log p_sum^s - (1 - p_sum^t) log(1 - p_sum^s)

    Arguments and result as kbest_cross_entropy.
    """
    check_reduction(reduction)
    log_p_t, log_p_s, present, exhausted, has_teacher, k_and_teacher_dtype = _candidate_log_probs(
        student_emissions, student_transitions, kb, lengths, start, end)
    log_psum_t, log_psum_s = safe_logsumexp(log_p_t, 1), safe_logsumexp(log_p_s, 1)
    set_term = -log_psum_t.exp() * torch.where(has_teacher, log_psum_s, torch.zeros_like(log_psum_s))
    loss = set_term + _residual_term(log_psum_t, log_psum_s, exhausted, *k_and_teacher_dtype)
    return reduce_per_sentence(torch.where(has_teacher, loss, torch.zeros_like(loss)), reduction)


def crf_nll(student_emissions: Tensor, student_transitions: Tensor, tags: Tensor,
            lengths: Optional[Tensor] = None, start: Optional[Tensor] = None,
            end: Optional[Tensor] = None, reduction: str = "mean") -> Tensor:
    """The multi-grained paper's hard loss L_hard = -log P_s(y_hard | x): tags (B, L) are the gold labels, or
    the teacher's top-1 on unlabelled text (kb.paths[:, 0]). Padded tags are ignored."""
    check_reduction(reduction)
    student = LinearChainCRF(student_emissions, student_transitions, lengths, start, end)
    return reduce_per_sentence(-student.log_prob(tags), reduction)


def token_kd(student_emissions: Tensor, teacher_emissions: Tensor, lengths: Optional[Tensor] = None,
             *, source: str = "emissions", student_transitions: Optional[Tensor] = None,
             teacher_transitions: Optional[Tensor] = None, student_start=None, student_end=None,
             teacher_start=None, teacher_end=None, temperature: float = 1.0,
             reduction: str = "mean") -> Tensor:
    """The multi-grained paper's token-level distillation: L_token = - sum_i sum_k P_t(y_i = k) log P_s(y_i = k),
    summed over the real positions of each sentence, times temperature^2 (Hinton et al.: keeps
    the gradient's scale independent of the temperature).

    source="emissions" (TOKEN-EM): P = softmax(emissions / temperature) per position.
    source="marginals" (TOKEN-POS): P = the CRF marginals of (emissions, transitions, start, end)
    / temperature, for teacher and student alike (transitions are then required).

    Shapes: emissions (B, L, T); transitions (T, T); lengths (B,). Returns a scalar, or (B,)
    with reduction='none'. It is the cross entropy; subtract the teacher's token entropy for the
    KL divergence (same gradient).
    """
    check_reduction(reduction)
    if source not in ("emissions", "marginals"):
        raise ValueError(f"source must be 'emissions' (TOKEN-EM) or 'marginals' (TOKEN-POS), got {source!r}")
    check_number("temperature", temperature, minimum=0, open_minimum=True, type_error=ValueError)
    for name, x in (("student_emissions", student_emissions), ("teacher_emissions", teacher_emissions)):
        check_tensor(name, x, 3, "(batch, seq_len, num_tags)")
    if student_emissions.shape != teacher_emissions.shape:
        raise ValueError(f"student_emissions {tuple(student_emissions.shape)} and teacher_emissions "
                         f"{tuple(teacher_emissions.shape)} must have the same shape")
    B, L, T = student_emissions.shape
    lengths = prepare_lengths(lengths, B, L, student_emissions.device)
    real = (torch.arange(L, device=lengths.device) < lengths.unsqueeze(1)).unsqueeze(2)  # (B, L, 1)
    tau = float(temperature)

    def scaled(x):
        return None if x is None else x / tau

    if source == "emissions":
        zero = torch.zeros((), dtype=student_emissions.dtype, device=student_emissions.device)
        # Padding may hold anything (even NaN): replace it before the softmax.
        log_p_student = torch.log_softmax(torch.where(real, student_emissions, zero) / tau, dim=2)
        p_teacher = torch.softmax(torch.where(real, teacher_emissions, zero.to(teacher_emissions.dtype)) / tau, dim=2)
    else:
        if student_transitions is None or teacher_transitions is None:
            raise ValueError("source='marginals' (TOKEN-POS) needs student_transitions and teacher_transitions")
        p_teacher = crf_ops.marginals(teacher_emissions / tau, scaled(teacher_transitions), lengths,
                                      scaled(teacher_start), scaled(teacher_end))
        mu_student = crf_ops.marginals(student_emissions / tau, scaled(student_transitions), lengths,
                                       scaled(student_start), scaled(student_end))
        # -inf where the student forbids a tag; log is never evaluated at 0, whose gradient
        # (0 / 0) would be NaN even where the term is selected away.
        allowed = mu_student > 0
        log_p_student = torch.where(allowed, torch.log(torch.where(allowed, mu_student, torch.ones_like(mu_student))),
                                    torch.full_like(mu_student, NEG_INF))
    p_teacher = p_teacher.to(log_p_student.dtype)
    keep = real & (p_teacher > 0)
    terms = p_teacher * torch.where(keep, log_p_student, torch.zeros_like(log_p_student))
    per_sentence = -terms.sum((1, 2)) * tau**2
    return reduce_per_sentence(per_sentence, reduction)


# ---- comparison points -----------------------------------------------------------------------
def topk_loss(student_emissions: Tensor, student_transitions: Tensor, kb,
              lengths: Optional[Tensor] = None, start: Optional[Tensor] = None,
              end: Optional[Tensor] = None, weighting: str = "teacher", reduction: str = "mean") -> Tensor:
    """Wang et al. 2020's k-best distillation, which drops the mass outside the K sequences:

        weighting="uniform" (Top-K):  - 1/K' sum_j log p_j^s
        weighting="teacher" (Top-WK): - sum_j (p_j^t / p_sum^t) log p_j^s

    with K' the number of sequences the teacher's k-best holds (K, or fewer when fewer exist).
    Arguments and result as kbest_cross_entropy.
    """
    check_reduction(reduction)
    if weighting not in ("uniform", "teacher"):
        raise ValueError(f"weighting must be 'uniform' (Top-K) or 'teacher' (Top-WK), got {weighting!r}")
    log_p_t, log_p_s, present, _, has_teacher, _ = _candidate_log_probs(
        student_emissions, student_transitions, kb, lengths, start, end)
    if weighting == "uniform":
        weights = present.to(log_p_s.dtype) / present.sum(1, keepdim=True).clamp(min=1)
    else:
        weights = torch.softmax(torch.where(has_teacher.unsqueeze(1), log_p_t, torch.zeros_like(log_p_t)), dim=1)
    loss = _cross_entropy_terms(weights, log_p_s, present)
    return reduce_per_sentence(torch.where(has_teacher, loss, torch.zeros_like(loss)), reduction)


def _check_pair(teacher, student) -> None:
    for name, x in (("teacher", teacher), ("student", student)):
        if not isinstance(x, LinearChainCRF):
            raise TypeError(f"{name} must be a crfkit.LinearChainCRF, got {type(x).__name__}")


def crf_cross_entropy(teacher: LinearChainCRF, student: LinearChainCRF, reduction: str = "mean") -> Tensor:
    """The exact CRF-to-CRF cross entropy H(P_t, P_s) = -E_{y ~ P_t}[log P_s(y)] over all T^n
    sequences, from the teacher's marginals and expected transition counts in O(n T^2)
    (no enumeration): the value kbest_cross_entropy approaches as K grows."""
    check_reduction(reduction)
    _check_pair(teacher, student)
    return reduce_per_sentence(teacher.cross_entropy(student), reduction)


def crf_kl_divergence(teacher: LinearChainCRF, student: LinearChainCRF, reduction: str = "mean") -> Tensor:
    """The exact KL(P_t || P_s) = H(P_t, P_s) - H(P_t): crf_cross_entropy minus the teacher's
    entropy (same gradient in the student)."""
    check_reduction(reduction)
    _check_pair(teacher, student)
    return reduce_per_sentence(teacher.kl_divergence(student), reduction)


__all__: Sequence[str] = (
    "crf_cross_entropy", "crf_kl_divergence", "crf_nll", "fuzzy_loss", "kbest_cross_entropy",
    "log1mexp", "token_kd", "topk_loss",
)
