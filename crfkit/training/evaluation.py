"""Scoring and timing a trained tagger on sentences (outside the Trainer).

    scores = evaluate_tagger(tagger, test_sentences)          # entity P / R / F1 (fractions)
    speed = tagging_throughput(tagger, token_lists)           # sentences per second
    rows = side_by_side_throughput([teacher, student], token_lists)   # interleaved rounds
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from .metrics import entity_scores

__all__ = ["evaluate_tagger", "tagging_throughput", "side_by_side_throughput"]


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


def side_by_side_throughput(taggers: Sequence, token_lists: Sequence[Sequence[str]], batch_size: int = 32,
                            rounds: int = 3, min_seconds: float = 2.0) -> list[dict]:
    """The taggers' speeds measured side by side: `rounds` rounds, each timing every tagger once
    with tagging_throughput in the order given. A machine shared with other work drifts over
    minutes, so the ratio to the first tagger is taken within each round, then its median over
    rounds. Returns one dict per tagger: "sentences_per_s" (the median over rounds), "rounds"
    (each round's speed), "vs_first" (the median over rounds of speed / the first tagger's speed
    in that round) and "vs_first_range" ([lowest, highest] of those ratios)."""
    if not taggers:
        raise ValueError("taggers must not be empty")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    speeds: list[list[float]] = [[] for _ in taggers]
    for _ in range(rounds):
        for tagger, measured in zip(taggers, speeds):
            measured.append(tagging_throughput(tagger, token_lists, batch_size, min_seconds)["sentences_per_s"])
    rows = []
    for measured in speeds:
        ratios = [s / f for s, f in zip(measured, speeds[0])]
        rows.append({"sentences_per_s": statistics.median(measured), "rounds": measured,
                     "vs_first": statistics.median(ratios), "vs_first_range": [min(ratios), max(ratios)]})
    return rows
