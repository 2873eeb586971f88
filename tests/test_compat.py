"""crfkit.compat: the pytorch-crf and AllenNLP drop-in layers give their peers' results.

pytorch-crf: compared with the installed torchcrf (skipped without it).
AllenNLP: compared with brute-force enumeration of every tag sequence on tiny sizes, with
allowed-transition lists worked out by hand from AllenNLP's documented rules, and, where its
CRF module can be loaded (an installed allennlp, or the wheel unpacked with `pip install
--no-deps --target DIR`: DIR is CRFKIT_ALLENNLP_SITE, default build/allennlp-2.10.1, where
`make setup` puts it), with AllenNLP's own code.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import itertools
import math
import pathlib
import re

import pytest
import torch

import allennlp_source
from crfkit.compat.allennlp import ConditionalRandomField, allowed_transitions
from crfkit.compat.pytorch_crf import CRF

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # torchcrf builds a uint8 mask when none is given, which torch.where warns about.
    pytest.mark.filterwarnings("ignore:where received a uint8 condition tensor"),
]

REDUCTIONS = ("none", "sum", "mean", "token_mean")
FORBIDDEN = -10000.0  # AllenNLP's score for a forbidden transition when decoding


def left_aligned_mask(lengths, L):
    """(B, L) bool mask, True at the first lengths[b] positions of row b."""
    return torch.arange(L) < torch.as_tensor(lengths).unsqueeze(1)


def random_batch(B, L, T, dtype, seed, min_length=1):
    """emissions (B, L, T), tags (B, L) valid everywhere (torchcrf indexes padding tags too),
    left-aligned mask (B, L) with ragged lengths in [min_length, L], the first one L."""
    g = torch.Generator().manual_seed(seed)
    emissions = torch.randn(B, L, T, generator=g, dtype=torch.float64).to(dtype)
    tags = torch.randint(0, T, (B, L), generator=g)
    lengths = torch.randint(min_length, L + 1, (B,), generator=g)
    lengths[0] = L
    return emissions, tags, left_aligned_mask(lengths, L)


# ---------------------------------------------------------------------------------------------
# pytorch-crf


@pytest.fixture(scope="module")
def torchcrf():
    return pytest.importorskip("torchcrf")


def pair_of_crfs(torchcrf, T, batch_first, dtype, seed=0):
    """(torchcrf.CRF, ours) with the same parameters, drawn away from torchcrf's small init so
    that the transition scores matter."""
    torch.manual_seed(seed)
    reference = torchcrf.CRF(T, batch_first=batch_first)
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_()
    reference = reference.to(dtype)
    ours = CRF(T, batch_first=batch_first).to(dtype)
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def in_layout(batch_first, *tensors):
    """Batch-first tensors as the CRF expects them: transposed to (L, B, ...) unless batch_first."""
    return tuple(x if batch_first or x is None else x.transpose(0, 1) for x in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_pytorch_crf_forward_and_gradients_match_torchcrf(torchcrf, dtype, batch_first, reduction):
    for seed, (B, L, T) in enumerate([(5, 6, 4), (1, 1, 3), (3, 9, 5)]):
        reference, ours = pair_of_crfs(torchcrf, T, batch_first, dtype, seed)
        emissions, tags, mask = random_batch(B, L, T, dtype, seed)
        for given_mask in (mask, None):
            results = []
            for crf in (reference, ours):
                crf.zero_grad()
                x = emissions.clone().requires_grad_()
                args = in_layout(batch_first, x, tags, given_mask)
                log_likelihood = crf(*args, reduction=reduction)
                log_likelihood.sum().backward()
                # A parameter a sentence never reaches (transitions at L = 1) has no gradient
                # in torchcrf and a zero one in crfkit: the same derivative.
                results.append((log_likelihood, x.grad, {n: torch.zeros_like(p) if p.grad is None else p.grad
                                                         for n, p in crf.named_parameters()}))
            (expected, expected_grad, expected_param_grads), (got, got_grad, got_param_grads) = results
            assert got.shape == expected.shape and got.dtype == expected.dtype
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got_grad, expected_grad, atol=1e-5, rtol=1e-5)
            assert got_param_grads.keys() == expected_param_grads.keys()
            for name in expected_param_grads:
                torch.testing.assert_close(got_param_grads[name], expected_param_grads[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch_first", [False, True])
def test_pytorch_crf_decode_matches_torchcrf(torchcrf, dtype, batch_first):
    for seed, (B, L, T) in enumerate([(6, 7, 5), (1, 1, 2), (4, 3, 6)]):
        reference, ours = pair_of_crfs(torchcrf, T, batch_first, dtype, seed)
        emissions, _, mask = random_batch(B, L, T, dtype, 100 + seed)
        for given_mask in (mask, None):
            x, m = in_layout(batch_first, emissions, given_mask)
            decoded = ours.decode(x, m)
            assert decoded == reference.decode(x, m)
            assert all(type(tag) is int for row in decoded for tag in row)
            expected_lengths = [L] * B if given_mask is None else given_mask.sum(1).tolist()
            assert [len(row) for row in decoded] == expected_lengths


def test_pytorch_crf_mixed_dtypes_and_mask_types_match_torchcrf(torchcrf):
    """float64 emissions with float32 parameters promote to float64, as in torchcrf; uint8 and
    long masks mean what bool ones do."""
    reference, ours = pair_of_crfs(torchcrf, 4, True, torch.float32)
    emissions, tags, mask = random_batch(3, 5, 4, torch.float64, 7)
    expected = reference(emissions, tags, mask, reduction="none")
    got = ours(emissions, tags, mask, reduction="none")
    assert got.dtype == expected.dtype == torch.float64
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    for mask_type in (torch.uint8, torch.long):
        torch.testing.assert_close(ours(emissions, tags, mask.to(mask_type), reduction="none"), got)
        assert ours.decode(emissions, mask.to(mask_type)) == ours.decode(emissions, mask)


def test_pytorch_crf_state_dicts_load_both_ways_and_init_matches(torchcrf):
    torch.manual_seed(3)
    reference = torchcrf.CRF(5)
    torch.manual_seed(3)
    ours = CRF(5)
    # Same parameters, order and initial draws: U(-0.1, 0.1) for start, end, transitions.
    assert list(ours.state_dict()) == list(reference.state_dict())
    for name, value in reference.state_dict().items():
        assert torch.equal(ours.state_dict()[name], value), name
    assert all(p.abs().max() <= 0.1 for p in ours.parameters())

    emissions, tags, mask = random_batch(2, 4, 5, torch.float32, 11)
    emissions, tags, mask = in_layout(False, emissions, tags, mask)
    trained = torchcrf.CRF(5)
    with torch.no_grad():
        for p in trained.parameters():
            p.normal_()
    ours.load_state_dict(trained.state_dict(), strict=True)
    torch.testing.assert_close(ours(emissions, tags, mask), trained(emissions, tags, mask))
    back = torchcrf.CRF(5)
    back.load_state_dict(ours.state_dict(), strict=True)
    for name, value in trained.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    assert ours.decode(emissions, mask) == back.decode(emissions, mask)


def test_pytorch_crf_ignores_tags_at_padding():
    crf = CRF(3, batch_first=True)
    emissions, tags, mask = random_batch(3, 4, 3, torch.float32, 5)
    padded = tags.masked_fill(~mask, -100)
    torch.testing.assert_close(crf(emissions, padded, mask, reduction="none"),
                               crf(emissions, tags, mask, reduction="none"))


def _bad_pytorch_crf_calls():
    """(description, argument the message must name, call(crf_class) -> raises); sequence first."""
    L, B, T = 4, 2, 3
    emissions = torch.randn(L, B, T)
    tags = torch.zeros(L, B, dtype=torch.long)
    mask = torch.ones(L, B, dtype=torch.bool)
    twos = mask.to(torch.uint8) * 2
    return [
        ("emissions 2-D", "emissions", lambda crf: crf(emissions[0], tags[0])),
        ("emissions wrong num_tags", "emissions", lambda crf: crf(torch.randn(L, B, T + 1), tags)),
        ("tags wrong shape", "tags", lambda crf: crf(emissions, tags[:, :1])),
        ("tags batch first", "tags", lambda crf: crf(emissions, tags.t())),
        ("mask wrong shape", "mask", lambda crf: crf(emissions, tags, mask[:3])),
        ("mask not 0 / 1", "mask", lambda crf: crf(emissions, tags, twos)),
        ("unknown reduction", "reduction", lambda crf: crf(emissions, tags, reduction="avg")),
        ("decode emissions 4-D", "emissions", lambda crf: crf.decode(emissions[None])),
        ("decode mask wrong shape", "mask", lambda crf: crf.decode(emissions, mask.t())),
    ]


BAD_PYTORCH_CRF_CALLS = _bad_pytorch_crf_calls()


@pytest.mark.parametrize("argument, call", [case[1:] for case in BAD_PYTORCH_CRF_CALLS],
                         ids=[case[0] for case in BAD_PYTORCH_CRF_CALLS])
def test_pytorch_crf_bad_input_raises_value_error_naming_the_argument(argument, call):
    with pytest.raises(ValueError, match=argument):
        call(CRF(3))
    # torchcrf raises ValueError on the same inputs, so code that catches it keeps working.
    if importlib.util.find_spec("torchcrf") is not None:
        import torchcrf

        with pytest.raises(ValueError):
            call(torchcrf.CRF(3))


def test_pytorch_crf_rejects_what_torchcrf_cannot_score():
    with pytest.raises(ValueError, match="num_tags"):
        CRF(0)
    crf = CRF(3, batch_first=True)
    tags = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="emissions"):
        crf(torch.randn(2, 0, 3), tags[:, :0])


# ---------------------------------------------------------------------------------------------
# AllenNLP: brute force


def sequence_scores(emissions, transitions, start, end, n):
    """{tags: score} for every tag sequence of length n >= 1 of one sentence (floats).
    emissions (L, T), transitions (T, T) [from, to], start / end (T,)."""
    em, tr, st, en = (x.tolist() for x in (emissions, transitions, start, end))
    scores = {}
    for tags in itertools.product(range(len(st)), repeat=n):
        score = st[tags[0]] + en[tags[-1]] + sum(em[i][t] for i, t in enumerate(tags))
        scores[tags] = score + sum(tr[a][b] for a, b in zip(tags, tags[1:]))
    return scores


def logsumexp(values):
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def start_end_of(crf):
    zeros = torch.zeros(crf.num_tags, dtype=crf.transitions.dtype)
    if crf.include_start_end_transitions:
        return crf.start_transitions.detach(), crf.end_transitions.detach()
    return zeros, zeros


def decoding_scores(crf):
    """What AllenNLP decodes with: forbidden transitions / first / last tags score -10000
    instead of their parameter (a constraint mask of 0 / 1)."""
    T = crf.num_tags
    allowed = crf._constraint_mask.detach().to(torch.bool)
    start, end = start_end_of(crf)

    def penalise(score, ok):
        return torch.where(ok, score, torch.full_like(score, FORBIDDEN))

    return (penalise(crf.transitions.detach(), allowed[:T, :T]), penalise(start, allowed[T, :T]),
            penalise(end, allowed[:T, T + 1]))


def random_allennlp_crf(T, include_start_end, constraints, seed):
    torch.manual_seed(seed)
    crf = ConditionalRandomField(T, constraints=constraints, include_start_end_transitions=include_start_end)
    return crf.double()


def random_constraints(T, seed):
    """A random subset (about 60 %) of the (T + 2) ** 2 pairs, AllenNLP's constraint format."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(T + 2, T + 2, generator=g) < 0.6
    return [(i, j) for i in range(T + 2) for j in range(T + 2) if keep[i, j]]


CRF_SETTINGS = [
    # (T, include_start_end_transitions, constraints)
    (3, True, None),
    (4, True, None),
    (3, False, None),
    (4, True, "random"),
    (3, False, "random"),
    (3, True, "BIO"),
    (4, True, "BIOUL"),
]
LABELS = {"BIO": {0: "B-PER", 1: "I-PER", 2: "O"}, "BIOUL": {0: "O", 1: "B-X", 2: "L-X", 3: "U-X"}}


def constraints_for(setting, T, seed):
    if setting is None:
        return None
    if setting == "random":
        return random_constraints(T, seed)
    return allowed_transitions(setting, LABELS[setting])


@pytest.mark.parametrize("T, include_start_end, constraint_setting", CRF_SETTINGS)
def test_allennlp_log_likelihood_equals_brute_force(T, include_start_end, constraint_setting):
    """forward = sum over sentences of score(tags) - logsumexp over every sequence; the
    constraints do not enter it (as in AllenNLP)."""
    for seed, (B, L) in enumerate([(4, 4), (3, 2), (1, 1)]):
        crf = random_allennlp_crf(T, include_start_end, constraints_for(constraint_setting, T, seed), seed)
        inputs, tags, mask = random_batch(B, L, T, torch.float64, 20 + seed)
        start, end = start_end_of(crf)
        expected = 0.0
        for b in range(B):
            n = int(mask[b].sum())
            scores = sequence_scores(inputs[b], crf.transitions.detach(), start, end, n)
            expected += scores[tuple(tags[b, :n].tolist())] - logsumexp(list(scores.values()))
        got = crf(inputs, tags, mask)
        assert got.shape == () and got.dtype == torch.float64
        assert got.item() == pytest.approx(expected, abs=1e-9)
        float32_crf = copy.deepcopy(crf).float()
        assert float32_crf(inputs.float(), tags, mask).item() == pytest.approx(expected, abs=1e-4)
        if seed == 0:  # no mask: every sentence full length
            full = sum(
                (s := sequence_scores(inputs[b], crf.transitions.detach(), start, end, L))[tuple(tags[b].tolist())]
                - logsumexp(list(s.values())) for b in range(B))
            assert crf(inputs, tags).item() == pytest.approx(full, abs=1e-9)


def test_allennlp_log_likelihood_gradients_are_finite_and_match_autograd_of_brute_force():
    crf = random_allennlp_crf(3, True, None, 0)
    inputs, tags, mask = random_batch(2, 3, 3, torch.float64, 1)
    inputs.requires_grad_()
    crf(inputs, tags, mask).backward()
    # The brute-force log-likelihood, differentiated by autograd.
    params = [p.detach().clone().requires_grad_()
              for p in (crf.transitions, crf.start_transitions, crf.end_transitions)]
    x = inputs.detach().clone().requires_grad_()
    total = 0
    for b in range(2):
        n = int(mask[b].sum())
        scores = {}
        for seq in itertools.product(range(3), repeat=n):
            s = params[1][seq[0]] + params[2][seq[-1]] + sum(x[b, i, t] for i, t in enumerate(seq))
            scores[seq] = s + sum((params[0][a, c] for a, c in zip(seq, seq[1:])), torch.zeros((), dtype=torch.float64))
        total = total + scores[tuple(tags[b, :n].tolist())] - torch.logsumexp(torch.stack(list(scores.values())), 0)
    total.backward()
    torch.testing.assert_close(inputs.grad, x.grad)
    for ours, expected in zip((crf.transitions, crf.start_transitions, crf.end_transitions), params):
        torch.testing.assert_close(ours.grad, expected.grad)
    assert crf._constraint_mask.grad is None


@pytest.mark.parametrize("T, include_start_end, constraint_setting", CRF_SETTINGS)
def test_allennlp_viterbi_tags_and_top_k_equal_brute_force(T, include_start_end, constraint_setting):
    """Every sequence ranked by AllenNLP's decoding score (-10000 per forbidden transition,
    first or last tag): viterbi_tags gives the first, top_k the first k with their scores."""
    for seed, (B, L) in enumerate([(4, 4), (2, 3), (1, 1)]):
        crf = random_allennlp_crf(T, include_start_end, constraints_for(constraint_setting, T, seed), seed)
        logits, _, mask = random_batch(B, L, T, torch.float64, 40 + seed)
        transitions, start, end = decoding_scores(crf)
        ranked = []
        for b in range(B):
            scores = sequence_scores(logits[b], transitions, start, end, int(mask[b].sum()))
            ranked.append(sorted(scores.items(), key=lambda item: -item[1]))

        best = crf.viterbi_tags(logits, mask)
        assert len(best) == B
        for (tags, score), sentence in zip(best, ranked):
            assert isinstance(tags, list) and isinstance(score, float)
            assert tuple(tags) == sentence[0][0]
            assert score == pytest.approx(sentence[0][1], abs=1e-7)

        for top_k in (1, 3, T ** L, T ** L + 2):
            decoded = crf.viterbi_tags(logits, mask, top_k=top_k)
            assert len(decoded) == B
            for sentence_decodings, sentence in zip(decoded, ranked):
                # Sentences with fewer than top_k sequences list just those.
                assert len(sentence_decodings) == min(top_k, len(sentence))
                assert [tuple(tags) for tags, _ in sentence_decodings] == [tags for tags, _ in sentence[:top_k]]
                assert [score for _, score in sentence_decodings] == pytest.approx(
                    [score for _, score in sentence[:top_k]], abs=1e-7)


def test_allennlp_constraints_are_respected_when_decoding():
    """BIOUL over {O, B-X, I-X, L-X, U-X}: emissions pulling hard toward forbidden tags (I-X
    first, B-X last) never yield a forbidden path while an allowed one exists, with or without
    start / end transitions; top-k lists the allowed sequences, best first, before any other."""
    labels = {0: "O", 1: "B-X", 2: "I-X", 3: "L-X", 4: "U-X"}
    pairs = allowed_transitions("BIOUL", labels)
    allowed = set(pairs)
    T, START, END = 5, 5, 6

    def is_allowed(tags):
        return ((START, tags[0]) in allowed and (tags[-1], END) in allowed
                and all((a, b) in allowed for a, b in zip(tags, tags[1:])))

    g = torch.Generator().manual_seed(0)
    for include_start_end in (True, False):
        crf = random_allennlp_crf(T, include_start_end, pairs, 1)
        logits = torch.randn(3, 4, T, generator=g, dtype=torch.float64)
        logits[:, 0, 2] += 20.0  # I-X may not start a sentence
        logits[:, 3, 1] += 20.0  # B-X may not end one (position 3 is the last of sentence 0)
        logits[1, 2, 1] += 20.0  # nor sentence 1 (length 3)
        mask = left_aligned_mask([4, 3, 1], 4)
        for (tags, _), n in zip(crf.viterbi_tags(logits, mask), (4, 3, 1)):
            assert len(tags) == n and is_allowed(tags)
        start, end = start_end_of(crf)
        for b, n in enumerate((4, 3, 1)):
            scores = sequence_scores(logits[b], crf.transitions.detach(), start, end, n)
            allowed_ranked = sorted((s, tags) for tags, s in scores.items() if is_allowed(tags))[::-1]
            k = len(allowed_ranked)
            decoded = crf.viterbi_tags(logits[b:b + 1], mask[b:b + 1], top_k=k + 2)[0]
            assert [tuple(tags) for tags, _ in decoded[:k]] == [tags for _, tags in allowed_ranked]
            assert [s for _, s in decoded[:k]] == pytest.approx([s for s, _ in allowed_ranked], abs=1e-7)
            # Past the allowed ones come forbidden sequences, each scored with the penalty.
            assert all(not is_allowed(tags) and score < FORBIDDEN / 2 for tags, score in decoded[k:])


def test_allennlp_every_path_forbidden_still_decodes_like_allennlp():
    """With no allowed pair at all, AllenNLP still returns the best path under its -10000
    penalties; so does the compat layer (crfkit's own -inf constraints would return none)."""
    crf = random_allennlp_crf(3, True, [], 0)
    logits = torch.randn(1, 2, 3, dtype=torch.float64)
    transitions, start, end = decoding_scores(crf)
    scores = sequence_scores(logits[0], transitions, start, end, 2)
    best = max(scores, key=scores.get)
    (tags, score), = crf.viterbi_tags(logits)
    assert tuple(tags) == best and score == pytest.approx(scores[best]) and score < 3 * FORBIDDEN + 100


def test_allennlp_empty_sentence():
    crf = random_allennlp_crf(3, True, None, 0)
    logits, tags, _ = random_batch(2, 3, 3, torch.float64, 0)
    mask = left_aligned_mask([3, 0], 3)
    sentence_0 = crf(logits[:1], tags[:1])
    assert crf(logits, tags, mask).item() == pytest.approx(sentence_0.item())
    assert crf.viterbi_tags(logits, mask)[1] == ([], 0.0)
    assert crf.viterbi_tags(logits, mask, top_k=3)[1] == [([], 0.0)]


def test_allennlp_state_dict_round_trip():
    for include_start_end, keys in ((True, ["transitions", "_constraint_mask", "start_transitions", "end_transitions"]),
                                    (False, ["transitions", "_constraint_mask"])):
        pairs = allowed_transitions("BIO", LABELS["BIO"])
        trained = random_allennlp_crf(3, include_start_end, pairs, 5)
        assert list(trained.state_dict()) == keys
        # As in AllenNLP, the mask is a parameter that is never trained.
        assert ([n for n, p in trained.named_parameters() if p.requires_grad]
                == [k for k in keys if k != "_constraint_mask"])
        expected_mask = torch.zeros(5, 5, dtype=torch.float64)
        for i, j in pairs:
            expected_mask[i, j] = 1.0
        assert torch.equal(trained._constraint_mask, expected_mask)

        fresh = ConditionalRandomField(3, include_start_end_transitions=include_start_end).double()
        fresh.load_state_dict(trained.state_dict(), strict=True)
        for name, value in trained.state_dict().items():
            assert torch.equal(fresh.state_dict()[name], value), name
        logits, tags, mask = random_batch(2, 4, 3, torch.float64, 9)
        assert fresh(logits, tags, mask).item() == trained(logits, tags, mask).item()
        assert fresh.viterbi_tags(logits, mask, top_k=2) == trained.viterbi_tags(logits, mask, top_k=2)


def test_allennlp_bad_input_raises_value_error_naming_the_argument():
    crf = ConditionalRandomField(3)
    inputs, tags, mask = torch.randn(2, 4, 3), torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool)
    cases = [
        ("inputs", lambda: crf(inputs[0], tags)),
        ("inputs", lambda: crf(torch.randn(2, 4, 5), tags)),
        ("tags", lambda: crf(inputs, tags[:, :3])),
        ("mask", lambda: crf(inputs, tags, mask[:1])),
        ("logits", lambda: crf.viterbi_tags(inputs[..., :2])),
        ("mask", lambda: crf.viterbi_tags(inputs, mask.t())),
        ("top_k", lambda: crf.viterbi_tags(inputs, top_k=0)),
        ("constraints", lambda: ConditionalRandomField(3, constraints=[(0, 5)])),
        ("num_tags", lambda: ConditionalRandomField(0)),
        ("constraint_type", lambda: allowed_transitions("BILOU", {0: "O"})),
    ]
    for argument, call in cases:
        with pytest.raises(ValueError, match=argument):
            call()


# ---------------------------------------------------------------------------------------------
# AllenNLP: allowed_transitions, expected pairs worked out from its documented rules


def test_allennlp_allowed_transitions_bio():
    # START = 3, END = 4. Any label may go to O or B-PER; I-PER only follows B-PER / I-PER;
    # START may go to O or B-PER; any label may end the sentence; nothing enters START or
    # leaves END. Listed by `from` (labels, then START), `to` in index order.
    assert allowed_transitions("BIO", {0: "B-PER", 1: "I-PER", 2: "O"}) == [
        (0, 0), (0, 1), (0, 2), (0, 4),
        (1, 0), (1, 1), (1, 2), (1, 4),
        (2, 0), (2, 2), (2, 4),
        (3, 0), (3, 2),
    ]


def test_allennlp_allowed_transitions_bio_two_types_follows_entities():
    labels = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
    START, END = 5, 6
    expected = {(f, t) for f in range(5) for t in (0, 1, 3)}           # into O / B-* from anywhere
    expected |= {(1, 2), (2, 2), (3, 4), (4, 4)}                         # I-X after B-X / I-X only
    expected |= {(f, END) for f in range(5)} | {(START, t) for t in (0, 1, 3)}
    assert allowed_transitions("BIO", labels) == sorted(expected)


def test_allennlp_allowed_transitions_bioul():
    # START = 5, END = 6. O / L-X / U-X go to O, B-*, U-* (and may end); B-X / I-X only go
    # on to I-X or L-X; START goes to O, B-*, U-*.
    assert allowed_transitions("BIOUL", {0: "O", 1: "B-PER", 2: "I-PER", 3: "L-PER", 4: "U-PER"}) == [
        (0, 0), (0, 1), (0, 4), (0, 6),
        (1, 2), (1, 3),
        (2, 2), (2, 3),
        (3, 0), (3, 1), (3, 4), (3, 6),
        (4, 0), (4, 1), (4, 4), (4, 6),
        (5, 0), (5, 1), (5, 4),
    ]


def test_allennlp_allowed_transitions_iob1_and_bmes():
    # IOB1, START = 4, END = 5: into O / I-* from anywhere; B-X only after I-X / B-X of type X.
    labels = {0: "O", 1: "I-PER", 2: "B-PER", 3: "I-LOC"}
    expected = {(f, t) for f in range(4) for t in (0, 1, 3)} | {(1, 2), (2, 2)}
    expected |= {(f, 5) for f in range(4)} | {(4, 0), (4, 1), (4, 3)}
    assert allowed_transitions("IOB1", labels) == sorted(expected)
    # BMES with bare labels, START = 4, END = 5: E / S go to B / S; B / M go on to M / E;
    # START goes to B / S; only E / S end.
    assert allowed_transitions("BMES", {0: "B", 1: "M", 2: "E", 3: "S"}) == [
        (0, 1), (0, 2), (1, 1), (1, 2), (2, 0), (2, 3), (2, 5), (3, 0), (3, 3), (3, 5), (4, 0), (4, 3),
    ]
    # AllenNLP's BMES has no O: it appears in no pair.
    assert allowed_transitions("BMES", {0: "O", 1: "S-X"}) == [(1, 1), (1, 3), (2, 1)]


# ---------------------------------------------------------------------------------------------
# AllenNLP's own code, where it can be loaded


def _load_allennlp_crf_module():
    """AllenNLP's conditional_random_field module, or None (tests/allennlp_source.py)."""
    found = allennlp_source.load_crf_modules()
    return None if found is None else found["conditional_random_field"]


@pytest.fixture(scope="module")
def allennlp_crf():
    module = _load_allennlp_crf_module()
    if module is None:
        pytest.skip("AllenNLP's CRF module cannot be loaded (see _load_allennlp_crf_module)")
    return module


@pytest.mark.parametrize("T, include_start_end, constraint_setting", CRF_SETTINGS)
def test_allennlp_matches_allennlp_itself(allennlp_crf, T, include_start_end, constraint_setting):
    for seed, (B, L) in enumerate([(5, 6), (1, 1)]):
        constraints = constraints_for(constraint_setting, T, seed)
        torch.manual_seed(seed)
        reference = allennlp_crf.ConditionalRandomField(T, constraints, include_start_end)
        torch.manual_seed(seed)
        ours = ConditionalRandomField(T, constraints, include_start_end)
        # Same initial draws, names and values: state_dicts load both ways.
        assert list(ours.state_dict()) == list(reference.state_dict())
        for name, value in reference.state_dict().items():
            assert torch.equal(ours.state_dict()[name], value), name
        reference.load_state_dict(ours.state_dict(), strict=True)

        inputs, tags, mask = random_batch(B, L, T, torch.float32, 60 + seed)
        for given_mask in (mask, None):
            results = []
            for crf in (reference, ours):
                crf.zero_grad()
                x = inputs.clone().requires_grad_()
                log_likelihood = crf(x, tags, given_mask)
                log_likelihood.backward()
                # Unreached transitions (L = 1): no gradient in AllenNLP, a zero one in crfkit.
                results.append((log_likelihood, x.grad, {
                    n: p.grad if p.grad is not None or not p.requires_grad else torch.zeros_like(p)
                    for n, p in crf.named_parameters()}))
            (expected, expected_grad, expected_param_grads), (got, got_grad, got_param_grads) = results
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got_grad, expected_grad, atol=1e-5, rtol=1e-5)
            assert got_param_grads.keys() == expected_param_grads.keys()
            assert got_param_grads["_constraint_mask"] is expected_param_grads["_constraint_mask"] is None
            for name, expected_param_grad in expected_param_grads.items():
                if name != "_constraint_mask":
                    torch.testing.assert_close(got_param_grads[name], expected_param_grad, atol=1e-5, rtol=1e-5)

            for top_k in (None, 1, 4):
                expected_decoding = reference.viterbi_tags(inputs, given_mask, top_k=top_k)
                got_decoding = ours.viterbi_tags(inputs, given_mask, top_k=top_k)
                if top_k is None:
                    expected_decoding, got_decoding = [[d] for d in expected_decoding], [[d] for d in got_decoding]
                assert len(got_decoding) == len(expected_decoding) == B
                for expected_sentence, got_sentence in zip(expected_decoding, got_decoding):
                    # The allowed sequences (no -10000 penalty) agree exactly. Below them AllenNLP's
                    # k-best also ranks paths through its START / END sentinels (so a sequence can
                    # come twice, and it pads past T ** length); crfkit ranks the real sequences.
                    allowed = [d for d in expected_sentence if d[1] > FORBIDDEN / 2]
                    assert [tags for tags, _ in got_sentence[:len(allowed)]] == [tags for tags, _ in allowed]
                    assert [s for _, s in got_sentence[:len(allowed)]] == pytest.approx(
                        [s for _, s in allowed], abs=1e-5)
                    assert all(s < FORBIDDEN / 2 for _, s in got_sentence[len(allowed):])
                    assert len(got_sentence) == min(len(expected_sentence), T ** len(got_sentence[0][0]))


def test_allennlp_allowed_transitions_match_allennlp_itself(allennlp_crf):
    label_sets = {
        "BIO": ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-MISC"],
        "IOB1": ["O", "I-PER", "B-PER", "I-LOC", "B-LOC"],
        "BIOUL": ["O", "B-PER", "I-PER", "L-PER", "U-PER", "B-LOC", "L-LOC", "U-LOC"],
        "BMES": ["B", "M", "E", "S", "O", "B-NR", "M-NR", "E-NR", "S-NR"],
    }
    for constraint_type, labels in label_sets.items():
        for ordering in (labels, labels[::-1]):
            as_dict = dict(enumerate(ordering))
            assert allowed_transitions(constraint_type, as_dict) == allennlp_crf.allowed_transitions(
                constraint_type, as_dict), constraint_type


# ---------------------------------------------------------------------------------------------
# README


def test_readme_switching_section_imports_work():
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = re.search(r"^## Switching from pytorch-crf or AllenNLP\n(.*?)(?=^## )", readme, re.S | re.M)
    assert section, "README section 'Switching from pytorch-crf or AllenNLP' is missing"
    new_imports = re.findall(r"^\+ *(from crfkit\.compat\.\S+ import .+)$", section.group(1), re.M)
    old_imports = re.findall(r"^- *(from \S+ import .+)$", section.group(1), re.M)
    assert len(new_imports) == len(old_imports) == 2
    namespace = {}
    for line in new_imports:
        exec(line, namespace)
    assert namespace["CRF"] is CRF and namespace["ConditionalRandomField"] is ConditionalRandomField
    with contextlib.suppress(ImportError):  # the peers' names, where they are installed
        exec(old_imports[0], {})


# ---------------------------------------------------------------------------------------------
# Masks with holes, left padding and an off first time step (crfkit.functional joins the chain)


def test_pytorch_crf_mask_with_holes_scores_the_on_positions():
    torch.manual_seed(0)
    crf = CRF(3, batch_first=True).double()
    emissions = torch.randn(3, 4, 3, dtype=torch.float64)
    tags = torch.randint(0, 3, (3, 4))
    mask = torch.tensor([[1, 0, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.uint8)
    real = [[0, 2], [2, 3], []]
    per_sentence = crf(emissions, tags, mask, reduction="none")
    for b, positions in enumerate(real):
        if positions:
            expected = crf(emissions[b:b + 1, positions], tags[b:b + 1, positions], reduction="none")
            torch.testing.assert_close(per_sentence[b:b + 1], expected)
        else:
            assert float(per_sentence[b].detach()) == 0.0  # the one empty sequence
    decoded = crf.decode(emissions, mask)
    for b, positions in enumerate(real):
        assert decoded[b] == (crf.decode(emissions[b:b + 1, positions])[0] if positions else [])


def test_allennlp_mask_with_holes_scores_the_on_positions():
    torch.manual_seed(0)
    crf = ConditionalRandomField(3).double()
    logits = torch.randn(2, 4, 3, dtype=torch.float64)
    tags = torch.randint(0, 3, (2, 4))
    mask = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    real = [[0, 2, 3], [1, 2]]
    expected = sum(crf(logits[b:b + 1, p], tags[b:b + 1, p]) for b, p in enumerate(real))
    torch.testing.assert_close(crf(logits, tags, mask), expected)
    decoded = crf.viterbi_tags(logits, mask, top_k=2)
    assert decoded == [crf.viterbi_tags(logits[b:b + 1, p], top_k=2)[0] for b, p in enumerate(real)]
