"""The CRF ops' arguments: checked, then put in the form every backend takes.

crfkit.functional calls prepare() before it hands anything to a backend; the other front ends
(crfkit.distribution, crfkit.nn, crfkit.distill.structured) use the same functions, so that one
mistake gets one message wherever it is made. What a backend receives (crfkit.backends.CRFBackend):

    emissions    (B, L, T)  contiguous, float32 or float64 (the compute dtype)
    transitions  (T, T)     contiguous, compute dtype, on the emissions' device
    lengths      (B,)       contiguous int64, values in [0, L] (see below)
    start, end   (T,)       contiguous, compute dtype; zeros where the caller gave None

Half precision: float16 and bfloat16 emissions are computed in float32 (compute_dtype); their
transitions / start / end may then be float32 or either half type. Otherwise the parameters must
have the emissions' dtype.

Values of lengths and tags: checked here on the host, except on the device types where the
current backend's kernels check them themselves (the backend's VALUES_CHECKED_ON_DEVICE: CUDA with
the compiled backend) and while torch.compile traces (data-dependent checks cannot be traced);
the kernels then raise instead.

This module is internal to the package: its names are public to crfkit's modules, not to users.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import backends
from ._validation import check_int

# Emissions in these dtypes are computed in float32, and the results are float32.
HALF_DTYPES = (torch.float16, torch.bfloat16)
_FULL_PRECISION = (torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the backends compute emissions of `dtype` in: float32 for a half type, else itself."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def is_compiling() -> bool:
    """Whether torch.compile is tracing the call (data-dependent checks are then left to the kernels)."""
    return torch.compiler.is_compiling()


def check_tensor(name: str, x, dim: int, shape_text: str) -> None:
    """Raise TypeError unless x is a Tensor, ValueError unless it has `dim` dimensions; the message
    names the argument and its expected shape, e.g. check_tensor("mask", m, 2, "(batch, seq_len)")."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_text}, got {type(x).__name__}")
    if x.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions {shape_text}, got shape {tuple(x.shape)}")


def prepare(emissions, transitions, lengths, start, end):
    """Validate the CRF arguments and return (emissions, transitions, lengths, start, end) ready
    for a backend: contiguous, in the compute dtype, start / end filled with zeros, lengths int64.
    Raises TypeError / ValueError naming the argument."""
    ready = already_prepared(emissions, transitions, lengths, start, end)
    return ready if ready is not None else prepare_checked(emissions, transitions, lengths, start, end)


def prepare_checked(emissions, transitions, lengths, start, end):
    """prepare() for any arguments: converts what needs converting, raises on what is wrong."""
    check_tensor("emissions", emissions, 3, "(batch, seq_len, num_tags)")
    if not emissions.is_floating_point():
        raise TypeError(f"emissions must be a floating-point tensor, got {emissions.dtype}")
    B, L, T = emissions.shape
    if T < 1:
        raise ValueError("emissions must have at least one tag (num_tags = emissions.shape[2] >= 1)")
    dtype = compute_dtype(emissions.dtype)
    # Parameters share the emissions' dtype; with half-precision emissions they may also be
    # float32 (the usual mixed-precision setup) or the other half type.
    accepted = (torch.float32, *HALF_DTYPES) if emissions.dtype in HALF_DTYPES else (dtype,)
    device = emissions.device

    def parameter(name, x, shape, per_example_shapes=()):
        if x is None:
            return _zeros(shape, dtype, device)
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {shape}, got {type(x).__name__}")
        if tuple(x.shape) != shape and tuple(x.shape) not in per_example_shapes:
            expected = " or ".join(str(s) for s in (shape, *per_example_shapes))
            raise ValueError(f"{name} must have shape {expected} for (batch, seq_len, num_tags) = {(B, L, T)}, "
                             f"got {tuple(x.shape)}")
        if x.dtype not in accepted:
            raise TypeError(
                f"{name} has dtype {x.dtype} but emissions has {emissions.dtype}; "
                f"expected {' or '.join(str(d) for d in accepted)}"
            )
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but emissions is on {device}; put them on one device")
        return _as_compute(x, dtype)

    if transitions is None:
        raise TypeError("transitions is required: a (num_tags, num_tags) tensor")
    transitions = parameter("transitions", transitions, (T, T), ((B, T, T), (B, 1, T, T), (B, L, T, T)))
    start = parameter("start", start, (T,), ((B, T),))
    end = parameter("end", end, (T,), ((B, T),))
    lengths = prepare_lengths(lengths, B, L, device)
    if transitions.dim() > 2 or start.dim() > 1 or end.dim() > 1:
        transitions, start, end = per_example_form(transitions, start, end, B, T)
    return _as_compute(emissions, dtype), transitions, lengths, start, end


def per_example_form(transitions: Tensor, start: Tensor, end: Tensor, B: int, T: int):
    """Per-example parameters as every backend takes them: transitions (B, Lt, T, T) with Lt = 1 (one
    matrix per sentence) or L (one per position), start and end (B, T), contiguous; shared ones
    are expanded (autograd sums their gradients back)."""
    if transitions.dim() == 2:
        transitions = transitions.expand(B, 1, T, T)
    elif transitions.dim() == 3:
        transitions = transitions.unsqueeze(1)
    return (transitions.contiguous(), start.expand(B, T).contiguous(), end.expand(B, T).contiguous())


# The checks above run on every call; at small sizes (B = 1, short sentences) they cost more
# than the kernels, so the no-op conversions are skipped and the default start / end zeros are
# made once per (num_tags, dtype, device). They are never written to or returned.
_ZEROS: dict = {}


def already_prepared(emissions, transitions, lengths, start, end):
    """The arguments as prepare() returns them when they need no conversion and pass every
    check (the usual call: float32 / float64 tensors of the right shapes on one device, dense,
    int64 lengths in range); None otherwise, and prepare_checked then converts them or raises
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
    if given_lengths is not None and B > 0 and not is_compiling() and not values_checked_on_device(lengths):
        low, high = length_range(lengths)
        if low < 0 or high > L:
            return None  # prepare_lengths raises the message
    return emissions, transitions, lengths, start, end


def values_checked_on_device(x: Tensor) -> bool:
    """Whether the current backend's kernels for x's device check the values of lengths and
    tags themselves and raise, naming the argument, once they have run (the compiled backend's
    CUDA kernels: VALUES_CHECKED_ON_DEVICE in crfkit/backends/compiled.py). The front end then
    leaves those checks to them: its own would read the values back to the host, which on a GPU
    is a reduction and copies that wait for the device, on every call."""
    checked = backends.current().VALUES_CHECKED_ON_DEVICE
    return bool(checked) and x.device.type in checked  # (x.device costs 0.2 us: asked only if needed)


def length_range(lengths: Tensor):
    """(min, max) of a non-empty int64 lengths tensor as Python ints. Small CPU batches go
    through a list (about 1 us for B = 32); a reduction and its two scalar reads cost 2.3 us."""
    if lengths.shape[0] <= 64 and lengths.device.type == "cpu":
        values = lengths.tolist()
        return min(values), max(values)
    low, high = torch.aminmax(lengths)
    return int(low), int(high)


def _zeros(shape, dtype, device) -> Tensor:
    if is_compiling():
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


def prepare_lengths(lengths, B: int, L: int, device) -> Tensor:
    """lengths (B,) as int64 on `device`, checked against a batch of B sentences of L positions;
    all L when lengths is None."""
    if lengths is None:
        return torch.full((B,), L, dtype=torch.long, device=device)
    check_tensor("lengths", lengths, 1, "(batch,)")
    if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
        raise TypeError(f"lengths must be an integer tensor, got {lengths.dtype}")
    if lengths.shape[0] != B:
        raise ValueError(f"lengths must have shape ({B},) for a batch of {B}, got {tuple(lengths.shape)}")
    if lengths.device != device:
        raise ValueError(f"lengths is on {lengths.device} but emissions is on {device}; put them on one device")
    # Data-dependent: while compiled, and where the kernels check on the device, they raise instead.
    if not is_compiling() and not values_checked_on_device(lengths):
        check_length_values(lengths, L)
    return _as_compute(lengths, torch.long)


def check_length_values(lengths: Tensor, L: int) -> None:
    """Raise ValueError unless every value of lengths (B,) lies in [0, L]. (Reads them on the host.)"""
    if lengths.shape[0] > 0:
        low, high = length_range(lengths)
        if low < 0 or high > L:
            raise ValueError(f"lengths must lie in [0, seq_len = {L}], got values in [{low}, {high}]")


def prepare_tags(tags, lengths: Tensor, B: int, L: int, T: int, device):
    """Tag sequences for sequence_score, checked against prepared lengths (B,): returns
    (tags (B, N, L) int64 contiguous, whether the caller gave (B, L) and expects (B,) back).
    Tags at real positions must lie in [0, T); those at padded positions are ignored."""
    if not isinstance(tags, Tensor):
        raise TypeError(f"tags must be a torch.Tensor (batch, seq_len), got {type(tags).__name__}")
    if tags.dtype == torch.bool or tags.is_floating_point() or tags.is_complex():
        raise TypeError(f"tags must be an integer tensor, got {tags.dtype}")
    if tags.device != device:
        raise ValueError(f"tags is on {tags.device} but emissions is on {device}")
    one_per_sentence = tags.dim() == 2
    if not (one_per_sentence or tags.dim() == 3) or tags.shape[0] != B or tags.shape[-1] != L:
        raise ValueError(f"tags must have shape ({B}, {L}) or ({B}, N, {L}), got {tuple(tags.shape)}")
    tags3 = (tags.unsqueeze(1) if one_per_sentence else tags).to(torch.long).contiguous()
    if not is_compiling() and tags3.numel() > 0 and not values_checked_on_device(tags3):
        valid = torch.arange(L, device=tags.device) < lengths.view(B, 1, 1)
        real = tags3[valid.expand_as(tags3)]
        if real.numel() and (int(real.min()) < 0 or int(real.max()) >= T):
            raise ValueError(f"tags within the lengths must lie in [0, num_tags = {T}), got values in "
                             f"[{int(real.min())}, {int(real.max())}]")
    return tags3, one_per_sentence


def check_k(k) -> None:
    """k of the k-best ops: an int >= 1 (not a bool)."""
    check_int("k", k, minimum=1)


class Layout(NamedTuple):
    """Where the real positions of a mask with holes went: the ops run on the sentences with their
    real positions moved to the front, in order (the chain joins across masked positions), and
    the position-wise results are moved back. order[b, j]: the original position of compact
    position j; inverse[b, p]: the compact position of original position p (both (B, L) int64)."""

    order: Tensor
    inverse: Tensor

    def to_compact(self, x: Tensor, dim: int = 1) -> Tensor:
        """Gather x's positions (its dimension `dim`, of size L) into the compact order."""
        return _gather_positions(x, self.order, dim)

    def to_original(self, x: Tensor, dim: int = 1) -> Tensor:
        """Move compact results (padding after each sentence's real positions: -1 / 0) back to the
        original positions, so that masked positions hold that padding."""
        return _gather_positions(x, self.inverse, dim)


def _gather_positions(x: Tensor, index: Tensor, dim: int) -> Tensor:
    B, L = index.shape
    shape = [1] * x.dim()
    shape[0], shape[dim] = B, L
    return x.gather(dim, index.view(shape).expand(*x.shape[:dim], L, *x.shape[dim + 1:]))


def apply_mask_and_allowed(emissions, transitions, lengths, mask, allowed):
    """The `mask` and `allowed` arguments of the ops, turned into what the backends take:
    returns (emissions, transitions, lengths, layout).

    mask (B, L) bool (or 0 / 1 integers), instead of lengths: the real positions, anywhere in the
    sentence (holes, left padding, a [CLS] position). A left-aligned mask becomes lengths; any
    other is a Layout: emissions (and per-position transitions (B, L, T, T), whose entry at
    position p scores the transition from the previous real position into p) are gathered into
    the compact order, and layout.to_original puts position-wise results back.
    allowed (B, L, T) bool: the tags each position may take; the others get emission -inf, which is
    exactly the CRF restricted to the allowed tags (gradient 0 there). Every real position must
    allow at least one tag (ValueError otherwise).
    """
    check_tensor("emissions", emissions, 3, "(batch, seq_len, num_tags)")
    if not emissions.is_floating_point():
        raise TypeError(f"emissions must be a floating-point tensor, got {emissions.dtype}")
    B, L, T = emissions.shape
    layout = None
    if mask is not None:
        if lengths is not None:
            raise ValueError("give lengths or mask, not both")
        mask = check_mask(mask, emissions)
        lengths = mask.sum(1)
        prefix = torch.arange(L, device=mask.device) < lengths.unsqueeze(1)
        if is_compiling() or not torch.equal(prefix, mask):
            order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
            layout = Layout(order, torch.argsort(order, dim=1))
    if allowed is not None:
        if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
            raise TypeError(f"allowed must be a bool tensor (batch, seq_len, num_tags), got "
                            f"{allowed.dtype if isinstance(allowed, Tensor) else type(allowed).__name__}")
        if tuple(allowed.shape) != (B, L, T):
            raise ValueError(f"allowed must have shape (batch, seq_len, num_tags) = {(B, L, T)}, "
                             f"got {tuple(allowed.shape)}")
        if allowed.device != emissions.device:
            raise ValueError(f"allowed is on {allowed.device} but emissions is on {emissions.device}")
        if not is_compiling():
            if mask is not None:
                real = mask
            else:
                real = torch.arange(L, device=allowed.device) < prepare_lengths(lengths, B, L, allowed.device)[:, None]
            empty = (real & ~allowed.any(2)).nonzero()
            if len(empty):
                b, i = (int(v) for v in empty[0])
                raise ValueError(f"allowed[{b}, {i}] allows no tag at a real position (every position needs one)")
        emissions = emissions.masked_fill(~allowed, float("-inf"))
    if layout is not None:
        emissions = layout.to_compact(emissions)
        if isinstance(transitions, Tensor) and transitions.dim() == 4 and transitions.shape[1] == L > 1:
            transitions = layout.to_compact(transitions)
    return emissions, transitions, lengths, layout


def check_mask(mask, emissions: Tensor) -> Tensor:
    """mask (B, L) of the real positions of emissions (B, L, T), as bool: bool, or integers 0 / 1
    (pytorch-crf's uint8 masks)."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor (batch, seq_len), got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(emissions.shape[:2]):
        raise ValueError(f"mask must have shape (batch, seq_len) = {tuple(emissions.shape[:2])} of emissions "
                         f"{tuple(emissions.shape)}, got {tuple(mask.shape)}")
    if mask.device != emissions.device:
        raise ValueError(f"mask is on {mask.device} but emissions is on {emissions.device}")
    if mask.dtype != torch.bool:
        if mask.is_floating_point() or mask.is_complex():
            raise TypeError(f"mask must be a bool (or 0 / 1 integer) tensor, got {mask.dtype}")
        if not is_compiling() and mask.numel() and bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("mask must hold only 0 and 1 (or be a bool tensor)")
        mask = mask != 0
    return mask
