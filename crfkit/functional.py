"""crfkit's public operations on linear-chain CRFs: check the arguments, then run a backend.

Shapes (batch first):
    emissions    (B, L, T)  emissions[b, i, t]: score of tag t at position i of sentence b
    transitions  (T, T)     transitions[s, t]: score of moving from tag s to tag t
    start, end   (T,)       optional scores of the first / last tag (default 0)
    lengths      (B,)       optional integer lengths; sentence b is positions 0 .. lengths[b]-1
                            (default: all L). Padded positions are never read.
    tags         (B, L)     integer tag indices (values at padded positions are ignored)

Score of a tag sequence y of length n (n >= 1):
    s(y) = start[y_0] + emissions[0, y_0] + sum_{i>=1} (transitions[y_{i-1}, y_i] + emissions[i, y_i]) + end[y_{n-1}]

Conventions, the same in every backend:
- A score of -inf forbids a tag, a transition, a first or last tag, in EVERY operation
  (log Z, marginals, Viterbi, k-best); crfkit.constraints builds such masks for BIO / BIOES / ...
  NaN or +inf anywhere a score is read raises ValueError (RuntimeError from the raw ops).
  So do lengths outside [0, L] and tags outside [0, T) at real positions; with CUDA tensors
  the kernels report those once they have run (the values are not read back to the host
  first: that would wait for the GPU on every call).
- A length-0 sentence has exactly one tag sequence, the empty one, of score 0:
  log Z = 0, marginals 0, Viterbi path all -1 with score 0, k-best row 0 = that empty path
  (score 0, log_prob 0) and the other rows missing.
- If every sequence of a sentence is forbidden: log Z = -inf, marginals 0, gradients 0 (no NaN),
  Viterbi path -1 with score -inf, every k-best row missing.
- k-best rows that hold no sequence (fewer than k allowed sequences) have path -1 and
  score / log_prob -inf.
- Ties: sequences of equal score are ordered by their tags read from the LAST position
  backwards, smaller tag index first (so among all-equal scores, [1, 0] comes before [0, 1]).
  Viterbi returns the first sequence in that order, identical to k-best row 0.
- dtypes: float32 and float64 are computed as they are; float16 and bfloat16 emissions are
  computed in float32 and the results are float32. transitions / start / end must have the
  dtype of emissions, or float32 (or any half type) when emissions are half precision.
- Non-contiguous and expanded inputs are accepted (copied to contiguous memory first).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import backends

_HALF = (torch.float16, torch.bfloat16)


class KBest(NamedTuple):
    """Result of kbest_viterbi: paths (B, K, L) int64, scores (B, K), log_probs (B, K)."""

    paths: Tensor
    scores: Tensor
    log_probs: Tensor


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _check_tensor(name: str, x, dim: int, shape_text: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_text}, got {type(x).__name__}")
    if x.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions {shape_text}, got shape {tuple(x.shape)}")


def _prepare(emissions, transitions, lengths, start, end):
    """Validate the CRF arguments and return them ready for a backend:
    contiguous, in the compute dtype, start / end filled with zeros, lengths int64."""
    ready = _already_prepared(emissions, transitions, lengths, start, end)
    return ready if ready is not None else _prepare_checked(emissions, transitions, lengths, start, end)


def _prepare_checked(emissions, transitions, lengths, start, end):
    """_prepare for any arguments: converts what needs converting, raises on what is wrong."""
    _check_tensor("emissions", emissions, 3, "(batch, seq_len, num_tags)")
    if not emissions.is_floating_point():
        raise TypeError(f"emissions must be a floating-point tensor, got {emissions.dtype}")
    B, L, T = emissions.shape
    if T < 1:
        raise ValueError("emissions must have at least one tag (num_tags = emissions.shape[2] >= 1)")
    compute_dtype = torch.float32 if emissions.dtype in _HALF else emissions.dtype
    # Parameters share the emissions' dtype; with half-precision emissions they may also be
    # float32 (the usual mixed-precision setup) or the other half type.
    accepted = (torch.float32, *_HALF) if emissions.dtype in _HALF else (compute_dtype,)
    device = emissions.device

    def parameter(name, x, shape):
        if x is None:
            return _zeros(shape, compute_dtype, device)
        _check_tensor(name, x, len(shape), "(" + ", ".join(map(str, shape)) + ")")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for num_tags = {T}, got {tuple(x.shape)}")
        if x.dtype not in accepted:
            raise TypeError(
                f"{name} has dtype {x.dtype} but emissions has {emissions.dtype}; "
                f"expected {' or '.join(str(d) for d in accepted)}"
            )
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but emissions is on {device}; put them on one device")
        return _as_compute(x, compute_dtype)

    if transitions is None:
        raise TypeError("transitions is required: a (num_tags, num_tags) tensor")
    transitions = parameter("transitions", transitions, (T, T))
    start = parameter("start", start, (T,))
    end = parameter("end", end, (T,))
    lengths = _prepare_lengths(lengths, B, L, device)
    return _as_compute(emissions, compute_dtype), transitions, lengths, start, end


# The checks above run on every call; at small sizes (B = 1, short sentences) they cost more
# than the kernels, so the no-op conversions are skipped and the default start / end zeros are
# made once per (num_tags, dtype, device). They are never written to or returned.
_ZEROS: dict = {}
_FULL_PRECISION = (torch.float32, torch.float64)


def _already_prepared(emissions, transitions, lengths, start, end):
    """The arguments as _prepare returns them when they need no conversion and pass every
    check (the usual call: float32 / float64 tensors of the right shapes on one device, dense,
    int64 lengths in range); None otherwise, and _prepare_checked then converts them or raises
    its messages. The same checks, in one pass without the conversions: 4.6 us instead of 7.9
    per call (B = 32, 1 thread), where a whole Viterbi call at B = 1 takes 4.3 us in the op."""
    if not (isinstance(emissions, Tensor) and isinstance(transitions, Tensor)
            and emissions.dim() == 3 and emissions.dtype in _FULL_PRECISION):
        return None
    B, L, T = emissions.shape
    dtype, device = emissions.dtype, emissions.device
    given_lengths = lengths
    if lengths is None:
        lengths = torch.full((B,), L, dtype=torch.long, device=device)
    elif not isinstance(lengths, Tensor):
        return None
    if start is None:
        start = _zeros((T,), dtype, device)
    if end is None:
        end = _zeros((T,), dtype, device)
    if not (T >= 1 and isinstance(start, Tensor) and isinstance(end, Tensor)
            and transitions.shape == (T, T) and start.shape == (T,) and end.shape == (T,)
            and lengths.shape == (B,) and lengths.dtype == torch.long
            and transitions.dtype == dtype and start.dtype == dtype and end.dtype == dtype
            and transitions.device == device and start.device == device and end.device == device
            and lengths.device == device and emissions.is_contiguous() and transitions.is_contiguous()
            and start.is_contiguous() and end.is_contiguous() and lengths.is_contiguous()):
        return None
    if given_lengths is not None and B > 0 and not _is_compiling() and not _values_checked_on_device(lengths):
        low, high = _length_range(lengths)
        if low < 0 or high > L:
            return None  # _prepare_lengths raises the message
    return emissions, transitions, lengths, start, end


def _values_checked_on_device(x: Tensor) -> bool:
    """Whether the current backend's kernels for x's device check the values of lengths and
    tags themselves and raise, naming the argument, once they have run (the compiled backend's
    CUDA kernels: VALUES_CHECKED_ON_DEVICE in crfkit/backends/compiled.py). The front end then
    leaves those checks to them: its own would read the values back to the host, which on a GPU
    is a reduction and copies that wait for the device, on every call."""
    checked = getattr(backends.current(), "VALUES_CHECKED_ON_DEVICE", ())
    return bool(checked) and x.device.type in checked  # (x.device costs 0.2 us: asked only if needed)


def _length_range(lengths: Tensor):
    """(min, max) of a non-empty int64 lengths tensor as Python ints. Small CPU batches go
    through a list (about 1 us for B = 32); a reduction and its two scalar reads cost 2.3 us."""
    if lengths.shape[0] <= 64 and lengths.device.type == "cpu":
        values = lengths.tolist()
        return min(values), max(values)
    low, high = torch.aminmax(lengths)
    return int(low), int(high)


def _zeros(shape, dtype, device) -> Tensor:
    if _is_compiling():
        return torch.zeros(shape, dtype=dtype, device=device)
    key = (shape, dtype, device)
    if key not in _ZEROS:
        if len(_ZEROS) > 64:
            _ZEROS.clear()
        _ZEROS[key] = torch.zeros(shape, dtype=dtype, device=device)
    return _ZEROS[key]


def _as_compute(x: Tensor, dtype) -> Tensor:
    if x.dtype != dtype:
        x = x.to(dtype)
    return x if x.is_contiguous() else x.contiguous()


def _prepare_lengths(lengths, B: int, L: int, device) -> Tensor:
    if lengths is None:
        return torch.full((B,), L, dtype=torch.long, device=device)
    _check_tensor("lengths", lengths, 1, "(batch,)")
    if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
        raise TypeError(f"lengths must be an integer tensor, got {lengths.dtype}")
    if lengths.shape[0] != B:
        raise ValueError(f"lengths must have shape ({B},) for a batch of {B}, got {tuple(lengths.shape)}")
    if lengths.device != device:
        raise ValueError(f"lengths is on {lengths.device} but emissions is on {device}; put them on one device")
    # Data-dependent: while compiled, and where the kernels check on the device, they raise instead.
    if not _is_compiling() and not _values_checked_on_device(lengths):
        check_length_values(lengths, L)
    return _as_compute(lengths, torch.long)


def check_length_values(lengths: Tensor, L: int) -> None:
    """Raise ValueError unless every value of lengths (B,) lies in [0, L]. (Reads them on the host.)"""
    if lengths.shape[0] > 0:
        low, high = _length_range(lengths)
        if low < 0 or high > L:
            raise ValueError(f"lengths must lie in [0, seq_len = {L}], got values in [{low}, {high}]")


def log_partition(emissions, transitions, lengths=None, start=None, end=None) -> Tensor:
    """log Z(x) = logsumexp over all tag sequences of their score: (B,).

    Differentiable in emissions, transitions, start and end; the gradient with respect to
    emissions is the marginals, computed by an analytic forward-backward kernel. In the compiled
    backend on the CPU a differentiable call computes those gradients in its forward (the
    backward then only scales them), so evaluation should run under torch.no_grad(); the
    gradient is not differentiable again there (a second derivative raises; the reference
    backend has them).
    """
    return backends.current().log_partition(*_prepare(emissions, transitions, lengths, start, end))


def marginals(emissions, transitions, lengths=None, start=None, end=None) -> Tensor:
    """P(y_i = t | x): (B, L, T), zero at padded positions. Differentiable (second-order
    derivatives of log Z are taken through the reference implementation)."""
    return backends.current().marginals(*_prepare(emissions, transitions, lengths, start, end))


def _marginals_and_transition_counts(emissions, transitions, lengths=None, start=None, end=None):
    """(marginals(...), expected_transition_counts(...)), from one forward-backward where the
    backend can (crfkit.distribution's exact entropy, cross entropy and KL need both)."""
    both = getattr(backends.current(), "marginals_and_transition_counts", None)
    if both is None:
        return (marginals(emissions, transitions, lengths, start, end),
                expected_transition_counts(emissions, transitions, lengths, start, end))
    return both(*_prepare(emissions, transitions, lengths, start, end))


def expected_transition_counts(emissions, transitions, lengths=None, start=None, end=None) -> Tensor:
    """Expected number of s -> t transitions per sentence: (B, T, T), i.e. the pairwise
    marginals P(y_{i-1} = s, y_i = t | x) summed over positions. With marginals() it gives
    every expectation of a score, E_p[s_q(y)], hence exact CRF cross entropy and KL divergence.

    The compiled backend has CPU and CUDA kernels for it (the per-sentence transition gradients
    of the log Z backward); differentiable calls and the other backends run the reference
    (autograd through its log Z), which is slower. Differentiable.
    """
    backend = backends.current()
    implementation = getattr(backend, "expected_transition_counts", backends.reference.expected_transition_counts)
    return implementation(*_prepare(emissions, transitions, lengths, start, end))


def viterbi(emissions, transitions, lengths=None, start=None, end=None):
    """The best tag sequence: (paths (B, L) int64, scores (B,)); paths are -1 at padded
    positions. scores are differentiable (they are the sequence scores of the paths)."""
    return tuple(backends.current().viterbi(*_prepare(emissions, transitions, lengths, start, end)))


def kbest_viterbi(emissions, transitions, k: int, lengths=None, start=None, end=None) -> KBest:
    """The k highest-scoring DISTINCT tag sequences, best first (exact k-best Viterbi).

    Returns KBest(paths (B, k, L) int64, scores (B, k), log_probs (B, k)) with
    log_probs = scores - log_partition. Row 0 equals viterbi(). Rows beyond the number of
    allowed sequences of a sentence have path -1 and score / log_prob -inf; padded positions
    are -1. scores and log_probs are differentiable. Ties: see the module docstring.
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    emissions, transitions, lengths, start, end = _prepare(emissions, transitions, lengths, start, end)
    paths, scores, log_probs = backends.current().kbest_viterbi(emissions, transitions, k, lengths, start, end)
    return KBest(paths, scores, log_probs)


def sequence_score(emissions, transitions, tags, lengths=None, start=None, end=None) -> Tensor:
    """Score s(x, y) of given tag sequences, differentiable.

    tags (B, L) -> (B,), or (B, N, L) -> (B, N) for N sequences per sentence. Tags at real
    positions must lie in [0, T); values at padded positions are ignored (e.g. -100).
    """
    emissions, transitions, lengths, start, end = _prepare(emissions, transitions, lengths, start, end)
    B, L, T = emissions.shape
    if not isinstance(tags, Tensor):
        raise TypeError(f"tags must be a torch.Tensor (batch, seq_len), got {type(tags).__name__}")
    if tags.dtype == torch.bool or tags.is_floating_point() or tags.is_complex():
        raise TypeError(f"tags must be an integer tensor, got {tags.dtype}")
    if tags.device != emissions.device:
        raise ValueError(f"tags is on {tags.device} but emissions is on {emissions.device}")
    squeeze = tags.dim() == 2
    if not (squeeze or tags.dim() == 3) or tags.shape[0] != B or tags.shape[-1] != L:
        raise ValueError(f"tags must have shape ({B}, {L}) or ({B}, N, {L}), got {tuple(tags.shape)}")
    tags3 = (tags.unsqueeze(1) if squeeze else tags).to(torch.long).contiguous()
    if not _is_compiling() and tags3.numel() > 0 and not _values_checked_on_device(tags3):
        valid = torch.arange(L, device=tags.device) < lengths.view(B, 1, 1)
        real = tags3[valid.expand_as(tags3)]
        if real.numel() and (int(real.min()) < 0 or int(real.max()) >= T):
            raise ValueError(f"tags within the lengths must lie in [0, num_tags = {T}), got values in "
                             f"[{int(real.min())}, {int(real.max())}]")
    scores = backends.current().sequence_score(emissions, transitions, tags3, lengths, start, end)
    return scores.squeeze(1) if squeeze else scores


def lengths_from_mask(mask: Tensor) -> Tensor:
    """(B, L) bool mask of real positions -> (B,) int64 lengths. The mask must be left-aligned
    (each row a run of True followed by False): crfkit does not support holes."""
    _check_tensor("mask", mask, 2, "(batch, seq_len)")
    mask = mask.bool()
    lengths = mask.sum(1)
    prefix = torch.arange(mask.shape[1], device=mask.device) < lengths.unsqueeze(1)
    if not _is_compiling() and not torch.equal(prefix, mask):
        raise ValueError("mask must be left-aligned (True for the first lengths[b] positions, then False)")
    return lengths
