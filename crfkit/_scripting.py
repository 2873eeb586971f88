"""The CRF layers under torch.jit.script: what crfkit.CRF and crfkit.compat.pytorch_crf.CRF run
instead of crfkit.functional once TorchScript compiles them (their `torch.jit.is_scripting()`
branches).

crfkit.functional checks its arguments with Python that TorchScript cannot compile (isinstance
on any value, reprlib, a cache of zeros) and picks a backend at each call. A scripted module has
neither: it calls the compiled ops, torch.ops.crfkit.* (schemas in crfkit/backends/op_table.py),
directly, with the arguments checked and converted here by the rules of crfkit._arguments.prepare
(the messages name the argument the same way; shapes print as lists). So a scripted layer always
runs the compiled kernels, whichever backend crfkit.use_backend chose, and scripting needs them
loaded: the layers' __prepare_scriptable__ calls require_compiled_ops(), which raises
RuntimeError saying so where the extension is not available (then use the layer in eager mode,
or torch.export: crfkit/export/pt2.py).

An error raised in scripted code reaches Python as torch.jit.Error (a RuntimeError) whose
message holds the Python class and text, e.g. "builtins.ValueError: lengths must lie in ...".

Shapes (batch first): emissions (B, L, T); transitions (T, T); start, end (T,); lengths (B,);
tags (B, L) or (B, N, L); mask (B, L).
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor



def require_compiled_ops(layer: str) -> None:
    """Raise RuntimeError unless crfkit's compiled extension is loaded (it registers the
    torch.ops.crfkit.* that a scripted layer calls); `layer` names the module being scripted.
    Takes the first op call's build where one is pending (crfkit.backends.current())."""
    from . import backends

    backends.current()
    if "compiled" not in backends.available():
        why = backends.backend_info()["unavailable"].get("compiled", "not loaded")
        raise RuntimeError(
            f"torch.jit.script({layer}) needs crfkit's compiled backend: the scripted module calls the "
            f"compiled ops torch.ops.crfkit.* directly, and they are not available here ({why}). Build them "
            "with `python -m crfkit.build`, or keep the layer in eager mode, or use torch.export "
            "(crfkit.export.pt2) for a deployable graph.")


def _dtype_name(dtype: torch.dtype) -> str:
    # (a torch.dtype is an int inside TorchScript: f"{dtype}" would print a number)
    if dtype == torch.float32:
        return "torch.float32"
    if dtype == torch.float64:
        return "torch.float64"
    if dtype == torch.float16:
        return "torch.float16"
    if dtype == torch.bfloat16:
        return "torch.bfloat16"
    return "a non-floating dtype"


def _is_half(dtype: torch.dtype) -> bool:
    return dtype == torch.float16 or dtype == torch.bfloat16


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for a half type, else dtype (crfkit._arguments.compute_dtype)."""
    return torch.float32 if _is_half(dtype) else dtype


def check_reduction(reduction: str) -> None:
    """crfkit._validation.check_reduction(reduction, CRF_REDUCTIONS) (TorchScript reads no global lists)."""
    if reduction not in ["mean", "sum", "none", "token_mean"]:
        raise ValueError(f"reduction must be one of 'mean', 'sum', 'none', 'token_mean', got '{reduction}'")


def check_no_allowed(allowed: Optional[Tensor]) -> None:
    """`allowed` is eager-only (crfkit._arguments.apply_mask_and_allowed has no TorchScript twin)."""
    if allowed is not None:
        raise ValueError("allowed is not taken under torch.jit.script: apply it as emissions.masked_fill(~allowed, "
                         "float('-inf')) before calling the scripted CRF")


def check_emissions(emissions: Tensor) -> None:
    if emissions.dim() != 3:
        raise ValueError(f"emissions must have 3 dimensions (batch, seq_len, num_tags), got shape {emissions.shape}")


def _parameter(name: str, x: Optional[Tensor], shape: List[int], emissions: Tensor) -> Tensor:
    """transitions / start / end as the ops take them: zeros (T,) for None, else checked and in
    the compute dtype, contiguous."""
    dtype = compute_dtype(emissions.dtype)
    if x is None:
        return torch.zeros(shape, dtype=dtype, device=emissions.device)
    if x.dim() != len(shape) or x.shape != shape:
        raise ValueError(f"{name} must have shape {shape} for num_tags = {shape[0]}, got {x.shape}")
    # Parameters share the emissions' dtype; with half-precision emissions they may also be
    # float32 or either half type (the usual mixed-precision setup).
    if _is_half(emissions.dtype):
        if not (x.dtype == torch.float32 or _is_half(x.dtype)):
            raise TypeError(f"{name} has dtype {_dtype_name(x.dtype)} but emissions has "
                            f"{_dtype_name(emissions.dtype)}; "
                            "expected torch.float32 or torch.float16 or torch.bfloat16")
    elif x.dtype != dtype:
        raise TypeError(f"{name} has dtype {_dtype_name(x.dtype)} but emissions has {_dtype_name(emissions.dtype)}; "
                        f"expected {_dtype_name(dtype)}")
    if x.device != emissions.device:
        raise ValueError(f"{name} is on {x.device} but emissions is on {emissions.device}; put them on one device")
    return x.to(dtype).contiguous()


def prepare_lengths(lengths: Optional[Tensor], B: int, L: int, device: torch.device) -> Tensor:
    """lengths (B,) int64 on device, values in [0, L] (checked on the host except on CUDA, where
    the compiled kernels check them, as in eager mode); all L for None."""
    if lengths is None:
        return torch.full([B], L, dtype=torch.long, device=device)
    if lengths.dim() != 1:
        raise ValueError(f"lengths must have 1 dimensions (batch,), got shape {lengths.shape}")
    if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
        raise TypeError("lengths must be an integer tensor")
    if lengths.shape[0] != B:
        raise ValueError(f"lengths must have shape ({B},) for a batch of {B}, got {lengths.shape}")
    if lengths.device != device:
        raise ValueError(f"lengths is on {lengths.device} but emissions is on {device}; put them on one device")
    if B > 0 and not lengths.is_cuda:
        low, high = int(lengths.min()), int(lengths.max())
        if low < 0 or high > L:
            raise ValueError(f"lengths must lie in [0, seq_len = {L}], got values in [{low}, {high}]")
    return lengths.to(torch.long).contiguous()


def prepare(emissions: Tensor, transitions: Tensor, lengths: Optional[Tensor], start: Optional[Tensor],
            end: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(emissions, transitions, lengths, start, end) checked and converted as
    crfkit._arguments.prepare does: contiguous, in the compute dtype, start / end zeros for None,
    lengths int64. Raises ValueError / TypeError naming the argument."""
    check_emissions(emissions)
    if not emissions.is_floating_point():
        raise TypeError("emissions must be a floating-point tensor")
    B, L, T = emissions.shape[0], emissions.shape[1], emissions.shape[2]
    if T < 1:
        raise ValueError("emissions must have at least one tag (num_tags = emissions.shape[2] >= 1)")
    transitions = _parameter("transitions", transitions, [T, T], emissions)
    start = _parameter("start", start, [T], emissions)
    end = _parameter("end", end, [T], emissions)
    lengths = prepare_lengths(lengths, B, L, emissions.device)
    return emissions.to(compute_dtype(emissions.dtype)).contiguous(), transitions, lengths, start, end


def prepare_tags(tags: Tensor, lengths: Tensor, T: int) -> Tensor:
    """tags (B, L) or (B, N, L) -> (B, N, L) int64 contiguous for prepared lengths (B,); values
    at real positions must lie in [0, T) (checked on the host except on CUDA)."""
    if tags.dtype == torch.bool or tags.is_floating_point() or tags.is_complex():
        raise TypeError("tags must be an integer tensor")
    if tags.device != lengths.device:
        raise ValueError(f"tags is on {tags.device} but emissions is on {lengths.device}")
    tags3 = tags.unsqueeze(1) if tags.dim() == 2 else tags
    tags3 = tags3.to(torch.long).contiguous()
    if not tags3.is_cuda and tags3.numel() > 0:
        B, L = tags3.shape[0], tags3.shape[2]
        valid = torch.arange(L, device=tags3.device) < lengths.view(B, 1, 1)
        real = tags3[valid.expand_as(tags3)]
        if real.numel() > 0:
            low, high = int(real.min()), int(real.max())
            if low < 0 or high >= T:
                raise ValueError(f"tags within the lengths must lie in [0, num_tags = {T}), got values in "
                                 f"[{low}, {high}]")
    return tags3


def check_tags_shape(tags: Tensor, B: int, L: int) -> None:
    if not (tags.dim() == 2 or tags.dim() == 3) or tags.shape[0] != B or tags.shape[-1] != L:
        raise ValueError(f"tags must have shape ({B}, {L}) or ({B}, N, {L}), got {tags.shape}")


def lengths_from_mask(mask: Tensor) -> Tensor:
    """(B, L) mask of real positions (any dtype, nonzero = real) -> (B,) int64 lengths; the mask
    must be left-aligned (crfkit.functional.lengths_from_mask)."""
    if mask.dim() != 2:
        raise ValueError(f"mask must have 2 dimensions (batch, seq_len), got shape {mask.shape}")
    mask = mask.to(torch.bool)
    lengths = mask.sum(1)
    prefix = torch.arange(mask.shape[1], device=mask.device) < lengths.unsqueeze(1)
    if not torch.equal(prefix, mask):
        raise ValueError("mask must be left-aligned (True for the first lengths[b] positions, then False) under "
                         "torch.jit.script; the eager module takes masks with holes")
    return lengths


def log_likelihood_from_scores(scores: Tensor, log_z: Tensor) -> Tensor:
    """log P(y) = s(y) - log Z: scores (B,) or (B, N), log_z (B,); -inf with gradient 0 where
    log Z = -inf (crfkit.reference.log_likelihood_from_scores)."""
    if scores.dim() != 1:
        log_z = log_z.unsqueeze(1)
    return torch.where(log_z == float("-inf"), torch.full_like(scores, float("-inf")), scores - log_z)


def log_probs_from_scores(scores: Tensor, log_z: Tensor) -> Tensor:
    """scores (B, K) - log Z (B,), -inf kept for missing rows (crfkit.reference.log_probs_from_scores)."""
    lowest = -3.4028234663852886e38 if log_z.dtype == torch.float32 else -1.7976931348623157e308
    return scores - log_z.clamp(min=lowest).unsqueeze(1)


def sequence_score(emissions: Tensor, transitions: Tensor, tags: Tensor, lengths: Tensor, start: Tensor,
                   end: Tensor) -> Tensor:
    """Prepared CRF arguments, tags (B, L) -> (B,) or (B, N, L) -> (B, N)."""
    check_tags_shape(tags, emissions.shape[0], emissions.shape[1])
    tags3 = prepare_tags(tags, lengths, emissions.shape[2])
    scores = torch.ops.crfkit.sequence_score(emissions, transitions, tags3, lengths, start, end)
    return scores.squeeze(1) if tags.dim() == 2 else scores


def kbest_viterbi(emissions: Tensor, transitions: Tensor, k: int, lengths: Tensor, start: Tensor,
                  end: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Prepared CRF arguments -> (scores (B, k), paths (B, k, L), log_probs (B, k)), as the
    compiled backend's kbest_viterbi (one op when nothing needs a gradient)."""
    if k < 1:
        raise ValueError(f"k must be a positive int, got {k}")
    needs_grad = torch.is_grad_enabled() and (emissions.requires_grad or transitions.requires_grad
                                              or start.requires_grad or end.requires_grad)
    if not needs_grad:
        scores, paths, log_probs = torch.ops.crfkit.kbest_viterbi_with_log_probs(emissions, transitions, k, lengths,
                                                                                 start, end)
        return scores, paths, log_probs
    scores, paths = torch.ops.crfkit.kbest_viterbi(emissions, transitions, k, lengths, start, end)
    log_z = torch.ops.crfkit.log_partition(emissions, transitions, lengths, start, end)
    return scores, paths, log_probs_from_scores(scores, log_z)
