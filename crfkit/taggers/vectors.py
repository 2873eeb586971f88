"""Pretrained word vectors for word-level students, read from a file in word2vec text format.

    words, vectors = read_word2vec_text("vectors.txt")     # (N,) words, (N, D) float32

(GloVe 6B 50d as a package ships it, `glove_vectors()`, lives in crfkit.packaged; the names are
kept here for code written against this module.)
"""
from __future__ import annotations

import numpy as np

from .._optional import moved_to

__all__ = ["read_word2vec_text"]

# Kept for the code written against this module: these names live in crfkit.packaged now.
__getattr__ = moved_to("crfkit.packaged", ("GLOVE_INSTALL", "glove_vectors"), __name__)


def read_word2vec_text(path: str) -> tuple[list[str], np.ndarray]:
    """(words (N,), vectors (N, D) float32) of a word-vector file in word2vec text format: one
    word and its D numbers per line, separated by spaces, after an optional "N D" header line
    (GloVe's own .txt files have none). A line with another number of values, or values that are
    not numbers, is a ValueError naming the file and line; a word seen twice keeps its first row."""
    words, rows, seen, width = [], [], set(), None
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            parts = raw.decode("utf-8", errors="replace").rstrip("\r\n").split(" ")
            if line_number == 1 and len(parts) == 2 and all(p.isdigit() for p in parts):
                width = int(parts[1])   # the header: N D
                continue
            if not raw.strip():
                continue
            values = parts[1:]
            if width is None:
                width = len(values)
            if len(values) != width or not parts[0]:
                raise ValueError(f"{path}:{line_number}: expected a word and {width} numbers, got "
                                 f"{len(values)} value(s) after {parts[0][:40]!r}")
            try:
                row = [float(v) for v in values]
            except ValueError:
                raise ValueError(f"{path}:{line_number}: the values after {parts[0][:40]!r} are not all numbers") \
                    from None
            if parts[0] not in seen:
                seen.add(parts[0])
                words.append(parts[0])
                rows.append(row)
    if not words:
        raise ValueError(f"{path} holds no word vectors")
    return words, np.asarray(rows, dtype=np.float32)
