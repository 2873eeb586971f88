"""crfkit.entities against brute-force enumeration of every tag sequence on tiny CRFs: the exact
probability of every possible entity, the Viterbi path's entities, MBR decoding against a search
over every set of non-overlapping entities, gradients, and bad input."""
import itertools
import math

import pytest
import torch

import crfkit
from crfkit.constraints import allowed_transitions
from crfkit.entities import entity_marginals, entity_spans, entity_types, mbr_decode
from crfkit.tag import entities as tag_entities

from brute_force import all_sequences, expectation

pytestmark = pytest.mark.usefixtures("one_thread")

NEG_INF = float("-inf")

# (scheme, labels): 1-2 entity types per scheme, labels in an unusual order where it tests
# entity_types' order of first appearance.
LABEL_SETS = {
    "BIO": ("BIO", ["O", "B-A", "I-A", "B-B", "I-B"]),
    "IOB1": ("IOB1", ["I-A", "O", "B-B", "I-B", "B-A"]),
    "BIOES": ("BIOES", ["O", "B-A", "I-A", "E-A", "S-A", "S-B"]),
    "BMES": ("BMES", ["O", "B", "M", "E", "S"]),
}


def split(label):
    if label == "O":
        return "O", ""
    prefix, _, kind = label.partition("-")
    return prefix, kind


def read(seq, labels):
    """The documented reading, written out: the entities (first, end, type name) of one tag sequence."""
    found, begin, kind = [], None, None
    for i, t in enumerate(seq):
        prefix, name = split(labels[t])
        if prefix == "O":
            if begin is not None:
                found.append((begin, i, kind))
            begin = None
            continue
        if prefix in ("B", "S") or begin is None or name != kind:
            if begin is not None:
                found.append((begin, i, kind))
            begin, kind = i, name
        if prefix in ("E", "S"):
            found.append((begin, i + 1, kind))
            begin = None
    if begin is not None:
        found.append((begin, len(seq), kind))
    return found


def make_crf(scheme, labels, B, L, dtype, constrained, seed, forbid=0.0):
    g = torch.Generator().manual_seed(seed)
    T = len(labels)
    emissions = torch.randn(B, L, T, generator=g, dtype=torch.float64) * 1.5
    transitions = torch.randn(T, T, generator=g, dtype=torch.float64)
    start, end = torch.randn(T, generator=g, dtype=torch.float64), torch.randn(T, generator=g, dtype=torch.float64)
    if forbid:
        emissions = emissions.masked_fill(torch.rand(B, L, T, generator=g) < forbid, NEG_INF)
        transitions = transitions.masked_fill(torch.rand(T, T, generator=g) < forbid, NEG_INF)
    if constrained:
        mask_t, mask_s, mask_e = allowed_transitions(labels, scheme).as_scores(torch.float64)
        transitions, start, end = transitions + mask_t, start + mask_s, end + mask_e
    lengths = torch.tensor([L, 0, 1, *([L - 1, 2, L] * B)][:B])
    return [x.to(dtype) for x in (emissions, transitions, start, end)] + [lengths]


def brute_force_entities(emissions, transitions, start, end, n, labels):
    """{(first, end, type name): probability} over every allowed sequence of length n, and the sequences."""
    seqs = all_sequences(emissions.double(), transitions.double(), start.double(), end.double(), n)
    probabilities = {}
    if not seqs:
        return probabilities, seqs
    top = max(s for s, _ in seqs)
    log_z = top + math.log(sum(math.exp(s - top) for s, _ in seqs))
    for score, seq in seqs:
        p = math.exp(score - log_z)
        for entity in read(seq, labels):
            probabilities[entity] = probabilities.get(entity, 0.0) + p
    return probabilities, seqs


def every_span(lengths, K):
    rows = [(b, s, e, k) for b, n in enumerate(lengths.tolist()) for s in range(n) for e in range(s + 1, n + 1)
            for k in range(K)]
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 4)


CASES = [(name, dtype, constrained, forbid) for name in LABEL_SETS for dtype in (torch.float64, torch.float32)
         for constrained, forbid in ((False, 0.0), (True, 0.0), (False, 0.25))]


@pytest.mark.parametrize("name, dtype, constrained, forbid", CASES)
def test_every_span_probability_matches_brute_force(name, dtype, constrained, forbid):
    scheme, labels = LABEL_SETS[name]
    L = 4 if len(labels) > 5 else 5
    emissions, transitions, start, end, lengths = make_crf(scheme, labels, 5, L, dtype, constrained,
                                                           seed=len(CASES) + CASES.index((name, dtype, constrained,
                                                                                          forbid)), forbid=forbid)
    types = entity_types(labels, scheme)
    spans = every_span(lengths, len(types))
    result = entity_marginals(emissions, transitions, labels, spans, lengths, start, end, scheme=scheme)
    assert torch.equal(result.spans, spans)
    assert result.probabilities.dtype == dtype and result.probabilities.shape == (spans.shape[0],)
    expected = []
    for b, n in enumerate(lengths.tolist()):
        probabilities, _ = brute_force_entities(emissions[b], transitions, start, end, n, labels)
        expected += [probabilities.get((s, e, types[k]), 0.0) for bb, s, e, k in spans.tolist() if bb == b]
    tolerance = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(result.probabilities.double(), torch.tensor(expected, dtype=torch.float64),
                               atol=tolerance, rtol=1e-4 if dtype == torch.float32 else 1e-9)


@pytest.mark.parametrize("name", ["BIO", "IOB1", "BIOES"])
@pytest.mark.parametrize("form", ["example", "example_1", "position"])
def test_per_example_and_per_position_transitions(name, form):
    # transitions (B, T, T), (B, 1, T, T) or (B, L, T, T) and start / end (B, T), as crfkit.functional takes them
    scheme, labels = LABEL_SETS[name]
    B, L, T = 4, 4, len(labels)
    emissions, _, _, _, lengths = make_crf(scheme, labels, B, L, torch.float64, False, seed=21)
    g = torch.Generator().manual_seed(22)
    shape = {"example": (B, T, T), "example_1": (B, 1, T, T), "position": (B, L, T, T)}[form]
    transitions = torch.randn(*shape, generator=g, dtype=torch.float64)
    transitions = transitions.masked_fill(torch.rand(*shape, generator=g) < 0.2, NEG_INF)
    start, end = (torch.randn(B, T, generator=g, dtype=torch.float64) for _ in range(2))
    types = entity_types(labels, scheme)
    spans = every_span(lengths, len(types))
    result = entity_marginals(emissions, transitions, labels, spans, lengths, start, end, scheme=scheme)
    expected = []
    for b, n in enumerate(lengths.tolist()):
        per_sentence = transitions[b] if form != "example_1" else transitions[b, 0]
        probabilities, _ = brute_force_entities(emissions[b], per_sentence, start[b], end[b], n, labels)
        expected += [probabilities.get((s, e, types[k]), 0.0) for bb, s, e, k in spans.tolist() if bb == b]
    torch.testing.assert_close(result.probabilities, torch.tensor(expected, dtype=torch.float64), atol=1e-12,
                               rtol=1e-9)
    viterbi_entities = entity_marginals(emissions, transitions, labels, None, lengths, start, end, scheme=scheme)
    paths = crfkit.viterbi(emissions, transitions, lengths, start, end).paths
    assert torch.equal(viterbi_entities.spans, entity_spans(paths, labels, lengths, scheme=scheme))
    decoded = mbr_decode(emissions, transitions, labels, lengths, start, end, scheme=scheme, threshold=0.2)
    for b, n in enumerate(lengths.tolist()):
        per_sentence = transitions[b] if form != "example_1" else transitions[b, 0]
        probabilities, _ = brute_force_entities(emissions[b], per_sentence, start[b], end[b], n, labels)
        probabilities = {(s, e, types.index(k)): p for (s, e, k), p in probabilities.items()}
        value = sum(p - 0.2 for r, p in zip(decoded.spans.tolist(), decoded.probabilities.tolist()) if r[0] == b)
        assert value == pytest.approx(best_set(probabilities, n, 0.2, n), abs=1e-9)


@pytest.mark.parametrize("name", LABEL_SETS)
def test_a_sentence_with_no_allowed_sequence_has_no_entity(name):
    scheme, labels = LABEL_SETS[name]
    emissions, transitions, start, end, lengths = make_crf(scheme, labels, 3, 3, torch.float64, True, seed=5)
    emissions[0, 1] = NEG_INF  # sentence 0 (length 3): every sequence forbidden
    spans = every_span(lengths, len(entity_types(labels, scheme)))
    result = entity_marginals(emissions, transitions, labels, spans, lengths, start, end, scheme=scheme)
    assert torch.all(result.probabilities[spans[:, 0] == 0] == 0)
    assert torch.all(torch.isfinite(result.probabilities))
    assert not (entity_marginals(emissions, transitions, labels, None, lengths, start, end,
                                 scheme=scheme).spans[:, 0] == 0).any()


@pytest.mark.parametrize("name", LABEL_SETS)
def test_the_reading_is_the_documented_one_and_crfkit_tag_entities(name):
    scheme, labels = LABEL_SETS[name]
    types = entity_types(labels, scheme)
    seqs = list(itertools.product(range(len(labels)), repeat=4))
    paths = torch.tensor(seqs)
    spans = entity_spans(paths, labels, scheme=scheme)
    found = {b: [] for b in range(len(seqs))}
    for b, s, e, k in spans.tolist():
        found[b].append((s, e, types[k]))
    words = ["w", "x", "y", "z"]
    for b, seq in enumerate(seqs):
        assert found[b] == read(seq, labels), [labels[t] for t in seq]
        if name != "BMES":  # crfkit.tag.entities reads PREFIX-TYPE labels only
            assert [(s, e, k) for _, k, s, e in tag_entities(words, [labels[t] for t in seq])] == found[b]


def test_entity_spans_respects_lengths_and_missing_paths():
    labels = LABEL_SETS["BIO"][1]
    paths = torch.tensor([[1, 2, 2, 0], [2, 1, -1, -1], [-1, -1, -1, -1]])
    spans = entity_spans(paths, labels, torch.tensor([4, 2, 3]))
    assert spans.tolist() == [[0, 0, 3, 0], [1, 0, 1, 0], [1, 1, 2, 0]]
    assert entity_spans(paths, labels, torch.tensor([2, 1, 0])).tolist() == [[0, 0, 2, 0], [1, 0, 1, 0]]
    assert entity_spans(torch.zeros(0, 3, dtype=torch.long), labels).shape == (0, 4)


def test_entity_types_in_order_of_first_appearance():
    assert entity_types(["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]) == ["PER", "LOC"]
    assert entity_types(["I-ORG", "O", "B-PER", "B-ORG"], "IOB1") == ["ORG", "PER"]
    assert entity_types(["O", "B", "M", "E", "S"], "BMES") == [""]
    assert entity_types(["O"]) == []


@pytest.mark.parametrize("name", LABEL_SETS)
@pytest.mark.parametrize("constrained", [False, True])
def test_spans_none_gives_the_viterbi_entities(name, constrained):
    scheme, labels = LABEL_SETS[name]
    emissions, transitions, start, end, lengths = make_crf(scheme, labels, 6, 4, torch.float64, constrained, seed=11)
    result = entity_marginals(emissions, transitions, labels, None, lengths, start, end, scheme=scheme)
    paths = crfkit.viterbi(emissions, transitions, lengths, start, end).paths
    assert torch.equal(result.spans, entity_spans(paths, labels, lengths, scheme=scheme))
    types = entity_types(labels, scheme)
    for (b, s, e, k), p in zip(result.spans.tolist(), result.probabilities.tolist()):
        probabilities, _ = brute_force_entities(emissions[b], transitions, start, end, int(lengths[b]), labels)
        assert p == pytest.approx(probabilities[(s, e, types[k])], abs=1e-12)
    empty = entity_marginals(emissions[:, :0], transitions, labels, None, torch.zeros(6, dtype=torch.long),
                             start, end, scheme=scheme)
    assert empty.spans.shape == (0, 4) and empty.probabilities.shape == (0,)


def test_half_precision_emissions_give_float32():
    scheme, labels = LABEL_SETS["BIO"]
    emissions, transitions, start, end, lengths = make_crf(scheme, labels, 2, 3, torch.float32, True, seed=3)
    result = entity_marginals(emissions.half(), transitions, labels, None, lengths, start, end)
    assert result.probabilities.dtype == torch.float32


def test_probabilities_are_differentiable_and_match_the_brute_force_gradient():
    scheme, labels = LABEL_SETS["BIO"]
    emissions, transitions, start, end, lengths = make_crf(scheme, labels, 3, 4, torch.float64, False, seed=7)
    lengths = torch.tensor([4, 3, 2])
    spans = torch.tensor([[0, 1, 3, 0], [1, 0, 1, 1], [2, 0, 2, 0], [0, 3, 4, 1]])
    types = entity_types(labels, scheme)
    params = [x.clone().requires_grad_() for x in (emissions, transitions, start, end)]
    result = entity_marginals(params[0], params[1], labels, spans, lengths, params[2], params[3])
    weights = torch.tensor([0.3, -1.0, 2.0, 0.7], dtype=torch.float64)
    grads = torch.autograd.grad((result.probabilities * weights).sum(), params)

    brute = [x.clone().requires_grad_() for x in (emissions, transitions, start, end)]
    total = 0
    for (b, s, e, k), w in zip(spans.tolist(), weights.tolist()):
        def feature(seq, s=s, e=e, k=k):
            return torch.tensor(float((s, e, types[k]) in read(seq, labels)), dtype=torch.float64)
        value = expectation(brute[0][b:b + 1], brute[1], lengths[b:b + 1], brute[2], brute[3], feature, ())
        total = total + w * value.sum()
    expected = torch.autograd.grad(total, brute)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)


# ---------------------------------------------------------------------------------- MBR decoding
def best_set(probabilities, n, threshold, max_len):
    """The best total of (p - threshold) over sets of non-overlapping candidate entities, by search."""
    candidates = [(s, e, k, p) for (s, e, k), p in probabilities.items() if e - s <= max_len]

    def search(position):  # best over entities starting at or after position
        if position >= n:
            return 0.0
        best = search(position + 1)
        for s, e, k, p in candidates:
            if s == position:
                best = max(best, p - threshold + search(e))
        return best

    return search(0)


@pytest.mark.parametrize("name", LABEL_SETS)
@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.2])
@pytest.mark.parametrize("constrained", [False, True])
def test_mbr_decode_is_the_best_set_of_entities(name, threshold, constrained):
    scheme, labels = LABEL_SETS[name]
    L = 4 if len(labels) > 5 else 5
    emissions, transitions, start, end, lengths = make_crf(scheme, labels, 5, L, torch.float64, constrained,
                                                           seed=int(threshold * 10) + 3 * constrained)
    types = entity_types(labels, scheme)
    for max_len in (None, 2):
        result = mbr_decode(emissions, transitions, labels, lengths, start, end, scheme=scheme,
                            threshold=threshold, max_span_length=max_len)
        assert result.paths.shape == (5, L)
        assert torch.equal(result.paths < 0, torch.arange(L) >= lengths.unsqueeze(1))
        assert torch.equal(entity_spans(result.paths, labels, lengths, scheme=scheme), result.spans)
        check = entity_marginals(emissions, transitions, labels, result.spans, lengths, start, end, scheme=scheme)
        torch.testing.assert_close(result.probabilities, check.probabilities)
        assert bool((result.probabilities > threshold).all())
        for b, n in enumerate(lengths.tolist()):
            probabilities, _ = brute_force_entities(emissions[b], transitions, start, end, n, labels)
            probabilities = {(s, e, types.index(k)): p for (s, e, k), p in probabilities.items()}
            chosen = [(p, tuple(r[1:])) for r, p in zip(result.spans.tolist(), result.probabilities.tolist())
                      if r[0] == b]
            value = sum(p - threshold for p, _ in chosen)
            assert value == pytest.approx(best_set(probabilities, n, threshold, max_len or n), abs=1e-9)
            if threshold == 0.5:
                above = sorted(span for span, p in probabilities.items()
                               if p > 0.5 and span[1] - span[0] <= (max_len or n))
                assert sorted(span for _, span in chosen) == above


def test_mbr_writes_iob1_b_tags_between_adjacent_entities_of_one_type():
    labels = ["O", "I-A", "B-A"]
    # Two one-word entities of type A side by side: each word's "I-A, starting a new entity" is
    # certain, so the DP takes both, and IOB1 must write the second as B-A.
    emissions = torch.tensor([[[-9.0, 0.0, 9.0], [-9.0, -9.0, 9.0]]], dtype=torch.float64)
    result = mbr_decode(emissions, torch.zeros(3, 3, dtype=torch.float64), labels, scheme="IOB1")
    assert result.spans.tolist() == [[0, 0, 1, 0], [0, 1, 2, 0]]
    assert result.paths.tolist() == [[1, 2]]


def test_mbr_needs_o_and_the_tags_it_writes():
    emissions = torch.tensor([[[0.0, 5.0, -5.0], [0.0, -5.0, 5.0]]])
    with pytest.raises(ValueError, match="labels must hold 'O'"):
        mbr_decode(emissions, torch.zeros(3, 3), ["B-A", "I-A", "B-B"])
    # BIOES labels without S-A cannot write a one-word A entity
    bioes = torch.full((1, 1, 3), -9.0)
    bioes[0, 0, 2] = 9.0
    with pytest.raises(ValueError, match="labels lack 'S-A'"):
        mbr_decode(bioes, torch.zeros(3, 3), ["O", "B-A", "E-A"], scheme="BIOES")
    # BIO labels O, I-A: the entity "I-A I-A" exists (I-A after O starts one) but cannot be written
    with pytest.raises(ValueError, match="labels lack 'B-A'"):
        mbr_decode(torch.tensor([[[-9.0, 9.0], [-9.0, 9.0]]]), torch.zeros(2, 2), ["O", "I-A"])
    only_o = mbr_decode(torch.zeros(2, 3, 1), torch.zeros(1, 1), ["O"], lengths=torch.tensor([3, 1]))
    assert only_o.paths.tolist() == [[0, 0, 0], [0, -1, -1]] and only_o.spans.shape == (0, 4)


# ------------------------------------------------------------------------------------- bad input
def test_bad_input_names_the_argument():
    labels = ["O", "B-A", "I-A"]
    emissions, transitions = torch.zeros(2, 3, 3), torch.zeros(3, 3)
    lengths = torch.tensor([3, 1])
    with pytest.raises(ValueError, match="labels has 2 tag names but emissions has num_tags = 3"):
        entity_marginals(emissions, transitions, ["O", "B-A"])
    with pytest.raises(TypeError, match="labels must be a sequence of str"):
        entity_marginals(emissions, transitions, "OBI")
    with pytest.raises(ValueError, match="labels: invalid label 'X-A'"):
        entity_marginals(emissions, transitions, ["O", "X-A", "I-A"])
    with pytest.raises(ValueError, match="scheme: unknown tagging scheme 'BILOU'"):
        entity_marginals(emissions, transitions, labels, scheme="BILOU")
    with pytest.raises(TypeError, match="scheme must be a tagging scheme name"):
        entity_marginals(emissions, transitions, labels, scheme=None)
    with pytest.raises(TypeError, match="spans must be a torch.Tensor"):
        entity_marginals(emissions, transitions, labels, [[0, 0, 1, 0]])
    with pytest.raises(TypeError, match="spans must be an integer tensor"):
        entity_marginals(emissions, transitions, labels, torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"spans must have shape \(N, 4\)"):
        entity_marginals(emissions, transitions, labels, torch.zeros(1, 3, dtype=torch.long))
    for row, message in (([2, 0, 1, 0], r"sentence 2 is not in \[0, batch = 2\)"),
                         ([1, 0, 2, 0], r"need 0 <= first < end <= lengths\[sentence\] = 1"),
                         ([0, 2, 2, 0], "need 0 <= first < end"),
                         ([0, -1, 1, 0], "need 0 <= first < end"),
                         ([0, 0, 1, 1], r"type index 1 is not in \[0, 1\)")):
        with pytest.raises(ValueError, match=message):
            entity_marginals(emissions, transitions, labels, torch.tensor([[0, 0, 1, 0], row]), lengths)
    with pytest.raises(ValueError, match="transitions must have shape"):
        entity_marginals(emissions, torch.zeros(2, 2), labels)
    with pytest.raises(ValueError, match="lengths must lie in"):
        entity_marginals(emissions, transitions, labels, lengths=torch.tensor([4, 1]))
    for threshold in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"threshold must be a number in \[0, 1\]"):
            mbr_decode(emissions, transitions, labels, threshold=threshold)
    with pytest.raises(TypeError, match="threshold must be a real number"):
        mbr_decode(emissions, transitions, labels, threshold="0.5")
    with pytest.raises(ValueError, match="max_span_length must be a positive int"):
        mbr_decode(emissions, transitions, labels, max_span_length=0)
    with pytest.raises(TypeError, match="paths must be an integer tensor"):
        entity_spans(torch.zeros(2, 3), labels)
    with pytest.raises(ValueError, match=r"paths within the lengths must lie in \[0, 3\)"):
        entity_spans(torch.tensor([[0, 3]]), labels)
