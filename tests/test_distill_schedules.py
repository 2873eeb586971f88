"""Schedules (crfkit.distill.schedules): values at known steps, seed 001's combined loss."""
import math

import pytest
import torch

from crfkit.distill.schedules import (
    AdaptiveTheta,
    LinearAnnealing,
    adaptive_kd_loss,
    adaptive_theta,
    linear_annealing,
)


def test_adaptive_theta_known_values():
    # theta_t = max(1 - exp(t / steps + b) / e, 0)
    assert adaptive_theta(0, 100) == pytest.approx(1 - 1 / math.e)           # 0.632...
    assert adaptive_theta(0, 100) == pytest.approx(0.6321205588, abs=1e-10)
    assert adaptive_theta(50, 100) == pytest.approx(1 - math.exp(-0.5))
    assert adaptive_theta(100, 100) == 0.0
    assert adaptive_theta(150, 100) == 0.0                                   # clamped past the end
    assert adaptive_theta(0, 100, bias=-2.0) == pytest.approx(1 - math.exp(-3))   # 0.950
    assert adaptive_theta(100, 100, bias=-1.0) == pytest.approx(1 - math.exp(-1))
    assert adaptive_theta(50, 100, bias=0.5) == 0.0                          # zero from (1 - b) * steps on
    assert adaptive_theta(49, 100, bias=0.5) == pytest.approx(1 - math.exp(-0.01))
    assert adaptive_theta(0, 100, bias=1.0) == 0.0
    assert adaptive_theta(0.5, 1.0) == pytest.approx(1 - math.exp(-0.5))     # fractional epochs


def test_adaptive_theta_is_decreasing_and_in_unit_interval():
    for bias in (-3.0, -1.0, 0.0, 0.3):
        values = [adaptive_theta(t, 40, bias) for t in range(0, 60)]
        assert all(0.0 <= v <= 1.0 for v in values)
        assert all(a >= b for a, b in zip(values, values[1:]))
    assert adaptive_theta(0, 10, bias=-800.0) == 1.0   # no overflow or underflow trouble
    assert adaptive_theta(10**9, 10, bias=0.0) == 0.0


def test_linear_annealing_values():
    assert linear_annealing(0, 10) == 1.0
    assert linear_annealing(5, 10) == pytest.approx(0.5)
    assert linear_annealing(10, 10) == 0.0
    assert linear_annealing(25, 10) == 0.0   # held at end
    assert linear_annealing(3, 12, start=0.2, end=0.8) == pytest.approx(0.35)
    assert linear_annealing(100, 12, start=0.2, end=0.8) == pytest.approx(0.8)


def test_schedule_classes_match_functions():
    theta = AdaptiveTheta(total_steps=30, bias=-0.5)
    anneal = LinearAnnealing(total_steps=30, start=0.9, end=0.1)
    for step in (0, 7, 30, 31):
        assert theta(step) == adaptive_theta(step, 30, -0.5)
        assert anneal(step) == linear_annealing(step, 30, 0.9, 0.1)
    assert "bias=-0.5" in repr(theta) and "end=0.1" in repr(anneal)


def test_adaptive_kd_loss():
    soft, hard = torch.tensor(2.0, requires_grad=True), torch.tensor(3.0)
    layers = [torch.tensor(1.0), torch.tensor(4.0)]
    theta = adaptive_theta(25, 100)
    expected = theta * 2.0 + (1 - theta) * 3.0 + theta * 5.0
    assert adaptive_kd_loss(soft, hard, layers, theta).item() == pytest.approx(expected, rel=1e-6)
    assert adaptive_kd_loss(soft, hard, torch.tensor(5.0), theta).item() == pytest.approx(expected, rel=1e-6)
    assert adaptive_kd_loss(soft, hard, None, 0.25).item() == pytest.approx(0.25 * 2 + 0.75 * 3)
    assert adaptive_kd_loss(soft, hard, None, torch.tensor(1.0)).item() == pytest.approx(2.0)
    loss = adaptive_kd_loss(soft, hard, layers, 0.3)
    loss.backward()
    assert soft.grad.item() == pytest.approx(0.3)


@pytest.mark.parametrize("call,exception,pattern", [
    (lambda: adaptive_theta(-1, 10), ValueError, "step must be a finite non-negative number, got -1"),
    (lambda: adaptive_theta(0, 0), ValueError, "total_steps must be a finite positive number, got 0"),
    (lambda: adaptive_theta(0, 10, bias=float("nan")), ValueError, "bias must be a finite number, got nan"),
    (lambda: adaptive_theta("1", 10), TypeError, "step must be a real number"),
    (lambda: adaptive_theta(True, 10), TypeError, "step must be a real number"),
    (lambda: linear_annealing(1, -5), ValueError, "total_steps must be a finite positive number, got -5"),
    (lambda: linear_annealing(1, 5, start=None), TypeError, "start must be a real number"),
    (lambda: linear_annealing(float("inf"), 5), ValueError, "step must be a finite non-negative number, got inf"),
    (lambda: AdaptiveTheta(0), ValueError, "total_steps must be a finite positive number, got 0"),
    (lambda: LinearAnnealing(10, end=float("nan")), ValueError, "end must be a finite number, got nan"),
    (lambda: adaptive_kd_loss(torch.tensor(1.0), torch.tensor(1.0), None, 1.5), ValueError,
     r"theta must be a number in \[0, 1\], got 1.5"),
    (lambda: adaptive_kd_loss(1.0, torch.tensor(1.0), None, 0.5), TypeError, "soft must be a scalar"),
    (lambda: adaptive_kd_loss(torch.tensor(1.0), torch.tensor(1.0), [1.0], 0.5), TypeError, "transfer\\[0\\]"),
    (lambda: adaptive_kd_loss(torch.tensor(1.0), torch.tensor(1.0), None, torch.ones(2)), ValueError,
     "theta must be a scalar"),
])
def test_bad_arguments(call, exception, pattern):
    with pytest.raises(exception, match=pattern):
        call()
