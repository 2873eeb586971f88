"""Tests for crfkit.constraints."""

import itertools
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from crfkit import constraints
from crfkit.constraints import SCHEMES, Constraints, allowed_transitions

# ---------------------------------------------------------------------------
# Independent reference: chunk grammars as regular expressions.
#
# Every tag is encoded as two characters: its prefix letter and one character
# standing for its type ("_" for O and for untyped BMES labels).  A sequence is
# valid iff its encoding matches the scheme's chunk grammar.  Backreferences
# tie all tags of a chunk to the type of the chunk's first tag.
# ---------------------------------------------------------------------------

_GRAMMARS = {
    # chunk = B-X (I-X)*
    "BIO": re.compile(r"(?:O_|B(\w)(?:I\1)*)*"),
    # run of same-type chunks = I-X (I-X)* (B-X (I-X)*)*
    "IOB1": re.compile(r"(?:O_|I(\w)(?:I\1)*(?:B\1(?:I\1)*)*)*"),
    # chunk = S-X | B-X (I-X)* E-X
    "BIOES": re.compile(r"(?:O_|S\w|B(\w)(?:I\1)*E\1)*"),
    "BMES": re.compile(r"(?:O_|S\w|B(\w)(?:M\1)*E\1)*"),
}


def _encode(labels):
    """Map each label to a two-character token (prefix, type char)."""
    type_chars = {}
    tokens = []
    for label in labels:
        if label == "O":
            tokens.append("O_")
            continue
        prefix, _, typ = label.partition("-")
        if typ == "":
            char = "_"
        else:
            char = type_chars.setdefault(typ, "abcdefghijklmnopqrstuvwxyz"[len(type_chars)])
        tokens.append(prefix + char)
    return tokens


def reference_valid(scheme, labels, seq):
    tokens = _encode(labels)
    return _GRAMMARS[scheme].fullmatch("".join(tokens[i] for i in seq)) is not None


def bio_rule_valid(labels, seq):
    """BIO stated directly: every I-X is preceded by B-X or I-X."""
    for k, i in enumerate(seq):
        if labels[i].startswith("I-"):
            if k == 0:
                return False
            prev = labels[seq[k - 1]]
            if prev not in ("B" + labels[i][1:], labels[i]):
                return False
    return True


def bioes_chunk_parser_valid(labels, seq, inside="I"):
    """BIOES/BMES as an explicit chunk parser (a small state machine)."""
    open_type = None  # type of the chunk currently open, None if none
    for i in seq:
        label = labels[i]
        prefix, typ = (label, "") if "-" not in label else label.split("-", 1)
        if prefix == "O" or prefix == "S" or prefix == "B":
            if open_type is not None:
                return False  # previous chunk never closed
            if prefix == "B":
                open_type = typ
        else:  # inside or E
            if open_type != typ:
                return False
            if prefix == "E":
                open_type = None
    return open_type is None


LABEL_SETS = {
    "BIO": ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"],
    "IOB1": ["O", "I-PER", "B-PER", "I-LOC", "B-LOC"],
    "BIOES": ["O", "B-PER", "I-PER", "E-PER", "S-PER", "B-LOC", "I-LOC", "E-LOC", "S-LOC"],
    "BMES": ["B", "M", "E", "S", "O", "B-NR", "M-NR", "E-NR", "S-NR"],
}


def _all_sequences(n, max_len=4):
    for length in range(1, max_len + 1):
        yield from itertools.product(range(n), repeat=length)


# ---------------------------------------------------------------------------
# Exhaustive agreement with the reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_is_allowed_matches_reference_exhaustively(scheme):
    labels = LABEL_SETS[scheme]
    c = allowed_transitions(labels, scheme)
    n_valid = 0
    for seq in _all_sequences(len(labels)):
        expected = reference_valid(scheme, labels, seq)
        assert c.is_allowed(seq) == expected, [labels[i] for i in seq]
        n_valid += expected
    # the reference itself is not trivially all-true / all-false
    assert 0 < n_valid < sum(len(labels) ** k for k in range(1, 5))


def test_reference_checkers_agree_with_each_other():
    # guards against a bug in the regex reference itself
    labels = LABEL_SETS["BIO"]
    for seq in _all_sequences(len(labels)):
        assert reference_valid("BIO", labels, seq) == bio_rule_valid(labels, seq)
    for scheme, inside in (("BIOES", "I"), ("BMES", "M")):
        labels = LABEL_SETS[scheme]
        for seq in _all_sequences(len(labels), max_len=3):
            assert reference_valid(scheme, labels, seq) == bioes_chunk_parser_valid(
                labels, seq, inside
            )


def test_known_counts_of_valid_sequences():
    # BIO over O,B-PER,I-PER,B-LOC,I-LOC, length 2: the first tag is O, B-PER or
    # B-LOC; O has 3 successors (O, B-PER, B-LOC), each B-X has 4 (those + I-X).
    c = allowed_transitions(LABEL_SETS["BIO"], "BIO")
    n2 = sum(c.is_allowed(s) for s in itertools.product(range(5), repeat=2))
    assert n2 == 3 + 4 + 4  # O, B-PER, B-LOC as first tags
    # BIOES length 1: O, S-PER, S-LOC only
    c = allowed_transitions(LABEL_SETS["BIOES"], "BIOES")
    ok = [LABEL_SETS["BIOES"][i] for i in range(9) if c.is_allowed([i])]
    assert ok == ["O", "S-PER", "S-LOC"]


def test_empty_sequence_allowed_and_tensor_input():
    c = allowed_transitions(LABEL_SETS["BIO"], "BIO")
    assert c.is_allowed([]) is True
    assert c.is_allowed(torch.tensor([1, 2, 0])) is True
    assert c.is_allowed(torch.tensor([0, 2])) is False
    with pytest.raises(ValueError, match="out of range"):
        c.is_allowed([0, 5])
    with pytest.raises(ValueError, match="out of range"):
        c.is_allowed([-1])


# ---------------------------------------------------------------------------
# as_scores
# ---------------------------------------------------------------------------


def test_as_scores_values_orientation_dtype_device():
    labels = ["O", "B-PER", "I-PER"]
    c = allowed_transitions(labels, "BIO")
    trans, start, end = c.as_scores()
    assert trans.dtype == start.dtype == end.dtype == torch.float32
    assert trans.shape == (3, 3) and start.shape == (3,) and end.shape == (3,)
    # [from, to]: O -> I-PER forbidden, B-PER -> I-PER allowed, I-PER -> O allowed
    assert trans[0, 2].item() == float("-inf")
    assert trans[1, 2].item() == 0.0
    assert trans[2, 0].item() == 0.0
    assert trans[2, 1].item() == 0.0
    expected = torch.tensor(
        [[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    )
    assert torch.equal(trans, expected)
    assert torch.equal(start, torch.tensor([0.0, 0.0, float("-inf")]))
    assert torch.equal(end, torch.zeros(3))

    t64, s64, e64 = c.as_scores(dtype=torch.float64, device="cpu")
    assert t64.dtype == s64.dtype == e64.dtype == torch.float64
    assert t64.device.type == "cpu"
    assert torch.equal(t64, expected.double())

    tm, sm, em = c.as_scores(dtype=torch.bfloat16, device="meta")
    assert tm.device.type == sm.device.type == em.device.type == "meta"
    assert tm.dtype == torch.bfloat16 and tm.shape == (3, 3)


def test_as_scores_consistent_with_masks_and_fresh():
    c = allowed_transitions(LABEL_SETS["BIOES"], "BIOES")
    trans, start, end = c.as_scores(torch.float16)
    for scores, mask in ((trans, c.transitions), (start, c.start), (end, c.end)):
        assert torch.equal(scores == 0, mask)
        assert torch.equal(torch.isneginf(scores), ~mask)
    trans.fill_(1.0)  # must not write through to the constraints
    assert torch.equal(c.as_scores()[0] == 0, c.transitions)


def test_as_scores_rejects_integer_dtype():
    c = allowed_transitions(["O", "B-PER"], "BIO")
    with pytest.raises(ValueError, match="dtype"):
        c.as_scores(dtype=torch.int64)


# ---------------------------------------------------------------------------
# Hand-written spot checks
# ---------------------------------------------------------------------------


def _t(c, a, b):
    return bool(c.transitions[c.labels.index(a), c.labels.index(b)])


def _s(c, a):
    return bool(c.start[c.labels.index(a)])


def _e(c, a):
    return bool(c.end[c.labels.index(a)])


def test_fields_and_types():
    c = allowed_transitions(["O", "B-PER", "I-PER"], "bio")
    assert isinstance(c, Constraints)
    assert c.labels == ("O", "B-PER", "I-PER")
    assert c.scheme == "BIO"
    assert c.transitions.dtype == c.start.dtype == c.end.dtype == torch.bool
    assert c.transitions.shape == (3, 3)
    with pytest.raises(AttributeError):
        c.scheme = "IOB1"  # frozen


def test_bio_spot_checks():
    c = allowed_transitions(LABEL_SETS["BIO"] + ["B-PER-X", "I-PER-X"], "BIO")
    assert not _t(c, "O", "I-PER")
    assert _t(c, "B-PER", "I-PER")
    assert _t(c, "I-PER", "I-PER")
    assert not _t(c, "B-LOC", "I-PER")
    assert not _t(c, "I-LOC", "I-PER")
    assert _t(c, "I-PER", "B-PER")
    assert _t(c, "I-PER", "B-LOC")
    assert _t(c, "B-PER", "O")
    # hyphenated type is its own type
    assert _t(c, "B-PER-X", "I-PER-X")
    assert not _t(c, "B-PER", "I-PER-X")
    assert not _t(c, "B-PER-X", "I-PER")
    assert _s(c, "O") and _s(c, "B-LOC") and not _s(c, "I-LOC")
    assert all(c.end.tolist())


def test_iob1_spot_checks():
    c = allowed_transitions(LABEL_SETS["IOB1"], "IOB1")
    assert _t(c, "I-PER", "B-PER")
    assert not _t(c, "O", "B-PER")
    assert not _t(c, "I-LOC", "B-PER")
    assert not _t(c, "B-LOC", "B-PER")
    assert _t(c, "B-PER", "B-PER")
    assert _t(c, "I-PER", "I-LOC")  # a new chunk of another type starts with I
    assert _t(c, "O", "I-PER")
    assert _t(c, "B-PER", "I-LOC")
    assert _s(c, "O") and _s(c, "I-PER") and not _s(c, "B-PER")
    assert all(c.end.tolist())


def test_bioes_spot_checks():
    c = allowed_transitions(LABEL_SETS["BIOES"], "IOBES")
    assert c.scheme == "BIOES"
    assert _t(c, "B-PER", "E-PER") and _t(c, "B-PER", "I-PER")
    assert not _t(c, "B-PER", "O") and not _t(c, "I-PER", "O")
    assert not _t(c, "B-PER", "E-LOC") and not _t(c, "I-PER", "I-LOC")
    assert not _t(c, "E-PER", "I-PER") and not _t(c, "S-PER", "E-PER")
    assert _t(c, "E-PER", "B-LOC") and _t(c, "S-LOC", "S-PER") and _t(c, "E-PER", "O")
    assert not _t(c, "O", "I-PER") and not _t(c, "O", "E-PER")
    # last-tag rule: O, E-*, S-* only
    assert [label for label in c.labels if _e(c, label)] == ["O", "E-PER", "S-PER", "E-LOC", "S-LOC"]
    assert [label for label in c.labels if _s(c, label)] == ["O", "B-PER", "S-PER", "B-LOC", "S-LOC"]


def test_bmes_spot_checks():
    c = allowed_transitions(LABEL_SETS["BMES"], "bmes")
    assert _t(c, "B", "M") and _t(c, "B", "E") and _t(c, "M", "E") and _t(c, "M", "M")
    assert not _t(c, "B", "M-NR") and not _t(c, "B-NR", "E")
    assert _t(c, "E", "S-NR") and _t(c, "S", "B") and _t(c, "S-NR", "O")
    assert not _t(c, "S", "M") and not _t(c, "O", "E")
    assert [label for label in c.labels if _e(c, label)] == ["E", "S", "O", "E-NR", "S-NR"]
    # no O needed
    c = allowed_transitions(["B", "M", "E", "S"], "BMES")
    assert c.is_allowed([0, 1, 1, 2, 3])
    assert not c.is_allowed([0, 1])


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["BILOU", "IOB3", ""])
def test_unknown_scheme(scheme):
    with pytest.raises(ValueError, match=r"scheme.*BIO, IOB1, BIOES, BMES"):
        allowed_transitions(["O"], scheme)


def test_scheme_aliases_case_insensitive():
    assert allowed_transitions(["O"], "iob2").scheme == "BIO"
    assert allowed_transitions(["O"], "IoBeS").scheme == "BIOES"
    assert allowed_transitions(["O"], "iob1").scheme == "IOB1"


def test_scheme_type_error():
    with pytest.raises(TypeError, match="scheme"):
        allowed_transitions(["O"], None)


def test_empty_labels():
    with pytest.raises(ValueError, match="labels must be non-empty"):
        allowed_transitions([], "BIO")


def test_duplicate_labels():
    with pytest.raises(ValueError, match=r"duplicate label 'B-PER'"):
        allowed_transitions(["O", "B-PER", "I-PER", "B-PER"], "BIO")


@pytest.mark.parametrize(
    "label, scheme, prefixes",
    [
        ("E-PER", "BIO", "B, I"),
        ("X-PER", "BIO", "B, I"),
        ("<pad>", "BIO", "B, I"),
        ("PER", "BIO", "B, I"),
        ("B", "BIO", "B, I"),  # untyped only under BMES
        ("B-", "BIO", "B, I"),  # empty type
        ("b-PER", "BIO", "B, I"),  # prefixes are case-sensitive
        ("O-PER", "BIO", "B, I"),
        ("S-PER", "IOB1", "I, B"),
        ("M-PER", "BIOES", "B, I, E, S"),
        ("I-PER", "BMES", "B, M, E, S"),
        ("X", "BMES", "B, M, E, S"),
    ],
)
def test_invalid_label(label, scheme, prefixes):
    with pytest.raises(ValueError) as info:
        allowed_transitions(["O", label], scheme)
    msg = str(info.value)
    assert repr(label) in msg
    assert prefixes in msg
    assert scheme in msg


@pytest.mark.parametrize("labels", ["O B-PER", ["O", 1], ["O", None], 5, [b"O"]])
def test_labels_type_error(labels):
    with pytest.raises(TypeError, match="labels must be a sequence of str"):
        allowed_transitions(labels, "BIO")


def test_labels_other_sequence_types():
    c = allowed_transitions(("O", "B-PER"), "BIO")
    assert c.labels == ("O", "B-PER")


def test_equality():
    a = allowed_transitions(LABEL_SETS["BIO"], "BIO")
    b = allowed_transitions(LABEL_SETS["BIO"], "IOB2")
    assert a == b and hash(a) == hash(b)
    assert a != allowed_transitions(LABEL_SETS["BIO"], "IOB1")


# ---------------------------------------------------------------------------
# Property-based: random label subsets
# ---------------------------------------------------------------------------

_TYPES = ["PER", "LOC", "PER-X"]


def _universe(scheme):
    prefixes = constraints._PREFIXES[scheme]
    labels = ["O"] + [f"{p}-{t}" for t in _TYPES for p in prefixes]
    if scheme == "BMES":
        labels += list(prefixes)
    return labels


@st.composite
def scheme_and_labels(draw):
    scheme = draw(st.sampled_from(SCHEMES))
    universe = _universe(scheme)
    typed = [label for label in universe if "-" in label]
    first = draw(st.sampled_from(typed))
    rest = draw(st.lists(st.sampled_from(universe), unique=True, max_size=len(universe)))
    labels = [first] + [label for label in rest if label != first]
    labels = draw(st.permutations(labels))
    seqs = draw(
        st.lists(
            st.lists(st.integers(0, len(labels) - 1), min_size=1, max_size=6),
            min_size=1,
            max_size=20,
        )
    )
    return scheme, list(labels), seqs


@settings(max_examples=150, deadline=None)
@given(scheme_and_labels())
def test_random_label_subsets_consistent(data):
    scheme, labels, seqs = data
    c = allowed_transitions(labels, scheme)
    T = len(labels)
    assert c.transitions.shape == (T, T) and c.start.shape == (T,)

    # 1. Constraints depend only on the labels involved: a subset in any order
    #    is the matching sub-matrix of the full label set.
    full_labels = _universe(scheme)
    full = allowed_transitions(full_labels, scheme)
    idx = torch.tensor([full_labels.index(label) for label in labels])
    assert torch.equal(c.transitions, full.transitions[idx][:, idx])
    assert torch.equal(c.start, full.start[idx])
    assert torch.equal(c.end, full.end[idx])

    # 2. With O present: a tag may start a sentence iff it may follow O,
    #    and may end one iff O may follow it.
    if "O" in labels:
        o = labels.index("O")
        assert torch.equal(c.start, c.transitions[o])
        assert torch.equal(c.end, c.transitions[:, o])

    # 3. Random sequences agree with the regex reference.
    for seq in seqs:
        assert c.is_allowed(seq) == reference_valid(scheme, labels, seq)

    # 4. A minimal one-chunk sentence is allowed for every type whose
    #    chunk-opening labels are present.
    single = {"BIO": ["B"], "IOB1": ["I"], "BIOES": ["S"], "BMES": ["S"]}[scheme]
    for label in labels:
        prefix, _, typ = label.partition("-")
        if prefix in single:
            assert c.is_allowed([labels.index(label)])
        pair = (f"B-{typ}" if typ else "B", f"E-{typ}" if typ else "E")
        if scheme in ("BIOES", "BMES") and prefix == "B" and pair[1] in labels:
            assert c.is_allowed([labels.index(pair[0]), labels.index(pair[1])])
