"""Loss weighting (crfkit.distill.weighting): uncertainty weights move the way the maths says;
fixed and scheduled weights."""
import math

import pytest
import torch
from torch import nn

from crfkit.distill.schedules import AdaptiveTheta
from crfkit.distill.weighting import FixedWeights, ScheduledWeights, UncertaintyWeighting


pytestmark = pytest.mark.usefixtures("one_thread")


def test_uncertainty_value_and_gradient_match_formula():
    combine = UncertaintyWeighting(3, initial_log_variances=[0.0, 0.5, -1.0])
    losses = [torch.tensor(0.5), torch.tensor(2.0), torch.tensor(8.0)]
    s = [0.0, 0.5, -1.0]
    # L_u = sum_i lambda_i L_i - 1/2 sum_i log lambda_i with lambda_i = exp(-s_i).
    expected = sum(math.exp(-si) * li for si, li in zip(s, [0.5, 2.0, 8.0])) - 0.5 * sum(-si for si in s)
    total = combine(losses)
    assert total.item() == pytest.approx(expected, rel=1e-6)
    total.backward()
    expected_grad = [-math.exp(-si) * li + 0.5 for si, li in zip(s, [0.5, 2.0, 8.0])]
    assert combine.log_variances.grad.tolist() == pytest.approx(expected_grad, rel=1e-6)
    assert combine.weights.tolist() == pytest.approx([math.exp(-si) for si in s], rel=1e-6)


def test_uncertainty_gradient_reaches_the_losses():
    combine = UncertaintyWeighting(2, initial_log_variances=[0.0, math.log(4.0)])
    a = torch.tensor(1.0, requires_grad=True)
    b = torch.tensor(1.0, requires_grad=True)
    combine([a, b]).backward()
    assert a.grad.item() == pytest.approx(1.0) and b.grad.item() == pytest.approx(0.25)


def test_uncertainty_weights_converge_to_one_over_twice_the_loss():
    constant_losses = [0.5, 2.0, 8.0]
    combine = UncertaintyWeighting(3)
    losses = [torch.tensor(v) for v in constant_losses]

    def descend():  # plain gradient descent, lr 0.5 (torch.optim's first step costs seconds)
        (gradient,) = torch.autograd.grad(combine(losses), combine.log_variances)
        with torch.no_grad():
            combine.log_variances -= 0.5 * gradient

    descend()
    # After one step from lambda = 1: the larger the loss, the smaller its weight.
    first = combine.weights.tolist()
    assert first[0] > first[1] > first[2]
    for _ in range(300):
        descend()
    assert combine.weights.tolist() == pytest.approx([1 / (2 * v) for v in constant_losses], rel=1e-4)
    # At the optimum every weighted loss is 1/2.
    assert (combine.weights * torch.tensor(constant_losses)).tolist() == pytest.approx([0.5] * 3, rel=1e-4)


def test_uncertainty_stays_float32_with_half_losses_autocast_and_model_half():
    combine = UncertaintyWeighting(2)
    losses = [torch.tensor(3.0, dtype=torch.float16), torch.tensor(0.1, dtype=torch.bfloat16)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total = combine(losses)
    assert total.dtype == torch.float32
    assert total.item() == pytest.approx(3.0 + float(torch.tensor(0.1, dtype=torch.bfloat16)), rel=1e-6)
    model = nn.Module()
    model.linear = nn.Linear(2, 2)
    model.weighting = combine
    model.half()
    assert model.linear.weight.dtype == torch.float16
    assert combine.log_variances.dtype == torch.float32
    model.to(torch.bfloat16)
    assert combine.log_variances.dtype == torch.float32 and isinstance(combine.log_variances, nn.Parameter)
    assert combine([torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.0)]).dtype == torch.float64


def test_uncertainty_bad_arguments():
    with pytest.raises(ValueError, match="num_losses must be a positive int, got 0"):
        UncertaintyWeighting(0)
    with pytest.raises(TypeError, match="num_losses must be an int"):
        UncertaintyWeighting(2.0)
    with pytest.raises(ValueError, match="initial_log_variances must hold num_losses = 3"):
        UncertaintyWeighting(3, initial_log_variances=[0.0, 1.0])
    with pytest.raises(ValueError, match="initial_log_variances must be finite"):
        UncertaintyWeighting(1, initial_log_variances=float("inf"))
    combine = UncertaintyWeighting(2)
    with pytest.raises(ValueError, match="losses must hold 2 losses"):
        combine([torch.tensor(1.0)])
    with pytest.raises(ValueError, match="losses\\[1\\] must be a scalar"):
        combine([torch.tensor(1.0), torch.ones(3)])
    with pytest.raises(TypeError, match="losses\\[0\\] must be a torch.Tensor"):
        combine([1.0, torch.tensor(1.0)])
    with pytest.raises(TypeError, match="losses must be a list or tuple"):
        combine(torch.ones(2))
    with pytest.raises(TypeError, match="losses\\[0\\] must be a floating-point"):
        combine([torch.tensor(1), torch.tensor(1.0)])


def test_fixed_weights():
    combine = FixedWeights([0.2, 0.0, 3])
    losses = (torch.tensor(1.5), torch.tensor(100.0), torch.tensor(0.5, dtype=torch.float64))
    total = combine(losses)
    assert total.item() == pytest.approx(0.2 * 1.5 + 3 * 0.5)
    assert total.dtype == torch.float64
    with pytest.raises(ValueError, match="losses must hold 3 losses"):
        combine(losses[:2])
    with pytest.raises(ValueError, match="weights must not be empty"):
        FixedWeights([])
    with pytest.raises(ValueError, match="weights\\[1\\] must be a finite non-negative"):
        FixedWeights([1.0, -0.5])
    with pytest.raises(TypeError, match="weights\\[0\\] must be a real number"):
        FixedWeights(["1"])
    with pytest.raises(TypeError, match="weights must be a list or tuple"):
        FixedWeights(torch.ones(2))


def test_scheduled_weights_reproduce_seed_001_combination():
    theta = AdaptiveTheta(total_steps=100, bias=-1.0)
    combine = ScheduledWeights([theta, lambda step: 1 - theta(step), theta])
    soft, hard, transfer = torch.tensor(2.0), torch.tensor(3.0), torch.tensor(5.0)
    for step in (0, 50, 100):
        t = 1 - math.exp(step / 100 - 1 - 1)
        assert combine([soft, hard, transfer], step).item() == pytest.approx(t * 2 + (1 - t) * 3 + t * 5, rel=1e-6)
    assert combine.weights_at(0)[1] == pytest.approx(math.exp(-2))
    with pytest.raises(ValueError, match="step is required"):
        combine([soft, hard, transfer])
    assert ScheduledWeights([1.0, 2.0])([soft, hard]).item() == pytest.approx(8.0)
    with pytest.raises(ValueError, match="weights\\[0\\] must be a finite non-negative"):
        ScheduledWeights([lambda step: -1.0])([soft], step=0)
