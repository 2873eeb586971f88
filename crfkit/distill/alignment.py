"""Sub-word to word alignment, so that a word-piece teacher and a word-level student meet at the
same positions.

A fast tokenizer called with ``is_split_into_words=True`` says, for every piece, which word it
came from (``encoding.word_ids(i)``: None for special tokens such as [CLS] / [SEP] / padding).
From that:

    encoding = tokenizer(words_batch, is_split_into_words=True, padding=True, return_tensors="pt")
    word_index = word_index_from_word_ids(encoding)                    # (B, P), -1 = no word
    teacher_logits = teacher(**encoding).logits                        # (B, P, T)
    word_logits, word_mask = align_to_words(teacher_logits, word_index, reduce="first")  # (B, W, T), (B, W)
    piece_labels = align_labels_to_pieces(word_tags, word_index)      # (B, P), -100 off first pieces

Reductions over the pieces of a word: "first" (BERT's convention for tagging: the first piece
stands for the word), "mean", "max" (element-wise; the DistillBiDAF report, a Stanford CS224N
project report on distilling BERT into BiDAF, found max best for span logits).
All three are vectorised scatter / gather operations and differentiable: with "first" only the
first piece of each word receives gradient, with "mean" each of a word's k pieces receives 1/k of
it, with "max" the piece holding the maximum (per feature) receives it (ties share it equally,
as torch.scatter_reduce does).

Conventions: the pieces of one word need not be contiguous, and word indices may skip words (a
word that the tokenizer turned into no piece, e.g. a lone control character, or words cut off by
truncation): such a word has no piece, its values are zero and its mask is False. Only
single-sequence encodings are meant; for sentence pairs, word ids restart in the second sequence,
so use ``encoding.sequence_ids(i)`` to set the other sequence's entries to -1 first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch

from .._validation import check_choice, check_int

__all__ = [
    "REDUCTIONS",
    "align_labels_to_pieces",
    "align_to_words",
    "first_piece_mask",
    "word_index_from_word_ids",
]

REDUCTIONS = ("first", "mean", "max")


def word_index_from_word_ids(word_ids_batch, num_pieces: Optional[int] = None) -> torch.Tensor:
    """Word ids of a batch of tokenized sentences as one padded tensor.

    word_ids_batch: a BatchEncoding from a fast tokenizer (its ``word_ids(i)`` is read for every
        sentence i), or a sequence of B lists, each with one entry per piece: the index of the word
        the piece belongs to, or None for special tokens and padding.
    num_pieces: P, the padded number of pieces (the teacher's sequence length); default the
        longest list. Lists shorter than P are padded with -1; a longer one is an error.

    Returns word_index: (B, P) int64, the word of each piece, -1 for special tokens and padding.
    """
    if hasattr(word_ids_batch, "word_ids") and callable(word_ids_batch.word_ids):
        encoding = word_ids_batch
        if not getattr(encoding, "is_fast", True) or getattr(encoding, "encodings", None) is None:
            raise TypeError("word_ids_batch: word ids need a fast tokenizer's BatchEncoding (use_fast=True)")
        word_ids_batch = [encoding.word_ids(i) for i in range(len(encoding.encodings))]
    if isinstance(word_ids_batch, (str, bytes)) or not isinstance(word_ids_batch, Sequence):
        raise TypeError(
            f"word_ids_batch must be a BatchEncoding or a sequence of lists, got {type(word_ids_batch).__name__}"
        )
    longest = max((len(ids) for ids in word_ids_batch), default=0)
    if num_pieces is None:
        num_pieces = longest
    else:
        check_int("num_pieces", num_pieces, minimum=0, type_error=ValueError)
    if longest > num_pieces:
        raise ValueError(f"num_pieces={num_pieces} is shorter than the longest word-id list ({longest})")
    # Building the (B, P) table is the one Python loop; it runs once per batch, at tokenization.
    word_index = torch.full((len(word_ids_batch), num_pieces), -1, dtype=torch.int64)
    for row, ids in enumerate(word_ids_batch):
        values = [-1 if word is None else word for word in ids]
        if any(not isinstance(word, int) or word < 0 for word in values if word != -1):
            raise ValueError(f"word_ids_batch[{row}]: word ids must be non-negative ints or None, got {list(ids)}")
        if values:
            word_index[row, : len(values)] = torch.tensor(values, dtype=torch.int64)
    return word_index


def _check_word_index(word_index: torch.Tensor, batch: int, pieces: int) -> None:
    if not isinstance(word_index, torch.Tensor):
        raise TypeError(f"word_index must be a torch.Tensor, got {type(word_index).__name__}")
    if word_index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"word_index must be an int64 (or int32) tensor, got {word_index.dtype}")
    if tuple(word_index.shape) != (batch, pieces):
        raise ValueError(f"word_index must have shape (B, P) = {(batch, pieces)}, got {tuple(word_index.shape)}")
    if word_index.numel() and int(word_index.min()) < -1:
        raise ValueError("word_index: entries must be a word index >= 0, or -1 for no word")


def _resolve_num_words(num_words, word_index: torch.Tensor) -> int:
    """W from num_words = None, an int or a (B,) tensor of per-sentence word counts (checked
    against word_index: no piece may belong to a word beyond its sentence's count)."""
    most_words_seen = int(word_index.max()) + 1 if word_index.numel() else 0
    if num_words is None:
        return most_words_seen
    if isinstance(num_words, bool):
        raise TypeError("num_words must be None, an int or a (B,) integer tensor, got a bool")
    if isinstance(num_words, int):
        if num_words < 0:
            raise ValueError(f"num_words must be non-negative, got {num_words}")
        if most_words_seen > num_words:
            raise ValueError(f"num_words={num_words} but word_index refers to word {most_words_seen - 1}")
        return num_words
    if isinstance(num_words, torch.Tensor):
        if num_words.dtype.is_floating_point or num_words.dtype == torch.bool or num_words.dim() != 1:
            raise TypeError(f"num_words as a tensor must be (B,) integer, "
                            f"got {num_words.dtype} {tuple(num_words.shape)}")
        if num_words.shape[0] != word_index.shape[0]:
            raise ValueError(f"num_words has {num_words.shape[0]} entries for a batch of {word_index.shape[0]}")
        lengths = num_words.to(device=word_index.device, dtype=torch.int64)
        if lengths.numel() and int(lengths.min()) < 0:
            raise ValueError("num_words: counts must be non-negative")
        if bool((word_index >= lengths[:, None]).any()):
            raise ValueError("word_index refers to a word at or beyond num_words[b] in some sentence b")
        return int(lengths.max()) if lengths.numel() else 0
    raise TypeError(f"num_words must be None, an int or a (B,) integer tensor, got {type(num_words).__name__}")


def align_to_words(
    piece_values: torch.Tensor,
    word_index: torch.Tensor,
    num_words: Union[None, int, torch.Tensor] = None,
    reduce: str = "first",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool piece-level values (teacher logits or hidden states) onto words.

    piece_values: (B, P, D) or (B, P), floating point.
    word_index: (B, P) int64 from word_index_from_word_ids: the word of each piece, -1 for none.
    num_words: W, the number of word positions to return: None -> one more than the largest word
        index; an int; or a (B,) tensor of per-sentence word counts (W = its max; the student's
        sentence lengths, so that words cut off by the teacher's truncation still get a slot).
    reduce: "first", "mean" or "max" over the pieces of each word.

    Returns (word_values, word_mask):
        word_values: (B, W, D) (or (B, W) for 2-D input), zero where a word has no piece;
        word_mask: (B, W) bool, True where the word has at least one piece.
    """
    if not isinstance(piece_values, torch.Tensor):
        raise TypeError(f"piece_values must be a torch.Tensor, got {type(piece_values).__name__}")
    if not piece_values.dtype.is_floating_point:
        raise TypeError(f"piece_values must be floating point, got {piece_values.dtype}")
    if piece_values.dim() not in (2, 3):
        raise ValueError(f"piece_values must be (B, P, D) or (B, P), got shape {tuple(piece_values.shape)}")
    check_choice("reduce", reduce, REDUCTIONS)
    squeeze = piece_values.dim() == 2
    values = piece_values.unsqueeze(-1) if squeeze else piece_values
    batch, pieces, features = values.shape
    _check_word_index(word_index, batch, pieces)
    word_index = word_index.to(device=values.device, dtype=torch.int64)
    width = _resolve_num_words(num_words, word_index)

    is_word_piece = word_index >= 0                                                  # (B, P)
    # Flatten (sentence, word) into one slot index; pieces of no word go to an extra slot
    # (batch * width) that is dropped at the end, so padding never reaches a real word.
    sentence = torch.arange(batch, device=values.device)[:, None]
    slot = torch.where(is_word_piece, sentence * width + word_index, torch.full_like(word_index, batch * width))
    slot = slot.reshape(-1)                                                         # (B*P,)
    slots = batch * width + 1

    piece_count = torch.zeros(slots, dtype=torch.int64, device=values.device)
    piece_count.index_add_(0, slot, torch.ones_like(slot))
    # Every piece's word is below num_words[b] (checked), so a word with a piece is a real word.
    word_mask = (piece_count[:-1] > 0).reshape(batch, width)

    flat_values = values.reshape(batch * pieces, features)
    if reduce == "first":
        # The first piece of a word is the smallest piece position mapped to it; gathering that
        # one row sends the whole gradient to it and none to the word's other pieces.
        position = torch.arange(batch * pieces, device=values.device)
        first_position = torch.full((slots,), batch * pieces, dtype=torch.int64, device=values.device)
        first_position.scatter_reduce_(0, slot, position, reduce="amin", include_self=True)
        first_position = first_position[:-1].clamp(max=max(batch * pieces - 1, 0))
        if batch * pieces == 0:
            word_values = values.new_zeros(batch * width, features)
        else:
            word_values = flat_values.index_select(0, first_position)
        # where, not a product: a word with no piece points at an arbitrary row, which may hold
        # anything (even inf in padding); it must give exactly zero and no gradient.
        word_values = torch.where(word_mask.reshape(-1, 1), word_values, word_values.new_zeros(()))
    else:
        # include_self=False: a slot's initial zero takes no part in the mean / max, and a word
        # with no piece keeps it.
        target = values.new_zeros(slots, features)
        index = slot[:, None].expand(-1, features)
        pooled = target.scatter_reduce(0, index, flat_values, reduce="mean" if reduce == "mean" else "amax",
                                       include_self=False)
        word_values = pooled[:-1]
    word_values = word_values.reshape(batch, width, features)
    return (word_values.squeeze(-1) if squeeze else word_values), word_mask


def first_piece_mask(word_index: torch.Tensor) -> torch.Tensor:
    """(B, P) bool: True at the first piece (smallest position) of every word.

    word_index: (B, P) int64, -1 for no word.
    """
    if not isinstance(word_index, torch.Tensor) or word_index.dim() != 2:
        raise TypeError("word_index must be a (B, P) integer tensor")
    _check_word_index(word_index, word_index.shape[0], word_index.shape[1])
    word_index = word_index.to(torch.int64)
    batch, pieces = word_index.shape
    width = int(word_index.max()) + 1 if word_index.numel() else 0
    position = torch.arange(pieces, device=word_index.device).expand(batch, -1)
    # Same sentinel-slot trick as align_to_words: column `width` collects the pieces of no word.
    column = torch.where(word_index >= 0, word_index, torch.full_like(word_index, width))
    first = torch.full((batch, width + 1), pieces, dtype=torch.int64, device=word_index.device)
    first.scatter_reduce_(1, column, position, reduce="amin", include_self=True)
    return (word_index >= 0) & (first.gather(1, column) == position)


def align_labels_to_pieces(
    word_labels,
    word_index: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_all_pieces: bool = False,
) -> torch.Tensor:
    """Word-level labels spread onto pieces, for training a word-piece teacher.

    word_labels: (B, W) integer tensor, or a sequence of B sequences of int (ragged: sentence b
        has len(word_labels[b]) words).
    word_index: (B, P) int64 from word_index_from_word_ids, -1 for no word.
    ignore_index: the label of the pieces that take no part in the loss (the default -100 is
        what torch.nn.functional.cross_entropy ignores).
    label_all_pieces: False (default) labels only the first piece of each word and gives the
        others ignore_index; True gives every piece its word's label.

    Returns piece_labels: (B, P) int64.
    """
    if isinstance(word_labels, torch.Tensor):
        if word_labels.dim() != 2 or word_labels.dtype.is_floating_point or word_labels.dtype == torch.bool:
            raise TypeError(f"word_labels as a tensor must be (B, W) integer, "
                            f"got {word_labels.dtype} {tuple(word_labels.shape)}")
        labels = word_labels.to(torch.int64)
        lengths = torch.full((labels.shape[0],), labels.shape[1], dtype=torch.int64)
    elif isinstance(word_labels, Sequence) and not isinstance(word_labels, (str, bytes)):
        lengths = torch.tensor([len(row) for row in word_labels], dtype=torch.int64)
        width = int(lengths.max()) if len(word_labels) else 0
        labels = torch.full((len(word_labels), width), ignore_index, dtype=torch.int64)
        for row, values in enumerate(word_labels):
            if len(values):
                labels[row, : len(values)] = torch.as_tensor(values, dtype=torch.int64)
    else:
        raise TypeError(f"word_labels must be a (B, W) tensor or a sequence of sequences, "
                        f"got {type(word_labels).__name__}")
    if not isinstance(word_index, torch.Tensor):
        raise TypeError(f"word_index must be a torch.Tensor, got {type(word_index).__name__}")
    if word_index.dim() != 2 or word_index.shape[0] != labels.shape[0]:
        raise ValueError(f"word_index must be (B, P) with B = {labels.shape[0]}, got {tuple(word_index.shape)}")
    _check_word_index(word_index, *word_index.shape)
    word_index = word_index.to(torch.int64)
    labels, lengths = labels.to(word_index.device), lengths.to(word_index.device)
    if bool((word_index >= lengths[:, None]).any()):
        raise ValueError("word_index refers to a word beyond the labels given for its sentence")

    has_word = word_index >= 0
    piece_labels = labels.gather(1, word_index.clamp(min=0)) if labels.shape[1] else torch.zeros_like(word_index)
    keep = has_word if label_all_pieces else first_piece_mask(word_index)
    return torch.where(keep, piece_labels, torch.full_like(piece_labels, ignore_index))
