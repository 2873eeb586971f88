"""crfkit.compat.allennlp's label-weighted CRFs (ConditionalRandomFieldWeightEmission,
ConditionalRandomFieldWeightTrans, ConditionalRandomFieldWeightLannoy) give AllenNLP's results,
and crfkit.compat.pytorch_crf.CRF has pytorch-crf's repr.

The weighted layers are compared with brute-force enumeration of the tag sequences on tiny
sizes (always run) and, where AllenNLP's CRF modules can be loaded (an installed allennlp, or
the wheel unpacked with `pip install --no-deps --target DIR`: DIR is CRFKIT_ALLENNLP_SITE,
default build/allennlp-2.10.1, where `make setup` puts it), with AllenNLP's own classes.
"""
from __future__ import annotations

import importlib.util
import itertools
import math
import pickle

import pytest
import torch

import allennlp_source
from crfkit.compat import allennlp as compat
from crfkit.compat.allennlp import ConditionalRandomField, ConfigurationError
from crfkit.compat.pytorch_crf import CRF

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:where received a uint8 condition tensor"),
]

VARIANTS = ("ConditionalRandomFieldWeightEmission", "ConditionalRandomFieldWeightTrans",
            "ConditionalRandomFieldWeightLannoy")
VARIANT_FILES = {  # AllenNLP's module of each variant, in allennlp/modules/conditional_random_field/
    "ConditionalRandomFieldWeightEmission": "conditional_random_field_wemission",
    "ConditionalRandomFieldWeightTrans": "conditional_random_field_wtrans",
    "ConditionalRandomFieldWeightLannoy": "conditional_random_field_wlannoy",
}
FORBIDDEN = -10000.0  # AllenNLP's score for a forbidden transition when decoding
LABELS = {"BIO": {0: "B-PER", 1: "I-PER", 2: "O"}, "BIOUL": {0: "O", 1: "B-X", 2: "L-X", 3: "U-X"}}


def prefix_mask(lengths, L):
    """(B, L) bool mask, True at the first lengths[b] positions of row b (AllenNLP's masks)."""
    return torch.arange(L) < torch.as_tensor(lengths).unsqueeze(1)


def random_batch(B, L, T, dtype, seed):
    """logits (B, L, T), tags (B, L) valid everywhere (AllenNLP indexes padding tags too) and a
    prefix mask with lengths in [1, L] (mask[:, 0] True), the first one L."""
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(B, L, T, generator=g, dtype=torch.float64)).to(dtype)
    tags = torch.randint(0, T, (B, L), generator=g)
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    lengths[0] = L
    return logits, tags, prefix_mask(lengths, L)


def random_weights(T, seed):
    """T non-uniform label weights in [0.2, 3.2) (a list, as AllenNLP takes them)."""
    g = torch.Generator().manual_seed(1000 + seed)
    return (0.2 + 3 * torch.rand(T, generator=g, dtype=torch.float64)).tolist()


def random_constraints(T, seed):
    """A random subset (about 60 %) of the (T + 2) ** 2 pairs, AllenNLP's constraint format."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(T + 2, T + 2, generator=g) < 0.6
    return [(i, j) for i in range(T + 2) for j in range(T + 2) if keep[i, j]]


def constraints_for(setting, T, seed, allennlp_allowed_transitions=None):
    """None, random pairs, or a scheme's pairs: "BIO" from AllenNLP's allowed_transitions where
    given, "BIOUL" (and "BIO" without AllenNLP) from crfkit's."""
    if setting is None:
        return None
    if setting == "random":
        return random_constraints(T, seed)
    if setting == "BIO" and allennlp_allowed_transitions is not None:
        return allennlp_allowed_transitions(setting, LABELS[setting])
    return compat.allowed_transitions(setting, LABELS[setting])


SETTINGS = [
    # (T, include_start_end_transitions, constraints)
    (3, True, None),
    (4, False, None),
    (4, True, "random"),
    (3, False, "BIO"),
    (4, True, "BIOUL"),
]


def ours(variant, T, weights, constraints=None, include_start_end=True, seed=0):
    torch.manual_seed(seed)
    return getattr(compat, variant)(T, weights, constraints, include_start_end)


# ---------------------------------------------------------------------------------------------
# Brute force: the weighted objectives from their definitions, every tag sequence enumerated


def path_score(logits, transitions, start, end, tags, w_emission, w_transition):
    """Score of one tag sequence (floats): emissions times w_emission[tag], transitions times
    w_transition[from tag], start / end unweighted."""
    score = start[tags[0]] + end[tags[-1]]
    score += sum(logits[i][t] * w_emission[t] for i, t in enumerate(tags))
    return score + sum(transitions[a][b] * w_transition[a] for a, b in zip(tags, tags[1:]))


def logsumexp(values):
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def brute_force_objective(variant, crf, logits, tags, n):
    """One sentence's forward value, from the variant's formula, by enumeration."""
    T = crf.num_tags
    w = crf.label_weights.tolist()
    ones = [1.0] * T
    em = logits.tolist()
    tr = crf.transitions.detach().tolist()
    if crf.include_start_end_transitions:
        start, end = crf.start_transitions.detach().tolist(), crf.end_transitions.detach().tolist()
    else:
        start = end = [0.0] * T
    gold = tuple(tags[:n].tolist())
    if variant == "ConditionalRandomFieldWeightEmission":
        w_emission, w_transition = w, ones
    else:
        w_emission, w_transition = w, w
    numerator = path_score(em, tr, start, end, gold, w_emission, w_transition)
    if variant != "ConditionalRandomFieldWeightLannoy":
        return numerator - logsumexp([path_score(em, tr, start, end, y, w_emission, w_transition)
                                      for y in itertools.product(range(T), repeat=n)])
    # Lannoy: log Z_i of every prefix y_0 .. y_i (unweighted, no end score), each step's share
    # log Z_i - log Z_{i-1} weighted by the gold tag at i, plus the end scores' share of log Z.
    zeros = [0.0] * T
    log_prefix = [logsumexp([path_score(em, tr, start, zeros, y, ones, ones)
                             for y in itertools.product(range(T), repeat=i + 1)]) for i in range(n)]
    log_z = logsumexp([path_score(em, tr, start, end, y, ones, ones) for y in itertools.product(range(T), repeat=n)])
    steps = [log_prefix[0]] + [log_prefix[i] - log_prefix[i - 1] for i in range(1, n)]
    return numerator - (sum(w[y] * step for y, step in zip(gold, steps)) + log_z - log_prefix[-1])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("include_start_end", [True, False])
def test_weighted_forward_equals_brute_force(variant, include_start_end):
    T = 3
    for seed, (B, L) in enumerate([(4, 4), (3, 2), (1, 1)]):
        crf = ours(variant, T, random_weights(T, seed), None, include_start_end, seed).double()
        logits, tags, mask = random_batch(B, L, T, torch.float64, 20 + seed)
        expected = sum(brute_force_objective(variant, crf, logits[b], tags[b], int(mask[b].sum())) for b in range(B))
        got = crf(logits, tags, mask)
        assert got.shape == () and got.dtype == torch.float64
        assert got.item() == pytest.approx(expected, abs=1e-9)
        full = sum(brute_force_objective(variant, crf, logits[b], tags[b], L) for b in range(B))
        assert crf(logits, tags).item() == pytest.approx(full, abs=1e-9)  # no mask: every sentence full length


@pytest.mark.parametrize("variant", VARIANTS)
def test_weighted_tags_at_padding_are_ignored_and_mask_types_agree(variant):
    crf = ours(variant, 3, random_weights(3, 0)).double()
    logits, tags, mask = random_batch(4, 5, 3, torch.float64, 3)
    expected = crf(logits, tags, mask)
    assert crf(logits, tags.masked_fill(~mask, -100), mask).item() == pytest.approx(expected.item(), abs=1e-12)
    for mask_type in (torch.uint8, torch.long):
        assert crf(logits, tags, mask.to(mask_type)).item() == pytest.approx(expected.item(), abs=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("include_start_end", [True, False])
def test_weighted_with_all_ones_weights_is_the_unweighted_crf(variant, include_start_end):
    T = 4
    constraints = compat.allowed_transitions("BIOUL", LABELS["BIOUL"])
    weighted = ours(variant, T, [1.0] * T, constraints, include_start_end, seed=5)
    torch.manual_seed(5)
    plain = ConditionalRandomField(T, constraints, include_start_end)
    state = weighted.state_dict()
    assert torch.equal(state.pop("label_weights"), torch.ones(T))
    assert list(state) == list(plain.state_dict())
    for name, value in plain.state_dict().items():
        assert torch.equal(state[name], value), name
    logits, tags, mask = random_batch(5, 6, T, torch.float32, 8)
    results = []
    for crf in (plain, weighted):
        crf.zero_grad()
        x = logits.clone().requires_grad_()
        value = crf(x, tags, mask)
        value.backward()
        results.append((value, x.grad, {n: p.grad for n, p in crf.named_parameters() if p.requires_grad}))
    (expected, expected_grad, expected_param_grads), (got, got_grad, got_param_grads) = results
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(got_grad, expected_grad, atol=1e-6, rtol=1e-6)
    assert got_param_grads.keys() == expected_param_grads.keys()
    for name, grad in expected_param_grads.items():
        torch.testing.assert_close(got_param_grads[name], grad, atol=1e-6, rtol=1e-6)
    for top_k in (None, 3):
        assert weighted.viterbi_tags(logits, mask, top_k) == plain.viterbi_tags(logits, mask, top_k)


@pytest.mark.parametrize("variant", VARIANTS)
def test_weighted_decoding_ignores_the_weights(variant):
    """As in AllenNLP, viterbi_tags is ConditionalRandomField's: label_weights shape the
    training objective only."""
    T = 4
    constraints = random_constraints(T, 2)
    weighted = ours(variant, T, random_weights(T, 1), constraints, seed=2)
    torch.manual_seed(2)
    plain = ConditionalRandomField(T, constraints)
    logits, _, mask = random_batch(4, 5, T, torch.float32, 4)
    for top_k in (None, 1, 4):
        assert weighted.viterbi_tags(logits, mask, top_k) == plain.viterbi_tags(logits, mask, top_k)


def test_lannoy_is_computed_in_log_space():
    """A constant c added to every logit adds c * w[y_i] to the numerator and c to each log z_i,
    which the normaliser weights by the same w[y_i]: the objective does not change. With
    c = 200 the scores are past float32's exp range (about 88), where a probability-space
    normaliser such as AllenNLP's overflows; crfkit's log-space one stays finite."""
    T = 3
    for include_start_end in (True, False):
        crf = ours("ConditionalRandomFieldWeightLannoy", T, [1.0, 2.0, 0.5], include_start_end=include_start_end)
        logits, tags, mask = random_batch(2, 4, T, torch.float32, 6)
        shifted = crf(logits + 200.0, tags, mask)
        assert torch.isfinite(shifted)
        assert shifted.item() == pytest.approx(crf(logits, tags, mask).item(), abs=1e-3)


# ---------------------------------------------------------------------------------------------
# label_weights checks


def _bad_label_weights(T):
    """(description, label_weights) that every variant rejects when built."""
    return [
        ("None", None),
        ("too short", [1.0] * (T - 1)),
        ("too long", [1.0] * (T + 1)),
        ("length one", [2.0]),
        ("nested", [[1.0] * T]),
        ("a scalar", float(T)),
        ("a string", "abc"),
        ("not numbers", ["a"] * T),
        ("NaN", [1.0] * (T - 1) + [float("nan")]),
        ("inf", [float("inf")] + [1.0] * (T - 1)),
    ]


BAD_LABEL_WEIGHTS = _bad_label_weights(3)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("label_weights", [case[1] for case in BAD_LABEL_WEIGHTS],
                         ids=[case[0] for case in BAD_LABEL_WEIGHTS])
def test_bad_label_weights_raise_configuration_error_naming_label_weights(variant, label_weights):
    cls = getattr(compat, variant)
    with pytest.raises(ConfigurationError, match="label_weights") as raised:
        cls(3, label_weights)
    assert isinstance(raised.value, ValueError)  # crfkit's argument errors are ValueErrors
    assert raised.value.message == str(raised.value)
    with pytest.raises(TypeError):
        cls(3)  # label_weights is required, as in AllenNLP


def test_label_weights_accepts_what_allennlp_accepts_and_stays_a_buffer():
    for given in ([1, 2, 3], (0.5, 1.0, 0.0), torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)):
        crf = compat.ConditionalRandomFieldWeightEmission(3, given)
        assert crf.label_weights.dtype == torch.get_default_dtype()
        assert crf.label_weights.tolist() == [float(v) for v in given]
        assert "label_weights" in dict(crf.named_buffers())
        assert "label_weights" not in dict(crf.named_parameters())
    weights = torch.tensor([1.0, 2.0, 3.0])
    crf = compat.ConditionalRandomFieldWeightTrans(3, weights)
    weights[0] = 9.0
    assert crf.label_weights[0].item() == 1.0  # a copy, not the caller's tensor


def test_configuration_error_pickles_with_its_message():
    error = pickle.loads(pickle.dumps(ConfigurationError("label_weights must be given")))
    assert type(error) is ConfigurationError and error.message == str(error) == "label_weights must be given"


# ---------------------------------------------------------------------------------------------
# AllenNLP's own weighted CRFs


def _load_allennlp_weighted_crfs():
    """{name: AllenNLP's class} for ConditionalRandomField, its three weighted variants,
    allowed_transitions and ConfigurationError, or None (tests/allennlp_source.py)."""
    modules = allennlp_source.load_crf_modules(("conditional_random_field", *VARIANT_FILES.values()))
    if modules is None:
        return None
    base = modules["conditional_random_field"]
    found = {"ConditionalRandomField": base.ConditionalRandomField, "allowed_transitions": base.allowed_transitions,
             "ConfigurationError": modules["checks"].ConfigurationError}
    for variant, stem in VARIANT_FILES.items():
        found[variant] = getattr(modules[stem], variant)
    return found


@pytest.fixture(scope="module")
def allennlp():
    found = _load_allennlp_weighted_crfs()
    if found is None:
        pytest.skip("AllenNLP's weighted CRF modules cannot be loaded: install allennlp==2.10.1, or unpack it "
                    "with `pip install --no-deps --target build/allennlp-2.10.1 allennlp==2.10.1` (`make setup`), "
                    "or point CRFKIT_ALLENNLP_SITE at such a folder")
    return found


def pair(allennlp, variant, T, weights, constraints, include_start_end, seed):
    """(AllenNLP's module, ours) built under the same seed: the same parameters."""
    torch.manual_seed(seed)
    reference = allennlp[variant](T, weights, constraints, include_start_end)
    return reference, ours(variant, T, weights, constraints, include_start_end, seed)


# dtype of (module, logits): AllenNLP's arithmetic promotes float32 parameters with float64 logits.
DTYPES = {"float32": (torch.float32, torch.float32), "float64": (torch.float64, torch.float64),
          "mixed": (torch.float32, torch.float64)}
TOLERANCE = {"float32": 2e-5, "float64": 1e-10, "mixed": 1e-6}


@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("T, include_start_end, constraint_setting", SETTINGS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_weighted_forward_and_gradients_match_allennlp(allennlp, variant, T, include_start_end,
                                                       constraint_setting, dtypes):
    """forward and its gradients w.r.t. the logits, transitions, start / end transitions and
    label_weights (made to require grad in both: a buffer, so that every term of the formula is
    checked), with and without a mask."""
    module_dtype, logits_dtype = DTYPES[dtypes]
    tolerance = TOLERANCE[dtypes]
    for seed, (B, L) in enumerate([(5, 6), (1, 1), (3, 4)]):
        constraints = constraints_for(constraint_setting, T, seed, allennlp["allowed_transitions"])
        reference, mine = pair(allennlp, variant, T, random_weights(T, seed), constraints, include_start_end, seed)
        # Same initial draws, names and values: state_dicts load both ways.
        assert list(mine.state_dict()) == list(reference.state_dict())
        for name, value in reference.state_dict().items():
            assert torch.equal(mine.state_dict()[name], value), name
        reference.load_state_dict(mine.state_dict(), strict=True)
        mine.load_state_dict(reference.state_dict(), strict=True)
        reference, mine = reference.to(module_dtype), mine.to(module_dtype)

        logits, tags, mask = random_batch(B, L, T, logits_dtype, 60 + seed)
        for given_mask in (mask, None):
            results = []
            for crf in (reference, mine):
                crf.zero_grad()
                crf.label_weights.grad = None
                crf.label_weights.requires_grad_(True)
                x = logits.clone().requires_grad_()
                value = crf(x, tags, given_mask)
                value.backward()
                crf.label_weights.requires_grad_(False)
                # Unreached transitions (L = 1): no gradient in AllenNLP, a zero one in crfkit.
                grads = {n: p.grad if p.grad is not None else torch.zeros_like(p)
                         for n, p in crf.named_parameters() if p.requires_grad}
                grads["label_weights"] = crf.label_weights.grad
                results.append((value, x.grad, grads))
            (expected, expected_grad, expected_grads), (got, got_grad, got_grads) = results
            assert got.shape == expected.shape == () and got.dtype == expected.dtype
            torch.testing.assert_close(got, expected, atol=tolerance * max(1.0, abs(expected.item())), rtol=tolerance)
            torch.testing.assert_close(got_grad, expected_grad, atol=tolerance, rtol=tolerance)
            assert got_grads.keys() == expected_grads.keys()
            for name, grad in expected_grads.items():
                torch.testing.assert_close(got_grads[name], grad, atol=tolerance, rtol=tolerance, msg=name)


@pytest.mark.parametrize("T, include_start_end, constraint_setting", SETTINGS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_weighted_viterbi_tags_match_allennlp(allennlp, variant, T, include_start_end, constraint_setting):
    for seed, (B, L) in enumerate([(5, 6), (1, 1), (3, 3)]):
        constraints = constraints_for(constraint_setting, T, seed, allennlp["allowed_transitions"])
        reference, mine = pair(allennlp, variant, T, random_weights(T, seed), constraints, include_start_end, seed)
        logits, _, mask = random_batch(B, L, T, torch.float32, 80 + seed)
        for given_mask in (mask, None):
            expected_best = reference.viterbi_tags(logits, given_mask)
            got_best = mine.viterbi_tags(logits, given_mask)
            assert [tags for tags, _ in got_best] == [tags for tags, _ in expected_best]
            assert [s for _, s in got_best] == pytest.approx([s for _, s in expected_best], abs=1e-4)
            for top_k in (1, 4):
                expected_decoding = reference.viterbi_tags(logits, given_mask, top_k=top_k)
                got_decoding = mine.viterbi_tags(logits, given_mask, top_k=top_k)
                assert len(got_decoding) == len(expected_decoding) == B
                for expected_sentence, got_sentence in zip(expected_decoding, got_decoding):
                    # The allowed sequences (no -10000 penalty) agree exactly; below them AllenNLP's
                    # k-best also ranks paths through its START / END sentinels (see
                    # tests/test_compat.py), crfkit the real sequences only.
                    allowed = [d for d in expected_sentence if d[1] > FORBIDDEN / 2]
                    assert [tags for tags, _ in got_sentence[:len(allowed)]] == [tags for tags, _ in allowed]
                    assert [s for _, s in got_sentence[:len(allowed)]] == pytest.approx(
                        [s for _, s in allowed], abs=1e-4)
                    assert all(s < FORBIDDEN / 2 for _, s in got_sentence[len(allowed):])
                    assert len(got_sentence) == min(len(expected_sentence), T ** len(got_sentence[0][0]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_weighted_all_ones_match_allennlp_unweighted_crf(allennlp, variant):
    """AllenNLP's own weighted variant with all-ones weights against AllenNLP's unweighted CRF,
    and ours against both: the same value."""
    T = 4
    logits, tags, mask = random_batch(4, 5, T, torch.float64, 9)
    torch.manual_seed(4)
    plain = allennlp["ConditionalRandomField"](T).double()
    reference, mine = pair(allennlp, variant, T, [1.0] * T, None, True, 4)
    expected = plain(logits, tags, mask).item()
    assert reference.double()(logits, tags, mask).item() == pytest.approx(expected, abs=1e-9)
    assert mine.double()(logits, tags, mask).item() == pytest.approx(expected, abs=1e-9)


def test_lannoy_where_allennlp_overflows(allennlp):
    """The documented difference: logits past float32's exp range make AllenNLP's Lannoy
    objective inf / NaN; crfkit's is the (finite) value of the unshifted logits."""
    T = 3
    reference, mine = pair(allennlp, "ConditionalRandomFieldWeightLannoy", T, [1.0, 2.0, 0.5], None, True, 0)
    logits, tags, mask = random_batch(2, 4, T, torch.float32, 6)
    assert not torch.isfinite(reference(logits + 200.0, tags, mask))
    expected = reference(logits, tags, mask).item()
    assert mine(logits + 200.0, tags, mask).item() == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bad_label_weights_give_allennlp_kind_of_error(allennlp, variant):
    """None: both raise ConfigurationError when built. A wrong length: crfkit raises
    ConfigurationError when built; AllenNLP builds the module and fails in forward with a
    RuntimeError (or, for length 1, broadcasts the weight silently in the emission and
    transition variants)."""
    T = 3
    with pytest.raises(allennlp["ConfigurationError"], match="label_weights"):
        allennlp[variant](T, None)
    with pytest.raises(ConfigurationError, match="label_weights must be given"):
        getattr(compat, variant)(T, None)
    assert ConfigurationError.__name__ == allennlp["ConfigurationError"].__name__
    logits, tags, mask = random_batch(2, 3, T, torch.float32, 1)
    for length in (T - 1, T + 1):
        weights = [1.0] * length
        with pytest.raises(ConfigurationError, match=f"len\\(label_weights\\) must be num_tags = {T}, got {length}"):
            getattr(compat, variant)(T, weights)
        reference = allennlp[variant](T, weights)
        with pytest.raises(RuntimeError):
            reference(logits, tags, mask)


# ---------------------------------------------------------------------------------------------
# pytorch-crf's repr


@pytest.mark.parametrize("num_tags", [1, 10])
@pytest.mark.parametrize("batch_first", [False, True])
def test_pytorch_crf_repr_is_pytorch_crfs(num_tags, batch_first):
    crf = CRF(num_tags, batch_first=batch_first)
    assert repr(crf) == str(crf) == f"CRF(num_tags={num_tags})"  # what pytorch-crf's own tests check
    if importlib.util.find_spec("torchcrf") is not None:
        import torchcrf

        assert repr(crf) == repr(torchcrf.CRF(num_tags, batch_first=batch_first))
