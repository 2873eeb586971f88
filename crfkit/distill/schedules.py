"""Weight schedules over training steps: the adaptive theta_t of the adaptive-weight paper (Ye and
Hernandez, *Knowledge Distillation Scheme for Named Entity Recognition Model Based on BERT*,
MLBDBI 2023; docs/METHODS.md has the references), linear teacher annealing, and the
adaptive-weight paper's combined loss.

Functions take (step, total_steps, ...) and return a float; the classes hold the settings and
are called with the step alone, so a trainer (or ScheduledWeights) needs no other argument:
    theta = AdaptiveTheta(total_steps=10_000, bias=-1.0)
    loss = adaptive_kd_loss(soft, hard, transfer, theta(step))

Steps may be ints or floats (a fractional epoch), counted from 0.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

from torch import Tensor

from .._validation import check_number

__all__ = ["adaptive_theta", "linear_annealing", "adaptive_kd_loss", "AdaptiveTheta", "LinearAnnealing"]


def _check_step(step, total_steps) -> tuple:
    step = check_number("step", step, minimum=0)
    total_steps = check_number("total_steps", total_steps, minimum=0, open_minimum=True)
    return step, total_steps


def adaptive_theta(step: float, total_steps: float, bias: float = 0.0) -> float:
    """The adaptive-weight paper's adaptive distillation weight, formula (14):

        theta_t = max(1 - exp(t / steps + b) / e, 0) = max(1 - exp(t / steps + b - 1), 0)

    Values: theta_0 = 1 - e^(b - 1) (0.632 for b = 0; close to 1 only for b well below 0,
    e.g. 0.950 for b = -2); theta decreases with t and reaches 0 at t = (1 - b) * steps, so
    at t = steps it is 0 for b = 0, already 0 from t = (1 - b) * steps on for b > 0, and
    1 - e^b > 0 for b < 0. For b >= 1 it is 0 throughout. Steps past total_steps follow the
    same formula (clamped at 0).

    Args:
        step: t >= 0.
        total_steps: steps > 0.
        bias: b, any finite number.
    """
    step, total_steps = _check_step(step, total_steps)
    bias = check_number("bias", bias)
    exponent = step / total_steps + bias - 1
    # exp overflows only where theta is 0 anyway.
    if exponent >= 0:
        return 0.0
    return max(-math.expm1(exponent), 0.0)


def linear_annealing(step: float, total_steps: float, start: float = 1.0, end: float = 0.0) -> float:
    """A weight moved linearly from start (step 0) to end (step total_steps), then held at end.

    Teacher annealing (Clark et al. 2019, not one of the distillation papers crfkit implements):
    a linear alternative to the adaptive-weight paper's theta_t for the weight between a
    distillation loss and a hard loss, e.g. the a of a L_distill + (1 - a) L_nll in the
    DistillBiDAF report (a Stanford CS224N project report on distilling BERT into BiDAF),
    annealed from 1 (all teacher) to 0.

        w(t) = start + (end - start) * min(t / steps, 1)

    Args:
        step: t >= 0.
        total_steps: steps > 0.
        start, end: finite numbers (end < start anneals down, end > start up).
    """
    step, total_steps = _check_step(step, total_steps)
    start = check_number("start", start)
    end = check_number("end", end)
    fraction = min(step / total_steps, 1.0)
    return start + (end - start) * fraction


def adaptive_kd_loss(soft: Tensor, hard: Tensor, transfer: Union[Tensor, Sequence[Tensor], None],
                     theta: Union[float, Tensor]) -> Tensor:
    """The adaptive-weight paper's combined loss, formula (15):

        L = theta * L_soft + (1 - theta) * L_hard + theta * sum_layers L_trans

    Args:
        soft: L_soft, e.g. soft_cross_entropy(...), a scalar tensor.
        hard: L_hard, e.g. hard_cross_entropy(...), a scalar tensor.
        transfer: L_trans summed over the mapped layers (a scalar tensor), or a sequence of
            per-layer scalars (summed here), or None for no layer loss.
        theta: the weight, in [0, 1]: adaptive_theta(step, total_steps, bias) (a number or a
            0-dim tensor).
    """
    for name, loss in (("soft", soft), ("hard", hard)):
        if not isinstance(loss, Tensor):
            raise TypeError(f"{name} must be a scalar torch.Tensor, got {type(loss).__name__}")
    if isinstance(theta, Tensor):
        if theta.numel() != 1:
            raise ValueError(f"theta must be a scalar, got shape {tuple(theta.shape)}")
        check_number("theta", float(theta), minimum=0, maximum=1)
    else:
        check_number("theta", theta, minimum=0, maximum=1)
    total = theta * soft + (1 - theta) * hard
    layer_total: Optional[Tensor] = None
    if isinstance(transfer, Tensor):
        layer_total = transfer
    elif transfer is not None:
        for index, layer_loss in enumerate(transfer):
            if not isinstance(layer_loss, Tensor):
                raise TypeError(f"transfer[{index}] must be a scalar torch.Tensor, got {type(layer_loss).__name__}")
            layer_total = layer_loss if layer_total is None else layer_total + layer_loss
    if layer_total is not None:
        total = total + theta * layer_total
    return total


class AdaptiveTheta:
    """adaptive_theta with its settings held: AdaptiveTheta(total_steps, bias)(step) -> theta_t
    (the adaptive-weight paper)."""

    def __init__(self, total_steps: float, bias: float = 0.0):
        adaptive_theta(0, total_steps, bias)  # validates the settings now, not at the first step
        self.total_steps = total_steps
        self.bias = bias

    def __call__(self, step: float) -> float:
        return adaptive_theta(step, self.total_steps, self.bias)

    def __repr__(self) -> str:
        return f"AdaptiveTheta(total_steps={self.total_steps}, bias={self.bias})"


class LinearAnnealing:
    """linear_annealing with its settings held: LinearAnnealing(total_steps, start, end)(step) -> weight."""

    def __init__(self, total_steps: float, start: float = 1.0, end: float = 0.0):
        linear_annealing(0, total_steps, start, end)
        self.total_steps = total_steps
        self.start = start
        self.end = end

    def __call__(self, step: float) -> float:
        return linear_annealing(step, self.total_steps, self.start, self.end)

    def __repr__(self) -> str:
        return f"LinearAnnealing(total_steps={self.total_steps}, start={self.start}, end={self.end})"
