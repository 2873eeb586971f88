"""Representation-level distillation: hidden states, attention scores, layer mapping.

They come from the adaptive-weight paper (Ye and Hernandez, *Knowledge Distillation Scheme for
Named Entity Recognition Model Based on BERT*, MLBDBI 2023) and the multi-stage distillation paper
(Mukherjee and Awadallah, *Multi-Stage Distillation Framework for Massive Multi-lingual NER*,
2020); docs/METHODS.md has the references.

Shapes:
    hidden   (B, L, D) hidden states of B sentences padded to L (or (N, D) flattened positions)
    scores   (B, H, L, L) attention scores of H heads, [b, h, query, key]
    mask     (B, L) bool, True at real positions (or (N,)); None: all positions are real

Reductions follow crfkit.distill.output: a loss per position (per attention entry for
attention_mse) that is exactly 0 where excluded, then 'none' returns it, 'sum' sums it and
'mean' averages it over the included positions (0, not NaN, when there is none). Padded
positions are replaced by zeros before any arithmetic, so NaN / inf garbage there does not leak
into the loss or its gradient (the projections' weight gradients included).

Hidden-state losses average the squared error over the feature dimension (torch's / TinyBERT's
MSE, the adaptive-weight paper's formula (11)), unlike logit_mse which sums over classes (the
squared norm of the papers behind crfkit.distill.output, the multi-stage paper among them):
hidden widths are in the hundreds and a sum would dwarf every other loss.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._validation import check_choice, check_int, check_reduction
from .output import (
    _check_features,
    _check_mask,
    _check_same_positions,
    _compute_dtype,
    _reduce,
    _zero_excluded,
    _zero_padding,
)

__all__ = [
    "HiddenStateMSE",
    "GeluProjectionLoss",
    "attention_mse",
    "uniform_layer_map",
    "layer_transfer_loss",
]

_HIDDEN_SHAPE = "(batch, seq_len, width) or (num_positions, width)"


def _prepare_hidden(student_hidden, teacher_hidden, mask, student_width: int, teacher_width: int):
    _check_features("student_hidden", student_hidden, _HIDDEN_SHAPE)
    _check_features("teacher_hidden", teacher_hidden, _HIDDEN_SHAPE)
    if student_hidden.shape[-1] != student_width:
        raise ValueError(f"student_hidden must have width student_width = {student_width} in its last "
                         f"dimension, got shape {tuple(student_hidden.shape)}")
    if teacher_hidden.shape[-1] != teacher_width:
        raise ValueError(f"teacher_hidden must have width teacher_width = {teacher_width} in its last "
                         f"dimension, got shape {tuple(teacher_hidden.shape)}")
    _check_same_positions("student_hidden", student_hidden, "teacher_hidden", teacher_hidden)
    mask = _check_mask(mask, student_hidden.shape[:-1], student_hidden.device)
    # Zero the padding before the projection: NaN rows there would otherwise reach the
    # projection's weight gradient (sum over rows of x^T g, with 0 * NaN = NaN).
    student = torch.where(mask.unsqueeze(-1), student_hidden, student_hidden.new_zeros(())) \
        if mask is not None else student_hidden
    return student, teacher_hidden, mask


class _ProjectedHiddenLoss(nn.Module):
    """Shared forward of the hidden-state losses: check, project the student's states, zero the
    padding, then a distance per position (the subclass's `_distance`), reduced."""

    student_width: int
    teacher_width: int

    def project(self, student_hidden: Tensor) -> Tensor:
        raise NotImplementedError

    def _distance(self, projected: Tensor, teacher: Tensor) -> Tensor:
        """(..., d_t), (..., d_t) -> (...): the distance per position."""
        raise NotImplementedError

    def forward(self, student_hidden: Tensor, teacher_hidden: Tensor, mask: Optional[Tensor] = None,
                reduction: str = "mean") -> Tensor:
        check_reduction(reduction)
        student, teacher, mask = _prepare_hidden(student_hidden, teacher_hidden, mask,
                                                 self.student_width, self.teacher_width)
        projected = self.project(student)
        dtype = _compute_dtype(projected, teacher)
        projected, teacher = _zero_padding(projected, mask, dtype), _zero_padding(teacher, mask, dtype)
        return _reduce(_zero_excluded(self._distance(projected, teacher), mask), mask, reduction)


class HiddenStateMSE(_ProjectedHiddenLoss):
    """The adaptive-weight paper's L_hidn = MSE(H_s W_h, H_t), with a learned projection W_h
    when widths differ.

    Args:
        student_width: d_s, the width of the student's hidden states.
        teacher_width: d_t, the width of the teacher's.
        bias: give the projection a bias (the adaptive-weight paper's formula has none;
            TinyBERT's code has one).

    When d_s == d_t there is no projection (the identity, no parameters). W_h is learned with
    the student: put this module's parameters in the student's optimizer.

    forward(student_hidden (B, L, d_s), teacher_hidden (B, L, d_t), mask=None, reduction="mean"):
    per position l[b, i] = mean over the d_t features of (H_s W_h - H_t)^2; 'mean' over real
    positions equals F.mse_loss(project(H_s)[mask], H_t[mask]); 'none' -> (B, L).
    """

    def __init__(self, student_width: int, teacher_width: int, bias: bool = False):
        super().__init__()
        self.student_width = check_int("student_width", student_width, minimum=1)
        self.teacher_width = check_int("teacher_width", teacher_width, minimum=1)
        if student_width == teacher_width:
            self.projection: nn.Module = nn.Identity()
        else:
            self.projection = nn.Linear(student_width, teacher_width, bias=bias)

    def project(self, student_hidden: Tensor) -> Tensor:
        """H_s W_h: (..., d_s) -> (..., d_t)."""
        return self.projection(student_hidden)

    def _distance(self, projected: Tensor, teacher: Tensor) -> Tensor:
        return (projected - teacher).square().mean(-1)

    def extra_repr(self) -> str:
        return f"student_width={self.student_width}, teacher_width={self.teacher_width}"


_DISTANCES = ("mse", "cosine", "softmax_kl", "keras_kld")
# Keras's backend epsilon, used by the released code's 'kullback_leibler_divergence' loss.
_KERAS_EPSILON = 1e-7


class GeluProjectionLoss(_ProjectedHiddenLoss):
    """The multi-stage paper's representation loss L_RL: a distance between the student's
    hidden states projected to the teacher's width, z~_s = GELU(W_f h_s + b_f), and the
    teacher's layer-l hidden states z_l^t (l around 6-7 of 12 in the multi-stage paper).

    Args:
        student_width: width of h_s (2H for a BiLSTM of H units per direction).
        teacher_width: width of z_l^t.
        distance: the per-position distance between z~_s and z_l^t:
            'mse'        mean over features of the squared difference (default; the 'mse'
                         option of the multi-stage paper's released code)
            'cosine'     1 - cosine similarity
            'softmax_kl' KL(softmax(z_l^t) || softmax(z~_s)), both softmaxes over the features:
                         the paper's "KL divergence between the student and the teacher
                         representations" read as a divergence between distributions (what
                         crfkit's faithful run of the paper, g100_da_multistage_paper, uses);
                         exactly 0 where z~_s equals z_l^t (or differs by a constant)
            'keras_kld'  sum over features of t * log(t / s) with t, s clipped to [1e-7, 1]:
                         what the paper's "KL divergence" is in its released (Keras) code.
                         Hidden states are not distributions; the clipping ignores every
                         negative teacher feature and all differences above 1. Provided to
                         reproduce the paper, not recommended.
        approximate: GELU variant, 'none' (exact, erf) or 'tanh'.

    The projection (W_f, b_f) always exists, even when the widths are equal (it is part of the
    method, shared across positions), and is learned with the student.

    forward(student_hidden (B, L, d_s), teacher_hidden (B, L, d_t), mask=None, reduction="mean")
    -> the distance per position reduced as in crfkit.distill.output ('none' -> (B, L)).
    """

    def __init__(self, student_width: int, teacher_width: int, distance: str = "mse",
                 approximate: str = "none"):
        super().__init__()
        self.student_width = check_int("student_width", student_width, minimum=1)
        self.teacher_width = check_int("teacher_width", teacher_width, minimum=1)
        check_choice("distance", distance, _DISTANCES)
        check_choice("approximate", approximate, ("none", "tanh"))
        self.distance = distance
        self.approximate = approximate
        self.projection = nn.Linear(student_width, teacher_width)

    def project(self, student_hidden: Tensor) -> Tensor:
        """z~_s = GELU(W_f h_s + b_f): (..., d_s) -> (..., d_t)."""
        return F.gelu(self.projection(student_hidden), approximate=self.approximate)

    def _distance(self, projected: Tensor, teacher: Tensor) -> Tensor:
        if self.distance == "mse":
            return (projected - teacher).square().mean(-1)
        if self.distance == "cosine":
            return 1 - F.cosine_similarity(projected, teacher, dim=-1, eps=1e-8)
        if self.distance == "softmax_kl":
            # sum_f p_t[f] (log p_t[f] - log p_s[f]); F.kl_div(input=log p_s, target=log p_t)
            teacher_log_probs = torch.log_softmax(teacher, dim=-1)
            return F.kl_div(torch.log_softmax(projected, dim=-1), teacher_log_probs, reduction="none",
                            log_target=True).sum(-1)
        target = teacher.clamp(_KERAS_EPSILON, 1)
        prediction = projected.clamp(_KERAS_EPSILON, 1)
        return (target * (target.log() - prediction.log())).sum(-1)

    def extra_repr(self) -> str:
        return (f"student_width={self.student_width}, teacher_width={self.teacher_width}, "
                f"distance={self.distance!r}")


def attention_mse(student_scores: Tensor, teacher_scores: Tensor, mask: Optional[Tensor] = None,
                  reduction: str = "mean") -> Tensor:
    """The adaptive-weight paper's L_attn = 1/h sum_heads MSE(A_s, A_t) on UNNORMALISED
    attention scores (q k^T / sqrt(d) before the softmax, as in TinyBERT).

    Args:
        student_scores: (B, H, L, L), [b, head, query, key].
        teacher_scores: the same shape (the same number of heads: map heads first otherwise).
        mask: which entries count. (B, L) bool of real positions: entry (q, k) counts when both
            q and k are real. Or (B, L, L) bool over (query, key) pairs, e.g. for causal
            attention. None: every entry counts.
        reduction: 'mean', 'sum', or 'none' -> (B, H, L, L) squared errors, 0 where excluded.

    'mean' is the sum of squared errors over the counted entries divided by H times the number
    of counted (q, k) pairs: the mean over heads of each head's MSE over the batch's counted
    pairs, which is formula (17). With mask=None it equals F.mse_loss(student, teacher).

    Masked scores: attention implementations add -inf, -10000 or finfo.min to the scores of
    padded keys. Such entries are excluded through the mask and replaced by zeros before the
    subtraction, so they give neither inf nor NaN; nothing is inferred from the values (a
    threshold such as TinyBERT's "<= -100 means masked" would also drop genuine scores and
    keep the padded queries' rows). Pass the mask. Note that Hugging Face models'
    output_attentions are softmax PROBABILITIES, not these scores; comparing those is a
    different loss.
    """
    check_reduction(reduction)
    shape_text = "(batch, heads, seq_len, seq_len)"
    for name, scores in (("student_scores", student_scores), ("teacher_scores", teacher_scores)):
        if not isinstance(scores, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {shape_text}, got {type(scores).__name__}")
        if not scores.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {scores.dtype}")
        if scores.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions {shape_text}, got shape {tuple(scores.shape)}")
    if student_scores.shape != teacher_scores.shape:
        raise ValueError(f"student_scores and teacher_scores must have the same shape (same number of heads), "
                         f"got {tuple(student_scores.shape)} and {tuple(teacher_scores.shape)}")
    if student_scores.device != teacher_scores.device:
        raise ValueError(f"teacher_scores is on {teacher_scores.device} "
                         f"but student_scores is on {student_scores.device}")
    B, H, num_queries, num_keys = student_scores.shape

    pair_mask = None
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a bool torch.Tensor (batch, seq_len) or (batch, seq_len, seq_len), "
                            f"got {type(mask).__name__}")
        if mask.dim() == 2:
            if num_queries != num_keys:
                raise ValueError(f"a (batch, seq_len) mask needs square scores, got {tuple(student_scores.shape)}; "
                                 f"pass a (batch, queries, keys) mask")
            mask = _check_mask(mask, torch.Size((B, num_keys)), student_scores.device)
            pair_mask = mask.unsqueeze(2) & mask.unsqueeze(1)
        else:
            pair_mask = _check_mask(mask, torch.Size((B, num_queries, num_keys)), student_scores.device)
        pair_mask = pair_mask.unsqueeze(1)  # (B, 1, Lq, Lk): the same entries in every head

    dtype = _compute_dtype(student_scores, teacher_scores)
    student, teacher = student_scores.to(dtype), teacher_scores.to(dtype)
    if pair_mask is not None:
        zero = student.new_zeros(())
        student, teacher = torch.where(pair_mask, student, zero), torch.where(pair_mask, teacher, zero)
    squared_error = (student - teacher).square()
    if reduction != "mean" or pair_mask is None:
        return _reduce(squared_error, None, reduction)
    counted_entries = pair_mask.sum() * H
    return squared_error.sum() / counted_entries.clamp(min=1).to(dtype)


def uniform_layer_map(num_student_layers: int, num_teacher_layers: int, include_embeddings: bool = False,
                      allow_uneven: bool = False) -> List[int]:
    """The adaptive-weight paper's uniform layer mapping: student layer m -> teacher layer m * N / M.

    Layers are numbered from 1 (the first Transformer layer) to M (student) or N (teacher);
    0 is the embedding output. These are exactly the indices of a Hugging Face model's
    `hidden_states` tuple (index 0 = embeddings, index j = output of layer j); its
    `attentions` tuple has no embedding entry, so layer j's attention is attentions[j - 1].

    Returns a list `teacher_layer` of length M: student layer m is matched to teacher layer
    teacher_layer[m - 1]. With include_embeddings=True the list has M + 1 entries, starting
    with 0 -> 0, and is indexed by the student's hidden_states index directly.

    Example: uniform_layer_map(6, 12) == [2, 4, 6, 8, 10, 12]; uniform_layer_map(4, 12) == [3, 6, 9, 12].

    N must be a multiple of M. With allow_uneven=True any M <= N is accepted and the teacher
    layer is floor(m * N / M): strictly increasing, and the last student layer still maps to
    the last teacher layer.
    """
    check_int("num_student_layers", num_student_layers, minimum=1)
    check_int("num_teacher_layers", num_teacher_layers, minimum=1)
    M, N = num_student_layers, num_teacher_layers
    if M > N:
        raise ValueError(f"num_student_layers = {M} exceeds num_teacher_layers = {N}: the uniform "
                         f"mapping needs a student no deeper than its teacher")
    if N % M != 0 and not allow_uneven:
        raise ValueError(f"num_teacher_layers = {N} is not a multiple of num_student_layers = {M}; "
                         f"pass allow_uneven=True to map layer m to floor(m * N / M)")
    teacher_layer = [m * N // M for m in range(1, M + 1)]
    return [0] + teacher_layer if include_embeddings else teacher_layer


HiddenLoss = Callable[..., Tensor]


def layer_transfer_loss(student_hidden_states: Sequence[Tensor], teacher_hidden_states: Sequence[Tensor],
                        layer_map: Sequence[int], hidden_loss: Union[HiddenLoss, Sequence[HiddenLoss]],
                        student_attention_scores: Optional[Sequence[Tensor]] = None,
                        teacher_attention_scores: Optional[Sequence[Tensor]] = None,
                        mask: Optional[Tensor] = None) -> Tensor:
    """The adaptive-weight paper's sum over mapped layers of L_trans = L_attn + L_hidn.

    Args:
        student_hidden_states: M + 1 tensors (B, L, d_s), Hugging Face order: [0] embeddings,
            [m] the output of layer m.
        teacher_hidden_states: N + 1 tensors (B, L, d_t), the same order.
        layer_map: from uniform_layer_map(M, N) (M entries) or with include_embeddings=True
            (M + 1 entries, the embedding pair then contributes L_hidn only).
        hidden_loss: a callable (student (B, L, d_s), teacher (B, L, d_t), mask) -> scalar,
            typically one HiddenStateMSE shared by all layers (as in TinyBERT), or a sequence
            of them, one per entry of layer_map.
        student_attention_scores: M tensors (B, H, L, L), [m - 1] for layer m (Hugging Face
            order); None to leave out L_attn. teacher_attention_scores: N tensors, the same order.
        mask: (B, L) bool, True at real positions.

    Returns the scalar sum over the pairs of layer_map of the (mean-reduced) losses.
    """
    layer_map = list(layer_map)
    num_student = len(student_hidden_states) - 1
    with_embeddings = len(layer_map) == num_student + 1
    if not with_embeddings and len(layer_map) != num_student:
        raise ValueError(f"layer_map has {len(layer_map)} entries but student_hidden_states holds "
                         f"{num_student} layers after the embeddings; expected {num_student} or {num_student + 1}")
    if any(not 0 <= t < len(teacher_hidden_states) for t in layer_map):
        raise ValueError(f"layer_map entries must index teacher_hidden_states (0 .. {len(teacher_hidden_states) - 1}), "
                         f"got {layer_map}")
    if (student_attention_scores is None) != (teacher_attention_scores is None):
        raise ValueError("pass both student_attention_scores and teacher_attention_scores, or neither")
    if student_attention_scores is not None and len(student_attention_scores) != num_student:
        raise ValueError(f"student_attention_scores must hold {num_student} layers, "
                         f"got {len(student_attention_scores)}")
    if callable(hidden_loss):
        hidden_losses = [hidden_loss] * len(layer_map)
    else:
        hidden_losses = list(hidden_loss)
        if len(hidden_losses) != len(layer_map):
            raise ValueError(f"hidden_loss must be one callable or one per layer_map entry ({len(layer_map)}), "
                             f"got {len(hidden_losses)}")

    total = None
    first_student_layer = 0 if with_embeddings else 1
    for offset, teacher_layer in enumerate(layer_map):
        student_layer = first_student_layer + offset
        loss = hidden_losses[offset](student_hidden_states[student_layer], teacher_hidden_states[teacher_layer],
                                     mask)
        if student_attention_scores is not None and student_layer >= 1:
            if teacher_layer < 1:
                raise ValueError(f"student layer {student_layer} maps to the teacher's embeddings, "
                                 "which have no attention")
            loss = loss + attention_mse(student_attention_scores[student_layer - 1],
                                        teacher_attention_scores[teacher_layer - 1], mask)
        total = loss if total is None else total + loss
    if total is None:
        raise ValueError("layer_map is empty")
    return total
