"""Word-shape (casing) classes: the capitalisation cue that uncased encoders and lowercased word
vectors lose.

    casing_ids(["EU", "rejects", "German", "1996", "McDonald", "-"])
    # [UPPER, LOWER, TITLE, NUMERIC, MIXED, OTHER]

Every tagger in crfkit.taggers embeds these classes (a small learned table) beside its word
features. The classes follow the casing feature of Reimers & Gurevych's BiLSTM-CRF tagger
(numeric, mainly numeric, all lower, all upper, initial upper, other), with "contains a digit"
and "punctuation / other" kept apart.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

__all__ = ["CASING_CLASSES", "NUM_CASING_CLASSES", "PAD_CASING", "casing_id", "casing_ids", "casing_tensor"]

# Index 0 is padding (never produced for a real word).
CASING_CLASSES = ("<pad>", "lower", "title", "upper", "mixed", "numeric", "has_digit", "other")
NUM_CASING_CLASSES = len(CASING_CLASSES)
PAD_CASING = 0
_LOWER, _TITLE, _UPPER, _MIXED, _NUMERIC, _HAS_DIGIT, _OTHER = range(1, NUM_CASING_CLASSES)


def casing_id(word: str) -> int:
    """The casing class of one word (an index into CASING_CLASSES, never 0)."""
    if not isinstance(word, str):
        raise TypeError(f"word must be a str, got {type(word).__name__}")
    return _casing_class(word)


# Cached because featurizing calls it for every word and a corpus repeats its words: uncached it
# was a tenth of a BiLSTM tagger's predict time. 2**16 words: about 10 MB at most.
@functools.lru_cache(maxsize=2 ** 16)
def _casing_class(word: str) -> int:
    digits = sum(c.isdigit() for c in word)
    if word and digits == len(word):
        return _NUMERIC
    if digits:
        return _HAS_DIGIT
    letters = [c for c in word if c.isalpha()]
    if not letters:
        return _OTHER
    if all(c.islower() for c in letters):
        return _LOWER
    if all(c.isupper() for c in letters):
        # A single capital letter ("A", "U.") reads like a title-cased word.
        return _UPPER if len(letters) > 1 else _TITLE
    if letters[0].isupper() and all(c.islower() for c in letters[1:]):
        return _TITLE
    return _MIXED


def casing_ids(words: Sequence[str]) -> list[int]:
    """Casing classes of a sentence's words: (n,) ints in 1 .. NUM_CASING_CLASSES - 1."""
    return [casing_id(w) for w in words]


def casing_tensor(sentences: Sequence[Sequence[str]], length: int) -> torch.Tensor:
    """(B, length) int64 casing classes of B sentences, PAD_CASING past each sentence's end."""
    casing = torch.full((len(sentences), length), PAD_CASING, dtype=torch.long)
    for b, s in enumerate(sentences):
        if s:
            casing[b, :len(s)] = torch.tensor(casing_ids(s), dtype=torch.long)
    return casing
