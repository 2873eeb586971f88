"""crfkit.LinearChainCRF's information measures (entropy, cross entropy, KL divergence) and
expected transition counts whatever subset of emissions / transitions / start / end requires
grad (frozen or constraint-only transitions, a frozen teacher, inputs made under no_grad), on
every backend: the values and the gradients that exist are those of the all-require-grad case,
and the values are those of brute-force enumeration of every tag sequence."""
import itertools
import math

import pytest
import torch

import brute_force
import crfkit
from conftest import random_crf

pytestmark = pytest.mark.usefixtures("one_thread")

INPUT_NAMES = ("emissions", "transitions", "start", "end")
# Every subset of the four inputs that requires grad, as (emissions, transitions, start, end) flags.
REQUIRES_GRAD_SUBSETS = list(itertools.product((False, True), repeat=4))
MEASURES = ("entropy", "cross_entropy", "kl_divergence", "expected_transition_counts")
TAKES_OTHER = ("cross_entropy", "kl_divergence")  # the measures of p that also depend on q


def tiny_inputs(seed):
    """Inputs of a tiny CRF: emissions (2, 3, 3), transitions (3, 3) with one forbidden
    transition (a constraint), lengths [3, 2], start, end (3,); float64, none requiring grad."""
    emissions, transitions, _, start, end = random_crf(2, 3, 3, seed=seed)
    transitions[0, 2] = -math.inf  # 0 -> 2 is never allowed, as BIO constraints forbid O -> I-X
    return dict(emissions=emissions, transitions=transitions, start=start, end=end), torch.tensor([3, 2])


P_INPUTS, LENGTHS = tiny_inputs(seed=11)
Q_INPUTS, _ = tiny_inputs(seed=12)


def with_requires_grad(inputs, flags):
    """Fresh copies of inputs (a dict of the four tensors), each requiring grad where its flag is."""
    return {name: inputs[name].clone().requires_grad_(flag) for name, flag in zip(INPUT_NAMES, flags)}


def distribution(inputs):
    return crfkit.LinearChainCRF(inputs["emissions"], inputs["transitions"], LENGTHS, inputs["start"], inputs["end"])


def measure(name, p_inputs, q_inputs):
    """One measure of p (and q where it takes one), each from fresh distributions so that every
    path (with or without the cached marginals) is exercised: (B,), or (B, T, T) for the counts."""
    p, q = distribution(p_inputs), distribution(q_inputs)
    if name in TAKES_OTHER:
        return getattr(p, name)(q)
    return getattr(p, name)()


def value_and_gradients(name, p_inputs, q_inputs):
    """(the measure, {("p" | "q", input name): gradient of a weighted sum of it}) for the inputs
    that require grad and that the measure depends on."""
    value = measure(name, p_inputs, q_inputs)
    sides = (("p", p_inputs), ("q", q_inputs)) if name in TAKES_OTHER else (("p", p_inputs),)
    differentiable = [(side, input_name, x) for side, inputs in sides
                      for input_name, x in inputs.items() if x.requires_grad]
    if not differentiable:
        return value, {}
    # Random weights, so that a gradient summing to zero (the counts of a sentence sum to n - 1) still shows.
    weights = torch.rand(value.shape, dtype=value.dtype, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad((weights * value).sum(), [x for _, _, x in differentiable])
    return value, {(side, input_name): g for (side, input_name, _), g in zip(differentiable, grads)}


def brute_force_measures(p_inputs, q_inputs):
    """Per sentence, entropy of p, cross entropy H(p, q) and KL(p || q), by enumeration."""
    entropy, cross_entropy = [], []
    for b, n in enumerate(LENGTHS.tolist()):
        p_seqs, q_seqs = (brute_force.all_sequences(x["emissions"][b].detach(), x["transitions"].detach(),
                                                    x["start"].detach(), x["end"].detach(), n)
                          for x in (p_inputs, q_inputs))
        log_zp, log_zq = brute_force.log_partition(p_seqs), brute_force.log_partition(q_seqs)
        q_score = dict((seq, s) for s, seq in q_seqs)  # p and q forbid the same transition
        entropy.append(-sum(math.exp(s - log_zp) * (s - log_zp) for s, _ in p_seqs))
        cross_entropy.append(-sum(math.exp(s - log_zp) * (q_score[seq] - log_zq) for s, seq in p_seqs))
    entropy, cross_entropy = (torch.tensor(entropy, dtype=torch.float64),
                              torch.tensor(cross_entropy, dtype=torch.float64))
    return {"entropy": entropy, "cross_entropy": cross_entropy, "kl_divergence": cross_entropy - entropy}


@pytest.fixture(scope="module")
def all_require_grad():
    """{(backend, measure): (value, gradients)} with every input of p and q requiring grad."""
    return {}


def expected(all_require_grad, backend, name):
    key = (backend, name)
    if key not in all_require_grad:
        flags = (True,) * 4
        all_require_grad[key] = value_and_gradients(
            name, with_requires_grad(P_INPUTS, flags), with_requires_grad(Q_INPUTS, flags))
    return all_require_grad[key]


@pytest.mark.parametrize("name", MEASURES)
@pytest.mark.parametrize("flags", REQUIRES_GRAD_SUBSETS,
                         ids=lambda flags: "+".join(n for n, f in zip(INPUT_NAMES, flags) if f) or "none")
def test_any_subset_of_inputs_may_require_grad(backend, flags, name, all_require_grad):
    # p and q with the same subset requiring grad (frozen transitions on both sides, say).
    p_inputs, q_inputs = with_requires_grad(P_INPUTS, flags), with_requires_grad(Q_INPUTS, flags)
    value, grads = value_and_gradients(name, p_inputs, q_inputs)
    want_value, want_grads = expected(all_require_grad, backend, name)
    torch.testing.assert_close(value, want_value)
    assert value.requires_grad == any(flags)
    sides = ("p", "q") if name in TAKES_OTHER else ("p",)
    assert set(grads) == {(side, n) for side in sides for n, f in zip(INPUT_NAMES, flags) if f}
    for key, grad in grads.items():
        assert grad is not None and torch.isfinite(grad).all(), key
        torch.testing.assert_close(grad, want_grads[key], msg=f"gradient with respect to {key}")
    if name != "expected_transition_counts":
        torch.testing.assert_close(value, brute_force_measures(p_inputs, q_inputs)[name], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", TAKES_OTHER)
@pytest.mark.parametrize("trained", ("p", "q"))
def test_one_distribution_frozen(backend, trained, name, all_require_grad):
    # Distillation: a frozen teacher (nothing requires grad) and a student being trained.
    p_inputs = with_requires_grad(P_INPUTS, (trained == "p",) * 4)
    q_inputs = with_requires_grad(Q_INPUTS, (trained == "q",) * 4)
    value, grads = value_and_gradients(name, p_inputs, q_inputs)
    want_value, want_grads = expected(all_require_grad, backend, name)
    torch.testing.assert_close(value, want_value)
    assert set(grads) == {(trained, n) for n in INPUT_NAMES}
    for key, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[key], msg=f"gradient with respect to {key}")


@pytest.mark.parametrize("name", MEASURES)
def test_nothing_recorded_under_no_grad(backend, name, all_require_grad):
    want_value = expected(all_require_grad, backend, name)[0]
    # Inputs computed under no_grad from tensors that require grad (a frozen model's outputs).
    sources = [with_requires_grad(x, (True,) * 4) for x in (P_INPUTS, Q_INPUTS)]
    with torch.no_grad():
        made_under_no_grad = [{n: x * 1 for n, x in inputs.items()} for inputs in sources]
    assert not any(x.requires_grad for inputs in made_under_no_grad for x in inputs.values())
    value = measure(name, *made_under_no_grad)
    torch.testing.assert_close(value, want_value)
    assert not value.requires_grad
    # Inputs that require grad, used under no_grad: nothing is recorded either.
    requiring = [with_requires_grad(x, (True,) * 4) for x in (P_INPUTS, Q_INPUTS)]
    with torch.no_grad():
        value = measure(name, *requiring)
    torch.testing.assert_close(value, want_value)
    assert not value.requires_grad


def test_constraint_only_transitions_and_no_start_end(backend):
    # The usual frozen case: transitions are only a 0 / -inf constraint mask, no start / end,
    # and only the emissions (a network's output) are trained.
    emissions = P_INPUTS["emissions"]
    mask = torch.zeros(3, 3, dtype=torch.float64)
    mask[0, 2] = -math.inf
    frozen = emissions.clone().requires_grad_()
    trainable = emissions.clone().requires_grad_()
    q = crfkit.LinearChainCRF(Q_INPUTS["emissions"], mask, LENGTHS)
    for get in (lambda d: d.entropy(), lambda d: d.expected_transition_counts(), lambda d: d.kl_divergence(q)):
        # Fresh distributions each time: their cached log Z and marginals hold a graph used once.
        got = get(crfkit.LinearChainCRF(frozen, mask, LENGTHS))
        want = get(crfkit.LinearChainCRF(trainable, mask.clone().requires_grad_(), LENGTHS))
        torch.testing.assert_close(got, want)
        weights = torch.rand(got.shape, dtype=got.dtype)
        (g_frozen,) = torch.autograd.grad((weights * got).sum(), frozen)
        (g_trainable,) = torch.autograd.grad((weights * want).sum(), trainable)
        torch.testing.assert_close(g_frozen, g_trainable)
    assert mask.grad is None and not mask.requires_grad  # the constraint was not touched


def test_entropy_of_the_tiny_case_by_enumeration(backend):
    # The tiny case by itself: B = 2, L = 3, T = 3, every one of the 3^3 sequences enumerated.
    p = distribution(P_INPUTS)
    torch.testing.assert_close(p.entropy(), brute_force_measures(P_INPUTS, Q_INPUTS)["entropy"], rtol=1e-10, atol=1e-10)


def test_functional_expected_transition_counts_with_frozen_transitions(backend):
    # the functional op itself: frozen transitions, emissions requiring grad (the counts' graph kept)
    emissions = P_INPUTS["emissions"].clone().requires_grad_()
    counts = crfkit.expected_transition_counts(emissions, P_INPUTS["transitions"], LENGTHS)
    reference = crfkit.expected_transition_counts(P_INPUTS["emissions"], P_INPUTS["transitions"], LENGTHS)
    torch.testing.assert_close(counts, reference)
    (grad,) = torch.autograd.grad(counts.square().sum(), emissions)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
