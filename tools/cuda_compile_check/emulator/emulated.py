"""The emulated CUDA kernels (build.py) behind crfkit's compiled backend, for tests on a CPU.

    from emulated import load, emulated_kernels
    load()                       # builds if needed, registers torch.ops.crfkit_emu.*
    with emulated_kernels():     # crfkit's compiled backend now calls crfkit_emu (CPU tensors)
        crfkit.log_partition(...)

The fake (meta) implementations are crfkit.backends.op_table's, registered for crfkit_emu. The autograd formulas of the
crfkit ops are registered for crfkit:: only (crfkit/backends/compiled.py), so the crfkit_emu ops
get theirs here: each backward calls the emulated backward kernel
(log_partition_backward_from_marginals, sequence_score_backward); the marginals take
compiled.py's formula.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build as _build  # noqa: E402

_LOADED: Optional[str] = None


def _register_python_side() -> None:
    from crfkit.backends import compiled as c
    from crfkit.backends import op_table

    op_table.register_fakes("crfkit_emu")  # the same shapes as the crfkit ops'
    emu = torch.ops.crfkit_emu

    # log Z: as the compiled backend does where the device has a log_partition_with_marginals kernel
    # (CUDA): the marginals and transition counts come from that op, the backward scales them
    # (log_partition_backward_from_marginals). A custom op's autograd here cannot replace its
    # forward, so the emulated forward runs log Z and then log_partition_with_marginals; the
    # values are the same (the GPU runs the second only).
    def save_marginals(ctx, inputs, output):
        emissions, transitions, lengths, start, end = inputs
        with torch.no_grad():
            _, marginals, counts = emu.log_partition_with_marginals(
                emissions.detach(), transitions.detach(), lengths, start.detach(), end.detach())
        ctx.save_for_backward(lengths, marginals, counts)

    def log_partition_backward(ctx, grad_log_z):
        lengths, marginals, counts = ctx.saved_tensors
        g = emu.log_partition_backward_from_marginals(grad_log_z.contiguous(), marginals, counts, lengths)
        return g[0], g[1], None, g[2], g[3]  # inputs: emissions, transitions, lengths, start, end

    # Decoders and sequence_score: their scores are sums of the scores the paths use. Inputs:
    # viterbi (emissions, transitions, lengths, start, end); kbest_viterbi and sequence_score
    # (emissions, transitions, k or tags, lengths, start, end).
    def save_viterbi_paths(ctx, inputs, output):  # output = (scores, paths)
        ctx.save_for_backward(inputs[0], inputs[2], output[1])
        ctx.mark_non_differentiable(output[1])

    def save_kbest_paths(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[3], output[1])
        ctx.mark_non_differentiable(output[1])

    def save_tags(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[3], inputs[2])

    def path_score_grads(grad_scores, emissions, lengths, tags, undefined):
        g = emu.sequence_score_backward(grad_scores.contiguous(), emissions, tags, lengths)
        return (g[0], g[1], *[None] * undefined, g[2], g[3])

    def viterbi_backward(ctx, grad_scores, grad_paths):
        emissions, lengths, paths = ctx.saved_tensors  # paths (B, L)
        return path_score_grads(grad_scores.unsqueeze(1), emissions, lengths, paths.unsqueeze(1), 1)

    def kbest_backward(ctx, grad_scores, grad_paths):
        emissions, lengths, paths = ctx.saved_tensors  # paths (B, K, L)
        return path_score_grads(grad_scores, emissions, lengths, paths, 2)

    def sequence_score_backward(ctx, grad_scores):
        emissions, lengths, tags = ctx.saved_tensors
        return path_score_grads(grad_scores, emissions, lengths, tags, 2)

    reg = torch.library.register_autograd
    reg("crfkit_emu::log_partition", log_partition_backward, setup_context=save_marginals)
    # The marginals and counts: compiled.py's formulas (its analytic backward kernels where the
    # device has them: compiled.ops is crfkit_emu inside emulated_kernels()).
    reg("crfkit_emu::marginals",
        c._second_derivative("marginals_backward", c.reference.marginals, c._MARGINALS_ONCE),
        setup_context=c._save_crf_inputs)
    reg("crfkit_emu::expected_transition_counts",
        c._second_derivative("expected_transition_counts_backward", c.reference.expected_transition_counts,
                             c._COUNTS_ONCE),
        setup_context=c._save_crf_inputs)
    reg("crfkit_emu::viterbi", viterbi_backward, setup_context=save_viterbi_paths)
    reg("crfkit_emu::kbest_viterbi", kbest_backward, setup_context=save_kbest_paths)
    reg("crfkit_emu::sequence_score", sequence_score_backward, setup_context=save_tags)


def load(sanitize: Optional[str] = None) -> str:
    """Build (incrementally) and load the emulated kernels once per process. sanitize:
    "thread" or "address" (default: $CRFKIT_EMU_SANITIZE); the process must then run with the
    sanitizer's runtime preloaded, e.g. LD_PRELOAD=$(gcc -print-file-name=libtsan.so)."""
    global _LOADED
    sanitize = sanitize or os.environ.get("CRFKIT_EMU_SANITIZE") or None
    if _LOADED is None:
        _LOADED = _build.build(sanitize=sanitize)
        _register_python_side()
        from crfkit.backends import deferred_errors

        deferred_errors.add_library(_LOADED)  # crfkit.deferred_errors / check_errors reach it too
    return _LOADED


@contextlib.contextmanager
def emulated_kernels():
    """Within the block, crfkit's compiled backend runs the emulated CUDA kernels."""
    from crfkit.backends import compiled

    saved_ops, saved_kernels, saved_checked = compiled.ops, dict(compiled._KERNELS), compiled.VALUES_CHECKED_ON_DEVICE
    compiled.ops = torch.ops.crfkit_emu
    # Like the CUDA kernels, the emulated ones check lengths and tags themselves: the front end
    # leaves those checks to them, as it does on a GPU.
    compiled.VALUES_CHECKED_ON_DEVICE = ("cpu",)
    # The emulated tensors are CPU tensors: on "CPU", only the ops that have CUDA kernels exist
    # (the others take compiled.py's fallbacks, as they would on a GPU).
    for name, key in saved_kernels:
        if key == "CPU":
            compiled._KERNELS[(name, key)] = torch._C._dispatch_has_kernel_for_dispatch_key(f"crfkit_emu::{name}",
                                                                                             "CPU")
    try:
        yield torch.ops.crfkit_emu
    finally:
        compiled.ops = saved_ops
        compiled.VALUES_CHECKED_ON_DEVICE = saved_checked
        compiled._KERNELS.clear()
        compiled._KERNELS.update(saved_kernels)
