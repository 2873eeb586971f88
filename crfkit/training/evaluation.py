"""Scoring and timing a trained tagger on sentences (outside the Trainer).

    scores = evaluate_tagger(tagger, test_sentences)          # entity P / R / F1 (fractions)
    speed = tagging_throughput(tagger, token_lists)           # sentences per second
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .metrics import entity_scores

__all__ = ["evaluate_tagger", "tagging_throughput"]


def evaluate_tagger(tagger, sentences: Sequence, batch_size: int = 64) -> dict[str, float]:
    """Entity precision / recall / F1 (seqeval, strict, in the tagger's scheme) of tagger on
    sentences with gold tags (crfkit.data.Sentence)."""
    predicted = tagger.predict([s.tokens for s in sentences], batch_size=batch_size)
    return entity_scores([s.tags for s in sentences], predicted, getattr(tagger, "scheme", "BIO"))


def tagging_throughput(tagger, token_lists: Sequence[Sequence[str]], batch_size: int = 32,
                       min_seconds: float = 2.0) -> dict[str, float]:
    """Sentences per second of tagger.predict (featurization, encoder, Viterbi) over token_lists in
    order, batch_size at a time, after one warm-up batch; repeated until min_seconds have passed.
    Returns {"sentences_per_s", "seconds", "sentences", "batch_size", "threads"}."""
    token_lists = [list(t) for t in token_lists]
    if not token_lists:
        raise ValueError("token_lists must not be empty")
    tagger.predict(token_lists[:batch_size], batch_size=batch_size)
    done, begin = 0, time.perf_counter()
    while True:
        tagger.predict(token_lists, batch_size=batch_size)
        done += len(token_lists)
        elapsed = time.perf_counter() - begin
        if elapsed >= min_seconds:
            break
    return {"sentences_per_s": done / elapsed, "seconds": elapsed, "sentences": done, "batch_size": batch_size,
            "threads": torch.get_num_threads()}
