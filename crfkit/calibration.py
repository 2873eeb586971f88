"""Temperature scaling of a CRF, and the calibration error of entity probabilities.

    temperature = fit_temperature(emissions, transitions, gold_tags, lengths, start, end)   # on validation
    probabilities = crfkit.entities.entity_marginals(emissions / temperature, transitions / temperature,
                                                     labels, None, lengths, start / temperature, end / temperature)
    ece, table = entity_calibration_error(probabilities, correct, bins=10)

Temperature scaling (Guo et al., 2017, for a CRF): every score of the CRF (emissions, transitions,
start, end) is divided by one scalar T > 0, chosen to minimise the negative log-likelihood of the
gold tag sequences of held-out data. The decoded (Viterbi) sequence does not change (dividing every
sequence's score by T keeps their order); the probabilities do: T > 1 flattens an over-confident
CRF, T < 1 sharpens an under-confident one. Forbidden (-inf) scores stay forbidden.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor

from ._validation import check_int, check_number
from .functional import log_partition, sequence_score

__all__ = ["entity_calibration_error", "fit_temperature", "scaled_nll"]

_GOLDEN = (math.sqrt(5) - 1) / 2  # 0.618...

Batches = Union[Tensor, Sequence[Tensor]]


def _batches(emissions: Batches, tags: Batches, lengths) -> list[tuple[Tensor, Tensor, Optional[Tensor]]]:
    """(emissions, tags, lengths) per batch: one tensor each, or sequences of one tensor per batch."""
    if isinstance(emissions, Tensor):
        if not isinstance(tags, Tensor):
            raise TypeError(f"tags must be a tensor (batch, seq_len) like emissions, got {type(tags).__name__}")
        if lengths is not None and not isinstance(lengths, Tensor):
            raise TypeError(f"lengths must be a tensor (batch,) or None like emissions, got {type(lengths).__name__}")
        return [(emissions, tags, lengths)]
    if isinstance(emissions, (str, bytes)) or not isinstance(emissions, Sequence):
        raise TypeError("emissions must be a tensor (batch, seq_len, num_tags) or a sequence of such tensors, one "
                        f"per batch; got {type(emissions).__name__}")
    if isinstance(tags, Tensor) or not isinstance(tags, Sequence) or len(tags) != len(emissions):
        raise TypeError(f"tags must be a sequence of {len(emissions)} tensors, one per batch of emissions")
    if lengths is None:
        lengths = [None] * len(emissions)
    elif isinstance(lengths, Tensor) or not isinstance(lengths, Sequence) or len(lengths) != len(emissions):
        raise TypeError(f"lengths must be None or a sequence of {len(emissions)} tensors, one per batch of emissions")
    if not emissions:
        raise ValueError("emissions holds no batch: there is nothing to fit the temperature on")
    return list(zip(emissions, tags, lengths))


def scaled_nll(temperature: float, emissions: Batches, transitions: Tensor, tags: Batches, lengths=None,
               start: Optional[Tensor] = None, end: Optional[Tensor] = None) -> float:
    """The negative log-likelihood of the gold tags, summed over sentences, of the CRF with every
    score divided by temperature: sum_b log Z(x_b / T) - s(x_b, y_b) / T. Arguments as fit_temperature's."""
    temperature = check_number("temperature", temperature, minimum=0, open_minimum=True)
    total = 0.0
    with torch.no_grad():
        for em, tg, ln in _batches(emissions, tags, lengths):
            gold = sequence_score(em, transitions, tg, ln, start, end)
            total += _nll(temperature, em, transitions, ln, start, end, float(gold.double().sum()))
    return total


def _nll(temperature, emissions, transitions, lengths, start, end, gold_sum: float) -> float:
    scale = 1.0 / temperature
    log_z = log_partition(emissions * scale, transitions * scale, lengths,
                          None if start is None else start * scale, None if end is None else end * scale)
    return float(log_z.double().sum()) - scale * gold_sum


def fit_temperature(emissions: Batches, transitions: Tensor, tags: Batches, lengths=None,
                    start: Optional[Tensor] = None, end: Optional[Tensor] = None, *,
                    bounds: tuple[float, float] = (0.05, 20.0), tolerance: float = 1e-4) -> float:
    """The temperature T > 0 that minimises the gold-sequence negative log-likelihood of the CRF
    whose scores (emissions, transitions, start, end) are all divided by T.

    emissions (B, L, T), tags (B, L) gold tag indices and lengths (B,) as in crfkit.functional, or
    sequences of such tensors, one per batch (validation data in batches of different lengths);
    transitions (T, T), start, end (T,) shared by every batch. Returns T as a float.

    The search: a golden-section search over log T within bounds (default 0.05 .. 20), until the
    bracket is narrower than tolerance in log T (a relative precision of about tolerance on T;
    about 25 evaluations of log Z over the data for the defaults). Why: with beta = 1 / T the NLL
    sum_b log Z(beta * theta_b) - beta * s_b(y_b) is convex in beta (log Z is a log-sum-exp of the
    sequence scores, linear in beta), so it is unimodal in log T, and a bracketing search finds its
    minimum without gradients, learning rates or line searches, deterministically, in a number of
    evaluations fixed by the bracket and the tolerance. A minimum at a bound (the data ask for a
    temperature outside bounds) gives that bound and a warning.

    Raises ValueError when a gold sequence is forbidden by the CRF (its score is -inf: the NLL is
    infinite at every temperature) or when the data hold no word.
    """
    low, high = bounds if isinstance(bounds, (tuple, list)) and len(bounds) == 2 else (None, None)
    if low is None:
        raise TypeError(f"bounds must be a pair (low, high) of positive numbers, got {bounds!r}")
    low = check_number("bounds[0]", low, minimum=0, open_minimum=True)
    high = check_number("bounds[1]", high, minimum=0, open_minimum=True)
    if not low < high:
        raise ValueError(f"bounds must satisfy low < high, got {bounds!r}")
    tolerance = check_number("tolerance", tolerance, minimum=0, open_minimum=True)
    batches = _batches(emissions, tags, lengths)
    prepared, words = [], 0
    with torch.no_grad():
        for i, (em, tg, ln) in enumerate(batches):
            gold = sequence_score(em, transitions, tg, ln, start, end)  # checks every argument
            forbidden = (gold == float("-inf")).nonzero()
            if forbidden.numel():
                where = f"sentence {int(forbidden[0])}" + (f" of batch {i}" if len(batches) > 1 else "")
                raise ValueError(f"tags: the gold tag sequence of {where} is forbidden by the CRF (it scores -inf), "
                                 "so its likelihood is 0 at every temperature")
            words += int(ln.sum()) if ln is not None else em.shape[0] * em.shape[1]
            prepared.append((em, ln, float(gold.double().sum())))
    if words == 0:
        raise ValueError("the data hold no word: there is nothing to fit the temperature on")

    def objective(log_t: float) -> float:
        with torch.no_grad():
            return sum(_nll(math.exp(log_t), em, transitions, ln, start, end, gold) for em, ln, gold in prepared)

    a, b = math.log(low), math.log(high)
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = objective(c), objective(d)
    while b - a > tolerance:
        if fc <= fd:  # the minimum is in [a, d]
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = objective(c)
        else:         # the minimum is in [c, b]
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = objective(d)
    best = (a + b) / 2
    if best - math.log(low) < 2 * tolerance or math.log(high) - best < 2 * tolerance:
        warnings.warn(f"fit_temperature: the NLL is smallest at the edge of bounds {bounds!r} "
                      f"(T = {math.exp(best):.4g}); the best temperature may lie outside them", RuntimeWarning,
                      stacklevel=2)
    return math.exp(best)


def entity_calibration_error(probabilities, correct, bins: int = 10) -> tuple[float, list[dict[str, Any]]]:
    """Expected calibration error of predicted entities over equal-width probability bins.

    probabilities: (N,) the predicted entities' probabilities in [0, 1] (a tensor or a sequence of
    numbers); correct: (N,) whether each is a correct entity (bools or 0 / 1). Bin i of `bins` holds
    the probabilities p with i / bins <= p < (i + 1) / bins (the last bin also holds p = 1), i.e.
    bin floor(p * bins) computed in float64.

    Returns (ece, table): ece = sum over bins of count / N * |accuracy - mean probability| (0.0 when
    N = 0), and one dict per bin: {"low", "high", "count", "mean_probability", "accuracy"}, the
    last two None for an empty bin. JSON-ready (plain floats and ints).
    """
    check_int("bins", bins, minimum=1)
    p = _vector("probabilities", probabilities, torch.float64)
    hit = _vector("correct", correct, None)
    if hit.dtype != torch.bool:
        if not bool(((hit == 0) | (hit == 1)).all()):
            raise ValueError("correct must hold bools or 0 / 1 values")
        hit = hit != 0
    if p.shape != hit.shape:
        raise ValueError(f"probabilities and correct must have the same length, got {p.shape[0]} and {hit.shape[0]}")
    if p.numel() and not bool(((p >= 0) & (p <= 1)).all()):
        raise ValueError("probabilities must lie in [0, 1] (and not be NaN)")
    index = (p * bins).floor().long().clamp(max=bins - 1)
    n = p.numel()
    ece, table = 0.0, []
    for i in range(bins):
        in_bin = index == i
        count = int(in_bin.sum())
        mean_p = float(p[in_bin].mean()) if count else None
        accuracy = float(hit[in_bin].double().mean()) if count else None
        if count:
            ece += count / n * abs(accuracy - mean_p)
        table.append({"low": i / bins, "high": (i + 1) / bins, "count": count, "mean_probability": mean_p,
                      "accuracy": accuracy})
    return ece, table


def _vector(name: str, values, dtype) -> Tensor:
    if not isinstance(values, Tensor):
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"{name} must be a 1-D tensor or a sequence of numbers, got {type(values).__name__}")
        try:
            values = torch.tensor(list(values), dtype=dtype if dtype is not None else None)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name} must be a 1-D tensor or a sequence of numbers") from None
    if values.dim() != 1:
        raise ValueError(f"{name} must be 1-D (N,), got shape {tuple(values.shape)}")
    if values.is_complex():
        raise TypeError(f"{name} must be real, got {values.dtype}")
    values = values.detach().cpu()
    return values.to(dtype) if dtype is not None else values
