"""Combining several losses into one: learned uncertainty weights, as in the multi-grained
distillation paper (Zhou et al., *Multi-Grained Knowledge Distillation for Named Entity
Recognition*, NAACL 2021), and fixed or scheduled weights, as in the other papers crfkit
implements: the adaptive-weight paper (Ye and Hernandez, *Knowledge Distillation Scheme for Named
Entity Recognition Model Based on BERT*, MLBDBI 2023), the multi-stage distillation paper
(Mukherjee and Awadallah, *Multi-Stage Distillation Framework for Massive Multi-lingual NER*,
2020), the DistillBiDAF report (a Stanford CS224N project report on distilling BERT into BiDAF)
and Tang et al. (*Distilling Task-Specific Knowledge from BERT into Simple Neural Networks*,
2019). docs/METHODS.md has the references.

Every combiner is called on a list (or tuple) of scalar losses and returns one scalar:
    combine = UncertaintyWeighting(3)
    total = combine([hard_loss, fuzzy_loss, kbest_ce_loss])
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .._validation import check_int, check_number

__all__ = ["UncertaintyWeighting", "FixedWeights", "ScheduledWeights"]


def _check_losses(losses, expected: int) -> List[Tensor]:
    """losses: a list / tuple of `expected` floating-point tensors holding one value each."""
    if isinstance(losses, Tensor) or not isinstance(losses, (list, tuple)):
        raise TypeError(f"losses must be a list or tuple of scalar tensors, got {type(losses).__name__}")
    if len(losses) != expected:
        raise ValueError(f"losses must hold {expected} losses (one per weight), got {len(losses)}")
    checked = []
    for index, loss in enumerate(losses):
        if not isinstance(loss, Tensor):
            raise TypeError(f"losses[{index}] must be a torch.Tensor, got {type(loss).__name__}")
        if not loss.is_floating_point():
            raise TypeError(f"losses[{index}] must be a floating-point tensor, got {loss.dtype}")
        if loss.numel() != 1:
            raise ValueError(f"losses[{index}] must be a scalar (one value), got shape {tuple(loss.shape)}; "
                             f"reduce it first")
        checked.append(loss.reshape(()))
    return checked


class UncertaintyWeighting(nn.Module):
    """The multi-grained paper's automatic loss weighting (Kendall, Gal & Cipolla 2018), learnable.

    With one learned s_i per loss and lambda_i = exp(-s_i) > 0:
        L_u = sum_i lambda_i L_i - 1/2 sum_i log lambda_i = sum_i (exp(-s_i) L_i + s_i / 2)

    The -1/2 log lambda_i term stops the weights from collapsing to 0. For a constant L_i > 0,
    d L_u / d s_i = -exp(-s_i) L_i + 1/2 vanishes at lambda_i = 1 / (2 L_i): a loss that stays
    large is down-weighted, and lambda_i L_i tends to 1/2 for every loss. L_u can be negative.

    Args:
        num_losses: how many losses forward() combines.
        initial_log_variances: s_i at the start, one number for all or one per loss (default
            0, i.e. every lambda_i = 1).

    s is a float32 Parameter (`log_variances`, shape (num_losses,)) and stays float32 when the
    enclosing model is converted with .half(), .bfloat16() or .to(dtype): these small scalars
    lose too much precision in half types. forward() computes in float32 (autocast disabled)
    whatever the losses' dtype, float64 losses giving a float64 result. Give the parameter to
    the optimizer with the model's (no weight decay: it would pull every lambda_i towards 1).
    """

    def __init__(self, num_losses: int, initial_log_variances: Union[float, Sequence[float]] = 0.0):
        super().__init__()
        check_int("num_losses", num_losses, minimum=1)
        if isinstance(initial_log_variances, (int, float)) and not isinstance(initial_log_variances, bool):
            initial = [float(initial_log_variances)] * num_losses
        elif isinstance(initial_log_variances, (list, tuple)):
            initial = [float(v) for v in initial_log_variances]
            if len(initial) != num_losses:
                raise ValueError(f"initial_log_variances must hold num_losses = {num_losses} values, "
                                 f"got {len(initial)}")
        else:
            raise TypeError(f"initial_log_variances must be a number or a list of numbers, "
                            f"got {type(initial_log_variances).__name__}")
        if not all(math.isfinite(v) for v in initial):
            raise ValueError(f"initial_log_variances must be finite, got {initial}")
        self.num_losses = num_losses
        self.log_variances = nn.Parameter(torch.tensor(initial, dtype=torch.float32))

    @property
    def weights(self) -> Tensor:
        """The current lambda_i = exp(-s_i): (num_losses,), detached."""
        return torch.exp(-self.log_variances.detach())

    def forward(self, losses: Sequence[Tensor]) -> Tensor:
        """losses: num_losses scalar tensors -> L_u, a scalar (float32, or float64 for float64 losses)."""
        checked = _check_losses(losses, self.num_losses)
        device = self.log_variances.device
        for index, loss in enumerate(checked):
            if loss.device != device:
                raise ValueError(f"losses[{index}] is on {loss.device} but the weights are on {device}")
        dtype = torch.float32
        for loss in checked:
            dtype = torch.promote_types(dtype, loss.dtype)
        # Outside autocast so that exp(-s) and the products stay in (at least) float32.
        with torch.autocast(device_type=device.type, enabled=False):
            stacked = torch.stack([loss.to(dtype) for loss in checked])
            log_variances = self.log_variances.to(dtype)
            return (torch.exp(-log_variances) * stacked).sum() + 0.5 * log_variances.sum()

    def _apply(self, fn, recurse=True):
        # Keep s in float32 through dtype conversions of an enclosing model (model.half());
        # device moves still apply.
        def keep_float32(tensor):
            applied = fn(tensor)
            if tensor.dtype == torch.float32 and applied.is_floating_point() and applied.dtype != torch.float32:
                return tensor.to(device=applied.device)
            return applied

        return super()._apply(keep_float32, recurse)

    def extra_repr(self) -> str:
        return f"num_losses={self.num_losses}"


def _check_weight(index: int, weight) -> float:
    return check_number(f"weights[{index}]", weight, minimum=0)


def _weighted_sum(weights: Sequence[float], losses: List[Tensor]) -> Tensor:
    total = None
    for weight, loss in zip(weights, losses):
        term = loss * weight
        total = term if total is None else total + term
    return total


class FixedWeights(nn.Module):
    """sum_i w_i L_i with constant weights: the multi-stage paper's joint a L_CE + b L_RL + c L_LL,
    the DistillBiDAF report's a L_distill + (1 - a) L_nll, Tang et al.'s a CE + (1 - a) MSE.

    Args:
        weights: a non-empty list of finite non-negative numbers, one per loss.

    forward(losses) takes exactly len(weights) scalar losses. No parameters: it can sit in a
    model next to UncertaintyWeighting and be swapped for it.
    """

    def __init__(self, weights: Sequence[float]):
        super().__init__()
        if not isinstance(weights, (list, tuple)):
            raise TypeError(f"weights must be a list or tuple of numbers, got {type(weights).__name__}")
        if len(weights) == 0:
            raise ValueError("weights must not be empty")
        self.weights = tuple(_check_weight(i, w) for i, w in enumerate(weights))

    def forward(self, losses: Sequence[Tensor]) -> Tensor:
        return _weighted_sum(self.weights, _check_losses(losses, len(self.weights)))

    def extra_repr(self) -> str:
        return f"weights={self.weights}"


WeightOrSchedule = Union[float, Callable[[int], float]]


class ScheduledWeights(nn.Module):
    """sum_i w_i(step) L_i, each weight a number or a schedule step -> weight.

    The adaptive-weight paper's L = theta_t L_soft + (1 - theta_t) L_hard + theta_t L_trans is
        theta = AdaptiveTheta(total_steps, bias)
        combine = ScheduledWeights([theta, lambda step: 1 - theta(step), theta])
        total = combine([soft, hard, transfer], step)

    Args:
        weights: a non-empty list; each entry a finite non-negative number or a callable
            taking the step and returning one (e.g. crfkit.distill.schedules.LinearAnnealing).

    forward(losses, step): step is required when any weight is a schedule.
    """

    def __init__(self, weights: Sequence[WeightOrSchedule]):
        super().__init__()
        if not isinstance(weights, (list, tuple)):
            raise TypeError(f"weights must be a list or tuple, got {type(weights).__name__}")
        if len(weights) == 0:
            raise ValueError("weights must not be empty")
        self.schedules = tuple(w if callable(w) else _check_weight(i, w) for i, w in enumerate(weights))

    def weights_at(self, step: Optional[int]) -> List[float]:
        """The weights at step (validated like FixedWeights')."""
        if step is None and any(callable(w) for w in self.schedules):
            raise ValueError("step is required: some weights are schedules")
        return [_check_weight(i, w(step)) if callable(w) else w for i, w in enumerate(self.schedules)]

    def forward(self, losses: Sequence[Tensor], step: Optional[int] = None) -> Tensor:
        checked = _check_losses(losses, len(self.schedules))
        return _weighted_sum(self.weights_at(step), checked)
