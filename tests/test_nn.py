"""crfkit.CRF, the nn.Module: likelihood signs and reductions, masks, constraints in training
and decoding, and that it learns."""
import math
import re

import pytest
import torch

import crfkit
from crfkit.constraints import allowed_transitions
from conftest import random_crf


def test_nll_is_the_negative_log_likelihood(backend):
    crf = crfkit.CRF(4).double()
    em, _, ln, _, _ = random_crf(5, 7, 4)
    tags = torch.randint(0, 4, (5, 7))
    per_sentence = crf.nll(em, tags, ln, reduction="none")
    expected = (crfkit.log_partition(em, crf.transitions, ln, crf.start, crf.end)
                - crfkit.sequence_score(em, crf.transitions, tags, ln, crf.start, crf.end))
    torch.testing.assert_close(per_sentence, expected)
    assert (per_sentence >= -1e-12).all()
    torch.testing.assert_close(crf(em, tags, ln), per_sentence.mean())
    torch.testing.assert_close(crf.nll(em, tags, ln, reduction="sum"), per_sentence.sum())
    torch.testing.assert_close(crf.nll(em, tags, ln, reduction="token_mean"), per_sentence.sum() / ln.sum())
    torch.testing.assert_close(crf.log_likelihood(em, tags, ln), -per_sentence)
    with pytest.raises(ValueError, match="reduction must be one of"):
        crf.nll(em, tags, ln, reduction="avg")


@pytest.mark.parametrize("reduction", ["mean", "sum", "token_mean"])
def test_a_batch_without_tokens_gives_zero_loss_not_nan(reduction):
    """No sentences, or only empty ones: the loss is 0 with zero gradients (0 / 0 was NaN for
    'mean' over no sentences and 'token_mean' over no tokens)."""
    crf = crfkit.CRF(4).double()
    no_tokens = [((0, 5), None), ((3, 5), torch.zeros(3, dtype=torch.long)), ((2, 0), None)]
    for (batch, seq_len), lengths in no_tokens:
        em = torch.randn(batch, seq_len, 4, dtype=torch.float64, requires_grad=True)
        tags = torch.zeros(batch, seq_len, dtype=torch.long)
        loss = crf.nll(em, tags, lengths, reduction=reduction)
        loss.backward()
        assert loss.item() == 0.0
        assert not em.grad.any() and not crf.transitions.grad.any()
    em, _, ln, _, _ = random_crf(4, 6, 4)
    ln[1] = 0   # one empty sentence among real ones changes nothing but the count
    tags = torch.randint(0, 4, (4, 6))
    per_sentence = crf.nll(em, tags, ln, reduction="none")
    expected = {"mean": per_sentence.mean(), "sum": per_sentence.sum(), "token_mean": per_sentence.sum() / ln.sum()}
    torch.testing.assert_close(crf.nll(em, tags, ln, reduction=reduction), expected[reduction])


def test_mask_and_lengths_agree(backend):
    crf = crfkit.CRF(3)
    em = torch.randn(3, 5, 3)
    ln = torch.tensor([5, 2, 0])
    mask = torch.arange(5) < ln.unsqueeze(1)
    tags = torch.randint(0, 3, (3, 5))
    torch.testing.assert_close(crf.nll(em, tags, mask=mask), crf.nll(em, tags, lengths=ln))
    assert torch.equal(crf.decode(em, mask=mask).paths, crf.decode(em, lengths=ln).paths)
    with pytest.raises(ValueError, match="lengths or mask"):
        crf.nll(em, tags, lengths=ln, mask=mask)


def test_constraints_hold_in_decoding_kbest_and_marginals(backend):
    labels = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    c = allowed_transitions(labels, "BIO")
    crf = crfkit.CRF(5, constraints=c)
    em = torch.randn(8, 10, 5) * 3
    em[:, :, [2, 4]] += 4.0  # I- tags look best everywhere; only constraints keep paths valid
    ln = torch.randint(1, 11, (8,))
    _, paths = crf.decode(em, ln)
    best = crf.kbest(em, 10, ln)
    for b in range(8):
        n = int(ln[b])
        assert c.is_allowed(paths[b, :n].tolist())
        for j in range(10):
            if best.scores[b, j] > -math.inf:
                assert c.is_allowed(best.paths[b, j, :n].tolist())
    mu = crf.marginals(em, ln)
    assert (mu[:, 0, 2] == 0).all() and (mu[:, 0, 4] == 0).all()  # no sentence starts inside
    # The masks are buffers: they move with the module and are saved with it.
    assert "transition_mask" in crf.state_dict()
    assert crf.double().transition_mask.dtype == torch.float64


def test_gradients_do_not_touch_forbidden_transitions(backend):
    c = allowed_transitions(["O", "B-PER", "I-PER"], "BIO")
    crf = crfkit.CRF(3, constraints=c)
    em = torch.randn(4, 6, 3)
    tags = torch.tensor([[0, 1, 2, 0, 0, 1]] * 4)
    crf.nll(em, tags).backward()
    assert crf.transitions.grad[0, 2] == 0  # O -> I-PER never happens
    assert torch.isfinite(crf.transitions.grad).all()


def test_crf_learns_a_transition_pattern(backend):
    torch.manual_seed(0)
    # Tags alternate 0,1,0,1,...; emissions are uninformative, so only transitions can learn it.
    tags = torch.tensor([[i % 2 for i in range(8)], [(i + 1) % 2 for i in range(8)]] * 8)
    em = torch.zeros(16, 8, 2)
    crf = crfkit.CRF(2)
    opt = torch.optim.Adam(crf.parameters(), lr=0.1)
    first = crf.nll(em, tags).item()
    for _ in range(100):
        opt.zero_grad()
        loss = crf.nll(em, tags)
        loss.backward()
        opt.step()
    # Half the sentences start with 0, half with 1: the best possible NLL is log 2.
    assert first > 5.0 and loss.item() < math.log(2) + 0.05
    assert torch.equal(crf.decode(em).paths[:, 1:], 1 - crf.decode(em).paths[:, :-1])


def _log_likelihood_by_front_end(name, emissions, transitions, tags):
    """log P(tags) (B,) and the leaf parameters, from one of the four front ends that compute it."""
    from crfkit.compat.allennlp import ConditionalRandomField
    from crfkit.compat.pytorch_crf import CRF as TorchCrfCRF
    from crfkit.distribution import LinearChainCRF

    if name == "distribution":
        return LinearChainCRF(emissions, transitions).log_prob(tags), transitions
    module = {"CRF": lambda: crfkit.CRF(4), "pytorch_crf": lambda: TorchCrfCRF(4, batch_first=True),
              "allennlp": lambda: ConditionalRandomField(4)}[name]().double()
    with torch.no_grad():
        module.transitions.copy_(transitions)
        for other in ("start", "end", "start_transitions", "end_transitions"):
            if getattr(module, other, None) is not None:
                getattr(module, other).zero_()
    if name == "CRF":
        return module.log_likelihood(emissions, tags), module.transitions
    if name == "pytorch_crf":
        return module(emissions, tags, reduction="none"), module.transitions
    return torch.stack([module(emissions[b:b + 1], tags[b:b + 1]) for b in range(len(tags))]), module.transitions


@pytest.mark.parametrize("front_end", ["CRF", "distribution", "pytorch_crf", "allennlp"])
def test_a_sentence_without_any_allowed_sequence_has_log_likelihood_minus_inf_not_nan(backend, front_end):
    """README's convention: where every sequence is forbidden (log Z = -inf), log P(y) is -inf
    (the CRF's loss +inf) with no gradient, and the other sentences are untouched; s(y) - log Z
    alone is -inf - -inf = NaN."""
    em, transitions, _, _, _ = random_crf(3, 5, 4)
    em[0, 2] = -math.inf   # sentence 0: no tag allowed at position 2
    em = em.detach().requires_grad_()
    transitions = transitions.detach().requires_grad_()
    tags = torch.randint(0, 4, (3, 5))
    log_likelihood, leaf = _log_likelihood_by_front_end(front_end, em, transitions, tags)
    assert log_likelihood[0].item() == -math.inf
    expected = crfkit.sequence_score(em, leaf, tags)[1:] - crfkit.log_partition(em, leaf)[1:]
    torch.testing.assert_close(log_likelihood[1:], expected)
    log_likelihood[1:].sum().backward(retain_graph=True)
    em_grad, leaf_grad = em.grad.clone(), leaf.grad.clone()
    log_likelihood.sum().backward()   # adding the -inf sentence adds no gradient
    assert not em_grad[0].any() and torch.isfinite(em.grad).all()
    torch.testing.assert_close(em.grad, 2 * em_grad)
    torch.testing.assert_close(leaf.grad, 2 * leaf_grad)


def test_emissions_for_another_number_of_tags_are_refused():
    crf = crfkit.CRF(5)
    em, tags = torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)
    message = re.escape("emissions must have num_tags = 5 (the CRF's) in its last dimension, got shape (2, 3, 4)")
    for call in (lambda: crf(em, tags), lambda: crf.decode(em), lambda: crf.kbest(em, 2), lambda: crf.marginals(em),
                 lambda: crf.log_partition(em), lambda: crf.log_likelihood(em, tags)):
        with pytest.raises(ValueError, match=message):
            call()


def test_bad_construction():
    with pytest.raises(ValueError, match="num_tags"):
        crfkit.CRF(0)
    with pytest.raises(ValueError, match="constraints are for 3 tags"):
        crfkit.CRF(4, constraints=allowed_transitions(["O", "B-X", "I-X"]))


# Every CRF method that accepts a mask, called on emissions (B, L, T) with `mask` (and tags (B, L)).
MASK_METHODS = {
    "nll": lambda crf, em, tags, mask: crf.nll(em, tags, mask=mask),
    "nll_token_mean": lambda crf, em, tags, mask: crf.nll(em, tags, mask=mask, reduction="token_mean"),
    "forward": lambda crf, em, tags, mask: crf(em, tags, mask=mask),
    "log_likelihood": lambda crf, em, tags, mask: crf.log_likelihood(em, tags, mask=mask),
    "log_partition": lambda crf, em, tags, mask: crf.log_partition(em, mask=mask),
    "decode": lambda crf, em, tags, mask: crf.decode(em, mask=mask),
    "kbest": lambda crf, em, tags, mask: crf.kbest(em, 2, mask=mask),
    "marginals": lambda crf, em, tags, mask: crf.marginals(em, mask=mask),
}


@pytest.mark.parametrize("method", MASK_METHODS)
@pytest.mark.parametrize("mask_shape", [(2, 3), (2, 7), (3, 5), (1, 5), (5,), (2, 5, 1)])
def test_a_mask_of_the_wrong_shape_is_refused(method, mask_shape):
    # A (2, 3) mask on (2, 5) emissions used to decode 3 of the 5 positions without a word.
    crf = crfkit.CRF(4)
    em = torch.randn(2, 5, 4)
    tags = torch.randint(0, 4, (2, 5))
    mask = torch.ones(mask_shape, dtype=torch.bool)
    expected = rf"mask must have shape .*\(2, 5\).*\(2, 5, 4\).*got {re.escape(str(mask_shape))}"
    with pytest.raises(ValueError, match=expected):
        MASK_METHODS[method](crf, em, tags, mask)


@pytest.mark.parametrize("method", MASK_METHODS)
def test_a_mask_with_holes_gives_what_the_sentences_without_them_give(method):
    torch.manual_seed(0)
    crf = crfkit.CRF(4)
    em = torch.randn(2, 5, 4, dtype=torch.float64)
    crf.double()
    tags = torch.randint(0, 4, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 0, 1, 1]], dtype=torch.bool)  # left padding and a hole in row 1
    real = [[0, 1, 2, 3, 4], [1, 3, 4]]
    with_holes = MASK_METHODS[method](crf, em, tags, mask)
    parts = [MASK_METHODS[method](crf, em[b:b + 1, real[b]], tags[b:b + 1, real[b]], None) for b in range(2)]
    if method in ("decode", "kbest"):
        for b in range(2):
            assert torch.equal(with_holes.paths[b, ..., real[b]], parts[b].paths[0])
            torch.testing.assert_close(with_holes.scores[b], parts[b].scores[0])
        assert bool((with_holes.paths[1, ..., [0, 2]] == -1).all())
    elif method == "marginals":
        for b in range(2):
            torch.testing.assert_close(with_holes[b, real[b]], parts[b][0])
        assert bool((with_holes[1, [0, 2]] == 0).all())
    elif method == "nll_token_mean":  # each part is its sum over its tokens: undo that
        torch.testing.assert_close(with_holes, (parts[0] * 5 + parts[1] * 3) / 8)
    elif with_holes.dim() == 0:  # the mean over sentences
        torch.testing.assert_close(with_holes, (parts[0] + parts[1]) / 2)
    else:
        torch.testing.assert_close(with_holes, torch.cat(parts))


@pytest.mark.parametrize("method", MASK_METHODS)
def test_a_mask_of_the_right_shape_gives_what_its_lengths_give(method):
    crf = crfkit.CRF(4).double()
    em, _, ln, _, _ = random_crf(3, 5, 4)
    tags = torch.randint(0, 4, (3, 5))
    got = MASK_METHODS[method](crf, em, tags, torch.arange(5) < ln.unsqueeze(1))
    by_lengths = {"nll": lambda: crf.nll(em, tags, ln), "forward": lambda: crf(em, tags, ln),
                  "nll_token_mean": lambda: crf.nll(em, tags, ln, reduction="token_mean"),
                  "log_likelihood": lambda: crf.log_likelihood(em, tags, ln),
                  "log_partition": lambda: crf.log_partition(em, ln), "decode": lambda: crf.decode(em, ln),
                  "kbest": lambda: crf.kbest(em, 2, ln), "marginals": lambda: crf.marginals(em, ln)}
    want = by_lengths[method]()
    for a, b in zip(*((x,) if isinstance(x, torch.Tensor) else x for x in (got, want))):
        torch.testing.assert_close(a, b)


def test_a_mask_that_is_not_a_tensor_is_refused():
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        crfkit.CRF(4).decode(torch.randn(2, 5, 4), mask=[[True] * 5] * 2)
