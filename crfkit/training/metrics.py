"""Entity-level precision, recall and F1 with seqeval (strict matching in the tagger's scheme, word
level).

    entity_scores([["B-PER", "I-PER", "O"]], [["B-PER", "O", "O"]])
    # {'precision': 0.0, 'recall': 0.0, 'f1': 0.0, 'entities': 1}

Strict mode counts an entity as found only when its type and exact span match, and treats a
span that breaks the scheme (e.g. an I- without its B-) as no entity; the taggers' CRFs are
constrained to the scheme, so their output is always well formed.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Optional

import numpy as np

from .._optional import require

__all__ = ["entity_scores", "make_compute_metrics", "paths_to_tags"]


# crfkit's scheme names (crfkit.constraints.SCHEMES and aliases) -> seqeval's
_SEQEVAL_SCHEMES = {"BIO": "IOB2", "IOB2": "IOB2", "IOB1": "IOB1", "BIOES": "IOBES", "IOBES": "IOBES",
                    "BMES": "IOBES"}


def entity_scores(gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]],
                  scheme: Optional[str] = "IOB2") -> dict[str, float]:
    """Micro-averaged entity precision / recall / F1 (fractions in [0, 1]) over sentences of tag
    names, and the number of gold entities. scheme: "BIO" / "IOB2", "IOB1", "BIOES" / "IOBES" or
    "BMES" (scored as BIOES, M- read as I-), matched strictly; None (an unconstrained tagger):
    seqeval's lenient default mode (conlleval's rules)."""
    metrics = require("seqeval.metrics", "pip install seqeval")
    schemes = require("seqeval.scheme", "pip install seqeval")
    if len(gold) != len(predicted):
        raise ValueError(f"gold has {len(gold)} sentences, predicted {len(predicted)}")
    for i, (g, p) in enumerate(zip(gold, predicted)):
        if len(g) != len(p):
            raise ValueError(f"sentence {i}: {len(g)} gold tags but {len(p)} predicted")
    gold, predicted = [list(g) for g in gold], [list(p) for p in predicted]
    if scheme is not None and scheme.upper() == "BMES":
        gold, predicted = ([[("I" + t[1:]) if t.startswith("M-") else t for t in s] for s in tags]
                           for tags in (gold, predicted))
    if scheme is None:
        kwargs = {"zero_division": 0}
    else:
        if scheme.upper() not in _SEQEVAL_SCHEMES:
            raise ValueError(f"scheme must be one of {', '.join(_SEQEVAL_SCHEMES)} or None, got {scheme!r}")
        kwargs = {"mode": "strict", "scheme": getattr(schemes, _SEQEVAL_SCHEMES[scheme.upper()]), "zero_division": 0}
    with warnings.catch_warnings():
        # With no entity in gold or predicted, seqeval's macro average is a mean over no types;
        # numpy warns about it, the micro scores read below are still the defined zeros.
        warnings.filterwarnings("ignore", "Mean of empty slice", RuntimeWarning)
        warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
        report = metrics.classification_report(gold, predicted, output_dict=True, **kwargs)
    micro = report["micro avg"]
    return {"precision": float(micro["precision"]), "recall": float(micro["recall"]),
            "f1": float(micro["f1-score"]), "entities": int(micro["support"])}


def paths_to_tags(paths: np.ndarray, labels: Sequence[str], reference: np.ndarray) -> list[list[str]]:
    """(N, L) tag indices -> tag-name lists, keeping the positions where reference >= 0
    (reference: (N, L) gold indices padded with -100, which marks each sentence's length)."""
    return [[labels[int(t)] for t, r in zip(row, ref) if r >= 0] for row, ref in zip(paths, reference)]


def make_compute_metrics(labels: Sequence[str], scheme: Optional[str] = "IOB2"):
    """A transformers Trainer compute_metrics: EvalPrediction(predictions = decoded paths (N, L),
    label_ids = gold (N, L), both padded with -100) -> {"precision", "recall", "f1"} in percent,
    scored under scheme (as entity_scores)."""
    labels = list(labels)

    def compute_metrics(prediction) -> dict[str, float]:
        gold = np.asarray(prediction.label_ids)
        paths = np.asarray(prediction.predictions)
        scores = entity_scores(paths_to_tags(gold, labels, gold), paths_to_tags(paths, labels, gold), scheme)
        return {"precision": 100 * scores["precision"], "recall": 100 * scores["recall"], "f1": 100 * scores["f1"]}

    return compute_metrics
