"""Output-level distillation losses on per-position logits.

They come from the adaptive-weight paper (Ye and Hernandez, *Knowledge Distillation Scheme for
Named Entity Recognition Model Based on BERT*, MLBDBI 2023), the multi-stage distillation paper
(Mukherjee and Awadallah, *Multi-Stage Distillation Framework for Massive Multi-lingual NER*,
2020), the DistillBiDAF report (a Stanford CS224N project report on distilling BERT into BiDAF)
and Tang et al. (*Distilling Task-Specific Knowledge from BERT into Simple Neural Networks*,
2019); docs/METHODS.md has the references.

Shapes:
    logits  (B, L, C)  one score per class at each position of B sentences padded to L, or
            (N, C)     N positions already flattened
    mask    (B, L)     bool, True at real positions (or (N,) for flat logits); None: all real
    labels  (B, L)     integer class indices (or (N,)), see hard_cross_entropy

Every loss here first computes a per-position loss l[b, i] and then reduces it:
    reduction="none"  the per-position losses, shape (B, L) (or (N,)), exactly 0 at
                      positions excluded by the mask; a per-sentence loss is .sum(-1)
    reduction="sum"   the sum of l over the real positions
    reduction="mean"  that sum divided by the number of real positions; 0 (not NaN) when
                      there is none (a fully padded batch), so a training step on it is a no-op

Padding never leaks: padded positions are replaced by zeros BEFORE any arithmetic, so NaN or
inf garbage there gives neither a NaN loss nor a NaN gradient (multiplying by the mask
afterwards would not be enough: 0 * NaN = NaN, and the backward of log_softmax would spread it).

dtypes: float16 / bfloat16 inputs are computed in float32 and the loss is float32; otherwise
the loss has the promoted dtype of the inputs. Gradients flow into every floating-point input
that requires them, the teacher's included: detach teacher outputs (or compute them under
torch.no_grad()) when the teacher is fixed.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._validation import check_bool, check_int, check_number, check_reduction

__all__ = ["logit_mse", "soft_cross_entropy", "hard_cross_entropy"]

_LOGITS_SHAPE = "(batch, seq_len, num_classes) or (num_positions, num_classes)"


# --- argument checks shared by the output- and representation-level losses ------------------

def _check_features(name: str, x, shape_text: str = _LOGITS_SHAPE) -> None:
    """x must be a floating-point tensor (B, L, D) or (N, D) with D >= 1."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_text}, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.dim() not in (2, 3):
        raise ValueError(f"{name} must have 2 or 3 dimensions {shape_text}, got shape {tuple(x.shape)}")
    if x.shape[-1] < 1:
        raise ValueError(f"{name} must have a last dimension of at least 1, got shape {tuple(x.shape)}")


def _check_same_positions(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    """a and b must index the same positions: equal shapes except the last dimension."""
    if a.shape[:-1] != b.shape[:-1]:
        raise ValueError(
            f"{name_a} and {name_b} must cover the same positions, got shapes "
            f"{tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.device != b.device:
        raise ValueError(f"{name_b} is on {b.device} but {name_a} is on {a.device}; put them on one device")


def _check_mask(mask, positions_shape: torch.Size, device: torch.device, name: str = "mask") -> Optional[Tensor]:
    """mask: None or a bool tensor of positions_shape on device."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a bool torch.Tensor of shape {tuple(positions_shape)} or None, "
                        f"got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True at real positions), got {mask.dtype}")
    if mask.shape != positions_shape:
        raise ValueError(f"{name} must have shape {tuple(positions_shape)}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but the inputs are on {device}; put them on one device")
    return mask


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The promoted dtype of the inputs, at least float32 (half types are computed in float32)."""
    dtype = torch.float32
    for x in tensors:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def _zero_padding(x: Tensor, mask: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """x in dtype with every padded position (mask False) replaced by zeros, so that garbage
    there (NaN, inf) reaches neither the loss nor the gradient. x: (..., D), mask: (...)."""
    x = x.to(dtype)
    if mask is None:
        return x
    return torch.where(mask.unsqueeze(-1), x, x.new_zeros(()))


def _reduce(per_item: Tensor, include: Optional[Tensor], reduction: str) -> Tensor:
    """Reduce per-item losses that are already 0 where include is False (see the module
    docstring). 'mean' divides by the number of included items, at least 1."""
    if reduction == "none":
        return per_item
    total = per_item.sum()
    if reduction == "sum":
        return total
    count = per_item.numel() if include is None else include.sum()
    if isinstance(count, Tensor):
        return total / count.clamp(min=1).to(total.dtype)
    return total / max(count, 1)


def _prepare_pair(student_logits, teacher_logits, mask) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    _check_features("student_logits", student_logits)
    _check_features("teacher_logits", teacher_logits)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits and teacher_logits must have the same shape, got "
            f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}"
        )
    _check_same_positions("student_logits", student_logits, "teacher_logits", teacher_logits)
    mask = _check_mask(mask, student_logits.shape[:-1], student_logits.device)
    dtype = _compute_dtype(student_logits, teacher_logits)
    return _zero_padding(student_logits, mask, dtype), _zero_padding(teacher_logits, mask, dtype), mask


def _zero_excluded(per_position: Tensor, include: Optional[Tensor]) -> Tensor:
    if include is None:
        return per_position
    return torch.where(include, per_position, per_position.new_zeros(()))


# --- the losses ------------------------------------------------------------------------------

def logit_mse(student_logits: Tensor, teacher_logits: Tensor, mask: Optional[Tensor] = None,
              reduction: str = "mean", scale: float = 1.0) -> Tensor:
    """Squared distance between student and teacher logits (the multi-stage paper, the
    DistillBiDAF report, Tang et al.).

    Per position: l[b, i] = scale * sum_c (student_logits[b, i, c] - teacher_logits[b, i, c])^2,
    the squared Euclidean norm ||z_s - z_t||^2 of the DistillBiDAF report and Tang et al.
    (scale=1); the multi-stage paper's L_LL = 1/2 sum ||r_s - z_t||^2 is scale=0.5 with
    reduction="sum".

    Args:
        student_logits: (B, L, C) or (N, C).
        teacher_logits: the same shape.
        mask: (B, L) or (N,) bool, True at real positions; None: all positions are real.
        reduction: 'mean' (over real positions), 'sum', or 'none' -> (B, L) / (N,).
        scale: a non-negative factor on the per-position loss.

    Relation to torch: with reduction="mean" this is C times
    F.mse_loss(student_logits[mask], teacher_logits[mask]) (which averages over classes too);
    pass scale=1/C to get that (the Keras 'mse' of the multi-stage paper's released code).
    """
    check_reduction(reduction)
    scale = check_number("scale", scale, minimum=0)
    student, teacher, mask = _prepare_pair(student_logits, teacher_logits, mask)
    per_position = (student - teacher).square().sum(-1) * scale
    return _reduce(per_position, mask, reduction)


def soft_cross_entropy(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0,
                       mask: Optional[Tensor] = None, reduction: str = "mean",
                       scale_by_temperature_squared: bool = True) -> Tensor:
    """Cross entropy from the teacher's softened distribution to the student's (the
    adaptive-weight paper's L_soft, Hinton et al.'s distillation loss; at temperature 1, the
    TOKEN-EM baseline of the multi-grained distillation paper, Zhou et al., *Multi-Grained
    Knowledge Distillation for Named Entity Recognition*).

    Per position, with p_t = softmax(teacher_logits / tau) and log p_s = log_softmax(student_logits / tau):
        l[b, i] = - tau^2 * sum_c p_t[c] * log p_s[c]
    The tau^2 factor (scale_by_temperature_squared=True, the default) keeps the gradient's size
    independent of tau: d l / d z_s = tau * (p_s - p_t) instead of (p_s - p_t) / tau, so that
    the weight between this loss and a hard loss need not change with the temperature
    (Hinton et al. 2015). The adaptive-weight paper's formula (3) has no such factor: pass False
    to match it.

    This is a cross entropy, not a KL divergence: it includes the teacher's entropy, which
    does not depend on the student, so the gradient in the student is the same as the KL's.

    Args:
        student_logits: (B, L, C) or (N, C).
        teacher_logits: the same shape. A teacher logit of -inf means probability 0 (e.g. the
            log of CRF marginals for TOKEN-POS); its term is 0 even where the student's is -inf.
            Each real position needs at least one finite teacher logit.
        temperature: tau > 0.
        mask: (B, L) or (N,) bool, True at real positions; None: all positions are real.
        reduction: 'mean' (over real positions), 'sum', or 'none' -> (B, L) / (N,).
        scale_by_temperature_squared: multiply by tau^2 (see above).
    """
    check_reduction(reduction)
    temperature = check_number("temperature", temperature, minimum=0, open_minimum=True)
    check_bool("scale_by_temperature_squared", scale_by_temperature_squared)
    student, teacher, mask = _prepare_pair(student_logits, teacher_logits, mask)
    teacher_probs = torch.softmax(teacher / temperature, dim=-1)
    student_log_probs = torch.log_softmax(student / temperature, dim=-1)
    # 0 * log 0 = 0: where the teacher gives probability 0 the student's log-probability is
    # replaced by 0 before the product, so that -inf there gives neither NaN nor a NaN gradient.
    student_log_probs = torch.where(teacher_probs > 0, student_log_probs, student_log_probs.new_zeros(()))
    per_position = -(teacher_probs * student_log_probs).sum(-1)
    if scale_by_temperature_squared:
        per_position = per_position * temperature ** 2
    # Zeroed padding is a uniform distribution with a non-zero cross entropy: drop it.
    return _reduce(_zero_excluded(per_position, mask), mask, reduction)


def hard_cross_entropy(student_logits: Tensor, labels: Tensor, mask: Optional[Tensor] = None,
                       ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """Token-level cross entropy with gold (or teacher top-1) labels: the adaptive-weight
    paper's L_hard, the multi-stage paper's L_CE, Tang et al.'s CE(y, softmax(z_s)).

    Per position: l[b, i] = -log_softmax(student_logits[b, i])[labels[b, i]].
    A position counts when mask is True there AND labels != ignore_index; the labels of other
    positions are never read (any value, e.g. -100 or garbage, is fine). With reduction="mean"
    this equals F.cross_entropy(student_logits[mask], labels[mask], ignore_index=ignore_index).

    Args:
        student_logits: (B, L, C) or (N, C).
        labels: (B, L) or (N,) integer tensor; counted labels must lie in [0, C).
        mask: (B, L) or (N,) bool, True at real positions; None: all positions are real.
        ignore_index: label value that excludes a position (like torch's cross_entropy).
        reduction: 'mean' (over counted positions), 'sum', or 'none' -> (B, L) / (N,).
    """
    check_reduction(reduction)
    _check_features("student_logits", student_logits)
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be an integer torch.Tensor, got {type(labels).__name__}")
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    check_int("ignore_index", ignore_index)
    positions_shape = student_logits.shape[:-1]
    if labels.shape != positions_shape:
        raise ValueError(f"labels must have shape {tuple(positions_shape)} (student_logits without its "
                         f"class dimension), got {tuple(labels.shape)}")
    if labels.device != student_logits.device:
        raise ValueError(f"labels is on {labels.device} but student_logits is on {student_logits.device}")
    mask = _check_mask(mask, positions_shape, student_logits.device)
    num_classes = student_logits.shape[-1]

    counted = labels != ignore_index
    if mask is not None:
        counted = counted & mask
    if not torch.compiler.is_compiling() and counted.any():
        counted_labels = labels[counted]
        low, high = int(counted_labels.min()), int(counted_labels.max())
        if low < 0 or high >= num_classes:
            raise ValueError(f"labels at counted positions must lie in [0, num_classes = {num_classes}) "
                             f"or equal ignore_index = {ignore_index}, got values in [{low}, {high}]")

    student = _zero_padding(student_logits, counted, _compute_dtype(student_logits))
    safe_labels = torch.where(counted, labels, labels.new_zeros(())).long()
    log_probs = torch.log_softmax(student, dim=-1)
    per_position = -log_probs.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
    return _reduce(_zero_excluded(per_position, counted), counted, reduction)
