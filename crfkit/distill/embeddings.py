"""Teacher embedding transfer (TE) and SVD reduction of an embedding table.

TE, a student reusing the teacher's input embeddings, comes from the multi-grained distillation
paper (Zhou et al., *Multi-Grained Knowledge Distillation for Named Entity Recognition*, NAACL
2021); the SVD reduction from the multi-stage distillation paper (Mukherjee and Awadallah,
*Multi-Stage Distillation Framework for Massive Multi-lingual NER*, 2020). References:
docs/METHODS.md.

A word-level student meets a word-piece teacher:

    from transformers import AutoTokenizer, AutoModel
    tokenizer = AutoTokenizer.from_pretrained(path)
    teacher_table = AutoModel.from_pretrained(path).embeddings.word_embeddings.weight   # (V_t, D)
    words = crfkit.data.Vocabulary.from_sentences(train)                               # student vocabulary
    embedding = torch.nn.Embedding(len(words), teacher_table.shape[1], padding_idx=words.pad_index)
    report = transfer_embeddings(embedding, teacher_table, words, tokenizer, freeze=True)
    report.coverage                                         # fraction of the student's words given a row

    # as in the multi-stage paper: a narrower student, from the teacher table reduced to E dimensions
    small = torch.nn.Embedding(len(words), 128, padding_idx=words.pad_index)
    transfer_embeddings(small, svd_reduce(teacher_table, 128), words, tokenizer)

How a student word gets its row: the word is split by the teacher's tokenizer; a word that is one
piece takes that piece's row; a word of several pieces takes the mean of its pieces' rows
(``multi_piece="mean"``; "first" takes the first piece's row, "skip" leaves such words alone).
The mean is a choice of crfkit (the multi-grained paper does not say how it handled words the
teacher splits): it is the simplest pooling that uses every piece, and it matches
``align_to_words(reduce="mean")``.
A word whose pieces include the teacher's unknown token, or a piece missing from the teacher's
vocabulary, gets no row and is reported as missing; rows not transferred (and the padding row)
keep the student's own initialisation. Because the reduction is linear, transferring from
svd_reduce(table) equals reducing the transferred rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from crfkit.data import Vocabulary

from .._validation import check_bool, check_choice, check_int

__all__ = ["MULTI_PIECE", "TransferReport", "svd_reduce", "teacher_word_vectors", "transfer_embeddings"]

MULTI_PIECE = ("mean", "first", "skip")


@dataclass(frozen=True)
class TransferReport:
    """What transfer_embeddings did, over the student's vocabulary.

    single_piece / multi_piece: words copied from one teacher piece / pooled from several.
    special: rows set from ``special_tokens``. skipped: rows not attempted (the padding row and a
    crfkit Vocabulary's pad / unk tokens that special_tokens does not map). missing: the words
    that got no teacher row. transferred: (V_s,) bool, the rows that were written.
    """

    single_piece: int
    multi_piece: int
    special: int
    skipped: tuple[str, ...]
    missing: tuple[str, ...]
    transferred: torch.Tensor = field(repr=False)

    @property
    def attempted(self) -> int:
        """Words that were looked up (the vocabulary less the skipped rows)."""
        return self.single_piece + self.multi_piece + self.special + len(self.missing)

    @property
    def coverage(self) -> float:
        """Fraction of the looked-up words that received a teacher row."""
        return (self.attempted - len(self.missing)) / self.attempted if self.attempted else 0.0


def _index_mapping(vocabulary, name: str) -> dict[str, int]:
    """A str -> index dict from a crfkit Vocabulary, a mapping, or a sequence of str (index =
    position)."""
    if isinstance(vocabulary, Vocabulary):
        return vocabulary.to_dict()
    if isinstance(vocabulary, Mapping):
        return dict(vocabulary)
    if isinstance(vocabulary, Sequence) and not isinstance(vocabulary, (str, bytes)):
        return {item: index for index, item in enumerate(vocabulary)}
    raise TypeError(f"{name} must be a Vocabulary, a str -> int mapping or a sequence of str, "
                    f"got {type(vocabulary).__name__}")


def _teacher_lookup(teacher_vocab, teacher_tokenize, unk_token):
    """(piece -> row dict, tokenize callable or None, unk token or None); a Hugging Face tokenizer
    supplies all three."""
    if hasattr(teacher_vocab, "get_vocab") and hasattr(teacher_vocab, "tokenize"):
        tokenizer = teacher_vocab
        return (tokenizer.get_vocab(), teacher_tokenize or tokenizer.tokenize,
                unk_token if unk_token is not None else getattr(tokenizer, "unk_token", None))
    if teacher_tokenize is not None and not callable(teacher_tokenize):
        raise TypeError(f"teacher_tokenize must be callable (str -> list of pieces), "
                        f"got {type(teacher_tokenize).__name__}")
    return _index_mapping(teacher_vocab, "teacher_vocab"), teacher_tokenize, unk_token


def teacher_word_vectors(
    words: Sequence[str],
    teacher_weight: torch.Tensor,
    teacher_vocab,
    *,
    teacher_tokenize: Optional[Callable[[str], list[str]]] = None,
    multi_piece: str = "mean",
    unk_token: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher vectors for N words.

    words: N strings.
    teacher_weight: (V_t, D) the teacher's piece embedding table.
    teacher_vocab: a Hugging Face tokenizer (its vocabulary, tokenize and unk_token are used), or
        a piece -> row mapping / sequence of pieces; with the latter, pass teacher_tokenize to
        split words into pieces, or each word is looked up as it is.
    multi_piece: "mean", "first" or "skip" for words of several pieces.
    unk_token: the teacher's unknown piece; a word with it among its pieces is not found.

    Returns (vectors (N, D) in teacher_weight's dtype, zero where not found; found (N,) bool;
    num_pieces (N,) int64, 0 where not found).
    """
    if not isinstance(teacher_weight, torch.Tensor) or teacher_weight.dim() != 2:
        raise TypeError("teacher_weight must be a (V_t, D) tensor")
    check_choice("multi_piece", multi_piece, MULTI_PIECE)
    piece_rows, tokenize, unk_token = _teacher_lookup(teacher_vocab, teacher_tokenize, unk_token)
    vocabulary_size = teacher_weight.shape[0]

    # Python only gathers (word, piece row, weight) triples; the arithmetic is one index_add.
    word_positions, rows, shares = [], [], []
    num_pieces = torch.zeros(len(words), dtype=torch.int64)
    for position, word in enumerate(words):
        pieces = tokenize(word) if tokenize is not None else [word]
        if not pieces or (unk_token is not None and unk_token in pieces):
            continue
        if any(piece not in piece_rows for piece in pieces):
            continue
        if len(pieces) > 1:
            if multi_piece == "skip":
                continue
            if multi_piece == "first":
                pieces = pieces[:1]
        indices = [piece_rows[piece] for piece in pieces]
        if any(not 0 <= index < vocabulary_size for index in indices):
            raise ValueError(f"teacher_vocab maps a piece of {word!r} to a row outside teacher_weight "
                             f"({vocabulary_size} rows)")
        num_pieces[position] = len(indices)
        word_positions.extend([position] * len(indices))
        rows.extend(indices)
        shares.extend([1.0 / len(indices)] * len(indices))

    weight = teacher_weight.detach()
    vectors = weight.new_zeros(len(words), weight.shape[1])
    if rows:
        rows_tensor = torch.tensor(rows, dtype=torch.int64, device=weight.device)
        share_tensor = torch.tensor(shares, dtype=weight.dtype, device=weight.device)[:, None]
        positions = torch.tensor(word_positions, dtype=torch.int64, device=weight.device)
        vectors.index_add_(0, positions, weight.index_select(0, rows_tensor) * share_tensor)
    return vectors, num_pieces > 0, num_pieces


def transfer_embeddings(
    student_embedding: nn.Embedding,
    teacher_weight: torch.Tensor,
    student_vocab,
    teacher_vocab,
    freeze: bool = False,
    *,
    teacher_tokenize: Optional[Callable[[str], list[str]]] = None,
    multi_piece: str = "mean",
    unk_token: Optional[str] = None,
    special_tokens: Optional[Mapping[str, str]] = None,
) -> TransferReport:
    """Copy teacher rows into a word-level student's embedding table, in place.

    student_embedding: nn.Embedding (V_s, D); its rows for the student's words are overwritten.
    teacher_weight: (V_t, D) teacher piece embeddings (same width D; reduce a wider table with
        svd_reduce first).
    student_vocab: the student's word -> row map: a crfkit Vocabulary, a mapping or a sequence.
    teacher_vocab: a Hugging Face tokenizer, or a piece -> row mapping / sequence (then
        teacher_tokenize splits words; see teacher_word_vectors).
    freeze: True stops gradient to the whole table (the multi-grained paper's TE keeps the
        teacher's rows fixed; rows that were not transferred stay frozen at their initial values
        too).
    multi_piece: "mean" (default), "first" or "skip" for words the teacher splits.
    unk_token: the teacher's unknown piece (taken from the tokenizer when one is given).
    special_tokens: student token -> teacher piece for rows looked up directly, e.g.
        {"<unk>": "[UNK]"}.

    Returns a TransferReport (counts, missing words, coverage, the (V_s,) mask of written rows).
    """
    if not isinstance(student_embedding, nn.Embedding):
        raise TypeError(f"student_embedding must be a torch.nn.Embedding, got {type(student_embedding).__name__}")
    if not isinstance(teacher_weight, torch.Tensor) or teacher_weight.dim() != 2:
        raise TypeError("teacher_weight must be a (V_t, D) tensor")
    if not teacher_weight.dtype.is_floating_point:
        raise TypeError(f"teacher_weight must be floating point, got {teacher_weight.dtype}")
    student_size, width = student_embedding.weight.shape
    if teacher_weight.shape[1] != width:
        raise ValueError(
            f"teacher_weight has width {teacher_weight.shape[1]} but student_embedding has {width}; "
            f"reduce it first with svd_reduce(teacher_weight, {width})"
        )
    check_bool("freeze", freeze)
    student_rows = _index_mapping(student_vocab, "student_vocab")
    for word, row in student_rows.items():
        if not isinstance(row, int) or not 0 <= row < student_size:
            raise ValueError(f"student_vocab maps {word!r} to row {row!r}, outside the student's {student_size} rows")
    special_tokens = dict(special_tokens or {})
    piece_rows, _, _ = _teacher_lookup(teacher_vocab, teacher_tokenize, unk_token)

    skip_rows = set()
    if student_embedding.padding_idx is not None:
        skip_rows.add(student_embedding.padding_idx)
    if isinstance(student_vocab, Vocabulary):
        for token in (student_vocab.pad_token, student_vocab.unk_token):
            if token is not None and token not in special_tokens:
                skip_rows.add(student_rows[token])

    skipped, special_words, special_pieces, ordinary = [], [], [], []
    for word, row in student_rows.items():
        if row in skip_rows:
            skipped.append(word)
        elif word in special_tokens:
            special_words.append(word)
            special_pieces.append(special_tokens[word])
        else:
            ordinary.append(word)
    for word, piece in zip(special_words, special_pieces):
        if piece not in piece_rows:
            raise ValueError(f"special_tokens maps {word!r} to {piece!r}, which is not in the teacher's vocabulary")

    vectors, found, num_pieces = teacher_word_vectors(
        ordinary, teacher_weight, teacher_vocab, teacher_tokenize=teacher_tokenize,
        multi_piece=multi_piece, unk_token=unk_token,
    )
    target_rows = torch.tensor([student_rows[word] for word in ordinary], dtype=torch.int64)
    transferred = torch.zeros(student_size, dtype=torch.bool)
    with torch.no_grad():
        weight = student_embedding.weight
        if found.any():
            rows = target_rows[found].to(weight.device)
            weight.index_copy_(0, rows, vectors[found].to(device=weight.device, dtype=weight.dtype))
            transferred[target_rows[found]] = True
        if special_words:
            rows = torch.tensor([student_rows[word] for word in special_words], dtype=torch.int64)
            pieces = torch.tensor([piece_rows[piece] for piece in special_pieces], dtype=torch.int64)
            source = teacher_weight.detach().index_select(0, pieces.to(teacher_weight.device))
            weight.index_copy_(0, rows.to(weight.device), source.to(device=weight.device, dtype=weight.dtype))
            transferred[rows] = True
    if freeze:
        student_embedding.weight.requires_grad_(False)

    return TransferReport(
        single_piece=int((num_pieces == 1).sum()),
        multi_piece=int((num_pieces > 1).sum()),
        special=len(special_words),
        skipped=tuple(skipped),
        missing=tuple(word for word, ok in zip(ordinary, found.tolist()) if not ok),
        transferred=transferred,
    )


def svd_reduce(weight: torch.Tensor, dim: int, *, return_basis: bool = False):
    """Reduce an embedding table to ``dim`` columns by truncated SVD (as in the multi-stage paper).

    weight: (V, D) floating point; dim: E with 1 <= E <= min(V, D).

    With weight = U diag(S) Vh, returns reduced = U[:, :E] diag(S[:E]) = weight @ Vh[:E].T, shape
    (V, E): the coordinates of each row in the top-E right singular directions, so that
    reduced @ Vh[:E] is the best rank-E approximation of weight (Eckart-Young; the squared
    Frobenius error is the sum of the discarded S**2). With return_basis=True, returns
    (reduced (V, E), basis (E, D) = Vh[:E]) so new rows can be projected the same way.

    No centring (the multi-stage paper reduces the table itself). Signs are made deterministic:
    each basis row has its largest-magnitude entry positive, so the result does not depend on the
    LAPACK build. The SVD runs in float32 at least (float64 stays float64); the result has
    weight's dtype.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"weight must be a (V, D) floating-point tensor, got {weight.dtype} {tuple(weight.shape)}")
    check_int("dim", dim, minimum=1, maximum=min(weight.shape))  # 1 .. min(V, D)
    compute_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    matrix = weight.detach().to(compute_dtype)
    left, singular, right = torch.linalg.svd(matrix, full_matrices=False)
    left, singular, right = left[:, :dim], singular[:dim], right[:dim]
    largest = right.abs().argmax(dim=1, keepdim=True)
    signs = torch.sign(right.gather(1, largest))
    signs[signs == 0] = 1
    right = right * signs
    reduced = (left * signs.T) * singular
    reduced = reduced.to(weight.dtype)
    if return_basis:
        return reduced, right.to(weight.dtype)
    return reduced
